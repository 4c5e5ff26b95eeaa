//! The compile driver: a forward program in, a verified plan out.
//!
//! [`compile_plan`] is what `hzp compile` does after parsing its flags, available to library
//! users: choose the shard groups ([`crate::plan::planner`]), build the per-rank step with its
//! collectives, schedule and rewriting ([`crate::dist::spmd`], [`crate::dist::rewrite`]), plan memory
//! ([`crate::plan::memory`]), assemble the [`Plan`], verify it ([`crate::plan::verify`]) and hash it.
//! It owns the compile policy:
//! - the choice among the planner's candidates: the shortlist
//!   ([`planner::shortlist`], [`SIMULATED_CANDIDATES`] by estimate plus the baselines' groups)
//!   is built side by side and simulated, and the fastest simulated plan that fits wins
//!   ([`planner::rerank_simulated`]); its simulated step is the predicted step;
//! - [`Recompute::Auto`]: when no sharding fits the budget without activation recompute, plan
//!   again with it (and say so);
//! - [`Buckets::PerUnit`]: one bucket per gather or reduction unit, unless the planner's
//!   estimate or the built arena is over the budget, then buckets of at most
//!   [`FALLBACK_BUCKET_BYTES`] (and say so);
//! - the kind of every buffer in the memory report ([`buffer_kind`], from node roles).
//!
//! What a CLI prints along the way (notes, the planner's report, programs after stages,
//! phase timings) comes out through [`CompileEvent`]s; the driver prints nothing.

use crate::cost::cluster::ClusterSpec;
use crate::dist::rewrite::RewriteOptions;
use crate::dist::spmd::ReduceGrads;
use crate::dist::spmd::{self, NarrowGrads, Rewrite, ScheduleOptions};
use crate::plan::memory;
use crate::plan::planner::{self, PlanReport, ShardOptions, ShardOverride, Strategy};
use crate::plan::verify::{self, VerifyOptions};
use crate::train::{Optimizer, TrainConfig};
use hzp_ir::plan::{format_bytes, BufferKind, Plan, ShardGroups};
use hzp_ir::{DType, Mesh, Program, RoleKind, ValueDef, ValueId};
use std::collections::BTreeMap;

/// How many of the fastest candidates that fit (by the planner's analytical estimate) the
/// compile builds and simulates, besides those with a baseline's groups
/// ([`planner::shortlist`]).
pub const SIMULATED_CANDIDATES: usize = 3;

/// Buckets of at most this many bytes are the fallback when whole-unit buckets do not fit.
pub const FALLBACK_BUCKET_BYTES: u64 = 64 << 20;

/// The most gather units `prefetch_depth` may issue ahead of the one computing.
pub const MAX_PREFETCH_DEPTH: usize = 4096;

/// Activation recompute (checkpointing per layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recompute {
    On,
    Off,
    /// Only when no sharding fits the budget without it.
    Auto,
}

/// How collective rewriting buckets collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buckets {
    /// One bucket per gather or reduction unit (a layer's parameters or gradients, per
    /// micro-batch and phase), falling back to [`FALLBACK_BUCKET_BYTES`] over the budget.
    PerUnit,
    /// Buckets of at most this many bytes (0: no bucketing).
    AtMost(u64),
}

/// Everything [`compile_plan`] decides with. [`CompileOptions::new`] gives `hzp compile`'s
/// defaults for a mesh and cluster.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// The model's name as recorded in the plan (a path or `preset:...`).
    pub model: String,
    /// The model's parameter fingerprint ([`hzp_ir::plan::model_fingerprint`]), taken before
    /// any freezing or tying, which `hzp run` checks the model it loads against.
    pub fingerprint: String,
    pub mesh: Mesh,
    pub cluster: ClusterSpec,
    /// Bytes per rank; `None`: the cluster's device memory for planning, no arena check.
    pub budget: Option<u64>,
    /// The verifier also rejects an arena over `budget`.
    pub verify_budget: bool,
    pub strategy: Strategy,
    /// Shard groups given by the user; they win over the strategy.
    pub overrides: ShardOverride,
    /// Loss, optimizer, clipping, micro-batches and compute dtype.
    pub train: TrainConfig,
    /// The loss as the user wrote it, recorded in the plan.
    pub loss_spec: Option<String>,
    pub reduce_grads: ReduceGrads,
    pub prefetch_depth: usize,
    pub reshard_after_forward: bool,
    pub recompute: Recompute,
    /// Bound on gathered bytes in flight or in use at once.
    pub max_inflight_bytes: Option<u64>,
    /// Collective rewriting (bucketing, hierarchical decomposition, RS+AG=AR, casts).
    pub rewrite: bool,
    pub buckets: Buckets,
    /// Exchange an embedding's gradient as looked-up rows where that moves fewer bytes.
    pub sparse_grads: bool,
    /// Dtype gradients are reduced and accumulated in.
    pub grad_dtype: DType,
    /// Also produce the plan's JSON (hashing it in the same pass).
    pub want_json: bool,
    /// The sparse averaging of `--strategy asyncmesh` (required by it, refused by the
    /// others).
    pub asyncmesh: Option<crate::dist::asyncmesh::AsyncMeshOptions>,
    /// How the model was edited before compiling, recorded in the plan for `hzp run`.
    pub model_edits: Option<hzp_ir::plan::ModelEdits>,
    /// Expert parallelism: the mesh axes whose ranks split the experts of every routed MoE
    /// layer ([`crate::dist::expert`]); `None`: every rank holds every expert.
    pub expert_parallel: Option<hzp_ir::Group>,
    /// Choose `expert_parallel` by simulation ([`choose_expert_parallel`]): none, or any
    /// set of mesh axes whose ranks divide every routed layer's experts.
    pub choose_expert_parallel: bool,
    /// Report the chosen plan's pipeline stages ([`CompileEvent::Stage`]). The shortlisted
    /// candidates are built quietly side by side; with this set the chosen one is built once
    /// more to show its stages (`--print-after`).
    pub stage_events: bool,
}

impl CompileOptions {
    /// `hzp compile`'s defaults: asynchzp, AdamW, one micro-batch, f32, per-micro-batch
    /// reduction, prefetch depth 1, reshard after forward, recompute only if needed, one
    /// bucket per unit, row-exchanged embedding gradients, f32 gradients.
    pub fn new(model: impl Into<String>, mesh: Mesh, cluster: ClusterSpec) -> CompileOptions {
        CompileOptions {
            model: model.into(),
            fingerprint: String::new(),
            mesh,
            cluster,
            budget: None,
            verify_budget: true,
            strategy: Strategy::AsyncHzp,
            overrides: ShardOverride::default(),
            train: TrainConfig::default(),
            loss_spec: None,
            reduce_grads: ReduceGrads::PerMicrobatch,
            prefetch_depth: 1,
            reshard_after_forward: true,
            recompute: Recompute::Auto,
            max_inflight_bytes: None,
            rewrite: true,
            buckets: Buckets::PerUnit,
            sparse_grads: true,
            grad_dtype: DType::F32,
            want_json: false,
            asyncmesh: None,
            model_edits: None,
            expert_parallel: None,
            choose_expert_parallel: false,
            stage_events: false,
        }
    }
}

/// What happens during a compile, for a caller to print.
pub enum CompileEvent<'a> {
    /// A decision the user should know about (a policy fallback, a row-exchanged gradient).
    Note(String),
    /// The planner chose shard groups (the report `--explain` prints).
    Planned(&'a PlanReport),
    /// The per-rank step after a stage of [`spmd::shard_training_step_rewritten`]
    /// (`collectives`, `rewrite`, `schedule`).
    Stage(&'a str, &'a Program),
    /// Collective rewriting finished (its report, as text).
    Rewritten(&'a str),
    /// The plan is assembled (memory planned), not yet verified.
    Assembled(&'a Plan),
    /// A phase of the compile finished (for timing).
    Phase(&'static str),
}

/// A compiled and verified plan, with what the planner weighed.
pub struct Compiled {
    pub plan: Plan,
    /// The plan's JSON ([`Plan::to_json`]) when [`CompileOptions::want_json`].
    pub json: Option<String>,
    pub report: PlanReport,
    /// Bytes of each kind live at the memory peak.
    pub peak_by_kind: BTreeMap<BufferKind, u64>,
}

/// Why [`compile_plan`] gave no plan.
#[derive(Debug)]
pub enum CompileError {
    /// No sharding fits the budget: the planner's message and its smallest candidate.
    NoFit {
        message: String,
        need: u64,
        budget: u64,
        groups: ShardGroups,
    },
    /// Anything else, as a message in the user's terms.
    Other(String),
}

impl std::fmt::Display for CompileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CompileError::NoFit { message, .. } | CompileError::Other(message) => {
                f.write_str(message)
            }
        }
    }
}

impl std::error::Error for CompileError {}

impl From<String> for CompileError {
    fn from(m: String) -> CompileError {
        CompileError::Other(m)
    }
}

/// What each value of a per-rank step holds, for the memory report: by the value's
/// definition, else by the role of the node that computes it.
pub fn buffer_kind(p: &Program, v: ValueId) -> BufferKind {
    let val = p.value(v);
    match val.def {
        ValueDef::Param => BufferKind::Param,
        // the rank's parameter shards are states named `shard/<parameter>` by spmd
        ValueDef::State if val.name.starts_with("shard/") => BufferKind::Param,
        ValueDef::State => BufferKind::OptimState,
        ValueDef::Input => BufferKind::Input,
        ValueDef::Const => BufferKind::Other,
        ValueDef::Node { node, .. } => {
            let n = &p.nodes[node.index()];
            match n.role.kind {
                RoleKind::Reduce | RoleKind::Accumulate => BufferKind::Grad,
                // a finished gradient, named `grad/<parameter>` by the training step
                _ if val.name.starts_with("grad/") => BufferKind::Grad,
                RoleKind::Regather => BufferKind::Param,
                RoleKind::Gather => BufferKind::CommBuffer,
                _ if n.op.is_collective() => BufferKind::CommBuffer,
                RoleKind::Optimizer => BufferKind::OptimState,
                RoleKind::Compute | RoleKind::Recompute | RoleKind::Loss => BufferKind::Activation,
            }
        }
    }
}

type Events<'e> = dyn FnMut(CompileEvent<'_>) -> Result<(), String> + 'e;

/// Compiles `fwd` (a forward program, parameters frozen or tied as wanted) into a verified
/// plan. `on` sees every [`CompileEvent`]; an error it returns stops the compile.
///
/// The stages, in order: plan shard groups ([`plan_groups`], retrying with recompute under
/// [`Recompute::Auto`]); build the per-rank step and its memory plan ([`build_step`], with
/// the bucket size of [`first_bucket_bytes`] and the fallback when whole-unit buckets break
/// the budget); assemble the plan ([`assemble`]); verify and hash it ([`verify_and_hash`]).
pub fn compile_plan(
    fwd: &Program,
    opts: &CompileOptions,
    on: &mut Events<'_>,
) -> Result<Compiled, CompileError> {
    if opts.choose_expert_parallel {
        return compile_with_chosen_experts(fwd, opts, on);
    }
    opts.cluster
        .validate_mesh(&opts.mesh)
        .map_err(|e| CompileError::Other(e.to_string()))?;
    if opts.prefetch_depth > MAX_PREFETCH_DEPTH {
        return Err(format!(
            "a prefetch depth of {} is more than the limit of {MAX_PREFETCH_DEPTH} gather units ahead",
            opts.prefetch_depth
        )
        .into());
    }
    check_expert_parallel(opts)?;
    // asyncmesh: the step of one replica is planned and built on the mesh without the slow
    // axis; the sparse averaging across it is added after (see `dist::asyncmesh`)
    let replica_opts = replica_options(opts)?;
    let whole = opts;
    let opts = replica_opts.as_ref().unwrap_or(opts);
    let (mut report, shard_opts) = plan_groups(fwd, opts, on)?;
    on(CompileEvent::Phase("plan shard groups"))?;

    // The shortlist is built and simulated (side by side), and the simulator's fastest plan
    // that fits wins: the step compile predicts is the one `hzp simulate` gives its plan.
    let picks = planner::shortlist(&report, SIMULATED_CANDIDATES);
    let picks = if picks.is_empty() {
        vec![report
            .candidates
            .iter()
            .position(|c| *c == report.chosen)
            .unwrap_or(0)]
    } else {
        picks
    };
    let fit_budget = opts.budget.unwrap_or(opts.cluster.device.memory_bytes);
    let build_one = |c: &planner::Candidate,
                     on: &mut Events<'_>|
     -> Result<BuiltCandidate, CompileError> {
        let sched = ScheduleOptions {
            narrow_grads: c.narrow.as_ref().map(|n| NarrowGrads {
                group: n.group.clone(),
                params: n.params.iter().cloned().collect(),
            }),
            ..shard_opts.schedule.clone()
        };
        let mut notes = Vec::new();
        let (mut step, mut mem) = build_with_buckets(fwd, opts, whole, c, &sched, &mut notes, on)?;
        let plan = assemble(whole, shard_opts.strategy.name(), &mut step, &mut mem);
        let sim =
            crate::simulate::simulate(&plan, &whole.cluster, &Default::default()).map_err(|e| {
                CompileError::Other(format!("simulating the plan of {}: {e}", c.label()))
            })?;
        Ok(BuiltCandidate {
            step,
            mem,
            plan,
            notes,
            sim: planner::SimulatedStep {
                step_s: sim.step_s,
                compute_s: sim.stream_busy_s[0],
                comm_s: sim.stream_busy_s[1] + sim.stream_busy_s[2],
                exposed_comm_s: sim.exposed_comm_s,
            },
        })
    };
    let mut built: Vec<(usize, BuiltCandidate)> = if picks.len() == 1 {
        vec![(picks[0], build_one(&report.candidates[picks[0]], on)?)]
    } else {
        let results: Vec<Result<BuiltCandidate, CompileError>> = std::thread::scope(|sc| {
            let handles: Vec<_> = picks
                .iter()
                .map(|&i| {
                    let (build_one, c) = (&build_one, &report.candidates[i]);
                    sc.spawn(move || build_one(c, &mut |_| Ok(())))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(CompileError::Other(
                            "internal: building a candidate plan panicked".into(),
                        ))
                    })
                })
                .collect()
        });
        let mut v = Vec::with_capacity(picks.len());
        for (&i, r) in picks.iter().zip(results) {
            v.push((i, r?));
        }
        v
    };
    let sims: Vec<(usize, planner::SimulatedStep, bool)> = built
        .iter()
        .map(|(i, b)| (*i, b.sim, b.plan.arena_bytes <= fit_budget))
        .collect();
    let best = planner::rerank_simulated(&mut report, &sims).unwrap_or(picks[0]);
    on(CompileEvent::Planned(&report))?;
    let k = built.iter().position(|(i, _)| *i == best).unwrap_or(0);
    let (_, mut chosen) = built.swap_remove(k);
    drop(built);
    if picks.len() > 1 && opts.stage_events {
        // the stages of the chosen plan, for `--print-after` (the shortlist was built quietly)
        let c = report.candidates[best].clone();
        chosen = build_one(&c, on)?;
    }
    for n in &chosen.notes {
        on(CompileEvent::Note(n.clone()))?;
    }
    let BuiltCandidate {
        step,
        mut plan,
        mem,
        ..
    } = chosen;
    for (name, rows, table) in &step.row_exchanged {
        on(CompileEvent::Note(format!(
            "note: `{name}`'s gradient goes out as its looked-up rows and their indices ({} sent \
             per rank per micro-batch) instead of reducing the {} table \
             (--dense-embedding-grads reduces the table)",
            format_bytes(*rows),
            format_bytes(*table)
        )))?;
    }
    if let Some(r) = &step.rewrite_report {
        on(CompileEvent::Rewritten(r))?;
    }
    on(CompileEvent::Phase(
        "build, simulate and pick the per-rank step",
    ))?;
    on(CompileEvent::Assembled(&plan))?;
    let peak_by_kind = mem.peak_by_kind;
    let json = verify_and_hash(&mut plan, whole)?;
    on(CompileEvent::Phase("verify + hash + JSON"))?;
    Ok(Compiled {
        plan,
        json,
        report,
        peak_by_kind,
    })
}

/// Expert parallelism is built into the ZeRO step that ACCO and AsyncMesh do not use.
fn check_expert_parallel(opts: &CompileOptions) -> Result<(), CompileError> {
    match &opts.expert_parallel {
        Some(ep) if matches!(opts.strategy, Strategy::Acco | Strategy::AsyncMesh) => Err(format!(
            "--expert-parallel {ep} with --strategy {} is not built: expert parallelism \
                 is built into the ZeRO step of the other strategies",
            opts.strategy
        )
        .into()),
        _ => Ok(()),
    }
}

/// The expert-parallel axes worth trying for `fwd` on `mesh`: every set of mesh axes (in
/// mesh order) of more than one rank whose size divides the expert count of every routed
/// layer. Empty when the model has no routed layer.
pub fn expert_parallel_options(fwd: &Program, mesh: &Mesh) -> Vec<hzp_ir::Group> {
    let experts: Vec<usize> = fwd
        .nodes
        .iter()
        .filter_map(|n| match n.op {
            hzp_ir::Op::MoeDispatch { experts, .. } => Some(experts),
            _ => None,
        })
        .collect();
    if experts.is_empty() {
        return Vec::new();
    }
    let k = mesh.axes.len().min(16);
    (1u32..(1 << k))
        .map(|bits| {
            hzp_ir::Group::new(
                mesh.axes
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| bits & (1 << i) != 0)
                    .map(|(_, a)| a.name.clone()),
            )
        })
        .filter(|g| {
            let n = mesh.size_of(g);
            n > 1 && experts.iter().all(|e| e % n == 0)
        })
        .collect()
}

/// [`compile_plan`] with the expert parallelism [`choose_expert_parallel`] picks.
fn compile_with_chosen_experts(
    fwd: &Program,
    opts: &CompileOptions,
    on: &mut Events<'_>,
) -> Result<Compiled, CompileError> {
    let opts = CompileOptions {
        expert_parallel: choose_expert_parallel(fwd, opts, on)?,
        choose_expert_parallel: false,
        ..opts.clone()
    };
    compile_plan(fwd, &opts, on)
}

/// `--expert-parallel auto`: compiles the plan without expert parallelism and with each of
/// [`expert_parallel_options`], and keeps the fastest simulated step among those whose
/// arena fits the budget (the smallest arena when none fits). Says what it weighed in one
/// note.
fn choose_expert_parallel(
    fwd: &Program,
    opts: &CompileOptions,
    on: &mut Events<'_>,
) -> Result<Option<hzp_ir::Group>, CompileError> {
    let options = expert_parallel_options(fwd, &opts.mesh);
    if options.is_empty() {
        on(CompileEvent::Note(format!(
            "note: --expert-parallel auto: `{}` has no routed MoE layer whose experts the \
             mesh {} could split; every rank holds every expert",
            fwd.name, opts.mesh
        )))?;
        return Ok(None);
    }
    let budget = opts.budget.unwrap_or(opts.cluster.device.memory_bytes);
    // (choice, its simulated step and arena, or why it did not compile)
    type Tried = (Option<hzp_ir::Group>, Result<(f64, u64), String>);
    let mut tried: Vec<Tried> = Vec::new();
    for choice in std::iter::once(None).chain(options.into_iter().map(Some)) {
        let o = CompileOptions {
            expert_parallel: choice.clone(),
            choose_expert_parallel: false,
            want_json: false,
            stage_events: false,
            ..opts.clone()
        };
        let r = compile_plan(fwd, &o, &mut |_| Ok(())).map(|c| {
            let step = c.report.chosen.step_s;
            (step, c.plan.arena_bytes)
        });
        tried.push((choice, r.map_err(|e| e.to_string())));
    }
    let fits = |r: &(f64, u64)| r.1 <= budget;
    let best = tried
        .iter()
        .filter_map(|(c, r)| r.as_ref().ok().map(|r| (c, r)))
        .min_by(|(_, a), (_, b)| {
            fits(b).cmp(&fits(a)).then(if fits(a) {
                a.0.total_cmp(&b.0)
            } else {
                a.1.cmp(&b.1)
            })
        })
        .map(|(c, _)| c.clone());
    let Some(best) = best else {
        let why: Vec<String> = tried
            .iter()
            .map(|(c, r)| {
                format!(
                    "{}: {}",
                    expert_label(c),
                    r.as_ref().err().map_or("", |e| e)
                )
            })
            .collect();
        return Err(CompileError::Other(format!(
            "--expert-parallel auto: no choice compiles ({})",
            why.join("; ")
        )));
    };
    let mut lines = vec![format!(
        "note: --expert-parallel auto chose {} (fastest simulated step that fits {} per rank):",
        expert_label(&best),
        format_bytes(budget)
    )];
    for (c, r) in &tried {
        lines.push(match r {
            Ok((step, arena)) => format!(
                "  {:<22} step {:>9.3} s  arena {:>10}{}",
                expert_label(c),
                step,
                format_bytes(*arena),
                if *arena > budget {
                    "  (does not fit)"
                } else {
                    ""
                }
            ),
            Err(e) => format!("  {:<22} {e}", expert_label(c)),
        });
    }
    on(CompileEvent::Note(lines.join("\n")))?;
    Ok(best)
}

fn expert_label(c: &Option<hzp_ir::Group>) -> String {
    match c {
        Some(g) => format!("experts over {g}"),
        None => "no expert parallelism".to_string(),
    }
}

/// Under `--strategy asyncmesh`, the options of one replica's step: the mesh without the
/// slow axis. `None` for every other strategy; an error for AsyncMesh options without that
/// strategy or that strategy without them.
fn replica_options(opts: &CompileOptions) -> Result<Option<CompileOptions>, CompileError> {
    match (&opts.asyncmesh, opts.strategy) {
        (Some(am), Strategy::AsyncMesh) => {
            am.validate(&opts.mesh)?;
            Ok(Some(CompileOptions {
                mesh: crate::dist::asyncmesh::fast_mesh(&opts.mesh, &am.slow_axis),
                ..opts.clone()
            }))
        }
        (None, Strategy::AsyncMesh) => Err(
            "--strategy asyncmesh needs --slow-axis (the mesh axis whose ranks \
             are the replicas)"
                .to_string()
                .into(),
        ),
        (Some(_), _) => Err(format!(
            "--slow-axis, --sync-every, --sparsity and --ema-beta apply to --strategy \
             asyncmesh only, not {}",
            opts.strategy
        )
        .into()),
        (None, _) => Ok(None),
    }
}

/// Stage 1: the planner's choice of shard groups (and its report), with the options it
/// planned for; under [`Recompute::Auto`], planned again with recompute when nothing fits
/// without it.
fn plan_groups(
    fwd: &Program,
    opts: &CompileOptions,
    on: &mut Events<'_>,
) -> Result<(PlanReport, ShardOptions), CompileError> {
    let (mesh, cluster, cfg) = (&opts.mesh, &opts.cluster, &opts.train);
    let mut shard_opts = ShardOptions {
        strategy: opts.strategy,
        memory_budget: opts.budget,
        micro_batches: cfg.micro_batches,
        compute: cfg.compute,
        overrides: opts.overrides.clone(),
        loss: Some(cfg.loss.clone()),
        schedule: ScheduleOptions {
            reduce_grads: opts.reduce_grads,
            reshard_after_forward: opts.reshard_after_forward,
            prefetch_depth: opts.prefetch_depth,
            max_inflight_bytes: opts.max_inflight_bytes,
            recompute: opts.recompute == Recompute::On,
            grad_dtype: opts.grad_dtype,
            narrow_grads: None,
            sparse_grads: opts.sparse_grads,
            expert_parallel: opts.expert_parallel.clone(),
        },
        muon: match &cfg.optimizer {
            Some(Optimizer::Muon { .. }) => crate::train::muon_parameters(fwd)
                .map_err(|e| e.0)?
                .into_values()
                .collect(),
            _ => Vec::new(),
        },
        muon_canzona: matches!(&cfg.optimizer, Some(Optimizer::Muon { muon, .. })
            if muon.placement == crate::train::muon::MuonPlacement::Canzona),
    };
    let mut planned = planner::plan_sharding(fwd, mesh, cluster, &shard_opts);
    if opts.recompute == Recompute::Auto {
        if let Err(planner::ShardPlanError::DoesNotFit { candidate, .. }) = &planned {
            on(CompileEvent::Note(format!(
                "note: no plan fits without activation recompute (the smallest needs {}); \
                 compiling with --recompute (--recompute off to refuse instead)",
                format_bytes(candidate.memory.total)
            )))?;
            shard_opts.schedule.recompute = true;
            planned = planner::plan_sharding(fwd, mesh, cluster, &shard_opts);
        }
    }
    let report = planned.map_err(|e| match e {
        planner::ShardPlanError::DoesNotFit {
            ref candidate,
            budget,
            ..
        } => CompileError::NoFit {
            message: e.to_string(),
            need: candidate.memory.total,
            budget,
            groups: candidate.groups(),
        },
        e => CompileError::Other(e.to_string()),
    })?;
    Ok((report, shard_opts))
}

/// The bucket size to build with first. Whole-unit buckets (`u64::MAX`) hold one more
/// gathered layer and one more gradient layer than the planner counts; when its estimate
/// with those is over the budget, start from the fallback size rather than build twice.
fn first_bucket_bytes(
    opts: &CompileOptions,
    c: &planner::Candidate,
    notes: &mut Vec<String>,
) -> u64 {
    let per_unit = opts.buckets == Buckets::PerUnit && opts.rewrite;
    match opts.buckets {
        Buckets::AtMost(b) => b,
        Buckets::PerUnit => {
            let m = &c.memory;
            let extra = m.gathered / (opts.prefetch_depth as u64 + 1) + m.grad_buckets / 2;
            let estimate = m.total.saturating_add(extra);
            match opts.budget {
                Some(b) if per_unit && estimate > b => {
                    notes.push(format!(
                        "note: one bucket per layer would need about {} per rank (the planner's \
                         {} plus a layer of gathered parameters and of gradients), over the \
                         budget of {}: using buckets of at most 64 MiB (--bucket-mb sets the size)",
                        format_bytes(estimate),
                        format_bytes(m.total),
                        format_bytes(b)
                    ));
                    FALLBACK_BUCKET_BYTES
                }
                _ => u64::MAX,
            }
        }
    }
}

/// A candidate's built step, its memory plan, its assembled plan (not yet verified), the
/// notes its build gave and its simulated step.
struct BuiltCandidate {
    step: spmd::ShardedStep,
    mem: memory::MemoryPlan,
    plan: Plan,
    notes: Vec<String>,
    sim: planner::SimulatedStep,
}

/// The per-rank step of candidate `c` and its memory plan, with the bucket policy: the size
/// of [`first_bucket_bytes`], and where whole-unit buckets still break the budget, buckets of
/// the fallback size instead (with a note saying so).
fn build_with_buckets(
    fwd: &Program,
    opts: &CompileOptions,
    whole: &CompileOptions,
    c: &planner::Candidate,
    sched: &ScheduleOptions,
    notes: &mut Vec<String>,
    on: &mut Events<'_>,
) -> Result<(spmd::ShardedStep, memory::MemoryPlan), CompileError> {
    let groups = c.groups();
    let bucket_bytes = first_bucket_bytes(opts, c, notes);
    let per_unit = opts.buckets == Buckets::PerUnit && opts.rewrite;
    let (mut step, mut mem) = build_step(fwd, opts, whole, &groups, sched, bucket_bytes, on)?;
    if let Some(b) = opts.budget {
        if bucket_bytes == u64::MAX && per_unit && mem.arena_bytes > b {
            let (s2, m2) = build_step(
                fwd,
                opts,
                whole,
                &groups,
                sched,
                FALLBACK_BUCKET_BYTES,
                &mut |_| Ok(()),
            )?;
            notes.push(format!(
                "note: with one bucket per layer the arena needs {} (budget {}); buckets of at \
                 most 64 MiB need {} (--bucket-mb sets the size)",
                format_bytes(mem.arena_bytes),
                format_bytes(b),
                format_bytes(m2.arena_bytes)
            ));
            (step, mem) = (s2, m2);
        }
    }
    Ok((step, mem))
}

/// Stage 2: the per-rank step (collectives, rewriting with buckets of at most
/// `bucket_bytes`, schedule) and its memory plan; each pipeline stage's program goes to
/// `on` as a [`CompileEvent::Stage`]. `opts` is what the step is built with (for asyncmesh,
/// one replica's mesh), `whole` what the user asked for (the asyncmesh averaging is added
/// to the step on its whole mesh).
fn build_step(
    fwd: &Program,
    opts: &CompileOptions,
    whole: &CompileOptions,
    groups: &ShardGroups,
    sched: &ScheduleOptions,
    bucket_bytes: u64,
    on: &mut Events<'_>,
) -> Result<(spmd::ShardedStep, memory::MemoryPlan), CompileError> {
    let rewrite = opts.rewrite.then(|| Rewrite {
        cluster: opts.cluster.clone(),
        options: RewriteOptions {
            bucket_bytes,
            ..Default::default()
        },
    });
    let mut shown: Result<(), String> = Ok(());
    if opts.strategy == Strategy::Acco {
        let step = crate::dist::acco::acco_step(fwd, &opts.train, &opts.mesh, sched.grad_dtype)
            .map_err(|e| CompileError::Other(e.to_string()))?;
        on(CompileEvent::Stage("schedule", &step.program))?;
        let mem = {
            let kinds = |v: ValueId| buffer_kind(&step.program, v);
            let persistent = memory::default_persistent(&step.program);
            memory::plan_memory(&step.program, &kinds, &persistent)
        };
        return Ok((step, mem));
    }
    let step = spmd::shard_training_step_rewritten(
        fwd,
        &opts.train,
        &opts.mesh,
        groups,
        sched,
        rewrite.as_ref(),
        &mut |stage, p| {
            if shown.is_ok() {
                shown = on(CompileEvent::Stage(stage, p));
            }
        },
    )
    .map_err(|e| CompileError::Other(e.to_string()))?;
    shown?;
    let mut step = step;
    if let (Some(am), Strategy::AsyncMesh) = (&whole.asyncmesh, whole.strategy) {
        let names: Vec<String> = step.layouts.iter().map(|l| l.name.clone()).collect();
        step.program =
            crate::dist::asyncmesh::add_sparse_averaging(&step.program, &names, &whole.mesh, am)?;
    }
    let mem = {
        let kinds = |v: ValueId| buffer_kind(&step.program, v);
        let persistent = memory::default_persistent(&step.program);
        memory::plan_memory(&step.program, &kinds, &persistent)
    };
    Ok((step, mem))
}

/// Stage 3: the plan from the step (whose program and layouts it takes) and its memory plan
/// (whose buffers it takes).
fn assemble(
    opts: &CompileOptions,
    strategy: &str,
    step: &mut spmd::ShardedStep,
    mem: &mut memory::MemoryPlan,
) -> Plan {
    let cfg = &opts.train;
    let prog = std::mem::take(&mut step.program);
    let mut plan = Plan::assemble(
        opts.model.clone(),
        strategy,
        opts.mesh.clone(),
        step.groups.clone(),
        prog,
        mem.arena_bytes,
        std::mem::take(&mut mem.buffers),
        std::mem::take(&mut step.layouts),
        cfg.micro_batches,
        opts.fingerprint.clone(),
    );
    plan.lr = match &cfg.optimizer {
        Some(
            Optimizer::AdamW { lr, .. } | Optimizer::Sgd { lr, .. } | Optimizer::Muon { lr, .. },
        ) => Some(*lr),
        None => None,
    };
    plan.loss = opts.loss_spec.clone();
    plan.model_edits = opts.model_edits.clone().filter(|e| !e.is_empty());
    plan.expert_parallel = step.experts.as_ref().map(|x| x.group.clone());
    if opts.strategy == Strategy::AsyncMesh {
        plan.asyncmesh = opts.asyncmesh.as_ref().map(|a| a.spec());
    }
    plan
}

/// Stage 4: verifies the plan and sets its content hash; returns its JSON when
/// `opts.want_json`. One communicator per (group, stream), as the runtime creates them:
/// collectives of one group on different streams need no ordering among themselves.
/// Verification and hashing both only read the plan, so they run side by side.
fn verify_and_hash(plan: &mut Plan, opts: &CompileOptions) -> Result<Option<String>, CompileError> {
    let vopts = VerifyOptions {
        budget: if opts.verify_budget {
            opts.budget
        } else {
            None
        },
        communicator_per_stream: true,
    };
    let shared: &Plan = plan;
    let (verified, (json, hash)) = std::thread::scope(|s| {
        let hashing = s.spawn(|| {
            if opts.want_json {
                let (j, h) = shared.to_json_and_hash();
                (Some(j), h)
            } else {
                (None, shared.compute_hash())
            }
        });
        let verified = verify::verify_plan_with(shared, &vopts);
        (
            verified,
            hashing.join().expect("the hashing thread does not panic"),
        )
    });
    if let Err(violations) = verified {
        let list: Vec<String> = violations.iter().map(|v| format!("  - {v}")).collect();
        return Err(format!(
            "the compiled plan failed verification:\n{}",
            list.join("\n")
        )
        .into());
    }
    plan.content_hash = hash;
    Ok(json)
}
