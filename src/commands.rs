//! The subcommands. Each one reads the user's files, calls into the crates, and prints.

use crate::files;
use crate::{Format, ModelArgs};
use hzp_frontends::{hzp_file, load_model, npz, LoadOptions};
use hzp_ir::{Program, Tensor};
use miette::{miette, IntoDiagnostic, Result, WrapErr};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Parses `--shape` values: `NAME=AxB`, repeated or comma-separated.
fn parse_shapes(specs: &[String]) -> Result<BTreeMap<String, Vec<usize>>> {
    let mut out = BTreeMap::new();
    for spec in specs {
        for part in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, dims) = part.split_once('=').ok_or_else(|| {
                miette!("--shape `{part}` must look like NAME=AxB, e.g. input_ids=8x2048")
            })?;
            let dims = dims
                .split('x')
                .map(|d| d.trim().parse::<usize>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|_| {
                    miette!("--shape `{part}`: `{dims}` is not a list of sizes like 8x2048")
                })?;
            if out.insert(name.trim().to_string(), dims).is_some() {
                return Err(miette!("--shape gives input `{name}` twice"));
            }
        }
    }
    Ok(out)
}

/// Parses `--bind` values: `NAME=1,2,3` (numbers), one input per flag.
fn parse_binds(specs: &[String]) -> Result<BTreeMap<String, Vec<f64>>> {
    let mut out = BTreeMap::new();
    for spec in specs {
        let (name, nums) = spec
            .split_once('=')
            .ok_or_else(|| miette!("--bind `{spec}` must look like NAME=1,2,3, e.g. --bind k=3"))?;
        let nums = nums
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|v| v.parse::<f64>())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| {
                miette!("--bind `{spec}`: `{nums}` is not a list of numbers like 1,2,3")
            })?;
        if out.insert(name.trim().to_string(), nums).is_some() {
            return Err(miette!("--bind gives input `{name}` twice"));
        }
    }
    Ok(out)
}

fn read_npz(path: &Path) -> Result<Vec<(String, Tensor)>> {
    npz::read(path).map_err(|e| miette!("{e}"))
}

/// Reads the model; input shapes come from --shape, then from the arrays of --inputs.
fn load(args: &ModelArgs, inputs: Option<&[(String, Tensor)]>) -> Result<Program> {
    load_as(args, inputs, false)
}

/// [`load`], reading shapes only when `shapes_only` (`show`: see
/// `hzp_frontends::onnx::ImportOptions::shapes_only`).
fn load_as(
    args: &ModelArgs,
    inputs: Option<&[(String, Tensor)]>,
    shapes_only: bool,
) -> Result<Program> {
    let mut shapes = parse_shapes(&args.shapes)?;
    let mut values = BTreeMap::new();
    if let Some(inputs) = inputs {
        for (k, t) in inputs {
            shapes.entry(k.clone()).or_insert_with(|| t.shape.clone());
            values.insert(k.clone(), t.clone());
        }
    }
    let opts = LoadOptions {
        shapes,
        values,
        bind: parse_binds(&args.bind)?,
        no_fuse_attention: args.no_fuse_attention,
        no_fuse_moe: args.no_fuse_moe,
        shapes_only,
        names: args.names.clone(),
    };
    load_model(&args.model, &opts).map_err(miette::Report::new)
}

/// The arrays for the program's inputs: from `arrays` by name, else the value the program
/// was specialized on (an input given with `--bind`).
fn eval_inputs(
    p: &Program,
    arrays: &[(String, Tensor)],
    file: &Path,
) -> Result<Vec<(String, Tensor)>> {
    p.inputs
        .iter()
        .map(|&v| {
            let name = &p.value(v).name;
            arrays
                .iter()
                .find(|(k, _)| k == name)
                .cloned()
                .or_else(|| p.specialized.get(name).map(|t| (name.clone(), t.clone())))
                .ok_or_else(|| {
                    miette!(
                        "{} has no array `{name}`, an input of the model (it has: {})",
                        file.display(),
                        arrays
                            .iter()
                            .map(|(k, _)| k.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                })
        })
        .collect()
}

pub fn import(args: &ModelArgs, inputs: Option<&Path>, output: Option<&Path>) -> Result<()> {
    let arrays = inputs.map(read_npz).transpose()?;
    let p = load(args, arrays.as_deref())?;
    match output {
        None => out!("{}", hzp_ir::text::print(&p)),
        Some(out) => {
            let weights = hzp_file::weights_path(out);
            let mut ins = files::model_roles(&args.model, "the model");
            ins.extend(inputs.map(|p| ("--inputs".to_string(), p.to_path_buf())));
            files::check_outputs(
                &[("-o", out), ("-o's weights file", weights.as_path())],
                &ins,
            )?;
            hzp_file::save(out, &p).map_err(miette::Report::new)?;
            note!(
                "wrote {} ({} nodes, {} parameters){}",
                out.display(),
                p.nodes.len(),
                p.num_parameters(),
                if hzp_file::sidecar_tensors(&p).is_empty() {
                    String::new()
                } else {
                    format!(" and {}", weights.display())
                }
            );
        }
    }
    Ok(())
}

/// `show --inputs`: the model loaded with the shapes of the arrays, read from their headers
/// alone. `None` when that is not enough: the archive could not be read that way, or the
/// import needs the values of inputs (a value that decides a shape is computed from them);
/// the caller then reads the arrays. A model that imports without values gives the same
/// program with them (only inputs a shape needs are specialized on).
fn load_with_array_shapes(args: &ModelArgs, path: &Path) -> Result<Option<Program>> {
    let Ok(arrays) = npz::read_shapes(path) else {
        return Ok(None);
    };
    let mut shapes = parse_shapes(&args.shapes)?;
    for (k, shape) in arrays {
        shapes.entry(k).or_insert(shape);
    }
    let opts = LoadOptions {
        shapes,
        values: BTreeMap::new(),
        bind: parse_binds(&args.bind)?,
        no_fuse_attention: args.no_fuse_attention,
        no_fuse_moe: args.no_fuse_moe,
        shapes_only: true,
        names: args.names.clone(),
    };
    match load_model(&args.model, &opts) {
        Ok(p) => Ok(Some(p)),
        Err(hzp_frontends::LoadError::Onnx(e))
            if e.kind == hzp_frontends::onnx::ImportErrorKind::Node =>
        {
            Ok(None)
        }
        Err(e) => Err(miette::Report::new(e)),
    }
}

pub fn show(args: &ModelArgs, inputs: Option<&Path>, format: Format) -> Result<()> {
    // Only shapes are needed: the arrays of --inputs are read only if the import needs values.
    let p = match inputs {
        None => load_as(args, None, true)?,
        Some(path) => match load_with_array_shapes(args, path)? {
            Some(p) => p,
            None => load_as(args, Some(&read_npz(path)?), true)?,
        },
    };
    let s = hzp_passes::report::summarize(&p);
    let equal = hzp_passes::train::ties::find_ties(&p);
    let shared = hzp_passes::train::ties::shared_parameters(&p);
    let map = name_map(args)?;
    // With a name map the parameters are PyTorch's: nothing was merged.
    let merged = if map.is_some() {
        Vec::new()
    } else {
        hzp_passes::train::ties::merged_initializers(&p)
    };
    let pytorch_ties = map_ties(map.as_ref());
    match format {
        Format::Text => {
            out!("{}", s.to_text());
            outln!("\nweight sharing");
            if equal.is_empty() && shared.is_empty() && merged.is_empty() && pytorch_ties.is_empty()
            {
                outln!("  none found (no two parameters are equal up to a transpose; none is read in the place of several)");
            }
            if let Some(m) = &map {
                outln!(
                    "  parameters named by PyTorch's state_dict keys ({})",
                    m.path.display()
                );
            }
            for t in &pytorch_ties {
                outln!(
                    "  `{}` is `{}` (tied in PyTorch; trained as one, written under both names)",
                    t.copy,
                    t.canonical
                );
            }
            for line in merged_lines(&merged) {
                outln!("  {line}");
            }
            for t in &equal {
                outln!(
                    "  `{}` equals {}`{}`: the exporter stored one weight twice (untied); --retie trains them as one",
                    t.copy,
                    if t.transposed { "the transpose of " } else { "" },
                    t.canonical
                );
            }
            for sp in &shared {
                outln!(
                    "  `{}` is read by {} layers ({}): a tied weight, or identical initializers the exporter merged",
                    sp.name,
                    sp.layers.len(),
                    sp.layers.join(", ")
                );
            }
        }
        Format::Json => {
            let mut v = serde_json::to_value(&s).into_diagnostic()?;
            v["weight_sharing"] = serde_json::json!({
                "equal_parameters": equal,
                "shared_across_layers": shared,
                "merged_initializers": merged,
                "pytorch_ties": pytorch_ties,
                "name_map": map.as_ref().map(|m| m.path.display().to_string()),
            });
            outln!("{}", serde_json::to_string_pretty(&v).into_diagnostic()?)
        }
    }
    Ok(())
}

/// Max |a - b| over elements (both converted to f64); None if shapes differ.
fn max_abs_diff(a: &Tensor, b: &Tensor) -> Option<f64> {
    if a.shape != b.shape {
        return None;
    }
    let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
    Some(
        x.iter()
            .zip(&y)
            .map(|(p, q)| {
                if p.is_nan() != q.is_nan() {
                    f64::INFINITY
                } else if p.is_nan() {
                    0.0
                } else {
                    (p - q).abs()
                }
            })
            .fold(0.0, f64::max),
    )
}

fn shape_str(t: &Tensor) -> String {
    t.ty().to_string()
}

/// [`hzp_frontends::limits::check_result_sizes`], as a CLI error.
pub fn check_result_sizes(p: &Program) -> Result<()> {
    hzp_frontends::limits::check_result_sizes(p).map_err(|e| miette!("{e}"))
}

pub fn eval(
    args: &ModelArgs,
    inputs: &Path,
    output: Option<&Path>,
    reference: Option<&Path>,
    reference_key: Option<&str>,
    tolerance: f64,
    format: Format,
) -> Result<()> {
    check_number(
        "--tolerance",
        tolerance,
        0.0,
        true,
        " (the largest allowed absolute difference)",
    )?;
    let mut ins = files::model_roles(&args.model, "the model");
    ins.push(("--inputs".into(), inputs.to_path_buf()));
    ins.extend(reference.map(|p| ("--reference".to_string(), p.to_path_buf())));
    let outs: Vec<(&str, &Path)> = output.map(|o| ("-o", o)).into_iter().collect();
    files::check_outputs(&outs, &ins)?;
    let read_files: Vec<PathBuf> = ins.into_iter().map(|(_, p)| p).collect();
    let arrays = read_npz(inputs)?;
    let p = load(args, Some(&arrays))?;
    let wanted = eval_inputs(&p, &arrays, inputs)?;
    check_result_sizes(&p)?;
    let start = Instant::now();
    let outs = hzp_runtime::eval::evaluate(&p, &wanted).map_err(|e| miette!("{e}"))?;
    let elapsed = start.elapsed();

    // Compare against a reference, if given.
    let refs = reference.map(read_npz).transpose()?;
    let picked = match (&refs, reference) {
        (Some(refs), Some(rpath)) => reference_arrays(&p, &outs, refs, rpath, reference_key)?,
        _ => vec![None; outs.len()],
    };
    let mut rows = Vec::new();
    let mut worst: Option<f64> = None;
    for ((name, t), r) in outs.iter().zip(picked) {
        let diff = match r {
            Some((rk, rt)) => Some((
                rk.clone(),
                max_abs_diff(t, rt).ok_or_else(|| {
                    miette!(
                        "output `{name}` is {} but reference `{rk}` is {}",
                        shape_str(t),
                        shape_str(rt)
                    )
                })?,
            )),
            None => None,
        };
        if let Some((_, d)) = &diff {
            worst = Some(worst.map_or(*d, |w: f64| w.max(*d)));
        }
        rows.push((name.clone(), t, diff));
    }
    if let Some(out) = output {
        files::write_npz(out, &read_files, &outs)?;
    }
    match format {
        Format::Json => {
            let list: Vec<serde_json::Value> = rows
                .iter()
                .map(|(name, t, diff)| {
                    let stats = stats(t);
                    serde_json::json!({
                        "name": name,
                        "dtype": t.dtype().name(),
                        "shape": t.shape,
                        "min": stats.0, "max": stats.1, "mean": stats.2,
                        "reference": diff.as_ref().map(|(k, _)| k),
                        "max_abs_diff": diff.as_ref().map(|(_, d)| d),
                    })
                })
                .collect();
            let v = serde_json::json!({
                "model": p.name,
                "seconds": elapsed.as_secs_f64(),
                "outputs": list,
                "within_tolerance": worst.map(|w| w <= tolerance),
            });
            outln!("{}", serde_json::to_string_pretty(&v).into_diagnostic()?);
        }
        Format::Text => {
            outln!(
                "evaluated {} on the CPU in {:.1} ms",
                p.name,
                elapsed.as_secs_f64() * 1e3
            );
            for (name, t, diff) in &rows {
                let (mn, mx, mean) = stats(t);
                out!(
                    "  {name}: {}  min {mn:.4}  max {mx:.4}  mean {mean:.4}",
                    shape_str(t)
                );
                if let Some((rk, d)) = diff {
                    out!("  max |diff| vs {rk}: {d:.3e}");
                }
                outln!();
            }
            if let Some(out) = output {
                outln!("wrote {}", out.display());
            }
        }
    }
    if let Some(w) = worst {
        if w > tolerance {
            return Err(miette!(
                "outputs differ from the reference by up to {w:.3e}, more than the tolerance {tolerance:e}"
            ));
        }
    }
    Ok(())
}

/// The array of the reference file each output is compared with: the array named after the
/// output; for a model with one output, `--reference-key NAME`, else the file's only array
/// that is not an input. Several candidates, or none for any output, is an error naming the
/// arrays (a reference that compares nothing would pass silently).
fn reference_arrays<'a>(
    p: &Program,
    outs: &[(String, Tensor)],
    refs: &'a [(String, Tensor)],
    file: &Path,
    key: Option<&str>,
) -> Result<Vec<Option<(&'a String, &'a Tensor)>>> {
    let all = || {
        refs.iter()
            .map(|(k, _)| format!("`{k}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(key) = key {
        if outs.len() != 1 {
            return Err(miette!(
                "--reference-key picks the reference array of a model with one output; this model has {} ({}): name the arrays of {} after them",
                outs.len(),
                outs.iter().map(|(k, _)| format!("`{k}`")).collect::<Vec<_>>().join(", "),
                file.display()
            ));
        }
        let r = refs.iter().find(|(k, _)| k == key).ok_or_else(|| {
            miette!(
                "--reference-key {key}: {} has no such array (it has: {})",
                file.display(),
                all()
            )
        })?;
        return Ok(vec![Some((&r.0, &r.1))]);
    }
    let is_input = |k: &str| p.inputs.iter().any(|&v| p.value(v).name == k);
    let mut picked = Vec::new();
    for (name, _) in outs {
        if let Some(r) = refs.iter().find(|(k, _)| k == name) {
            picked.push(Some((&r.0, &r.1)));
            continue;
        }
        if outs.len() == 1 {
            let cands: Vec<&(String, Tensor)> = refs.iter().filter(|(k, _)| !is_input(k)).collect();
            match cands.as_slice() {
                [one] => picked.push(Some((&one.0, &one.1))),
                [] => {
                    return Err(miette!(
                        "{} has no array for output `{name}` (none is named so, and every array is an input: {})",
                        file.display(),
                        all()
                    ))
                }
                many => {
                    return Err(miette!(
                        "{} has {} arrays that could be the reference for output `{name}` ({}): pass --reference-key NAME to pick one",
                        file.display(),
                        many.len(),
                        many.iter().map(|(k, _)| format!("`{k}`")).collect::<Vec<_>>().join(", ")
                    ))
                }
            }
        } else {
            picked.push(None);
        }
    }
    if picked.iter().all(Option::is_none) {
        return Err(miette!(
            "{} has no array named after an output of the model ({}; it has: {})",
            file.display(),
            outs.iter()
                .map(|(k, _)| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", "),
            all()
        ));
    }
    Ok(picked)
}

fn stats(t: &Tensor) -> (f64, f64, f64) {
    let v = t.to_f64_vec();
    if v.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    let mn = v.iter().cloned().fold(f64::INFINITY, f64::min);
    let mx = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    (mn, mx, v.iter().sum::<f64>() / v.len() as f64)
}

/// Peak resident memory of this process so far (Linux), in bytes.
fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub fn bench_import(args: &ModelArgs, repeat: usize) -> Result<()> {
    let repeat = repeat.max(1);
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..repeat {
        let start = Instant::now();
        let p = load(args, None)?;
        hzp_ir::verify(&p)
            .map_err(|e| miette!("{e}"))
            .wrap_err("verifying the imported program")?;
        times.push(start.elapsed().as_secs_f64());
        last = Some(p);
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let p = last.expect("repeat >= 1");
    outln!(
        "import + verify {}: {} nodes, {} parameters",
        args.model,
        p.nodes.len(),
        p.num_parameters()
    );
    outln!(
        "  median {:.3} s over {} runs (min {:.3} s, max {:.3} s)",
        median,
        times.len(),
        times[0],
        times[times.len() - 1]
    );
    match peak_rss_bytes() {
        Some(b) => outln!(
            "  peak resident memory {:.1} MiB",
            b as f64 / (1 << 20) as f64
        ),
        None => outln!("  peak resident memory: not available on this OS"),
    }
    Ok(())
}

// ---------------------------------------------------------------- training

use crate::TrainArgs;
use hzp_passes::train::ties::{self, Tie};
use hzp_passes::train::{self as tr, LossKind, Optimizer, TrainConfig};

/// What `grad` and `train` share: the step program, the batch, and the ties made.
struct Prepared {
    step: Program,
    batch: Vec<(String, Tensor)>,
    ties: Vec<Tie>,
    /// The forward program at one micro-batch (ties made, frozen parameters constant).
    fwd: Program,
    cfg: TrainConfig,
}

fn parse_pair(s: &str, what: &str) -> Result<(f64, f64)> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    match parts.as_slice() {
        [a, b] => Ok((
            a.parse()
                .map_err(|_| miette!("{what} `{s}`: `{a}` is not a number"))?,
            b.parse()
                .map_err(|_| miette!("{what} `{s}`: `{b}` is not a number"))?,
        )),
        _ => Err(miette!(
            "{what} must be two numbers like 0.9,0.999, got `{s}`"
        )),
    }
}

/// The loss flags in one string, as a plan records them (`lm`, `ce labels=y`, ...): parsed
/// back by [`loss_from_spec`].
pub(crate) fn loss_spec(t: &TrainArgs) -> String {
    let mut s = t.loss.clone();
    if let Some(l) = &t.labels {
        s.push_str(&format!(" labels={l}"));
    }
    if let Some(x) = &t.target {
        s.push_str(&format!(" target={x}"));
    }
    if t.router_aux_loss != 0.0 {
        s.push_str(&format!(" router_aux={:?}", t.router_aux_loss));
    }
    s
}

/// The loss a plan records (see [`loss_spec`]).
pub(crate) fn loss_from_spec(spec: &str) -> Result<LossKind> {
    let mut parts = spec.split_whitespace();
    let kind = parts.next().unwrap_or("lm");
    let (mut labels, mut target, mut aux) = (None, None, 0.0);
    for p in parts {
        match p.split_once('=') {
            Some(("labels", v)) => labels = Some(v),
            Some(("target", v)) => target = Some(v),
            Some(("router_aux", v)) => {
                aux = v.parse().map_err(|_| {
                    miette!("the plan's loss `{spec}`: router_aux `{v}` is not a number")
                })?
            }
            _ => return Err(miette!("the plan's loss `{spec}` is not one hzp reads")),
        }
    }
    LossKind::parse(kind, labels, target)
        .and_then(|l| l.with_router_aux(aux))
        .map_err(|e| miette!("{e}"))
}

/// The most micro-batches a step may be split into (each is unrolled into the step; the
/// plan verifier has the same limit).
pub(crate) const MAX_MICRO_BATCHES: usize = hzp_passes::plan::verify::MAX_MICRO_BATCHES;

/// A flag's value must be a finite number in a range; the message names the flag, the value
/// and the range.
pub(crate) fn check_number(
    flag: &str,
    v: f64,
    min: f64,
    min_inclusive: bool,
    note: &str,
) -> Result<()> {
    let ok = v.is_finite() && if min_inclusive { v >= min } else { v > min };
    if ok {
        return Ok(());
    }
    Err(miette!(
        "{flag} {v}: must be a finite number {} {min}{note}",
        if min_inclusive {
            "at least"
        } else {
            "greater than"
        }
    ))
}

/// The optimizer's and clipping's numbers, checked as torch.optim checks them (and finite).
fn check_train_numbers(t: &TrainArgs) -> Result<()> {
    check_number("--lr", t.lr, 0.0, true, " (a learning rate)")?;
    check_number("--eps", t.eps, 0.0, true, "")?;
    if let Some(w) = t.weight_decay {
        check_number("--weight-decay", w, 0.0, true, "")?;
    }
    check_number("--momentum", t.momentum, 0.0, true, "")?;
    if let Some(c) = t.clip_grad_norm {
        check_number(
            "--clip-grad-norm",
            c,
            0.0,
            false,
            " (the largest global gradient norm)",
        )?;
    }
    Ok(())
}

pub(crate) fn train_config(t: &TrainArgs, with_optimizer: bool) -> Result<TrainConfig> {
    let loss = LossKind::parse(&t.loss, t.labels.as_deref(), t.target.as_deref())
        .and_then(|l| l.with_router_aux(t.router_aux_loss))
        .map_err(|e| miette!("{e}"))?;
    check_train_numbers(t)?;
    let optimizer = if !with_optimizer {
        None
    } else {
        let betas = || -> Result<(f64, f64)> {
            let (beta1, beta2) = parse_pair(&t.betas, "--betas")?;
            for (b, which) in [(beta1, "first"), (beta2, "second")] {
                if !(0.0..1.0).contains(&b) {
                    return Err(miette!(
                        "--betas {}: the {which} beta is {b}; each must be at least 0 and below 1 (as torch.optim.AdamW requires)",
                        t.betas
                    ));
                }
            }
            Ok((beta1, beta2))
        };
        if t.optimizer != "muon" {
            if t.muon_lr != hzp_passes::train::muon::DEFAULT_LR {
                return Err(miette!(
                    "--muon-lr is Muon's learning rate; it needs --optimizer muon (not {})",
                    t.optimizer
                ));
            }
            if t.muon_adjust_lr != "original" {
                return Err(miette!(
                    "--muon-adjust-lr needs --optimizer muon (not {})",
                    t.optimizer
                ));
            }
            if t.muon_placement != "replicated" {
                return Err(miette!(
                    "--muon-placement places Muon's Newton-Schulz work; it needs --optimizer muon (not {})",
                    t.optimizer
                ));
            }
            if t.muon_ns_precision != "bf16" {
                return Err(miette!(
                    "--muon-ns-precision needs --optimizer muon (not {})",
                    t.optimizer
                ));
            }
        }
        Some(match t.optimizer.as_str() {
            "adamw" => {
                let (beta1, beta2) = betas()?;
                Optimizer::AdamW {
                    lr: t.lr,
                    beta1,
                    beta2,
                    eps: t.eps,
                    weight_decay: t.weight_decay.unwrap_or(0.01),
                }
            }
            "muon" => {
                let (beta1, beta2) = betas()?;
                check_number("--muon-lr", t.muon_lr, 0.0, true, " (Muon's learning rate)")?;
                if t.lr <= 0.0 {
                    return Err(miette!(
                        "--optimizer muon: Muon's learning rate follows --lr's schedule (--muon-lr x rate / --lr), so --lr must be above 0, not {}",
                        t.lr
                    ));
                }
                let adjust = hzp_passes::train::muon::MuonAdjust::parse(&t.muon_adjust_lr)
                    .map_err(|e| miette!("--muon-adjust-lr: {e}"))?;
                let ns_bf16 = match t.muon_ns_precision.as_str() {
                    "bf16" => true,
                    "fp32" | "f32" => false,
                    other => {
                        return Err(miette!(
                            "--muon-ns-precision `{other}`: expected bf16 (torch's) or fp32"
                        ))
                    }
                };
                let placement = hzp_passes::train::muon::MuonPlacement::parse(&t.muon_placement)
                    .map_err(|e| miette!("--muon-placement: {e}"))?;
                Optimizer::Muon {
                    lr: t.lr,
                    beta1,
                    beta2,
                    eps: t.eps,
                    weight_decay: t.weight_decay.unwrap_or(0.01),
                    muon: hzp_passes::train::muon::MuonSettings {
                        ns_bf16,
                        placement,
                        ..hzp_passes::train::muon::MuonSettings::torch(t.muon_lr, adjust)
                    },
                }
            }
            "sgd" => Optimizer::Sgd {
                lr: t.lr,
                momentum: t.momentum,
                weight_decay: t.weight_decay.unwrap_or(0.0),
            },
            other => {
                return Err(miette!(
                    "unknown optimizer `{other}` (expected adamw, sgd or muon)"
                ))
            }
        })
    };
    let compute = match t.precision.as_deref().unwrap_or("fp32") {
        "fp32" | "f32" => hzp_ir::DType::F32,
        "bf16" => hzp_ir::DType::BF16,
        "fp16" | "f16" => hzp_ir::DType::F16,
        other => {
            return Err(miette!(
                "unknown precision `{other}` (expected fp32, bf16 or fp16)"
            ))
        }
    };
    if t.micro_batches == 0 {
        return Err(miette!("--micro-batches must be at least 1"));
    }
    if t.micro_batches > MAX_MICRO_BATCHES {
        return Err(miette!(
            "--micro-batches {} is more than the limit of {MAX_MICRO_BATCHES} (each micro-batch is a copy of the forward and backward in the step)",
            t.micro_batches
        ));
    }
    for stage in &t.print_after {
        if !["import", "loss", "autodiff", "optimizer"].contains(&stage.as_str()) {
            return Err(miette!(
                "--print-after `{stage}`: the stages are import, loss, autodiff, optimizer"
            ));
        }
    }
    Ok(TrainConfig {
        loss,
        optimizer,
        clip_grad_norm: t.clip_grad_norm,
        micro_batches: t.micro_batches,
        compute,
    })
}

/// With `--optimizer muon`: which parameters Muon updates (and as what linear map) and how
/// many AdamW does; an error when Muon has nothing to update.
pub(crate) fn note_muon_split(fwd: &Program, cfg: &TrainConfig) -> Result<()> {
    let Some(Optimizer::Muon { .. }) = &cfg.optimizer else {
        return Ok(());
    };
    let m = tr::muon_parameters(fwd).map_err(|e| miette!("{e}"))?;
    let maps: Vec<String> = m
        .iter()
        .map(|(n, x)| format!("{n} ({}->{})", x.in_features, x.out_features))
        .collect();
    note!(
        "muon: {} matrices (in->out features): {}; AdamW: the other {} parameters",
        m.len(),
        maps.join(", "),
        fwd.params.len() - m.len()
    );
    Ok(())
}

fn prepare(
    args: &ModelArgs,
    inputs: &Path,
    t: &TrainArgs,
    with_optimizer: bool,
) -> Result<Prepared> {
    let arrays = read_npz(inputs)?;
    prepare_arrays(args, arrays, inputs, t, with_optimizer)
}

/// [`prepare`] on arrays at hand (`source` names them in messages).
fn prepare_arrays(
    args: &ModelArgs,
    arrays: Vec<(String, Tensor)>,
    inputs: &Path,
    t: &TrainArgs,
    with_optimizer: bool,
) -> Result<Prepared> {
    let cfg = train_config(t, with_optimizer)?;
    let m = cfg.micro_batches;
    // The model is imported at micro-batch shapes: axis 0 of every array divided by m.
    let mut micro = Vec::new();
    for (k, a) in &arrays {
        let mut shape = a.shape.clone();
        if m > 1 {
            match shape.first_mut() {
                Some(d) if *d % m == 0 => *d /= m,
                _ => {
                    return Err(miette!(
                        "--micro-batches {m}: `{k}` in {} is {}; its first dim must divide by {m}",
                        inputs.display(),
                        a.ty()
                    ))
                }
            }
        }
        micro.push((
            k.clone(),
            Tensor::zeros(&hzp_ir::TensorType::new(a.dtype(), shape)),
        ));
    }
    let mut fwd = load(args, Some(&micro))?;
    // Models with fixed shapes (.hzp, presets) must already be at micro-batch shape.
    for &v in &fwd.inputs {
        let val = fwd.value(v);
        if let Some((_, t)) = micro.iter().find(|(k, _)| *k == val.name) {
            if t.shape != val.ty.shape {
                return Err(miette!(
                    "input `{}` of the model is fixed at {}, but {} gives {} rows{}: the model must take one micro-batch ({})",
                    val.name,
                    val.ty,
                    inputs.display(),
                    t.shape.first().map_or(0, |d| d * m),
                    if m > 1 { format!(" split into {m} micro-batches") } else { String::new() },
                    hzp_ir::TensorType::new(val.ty.dtype, t.shape.clone())
                ));
            }
        }
    }
    let made = apply_freeze_and_ties(&mut fwd, t, args)?;
    note_muon_split(&fwd, &cfg)?;
    let show = |stage: &str, p: &Program| -> Result<()> {
        if t.print_after.iter().any(|s| s == stage) {
            outln!("# --print-after {stage}\n{}", hzp_ir::text::print(p));
        }
        Ok(())
    };
    show("import", &fwd)?;
    let fwd_c = tr::lower_precision(&fwd, cfg.compute).map_err(|e| miette!("{e}"))?;
    if t.print_after.iter().any(|s| s == "loss") {
        show(
            "loss",
            &tr::attach_loss(&fwd_c, &cfg.loss).map_err(|e| miette!("{e}"))?,
        )?;
    }
    if t.print_after.iter().any(|s| s == "autodiff") {
        show(
            "autodiff",
            &tr::gradient_program(&fwd_c, &cfg.loss).map_err(|e| miette!("{e}"))?,
        )?;
    }
    let step = tr::training_step(&fwd, &cfg).map_err(|e| miette!("{e}"))?;
    show("optimizer", &step)?;
    let batch = program_inputs(&step, &arrays, inputs)?;
    Ok(Prepared {
        step,
        batch,
        ties: made,
        fwd,
        cfg,
    })
}

/// The arrays of `arrays` that `p` takes as inputs, checked by name, dtype and shape.
fn program_inputs(
    p: &Program,
    arrays: &[(String, Tensor)],
    file: &Path,
) -> Result<Vec<(String, Tensor)>> {
    p.inputs
        .iter()
        .filter(|&&v| p.value(v).name != hzp_passes::train::LR_INPUT)
        .map(|&v| {
            let val = p.value(v);
            let given = arrays.iter().find(|(k, _)| *k == val.name).map(|(_, t)| t);
            let t = given
                .or_else(|| p.specialized.get(&val.name))
                .ok_or_else(|| {
                    miette!(
                        "{} has no array `{}`, which the training step needs as {}",
                        file.display(),
                        val.name,
                        val.ty
                    )
                })?;
            if t.ty() != val.ty {
                return Err(miette!(
                    "`{}` in {} is {}, but the training step needs {}",
                    val.name,
                    file.display(),
                    t.ty(),
                    val.ty
                ));
            }
            Ok((val.name.clone(), t.clone()))
        })
        .collect()
}

/// Adds entries for retied copies (transposed back where needed), so that every original
/// initializer name has a value.
pub(crate) fn with_tied_copies(
    mut named: Vec<(String, Tensor)>,
    ties: &[Tie],
    prefix: &str,
) -> Vec<(String, Tensor)> {
    for tie in ties {
        let key = format!("{prefix}{}", tie.canonical);
        if let Some((_, t)) = named.iter().find(|(k, _)| *k == key) {
            let t = if tie.transposed {
                transpose_last2(t)
            } else {
                t.clone()
            };
            named.push((format!("{prefix}{}", tie.copy), t));
        }
    }
    named
}

fn transpose_last2(t: &Tensor) -> Tensor {
    let out = ties::transpose_last2(&t.to_f32_vec(), &t.shape);
    let mut shape = t.shape.clone();
    let r = shape.len();
    shape.swap(r - 2, r - 1);
    Tensor::from_f64(
        t.dtype(),
        shape,
        &out.iter().map(|&x| x as f64).collect::<Vec<_>>(),
    )
}

pub fn grad(args: &ModelArgs, inputs: &Path, t: &TrainArgs, output: &Path) -> Result<()> {
    let mut ins = files::model_roles(&args.model, "the model");
    ins.push(("--inputs".into(), inputs.to_path_buf()));
    files::check_outputs(&[("-o", output)], &ins)?;
    let read_files: Vec<PathBuf> = ins.into_iter().map(|(_, p)| p).collect();
    let prep = prepare(args, inputs, t, false)?;
    check_result_sizes(&prep.step)?;
    let start = Instant::now();
    let outs = hzp_runtime::eval::evaluate(&prep.step, &prep.batch).map_err(|e| miette!("{e}"))?;
    let n_params = prep.step.params.len();
    let grads_from = outs.len() - n_params;
    let mut named = vec![("loss".to_string(), outs[0].1.clone())];
    if t.clip_grad_norm.is_some() {
        named.push(("grad_norm".to_string(), outs[1].1.clone()));
    }
    let grads: Vec<(String, Tensor)> = prep
        .step
        .params
        .iter()
        .zip(&outs[grads_from..])
        .map(|(prm, (_, g))| (prep.step.value(prm.value).name.clone(), g.clone()))
        .collect();
    named.extend(with_tied_copies(grads, &prep.ties, ""));
    files::write_npz(output, &read_files, &named)?;
    outln!(
        "loss {:.6}; {} gradients written to {} ({:.1} ms)",
        outs[0].1.to_f64_vec()[0],
        named.len() - 1,
        output.display(),
        start.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

pub fn train(
    args: &ModelArgs,
    inputs: Option<&Path>,
    t: &TrainArgs,
    steps: usize,
    save_params: Option<&Path>,
    session: &crate::session::LoopArgs,
    format: Format,
) -> Result<()> {
    use crate::session::{self as ss, Evaluator, Metrics};
    let text = format == Format::Text;
    let arrays = train_arrays(args, inputs, session)?;
    let source = inputs.unwrap_or(Path::new("--shape"));
    let prep = prepare_arrays(args, arrays, source, t, true)?;
    let mut ins = files::model_roles(&args.model, "the model");
    ins.extend(inputs.map(|p| ("--inputs".to_string(), p.to_path_buf())));
    ins.extend(session.data.clone().map(|p| ("--data".to_string(), p)));
    ins.extend(
        session
            .val_data
            .clone()
            .map(|p| ("--val-data".to_string(), p)),
    );
    let mut outs: Vec<(&str, &Path)> = Vec::new();
    outs.extend(save_params.map(|p| ("--save-params", p)));
    outs.extend(session.log.as_deref().map(|p| ("--log", p)));
    files::check_outputs(&outs, &ins)?;
    let read_files: Vec<PathBuf> = ins.into_iter().map(|(_, p)| p).collect();
    let schedule = session.schedule(t.lr, steps)?;
    let eval_every = session.eval_period(steps)?;
    let p = &prep.step;
    check_result_sizes(p)?;
    let (mut feed, val_feed) = match ss::open_feeds(session, p, 1)? {
        Some((f, v)) => (Some(f), v),
        None => (None, None),
    };
    if let (true, Some(f)) = (text, &feed) {
        outln!("{}", f.data_line());
    }
    let mut evaluator = match val_feed {
        Some(vf) => {
            let lowered =
                tr::lower_precision(&prep.fwd, prep.cfg.compute).map_err(|e| miette!("{e}"))?;
            let program = tr::attach_loss(&lowered, &prep.cfg.loss).map_err(|e| miette!("{e}"))?;
            let e = Evaluator::new(program, vf, session.eval_batches)?;
            if text {
                outln!("evaluation: {}", e.describe());
            }
            Some(e)
        }
        None => None,
    };
    let mut metrics = Metrics::open(session.log.as_deref())?;
    let pb = if text { ss::progress(steps, 0) } else { None };
    let norm_name = (p.outputs.len() > 1).then(|| p.value(p.outputs[1]).name.clone());
    let mut trainer = hzp_runtime::train::Trainer::new(&prep.step).map_err(|e| miette!("{e}"))?;
    let mut losses = Vec::new();
    let mut times = Vec::new();
    let plain = session.is_plain();
    for s in 0..steps {
        let lr = schedule.at(s);
        let first = feed.as_ref().map_or(0, |f| (s * f.rows) as u64);
        let batch = ss::step_batch(p, &prep.batch, feed.as_mut(), first, lr)?;
        let start = Instant::now();
        let outs = trainer
            .step(&batch)
            .map_err(|e| miette!("step {}: {e}", s + 1))?;
        let dt = start.elapsed().as_secs_f64();
        let loss = outs[0].1.to_f64_vec()[0];
        let done = s + 1;
        let val_loss = match (&mut evaluator, eval_every) {
            (Some(e), Some(k)) if done.is_multiple_of(k) || done == steps => {
                Some(e.loss(&trainer.parameters())?)
            }
            _ => None,
        };
        let report = ss::StepReport {
            step: done,
            loss: Some(loss),
            lr,
            seconds: dt,
            tokens: feed.as_ref().map(|f| f.rows * f.seq),
            grad_norm: norm_name.as_ref().and_then(|n| {
                outs.iter()
                    .find(|(k, _)| k == n)
                    .and_then(|(_, t)| t.to_f64_vec().first().copied())
            }),
            val_loss,
        };
        if text {
            // without a schedule, data or evaluation: the line `hzp train` always printed
            let line = if plain {
                format!("step {done:>4}  loss {loss:.6}  ({:.1} ms)", dt * 1e3)
            } else {
                report.line()
            };
            ss::say(&pb, &line)?;
            if let Some(b) = &pb {
                b.set_position(done as u64);
            }
        }
        metrics.write(&report.json())?;
        losses.push(loss);
        times.push(dt);
    }
    if let Some(b) = pb {
        b.finish_and_clear();
    }
    if let Some(out) = save_params {
        let params = with_tied_copies(trainer.parameters(), &prep.ties, "");
        files::write_params(out, &read_files, &params)?;
        if text {
            outln!("saved {} parameters to {}", params.len(), out.display());
        }
    }
    if format == Format::Json {
        let v = serde_json::json!({
            "model": args.model,
            "steps": steps,
            "losses": losses,
            "step_seconds": times,
        });
        outln!("{}", serde_json::to_string_pretty(&v).into_diagnostic()?);
    }
    Ok(())
}

/// The names of a repeatable, comma-separated flag (`--freeze a,b --freeze c`).
pub(crate) fn flag_list(v: &[String]) -> Vec<String> {
    v.iter()
        .flat_map(|s| s.split(','))
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// The arrays of `hzp train`: --inputs, and with --data a placeholder for the token input at
/// the shape --shape gives (the model is imported at that shape; the data fills it every
/// step).
fn train_arrays(
    args: &ModelArgs,
    inputs: Option<&Path>,
    session: &crate::session::LoopArgs,
) -> Result<Vec<(String, Tensor)>> {
    let mut arrays = match inputs {
        Some(p) => read_npz(p)?,
        None => Vec::new(),
    };
    let token_name = session
        .data_input
        .clone()
        .unwrap_or_else(|| "input_ids".to_string());
    if session.data.is_some() && !arrays.iter().any(|(k, _)| *k == token_name) {
        let shapes = parse_shapes(&args.shapes)?;
        let shape = shapes.get(&token_name).ok_or_else(|| {
            miette!(
                "--data: give the batch shape of `{token_name}` with --shape {token_name}=BxT (B rows of T tokens per step)"
            )
        })?;
        arrays.push((
            token_name.clone(),
            Tensor::zeros(&hzp_ir::TensorType::new(hzp_ir::DType::I64, shape.clone())),
        ));
    } else if session.data.is_none() && inputs.is_none() {
        return Err(miette!(
            "hzp train needs the batch: --inputs IN.npz (the same batch every step) or --data TOKENS.bin with --shape input_ids=BxT"
        ));
    }
    Ok(arrays)
}

/// `--freeze`, `--untie` and `--retie` on a forward program (what `grad`, `train` and
/// `compile` share): frozen parameters become constants; `--untie NAME` gives each reader of
/// NAME its own parameter; with `--retie`, parameters the exporter stored twice train as one
/// (and are reported); without it, a note says they train separately. Without a name map,
/// initializers an exporter merged are named in a warning. Returns the ties made, with the
/// name map's ties (PyTorch's own: the program trains one parameter, outputs carry every
/// key).
pub(crate) fn apply_freeze_and_ties(
    fwd: &mut Program,
    t: &TrainArgs,
    args: &ModelArgs,
) -> Result<Vec<ties::Tie>> {
    let freeze = flag_list(&t.freeze);
    let skipped = ties::freeze(fwd, &freeze).map_err(|e| miette!("{e}"))?;
    if !skipped.is_empty() {
        note!(
            "note: --freeze: not parameters of this program (constants, or folded away at import): {}",
            skipped.join(", ")
        );
    }
    for name in flag_list(&t.untie) {
        let made = ties::untie(fwd, &name).map_err(|e| miette!("{e}"))?;
        note!(
            "untie: `{name}` is read by {} nodes; each trains its own copy ({})",
            made.len() + 1,
            made.iter()
                .map(|(n, node)| format!("`{n}` for node `{node}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let map = name_map(args)?;
    if map.is_none() {
        for line in merged_lines(&ties::merged_initializers(fwd)) {
            note!("warning: {line}");
        }
    }
    let found = ties::find_ties(fwd);
    let mut made = if t.retie {
        ties::retie(fwd, &found).map_err(|e| miette!("{e}"))?;
        for tie in &found {
            note!(
                "retie: `{}` is {}`{}`; training them as one parameter",
                tie.copy,
                if tie.transposed {
                    "the transpose of "
                } else {
                    "a copy of "
                },
                tie.canonical
            );
        }
        found
    } else {
        if !found.is_empty() {
            note!(
                "note: {} parameter(s) equal another up to a transpose (e.g. `{}` and `{}`); they train separately unless you pass --retie",
                found.len(),
                found[0].copy,
                found[0].canonical
            );
        }
        Vec::new()
    };
    made.extend(map_ties(map.as_ref()));
    Ok(made)
}

/// The name map of the model (`--names`, or `<stem>.names.json` beside it).
pub(crate) fn name_map(args: &ModelArgs) -> Result<Option<hzp_frontends::names::NameMap>> {
    hzp_frontends::names::find_for_model(&args.model, args.names.as_deref())
        .map_err(|e| miette!("{e}"))
}

/// PyTorch's ties by a name map, as ties of the trained (canonical) key to each other key.
pub(crate) fn map_ties(map: Option<&hzp_frontends::names::NameMap>) -> Vec<ties::Tie> {
    map.map(|m| {
        m.tie_copies()
            .into_iter()
            .map(|(canonical, copy)| ties::Tie {
                canonical,
                copy,
                transposed: false,
            })
            .collect()
    })
    .unwrap_or_default()
}

/// One line per initializer an exporter merged, with the fix.
pub(crate) fn merged_lines(merged: &[ties::Merged]) -> Vec<String> {
    merged
        .iter()
        .map(|m| {
            let mut readers: Vec<String> =
                m.readers.iter().take(6).map(|r| format!("`{r}`")).collect();
            if m.readers.len() > 6 {
                readers.push(format!("and {} more", m.readers.len() - 6));
            }
            format!(
                "`{}`{} is read as {} by {} nodes of different layers ({}): the exporter merged equal-valued initializers, so they would train as one parameter where PyTorch has one per layer; export with frontends/python/hzp_export.py (it writes a name map), or pass --untie {} to train each its own",
                m.name,
                m.constant.map_or(String::new(), |c| format!(" (every element {c})")),
                m.read_as,
                m.readers.len(),
                readers.join(", "),
                m.name
            )
        })
        .collect()
}

/// Reads the model for `hzp compile` at the per-rank micro-batch shape: the global batch
/// (from --shape or --inputs) with axis 0 divided by `divisor` (ranks x micro-batches).
/// Presets are already per-rank micro-batches (their `batch`).
pub(crate) fn load_for_compile(
    args: &ModelArgs,
    inputs: Option<&Path>,
    divisor: usize,
) -> Result<Program> {
    if args.model.starts_with("preset:") {
        if !args.shapes.is_empty() || inputs.is_some() {
            return Err(miette!(
                "a preset's batch is set in the preset itself (e.g. preset:llama3-70b,batch=2,seq=4096): it is the micro-batch of one rank; --shape and --inputs do not apply"
            ));
        }
        return load(args, None);
    }
    let mut shapes = parse_shapes(&args.shapes)?;
    if let Some(path) = inputs {
        for (k, t) in read_npz(path)? {
            shapes.entry(k).or_insert(t.shape);
        }
    }
    for (name, shape) in shapes.iter_mut() {
        match shape.first_mut() {
            Some(d) if *d % divisor == 0 && *d >= divisor => *d /= divisor,
            _ => {
                return Err(miette!(
                    "the global batch of `{name}` ({shape:?}) must split evenly over {divisor} (ranks x micro-batches) along its first dim"
                ))
            }
        }
    }
    // The batch is split over ranks and micro-batches, so input values cannot be folded in.
    let opts = LoadOptions {
        shapes,
        bind: parse_binds(&args.bind)?,
        no_fuse_attention: args.no_fuse_attention,
        no_fuse_moe: args.no_fuse_moe,
        names: args.names.clone(),
        ..Default::default()
    };
    let p = load_model(&args.model, &opts).map_err(miette::Report::new)?;
    if !p.specialized.is_empty() {
        return Err(miette!(
            "the model was specialized on the value of {} (--bind), and hzp compile does not \
             take specialized programs yet: the plan would not check those values when it runs",
            p.specialized
                .keys()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok(p)
}
