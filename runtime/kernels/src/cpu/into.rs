//! Kernels that write into caller-provided buffers: [`eval_op_into`].
//!
//! The plan executor keeps every tensor at a planned offset of one per-rank arena. It hands
//! each kernel read-only views of the inputs ([`TensorRef`]) and writable views of the
//! outputs ([`TensorMut`]), both borrowed from that arena, plus a [`Workspace`] of scratch
//! memory (bf16/f16 inputs widened to f32, f32 results before they are rounded to bf16,
//! index tables, partial sums). The workspace grows on first use and is then reused, so
//! after one warm-up call with the same shapes (or [`Workspace::reserve_for`]) a kernel
//! allocates nothing whose size depends on the tensors. The one exception is the `gemm`
//! crate's packing buffer inside MatMul, which gemm allocates per product and which is
//! bounded by its cache blocking (at most about the size of the L3 cache), not by the
//! operands; see `runtime/tests/alloc_free.rs`.
//!
//! Results are bit-identical to [`super::eval_op`] (which is a wrapper around this).

use half::{bf16, f16};
use hzp_ir::{DType, Data, Op, Tensor, TensorType};

// ---------------------------------------------------------------- views

/// A read-only view of a tensor's elements in some buffer (row-major, contiguous).
#[derive(Clone, Copy, Debug)]
pub enum DataRef<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
    I64(&'a [i64]),
    I32(&'a [i32]),
    Bool(&'a [bool]),
}

/// A writable view of a tensor's elements in some buffer (row-major, contiguous). Kernels
/// only write it (every element), never read what was there before.
#[derive(Debug)]
pub enum DataMut<'a> {
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
    F16(&'a mut [f16]),
    I64(&'a mut [i64]),
    I32(&'a mut [i32]),
    Bool(&'a mut [bool]),
}

/// A read-only tensor: its shape and a view of its elements.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    pub shape: &'a [usize],
    pub data: DataRef<'a>,
}

/// A tensor to write: its shape and a writable view of its elements.
#[derive(Debug)]
pub struct TensorMut<'a> {
    pub shape: &'a [usize],
    pub data: DataMut<'a>,
}

macro_rules! each_variant {
    ($v:expr, $x:ident => $e:expr) => {
        match $v {
            Self::F32($x) => $e,
            Self::BF16($x) => $e,
            Self::F16($x) => $e,
            Self::I64($x) => $e,
            Self::I32($x) => $e,
            Self::Bool($x) => $e,
        }
    };
}

/// Reinterprets `bytes` as `T`s, checking alignment and length.
///
/// # Safety
/// Every bit pattern of `size_of::<T>()` bytes must be a valid `T`.
unsafe fn cast_bytes<T>(bytes: &[u8]) -> Result<&[T], String> {
    let (pre, mid, post) = bytes.align_to::<T>();
    if !pre.is_empty() || !post.is_empty() {
        return Err(bytes_err::<T>(bytes.as_ptr() as usize, bytes.len()));
    }
    Ok(mid)
}

/// Mutable [`cast_bytes`].
///
/// # Safety
/// As for [`cast_bytes`].
unsafe fn cast_bytes_mut<T>(bytes: &mut [u8]) -> Result<&mut [T], String> {
    let (addr, len) = (bytes.as_ptr() as usize, bytes.len());
    let (pre, mid, post) = bytes.align_to_mut::<T>();
    if !pre.is_empty() || !post.is_empty() {
        return Err(bytes_err::<T>(addr, len));
    }
    Ok(mid)
}

fn bytes_err<T>(addr: usize, len: usize) -> String {
    let (size, align) = (std::mem::size_of::<T>(), std::mem::align_of::<T>());
    format!(
        "a buffer of {len} bytes at address {addr:#x} is not a whole number of {size}-byte \
         elements aligned to {align} bytes"
    )
}

/// What [`DataRef`] and [`DataMut`] share: the dtype, the element count, and the view of
/// owned [`Data`] (writable for `DataMut`).
macro_rules! view_common {
    ($view:ident $(, $m:tt)?) => {
        impl<'a> $view<'a> {
            pub fn dtype(&self) -> DType {
                match self {
                    Self::F32(_) => DType::F32,
                    Self::BF16(_) => DType::BF16,
                    Self::F16(_) => DType::F16,
                    Self::I64(_) => DType::I64,
                    Self::I32(_) => DType::I32,
                    Self::Bool(_) => DType::Bool,
                }
            }

            /// Number of elements.
            pub fn len(&self) -> usize {
                each_variant!(self, v => v.len())
            }

            pub fn is_empty(&self) -> bool {
                self.len() == 0
            }

            /// A view of owned tensor data.
            pub fn of(d: &'a $($m)? Data) -> $view<'a> {
                match d {
                    Data::F32(v) => Self::F32(v),
                    Data::BF16(v) => Self::BF16(v),
                    Data::F16(v) => Self::F16(v),
                    Data::I64(v) => Self::I64(v),
                    Data::I32(v) => Self::I32(v),
                    Data::Bool(v) => Self::Bool(v),
                }
            }
        }
    };
}

view_common!(DataRef);
view_common!(DataMut, mut);

impl<'a> DataRef<'a> {
    /// Views raw bytes (a slice of an arena) as elements of `dtype`. The bytes must be
    /// aligned to the element size and a whole number of elements; bool elements must be
    /// bytes 0 or 1 (checked: an arena is zero-initialized and kernels only store 0/1).
    pub fn from_bytes(dtype: DType, bytes: &'a [u8]) -> Result<DataRef<'a>, String> {
        // SAFETY: every bit pattern is a valid f32/bf16/f16/i64/i32; bool is checked first.
        unsafe {
            Ok(match dtype {
                DType::F32 => Self::F32(cast_bytes(bytes)?),
                DType::BF16 => Self::BF16(cast_bytes(bytes)?),
                DType::F16 => Self::F16(cast_bytes(bytes)?),
                DType::I64 => Self::I64(cast_bytes(bytes)?),
                DType::I32 => Self::I32(cast_bytes(bytes)?),
                DType::Bool => {
                    if let Some(i) = bytes.iter().position(|&b| b > 1) {
                        return Err(format!(
                            "byte {i} of a bool buffer is {}, not 0 or 1",
                            bytes[i]
                        ));
                    }
                    Self::Bool(std::slice::from_raw_parts(
                        bytes.as_ptr() as *const bool,
                        bytes.len(),
                    ))
                }
            })
        }
    }

    /// Copies the elements into owned [`Data`].
    pub fn to_data(&self) -> Data {
        match *self {
            Self::F32(v) => Data::F32(v.to_vec()),
            Self::BF16(v) => Data::BF16(v.to_vec()),
            Self::F16(v) => Data::F16(v.to_vec()),
            Self::I64(v) => Data::I64(v.to_vec()),
            Self::I32(v) => Data::I32(v.to_vec()),
            Self::Bool(v) => Data::Bool(v.to_vec()),
        }
    }
}

impl<'a> DataMut<'a> {
    /// Views raw bytes (a slice of an arena) as writable elements of `dtype`, with the
    /// alignment and length rules of [`DataRef::from_bytes`]. A bool buffer's bytes are
    /// first normalized to 0/1 (a bool may hold no other value); kernels overwrite every
    /// element anyway.
    pub fn from_bytes(dtype: DType, bytes: &'a mut [u8]) -> Result<DataMut<'a>, String> {
        // SAFETY: every bit pattern is a valid f32/bf16/f16/i64/i32; bool bytes are made
        // 0/1 before the cast.
        unsafe {
            Ok(match dtype {
                DType::F32 => Self::F32(cast_bytes_mut(bytes)?),
                DType::BF16 => Self::BF16(cast_bytes_mut(bytes)?),
                DType::F16 => Self::F16(cast_bytes_mut(bytes)?),
                DType::I64 => Self::I64(cast_bytes_mut(bytes)?),
                DType::I32 => Self::I32(cast_bytes_mut(bytes)?),
                DType::Bool => {
                    bytes.iter_mut().for_each(|b| *b = (*b != 0) as u8);
                    Self::Bool(std::slice::from_raw_parts_mut(
                        bytes.as_mut_ptr() as *mut bool,
                        bytes.len(),
                    ))
                }
            })
        }
    }

    /// A shorter-lived writable view of the same elements.
    pub fn reborrow(&mut self) -> DataMut<'_> {
        match self {
            Self::F32(v) => DataMut::F32(v),
            Self::BF16(v) => DataMut::BF16(v),
            Self::F16(v) => DataMut::F16(v),
            Self::I64(v) => DataMut::I64(v),
            Self::I32(v) => DataMut::I32(v),
            Self::Bool(v) => DataMut::Bool(v),
        }
    }

    /// A read-only view of the same elements.
    pub fn as_ref(&self) -> DataRef<'_> {
        match self {
            Self::F32(v) => DataRef::F32(v),
            Self::BF16(v) => DataRef::BF16(v),
            Self::F16(v) => DataRef::F16(v),
            Self::I64(v) => DataRef::I64(v),
            Self::I32(v) => DataRef::I32(v),
            Self::Bool(v) => DataRef::Bool(v),
        }
    }
}

impl<'a> TensorRef<'a> {
    pub fn new(shape: &'a [usize], data: DataRef<'a>) -> Self {
        TensorRef { shape, data }
    }

    /// A view of an owned tensor.
    pub fn of(t: &'a Tensor) -> Self {
        TensorRef {
            shape: &t.shape,
            data: DataRef::of(&t.data),
        }
    }

    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// The tensor's type (allocates the shape vector).
    pub fn ty(&self) -> TensorType {
        TensorType::new(self.dtype(), self.shape.to_vec())
    }
}

impl<'a> TensorMut<'a> {
    pub fn new(shape: &'a [usize], data: DataMut<'a>) -> Self {
        TensorMut { shape, data }
    }

    /// A writable view of an owned tensor.
    pub fn of(t: &'a mut Tensor) -> Self {
        TensorMut {
            shape: &t.shape,
            data: DataMut::of(&mut t.data),
        }
    }

    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// A shorter-lived view of the same tensor.
    pub fn reborrow(&mut self) -> TensorMut<'_> {
        TensorMut {
            shape: self.shape,
            data: self.data.reborrow(),
        }
    }
}

// ---------------------------------------------------------------- workspace

/// Numbered scratch buffers of one element type. `take` hands out disjoint slices of the
/// requested lengths from the first buffers, growing a buffer only when it is too short;
/// contents are whatever the last user left (kernels write before they read).
#[derive(Debug, Default)]
pub(crate) struct Pool<T> {
    bufs: Vec<Vec<T>>,
}

impl<T: Copy + Default> Pool<T> {
    pub(crate) fn take<const N: usize>(&mut self, lens: [usize; N]) -> [&mut [T]; N] {
        if self.bufs.len() < N {
            self.bufs.resize_with(N, Vec::new);
        }
        let mut it = self.bufs.iter_mut();
        lens.map(|n| {
            let v = it.next().expect("pool has N buffers");
            if v.len() < n {
                v.resize(n, T::default());
            }
            &mut v[..n]
        })
    }

    fn bytes(&self) -> usize {
        self.bufs.iter().map(|b| b.capacity()).sum::<usize>() * std::mem::size_of::<T>()
    }
}

/// Scratch memory for [`eval_op_into`], reused across calls: grown on first use (or by
/// [`Workspace::reserve_for`]), then never again for the same shapes. One per thread that
/// runs kernels (it is `Send`, not shared).
#[derive(Debug, Default)]
pub struct Workspace {
    pub(crate) f32s: Pool<f32>,
    pub(crate) f64s: Pool<f64>,
    pub(crate) usizes: Pool<usize>,
    pub(crate) i64s: Pool<i64>,
}

impl Workspace {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of scratch memory held.
    pub fn bytes(&self) -> usize {
        self.f32s.bytes() + self.f64s.bytes() + self.usizes.bytes() + self.i64s.bytes()
    }

    /// Grows the workspace to what `eval_op_into(op, inputs of these types, ..)` needs, so
    /// that the first real call allocates nothing either. It runs the op once on
    /// placeholder inputs (zeros; ones for integer divisors), so call it at setup, not in
    /// the step loop. Errors are the op's own (a bad type, an op with no kernel).
    pub fn reserve_for(&mut self, op: &Op, inputs: &[TensorType]) -> Result<(), String> {
        let ones = matches!(
            op,
            Op::Binary(hzp_ir::BinaryOp::Div | hzp_ir::BinaryOp::Mod | hzp_ir::BinaryOp::Pow)
        );
        let ins: Vec<Tensor> = inputs
            .iter()
            .map(|t| {
                let v = if ones && !t.dtype.is_float() {
                    1.0
                } else {
                    0.0
                };
                Tensor::from_f64(t.dtype, t.shape.clone(), &vec![v; t.numel()])
            })
            .collect();
        let refs: Vec<&TensorType> = inputs.iter().collect();
        let outs = op.infer(&refs, None)?;
        let mut outs: Vec<Tensor> = outs.iter().map(Tensor::zeros).collect();
        let in_views: Vec<TensorRef> = ins.iter().map(TensorRef::of).collect();
        let mut out_views: Vec<TensorMut> = outs.iter_mut().map(TensorMut::of).collect();
        eval_op_into(op, &in_views, &mut out_views, self)
    }
}

// ---------------------------------------------------------------- entry point

/// Checks `inputs` against `op` (a kernel exists, element counts match shapes, the type
/// rule accepts them) and returns the output types.
pub(crate) fn check_inputs(op: &Op, inputs: &[TensorRef<'_>]) -> Result<Vec<TensorType>, String> {
    let name = op.name();
    if op.is_collective() {
        return Err(format!(
            "{name} needs a communicator; run the plan with the executor"
        ));
    }
    if matches!(op, Op::Free | Op::RecordEvent { .. } | Op::WaitEvent { .. }) {
        return Err(format!(
            "{name} is a memory/stream op with no kernel; run the plan with the executor"
        ));
    }
    for (i, t) in inputs.iter().enumerate() {
        match super::layout::checked_numel(t.shape) {
            Some(n) if n == t.data.len() => {}
            _ => {
                return Err(format!(
                    "{name}: input {i} has {} elements but shape {:?}",
                    t.data.len(),
                    t.shape
                ))
            }
        }
    }
    let types: Vec<TensorType> = inputs.iter().map(TensorRef::ty).collect();
    let refs: Vec<&TensorType> = types.iter().collect();
    let out_types = op.infer(&refs, None)?;
    for t in &out_types {
        if super::layout::checked_numel(&t.shape).is_none_or(|n| n > isize::MAX as usize / 8) {
            return Err(format!("{name}: output {t} is too large"));
        }
    }
    Ok(out_types)
}

/// Runs one compute op on `inputs`, writing its outputs into `outputs`.
///
/// `outputs` must have exactly the types that `op.infer` gives for the inputs' types (same
/// count, dtype and shape, and as many elements as the shape says); every element of every
/// output is written, nothing outside the output slices is touched. Inputs are read only.
/// Temporaries (bf16/f16 widened to f32, f32 results before rounding, index tables, f64
/// partial sums) come from `ws`. The arithmetic, and so every bit of the result, is that
/// of [`super::eval_op`]. Errors say which op and why (never a panic on bad data: an
/// out-of-range index, a wrong buffer). Collectives, memory and event ops have no kernel
/// and are rejected.
///
/// Allocation: after `ws` has served the same op on the same shapes once (or
/// [`Workspace::reserve_for`]), a call allocates only small fixed-size things (the
/// inferred types' shape vectors, stride vectors of the strided walks) and, inside MatMul,
/// gemm's own packing buffer (bounded by its cache blocking).
pub fn eval_op_into(
    op: &Op,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
    ws: &mut Workspace,
) -> Result<(), String> {
    let out_types = check_inputs(op, inputs)?;
    run_checked(op, inputs, &out_types, outputs, ws)
}

/// [`eval_op_into`] after [`check_inputs`] gave `out_types`.
pub(crate) fn run_checked(
    op: &Op,
    inputs: &[TensorRef<'_>],
    out_types: &[TensorType],
    outputs: &mut [TensorMut<'_>],
    ws: &mut Workspace,
) -> Result<(), String> {
    let name = op.name();
    if out_types.len() != outputs.len() {
        return Err(format!(
            "{name}: {} output buffers given, the op has {} outputs",
            outputs.len(),
            out_types.len()
        ));
    }
    for (i, (t, o)) in out_types.iter().zip(outputs.iter()).enumerate() {
        if t.shape != o.shape || t.dtype != o.dtype() || t.numel() != o.data.len() {
            return Err(format!(
                "{name}: output {i} is {t} but the buffer is {}{:?} with {} elements",
                o.dtype(),
                o.shape,
                o.data.len()
            ));
        }
    }
    super::run(op, inputs, outputs, ws).map_err(|e| {
        if e.starts_with(name) {
            e
        } else {
            format!("{name}: {e}")
        }
    })
}
