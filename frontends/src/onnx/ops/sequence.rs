//! Sequences of tensors with static lengths: `SplitToSequence`, `SequenceConstruct`,
//! `SequenceAt`, `SequenceLength`, `SequenceInsert`, `SequenceErase`, `ConcatFromSequence`.
//!
//! hzp's programs hold tensors only. With static shapes, static split sizes and import-time
//! constant positions, every sequence is known element by element at import: it is kept in
//! the translation context as a list of slots ([`Ctx::seqs`], by ONNX name) and never becomes
//! an IR value. `SequenceAt` is the element itself, `ConcatFromSequence` one `Concat` of the
//! elements. A position computed at run time is refused, naming the node and the input.

use super::{emit1, err, int_scalar, non_neg, norm_axis, one, out_name, reshape_tmp, Outs, Rule};
use crate::onnx::ctx::{Ctx, NodeCx, Slot};
use crate::onnx::error::{node_err, FResult};
use hzp_ir::{Op, Tensor};
use std::rc::Rc;

pub(super) const OPS: &[(&str, Rule)] = &[
    ("ConcatFromSequence", concat_from_sequence),
    ("SequenceAt", sequence_at),
    ("SequenceConstruct", sequence_construct),
    ("SequenceErase", sequence_erase),
    ("SequenceInsert", sequence_insert),
    ("SequenceLength", sequence_length),
    ("SplitToSequence", split_to_sequence),
];

/// Whether `op_type` (default domain) reads sequences: the only ops a sequence may flow into.
pub(crate) fn takes_sequences(op_type: &str) -> bool {
    matches!(
        op_type,
        "ConcatFromSequence" | "SequenceAt" | "SequenceErase" | "SequenceInsert" | "SequenceLength"
    )
}

/// Input `k` of `n` as a sequence.
fn seq_input(n: &NodeCx, k: usize) -> FResult<Rc<Vec<Slot>>> {
    match n.seqs.get(k).cloned().flatten() {
        Some(s) => Ok(s),
        None if n.input(k).is_some() => err(format!(
            "input {k} (`{}`) must be a sequence (from SplitToSequence, SequenceConstruct, ...), \
             but it is a tensor",
            n.in_name(k)
        )),
        None => err(format!(
            "input {k} (the sequence) is missing ({} has {} inputs)",
            n.p.op_type,
            n.p.input.len()
        )),
    }
}

/// Binds output 0 of `n` to the sequence `elems`; no tensor slot.
fn seq_output(cx: &mut Ctx, n: &NodeCx, elems: Vec<Slot>) -> FResult<Outs> {
    match n.p.output.first() {
        Some(o) if !o.is_empty() => {
            cx.seqs.insert(o.clone(), Rc::new(elems));
        }
        _ => {}
    }
    Ok(vec![None])
}

/// A position into a sequence of `len` elements from input `k` (an import-time constant;
/// negative counts from the back), in `0..len` (or `0..=len` when `insert`).
fn position(cx: &Ctx, n: &NodeCx, k: usize, len: usize, insert: bool) -> FResult<usize> {
    let t = cx.static_input(n, k, "the position")?;
    if !t.shape.is_empty() && t.numel() != 1 {
        return err(format!(
            "the position (input `{}`) must be a scalar, got shape {:?}",
            n.in_name(k),
            t.shape
        ));
    }
    if !t.dtype().is_int() {
        return err(format!(
            "the position (input `{}`) must be int32 or int64, got {}",
            n.in_name(k),
            t.dtype()
        ));
    }
    let p = int_scalar(t, "the position")?;
    let n_len = len as i64;
    let hi = if insert { n_len } else { n_len - 1 };
    if p < -n_len || p > hi {
        return err(format!(
            "position {p} is out of range for a sequence of {len} element{} (accepted: {} to {hi})",
            if len == 1 { "" } else { "s" },
            -n_len
        ));
    }
    Ok(if p < 0 {
        (p + n_len) as usize
    } else {
        p as usize
    })
}

/// `SplitToSequence(input, split?)`: chunks of `input` along `axis`; without `split`, chunks
/// of one (with the axis removed unless `keepdims`); a scalar `split` cuts chunks of that size
/// (the last one smaller when it does not divide the dim); a 1-D `split` gives the sizes.
fn split_to_sequence(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let s = cx.shape(&x);
    if s.is_empty() {
        return err("cannot split a scalar into a sequence");
    }
    let axis = norm_axis(n.attr_i("axis", 0)?, s.len(), "axis")?;
    let dim = s[axis];
    let (sizes, squeeze) = match n.input(1) {
        None => (vec![1; dim], n.attr_i("keepdims", 1)? == 0),
        Some(_) => {
            let t = cx.static_input(n, 1, "the split sizes")?;
            if t.shape.is_empty() {
                let c = int_scalar(t, "the split size")?;
                let c = usize::try_from(c)
                    .ok()
                    .filter(|&c| c > 0)
                    .ok_or_else(|| node_err(format!("the split size {c} must be positive")))?;
                let mut v = vec![c; dim / c];
                if !dim.is_multiple_of(c) {
                    v.push(dim % c);
                }
                (v, false)
            } else if t.shape.len() == 1 {
                let v = t.to_i64_vec().ok_or_else(|| {
                    node_err(format!(
                        "the split sizes must hold integers, got {}",
                        t.dtype()
                    ))
                })?;
                let v = non_neg(&v, "the split sizes")?;
                if v.iter().try_fold(0usize, |a, &b| a.checked_add(b)) != Some(dim) {
                    return err(format!(
                        "the split sizes {v:?} do not add up to dim {axis} of {s:?}"
                    ));
                }
                (v, false)
            } else {
                return err(format!(
                    "the split sizes must be a scalar or 1-D, got shape {:?}",
                    t.shape
                ));
            }
        }
    };
    let base = match n.p.output.first() {
        Some(o) if !o.is_empty() => o.clone(),
        _ => n.ir_name.clone(),
    };
    let parts: Vec<Slot> = match sizes.len() {
        0 => Vec::new(),
        1 => vec![x],
        k => {
            let outs: Vec<String> = (0..k).map(|i| cx.fresh(&format!("{base}/{i}"))).collect();
            cx.emit(&n.ir_name, Op::Split { axis, sizes }, &[x], outs)?
        }
    };
    let elems = if squeeze {
        let mut shape = s.clone();
        shape.remove(axis);
        let mut v = Vec::with_capacity(parts.len());
        for p in parts {
            v.push(reshape_tmp(cx, n, p, shape.clone(), "squeezed")?);
        }
        v
    } else {
        parts
    };
    seq_output(cx, n, elems)
}

/// `SequenceConstruct(inputs...)`: a sequence of its inputs (one dtype).
fn sequence_construct(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let mut elems = Vec::with_capacity(n.ins.len());
    for k in 0..n.ins.len() {
        elems.push(n.req(k)?.clone());
    }
    if let Some(first) = elems.first() {
        let d = cx.dtype(first);
        for (k, e) in elems.iter().enumerate() {
            if cx.dtype(e) != d {
                return err(format!(
                    "the elements of a sequence have one dtype: input 0 is {d}, input {k} (`{}`) is {}",
                    n.in_name(k),
                    cx.dtype(e)
                ));
            }
        }
    }
    seq_output(cx, n, elems)
}

/// `SequenceAt(sequence, position)`: the element at a constant position.
fn sequence_at(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let seq = seq_input(n, 0)?;
    let i = position(cx, n, 1, seq.len(), false)?;
    one(seq[i].clone())
}

/// `SequenceLength(sequence)`: its length, an int64 scalar constant.
fn sequence_length(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let seq = seq_input(n, 0)?;
    let out = out_name(cx, n, 0);
    one(cx.named_const(Tensor::scalar_i64(seq.len() as i64), out))
}

/// `SequenceInsert(sequence, tensor, position?)`: a new sequence with `tensor` at the
/// position (default: at the end).
fn sequence_insert(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let seq = seq_input(n, 0)?;
    let t = n.req(1)?.clone();
    if let Some(first) = seq.first() {
        let (d, e) = (cx.dtype(first), cx.dtype(&t));
        if d != e {
            return err(format!(
                "the sequence holds {d}, the inserted tensor (`{}`) is {e}",
                n.in_name(1)
            ));
        }
    }
    let at = if n.input(2).is_some() {
        position(cx, n, 2, seq.len(), true)?
    } else {
        seq.len()
    };
    let mut elems: Vec<Slot> = seq.as_ref().clone();
    elems.insert(at, t);
    seq_output(cx, n, elems)
}

/// `SequenceErase(sequence, position?)`: a new sequence without the element at the position
/// (default: the last).
fn sequence_erase(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let seq = seq_input(n, 0)?;
    if seq.is_empty() {
        return err("cannot erase from an empty sequence");
    }
    let at = if n.input(1).is_some() {
        position(cx, n, 1, seq.len(), false)?
    } else {
        seq.len() - 1
    };
    let mut elems: Vec<Slot> = seq.as_ref().clone();
    elems.remove(at);
    seq_output(cx, n, elems)
}

/// `ConcatFromSequence(sequence)`: the elements concatenated along `axis`, or stacked along a
/// new `axis` with `new_axis = 1`.
fn concat_from_sequence(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let seq = seq_input(n, 0)?;
    let a = n
        .attr("axis")
        .and_then(|a| a.i)
        .ok_or_else(|| node_err("ConcatFromSequence needs the `axis` attribute"))?;
    let new_axis = match n.attr_i("new_axis", 0)? {
        0 => false,
        1 => true,
        v => return err(format!("attribute `new_axis` must be 0 or 1, got {v}")),
    };
    let Some(first) = seq.first() else {
        return err("cannot concatenate an empty sequence (its result has no shape)");
    };
    let r = cx.shape(first).len();
    let mut elems: Vec<Slot> = seq.as_ref().clone();
    let axis = if new_axis {
        let axis = norm_axis(a, r + 1, "axis")?;
        for e in elems.iter_mut() {
            let mut shape = cx.shape(e);
            if shape.len() != r {
                return err(format!(
                    "the elements of the sequence have different ranks ({r} and {})",
                    shape.len()
                ));
            }
            shape.insert(axis, 1);
            *e = reshape_tmp(cx, n, e.clone(), shape, "unsqueezed")?;
        }
        axis
    } else {
        if r == 0 {
            return err("cannot concatenate scalars without `new_axis = 1`");
        }
        norm_axis(a, r, "axis")?
    };
    if elems.len() == 1 {
        return one(elems.swap_remove(0));
    }
    let out = out_name(cx, n, 0);
    one(emit1(cx, &n.ir_name, Op::Concat { axis }, &elems, out)?)
}
