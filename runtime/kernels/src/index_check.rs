//! Integer inputs used as indices (token ids, class labels) are range-checked where they
//! enter a backend: a token id outside `0..vocabulary` is an error naming the input, the
//! position and the vocabulary, as in PyTorch. ONNX's Gather would read a negative id as
//! counting from the end of the table, and the row-exchanged embedding gradient of a
//! sharded plan would drop it: accepting one silently trains something other than what the
//! user meant.
//!
//! [`index_bounds`] follows each integer program input through ops that only move or
//! select its values (reshape, slice, transpose, concat, ...) to the ops that index with
//! it: a Gather from a parameter table (an embedding: the indexed axis) and
//! SoftmaxCrossEntropy (the classes).
//! [`check_index_inputs`] checks every element of those inputs against the smallest bound.

use hzp_ir::{Data, Op, Program, Tensor, ValueId};
use std::collections::HashMap;

/// One use of an input as an index: values must lie in `0..bound`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexUse {
    pub bound: usize,
    /// What is indexed, in the user's terms (the table and the node).
    pub what: String,
}

/// For each integer program input used as an index, its tightest use.
pub fn index_bounds(p: &Program) -> HashMap<ValueId, IndexUse> {
    let users = p.users();
    let mut out: HashMap<ValueId, IndexUse> = HashMap::new();
    for &input in &p.inputs {
        if input.index() >= p.values.len() || !p.ty(input).dtype.is_int() {
            continue;
        }
        let mut best: Option<IndexUse> = None;
        let mut seen = vec![false; p.values.len()];
        let mut stack = vec![input];
        while let Some(v) = stack.pop() {
            if std::mem::replace(&mut seen[v.index()], true) {
                continue;
            }
            for &n in users.get(v.index()).map(Vec::as_slice).unwrap_or(&[]) {
                let node = p.node(n);
                let operand = |i: usize| node.inputs.get(i).copied();
                let found = match &node.op {
                    Op::Gather { axis }
                        if operand(1) == Some(v) && operand(0).is_some_and(|d| is_table(p, d)) =>
                    {
                        operand(0).and_then(|data| {
                            let dim = *p.ty(data).shape.get(*axis)?;
                            Some(IndexUse {
                                bound: dim,
                                what: format!(
                                    "it indexes axis {axis} of `{}` (node `{}`), which has {dim} entries",
                                    p.value(data).name,
                                    node.name
                                ),
                            })
                        })
                    }
                    Op::SoftmaxCrossEntropy { axis } | Op::SoftmaxCrossEntropyGrad { axis }
                        if operand(1) == Some(v) =>
                    {
                        operand(0).and_then(|logits| {
                            let dim = *p.ty(logits).shape.get(*axis)?;
                            Some(IndexUse {
                                bound: dim,
                                what: format!(
                                    "it holds class labels for the loss over {dim} classes (node `{}`)",
                                    node.name
                                ),
                            })
                        })
                    }
                    // Ops that pass the values on unchanged: follow their outputs.
                    Op::Reshape { .. }
                    | Op::Slice { .. }
                    | Op::Transpose { .. }
                    | Op::Expand { .. }
                    | Op::Tile { .. }
                    | Op::Concat { .. }
                    | Op::Split { .. }
                    | Op::Identity
                    | Op::Copy => {
                        for &o in &node.outputs {
                            if p.ty(o).dtype.is_int() {
                                stack.push(o);
                            }
                        }
                        None
                    }
                    Op::Cast { to } if to.is_int() => {
                        stack.extend(node.outputs.iter().copied());
                        None
                    }
                    _ => None,
                };
                if let Some(u) = found {
                    if best.as_ref().is_none_or(|b| u.bound < b.bound) {
                        best = Some(u);
                    }
                }
            }
        }
        if let Some(b) = best {
            out.insert(input, b);
        }
    }
    out
}

/// Whether `v` is a trainable table: a parameter, or one as the step reads it (cast to the
/// compute type, gathered from its shards, reshaped). A lookup into one is an embedding,
/// where PyTorch rejects negative ids; other Gathers keep ONNX's meaning (negative indices
/// count from the end), as does OneHot.
fn is_table(p: &Program, mut v: ValueId) -> bool {
    for _ in 0..64 {
        if v.index() >= p.values.len() {
            return false;
        }
        match p.value(v).def {
            hzp_ir::ValueDef::Param => return true,
            hzp_ir::ValueDef::Node { node, .. } => {
                let n = p.node(node);
                match n.op {
                    Op::Cast { .. }
                    | Op::AllGather { .. }
                    | Op::Slice { .. }
                    | Op::Reshape { .. }
                    | Op::Identity
                    | Op::Copy
                    | Op::Concat { .. } => match n.inputs.first() {
                        Some(&x) => v = x,
                        None => return false,
                    },
                    _ => return false,
                }
            }
            _ => return false,
        }
    }
    false
}

/// The row-major position of flat index `i` in `shape`, as `[a, b, c]`.
fn position(shape: &[usize], mut i: usize) -> String {
    let mut idx = vec![0; shape.len()];
    for (k, &d) in shape.iter().enumerate().rev() {
        if d > 0 {
            idx[k] = i % d;
            i /= d;
        }
    }
    format!(
        "[{}]",
        idx.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// The first element of `t` outside `0..bound`: (flat index, value).
fn first_outside(t: &Tensor, bound: usize) -> Option<(usize, i64)> {
    let bound = i64::try_from(bound).unwrap_or(i64::MAX);
    match &t.data {
        Data::I64(v) => v
            .iter()
            .position(|&x| x < 0 || x >= bound)
            .map(|i| (i, v[i])),
        Data::I32(v) => v
            .iter()
            .position(|&x| x < 0 || i64::from(x) >= bound)
            .map(|i| (i, i64::from(v[i]))),
        _ => None,
    }
}

/// The index uses of a program's inputs (see [`index_bounds`]), found once, to check every
/// batch an executor is given: each backend checks its batches where they enter, so no
/// entry point (a CLI command or a library caller) can feed an out-of-range id to a lookup
/// or to the row-exchanged embedding gradient, which would drop its row silently.
#[derive(Clone, Debug, Default)]
pub struct IndexChecker {
    /// (input name, its tightest use), in the program's input order.
    uses: Vec<(String, IndexUse)>,
}

impl IndexChecker {
    pub fn new(p: &Program) -> IndexChecker {
        let mut bounds = index_bounds(p);
        IndexChecker {
            uses: p
                .inputs
                .iter()
                .filter_map(|v| Some((p.value(*v).name.clone(), bounds.remove(v)?)))
                .collect(),
        }
    }

    /// Checks the arrays of `inputs` (by input name; names the program does not use as
    /// indices are skipped). The error names the input, the first bad element's position
    /// and value, and the bound.
    pub fn check(&self, inputs: &[(String, Tensor)]) -> Result<(), String> {
        for (name, u) in &self.uses {
            for (k, t) in inputs {
                if k != name {
                    continue;
                }
                if let Some((i, x)) = first_outside(t, u.bound) {
                    return Err(format!(
                        "input `{name}` holds {x} at position {} (of shape {:?}), outside 0..{}: {}{}",
                        position(&t.shape, i),
                        t.shape,
                        u.bound,
                        u.what,
                        if x < 0 {
                            " (negative ids are rejected, as PyTorch does, rather than counted from the end)"
                        } else {
                            ""
                        }
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Checks the integer inputs of `p` used as indices (see the module doc). `inputs` are
/// matched to program inputs by name; names the program does not use are skipped.
pub fn check_index_inputs(p: &Program, inputs: &[(String, Tensor)]) -> Result<(), String> {
    IndexChecker::new(p).check(inputs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hzp_ir::{DType, TensorType};

    fn embedding() -> Program {
        let mut p = Program::new("emb");
        let ids = p.add_input("input_ids", TensorType::new(DType::I64, vec![2, 3]));
        let w = p.add_param("wte", TensorType::new(DType::F32, vec![10, 4]), None);
        let flat = p
            .add_node(
                "flat",
                Op::Reshape { shape: vec![6] },
                vec![ids],
                vec!["flat".into()],
            )
            .unwrap()[0];
        let out = p
            .add_node(
                "lookup",
                Op::Gather { axis: 0 },
                vec![w, flat],
                vec!["out".into()],
            )
            .unwrap()[0];
        p.outputs.push(out);
        p
    }

    #[test]
    fn token_ids_are_checked_through_reshapes() {
        let p = embedding();
        let ok = Tensor::i64(vec![2, 3], vec![0, 1, 2, 3, 4, 9]);
        check_index_inputs(&p, &[("input_ids".into(), ok)]).unwrap();
        let neg = Tensor::i64(vec![2, 3], vec![0, 1, 2, 3, -1, 9]);
        let e = check_index_inputs(&p, &[("input_ids".into(), neg)]).unwrap_err();
        assert!(
            e.contains("`input_ids` holds -1 at position [1, 1]")
                && e.contains("outside 0..10")
                && e.contains("`wte`")
                && e.contains("negative ids are rejected"),
            "{e}"
        );
        let big = Tensor::i64(vec![2, 3], vec![0, 10, 2, 3, 4, 5]);
        let e = check_index_inputs(&p, &[("input_ids".into(), big)]).unwrap_err();
        assert!(e.contains("holds 10 at position [0, 1]"), "{e}");
    }
}
