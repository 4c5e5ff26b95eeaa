//! Indexing and generated values: Gather / Scatter families, OneHot, TopK, ArgMax / ArgMin, Trilu, CumSum, Range, constants.

use super::*;

/// The default-domain ONNX ops of this family and their rules.
pub(super) const OPS: &[(&str, Rule)] = &[
    ("ArgMax", argmax),
    ("ArgMin", argmax),
    ("Constant", constant),
    ("ConstantOfShape", constant_of_shape),
    ("CumSum", cumsum),
    ("Gather", gather),
    ("GatherElements", gather),
    ("GatherND", gather_nd),
    ("OneHot", one_hot),
    ("Range", range),
    ("ScatterElements", scatter),
    ("ScatterND", scatter),
    ("TopK", top_k),
    ("Trilu", trilu),
];

/// Gather and GatherElements along `axis`.
pub(super) fn gather(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let op_type = n.p.op_type.as_str();
    let (d, i) = (n.req(0)?.clone(), n.req(1)?.clone());
    let axis = norm_axis(n.attr_i("axis", 0)?, cx.shape(&d).len(), "axis")?;
    let op = if op_type == "Gather" {
        Op::Gather { axis }
    } else {
        Op::GatherElements { axis }
    };
    let out = out_name(cx, n, 0);
    one(emit1(cx, &name, op, &[d, i], out)?)
}

/// GatherND with `batch_dims`.
pub(super) fn gather_nd(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let (d, i) = (n.req(0)?.clone(), n.req(1)?.clone());
    let b = n.attr_i("batch_dims", 0)?;
    let batch_dims =
        usize::try_from(b).map_err(|_| node_err(format!("batch_dims {b} is negative")))?;
    let out = out_name(cx, n, 0);
    one(emit1(cx, &name, Op::GatherND { batch_dims }, &[d, i], out)?)
}

/// ScatterElements and ScatterND (reduction none or add).
pub(super) fn scatter(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let op_type = n.p.op_type.as_str();
    let ins = [n.req(0)?.clone(), n.req(1)?.clone(), n.req(2)?.clone()];
    let add = match n.attr_s("reduction")?.as_deref() {
        None | Some("none") => false,
        Some("add") => true,
        Some(r) => {
            return unsupported(format!(
                "reduction=`{r}` is not supported (hzp has none and add)"
            ))
        }
    };
    let op = if op_type == "ScatterElements" {
        let axis = norm_axis(n.attr_i("axis", 0)?, cx.shape(&ins[0]).len(), "axis")?;
        Op::ScatterElements { axis, add }
    } else {
        Op::ScatterND { add }
    };
    let out = out_name(cx, n, 0);
    one(emit1(cx, &name, op, &ins, out)?)
}

/// OneHot with a constant depth.
pub(super) fn one_hot(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let mut idx = n.req(0)?.clone();
    if cx.dtype(&idx).is_float() {
        // ONNX takes any numeric indices; hzp's OneHot takes integers.
        let t = tmp(cx, n, "indices");
        idx = emit1(cx, &name, Op::Cast { to: DType::I64 }, &[idx], t)?;
    }
    let d = int_scalar(cx.static_input(n, 1, "the depth")?, "the depth")?;
    let depth = usize::try_from(d).map_err(|_| node_err(format!("depth {d} is negative")))?;
    let values = n.req(2)?.clone();
    let axis = norm_axis(n.attr_i("axis", -1)?, cx.shape(&idx).len() + 1, "axis")?;
    let out = out_name(cx, n, 0);
    one(emit1(
        cx,
        &name,
        Op::OneHot { axis, depth },
        &[idx, values],
        out,
    )?)
}

/// TopK with a constant k: values and indices.
pub(super) fn top_k(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let x = n.req(0)?.clone();
    let k = int_scalar(cx.static_input(n, 1, "k")?, "k")?;
    let k = usize::try_from(k).map_err(|_| node_err(format!("k {k} is negative")))?;
    let axis = norm_axis(n.attr_i("axis", -1)?, cx.shape(&x).len(), "axis")?;
    let op = Op::TopK {
        axis,
        k,
        largest: n.attr_i("largest", 1)? != 0,
        sorted: n.attr_i("sorted", 1)? != 0,
    };
    let outs = vec![out_name(cx, n, 0), out_name(cx, n, 1)];
    let r = cx.emit(&name, op, &[x], outs)?;
    Ok(r.into_iter().map(Some).collect())
}

pub(super) fn argmax(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let mut x = n.req(0)?.clone();
    let r = cx.shape(&x).len();
    let axis = norm_axis(n.attr_i("axis", 0)?, r, "axis")?;
    let keep_dims = n.attr_i("keepdims", 1)? != 0;
    let last = n.attr_i("select_last_index", 0)? != 0;
    let dim = cx.shape(&x)[axis];
    if last && dim > 1 {
        // The last extremum is the first one of the reversed axis.
        let t = tmp(cx, n, "reversed");
        let op = Op::Slice {
            axes: vec![axis],
            starts: vec![dim as i64 - 1],
            ends: vec![-1],
            steps: vec![-1],
        };
        x = emit1(cx, &n.ir_name, op, &[x], t)?;
    }
    if n.p.op_type == "ArgMin" {
        // The first minimum of x is the first maximum of -x.
        if cx.dtype(&x) == DType::Bool {
            return err("ArgMin of bool is not supported");
        }
        let t = tmp(cx, n, "neg");
        x = emit1(cx, &n.ir_name, Op::Unary(UnaryOp::Neg), &[x], t)?;
    }
    if !(last && dim > 1) {
        let out = out_name(cx, n, 0);
        return one(emit1(
            cx,
            &n.ir_name,
            Op::ArgMax { axis, keep_dims },
            &[x],
            out,
        )?);
    }
    let t = tmp(cx, n, "reversed_index");
    let i = emit1(cx, &n.ir_name, Op::ArgMax { axis, keep_dims }, &[x], t)?;
    let top = cx.scalar(DType::I64, dim as f64 - 1.0, &format!("{}/last", n.ir_name));
    let out = out_name(cx, n, 0);
    one(emit1(
        cx,
        &n.ir_name,
        Op::Binary(BinaryOp::Sub),
        &[top, i],
        out,
    )?)
}

/// Trilu: the upper or lower triangle with diagonal offset `k`.
pub(super) fn trilu(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let x = n.req(0)?.clone();
    let k = match n.input(1) {
        Some(_) => int_scalar(cx.static_input(n, 1, "k")?, "k")?,
        None => 0,
    };
    let op = Op::Trilu {
        upper: n.attr_i("upper", 1)? != 0,
        k,
    };
    let out = out_name(cx, n, 0);
    one(emit1(cx, &name, op, &[x], out)?)
}

/// CumSum over a constant axis.
pub(super) fn cumsum(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let x = n.req(0)?.clone();
    let a = int_scalar(cx.static_input(n, 1, "the axis")?, "the axis")?;
    let axis = norm_axis(a, cx.shape(&x).len(), "axis")?;
    let op = Op::CumSum {
        axis,
        exclusive: n.attr_i("exclusive", 0)? != 0,
        reverse: n.attr_i("reverse", 0)? != 0,
    };
    let out = out_name(cx, n, 0);
    one(emit1(cx, &name, op, &[x], out)?)
}

pub(super) fn range(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let start = cx.static_input(n, 0, "the start")?.clone();
    let limit = cx.static_input(n, 1, "the limit")?.clone();
    let delta = cx.static_input(n, 2, "the delta")?.clone();
    for (t, what) in [(&start, "start"), (&limit, "limit"), (&delta, "delta")] {
        if t.numel() != 1 {
            return err(format!("{what} must be a scalar, got shape {:?}", t.shape));
        }
    }
    let dtype = start.dtype();
    if limit.dtype() != dtype || delta.dtype() != dtype {
        return err("start, limit and delta must have one type");
    }
    let out = out_name(cx, n, 0);
    const MAX: i64 = 1 << 28;
    let t = if let (Some(s), Some(l), Some(d)) =
        (start.to_i64_vec(), limit.to_i64_vec(), delta.to_i64_vec())
    {
        let (s, l, d) = (s[0] as i128, l[0] as i128, d[0] as i128);
        if d == 0 {
            return err("delta is 0");
        }
        let count = ((l - s) + d - d.signum()) / d;
        let count = count.max(0);
        if count > MAX as i128 {
            return err(format!("Range would make {count} elements"));
        }
        if !cx.computes(count as u64 * 8 * 2) {
            return one(cx.placeholder(&n.ir_name, dtype, vec![count as usize], out)?);
        }
        cx.check_fold_budget(&format!("Range of {count} elements"), count as u64 * 8 * 2)?;
        if dtype == DType::I64 {
            let v: Vec<i64> = (0..count).map(|i| (s + i * d) as i64).collect();
            Tensor::i64(vec![v.len()], v)
        } else {
            let v: Vec<f64> = (0..count).map(|i| (s + i * d) as f64).collect();
            Tensor::from_f64(dtype, vec![v.len()], &v)
        }
    } else {
        let (s, l, d) = (
            start.to_f64_vec()[0],
            limit.to_f64_vec()[0],
            delta.to_f64_vec()[0],
        );
        if d == 0.0 || !d.is_finite() || !s.is_finite() || !l.is_finite() {
            return err(format!("cannot make a range from {s} to {l} by {d}"));
        }
        let count = ((l - s) / d).ceil().max(0.0);
        if count > MAX as f64 {
            return err(format!("Range would make {count} elements"));
        }
        let count = count as usize;
        if !cx.computes(count as u64 * 8 * 2) {
            return one(cx.placeholder(&n.ir_name, dtype, vec![count], out)?);
        }
        cx.check_fold_budget(&format!("Range of {count} elements"), count as u64 * 8 * 2)?;
        // Like ONNX's reference: start + i * delta, computed in the tensor's type.
        let v: Vec<f64> = (0..count).map(|i| s + i as f64 * d).collect();
        Tensor::from_f64(dtype, vec![count], &v)
    };
    one(cx.named_const(t, out))
}

pub(super) fn constant(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let a =
        n.p.attribute
            .first()
            .ok_or_else(|| node_err("Constant has no value attribute"))?;
    if n.p.attribute.len() != 1 {
        return err("Constant must have exactly one attribute");
    }
    let t = match a.name.as_str() {
        "value" => {
            let t =
                a.t.as_ref()
                    .ok_or_else(|| node_err("attribute `value` must be a tensor"))?;
            cx.decode(t, "attribute `value`")?
        }
        "value_float" => Tensor::scalar_f32(
            a.f.ok_or_else(|| node_err("attribute `value_float` must be a float"))?,
        ),
        "value_floats" => Tensor::f32(vec![a.floats.len()], a.floats.clone()),
        "value_int" => Tensor::scalar_i64(
            a.i.ok_or_else(|| node_err("attribute `value_int` must be an integer"))?,
        ),
        "value_ints" => Tensor::i64(vec![a.ints.len()], a.ints.clone()),
        other => {
            return unsupported(format!(
                "Constant with attribute `{other}` is not supported (hzp reads value, \
                 value_float(s) and value_int(s))"
            ))
        }
    };
    let out = out_name(cx, n, 0);
    one(cx.named_const(t, out))
}

/// ConstantOfShape: a constant shape filled with `value`.
pub(super) fn constant_of_shape(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let shape = non_neg(
        &ints(cx.static_input(n, 0, "the shape")?, "the shape")?,
        "the shape",
    )?;
    let (value, dtype) = match n.attr("value").and_then(|a| a.t.as_ref()) {
        None => (0.0, DType::F32),
        Some(t) => {
            let v = cx.decode(t, "attribute `value`")?;
            if v.numel() != 1 {
                return err("attribute `value` must have one element");
            }
            (v.to_f64_vec()[0], v.dtype())
        }
    };
    let out = out_name(cx, n, 0);
    one(cx.fill(&name, value, dtype, shape, out)?)
}
