//! Normalizations and softmax: LayerNormalization, RMSNormalization (and com.microsoft's SimplifiedLayerNormalization), Softmax, LogSoftmax and the masked-softmax guards.

use super::*;

/// The default-domain ONNX ops of this family and their rules.
pub(super) const OPS: &[(&str, Rule)] = &[
    ("LayerNormalization", layer_norm),
    ("LogSoftmax", softmax),
    ("RMSNormalization", rms_norm),
    ("Softmax", softmax),
];

pub(super) fn layer_norm(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let scale = n.req(1)?.clone();
    let r = cx.shape(&x).len();
    let axis = norm_axis(n.attr_i("axis", -1)?, r, "axis")?;
    let epsilon = n.attr_f("epsilon", 1e-5)?;
    let mut ins = vec![x, scale];
    if let Some(b) = n.input(2) {
        ins.push(b.clone());
    }
    let x = ins[0].clone();
    let out = out_name(cx, n, 0);
    let y = emit1(cx, &n.ir_name, Op::LayerNorm { axis, epsilon }, &ins, out)?;
    let wanted = |k: usize| n.p.output.get(k).is_some_and(|o| !o.is_empty());
    if !wanted(1) && !wanted(2) {
        return one(y);
    }
    // Mean and InvStdDev (in f32, ONNX's default stash type), written out; dead code
    // elimination drops them when nothing reads them.
    let name = n.ir_name.clone();
    let mut b = Builder {
        cx,
        n,
        name: &name,
        dt: DType::F32,
    };
    let xf = if b.cx.dtype(&x) == DType::F32 {
        x
    } else {
        b.tmp(Op::Cast { to: DType::F32 }, &[x], "stash")?
    };
    let mean_op = Op::Reduce {
        op: ReduceOp::Mean,
        axes: (axis..r).collect(),
        keep_dims: true,
    };
    let mean_name = out_name(b.cx, n, 1);
    let mean = emit1(
        b.cx,
        &name,
        mean_op.clone(),
        std::slice::from_ref(&xf),
        mean_name,
    )?;
    let d = b.bin(BinaryOp::Sub, &xf, &mean, "centered")?;
    let sq = b.bin(BinaryOp::Mul, &d, &d, "squared")?;
    let var = b.tmp(mean_op, &[sq], "variance")?;
    let eps = b.k(epsilon as f64);
    let ve = b.bin(BinaryOp::Add, &var, &eps, "variance_eps")?;
    let sd = b.un(UnaryOp::Sqrt, &ve, "stddev")?;
    let inv_name = out_name(b.cx, n, 2);
    let inv = emit1(b.cx, &name, Op::Unary(UnaryOp::Reciprocal), &[sd], inv_name)?;
    Ok(vec![Some(y), Some(mean), Some(inv)])
}

pub(super) fn rms_norm(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let scale = n.req(1)?.clone();
    let r = cx.shape(&x).len();
    let axis = norm_axis(n.attr_i("axis", -1)?, r, "axis")?;
    let epsilon = n.attr_f("epsilon", 1e-5)?;
    let out = out_name(cx, n, 0);
    one(emit1(
        cx,
        &n.ir_name,
        Op::RmsNorm { axis, epsilon },
        &[x, scale],
        out,
    )?)
}

/// Softmax and LogSoftmax over one axis.
pub(super) fn softmax(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let op_type = n.p.op_type.as_str();
    let x = n.req(0)?.clone();
    let axis = norm_axis(n.attr_i("axis", -1)?, cx.shape(&x).len(), "axis")?;
    let op = if op_type == "Softmax" {
        Op::Softmax { axis }
    } else {
        Op::LogSoftmax { axis }
    };
    let out = out_name(cx, n, 0);
    one(emit1(cx, &name, op, &[x], out)?)
}

/// `Where(IsNaN(s), 0, s)` with `s = Softmax(x)`: how both exporters write PyTorch's "safe"
/// softmax of attention (a row whose every score is masked to -inf gives zeros, not NaN).
/// Returns `x` and the softmax axis. Kept as written, such a row's NaNs would still reach
/// the gradient (the softmax backward multiplies by its NaN output), so the pattern is
/// rebuilt by [`safe_softmax`].
pub(super) fn nan_guarded_softmax(cx: &Ctx, ins: &[Slot; 3]) -> Option<(Slot, usize)> {
    let (Slot::Val(c), Slot::Val(s)) = (&ins[0], &ins[2]) else {
        return None;
    };
    let zero = ins[1].as_const()?;
    if zero.numel() != 1 || zero.to_f64_vec()[0] != 0.0 {
        return None;
    }
    let p = &cx.prog;
    let guard = p.node(p.producer(*c)?);
    if guard.op != Op::Unary(UnaryOp::IsNaN) || guard.inputs[0] != *s {
        return None;
    }
    let sm = p.node(p.producer(*s)?);
    match sm.op {
        Op::Softmax { axis } => Some((Slot::Val(sm.inputs[0]), axis)),
        _ => None,
    }
}

/// Whether `x` is attention scores plus a constant mask none of whose rows along `axis` is
/// all -inf (a causal mask): `Add(scores, mask)` with the scores a MatMul, possibly scaled
/// by a constant. Then no softmax row over `axis` can be fully masked.
pub(super) fn never_fully_masked(cx: &Ctx, x: &Slot, axis: usize) -> bool {
    let Slot::Val(x) = x else {
        return false;
    };
    let p = &cx.prog;
    let Some(add) = p.producer(*x).map(|i| p.node(i)) else {
        return false;
    };
    if add.op != Op::Binary(BinaryOp::Add) {
        return false;
    }
    let rank = p.ty(*x).rank();
    let is_scores = |v: hzp_ir::ValueId| {
        let Some(node) = p.producer(v).map(|i| p.node(i)) else {
            return false;
        };
        match node.op {
            Op::MatMul => true,
            Op::Binary(BinaryOp::Mul | BinaryOp::Div) => {
                node.inputs
                    .iter()
                    .any(|&i| p.producer(i).is_some_and(|j| p.node(j).op == Op::MatMul))
                    && node.inputs.iter().any(|&i| p.const_data(i).is_some())
            }
            _ => false,
        }
    };
    let (a, b) = (add.inputs[0], add.inputs[1]);
    let (scores, mask) = match (p.const_data(a), p.const_data(b)) {
        (None, Some(m)) => (a, m),
        (Some(m), None) => (b, m),
        _ => return false,
    };
    if !is_scores(scores) || mask.shape.len() > rank {
        return false;
    }
    // The mask as rank `rank`; a row along `axis` is all -inf iff every element of it is.
    let mut shape = vec![1; rank - mask.shape.len()];
    shape.extend(&mask.shape);
    let len = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let vals = mask.to_f64_vec();
    if len == 0 || inner == 0 {
        return false;
    }
    let outer = vals.len() / (len * inner);
    for o in 0..outer {
        for i in 0..inner {
            if (0..len).all(|k| vals[(o * len + k) * inner + i] == f64::NEG_INFINITY) {
                return false;
            }
        }
    }
    true
}

/// Softmax over `axis` that gives zeros for a row of only -inf (ONNX Attention's and
/// PyTorch's convention) with finite gradients: such rows are detected on the input (max
/// is -inf), zeroed before the softmax and zeroed again after it.
pub(super) fn safe_softmax(
    cx: &mut Ctx,
    n: &NodeCx,
    x: Slot,
    axis: usize,
    out: String,
) -> FResult<Slot> {
    let name = n.ir_name.clone();
    let dt = cx.dtype(&x);
    let mut b = Builder {
        cx,
        n,
        name: &name,
        dt,
    };
    let max = b.tmp(
        Op::Reduce {
            op: ReduceOp::Max,
            axes: vec![axis],
            keep_dims: true,
        },
        std::slice::from_ref(&x),
        "row_max",
    )?;
    let ninf = b.k(f64::NEG_INFINITY);
    let zero = b.k(0.0);
    let dead = b.bin(BinaryOp::Equal, &max, &ninf, "row_masked")?;
    let finite = b.tmp(Op::Where, &[dead.clone(), zero.clone(), x], "finite_rows")?;
    let y = b.tmp(Op::Softmax { axis }, &[finite], "softmax")?;
    emit1(b.cx, &name, Op::Where, &[dead, zero, y], out)
}
