//! ONNX's per-operator conformance cases, when present: set `HZP_ONNX_NODE_CASES` to a
//! folder written by `frontends/tests/fixtures/make_onnx_node_cases.py` (one sub-folder per case with
//! `model.onnx`, `inputs.npz`, `outputs.npz`). Each case must either be refused with a clear
//! error (unsupported op, run-time shape) or import and reproduce ONNX's outputs on hzp's
//! CPU evaluator; a panic, an evaluation error or a wrong value fails the test. The folder
//! written by `examples/onnx_node_tests/make_cases.py` (the stricter suite that
//! `tests/onnx_node_cases.rs` runs through `hzp eval`) has the same layout; CI (`.ci/run`)
//! generates that one and runs both tests on it. Without the variable the test records a
//! skip (`tests/common/skip.rs`), which fails where `CI` is set.

#[path = "../../tests/common/skip.rs"]
mod skip;

use hzp_frontends::onnx::{import_file, ImportErrorKind, ImportOptions};
use hzp_ir::{DType, Tensor};
use std::collections::BTreeMap;

fn tolerance(d: DType) -> f64 {
    match d {
        DType::F16 | DType::BF16 => 2e-3,
        _ => 1e-4,
    }
}

fn compare(got: &Tensor, want: &Tensor) -> Result<(), String> {
    if got.shape != want.shape {
        return Err(format!("shape {:?}, expected {:?}", got.shape, want.shape));
    }
    if got.dtype() != want.dtype() {
        return Err(format!("dtype {}, expected {}", got.dtype(), want.dtype()));
    }
    let tol = tolerance(want.dtype());
    for (i, (x, y)) in got.to_f64_vec().iter().zip(want.to_f64_vec()).enumerate() {
        let ok = (x.is_nan() && y.is_nan()) || *x == y || (x - y).abs() <= tol * (1.0 + y.abs());
        if !ok {
            return Err(format!("element {i} is {x}, expected {y}"));
        }
    }
    Ok(())
}

#[test]
fn onnx_node_conformance_cases() {
    let Ok(root) = std::env::var("HZP_ONNX_NODE_CASES") else {
        skip::skip(
            "onnx_node_conformance_cases",
            skip::Missing::OnnxCases,
            "HZP_ONNX_NODE_CASES is not set (generate the cases with \
             examples/onnx_node_tests/make_cases.py DIR, `pip install onnx numpy`)",
        );
        return;
    };
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{root}: {e}"))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("model.onnx").exists())
        .collect();
    dirs.sort();
    assert!(
        !dirs.is_empty(),
        "{root}: no case folders (with model.onnx)"
    );
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    for d in &dirs {
        let name = d.file_name().unwrap().to_string_lossy().to_string();
        let (Ok(ins), Ok(outs)) = (
            hzp_frontends::npz::read(&d.join("inputs.npz")),
            hzp_frontends::npz::read(&d.join("outputs.npz")),
        ) else {
            *counts.entry("skipped (npz dtype)").or_default() += 1;
            continue;
        };
        let mut opts = ImportOptions::default();
        for (n, t) in &ins {
            opts.shapes.insert(n.clone(), t.shape.clone());
            // inputs that decide shapes specialize the program, as `hzp eval --inputs` does
            opts.values.insert(n.clone(), t.clone());
        }
        let imported = std::panic::catch_unwind(|| import_file(&d.join("model.onnx"), &opts));
        let p = match imported {
            Err(_) => {
                failures.push(format!("{name}: import panicked"));
                continue;
            }
            Ok(Err(e)) => {
                let kind = match e.kind {
                    ImportErrorKind::Unsupported => "refused: unsupported",
                    ImportErrorKind::Node if e.message.contains("computed at run time") => {
                        "refused: run-time shape"
                    }
                    _ => {
                        failures.push(format!("{name}: {e}"));
                        continue;
                    }
                };
                *counts.entry(kind).or_default() += 1;
                continue;
            }
            Ok(Ok(p)) => p,
        };
        let run = std::panic::catch_unwind(|| hzp_kernels::eval::evaluate(&p, &ins));
        let got = match run {
            Err(_) => {
                failures.push(format!("{name}: evaluation panicked"));
                continue;
            }
            Ok(Err(e)) => {
                failures.push(format!("{name}: evaluation failed: {e}"));
                continue;
            }
            Ok(Ok(g)) => g,
        };
        let mut bad = None;
        for (n, want) in &outs {
            match got.iter().find(|(g, _)| g == n) {
                None => bad = Some(format!("output `{n}` missing")),
                Some((_, g)) => {
                    if let Err(e) = compare(g, want) {
                        bad = Some(format!("output `{n}`: {e}"));
                    }
                }
            }
            if bad.is_some() {
                break;
            }
        }
        match bad {
            None => *counts.entry("pass").or_default() += 1,
            Some(b) => failures.push(format!("{name}: {b}")),
        }
    }
    println!(
        "{} cases: {counts:?}, {} failures",
        dirs.len(),
        failures.len()
    );
    for f in &failures {
        println!("  {f}");
    }
    assert!(
        failures.is_empty(),
        "{} conformance failures",
        failures.len()
    );
}
