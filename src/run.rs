//! `hzp run`: execute a compiled plan on W ranks: on the CPU as threads of this process, on
//! the GPU as every rank on one GPU (`--ranks-on-one-gpu`), or, under a launcher (`hzp
//! launch`, torchrun, srun), one process per rank on either backend (see `procs`). Every
//! backend is opened as a `PlanExecutor` and driven by the same step loop (`train_loop`).

use crate::plan_file::{apply_plan_edits, load_forward, load_imported, plan_ties, read_plan};
use crate::run_args::RunArgs;
use crate::Format;
use hzp_frontends::npz;
use hzp_ir::plan::Plan;
use hzp_ir::{Group, Op, Tensor};
use hzp_passes::cost::cluster::{
    parse_duration, parse_rate, ClusterSpec, Link, MAX_LINK_LATENCY, MIN_LINK_BANDWIDTH,
};
use hzp_passes::cost::{CollectiveKind, CostModel};
use hzp_runtime::comm::LinkModel;
use hzp_runtime::exec::{CommMode, ExecOptions, Executor};
use hzp_runtime::executor::{PlanExecutor, StepStats, TraceEvent};
use hzp_runtime::watchdog::FlightReport;
use miette::{miette, IntoDiagnostic, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The cluster `--link` starts from (its device is irrelevant: only links are used).
const BASE_CLUSTER: &str = include_str!("../examples/clusters/h100-dgx.toml");

/// A [`LinkModel`] from the cost model: the fastest algorithm's alpha-beta time.
struct CostLinks(CostModel);

impl LinkModel for CostLinks {
    fn duration(&self, op: &Op, group: &Group, bytes: u64) -> Result<Duration, String> {
        let Some(kind) = CollectiveKind::of(op) else {
            return Ok(Duration::ZERO);
        };
        match self.0.best_collective(kind, bytes as f64, group) {
            Ok(c) if c.seconds > 0.0 => Duration::try_from_secs_f64(c.seconds).map_err(|_| {
                format!(
                    "the cost model's time for {bytes} bytes is {} s, not a time to wait (check the link bandwidths and latencies)",
                    c.seconds
                )
            }),
            _ => Ok(Duration::ZERO),
        }
    }
}

/// Builds a cluster whose links are `intra` for the innermost mesh axis and `inter` for the
/// others, from `intra=300GB/s,inter=25GB/s[,latency=5us]`.
pub fn links_from_flag(s: &str, mesh: &hzp_ir::Mesh) -> Result<ClusterSpec> {
    let mut intra = None;
    let mut inter = None;
    let mut latency = 0.0;
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| miette!("--link `{part}` must look like intra=300GB/s"))?;
        match k.trim() {
            "intra" => intra = Some(parse_rate(v.trim()).map_err(|e| miette!("--link: {e}"))?),
            "inter" => inter = Some(parse_rate(v.trim()).map_err(|e| miette!("--link: {e}"))?),
            "latency" => latency = parse_duration(v.trim()).map_err(|e| miette!("--link: {e}"))?,
            other => {
                return Err(miette!(
                    "--link: unknown key `{other}` (expected intra, inter, latency)"
                ))
            }
        }
    }
    let mut spec = ClusterSpec::from_toml_str(BASE_CLUSTER, "examples/clusters/h100-dgx.toml")
        .map_err(|e| miette!("{e}"))?;
    let (last, outer) = mesh
        .axes
        .split_last()
        .ok_or_else(|| miette!("the plan's mesh has no axes"))?;
    let intra = intra.ok_or_else(|| miette!("--link needs intra=RATE (e.g. intra=300GB/s)"))?;
    spec.links = vec![Link {
        name: "intra".into(),
        axes: vec![last.name.clone()],
        bandwidth: intra,
        latency,
        efficiency: 1.0,
    }];
    if !outer.is_empty() {
        let inter = inter.ok_or_else(|| {
            miette!(
                "--link needs inter=RATE: the mesh {mesh} has axes outside `{}`",
                last.name
            )
        })?;
        spec.links.push(Link {
            name: "inter".into(),
            axes: outer.iter().map(|a| a.name.clone()).collect(),
            bandwidth: inter,
            latency,
            efficiency: 1.0,
        });
    }
    for l in &spec.links {
        if !(l.bandwidth.is_finite() && l.bandwidth >= MIN_LINK_BANDWIDTH) {
            return Err(miette!(
                "--link {}={} B/s: a link bandwidth must be a finite number of at least {MIN_LINK_BANDWIDTH} B/s",
                l.name,
                l.bandwidth
            ));
        }
    }
    if !(latency.is_finite() && (0.0..=MAX_LINK_LATENCY).contains(&latency)) {
        return Err(miette!(
            "--link latency={latency} s: a link latency must be between 0 and {MAX_LINK_LATENCY} s (an hour)"
        ));
    }
    spec.mesh = mesh.clone();
    Ok(spec)
}

/// The trained parameters as `--save-params` writes them: with the copies of retied weights
/// under their own names again (as `hzp train --save-params` writes them), when the model
/// can be read.
fn saved_parameters(
    args: &RunArgs,
    plan: &Plan,
    params: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>> {
    let model = args.model.clone().unwrap_or_else(|| plan.model.clone());
    if model.starts_with("preset:") || !Path::new(&model).exists() {
        return Ok(params);
    }
    let fwd = load_forward(&model, plan)?;
    let mut ties = plan_ties(&fwd, plan);
    // PyTorch's ties by the model's name map: every key is written
    let names = plan.model_edits.as_ref().and_then(|e| e.names.as_deref());
    let map = hzp_frontends::names::find_for_model(&model, names.map(Path::new))
        .map_err(|e| miette!("{e}"))?;
    ties.extend(crate::commands::map_ties(map.as_ref()));
    Ok(crate::commands::with_tied_copies(params, &ties, ""))
}

/// The full parameters the plan trains: from `--params`, else from the model (checked
/// against the plan's fingerprint).
fn parameters(args: &RunArgs, plan: &Plan) -> Result<Vec<(String, Tensor)>> {
    if let Some(path) = &args.params {
        let arrays = npz::read(path).map_err(|e| miette!("{e}"))?;
        for l in &plan.layouts {
            match arrays.iter().find(|(k, _)| *k == l.name) {
                None => {
                    return Err(miette!(
                        "{} has no array `{}`, a parameter the plan trains",
                        path.display(),
                        l.name
                    ))
                }
                Some((_, t)) if t.shape != l.shape => {
                    return Err(miette!(
                        "`{}` in {} has shape {:?}; the plan was compiled for {:?}",
                        l.name,
                        path.display(),
                        t.shape,
                        l.shape
                    ))
                }
                _ => {}
            }
        }
        return Ok(arrays);
    }
    let model = args.model.clone().unwrap_or_else(|| plan.model.clone());
    if model.starts_with("preset:") {
        return Err(miette!(
            "the plan was compiled from {model}, which has shapes but no weights: give the parameters with --params P.npz"
        ));
    }
    if args.model.is_none() && !Path::new(&model).exists() {
        return Err(miette!(
            "the plan was compiled from {model}, which is not there (relative paths are read from the current directory): pass --model PATH or --params P.npz"
        ));
    }
    model_parameters(&model, plan)
}

/// The initial parameters of `model` (a file with weights), checked to be the model `plan`
/// was compiled from.
pub(crate) fn model_parameters(model: &str, plan: &Plan) -> Result<Vec<(String, Tensor)>> {
    let mut fwd = load_imported(model, plan)?;
    let found = crate::compile::fingerprint_of(&fwd);
    if !plan.model_fingerprint.is_empty() && found != plan.model_fingerprint {
        return Err(miette!(
            "the plan was compiled for another model: {model} has parameter fingerprint {}..., the plan records {}... (compiled from {}); recompile, or pass --params to run these weights anyway",
            &found[..12.min(found.len())],
            &plan.model_fingerprint[..12.min(plan.model_fingerprint.len())],
            plan.model
        ));
    }
    apply_plan_edits(&mut fwd, plan)?;
    fwd.params
        .iter()
        .map(|p| {
            let name = fwd.value(p.value).name.clone();
            let data = p
                .data
                .clone()
                .ok_or_else(|| miette!("parameter `{name}` of {model} has no data"))?;
            Ok((name, data))
        })
        .collect()
}

fn mean(v: &[Duration]) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.iter().sum::<Duration>() / v.len() as u32
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The MPI launcher this process looks started by, as words, when it is one of several
/// processes: `OMPI_COMM_WORLD_SIZE` (Open MPI) or `PMI_SIZE` (MPICH, Intel MPI) above 1
/// (`hzp launch`, torchrun and srun are read by `procs::discover`).
pub fn launched_by(get: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    for (var, who) in [
        ("OMPI_COMM_WORLD_SIZE", "mpirun"),
        ("PMI_SIZE", "an MPI launcher"),
    ] {
        let Some(v) = get(var) else { continue };
        if v.trim().parse::<u64>().is_ok_and(|n| n > 1) {
            return Some(format!(
                "this process looks started by {who} as one of several ({var}={})",
                v.trim()
            ));
        }
    }
    None
}

/// Steps that count in the summary: all but the first (warm-up) when there are several.
fn measured(stats: &[StepStats]) -> &[StepStats] {
    if stats.len() > 1 {
        &stats[1..]
    } else {
        stats
    }
}

pub fn run(args: &RunArgs) -> Result<()> {
    let cuda = match args.backend.as_str() {
        "cpu" => false,
        "cuda" => true,
        other => return Err(miette!("unknown backend `{other}` (expected cpu or cuda)")),
    };
    let get = |k: &str| std::env::var(k).ok();
    if let Some(why) = launched_by(&get) {
        if crate::procs::discover(&get).ok().flatten().is_none() {
            return Err(miette!(
                "{why}; hzp reads the variables of `hzp launch`, torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and srun, not MPI's: start the processes with one of those"
            ));
        }
    }
    let dist = crate::procs::discover(&get).map_err(|e| miette!("{e}"))?;
    check_backend_flags(args, cuda)?;
    let comm = match args.comm.as_str() {
        "async" => CommMode::Async,
        "sync" => CommMode::Sync,
        other => return Err(miette!("--comm `{other}`: expected async or sync")),
    };
    let timeout = hzp_runtime::watchdog::parse_timeout(&args.collective_timeout)
        .map_err(|e| miette!("--collective-timeout {e}"))?;
    let fault = hzp_runtime::watchdog::Fault::from_env().map_err(|e| miette!("{e}"))?;
    if cuda && fault.is_some() {
        return Err(miette!(
            "HZP_FAULT injects faults into the CPU backend only; unset it for --backend cuda"
        ));
    }
    let plan = read_plan(&args.plan)?;
    let link = link_model(args, &plan)?;
    let outs = checked_outputs(args, &plan)?;
    let fixed = fixed_batch(args, &plan)?;
    let lr_max = args.lr.or(plan.lr).ok_or_else(|| {
        miette!("the plan records no learning rate (compiled by an older hzp?): pass --lr")
    })?;
    let schedule = args.session.schedule(lr_max, args.steps)?;
    let params = parameters(args, &plan)?;
    let plain = args.session.is_plain()
        && args.checkpoint_dir.is_none()
        && !args.resume
        && args.stop_at.is_none()
        && args.lr.is_none();
    let text = args.format == Format::Text;
    let mut procs = match &dist {
        None => None,
        Some(env) => {
            if args.trace.is_some() {
                return Err(miette!(
                    "--trace writes every rank's timeline from one process; under a launcher each process runs one rank: run the plan once without a launcher to trace it"
                ));
            }
            if args.ranks_on_one_gpu {
                return Err(miette!(
                    "--ranks-on-one-gpu runs every rank of the plan in this one process, but a launcher started it as rank {} of {}: start one process without a launcher",
                    env.rank,
                    env.world_size
                ));
            }
            let w = plan.mesh.world_size();
            if env.world_size != w {
                return Err(miette!(
                    "the launcher started {} processes (rank {} of {}), but the plan's mesh {} has {w} rank{}: start one process per rank (e.g. `hzp launch --nproc-per-node {w} -- run ...`)",
                    env.world_size,
                    env.rank,
                    env.world_size,
                    plan.mesh,
                    if w == 1 { "" } else { "s" }
                ));
            }
            if env.rank != 0 {
                // rank 0 reports the run
                crate::stdio::quiet();
            }
            Some(crate::procs::Procs::connect(env, &plan, timeout)?)
        }
    };
    let ropts = cuda_run_options(args, cuda, comm, timeout)?;
    let mut ex: Box<dyn PlanExecutor> = if let Some(ropts) = &ropts {
        open_cuda(
            args,
            &plan,
            &params,
            ropts,
            dist.as_ref(),
            procs.as_mut(),
            timeout,
        )?
    } else {
        let opts = exec_options(args, comm, link, timeout, fault);
        Box::new(
            match procs.as_mut() {
                None => Executor::new(&plan, &params, opts),
                Some(p) => Executor::new_process(&plan, &params, opts, &mut p.rv),
            }
            .map_err(|e| miette!("{e}"))?,
        )
    };
    let ex = ex.as_mut();
    let stats = if plain {
        let batch = hzp_passes::train::with_lr(&plan.program, &fixed, lr_max);
        ex.set_inputs(&batch).map_err(|e| {
            miette!(
                "{}: {e}",
                args.inputs.as_deref().unwrap_or(Path::new("")).display()
            )
        })?;
        let r = ex.run(args.steps).map_err(|e| miette!("{e}"));
        flight_on_error(r, ex, args)?
    } else {
        // the loop prints a line per step as it goes: the header comes first
        if text {
            outln!("{}", run_header(args, &plan, ex, "running"));
        }
        let oe = |p: &Plan, prm: &[(String, Tensor)]| open_eval(ropts.as_ref(), p, prm);
        let (sched, pr) = (&schedule, procs.as_mut());
        let r = crate::train_loop::run_loop(args, &plan, ex, &fixed, sched, &oe, pr);
        flight_on_error(r, ex, args)?
    };

    if text {
        if plain {
            outln!("{}", run_header(args, &plan, ex, "ran"));
            for s in &stats {
                outln!(
                    "step {:>4}  loss {}  ({:.1} ms)",
                    s.step,
                    s.loss.map_or("-".to_string(), |l| format!("{l:.6}")),
                    ms(s.wall)
                );
            }
        }
        if stats.is_empty() {
            return Ok(());
        }
        print_step_summary(&stats)?;
    }
    let saved = write_run_outputs(args, &plan, ex, &outs, text, procs.as_mut())?;
    if !text {
        print_run_json(args, &plan, &stats, saved)?;
    }
    Ok(())
}

/// Options of one backend given to the other are refused, naming the backend they belong to.
fn check_backend_flags(args: &RunArgs, cuda: bool) -> Result<()> {
    if cuda {
        if args.emulate_links.is_some() || args.link.is_some() || args.trace.is_some() {
            return Err(miette!(
                "--emulate-links, --link and --trace are options of the CPU backend"
            ));
        }
        return Ok(());
    }
    if args.attention.is_some() {
        return Err(miette!(
            "--attention chooses the CUDA backend's attention kernels; the CPU backend runs its own (drop --attention or use --backend cuda)"
        ));
    }
    if args.fuse_elementwise {
        return Err(miette!(
            "--fuse-elementwise fuses the CUDA backend's kernels; the CPU backend runs each node with its own kernel (drop it or use --backend cuda)"
        ));
    }
    if args.no_cuda_graph {
        return Err(miette!(
            "--no-cuda-graph is an option of --backend cuda (the CPU backend captures no graphs)"
        ));
    }
    if args.ranks_on_one_gpu {
        return Err(miette!(
            "--ranks-on-one-gpu is an option of --backend cuda (the CPU backend always runs every rank in this process)"
        ));
    }
    Ok(())
}

/// How the CUDA executors run (`None` on the CPU backend).
fn cuda_run_options(
    args: &RunArgs,
    cuda: bool,
    comm: CommMode,
    timeout: Duration,
) -> Result<Option<hzp_runtime::cuda::RunOptions>> {
    if !cuda {
        return Ok(None);
    }
    Ok(Some(hzp_runtime::cuda::RunOptions {
        lower: cuda_lower_options(args.attention.as_deref(), args.fuse_elementwise)?,
        comm,
        timeout,
        graphs: !args.no_cuda_graph && hzp_runtime::cuda::graph::from_env(),
    }))
}

/// The executor an evaluation plan (`--val-data`) runs on: the CPU executor, or with
/// `--backend cuda` (`ropts`) the GPU: its one rank on device 0 of those this process sees
/// (one process per GPU: rank 0's process evaluates).
fn open_eval(
    ropts: Option<&hzp_runtime::cuda::RunOptions>,
    plan: &Plan,
    params: &[(String, Tensor)],
) -> Result<Box<dyn PlanExecutor>> {
    match ropts {
        Some(o) => hzp_runtime::cuda::open_one_gpu(plan, params, o)
            .map_err(|e| miette!("evaluation on the GPU: {e}")),
        None => Ok(Box::new(
            Executor::new(plan, params, ExecOptions::default())
                .map_err(|e| miette!("evaluation: {e}"))?,
        )),
    }
}

/// `--backend cuda`: every rank on this machine's one GPU (`--ranks-on-one-gpu`), or this
/// process's rank on its GPU, NCCL between the processes `procs` connects (a group of one
/// without a launcher). Without the libraries, or in a build without the `cuda` feature, the
/// runtime says which.
fn open_cuda(
    args: &RunArgs,
    plan: &Plan,
    params: &[(String, Tensor)],
    ropts: &hzp_runtime::cuda::RunOptions,
    dist: Option<&hzp_runtime::cuda::rendezvous::DistEnv>,
    procs: Option<&mut crate::procs::Procs>,
    timeout: Duration,
) -> Result<Box<dyn PlanExecutor>> {
    use hzp_runtime::cuda::rendezvous::{DistEnv, Rendezvous};
    if args.ranks_on_one_gpu {
        return hzp_runtime::cuda::open_one_gpu(plan, params, ropts).map_err(|e| miette!("{e}"));
    }
    let single = DistEnv::single();
    let env = dist.unwrap_or(&single);
    let mut alone;
    let rv = match procs {
        Some(p) => &mut p.rv,
        None => {
            alone = Rendezvous::connect(env, timeout).map_err(|e| miette!("{e}"))?;
            &mut alone
        }
    };
    hzp_runtime::cuda::open_process(plan, params, ropts, env, rv).map_err(|e| miette!("{e}"))
}

/// What `hzp compare --run-steps` measures of one plan.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Measured {
    pub steps: usize,
    /// Mean wall time of a step (the first, a warm-up, left out when there are several).
    pub step_s: f64,
    /// Mean time per step the compute thread waited on communication (same steps).
    pub exposed_comm_s: f64,
    /// The loss of rank 0 at the first and the last step.
    pub first_loss: Option<f64>,
    pub last_loss: Option<f64>,
}

/// Runs `plan` for `steps` steps on this machine's CPU (its ranks as threads, comm streams
/// on background threads, as `hzp run` does) on one fixed `batch`, from the initial weights
/// of `model`, with collectives slowed to the links of `link` (`hzp run --link`) when given.
pub(crate) fn measure_plan(
    plan: &Plan,
    model: &str,
    batch: &[(String, Tensor)],
    steps: usize,
    link: Option<&str>,
) -> Result<Measured> {
    let params = model_parameters(model, plan)?;
    hzp_runtime::index_check::check_index_inputs(&plan.program, batch)
        .map_err(|e| miette!("{e}"))?;
    let link = link
        .map(|s| cost_links(links_from_flag(s, &plan.mesh)?, plan))
        .transpose()?;
    let lr = plan
        .lr
        .ok_or_else(|| miette!("the plan records no learning rate"))?;
    let opts = ExecOptions {
        comm: CommMode::Async,
        link,
        trace: false,
        collective_timeout: Some(Duration::from_secs(300)),
        fault: None,
        on_stuck: None,
        flight_capacity: 0,
    };
    let mut ex = Executor::new(plan, &params, opts).map_err(|e| miette!("{e}"))?;
    let inputs = hzp_passes::train::with_lr(&plan.program, batch, lr);
    ex.set_inputs(&inputs).map_err(|e| miette!("{e}"))?;
    let stats = ex.run(steps).map_err(|e| miette!("{e}"))?;
    let m = measured(&stats);
    let n = m.len().max(1) as f64;
    Ok(Measured {
        steps: stats.len(),
        step_s: m.iter().map(|s| s.wall.as_secs_f64()).sum::<f64>() / n,
        exposed_comm_s: m.iter().map(|s| s.exposed_comm.as_secs_f64()).sum::<f64>() / n,
        first_loss: stats.first().and_then(|s| s.loss),
        last_loss: stats.last().and_then(|s| s.loss),
    })
}

/// `--emulate-links` or `--link`: the link model collectives are slowed down to.
fn link_model(args: &RunArgs, plan: &Plan) -> Result<Option<Arc<dyn LinkModel>>> {
    Ok(match (&args.emulate_links, &args.link) {
        (Some(path), _) => Some(cost_links(
            ClusterSpec::load(path).map_err(|e| miette!("{e}"))?,
            plan,
        )?),
        (None, Some(s)) => Some(cost_links(links_from_flag(s, &plan.mesh)?, plan)?),
        (None, None) => None,
    })
}

/// Collectives slowed to what the cost model gives on `spec`'s links for the plan's mesh.
fn cost_links(spec: ClusterSpec, plan: &Plan) -> Result<Arc<dyn LinkModel>> {
    let cm = CostModel::new(spec, plan.mesh.clone()).map_err(|e| miette!("{e}"))?;
    Ok(Arc::new(CostLinks(cm)))
}

/// The files `hzp run` reads, each with its role: the plan, the model it names (or
/// `--model`) with its sidecars, `--inputs`, `--params`, the token files, `--emulate-links`
/// and, with `--checkpoint-dir`, every checkpoint folder there (one may be resumed).
fn run_inputs(args: &RunArgs, plan: &Plan) -> Vec<(String, PathBuf)> {
    let mut ins: Vec<(String, PathBuf)> = vec![("the plan".into(), args.plan.clone())];
    match &args.model {
        Some(m) => ins.extend(crate::files::model_roles(m, "--model")),
        None => ins.extend(crate::files::model_roles(
            &plan.model,
            "the model the plan names",
        )),
    }
    let flag = |f: &str, p: &Option<PathBuf>| p.clone().map(|p| (f.to_string(), p));
    ins.extend(flag("--inputs", &args.inputs));
    ins.extend(flag("--params", &args.params));
    ins.extend(flag("--data", &args.session.data));
    ins.extend(flag("--val-data", &args.session.val_data));
    ins.extend(flag("--emulate-links", &args.emulate_links));
    if let Some(dir) = &args.checkpoint_dir {
        if let Ok(steps) = hzp_runtime::checkpoint::list(dir) {
            for (_, p) in steps {
                ins.push(("a checkpoint in --checkpoint-dir".into(), p));
            }
        }
    }
    ins
}

/// Checks, before any work, that no file `hzp run` writes is one it reads (or lies inside
/// a checkpoint of `--checkpoint-dir`) and that no two of its outputs share a path; returns
/// the files it reads.
fn checked_outputs(args: &RunArgs, plan: &Plan) -> Result<Vec<PathBuf>> {
    let ins = run_inputs(args, plan);
    let mut outs: Vec<(&str, &Path)> = Vec::new();
    outs.extend(args.save_params.as_deref().map(|p| ("--save-params", p)));
    outs.extend(args.trace.as_deref().map(|p| ("--trace", p)));
    outs.extend(args.session.log.as_deref().map(|p| ("--log", p)));
    crate::files::check_outputs(&outs, &ins)?;
    if let Some(dir) = &args.checkpoint_dir {
        for (role, p) in &outs {
            if crate::files::same_path(dir, p) {
                return Err(miette!(
                    "{role} {} is also --checkpoint-dir; give it a path of its own",
                    p.display()
                ));
            }
        }
        if let Ok(m) = std::fs::metadata(dir) {
            if !m.is_dir() {
                return Err(miette!(
                    "--checkpoint-dir {}: exists and is not a folder",
                    dir.display()
                ));
            }
        }
    }
    if let Some(dir) = &args.flight_recorder {
        for (role, p) in &ins {
            if crate::files::same_path(p, dir) || crate::files::inside(p, dir) {
                return Err(miette!(
                    "--flight-recorder {} is {role} ({}) or holds it; give the flight records a folder of their own",
                    dir.display(),
                    p.display()
                ));
            }
        }
    }
    Ok(ins.into_iter().map(|(_, p)| p).collect())
}

/// The batch of `--inputs` (empty with `--data` alone), its token ids and labels checked.
fn fixed_batch(args: &RunArgs, plan: &Plan) -> Result<Vec<(String, Tensor)>> {
    if args.inputs.is_none() && args.session.data.is_none() {
        return Err(miette!(
            "hzp run needs the batch: --inputs IN.npz (the same batch every step) or --data TOKENS.bin"
        ));
    }
    let fixed = match &args.inputs {
        Some(p) => npz::read(p).map_err(|e| miette!("{e}"))?,
        None => Vec::new(),
    };
    // Token ids and labels in range, for every backend (the row-exchanged embedding
    // gradient relies on it as much as the lookup does); --data checks its own.
    if let Some(path) = &args.inputs {
        hzp_runtime::index_check::check_index_inputs(&plan.program, &fixed)
            .map_err(|e| miette!("{}: {e}", path.display()))?;
    }
    Ok(fixed)
}

/// The CPU executor's options; threads that ignore an abort get the flight report
/// printed (and written to `--flight-recorder`), then the process ends.
fn exec_options(
    args: &RunArgs,
    comm: CommMode,
    link: Option<Arc<dyn LinkModel>>,
    timeout: Duration,
    fault: Option<hzp_runtime::watchdog::Fault>,
) -> ExecOptions {
    let recorder_dir = args.flight_recorder.clone();
    ExecOptions {
        comm,
        link,
        trace: args.trace.is_some(),
        collective_timeout: Some(timeout),
        fault,
        on_stuck: Some(Arc::new(move |report: &FlightReport| {
            // threads that ignore the abort: report, then end the process (nothing else can)
            emit_flight_report(report, recorder_dir.as_deref());
            note!("error: {}", report.reason);
            std::process::exit(EXIT_STUCK);
        })),
        flight_capacity: 0,
    }
}

/// The first line of the text report: `{verb} PLAN (model on mesh, W ranks, ...)`.
fn run_header(args: &RunArgs, plan: &Plan, ex: &dyn PlanExecutor, verb: &str) -> String {
    let w = plan.mesh.world_size();
    format!(
        "{verb} {} ({} on {}, {w} rank{}, strategy {}{}) on {}, communication {}{}",
        args.plan.display(),
        plan.model,
        plan.mesh,
        if w == 1 { "" } else { "s" },
        plan.strategy,
        match &plan.asyncmesh {
            Some(a) => format!(
                ": replicas along {}, sparsity {} per {} step(s), EMA beta {}; the \
                 parameters saved and evaluated are the replicas' mean",
                a.slow_axis, a.sparsity, a.sync_every, a.ema_beta
            ),
            None => String::new(),
        },
        ex.device(),
        args.comm,
        match (&args.emulate_links, &args.link) {
            (Some(p), _) => format!(", links emulated from {}", p.display()),
            (None, Some(s)) => format!(", links emulated at {s}"),
            _ => String::new(),
        }
    )
}

/// The text summary of the measured steps: per stream busy time, step time, exposed
/// communication.
fn print_step_summary(stats: &[StepStats]) -> Result<()> {
    let m = measured(stats);
    let wall = mean(&m.iter().map(|s| s.wall).collect::<Vec<_>>());
    outln!(
        "per step, mean over {} step{}{} and the ranks:",
        m.len(),
        if m.len() == 1 { "" } else { "s" },
        if stats.len() > 1 {
            " (the first, warm-up, left out)"
        } else {
            ""
        }
    );
    outln!("  {:<16} {:>10}  {:>7}", "stream", "busy ms", "of step");
    for (k, s) in hzp_ir::StreamKind::ALL.iter().enumerate() {
        let b = mean(&m.iter().map(|x| x.busy[k]).collect::<Vec<_>>());
        outln!(
            "  {:<16} {:>10.3}  {:>6.1}%",
            s.name(),
            ms(b),
            100.0 * b.as_secs_f64() / wall.as_secs_f64().max(1e-12)
        );
    }
    let comm_t = mean(&m.iter().map(|x| x.comm()).collect::<Vec<_>>());
    let exposed = mean(&m.iter().map(|x| x.exposed_comm).collect::<Vec<_>>());
    outln!("  step time        {:>10.3} ms", ms(wall));
    if exposed <= comm_t {
        outln!(
            "  exposed communication {:.3} ms ({:.1}% of communication time {:.3} ms)",
            ms(exposed),
            100.0 * exposed.as_secs_f64() / comm_t.as_secs_f64().max(1e-12),
            ms(comm_t)
        );
    } else {
        // The compute stream waited on comm streams that were themselves waiting (for
        // other ranks, or on compute): a share of their busy time would exceed 100%.
        outln!(
            "  exposed communication {:.3} ms (compute waited on the comm streams longer than their busy time {:.3} ms: they were waiting too, for other ranks or on compute)",
            ms(exposed),
            ms(comm_t)
        );
    }
    Ok(())
}

/// `--save-params` and `--trace`; returns how many parameters were saved.
fn write_run_outputs(
    args: &RunArgs,
    plan: &Plan,
    ex: &dyn PlanExecutor,
    outs: &[PathBuf],
    text: bool,
    procs: Option<&mut crate::procs::Procs>,
) -> Result<Option<usize>> {
    let mut saved = None;
    if let Some(out) = &args.save_params {
        let params = match procs {
            None => ex.parameters().map_err(|e| miette!("{e}"))?,
            Some(p) => {
                let all = p.parameters(ex)?;
                if p.rank() != 0 {
                    // rank 0 writes the file
                    return Ok(None);
                }
                all
            }
        };
        let p = saved_parameters(args, plan, params)?;
        crate::files::write_params(out, outs, &p)?;
        saved = Some(p.len());
        if text {
            outln!("saved {} parameters to {}", p.len(), out.display());
        }
    }
    if let Some(out) = &args.trace {
        let json = trace_json(ex, ex.trace());
        crate::files::write_bytes(out, outs, json.as_bytes())?;
        if text {
            outln!(
                "wrote a trace of {} node runs to {}",
                ex.trace().len(),
                out.display()
            );
        }
    }
    Ok(saved)
}

/// The `--format json` report of a CPU run.
fn print_run_json(
    args: &RunArgs,
    plan: &Plan,
    stats: &[StepStats],
    saved: Option<usize>,
) -> Result<()> {
    let m = measured(stats);
    let secs = |f: &dyn Fn(&StepStats) -> Duration| -> Vec<f64> {
        stats.iter().map(|s| f(s).as_secs_f64()).collect()
    };
    let mut streams = BTreeMap::new();
    for (k, s) in hzp_ir::StreamKind::ALL.iter().enumerate() {
        streams.insert(s.name(), secs(&|x: &StepStats| x.busy[k]));
    }
    let v = serde_json::json!({
        "plan": args.plan.display().to_string(),
        "model": plan.model,
        "strategy": plan.strategy,
        "mesh": plan.mesh.to_string(),
        "world_size": plan.mesh.world_size(),
        "backend": args.backend,
        "comm": args.comm,
        "steps": args.steps,
        "losses": stats.iter().map(|s| s.loss).collect::<Vec<_>>(),
        "step_seconds": secs(&|x: &StepStats| x.wall),
        "busy_seconds": streams,
        "comm_seconds": secs(&|x: &StepStats| x.comm()),
        "exposed_comm_seconds": secs(&|x: &StepStats| x.exposed_comm),
        "summary": {
            "steps_measured": m.len(),
            "step_seconds": mean(&m.iter().map(|s| s.wall).collect::<Vec<_>>()).as_secs_f64(),
            "comm_seconds": mean(&m.iter().map(|s| s.comm()).collect::<Vec<_>>()).as_secs_f64(),
            "exposed_comm_seconds": mean(&m.iter().map(|s| s.exposed_comm).collect::<Vec<_>>()).as_secs_f64(),
        },
        "saved_parameters": saved,
    });
    outln!("{}", serde_json::to_string_pretty(&v).into_diagnostic()?);
    Ok(())
}

/// Exit code when threads of a failed run do not stop (a hang the watchdog found).
pub const EXIT_STUCK: i32 = 3;

/// Entries of each rank's flight record printed on failure (the files hold them all).
const PRINTED_ENTRIES: usize = 12;

/// Prints the flight report on stderr and writes it to `dir`.
pub fn emit_flight_report(report: &FlightReport, dir: Option<&Path>) {
    note!("{}", report.summary(PRINTED_ENTRIES).trim_end());
    if let Some(dir) = dir {
        match report.write_dir(dir) {
            Ok(files) => note!(
                "flight recorder: wrote {} file{} to {}",
                files.len(),
                if files.len() == 1 { "" } else { "s" },
                dir.display()
            ),
            Err(e) => note!("flight recorder: {e}"),
        }
    }
}

/// On a failed run, the executor's flight report goes out before the error.
fn flight_on_error<T>(r: Result<T>, ex: &dyn PlanExecutor, args: &RunArgs) -> Result<T> {
    if r.is_err() {
        if let Some(report) = ex.flight_report() {
            emit_flight_report(&report, args.flight_recorder.as_deref());
        }
    }
    r
}

/// The CUDA lowering `--attention` and `--fuse-elementwise` ask for (otherwise
/// [`LowerOptions::from_env`], which reads `HZP_CUDA_ATTENTION` and `HZP_CUDA_FUSE`).
///
/// [`LowerOptions::from_env`]: hzp_runtime::cuda::lower::LowerOptions::from_env
pub(crate) fn cuda_lower_options(
    attention: Option<&str>,
    fuse: bool,
) -> Result<hzp_runtime::cuda::lower::LowerOptions> {
    use hzp_runtime::cuda::lower::{CudaAttention, LowerOptions};
    let mut o = LowerOptions::from_env();
    o.fuse |= fuse;
    match attention {
        None => {}
        Some("flash") => o.attention = CudaAttention::Flash,
        Some("pasa") => o.attention = CudaAttention::Pasa,
        Some(other) => return Err(miette!("--attention `{other}`: expected flash or pasa")),
    }
    Ok(o)
}

/// Chrome Trace Event JSON: one complete ("X") event per node run, pid = rank, tid =
/// stream (0 compute, 1 all-gather, 2 reduce-scatter), microseconds; args name the node, its
/// op and the bytes it wrote (a collective: the bytes the cost model counts).
pub fn trace_json(ex: &dyn PlanExecutor, events: &[TraceEvent]) -> String {
    let p = ex.program();
    let world = ex.mesh().world_size();
    let mut list = Vec::with_capacity(events.len() + 4 * world);
    for r in 0..world {
        list.push(serde_json::json!({
            "name": "process_name", "ph": "M", "pid": r, "tid": 0,
            "args": {"name": format!("rank {r}")}
        }));
        for (k, s) in hzp_ir::StreamKind::ALL.iter().enumerate() {
            list.push(serde_json::json!({
                "name": "thread_name", "ph": "M", "pid": r, "tid": k,
                "args": {"name": s.name()}
            }));
        }
    }
    for e in events {
        let n = &p.nodes[e.node];
        let out_bytes: u64 = n.outputs.iter().map(|&o| p.ty(o).size_bytes() as u64).sum();
        let bytes = if n.op.is_collective() {
            let ib = n.inputs.first().map_or(0, |&i| p.ty(i).size_bytes());
            hzp_runtime::comm::collective_bytes(&n.op, ib, out_bytes as usize)
        } else {
            out_bytes
        };
        list.push(serde_json::json!({
            "name": n.name,
            "cat": n.op.name(),
            "ph": "X",
            "ts": e.start.as_secs_f64() * 1e6,
            "dur": e.dur.as_secs_f64() * 1e6,
            "pid": e.rank,
            "tid": e.stream.index(),
            "args": {"node": n.name, "op": n.op.name(), "bytes": bytes, "step": e.step},
        }));
    }
    let v = serde_json::json!({ "traceEvents": list, "displayTimeUnit": "ms" });
    let mut s = serde_json::to_string(&v).unwrap_or_default();
    s.push('\n');
    s
}
