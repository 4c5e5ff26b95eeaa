//! Products: MatMul, Gemm, Einsum (as transposes, reshapes and batched products) and Conv (as patches times weights).

use super::shape::reshape;
use super::*;

/// The default-domain ONNX ops of this family and their rules.
pub(super) const OPS: &[(&str, Rule)] = &[
    ("Conv", conv),
    ("Einsum", einsum),
    ("Gemm", gemm),
    ("MatMul", matmul),
];

/// MatMul (numpy broadcasting of the batch axes).
pub(super) fn matmul(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let ins = [n.req(0)?.clone(), n.req(1)?.clone()];
    let out = out_name(cx, n, 0);
    one(emit1(cx, &name, Op::MatMul, &ins, out)?)
}

pub(super) fn gemm(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let mut a = n.req(0)?.clone();
    let mut b = n.req(1)?.clone();
    let c = n.input(2).cloned();
    let alpha = n.attr_f("alpha", 1.0)?;
    let beta = n.attr_f("beta", 1.0)?;
    for (s, what) in [(&a, "A"), (&b, "B")] {
        let r = cx.shape(s).len();
        if r != 2 {
            return err(format!("Gemm input {what} must have rank 2, got rank {r}"));
        }
    }
    if n.attr_i("transA", 0)? != 0 {
        let t = tmp(cx, n, "A_T");
        a = emit1(cx, &name, Op::Transpose { perm: vec![1, 0] }, &[a], t)?;
    }
    if n.attr_i("transB", 0)? != 0 {
        let t = tmp(cx, n, "B_T");
        b = emit1(cx, &name, Op::Transpose { perm: vec![1, 0] }, &[b], t)?;
    }
    let use_c = c.is_some() && beta != 0.0;
    let scale = alpha != 1.0;
    let out = if use_c || scale {
        tmp(cx, n, "matmul")
    } else {
        out_name(cx, n, 0)
    };
    let mut y = emit1(cx, &name, Op::MatMul, &[a, b], out)?;
    let dtype = cx.dtype(&y);
    if scale {
        let k = cx.scalar(dtype, alpha as f64, &format!("{name}/alpha"));
        let out = if use_c {
            tmp(cx, n, "scaled")
        } else {
            out_name(cx, n, 0)
        };
        y = emit1(cx, &name, Op::Binary(BinaryOp::Mul), &[y, k], out)?;
    }
    if let (true, Some(mut c)) = (use_c, c) {
        if beta != 1.0 {
            let k = cx.scalar(cx.dtype(&c), beta as f64, &format!("{name}/beta"));
            let t = tmp(cx, n, "C_scaled");
            c = emit1(cx, &name, Op::Binary(BinaryOp::Mul), &[c, k], t)?;
        }
        let out = out_name(cx, n, 0);
        y = emit1(cx, &name, Op::Binary(BinaryOp::Add), &[y, c], out)?;
    }
    one(y)
}

/// Einsum with one or two operands, each letter at most once per operand (no diagonals),
/// `...` allowed where it covers dims of equal sizes. Written as ReduceSum (letters only one
/// operand has and the output lacks), Transpose/Reshape into one batched MatMul, and a
/// final Reshape/Transpose into the output's order.
pub(super) fn einsum(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let eq = n
        .attr_s("equation")?
        .ok_or_else(|| node_err("Einsum needs the `equation` attribute"))?;
    let eq: String = eq.chars().filter(|c| !c.is_whitespace()).collect();
    let ins: Vec<Slot> = n.ins.iter().flatten().cloned().collect();
    let shapes: Vec<Vec<usize>> = ins.iter().map(|s| cx.shape(s)).collect();
    let (mut ops, out) = einsum_letters(&eq, &shapes)?;
    let size = letter_sizes(&ops, &shapes)?;
    let dim = |c: char| {
        size.iter()
            .find(|(l, _)| *l == c)
            .map(|(_, d)| *d)
            .unwrap_or(1)
    };
    let mut vals = ins;
    sum_lone_letters(cx, n, &mut ops, &mut vals, &out)?;
    let (cur, letters) = if ops.len() == 1 {
        (vals[0].clone(), ops[0].clone())
    } else {
        contract_pair(cx, n, &ops, &vals, &out, &dim)?
    };
    one(permute_letters(cx, n, cur, &letters, &out, "output")?)
}

/// The letters of each operand of equation `eq` (`...` expanded into letters no term
/// uses) for operands of `shapes`, and the output's letters (explicit, or implicit: `...`
/// first, then the letters used once, sorted).
fn einsum_letters(eq: &str, shapes: &[Vec<usize>]) -> FResult<(Vec<Vec<char>>, Vec<char>)> {
    let bad = |why: &str| {
        Fail::new(
            ImportErrorKind::Unsupported,
            format!(
                "Einsum equation `{eq}` is not supported ({why}; hzp takes one or two operands \
                 without repeated letters)"
            ),
        )
    };
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l.to_string(), Some(r.to_string())),
        None => (eq.to_string(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != shapes.len() || !(1..=2).contains(&shapes.len()) {
        return Err(bad(&format!("{} operands", shapes.len())));
    }
    // Expand `...` into letters no term uses.
    let mut spare = ('A'..='Z').chain('a'..='z').filter(|c| !eq.contains(*c));
    let mut ell: Option<Vec<char>> = None;
    let mut ops: Vec<Vec<char>> = Vec::new();
    for (t, s) in terms.iter().zip(shapes) {
        let rank = s.len();
        let letters: Vec<char> = t.replace("...", "").chars().collect();
        if letters.iter().any(|c| !c.is_ascii_alphabetic()) {
            return Err(bad("unexpected characters"));
        }
        let v = if t.contains("...") {
            let k = rank
                .checked_sub(letters.len())
                .ok_or_else(|| node_err(format!("`{t}` does not fit rank {rank}")))?;
            let e = match &ell {
                Some(e) if e.len() == k => e.clone(),
                Some(_) => return Err(bad("`...` covers different ranks")),
                None => {
                    let e: Vec<char> = (0..k).filter_map(|_| spare.next()).collect();
                    if e.len() != k {
                        return Err(bad("too many dims"));
                    }
                    ell = Some(e.clone());
                    e
                }
            };
            t.replace("...", &e.iter().collect::<String>())
                .chars()
                .collect()
        } else {
            letters
        };
        if v.len() != rank {
            return err(format!(
                "`{t}` has {} letters, but the operand has rank {rank}",
                v.len()
            ));
        }
        if v.iter().enumerate().any(|(i, c)| v[..i].contains(c)) {
            return Err(bad("a repeated letter (diagonal)"));
        }
        ops.push(v);
    }
    let out: Vec<char> = match rhs {
        Some(r) => {
            let e: String = ell.clone().unwrap_or_default().into_iter().collect();
            r.replace("...", &e).chars().collect()
        }
        None => {
            // Implicit output: `...` first, then the letters used once, sorted.
            let mut once: Vec<char> = ops
                .iter()
                .flatten()
                .copied()
                .filter(|c| ops.iter().flatten().filter(|d| *d == c).count() == 1)
                .filter(|c| !ell.as_ref().is_some_and(|e| e.contains(c)))
                .collect();
            once.sort_unstable();
            let mut o = ell.clone().unwrap_or_default();
            o.extend(once);
            o
        }
    };
    if out.iter().enumerate().any(|(i, c)| out[..i].contains(c))
        || out.iter().any(|c| !ops.iter().any(|o| o.contains(c)))
    {
        return Err(bad("the output repeats a letter or has one no operand has"));
    }
    Ok((ops, out))
}

/// Each letter's size; a letter must have one size in every operand.
fn letter_sizes(ops: &[Vec<char>], shapes: &[Vec<usize>]) -> FResult<Vec<(char, usize)>> {
    let mut size: Vec<(char, usize)> = Vec::new();
    for (o, s) in ops.iter().zip(shapes) {
        for (c, &d) in o.iter().zip(s) {
            match size.iter().find(|(l, _)| l == c) {
                Some((_, x)) if *x != d => {
                    return err(format!(
                        "letter `{c}` is {x} in one operand and {d} in another"
                    ))
                }
                Some(_) => {}
                None => size.push((*c, d)),
            }
        }
    }
    Ok(size)
}

/// Sums away the letters only one operand has and the output lacks.
fn sum_lone_letters(
    cx: &mut Ctx,
    n: &NodeCx,
    ops: &mut [Vec<char>],
    vals: &mut [Slot],
    out: &[char],
) -> FResult<()> {
    let name = n.ir_name.clone();
    for i in 0..ops.len() {
        let others: Vec<char> = ops
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .flat_map(|(_, o)| o.clone())
            .collect();
        let gone: Vec<usize> = (0..ops[i].len())
            .filter(|&k| !out.contains(&ops[i][k]) && !others.contains(&ops[i][k]))
            .collect();
        if !gone.is_empty() {
            let t = tmp(cx, n, &format!("sum{i}"));
            let op = Op::Reduce {
                op: ReduceOp::Sum,
                axes: gone.clone(),
                keep_dims: false,
            };
            vals[i] = emit1(cx, &name, op, &[vals[i].clone()], t)?;
            let kept: Vec<char> = (0..ops[i].len())
                .filter(|k| !gone.contains(k))
                .map(|k| ops[i][k])
                .collect();
            ops[i] = kept;
        }
    }
    Ok(())
}

/// `x` (letters `have`) transposed to the letters `want`.
fn permute_letters(
    cx: &mut Ctx,
    n: &NodeCx,
    x: Slot,
    have: &[char],
    want: &[char],
    what: &str,
) -> FResult<Slot> {
    let perm: Vec<usize> = want
        .iter()
        .map(|c| have.iter().position(|h| h == c).unwrap_or(0))
        .collect();
    if perm.iter().copied().eq(0..perm.len()) {
        Ok(x)
    } else {
        let t = tmp(cx, n, what);
        emit1(cx, &n.ir_name, Op::Transpose { perm }, &[x], t)
    }
}

/// Two operands as one batched product: batch letters (in both and the output), then the
/// left's own letters times the contracted ones times the right's own; returns the product
/// and its letters.
fn contract_pair(
    cx: &mut Ctx,
    n: &NodeCx,
    ops: &[Vec<char>],
    vals: &[Slot],
    out: &[char],
    dim: &dyn Fn(char) -> usize,
) -> FResult<(Slot, Vec<char>)> {
    let name = n.ir_name.clone();
    let (l, r) = (&ops[0], &ops[1]);
    let batch: Vec<char> = l
        .iter()
        .copied()
        .filter(|c| r.contains(c) && out.contains(c))
        .collect();
    let ms: Vec<char> = l.iter().copied().filter(|c| !r.contains(c)).collect();
    let ns: Vec<char> = r.iter().copied().filter(|c| !l.contains(c)).collect();
    let ks: Vec<char> = l
        .iter()
        .copied()
        .filter(|c| r.contains(c) && !out.contains(c))
        .collect();
    let prod = |v: &[char]| v.iter().map(|&c| dim(c)).product::<usize>();
    let bshape: Vec<usize> = batch.iter().map(|&c| dim(c)).collect();
    let order = |a: &[char], b: &[char], c: &[char]| -> Vec<char> {
        a.iter().chain(b).chain(c).copied().collect()
    };
    let a = permute_letters(cx, n, vals[0].clone(), l, &order(&batch, &ms, &ks), "lhs")?;
    let mut sa = bshape.clone();
    sa.extend([prod(&ms), prod(&ks)]);
    let a = reshape_tmp(cx, n, a, sa, "lhs_matrix")?;
    let b = permute_letters(cx, n, vals[1].clone(), r, &order(&batch, &ks, &ns), "rhs")?;
    let mut sb = bshape.clone();
    sb.extend([prod(&ks), prod(&ns)]);
    let b = reshape_tmp(cx, n, b, sb, "rhs_matrix")?;
    let t = tmp(cx, n, "matmul");
    let y = emit1(cx, &name, Op::MatMul, &[a, b], t)?;
    let letters = order(&batch, &ms, &ns);
    let shape: Vec<usize> = letters.iter().map(|&c| dim(c)).collect();
    Ok((reshape_tmp(cx, n, y, shape, "product")?, letters))
}

/// Largest padded spatial dim Conv takes (keeps its index arithmetic far from overflow).
pub(super) const MAX_PAD_DIM: usize = 1 << 40;

/// Conv (1-D, 2-D, 3-D, ...; groups, strides, dilations, pads, auto_pad) written as one
/// batched MatMul of the weights with the input's patches (im2col). The patches come from
/// a Reshape/Transpose when the stride equals the kernel (patch embeddings: ViT, CLIP),
/// else from one strided Slice per kernel offset. Padding is zeros concatenated beside the
/// input. The weight keeps its ONNX layout (it is only reshaped), so a trainable weight
/// stays the parameter the file names.
pub(super) fn conv(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let x = n.req(0)?.clone();
    let w = n.req(1)?.clone();
    let bias = n.input(2).cloned();
    let (xs, ws) = (cx.shape(&x), cx.shape(&w));
    if xs.len() < 3 || ws.len() != xs.len() {
        return err(format!(
            "Conv needs an input [N, C, D...] and a weight [M, C/group, K...] of the same rank \
             (at least 3), got {xs:?} and {ws:?}"
        ));
    }
    let geo = conv_geometry(n, &xs, &ws)?;
    let ConvGeometry {
        batch,
        chans,
        m,
        g,
        ref kernel,
        ref out_sp,
        ..
    } = geo;
    let sp = out_sp.len();
    let xp = zero_pad(cx, n, x, &geo)?;
    let k: usize = kernel.iter().product();
    let l: usize = out_sp.iter().product();
    let cg = chans / g;
    // Patches as [N, C, K, L] (kernel offsets row-major, then output positions).
    let patches = if geo.strides == *kernel && geo.dil.iter().all(|&d| d == 1) {
        tiled_patches(cx, n, xp, &geo)?
    } else {
        strided_patches(cx, n, xp, &geo)?
    };
    let patches = reshape_tmp(cx, n, patches, vec![batch, g, cg * k, l], "patch_rows")?;
    let wm = reshape_tmp(cx, n, w, vec![g, m / g, cg * k], "weight_rows")?;
    let t = tmp(cx, n, "matmul");
    let y = emit1(cx, &name, Op::MatMul, &[wm, patches], t)?;
    let mut shape = vec![batch, m];
    shape.extend(out_sp);
    match bias {
        None => reshape(cx, n, y, shape),
        Some(b) => {
            let y = reshape_tmp(cx, n, y, shape, "unbiased")?;
            let mut bs = vec![m];
            bs.extend(vec![1; sp]);
            let b = reshape_tmp(cx, n, b, bs, "bias")?;
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, Op::Binary(BinaryOp::Add), &[y, b], out)?)
        }
    }
}

/// A convolution's sizes: batch, input channels, output channels, groups, the kernel, the
/// strides and dilations, the dilated kernel's extent, the padding before and after each
/// spatial axis, and the output's spatial shape.
struct ConvGeometry {
    batch: usize,
    chans: usize,
    m: usize,
    g: usize,
    kernel: Vec<usize>,
    strides: Vec<usize>,
    dil: Vec<usize>,
    pb: Vec<usize>,
    pe: Vec<usize>,
    out_sp: Vec<usize>,
}

/// Checks Conv's attributes against the input `xs` and weight `ws` shapes and works out
/// its geometry (`auto_pad` included).
fn conv_geometry(n: &NodeCx, xs: &[usize], ws: &[usize]) -> FResult<ConvGeometry> {
    let sp = xs.len() - 2; // spatial dims
    let (batch, chans, m) = (xs[0], xs[1], ws[0]);
    let kernel = ws[2..].to_vec();
    if kernel.contains(&0) {
        return err(format!("the weight {ws:?} has an empty kernel"));
    }
    if let Some(k) = n.attr_ints("kernel_shape") {
        if non_neg(&k, "kernel_shape")? != kernel {
            return err(format!(
                "kernel_shape {k:?} differs from the weight's {kernel:?}"
            ));
        }
    }
    let g = n.attr_i("group", 1)?;
    let g = usize::try_from(g)
        .ok()
        .filter(|&g| g > 0)
        .ok_or_else(|| node_err(format!("group {g} must be positive")))?;
    if chans % g != 0 || m % g != 0 || ws[1].checked_mul(g) != Some(chans) {
        return err(format!(
            "{chans} input channels, weight {ws:?} and group {g} do not fit together"
        ));
    }
    let per_axis = |attr: &str, default: usize| -> FResult<Vec<usize>> {
        match n.attr_ints(attr) {
            Some(v) if !v.is_empty() => {
                let v = non_neg(&v, attr)?;
                if v.len() != sp || v.contains(&0) {
                    return err(format!("{attr} {v:?} must be {sp} positive numbers"));
                }
                Ok(v)
            }
            _ => Ok(vec![default; sp]),
        }
    };
    let strides = per_axis("strides", 1)?;
    let dil = per_axis("dilations", 1)?;
    // Extent of the dilated kernel along each axis.
    let ext: Vec<usize> = (0..sp)
        .map(|i| dil[i].saturating_mul(kernel[i] - 1).saturating_add(1))
        .collect();
    let auto_pad = n.attr_s("auto_pad")?.unwrap_or_else(|| "NOTSET".into());
    let (mut pb, mut pe) = (vec![0usize; sp], vec![0usize; sp]);
    match auto_pad.as_str() {
        "NOTSET" => {
            if let Some(p) = n.attr_ints("pads").filter(|p| !p.is_empty()) {
                let p = non_neg(&p, "pads")?;
                if p.len() != 2 * sp {
                    return err(format!("pads {p:?} must have {} entries", 2 * sp));
                }
                pb = p[..sp].to_vec();
                pe = p[sp..].to_vec();
            }
        }
        "VALID" => {}
        "SAME_UPPER" | "SAME_LOWER" => {
            for i in 0..sp {
                let d = xs[2 + i];
                let out = d.div_ceil(strides[i]);
                let total = ((out.max(1) - 1).saturating_mul(strides[i]))
                    .saturating_add(ext[i])
                    .saturating_sub(d);
                let small = total / 2;
                (pb[i], pe[i]) = if auto_pad == "SAME_UPPER" {
                    (small, total - small)
                } else {
                    (total - small, small)
                };
            }
        }
        other => return err(format!("unknown auto_pad `{other}`")),
    }
    let mut out_sp = Vec::with_capacity(sp);
    for i in 0..sp {
        let padded = xs[2 + i].saturating_add(pb[i]).saturating_add(pe[i]);
        if padded < ext[i] || padded > MAX_PAD_DIM {
            return err(format!(
                "the kernel {kernel:?} (dilations {dil:?}) does not fit the padded input {xs:?}"
            ));
        }
        out_sp.push((padded - ext[i]) / strides[i] + 1);
    }
    Ok(ConvGeometry {
        batch,
        chans,
        m,
        g,
        kernel,
        strides,
        dil,
        pb,
        pe,
        out_sp,
    })
}

/// `x` with zeros concatenated before and after each spatial axis.
fn zero_pad(cx: &mut Ctx, n: &NodeCx, x: Slot, geo: &ConvGeometry) -> FResult<Slot> {
    let name = n.ir_name.clone();
    let dt = cx.dtype(&x);
    let (sp, pb, pe) = (geo.out_sp.len(), &geo.pb, &geo.pe);
    let mut xp = x;
    for i in 0..sp {
        let a = 2 + i;
        let mut parts = Vec::new();
        for (amount, after) in [(pb[i], false), (pe[i], true)] {
            if after {
                parts.push(xp.clone());
            }
            if amount > 0 {
                let mut s = cx.shape(&xp);
                s[a] = amount;
                let t = tmp(cx, n, &format!("pad{a}"));
                parts.push(cx.fill(&name, 0.0, dt, s, t)?);
            }
        }
        if parts.len() > 1 {
            let t = tmp(cx, n, &format!("padded{a}"));
            xp = emit1(cx, &name, Op::Concat { axis: a }, &parts, t)?;
        }
    }
    Ok(xp)
}

/// Patches of a convolution whose strides equal its kernel, without dilation: the
/// non-overlapping patches by cropping to whole patches, splitting each axis into
/// (position, offset) and moving the offsets before the positions.
fn tiled_patches(cx: &mut Ctx, n: &NodeCx, xp: Slot, geo: &ConvGeometry) -> FResult<Slot> {
    let name = n.ir_name.clone();
    let (batch, chans, kernel, out_sp) = (geo.batch, geo.chans, &geo.kernel, &geo.out_sp);
    let sp = out_sp.len();
    let (k, l): (usize, usize) = (kernel.iter().product(), out_sp.iter().product());
    let mut xp = xp;
    let whole: Vec<usize> = (0..sp).map(|i| out_sp[i] * kernel[i]).collect();
    let ps = cx.shape(&xp);
    if ps[2..] != whole[..] {
        let t = tmp(cx, n, "whole_patches");
        let op = Op::Slice {
            axes: (2..2 + sp).collect(),
            starts: vec![0; sp],
            ends: whole.iter().map(|&d| d as i64).collect(),
            steps: vec![1; sp],
        };
        xp = emit1(cx, &name, op, &[xp], t)?;
    }
    let mut split = vec![batch, chans];
    for i in 0..sp {
        split.push(out_sp[i]);
        split.push(kernel[i]);
    }
    let t = reshape_tmp(cx, n, xp, split, "patch_grid")?;
    let mut perm = vec![0, 1];
    perm.extend((0..sp).map(|i| 3 + 2 * i));
    perm.extend((0..sp).map(|i| 2 + 2 * i));
    let t = if perm.iter().copied().eq(0..perm.len()) {
        t
    } else {
        let o = tmp(cx, n, "patch_offsets_first");
        emit1(cx, &name, Op::Transpose { perm }, &[t], o)?
    };
    reshape_tmp(cx, n, t, vec![batch, chans, k, l], "patches")
}

/// Patches of any convolution: one strided slice per kernel offset, concatenated.
fn strided_patches(cx: &mut Ctx, n: &NodeCx, xp: Slot, geo: &ConvGeometry) -> FResult<Slot> {
    let name = n.ir_name.clone();
    let (batch, chans, kernel, out_sp) = (geo.batch, geo.chans, &geo.kernel, &geo.out_sp);
    let (strides, dil) = (&geo.strides, &geo.dil);
    let sp = out_sp.len();
    let (k, l): (usize, usize) = (kernel.iter().product(), out_sp.iter().product());
    let mut cols = Vec::with_capacity(k);
    for off in 0..k {
        // Row-major kernel offset of index `off`.
        let mut rem = off;
        let mut idx = vec![0usize; sp];
        for i in (0..sp).rev() {
            idx[i] = rem % kernel[i];
            rem /= kernel[i];
        }
        let starts: Vec<i64> = (0..sp).map(|i| (idx[i] * dil[i]) as i64).collect();
        let ends: Vec<i64> = (0..sp)
            .map(|i| (idx[i] * dil[i] + (out_sp[i] - 1) * strides[i] + 1) as i64)
            .collect();
        let op = Op::Slice {
            axes: (2..2 + sp).collect(),
            starts,
            ends,
            steps: strides.iter().map(|&s| s as i64).collect(),
        };
        let t = tmp(cx, n, &format!("offset{off}"));
        let s = emit1(cx, &name, op, std::slice::from_ref(&xp), t)?;
        cols.push(reshape_tmp(
            cx,
            n,
            s,
            vec![batch, chans, 1, l],
            &format!("offset{off}_flat"),
        )?);
    }
    if cols.len() == 1 {
        Ok(cols.pop().unwrap_or_else(|| unreachable!()))
    } else {
        let t = tmp(cx, n, "patches");
        emit1(cx, &name, Op::Concat { axis: 2 }, &cols, t)
    }
}
