//! Reductions: Reduce (sum/mean/max/min/prod over axes), ArgMax and CumSum. Float sums and
//! products accumulate in f64; max/min propagate NaN like PyTorch; integers wrap.

use super::elem::{floats, out_stage_len, stage_len, store_f32, typed, typed_mut};
use super::elementwise::IntElem;
use super::into::{DataMut, DataRef, TensorRef, Workspace};
use super::layout::{around_axis, strides_of, walk_rows};
use hzp_ir::{DType, ReduceOp};

/// Strides that map every input position to its output slot (0 along reduced axes).
fn output_strides(shape: &[usize], axes: &[usize]) -> Vec<isize> {
    let kept: Vec<usize> = (0..shape.len())
        .map(|d| if axes.contains(&d) { 1 } else { shape[d] })
        .collect();
    let mut st = strides_of(&kept);
    for &a in axes {
        st[a] = 0;
    }
    st
}

/// Sums over leading axes (the reduced axes are `0..k`, `k` < rank) of a row-major tensor,
/// `cols` elements per row: per column, in f64, the rows in order. The same additions in
/// the same order as [`fold`], at the CPU's vector width.
fn sum_leading(x: &[f32], cols: usize, acc: &mut [f64]) {
    super::math::vectorized(
        #[inline(always)]
        || {
            acc.fill(0.0);
            for row in x.chunks_exact(cols) {
                for (a, &v) in acc.iter_mut().zip(row) {
                    *a += v as f64;
                }
            }
        },
    )
}

/// The columns of a reduction over leading axes only (see [`sum_leading`]).
fn leading_cols(shape: &[usize], axes: &[usize]) -> Option<usize> {
    let prefix = axes.iter().enumerate().all(|(i, &a)| a == i);
    let cols: usize = shape[axes.len().min(shape.len())..].iter().product();
    (prefix && !axes.is_empty() && axes.len() < shape.len() && cols > 0).then_some(cols)
}

/// Folds every input element into its output slot: `acc[slot] = f(acc[slot], x)`, with
/// `acc` (one slot per output element) first set to `init`. Reducing trailing axes only is
/// the contiguous-rows fast path.
fn fold<A: Copy, X: Copy>(
    x: &[X],
    shape: &[usize],
    axes: &[usize],
    acc: &mut [A],
    init: A,
    f: impl Fn(A, X) -> A,
) {
    acc.fill(init);
    // axes are sorted and deduplicated: reducing the trailing dims folds contiguous rows
    let (r, n) = (shape.len(), axes.len());
    if axes.iter().enumerate().all(|(i, &a)| a == r - n + i) {
        let row: usize = shape[r - n..].iter().product();
        if row > 0 {
            for (a, chunk) in acc.iter_mut().zip(x.chunks_exact(row)) {
                let mut s = *a;
                for &v in chunk {
                    s = f(s, v);
                }
                *a = s;
            }
        }
        return;
    }
    let ist = strides_of(shape);
    let ost = output_strides(shape, axes);
    walk_rows(shape, [&ist, &ost], [0, 0], |[i, o], len, [si, so]| {
        let (i, o) = (i as usize, o as usize);
        if si == 1 && so == 1 {
            for (a, &v) in acc[o..o + len].iter_mut().zip(&x[i..i + len]) {
                *a = f(*a, v);
            }
        } else {
            let mut s = acc[o];
            let (si, so) = (si as usize, so as usize);
            for t in 0..len {
                if so == 0 {
                    s = f(s, x[i + t * si]);
                } else {
                    acc[o + t * so] = f(acc[o + t * so], x[i + t * si]);
                }
            }
            if so == 0 {
                acc[o] = s;
            }
        }
    });
}

fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

fn nan_min(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.min(b)
    }
}

fn int_reduce<T: IntElem>(
    x: &TensorRef,
    op: ReduceOp,
    axes: &[usize],
    out: &mut DataMut,
) -> Result<(), String> {
    let v = typed::<T>(x)?;
    let s = x.shape;
    let o = typed_mut::<T>(out)?;
    match op {
        ReduceOp::Sum => fold(v, s, axes, o, T::ZERO, |a, b| a.wadd(b)),
        ReduceOp::Prod => fold(v, s, axes, o, T::ONE, |a, b| a.wmul(b)),
        ReduceOp::Max => fold(v, s, axes, o, T::MIN, |a, b| a.max(b)),
        ReduceOp::Min => fold(v, s, axes, o, T::MAX, |a, b| a.min(b)),
        ReduceOp::Mean => return Err("Reduce mean needs a float input".into()),
    }
    Ok(())
}

/// Reduce over `axes` into `out` (the output layout does not depend on `keep_dims`).
/// Over an empty set: sum 0, prod 1, max the dtype's lowest value, min its highest
/// (like ONNX), mean NaN.
pub fn reduce(
    x: &TensorRef,
    op: ReduceOp,
    axes: &[usize],
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    // sorted and deduplicated (as the type rule leaves them, usually: then no copy)
    let owned;
    let axes = if axes.windows(2).all(|w| w[0] < w[1]) {
        axes
    } else {
        let mut v = axes.to_vec();
        v.sort_unstable();
        v.dedup();
        owned = v;
        &owned[..]
    };
    let s = x.shape;
    match x.dtype() {
        DType::I64 => int_reduce::<i64>(x, op, axes, out),
        DType::I32 => int_reduce::<i32>(x, op, axes, out),
        DType::Bool => {
            let v = typed::<bool>(x)?;
            let o = typed_mut::<bool>(out)?;
            match op {
                ReduceOp::Sum | ReduceOp::Max => fold(v, s, axes, o, false, |a, b| a | b),
                ReduceOp::Prod | ReduceOp::Min => fold(v, s, axes, o, true, |a, b| a & b),
                ReduceOp::Mean => return Err("Reduce mean needs a float input".into()),
            }
            Ok(())
        }
        _ => {
            let n_out = out.len();
            let wide = !matches!(op, ReduceOp::Max | ReduceOp::Min);
            let [xs, os] = ws.f32s.take([stage_len(x.data), out_stage_len(out)]);
            let [acc] = ws.f64s.take([if wide { n_out } else { 0 }]);
            let v = floats(x.data, xs);
            store_f32(out, os, |o| {
                if float_rows(v, s, axes, op, o) {
                    return;
                }
                let sum = |acc: &mut [f64]| match leading_cols(s, axes) {
                    Some(cols) => sum_leading(v, cols, acc),
                    None => fold(v, s, axes, acc, 0f64, |a, b| a + b as f64),
                };
                match op {
                    ReduceOp::Sum => {
                        sum(acc);
                        o.iter_mut().zip(&*acc).for_each(|(o, &a)| *o = a as f32);
                    }
                    ReduceOp::Mean => {
                        let n: usize = axes.iter().map(|&a| s[a]).product();
                        sum(acc);
                        o.iter_mut()
                            .zip(&*acc)
                            .for_each(|(o, &a)| *o = (a / n as f64) as f32);
                    }
                    ReduceOp::Prod => {
                        fold(v, s, axes, acc, 1f64, |a, b| a * b as f64);
                        o.iter_mut().zip(&*acc).for_each(|(o, &a)| *o = a as f32);
                    }
                    ReduceOp::Max => fold(v, s, axes, o, f32::NEG_INFINITY, nan_max),
                    ReduceOp::Min => fold(v, s, axes, o, f32::INFINITY, nan_min),
                }
            });
            Ok(())
        }
    }
}

/// Reduces contiguous rows (the reduced axes are the trailing ones): sums with four f64
/// accumulators, max/min eight lanes wide (NaN wins, as in the general fold), into `out`.
/// Rows in parallel when there are threads. `false` (nothing written) for other layouts
/// and Prod.
fn float_rows(v: &[f32], shape: &[usize], axes: &[usize], op: ReduceOp, out: &mut [f32]) -> bool {
    let (r, n) = (shape.len(), axes.len());
    let trailing = axes.iter().enumerate().all(|(i, &a)| a == r - n + i);
    let row: usize = shape[r - n..].iter().product();
    if !trailing || row == 0 || matches!(op, ReduceOp::Prod) {
        return false;
    }
    fn lanes(row: &[f32], init: f32, f: fn(f32, f32) -> f32) -> f32 {
        let mut acc = [init; 8];
        let mut chunks = row.chunks_exact(8);
        for c in &mut chunks {
            for k in 0..8 {
                acc[k] = f(acc[k], c[k]);
            }
        }
        let mut m = chunks.remainder().iter().fold(init, |a, &x| f(a, x));
        for a in acc {
            m = f(m, a);
        }
        m
    }
    let one = |row: &[f32]| -> f32 {
        match op {
            ReduceOp::Sum => super::norm::sum_f64(row) as f32,
            ReduceOp::Mean => (super::norm::sum_f64(row) / row.len() as f64) as f32,
            ReduceOp::Max => lanes(row, f32::NEG_INFINITY, nan_max),
            ReduceOp::Min => lanes(row, f32::INFINITY, nan_min),
            ReduceOp::Prod => f32::NAN,
        }
    };
    debug_assert_eq!(out.len(), v.len() / row);
    let per = (1 << 14) / row + 1; // rows per parallel piece
    super::threads::for_each_chunk(out, per, |i, o| {
        for (k, o) in o.iter_mut().enumerate() {
            let j = i * per + k;
            *o = one(&v[j * row..(j + 1) * row]);
        }
    });
    true
}

/// Index of the first maximum along `axis` (NaN counts as the maximum, like PyTorch).
pub fn argmax(
    x: &TensorRef,
    axis: usize,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    let (outer, dim, inner) = around_axis(x.shape, axis);
    if dim == 0 && outer * inner > 0 {
        return Err(format!("ArgMax over axis {axis} of size 0"));
    }
    let out = typed_mut::<i64>(out)?;
    // better(a, b): a strictly beats b
    fn scan<T: Copy>(
        v: &[T],
        outer: usize,
        dim: usize,
        inner: usize,
        out: &mut [i64],
        better: impl Fn(T, T) -> bool,
    ) {
        for o in 0..outer {
            for i in 0..inner {
                let base = o * dim * inner + i;
                let mut best = v[base];
                let mut bi = 0;
                for d in 1..dim {
                    let c = v[base + d * inner];
                    if better(c, best) {
                        best = c;
                        bi = d;
                    }
                }
                out[o * inner + i] = bi as i64;
            }
        }
    }
    match x.data {
        DataRef::I64(v) => scan(v, outer, dim, inner, out, |a, b| a > b),
        DataRef::I32(v) => scan(v, outer, dim, inner, out, |a, b| a > b),
        DataRef::Bool(v) => scan(v, outer, dim, inner, out, |a, b| a & !b),
        _ => {
            let [xs] = ws.f32s.take([stage_len(x.data)]);
            let v = floats(x.data, xs);
            scan(v, outer, dim, inner, out, |a: f32, b: f32| {
                !b.is_nan() && (a.is_nan() || a > b)
            })
        }
    }
    Ok(())
}

/// Running `add` along `axis` of `v` into `out` (every element written).
#[allow(clippy::too_many_arguments)]
fn scan_axis<A: Copy, T: Copy, R>(
    v: &[T],
    shape: &[usize],
    axis: usize,
    (exclusive, reverse): (bool, bool),
    out: &mut [R],
    zero: A,
    add: impl Fn(A, T) -> A,
    store: impl Fn(A) -> R,
) {
    let (outer, dim, inner) = around_axis(shape, axis);
    for o in 0..outer {
        for i in 0..inner {
            let base = o * dim * inner + i;
            let mut acc = zero;
            for step in 0..dim {
                let d = if reverse { dim - 1 - step } else { step };
                let at = base + d * inner;
                if exclusive {
                    out[at] = store(acc);
                    acc = add(acc, v[at]);
                } else {
                    acc = add(acc, v[at]);
                    out[at] = store(acc);
                }
            }
        }
    }
}

/// Running sum along `axis` (ONNX CumSum with `exclusive` and `reverse`) into `out`.
pub fn cumsum(
    x: &TensorRef,
    axis: usize,
    exclusive: bool,
    reverse: bool,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    let s = x.shape;
    let flags = (exclusive, reverse);
    match x.data {
        DataRef::I64(v) => {
            let o = typed_mut::<i64>(out)?;
            scan_axis(v, s, axis, flags, o, 0i64, |a, b| a.wrapping_add(b), |a| a)
        }
        DataRef::I32(v) => {
            let o = typed_mut::<i32>(out)?;
            scan_axis(v, s, axis, flags, o, 0i32, |a, b| a.wrapping_add(b), |a| a)
        }
        DataRef::Bool(_) => return Err("CumSum is not defined for bool".into()),
        _ => {
            let [xs, os] = ws.f32s.take([stage_len(x.data), out_stage_len(out)]);
            let v = floats(x.data, xs);
            store_f32(out, os, |o| {
                scan_axis(
                    v,
                    s,
                    axis,
                    flags,
                    o,
                    0f64,
                    |a, b| a + b as f64,
                    |a| a as f32,
                )
            });
        }
    }
    Ok(())
}
