//! Nothing the user has is lost: checkpoint retention removes only the run's own older
//! checkpoints (never the one resumed from, never another run's or a stray folder); no
//! output of a command is one of its inputs (or lies inside one) or another of its
//! outputs; a checkpoint is verified the same way on every path (same-plan resume,
//! resharded resume, export, show), so forged headers and manifests are refused; a run
//! killed at random points while checkpointing resumes to the uninterrupted run's bits.

mod common;
use common::*;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

fn model() -> PathBuf {
    own_models_dir().join("gpt2_tiny.legacy.op17.onnx")
}

fn tokens() -> PathBuf {
    own_models_dir().join("tokens/train.bin")
}

/// Compiles the tiny GPT-2 (from `model`) for batches of 4 x 32 tokens.
fn compile_from(dir: &Path, model: &Path, name: &str, mesh: &str) -> PathBuf {
    let plan = dir.join(format!("{name}.json"));
    ok(&[
        "compile",
        s(model),
        "--shape",
        "input_ids=4x32",
        "--retie",
        "--mesh",
        mesh,
        "--strategy",
        "zero3",
        "-o",
        s(&plan),
    ]);
    plan
}

/// `hzp run PLAN --data tokens --steps STEPS` with `extra`.
fn run(plan: &Path, steps: &str, extra: &[&str]) -> (i32, String, String) {
    let t = tokens();
    let mut args = vec!["run", s(plan), "--data", s(&t), "--steps", steps];
    args.extend_from_slice(extra);
    hzp(&args)
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn sha_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

#[test]
fn keep_removes_only_this_runs_older_checkpoints() {
    let dir = tempdir("keep-lineage");
    let plan = compile_from(&dir, &model(), "p", "gpu=2");
    // another run's complete checkpoint at a later step, and a stray folder
    let other = dir.join("other");
    let (code, _, err) = run(
        &plan,
        "9",
        &["--checkpoint-dir", s(&other), "--checkpoint-every", "9"],
    );
    assert_eq!(code, 0, "{err}");
    let ck = dir.join("ck");
    std::fs::create_dir_all(ck.join("step-000011")).unwrap();
    std::fs::rename(other.join("step-000009"), ck.join("step-000009")).unwrap();
    let (code, out, err) = run(
        &plan,
        "4",
        &[
            "--checkpoint-dir",
            s(&ck),
            "--checkpoint-every",
            "1",
            "--keep",
            "1",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("step-000004"), "{out}");
    assert_eq!(
        names(&ck),
        vec!["step-000004", "step-000009", "step-000011"],
        "{err}"
    );
    assert!(
        err.contains("step-000009") && err.contains("another run"),
        "{err}"
    );
    assert!(
        err.contains("step-000011") && err.contains("not a complete checkpoint"),
        "{err}"
    );
    // each note once, not once per checkpoint written
    assert_eq!(err.matches("step-000011").count(), 1, "{err}");
}

#[test]
fn keep_never_removes_the_checkpoint_resumed_from() {
    let dir = tempdir("keep-resume");
    let plan = compile_from(&dir, &model(), "p", "gpu=2");
    let ck = dir.join("ck");
    let flags = [
        "--checkpoint-dir",
        s(&ck),
        "--checkpoint-every",
        "1",
        "--keep",
        "1",
    ];
    let mut first = flags.to_vec();
    first.extend_from_slice(&["--stop-at", "2"]);
    let (code, _, err) = run(&plan, "6", &first);
    assert_eq!(code, 0, "{err}");
    assert_eq!(names(&ck), vec!["step-000002"]);
    // a higher-numbered stray folder, and what a killed writer of this run left behind
    std::fs::create_dir_all(ck.join("step-000009")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(ck.join("step-000002/manifest.json")).unwrap(),
    )
    .unwrap();
    let run_id = manifest["run"].as_str().unwrap().to_string();
    assert!(run_id.len() >= 8, "{manifest}");
    let ours = format!(".step-000003.partial-{run_id}-1-3-0");
    let theirs = ".step-000003.partial-0123456789abcdef-1-3-0".to_string();
    std::fs::create_dir_all(ck.join(&ours)).unwrap();
    std::fs::create_dir_all(ck.join(&theirs)).unwrap();
    let mut second = flags.to_vec();
    second.extend_from_slice(&["--resume", "--stop-at", "4"]);
    let (code, out, err) = run(&plan, "6", &second);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("resumed from") && out.contains("step-000002"),
        "{out}"
    );
    let left = names(&ck);
    assert!(left.contains(&"step-000002".to_string()), "{left:?}");
    assert!(left.contains(&"step-000004".to_string()), "{left:?}");
    assert!(left.contains(&"step-000009".to_string()), "{left:?}");
    assert!(!left.contains(&"step-000003".to_string()), "{left:?}");
    assert!(!left.contains(&ours), "{left:?}");
    assert!(left.contains(&theirs), "{left:?}");
}

#[test]
fn no_output_is_an_input_or_another_output() {
    let dir = tempdir("outputs");
    // the plan names a model of the user's: a copy it may not write over
    let m = dir.join("model.onnx");
    std::fs::copy(model(), &m).unwrap();
    let before = std::fs::read(&m).unwrap();
    let plan = compile_from(&dir, &m, "p", "gpu=2");
    let (code, _, err) = run(&plan, "1", &["--save-params", s(&m)]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("the model the plan names"), "{err}");
    assert_eq!(std::fs::read(&m).unwrap(), before);
    let (code, _, err) = run(&plan, "1", &["--log", s(&m)]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--log") && err.contains("model"), "{err}");
    assert_eq!(std::fs::read(&m).unwrap(), before);
    // two outputs on one path
    let x = dir.join("x.out");
    let (code, _, err) = run(&plan, "1", &["--trace", s(&x), "--log", s(&x)]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("same file"), "{err}");
    assert!(!x.exists());
    let (code, _, err) = hzp(&["simulate", s(&plan), "--trace", s(&x), "--timeline", s(&x)]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("--trace") && err.contains("--timeline") && err.contains("same file"),
        "{err}"
    );
    let txt = dir.join("a.txt");
    std::fs::write(&txt, "some text to turn into tokens").unwrap();
    let (code, _, err) = hzp(&[
        "data",
        "prepare",
        s(&txt),
        "-o",
        s(&x),
        "--val-output",
        s(&x),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("--val-output") && err.contains("same file"),
        "{err}"
    );
    // a file of the checkpoint being resumed, and a shard of the checkpoint exported
    let ck = dir.join("ck");
    let (code, _, err) = run(&plan, "2", &["--checkpoint-dir", s(&ck)]);
    assert_eq!(code, 0, "{err}");
    let mf = ck.join("step-000002/manifest.json");
    let mf_before = std::fs::read(&mf).unwrap();
    let (code, _, err) = run(
        &plan,
        "3",
        &["--checkpoint-dir", s(&ck), "--resume", "--log", s(&mf)],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("checkpoint"), "{err}");
    assert_eq!(std::fs::read(&mf).unwrap(), mf_before);
    let shard = ck.join("step-000002/rank-00000.safetensors");
    let shard_before = std::fs::read(&shard).unwrap();
    let (code, _, err) = hzp(&["checkpoint", "export", s(&ck), "-o", s(&shard)]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("checkpoint"), "{err}");
    assert_eq!(std::fs::read(&shard).unwrap(), shard_before);
    // a checkpoint folder that is a file: refused before the first step
    let (code, out, err) = run(&plan, "2", &["--checkpoint-dir", s(&txt)]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("not a folder") && !out.contains("step    1"),
        "{err}"
    );
}

/// A model whose one weight lies in an external-data file beside it: `y = x + w`.
fn external_data_model(dir: &Path) -> (PathBuf, PathBuf) {
    use hzp_frontends::onnx::proto::*;
    use prost::Message;
    let w = dir.join("w.bin");
    let vals: Vec<u8> = [1.0f32, 2.0, 3.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    std::fs::write(&w, &vals).unwrap();
    let vi = |name: &str| ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: 1,
                shape: Some(TensorShapeProto {
                    dim: vec![tensor_shape_proto::Dimension {
                        value: Some(tensor_shape_proto::dimension::Value::DimValue(3)),
                        ..Default::default()
                    }],
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    };
    let init = TensorProto {
        name: "w".into(),
        dims: vec![3],
        data_type: 1,
        data_location: data_location::EXTERNAL,
        external_data: vec![StringStringEntryProto {
            key: "location".into(),
            value: "w.bin".into(),
        }],
        ..Default::default()
    };
    let model = ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(GraphProto {
            name: "g".into(),
            node: vec![NodeProto {
                op_type: "Add".into(),
                input: vec!["x".into(), "w".into()],
                output: vec!["y".into()],
                ..Default::default()
            }],
            initializer: vec![init],
            input: vec![vi("x")],
            output: vec![vi("y")],
            ..Default::default()
        }),
        ..Default::default()
    };
    let p = dir.join("ext.onnx");
    std::fs::write(&p, model.encode_to_vec()).unwrap();
    (p, w)
}

#[test]
fn external_data_is_an_input() {
    let dir = tempdir("external");
    let (m, w) = external_data_model(&dir);
    let inputs = dir.join("in.npz");
    hzp_frontends::npz::write(
        &inputs,
        &[(
            "x".to_string(),
            hzp_ir::Tensor::f32(vec![3], vec![0.5, 0.5, 0.5]),
        )],
    )
    .unwrap();
    // the model evaluates (the data is read from w.bin)
    let out = dir.join("out.npz");
    ok(&["eval", s(&m), "--inputs", s(&inputs), "-o", s(&out)]);
    let y = read_npz(&out);
    assert_eq!(y[0].1.to_f64_vec(), vec![1.5, 2.5, 3.5]);
    let before = std::fs::read(&w).unwrap();
    for args in [
        vec!["eval", s(&m), "--inputs", s(&inputs), "-o", s(&w)],
        vec!["import", s(&m), "-o", s(&w)],
    ] {
        let (code, _, err) = hzp(&args);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.contains("a file of the model"), "{err}");
        assert_eq!(std::fs::read(&w).unwrap(), before);
    }
}

/// The header of a safetensors file: (its JSON, the bytes after it).
fn split_st(b: &[u8]) -> (String, Vec<u8>) {
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    (
        String::from_utf8(b[8..8 + n].to_vec()).unwrap(),
        b[8 + n..].to_vec(),
    )
}

fn join_st(header: &str, rest: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(rest);
    out
}

/// `v` as compact JSON with sorted keys (the manifest's documented seal form).
fn canonical(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let parts: Vec<String> = keys
                .iter()
                .map(|k| {
                    format!(
                        "{}:{}",
                        serde_json::to_string(k).unwrap(),
                        canonical(&m[*k])
                    )
                })
                .collect();
            format!("{{{}}}", parts.join(","))
        }
        serde_json::Value::Array(a) => {
            format!(
                "[{}]",
                a.iter().map(canonical).collect::<Vec<_>>().join(",")
            )
        }
        other => other.to_string(),
    }
}

/// Rewrites a manifest with its seal recomputed, as a forger would.
fn reseal(path: &Path, mut m: serde_json::Value) {
    m["manifest_sha256"] = serde_json::Value::String(String::new());
    m["manifest_sha256"] = serde_json::Value::String(sha_hex(canonical(&m).as_bytes()));
    let mut text = serde_json::to_string_pretty(&m).unwrap();
    text.push('\n');
    std::fs::write(path, text).unwrap();
}

fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Every reader of `ck`: same-plan resume, resharded resume, export, show.
fn every_path_refuses(dir: &Path, plan: &Path, one: &Path, ck: &Path, needle: &str) {
    for (what, p) in [("same plan", plan), ("resharded", one)] {
        let (code, _, err) = run(p, "3", &["--checkpoint-dir", s(ck), "--resume"]);
        assert_eq!(code, 1, "{what} resume of a forged checkpoint: {err}");
        assert!(err.contains(needle), "{what}: {err}");
    }
    let out = dir.join("export.safetensors");
    let (code, _, err) = hzp(&["checkpoint", "export", s(ck), "-o", s(&out)]);
    assert_eq!(code, 1, "export of a forged checkpoint: {err}");
    assert!(err.contains(needle), "export: {err}");
    assert!(!out.exists());
    let shown = ok(&["checkpoint", "show", s(ck)]);
    assert!(shown.contains("not a complete checkpoint"), "{shown}");
}

#[test]
fn forged_checkpoints_are_refused_on_every_path() {
    let dir = tempdir("forged");
    let plan = compile_from(&dir, &model(), "p", "gpu=2");
    let one = compile_from(&dir, &model(), "one", "gpu=1");
    let good = dir.join("good");
    let (code, _, err) = run(&plan, "2", &["--checkpoint-dir", s(&good)]);
    assert_eq!(code, 0, "{err}");
    let fresh = |tag: &str| {
        let ck = dir.join(tag);
        let step = ck.join("step-000002");
        std::fs::create_dir_all(&step).unwrap();
        for e in std::fs::read_dir(good.join("step-000002")).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), step.join(e.file_name())).unwrap();
        }
        (ck, step)
    };
    let manifest = read_json(&good.join("step-000002/manifest.json"));
    let master = manifest["layouts"][0]["name"].as_str().unwrap().to_string();

    // 1. a master shard's dtype changed in the header (same size), the file's hash and
    //    the manifest's seal recomputed: the header disagrees with the manifest
    let forge_dtype = |step: &Path, also_manifest: bool| {
        let f = step.join("rank-00000.safetensors");
        let (header, rest) = split_st(&std::fs::read(&f).unwrap());
        let mut h: serde_json::Value = serde_json::from_str(&header).unwrap();
        assert_eq!(h[&master]["dtype"], "F32", "{header}");
        h[&master]["dtype"] = "I32".into();
        let mut text = serde_json::to_string(&h).unwrap();
        while text.len() < header.len() {
            text.push(' ');
        }
        let bytes = join_st(&text, &rest);
        std::fs::write(&f, &bytes).unwrap();
        let mp = step.join("manifest.json");
        let mut m = read_json(&mp);
        m["files"][0]["sha256"] = sha_hex(&bytes).into();
        m["files"][0]["bytes"] = (bytes.len() as u64).into();
        if also_manifest {
            for t in m["files"][0]["tensors"].as_array_mut().unwrap() {
                if t["name"] == master.as_str() {
                    t["dtype"] = "i32".into();
                }
            }
        }
        reseal(&mp, m);
    };
    let (ck, step) = fresh("dtype");
    forge_dtype(&step, false);
    every_path_refuses(&dir, &plan, &one, &ck, "its header has");
    // the manifest forged to agree: the layout says master shards are f32
    let (ck, step) = fresh("dtype-both");
    forge_dtype(&step, true);
    let (code, _, err) = run(&one, "3", &["--checkpoint-dir", s(&ck), "--resume"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("f32["), "{err}");
    let (code, _, err) = hzp(&["checkpoint", "export", s(&ck), "-o", s(&dir.join("e.npz"))]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("f32["), "{err}");

    // 2. two `files` entries swapped, the seal recomputed: entries are one per rank in order
    let (ck, step) = fresh("swap");
    let mp = step.join("manifest.json");
    let mut m = read_json(&mp);
    let files = m["files"].as_array_mut().unwrap();
    files.swap(0, 1);
    reseal(&mp, m);
    every_path_refuses(&dir, &plan, &one, &ck, "file entry 0");

    // 3. the two rank files swapped on disk with their entries' sizes, hashes and tensors:
    //    each file's header says which rank it holds
    let (ck, step) = fresh("swap-files");
    let (a, b) = (
        step.join("rank-00000.safetensors"),
        step.join("rank-00001.safetensors"),
    );
    let tmp = step.join("t");
    std::fs::rename(&a, &tmp).unwrap();
    std::fs::rename(&b, &a).unwrap();
    std::fs::rename(&tmp, &b).unwrap();
    let mp = step.join("manifest.json");
    let mut m = read_json(&mp);
    let f0 = m["files"][0].clone();
    let f1 = m["files"][1].clone();
    for key in ["bytes", "sha256", "tensors"] {
        m["files"][0][key] = f1[key].clone();
        m["files"][1][key] = f0[key].clone();
    }
    reseal(&mp, m);
    every_path_refuses(&dir, &plan, &one, &ck, "holds rank 1");

    // 4. any edit without the seal: the manifest's own hash
    let (ck, step) = fresh("edit");
    let mp = step.join("manifest.json");
    let text = std::fs::read_to_string(&mp).unwrap();
    std::fs::write(&mp, text.replacen("\"lr\": ", "\"lr\": 1", 1)).unwrap();
    every_path_refuses(&dir, &plan, &one, &ck, "manifest_sha256");

    // 5. a layout made absurd and sealed: refused before any number is trusted
    let (ck, step) = fresh("layout");
    let mp = step.join("manifest.json");
    let mut m = read_json(&mp);
    m["layouts"][0]["padded"] = serde_json::json!(1u64 << 50);
    reseal(&mp, m);
    every_path_refuses(&dir, &plan, &one, &ck, "not a layout hzp writes");
}

/// A 64-bit linear congruential generator (the test's own: fixed, reproducible delays).
fn lcg(state: &mut u64) -> u64 {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *state >> 33
}

#[test]
fn killed_while_checkpointing_resumes_to_the_same_bits() {
    let dir = tempdir("kill");
    let plan = compile_from(&dir, &model(), "p", "gpu=2");
    let steps = "24";
    let whole = dir.join("whole.npz");
    let (code, _, err) = run(&plan, steps, &["--save-params", s(&whole)]);
    assert_eq!(code, 0, "{err}");
    let ck = dir.join("ck");
    let t = tokens();
    let args = |out: &Path| -> Vec<String> {
        [
            "run",
            s(&plan),
            "--data",
            s(&t),
            "--steps",
            steps,
            "--checkpoint-dir",
            s(&ck),
            "--checkpoint-every",
            "1",
            "--keep",
            "2",
            "--resume",
            "--save-params",
            s(out),
        ]
        .iter()
        .map(|x| x.to_string())
        .collect()
    };
    let started = std::time::Instant::now();
    let mut seed = 0x5eed_u64;
    let mut kills = 0;
    let resumed = dir.join("resumed.npz");
    // kill the run at pseudo-random moments; each time it resumes from what is complete
    while kills < 5 && started.elapsed() < std::time::Duration::from_secs(20) {
        let mut child = std::process::Command::new(hzp_bin())
            .args(args(&resumed))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let delay = 40 + lcg(&mut seed) % 400;
        std::thread::sleep(std::time::Duration::from_millis(delay));
        match child.try_wait().unwrap() {
            Some(status) => {
                assert!(status.success(), "the run failed: {status}");
                break;
            }
            None => {
                child.kill().unwrap();
                child.wait().unwrap();
                kills += 1;
            }
        }
    }
    assert!(
        kills >= 2,
        "the run was killed only {kills} times: the test checks nothing"
    );
    // finish: the parameters equal the uninterrupted run's bit for bit
    let a: Vec<String> = args(&resumed);
    let a: Vec<&str> = a.iter().map(|x| x.as_str()).collect();
    let out = ok(&a);
    assert!(
        out.contains("saved") || out.contains("nothing to run"),
        "{out}"
    );
    if !resumed.exists() {
        // the last killed-or-finished child had saved them: nothing to compare otherwise
        panic!("no parameters saved after resuming: {out}");
    }
    let (x, y) = (read_npz(&whole), read_npz(&resumed));
    assert_eq!(x.len(), y.len());
    for ((ka, ta), (kb, tb)) in x.iter().zip(&y) {
        assert_eq!(ka, kb);
        assert_eq!(ta, tb, "{ka} differs after {kills} kills");
    }
    // no hidden partial folder of the run is left behind
    let left = names(&ck);
    assert!(
        left.iter().all(|n| !n.contains(".partial-")),
        "{left:?} after {kills} kills"
    );
}
