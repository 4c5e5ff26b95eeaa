//! Reverse-mode automatic differentiation over the IR.
//!
//! [`differentiate`] appends the backward graph of a scalar `loss` to a program and returns
//! the gradient value of each requested parameter. Only float values on a path from a
//! requested parameter to the loss are differentiated; integer and index paths never are.
//! A value read by several nodes (a tied embedding, a residual) accumulates its gradients.
//! An op on such a path without a gradient rule fails with the op and the node's name.

use crate::emit::Emitter;
use hzp_ir::{
    BinaryOp, DType, Node, Op, Program, ReduceOp, Role, RoleKind, UnaryOp, ValueDef, ValueId,
};
use std::collections::HashMap;

#[derive(Debug, thiserror::Error)]
#[error("autodiff: {0}")]
pub struct AutodiffError(pub String);

/// Appends the backward graph of `loss` (a scalar float value of `p`) and returns, for each
/// of `wrt` in order, the value holding d loss / d wrt (zeros if the loss does not depend
/// on it). The program's outputs are left unchanged; callers add what they need.
pub fn differentiate(
    p: &mut Program,
    loss: ValueId,
    wrt: &[ValueId],
) -> Result<Vec<ValueId>, AutodiffError> {
    differentiate_scaled(p, loss, wrt, 1.0)
}

/// [`differentiate`] of `scale * loss`: the backward starts from `scale` instead of 1, so
/// every gradient comes out multiplied by it (gradients are linear in the seed; a power of
/// two scales every intermediate value exactly).
pub fn differentiate_scaled(
    p: &mut Program,
    loss: ValueId,
    wrt: &[ValueId],
    scale: f64,
) -> Result<Vec<ValueId>, AutodiffError> {
    let lt = p.ty(loss).clone();
    if !lt.dtype.is_float() || lt.numel() != 1 {
        return Err(AutodiffError(format!(
            "the loss `{}` must be a float scalar, it is {}",
            p.value(loss).name,
            lt
        )));
    }
    let nv = p.values.len();
    let forward_nodes = p.nodes.len();

    // Forward sweep: which values depend on a requested parameter.
    let mut depends = vec![false; nv];
    for &w in wrt {
        depends[w.index()] = true;
    }
    for n in &p.nodes {
        if n.inputs.iter().any(|v| depends[v.index()]) {
            for &o in &n.outputs {
                depends[o.index()] = p.ty(o).dtype.is_float();
            }
        }
    }
    // Backward sweep: which values the loss depends on.
    let mut reaches = vec![false; nv];
    reaches[loss.index()] = true;
    for n in p.nodes.iter().rev() {
        if n.outputs.iter().any(|o| reaches[o.index()]) {
            for &i in &n.inputs {
                reaches[i.index()] = true;
            }
        }
    }
    let active: Vec<bool> = (0..nv)
        .map(|i| depends[i] && reaches[i] && p.values[i].ty.dtype.is_float())
        .collect();

    let mut e = Emitter::new(p);
    let mut grads: HashMap<ValueId, ValueId> = HashMap::new();
    e.enter("loss/seed", Role::of(RoleKind::Loss));
    let one = e.scalar(scale, lt.dtype);
    let seed = if lt.shape.is_empty() {
        one
    } else {
        e.op(
            Op::Reshape {
                shape: lt.shape.clone(),
            },
            &[one],
        )
        .map_err(AutodiffError)?
    };
    grads.insert(loss, seed);

    for ni in (0..forward_nodes).rev() {
        let node = e.p.nodes[ni].clone();
        if !node.outputs.iter().any(|o| active[o.index()]) {
            continue;
        }
        let dys: Vec<Option<ValueId>> =
            node.outputs.iter().map(|o| grads.get(o).copied()).collect();
        if dys.iter().all(Option::is_none) {
            continue;
        }
        let want: Vec<bool> = node.inputs.iter().map(|i| active[i.index()]).collect();
        if !want.iter().any(|&w| w) {
            continue;
        }
        e.enter(format!("{}/bwd", node.name), Role::default());
        let dxs = rule(&mut e, &node, &dys, &want).map_err(|m| {
            AutodiffError(format!("node `{}` ({}): {m}", node.name, node.op.name()))
        })?;
        for ((&x, dx), &w) in node.inputs.iter().zip(dxs).zip(&want) {
            let (Some(dx), true) = (dx, w) else { continue };
            let acc = match grads.get(&x) {
                Some(&prev) => accumulate(&mut e, prev, dx).map_err(AutodiffError)?,
                None => dx,
            };
            grads.insert(x, acc);
        }
    }

    e.enter("grad", Role::default());
    let mut out = Vec::new();
    for &w in wrt {
        let g = match grads.get(&w) {
            Some(&g) => g,
            None => {
                let ty = e.ty(w).clone();
                e.zeros(&ty).map_err(AutodiffError)?
            }
        };
        out.push(g);
    }
    Ok(out)
}

type R<T> = Result<T, String>;

/// `prev + dx`, the gradient of a value read twice. When `dx` scatter-adds into zeros (a
/// gather's gradient, e.g. a tied embedding's rows), the updates are scatter-added into
/// `prev` instead: no zero tensor and no dense addition (the sums per row are the same up to
/// the order of their terms). The zeros and the first scatter are left to dead-code
/// elimination.
fn accumulate(e: &mut Emitter, prev: ValueId, dx: ValueId) -> R<ValueId> {
    let scatter_into_zeros = |e: &Emitter, v: ValueId| -> Option<(ValueId, ValueId)> {
        let ValueDef::Node { node, .. } = e.p.value(v).def else {
            return None;
        };
        let n = e.p.nodes.get(node.index())?;
        let (Op::ScatterND { add: true }, [z, idx, upd]) = (&n.op, n.inputs.as_slice()) else {
            return None;
        };
        let ValueDef::Node { node: zn, .. } = e.p.value(*z).def else {
            return None;
        };
        let zero = matches!(
            e.p.nodes.get(zn.index()).map(|n| &n.op),
            Some(Op::Fill { value, .. }) if *value == 0.0
        );
        zero.then_some((*idx, *upd))
    };
    if e.ty(prev) == e.ty(dx) {
        for (dense, sparse) in [(prev, dx), (dx, prev)] {
            if let Some((idx, upd)) = scatter_into_zeros(e, sparse) {
                return e.op(Op::ScatterND { add: true }, &[dense, idx, upd]);
            }
        }
    }
    e.op(Op::Binary(BinaryOp::Add), &[prev, dx])
}

fn bin(e: &mut Emitter, op: BinaryOp, a: ValueId, b: ValueId) -> R<ValueId> {
    e.op(Op::Binary(op), &[a, b])
}

fn un(e: &mut Emitter, op: UnaryOp, a: ValueId) -> R<ValueId> {
    e.op(Op::Unary(op), &[a])
}

fn mul(e: &mut Emitter, a: ValueId, b: ValueId) -> R<ValueId> {
    bin(e, BinaryOp::Mul, a, b)
}

fn mulc(e: &mut Emitter, a: ValueId, c: f64) -> R<ValueId> {
    let s = e.scalar(c, e.ty(a).dtype);
    mul(e, a, s)
}

fn sub(e: &mut Emitter, a: ValueId, b: ValueId) -> R<ValueId> {
    bin(e, BinaryOp::Sub, a, b)
}

fn reshape(e: &mut Emitter, a: ValueId, shape: &[usize]) -> R<ValueId> {
    if e.shape(a) == shape {
        return Ok(a);
    }
    e.op(
        Op::Reshape {
            shape: shape.to_vec(),
        },
        &[a],
    )
}

fn reduce_keep(e: &mut Emitter, op: ReduceOp, a: ValueId, axes: Vec<usize>) -> R<ValueId> {
    e.op(
        Op::Reduce {
            op,
            axes,
            keep_dims: true,
        },
        &[a],
    )
}

/// Sums `g` (shaped like a broadcast result) down to `target`'s shape.
pub fn unbroadcast(e: &mut Emitter, g: ValueId, target: &[usize]) -> R<ValueId> {
    let s = e.shape(g);
    if s == target {
        return Ok(g);
    }
    let lead = s.len() - target.len().min(s.len());
    let axes: Vec<usize> = (0..s.len())
        .filter(|&i| i < lead || (target[i - lead] == 1 && s[i] != 1))
        .collect();
    let r = if axes.is_empty() {
        g
    } else {
        reduce_keep(e, ReduceOp::Sum, g, axes)?
    };
    reshape(e, r, target)
}

fn swap_last2(e: &mut Emitter, a: ValueId) -> R<ValueId> {
    let r = e.ty(a).rank();
    let mut perm: Vec<usize> = (0..r).collect();
    perm.swap(r - 2, r - 1);
    transpose(e, a, perm)
}

/// `Transpose{perm}(a)`, or the value `a` was transposed from when the two transposes undo
/// each other (the backward of `x @ Transpose(w)` reads `w` itself, not a copy of it).
fn transpose(e: &mut Emitter, a: ValueId, perm: Vec<usize>) -> R<ValueId> {
    if let ValueDef::Node { node, .. } = e.p.value(a).def {
        if let Some(n) = e.p.nodes.get(node.index()) {
            if let (Op::Transpose { perm: first }, [x]) = (&n.op, n.inputs.as_slice()) {
                // z[i] = x[first[perm[i]]]
                if first.len() == perm.len()
                    && perm
                        .iter()
                        .enumerate()
                        .all(|(i, &p)| first.get(p) == Some(&i))
                {
                    return Ok(*x);
                }
            }
        }
    }
    e.op(Op::Transpose { perm }, &[a])
}

/// The exchange run backwards: what rank r sent as chunk i of `split_axis` comes back from
/// rank i as chunk r of `concat_axis`.
fn all_to_all_rule(e: &mut Emitter, op: &Op, dy: ValueId) -> R<ValueId> {
    let Op::AllToAll {
        group,
        split_axis,
        concat_axis,
    } = op
    else {
        return Err("internal: not an AllToAll".to_string());
    };
    e.op(
        Op::AllToAll {
            group: group.clone(),
            split_axis: *concat_axis,
            concat_axis: *split_axis,
        },
        &[dy],
    )
}

fn where_(e: &mut Emitter, c: ValueId, a: ValueId, b: ValueId) -> R<ValueId> {
    e.op(Op::Where, &[c, a, b])
}

/// Gradient rule of one node: for each input, its gradient contribution (None = none).
fn rule(
    e: &mut Emitter,
    node: &Node,
    dys: &[Option<ValueId>],
    want: &[bool],
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    let outs = &node.outputs;
    // Most ops have one output; take its gradient.
    let dy = dys[0];
    let in_shape = |e: &Emitter, i: usize| e.shape(ins[i]);
    let none = |n: usize| vec![None; n];
    let Some(dy0) = dy.or_else(|| dys.iter().flatten().next().copied()) else {
        return Ok(none(ins.len()));
    };
    let r = match &node.op {
        Op::Identity | Op::Copy => vec![Some(dy0)],
        Op::Cast { to } => {
            let from = e.ty(ins[0]).dtype;
            if from.is_float() && to.is_float() {
                vec![Some(e.op(Op::Cast { to: from }, &[dy0])?)]
            } else {
                none(1)
            }
        }
        Op::Unary(u) => unary_rule(e, node, dy0, u)?,
        Op::Binary(b) => binary_rule(e, node, dy0, want, b)?,
        Op::Where => where_rule(e, node, dy0, want)?,
        Op::MatMul => matmul_rule(e, ins[0], ins[1], dy0, want)?,
        Op::Softmax { axis } => softmax_rule(e, outs[0], dy0, *axis)?,
        Op::LogSoftmax { axis } => log_softmax_rule(e, outs[0], dy0, *axis)?,
        Op::SoftmaxCrossEntropy { axis } => {
            let g = e.op(
                Op::SoftmaxCrossEntropyGrad { axis: *axis },
                &[ins[0], ins[1], dy0],
            )?;
            vec![Some(g), None]
        }
        Op::Attention { scale, causal } => attention_rule(e, node, dys, want, *scale, *causal)?,
        Op::LayerNorm { axis, epsilon } => norm_rule(e, ins, dy0, *axis, *epsilon, true, want)?,
        Op::RmsNorm { axis, epsilon } => norm_rule(e, ins, dy0, *axis, *epsilon, false, want)?,
        Op::Reduce {
            op,
            axes,
            keep_dims,
        } => reduce_rule(e, node, dy0, op, axes, keep_dims)?,
        Op::Reshape { .. } => vec![Some(reshape(e, dy0, &in_shape(e, 0))?)],
        Op::Transpose { perm } => transpose_rule(e, dy0, perm)?,
        Op::Expand { .. } => vec![Some(unbroadcast(e, dy0, &in_shape(e, 0))?)],
        Op::Tile { repeats } => tile_rule(e, node, dy0, repeats)?,
        Op::Concat { axis } => concat_rule(e, node, dy0, want, axis)?,
        Op::Split { axis, .. } => split_rule(e, node, dys, axis)?,
        Op::Slice {
            axes,
            starts,
            ends,
            steps,
        } => slice_rule(e, node, dy0, axes, starts, ends, steps)?,
        // the same op on the gradient
        Op::Trilu { .. }
        | Op::AllReduce {
            reduce: ReduceOp::Sum,
            ..
        } => {
            vec![Some(e.op(node.op.clone(), &[dy0])?)]
        }
        Op::AllToAll { .. } => vec![Some(all_to_all_rule(e, &node.op, dy0)?)],
        Op::CumSum {
            axis,
            exclusive,
            reverse,
        } => vec![Some(e.op(
            Op::CumSum {
                axis: *axis,
                exclusive: *exclusive,
                reverse: !*reverse,
            },
            &[dy0],
        )?)],
        Op::Gather { axis } => gather_op_rule(e, node, dy0, want, axis)?,
        Op::GatherElements { axis } => gather_elements_rule(e, node, dy0, axis)?,
        Op::GatherND { batch_dims } => gather_nd_rule(e, node, dy0, batch_dims)?,
        Op::TopK { axis, .. } => topk_rule(e, node, dys, axis)?,
        Op::MoeDispatch { .. } => moe_dispatch_rule(e, node, dys)?,
        Op::MoeCombine => moe_combine_rule(e, node, dy0, want)?,
        Op::ScatterElements { add: false, axis } => {
            scatter_elements_rule(e, node, dy0, want, axis)?
        }
        Op::ScatterND { add: false } => scatter_nd_rule(e, node, dy0, want)?,
        Op::ScatterElements { add: true, .. } | Op::ScatterND { add: true } => {
            scatter_add_rule(e, node, dy0, want)?
        }
        Op::AllGather { group, axis } => vec![Some(e.op(
            Op::ReduceScatter {
                group: group.clone(),
                axis: *axis,
                reduce: ReduceOp::Sum,
            },
            &[dy0],
        )?)],
        Op::ReduceScatter {
            group,
            axis,
            reduce: ReduceOp::Sum,
        } => vec![Some(e.op(
            Op::AllGather {
                group: group.clone(),
                axis: *axis,
            },
            &[dy0],
        )?)],
        // reductions other than a sum (the arms above take the sums)
        Op::AllReduce { reduce, .. } | Op::ReduceScatter { reduce, .. } => {
            return Err(format!(
                "no gradient rule for {} with reduce={}",
                node.op.name(),
                reduce.name()
            ))
        }
        // No gradient rule, listed by name so that a new op does not compile until it is
        // given a rule here or added to this list.
        Op::GeluTanhGrad
        | Op::SoftmaxCrossEntropyGrad { .. }
        | Op::LayerNormGrad { .. }
        | Op::RmsNormGrad { .. }
        | Op::AttentionGrad { .. }
        | Op::MoeCombineGrad
        | Op::ArgMax { .. }
        | Op::OneHot { .. }
        | Op::Fill { .. }
        | Op::AdamW { .. }
        | Op::Broadcast { .. }
        | Op::Free
        | Op::RecordEvent { .. }
        | Op::WaitEvent { .. } => return Err(format!("no gradient rule for {}", node.op.name())),
    };
    Ok(r)
}

fn softmax_rule(e: &mut Emitter, y: ValueId, dy0: ValueId, axis: usize) -> R<Vec<Option<ValueId>>> {
    let t = mul(e, dy0, y)?;
    let s = reduce_keep(e, ReduceOp::Sum, t, vec![axis])?;
    let d = sub(e, dy0, s)?;
    Ok(vec![Some(mul(e, y, d)?)])
}

fn log_softmax_rule(
    e: &mut Emitter,
    y: ValueId,
    dy0: ValueId,
    axis: usize,
) -> R<Vec<Option<ValueId>>> {
    let p = un(e, UnaryOp::Exp, y)?;
    let s = reduce_keep(e, ReduceOp::Sum, dy0, vec![axis])?;
    let t = mul(e, p, s)?;
    Ok(vec![Some(sub(e, dy0, t)?)])
}

/// The inverse permutation on the gradient.
fn transpose_rule(e: &mut Emitter, dy0: ValueId, perm: &[usize]) -> R<Vec<Option<ValueId>>> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    Ok(vec![Some(transpose(e, dy0, inv)?)])
}

fn unary_rule(e: &mut Emitter, node: &Node, dy0: ValueId, u: &UnaryOp) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    let outs = &node.outputs;
    let x = ins[0];
    let y = outs[0];
    let dt = e.ty(x).dtype;
    let g = match u {
        UnaryOp::Neg => Some(un(e, UnaryOp::Neg, dy0)?),
        UnaryOp::Abs => {
            let s = un(e, UnaryOp::Sign, x)?;
            Some(mul(e, dy0, s)?)
        }
        UnaryOp::Exp => Some(mul(e, dy0, y)?),
        UnaryOp::Log => Some(bin(e, BinaryOp::Div, dy0, x)?),
        UnaryOp::Sqrt => {
            let t = bin(e, BinaryOp::Div, dy0, y)?;
            Some(mulc(e, t, 0.5)?)
        }
        UnaryOp::Rsqrt => {
            let y2 = mul(e, y, y)?;
            let y3 = mul(e, y2, y)?;
            let t = mul(e, dy0, y3)?;
            Some(mulc(e, t, -0.5)?)
        }
        UnaryOp::Reciprocal => {
            let y2 = mul(e, y, y)?;
            let t = mul(e, dy0, y2)?;
            Some(un(e, UnaryOp::Neg, t)?)
        }
        UnaryOp::Tanh => {
            let y2 = mul(e, y, y)?;
            let one = e.scalar(1.0, dt);
            let d = sub(e, one, y2)?;
            Some(mul(e, dy0, d)?)
        }
        UnaryOp::Sigmoid => {
            let one = e.scalar(1.0, dt);
            let d = sub(e, one, y)?;
            let d = mul(e, y, d)?;
            Some(mul(e, dy0, d)?)
        }
        UnaryOp::Erf => {
            // 2/sqrt(pi) * exp(-x^2)
            let x2 = mul(e, x, x)?;
            let nx2 = un(e, UnaryOp::Neg, x2)?;
            let ex = un(e, UnaryOp::Exp, nx2)?;
            let d = mulc(e, ex, 2.0 / std::f64::consts::PI.sqrt())?;
            Some(mul(e, dy0, d)?)
        }
        UnaryOp::Relu => {
            let zero = e.scalar(0.0, dt);
            let pos = bin(e, BinaryOp::Greater, x, zero)?;
            Some(where_(e, pos, dy0, zero)?)
        }
        UnaryOp::Gelu => {
            // Phi(x) + x * phi(x)
            let xs = mulc(e, x, std::f64::consts::FRAC_1_SQRT_2)?;
            let erf = un(e, UnaryOp::Erf, xs)?;
            let one = e.scalar(1.0, dt);
            let cdf = bin(e, BinaryOp::Add, erf, one)?;
            let cdf = mulc(e, cdf, 0.5)?;
            let x2 = mul(e, x, x)?;
            let a = mulc(e, x2, -0.5)?;
            let pdf = un(e, UnaryOp::Exp, a)?;
            let pdf = mulc(e, pdf, 1.0 / (2.0 * std::f64::consts::PI).sqrt())?;
            let xp = mul(e, x, pdf)?;
            let d = bin(e, BinaryOp::Add, cdf, xp)?;
            Some(mul(e, dy0, d)?)
        }
        // one fused pass: dy * d/dx [0.5 x (1 + tanh(c (x + 0.044715 x^3)))]
        UnaryOp::GeluTanh => Some(e.op(Op::GeluTanhGrad, &[x, dy0])?),
        UnaryOp::Silu => {
            // s (1 + x (1 - s))
            let s = un(e, UnaryOp::Sigmoid, x)?;
            let one = e.scalar(1.0, dt);
            let oms = sub(e, one, s)?;
            let t = mul(e, x, oms)?;
            let t = bin(e, BinaryOp::Add, t, one)?;
            let d = mul(e, s, t)?;
            Some(mul(e, dy0, d)?)
        }
        UnaryOp::Sin => {
            let c = un(e, UnaryOp::Cos, x)?;
            Some(mul(e, dy0, c)?)
        }
        UnaryOp::Cos => {
            let s = un(e, UnaryOp::Sin, x)?;
            let t = mul(e, dy0, s)?;
            Some(un(e, UnaryOp::Neg, t)?)
        }
        // Piecewise constant: zero gradient almost everywhere.
        UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Sign => None,
        UnaryOp::Not | UnaryOp::IsNaN => None,
    };
    Ok(vec![g])
}

fn binary_rule(
    e: &mut Emitter,
    node: &Node,
    dy0: ValueId,
    want: &[bool],
    b: &BinaryOp,
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    let outs = &node.outputs;
    let in_shape = |e: &Emitter, i: usize| e.shape(ins[i]);
    let (x, y, out) = (ins[0], ins[1], outs[0]);
    let (sx, sy) = (in_shape(e, 0), in_shape(e, 1));
    let (gx, gy) = match b {
        BinaryOp::Add => (Some(dy0), Some(dy0)),
        BinaryOp::Sub => (Some(dy0), Some(un(e, UnaryOp::Neg, dy0)?)),
        BinaryOp::Mul => (
            if want[0] { Some(mul(e, dy0, y)?) } else { None },
            if want[1] { Some(mul(e, dy0, x)?) } else { None },
        ),
        BinaryOp::Div => {
            let gx = bin(e, BinaryOp::Div, dy0, y)?;
            let gy = if want[1] {
                let t = mul(e, gx, out)?;
                Some(un(e, UnaryOp::Neg, t)?)
            } else {
                None
            };
            (Some(gx), gy)
        }
        BinaryOp::Pow => {
            let gx = if want[0] {
                let one = e.scalar(1.0, e.ty(y).dtype);
                let ym1 = sub(e, y, one)?;
                let pw = bin(e, BinaryOp::Pow, x, ym1)?;
                let t = mul(e, pw, y)?;
                Some(mul(e, dy0, t)?)
            } else {
                None
            };
            let gy = if want[1] {
                let lx = un(e, UnaryOp::Log, x)?;
                let t = mul(e, out, lx)?;
                Some(mul(e, dy0, t)?)
            } else {
                None
            };
            (gx, gy)
        }
        BinaryOp::Max | BinaryOp::Min => {
            let cmp = if *b == BinaryOp::Max {
                BinaryOp::GreaterOrEqual
            } else {
                BinaryOp::LessOrEqual
            };
            let mask = bin(e, cmp, x, y)?;
            let zero = e.scalar(0.0, e.ty(dy0).dtype);
            (
                Some(where_(e, mask, dy0, zero)?),
                Some(where_(e, mask, zero, dy0)?),
            )
        }
        BinaryOp::Mod => (Some(dy0), None),
        // comparisons and logic give booleans: no gradient flows through them
        BinaryOp::Equal
        | BinaryOp::Less
        | BinaryOp::LessOrEqual
        | BinaryOp::Greater
        | BinaryOp::GreaterOrEqual
        | BinaryOp::And
        | BinaryOp::Or
        | BinaryOp::Xor => (None, None),
    };
    let gx = match gx {
        Some(g) if want[0] => Some(unbroadcast(e, g, &sx)?),
        _ => None,
    };
    let gy = match gy {
        Some(g) if want[1] => Some(unbroadcast(e, g, &sy)?),
        _ => None,
    };
    Ok(vec![gx, gy])
}

fn where_rule(
    e: &mut Emitter,
    node: &Node,
    dy0: ValueId,
    want: &[bool],
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    let in_shape = |e: &Emitter, i: usize| e.shape(ins[i]);
    let zero = e.scalar(0.0, e.ty(dy0).dtype);
    let c = ins[0];
    let gx = if want[1] {
        let g = where_(e, c, dy0, zero)?;
        Some(unbroadcast(e, g, &in_shape(e, 1))?)
    } else {
        None
    };
    let gy = if want[2] {
        let g = where_(e, c, zero, dy0)?;
        Some(unbroadcast(e, g, &in_shape(e, 2))?)
    } else {
        None
    };
    Ok(vec![None, gx, gy])
}

fn reduce_rule(
    e: &mut Emitter,
    node: &Node,
    dy0: ValueId,
    op: &ReduceOp,
    axes: &[usize],
    keep_dims: &bool,
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    let outs = &node.outputs;
    let x = ins[0];
    let xs = e.shape(x);
    let keep_shape: Vec<usize> = xs
        .iter()
        .enumerate()
        .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
        .collect();
    let _ = keep_dims;
    let dyk = reshape(e, dy0, &keep_shape)?;
    let count: usize = axes.iter().map(|&a| xs[a]).product();
    let g = match op {
        ReduceOp::Sum => e.op(Op::Expand { shape: xs.clone() }, &[dyk])?,
        ReduceOp::Mean => {
            let d = mulc(e, dyk, 1.0 / count as f64)?;
            e.op(Op::Expand { shape: xs.clone() }, &[d])?
        }
        ReduceOp::Max | ReduceOp::Min => {
            // Split evenly between tied extrema.
            let yk = reshape(e, outs[0], &keep_shape)?;
            let mask = bin(e, BinaryOp::Equal, x, yk)?;
            let dt = e.ty(x).dtype;
            let mf = e.op(Op::Cast { to: dt }, &[mask])?;
            let cnt = reduce_keep(e, ReduceOp::Sum, mf, axes.to_vec())?;
            let share = bin(e, BinaryOp::Div, dyk, cnt)?;
            mul(e, mf, share)?
        }
        ReduceOp::Prod => return Err("no gradient rule for Reduce prod".into()),
    };
    Ok(vec![Some(g)])
}

fn tile_rule(
    e: &mut Emitter,
    node: &Node,
    dy0: ValueId,
    repeats: &[usize],
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    let in_shape = |e: &Emitter, i: usize| e.shape(ins[i]);
    let xs = in_shape(e, 0);
    let mut inter = Vec::new();
    for (&r, &d) in repeats.iter().zip(&xs) {
        inter.push(r);
        inter.push(d);
    }
    let t = reshape(e, dy0, &inter)?;
    let axes: Vec<usize> = (0..xs.len()).map(|i| 2 * i).collect();
    let s = e.op(
        Op::Reduce {
            op: ReduceOp::Sum,
            axes,
            keep_dims: false,
        },
        &[t],
    )?;
    Ok(vec![Some(reshape(e, s, &xs)?)])
}

fn concat_rule(
    e: &mut Emitter,
    node: &Node,
    dy0: ValueId,
    want: &[bool],
    axis: &usize,
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    let in_shape = |e: &Emitter, i: usize| e.shape(ins[i]);
    let mut off = 0i64;
    let mut r = Vec::new();
    for (i, &wanted) in want.iter().enumerate() {
        let len = in_shape(e, i)[*axis] as i64;
        if wanted {
            r.push(Some(e.op(
                Op::Slice {
                    axes: vec![*axis],
                    starts: vec![off],
                    ends: vec![off + len],
                    steps: vec![1],
                },
                &[dy0],
            )?));
        } else {
            r.push(None);
        }
        off += len;
    }
    Ok(r)
}

fn split_rule(
    e: &mut Emitter,
    node: &Node,
    dys: &[Option<ValueId>],
    axis: &usize,
) -> R<Vec<Option<ValueId>>> {
    let outs = &node.outputs;
    let mut parts = Vec::new();
    for (k, &o) in outs.iter().enumerate() {
        parts.push(match dys[k] {
            Some(d) => d,
            None => {
                let ty = e.ty(o).clone();
                e.zeros(&ty)?
            }
        });
    }
    Ok(vec![Some(e.op(Op::Concat { axis: *axis }, &parts)?)])
}

fn slice_rule(
    e: &mut Emitter,
    node: &Node,
    dy0: ValueId,
    axes: &[usize],
    starts: &[i64],
    ends: &[i64],
    steps: &[i64],
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    let in_shape = |e: &Emitter, i: usize| e.shape(ins[i]);
    let xs = in_shape(e, 0);
    let mut cur = dy0;
    for (((&a, &st), &en), &step) in axes.iter().zip(starts).zip(ends).zip(steps) {
        if step == 1 && en >= st {
            cur = pad_axis(e, cur, a, st as usize, xs[a] - en as usize)?;
        } else {
            cur = strided_slice_grad(e, cur, a, st, step, xs[a])?;
        }
    }
    Ok(vec![Some(cur)])
}

fn gather_op_rule(
    e: &mut Emitter,
    node: &Node,
    dy0: ValueId,
    want: &[bool],
    axis: &usize,
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    let none = |n: usize| vec![None; n];
    if !want[0] {
        return Ok(none(2));
    }
    Ok(vec![
        Some(gather_rule(e, ins[0], ins[1], dy0, *axis)?),
        None,
    ])
}

fn gather_elements_rule(
    e: &mut Emitter,
    node: &Node,
    dy0: ValueId,
    axis: &usize,
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    let ty = e.ty(ins[0]).clone();
    let z = e.zeros(&ty)?;
    Ok(vec![
        Some(e.op(
            Op::ScatterElements {
                axis: *axis,
                add: true,
            },
            &[z, ins[1], dy0],
        )?),
        None,
    ])
}

fn gather_nd_rule(
    e: &mut Emitter,
    node: &Node,
    dy0: ValueId,
    batch_dims: &usize,
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    if *batch_dims != 0 {
        return Err("no gradient rule for GatherND with batch_dims > 0".into());
    }
    let ty = e.ty(ins[0]).clone();
    let z = e.zeros(&ty)?;
    Ok(vec![
        Some(e.op(Op::ScatterND { add: true }, &[z, ins[1], dy0])?),
        None,
    ])
}

fn topk_rule(
    e: &mut Emitter,
    node: &Node,
    dys: &[Option<ValueId>],
    axis: &usize,
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    let outs = &node.outputs;
    let none = |n: usize| vec![None; n];
    let Some(dv) = dys[0] else {
        return Ok(none(1));
    };
    let ty = e.ty(ins[0]).clone();
    let z = e.zeros(&ty)?;
    Ok(vec![Some(e.op(
        Op::ScatterElements {
            axis: *axis,
            add: true,
        },
        &[z, outs[1], dv],
    )?)])
}

/// The tokens' gradient is the dispatched gradient read back at each kept choice's row and
/// summed over the choices: a combine with weight one.
fn moe_dispatch_rule(
    e: &mut Emitter,
    node: &Node,
    dys: &[Option<ValueId>],
) -> R<Vec<Option<ValueId>>> {
    let (choices, slots) = (node.inputs[1], node.outputs[1]);
    let Some(dd) = dys[0] else {
        return Ok(vec![None, None]);
    };
    let dtype = e.ty(node.inputs[0]).dtype;
    let ones = e.op(
        Op::Fill {
            value: 1.0,
            dtype,
            shape: e.shape(choices),
        },
        &[],
    )?;
    let dx = e.op(Op::MoeCombine, &[dd, choices, slots, ones])?;
    Ok(vec![Some(dx), None])
}

/// One `MoeCombineGrad` node gives the experts' outputs' and the weights' gradients.
fn moe_combine_rule(
    e: &mut Emitter,
    node: &Node,
    dy0: ValueId,
    want: &[bool],
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    let g = e.ops(Op::MoeCombineGrad, &[ins[0], ins[1], ins[2], ins[3], dy0])?;
    Ok(vec![
        want[0].then_some(g[0]),
        None,
        None,
        want[3].then_some(g[1]),
    ])
}

fn scatter_elements_rule(
    e: &mut Emitter,
    node: &Node,
    dy0: ValueId,
    want: &[bool],
    axis: &usize,
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    // data: the output gradient where nothing was written over it; updates: the
    // output gradient at the written positions
    let gd = if want[0] {
        let ty = e.ty(ins[2]).clone();
        let z = e.zeros(&ty)?;
        Some(e.op(
            Op::ScatterElements {
                axis: *axis,
                add: false,
            },
            &[dy0, ins[1], z],
        )?)
    } else {
        None
    };
    let gu = if want[2] {
        Some(e.op(Op::GatherElements { axis: *axis }, &[dy0, ins[1]])?)
    } else {
        None
    };
    Ok(vec![gd, None, gu])
}

fn scatter_nd_rule(
    e: &mut Emitter,
    node: &Node,
    dy0: ValueId,
    want: &[bool],
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    let gd = if want[0] {
        let ty = e.ty(ins[2]).clone();
        let z = e.zeros(&ty)?;
        Some(e.op(Op::ScatterND { add: false }, &[dy0, ins[1], z])?)
    } else {
        None
    };
    let gu = if want[2] {
        Some(e.op(Op::GatherND { batch_dims: 0 }, &[dy0, ins[1]])?)
    } else {
        None
    };
    Ok(vec![gd, None, gu])
}

fn scatter_add_rule(
    e: &mut Emitter,
    node: &Node,
    dy0: ValueId,
    want: &[bool],
) -> R<Vec<Option<ValueId>>> {
    let ins = &node.inputs;
    // data passes through; updates' gradient gathers the output gradient
    let gu = if want[2] {
        Some(match &node.op {
            Op::ScatterElements { axis, .. } => {
                e.op(Op::GatherElements { axis: *axis }, &[dy0, ins[1]])?
            }
            _ => e.op(Op::GatherND { batch_dims: 0 }, &[dy0, ins[1]])?,
        })
    } else {
        None
    };
    Ok(vec![Some(dy0), None, gu])
}

/// `g` with `before` and `after` zeros added along `axis`.
fn pad_axis(e: &mut Emitter, g: ValueId, axis: usize, before: usize, after: usize) -> R<ValueId> {
    let cs = e.shape(g);
    let dt = e.ty(g).dtype;
    let mut parts = Vec::new();
    for (n, last) in [(before, false), (after, true)] {
        if last {
            parts.push(g);
        }
        if n > 0 {
            let mut s = cs.clone();
            s[axis] = n;
            parts.push(e.zeros(&hzp_ir::TensorType::new(dt, s))?);
        }
    }
    if parts.len() == 1 {
        return Ok(g);
    }
    e.op(Op::Concat { axis }, &parts)
}

/// The gradient of a Slice along one axis with a step other than 1 (`start` normalized as
/// the Slice op holds it): element i of `g` goes to position start + i * step of an axis
/// of `dim`, zeros elsewhere. A negative step is a reversed slice with step |step|; the
/// gaps are zeros concatenated beside each element (via an extra axis) and reshaped away.
fn strided_slice_grad(
    e: &mut Emitter,
    g: ValueId,
    axis: usize,
    start: i64,
    step: i64,
    dim: usize,
) -> R<ValueId> {
    let gs = e.shape(g);
    let count = gs[axis];
    let dt = e.ty(g).dtype;
    if count == 0 {
        let mut s = gs;
        s[axis] = dim;
        return e.zeros(&hzp_ir::TensorType::new(dt, s));
    }
    let (mut g, lo) = if step < 0 {
        let flipped = e.op(
            Op::Slice {
                axes: vec![axis],
                starts: vec![count as i64 - 1],
                ends: vec![-1],
                steps: vec![-1],
            },
            &[g],
        )?;
        (flipped, start + (count as i64 - 1) * step)
    } else {
        (g, start)
    };
    let k = step.unsigned_abs() as usize;
    let lo = usize::try_from(lo).map_err(|_| format!("Slice start {start} out of range"))?;
    if k > 1 {
        let mut s1 = gs.clone();
        s1.insert(axis + 1, 1);
        let g1 = reshape(e, g, &s1)?;
        let mut sz = s1.clone();
        sz[axis + 1] = k - 1;
        let z = e.zeros(&hzp_ir::TensorType::new(dt, sz))?;
        let spread = e.op(Op::Concat { axis: axis + 1 }, &[g1, z])?;
        let mut s2 = gs.clone();
        s2[axis] = count * k;
        g = reshape(e, spread, &s2)?;
        // keep (count - 1) * k + 1 elements at least, and no more than fit after `lo`
        let keep = (count * k).min(dim.saturating_sub(lo));
        if keep < count * k {
            g = e.op(
                Op::Slice {
                    axes: vec![axis],
                    starts: vec![0],
                    ends: vec![keep as i64],
                    steps: vec![1],
                },
                &[g],
            )?;
        }
    }
    let len = e.shape(g)[axis];
    let after = dim
        .checked_sub(lo + len)
        .ok_or_else(|| format!("Slice positions run past the axis of {dim}"))?;
    pad_axis(e, g, axis, lo, after)
}

fn matmul_rule(
    e: &mut Emitter,
    a: ValueId,
    b: ValueId,
    dy: ValueId,
    want: &[bool],
) -> R<Vec<Option<ValueId>>> {
    let sa = e.shape(a);
    let sb = e.shape(b);
    // Promote rank-1 operands the way matmul does, so both are at least rank 2.
    let sa2 = if sa.len() == 1 {
        vec![1, sa[0]]
    } else {
        sa.clone()
    };
    let sb2 = if sb.len() == 1 {
        vec![sb[0], 1]
    } else {
        sb.clone()
    };
    let a2 = reshape(e, a, &sa2)?;
    let b2 = reshape(e, b, &sb2)?;
    let batch = hzp_ir::broadcast_shapes(&sa2[..sa2.len() - 2], &sb2[..sb2.len() - 2])
        .ok_or("MatMul batch dims do not broadcast")?;
    let mut sy2 = batch;
    sy2.push(sa2[sa2.len() - 2]);
    sy2.push(sb2[sb2.len() - 1]);
    let dy2 = reshape(e, dy, &sy2)?;
    let ga = if want[0] {
        let bt = swap_last2(e, b2)?;
        let g = e.op(Op::MatMul, &[dy2, bt])?;
        let g = unbroadcast(e, g, &sa2)?;
        Some(reshape(e, g, &sa)?)
    } else {
        None
    };
    let gb = if want[1] && sb2.len() == 2 && sa2.len() > 2 {
        // b is one matrix (a weight) read by every batch entry of a: fold the batch into
        // the rows, one product [k, B*m] @ [B*m, n] instead of B products and a sum
        let (k, n) = (sb2[0], sb2[1]);
        let rows: usize = sa2[..sa2.len() - 1].iter().product();
        let af = reshape(e, a2, &[rows, k])?;
        let dyf = reshape(e, dy2, &[rows, n])?;
        let at = swap_last2(e, af)?;
        let g = e.op(Op::MatMul, &[at, dyf])?;
        Some(reshape(e, g, &sb)?)
    } else if want[1] {
        let at = swap_last2(e, a2)?;
        let g = e.op(Op::MatMul, &[at, dy2])?;
        let g = unbroadcast(e, g, &sb2)?;
        Some(reshape(e, g, &sb)?)
    } else {
        None
    };
    Ok(vec![ga, gb])
}

/// LayerNorm (`centered`) and RmsNorm: gradients of x, scale and (LayerNorm) bias. One
/// [`Op::LayerNormGrad`] / [`Op::RmsNormGrad`] recomputes the statistics and gives dx and
/// dy * xhat (the scale's gradient before its sum over the leading axes); the bias's
/// gradient is dy summed the same way.
fn norm_rule(
    e: &mut Emitter,
    ins: &[ValueId],
    dy: ValueId,
    axis: usize,
    eps: f32,
    centered: bool,
    want: &[bool],
) -> R<Vec<Option<ValueId>>> {
    let (x, scale) = (ins[0], ins[1]);
    let mut r = vec![None; ins.len()];
    if want[0] || want[1] {
        let op = if centered {
            Op::LayerNormGrad { axis, epsilon: eps }
        } else {
            Op::RmsNormGrad { axis, epsilon: eps }
        };
        let outs = e.ops(op, &[x, scale, dy])?;
        if want[0] {
            r[0] = Some(outs[0]);
        }
        if want[1] {
            let ss = e.shape(scale);
            r[1] = Some(unbroadcast(e, outs[1], &ss)?);
        }
    }
    if ins.len() > 2 && want[2] {
        let bs = e.shape(ins[2]);
        r[2] = Some(unbroadcast(e, dy, &bs)?);
    }
    Ok(r)
}

/// Attention: one [`Op::AttentionGrad`] gives dq, dk and dv from the saved output and
/// log-sum-exp (nothing of size T x S is kept between the passes). A mask that needs a
/// gradient (a learned position bias, as T5's) gets `dS = P (dO Vᵀ - rowsum(dO O))`,
/// computed explicitly from the same saved statistics and summed to the mask's shape: that
/// part is T x S, as the explicit graph's would be.
fn attention_rule(
    e: &mut Emitter,
    node: &Node,
    dys: &[Option<ValueId>],
    want: &[bool],
    scale: f64,
    causal: bool,
) -> R<Vec<Option<ValueId>>> {
    let (ins, outs) = (&node.inputs, &node.outputs);
    let mut r = vec![None; ins.len()];
    if dys.get(1).is_some_and(Option::is_some) {
        return Err(
            "the log-sum-exp output of Attention is not differentiable here (only its output o is)"
                .into(),
        );
    }
    let Some(dout) = dys[0] else {
        return Ok(r);
    };
    let (q, k, v, o, lse) = (ins[0], ins[1], ins[2], outs[0], outs[1]);
    if want[..3].iter().any(|&w| w) {
        let mut args = vec![q, k, v, o, lse, dout];
        args.extend(ins.get(3).copied());
        let g = e.ops(Op::AttentionGrad { scale, causal }, &args)?;
        for i in 0..3 {
            if want[i] {
                r[i] = Some(g[i]);
            }
        }
    }
    if ins.len() > 3 && want[3] {
        r[3] = Some(attention_mask_grad(e, ins, o, lse, dout, scale, causal)?);
    }
    Ok(r)
}

/// The gradient of an attention's additive mask: the score gradient `P (dP - D)` with
/// `P = exp(S - lse)` (zero on fully masked rows), summed to the mask's shape.
fn attention_mask_grad(
    e: &mut Emitter,
    ins: &[ValueId],
    o: ValueId,
    lse: ValueId,
    dout: ValueId,
    scale: f64,
    causal: bool,
) -> R<ValueId> {
    let (q, k, v, mask) = (ins[0], ins[1], ins[2], ins[3]);
    let (qs, ks) = (e.shape(q), e.shape(k));
    let dt = e.ty(q).dtype;
    let (b, hq, t, hkv, s) = (qs[0], qs[1], qs[2], ks[1], ks[2]);
    // key/value heads repeated to the query heads (h reads h / g)
    let repeat = |e: &mut Emitter, x: ValueId| -> R<ValueId> {
        if hkv == hq {
            return Ok(x);
        }
        let xs = e.shape(x);
        let g = hq / hkv;
        let x = reshape(e, x, &[b, hkv, 1, xs[2], xs[3]])?;
        let x = e.op(
            Op::Expand {
                shape: vec![b, hkv, g, xs[2], xs[3]],
            },
            &[x],
        )?;
        reshape(e, x, &[b, hq, xs[2], xs[3]])
    };
    let kr = repeat(e, k)?;
    let vr = repeat(e, v)?;
    let kt = swap_last2(e, kr)?;
    let sc = e.op(Op::MatMul, &[q, kt])?;
    let sc = mulc(e, sc, scale)?;
    let mut sc = bin(e, BinaryOp::Add, sc, mask)?;
    if causal {
        let ninf = e.op(
            Op::Fill {
                value: f64::NEG_INFINITY,
                dtype: dt,
                shape: vec![t, s],
            },
            &[],
        )?;
        let above = e.op(Op::Trilu { upper: true, k: 1 }, &[ninf])?;
        sc = bin(e, BinaryOp::Add, sc, above)?;
    }
    let l = reshape(e, lse, &[b, hq, t, 1])?;
    let l = if dt == DType::F32 {
        l
    } else {
        e.op(Op::Cast { to: dt }, &[l])?
    };
    let ninf = e.scalar(f64::NEG_INFINITY, dt);
    let dead = bin(e, BinaryOp::Equal, l, ninf)?;
    let zero = e.scalar(0.0, dt);
    let l = where_(e, dead, zero, l)?;
    let p = sub(e, sc, l)?;
    let p = un(e, UnaryOp::Exp, p)?;
    let p = where_(e, dead, zero, p)?;
    let vt = swap_last2(e, vr)?;
    let dp = e.op(Op::MatMul, &[dout, vt])?;
    let od = mul(e, dout, o)?;
    let dsum = reduce_keep(e, ReduceOp::Sum, od, vec![3])?;
    let dp = sub(e, dp, dsum)?;
    let ds = mul(e, p, dp)?;
    let ms = e.shape(mask);
    unbroadcast(e, ds, &ms)
}

/// Gather's gradient: scatter-add the output gradient into zeros shaped like the data.
fn gather_rule(
    e: &mut Emitter,
    data: ValueId,
    idx: ValueId,
    dy: ValueId,
    axis: usize,
) -> R<ValueId> {
    let ds = e.shape(data);
    let is = e.shape(idx);
    let dt = e.ty(data).dtype;
    let ri = is.len();
    let rd = ds.len();
    // Move the index dims of dy to the front: [I..., D[:axis]..., D[axis+1..]...].
    let dyt = if axis == 0 {
        dy
    } else {
        let mut perm: Vec<usize> = (axis..axis + ri).collect();
        perm.extend(0..axis);
        perm.extend(axis + ri..rd - 1 + ri);
        e.op(Op::Transpose { perm }, &[dy])?
    };
    let mut zshape = vec![ds[axis]];
    zshape.extend(&ds[..axis]);
    zshape.extend(&ds[axis + 1..]);
    let z = e.zeros(&hzp_ir::TensorType::new(dt, zshape))?;
    let mut ishape = is.clone();
    ishape.push(1);
    let idx1 = reshape(e, idx, &ishape)?;
    let s = e.op(Op::ScatterND { add: true }, &[z, idx1, dyt])?;
    if axis == 0 {
        return Ok(s);
    }
    let mut back: Vec<usize> = (1..=axis).collect();
    back.push(0);
    back.extend(axis + 1..rd);
    e.op(Op::Transpose { perm: back }, &[s])
}
