//! More architectures than the main test models, from tests/models/extra/ (made by
//! tests/models/make_extra_models.py; see its README): Gemma 2, ViT, Whisper's encoder, GPT-J,
//! Qwen2-MoE, ModernBERT, T5's encoder, Qwen3, OPT and Phi, exported by the legacy exporter
//! (opsets 14, 17, 20) and the dynamo exporter (opsets 18, 23). Each file imports, evaluates
//! to PyTorch's output, and gives PyTorch's loss, gradients and parameters after 5 AdamW
//! steps (references in tests/models/extra/ref/, keyed by ONNX initializer name; the
//! comparison rules of tests/training.rs).

mod common;
use common::*;
use hzp_ir::{verify, Tensor};
use std::path::{Path, PathBuf};
use std::process::Command;

/// tests/models/extra/, or the folder `HZP_EXTRA_MODELS` names (e.g. the 26 more models of
/// `make_extra_models.py --more --out DIR`, which are not committed).
fn extra_dir() -> PathBuf {
    match std::env::var_os("HZP_EXTRA_MODELS") {
        Some(d) => PathBuf::from(d),
        None => own_models_dir().join("extra"),
    }
}

/// One exported file with its inputs and reference.
struct Case {
    stem: String,
    onnx: PathBuf,
    io: PathBuf,
    refs: Vec<(String, Tensor)>,
    loss: String,
    unmapped: Vec<String>,
}

fn cases() -> Vec<Case> {
    let dir = extra_dir();
    let mut onnx: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "onnx"))
        .collect();
    onnx.sort();
    assert!(
        onnx.len() >= 10,
        "{}: only {} models",
        dir.display(),
        onnx.len()
    );
    eprintln!("{} ONNX files in {}", onnx.len(), dir.display());
    onnx.into_iter()
        .map(|path| {
            let file = path.file_name().unwrap().to_string_lossy().to_string();
            let stem = file.trim_end_matches(".onnx").to_string();
            let model = stem.split('.').next().unwrap().to_string();
            let json = dir.join(format!("ref/{stem}.ref.json"));
            let meta: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(&json)
                    .unwrap_or_else(|e| panic!("{}: {e}", json.display())),
            )
            .unwrap();
            let strings = |k: &str| -> Vec<String> {
                meta[k]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap().to_string())
                    .collect()
            };
            Case {
                onnx: path.clone(),
                io: dir.join(format!("{model}.io.npz")),
                refs: read_npz(&dir.join(format!("ref/{stem}.ref.npz"))),
                loss: meta["loss"].as_str().unwrap().to_string(),
                unmapped: strings("unmapped"),
                stem,
            }
        })
        .collect()
}

fn get<'a>(npz: &'a [(String, Tensor)], key: &str) -> Option<&'a Tensor> {
    npz.iter().find(|(k, _)| k == key).map(|(_, t)| t)
}

fn scalar(npz: &[(String, Tensor)], key: &str) -> f64 {
    get(npz, key)
        .unwrap_or_else(|| panic!("no `{key}`"))
        .to_f64_vec()[0]
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hzp-extra-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// `hzp CMD` on the case's model and batch with its loss, --retie and --freeze (as
/// tests/training.rs runs it); stdout, or the failure's text.
fn hzp(c: &Case, cmd: &str, extra: &[&str]) -> Result<String, String> {
    let mut command = Command::new(hzp_bin());
    command
        .arg(cmd)
        .arg(&c.onnx)
        .arg("--inputs")
        .arg(&c.io)
        .args(["--loss", &c.loss, "--retie"]);
    if !c.unmapped.is_empty() {
        command.args(["--freeze", &c.unmapped.join(",")]);
    }
    let out = command.args(extra).output().unwrap();
    // a failure is reported, never a panic (Rust's exit code 101)
    assert_ne!(
        out.status.code(),
        Some(101),
        "hzp {cmd} panicked: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(format!(
            "hzp {cmd} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `check` on every case and fails once, listing every case that failed.
fn for_each_case(what: &str, check: impl Fn(&Case) -> Result<String, String>) {
    let mut failed = Vec::new();
    for c in cases() {
        match check(&c) {
            Ok(msg) => eprintln!("{}: {msg}", c.stem),
            Err(e) => {
                eprintln!("{}: FAILED: {e}", c.stem);
                failed.push(format!("{}: {e}", c.stem));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{what}: {} failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

fn forward(c: &Case) -> Result<String, String> {
    let io = read_npz(&c.io);
    let opts = hzp_frontends::LoadOptions {
        shapes: io
            .iter()
            .filter(|(k, _)| k != "torch_out")
            .map(|(k, t)| (k.clone(), t.shape.clone()))
            .collect(),
        ..Default::default()
    };
    let p = hzp_frontends::load_model(c.onnx.to_str().unwrap(), &opts)
        .map_err(|e| format!("import: {e}"))?;
    verify(&p).map_err(|e| format!("verify: {e}"))?;
    let inputs = program_inputs(&p, &io);
    let outs = hzp_runtime::eval::evaluate(&p, &inputs).map_err(|e| format!("eval: {e}"))?;
    let torch = get(&io, "torch_out").unwrap();
    if outs.len() != 1 || outs[0].1.shape != torch.shape {
        return Err(format!("outputs {outs:?} vs torch_out {:?}", torch.shape));
    }
    let d = max_abs_diff(&outs[0].1, torch);
    if d >= 1e-4 {
        return Err(format!("max |hzp - torch| = {d:.3e} >= 1e-4"));
    }
    Ok(format!("max |hzp - torch| = {d:.3e}"))
}

fn gradients(c: &Case) -> Result<String, String> {
    let out = tmp(&format!("{}.grads.npz", c.stem));
    hzp(c, "grad", &["-o", out.to_str().unwrap()])?;
    let got = read_npz(&out);
    let (l, lr) = (scalar(&got, "loss"), scalar(&c.refs, "loss"));
    if (l - lr).abs() > 1e-5 * lr.abs().max(1e-3) {
        return Err(format!("loss {l} vs torch {lr}"));
    }
    let mut rows = Vec::new();
    for (k, want) in &c.refs {
        let Some(name) = k.strip_prefix("grad/") else {
            continue;
        };
        let have = get(&got, name).ok_or_else(|| format!("hzp wrote no gradient `{name}`"))?;
        if have.shape != want.shape {
            return Err(format!(
                "`{name}`: shape {:?} vs {:?}",
                have.shape, want.shape
            ));
        }
        let (a, b) = (have.to_f64_vec(), want.to_f64_vec());
        let d: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
        rows.push((name.to_string(), norm(&d), norm(&b)));
    }
    let global = norm(&rows.iter().map(|r| r.2).collect::<Vec<_>>());
    let mut bad = Vec::new();
    for (name, d, n) in &rows {
        // as tests/training.rs: relative L2 per parameter; a gradient that is zero in exact
        // arithmetic is round-off on both sides and held against the global norm
        let ok = *d <= 1e-4 * n || (*n <= 1e-6 * global && *d <= 1e-6 * global);
        if !ok {
            bad.push(format!("`{name}`: |diff| {d:.3e}, |torch| {n:.3e}"));
        }
    }
    if !bad.is_empty() {
        return Err(format!("gradients: {}", bad.join("; ")));
    }
    Ok(format!("loss {l:.6}, {} gradients match", rows.len()))
}

fn adamw(c: &Case) -> Result<String, String> {
    let out = tmp(&format!("{}.adamw.npz", c.stem));
    let text = hzp(
        c,
        "train",
        &[
            "--steps",
            "5",
            "--format",
            "json",
            "--save-params",
            out.to_str().unwrap(),
        ],
    )?;
    let got = read_npz(&out);
    let (mut dd, mut rr) = (0.0, 0.0);
    let mut bad = Vec::new();
    // The largest gradient element of the model: gradients below 1e-6 of it are round-off.
    let gmax = c
        .refs
        .iter()
        .filter(|(k, _)| k.starts_with("grad/"))
        .flat_map(|(_, t)| t.to_f64_vec())
        .fold(0.0f64, |m, x| m.max(x.abs()));
    for (k, want) in &c.refs {
        let Some(name) = k.strip_prefix("adamw5/") else {
            continue;
        };
        let have = get(&got, name).ok_or_else(|| format!("hzp saved no `{name}`"))?;
        let (a, b) = (have.to_f64_vec(), want.to_f64_vec());
        if a.len() != b.len() {
            return Err(format!("`{name}`: {} vs {} elements", a.len(), b.len()));
        }
        // Over the elements whose gradient is not round-off (see tests/training.rs: AdamW
        // divides a gradient by its own RMS, so the round-off of a gradient that is zero in
        // exact arithmetic, e.g. an attention key bias's, moves its element by up to ~lr
        // differently on each side). Those elements only have to stay within a few steps
        // of lr (1e-3) of torch's.
        let grad = get(&c.refs, &format!("grad/{name}")).unwrap().to_f64_vec();
        let (mut d, mut n) = (Vec::new(), Vec::new());
        for i in 0..a.len() {
            if grad[i].abs() >= 1e-6 * gmax {
                d.push(a[i] - b[i]);
                n.push(b[i]);
                dd += (a[i] - b[i]).powi(2);
                rr += b[i].powi(2);
            } else if (a[i] - b[i]).abs() > 1e-2 {
                bad.push(format!(
                    "`{name}`[{i}] (gradient ~0): {} vs torch {}",
                    a[i], b[i]
                ));
            }
        }
        // Per parameter 1e-4 (the whole model 1e-5, below): elements with small gradients
        // (mean losses of normalized outputs have many) drift most over 5 steps.
        let rel = norm(&d) / norm(&n).max(1e-12);
        if rel >= 1e-4 {
            bad.push(format!("`{name}`: rel err {rel:.3e}"));
        }
    }
    let total = (dd / rr.max(1e-300)).sqrt();
    if total >= 1e-5 {
        bad.push(format!("all parameters: rel err {total:.3e}"));
    }
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
    let losses: Vec<f64> = v["losses"]
        .as_array()
        .ok_or("no losses")?
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    // Losses within 1e-5 relative; a mean of normalized outputs is a near-cancelling sum
    // near 0, held to 1e-6 absolute.
    let want = get(&c.refs, "adamw5_loss").unwrap().to_f64_vec();
    if losses.len() != want.len()
        || losses
            .iter()
            .zip(&want)
            .any(|(a, b)| (a - b).abs() > 1e-5 * b.abs().max(0.1))
    {
        bad.push(format!("losses {losses:?} vs torch {want:?}"));
    }
    if !bad.is_empty() {
        return Err(format!("after 5 AdamW steps: {}", bad.join("; ")));
    }
    Ok(format!("5 AdamW steps match (rel err {total:.2e})"))
}

/// A global batch of 8 rows from the case's 2: integer inputs named `input_ids` shifted per
/// pair of rows (so ranks and micro-batches see different tokens), float inputs scaled per
/// pair, masks repeated.
fn global_batch(c: &Case) -> PathBuf {
    const ROWS: usize = 8;
    let io = read_npz(&c.io);
    let mut out = Vec::new();
    for (k, t) in io.iter().filter(|(k, _)| k != "torch_out") {
        let rows = t.shape[0];
        let row = t.numel() / rows;
        let mut shape = t.shape.clone();
        shape[0] = ROWS;
        let tiled = if t.dtype().is_float() {
            let v = t.to_f32_vec();
            let mut data = Vec::with_capacity(row * ROWS);
            for r in 0..ROWS {
                let scale = 1.0 + 0.25 * (r / rows) as f32;
                data.extend(v[(r % rows) * row..][..row].iter().map(|x| x * scale));
            }
            Tensor::f32(shape, data)
        } else {
            let v = t.to_i64_vec().unwrap();
            // ids stay below the largest one the case uses (within the vocabulary)
            let bound = v.iter().copied().max().unwrap_or(0) + 1;
            let mut data = Vec::with_capacity(row * ROWS);
            for r in 0..ROWS {
                let src = &v[(r % rows) * row..][..row];
                let shift = (r / rows) as i64 * 37;
                if k == "input_ids" {
                    data.extend(src.iter().map(|&x| (x + shift).rem_euclid(bound)));
                } else {
                    data.extend_from_slice(src);
                }
            }
            Tensor::i64(shape, data)
        };
        out.push((k.clone(), tiled));
    }
    let path = tmp(&format!("{}.batch8.npz", c.stem));
    hzp_frontends::npz::write(&path, &out).unwrap();
    path
}

/// Relative L2 distance of two parameter sets (every element of every parameter).
fn params_rel(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> Result<f64, String> {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for (k, want) in b {
        let have = get(a, k).ok_or_else(|| format!("no `{k}` in the multi-rank run"))?;
        let (x, y) = (have.to_f64_vec(), want.to_f64_vec());
        if x.len() != y.len() {
            return Err(format!("`{k}`: {} vs {} elements", x.len(), y.len()));
        }
        for (p, q) in x.iter().zip(&y) {
            d += (p - q) * (p - q);
            n += q * q;
        }
    }
    if a.len() != b.len() {
        return Err(format!("{} vs {} parameters", a.len(), b.len()));
    }
    Ok(d.sqrt() / n.sqrt().max(1e-30))
}

/// `hzp compile` (the default pipeline: planner, collective rewriting with per-unit
/// buckets, 2 micro-batches) + `hzp run` against `hzp train` on one rank, same global batch,
/// 3 AdamW steps: losses and parameters within 1e-5 relative. Mesh and strategy rotate over
/// the cases so every one of them is covered by some model.
fn multi_rank(c: &Case, k: usize) -> Result<String, String> {
    const CONFIGS: [(&str, &str); 4] = [
        ("gpu=2", "asynchzp"),
        ("node=2,gpu=2", "zero3"),
        ("gpu=4", "hsdp"),
        ("node=2,gpu=2", "ddp"),
    ];
    let (mesh, strategy) = CONFIGS[k % CONFIGS.len()];
    let batch = global_batch(c);
    let b = batch.to_str().unwrap();
    let with_batch = |cmd: &str, model: &Path, extra: &[&str]| -> Result<String, String> {
        let mut command = Command::new(hzp_bin());
        command.arg(cmd).arg(model).args(["--inputs", b]);
        command.args(extra);
        let out = command.output().unwrap();
        if !out.status.success() {
            return Err(format!(
                "hzp {cmd} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let mut model_flags = vec!["--loss", &c.loss, "--retie", "--micro-batches", "2"];
    let frozen = c.unmapped.join(",");
    if !c.unmapped.is_empty() {
        model_flags.extend(["--freeze", &frozen]);
    }
    let one = tmp(&format!("{}.mr.one.npz", c.stem));
    let text = with_batch(
        "train",
        &c.onnx,
        &[
            model_flags.as_slice(),
            &["--steps", "3", "--format", "json"],
            &["--save-params", one.to_str().unwrap()],
        ]
        .concat(),
    )?;
    let want_losses = json_losses(&text);
    let plan = tmp(&format!("{}.mr.plan.json", c.stem));
    with_batch(
        "compile",
        &c.onnx,
        &[
            model_flags.as_slice(),
            &["--mesh", mesh, "--strategy", strategy],
            &["-o", plan.to_str().unwrap()],
        ]
        .concat(),
    )?;
    let many = tmp(&format!("{}.mr.many.npz", c.stem));
    let text = with_batch(
        "run",
        &plan,
        &[
            "--steps",
            "3",
            "--format",
            "json",
            "--save-params",
            many.to_str().unwrap(),
        ],
    )?;
    let losses = json_losses(&text);
    let dl = losses
        .iter()
        .zip(&want_losses)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
        .fold(0.0f64, f64::max);
    // written so that NaN fails too
    let within = |x: f64| x <= 1e-5;
    if losses.len() != want_losses.len() || !within(dl) {
        return Err(format!(
            "{mesh} {strategy}: losses {losses:?} vs one rank {want_losses:?}"
        ));
    }
    let r = params_rel(&read_npz(&many), &read_npz(&one))?;
    if !within(r) {
        return Err(format!(
            "{mesh} {strategy}: parameters off by {r:.3e} relative after 3 steps"
        ));
    }
    Ok(format!(
        "{mesh} {strategy}: losses within {dl:.1e}, parameters within {r:.1e}"
    ))
}

#[test]
fn extra_models_multi_rank_plans_match_one_rank() {
    let cases = cases();
    let mut failed = Vec::new();
    for (k, c) in cases.iter().enumerate() {
        match multi_rank(c, k) {
            Ok(msg) => eprintln!("{}: {msg}", c.stem),
            Err(e) => {
                eprintln!("{}: FAILED: {e}", c.stem);
                failed.push(format!("{}: {e}", c.stem));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "multi-rank: {} of {} failed:\n{}",
        failed.len(),
        cases.len(),
        failed.join("\n")
    );
}

#[test]
fn extra_models_evaluate_to_torch_out() {
    for_each_case("forward", forward);
}

#[test]
fn extra_models_gradients_match_torch() {
    for_each_case("gradients", gradients);
}

#[test]
fn extra_models_five_adamw_steps_match_torch() {
    for_each_case("AdamW", adamw);
}

#[test]
fn every_extra_model_has_its_inputs_and_reference() {
    let dir = extra_dir();
    for c in cases() {
        assert!(c.io.exists(), "{}: no {}", c.stem, c.io.display());
        assert!(get(&c.refs, "adamw5_loss").is_some(), "{}", c.stem);
    }
    // and no reference is left without its model
    for e in std::fs::read_dir(dir.join("ref")).unwrap() {
        let p = e.unwrap().path();
        let f = p.file_name().unwrap().to_string_lossy().to_string();
        if let Some(stem) = f.strip_suffix(".ref.json") {
            assert!(
                Path::new(&dir.join(format!("{stem}.onnx"))).exists(),
                "{f} has no model"
            );
        }
    }
}
