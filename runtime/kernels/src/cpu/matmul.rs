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
            let (a, b) = (
                pa.get().add(ia) as *const f32,
                pb.get().add(ib) as *const f32,
            );
            let c = pc.get().add(i * mn);
            product_trimmed((m, n, k), a, (ars, acs), b, (brs, bcs), c, threads);
        }
    };
    if threads > 1 && nb >= threads {
        threads::for_each_index(nb, |i| one(i, 1));
    } else {
        (0..nb).for_each(|i| one(i, threads));
    }
    Ok(())
}

/// `c[m,n] = a[m,k] @ b[k,n]` as [`gemm_strided`] computes it, bit for bit, leaving out
/// what [`trim`] finds: gemm multiplies the leading `rows x depth` part and the rows past
/// it are written as zeros. Those rows are +0.0 in the full product only if every element
/// of `b` they would meet is finite; rather than scanning `b`, the first computed row
/// tells: each of its elements is a sum of products with a whole column of `b[..depth]`,
/// so it is finite only if that column is (`0 * inf` is NaN, and an inf or NaN term keeps
/// the sum non-finite). When one is not (or a finite sum overflowed), the rows are
/// computed after all.
///
/// # Safety
/// As [`gemm_strided`].
#[allow(clippy::too_many_arguments)]
unsafe fn product_trimmed(
    (m, n, k): (usize, usize, usize),
    a: *const f32,
    (ars, acs): (isize, isize),
    b: *const f32,
    (brs, bcs): (isize, isize),
    c: *mut f32,
    threads: usize,
) {
    let (rows, depth) = trim((m, n, k), a, (ars, acs), b, (brs, bcs));
    gemm_strided(rows, n, depth, a, (ars, acs), b, (brs, bcs), c, threads);
    if rows == m {
        return;
    }
    if all((c as *const f32, n, 1), |x: f32| x.is_finite()) {
        std::ptr::write_bytes(c.add(rows * n), 0, (m - rows) * n);
    } else {
        gemm_strided(m, n, depth, a, (ars, acs), b, (brs, bcs), c, threads);
    }
}

/// The rows and the depth of one `m x n x k` product (`a` at strides (`ars`, `acs`), `b`
/// at (`brs`, `bcs`)) that gemm must compute for the full product, every bit of it: the
/// rows past `rows` are zero (+0.0) in the full product provided `b[..depth]` is finite
/// (which [`product_trimmed`] checks), and the terms past `depth` of the contraction
/// change nothing. `(m, k)` when nothing can be left out.
///
/// A mixture of experts' buffers (`MoeDispatch`: each expert's filled rows are a prefix of
/// its `C` rows, the rest zero) make batched products whose row operand ends in zero rows
/// (`buffer @ W`, and `dY @ Wᵀ` in the backward, whose empty slots `MoeCombineGrad` leaves
/// zero) or whose contraction ends in zero terms (`bufferᵀ @ dY`). Found from the values,
/// not from names, so any product with such trailing zeros gains.
///
/// **Exactly the full product.** `0 * x` is ±0 for a finite `x` but NaN for an infinite or
/// NaN one, so a zero row of `a` can be left out only when every element of `b` it would
/// meet is finite (checked after the product, see [`product_trimmed`]), and a contraction
/// term `p` only when column `p` of `a` is zero and row `p` of `b` finite, or the other
/// way round. Then each left-out term is a fused multiply-add
/// of ±0 into an accumulator that starts at +0 and so is never -0: it changes nothing,
/// and a zero row's result is +0. gemm's summation order for one element must also stay
/// the same: gemm 0.19 picks its kernel by the product's size (dot-product kernels below
/// 257 elements of the result, matrix-vector ones for one row or column, another for
/// `k <= 2`) and blocks the contraction by `k` (one block up to 512; above that, blocks of
/// 512 when `m` and `n` are at most 64, else blocks it sizes from the cache, of at least
/// `ceil(k / ceil(k / 512))`). So only products on its blocked kernel are trimmed, to a
/// size on the same kernel with the same leading contraction blocks
/// ([`rows_on_the_same_kernel`], [`depth_in_the_same_blocks`]); the tests check the
/// result against the untrimmed gemm call bit for bit.
///
/// Cheap when nothing can be left out: the scans stop at the first nonzero element from
/// the end (one element for a dense operand).
///
/// # Safety
/// As [`gemm_strided`] for `a` and `b`.
unsafe fn trim(
    (m, n, k): (usize, usize, usize),
    a: *const f32,
    (ars, acs): (isize, isize),
    b: *const f32,
    (brs, bcs): (isize, isize),
) -> (usize, usize) {
    if !on_blocked_kernel(m, n, k) {
        return (m, k);
    }
    // column q of a, row p of b, row i of a: `len` values at a stride
    let col_a = |q: usize| (a.offset(q as isize * acs), m, ars);
    let row_b = |p: usize| (b.offset(p as isize * brs), n, bcs);
    let row_a = |i: usize, len: usize| (a.offset(i as isize * ars), len, acs);
    let zero = |x: f32| x == 0.0;
    let finite = |x: f32| x.is_finite();
    // the contraction: trailing terms whose column of `a` or row of `b` is zero
    let mut p = k;
    while p > 0 {
        let q = p - 1;
        let nothing = if all(col_a(q), zero) {
            all(row_b(q), finite)
        } else {
            all(row_b(q), zero) && all(col_a(q), finite)
        };
        if !nothing {
            break;
        }
        p = q;
    }
    let depth = depth_in_the_same_blocks(m, n, k, p);
    // the rows: trailing zero rows of `a` over that depth (the terms past it change
    // nothing in any row, zero or not)
    let mut r = m;
    while r > 0 && all(row_a(r - 1, depth), zero) {
        r -= 1;
    }
    (rows_on_the_same_kernel(m, n, depth, r), depth)
}

/// Whether `f` holds for the `len` values at `p`, `p + stride`, ...: a contiguous run in
/// chunks without early exits, which the compiler vectorizes.
///
/// # Safety
/// Every one of those values must be readable.
unsafe fn all((p, len, stride): (*const f32, usize, isize), f: impl Fn(f32) -> bool) -> bool {
    if stride == 1 {
        std::slice::from_raw_parts(p, len)
            .chunks(64)
            .all(|c| c.iter().fold(true, |acc, &x| acc & f(x)))
    } else {
        (0..len).all(|i| f(*p.offset(i as isize * stride)))
    }
}

/// Whether gemm 0.19 multiplies an `m x n x k` product with its blocked (packed
/// micro-kernel) kernel whatever the operands' strides: not a dot-product kernel (result
/// of at most 256 elements), a matrix-vector one (`m` or `n` 1) or the `k <= 2` one.
fn on_blocked_kernel(m: usize, n: usize, k: usize) -> bool {
    m > 1 && n > 1 && k > 2 && m.saturating_mul(n) > 256
}

/// The fewest rows, at least `filled`, whose `rows x n x k` product gemm computes with the
/// same kernel and contraction blocks as the `m x n x k` one (on its blocked kernel): each
/// row's elements are then summed in the same order. `m` when that is not fewer.
fn rows_on_the_same_kernel(m: usize, n: usize, k: usize, filled: usize) -> usize {
    if filled >= m || !on_blocked_kernel(m, n, k) {
        return m;
    }
    let mut rows = filled.max(2).max(256 / n + 1);
    // above 512, the blocks of the contraction depend on whether m and n are <= 64
    if k > 512 && n <= 64 && m > 64 {
        rows = rows.max(65);
    }
    rows.min(m)
}

/// The shortest contraction, at least `needed`, of an `m x n x depth` product whose gemm
/// blocks are the leading blocks of the `m x n x k` one's (both on the blocked kernel):
/// the terms past it then only add zeros to sums that are the same. `k` when that is not
/// shorter.
fn depth_in_the_same_blocks(m: usize, n: usize, k: usize, needed: usize) -> usize {
    let d = needed.max(3);
    if d >= k || !on_blocked_kernel(m, n, k) {
        return k;
    }
    if k <= 512 {
        // one block of all k terms; `d` terms are one block too
        return d;
    }
    if m <= 64 && n <= 64 {
        // blocks of 512: d within the first, or whole blocks
        return if d <= 512 { d } else { d.div_ceil(512) * 512 }.min(k);
    }
    // blocks of kc = ceil(k / ceil(k / A)) for a cache-derived A >= 512, so kc is at least
    // this; `d` up to it is one block (d <= kc <= A) within the full product's first
    let first = k.div_ceil(k.div_ceil(512));
    if d <= first {
        d
    } else {
        k
    }
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

    /// A small deterministic generator (xorshift64*), values in [-1, 1).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn f(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    /// The untrimmed product, one plain gemm call per batch entry at the full sizes: what
    /// the batched kernel computed before it left anything out.
    fn untrimmed(a: &MatView, b: &MatView) -> Vec<f32> {
        let (e, m, k, n) = (a.shape[0], a.shape[1], a.shape[2], b.shape[2]);
        let mut out = vec![f32::NAN; e * m * n];
        for i in 0..e {
            // SAFETY: the test's views are in bounds; entry i writes its own chunk.
            unsafe {
                gemm_strided(
                    m,
                    n,
                    k,
                    a.data.as_ptr().add(a.offset + i * a.strides[0] as usize),
                    (a.strides[1], a.strides[2]),
                    b.data.as_ptr().add(b.offset + i * b.strides[0] as usize),
                    (b.strides[1], b.strides[2]),
                    out.as_mut_ptr().add(i * m * n),
                    threads::num_threads(),
                )
            }
        }
        out
    }

    /// `[e, rows, cols]` random values, each entry's rows past a random prefix zero (one
    /// entry empty and one full when there are several).
    fn prefixed(rng: &mut Rng, e: usize, rows: usize, cols: usize) -> (Vec<f32>, Vec<usize>) {
        let mut v: Vec<f32> = (0..e * rows * cols).map(|_| rng.f()).collect();
        let filled: Vec<usize> = (0..e)
            .map(|i| match i {
                0 if e > 1 => 0,
                1 if e > 2 => rows,
                _ => rng.below(rows + 1),
            })
            .collect();
        for (i, &f) in filled.iter().enumerate() {
            v[(i * rows + f) * cols..(i + 1) * rows * cols].fill(0.0);
        }
        (v, filled)
    }

    fn poison(rng: &mut Rng, v: &mut [f32]) {
        for x in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            if rng.below(3) == 0 {
                let i = rng.below(v.len());
                v[i] = x;
            }
        }
    }

    fn same_bits(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits(),
                "{what}: element {i}: {g:e} ({:#x}) vs untrimmed {w:e} ({:#x})",
                g.to_bits(),
                w.to_bits()
            );
        }
    }

    /// Shapes `(experts, rows, depth, cols)` on every side of gemm's kernel and blocking
    /// choices: dot-product sizes (not trimmed), the 256-element edge, one contraction
    /// block, blocks of 512 (m, n <= 64), cache-sized blocks, n <= 64 with m > 64.
    const SHAPES: &[(usize, usize, usize, usize)] = &[
        (4, 32, 64, 128),
        (4, 32, 64, 64),
        (3, 8, 16, 8),
        (3, 20, 9, 13),
        (5, 17, 40, 3),
        (4, 1, 30, 40),
        (3, 48, 1100, 40),
        (3, 100, 700, 80),
        (3, 130, 600, 24),
        (2, 70, 1300, 90),
        (3, 64, 3, 64),
    ];

    /// Rows: `[E, C, K] @ [E, K, N]` with each entry's rows past a random prefix zero (the
    /// forward `buffer @ W` and the backward `dY @ Wᵀ`), `b` sometimes holding inf or NaN:
    /// the kernel's result equals the untrimmed gemm product bit for bit, and rows were
    /// left out where they could be.
    #[test]
    fn trailing_zero_rows_are_left_out_and_the_product_is_unchanged() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut trimmed = 0;
        for round in 0..6 {
            for &(e, m, k, n) in SHAPES {
                let (a, filled) = prefixed(&mut rng, e, m, k);
                let mut b: Vec<f32> = (0..e * k * n).map(|_| rng.f()).collect();
                let poisoned = round % 3 == 2;
                if poisoned {
                    poison(&mut rng, &mut b);
                }
                let (va, vb) = (
                    MatView::contiguous(&a, &[e, m, k]),
                    MatView::contiguous(&b, &[e, k, n]),
                );
                let (got, _) = matmul_views(&va, &vb).unwrap();
                same_bits(&got, &untrimmed(&va, &vb), &format!("{:?}", (e, m, k, n)));
                for (i, &f) in filled.iter().enumerate() {
                    // SAFETY: entry i of the in-bounds contiguous views
                    let (rows, depth) = unsafe {
                        trim(
                            (m, n, k),
                            a.as_ptr().add(i * m * k),
                            (k as isize, 1),
                            b.as_ptr().add(i * k * n),
                            (n as isize, 1),
                        )
                    };
                    let finite = b[i * k * n..(i + 1) * k * n].iter().all(|x| x.is_finite());
                    let want = if !on_blocked_kernel(m, n, k) {
                        Some((m, k))
                    } else if !finite {
                        // rows may be chosen (the product finds b's NaN and computes
                        // them after all), the contraction is not shortened
                        (f > 0).then_some((rows_on_the_same_kernel(m, n, k, f), k))
                    } else if f == 0 {
                        // an empty entry: its zero columns shorten the contraction too
                        let d = depth_in_the_same_blocks(m, n, k, 0);
                        Some((rows_on_the_same_kernel(m, n, d, 0), d))
                    } else {
                        Some((rows_on_the_same_kernel(m, n, k, f), k))
                    };
                    if let Some(want) = want {
                        assert_eq!((rows, depth), want, "{:?} filled {f}", (e, m, k, n));
                    }
                    assert!(rows >= f && rows <= m);
                    trimmed += usize::from(rows < m);
                }
            }
        }
        assert!(trimmed > 20, "only {trimmed} products trimmed");
        // one inf in b: the zero rows of the full product are NaN in its column, and so
        // are the kernel's (it finds the inf in the first computed row)
        let (m, k, n) = (32, 64, 128);
        let mut a: Vec<f32> = (0..m * k).map(|_| rng.f()).collect();
        a[10 * k..].fill(0.0);
        let mut b: Vec<f32> = (0..k * n).map(|_| rng.f()).collect();
        b[5 * n + 7] = f32::INFINITY;
        let (va, vb) = (
            MatView::contiguous(&a, &[1, m, k]),
            MatView::contiguous(&b, &[1, k, n]),
        );
        let (got, _) = matmul_views(&va, &vb).unwrap();
        assert!(got[(m - 1) * n + 7].is_nan() && got[(m - 1) * n + 8] == 0.0);
        same_bits(&got, &untrimmed(&va, &vb), "one inf in b");
    }

    /// The contraction: `bufferᵀ @ dY` (`a` a transposed view of `[E, C, H]`, `b` `[E, C,
    /// F]`, both zero past each entry's prefix of C), the weight gradient of an expert
    /// product, and products where only one side's trailing terms are zero and the other
    /// may hold inf or NaN: equal to the untrimmed gemm product bit for bit.
    #[test]
    fn trailing_zero_contraction_terms_are_left_out_and_the_product_is_unchanged() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut trimmed = 0;
        for round in 0..6 {
            for &(e, h, c, f) in SHAPES {
                // buffer [e, c, h] read as [e, h, c]; dY [e, c, f] zero where buffer is
                let (buf, filled) = prefixed(&mut rng, e, c, h);
                let mut dy: Vec<f32> = (0..e * c * f).map(|_| rng.f()).collect();
                for (i, &n) in filled.iter().enumerate() {
                    let zero_too = round % 3 != 1;
                    if zero_too {
                        dy[(i * c + n) * f..(i + 1) * c * f].fill(0.0);
                    }
                }
                if round % 3 == 2 {
                    poison(&mut rng, &mut dy);
                }
                let va = MatView::contiguous(&buf, &[e, c, h]).swap_last2();
                let vb = MatView::contiguous(&dy, &[e, c, f]);
                let (got, _) = matmul_views(&va, &vb).unwrap();
                same_bits(&got, &untrimmed(&va, &vb), &format!("{:?}", (e, h, c, f)));
                // the other way round: `a` full, `b`'s trailing rows zero
                let a2: Vec<f32> = (0..e * h * c).map(|_| rng.f()).collect();
                let (mut b2, _) = prefixed(&mut rng, e, c, f);
                if round % 3 == 2 {
                    poison(&mut rng, &mut b2);
                }
                let va2 = MatView::contiguous(&a2, &[e, h, c]);
                let vb2 = MatView::contiguous(&b2, &[e, c, f]);
                let (got2, _) = matmul_views(&va2, &vb2).unwrap();
                same_bits(&got2, &untrimmed(&va2, &vb2), "b's trailing rows zero");
                for (i, &n) in filled.iter().enumerate() {
                    // SAFETY: entry i of the in-bounds views
                    let (rows, depth) = unsafe {
                        trim(
                            (h, f, c),
                            buf.as_ptr().add(i * c * h),
                            (1, h as isize),
                            dy.as_ptr().add(i * c * f),
                            (f as isize, 1),
                        )
                    };
                    assert!(rows == h || n == 0);
                    assert!(depth >= n && depth <= c);
                    trimmed += usize::from(depth < c);
                }
            }
        }
        assert!(trimmed > 20, "only {trimmed} contractions trimmed");
    }
}
