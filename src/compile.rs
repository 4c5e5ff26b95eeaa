//! `hzp compile` and `hzp inspect`: the AsyncHZP compiler's front door.

use crate::commands::{load_for_compile, train_config};
use crate::{Format, ModelArgs, TrainArgs};
use hzp_ir::plan::{BufferKind, Plan};
use hzp_ir::{Mesh, Op, Program, StreamKind};
use hzp_passes::compile::{
    compile_plan, Buckets, CompileError, CompileEvent, CompileOptions, Recompute,
    MAX_PREFETCH_DEPTH,
};
use hzp_passes::cost::cluster::{parse_bytes, ClusterSpec};
use hzp_passes::dist::spmd::ReduceGrads;
use hzp_passes::plan::memory::MemoryPlan;
use hzp_passes::plan::planner::{self, ShardOverride, Strategy};
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
    /// asynchzp (search over hierarchical groups), zero1, zero2, zero3, hsdp, ddp, or
    /// asyncmesh (replicas along --slow-axis step locally and average a sparse chunk of
    /// their parameters asynchronously).
    /// [default: asynchzp]
    #[arg(long, ignore_case = true, value_parser = crate::strategy_choices())]
    pub strategy: Option<String>,
    /// asyncmesh: the mesh axis whose ranks are the replicas (e.g. node).
    #[arg(long, value_name = "AXIS")]
    pub slow_axis: Option<String>,
    /// asyncmesh: spread the averaging budget over H steps (each step averages
    /// ceil(S n / H) elements of an n-element shard). Default 1.
    #[arg(long, value_name = "H")]
    pub sync_every: Option<usize>,
    /// asyncmesh: the fraction S of the parameters averaged across the slow axis per H
    /// steps, 0 < S <= 1. Default 0.05.
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    pub sparsity: Option<f64>,
    /// asyncmesh: the EMA factor B of the staleness correction, 0 <= B < 1. Default 0.9.
    #[arg(long, value_name = "B", allow_negative_numbers = true)]
    pub ema_beta: Option<f64>,
    /// Override the groups: params=gpu,grads=gpu,optim=node.gpu (axes joined by `.`).
    #[arg(long)]
    pub shard: Option<String>,
    /// Split the experts of every routed MoE layer over the ranks of these mesh axes
    /// (expert parallelism), e.g. gpu or node,gpu: each rank holds E/n experts, tokens go to
    /// their experts and back by AllToAll, and expert weights are ZeRO-sharded over the
    /// other axes only. `auto` compiles each choice (none, and every set of axes whose ranks
    /// divide the experts) and keeps the fastest simulated step that fits. Default: every
    /// rank holds every expert.
    #[arg(long, value_name = "AXES|auto")]
    pub expert_parallel: Option<String>,
    /// Print every candidate the planner weighed and why it chose one.
    #[arg(long)]
    pub explain: bool,
    /// Layers whose parameters are gathered ahead of the one computing.
    #[arg(long, default_value_t = DEFAULT_PREFETCH_DEPTH)]
    pub prefetch_depth: usize,
    /// Free gathered parameters after a layer's forward and gather again for backward.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub reshard_after_forward: bool,
    /// Reduce gradients once per step (per-step) or after every micro-batch.
    #[arg(long, default_value = DEFAULT_REDUCE_GRADS, ignore_case = true, value_parser = crate::reduce_grads_choices())]
    pub reduce_grads: String,
    /// Recompute each layer's activations in its backward from the layer's inputs
    /// (activation checkpointing per layer): on, off, or auto (default: only when no plan
    /// fits the budget without it; compile then says so). `--recompute` alone means on.
    #[arg(long, num_args = 0..=1, default_value = DEFAULT_RECOMPUTE, default_missing_value = "on", ignore_case = true, value_parser = crate::recompute_choices())]
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
    #[arg(long, default_value = DEFAULT_BUCKET_MB, value_name = "MiB|unit")]
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
    #[arg(long, default_value = DEFAULT_GRAD_DTYPE, ignore_case = true, value_parser = crate::choices(&[("f32", &["fp32", "float32"]), ("bf16", &["bfloat16"]), ("f16", &["fp16", "float16"])]))]
    pub grad_dtype: String,
    /// Where to write the plan (JSON).
    #[arg(short, long, value_name = "PLAN.json")]
    pub output: Option<std::path::PathBuf>,
}

/// `--expert-parallel AXES`: mesh axes joined by `,` or `.`.
fn expert_axes(s: &str, mesh: &hzp_ir::Mesh) -> Result<hzp_ir::Group> {
    let axes: Vec<&str> = s
        .split([',', '.'])
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .collect();
    if axes.is_empty() {
        return Err(miette!(
            "--expert-parallel needs mesh axes, e.g. --expert-parallel gpu (mesh {mesh})"
        ));
    }
    for a in &axes {
        if mesh.axis(a).is_none() {
            return Err(miette!(
                "--expert-parallel {s}: `{a}` is not an axis of the mesh {mesh}"
            ));
        }
    }
    Ok(hzp_ir::Group::new(axes.iter().copied()))
}

pub(crate) fn load_cluster(path: Option<&Path>) -> Result<ClusterSpec> {
    match path {
        Some(p) => ClusterSpec::load(p).map_err(|e| miette!("{e}")),
        None => ClusterSpec::from_toml_str(DEFAULT_CLUSTER, "examples/clusters/h100-dgx.toml")
            .map_err(|e| miette!("{e}")),
    }
}

// The defaults of `hzp compile`'s flags, shared by the parser and [`CompileArgs::for_mesh`].
const DEFAULT_PREFETCH_DEPTH: usize = 1;
const DEFAULT_REDUCE_GRADS: &str = "per-microbatch";
const DEFAULT_RECOMPUTE: &str = "auto";
const DEFAULT_BUCKET_MB: &str = "unit";
const DEFAULT_GRAD_DTYPE: &str = "f32";

impl CompileArgs {
    /// `--strategy`, or its default.
    pub fn strategy(&self) -> &str {
        self.strategy.as_deref().unwrap_or("asynchzp")
    }

    /// `hzp compile --mesh MESH` with every other flag at its default: what `hzp scale` and
    /// `hzp bench compile` start from before they set their own flags (as typed values).
    pub fn for_mesh(mesh: &str) -> CompileArgs {
        CompileArgs {
            mesh: mesh.to_string(),
            cluster: None,
            memory: None,
            strategy: None,
            slow_axis: None,
            sync_every: None,
            sparsity: None,
            ema_beta: None,
            shard: None,
            expert_parallel: None,
            explain: false,
            prefetch_depth: DEFAULT_PREFETCH_DEPTH,
            reshard_after_forward: true,
            reduce_grads: DEFAULT_REDUCE_GRADS.to_string(),
            recompute: DEFAULT_RECOMPUTE.to_string(),
            max_inflight_bytes: None,
            bucket_mb: DEFAULT_BUCKET_MB.to_string(),
            no_rewrite: false,
            dense_embedding_grads: false,
            grad_dtype: DEFAULT_GRAD_DTYPE.to_string(),
            output: None,
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
/// [`hzp_passes::dist::spmd::STAGES`]: after collective insertion, rewriting and scheduling), and
/// the memory plan.
pub fn print_stage_names() -> Vec<&'static str> {
    let mut v = vec!["import", "training"];
    v.extend(hzp_passes::dist::spmd::STAGES);
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
    pub report: planner::PlanReport,
    pub peak_by_kind: BTreeMap<BufferKind, u64>,
    pub cluster: ClusterSpec,
    /// The memory budget per rank, if one was given.
    pub budget: Option<u64>,
}

/// Phase timings of a compile, printed to stderr when `HZP_PROFILE_COMPILE` is set.
struct Phases {
    on: bool,
    last: Instant,
}

impl Phases {
    fn new() -> Phases {
        Phases {
            on: std::env::var_os("HZP_PROFILE_COMPILE").is_some(),
            last: Instant::now(),
        }
    }

    fn mark(&mut self, what: &str) {
        if self.on {
            let now = Instant::now();
            note!("  {what:<22} {:8.3} s", (now - self.last).as_secs_f64());
            self.last = now;
        }
    }
}

/// The forward program and the library compile options `hzp compile`'s flags ask for; the
/// stages `--print-after` names.
pub struct Request {
    pub fwd: Program,
    pub opts: CompileOptions,
    pub stages: BTreeSet<&'static str>,
    pub explain: bool,
}

/// Parses the flags of `hzp compile` (shared with `hzp compare` and `hzp scale`) and loads
/// the model.
pub fn request(
    model: &ModelArgs,
    inputs: Option<&Path>,
    t: &TrainArgs,
    c: &CompileArgs,
) -> Result<Request> {
    let mesh = Mesh::parse(&c.mesh).map_err(|e| miette!("--mesh: {e}"))?;
    let cluster = load_cluster(c.cluster.as_deref())?;
    cluster.validate_mesh(&mesh).map_err(|e| miette!("{e}"))?;
    // Without --memory, the budget is the cluster's device memory, the same number the
    // planner plans with: a plan compiled without the flag is the plan compiled with it.
    let budget = Some(match &c.memory {
        Some(m) => parse_bytes(m).map_err(|e| miette!("--memory {m}: {e}"))?,
        None => cluster.device.memory_bytes,
    });
    // `--print-after` names compile stages here, not the stages of `hzp train`.
    let stages = print_stages(&t.print_after)?;
    let mut cfg = train_config(
        &TrainArgs {
            print_after: Vec::new(),
            ..t.clone()
        },
        true,
    )?;
    if c.prefetch_depth > MAX_PREFETCH_DEPTH {
        return Err(miette!(
            "--prefetch-depth {} is more than the limit of {MAX_PREFETCH_DEPTH} gather units ahead",
            c.prefetch_depth
        ));
    }
    let strategy = Strategy::parse(c.strategy()).map_err(|e| miette!("{e}"))?;
    if strategy == Strategy::Acco {
        // ACCO splits each rank's batch into two halves of --micro-batches each; the plan
        // holds both halves' micro-batches.
        cfg.micro_batches = cfg
            .micro_batches
            .checked_mul(2)
            .ok_or_else(|| miette!("--micro-batches {} is too many", cfg.micro_batches))?;
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
    crate::commands::apply_freeze_and_ties(&mut fwd, t, model)?;
    crate::commands::note_muon_split(&fwd, &cfg)?;
    show_stage(&stages, "import", || hzp_ir::text::print(&fwd))?;
    let asyncmesh = asyncmesh_options(c, strategy, &mesh)?;
    let overrides = match &c.shard {
        Some(s) => ShardOverride::parse(s, &mesh).map_err(|e| miette!("--shard: {e}"))?,
        None => ShardOverride::default(),
    };
    let grad_dtype = match c.grad_dtype.to_ascii_lowercase().as_str() {
        "f32" | "fp32" | "float32" => hzp_ir::DType::F32,
        "bf16" | "bfloat16" => hzp_ir::DType::BF16,
        "f16" | "fp16" | "float16" => hzp_ir::DType::F16,
        other => {
            return Err(miette!("--grad-dtype {other}: expected f32, bf16 or f16"));
        }
    };
    let max_inflight_bytes = match &c.max_inflight_bytes {
        Some(b) => Some(parse_bytes(b).map_err(|e| miette!("--max-inflight-bytes {b}: {e}"))?),
        None => None,
    };
    let recompute = match c.recompute.to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" => Recompute::On,
        "off" | "false" | "no" => Recompute::Off,
        "auto" => Recompute::Auto,
        other => {
            return Err(miette!("--recompute {other}: expected on, off or auto"));
        }
    };
    let buckets = match c.bucket_mb.trim() {
        "unit" => Buckets::PerUnit,
        n => Buckets::AtMost(
            n.parse::<u64>()
                .ok()
                .and_then(|m| m.checked_mul(1 << 20))
                .ok_or_else(|| miette!("--bucket-mb {n}: expected a number of MiB or `unit`"))?,
        ),
    };
    // Presets are shapes of large models: planned in bf16 unless a precision was asked for
    // (`--precision fp32` keeps fp32).
    if t.precision.is_none() && model.model.starts_with("preset:") {
        cfg.compute = hzp_ir::DType::BF16;
    }
    if stages.contains("training") {
        let step = hzp_passes::train::training_step(&fwd, &cfg).map_err(|e| miette!("{e}"))?;
        show_stage(&stages, "training", || hzp_ir::text::print(&step))?;
    }
    let opts = CompileOptions {
        fingerprint,
        budget,
        verify_budget: true,
        strategy,
        overrides,
        train: cfg,
        loss_spec: Some(crate::commands::loss_spec(t)),
        reduce_grads: ReduceGrads::parse(&c.reduce_grads).map_err(|e| miette!("{e}"))?,
        prefetch_depth: c.prefetch_depth,
        reshard_after_forward: c.reshard_after_forward,
        recompute,
        max_inflight_bytes,
        rewrite: !c.no_rewrite,
        buckets,
        sparse_grads: !c.dense_embedding_grads,
        grad_dtype,
        asyncmesh,
        model_edits: Some(hzp_ir::ModelEdits {
            names: model.names.as_ref().map(|p| p.display().to_string()),
            freeze: crate::commands::flag_list(&t.freeze),
            untie: crate::commands::flag_list(&t.untie),
            retie: t.retie,
        }),
        stage_events: !stages.is_empty(),
        expert_parallel: match c.expert_parallel.as_deref() {
            Some(a) if a.trim().eq_ignore_ascii_case("auto") => None,
            Some(a) => Some(expert_axes(a, &mesh)?),
            None => None,
        },
        choose_expert_parallel: c
            .expert_parallel
            .as_deref()
            .is_some_and(|a| a.trim().eq_ignore_ascii_case("auto")),
        ..CompileOptions::new(model.model.clone(), mesh, cluster)
    };
    Ok(Request {
        fwd,
        opts,
        stages,
        explain: c.explain,
    })
}

/// Runs the library compile driver on a request, printing what `hzp compile` prints along
/// the way (notes, `--explain`, `--print-after` stages, `HZP_PROFILE_COMPILE` timings).
pub fn run_request(r: &Request) -> std::result::Result<Built, CompileError> {
    let mut phases = Phases::new();
    phases.mark("load");
    let rewrite = r.opts.rewrite;
    let compiled = compile_plan(&r.fwd, &r.opts, &mut |ev| {
        let shown = match ev {
            CompileEvent::Note(m) => {
                note!("{m}");
                Ok(())
            }
            CompileEvent::Planned(report) => {
                if r.explain {
                    crate::stdio::out(format_args!("{}\n", planner::explain(report)))
                } else {
                    Ok(())
                }
            }
            CompileEvent::Stage(stage, p) => {
                let mut shown = show_stage(&r.stages, stage, || hzp_ir::text::print(p));
                if shown.is_ok() && stage == "collectives" && !rewrite {
                    shown = show_stage(&r.stages, "rewrite", || {
                        "# collective rewriting is off (--no-rewrite): as after collectives".into()
                    });
                }
                shown
            }
            CompileEvent::Rewritten(report) => {
                if r.explain {
                    crate::stdio::out(format_args!("collective rewriting:\n{report}\n"))
                } else {
                    Ok(())
                }
            }
            CompileEvent::Assembled(plan) => show_stage(&r.stages, "memory", || memory_text(plan)),
            CompileEvent::Phase(what) => {
                phases.mark(what);
                Ok(())
            }
        };
        shown.map_err(|e| e.to_string())
    })?;
    Ok(Built {
        plan: compiled.plan,
        json: compiled.json,
        report: compiled.report,
        peak_by_kind: compiled.peak_by_kind,
        cluster: r.opts.cluster.clone(),
        budget: r.opts.budget,
    })
}

/// Whether any of asyncmesh's flags was given.
pub fn asyncmesh_flags_given(c: &CompileArgs) -> bool {
    c.slow_axis.is_some() || c.sync_every.is_some() || c.sparsity.is_some() || c.ema_beta.is_some()
}

/// The asyncmesh knobs from the flags, checked, for `--strategy asyncmesh`; `None` for the
/// other strategies (`hzp compile` refuses the flags with them, see [`build_plan`]).
fn asyncmesh_options(
    c: &CompileArgs,
    strategy: Strategy,
    mesh: &Mesh,
) -> Result<Option<hzp_passes::dist::asyncmesh::AsyncMeshOptions>> {
    use hzp_passes::dist::asyncmesh::AsyncMeshOptions;
    if strategy != Strategy::AsyncMesh {
        return Ok(None);
    }
    let Some(axis) = &c.slow_axis else {
        return Err(miette!(
            "--strategy asyncmesh needs --slow-axis AXIS (the mesh axis whose ranks are the \
                 replicas, e.g. node for --mesh {mesh})"
        ));
    };
    let o = AsyncMeshOptions {
        slow_axis: axis.trim().to_string(),
        sync_every: c.sync_every.unwrap_or(AsyncMeshOptions::DEFAULT_SYNC_EVERY),
        sparsity: c.sparsity.unwrap_or(AsyncMeshOptions::DEFAULT_SPARSITY),
        ema_beta: c.ema_beta.unwrap_or(AsyncMeshOptions::DEFAULT_EMA_BETA),
    };
    o.validate(mesh).map_err(|e| miette!("{e}"))?;
    Ok(Some(o))
}

/// The passes of `hzp compile` up to a verified plan. `verify_budget`: the verifier also
/// rejects an arena over `--memory`.
pub fn build_plan(
    model: &ModelArgs,
    inputs: Option<&Path>,
    t: &TrainArgs,
    c: &CompileArgs,
    verify_budget: bool,
    want_json: bool,
) -> Result<Built> {
    if asyncmesh_flags_given(c) && Strategy::parse(c.strategy()).ok() != Some(Strategy::AsyncMesh) {
        return Err(miette!(
            "--slow-axis, --sync-every, --sparsity and --ema-beta apply to --strategy \
                 asyncmesh only, not {}",
            c.strategy()
        ));
    }
    let mut r = request(model, inputs, t, c)?;
    r.opts.verify_budget = verify_budget;
    r.opts.want_json = want_json;
    run_request(&r).map_err(|e| miette!("{e}"))
}

pub fn compile(
    model: &ModelArgs,
    inputs: Option<&Path>,
    t: &TrainArgs,
    c: &CompileArgs,
    format: Format,
) -> Result<()> {
    let start = Instant::now();
    let mut ins = crate::files::model_roles(&model.model, "the model");
    ins.extend(inputs.map(|p| ("--inputs".to_string(), p.to_path_buf())));
    ins.extend(c.cluster.clone().map(|p| ("--cluster".to_string(), p)));
    let outs: Vec<(&str, &Path)> = c.output.as_deref().map(|o| ("-o", o)).into_iter().collect();
    crate::files::check_outputs(&outs, &ins)?;
    let read_files: Vec<std::path::PathBuf> = ins.into_iter().map(|(_, p)| p).collect();
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
            let bytes = hzp_passes::dist::collective_bytes(p, n);
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
    report: &planner::PlanReport,
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
        planner::human_seconds(s.predicted_step_s),
        planner::human_seconds(s.predicted_exposed_comm_s)
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

/// Bytes per rank of an ACCO plan's own states, by kind: `est` (the estimate), `grad` (the
/// kept half-batch gradient), `gest` (the reduced half-gradient shard).
fn acco_state_bytes(p: &hzp_ir::Program) -> BTreeMap<&'static str, u64> {
    let mut out: BTreeMap<&'static str, u64> = BTreeMap::new();
    for st in &p.states {
        let v = p.value(st.value);
        let kind = [
            ("acco.est/", "est"),
            ("acco.grad/", "grad"),
            ("acco.gest/", "gest"),
        ]
        .into_iter()
        .find(|(pre, _)| v.name.starts_with(pre));
        if let Some((_, k)) = kind {
            *out.entry(k).or_default() += (v.ty.numel() * v.ty.dtype.size_bytes()) as u64;
        }
    }
    out
}

/// `hzp inspect`'s lines for an ACCO plan.
fn acco_summary(plan: &hzp_ir::Plan) -> Vec<String> {
    let b = acco_state_bytes(&plan.program);
    let get = |k: &str| hzp_ir::plan::format_bytes(b.get(k).copied().unwrap_or(0));
    vec![
        format!(
            "acco: each step is two halves of {} micro-batch(es); each half's reduce-scatter, \
             AdamW and all-gather overlap the other half's compute",
            plan.micro_batches / 2
        ),
        format!(
            "  extra state per rank: estimate {}, kept half-batch gradient {}, reduced \
             half-gradient {}",
            get("est"),
            get("grad"),
            get("gest")
        ),
    ]
}

pub fn inspect(path: &Path, cluster: Option<&Path>, format: Format) -> Result<()> {
    let plan = crate::plan_file::read_plan(path)?;
    let p = &plan.program;
    let persistent = hzp_passes::plan::memory::default_persistent(p);
    let kinds = |v: hzp_ir::ValueId| hzp_passes::compile::buffer_kind(p, v);
    let mem = hzp_passes::plan::memory::plan_memory(p, &kinds, &persistent);
    let cluster = load_cluster(cluster)?;
    cluster
        .validate_mesh(&plan.mesh)
        .map_err(|e| miette!("{e}"))?;
    let per_link = bytes_per_link(p, &plan.mesh, &cluster)?;
    let intra: Vec<String> = hzp_passes::cost::cluster::node_local_group(&plan.mesh, &cluster)
        .axes
        .iter()
        .filter_map(|a| cluster.link_for_axis(a).ok().map(|l| l.name.clone()))
        .collect();
    match format {
        Format::Json => inspect_json(&plan, &mem, &cluster, &per_link),
        Format::Text => inspect_text(path, &plan, &mem, &cluster, &per_link, &intra),
    }
}

/// `hzp inspect --format json`.
fn inspect_json(
    plan: &Plan,
    mem: &MemoryPlan,
    cluster: &ClusterSpec,
    per_link: &[(String, f64)],
) -> Result<()> {
    let p = &plan.program;
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
    let mut v = v;
    if plan.strategy == "acco" {
        v["acco"] = serde_json::json!({
            "micro_batches_per_phase": plan.micro_batches / 2,
            "state_bytes_per_rank": acco_state_bytes(p),
        });
    }
    if let Some(g) = &plan.expert_parallel {
        let (per_rank, total) = expert_numel(plan);
        v["experts"] = serde_json::json!({
            "split_over": g.to_string(),
            "ranks": plan.mesh.size_of(g),
            "weights_per_rank_before_zero": per_rank,
            "weights_total": total,
        });
    }
    if let Some(am) = &plan.asyncmesh {
        let (slow, fast) = hzp_passes::dist::asyncmesh::traffic(p, &am.slow_axis);
        v["asyncmesh"] = serde_json::json!({
            "slow_axis": am.slow_axis,
            "sync_every": am.sync_every,
            "sparsity": am.sparsity,
            "ema_beta": am.ema_beta,
            "slow_axis_bytes_per_step": slow,
            "fast_axes_bytes_per_step": fast,
        });
    }
    if let Some(part) = hzp_passes::train::canzona::of_plan(plan) {
        let owners: BTreeMap<String, usize> = part
            .owners()
            .into_iter()
            .map(|(name, (_, rank, _))| (name, rank))
            .collect();
        v["muon_placement"] = serde_json::json!({
            "placement": "canzona",
            "ranks": part.o,
            "ns_flops_per_rank": part.useful_flops(),
            "ns_flops_executed_per_rank": part.executed_flops(),
            "imbalance_max_over_mean": part.imbalance(),
            "owners": owners,
        });
    }
    outln!("{}", serde_json::to_string_pretty(&v).into_diagnostic()?);
    Ok(())
}

/// The expert weights' elements each rank holds before ZeRO sharding (its experts'
/// slices), and in all.
fn expert_numel(plan: &Plan) -> (u64, u64) {
    plan.layouts
        .iter()
        .filter_map(|l| {
            let n = plan.mesh.size_of(l.expert_group.as_ref()?) as u64;
            Some((l.numel as u64 / n.max(1), l.numel as u64))
        })
        .fold((0, 0), |(a, b), (x, y)| (a + x, b + y))
}

/// `hzp inspect`'s line on expert parallelism, when the plan has it.
fn experts_line(plan: &Plan) -> Option<String> {
    let g = plan.expert_parallel.as_ref()?;
    let (per_rank, total) = expert_numel(plan);
    Some(format!(
        "  experts: split over {g} ({} ranks): each rank computes with {} of the {} expert \
         weights ({:.3} of them) before ZeRO sharding; tokens reach their experts by AllToAll",
        plan.mesh.size_of(g),
        hzp_passes::report::human_count(per_rank),
        hzp_passes::report::human_count(total),
        per_rank as f64 / total.max(1) as f64
    ))
}

/// `hzp inspect`'s text: the plan's header, its AsyncMesh, Canzona and ACCO summaries,
/// memory, collectives, bytes per link class and each stream's nodes.
fn inspect_text(
    path: &Path,
    plan: &Plan,
    mem: &MemoryPlan,
    cluster: &ClusterSpec,
    per_link: &[(String, f64)],
    intra: &[String],
) -> Result<()> {
    let p = &plan.program;
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
    if let Some(line) = experts_line(plan) {
        outln!("{line}");
    }
    if let Some(am) = &plan.asyncmesh {
        let (slow, fast) = hzp_passes::dist::asyncmesh::traffic(p, &am.slow_axis);
        // this rank's fp32 master shards: what the replicas' averaging is a part of
        let master: u64 = plan
            .layouts
            .iter()
            .map(|l| {
                let o = plan.mesh.group_size(&l.optim_group).unwrap_or(1).max(1);
                4 * (l.padded / o) as u64
            })
            .sum();
        outln!(
            "  asyncmesh: replicas along `{}`, sparsity {} per {} step(s), EMA beta {}",
            am.slow_axis,
            am.sparsity,
            am.sync_every,
            am.ema_beta
        );
        outln!(
            "  communication per step (collective payload per rank): over the slow \
         axis `{}` {} ({:.2}% of the rank's {} of fp32 master shards; sparse \
         averaging and the reported loss), over the fast axes {}",
            am.slow_axis,
            hzp_ir::plan::format_bytes(slow),
            100.0 * slow as f64 / master.max(1) as f64,
            hzp_ir::plan::format_bytes(master),
            hzp_ir::plan::format_bytes(fast)
        );
    }
    if let Some(part) = hzp_passes::train::canzona::of_plan(plan) {
        outln!();
        for l in part.describe() {
            outln!("{l}");
        }
    }
    if plan.strategy == "acco" {
        outln!();
        for l in acco_summary(plan) {
            outln!("{l}");
        }
    }
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
    for (l, b) in per_link {
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
    print_streams(p)
}

/// Each stream's nodes in order, with their op and output types (events by number).
fn print_streams(p: &Program) -> Result<()> {
    for stream in [
        StreamKind::Compute,
        StreamKind::AllGather,
        StreamKind::ReduceScatter,
    ] {
        let ops: Vec<&hzp_ir::Node> = p.nodes.iter().filter(|n| n.stream == stream).collect();
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::CompileArgs;
    use clap::Parser;

    /// `for_mesh` gives what the parser gives `hzp compile --mesh M` (a flag added to the
    /// parser with a default, and not to `for_mesh`, fails here).
    #[test]
    fn for_mesh_is_the_parsers_defaults() {
        #[derive(Parser)]
        struct Argv {
            #[command(flatten)]
            c: CompileArgs,
        }
        let parsed = Argv::try_parse_from(["hzp", "--mesh", "node=2,gpu=8"])
            .unwrap()
            .c;
        assert_eq!(
            format!("{parsed:?}"),
            format!("{:?}", CompileArgs::for_mesh("node=2,gpu=8"))
        );
    }
}
