//! `hzp simulate`, `hzp compare` and `hzp scale`: predictions of the discrete-event simulator
//! ([`hzp_passes::simulate`]) for a plan, for several strategies, and for several world sizes.

use crate::compile::{request, run_request, Built, CompileArgs};
use crate::{Format, ModelArgs, TrainArgs};
use clap::ValueEnum;
use hzp_ir::plan::format_bytes;
use hzp_ir::trace::Trace;
use hzp_ir::Mesh;
use hzp_passes::compile::CompileError;
use hzp_passes::cost::cluster::{parse_bytes, ClusterSpec};
use hzp_passes::cost::Algorithm;
use hzp_passes::plan::planner::ShardOverride;
use hzp_passes::plan::planner::Strategy;
use hzp_passes::simulate::{self, SimOptions, Simulation};
use indicatif::{ProgressBar, ProgressStyle};
use miette::{miette, IntoDiagnostic, Result};
use rayon::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// The AsyncHZP paper's reported weak-scaling linearity from 256 to 1024 ranks (Bai et al.,
/// arXiv:2510.20111), measured on its own hardware: a reference figure, not ours.
const PAPER_LINEARITY_256_1024: f64 = 0.9112;

/// Output formats of `compare` and `scale`.
#[derive(Clone, Copy, Debug, Default, ValueEnum, PartialEq, Eq)]
pub enum TableFormat {
    #[default]
    Text,
    Json,
    Markdown,
}

/// How collectives are modeled.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SimFlags {
    /// Algorithm of every collective: ring, tree or hierarchical (default: the fastest for
    /// each, as the planner assumes).
    #[arg(long, value_parser = crate::choices(&[("ring", &[]), ("tree", &[]), ("hierarchical", &[]), ("best", &[])]))]
    pub algorithm: Option<String>,
    /// Let concurrent transfers on one link class use its full bandwidth each (default: they
    /// share it fairly).
    #[arg(long)]
    pub no_sharing: bool,
}

impl SimFlags {
    fn options(&self) -> Result<SimOptions> {
        let algorithm = match self.algorithm.as_deref() {
            None | Some("best") => None,
            Some(a) => Some(
                Algorithm::ALL
                    .into_iter()
                    .find(|x| x.name() == a)
                    .ok_or_else(|| {
                        miette!("--algorithm {a}: expected ring, tree, hierarchical or best")
                    })?,
            ),
        };
        Ok(SimOptions {
            algorithm,
            no_sharing: self.no_sharing,
            ..SimOptions::default()
        })
    }
}

/// Flags of `hzp simulate`.
#[derive(clap::Args, Clone, Debug)]
pub struct SimulateArgs {
    /// A plan written by `hzp compile -o`.
    pub plan: PathBuf,
    /// Cluster spec (TOML; see examples/clusters/). Default: the 8xH100 DGX spec.
    #[arg(long, value_name = "SPEC.toml")]
    pub cluster: Option<PathBuf>,
    /// Write the predicted timeline as a Chrome trace (open in Perfetto or chrome://tracing).
    #[arg(long, value_name = "SIM.json")]
    pub trace: Option<PathBuf>,
    /// Ranks written to the trace (every rank has the same timeline). Default: up to 4.
    #[arg(long, default_value_t = 4)]
    pub trace_ranks: usize,
    /// Write a Gantt chart of one rank's streams (SVG).
    #[arg(long, value_name = "T.svg")]
    pub timeline: Option<PathBuf>,
    /// Write a plot of memory over the step, per buffer kind (SVG).
    #[arg(long, value_name = "MEM.svg")]
    pub memory_plot: Option<PathBuf>,
    /// A trace written by `hzp run --trace`: use its measured node times and report how far
    /// the analytical prediction was.
    #[arg(long, value_name = "RUN.json")]
    pub calibrate: Option<PathBuf>,
    /// Run every node one at a time in issue order (no overlap): the no-overlap baseline.
    #[arg(long)]
    pub serialize: bool,
    #[command(flatten)]
    pub sim: SimFlags,
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

fn write_file(path: &Path, text: &str, inputs: &[&Path]) -> Result<()> {
    crate::files::write_bytes(path, inputs, text.as_bytes())
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

fn secs(s: f64) -> String {
    hzp_passes::simulate::svg::fmt_time(s)
}

fn bytes_f(b: f64) -> String {
    format_bytes(b.max(0.0).round() as u64)
}

/// The strategies `hzp compare` compares unless told.
const DEFAULT_STRATEGIES: &str = "asynchzp,zero3,hsdp,ddp";

/// The summary `hzp simulate --format json` prints (the per-node timings stay in the trace).
#[derive(Serialize)]
struct SimSummary<'a> {
    model: &'a str,
    strategy: &'a str,
    cluster: &'a str,
    mesh: &'a str,
    world_size: usize,
    serialized: bool,
    step_time_s: f64,
    critical_path_s: f64,
    compute_busy_s: f64,
    allgather_busy_s: f64,
    reducescatter_busy_s: f64,
    exposed_comm_s: f64,
    exposed_comm_fraction: f64,
    compute_wait_s: f64,
    tail_s: f64,
    mfu: f64,
    model_flops: f64,
    hardware_flops: f64,
    peak_flops: f64,
    tokens_per_rank: u64,
    token_source: &'a str,
    tokens_per_s: f64,
    peak_memory_bytes: u64,
    peak_memory_time_s: f64,
    peak_memory_by_kind: &'a BTreeMap<String, u64>,
    issue_order_peak_bytes: u64,
    arena_bytes: u64,
    /// The cluster's memory per device.
    device_memory_bytes: u64,
    /// Whether the plan's arena fits the cluster's device memory.
    fits: bool,
    /// Why it does not fit (absent when it does).
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
    links: &'a [simulate::LinkUsage],
    #[serde(skip_serializing_if = "Option::is_none")]
    calibration: Option<&'a simulate::Calibration>,
}

/// Whether a plan's arena fits the device memory: `None` when it does, else why not.
fn device_fit(arena: u64, s: &Simulation, spec: &ClusterSpec) -> Option<String> {
    let device = spec.device.memory_bytes;
    (arena > device).then(|| {
        format!(
            "does not fit: the plan's arena is {} per rank > the {} of device memory of cluster {} (recompile with --memory {} or less, or another strategy)",
            format_bytes(arena),
            format_bytes(device),
            s.cluster,
            format_bytes(device)
        )
    })
}

fn sim_summary<'a>(
    s: &'a Simulation,
    calibration: Option<&'a simulate::Calibration>,
    device_memory_bytes: u64,
    note: Option<String>,
) -> SimSummary<'a> {
    SimSummary {
        device_memory_bytes,
        fits: note.is_none(),
        note,
        model: &s.model,
        strategy: &s.strategy,
        cluster: &s.cluster,
        mesh: &s.mesh,
        world_size: s.world_size,
        serialized: s.serialized,
        step_time_s: s.step_s,
        critical_path_s: s.critical_path_s,
        compute_busy_s: s.stream_busy_s[0],
        allgather_busy_s: s.stream_busy_s[1],
        reducescatter_busy_s: s.stream_busy_s[2],
        exposed_comm_s: s.exposed_comm_s,
        exposed_comm_fraction: s.exposed_comm_fraction(),
        compute_wait_s: s.compute_wait_s,
        tail_s: s.tail_s,
        mfu: s.mfu,
        model_flops: s.model_flops,
        hardware_flops: s.hardware_flops,
        peak_flops: s.peak_flops,
        tokens_per_rank: s.tokens_per_rank,
        token_source: &s.token_source,
        tokens_per_s: s.tokens_per_s,
        peak_memory_bytes: s.memory.peak_bytes,
        peak_memory_time_s: s.memory.peak_time_s,
        peak_memory_by_kind: &s.memory.peak_by_kind,
        issue_order_peak_bytes: s.memory.planned_peak_bytes,
        arena_bytes: s.memory.arena_bytes,
        links: &s.links,
        calibration,
    }
}

fn print_sim(s: &Simulation, device: u64, note: Option<&str>) -> Result<()> {
    let frac = |x: f64| {
        if s.step_s > 0.0 {
            pct(x / s.step_s)
        } else {
            "-".into()
        }
    };
    outln!(
        "simulated step: {} / {} on {} ({} ranks), cluster {}{}",
        s.model,
        s.strategy,
        s.mesh,
        s.world_size,
        s.cluster,
        if s.serialized {
            " [serialized: one node at a time]"
        } else {
            ""
        }
    );
    outln!(
        "  step time              {:>12}   (critical path {})",
        secs(s.step_s),
        secs(s.critical_path_s)
    );
    let names = ["compute", "all-gather", "reduce-scatter"];
    for (i, n) in names.iter().enumerate() {
        outln!(
            "  {:<22} {:>12}   ({} of step)",
            format!("{n} busy"),
            secs(s.stream_busy_s[i]),
            frac(s.stream_busy_s[i])
        );
    }
    outln!(
        "  exposed communication  {:>12}   ({} of step: compute blocked in waits {}, tail after \
         compute {})",
        secs(s.exposed_comm_s),
        frac(s.exposed_comm_s),
        secs(s.compute_wait_s),
        secs(s.tail_s)
    );
    outln!(
        "  MFU                    {:>12}   ({:.3e} model FLOPs per rank per step, peak {:.0} \
         TFLOP/s)",
        pct(s.mfu),
        s.model_flops,
        s.peak_flops / 1e12
    );
    outln!(
        "  tokens/s               {:>12.0}   ({} tokens per rank per step: {})",
        s.tokens_per_s,
        s.tokens_per_rank,
        s.token_source
    );
    let m = &s.memory;
    outln!(
        "  memory peak per rank   {:>12}   at {} (issue-order peak {}, arena {})",
        format_bytes(m.peak_bytes),
        secs(m.peak_time_s),
        format_bytes(m.planned_peak_bytes),
        format_bytes(m.arena_bytes)
    );
    for (k, v) in &m.peak_by_kind {
        outln!("    {k:<20} {:>12}", format_bytes(*v));
    }
    match note {
        Some(n) => outln!("  DOES NOT FIT           {n}"),
        None => outln!(
            "  device memory          {:>12}   (the arena fits)",
            format_bytes(device)
        ),
    }
    if !s.links.is_empty() {
        outln!("  link classes (per rank per step):");
        for l in &s.links {
            outln!(
                "    {:<12} {:<11} sends {:>12}   busy {:>12}   ({} of step)",
                l.name,
                if l.cross_node {
                    "cross-node"
                } else {
                    "in-node"
                },
                bytes_f(l.bytes_per_rank),
                secs(l.busy_s),
                frac(l.busy_s)
            );
        }
    }
    Ok(())
}

fn print_calibration(c: &simulate::Calibration, file: &Path) -> Result<()> {
    outln!(
        "calibration against {} ({} of {} timed nodes measured{}):",
        file.display(),
        c.matched_nodes,
        c.timed_nodes,
        if c.unknown_nodes > 0 {
            format!("; {} trace nodes not in the plan", c.unknown_nodes)
        } else {
            String::new()
        }
    );
    outln!(
        "  {:<16} {:>6} {:>14} {:>14} {:>10}",
        "op",
        "nodes",
        "predicted",
        "measured",
        "error"
    );
    for k in &c.per_kind {
        outln!(
            "  {:<16} {:>6} {:>14} {:>14} {:>+9.1}%",
            k.op,
            k.nodes,
            secs(k.predicted_s),
            secs(k.measured_s),
            100.0 * k.relative_error
        );
    }
    outln!(
        "  step: predicted {}, simulated with measured node times {}{}; prediction error {:+.1}%",
        secs(c.predicted_step_s),
        secs(c.calibrated_step_s),
        match c.measured_step_s {
            Some(m) => format!(", measured {}", secs(m)),
            None => String::new(),
        },
        100.0 * c.step_relative_error
    );
    Ok(())
}

pub fn simulate_cmd(a: &SimulateArgs) -> Result<()> {
    let inputs: Vec<&Path> = [
        Some(a.plan.as_path()),
        a.calibrate.as_deref(),
        a.cluster.as_deref(),
    ]
    .into_iter()
    .flatten()
    .collect();
    let roles = [
        ("the plan", Some(a.plan.as_path())),
        ("--calibrate", a.calibrate.as_deref()),
        ("--cluster", a.cluster.as_deref()),
    ];
    let ins: Vec<(&str, &Path)> = roles
        .into_iter()
        .filter_map(|(r, p)| p.map(|p| (r, p)))
        .collect();
    let outs: Vec<(&str, &Path)> = [
        ("--trace", a.trace.as_deref()),
        ("--timeline", a.timeline.as_deref()),
        ("--memory-plot", a.memory_plot.as_deref()),
    ]
    .into_iter()
    .filter_map(|(r, p)| p.map(|p| (r, p)))
    .collect();
    crate::files::check_outputs(&outs, &ins)?;
    let plan = crate::plan_file::read_plan(&a.plan)?;
    let spec = crate::compile::load_cluster(a.cluster.as_deref())?;
    let mut opts = a.sim.options()?;
    opts.serialize = a.serialize;
    let sim = simulate::simulate(&plan, &spec, &opts).map_err(|e| miette!("{e}"))?;
    let calibration = match &a.calibrate {
        None => None,
        Some(path) => {
            let t = hzp_frontends::limits::read_regular_string(path)
                .map_err(|e| miette!("cannot read {}: {e}", path.display()))?;
            let trace =
                Trace::from_json(&t, &path.display().to_string()).map_err(|e| miette!("{e}"))?;
            let m = simulate::measurements_from_trace(&trace);
            if m.events == 0 {
                return Err(miette!(
                    "{}: the trace has no complete (\"X\") events with args.node: nothing to \
                     calibrate with",
                    path.display()
                ));
            }
            Some(simulate::calibrate(&plan, &spec, &opts, &sim, &m).map_err(|e| miette!("{e}"))?)
        }
    };
    // Pictures and trace show the calibrated run when there is one.
    let shown = calibration.as_ref().map_or(&sim, |c| &c.1);
    if let Some(path) = &a.trace {
        let trace = shown.to_trace(&plan, a.trace_ranks);
        write_file(path, &trace.to_json(), &inputs)?;
    }
    if let Some(path) = &a.timeline {
        write_file(
            path,
            &hzp_passes::simulate::svg::gantt(&plan, shown),
            &inputs,
        )?;
    }
    if let Some(path) = &a.memory_plot {
        write_file(
            path,
            &hzp_passes::simulate::svg::memory_plot(shown),
            &inputs,
        )?;
    }
    let note = device_fit(plan.arena_bytes, &sim, &spec);
    let device = spec.device.memory_bytes;
    match a.format {
        Format::Json => {
            let s = sim_summary(&sim, calibration.as_ref().map(|c| &c.0), device, note);
            outln!("{}", serde_json::to_string_pretty(&s).into_diagnostic()?);
        }
        Format::Text => {
            print_sim(&sim, device, note.as_deref())?;
            if let (Some(c), Some(path)) = (&calibration, &a.calibrate) {
                print_calibration(&c.0, path)?;
            }
            for (what, p) in [
                ("trace", &a.trace),
                ("timeline", &a.timeline),
                ("memory plot", &a.memory_plot),
            ] {
                if let Some(p) = p {
                    outln!("wrote {what} {}", p.display());
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// compare and scale

/// One strategy's prediction.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub strategy: String,
    /// P / G / O as compiled.
    pub groups: String,
    pub mesh: String,
    pub ranks: usize,
    pub fits: bool,
    /// Budget per rank, bytes.
    pub budget_bytes: u64,
    pub step_time_s: f64,
    pub mfu: f64,
    pub exposed_comm_fraction: f64,
    /// The plan's arena per rank (what a rank allocates).
    pub peak_memory_bytes: u64,
    /// Peak of the simulated memory timeline (<= the arena).
    pub simulated_peak_bytes: u64,
    pub tokens_per_s: f64,
    /// Bytes one rank sends per step, per link class.
    pub bytes_per_link: BTreeMap<String, f64>,
    pub cross_node_bytes: f64,
    /// `hzp compare --run-steps`: what running the plan on this machine measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub measured: Option<crate::run::Measured>,
    /// Why it does not fit, or what went wrong.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

fn empty_row(strategy: &str, mesh: &str, ranks: usize, note: String) -> Row {
    Row {
        strategy: strategy.to_string(),
        groups: String::new(),
        mesh: mesh.to_string(),
        ranks,
        fits: false,
        budget_bytes: 0,
        step_time_s: f64::NAN,
        mfu: f64::NAN,
        exposed_comm_fraction: f64::NAN,
        peak_memory_bytes: 0,
        simulated_peak_bytes: 0,
        tokens_per_s: f64::NAN,
        bytes_per_link: BTreeMap::new(),
        cross_node_bytes: 0.0,
        measured: None,
        note: Some(note),
    }
}

/// Compiles `strategy` with the shared passes and simulates it: its row and the plan. A
/// strategy that does not fit the budget is compiled anyway with the planner's smallest
/// candidate (and no budget) and marked `fits: false`, so the table can show what it would
/// take.
fn evaluate(
    model: &ModelArgs,
    inputs: Option<&Path>,
    t: &TrainArgs,
    c: &CompileArgs,
    strategy: &str,
    sim: &SimOptions,
) -> std::result::Result<(Row, hzp_ir::plan::Plan), miette::Report> {
    let mut c = c.clone();
    c.strategy = Some(strategy.to_string());
    c.output = None;
    let mut r = request(model, inputs, t, &c)?;
    r.opts.verify_budget = false;
    let (built, no_fit) = match run_request(&r) {
        Ok(b) => (b, None),
        Err(CompileError::NoFit {
            need,
            budget,
            groups,
            ..
        }) => {
            // the planner's smallest candidate, compiled without a budget to show it
            r.opts.overrides = ShardOverride {
                params: Some(groups.params),
                grads: Some(groups.grads),
                optim: Some(groups.optim),
            };
            r.opts.budget = Some(1u64 << 60);
            r.explain = false;
            (
                run_request(&r).map_err(|e| miette!("{e}"))?,
                Some((need, budget)),
            )
        }
        Err(e) => return Err(miette!("{e}")),
    };
    let Built {
        plan,
        cluster,
        budget,
        ..
    } = built;
    // The budget asked for (a strategy that did not fit was compiled without one).
    let budget = match no_fit {
        Some((_, b)) => b,
        None => budget.unwrap_or(cluster.device.memory_bytes),
    };
    let s = simulate::simulate(&plan, &cluster, sim).map_err(|e| miette!("{e}"))?;
    let (fits, note) = match no_fit {
        Some((need, b)) => (
            false,
            Some(format!(
                "does not fit: the planner's smallest candidate needs {} > budget {}; compiled \
                 without the budget to show it",
                format_bytes(need),
                format_bytes(b)
            )),
        ),
        None if plan.arena_bytes > budget => (
            false,
            Some(format!(
                "does not fit: the plan's arena is {} > budget {}",
                format_bytes(plan.arena_bytes),
                format_bytes(budget)
            )),
        ),
        None => (true, None),
    };
    let row = Row {
        strategy: strategy.to_string(),
        groups: format!(
            "P={} G={} O={}",
            plan.groups.params,
            plan.grads_label(),
            plan.groups.optim
        ),
        mesh: plan.mesh.to_string(),
        ranks: plan.mesh.world_size(),
        fits,
        budget_bytes: budget,
        step_time_s: s.step_s,
        mfu: s.mfu,
        exposed_comm_fraction: s.exposed_comm_fraction(),
        peak_memory_bytes: plan.arena_bytes,
        simulated_peak_bytes: s.memory.peak_bytes,
        tokens_per_s: s.tokens_per_s,
        bytes_per_link: s
            .links
            .iter()
            .map(|l| (l.name.clone(), l.bytes_per_rank))
            .collect(),
        cross_node_bytes: s.cross_node_bytes(),
        measured: None,
        note,
    };
    Ok((row, plan))
}

fn parse_strategies(s: &str) -> Result<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    for name in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        Strategy::parse(name).map_err(|e| miette!("--strategies: {e}"))?;
        if !out.iter().any(|x| x == name) {
            out.push(name.to_string());
        }
    }
    if out.is_empty() {
        return Err(miette!("--strategies: name at least one strategy"));
    }
    Ok(out)
}

fn progress(total: usize, quiet: bool) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{spinner} [{elapsed}] {bar:30} {pos}/{len} {msg}")
    {
        pb.set_style(style);
    }
    pb
}

/// Flags of `hzp compare`.
#[derive(clap::Args, Clone, Debug)]
pub struct CompareArgs {
    /// Strategies to compile and simulate, comma-separated (asynchzp, zero1, zero2, zero3,
    /// hsdp, ddp, acco, asyncmesh) [default: asynchzp,zero3,hsdp,ddp].
    #[arg(long, value_name = "S,S,...")]
    pub strategies: Option<String>,
    #[command(flatten)]
    pub sim: SimFlags,
    /// Also run each strategy's plan for N steps on this machine's CPU (its ranks as
    /// threads, as `hzp run` does) on the --inputs batch, from the model's weights, and
    /// report the measured step time, exposed communication and loss beside the prediction.
    #[arg(long, value_name = "N")]
    pub run_steps: Option<usize>,
    /// With --run-steps: emulate links by bandwidth as `hzp run --link` does,
    /// intra=100MB/s,inter=10MB/s[,latency=5us] (intra: the innermost mesh axis; inter:
    /// the others).
    #[arg(long, value_name = "intra=..,inter=..")]
    pub link: Option<String>,
    /// No progress output.
    #[arg(long, short)]
    pub quiet: bool,
    #[arg(long, value_enum, default_value_t)]
    pub format: TableFormat,
}

fn link_names(rows: &[Row]) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for r in rows {
        for k in r.bytes_per_link.keys() {
            if !v.contains(k) {
                v.push(k.clone());
            }
        }
    }
    v
}

fn or_dash(x: f64, f: impl Fn(f64) -> String) -> String {
    if x.is_finite() {
        f(x)
    } else {
        "-".into()
    }
}

fn compare_table(rows: &[Row]) -> Vec<Vec<String>> {
    let links = link_names(rows);
    let mut header: Vec<String> = [
        "strategy",
        "groups",
        "step",
        "MFU",
        "exposed comm",
        "memory/rank",
        "fits",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    header.extend(links.iter().map(|l| format!("{l} bytes/rank")));
    let ran = rows.iter().any(|r| r.measured.is_some());
    if ran {
        header.extend(["run: step", "run: exposed comm", "run: loss"].map(String::from));
    }
    let mut out = vec![header];
    for r in rows {
        let mut row = vec![
            r.strategy.clone(),
            r.groups.clone(),
            or_dash(r.step_time_s, secs),
            or_dash(r.mfu, pct),
            or_dash(r.exposed_comm_fraction, pct),
            if r.peak_memory_bytes > 0 {
                format_bytes(r.peak_memory_bytes)
            } else {
                "-".into()
            },
            if r.fits {
                "yes".into()
            } else if r.peak_memory_bytes > 0 {
                format!("does not fit (budget {})", format_bytes(r.budget_bytes))
            } else {
                "error".into()
            },
        ];
        for l in &links {
            row.push(bytes_f(r.bytes_per_link.get(l).copied().unwrap_or(0.0)));
        }
        if ran {
            match &r.measured {
                Some(m) => {
                    let loss = |l: Option<f64>| l.map_or("-".into(), |l| format!("{l:.4}"));
                    row.push(secs(m.step_s));
                    row.push(secs(m.exposed_comm_s));
                    row.push(format!("{} -> {}", loss(m.first_loss), loss(m.last_loss)));
                }
                None => row.extend(["-", "-", "-"].map(String::from)),
            }
        }
        out.push(row);
    }
    out
}

fn print_table(rows: &[Vec<String>], markdown: bool) -> Result<()> {
    let ncol = rows.iter().map(Vec::len).max().unwrap_or(0);
    let width: Vec<usize> = (0..ncol)
        .map(|c| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    for (i, r) in rows.iter().enumerate() {
        let cells: Vec<String> = (0..ncol)
            .map(|c| {
                let s = r.get(c).map_or("", String::as_str);
                format!("{s:<w$}", w = width[c])
            })
            .collect();
        if markdown {
            outln!("| {} |", cells.join(" | "));
            if i == 0 {
                let rule: Vec<String> = width.iter().map(|w| "-".repeat(*w)).collect();
                outln!("|-{}-|", rule.join("-|-"));
            }
        } else {
            outln!("  {}", cells.join("  ").trim_end());
        }
    }
    Ok(())
}

pub fn compare(
    model: &ModelArgs,
    inputs: Option<&Path>,
    t: &TrainArgs,
    c: &CompileArgs,
    a: &CompareArgs,
) -> Result<()> {
    if c.output.is_some() {
        return Err(miette!(
            "hzp compare compiles one plan per strategy and writes none: -o does not apply \
             (use hzp compile --strategy NAME -o PLAN.json)"
        ));
    }
    if c.shard.is_some() {
        return Err(miette!(
            "hzp compare compiles each of --strategies: --shard would override them all"
        ));
    }
    let list = match (&c.strategy, &a.strategies) {
        (Some(_), Some(_)) => {
            return Err(miette!(
                "hzp compare takes the strategies to compare as --strategies A,B,...; give that alone (--strategy is hzp compile's)"
            ))
        }
        (Some(s), None) => {
            note!("note: hzp compare reads --strategy {s} as --strategies {s} (the flag that lists the strategies to compare; --strategy here will stop working in a later release)");
            s.clone()
        }
        (None, Some(l)) => l.clone(),
        (None, None) => DEFAULT_STRATEGIES.to_string(),
    };
    let strategies = parse_strategies(&list)?;
    if crate::compile::asyncmesh_flags_given(c)
        && !strategies
            .iter()
            .any(|s| Strategy::parse(s).ok() == Some(Strategy::AsyncMesh))
    {
        return Err(miette!(
            "--slow-axis, --sync-every, --sparsity and --ema-beta apply to asyncmesh, which \
             --strategies does not list"
        ));
    }
    let batch = run_batch(model, inputs, a)?;
    let sim = a.sim.options()?;
    let pb = progress(strategies.len(), a.quiet);
    pb.set_message("compiling and simulating");
    // every configuration is a whole compile + simulation: one per rayon worker, results in
    // the order of the list
    let results: Vec<_> = strategies
        .par_iter()
        .map(|s| {
            let r = evaluate(model, inputs, t, c, s, &sim);
            pb.inc(1);
            r
        })
        .collect();
    let mut rows = Vec::new();
    let mut plans = Vec::new();
    let mut first_error = None;
    for (s, r) in strategies.iter().zip(results) {
        match r {
            Ok((r, plan)) => {
                rows.push(r);
                plans.push(Some(plan));
            }
            Err(e) => {
                let msg = format!("{e}");
                rows.push(empty_row(s, &c.mesh, 0, msg));
                plans.push(None);
                first_error.get_or_insert(e);
            }
        }
    }
    pb.finish_and_clear();
    if rows.iter().all(|r| r.peak_memory_bytes == 0) {
        if let Some(e) = first_error {
            return Err(e);
        }
    }
    if let (Some(steps), Some(batch)) = (a.run_steps, &batch) {
        // one plan at a time: each run uses every core of this machine
        for (row, plan) in rows.iter_mut().zip(&plans) {
            let Some(plan) = plan else { continue };
            if !a.quiet {
                note!(
                    "running {} for {steps} steps on this machine's CPU{}",
                    row.strategy,
                    a.link
                        .as_deref()
                        .map_or(String::new(), |l| format!(" (links {l})"))
                );
            }
            let m = crate::run::measure_plan(plan, &model.model, batch, steps, a.link.as_deref())
                .map_err(|e| miette!("running the {} plan: {e}", row.strategy))?;
            row.measured = Some(m);
        }
    }
    match a.format {
        TableFormat::Json => outln!("{}", serde_json::to_string_pretty(&rows).into_diagnostic()?),
        TableFormat::Text | TableFormat::Markdown => {
            let md = a.format == TableFormat::Markdown;
            if !md {
                outln!(
                    "{} on {} ({} ranks), predicted by the simulator{}:",
                    model.model,
                    c.mesh,
                    rows.iter().map(|r| r.ranks).max().unwrap_or(0),
                    match a.run_steps {
                        Some(n) => format!(
                            "; run: {n} steps on this machine's CPU{} (step and exposed \
                             communication: means without the first step; loss: first -> last)",
                            a.link
                                .as_deref()
                                .map_or(String::new(), |l| format!(", links {l}"))
                        ),
                        None => String::new(),
                    }
                );
            }
            print_table(&compare_table(&rows), md)?;
            for r in &rows {
                if let Some(n) = &r.note {
                    outln!("{}{}: {n}", if md { "\n- " } else { "  " }, r.strategy);
                }
            }
        }
    }
    Ok(())
}

/// The batch `--run-steps` runs on (`--inputs`), after checking the flags that go with it.
fn run_batch(
    model: &ModelArgs,
    inputs: Option<&Path>,
    a: &CompareArgs,
) -> Result<Option<Vec<(String, hzp_ir::Tensor)>>> {
    let Some(steps) = a.run_steps else {
        if a.link.is_some() {
            return Err(miette!(
                "--link emulates links for the runs of --run-steps N; without it hzp compare \
                 only simulates (use --cluster SPEC.toml to model other links)"
            ));
        }
        return Ok(None);
    };
    if steps == 0 {
        return Err(miette!("--run-steps must be at least 1"));
    }
    if model.model.starts_with("preset:") {
        return Err(miette!(
            "--run-steps runs each plan from the model's weights; {} has shapes only (compare \
             a model file, or drop --run-steps)",
            model.model
        ));
    }
    let path = inputs.ok_or_else(|| {
        miette!("--run-steps runs each plan on a batch: give it with --inputs IN.npz")
    })?;
    let batch = hzp_frontends::npz::read(path).map_err(|e| miette!("{e}"))?;
    Ok(Some(batch))
}

/// Flags of `hzp scale`.
#[derive(clap::Args, Clone, Debug)]
pub struct ScaleArgs {
    /// Cluster spec (TOML). Default: the 8xH100 DGX spec.
    #[arg(long, value_name = "SPEC.toml")]
    pub cluster: Option<PathBuf>,
    /// World sizes, comma-separated; linearity is measured against the first.
    #[arg(long, default_value = "256,512,1024")]
    pub ranks: String,
    /// Strategies, comma-separated.
    #[arg(long, default_value = "asynchzp,zero3")]
    pub strategies: String,
    /// The mesh with one axis `*` that grows with the ranks, e.g. node=*,gpu=8. Default: the
    /// cluster's mesh with its outermost axis as `*`.
    #[arg(long, value_name = "MESH")]
    pub mesh: Option<String>,
    /// The older name of --mesh here (still read, with a note).
    #[arg(long, hide = true)]
    pub mesh_template: Option<String>,
    /// Memory budget per rank, e.g. 80GiB. Default: the cluster's device memory.
    #[arg(long)]
    pub memory: Option<String>,
    /// Layers whose parameters are gathered ahead of the one computing.
    #[arg(long, default_value_t = 1)]
    pub prefetch_depth: usize,
    /// Reduce gradients once per step (per-step) or after every micro-batch.
    #[arg(long, default_value = "per-microbatch", ignore_case = true, value_parser = crate::reduce_grads_choices())]
    pub reduce_grads: String,
    /// Recompute each layer's activations in its backward: on, off, or auto (only when no
    /// plan fits the budget without it), as `hzp compile`; `--recompute` alone means on.
    #[arg(long, num_args = 0..=1, default_value = "auto", default_missing_value = "on", ignore_case = true, value_parser = crate::recompute_choices())]
    pub recompute: String,
    #[command(flatten)]
    pub sim: SimFlags,
    /// No progress output.
    #[arg(long, short)]
    pub quiet: bool,
    #[arg(long, value_enum, default_value_t)]
    pub format: TableFormat,
}

/// `node=*,gpu=8` with `ranks` ranks: `node=ranks/8,gpu=8`.
pub fn mesh_for(template: &str, ranks: usize) -> Result<String> {
    let parts: Vec<(&str, &str)> = template
        .split(',')
        .map(|p| p.split_once('=').unwrap_or((p, "")))
        .collect();
    let stars = parts.iter().filter(|p| p.1.trim() == "*").count();
    if stars != 1 {
        return Err(miette!(
            "--mesh-template {template}: exactly one axis must be `*` (the one that grows), e.g. \
             node=*,gpu=8"
        ));
    }
    let fixed_s: Vec<String> = parts
        .iter()
        .filter(|p| p.1.trim() != "*")
        .map(|p| format!("{}={}", p.0, p.1))
        .collect();
    let fixed = if fixed_s.is_empty() {
        1
    } else {
        Mesh::parse(&fixed_s.join(","))
            .map_err(|e| miette!("--mesh-template {template}: {e}"))?
            .world_size()
    };
    if ranks == 0 || !ranks.is_multiple_of(fixed) {
        return Err(miette!(
            "{ranks} ranks do not fill --mesh-template {template}: the fixed axes hold {fixed} \
             ranks, so the ranks must be a multiple of {fixed}"
        ));
    }
    let mesh: Vec<String> = parts
        .iter()
        .map(|p| {
            if p.1.trim() == "*" {
                format!("{}={}", p.0, ranks / fixed)
            } else {
                format!("{}={}", p.0, p.1)
            }
        })
        .collect();
    Ok(mesh.join(","))
}

/// Scales the leading dim of every `--shape NAME=AxB...` by `factor` (weak scaling of a
/// global batch).
fn scale_shapes(shapes: &[String], factor: usize) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for s in shapes {
        let mut parts = Vec::new();
        for item in s.split(',') {
            let (name, dims) = item
                .split_once('=')
                .ok_or_else(|| miette!("--shape {item}: expected NAME=AxB"))?;
            let mut d: Vec<String> = dims.split('x').map(str::to_string).collect();
            let first: usize = d[0]
                .trim()
                .parse()
                .map_err(|_| miette!("--shape {item}: `{}` is not a size", d[0]))?;
            d[0] = (first * factor).to_string();
            parts.push(format!("{name}={}", d.join("x")));
        }
        out.push(parts.join(","));
    }
    Ok(out)
}

#[derive(Serialize)]
struct ScaleRow {
    strategy: String,
    ranks: usize,
    mesh: String,
    fits: bool,
    step_time_s: f64,
    tokens_per_s: f64,
    linearity: f64,
    mfu: f64,
    exposed_comm_fraction: f64,
    cross_node_bytes: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
}

/// One (strategy, ranks) pair of `hzp scale`: strategy, ranks, mesh, the model at that
/// batch, and the compile flags.
type ScaleJob = (String, usize, String, ModelArgs, CompileArgs);

pub fn scale(model: &ModelArgs, t: &TrainArgs, a: &ScaleArgs) -> Result<()> {
    let strategies = parse_strategies(&a.strategies)?;
    let ranks = parse_ranks(&a.ranks)?;
    let cluster = crate::compile::load_cluster(a.cluster.as_deref())?;
    let template = match (&a.mesh, &a.mesh_template) {
        (Some(_), Some(_)) => {
            return Err(miette!(
                "give the mesh once, as --mesh (--mesh-template is its older name)"
            ))
        }
        (Some(t), None) => t.clone(),
        (None, Some(t)) => {
            note!("note: hzp scale's --mesh-template is now --mesh (the older name will stop working in a later release)");
            t.clone()
        }
        (None, None) => default_template(&cluster),
    };
    let meshes: Vec<String> = ranks
        .iter()
        .map(|&n| mesh_for(&template, n))
        .collect::<Result<_>>()?;
    let preset = model.model.starts_with("preset:");
    if !preset && model.shapes.is_empty() {
        return Err(miette!(
            "hzp scale needs the global batch at the first rank count ({}) from --shape \
             NAME=AxB (it grows the batch with the ranks: weak scaling); a preset's batch is \
             already per rank",
            ranks[0]
        ));
    }
    let sim = a.sim.options()?;
    let pb = progress(strategies.len() * ranks.len(), a.quiet);
    pb.set_message("compiling and simulating");
    // Every (strategy, ranks) pair compiles independently; linearity is computed after.
    let jobs = scale_jobs(model, a, &strategies, &ranks, &meshes)?;
    let results: Vec<_> = jobs
        .par_iter()
        .map(|(s, n, mesh, m, c)| {
            let row = match evaluate(m, None, t, c, s, &sim).map(|(row, _)| row) {
                Ok(r) => r,
                Err(e) => empty_row(s, mesh, *n, format!("{e}")),
            };
            pb.inc(1);
            row
        })
        .collect();
    let rows = scale_rows(&jobs, results);
    pb.finish_and_clear();
    if rows.iter().all(|r| !r.tokens_per_s.is_finite()) {
        let notes: Vec<String> = rows.iter().filter_map(|r| r.note.clone()).collect();
        return Err(miette!(
            "no configuration could be simulated:\n{}",
            notes.join("\n")
        ));
    }
    match a.format {
        TableFormat::Json => outln!("{}", serde_json::to_string_pretty(&rows).into_diagnostic()?),
        TableFormat::Text | TableFormat::Markdown => {
            let md = a.format == TableFormat::Markdown;
            if !md {
                outln!(
                    "weak scaling of {} on {} (mesh {}), fixed tokens per rank:",
                    model.model,
                    cluster.name,
                    template
                );
            }
            print_scale_table(&rows, md)?;
            print_scale_notes(&rows, &strategies, &ranks, md)?;
        }
    }
    Ok(())
}

/// `--ranks`: the world sizes, each at least 1, at least one.
fn parse_ranks(s: &str) -> Result<Vec<usize>> {
    let mut ranks: Vec<usize> = Vec::new();
    for r in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        let n: usize = r
            .parse()
            .map_err(|_| miette!("--ranks: `{r}` is not a number of ranks"))?;
        if n == 0 {
            return Err(miette!("--ranks: 0 ranks"));
        }
        ranks.push(n);
    }
    if ranks.is_empty() {
        return Err(miette!("--ranks: give at least one world size"));
    }
    Ok(ranks)
}

/// The cluster's mesh with its outermost axis free (`*`): the default `--mesh-template`.
fn default_template(cluster: &ClusterSpec) -> String {
    cluster
        .mesh
        .axes
        .iter()
        .enumerate()
        .map(|(i, ax)| {
            if i == 0 {
                format!("{}=*", ax.name)
            } else {
                format!("{}={}", ax.name, ax.size)
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Every (strategy, ranks) pair, strategies outermost; the global batch grows with the
/// ranks (weak scaling) unless the model is a preset.
fn scale_jobs(
    model: &ModelArgs,
    a: &ScaleArgs,
    strategies: &[String],
    ranks: &[usize],
    meshes: &[String],
) -> Result<Vec<ScaleJob>> {
    let preset = model.model.starts_with("preset:");
    let mut jobs = Vec::new();
    for s in strategies {
        for (&n, mesh) in ranks.iter().zip(meshes) {
            let mut m = model.clone();
            if !preset {
                if n % ranks[0] != 0 {
                    return Err(miette!(
                        "--ranks: {n} is not a multiple of {}: the global batch cannot grow by \
                         a whole factor",
                        ranks[0]
                    ));
                }
                m.shapes = scale_shapes(&model.shapes, n / ranks[0])?;
            }
            jobs.push((s.clone(), n, mesh.clone(), m, compile_args(a, mesh)?));
        }
    }
    Ok(jobs)
}

/// The table's rows: linearity against the first rank count of the same strategy that
/// could be simulated.
fn scale_rows(jobs: &[ScaleJob], results: Vec<Row>) -> Vec<ScaleRow> {
    let mut rows: Vec<ScaleRow> = Vec::new();
    let mut base: Option<(&str, usize, f64)> = None;
    for ((s, n, mesh, _, _), row) in jobs.iter().zip(results) {
        let n = *n;
        if base.is_some_and(|(bs, _, _)| bs != s.as_str()) {
            base = None;
        }
        let tps = row.tokens_per_s;
        if base.is_none() && tps.is_finite() && tps > 0.0 {
            base = Some((s, n, tps));
        }
        let linearity = match base {
            Some((_, n0, t0)) if tps.is_finite() => tps / (n as f64 / n0 as f64 * t0),
            _ => f64::NAN,
        };
        rows.push(ScaleRow {
            strategy: s.clone(),
            ranks: n,
            mesh: mesh.clone(),
            fits: row.fits,
            step_time_s: row.step_time_s,
            tokens_per_s: tps,
            linearity,
            mfu: row.mfu,
            exposed_comm_fraction: row.exposed_comm_fraction,
            cross_node_bytes: row.cross_node_bytes,
            note: row.note,
        });
    }
    rows
}

/// The text or Markdown table of `hzp scale`.
fn print_scale_table(rows: &[ScaleRow], md: bool) -> Result<()> {
    let mut table = vec![[
        "strategy",
        "ranks",
        "mesh",
        "step",
        "tokens/s",
        "linearity",
        "MFU",
        "exposed comm",
        "cross-node bytes/rank",
        "fits",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect::<Vec<_>>()];
    for r in rows {
        table.push(vec![
            r.strategy.clone(),
            r.ranks.to_string(),
            r.mesh.clone(),
            or_dash(r.step_time_s, secs),
            or_dash(r.tokens_per_s, |x| format!("{x:.0}")),
            or_dash(r.linearity, pct),
            or_dash(r.mfu, pct),
            or_dash(r.exposed_comm_fraction, pct),
            bytes_f(r.cross_node_bytes),
            if r.fits { "yes" } else { "no" }.to_string(),
        ]);
    }
    print_table(&table, md)
}

/// The rows' notes, the paper's reference figure, and ours from 256 to 1024 ranks.
fn print_scale_notes(
    rows: &[ScaleRow],
    strategies: &[String],
    ranks: &[usize],
    md: bool,
) -> Result<()> {
    let lead = if md { "\n" } else { "  " };
    for r in rows {
        if let Some(n) = &r.note {
            outln!("{lead}{} at {} ranks: {n}", r.strategy, r.ranks);
        }
    }
    outln!(
        "{lead}reference: the AsyncHZP paper (Bai et al., arXiv:2510.20111) reports {} \
         linearity from 256 to 1024 ranks on its own hardware (a figure from the paper, \
         not computed here)",
        pct(PAPER_LINEARITY_256_1024)
    );
    for s in strategies {
        let at = |n: usize| {
            rows.iter()
                .find(|r| &r.strategy == s && r.ranks == n)
                .map(|r| r.linearity)
        };
        if let (Some(_), Some(l)) = (at(256), at(1024)) {
            if ranks.first() == Some(&256) {
                outln!(
                    "{lead}ours, {s}: {} from 256 to 1024 ranks (simulated)",
                    or_dash(l, pct)
                );
            }
        }
    }
    Ok(())
}

/// `hzp compile`'s flags for one mesh of `hzp scale`: the compiler's defaults
/// ([`CompileArgs::for_mesh`]) with scale's own flags set.
fn compile_args(a: &ScaleArgs, mesh: &str) -> Result<CompileArgs> {
    let mut c = CompileArgs::for_mesh(mesh);
    c.cluster = a.cluster.clone();
    if let Some(m) = &a.memory {
        parse_bytes(m).map_err(|e| miette!("--memory {m}: {e}"))?;
        c.memory = Some(m.clone());
    }
    c.prefetch_depth = a.prefetch_depth;
    c.reduce_grads = a.reduce_grads.clone();
    c.recompute = a.recompute.clone();
    Ok(c)
}
