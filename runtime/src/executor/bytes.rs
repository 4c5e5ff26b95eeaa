//! Tensors as the bytes of a device buffer (the CPU arena, a GPU allocation, a checkpoint
//! file): little-endian machines, the native representation; bool as one byte 0/1.

use half::{bf16, f16};
use hzp_ir::{DType, Data, Tensor, TensorType};

/// The bytes of a tensor's data as stored in a device buffer (little-endian machines: the native
/// representation; bool as one byte 0/1).
pub fn data_bytes(d: &Data) -> &[u8] {
    fn raw<T>(v: &[T]) -> &[u8] {
        // SAFETY: plain-old-data element types without padding.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
    }
    match d {
        Data::F32(v) => raw(v),
        Data::BF16(v) => raw(v),
        Data::F16(v) => raw(v),
        Data::I64(v) => raw(v),
        Data::I32(v) => raw(v),
        Data::Bool(v) => raw(v),
    }
}

/// A tensor of type `ty` read from arena bytes (`bytes.len()` must be its size).
pub fn tensor_from_bytes(ty: &TensorType, bytes: &[u8]) -> Tensor {
    let n = ty.numel();
    fn read<T: Copy>(bytes: &[u8], n: usize, f: impl Fn(&[u8]) -> T) -> Vec<T> {
        let es = bytes.len() / n.max(1);
        (0..n).map(|i| f(&bytes[i * es..(i + 1) * es])).collect()
    }
    let a2 = |c: &[u8]| [c[0], c[1]];
    let a4 = |c: &[u8]| [c[0], c[1], c[2], c[3]];
    let a8 = |c: &[u8]| [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]];
    let data = match ty.dtype {
        DType::F32 => Data::F32(read(bytes, n, |c| f32::from_ne_bytes(a4(c)))),
        DType::BF16 => Data::BF16(read(bytes, n, |c| {
            bf16::from_bits(u16::from_ne_bytes(a2(c)))
        })),
        DType::F16 => Data::F16(read(bytes, n, |c| {
            f16::from_bits(u16::from_ne_bytes(a2(c)))
        })),
        DType::I64 => Data::I64(read(bytes, n, |c| i64::from_ne_bytes(a8(c)))),
        DType::I32 => Data::I32(read(bytes, n, |c| i32::from_ne_bytes(a4(c)))),
        DType::Bool => Data::Bool(bytes.iter().map(|&b| b != 0).collect()),
    };
    Tensor {
        shape: ty.shape.clone(),
        data,
    }
}

/// Writes a tensor's data into arena bytes of exactly its size.
pub fn write_tensor(t: &Tensor, out: &mut [u8]) -> Result<(), String> {
    let src = data_bytes(&t.data);
    if src.len() != out.len() {
        return Err(format!(
            "internal: a {} result of {} bytes for a buffer of {} bytes",
            t.ty(),
            src.len(),
            out.len()
        ));
    }
    out.copy_from_slice(src);
    Ok(())
}

/// The first element of arena bytes of `dtype`, as f64 (for printing a loss).
pub fn scalar_f64(dtype: DType, bytes: &[u8]) -> Option<f64> {
    let b = bytes.get(..dtype.size_bytes())?;
    Some(match dtype {
        DType::F32 => f32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::BF16 => bf16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f64(),
        DType::F16 => f16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f64(),
        DType::I64 => i64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f64,
        DType::I32 => i32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::Bool => (b[0] != 0) as u8 as f64,
    })
}
