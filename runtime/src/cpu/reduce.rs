//! Reductions: Reduce (sum/mean/max/min/prod over axes), ArgMax and CumSum. Float sums and
//! products accumulate in f64; max/min propagate NaN like PyTorch; integers wrap.

use super::elem::{floats, from_f32, typed};
use super::elementwise::IntElem;
use super::layout::{around_axis, strides_of, walk_rows};
use hzp_ir::{DType, Data, ReduceOp, Tensor};

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

/// Folds every input element into its output slot: `acc[slot] = f(acc[slot], x)`.
/// Reducing trailing axes only is the contiguous-rows fast path.
fn fold<A: Copy, X: Copy>(
    x: &[X],
    shape: &[usize],
    axes: &[usize],
    init: A,
    f: impl Fn(A, X) -> A,
) -> Vec<A> {
    let out_n: usize = (0..shape.len())
        .filter(|d| !axes.contains(d))
        .map(|d| shape[d])
        .product();
    let mut acc = vec![init; out_n];
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
        return acc;
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
    acc
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

fn int_reduce<T: IntElem>(x: &Tensor, op: ReduceOp, axes: &[usize]) -> Result<Data, String> {
    let v = typed::<T>(x)?;
    let s = &x.shape;
    let out = match op {
        ReduceOp::Sum => fold(v, s, axes, T::ZERO, |a, b| a.wadd(b)),
        ReduceOp::Prod => fold(v, s, axes, T::ONE, |a, b| a.wmul(b)),
        ReduceOp::Max => fold(v, s, axes, T::MIN, |a, b| a.max(b)),
        ReduceOp::Min => fold(v, s, axes, T::MAX, |a, b| a.min(b)),
        ReduceOp::Mean => return Err("Reduce mean needs a float input".into()),
    };
    Ok(T::wrap(out))
}

/// Reduce over `axes` (the output layout does not depend on `keep_dims`).
/// Over an empty set: sum 0, prod 1, max the dtype's lowest value, min its highest
/// (like ONNX), mean NaN.
pub fn reduce(x: &Tensor, op: ReduceOp, axes: &[usize]) -> Result<Data, String> {
    let mut axes = axes.to_vec();
    axes.sort_unstable();
    axes.dedup();
    let s = &x.shape;
    match x.dtype() {
        DType::I64 => int_reduce::<i64>(x, op, &axes),
        DType::I32 => int_reduce::<i32>(x, op, &axes),
        DType::Bool => {
            let v = typed::<bool>(x)?;
            Ok(Data::Bool(match op {
                ReduceOp::Sum | ReduceOp::Max => fold(v, s, &axes, false, |a, b| a | b),
                ReduceOp::Prod | ReduceOp::Min => fold(v, s, &axes, true, |a, b| a & b),
                ReduceOp::Mean => return Err("Reduce mean needs a float input".into()),
            }))
        }
        dt => {
            let v = floats(x);
            if let Some(out) = float_rows(&v, s, &axes, op) {
                return Ok(from_f32(dt, out));
            }
            let out: Vec<f32> = match op {
                ReduceOp::Sum => fold(&v, s, &axes, 0f64, |a, b| a + b as f64)
                    .into_iter()
                    .map(|a| a as f32)
                    .collect(),
                ReduceOp::Mean => {
                    let n: usize = axes.iter().map(|&a| s[a]).product();
                    fold(&v, s, &axes, 0f64, |a, b| a + b as f64)
                        .into_iter()
                        .map(|a| (a / n as f64) as f32)
                        .collect()
                }
                ReduceOp::Prod => fold(&v, s, &axes, 1f64, |a, b| a * b as f64)
                    .into_iter()
                    .map(|a| a as f32)
                    .collect(),
                ReduceOp::Max => fold(&v, s, &axes, f32::NEG_INFINITY, nan_max),
                ReduceOp::Min => fold(&v, s, &axes, f32::INFINITY, nan_min),
            };
            Ok(from_f32(dt, out))
        }
    }
}

/// Reduces contiguous rows (the reduced axes are the trailing ones): sums with four f64
/// accumulators, max/min eight lanes wide (NaN wins, as in the general fold). Rows in
/// parallel when there are threads. `None` for other layouts and Prod.
fn float_rows(v: &[f32], shape: &[usize], axes: &[usize], op: ReduceOp) -> Option<Vec<f32>> {
    let (r, n) = (shape.len(), axes.len());
    let trailing = axes.iter().enumerate().all(|(i, &a)| a == r - n + i);
    let row: usize = shape[r - n..].iter().product();
    if !trailing || row == 0 || matches!(op, ReduceOp::Prod) {
        return None;
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
    let rows = v.len() / row;
    let mut out = vec![0f32; rows];
    let per = (1 << 14) / row + 1; // rows per parallel piece
    super::threads::for_each_chunk(&mut out, per, |i, o| {
        for (k, o) in o.iter_mut().enumerate() {
            let j = i * per + k;
            *o = one(&v[j * row..(j + 1) * row]);
        }
    });
    Some(out)
}

/// Index of the first maximum along `axis` (NaN counts as the maximum, like PyTorch).
pub fn argmax(x: &Tensor, axis: usize) -> Result<Data, String> {
    let (outer, dim, inner) = around_axis(&x.shape, axis);
    if dim == 0 && outer * inner > 0 {
        return Err(format!("ArgMax over axis {axis} of size 0"));
    }
    let mut out = vec![0i64; outer * inner];
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
    match &x.data {
        Data::I64(v) => scan(v, outer, dim, inner, &mut out, |a, b| a > b),
        Data::I32(v) => scan(v, outer, dim, inner, &mut out, |a, b| a > b),
        Data::Bool(v) => scan(v, outer, dim, inner, &mut out, |a, b| a & !b),
        _ => {
            let v = floats(x);
            scan(&v, outer, dim, inner, &mut out, |a: f32, b: f32| {
                !b.is_nan() && (a.is_nan() || a > b)
            })
        }
    }
    Ok(Data::I64(out))
}

fn scan_axis<A: Copy, T: Copy>(
    v: &[T],
    shape: &[usize],
    axis: usize,
    (exclusive, reverse): (bool, bool),
    zero: A,
    add: impl Fn(A, T) -> A,
    store: impl Fn(A) -> T,
) -> Vec<T> {
    let (outer, dim, inner) = around_axis(shape, axis);
    let mut out = v.to_vec();
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
    out
}

/// Running sum along `axis` (ONNX CumSum with `exclusive` and `reverse`).
pub fn cumsum(x: &Tensor, axis: usize, exclusive: bool, reverse: bool) -> Result<Data, String> {
    let s = &x.shape;
    Ok(match &x.data {
        Data::I64(v) => Data::I64(scan_axis(
            v,
            s,
            axis,
            (exclusive, reverse),
            0i64,
            |a, b| a.wrapping_add(b),
            |a| a,
        )),
        Data::I32(v) => Data::I32(scan_axis(
            v,
            s,
            axis,
            (exclusive, reverse),
            0i32,
            |a, b| a.wrapping_add(b),
            |a| a,
        )),
        Data::Bool(_) => return Err("CumSum is not defined for bool".into()),
        _ => {
            let v = floats(x);
            let r = scan_axis(
                &v,
                s,
                axis,
                (exclusive, reverse),
                0f64,
                |a, b| a + b as f64,
                |a| a as f32,
            );
            from_f32(x.dtype(), r)
        }
    })
}
