//! The CLI as a user runs it: exit codes, messages, JSON keys, files written.

mod common;
use common::*;
use hzp_frontends::npz;
use hzp_ir::Tensor;

fn params_of(spec: &str) -> u64 {
    let (code, out, err) = hzp(&["show", spec, "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["parameters"].as_u64().unwrap()
}

#[test]
fn preset_parameter_counts() {
    let gpt3 = params_of("preset:gpt3-175b");
    assert!(
        (174_000_000_000..=176_000_000_000).contains(&gpt3),
        "{gpt3}"
    );
    let llama = params_of("preset:llama3-70b") as f64;
    assert!((llama / 70.6e9 - 1.0).abs() < 0.01, "{llama}");
    let mixtral = params_of("preset:mixtral-8x7b") as f64;
    assert!((mixtral / 46.7e9 - 1.0).abs() < 0.01, "{mixtral}");
}

#[test]
fn eval_matches_torch_and_writes_outputs() {
    let dir = tempdir("cli");
    let out = dir.join("out.npz");
    let model = own_models_dir().join("gpt2_tiny.legacy.op17.onnx");
    let io = own_models_dir().join("gpt2_tiny.io.npz");
    let (code, stdout, err) = hzp(&[
        "eval",
        model.to_str().unwrap(),
        "--inputs",
        io.to_str().unwrap(),
        "--reference",
        io.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stdout}{err}");
    assert!(stdout.contains("max |diff| vs torch_out"), "{stdout}");
    let outs = read_npz(&out);
    assert_eq!(outs[0].0, "logits");
    assert_eq!(outs[0].1.shape, vec![2, 16, 256]);
}

#[test]
fn import_writes_hzp_that_loads_back_and_evaluates_the_same() {
    let dir = tempdir("cli");
    let hzp_path = dir.join("llama.hzp");
    let model = own_models_dir().join("llama_tiny.dynamo.op18.onnx");
    let io = own_models_dir().join("llama_tiny.io.npz");
    let (code, _, err) = hzp(&[
        "import",
        model.to_str().unwrap(),
        "--shape",
        "input_ids=2x16",
        "-o",
        hzp_path.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(dir.join("llama.weights.npz").exists());
    let (code, stdout, err) = hzp(&[
        "eval",
        hzp_path.to_str().unwrap(),
        "--inputs",
        io.to_str().unwrap(),
        "--reference",
        io.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stdout}{err}");
}

#[test]
fn show_json_has_stable_keys() {
    let model = own_models_dir().join("bert_tiny.legacy.op17.onnx");
    let io = own_models_dir().join("bert_tiny.io.npz");
    let (code, out, err) = hzp(&[
        "show",
        model.to_str().unwrap(),
        "--inputs",
        io.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for key in ["parameters", "op_histogram", "layers", "inputs", "outputs"] {
        assert!(
            v.get(key).is_some(),
            "show --format json lacks `{key}`: {out}"
        );
    }
}

#[test]
fn bad_inputs_fail_with_a_message_and_no_panic() {
    let dir = tempdir("cli");
    let empty = dir.join("empty.onnx");
    std::fs::write(&empty, b"").unwrap();
    let junk = dir.join("junk.onnx");
    std::fs::write(
        &junk,
        (0..4096u32)
            .map(|i| ((i.wrapping_mul(2654435761u32)) >> 24) as u8)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let bad_text = dir.join("bad.hzp");
    std::fs::write(
        &bad_text,
        "program \"x\"\ninput %a : f32[2]\n%b = Frobnicate(%a) : f32[2] \"n\"\noutput %b\n",
    )
    .unwrap();
    let model = own_models_dir().join("gpt2_tiny.dynamo.op18.onnx");
    let cases: Vec<Vec<String>> = vec![
        vec!["show".into(), empty.display().to_string()],
        vec!["show".into(), junk.display().to_string()],
        vec!["show".into(), bad_text.display().to_string()],
        vec!["show".into(), "does-not-exist.onnx".into()],
        vec!["show".into(), "preset:nonsense".into()],
        // symbolic dims left unbound
        vec!["show".into(), model.display().to_string()],
        vec![
            "show".into(),
            model.display().to_string(),
            "--shape".into(),
            "input_ids=2".into(),
        ],
        vec![
            "show".into(),
            model.display().to_string(),
            "--shape".into(),
            "input_ids=axb".into(),
        ],
    ];
    for args in cases {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, out, err) = hzp(&a);
        assert_eq!(code, 1, "{a:?} should fail with exit 1: {out}{err}");
        assert!(!err.contains("panicked"), "{a:?} panicked: {err}");
        assert!(!err.trim().is_empty(), "{a:?} printed no error");
    }
    // the unknown op is named, with its line
    let (_, _, err) = hzp(&["show", bad_text.to_str().unwrap()]);
    assert!(err.contains("Frobnicate") && err.contains(":3:"), "{err}");
}

#[test]
fn refuses_to_overwrite_its_input() {
    let dir = tempdir("cli");
    let io = dir.join("io.npz");
    std::fs::copy(own_models_dir().join("gpt2_tiny.io.npz"), &io).unwrap();
    let before = std::fs::read(&io).unwrap();
    let model = own_models_dir().join("gpt2_tiny.dynamo.op18.onnx");
    let (code, _, err) = hzp(&[
        "eval",
        model.to_str().unwrap(),
        "--inputs",
        io.to_str().unwrap(),
        "-o",
        io.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("input"), "{err}");
    assert_eq!(std::fs::read(&io).unwrap(), before);
}

/// `x` f32[2,3] reshaped to the shape held by the graph input `s` i64[2].
fn reshape_by_input_model() -> Vec<u8> {
    use hzp_frontends::onnx::proto::*;
    use prost::Message;
    let vi = |name: &str, elem: i32, dims: &[i64]| ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            denotation: String::new(),
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: elem,
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|&d| tensor_shape_proto::Dimension {
                            denotation: String::new(),
                            value: Some(tensor_shape_proto::dimension::Value::DimValue(d)),
                        })
                        .collect(),
                }),
            })),
        }),
        doc_string: String::new(),
    };
    ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: 18,
        }],
        graph: Some(GraphProto {
            node: vec![NodeProto {
                input: vec!["x".into(), "s".into()],
                output: vec!["y".into()],
                name: "reshape".into(),
                op_type: "Reshape".into(),
                ..Default::default()
            }],
            name: "g".into(),
            input: vec![vi("x", 1, &[2, 3]), vi("s", 7, &[2])],
            output: vec![ValueInfoProto {
                name: "y".into(),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

#[test]
fn shapes_fed_as_inputs_are_bound_by_value_and_checked() {
    let dir = tempdir("cli");
    let model = dir.join("reshape.onnx");
    std::fs::write(&model, reshape_by_input_model()).unwrap();
    let x = Tensor::f32(vec![2, 3], (0..6).map(|v| v as f32).collect());
    let only_x = dir.join("x.npz");
    npz::write(&only_x, &[("x".to_string(), x.clone())]).unwrap();
    let m = model.to_str().unwrap();

    // no value: the error names the node, the input and the flag
    let (code, _, err) = hzp(&["eval", m, "--inputs", only_x.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("reshape") && err.contains("`s`") && err.contains("--bind"),
        "{err}"
    );

    // --bind: specialized, evaluated, printed with its value
    let out = dir.join("y.npz");
    let (code, _, err) = hzp(&[
        "eval",
        m,
        "--inputs",
        only_x.to_str().unwrap(),
        "--bind",
        "s=3,2",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let y = npz::read(&out).unwrap();
    assert_eq!(y[0].1.shape, vec![3, 2]);
    let (code, text, err) = hzp(&["import", m, "--bind", "s=3,2"]);
    assert_eq!(code, 0, "{err}");
    assert!(text.contains("input %s : i64[2] = [3, 2]"), "{text}");
    let (code, _, err) = hzp(&["import", m, "--bind", "shape=3,2"]);
    assert_eq!(code, 1);
    // miette wraps lines; compare the words
    let flat = |e: &str| {
        e.replace('│', " ")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert!(
        flat(&err).contains("`shape`, which is not a graph input"),
        "{err}"
    );
    let (code, _, err) = hzp(&["import", m, "--bind", "s=3,2,1"]);
    assert_eq!(code, 1);
    assert!(
        flat(&err).contains("3 numbers for input `s`, whose shape is [2]"),
        "{err}"
    );

    // the value from --inputs, then another value than the one bound: refused, naming `s`
    let with_s = |v: Vec<i64>| {
        let f = dir.join(format!("xs{}{}.npz", v[0], v[1]));
        npz::write(
            &f,
            &[
                ("x".to_string(), x.clone()),
                ("s".to_string(), Tensor::i64(vec![2], v)),
            ],
        )
        .unwrap();
        f
    };
    let f = with_s(vec![1, 6]);
    let (code, _, err) = hzp(&["eval", m, "--inputs", f.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    // show reads only the arrays' shapes, and their values when the import needs them
    let (code, text, err) = hzp(&["show", m, "--inputs", f.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(text.contains("Reshape"), "{text}");
    let (code, _, err) = hzp(&["show", m, "--inputs", only_x.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("`s`") && err.contains("--bind"), "{err}");
    let (code, _, err) = hzp(&[
        "eval",
        m,
        "--inputs",
        f.to_str().unwrap(),
        "--bind",
        "s=3,2",
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("input `s` is [1, 6]"), "{err}");
}

#[test]
fn compile_writes_a_verified_deterministic_plan_that_inspect_reads() {
    let dir = tempdir("cli");
    let model = own_models_dir().join("llama_tiny.dynamo.op18.onnx");
    let io = own_models_dir().join("llama_tiny.io.npz");
    let mut plans = Vec::new();
    for (i, (mesh, strategy)) in [
        ("node=2,gpu=2", "asynchzp"),
        ("node=2,gpu=2", "asynchzp"),
        ("gpu=4", "zero3"),
        ("gpu=2", "ddp"),
        ("node=2,gpu=2", "hsdp"),
    ]
    .iter()
    .enumerate()
    {
        // the example batch has 2 rows; 4 ranks need a global batch of at least 4
        let rows = if mesh.contains("node") || mesh.contains('4') {
            4
        } else {
            2
        };
        let out = dir.join(format!("plan{i}.json"));
        let (code, stdout, err) = hzp(&[
            "compile",
            model.to_str().unwrap(),
            "--shape",
            &format!("input_ids={rows}x16"),
            "--mesh",
            mesh,
            "--strategy",
            strategy,
            "--memory",
            "1GiB",
            "-o",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{mesh} {strategy}: {stdout}{err}");
        assert!(stdout.contains("collectives per step"), "{stdout}");
        let (code, text, err) = hzp(&["inspect", out.to_str().unwrap()]);
        assert_eq!(code, 0, "{err}");
        assert!(
            text.contains("stream allgather") && text.contains("memory per rank"),
            "{text}"
        );
        plans.push(std::fs::read(&out).unwrap());
    }
    assert_eq!(
        plans[0], plans[1],
        "the same compile twice gave different plans"
    );
    let _ = io;
    // a plan edited by hand is refused
    let edited = dir.join("edited.json");
    let text = String::from_utf8(plans[2].clone())
        .unwrap()
        .replacen("zero3", "zero2", 1);
    std::fs::write(&edited, text).unwrap();
    let (code, _, err) = hzp(&["inspect", edited.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("modified"), "{err}");
}

/// `hzp compile` gives a verified plan for every test model (the project's own, and
/// ../shared/onnx when present) on meshes of 1, 2, 4 and 8 ranks.
#[test]
fn every_model_compiles_on_1_2_4_and_8_ranks() {
    let dir = tempdir("cli");
    for (model, io) in all_models() {
        // the model's batch repeated to 8 rows, so that 8 ranks each get one
        let rows: Vec<(String, hzp_ir::Tensor)> = read_npz(&io)
            .into_iter()
            .filter(|(k, t)| k != "torch_out" && !t.shape.is_empty())
            .map(|(k, t)| {
                let reps = 8 / t.shape[0].max(1);
                let parts: Vec<&hzp_ir::Tensor> = (0..reps).map(|_| &t).collect();
                let cat = hzp_runtime::cpu::eval_op(&hzp_ir::Op::Concat { axis: 0 }, &parts)
                    .unwrap()
                    .remove(0);
                (k, cat)
            })
            .collect();
        let batch = dir.join("batch8.npz");
        hzp_frontends::npz::write(&batch, &rows).unwrap();
        for mesh in ["gpu=1", "gpu=2", "gpu=4", "node=2,gpu=4"] {
            let plan = dir.join("plan.json");
            let (code, out, err) = hzp(&[
                "compile",
                model.to_str().unwrap(),
                "--inputs",
                batch.to_str().unwrap(),
                "--mesh",
                mesh,
                "-o",
                plan.to_str().unwrap(),
            ]);
            assert_eq!(code, 0, "{} on {mesh}: {out}{err}", model.display());
            let (code, _, err) = hzp(&["inspect", plan.to_str().unwrap()]);
            assert_eq!(code, 0, "inspect {} on {mesh}: {err}", model.display());
        }
    }
}

/// One bucket per layer is the default; when that is what breaks the budget, compile says so
/// and uses 64 MiB buckets, and the plan it writes fits.
#[test]
fn unit_buckets_fall_back_to_fixed_buckets_under_a_tight_budget() {
    let dir = tempdir("cli");
    let plan = dir.join("plan.json");
    let args = |budget: &str| {
        vec![
            "compile".to_string(),
            "preset:gpt3-175b,layers=8".into(),
            "--mesh".into(),
            "node=16,gpu=8".into(),
            "--recompute".into(),
            "on".into(),
            "--memory".into(),
            budget.into(),
            "--format".into(),
            "json".into(),
            "-o".into(),
            plan.to_str().unwrap().into(),
        ]
    };
    let run = |budget: &str| {
        let a = args(budget);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let (code, out, err) = hzp(&a);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        (v["arena_bytes"].as_u64().unwrap(), err)
    };
    let (roomy, err) = run("80GiB");
    assert!(!err.contains("buckets of at most 64 MiB"), "{err}");
    // just under the unit-bucket arena (the planner's own estimate stays under it)
    let budget = roomy - (128 << 20);
    let (tight, err) = run(&budget.to_string());
    // said before building (the planner's estimate) or after (the planned arena)
    assert!(err.contains("buckets of at most 64 MiB"), "{err}");
    assert!(tight <= budget && tight < roomy, "{tight} vs {roomy}");
}

/// `--muon-placement canzona` on GPT-2 small (`preset:gpt`) over 8 ranks: `hzp inspect`
/// prints the partition, whose imbalance of owned Newton-Schulz FLOPs (max/mean) is within
/// Graham's bound for greedy LPT, 4/3 - 1/(3m) with m = 8 (mean <= OPT, so this implies the
/// LPT guarantee); a strategy whose optimizer group is one rank is refused.
#[test]
fn canzona_partition_of_gpt2_small_is_printed_and_balanced() {
    let dir = tempdir("cli");
    let plan = dir.join("canzona.json");
    let (code, out, err) = hzp(&[
        "compile",
        "preset:gpt",
        "--mesh",
        "gpu=8",
        "--strategy",
        "zero3",
        "--optimizer",
        "muon",
        "--muon-placement",
        "canzona",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, text, err) = hzp(&["inspect", plan.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let line = text
        .lines()
        .find(|l| l.starts_with("muon placement canzona over 8 ranks"))
        .unwrap_or_else(|| panic!("{text}"));
    println!("{line}");
    let imb: f64 = line
        .split("imbalance max/mean ")
        .nth(1)
        .and_then(|s| s.split(';').next())
        .unwrap()
        .parse()
        .unwrap();
    let bound = 4.0 / 3.0 - 1.0 / 24.0;
    assert!(imb <= bound, "{imb} > {bound}");
    assert!(
        text.contains("bucket 768x3072: 24 matrices (12 stored 3072x768), 3 slots per rank"),
        "{text}"
    );
    let (code, json, err) = hzp(&["inspect", plan.to_str().unwrap(), "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["muon_placement"]["owners"].as_object().unwrap().len(), 48);
    // ddp keeps the optimizer whole on every rank: no owners to choose among
    let (code, out, err) = hzp(&[
        "compile",
        "preset:gpt,layers=2",
        "--mesh",
        "gpu=2",
        "--strategy",
        "ddp",
        "--optimizer",
        "muon",
        "--muon-placement",
        "canzona",
        "-o",
        dir.join("ddp.json").to_str().unwrap(),
    ]);
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("optimizer group has several ranks"), "{err}");
}

/// A preset is planned in bf16 unless a precision is asked for: `--precision fp32` is kept
/// (it was once indistinguishable from the default and silently became bf16).
#[test]
fn preset_precision_fp32_is_kept() {
    let dir = tempdir("cli");
    let plan = |name: &str, extra: &[&str]| -> Vec<u8> {
        let out = dir.join(name);
        let mut args = vec!["compile", "preset:gpt,layers=2", "--mesh", "gpu=1", "-o"];
        args.push(out.to_str().unwrap());
        args.extend(extra);
        let (code, o, e) = hzp(&args);
        assert_eq!(code, 0, "{o}{e}");
        std::fs::read(&out).unwrap()
    };
    let default = plan("default.json", &[]);
    assert_eq!(default, plan("bf16.json", &["--precision", "bf16"]));
    assert_ne!(default, plan("fp32.json", &["--precision", "fp32"]));
}
