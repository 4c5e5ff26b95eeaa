//! MatMul with numpy semantics (rank-1 operands promoted, batch dims broadcast). Every 2-D
//! product goes through the `gemm` crate in f32; bf16/f16 operands are widened first and the
//! result rounded on store.

use super::elem::{floats, from_f32};
use super::layout::{broadcast_strides, walk};
use hzp_ir::{broadcast_shapes, Data, Tensor};

/// `c[m,n] = a[m,k] @ b[k,n]`, all row-major and contiguous.
pub fn gemm_f32(m: usize, n: usize, k: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c[..m * n].fill(0.0);
        return;
    }
    // SAFETY: the asserts above keep every access of an m x k, k x n and m x n row-major
    // matrix inside the slices; `c` is exclusively borrowed and does not alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            1,
            n as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Data, String> {
    let (av, bv) = (floats(a), floats(b));
    let mut sa = a.shape.clone();
    let mut sb = b.shape.clone();
    if sa.len() == 1 {
        sa.insert(0, 1);
    }
    if sb.len() == 1 {
        sb.push(1);
    }
    let (ra, rb) = (sa.len(), sb.len());
    let (m, k, n) = (sa[ra - 2], sa[ra - 1], sb[rb - 1]);
    let (ba, bb) = (&sa[..ra - 2], &sb[..rb - 2]);
    let batch = broadcast_shapes(ba, bb).ok_or("MatMul: batch dims do not broadcast")?;
    let nb: usize = batch.iter().product();
    let mut out = vec![0f32; nb * m * n];
    if bb.iter().product::<usize>() == 1 && ba.iter().product::<usize>() == nb {
        // b is one matrix: fold a's batch into its rows, one product
        gemm_f32(nb * m, n, k, &av, &bv, &mut out);
    } else {
        let (ta, tb) = (broadcast_strides(ba, &batch), broadcast_strides(bb, &batch));
        let (mk, kn, mn) = (m * k, k * n, m * n);
        let mut i = 0;
        walk(&batch, [&ta, &tb], [0, 0], |[ia, ib]| {
            let (ia, ib) = (ia as usize * mk, ib as usize * kn);
            gemm_f32(
                m,
                n,
                k,
                &av[ia..ia + mk],
                &bv[ib..ib + kn],
                &mut out[i..i + mn],
            );
            i += mn;
        });
    }
    Ok(from_f32(a.dtype(), out))
}
