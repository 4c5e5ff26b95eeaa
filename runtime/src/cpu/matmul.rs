//! MatMul with numpy semantics (rank-1 operands promoted, batch dims broadcast). Every 2-D
//! product goes through the `gemm` crate in f32; bf16/f16 operands are widened first and the
//! result rounded on store.
//!
//! Operands are strided views ([`MatView`]): gemm reads rows and columns at any stride, so
//! a transposed (or batch-permuted) operand costs nothing. The evaluator uses that to run
//! `MatMul(Transpose(x), y)` without materializing the transpose.

use super::elem::{floats, from_f32};
use super::layout::{strides_of, walk};
use super::threads;
use hzp_ir::{broadcast_shapes, Data, Tensor};

/// A strided view of f32 data as a stack of matrices: element `idx` of `shape` is at
/// `offset + sum_d idx[d] * strides[d]` in `data`. Strides are non-negative.
#[derive(Clone, Debug)]
pub struct MatView<'a> {
    pub data: &'a [f32],
    pub shape: Vec<usize>,
    pub strides: Vec<isize>,
    pub offset: usize,
}

impl<'a> MatView<'a> {
    /// A contiguous row-major view of `data` as `shape`.
    pub fn contiguous(data: &'a [f32], shape: &[usize]) -> MatView<'a> {
        MatView {
            data,
            shape: shape.to_vec(),
            strides: strides_of(shape),
            offset: 0,
        }
    }

    /// The view with its dims reordered: dim `i` of the result is dim `perm[i]` of `self`.
    pub fn permuted(&self, perm: &[usize]) -> MatView<'a> {
        MatView {
            data: self.data,
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        }
    }

    /// Whether the view reads its elements row-major and densely (a reshape of it is a
    /// view too).
    pub fn is_contiguous(&self) -> bool {
        self.shape.contains(&0)
            || self
                .shape
                .iter()
                .zip(&self.strides)
                .zip(strides_of(&self.shape))
                .all(|((&d, &s), c)| d == 1 || s == c)
    }

    /// Checks that every element the view addresses lies inside `data`.
    fn in_bounds(&self) -> bool {
        if self.shape.contains(&0) {
            return true;
        }
        if self.shape.len() != self.strides.len() || self.strides.iter().any(|&s| s < 0) {
            return false;
        }
        let last = self
            .shape
            .iter()
            .zip(&self.strides)
            .try_fold(self.offset, |acc, (&d, &s)| {
                acc.checked_add((d - 1).checked_mul(s as usize)?)
            });
        last.is_some_and(|l| l < self.data.len())
    }
}

/// `c[m,n] = a[m,k] @ b[k,n]` with `a` and `b` read at the given (row, column) strides
/// and `c` contiguous. `threads` > 1 lets gemm split the product. `c` is only written
/// (it may be uninitialized).
///
/// # Safety
/// Every element `a + i*ars + p*acs` (`i < m`, `p < k`), `b + p*brs + j*bcs` (`p < k`,
/// `j < n`) must be readable and `c[..m*n]` writable and not aliased.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_strided(
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    (ars, acs): (isize, isize),
    b: *const f32,
    (brs, bcs): (isize, isize),
    c: *mut f32,
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        std::ptr::write_bytes(c, 0, m * n);
        return;
    }
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    gemm::gemm(
        m, n, k, c, 1, n as isize, false, a, acs, ars, b, bcs, brs, 0.0, 1.0, false, false, false,
        par,
    );
}

/// `c[m,n] = a[m,k] @ b[k,n]`, all row-major and contiguous.
pub fn gemm_f32(m: usize, n: usize, k: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    // SAFETY: the asserts above keep every access of an m x k, k x n and m x n row-major
    // matrix inside the slices; `c` is exclusively borrowed and does not alias `a` or `b`.
    unsafe {
        gemm_strided(
            m,
            n,
            k,
            a.as_ptr(),
            (k as isize, 1),
            b.as_ptr(),
            (n as isize, 1),
            c.as_mut_ptr(),
            threads::num_threads(),
        )
    }
}

/// numpy matmul of two strided f32 views; returns the row-major result and its shape.
pub fn matmul_views(a: &MatView, b: &MatView) -> Result<(Vec<f32>, Vec<usize>), String> {
    // on the kernels' pool, so that gemm's threads are the pool's
    threads::install(|| matmul_views_here(a, b))
}

fn matmul_views_here(a: &MatView, b: &MatView) -> Result<(Vec<f32>, Vec<usize>), String> {
    if a.shape.is_empty() || b.shape.is_empty() {
        return Err("MatMul: operands must have rank >= 1".into());
    }
    if !a.in_bounds() || !b.in_bounds() {
        return Err("internal: MatMul operand view out of bounds".into());
    }
    // promote rank-1 operands: a [k] -> [1, k], b [k] -> [k, 1]
    let (mut sa, mut ta) = (a.shape.clone(), a.strides.clone());
    let (mut sb, mut tb) = (b.shape.clone(), b.strides.clone());
    let (a1, b1) = (sa.len() == 1, sb.len() == 1);
    if a1 {
        sa.insert(0, 1);
        ta.insert(0, 0);
    }
    if b1 {
        sb.push(1);
        tb.push(0);
    }
    let (ra, rb) = (sa.len(), sb.len());
    let (m, k, n) = (sa[ra - 2], sa[ra - 1], sb[rb - 1]);
    if sb[rb - 2] != k {
        return Err(format!(
            "MatMul: inner dims differ ({:?} @ {:?})",
            a.shape, b.shape
        ));
    }
    let (ba, bb) = (&sa[..ra - 2], &sb[..rb - 2]);
    let batch = broadcast_shapes(ba, bb).ok_or("MatMul: batch dims do not broadcast")?;
    let mut out_shape = batch.clone();
    if !a1 {
        out_shape.push(m);
    }
    if !b1 {
        out_shape.push(n);
    }
    let nb: usize = batch.iter().product();
    let mn = m * n;
    if nb == 0 || mn == 0 {
        return Ok((Vec::new(), out_shape));
    }
    // gemm writes every element of the result: no need to zero it first
    let total = nb.checked_mul(mn).ok_or("MatMul: result too large")?;
    let mut out: Vec<f32> = Vec::with_capacity(total);
    let pc = SendPtr(out.as_mut_ptr());
    let (ars, acs) = (ta[ra - 2], ta[ra - 1]);
    let (brs, bcs) = (tb[rb - 2], tb[rb - 1]);
    let threads = threads::num_threads();
    let (pa, pb) = (a.data.as_ptr(), b.data.as_ptr());

    // b is one matrix and a's batch dims continue its rows at a uniform stride: one
    // product with the batch folded into the rows
    let b_single = tb[..rb - 2].iter().zip(bb).all(|(&s, &d)| s == 0 || d == 1);
    if b_single && ba.iter().product::<usize>() == nb && foldable(ba, &ta[..ra - 2], m, ars) {
        // SAFETY: the views are in bounds (checked above); folding walks the same
        // elements as the batch loop would.
        unsafe {
            gemm_strided(
                nb * m,
                n,
                k,
                pa.add(a.offset),
                (ars, acs),
                pb.add(b.offset),
                (brs, bcs),
                pc.get(),
                threads,
            );
            out.set_len(total);
        }
        return Ok((out, out_shape));
    }

    // one product per batch entry; entries in parallel when there are enough of them
    let (ta_b, tb_b) = (
        broadcast_batch_strides(ba, &ta[..ra - 2], &batch),
        broadcast_batch_strides(bb, &tb[..rb - 2], &batch),
    );
    let mut offs = Vec::with_capacity(nb);
    walk(
        &batch,
        [&ta_b, &tb_b],
        [a.offset as isize, b.offset as isize],
        |[ia, ib]| offs.push((ia as usize, ib as usize)),
    );
    let (pa, pb) = (SendPtr(pa as *mut f32), SendPtr(pb as *mut f32));
    let one = |i: usize, threads: usize| {
        let (ia, ib) = offs[i];
        // SAFETY: in bounds as checked above; batch entry i writes its own chunk
        // [i*mn, (i+1)*mn) of the result's capacity.
        unsafe {
            gemm_strided(
                m,
                n,
                k,
                pa.get().add(ia),
                (ars, acs),
                pb.get().add(ib),
                (brs, bcs),
                pc.get().add(i * mn),
                threads,
            )
        }
    };
    if threads > 1 && nb >= threads {
        threads::for_each_index(nb, |i| one(i, 1));
    } else {
        (0..nb).for_each(|i| one(i, threads));
    }
    // SAFETY: every batch entry wrote its chunk, so all `total` elements are initialized.
    unsafe { out.set_len(total) };
    Ok((out, out_shape))
}

/// A raw pointer that may cross to worker threads.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used for data that outlives the parallel section, read by all threads or
// written in disjoint parts.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Whether batch dims `dims` (strides `st`) followed by `m` rows at stride `rs` address
/// the same elements as `prod(dims) * m` rows at stride `rs`.
fn foldable(dims: &[usize], st: &[isize], m: usize, rs: isize) -> bool {
    let mut want = rs * m as isize;
    for (&d, &s) in dims.iter().zip(st).rev() {
        if d != 1 && s != want {
            return false;
        }
        want *= d as isize;
    }
    true
}

/// A view's batch strides as seen from the broadcast batch shape (stride 0 for missing
/// and size-1 dims).
fn broadcast_batch_strides(dims: &[usize], st: &[isize], batch: &[usize]) -> Vec<isize> {
    let lead = batch.len() - dims.len();
    (0..batch.len())
        .map(|i| {
            if i < lead || dims[i - lead] == 1 {
                0
            } else {
                st[i - lead]
            }
        })
        .collect()
}

pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Data, String> {
    let (av, bv) = (floats(a), floats(b));
    let (out, _) = matmul_views(
        &MatView::contiguous(&av, &a.shape),
        &MatView::contiguous(&bv, &b.shape),
    )?;
    Ok(from_f32(a.dtype(), out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &MatView, b: &MatView) -> Vec<f32> {
        // 2-D only
        let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
        let at = |i: usize, j: usize| {
            a.data[a.offset + i * a.strides[0] as usize + j * a.strides[1] as usize]
        };
        let bt = |i: usize, j: usize| {
            b.data[b.offset + i * b.strides[0] as usize + j * b.strides[1] as usize]
        };
        let mut c = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
            }
        }
        c
    }

    #[test]
    fn transposed_views_match_materialized() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        // a stored as [k, m] and read transposed
        let mut at = vec![0f32; m * k];
        for i in 0..m {
            for p in 0..k {
                at[p * m + i] = a[i * k + p];
            }
        }
        let va = MatView::contiguous(&a, &[m, k]);
        let vat = MatView::contiguous(&at, &[k, m]).permuted(&[1, 0]);
        let vb = MatView::contiguous(&b, &[k, n]);
        let want = naive(&va, &vb);
        let (got, shape) = matmul_views(&vat, &vb).unwrap();
        assert_eq!(shape, vec![m, n]);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
    }

    #[test]
    fn batch_permuted_views_fold_or_loop() {
        // a: [2, 4, 3] stored as [4, 2, 3] (perm [1, 0, 2]); b: one [3, 2] matrix
        let a: Vec<f32> = (0..24).map(|i| i as f32 - 7.0).collect();
        let b: Vec<f32> = (0..6).map(|i| (i as f32) * 0.5).collect();
        let va = MatView::contiguous(&a, &[4, 2, 3]).permuted(&[1, 0, 2]);
        assert!(!va.is_contiguous());
        let vb = MatView::contiguous(&b, &[3, 2]);
        let (got, shape) = matmul_views(&va, &vb).unwrap();
        assert_eq!(shape, vec![2, 4, 2]);
        for bi in 0..2 {
            for i in 0..4 {
                for j in 0..2 {
                    let w: f32 = (0..3).map(|p| a[i * 6 + bi * 3 + p] * b[p * 2 + j]).sum();
                    assert_eq!(got[bi * 8 + i * 2 + j], w);
                }
            }
        }
        // an out-of-bounds view is an error, not a read past the end
        let bad = MatView {
            data: &b,
            shape: vec![3, 3],
            strides: vec![3, 1],
            offset: 0,
        };
        assert!(matmul_views(&bad, &vb).is_err());
    }
}
