//! The sharding planner: picks the shard groups P ⊆ G ⊆ O (parameters, gradients, optimizer
//! states) of a mesh for a model on a cluster, by memory and predicted step time.
//!
//! # Candidates
//!
//! Groups nest from the innermost (fastest) mesh axis out: the candidate groups are the
//! suffixes of the mesh's axis list ([`nested_groups`]: `[]`, `[gpu]`, `[node,gpu]` for
//! `node=128,gpu=8`; a split axis `gpu=2x4` gives the finer `[gpu.1]`, `[gpu.0,gpu.1]`).
//! [`Strategy::AsyncHzp`] weighs every nested triple P ⊆ G ⊆ O; the baselines are fixed
//! triples ([`Strategy::groups`]); a user's `--shard` override ([`ShardOverride`]) fixes the
//! groups it names and wins over the strategy.
//!
//! # Memory per rank
//!
//! With Ψ the parameter elements (each parameter padded to a multiple of o, as
//! [`crate::dist::spmd`] lays shards out), `c` the compute dtype's bytes and `r` the gradient
//! dtype's ([`ShardOptions::grad_dtype`], fp32 by default: gradients are accumulated and
//! reduced in fp32, as [`crate::dist::spmd`] does):
//!
//! | kind | bytes |
//! |---|---|
//! | parameters (compute-dtype shard) | `c Ψ / p` |
//! | master weights (fp32) | `4 Ψ / o` |
//! | gradients | `r Ψ / g` when reduce-scattered per micro-batch (or m = 1); `r Ψ` when accumulated unsharded for a per-step reduction, or when g = 1 |
//! | optimizer states (Adam m, v, fp32) | `8 Ψ / o` |
//! | activations | forward values the backward reads, for one micro-batch (below) |
//! | buffers | gathered parameters in flight + gradient buckets (below) |
//!
//! Activations come from the program itself: the forward program is lowered to the compute
//! dtype ([`crate::train::lower_precision`]), the loss attached, the backward appended
//! ([`crate::train::autodiff::differentiate`]); every forward value a backward node reads is saved,
//! except parameters, constants and values computed from parameters alone (casts and
//! transposes of weights: those are the gathered buffers). Graph inputs the backward reads
//! count. With `recompute`, only the inputs of every layer (values a layer reads that another
//! layer or no layer produced), the saved values outside every layer, and the largest one
//! layer's other saved values are kept. If the backward cannot be derived (an op without a
//! gradient rule), the planner falls back to the forward alone: the inputs of every forward op
//! other than additions, views and data movement are taken as saved, the backward is charged
//! twice the forward's compute, and the report says so in `notes`.
//!
//! Buffers: when p > 1, the gathered (full, compute-dtype) parameters of the
//! `prefetch_depth + 1` largest layers, or of every layer when parameters are kept gathered
//! from forward to backward (`reshard_after_forward = false`); when gradients are
//! reduce-scattered per layer (g > 1), two gradient buckets of the largest layers (one being
//! produced, one in flight).
//!
//! # Step time
//!
//! Compute: the roofline time ([`crate::cost::roofline`]) of every forward and backward node of
//! one micro-batch (in the lowered program's dtypes), times m, plus one more forward of the
//! layers per micro-batch with `recompute`, plus the AdamW update on the 1/o shard (memory
//! bound: fp32 master, m and v read and written, the gradient read, the compute copy written).
//!
//! Communication, with the fastest algorithm of the cost model ([`CostModel::best_collective`])
//! on each group's link classes:
//! - per layer and micro-batch: all-gather over P in forward, again in backward when
//!   parameters are resharded after forward (p > 1 only);
//! - per layer: reduce-scatter of the gradient over G, every micro-batch or only in the last
//!   micro-batch's backward for a per-step reduction (g > 1 only); an untied embedding's
//!   gradient reduced per micro-batch goes out instead as an all-gather over G of its
//!   looked-up rows and indices where the step does so ([`ShardOptions::sparse_grads`]: the
//!   rows split evenly over G, no padding, fewer bytes than the table);
//! - once per step, after the last backward: reduce-scatter of the G-shard over O\G,
//!   all-reduce of the O-shard over the rest of the world (W\O), the optimizer, then the
//!   all-gather of the updated compute-dtype shard over O\P.
//!
//! Overlap: a small event simulation of the step. The compute stream runs the layers in order
//! (forward, then backward in reverse, per micro-batch); the all-gather stream gathers a
//! layer's parameters ahead of its compute, at most `prefetch_depth + 1` gathered layers in
//! flight; the reduce-scatter stream reduces a layer's gradient after its backward. A layer
//! waits for its gather; the step-end collectives and the optimizer run after the last
//! reduce-scatter, exposed. In backward, a layer's re-gather and reduce-scatter share the link
//! classes both groups use: each is charged the smaller of the two bandwidth terms on those
//! links once more (fair sharing of two transfers started together); otherwise the streams are
//! independent. Predicted step time = the simulated end; exposed communication = step time
//! minus compute.
//!
//! # Choice
//!
//! The fastest candidate whose memory fits the budget; ties (within 1e-9 relative) go to less
//! memory, then fewer cross-node bytes, then the earlier candidate. Then, among the fitting
//! candidates predicted within [`SAME_SPEED`] (1%) of that one, the one sending the fewest
//! bytes across nodes wins: the analytical model cannot tell such step times apart, and
//! cross-node links are the contended ones; among those sending as many, the one needing the
//! least memory. If none fits, the error
//! names the candidate needing the least memory and breaks its need down.
//!
//! # One number: the simulator decides
//!
//! The analytical estimate above only shortlists. The compile driver ([`crate::compile`])
//! builds the plans of the [`shortlist`] (the fastest fitting candidates by the estimate and
//! every fitting candidate with a baseline's groups, so the choice is never slower in the
//! simulator than a baseline that fits), simulates each with [`crate::simulate`], and
//! [`rerank_simulated`] chooses the fastest simulated plan whose arena fits. The step the
//! compile reports is that simulation's: what `hzp simulate` gives the written plan. Each
//! candidate keeps its estimate in [`Candidate::estimate_s`].

use crate::cost::cluster::{node_local_group, ClusterError, ClusterSpec};
use crate::cost::{roofline, CollectiveCost, CollectiveKind, CostError, CostModel};
use crate::dist::spmd::ReduceGrads;
use crate::report::{human_bytes, human_count, layer_of_params, LayerGrouping};
use crate::train::autodiff::differentiate;
use crate::train::{attach_loss, lower_precision_cow, LossKind};
use hzp_ir::{BinaryOp, DType, Group, Mesh, Op, Program, ShardGroups, ValueDef, ValueId};
use serde::{Serialize, Serializer};
use std::collections::{BTreeMap, HashMap};
use std::fmt::{self, Write as _};

// ---------------------------------------------------------------------------------------------
// Options

/// How shard groups are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Strategy {
    /// Search every nested (P, G, O) by cost.
    AsyncHzp,
    /// Optimizer states sharded over the world: (none, none, world).
    Zero1,
    /// Gradients and optimizer states sharded over the world: (none, world, world).
    Zero2,
    /// Everything sharded over the world (FSDP FULL_SHARD): (world, world, world).
    Zero3,
    /// Everything sharded inside a node, replicated across nodes: (local, local, local).
    Hsdp,
    /// Nothing sharded; gradients all-reduced over the world: (none, none, none).
    Ddp,
    /// ZeRO-1's layout with ACCO's schedule (`dist::acco`): each half-batch's gradient
    /// reduction and optimizer step overlap the other half's compute.
    Acco,
    /// Replicas along a slow axis step locally and average a sparse chunk of their
    /// parameters asynchronously ([`crate::dist::asyncmesh`]); inside a replica the groups
    /// are searched over the other axes as for AsyncHzp.
    AsyncMesh,
}

impl Strategy {
    pub const ALL: [Strategy; 8] = [
        Strategy::AsyncHzp,
        Strategy::Zero1,
        Strategy::Zero2,
        Strategy::Zero3,
        Strategy::Hsdp,
        Strategy::Ddp,
        Strategy::Acco,
        Strategy::AsyncMesh,
    ];

    /// `asynchzp`, `zero1`, `zero2`, `zero3`, `hsdp`, `ddp`, `acco`, `asyncmesh`.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::AsyncHzp => "asynchzp",
            Strategy::Zero1 => "zero1",
            Strategy::Zero2 => "zero2",
            Strategy::Zero3 => "zero3",
            Strategy::Hsdp => "hsdp",
            Strategy::Ddp => "ddp",
            Strategy::Acco => "acco",
            Strategy::AsyncMesh => "asyncmesh",
        }
    }

    /// A strategy by name; also `async-hzp`, `hzp` and `fsdp` (= zero3). Case-insensitive.
    pub fn parse(s: &str) -> Result<Strategy, String> {
        let l = s.trim().to_ascii_lowercase();
        let found = match l.as_str() {
            "async-hzp" | "async_hzp" | "hzp" => Some(Strategy::AsyncHzp),
            "fsdp" | "zero-3" => Some(Strategy::Zero3),
            "zero-1" => Some(Strategy::Zero1),
            "zero-2" => Some(Strategy::Zero2),
            "async-mesh" | "async_mesh" => Some(Strategy::AsyncMesh),
            _ => Strategy::ALL.into_iter().find(|st| st.name() == l),
        };
        found.ok_or_else(|| {
            format!(
                "unknown strategy `{s}` (expected {})",
                Strategy::ALL.map(Strategy::name).join(", ")
            )
        })
    }

    /// The fixed groups of a baseline; `None` for [`Strategy::AsyncHzp`] and
    /// [`Strategy::AsyncMesh`], which search.
    /// HSDP shards over the node-local axes ([`node_local_group`]).
    pub fn groups(self, mesh: &Mesh, cluster: &ClusterSpec) -> Option<ShardGroups> {
        let none = Group::new(Vec::<String>::new());
        let world = world_group(mesh);
        let (p, g, o) = match self {
            Strategy::AsyncHzp | Strategy::AsyncMesh => return None,
            Strategy::Ddp => (none.clone(), none.clone(), none),
            Strategy::Zero1 | Strategy::Acco => (none.clone(), none, world),
            Strategy::Zero2 => (none, world.clone(), world),
            Strategy::Zero3 => (world.clone(), world.clone(), world),
            Strategy::Hsdp => {
                let l = node_local_group(mesh, cluster);
                (l.clone(), l.clone(), l)
            }
        };
        Some(ShardGroups {
            params: p,
            grads: g,
            optim: o,
        })
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for Strategy {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// What the planner plans for.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardOptions {
    pub strategy: Strategy,
    /// Bytes per rank; `None` = the cluster's device memory.
    pub memory_budget: Option<u64>,
    /// Micro-batches per step (m >= 1).
    pub micro_batches: usize,
    /// Compute dtype (bf16, f16 or f32); master weights and Adam states are fp32.
    pub compute: DType,
    /// The user's `--shard` groups; they win over the strategy.
    pub overrides: ShardOverride,
    /// The loss used to derive the backward; `None` tries `lm`, then `mean`.
    pub loss: Option<LossKind>,
    /// The schedule the candidates are built and costed with (gradient reduction and dtype,
    /// prefetch, resharding, recompute, row-exchanged embedding gradients). Its
    /// `narrow_grads` is the planner's to choose and is ignored here.
    pub schedule: crate::dist::spmd::ScheduleOptions,
    /// The matrices Muon updates (`--optimizer muon`; empty otherwise): they keep one
    /// momentum instead of AdamW's two moments, each member of O orthogonalizes every one
    /// of them whole (Newton-Schulz in f32 products, as the step program computes it), and
    /// their Nesterov updates are all-gathered over O first.
    pub muon: Vec<crate::train::muon::MuonMatrix>,
    /// `--muon-placement canzona`: each matrix is orthogonalized by one owner in O (the
    /// uniform slots of [`crate::train::canzona`]) after an all-to-all of the Nesterov
    /// updates to the owners, and a second all-to-all returns the results; only candidates
    /// whose O has several ranks.
    pub muon_canzona: bool,
}

impl Default for ShardOptions {
    fn default() -> Self {
        ShardOptions {
            strategy: Strategy::AsyncHzp,
            memory_budget: None,
            micro_batches: 1,
            compute: DType::BF16,
            overrides: ShardOverride::default(),
            loss: None,
            schedule: crate::dist::spmd::ScheduleOptions {
                reduce_grads: ReduceGrads::PerMicrobatch,
                reshard_after_forward: true,
                prefetch_depth: 1,
                max_inflight_bytes: None,
                recompute: false,
                grad_dtype: DType::F32,
                narrow_grads: None,
                sparse_grads: true,
                expert_parallel: None,
            },
            muon: Vec::new(),
            muon_canzona: false,
        }
    }
}

impl ShardOptions {
    /// The same options with per-layer activation recompute on or off.
    pub fn with_recompute(mut self, recompute: bool) -> ShardOptions {
        self.schedule.recompute = recompute;
        self
    }
}

// ---------------------------------------------------------------------------------------------
// Groups

/// Every axis of the mesh, outermost first.
pub fn world_group(mesh: &Mesh) -> Group {
    Group::new(mesh.axes.iter().map(|a| a.name.clone()))
}

/// The candidate groups: suffixes of the mesh's axes, from `[]` to the whole world.
pub fn nested_groups(mesh: &Mesh) -> Vec<Group> {
    let n = mesh.axes.len();
    (0..=n)
        .rev()
        .map(|k| Group::new(mesh.axes[k..].iter().map(|a| a.name.clone())))
        .collect()
}

/// `axes` in mesh order (outermost first), deduplicated; axes not in the mesh are dropped.
fn canonical<'a>(mesh: &Mesh, axes: impl IntoIterator<Item = &'a String>) -> Group {
    let set: Vec<&String> = axes.into_iter().collect();
    Group::new(
        mesh.axes
            .iter()
            .filter(|a| set.contains(&&a.name))
            .map(|a| a.name.clone()),
    )
}

/// The user's `--shard params=gpu,grads=gpu,optim=node.gpu`: groups it names are fixed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ShardOverride {
    pub params: Option<Group>,
    pub grads: Option<Group>,
    pub optim: Option<Group>,
}

impl ShardOverride {
    /// Parses `params=gpu,grads=gpu,optim=node.gpu` against `mesh`.
    ///
    /// Keys: `params` (`p`), `grads` (`g`), `optim` (`o`, `states`); each at most once. A
    /// group is mesh axes joined with `.` (`node.gpu`; a split axis keeps its own dot:
    /// `node.gpu.1`; the name of an axis that was split stands for all its parts), `none`
    /// for no axis, `world` for all. Groups given must nest: params ⊆ grads ⊆ optim. Errors
    /// name the bad entry and list the mesh's axes.
    pub fn parse(s: &str, mesh: &Mesh) -> Result<ShardOverride, String> {
        let axes_list = || {
            mesh.axes
                .iter()
                .map(|a| a.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut o = ShardOverride::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, val) = part.split_once('=').ok_or_else(|| {
                format!(
                    "--shard entry `{part}` must look like KEY=GROUP, e.g. params=gpu \
                     (keys: params, grads, optim)"
                )
            })?;
            let slot = match key.trim().to_ascii_lowercase().as_str() {
                "params" | "param" | "parameters" | "p" => &mut o.params,
                "grads" | "grad" | "gradients" | "g" => &mut o.grads,
                "optim" | "optimizer" | "states" | "o" => &mut o.optim,
                k => {
                    return Err(format!(
                    "--shard entry `{part}`: unknown key `{k}` (expected params, grads or optim)"
                ))
                }
            };
            if slot.is_some() {
                return Err(format!(
                    "--shard entry `{part}`: `{}` is given twice",
                    key.trim()
                ));
            }
            let val = val.trim();
            let group = match val.to_ascii_lowercase().as_str() {
                "none" | "" | "-" => Group::new(Vec::<String>::new()),
                "world" | "all" => world_group(mesh),
                _ => {
                    let tokens: Vec<&str> = val.split('.').collect();
                    let mut axes: Vec<String> = Vec::new();
                    let mut i = 0;
                    while i < tokens.len() {
                        // Longest run of tokens that names an axis (split axes contain dots).
                        let found = (i + 1..=tokens.len())
                            .rev()
                            .map(|j| (j, tokens[i..j].join(".")))
                            .find(|(_, name)| mesh.axis(name).is_some());
                        if let Some((j, name)) = found {
                            axes.push(name);
                            i = j;
                            continue;
                        }
                        let base = tokens[i];
                        let parts: Vec<String> = mesh
                            .axes
                            .iter()
                            .filter(|a| {
                                a.name
                                    .strip_prefix(base)
                                    .and_then(|r| r.strip_prefix('.'))
                                    .is_some_and(|r| {
                                        !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit())
                                    })
                            })
                            .map(|a| a.name.clone())
                            .collect();
                        if base.is_empty() || parts.is_empty() {
                            return Err(format!(
                                "--shard entry `{part}`: `{base}` is not an axis of the mesh \
                                 {mesh} (axes: {}; join axes with `.`, or say none or world)",
                                axes_list()
                            ));
                        }
                        axes.extend(parts);
                        i += 1;
                    }
                    for (k, a) in axes.iter().enumerate() {
                        if axes[..k].contains(a) {
                            return Err(format!(
                                "--shard entry `{part}`: axis `{a}` is named twice"
                            ));
                        }
                    }
                    canonical(mesh, &axes)
                }
            };
            *slot = Some(group);
        }
        let pairs = [
            ("params", &o.params, "grads", &o.grads),
            ("grads", &o.grads, "optim", &o.optim),
            ("params", &o.params, "optim", &o.optim),
        ];
        for (an, a, bn, b) in pairs {
            if let (Some(a), Some(b)) = (a, b) {
                if !a.is_subset_of(b) {
                    return Err(format!(
                        "--shard: groups must nest (params ⊆ grads ⊆ optim), but {an} {a} is \
                         not inside {bn} {b}"
                    ));
                }
            }
        }
        Ok(o)
    }

    pub fn is_empty(&self) -> bool {
        self.params.is_none() && self.grads.is_none() && self.optim.is_none()
    }
}

impl fmt::Display for ShardOverride {
    /// `params=gpu,optim=node.gpu` (what [`ShardOverride::parse`] reads back).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        for (k, g) in [
            ("params", &self.params),
            ("grads", &self.grads),
            ("optim", &self.optim),
        ] {
            if let Some(g) = g {
                let v = if g.axes.is_empty() {
                    "none".to_string()
                } else {
                    g.axes.join(".")
                };
                parts.push(format!("{k}={v}"));
            }
        }
        f.write_str(&parts.join(","))
    }
}

// ---------------------------------------------------------------------------------------------
// Results

/// Bytes per rank, by kind (see the module docs for the formulas).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryBreakdown {
    /// The compute-dtype parameter shard, `c Ψ / p`.
    pub params: u64,
    /// The fp32 master shard, `4 Ψ / o`.
    pub master: u64,
    /// Gradient shard (or the unsharded accumulator).
    pub grads: u64,
    /// Adam m and v, `8 Ψ / o`.
    pub optim_states: u64,
    /// Saved forward values of one micro-batch.
    pub activations: u64,
    /// `gathered + grad_buckets`.
    pub buffers: u64,
    /// Gathered parameters in flight.
    pub gathered: u64,
    /// Full-layer gradients waiting for their reduce-scatter.
    pub grad_buckets: u64,
    pub total: u64,
}

impl MemoryBreakdown {
    /// `parameters 1.0 GiB + master weights ... = total`.
    pub fn describe(&self) -> String {
        format!(
            "parameters {} + master weights {} + gradients {} + optimizer states {} + \
             activations {} + buffers {} = {}",
            human_bytes(self.params),
            human_bytes(self.master),
            human_bytes(self.grads),
            human_bytes(self.optim_states),
            human_bytes(self.activations),
            human_bytes(self.buffers),
            human_bytes(self.total)
        )
    }
}

/// One (P, G, O) weighed by the planner.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Candidate {
    /// Groups in mesh order, outermost axis first.
    pub params: Group,
    pub grads: Group,
    pub optim: Group,
    pub p: usize,
    pub g: usize,
    pub o: usize,
    /// The baselines with exactly these groups (`zero3`, `hsdp`, ...), joined by `/`.
    pub baseline: Option<String>,
    pub memory: MemoryBreakdown,
    /// `memory.total <= budget`.
    pub fits: bool,
    /// Seconds of compute per step (forward, backward, recompute, optimizer).
    pub compute_s: f64,
    /// Seconds of all collectives of a step, as if run back to back.
    pub comm_s: f64,
    /// The part of the communication not hidden behind compute.
    pub exposed_comm_s: f64,
    /// Predicted step time: compute + exposed communication. For a candidate the compile
    /// built and simulated ([`Candidate::simulated`]), the discrete-event simulator's step of
    /// its plan (and `compute_s`, `comm_s`, `exposed_comm_s` are the simulator's too);
    /// otherwise the planner's analytical estimate.
    pub step_s: f64,
    /// The planner's analytical estimate of the step (what `step_s` was before simulation).
    pub estimate_s: f64,
    /// Whether the compile built this candidate's plan and simulated it (see
    /// [`rerank_simulated`]).
    pub simulated: bool,
    /// Bytes one rank sends per step over each link class.
    pub bytes_per_link: BTreeMap<String, f64>,
    /// Bytes one rank sends per step over link classes that leave the node.
    pub cross_node_bytes: f64,
    /// Layers whose gradients accumulate in a narrower, node-local group (see
    /// [`crate::dist::spmd::ScheduleOptions::narrow_grads`]).
    pub narrow: Option<NarrowChoice>,
    /// Parameters whose gradients are modeled as exchanged rows rather than a reduced table
    /// (untied embeddings, see [`ShardOptions::sparse_grads`]).
    pub row_exchanged: Vec<String>,
}

/// Gradients of some layers reduced per micro-batch inside a node and accumulated there, the
/// rest of G reduced once per step: fewer bytes across nodes for the memory that fits.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NarrowChoice {
    pub group: Group,
    /// How many of the model's layers (as the planner groups them).
    pub layers: usize,
    /// Their parameters, by name.
    pub params: Vec<String>,
}

impl Candidate {
    pub fn groups(&self) -> ShardGroups {
        ShardGroups {
            params: self.params.clone(),
            grads: self.grads.clone(),
            optim: self.optim.clone(),
        }
    }

    /// `P=[gpu] G=[gpu] O=[node,gpu]`; `G=[node,gpu]+[gpu]x40` when 40 layers accumulate
    /// their gradients in [gpu].
    pub fn label(&self) -> String {
        format!(
            "P={} G={} O={}",
            self.params,
            self.grads_label(),
            self.optim
        )
    }

    /// The gradient group, with the narrower accumulation group and its layer count if any.
    pub fn grads_label(&self) -> String {
        match &self.narrow {
            Some(n) => format!("{}+{}x{}", self.grads, n.group, n.layers),
            None => self.grads.to_string(),
        }
    }
}

/// What the planner weighed and what it chose.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlanReport {
    pub model: String,
    pub cluster: String,
    pub mesh: String,
    pub world_size: usize,
    pub strategy: Strategy,
    pub overrides: ShardOverride,
    pub budget_bytes: u64,
    pub micro_batches: usize,
    pub compute_dtype: String,
    pub grad_dtype: String,
    pub reduce_grads: ReduceGrads,
    pub prefetch_depth: usize,
    pub reshard_after_forward: bool,
    pub recompute: bool,
    /// Trainable elements.
    pub parameters: u64,
    pub layers: usize,
    /// Saved activations of one micro-batch without recompute, and with it.
    pub activation_bytes: u64,
    pub activation_bytes_recompute: u64,
    /// The node-local axes and the link classes that leave a node.
    pub node_local: Group,
    pub cross_node_links: Vec<String>,
    /// What the planner had to estimate rather than derive from the program.
    pub notes: Vec<String>,
    pub chosen: Candidate,
    /// Every candidate weighed, in enumeration order (P, then G, then O, narrow to wide).
    pub candidates: Vec<Candidate>,
}

/// Why no plan came out.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ShardPlanError {
    #[error("{0}")]
    Options(String),
    #[error("{0}")]
    Override(String),
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error(transparent)]
    Cost(#[from] CostError),
    #[error("cannot plan model `{model}`: {message}")]
    Model { model: String, message: String },
    #[error("{}", no_fit_message(.model, .strategy, .budget, .weighed, .candidate, .hint))]
    DoesNotFit {
        model: String,
        strategy: Strategy,
        budget: u64,
        /// Candidates weighed.
        weighed: usize,
        /// The candidate needing the least memory.
        candidate: Box<Candidate>,
        /// What could make it fit (`Try ...`).
        hint: String,
    },
}

fn no_fit_message(
    model: &str,
    strategy: &Strategy,
    budget: &u64,
    weighed: &usize,
    c: &Candidate,
    hint: &str,
) -> String {
    let m = &c.memory;
    format!(
        "no sharding of `{model}` fits the memory budget of {} per rank (strategy {strategy}, \
         {weighed} candidate{} weighed). The smallest, {}, needs {} per rank: parameters {}, \
         master weights {}, gradients {}, optimizer states {}, activations {}, buffers {} \
         ({} gathered parameters, {} gradient buckets). {hint}",
        human_bytes(*budget),
        if *weighed == 1 { "" } else { "s" },
        c.label(),
        human_bytes(m.total),
        human_bytes(m.params),
        human_bytes(m.master),
        human_bytes(m.grads),
        human_bytes(m.optim_states),
        human_bytes(m.activations),
        human_bytes(m.buffers),
        human_bytes(m.gathered),
        human_bytes(m.grad_buckets),
    )
}

/// `Try ...`: the knobs that reduce the smallest candidate's need, largest part first.
fn no_fit_hint(opts: &ShardOptions, c: &Candidate) -> String {
    let m = &c.memory;
    let mut tries: Vec<(u64, &str)> = Vec::new();
    if !opts.schedule.recompute {
        tries.push((m.activations, "activation recompute (--recompute)"));
    }
    tries.push((m.activations, "a smaller micro-batch or sequence"));
    if opts.schedule.grad_dtype.size_bytes() > 2 && m.grads + m.grad_buckets > 0 {
        tries.push((m.grads + m.grad_buckets, "bf16 gradients"));
    }
    if opts.schedule.reduce_grads == ReduceGrads::PerStep && opts.micro_batches > 1 {
        tries.push((m.grads, "reducing gradients per micro-batch"));
    }
    if !opts.schedule.reshard_after_forward {
        tries.push((m.gathered, "resharding after forward"));
    }
    if opts.schedule.prefetch_depth > 1 {
        tries.push((m.gathered, "a smaller prefetch depth"));
    }
    if opts.strategy != Strategy::AsyncHzp || !opts.overrides.is_empty() {
        tries.push((
            m.params + m.master + m.optim_states,
            "wider shard groups (strategy asynchzp without --shard)",
        ));
    }
    tries.sort_by_key(|t| std::cmp::Reverse(t.0));
    let mut list: Vec<&str> = tries.iter().map(|t| t.1).collect();
    list.push("more ranks");
    format!("Try {}.", list.join(", "))
}

// ---------------------------------------------------------------------------------------------
// Model profile: what the planner needs from the program, independent of the groups.

/// Per layer (in execution order): name and parameter bytes in their declared dtypes.
/// Layers are [`layer_of_params`]'s.
pub fn layer_params(fwd: &Program) -> Vec<(String, u64)> {
    let g = layer_of_params(fwd);
    let mut out: Vec<(String, u64)> = g.names.iter().map(|n| (n.clone(), 0)).collect();
    for (prm, &l) in fwd.params.iter().zip(&g.of_param) {
        out[l].1 += fwd.ty(prm.value).size_bytes() as u64;
    }
    out
}

struct Profile {
    /// What was estimated rather than derived.
    notes: Vec<String>,
    /// Name and elements of each parameter and its layer.
    param_names: Vec<String>,
    param_numel: Vec<u64>,
    param_layer: Vec<usize>,
    layers: usize,
    /// Compute seconds of one micro-batch per layer; `other` = nodes outside every layer.
    fwd_s: Vec<f64>,
    bwd_s: Vec<f64>,
    other_fwd_s: f64,
    other_bwd_s: f64,
    act_bytes: u64,
    act_recompute_bytes: u64,
    /// Per parameter: its gradient as a scatter-add of looked-up rows into zeros (an untied
    /// embedding), which the step may exchange as rows (see [`RowTable`]).
    row_tables: Vec<Option<RowTable>>,
}

/// A parameter whose gradient is a scatter-add of looked-up rows into zeros
/// (`ScatterND(zeros, idx [..., 1], rows)`, read by nothing else): [`crate::dist::spmd`] all-gathers
/// the rows and their indices over G instead of reduce-scattering the table when, for the
/// candidate's G and O, the table's rows split evenly over G, its shards need no padding and
/// the rows of all ranks are fewer bytes than the table.
#[derive(Clone, Copy, Debug)]
struct RowTable {
    rows: u64,
    numel: u64,
    /// Lookups per rank and micro-batch.
    lookups: u64,
    index_bytes: u64,
}

impl RowTable {
    /// Bytes of rows and indices gathered over `g` ranks per micro-batch (gradient dtype
    /// `r` bytes per element), when the exchange applies for `g` and `o`.
    fn gathered(&self, g: u64, o: u64, r: u64) -> Option<u64> {
        if g <= 1 || !self.rows.is_multiple_of(g) || !self.numel.is_multiple_of(o) {
            return None;
        }
        let sent = g * self.lookups * (self.numel / self.rows * r + self.index_bytes);
        (sent < self.numel * r).then_some(sent)
    }
}

/// [`RowTable`] of parameter `param` with gradient `gv` in the differentiated program `p`.
fn row_table(
    p: &Program,
    users: &[Vec<hzp_ir::NodeId>],
    param: ValueId,
    gv: ValueId,
) -> Option<RowTable> {
    let n = p.node(p.producer(gv)?);
    let (Op::ScatterND { add: true }, &[base, idx, upd]) = (&n.op, n.inputs.as_slice()) else {
        return None;
    };
    let (pt, it, ut) = (p.ty(param), p.ty(idx), p.ty(upd));
    let lead = it.rank().checked_sub(1)?;
    let shaped = pt.rank() >= 2
        && it.rank() >= 2
        && it.shape[lead] == 1
        && it.dtype.is_int()
        && ut.rank() == lead + pt.rank() - 1
        && ut.shape[..lead] == it.shape[..lead]
        && ut.shape[lead..] == pt.shape[1..]
        && p.ty(base).shape == pt.shape
        && users[gv.index()].is_empty();
    let zero_base = matches!(
        p.producer(base).map(|b| &p.node(b).op),
        Some(Op::Fill { value, .. }) if *value == 0.0
    );
    (shaped && zero_base).then(|| RowTable {
        rows: pt.shape[0] as u64,
        numel: pt.numel() as u64,
        lookups: it.shape[..lead].iter().product::<usize>() as u64,
        index_bytes: it.dtype.size_bytes() as u64,
    })
}

fn model_err(fwd: &Program, message: impl Into<String>) -> ShardPlanError {
    ShardPlanError::Model {
        model: fwd.name.clone(),
        message: message.into(),
    }
}

/// Bytes of the activations the backward keeps (forward values the backward reads; without
/// a backward, `with_backward` false, the inputs of the forward's compute ops other than
/// additions, views and data movement), and with per-layer recompute (layer inputs and
/// values outside layers kept, plus one layer's rest). `p` holds the forward's `n_fwd`
/// nodes and `n_fwd_values` values first, then the backward.
fn saved_activations(
    p: &Program,
    (n_fwd, n_fwd_values): (usize, usize),
    grouping: &LayerGrouping,
    with_backward: bool,
) -> (u64, u64) {
    // Which forward values depend on an input, which on a parameter.
    let mut dep_in = vec![false; n_fwd_values];
    let mut dep_par = vec![false; n_fwd_values];
    for &i in &p.inputs {
        dep_in[i.index()] = true;
    }
    for prm in &p.params {
        dep_par[prm.value.index()] = true;
    }
    for n in &p.nodes[..n_fwd] {
        let a = n.inputs.iter().any(|v| dep_in[v.index()]);
        let b = n.inputs.iter().any(|v| dep_par[v.index()]);
        for &o in &n.outputs {
            dep_in[o.index()] = a;
            dep_par[o.index()] = b;
        }
    }
    let is_activation = |v: ValueId| -> bool {
        let i = v.index();
        i < n_fwd_values
            && !matches!(p.values[i].def, ValueDef::Param | ValueDef::Const)
            && (dep_in[i] || !dep_par[i])
    };
    let value_layer = |v: ValueId| -> Option<usize> {
        p.producer(v)
            .filter(|n| n.index() < n_fwd)
            .and_then(|n| grouping.of_node[n.index()])
    };
    let nl = grouping.names.len();

    // Saved values: forward values the backward reads (or, without a backward, the inputs
    // of forward ops other than additions, views and data movement).
    let mut saved = vec![false; n_fwd_values];
    let readers: Vec<&hzp_ir::Node> = if with_backward {
        p.nodes[n_fwd..].iter().collect()
    } else {
        p.nodes[..n_fwd]
            .iter()
            .filter(|n| {
                !matches!(
                    n.op,
                    Op::Identity
                        | Op::Reshape { .. }
                        | Op::Transpose { .. }
                        | Op::Slice { .. }
                        | Op::Concat { .. }
                        | Op::Split { .. }
                        | Op::Expand { .. }
                        | Op::Cast { .. }
                        | Op::Binary(BinaryOp::Add | BinaryOp::Sub)
                )
            })
            .collect()
    };
    for n in readers {
        for &v in &n.inputs {
            if is_activation(v) {
                saved[v.index()] = true;
            }
        }
    }
    let bytes_of = |i: usize| p.values[i].ty.size_bytes() as u64;
    let act_bytes: u64 = (0..n_fwd_values).filter(|&i| saved[i]).map(bytes_of).sum();
    // Recompute: keep layer inputs and saved values outside layers, plus one layer's rest.
    let mut kept = vec![false; n_fwd_values];
    for (i, &s) in saved.iter().enumerate() {
        if s && value_layer(ValueId(i as u32)).is_none() {
            kept[i] = true;
        }
    }
    for (ni, n) in p.nodes[..n_fwd].iter().enumerate() {
        let Some(l) = grouping.of_node[ni] else {
            continue;
        };
        for &v in &n.inputs {
            if is_activation(v) && value_layer(v) != Some(l) {
                kept[v.index()] = true;
            }
        }
    }
    let mut per_layer = vec![0u64; nl];
    for i in 0..n_fwd_values {
        if saved[i] && !kept[i] {
            if let Some(l) = value_layer(ValueId(i as u32)) {
                per_layer[l] += bytes_of(i);
            }
        }
    }
    let kept_bytes: u64 = (0..n_fwd_values).filter(|&i| kept[i]).map(bytes_of).sum();
    let act_recompute_bytes = kept_bytes + per_layer.iter().copied().max().unwrap_or(0);
    (act_bytes, act_recompute_bytes)
}

/// The modeled compute time of each layer's forward and backward and of the nodes outside
/// layers, over the first `timed` nodes of `p` (the forward's `n_fwd`, then the backward).
/// A backward node counts for the layer of a parameter it reads, else of the forward value
/// produced last it reads, else of its backward input produced last.
fn layer_times(
    p: &Program,
    n_fwd: usize,
    timed: usize,
    grouping: &LayerGrouping,
    cluster: &ClusterSpec,
    opts: &ShardOptions,
) -> (Vec<f64>, Vec<f64>, f64, f64) {
    let nl = grouping.names.len();
    let mut param_layer_of_value: HashMap<ValueId, usize> = HashMap::new();
    for (prm, &l) in p.params.iter().zip(&grouping.of_param) {
        param_layer_of_value.insert(prm.value, l);
    }
    let mut node_layer: Vec<Option<usize>> = grouping.of_node.clone();
    let mut fwd_s = vec![0.0; nl];
    let mut bwd_s = vec![0.0; nl];
    let (mut other_fwd_s, mut other_bwd_s) = (0.0, 0.0);
    // a product over a dropless MoE buffer computes its filled rows (as the simulator
    // charges it)
    let filled = crate::cost::moe::filled_fractions(p);
    for (i, n) in p.nodes[..timed].iter().enumerate() {
        let ins: Vec<&hzp_ir::TensorType> = n.inputs.iter().map(|&v| p.ty(v)).collect();
        let outs: Vec<&hzp_ir::TensorType> = n.outputs.iter().map(|&v| p.ty(v)).collect();
        let dtype = ins
            .iter()
            .map(|t| t.dtype)
            .find(|d| d.is_float())
            .unwrap_or(opts.compute);
        // Casts of parameters to the compute dtype do not run in a sharded step: the gathered
        // parameters already are in the compute dtype.
        let weight_cast = matches!(n.op, Op::Cast { .. })
            && n.inputs
                .iter()
                .all(|v| p.values[v.index()].def == ValueDef::Param);
        let secs = if weight_cast {
            0.0
        } else {
            roofline(&n.op, &ins, &outs, cluster, dtype)
                .with_flop_fraction(filled[i])
                .seconds
        };
        if i < n_fwd {
            match node_layer[i] {
                Some(l) => fwd_s[l] += secs,
                None => other_fwd_s += secs,
            }
            continue;
        }
        let direct = n
            .inputs
            .iter()
            .find_map(|v| param_layer_of_value.get(v).copied());
        let by_producer = |forward: bool| {
            n.inputs
                .iter()
                .filter_map(|&v| {
                    let prod = p.producer(v)?;
                    if (prod.index() < n_fwd) != forward || prod.index() >= i {
                        return None;
                    }
                    node_layer[prod.index()].map(|l| (prod, l))
                })
                .max_by_key(|(prod, _)| *prod)
                .map(|(_, l)| l)
        };
        let layer = direct
            .or_else(|| by_producer(true))
            .or_else(|| by_producer(false));
        node_layer.push(layer);
        match layer {
            Some(l) => bwd_s[l] += secs,
            None => other_bwd_s += secs,
        }
    }
    (fwd_s, bwd_s, other_fwd_s, other_bwd_s)
}

fn profile(
    fwd: &Program,
    cluster: &ClusterSpec,
    opts: &ShardOptions,
) -> Result<Profile, ShardPlanError> {
    let low = lower_precision_cow(fwd, opts.compute).map_err(|e| model_err(fwd, e.0))?;
    let mut p = match &opts.loss {
        Some(k) => attach_loss(&low, k),
        None => attach_loss(&low, &LossKind::Lm { labels: None })
            .or_else(|_| attach_loss(&low, &LossKind::Mean)),
    }
    .map_err(|e| model_err(fwd, e.0))?;
    drop(low);
    let n_fwd = p.nodes.len();
    let n_fwd_values = p.values.len();
    let grouping = layer_of_params(&p);
    let loss = p.outputs[0];
    let params: Vec<ValueId> = p.params.iter().map(|x| x.value).collect();
    // Without a backward (an op with no gradient rule), estimate from the forward alone.
    let grads = differentiate(&mut p, loss, &params);
    let row_tables: Vec<Option<RowTable>> = match &grads {
        Ok(gs) => {
            let users = p.users();
            let mut times: HashMap<ValueId, usize> = HashMap::new();
            for &g in gs {
                *times.entry(g).or_default() += 1;
            }
            params
                .iter()
                .zip(gs)
                .map(|(&w, &gv)| {
                    // (a gradient value shared with another parameter stays dense)
                    let once = times[&gv] == 1;
                    row_table(&p, &users, w, gv).filter(|_| once)
                })
                .collect()
        }
        Err(_) => vec![None; params.len()],
    };
    let fallback = grads.err().map(|e| {
        format!(
            "the backward could not be derived ({}); activations are estimated as the inputs of \
             the forward's compute ops and the backward as twice the forward's compute",
            e.0.trim_start_matches("autodiff: ")
        )
    });

    let (act_bytes, act_recompute_bytes) =
        saved_activations(&p, (n_fwd, n_fwd_values), &grouping, fallback.is_none());
    let timed = if fallback.is_none() {
        p.nodes.len()
    } else {
        n_fwd
    };
    let (fwd_s, mut bwd_s, other_fwd_s, mut other_bwd_s) =
        layer_times(&p, n_fwd, timed, &grouping, cluster, opts);
    if fallback.is_some() {
        bwd_s = fwd_s.iter().map(|f| 2.0 * f).collect();
        other_bwd_s = 2.0 * other_fwd_s;
    }
    // The activation peak the compiled step will have, measured on the scheduled step of one
    // rank (activations do not depend on the shard groups); the estimate above stays for the
    // other setting of recompute and for models without a backward.
    // Without recompute, the saved activations alone are a lower bound of the peak: when
    // they exceed the budget, nothing fits and measuring the peak is not needed.
    let (mut act_bytes, mut act_recompute_bytes) = (act_bytes, act_recompute_bytes);
    let budget = opts.memory_budget.unwrap_or(cluster.device.memory_bytes);
    let hopeless = !opts.schedule.recompute && act_bytes > budget;
    // What the profile keeps of the training program, taken before it is freed: the probe
    // below builds a whole step of its own, which need not sit on top of this one.
    let param_names: Vec<String> = p
        .params
        .iter()
        .map(|q| p.value(q.value).name.clone())
        .collect();
    let param_numel: Vec<u64> = p
        .params
        .iter()
        .map(|q| p.ty(q.value).numel() as u64)
        .collect();
    drop(p);
    if fallback.is_none() && !hopeless {
        if let Some(measured) = probe_activations(fwd, opts) {
            if opts.schedule.recompute {
                act_recompute_bytes = measured;
            } else {
                act_bytes = measured;
            }
        }
    }
    Ok(Profile {
        notes: fallback.into_iter().collect(),
        param_names,
        param_numel,
        param_layer: grouping.of_param.clone(),
        layers: grouping.names.len(),
        row_tables,
        fwd_s,
        bwd_s,
        other_fwd_s,
        other_bwd_s,
        act_bytes,
        act_recompute_bytes,
    })
}

/// Peak bytes of activations (every value of the step but gathered parameters, gradients on
/// their way to the optimizer, and optimizer work) over one micro-batch of the scheduled
/// step on a single rank, in issue order. `None` if that step cannot be built.
fn probe_activations(fwd: &Program, opts: &ShardOptions) -> Option<u64> {
    let mesh = Mesh::parse("gpu=1").ok()?;
    let loss = opts.loss.clone().unwrap_or(LossKind::Lm { labels: None });
    let cfg = crate::train::TrainConfig {
        loss,
        optimizer: Some(crate::train::Optimizer::Sgd {
            lr: 0.1,
            momentum: 0.0,
            weight_decay: 0.0,
        }),
        clip_grad_norm: None,
        micro_batches: 1,
        compute: opts.compute,
    };
    let sched = crate::dist::spmd::ScheduleOptions {
        reduce_grads: ReduceGrads::PerMicrobatch,
        reshard_after_forward: opts.schedule.reshard_after_forward,
        prefetch_depth: opts.schedule.prefetch_depth,
        max_inflight_bytes: None,
        recompute: opts.schedule.recompute,
        grad_dtype: opts.schedule.grad_dtype,
        narrow_grads: None,
        sparse_grads: true,
        expert_parallel: None,
    };
    let none = Group::new(Vec::<String>::new());
    let spec = crate::dist::spmd::ShardGroups {
        params: none.clone(),
        grads: none.clone(),
        optim: none,
    };
    let step = crate::dist::spmd::shard_training_step_with(fwd, &cfg, &mesh, &spec, &sched).ok()?;
    let q = &step.program;
    let activation = |n: &hzp_ir::Node| {
        use hzp_ir::RoleKind as K;
        matches!(n.role.kind, K::Compute | K::Recompute | K::Loss)
    };
    let mut last = vec![0usize; q.values.len()];
    for (i, n) in q.nodes.iter().enumerate() {
        for &v in &n.inputs {
            last[v.index()] = i;
        }
    }
    let mut ends: Vec<u64> = vec![0; q.nodes.len() + 1];
    let (mut live, mut peak) = (0u64, 0u64);
    for (i, n) in q.nodes.iter().enumerate() {
        live -= ends[i];
        if activation(n) {
            for &o in &n.outputs {
                let b = q.ty(o).size_bytes() as u64;
                live += b;
                let end = last[o.index()].max(i);
                ends[end + 1] += b;
            }
        }
        peak = peak.max(live);
    }
    Some(peak)
}

// ---------------------------------------------------------------------------------------------
// Evaluation of one candidate

type CostCache = HashMap<(CollectiveKind, u64, Group), CollectiveCost>;

struct Ctx<'a> {
    mesh: &'a Mesh,
    model: &'a CostModel,
    opts: &'a ShardOptions,
    prof: &'a Profile,
    /// Expert parallelism (`opts.schedule.expert_parallel`): what it splits.
    experts: Option<&'a ExpertInfo>,
    budget: u64,
    cross_links: &'a [String],
    baselines: &'a [(Strategy, ShardGroups)],
}

/// Seconds of one collective alone, and with the bandwidth term on the link classes in
/// `shared` doubled (what it takes when another collective shares those links throughout).
struct Comm {
    seconds: f64,
    shared_s: f64,
}

/// The cost of a collective (cached), with its traffic and time counted `times` per step
/// into `links` and `total`.
#[allow(clippy::too_many_arguments)]
fn collective(
    ctx: &Ctx,
    cache: &mut CostCache,
    kind: CollectiveKind,
    bytes: u64,
    group: &Group,
    times: f64,
    shared: &[String],
    links: &mut BTreeMap<String, f64>,
    total: &mut f64,
) -> Result<Comm, ShardPlanError> {
    if bytes == 0 || ctx.mesh.size_of(group) <= 1 {
        return Ok(Comm {
            seconds: 0.0,
            shared_s: 0.0,
        });
    }
    let key = (kind, bytes, group.clone());
    if !cache.contains_key(&key) {
        let c = ctx.model.best_collective(kind, bytes as f64, group)?;
        cache.insert(key.clone(), c);
    }
    let c = &cache[&key];
    if times > 0.0 {
        for (l, b) in &c.bytes_sent_per_rank_per_link {
            *links.entry(l.clone()).or_insert(0.0) += b * times;
        }
        *total += c.seconds * times;
    }
    Ok(Comm {
        seconds: c.seconds,
        shared_s: c.time_with_sharing(|l| if shared.iter().any(|x| x == l) { 2 } else { 1 }),
    })
}

/// One task of the step simulation: a layer's compute, the gather it waits for, the
/// reduce-scatter that follows it.
struct Task {
    compute: f64,
    gather: f64,
    reduce: f64,
}

/// Simulated end of the compute/gather/reduce-scatter streams (see the module docs).
fn simulate(tasks: &[Task], prefetch_depth: usize) -> f64 {
    let window = prefetch_depth + 1;
    let mut comp_end = 0.0f64;
    let mut ag_free = 0.0f64;
    let mut rs_free = 0.0f64;
    // Compute end of every gathering task so far (a gather slot frees when it ends).
    let mut gathered_done: Vec<f64> = Vec::new();
    let mut gathers = 0usize;
    for t in tasks {
        let mut ready = comp_end;
        if t.gather > 0.0 {
            let slot_free = if gathers >= window {
                gathered_done[gathers - window]
            } else {
                0.0
            };
            let start = ag_free.max(slot_free);
            ag_free = start + t.gather;
            ready = ready.max(ag_free);
        }
        comp_end = ready + t.compute;
        if t.gather > 0.0 {
            gathered_done.push(comp_end);
            gathers += 1;
        }
        if t.reduce > 0.0 {
            rs_free = rs_free.max(comp_end) + t.reduce;
        }
    }
    comp_end.max(rs_free)
}

/// With `--muon-placement canzona` and several optimizer ranks: the partition of the Muon
/// matrices over `o` ranks the step program runs (names stand in for the matrices: only the
/// shapes and costs matter here).
fn canzona_partition(opts: &ShardOptions, o: usize) -> Option<crate::train::canzona::Partition> {
    if !opts.muon_canzona || o < 2 || opts.muon.is_empty() {
        return None;
    }
    let ms: std::collections::BTreeMap<String, crate::train::muon::MuonMatrix> = opts
        .muon
        .iter()
        .enumerate()
        .map(|(i, m)| (format!("m{i:08}"), m.clone()))
        .collect();
    Some(crate::train::canzona::partition(&ms, o, 5))
}

/// Elements per layer, each parameter padded to a multiple of `o` (as the layouts pad).
fn layer_pad(prof: &Profile, o: u64, experts: Option<&ExpertInfo>) -> (Vec<u64>, Vec<u64>) {
    let mut pad = vec![0u64; prof.layers];
    let mut expert = vec![0u64; prof.layers];
    for (k, (&n, &l)) in prof.param_numel.iter().zip(&prof.param_layer).enumerate() {
        if experts.is_some_and(|x| x.is_expert[k]) {
            // an expert weight is not padded (spmd refuses one that would need it)
            expert[l] += n;
        } else {
            pad[l] += n.div_ceil(o).max(1) * o;
        }
    }
    (pad, expert)
}

/// The sizes a candidate (P, G, O, and the narrow group N of the layers in `in_narrow`) is
/// costed with: group sizes, bytes per element, each layer's padded elements.
struct Sizes {
    p: usize,
    g: usize,
    o: usize,
    /// The narrow gradient group (G when none) and its size.
    ng: Group,
    n_size: usize,
    in_narrow: Vec<bool>,
    w: usize,
    m: usize,
    /// Bytes per element of the compute and the gradient-reduction dtype.
    c: u64,
    r: u64,
    layer_pad: Vec<u64>,
    /// All padded elements, and those of the narrow layers.
    psi: u64,
    narrow_pad: u64,
    /// Gradients reduce-scattered over G per micro-batch (or with one micro-batch).
    sharded_grads: bool,
    /// Elements of the matrices Muon updates.
    muon_numel: u64,
    /// Under expert parallelism, the expert weights (not in `layer_pad` and `psi`).
    ex: Option<ExpertSizes>,
}

/// The expert weights of a candidate under expert parallelism over E (`n` ranks): a rank
/// computes with `1/n` of each, ZeRO-sharded over P \ E, G \ E and O \ E.
struct ExpertSizes {
    n: u64,
    /// Elements per layer (whole), and in all.
    layer: Vec<u64>,
    psi: u64,
    p_group: Group,
    g_group: Group,
    /// Sizes of P \ E, G \ E, O \ E and of the replicas W \ (O ∪ E).
    p: u64,
    g: u64,
    o: u64,
    replicas: Group,
    r: u64,
    o_minus_g: Group,
    o_minus_p: Group,
    /// Per layer, the AllToAll bytes of one micro-batch's forward, and the group.
    a2a_bytes: Vec<u64>,
    group: Group,
}

impl ExpertSizes {
    fn new(
        ctx: &Ctx,
        x: &ExpertInfo,
        (pg, gg, og): (&Group, &Group, &Group),
        layer: Vec<u64>,
    ) -> ExpertSizes {
        let mesh = ctx.mesh;
        let e = &x.group;
        let (p_group, g_group, o_group) = (pg.minus(e), gg.minus(e), og.minus(e));
        let replicas = world_group(mesh).minus(og).minus(e);
        ExpertSizes {
            n: x.n as u64,
            psi: layer.iter().sum(),
            layer,
            p: mesh.size_of(&p_group) as u64,
            g: mesh.size_of(&g_group) as u64,
            o: mesh.size_of(&o_group) as u64,
            r: mesh.size_of(&replicas) as u64,
            o_minus_g: o_group.minus(&g_group),
            o_minus_p: o_group.minus(&p_group),
            p_group,
            g_group,
            replicas,
            a2a_bytes: x.a2a_bytes.clone(),
            group: e.clone(),
        }
    }

    /// A rank's elements of expert layer `l` (its experts' slice).
    fn local(&self, l: usize) -> u64 {
        self.layer[l] / self.n
    }
}

impl Sizes {
    fn new(
        ctx: &Ctx,
        (pg, gg, og): (&Group, &Group, &Group),
        narrow: Option<(&Group, &[bool])>,
    ) -> Sizes {
        let (mesh, opts, prof) = (ctx.mesh, ctx.opts, ctx.prof);
        let (p, g, o) = (mesh.size_of(pg), mesh.size_of(gg), mesh.size_of(og));
        // Layers whose gradients accumulate in the narrower group `ng` (n ranks).
        let (ng, in_narrow): (Group, Vec<bool>) = match narrow {
            Some((n, flags)) => (n.clone(), flags.to_vec()),
            None => (gg.clone(), vec![false; prof.layers]),
        };
        let m = opts.micro_batches.max(1);
        let (layer_pad, layer_expert) = layer_pad(prof, o as u64, ctx.experts);
        let ex = ctx
            .experts
            .map(|x| ExpertSizes::new(ctx, x, (pg, gg, og), layer_expert));
        let narrow_pad: u64 = layer_pad
            .iter()
            .zip(&in_narrow)
            .filter(|(_, &f)| f)
            .map(|(&n, _)| n)
            .sum();
        Sizes {
            p,
            g,
            o,
            n_size: mesh.size_of(&ng),
            ng,
            in_narrow,
            w: mesh.world_size(),
            m,
            c: opts.compute.size_bytes() as u64,
            r: opts.schedule.grad_dtype.size_bytes() as u64,
            psi: layer_pad.iter().sum(),
            layer_pad,
            narrow_pad,
            sharded_grads: g > 1
                && (opts.schedule.reduce_grads == ReduceGrads::PerMicrobatch || m == 1),
            muon_numel: opts.muon.iter().map(|m| (m.rows * m.cols) as u64).sum(),
            ex,
        }
    }

    /// The elements of the `k` largest layers (with a rank's slice of the expert weights).
    fn largest(&self, k: usize) -> u64 {
        let mut sorted = self.layer_pad.clone();
        if let Some(x) = &self.ex {
            for (l, s) in sorted.iter_mut().enumerate() {
                *s += x.local(l);
            }
        }
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        sorted.iter().take(k).sum()
    }
}

/// A candidate's memory per rank, by kind.
fn candidate_memory(ctx: &Ctx, z: &Sizes) -> MemoryBreakdown {
    let (opts, prof) = (ctx.opts, ctx.prof);
    let (c, r, psi, o64) = (z.c, z.r, z.psi, z.o as u64);
    // ACCO keeps a whole estimate of the parameters, a second whole gradient (one half's
    // while the other's accumulates) and the reduced half-gradient on the O-shard
    let acco = opts.strategy == Strategy::Acco;
    let params = c * psi / z.p as u64 + if acco { c * psi } else { 0 };
    let master = 4 * psi / o64;
    let grads = if z.sharded_grads {
        r * (psi - z.narrow_pad) / z.g as u64 + r * z.narrow_pad / z.n_size as u64
    } else {
        r * psi
    } + if acco { r * psi + 4 * psi / o64 } else { 0 };
    // Muon's matrices keep one momentum (4 bytes), every other parameter AdamW's two
    let optim_states = 8 * (psi - z.muon_numel) / o64 + 4 * z.muon_numel / o64;
    // the expert weights: a rank's slice, sharded over the groups without E
    let (params, master, grads, optim_states) = match &z.ex {
        Some(x) => {
            let local = x.psi / x.n;
            (
                params + c * local / x.p,
                master + 4 * local / x.o,
                grads
                    + if z.sharded_grads {
                        r * local / x.g
                    } else {
                        r * local
                    },
                optim_states + 8 * local / x.o,
            )
        }
        None => (params, master, grads, optim_states),
    };
    let activations = if opts.schedule.recompute {
        prof.act_recompute_bytes
    } else {
        prof.act_bytes
    };
    let gathered = if z.p > 1 {
        if opts.schedule.reshard_after_forward {
            c * z.largest(opts.schedule.prefetch_depth + 1)
        } else {
            c * (psi + z.ex.as_ref().map_or(0, |x| x.psi / x.n))
        }
    } else {
        0
    };
    let grad_buckets = if z.sharded_grads { r * z.largest(2) } else { 0 };
    let buffers = gathered + grad_buckets;
    let total = params + master + grads + optim_states + activations + buffers;
    MemoryBreakdown {
        params,
        master,
        grads,
        optim_states,
        activations,
        buffers,
        gathered,
        grad_buckets,
        total,
    }
}

/// Collectives costed for one candidate, their traffic per link class and total time
/// summed in the order they are asked for.
struct Tally<'t, 'c> {
    ctx: &'t Ctx<'c>,
    cache: &'t mut CostCache,
    links: BTreeMap<String, f64>,
    comm_s: f64,
}

impl Tally<'_, '_> {
    /// [`collective`], counted `times` per step.
    fn add(
        &mut self,
        kind: CollectiveKind,
        bytes: u64,
        group: &Group,
        times: f64,
        shared: &[String],
    ) -> Result<Comm, ShardPlanError> {
        collective(
            self.ctx,
            self.cache,
            kind,
            bytes,
            group,
            times,
            shared,
            &mut self.links,
            &mut self.comm_s,
        )
    }

    /// Link classes of `grp` that P's all-gathers also use (in backward the re-gather and
    /// the reduce-scatter run at once and share their bandwidth).
    fn shared_with_p(&self, pg: &Group, grp: &Group) -> Vec<String> {
        let model = &self.ctx.model;
        let p_links: Vec<String> = model
            .group_link_classes(pg)
            .iter()
            .map(|l| l.name.clone())
            .collect();
        model
            .group_link_classes(grp)
            .iter()
            .map(|l| l.name.clone())
            .filter(|l| p_links.contains(l))
            .collect()
    }
}

/// Per layer, the all-gather of its parameters and the reduction of its gradients (dense
/// reduce-scatter plus the rows of row-exchanged embeddings); and the names of the
/// row-exchanged parameters.
#[allow(clippy::type_complexity)]
fn layer_collectives(
    t: &mut Tally,
    z: &Sizes,
    (pg, gg): (&Group, &Group),
) -> Result<(Vec<Comm>, Vec<Comm>, Vec<String>), ShardPlanError> {
    let (opts, prof) = (t.ctx.opts, t.ctx.prof);
    let mf = z.m as f64;
    let regather = z.p > 1 && opts.schedule.reshard_after_forward;
    let rs_times = match (z.g > 1, z.sharded_grads) {
        (true, true) => mf,
        (true, false) => 1.0,
        (false, _) => 0.0,
    };
    let shared = t.shared_with_p(pg, gg);
    let shared_narrow = t.shared_with_p(pg, &z.ng);
    let ag_times = if z.p > 1 {
        mf * if regather { 2.0 } else { 1.0 }
    } else {
        0.0
    };
    // Untied embeddings whose gradients go out as rows (per layer: table elements no longer
    // reduce-scattered, bytes of rows and indices all-gathered over G), as the step does
    // with per-micro-batch reductions over a G of more than one rank.
    let mut row_elems = vec![0u64; prof.layers];
    let mut row_bytes = vec![0u64; prof.layers];
    let mut row_exchanged = Vec::new();
    if opts.schedule.sparse_grads
        && z.sharded_grads
        && opts.schedule.reduce_grads == ReduceGrads::PerMicrobatch
    {
        for (k, tb) in prof.row_tables.iter().enumerate() {
            let l = prof.param_layer[k];
            let gathered =
                tb.and_then(|tb| tb.gathered(z.g as u64, z.o as u64, z.r).map(|b| (tb, b)));
            if let (Some((tb, b)), false) = (gathered, z.in_narrow[l]) {
                row_elems[l] += tb.numel;
                row_bytes[l] += b;
                row_exchanged.push(prof.param_names[k].clone());
            }
        }
    }
    let mut ag = Vec::with_capacity(prof.layers);
    let mut rs = Vec::with_capacity(prof.layers);
    for (l, (&n, &nar)) in z.layer_pad.iter().zip(&z.in_narrow).enumerate() {
        let mut a = t.add(CollectiveKind::AllGather, z.c * n, pg, ag_times, &shared)?;
        if let Some(x) = z.ex.as_ref().filter(|x| x.p > 1 && z.p > 1) {
            let e = t.add(
                CollectiveKind::AllGather,
                z.c * x.local(l),
                &x.p_group,
                ag_times,
                &shared,
            )?;
            a.seconds += e.seconds;
            a.shared_s += e.shared_s;
        }
        ag.push(a);
        let (rg, rsize, rshared) = if nar {
            (&z.ng, z.n_size, &shared_narrow)
        } else {
            (gg, z.g, &shared)
        };
        let times = if rsize > 1 { rs_times } else { 0.0 };
        let dense = t.add(
            CollectiveKind::ReduceScatter,
            z.r * (n - row_elems[l]),
            rg,
            times,
            rshared,
        )?;
        let rows = t.add(
            CollectiveKind::AllGather,
            row_bytes[l],
            gg,
            rs_times,
            &shared,
        )?;
        let mut experts = Comm {
            seconds: 0.0,
            shared_s: 0.0,
        };
        if let Some(x) = z.ex.as_ref().filter(|x| x.g > 1) {
            experts = t.add(
                CollectiveKind::ReduceScatter,
                z.r * x.local(l),
                &x.g_group,
                rs_times,
                &shared,
            )?;
        }
        rs.push(Comm {
            seconds: dense.seconds + rows.seconds + experts.seconds,
            shared_s: dense.shared_s + rows.shared_s + experts.shared_s,
        });
    }
    Ok((ag, rs, row_exchanged))
}

/// The once-per-step collectives: the cross-replica reduce-scatter (O\G) and all-reduce
/// (W\O), each narrow layer's reduction over the rest of O (by layer), and the re-gather
/// over O\P.
struct StepComms {
    rs_cross: f64,
    narrow_cross: Vec<f64>,
    ar_cross: f64,
    ag_regather: f64,
}

fn step_collectives(
    t: &mut Tally,
    z: &Sizes,
    (pg, gg, og): (&Group, &Group, &Group),
) -> Result<StepComms, ShardPlanError> {
    let (mesh, prof) = (t.ctx.mesh, t.ctx.prof);
    let world = world_group(mesh);
    let (r, psi, o64) = (z.r, z.psi, z.o as u64);
    let rs_cross = t
        .add(
            CollectiveKind::ReduceScatter,
            r * (psi - z.narrow_pad) / z.g as u64,
            &og.minus(gg),
            1.0,
            &[],
        )?
        .seconds;
    // A narrow layer's gradient crosses the rest of O once, right after its last
    // accumulation: on the reduce stream during the last micro-batch's backward.
    let mut narrow_cross = vec![0.0; prof.layers];
    if z.narrow_pad > 0 {
        let rest = og.minus(&z.ng);
        for (l, (&n, &nar)) in z.layer_pad.iter().zip(&z.in_narrow).enumerate() {
            if nar {
                let bytes = r * n / z.n_size as u64;
                narrow_cross[l] = t
                    .add(CollectiveKind::ReduceScatter, bytes, &rest, 1.0, &[])?
                    .seconds;
            }
        }
    }
    let ar_cross = if z.w > z.o {
        t.add(
            CollectiveKind::AllReduce,
            r * psi / o64,
            &world.minus(og),
            1.0,
            &[],
        )?
        .seconds
    } else {
        0.0
    };
    let ag_regather = t
        .add(
            CollectiveKind::AllGather,
            z.c * psi / z.p as u64,
            &og.minus(pg),
            1.0,
            &[],
        )?
        .seconds;
    // the expert weights' slices: the same three over the groups without E
    let (mut rs_cross, mut ar_cross, mut ag_regather) = (rs_cross, ar_cross, ag_regather);
    if let Some(x) = &z.ex {
        let local = x.psi / x.n;
        rs_cross += t
            .add(
                CollectiveKind::ReduceScatter,
                r * local / x.g,
                &x.o_minus_g,
                1.0,
                &[],
            )?
            .seconds;
        if x.r > 1 {
            ar_cross += t
                .add(
                    CollectiveKind::AllReduce,
                    r * local / x.o,
                    &x.replicas,
                    1.0,
                    &[],
                )?
                .seconds;
        }
        ag_regather += t
            .add(
                CollectiveKind::AllGather,
                z.c * local / x.p,
                &x.o_minus_p,
                1.0,
                &[],
            )?
            .seconds;
    }
    Ok(StepComms {
        rs_cross,
        narrow_cross,
        ar_cross,
        ag_regather,
    })
}

/// The per-layer tasks of a step (forward with its gather, the rest of the forward and
/// backward, backward with its re-gather, recompute and reduction), for [`simulate`].
fn step_tasks(
    ctx: &Ctx,
    z: &Sizes,
    (ag, rs, a2a): (&[Comm], &[Comm], &[f64]),
    narrow_cross: &[f64],
) -> Vec<Task> {
    let (opts, prof) = (ctx.opts, ctx.prof);
    let m = z.m;
    let regather = z.p > 1 && opts.schedule.reshard_after_forward;
    let mut tasks = Vec::with_capacity(m * (2 * prof.layers + 2));
    for k in 0..m {
        for (l, (&f, a)) in prof.fwd_s.iter().zip(ag).enumerate() {
            tasks.push(Task {
                // the tokens' exchanges with their experts lie on the compute's path
                compute: f + a2a[l],
                gather: if z.p > 1 { a.seconds } else { 0.0 },
                reduce: 0.0,
            });
        }
        tasks.push(Task {
            compute: prof.other_fwd_s + prof.other_bwd_s,
            gather: 0.0,
            reduce: 0.0,
        });
        let reduce_now = z.g > 1 && (z.sharded_grads || k + 1 == m);
        for l in (0..prof.layers).rev() {
            let (gather, reduce) = match (regather, reduce_now) {
                (true, true) => {
                    // Fair sharing: while both run each gets half the shared links; the
                    // shorter one's bandwidth term delays both.
                    let extra =
                        (ag[l].shared_s - ag[l].seconds).min(rs[l].shared_s - rs[l].seconds);
                    (ag[l].seconds + extra, rs[l].seconds + extra)
                }
                (true, false) => (ag[l].seconds, 0.0),
                (false, true) => (0.0, rs[l].seconds),
                (false, false) => (0.0, 0.0),
            };
            let reduce = if k + 1 == m {
                reduce + narrow_cross[l]
            } else {
                reduce
            };
            tasks.push(Task {
                compute: prof.bwd_s[l]
                    + a2a[l]
                    + if opts.schedule.recompute {
                        prof.fwd_s[l] + a2a[l]
                    } else {
                        0.0
                    },
                gather,
                reduce,
            });
        }
    }
    tasks
}

/// The optimizer's time (memory-bound AdamW over the O-shard, plus Muon's Newton-Schulz on
/// every whole matrix on every member of O) and the step's compute time.
fn compute_times(ctx: &Ctx, z: &Sizes) -> (f64, f64) {
    let (opts, prof) = (ctx.opts, ctx.prof);
    let d = &ctx.model.spec().device;
    let optimized = z.psi / z.o as u64 + z.ex.as_ref().map_or(0, |x| x.psi / x.n / x.o);
    let mut opt_s =
        ((24 + z.r + z.c) * optimized) as f64 / (d.memory_bandwidth * d.memory_efficiency);
    // Muon: every member of O runs Newton-Schulz on every whole matrix (f32 products), or
    // with Canzona on its slots only
    let muon_flops: u64 = match canzona_partition(opts, z.o) {
        Some(part) => part.executed_flops(),
        None => opts.muon.iter().map(|m| m.ns_flops(5)).sum(),
    };
    if muon_flops > 0 {
        opt_s += muon_flops as f64 / (d.peak_flops_fp32 * d.matmul_efficiency);
    }
    let fwd_total: f64 = prof.fwd_s.iter().sum::<f64>() + prof.other_fwd_s;
    let bwd_total: f64 = prof.bwd_s.iter().sum::<f64>() + prof.other_bwd_s;
    let rec_total: f64 = if opts.schedule.recompute {
        prof.fwd_s.iter().sum()
    } else {
        0.0
    };
    (
        opt_s,
        z.m as f64 * (fwd_total + bwd_total + rec_total) + opt_s,
    )
}

/// One candidate (P, G, O; with `narrow`, the layers whose gradients accumulate in N):
/// memory per rank, traffic per link class, and the step simulated on the cost model.
fn evaluate(
    ctx: &Ctx,
    cache: &mut CostCache,
    pg: &Group,
    gg: &Group,
    og: &Group,
    narrow: Option<(&Group, &[bool])>,
) -> Result<Candidate, ShardPlanError> {
    let (opts, prof) = (ctx.opts, ctx.prof);
    let z = Sizes::new(ctx, (pg, gg, og), narrow);
    let memory = candidate_memory(ctx, &z);
    let mut t = Tally {
        ctx,
        cache,
        links: BTreeMap::new(),
        comm_s: 0.0,
    };
    let (ag, rs, row_exchanged) = layer_collectives(&mut t, &z, (pg, gg))?;
    let cross = step_collectives(&mut t, &z, (pg, gg, og))?;
    let (opt_s, compute_s) = compute_times(ctx, &z);
    // the AllToAll of each routed layer's forward (its backward repeats them)
    let mut a2a = vec![0.0; prof.layers];
    if let Some(x) = &z.ex {
        for (l, &b) in x.a2a_bytes.iter().enumerate() {
            if b > 0 && x.n > 1 {
                // to the experts and back, in the forward, the backward and a recompute
                let calls = if opts.schedule.recompute { 3.0 } else { 2.0 } * z.m as f64;
                let one = t.add(CollectiveKind::AllToAll, b / 2, &x.group, 2.0 * calls, &[])?;
                a2a[l] = 2.0 * one.seconds;
            }
        }
    }
    let tasks = step_tasks(ctx, &z, (&ag, &rs, &a2a), &cross.narrow_cross);
    // Muon: the Nesterov updates (f32) are all-gathered over O before Newton-Schulz, or
    // with Canzona sent to their owners and the results back: two all-to-alls of every
    // bucket's slots of flat shards
    let ag_muon = if let Some(part) = canzona_partition(opts, z.o) {
        let o = z.o;
        let bytes: u64 = part
            .buckets
            .iter()
            .map(|b| 4 * (b.slots * o * (b.rows * b.cols).div_ceil(o)) as u64)
            .sum();
        2.0 * t
            .add(CollectiveKind::AllToAll, bytes, og, 1.0, &[])?
            .seconds
    } else if z.o > 1 && z.muon_numel > 0 {
        t.add(CollectiveKind::AllGather, 4 * z.muon_numel, og, 1.0, &[])?
            .seconds
    } else {
        0.0
    };
    let step_s = simulate(&tasks, opts.schedule.prefetch_depth)
        + cross.rs_cross
        + cross.ar_cross
        + opt_s
        + cross.ag_regather
        + ag_muon;
    let Tally { links, comm_s, .. } = t;
    let exposed_comm_s = (step_s - compute_s).max(0.0);
    let cross_node_bytes = links
        .iter()
        .filter(|(l, _)| ctx.cross_links.contains(l))
        .map(|(_, b)| *b)
        .sum();
    let names: Vec<&str> = ctx
        .baselines
        .iter()
        .filter(|(_, sg)| sg.params == *pg && sg.grads == *gg && sg.optim == *og)
        .map(|(s, _)| s.name())
        .collect();
    let in_narrow = &z.in_narrow;
    Ok(Candidate {
        params: pg.clone(),
        grads: gg.clone(),
        optim: og.clone(),
        p: z.p,
        g: z.g,
        o: z.o,
        baseline: (!names.is_empty()).then(|| names.join("/")),
        fits: memory.total <= ctx.budget,
        memory,
        compute_s,
        comm_s,
        exposed_comm_s,
        step_s,
        estimate_s: step_s,
        simulated: false,
        bytes_per_link: links,
        cross_node_bytes,
        row_exchanged,
        narrow: (z.narrow_pad > 0).then(|| NarrowChoice {
            group: z.ng.clone(),
            layers: in_narrow.iter().filter(|&&f| f).count(),
            params: prof
                .param_names
                .iter()
                .zip(&prof.param_layer)
                .filter(|(_, &l)| in_narrow[l])
                .map(|(n, _)| n.clone())
                .collect(),
        }),
    })
}

/// What expert parallelism splits, for the estimate: the group, which parameters are
/// expert weights (by profile index), and each layer's AllToAll bytes per micro-batch in the
/// compute dtype (the forward's exchanges; the backward repeats them).
struct ExpertInfo {
    group: Group,
    n: usize,
    is_expert: Vec<bool>,
    a2a_bytes: Vec<u64>,
}

impl ExpertInfo {
    fn new(
        fwd: &Program,
        mesh: &Mesh,
        opts: &ShardOptions,
        prof: &Profile,
    ) -> Result<Option<ExpertInfo>, ShardPlanError> {
        let Some(group) = &opts.schedule.expert_parallel else {
            return Ok(None);
        };
        let (split_fwd, split) = crate::dist::expert::expert_parallel_forward(fwd, mesh, group)
            .map_err(ShardPlanError::Options)?;
        let is_expert = prof
            .param_names
            .iter()
            .map(|n| split.params.contains_key(n))
            .collect();
        // each exchange's layer: that of the expert weights its region reads (the layer
        // grouping of the split forward, by its parameters)
        let grouping = crate::report::layer_of_params(&split_fwd);
        let mut a2a_bytes = vec![0u64; prof.layers];
        let users = split_fwd.users();
        let layer_of_param: HashMap<ValueId, usize> = split_fwd
            .params
            .iter()
            .zip(&grouping.of_param)
            .map(|(q, &l)| (q.value, l))
            .collect();
        for (i, n) in split_fwd.nodes.iter().enumerate() {
            if !matches!(n.op, Op::AllToAll { .. }) {
                continue;
            }
            let bytes = (split_fwd.ty(n.outputs[0]).numel() * opts.compute.size_bytes()) as u64;
            let layer = grouping.of_node[i]
                .or_else(|| {
                    // the first expert weight read downstream
                    users[n.outputs[0].index()].iter().find_map(|u| {
                        split_fwd.nodes[u.index()]
                            .inputs
                            .iter()
                            .find_map(|v| layer_of_param.get(v).copied())
                    })
                })
                .unwrap_or(0)
                .min(prof.layers.saturating_sub(1));
            if let Some(b) = a2a_bytes.get_mut(layer) {
                *b += bytes;
            }
        }
        Ok(Some(ExpertInfo {
            n: split.size,
            group: split.group,
            is_expert,
            a2a_bytes,
        }))
    }
}

// ---------------------------------------------------------------------------------------------
// The planner

fn candidate_triples(
    mesh: &Mesh,
    cluster: &ClusterSpec,
    opts: &ShardOptions,
) -> Result<Vec<(Group, Group, Group)>, ShardPlanError> {
    let ov = &opts.overrides;
    let mut out: Vec<(Group, Group, Group)> = Vec::new();
    match opts.strategy.groups(mesh, cluster) {
        Some(sg) => {
            let pick = |o: &Option<Group>, d: Group| o.clone().unwrap_or(d);
            let t = (
                pick(&ov.params, sg.params),
                pick(&ov.grads, sg.grads),
                pick(&ov.optim, sg.optim),
            );
            if !t.0.is_subset_of(&t.1) || !t.1.is_subset_of(&t.2) {
                return Err(ShardPlanError::Override(format!(
                    "--shard {ov} with strategy {} gives {} {} {}, which do not nest \
                     (params ⊆ grads ⊆ optim); name the other groups too",
                    opts.strategy, t.0, t.1, t.2
                )));
            }
            out.push(t);
        }
        None => {
            let nested = nested_groups(mesh);
            let choices = |o: &Option<Group>| -> Vec<Group> {
                match o {
                    Some(g) => vec![g.clone()],
                    None => nested.clone(),
                }
            };
            for pg in choices(&ov.params) {
                for gg in choices(&ov.grads) {
                    if !pg.is_subset_of(&gg) {
                        continue;
                    }
                    for og in choices(&ov.optim) {
                        if gg.is_subset_of(&og) {
                            out.push((pg.clone(), gg.clone(), og));
                        }
                    }
                }
            }
            if out.is_empty() {
                return Err(ShardPlanError::Override(format!(
                    "--shard {ov} leaves no nested candidate (params ⊆ grads ⊆ optim) on the \
                     mesh {mesh}"
                )));
            }
        }
    }
    Ok(out)
}

/// Step times within this fraction of the fastest count as equally fast when choosing.
pub const SAME_SPEED: f64 = 0.01;

fn better(a: &Candidate, b: &Candidate) -> bool {
    let scale = a.step_s.abs().max(b.step_s.abs()).max(1e-30);
    if (a.step_s - b.step_s).abs() > 1e-9 * scale {
        return a.step_s < b.step_s;
    }
    if a.memory.total != b.memory.total {
        return a.memory.total < b.memory.total;
    }
    a.cross_node_bytes < b.cross_node_bytes
}

/// Plans the shard groups of `fwd` (a forward program at per-rank micro-batch shapes) on
/// `mesh` of `cluster`. See the module docs for the model.
/// The options' own checks: micro-batches, float dtypes, `--shard` groups on the mesh's
/// axes.
fn check_options(mesh: &Mesh, opts: &ShardOptions) -> Result<(), ShardPlanError> {
    if opts.micro_batches == 0 {
        return Err(ShardPlanError::Options(
            "micro-batches per step must be at least 1".into(),
        ));
    }
    for (what, d) in [
        ("compute", opts.compute),
        ("gradient", opts.schedule.grad_dtype),
    ] {
        if !d.is_float() {
            return Err(ShardPlanError::Options(format!(
                "the {what} dtype must be f32, bf16 or f16, not {}",
                d.name()
            )));
        }
    }
    for (what, g) in [
        ("params", &opts.overrides.params),
        ("grads", &opts.overrides.grads),
        ("optim", &opts.overrides.optim),
    ] {
        if let Some(g) = g {
            if let Some(a) = g.axes.iter().find(|a| mesh.axis(a).is_none()) {
                return Err(ShardPlanError::Override(format!(
                    "--shard {what}={}: `{a}` is not an axis of the mesh {mesh}",
                    g.axes.join(".")
                )));
            }
        }
    }
    Ok(())
}

/// Mixed candidates: a plan that fits with G reaching across nodes keeps layers' gradients
/// accumulating inside the node (G ∩ node-local): those cross the node boundary once per
/// step instead of once per micro-batch. As many layers as the memory left allows (taken in
/// layer order), and, since the narrow layers' reductions across nodes come at the end of
/// the step where the last layers' backward cannot hide them, also each eighth of those, the
/// layers whose backward comes first (the last layers) first, unless every layer narrow is
/// as fast (within [`SAME_SPEED`]).
/// The mixed candidates that fit.
fn mixed_candidates(
    ctx: &Ctx,
    cache: &mut CostCache,
    candidates: &[Candidate],
    node_local: &Group,
) -> Result<Vec<Candidate>, ShardPlanError> {
    let (mesh, opts, prof, budget) = (ctx.mesh, ctx.opts, ctx.prof, ctx.budget);
    let r = opts.schedule.grad_dtype.size_bytes() as u64;
    let mut out = Vec::new();
    for c in candidates {
        let ng = Group {
            axes: c
                .grads
                .axes
                .iter()
                .filter(|a| node_local.axes.contains(a))
                .cloned()
                .collect(),
        };
        let n = mesh.size_of(&ng);
        if !c.fits || n >= c.g || !c.params.is_subset_of(&ng) {
            continue;
        }
        let (layer_pad, _) = layer_pad(prof, c.o as u64, ctx.experts);
        let mut slack = budget.saturating_sub(c.memory.total);
        let mut flags = vec![false; prof.layers];
        for (l, &pad) in layer_pad.iter().enumerate() {
            let extra = r * pad / n as u64 - r * pad / c.g as u64;
            if extra <= slack {
                slack -= extra;
                flags[l] = true;
            }
        }
        let fit: Vec<usize> = (0..prof.layers).rev().filter(|&l| flags[l]).collect();
        let mut sets: Vec<Vec<bool>> = vec![flags];
        // every layer narrow as fast as none: that candidate already sends the fewest bytes
        let all_narrow_as_fast = candidates.iter().any(|a| {
            a.fits
                && a.narrow.is_none()
                && (&a.params, &a.grads, &a.optim) == (&c.params, &ng, &c.optim)
                && a.step_s <= c.step_s * (1.0 + SAME_SPEED)
        });
        for q in (1..8).filter(|_| !all_narrow_as_fast) {
            let k = (fit.len() * q).div_ceil(8);
            let mut part = vec![false; prof.layers];
            for &l in &fit[..k] {
                part[l] = true;
            }
            sets.push(part);
        }
        let (pg, gg, og) = (c.params.clone(), c.grads.clone(), c.optim.clone());
        let mut seen = std::collections::HashSet::new();
        for set in sets {
            // none: nothing to mix; all: that is the candidate with G = the narrow group
            if !set.iter().any(|&f| f) || set.iter().all(|&f| f) || !seen.insert(set.clone()) {
                continue;
            }
            let mixed = evaluate(ctx, cache, &pg, &gg, &og, Some((&ng, &set)))?;
            if mixed.fits {
                out.push(mixed);
            }
        }
    }
    Ok(out)
}

/// The fastest candidate that fits; among those predicted within SAME_SPEED of it, the one
/// that sends the fewest bytes across nodes (the model cannot tell such step times apart,
/// and cross-node links are the ones other jobs and congestion slow down), then the one
/// that needs the least memory (headroom for a larger batch), then the fastest. `None`
/// when nothing fits.
fn choose(candidates: &[Candidate]) -> Option<&Candidate> {
    let mut fastest: Option<&Candidate> = None;
    for c in candidates.iter().filter(|c| c.fits) {
        if fastest.is_none_or(|b| better(c, b)) {
            fastest = Some(c);
        }
    }
    let mut chosen = fastest;
    if let Some(f) = fastest {
        for c in candidates.iter().filter(|c| c.fits) {
            if c.step_s <= f.step_s * (1.0 + SAME_SPEED)
                && chosen.is_some_and(|b| {
                    let same_cross = c.cross_node_bytes <= b.cross_node_bytes * (1.0 + 1e-9);
                    c.cross_node_bytes < b.cross_node_bytes * (1.0 - 1e-9)
                        || (same_cross && c.memory.total < b.memory.total)
                        || (same_cross && c.memory.total == b.memory.total && better(c, b))
                })
            {
                chosen = Some(c);
            }
        }
    }
    chosen
}

pub fn plan_sharding(
    fwd: &Program,
    mesh: &Mesh,
    cluster: &ClusterSpec,
    opts: &ShardOptions,
) -> Result<PlanReport, ShardPlanError> {
    check_options(mesh, opts)?;
    let model = CostModel::new(cluster.clone(), mesh.clone())?;
    let budget = opts.memory_budget.unwrap_or(cluster.device.memory_bytes);
    let node_local = node_local_group(mesh, cluster);
    let mut cross_links: Vec<String> = Vec::new();
    for a in &mesh.axes {
        if a.size > 1 && !node_local.axes.contains(&a.name) {
            let l = cluster.link_for_axis(&a.name)?;
            if !cross_links.contains(&l.name) {
                cross_links.push(l.name.clone());
            }
        }
    }
    // (ACCO has ZeRO-1's groups; its schedule is not a layout of its own)
    let baselines: Vec<(Strategy, ShardGroups)> = Strategy::ALL
        .iter()
        .filter(|s| **s != Strategy::Acco)
        .filter_map(|s| s.groups(mesh, cluster).map(|g| (*s, g)))
        .collect();
    let mut triples = candidate_triples(mesh, cluster, opts)?;
    if opts.muon_canzona && !opts.muon.is_empty() {
        triples.retain(|(_, _, og)| mesh.size_of(og) > 1);
        if triples.is_empty() {
            return Err(ShardPlanError::Options(format!(
                "--muon-placement canzona gives each Muon matrix one owner among the optimizer \
                 group's ranks, but strategy {} on mesh {mesh} has no candidate whose optimizer \
                 group has several ranks; use asynchzp or zero1/2/3 on several ranks, or \
                 --muon-placement replicated",
                opts.strategy.name()
            )));
        }
    }
    let prof = profile(fwd, cluster, opts)?;
    let experts = ExpertInfo::new(fwd, mesh, opts, &prof)?;
    let ctx = Ctx {
        mesh,
        model: &model,
        opts,
        prof: &prof,
        experts: experts.as_ref(),
        budget,
        cross_links: &cross_links,
        baselines: &baselines,
    };
    let mut cache = CostCache::new();
    let mut candidates = Vec::with_capacity(triples.len());
    for (pg, gg, og) in &triples {
        candidates.push(evaluate(&ctx, &mut cache, pg, gg, og, None)?);
    }
    if opts.strategy == Strategy::AsyncHzp
        && opts.overrides.grads.is_none()
        && opts.schedule.reduce_grads == ReduceGrads::PerMicrobatch
        && opts.micro_batches > 1
    {
        let mixed = mixed_candidates(&ctx, &mut cache, &candidates, &node_local)?;
        candidates.extend(mixed);
    }
    let chosen = choose(&candidates);
    let Some(chosen) = chosen.cloned() else {
        let smallest = candidates
            .iter()
            .min_by(|a, b| {
                a.memory
                    .total
                    .cmp(&b.memory.total)
                    .then(a.step_s.total_cmp(&b.step_s))
            })
            .cloned()
            .expect("at least one candidate");
        return Err(ShardPlanError::DoesNotFit {
            model: fwd.name.clone(),
            strategy: opts.strategy,
            budget,
            weighed: candidates.len(),
            hint: no_fit_hint(opts, &smallest),
            candidate: Box::new(smallest),
        });
    };
    Ok(PlanReport {
        model: fwd.name.clone(),
        cluster: cluster.name.clone(),
        mesh: mesh.to_string(),
        world_size: mesh.world_size(),
        strategy: opts.strategy,
        overrides: opts.overrides.clone(),
        budget_bytes: budget,
        micro_batches: opts.micro_batches,
        compute_dtype: opts.compute.name().to_string(),
        grad_dtype: opts.schedule.grad_dtype.name().to_string(),
        reduce_grads: opts.schedule.reduce_grads,
        prefetch_depth: opts.schedule.prefetch_depth,
        reshard_after_forward: opts.schedule.reshard_after_forward,
        recompute: opts.schedule.recompute,
        parameters: fwd.num_parameters(),
        layers: prof.layers,
        activation_bytes: prof.act_bytes,
        activation_bytes_recompute: prof.act_recompute_bytes,
        node_local,
        cross_node_links: cross_links,
        notes: prof.notes.clone(),
        chosen,
        candidates,
    })
}

/// What simulating one candidate's built plan gave: step, compute-stream busy time, busy
/// time of the communication streams, exposed communication (seconds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimulatedStep {
    pub step_s: f64,
    pub compute_s: f64,
    pub comm_s: f64,
    pub exposed_comm_s: f64,
}

/// The candidates worth building and simulating: the `k` fastest that fit by the analytical
/// estimate, every fitting candidate with a baseline's groups (so that the choice is never
/// slower in the simulator than a baseline that fits), and the planner's own choice. Indices
/// into `r.candidates`, ascending. Empty when nothing fits.
pub fn shortlist(r: &PlanReport, k: usize) -> Vec<usize> {
    let cs = &r.candidates;
    let mut fitting: Vec<usize> = (0..cs.len()).filter(|&i| cs[i].fits).collect();
    fitting.sort_by(|&a, &b| {
        cs[a]
            .estimate_s
            .total_cmp(&cs[b].estimate_s)
            .then(a.cmp(&b))
    });
    let mut pick: Vec<usize> = fitting.iter().take(k).copied().collect();
    pick.extend(fitting.iter().filter(|&&i| cs[i].baseline.is_some()));
    pick.extend(cs.iter().position(|c| *c == r.chosen));
    pick.sort_unstable();
    pick.dedup();
    pick
}

/// Re-ranks the candidates at `sims` (index into `r.candidates`, simulated step; `usable`:
/// its built plan fits the budget) by the simulator: their `step_s`, `compute_s`, `comm_s`
/// and `exposed_comm_s` become the simulator's, and the chosen candidate becomes the fastest
/// usable one in the simulator (ties within 1e-9 relative: less memory, then fewer
/// cross-node bytes, then the earlier candidate). With no usable candidate, the fastest simulated one
/// is chosen. Returns the chosen index.
pub fn rerank_simulated(
    r: &mut PlanReport,
    sims: &[(usize, SimulatedStep, bool)],
) -> Option<usize> {
    for (i, s, _) in sims {
        let c = &mut r.candidates[*i];
        c.step_s = s.step_s;
        c.compute_s = s.compute_s;
        c.comm_s = s.comm_s;
        c.exposed_comm_s = s.exposed_comm_s;
        c.simulated = true;
    }
    let any_usable = sims.iter().any(|s| s.2);
    let mut best: Option<usize> = None;
    for (i, _, usable) in sims {
        if any_usable && !usable {
            continue;
        }
        let c = &r.candidates[*i];
        if best.is_none_or(|b| better(c, &r.candidates[b])) {
            best = Some(*i);
        }
    }
    if let Some(b) = best {
        r.chosen = r.candidates[b].clone();
    }
    best
}

// ---------------------------------------------------------------------------------------------
// Explanation

/// `1.234 s`, `12.35 ms`, `3.4 us`.
pub fn human_seconds(s: f64) -> String {
    if s == 0.0 {
        "0".to_string()
    } else if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} us", s * 1e6)
    }
}

fn hb(x: f64) -> String {
    human_bytes(x.max(0.0).round() as u64)
}

fn table(out: &mut String, rows: &[Vec<String>]) {
    let ncol = rows.iter().map(Vec::len).max().unwrap_or(0);
    let width: Vec<usize> = (0..ncol)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            let pad = width[c] - cell.chars().count();
            if c < 4 {
                line.push_str(cell);
                line.push_str(&" ".repeat(pad));
            } else {
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            }
            line.push_str("  ");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

/// A readable account of a [`PlanReport`]: the settings, a table of every candidate weighed
/// (groups, memory by kind, fits, compute, communication, exposed communication, predicted
/// step time, cross-node bytes per step) and why the chosen one won.
pub fn explain(r: &PlanReport) -> String {
    let mut s = String::new();
    explain_header(&mut s, r);
    s.push('\n');
    explain_table(&mut s, r);
    explain_choice(&mut s, r);
    explain_limits(&mut s, r);
    s.push('\n');
    s
}

/// The report's first lines: model, cluster, mesh, strategy, schedule, sizes, notes.
fn explain_header(s: &mut String, r: &PlanReport) {
    let _ = writeln!(
        s,
        "sharding plan for `{}` on {} (mesh {}, {} ranks), strategy {}{}",
        r.model,
        r.cluster,
        r.mesh,
        r.world_size,
        r.strategy,
        if r.overrides.is_empty() {
            String::new()
        } else {
            format!(", --shard {}", r.overrides)
        }
    );
    let _ = writeln!(
        s,
        "budget {} per rank; {} micro-batch{} per step, {} compute, {} gradients reduced per {}, \
         prefetch depth {}, {}, {}",
        human_bytes(r.budget_bytes),
        r.micro_batches,
        if r.micro_batches == 1 { "" } else { "es" },
        r.compute_dtype,
        r.grad_dtype,
        if r.reduce_grads == ReduceGrads::PerStep {
            "step"
        } else {
            "micro-batch"
        },
        r.prefetch_depth,
        if r.reshard_after_forward {
            "reshard after forward"
        } else {
            "keep gathered parameters until backward"
        },
        if r.recompute {
            "recompute activations"
        } else {
            "no recompute"
        }
    );
    let _ = writeln!(
        s,
        "{} parameters in {} layers; activations per micro-batch {} ({} with recompute); \
         node-local axes {}, cross-node links: {}",
        human_count(r.parameters),
        r.layers,
        human_bytes(r.activation_bytes),
        human_bytes(r.activation_bytes_recompute),
        r.node_local,
        if r.cross_node_links.is_empty() {
            "none".to_string()
        } else {
            r.cross_node_links.join(", ")
        }
    );
    for n in &r.notes {
        let _ = writeln!(s, "note: {n}");
    }
}

/// The table of candidates: groups, memory by kind, times, cross-node bytes.
fn explain_table(s: &mut String, r: &PlanReport) {
    let mut rows = vec![[
        "",
        "P",
        "G",
        "O",
        "params",
        "master",
        "grads",
        "states",
        "acts",
        "buffers",
        "total",
        "fits",
        "compute",
        "comm",
        "exposed",
        "step",
        "estimate",
        "cross-node",
    ]
    .map(String::from)
    .to_vec()];
    for c in &r.candidates {
        let mark = if *c == r.chosen { "*" } else { "" };
        let m = &c.memory;
        let mut p = c.params.to_string();
        if let Some(b) = &c.baseline {
            p = format!("{p} ({b})");
        }
        rows.push(vec![
            mark.to_string(),
            p,
            c.grads_label(),
            c.optim.to_string(),
            human_bytes(m.params),
            human_bytes(m.master),
            human_bytes(m.grads),
            human_bytes(m.optim_states),
            human_bytes(m.activations),
            human_bytes(m.buffers),
            human_bytes(m.total),
            if c.fits { "yes" } else { "no" }.to_string(),
            human_seconds(c.compute_s),
            human_seconds(c.comm_s),
            human_seconds(c.exposed_comm_s),
            if c.simulated {
                format!("{} sim", human_seconds(c.step_s))
            } else {
                human_seconds(c.step_s)
            },
            human_seconds(c.estimate_s),
            hb(c.cross_node_bytes),
        ]);
    }
    table(s, &rows);
    let simulated = r.candidates.iter().filter(|c| c.simulated).count();
    if simulated > 0 {
        let _ = writeln!(
            s,
            "\n`sim`: the {simulated} candidate{} built and simulated (the fastest that fit by the \
             estimate, and those with a baseline's groups): their compute, comm, exposed and \
             step are the simulator's for the built plan, the one `hzp simulate` predicts; the \
             others show the planner's estimate.",
            if simulated == 1 { "" } else { "s" }
        );
    }
    s.push('\n');
}

/// Why the chosen candidate: its prediction, how it compares with the fastest that fits,
/// the next fastest and ZeRO-3, and its row-exchanged gradients.
fn explain_choice(s: &mut String, r: &PlanReport) {
    let c = &r.chosen;
    // with a simulated choice, it is compared with the other simulated candidates only
    let fitting: Vec<&Candidate> = r
        .candidates
        .iter()
        .filter(|x| x.fits && x.simulated == c.simulated)
        .collect();
    let _ = write!(
        s,
        "Chosen: {} (p={}, g={}, o={}{}). Predicted step {}: compute {} plus {} of exposed \
         communication (of {} in all); {} per rank of the {} budget; {} per rank per step across \
         nodes.",
        c.label(),
        c.p,
        c.g,
        c.o,
        c.baseline
            .as_ref()
            .map(|b| format!(", = {b}"))
            .unwrap_or_default(),
        human_seconds(c.step_s),
        human_seconds(c.compute_s),
        human_seconds(c.exposed_comm_s),
        human_seconds(c.comm_s),
        human_bytes(c.memory.total),
        human_bytes(r.budget_bytes),
        hb(c.cross_node_bytes)
    );
    if r.candidates.len() == 1 {
        let _ = write!(s, " It is the only candidate of strategy {}.", r.strategy);
    } else {
        if fitting.len() == 1 {
            let _ = write!(
                s,
                " It is the only candidate that fits (of {} weighed).",
                r.candidates.len()
            );
        } else {
            let fastest = fitting
                .iter()
                .min_by(|a, b| a.step_s.total_cmp(&b.step_s))
                .copied()
                .unwrap_or(c);
            let same_cross =
                (fastest.cross_node_bytes - c.cross_node_bytes).abs() <= 1e-9 * c.cross_node_bytes;
            if fastest.step_s < c.step_s && same_cross {
                let _ = write!(
                    s,
                    " The fastest that fits, {}, is predicted {:.2}% faster ({}), within {}% \
                     (closer than the model can tell apart) and sending as many bytes across \
                     nodes, so the plan that needs the least memory among those is chosen: {} \
                     instead of {} per rank.",
                    fastest.label(),
                    (1.0 - fastest.step_s / c.step_s) * 100.0,
                    human_seconds(fastest.step_s),
                    SAME_SPEED * 100.0,
                    human_bytes(c.memory.total),
                    human_bytes(fastest.memory.total)
                );
            } else if fastest.step_s < c.step_s {
                let _ = write!(
                    s,
                    " The fastest that fits, {}, is predicted {:.2}% faster ({}), within {}% \
                     (closer than the model can tell apart), so the plan that sends the fewest \
                     bytes across nodes among those is chosen: {} instead of {} per step.",
                    fastest.label(),
                    (1.0 - fastest.step_s / c.step_s) * 100.0,
                    human_seconds(fastest.step_s),
                    SAME_SPEED * 100.0,
                    hb(c.cross_node_bytes),
                    hb(fastest.cross_node_bytes)
                );
            } else if c.simulated {
                let _ = write!(
                    s,
                    " It is the fastest in the simulator of the {} candidates that fit and were \
                     built and simulated (of {} weighed).",
                    fitting.len(),
                    r.candidates.len()
                );
            } else {
                let _ = write!(
                    s,
                    " It is the fastest of the {} candidates that fit (of {} weighed).",
                    fitting.len(),
                    r.candidates.len()
                );
            }
        }
        let runner = fitting
            .iter()
            .filter(|x| **x != c)
            .min_by(|a, b| a.step_s.total_cmp(&b.step_s));
        if let Some(n) = runner {
            let _ = write!(
                s,
                " The next fastest that fits, {}, takes {} ({:+.1}%).",
                n.label(),
                human_seconds(n.step_s),
                (n.step_s / c.step_s - 1.0) * 100.0
            );
        }
        if let Some(z) = r
            .candidates
            .iter()
            .find(|x| x.p == r.world_size && x.g == r.world_size && x.o == r.world_size)
            .filter(|z| *z != c)
        {
            let _ = write!(
                s,
                " ZeRO-3 ({}) would take {}{} and send {} across nodes per step.",
                z.label(),
                human_seconds(z.step_s),
                if z.fits { "" } else { " but does not fit" },
                hb(z.cross_node_bytes)
            );
        }
    }
    if !c.row_exchanged.is_empty() {
        let _ = write!(
            s,
            " Gradients exchanged as their looked-up rows and indices instead of reducing the \
             table (untied embeddings; --dense-embedding-grads turns it off): {}.",
            c.row_exchanged.join(", ")
        );
    }
}

/// What the budget ruled out: the fastest candidate that does not fit, and for P, G and O
/// the narrower groups none of which fits.
fn explain_limits(s: &mut String, r: &PlanReport) {
    let c = &r.chosen;
    // Faster candidates that do not fit, and narrower groups that do not fit.
    let mut told: Vec<&Candidate> = Vec::new();
    if let Some(f) = r
        .candidates
        .iter()
        .filter(|x| !x.fits && x.step_s < c.step_s)
        .min_by(|a, b| a.step_s.total_cmp(&b.step_s))
    {
        let _ = write!(
            s,
            " The fastest candidate, {}, would take {} but needs {} per rank: {}.",
            f.label(),
            human_seconds(f.step_s),
            human_bytes(f.memory.total),
            f.memory.describe()
        );
        told.push(f);
    }
    type Field = (&'static str, fn(&Candidate) -> (usize, &Group));
    let fields: [Field; 3] = [
        ("P", |x| (x.p, &x.params)),
        ("G", |x| (x.g, &x.grads)),
        ("O", |x| (x.o, &x.optim)),
    ];
    for (name, get) in fields {
        let (size, group) = get(c);
        let narrower: Vec<&Candidate> = r
            .candidates
            .iter()
            .filter(|x| {
                let (sz, gr) = get(x);
                sz < size && gr.is_subset_of(group)
            })
            .collect();
        if narrower.is_empty() || narrower.iter().any(|x| x.fits) {
            continue;
        }
        let smallest = narrower
            .iter()
            .min_by(|a, b| a.memory.total.cmp(&b.memory.total))
            .expect("non-empty");
        if told.contains(smallest) {
            let _ = write!(
                s,
                " No candidate with {name} narrower than {group} fits the budget."
            );
            continue;
        }
        let _ = write!(
            s,
            " No candidate with {name} narrower than {group} fits: the smallest of them, {}, \
             needs {} per rank ({}) against a budget of {}, which forced the wider {name}.",
            smallest.label(),
            human_bytes(smallest.memory.total),
            smallest.memory.describe(),
            human_bytes(r.budget_bytes)
        );
        told.push(smallest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulation_hides_gathers_behind_compute() {
        // Three layers, each gather shorter than the compute before it: only the first
        // gather is exposed.
        let t = |c: f64, g: f64| Task {
            compute: c,
            gather: g,
            reduce: 0.0,
        };
        let end = simulate(&[t(1.0, 0.5), t(1.0, 0.5), t(1.0, 0.5)], 1);
        assert!((end - 3.5).abs() < 1e-12, "{end}");
        // No prefetch window to speak of (depth 0): every gather waits for the previous
        // layer's compute to free its buffer.
        let end = simulate(&[t(1.0, 0.5), t(1.0, 0.5), t(1.0, 0.5)], 0);
        assert!((end - 4.5).abs() < 1e-12, "{end}");
        // Reduce-scatters after the last compute are exposed.
        let end = simulate(
            &[Task {
                compute: 1.0,
                gather: 0.0,
                reduce: 2.0,
            }],
            1,
        );
        assert!((end - 3.0).abs() < 1e-12, "{end}");
    }
}
