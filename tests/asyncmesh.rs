//! `--strategy asyncmesh`: sparse asynchronous averaging across a slow mesh axis.
//! The run of a plan equals the reference of tests/models/make_asyncmesh_refs.py (written
//! from the pseudo-code in passes/src/dist/asyncmesh.rs, torch's AdamW per replica) in its
//! losses, the replicas' mean (what is saved), each replica's shards and the EMA state; the compiled
//! schedule issues the slow-axis all-reduce before the forward and reads it after the
//! backward; the flags are checked.

mod common;
use common::*;
use hzp_ir::{Op, RoleKind, StreamKind, Tensor};
use std::path::{Path, PathBuf};

fn dir() -> PathBuf {
    own_models_dir().join("asyncmesh")
}

/// Compiles the reference's configuration (S = 0.3, H = 2, B = 0.8, lr 1e-2) plus `extra`.
fn compile(out: &Path, extra: &[&str]) -> PathBuf {
    let plan = out.join("plan.json");
    let (model, io) = (dir().join("mlp.hzp"), dir().join("io.npz"));
    let mut args = vec![
        "compile",
        s(&model),
        "--inputs",
        s(&io),
        "--loss",
        "mse",
        "--target",
        "y",
        "--lr",
        "1e-2",
        "--mesh",
        "node=2,gpu=2",
        "--strategy",
        "asyncmesh",
        "--slow-axis",
        "node",
        "--sparsity",
        "0.3",
        "--sync-every",
        "2",
        "--ema-beta",
        "0.8",
        "-o",
        s(&plan),
    ];
    args.extend_from_slice(extra);
    ok(&args);
    plan
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-12f64, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs() / scale))
}

fn get<'a>(t: &'a [(String, Tensor)], name: &str) -> &'a Tensor {
    &t.iter()
        .find(|(k, _)| k == name)
        .unwrap_or_else(|| panic!("no `{name}`"))
        .1
}

fn rank_state(ck: &Path, rank: usize) -> Vec<(String, Tensor)> {
    let bytes = std::fs::read(ck.join(format!("rank-{rank:05}.safetensors"))).unwrap();
    hzp_runtime::checkpoint::from_safetensors(&bytes).unwrap()
}

/// Replica `replica`'s whole `name` (`numel` elements), put together here from the
/// checkpoint's shards: on node=2,gpu=2, replica r is ranks 2r and 2r + 1, which hold the
/// first and second halves (rounded up, the last padded) of the flattened parameter.
fn replica_from_shards(ck: &Path, replica: usize, name: &str, numel: usize) -> Vec<f64> {
    let mut whole = Vec::new();
    for gpu in 0..2 {
        whole.extend(get(&rank_state(ck, 2 * replica + gpu), name).to_f64_vec());
    }
    assert_eq!(whole.len(), numel.div_ceil(2) * 2, "{name}'s shards");
    whole.truncate(numel);
    whole
}

/// The replicas' mean of `name`, a direct element-wise average of the two replicas above.
fn mean_from_shards(ck: &Path, name: &str, numel: usize) -> Vec<f64> {
    let (a, b) = (
        replica_from_shards(ck, 0, name, numel),
        replica_from_shards(ck, 1, name, numel),
    );
    a.iter().zip(&b).map(|(x, y)| (x + y) / 2.0).collect()
}

/// Whether `got` is the replicas' `mean`: within f32 rounding (the mean above is exact in
/// f64 from f32 values; the runtime averages in f32).
fn is_the_mean(got: &[f64], mean: &[f64]) -> Result<(), String> {
    let e = rel(got, mean);
    if e < 1e-6 {
        Ok(())
    } else {
        Err(format!("{e} from the replicas' mean"))
    }
}

/// Losses, parameters and EMA states of 8 steps of `hzp run` equal the reference within
/// 1e-5 relative; the step counter counted the steps.
#[test]
fn run_equals_the_reference() {
    let out = tempdir("ref");
    let plan = compile(&out, &[]);
    let params = out.join("params.npz");
    let ck = out.join("ck");
    let io = dir().join("io.npz");
    let json = ok(&[
        "run",
        s(&plan),
        "--inputs",
        s(&io),
        "--steps",
        "8",
        "--format",
        "json",
        "--save-params",
        s(&params),
        "--checkpoint-dir",
        s(&ck),
    ]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let losses: Vec<f64> = v["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let reference = read_npz(&dir().join("ref.npz"));
    let r = |k: &str| get(&reference, k).to_f64_vec();
    let e = rel(&losses, &r("losses"));
    assert!(e < 1e-5, "losses {losses:?} vs {:?}: {e}", r("losses"));
    let got = read_npz(&params);
    let ck = ck.join("step-000008");
    // rank 0 is replica 0's shard 0, rank 2 replica 1's shard 0 (o = 2 over gpu)
    let (rank0, rank2) = (rank_state(&ck, 0), rank_state(&ck, 2));
    for name in ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"] {
        let want0 = r(&format!("replica0/{name}"));
        // the saved model is the replicas' mean
        let mean: Vec<f64> = want0
            .iter()
            .zip(r(&format!("replica1/{name}")))
            .map(|(a, b)| (a + b) / 2.0)
            .collect();
        let e = rel(&get(&got, name).to_f64_vec(), &mean);
        assert!(e < 1e-5, "the replicas' mean of {name}: {e}");
        // and, bit for bit up to f32 rounding, the mean of what the ranks saved, computed here
        let here = mean_from_shards(&ck, name, want0.len());
        if let Err(e) = is_the_mean(&get(&got, name).to_f64_vec(), &here) {
            panic!("--save-params' {name}: {e}");
        }
        // a wrong assembly (replica 0 alone) is caught by that comparison
        let alone = replica_from_shards(&ck, 0, name, want0.len());
        assert!(
            is_the_mean(&alone, &here).is_err(),
            "{name}: replica 0 passes"
        );
        // rank 0 holds replica 0's shard 0
        let shard0 = get(&rank0, name).to_f64_vec();
        let e = rel(&shard0, &want0[..shard0.len()]);
        assert!(e < 1e-5, "replica 0's shard of {name}: {e}");
        let shard = get(&rank2, name).to_f64_vec();
        let mut want1 = r(&format!("replica1/{name}"));
        want1.resize(want1.len().div_ceil(2) * 2, 0.0);
        let e = rel(&shard, &want1[..shard.len()]);
        assert!(e < 1e-5, "replica 1's shard of {name}: {e}");
        // the replicas differ: averaging is sparse (so the comparison above can fail)
        assert!(rel(&want0, &r(&format!("replica1/{name}"))) > 1e-3);
        let u = get(&rank0, &format!("asyncmesh.u/{name}")).to_f64_vec();
        let want_u = r(&format!("u0/{name}"));
        let e = rel(&u, &want_u[..u.len()]);
        assert!(e < 1e-4, "u of {name}: {e}");
    }
    let step = get(&rank0, "asyncmesh.step").to_f64_vec();
    assert_eq!(step, vec![8.0]);

    // every backend puts the model together from every rank's master shards with
    // `executor::parameters_from` (for --save-params, evaluation and multi-process runs): the
    // replicas' mean as well, compared with the mean computed above from the shards
    let plan =
        hzp_ir::Plan::from_json(&std::fs::read_to_string(&plan).unwrap(), "plan.json").unwrap();
    let p = &plan.program;
    let shards: std::collections::HashMap<usize, Vec<(String, Tensor)>> = (0..4)
        .map(|r| {
            let state = rank_state(&ck, r);
            let masters = p
                .params
                .iter()
                .map(|prm| {
                    let name = p.value(prm.value).name.clone();
                    let t = get(&state, &name).clone();
                    (name, t)
                })
                .collect();
            (r, masters)
        })
        .collect();
    let assembled = hzp_runtime::executor::parameters_from(
        &plan.mesh,
        &plan.layouts,
        plan.asyncmesh.is_some(),
        &shards,
    )
    .unwrap();
    assert_eq!(assembled.len(), 4);
    for (name, t) in &assembled {
        let here = mean_from_shards(&ck, name, t.shape.iter().product());
        if let Err(e) = is_the_mean(&t.to_f64_vec(), &here) {
            panic!("parameters_from's {name}: {e}");
        }
    }
}

/// The slow-axis all-reduce of the averaged chunks is on a comm stream, issued before the
/// first forward compute node; the compute stream reads it only after the last backward
/// node, with a wait in between; the chunks are about S/H of the master bytes.
#[test]
fn average_overlaps_forward_and_backward() {
    let out = tempdir("order");
    let plan = compile(&out, &[]);
    let plan =
        hzp_ir::plan::Plan::from_json(&std::fs::read_to_string(&plan).unwrap(), "plan").unwrap();
    let p = &plan.program;
    assert_eq!(plan.strategy, "asyncmesh");
    assert_eq!(plan.asyncmesh.as_ref().unwrap().slow_axis, "node");
    let users = p.users();
    let slow: Vec<usize> = p
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| matches!(&n.op, Op::AllReduce { group, .. } if group.axes == ["node"]))
        .map(|(i, _)| i)
        .collect();
    // the chunks' all-reduce: the slow one whose input is not the loss
    let avg = *slow
        .iter()
        .find(|&&i| p.ty(p.nodes[i].inputs[0]).numel() > 1)
        .expect("a slow-axis all-reduce of the chunks");
    let an = &p.nodes[avg];
    assert_ne!(an.stream, StreamKind::Compute);
    let compute: Vec<usize> = p
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| {
            n.role.kind == RoleKind::Compute
                && !matches!(n.op, Op::RecordEvent { .. } | Op::WaitEvent { .. })
        })
        .map(|(i, _)| i)
        .collect();
    let (first, last) = (compute[0], *compute.last().unwrap());
    assert!(
        avg < first,
        "all-reduce at {avg}, first forward node at {first}"
    );
    let first_reader = users[an.outputs[0].index()]
        .iter()
        .map(|n| n.index())
        .min()
        .unwrap();
    assert!(
        first_reader > last,
        "read at {first_reader}, last backward node at {last}"
    );
    assert_eq!(p.nodes[first_reader].stream, StreamKind::Compute);
    let waits = p.nodes[last..first_reader]
        .iter()
        .filter(|n| matches!(n.op, Op::WaitEvent { .. }) && n.stream == StreamKind::Compute)
        .count();
    assert!(waits > 0, "no wait before the average is read");
    // per step: ceil(0.15 n) of each n-element shard (n = 64, 8, 16, 1)
    assert_eq!(p.ty(an.inputs[0]).numel(), 10 + 2 + 3 + 1);
    // inspect reports the slow axis's bytes apart from the fast axes'
    let text = ok(&["inspect", s(&out.join("plan.json"))]);
    assert!(
        text.contains("over the slow axis `node` 68 B ("),
        "inspect: {text}"
    );
}

/// Each flag's bad values are refused with the flag named.
#[test]
fn flags_are_checked() {
    let out = tempdir("flags");
    let (model, io) = (dir().join("mlp.hzp"), dir().join("io.npz"));
    let base = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "compile",
            s(&model),
            "--inputs",
            s(&io),
            "--loss",
            "mse",
            "--target",
            "y",
            "--mesh",
            "node=2,gpu=2",
            "-o",
            s(&out.join("p.json")),
        ]
        .iter()
        .map(|x| x.to_string())
        .collect();
        v.extend(extra.iter().map(|x| x.to_string()));
        v
    };
    let am = ["--strategy", "asyncmesh", "--slow-axis", "node"];
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec!["--sparsity", "0"], vec!["--sparsity 0", "0 < S <= 1"]),
        (vec!["--sparsity", "1.5"], vec!["--sparsity 1.5"]),
        (vec!["--sparsity", "NaN"], vec!["--sparsity NaN"]),
        (vec!["--sparsity", "-0.1"], vec!["--sparsity"]),
        (
            vec!["--sync-every", "0"],
            vec!["--sync-every 0", "at least 1"],
        ),
        (vec!["--sync-every", "x"], vec!["--sync-every"]),
        (vec!["--ema-beta", "1"], vec!["--ema-beta 1", "0 <= B < 1"]),
        (vec!["--ema-beta", "inf"], vec!["--ema-beta inf"]),
        (vec!["--ema-beta", "-0.5"], vec!["--ema-beta"]),
    ];
    for (extra, needles) in cases {
        let mut args: Vec<&str> = am.to_vec();
        args.extend(extra);
        let a = base(&args);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        fails_with(&a, &needles);
    }
    let a = base(&["--strategy", "asyncmesh", "--slow-axis", "rack"]);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    fails_with(&a, &["--slow-axis rack", "not an axis", "node, gpu"]);
    let a = base(&["--strategy", "asyncmesh"]);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    fails_with(&a, &["needs --slow-axis"]);
    let a = base(&["--strategy", "zero3", "--sparsity", "0.1"]);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    fails_with(&a, &["asyncmesh only", "zero3"]);
}

/// The step counter and the EMA states are checkpointed: 4 steps, then `--resume` to 8,
/// end bitwise where 8 uninterrupted steps do (losses and replica 0's parameters), and the
/// run says whose parameters it saves.
#[test]
fn resume_continues_the_averaging() {
    let out = tempdir("resume");
    let plan = compile(&out, &[]);
    let io = dir().join("io.npz");
    let run = |tag: &str, extra: &[&str]| -> (String, Vec<(String, Tensor)>) {
        let params = out.join(format!("{tag}.npz"));
        let mut args = vec![
            "run",
            s(&plan),
            "--inputs",
            s(&io),
            "--steps",
            "8",
            "--save-params",
            s(&params),
        ];
        args.extend_from_slice(extra);
        let text = ok(&args);
        (text, read_npz(&params))
    };
    let (text, whole) = run("whole", &[]);
    assert!(text.contains("replicas along node"), "{text}");
    assert!(text.contains("the replicas' mean"), "{text}");
    let ck = out.join("ck");
    run("first", &["--checkpoint-dir", s(&ck), "--stop-at", "4"]);
    let (_, resumed) = run("second", &["--checkpoint-dir", s(&ck), "--resume"]);
    assert_eq!(whole.len(), resumed.len());
    for ((k, a), (k2, b)) in whole.iter().zip(&resumed) {
        assert_eq!(k, k2);
        assert_eq!(a.to_f64_vec(), b.to_f64_vec(), "{k} after resuming");
    }
}
