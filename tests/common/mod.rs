//! Shared helpers for the end-to-end tests.
#![allow(dead_code)]

use hzp_frontends::{load_model, npz, LoadOptions};
use hzp_ir::{Program, Tensor};
use std::path::{Path, PathBuf};

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
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
        None => eprintln!("note: ../shared/onnx is absent; testing the project's own models only"),
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
    let opts = LoadOptions {
        no_fuse_attention,
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

pub fn hzp_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hzp"))
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
