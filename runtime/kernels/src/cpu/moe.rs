//! Mixture of experts with static shapes: [`Op::MoeDispatch`] (tokens copied into
//! per-expert buffers of a fixed capacity), [`Op::MoeCombine`] (the weighted sum back) and
//! [`Op::MoeCombineGrad`]. The drop rule lives in [`assign_slots`] and nowhere else.
//!
//! [`Op::MoeDispatch`]: hzp_ir::Op::MoeDispatch
//! [`Op::MoeCombine`]: hzp_ir::Op::MoeCombine
//! [`Op::MoeCombineGrad`]: hzp_ir::Op::MoeCombineGrad

use super::elem::{floats, out_stage_len, stage_len, store_f32, typed, typed_mut, Elem};
use super::index::Ids;
use super::into::{DataMut, TensorMut, TensorRef, Workspace};

/// Each choice's row in its expert's buffer, or -1 when the expert is already full: the
/// GShard rule. Choices are taken by priority (column `j` of `choices` for every token
/// before column `j + 1`), tokens in order within a priority, and an expert takes the
/// first `capacity` that reach it. `fill` (`experts` long) is scratch. The rule does not
/// depend on how many ranks run the program: it reads the whole `[T,K]` table.
pub fn assign_slots(
    choices: &TensorRef,
    experts: usize,
    capacity: usize,
    slots: &mut [i64],
    fill: &mut [usize],
) -> Result<(), String> {
    let ids = Ids::of(choices)?;
    let (t, k) = (choices.shape[0], choices.shape[1]);
    fill.fill(0);
    for j in 0..k {
        for tok in 0..t {
            let at = tok * k + j;
            let e = expert_of(ids, at, experts, "MoeDispatch")?;
            slots[at] = if fill[e] < capacity {
                fill[e] += 1;
                (fill[e] - 1) as i64
            } else {
                -1
            };
        }
    }
    Ok(())
}

/// The expert of choice `at`, checked against the expert count.
fn expert_of(ids: Ids, at: usize, experts: usize, op: &str) -> Result<usize, String> {
    let e = ids.get(at);
    if e < 0 || e >= experts as i64 {
        return Err(format!(
            "{op}: expert index {e} (choice {at}) is outside 0..{experts}"
        ));
    }
    Ok(e as usize)
}

/// `[T,H]` tokens into `[experts, capacity, H]` and the `[T,K]` slots.
pub fn dispatch<T: Elem>(
    x: &TensorRef,
    choices: &TensorRef,
    (experts, capacity): (usize, usize),
    outs: &mut [TensorMut],
    ws: &mut Workspace,
) -> Result<(), String> {
    let [buf, slots] = outs else {
        return Err("internal: MoeDispatch has two outputs".into());
    };
    let (t, h) = (x.shape[0], x.shape[1]);
    let k = choices.shape[1];
    let slots = typed_mut::<i64>(&mut slots.data)?;
    let [fill] = ws.usizes.take([experts]);
    assign_slots(choices, experts, capacity, slots, fill)?;
    let ids = Ids::of(choices)?;
    let src = typed::<T>(x)?;
    let dst = typed_mut::<T>(&mut buf.data)?;
    dst.fill(T::default());
    for tok in 0..t {
        for j in 0..k {
            let at = tok * k + j;
            if let Ok(s) = usize::try_from(slots[at]) {
                let e = expert_of(ids, at, experts, "MoeDispatch")?;
                let row = (e * capacity + s) * h;
                dst[row..row + h].copy_from_slice(&src[tok * h..tok * h + h]);
            }
        }
    }
    Ok(())
}

/// The rows of `[E,C,H]` that choice `at` reads: `None` when it was dropped.
fn row_of(
    ids: Ids,
    slots: &[i64],
    at: usize,
    (experts, capacity, h): (usize, usize, usize),
    op: &str,
) -> Result<Option<usize>, String> {
    let s = slots[at];
    if s == -1 {
        return Ok(None);
    }
    if s < 0 || s >= capacity as i64 {
        return Err(format!(
            "{op}: slot {s} (choice {at}) is outside the capacity {capacity} (or -1 for a dropped choice)"
        ));
    }
    let e = expert_of(ids, at, experts, op)?;
    Ok(Some((e * capacity + s as usize) * h))
}

/// (expert_out, choices, slots, weights) -> `[T,H]`, in f32 (bf16/f16 widened, the result
/// rounded once).
pub fn combine(ins: &[TensorRef], out: &mut DataMut, ws: &mut Workspace) -> Result<(), String> {
    let [ye, choices, slots, w] = ins else {
        return Err("internal: MoeCombine takes 4 inputs".into());
    };
    let dims = (ye.shape[0], ye.shape[1], ye.shape[2]);
    let h = dims.2;
    let (t, k) = (choices.shape[0], choices.shape[1]);
    let ids = Ids::of(choices)?;
    let slots = typed::<i64>(slots)?;
    let [ye_buf, w_buf, o_buf] =
        ws.f32s
            .take([stage_len(ye.data), stage_len(w.data), out_stage_len(out)]);
    let ye = floats(ye.data, ye_buf);
    let w = floats(w.data, w_buf);
    store_f32(out, o_buf, |o| {
        o.fill(0.0);
        for tok in 0..t {
            let y = &mut o[tok * h..tok * h + h];
            for j in 0..k {
                let at = tok * k + j;
                if let Some(row) = row_of(ids, slots, at, dims, "MoeCombine")? {
                    let wt = w[at];
                    for (y, &v) in y.iter_mut().zip(&ye[row..row + h]) {
                        *y += wt * v;
                    }
                }
            }
        }
        Ok(())
    })
}

/// (expert_out, choices, slots, weights, dy) -> (d_expert_out, d_weights), in f32.
pub fn combine_grad(
    ins: &[TensorRef],
    outs: &mut [TensorMut],
    ws: &mut Workspace,
) -> Result<(), String> {
    let [ye, choices, slots, w, dy] = ins else {
        return Err("internal: MoeCombineGrad takes 5 inputs".into());
    };
    let [dye, dw] = outs else {
        return Err("internal: MoeCombineGrad has two outputs".into());
    };
    let dims = (ye.shape[0], ye.shape[1], ye.shape[2]);
    let h = dims.2;
    let (t, k) = (choices.shape[0], choices.shape[1]);
    let ids = Ids::of(choices)?;
    let slots = typed::<i64>(slots)?;
    let [ye_buf, w_buf, dy_buf, dye_buf, dw_buf] = ws.f32s.take([
        stage_len(ye.data),
        stage_len(w.data),
        stage_len(dy.data),
        out_stage_len(&dye.data),
        out_stage_len(&dw.data),
    ]);
    let ye = floats(ye.data, ye_buf);
    let w = floats(w.data, w_buf);
    let dy = floats(dy.data, dy_buf);
    store_f32(&mut dye.data, dye_buf, |dye| {
        store_f32(&mut dw.data, dw_buf, |dw| {
            dye.fill(0.0);
            for tok in 0..t {
                let g = &dy[tok * h..tok * h + h];
                for j in 0..k {
                    let at = tok * k + j;
                    let Some(row) = row_of(ids, slots, at, dims, "MoeCombineGrad")? else {
                        dw[at] = 0.0;
                        continue;
                    };
                    let wt = w[at];
                    let mut dot = 0.0f32;
                    for ((d, &v), &gy) in dye[row..row + h].iter_mut().zip(&ye[row..row + h]).zip(g)
                    {
                        *d += wt * gy;
                        dot += gy * v;
                    }
                    dw[at] = dot;
                }
            }
            Ok(())
        })
    })
}

#[cfg(test)]
mod tests {
    use crate::cpu::eval_op;
    use hzp_ir::{Op, Tensor};

    /// Deterministic pseudo-random numbers in [0, 1).
    fn uniform(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 11) as f64 / (1u64 << 53) as f64
            })
            .collect()
    }

    /// Distinct expert choices per token, like a top-k: `[t, k]`.
    fn choices(t: usize, k: usize, experts: usize, seed: u64) -> Vec<i64> {
        let r = uniform(t * experts, seed);
        let mut out = Vec::new();
        for tok in 0..t {
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by(|&a, &b| r[tok * experts + b].total_cmp(&r[tok * experts + a]));
            out.extend(order[..k].iter().map(|&e| e as i64));
        }
        out
    }

    /// The drop rule written as plainly as possible: walk the choices by priority, then
    /// token, and count per expert.
    fn reference_slots(ch: &[i64], t: usize, k: usize, experts: usize, cap: usize) -> Vec<i64> {
        let mut taken = vec![0usize; experts];
        let mut slots = vec![0i64; t * k];
        for priority in 0..k {
            for token in 0..t {
                let e = ch[token * k + priority] as usize;
                if taken[e] < cap {
                    slots[token * k + priority] = taken[e] as i64;
                    taken[e] += 1;
                } else {
                    slots[token * k + priority] = -1;
                }
            }
        }
        slots
    }

    #[test]
    fn dispatch_follows_the_priority_drop_rule() {
        let (h, experts) = (3, 4);
        let mut dropped_some = false;
        for (t, k, cap, seed) in [
            (7, 2, 2, 1),
            (9, 3, 4, 2),
            (5, 1, 1, 3),
            (8, 2, 8, 4),
            (6, 4, 3, 5),
        ] {
            let ch = choices(t, k, experts, seed);
            let x: Vec<f32> = (0..t * h).map(|i| i as f32 + 1.0).collect();
            let outs = eval_op(
                &Op::MoeDispatch {
                    experts,
                    capacity: cap,
                },
                &[
                    &Tensor::f32(vec![t, h], x.clone()),
                    &Tensor::i64(vec![t, k], ch.clone()),
                ],
            )
            .unwrap();
            let want = reference_slots(&ch, t, k, experts, cap);
            let got: Vec<i64> = outs[1].to_f64_vec().iter().map(|&v| v as i64).collect();
            assert_eq!(got, want, "t={t} k={k} capacity={cap}");
            dropped_some |= want.contains(&-1);
            // every kept choice's row holds its token; every other row is zero
            let buf = outs[0].to_f32_vec();
            let mut expect = vec![0.0f32; experts * cap * h];
            for (at, &s) in want.iter().enumerate() {
                if s >= 0 {
                    let row = (ch[at] as usize * cap + s as usize) * h;
                    let tok = at / k;
                    expect[row..row + h].copy_from_slice(&x[tok * h..tok * h + h]);
                }
            }
            assert_eq!(buf, expect, "t={t} k={k} capacity={cap}");
        }
        assert!(dropped_some, "the cases must exercise drops");
    }

    #[test]
    fn combine_sums_the_kept_choices_weighted() {
        let (t, k, experts, cap, h) = (6, 2, 3, 3, 2);
        let ch = choices(t, k, experts, 9);
        let slots = reference_slots(&ch, t, k, experts, cap);
        assert!(slots.contains(&-1));
        let ye: Vec<f32> = uniform(experts * cap * h, 10)
            .iter()
            .map(|&v| v as f32)
            .collect();
        let w: Vec<f32> = uniform(t * k, 11).iter().map(|&v| v as f32).collect();
        let y = eval_op(
            &Op::MoeCombine,
            &[
                &Tensor::f32(vec![experts, cap, h], ye.clone()),
                &Tensor::i64(vec![t, k], ch.clone()),
                &Tensor::i64(vec![t, k], slots.clone()),
                &Tensor::f32(vec![t, k], w.clone()),
            ],
        )
        .unwrap();
        let mut want = vec![0.0f32; t * h];
        for tok in 0..t {
            for j in 0..k {
                let s = slots[tok * k + j];
                if s < 0 {
                    continue;
                }
                for i in 0..h {
                    want[tok * h + i] +=
                        w[tok * k + j] * ye[(ch[tok * k + j] as usize * cap + s as usize) * h + i];
                }
            }
        }
        assert_eq!(y[0].to_f32_vec(), want);
    }

    #[test]
    fn bad_indices_are_errors_not_panics() {
        let x = Tensor::f32(vec![2, 2], vec![1.0; 4]);
        let bad = Tensor::i64(vec![2, 1], vec![0, 5]);
        let e = eval_op(
            &Op::MoeDispatch {
                experts: 3,
                capacity: 2,
            },
            &[&x, &bad],
        )
        .unwrap_err();
        assert!(e.contains("expert index 5") && e.contains("0..3"), "{e}");
        let ye = Tensor::f32(vec![3, 2, 2], vec![1.0; 12]);
        let ok = Tensor::i64(vec![2, 1], vec![0, 1]);
        let w = Tensor::f32(vec![2, 1], vec![1.0; 2]);
        for slots in [vec![0, 2], vec![-2, 0]] {
            let s = Tensor::i64(vec![2, 1], slots);
            let e = eval_op(&Op::MoeCombine, &[&ye, &ok, &s, &w]).unwrap_err();
            assert!(e.contains("outside the capacity 2"), "{e}");
        }
    }
}
