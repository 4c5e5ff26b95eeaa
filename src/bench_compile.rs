//! `hzp bench compile`: how long `hzp compile` takes and how much memory it needs, for one
//! model on several meshes. A plan is SPMD (one program for every rank), so its compile time
//! and size should not grow with the number of ranks; the table says whether they do.
//! With `--layers N,N,...` it compiles a preset at each layer count instead, on one mesh, and
//! gives the ratio of time and peak memory per step (they should grow about linearly).

use crate::compile::{build_plan, CompileArgs};
use crate::{ModelArgs, TrainArgs};
use miette::{miette, Result};
use std::path::PathBuf;
use std::time::Instant;

/// Flags of `hzp bench compile`.
#[derive(clap::Args, Clone, Debug)]
pub struct BenchCompileArgs {
    /// The model: FILE.onnx, FILE.hzp or preset:NAME.
    #[arg(default_value = "preset:gpt3-175b")]
    pub model: String,
    /// Bind symbolic input dims (the global batch), as for `hzp compile`.
    #[arg(long = "shape", value_name = "NAME=AxB")]
    pub shapes: Vec<String>,
    /// The meshes to compile for, one per flag (`--meshes node=8,gpu=8 --meshes
    /// node=1024,gpu=8`). Default: those two (64 and 8192 ranks); with --layers, gpu=8.
    #[arg(long = "meshes", value_name = "MESH")]
    pub meshes: Vec<String>,
    /// The old name of --meshes (still read, with a note).
    #[arg(long = "mesh", hide = true)]
    pub mesh_old: Vec<String>,
    /// Compiles per mesh (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Cluster spec (TOML). Default: the 8xH100 DGX spec.
    #[arg(long, value_name = "SPEC.toml")]
    pub cluster: Option<PathBuf>,
    /// Memory budget per rank, e.g. 80GiB. Default: the cluster's device memory (as `hzp
    /// compile --memory`).
    #[arg(long)]
    pub memory: Option<String>,
    /// The strategy, as `hzp compile --strategy`.
    #[arg(long, default_value = "asynchzp", ignore_case = true, value_parser = crate::strategy_choices())]
    pub strategy: String,
    /// Per-layer activation recomputation: on, off or auto, as `hzp compile --recompute`
    /// (`--recompute` alone means on).
    #[arg(long, num_args = 0..=1, default_value = "auto", default_missing_value = "on", ignore_case = true, value_parser = crate::recompute_choices())]
    pub recompute: String,
    /// Skip collective rewriting, as `hzp compile --no-rewrite`.
    #[arg(long)]
    pub no_rewrite: bool,
    /// Compile the preset with each of these layer counts (e.g. 96,192,384,768) on one mesh
    /// (the one --meshes given, default gpu=8), and print the ratio of wall time, CPU time and peak
    /// memory from each count to the next (a cost linear in the layers gives 2 per doubling).
    #[arg(long, value_delimiter = ',', value_name = "N,N,...")]
    pub layers: Vec<usize>,
    #[command(flatten)]
    pub train: TrainArgs,
}

/// `hzp compile`'s flags for one mesh: the compiler's defaults ([`CompileArgs::for_mesh`])
/// with the bench's own flags set.
fn compile_args(a: &BenchCompileArgs, mesh: &str) -> Result<CompileArgs> {
    let mut c = CompileArgs::for_mesh(mesh);
    if let Some(m) = &a.memory {
        hzp_passes::cost::cluster::parse_bytes(m).map_err(|e| miette!("--memory {m}: {e}"))?;
    }
    c.memory = a.memory.clone();
    c.strategy = Some(a.strategy.clone());
    c.recompute = a.recompute.clone();
    c.no_rewrite = a.no_rewrite;
    c.cluster = a.cluster.clone();
    Ok(c)
}

/// Resets the peak resident set size of this process (Linux: `5` to /proc/self/clear_refs),
/// so that each mesh reports its own peak. Returns whether it could.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The peak resident set size (VmHWM), if the OS reports it.
fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

struct Row {
    mesh: String,
    ranks: usize,
    groups: String,
    times: Vec<f64>,
    peak_rss: Option<u64>,
    nodes: usize,
    json_bytes: usize,
    arena: u64,
    fits: bool,
}

impl Row {
    fn median(&self) -> f64 {
        self.times[self.times.len() / 2]
    }
}

fn secs(s: f64) -> String {
    if s < 1.0 {
        format!("{:.0} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// CPU time of this process so far (user + system, all threads), if the OS reports it.
fn cpu_seconds() -> Option<f64> {
    // SAFETY: an all-zero `rusage` is a valid value of this plain C struct.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage only writes into the struct it is given, which outlives the call.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return None;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    Some(t(u.ru_utime) + t(u.ru_stime))
}

struct LayersRow {
    layers: usize,
    /// Wall and CPU seconds of each compile, each sorted.
    wall: Vec<f64>,
    cpu: Vec<f64>,
    peak_rss: Option<u64>,
    nodes: usize,
}

/// `hzp bench compile preset:NAME --layers N,N,...`: one row per layer count.
fn bench_layers(a: &BenchCompileArgs) -> Result<()> {
    if !a.model.starts_with("preset:") {
        return Err(miette!(
            "--layers needs a preset model (e.g. preset:gpt), not `{}`",
            a.model
        ));
    }
    if a.model.split(',').any(|s| s.trim().starts_with("layers=")) {
        return Err(miette!(
            "`{}` already sets layers=; with --layers give the preset without it",
            a.model
        ));
    }
    if a.layers.contains(&0) {
        return Err(miette!("--layers: a layer count must be at least 1"));
    }
    let mesh = match meshes(a).as_slice() {
        [] => "gpu=8".to_string(),
        [m] => m.clone(),
        _ => {
            return Err(miette!(
                "--layers compiles on one mesh; give at most one --meshes"
            ))
        }
    };
    let repeat = a.repeat.max(1);
    let c = compile_args(a, &mesh)?;
    let resets = reset_peak_rss();
    let models: Vec<ModelArgs> = a
        .layers
        .iter()
        .map(|&n| ModelArgs {
            model: format!("{},layers={n}", a.model),
            shapes: a.shapes.clone(),
            bind: Vec::new(),
            no_fuse_attention: false,
            no_fuse_moe: false,
            names: None,
        })
        .collect();
    let mut rows: Vec<LayersRow> = a
        .layers
        .iter()
        .map(|&n| LayersRow {
            layers: n,
            wall: Vec::new(),
            cpu: Vec::new(),
            peak_rss: None,
            nodes: 0,
        })
        .collect();
    // Rounds: each compiles every count once, in order, so a change in the machine's speed
    // while the bench runs (a shared or throttled VM) touches every count alike rather than
    // whichever count was running then.
    for round in 0..repeat {
        for (model, row) in models.iter().zip(rows.iter_mut()) {
            if resets {
                reset_peak_rss();
            }
            let (start, cpu0) = (Instant::now(), cpu_seconds());
            let built = build_plan(model, None, &a.train, &c, false, true)
                .map_err(|e| e.wrap_err(format!("compiling {} for {mesh}", model.model)))?;
            row.wall.push(start.elapsed().as_secs_f64());
            if let (Some(x), Some(y)) = (cpu0, cpu_seconds()) {
                row.cpu.push(y - x);
            }
            row.nodes = built.plan.program.nodes.len();
            drop(built);
            // peak RSS from the first round only: freed memory stays with the allocator, so a
            // later round's small count would report the large count's leftovers
            if round == 0 {
                row.peak_rss = peak_rss_bytes();
            }
        }
    }
    for r in &mut rows {
        r.wall.sort_by(f64::total_cmp);
        r.cpu.sort_by(f64::total_cmp);
    }
    outln!(
        "compile {},layers=N on {mesh} (strategy {}, budget {}{}{}), {repeat} round(s) over the \
         counts (each compiles every count once), plan JSON made (not written)",
        a.model,
        a.strategy,
        budget_text(a),
        if a.recompute == "auto" {
            String::new()
        } else {
            format!(", recompute {}", a.recompute)
        },
        if a.no_rewrite { ", no rewrite" } else { "" },
    );
    let median = |v: &[f64]| v.get(v.len() / 2).copied();
    let least = |v: &[f64]| v.first().copied();
    let cell = |x: Option<f64>| x.map_or("n/a".to_string(), secs);
    outln!(
        "  {:>7}  {:>11}  {:>9}  {:>10}  {:>9}  {:>10}  {:>8}",
        "layers",
        "wall median",
        "wall min",
        "CPU median",
        "CPU min",
        "peak RSS",
        "nodes"
    );
    for r in &rows {
        outln!(
            "  {:>7}  {:>11}  {:>9}  {:>10}  {:>9}  {:>10}  {:>8}",
            r.layers,
            cell(median(&r.wall)),
            cell(least(&r.wall)),
            cell(median(&r.cpu)),
            cell(least(&r.cpu)),
            r.peak_rss
                .map_or("n/a".to_string(), hzp_ir::plan::format_bytes),
            r.nodes
        );
    }
    if resets {
        outln!(
            "  peak RSS: of each count's compile in the first round (counts in the order given)"
        );
    } else {
        outln!("  peak RSS: the peak of the process so far (it could not be reset per count)");
    }
    let ratio = |x: Option<f64>, y: Option<f64>| match (x, y) {
        (Some(x), Some(y)) if y > 0.0 => format!("x{:.2}", x / y),
        _ => "n/a".to_string(),
    };
    for w in rows.windows(2) {
        let (p, r) = (&w[0], &w[1]);
        outln!(
            "layers {} / {} (x{:.2}): wall {} (min {}), CPU {} (min {}), peak RSS {}",
            r.layers,
            p.layers,
            r.layers as f64 / p.layers as f64,
            ratio(median(&r.wall), median(&p.wall)),
            ratio(least(&r.wall), least(&p.wall)),
            ratio(median(&r.cpu), median(&p.cpu)),
            ratio(least(&r.cpu), least(&p.cpu)),
            ratio(r.peak_rss.map(|b| b as f64), p.peak_rss.map(|b| b as f64)),
        );
    }
    Ok(())
}

/// The budget as the header prints it: `--memory`, or the device memory it defaults to.
fn budget_text(a: &BenchCompileArgs) -> String {
    a.memory
        .clone()
        .unwrap_or_else(|| "the device memory".to_string())
}

/// The meshes asked for: `--meshes`, and the old spelling `--mesh` with a note.
fn meshes(a: &BenchCompileArgs) -> Vec<String> {
    if !a.mesh_old.is_empty() {
        note!(
            "note: hzp bench compile reads --mesh as --meshes (one mesh per flag, as here; --mesh is hzp compile's single mesh and will stop working here in a later release)"
        );
    }
    a.meshes.iter().chain(&a.mesh_old).cloned().collect()
}

pub fn bench_compile(a: &BenchCompileArgs) -> Result<()> {
    if !a.layers.is_empty() {
        return bench_layers(a);
    }
    let mut meshes = meshes(a);
    if meshes.is_empty() {
        meshes = vec!["node=8,gpu=8".into(), "node=1024,gpu=8".into()];
    }
    let repeat = a.repeat.max(1);
    let model = ModelArgs {
        model: a.model.clone(),
        shapes: a.shapes.clone(),
        bind: Vec::new(),
        no_fuse_attention: false,
        no_fuse_moe: false,
        names: None,
    };
    let resets = reset_peak_rss();
    let mut rows = Vec::new();
    for mesh in &meshes {
        let c = compile_args(a, mesh)?;
        if resets {
            reset_peak_rss();
        }
        let mut times = Vec::new();
        let mut last = None;
        for _ in 0..repeat {
            let start = Instant::now();
            // The budget is reported below, not enforced: a plan over it still times the
            // whole compile.
            let built = build_plan(&model, None, &a.train, &c, false, true)
                .map_err(|e| e.wrap_err(format!("compiling {} for {mesh}", a.model)))?;
            times.push(start.elapsed().as_secs_f64());
            last = Some(built);
        }
        let peak_rss = peak_rss_bytes();
        times.sort_by(f64::total_cmp);
        let built = last.expect("repeat >= 1");
        let plan = &built.plan;
        rows.push(Row {
            mesh: mesh.clone(),
            ranks: plan.mesh.world_size(),
            groups: format!(
                "{} {} {}",
                plan.groups.params, plan.groups.grads, plan.groups.optim
            ),
            times,
            peak_rss,
            nodes: plan.program.nodes.len(),
            json_bytes: built.json.as_ref().map_or(0, String::len),
            arena: plan.arena_bytes,
            fits: built.budget.is_none_or(|b| plan.arena_bytes <= b),
        });
    }
    print_table(a, &rows, repeat, resets)?;
    Ok(())
}

fn print_table(a: &BenchCompileArgs, rows: &[Row], repeat: usize, resets: bool) -> Result<()> {
    outln!(
        "compile {} (strategy {}, budget {}{}{}), {} compile(s) per mesh, plan JSON made (not written)",
        a.model,
        a.strategy,
        budget_text(a),
        if a.recompute == "auto" { String::new() } else { format!(", recompute {}", a.recompute) },
        if a.no_rewrite { ", no rewrite" } else { "" },
        repeat
    );
    let gw = rows
        .iter()
        .map(|r| r.groups.len())
        .max()
        .unwrap_or(0)
        .max(13);
    let mw = rows.iter().map(|r| r.mesh.len()).max().unwrap_or(0).max(4);
    outln!(
        "  {:<mw$}  {:>6}  {:<gw$}  {:>9}  {:>9}  {:>9}  {:>10}  {:>6}  {:>10}  {:>11}",
        "mesh",
        "ranks",
        "groups P G O",
        "median",
        "min",
        "max",
        "peak RSS",
        "nodes",
        "plan.json",
        "arena/rank"
    );
    for r in rows {
        outln!(
            "  {:<mw$}  {:>6}  {:<gw$}  {:>9}  {:>9}  {:>9}  {:>10}  {:>6}  {:>10}  {:>10}{}",
            r.mesh,
            r.ranks,
            r.groups,
            secs(r.median()),
            secs(r.times[0]),
            secs(r.times[r.times.len() - 1]),
            r.peak_rss
                .map_or("n/a".to_string(), hzp_ir::plan::format_bytes),
            r.nodes,
            hzp_ir::plan::format_bytes(r.json_bytes as u64),
            hzp_ir::plan::format_bytes(r.arena),
            if r.fits { " " } else { "*" }
        );
    }
    if rows.iter().any(|r| !r.fits) {
        outln!(
            "  * the plan's arena is over the budget ({})",
            budget_text(a)
        );
    }
    if !resets {
        outln!("  peak RSS: the peak of the process so far (it could not be reset per mesh)");
    }
    if let Some((first, rest)) = rows.split_first() {
        for r in rest {
            outln!(
                "compile time {} / {}: {:.3}x (medians); plan.json {:.3}x",
                r.mesh,
                first.mesh,
                r.median() / first.median(),
                r.json_bytes as f64 / first.json_bytes as f64
            );
        }
    }
    Ok(())
}
