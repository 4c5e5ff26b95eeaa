//! Data movement: Transpose, Slice, Concat, Split, Expand, Tile, Trilu, each writing into
//! its output buffer. (Reshape, Identity and Copy only copy the data.) Every kernel is
//! generic over the element type and expressed through the strided walk where it can be.

use super::elem::{typed, typed_mut, Elem};
use super::into::{DataMut, TensorMut, TensorRef};
use super::layout::{around_axis, expand_into, gather_strided_into, strides_of};

pub fn transpose<T: Elem>(x: &TensorRef, perm: &[usize], out: &mut DataMut) -> Result<(), String> {
    let src = typed::<T>(x)?;
    let dst = typed_mut::<T>(out)?;
    let r = perm.len();
    if r >= 2
        && perm[r - 2] == r - 1
        && perm[r - 1] == r - 2
        && perm[..r - 2].iter().enumerate().all(|(i, &p)| i == p)
    {
        let (m, n) = (x.shape[r - 2], x.shape[r - 1]);
        transpose_last2(src, m, n, dst);
        return Ok(());
    }
    let st = strides_of(x.shape);
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let strides: Vec<isize> = perm.iter().map(|&p| st[p]).collect();
    gather_strided_into(src, &shape, &strides, 0, dst);
    Ok(())
}

/// Transposes each `m x n` matrix of `src` (a stack of them) into `out`, in blocks of 8 x
/// 8, so that both the reads and the writes stay within a few cache lines (larger blocks
/// would map power-of-two strided rows onto the same cache sets). Bands of 64 input rows
/// in parallel.
pub fn transpose_last2<T: Copy + Send + Sync>(src: &[T], m: usize, n: usize, out: &mut [T]) {
    const B: usize = 8;
    const BAND: usize = 64;
    assert_eq!(src.len(), out.len());
    if m * n == 0 {
        return;
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
                        // SAFETY: (mat, j, i) is inside `out` (as long as `src`), and
                        // input rows r0..r1 (output columns) belong to this piece alone.
                        unsafe { *o.get().add(mat * m * n + j * m + i) = a[i * n + j] };
                    }
                }
            }
        }
    });
}

/// Slice with per-axis start/end/step (already clamped; the type rule gave the output
/// shape, `out.shape`).
pub fn slice<T: Elem>(
    x: &TensorRef,
    axes: &[usize],
    starts: &[i64],
    steps: &[i64],
    out: &mut TensorMut,
) -> Result<(), String> {
    let src = typed::<T>(x)?;
    let out_shape = out.shape;
    let dst = typed_mut::<T>(&mut out.data)?;
    let mut strides = strides_of(x.shape);
    let mut base = 0isize;
    for i in 0..axes.len() {
        let a = axes[i];
        if out_shape[a] == 0 {
            return Ok(());
        }
        base += starts[i] as isize * strides[a];
        strides[a] *= steps[i] as isize;
    }
    gather_strided_into(src, out_shape, &strides, base, dst);
    Ok(())
}

pub fn concat<T: Elem>(ins: &[TensorRef], axis: usize, out: &mut TensorMut) -> Result<(), String> {
    let (outer, _, inner) = around_axis(out.shape, axis);
    for t in ins {
        typed::<T>(t)?;
    }
    let chunk = |t: &TensorRef| t.shape[axis] * inner;
    let row: usize = ins.iter().map(chunk).sum();
    let dst = typed_mut::<T>(&mut out.data)?;
    if row == 0 {
        return Ok(());
    }
    assert_eq!(dst.len(), outer * row);
    let dst = super::threads::SendPtr(dst.as_mut_ptr());
    // pieces of whole output rows (one row: every part's chunk for one outer index)
    let rows_per = (1 << 16) / row + 1;
    super::threads::for_each_index(outer.div_ceil(rows_per), |piece| {
        for o in piece * rows_per..((piece + 1) * rows_per).min(outer) {
            let mut at = o * row;
            for t in ins {
                let (src, c) = (T::of_ref(t.data).unwrap_or_default(), chunk(t));
                let part = &src[o * c..(o + 1) * c];
                // SAFETY: output row o is [o*row, (o+1)*row) of the output (which holds
                // outer * row elements), written only by this piece.
                unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), dst.get().add(at), c) };
                at += c;
            }
        }
    });
    Ok(())
}

pub fn split<T: Elem>(
    x: &TensorRef,
    axis: usize,
    sizes: &[usize],
    outs: &mut [TensorMut],
) -> Result<(), String> {
    let src = typed::<T>(x)?;
    let (outer, dim, inner) = around_axis(x.shape, axis);
    let mut start = 0;
    for (&n, out) in sizes.iter().zip(outs) {
        let dst = typed_mut::<T>(&mut out.data)?;
        let c = n * inner;
        for o in 0..outer {
            let b = (o * dim + start) * inner;
            dst[o * c..(o + 1) * c].copy_from_slice(&src[b..b + c]);
        }
        start += n;
    }
    Ok(())
}

pub fn expand_to<T: Elem>(x: &TensorRef, out: &mut TensorMut) -> Result<(), String> {
    let shape = out.shape;
    expand_into(
        typed::<T>(x)?,
        x.shape,
        shape,
        typed_mut::<T>(&mut out.data)?,
    );
    Ok(())
}

/// Tile as a broadcast: view `[d0, d1, ..]` as `[1, d0, 1, d1, ..]`, expand to
/// `[r0, d0, r1, d1, ..]`, and read that row-major.
pub fn tile<T: Elem>(x: &TensorRef, repeats: &[usize], out: &mut DataMut) -> Result<(), String> {
    let src = typed::<T>(x)?;
    let st = strides_of(x.shape);
    let mut shape = Vec::with_capacity(2 * repeats.len());
    let mut strides = Vec::with_capacity(2 * repeats.len());
    for (d, &r) in repeats.iter().enumerate() {
        shape.extend([r, x.shape[d]]);
        strides.extend([0, st[d]]);
    }
    gather_strided_into(src, &shape, &strides, 0, typed_mut::<T>(out)?);
    Ok(())
}

/// Keeps the upper (`j - i >= k`) or lower (`j - i <= k`) triangle of the last two dims.
pub fn trilu<T: Elem>(x: &TensorRef, upper: bool, k: i64, out: &mut DataMut) -> Result<(), String> {
    let src = typed::<T>(x)?;
    let out = typed_mut::<T>(out)?;
    out.copy_from_slice(src);
    let r = x.shape.len();
    let (m, n) = (x.shape[r - 2], x.shape[r - 1]);
    if m * n == 0 {
        return Ok(());
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::layout::gather_strided;

    #[test]
    fn blocked_transpose_matches_the_strided_walk() {
        for (b, m, n) in [(3, 70, 13), (1, 8, 8), (2, 1, 9), (1, 130, 1)] {
            let src: Vec<i64> = (0..(b * m * n) as i64).collect();
            let mut got = vec![0i64; src.len()];
            transpose_last2(&src, m, n, &mut got);
            let want = gather_strided(&src, &[b, n, m], &[(m * n) as isize, 1, n as isize], 0);
            assert_eq!(got, want, "{b}x{m}x{n}");
        }
    }
}
