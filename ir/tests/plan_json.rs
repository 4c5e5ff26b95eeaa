//! The plan format: JSON round trip, refusal of other versions and of modified files, the text
//! form.

mod text_common;

use half::bf16;
use hzp_ir::*;
use text_common::{all_ops, one, t};

/// A two-stream program: an all-gather on the all-gather stream, an event, compute; data with
/// NaN, infinities and -0.0; a shapes-only parameter; a large constant and a bf16 state.
fn program() -> Program {
    let mut p = Program::new("tiny");
    p.mesh = Some(Mesh::parse("gpu=4").unwrap());
    let f = DType::F32;
    let x = p.add_input("x", t(f, &[8, 4]));
    let w = p.add_param(
        "w",
        t(f, &[2, 4]),
        Some(Tensor::f32(
            vec![2, 4],
            vec![
                1.0,
                f32::NAN,
                f32::INFINITY,
                f32::NEG_INFINITY,
                -0.0,
                0.1,
                1e-30,
                3.5,
            ],
        )),
    );
    let _big = p.add_param("big", t(f, &[1 << 20, 1 << 10]), None);
    let mask: Vec<f32> = (0..32)
        .map(|i| {
            if i % 3 == 0 {
                f32::NEG_INFINITY
            } else {
                i as f32
            }
        })
        .collect();
    let mask = p.add_const("mask", Tensor::f32(vec![8, 4], mask));
    let _small = p.add_const("small", Tensor::i64(vec![3], vec![1, -2, 3]));
    let _m = p.add_state(
        "m",
        t(DType::BF16, &[32]),
        Some(Tensor::new(
            vec![32],
            Data::BF16((0..32).map(|i| bf16::from_f32(i as f32 * 0.25)).collect()),
        )),
    );
    let full = one(
        &mut p,
        "ag_w",
        Op::AllGather {
            group: Group::new(["gpu"]),
            axis: 0,
        },
        &[w],
    );
    p.nodes[0].stream = StreamKind::AllGather;
    p.nodes[0].role = hzp_ir::Role::new(hzp_ir::RoleKind::Gather, "mb0.fwd.h \"0\"");
    p.add_node("rec", Op::RecordEvent { event: 1 }, vec![], vec![])
        .unwrap();
    p.nodes[1].stream = StreamKind::AllGather;
    p.add_node("wait", Op::WaitEvent { event: 1 }, vec![], vec![])
        .unwrap();
    let y = one(&mut p, "mul", Op::Binary(BinaryOp::Mul), &[x, full]);
    let y = one(&mut p, "masked", Op::Binary(BinaryOp::Add), &[y, mask]);
    let fill = one(
        &mut p,
        "fill",
        Op::Fill {
            value: f64::NEG_INFINITY,
            dtype: f,
            shape: vec![8, 4],
        },
        &[],
    );
    let y = one(&mut p, "out", Op::Binary(BinaryOp::Max), &[y, fill]);
    p.add_node("free_full", Op::Free, vec![full], vec![])
        .unwrap();
    p.outputs = vec![y];
    verify(&p).unwrap();
    p
}

fn plan_of(p: Program) -> Plan {
    let mesh = p
        .mesh
        .clone()
        .unwrap_or_else(|| Mesh::parse("gpu=1").unwrap());
    let buffers = (0..p.values.len())
        .map(|i| Buffer {
            value: ValueId(i as u32),
            offset: 64 * i as u64,
            bytes: 64,
            kind: BufferKind::ALL[i % BufferKind::ALL.len()],
        })
        .collect::<Vec<_>>();
    let arena = 64 * buffers.len() as u64;
    Plan::new(
        "tiny.hzp",
        "asynchzp",
        mesh,
        ShardGroups {
            params: Group::new(["gpu"]),
            grads: Group::new(["gpu"]),
            optim: Group::new(Vec::<String>::new()),
        },
        p,
        arena,
        buffers,
    )
}

fn f32_bits(t: &Tensor) -> Vec<u32> {
    match &t.data {
        Data::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
        _ => panic!("not f32"),
    }
}

#[test]
fn json_round_trips_exactly() {
    let plan = plan_of(program());
    let json = plan.to_json();
    assert_eq!(json, plan.to_json(), "to_json is deterministic");
    assert!(
        json.starts_with("{\n  \"version\": 3,\n  \"content_hash\": \""),
        "{json}"
    );
    assert_eq!(plan.content_hash, plan.compute_hash());
    assert_eq!(plan.content_hash.len(), 64);

    let back = Plan::from_json(&json, "plan.json").unwrap_or_else(|e| panic!("{e}"));
    // NaN != NaN, so compare the parts and the data bit for bit
    assert_eq!(back.to_json(), json);
    assert_eq!(back.content_hash, plan.content_hash);
    assert_eq!(back.buffers, plan.buffers);
    assert_eq!(back.mesh, plan.mesh);
    assert_eq!(back.groups, plan.groups);
    assert_eq!(back.arena_bytes, plan.arena_bytes);
    assert_eq!(
        (back.model.as_str(), back.strategy.as_str()),
        ("tiny.hzp", "asynchzp")
    );
    assert_eq!(back.program.nodes, plan.program.nodes);
    assert_eq!(back.program.values, plan.program.values);
    assert_eq!(back.program.consts, plan.program.consts);
    assert_eq!(back.program.states, plan.program.states);
    assert_eq!(back.program.outputs, plan.program.outputs);
    let (w0, w1) = (&plan.program.params[0], &back.program.params[0]);
    assert_eq!(
        f32_bits(w0.data.as_ref().unwrap()),
        f32_bits(w1.data.as_ref().unwrap())
    );
    assert!(
        back.program.params[1].data.is_none(),
        "shapes-only stays so"
    );
    assert_eq!(
        back.program.nodes[5].op,
        Op::Fill {
            value: f64::NEG_INFINITY,
            dtype: DType::F32,
            shape: vec![8, 4]
        }
    );
    assert_eq!(back.program.nodes[0].stream, StreamKind::AllGather);
}

#[test]
fn data_is_compact_and_shapes_only_params_cost_nothing() {
    let plan = plan_of(program());
    let json = plan.to_json();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let names: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    // `w` (a parameter with data), `mask` (33+ elements), `m` (a 32-element state); not `big`
    // (no data) and not `small` (inline in the program text)
    assert_eq!(names, ["w", "mask", "m"]);
    assert_eq!(v["data"][1]["dtype"], "f32");
    assert_eq!(v["data"][1]["shape"], serde_json::json!([8, 4]));
    assert_eq!(v["data"][1]["base64"].as_str().unwrap().len(), 172);
    // a 4 GiB parameter without data adds one line
    assert!(json.len() < 8000, "{}", json.len());
    let lines: Vec<&str> = v["program"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    assert!(
        lines.contains(&"param %big : f32[1048576,1024]"),
        "{lines:?}"
    );
    assert!(
        lines.contains(&"const %mask : f32[8,4] = @data"),
        "{lines:?}"
    );
}

#[test]
fn every_op_round_trips_through_a_plan() {
    let plan = plan_of(all_ops());
    let json = plan.to_json();
    let back = Plan::from_json(&json, "plan.json").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back.to_json(), json);
    // all_ops has no NaN in its data, so the programs compare equal
    assert_eq!(back, plan);
}

#[test]
fn another_version_is_refused_first() {
    let json = plan_of(program()).to_json();
    let v3 = json.replacen("\"version\": 3,", "\"version\": 4,", 1);
    assert_ne!(v3, json);
    let e = Plan::from_json(&v3, "plan.json").unwrap_err();
    assert_eq!(
        e.to_string(),
        "plan.json was written by plan format version 4; this hzp reads version 3"
    );
    assert!(matches!(e, PlanError::Version { found: 4, .. }));
    // the version is looked at before the layout: a future layout still gets this message
    let future = r#"{"version": 7, "whatever": [1, 2, 3]}"#;
    let e = Plan::from_json(future, "other.json").unwrap_err();
    assert_eq!(
        e.to_string(),
        "other.json was written by plan format version 7; this hzp reads version 3"
    );
}

#[test]
fn a_modified_plan_is_refused() {
    let plan = plan_of(program());
    let json = plan.to_json();
    let edits = [
        json.replacen(
            &format!("\"arena_bytes\": {}", plan.arena_bytes),
            "\"arena_bytes\": 1",
            1,
        ),
        json.replacen("\"offset\": 64,", "\"offset\": 128,", 1),
        json.replacen("\"strategy\": \"asynchzp\"", "\"strategy\": \"zero3\"", 1),
        json.replacen("Mul(%x, %ag_w)", "Add(%x, %ag_w)", 1),
    ];
    for edited in edits {
        assert_ne!(edited, json);
        let e = Plan::from_json(&edited, "plan.json").unwrap_err();
        assert_eq!(
            e.to_string(),
            "plan.json was modified after it was compiled: its content hash does not match"
        );
        match e {
            PlanError::Modified {
                recorded, computed, ..
            } => {
                assert_eq!(recorded, plan.content_hash);
                assert_ne!(computed, recorded);
            }
            other => panic!("{other:?}"),
        }
    }
    // reformatting is not a modification: the hash is over the canonical form
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let compact = serde_json::to_string(&v).unwrap();
    assert!(Plan::from_json(&compact, "plan.json").is_ok());
}

#[test]
fn the_hash_is_reproducible_from_the_json_alone() {
    let plan = plan_of(program());
    let mut v: serde_json::Value = serde_json::from_str(&plan.to_json()).unwrap();
    assert_eq!(content_hash_of(&v), plan.content_hash);
    // a deliberate edit, re-stamped, reads back with the edit
    v["model"] = "renamed".into();
    v["content_hash"] = content_hash_of(&v).into();
    let back = Plan::from_json(&v.to_string(), "plan.json").unwrap();
    assert_eq!(back.model, "renamed");
}

/// A re-stamped file is still user input: bad content is refused with a message, never a
/// panic.
#[test]
fn restamped_garbage_is_refused_without_panicking() {
    let base: serde_json::Value = serde_json::from_str(&plan_of(program()).to_json()).unwrap();
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "does not read back",
            Box::new(|v| v["program"][5] = "%q = Nope(%x)".into()),
        ),
        (
            "refers to value 999",
            Box::new(|v| v["buffers"][0]["value"] = 999.into()),
        ),
        (
            "must be 128 bytes",
            Box::new(|v| v["data"][1]["base64"] = "AAAA".into()),
        ),
        (
            "not valid base64",
            Box::new(|v| v["data"][1]["base64"] = "!!!!".into()),
        ),
        (
            "does not take from `data`",
            Box::new(|v| {
                let extra = v["data"][1].clone();
                let mut extra = extra;
                extra["name"] = "nobody".into();
                v["data"].as_array_mut().unwrap().push(extra);
            }),
        ),
        (
            "holds `mask` twice",
            Box::new(|v| {
                let extra = v["data"][1].clone();
                v["data"].as_array_mut().unwrap().push(extra);
            }),
        ),
        (
            "too large",
            Box::new(|v| v["data"][1]["shape"] = serde_json::json!([1u64 << 40, 1u64 << 40])),
        ),
        (
            "has size 0",
            Box::new(|v| v["mesh"]["axes"][0]["size"] = 0.into()),
        ),
        ("unknown field `extra`", Box::new(|v| v["extra"] = 1.into())),
        (
            "bool data must be bytes 0 or 1",
            Box::new(|v| {
                v["data"][1]["dtype"] = "bool".into();
                v["data"][1]["shape"] = serde_json::json!([3]);
                v["data"][1]["base64"] = "AAEC".into();
            }),
        ),
    ];
    for (want, edit) in cases {
        let mut v = base.clone();
        edit(&mut v);
        v["content_hash"] = content_hash_of(&v).into();
        let e = Plan::from_json(&v.to_string(), "plan.json").unwrap_err();
        assert!(e.to_string().contains(want), "want `{want}`, got: {e}");
        assert!(e.to_string().starts_with("plan.json"), "{e}");
    }
}

#[test]
fn not_a_plan() {
    let e = Plan::from_json("{\"model\": 1}", "p.json").unwrap_err();
    assert_eq!(
        e.to_string(),
        "p.json is not an hzp plan: it has no `version` field"
    );
    let e = Plan::from_json("{\"version\": \"one\"}", "p.json").unwrap_err();
    assert!(e.to_string().contains("not a format number"), "{e}");
    let e = Plan::from_json("{\n  \"version\": 2,\n  oops\n}", "p.json").unwrap_err();
    match &e {
        PlanError::Json { line, .. } => assert_eq!(*line, 3, "{e}"),
        other => panic!("{other:?}"),
    }
    assert!(
        e.to_string().starts_with("p.json is not valid plan JSON"),
        "{e}"
    );
    let json = plan_of(program()).to_json();
    let no_hash: serde_json::Value = {
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v.as_object_mut().unwrap().remove("content_hash");
        v
    };
    let e = Plan::from_json(&no_hash.to_string(), "p.json").unwrap_err();
    assert!(e.to_string().contains("no `content_hash`"), "{e}");
    // truncated files
    for cut in [1, json.len() / 3, json.len() - 3] {
        assert!(Plan::from_json(&json[..cut], "p.json").is_err());
    }
}

#[test]
fn text_form_has_header_program_and_buffers() {
    let plan = plan_of(program());
    let s = plan.to_text();
    assert_eq!(s, plan.to_text());
    for want in [
        "# hzp plan, format version 3\n",
        "# model:    tiny.hzp\n",
        "# strategy: asynchzp\n",
        "# mesh:     gpu=4 (4 ranks)\n",
        "# groups:   params P=[gpu] grads G=[gpu] optim O=[]\n",
        "# arena:    704 B (704 bytes) per rank, 11 buffers\n",
        &format!("# hash:     sha256:{}\n", plan.content_hash),
        "program \"tiny\"\nmesh gpu=4\n",
        "%ag_w = AllGather{group=[gpu], axis=0}(%w) : f32[8,4] \"ag_w\" @allgather role=gather(\"mb0.fwd.h \\\"0\\\"\")\n",
        "# buffers (offset, bytes, kind, value), arena order\n",
        "buffer      0     64 param       %x\n",
        "buffer     64     64 grad        %w\n",
    ] {
        assert!(s.contains(want), "missing {want:?} in\n{s}");
    }
    // the text of the program inside is exactly the text form
    assert!(s.contains(&text::print(&plan.program)));
}
