//! `--strategy acco`: losses of `hzp run` on 1, 2 and 2x2 ranks equal a PyTorch
//! reference written from the paper's pseudo-code (tests/models/make_acco_refs.py); the step
//! program's order puts each phase's reduction, optimizer and all-gather beside the other
//! half's compute; the simulator sees the overlap; checkpoints resume bitwise; what is not
//! built is refused with the reason.

mod common;
use common::*;
use hzp_ir::{Op, Plan, Program, RoleKind};
use std::path::{Path, PathBuf};

fn model() -> PathBuf {
    own_models_dir().join("gpt2_tiny.legacy.op17.onnx")
}

fn tokens() -> PathBuf {
    own_models_dir().join("tokens/train.bin")
}

/// The tiny GPT-2 with ACCO (or `strategy`) for `rows` x 32 tokens per step.
fn compile(dir: &Path, mesh: &str, rows: usize, strategy: &str, extra: &[&str]) -> PathBuf {
    let plan = dir.join(format!("{strategy}-{mesh}-{rows}.json"));
    let shape = format!("input_ids={rows}x32");
    let mut args: Vec<String> = vec![
        "compile".into(),
        s(&model()).to_string(),
        "--shape".into(),
        shape,
        "--retie".into(),
        "--lr".into(),
        "3e-3".into(),
        "--mesh".into(),
        mesh.into(),
        "--strategy".into(),
        strategy.into(),
        "-o".into(),
        s(&plan).into(),
    ];
    args.extend(extra.iter().map(|x| x.to_string()));
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    plan
}

/// `hzp run` over the token file with make_token_refs.py's schedule for 8 steps.
fn run(plan: &Path, extra: &[&str]) -> Vec<f64> {
    let t = tokens();
    let mut args = vec![
        "run",
        s(plan),
        "--data",
        s(&t),
        "--lr-schedule",
        "cosine",
        "--warmup",
        "2",
        "--min-lr",
        "3e-4",
        "--steps",
        "8",
        "--format",
        "json",
    ];
    args.extend_from_slice(extra);
    json_losses(&ok(&args))
}

fn reference(name: &str) -> Vec<f64> {
    let r = read_npz(&own_models_dir().join("tokens").join(name));
    let (_, t) = r.iter().find(|(k, _)| k == "losses").expect("losses");
    t.to_f64_vec()
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-12))
        .fold(0.0, f64::max)
}

#[test]
fn losses_equal_the_reference_written_from_the_paper() {
    let dir = tempdir("ref");
    // the reference is not synchronous AdamW: a test that could not tell them apart would
    // prove nothing
    let sync = reference("gpt2_cosine.ref.npz");
    let w1 = reference("acco_w1.ref.npz");
    assert!(
        max_rel(&w1, &sync) > 1e-3,
        "the ACCO reference equals synchronous AdamW"
    );
    for (mesh, rows, file) in [
        ("gpu=1", 4, "acco_w1.ref.npz"),
        ("gpu=2", 4, "acco_w2.ref.npz"),
        ("node=2,gpu=2", 8, "acco_w4.ref.npz"),
    ] {
        let plan = compile(&dir, mesh, rows, "acco", &[]);
        let got = run(&plan, &[]);
        let want = reference(file);
        let d = max_rel(&got, &want);
        assert!(
            d <= 1e-5,
            "{mesh}: losses {got:?} vs reference {want:?} (max relative difference {d:.2e})"
        );
    }
}

/// Node indices of `p` whose role is `kind` with a unit starting with `unit` and whose op
/// matches `is`.
fn nodes(p: &Program, kind: RoleKind, unit: &str, is: impl Fn(&Op) -> bool) -> Vec<usize> {
    p.nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.role.kind == kind && n.role.unit.starts_with(unit))
        .filter(|(_, n)| is(&n.op))
        .map(|(i, _)| i)
        .collect()
}

#[test]
fn each_phase_communicates_beside_the_other_halfs_compute() {
    let dir = tempdir("order");
    let path = compile(&dir, "gpu=2", 4, "acco", &[]);
    let shown = ok(&["inspect", s(&path)]);
    assert!(
        shown.contains("acco: each step is two halves of 1 micro-batch")
            && shown.contains("extra state per rank: estimate"),
        "{shown}"
    );
    let plan = Plan::from_json(&std::fs::read_to_string(&path).unwrap(), "plan.json").unwrap();
    let p = &plan.program;
    assert_eq!(plan.micro_batches, 2, "two halves of one micro-batch each");
    let any = |_: &Op| true;
    let first = |v: Vec<usize>| *v.first().expect("a node");
    let last = |v: Vec<usize>| *v.last().expect("a node");
    let rs = |o: &Op| matches!(o, Op::ReduceScatter { .. });
    let ag = |o: &Op| matches!(o, Op::AllGather { .. });
    let adamw = |o: &Op| matches!(o, Op::AdamW { .. });
    let matmul = |o: &Op| matches!(o, Op::MatMul);
    let (mb0, mb1) = (
        nodes(p, RoleKind::Compute, "mb0", any),
        nodes(p, RoleKind::Compute, "mb1", any),
    );
    // phase 1: the last step's gradients go out before the first half's compute starts; the
    // committed optimizer step runs inside that compute, and its all-gather is issued before
    // the first half's compute ends
    let rs1 = first(nodes(p, RoleKind::Reduce, "acco.commit", rs));
    let commit = nodes(p, RoleKind::Optimizer, "acco.commit", adamw);
    let ag1 = first(nodes(p, RoleKind::Regather, "acco.commit", ag));
    assert!(
        rs1 < mb0[0],
        "reduce-scatter {rs1} after compute {}",
        mb0[0]
    );
    let mm0 = nodes(p, RoleKind::Compute, "mb0", matmul);
    assert!(first(commit.clone()) > mm0[0] && last(commit.clone()) < ag1);
    assert!(
        ag1 < last(mb0.clone()),
        "the all-gather waits for the backward"
    );
    // phase 2 likewise, with the first half's gradients and the estimate
    let rs2 = first(nodes(p, RoleKind::Reduce, "acco.estimate", rs));
    let est = nodes(p, RoleKind::Optimizer, "acco.estimate", adamw);
    let ag2 = first(nodes(p, RoleKind::Regather, "acco.estimate", ag));
    assert!(last(mb0.clone()) < rs2 && rs2 < mb1[0]);
    assert!(first(est.clone()) > mb1[0] && last(est) < ag2 && ag2 < last(mb1));
    // the compute stream waits for no collective before the first half's first product
    let first_wait = p
        .nodes
        .iter()
        .position(|n| {
            matches!(n.op, Op::WaitEvent { .. }) && n.stream == hzp_ir::StreamKind::Compute
        })
        .expect("the compute stream waits for the reduced gradients somewhere");
    assert!(
        first_wait > mm0[0],
        "wait {first_wait} before compute {}",
        mm0[0]
    );
    // every collective of the step is on a communication stream
    for n in &p.nodes {
        if n.op.is_collective() {
            assert_ne!(n.stream, hzp_ir::StreamKind::Compute, "{}", n.name);
        }
    }
}

fn simulate(plan: &Path) -> serde_json::Value {
    serde_json::from_str(&ok(&["simulate", s(plan), "--format", "json"])).unwrap()
}

#[test]
fn the_simulator_sees_the_overlap() {
    let dir = tempdir("sim");
    let mut frac = Vec::new();
    for strategy in ["acco", "zero1"] {
        let plan = dir.join(format!("{strategy}.json"));
        ok(&[
            "compile",
            "preset:gpt,layers=4",
            "--mesh",
            "node=2,gpu=8",
            "--strategy",
            strategy,
            "-o",
            s(&plan),
        ]);
        let v = simulate(&plan);
        frac.push(v["exposed_comm_fraction"].as_f64().unwrap());
    }
    assert!(
        frac[0] < 0.5 * frac[1],
        "exposed communication: acco {:.3} vs zero1 {:.3}",
        frac[0],
        frac[1]
    );
}

#[test]
fn checkpoints_resume_bitwise() {
    let dir = tempdir("resume");
    let plan = compile(&dir, "gpu=2", 4, "acco", &[]);
    let full = dir.join("full.npz");
    let whole = run(&plan, &["--save-params", s(&full)]);
    let ck = dir.join("ck");
    let first = run(
        &plan,
        &[
            "--stop-at",
            "5",
            "--checkpoint-dir",
            s(&ck),
            "--checkpoint-every",
            "5",
        ],
    );
    assert_eq!(first, whole[..5]);
    let resumed = dir.join("resumed.npz");
    let rest = run(
        &plan,
        &[
            "--checkpoint-dir",
            s(&ck),
            "--resume",
            "--save-params",
            s(&resumed),
        ],
    );
    assert_eq!(rest, whole[5..], "losses after resuming");
    assert_eq!(
        std::fs::read(&full).unwrap(),
        std::fs::read(&resumed).unwrap(),
        "parameters"
    );
}

#[test]
fn what_is_not_built_is_refused_with_the_reason() {
    let dir = tempdir("refuse");
    let m = model();
    for (extra, want) in [
        (
            &["--optimizer", "muon"][..],
            "--strategy acco is built for AdamW",
        ),
        (&["--optimizer", "sgd"][..], "not SGD"),
        (
            &["--clip-grad-norm", "1.0"][..],
            "--clip-grad-norm is not built",
        ),
    ] {
        let out = dir.join("x.json");
        let mut args = vec![
            "compile",
            s(&m),
            "--shape",
            "input_ids=4x32",
            "--mesh",
            "gpu=2",
            "--strategy",
            "acco",
            "-o",
            s(&out),
        ];
        args.extend_from_slice(extra);
        let (code, _, err) = hzp(&args);
        assert_eq!(code, 1, "{extra:?}: {err}");
        assert!(err.contains(want), "{extra:?}: {err}");
        assert!(!out.exists());
    }
}

/// A checkpoint moves between ACCO and another strategy: the committed parameters and
/// moments carry over, ACCO's own states start again (the next ACCO step primes).
#[test]
fn checkpoints_move_between_acco_and_other_plans() {
    let dir = tempdir("move");
    let acco = compile(&dir, "gpu=2", 4, "acco", &[]);
    let zero1 = compile(&dir, "gpu=2", 4, "zero1", &[]);
    let ck = dir.join("ck");
    let ck_s = s(&ck).to_string();
    let every = ["--checkpoint-dir", &ck_s, "--checkpoint-every", "2"];
    let first = run(&acco, &[&["--stop-at", "4"][..], &every[..]].concat());
    assert_eq!(first.len(), 4);
    // ACCO -> zero1: steps 5..8 continue from the committed parameters
    let moved = run(
        &zero1,
        &[&["--resume", "--stop-at", "6"][..], &every[..]].concat(),
    );
    assert_eq!(moved.len(), 2);
    // a fresh zero1 run from step 0 would start at the initial loss, not below it
    assert!(moved[0] < first[0] - 0.1, "{moved:?} vs {first:?}");
    // zero1 -> ACCO on another rank count: its first step primes, then it trains on
    let back = compile(&dir, "node=2,gpu=2", 8, "acco", &[]);
    let again = run(&back, &[&["--resume"][..], &every[..]].concat());
    assert_eq!(again.len(), 2);
    assert!(
        again.iter().all(|l| l.is_finite() && *l < first[0]),
        "{again:?}"
    );
}

/// The ACCO step's ops all lower for the CUDA backend (what a machine without a GPU can
/// check; examples/device/multi_rank_check.sh PART=acco runs it on one).
#[test]
fn the_acco_step_lowers_for_cuda() {
    let dir = tempdir("cuda");
    for mesh in ["gpu=1", "gpu=2", "node=2,gpu=2"] {
        let plan = compile(&dir, mesh, 8, "acco", &["--no-fuse-attention"]);
        let plan = Plan::from_json(&std::fs::read_to_string(&plan).unwrap(), "plan.json").unwrap();
        for rank in 0..plan.mesh.world_size() {
            hzp_runtime::cuda::lower::lower_program(&plan, rank)
                .unwrap_or_else(|e| panic!("{mesh} rank {rank}: {e}"));
        }
    }
}
