//! Indexing: Gather, GatherElements, GatherND, ScatterElements, ScatterND, OneHot, TopK,
//! each writing into its output buffers (index tables in workspace buffers).
//! Negative indices wrap once (ONNX); an index still out of range is an error that names
//! the index, the axis and its size.

use super::elem::{typed, typed_mut, Elem};
use super::into::{DataMut, DataRef, TensorMut, TensorRef, Workspace};
use super::layout::{around_axis, strides_of, walk};
use std::cmp::Ordering;

/// The elements of an integer (index) tensor, read as i64.
#[derive(Clone, Copy)]
pub(crate) enum Ids<'a> {
    I64(&'a [i64]),
    I32(&'a [i32]),
}

impl Ids<'_> {
    pub(crate) fn of<'a>(t: &TensorRef<'a>) -> Result<Ids<'a>, String> {
        match t.data {
            DataRef::I64(v) => Ok(Ids::I64(v)),
            DataRef::I32(v) => Ok(Ids::I32(v)),
            _ => Err(format!("indices must be i64 or i32, got {}", t.dtype())),
        }
    }

    #[inline(always)]
    pub(crate) fn get(self, i: usize) -> i64 {
        match self {
            Ids::I64(v) => v[i],
            Ids::I32(v) => v[i] as i64,
        }
    }

    fn len(self) -> usize {
        match self {
            Ids::I64(v) => v.len(),
            Ids::I32(v) => v.len(),
        }
    }
}

/// Wraps a negative index once and checks the range.
fn wrap(op: &str, i: i64, axis: usize, dim: usize) -> Result<usize, String> {
    let j = if i < 0 { i + dim as i64 } else { i };
    if j < 0 || j >= dim as i64 {
        return Err(format!(
            "{op}: index {i} is out of range for dim {axis} of size {dim}"
        ));
    }
    Ok(j as usize)
}

pub fn gather<T: Elem>(
    x: &TensorRef,
    idx: &TensorRef,
    axis: usize,
    out: &mut DataMut,
) -> Result<(), String> {
    let src = typed::<T>(x)?;
    let (outer, dim, inner) = around_axis(x.shape, axis);
    let ids = Ids::of(idx)?;
    // every index checked before anything is written
    for p in 0..ids.len() {
        wrap("Gather", ids.get(p), axis, dim)?;
    }
    let dst = typed_mut::<T>(out)?;
    let mut at = 0;
    for o in 0..outer {
        for p in 0..ids.len() {
            let j = wrap("Gather", ids.get(p), axis, dim)?;
            let b = (o * dim + j) * inner;
            dst[at..at + inner].copy_from_slice(&src[b..b + inner]);
            at += inner;
        }
    }
    Ok(())
}

/// Checks that `indices` fits inside `data` off `axis` (GatherElements/ScatterElements).
fn check_elements_shape(
    op: &str,
    data: &[usize],
    ind: &[usize],
    axis: usize,
) -> Result<(), String> {
    for d in 0..data.len() {
        if d != axis && ind[d] > data[d] {
            return Err(format!(
                "{op}: indices dim {d} has size {} but the data only {}",
                ind[d], data[d]
            ));
        }
    }
    Ok(())
}

/// For every index position of `ind` (row-major), the offset into the data with the
/// `axis` coordinate replaced by the wrapped index, into `out` (one per index).
fn element_targets(
    op: &str,
    data: &[usize],
    ind: &TensorRef,
    axis: usize,
    out: &mut [usize],
) -> Result<(), String> {
    check_elements_shape(op, data, ind.shape, axis)?;
    let ids = Ids::of(ind)?;
    let mut dst = strides_of(data);
    let axis_stride = dst[axis] as usize;
    dst[axis] = 0;
    let ist = strides_of(ind.shape);
    let mut err = None;
    walk(ind.shape, [&ist, &dst], [0, 0], |[p, o]| {
        let p = p as usize;
        match wrap(op, ids.get(p), axis, data[axis]) {
            Ok(j) => out[p] = o as usize + j * axis_stride,
            Err(e) => {
                err.get_or_insert(e);
            }
        }
    });
    match err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

pub fn gather_elements<T: Elem>(
    x: &TensorRef,
    idx: &TensorRef,
    axis: usize,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    let src = typed::<T>(x)?;
    let [at] = ws.usizes.take([idx.data.len()]);
    element_targets("GatherElements", x.shape, idx, axis, at)?;
    let dst = typed_mut::<T>(out)?;
    dst.iter_mut().zip(&*at).for_each(|(d, &o)| *d = src[o]);
    Ok(())
}

pub fn scatter_elements<T: Elem>(
    (x, idx, upd): (&TensorRef, &TensorRef, &TensorRef),
    axis: usize,
    add: Option<fn(T, T) -> T>,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    let u = typed::<T>(upd)?;
    let dst = typed_mut::<T>(out)?;
    dst.copy_from_slice(typed::<T>(x)?);
    let [at] = ws.usizes.take([idx.data.len()]);
    element_targets("ScatterElements", x.shape, idx, axis, at)?;
    for (p, &o) in at.iter().enumerate() {
        dst[o] = match add {
            Some(f) => f(dst[o], u[p]),
            None => u[p],
        };
    }
    Ok(())
}

/// The number of slices a GatherND/ScatterND index tensor addresses with `b` leading batch
/// dims (the last dim holds the index tuples).
fn nd_count(data: &[usize], ind: &[usize], b: usize) -> usize {
    let r = ind.len();
    let batch: usize = data[..b].iter().product();
    let per_batch: usize = ind[b..r - 1].iter().product();
    batch * per_batch
}

/// Offsets of the slices addressed by the index tuples of a GatherND/ScatterND index tensor
/// (the last dim holds the tuples), for `b` leading batch dims shared by data and indices,
/// into `offs` ([`nd_count`] of them); returns the slice length.
fn nd_targets(
    op: &str,
    data: &[usize],
    ind: &TensorRef,
    b: usize,
    offs: &mut [usize],
) -> Result<usize, String> {
    let ids = Ids::of(ind)?;
    let r = ind.shape.len();
    let last = ind.shape[r - 1];
    let batch: usize = data[..b].iter().product();
    let batch_stride: usize = data[b..].iter().product();
    let per_batch: usize = ind.shape[b..r - 1].iter().product();
    let st = strides_of(data);
    let slice: usize = data[b + last..].iter().product();
    for bt in 0..batch {
        for m in 0..per_batch {
            let t = (bt * per_batch + m) * last;
            let mut off = bt * batch_stride;
            for j in 0..last {
                let a = b + j;
                off += wrap(op, ids.get(t + j), a, data[a])? * st[a] as usize;
            }
            offs[bt * per_batch + m] = off;
        }
    }
    Ok(slice)
}

pub fn gather_nd<T: Elem>(
    x: &TensorRef,
    idx: &TensorRef,
    batch_dims: usize,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    let src = typed::<T>(x)?;
    let [offs] = ws.usizes.take([nd_count(x.shape, idx.shape, batch_dims)]);
    let slice = nd_targets("GatherND", x.shape, idx, batch_dims, offs)?;
    let dst = typed_mut::<T>(out)?;
    for (p, &o) in offs.iter().enumerate() {
        dst[p * slice..(p + 1) * slice].copy_from_slice(&src[o..o + slice]);
    }
    Ok(())
}

pub fn scatter_nd<T: Elem>(
    (x, idx, upd): (&TensorRef, &TensorRef, &TensorRef),
    add: Option<fn(T, T) -> T>,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    typed_mut::<T>(out)?.copy_from_slice(typed::<T>(x)?);
    scatter_nd_onto((x.shape, idx, upd), add, out, ws)
}

/// The scatter of [`scatter_nd`] onto `out`, which already holds the data (of `shape`): the
/// in-place form, where the output lies in the data's own bytes.
pub fn scatter_nd_onto<T: Elem>(
    (shape, idx, upd): (&[usize], &TensorRef, &TensorRef),
    add: Option<fn(T, T) -> T>,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    let u = typed::<T>(upd)?;
    let out = typed_mut::<T>(out)?;
    let [offs] = ws.usizes.take([nd_count(shape, idx.shape, 0)]);
    let slice = nd_targets("ScatterND", shape, idx, 0, offs)?;
    for (p, &o) in offs.iter().enumerate() {
        let dst = &mut out[o..o + slice];
        let src = &u[p * slice..(p + 1) * slice];
        match add {
            Some(f) => dst.iter_mut().zip(src).for_each(|(d, &s)| *d = f(*d, s)),
            None => dst.copy_from_slice(src),
        }
    }
    Ok(())
}

/// ONNX OneHot: `on` at the index along the inserted `axis`, `off` elsewhere; indices in
/// [-depth, depth) wrap, others give an all-`off` row.
pub fn one_hot<T: Elem>(
    idx: &TensorRef,
    values: &TensorRef,
    axis: usize,
    depth: usize,
    out: &mut DataMut,
) -> Result<(), String> {
    let ids = Ids::of(idx)?;
    let v = typed::<T>(values)?;
    let (off, on) = (v[0], v[1]);
    let outer: usize = idx.shape[..axis].iter().product();
    let inner: usize = idx.shape[axis..].iter().product();
    let out = typed_mut::<T>(out)?;
    out.fill(off);
    for o in 0..outer {
        for i in 0..inner {
            let k = ids.get(o * inner + i);
            let k = if k < 0 { k + depth as i64 } else { k };
            if k >= 0 && (k as usize) < depth {
                out[(o * depth + k as usize) * inner + i] = on;
            }
        }
    }
    Ok(())
}

/// Float order with NaN above everything (PyTorch's sort/topk order).
fn nan_last(a: f64, b: f64) -> Ordering {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        _ => a.partial_cmp(&b).unwrap_or(Ordering::Equal),
    }
}

/// The order TopK compares elements of `x` in: integers (and bools) as i64, floats as f64
/// with NaN above everything.
fn value_cmp(x: DataRef<'_>, a: usize, b: usize) -> Ordering {
    match x {
        DataRef::I64(v) => v[a].cmp(&v[b]),
        DataRef::I32(v) => (v[a] as i64).cmp(&(v[b] as i64)),
        DataRef::Bool(v) => (v[a] as i64).cmp(&(v[b] as i64)),
        DataRef::F32(v) => nan_last(v[a] as f64, v[b] as f64),
        DataRef::BF16(v) => nan_last(v[a].to_f64(), v[b].to_f64()),
        DataRef::F16(v) => nan_last(v[a].to_f64(), v[b].to_f64()),
    }
}

/// Indices of the top `k` along `axis` into `out`, sorted (largest first, or smallest
/// first), ties by the lower index; laid out as `[outer, k, inner]`. `lane` holds the
/// axis' size.
fn topk_indices(
    x: &TensorRef,
    axis: usize,
    k: usize,
    largest: bool,
    lane: &mut [usize],
    out: &mut [i64],
) {
    let (outer, dim, inner) = around_axis(x.shape, axis);
    if k == 0 {
        return;
    }
    if k > dim {
        out.fill(0); // positions past the axis' size
    }
    for o in 0..outer {
        for i in 0..inner {
            let base = o * dim * inner + i;
            let lane = &mut lane[..dim];
            for (d, l) in lane.iter_mut().enumerate() {
                *l = base + d * inner;
            }
            // a total order: by value (descending if largest), then by position
            let cmp = |a: &usize, b: &usize| {
                let c = value_cmp(x.data, *a, *b);
                let c = if largest { c.reverse() } else { c };
                c.then(a.cmp(b))
            };
            let top = if k < dim {
                lane.select_nth_unstable_by(k - 1, cmp);
                &mut lane[..k]
            } else {
                lane
            };
            top.sort_unstable_by(cmp);
            for (j, &p) in top.iter().enumerate() {
                out[(o * k + j) * inner + i] = ((p - base) / inner) as i64;
            }
        }
    }
}

/// TopK into `values` (of `x`'s dtype) and `indices` (i64), both `[outer, k, inner]`.
pub fn topk<T: Elem>(
    x: &TensorRef,
    (axis, k, largest): (usize, usize, bool),
    outs: &mut [TensorMut],
    ws: &mut Workspace,
) -> Result<(), String> {
    let [values, indices] = outs else {
        return Err("internal: TopK has two outputs".into());
    };
    let src = typed::<T>(x)?;
    let (outer, dim, inner) = around_axis(x.shape, axis);
    let ids = typed_mut::<i64>(&mut indices.data)?;
    let [lane] = ws.usizes.take([dim]);
    topk_indices(x, axis, k, largest, lane, ids);
    let vals = typed_mut::<T>(&mut values.data)?;
    let mut at = 0;
    for o in 0..outer {
        for j in 0..k {
            for i in 0..inner {
                let d = ids[(o * k + j) * inner + i] as usize;
                vals[at] = src[(o * dim + d) * inner + i];
                at += 1;
            }
        }
    }
    Ok(())
}
