//! Malformed and unsupported models give one clear error naming the file, never a panic.

mod onnx_util;
#[path = "../../tests/common/skip.rs"]
mod skip;

use hzp_frontends::onnx::proto::{StringStringEntryProto, TensorProto};
use hzp_frontends::onnx::{import_bytes, import_file, ImportError, ImportErrorKind, ImportOptions};
use hzp_ir::Tensor;
use onnx_util::*;

fn fail(m: &M, shapes: &[(&str, &[usize])]) -> ImportError {
    let e = m.import(shapes).expect_err("import should fail");
    let s = e.to_string();
    assert!(s.starts_with("cannot import test.onnx: "), "{s}");
    assert!(!s.contains('\n'), "one paragraph: {s}");
    e
}

/// y = x + w
fn add_model() -> M {
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(2), D::V(3)]));
    m.inits
        .push(init("w", &Tensor::f32(vec![3], vec![1.0, 2.0, 3.0])));
    m.nodes
        .push(node("Add", "add", &["x", "w"], &["y"], vec![]));
    m.outputs.push(out("y"));
    m
}

#[test]
fn the_add_model_itself_imports() {
    let p = add_model().import(&[]).unwrap();
    assert_eq!(p.params.len(), 1);
    assert_eq!(p.nodes.len(), 1);
}

#[test]
fn empty_file() {
    let e = import_bytes(&[], None, "empty.onnx", &ImportOptions::default()).unwrap_err();
    assert_eq!(e.kind, ImportErrorKind::Decode);
    assert!(
        e.to_string().contains("empty.onnx") && e.message.contains("empty"),
        "{e}"
    );
}

#[test]
fn random_bytes_never_panic() {
    let mut x: u64 = 0x9e3779b97f4a7c15;
    for len in [1usize, 2, 3, 10, 100, 1000, 10_000] {
        for _ in 0..20 {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let e =
                import_bytes(&bytes, None, "noise.onnx", &ImportOptions::default()).unwrap_err();
            assert!(
                e.to_string().starts_with("cannot import noise.onnx: "),
                "{e}"
            );
        }
    }
    // Valid protobuf that is not a model.
    let e = import_bytes(b"\x0a\x03abc", None, "text.onnx", &ImportOptions::default()).unwrap_err();
    assert_eq!(e.kind, ImportErrorKind::Decode, "{e}");
}

#[test]
fn truncated_model() {
    let b = add_model().bytes();
    for cut in 1..b.len() {
        // Never panics; most cuts are decode errors (some cuts end on a field boundary and
        // leave a smaller valid message, which then fails a later check).
        let r = import_bytes(&b[..cut], None, "cut.onnx", &ImportOptions::default());
        assert!(r.is_err(), "cut at {cut} imported");
    }
    let e = import_bytes(
        &b[..b.len() / 2],
        None,
        "cut.onnx",
        &ImportOptions::default(),
    )
    .unwrap_err();
    assert_eq!(e.kind, ImportErrorKind::Decode, "{e}");
}

#[test]
fn missing_file() {
    let e = import_file(
        std::path::Path::new("/nonexistent/m.onnx"),
        &ImportOptions::default(),
    )
    .unwrap_err();
    assert_eq!(e.kind, ImportErrorKind::Io);
    assert!(e.to_string().contains("/nonexistent/m.onnx"), "{e}");
}

#[test]
fn node_reads_a_missing_initializer() {
    let mut m = add_model();
    m.inits.clear();
    let e = fail(&m, &[]);
    assert_eq!(e.kind, ImportErrorKind::Graph);
    assert!(
        e.message
            .contains("Add `add` reads `w`, which no node, input or initializer defines"),
        "{e}"
    );
}

#[test]
fn cycles_name_their_nodes() {
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(2)]));
    m.nodes
        .push(node("Add", "a", &["x", "c"], &["a_out"], vec![]));
    m.nodes
        .push(node("Relu", "b", &["a_out"], &["b_out"], vec![]));
    m.nodes.push(node("Neg", "c", &["b_out"], &["c"], vec![]));
    m.nodes.push(node("Relu", "d", &["x"], &["y"], vec![]));
    m.outputs.push(out("y"));
    let e = fail(&m, &[]);
    assert_eq!(e.kind, ImportErrorKind::Graph);
    assert!(e.message.contains("cycle"), "{e}");
    for n in ["Add `a`", "Relu `b`", "Neg `c`"] {
        assert!(e.message.contains(n), "{e}");
    }
    assert!(!e.message.contains("`d`"), "{e}");
    // A node reading its own output.
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(2)]));
    m.nodes
        .push(node("Add", "self", &["x", "s"], &["s"], vec![]));
    m.outputs.push(out("s"));
    let e = fail(&m, &[]);
    assert!(
        e.message.contains("cycle") && e.message.contains("Add `self`"),
        "{e}"
    );
}

#[test]
fn unknown_opsets() {
    for v in [7, 12, 26, 30] {
        let mut m = add_model();
        m.opset = v;
        let e = fail(&m, &[]);
        assert_eq!(e.kind, ImportErrorKind::Opset);
        assert!(
            e.message
                .contains(&format!("unsupported opset {v} (hzp reads opsets 13-25")),
            "{e}"
        );
    }
    for v in [13, 21, 25] {
        let mut m = add_model();
        m.opset = v;
        m.import(&[]).unwrap();
    }
    // No default-domain opset at all.
    let mut p = add_model().proto();
    p.opset_import[0].domain = "com.example".into();
    let e = import_bytes(
        &prost::Message::encode_to_vec(&p),
        None,
        "t.onnx",
        &ImportOptions::default(),
    )
    .unwrap_err();
    assert_eq!(e.kind, ImportErrorKind::Opset);
    assert!(e.message.contains("com.example"), "{e}");
}

#[test]
fn unsupported_ops_are_listed_together() {
    let mut m = M::new();
    m.inputs
        .push(vi("x", FLOAT, &[D::V(1), D::V(1), D::V(4), D::V(4)]));
    m.nodes
        .push(node("MaxPool", "/c1/MaxPool", &["x"], &["c1"], vec![]));
    m.nodes.push(node("Relu", "r", &["c1"], &["r"], vec![]));
    m.nodes
        .push(node("MaxPool", "/c2/MaxPool", &["r"], &["c2"], vec![]));
    m.nodes
        .push(node("Loop", "/l/Loop", &["c2"], &["l"], vec![]));
    m.nodes
        .push(node("Resize", "dead", &["x"], &["unused"], vec![]));
    m.outputs.push(out("l"));
    let e = fail(&m, &[]);
    assert_eq!(e.kind, ImportErrorKind::Unsupported);
    assert!(
        e.message.contains(
            "uses 2 op types hzp does not support: Loop (nodes: /l/Loop), MaxPool (nodes: /c1/MaxPool, /c2/MaxPool)"
        ),
        "{e}"
    );
    // Other domains are named with their domain.
    let mut m = add_model();
    m.nodes[0].domain = "com.example".into();
    let e = fail(&m, &[]);
    assert!(e.message.contains("com.example.Add (nodes: add)"), "{e}");
}

fn external(location: &str) -> M {
    let mut m = add_model();
    m.inits[0] = TensorProto {
        dims: vec![3],
        data_type: FLOAT,
        name: "w".into(),
        data_location: 1,
        external_data: vec![
            StringStringEntryProto {
                key: "location".into(),
                value: location.into(),
            },
            StringStringEntryProto {
                key: "offset".into(),
                value: "4".into(),
            },
            StringStringEntryProto {
                key: "length".into(),
                value: "12".into(),
            },
        ],
        ..Default::default()
    };
    m
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("hzp-onnx-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn external_data_paths_stay_in_the_model_folder() {
    let dir = temp_dir("ext-bad");
    for (loc, why) in [
        ("/etc/passwd", "absolute path"),
        ("../secret.bin", "`..`"),
        ("sub/../../secret.bin", "`..`"),
        ("sub\\..\\..\\secret.bin", "`..`"),
    ] {
        let e = import_bytes(
            &external(loc).bytes(),
            Some(&dir),
            "ext.onnx",
            &ImportOptions::default(),
        )
        .unwrap_err();
        assert_eq!(e.kind, ImportErrorKind::TensorData, "{e}");
        assert!(
            e.message.contains("initializer `w`") && e.message.contains(loc),
            "{e}"
        );
        assert!(e.message.contains(why), "{loc}: {e}");
    }
    // Missing file, and a file too short for offset + length.
    let e = import_bytes(
        &external("w.bin").bytes(),
        Some(&dir),
        "ext.onnx",
        &ImportOptions::default(),
    )
    .unwrap_err();
    assert!(
        e.message.contains("w.bin") && e.message.contains("cannot be read"),
        "{e}"
    );
    std::fs::write(dir.join("w.bin"), [0u8; 10]).unwrap();
    let e = import_bytes(
        &external("w.bin").bytes(),
        Some(&dir),
        "ext.onnx",
        &ImportOptions::default(),
    )
    .unwrap_err();
    assert!(
        e.message.contains("bytes 4..16") && e.message.contains("only 10 bytes"),
        "{e}"
    );
    // No folder to read from.
    let e = import_bytes(
        &external("w.bin").bytes(),
        None,
        "ext.onnx",
        &ImportOptions::default(),
    )
    .unwrap_err();
    assert!(e.message.contains("without a folder"), "{e}");
    // A symlink that leads out of the folder.
    #[cfg(unix)]
    {
        let outside = temp_dir("ext-outside");
        std::fs::write(outside.join("secret.bin"), [0u8; 64]).unwrap();
        std::os::unix::fs::symlink(outside.join("secret.bin"), dir.join("link.bin")).unwrap();
        let e = import_bytes(
            &external("link.bin").bytes(),
            Some(&dir),
            "ext.onnx",
            &ImportOptions::default(),
        )
        .unwrap_err();
        assert!(e.message.contains("outside"), "{e}");
        let _ = std::fs::remove_dir_all(&outside);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn external_data_is_read_from_the_model_folder() {
    let dir = temp_dir("ext-ok");
    std::fs::create_dir_all(dir.join("weights")).unwrap();
    let mut bytes = vec![0xffu8; 4];
    for v in [0.5f32, -1.5, 2.25] {
        bytes.extend(v.to_le_bytes());
    }
    std::fs::write(dir.join("weights/w.bin"), &bytes).unwrap();
    std::fs::write(dir.join("m.onnx"), external("weights/w.bin").bytes()).unwrap();
    let p = import_file(&dir.join("m.onnx"), &ImportOptions::default()).unwrap();
    assert_eq!(p.name, "m");
    let w = p.params[0].data.as_ref().unwrap();
    assert_eq!(w.to_f32_vec(), vec![0.5, -1.5, 2.25]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn inconsistent_tensor_data() {
    let mut m = add_model();
    m.inits[0].raw_data.truncate(8);
    let e = fail(&m, &[]);
    assert_eq!(e.kind, ImportErrorKind::TensorData);
    assert!(
        e.message.contains("initializer `w`") && e.message.contains("8 bytes"),
        "{e}"
    );
    let mut m = add_model();
    m.inits[0].dims = vec![-3];
    let e = fail(&m, &[]);
    assert!(e.message.contains("negative"), "{e}");
    let mut m = add_model();
    m.inits[0].data_type = 8; // STRING
    let e = fail(&m, &[]);
    assert!(e.message.contains("STRING"), "{e}");
}

#[test]
fn duplicate_definitions() {
    let mut m = add_model();
    m.nodes.push(node("Neg", "again", &["x"], &["y"], vec![]));
    let e = fail(&m, &[]);
    assert_eq!(e.kind, ImportErrorKind::Graph);
    assert!(e.message.contains("`y` is defined twice"), "{e}");
}

#[test]
fn symbolic_inputs() {
    let mut m = add_model();
    m.inputs[0] = vi("x", FLOAT, &[D::P("batch"), D::V(3)]);
    m.inputs.push(vi("z", FLOAT, &[D::P("n"), D::P("m")]));
    m.nodes.push(node("Relu", "r", &["z"], &["zz"], vec![]));
    m.outputs.push(out("zz"));
    let e = fail(&m, &[]);
    assert_eq!(e.kind, ImportErrorKind::Shapes);
    assert!(e.message.contains("`x` [batch, 3], `z` [n, m]"), "{e}");
    assert!(e.message.contains("--shape x=2x3"), "{e}");
    // Typos are pointed out.
    let e = fail(&m, &[("X", &[2, 3]), ("z", &[1, 1])]);
    assert!(e.message.contains("`X`, which is not a graph input"), "{e}");
    // Fixed dims are checked.
    let e = fail(&m, &[("x", &[2, 4]), ("z", &[1, 1])]);
    assert!(
        e.message.contains("has 4 in dim 1") && e.message.contains("fixes that dim to 3"),
        "{e}"
    );
    let p = m.import(&[("x", &[5, 3]), ("z", &[1, 2])]).unwrap();
    assert_eq!(p.ty(p.outputs[0]).shape, vec![5, 3]);
    assert_eq!(p.ty(p.outputs[1]).shape, vec![1, 2]);
}

#[test]
fn runtime_shapes_are_rejected_with_the_source() {
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(2), D::V(3)]));
    m.inputs.push(vi("s", INT64, &[D::V(1)]));
    m.nodes.push(node(
        "Reshape",
        "/h.0/Reshape_3",
        &["x", "s"],
        &["y"],
        vec![],
    ));
    m.outputs.push(out("y"));
    let e = fail(&m, &[]);
    assert_eq!(e.kind, ImportErrorKind::Node);
    assert!(
        e.message.starts_with("Reshape `/h.0/Reshape_3`: the target shape (input `s`) is computed at run time from the graph input `s`; hzp needs static shapes")
            && e.message.contains("--bind s=1,2,3"),
        "{e}"
    );
}

/// A shape computed from a graph input whose value is given (an inputs file, `--bind`):
/// the program is specialized on it, records it, prints it, and refuses other values.
#[test]
fn runtime_shapes_from_given_inputs_specialize_the_program() {
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(2), D::V(3)]));
    m.inputs.push(vi("s", INT64, &[D::V(2)]));
    m.inputs.push(vi("k", INT64, &[D::V(1)]));
    // the target shape is computed from two inputs: s * k
    m.nodes
        .push(node("Mul", "scale", &["s", "k"], &["t"], vec![]));
    m.nodes
        .push(node("Reshape", "r", &["x", "t"], &["y"], vec![]));
    m.outputs.push(out("y"));
    let x = Tensor::f32(vec![2, 3], (0..6).map(|v| v as f32).collect());
    let s = Tensor::i64(vec![2], vec![3, 2]);
    let k = Tensor::i64(vec![1], vec![1]);

    // only `s` given: the error names `k`, the input still missing
    let mut o = opts(&[]);
    o.values.insert("s".into(), s.clone());
    let e = import_bytes(&m.bytes(), None, "test.onnx", &o).unwrap_err();
    assert!(
        e.message.contains("from the graph inputs `k`") || e.message.contains("graph input `k`"),
        "{e}"
    );
    assert!(e.message.contains("--bind k=1,2,3"), "{e}");

    // both given, one from an array and one with --bind
    o.bind.insert("k".into(), vec![1.0]);
    let p = import_bytes(&m.bytes(), None, "test.onnx", &o).unwrap();
    assert_eq!(p.ty(p.outputs[0]).shape, vec![3, 2]);
    assert_eq!(p.specialized.keys().collect::<Vec<_>>(), ["k", "s"]);
    assert_eq!(p.inputs.len(), 3, "specialized inputs stay inputs");
    let text = hzp_ir::text::print(&p);
    assert!(text.contains("input %s : i64[2] = [3, 2]"), "{text}");
    assert!(text.contains("input %k : i64[1] = [1]"), "{text}");
    let back = hzp_ir::text::parse(&text, "t.hzp", &|_| None).unwrap();
    assert_eq!(back, p);

    // the same values run; another value is an error naming the input
    let y = run(&p, &[("x", x.clone()), ("s", s.clone()), ("k", k.clone())]);
    assert_eq!(y[0].1.shape, vec![3, 2]);
    let ins = |s: Tensor| {
        vec![
            ("x".to_string(), x.clone()),
            ("s".to_string(), s),
            ("k".to_string(), k.clone()),
        ]
    };
    let e = hzp_kernels::eval::evaluate(&p, &ins(Tensor::i64(vec![2], vec![6, 1]))).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("input `s` is [6, 1]") && msg.contains("specialized on `s` = [3, 2]"),
        "{msg}"
    );

    // values of inputs that decide no shape change nothing
    let mut plain = M::new();
    plain.inputs.push(vi("x", FLOAT, &[D::V(2), D::V(3)]));
    plain
        .nodes
        .push(node("Relu", "relu", &["x"], &["y"], vec![]));
    plain.outputs.push(out("y"));
    let mut o = opts(&[]);
    o.values.insert("x".into(), x.clone());
    let a = import_bytes(&plain.bytes(), None, "test.onnx", &o).unwrap();
    let b = import_bytes(&plain.bytes(), None, "test.onnx", &opts(&[])).unwrap();
    assert!(a.specialized.is_empty());
    assert_eq!(hzp_ir::text::print(&a), hzp_ir::text::print(&b));
}

#[test]
fn outputs_hzp_does_not_compute_must_be_unused() {
    let m = |used: bool| {
        let mut m = M::new();
        m.inputs.push(vi("x", FLOAT, &[D::V(2), D::V(4)]));
        m.inits.push(init("g", &Tensor::f32(vec![4], vec![1.0; 4])));
        let mut n = node(
            "SimplifiedLayerNormalization",
            "rms",
            &["x", "g"],
            &["y", "inv"],
            vec![],
        );
        n.domain = "com.microsoft".into();
        m.nodes.push(n);
        m.outputs.push(out("y"));
        if used {
            m.outputs.push(out("inv"));
        }
        m
    };
    let p = m(false).import(&[]).unwrap();
    assert!(matches!(p.nodes[0].op, hzp_ir::Op::RmsNorm { axis: 1, .. }));
    let e = fail(&m(true), &[]);
    assert!(
        e.message
            .contains("com.microsoft.SimplifiedLayerNormalization `rms`: output 1 (`inv`) is used"),
        "{e}"
    );
}

#[test]
fn type_errors_name_the_node() {
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(2), D::V(3)]));
    m.inputs.push(vi("z", FLOAT, &[D::V(4), D::V(5)]));
    m.nodes
        .push(node("MatMul", "mm", &["x", "z"], &["y"], vec![]));
    m.outputs.push(out("y"));
    let e = fail(&m, &[]);
    assert_eq!(e.kind, ImportErrorKind::Node);
    assert!(e.message.starts_with("MatMul `mm`: "), "{e}");
    assert!(e.message.contains("inner dimensions"), "{e}");
}

#[test]
fn declared_output_types_are_checked() {
    let mut m = add_model();
    m.outputs[0] = vi("y", FLOAT, &[D::V(2), D::V(4)]);
    let e = fail(&m, &[]);
    assert!(
        e.message.contains("graph output `y`") && e.message.contains("dim 1 is 3, expected 4"),
        "{e}"
    );
}

#[test]
fn huge_sizes_are_errors_not_overflows() {
    let big = i64::MAX / 2;
    let cases: Vec<(&str, Vec<&str>, Vec<TensorProto>)> = vec![
        (
            "Expand",
            vec!["x", "s"],
            vec![init("s", &Tensor::i64(vec![3], vec![big, big, 3]))],
        ),
        (
            "Reshape",
            vec!["x", "s"],
            vec![init("s", &Tensor::i64(vec![3], vec![big, big, -1]))],
        ),
        (
            "Tile",
            vec!["x", "s"],
            vec![init("s", &Tensor::i64(vec![2], vec![big, big]))],
        ),
        (
            "ConstantOfShape",
            vec!["s"],
            vec![init("s", &Tensor::i64(vec![2], vec![big, big]))],
        ),
        (
            "Split",
            vec!["x", "s"],
            vec![init("s", &Tensor::i64(vec![2], vec![big, big]))],
        ),
    ];
    for (op, ins, inits) in cases {
        let mut m = M::new();
        m.inputs.push(vi("x", FLOAT, &[D::V(2), D::V(3)]));
        m.inits = inits;
        let outs: &[&str] = if op == "Split" { &["y", "y2"] } else { &["y"] };
        m.nodes.push(node(op, "n", &ins, outs, vec![]));
        m.outputs.push(out("y"));
        let e = fail(&m, &[]);
        assert!(e.message.starts_with(&format!("{op} `n`: ")), "{e}");
    }
    // Slice with extreme steps and bounds is fine.
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(2), D::V(3)]));
    m.inits
        .push(init("st", &Tensor::i64(vec![2], vec![i64::MIN, i64::MAX])));
    m.inits
        .push(init("en", &Tensor::i64(vec![2], vec![i64::MAX, i64::MIN])));
    m.inits.push(init("ax", &Tensor::i64(vec![2], vec![0, 1])));
    m.inits
        .push(init("sp", &Tensor::i64(vec![2], vec![i64::MAX, i64::MIN])));
    m.nodes.push(node(
        "Slice",
        "s",
        &["x", "st", "en", "ax", "sp"],
        &["y"],
        vec![],
    ));
    m.outputs.push(out("y"));
    let p = m.import(&[]).unwrap();
    assert_eq!(p.ty(p.outputs[0]).shape, vec![1, 1]);
    // Bindings with too many elements.
    let e = fail(&add_model_sym(), &[("x", &[usize::MAX / 2, 3])]);
    assert_eq!(e.kind, ImportErrorKind::Shapes, "{e}");
}

fn add_model_sym() -> M {
    let mut m = add_model();
    m.inputs[0] = vi("x", FLOAT, &[D::P("b"), D::V(3)]);
    m
}

/// Byte flips in a real model: any outcome but a panic is fine.
#[test]
fn mutated_models_never_panic() {
    let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/models"));
    let files = ["gpt2_tiny.dynamo.op18.onnx", "llama_tiny.legacy.op17.onnx"];
    let mut x: u64 = 0x2545f4914f6cdd1d;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let opts = onnx_util::opts(&[("input_ids", &[2, 4])]);
    for f in files {
        // committed test models: a missing one is a broken checkout, not a skip
        let orig = std::fs::read(dir.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        let (mut ok, mut failed) = (0, 0);
        let iters: usize = std::env::var("HZP_FUZZ_ITERS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(150);
        for _ in 0..iters {
            let mut b = orig.clone();
            for _ in 0..1 + next() % 4 {
                let i = (next() as usize) % b.len();
                b[i] = next() as u8;
            }
            let r = std::panic::catch_unwind(|| import_bytes(&b, None, f, &opts));
            match r {
                Ok(Ok(_)) => ok += 1,
                Ok(Err(_)) => failed += 1,
                Err(_) => panic!("{f}: a mutated copy made the importer panic"),
            }
        }
        println!("{f}: {ok} mutated copies imported, {failed} refused");
    }
}

#[test]
#[cfg(unix)]
fn external_data_in_a_fifo_is_an_error_not_a_hang() {
    let dir = temp_dir("ext-fifo");
    let fifo = dir.join("w.bin");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success());
    if !made {
        skip::skip("", skip::Missing::Other, "mkfifo is not available");
        return;
    }
    // Opening a FIFO for reading blocks until a writer comes: run the import on a thread and
    // give it a deadline, so a regression fails instead of hanging the suite.
    let (tx, rx) = std::sync::mpsc::channel();
    let d = dir.clone();
    std::thread::spawn(move || {
        let r = import_bytes(
            &external("w.bin").bytes(),
            Some(&d),
            "ext.onnx",
            &ImportOptions::default(),
        );
        let _ = tx.send(r.map(|_| ()).map_err(|e| e.to_string()));
    });
    let r = rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("the import hung on a FIFO");
    let e = r.unwrap_err();
    assert!(e.contains("w.bin") && e.contains("FIFO"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
