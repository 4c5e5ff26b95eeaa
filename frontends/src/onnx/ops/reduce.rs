//! Reductions (`Reduce*`), with ONNX's axes input, `keepdims` and `noop_with_empty_axes`.

use super::shape::reshape;
use super::*;

/// The default-domain ONNX ops of this family and their rules.
pub(super) const OPS: &[(&str, Rule)] = &[
    ("ReduceL1", reduce),
    ("ReduceL2", reduce),
    ("ReduceLogSum", reduce),
    ("ReduceLogSumExp", reduce),
    ("ReduceMax", reduce),
    ("ReduceMean", reduce),
    ("ReduceMin", reduce),
    ("ReduceProd", reduce),
    ("ReduceSum", reduce),
    ("ReduceSumSquare", reduce),
];

pub(super) fn reduce(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let r = cx.shape(&x).len();
    let op_type = n.p.op_type.as_str();
    let name = n.ir_name.clone();
    let op = match op_type {
        "ReduceMean" => ReduceOp::Mean,
        "ReduceMax" => ReduceOp::Max,
        "ReduceMin" => ReduceOp::Min,
        "ReduceProd" => ReduceOp::Prod,
        _ => ReduceOp::Sum,
    };
    let keep_dims = n.attr_i("keepdims", 1)? != 0;
    let axes = axes_input(cx, n, 1, "the axes")?.unwrap_or_default();
    let noop = axes.is_empty() && n.attr_i("noop_with_empty_axes", 0)? != 0;
    let mut axes = if axes.is_empty() {
        (0..r).collect()
    } else {
        norm_axes(&axes, r, "axes")?
    };
    axes.sort_unstable();
    // The elementwise part before the reduction.
    let x = match op_type {
        "ReduceSumSquare" | "ReduceL2" => {
            let t = tmp(cx, n, "square");
            emit1(cx, &name, Op::Binary(BinaryOp::Mul), &[x.clone(), x], t)?
        }
        "ReduceL1" => {
            let t = tmp(cx, n, "abs");
            emit1(cx, &name, Op::Unary(UnaryOp::Abs), &[x], t)?
        }
        _ => x,
    };
    if noop {
        // The input is not reduced (the elementwise part still applies).
        return one(x);
    }
    let post = match op_type {
        "ReduceL2" => Some(UnaryOp::Sqrt),
        "ReduceLogSum" => Some(UnaryOp::Log),
        _ => None,
    };
    if op_type == "ReduceLogSumExp" {
        return log_sum_exp(cx, n, x, axes, keep_dims);
    }
    let out = if post.is_some() {
        tmp(cx, n, "reduced")
    } else {
        out_name(cx, n, 0)
    };
    let reduce_op = Op::Reduce {
        op,
        axes,
        keep_dims,
    };
    let y = emit1(cx, &name, reduce_op, &[x], out)?;
    match post {
        Some(u) => {
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, Op::Unary(u), &[y], out)?)
        }
        None => one(y),
    }
}

/// log(sum(exp(x - m))) + m with m = max(x) over the axes, for stability.
pub(super) fn log_sum_exp(
    cx: &mut Ctx,
    n: &NodeCx,
    x: Slot,
    axes: Vec<usize>,
    keep_dims: bool,
) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let keep = |op| Op::Reduce {
        op,
        axes: axes.clone(),
        keep_dims: true,
    };
    let t = tmp(cx, n, "max");
    let m = emit1(cx, &name, keep(ReduceOp::Max), std::slice::from_ref(&x), t)?;
    let t = tmp(cx, n, "shifted");
    let d = emit1(cx, &name, Op::Binary(BinaryOp::Sub), &[x, m.clone()], t)?;
    let t = tmp(cx, n, "exp");
    let e = emit1(cx, &name, Op::Unary(UnaryOp::Exp), &[d], t)?;
    let t = tmp(cx, n, "sum");
    let s = emit1(cx, &name, keep(ReduceOp::Sum), &[e], t)?;
    let t = tmp(cx, n, "log");
    let l = emit1(cx, &name, Op::Unary(UnaryOp::Log), &[s], t)?;
    let kept = if keep_dims {
        out_name(cx, n, 0)
    } else {
        tmp(cx, n, "kept")
    };
    let y = emit1(cx, &name, Op::Binary(BinaryOp::Add), &[l, m], kept)?;
    if keep_dims {
        return one(y);
    }
    let shape: Vec<usize> = cx
        .shape(&y)
        .iter()
        .enumerate()
        .filter(|(i, _)| !axes.contains(i))
        .map(|(_, &d)| d)
        .collect();
    reshape(cx, n, y, shape)
}
