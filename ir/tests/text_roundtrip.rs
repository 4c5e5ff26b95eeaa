//! The text form: printing and parsing back gives the same program.

mod text_common;

use hzp_ir::text;
use hzp_ir::*;
use std::collections::BTreeSet;
use text_common::*;

#[test]
fn every_op_round_trips() {
    let p = all_ops();
    let used: BTreeSet<&str> = p.nodes.iter().map(|n| n.op.name()).collect();
    let all: BTreeSet<&str> = Op::all_names().into_iter().collect();
    let missing: Vec<_> = all.difference(&used).collect();
    assert!(missing.is_empty(), "ops not covered: {missing:?}");
    let s = roundtrip(&p);
    // spot checks of the form
    assert!(
        s.starts_with("program \"all \\\"ops\\\"\"\nmesh node=2,gpu=4\n"),
        "{s}"
    );
    assert!(s.contains("input %\"onnx::ids\" : i64[2,4]\n"), "{s}");
    assert!(
        s.contains("param %\"ln \\\"scale\\\"\\\\\" : f32[8]\n"),
        "{s}"
    );
    assert!(
        s.contains("param %transformer.h.0.attn/w : f32[8,8]\n"),
        "{s}"
    );
    assert!(
        s.contains("const %nd : i64[3,2] = [0, 1, 1, 2, 1, 3]\n"),
        "{s}"
    );
    assert!(s.contains("const %upd2 : f32[3,8] = @data\n"), "{s}");
    assert!(s.contains("const %empty : i64[0] = []\n"), "{s}");
    assert!(s.contains("const %scalar : f32[] = [2.5]\n"), "{s}");
    assert!(s.contains("= [1.5, -0.0, inf, 0.0030975342]"), "{s}");
    assert!(s.contains("{axis=2, epsilon=1e-5}"), "{s}");
    assert!(s.contains("AllReduce{group=[], reduce=max}"), "{s}");
    assert!(
        s.contains("%allgather = AllGather{group=[gpu], axis=0}(%x) : f32[8,4,8] \"allgather\" @allgather\n"),
        "{s}"
    );
    assert!(s.contains("%split.0, %\"split:1\" = Split{axis=2, sizes=[3,5]}(%x) : f32[2,4,3], f32[2,4,5] \"split\"\n"), "{s}");
    assert!(s.contains("Free(%copy) \"free \\\"c\\\"\"\n"), "{s}");
    assert!(
        s.contains("RecordEvent{event=3}() \"rec\" @allgather\n"),
        "{s}"
    );
    assert!(
        s.contains("\noutput %allgather, %/h.0/attn/MatMul_output_0, %x, %allgather\n"),
        "{s}"
    );
    assert!(!s.contains("\norder "), "{s}");
    assert!(!s.contains("@compute"), "{s}");
}

#[test]
fn sidecar_holds_params_with_data_and_large_consts() {
    let p = all_ops();
    let names: Vec<&str> = text::sidecar_entries(&p)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        names,
        [
            "transformer.h.0.attn/w",
            "ln.bias",
            "upd2",
            "big_hf",
            "big_bools"
        ]
    );
}

#[test]
fn missing_param_data_gives_a_param_without_data() {
    let p = all_ops();
    let s = text::print(&p);
    let w = weights(&p);
    let q = text::parse(&s, "t.hzp", &|n| {
        if n == "ln.bias" {
            None
        } else {
            w.get(n).cloned()
        }
    })
    .unwrap();
    let bias = q.find_value("ln.bias").unwrap();
    assert!(q.param(bias).unwrap().data.is_none());
    let wv = q.find_value("transformer.h.0.attn/w").unwrap();
    assert!(q.param(wv).unwrap().data.is_some());
}

#[test]
fn odd_names_round_trip() {
    let mut p = Program::new("");
    let names = [
        "plain",
        "with space",
        "q\"uote",
        "back\\slash",
        "tab\there",
        "new\nline",
        "ctrl\u{1}\u{7f}",
        "ünïcödé",
        "日本",
        "#hash",
        "%pct",
        "-leading-dash",
        "0digit",
        "a,b",
        "a=b",
        "@at",
        "{}[]()",
        "true",
        "inf",
        "order",
    ];
    let mut prev = p.add_input(names[0], t(DType::F32, &[2]));
    for (i, n) in names.iter().enumerate().skip(1) {
        let node_name = format!("node {n} {i}");
        prev = one(&mut p, n, Op::Unary(UnaryOp::Neg), &[prev]);
        let last = p.nodes.len() - 1;
        p.nodes[last].name = node_name;
    }
    p.outputs = vec![prev];
    roundtrip(&p);
}

#[test]
fn mesh_with_odd_axis_names_round_trips() {
    let mut p = Program::new("m");
    p.mesh = Some(Mesh {
        axes: vec![
            MeshAxis {
                name: "node".into(),
                size: 3,
            },
            MeshAxis {
                name: "gpu.0".into(),
                size: 2,
            },
            MeshAxis {
                name: "weird axis".into(),
                size: 1,
            },
            MeshAxis {
                name: "true".into(),
                size: 2,
            },
        ],
    });
    let x = p.add_input("x", t(DType::F32, &[4, 2]));
    let y = one(
        &mut p,
        "ag",
        Op::AllGather {
            group: Group::new(["weird axis", "gpu.0", "true"]),
            axis: 1,
        },
        &[x],
    );
    p.outputs = vec![y];
    let s = roundtrip(&p);
    assert!(
        s.contains("mesh node=3,gpu.0=2,\"weird axis\"=1,\"true\"=2\n"),
        "{s}"
    );
    assert!(s.contains("group=[\"weird axis\",gpu.0,\"true\"]"), "{s}");
}

#[test]
fn empty_program_and_empty_mesh_round_trip() {
    roundtrip(&Program::new("empty"));
    let mut p = Program::new("m");
    p.mesh = Some(Mesh { axes: vec![] });
    roundtrip(&p);
}

#[test]
fn float_attributes_round_trip_exactly() {
    let values = [
        0.1,
        -0.0,
        1e300,
        -1e-300,
        f64::MIN_POSITIVE,
        5e-324,
        f64::MAX,
        f64::INFINITY,
        f64::NEG_INFINITY,
        1.0 / 3.0,
        123456789.0,
        1e16,
    ];
    let epsilons = [1e-5f32, 1e-12, 0.1, f32::MIN_POSITIVE, 1e-45, 3.0, f32::MAX];
    let mut p = Program::new("floats");
    let x = p.add_input("x", t(DType::F32, &[2, 4]));
    let s = p.add_input("s", t(DType::F32, &[4]));
    for (i, v) in values.iter().enumerate() {
        one(
            &mut p,
            &format!("fill{i}"),
            Op::Fill {
                value: *v,
                dtype: DType::F32,
                shape: vec![1],
            },
            &[],
        );
    }
    for (i, e) in epsilons.iter().enumerate() {
        one(
            &mut p,
            &format!("ln{i}"),
            Op::LayerNorm {
                axis: 1,
                epsilon: *e,
            },
            &[x, s],
        );
    }
    let text = roundtrip(&p);
    assert!(text.contains("value=0.1,"), "{text}");
    assert!(text.contains("value=-inf,"), "{text}");
    assert!(text.contains("epsilon=1e-12}"), "{text}");
    assert!(text.contains("epsilon=0.1}"), "{text}");
}

#[test]
fn nan_prints_and_parses() {
    let mut p = Program::new("nan");
    p.add_const("c", Tensor::f32(vec![2], vec![f32::NAN, 1.0]));
    one(
        &mut p,
        "fill",
        Op::Fill {
            value: f64::NAN,
            dtype: DType::F32,
            shape: vec![],
        },
        &[],
    );
    let s = text::print(&p);
    assert!(s.contains("= [nan, 1.0]"), "{s}");
    assert!(s.contains("value=nan,"), "{s}");
    let q = text::parse(&s, "nan.hzp", &|_| None).unwrap();
    match &q.consts[0].data.data {
        Data::F32(v) => assert!(v[0].is_nan() && v[1] == 1.0),
        other => panic!("{other:?}"),
    }
    match &q.nodes[0].op {
        Op::Fill { value, .. } => assert!(value.is_nan()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn program_built_layer_by_layer_prints_params_where_they_are_made() {
    let mut p = Program::new("layers");
    let mut h = p.add_input("x", t(DType::F32, &[2, 4]));
    for l in 0..3 {
        let w = p.add_param(format!("l{l}.w"), t(DType::F32, &[4, 4]), None);
        h = one(&mut p, &format!("l{l}.mm"), Op::MatMul, &[h, w]);
        let c = p.add_const(format!("l{l}.c"), Tensor::scalar_f32(l as f32));
        h = one(
            &mut p,
            &format!("l{l}.add"),
            Op::Binary(BinaryOp::Add),
            &[h, c],
        );
    }
    p.outputs = vec![h];
    let s = roundtrip(&p);
    assert!(!s.contains("\norder "), "{s}");
    let lines: Vec<&str> = s.lines().collect();
    let pos = |prefix: &str| lines.iter().position(|l| l.starts_with(prefix)).unwrap();
    assert!(pos("param %l1.w") > pos("%l0.add"), "{s}");
    assert!(pos("param %l1.w") < pos("%l1.mm"), "{s}");
}

#[test]
fn out_of_order_value_ids_round_trip_with_an_order_line() {
    // Nodes whose outputs are numbered against node order (as after inserting a node).
    let mut p = Program::new("reordered");
    let x = p.add_input("x", t(DType::F32, &[3]));
    let a = one(&mut p, "a", Op::Unary(UnaryOp::Relu), &[x]);
    let b = one(&mut p, "b", Op::Unary(UnaryOp::Neg), &[x]);
    p.nodes.swap(0, 1);
    p.values[a.index()].def = ValueDef::Node {
        node: NodeId(1),
        slot: 0,
    };
    p.values[b.index()].def = ValueDef::Node {
        node: NodeId(0),
        slot: 0,
    };
    p.outputs = vec![a, b];
    let s = roundtrip(&p);
    assert!(s.ends_with("order %x, %a, %b\n"), "{s}");

    // Input list not in arena order.
    let mut p = Program::new("inputs");
    let x = p.add_input("x", t(DType::F32, &[3]));
    let y = p.add_input("y", t(DType::F32, &[3]));
    let z = one(&mut p, "z", Op::Binary(BinaryOp::Sub), &[x, y]);
    p.inputs.reverse();
    p.outputs = vec![z];
    let s = roundtrip(&p);
    assert!(s.contains("input %y : f32[3]\ninput %x : f32[3]\n"), "{s}");
    assert!(s.contains("\norder %x, %y, %z\n"), "{s}");

    // A parameter added after the node that reads it (a pass put the node first).
    let mut p = Program::new("late_param");
    let x = p.add_input("x", t(DType::F32, &[2, 2]));
    let y = one(&mut p, "y", Op::Unary(UnaryOp::Exp), &[x]);
    let w = p.add_param("w", t(DType::F32, &[2, 2]), None);
    let z = one(&mut p, "z", Op::MatMul, &[y, w]);
    // move z to the front and make it read x
    let mut moved = p.nodes.pop().unwrap();
    moved.inputs = vec![x, w];
    p.nodes.insert(0, moved);
    p.values[y.index()].def = ValueDef::Node {
        node: NodeId(1),
        slot: 0,
    };
    p.values[z.index()].def = ValueDef::Node {
        node: NodeId(0),
        slot: 0,
    };
    p.outputs = vec![z, y];
    let s = roundtrip(&p);
    assert!(s.contains("order %x, %y, %w, %z"), "{s}");
}

#[test]
fn hand_written_text_may_leave_out_types_and_names() {
    let src = "\
# a hand-written program
input %x : f32[2,3]   # comment after a statement
param %w : f32[3,4]

%y = MatMul(%x, %w)
%z = Relu(%y) \"relu node\"
Free(%y)
output %z
";
    let p = text::parse(src, "models/hand.hzp", &|_| None).unwrap();
    assert_eq!(p.name, "hand");
    assert_eq!(p.ty(p.outputs[0]), &t(DType::F32, &[2, 4]));
    assert_eq!(p.nodes[0].name, "y");
    assert_eq!(p.nodes[1].name, "relu node");
    assert_eq!(p.nodes[2].name, "Free");
    roundtrip(&p);
}

#[test]
fn crlf_line_endings_parse() {
    let src = "program \"w\"\r\ninput %x : f32[2]\r\n%y = Neg(%x) : f32[2] \"n\"\r\noutput %y\r\n";
    let p = text::parse(src, "w.hzp", &|_| None).unwrap();
    assert_eq!(p.nodes.len(), 1);
}

#[test]
fn printing_and_parsing_3000_nodes_is_fast() {
    let mut p = Program::new("big");
    let mut h = p.add_input("x", t(DType::F32, &[4, 64]));
    for i in 0..1000 {
        let w = p.add_param(format!("layer.{i}.w"), t(DType::F32, &[64, 64]), None);
        h = one(&mut p, &format!("layer.{i}.mm"), Op::MatMul, &[h, w]);
        h = one(
            &mut p,
            &format!("layer.{i}.act"),
            Op::Unary(UnaryOp::Gelu),
            &[h],
        );
        h = one(
            &mut p,
            &format!("layer.{i}.ln"),
            Op::Softmax { axis: 1 },
            &[h],
        );
    }
    p.outputs = vec![h];
    let start = std::time::Instant::now();
    let s = text::print(&p);
    let q = text::parse(&s, "big.hzp", &|_| None).unwrap();
    let took = start.elapsed();
    assert_eq!(q, p);
    assert!(took.as_secs_f64() < 2.0, "print + parse took {took:?}");
}

#[test]
fn the_module_doc_example_is_what_the_printer_writes() {
    let doc = include_str!("../src/text/mod.rs");
    let start = doc.find("//! ```text\n").unwrap() + "//! ```text\n".len();
    let end = start + doc[start..].find("//! ```\n").unwrap();
    let example: String = doc[start..end]
        .lines()
        .map(|l| {
            l.strip_prefix("//! ")
                .unwrap_or(l.trim_start_matches("//!"))
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let mask = Tensor::new(vec![1, 1, 16, 16], Data::Bool(vec![true; 256]));
    let p = text::parse(&example, "doc.hzp", &|n| {
        (n == "mask").then(|| mask.clone())
    })
    .unwrap();
    assert_eq!(text::print(&p), example);
    assert_eq!(p.nodes.len(), 5);
    assert_eq!(p.nodes[2].stream, StreamKind::AllGather);
}

#[test]
fn printing_an_invalid_program_does_not_panic() {
    let mut p = all_ops();
    p.nodes[3].inputs.push(ValueId(100_000));
    p.nodes[4].outputs.push(ValueId(100_001));
    p.inputs.push(ValueId(100_002));
    p.params.push(Param {
        value: ValueId(100_003),
        data: None,
    });
    p.outputs.push(ValueId(100_004));
    let s = text::print(&p);
    assert!(s.contains("%\"<missing v100000>\""), "{s}");
    assert!(text::parse(&s, "bad.hzp", &|_| None).is_err());
}

#[test]
fn training_programs_round_trip_states_updates_and_precision() {
    use hzp_ir::{BinaryOp, Precision, Update};
    let mut p = Program::new("step");
    let w = p.add_param(
        "w",
        TensorType::new(DType::F32, vec![3]),
        Some(Tensor::f32(vec![3], vec![1.0, 2.0, 3.0])),
    );
    let m = p.add_state("adamw.m/w", TensorType::new(DType::F32, vec![3]), None);
    let big = p.add_state(
        "init.big",
        TensorType::new(DType::F32, vec![20]),
        Some(Tensor::f32(vec![20], (0..20).map(|i| i as f32).collect())),
    );
    let small = p.add_state(
        "step",
        TensorType::new(DType::F32, vec![]),
        Some(Tensor::scalar_f32(4.0)),
    );
    let m2 = p
        .add_node(
            "m2",
            Op::Binary(BinaryOp::Add),
            vec![m, w],
            vec!["m2".into()],
        )
        .unwrap()[0];
    let w2 = p
        .add_node(
            "w2",
            Op::Binary(BinaryOp::Sub),
            vec![w, m2],
            vec!["w2".into()],
        )
        .unwrap()[0];
    p.outputs = vec![w2];
    p.updates = vec![
        Update {
            target: w,
            value: w2,
        },
        Update {
            target: m,
            value: m2,
        },
    ];
    p.precision = Some(Precision {
        compute: DType::BF16,
        master: DType::F32,
        reduce: DType::F32,
    });
    let _ = (big, small);
    hzp_ir::verify(&p).unwrap();
    let text = hzp_ir::text::print(&p);
    assert!(text.contains("state %adamw.m/w : f32[3]\n"), "{text}");
    assert!(text.contains("update %w = %w2"), "{text}");
    assert!(
        text.contains("precision compute=bf16, master=f32, reduce=f32"),
        "{text}"
    );
    let lookup = |name: &str| {
        hzp_ir::text::sidecar_entries(&p)
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(_, t)| t.clone())
    };
    let back = hzp_ir::text::parse(&text, "step.hzp", &lookup).unwrap();
    assert_eq!(back, p);
}

#[test]
fn specialized_inputs_print_their_values_and_are_checked() {
    let src = "program \"s\"\n\ninput %x : f32[6]\ninput %k : i64[2] = [3, 2]\n\
               %y = Reshape{shape=[3,2]}(%x) : f32[3,2] \"r\"\n\noutput %y\n";
    let p = text::parse(src, "s.hzp", &|_| None).unwrap();
    assert_eq!(p.specialized["k"], Tensor::i64(vec![2], vec![3, 2]));
    assert_eq!(text::print(&p), src);
    verify(&p).unwrap();
    assert!(p
        .check_specialized([("k", &Tensor::i64(vec![2], vec![3, 2]))])
        .is_ok());
    let e = p
        .check_specialized([("k", &Tensor::i64(vec![2], vec![2, 3]))])
        .unwrap_err();
    assert!(
        e.contains("input `k` is [2, 3]") && e.contains("`k` = [3, 2]"),
        "{e}"
    );
    // a value of another type, or of something that is not an input, does not verify
    let mut bad = p.clone();
    bad.specialized
        .insert("k".into(), Tensor::i64(vec![1], vec![3]));
    assert!(verify(&bad).is_err());
    let mut bad = p.clone();
    bad.specialized
        .insert("y".into(), Tensor::f32(vec![3, 2], vec![0.0; 6]));
    assert!(verify(&bad).is_err());
}
