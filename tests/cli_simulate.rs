//! `hzp simulate`, `hzp compare` and `hzp scale` as a user runs them: tables, JSON fields,
//! files written (a valid Chrome trace, SVGs), calibration, and error messages.

mod common;
use common::*;
use std::path::{Path, PathBuf};

const TINY: &str = "preset:gpt,layers=2,hidden=64,heads=4,vocab=128,seq=16,batch=2";

/// A 4-rank plan of the tiny llama ONNX model.
fn compile_plan(dir: &Path) -> PathBuf {
    let model = own_models_dir().join("llama_tiny.dynamo.op18.onnx");
    let out = dir.join("plan.json");
    let (code, stdout, err) = hzp(&[
        "compile",
        s(&model),
        "--shape",
        "input_ids=4x16",
        "--mesh",
        "node=2,gpu=2",
        "-o",
        s(&out),
    ]);
    assert_eq!(code, 0, "{stdout}{err}");
    out
}

#[test]
fn simulate_writes_summary_trace_and_pictures() {
    let dir = tempdir("sim");
    let plan = compile_plan(&dir);
    let (trace, gantt, mem) = (dir.join("sim.json"), dir.join("t.svg"), dir.join("mem.svg"));
    let (code, out, err) = hzp(&[
        "simulate",
        s(&plan),
        "--trace",
        s(&trace),
        "--timeline",
        s(&gantt),
        "--memory-plot",
        s(&mem),
        "--format",
        "json",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for key in [
        "step_time_s",
        "critical_path_s",
        "compute_busy_s",
        "exposed_comm_fraction",
        "mfu",
        "tokens_per_s",
        "peak_memory_bytes",
        "issue_order_peak_bytes",
        "arena_bytes",
        "links",
    ] {
        assert!(v.get(key).is_some(), "missing {key}: {out}");
    }
    let step = v["step_time_s"].as_f64().unwrap();
    assert!(step > 0.0 && step >= v["critical_path_s"].as_f64().unwrap() * (1.0 - 1e-9));
    assert!(v["peak_memory_bytes"].as_u64().unwrap() <= v["arena_bytes"].as_u64().unwrap());
    assert_eq!(v["world_size"], 4);
    // the trace: valid Trace Event JSON, one process per rank (4), named streams
    let text = std::fs::read_to_string(&trace).unwrap();
    let summary = hzp_ir::trace::validate(&text, "sim.json").unwrap();
    assert_eq!(summary.pids, vec![0, 1, 2, 3]);
    assert!(text.contains("\"thread_name\"") && text.contains("\"allgather\""));
    for svg in [&gantt, &mem] {
        let t = std::fs::read_to_string(svg).unwrap();
        assert!(
            t.starts_with("<?xml") && t.trim_end().ends_with("</svg>"),
            "{t}"
        );
    }
    // text output: the summary table
    let (code, out, err) = hzp(&["simulate", s(&plan), "--serialize"]);
    assert_eq!(code, 0, "{err}");
    for want in [
        "step time",
        "exposed communication",
        "MFU",
        "tokens/s",
        "memory peak per rank",
        "serialized",
    ] {
        assert!(out.contains(want), "{want}: {out}");
    }
    // calibration against a "measured" trace (here the prediction itself)
    let (code, out, err) = hzp(&["simulate", s(&plan), "--calibrate", s(&trace)]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("calibration against") && out.contains("prediction error"),
        "{out}"
    );
}

#[test]
fn simulate_errors_say_what_is_wrong() {
    let dir = tempdir("sim");
    let (code, _, err) = hzp(&["simulate", s(&dir.join("missing.json"))]);
    assert_eq!(code, 1);
    assert!(
        err.contains("cannot read") && err.contains("missing.json"),
        "{err}"
    );
    let plan = compile_plan(&dir);
    let bad = dir.join("bad.json");
    std::fs::write(
        &bad,
        r#"{"traceEvents": [{"name": "x", "ph": "X", "ts": 0}]}"#,
    )
    .unwrap();
    let (code, _, err) = hzp(&["simulate", s(&plan), "--calibrate", s(&bad)]);
    assert_eq!(code, 1);
    assert!(
        err.contains("bad.json") && err.contains("needs \"dur\""),
        "{err}"
    );
    let (code, _, err) = hzp(&["simulate", s(&plan), "--algorithm", "butterfly"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("butterfly") && err.contains("--algorithm") && err.contains("ring, tree"),
        "{err}"
    );
    // a cluster without a link for one of the plan's axes
    let spec = dir.join("one_link.toml");
    let toml = std::fs::read_to_string(repo().join("examples/clusters/h100-dgx.toml"))
        .unwrap()
        .replace("axes = [\"node\"]", "axes = [\"rack\"]");
    std::fs::write(&spec, toml).unwrap();
    let (code, _, err) = hzp(&["simulate", s(&plan), "--cluster", s(&spec)]);
    assert_eq!(code, 1);
    assert!(err.contains("node"), "{err}");
}

#[test]
fn simulate_says_when_the_plan_does_not_fit_the_clusters_devices() {
    let dir = tempdir("sim-fit");
    let plan = compile_plan(&dir);
    // the default cluster (80 GiB per device) holds the tiny plan
    let (code, out, err) = hzp(&["simulate", s(&plan), "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["fits"], true, "{out}");
    assert_eq!(v["device_memory_bytes"], 80u64 << 30, "{out}");
    assert!(v.get("note").is_none(), "{out}");
    let (code, out, err) = hzp(&["simulate", s(&plan)]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("(the arena fits)") && !out.contains("DOES NOT FIT"),
        "{out}"
    );
    // a cluster of 4 KiB devices does not
    let spec = dir.join("small.toml");
    let toml = std::fs::read_to_string(repo().join("examples/clusters/h100-dgx.toml"))
        .unwrap()
        .replace("memory = \"80GiB\"", "memory = \"4KiB\"");
    assert!(toml.contains("memory = \"4KiB\""));
    std::fs::write(&spec, toml).unwrap();
    let (code, out, err) = hzp(&[
        "simulate",
        s(&plan),
        "--cluster",
        s(&spec),
        "--format",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let arena = v["arena_bytes"].as_u64().unwrap();
    assert!(arena > 4096, "{out}");
    assert_eq!(v["fits"], false, "{out}");
    assert_eq!(v["device_memory_bytes"], 4096, "{out}");
    let note = v["note"].as_str().unwrap();
    assert!(
        note.contains("does not fit") && note.contains("> the 4.00 KiB of device memory"),
        "{note}"
    );
    let (code, out, err) = hzp(&["simulate", s(&plan), "--cluster", s(&spec)]);
    assert_eq!(code, 0, "{err}");
    let line = out
        .lines()
        .find(|l| l.contains("DOES NOT FIT"))
        .unwrap_or_else(|| panic!("no DOES NOT FIT line: {out}"));
    assert!(
        line.contains("arena is") && line.contains("of device memory") && line.contains("--memory"),
        "{line}"
    );
}

#[test]
fn compare_strategies_json_and_markdown() {
    let model = own_models_dir().join("llama_tiny.dynamo.op18.onnx");
    let args = [
        "compare",
        s(&model),
        "--shape",
        "input_ids=4x16",
        "--mesh",
        "node=2,gpu=2",
        "--strategies",
        "asynchzp,zero3,hsdp,ddp",
    ];
    let mut json = args.to_vec();
    json.extend(["--format", "json"]);
    let (code, out, err) = hzp(&json);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 4);
    for (r, name) in rows.iter().zip(["asynchzp", "zero3", "hsdp", "ddp"]) {
        assert_eq!(r["strategy"], name);
        assert_eq!(r["fits"], true, "{r}");
        assert!(r["step_time_s"].as_f64().unwrap() > 0.0);
        assert!(r["mfu"].as_f64().unwrap() > 0.0);
        let x = r["exposed_comm_fraction"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&x));
        assert!(r["peak_memory_bytes"].as_u64().unwrap() > 0);
    }
    // zero3 shards everything over the whole world
    assert_eq!(rows[1]["groups"], "P=[node,gpu] G=[node,gpu] O=[node,gpu]");
    let mut md = args.to_vec();
    md.extend(["--format", "markdown"]);
    let (code, out, err) = hzp(&md);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("| strategy"), "{out}");
    assert!(out.contains("| zero3"), "{out}");
    // nothing fits 64 KiB: every row says so, and the comparison still completes
    let mut tiny = json.clone();
    tiny.extend(["--memory", "64KiB", "--quiet"]);
    let (code, out, err) = hzp(&tiny);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for r in v.as_array().unwrap() {
        assert_eq!(r["fits"], false, "{r}");
        assert!(r["note"].as_str().unwrap().contains("does not fit"), "{r}");
        assert_eq!(r["budget_bytes"], 64 * 1024, "{r}");
        assert!(r["step_time_s"].as_f64().unwrap() > 0.0);
    }
    // an unknown strategy is refused up front
    let mut bad = args.to_vec();
    bad[7] = "asynchzp,zero9";
    let (code, _, err) = hzp(&bad);
    assert_eq!(code, 1);
    assert!(err.contains("zero9"), "{err}");
}

#[test]
fn scale_reports_linearity() {
    let (code, out, err) = hzp(&[
        "scale",
        TINY,
        "--ranks",
        "4,8,16",
        "--mesh",
        "node=*,gpu=2",
        "--strategies",
        "asynchzp,zero3",
        "--format",
        "json",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 6);
    for r in rows {
        for key in ["strategy", "ranks", "tokens_per_s", "linearity"] {
            assert!(r.get(key).is_some(), "{key}: {r}");
        }
        let l = r["linearity"].as_f64().unwrap();
        assert!(l > 0.0 && l <= 1.0 + 1e-9, "{r}");
    }
    assert_eq!(rows[0]["ranks"], 4);
    assert_eq!(rows[0]["linearity"], 1.0);
    assert_eq!(rows[2]["mesh"], "node=8,gpu=2");
    // text: the paper's figure printed as a reference, labeled as such
    let (code, out, err) = hzp(&["scale", TINY, "--ranks", "4,8", "--mesh", "node=*,gpu=2"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("91.1%") && out.contains("paper"), "{out}");
    // a template the ranks do not fill
    let (code, _, err) = hzp(&["scale", TINY, "--ranks", "6", "--mesh", "node=*,gpu=4"]);
    assert_eq!(code, 1);
    assert!(err.contains("multiple of 4"), "{err}");
}

/// `hzp compare --run-steps N --link ...` runs every strategy's plan on this machine, beside
/// the prediction: every plan starts from the same weights on the same batch, so their first
/// losses agree (sharding does not change the step); each then trains.
#[test]
fn compare_runs_each_plan_with_emulated_links() {
    let dir = tempdir("compare-run");
    let model = own_models_dir().join("gpt2_tiny.legacy.op17.onnx");
    let io = read_npz(&own_models_dir().join("gpt2_tiny.io.npz"));
    let (_, ids) = io.iter().find(|(k, _)| k == "input_ids").unwrap();
    // the [2, 16] batch four times over: [8, 16], two rows per rank
    let parts: Vec<&hzp_ir::Tensor> = (0..4).map(|_| ids).collect();
    let batch = hzp_runtime::cpu::eval_op(&hzp_ir::Op::Concat { axis: 0 }, &parts)
        .unwrap()
        .remove(0);
    let inputs = dir.join("batch.npz");
    hzp_frontends::npz::write(&inputs, &[("input_ids".to_string(), batch)]).unwrap();
    let args = [
        "compare",
        s(&model),
        "--inputs",
        s(&inputs),
        "--retie",
        "--mesh",
        "node=2,gpu=2",
        "--strategies",
        "asynchzp,zero3,acco,asyncmesh",
        "--slow-axis",
        "node",
        "--run-steps",
        "3",
        "--link",
        "intra=1GB/s,inter=100MB/s",
        "--quiet",
    ];
    let mut json = args.to_vec();
    json.extend(["--format", "json"]);
    let (code, out, err) = hzp(&json);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 4);
    let first0 = rows[0]["measured"]["first_loss"].as_f64().unwrap();
    for r in rows {
        let m = &r["measured"];
        assert_eq!(m["steps"], 3, "{r}");
        assert!(m["step_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(m["exposed_comm_s"].as_f64().unwrap() >= 0.0, "{r}");
        let (first, last) = (
            m["first_loss"].as_f64().unwrap(),
            m["last_loss"].as_f64().unwrap(),
        );
        assert!((first - first0).abs() <= 1e-5 * first0, "{r}");
        assert!(last < first, "{r}");
    }
    let (code, out, err) = hzp(&args);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("run: 3 steps on this machine's CPU, links intra=1GB/s"),
        "{out}"
    );
    assert!(out.contains("run: loss"), "{out}");
    // without --run-steps only the simulation runs: no measured field, no columns
    let base = &args[..args.len() - 5];
    assert_eq!(base.last(), Some(&"node"));
    let mut sim_only = base.to_vec();
    sim_only.extend(["--quiet", "--format", "json"]);
    let (code, out, err) = hzp(&sim_only);
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains("measured"), "{out}");
    // what --run-steps needs
    let mut no_run = base.to_vec();
    no_run.extend(["--link", "intra=1GB/s,inter=100MB/s"]);
    fails_with(&no_run, &["--link", "--run-steps"]);
    let mut no_inputs: Vec<&str> = args
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 2 && *i != 3)
        .map(|(_, a)| *a)
        .collect();
    no_inputs.extend(["--shape", "input_ids=8x16"]);
    fails_with(&no_inputs, &["--run-steps", "--inputs"]);
    fails_with(
        &[
            "compare",
            TINY,
            "--mesh",
            "gpu=2",
            "--run-steps",
            "2",
            "--quiet",
        ],
        &["shapes only", "--run-steps"],
    );
}

/// `hzp compile --format json` of `model` (with `extra` flags) on `mesh` into `dir`: the plan
/// and the predicted step.
fn compile_predicted(dir: &Path, model: &str, mesh: &str, extra: &[&str]) -> (PathBuf, f64) {
    let out = dir.join(format!("{}.json", mesh.replace([',', '='], "_")));
    let mut args = vec![
        "compile",
        model,
        "--mesh",
        mesh,
        "--format",
        "json",
        "-o",
        s(&out),
    ];
    args.extend(extra);
    let (code, stdout, err) = hzp(&args);
    assert_eq!(code, 0, "{model} on {mesh}: {stdout}{err}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    (out, v["predicted_step_s"].as_f64().unwrap())
}

/// `hzp simulate --format json`'s step of a plan.
fn simulated_step(plan: &Path) -> f64 {
    let (code, out, err) = hzp(&["simulate", s(plan), "--format", "json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["step_time_s"].as_f64().unwrap()
}

/// `hzp compare` of every baseline and asynchzp: asynchzp is never slower in the simulator
/// than a baseline that fits.
fn asynchzp_never_slower(model: &str, mesh: &str, extra: &[&str]) {
    let mut args = vec![
        "compare",
        model,
        "--mesh",
        mesh,
        "--strategies",
        "asynchzp,zero1,zero2,zero3,hsdp,ddp",
        "--format",
        "json",
        "--quiet",
    ];
    args.extend(extra);
    let (code, out, err) = hzp(&args);
    assert_eq!(code, 0, "{model} on {mesh}: {out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v.as_array().unwrap();
    assert_eq!(rows[0]["strategy"], "asynchzp");
    assert_eq!(rows[0]["fits"], true, "{model} on {mesh}: {}", rows[0]);
    let ours = rows[0]["step_time_s"].as_f64().unwrap();
    for r in &rows[1..] {
        if r["fits"] == true {
            let theirs = r["step_time_s"].as_f64().unwrap();
            assert!(
                ours <= theirs * (1.0 + 1e-9),
                "{model} on {mesh}: asynchzp {ours} s is slower than {} {theirs} s ({})",
                r["strategy"],
                r["groups"]
            );
        }
    }
}

fn assert_agree(what: &str, predicted: f64, simulated: f64) {
    let rel = (predicted / simulated - 1.0).abs();
    assert!(
        predicted > 0.0 && rel <= 0.10,
        "{what}: compile predicts {predicted} s, simulate gives {simulated} s ({:.1}% apart)",
        rel * 100.0
    );
}

/// One number per question: the step `hzp compile` predicts is the one `hzp simulate` gives
/// the same plan (within 10%; the compile simulates the plans it weighs), on every ONNX model
/// of tests/models (both exporters) on two meshes; and `hzp compare` never shows asynchzp
/// slower than a baseline that fits.
#[test]
fn compile_predicts_the_simulated_step_for_every_test_model() {
    let dir = tempdir("onenumber");
    let mut models: Vec<PathBuf> = std::fs::read_dir(own_models_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "onnx"))
        .collect();
    models.sort();
    assert!(models.len() >= 8, "{models:?}");
    for m in &models {
        let name = m.file_stem().unwrap().to_string_lossy().to_string();
        let sub = dir.join(&name);
        std::fs::create_dir_all(&sub).unwrap();
        let shape = ["--shape", "input_ids=8x16"];
        for mesh in ["node=2,gpu=4", "node=2,gpu=2"] {
            let (plan, predicted) = compile_predicted(&sub, s(m), mesh, &shape);
            assert_agree(
                &format!("{name} on {mesh}"),
                predicted,
                simulated_step(&plan),
            );
        }
        asynchzp_never_slower(s(m), "node=2,gpu=4", &shape);
    }
}

/// The same for the large presets on the README's meshes.
#[test]
fn compile_predicts_the_simulated_step_for_the_presets() {
    let dir = tempdir("onenumber-presets");
    for preset in [
        "preset:gpt3-175b",
        "preset:llama3-70b",
        "preset:mixtral-8x7b",
    ] {
        let sub = dir.join(preset.trim_start_matches("preset:"));
        std::fs::create_dir_all(&sub).unwrap();
        for mesh in ["node=128,gpu=8", "node=16,gpu=8"] {
            let (plan, predicted) = compile_predicted(&sub, preset, mesh, &[]);
            assert_agree(
                &format!("{preset} on {mesh}"),
                predicted,
                simulated_step(&plan),
            );
        }
        asynchzp_never_slower(preset, "node=16,gpu=8", &[]);
    }
}
