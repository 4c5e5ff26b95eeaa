//! Fused scaled dot-product attention ([`hzp_ir::Op::Attention`] and its gradient), tiled
//! as FlashAttention-2 does it: no score or probability matrix is ever stored.
//!
//! Forward: per (batch, query head, block of [`ROWS`] queries), keys in blocks of
//! [`COLS`]; each block's scores update a running row maximum, the running sum of
//! exponentials and the output rows (accumulated in the output itself), rescaled when the
//! maximum grows (online softmax). The result is the output and each row's log-sum-exp.
//! Scratch is two stack arrays per task: O(rows), not O(T x S).
//!
//! Backward: `D_i = dO_i . O_i` per row, then the probabilities are recomputed from the
//! saved log-sum-exp, `p_ij = exp(s_ij - lse_i)`, twice: once per block of query rows for
//! dQ (`dQ_i = scale sum_j p_ij (dO_i . v_j - D_i) k_j`) and once per block of keys of a
//! key/value head for dK and dV, summing over every query head of its group and every
//! query row (`dV_j = sum_i p_ij dO_i`, `dK_j = scale sum_i p_ij (dO_i . v_j - D_i) q_i`).
//! Each output row has one owner task, so there are no atomics and the sums have one order.
//!
//! Determinism: dot products keep eight partial sums in a fixed order, every other loop is
//! elementwise, and `exp` is [`math::exp`] (fused multiply-adds at every level), so every
//! vector level gives the same bits (`runtime/tests/simd_levels.rs`).
//!
//! A row whose every score is -inf (a fully masked row) yields zeros with `lse = -inf` and
//! no gradient: PyTorch's convention for SDPA (its "safe" softmax), which the importer
//! keeps for explicit attention too. A causal row always sees key 0 (top-left aligned).

use super::elem::{floats, out_stage_len, stage_len, store_f32};
use super::into::{TensorMut, TensorRef, Workspace};
use super::math;
use super::threads::{for_each_index, SendPtr};

/// Query rows per task.
const ROWS: usize = 32;
/// Keys per block.
const COLS: usize = 64;

/// Shapes and attributes of one attention.
#[derive(Clone, Copy, Debug)]
struct Dims {
    b: usize,
    hq: usize,
    hkv: usize,
    t: usize,
    s: usize,
    d: usize,
    dv: usize,
    scale: f32,
    causal: bool,
}

impl Dims {
    fn of(q: &[usize], k: &[usize], v: &[usize], scale: f64, causal: bool) -> Result<Dims, String> {
        let bad = || "internal: attention operands of the wrong rank".to_string();
        let (&[b, hq, t, d], &[_, hkv, s, _], &[_, _, _, dv]) = (q, k, v) else {
            return Err(bad());
        };
        if hkv == 0 || !hq.is_multiple_of(hkv) {
            return Err(bad());
        }
        Ok(Dims {
            b,
            hq,
            hkv,
            t,
            s,
            d,
            dv,
            scale: scale as f32,
            causal,
        })
    }
    /// Query heads per key/value head.
    fn group(&self) -> usize {
        self.hq / self.hkv
    }
    /// Keys row `i` may see: `0..keys(i)`.
    fn keys(&self, i: usize) -> usize {
        if self.causal {
            (i + 1).min(self.s)
        } else {
            self.s
        }
    }
}

/// An additive mask broadcast to [B, Hq, T, S]: element strides per axis (0 where the
/// mask has extent 1).
#[derive(Clone, Copy)]
struct Mask<'a> {
    data: &'a [f32],
    strides: [usize; 4],
}

impl<'a> Mask<'a> {
    fn of(data: &'a [f32], shape: &[usize]) -> Mask<'a> {
        let mut full = [1usize; 4];
        full[4 - shape.len()..].copy_from_slice(shape);
        let mut strides = [0usize; 4];
        let mut st = 1;
        for a in (0..4).rev() {
            strides[a] = if full[a] == 1 { 0 } else { st };
            st *= full[a];
        }
        Mask { data, strides }
    }
    /// The mask row of (b, h, i) and its stride along the keys.
    fn row(&self, b: usize, h: usize, i: usize) -> (&'a [f32], usize) {
        let [sb, sh, si, sj] = self.strides;
        (&self.data[b * sb + h * sh + i * si..], sj)
    }
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// y += a x
#[inline(always)]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// The scaled, masked score of query row `qi` against key `j`.
#[inline(always)]
fn score(dm: &Dims, qi: &[f32], kj: &[f32], mask: Option<(&[f32], usize)>, j: usize) -> f32 {
    let s = dm.scale * dot(qi, kj);
    match mask {
        Some((m, sj)) => s + m[j * sj],
        None => s,
    }
}

/// The forward: outputs `o` (q's dtype) and `lse` (f32).
pub fn attention(
    ins: &[TensorRef],
    scale: f64,
    causal: bool,
    outs: &mut [TensorMut],
    ws: &mut Workspace,
) -> Result<(), String> {
    let [o, lse] = outs else {
        return Err("internal: attention has two outputs".into());
    };
    let (q, k, v) = (&ins[0], &ins[1], &ins[2]);
    let mask = ins.get(3);
    let dm = Dims::of(q.shape, k.shape, v.shape, scale, causal)?;
    let lse = super::elem::typed_mut::<f32>(&mut lse.data)?;
    let [qs, ks, vs, ms, os] = ws.f32s.take([
        stage_len(q.data),
        stage_len(k.data),
        stage_len(v.data),
        mask.map_or(0, |m| stage_len(m.data)),
        out_stage_len(&o.data),
    ]);
    let (qv, kv, vv) = (floats(q.data, qs), floats(k.data, ks), floats(v.data, vs));
    let mask = mask.map(|m| Mask::of(floats(m.data, ms), m.shape));
    store_f32(&mut o.data, os, |ov| {
        forward(&dm, qv, kv, vv, mask, ov, lse);
    });
    Ok(())
}

fn forward(
    dm: &Dims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<Mask>,
    o: &mut [f32],
    lse: &mut [f32],
) {
    let (t, s, d, dv) = (dm.t, dm.s, dm.d, dm.dv);
    let blocks = t.div_ceil(ROWS);
    let (op, lp) = (SendPtr(o.as_mut_ptr()), SendPtr(lse.as_mut_ptr()));
    for_each_index(dm.b * dm.hq * blocks, |task| {
        let (bh, blk) = (task / blocks, task % blocks);
        let (b, h) = (bh / dm.hq, bh % dm.hq);
        let kvh = b * dm.hkv + h / dm.group();
        let (i0, i1) = (blk * ROWS, ((blk + 1) * ROWS).min(t));
        let rows = i1 - i0;
        let row0 = bh * t + i0;
        // SAFETY: task (b, h, blk) alone writes rows i0..i1 of head (b, h).
        let or = unsafe { std::slice::from_raw_parts_mut(op.get().add(row0 * dv), rows * dv) };
        let mr = unsafe { std::slice::from_raw_parts_mut(lp.get().add(row0), rows) };
        let kh = &k[kvh * s * d..(kvh + 1) * s * d];
        let vh = &v[kvh * s * dv..(kvh + 1) * s * dv];
        let qh = &q[row0 * d..(row0 + rows) * d];
        math::vectorized(
            #[inline(always)]
            || forward_rows(dm, (b, h, i0), qh, kh, vh, mask, or, mr),
        );
    });
}

/// Rows `i0..i0 + m.len()` of head (b, h): `o` accumulates, `m` holds the running maximum
/// and finally the log-sum-exp.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn forward_rows(
    dm: &Dims,
    (b, h, i0): (usize, usize, usize),
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<Mask>,
    o: &mut [f32],
    m: &mut [f32],
) {
    let (d, dv) = (dm.d, dm.dv);
    let rows = m.len();
    let mut l = [0f32; ROWS];
    let mut p = [0f32; COLS];
    o.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    let end = dm.keys(i0 + rows - 1);
    let mut j0 = 0;
    while j0 < end {
        let j1 = (j0 + COLS).min(end);
        for r in 0..rows {
            let i = i0 + r;
            let je = j1.min(dm.keys(i));
            if je <= j0 {
                continue;
            }
            let qi = &q[r * d..(r + 1) * d];
            let mrow = mask.map(|mk| mk.row(b, h, i));
            let mut mx = m[r];
            for j in j0..je {
                let sc = score(dm, qi, &k[j * d..(j + 1) * d], mrow, j);
                p[j - j0] = sc;
                mx = mx.max(sc);
            }
            if mx == f32::NEG_INFINITY {
                continue; // every score so far is -inf
            }
            let alpha = if m[r] == f32::NEG_INFINITY {
                0.0
            } else {
                math::exp(m[r] - mx)
            };
            let orow = &mut o[r * dv..(r + 1) * dv];
            if alpha != 1.0 {
                l[r] *= alpha;
                orow.iter_mut().for_each(|x| *x *= alpha);
            }
            let mut sum = 0f32;
            for j in j0..je {
                let e = math::exp(p[j - j0] - mx);
                sum += e;
                axpy(e, &v[j * dv..(j + 1) * dv], orow);
            }
            l[r] += sum;
            m[r] = mx;
        }
        j0 = j1;
    }
    for r in 0..rows {
        let orow = &mut o[r * dv..(r + 1) * dv];
        if l[r] > 0.0 && m[r] != f32::NEG_INFINITY {
            let inv = 1.0 / l[r];
            orow.iter_mut().for_each(|x| *x *= inv);
            m[r] += l[r].ln();
        } else {
            orow.fill(0.0);
            m[r] = f32::NEG_INFINITY;
        }
    }
}

/// The backward: inputs (q, k, v, o, lse, do, mask?), outputs dq, dk, dv.
pub fn attention_grad(
    ins: &[TensorRef],
    scale: f64,
    causal: bool,
    outs: &mut [TensorMut],
    ws: &mut Workspace,
) -> Result<(), String> {
    let [dq, dk, dvo] = outs else {
        return Err("internal: the attention gradient has three outputs".into());
    };
    let (q, k, v, o, lse, dout) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4], &ins[5]);
    let mask = ins.get(6);
    let dm = Dims::of(q.shape, k.shape, v.shape, scale, causal)?;
    let lse = super::elem::typed::<f32>(lse)?;
    let [qs, ks, vs, os, gs, ms, rs, s1, s2, s3] = ws.f32s.take([
        stage_len(q.data),
        stage_len(k.data),
        stage_len(v.data),
        stage_len(o.data),
        stage_len(dout.data),
        mask.map_or(0, |m| stage_len(m.data)),
        lse.len(),
        out_stage_len(&dq.data),
        out_stage_len(&dk.data),
        out_stage_len(&dvo.data),
    ]);
    let (qv, kv, vv) = (floats(q.data, qs), floats(k.data, ks), floats(v.data, vs));
    let (ov, gv) = (floats(o.data, os), floats(dout.data, gs));
    let mask = mask.map(|m| Mask::of(floats(m.data, ms), m.shape));
    // D_i = dO_i . O_i
    let dvn = dm.dv;
    let drow = rs;
    {
        let dp = SendPtr(drow.as_mut_ptr());
        let n = drow.len();
        super::threads::for_each_range(n, 256, |a, e| {
            // SAFETY: the ranges are disjoint.
            let dr = unsafe { std::slice::from_raw_parts_mut(dp.get().add(a), e - a) };
            math::vectorized(
                #[inline(always)]
                || {
                    for (r, x) in dr.iter_mut().enumerate() {
                        let i = a + r;
                        *x = dot(&gv[i * dvn..(i + 1) * dvn], &ov[i * dvn..(i + 1) * dvn]);
                    }
                },
            );
        });
    }
    let drow: &[f32] = drow;
    let ctx = GradCtx {
        dm,
        q: qv,
        k: kv,
        v: vv,
        dout: gv,
        lse,
        drow,
        mask,
    };
    store_f32(&mut dq.data, s1, |dqv| grad_q(&ctx, dqv));
    store_f32(&mut dk.data, s2, |dkv| {
        store_f32(&mut dvo.data, s3, |dvv| grad_kv(&ctx, dkv, dvv))
    });
    Ok(())
}

struct GradCtx<'a> {
    dm: Dims,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    dout: &'a [f32],
    lse: &'a [f32],
    drow: &'a [f32],
    mask: Option<Mask<'a>>,
}

impl GradCtx<'_> {
    /// `(p_ij, ds_ij)` for the query row `row` (flat over B, Hq, T) of head (b, h) at
    /// position i and key `j` of key/value head `kvh` (flat over B, Hkv).
    #[inline(always)]
    fn p_ds(
        &self,
        (b, h, i, row): (usize, usize, usize, usize),
        kvh: usize,
        j: usize,
    ) -> (f32, f32) {
        let (d, dv, s) = (self.dm.d, self.dm.dv, self.dm.s);
        let l = self.lse[row];
        if l == f32::NEG_INFINITY {
            return (0.0, 0.0);
        }
        let qi = &self.q[row * d..(row + 1) * d];
        let kj = &self.k[(kvh * s + j) * d..(kvh * s + j + 1) * d];
        let mrow = self.mask.map(|mk| mk.row(b, h, i));
        let sc = score(&self.dm, qi, kj, mrow, j);
        let p = math::exp(sc - l);
        let vj = &self.v[(kvh * s + j) * dv..(kvh * s + j + 1) * dv];
        let dp = dot(&self.dout[row * dv..(row + 1) * dv], vj);
        (p, p * (dp - self.drow[row]))
    }
}

fn grad_q(c: &GradCtx, dq: &mut [f32]) {
    let dm = c.dm;
    let (t, d) = (dm.t, dm.d);
    let blocks = t.div_ceil(ROWS);
    let qp = SendPtr(dq.as_mut_ptr());
    for_each_index(dm.b * dm.hq * blocks, |task| {
        let (bh, blk) = (task / blocks, task % blocks);
        let (b, h) = (bh / dm.hq, bh % dm.hq);
        let kvh = b * dm.hkv + h / dm.group();
        let (i0, i1) = (blk * ROWS, ((blk + 1) * ROWS).min(t));
        // SAFETY: task (b, h, blk) alone writes rows i0..i1 of head (b, h).
        let out = unsafe {
            std::slice::from_raw_parts_mut(qp.get().add((bh * t + i0) * d), (i1 - i0) * d)
        };
        math::vectorized(
            #[inline(always)]
            || {
                out.fill(0.0);
                for i in i0..i1 {
                    let row = bh * t + i;
                    let dqi = &mut out[(i - i0) * d..(i - i0 + 1) * d];
                    for j in 0..dm.keys(i) {
                        let (_, ds) = c.p_ds((b, h, i, row), kvh, j);
                        if ds != 0.0 {
                            let kj = &c.k[(kvh * dm.s + j) * d..(kvh * dm.s + j + 1) * d];
                            axpy(dm.scale * ds, kj, dqi);
                        }
                    }
                }
            },
        );
    });
}

fn grad_kv(c: &GradCtx, dk: &mut [f32], dv: &mut [f32]) {
    let dm = c.dm;
    let (t, s, d, dvn) = (dm.t, dm.s, dm.d, dm.dv);
    let blocks = s.div_ceil(COLS);
    let (kp, vp) = (SendPtr(dk.as_mut_ptr()), SendPtr(dv.as_mut_ptr()));
    for_each_index(dm.b * dm.hkv * blocks, |task| {
        let (kvh, blk) = (task / blocks, task % blocks);
        let b = kvh / dm.hkv;
        let (j0, j1) = (blk * COLS, ((blk + 1) * COLS).min(s));
        let base = kvh * s + j0;
        // SAFETY: task (kvh, blk) alone writes keys j0..j1 of key/value head kvh.
        let (dkb, dvb) = unsafe {
            (
                std::slice::from_raw_parts_mut(kp.get().add(base * d), (j1 - j0) * d),
                std::slice::from_raw_parts_mut(vp.get().add(base * dvn), (j1 - j0) * dvn),
            )
        };
        math::vectorized(
            #[inline(always)]
            || {
                dkb.fill(0.0);
                dvb.fill(0.0);
                let g = dm.group();
                for h in (kvh % dm.hkv) * g..(kvh % dm.hkv + 1) * g {
                    // causal: query i sees key j iff j <= i
                    let first = if dm.causal { j0 } else { 0 };
                    for i in first..t {
                        let row = (b * dm.hq + h) * t + i;
                        let je = j1.min(dm.keys(i));
                        let qi = &c.q[row * d..(row + 1) * d];
                        let gi = &c.dout[row * dvn..(row + 1) * dvn];
                        for j in j0..je {
                            let (p, ds) = c.p_ds((b, h, i, row), kvh, j);
                            let r = j - j0;
                            if p != 0.0 {
                                axpy(p, gi, &mut dvb[r * dvn..(r + 1) * dvn]);
                            }
                            if ds != 0.0 {
                                axpy(dm.scale * ds, qi, &mut dkb[r * d..(r + 1) * d]);
                            }
                        }
                    }
                }
            },
        );
    });
}
