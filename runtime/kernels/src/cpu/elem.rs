//! Element types as Rust types: typed access to tensor views, dtype dispatch, and the f32
//! staging that float kernels compute in (bf16/f16 are widened on load and rounded on
//! store, through workspace buffers).

use super::into::{DataMut, DataRef, TensorRef};
use half::{bf16, f16};
use hzp_ir::DType;

/// A Rust type that is the storage of one [`DType`].
pub trait Elem: Copy + Default + PartialEq + Send + Sync + 'static {
    const DTYPE: DType;
    /// The elements of a view of this dtype.
    fn of_ref(d: DataRef<'_>) -> Option<&[Self]>;
    /// The elements of a writable view of this dtype.
    fn of_mut<'a>(d: &'a mut DataMut<'_>) -> Option<&'a mut [Self]>;
}

macro_rules! impl_elem {
    ($t:ty, $variant:ident) => {
        impl Elem for $t {
            const DTYPE: DType = DType::$variant;
            fn of_ref(d: DataRef<'_>) -> Option<&[Self]> {
                match d {
                    DataRef::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn of_mut<'a>(d: &'a mut DataMut<'_>) -> Option<&'a mut [Self]> {
                match d {
                    DataMut::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}

impl_elem!(f32, F32);
impl_elem!(bf16, BF16);
impl_elem!(f16, F16);
impl_elem!(i64, I64);
impl_elem!(i32, I32);
impl_elem!(bool, Bool);

/// The elements of `t` as `T`, or an error if `t` holds another dtype.
pub fn typed<'a, T: Elem>(t: &TensorRef<'a>) -> Result<&'a [T], String> {
    T::of_ref(t.data)
        .ok_or_else(|| format!("internal: expected {} data, found {}", T::DTYPE, t.dtype()))
}

/// The elements of the output `d` as `T`, or an error if it holds another dtype.
pub fn typed_mut<'a, T: Elem>(d: &'a mut DataMut<'_>) -> Result<&'a mut [T], String> {
    let dt = d.dtype();
    T::of_mut(d).ok_or_else(|| format!("internal: expected {} output, found {dt}", T::DTYPE))
}

/// Calls a generic function `f::<T>(args)` with `T` the storage type of `dtype`.
macro_rules! by_dtype {
    ($dt:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $dt {
            hzp_ir::DType::F32 => $f::<f32>($($arg),*),
            hzp_ir::DType::BF16 => $f::<half::bf16>($($arg),*),
            hzp_ir::DType::F16 => $f::<half::f16>($($arg),*),
            hzp_ir::DType::I64 => $f::<i64>($($arg),*),
            hzp_ir::DType::I32 => $f::<i32>($($arg),*),
            hzp_ir::DType::Bool => $f::<bool>($($arg),*),
        }
    };
}
pub(crate) use by_dtype;

/// How many f32 staging elements [`floats`] needs for `d` (none when it is f32 already).
pub fn stage_len(d: DataRef<'_>) -> usize {
    match d {
        DataRef::F32(_) => 0,
        _ => d.len(),
    }
}

/// How many f32 elements [`store_f32`] needs to stage a result for `d` (none when it is
/// f32, which the kernel writes directly).
pub fn out_stage_len(d: &DataMut<'_>) -> usize {
    match d {
        DataMut::F32(_) => 0,
        _ => d.len(),
    }
}

/// A tensor's elements as f32: borrowed when already f32, else converted into `buf`
/// (which holds at least [`stage_len`] elements). Integers go through f64 (exact for
/// |x| < 2^24), bools become 0/1.
pub fn floats<'a>(d: DataRef<'a>, buf: &'a mut [f32]) -> &'a [f32] {
    let buf = &mut buf[..stage_len(d)];
    match d {
        DataRef::F32(v) => return v,
        DataRef::BF16(v) => buf.iter_mut().zip(v).for_each(|(o, x)| *o = x.to_f32()),
        DataRef::F16(v) => buf.iter_mut().zip(v).for_each(|(o, x)| *o = x.to_f32()),
        DataRef::I64(v) => buf
            .iter_mut()
            .zip(v)
            .for_each(|(o, &x)| *o = x as f64 as f32),
        DataRef::I32(v) => buf
            .iter_mut()
            .zip(v)
            .for_each(|(o, &x)| *o = x as f64 as f32),
        DataRef::Bool(v) => buf
            .iter_mut()
            .zip(v)
            .for_each(|(o, &x)| *o = if x { 1.0 } else { 0.0 }),
    }
    buf
}

/// Computes an f32 result with `f` and stores it in `out`: `f` writes `out` itself when it
/// is f32, else `buf` (at least [`out_stage_len`] elements), which is then converted to
/// the output dtype (rounding to nearest even for bf16/f16, truncating for integers,
/// != 0 for bool).
pub fn store_f32<R>(out: &mut DataMut<'_>, buf: &mut [f32], f: impl FnOnce(&mut [f32]) -> R) -> R {
    if let DataMut::F32(o) = out {
        return f(o);
    }
    let buf = &mut buf[..out.len()];
    let r = f(buf);
    round_into(buf, out);
    r
}

/// Stores f32 values as the dtype of `out` (same length).
pub fn round_into(v: &[f32], out: &mut DataMut<'_>) {
    match out {
        DataMut::F32(o) => o.copy_from_slice(v),
        DataMut::BF16(o) => o
            .iter_mut()
            .zip(v)
            .for_each(|(o, &x)| *o = bf16::from_f32(x)),
        DataMut::F16(o) => o
            .iter_mut()
            .zip(v)
            .for_each(|(o, &x)| *o = f16::from_f32(x)),
        DataMut::I64(o) => o.iter_mut().zip(v).for_each(|(o, &x)| *o = x as i64),
        DataMut::I32(o) => o.iter_mut().zip(v).for_each(|(o, &x)| *o = x as i32),
        DataMut::Bool(o) => o.iter_mut().zip(v).for_each(|(o, &x)| *o = x != 0.0),
    }
}

/// Copies `src` into `out` (same dtype and length, checked).
pub fn copy_data(src: DataRef<'_>, out: &mut DataMut<'_>) -> Result<(), String> {
    fn go<T: Elem>(src: DataRef<'_>, out: &mut DataMut<'_>) -> Result<(), String> {
        let s = T::of_ref(src).ok_or("internal: copy between dtypes")?;
        let o = typed_mut::<T>(out)?;
        if s.len() != o.len() {
            return Err("internal: copy between lengths".into());
        }
        o.copy_from_slice(s);
        Ok(())
    }
    by_dtype!(src.dtype(), go(src, out))
}
