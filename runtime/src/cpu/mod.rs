//! CPU kernels, one per compute op, behind one entry point: [`eval_op`].
//!
//! Layout: `layout` (strides, broadcasting, the strided walk), `elem` (dtype dispatch and
//! the f32 view), and one file per family: `elementwise`, `matmul`, `norm`, `reduce`,
//! `movement`, `index`. Semantics follow the doc comments on [`Op`] and, where those are
//! silent, ONNX / numpy / PyTorch.

pub mod elem;
pub mod elementwise;
pub mod index;
pub mod layout;
pub mod math;
pub mod matmul;
pub mod movement;
pub mod norm;
pub mod reduce;
pub mod threads;

use elem::by_dtype;
use half::{bf16, f16};
use hzp_ir::{DType, Data, Op, Tensor, TensorType};

/// Runs one op on concrete tensors. Errors say which op and why (never panic on bad data).
///
/// Inputs are checked against the op's type rule first; the outputs have exactly the types
/// the rule infers. Collectives, memory and event ops are not single-tensor kernels and are
/// rejected (the plan executor runs them).
pub fn eval_op(op: &Op, inputs: &[&Tensor]) -> Result<Vec<Tensor>, String> {
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
        match layout::checked_numel(&t.shape) {
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
    let types: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = types.iter().collect();
    let out_types = op.infer(&refs, None)?;
    for t in &out_types {
        if layout::checked_numel(&t.shape).is_none_or(|n| n > isize::MAX as usize / 8) {
            return Err(format!("{name}: output {t} is too large"));
        }
    }
    let datas = run(op, inputs, &out_types).map_err(|e| {
        if e.starts_with(name) {
            e
        } else {
            format!("{name}: {e}")
        }
    })?;
    if datas.len() != out_types.len() {
        return Err(format!(
            "internal: {name} produced {} outputs, expected {}",
            datas.len(),
            out_types.len()
        ));
    }
    datas
        .into_iter()
        .zip(out_types)
        .map(|(d, t)| {
            if d.dtype() != t.dtype || d.len() != t.numel() {
                return Err(format!(
                    "internal: {name} produced {} data with {} elements, expected {t}",
                    d.dtype(),
                    d.len()
                ));
            }
            Ok(Tensor {
                shape: t.shape,
                data: d,
            })
        })
        .collect()
}

fn add_f32(a: f32, b: f32) -> f32 {
    a + b
}
fn add_bf16(a: bf16, b: bf16) -> bf16 {
    bf16::from_f32(a.to_f32() + b.to_f32())
}
fn add_f16(a: f16, b: f16) -> f16 {
    f16::from_f32(a.to_f32() + b.to_f32())
}
fn add_i64(a: i64, b: i64) -> i64 {
    a.wrapping_add(b)
}
fn add_i32(a: i32, b: i32) -> i32 {
    a.wrapping_add(b)
}
fn add_bool(a: bool, b: bool) -> bool {
    a | b
}

/// Scatter with an optional add, dispatched on the data's dtype.
fn scatter(
    x: &Tensor,
    idx: &Tensor,
    upd: &Tensor,
    add: bool,
    axis: Option<usize>,
) -> Result<Data, String> {
    macro_rules! go {
        ($t:ty, $f:ident) => {{
            let f: Option<fn($t, $t) -> $t> = if add { Some($f) } else { None };
            match axis {
                Some(a) => index::scatter_elements::<$t>(x, idx, upd, a, f),
                None => index::scatter_nd::<$t>(x, idx, upd, f),
            }
        }};
    }
    match x.dtype() {
        DType::F32 => go!(f32, add_f32),
        DType::BF16 => go!(bf16, add_bf16),
        DType::F16 => go!(f16, add_f16),
        DType::I64 => go!(i64, add_i64),
        DType::I32 => go!(i32, add_i32),
        DType::Bool => go!(bool, add_bool),
    }
}

fn run(op: &Op, ins: &[&Tensor], outs: &[TensorType]) -> Result<Vec<Data>, String> {
    use movement::*;
    let x = ins.first().copied();
    // the type rule checked arity, so inputs the op needs are present
    let x0 = || x.ok_or_else(|| "missing input".to_string());
    let out0 = &outs.first().ok_or("internal: no output type")?.shape;
    let one = |d: Data| Ok(vec![d]);
    match op {
        Op::Unary(u) => one(elementwise::unary(*u, x0()?)?),
        Op::Binary(b) => one(elementwise::binary(*b, ins[0], ins[1], out0)?),
        Op::Where => one(elementwise::where_(ins[0], ins[1], ins[2], out0)?),
        Op::Cast { to } => one(elementwise::cast(x0()?, *to)),
        Op::Identity | Op::Copy | Op::Reshape { .. } => one(x0()?.data.clone()),
        Op::MatMul => one(matmul::matmul(ins[0], ins[1])?),
        Op::Softmax { axis } => one(norm::softmax(x0()?, *axis, false)),
        Op::LogSoftmax { axis } => one(norm::softmax(x0()?, *axis, true)),
        Op::LayerNorm { axis, epsilon } => one(norm::norm(
            ins[0],
            ins[1],
            ins.get(2).copied(),
            *axis,
            *epsilon,
            false,
        )),
        Op::RmsNorm { axis, epsilon } => {
            one(norm::norm(ins[0], ins[1], None, *axis, *epsilon, true))
        }
        Op::Reduce { op, axes, .. } => one(reduce::reduce(x0()?, *op, axes)?),
        Op::ArgMax { axis, .. } => one(reduce::argmax(x0()?, *axis)?),
        Op::CumSum {
            axis,
            exclusive,
            reverse,
        } => one(reduce::cumsum(x0()?, *axis, *exclusive, *reverse)?),
        Op::Transpose { perm } => {
            let x = x0()?;
            one(by_dtype!(x.dtype(), transpose(x, perm))?)
        }
        Op::Slice {
            axes,
            starts,
            steps,
            ..
        } => {
            let x = x0()?;
            one(by_dtype!(x.dtype(), slice(x, axes, starts, steps, out0))?)
        }
        Op::Concat { axis } => one(by_dtype!(ins[0].dtype(), concat(ins, *axis, out0))?),
        Op::Split { axis, sizes } => {
            let x = x0()?;
            by_dtype!(x.dtype(), split(x, *axis, sizes))
        }
        Op::Expand { shape } => {
            let x = x0()?;
            one(by_dtype!(x.dtype(), expand_to(x, shape))?)
        }
        Op::Tile { repeats } => {
            let x = x0()?;
            one(by_dtype!(x.dtype(), tile(x, repeats))?)
        }
        Op::Trilu { upper, k } => {
            let x = x0()?;
            one(by_dtype!(x.dtype(), trilu(x, *upper, *k))?)
        }
        Op::Gather { axis } => {
            use index::gather;
            one(by_dtype!(ins[0].dtype(), gather(ins[0], ins[1], *axis))?)
        }
        Op::GatherElements { axis } => {
            use index::gather_elements;
            one(by_dtype!(
                ins[0].dtype(),
                gather_elements(ins[0], ins[1], *axis)
            )?)
        }
        Op::GatherND { batch_dims } => {
            use index::gather_nd;
            one(by_dtype!(
                ins[0].dtype(),
                gather_nd(ins[0], ins[1], *batch_dims)
            )?)
        }
        Op::ScatterElements { axis, add } => {
            one(scatter(ins[0], ins[1], ins[2], *add, Some(*axis))?)
        }
        Op::ScatterND { add } => one(scatter(ins[0], ins[1], ins[2], *add, None)?),
        Op::OneHot { axis, depth } => {
            use index::one_hot;
            one(by_dtype!(
                ins[1].dtype(),
                one_hot(ins[0], ins[1], *axis, *depth)
            )?)
        }
        Op::TopK {
            axis, k, largest, ..
        } => {
            use index::take_along;
            let x = x0()?;
            let ids = index::topk_indices(x, *axis, *k, *largest);
            let values = by_dtype!(x.dtype(), take_along(x, *axis, &ids, *k))?;
            Ok(vec![values, Data::I64(ids)])
        }
        Op::Fill {
            value,
            dtype,
            shape,
        } => one(fill(*dtype, *value, shape.iter().product())),
        Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllReduce { .. }
        | Op::AllToAll { .. }
        | Op::Broadcast { .. }
        | Op::Free
        | Op::RecordEvent { .. }
        | Op::WaitEvent { .. } => Err("needs the executor".into()),
    }
}

/// `n` copies of `value` converted to `dtype` as a cast would.
fn fill(dtype: DType, value: f64, n: usize) -> Data {
    match dtype {
        DType::F32 => Data::F32(vec![value as f32; n]),
        DType::BF16 => Data::BF16(vec![bf16::from_f64(value); n]),
        DType::F16 => Data::F16(vec![f16::from_f64(value); n]),
        DType::I64 => Data::I64(vec![value as i64; n]),
        DType::I32 => Data::I32(vec![value as i32; n]),
        DType::Bool => Data::Bool(vec![value != 0.0; n]),
    }
}
