//! Training runs as a user runs them (`hzp run --data ...`): token batches equal the
//! explicit `--inputs` path; losses equal PyTorch's AdamW with nanoGPT's cosine schedule over
//! a token file (reference made by tests/models/make_token_refs.py) on 1, 2 and 2x2 ranks;
//! checkpoints resume bitwise with the same plan and reshard to other plans; damaged,
//! partial and mismatched checkpoints give the documented behaviour.

mod common;
use common::*;
use hzp_frontends::npz;
use hzp_ir::Tensor;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

static MODEL: LazyLock<PathBuf> =
    LazyLock::new(|| own_models_dir().join("gpt2_tiny.legacy.op17.onnx"));

/// Byte-level tokens made by tests/models/make_token_refs.py.
static TOKENS: LazyLock<PathBuf> = LazyLock::new(|| own_models_dir().join("tokens/train.bin"));

fn tokens() -> &'static Path {
    &TOKENS
}

/// Compiles the tiny GPT-2 for batches of 4 x 32 tokens.
fn compile(dir: &Path, name: &str, mesh: &str, strategy: &str, extra: &[&str]) -> PathBuf {
    let plan = dir.join(format!("{name}.json"));
    let mut args = vec![
        "compile",
        s(&MODEL),
        "--shape",
        "input_ids=4x32",
        "--retie",
        "--lr",
        "3e-3",
        "--mesh",
        mesh,
        "--strategy",
        strategy,
        "-o",
        s(&plan),
    ];
    args.extend_from_slice(extra);
    ok(&args);
    plan
}

fn losses(json: &str) -> Vec<f64> {
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    v["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

const SCHEDULE: [&str; 7] = [
    "--lr-schedule",
    "cosine",
    "--warmup",
    "2",
    "--min-lr",
    "3e-4",
    "--steps",
];

fn run_json(plan: &Path, steps: &str, extra: &[&str]) -> Vec<f64> {
    let mut args = vec!["run", s(plan), "--data", s(tokens())];
    args.extend_from_slice(&SCHEDULE);
    args.push(steps);
    args.extend_from_slice(&["--format", "json"]);
    args.extend_from_slice(extra);
    losses(&ok(&args))
}

fn params(path: &Path) -> Vec<(String, Tensor)> {
    let mut p = npz::read(path).unwrap();
    p.sort_by(|a, b| a.0.cmp(&b.0));
    p
}

fn max_rel(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut worst: f64 = 0.0;
    for ((ka, ta), (kb, tb)) in a.iter().zip(b) {
        assert_eq!(ka, kb);
        let (x, y) = (ta.to_f64_vec(), tb.to_f64_vec());
        let scale = x.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
        for (u, v) in x.iter().zip(&y) {
            worst = worst.max((u - v).abs() / scale);
        }
    }
    worst
}

#[test]
fn losses_match_pytorch_adamw_with_nanogpts_cosine_schedule() {
    let refs = npz::read(&own_models_dir().join("tokens/gpt2_cosine.ref.npz")).unwrap();
    let want = refs
        .iter()
        .find(|(k, _)| k == "losses")
        .unwrap()
        .1
        .to_f64_vec();
    assert_eq!(want.len(), 8);
    let dir = tempdir("pytorch");
    for (i, mesh) in ["gpu=1", "gpu=2", "node=2,gpu=2"].into_iter().enumerate() {
        let plan = compile(&dir, &format!("p{i}"), mesh, "asynchzp", &[]);
        let got = run_json(&plan, "8", &[]);
        assert_eq!(got.len(), 8);
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs(),
                "{mesh}: step {}: hzp {g}, PyTorch {w}",
                k + 1
            );
        }
    }
}

#[test]
fn hzp_train_reads_token_files_with_schedules_too() {
    // one rank without a plan: the same reference
    let refs = npz::read(&own_models_dir().join("tokens/gpt2_cosine.ref.npz")).unwrap();
    let want = refs
        .iter()
        .find(|(k, _)| k == "losses")
        .unwrap()
        .1
        .to_f64_vec();
    let dir = tempdir("train");
    let log = dir.join("m.jsonl");
    let mut args = vec![
        "train",
        s(&MODEL),
        "--shape",
        "input_ids=4x32",
        "--retie",
        "--lr",
        "3e-3",
        "--data",
        s(tokens()),
        "--val-data",
        s(tokens()),
        "--eval-every",
        "4",
        "--log",
        s(&log),
        "--format",
        "json",
    ];
    args.extend_from_slice(&SCHEDULE);
    args.push("8");
    let got = losses(&ok(&args));
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs(),
            "step {}: hzp {g}, PyTorch {w}",
            k + 1
        );
    }
    let lines = std::fs::read_to_string(&log).unwrap();
    let evals = lines.lines().filter(|l| l.contains("val_loss")).count();
    assert_eq!((lines.lines().count(), evals), (8, 2), "{lines}");
}

/// Batch k of the token file as `--data` reads it (4 rows of 32, windows in file order).
fn batch(k: usize) -> Tensor {
    let bytes = std::fs::read(tokens()).unwrap();
    let ids: Vec<i64> = bytes
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]) as i64)
        .collect();
    let windows = ids.len() / 32;
    let mut out = Vec::new();
    for r in 0..4 {
        let w = (k * 4 + r) % windows;
        out.extend_from_slice(&ids[w * 32..(w + 1) * 32]);
    }
    Tensor::i64(vec![4, 32], out)
}

#[test]
fn token_batches_equal_the_explicit_inputs() {
    // SGD keeps no state, so eight one-step runs chained through --params are eight steps
    let dir = tempdir("explicit");
    for mesh in ["gpu=1", "gpu=2"] {
        let plan = compile(&dir, "sgd", mesh, "zero3", &["--optimizer", "sgd"]);
        let data_params = dir.join("data.npz");
        let via_data = losses(&ok(&[
            "run",
            s(&plan),
            "--data",
            s(tokens()),
            "--steps",
            "8",
            "--format",
            "json",
            "--save-params",
            s(&data_params),
        ]));
        let mut via_inputs = Vec::new();
        let mut prev: Option<PathBuf> = None;
        for k in 0..8 {
            let input = dir.join(format!("batch{k}.npz"));
            npz::write(&input, &[("input_ids".to_string(), batch(k))]).unwrap();
            let out = dir.join(format!("after{k}.npz"));
            let mut args = vec!["run", s(&plan), "--inputs", s(&input), "--steps", "1"];
            args.extend_from_slice(&["--format", "json", "--save-params", s(&out)]);
            if let Some(p) = &prev {
                args.extend_from_slice(&["--params", s(p)]);
            }
            via_inputs.extend(losses(&ok(&args)));
            prev = Some(out);
        }
        assert_eq!(via_data, via_inputs, "{mesh}");
        assert_eq!(
            params(&data_params),
            params(prev.as_ref().unwrap()),
            "{mesh}"
        );
    }
}

#[test]
fn resume_is_bitwise_the_uninterrupted_run() {
    let dir = tempdir("resume");
    for strategy in ["asynchzp", "zero3", "ddp"] {
        let plan = compile(&dir, strategy, "gpu=2", strategy, &[]);
        let full = dir.join(format!("{strategy}-full.npz"));
        let whole = run_json(&plan, "8", &["--save-params", s(&full)]);
        let ck = dir.join(format!("{strategy}-ck"));
        let first = run_json(
            &plan,
            "8",
            &[
                "--stop-at",
                "5",
                "--checkpoint-dir",
                s(&ck),
                "--checkpoint-every",
                "5",
            ],
        );
        assert_eq!(first, whole[..5], "{strategy}");
        assert!(ck.join("step-000005/manifest.json").is_file());
        let resumed = dir.join(format!("{strategy}-resumed.npz"));
        let rest = run_json(
            &plan,
            "8",
            &[
                "--checkpoint-dir",
                s(&ck),
                "--resume",
                "--save-params",
                s(&resumed),
            ],
        );
        assert_eq!(rest, whole[5..], "{strategy}: losses after resuming");
        assert_eq!(params(&full), params(&resumed), "{strategy}: parameters");
    }
}

/// Muon plans (the schedule scales Muon's rate with AdamW's): the same command compiles the
/// same bytes; a checkpoint (the momentum is a state cut like its master) resumes bitwise,
/// and another rank count resumes it (losses within 1e-4: bf16 Newton-Schulz carries the
/// other summation order's round-off further than AdamW does, see tests/training.rs).
#[test]
fn muon_plans_are_deterministic_and_resume_from_checkpoints() {
    let dir = tempdir("muon");
    let muon = ["--optimizer", "muon"];
    let plan = compile(&dir, "muon-a", "gpu=2", "zero3", &muon);
    let again = compile(&dir, "muon-b", "gpu=2", "zero3", &muon);
    assert_eq!(
        std::fs::read(&plan).unwrap(),
        std::fs::read(&again).unwrap(),
        "the same Muon plan compiled twice differs"
    );
    let full = dir.join("muon-full.npz");
    let whole = run_json(&plan, "8", &["--save-params", s(&full)]);
    assert!(whole[7] < whole[0], "Muon does not train: {whole:?}");
    let ck = dir.join("muon-ck");
    let first = run_json(&plan, "8", &["--stop-at", "5", "--checkpoint-dir", s(&ck)]);
    assert_eq!(first, whole[..5]);
    let manifest = std::fs::read_to_string(ck.join("step-000005/manifest.json")).unwrap();
    assert!(manifest.contains("muon.momentum/"), "{manifest}");
    let resumed = dir.join("muon-resumed.npz");
    let rest = run_json(
        &plan,
        "8",
        &[
            "--checkpoint-dir",
            s(&ck),
            "--resume",
            "--save-params",
            s(&resumed),
        ],
    );
    assert_eq!(rest, whole[5..], "losses after resuming");
    assert_eq!(params(&full), params(&resumed), "parameters after resuming");
    let four = compile(&dir, "muon-four", "gpu=4", "zero3", &muon);
    let mine = dir.join("muon-ck-four");
    copy_dir(&ck.join("step-000005"), &mine.join("step-000005"));
    let rest = run_json(&four, "8", &["--checkpoint-dir", s(&mine), "--resume"]);
    assert_eq!(rest.len(), 3);
    for (g, w) in rest.iter().zip(&whole[5..]) {
        assert!((g - w).abs() <= 1e-4 * w.abs(), "gpu=4: {g} vs {w}");
    }
}

#[test]
fn another_plan_reshards_the_checkpoint() {
    let dir = tempdir("reshard");
    let two = compile(&dir, "two", "gpu=2", "asynchzp", &[]);
    let full = dir.join("full.npz");
    let whole = run_json(&two, "8", &["--save-params", s(&full)]);
    let ck = dir.join("ck");
    run_json(&two, "8", &["--stop-at", "5", "--checkpoint-dir", s(&ck)]);
    for (name, mesh, strategy) in [("four", "gpu=4", "zero3"), ("one", "gpu=1", "asynchzp")] {
        let plan = compile(&dir, name, mesh, strategy, &[]);
        let mine = dir.join(format!("ck-{name}"));
        copy_dir(&ck.join("step-000005"), &mine.join("step-000005"));
        let out = dir.join(format!("{name}.npz"));
        let rest = run_json(
            &plan,
            "8",
            &[
                "--checkpoint-dir",
                s(&mine),
                "--resume",
                "--save-params",
                s(&out),
            ],
        );
        assert_eq!(rest.len(), 3);
        for (g, w) in rest.iter().zip(&whole[5..]) {
            assert!((g - w).abs() <= 1e-5 * w.abs(), "{name}: {g} vs {w}");
        }
        let rel = max_rel(&params(&full), &params(&out));
        assert!(rel <= 1e-5, "{name}: parameters differ by {rel} relative");
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn damaged_partial_and_foreign_checkpoints() {
    let dir = tempdir("damaged");
    let plan = compile(&dir, "p", "gpu=2", "zero3", &[]);
    let ck = dir.join("ck");
    run_json(
        &plan,
        "8",
        &[
            "--stop-at",
            "4",
            "--checkpoint-dir",
            s(&ck),
            "--checkpoint-every",
            "2",
        ],
    );
    let (s2, s4) = (ck.join("step-000002"), ck.join("step-000004"));
    let resume = |ck: &Path| {
        let mut args = vec!["run", s(&plan), "--data", s(tokens())];
        args.extend_from_slice(&SCHEDULE);
        args.extend_from_slice(&["5", "--checkpoint-dir", s(ck), "--resume"]);
        hzp(&args)
    };
    // a truncated shard: skipped in favour of step 2, with a note naming the file
    let shard = s4.join("rank-00001.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    let (code, out, err) = resume(&ck);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("rank-00001.safetensors") && err.contains("truncated"),
        "{err}"
    );
    assert!(
        out.contains("resumed from") && out.contains("step-000002"),
        "{out}"
    );
    // a changed byte (same size): the hash says so
    let dir2 = tempdir("damaged-hash");
    let ck2 = dir2.join("ck");
    copy_dir(&s2, &ck2.join("step-000002"));
    let f = ck2.join("step-000002/rank-00000.safetensors");
    let mut b = std::fs::read(&f).unwrap();
    let n = b.len();
    b[n - 1] ^= 0x55;
    std::fs::write(&f, &b).unwrap();
    let (code, _, err) = resume(&ck2);
    assert_eq!(code, 1, "a lone damaged checkpoint must not load: {err}");
    assert!(
        err.contains("SHA-256") && err.contains("rank-00000.safetensors"),
        "{err}"
    );
    // no manifest: not a checkpoint
    let dir3 = tempdir("damaged-manifest");
    let ck3 = dir3.join("ck");
    copy_dir(&s2, &ck3.join("step-000002"));
    std::fs::remove_file(ck3.join("step-000002/manifest.json")).unwrap();
    let (code, _, err) = resume(&ck3);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no manifest.json"), "{err}");
    // another model: an error naming the checkpoint
    let other = dir.join("other.json");
    ok(&[
        "compile",
        s(&own_models_dir().join("llama_tiny.legacy.op17.onnx")),
        "--shape",
        "input_ids=4x32",
        "--mesh",
        "gpu=2",
        "-o",
        s(&other),
    ]);
    let mut args = vec!["run", s(&other), "--data", s(tokens()), "--steps", "5"];
    args.extend_from_slice(&["--checkpoint-dir", s(&ck), "--resume"]);
    let (code, _, err) = hzp(&args);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("another model") && err.contains("step-00000"),
        "{err}"
    );
    // never written over
    let mut args = vec!["run", s(&plan), "--data", s(tokens()), "--steps", "2"];
    args.extend_from_slice(&["--checkpoint-dir", s(&ck)]);
    let (code, _, err) = hzp(&args);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("exists already"), "{err}");
}

#[test]
fn evaluation_metrics_export_and_keep() {
    let dir = tempdir("eval");
    let plan = compile(&dir, "p", "gpu=2", "asynchzp", &[]);
    let log = dir.join("m.jsonl");
    let ck = dir.join("ck");
    let out = ok(&[
        "run",
        s(&plan),
        "--data",
        s(tokens()),
        "--val-data",
        s(tokens()),
        "--eval-every",
        "2",
        "--eval-batches",
        "2",
        "--steps",
        "4",
        "--log",
        s(&log),
        "--checkpoint-dir",
        s(&ck),
        "--checkpoint-every",
        "1",
        "--keep",
        "2",
    ]);
    assert!(out.contains("val_loss"), "{out}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    for (k, l) in lines.iter().enumerate() {
        assert_eq!(l["step"], k + 1);
        for key in ["loss", "lr", "tokens_per_s", "step_seconds"] {
            assert!(l[key].is_number(), "{key} in {l}");
        }
        assert_eq!(l["val_loss"].is_number(), k % 2 == 1, "{l}");
    }
    // the same evaluation on one rank: the same batches and (nearly) the same parameters
    let one = compile(&dir, "one", "gpu=1", "asynchzp", &[]);
    let log1 = dir.join("m1.jsonl");
    ok(&[
        "run",
        s(&one),
        "--data",
        s(tokens()),
        "--val-data",
        s(tokens()),
        "--eval-every",
        "2",
        "--eval-batches",
        "2",
        "--steps",
        "2",
        "--log",
        s(&log1),
    ]);
    let v1: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(&log1)
            .unwrap()
            .lines()
            .nth(1)
            .unwrap(),
    )
    .unwrap();
    let (a, b) = (
        v1["val_loss"].as_f64().unwrap(),
        lines[1]["val_loss"].as_f64().unwrap(),
    );
    assert!(
        (a - b).abs() <= 1e-5 * b,
        "val_loss on 1 rank {a}, on 2 ranks {b}"
    );
    // --keep 2 left the newest two
    let mut kept: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    kept.sort();
    assert_eq!(kept, vec!["step-000003", "step-000004"]);
    // export: the parameters of the run's end, by initializer name
    let saved = dir.join("final.npz");
    let exported = dir.join("export.npz");
    ok(&["checkpoint", "export", s(&ck), "-o", s(&exported)]);
    let shown = ok(&["checkpoint", "show", s(&ck)]);
    assert!(
        shown.contains("step 4") && shown.contains("gpu=2"),
        "{shown}"
    );
    ok(&[
        "run",
        s(&plan),
        "--data",
        s(tokens()),
        "--steps",
        "4",
        "--save-params",
        s(&saved),
    ]);
    // `--save-params` also writes the copies of retied weights under their ONNX names (as
    // `hzp train` does); the export holds the trained parameters
    let (saved, exported) = (params(&saved), params(&exported));
    let trained: Vec<_> = saved
        .iter()
        .filter(|(k, _)| exported.iter().any(|(e, _)| e == k))
        .cloned()
        .collect();
    assert_eq!(trained, exported);
    assert!(
        saved.len() - exported.len() <= 1,
        "{} vs {}",
        saved.len(),
        exported.len()
    );
    let st = dir.join("export.safetensors");
    ok(&["checkpoint", "export", s(&ck), "-o", s(&st)]);
    assert!(std::fs::metadata(&st).unwrap().len() > 1000);
}

#[test]
fn out_of_vocabulary_tokens_name_the_file_and_offset() {
    let dir = tempdir("vocab");
    let plan = compile(&dir, "p", "gpu=1", "asynchzp", &[]);
    let mut bytes = std::fs::read(tokens()).unwrap();
    bytes[2 * 40..2 * 40 + 2].copy_from_slice(&300u16.to_le_bytes());
    let bad = dir.join("bad.bin");
    std::fs::write(&bad, &bytes).unwrap();
    let (code, _, err) = hzp(&["run", s(&plan), "--data", s(&bad), "--steps", "1"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("bad.bin") && err.contains("byte offset 80") && err.contains("300"),
        "{err}"
    );
}

/// `hzp run` of a Canzona plan (`--muon-placement canzona`, Newton-Schulz in f32 so round-off
/// is not amplified) trains as the replicated plan does (losses and parameters within 1e-5),
/// compiles to the same bytes twice, and resumes the replicated plan's checkpoint (the
/// momentum is cut the same way).
#[test]
fn canzona_plans_run_as_replicated_ones() {
    let dir = tempdir("canzona");
    let rep = ["--optimizer", "muon", "--muon-ns-precision", "fp32"];
    let can = [
        "--optimizer",
        "muon",
        "--muon-ns-precision",
        "fp32",
        "--muon-placement",
        "canzona",
    ];
    let r = compile(&dir, "rep", "gpu=4", "zero3", &rep);
    let c = compile(&dir, "can", "gpu=4", "zero3", &can);
    let c2 = compile(&dir, "can2", "gpu=4", "zero3", &can);
    assert_eq!(std::fs::read(&c).unwrap(), std::fs::read(&c2).unwrap());
    assert_ne!(std::fs::read(&c).unwrap(), std::fs::read(&r).unwrap());
    let (rp, cp) = (dir.join("rep.npz"), dir.join("can.npz"));
    let lr = run_json(&r, "8", &["--save-params", s(&rp)]);
    let lc = run_json(&c, "8", &["--save-params", s(&cp)]);
    assert!(lc[7] < lc[0], "Canzona Muon does not train: {lc:?}");
    for (g, w) in lc.iter().zip(&lr) {
        assert!((g - w).abs() <= 1e-5 * w.abs(), "{g} vs {w}");
    }
    let rel = max_rel(&params(&rp), &params(&cp));
    assert!(rel <= 1e-5, "parameters differ by {rel} relative");
    let ck = dir.join("ck");
    run_json(&r, "8", &["--stop-at", "5", "--checkpoint-dir", s(&ck)]);
    let rest = run_json(&c, "8", &["--checkpoint-dir", s(&ck), "--resume"]);
    assert_eq!(rest.len(), 3);
    for (g, w) in rest.iter().zip(&lr[5..]) {
        assert!((g - w).abs() <= 1e-5 * w.abs(), "resumed: {g} vs {w}");
    }
}
