//! Data movement: Transpose, Slice, Concat, Split, Expand, Tile, Trilu. (Reshape, Identity
//! and Copy only clone the data.) Every kernel is generic over the element type and
//! expressed through the strided walk where it can be.

use super::elem::{typed, Elem};
use super::layout::{around_axis, expand, gather_strided, strides_of};
use hzp_ir::{Data, Tensor};

pub fn transpose<T: Elem>(x: &Tensor, perm: &[usize]) -> Result<Data, String> {
    let src = typed::<T>(x)?;
    let st = strides_of(&x.shape);
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let strides: Vec<isize> = perm.iter().map(|&p| st[p]).collect();
    Ok(T::wrap(gather_strided(src, &shape, &strides, 0)))
}

/// Slice with per-axis start/end/step (already clamped; the type rule gave `out_shape`).
pub fn slice<T: Elem>(
    x: &Tensor,
    axes: &[usize],
    starts: &[i64],
    steps: &[i64],
    out_shape: &[usize],
) -> Result<Data, String> {
    let src = typed::<T>(x)?;
    let mut strides = strides_of(&x.shape);
    let mut base = 0isize;
    for i in 0..axes.len() {
        let a = axes[i];
        if out_shape[a] == 0 {
            return Ok(T::wrap(Vec::new()));
        }
        base += starts[i] as isize * strides[a];
        strides[a] *= steps[i] as isize;
    }
    Ok(T::wrap(gather_strided(src, out_shape, &strides, base)))
}

pub fn concat<T: Elem>(ins: &[&Tensor], axis: usize, out_shape: &[usize]) -> Result<Data, String> {
    let (outer, _, inner) = around_axis(out_shape, axis);
    let parts: Vec<(&[T], usize)> = ins
        .iter()
        .map(|t| Ok((typed::<T>(t)?, t.shape[axis] * inner)))
        .collect::<Result<_, String>>()?;
    let mut out = Vec::with_capacity(out_shape.iter().product());
    for o in 0..outer {
        for (src, chunk) in &parts {
            out.extend_from_slice(&src[o * chunk..(o + 1) * chunk]);
        }
    }
    Ok(T::wrap(out))
}

pub fn split<T: Elem>(x: &Tensor, axis: usize, sizes: &[usize]) -> Result<Vec<Data>, String> {
    let src = typed::<T>(x)?;
    let (outer, dim, inner) = around_axis(&x.shape, axis);
    let mut outs = Vec::with_capacity(sizes.len());
    let mut start = 0;
    for &n in sizes {
        let mut v = Vec::with_capacity(outer * n * inner);
        for o in 0..outer {
            let b = (o * dim + start) * inner;
            v.extend_from_slice(&src[b..b + n * inner]);
        }
        outs.push(T::wrap(v));
        start += n;
    }
    Ok(outs)
}

pub fn expand_to<T: Elem>(x: &Tensor, shape: &[usize]) -> Result<Data, String> {
    Ok(T::wrap(expand(typed::<T>(x)?, &x.shape, shape)))
}

/// Tile as a broadcast: view `[d0, d1, ..]` as `[1, d0, 1, d1, ..]`, expand to
/// `[r0, d0, r1, d1, ..]`, and read that row-major.
pub fn tile<T: Elem>(x: &Tensor, repeats: &[usize]) -> Result<Data, String> {
    let src = typed::<T>(x)?;
    let st = strides_of(&x.shape);
    let mut shape = Vec::with_capacity(2 * repeats.len());
    let mut strides = Vec::with_capacity(2 * repeats.len());
    for (d, &r) in repeats.iter().enumerate() {
        shape.extend([r, x.shape[d]]);
        strides.extend([0, st[d]]);
    }
    Ok(T::wrap(gather_strided(src, &shape, &strides, 0)))
}

/// Keeps the upper (`j - i >= k`) or lower (`j - i <= k`) triangle of the last two dims.
pub fn trilu<T: Elem>(x: &Tensor, upper: bool, k: i64) -> Result<Data, String> {
    let src = typed::<T>(x)?;
    let r = x.shape.len();
    let (m, n) = (x.shape[r - 2], x.shape[r - 1]);
    let mut out = src.to_vec();
    if m * n == 0 {
        return Ok(T::wrap(out));
    }
    for mat in out.chunks_mut(m * n) {
        for i in 0..m {
            for j in 0..n {
                let d = j as i64 - i as i64;
                let keep = if upper { d >= k } else { d <= k };
                if !keep {
                    mat[i * n + j] = T::default();
                }
            }
        }
    }
    Ok(T::wrap(out))
}
