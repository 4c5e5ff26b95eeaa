//! Token files for training runs: a raw little-endian array of token ids (nanoGPT's
//! `train.bin`: uint16; `--data-dtype u32` for larger vocabularies), or llm.c's `.bin`
//! (a 1024-byte header of int32s: magic 20240520, version (1: uint16 tokens, 2: uint32),
//! token count; then the tokens), recognised by its header.
//!
//! The file is memory-mapped and only the windows a step uses are read. A run cuts it into
//! consecutive windows of `T` tokens (`floor(N / T)` of them); step `s`, global row `r` of a
//! batch of `B` rows reads window `(s * B + r) mod windows` ([`Sampler`]), so one epoch goes
//! through the file in order and the next starts again; with a shuffle seed the windows of
//! each epoch are a permutation drawn from (seed, epoch).

use memmap2::Mmap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// llm.c's header magic.
pub const LLMC_MAGIC: i32 = 20240520;
/// llm.c's header size in bytes.
pub const LLMC_HEADER: usize = 1024;

/// The width of one token id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    U16,
    U32,
}

impl TokenDtype {
    pub fn parse(s: &str) -> Result<TokenDtype, String> {
        match s {
            "u16" | "uint16" => Ok(TokenDtype::U16),
            "u32" | "uint32" => Ok(TokenDtype::U32),
            other => Err(format!("--data-dtype `{other}`: expected u16 or u32")),
        }
    }
    pub fn bytes(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            TokenDtype::U16 => "u16",
            TokenDtype::U32 => "u32",
        }
    }
}

/// Why a token file cannot be used. Messages name the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("{file}: {message}")]
    File { file: String, message: String },
    #[error(
        "{file}: token {index} (byte offset {offset}) is {id}, not below the model's vocabulary of {vocab}"
    )]
    OutOfVocab {
        file: String,
        index: usize,
        offset: usize,
        id: u32,
        vocab: usize,
    },
}

/// A memory-mapped token file.
pub struct TokenFile {
    path: PathBuf,
    map: Mmap,
    /// Bytes before the first token (llm.c's header, or 0).
    start: usize,
    dtype: TokenDtype,
    len: usize,
    llmc: bool,
}

impl std::fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenFile")
            .field("path", &self.path)
            .field("dtype", &self.dtype)
            .field("len", &self.len)
            .field("llmc", &self.llmc)
            .finish()
    }
}

impl TokenFile {
    /// Opens `path`: llm.c's format when the file starts with its magic, else raw tokens of
    /// `raw_dtype` (default u16). The file must be a regular file.
    pub fn open(path: &Path, raw_dtype: Option<TokenDtype>) -> Result<TokenFile, TokenError> {
        let file_err = |message: String| TokenError::File {
            file: path.display().to_string(),
            message,
        };
        let meta = std::fs::metadata(path).map_err(|e| file_err(format!("cannot read it: {e}")))?;
        if !meta.is_file() {
            return Err(file_err(
                "not a regular file (token data must be a file that can be memory-mapped)".into(),
            ));
        }
        let f = File::open(path).map_err(|e| file_err(format!("cannot open it: {e}")))?;
        let size = usize::try_from(meta.len())
            .map_err(|_| file_err("larger than this machine's address space".into()))?;
        if size == 0 {
            return Err(file_err("the file is empty".into()));
        }
        // SAFETY: the map is read-only; a file changed by another process while we run
        // could give other token ids, never memory unsafety in this process's own data.
        let map = unsafe { Mmap::map(&f) }.map_err(|e| file_err(format!("cannot map it: {e}")))?;
        let word = |i: usize| i32::from_le_bytes(map[4 * i..4 * i + 4].try_into().unwrap());
        if size >= LLMC_HEADER && word(0) == LLMC_MAGIC {
            let version = word(1);
            let dtype = match version {
                1 => TokenDtype::U16,
                2 => TokenDtype::U32,
                v => {
                    return Err(file_err(format!(
                        "an llm.c token file of version {v}; versions 1 (uint16 tokens) and 2 (uint32) are known"
                    )))
                }
            };
            if let Some(d) = raw_dtype {
                if d != dtype {
                    return Err(file_err(format!(
                        "--data-dtype {} given, but the llm.c header (version {version}) says {}",
                        d.name(),
                        dtype.name()
                    )));
                }
            }
            let count = usize::try_from(word(2)).map_err(|_| {
                file_err(format!(
                    "the llm.c header's token count {} is negative",
                    word(2)
                ))
            })?;
            let need = count
                .checked_mul(dtype.bytes())
                .and_then(|b| b.checked_add(LLMC_HEADER));
            if need != Some(size) {
                return Err(file_err(format!(
                    "the llm.c header says {count} tokens ({} bytes with the header), but the file has {size} bytes",
                    need.map_or("too many".into(), |n| n.to_string())
                )));
            }
            return Ok(TokenFile {
                path: path.to_path_buf(),
                map,
                start: LLMC_HEADER,
                dtype,
                len: count,
                llmc: true,
            });
        }
        let dtype = raw_dtype.unwrap_or(TokenDtype::U16);
        if !size.is_multiple_of(dtype.bytes()) {
            return Err(file_err(format!(
                "{size} bytes is not a whole number of {} tokens ({} bytes each); pass --data-dtype if the tokens are another width",
                dtype.name(),
                dtype.bytes()
            )));
        }
        Ok(TokenFile {
            path: path.to_path_buf(),
            map,
            start: 0,
            dtype,
            len: size / dtype.bytes(),
            llmc: false,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }
    /// "llm.c" or "raw".
    pub fn format(&self) -> &'static str {
        if self.llmc {
            "llm.c"
        } else {
            "raw"
        }
    }

    /// Token `i`.
    pub fn token(&self, i: usize) -> u32 {
        let at = self.start + i * self.dtype.bytes();
        match self.dtype {
            TokenDtype::U16 => u16::from_le_bytes([self.map[at], self.map[at + 1]]) as u32,
            TokenDtype::U32 => u32::from_le_bytes(self.map[at..at + 4].try_into().unwrap()),
        }
    }

    /// Byte offset of token `i` in the file.
    pub fn offset_of(&self, i: usize) -> usize {
        self.start + i * self.dtype.bytes()
    }

    /// Number of whole windows of `t` tokens.
    pub fn windows(&self, t: usize) -> usize {
        self.len.checked_div(t).unwrap_or(0)
    }

    /// Appends window `w` (tokens `w*t .. (w+1)*t`) to `out`, checking every id against
    /// `vocab` (when known).
    pub fn read_window(
        &self,
        w: usize,
        t: usize,
        vocab: Option<usize>,
        out: &mut Vec<i64>,
    ) -> Result<(), TokenError> {
        let first = w * t;
        for i in first..first + t {
            let id = self.token(i);
            if let Some(v) = vocab {
                if id as usize >= v {
                    return Err(TokenError::OutOfVocab {
                        file: self.path.display().to_string(),
                        index: i,
                        offset: self.offset_of(i),
                        id,
                        vocab: v,
                    });
                }
            }
            out.push(id as i64);
        }
        Ok(())
    }
}

/// Which window each sample reads: sample `k` (step `s`, row `r` of a batch of `B`:
/// `k = s*B + r`) is window `k mod windows` of epoch `k / windows`, in file order, or
/// through that epoch's permutation when shuffling.
#[derive(Clone, Debug)]
pub struct Sampler {
    windows: usize,
    seed: Option<u64>,
    /// The permutation of the epoch last asked for.
    perm: Option<(usize, Vec<u32>)>,
}

impl Sampler {
    pub fn new(windows: usize, seed: Option<u64>) -> Sampler {
        Sampler {
            windows,
            seed,
            perm: None,
        }
    }

    pub fn windows(&self) -> usize {
        self.windows
    }

    /// The window of sample `k`.
    pub fn window(&mut self, k: u64) -> usize {
        let n = self.windows as u64;
        let (epoch, pos) = ((k / n) as usize, (k % n) as usize);
        let Some(seed) = self.seed else {
            return pos;
        };
        if self.perm.as_ref().map(|(e, _)| *e) != Some(epoch) {
            self.perm = Some((epoch, permutation(self.windows, seed, epoch as u64)));
        }
        self.perm.as_ref().map_or(pos, |(_, p)| p[pos] as usize)
    }
}

/// splitmix64: a small, well-mixed generator whose stream depends only on its seed.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The permutation of `0..n` for (seed, epoch): Fisher-Yates with splitmix64, unbiased
/// bounded draws by rejection.
fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<u32> {
    let mut p: Vec<u32> = (0..n as u32).collect();
    let mut st = seed ^ epoch.wrapping_mul(0xD1B5_4A32_D192_ED03);
    for i in (1..n).rev() {
        let bound = (i + 1) as u64;
        let zone = u64::MAX - u64::MAX % bound;
        let j = loop {
            let x = splitmix64(&mut st);
            if x < zone {
                break (x % bound) as usize;
            }
        };
        p.swap(i, j);
    }
    p
}

/// Writes `bytes` of text as byte-level tokens (vocabulary 256): one little-endian u16 per
/// byte, nanoGPT's raw format.
pub fn byte_tokens(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.extend_from_slice(&(b as u16).to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str, bytes: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("hzp-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn raw_u16_windows_in_file_order() {
        let ids: Vec<u16> = (0..10).collect();
        let bytes: Vec<u8> = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
        let f = TokenFile::open(&tmp("raw.bin", &bytes), None).unwrap();
        assert_eq!((f.len(), f.format(), f.windows(3)), (10, "raw", 3));
        let mut out = Vec::new();
        f.read_window(2, 3, Some(256), &mut out).unwrap();
        assert_eq!(out, vec![6, 7, 8]);
        let mut s = Sampler::new(3, None);
        let got: Vec<usize> = (0..7).map(|k| s.window(k)).collect();
        assert_eq!(got, vec![0, 1, 2, 0, 1, 2, 0]);
    }

    #[test]
    fn llmc_header_is_recognised_and_checked() {
        let mut bytes = vec![0u8; LLMC_HEADER];
        bytes[0..4].copy_from_slice(&LLMC_MAGIC.to_le_bytes());
        bytes[4..8].copy_from_slice(&1i32.to_le_bytes());
        bytes[8..12].copy_from_slice(&4i32.to_le_bytes());
        for id in [5u16, 6, 7, 300] {
            bytes.extend_from_slice(&id.to_le_bytes());
        }
        let f = TokenFile::open(&tmp("llmc.bin", &bytes), None).unwrap();
        assert_eq!((f.len(), f.format()), (4, "llm.c"));
        let mut out = Vec::new();
        let e = f.read_window(1, 2, Some(256), &mut out).unwrap_err();
        assert_eq!(
            e,
            TokenError::OutOfVocab {
                file: f.path().display().to_string(),
                index: 3,
                offset: LLMC_HEADER + 6,
                id: 300,
                vocab: 256
            }
        );
        // a header whose count disagrees with the file
        bytes[8..12].copy_from_slice(&5i32.to_le_bytes());
        let e = TokenFile::open(&tmp("llmc_bad.bin", &bytes), None).unwrap_err();
        assert!(e.to_string().contains("says 5 tokens"), "{e}");
    }

    #[test]
    fn odd_sizes_and_non_files_are_refused() {
        let e = TokenFile::open(&tmp("odd.bin", &[1, 2, 3]), None).unwrap_err();
        assert!(e.to_string().contains("not a whole number"), "{e}");
        let dir = std::env::temp_dir();
        let e = TokenFile::open(&dir, None).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }

    #[test]
    fn shuffled_epochs_are_permutations_that_differ() {
        let mut s = Sampler::new(50, Some(7));
        let e0: Vec<usize> = (0..50).map(|k| s.window(k)).collect();
        let e1: Vec<usize> = (50..100).map(|k| s.window(k)).collect();
        let mut sorted = e0.clone();
        sorted.sort();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert_ne!(e0, e1);
        assert_ne!(e0, (0..50).collect::<Vec<_>>());
        // the same seed gives the same order
        let mut t = Sampler::new(50, Some(7));
        assert_eq!((0..50).map(|k| t.window(k)).collect::<Vec<_>>(), e0);
    }
}
