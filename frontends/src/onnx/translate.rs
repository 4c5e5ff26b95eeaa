//! The import driver and the translation context: the map from ONNX names to IR values or
//! import-time constants, constant folding, and the program being built.

use super::error::{graph_err, node_err, FResult, Fail, ImportErrorKind};
use super::graph::{classify_params, node_label, Def, GraphInfo, Signature};
use super::ops;
use super::proto::{
    data_type as dt, tensor_shape_proto::dimension, type_proto, AttributeProto, GraphProto,
    ModelProto, NodeProto, ValueInfoProto,
};
use super::tensor::{decode_tensor, dtype_of};
use super::ImportOptions;
use hzp_ir::{numel, DType, NameSet, Op, Program, Tensor, TensorType, ValueId};
use prost::Message;
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
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
    env: HashMap<String, Slot>,
    /// Sequences of tensors by ONNX name, element by element (see `ops::sequence`).
    pub seqs: HashMap<String, Rc<Vec<Slot>>>,
    info: &'g GraphInfo<'g>,
    model_dir: Option<&'g Path>,
    /// Graph inputs whose values were given (specialization candidates).
    given: &'g std::collections::BTreeSet<String>,
    /// Bytes of constants computed at import so far (checked against the memory budget:
    /// shapes bound by `--shape` can make folded tensors of any size).
    folded_bytes: u64,
    /// [`super::ImportOptions::shapes_only`].
    shapes_only: bool,
    /// Placeholders of a shapes-only import (values not computed), by value.
    placeholders: std::collections::HashSet<ValueId>,
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
    fn lookup(&mut self, name: &str) -> FResult<Slot> {
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

fn check_opsets(m: &ModelProto) -> FResult<()> {
    let mut default = None;
    for o in &m.opset_import {
        if o.domain.is_empty() || o.domain == "ai.onnx" {
            default = Some(o.version);
        }
    }
    match default {
        Some(v) if (MIN_OPSET..=MAX_OPSET).contains(&v) => Ok(()),
        Some(v) => Err(Fail::new(
            ImportErrorKind::Opset,
            format!(
                "unsupported opset {v} (hzp reads opsets {MIN_OPSET}-{MAX_OPSET} of the default \
                 ONNX domain; re-export with e.g. `opset_version=18`, or convert the model with \
                 onnx.version_converter)"
            ),
        )),
        None => Err(Fail::new(
            ImportErrorKind::Opset,
            format!(
                "the model imports no opset of the default ONNX domain (opset_import lists: {}); \
                 hzp reads opsets {MIN_OPSET}-{MAX_OPSET}",
                if m.opset_import.is_empty() {
                    "nothing".to_string()
                } else {
                    m.opset_import
                        .iter()
                        .map(|o| format!("`{}` {}", o.domain, o.version))
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ),
        )),
    }
}

/// Lists every op type of a live node that hzp cannot translate, in one error.
fn check_supported(info: &GraphInfo, m: &ModelProto) -> FResult<()> {
    let mut bad: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for ni in info.live_order() {
        let n = &info.graph.node[ni];
        if ops::is_supported(&n.domain, &n.op_type) {
            continue;
        }
        let mut key = if n.domain.is_empty() || n.domain == "ai.onnx" {
            n.op_type.clone()
        } else {
            format!("{}.{}", n.domain, n.op_type)
        };
        if m.functions
            .iter()
            .any(|f| f.name == n.op_type && f.domain == n.domain)
        {
            key.push_str(" (a model-local function)");
        }
        let who = if n.name.is_empty() {
            match n.output.iter().find(|o| !o.is_empty()) {
                Some(o) => format!("unnamed, writes `{o}`"),
                None => "unnamed".to_string(),
            }
        } else {
            n.name.clone()
        };
        bad.entry(key).or_default().push(who);
    }
    if bad.is_empty() {
        return Ok(());
    }
    let parts: Vec<String> = bad
        .iter()
        .map(|(op, nodes)| {
            let shown: Vec<&str> = nodes.iter().take(6).map(|s| s.as_str()).collect();
            let more = if nodes.len() > 6 {
                format!(", and {} more", nodes.len() - 6)
            } else {
                String::new()
            };
            format!("{op} (nodes: {}{more})", shown.join(", "))
        })
        .collect();
    let n = bad.len();
    Err(Fail::new(
        ImportErrorKind::Unsupported,
        format!(
            "the model uses {n} op type{} hzp does not support: {}",
            if n == 1 { "" } else { "s" },
            parts.join(", ")
        ),
    ))
}

fn signature(m: &ModelProto) -> Signature {
    const KEY: &str = "pkg.torch.export.ExportedProgram.graph_signature";
    let from_graph = m
        .graph
        .as_ref()
        .into_iter()
        .flat_map(|g| g.metadata_props.iter());
    from_graph
        .chain(m.metadata_props.iter())
        .find(|p| p.key == KEY)
        .map(|p| Signature::parse(&p.value))
        .unwrap_or_default()
}

/// A declared dim.
#[derive(Clone, Debug, PartialEq)]
enum Dim {
    Fixed(usize),
    Sym(String),
    Unknown,
}

fn fmt_dims(d: &[Dim]) -> String {
    let parts: Vec<String> = d
        .iter()
        .map(|d| match d {
            Dim::Fixed(n) => n.to_string(),
            Dim::Sym(s) => s.clone(),
            Dim::Unknown => "?".to_string(),
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

/// Element type and declared dims (`None`: rank unknown) of a value info.
fn declared(v: &ValueInfoProto, what: &str) -> FResult<(i32, Option<Vec<Dim>>)> {
    let shape_err = |m: String| Fail::new(ImportErrorKind::Shapes, m);
    let t = match v.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => t,
        Some(_) => {
            return Err(Fail::new(
                ImportErrorKind::Unsupported,
                format!(
                    "{what} `{}` is not a tensor (sequences, maps and optionals are not supported)",
                    v.name
                ),
            ))
        }
        None => return Err(shape_err(format!("{what} `{}` has no type", v.name))),
    };
    let dims = match &t.shape {
        None => None,
        Some(s) => {
            let mut out = Vec::new();
            for d in &s.dim {
                out.push(match &d.value {
                    Some(dimension::Value::DimValue(x)) => {
                        Dim::Fixed(usize::try_from(*x).map_err(|_| {
                            shape_err(format!("{what} `{}` declares a negative dim {x}", v.name))
                        })?)
                    }
                    Some(dimension::Value::DimParam(p)) if !p.is_empty() => Dim::Sym(p.clone()),
                    _ => Dim::Unknown,
                });
            }
            Some(out)
        }
    };
    Ok((t.elem_type, dims))
}

/// Static types for the graph inputs, from the declared shapes and the bindings.
fn bind_inputs(
    info: &GraphInfo,
    opts: &ImportOptions,
) -> FResult<(Vec<TensorType>, BTreeMap<String, usize>)> {
    let shape_err = |m: String| Fail::new(ImportErrorKind::Shapes, m);
    let mut decls = Vec::new();
    for v in &info.inputs {
        let (et, dims) = declared(v, "graph input")?;
        // Same mapping as for tensor data (and as hzp's .npz reader): DOUBLE inputs are fed
        // as f32, narrow integers widened.
        let dtype = dtype_of(et).ok_or_else(|| {
            Fail::new(
                ImportErrorKind::Unsupported,
                format!(
                    "graph input `{}` has element type {}, which hzp does not support",
                    v.name,
                    dt::name(et)
                ),
            )
        })?;
        decls.push((v.name.as_str(), dtype, dims));
    }
    // Symbols from explicit bindings.
    let mut symbols: BTreeMap<String, (usize, String)> = BTreeMap::new();
    let mut shapes: Vec<Option<Vec<usize>>> = vec![None; decls.len()];
    for (i, (name, _, dims)) in decls.iter().enumerate() {
        let Some(b) = opts.shapes.get(*name) else {
            continue;
        };
        check_binding(name, dims.as_deref(), b, &mut symbols)?;
        if !size_ok(b) {
            return Err(shape_err(format!(
                "the shape given for input `{name}` ({}) has too many elements",
                fmt_shape(b)
            )));
        }
        shapes[i] = Some(b.clone());
    }
    // Inputs without a binding: fixed dims and symbols bound elsewhere.
    let mut missing = Vec::new();
    for (i, (name, _, dims)) in decls.iter().enumerate() {
        if shapes[i].is_some() {
            continue;
        }
        let derived: Option<Vec<usize>> = dims.as_ref().and_then(|dims| {
            dims.iter()
                .map(|d| match d {
                    Dim::Fixed(n) => Some(*n),
                    Dim::Sym(s) => symbols.get(s).map(|(x, _)| *x),
                    Dim::Unknown => None,
                })
                .collect()
        });
        match derived {
            Some(s) => shapes[i] = Some(s),
            None => missing.push(match dims {
                Some(d) => format!("`{name}` {}", fmt_dims(d)),
                None => format!("`{name}` (rank not declared)"),
            }),
        }
    }
    if !missing.is_empty() {
        return Err(missing_shapes(&decls, &shapes, &missing, opts));
    }
    let tys = decls
        .iter()
        .zip(shapes)
        .map(|((_, d, _), s)| TensorType::new(*d, s.unwrap_or_default()))
        .collect();
    Ok((tys, symbols.into_iter().map(|(k, (v, _))| (k, v)).collect()))
}

/// A `--shape` binding `b` of input `name` against its declared `dims`: the same rank,
/// fixed dims kept, each symbolic dim one size across the bindings (recorded in `symbols`
/// with the input that gave it).
fn check_binding(
    name: &str,
    dims: Option<&[Dim]>,
    b: &[usize],
    symbols: &mut BTreeMap<String, (usize, String)>,
) -> FResult<()> {
    let shape_err = |m: String| Fail::new(ImportErrorKind::Shapes, m);
    if let Some(dims) = dims {
        if dims.len() != b.len() {
            return Err(shape_err(format!(
                "the shape given for input `{name}` ({}) has rank {}, but the model declares \
                 `{name}` with rank {} {}",
                fmt_shape(b),
                b.len(),
                dims.len(),
                fmt_dims(dims)
            )));
        }
        for (k, (d, &x)) in dims.iter().zip(b).enumerate() {
            match d {
                Dim::Fixed(n) if *n != x => {
                    return Err(shape_err(format!(
                        "the shape given for input `{name}` ({}) has {x} in dim {k}, but the \
                         model fixes that dim to {n} (declared {})",
                        fmt_shape(b),
                        fmt_dims(dims)
                    )))
                }
                Dim::Sym(s) => match symbols.get(s) {
                    Some((prev, from)) if *prev != x => {
                        return Err(shape_err(format!(
                            "symbolic dim `{s}` is {prev} in the shape given for input \
                             `{from}` but {x} in the one given for `{name}`"
                        )))
                    }
                    Some(_) => {}
                    None => {
                        symbols.insert(s.clone(), (x, name.to_string()));
                    }
                },
                _ => {}
            }
        }
    }
    Ok(())
}

/// The error for inputs whose shapes are not known (`missing`, described), with an example
/// `--shape` and the names given that are not inputs.
fn missing_shapes(
    decls: &[(&str, DType, Option<Vec<Dim>>)],
    shapes: &[Option<Vec<usize>>],
    missing: &[String],
    opts: &ImportOptions,
) -> Fail {
    let shape_err = |m: String| Fail::new(ImportErrorKind::Shapes, m);
    let example = decls
        .iter()
        .zip(shapes)
        .find(|(_, s)| s.is_none())
        .map(|((n, _, d), _)| {
            let ex: Vec<String> = match d {
                Some(d) => d
                    .iter()
                    .enumerate()
                    .map(|(k, d)| match d {
                        Dim::Fixed(x) => x.to_string(),
                        _ if k == 0 => "2".to_string(),
                        _ => "16".to_string(),
                    })
                    .collect(),
                None => vec!["2".into(), "16".into()],
            };
            format!("{n}={}", ex.join("x"))
        })
        .unwrap_or_default();
    let unknown: Vec<&str> = opts
        .shapes
        .keys()
        .filter(|k| !decls.iter().any(|(n, _, _)| n == k))
        .map(|k| k.as_str())
        .collect();
    let hint = if unknown.is_empty() {
        String::new()
    } else {
        format!(
            " (shapes were given for {}, which {} not a graph input; the inputs are {})",
            {
                // name a few; an inputs file for another model can hold hundreds
                let mut shown: Vec<String> =
                    unknown.iter().take(6).map(|u| format!("`{u}`")).collect();
                if unknown.len() > 6 {
                    shown.push(format!("and {} more", unknown.len() - 6));
                }
                shown.join(", ")
            },
            if unknown.len() == 1 { "is" } else { "are" },
            decls
                .iter()
                .map(|(n, _, _)| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    shape_err(format!(
        "hzp needs static shapes, and {} with symbolic dims {} no shape: {}. Pass one \
         `--shape NAME=AxB` per input (e.g. `--shape {example}`), or `--inputs FILE.npz` with \
         example inputs{hint}",
        if missing.len() == 1 {
            "this input"
        } else {
            "these inputs"
        },
        if missing.len() == 1 { "has" } else { "have" },
        missing.join(", ")
    ))
}

fn fmt_shape(s: &[usize]) -> String {
    s.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("x")
}

/// Checks a graph output's declared type against what hzp computed.
fn check_output(
    v: &ValueInfoProto,
    got: &TensorType,
    symbols: &BTreeMap<String, usize>,
) -> FResult<()> {
    if v.r#type.is_none() {
        return Ok(());
    }
    let (et, dims) = declared(v, "graph output")?;
    let mismatch = |why: String| {
        Fail::new(
            ImportErrorKind::Node,
            format!(
                "graph output `{}` is declared as {} {} but hzp computes {got} ({why}); the \
                 model or hzp's translation is wrong",
                v.name,
                dt::name(et),
                dims.as_ref()
                    .map(|d| fmt_dims(d))
                    .unwrap_or_else(|| "[?]".into())
            ),
        )
    };
    if et != dt::UNDEFINED && dtype_of(et) != Some(got.dtype) {
        return Err(mismatch("element types differ".into()));
    }
    if let Some(dims) = &dims {
        if dims.len() != got.shape.len() {
            return Err(mismatch("ranks differ".into()));
        }
        for (k, (d, &x)) in dims.iter().zip(&got.shape).enumerate() {
            let want = match d {
                Dim::Fixed(n) => Some(*n),
                Dim::Sym(s) => symbols.get(s).copied(),
                Dim::Unknown => None,
            };
            if let Some(w) = want {
                if w != x {
                    return Err(mismatch(format!("dim {k} is {x}, expected {w}")));
                }
            }
        }
    }
    Ok(())
}

/// The whole import. A value that decides a shape and is computed from graph inputs whose
/// values are given makes the import start again, specialized on those inputs.
pub(crate) fn import(
    bytes: &[u8],
    model_dir: Option<&Path>,
    name: &str,
    opts: &ImportOptions,
) -> FResult<Program> {
    let mut on: BTreeMap<String, Tensor> = BTreeMap::new();
    loop {
        match import_specialized(bytes, model_dir, name, opts, &on) {
            Err(f)
                if !f.specialize.is_empty() && f.specialize.iter().any(|i| !on.contains_key(i)) =>
            {
                for i in f.specialize {
                    let t = given_value(bytes, opts, &i)?;
                    on.insert(i, t);
                }
            }
            Err(mut f) => {
                if !f.specialize.is_empty() {
                    // not expected: the inputs were folded and the value still is not
                    f.message = format!("{} (internal: specializing did not help)", f.message);
                }
                return Err(f);
            }
            Ok(p) => return Ok(p),
        }
    }
}

/// The value given for graph input `name`: `--bind` numbers read with the input's declared
/// type and bound shape, else the array given.
fn given_value(bytes: &[u8], opts: &ImportOptions, name: &str) -> FResult<Tensor> {
    if let Some(t) = opts.values.get(name) {
        if !opts.bind.contains_key(name) {
            return Ok(t.clone());
        }
    }
    let nums = opts
        .bind
        .get(name)
        .ok_or_else(|| node_err(format!("internal: no value for input `{name}`")))?;
    let model = ModelProto::decode(bytes).map_err(|e| node_err(e.to_string()))?;
    let v = model
        .graph
        .as_ref()
        .and_then(|g| g.input.iter().find(|v| v.name == name))
        .ok_or_else(|| node_err(format!("`{name}` is not a graph input")))?;
    let (et, dims) = declared(v, "graph input")?;
    let dtype = dtype_of(et).unwrap_or(DType::I64);
    let shape = bind_shape(opts, name, dims.as_deref(), nums.len())?;
    Ok(Tensor::from_f64(dtype, shape, nums))
}

/// The shape of a `--bind` value with `n` numbers.
fn bind_shape(
    opts: &ImportOptions,
    name: &str,
    dims: Option<&[Dim]>,
    n: usize,
) -> FResult<Vec<usize>> {
    let shape = if let Some(s) = opts.shapes.get(name) {
        s.clone()
    } else {
        match dims {
            Some([]) => vec![],
            Some(d) if d.iter().all(|d| matches!(d, Dim::Fixed(_))) => d
                .iter()
                .map(|d| match d {
                    Dim::Fixed(x) => *x,
                    _ => 0,
                })
                .collect(),
            _ => vec![n],
        }
    };
    if numel(&shape) != n {
        return Err(Fail::new(
            ImportErrorKind::Shapes,
            format!(
                "--bind gives {n} number{} for input `{name}`, whose shape is [{}] ({} elements)",
                if n == 1 { "" } else { "s" },
                fmt_shape(&shape),
                numel(&shape)
            ),
        ));
    }
    Ok(shape)
}

fn import_specialized(
    bytes: &[u8],
    model_dir: Option<&Path>,
    name: &str,
    opts: &ImportOptions,
    on: &BTreeMap<String, Tensor>,
) -> FResult<Program> {
    let mut model = decode_model(bytes)?;
    let keys = match &opts.names {
        Some(map) => super::rename::apply(&mut model, map, model_dir)?,
        None => Vec::new(),
    };
    let g = model
        .graph
        .as_ref()
        .ok_or_else(|| Fail::new(ImportErrorKind::Decode, "the model holds no graph"))?;
    check_opsets(&model)?;
    let info = GraphInfo::new(g)?;
    check_supported(&info, &model)?;
    let mut sig = signature(&model);
    sig.params.extend(keys);
    let is_param = classify_params(&info, &sig);
    let bound = bound_shapes(&info, opts)?;
    let (input_tys, symbols) = bind_inputs(&info, &bound)?;
    let given: std::collections::BTreeSet<String> = opts
        .values
        .keys()
        .chain(opts.bind.keys())
        .cloned()
        .collect();

    let names = graph_names(g, &info);
    let mut cx = Ctx {
        prog: Program::new(name),
        names,
        env: HashMap::new(),
        seqs: HashMap::new(),
        info: &info,
        model_dir,
        given: &given,
        folded_bytes: 0,
        shapes_only: opts.shapes_only,
        placeholders: Default::default(),
    };
    for (v, ty) in info.inputs.iter().zip(input_tys) {
        if let Some(t) = on.get(&v.name) {
            if t.ty() != ty {
                return Err(Fail::new(
                    ImportErrorKind::Shapes,
                    format!(
                        "the value given for input `{}` is {}, but the input is {ty}",
                        v.name,
                        t.ty()
                    ),
                ));
            }
            // The input stays (the evaluator checks that it keeps this value); the program
            // reads the value as a constant.
            cx.prog.add_input(v.name.clone(), ty);
            cx.prog.specialized.insert(v.name.clone(), t.clone());
            let cname = cx.fresh(&v.name);
            let s = cx.named_const(t.clone(), cname);
            cx.env.insert(v.name.clone(), s);
            continue;
        }
        let id = cx.prog.add_input(v.name.clone(), ty);
        cx.env.insert(v.name.clone(), Slot::Val(id));
    }
    for (i, t) in g.initializer.iter().enumerate() {
        if !is_param[i] {
            continue;
        }
        let data = decode_tensor(t, &format!("initializer `{}`", t.name), model_dir)?;
        let id = cx.prog.add_param(t.name.clone(), data.ty(), Some(data));
        cx.env.insert(t.name.clone(), Slot::Val(id));
    }

    translate_nodes(&mut cx, g, &info)?;

    let outputs = graph_outputs(&mut cx, g, &symbols)?;
    let mut prog = cx.prog;
    prog.outputs = outputs;
    prog.eliminate_dead_code();
    hzp_ir::verify(&prog).map_err(|e| {
        Fail::new(
            ImportErrorKind::Verify,
            format!(
                "internal error: the imported program does not verify ({e}); please report this \
                 with the model"
            ),
        )
    })?;
    Ok(prog)
}

/// The model in `bytes`, with a graph; errors say what the bytes are instead.
fn decode_model(bytes: &[u8]) -> FResult<ModelProto> {
    let decode = |m: String| Fail::new(ImportErrorKind::Decode, m);
    if bytes.is_empty() {
        return Err(decode(
            "the file is empty (0 bytes), not an ONNX model".into(),
        ));
    }
    let model = ModelProto::decode(bytes).map_err(|e| {
        decode(format!(
            "the file is not a valid ONNX model: protobuf decoding failed ({e}); is it truncated \
             or another kind of file?"
        ))
    })?;
    if model.graph.is_none() {
        return Err(decode(
            "the file decodes as protobuf but holds no ONNX graph; is it an ONNX model?".into(),
        ));
    }
    Ok(model)
}

/// The shape bindings to import with: `--shape`'s, plus the shapes of `--bind` values of
/// inputs without one (only the shapes: `values` may hold large arrays).
fn bound_shapes(info: &GraphInfo, opts: &ImportOptions) -> FResult<ImportOptions> {
    let mut bound = ImportOptions {
        shapes: opts.shapes.clone(),
        ..Default::default()
    };
    for (name, nums) in &opts.bind {
        if !info.inputs.iter().any(|v| v.name == *name) {
            return Err(Fail::new(
                ImportErrorKind::Shapes,
                format!(
                    "--bind gives a value for `{name}`, which is not a graph input (the inputs \
                     are {})",
                    info.inputs
                        .iter()
                        .map(|v| format!("`{}`", v.name))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        if let Some(v) = info.inputs.iter().find(|v| v.name == *name) {
            if !bound.shapes.contains_key(name) {
                let (_, dims) = declared(v, "graph input")?;
                let shape = bind_shape(opts, name, dims.as_deref(), nums.len())?;
                bound.shapes.insert(name.clone(), shape);
            }
        }
    }
    Ok(bound)
}

/// Every name the graph already uses (inputs, initializers, node outputs, graph outputs),
/// so that fresh names never collide with them.
fn graph_names(g: &GraphProto, info: &GraphInfo) -> NameSet {
    let mut names = NameSet::default();
    for v in &info.inputs {
        names.insert(&v.name);
    }
    for t in &g.initializer {
        names.insert(&t.name);
    }
    for n in &g.node {
        for o in &n.output {
            if !o.is_empty() {
                names.insert(o);
            }
        }
    }
    for o in &g.output {
        names.insert(&o.name);
    }
    names
}

/// Translates the live nodes in order, binding each ONNX output to its slot; an output
/// something reads but hzp does not compute is an error.
fn translate_nodes(cx: &mut Ctx, g: &GraphProto, info: &GraphInfo) -> FResult<()> {
    for ni in info.live_order() {
        let p = &g.node[ni];
        let label = node_label(p);
        let prefix = |f: Fail| Fail {
            kind: f.kind,
            message: format!("{label}: {}", f.message),
            specialize: f.specialize,
        };
        let mut ins = Vec::with_capacity(p.input.len());
        let mut seqs = Vec::with_capacity(p.input.len());
        for (k, i) in p.input.iter().enumerate() {
            if let Some(s) = cx.seqs.get(i) {
                if !ops::takes_sequences(&p.domain, &p.op_type) {
                    return Err(prefix(node_err(format!(
                        "input {k} (`{i}`) is a sequence of tensors, but {} takes tensors                          (a sequence can only go into SequenceAt, ConcatFromSequence,                          SequenceLength, SequenceInsert or SequenceErase)",
                        p.op_type
                    ))));
                }
                ins.push(None);
                seqs.push(Some(s.clone()));
                continue;
            }
            seqs.push(None);
            ins.push(if i.is_empty() {
                None
            } else {
                Some(cx.lookup(i).map_err(prefix)?)
            });
        }
        let ir_name = if !p.name.is_empty() {
            p.name.clone()
        } else {
            p.output
                .iter()
                .find(|o| !o.is_empty())
                .cloned()
                .unwrap_or_else(|| p.op_type.clone())
        };
        let n = NodeCx {
            p,
            ir_name,
            ins,
            seqs,
        };
        let outs = ops::translate(cx, &n).map_err(prefix)?;
        for (k, o) in p.output.iter().enumerate() {
            if o.is_empty() {
                continue;
            }
            match outs.get(k).cloned().flatten() {
                Some(s) => {
                    cx.env.insert(o.clone(), s);
                }
                None if cx.seqs.contains_key(o) => {}
                None if info.used.contains(o.as_str()) => {
                    return Err(node_err(format!(
                        "{label}: output {k} (`{o}`) is used, but hzp does not compute it for {}",
                        p.op_type
                    )));
                }
                None => {}
            }
        }
    }
    Ok(())
}

/// The graph outputs as IR values under their ONNX names (an alias gets an Identity node),
/// checked against their declared types.
fn graph_outputs(
    cx: &mut Ctx,
    g: &GraphProto,
    symbols: &BTreeMap<String, usize>,
) -> FResult<Vec<ValueId>> {
    let mut outputs = Vec::new();
    for o in &g.output {
        if cx.seqs.contains_key(&o.name) {
            return Err(graph_err(format!(
                "graph output `{}` is a sequence of tensors; hzp's programs output tensors \
                 (ConcatFromSequence or SequenceAt make one)",
                o.name
            )));
        }
        let s = cx.lookup(&o.name)?;
        let id = match &s {
            Slot::Val(v) if cx.prog.value(*v).name == o.name => *v,
            Slot::Const(c) if c.name == o.name => cx.materialize(&s),
            _ => {
                // The output's ONNX name belongs to no IR value (aliases like Identity):
                // give it one.
                let v = cx.materialize(&s);
                if cx.prog.find_value(&o.name).is_some() {
                    return Err(graph_err(format!(
                        "graph output `{}` cannot keep its name",
                        o.name
                    )));
                }
                let r = cx
                    .prog
                    .add_node(o.name.clone(), Op::Identity, vec![v], vec![o.name.clone()])
                    .map_err(node_err)?;
                r[0]
            }
        };
        check_output(o, cx.prog.ty(id), symbols)?;
        outputs.push(id);
    }
    Ok(outputs)
}
