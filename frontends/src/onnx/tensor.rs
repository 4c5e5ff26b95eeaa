//! Decoding `TensorProto`s (initializers, `Constant` values, attribute tensors) into hzp
//! tensors, including data stored in external files next to the model.
//!
//! Element types: FLOAT, FLOAT16, BFLOAT16, INT32, INT64 and BOOL map to the hzp dtype of the
//! same kind. hzp has no float64 and no narrow integers, so DOUBLE data is read as f32
//! (rounded to nearest; documented precision loss), INT8/UINT8/INT16/UINT16 data as i32 and
//! UINT32/UINT64 data as i64 (values are kept exactly; a UINT64 above i64::MAX is an error).
//! STRING, complex, float8 and 4-bit types are rejected.

use super::error::{data_err, FResult};
use super::proto::{data_location, data_type as dt, TensorProto};
use half::{bf16, f16};
use hzp_ir::{DType, Data, Tensor};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};

/// The hzp dtype ONNX element type `t` is read as, or `None` when hzp has none.
pub(crate) fn dtype_of(t: i32) -> Option<DType> {
    Some(match t {
        dt::FLOAT | dt::DOUBLE => DType::F32,
        dt::FLOAT16 => DType::F16,
        dt::BFLOAT16 => DType::BF16,
        dt::INT64 | dt::UINT32 | dt::UINT64 => DType::I64,
        dt::INT32 | dt::INT8 | dt::UINT8 | dt::INT16 | dt::UINT16 => DType::I32,
        dt::BOOL => DType::Bool,
        _ => return None,
    })
}

/// Bytes per element in `raw_data` / external files.
fn raw_size(t: i32) -> Option<usize> {
    Some(match t {
        dt::FLOAT | dt::INT32 | dt::UINT32 => 4,
        dt::DOUBLE | dt::INT64 | dt::UINT64 => 8,
        dt::FLOAT16 | dt::BFLOAT16 | dt::INT16 | dt::UINT16 => 2,
        dt::INT8 | dt::UINT8 | dt::BOOL => 1,
        _ => return None,
    })
}

/// Checked element count of ONNX dims.
pub(crate) fn dims_to_shape(dims: &[i64], what: &str) -> FResult<Vec<usize>> {
    let mut shape = Vec::with_capacity(dims.len());
    let mut n: usize = 1;
    for &d in dims {
        let u = usize::try_from(d)
            .map_err(|_| data_err(format!("{what} has a negative dimension {d}")))?;
        n = n
            .checked_mul(u)
            .ok_or_else(|| data_err(format!("{what} has dims {dims:?}, too many elements")))?;
        shape.push(u);
    }
    Ok(shape)
}

/// Decodes a tensor. `what` names it in errors (e.g. "initializer `w`"); `model_dir` is the
/// folder external data paths are relative to.
pub(crate) fn decode_tensor(
    t: &TensorProto,
    what: &str,
    model_dir: Option<&Path>,
) -> FResult<Tensor> {
    let shape = dims_to_shape(&t.dims, what)?;
    let n: usize = shape.iter().product();
    let ty = t.data_type;
    if dtype_of(ty).is_none() {
        return Err(data_err(format!(
            "{what} has element type {}, which hzp does not support",
            dt::name(ty)
        )));
    }
    if t.segment.is_some() {
        return Err(data_err(format!(
            "{what} is a segment of a larger tensor, which hzp does not read"
        )));
    }
    let data = if t.data_location == data_location::EXTERNAL {
        let bytes = read_external(t, what, model_dir, n, ty)?;
        from_raw(&bytes, ty, n, what)?
    } else if t.data_location != data_location::DEFAULT {
        return Err(data_err(format!(
            "{what} has an unknown data_location {}",
            t.data_location
        )));
    } else if !t.raw_data.is_empty() {
        from_raw(&t.raw_data, ty, n, what)?
    } else {
        from_typed(t, ty, n, what)?
    };
    debug_assert_eq!(data.len(), n);
    Ok(Tensor { shape, data })
}

fn count_err(what: &str, have: usize, n: usize) -> crate::onnx::error::Fail {
    data_err(format!(
        "{what} holds {have} elements, but its dims call for {n}"
    ))
}

fn from_raw(b: &[u8], ty: i32, n: usize, what: &str) -> FResult<Data> {
    let size = raw_size(ty).unwrap_or(1);
    if n.checked_mul(size) != Some(b.len()) {
        return Err(data_err(format!(
            "{what} has {} bytes of data, but {n} elements of {} take {} bytes",
            b.len(),
            dt::name(ty),
            n.saturating_mul(size)
        )));
    }
    fn chunks<const N: usize>(b: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
        b.chunks_exact(N).map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            a
        })
    }
    Ok(match ty {
        dt::FLOAT => Data::F32(chunks::<4>(b).map(f32::from_le_bytes).collect()),
        dt::DOUBLE => Data::F32(
            chunks::<8>(b)
                .map(|c| f64::from_le_bytes(c) as f32)
                .collect(),
        ),
        dt::FLOAT16 => Data::F16(
            chunks::<2>(b)
                .map(|c| f16::from_bits(u16::from_le_bytes(c)))
                .collect(),
        ),
        dt::BFLOAT16 => Data::BF16(
            chunks::<2>(b)
                .map(|c| bf16::from_bits(u16::from_le_bytes(c)))
                .collect(),
        ),
        dt::INT64 => Data::I64(chunks::<8>(b).map(i64::from_le_bytes).collect()),
        dt::UINT64 => {
            let mut v = Vec::with_capacity(n);
            for c in chunks::<8>(b) {
                let x = u64::from_le_bytes(c);
                v.push(i64::try_from(x).map_err(|_| {
                    data_err(format!("{what}: UINT64 value {x} does not fit hzp's i64"))
                })?);
            }
            Data::I64(v)
        }
        dt::UINT32 => Data::I64(
            chunks::<4>(b)
                .map(|c| u32::from_le_bytes(c) as i64)
                .collect(),
        ),
        dt::INT32 => Data::I32(chunks::<4>(b).map(i32::from_le_bytes).collect()),
        dt::INT16 => Data::I32(
            chunks::<2>(b)
                .map(|c| i16::from_le_bytes(c) as i32)
                .collect(),
        ),
        dt::UINT16 => Data::I32(
            chunks::<2>(b)
                .map(|c| u16::from_le_bytes(c) as i32)
                .collect(),
        ),
        dt::INT8 => Data::I32(b.iter().map(|&x| x as i8 as i32).collect()),
        dt::UINT8 => Data::I32(b.iter().map(|&x| x as i32).collect()),
        dt::BOOL => Data::Bool(b.iter().map(|&x| x != 0).collect()),
        _ => return Err(data_err(format!("{what}: unsupported element type"))),
    })
}

fn from_typed(t: &TensorProto, ty: i32, n: usize, what: &str) -> FResult<Data> {
    let check = |have: usize| {
        if have == n {
            Ok(())
        } else {
            Err(count_err(what, have, n))
        }
    };
    Ok(match ty {
        dt::FLOAT => {
            check(t.float_data.len())?;
            Data::F32(t.float_data.clone())
        }
        dt::DOUBLE => {
            check(t.double_data.len())?;
            Data::F32(t.double_data.iter().map(|&x| x as f32).collect())
        }
        dt::INT64 => {
            check(t.int64_data.len())?;
            Data::I64(t.int64_data.clone())
        }
        dt::UINT32 | dt::UINT64 => {
            check(t.uint64_data.len())?;
            let mut v = Vec::with_capacity(n);
            for &x in &t.uint64_data {
                v.push(
                    i64::try_from(x).map_err(|_| {
                        data_err(format!("{what}: value {x} does not fit hzp's i64"))
                    })?,
                );
            }
            Data::I64(v)
        }
        dt::INT32 | dt::INT16 | dt::INT8 | dt::UINT16 | dt::UINT8 => {
            check(t.int32_data.len())?;
            Data::I32(t.int32_data.clone())
        }
        dt::BOOL => {
            check(t.int32_data.len())?;
            Data::Bool(t.int32_data.iter().map(|&x| x != 0).collect())
        }
        dt::FLOAT16 => {
            check(t.int32_data.len())?;
            Data::F16(
                t.int32_data
                    .iter()
                    .map(|&x| f16::from_bits(x as u16))
                    .collect(),
            )
        }
        dt::BFLOAT16 => {
            check(t.int32_data.len())?;
            Data::BF16(
                t.int32_data
                    .iter()
                    .map(|&x| bf16::from_bits(x as u16))
                    .collect(),
            )
        }
        _ => return Err(data_err(format!("{what}: unsupported element type"))),
    })
}

/// Checks an external-data location: relative, no `..`, no root or drive prefix.
fn check_location(loc: &str, what: &str) -> FResult<()> {
    let bad = |why: &str| {
        data_err(format!(
            "{what} stores its data in external file `{loc}`, {why}; hzp reads external data \
             only from files inside the model's folder"
        ))
    };
    if loc.is_empty() {
        return Err(data_err(format!(
            "{what} stores its data externally but names no file (`location` is empty)"
        )));
    }
    let p = Path::new(loc);
    if p.is_absolute() || loc.starts_with('/') || loc.starts_with('\\') {
        return Err(bad("an absolute path"));
    }
    // Check the raw text too, so that `..` between backslashes is caught on any platform.
    if loc.split(['/', '\\']).any(|c| c == "..") {
        return Err(bad("a path that climbs out with `..`"));
    }
    for c in p.components() {
        match c {
            Component::Normal(_) | Component::CurDir => {}
            Component::ParentDir => return Err(bad("a path that climbs out with `..`")),
            Component::RootDir | Component::Prefix(_) => return Err(bad("an absolute path")),
        }
    }
    if loc.contains(':') {
        return Err(bad("a path with a drive or stream prefix"));
    }
    Ok(())
}

fn read_external(
    t: &TensorProto,
    what: &str,
    model_dir: Option<&Path>,
    n: usize,
    ty: i32,
) -> FResult<Vec<u8>> {
    let mut location = None;
    let mut offset: u64 = 0;
    let mut length: Option<u64> = None;
    for e in &t.external_data {
        let num = |v: &str| {
            v.trim().parse::<u64>().map_err(|_| {
                data_err(format!(
                    "{what}: external data `{}` is `{v}`, not a non-negative integer",
                    e.key
                ))
            })
        };
        match e.key.as_str() {
            "location" => location = Some(e.value.clone()),
            "offset" => offset = num(&e.value)?,
            "length" => length = Some(num(&e.value)?),
            _ => {}
        }
    }
    let loc = location.ok_or_else(|| {
        data_err(format!(
            "{what} stores its data externally but has no `location` entry"
        ))
    })?;
    check_location(&loc, what)?;
    let dir = model_dir.ok_or_else(|| {
        data_err(format!(
            "{what} stores its data in external file `{loc}`, but the model was given as \
             bytes without a folder to read it from"
        ))
    })?;
    let path: PathBuf = dir.join(&loc);
    let io = |e: std::io::Error| {
        data_err(format!(
            "{what} stores its data in external file `{loc}` ({}), which cannot be read: {e}",
            path.display()
        ))
    };
    // Symbolic links must not lead out of the folder either.
    let real_dir = dir.canonicalize().map_err(io)?;
    let real = path.canonicalize().map_err(io)?;
    if !real.starts_with(&real_dir) {
        return Err(data_err(format!(
            "{what} stores its data in external file `{loc}`, which resolves to {} outside \
             the model's folder {}",
            real.display(),
            real_dir.display()
        )));
    }
    let mut f = crate::limits::open_regular(&real).map_err(io)?;
    let file_len = f.metadata().map_err(io)?.len();
    let want = n as u64 * raw_size(ty).unwrap_or(1) as u64;
    let length = length.unwrap_or_else(|| file_len.saturating_sub(offset));
    let end = offset.checked_add(length);
    if end.is_none_or(|end| end > file_len) {
        return Err(data_err(format!(
            "{what} reads bytes {offset}..{} of external file `{loc}`, which has only \
             {file_len} bytes",
            offset.saturating_add(length)
        )));
    }
    if length != want {
        return Err(data_err(format!(
            "{what} has {length} bytes of external data in `{loc}`, but {n} elements of {} \
             take {want} bytes",
            dt::name(ty)
        )));
    }
    crate::limits::check_budget(&format!("{what}'s external data in `{loc}`"), length)
        .map_err(data_err)?;
    let len = usize::try_from(length)
        .map_err(|_| data_err(format!("{what}: external data is too large")))?;
    f.seek(SeekFrom::Start(offset)).map_err(io)?;
    let mut buf = vec![0u8; len];
    f.read_exact(&mut buf).map_err(io)?;
    Ok(buf)
}

/// Encodes a tensor as a `TensorProto` with `raw_data` (for tests and tools).
pub fn encode_tensor(name: &str, t: &Tensor) -> TensorProto {
    let (data_type, raw_data): (i32, Vec<u8>) = match &t.data {
        Data::F32(v) => (dt::FLOAT, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        Data::BF16(v) => (
            dt::BFLOAT16,
            v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        ),
        Data::F16(v) => (
            dt::FLOAT16,
            v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        ),
        Data::I64(v) => (dt::INT64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        Data::I32(v) => (dt::INT32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        Data::Bool(v) => (dt::BOOL, v.iter().map(|&x| x as u8).collect()),
    };
    TensorProto {
        dims: t.shape.iter().map(|&d| d as i64).collect(),
        data_type,
        name: name.to_string(),
        raw_data,
        ..Default::default()
    }
}
