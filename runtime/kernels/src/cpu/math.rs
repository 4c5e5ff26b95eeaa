//! Scalar f32 special functions written branch-free so the elementwise loops that call them
//! vectorize: exp (Cephes-style range reduction and polynomial, ~1 ulp), tanh, sigmoid,
//! erf/erfc and the two GELUs. Relative error stays within a few 1e-7 except where the
//! argument of exp itself is large (|x| > ~10), where the f32 rounding of the argument
//! dominates (as in every f32 implementation).
//!
//! Polynomials are evaluated with fused multiply-adds (`mul_add`, one rounding per step).
//! Loops that call them run inside [`vectorized`], which compiles them for AVX-512 or
//! AVX2 with FMA (picked at run time), so `mul_add` is one instruction per lane. Called
//! outside it on a CPU without FMA, `mul_add` is the C library's `fmaf`: the same
//! results, only slower. Lane width never changes a result: the ops are elementwise.
//!
//! Polynomial coefficients are kept as published (Cephes, Numerical Recipes), digits past
//! f32 precision included.
#![allow(clippy::excessive_precision)]

use std::sync::OnceLock;

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in a part with few mantissa bits (exact products with small n) and the rest.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// The widest vector instruction set this CPU offers to [`vectorized`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Simd {
    /// AVX-512F with FMA (16 f32 lanes).
    Avx512,
    /// AVX2 with FMA (8 f32 lanes).
    Avx2,
    /// The compile-time baseline.
    Baseline,
}

/// Detected once per process. `HZP_SIMD=avx2|baseline` caps it (for benchmarks and for
/// checking that every level gives the same results).
pub fn simd() -> Simd {
    static LEVEL: OnceLock<Simd> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = match std::env::var("HZP_SIMD").ok().as_deref().map(str::trim) {
            Some("baseline") => Simd::Baseline,
            Some("avx2") => Simd::Avx2,
            _ => Simd::Avx512,
        };
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let fma = has!("fma");
            if cap == Simd::Avx512 && fma && has!("avx512f") && has!("avx2") {
                return Simd::Avx512;
            }
            if cap != Simd::Baseline && fma && has!("avx2") {
                return Simd::Avx2;
            }
        }
        let _ = cap;
        Simd::Baseline
    })
}

/// Runs `f` compiled for the CPU's [`simd`] level: `f` (a closure whose loops call the
/// `#[inline(always)]` functions of this module) is inlined into a copy of this function
/// built with those target features, so its loops vectorize at that width with FMA.
#[inline(always)]
pub fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        match simd() {
            // SAFETY: the features were detected at run time (`simd`).
            Simd::Avx512 => return unsafe { avx512(f) },
            // SAFETY: as above.
            Simd::Avx2 => return unsafe { avx2(f) },
            Simd::Baseline => {}
        }
    }
    f()
}

/// e^x. Overflows to inf above ~88.72, underflows to 0 (through subnormals) below ~-103.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // NaN-ignoring min/max vectorize; NaN is restored at the end
    #[allow(clippy::manual_clamp)]
    let xc = x.max(-104.0).min(89.0);
    // n = round(x / ln 2) by the 1.5 * 2^23 trick: the low mantissa bits of t hold n
    const MAGIC: f32 = 12_582_912.0;
    let t = xc.mul_add(LOG2E, MAGIC);
    let n = t - MAGIC;
    let ni = t.to_bits() as i32 - 0x4B40_0000;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, xc));
    let p = 1.987_569_2e-4f32.mul_add(r, 1.398_199_9e-3);
    let p = p.mul_add(r, 8.333_452e-3);
    let p = p.mul_add(r, 4.166_579_6e-2);
    let p = p.mul_add(r, 1.666_666_5e-1);
    let p = p.mul_add(r, 5.000_000_1e-1);
    let p = (p * r).mul_add(r, r) + 1.0;
    // 2^n as two factors so that n in [-150, 128] stays in the normal exponent range
    let n1 = ni >> 1;
    let n2 = ni - n1;
    let s1 = f32::from_bits(((n1 + 127) as u32) << 23);
    let s2 = f32::from_bits(((n2 + 127) as u32) << 23);
    let e = p * s1 * s2;
    if x.is_nan() {
        x
    } else {
        e
    }
}

#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    // |x| < 0.625: odd polynomial (Cephes tanhf)
    let z = x * x;
    let q = (-5.704_988_7e-3f32).mul_add(z, 2.063_908_9e-2);
    let q = q.mul_add(z, -5.373_971_6e-2);
    let q = q.mul_add(z, 1.333_144_2e-1);
    let q = q.mul_add(z, -3.333_328_2e-1);
    let small = (q * z).mul_add(x, x);
    // otherwise 1 - 2 / (e^2|x| + 1), with the sign of x
    let big = (1.0 - 2.0 / (exp(2.0 * a) + 1.0)).copysign(x);
    if a < 0.625 {
        small
    } else {
        big
    }
}

#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// erfc(|v|) via the Chebyshev-fitted exponential form (relative error < 1.2e-7 in exact
/// arithmetic), and the sign fix-up for negative v.
#[inline(always)]
pub fn erfc(v: f32) -> f32 {
    let z = v.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let mut poly = 0.170_872_77f32;
    for c in [
        -0.822_152_2,
        1.488_515_9,
        -1.135_204,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_97,
        1.000_023_7,
        -1.265_512_2,
    ] {
        poly = poly.mul_add(t, c);
    }
    let r = t * exp((-z).mul_add(z, poly));
    if v >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

/// erf: Maclaurin series for |x| < 0.5 (where 1 - erfc loses relative accuracy), else
/// 1 - erfc.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    use std::f32::consts::FRAC_2_SQRT_PI as C;
    let z = x * x;
    // 2/sqrt(pi) * (x - x^3/3 + x^5/10 - x^7/42 + x^9/216 - x^11/1320 + x^13/9360)
    let mut q = C / 9360.0;
    for c in [-C / 1320.0, C / 216.0, -C / 42.0, C / 10.0, -C / 3.0, C] {
        q = q.mul_add(z, c);
    }
    let series = x * q;
    let far = 1.0 - erfc(x);
    if x.abs() < 0.5 {
        series
    } else {
        far
    }
}

/// Exact GELU: 0.5 x (1 + erf(x / sqrt 2)) = 0.5 x erfc(-x / sqrt 2).
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    0.5 * x * erfc(-x * std::f32::consts::FRAC_1_SQRT_2)
}

/// tanh-approximated GELU: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed
/// as x / (1 + e^(-2u)) (0.5 (1 + tanh(u)) is the logistic function of 2u): one exp and one
/// division, and no cancellation in 1 + tanh(u) where u is very negative.
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    x / (1.0 + exp(-2.0 * gelu_inner(x)))
}

/// u = sqrt(2/pi) (x + 0.044715 x^3) of the tanh-approximated GELU.
#[inline(always)]
fn gelu_inner(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    const A: f32 = 0.044_715;
    C * (A * x * x).mul_add(x, x)
}

/// d/dx of [`gelu_tanh`]: 0.5 (1 + t) + 0.5 x (1 - t^2) u' with t = tanh(u) and
/// u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2). With e = e^(-2u) and s = 1 / (1 + e):
/// 0.5 (1 + t) = s and 0.5 (1 - t^2) = 2 s (1 - s) = 2 s (e s), so the gradient is
/// s (1 + 2 x (e s) u'). Where e overflows, s is 0 and so is the gradient.
#[inline(always)]
pub fn gelu_tanh_grad(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    const A: f32 = 0.044_715;
    let e = exp(-2.0 * gelu_inner(x));
    let s = 1.0 / (1.0 + e);
    let es = if e.is_finite() { e * s } else { 0.0 };
    let du = C * (3.0 * A).mul_add(x * x, 1.0);
    s * (2.0 * x * es).mul_add(du, 1.0)
}

/// `out[i] = f(x[i])` for `i < x.len()`, [`vectorized`].
///
/// # Safety
/// `out` must be valid for `x.len()` writes (it may be uninitialized) and must not overlap
/// `x`.
pub unsafe fn map_raw(x: &[f32], out: *mut f32, f: impl Fn(f32) -> f32 + Copy) {
    vectorized(
        #[inline(always)]
        move || {
            for (i, &v) in x.iter().enumerate() {
                // SAFETY: the caller's contract: `out` holds x.len() writable elements.
                unsafe { *out.add(i) = f(v) };
            }
        },
    )
}

/// `out[i] = f(a[i], b[i])` for `i < a.len()` (`b` at least as long), [`vectorized`].
///
/// # Safety
/// `b.len() >= a.len()`; `out` must be valid for `a.len()` writes (it may be
/// uninitialized) and must not overlap `a` or `b`.
pub unsafe fn zip_raw(a: &[f32], b: &[f32], out: *mut f32, f: impl Fn(f32, f32) -> f32 + Copy) {
    vectorized(
        #[inline(always)]
        move || {
            let b = &b[..a.len()];
            for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
                // SAFETY: the caller's contract: `out` holds a.len() writable elements.
                unsafe { *out.add(i) = f(x, y) };
            }
        },
    )
}

/// `f` over `x`, into a new vector (see [`map_raw`]).
pub fn map_f32(x: &[f32], f: impl Fn(f32) -> f32 + Copy) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    // SAFETY: the capacity holds x.len() elements, all written before set_len.
    unsafe {
        map_raw(x, out.as_mut_ptr(), f);
        out.set_len(x.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(a: f32, b: f64) -> f64 {
        ((a as f64 - b) / b.abs().max(1e-30)).abs()
    }

    /// Points spread over [lo, hi], dense near 0.
    fn grid(lo: f32, hi: f32) -> Vec<f32> {
        (0..=20000)
            .map(|i| lo + (hi - lo) * (i as f32 / 20000.0))
            .chain([0.0, -0.0, 1e-8, -1e-8, 1e-3, -1e-3])
            .collect()
    }

    #[test]
    fn tanh_gelu_and_its_gradient_are_accurate() {
        let c = (2.0f64 / std::f64::consts::PI).sqrt();
        for x in grid(-12.0, 12.0) {
            let xd = x as f64;
            let u = c * (xd + 0.044715 * xd * xd * xd);
            // in f64, 0.5 (1 + tanh u) = s and 0.5 (1 - tanh^2 u) = 2 s (1 - s) without the
            // cancellation of 1 + tanh u for very negative u
            let e = (-2.0 * u).exp();
            let s = 1.0 / (1.0 + e);
            let want = xd * s;
            // relative (the f32 rounding of u, amplified by e^(-2u), grows with |u|) where the
            // value is a normal f32, absolute in the far negative tail
            let tol = 1e-6 + 4e-7 * u.abs();
            let err = (gelu_tanh(x) as f64 - want).abs();
            assert!(
                err <= tol * want.abs() + 1e-36,
                "gelu_tanh({x}) = {} vs {want}",
                gelu_tanh(x)
            );
            let dwant = s + 2.0 * xd * s * (e * s) * c * (1.0 + 3.0 * 0.044715 * xd * xd);
            let derr = (gelu_tanh_grad(x) as f64 - dwant).abs();
            assert!(
                derr <= tol * dwant.abs().max(1.0),
                "gelu_tanh_grad({x}) = {} vs {dwant}",
                gelu_tanh_grad(x)
            );
        }
        assert_eq!(gelu_tanh(f32::INFINITY), f32::INFINITY);
        assert_eq!(gelu_tanh(-20.0), 0.0);
        assert_eq!(gelu_tanh_grad(-20.0), 0.0);
        assert_eq!(gelu_tanh_grad(20.0), 1.0);
        assert!(gelu_tanh(f32::NAN).is_nan() && gelu_tanh_grad(f32::NAN).is_nan());
    }

    #[test]
    fn exp_is_accurate_and_handles_extremes() {
        for x in grid(-87.0, 88.0) {
            let e = rel(exp(x), (x as f64).exp());
            assert!(e < 3e-7, "exp({x}): rel err {e}");
        }
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
        // subnormal results
        let s = exp(-100.0);
        assert!(s > 0.0 && rel(s, (-100f64).exp()) < 1e-2, "{s}");
    }

    #[test]
    fn tanh_sigmoid_erf_are_accurate() {
        for x in grid(-20.0, 20.0) {
            let xd = x as f64;
            assert!(rel(tanh(x), xd.tanh()) < 4e-7 || xd == 0.0, "tanh({x})");
            assert!(
                rel(sigmoid(x), 1.0 / (1.0 + (-xd).exp())) < 4e-7,
                "sigmoid({x})"
            );
        }
        for x in grid(-5.0, 5.0) {
            let want = crate::cpu::elementwise::erf_f64(x as f64);
            if want != 0.0 {
                assert!(rel(erf(x), want) < 5e-7, "erf({x}) = {} vs {want}", erf(x));
            }
        }
        for x in grid(-3.0, 9.0) {
            let want = crate::cpu::elementwise::erfc_f64(x as f64);
            // the f32 rounding of the argument -x^2 of exp bounds the accuracy
            let tol = 1e-6 + (x as f64).powi(2) * 1.2e-7;
            assert!(
                rel(erfc(x), want) < tol,
                "erfc({x}) = {} vs {want}",
                erfc(x)
            );
        }
        assert!(tanh(f32::NAN).is_nan());
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
        assert_eq!(sigmoid(-200.0), 0.0);
        assert_eq!(sigmoid(200.0), 1.0);
    }
}
