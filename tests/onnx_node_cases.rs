//! ONNX's own per-operator node tests, run through `hzp eval` as a user runs it.
//!
//! The cases are generated from the installed `onnx` package (no network) by
//! `examples/onnx_node_tests/make_cases.py OUT_DIR`; this test runs when
//! `HZP_ONNX_NODE_CASES=OUT_DIR` is set and records a skip otherwise (`tests/common/skip.rs`;
//! a failure where `CI` is set: CI generates the cases). Each
//! case is `hzp eval model.onnx --inputs inputs.npz -o out.npz`; every output must match
//! `outputs.npz` within 1e-4 relative plus 1e-5 absolute (NaN where NaN is expected, the
//! same infinities, the same dtype and shape). Prints pass and fail counts per op type and
//! fails if any case fails (other than the [`KNOWN_FAILURES`], which must still fail) or if
//! the manifest lists a case that is not there. `HZP_ONNX_NODE_FILTER=SUBSTRING` runs only
//! the cases whose name contains it.

mod common;
use common::*;
use hzp_frontends::npz;
use hzp_ir::Tensor;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// Cases hzp is known not to pass, with why. Each must still fail (so the list stays true);
/// any other failure fails the test.
const KNOWN_FAILURES: &[(&str, &str)] = &[];

const RTOL: f64 = 1e-4;
const ATOL: f64 = 1e-5;

/// Why `got` does not match `want`, or None when it does.
fn mismatch(name: &str, got: &Tensor, want: &Tensor) -> Option<String> {
    if got.dtype() != want.dtype() || got.shape != want.shape {
        return Some(format!(
            "output `{name}` is {:?}{:?}, expected {:?}{:?}",
            got.dtype(),
            got.shape,
            want.dtype(),
            want.shape
        ));
    }
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
        let ok = if b.is_nan() {
            a.is_nan()
        } else if b.is_infinite() {
            a == b
        } else {
            (a - b).abs() <= ATOL + RTOL * b.abs()
        };
        if !ok {
            return Some(format!(
                "output `{name}` element {i} is {a}, expected {b} ({} of {} elements differ)",
                g.iter()
                    .zip(&w)
                    .filter(|(a, b)| !(a == b
                        || (a.is_nan() && b.is_nan())
                        || (*a - *b).abs() <= ATOL + RTOL * b.abs()))
                    .count(),
                w.len()
            ));
        }
    }
    None
}

/// Runs one case; Err says why it failed.
fn run_case(dir: &Path, out: &Path) -> Result<(), String> {
    let res = Command::new(hzp_bin())
        .arg("eval")
        .arg(dir.join("model.onnx"))
        .arg("--inputs")
        .arg(dir.join("inputs.npz"))
        .arg("-o")
        .arg(out)
        .output()
        .map_err(|e| format!("cannot run hzp: {e}"))?;
    // a failure is reported, never a panic (Rust's exit code 101)
    assert_ne!(
        res.status.code(),
        Some(101),
        "hzp eval panicked on {}: {}",
        dir.display(),
        String::from_utf8_lossy(&res.stderr)
    );
    if !res.status.success() {
        let err = String::from_utf8_lossy(&res.stderr);
        return Err(err.trim().replace('\n', " "));
    }
    let got = npz::read(out).map_err(|e| e.to_string())?;
    let want = npz::read(&dir.join("outputs.npz")).map_err(|e| e.to_string())?;
    for (name, w) in &want {
        let g = got
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, t)| t)
            .ok_or_else(|| format!("no output `{name}`"))?;
        if let Some(why) = mismatch(name, g, w) {
            return Err(why);
        }
    }
    Ok(())
}

#[test]
fn onnx_node_cases() {
    let Some(root) = std::env::var_os("HZP_ONNX_NODE_CASES") else {
        skip::skip(
            "onnx_node_cases",
            skip::Missing::OnnxCases,
            "HZP_ONNX_NODE_CASES is not set. Generate the cases with `python3 \
             examples/onnx_node_tests/make_cases.py DIR` (needs `pip install onnx numpy`) and \
             run with HZP_ONNX_NODE_CASES=DIR",
        );
        return;
    };
    let root = Path::new(&root);
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("manifest.json"))
            .unwrap_or_else(|e| panic!("{}/manifest.json: {e}", root.display())),
    )
    .expect("manifest.json is JSON");
    let cases = manifest["cases"].as_object().expect("manifest lists cases");
    assert!(!cases.is_empty(), "the manifest lists no cases");
    let only = std::env::var("HZP_ONNX_NODE_FILTER").ok();
    let tmp = std::env::temp_dir().join(format!("hzp-node-cases-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).expect("a temporary folder");
    let mut per_op: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut known = Vec::new();
    let mut now_passing = Vec::new();
    for (case, op) in cases {
        if only.as_deref().is_some_and(|f| !case.contains(f)) {
            continue;
        }
        let op = op.as_str().unwrap_or("?").to_string();
        let dir = root.join(case);
        assert!(
            dir.join("model.onnx").exists(),
            "case {case} is in the manifest but {} is missing",
            dir.display()
        );
        let entry = per_op.entry(op.clone()).or_default();
        let expected_failure = KNOWN_FAILURES.iter().find(|(k, _)| k == case);
        match run_case(&dir, &tmp.join(format!("{case}.npz"))) {
            Ok(()) => {
                entry.0 += 1;
                if expected_failure.is_some() {
                    now_passing.push(case.clone());
                }
            }
            Err(why) => {
                entry.1 += 1;
                match expected_failure {
                    Some((_, reason)) => known.push(format!("{case} ({op}): {reason}: {why}")),
                    None => failures.push(format!("{case} ({op}): {why}")),
                }
            }
        }
    }
    let (pass, fail) = per_op
        .values()
        .fold((0, 0), |(p, f), (a, b)| (p + a, f + b));
    println!(
        "ONNX node tests (onnx {}): {pass} of {} pass",
        manifest["onnx_version"].as_str().unwrap_or("?"),
        pass + fail
    );
    for (op, (p, f)) in &per_op {
        println!(
            "  {op:<20} {p:>3} of {:>3}{}",
            p + f,
            if *f > 0 { "  FAILING" } else { "" }
        );
    }
    let _ = std::fs::remove_dir_all(&tmp);
    for k in &known {
        println!("known failure {k}");
    }
    for f in &failures {
        println!("FAIL {f}");
    }
    assert!(
        now_passing.is_empty(),
        "these cases pass now; take them off KNOWN_FAILURES: {now_passing:?}"
    );
    assert!(
        failures.is_empty(),
        "{} of {} ONNX node tests fail (listed above)",
        failures.len(),
        pass + fail
    );
}
