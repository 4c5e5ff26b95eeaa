//! Ops that only move or view data: Reshape and its relatives, Transpose, Slice, Concat, Split, Expand, Tile, Pad, Shape, Size.

use super::*;

/// The default-domain ONNX ops of this family and their rules.
pub(super) const OPS: &[(&str, Rule)] = &[
    ("Concat", concat),
    ("Expand", expand),
    ("Flatten", flatten),
    ("Pad", pad),
    ("Reshape", reshape_op),
    ("Shape", shape_op),
    ("Size", size),
    ("Slice", slice),
    ("Split", split),
    ("Squeeze", squeeze),
    ("Tile", tile),
    ("Transpose", transpose),
    ("Unsqueeze", unsqueeze),
];

/// The static shape of an ONNX Reshape (`0` copies the input dim unless `allowzero`, one
/// `-1` is inferred).
pub(super) fn reshape_target(
    input: &[usize],
    target: &[i64],
    allowzero: bool,
) -> FResult<Vec<usize>> {
    let total: usize = input.iter().product();
    let product = |v: &[usize]| v.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let mut out = Vec::with_capacity(target.len());
    let mut infer = None;
    for (i, &d) in target.iter().enumerate() {
        if d == -1 {
            if infer.is_some() {
                return err(format!("target shape {target:?} has more than one -1"));
            }
            infer = Some(i);
            out.push(1);
        } else if d == 0 && !allowzero {
            let v = input.get(i).copied().ok_or_else(|| {
                node_err(format!(
                    "target shape {target:?} copies dim {i} (0), but the input {input:?} has rank {}",
                    input.len()
                ))
            })?;
            out.push(v);
        } else if d < 0 {
            return err(format!("target shape {target:?} has a negative dim {d}"));
        } else {
            out.push(d as usize);
        }
    }
    if let Some(i) = infer {
        let known = product(&out).unwrap_or(0);
        if total.checked_rem(known) != Some(0) {
            return err(format!(
                "cannot reshape {input:?} ({total} elements) to {target:?}"
            ));
        }
        out[i] = total / known;
    }
    if product(&out) != Some(total) {
        return err(format!(
            "cannot reshape {input:?} ({total} elements) to {target:?} ({:?})",
            out
        ));
    }
    Ok(out)
}

pub(super) fn reshape(cx: &mut Ctx, n: &NodeCx, x: Slot, shape: Vec<usize>) -> FResult<Outs> {
    if cx.shape(&x) == shape {
        return one(x);
    }
    let out = out_name(cx, n, 0);
    one(emit1(cx, &n.ir_name, Op::Reshape { shape }, &[x], out)?)
}

/// Reshape to a constant target (0 copies, -1 infers; `allowzero`).
pub(super) fn reshape_op(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let target = ints(
        cx.static_input(n, 1, "the target shape")?,
        "the target shape",
    )?;
    let shape = reshape_target(&cx.shape(&x), &target, n.attr_i("allowzero", 0)? != 0)?;
    reshape(cx, n, x, shape)
}

/// Flatten to 2-D at `axis`.
pub(super) fn flatten(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let s = cx.shape(&x);
    let a = n.attr_i("axis", 1)?;
    let r = s.len() as i64;
    let axis = if a < 0 { a + r } else { a };
    if axis < 0 || axis > r {
        return err(format!("axis {a} is out of range for rank {r}"));
    }
    let axis = axis as usize;
    let shape = vec![s[..axis].iter().product(), s[axis..].iter().product()];
    reshape(cx, n, x, shape)
}

/// Squeeze the given axes (or every axis of size 1).
pub(super) fn squeeze(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let s = cx.shape(&x);
    let axes = axes_input(cx, n, 1, "axes")?;
    let axes = match axes {
        Some(a) if !a.is_empty() => norm_axes(&a, s.len(), "axes")?,
        _ => (0..s.len()).filter(|&i| s[i] == 1).collect(),
    };
    if let Some(&a) = axes.iter().find(|&&a| s[a] != 1) {
        return err(format!(
            "cannot squeeze axis {a} of shape {s:?}: its size is not 1"
        ));
    }
    let shape = (0..s.len())
        .filter(|i| !axes.contains(i))
        .map(|i| s[i])
        .collect();
    reshape(cx, n, x, shape)
}

/// Unsqueeze: insert axes of size 1.
pub(super) fn unsqueeze(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let s = cx.shape(&x);
    let axes = axes_input(cx, n, 1, "axes")?.ok_or_else(|| node_err("Unsqueeze needs axes"))?;
    let rank = s.len() + axes.len();
    let axes = norm_axes(&axes, rank, "axes")?;
    let mut it = s.iter();
    let shape = (0..rank)
        .map(|i| {
            if axes.contains(&i) {
                1
            } else {
                it.next().copied().unwrap_or(1)
            }
        })
        .collect();
    reshape(cx, n, x, shape)
}

/// Transpose by `perm` (reversed axes by default); the identity permutation is its input.
pub(super) fn transpose(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let x = n.req(0)?.clone();
    let r = cx.shape(&x).len();
    let perm = match n.attr_ints("perm") {
        Some(p) => non_neg(&p, "perm")?,
        None => (0..r).rev().collect(),
    };
    if perm.iter().copied().eq(0..r) {
        return one(x);
    }
    let out = out_name(cx, n, 0);
    one(emit1(cx, &name, Op::Transpose { perm }, &[x], out)?)
}

pub(super) fn slice(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let s = cx.shape(&x);
    let r = s.len();
    let starts = ints(cx.static_input(n, 1, "the starts")?, "the starts")?;
    let ends = ints(cx.static_input(n, 2, "the ends")?, "the ends")?;
    let axes = match n.input(3) {
        Some(_) => ints(cx.static_input(n, 3, "the axes")?, "the axes")?,
        None => (0..starts.len() as i64).collect(),
    };
    let steps = match n.input(4) {
        Some(_) => ints(cx.static_input(n, 4, "the steps")?, "the steps")?,
        None => vec![1; starts.len()],
    };
    if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
        return err(format!(
            "starts {starts:?}, ends {ends:?}, axes {axes:?} and steps {steps:?} differ in length"
        ));
    }
    let axes = norm_axes(&axes, r, "axes")?;
    let mut op_axes = Vec::new();
    let (mut op_starts, mut op_ends, mut op_steps) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..axes.len() {
        let a = axes[i];
        let dim = s[a] as i64;
        let step = steps[i];
        if step == 0 {
            return err("a step is 0");
        }
        if dim == 0 {
            continue; // empty either way
        }
        // A step longer than the dim selects at most one element either way; clamping it
        // keeps the length arithmetic from overflowing.
        let step = step.clamp(-dim.max(1), dim.max(1));
        let mut st = starts[i];
        let mut en = ends[i];
        if st < 0 {
            st = st.saturating_add(dim);
        }
        if en < 0 {
            en = en.saturating_add(dim);
        }
        if step > 0 {
            st = st.clamp(0, dim);
            en = en.clamp(0, dim);
        } else {
            st = st.clamp(0, (dim - 1).max(0));
            en = en.clamp(-1, dim - 1);
        }
        if step == 1 && st == 0 && en == dim {
            continue;
        }
        op_axes.push(a);
        op_starts.push(st);
        op_ends.push(en);
        op_steps.push(step);
    }
    if op_axes.is_empty() {
        return one(x);
    }
    let op = Op::Slice {
        axes: op_axes,
        starts: op_starts,
        ends: op_ends,
        steps: op_steps,
    };
    let out = out_name(cx, n, 0);
    one(emit1(cx, &n.ir_name, op, &[x], out)?)
}

/// Concat along `axis`.
pub(super) fn concat(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let ins: Vec<Slot> = n.ins.iter().flatten().cloned().collect();
    let first = ins
        .first()
        .ok_or_else(|| node_err("Concat has no inputs"))?;
    let r = cx.shape(first).len();
    let a = n
        .attr("axis")
        .and_then(|a| a.i)
        .ok_or_else(|| node_err("Concat needs the `axis` attribute"))?;
    let axis = norm_axis(a, r, "axis")?;
    if ins.len() == 1 {
        return one(ins[0].clone());
    }
    let out = out_name(cx, n, 0);
    one(emit1(cx, &name, Op::Concat { axis }, &ins, out)?)
}

pub(super) fn split(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let s = cx.shape(&x);
    let axis = norm_axis(n.attr_i("axis", 0)?, s.len(), "axis")?;
    let dim = s[axis];
    let sizes: Vec<usize> = if n.input(1).is_some() {
        non_neg(
            &ints(cx.static_input(n, 1, "the split sizes")?, "the split sizes")?,
            "the split sizes",
        )?
    } else if let Some(v) = n.attr_ints("split") {
        non_neg(&v, "the split sizes")?
    } else {
        let parts = match n.attr("num_outputs") {
            Some(a) => {
                a.i.ok_or_else(|| node_err("attribute `num_outputs` must be an integer"))?
            }
            None => n.n_outputs() as i64,
        };
        let parts = usize::try_from(parts)
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| node_err(format!("cannot split into {parts} parts")))?;
        let chunk = dim.div_ceil(parts);
        let mut v = vec![chunk; parts];
        let rest = dim as i64 - (chunk * (parts - 1)) as i64;
        if rest < 0 {
            return err(format!("cannot split a dim of {dim} into {parts} parts"));
        }
        v[parts - 1] = rest as usize;
        v
    };
    if sizes.len() != n.n_outputs() {
        return err(format!(
            "the split sizes {sizes:?} make {} parts, but the node has {} outputs",
            sizes.len(),
            n.n_outputs()
        ));
    }
    if sizes.iter().try_fold(0usize, |a, &b| a.checked_add(b)) != Some(dim) {
        return err(format!(
            "the split sizes {sizes:?} do not add up to dim {axis} of {s:?}"
        ));
    }
    if sizes.len() == 1 {
        return one(x);
    }
    let outs: Vec<String> = (0..sizes.len()).map(|k| out_name(cx, n, k)).collect();
    let r = cx.emit(&n.ir_name, Op::Split { axis, sizes }, &[x], outs)?;
    Ok(r.into_iter().map(Some).collect())
}

/// Expand by broadcasting to a constant shape.
pub(super) fn expand(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let x = n.req(0)?.clone();
    let want = non_neg(
        &ints(
            cx.static_input(n, 1, "the target shape")?,
            "the target shape",
        )?,
        "the target shape",
    )?;
    let s = cx.shape(&x);
    let shape = broadcast_shapes(&s, &want)
        .ok_or_else(|| node_err(format!("shape {s:?} does not broadcast with {want:?}")))?;
    if shape == s {
        return one(x);
    }
    let out = out_name(cx, n, 0);
    one(emit1(cx, &name, Op::Expand { shape }, &[x], out)?)
}

/// Tile by constant repeats.
pub(super) fn tile(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let x = n.req(0)?.clone();
    let reps = non_neg(
        &ints(cx.static_input(n, 1, "the repeats")?, "the repeats")?,
        "the repeats",
    )?;
    let s = cx.shape(&x);
    if reps.iter().all(|&r| r == 1) && reps.len() == s.len() {
        return one(x);
    }
    if s.iter()
        .zip(&reps)
        .any(|(d, r)| d.checked_mul(*r).is_none())
    {
        return err(format!("repeats {reps:?} of shape {s:?} are too large"));
    }
    let out = out_name(cx, n, 0);
    one(emit1(cx, &name, Op::Tile { repeats: reps }, &[x], out)?)
}

/// Shape: the input's static shape (with `start` / `end`) as a constant.
pub(super) fn shape_op(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?;
    let s = cx.shape(x);
    let r = s.len() as i64;
    let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
    let start = clamp(n.attr_i("start", 0)?);
    let end = clamp(n.attr_i("end", r)?);
    let dims: Vec<i64> = if start < end {
        s[start..end].iter().map(|&d| d as i64).collect()
    } else {
        vec![]
    };
    let out = out_name(cx, n, 0);
    let len = dims.len();
    one(cx.named_const(Tensor::i64(vec![len], dims), out))
}

/// Size: the element count as a constant.
pub(super) fn size(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let s = cx.shape(n.req(0)?);
    let out = out_name(cx, n, 0);
    let size = s.iter().product::<usize>() as i64;
    one(cx.named_const(Tensor::scalar_i64(size), out))
}

/// Pad in `constant` mode: negative pads crop (Slice), positive pads concatenate constant
/// blocks.
pub(super) fn pad(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let mut x = n.req(0)?.clone();
    let mode = n.attr_s("mode")?.unwrap_or_else(|| "constant".into());
    if mode != "constant" {
        return unsupported(format!(
            "Pad mode `{mode}` is not supported (hzp pads with a constant)"
        ));
    }
    let r = cx.shape(&x).len();
    let pads = ints(cx.static_input(n, 1, "the pads")?, "the pads")?;
    let dt = cx.dtype(&x);
    let value = match n.input(2) {
        Some(_) => {
            let t = cx.static_input(n, 2, "the constant value")?;
            if t.numel() != 1 {
                return err("the constant value must have one element");
            }
            t.to_f64_vec()[0]
        }
        None => 0.0,
    };
    let axes = match n.input(3) {
        Some(_) => norm_axes(
            &ints(cx.static_input(n, 3, "the axes")?, "the axes")?,
            r,
            "axes",
        )?,
        None => (0..r).collect(),
    };
    if pads.len() != 2 * axes.len() {
        return err(format!(
            "pads {pads:?} must have two entries per axis ({} axes)",
            axes.len()
        ));
    }
    let k = axes.len();
    for (i, &a) in axes.iter().enumerate() {
        let (before, after) = (pads[i], pads[i + k]);
        if before == 0 && after == 0 {
            continue;
        }
        let dim = cx.shape(&x)[a] as i64;
        if before < 0 || after < 0 {
            let st = before.saturating_neg().max(0);
            let en = dim.saturating_sub(after.saturating_neg().max(0));
            if st > en {
                return err(format!("pads {pads:?} crop more than dim {a} holds"));
            }
            let t = tmp(cx, n, &format!("crop{a}"));
            let op = Op::Slice {
                axes: vec![a],
                starts: vec![st],
                ends: vec![en],
                steps: vec![1],
            };
            x = emit1(cx, &name, op, &[x], t)?;
        }
        let mut ins = Vec::new();
        for (amount, what) in [(before, "before"), (after, "after")] {
            if what == "after" {
                ins.push(x.clone());
            }
            if amount > 0 {
                let mut shape = cx.shape(&x);
                shape[a] = usize::try_from(amount)
                    .map_err(|_| node_err(format!("pad {amount} is too large")))?;
                let t = tmp(cx, n, &format!("pad{a}_{what}"));
                ins.push(cx.fill(&name, value, dt, shape, t)?);
            }
        }
        if ins.len() > 1 {
            let t = tmp(cx, n, &format!("padded{a}"));
            x = emit1(cx, &name, Op::Concat { axis: a }, &ins, t)?;
        }
    }
    one(x)
}
