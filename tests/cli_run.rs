//! `hzp run` as a user runs it: compile then run gives `hzp train`'s parameters; the JSON
//! report; a trace; clear errors for a plan of another version, a modified plan, another
//! model, missing inputs; `--backend cuda` without the libraries.

mod common;
use common::*;
use std::path::{Path, PathBuf};

fn model() -> PathBuf {
    own_models_dir().join("gpt2_tiny.legacy.op17.onnx")
}

fn io() -> PathBuf {
    own_models_dir().join("gpt2_tiny.io.npz")
}

/// Compiles gpt2 for `mesh` and `strategy` into `dir/plan.json`.
fn compile(dir: &Path, mesh: &str, strategy: &str) -> PathBuf {
    let plan = dir.join("plan.json");
    let (code, _, err) = hzp(&[
        "compile",
        s(&model()),
        "--inputs",
        s(&io()),
        "--mesh",
        mesh,
        "--strategy",
        strategy,
        "-o",
        s(&plan),
    ]);
    assert_eq!(code, 0, "{err}");
    plan
}

#[test]
fn run_gives_the_parameters_of_train() {
    let d = tempdir("train");
    let trained = d.join("train.npz");
    let (code, _, err) = hzp(&[
        "train",
        s(&model()),
        "--inputs",
        s(&io()),
        "--steps",
        "3",
        "--save-params",
        s(&trained),
    ]);
    assert_eq!(code, 0, "{err}");
    let want = read_npz(&trained);
    for (mesh, strategy, comm) in [("gpu=2", "zero3", "async"), ("gpu=2", "ddp", "sync")] {
        let plan = compile(&d, mesh, strategy);
        let ran = d.join("run.npz");
        let trace = d.join("trace.json");
        let (code, out, err) = hzp(&[
            "run",
            s(&plan),
            "--inputs",
            s(&io()),
            "--steps",
            "3",
            "--comm",
            comm,
            "--save-params",
            s(&ran),
            "--trace",
            s(&trace),
            "--link",
            "intra=100GB/s",
        ]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("step    3  loss"), "{out}");
        assert!(out.contains("exposed communication"), "{out}");
        let got = read_npz(&ran);
        assert_eq!(got.len(), want.len());
        for (name, w) in &want {
            let (_, g) = got.iter().find(|(k, _)| k == name).unwrap();
            let (x, y) = (g.to_f64_vec(), w.to_f64_vec());
            let d: f64 = x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum();
            let n: f64 = y.iter().map(|b| b * b).sum();
            // the key bias moves by round-off (see tests/run_e2e.rs); everything else is tight
            let tol = if name.contains("c_attn.bias") {
                1e-4
            } else {
                1e-5
            };
            assert!(
                d.sqrt() <= tol * n.sqrt(),
                "{mesh} {strategy} {comm}: `{name}`"
            );
        }
        let t: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
        let events = t["traceEvents"].as_array().unwrap();
        let x: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert!(!x.is_empty());
        for e in &x {
            assert!(e["pid"].as_u64().unwrap() < 2);
            assert!(e["tid"].as_u64().unwrap() < 3);
            assert!(e["dur"].as_f64().unwrap() >= 0.0);
            assert!(e["args"]["node"].is_string() && e["args"]["bytes"].is_u64());
        }
        if comm == "async" {
            assert!(
                x.iter().any(|e| e["tid"] == 1),
                "no all-gather stream events"
            );
        }
    }
}

#[test]
fn json_report_has_stable_keys() {
    let d = tempdir("json");
    let plan = compile(&d, "gpu=2", "zero3");
    let (code, out, err) = hzp(&[
        "run",
        s(&plan),
        "--inputs",
        s(&io()),
        "--steps",
        "2",
        "--format",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["losses"].as_array().unwrap().len(), 2);
    for k in [
        "step_seconds",
        "comm_seconds",
        "exposed_comm_seconds",
        "busy_seconds",
        "summary",
    ] {
        assert!(!v[k].is_null(), "{k}: {out}");
    }
    assert_eq!(v["world_size"], 2);
}

#[test]
fn bad_plans_models_and_inputs_are_refused_clearly() {
    let d = tempdir("errors");
    let plan = compile(&d, "gpu=2", "zero3");
    let text = std::fs::read_to_string(&plan).unwrap();
    let io_path = io();
    let run = |plan: &Path, extra: &[&str]| {
        let mut a = vec!["run", s(plan), "--inputs", s(&io_path)];
        a.extend_from_slice(extra);
        hzp(&a)
    };
    // another format version
    let v1 = d.join("v1.json");
    std::fs::write(&v1, text.replacen("\"version\": 3", "\"version\": 1", 1)).unwrap();
    let (code, _, err) = run(&v1, &[]);
    assert_eq!(code, 1);
    assert!(err.contains("version 1"), "{err}");
    // modified after compiling
    let m = d.join("modified.json");
    std::fs::write(
        &m,
        text.replacen("\"arena_bytes\": ", "\"arena_bytes\": 1", 1),
    )
    .unwrap();
    let (code, _, err) = run(&m, &[]);
    assert_eq!(code, 1);
    assert!(err.contains("modified"), "{err}");
    // another model
    let other = own_models_dir().join("gpt2_tiny.dynamo.op18.onnx");
    let (code, _, err) = run(&plan, &["--model", s(&other)]);
    assert_eq!(code, 1);
    assert!(err.contains("another model"), "{err}");
    // missing inputs: an npz without input_ids
    let (code, _, err) = hzp(&[
        "run",
        s(&plan),
        "--inputs",
        s(&own_models_dir().join("gpt2_tiny.grads.npz")),
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("input_ids"), "{err}");
    // --params lacking a parameter
    let (code, _, err) = run(
        &plan,
        &["--params", s(&own_models_dir().join("gpt2_tiny.io.npz"))],
    );
    assert_eq!(code, 1);
    assert!(err.contains("a parameter the plan trains"), "{err}");
    // bad --link
    let (code, _, err) = run(&plan, &["--link", "intra=fast"]);
    assert_eq!(code, 1);
    assert!(err.contains("--link"), "{err}");
    // links so slow (or latencies so long) that a collective's time is no duration: refused
    // before any step, never a panic in a comm thread
    for (link, words) in [
        ("intra=1e-300B/s", ["--link intra=", "at least 1 B/s"]),
        ("intra=0.5B/s", ["--link intra=", "at least 1 B/s"]),
        (
            "intra=300GB/s,latency=1e300s",
            ["--link latency=", "an hour"],
        ),
    ] {
        let (code, out, err) = run(&plan, &["--link", link, "--steps", "1"]);
        assert_eq!(code, 1, "{link}: {out}{err}");
        for w in words {
            assert!(err.contains(w), "{link}: {err}");
        }
    }
    // and through a cluster spec
    let spec = d.join("slow.toml");
    let toml = std::fs::read_to_string(repo().join("examples/clusters/h100-dgx.toml")).unwrap();
    for (from, to, key) in [
        ("bandwidth = \"450GB/s\"", "bandwidth = 1e-300", "bandwidth"),
        ("latency = \"3us\"", "latency = 1e300", "latency"),
    ] {
        assert!(toml.contains(from), "{from}");
        std::fs::write(&spec, toml.replacen(from, to, 1)).unwrap();
        let (code, out, err) = run(&plan, &["--emulate-links", s(&spec), "--steps", "1"]);
        assert_eq!(code, 1, "{key}: {out}{err}");
        assert!(
            err.contains("slow.toml") && err.contains(&format!("links[0].{key}")),
            "{key}: {err}"
        );
    }
}

#[test]
fn cuda_backend_names_what_is_missing() {
    let d = tempdir("cuda");
    let plan = compile(&d, "gpu=2", "zero3");
    let (code, _, err) = hzp(&["run", s(&plan), "--inputs", s(&io()), "--backend", "cuda"]);
    if code == 0 {
        skip::skip(
            "cuda_backend_names_what_is_missing",
            skip::Missing::Other,
            "this machine runs CUDA: no missing library to name",
        );
        return;
    }
    assert!(
        err.contains("not found") || err.contains("without CUDA"),
        "{err}"
    );
    // every rank on the one GPU: the same check of the libraries first (or, in a build
    // without the feature, the rebuild hint), never a panic
    let (code, _, err) = hzp(&[
        "run",
        s(&plan),
        "--inputs",
        s(&io()),
        "--backend",
        "cuda",
        "--ranks-on-one-gpu",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("--ranks-on-one-gpu")
            && (err.contains("not found") || err.contains("without the `cuda` feature")),
        "{err}"
    );
    // an option of the CUDA backend only
    let (code, _, err) = hzp(&["run", s(&plan), "--inputs", s(&io()), "--ranks-on-one-gpu"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("is an option of --backend cuda"), "{err}");
    // a training run from a token file with a schedule and a metrics log goes as far as the
    // libraries on the CUDA backend (it is not refused for its flags) ...
    let tokens = own_models_dir().join("tokens/train.bin");
    let log = d.join("metrics.jsonl");
    let train = [
        "run",
        s(&plan),
        "--backend",
        "cuda",
        "--data",
        s(&tokens),
        "--lr-schedule",
        "cosine",
        "--warmup",
        "2",
        "--lr",
        "3e-3",
        "--steps",
        "3",
        "--log",
        s(&log),
    ];
    let (code, _, err) = hzp(&train);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("not found") || err.contains("without CUDA"),
        "{err}"
    );
    // ... and so does one that evaluates (a forward+loss plan on the GPU) ...
    let mut eval = train.to_vec();
    eval.extend(["--val-data", s(&tokens), "--eval-every", "2"]);
    let (code, _, err) = hzp(&eval);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("not found") || err.contains("without CUDA"),
        "{err}"
    );
    // ... and so do checkpoints and --resume, with every rank on one GPU or one process
    // per GPU: the step loop is every backend's, and the CUDA executors hand their values to
    // checkpoints and take them back; only the missing GPU or library stops them here
    let ck = d.join("ck");
    std::fs::create_dir_all(&ck).unwrap();
    let mut ckpt = train.to_vec();
    ckpt.extend([
        "--checkpoint-dir",
        s(&ck),
        "--resume",
        "--checkpoint-every",
        "1",
    ]);
    for extra in [&[][..], &["--ranks-on-one-gpu"][..]] {
        let mut args = ckpt.clone();
        args.extend(extra);
        let (code, out, err) = hzp(&args);
        assert_eq!(code, 1, "{extra:?}: {out}{err}");
        assert!(
            err.contains("not found") || err.contains("without the `cuda` feature"),
            "{extra:?}: {err}"
        );
        assert!(
            !err.contains("--checkpoint-dir") && !err.contains("--resume"),
            "{extra:?}: the flags are refused: {err}"
        );
        // nothing was written into the checkpoint folder
        assert_eq!(std::fs::read_dir(&ck).unwrap().count(), 0, "{extra:?}");
    }
}

/// `hzp compile` honours the training flags that change the model: with `--retie` the tied
/// embedding trains as one parameter and `--freeze` keeps a parameter fixed, so `hzp run`
/// gives `hzp train`'s losses with the same flags (and not without them).
#[test]
fn compile_honours_retie_and_freeze() {
    let d = tempdir("ties");
    let (model, io) = (model(), io());
    let flags = ["--retie", "--freeze", "transformer.wpe.weight"];
    let plan = d.join("tied.json");
    let mut args = vec![
        "compile",
        s(&model),
        "--inputs",
        s(&io),
        "--loss",
        "lm",
        "--mesh",
        "gpu=2",
        "-o",
        s(&plan),
    ];
    args.extend(flags);
    let (code, _, err) = hzp(&args);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("retie:"), "{err}");
    let (code, out, err) = hzp(&[
        "run",
        s(&plan),
        "--inputs",
        s(&io),
        "--steps",
        "3",
        "--format",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let run = json_losses(&out);
    // `hzp train` with extra flags: its losses
    let train_losses = |extra: &[&str]| {
        let mut args = vec![
            "train",
            s(&model),
            "--inputs",
            s(&io),
            "--loss",
            "lm",
            "--steps",
            "3",
            "--format",
            "json",
        ];
        args.extend(extra);
        let (code, out, err) = hzp(&args);
        assert_eq!(code, 0, "{err}");
        json_losses(&out)
    };
    let train = train_losses(&flags);
    assert_eq!(run.len(), 3);
    for (a, b) in run.iter().zip(&train) {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs(),
            "run {run:?} vs train {train:?}"
        );
    }
    // without the flags the steps after the first differ: the flags did something
    let plain = train_losses(&[]);
    assert!(
        (plain[2] - run[2]).abs() > 1e-6 * run[2].abs(),
        "{plain:?} vs {run:?}"
    );
}

/// `--eval-batches` beyond what `--val-data` holds is refused before the first step (it
/// used to wrap around the file, evaluating the same windows without end).
#[test]
fn eval_batches_are_bounded_by_the_held_out_file() {
    let d = tempdir("eval-batches");
    let plan = compile(&d, "gpu=2", "zero3");
    let tokens = own_models_dir().join("tokens/train.bin");
    let run = |e: &str| {
        hzp(&[
            "run",
            s(&plan),
            "--data",
            s(&tokens),
            "--val-data",
            s(&tokens),
            "--eval-batches",
            e,
            "--steps",
            "1",
        ])
    };
    let (code, out, err) = run("1000000000000");
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("--eval-batches 1000000000000") && err.contains("train.bin holds"),
        "{err}"
    );
    assert!(!out.contains("step"), "refused before training: {out}");
    // the most it holds, named in the message: one more is refused too
    let held: usize = err
        .split("that is ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of batches in: {err}"));
    assert!(held >= 1, "{err}");
    let (code, _, err) = run(&(held + 1).to_string());
    assert_eq!(code, 1, "{err}");
    assert!(err.contains(&format!("evaluate at most {held}")), "{err}");
    // `hzp train` checks the same
    let (code, _, err) = hzp(&[
        "train",
        s(&model()),
        "--inputs",
        s(&io()),
        "--data",
        s(&tokens),
        "--val-data",
        s(&tokens),
        "--eval-batches",
        "1000000000000",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--eval-batches 1000000000000"), "{err}");
}

/// `--router-aux-loss` on `hzp compile` is recorded in the plan's loss, and `hzp run`
/// computes it: the routed `preset:moe-tiny` with the PyTorch model's weights gives
/// transformers' Mixtral loss with `router_aux_loss_coef=0.05`
/// (tests/models/make_moe_aux_refs.py). A model without routed layers, or a negative
/// coefficient, is refused.
#[test]
fn the_router_aux_loss_is_recorded_in_the_plan_and_run() {
    let d = tempdir("router-aux");
    let models = own_models_dir();
    let params: Vec<_> = read_npz(&models.join("moe_tiny.grads.npz"))
        .into_iter()
        .filter_map(|(k, t)| k.strip_prefix("param/").map(|n| (n.to_string(), t)))
        .collect();
    let ids: Vec<_> = read_npz(&models.join("moe_tiny.io.npz"))
        .into_iter()
        .filter(|(k, _)| k == "input_ids")
        .collect();
    let (pp, ip) = (d.join("params.npz"), d.join("inputs.npz"));
    hzp_frontends::npz::write(&pp, &params).unwrap();
    hzp_frontends::npz::write(&ip, &ids).unwrap();
    let want = read_npz(&models.join("moe_tiny.aux.npz"))
        .into_iter()
        .find(|(k, _)| k == "loss")
        .unwrap()
        .1
        .to_f64_vec()[0];
    let plan = d.join("plan.json");
    let compile = |extra: &[&str]| {
        let mut args = vec!["compile", "preset:moe-tiny", "--mesh", "gpu=1"];
        args.extend_from_slice(&["--precision", "fp32", "-o", s(&plan)]);
        args.extend_from_slice(extra);
        ok(&args)
    };
    let run = || {
        let out = ok(&["run", s(&plan), "--params", s(&pp), "--inputs", s(&ip)]);
        let line = out
            .lines()
            .find(|l| l.contains("loss"))
            .unwrap()
            .to_string();
        let v: f64 = line.split_whitespace().nth(3).unwrap().parse().unwrap();
        v
    };
    compile(&["--router-aux-loss", "0.05"]);
    let text = std::fs::read_to_string(&plan).unwrap();
    assert!(text.contains("\"lm router_aux=0.05\""), "the plan's loss");
    let with_aux = run();
    assert!((with_aux - want).abs() < 1e-4, "{with_aux} vs {want}");
    compile(&[]);
    assert!(!std::fs::read_to_string(&plan)
        .unwrap()
        .contains("router_aux"));
    let plain = run();
    assert!((with_aux - plain).abs() > 1e-2, "{with_aux} vs {plain}");
    fails_with(
        &[
            "compile",
            "preset:llama-tiny",
            "--mesh",
            "gpu=1",
            "--router-aux-loss",
            "0.05",
            "-o",
            s(&plan),
        ],
        &["--router-aux-loss 0.05", "no routed MoE layer"],
    );
    fails_with(
        &[
            "compile",
            "preset:moe-tiny",
            "--mesh",
            "gpu=1",
            "--router-aux-loss=-1",
            "-o",
            s(&plan),
        ],
        &["--router-aux-loss"],
    );
}

/// `--expert-parallel gpu` on `gpu=4`: the plan records it, `hzp inspect` lists its
/// AllToAll collectives on a comm stream and each rank's quarter of the expert weights, and
/// 5 AdamW steps on the CPU backend give one rank's parameters (dropless routing: every
/// token meets the same experts however the batch is split). A checkpoint of the
/// expert-parallel run resumes under the one-rank plan and ends where that plan ends.
#[test]
fn an_expert_parallel_plan_trains_as_one_rank_and_its_checkpoints_reshard() {
    let d = tempdir("expert-parallel");
    let models = own_models_dir();
    let params: Vec<_> = read_npz(&models.join("moe_tiny.grads.npz"))
        .into_iter()
        .filter_map(|(k, t)| k.strip_prefix("param/").map(|n| (n.to_string(), t)))
        .collect();
    // four sequences: the export's two and two more from the same vocabulary
    let ids: Vec<i64> = (0..64).map(|i| (i * 37 % 251) as i64).collect();
    let (pp, ip) = (d.join("params.npz"), d.join("inputs.npz"));
    hzp_frontends::npz::write(&pp, &params).unwrap();
    hzp_frontends::npz::write(
        &ip,
        &[(
            "input_ids".to_string(),
            hzp_ir::Tensor::i64(vec![4, 16], ids),
        )],
    )
    .unwrap();
    // (a preset's batch is one rank's micro-batch)
    let compile = |plan: &Path, model: &str, mesh: &str, extra: &[&str]| {
        let mut args = vec!["compile", model];
        args.extend_from_slice(&["--mesh", mesh, "--precision", "fp32", "-o", s(plan)]);
        args.extend_from_slice(extra);
        ok(&args)
    };
    let (one, ep) = (d.join("one.json"), d.join("ep.json"));
    compile(&one, "preset:moe-tiny,batch=4", "gpu=1", &[]);
    compile(
        &ep,
        "preset:moe-tiny,batch=1",
        "gpu=4",
        &[
            "--expert-parallel",
            "gpu",
            "--shard",
            "params=gpu,grads=gpu,optim=gpu",
        ],
    );
    let text = ok(&["inspect", s(&ep)]);
    assert!(
        text.contains("experts: split over [gpu] (4 ranks)") && text.contains("(0.250 of them)"),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l.contains("AllToAll")
            && l.contains("[gpu]")
            && l.contains("on reducescatter")),
        "{text}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&ok(&["inspect", s(&ep), "--format", "json"])).unwrap();
    assert_eq!(json["experts"]["ranks"], 4);
    let run = |plan: &Path, out: &Path, extra: &[&str]| {
        let mut args = vec!["run", s(plan), "--params", s(&pp), "--inputs", s(&ip)];
        args.extend_from_slice(&["--save-params", s(out)]);
        args.extend_from_slice(extra);
        ok(&args)
    };
    let (a, b, c) = (d.join("a.npz"), d.join("b.npz"), d.join("c.npz"));
    run(&one, &a, &["--steps", "5"]);
    let ckpt = d.join("ckpt");
    run(
        &ep,
        &b,
        &[
            "--steps",
            "5",
            "--checkpoint-dir",
            s(&ckpt),
            "--checkpoint-every",
            "3",
        ],
    );
    // resume the expert-parallel run's step-3 checkpoint under the one-rank plan
    std::fs::remove_dir_all(ckpt.join("step-000005")).unwrap();
    run(
        &one,
        &c,
        &["--steps", "5", "--checkpoint-dir", s(&ckpt), "--resume"],
    );
    let want = read_npz(&a);
    for other in [&b, &c] {
        let got = read_npz(other);
        assert_eq!(got.len(), want.len());
        for ((n, x), (m, y)) in want.iter().zip(&got) {
            assert_eq!(n, m);
            let scale = x.to_f64_vec().iter().fold(0f64, |a, v| a.max(v.abs()));
            let e = max_abs_diff(x, y);
            assert!(
                e <= 1e-5 * scale.max(1e-3),
                "`{n}` differs by {e:.3e} ({})",
                other.display()
            );
        }
    }
}
