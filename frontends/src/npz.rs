//! `.npz` archives: numpy's zip of `.npy` arrays, for inputs, outputs and weights.
//!
//! Reading accepts what `numpy.savez` and `numpy.savez_compressed` write (entries stored or
//! deflated, `.npy` format versions 1.0, 2.0 and 3.0, C order) and also a bare `.npy` file,
//! whose one array is named after the file's stem. Keys are the entry names without their
//! `.npy` suffix, in archive order.
//!
//! Element types map onto [`hzp_ir::DType`] as follows (either byte order):
//!
//! | numpy           | hzp    | note                                                      |
//! |-----------------|--------|-----------------------------------------------------------|
//! | `f4`            | `f32`  |                                                           |
//! | `f8`            | `f32`  | **rounded**: numpy's default float is f64, PyTorch's f32  |
//! | `f2`            | `f16`  |                                                           |
//! | `i8`            | `i64`  |                                                           |
//! | `i4`            | `i32`  |                                                           |
//! | `i2`, `i1`, `u2`, `u1` | `i32` | widened, exact                                      |
//! | `u4`            | `i64`  | widened, exact                                            |
//! | `b1`            | `bool` | any non-zero byte is true                                 |
//!
//! `f8 -> f32` is the one conversion that can change values. Anything else (complex,
//! `u8`, strings, objects, structured dtypes, Fortran order) is an error that names the
//! file, the entry and the dtype.
//!
//! Writing produces what `numpy.load` reads: stored (uncompressed) entries named
//! `<key>.npy`, `.npy` version 1.0 with the header padded so the data starts on a 64-byte
//! boundary, as numpy does (version 2.0 only when a header outgrows 64 KiB). `bf16` has no
//! numpy dtype and is written as `<f4` (exact: every bf16 is an f32). The archive goes to a
//! temporary file beside the target and is renamed over it at the end, so a failure never
//! leaves a half-written file at the user's path.

use half::{bf16, f16};
use hzp_ir::{DType, Data, Tensor};
use std::collections::HashSet;
use std::fmt;
use std::io::{self, BufReader, Read, Seek, Write};
use std::path::Path;

/// A problem with an `.npz`/`.npy` file; names the file and, where it applies, the entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NpzError {
    /// The file as the user named it.
    pub file: String,
    /// The array (key) the problem is about, if any.
    pub entry: Option<String>,
    pub message: String,
}

impl fmt::Display for NpzError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.entry {
            Some(e) => write!(f, "{}: array `{e}`: {}", self.file, self.message),
            None => write!(f, "{}: {}", self.file, self.message),
        }
    }
}

impl std::error::Error for NpzError {}

fn file_err(file: &str, message: impl Into<String>) -> NpzError {
    NpzError {
        file: file.to_string(),
        entry: None,
        message: message.into(),
    }
}

fn entry_err(file: &str, entry: &str, message: impl Into<String>) -> NpzError {
    NpzError {
        file: file.to_string(),
        entry: Some(entry.to_string()),
        message: message.into(),
    }
}

const NPY_MAGIC: &[u8; 6] = b"\x93NUMPY";
const ZIP_MAGIC: &[u8; 2] = b"PK";

/// Reads every array of an `.npz` archive (or the one array of a `.npy` file).
pub fn read(path: &Path) -> Result<Vec<(String, Tensor)>, NpzError> {
    let name = path.display().to_string();
    let io_err = |e: io::Error| file_err(&name, format!("cannot read: {e}"));
    let mut f = crate::limits::open_regular(path).map_err(io_err)?;
    let mut magic = [0u8; 6];
    let n = read_up_to(&mut f, &mut magic).map_err(io_err)?;
    f.rewind().map_err(io_err)?;
    if magic[..n].starts_with(NPY_MAGIC) {
        let len = f.metadata().map_err(io_err)?.len();
        crate::limits::check_budget("the array", len).map_err(|m| file_err(&name, m))?;
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes).map_err(io_err)?;
        let key = npy_key(path);
        let t = parse_npy(&bytes).map_err(|m| entry_err(&name, &key, m))?;
        return Ok(vec![(key, t)]);
    }
    check_zip_magic(&magic[..n], &name)?;
    read_zip(BufReader::new(f), &name)
}

/// The key and shape of every array of an `.npz` archive (or of the one array of a `.npy`
/// file), from the array headers alone: no array data is read, decompressed past its
/// header, or allocated, whatever sizes the headers declare (`hzp show --inputs` needs
/// only shapes).
pub fn read_shapes(path: &Path) -> Result<Vec<(String, Vec<usize>)>, NpzError> {
    let name = path.display().to_string();
    let io_err = |e: io::Error| file_err(&name, format!("cannot read: {e}"));
    let mut f = crate::limits::open_regular(path).map_err(io_err)?;
    let mut magic = [0u8; 6];
    let n = read_up_to(&mut f, &mut magic).map_err(io_err)?;
    f.rewind().map_err(io_err)?;
    if magic[..n].starts_with(NPY_MAGIC) {
        let key = npy_key(path);
        let shape = npy_shape(&mut f).map_err(|m| entry_err(&name, &key, m))?;
        return Ok(vec![(key, shape)]);
    }
    check_zip_magic(&magic[..n], &name)?;
    let mut zip = zip::ZipArchive::new(BufReader::new(f))
        .map_err(|e| file_err(&name, format!("not a readable .npz archive (zip): {e}")))?;
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for i in 0..zip.len() {
        let mut entry = zip
            .by_index(i)
            .map_err(|e| file_err(&name, format!("entry {i} of the archive: {e}")))?;
        if entry.is_dir() {
            continue;
        }
        let raw_name = entry.name().to_string();
        let Some(key) = raw_name.strip_suffix(".npy").map(str::to_string) else {
            return Err(entry_err(
                &name,
                &raw_name,
                "is not an .npy array (its name does not end in .npy)",
            ));
        };
        let shape = npy_shape(&mut entry).map_err(|m| entry_err(&name, &key, m))?;
        if !seen.insert(key.clone()) {
            return Err(entry_err(&name, &key, "appears twice in the archive"));
        }
        out.push((key, shape));
    }
    Ok(out)
}

/// The largest `.npy` header [`read_shapes`] reads (numpy writes a few hundred bytes).
const MAX_NPY_HEADER: usize = 1 << 20;

/// The shape in the header of the `.npy` array `r` starts with (read no further).
fn npy_shape(r: &mut impl Read) -> Result<Vec<usize>, String> {
    let mut pre = [0u8; 12];
    let n = read_up_to(r, &mut pre[..10]).map_err(|e| format!("cannot read: {e}"))?;
    if n < 8 || &pre[..6] != NPY_MAGIC {
        return Err("not an .npy array (it does not start with \\x93NUMPY)".into());
    }
    let (major, minor) = (pre[6], pre[7]);
    let hlen = match major {
        1 if n == 10 => u16::from_le_bytes([pre[8], pre[9]]) as usize,
        2 | 3 if n == 10 => {
            if read_up_to(r, &mut pre[10..12]).map_err(|e| format!("cannot read: {e}"))? != 2 {
                return Err("truncated .npy header".into());
            }
            u32::from_le_bytes([pre[8], pre[9], pre[10], pre[11]]) as usize
        }
        1..=3 => return Err("truncated .npy header".into()),
        _ => {
            return Err(format!(
                ".npy format version {major}.{minor} is not supported (1.0, 2.0 and 3.0 are)"
            ))
        }
    };
    if hlen > MAX_NPY_HEADER {
        return Err(format!(
            "the .npy header says it is {hlen} bytes long, more than the {MAX_NPY_HEADER} hzp reads"
        ));
    }
    let mut header = vec![0u8; hlen];
    if read_up_to(r, &mut header).map_err(|e| format!("cannot read: {e}"))? != hlen {
        return Err("truncated .npy header".into());
    }
    if major < 3 && !header.is_ascii() {
        return Err("bad .npy header: non-ASCII bytes in a version 1/2 header".into());
    }
    Ok(parse_header(&header)?.shape)
}

/// Like [`read`], from bytes already in memory; `display_name` names them in errors.
pub fn read_bytes(bytes: &[u8], display_name: &str) -> Result<Vec<(String, Tensor)>, NpzError> {
    if bytes.starts_with(NPY_MAGIC) {
        let key = npy_key(Path::new(display_name));
        let t = parse_npy(bytes).map_err(|m| entry_err(display_name, &key, m))?;
        return Ok(vec![(key, t)]);
    }
    check_zip_magic(bytes, display_name)?;
    read_zip(io::Cursor::new(bytes), display_name)
}

/// The key of a bare `.npy` file: its file name without `.npy`.
fn npy_key(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    match name.strip_suffix(".npy") {
        Some(s) if !s.is_empty() => s.to_string(),
        _ if name.is_empty() => "arr_0".to_string(),
        _ => name,
    }
}

fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn check_zip_magic(head: &[u8], file: &str) -> Result<(), NpzError> {
    if head.len() < 2 || &head[..2] != ZIP_MAGIC {
        return Err(file_err(
            file,
            if head.is_empty() {
                "the file is empty, not an .npz archive".to_string()
            } else {
                "not an .npz archive (a zip file) nor an .npy array".to_string()
            },
        ));
    }
    Ok(())
}

fn read_zip<R: Read + Seek>(mut reader: R, file: &str) -> Result<Vec<(String, Tensor)>, NpzError> {
    // Bounds how much memory an entry's claimed size may reserve up front.
    let archive_len = reader
        .seek(io::SeekFrom::End(0))
        .and_then(|n| reader.rewind().map(|_| n))
        .map_err(|e| file_err(file, format!("cannot read: {e}")))?;
    let mut zip = zip::ZipArchive::new(reader)
        .map_err(|e| file_err(file, format!("not a readable .npz archive (zip): {e}")))?;
    let mut out: Vec<(String, Tensor)> = Vec::with_capacity(zip.len().min(1 << 16));
    let mut seen = HashSet::new();
    // The arrays of one file together must fit the memory budget; each entry's declared
    // size is checked before it is read, and reading stops where the declaration ends.
    let budget = crate::limits::max_memory();
    let mut total: u64 = 0;
    for i in 0..zip.len() {
        let mut entry = zip
            .by_index(i)
            .map_err(|e| file_err(file, format!("entry {i} of the archive: {e}")))?;
        if entry.is_dir() {
            continue;
        }
        let raw_name = entry.name().to_string();
        let key = match raw_name.strip_suffix(".npy") {
            Some(k) => k.to_string(),
            None => {
                return Err(entry_err(
                    file,
                    &raw_name,
                    "is not an .npy array (its name does not end in .npy)",
                ))
            }
        };
        // Deflate expands at most ~1032x; a stored entry is no larger than the archive.
        let bound = match entry.compression() {
            zip::CompressionMethod::Stored => archive_len,
            _ => archive_len.saturating_mul(1032),
        };
        let declared = entry.size();
        total = total.saturating_add(declared);
        if total > budget {
            return Err(entry_err(
                file,
                &key,
                crate::limits::check_budget(
                    &format!(
                        "with the arrays before it, the archive ({} declared for this one)",
                        crate::limits::fmt_bytes(declared)
                    ),
                    total,
                )
                .err()
                .unwrap_or_default(),
            ));
        }
        let mut bytes = Vec::new();
        let _ = bytes.try_reserve(declared.min(bound).min(1 << 40) as usize);
        (&mut entry)
            .take(declared.saturating_add(1))
            .read_to_end(&mut bytes)
            .map_err(|e| entry_err(file, &key, format!("cannot read the entry: {e}")))?;
        if bytes.len() as u64 != declared {
            return Err(entry_err(
                file,
                &key,
                format!(
                    "the archive declares {declared} bytes for this entry but it holds {}{}",
                    if bytes.len() as u64 > declared {
                        "more"
                    } else {
                        ""
                    },
                    if bytes.len() as u64 > declared {
                        String::new()
                    } else {
                        format!(" {}", bytes.len())
                    }
                ),
            ));
        }
        drop(entry);
        let t = parse_npy(&bytes).map_err(|m| entry_err(file, &key, m))?;
        if !seen.insert(key.clone()) {
            return Err(entry_err(file, &key, "appears twice in the archive"));
        }
        out.push((key, t));
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// .npy parsing
// ---------------------------------------------------------------------------------------

/// Element kinds an `.npy` file can hold that hzp reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NpyKind {
    F8,
    F4,
    F2,
    I8,
    I4,
    I2,
    I1,
    U4,
    U2,
    U1,
    B1,
}

impl NpyKind {
    fn size(self) -> usize {
        match self {
            NpyKind::F8 | NpyKind::I8 => 8,
            NpyKind::F4 | NpyKind::I4 | NpyKind::U4 => 4,
            NpyKind::F2 | NpyKind::I2 | NpyKind::U2 => 2,
            NpyKind::I1 | NpyKind::U1 | NpyKind::B1 => 1,
        }
    }
}

const SUPPORTED: &str = "f4, f8 (read as f32), f2, i8, i4, i2, i1, u4, u2, u1, b1";

/// Parses a numpy dtype string such as `<f4`; returns the kind and whether it is big-endian.
fn parse_descr(descr: &str) -> Result<(NpyKind, bool), String> {
    let (order, code) = match descr.chars().next() {
        Some(c @ ('<' | '>' | '|' | '=')) => (c, &descr[1..]),
        _ => ('=', descr),
    };
    let kind = match code {
        "f8" => NpyKind::F8,
        "f4" => NpyKind::F4,
        "f2" | "e" => NpyKind::F2,
        "i8" => NpyKind::I8,
        "i4" => NpyKind::I4,
        "i2" => NpyKind::I2,
        "i1" | "b" => NpyKind::I1,
        "u4" => NpyKind::U4,
        "u2" => NpyKind::U2,
        "u1" | "B" => NpyKind::U1,
        "b1" | "?" => NpyKind::B1,
        _ => {
            return Err(format!(
                "unsupported dtype `{descr}` (supported: {SUPPORTED})"
            ))
        }
    };
    Ok((kind, order == '>' && kind.size() > 1))
}

/// A value of the Python literal that an `.npy` header is.
#[derive(Clone, Debug, PartialEq)]
enum PyLit {
    Str(String),
    Int(u64),
    Bool(bool),
    None,
    Tuple(Vec<PyLit>),
    List(Vec<PyLit>),
    Dict(Vec<(PyLit, PyLit)>),
}

/// A tiny recursive-descent parser for the Python literal in an `.npy` header.
struct LitParser<'a> {
    s: &'a [u8],
    i: usize,
}

const MAX_LIT_DEPTH: usize = 32;

impl LitParser<'_> {
    fn skip_ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.s.get(self.i).copied()
    }

    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.peek() == Some(c) {
            self.i += 1;
            Ok(())
        } else {
            Err(format!("expected `{}` at byte {}", c as char, self.i))
        }
    }

    fn value(&mut self, depth: usize) -> Result<PyLit, String> {
        if depth > MAX_LIT_DEPTH {
            return Err("nested too deeply".into());
        }
        match self.peek() {
            Some(q @ (b'\'' | b'"')) => {
                self.i += 1;
                let start = self.i;
                while self.i < self.s.len() && self.s[self.i] != q {
                    if self.s[self.i] == b'\\' {
                        return Err("escapes in strings are not supported".into());
                    }
                    self.i += 1;
                }
                if self.i >= self.s.len() {
                    return Err("unterminated string".into());
                }
                let text = String::from_utf8_lossy(&self.s[start..self.i]).into_owned();
                self.i += 1;
                Ok(PyLit::Str(text))
            }
            Some(b'(') => {
                self.i += 1;
                Ok(PyLit::Tuple(self.seq(b')', depth)?))
            }
            Some(b'[') => {
                self.i += 1;
                Ok(PyLit::List(self.seq(b']', depth)?))
            }
            Some(b'{') => {
                self.i += 1;
                let mut items = Vec::new();
                loop {
                    if self.peek() == Some(b'}') {
                        self.i += 1;
                        break;
                    }
                    let k = self.value(depth + 1)?;
                    self.expect(b':')?;
                    let v = self.value(depth + 1)?;
                    items.push((k, v));
                    match self.peek() {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {}
                        _ => return Err(format!("expected `,` or `}}` at byte {}", self.i)),
                    }
                }
                Ok(PyLit::Dict(items))
            }
            Some(c) if c.is_ascii_digit() => {
                let start = self.i;
                while self.i < self.s.len() && self.s[self.i].is_ascii_digit() {
                    self.i += 1;
                }
                // Python 2 wrote longs as `3L`.
                let digits = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
                if self.i < self.s.len() && self.s[self.i] == b'L' {
                    self.i += 1;
                }
                digits
                    .parse::<u64>()
                    .map(PyLit::Int)
                    .map_err(|_| format!("number `{digits}` is too large"))
            }
            Some(c) if c.is_ascii_alphabetic() => {
                let start = self.i;
                while self.i < self.s.len() && self.s[self.i].is_ascii_alphanumeric() {
                    self.i += 1;
                }
                match &self.s[start..self.i] {
                    b"True" => Ok(PyLit::Bool(true)),
                    b"False" => Ok(PyLit::Bool(false)),
                    b"None" => Ok(PyLit::None),
                    w => Err(format!("unexpected word `{}`", String::from_utf8_lossy(w))),
                }
            }
            Some(c) => Err(format!("unexpected `{}` at byte {}", c as char, self.i)),
            None => Err("the header ends early".into()),
        }
    }

    fn seq(&mut self, close: u8, depth: usize) -> Result<Vec<PyLit>, String> {
        let mut items = Vec::new();
        loop {
            if self.peek() == Some(close) {
                self.i += 1;
                return Ok(items);
            }
            items.push(self.value(depth + 1)?);
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(c) if c == close => {}
                _ => {
                    return Err(format!(
                        "expected `,` or `{}` at byte {}",
                        close as char, self.i
                    ))
                }
            }
        }
    }
}

/// What an `.npy` header says.
struct NpyHeader {
    descr: String,
    kind: NpyKind,
    big_endian: bool,
    shape: Vec<usize>,
}

fn parse_header(text: &[u8]) -> Result<NpyHeader, String> {
    let bad = |why: String| format!("bad .npy header: {why}");
    let mut p = LitParser { s: text, i: 0 };
    let lit = p.value(0).map_err(bad)?;
    if p.peek().is_some() {
        return Err(bad(format!(
            "unexpected text after the header dict at byte {}",
            p.i
        )));
    }
    let PyLit::Dict(items) = lit else {
        return Err(bad("it is not a dict".into()));
    };
    let get = |key: &str| {
        items
            .iter()
            .find(|(k, _)| matches!(k, PyLit::Str(s) if s == key))
            .map(|(_, v)| v)
            .ok_or_else(|| bad(format!("it has no `{key}`")))
    };
    let descr = match get("descr")? {
        PyLit::Str(s) => s.clone(),
        PyLit::List(_) => {
            return Err("structured (record) arrays are not supported; save plain arrays".into())
        }
        other => return Err(bad(format!("`descr` is {other:?}, not a dtype string"))),
    };
    match get("fortran_order")? {
        PyLit::Bool(false) => {}
        PyLit::Bool(true) => {
            return Err(
                "the array is in Fortran order, which is not supported; save it with \
                 numpy.ascontiguousarray(a) first"
                    .into(),
            )
        }
        other => return Err(bad(format!("`fortran_order` is {other:?}, not True/False"))),
    }
    let shape = match get("shape")? {
        PyLit::Tuple(dims) => dims
            .iter()
            .map(|d| match d {
                PyLit::Int(n) => {
                    usize::try_from(*n).map_err(|_| bad(format!("dimension {n} is too large")))
                }
                other => Err(bad(format!("shape holds {other:?}, not a size"))),
            })
            .collect::<Result<Vec<_>, _>>()?,
        other => return Err(bad(format!("`shape` is {other:?}, not a tuple"))),
    };
    let (kind, big_endian) = parse_descr(&descr)?;
    Ok(NpyHeader {
        descr,
        kind,
        big_endian,
        shape,
    })
}

fn fmt_shape(s: &[usize]) -> String {
    format!(
        "[{}]",
        s.iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(",")
    )
}

/// Parses one `.npy` array. Errors are messages without the file/entry (callers add them).
fn parse_npy(b: &[u8]) -> Result<Tensor, String> {
    if b.len() < 8 || &b[..6] != NPY_MAGIC {
        return Err("not an .npy array (it does not start with \\x93NUMPY)".into());
    }
    let (major, minor) = (b[6], b[7]);
    let (hlen, start): (usize, usize) = match major {
        1 => {
            if b.len() < 10 {
                return Err("truncated .npy header".into());
            }
            (u16::from_le_bytes([b[8], b[9]]) as usize, 10)
        }
        2 | 3 => {
            if b.len() < 12 {
                return Err("truncated .npy header".into());
            }
            (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12)
        }
        _ => {
            return Err(format!(
                ".npy format version {major}.{minor} is not supported (1.0, 2.0 and 3.0 are)"
            ))
        }
    };
    let end = start
        .checked_add(hlen)
        .filter(|&e| e <= b.len())
        .ok_or_else(|| {
            format!(
                "truncated .npy header: it says {hlen} bytes, {} are there",
                b.len() - start
            )
        })?;
    let header = &b[start..end];
    if major < 3 && !header.is_ascii() {
        return Err("bad .npy header: non-ASCII bytes in a version 1/2 header".into());
    }
    let h = parse_header(header)?;
    let numel = h
        .shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("shape {} is too large", fmt_shape(&h.shape)))?;
    let size = h.kind.size();
    let need = numel
        .checked_mul(size)
        .ok_or_else(|| format!("shape {} is too large", fmt_shape(&h.shape)))?;
    let data = &b[end..];
    if data.len() < need {
        return Err(format!(
            "data is {} bytes, but shape {} of {} needs {need} (the file is truncated)",
            data.len(),
            fmt_shape(&h.shape),
            h.descr
        ));
    }
    let data = &data[..need];
    Ok(Tensor {
        shape: h.shape,
        data: decode(data, h.kind, h.big_endian),
    })
}

/// Reads `N`-byte elements in the given byte order.
fn elems<const N: usize>(data: &[u8], big: bool) -> impl Iterator<Item = [u8; N]> + '_ {
    data.chunks_exact(N).map(move |c| {
        let mut a = [0u8; N];
        a.copy_from_slice(c);
        if big {
            a.reverse();
        }
        a
    })
}

fn decode(data: &[u8], kind: NpyKind, big: bool) -> Data {
    match kind {
        NpyKind::F8 => Data::F32(
            elems::<8>(data, big)
                .map(|a| f64::from_le_bytes(a) as f32)
                .collect(),
        ),
        NpyKind::F4 => Data::F32(elems::<4>(data, big).map(f32::from_le_bytes).collect()),
        NpyKind::F2 => Data::F16(elems::<2>(data, big).map(f16::from_le_bytes).collect()),
        NpyKind::I8 => Data::I64(elems::<8>(data, big).map(i64::from_le_bytes).collect()),
        NpyKind::I4 => Data::I32(elems::<4>(data, big).map(i32::from_le_bytes).collect()),
        NpyKind::U4 => Data::I64(
            elems::<4>(data, big)
                .map(|a| u32::from_le_bytes(a) as i64)
                .collect(),
        ),
        NpyKind::I2 => Data::I32(
            elems::<2>(data, big)
                .map(|a| i16::from_le_bytes(a) as i32)
                .collect(),
        ),
        NpyKind::U2 => Data::I32(
            elems::<2>(data, big)
                .map(|a| u16::from_le_bytes(a) as i32)
                .collect(),
        ),
        NpyKind::I1 => Data::I32(data.iter().map(|&x| x as i8 as i32).collect()),
        NpyKind::U1 => Data::I32(data.iter().map(|&x| x as i32).collect()),
        NpyKind::B1 => Data::Bool(data.iter().map(|&x| x != 0).collect()),
    }
}

// ---------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------

/// The numpy dtype an hzp dtype is written as.
fn descr_of(d: DType) -> &'static str {
    match d {
        DType::F32 | DType::BF16 => "<f4",
        DType::F16 => "<f2",
        DType::I64 => "<i8",
        DType::I32 => "<i4",
        DType::Bool => "|b1",
    }
}

fn npy_header(t: &Tensor) -> Vec<u8> {
    let shape = match t.shape.len() {
        0 => "()".to_string(),
        1 => format!("({},)", t.shape[0]),
        _ => format!(
            "({})",
            t.shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let dict = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {shape}, }}",
        descr_of(t.dtype())
    );
    // numpy pads with spaces and ends with '\n' so the data starts 64-byte aligned.
    let v1 = 10 + dict.len() < 64 * 1024 - 64;
    let prefix = if v1 { 10 } else { 12 };
    let total = (prefix + dict.len() + 1).div_ceil(64) * 64;
    let hlen = total - prefix;
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(NPY_MAGIC);
    if v1 {
        out.extend_from_slice(&[1, 0]);
        out.extend_from_slice(&(hlen as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&[2, 0]);
        out.extend_from_slice(&(hlen as u32).to_le_bytes());
    }
    out.extend_from_slice(dict.as_bytes());
    out.resize(total - 1, b' ');
    out.push(b'\n');
    out
}

/// Bytes of the array's data as written (bf16 widened to f32).
fn data_len(t: &Tensor) -> u64 {
    let per = match t.dtype() {
        DType::BF16 => 4,
        d => d.size_bytes(),
    };
    t.numel() as u64 * per as u64
}

/// Writes the data little-endian in chunks, so no second copy of a big tensor is made.
fn write_data(w: &mut impl Write, data: &Data) -> io::Result<()> {
    const CHUNK: usize = 1 << 14;
    let mut buf: Vec<u8> = Vec::with_capacity(CHUNK * 8);
    macro_rules! chunks {
        ($v:expr, $f:expr) => {
            for c in $v.chunks(CHUNK) {
                buf.clear();
                for x in c {
                    buf.extend_from_slice(&$f(x));
                }
                w.write_all(&buf)?;
            }
        };
    }
    match data {
        Data::F32(v) => chunks!(v, |x: &f32| x.to_le_bytes()),
        Data::BF16(v) => chunks!(v, |x: &bf16| x.to_f32().to_le_bytes()),
        Data::F16(v) => chunks!(v, |x: &f16| x.to_le_bytes()),
        Data::I64(v) => chunks!(v, |x: &i64| x.to_le_bytes()),
        Data::I32(v) => chunks!(v, |x: &i32| x.to_le_bytes()),
        Data::Bool(v) => chunks!(v, |x: &bool| [*x as u8]),
    }
    Ok(())
}

/// Checks names and sizes before anything is written.
fn check_tensors(tensors: &[(String, Tensor)], file: &str) -> Result<(), NpzError> {
    let mut seen = HashSet::new();
    for (name, t) in tensors {
        if name.is_empty() {
            return Err(file_err(file, "an array has an empty name"));
        }
        if !seen.insert(name.as_str()) {
            return Err(entry_err(file, name, "is given twice"));
        }
        let n = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if n != Some(t.data.len()) {
            return Err(entry_err(
                file,
                name,
                format!(
                    "has {} elements, but its shape {} needs {}",
                    t.data.len(),
                    fmt_shape(&t.shape),
                    n.map_or("more than fit in memory".into(), |n| n.to_string())
                ),
            ));
        }
    }
    Ok(())
}

fn write_zip<W: Write + Seek>(w: W, tensors: &[(String, Tensor)]) -> zip::result::ZipResult<W> {
    let mut zip = zip::ZipWriter::new(w);
    for (name, t) in tensors {
        let header = npy_header(t);
        let size = header.len() as u64 + data_len(t);
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored)
            .last_modified_time(zip::DateTime::default())
            .unix_permissions(0o644)
            .large_file(size >= u32::MAX as u64);
        zip.start_file(format!("{name}.npy"), opts)?;
        zip.write_all(&header)?;
        write_data(&mut zip, &t.data)?;
    }
    zip.finish()
}

/// The archive [`write`] would produce, in memory.
pub fn write_bytes(tensors: &[(String, Tensor)]) -> Result<Vec<u8>, NpzError> {
    check_tensors(tensors, "<memory>")?;
    let cur = write_zip(io::Cursor::new(Vec::new()), tensors)
        .map_err(|e| file_err("<memory>", format!("cannot write the archive: {e}")))?;
    Ok(cur.into_inner())
}

/// Writes `tensors` as an `.npz` archive at `path` (through [`crate::output::write_with`]:
/// regular files only, exclusive temporary file, fsync, rename; see the module doc).
pub fn write(path: &Path, tensors: &[(String, Tensor)]) -> Result<(), NpzError> {
    let name = path.display().to_string();
    check_tensors(tensors, &name)?;
    crate::output::write_with(path, |w| {
        write_zip(w, tensors).map_err(|e| match e {
            zip::result::ZipError::Io(e) => e,
            e => io::Error::other(e.to_string()),
        })?;
        Ok(())
    })
    .map_err(|e| file_err(&name, e.message))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::path::PathBuf;

    fn every_dtype() -> Vec<(String, Tensor)> {
        vec![
            (
                "f32".into(),
                Tensor::f32(
                    vec![2, 3],
                    vec![1.5, -2.0, 0.0, f32::MAX, f32::MIN_POSITIVE, -0.25],
                ),
            ),
            (
                "bf16".into(),
                Tensor::new(
                    vec![3],
                    Data::BF16(vec![bf16::from_f32(1.0), bf16::from_f32(-3.5), bf16::MAX]),
                ),
            ),
            (
                "f16".into(),
                Tensor::new(
                    vec![2, 1],
                    Data::F16(vec![f16::from_f32(0.5), f16::from_f32(-65504.0)]),
                ),
            ),
            (
                "i64".into(),
                Tensor::i64(vec![4], vec![0, -1, i64::MAX, i64::MIN]),
            ),
            (
                "i32".into(),
                Tensor::new(vec![1, 2], Data::I32(vec![i32::MIN, 7])),
            ),
            (
                "bool".into(),
                Tensor::new(vec![3], Data::Bool(vec![true, false, true])),
            ),
            ("scalar".into(), Tensor::scalar_f32(3.25)),
            ("empty".into(), Tensor::new(vec![0, 5], Data::I64(vec![]))),
            ("nested/name.with.dots".into(), Tensor::scalar_i64(-9)),
        ]
    }

    #[test]
    fn shapes_come_from_the_headers_alone() {
        let d = tmpdir("shapes");
        let arrays = every_dtype();
        let path = d.join("all.npz");
        write(&path, &arrays).unwrap();
        let want: Vec<(String, Vec<usize>)> = arrays
            .iter()
            .map(|(k, t)| (k.clone(), t.shape.clone()))
            .collect();
        assert_eq!(read_shapes(&path).unwrap(), want);
        // a bare .npy, and one whose data is cut off: the header is all that is read
        let (k, t) = &arrays[0];
        let mut bytes = npy_header(t);
        write_data(&mut bytes, &t.data).unwrap();
        let npy = d.join(format!("{k}.npy"));
        std::fs::write(&npy, &bytes[..bytes.len() - 3]).unwrap();
        assert_eq!(
            read_shapes(&npy).unwrap(),
            vec![(k.clone(), t.shape.clone())]
        );
        assert!(read(&npy).is_err());
        // a cut header is an error naming the entry
        std::fs::write(&npy, &bytes[..9]).unwrap();
        let e = read_shapes(&npy).unwrap_err().to_string();
        assert!(e.contains("truncated .npy header"), "{e}");
    }

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hzp-npz-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn round_trips_every_dtype() {
        let d = tmpdir("rt");
        let p = d.join("all.npz");
        let ts = every_dtype();
        write(&p, &ts).unwrap();
        let back = read(&p).unwrap();
        assert_eq!(back.len(), ts.len());
        for ((k0, t0), (k1, t1)) in ts.iter().zip(&back) {
            assert_eq!(k0, k1);
            assert_eq!(t0.shape, t1.shape, "{k0}");
            if let Data::BF16(v) = &t0.data {
                // bf16 is written as f32, exactly.
                let want: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
                assert_eq!(t1.data, Data::F32(want));
            } else {
                assert_eq!(t0.data, t1.data, "{k0}");
            }
        }
        // No temp file is left behind.
        let left: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("all.npz")]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn headers_are_64_byte_aligned_like_numpy() {
        for (_, t) in every_dtype() {
            let h = npy_header(&t);
            assert_eq!(h.len() % 64, 0);
            assert_eq!(*h.last().unwrap(), b'\n');
            let parsed =
                parse_npy(&[h.clone(), vec![0u8; data_len(&t) as usize]].concat()).unwrap();
            assert_eq!(parsed.shape, t.shape);
        }
        let h = npy_header(&Tensor::f32(vec![2, 16], vec![0.0; 32]));
        let text = String::from_utf8(h[10..].to_vec()).unwrap();
        assert!(text.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 16), }"));
        let h = npy_header(&Tensor::f32(vec![3], vec![0.0; 3]));
        assert!(String::from_utf8_lossy(&h).contains("'shape': (3,)"));
    }

    fn npy(header: &str, data: &[u8]) -> Vec<u8> {
        let mut v = NPY_MAGIC.to_vec();
        v.extend_from_slice(&[1, 0]);
        v.extend_from_slice(&(header.len() as u16).to_le_bytes());
        v.extend_from_slice(header.as_bytes());
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn reads_other_dtypes_and_versions() {
        // f8 -> f32, big-endian, small ints widened, version 2.0 and 3.0 headers.
        let f8: Vec<u8> = [1.5f64, -2.25]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let t = parse_npy(&npy(
            "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }\n",
            &f8,
        ))
        .unwrap();
        assert_eq!(t.data, Data::F32(vec![1.5, -2.25]));
        let be: Vec<u8> = [1i32, -3].iter().flat_map(|x| x.to_be_bytes()).collect();
        let t = parse_npy(&npy(
            "{'shape': (1, 2), 'fortran_order': False, 'descr': '>i4'}",
            &be,
        ))
        .unwrap();
        assert_eq!(
            (t.shape.clone(), t.data),
            (vec![1, 2], Data::I32(vec![1, -3]))
        );
        let t = parse_npy(&npy(
            "{'descr': '|u1', 'fortran_order': False, 'shape': (3,)}",
            &[0, 200, 255],
        ))
        .unwrap();
        assert_eq!(t.data, Data::I32(vec![0, 200, 255]));
        let t = parse_npy(&npy(
            "{'descr': '|i1', 'fortran_order': False, 'shape': (2,)}",
            &[0xff, 5],
        ))
        .unwrap();
        assert_eq!(t.data, Data::I32(vec![-1, 5]));
        let t = parse_npy(&npy(
            "{'descr': '<u4', 'fortran_order': False, 'shape': ()}",
            &u32::MAX.to_le_bytes(),
        ))
        .unwrap();
        assert_eq!(
            (t.shape.clone(), t.data),
            (vec![], Data::I64(vec![u32::MAX as i64]))
        );
        for major in [2u8, 3] {
            let h = "{'descr': '<i8', 'fortran_order': False, 'shape': (1,), }\n";
            let mut v = NPY_MAGIC.to_vec();
            v.extend_from_slice(&[major, 0]);
            v.extend_from_slice(&(h.len() as u32).to_le_bytes());
            v.extend_from_slice(h.as_bytes());
            v.extend_from_slice(&42i64.to_le_bytes());
            assert_eq!(parse_npy(&v).unwrap().data, Data::I64(vec![42]));
        }
    }

    #[test]
    fn errors_name_the_problem() {
        let e = parse_npy(&npy(
            "{'descr': '<c8', 'fortran_order': False, 'shape': (1,)}",
            &[0; 8],
        ))
        .unwrap_err();
        assert!(e.contains("unsupported dtype `<c8`"), "{e}");
        let e = parse_npy(&npy(
            "{'descr': '<f4', 'fortran_order': True, 'shape': (1,)}",
            &[0; 4],
        ))
        .unwrap_err();
        assert!(e.contains("Fortran order"), "{e}");
        let e = parse_npy(&npy(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}",
            &[0; 20],
        ))
        .unwrap_err();
        assert!(
            e.contains("data is 20 bytes") && e.contains("needs 24"),
            "{e}"
        );
        let e = parse_npy(&npy("{'descr': '<f4', 'shape': (2,)}", &[0; 8])).unwrap_err();
        assert!(e.contains("fortran_order"), "{e}");
        let e = parse_npy(&npy(
            "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,)}",
            &[0; 8],
        ))
        .unwrap_err();
        assert!(e.contains("structured"), "{e}");
        let e = parse_npy(&npy(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999, 99999999999, 99999999999)}",
            &[],
        ))
        .unwrap_err();
        assert!(e.contains("too large"), "{e}");

        // Whole-archive errors name the file (and the entry).
        let e = read_bytes(b"hello world", "x.npz").unwrap_err();
        assert_eq!(e.file, "x.npz");
        assert!(e.to_string().contains("not an .npz archive"), "{e}");
        let good = write_bytes(&every_dtype()).unwrap();
        let e = read_bytes(&good[..good.len() / 2], "half.npz").unwrap_err();
        assert!(e.to_string().starts_with("half.npz: "), "{e}");
        let e = read(Path::new("/nonexistent/dir/a.npz")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/dir/a.npz"), "{e}");

        // An entry with a bad dtype inside a valid zip: the error names the entry.
        let mut cur = io::Cursor::new(Vec::new());
        {
            let mut z = zip::ZipWriter::new(&mut cur);
            z.start_file("weird.npy", zip::write::SimpleFileOptions::default())
                .unwrap();
            z.write_all(&npy(
                "{'descr': '<c8', 'fortran_order': False, 'shape': (1,)}",
                &[0; 8],
            ))
            .unwrap();
            z.finish().unwrap();
        }
        let e = read_bytes(cur.get_ref(), "c.npz").unwrap_err();
        assert_eq!(e.entry.as_deref(), Some("weird"));
        assert!(
            e.to_string()
                .starts_with("c.npz: array `weird`: unsupported dtype `<c8`"),
            "{e}"
        );
    }

    #[test]
    fn reads_deflated_entries_and_bare_npy() {
        let t = Tensor::f32(vec![4], vec![1.0, 2.0, 3.0, 4.0]);
        let mut body = npy_header(&t);
        write_data(&mut body, &t.data).unwrap();
        let mut cur = io::Cursor::new(Vec::new());
        {
            let mut z = zip::ZipWriter::new(&mut cur);
            let o = zip::write::SimpleFileOptions::default()
                .compression_method(zip::CompressionMethod::Deflated);
            z.start_file("b.npy", o).unwrap();
            z.write_all(&body).unwrap();
            z.start_file("a.npy", o).unwrap();
            z.write_all(&body).unwrap();
            z.finish().unwrap();
        }
        let back = read_bytes(cur.get_ref(), "d.npz").unwrap();
        // archive order, not sorted
        assert_eq!(
            back.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
            ["b", "a"]
        );
        assert_eq!(back[1].1, t);
        let single = read_bytes(&body, "dir/w.npy").unwrap();
        assert_eq!(single, vec![("w".to_string(), t)]);
    }

    #[test]
    fn write_rejects_bad_input_and_keeps_old_file() {
        let d = tmpdir("bad");
        let p = d.join("keep.npz");
        std::fs::write(&p, b"old").unwrap();
        let bad = vec![(
            "x".to_string(),
            Tensor {
                shape: vec![3],
                data: Data::F32(vec![1.0]),
            },
        )];
        assert!(write(&p, &bad)
            .unwrap_err()
            .to_string()
            .contains("has 1 elements"));
        let dup = vec![
            ("x".to_string(), Tensor::scalar_f32(1.0)),
            ("x".to_string(), Tensor::scalar_f32(2.0)),
        ];
        assert!(write(&p, &dup)
            .unwrap_err()
            .to_string()
            .contains("given twice"));
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        // A directory that does not exist: an error, nothing created.
        let e = write(&d.join("no/such/dir/x.npz"), &every_dtype()).unwrap_err();
        assert!(e.to_string().contains("no/such/dir/x.npz"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn truncated_archives_are_errors_not_panics() {
        let good = write_bytes(&every_dtype()).unwrap();
        for n in 0..good.len() {
            let _ = read_bytes(&good[..n], "t.npz");
        }
        assert!(read_bytes(&good, "t.npz").is_ok());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = read_bytes(&bytes, "a.npz");
            let mut with_magic = b"PK\x03\x04".to_vec();
            with_magic.extend_from_slice(&bytes);
            let _ = read_bytes(&with_magic, "a.npz");
            let mut npy_magic = NPY_MAGIC.to_vec();
            npy_magic.extend_from_slice(&bytes);
            let _ = read_bytes(&npy_magic, "a.npy");
        }

        #[test]
        fn corrupted_archives_never_panic(
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)
        ) {
            let mut bytes = write_bytes(&every_dtype()).unwrap();
            for (i, b) in flips {
                let at = i.index(bytes.len());
                bytes[at] = b;
            }
            let _ = read_bytes(&bytes, "c.npz");
        }

        #[test]
        fn headers_never_panic(text in "[{}()\\[\\]:,'\" a-z0-9<|>TrueFalsNn]{0,80}") {
            let _ = parse_npy(&npy(&text, &[0; 16]));
        }
    }

    #[test]
    fn reads_the_shared_gpt2_io_file() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/onnx/gpt2_tiny.io.npz");
        if !p.exists() {
            eprintln!("skipping: {} is absent", p.display());
            return;
        }
        let arrays = read(&p).unwrap();
        let get = |k: &str| &arrays.iter().find(|(n, _)| n == k).unwrap().1;
        assert_eq!(get("input_ids").ty().to_string(), "i64[2,16]");
        assert_eq!(get("torch_out").ty().to_string(), "f32[2,16,1000]");
        // Written back and read again, it is the same.
        let again = read_bytes(&write_bytes(&arrays).unwrap(), "again.npz").unwrap();
        assert_eq!(again, arrays);
    }
}
