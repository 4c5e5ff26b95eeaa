//! Shared helpers for the end-to-end tests.
#![allow(dead_code)]

pub mod skip;

use hzp_frontends::{load_model, npz, LoadOptions};
use hzp_ir::{Program, Tensor};
use std::path::{Path, PathBuf};

/// The checkout: `HZP_REPO` when set (a test binary taken to another machine, as the device
/// check does), else the one it was built from.
pub fn repo() -> PathBuf {
    std::env::var_os("HZP_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// The project's own test models (always present).
pub fn own_models_dir() -> PathBuf {
    repo().join("tests/models")
}

/// `../shared/onnx` beside the checkout, when present.
pub fn shared_models_dir() -> Option<PathBuf> {
    let d = repo().join("../shared/onnx");
    d.is_dir().then_some(d)
}

/// Every test model: (path to .onnx, path to its .io.npz).
pub fn all_models() -> Vec<(PathBuf, PathBuf)> {
    let mut dirs = vec![own_models_dir()];
    match shared_models_dir() {
        Some(d) => dirs.push(d),
        None => skip::skip(
            "",
            skip::Missing::Shared,
            "../shared/onnx is absent; testing the project's own models only",
        ),
    }
    let mut out = Vec::new();
    for d in dirs {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "onnx"))
            .collect();
        files.sort();
        for f in files {
            let stem = f.file_name().unwrap().to_string_lossy().to_string();
            let model = stem.split('.').next().unwrap().to_string();
            let io = d.join(format!("{model}.io.npz"));
            assert!(io.exists(), "{} has no {}", f.display(), io.display());
            out.push((f, io));
        }
    }
    out
}

/// The learning rate the tests' optimizers use.
pub const LR: f64 = 1e-3;

/// The learning rate `io` gives (`optimizer.lr`), else [`LR`].
fn lr_in(io: &[(String, Tensor)]) -> f64 {
    io.iter()
        .find(|(k, _)| k == hzp_passes::train::LR_INPUT)
        .map_or(LR, |(_, t)| t.to_f64_vec()[0])
}

/// Inputs of `io.npz` that are graph inputs of `p`, in the program's input order.
///
/// A training step's learning-rate input (`optimizer.lr`) is taken from `io` when there, else
/// set to [`LR`], the rate the tests' optimizers use.
pub fn program_inputs(p: &Program, io: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    let io = &hzp_passes::train::with_lr(p, io, lr_in(io));
    p.inputs
        .iter()
        .map(|&v| {
            let name = &p.value(v).name;
            io.iter()
                .find(|(k, _)| k == name)
                .cloned()
                .unwrap_or_else(|| panic!("io file lacks input {name}"))
        })
        .collect()
}

/// Imports `model` with input shapes bound from `io`.
pub fn import(model: &Path, io: &[(String, Tensor)]) -> Program {
    import_with(model, io, false)
}

/// [`import`], keeping attention as the exporter wrote it when `no_fuse_attention`.
pub fn import_with(model: &Path, io: &[(String, Tensor)], no_fuse_attention: bool) -> Program {
    import_in_form(model, io, no_fuse_attention, false)
}

/// [`import_with`], keeping mixtures of experts as the exporter wrote them when `no_fuse_moe`.
pub fn import_in_form(
    model: &Path,
    io: &[(String, Tensor)],
    no_fuse_attention: bool,
    no_fuse_moe: bool,
) -> Program {
    let opts = LoadOptions {
        no_fuse_attention,
        no_fuse_moe,
        shapes: io
            .iter()
            .filter(|(k, _)| k != "torch_out")
            .map(|(k, t)| (k.clone(), t.shape.clone()))
            .collect(),
        ..Default::default()
    };
    load_model(model.to_str().unwrap(), &opts)
        .unwrap_or_else(|e| panic!("importing {}: {e}", model.display()))
}

pub fn read_npz(p: &Path) -> Vec<(String, Tensor)> {
    npz::read(p).unwrap_or_else(|e| panic!("{e}"))
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape, b.shape);
    a.to_f64_vec()
        .iter()
        .zip(b.to_f64_vec())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// The hzp binary: `HZP_BIN` when set (beside a test binary taken to another machine), else
/// the one cargo built with the test.
pub fn hzp_bin() -> PathBuf {
    std::env::var_os("HZP_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_hzp")))
}

/// The per-step losses that `hzp train` or `hzp run` print with `--format json`.
pub fn json_losses(stdout: &str) -> Vec<f64> {
    let v: serde_json::Value = serde_json::from_str(stdout).unwrap();
    v["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

// ---- the CLI as a user runs it (every CLI test file uses these) ----

/// Runs the `hzp` binary with `args` and extra environment `env`, stdin closed. Returns the
/// exit code, stdout, and stderr with miette's wrapping undone (its `│` gutter dropped and
/// every run of whitespace one space), so tests can look for phrases. No CLI run may end in
/// a panic (Rust's exit code 101): asserted here, for every test that runs hzp.
pub fn hzp_env(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = std::process::Command::new(hzp_bin())
        .args(args)
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let code = out.status.code().unwrap_or(-1);
    assert_ne!(code, 101, "hzp {args:?} panicked:\n{err}");
    let flat: Vec<&str> = err.split_whitespace().filter(|w| *w != "│").collect();
    (
        code,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        flat.join(" "),
    )
}

/// [`hzp_env`] without extra environment.
pub fn hzp(args: &[&str]) -> (i32, String, String) {
    hzp_env(args, &[])
}

/// Runs hzp, asserts success, returns stdout.
#[track_caller]
pub fn ok(args: &[&str]) -> String {
    let (code, out, err) = hzp(args);
    assert_eq!(code, 0, "hzp {}: {err}", args.join(" "));
    out
}

/// Runs hzp, asserts exit code 1 (a user error) and that stderr holds every needle; returns
/// stderr.
#[track_caller]
pub fn fails_with(args: &[&str], needles: &[&str]) -> String {
    let (code, out, err) = hzp(args);
    assert_eq!(code, 1, "hzp {args:?}\nstdout: {out}\nstderr: {err}");
    for n in needles {
        assert!(err.contains(n), "hzp {args:?}: stderr lacks `{n}`:\n{err}");
    }
    err
}

/// A fresh, empty directory for one test: named by the test binary, the process, `tag` and
/// a counter, so tests running in parallel never share one.
pub fn tempdir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let exe = std::env::current_exe().ok();
    let bin = exe
        .as_ref()
        .and_then(|p| p.file_stem())
        .map_or("test".into(), |s| s.to_string_lossy().into_owned());
    let d = std::env::temp_dir().join(format!(
        "hzp-{bin}-{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A path as the `&str` an argument list takes.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}
