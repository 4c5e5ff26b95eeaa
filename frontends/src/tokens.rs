//! Token files for training runs: a raw little-endian array of token ids (nanoGPT's
//! `train.bin`: uint16; `--data-dtype u32` for larger vocabularies), or llm.c's `.bin`
//! (a 1024-byte header of int32s: magic 20240520, version (1: uint16 tokens, 2: uint32),
//! token count; then the tokens), recognised by its header.
//!
//! A file that looks like an llm.c file but lacks the magic is refused rather than read as
//! raw tokens (which would train on the header's bytes): the rule is that the file is at
//! least 1024 bytes and either its first int32 is the magic byte-swapped (a big-endian
//! writer), or its second int32 is a version (1 or 2) and its third a token count that,
//! with that version's width and the 1024-byte header, gives exactly the file's size. A
//! raw token file matches that only if its tokens 2..6 happen to spell such a header that
//! also predicts its length to the byte, so raw files are not refused in practice.
//!
//! Only the windows a step uses are read, each with one positioned read (`pread`) of the
//! open file, so a file truncated while a run reads it gives an error naming the file
//! (a memory map would end the process with a bus error instead). A run cuts the file into
//! consecutive windows of `T` tokens (`floor(N / T)` of them); step `s`, global row `r` of a
//! batch of `B` rows reads window `(s * B + r) mod windows` ([`Sampler`]), so one epoch goes
//! through the file in order and the next starts again; with a shuffle seed the windows of
//! each epoch are a permutation drawn from (seed, epoch).

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

/// An open token file.
pub struct TokenFile {
    path: PathBuf,
    file: File,
    /// The file's size in bytes when it was opened.
    size: u64,
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
        // the size of the file opened (not of whatever the path names by now)
        let size64 = f
            .metadata()
            .map_err(|e| file_err(format!("cannot read it: {e}")))?
            .len();
        let size = usize::try_from(size64)
            .map_err(|_| file_err("larger than this machine's address space".into()))?;
        if size == 0 {
            return Err(file_err("the file is empty".into()));
        }
        let mut head = [0u8; LLMC_HEADER];
        let head_len = size.min(LLMC_HEADER);
        read_at(&f, &mut head[..head_len], 0)
            .map_err(|e| file_err(format!("cannot read it: {e}")))?;
        let word = |i: usize| i32::from_le_bytes(head[4 * i..4 * i + 4].try_into().unwrap());
        let width = |version: i32| match version {
            1 => Some(TokenDtype::U16),
            2 => Some(TokenDtype::U32),
            _ => None,
        };
        if size >= LLMC_HEADER && word(0) == LLMC_MAGIC {
            let version = word(1);
            let Some(dtype) = width(version) else {
                return Err(file_err(format!(
                    "an llm.c token file of version {version}; versions 1 (uint16 tokens) and 2 (uint32) are known"
                )));
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
                file: f,
                size: size64,
                start: LLMC_HEADER,
                dtype,
                len: count,
                llmc: true,
            });
        }
        if size >= LLMC_HEADER {
            // an llm.c header with the wrong magic (see the module docs for the rule)
            if word(0) == LLMC_MAGIC.swap_bytes() {
                return Err(file_err(format!(
                    "starts with llm.c's magic {LLMC_MAGIC} byte-swapped (a big-endian file?); llm.c token files are little-endian"
                )));
            }
            let (version, count) = (word(1), word(2));
            if let (Some(d), Ok(n)) = (width(version), usize::try_from(count)) {
                if n.checked_mul(d.bytes())
                    .and_then(|b| b.checked_add(LLMC_HEADER))
                    == Some(size)
                {
                    return Err(file_err(format!(
                        "looks like an llm.c token file (version {version}, {count} tokens of {}, which is the file's size with a 1024-byte header) but its magic number is {} where llm.c writes {LLMC_MAGIC}; fix or rewrite the header (it is not read as raw tokens, which would train on the header)",
                        d.name(),
                        word(0)
                    )));
                }
            }
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
            file: f,
            size: size64,
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
        let width = self.dtype.bytes();
        if first.checked_add(t).is_none_or(|end| end > self.len) {
            return Err(TokenError::File {
                file: self.path.display().to_string(),
                message: format!(
                    "window {w} of {t} tokens is past the end of the file's {} tokens",
                    self.len
                ),
            });
        }
        let mut bytes = vec![0u8; t * width];
        if let Err(e) = read_at(&self.file, &mut bytes, self.offset_of(first) as u64) {
            return Err(self.read_error(e));
        }
        for (k, b) in bytes.chunks_exact(width).enumerate() {
            let id = match self.dtype {
                TokenDtype::U16 => u16::from_le_bytes([b[0], b[1]]) as u32,
                TokenDtype::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            };
            if let Some(v) = vocab {
                if id as usize >= v {
                    let i = first + k;
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

    /// A failed read: a file that shrank since it was opened is named as such.
    fn read_error(&self, e: std::io::Error) -> TokenError {
        let now = self.file.metadata().map(|m| m.len()).ok();
        let message = match now {
            Some(n) if n < self.size => format!(
                "the file shrank from {} to {n} bytes while this run reads it (truncated or rewritten by another program?); the run cannot go on with it",
                self.size
            ),
            _ if e.kind() == std::io::ErrorKind::UnexpectedEof => format!(
                "the file ended early ({} bytes when opened) while this run reads it (truncated or rewritten by another program?)",
                self.size
            ),
            _ => format!("cannot read it: {e}"),
        };
        TokenError::File {
            file: self.path.display().to_string(),
            message,
        }
    }
}

/// Fills `buf` from `file` at byte `offset` (a positioned read: no shared cursor).
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
    }
    #[cfg(windows)]
    {
        let (mut done, mut buf) = (0u64, buf);
        while !buf.is_empty() {
            match std::os::windows::fs::FileExt::seek_read(file, buf, offset + done) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    buf = &mut std::mem::take(&mut buf)[n..];
                    done += n as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
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
    fn a_file_truncated_after_opening_is_an_error_naming_it() {
        let ids: Vec<u16> = (0..100).collect();
        let bytes: Vec<u8> = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
        let p = tmp("shrinks.bin", &bytes);
        let f = TokenFile::open(&p, None).unwrap();
        let mut out = Vec::new();
        f.read_window(9, 10, None, &mut out).unwrap();
        assert_eq!(out, (90..100).collect::<Vec<i64>>());
        // another program cuts the file to 50 tokens while the run holds it open
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(100)
            .unwrap();
        out.clear();
        // a window still inside the file reads; one past the new end is an error
        f.read_window(4, 10, None, &mut out).unwrap();
        assert_eq!(out, (40..50).collect::<Vec<i64>>());
        let e = f
            .read_window(9, 10, None, &mut out)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&p.display().to_string()) && e.contains("shrank from 200 to 100 bytes"),
            "{e}"
        );
        // and a window the file never had is refused, not read
        let e = f
            .read_window(10, 10, None, &mut out)
            .unwrap_err()
            .to_string();
        assert!(e.contains("past the end"), "{e}");
    }

    fn header(magic: i32, version: i32, count: i32) -> Vec<u8> {
        let mut bytes = vec![0u8; LLMC_HEADER];
        bytes[0..4].copy_from_slice(&magic.to_le_bytes());
        bytes[4..8].copy_from_slice(&version.to_le_bytes());
        bytes[8..12].copy_from_slice(&count.to_le_bytes());
        bytes
    }

    #[test]
    fn an_llmc_header_with_a_wrong_magic_is_refused_not_read_as_tokens() {
        // version 1, 6 uint16 tokens, magic off by one
        let mut bytes = header(LLMC_MAGIC + 1, 1, 6);
        bytes.extend(std::iter::repeat_n(7u8, 12));
        let p = tmp("near_miss.bin", &bytes);
        let e = TokenFile::open(&p, None).unwrap_err().to_string();
        assert!(
            e.contains(&p.display().to_string())
                && e.contains("looks like an llm.c token file")
                && e.contains("magic number is 20240521"),
            "{e}"
        );
        // version 2: uint32 tokens
        let mut bytes = header(0, 2, 3);
        bytes.extend(std::iter::repeat_n(1u8, 12));
        let e = TokenFile::open(&tmp("near_miss2.bin", &bytes), Some(TokenDtype::U32))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("version 2, 3 tokens of u32") && e.contains("magic number is 0"),
            "{e}"
        );
        // the magic written big-endian
        let mut bytes = header(LLMC_MAGIC.swap_bytes(), 1, 2);
        bytes.extend([0u8; 4]);
        let e = TokenFile::open(&tmp("big_endian.bin", &bytes), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("byte-swapped"), "{e}");
    }

    #[test]
    fn raw_files_that_only_resemble_a_header_are_raw() {
        // tokens 2, 3 spell version 1, but the count does not predict the size
        let mut bytes = header(5, 1, 6);
        bytes.extend([0u8; 14]);
        let f = TokenFile::open(&tmp("raw_like.bin", &bytes), None).unwrap();
        assert_eq!((f.format(), f.len()), ("raw", (LLMC_HEADER + 14) / 2));
        // a short file is never taken for a header
        let f = TokenFile::open(&tmp("short.bin", &header(0, 1, 0)[..64]), None).unwrap();
        assert_eq!((f.format(), f.len()), ("raw", 32));
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
