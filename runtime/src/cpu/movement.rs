//! Data movement: Transpose, Slice, Concat, Split, Expand, Tile, Trilu. (Reshape, Identity
//! and Copy only clone the data.) Every kernel is generic over the element type and
//! expressed through the strided walk where it can be.

use super::elem::{typed, Elem};
use super::layout::{around_axis, expand, gather_strided, strides_of};
use hzp_ir::{Data, Tensor};

pub fn transpose<T: Elem>(x: &Tensor, perm: &[usize]) -> Result<Data, String> {
    let src = typed::<T>(x)?;
    let r = perm.len();
    if r >= 2
        && perm[r - 2] == r - 1
        && perm[r - 1] == r - 2
        && perm[..r - 2].iter().enumerate().all(|(i, &p)| i == p)
    {
        let (m, n) = (x.shape[r - 2], x.shape[r - 1]);
        return Ok(T::wrap(transpose_last2(src, m, n)));
    }
    let st = strides_of(&x.shape);
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let strides: Vec<isize> = perm.iter().map(|&p| st[p]).collect();
    Ok(T::wrap(gather_strided(src, &shape, &strides, 0)))
}

/// Transposes each `m x n` matrix of `src` (a stack of them) in blocks of 8 x 8, so that
/// both the reads and the writes stay within a few cache lines (larger blocks would map
/// power-of-two strided rows onto the same cache sets). Bands of 64 input rows in parallel.
fn transpose_last2<T: Copy + Default + Send + Sync>(src: &[T], m: usize, n: usize) -> Vec<T> {
    const B: usize = 8;
    const BAND: usize = 64;
    let mut out = vec![T::default(); src.len()];
    if m * n == 0 {
        return out;
    }
    let bands = m.div_ceil(BAND);
    let mats = src.len() / (m * n);
    let o = super::threads::SendPtr(out.as_mut_ptr());
    super::threads::for_each_index(mats * bands, |p| {
        let (mat, band) = (p / bands, p % bands);
        let a = &src[mat * m * n..(mat + 1) * m * n];
        let (r0, r1) = (band * BAND, ((band + 1) * BAND).min(m));
        for i0 in (r0..r1).step_by(B) {
            let i1 = (i0 + B).min(r1);
            for j0 in (0..n).step_by(B) {
                for j in j0..(j0 + B).min(n) {
                    for i in i0..i1 {
                        // SAFETY: (mat, j, i) is inside the output, and input rows
                        // r0..r1 (output columns) belong to this piece alone.
                        unsafe { *o.get().add(mat * m * n + j * m + i) = a[i * n + j] };
                    }
                }
            }
        }
    });
    out
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
    let total: usize = out_shape.iter().product();
    let row: usize = parts.iter().map(|p| p.1).sum();
    let mut out: Vec<T> = Vec::with_capacity(total);
    if row == 0 {
        return Ok(T::wrap(out));
    }
    let dst = super::threads::SendPtr(out.as_mut_ptr());
    // pieces of whole output rows (one row: every part's chunk for one outer index)
    let rows_per = (1 << 16) / row + 1;
    super::threads::for_each_index(outer.div_ceil(rows_per), |piece| {
        for o in piece * rows_per..((piece + 1) * rows_per).min(outer) {
            let mut at = o * row;
            for (src, chunk) in &parts {
                let part = &src[o * chunk..(o + 1) * chunk];
                // SAFETY: output row o is [o*row, (o+1)*row) of the capacity (total =
                // outer * row), written only by this piece.
                unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), dst.get().add(at), *chunk) };
                at += chunk;
            }
        }
    });
    // SAFETY: every output row was written.
    unsafe { out.set_len(total) };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocked_transpose_matches_the_strided_walk() {
        for (b, m, n) in [(3, 70, 13), (1, 8, 8), (2, 1, 9), (1, 130, 1)] {
            let src: Vec<i64> = (0..(b * m * n) as i64).collect();
            let x = Tensor::i64(vec![b, m, n], src.clone());
            let got = transpose::<i64>(&x, &[0, 2, 1]).unwrap();
            let want = gather_strided(&src, &[b, n, m], &[(m * n) as isize, 1, n as isize], 0);
            assert_eq!(got, Data::I64(want), "{b}x{m}x{n}");
        }
    }
}
