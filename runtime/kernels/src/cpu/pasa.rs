//! fp16 flash attention, emulated step by step on the CPU: the plain algorithm and PASA
//! (Pseudo-Average Shifting Attention, Cheng et al., arXiv 2503.01873). A reference for the
//! CUDA kernel `attn_fwd_pasa_f16` (`cuda/kernels/attention.cu`), which runs the same
//! sequence of roundings, and the evidence that PASA is needed: on inputs with a large bias
//! and amplitude the plain algorithm's fp16 scores overflow (inf, then NaN) while PASA's
//! stay finite and match exact attention (`runtime/tests/pasa.rs`).
//!
//! One (batch, head) at a time: `q` [T, D], `k` [S, D], `v` [S, DV], an optional additive
//! mask [T, S] and a causal flag (key j seen by query i when j <= i), keys in blocks of
//! `block`. Results: the output [T, DV] (fp16) and each row's log-sum-exp (f32, the statistic
//! the backward kernels read).
//!
//! ## What "fp16 compute" means here
//! Every value the algorithm keeps is rounded to fp16 (round to nearest even): the scores,
//! the block maxima, the running maximum `m`, sum `l` and output accumulator, the
//! probabilities, the rescaling factors, the shifted keys. Reductions (a dot product of a
//! score, the block's row sum of probabilities, a column of `P V`, a block's key sum) add
//! their terms in f32 in a fixed order and round the total once, as a matrix unit with f16
//! outputs does (tensor cores, the NPU's cube unit); elementwise steps compute in f32 and
//! round the result, which for a single f16 add or multiply is the f16 operation's result.
//! The score product is rounded before it is scaled (`S = fp16(Q Kᵀ)`, then `fp16(S scale)`),
//! as a kernel that takes the product from the matrix unit in f16 does: that is where plain
//! fp16 attention overflows (|q·k| > 65504 gives inf, and `inf - inf` NaN).
//!
//! ## PASA as hzp computes it
//! For key block j (rows `K_j`, n keys) the pseudo-average is the block's mean key
//! `k̄_j = fp16(Σ_rows K_j / n)`, shifted by `β`: `h_j = fp16(β k̄_j)`, `K'_j = fp16(K_j - h_j)`.
//! The block's shifted scores are `S'_j = fp16(fp16(Q K'_jᵀ) scale)`, which equals
//! `S_j - a_j` with the row constant `a_j = scale q·h_j`: the paper's shifting matrix
//! `M = I - (β/n) 1 1ᵀ` applied to the block (`S_j M = Q (M K_j)ᵀ`, M symmetric), computed
//! by shifting K before the product. Removing the keys' common part removes the
//! `D·bias_q·bias_k` term that overflows, and softmax is invariant to a per-row constant.
//!
//! Global recovering: the running state (m, l, acc) is kept in the frame of the current
//! block (scores relative to `a_j`). Moving to block j converts the running maximum,
//! `m ← fp16(m - δ_j)` with `δ_j = a_j - a_{j-1} = fp16(fp16(q·fp16(h_j - h_{j-1})) scale)`,
//! a product of q with the (small) difference of consecutive pseudo-averages, so the large
//! absolute shifts `a_j` never appear in fp16; `l` and `acc` are relative to `m` and need no
//! change. Then the usual online-softmax update with `S'_j`. At the end
//! `O = fp16(acc / l)` and `lse = m + ln l + a_last` in f32, with `a_last = scale q·h_last`
//! computed in f32: the true row log-sum-exp, so the existing gradient kernels (which
//! recompute `P = exp(S - lse)` in f32) serve PASA's backward unchanged.
//!
//! Interpretations (only the paper's abstract and summaries of its method could be read
//! here, not its algorithm listing): (1) the paper tunes `β` by a nonlinear condition and
//! its shifting matrix `M` is singular at `β = 1`; hzp takes the shift's size from `q·h_j`
//! directly rather than recovering it from the shifted scores, so it needs no inverse of
//! `M` and uses `β = 1` ([`PASA_BETA`]), which removes the whole common part (a `β` below 1
//! leaves `(1 - β) D bias_q bias_k scale` in every score, where fp16 has fewer bits for the
//! differences that matter: `runtime/tests/pasa.rs` measures it). (2) "Global recovering"
//! is read as the reconciliation of the blocks' shifted frames in the online softmax, done
//! on the running maximum as above, plus the absolute shift added back to the saved
//! log-sum-exp. (3) The block of keys a pseudo-average is taken over is the kernel's key
//! tile ([`PASA_BLOCK`] on CUDA).
//! Limits: a shifted score or a frame change beyond 65504 still overflows (scores whose
//! spread within one row exceeds fp16's range have no fp16 representation at all).

use half::f16;

/// The `β` hzp's PASA uses (see the module comment: interpretation 1).
pub const PASA_BETA: f32 = 1.0;
/// Keys per block of the CUDA kernel (`AT_BC` in `attention.cu`): the block a
/// pseudo-average is taken over.
pub const PASA_BLOCK: usize = 16;

/// Rounds to fp16 and back (round to nearest even; overflow gives ±inf).
#[inline]
pub fn r16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// One (batch, head) of attention: operands as f16 values, row-major.
#[derive(Clone, Copy, Debug)]
pub struct Head<'a> {
    pub q: &'a [f16],
    pub k: &'a [f16],
    pub v: &'a [f16],
    /// Additive mask [T, S], or none.
    pub mask: Option<&'a [f16]>,
    pub t: usize,
    pub s: usize,
    pub d: usize,
    pub dv: usize,
    pub scale: f32,
    pub causal: bool,
}

/// Output [T, DV] and row log-sum-exp [T].
#[derive(Clone, Debug)]
pub struct Fp16Result {
    pub out: Vec<f16>,
    pub lse: Vec<f32>,
}

impl Head<'_> {
    fn check(&self, block: usize) -> Result<(), String> {
        let (t, s, d, dv) = (self.t, self.s, self.d, self.dv);
        if block == 0 {
            return Err("block of 0 keys".into());
        }
        if self.q.len() != t * d || self.k.len() != s * d || self.v.len() != s * dv {
            return Err(format!(
                "operand sizes q {} k {} v {} do not match T={t} S={s} D={d} DV={dv}",
                self.q.len(),
                self.k.len(),
                self.v.len()
            ));
        }
        if self.mask.is_some_and(|m| m.len() != t * s) {
            return Err(format!("the mask is not [T={t}, S={s}]"));
        }
        Ok(())
    }

    /// Whether query i sees key j, and the mask added to its score.
    fn bias(&self, i: usize, j: usize) -> Option<f32> {
        if self.causal && j > i {
            return None;
        }
        Some(self.mask.map_or(0.0, |m| m[i * self.s + j].to_f32()))
    }

    fn f(x: &[f16]) -> Vec<f32> {
        x.iter().map(|v| v.to_f32()).collect()
    }
}

/// The online-softmax state of one row, every field an fp16 value.
struct Row {
    m: f32,
    l: f32,
    acc: Vec<f32>,
}

impl Row {
    fn new(dv: usize) -> Row {
        Row {
            m: f32::NEG_INFINITY,
            l: 0.0,
            acc: vec![0.0; dv],
        }
    }

    /// The online update with one block's scores `sc` (fp16 values; None = masked) and
    /// its value rows `v[j]` [DV].
    fn update(&mut self, sc: &[Option<f32>], v: &[f32], dv: usize) {
        let bmax = sc
            .iter()
            .flatten()
            .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mn = self.m.max(bmax);
        if mn == f32::NEG_INFINITY {
            return; // nothing seen yet, nothing in this block
        }
        let corr = if self.m == f32::NEG_INFINITY {
            0.0
        } else {
            r16(r16(self.m - mn).exp())
        };
        let p: Vec<f32> = sc
            .iter()
            .map(|s| s.map_or(0.0, |s| r16(r16(s - mn).exp())))
            .collect();
        let psum = r16(p.iter().sum::<f32>());
        self.l = r16(r16(self.l * corr) + psum);
        for c in 0..dv {
            let mut pv = 0.0f32;
            for (jj, &pj) in p.iter().enumerate() {
                pv += pj * v[jj * dv + c];
            }
            self.acc[c] = r16(r16(self.acc[c] * corr) + r16(pv));
        }
        self.m = mn;
    }

    /// `fp16(acc / l)` (zeros for a row that saw nothing; NaN stays NaN).
    fn finish(&self, out: &mut [f16]) {
        for (o, &a) in out.iter_mut().zip(&self.acc) {
            *o = f16::from_f32(if self.l == 0.0 { 0.0 } else { a / self.l });
        }
    }

    /// `m + ln l` in f32 (-inf for a row that saw nothing).
    fn lse(&self) -> f32 {
        if self.l == 0.0 {
            f32::NEG_INFINITY
        } else {
            self.m + self.l.ln()
        }
    }
}

/// `fp16(fp16(x·y) scale)`: a score from the matrix unit's f16 output, then scaled.
fn score(x: &[f32], y: &[f32], scale: f32) -> f32 {
    let dot: f32 = x.iter().zip(y).map(|(a, b)| a * b).sum();
    r16(r16(dot) * scale)
}

/// Plain fp16 flash attention (FlashAttention's online softmax, every kept value fp16).
pub fn flash_fp16(h: &Head, block: usize) -> Result<Fp16Result, String> {
    h.check(block)?;
    let (q, k, v) = (Head::f(h.q), Head::f(h.k), Head::f(h.v));
    let (d, dv) = (h.d, h.dv);
    let mut out = vec![f16::ZERO; h.t * dv];
    let mut lse = vec![f32::NEG_INFINITY; h.t];
    for i in 0..h.t {
        let qi = &q[i * d..(i + 1) * d];
        let mut row = Row::new(dv);
        for j0 in (0..h.s).step_by(block) {
            let n = block.min(h.s - j0);
            let sc: Vec<Option<f32>> = (j0..j0 + n)
                .map(|j| {
                    h.bias(i, j)
                        .map(|b| r16(score(qi, &k[j * d..(j + 1) * d], h.scale) + b))
                })
                .collect();
            row.update(&sc, &v[j0 * dv..(j0 + n) * dv], dv);
        }
        row.finish(&mut out[i * dv..(i + 1) * dv]);
        lse[i] = row.lse();
    }
    Ok(Fp16Result { out, lse })
}

/// The shift `h = fp16(β fp16(mean of the rows of k[j0..j0+n]))` [D] of one key block.
pub fn block_shift(k: &[f32], d: usize, j0: usize, n: usize, beta: f32) -> Vec<f32> {
    (0..d)
        .map(|c| {
            let mut sum = 0.0f32;
            for j in j0..j0 + n {
                sum += k[j * d + c];
            }
            r16(beta * r16(sum / n as f32))
        })
        .collect()
}

/// PASA in fp16 (see the module comment). `recover = false` leaves out the frame change
/// between blocks: wrong wherever the blocks' pseudo-averages differ, which the tests use to
/// show that the recovery is what makes the result right.
pub fn pasa_fp16(h: &Head, block: usize, beta: f32, recover: bool) -> Result<Fp16Result, String> {
    h.check(block)?;
    let (q, k, v) = (Head::f(h.q), Head::f(h.k), Head::f(h.v));
    let (d, dv) = (h.d, h.dv);
    let mut out = vec![f16::ZERO; h.t * dv];
    let mut lse = vec![f32::NEG_INFINITY; h.t];
    // the blocks' shifted keys and shifts, the same for every query row
    let mut blocks = Vec::new();
    for j0 in (0..h.s).step_by(block) {
        let n = block.min(h.s - j0);
        let sh = block_shift(&k, d, j0, n, beta);
        let shifted: Vec<f32> = (0..n * d).map(|x| r16(k[j0 * d + x] - sh[x % d])).collect();
        blocks.push((j0, n, sh, shifted));
    }
    for i in 0..h.t {
        let qi = &q[i * d..(i + 1) * d];
        let mut row = Row::new(dv);
        let mut prev: Option<&Vec<f32>> = None;
        for (j0, n, sh, shifted) in &blocks {
            if let Some(p) = prev {
                if recover && row.m != f32::NEG_INFINITY {
                    let diff: Vec<f32> = sh.iter().zip(p).map(|(a, b)| r16(a - b)).collect();
                    row.m = r16(row.m - score(qi, &diff, h.scale));
                }
            }
            prev = Some(sh);
            let sc: Vec<Option<f32>> = (0..*n)
                .map(|jj| {
                    h.bias(i, j0 + jj)
                        .map(|b| r16(score(qi, &shifted[jj * d..(jj + 1) * d], h.scale) + b))
                })
                .collect();
            row.update(&sc, &v[j0 * dv..(j0 + n) * dv], dv);
        }
        row.finish(&mut out[i * dv..(i + 1) * dv]);
        lse[i] = row.lse();
        if let (Some(last), true) = (prev, row.l != 0.0) {
            let a: f32 = qi.iter().zip(last).map(|(x, y)| x * y).sum::<f32>() * h.scale;
            lse[i] += a;
        }
    }
    Ok(Fp16Result { out, lse })
}

/// Exact attention in f64 of the same f16 operands: output [T, DV] and lse [T] (zeros and
/// -inf for a row that sees no key).
pub fn exact_f64(h: &Head) -> Result<(Vec<f64>, Vec<f64>), String> {
    h.check(1)?;
    let f = |x: &[f16]| -> Vec<f64> { x.iter().map(|v| v.to_f64()).collect() };
    let (q, k, v) = (f(h.q), f(h.k), f(h.v));
    let (d, dv) = (h.d, h.dv);
    let mut out = vec![0.0; h.t * dv];
    let mut lse = vec![f64::NEG_INFINITY; h.t];
    for i in 0..h.t {
        let sc: Vec<f64> = (0..h.s)
            .map(|j| match h.bias(i, j) {
                Some(b) => {
                    let dot: f64 = (0..d).map(|c| q[i * d + c] * k[j * d + c]).sum();
                    dot * h.scale as f64 + b as f64
                }
                None => f64::NEG_INFINITY,
            })
            .collect();
        let m = sc.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        if m == f64::NEG_INFINITY {
            continue;
        }
        let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
        let l: f64 = e.iter().sum();
        for c in 0..dv {
            out[i * dv + c] = (0..h.s).map(|j| e[j] * v[j * dv + c]).sum::<f64>() / l;
        }
        lse[i] = m + l.ln();
    }
    Ok((out, lse))
}
