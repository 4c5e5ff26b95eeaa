//! MatMul with numpy semantics (rank-1 operands promoted, batch dims broadcast). Every 2-D
//! product goes through the `gemm` crate in f32; bf16/f16 operands are widened first and the
//! result rounded on store.
//!
//! Operands are strided views ([`MatView`]): gemm reads rows and columns at any stride, so
//! a transposed (or batch-permuted) operand costs nothing. The evaluator uses that to run
//! `MatMul(Transpose(x), y)` without materializing the transpose.

use super::elem::{floats, out_stage_len, stage_len, store_f32};
use super::into::{DataMut, DataRef, TensorRef, Workspace};
use super::layout::strides_of;
use super::threads;
use hzp_ir::broadcast_shapes;

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

    /// The view with its last two axes swapped (a transposed matrix stack; rank >= 2).
    pub fn swap_last2(&self) -> MatView<'a> {
        self.permuted(&hzp_ir::views::last_two_swapped(self.shape.len()))
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

thread_local! {
    static IN_GEMM: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside a call of the `gemm` crate. gemm allocates a packing
/// buffer per product (sized by its cache blocking, not by the operands beyond that), the
/// only heap allocation of the kernels that is not fixed-size; allocation accounting (the
/// `alloc_free` test) uses this to tell it apart. Cheap, and never allocates.
pub fn in_gemm() -> bool {
    IN_GEMM.try_with(|c| c.get()).unwrap_or(false)
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
    IN_GEMM.with(|f| f.set(true));
    gemm::gemm(
        m, n, k, c, 1, n as isize, false, a, acs, ars, b, bcs, brs, 0.0, 1.0, false, false, false,
        par,
    );
    IN_GEMM.with(|f| f.set(false));
}

/// `c[m,n] = beta * a[m,k] @ b[k,n]`, or `c += beta * a @ b` with `accumulate`, on one
/// thread: `a` and `b` read at the given (row, column) strides, `c` at row stride `ldc`.
/// For kernels that multiply blocks inside their own parallel tasks (fused attention).
///
/// # Safety
/// As [`gemm_strided`], with `c + i*ldc + j` (`i < m`, `j < n`) writable and not aliased.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_block(
    (m, n, k): (usize, usize, usize),
    a: *const f32,
    (ars, acs): (isize, isize),
    b: *const f32,
    (brs, bcs): (isize, isize),
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                std::ptr::write_bytes(c.add(i * ldc), 0, n);
            }
        }
        return;
    }
    let was = IN_GEMM.with(|f| f.replace(true));
    gemm::gemm(
        m,
        n,
        k,
        c,
        1,
        ldc as isize,
        accumulate,
        a,
        acs,
        ars,
        b,
        bcs,
        brs,
        1.0,
        beta,
        false,
        false,
        false,
        gemm::Parallelism::None,
    );
    IN_GEMM.with(|f| f.set(was));
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

/// The shape of numpy `matmul(a, b)` for operand shapes `a` and `b`.
pub fn matmul_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>, String> {
    if a.is_empty() || b.is_empty() {
        return Err("MatMul: operands must have rank >= 1".into());
    }
    let (a1, b1) = (a.len() == 1, b.len() == 1);
    let (ra, rb) = (a.len(), b.len());
    let k = a[ra - 1];
    let kb = if b1 { b[0] } else { b[rb - 2] };
    if kb != k {
        return Err(format!("MatMul: inner dims differ ({a:?} @ {b:?})"));
    }
    let ba = if a1 { &[][..] } else { &a[..ra - 2] };
    let bb = if b1 { &[][..] } else { &b[..rb - 2] };
    let mut out = broadcast_shapes(ba, bb).ok_or("MatMul: batch dims do not broadcast")?;
    if !a1 {
        out.push(a[ra - 2]);
    }
    if !b1 {
        out.push(b[rb - 1]);
    }
    Ok(out)
}

/// numpy matmul of two strided f32 views; returns the row-major result and its shape.
pub fn matmul_views(a: &MatView, b: &MatView) -> Result<(Vec<f32>, Vec<usize>), String> {
    let shape = matmul_shape(&a.shape, &b.shape)?;
    let n = super::layout::checked_numel(&shape).ok_or("MatMul: result too large")?;
    let mut out = vec![0f32; n];
    matmul_views_into(a, b, &mut out)?;
    Ok((out, shape))
}

/// numpy matmul of two strided f32 views into `out` (row-major, exactly as many elements
/// as the result has; every one is written).
pub fn matmul_views_into(a: &MatView, b: &MatView, out: &mut [f32]) -> Result<(), String> {
    // on the kernels' pool, so that gemm's threads are the pool's
    threads::install(|| matmul_views_here(a, b, out))
}

/// Up to 8 values on the stack, more on the heap.
struct Small<T: Copy + Default> {
    n: usize,
    stack: [T; 8],
    heap: Vec<T>,
}

impl<T: Copy + Default> Small<T> {
    fn new() -> Self {
        Small {
            n: 0,
            stack: [T::default(); 8],
            heap: Vec::new(),
        }
    }
    fn push(&mut self, v: T) {
        if self.n < 8 {
            self.stack[self.n] = v;
        } else {
            if self.n == 8 {
                self.heap.extend_from_slice(&self.stack);
            }
            self.heap.push(v);
        }
        self.n += 1;
    }
    fn get(&self) -> &[T] {
        if self.n <= 8 {
            &self.stack[..self.n]
        } else {
            &self.heap
        }
    }
}

fn matmul_views_here(a: &MatView, b: &MatView, out: &mut [f32]) -> Result<(), String> {
    if a.shape.is_empty() || b.shape.is_empty() {
        return Err("MatMul: operands must have rank >= 1".into());
    }
    if !a.in_bounds() || !b.in_bounds() {
        return Err("internal: MatMul operand view out of bounds".into());
    }
    // promote rank-1 operands: a [k] -> [1, k], b [k] -> [k, 1]
    let (a1, b1) = (a.shape.len() == 1, b.shape.len() == 1);
    let (mut sa, mut ta, mut sb, mut tb) = (Small::new(), Small::new(), Small::new(), Small::new());
    if a1 {
        sa.push(1);
        ta.push(0);
    }
    a.shape.iter().for_each(|&d| sa.push(d));
    a.strides.iter().for_each(|&s| ta.push(s));
    b.shape.iter().for_each(|&d| sb.push(d));
    b.strides.iter().for_each(|&s| tb.push(s));
    if b1 {
        sb.push(1);
        tb.push(0);
    }
    let (sa, ta, sb, tb) = (sa.get(), ta.get(), sb.get(), tb.get());
    let (ra, rb) = (sa.len(), sb.len());
    let (m, k, n) = (sa[ra - 2], sa[ra - 1], sb[rb - 1]);
    if sb[rb - 2] != k {
        return Err(format!(
            "MatMul: inner dims differ ({:?} @ {:?})",
            a.shape, b.shape
        ));
    }
    let (ba, bb) = (&sa[..ra - 2], &sb[..rb - 2]);
    // the broadcast batch dims, right-aligned: rank and count without a vector
    let rbatch = ba.len().max(bb.len());
    let dim_of = |d: &[usize], i: usize| -> usize {
        let lead = rbatch - d.len();
        if i < lead {
            1
        } else {
            d[i - lead]
        }
    };
    let mut nb = 1usize;
    for i in 0..rbatch {
        let (x, y) = (dim_of(ba, i), dim_of(bb, i));
        if x != y && x != 1 && y != 1 {
            return Err("MatMul: batch dims do not broadcast".into());
        }
        nb = nb.saturating_mul(if x == 1 { y } else { x });
    }
    let mn = m * n;
    if nb.checked_mul(mn) != Some(out.len()) {
        return Err(format!(
            "internal: MatMul of {:?} @ {:?} into {} elements",
            a.shape,
            b.shape,
            out.len()
        ));
    }
    if nb == 0 || mn == 0 {
        return Ok(());
    }
    // gemm writes every element of the result: no need to zero it first
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
        // elements as the batch loop would; `out` holds nb * m * n elements.
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
        }
        return Ok(());
    }

    // one product per batch entry; entries in parallel when there are enough of them.
    // Entry i's operand offsets: i unravelled over the batch dims (row-major), with
    // broadcast (size-1 or missing) dims contributing nothing.
    let (ta_b, tb_b) = (&ta[..ra - 2], &tb[..rb - 2]);
    let offsets = |i: usize| -> (usize, usize) {
        let (mut ia, mut ib) = (a.offset as isize, b.offset as isize);
        let mut rest = i;
        for d in (0..rbatch).rev() {
            let (x, y) = (dim_of(ba, d), dim_of(bb, d));
            let size = if x == 1 { y } else { x };
            let c = (rest % size) as isize;
            rest /= size;
            if x != 1 {
                ia += c * ta_b[d - (rbatch - ba.len())];
            }
            if y != 1 {
                ib += c * tb_b[d - (rbatch - bb.len())];
            }
        }
        (ia as usize, ib as usize)
    };
    let (pa, pb) = (SendPtr(pa as *mut f32), SendPtr(pb as *mut f32));
    let one = |i: usize, threads: usize| {
        let (ia, ib) = offsets(i);
        // SAFETY: in bounds as checked above; batch entry i writes its own chunk
        // [i*mn, (i+1)*mn) of `out`.
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
    Ok(())
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

/// MatMul of two tensors into `out` (the inferred output, of `a`'s dtype).
pub fn matmul(
    a: &TensorRef,
    b: &TensorRef,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    let [as_, bs, os] = ws
        .f32s
        .take([stage_len(a.data), stage_len(b.data), out_stage_len(out)]);
    let (av, bv) = (floats(a.data, as_), floats(b.data, bs));
    let (va, vb) = (
        MatView::contiguous(av, a.shape),
        MatView::contiguous(bv, b.shape),
    );
    store_f32(out, os, |o| matmul_views_into(&va, &vb, o))
}

/// MatMul of two operands given by their bytes: each read as its own `shape` (`stored`
/// `None`) or, for a transposed operand a plan keeps in its input's bytes
/// (`hzp_ir::views::transposed_operands`), as the `stored` shape with the last two axes
/// swapped. bf16/f16 are widened and the result rounded as [`matmul`] does.
pub fn matmul_stored(
    (a, a_shape, a_stored): (DataRef, &[usize], Option<&[usize]>),
    (b, b_shape, b_stored): (DataRef, &[usize], Option<&[usize]>),
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    let [as_, bs, os] = ws
        .f32s
        .take([stage_len(a), stage_len(b), out_stage_len(out)]);
    let (av, bv) = (floats(a, as_), floats(b, bs));
    let view = |data, shape: &[usize], stored: Option<&[usize]>| match stored {
        Some(s) => MatView::contiguous(data, s).swap_last2(),
        None => MatView::contiguous(data, shape),
    };
    let (va, vb) = (view(av, a_shape, a_stored), view(bv, b_shape, b_stored));
    store_f32(out, os, |o| matmul_views_into(&va, &vb, o))
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
