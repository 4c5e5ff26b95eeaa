//! ONNX's own attention ops: Attention (opset 23 semantics) and RotaryEmbedding.

use super::norm::safe_softmax;
use super::shape::reshape;
use super::*;

/// The default-domain ONNX ops of this family and their rules.
pub(super) const OPS: &[(&str, Rule)] = &[
    ("Attention", attention),
    ("RotaryEmbedding", rotary_embedding),
];

/// [B, S, H*D] -> [B, H, S, D].
pub(super) fn split_heads(
    cx: &mut Ctx,
    n: &NodeCx,
    x: Slot,
    heads: usize,
    what: &str,
) -> FResult<Slot> {
    let s = cx.shape(&x);
    if heads == 0 || !s[2].is_multiple_of(heads) {
        return err(format!(
            "{what} of shape {s:?} does not split into {heads} heads"
        ));
    }
    let x = reshape_tmp(cx, n, x, vec![s[0], s[1], heads, s[2] / heads], what)?;
    let t = tmp(cx, n, &format!("{what}_heads"));
    emit1(
        cx,
        &n.ir_name,
        Op::Transpose {
            perm: vec![0, 2, 1, 3],
        },
        &[x],
        t,
    )
}

/// An additive [q, kv] bias of 0 (attend) and -inf: key j is visible from query i when
/// `allowed(i, j)`.
pub(super) fn position_bias(q: usize, kv: usize, allowed: impl Fn(i64, i64) -> bool) -> Tensor {
    let mut v = Vec::with_capacity(q * kv);
    for i in 0..q as i64 {
        for j in 0..kv as i64 {
            v.push(if allowed(i, j) {
                0.0
            } else {
                f32::NEG_INFINITY
            });
        }
    }
    Tensor::f32(vec![q, kv], v)
}

/// Attention (opsets 23-25): scaled dot-product attention with grouped KV heads, a boolean
/// or additive mask (padded with "masked" up to the key length), causal and sliding-window
/// masks aligned to the end of a past cache, soft-capping, key padding by
/// `nonpad_kv_seqlen`, and a past cache (the present outputs are the concatenations). A row
/// with every key masked gives zeros. Written with MatMul, Softmax and elementwise ops.
pub(super) fn attention(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let (q, mut k, mut v, rank, dt, past_len) = attention_inputs(cx, n)?;
    let (qs, ks, vs) = (cx.shape(&q), cx.shape(&k), cx.shape(&v));
    let (batch, qh, tq, hd) = (qs[0], qs[1], qs[2], qs[3]);
    let (kvh, tk) = (ks[1], ks[2]);
    if vs[1] != kvh || vs[2] != tk || ks[3] != hd || kvh == 0 || qh % kvh != 0 {
        return err(format!(
            "Q {qs:?}, K {ks:?} and V {vs:?} (as [batch, heads, sequence, head size]) do not \
             fit together"
        ));
    }
    let mut outs: Outs = vec![None; n.n_outputs().max(1)];
    let wanted = |i: usize| n.p.output.get(i).is_some_and(|o| !o.is_empty());
    if wanted(1) {
        outs[1] = Some(k.clone());
    }
    if wanted(2) {
        outs[2] = Some(v.clone());
    }
    // Grouped KV heads: each KV head serves qh / kvh consecutive query heads.
    if qh != kvh {
        repeat_kv_heads(cx, n, [&mut k, &mut v], qh / kvh, qh)?;
    }
    let scale = match n.attr("scale") {
        Some(_) => n.attr_f("scale", 1.0)? as f64,
        None => 1.0 / (hd as f64).sqrt(),
    };
    let mut b = Builder {
        cx,
        n,
        name: &name,
        dt,
    };
    let kt = b.tmp(
        Op::Transpose {
            perm: vec![0, 1, 3, 2],
        },
        &[k],
        "key_t",
    )?;
    let qk = b.tmp(Op::MatMul, &[q, kt], "qk")?;
    let sc = b.k(scale);
    let mut scores = b.bin(BinaryOp::Mul, &qk, &sc, "scores")?;
    let raw_scores = scores.clone();
    let softcap = n.attr_f("softcap", 0.0)? as f64;
    if softcap > 0.0 {
        let c = b.k(softcap);
        let d = b.bin(BinaryOp::Div, &scores, &c, "capped_in")?;
        let t = b.un(UnaryOp::Tanh, &d, "capped_tanh")?;
        scores = b.bin(BinaryOp::Mul, &t, &c, "capped")?;
    }
    let (bias, runtime_mask) = attention_bias(&mut b, [batch, tq, tk], past_len)?;
    if let Some(bias) = &bias {
        scores = b.bin(BinaryOp::Add, &scores, bias, "masked_scores")?;
    }
    let fully_masked_row = runtime_mask || may_mask_a_whole_row(bias.as_ref());
    let t = tmp(b.cx, n, "probs");
    let probs = if fully_masked_row {
        safe_softmax(b.cx, n, scores, 3, t)?
    } else {
        emit1(b.cx, &name, Op::Softmax { axis: 3 }, &[scores], t)?
    };
    if wanted(3) {
        outs[3] = Some(match n.attr_i("qk_matmul_output_mode", 0)? {
            0 if softcap <= 0.0 => raw_scores,
            3 => probs.clone(),
            m => {
                return unsupported(format!(
                    "Attention's qk_matmul_output with qk_matmul_output_mode {m} is not \
                     supported (hzp gives mode 0 without softcap, and mode 3)"
                ))
            }
        });
    }
    let y = if rank == 4 {
        let out = out_name(b.cx, n, 0);
        emit1(b.cx, &name, Op::MatMul, &[probs, v], out)?
    } else {
        let y = b.tmp(Op::MatMul, &[probs, v], "heads_out")?;
        let y = b.tmp(
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            &[y],
            "heads_last",
        )?;
        let dv = b.cx.shape(&y)[3];
        let out = out_name(b.cx, n, 0);
        emit1(
            b.cx,
            &name,
            Op::Reshape {
                shape: vec![batch, tq, qh * dv],
            },
            &[y],
            out,
        )?
    };
    outs[0] = Some(y);
    Ok(outs)
}

/// Attention's Q, K and V as [batch, heads, sequence, head size] (3-D inputs split into
/// `q_num_heads` / `kv_num_heads` heads; a past cache concatenated before K and V), with
/// the inputs' rank, dtype and the past length.
#[allow(clippy::type_complexity)]
fn attention_inputs(cx: &mut Ctx, n: &NodeCx) -> FResult<(Slot, Slot, Slot, usize, DType, usize)> {
    let name = n.ir_name.clone();
    let (mut q, mut k, mut v) = (n.req(0)?.clone(), n.req(1)?.clone(), n.req(2)?.clone());
    let rank = cx.shape(&q).len();
    if !(rank == 3 || rank == 4) || cx.shape(&k).len() != rank || cx.shape(&v).len() != rank {
        return err(format!(
            "Q, K and V must all be rank 3 or all rank 4, got {:?}, {:?}, {:?}",
            cx.shape(&q),
            cx.shape(&k),
            cx.shape(&v)
        ));
    }
    let dt = cx.dtype(&q);
    if !dt.is_float() {
        return err(format!("Attention needs float inputs, got {dt}"));
    }
    if rank == 3 {
        let heads = |a: &str| -> FResult<usize> {
            let h = n.attr_i(a, 0)?;
            usize::try_from(h)
                .ok()
                .filter(|&h| h > 0)
                .ok_or_else(|| node_err(format!("3-D inputs need a positive `{a}`, got {h}")))
        };
        let (qh, kvh) = (heads("q_num_heads")?, heads("kv_num_heads")?);
        q = split_heads(cx, n, q, qh, "q")?;
        k = split_heads(cx, n, k, kvh, "k")?;
        v = split_heads(cx, n, v, kvh, "v")?;
    }
    let mut past_len = 0usize;
    match (n.input(4).cloned(), n.input(5).cloned()) {
        (Some(pk), Some(pv)) => {
            if n.input(6).is_some() {
                return err("nonpad_kv_seqlen cannot be combined with a past cache");
            }
            past_len = cx.shape(&pk).get(2).copied().unwrap_or(0);
            let t = tmp(cx, n, "key");
            k = emit1(cx, &name, Op::Concat { axis: 2 }, &[pk, k], t)?;
            let t = tmp(cx, n, "value");
            v = emit1(cx, &name, Op::Concat { axis: 2 }, &[pv, v], t)?;
        }
        (None, None) => {}
        _ => return err("past_key and past_value must be given together"),
    }
    Ok((q, k, v, rank, dt, past_len))
}

/// Repeats each of `kv`'s heads `r` times (consecutive query heads share a KV head), to
/// `qh` heads.
fn repeat_kv_heads(
    cx: &mut Ctx,
    n: &NodeCx,
    kv: [&mut Slot; 2],
    r: usize,
    qh: usize,
) -> FResult<()> {
    let name = n.ir_name.clone();
    let [k, v] = kv;
    for (x, what) in [(k, "key"), (v, "value")] {
        let s = cx.shape(x);
        let t = reshape_tmp(
            cx,
            n,
            x.clone(),
            vec![s[0], s[1], 1, s[2], s[3]],
            &format!("{what}_groups"),
        )?;
        let e = tmp(cx, n, &format!("{what}_repeated"));
        let t = emit1(
            cx,
            &name,
            Op::Expand {
                shape: vec![s[0], s[1], r, s[2], s[3]],
            },
            &[t],
            e,
        )?;
        *x = reshape_tmp(
            cx,
            n,
            t,
            vec![s[0], qh, s[2], s[3]],
            &format!("{what}_per_head"),
        )?;
    }
    Ok(())
}

/// The additive bias on the scores (`[batch, tq, tk]`: batch, queries, keys; `past_len`
/// keys precede the queries): the attention mask (boolean or additive, padded with -inf to
/// the keys), the causal mask, the sliding window, the padding of `nonpad_kv_seqlen`; and
/// whether any of it is known only at run time.
fn attention_bias(
    b: &mut Builder,
    [batch, tq, tk]: [usize; 3],
    past_len: usize,
) -> FResult<(Option<Slot>, bool)> {
    let (n, dt) = (b.n, b.dt);
    let name = b.name.to_string();
    let ninf = b.k(f64::NEG_INFINITY);
    let zero = b.k(0.0);
    let mut bias: Option<Slot> = None;
    let mut runtime_mask = false;
    if let Some(mask) = n.input(3).cloned() {
        runtime_mask |= mask.as_const().is_none();
        let mut m = if b.cx.dtype(&mask) == DType::Bool {
            b.tmp(Op::Where, &[mask, zero.clone(), ninf.clone()], "mask_bias")?
        } else if b.cx.dtype(&mask) != dt {
            b.tmp(Op::Cast { to: dt }, &[mask], "mask_bias")?
        } else {
            mask
        };
        let ms = b.cx.shape(&m);
        let last = ms.last().copied().unwrap_or(0);
        if ms.is_empty() || last > tk {
            return err(format!(
                "attn_mask of shape {ms:?} is longer than the {tk} keys"
            ));
        }
        if last < tk {
            let mut ps = ms.clone();
            *ps.last_mut().unwrap_or(&mut 0) = tk - last;
            let t = tmp(b.cx, n, "mask_pad");
            let pad = b.cx.fill(&name, f64::NEG_INFINITY, dt, ps, t)?;
            let axis = ms.len() - 1;
            m = b.tmp(Op::Concat { axis }, &[m, pad], "mask_padded")?;
        }
        bias = Some(m);
    }
    let offset = past_len as i64;
    let mut add_bias = |b: &mut Builder, t: Slot, what: &str| -> FResult<()> {
        bias = Some(match bias.take() {
            None => t,
            Some(prev) => b.bin(BinaryOp::Add, &prev, &t, what)?,
        });
        Ok(())
    };
    if n.attr_i("is_causal", 0)? != 0 {
        if n.input(6).is_some() {
            return unsupported(
                "Attention with is_causal and nonpad_kv_seqlen (a static KV cache) is not \
                 supported",
            );
        }
        let t = position_bias(tq, tk, |i, j| j <= i + offset);
        let c = b.cx.konst(t, &format!("{name}/causal"));
        add_bias(b, c, "causal_bias")?;
    }
    let (left, right) = (
        n.attr_i("left_window_size", -1)?,
        n.attr_i("right_window_size", -1)?,
    );
    if left >= 0 || right >= 0 {
        if n.input(6).is_some() {
            return unsupported(
                "Attention with a sliding window and nonpad_kv_seqlen is not supported",
            );
        }
        let t = position_bias(tq, tk, |i, j| {
            let d = i + offset - j;
            (left < 0 || d <= left) && (right < 0 || -d <= right)
        });
        let c = b.cx.konst(t, &format!("{name}/window"));
        add_bias(b, c, "window_bias")?;
    }
    if let Some(lens) = n.input(6).cloned() {
        runtime_mask |= lens.as_const().is_none();
        let pos = Tensor::i64(vec![1, tk], (0..tk as i64).collect());
        let pos = b.cx.konst(pos, &format!("{name}/key_positions"));
        let lens = reshape_tmp(b.cx, n, lens, vec![batch, 1], "kv_lengths")?;
        let lens = if b.cx.dtype(&lens) == DType::I64 {
            lens
        } else {
            b.tmp(Op::Cast { to: DType::I64 }, &[lens], "kv_lengths_i64")?
        };
        let valid = b.bin(BinaryOp::Less, &pos, &lens, "key_valid")?;
        let valid = reshape_tmp(b.cx, n, valid, vec![batch, 1, 1, tk], "key_valid_4d")?;
        let t = b.tmp(
            Op::Where,
            &[valid, zero.clone(), ninf.clone()],
            "padding_bias",
        )?;
        add_bias(b, t, "bias")?;
    }
    Ok((bias, runtime_mask))
}

/// Whether a constant bias has a row that is all -inf, or the bias is computed (either may
/// leave a row with no key).
fn may_mask_a_whole_row(bias: Option<&Slot>) -> bool {
    bias.and_then(|s| s.as_const()).is_some_and(|t| {
        let s = t.shape.clone();
        let last = s.last().copied().unwrap_or(1).max(1);
        t.to_f64_vec()
            .chunks(last)
            .any(|row| row.iter().all(|&x| x == f64::NEG_INFINITY))
    }) || bias.is_some_and(|s| s.as_const().is_none())
}

/// RotaryEmbedding (opset 23): rotates the first `rotary_embedding_dim` (default all) dims
/// of each head by the cos/sin caches, taken at `position_ids` when given (else the caches
/// are per position already), in halves or interleaved pairs.
pub(super) fn rotary_embedding(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let x = n.req(0)?.clone();
    let (mut cos, mut sin) = (n.req(1)?.clone(), n.req(2)?.clone());
    let xs = cx.shape(&x);
    let dt = cx.dtype(&x);
    // As [B, S, H, D].
    let x4 = match xs.len() {
        4 => {
            let t = tmp(cx, n, "seq_major");
            emit1(
                cx,
                &name,
                Op::Transpose {
                    perm: vec![0, 2, 1, 3],
                },
                &[x],
                t,
            )?
        }
        3 => {
            let h = n.attr_i("num_heads", 0)?;
            let h = usize::try_from(h)
                .ok()
                .filter(|&h| h > 0 && xs[2].is_multiple_of(h))
                .ok_or_else(|| {
                    node_err(format!(
                        "a 3-D input {xs:?} needs `num_heads` dividing its last dim, got {h}"
                    ))
                })?;
            reshape_tmp(cx, n, x, vec![xs[0], xs[1], h, xs[2] / h], "heads")?
        }
        r => return err(format!("the input must have rank 3 or 4, got rank {r}")),
    };
    let s4 = cx.shape(&x4);
    let (bsz, seq, heads, hd) = (s4[0], s4[1], s4[2], s4[3]);
    let rd = match n.attr_i("rotary_embedding_dim", 0)? {
        0 => hd,
        d => usize::try_from(d)
            .ok()
            .filter(|&d| d <= hd && d % 2 == 0)
            .ok_or_else(|| node_err(format!("rotary_embedding_dim {d} does not fit {hd}")))?,
    };
    let half = rd / 2;
    if let Some(pos) = n.input(3).cloned() {
        let t = tmp(cx, n, "cos");
        cos = emit1(cx, &name, Op::Gather { axis: 0 }, &[cos, pos.clone()], t)?;
        let t = tmp(cx, n, "sin");
        sin = emit1(cx, &name, Op::Gather { axis: 0 }, &[sin, pos], t)?;
    }
    for c in [&cos, &sin] {
        let cs = cx.shape(c);
        if cs.len() != 3 || cs[2] != half {
            return err(format!(
                "the cos/sin caches give {cs:?} per token, expected [batch, sequence, {half}]"
            ));
        }
    }
    let (cs, ss) = (cx.shape(&cos), cx.shape(&sin));
    cos = reshape_tmp(cx, n, cos, vec![cs[0], cs[1], 1, half], "cos_4d")?;
    sin = reshape_tmp(cx, n, sin, vec![ss[0], ss[1], 1, half], "sin_4d")?;
    let slice = |cx: &mut Ctx, x: &Slot, st: usize, en: usize, step: i64, what: &str| {
        let t = tmp(cx, n, what);
        let op = Op::Slice {
            axes: vec![3],
            starts: vec![st as i64],
            ends: vec![en as i64],
            steps: vec![step],
        };
        emit1(cx, &name, op, std::slice::from_ref(x), t)
    };
    let rot = if rd == hd {
        x4.clone()
    } else {
        slice(cx, &x4, 0, rd, 1, "rotated_part")?
    };
    let interleaved = n.attr_i("interleaved", 0)? != 0;
    let (x1, x2) = if interleaved {
        (
            slice(cx, &rot, 0, rd, 2, "even")?,
            slice(cx, &rot, 1, rd, 2, "odd")?,
        )
    } else {
        (
            slice(cx, &rot, 0, half, 1, "first_half")?,
            slice(cx, &rot, half, rd, 1, "second_half")?,
        )
    };
    let mut b = Builder {
        cx,
        n,
        name: &name,
        dt,
    };
    let c1 = b.bin(BinaryOp::Mul, &cos, &x1, "cos_x1")?;
    let s2 = b.bin(BinaryOp::Mul, &sin, &x2, "sin_x2")?;
    let real = b.bin(BinaryOp::Sub, &c1, &s2, "real")?;
    let s1 = b.bin(BinaryOp::Mul, &sin, &x1, "sin_x1")?;
    let c2 = b.bin(BinaryOp::Mul, &cos, &x2, "cos_x2")?;
    let imag = b.bin(BinaryOp::Add, &s1, &c2, "imag")?;
    let rotated = if interleaved {
        let pair = vec![bsz, seq, heads, half, 1];
        let r = reshape_tmp(b.cx, n, real, pair.clone(), "real_pair")?;
        let i = reshape_tmp(b.cx, n, imag, pair, "imag_pair")?;
        let p = b.tmp(Op::Concat { axis: 4 }, &[r, i], "pairs")?;
        reshape_tmp(b.cx, n, p, vec![bsz, seq, heads, rd], "rotated")?
    } else {
        b.tmp(Op::Concat { axis: 3 }, &[real, imag], "rotated")?
    };
    let y = if rd == hd {
        rotated
    } else {
        let rest = slice(b.cx, &x4, rd, hd, 1, "passed_part")?;
        b.tmp(Op::Concat { axis: 3 }, &[rotated, rest], "joined")?
    };
    if xs.len() == 4 {
        one(b.last(
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            &[y],
        )?)
    } else {
        reshape(b.cx, n, y, xs)
    }
}
