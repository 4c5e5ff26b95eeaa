//! Snapshots of `hzp compile --print-after all` (the forward program, the single-rank
//! training step, the per-rank step after collective insertion, after collective rewriting
//! and after scheduling, and the memory plan) for the tiny MLP (examples/models/mlp.hzp) on the meshes `gpu=4` and
//! `node=2,gpu=4`, with the planner's choice and with ZeRO-3; the groups, memory and
//! collectives `hzp inspect` reports for a tiny Llama; and byte-identical plans from two
//! compiles. Runs the CLI binary, as a user would.
//! Re-bless with `INSTA_UPDATE=always cargo test --test snapshots_compile` after review.

mod common;
use common::repo;
use std::path::PathBuf;
use std::process::Command;

fn hzp(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_hzp"))
        .current_dir(repo())
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "hzp {}\n{stdout}\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The `--print-after all` part of `hzp compile`'s output (the summary after it carries the
/// compile time).
fn print_after_all(mesh: &str, strategy: &str) -> String {
    let out = hzp(&[
        "compile",
        "examples/models/mlp.hzp",
        "--mesh",
        mesh,
        "--strategy",
        strategy,
        "--loss",
        "mse",
        "--target",
        "y",
        "--clip-grad-norm",
        "1.0",
        "--print-after",
        "all",
    ]);
    let end = out
        .find("\nplan for examples/models/mlp.hzp")
        .expect("the summary follows the printed stages");
    let printed = &out[..end + 1];
    let headers: Vec<&str> = printed
        .lines()
        .filter(|l| l.starts_with("# after "))
        .collect();
    assert_eq!(
        headers,
        [
            "# after import",
            "# after training",
            "# after collectives",
            "# after rewrite",
            "# after schedule",
            "# after memory"
        ]
    );
    printed.to_string()
}

#[test]
fn mlp_gpu4_asynchzp() {
    insta::assert_snapshot!(print_after_all("gpu=4", "asynchzp"));
}

#[test]
fn mlp_gpu4_zero3() {
    insta::assert_snapshot!(print_after_all("gpu=4", "zero3"));
}

#[test]
fn mlp_node2_gpu4_asynchzp() {
    insta::assert_snapshot!(print_after_all("node=2,gpu=4", "asynchzp"));
}

#[test]
fn mlp_node2_gpu4_zero3() {
    insta::assert_snapshot!(print_after_all("node=2,gpu=4", "zero3"));
}

#[test]
fn print_after_takes_lists_and_rejects_unknown_stages() {
    let base = [
        "compile",
        "examples/models/mlp.hzp",
        "--mesh",
        "gpu=2",
        "--loss",
        "mean",
    ];
    let out = hzp(&[&base[..], &["--print-after", "schedule,training"][..]].concat());
    let headers: Vec<&str> = out.lines().filter(|l| l.starts_with("# after ")).collect();
    assert_eq!(headers, ["# after training", "# after schedule"]);

    let bad = Command::new(env!("CARGO_BIN_EXE_hzp"))
        .current_dir(repo())
        .args([&base[..], &["--print-after", "autodiff"][..]].concat())
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    let err = String::from_utf8_lossy(&bad.stderr);
    for stage in [
        "`autodiff`",
        "import",
        "training",
        "collectives",
        "schedule",
        "memory",
    ] {
        assert!(err.contains(stage), "{err}");
    }
}

fn tempdir() -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "hzp-snapshots-compile-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Compiles the tiny Llama (global batch 8 x 16, two micro-batches) to `out`.
fn compile_llama(mesh: &str, strategy: &str, out: &std::path::Path) {
    hzp(&[
        "compile",
        "tests/models/llama_tiny.dynamo.op18.onnx",
        "--shape",
        "input_ids=16x16",
        "--micro-batches",
        "2",
        "--mesh",
        mesh,
        "--strategy",
        strategy,
        "--memory",
        "1GiB",
        "-o",
        out.to_str().unwrap(),
    ]);
}

/// `hzp inspect` up to the per-stream op lists: groups, memory by kind, collectives.
fn inspect_head(plan: &std::path::Path) -> String {
    let out = hzp(&["inspect", plan.to_str().unwrap()]);
    let end = out.find("\nstream ").expect("inspect lists the streams");
    // the first line names the temporary file
    out[..end + 1]
        .lines()
        .skip(1)
        .map(|l| format!("{l}\n"))
        .collect()
}

#[test]
fn llama_plans_are_byte_identical_and_inspected() {
    let dir = tempdir();
    let mut heads = String::new();
    for mesh in ["gpu=4", "node=2,gpu=4"] {
        for strategy in ["asynchzp", "zero3"] {
            let (a, b) = (dir.join("a.json"), dir.join("b.json"));
            compile_llama(mesh, strategy, &a);
            compile_llama(mesh, strategy, &b);
            let (a_bytes, b_bytes) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
            assert!(
                a_bytes == b_bytes,
                "two compiles on {mesh} ({strategy}) gave different plan.json"
            );
            heads.push_str(&format!("## {mesh} {strategy}\n{}\n", inspect_head(&a)));
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    insta::assert_snapshot!(heads);
}

#[test]
fn bench_compile_reports_every_mesh_and_the_ratio() {
    let out = hzp(&[
        "bench",
        "compile",
        "examples/models/mlp.hzp",
        "--loss",
        "mean",
        "--meshes",
        "gpu=2",
        "--meshes",
        "node=2,gpu=4",
        "--repeat",
        "1",
    ]);
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("  gpu=2 ") || l.starts_with("  node=2,gpu=4 "))
        .collect();
    assert_eq!(rows.len(), 2, "{out}");
    assert!(
        rows[1].contains(" 8 "),
        "the second mesh has 8 ranks: {out}"
    );
    assert!(out.contains("compile time node=2,gpu=4 / gpu=2: "), "{out}");
}
