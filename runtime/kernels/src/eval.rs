//! Program evaluation on the CPU: runs a forward program node by node with [`eval_op`],
//! freeing every intermediate after its last use so memory stays bounded by the live set.

use crate::cpu::eval_op;
use hzp_ir::{Op, Program, Tensor, TensorType, ValueDef, ValueId};
use std::borrow::Cow;
use std::collections::HashMap;
use thiserror::Error;

/// Why a program could not be evaluated. Every variant names what it is about.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum EvalError {
    /// The inputs given do not match the program's inputs by name.
    #[error("inputs do not match the program: {}", describe_names(.missing, .unexpected, .duplicate))]
    InputNames {
        missing: Vec<String>,
        unexpected: Vec<String>,
        duplicate: Vec<String>,
    },
    /// An input has the wrong dtype or shape.
    #[error("input `{name}` is {got}, expected {expected}")]
    InputType {
        name: String,
        expected: TensorType,
        got: TensorType,
    },
    /// An input differs from the value the program was specialized on at import.
    #[error("{0}")]
    Specialized(String),
    /// A parameter without data (shapes-only programs such as presets).
    #[error("parameter `{name}` has no data (a shapes-only program, e.g. a preset, cannot be evaluated)")]
    ParamWithoutData { name: String },
    /// A parameter or constant whose data does not match its declared type.
    #[error("{kind} `{name}` holds {got} data but is declared {expected}")]
    DataType {
        kind: &'static str,
        name: String,
        expected: TensorType,
        got: TensorType,
    },
    /// A node's kernel failed.
    #[error("node \"{node}\" ({op}): {message}")]
    Node {
        node: String,
        op: &'static str,
        message: String,
    },
    /// The program itself is inconsistent (run the verifier).
    #[error("malformed program: {0}")]
    Malformed(String),
    /// An integer input used as an index holds a value outside its range (see
    /// [`crate::index_check`]).
    #[error("{0}")]
    IndexRange(String),
}

fn describe_names(missing: &[String], unexpected: &[String], duplicate: &[String]) -> String {
    let list = |v: &[String]| {
        v.iter()
            .map(|n| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(format!("missing {}", list(missing)));
    }
    if !unexpected.is_empty() {
        parts.push(format!("unexpected {}", list(unexpected)));
    }
    if !duplicate.is_empty() {
        parts.push(format!("given twice {}", list(duplicate)));
    }
    parts.join("; ")
}

/// Checks that a tensor's element count matches its own shape (fields are public).
fn consistent(t: &Tensor) -> bool {
    crate::cpu::layout::checked_numel(&t.shape) == Some(t.data.len())
}

/// Runs the forward program `p` on named `inputs`; returns the program outputs in
/// `p.outputs` order, keyed by value name.
///
/// Parameters come from [`hzp_ir::Param::data`], constants from the program. Nodes run in
/// order; each intermediate is dropped right after its last reader, so peak memory is the
/// largest live set, not the sum of all activations. Memory and stream ops (`Free`,
/// `RecordEvent`, `WaitEvent`) are no-ops here; collectives are errors.
pub fn evaluate(
    p: &Program,
    inputs: &[(String, Tensor)],
) -> Result<Vec<(String, Tensor)>, EvalError> {
    evaluate_with_stats(p, inputs).map(|(outs, _)| outs)
}

/// Memory statistics of one evaluation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EvalStats {
    /// The most bytes of node results alive at once (inputs, parameters and constants are
    /// borrowed, not counted).
    pub peak_live_bytes: usize,
}

/// [`evaluate`], also reporting how much intermediate memory was alive at the peak.
pub fn evaluate_with_stats(
    p: &Program,
    inputs: &[(String, Tensor)],
) -> Result<(Vec<(String, Tensor)>, EvalStats), EvalError> {
    // the whole program on a thread of the kernels' pool (see `cpu::threads`)
    crate::cpu::threads::install(|| evaluate_here(p, inputs))
}

fn evaluate_here(
    p: &Program,
    inputs: &[(String, Tensor)],
) -> Result<(Vec<(String, Tensor)>, EvalStats), EvalError> {
    let nv = p.values.len();
    let mut slots: Vec<Option<Cow<'_, Tensor>>> = vec![None; nv];
    bind_inputs(p, inputs, &mut slots)?;
    bind_data(p, &mut slots)?;
    for n in &p.nodes {
        for &v in n.inputs.iter().chain(&n.outputs) {
            in_range(p, v)?;
        }
    }
    let mut is_output = vec![false; nv];
    for &o in &p.outputs {
        is_output[in_range(p, o)?.index()] = true;
    }
    let mut ev = Evaluator::new(p, slots, is_output);
    for (i, node) in p.nodes.iter().enumerate() {
        ev.run_node(i, node)?;
    }
    ev.finish()
}

/// `v`, if the program has it.
fn in_range(p: &Program, v: ValueId) -> Result<ValueId, EvalError> {
    if v.index() < p.values.len() {
        Ok(v)
    } else {
        Err(EvalError::Malformed(format!(
            "reference to missing value {v}"
        )))
    }
}

/// Binds the inputs by name: each of the program's inputs given once, nothing else, each
/// of its type (and as the program was specialized); token ids and labels in range.
fn bind_inputs<'a>(
    p: &'a Program,
    inputs: &'a [(String, Tensor)],
    slots: &mut [Option<Cow<'a, Tensor>>],
) -> Result<(), EvalError> {
    let by_name: HashMap<&str, ValueId> = p
        .inputs
        .iter()
        .map(|&v| in_range(p, v).map(|v| (p.value(v).name.as_str(), v)))
        .collect::<Result<_, _>>()?;
    let mut given: HashMap<&str, &Tensor> = HashMap::new();
    let (mut unexpected, mut duplicate) = (Vec::new(), Vec::new());
    for (name, t) in inputs {
        if !by_name.contains_key(name.as_str()) {
            unexpected.push(name.clone());
        } else if given.insert(name.as_str(), t).is_some() {
            duplicate.push(name.clone());
        }
    }
    let missing: Vec<String> = p
        .inputs
        .iter()
        .map(|&v| &p.value(v).name)
        .filter(|n| !given.contains_key(n.as_str()))
        .cloned()
        .collect();
    if !missing.is_empty() || !unexpected.is_empty() || !duplicate.is_empty() {
        return Err(EvalError::InputNames {
            missing,
            unexpected,
            duplicate,
        });
    }
    p.check_specialized(given.iter().map(|(k, t)| (*k, *t)))
        .map_err(EvalError::Specialized)?;
    for &v in &p.inputs {
        let value = p.value(v);
        let t = given[value.name.as_str()];
        if t.ty() != value.ty || !consistent(t) {
            return Err(EvalError::InputType {
                name: value.name.clone(),
                expected: value.ty.clone(),
                got: t.ty(),
            });
        }
        slots[v.index()] = Some(Cow::Borrowed(t));
    }
    crate::index_check::check_index_inputs(p, inputs).map_err(EvalError::IndexRange)
}

/// Binds the parameters and constants: each with data of its type.
fn bind_data<'a>(p: &'a Program, slots: &mut [Option<Cow<'a, Tensor>>]) -> Result<(), EvalError> {
    for prm in &p.params {
        let v = in_range(p, prm.value)?;
        let value = p.value(v);
        let t = prm
            .data
            .as_ref()
            .ok_or_else(|| EvalError::ParamWithoutData {
                name: value.name.clone(),
            })?;
        if t.ty() != value.ty || !consistent(t) {
            return Err(EvalError::DataType {
                kind: "parameter",
                name: value.name.clone(),
                expected: value.ty.clone(),
                got: t.ty(),
            });
        }
        slots[v.index()] = Some(Cow::Borrowed(t));
    }
    for c in &p.consts {
        let v = in_range(p, c.value)?;
        let value = p.value(v);
        if c.data.ty() != value.ty || !consistent(&c.data) {
            return Err(EvalError::DataType {
                kind: "constant",
                name: value.name.clone(),
                expected: value.ty.clone(),
                got: c.data.ty(),
            });
        }
        slots[v.index()] = Some(Cow::Borrowed(&c.data));
    }
    Ok(())
}

/// An error of `node`.
fn node_err(node: &hzp_ir::Node, message: String) -> EvalError {
    EvalError::Node {
        node: node.name.clone(),
        op: node.op.name(),
        message,
    }
}

/// `node` reads `v`, which is not bound.
fn not_computed(p: &Program, node: &hzp_ir::Node, v: ValueId) -> EvalError {
    node_err(
        node,
        format!(
            "input `{}` has not been computed (nodes out of order?)",
            p.value(v).name
        ),
    )
}

/// One evaluation: the values bound so far, what was planned before the run (views,
/// MatMuls deferred to a transpose, liveness, fused runs), and the memory counters.
struct Evaluator<'a> {
    p: &'a Program,
    slots: Vec<Option<Cow<'a, Tensor>>>,
    is_output: Vec<bool>,
    /// Transposes and reshapes that only MatMuls read, as strided views.
    views: Vec<Option<views::View>>,
    /// At a transpose: the MatMul that runs there.
    runs_mm: Vec<Option<usize>>,
    /// MatMuls that run at a transpose instead.
    deferred_mm: Vec<bool>,
    /// The last node reading each value (outputs live to the end).
    last_use: Vec<Option<usize>>,
    fusion: crate::fuse::Plan,
    stats: EvalStats,
    live_bytes: usize,
    profile: Option<profile::Profile>,
}

impl<'a> Evaluator<'a> {
    /// Plans the run of `p` with its inputs, parameters and constants bound in `slots`.
    fn new(
        p: &'a Program,
        slots: Vec<Option<Cow<'a, Tensor>>>,
        is_output: Vec<bool>,
    ) -> Evaluator<'a> {
        // ---- transposes and reshapes that only MatMuls read become strided views
        let views = views::plan(p, &is_output);
        // ---- a MatMul read only by a transpose of its last two axes runs at the transpose,
        // as the product of its transposed operands: (a b)^T = b^T a^T, no copy
        let (mut runs_mm, mut deferred_mm) =
            (vec![None; p.nodes.len()], vec![false; p.nodes.len()]);
        for (t, m) in views::plan_swapped(p, &is_output, &views) {
            runs_mm[t] = Some(m);
            deferred_mm[m] = true;
        }
        let mut ev = Evaluator {
            p,
            slots,
            last_use: vec![None; p.values.len()],
            is_output,
            views,
            runs_mm,
            deferred_mm,
            fusion: crate::fuse::Plan::default(),
            stats: EvalStats::default(),
            live_bytes: 0,
            profile: None,
        };
        // ---- liveness: the last node reading each value; outputs live to the end
        for (i, n) in p.nodes.iter().enumerate() {
            if views::is_view_node(n, &ev.views) || ev.deferred_mm[i] {
                continue;
            }
            for &v in ev.reads(i) {
                let s = ev.source(v);
                ev.last_use[s.index()] = Some(i);
            }
        }
        // ---- runs of elementwise nodes that execute as one fused pass
        if crate::fuse::enabled() {
            ev.fusion = crate::fuse::plan(p, &ev.is_output, |i| {
                views::is_view_node(&p.nodes[i], &ev.views)
                    || ev.deferred_mm[i]
                    || ev.runs_mm[i].is_some()
            });
        }
        ev.profile = profile::enabled().then(profile::Profile::default);
        ev
    }

    /// The value a node really reads: a view's source.
    fn source(&self, v: ValueId) -> ValueId {
        self.views[v.index()].as_ref().map_or(v, |w| w.src)
    }

    /// The inputs node `i` reads at run time.
    fn reads(&self, i: usize) -> &'a [ValueId] {
        let p = self.p;
        match self.runs_mm[i] {
            Some(m) => &p.nodes[m].inputs,
            None => &p.nodes[i].inputs,
        }
    }

    /// Runs node `i` (unless it is a view, deferred, or no computation), or the fused run
    /// it starts.
    fn run_node(&mut self, i: usize, node: &'a hzp_ir::Node) -> Result<(), EvalError> {
        if matches!(
            node.op,
            Op::Free | Op::RecordEvent { .. } | Op::WaitEvent { .. }
        ) {
            return Ok(());
        }
        if views::is_view_node(node, &self.views) || self.deferred_mm[i] {
            return Ok(());
        }
        if let Some(g) = self.fusion.group_of.get(i).copied().flatten() {
            // a fused run executes whole at its first node
            if i == self.fusion.groups[g].first {
                self.run_fused(g, node)?;
            }
            return Ok(());
        }
        if self.runs_mm[i].is_some() || node.inputs.iter().any(|v| self.views[v.index()].is_some())
        {
            return self.run_view_matmul(i, node);
        }
        self.run_plain(i, node)
    }

    /// Runs fused group `g` (at its first node, `node`).
    fn run_fused(&mut self, g: usize, node: &hzp_ir::Node) -> Result<(), EvalError> {
        let p = self.p;
        let group = &self.fusion.groups[g];
        // inputs that die here and that the run may reuse are given up to it
        let dies = |v: ValueId| {
            self.last_use[v.index()].is_some_and(|u| u <= group.last) && !self.is_output[v.index()]
        };
        let mut given: Vec<Option<Tensor>> = vec![None; group.inputs.len()];
        for d in group.donations() {
            let j = group.inputs.iter().position(|&v| v == d);
            let owned = matches!(self.slots[d.index()], Some(Cow::Owned(_)));
            if let (Some(j), true, true) = (j, dies(d), owned) {
                if let Some(Cow::Owned(t)) = self.slots[d.index()].take() {
                    self.live_bytes -= t.size_bytes();
                    given[j] = Some(t);
                }
            }
        }
        let mut args = Vec::with_capacity(group.inputs.len());
        for (&v, g) in group.inputs.iter().zip(given) {
            args.push(match g {
                Some(t) => crate::fuse::Input::Owned(t),
                None => crate::fuse::Input::Borrowed(
                    self.slots[v.index()]
                        .as_deref()
                        .ok_or_else(|| not_computed(p, node, v))?,
                ),
            });
        }
        let started = self.profile.as_ref().map(|prof| {
            (
                prof.fused_key(&group.op_names(), group.elements()),
                profile::Stamp::now(),
            )
        });
        let results = crate::fuse::run(group, args).map_err(|m| node_err(node, m))?;
        if let (Some(prof), Some((key, t0))) = (self.profile.as_mut(), started) {
            prof.record(key, t0);
        }
        for (v, t) in group.output_values().zip(results) {
            self.live_bytes += t.size_bytes();
            self.slots[v.index()] = Some(Cow::Owned(t));
        }
        self.stats.peak_live_bytes = self.stats.peak_live_bytes.max(self.live_bytes);
        for &v in &group.inputs {
            let dead = self.last_use[v.index()].is_some_and(|u| u <= group.last);
            if dead && !self.is_output[v.index()] {
                if let Some(Cow::Owned(t)) = self.slots[v.index()].take() {
                    self.live_bytes -= t.size_bytes();
                }
            }
        }
        Ok(())
    }

    /// A MatMul reading a view (the planner allows no other reader), or a transpose
    /// running the MatMul it was deferred from (node `i`).
    fn run_view_matmul(&mut self, i: usize, node: &'a hzp_ir::Node) -> Result<(), EvalError> {
        let p = self.p;
        let nerr = |m: String| node_err(node, m);
        let swapped = self.runs_mm[i];
        let (mm_op, mm_inputs) = match swapped {
            Some(m) => (&p.nodes[m].op, &p.nodes[m].inputs[..]),
            None => (&node.op, &node.inputs[..]),
        };
        let started = self.profile.as_ref().map(|prof| {
            let shapes: Vec<&[usize]> = mm_inputs.iter().map(|&v| &p.ty(v).shape[..]).collect();
            (prof.view_key(mm_op, &shapes), profile::Stamp::now())
        });
        let mut operands = Vec::with_capacity(2);
        for &v in mm_inputs {
            let src = self.slots[self.source(v).index()]
                .as_deref()
                .ok_or_else(|| not_computed(p, node, v))?;
            operands.push(views::operand(src, self.views[v.index()].as_ref()).map_err(nerr)?);
        }
        let (Op::MatMul, [a, b]) = (mm_op, &operands[..]) else {
            return Err(nerr("internal: a strided view read by a non-MatMul".into()));
        };
        let (out, shape) = if swapped.is_some() {
            let (at, bt) = (a.swap_last2(), b.swap_last2());
            crate::cpu::matmul::matmul_views(&bt, &at).map_err(nerr)?
        } else {
            crate::cpu::matmul::matmul_views(a, b).map_err(nerr)?
        };
        drop(operands);
        if let (Some(prof), Some((key, t0))) = (self.profile.as_mut(), started) {
            prof.record(key, t0);
        }
        let t = Tensor {
            shape,
            data: hzp_ir::Data::F32(out),
        };
        self.store_and_free(i, node, vec![t], mm_inputs)
    }

    /// Runs node `i` with [`eval_op`], or, for a reshape or identity of a dying
    /// intermediate, by reusing its buffer.
    fn run_plain(&mut self, i: usize, node: &'a hzp_ir::Node) -> Result<(), EvalError> {
        let p = self.p;
        let nerr = |m: String| node_err(node, m);
        let args: Vec<&Tensor> = node
            .inputs
            .iter()
            .map(|&v| {
                self.slots[v.index()]
                    .as_deref()
                    .ok_or_else(|| not_computed(p, node, v))
            })
            .collect::<Result<_, _>>()?;
        // a reshape or identity of a dying intermediate reuses its buffer
        let reuse = node.op.is_view()
            && node.inputs.len() == 1
            && node.outputs.len() == 1
            && self.last_use[node.inputs[0].index()] == Some(i)
            && !self.is_output[node.inputs[0].index()]
            && matches!(self.slots[node.inputs[0].index()], Some(Cow::Owned(_)))
            && args[0].numel() == p.value(in_range(p, node.outputs[0])?).ty.numel();
        let started = self
            .profile
            .as_ref()
            .map(|prof| (prof.key(&node.op, &args, reuse), profile::Stamp::now()));
        let results = if reuse {
            drop(args);
            let v = node.inputs[0].index();
            let Some(Cow::Owned(mut t)) = self.slots[v].take() else {
                return Err(nerr("internal: reused input vanished".into()));
            };
            self.live_bytes -= t.size_bytes();
            t.shape = p.value(node.outputs[0]).ty.shape.clone();
            vec![t]
        } else {
            let r = eval_op(&node.op, &args).map_err(nerr)?;
            drop(args);
            r
        };
        if let (Some(prof), Some((key, t0))) = (self.profile.as_mut(), started) {
            prof.record(key, t0);
        }
        self.store_and_free(i, node, results, &node.inputs)
    }

    /// Binds node `i`'s results (see [`store`]), counts the peak, and frees what it was
    /// the last reader of among `read` (see [`free_dead`]).
    fn store_and_free(
        &mut self,
        i: usize,
        node: &hzp_ir::Node,
        results: Vec<Tensor>,
        read: &[ValueId],
    ) -> Result<(), EvalError> {
        store(
            self.p,
            node,
            results,
            (&self.last_use, &self.is_output),
            &mut self.slots,
            &mut self.live_bytes,
        )
        .map_err(|m| node_err(node, m))?;
        self.stats.peak_live_bytes = self.stats.peak_live_bytes.max(self.live_bytes);
        let views = &self.views;
        let source = |v: ValueId| views[v.index()].as_ref().map_or(v, |w| w.src);
        free_dead(
            read,
            i,
            &source,
            (&self.last_use, &self.is_output),
            &mut self.slots,
            &mut self.live_bytes,
        );
        Ok(())
    }

    /// Reports the profile (if on) and returns the outputs: the last occurrence of an
    /// output takes its tensor; earlier ones (an output listed twice) clone it.
    fn finish(mut self) -> Result<(Vec<(String, Tensor)>, EvalStats), EvalError> {
        let p = self.p;
        if let Some(prof) = self.profile.take() {
            prof.report(&p.name);
        }
        let mut outs = Vec::with_capacity(p.outputs.len());
        for (j, &o) in p.outputs.iter().enumerate() {
            let value = p.value(o);
            let last = !p.outputs[j + 1..].contains(&o);
            let t = if last {
                self.slots[o.index()].take()
            } else {
                self.slots[o.index()].clone()
            };
            let t = t.ok_or_else(|| {
                EvalError::Malformed(format!("output `{}` is never computed", value.name))
            })?;
            outs.push((value.name.clone(), t.into_owned()));
        }
        Ok((outs, self.stats))
    }
}

/// Checks a node's results against its declared outputs and binds those that are read
/// later or returned.
fn store<'a>(
    p: &Program,
    node: &hzp_ir::Node,
    results: Vec<Tensor>,
    (last_use, is_output): (&[Option<usize>], &[bool]),
    slots: &mut [Option<Cow<'a, Tensor>>],
    live_bytes: &mut usize,
) -> Result<(), String> {
    if results.len() != node.outputs.len() {
        return Err(format!(
            "produced {} outputs, the node declares {}",
            results.len(),
            node.outputs.len()
        ));
    }
    for (&o, t) in node.outputs.iter().zip(results) {
        let value = p.value(o);
        if t.ty() != value.ty {
            return Err(format!(
                "computed {} for `{}`, declared {}",
                t.ty(),
                value.name,
                value.ty
            ));
        }
        if !matches!(value.def, ValueDef::Node { .. }) {
            return Err(format!(
                "writes `{}`, which is not a node output",
                value.name
            ));
        }
        // an output nobody reads and the program does not return is dropped at once
        if last_use[o.index()].is_some() || is_output[o.index()] {
            *live_bytes += t.size_bytes();
            slots[o.index()] = Some(Cow::Owned(t));
        }
    }
    Ok(())
}

/// Frees what node `i` was the last reader of (through views: their sources).
fn free_dead(
    inputs: &[ValueId],
    i: usize,
    source: &impl Fn(ValueId) -> ValueId,
    (last_use, is_output): (&[Option<usize>], &[bool]),
    slots: &mut [Option<Cow<'_, Tensor>>],
    live_bytes: &mut usize,
) {
    for &v in inputs {
        let v = source(v);
        if last_use[v.index()] == Some(i) && !is_output[v.index()] {
            if let Some(Cow::Owned(t)) = slots[v.index()].take() {
                *live_bytes -= t.size_bytes();
            }
            // borrowed inputs, parameters and constants are only unbound
        }
    }
}

/// Strided views: a Transpose or Reshape of f32 data whose result is read only by MatMuls
/// (directly or through more such views) is not run. Each MatMul reads the view's source
/// with the view's strides instead (gemm takes row and column strides, so a transposed
/// operand is free), and the source lives until the view's last reader.
mod views {
    use crate::cpu::layout::strides_of;
    use crate::cpu::matmul::MatView;
    use hzp_ir::{DType, Data, Node, Op, Program, Tensor, ValueId};

    /// A value computed as a strided view of `src` (a value that is materialized).
    #[derive(Clone, Debug)]
    pub struct View {
        pub src: ValueId,
        pub shape: Vec<usize>,
        pub strides: Vec<isize>,
    }

    fn contiguous(shape: &[usize], strides: &[isize]) -> bool {
        shape.contains(&0)
            || shape
                .iter()
                .zip(strides)
                .zip(strides_of(shape))
                .all(|((&d, &s), c)| d == 1 || s == c)
    }

    /// The view a Transpose or Reshape node makes of `base` (the view of its input, or the
    /// input itself), if it is one.
    fn view_of(op: &Op, base: View) -> Option<View> {
        match op {
            Op::Transpose { perm } => {
                let r = base.shape.len();
                let mut seen = vec![false; r];
                for &q in perm {
                    if q >= r || std::mem::replace(&mut seen[q], true) {
                        return None;
                    }
                }
                (perm.len() == r).then(|| View {
                    src: base.src,
                    shape: perm.iter().map(|&q| base.shape[q]).collect(),
                    strides: perm.iter().map(|&q| base.strides[q]).collect(),
                })
            }
            Op::Reshape { shape } => {
                let same = shape.iter().product::<usize>() == base.shape.iter().product::<usize>();
                (same && contiguous(&base.shape, &base.strides)).then(|| View {
                    src: base.src,
                    shape: shape.clone(),
                    strides: strides_of(shape),
                })
            }
            _ => None,
        }
    }

    fn candidate(p: &Program, n: &Node) -> bool {
        matches!(n.op, Op::Transpose { .. } | Op::Reshape { .. })
            && n.inputs.len() == 1
            && n.outputs.len() == 1
            && p.ty(n.inputs[0]).dtype == DType::F32
            && p.ty(n.outputs[0]).dtype == DType::F32
    }

    /// Whether node `n` only makes a view (and is not run).
    pub fn is_view_node(n: &Node, views: &[Option<View>]) -> bool {
        n.outputs.len() == 1 && views[n.outputs[0].index()].is_some()
    }

    /// For every value, its view, or `None` where it is computed. Value ids are in range.
    pub fn plan(p: &Program, is_output: &[bool]) -> Vec<Option<View>> {
        let nv = p.values.len();
        let mut readers: Vec<Vec<usize>> = vec![Vec::new(); nv];
        for (i, n) in p.nodes.iter().enumerate() {
            for &v in &n.inputs {
                readers[v.index()].push(i);
            }
        }
        let mut cand: Vec<bool> = p.nodes.iter().map(|n| candidate(p, n)).collect();
        loop {
            let mut views: Vec<Option<View>> = vec![None; nv];
            for (i, n) in p.nodes.iter().enumerate() {
                if !cand[i] {
                    continue;
                }
                let x = n.inputs[0];
                let base = views[x.index()].clone().unwrap_or_else(|| {
                    let shape = p.ty(x).shape.clone();
                    View {
                        src: x,
                        strides: strides_of(&shape),
                        shape,
                    }
                });
                match view_of(&n.op, base) {
                    Some(v) if v.shape == p.ty(n.outputs[0]).shape => {
                        views[n.outputs[0].index()] = Some(v)
                    }
                    _ => cand[i] = false,
                }
            }
            // a view must be read only by MatMuls and views, and not be returned
            let mut changed = false;
            for (i, n) in p.nodes.iter().enumerate() {
                let y = n.outputs.first().map(|y| y.index());
                let Some(y) = y.filter(|&y| cand[i] && views[y].is_some()) else {
                    continue;
                };
                let ok = !is_output[y]
                    && readers[y].iter().all(|&r| {
                        let rn = &p.nodes[r];
                        (matches!(rn.op, Op::MatMul) && rn.inputs.len() == 2)
                            || (cand[r] && views[rn.outputs[0].index()].is_some())
                    });
                if !ok {
                    cand[i] = false;
                    changed = true;
                }
            }
            if !changed {
                return views;
            }
        }
    }

    /// Transposes (not views) of the last two axes whose input is an f32 MatMul of rank >= 2
    /// operands read by nothing else: (transpose node, MatMul node) pairs. The MatMul is
    /// not run; the transpose computes it with swapped, transposed operands.
    pub fn plan_swapped(
        p: &Program,
        is_output: &[bool],
        views: &[Option<View>],
    ) -> Vec<(usize, usize)> {
        let mut producer = vec![None; p.values.len()];
        let mut readers = vec![0usize; p.values.len()];
        for (i, n) in p.nodes.iter().enumerate() {
            for &o in &n.outputs {
                producer[o.index()] = Some(i);
            }
            for &v in &n.inputs {
                readers[v.index()] += 1;
            }
        }
        let mut out = Vec::new();
        for (t, n) in p.nodes.iter().enumerate() {
            let Op::Transpose { perm } = &n.op else {
                continue;
            };
            if !candidate(p, n) || is_view_node(n, views) || !hzp_ir::views::swaps_last_two(perm) {
                continue;
            }
            let x = n.inputs[0];
            let Some(m) = producer[x.index()] else {
                continue;
            };
            let mn = &p.nodes[m];
            let ok = matches!(mn.op, Op::MatMul)
                && mn.inputs.len() == 2
                && mn.outputs.len() == 1
                && readers[x.index()] == 1
                && !is_output[x.index()]
                && mn
                    .inputs
                    .iter()
                    .all(|&v| p.ty(v).dtype == DType::F32 && p.ty(v).rank() >= 2);
            if ok {
                out.push((t, m));
            }
        }
        out
    }

    /// A MatMul operand: `t` itself, or the view `v` of it.
    pub fn operand<'a>(t: &'a Tensor, v: Option<&View>) -> Result<MatView<'a>, String> {
        let Data::F32(data) = &t.data else {
            return Err(format!("internal: strided MatMul operand is {}", t.dtype()));
        };
        Ok(match v {
            None => MatView::contiguous(data, &t.shape),
            Some(v) => {
                if v.shape.iter().product::<usize>() > data.len() && !v.shape.contains(&0) {
                    return Err("internal: view larger than its source".into());
                }
                MatView {
                    data,
                    shape: v.shape.clone(),
                    strides: v.strides.clone(),
                    offset: 0,
                }
            }
        })
    }
}

/// Per-op-kind timing, on when the environment variable `HZP_PROFILE` is set (to anything
/// but `0`): each evaluation then prints a table of time per op kind to stderr. When off, the
/// evaluator only tests one `Option` per node.
mod profile {
    use hzp_ir::{Op, Tensor};
    use std::collections::HashMap;
    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    /// `HZP_PROFILE` unset, empty or `0`: off; `shapes`: per op kind and input shapes;
    /// anything else: per op kind.
    fn level() -> u8 {
        static LEVEL: OnceLock<u8> = OnceLock::new();
        *LEVEL.get_or_init(|| match std::env::var("HZP_PROFILE").as_deref() {
            Err(_) | Ok("") | Ok("0") => 0,
            Ok("shapes") => 2,
            Ok(_) => 1,
        })
    }

    pub fn enabled() -> bool {
        level() > 0
    }

    #[derive(Default)]
    pub struct Profile {
        /// op kind -> (calls, wall time, cpu time of the calling thread)
        by_kind: HashMap<String, (usize, Duration, Duration)>,
    }

    impl Profile {
        /// The row a node's time is counted in.
        pub fn key(&self, op: &Op, args: &[&Tensor], reused: bool) -> String {
            let mut key = match op {
                Op::Reduce { op, .. } => format!("Reduce{op:?}"),
                _ => op.name().to_string(),
            };
            if reused {
                key += " (in place)";
            }
            if level() == 2 {
                for a in args {
                    key += &format!(" {:?}", a.shape);
                }
            }
            key
        }

        /// The row of a fused run of elementwise ops.
        pub fn fused_key(&self, ops: &[&str], n: usize) -> String {
            if level() == 2 {
                format!("Fused {} [{n}]", ops.join(","))
            } else {
                "Fused elementwise".to_string()
            }
        }

        /// The row of a MatMul that reads strided views.
        pub fn view_key(&self, op: &Op, shapes: &[&[usize]]) -> String {
            let mut key = format!("{} (strided)", op.name());
            if level() == 2 {
                for s in shapes {
                    key += &format!(" {s:?}");
                }
            }
            key
        }

        pub fn record(&mut self, key: String, start: Stamp) {
            let e = self.by_kind.entry(key).or_default();
            e.0 += 1;
            e.1 += start.wall.elapsed();
            e.2 += thread_cpu().saturating_sub(start.cpu);
        }

        pub fn report(&self, program: &str) {
            let total: Duration = self.by_kind.values().map(|e| e.1).sum();
            let total_cpu: Duration = self.by_kind.values().map(|e| e.2).sum();
            let mut rows: Vec<_> = self.by_kind.iter().collect();
            rows.sort_by(|a, b| b.1 .1.cmp(&a.1 .1).then(a.0.cmp(b.0)));
            let mut s = format!(
                "hzp profile: `{program}`, {:.1} ms in kernels ({:.1} ms cpu of this thread)\n\
                 {:<40} {:>6} {:>10} {:>10} {:>6}\n",
                total.as_secs_f64() * 1e3,
                total_cpu.as_secs_f64() * 1e3,
                "op",
                "calls",
                "ms",
                "cpu ms",
                "%"
            );
            for (k, (n, t, c)) in rows {
                s += &format!(
                    "{k:<40} {n:>6} {:>10.2} {:>10.2} {:>5.1}%\n",
                    t.as_secs_f64() * 1e3,
                    c.as_secs_f64() * 1e3,
                    100.0 * t.as_secs_f64() / total.as_secs_f64().max(1e-12)
                );
            }
            eprint!("{s}");
        }
    }

    /// When a kernel started: wall clock and this thread's CPU time (which, unlike the
    /// wall clock, does not count time other processes had the core; with
    /// `HZP_NUM_THREADS=1` it is the kernel's whole cost).
    #[derive(Clone, Copy)]
    pub struct Stamp {
        wall: Instant,
        cpu: Duration,
    }

    impl Stamp {
        pub fn now() -> Stamp {
            Stamp {
                wall: Instant::now(),
                cpu: thread_cpu(),
            }
        }
    }

    #[cfg(unix)]
    fn thread_cpu() -> Duration {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec to the pointer it is given.
        let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        if r != 0 {
            return Duration::ZERO;
        }
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }

    #[cfg(not(unix))]
    fn thread_cpu() -> Duration {
        Duration::ZERO
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hzp_ir::{BinaryOp, DType, UnaryOp};

    #[test]
    fn missing_and_extra_inputs_are_listed() {
        let mut p = Program::new("t");
        let x = p.add_input("x", TensorType::new(DType::F32, vec![2]));
        let y = p
            .add_node("neg", Op::Unary(UnaryOp::Neg), vec![x], vec!["y".into()])
            .unwrap();
        p.outputs = y;
        let e = evaluate(&p, &[("z".into(), Tensor::f32(vec![2], vec![1.0, 2.0]))]).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("missing `x`") && s.contains("unexpected `z`"),
            "{s}"
        );
        let e = evaluate(
            &p,
            &[("x".into(), Tensor::f32(vec![3], vec![1.0, 2.0, 3.0]))],
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "input `x` is f32[3], expected f32[2]");
        let r = evaluate(&p, &[("x".into(), Tensor::f32(vec![2], vec![1.0, -2.0]))]).unwrap();
        assert_eq!(r[0].0, "y");
        assert_eq!(r[0].1, Tensor::f32(vec![2], vec![-1.0, 2.0]));
    }

    #[test]
    fn kernel_errors_name_the_node() {
        let mut p = Program::new("t");
        let x = p.add_input("x", TensorType::new(DType::I64, vec![2]));
        let z = p.add_const("z", Tensor::i64(vec![2], vec![1, 0]));
        let y = p
            .add_node(
                "/h.0/div",
                Op::Binary(BinaryOp::Div),
                vec![x, z],
                vec!["y".into()],
            )
            .unwrap();
        p.outputs = y;
        let e = evaluate(&p, &[("x".into(), Tensor::i64(vec![2], vec![4, 5]))]).unwrap_err();
        assert!(
            e.to_string().starts_with("node \"/h.0/div\" (Div): "),
            "{e}"
        );
    }
}
