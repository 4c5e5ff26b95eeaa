//! Element types as Rust types: typed access to [`Data`], dtype dispatch, and the f32 view
//! that float kernels compute in (bf16/f16 are widened on load and rounded on store).

use half::{bf16, f16};
use hzp_ir::{DType, Data, Tensor};
use std::borrow::Cow;

/// A Rust type that is the storage of one [`DType`].
pub trait Elem: Copy + Default + PartialEq + Send + Sync + 'static {
    const DTYPE: DType;
    fn slice(d: &Data) -> Option<&[Self]>;
    fn wrap(v: Vec<Self>) -> Data;
}

macro_rules! impl_elem {
    ($t:ty, $variant:ident) => {
        impl Elem for $t {
            const DTYPE: DType = DType::$variant;
            fn slice(d: &Data) -> Option<&[Self]> {
                match d {
                    Data::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn wrap(v: Vec<Self>) -> Data {
                Data::$variant(v)
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
pub fn typed<T: Elem>(t: &Tensor) -> Result<&[T], String> {
    T::slice(&t.data)
        .ok_or_else(|| format!("internal: expected {} data, found {}", T::DTYPE, t.dtype()))
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

/// A float tensor's elements as f32 (borrowed when already f32). Integer and bool tensors
/// are converted too (exactly for |x| < 2^24).
pub fn floats(t: &Tensor) -> Cow<'_, [f32]> {
    match &t.data {
        Data::F32(v) => Cow::Borrowed(v),
        _ => Cow::Owned(t.to_f32_vec()),
    }
}

/// Stores f32 results as `dtype` (rounding to nearest even for bf16/f16).
pub fn from_f32(dtype: DType, v: Vec<f32>) -> Data {
    match dtype {
        DType::F32 => Data::F32(v),
        DType::BF16 => Data::BF16(v.into_iter().map(bf16::from_f32).collect()),
        DType::F16 => Data::F16(v.into_iter().map(f16::from_f32).collect()),
        DType::I64 => Data::I64(v.into_iter().map(|x| x as i64).collect()),
        DType::I32 => Data::I32(v.into_iter().map(|x| x as i32).collect()),
        DType::Bool => Data::Bool(v.into_iter().map(|x| x != 0.0).collect()),
    }
}
