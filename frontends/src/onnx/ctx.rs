//! The translation context the op rules work in: the map from ONNX names to IR values or
//! import-time constants ([`Slot`]), a node's attributes and inputs ([`NodeCx`]), constant
//! folding with the CPU kernels, and the program being built ([`Ctx`]). The import driver
//! (`translate`) walks the graph with it and the op rules (`ops`) fill it; it knows neither.

use super::error::{graph_err, node_err, FResult, Fail};
use super::graph::{node_label, Def, GraphInfo};
use super::proto::{AttributeProto, NodeProto};
use super::tensor::decode_tensor;
use hzp_ir::{numel, DType, NameSet, Op, Program, Tensor, TensorType, ValueId};
use std::cell::Cell;
use std::collections::HashMap;
use std::path::Path;
use std::rc::Rc;

pub(crate) const MIN_OPSET: i64 = 13;
pub(crate) const MAX_OPSET: i64 = 25;

/// Results up to this many elements are always folded into constants.
const FOLD_ALWAYS: usize = 1 << 22;
/// Above this, folding never happens (the op stays in the program); between the two limits a
/// result is folded only when it is not larger than its inputs together (so broadcasts of big
/// masks stay run-time ops instead of bloating the program).
const FOLD_MAX: usize = 1 << 28;

/// A constant known at import time.
pub(crate) struct ConstVal {
    pub t: Tensor,
    /// The name it gets if it has to become an IR constant (reserved, so never taken).
    pub name: String,
    /// The IR constant once made.
    pub id: Cell<Option<ValueId>>,
}

/// What an ONNX name stands for.
#[derive(Clone)]
pub(crate) enum Slot {
    /// An IR value: an input, a parameter, a node output.
    Val(ValueId),
    /// A constant known at import time.
    Const(Rc<ConstVal>),
}

impl Slot {
    pub fn as_const(&self) -> Option<&Tensor> {
        match self {
            Slot::Const(c) => Some(&c.t),
            Slot::Val(_) => None,
        }
    }
}

/// One ONNX node being translated.
pub(crate) struct NodeCx<'a> {
    pub p: &'a NodeProto,
    /// The name IR nodes made from it get.
    pub ir_name: String,
    /// Inputs; `None` for omitted optional inputs (empty names) and for sequences.
    pub ins: Vec<Option<Slot>>,
    /// The sequence inputs (by position; `None` for tensors and omitted inputs).
    pub seqs: Vec<Option<Rc<Vec<Slot>>>>,
}

impl<'a> NodeCx<'a> {
    pub fn attr(&self, name: &str) -> Option<&'a AttributeProto> {
        self.p.attribute.iter().find(|a| a.name == name)
    }

    pub fn attr_i(&self, name: &str, default: i64) -> FResult<i64> {
        match self.attr(name) {
            None => Ok(default),
            Some(a) => {
                a.i.ok_or_else(|| node_err(format!("attribute `{name}` must be an integer")))
            }
        }
    }

    pub fn attr_f(&self, name: &str, default: f32) -> FResult<f32> {
        match self.attr(name) {
            None => Ok(default),
            Some(a) => {
                a.f.or(a.i.map(|i| i as f32))
                    .ok_or_else(|| node_err(format!("attribute `{name}` must be a float")))
            }
        }
    }

    pub fn attr_ints(&self, name: &str) -> Option<Vec<i64>> {
        self.attr(name).map(|a| a.ints.clone())
    }

    pub fn attr_s(&self, name: &str) -> FResult<Option<String>> {
        match self.attr(name) {
            None => Ok(None),
            Some(a) => match &a.s {
                Some(s) => Ok(Some(String::from_utf8_lossy(s).into_owned())),
                None => Err(node_err(format!("attribute `{name}` must be a string"))),
            },
        }
    }

    pub fn input(&self, k: usize) -> Option<&Slot> {
        self.ins.get(k).and_then(|s| s.as_ref())
    }

    /// A required input.
    pub fn req(&self, k: usize) -> FResult<&Slot> {
        self.input(k).ok_or_else(|| {
            node_err(format!(
                "input {k} is missing ({} has {} inputs)",
                self.p.op_type,
                self.p.input.len()
            ))
        })
    }

    /// The ONNX name of input `k` (for messages).
    pub fn in_name(&self, k: usize) -> &str {
        self.p.input.get(k).map(|s| s.as_str()).unwrap_or("")
    }

    pub fn n_outputs(&self) -> usize {
        self.p.output.len()
    }
}

pub(crate) struct Ctx<'g> {
    pub prog: Program,
    pub names: NameSet,
    pub env: HashMap<String, Slot>,
    /// Sequences of tensors by ONNX name, element by element (see `ops::sequence`).
    pub seqs: HashMap<String, Rc<Vec<Slot>>>,
    pub(crate) info: &'g GraphInfo<'g>,
    pub(crate) model_dir: Option<&'g Path>,
    /// Graph inputs whose values were given (specialization candidates).
    pub(crate) given: &'g std::collections::BTreeSet<String>,
    /// Bytes of constants computed at import so far (checked against the memory budget:
    /// shapes bound by `--shape` can make folded tensors of any size).
    pub(crate) folded_bytes: u64,
    /// [`super::ImportOptions::shapes_only`].
    pub(crate) shapes_only: bool,
    /// Placeholders of a shapes-only import (values not computed), by value.
    pub(crate) placeholders: std::collections::HashSet<ValueId>,
}

impl<'g> Ctx<'g> {
    /// Whether a result of `bytes` computed at import is computed: always, except in a
    /// shapes-only import past [`super::SHAPES_ONLY_BUDGET`] (or the memory budget, when
    /// smaller): there it is not computed instead of failing the budget.
    pub fn computes(&self, bytes: u64) -> bool {
        !self.shapes_only
            || self.folded_bytes.saturating_add(bytes)
                <= super::SHAPES_ONLY_BUDGET.min(crate::limits::max_memory())
    }

    /// A shapes-only import's stand-in for a tensor that is not computed: a `Fill` of zeros
    /// of its type (see [`super::ImportOptions::shapes_only`]).
    pub fn placeholder(
        &mut self,
        node: &str,
        dtype: DType,
        shape: Vec<usize>,
        out: String,
    ) -> FResult<Slot> {
        let vs = self
            .prog
            .add_node(
                node,
                Op::Fill {
                    value: 0.0,
                    dtype,
                    shape,
                },
                vec![],
                vec![out],
            )
            .map_err(node_err)?;
        self.placeholders.insert(vs[0]);
        Ok(Slot::Val(vs[0]))
    }

    /// Whether `bytes` more of computed constants fit the memory budget.
    pub fn fold_fits(&self, bytes: u64) -> bool {
        self.folded_bytes.saturating_add(bytes) <= crate::limits::max_memory()
    }

    /// Checks that a constant of `bytes` that must be computed at import (`what`) fits the
    /// memory budget, with what is already computed.
    pub fn check_fold_budget(&self, what: &str, bytes: u64) -> FResult<()> {
        crate::limits::check_budget(
            &format!(
                "{what} (with the {} of constants computed before it; the input shapes may be too large)",
                crate::limits::fmt_bytes(self.folded_bytes)
            ),
            self.folded_bytes.saturating_add(bytes),
        )
        .map_err(node_err)
    }

    pub fn ty(&self, s: &Slot) -> TensorType {
        match s {
            Slot::Val(v) => self.prog.ty(*v).clone(),
            Slot::Const(c) => c.t.ty(),
        }
    }

    pub fn shape(&self, s: &Slot) -> Vec<usize> {
        match s {
            Slot::Val(v) => self.prog.ty(*v).shape.clone(),
            Slot::Const(c) => c.t.shape.clone(),
        }
    }

    pub fn dtype(&self, s: &Slot) -> DType {
        match s {
            Slot::Val(v) => self.prog.ty(*v).dtype,
            Slot::Const(c) => c.t.dtype(),
        }
    }

    /// A constant under a name that is already reserved (an ONNX name or a fresh one).
    pub fn named_const(&mut self, t: Tensor, name: String) -> Slot {
        self.folded_bytes = self
            .folded_bytes
            .saturating_add((t.numel() * t.dtype().size_bytes()) as u64);
        Slot::Const(Rc::new(ConstVal {
            t,
            name,
            id: Cell::new(None),
        }))
    }

    /// A new constant named after `base`.
    pub fn konst(&mut self, t: Tensor, base: &str) -> Slot {
        let name = self.names.fresh(base);
        self.named_const(t, name)
    }

    /// A scalar constant of `dtype`.
    pub fn scalar(&mut self, dtype: DType, v: f64, base: &str) -> Slot {
        self.konst(Tensor::from_f64(dtype, vec![], &[v]), base)
    }

    /// The IR value of a slot (constants become IR constants on first use).
    pub fn materialize(&mut self, s: &Slot) -> ValueId {
        match s {
            Slot::Val(v) => *v,
            Slot::Const(c) => {
                if let Some(id) = c.id.get() {
                    return id;
                }
                let id = self.prog.add_const(c.name.clone(), c.t.clone());
                c.id.set(Some(id));
                id
            }
        }
    }

    /// Decodes a tensor of the model (external data is read from the model's folder).
    pub fn decode(&self, t: &super::proto::TensorProto, what: &str) -> FResult<Tensor> {
        decode_tensor(t, what, self.model_dir)
    }

    /// A fresh value name derived from `base`.
    pub fn fresh(&mut self, base: &str) -> String {
        self.names.fresh(base)
    }

    /// Adds `op` over `ins`, or evaluates it right away when every input is a constant.
    /// `outs` are the names of the results (reserved or fresh).
    pub fn emit(
        &mut self,
        node: &str,
        op: Op,
        ins: &[Slot],
        outs: Vec<String>,
    ) -> FResult<Vec<Slot>> {
        let tys: Vec<TensorType> = ins.iter().map(|s| self.ty(s)).collect();
        let refs: Vec<&TensorType> = tys.iter().collect();
        let out_tys = op.infer(&refs, None).map_err(node_err)?;
        for t in &out_tys {
            if !size_ok(&t.shape) {
                return Err(node_err(format!(
                    "{} would make a tensor of shape {:?}, which is too large",
                    op.name(),
                    t.shape
                )));
            }
        }
        if out_tys.len() != outs.len() {
            return Err(node_err(format!(
                "internal: {} makes {} results, {} names given",
                op.name(),
                out_tys.len(),
                outs.len()
            )));
        }
        let consts: Option<Vec<&Tensor>> = ins.iter().map(|s| s.as_const()).collect();
        if let Some(ts) = consts {
            let out_n: usize = out_tys.iter().map(|t| t.numel()).sum();
            let in_n: usize = ts.iter().map(|t| t.numel()).sum();
            let out_bytes: u64 = out_tys
                .iter()
                .map(|t| (t.numel() * t.dtype.size_bytes()) as u64)
                .sum();
            // Over the memory budget the op stays a run-time op instead.
            let fold = (out_n <= FOLD_ALWAYS || (out_n <= FOLD_MAX && out_n <= in_n))
                && self.fold_fits(out_bytes)
                && self.computes(out_bytes);
            if fold && !ts.is_empty() {
                let results = fold_op(&op, &ts)?;
                if results.len() != out_tys.len()
                    || results.iter().zip(&out_tys).any(|(r, t)| r.ty() != *t)
                {
                    let got: Vec<String> = results.iter().map(|r| r.ty().to_string()).collect();
                    let want: Vec<String> = out_tys.iter().map(|t| t.to_string()).collect();
                    return Err(node_err(format!(
                        "constant folding of {} gave [{}], expected [{}]",
                        op.name(),
                        got.join(", "),
                        want.join(", ")
                    )));
                }
                return Ok(results
                    .into_iter()
                    .zip(outs)
                    .map(|(t, name)| self.named_const(t, name))
                    .collect());
            }
        }
        let ids: Vec<ValueId> = ins.iter().map(|s| self.materialize(s)).collect();
        let vs = self.prog.add_node(node, op, ids, outs).map_err(node_err)?;
        Ok(vs.into_iter().map(Slot::Val).collect())
    }

    /// A tensor computed at import time, stored as a constant or, when it is too big to keep
    /// as data, as a run-time `Fill` (only for uniform tensors).
    pub fn fill(
        &mut self,
        node: &str,
        value: f64,
        dtype: DType,
        shape: Vec<usize>,
        out: String,
    ) -> FResult<Slot> {
        let n = checked_numel(&shape)?;
        if n <= FOLD_ALWAYS && self.computes((n * dtype.size_bytes()) as u64) {
            let t = Tensor::from_f64(dtype, shape, &vec![value; n]);
            return Ok(self.named_const(t, out));
        }
        let vs = self
            .prog
            .add_node(
                node,
                Op::Fill {
                    value,
                    dtype,
                    shape,
                },
                vec![],
                vec![out],
            )
            .map_err(node_err)?;
        Ok(Slot::Val(vs[0]))
    }

    /// Input `k` of `n` as an import-time constant; the error says what it is for (`what`,
    /// e.g. "the target shape") and where the run-time value comes from.
    pub fn static_input<'s>(&self, n: &'s NodeCx, k: usize, what: &str) -> FResult<&'s Tensor> {
        let s = n.req(k)?;
        match s {
            Slot::Const(c) => Ok(&c.t),
            Slot::Val(v) => {
                let name = n.in_name(k);
                if self.placeholders.contains(v) {
                    return Err(node_err(format!(
                        "{what} (input `{name}`) comes from a tensor that reading shapes only does \
                         not compute (over {} of computed constants); use a smaller --shape",
                        crate::limits::fmt_bytes(super::SHAPES_ONLY_BUDGET)
                    )));
                }
                if let Some(f) = self.specialization(*v, what, name) {
                    return Err(f);
                }
                let origin = match self.info.defs.get(name) {
                    Some(Def::Input(_)) => format!(" (it is the graph input `{name}`)"),
                    Some(Def::Init(_)) => format!(" (it is the trainable parameter `{name}`)"),
                    Some(&Def::Node(i, _)) => match self.info.graph.node.get(i) {
                        Some(p) => format!(" by {}", node_label(p)),
                        None => String::new(),
                    },
                    None => String::new(),
                };
                Err(node_err(format!(
                    "{what} (input `{name}`) is computed at run time{origin}; hzp needs static \
                     shapes, so it must be computable from constants and input shapes"
                )))
            }
        }
    }

    /// When the run-time value `v` is computed from graph inputs only (and constants): the
    /// failure that asks the driver to specialize on them if all their values were given,
    /// else the error that says how to give them. None when a parameter feeds it.
    fn specialization(&self, v: ValueId, what: &str, name: &str) -> Option<Fail> {
        let mut stack = vec![v];
        let mut seen = std::collections::HashSet::new();
        let mut inputs = std::collections::BTreeSet::new();
        while let Some(v) = stack.pop() {
            if !seen.insert(v) {
                continue;
            }
            let val = self.prog.value(v);
            match val.def {
                hzp_ir::ValueDef::Input => {
                    inputs.insert(val.name.clone());
                }
                hzp_ir::ValueDef::Node { node, .. } => {
                    stack.extend(self.prog.nodes[node.index()].inputs.iter().copied());
                }
                hzp_ir::ValueDef::Const => {}
                _ => return None,
            }
        }
        if inputs.is_empty() {
            return None;
        }
        let missing: Vec<&String> = inputs.iter().filter(|i| !self.given.contains(*i)).collect();
        if missing.is_empty() {
            let mut f = node_err(format!(
                "{what} (input `{name}`) needs the values of inputs"
            ));
            f.specialize = inputs.into_iter().collect();
            return Some(f);
        }
        let list: Vec<String> = missing.iter().map(|m| format!("`{m}`")).collect();
        let example = missing[0];
        Some(node_err(format!(
            "{what} (input `{name}`) is computed at run time from the graph input{} {}; hzp \
             needs static shapes, so it needs {} value{} at import: give {} with \
             `--bind {example}=1,2,3` (numbers separated by commas) or in the `--inputs` file, \
             and the program will be specialized on {}",
            if missing.len() == 1 { "" } else { "s" },
            list.join(", "),
            if missing.len() == 1 { "its" } else { "their" },
            if missing.len() == 1 { "" } else { "s" },
            if missing.len() == 1 { "it" } else { "them" },
            if missing.len() == 1 {
                "that value"
            } else {
                "those values"
            },
        )))
    }

    /// The slot for an ONNX name (initializers that are constants are decoded on first use).
    pub(crate) fn lookup(&mut self, name: &str) -> FResult<Slot> {
        if let Some(s) = self.env.get(name) {
            return Ok(s.clone());
        }
        match self.info.defs.get(name) {
            Some(Def::Init(_)) => {
                let t = self
                    .info
                    .init(name)
                    .ok_or_else(|| graph_err(format!("initializer `{name}` vanished")))?;
                let data = decode_tensor(t, &format!("initializer `{name}`"), self.model_dir)?;
                let s = self.named_const(data, name.to_string());
                self.env.insert(name.to_string(), s.clone());
                Ok(s)
            }
            _ => Err(graph_err(format!(
                "`{name}` is read before anything defines it"
            ))),
        }
    }
}

/// Most elements a value may have (keeps every later size computation from overflowing).
pub(crate) const MAX_ELEMENTS: usize = 1 << 48;

/// Whether a shape's element count is computable and at most [`MAX_ELEMENTS`].
pub(crate) fn size_ok(shape: &[usize]) -> bool {
    shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .is_some_and(|n| n <= MAX_ELEMENTS)
}

fn checked_numel(shape: &[usize]) -> FResult<usize> {
    shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .filter(|&n| n <= FOLD_MAX * 8)
        .ok_or_else(|| node_err(format!("a tensor of shape {shape:?} is too large")))
}

/// Evaluates an op on constants.
fn fold_op(op: &Op, ts: &[&Tensor]) -> FResult<Vec<Tensor>> {
    match (op, ts) {
        (Op::Identity, [t]) => Ok(vec![(*t).clone()]),
        (Op::Reshape { shape }, [t]) if numel(shape) == t.numel() => Ok(vec![Tensor {
            shape: shape.clone(),
            data: t.data.clone(),
        }]),
        _ => hzp_kernels::cpu::eval_op(op, ts).map_err(|e| {
            node_err(format!(
                "evaluating {} on constants at import time failed: {e}",
                op.name()
            ))
        }),
    }
}
