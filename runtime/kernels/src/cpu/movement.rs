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

/// Transposes each `m x n` matrix of `src` (a stack of them) into `out`. Bands of 64 input
/// rows go to the threads; within a band, tiles of 64 x 32 keep both the rows read and the
/// rows written in the L1 cache. Elements of 4 bytes move 8 x 8 at a time through AVX2
/// registers (unpack/shuffle/permute: pure bit moves, so any 4-byte type is copied exactly)
/// when the CPU has AVX2; the rest element by element in 8 x 8 blocks.
pub fn transpose_last2<T: Copy + Send + Sync>(src: &[T], m: usize, n: usize, out: &mut [T]) {
    const BAND: usize = 64;
    const TILE_COLS: usize = 32;
    assert_eq!(src.len(), out.len());
    if m * n == 0 {
        return;
    }
    let bands = m.div_ceil(BAND);
    let mats = src.len() / (m * n);
    let wide = simd8::available() && std::mem::size_of::<T>() == 4;
    let o = super::threads::SendPtr(out.as_mut_ptr());
    super::threads::for_each_index(mats * bands, |p| {
        let (mat, band) = (p / bands, p % bands);
        let a = &src[mat * m * n..(mat + 1) * m * n];
        let (r0, r1) = (band * BAND, ((band + 1) * BAND).min(m));
        // SAFETY (for the writes below): (mat, j, i) is inside `out` (as long as `src`), and
        // input rows r0..r1 (output columns) belong to this piece alone.
        let put = |j: usize, i: usize, v: T| unsafe { *o.get().add(mat * m * n + j * m + i) = v };
        for c0 in (0..n).step_by(TILE_COLS) {
            let c1 = (c0 + TILE_COLS).min(n);
            let mut i0 = r0;
            while i0 < r1 {
                let i1 = (i0 + 8).min(r1);
                let mut j0 = c0;
                while j0 < c1 {
                    let j1 = (j0 + 8).min(c1);
                    if wide && i1 - i0 == 8 && j1 - j0 == 8 {
                        // SAFETY: 8 rows of 8 elements from (i0, j0) are inside `a` (row
                        // length n) and 8 rows of 8 from (j0, i0) inside this matrix of
                        // `out` (row length m), in this piece's columns; T is 4 bytes.
                        unsafe {
                            simd8::transpose_8x8(
                                a.as_ptr().add(i0 * n + j0) as *const f32,
                                n,
                                o.get().add(mat * m * n + j0 * m + i0) as *mut f32,
                                m,
                            )
                        };
                    } else {
                        for j in j0..j1 {
                            for i in i0..i1 {
                                put(j, i, a[i * n + j]);
                            }
                        }
                    }
                    j0 = j1;
                }
                i0 = i1;
            }
        }
    });
}

/// The 8 x 8 transpose of 4-byte elements in AVX2 registers.
mod simd8 {
    /// Whether this CPU has AVX2 (checked once).
    pub fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            *ON.get_or_init(|| std::arch::is_x86_feature_detected!("avx2"))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Writes the transpose of the 8 x 8 block at `src` (rows `ld_s` apart) to `dst` (rows
    /// `ld_d` apart). Only moves bits: the lanes are any 4-byte values.
    ///
    /// # Safety
    /// [`available`] is true; the 64 elements read and written are in bounds, and the two
    /// blocks do not overlap.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    pub unsafe fn transpose_8x8(src: *const f32, ld_s: usize, dst: *mut f32, ld_d: usize) {
        use std::arch::x86_64::*;
        let r = [
            _mm256_loadu_ps(src),
            _mm256_loadu_ps(src.add(ld_s)),
            _mm256_loadu_ps(src.add(2 * ld_s)),
            _mm256_loadu_ps(src.add(3 * ld_s)),
            _mm256_loadu_ps(src.add(4 * ld_s)),
            _mm256_loadu_ps(src.add(5 * ld_s)),
            _mm256_loadu_ps(src.add(6 * ld_s)),
            _mm256_loadu_ps(src.add(7 * ld_s)),
        ];
        // pairs of rows interleaved, then quads, then the 128-bit halves
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let rows = [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ];
        for (k, row) in rows.iter().enumerate() {
            _mm256_storeu_ps(dst.add(k * ld_d), *row);
        }
    }

    /// Never called: [`available`] is false off x86-64.
    #[cfg(not(target_arch = "x86_64"))]
    pub unsafe fn transpose_8x8(_: *const f32, _: usize, _: *mut f32, _: usize) {
        unreachable!("AVX2 transposes only run on x86-64")
    }
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
    fn four_byte_transposes_match_the_strided_walk() {
        // 8 x 8 register blocks where they fit, element by element at the edges; i32
        // patterns that are NaNs as f32 come through unchanged
        for (b, m, n) in [
            (1, 8, 8),
            (1, 16, 24),
            (2, 67, 45),
            (3, 70, 13),
            (1, 130, 1),
            (1, 64, 96),
        ] {
            let src: Vec<i32> = (0..(b * m * n) as i32)
                .map(|i| i.wrapping_mul(0x7fc0_0001u32 as i32))
                .collect();
            let mut got = vec![0i32; src.len()];
            transpose_last2(&src, m, n, &mut got);
            let want = gather_strided(&src, &[b, n, m], &[(m * n) as isize, 1, n as isize], 0);
            assert_eq!(got, want, "{b}x{m}x{n}");
            let f: Vec<f32> = src.iter().map(|&x| x as f32).collect();
            let mut gf = vec![0f32; f.len()];
            transpose_last2(&f, m, n, &mut gf);
            let wf = gather_strided(&f, &[b, n, m], &[(m * n) as isize, 1, n as isize], 0);
            assert_eq!(gf, wf, "f32 {b}x{m}x{n}");
        }
    }

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
