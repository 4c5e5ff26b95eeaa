//! Per-op translation: ONNX op semantics (opsets 13-21) onto hzp's op set. Attributes that
//! ONNX passes as inputs (shapes, axes, sizes, k, depth) must be import-time constants (or
//! values bound by `--inputs` / `--bind`, which the importer folds first).
//!
//! One file per op family; each lists its ops with their rules in `OPS`, and [`rule`] finds
//! a node's rule in those lists: the one registry that both [`is_supported`] (the importer's
//! up-front check and `hzp show`'s list) and [`translate`] read, so they cannot disagree.
//! To add an op: write its rule in its family's file and add it to that file's `OPS`.

use super::ctx::{Ctx, NodeCx, Slot};
use super::error::{node_err, FResult, Fail, ImportErrorKind};
use super::proto::data_type as dt;
use hzp_ir::{broadcast_shapes, BinaryOp, DType, Op, ReduceOp, Tensor, UnaryOp};

mod attention;
mod elementwise;
mod index;
mod linalg;
mod norm;
mod reduce;
mod sequence;
mod shape;

use std::collections::BTreeMap;
use std::sync::OnceLock;

/// How one ONNX node becomes hzp ops: a slot per ONNX output (`None`: not computed).
type Rule = fn(&mut Ctx, &NodeCx) -> FResult<Outs>;

/// The families of the default (`ai.onnx`) domain.
const FAMILIES: [&[(&str, Rule)]; 8] = [
    attention::OPS,
    elementwise::OPS,
    index::OPS,
    linalg::OPS,
    norm::OPS,
    reduce::OPS,
    sequence::OPS,
    shape::OPS,
];

/// The `com.microsoft` ops hzp translates.
const MICROSOFT_OPS: &[(&str, Rule)] = &[("SimplifiedLayerNormalization", norm::rms_norm)];

/// The default domain's registry, by op type.
fn default_domain() -> &'static BTreeMap<&'static str, Rule> {
    static REGISTRY: OnceLock<BTreeMap<&'static str, Rule>> = OnceLock::new();
    REGISTRY.get_or_init(|| FAMILIES.iter().flat_map(|f| f.iter().copied()).collect())
}

/// The rule for `op_type` of `domain`, if hzp translates it.
fn rule(domain: &str, op_type: &str) -> Option<Rule> {
    match domain {
        "" | "ai.onnx" => default_domain().get(op_type).copied(),
        "com.microsoft" => MICROSOFT_OPS
            .iter()
            .find(|(o, _)| *o == op_type)
            .map(|&(_, r)| r),
        _ => None,
    }
}

/// Op types of the default domain hzp translates, sorted.
pub(crate) fn default_domain_ops() -> Vec<&'static str> {
    default_domain().keys().copied().collect()
}

/// Whether hzp translates `op_type` of `domain`.
pub(crate) fn is_supported(domain: &str, op_type: &str) -> bool {
    rule(domain, op_type).is_some()
}

/// Whether `op_type` of `domain` reads sequences (the only ops a sequence may flow into).
pub(crate) fn takes_sequences(domain: &str, op_type: &str) -> bool {
    (domain.is_empty() || domain == "ai.onnx") && sequence::takes_sequences(op_type)
}

/// Translates one node; returns a slot per ONNX output (`None`: not computed, or a sequence
/// the rule bound in [`Ctx::seqs`]).
pub(crate) fn translate(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let (domain, op_type) = (n.p.domain.as_str(), n.p.op_type.as_str());
    match rule(domain, op_type) {
        Some(r) => r(cx, n),
        None if domain.is_empty() || domain == "ai.onnx" => {
            unsupported(format!("{op_type} is not supported"))
        }
        None => unsupported(format!("{domain}.{op_type} is not supported")),
    }
}

type Outs = Vec<Option<Slot>>;

fn one(s: Slot) -> FResult<Outs> {
    Ok(vec![Some(s)])
}

fn err<T>(m: impl Into<String>) -> FResult<T> {
    Err(node_err(m))
}

fn unsupported<T>(m: impl Into<String>) -> FResult<T> {
    Err(Fail::new(ImportErrorKind::Unsupported, m))
}

/// The IR name of output `k` (the ONNX name, or a fresh one for omitted outputs).
fn out_name(cx: &mut Ctx, n: &NodeCx, k: usize) -> String {
    match n.p.output.get(k) {
        Some(o) if !o.is_empty() => o.clone(),
        _ => cx.fresh(&format!("{}:{k}", n.ir_name)),
    }
}

/// A fresh name for an intermediate value of this node.
fn tmp(cx: &mut Ctx, n: &NodeCx, what: &str) -> String {
    let base = match n.p.output.first() {
        Some(o) if !o.is_empty() => o.clone(),
        _ => n.ir_name.clone(),
    };
    cx.fresh(&format!("{base}/{what}"))
}

fn emit1(cx: &mut Ctx, node: &str, op: Op, ins: &[Slot], out: String) -> FResult<Slot> {
    let mut v = cx.emit(node, op, ins, vec![out])?;
    v.pop()
        .ok_or_else(|| node_err("internal: op made no result"))
}

/// Normalizes an ONNX axis (negative counts from the end) for `rank`.
fn norm_axis(a: i64, rank: usize, what: &str) -> FResult<usize> {
    let r = rank as i64;
    let x = if a < 0 { a + r } else { a };
    if x < 0 || x >= r {
        return err(format!("{what} {a} is out of range for rank {rank}"));
    }
    Ok(x as usize)
}

/// Normalizes a list of axes; duplicates are an error.
fn norm_axes(axes: &[i64], rank: usize, what: &str) -> FResult<Vec<usize>> {
    let mut out = Vec::with_capacity(axes.len());
    for &a in axes {
        let x = norm_axis(a, rank, what)?;
        if out.contains(&x) {
            return err(format!("{what} {axes:?} name axis {x} twice"));
        }
        out.push(x);
    }
    Ok(out)
}

/// Integer values of a constant (index/shape inputs).
fn ints(t: &Tensor, what: &str) -> FResult<Vec<i64>> {
    t.to_i64_vec()
        .ok_or_else(|| node_err(format!("{what} must hold integers, got {}", t.dtype())))
}

/// One integer from a scalar or 1-element constant.
fn int_scalar(t: &Tensor, what: &str) -> FResult<i64> {
    if t.numel() != 1 {
        return err(format!(
            "{what} must have one element, got shape {:?}",
            t.shape
        ));
    }
    match t.to_i64_vec() {
        Some(v) => Ok(v[0]),
        None => {
            let f = t.to_f64_vec()[0];
            if f.fract() != 0.0 || !f.is_finite() {
                return err(format!("{what} must be a whole number, got {f}"));
            }
            Ok(f as i64)
        }
    }
}

fn non_neg(v: &[i64], what: &str) -> FResult<Vec<usize>> {
    v.iter()
        .map(|&x| {
            usize::try_from(x).map_err(|_| node_err(format!("{what} {v:?} has a negative entry")))
        })
        .collect()
}

/// Axes from input `k` (a constant) or, for older opsets, the `axes` attribute.
fn axes_input(cx: &Ctx, n: &NodeCx, k: usize, what: &str) -> FResult<Option<Vec<i64>>> {
    if n.input(k).is_some() {
        Ok(Some(ints(cx.static_input(n, k, what)?, what)?))
    } else {
        Ok(n.attr_ints("axes"))
    }
}

/// A small helper for formulas: scalar constants of one dtype, intermediate and final ops.
struct Builder<'c, 'g, 'n, 'a> {
    cx: &'c mut Ctx<'g>,
    n: &'n NodeCx<'a>,
    name: &'n str,
    dt: DType,
}

impl Builder<'_, '_, '_, '_> {
    fn k(&mut self, v: f64) -> Slot {
        self.cx.scalar(self.dt, v, &format!("{}/const", self.name))
    }
    fn tmp(&mut self, op: Op, ins: &[Slot], what: &str) -> FResult<Slot> {
        let t = tmp(self.cx, self.n, what);
        emit1(self.cx, self.name, op, ins, t)
    }
    fn bin(&mut self, op: BinaryOp, a: &Slot, b: &Slot, what: &str) -> FResult<Slot> {
        self.tmp(Op::Binary(op), &[a.clone(), b.clone()], what)
    }
    fn un(&mut self, op: UnaryOp, a: &Slot, what: &str) -> FResult<Slot> {
        self.tmp(Op::Unary(op), std::slice::from_ref(a), what)
    }
    fn last(&mut self, op: Op, ins: &[Slot]) -> FResult<Slot> {
        let out = out_name(self.cx, self.n, 0);
        emit1(self.cx, self.name, op, ins, out)
    }
}

fn reshape_tmp(cx: &mut Ctx, n: &NodeCx, x: Slot, shape: Vec<usize>, what: &str) -> FResult<Slot> {
    if cx.shape(&x) == shape {
        return Ok(x);
    }
    let t = tmp(cx, n, what);
    emit1(cx, &n.ir_name, Op::Reshape { shape }, &[x], t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_op_has_one_rule() {
        let mut seen = std::collections::BTreeSet::new();
        for family in FAMILIES {
            for (op, _) in family {
                assert!(seen.insert(*op), "{op} is registered twice");
            }
        }
        assert_eq!(seen.len(), default_domain().len());
        assert!(is_supported("", "MatMul") && is_supported("ai.onnx", "Softmax"));
        assert!(is_supported(
            "com.microsoft",
            "SimplifiedLayerNormalization"
        ));
        assert!(!is_supported("com.microsoft", "MatMul") && !is_supported("x", "Add"));
    }
}
