//! The fused attention kernels ([`Op::Attention`], [`Op::AttentionGrad`]) against a plain
//! f64 implementation of the explicit form (scores, mask, softmax, product) and its
//! gradient, on random shapes: 1 to 300 queries, odd head sizes, grouped-query ratios 1, 2,
//! 4 and 8, causal, padding and additive masks, fully masked rows (zeros and no gradient,
//! PyTorch's SDPA convention); plus finite differences of the fused forward.

use hzp_ir::{Op, Tensor};
use hzp_runtime::cpu::eval_op;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n).map(|_| (self.next() * scale) as f32).collect()
    }
}

#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    hkv: usize,
    g: usize,
    t: usize,
    s: usize,
    d: usize,
    dv: usize,
    causal: bool,
    /// 0: none, 1: padding [B,1,1,S] (-inf on padded keys; batch 0 fully padded when
    /// `b > 1`), 2: additive [T,S] bias with some -inf, 3: [B,Hq,T,S] bias
    mask: u8,
}

struct Data {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Option<Tensor>,
    dout: Tensor,
}

fn data(c: &Case, rng: &mut Rng) -> Data {
    let hq = c.hkv * c.g;
    let q = Tensor::f32(vec![c.b, hq, c.t, c.d], rng.vec(c.b * hq * c.t * c.d, 1.5));
    let k = Tensor::f32(
        vec![c.b, c.hkv, c.s, c.d],
        rng.vec(c.b * c.hkv * c.s * c.d, 1.5),
    );
    let v = Tensor::f32(
        vec![c.b, c.hkv, c.s, c.dv],
        rng.vec(c.b * c.hkv * c.s * c.dv, 1.0),
    );
    let dout = Tensor::f32(
        vec![c.b, hq, c.t, c.dv],
        rng.vec(c.b * hq * c.t * c.dv, 1.0),
    );
    let mask = match c.mask {
        1 => {
            let mut m = vec![0f32; c.b * c.s];
            for bi in 0..c.b {
                // batch 0 of several: every key padded (fully masked rows)
                let valid = if bi == 0 && c.b > 1 {
                    0
                } else {
                    (c.s * 2).div_ceil(3)
                };
                for j in valid..c.s {
                    m[bi * c.s + j] = f32::NEG_INFINITY;
                }
            }
            Some(Tensor::f32(vec![c.b, 1, 1, c.s], m))
        }
        2 => {
            let m = (0..c.t * c.s)
                .map(|i| {
                    if i % 5 == 2 {
                        f32::NEG_INFINITY
                    } else {
                        (rng.next() * 2.0) as f32
                    }
                })
                .collect();
            Some(Tensor::f32(vec![c.t, c.s], m))
        }
        3 => Some(Tensor::f32(
            vec![c.b, hq, c.t, c.s],
            rng.vec(c.b * hq * c.t * c.s, 3.0),
        )),
        _ => None,
    };
    Data {
        q,
        k,
        v,
        mask,
        dout,
    }
}

/// The explicit form in f64: (o, lse, dq, dk, dv).
#[allow(clippy::type_complexity)]
fn reference(c: &Case, x: &Data, scale: f64) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let hq = c.hkv * c.g;
    let (q, k, v, g) = (
        x.q.to_f64_vec(),
        x.k.to_f64_vec(),
        x.v.to_f64_vec(),
        x.dout.to_f64_vec(),
    );
    let mask = x.mask.as_ref().map(|m| (m.to_f64_vec(), m.shape.clone()));
    let mask_at = |b: usize, h: usize, i: usize, j: usize| -> f64 {
        let Some((m, shape)) = &mask else { return 0.0 };
        let mut full = vec![1; 4 - shape.len()];
        full.extend(shape);
        let idx = [b, h, i, j];
        let mut off = 0;
        for a in 0..4 {
            off = off * full[a] + if full[a] == 1 { 0 } else { idx[a] };
        }
        m[off]
    };
    let (t, s, d, dv) = (c.t, c.s, c.d, c.dv);
    let mut o = vec![0.0; c.b * hq * t * dv];
    let mut lse = vec![f64::NEG_INFINITY; c.b * hq * t];
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; k.len()];
    let mut dvv = vec![0.0; v.len()];
    for b in 0..c.b {
        for h in 0..hq {
            let kh = b * c.hkv + h / c.g;
            for i in 0..t {
                let row = (b * hq + h) * t + i;
                let qi = &q[row * d..(row + 1) * d];
                let sc: Vec<f64> = (0..s)
                    .map(|j| {
                        if c.causal && j > i {
                            return f64::NEG_INFINITY;
                        }
                        let kj = &k[(kh * s + j) * d..(kh * s + j + 1) * d];
                        scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>()
                            + mask_at(b, h, i, j)
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    continue; // fully masked: zeros, no gradient
                }
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                let p: Vec<f64> = e.iter().map(|x| x / z).collect();
                lse[row] = m + z.ln();
                let gi = &g[row * dv..(row + 1) * dv];
                let dp: Vec<f64> = (0..s)
                    .map(|j| {
                        let vj = &v[(kh * s + j) * dv..(kh * s + j + 1) * dv];
                        gi.iter().zip(vj).map(|(a, b)| a * b).sum()
                    })
                    .collect();
                let dsum: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for j in 0..s {
                    let vj = (kh * s + j) * dv;
                    for e in 0..dv {
                        o[row * dv + e] += p[j] * v[vj + e];
                        dvv[vj + e] += p[j] * gi[e];
                    }
                    let ds = p[j] * (dp[j] - dsum);
                    let kj = (kh * s + j) * d;
                    for e in 0..d {
                        dq[row * d + e] += scale * ds * k[kj + e];
                        dk[kj + e] += scale * ds * qi[e];
                    }
                }
            }
        }
    }
    (o, lse, dq, dk, dvv)
}

fn close(what: &str, c: &Case, got: &Tensor, want: &[f64], tol: f64) {
    let got = got.to_f64_vec();
    assert_eq!(got.len(), want.len(), "{what} {c:?}");
    let scale = want
        .iter()
        .filter(|x| x.is_finite())
        .fold(1e-3f64, |a, x| a.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_finite() {
            (g - w).abs() <= tol * scale
        } else {
            g == w
        };
        assert!(ok, "{what} {c:?}: element {i}: {g} vs {w} (scale {scale})");
    }
}

fn run_case(c: &Case, seed: u64) {
    let mut rng = Rng(seed);
    let x = data(c, &mut rng);
    let scale = 1.0 / (c.d as f64).sqrt();
    let (o, lse, dq, dk, dv) = reference(c, &x, scale);
    let op = Op::Attention {
        scale,
        causal: c.causal,
    };
    let mut ins = vec![&x.q, &x.k, &x.v];
    ins.extend(x.mask.as_ref());
    let fwd = eval_op(&op, &ins).unwrap();
    close("o", c, &fwd[0], &o, 1e-5);
    close("lse", c, &fwd[1], &lse, 1e-5);
    let grad = Op::AttentionGrad {
        scale,
        causal: c.causal,
    };
    let mut gins = vec![&x.q, &x.k, &x.v, &fwd[0], &fwd[1], &x.dout];
    gins.extend(x.mask.as_ref());
    let g = eval_op(&grad, &gins).unwrap();
    close("dq", c, &g[0], &dq, 1e-4);
    close("dk", c, &g[1], &dk, 1e-4);
    close("dv", c, &g[2], &dv, 1e-4);
}

#[test]
fn fused_attention_matches_the_explicit_form() {
    let mut seed = 1;
    let ts = [1usize, 2, 7, 31, 32, 33, 64, 65, 100];
    for (n, &t) in ts.iter().enumerate() {
        for g in [1usize, 2, 4, 8] {
            for causal in [false, true] {
                let mask = ((n + g) % 4) as u8;
                let d = [1usize, 5, 17, 8, 64][n % 5];
                let s = if causal {
                    t
                } else {
                    [t, t + 3, (t / 2).max(1)][n % 3]
                };
                let c = Case {
                    b: 1 + n % 2,
                    hkv: 1 + (n + g) % 2,
                    g,
                    t,
                    s,
                    d,
                    dv: [d, 3, 16][n % 3],
                    causal,
                    mask,
                };
                run_case(&c, seed);
                seed += 1;
            }
        }
    }
}

#[test]
fn long_sequences_and_every_mask_kind() {
    for (i, mask) in [0u8, 1, 2, 3].into_iter().enumerate() {
        let c = Case {
            b: 2,
            hkv: 1,
            g: 2,
            t: 300,
            s: 300,
            d: 13,
            dv: 13,
            causal: i % 2 == 1,
            mask,
        };
        run_case(&c, 100 + i as u64);
    }
}

#[test]
fn fully_masked_rows_give_zeros_and_no_gradient() {
    let c = Case {
        b: 2,
        hkv: 2,
        g: 2,
        t: 5,
        s: 9,
        d: 4,
        dv: 4,
        causal: false,
        mask: 1, // batch 0: every key padded
    };
    let mut rng = Rng(7);
    let x = data(&c, &mut rng);
    let op = Op::Attention {
        scale: 0.5,
        causal: false,
    };
    let m = x.mask.as_ref().unwrap();
    let fwd = eval_op(&op, &[&x.q, &x.k, &x.v, m]).unwrap();
    let o = fwd[0].to_f64_vec();
    let lse = fwd[1].to_f64_vec();
    let per_batch = o.len() / 2;
    assert!(o[..per_batch].iter().all(|&v| v == 0.0));
    assert!(lse[..lse.len() / 2].iter().all(|&v| v == f64::NEG_INFINITY));
    assert!(
        o[per_batch..].iter().all(|v| v.is_finite()) && o[per_batch..].iter().any(|&v| v != 0.0)
    );
    let grad = Op::AttentionGrad {
        scale: 0.5,
        causal: false,
    };
    let g = eval_op(&grad, &[&x.q, &x.k, &x.v, &fwd[0], &fwd[1], &x.dout, m]).unwrap();
    let dq = g[0].to_f64_vec();
    assert!(dq[..dq.len() / 2].iter().all(|&v| v == 0.0));
    assert!(g
        .iter()
        .all(|t| t.to_f64_vec().iter().all(|v| v.is_finite())));
}

/// Central differences of `L = sum(o * w)` against the kernel's gradient with dO = w.
#[test]
fn gradients_match_finite_differences() {
    for (causal, mask, g) in [(false, 2u8, 2usize), (true, 0, 4), (false, 1, 1)] {
        let c = Case {
            b: 2,
            hkv: 1,
            g,
            t: 6,
            s: 6,
            d: 3,
            dv: 5,
            causal,
            mask,
        };
        let mut rng = Rng(11 + g as u64);
        let x = data(&c, &mut rng);
        let scale = 0.7;
        let op = Op::Attention { scale, causal };
        let loss = |q: &Tensor, k: &Tensor, v: &Tensor| -> f64 {
            let mut ins = vec![q, k, v];
            ins.extend(x.mask.as_ref());
            let o = eval_op(&op, &ins).unwrap()[0].to_f64_vec();
            o.iter().zip(x.dout.to_f64_vec()).map(|(a, b)| a * b).sum()
        };
        let mut ins = vec![&x.q, &x.k, &x.v];
        ins.extend(x.mask.as_ref());
        let fwd = eval_op(&op, &ins).unwrap();
        let mut gins = vec![&x.q, &x.k, &x.v, &fwd[0], &fwd[1], &x.dout];
        gins.extend(x.mask.as_ref());
        let grads = eval_op(&Op::AttentionGrad { scale, causal }, &gins).unwrap();
        let eps = 1e-2;
        for which in 0..3 {
            let base = [&x.q, &x.k, &x.v][which];
            let n = base.numel();
            let want = grads[which].to_f64_vec();
            for idx in (0..n).step_by(7) {
                let mut plus = base.to_f64_vec();
                let mut minus = plus.clone();
                plus[idx] += eps;
                minus[idx] -= eps;
                let mk = |d: Vec<f64>| Tensor::from_f64(hzp_ir::DType::F32, base.shape.clone(), &d);
                let (tp, tm) = (mk(plus), mk(minus));
                let pick = |t: &Tensor| -> [Tensor; 3] {
                    let mut a = [x.q.clone(), x.k.clone(), x.v.clone()];
                    a[which] = t.clone();
                    a
                };
                let [qp, kp, vp] = pick(&tp);
                let [qm, km, vm] = pick(&tm);
                let fd = (loss(&qp, &kp, &vp) - loss(&qm, &km, &vm)) / (2.0 * eps);
                let err = (fd - want[idx]).abs();
                assert!(
                    err <= 2e-2 * (1.0 + want[idx].abs()),
                    "input {which} element {idx} ({c:?}): finite difference {fd} vs {}",
                    want[idx]
                );
            }
        }
    }
}

#[test]
fn bf16_inputs_compute_in_f32() {
    let c = Case {
        b: 1,
        hkv: 2,
        g: 2,
        t: 9,
        s: 9,
        d: 8,
        dv: 8,
        causal: true,
        mask: 0,
    };
    let x = data(&c, &mut Rng(3));
    let cast = |t: &Tensor| Tensor::from_f64(hzp_ir::DType::BF16, t.shape.clone(), &t.to_f64_vec());
    let widen = |t: &Tensor| Tensor::from_f64(hzp_ir::DType::F32, t.shape.clone(), &t.to_f64_vec());
    let (q, k, v) = (cast(&x.q), cast(&x.k), cast(&x.v));
    let op = Op::Attention {
        scale: 0.25,
        causal: true,
    };
    let out = eval_op(&op, &[&q, &k, &v]).unwrap();
    assert_eq!(out[0].dtype(), hzp_ir::DType::BF16);
    assert_eq!(out[1].dtype(), hzp_ir::DType::F32);
    let widened = Data {
        q: widen(&q),
        k: widen(&k),
        v: widen(&v),
        mask: None,
        dout: x.dout.clone(),
    };
    let (o, ..) = reference(&c, &widened, 0.25);
    close("bf16 o", &c, &out[0], &o, 1e-2);
}
