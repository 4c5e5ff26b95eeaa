//! The fused AdamW step ([`Op::AdamW`](hzp_ir::Op::AdamW)): one pass over the parameter,
//! gradient and both moments instead of fourteen elementwise ops. It computes each element
//! with the same f32 operations, in the same order, as the unfused formula, so the two give
//! the same bits. Results may lie in the bytes of the inputs they replace (the memory plan's
//! in-place updates): every chunk of inputs is copied to the stack before any result of that
//! chunk is stored.

use super::elem::typed;
use super::into::{TensorMut, TensorRef};
use super::math;
use super::threads::{for_each_range, SendPtr};

/// The constants of one AdamW op, rounded to f32 as the unfused formula's scalars are.
#[derive(Clone, Copy, Debug)]
pub struct AdamWStep {
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    eps: f32,
    decay: f32,
    step_size: f32,
    bias2_sqrt: f32,
}

impl AdamWStep {
    /// From the op's attributes (beta1, beta2, eps, weight decay) and its three scalar
    /// inputs (step size, bias correction, learning rate). The decay factor
    /// `1 - lr * weight_decay` is computed in f64 and rounded once, as torch computes it
    /// from Python floats.
    pub fn new(
        (beta1, beta2, eps, weight_decay): (f64, f64, f64, f64),
        step_size: f32,
        bias2_sqrt: f32,
        lr: f32,
    ) -> AdamWStep {
        let decay = 1.0 - lr as f64 * weight_decay;
        AdamWStep {
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            eps: eps as f32,
            decay: decay as f32,
            step_size,
            bias2_sqrt,
        }
    }
}

/// Elements per stack chunk (four inputs of 2 KiB each stay in L1).
const CHUNK: usize = 512;

/// One AdamW step over `n` elements: reads `w, g, m, v`, writes `w2, m2, v2`.
///
/// # Safety
/// Every pointer is valid for `n` f32 elements. `w2`, `m2` and `v2` are disjoint from each
/// other and from the other inputs, except that each may be exactly (same address) the
/// input it replaces: `w2 == w`, `m2 == m`, `v2 == v`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn adamw_raw(
    n: usize,
    c: &AdamWStep,
    w: *const f32,
    g: *const f32,
    m: *const f32,
    v: *const f32,
    w2: *mut f32,
    m2: *mut f32,
    v2: *mut f32,
) {
    let ptrs = (
        SendPtr(w as *mut f32),
        SendPtr(g as *mut f32),
        SendPtr(m as *mut f32),
        SendPtr(v as *mut f32),
        SendPtr(w2),
        SendPtr(m2),
        SendPtr(v2),
    );
    let c = *c;
    for_each_range(n, 1 << 16, move |start, end| {
        let (w, g, m, v, w2, m2, v2) = ptrs;
        #[cfg(target_arch = "x86_64")]
        if math::simd() != math::Simd::Baseline {
            // SAFETY: AVX2 (so AVX) was detected at run time (`math::simd`); the pointers
            // are the caller's, offset within range.
            unsafe {
                let at = |p: SendPtr<f32>| p.get().add(start);
                step_avx(
                    end - start,
                    &c,
                    (at(w), at(g), at(m), at(v)),
                    (at(w2), at(m2), at(v2)),
                )
            };
            return;
        }
        math::vectorized(
            #[inline(always)]
            || {
                let mut k = start;
                while k < end {
                    let len = CHUNK.min(end - k);
                    let mut bw = [0f32; CHUNK];
                    let mut bg = [0f32; CHUNK];
                    let mut bm = [0f32; CHUNK];
                    let mut bv = [0f32; CHUNK];
                    // SAFETY: the caller's contract: in range; the stack copies are taken
                    // before this chunk's results are stored over any input.
                    unsafe {
                        std::ptr::copy_nonoverlapping(w.get().add(k), bw.as_mut_ptr(), len);
                        std::ptr::copy_nonoverlapping(g.get().add(k), bg.as_mut_ptr(), len);
                        std::ptr::copy_nonoverlapping(m.get().add(k), bm.as_mut_ptr(), len);
                        std::ptr::copy_nonoverlapping(v.get().add(k), bv.as_mut_ptr(), len);
                    }
                    step(
                        &c,
                        &mut bw[..len],
                        &bg[..len],
                        &mut bm[..len],
                        &mut bv[..len],
                    );
                    // SAFETY: as above.
                    unsafe {
                        std::ptr::copy_nonoverlapping(bw.as_ptr(), w2.get().add(k), len);
                        std::ptr::copy_nonoverlapping(bm.as_ptr(), m2.get().add(k), len);
                        std::ptr::copy_nonoverlapping(bv.as_ptr(), v2.get().add(k), len);
                    }
                    k += len;
                }
            },
        )
    });
}

/// The step over `n` elements, eight at a time with AVX: the same IEEE operations in the
/// same order as [`step`] (no fused multiply-adds), so the same bits. Each group of eight is
/// loaded before it is stored, so a result may lie exactly over the input it replaces.
///
/// # Safety
/// AVX is available; the pointers are valid for `n` elements as [`adamw_raw`] says.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn step_avx(
    n: usize,
    c: &AdamWStep,
    (w, g, m, v): (*const f32, *const f32, *const f32, *const f32),
    (w2, m2, v2): (*mut f32, *mut f32, *mut f32),
) {
    use std::arch::x86_64::*;
    let decay = _mm256_set1_ps(c.decay);
    let omb1 = _mm256_set1_ps(c.one_minus_beta1);
    let b2 = _mm256_set1_ps(c.beta2);
    let omb2 = _mm256_set1_ps(c.one_minus_beta2);
    let b2s = _mm256_set1_ps(c.bias2_sqrt);
    let eps = _mm256_set1_ps(c.eps);
    let lr = _mm256_set1_ps(c.step_size);
    let mut i = 0;
    while i + 8 <= n {
        let wv = _mm256_loadu_ps(w.add(i));
        let gv = _mm256_loadu_ps(g.add(i));
        let mv = _mm256_loadu_ps(m.add(i));
        let vv = _mm256_loadu_ps(v.add(i));
        let wd = _mm256_mul_ps(wv, decay);
        let mn = _mm256_add_ps(mv, _mm256_mul_ps(_mm256_sub_ps(gv, mv), omb1));
        let vn = _mm256_add_ps(
            _mm256_mul_ps(vv, b2),
            _mm256_mul_ps(_mm256_mul_ps(gv, gv), omb2),
        );
        let den = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vn), b2s), eps);
        let wn = _mm256_sub_ps(wd, _mm256_mul_ps(_mm256_div_ps(mn, den), lr));
        _mm256_storeu_ps(w2.add(i), wn);
        _mm256_storeu_ps(m2.add(i), mn);
        _mm256_storeu_ps(v2.add(i), vn);
        i += 8;
    }
    // the tail, element by element (each read before its result is stored)
    while i < n {
        let (mut bw, mut bm, mut bv) = ([*w.add(i)], [*m.add(i)], [*v.add(i)]);
        step(c, &mut bw, &[*g.add(i)], &mut bm, &mut bv);
        (*w2.add(i), *m2.add(i), *v2.add(i)) = (bw[0], bm[0], bv[0]);
        i += 1;
    }
}

/// The step on one chunk, in place: the unfused formula's operations in its order.
#[inline(always)]
fn step(c: &AdamWStep, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let n = w.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let wd = w[i] * c.decay;
        // m + (1 - b1)(g - m), torch's lerp
        let m2 = m[i] + (g[i] - m[i]) * c.one_minus_beta1;
        let v2 = v[i] * c.beta2 + g[i] * g[i] * c.one_minus_beta2;
        let den = v2.sqrt() / c.bias2_sqrt + c.eps;
        w[i] = wd - m2 / den * c.step_size;
        m[i] = m2;
        v[i] = v2;
    }
}

/// [`adamw_raw`] on separate tensors (the allocating evaluator's path).
pub fn adamw(
    hyper: (f64, f64, f64, f64),
    ins: &[TensorRef],
    outs: &mut [TensorMut],
) -> Result<(), String> {
    let [w, g, m, v, step_size, b2, lr] = ins else {
        return Err("internal: AdamW takes 7 inputs".into());
    };
    let scalar = |t: &TensorRef| -> Result<f32, String> {
        typed::<f32>(t)?
            .first()
            .copied()
            .ok_or_else(|| "AdamW: an empty scalar".to_string())
    };
    let c = AdamWStep::new(hyper, scalar(step_size)?, scalar(b2)?, scalar(lr)?);
    let (w, g, m, v) = (
        typed::<f32>(w)?,
        typed::<f32>(g)?,
        typed::<f32>(m)?,
        typed::<f32>(v)?,
    );
    let n = w.len();
    if [g.len(), m.len(), v.len()] != [n; 3] {
        return Err("internal: AdamW inputs of different lengths".into());
    }
    let [ow, om, ov] = outs else {
        return Err("internal: AdamW has 3 outputs".into());
    };
    let ptr = |o: &mut TensorMut| -> Result<*mut f32, String> {
        let s = super::elem::typed_mut::<f32>(&mut o.data)?;
        if s.len() != n {
            return Err("internal: AdamW output of another length".into());
        }
        Ok(s.as_mut_ptr())
    };
    let (pw, pm, pv) = (ptr(ow)?, ptr(om)?, ptr(ov)?);
    // SAFETY: seven distinct buffers of n elements (the outputs are borrowed mutably here).
    unsafe {
        adamw_raw(
            n,
            &c,
            w.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            pw,
            pm,
            pv,
        )
    };
    Ok(())
}
