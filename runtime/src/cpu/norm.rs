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

#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    // eight independent lanes (the max of a row does not depend on the order); NaN wins
    #[inline(always)]
    fn mx(m: f32, x: f32) -> f32 {
        if x > m || x.is_nan() {
            x
        } else {
            m
        }
    }
    let mut acc = [f32::NEG_INFINITY; 8];
    let mut chunks = row.chunks_exact(8);
    for c in &mut chunks {
        for k in 0..8 {
            acc[k] = mx(acc[k], c[k]);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| mx(m, x));
    acc.iter().fold(tail, |m, &x| mx(m, x))
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
    let mut sum = 0f64;
    for c in row.chunks(256) {
        let mut e = [0f32; 256];
        for (e, &x) in e.iter_mut().zip(c) {
            *e = math::exp(x - m);
        }
        sum += sum_f64(&e[..c.len()]);
    }
    let lse = sum.ln() as f32;
    row.iter_mut().for_each(|x| *x = (*x - m) - lse);
}

/// (Log)softmax of every contiguous row of `dim` elements of `v`, in place: rows in
/// parallel when there are threads, and on x86-64 compiled a second time with AVX2 (picked
/// at run time) so the exp polynomial runs 8 lanes wide.
fn softmax_rows(v: &mut [f32], dim: usize, log: bool) {
    #[inline(always)]
    fn body(v: &mut [f32], dim: usize, log: bool) {
        for row in v.chunks_exact_mut(dim) {
            if log {
                log_softmax_row(row)
            } else {
                softmax_row(row)
            }
        }
    }
    fn rows(v: &mut [f32], dim: usize, log: bool) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            #[target_feature(enable = "avx2")]
            unsafe fn wide(v: &mut [f32], dim: usize, log: bool) {
                body(v, dim, log)
            }
            // SAFETY: AVX2 support was just detected.
            unsafe { wide(v, dim, log) };
            return;
        }
        body(v, dim, log)
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
            for_each_lane(v, x.shape, axis, buf, log_softmax_row);
        } else {
            for_each_lane(v, x.shape, axis, buf, softmax_row);
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
        super::threads::for_each_chunk(v, per * d, |_, rows| norm_rows(rows, d, s, b, eps, rms));
    });
    Ok(())
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

fn norm_rows(v: &mut [f32], d: usize, s: &[f32], b: Option<&[f32]>, eps: f32, rms: bool) {
    for row in v.chunks_exact_mut(d) {
        let mean = if rms {
            0.0
        } else {
            (sum_f64(row) / d as f64) as f32
        };
        let var = row
            .iter()
            .map(|&x| {
                let c = (x - mean) as f64;
                c * c
            })
            .sum::<f64>()
            / d as f64;
        let rstd = (1.0 / (var + eps as f64).sqrt()) as f32;
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
