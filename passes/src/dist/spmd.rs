//! Collective insertion: turns a single-rank training step into the per-rank (SPMD) step of
//! a hierarchical ZeRO plan, given the shard groups P (parameters), G (gradients) and O
//! (optimizer states) of a mesh.
//!
//! Per rank and parameter `w` (n elements, padded to `n_pad`, a multiple of o):
//! - the trainable parameter is the rank's fp32 master shard `w`: `[n_pad / o]`;
//! - a state `shard/w` holds the rank's compute-dtype shard `[n_pad / p]`;
//! - forward and backward read `Reshape(Slice(AllGather_P(shard/w)))`;
//! - the full gradient is padded, reduce-scattered over G, then over O\G, all-reduced over
//!   the rest of the world (W\O); the backward is seeded with 1/(W·M) for W ranks and M
//!   micro-batches, so the accumulated sum is the gradient of the mean loss over ranks and
//!   micro-batches;
//! - the optimizer updates the master shard and its states on the 1/o shard;
//! - `shard/w` is rebuilt by casting the new master and all-gathering it over O\P.
//!
//! Shards nest: a group lists its axes P first, then G\P, then O\G, so a rank's O-shard is
//! a slice of its G-shard, which is a slice of its P-shard. Global-norm clipping sums the
//! squares of each rank's O-shards and all-reduces that partial sum over O.
//!
//! Collectives go on the all-gather and reduce-scatter streams; every use across streams is
//! ordered by a RecordEvent / WaitEvent pair (see [`insert_events`]).

use crate::dist::streams::{assign_streams, insert_events_with};
use crate::emit::Emitter;
use crate::train::muon::Holding;
use crate::train::{self, TrainConfig, TrainError};
pub use hzp_ir::ParamLayout;
use hzp_ir::{
    BinaryOp, DType, Group, Mesh, NodeId, Op, Precision, Program, ReduceOp, Role, RoleKind,
    StreamKind, TensorType, Update, ValueDef, ValueId,
};
use serde::{Serialize, Serializer};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

/// The three shard groups (P, G, O) a step is built for: [`hzp_ir::plan::ShardGroups`].
pub use hzp_ir::plan::ShardGroups;

/// A per-rank training step and the layout of its parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardedStep {
    pub program: Program,
    pub layouts: Vec<ParamLayout>,
    pub groups: ShardGroups,
    /// What collective rewriting did, when it ran (for `--explain`).
    pub rewrite_report: Option<String>,
    /// The parameters whose gradients are exchanged as rows (see [`SparseGrad`]): name, bytes
    /// each rank sends per micro-batch as rows and indices, and the table's bytes.
    pub row_exchanged: Vec<(String, u64, u64)>,
    /// What expert parallelism split, when the step has it.
    pub experts: Option<crate::dist::expert::ExpertSplit>,
}

fn err(s: impl Into<String>) -> TrainError {
    TrainError(s.into())
}

/// Orders the axes of P, G and O so that shards nest (see the module docs); checks that the
/// axes exist and that P ⊆ G ⊆ O.
pub fn canonical_groups(mesh: &Mesh, spec: &ShardGroups) -> Result<ShardGroups, TrainError> {
    let in_mesh_order = |g: &Group, what: &str| -> Result<Vec<String>, TrainError> {
        for a in &g.axes {
            if mesh.axis(a).is_none() {
                return Err(err(format!(
                    "the {what} group names axis `{a}`, which is not in the mesh {mesh}"
                )));
            }
        }
        Ok(mesh
            .axes
            .iter()
            .filter(|a| g.axes.contains(&a.name))
            .map(|a| a.name.clone())
            .collect())
    };
    let p = in_mesh_order(&spec.params, "parameter")?;
    let g = in_mesh_order(&spec.grads, "gradient")?;
    let o = in_mesh_order(&spec.optim, "optimizer-state")?;
    if !p.iter().all(|a| g.contains(a)) || !g.iter().all(|a| o.contains(a)) {
        return Err(err(format!(
            "shard groups must nest, params ⊆ grads ⊆ optim; got params {}, grads {}, optim {}",
            spec.params, spec.grads, spec.optim
        )));
    }
    let mut gg = p.clone();
    gg.extend(g.iter().filter(|a| !p.contains(a)).cloned());
    let mut oo = gg.clone();
    oo.extend(o.iter().filter(|a| !gg.contains(a)).cloned());
    Ok(ShardGroups {
        params: Group { axes: p },
        grads: Group { axes: gg },
        optim: Group { axes: oo },
    })
}

/// When gradients are reduce-scattered over G.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceGrads {
    /// Once per step, after accumulating all micro-batches unsharded (less traffic, a full
    /// gradient buffer).
    PerStep,
    /// After every micro-batch's backward, layer by layer, into a 1/g accumulator.
    PerMicrobatch,
}

impl ReduceGrads {
    /// `step` or `microbatch`.
    pub fn name(self) -> &'static str {
        match self {
            ReduceGrads::PerStep => "step",
            ReduceGrads::PerMicrobatch => "microbatch",
        }
    }

    /// `step` / `per-step`, `microbatch` / `per-microbatch` (also `micro-batch`).
    pub fn parse(s: &str) -> Result<ReduceGrads, String> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "step" | "per-step" => Ok(ReduceGrads::PerStep),
            "microbatch" | "micro-batch" | "per-microbatch" | "per-micro-batch" => {
                Ok(ReduceGrads::PerMicrobatch)
            }
            _ => Err(format!(
                "unknown gradient reduction `{s}` (expected step or microbatch)"
            )),
        }
    }
}

impl Serialize for ReduceGrads {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// How the per-rank step is scheduled (DESIGN.md, steps 7 and 8).
#[derive(Clone, Debug, PartialEq)]
pub struct ScheduleOptions {
    /// Reduce-scatter gradients after every micro-batch (into a 1/g accumulator) or once
    /// per step (full-size accumulator, one reduction).
    pub reduce_grads: ReduceGrads,
    /// Gather a layer's parameters again for its backward instead of keeping the forward's
    /// gathered copy.
    pub reshard_after_forward: bool,
    /// Gather units (a layer's parameters, per micro-batch and phase) issued ahead of the
    /// one computing: the all-gather of unit j waits until unit j - depth - 1 is released.
    pub prefetch_depth: usize,
    /// Bound on the bytes of gathered units in flight or in use (the unit computing
    /// included); `None`: only the depth bounds them.
    pub max_inflight_bytes: Option<u64>,
    /// Recompute each layer's activations in its backward from the layer's inputs.
    pub recompute: bool,
    /// dtype gradients are reduced and accumulated in (fp32, or bf16/f16 to halve gradient
    /// memory and traffic); the optimizer always sees fp32.
    pub grad_dtype: DType,
    /// Parameters whose gradients are reduce-scattered per micro-batch over a group
    /// narrower than G (inside a node) and accumulated there; the rest of G is reduced once
    /// per step, after the last accumulation. Needs per-micro-batch reduction.
    pub narrow_grads: Option<NarrowGrads>,
    /// Exchange the looked-up rows of an (untied) embedding table's gradient instead of
    /// reducing the whole table when that moves fewer bytes (see [`SparseGrad`]).
    pub sparse_grads: bool,
    /// Expert parallelism: the mesh axes whose ranks split the experts of every routed MoE
    /// layer ([`crate::dist::expert`]). An expert weight is then ZeRO-sharded over the
    /// groups' other axes only.
    pub expert_parallel: Option<Group>,
}

/// See [`ScheduleOptions::narrow_grads`]: `params ⊆ group ⊊ grads` must hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NarrowGrads {
    pub group: Group,
    /// Parameter names (as in the forward program).
    pub params: BTreeSet<String>,
}

impl Default for ScheduleOptions {
    fn default() -> Self {
        ScheduleOptions {
            reduce_grads: ReduceGrads::PerMicrobatch,
            reshard_after_forward: true,
            prefetch_depth: 1,
            max_inflight_bytes: None,
            recompute: false,
            grad_dtype: DType::F32,
            narrow_grads: None,
            sparse_grads: true,
            expert_parallel: None,
        }
    }
}

/// A parameter's gradient that is a scatter-add of rows into zeros (an untied embedding
/// lookup's gradient, `ScatterND(zeros, idx [..., 1], rows [..., row shape])`) on a table
/// whose rows divide evenly between the gradient group's ranks. Instead of reduce-scattering
/// the dense table, the looked-up rows and their indices are all-gathered and each rank adds
/// the rows that fall in its shard (DeepSpeed's sparse gradients; the rank's shard offset
/// comes from an all-to-all of `0..g`). Chosen only when the rows of all ranks are fewer
/// bytes than the table. A tied table's gradient (rows scattered into the LM head's dense
/// gradient) stays dense: the rows would be sent on top of the dense reduction.
struct SparseGrad {
    /// The scatter in the micro-batch program.
    node: usize,
    /// Bytes of rows and indices each rank sends per micro-batch.
    sent: u64,
}

/// [`SparseGrad`] for gradient output `gv` of parameter layout `l`, when it qualifies.
fn sparse_grad(
    micro: &Program,
    users: &[Vec<NodeId>],
    gv: ValueId,
    l: &ParamLayout,
    g: usize,
    gdt: DType,
) -> Option<SparseGrad> {
    let node = micro.producer(gv)?;
    let n = &micro.nodes[node.index()];
    let (Op::ScatterND { add: true }, &[base, idx, upd]) = (&n.op, n.inputs.as_slice()) else {
        return None;
    };
    let (it, ut) = (micro.ty(idx), micro.ty(upd));
    let rows = *l.shape.first()?;
    // one row index per lookup: idx [..., 1], rows [..., table row shape]
    let lead = it.rank().checked_sub(1)?;
    let shaped = l.shape.len() >= 2
        && it.rank() >= 2
        && it.shape[lead] == 1
        && it.dtype.is_int()
        && ut.rank() == lead + l.shape.len() - 1
        && ut.shape[..lead] == it.shape[..lead]
        && ut.shape[lead..] == l.shape[1..]
        && micro.ty(base).shape == l.shape;
    let lookups: usize = it.shape[..lead].iter().product();
    if !shaped
        || !users[gv.index()].is_empty()
        // (the gradient of this parameter alone)
        || micro.outputs.iter().filter(|&&o| o == gv).count() != 1
        || l.padded != l.numel
        || rows % g != 0
    {
        return None;
    }
    let row_bytes = (l.numel / rows * gdt.size_bytes()) as u64;
    let sent = (g * lookups) as u64 * (row_bytes + it.dtype.size_bytes() as u64);
    if sent >= l.numel as u64 * gdt.size_bytes() as u64 {
        return None;
    }
    match micro.producer(base).map(|b| &micro.nodes[b.index()].op) {
        Some(Op::Fill { value, .. }) if *value == 0.0 => Some(SparseGrad {
            node: node.index(),
            sent: sent / g as u64 * (g as u64 - 1),
        }),
        _ => None,
    }
}

/// Builds the per-rank step with the default schedule. `fwd` is the forward program at the
/// per-rank micro-batch shapes; `cfg` as for [`train::training_step`] (its optimizer is
/// required).
pub fn shard_training_step(
    fwd: &Program,
    cfg: &TrainConfig,
    mesh: &Mesh,
    spec: &ShardGroups,
) -> Result<ShardedStep, TrainError> {
    shard_training_step_with(fwd, cfg, mesh, spec, &ScheduleOptions::default())
}

/// Phase of a gather unit: forward, backward, or both (when gathered parameters are kept
/// from the forward to the backward).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Phase {
    Fwd,
    Bwd,
    Both,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Fwd => "fwd",
            Phase::Bwd => "bwd",
            Phase::Both => "fwdbwd",
        }
    }
}

type UnitKey = (Phase, usize);

/// What the builder knows about the single-micro-batch gradient program.
struct Analysis {
    is_fwd: Vec<bool>,
    node_layer: Vec<Option<usize>>,
    /// Layer of each parameter (index into `layer_names`).
    param_layer: Vec<usize>,
    param_index: HashMap<ValueId, usize>,
    layer_names: Vec<String>,
    /// For each recomputable forward value read by the backward: its layer.
    need_layer: HashMap<ValueId, usize>,
    /// Per layer, the forward nodes to clone (program order) to recompute what the
    /// backward reads.
    closure: Vec<Vec<usize>>,
    /// Values a clone recomputes (inputs of cloned nodes that are not in this set are read
    /// from the forward).
    recomputed: HashSet<ValueId>,
    /// Parameters of each gather unit, in parameter order.
    units: BTreeMap<UnitKey, BTreeSet<usize>>,
    reshard: bool,
    /// With `reshard`, the layer whose parameters stay gathered from the forward into the
    /// backward anyway: that of the forward's last parameter read (the LM head), whose
    /// backward comes right after the loss, so freeing it would only gather it again (FSDP
    /// does not reshard its root module for the same reason).
    kept: Option<usize>,
}

/// Each parameter's layer and index, and each node of the micro program: whether it is of
/// the forward, and its layer (a backward node takes the layer of the forward values or
/// parameters it reads, else that of the gradients it reads).
#[allow(clippy::type_complexity)]
fn node_layers(
    micro: &Program,
    with_loss: &Program,
    grouping: &crate::report::LayerGrouping,
) -> Result<
    (
        Vec<usize>,
        HashMap<ValueId, usize>,
        Vec<bool>,
        Vec<Option<usize>>,
    ),
    TrainError,
> {
    let fwd_layer: HashMap<&str, Option<usize>> = with_loss
        .nodes
        .iter()
        .zip(&grouping.of_node)
        .map(|(n, l)| (n.name.as_str(), *l))
        .collect();
    let layer_by_param: HashMap<&str, usize> = with_loss
        .params
        .iter()
        .zip(&grouping.of_param)
        .map(|(q, &l)| (with_loss.value(q.value).name.as_str(), l))
        .collect();
    let mut param_layer = Vec::new();
    let mut param_index = HashMap::new();
    for (k, q) in micro.params.iter().enumerate() {
        let name = &micro.value(q.value).name;
        let l = *layer_by_param.get(name.as_str()).ok_or_else(|| {
            err(format!(
                "internal: parameter `{name}` has no layer in the forward program"
            ))
        })?;
        param_layer.push(l);
        param_index.insert(q.value, k);
    }
    let n = micro.nodes.len();
    let mut is_fwd = vec![false; n];
    let mut node_layer: Vec<Option<usize>> = vec![None; n];
    let mut value_layer: Vec<Option<usize>> = vec![None; micro.values.len()];
    let mut value_fwd: Vec<bool> = vec![false; micro.values.len()];
    for (k, q) in micro.params.iter().enumerate() {
        value_layer[q.value.index()] = Some(param_layer[k]);
        value_fwd[q.value.index()] = true;
    }
    for (i, node) in micro.nodes.iter().enumerate() {
        let fwd = fwd_layer.get(node.name.as_str());
        is_fwd[i] = fwd.is_some();
        node_layer[i] = match fwd {
            Some(l) => *l,
            None => {
                // backward: the layer of the forward values (or parameters) it reads,
                // else that of the gradients it reads
                let of = |want_fwd: bool| {
                    node.inputs
                        .iter()
                        .filter(|v| value_fwd[v.index()] == want_fwd)
                        .filter_map(|v| value_layer[v.index()])
                        .max()
                };
                of(true).or_else(|| of(false))
            }
        };
        for &o in &node.outputs {
            value_layer[o.index()] = node_layer[i];
            value_fwd[o.index()] = is_fwd[i];
        }
    }
    Ok((param_layer, param_index, is_fwd, node_layer))
}

/// With recompute: the forward values the backward reads that a layer recomputes (by
/// layer), the forward nodes each layer clones (program order), and every value the clones
/// compute. A forward value is a checkpoint (kept from the forward) when it has no layer, is
/// an output, or a forward node of another layer reads it.
#[allow(clippy::type_complexity)]
fn recompute_closure(
    micro: &Program,
    is_fwd: &[bool],
    node_layer: &[Option<usize>],
    n_layers: usize,
) -> (HashMap<ValueId, usize>, Vec<Vec<usize>>, HashSet<ValueId>) {
    let n = micro.nodes.len();
    let mut need_layer = HashMap::new();
    let mut closure = vec![Vec::new(); n_layers];
    let mut recomputed = HashSet::new();
    let users = micro.users();
    let producer = |v: ValueId| micro.producer(v).map(|x| x.index());
    let recomputable = |v: ValueId| -> Option<usize> {
        let pn = producer(v)?;
        if !is_fwd[pn] || micro.outputs.contains(&v) {
            return None;
        }
        let l = node_layer[pn]?;
        let crosses = users[v.index()]
            .iter()
            .any(|u| is_fwd[u.index()] && node_layer[u.index()] != Some(l));
        (!crosses).then_some(l)
    };
    for (i, node) in micro.nodes.iter().enumerate() {
        if is_fwd[i] {
            continue;
        }
        for &v in &node.inputs {
            if let Some(l) = recomputable(v) {
                need_layer.insert(v, l);
            }
        }
    }
    let mut in_closure = vec![false; n];
    let mut stack: Vec<ValueId> = need_layer.keys().copied().collect();
    stack.sort();
    while let Some(v) = stack.pop() {
        if !recomputed.insert(v) {
            continue;
        }
        let pn = producer(v).expect("recomputable values have producers");
        if in_closure[pn] {
            continue;
        }
        in_closure[pn] = true;
        for &o in &micro.nodes[pn].outputs {
            recomputed.insert(o);
        }
        for &x in &micro.nodes[pn].inputs {
            if recomputable(x).is_some() {
                stack.push(x);
            }
        }
    }
    for (i, &c) in in_closure.iter().enumerate() {
        if c {
            let l = node_layer[i].expect("cloned nodes have a layer");
            closure[l].push(i);
        }
    }
    (need_layer, closure, recomputed)
}

/// Without recompute but with `reshard_after_forward`: the values the forward computes from
/// a layer's parameters and constants alone (a parameter cast to the compute dtype, a
/// transposed or reshaped weight) that the backward reads, recomputed in the backward from
/// the parameters gathered again for it, as [`recompute_closure`] gives them. Kept from the
/// forward they would hold the layer's gathered weights (in another form) through the step,
/// which resharding after the forward is there to avoid; recomputing them costs a cast or a
/// view. Only parameters that are gathered (`gathered`, per parameter) count: a rank that
/// holds a whole parameter frees nothing by casting it again. Values of the `kept` layer
/// (gathered into the backward anyway), values read by a forward node of another layer (a
/// tied weight) and outputs stay as they are.
fn weight_closure(
    micro: &Program,
    is_fwd: &[bool],
    node_layer: &[Option<usize>],
    n_layers: usize,
    kept: Option<usize>,
    gathered: &[bool],
) -> (HashMap<ValueId, usize>, Vec<Vec<usize>>, HashSet<ValueId>) {
    let users = micro.users();
    // values computed from gathered parameters and constants alone, by forward nodes
    let mut weights_only = vec![false; micro.values.len()];
    for (q, &g) in micro.params.iter().zip(gathered) {
        weights_only[q.value.index()] = g;
    }
    let mut closure = vec![Vec::new(); n_layers];
    let mut recomputed = HashSet::new();
    let mut need_layer = HashMap::new();
    for (i, node) in micro.nodes.iter().enumerate() {
        let derived = is_fwd[i]
            && node
                .inputs
                .iter()
                .all(|v| weights_only[v.index()] || matches!(micro.value(*v).def, ValueDef::Const))
            && node.inputs.iter().any(|v| weights_only[v.index()]);
        if !derived {
            continue;
        }
        let Some(l) = node_layer[i].filter(|&l| Some(l) != kept) else {
            continue;
        };
        let local = node.outputs.iter().all(|o| {
            !micro.outputs.contains(o)
                && users[o.index()]
                    .iter()
                    .all(|u| !is_fwd[u.index()] || node_layer[u.index()] == Some(l))
        });
        if !local {
            continue;
        }
        for &o in &node.outputs {
            weights_only[o.index()] = true;
            recomputed.insert(o);
            if users[o.index()].iter().any(|u| !is_fwd[u.index()]) {
                need_layer.insert(o, l);
            }
        }
        closure[l].push(i);
    }
    // only the chains some backward read needs
    let mut needed: HashSet<usize> = HashSet::new();
    let mut stack: Vec<ValueId> = need_layer.keys().copied().collect();
    while let Some(v) = stack.pop() {
        let Some(p) = micro.producer(v).map(|x| x.index()) else {
            continue;
        };
        if recomputed.contains(&v) && needed.insert(p) {
            stack.extend(micro.nodes[p].inputs.iter().copied());
        }
    }
    for c in closure.iter_mut() {
        c.retain(|i| needed.contains(i));
    }
    recomputed.retain(|v| {
        micro
            .producer(*v)
            .is_some_and(|p| needed.contains(&p.index()))
    });
    (need_layer, closure, recomputed)
}

/// The layer whose parameters stay gathered from the forward into the backward (see
/// `Analysis::kept`): that of the forward's last read of a parameter or of a value computed
/// from parameters and constants alone (a transposed or cast weight, read later than the
/// weight).
fn kept_layer(micro: &Program, is_fwd: &[bool], param_layer: &[usize]) -> Option<usize> {
    let mut derived: Vec<Option<usize>> = vec![None; micro.values.len()];
    for (k, q) in micro.params.iter().enumerate() {
        derived[q.value.index()] = Some(param_layer[k]);
    }
    let mut kept = None;
    for (i, node) in micro.nodes.iter().enumerate() {
        if !is_fwd[i] {
            continue;
        }
        let Some(l) = node.inputs.iter().find_map(|v| derived[v.index()]) else {
            continue;
        };
        kept = Some(l);
        let only_weights = node.inputs.iter().all(|v| {
            derived[v.index()].is_some() || matches!(micro.value(*v).def, ValueDef::Const)
        });
        if only_weights {
            for &o in &node.outputs {
                derived[o.index()] = Some(l);
            }
        }
    }
    kept
}

impl Analysis {
    /// `gathered`: per parameter, whether its group gathers it (more than one rank holds a
    /// shard of it).
    fn new(
        micro: &Program,
        with_loss: &Program,
        sched: &ScheduleOptions,
        gathered: &[bool],
    ) -> Result<Analysis, TrainError> {
        let grouping = crate::report::layer_of_params(with_loss);
        let (param_layer, param_index, is_fwd, node_layer) =
            node_layers(micro, with_loss, &grouping)?;
        let n_layers = grouping.names.len();
        let kept = kept_layer(micro, &is_fwd, &param_layer);
        let (need_layer, closure, recomputed) = if sched.recompute {
            recompute_closure(micro, &is_fwd, &node_layer, n_layers)
        } else if sched.reshard_after_forward {
            weight_closure(micro, &is_fwd, &node_layer, n_layers, kept, gathered)
        } else {
            (HashMap::new(), vec![Vec::new(); n_layers], HashSet::new())
        };
        let mut a = Analysis {
            is_fwd,
            node_layer,
            param_layer,
            param_index,
            layer_names: grouping.names.clone(),
            need_layer,
            closure,
            recomputed,
            units: BTreeMap::new(),
            reshard: sched.reshard_after_forward,
            kept,
        };
        a.units = a.unit_params(micro);
        Ok(a)
    }

    /// The parameters of each unit: from every read, and from the clones' reads.
    fn unit_params(&self, micro: &Program) -> BTreeMap<UnitKey, BTreeSet<usize>> {
        let a = self;
        let mut units: BTreeMap<UnitKey, BTreeSet<usize>> = BTreeMap::new();
        for (i, node) in micro.nodes.iter().enumerate() {
            for &v in &node.inputs {
                if let Some(&k) = a.param_index.get(&v) {
                    units
                        .entry(a.unit_of_use(i, k, false))
                        .or_default()
                        .insert(k);
                }
            }
        }
        for nodes in &a.closure {
            for &i in nodes {
                for &v in &micro.nodes[i].inputs {
                    if let Some(&k) = a.param_index.get(&v) {
                        units
                            .entry(a.unit_of_use(i, k, true))
                            .or_default()
                            .insert(k);
                    }
                }
            }
        }
        units
    }

    /// The gather unit that serves node `i`'s read of parameter `k` (`clone`: a recompute
    /// clone of forward node `i`, which runs in the backward).
    fn unit_of_use(&self, i: usize, k: usize, clone: bool) -> UnitKey {
        if !self.reshard {
            return (Phase::Both, self.param_layer[k]);
        }
        let layer = self.node_layer[i].unwrap_or(self.param_layer[k]);
        let phase = if self.kept == Some(layer) {
            Phase::Both
        } else if self.is_fwd[i] && !clone {
            Phase::Fwd
        } else {
            Phase::Bwd
        };
        (phase, layer)
    }

    fn unit_name(&self, mb: usize, key: UnitKey) -> String {
        let layer = self.layer_names[key.1].replace('/', ".");
        format!("mb{mb}.{}.{layer}", key.0.name())
    }
}

/// One gather unit as emitted: the names of its all-gather outputs and of the gathered
/// parameters the step reads.
struct UnitRec {
    /// The unit, `<micro-batch>.<phase>.<layer>`: every node of the unit has the role
    /// `gather(<key>)`, also after collective rewriting (which keeps roles).
    key: String,
}

/// Builds the per-rank step: for each micro-batch, the forward and backward with every
/// parameter read from a per-unit gather (a layer's parameters, gathered at the unit's first
/// use; again in the backward with `reshard_after_forward`), gradients reduce-scattered as
/// they are produced (per micro-batch) or once per step, then the cross-replica reduction,
/// the optimizer on the 1/o shard and the re-gather; then streams, the prefetch order and
/// events.
pub fn shard_training_step_with(
    fwd: &Program,
    cfg: &TrainConfig,
    mesh: &Mesh,
    spec: &ShardGroups,
    sched: &ScheduleOptions,
) -> Result<ShardedStep, TrainError> {
    shard_training_step_traced(fwd, cfg, mesh, spec, sched, &mut |_, _| {})
}

/// Names of the stages [`shard_training_step_traced`] reports, in order: `collectives` (the
/// per-rank step with collectives inserted and streams assigned, in the order emitted),
/// `rewrite` (after collective rewriting, when asked for) and `schedule` (gathers issued for
/// prefetch, rate-limiting and data events inserted).
pub const STAGES: [&str; 3] = ["collectives", "rewrite", "schedule"];

/// Collective rewriting ([`crate::dist::rewrite`]) between insertion and scheduling.
#[derive(Clone, Debug, PartialEq)]
pub struct Rewrite {
    pub cluster: crate::cost::cluster::ClusterSpec,
    pub options: crate::dist::rewrite::RewriteOptions,
}

/// [`shard_training_step_with`], handing the program after each stage (see [`STAGES`]) to
/// `trace` (for `--print-after`).
pub fn shard_training_step_traced(
    fwd: &Program,
    cfg: &TrainConfig,
    mesh: &Mesh,
    spec: &ShardGroups,
    sched: &ScheduleOptions,
    trace: &mut dyn FnMut(&str, &Program),
) -> Result<ShardedStep, TrainError> {
    shard_training_step_rewritten(fwd, cfg, mesh, spec, sched, None, trace)
}

/// [`shard_training_step_traced`] with collective rewriting after insertion; the step's
/// `rewrite_report` says what it did.
pub fn shard_training_step_rewritten(
    fwd: &Program,
    cfg: &TrainConfig,
    mesh: &Mesh,
    spec: &ShardGroups,
    sched: &ScheduleOptions,
    rewrite: Option<&Rewrite>,
    trace: &mut dyn FnMut(&str, &Program),
) -> Result<ShardedStep, TrainError> {
    // Stage 1, validate: an optimizer, a float gradient dtype.
    let opt = cfg
        .optimizer
        .clone()
        .ok_or_else(|| err("a sharded training step needs an optimizer"))?;
    if !sched.grad_dtype.is_float() {
        return Err(err(format!(
            "gradients must be reduced in a float dtype, not {}",
            sched.grad_dtype
        )));
    }
    // Expert parallelism: each rank's forward holds its slice of the experts, with the
    // exchanges around them.
    let split = split_experts(fwd, mesh, &opt, sched)?;
    let (fwd, experts) = match &split {
        Some((p, x)) => (p, Some(x.clone())),
        None => (fwd, None),
    };
    // Stage 2, group sizes: the nested groups and what each reduction covers.
    let groups = StepGroups::new(fwd, mesh, spec, sched, experts.clone())?;
    groups.check_clipping(cfg)?;
    let m = cfg.micro_batches.max(1);
    let fwd_lp = train::lower_precision_cow(fwd, cfg.compute)?;
    // gradients of loss / (W * M): their sum over ranks and micro-batches is the mean
    let micro = train::gradient_program_scaled(&fwd_lp, &cfg.loss, 1.0 / (groups.w * m) as f64)?;
    let an = {
        let with_loss = train::attach_loss(&fwd_lp, &cfg.loss)?;
        // whether each parameter is gathered (over P, or P \ E for an expert slice)
        let gathered: Vec<bool> = (micro.params.iter())
            .map(|q| match groups.expert(&micro.value(q.value).name) {
                Some(x) => x.p > 1,
                None => groups.p > 1,
            })
            .collect();
        Analysis::new(&micro, &with_loss, sched, &gathered)?
    };
    drop(fwd_lp);

    // Stage 3, per-rank declarations: inputs, master and compute shards, constants.
    let mut q = Program::new(format!("{}.rank", fwd.name));
    let decls = Declarations::new(&mut q, &micro, &groups, cfg, sched, m)?;
    let n_params = micro.params.len();
    let mut e = Emitter::new(&mut q);
    let mut b = StepBuilder {
        fwd,
        micro: &micro,
        an: &an,
        gr: &groups,
        d: &decls,
        m,
        gdt: sched.grad_dtype,
        per_mb: sched.reduce_grads == ReduceGrads::PerMicrobatch,
        sparse: SparseGrads::default(),
        units: Vec::new(),
        losses: Vec::new(),
        acc: vec![None; n_params],
        final_g: vec![None; n_params],
    };
    // Stage 4, sparse gradients: which embedding gradients are exchanged as rows.
    b.sparse = SparseGrads::new(&mut e, &micro, &groups, &decls.layouts, sched, b.per_mb)?;
    // Stage 5, micro-batches: forward, recompute, backward, gather / reduce / accumulate.
    for mb in 0..m {
        b.micro_batch(&mut e, mb)?;
    }
    // Stage 6, the global loss; stage 7, clipping, optimizer and re-gather.
    let loss = b.global_loss(&mut e)?;
    let (outputs, updates, state_names) = b.optimizer_and_regather(&mut e, cfg, &opt, loss)?;
    let StepBuilder {
        units,
        sparse: SparseGrads { row_exchanged, .. },
        ..
    } = b;
    drop(e);
    // The gradient program and what was derived from it are not needed any more: freed
    // before the step is rewritten and scheduled (two more programs of its size), they do
    // not add to the compile's peak memory.
    drop(an);
    drop(micro);
    let Declarations { layouts, .. } = decls;
    q.outputs = outputs;
    q.updates = updates;
    if let Some(v) = q.outputs.first().copied() {
        if q.find_value("loss").is_none() {
            q.values[v.index()].name = "loss".into();
        }
    }
    q.eliminate_dead_code();
    // Then the pipeline's stages: streams, rewriting, schedule and events.
    // Each pipeline stage's program is verified before it is traced or used.
    let mut stage_done = |stage: &str, q: &Program| -> Result<(), TrainError> {
        hzp_ir::verify(q).map_err(|e| {
            err(format!(
                "the sharded step failed verification after stage `{stage}`: {e}"
            ))
        })?;
        trace(stage, q);
        Ok(())
    };
    assign_streams(&mut q);
    stage_done(STAGES[0], &q)?;
    let mut rewrite_report = None;
    if let Some(rw) = rewrite {
        let (r, rep) = crate::dist::rewrite::rewrite_collectives_owned(
            std::mem::take(&mut q),
            mesh,
            &rw.cluster,
            &rw.options,
        )
        .map_err(|e| err(format!("collective rewriting: {e}")))?;
        q = r;
        drop_redundant_copies(&mut q);
        stage_done(STAGES[1], &q)?;
        rewrite_report = Some(rep.to_string());
    }
    let (order, waits) = prefetch_schedule(&q, &units, sched);
    let order = defer_reduce_consumers(&q, &order, &waits);
    let scheduled = insert_events_with(&q, &order, &waits);
    // (the unscheduled program is freed now, not when the step is returned)
    drop(q);
    let q = scheduled;
    stage_done(STAGES[2], &q)?;
    let mut layouts = layouts;
    for (l, names) in layouts.iter_mut().zip(state_names) {
        l.states = names;
    }
    Ok(ShardedStep {
        program: q,
        layouts,
        groups: groups.spec,
        rewrite_report,
        row_exchanged,
        experts,
    })
}

/// The forward of one rank of the expert-parallel group and what it split, under
/// `sched.expert_parallel` ([`crate::dist::expert`]).
fn split_experts(
    fwd: &Program,
    mesh: &Mesh,
    opt: &train::Optimizer,
    sched: &ScheduleOptions,
) -> Result<Option<(Program, crate::dist::expert::ExpertSplit)>, TrainError> {
    let Some(group) = &sched.expert_parallel else {
        return Ok(None);
    };
    if matches!(opt, train::Optimizer::Muon { .. }) {
        return Err(err(
            "--expert-parallel with the Muon optimizer is not built: Muon orthogonalizes \
             whole matrices, and an expert-parallel rank holds a slice of each stacked expert \
             weight; use AdamW or SGD",
        ));
    }
    crate::dist::expert::expert_parallel_forward(fwd, mesh, group)
        .map(Some)
        .map_err(err)
}

/// The groups of a step and their sizes: P ⊆ G ⊆ O nested in mesh order, the narrow
/// gradient group N (P ⊆ N ⊆ G) where asked for, and the groups each reduction covers.
struct StepGroups<'m> {
    mesh: &'m Mesh,
    spec: ShardGroups,
    narrow_grads: Option<NarrowGrads>,
    /// Every axis of the mesh.
    world: Group,
    /// Sizes of P, G, O and the world.
    p: usize,
    g: usize,
    o: usize,
    w: usize,
    o_minus_g: Group,
    o_minus_p: Group,
    /// W \ O: the replicas of an O-shard.
    replicas: Group,
    /// The groups of the expert weights, under expert parallelism.
    experts: Option<ExpertGroups>,
}

/// The groups an expert weight's collectives run over: P, G, O and the replicas without
/// the expert-parallel axes E (each rank of E holds other experts), and its layout's
/// groups, E first: `E ++ (O \ E)` and `E ++ (P \ E)`, so that a rank's shards are pieces
/// of its own experts' slice of the stacked weight.
struct ExpertGroups {
    split: crate::dist::expert::ExpertSplit,
    params: Group,
    p: usize,
    grads: Group,
    g: usize,
    o: usize,
    o_minus_g: Group,
    o_minus_p: Group,
    replicas: Group,
    r: usize,
    layout_optim: Group,
    layout_params: Group,
}

impl ExpertGroups {
    fn new(
        mesh: &Mesh,
        spec: &ShardGroups,
        world: &Group,
        split: crate::dist::expert::ExpertSplit,
    ) -> ExpertGroups {
        let ep = &split.group;
        let params = spec.params.minus(ep);
        let grads = spec.grads.minus(ep);
        let optim = spec.optim.minus(ep);
        let replicas = world.minus(&spec.optim).minus(ep);
        let with_ep = |g: &Group| Group::new(ep.axes.iter().chain(&g.axes).cloned());
        ExpertGroups {
            p: mesh.size_of(&params),
            g: mesh.size_of(&grads),
            o: mesh.size_of(&optim),
            r: mesh.size_of(&replicas),
            o_minus_g: optim.minus(&grads),
            o_minus_p: optim.minus(&params),
            layout_optim: with_ep(&optim),
            layout_params: with_ep(&params),
            params,
            grads,
            replicas,
            split,
        }
    }
}

impl<'m> StepGroups<'m> {
    fn new(
        fwd: &Program,
        mesh: &'m Mesh,
        spec: &ShardGroups,
        sched: &ScheduleOptions,
        experts: Option<crate::dist::expert::ExpertSplit>,
    ) -> Result<StepGroups<'m>, TrainError> {
        let spec = canonical_groups(mesh, spec)?;
        let narrow_grads = match &sched.narrow_grads {
            Some(nw) if !nw.params.is_empty() => Some(narrow_group(fwd, mesh, &spec, sched, nw)?),
            _ => None,
        };
        let world = Group {
            axes: mesh.axes.iter().map(|a| a.name.clone()).collect(),
        };
        let experts = experts.map(|s| ExpertGroups::new(mesh, &spec, &world, s));
        Ok(StepGroups {
            experts,
            mesh,
            p: mesh.size_of(&spec.params),
            g: mesh.size_of(&spec.grads),
            o: mesh.size_of(&spec.optim),
            w: mesh.world_size(),
            o_minus_g: spec.optim.minus(&spec.grads),
            o_minus_p: spec.optim.minus(&spec.params),
            replicas: world.minus(&spec.optim),
            world,
            narrow_grads,
            spec,
        })
    }

    /// The narrow group parameter `name`'s gradient is reduce-scattered over per
    /// micro-batch, if it has one.
    fn narrow(&self, name: &str) -> Option<&Group> {
        if self.expert(name).is_some() {
            return None;
        }
        let nw = self.narrow_grads.as_ref()?;
        nw.params.iter().any(|p| p == name).then_some(&nw.group)
    }

    /// Global-norm clipping sums every rank's shards over O: an expert weight's shards lie
    /// over E and O \ E, so E must lie inside O.
    fn check_clipping(&self, cfg: &TrainConfig) -> Result<(), TrainError> {
        match (&self.experts, cfg.clip_grad_norm) {
            (Some(x), Some(_)) if !x.split.group.is_subset_of(&self.spec.optim) => {
                Err(err(format!(
                    "gradient clipping with --expert-parallel {} needs the expert-parallel \
                     axes inside the optimizer-state group {} (the global norm sums every \
                     rank's shards over that group)",
                    x.split.group, self.spec.optim
                )))
            }
            _ => Ok(()),
        }
    }

    /// The groups of parameter `name` when it is an expert weight split by expert
    /// parallelism.
    fn expert(&self, name: &str) -> Option<&ExpertGroups> {
        self.experts
            .as_ref()
            .filter(|x| x.split.params.contains_key(name))
    }
}

/// The narrow gradient group, in mesh order, nested P ⊆ N ⊆ G.
fn narrow_group(
    fwd: &Program,
    mesh: &Mesh,
    spec: &ShardGroups,
    sched: &ScheduleOptions,
    nw: &NarrowGrads,
) -> Result<NarrowGrads, TrainError> {
    if sched.reduce_grads != ReduceGrads::PerMicrobatch {
        return Err(err(
            "accumulating gradients in a narrower group needs per-micro-batch reduction \
             (--reduce-grads per-microbatch)",
        ));
    }
    let ng = canonical_groups(
        mesh,
        &ShardGroups {
            params: spec.params.clone(),
            grads: nw.group.clone(),
            optim: spec.grads.clone(),
        },
    )
    .map_err(|e| {
        err(format!(
            "the in-node gradient group {} must hold the parameter group {} and lie in the \
             gradient group {}: {e}",
            nw.group, spec.params, spec.grads
        ))
    })?;
    if let Some(bad) = nw
        .params
        .iter()
        .find(|n| !fwd.params.iter().any(|p| &fwd.value(p.value).name == *n))
    {
        return Err(err(format!(
            "the in-node gradient group lists `{bad}`, which is not a parameter of `{}`",
            fwd.name
        )));
    }
    Ok(NarrowGrads {
        group: ng.grads,
        params: nw.params.clone(),
    })
}

/// What the per-rank step declares before any node: the rank's micro-batches (concatenated
/// on axis 0), each parameter's fp32 master shard (the trainable parameter) and compute
/// shard (a state), their layouts, and the constants.
struct Declarations {
    /// (input of the micro program, the step's input).
    globals: Vec<(ValueId, ValueId)>,
    layouts: Vec<ParamLayout>,
    masters: Vec<ValueId>,
    shards: Vec<ValueId>,
    consts: HashMap<ValueId, ValueId>,
    /// Which gradient outputs (index into the parameters) each micro value is.
    grad_of: HashMap<ValueId, Vec<usize>>,
}

impl Declarations {
    fn new(
        q: &mut Program,
        micro: &Program,
        gr: &StepGroups,
        cfg: &TrainConfig,
        sched: &ScheduleOptions,
        m: usize,
    ) -> Result<Declarations, TrainError> {
        let (compute, gdt) = (cfg.compute, sched.grad_dtype);
        q.mesh = Some(gr.mesh.clone());
        if compute != DType::F32 || gdt != DType::F32 {
            q.precision = Some(Precision {
                compute,
                master: DType::F32,
                reduce: gdt,
            });
        }
        let globals = train::declare_batch_inputs(q, micro, m)?;
        let (mut layouts, mut masters, mut shards) = (Vec::new(), Vec::new(), Vec::new());
        let (p, o) = (gr.p, gr.o);
        for prm in &micro.params {
            let name = micro.value(prm.value).name.clone();
            let ty = micro.ty(prm.value).clone();
            let (shape, optim_group, params_group, o, p) = match gr.expert(&name) {
                // an expert weight: its full shape, cut over E ++ (O \ E) without padding
                // (padding at the end would not split by expert)
                Some(x) => {
                    let shape = x.split.params[&name].clone();
                    let cut = x.split.size * x.o;
                    let numel: usize = shape.iter().product();
                    if !numel.is_multiple_of(cut) {
                        return Err(err(format!(
                            "--expert-parallel {}: the expert weight `{name}` {shape:?} has \
                             {numel} elements, which do not split evenly into the {} experts' \
                             slices times the {} ranks of its optimizer-state group {} (shard \
                             it over fewer ranks, or choose other expert-parallel axes)",
                            x.split.group, x.split.size, x.o, x.layout_optim
                        )));
                    }
                    (
                        shape,
                        x.layout_optim.clone(),
                        x.layout_params.clone(),
                        cut,
                        x.split.size * x.p,
                    )
                }
                None => (
                    ty.shape.clone(),
                    gr.spec.optim.clone(),
                    gr.spec.params.clone(),
                    o,
                    p,
                ),
            };
            let n: usize = shape.iter().product();
            let padded = n.div_ceil(o).max(1) * o;
            let master = q.add_param(
                name.clone(),
                TensorType::new(DType::F32, vec![padded / o]),
                None,
            );
            let shard_name = format!("shard/{name}");
            let shard = q.add_state(
                shard_name.clone(),
                TensorType::new(compute, vec![padded / p]),
                None,
            );
            masters.push(master);
            shards.push(shard);
            let accumulate_group = gr.narrow(&name).cloned();
            let expert_group = gr.expert(&name).map(|x| x.split.group.clone());
            layouts.push(ParamLayout {
                name,
                shape,
                numel: n,
                padded,
                optim_group,
                params_group,
                compute_shard: shard_name,
                compute_dtype: compute,
                accumulate_group,
                states: Vec::new(),
                expert_group,
            });
        }
        let mut consts: HashMap<ValueId, ValueId> = HashMap::new();
        // (one name set for all constants: `fresh` marks each name it hands out)
        let mut names = hzp_ir::NameSet::from_program(q);
        for c in &micro.consts {
            let name = names.fresh(&micro.value(c.value).name);
            consts.insert(c.value, q.add_const(name, c.data.clone()));
        }
        let mut grad_of: HashMap<ValueId, Vec<usize>> = HashMap::new();
        for (j, &gv) in micro.outputs[1..].iter().enumerate() {
            grad_of.entry(gv).or_default().push(j);
        }
        Ok(Declarations {
            globals,
            layouts,
            masters,
            shards,
            consts,
            grad_of,
        })
    }
}

/// The row-exchanged gradients (see [`SparseGrad`]) and this rank's index in G.
#[derive(Default)]
struct SparseGrads {
    /// The gradient of parameter j, by the micro program's scatter node.
    at: HashMap<usize, usize>,
    /// This rank's index in the gradient group, as a scalar (when any gradient is
    /// row-exchanged).
    member: Option<ValueId>,
    /// For the step's report: name, bytes sent per micro-batch, the table's bytes.
    row_exchanged: Vec<(String, u64, u64)>,
}

impl SparseGrads {
    fn new(
        e: &mut Emitter,
        micro: &Program,
        gr: &StepGroups,
        layouts: &[ParamLayout],
        sched: &ScheduleOptions,
        per_mb: bool,
    ) -> Result<SparseGrads, TrainError> {
        let (g, gdt) = (gr.g, sched.grad_dtype);
        let users = micro.users();
        let sparse: Vec<Option<SparseGrad>> = layouts
            .iter()
            .enumerate()
            .map(|(j, l)| {
                if !(sched.sparse_grads
                    && per_mb
                    && g > 1
                    && gr.narrow(&l.name).is_none()
                    && gr.expert(&l.name).is_none())
                {
                    return None;
                }
                sparse_grad(micro, &users, micro.outputs[1 + j], l, g, gdt)
            })
            .collect();
        let row_exchanged = sparse
            .iter()
            .zip(layouts)
            .filter_map(|(s, l)| {
                let s = s.as_ref()?;
                Some((l.name.clone(), s.sent, (l.numel * gdt.size_bytes()) as u64))
            })
            .collect();
        let at: HashMap<usize, usize> = sparse
            .iter()
            .enumerate()
            .filter_map(|(j, s)| Some((s.as_ref()?.node, j)))
            .collect();
        // member j sends piece r of 0..g to member r, so member r receives r from every
        // member
        let member = if at.is_empty() {
            None
        } else {
            e.enter("member", Role::new(RoleKind::Reduce, "member"));
            Some(
                e.member_index("member/ranks", &gr.spec.grads, g)
                    .map_err(err)?,
            )
        };
        Ok(SparseGrads {
            at,
            member,
            row_exchanged,
        })
    }
}

/// Emits the per-rank step, stage by stage, from the single-micro-batch gradient program.
struct StepBuilder<'a> {
    /// The forward program the step is built from (Muon reads its matrices' uses).
    fwd: &'a Program,
    micro: &'a Program,
    an: &'a Analysis,
    gr: &'a StepGroups<'a>,
    d: &'a Declarations,
    m: usize,
    gdt: DType,
    per_mb: bool,
    sparse: SparseGrads,
    /// Gather units in the order emitted.
    units: Vec<UnitRec>,
    /// Each micro-batch's loss.
    losses: Vec<ValueId>,
    /// Per parameter: the per-micro-batch accumulator (a shard over G) or the per-step
    /// full accumulator.
    acc: Vec<Option<ValueId>>,
    /// Per parameter: the reduced gradient on the rank's O-shard (after the last
    /// micro-batch).
    final_g: Vec<Option<ValueId>>,
}

/// What one micro-batch's emission keeps track of.
struct MicroBatch {
    mb: usize,
    /// The suffix of copied names (`/micro<mb>`, none with one micro-batch).
    suffix: String,
    /// Micro-program value -> step value.
    vmap: HashMap<ValueId, ValueId>,
    /// Gathered parameters of the units started in this micro-batch.
    gathered: HashMap<(UnitKey, usize), ValueId>,
    started: HashSet<UnitKey>,
    /// Recomputed values, and the layers already recomputed.
    clones: HashMap<ValueId, ValueId>,
    cloned: HashSet<usize>,
    /// Reduced gradients not yet added to their accumulator, with the backward layer count
    /// at which they were reduced.
    pending: Vec<(usize, ValueId, usize)>,
    bwd_layers_seen: usize,
    last_bwd_layer: Option<Option<usize>>,
    done_grads: Vec<bool>,
}

impl StepBuilder<'_> {
    /// The gather chain of parameter k: AllGather over P, drop the padding, reshape.
    fn gather(&self, e: &mut Emitter, k: usize) -> Result<ValueId, String> {
        let l = &self.d.layouts[k];
        let mut v = self.d.shards[k];
        if let Some(x) = self.gr.expert(&l.name) {
            // the rank's experts' slice, gathered over P \ E
            if x.p > 1 {
                v = e.op(
                    Op::AllGather {
                        group: x.params.clone(),
                        axis: 0,
                    },
                    &[v],
                )?;
            }
            let local = self.micro.ty(self.micro.params[k].value).shape.clone();
            let n: usize = local.iter().product();
            return crate::dist::unpad(e, v, n, n, &local);
        }
        if self.gr.p > 1 {
            v = e.op(
                Op::AllGather {
                    group: self.gr.spec.params.clone(),
                    axis: 0,
                },
                &[v],
            )?;
        }
        crate::dist::unpad(e, v, l.numel, l.padded, &l.shape)
    }

    /// Parameter j's gradient as a flat, padded vector in the gradient dtype.
    fn flat_grad(&self, e: &mut Emitter, v: ValueId, j: usize) -> Result<ValueId, String> {
        let l = &self.d.layouts[j];
        if let Some(x) = self.gr.expert(&l.name) {
            let n = l.numel / x.split.size;
            return crate::dist::flat_padded(e, v, n, n, self.gdt);
        }
        crate::dist::flat_padded(e, v, l.numel, l.padded, self.gdt)
    }

    /// Reduce-scatters parameter j's flat gradient over G (or its narrow group).
    fn reduce_scatter_g(&self, e: &mut Emitter, v: ValueId, j: usize) -> Result<ValueId, String> {
        let name = &self.d.layouts[j].name;
        let (group, size_) = match (self.gr.expert(name), self.gr.narrow(name)) {
            (Some(x), _) => (x.grads.clone(), x.g),
            (None, Some(n)) => (n.clone(), self.gr.mesh.size_of(n)),
            (None, None) => (self.gr.spec.grads.clone(), self.gr.g),
        };
        if size_ > 1 {
            e.op(
                Op::ReduceScatter {
                    group,
                    axis: 0,
                    reduce: ReduceOp::Sum,
                },
                &[v],
            )
        } else {
            Ok(v)
        }
    }

    /// Adds `v` to parameter j's accumulator and, in the last micro-batch, reduces the sum
    /// to the rank's O-shard ([`Self::finish`]). The first value is copied when it comes
    /// from a collective: reading it on the compute stream is what lets the compute stream
    /// reuse the memory the reduce-scatter read (a value the comm stream reads is only dead
    /// once the compute stream has waited for that read).
    fn accumulate(
        &mut self,
        e: &mut Emitter,
        mb: usize,
        j: usize,
        v: ValueId,
    ) -> Result<(), String> {
        self.acc[j] = Some(match self.acc[j] {
            None if e
                .p
                .producer(v)
                .is_some_and(|n| e.p.node(n).op.is_collective()) =>
            {
                e.op(Op::Copy, &[v])?
            }
            None => v,
            Some(a) => e.op(Op::Binary(BinaryOp::Add), &[a, v])?,
        });
        if mb + 1 == self.m {
            let a = self.acc[j].ok_or("internal: nothing accumulated")?;
            self.final_g[j] = Some(self.finish(e, j, a)?);
        }
        Ok(())
    }

    /// Reduces an accumulated gradient to the rank's O-shard, in fp32: right after its last
    /// accumulation, so the cross-replica reduction overlaps the last micro-batch's
    /// backward.
    fn finish(&self, e: &mut Emitter, j: usize, v: ValueId) -> Result<ValueId, String> {
        let (gr, l) = (self.gr, &self.d.layouts[j]);
        e.enter(
            format!("reduce.step/{}", l.name),
            Role::new(RoleKind::Reduce, "step"),
        );
        let mut v = v;
        if !self.per_mb {
            v = self.reduce_scatter_g(e, v, j)?;
        }
        // (rest of O, its size after the reduction so far, O's size, replicas and their count)
        let (rest, reduced, o, replicas, r) = match (gr.expert(&l.name), gr.narrow(&l.name)) {
            (Some(x), _) => (x.o_minus_g.clone(), x.g, x.o, x.replicas.clone(), x.r),
            (None, Some(n)) => (
                gr.spec.optim.minus(n),
                gr.mesh.size_of(n),
                gr.o,
                gr.replicas.clone(),
                gr.w / gr.o,
            ),
            (None, None) => (
                gr.o_minus_g.clone(),
                gr.g,
                gr.o,
                gr.replicas.clone(),
                gr.w / gr.o,
            ),
        };
        if o > reduced {
            v = e.op(
                Op::ReduceScatter {
                    group: rest,
                    axis: 0,
                    reduce: ReduceOp::Sum,
                },
                &[v],
            )?;
        }
        if r > 1 {
            v = e.op(
                Op::AllReduce {
                    group: replicas,
                    reduce: ReduceOp::Sum,
                },
                &[v],
            )?;
        }
        if e.ty(v).dtype != DType::F32 {
            v = e.op(Op::Cast { to: DType::F32 }, &[v])?;
        }
        // (already the mean: the backward was seeded with 1 / (W * M))
        Ok(v)
    }

    /// The rank's shard of a row-exchanged gradient of parameter j (lookups `idx`, rows
    /// `upd`): the rows of every rank of G that fall in it.
    fn sparse_rows(
        &self,
        e: &mut Emitter,
        j: usize,
        idx: ValueId,
        upd: ValueId,
    ) -> Result<ValueId, String> {
        let (l, gdt, g) = (&self.d.layouts[j], self.gdt, self.gr.g);
        // the lookups as one list: idx [T, 1], rows [T, table row shape]
        let lookups: usize = e.ty(idx).shape.iter().product();
        let idx = e.op(
            Op::Reshape {
                shape: vec![lookups, 1],
            },
            &[idx],
        )?;
        let mut rows_shape = vec![lookups];
        rows_shape.extend_from_slice(&l.shape[1..]);
        let mut upd = e.op(Op::Reshape { shape: rows_shape }, &[upd])?;
        if e.ty(upd).dtype != gdt {
            upd = e.op(Op::Cast { to: gdt }, &[upd])?;
        }
        let gather = |e: &mut Emitter, v: ValueId| {
            e.op(
                Op::AllGather {
                    group: self.gr.spec.grads.clone(),
                    axis: 0,
                },
                &[v],
            )
        };
        let idx_all = gather(e, idx)?;
        let upd_all = gather(e, upd)?;
        let idt = e.ty(idx).dtype;
        let mut me = self.sparse.member.ok_or("internal: no member index")?;
        if idt != DType::I64 {
            me = e.op(Op::Cast { to: idt }, &[me])?;
        }
        let per = l.shape[0] / g;
        let per_c = e.scalar(per as f64, idt);
        let first = e.op(Op::Binary(BinaryOp::Mul), &[me, per_c])?;
        let loc = e.op(Op::Binary(BinaryOp::Sub), &[idx_all, first])?;
        let zero_i = e.scalar(0.0, idt);
        let lo = e.op(Op::Binary(BinaryOp::GreaterOrEqual), &[loc, zero_i])?;
        let hi = e.op(Op::Binary(BinaryOp::Less), &[loc, per_c])?;
        let inside = e.op(Op::Binary(BinaryOp::And), &[lo, hi])?;
        let loc = e.op(Op::Where, &[inside, loc, zero_i])?;
        // one mask entry per row, broadcast over the row's elements
        let mut mask_shape = vec![e.ty(upd_all).shape[0]];
        mask_shape.resize(e.ty(upd_all).rank(), 1);
        let mask = e.op(Op::Reshape { shape: mask_shape }, &[inside])?;
        let zero_g = e.scalar(0.0, gdt);
        let rows = e.op(Op::Where, &[mask, upd_all, zero_g])?;
        let mut shard_shape = l.shape.clone();
        shard_shape[0] = per;
        let base = e.zeros(&TensorType::new(gdt, shard_shape))?;
        let sum = e.op(Op::ScatterND { add: true }, &[base, loc, rows])?;
        e.op(
            Op::Reshape {
                shape: vec![l.numel / g],
            },
            &[sum],
        )
    }

    /// The micro-batch's slices of the step's inputs.
    fn micro_batch_inputs(&self, e: &mut Emitter, mb: usize) -> Result<MicroBatch, TrainError> {
        let (micro, m) = (self.micro, self.m);
        let mut vmap: HashMap<ValueId, ValueId> = self.d.consts.clone();
        for &(mi, gi) in &self.d.globals {
            let v = if m == 1 {
                gi
            } else {
                let rows = micro.ty(mi).shape[0] as i64;
                let name = e.fresh(&format!("{}/micro{mb}", micro.value(mi).name));
                e.p.add_node(
                    name.clone(),
                    Op::Slice {
                        axes: vec![0],
                        starts: vec![mb as i64 * rows],
                        ends: vec![(mb as i64 + 1) * rows],
                        steps: vec![1],
                    },
                    vec![gi],
                    vec![name],
                )
                .map_err(err)?[0]
            };
            vmap.insert(mi, v);
        }
        Ok(MicroBatch {
            mb,
            suffix: if m == 1 {
                String::new()
            } else {
                format!("/micro{mb}")
            },
            vmap,
            gathered: HashMap::new(),
            started: HashSet::new(),
            clones: HashMap::new(),
            cloned: HashSet::new(),
            pending: Vec::new(),
            bwd_layers_seen: 0,
            last_bwd_layer: None,
            done_grads: vec![false; self.micro.params.len()],
        })
    }

    /// Parameter k as gathered by unit `key` (which starts, gathering all its parameters,
    /// at its first read).
    fn param_for(
        &mut self,
        e: &mut Emitter,
        st: &mut MicroBatch,
        key: UnitKey,
        k: usize,
    ) -> Result<ValueId, String> {
        if st.started.insert(key) {
            let uname = self.an.unit_name(st.mb, key);
            let rec = UnitRec { key: uname.clone() };
            for &kk in &self.an.units[&key] {
                e.enter(
                    format!("gather.{uname}/{}", self.d.layouts[kk].name),
                    Role::new(RoleKind::Gather, uname.clone()),
                );
                let v = self.gather(e, kk)?;
                st.gathered.insert((key, kk), v);
            }
            self.units.push(rec);
        }
        st.gathered
            .get(&(key, k))
            .copied()
            .ok_or_else(|| format!("internal: unit {key:?} does not gather parameter {k}"))
    }

    /// Copies node i of the micro program with inputs `ins`, its names suffixed by `tag`.
    fn copy_node(
        &self,
        e: &mut Emitter,
        i: usize,
        ins: Vec<ValueId>,
        tag: &str,
        recompute: bool,
    ) -> Result<Vec<ValueId>, String> {
        let node = &self.micro.nodes[i];
        // a parameter's cast to the compute dtype reads the rank's shard or gathered copy,
        // already of that dtype: no node, no second copy of the weight
        if let (Op::Cast { to }, [x], [y]) = (&node.op, &node.inputs[..], &ins[..]) {
            if self.an.param_index.contains_key(x) && e.p.ty(*y) == self.micro.ty(node.outputs[0]) {
                debug_assert_eq!(e.p.ty(*y).dtype, *to);
                return Ok(vec![*y]);
            }
        }
        let role = if recompute {
            Role::of(RoleKind::Recompute)
        } else {
            node.role.clone()
        };
        crate::dist::copy_node(e, self.micro, node, ins, tag, role)
    }

    /// Adds the reduced gradients of two backward layers back to their accumulators (by
    /// then their reduce-scatters have had a layer's backward to finish in); `all` adds
    /// every pending one.
    fn accumulate_due(
        &mut self,
        e: &mut Emitter,
        st: &mut MicroBatch,
        all: bool,
    ) -> Result<(), TrainError> {
        let seen = st.bwd_layers_seen;
        let (due, keep): (Vec<_>, Vec<_>) = st
            .pending
            .drain(..)
            .partition(|&(_, _, at)| all || at + 2 <= seen);
        st.pending = keep;
        for (j, v, _) in due {
            e.enter(
                format!("accumulate.mb{}/{}", st.mb, self.d.layouts[j].name),
                Role::new(RoleKind::Accumulate, format!("mb{}", st.mb)),
            );
            self.accumulate(e, st.mb, j, v).map_err(err)?;
        }
        Ok(())
    }

    /// Clones the forward of every layer whose activations node i (of the backward) reads
    /// and that is not recomputed yet in this micro-batch.
    fn recompute_for(
        &mut self,
        e: &mut Emitter,
        st: &mut MicroBatch,
        i: usize,
    ) -> Result<(), TrainError> {
        let (micro, an) = (self.micro, self.an);
        for &v in &micro.nodes[i].inputs {
            let Some(&l) = an.need_layer.get(&v) else {
                continue;
            };
            if !st.cloned.insert(l) {
                continue;
            }
            for &ci in &an.closure[l] {
                let cnode = &micro.nodes[ci];
                let mut ins = Vec::new();
                for &x in &cnode.inputs {
                    let y = if let Some(&k) = an.param_index.get(&x) {
                        let key = an.unit_of_use(ci, k, true);
                        self.param_for(e, st, key, k).map_err(err)?
                    } else if an.recomputed.contains(&x) {
                        *st.clones.get(&x).ok_or_else(|| {
                            err("internal: a recompute clone reads a value not yet recomputed")
                        })?
                    } else {
                        *st.vmap
                            .get(&x)
                            .ok_or_else(|| err("internal: unmapped value"))?
                    };
                    ins.push(y);
                }
                let tag = format!("{}/recompute", st.suffix);
                let outs = self.copy_node(e, ci, ins, &tag, true).map_err(err)?;
                for (&o, v) in cnode.outputs.iter().zip(outs) {
                    st.clones.insert(o, v);
                }
            }
        }
        Ok(())
    }

    /// Parameter j's gradient `v` of this micro-batch, reduced (per micro-batch: to its
    /// G-shard, accumulated two layers later; per step: accumulated whole now). `scope` is
    /// the reduction's scope under `reduce.mb<mb>`; `seen` the backward layer count to
    /// accumulate it after.
    fn reduce_grad(
        &mut self,
        e: &mut Emitter,
        st: &mut MicroBatch,
        j: usize,
        v: ValueId,
        layer: Option<&str>,
        seen: usize,
    ) -> Result<(), TrainError> {
        let mb = st.mb;
        let name = self.d.layouts[j].name.clone();
        let (scope, unit) = match layer {
            Some(layer) => (
                format!("reduce.mb{mb}.{layer}/{name}"),
                format!("mb{mb}.{layer}"),
            ),
            None => (format!("reduce.mb{mb}/{name}"), format!("mb{mb}")),
        };
        e.enter(scope, Role::new(RoleKind::Reduce, unit));
        let f = self.flat_grad(e, v, j).map_err(err)?;
        if self.per_mb {
            let r = self.reduce_scatter_g(e, f, j).map_err(err)?;
            st.pending.push((j, r, seen));
        } else {
            if layer.is_some() {
                e.enter(
                    format!("accumulate.mb{mb}/{name}"),
                    Role::new(RoleKind::Accumulate, format!("mb{mb}")),
                );
            }
            self.accumulate(e, mb, j, f).map_err(err)?;
        }
        Ok(())
    }

    /// Stage 5 for micro-batch `mb`: the forward and backward with parameters read from
    /// their gather units, recompute before each layer's backward, each gradient reduced as
    /// it is produced; then the gradients no node computes, and the pending accumulations.
    fn micro_batch(&mut self, e: &mut Emitter, mb: usize) -> Result<(), TrainError> {
        let (micro, an) = (self.micro, self.an);
        let mut st = self.micro_batch_inputs(e, mb)?;
        for (i, node) in micro.nodes.iter().enumerate() {
            let bwd = !an.is_fwd[i];
            if bwd {
                let l = an.node_layer[i];
                if st.last_bwd_layer != Some(l) {
                    st.last_bwd_layer = Some(l);
                    st.bwd_layers_seen += 1;
                }
                self.accumulate_due(e, &mut st, false)?;
                self.recompute_for(e, &mut st, i)?;
            }
            let mut ins = Vec::new();
            for &x in &node.inputs {
                let y = if let Some(&k) = an.param_index.get(&x) {
                    let key = an.unit_of_use(i, k, false);
                    self.param_for(e, &mut st, key, k).map_err(err)?
                } else if bwd && an.need_layer.contains_key(&x) {
                    st.clones[&x]
                } else {
                    *st.vmap.get(&x).ok_or_else(|| {
                        err(format!(
                            "internal: `{}` read before it is computed",
                            micro.value(x).name
                        ))
                    })?
                };
                ins.push(y);
            }
            if let Some(&j) = self.sparse.at.get(&i) {
                let l = &self.d.layouts[j];
                let layer = an.layer_names[an.param_layer[j]].replace('/', ".");
                e.enter(
                    format!("reduce.mb{mb}.{layer}/{}/rows", l.name),
                    Role::new(RoleKind::Reduce, format!("mb{mb}.{layer}")),
                );
                let r = self.sparse_rows(e, j, ins[1], ins[2]).map_err(err)?;
                st.done_grads[j] = true;
                st.pending.push((j, r, st.bwd_layers_seen));
                continue;
            }
            let suffix = st.suffix.clone();
            let outs = self.copy_node(e, i, ins, &suffix, false).map_err(err)?;
            for (&o, v) in node.outputs.iter().zip(outs) {
                st.vmap.insert(o, v);
                for &j in self.d.grad_of.get(&o).into_iter().flatten() {
                    st.done_grads[j] = true;
                    let layer = an.layer_names[an.param_layer[j]].replace('/', ".");
                    let seen = st.bwd_layers_seen;
                    self.reduce_grad(e, &mut st, j, v, Some(&layer), seen)?;
                }
            }
        }
        // Gradients that no node of the backward computes (constants, inputs).
        for j in 0..micro.params.len() {
            if st.done_grads[j] {
                continue;
            }
            let gv = micro.outputs[1 + j];
            let v = match st.vmap.get(&gv) {
                Some(&v) => v,
                None => {
                    let k = an.param_index[&gv];
                    let key = an.unit_of_use(0, k, true);
                    self.param_for(e, &mut st, key, k).map_err(err)?
                }
            };
            self.reduce_grad(e, &mut st, j, v, None, 0)?;
        }
        self.accumulate_due(e, &mut st, true)?;
        self.losses.push(st.vmap[&micro.outputs[0]]);
        Ok(())
    }

    /// Stage 6: the global loss, the mean of the ranks' micro-batch losses.
    fn global_loss(&self, e: &mut Emitter) -> Result<ValueId, TrainError> {
        let (m, w, losses) = (self.m, self.gr.w, &self.losses);
        e.enter("loss", Role::of(RoleKind::Loss));
        (|| -> Result<ValueId, String> {
            let mut v = losses[0];
            if e.ty(v).dtype != DType::F32 {
                v = e.op(Op::Cast { to: DType::F32 }, &[v])?;
            }
            for &x in &losses[1..] {
                let x = if e.ty(x).dtype != DType::F32 {
                    e.op(Op::Cast { to: DType::F32 }, &[x])?
                } else {
                    x
                };
                v = e.op(Op::Binary(BinaryOp::Add), &[v, x])?;
            }
            if m > 1 {
                let s = e.scalar(1.0 / m as f64, DType::F32);
                v = e.op(Op::Binary(BinaryOp::Mul), &[v, s])?;
            }
            if w > 1 {
                v = e.op(
                    Op::AllReduce {
                        group: self.gr.world.clone(),
                        reduce: ReduceOp::Sum,
                    },
                    &[v],
                )?;
                let s = e.scalar(1.0 / w as f64, DType::F32);
                v = e.op(Op::Binary(BinaryOp::Mul), &[v, s])?;
            }
            Ok(v)
        })()
        .map_err(err)
    }

    /// Stage 7: global-norm clipping, the optimizer on the O-shards, and the re-gather of
    /// each compute shard from its new master shard. Returns the step's outputs (loss, the
    /// norm when clipping), its updates, and the optimizer's state names per parameter.
    #[allow(clippy::type_complexity)]
    fn optimizer_and_regather(
        &self,
        e: &mut Emitter,
        cfg: &TrainConfig,
        opt: &train::Optimizer,
        loss: ValueId,
    ) -> Result<(Vec<ValueId>, Vec<Update>, Vec<Vec<String>>), TrainError> {
        let (gr, d) = (self.gr, self.d);
        // Every gradient was finished in the last micro-batch.
        let mut grads: Vec<ValueId> = self
            .final_g
            .iter()
            .map(|g| g.ok_or_else(|| err("internal: a gradient was never accumulated")))
            .collect::<Result<_, _>>()?;
        let mut outputs = vec![loss];
        if let Some(max_norm) = cfg.clip_grad_norm {
            e.enter("clip", Role::new(RoleKind::Optimizer, "clip"));
            let shards_of = (gr.o > 1).then_some(&gr.spec.optim);
            let (norm, clipped) = train::clip(e, &grads, max_norm, shards_of).map_err(err)?;
            grads = clipped;
            outputs.push(norm);
        }
        let mut updates: Vec<Update> = Vec::new();
        e.enter("optimizer", Role::of(RoleKind::Optimizer));
        let muon_matrices = match opt {
            train::Optimizer::Muon { .. } => Some(train::muon_parameters(self.fwd)?),
            _ => None,
        };
        let canzona = match opt {
            train::Optimizer::Muon { muon, .. } => {
                muon.placement == crate::train::muon::MuonPlacement::Canzona
            }
            _ => false,
        };
        let holding = match &muon_matrices {
            Some(ms) if canzona => {
                if gr.o < 2 {
                    return Err(err(format!(
                        "--muon-placement canzona gives each Muon matrix one owner in the \
                         optimizer group, but this plan's optimizer group {} has {} rank; use \
                         a strategy that shards the optimizer (asynchzp, zero1/2/3) on several \
                         ranks, or --muon-placement replicated",
                        gr.spec.optim, gr.o
                    )));
                }
                let steps = match opt {
                    train::Optimizer::Muon { muon, .. } => muon.ns_steps,
                    _ => 0,
                };
                let partition = crate::train::canzona::partition(ms, gr.o, steps);
                // which slots a rank transposes depends on the rank: its member index
                let member = if partition.buckets.iter().any(|b| !b.flipped.is_empty()) {
                    e.enter("optimizer/member", Role::of(RoleKind::Optimizer));
                    let m = e
                        .member_index("muon.member/ranks", &gr.spec.optim, gr.o)
                        .map_err(err)?;
                    e.enter("optimizer", Role::of(RoleKind::Optimizer));
                    Some(m)
                } else {
                    None
                };
                Holding::Canzona {
                    group: gr.spec.optim.clone(),
                    size: gr.o,
                    member,
                    partition,
                }
            }
            Some(_) => {
                // the optimizer group's member index, to take this rank's shard of a whole
                // orthogonalized matrix
                let member = if gr.o > 1 {
                    e.enter("optimizer/member", Role::of(RoleKind::Optimizer));
                    Some(
                        e.member_index("muon.member/ranks", &gr.spec.optim, gr.o)
                            .map_err(err)?,
                    )
                } else {
                    None
                };
                e.enter("optimizer", Role::of(RoleKind::Optimizer));
                Holding::Shards {
                    group: gr.spec.optim.clone(),
                    size: gr.o,
                    member,
                }
            }
            None => Holding::Whole,
        };
        let muon = muon_matrices.as_ref().map(|m| (m, &holding));
        let optim_states =
            train::optimizer(e, opt, &d.masters, &grads, &mut updates, muon).map_err(err)?;
        let state_names: Vec<Vec<String>> = optim_states
            .iter()
            .map(|v| v.iter().map(|&s| e.p.value(s).name.clone()).collect())
            .collect();
        // Rebuild each compute shard from the new master shard (the first update of each
        // target).
        let mut update_of: HashMap<ValueId, ValueId> = HashMap::with_capacity(updates.len());
        for u in &updates {
            update_of.entry(u.target).or_insert(u.value);
        }
        let compute = cfg.compute;
        for (k, &master) in d.masters.iter().enumerate() {
            let new_master = *update_of
                .get(&master)
                .ok_or_else(|| err("the optimizer did not update a parameter"))?;
            // one regather unit per layer, as the gathers: a layer's new shards go out as
            // soon as its optimizer step is done, while the next layers' steps run
            let layer = self.an.layer_names[self.an.param_layer[k]].replace('/', ".");
            e.enter(
                format!("regather.{layer}/{}", d.layouts[k].name),
                Role::new(RoleKind::Regather, layer.clone()),
            );
            let (o, p, o_minus_p) = match gr.expert(&d.layouts[k].name) {
                Some(x) => (x.o, x.p, &x.o_minus_p),
                None => (gr.o, gr.p, &gr.o_minus_p),
            };
            let run = |e: &mut Emitter| -> Result<ValueId, String> {
                let mut v = new_master;
                if compute != DType::F32 {
                    v = e.op(Op::Cast { to: compute }, &[v])?;
                }
                if o > p {
                    v = e.op(
                        Op::AllGather {
                            group: o_minus_p.clone(),
                            axis: 0,
                        },
                        &[v],
                    )?;
                }
                if v == new_master {
                    // fp32 with P = O: the shard is a copy of the master
                    v = e.op(Op::Copy, &[v])?;
                }
                Ok(v)
            };
            let v = run(e).map_err(err)?;
            updates.push(Update {
                target: d.shards[k],
                value: v,
            });
        }
        Ok((outputs, updates, state_names))
    }
}

/// The issue order and the rate-limiting waits of the gather units: the all-gathers of unit
/// j wait until unit r(j) is released (its last reader has run), where r(j) = j - depth - 1,
/// or earlier still if the bytes of units r(j)+1..=j would exceed `max_inflight_bytes`; they
/// are issued right after that release (prefetch), never later than their first reader.
/// Returns the node order and (waiting node, node waited for) pairs.
fn prefetch_schedule(
    p: &Program,
    units: &[UnitRec],
    sched: &ScheduleOptions,
) -> (Vec<NodeId>, Vec<(NodeId, NodeId)>) {
    let users = p.users();
    let index: HashMap<&str, usize> = units
        .iter()
        .enumerate()
        .map(|(i, u)| (u.key.as_str(), i))
        .collect();
    let unit_of = |n: &hzp_ir::Node| {
        (n.role.kind == RoleKind::Gather)
            .then(|| index.get(n.role.unit.as_str()).copied())
            .flatten()
    };
    struct U {
        gathers: Vec<NodeId>,
        start: usize,
        release: usize,
        bytes: u64,
    }
    let mut all: Vec<U> = (0..units.len())
        .map(|_| U {
            gathers: Vec::new(),
            start: usize::MAX,
            release: 0,
            bytes: 0,
        })
        .collect();
    for (i, n) in p.nodes.iter().enumerate() {
        let Some(u) = unit_of(n) else { continue };
        if n.stream == StreamKind::AllGather && n.op.is_collective() {
            all[u].gathers.push(NodeId(i as u32));
            all[u].start = all[u].start.min(i);
            all[u].bytes += n
                .outputs
                .iter()
                .map(|&v| p.ty(v).size_bytes() as u64)
                .sum::<u64>();
        }
        // released when the last reader outside the unit of a value it made has run
        for &o in &n.outputs {
            for r in &users[o.index()] {
                if unit_of(&p.nodes[r.index()]) != Some(u) {
                    all[u].release = all[u].release.max(r.index());
                }
            }
        }
    }
    // What moves with a unit's gathers: they and the nodes of the unit they depend on (the
    // flattening and concatenation of a bucket); `ready`: the latest producer outside those
    // that they read (they cannot be issued before it).
    let mut moves: Vec<(Vec<NodeId>, i64)> = Vec::new();
    let mut seq: Vec<U> = Vec::new();
    for (ui, mut u) in all.into_iter().enumerate() {
        if u.gathers.is_empty() {
            continue;
        }
        let mut set: BTreeSet<usize> = BTreeSet::new();
        let mut stack: Vec<usize> = u.gathers.iter().map(|n| n.index()).collect();
        while let Some(i) = stack.pop() {
            if !set.insert(i) {
                continue;
            }
            for &v in &p.nodes[i].inputs {
                if let Some(pn) = p.producer(v) {
                    if unit_of(&p.nodes[pn.index()]) == Some(ui) {
                        stack.push(pn.index());
                    }
                }
            }
        }
        let mut ready: i64 = -1;
        for &i in &set {
            for &v in &p.nodes[i].inputs {
                if let Some(pn) = p.producer(v) {
                    if !set.contains(&pn.index()) {
                        ready = ready.max(pn.index() as i64);
                    }
                }
            }
        }
        u.start = set.first().copied().unwrap_or(u.start);
        u.release = u.release.max(u.start);
        moves.push((set.into_iter().map(|i| NodeId(i as u32)).collect(), ready));
        seq.push(u);
    }
    let mut waits = Vec::new();
    // Where each unit's gathers go: after node `at` (-1: at the start of the step), or in
    // place (`None`) when the wait allows no earlier issue.
    let mut place: Vec<Option<i64>> = Vec::with_capacity(seq.len());
    let mut eff_prev: i64 = -1;
    for j in 0..seq.len() {
        let mut r: Option<usize> = j.checked_sub(sched.prefetch_depth + 1);
        if let Some(limit) = sched.max_inflight_bytes {
            // the earliest unit i such that units i..=j fit the limit (at least j itself)
            let mut total = seq[j].bytes;
            let mut i = j;
            while i > 0 && total + seq[i - 1].bytes <= limit {
                total += seq[i - 1].bytes;
                i -= 1;
            }
            // units i..=j may be in flight together: wait for unit i-1
            if let Some(ib) = i.checked_sub(1) {
                r = Some(r.map_or(ib, |r| r.max(ib)));
            }
        }
        // Only a release issued before the unit's first use can be waited for.
        while let Some(ri) = r {
            if seq[ri].release < seq[j].start {
                break;
            }
            r = ri.checked_sub(1);
        }
        let at = r.map_or(-1, |ri| seq[ri].release as i64).max(eff_prev);
        if let Some(ri) = r {
            for &gn in &seq[j].gathers {
                waits.push((gn, NodeId(seq[ri].release as u32)));
            }
        }
        let at = at.max(moves[j].1);
        if at < seq[j].start as i64 {
            place.push(Some(at));
            eff_prev = at;
        } else {
            place.push(None);
            eff_prev = seq[j].start as i64 - 1;
        }
    }
    (issue_order(p.nodes.len(), &moves, &place), waits)
}

/// The node order with each unit's moved nodes (`moves`) right after the node `place` says
/// (-1: at the start; `None`: left in place), every other node in program order.
fn issue_order(n: usize, moves: &[(Vec<NodeId>, i64)], place: &[Option<i64>]) -> Vec<NodeId> {
    let mut moved = vec![false; n];
    let mut after: BTreeMap<i64, Vec<NodeId>> = BTreeMap::new();
    for ((mv, _), at) in moves.iter().zip(place) {
        if let Some(at) = *at {
            for &gn in mv {
                after.entry(at).or_default().push(gn);
                moved[gn.index()] = true;
            }
        }
    }
    let mut order: Vec<NodeId> = after.get(&-1).cloned().unwrap_or_default();
    for (i, &m) in moved.iter().enumerate() {
        if !m {
            order.push(NodeId(i as u32));
        }
        if let Some(v) = after.get(&(i as i64)) {
            order.extend(v.iter().copied());
        }
    }
    order
}

/// Removes `c = Copy(x)` where `x` is computed on the compute stream by a node that is not a
/// collective and read by nothing else, and neither value is a program output or takes part
/// in an update: readers of `c` read `x`. An accumulator starts as a copy of its first
/// reduced gradient so that the compute stream, not the reduce-scatter stream, is the last
/// to read the collective's result (see `add_to`); after bucketing that value is a slice of
/// the bucket computed on the compute stream, and the copy only costs a pass over the
/// gradients.
fn drop_redundant_copies(q: &mut Program) {
    let users = q.users();
    let escapes = q.escaping_values();
    let mut subst: Vec<Option<ValueId>> = vec![None; q.values.len()];
    let mut any = false;
    for n in &q.nodes {
        let (Op::Copy, [x], [c]) = (&n.op, n.inputs.as_slice(), n.outputs.as_slice()) else {
            continue;
        };
        let computed = q.producer(*x).is_some_and(|pn| {
            let pn = q.node(pn);
            pn.stream == StreamKind::Compute && !pn.op.is_collective()
        });
        if computed
            && n.stream == StreamKind::Compute
            && !escapes[x.index()]
            && !escapes[c.index()]
            && users[x.index()].len() == 1
        {
            subst[c.index()] = Some(*x);
            any = true;
        }
    }
    if !any {
        return;
    }
    for n in q.nodes.iter_mut() {
        for v in n.inputs.iter_mut() {
            while let Some(x) = subst[v.index()] {
                *v = x;
            }
        }
    }
    q.eliminate_dead_code();
}

/// How many later reductions are issued before the compute stream reads a reduction's
/// result (see [`defer_reduce_consumers`]).
const REDUCE_DEPTH: usize = 2;

/// After the last reduction, the compute that reads a re-gathered layer waits until the
/// optimizer steps of the layers whose re-gathers go out this many re-gathers later are
/// issued: when a layer's re-gather takes longer than the next layer's reduction, the next
/// step's update still goes out without waiting for it (see [`defer_reduce_consumers`]).
const REGATHER_DEPTH: usize = 2;

/// Moves the compute that reads a reduction's result (unpacking a gradient bucket, adding
/// it to the accumulator, scaling) from right after the reduction to right after the
/// [`REDUCE_DEPTH`]-th next reduction is issued, so the compute stream goes on with the
/// next layers' backward while the reduction runs instead of waiting for it at once (two,
/// not one: a small reduction issued right after a large one, e.g. a position embedding's,
/// would otherwise make the compute stream wait for the large one before the work that
/// follows the small one). Nodes move only later, never past
/// a node that reads them (a collective packed from them stays where it was, and so do
/// they), and the result is a topological order that keeps `extra`'s (waiter, waited)
/// pairs: the deferral costs at most two reductions' results held a layer longer. After
/// the last reduction the optimizer steps run in reduction order, and the compute that
/// reads a layer's re-gathered parameters waits until the step of the layer
/// [`REGATHER_DEPTH`] re-gathers later is done.
fn defer_reduce_consumers(
    p: &Program,
    order: &[NodeId],
    extra: &[(NodeId, NodeId)],
) -> Vec<NodeId> {
    let n = order.len();
    let mut pos = vec![usize::MAX; p.nodes.len()];
    for (i, &id) in order.iter().enumerate() {
        pos[id.index()] = i;
    }
    let o = Reorder {
        p,
        order,
        pos,
        users: p.users(),
    };
    let reduces = o.update_reductions();
    // The preferred place of the node at each position: (target, 0) goes just before the
    // node at `target`, (own position, 1) stays.
    let mut key: Vec<(usize, usize)> = (0..n).map(|i| (i, 1)).collect();
    o.defer_reduction_readers(&reduces, &mut key);
    if let Some(&last) = reduces.last() {
        o.order_after_last_reduction(&reduces, last, &mut key);
    }
    o.send_side_reductions_early(&reduces, &mut key);
    let out = o.sort_by_keys(extra, &key);
    debug_assert_eq!(out.len(), n, "the order given is topological");
    out
}

/// A program in an issue order, with each node's position in it and each value's readers:
/// what [`defer_reduce_consumers`]'s steps read.
struct Reorder<'a> {
    p: &'a Program,
    order: &'a [NodeId],
    /// Node -> position in `order` (`usize::MAX`: not in it).
    pos: Vec<usize>,
    users: Vec<Vec<NodeId>>,
}

impl Reorder<'_> {
    /// Whether a node is a gradient-stream reduction.
    fn is_reduction(nd: &hzp_ir::Node) -> bool {
        nd.stream == StreamKind::ReduceScatter && nd.op.is_collective()
    }

    /// Positions of the reductions whose results the updates depend on (gradients on their
    /// way to the optimizer), in order; one whose result only leaves the step (the loss
    /// summed for the report) holds no update back.
    fn update_reductions(&self) -> Vec<usize> {
        let (p, order) = (self.p, self.order);
        let mut feeds_update = vec![false; p.values.len()];
        let mut stack: Vec<ValueId> = p.updates.iter().map(|u| u.value).collect();
        while let Some(v) = stack.pop() {
            if std::mem::replace(&mut feeds_update[v.index()], true) {
                continue;
            }
            if let Some(pn) = p.producer(v) {
                stack.extend(p.nodes[pn.index()].inputs.iter().copied());
            }
        }
        order
            .iter()
            .enumerate()
            .filter(|(_, id)| {
                let nd = &p.nodes[id.index()];
                Self::is_reduction(nd) && nd.outputs.iter().any(|o| feeds_update[o.index()])
            })
            .map(|(i, _)| i)
            .collect()
    }

    /// The compute that reads a reduction's result (through compute only) moves to just
    /// before the first node of another stream that reads it or the reduction
    /// `REDUCE_DEPTH` later, whichever comes first.
    fn defer_reduction_readers(&self, reduces: &[usize], key: &mut [(usize, usize)]) {
        let (p, order, pos, users) = (self.p, self.order, &self.pos, &self.users);
        let n = order.len();
        let mut stamp = vec![usize::MAX; n];
        let mut chain: Vec<usize> = Vec::new();
        let mut stack: Vec<usize> = Vec::new();
        for (k, &r) in reduces
            .iter()
            .enumerate()
            .take(reduces.len().saturating_sub(1))
        {
            // (the last reductions defer to the last one, after which the optimizer runs)
            let limit = reduces[(k + REDUCE_DEPTH).min(reduces.len() - 1)] + 1;
            chain.clear();
            stack.clear();
            stack.push(r);
            let mut first_ext = limit;
            while let Some(x) = stack.pop() {
                for &o in &p.nodes[order[x].index()].outputs {
                    for u in &users[o.index()] {
                        let pu = pos[u.index()];
                        if pu >= limit || stamp[pu] == k {
                            continue;
                        }
                        if p.nodes[u.index()].stream == StreamKind::Compute {
                            stamp[pu] = k;
                            chain.push(pu);
                            stack.push(pu);
                        } else {
                            first_ext = first_ext.min(pu);
                        }
                    }
                }
            }
            for &c in &chain {
                if c < first_ext && key[c].0 < first_ext {
                    key[c] = (first_ext, 0);
                }
            }
        }
    }

    /// After the last reduction (the optimizer, the re-gathers): work in the order its
    /// reductions were issued, so the updates of the parameters reduced first run while the
    /// last reductions (the first layers' gradients) are still on the wire. The compute that
    /// reads a re-gather (an all-gather issued after the last reduction) goes with the work
    /// of the layer whose re-gather goes out REGATHER_DEPTH later, so the compute stream runs
    /// the next layers' optimizer steps while the re-gather is on the wire instead of
    /// waiting for it.
    fn order_after_last_reduction(
        &self,
        reduces: &[usize],
        last: usize,
        key: &mut [(usize, usize)],
    ) {
        let (p, order, pos, users) = (self.p, self.order, &self.pos, &self.users);
        let n = order.len();
        let regathers: Vec<usize> = (last + 1..n)
            .filter(|&i| {
                let nd = &p.nodes[order[i].index()];
                nd.stream == StreamKind::AllGather && nd.op.is_collective()
            })
            .collect();
        let deps = |defer: &[Option<usize>]| {
            // 0: none, else 2 * (position + 1) of the reduction; odd: after that reduction's
            // work (a deferred re-gather reader)
            let mut dep = vec![0usize; n];
            for (i, &id) in order.iter().enumerate() {
                if reduces.binary_search(&i).is_ok() {
                    dep[i] = 2 * (i + 1);
                    continue;
                }
                let nd = &p.nodes[id.index()];
                let mut d = 0;
                for &v in &nd.inputs {
                    if let Some(pn) = p.producer(v) {
                        let j = pos[pn.index()];
                        if j != usize::MAX {
                            d = d.max(defer[j].unwrap_or(dep[j]));
                        }
                    }
                }
                dep[i] = d;
            }
            dep
        };
        let mut dep = deps(&vec![None; n]);
        // (an all-gather that waits for no reduction, such as an embedding gradient's rows,
        // carries no new parameters: its readers are not deferred)
        let mut by_dep: Vec<usize> = regathers.iter().copied().filter(|&g| dep[g] > 0).collect();
        if !by_dep.is_empty() {
            // in the order they go out: by the reductions they wait for
            by_dep.sort_by_key(|&g| (dep[g], g));
            let mut defer = vec![None; n];
            for (k, &g) in by_dep.iter().enumerate() {
                // the last ones' readers go after everything else
                defer[g] = Some(
                    by_dep
                        .get(k + REGATHER_DEPTH)
                        .map_or(2 * n + 3, |&h| dep[h].max(dep[g]) + 1),
                );
            }
            dep = deps(&defer);
        }
        // A node that waits for nothing goes with the earliest of its readers, not ahead of
        // everything (that would hold its result longer, e.g. every parameter's decay).
        let mut eff = dep.clone();
        for i in (last + 1..n).rev() {
            let mut first_reader = usize::MAX;
            for &o in &p.nodes[order[i].index()].outputs {
                for u in &users[o.index()] {
                    let j = pos[u.index()];
                    if j != usize::MAX && j > last {
                        first_reader = first_reader.min(eff[j]);
                    }
                }
            }
            // (a re-gather goes out as soon as its inputs are there)
            if first_reader != usize::MAX && regathers.binary_search(&i).is_err() {
                eff[i] = eff[i].max(first_reader);
            }
            key[i] = (last + 1, eff[i]);
        }
    }

    /// A reduction no update depends on (the loss summed for the report) goes out as soon
    /// as its inputs are there: queued behind the gradients' reductions, its reader would
    /// wait for all of them.
    fn send_side_reductions_early(&self, reduces: &[usize], key: &mut [(usize, usize)]) {
        let (p, order, pos) = (self.p, self.order, &self.pos);
        for (i, &id) in order.iter().enumerate() {
            let nd = &p.nodes[id.index()];
            if Self::is_reduction(nd) && reduces.binary_search(&i).is_err() {
                let ready = nd
                    .inputs
                    .iter()
                    .filter_map(|&v| p.producer(v))
                    .map(|pn| pos[pn.index()])
                    .filter(|&j| j != usize::MAX)
                    .max()
                    .map_or(0, |j| j + 1);
                key[i] = (ready, 0);
            }
        }
    }

    /// Kahn's algorithm over the data edges and the `extra` (waiter, waited) pairs,
    /// smallest (key, position) first among the ready nodes.
    fn sort_by_keys(&self, extra: &[(NodeId, NodeId)], key: &[(usize, usize)]) -> Vec<NodeId> {
        let (p, order, pos) = (self.p, self.order, &self.pos);
        let n = order.len();
        let mut indeg = vec![0u32; n];
        let mut succ: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, &id) in order.iter().enumerate() {
            for &v in &p.nodes[id.index()].inputs {
                if let Some(pn) = p.producer(v) {
                    let j = pos[pn.index()];
                    if j != usize::MAX && j != i {
                        succ[j].push(i);
                        indeg[i] += 1;
                    }
                }
            }
        }
        for &(waiter, waited) in extra {
            let (a, b) = (pos[waited.index()], pos[waiter.index()]);
            if a != usize::MAX && b != usize::MAX && a != b {
                succ[a].push(b);
                indeg[b] += 1;
            }
        }
        let mut heap: std::collections::BinaryHeap<std::cmp::Reverse<(usize, usize, usize)>> = (0
            ..n)
            .filter(|&i| indeg[i] == 0)
            .map(|i| std::cmp::Reverse((key[i].0, key[i].1, i)))
            .collect();
        let mut out = Vec::with_capacity(n);
        while let Some(std::cmp::Reverse((_, _, i))) = heap.pop() {
            out.push(order[i]);
            for &j in &succ[i] {
                indeg[j] -= 1;
                if indeg[j] == 0 {
                    heap.push(std::cmp::Reverse((key[j].0, key[j].1, j)));
                }
            }
        }
        out
    }
}
