//! Normalizations over an axis: Softmax, LogSoftmax (max-subtracted), LayerNorm (biased
//! variance, like ONNX LayerNormalization) and RmsNorm. Computed in f32 with f64 sums;
//! contiguous rows (the usual last-axis case) are processed in place without gathers.

use super::elem::{floats, out_stage_len, stage_len, store_f32};
use super::into::{DataMut, TensorRef, Workspace};
use super::layout::{around_axis, expand_into};
use super::math;

/// Applies `f` to every lane along `axis` of `v` (shape `shape`), in place; strided lanes
/// are gathered into `buf` (`dim` elements) and back.
fn for_each_lane(
    v: &mut [f32],
    shape: &[usize],
    axis: usize,
    buf: &mut [f32],
    mut f: impl FnMut(&mut [f32]),
) {
    let (outer, dim, inner) = around_axis(shape, axis);
    if dim == 0 {
        return;
    }
    if inner == 1 {
        v.chunks_exact_mut(dim).for_each(f);
        return;
    }
    let buf = &mut buf[..dim];
    for o in 0..outer {
        for i in 0..inner {
            let base = o * dim * inner + i;
            for d in 0..dim {
                buf[d] = v[base + d * inner];
            }
            f(buf);
            for d in 0..dim {
                v[base + d * inner] = buf[d];
            }
        }
    }
}

/// The largest element of a row (-inf for an empty row), with sixteen independent lanes
/// (the max does not depend on the order). NaN elements are passed over: every consumer
/// here subtracts the max from each element, so a NaN still makes its row's result NaN.
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    #[inline(always)]
    fn mx(m: f32, x: f32) -> f32 {
        if x > m {
            x
        } else {
            m
        }
    }
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for k in 0..16 {
            acc[k] = mx(acc[k], c[k]);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| mx(m, x));
    acc.iter().fold(tail, |m, &x| mx(m, x))
}

/// Sum of exp(x - m) over a row: f32 partial sums in sixteen lanes over 256-element
/// pieces (at most 16 terms per lane, all positive), the pieces summed in f64.
#[inline(always)]
fn sum_exp(row: &[f32], m: f32) -> f64 {
    let mut total = 0f64;
    for piece in row.chunks(256) {
        let mut acc = [0f32; 16];
        let mut chunks = piece.chunks_exact(16);
        for c in &mut chunks {
            for k in 0..16 {
                acc[k] += math::exp(c[k] - m);
            }
        }
        let mut s = 0f64;
        for &x in chunks.remainder() {
            s += math::exp(x - m) as f64;
        }
        for a in acc {
            s += a as f64;
        }
        total += s;
    }
    total
}

/// [`sum_exp`] that also stores each exp(x - m) in `out` (same operations, same sum).
#[inline(always)]
fn sum_exp_store(row: &[f32], m: f32, out: &mut [f32]) -> f64 {
    let mut total = 0f64;
    for (piece, o) in row.chunks(256).zip(out.chunks_mut(256)) {
        let mut acc = [0f32; 16];
        let mut chunks = piece.chunks_exact(16);
        let mut outs = o.chunks_exact_mut(16);
        for (c, oc) in (&mut chunks).zip(&mut outs) {
            for k in 0..16 {
                let e = math::exp(c[k] - m);
                oc[k] = e;
                acc[k] += e;
            }
        }
        let mut s = 0f64;
        for (&x, o) in chunks.remainder().iter().zip(outs.into_remainder()) {
            let e = math::exp(x - m);
            *o = e;
            s += e as f64;
        }
        for a in acc {
            s += a as f64;
        }
        total += s;
    }
    total
}

/// Sum of (x - mean)^2 in f64 with eight independent accumulators (as [`sum_f64`]).
#[inline(always)]
fn sum_sq_f64(v: &[f32], mean: f32) -> f64 {
    let mut acc = [0f64; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for k in 0..8 {
            let d = (c[k] - mean) as f64;
            acc[k] += d * d;
        }
    }
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&x| {
            let d = (x - mean) as f64;
            d * d
        })
        .sum();
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
}

/// Sum in f64 with eight independent accumulators (keeps the adds pipelined).
#[inline(always)]
pub fn sum_f64(v: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for k in 0..8 {
            acc[k] += c[k] as f64;
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&x| x as f64).sum();
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
}

#[inline(always)]
fn softmax_row(row: &mut [f32]) {
    let m = row_max(row);
    row.iter_mut().for_each(|x| *x = math::exp(*x - m));
    let inv = (1.0 / sum_f64(row)) as f32;
    row.iter_mut().for_each(|x| *x *= inv);
}

#[inline(always)]
fn log_softmax_row(row: &mut [f32]) {
    let m = row_max(row);
    let lse = sum_exp(row, m).ln() as f32;
    row.iter_mut().for_each(|x| *x = (*x - m) - lse);
}

/// (Log)softmax of every contiguous row of `dim` elements of `v`, in place: rows in
/// parallel when there are threads, each piece [`math::vectorized`].
fn softmax_rows(v: &mut [f32], dim: usize, log: bool) {
    fn rows(v: &mut [f32], dim: usize, log: bool) {
        math::vectorized(
            #[inline(always)]
            || {
                for row in v.chunks_exact_mut(dim) {
                    if log {
                        log_softmax_row(row)
                    } else {
                        softmax_row(row)
                    }
                }
            },
        )
    }
    let n_rows = v.len() / dim;
    let t = super::threads::num_threads();
    if t > 1 && n_rows >= 2 * t && v.len() >= 1 << 15 {
        let per = n_rows.div_ceil(4 * t);
        super::threads::for_each_chunk(v, per * dim, |_, c| rows(c, dim, log));
    } else {
        rows(v, dim, log)
    }
}

/// (Log)softmax of `x` along `axis` into `out` (the same shape, of `x`'s dtype).
pub fn softmax(
    x: &TensorRef,
    axis: usize,
    log: bool,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    let (_, dim, inner) = around_axis(x.shape, axis);
    let lane = if inner == 1 { 0 } else { dim };
    let [xs, os, buf] = ws.f32s.take([stage_len(x.data), out_stage_len(out), lane]);
    let xv = floats(x.data, xs);
    store_f32(out, os, |v| {
        v.copy_from_slice(xv);
        if inner == 1 && dim > 0 {
            softmax_rows(v, dim, log);
        } else if log {
            math::vectorized(
                #[inline(always)]
                || for_each_lane(v, x.shape, axis, buf, log_softmax_row),
            );
        } else {
            math::vectorized(
                #[inline(always)]
                || for_each_lane(v, x.shape, axis, buf, softmax_row),
            );
        }
    });
    Ok(())
}

/// LayerNorm (`rms == false`: (x - mean) / sqrt(var + eps) * scale + bias) or RmsNorm
/// (x / sqrt(mean(x^2) + eps) * scale) over dims `axis..`, into `out` (the same shape, of
/// `x`'s dtype).
#[allow(clippy::too_many_arguments)]
pub fn norm(
    x: &TensorRef,
    scale: &TensorRef,
    bias: Option<&TensorRef>,
    axis: usize,
    eps: f32,
    rms: bool,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    let norm_dims = &x.shape[axis..];
    let d: usize = norm_dims.iter().product();
    // a scale or bias broadcast to the full normalized dims, flattened: the parameter
    // itself when it has d elements (broadcasting then only adds leading 1s)
    let row_len = |p: Option<&TensorRef>| p.map_or(0, |p| if p.data.len() == d { 0 } else { d });
    let [xs, os, ss, sr, bs, br] = ws.f32s.take([
        stage_len(x.data),
        out_stage_len(out),
        stage_len(scale.data),
        row_len(Some(scale)),
        bias.map_or(0, |b| stage_len(b.data)),
        row_len(bias),
    ]);
    let xv = floats(x.data, xs);
    let s = param_row(scale, norm_dims, ss, sr);
    let b = bias.map(|b| param_row(b, norm_dims, bs, br));
    store_f32(out, os, |v| {
        v.copy_from_slice(xv);
        if d == 0 {
            return;
        }
        // rows in parallel pieces of about 64K elements
        let per = (1 << 16) / d + 1;
        super::threads::for_each_chunk(v, per * d, |_, rows| {
            math::vectorized(
                #[inline(always)]
                || norm_rows(rows, d, s, b, eps, rms),
            )
        });
    });
    Ok(())
}

/// The gradient of LayerNorm (`rms == false`) or RmsNorm over dims `axis..` (`Op::LayerNormGrad`
/// / `Op::RmsNormGrad`): from `x`, `scale` and the output gradient `dy`, writes `dx` and
/// `dy * xhat` (xhat the normalized x, its statistics recomputed by the forward's
/// [`row_stats`]). Per row, with `g = dy * scale`:
/// `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))` (RmsNorm: without `mean(g)`).
/// The row sums are f32 in sixteen lanes over 256-element pieces, the pieces summed in f64.
#[allow(clippy::too_many_arguments)]
pub fn norm_grad(
    x: &TensorRef,
    scale: &TensorRef,
    dy: &TensorRef,
    axis: usize,
    eps: f32,
    rms: bool,
    outs: &mut [super::into::TensorMut],
    ws: &mut Workspace,
) -> Result<(), String> {
    let [dx, dyxh] = outs else {
        return Err("internal: a norm gradient has two outputs".into());
    };
    let n = x.data.len();
    if dy.data.len() != n || dx.data.len() != n || dyxh.data.len() != n {
        return Err("internal: norm gradient operands of different lengths".into());
    }
    let norm_dims = &x.shape[axis..];
    let d: usize = norm_dims.iter().product();
    let row_len = if scale.data.len() == d { 0 } else { d };
    let [xs, ys, ss, sr, os1, os2] = ws.f32s.take([
        stage_len(x.data),
        stage_len(dy.data),
        stage_len(scale.data),
        row_len,
        out_stage_len(&dx.data),
        out_stage_len(&dyxh.data),
    ]);
    let xv = floats(x.data, xs);
    let dyv = floats(dy.data, ys);
    let s = param_row(scale, norm_dims, ss, sr);
    store_f32(&mut dyxh.data, os2, |o2| {
        store_f32(&mut dx.data, os1, |o1| {
            if d == 0 {
                return;
            }
            let o2p = super::threads::SendPtr(o2.as_mut_ptr());
            // rows in parallel pieces of about 64K elements
            let per = ((1 << 16) / d + 1) * d;
            super::threads::for_each_chunk(o1, per, |k, dxr| {
                let at = k * per;
                let n = dxr.len();
                // SAFETY: chunk k of `o2` (same length as `o1`) is written only here.
                let yh = unsafe { std::slice::from_raw_parts_mut(o2p.get().add(at), n) };
                let (xr, gr) = (&xv[at..at + n], &dyv[at..at + n]);
                math::vectorized(
                    #[inline(always)]
                    || norm_grad_rows(xr, gr, s, d, eps, rms, dxr, yh),
                )
            });
        })
    });
    Ok(())
}

/// [`norm_grad`] over whole rows of `d` elements.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn norm_grad_rows(
    x: &[f32],
    dy: &[f32],
    s: &[f32],
    d: usize,
    eps: f32,
    rms: bool,
    dx: &mut [f32],
    dyxh: &mut [f32],
) {
    let rows = x.chunks_exact(d).zip(dy.chunks_exact(d));
    for ((xr, gr), (dxr, yr)) in rows.zip(dx.chunks_exact_mut(d).zip(dyxh.chunks_exact_mut(d))) {
        // the forward's statistics
        let (mean, rstd) = row_stats(xr, eps, rms);
        // sums of g and g * xhat; dy * xhat stored on the way
        let (mut sg, mut sgx) = (0f64, 0f64);
        let pieces = xr.chunks(256).zip(gr.chunks(256)).zip(s.chunks(256));
        for (((xp, gp), sp), yp) in pieces.zip(yr.chunks_mut(256)) {
            let (mut a, mut b) = ([0f32; 16], [0f32; 16]);
            let mut xc = xp.chunks_exact(16);
            let mut gc = gp.chunks_exact(16);
            let mut sc = sp.chunks_exact(16);
            let mut yc = yp.chunks_exact_mut(16);
            for (((xk, gk), sk), yk) in (&mut xc).zip(&mut gc).zip(&mut sc).zip(&mut yc) {
                for k in 0..16 {
                    let xh = (xk[k] - mean) * rstd;
                    let g = gk[k] * sk[k];
                    yk[k] = gk[k] * xh;
                    a[k] += g;
                    b[k] += g * xh;
                }
            }
            let (mut pa, mut pb) = (0f64, 0f64);
            let tail = xc
                .remainder()
                .iter()
                .zip(gc.remainder())
                .zip(sc.remainder());
            for (((&xv, &gv), &sv), y) in tail.zip(yc.into_remainder()) {
                let xh = (xv - mean) * rstd;
                let g = gv * sv;
                *y = gv * xh;
                pa += g as f64;
                pb += (g * xh) as f64;
            }
            for k in 0..16 {
                pa += a[k] as f64;
                pb += b[k] as f64;
            }
            sg += pa;
            sgx += pb;
        }
        let mg = if rms { 0.0 } else { (sg / d as f64) as f32 };
        let mgx = (sgx / d as f64) as f32;
        for (((o, &xv), &g), &sv) in dxr.iter_mut().zip(xr).zip(gr).zip(s) {
            let xh = (xv - mean) * rstd;
            *o = rstd * (g * sv - mg - xh * mgx);
        }
    }
}

/// A scale or bias as a row of the normalized dims' element count: the parameter's own
/// elements (widened into `stage` if not f32) when it has that many, else broadcast into
/// `row`.
fn param_row<'a>(
    p: &TensorRef<'a>,
    norm_dims: &[usize],
    stage: &'a mut [f32],
    row: &'a mut [f32],
) -> &'a [f32] {
    let v = floats(p.data, stage);
    if v.len() == norm_dims.iter().product::<usize>() {
        return v;
    }
    expand_into(v, p.shape, norm_dims, row);
    row
}

/// One row's mean (0 for RmsNorm) and 1 / sqrt(variance + eps), summed in f64: what
/// [`norm`] normalizes with and [`norm_grad`] recomputes.
#[inline(always)]
fn row_stats(row: &[f32], eps: f32, rms: bool) -> (f32, f32) {
    let d = row.len() as f64;
    let mean = if rms { 0.0 } else { (sum_f64(row) / d) as f32 };
    let var = sum_sq_f64(row, mean) / d;
    (mean, (1.0 / (var + eps as f64).sqrt()) as f32)
}

#[inline(always)]
fn norm_rows(v: &mut [f32], d: usize, s: &[f32], b: Option<&[f32]>, eps: f32, rms: bool) {
    for row in v.chunks_exact_mut(d) {
        let (mean, rstd) = row_stats(row, eps, rms);
        match b {
            Some(b) => {
                for ((x, &s), &b) in row.iter_mut().zip(s).zip(b) {
                    *x = (*x - mean) * rstd * s + b;
                }
            }
            None => {
                for (x, &s) in row.iter_mut().zip(s) {
                    *x = (*x - mean) * rstd * s;
                }
            }
        }
    }
}

/// Labels as row indices: each must lie in `0..dim` (no wrapping, as ONNX
/// SoftmaxCrossEntropyLoss), else the error names the position and the value.
fn label_at(labels: &TensorRef, k: usize, dim: usize) -> Result<usize, String> {
    use super::into::DataRef;
    let l = match labels.data {
        DataRef::I64(v) => v[k],
        DataRef::I32(v) => v[k] as i64,
        d => return Err(format!("labels must be int64 or int32, got {}", d.dtype())),
    };
    usize::try_from(l)
        .ok()
        .filter(|&l| l < dim)
        .ok_or_else(|| format!("label {l} at position {k} is outside the {dim} classes 0..{dim}"))
}

/// Per contiguous row (`dim` elements, label `labels[r]`): the loss `m + ln s - x[label]`
/// (`grad == None`) written to `out[r]`, or the gradient `(exp(x - m) / s - onehot) * g[r]`
/// written to the row of `out` (`grad == Some(g)`).
#[inline(always)]
fn ce_body(x: &[f32], labels: &[usize], grad: Option<&[f32]>, dim: usize, out: &mut [f32]) {
    for (r, row) in x.chunks_exact(dim).enumerate() {
        let m = row_max(row);
        let l = labels[r];
        match grad {
            None => out[r] = (m as f64 + sum_exp(row, m).ln() - row[l] as f64) as f32,
            Some(g) => {
                // exp(x - m) once: stored, summed, then scaled in place
                let o = &mut out[r * dim..(r + 1) * dim];
                let s = sum_exp_store(row, m, o);
                let g = g[r];
                let scale = (g as f64 / s) as f32;
                for o in o.iter_mut() {
                    *o *= scale;
                }
                o[l] -= g;
            }
        }
    }
}

/// [`ce_body`], [`math::vectorized`].
fn ce_rows(x: &[f32], labels: &[usize], grad: Option<&[f32]>, dim: usize, out: &mut [f32]) {
    math::vectorized(
        #[inline(always)]
        || ce_body(x, labels, grad, dim, out),
    )
}

/// Per-position scratch of [`ce_cols`]: running maximum, block maximum, block sums (f32),
/// total sums (f64), each one entry per position.
struct ColState<'a> {
    m: &'a mut [f32],
    bm: &'a mut [f32],
    acc: &'a mut [f32],
    total: &'a mut [f64],
}

/// [`ce_body`] for a class axis that is not last: `x` is one `[dim, lanes]` block (each
/// column a position, `labels.len()` = lanes) and `out` its losses (`[lanes]`) or its
/// gradient (`[dim, lanes]`). The class axis is swept row by row, each row across all
/// positions at once (contiguous, vectorized across positions), in blocks of 256 classes:
/// a block's maximum, the running sum rescaled where the maximum rose, then the block's
/// exponentials while it is in cache (f32 within a block, f64 across). The gradient is a
/// second sweep. Positions are split between threads in contiguous ranges.
fn ce_cols(
    x: &[f32],
    labels: &[usize],
    grad: Option<&[f32]>,
    dim: usize,
    out: &mut [f32],
    st: ColState,
) {
    let n = labels.len();
    let optr = super::threads::SendPtr(out.as_mut_ptr());
    let olen = if grad.is_some() { dim * n } else { n };
    let sp = (
        super::threads::SendPtr(st.m.as_mut_ptr()),
        super::threads::SendPtr(st.bm.as_mut_ptr()),
        super::threads::SendPtr(st.acc.as_mut_ptr()),
        super::threads::SendPtr(st.total.as_mut_ptr()),
    );
    super::threads::for_each_range(n, 64, |lo, hi| {
        let w = hi - lo;
        // SAFETY: each call writes only positions lo..hi of `out` (losses: those entries;
        // gradient: those columns of every row) and of the state arrays (each `n` long),
        // disjoint between calls; all outlive the parallel section.
        let (out, m, bm, acc, total) = unsafe {
            (
                std::slice::from_raw_parts_mut(optr.get(), olen),
                std::slice::from_raw_parts_mut(sp.0.get().add(lo), w),
                std::slice::from_raw_parts_mut(sp.1.get().add(lo), w),
                std::slice::from_raw_parts_mut(sp.2.get().add(lo), w),
                std::slice::from_raw_parts_mut(sp.3.get().add(lo), w),
            )
        };
        math::vectorized(
            #[inline(always)]
            || {
                let row = |d: usize| &x[d * n + lo..d * n + hi];
                m.fill(f32::NEG_INFINITY);
                total.fill(0.0);
                let mut d0 = 0;
                while d0 < dim {
                    let d1 = (d0 + 256).min(dim);
                    bm.copy_from_slice(m);
                    for d in d0..d1 {
                        for (b, &v) in bm.iter_mut().zip(row(d)) {
                            if v > *b {
                                *b = v;
                            }
                        }
                    }
                    for ((t, mm), &b) in total.iter_mut().zip(m.iter_mut()).zip(bm.iter()) {
                        if b > *mm {
                            *t *= math::exp(*mm - b) as f64;
                            *mm = b;
                        }
                    }
                    acc.fill(0.0);
                    for d in d0..d1 {
                        for ((a, &v), &mm) in acc.iter_mut().zip(row(d)).zip(m.iter()) {
                            *a += math::exp(v - mm);
                        }
                    }
                    for (t, &a) in total.iter_mut().zip(acc.iter()) {
                        *t += a as f64;
                    }
                    d0 = d1;
                }
                match grad {
                    None => {
                        for k in 0..w {
                            let i = lo + k;
                            let xl = x[labels[i] * n + i];
                            out[i] = (m[k] as f64 + total[k].ln() - xl as f64) as f32;
                        }
                    }
                    Some(g) => {
                        // the scale per position, in the block-sum scratch
                        for ((a, &t), &gi) in acc.iter_mut().zip(total.iter()).zip(&g[lo..hi]) {
                            *a = (gi as f64 / t) as f32;
                        }
                        for d in 0..dim {
                            let o = &mut out[d * n + lo..d * n + hi];
                            for (((o, &v), &mm), &sc) in
                                o.iter_mut().zip(row(d)).zip(m.iter()).zip(acc.iter())
                            {
                                *o = math::exp(v - mm) * sc;
                            }
                        }
                        for i in lo..hi {
                            out[labels[i] * n + i] -= g[i];
                        }
                    }
                }
            },
        )
    });
}

/// Softmax cross-entropy along `axis` of `x` against integer `labels` (x's shape without
/// `axis`): the per-position loss (`dy == None`, `out` shaped like the labels) or, given the
/// loss gradient `dy`, the logits' gradient (`out` shaped like `x`). Rows are computed in
/// f32 with f64 sums; with the axis not last, positions are swept side by side ([`ce_cols`]).
pub fn softmax_cross_entropy(
    x: &TensorRef,
    labels: &TensorRef,
    dy: Option<&TensorRef>,
    axis: usize,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    let (outer, dim, inner) = around_axis(x.shape, axis);
    let n = outer * inner;
    if dim == 0 {
        return if n == 0 {
            Ok(())
        } else {
            Err("softmax cross-entropy over an empty class axis".into())
        };
    }
    let [at] = ws.usizes.take([n]);
    for (k, a) in at.iter_mut().enumerate() {
        *a = label_at(labels, k, dim)?;
    }
    let cols = if inner != 1 { inner } else { 0 };
    let [xs, os, gs, m, bm, acc] = ws.f32s.take([
        stage_len(x.data),
        out_stage_len(out),
        dy.map_or(0, |d| stage_len(d.data)),
        cols,
        cols,
        cols,
    ]);
    let [total] = ws.f64s.take([cols]);
    let xv = floats(x.data, xs);
    let g = dy.map(|d| floats(d.data, gs));
    let at = &*at;
    store_f32(out, os, |o| {
        if inner != 1 {
            // the class axis is not last: lanes side by side, one block per outer index
            let per = if g.is_some() { dim * inner } else { inner };
            for (b, ob) in o.chunks_exact_mut(per).enumerate() {
                let lanes = b * inner..(b + 1) * inner;
                let xb = &xv[b * dim * inner..(b + 1) * dim * inner];
                let st = ColState {
                    m: &mut *m,
                    bm: &mut *bm,
                    acc: &mut *acc,
                    total: &mut *total,
                };
                ce_cols(xb, &at[lanes.clone()], g.map(|g| &g[lanes]), dim, ob, st);
            }
            return;
        }
        let run = |first: usize, o: &mut [f32]| {
            let per = if g.is_some() { dim } else { 1 };
            let count = o.len() / per;
            let rows = &xv[first * dim..(first + count) * dim];
            let g = g.map(|g| &g[first..first + count]);
            ce_rows(rows, &at[first..first + count], g, dim, o);
        };
        let per_row = if g.is_some() { dim } else { 1 };
        // rows in parallel pieces of about 64K elements
        let chunk = ((1 << 16) / dim).max(1);
        super::threads::for_each_chunk(o, chunk * per_row, |c, piece| run(c * chunk, piece));
    });
    Ok(())
}
