//! Fused scaled dot-product attention ([`hzp_ir::Op::Attention`] and its gradient), tiled
//! as FlashAttention-2 does it: no score or probability matrix is ever stored.
//!
//! Forward: per (batch, query head, block of [`ROWS`] queries), keys in blocks of
//! [`COLS`]: the block's scores `scale Q Kᵀ` (one gemm), mask and causal cut added, then
//! per row the running maximum and sum of exponentials are updated and the output rows,
//! accumulated in the output itself, rescaled when the maximum grows (online softmax),
//! before `O += P V` (a second gemm). The result is the output and each row's log-sum-exp.
//! Scratch is one ROWS x COLS block on the stack per task: O(block), not O(T x S).
//!
//! Backward: `D_i = dO_i . O_i` per row, then per (query block, key block) the
//! probabilities are recomputed from the saved log-sum-exp, `P = exp(S - lse)`, with
//! `dP = dO Vᵀ` and `dS = P (dP - D)`, twice: once per block of query rows for `dQ +=
//! scale dS K`, and once per block of keys of a key/value head for `dV += Pᵀ dO` and
//! `dK += scale dSᵀ Q`, summed over every query head of its group and every query block.
//! Each output row has one owner task, so there are no atomics and the sums have one order.
//!
//! Determinism: the block products go through the `gemm` crate (single-threaded inside a
//! task, its kernel chosen by the CPU as for `MatMul`, whatever `HZP_SIMD` says), the
//! rest is elementwise with `exp` = [`math::exp`] (fused multiply-adds at every level) and
//! `D_i`'s dot products in a fixed order, so every vector level gives the same bits
//! (`runtime/tests/simd_levels.rs`).
//!
//! A row whose every score is -inf (a fully masked row) yields zeros with `lse = -inf` and
//! no gradient: PyTorch's convention for SDPA (its "safe" softmax), which the importer
//! keeps for explicit attention too. A causal row always sees key 0 (top-left aligned).

use super::elem::{floats, out_stage_len, stage_len, store_f32};
use super::into::{TensorMut, TensorRef, Workspace};
use super::math;
use super::matmul::gemm_block;
use super::threads::{for_each_index, SendPtr};

/// Query rows per task and per block of the backward.
const ROWS: usize = 64;
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

/// `S[r][c] = scale q_{i0+r} . k_{j0+c}` + mask, -inf after the query when causal: the
/// block's scores, `rows x cols` at row stride `cols`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn scores(
    dm: &Dims,
    (b, h, i0, j0): (usize, usize, usize, usize),
    (rows, cols): (usize, usize),
    q: &[f32],
    k: &[f32],
    mask: Option<Mask>,
    sc: &mut [f32],
) {
    let d = dm.d;
    // SAFETY: q holds `rows` rows of d from i0 (the caller's slice), k the keys j0..j0+cols
    // of this head; sc holds rows * cols.
    unsafe {
        gemm_block(
            (rows, cols, d),
            q.as_ptr(),
            (d as isize, 1),
            k[j0 * d..].as_ptr(),
            (1, d as isize),
            sc.as_mut_ptr(),
            cols,
            false,
            dm.scale,
        );
    }
    for r in 0..rows {
        let i = i0 + r;
        let row = &mut sc[r * cols..(r + 1) * cols];
        if let Some(mk) = mask {
            let (m, sj) = mk.row(b, h, i);
            for (c, x) in row.iter_mut().enumerate() {
                *x += m[(j0 + c) * sj];
            }
        }
        if dm.causal && j0 + cols > i + 1 {
            let from = (i + 1).saturating_sub(j0);
            row[from..].fill(f32::NEG_INFINITY);
        }
    }
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
    let dv = dm.dv;
    let rows = m.len();
    let mut l = [0f32; ROWS];
    let mut sc = [0f32; ROWS * COLS];
    o.fill(0.0);
    m.fill(f32::NEG_INFINITY);
    let end = dm.keys(i0 + rows - 1);
    let mut j0 = 0;
    while j0 < end {
        let cols = (end - j0).min(COLS);
        let sc = &mut sc[..rows * cols];
        scores(dm, (b, h, i0, j0), (rows, cols), q, k, mask, sc);
        for r in 0..rows {
            let row = &mut sc[r * cols..(r + 1) * cols];
            let mx = row.iter().fold(m[r], |a, &x| a.max(x));
            if mx == f32::NEG_INFINITY {
                row.fill(0.0); // every score so far is -inf
                continue;
            }
            let alpha = if m[r] == f32::NEG_INFINITY {
                0.0
            } else {
                math::exp(m[r] - mx)
            };
            if alpha != 1.0 {
                l[r] *= alpha;
                o[r * dv..(r + 1) * dv].iter_mut().for_each(|x| *x *= alpha);
            }
            let mut sum = 0f32;
            for x in row.iter_mut() {
                *x = math::exp(*x - mx);
                sum += *x;
            }
            l[r] += sum;
            m[r] = mx;
        }
        // o += P V
        // SAFETY: sc is rows x cols, v holds keys j0..j0+cols of dv, o is rows x dv.
        unsafe {
            gemm_block(
                (rows, dv, cols),
                sc.as_ptr(),
                (cols as isize, 1),
                v[j0 * dv..].as_ptr(),
                (dv as isize, 1),
                o.as_mut_ptr(),
                dv,
                true,
                1.0,
            );
        }
        j0 += cols;
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
    /// For query rows i0..i0+rows of head (b, h) (flat row `row0` = first of them) against
    /// keys j0..j0+cols of key/value head `kvh`: `p` (in `sc`) and `ds = p (dP - D)` (in
    /// `dp`), both rows x cols.
    #[inline(always)]
    fn p_ds(
        &self,
        (b, h, i0, row0): (usize, usize, usize, usize),
        (kvh, j0): (usize, usize),
        (rows, cols): (usize, usize),
        sc: &mut [f32],
        dp: &mut [f32],
    ) {
        let dm = &self.dm;
        let (d, dv, s) = (dm.d, dm.dv, dm.s);
        let q = &self.q[row0 * d..(row0 + rows) * d];
        let k = &self.k[kvh * s * d..(kvh + 1) * s * d];
        let v = &self.v[kvh * s * dv..(kvh + 1) * s * dv];
        scores(dm, (b, h, i0, j0), (rows, cols), q, k, self.mask, sc);
        // dP = dO V^T
        // SAFETY: dO rows row0.. of dv, keys j0..j0+cols of v, dp rows x cols.
        unsafe {
            gemm_block(
                (rows, cols, dv),
                self.dout[row0 * dv..].as_ptr(),
                (dv as isize, 1),
                v[j0 * dv..].as_ptr(),
                (1, dv as isize),
                dp.as_mut_ptr(),
                cols,
                false,
                1.0,
            );
        }
        for r in 0..rows {
            let l = self.lse[row0 + r];
            let dsum = self.drow[row0 + r];
            let pr = &mut sc[r * cols..(r + 1) * cols];
            let dr = &mut dp[r * cols..(r + 1) * cols];
            if l == f32::NEG_INFINITY {
                pr.fill(0.0);
                dr.fill(0.0);
                continue;
            }
            for (p, g) in pr.iter_mut().zip(dr.iter_mut()) {
                *p = math::exp(*p - l);
                *g = *p * (*g - dsum);
            }
        }
    }
}

fn grad_q(c: &GradCtx, dq: &mut [f32]) {
    let dm = c.dm;
    let (t, s, d) = (dm.t, dm.s, dm.d);
    let blocks = t.div_ceil(ROWS);
    let qp = SendPtr(dq.as_mut_ptr());
    for_each_index(dm.b * dm.hq * blocks, |task| {
        let (bh, blk) = (task / blocks, task % blocks);
        let (b, h) = (bh / dm.hq, bh % dm.hq);
        let kvh = b * dm.hkv + h / dm.group();
        let (i0, i1) = (blk * ROWS, ((blk + 1) * ROWS).min(t));
        let rows = i1 - i0;
        let row0 = bh * t + i0;
        // SAFETY: task (b, h, blk) alone writes rows i0..i1 of head (b, h).
        let out = unsafe { std::slice::from_raw_parts_mut(qp.get().add(row0 * d), rows * d) };
        let k = &c.k[kvh * s * d..(kvh + 1) * s * d];
        math::vectorized(
            #[inline(always)]
            || {
                let mut sc = [0f32; ROWS * COLS];
                let mut dp = [0f32; ROWS * COLS];
                out.fill(0.0);
                let end = dm.keys(i1 - 1);
                let mut j0 = 0;
                while j0 < end {
                    let cols = (end - j0).min(COLS);
                    let (sc, dp) = (&mut sc[..rows * cols], &mut dp[..rows * cols]);
                    c.p_ds((b, h, i0, row0), (kvh, j0), (rows, cols), sc, dp);
                    // dQ += scale dS K
                    // SAFETY: dp rows x cols, keys j0..j0+cols of d, out rows x d.
                    unsafe {
                        gemm_block(
                            (rows, d, cols),
                            dp.as_ptr(),
                            (cols as isize, 1),
                            k[j0 * d..].as_ptr(),
                            (d as isize, 1),
                            out.as_mut_ptr(),
                            d,
                            true,
                            dm.scale,
                        );
                    }
                    j0 += cols;
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
        let cols = j1 - j0;
        let base = kvh * s + j0;
        // SAFETY: task (kvh, blk) alone writes keys j0..j1 of key/value head kvh.
        let (dkb, dvb) = unsafe {
            (
                std::slice::from_raw_parts_mut(kp.get().add(base * d), cols * d),
                std::slice::from_raw_parts_mut(vp.get().add(base * dvn), cols * dvn),
            )
        };
        math::vectorized(
            #[inline(always)]
            || {
                let mut sc = [0f32; ROWS * COLS];
                let mut dp = [0f32; ROWS * COLS];
                dkb.fill(0.0);
                dvb.fill(0.0);
                let g = dm.group();
                // causal: queries before j0 see none of these keys
                let first = if dm.causal { j0 / ROWS * ROWS } else { 0 };
                for h in (kvh % dm.hkv) * g..(kvh % dm.hkv + 1) * g {
                    let mut i0 = first;
                    while i0 < t {
                        let rows = (t - i0).min(ROWS);
                        let row0 = (b * dm.hq + h) * t + i0;
                        let (sc, dp) = (&mut sc[..rows * cols], &mut dp[..rows * cols]);
                        c.p_ds((b, h, i0, row0), (kvh, j0), (rows, cols), sc, dp);
                        // dV += P^T dO, dK += scale dS^T Q
                        // SAFETY: sc and dp are rows x cols (read transposed), dO and q
                        // hold rows row0..row0+rows, dvb and dkb are cols x dv / cols x d.
                        unsafe {
                            gemm_block(
                                (cols, dvn, rows),
                                sc.as_ptr(),
                                (1, cols as isize),
                                c.dout[row0 * dvn..].as_ptr(),
                                (dvn as isize, 1),
                                dvb.as_mut_ptr(),
                                dvn,
                                true,
                                1.0,
                            );
                            gemm_block(
                                (cols, d, rows),
                                dp.as_ptr(),
                                (1, cols as isize),
                                c.q[row0 * d..].as_ptr(),
                                (d as isize, 1),
                                dkb.as_mut_ptr(),
                                d,
                                true,
                                dm.scale,
                            );
                        }
                        i0 += rows;
                    }
                }
            },
        );
    });
}
