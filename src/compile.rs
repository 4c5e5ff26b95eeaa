//! `hzp compile` and `hzp inspect`: the AsyncHZP compiler's front door.

use crate::commands::{load_for_compile, train_config};
use crate::{Format, ModelArgs, TrainArgs};
use hzp_ir::plan::{BufferKind, Plan, ShardGroups};
use hzp_ir::{Mesh, Op, Program, RoleKind, StreamKind, ValueDef, ValueId};
use hzp_passes::cluster::{parse_bytes, ClusterSpec};
use hzp_passes::shard_plan::{self, ReduceGrads, ShardOptions, ShardOverride, Strategy};
use hzp_passes::train::Optimizer;
use miette::{miette, IntoDiagnostic, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Instant;

/// The cluster used when `--cluster` is not given.
const DEFAULT_CLUSTER: &str = include_str!("../examples/clusters/h100-dgx.toml");

/// Flags of `hzp compile` beyond the model and training flags.
#[derive(clap::Args, Clone, Debug)]
pub struct CompileArgs {
    /// The mesh of data-parallel ranks, outermost axis first: node=16,gpu=8 (an axis may be
    /// split: gpu=2x4).
    #[arg(long)]
    pub mesh: String,
    /// Cluster spec (TOML; see examples/clusters/). Default: the 8xH100 DGX spec.
    #[arg(long, value_name = "SPEC.toml")]
    pub cluster: Option<std::path::PathBuf>,
    /// Memory budget per rank, e.g. 80GiB. Default: the cluster's device memory.
    #[arg(long)]
    pub memory: Option<String>,
    /// asynchzp (search over hierarchical groups), zero1, zero2, zero3, hsdp or ddp.
    #[arg(long, default_value = "asynchzp")]
    pub strategy: String,
    /// Override the groups: params=gpu,grads=gpu,optim=node.gpu (axes joined by `.`).
    #[arg(long)]
    pub shard: Option<String>,
    /// Print every candidate the planner weighed and why it chose one.
    #[arg(long)]
    pub explain: bool,
    /// Layers whose parameters are gathered ahead of the one computing.
    #[arg(long, default_value_t = 1)]
    pub prefetch_depth: usize,
    /// Free gathered parameters after a layer's forward and gather again for backward.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub reshard_after_forward: bool,
    /// Reduce gradients once per step (per-step) or after every micro-batch.
    #[arg(long, default_value = "per-microbatch")]
    pub reduce_grads: String,
    /// Recompute each layer's activations in its backward from the layer's inputs
    /// (activation checkpointing per layer): on, off, or auto (default: only when no plan
    /// fits the budget without it; compile then says so). `--recompute` alone means on.
    #[arg(long, num_args = 0..=1, default_value = "auto", default_missing_value = "on")]
    pub recompute: String,
    /// Bound on the bytes of gathered parameters in flight or in use at once (e.g. 4GiB);
    /// default: only --prefetch-depth bounds them.
    #[arg(long, value_name = "BYTES")]
    pub max_inflight_bytes: Option<String>,
    /// Largest bucket of fused collectives for collective rewriting, in MiB, or `unit`: one
    /// bucket per gather or reduction unit (a layer's parameters or gradients, per
    /// micro-batch and phase, as FSDP's flat parameter), however large; 0: no bucketing.
    /// Fewer, larger collectives pay the per-message latency (a ring over 128 nodes pays it
    /// 127 times) once per layer; the bucket costs one more layer-sized buffer in flight.
    #[arg(long, default_value = "unit", value_name = "MiB|unit")]
    pub bucket_mb: String,
    /// Skip collective rewriting (bucketing, hierarchical decomposition, RS+AG=AR, cast
    /// placement).
    #[arg(long)]
    pub no_rewrite: bool,
    /// Reduce an embedding table's gradient as a dense table even where exchanging the
    /// looked-up rows and their indices moves fewer bytes (the default exchanges the rows:
    /// each rank adds the ones in its shard).
    #[arg(long)]
    pub dense_embedding_grads: bool,
    /// dtype gradients are reduced and accumulated in: f32 (default) or bf16 (half the
    /// gradient memory and traffic, less exact sums).
    #[arg(long, default_value = "f32")]
    pub grad_dtype: String,
    /// Where to write the plan (JSON).
    #[arg(short, long, value_name = "PLAN.json")]
    pub output: Option<std::path::PathBuf>,
}

fn load_cluster(path: Option<&Path>) -> Result<ClusterSpec> {
    match path {
        Some(p) => ClusterSpec::load(p).map_err(|e| miette!("{e}")),
        None => ClusterSpec::from_toml_str(DEFAULT_CLUSTER, "examples/clusters/h100-dgx.toml")
            .map_err(|e| miette!("{e}")),
    }
}

/// What each value of a per-rank step holds, for the memory report.
fn buffer_kind(p: &Program, v: ValueId) -> BufferKind {
    let val = p.value(v);
    match val.def {
        ValueDef::Param => BufferKind::Param,
        ValueDef::State if val.name.starts_with("shard/") => BufferKind::Param,
        ValueDef::State => BufferKind::OptimState,
        ValueDef::Input => BufferKind::Input,
        ValueDef::Const => BufferKind::Other,
        ValueDef::Node { node, .. } => {
            let n = &p.nodes[node.index()];
            match n.role.kind {
                RoleKind::Reduce | RoleKind::Accumulate => BufferKind::Grad,
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

/// The fingerprint of a forward program's parameters (see [`hzp_ir::plan::model_fingerprint`]).
pub fn fingerprint_of(fwd: &Program) -> String {
    hzp_ir::plan::model_fingerprint(fwd.params.iter().map(|p| {
        (
            fwd.value(p.value).name.as_str(),
            &fwd.value(p.value).ty,
            p.data.as_ref(),
        )
    }))
}

/// The stages `hzp compile --print-after` prints, in pipeline order: the forward program as
/// loaded, the single-rank training step, the stages of the per-rank step builder (see
/// [`hzp_passes::spmd::STAGES`]: after collective insertion, rewriting and scheduling), and
/// the memory plan.
pub fn print_stage_names() -> Vec<&'static str> {
    let mut v = vec!["import", "training"];
    v.extend(hzp_passes::spmd::STAGES);
    v.push("memory");
    v
}

/// The stages named by `--print-after` (repeated, comma-separated, or `all`).
fn print_stages(list: &[String]) -> Result<BTreeSet<&'static str>> {
    let names = print_stage_names();
    let mut out = BTreeSet::new();
    for name in list.iter().flat_map(|s| s.split(',')).map(str::trim) {
        if name == "all" {
            out.extend(names.iter().copied());
        } else if let Some(&s) = names.iter().find(|&&s| s == name) {
            out.insert(s);
        } else {
            return Err(miette!(
                "--print-after `{name}`: hzp compile's stages are {} (or all)",
                names.join(", ")
            ));
        }
    }
    Ok(out)
}

/// Prints `text()` under a `# after STAGE` header when `--print-after` asked for `stage`.
fn show_stage(
    stages: &BTreeSet<&'static str>,
    stage: &str,
    text: impl FnOnce() -> String,
) -> Result<()> {
    if stages.contains(stage) {
        let text = text();
        outln!("# after {stage}\n{}", text.trim_end());
    }
    Ok(())
}

/// The plan's text form without the program (printed `after schedule`): its header and the
/// buffer table of the memory plan.
fn memory_text(plan: &Plan) -> String {
    let full = plan.to_text();
    match (full.find("\n\n"), full.rfind("\n# buffers")) {
        (Some(head), Some(table)) if head < table => format!(
            "{}# program: as printed after schedule\n{}",
            &full[..=head],
            &full[table + 1..]
        ),
        _ => full,
    }
}

/// A compiled and verified plan, with what the planner weighed.
pub struct Built {
    pub plan: Plan,
    /// The plan's JSON ([`Plan::to_json`]), when `build_plan` was asked for it.
    pub json: Option<String>,
    pub report: shard_plan::PlanReport,
    pub peak_by_kind: BTreeMap<BufferKind, u64>,
    pub cluster: ClusterSpec,
    /// The memory budget per rank, if one was given.
    pub budget: Option<u64>,
}

/// Why [`build_plan`] gave no plan.
pub enum BuildError {
    /// No sharding fits the budget: the planner's message, and its smallest candidate.
    NoFit {
        message: String,
        need: u64,
        budget: u64,
        groups: ShardGroups,
    },
    Other(miette::Report),
}

impl From<miette::Report> for BuildError {
    fn from(e: miette::Report) -> BuildError {
        BuildError::Other(e)
    }
}

impl From<BuildError> for miette::Report {
    fn from(e: BuildError) -> miette::Report {
        match e {
            BuildError::NoFit { message, .. } => miette!("{message}"),
            BuildError::Other(r) => r,
        }
    }
}

/// The passes of `hzp compile` up to a verified plan (shared with `hzp compare` and `hzp
/// scale`). `verify_budget`: the verifier also rejects an arena over `--memory`.
/// Phase timings of a compile, printed to stderr when `HZP_PROFILE_COMPILE` is set.
struct Phases {
    on: bool,
    last: std::cell::Cell<Instant>,
}

impl Phases {
    fn new() -> Phases {
        Phases {
            on: std::env::var_os("HZP_PROFILE_COMPILE").is_some(),
            last: std::cell::Cell::new(Instant::now()),
        }
    }

    fn mark(&self, what: &str) {
        if self.on {
            let now = Instant::now();
            note!(
                "  {what:<22} {:8.3} s",
                (now - self.last.get()).as_secs_f64()
            );
            self.last.set(now);
        }
    }
}

/// The most gather units `--prefetch-depth` may issue ahead of the one computing.
pub const MAX_PREFETCH_DEPTH: usize = 4096;

pub fn build_plan(
    model: &ModelArgs,
    inputs: Option<&Path>,
    t: &TrainArgs,
    c: &CompileArgs,
    verify_budget: bool,
    want_json: bool,
) -> std::result::Result<Built, BuildError> {
    let mesh = Mesh::parse(&c.mesh).map_err(|e| miette!("--mesh: {e}"))?;
    let cluster = load_cluster(c.cluster.as_deref())?;
    cluster.validate_mesh(&mesh).map_err(|e| miette!("{e}"))?;
    let budget = match &c.memory {
        Some(m) => Some(parse_bytes(m).map_err(|e| miette!("--memory {m}: {e}"))?),
        None => None,
    };
    // `--print-after` names compile stages here, not the stages of `hzp train`.
    let stages = print_stages(&t.print_after)?;
    let cfg = train_config(
        &TrainArgs {
            print_after: Vec::new(),
            ..t.clone()
        },
        true,
    )?;
    let phases = Phases::new();
    if c.prefetch_depth > MAX_PREFETCH_DEPTH {
        return Err(miette!(
            "--prefetch-depth {} is more than the limit of {MAX_PREFETCH_DEPTH} gather units ahead",
            c.prefetch_depth
        )
        .into());
    }
    // Both factors are bounded (Mesh::MAX_RANKS, MAX_MICRO_BATCHES), so this cannot wrap.
    let divisor = mesh
        .world_size()
        .checked_mul(cfg.micro_batches)
        .ok_or_else(|| {
            miette!(
                "--mesh {} x --micro-batches {} is too many",
                mesh,
                cfg.micro_batches
            )
        })?;
    let mut fwd = load_for_compile(model, inputs, divisor)?;
    // `hzp run` checks the model it loads against this, before any freezing or tying.
    let fingerprint = fingerprint_of(&fwd);
    crate::commands::apply_freeze_and_ties(&mut fwd, t)?;
    show_stage(&stages, "import", || hzp_ir::text::print(&fwd))?;
    let strategy = Strategy::parse(&c.strategy).map_err(|e| miette!("{e}"))?;
    let overrides = match &c.shard {
        Some(s) => ShardOverride::parse(s, &mesh).map_err(|e| miette!("--shard: {e}"))?,
        None => ShardOverride::default(),
    };
    let grad_dtype = match c.grad_dtype.to_ascii_lowercase().as_str() {
        "f32" | "fp32" | "float32" => hzp_ir::DType::F32,
        "bf16" | "bfloat16" => hzp_ir::DType::BF16,
        "f16" | "fp16" | "float16" => hzp_ir::DType::F16,
        other => {
            return Err(miette!("--grad-dtype {other}: expected f32, bf16 or f16").into());
        }
    };
    let max_inflight_bytes = match &c.max_inflight_bytes {
        Some(b) => Some(parse_bytes(b).map_err(|e| miette!("--max-inflight-bytes {b}: {e}"))?),
        None => None,
    };
    let recompute_mode = match c.recompute.to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" => Some(true),
        "off" | "false" | "no" => Some(false),
        "auto" => None,
        other => {
            return Err(miette!("--recompute {other}: expected on, off or auto").into());
        }
    };
    let mut opts = ShardOptions {
        strategy,
        memory_budget: budget,
        micro_batches: cfg.micro_batches,
        compute: if cfg.compute == hzp_ir::DType::F32 && model.model.starts_with("preset:") {
            hzp_ir::DType::BF16
        } else {
            cfg.compute
        },
        reduce_grads: ReduceGrads::parse(&c.reduce_grads).map_err(|e| miette!("{e}"))?,
        prefetch_depth: c.prefetch_depth,
        reshard_after_forward: c.reshard_after_forward,
        recompute: recompute_mode.unwrap_or(false),
        grad_dtype,
        overrides,
        loss: Some(cfg.loss.clone()),
        sparse_grads: !c.dense_embedding_grads,
    };
    let mut cfg = cfg;
    cfg.compute = opts.compute;
    if stages.contains("training") {
        let step = hzp_passes::train::training_step(&fwd, &cfg).map_err(|e| miette!("{e}"))?;
        show_stage(&stages, "training", || hzp_ir::text::print(&step))?;
    }
    phases.mark("load");
    let mut planned = shard_plan::plan_sharding(&fwd, &mesh, &cluster, &opts);
    if recompute_mode.is_none() {
        if let Err(shard_plan::ShardPlanError::DoesNotFit { candidate, .. }) = &planned {
            note!(
                "note: no plan fits without activation recompute (the smallest needs {}); \
                 compiling with --recompute (--recompute off to refuse instead)",
                hzp_ir::plan::format_bytes(candidate.memory.total)
            );
            opts.recompute = true;
            planned = shard_plan::plan_sharding(&fwd, &mesh, &cluster, &opts);
        }
    }
    let sched = hzp_passes::spmd::ScheduleOptions {
        reduce_grads: opts.reduce_grads,
        reshard_after_forward: opts.reshard_after_forward,
        prefetch_depth: opts.prefetch_depth,
        max_inflight_bytes,
        recompute: opts.recompute,
        grad_dtype: opts.grad_dtype,
        narrow_grads: None,
        sparse_grads: !c.dense_embedding_grads,
    };
    let report = planned.map_err(|e| match e {
        shard_plan::ShardPlanError::DoesNotFit {
            ref candidate,
            budget,
            ..
        } => BuildError::NoFit {
            message: e.to_string(),
            need: candidate.memory.total,
            budget,
            groups: candidate.groups(),
        },
        e => BuildError::Other(miette!("{e}")),
    })?;
    if c.explain {
        outln!("{}", shard_plan::explain(&report));
    }
    let chosen = report.chosen.groups();
    let sched = hzp_passes::spmd::ScheduleOptions {
        narrow_grads: report
            .chosen
            .narrow
            .as_ref()
            .map(|n| hzp_passes::spmd::NarrowGrads {
                group: n.group.clone(),
                params: n.params.iter().cloned().collect(),
            }),
        ..sched
    };
    let groups = hzp_passes::spmd::ShardSpec {
        params: chosen.params.clone(),
        grads: chosen.grads.clone(),
        optim: chosen.optim.clone(),
    };
    let bucket_bytes = match c.bucket_mb.trim() {
        "unit" => u64::MAX,
        n => n
            .parse::<u64>()
            .ok()
            .and_then(|m| m.checked_mul(1 << 20))
            .ok_or_else(|| miette!("--bucket-mb {n}: expected a number of MiB or `unit`"))?,
    };
    phases.mark("plan shard groups");
    // Builds the per-rank step and its memory plan with buckets of at most `bucket_bytes`.
    let build = |bucket_bytes: u64| -> Result<_> {
        let rewrite = (!c.no_rewrite).then(|| hzp_passes::spmd::Rewrite {
            cluster: cluster.clone(),
            options: hzp_passes::rewrite::RewriteOptions {
                bucket_bytes,
                ..Default::default()
            },
        });
        let mut shown: Result<()> = Ok(());
        let step = hzp_passes::spmd::shard_training_step_rewritten(
            &fwd,
            &cfg,
            &mesh,
            &groups,
            &sched,
            rewrite.as_ref(),
            &mut |stage, p| {
                if shown.is_err() {
                    return;
                }
                shown = show_stage(&stages, stage, || hzp_ir::text::print(p));
                if shown.is_ok() && stage == "collectives" && rewrite.is_none() {
                    shown = show_stage(&stages, "rewrite", || {
                        "# collective rewriting is off (--no-rewrite): as after collectives".into()
                    });
                }
            },
        )
        .map_err(|e| miette!("{e}"))?;
        shown?;
        let mem = {
            let kinds = |v: ValueId| buffer_kind(&step.program, v);
            let persistent = hzp_passes::memory::default_persistent(&step.program);
            hzp_passes::memory::plan_memory(&step.program, &kinds, &persistent)
        };
        Ok((step, mem))
    };
    // Whole-unit buckets hold one more gathered layer and one more gradient layer than the
    // planner counts; when its estimate with those is over the budget, start from 64 MiB
    // buckets rather than build twice.
    const FALLBACK_BUCKET: u64 = 64 << 20;
    let bucket_bytes = {
        let m = &report.chosen.memory;
        let extra = m.gathered / (opts.prefetch_depth as u64 + 1) + m.grad_buckets / 2;
        if bucket_bytes == u64::MAX
            && !c.no_rewrite
            && budget.is_some_and(|b| m.total.saturating_add(extra) > b)
        {
            note!(
                "note: one bucket per layer would need about {} per rank (the planner's {} plus \
                 a layer of gathered parameters and of gradients), over the budget of {}: \
                 using buckets of at most 64 MiB (--bucket-mb sets the size)",
                hzp_ir::plan::format_bytes(m.total.saturating_add(extra)),
                hzp_ir::plan::format_bytes(m.total),
                hzp_ir::plan::format_bytes(budget.unwrap_or(0))
            );
            FALLBACK_BUCKET
        } else {
            bucket_bytes
        }
    };
    let (mut step, mut mem) = build(bucket_bytes)?;
    // Where whole-unit buckets still break the budget, buckets of the old fixed size are used
    // instead, and compile says so.
    if bucket_bytes == u64::MAX && !c.no_rewrite && budget.is_some_and(|b| mem.arena_bytes > b) {
        let (s2, m2) = build(FALLBACK_BUCKET)?;
        note!(
            "note: with one bucket per layer the arena needs {} (budget {}); buckets of at most \
             64 MiB need {} (--bucket-mb sets the size)",
            hzp_ir::plan::format_bytes(mem.arena_bytes),
            hzp_ir::plan::format_bytes(budget.unwrap_or(0)),
            hzp_ir::plan::format_bytes(m2.arena_bytes)
        );
        (step, mem) = (s2, m2);
    }
    for (name, rows, table) in &step.row_exchanged {
        note!(
            "note: `{name}`'s gradient goes out as its looked-up rows and their indices ({} sent \
             per rank per micro-batch) instead of reducing the {} table \
             (--dense-embedding-grads reduces the table)",
            hzp_ir::plan::format_bytes(*rows),
            hzp_ir::plan::format_bytes(*table)
        );
    }
    if c.explain {
        if let Some(r) = &step.rewrite_report {
            outln!("collective rewriting:\n{r}");
        }
    }
    phases.mark("build per-rank step + memory plan");
    let plan_groups = ShardGroups {
        params: step.groups.params.clone(),
        grads: step.groups.grads.clone(),
        optim: step.groups.optim.clone(),
    };
    let prog = std::mem::take(&mut step.program);
    let mut plan = Plan::assemble(
        model.model.clone(),
        strategy.name(),
        mesh.clone(),
        plan_groups,
        prog,
        mem.arena_bytes,
        mem.buffers.clone(),
        step.layouts.clone(),
        cfg.micro_batches,
        fingerprint,
    );
    plan.lr = match &cfg.optimizer {
        Some(Optimizer::AdamW { lr, .. } | Optimizer::Sgd { lr, .. }) => Some(*lr),
        None => None,
    };
    plan.loss = Some(crate::commands::loss_spec(t));
    show_stage(&stages, "memory", || memory_text(&plan))?;
    // One communicator per (group, stream), as the runtime creates them: collectives of one
    // group on different streams do not need ordering among themselves.
    let vopts = hzp_passes::verify_plan::VerifyOptions {
        budget: if verify_budget { budget } else { None },
        communicator_per_stream: true,
    };
    phases.mark("assemble plan");
    // Verification and the content hash (with the JSON, when it is wanted) both only read the
    // plan: they run side by side.
    let (verified, (json, hash)) = std::thread::scope(|s| {
        let hashing = s.spawn(|| {
            if want_json {
                let (j, h) = plan.to_json_and_hash();
                (Some(j), h)
            } else {
                (None, plan.compute_hash())
            }
        });
        let verified = hzp_passes::verify_plan::verify_plan_with(&plan, &vopts);
        (
            verified,
            hashing.join().expect("the hashing thread does not panic"),
        )
    });
    if let Err(violations) = verified {
        let list: Vec<String> = violations.iter().map(|v| format!("  - {v}")).collect();
        return Err(miette!(
            "the compiled plan failed verification:\n{}",
            list.join("\n")
        )
        .into());
    }
    plan.content_hash = hash;
    phases.mark("verify + hash + JSON");
    Ok(Built {
        plan,
        json,
        report,
        peak_by_kind: mem.peak_by_kind,
        cluster,
        budget,
    })
}

pub fn compile(
    model: &ModelArgs,
    inputs: Option<&Path>,
    t: &TrainArgs,
    c: &CompileArgs,
    format: Format,
) -> Result<()> {
    let start = Instant::now();
    let mut read_files = crate::files::model_files(&model.model);
    read_files.extend(inputs.map(Path::to_path_buf));
    read_files.extend(c.cluster.clone());
    if let Some(out) = &c.output {
        crate::files::check_output(out, &read_files)?;
    }
    let Built {
        plan,
        json,
        report,
        peak_by_kind,
        ..
    } = build_plan(model, inputs, t, c, true, c.output.is_some())?;
    if let Some(out) = &c.output {
        let json = json.ok_or_else(|| miette!("internal error: the plan's JSON was not made"))?;
        crate::files::write_bytes(out, &read_files, json.as_bytes())?;
    }
    let summary = summary(&plan, &report, &peak_by_kind, start.elapsed().as_secs_f64());
    match format {
        Format::Json => outln!(
            "{}",
            serde_json::to_string_pretty(&summary).into_diagnostic()?
        ),
        Format::Text => {
            print_summary(&summary)?;
            if let Some(out) = &c.output {
                outln!("wrote {}", out.display());
            }
        }
    }
    Ok(())
}

#[derive(serde::Serialize)]
struct Summary {
    model: String,
    strategy: String,
    mesh: String,
    world_size: usize,
    groups: BTreeMap<&'static str, String>,
    predicted_step_s: f64,
    predicted_exposed_comm_s: f64,
    nodes_per_stream: BTreeMap<&'static str, usize>,
    collectives: Vec<CollectiveRow>,
    arena_bytes: u64,
    peak_by_kind: BTreeMap<String, u64>,
    bytes_per_link: BTreeMap<String, f64>,
    compile_seconds: f64,
}

#[derive(serde::Serialize)]
struct CollectiveRow {
    op: String,
    group: String,
    stream: String,
    count: usize,
    bytes: u64,
}

fn collectives(p: &Program) -> Vec<CollectiveRow> {
    let mut rows: BTreeMap<(String, String, String), (usize, u64)> = BTreeMap::new();
    for n in &p.nodes {
        if let Some(g) = n.op.group() {
            let bytes = n
                .inputs
                .iter()
                .chain(&n.outputs)
                .map(|&v| p.ty(v).size_bytes() as u64)
                .max()
                .unwrap_or(0);
            let e = rows
                .entry((
                    n.op.name().to_string(),
                    g.to_string(),
                    n.stream.name().to_string(),
                ))
                .or_default();
            e.0 += 1;
            e.1 += bytes;
        }
    }
    rows.into_iter()
        .map(|((op, group, stream), (count, bytes))| CollectiveRow {
            op,
            group,
            stream,
            count,
            bytes,
        })
        .collect()
}

fn nodes_per_stream(p: &Program) -> BTreeMap<&'static str, usize> {
    let mut m = BTreeMap::new();
    for n in &p.nodes {
        *m.entry(n.stream.name()).or_default() += 1;
    }
    m
}

fn summary(
    plan: &Plan,
    report: &shard_plan::PlanReport,
    peak: &BTreeMap<BufferKind, u64>,
    secs: f64,
) -> Summary {
    let mut groups = BTreeMap::new();
    groups.insert("params", plan.groups.params.to_string());
    groups.insert("grads", plan.grads_label());
    groups.insert("optim", plan.groups.optim.to_string());
    Summary {
        model: plan.model.clone(),
        strategy: plan.strategy.clone(),
        mesh: plan.mesh.to_string(),
        world_size: plan.mesh.world_size(),
        groups,
        predicted_step_s: report.chosen.step_s,
        predicted_exposed_comm_s: report.chosen.exposed_comm_s,
        nodes_per_stream: nodes_per_stream(&plan.program),
        collectives: collectives(&plan.program),
        arena_bytes: plan.arena_bytes,
        peak_by_kind: peak
            .iter()
            .map(|(k, v)| (k.name().to_string(), *v))
            .collect(),
        bytes_per_link: report.chosen.bytes_per_link.clone(),
        compile_seconds: secs,
    }
}

fn print_summary(s: &Summary) -> Result<()> {
    outln!(
        "plan for {} on {} ({} ranks), strategy {}",
        s.model,
        s.mesh,
        s.world_size,
        s.strategy
    );
    outln!(
        "  groups: params {}  grads {}  optim {}",
        s.groups["params"],
        s.groups["grads"],
        s.groups["optim"]
    );
    outln!(
        "  predicted step {} (exposed communication {})",
        shard_plan::human_seconds(s.predicted_step_s),
        shard_plan::human_seconds(s.predicted_exposed_comm_s)
    );
    outln!(
        "  arena per rank {}",
        hzp_ir::plan::format_bytes(s.arena_bytes)
    );
    for (k, v) in &s.peak_by_kind {
        outln!("    {k:<12} {}", hzp_ir::plan::format_bytes(*v));
    }
    outln!("  nodes per stream:");
    for (k, v) in &s.nodes_per_stream {
        outln!("    {k:<14} {v}");
    }
    outln!("  collectives per step:");
    for r in &s.collectives {
        outln!(
            "    {:<14} {:<16} on {:<14} x{:<5} {}",
            r.op,
            r.group,
            r.stream,
            r.count,
            hzp_ir::plan::format_bytes(r.bytes)
        );
    }
    outln!("  compiled in {:.2} s", s.compile_seconds);
    Ok(())
}

/// Bytes one rank sends per step over each link class of `cluster` (by the cost model's
/// fastest algorithm for each collective), in the order link classes are first used.
pub fn bytes_per_link(
    p: &Program,
    mesh: &Mesh,
    cluster: &ClusterSpec,
) -> Result<Vec<(String, f64)>> {
    let model = hzp_passes::cost::CostModel::new(cluster.clone(), mesh.clone())
        .map_err(|e| miette!("{e}"))?;
    let mut out: Vec<(String, f64)> = Vec::new();
    for n in &p.nodes {
        let (Some(kind), Some(group)) = (hzp_passes::cost::CollectiveKind::of(&n.op), n.op.group())
        else {
            continue;
        };
        let ins: Vec<&hzp_ir::TensorType> = n.inputs.iter().map(|&v| p.ty(v)).collect();
        let outs: Vec<&hzp_ir::TensorType> = n.outputs.iter().map(|&v| p.ty(v)).collect();
        let cost = model
            .best_collective(kind, kind.full_bytes(&ins, &outs), group)
            .map_err(|e| miette!("{}: {e}", n.name))?;
        for (l, b) in cost.bytes_sent_per_rank_per_link {
            match out.iter_mut().find(|(x, _)| *x == l) {
                Some((_, t)) => *t += b,
                None => out.push((l, b)),
            }
        }
    }
    Ok(out)
}

pub fn inspect(path: &Path, cluster: Option<&Path>, format: Format) -> Result<()> {
    let plan = crate::run::read_plan(path)?;
    let p = &plan.program;
    let persistent = hzp_passes::memory::default_persistent(p);
    let kinds = |v: ValueId| buffer_kind(p, v);
    let mem = hzp_passes::memory::plan_memory(p, &kinds, &persistent);
    let cluster = load_cluster(cluster)?;
    cluster
        .validate_mesh(&plan.mesh)
        .map_err(|e| miette!("{e}"))?;
    let per_link = bytes_per_link(p, &plan.mesh, &cluster)?;
    let intra: Vec<String> = shard_plan::node_local_group(&plan.mesh, &cluster)
        .axes
        .iter()
        .filter_map(|a| cluster.link_for_axis(a).ok().map(|l| l.name.clone()))
        .collect();
    match format {
        Format::Json => {
            let v = serde_json::json!({
                "model": plan.model,
                "strategy": plan.strategy,
                "mesh": plan.mesh.to_string(),
                "groups": {
                    "params": plan.groups.params.to_string(),
                    "grads": plan.groups.grads.to_string(),
                    "optim": plan.groups.optim.to_string(),
                },
                "grads_accumulated_in": plan.layouts.iter().filter_map(|l| l.accumulate_group.as_ref().map(|g| (l.name.clone(), g.to_string()))).collect::<BTreeMap<_, _>>(),
                "arena_bytes": plan.arena_bytes,
                "peak_by_kind": mem.peak_by_kind.iter().map(|(k, v)| (k.name().to_string(), *v)).collect::<BTreeMap<_, _>>(),
                "nodes_per_stream": nodes_per_stream(p),
                "collectives": collectives(p),
                "cluster": cluster.name,
                "bytes_per_rank_per_link": per_link.iter().map(|(l, b)| (l.clone(), b.round() as u64)).collect::<BTreeMap<_, _>>(),
                "content_hash": plan.content_hash,
            });
            outln!("{}", serde_json::to_string_pretty(&v).into_diagnostic()?);
        }
        Format::Text => {
            outln!(
                "plan {} (format version {}, hash {})",
                path.display(),
                plan.version,
                &plan.content_hash[..16.min(plan.content_hash.len())]
            );
            outln!(
                "  model {}  strategy {}  mesh {}",
                plan.model,
                plan.strategy,
                plan.mesh
            );
            outln!(
                "  groups: params {}  grads {}  optim {}",
                plan.groups.params,
                plan.grads_label(),
                plan.groups.optim
            );
            outln!(
                "\nmemory per rank: arena {}",
                hzp_ir::plan::format_bytes(plan.arena_bytes)
            );
            for (k, v) in &mem.peak_by_kind {
                outln!("  {:<12} {}", k.name(), hzp_ir::plan::format_bytes(*v));
            }
            outln!("\ncollectives per step");
            for r in collectives(p) {
                outln!(
                    "  {:<14} {:<16} on {:<14} x{:<5} {}",
                    r.op,
                    r.group,
                    r.stream,
                    r.count,
                    hzp_ir::plan::format_bytes(r.bytes)
                );
            }
            outln!(
                "\nbytes sent per rank per step, by link class ({})",
                cluster.name
            );
            for (l, b) in &per_link {
                let class = if intra.contains(l) {
                    "inside a node"
                } else {
                    "across nodes"
                };
                outln!(
                    "  {:<14} {:>12}  {class}",
                    l,
                    hzp_ir::plan::format_bytes(b.round() as u64)
                );
            }
            for stream in [
                StreamKind::Compute,
                StreamKind::AllGather,
                StreamKind::ReduceScatter,
            ] {
                let ops: Vec<&hzp_ir::Node> =
                    p.nodes.iter().filter(|n| n.stream == stream).collect();
                outln!("\nstream {} ({} ops)", stream.name(), ops.len());
                for n in ops {
                    let detail = match &n.op {
                        Op::RecordEvent { event } => format!("record event {event}"),
                        Op::WaitEvent { event } => format!("wait event {event}"),
                        op => {
                            let outs: Vec<String> =
                                n.outputs.iter().map(|&o| p.ty(o).to_string()).collect();
                            format!("{} -> {}", op.name(), outs.join(", "))
                        }
                    };
                    outln!("  {:<48} {}", n.name, detail);
                }
            }
        }
    }
    Ok(())
}
