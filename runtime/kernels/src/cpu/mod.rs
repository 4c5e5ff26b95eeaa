//! CPU kernels, one per compute op, behind two entry points: [`eval_op_into`] writes into
//! caller-provided buffers (the executor's arena) with scratch from a [`Workspace`], and
//! [`eval_op`] allocates the outputs and calls it.
//!
//! Layout: `layout` (strides, broadcasting, the strided walk), `elem` (dtype dispatch and
//! the f32 view), and one file per family: `elementwise`, `matmul`, `norm`, `reduce`,
//! `movement`, `index`, `moe`. Semantics follow the doc comments on [`Op`] and, where those are
//! silent, ONNX / numpy / PyTorch.

pub mod attention;
pub mod elem;
pub mod elementwise;
pub mod index;
pub mod into;
pub mod layout;
pub mod math;
pub mod matmul;
pub mod moe;
pub mod movement;
pub mod norm;
pub mod optim;
pub mod pasa;
pub mod reduce;
pub mod threads;

use elem::by_dtype;
use half::{bf16, f16};
use hzp_ir::{DType, Op, Tensor};
pub use into::{eval_op_into, DataMut, DataRef, TensorMut, TensorRef, Workspace};

/// Runs one op on concrete tensors, into newly allocated outputs. Errors say which op and
/// why (never panic on bad data).
///
/// Inputs are checked against the op's type rule first; the outputs have exactly the types
/// the rule infers. Collectives, memory and event ops are not single-tensor kernels and are
/// rejected (the plan executor runs them). A wrapper around [`eval_op_into`] with a
/// per-thread [`Workspace`] (released when it grows past [`EVAL_OP_WORKSPACE_LIMIT`]).
pub fn eval_op(op: &Op, inputs: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let ins: Vec<TensorRef> = inputs.iter().map(|t| TensorRef::of(t)).collect();
    let out_types = into::check_inputs(op, &ins)?;
    let mut outs: Vec<Tensor> = out_types.iter().map(Tensor::zeros).collect();
    let mut views: Vec<TensorMut> = outs.iter_mut().map(TensorMut::of).collect();
    with_thread_workspace(|ws| into::run_checked(op, &ins, &out_types, &mut views, ws))?;
    Ok(outs)
}

/// The most scratch memory [`eval_op`]'s per-thread workspace keeps between calls.
pub const EVAL_OP_WORKSPACE_LIMIT: usize = 64 << 20;

/// `f` with this thread's workspace (a fresh one if it is in use further up the stack).
fn with_thread_workspace<R>(f: impl FnOnce(&mut Workspace) -> R) -> R {
    use std::cell::RefCell;
    thread_local! {
        static WS: RefCell<Workspace> = RefCell::new(Workspace::new());
    }
    let f = std::cell::Cell::new(Some(f));
    let run = |ws: &mut Workspace| (f.take().expect("called once"))(ws);
    let r = WS.try_with(|cell| match cell.try_borrow_mut() {
        Ok(mut ws) => {
            let r = run(&mut ws);
            if ws.bytes() > EVAL_OP_WORKSPACE_LIMIT {
                *ws = Workspace::new();
            }
            Some(r)
        }
        Err(_) => None,
    });
    match r {
        Ok(Some(r)) => r,
        _ => run(&mut Workspace::new()),
    }
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
/// Runs `$body` with `$t` the element type of `$dt` and `$f` its addition when `$add` (the
/// reduction of the scatters), `None` otherwise.
macro_rules! with_scatter_add {
    ($dt:expr, $add:expr, $t:ident, $f:ident => $body:expr) => {{
        macro_rules! arm {
            ($ty:ty, $fun:ident) => {{
                type $t = $ty;
                let $f: Option<fn($t, $t) -> $t> = if $add { Some($fun) } else { None };
                $body
            }};
        }
        match $dt {
            DType::F32 => arm!(f32, add_f32),
            DType::BF16 => arm!(bf16, add_bf16),
            DType::F16 => arm!(f16, add_f16),
            DType::I64 => arm!(i64, add_i64),
            DType::I32 => arm!(i32, add_i32),
            DType::Bool => arm!(bool, add_bool),
        }
    }};
}

fn scatter(
    ins: &[TensorRef],
    add: bool,
    axis: Option<usize>,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    let [x, idx, upd] = ins else {
        return Err("internal: scatter takes 3 inputs".into());
    };
    with_scatter_add!(x.dtype(), add, T, f => match axis {
        Some(a) => index::scatter_elements::<T>((x, idx, upd), a, f, out, ws),
        None => index::scatter_nd::<T>((x, idx, upd), f, out, ws),
    })
}

/// ScatterND over its data's own bytes: `out` (of `dtype` and `shape`) already holds the
/// data; the updates are stored, or added with `add`, at their indices.
pub fn scatter_nd_in_place(
    dtype: DType,
    shape: &[usize],
    idx: &TensorRef,
    upd: &TensorRef,
    add: bool,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    with_scatter_add!(dtype, add, T, f => index::scatter_nd_onto::<T>((shape, idx, upd), f, out, ws))
}

/// The kernel of `op`; inputs and outputs were checked against its type rule.
fn run(
    op: &Op,
    ins: &[TensorRef],
    outs: &mut [TensorMut],
    ws: &mut Workspace,
) -> Result<(), String> {
    use movement::*;
    // the type rule checked arity, so the inputs and outputs the op needs are present
    let x = ins.first().ok_or("missing input");
    if let Op::Split { axis, sizes } = op {
        let x = x?;
        return by_dtype!(x.dtype(), split(x, *axis, sizes, outs));
    }
    if let Op::TopK {
        axis, k, largest, ..
    } = op
    {
        let x = x?;
        use index::topk;
        return by_dtype!(x.dtype(), topk(x, (*axis, *k, *largest), outs, ws));
    }
    if let Op::AdamW {
        beta1,
        beta2,
        eps,
        weight_decay,
    } = op
    {
        return optim::adamw((*beta1, *beta2, *eps, *weight_decay), ins, outs);
    }
    if let Op::Attention { scale, causal } = op {
        return attention::attention(ins, *scale, *causal, outs, ws);
    }
    if let Op::AttentionGrad { scale, causal } = op {
        return attention::attention_grad(ins, *scale, *causal, outs, ws);
    }
    if let Op::MoeDispatch { experts, capacity } = op {
        let x = x?;
        use moe::dispatch;
        return by_dtype!(
            x.dtype(),
            dispatch(x, &ins[1], (*experts, *capacity), outs, ws)
        );
    }
    if let Op::MoeCombineGrad = op {
        return moe::combine_grad(ins, outs, ws);
    }
    if let Op::LayerNormGrad { axis, epsilon } | Op::RmsNormGrad { axis, epsilon } = op {
        let rms = matches!(op, Op::RmsNormGrad { .. });
        return norm::norm_grad(&ins[0], &ins[1], &ins[2], *axis, *epsilon, rms, outs, ws);
    }
    let [out] = outs else {
        return Err(format!(
            "internal: {} outputs for a one-output op",
            outs.len()
        ));
    };
    let shape = out.shape;
    let o = &mut out.data;
    match op {
        Op::Unary(u) => elementwise::unary(*u, x?, o, ws),
        Op::Binary(b) => elementwise::binary(*b, &ins[0], &ins[1], shape, o, ws),
        Op::Where => elementwise::where_(&ins[0], &ins[1], &ins[2], shape, o),
        Op::GeluTanhGrad => elementwise::gelu_tanh_grad(&ins[0], &ins[1], o, ws),
        Op::Cast { .. } => elementwise::cast(x?, o),
        Op::Identity | Op::Copy | Op::Reshape { .. } => elem::copy_data(x?.data, o),
        Op::MatMul => matmul::matmul(&ins[0], &ins[1], o, ws),
        Op::Softmax { axis } => norm::softmax(x?, *axis, false, o, ws),
        Op::LogSoftmax { axis } => norm::softmax(x?, *axis, true, o, ws),
        Op::SoftmaxCrossEntropy { axis } => {
            norm::softmax_cross_entropy(&ins[0], &ins[1], None, *axis, o, ws)
        }
        Op::SoftmaxCrossEntropyGrad { axis } => {
            norm::softmax_cross_entropy(&ins[0], &ins[1], ins.get(2), *axis, o, ws)
        }
        Op::LayerNorm { axis, epsilon } => {
            norm::norm(&ins[0], &ins[1], ins.get(2), *axis, *epsilon, false, o, ws)
        }
        Op::RmsNorm { axis, epsilon } => {
            norm::norm(&ins[0], &ins[1], None, *axis, *epsilon, true, o, ws)
        }
        Op::Reduce { op, axes, .. } => reduce::reduce(x?, *op, axes, o, ws),
        Op::ArgMax { axis, .. } => reduce::argmax(x?, *axis, o, ws),
        Op::CumSum {
            axis,
            exclusive,
            reverse,
        } => reduce::cumsum(x?, *axis, *exclusive, *reverse, o, ws),
        Op::Transpose { perm } => {
            let x = x?;
            by_dtype!(x.dtype(), transpose(x, perm, o))
        }
        Op::Slice {
            axes,
            starts,
            steps,
            ..
        } => {
            let x = x?;
            by_dtype!(x.dtype(), slice(x, axes, starts, steps, out))
        }
        Op::Concat { axis } => by_dtype!(ins[0].dtype(), concat(ins, *axis, out)),
        Op::Expand { .. } => {
            let x = x?;
            by_dtype!(x.dtype(), expand_to(x, out))
        }
        Op::Tile { repeats } => {
            let x = x?;
            by_dtype!(x.dtype(), tile(x, repeats, o))
        }
        Op::Trilu { upper, k } => {
            let x = x?;
            by_dtype!(x.dtype(), trilu(x, *upper, *k, o))
        }
        Op::Gather { axis } => {
            use index::gather;
            by_dtype!(ins[0].dtype(), gather(&ins[0], &ins[1], *axis, o))
        }
        Op::GatherElements { axis } => {
            use index::gather_elements;
            by_dtype!(
                ins[0].dtype(),
                gather_elements(&ins[0], &ins[1], *axis, o, ws)
            )
        }
        Op::GatherND { batch_dims } => {
            use index::gather_nd;
            by_dtype!(
                ins[0].dtype(),
                gather_nd(&ins[0], &ins[1], *batch_dims, o, ws)
            )
        }
        Op::ScatterElements { axis, add } => scatter(ins, *add, Some(*axis), o, ws),
        Op::ScatterND { add } => scatter(ins, *add, None, o, ws),
        Op::OneHot { axis, depth } => {
            use index::one_hot;
            by_dtype!(ins[1].dtype(), one_hot(&ins[0], &ins[1], *axis, *depth, o))
        }
        Op::MoeCombine => moe::combine(ins, o, ws),
        Op::Fill { value, .. } => {
            fill(*value, o);
            Ok(())
        }
        Op::Split { .. }
        | Op::MoeDispatch { .. }
        | Op::MoeCombineGrad
        | Op::TopK { .. }
        | Op::AdamW { .. }
        | Op::LayerNormGrad { .. }
        | Op::RmsNormGrad { .. }
        | Op::Attention { .. }
        | Op::AttentionGrad { .. }
        | Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllReduce { .. }
        | Op::AllToAll { .. }
        | Op::Broadcast { .. }
        | Op::Free
        | Op::RecordEvent { .. }
        | Op::WaitEvent { .. } => Err("needs the executor".into()),
    }
}

/// Fills `out` with `value` converted to its dtype as a cast would.
fn fill(value: f64, out: &mut DataMut) {
    match out {
        DataMut::F32(o) => o.fill(value as f32),
        DataMut::BF16(o) => o.fill(bf16::from_f64(value)),
        DataMut::F16(o) => o.fill(f16::from_f64(value)),
        DataMut::I64(o) => o.fill(value as i64),
        DataMut::I32(o) => o.fill(value as i32),
        DataMut::Bool(o) => o.fill(value != 0.0),
    }
}
