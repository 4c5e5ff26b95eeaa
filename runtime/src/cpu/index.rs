//! Indexing: Gather, GatherElements, GatherND, ScatterElements, ScatterND, OneHot, TopK.
//! Negative indices wrap once (ONNX); an index still out of range is an error that names
//! the index, the axis and its size.

use super::elem::{typed, Elem};
use super::layout::{around_axis, strides_of, walk};
use hzp_ir::{Data, Tensor};
use std::borrow::Cow;
use std::cmp::Ordering;

/// The elements of an integer tensor as i64.
fn indices(t: &Tensor) -> Result<Cow<'_, [i64]>, String> {
    match &t.data {
        Data::I64(v) => Ok(Cow::Borrowed(v)),
        Data::I32(v) => Ok(Cow::Owned(v.iter().map(|&x| x as i64).collect())),
        _ => Err(format!("indices must be i64 or i32, got {}", t.dtype())),
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

pub fn gather<T: Elem>(x: &Tensor, idx: &Tensor, axis: usize) -> Result<Data, String> {
    let src = typed::<T>(x)?;
    let (outer, dim, inner) = around_axis(&x.shape, axis);
    let ids: Vec<usize> = indices(idx)?
        .iter()
        .map(|&i| wrap("Gather", i, axis, dim))
        .collect::<Result<_, _>>()?;
    let mut out = Vec::with_capacity(outer * ids.len() * inner);
    for o in 0..outer {
        for &j in &ids {
            let b = (o * dim + j) * inner;
            out.extend_from_slice(&src[b..b + inner]);
        }
    }
    Ok(T::wrap(out))
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

/// For every index position of `ind` (row-major): (position, offset into the data with the
/// `axis` coordinate replaced by the wrapped index).
fn element_targets(
    op: &str,
    data: &[usize],
    ind: &Tensor,
    axis: usize,
) -> Result<Vec<usize>, String> {
    check_elements_shape(op, data, &ind.shape, axis)?;
    let ids = indices(ind)?;
    let mut dst = strides_of(data);
    let axis_stride = dst[axis] as usize;
    dst[axis] = 0;
    let ist = strides_of(&ind.shape);
    let mut out = vec![0usize; ids.len()];
    let mut err = None;
    walk(&ind.shape, [&ist, &dst], [0, 0], |[p, o]| {
        let p = p as usize;
        match wrap(op, ids[p], axis, data[axis]) {
            Ok(j) => out[p] = o as usize + j * axis_stride,
            Err(e) => {
                err.get_or_insert(e);
            }
        }
    });
    match err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

pub fn gather_elements<T: Elem>(x: &Tensor, idx: &Tensor, axis: usize) -> Result<Data, String> {
    let src = typed::<T>(x)?;
    let at = element_targets("GatherElements", &x.shape, idx, axis)?;
    Ok(T::wrap(at.into_iter().map(|o| src[o]).collect()))
}

pub fn scatter_elements<T: Elem>(
    x: &Tensor,
    idx: &Tensor,
    upd: &Tensor,
    axis: usize,
    add: Option<fn(T, T) -> T>,
) -> Result<Data, String> {
    let mut out = typed::<T>(x)?.to_vec();
    let u = typed::<T>(upd)?;
    let at = element_targets("ScatterElements", &x.shape, idx, axis)?;
    for (p, o) in at.into_iter().enumerate() {
        out[o] = match add {
            Some(f) => f(out[o], u[p]),
            None => u[p],
        };
    }
    Ok(T::wrap(out))
}

/// Offsets of the slices addressed by the index tuples of a GatherND/ScatterND index tensor
/// (the last dim holds the tuples), for `b` leading batch dims shared by data and indices.
fn nd_targets(
    op: &str,
    data: &[usize],
    ind: &Tensor,
    b: usize,
) -> Result<(Vec<usize>, usize), String> {
    let ids = indices(ind)?;
    let r = ind.shape.len();
    let last = ind.shape[r - 1];
    let batch: usize = data[..b].iter().product();
    let batch_stride: usize = data[b..].iter().product();
    let per_batch: usize = ind.shape[b..r - 1].iter().product();
    let st = strides_of(data);
    let slice: usize = data[b + last..].iter().product();
    let mut offs = Vec::with_capacity(batch * per_batch);
    for bt in 0..batch {
        for m in 0..per_batch {
            let t = (bt * per_batch + m) * last;
            let mut off = bt * batch_stride;
            for j in 0..last {
                let a = b + j;
                off += wrap(op, ids[t + j], a, data[a])? * st[a] as usize;
            }
            offs.push(off);
        }
    }
    Ok((offs, slice))
}

pub fn gather_nd<T: Elem>(x: &Tensor, idx: &Tensor, batch_dims: usize) -> Result<Data, String> {
    let src = typed::<T>(x)?;
    let (offs, slice) = nd_targets("GatherND", &x.shape, idx, batch_dims)?;
    let mut out = Vec::with_capacity(offs.len() * slice);
    for o in offs {
        out.extend_from_slice(&src[o..o + slice]);
    }
    Ok(T::wrap(out))
}

pub fn scatter_nd<T: Elem>(
    x: &Tensor,
    idx: &Tensor,
    upd: &Tensor,
    add: Option<fn(T, T) -> T>,
) -> Result<Data, String> {
    let mut out = typed::<T>(x)?.to_vec();
    let u = typed::<T>(upd)?;
    let (offs, slice) = nd_targets("ScatterND", &x.shape, idx, 0)?;
    for (p, o) in offs.into_iter().enumerate() {
        let dst = &mut out[o..o + slice];
        let src = &u[p * slice..(p + 1) * slice];
        match add {
            Some(f) => dst.iter_mut().zip(src).for_each(|(d, &s)| *d = f(*d, s)),
            None => dst.copy_from_slice(src),
        }
    }
    Ok(T::wrap(out))
}

/// ONNX OneHot: `on` at the index along the inserted `axis`, `off` elsewhere; indices in
/// [-depth, depth) wrap, others give an all-`off` row.
pub fn one_hot<T: Elem>(
    idx: &Tensor,
    values: &Tensor,
    axis: usize,
    depth: usize,
) -> Result<Data, String> {
    let ids = indices(idx)?;
    let v = typed::<T>(values)?;
    let (off, on) = (v[0], v[1]);
    let outer: usize = idx.shape[..axis].iter().product();
    let inner: usize = idx.shape[axis..].iter().product();
    let mut out = vec![off; outer * depth * inner];
    for o in 0..outer {
        for i in 0..inner {
            let k = ids[o * inner + i];
            let k = if k < 0 { k + depth as i64 } else { k };
            if k >= 0 && (k as usize) < depth {
                out[(o * depth + k as usize) * inner + i] = on;
            }
        }
    }
    Ok(T::wrap(out))
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

/// Indices of the top `k` along `axis`, sorted (largest first, or smallest first), ties by
/// the lower index; laid out as `[outer, k, inner]`.
pub fn topk_indices(x: &Tensor, axis: usize, k: usize, largest: bool) -> Vec<i64> {
    let (outer, dim, inner) = around_axis(&x.shape, axis);
    let mut out = vec![0i64; outer * k * inner];
    let ints = x.to_i64_vec();
    let floats = if ints.is_none() {
        x.to_f64_vec()
    } else {
        Vec::new()
    };
    let value_cmp = |a: usize, b: usize| -> Ordering {
        match &ints {
            Some(v) => v[a].cmp(&v[b]),
            None => nan_last(floats[a], floats[b]),
        }
    };
    let mut lane: Vec<usize> = Vec::with_capacity(dim);
    for o in 0..outer {
        for i in 0..inner {
            let base = o * dim * inner + i;
            lane.clear();
            lane.extend((0..dim).map(|d| base + d * inner));
            // a total order: by value (descending if largest), then by position
            let cmp = |a: &usize, b: &usize| {
                let c = value_cmp(*a, *b);
                let c = if largest { c.reverse() } else { c };
                c.then(a.cmp(b))
            };
            if k == 0 {
                continue;
            }
            if k < dim {
                lane.select_nth_unstable_by(k - 1, cmp);
                lane.truncate(k);
            }
            lane.sort_unstable_by(cmp);
            for (j, &p) in lane.iter().enumerate() {
                out[(o * k + j) * inner + i] = ((p - base) / inner) as i64;
            }
        }
    }
    out
}

/// Values at `[outer, k, inner]` indices along `axis` (the values output of TopK).
pub fn take_along<T: Elem>(x: &Tensor, axis: usize, ids: &[i64], k: usize) -> Result<Data, String> {
    let src = typed::<T>(x)?;
    let (outer, dim, inner) = around_axis(&x.shape, axis);
    let mut out = Vec::with_capacity(ids.len());
    for o in 0..outer {
        for j in 0..k {
            for i in 0..inner {
                let d = ids[(o * k + j) * inner + i] as usize;
                out.push(src[(o * dim + d) * inner + i]);
            }
        }
    }
    Ok(T::wrap(out))
}
