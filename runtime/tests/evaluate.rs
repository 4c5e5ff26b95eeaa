//! End-to-end evaluation of small hand-built programs.

use hzp_ir::{BinaryOp, DType, Op, Program, ReduceOp, Tensor, TensorType, UnaryOp};
use hzp_runtime::eval::{evaluate, evaluate_with_stats, EvalError};

fn ty(shape: &[usize]) -> TensorType {
    TensorType::new(DType::F32, shape.to_vec())
}

/// y = softmax(x @ w + b) along the last axis; also returns h = x @ w (used twice: by the
/// add and as an output) and s = sum(h) + sum(x) (x is read by two distant nodes).
fn mlp() -> Program {
    let mut p = Program::new("mlp");
    let x = p.add_input("x", ty(&[2, 3]));
    let w = p.add_param(
        "w",
        ty(&[3, 2]),
        Some(Tensor::f32(vec![3, 2], vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0])),
    );
    let b = p.add_const("b", Tensor::f32(vec![2], vec![0.5, -0.5]));
    let h = p
        .add_node("/mm", Op::MatMul, vec![x, w], vec!["h".into()])
        .unwrap()[0];
    let z = p
        .add_node(
            "/add",
            Op::Binary(BinaryOp::Add),
            vec![h, b],
            vec!["z".into()],
        )
        .unwrap()[0];
    let y = p
        .add_node(
            "/softmax",
            Op::Softmax { axis: 1 },
            vec![z],
            vec!["y".into()],
        )
        .unwrap()[0];
    let sum = |axes: Vec<usize>| Op::Reduce {
        op: ReduceOp::Sum,
        axes,
        keep_dims: false,
    };
    let sh = p
        .add_node("/sum_h", sum(vec![0, 1]), vec![h], vec!["sh".into()])
        .unwrap()[0];
    let sx = p
        .add_node("/sum_x", sum(vec![0, 1]), vec![x], vec!["sx".into()])
        .unwrap()[0];
    let s = p
        .add_node(
            "/s",
            Op::Binary(BinaryOp::Add),
            vec![sh, sx],
            vec!["s".into()],
        )
        .unwrap()[0];
    p.outputs = vec![y, h, s];
    hzp_ir::verify(&p).unwrap();
    p
}

#[test]
fn evaluates_a_program_with_multi_use_values() {
    let p = mlp();
    let x = Tensor::f32(vec![2, 3], vec![1.0, 2.0, 3.0, -1.0, 0.0, 1.0]);
    let out = evaluate(&p, &[("x".into(), x)]).unwrap();
    let names: Vec<&str> = out.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["y", "h", "s"]);
    // h = x @ w = [[1+3, 2+3], [-1+1, 0+1]] = [[4,5],[0,1]]
    assert_eq!(out[1].1, Tensor::f32(vec![2, 2], vec![4.0, 5.0, 0.0, 1.0]));
    // z = [[4.5, 4.5], [0.5, 0.5]] -> softmax rows are uniform
    assert_eq!(out[0].1, Tensor::f32(vec![2, 2], vec![0.5; 4]));
    // s = sum(h) + sum(x) = 10 + 6
    assert_eq!(out[2].1, Tensor::scalar_f32(16.0));
}

#[test]
fn intermediates_are_freed_after_their_last_use() {
    // a chain of 10 Neg nodes over 1000 floats: at most two results alive at once
    let mut p = Program::new("chain");
    let mut v = p.add_input("x", ty(&[1000]));
    let keep = v;
    for k in 0..10 {
        v = p
            .add_node(
                format!("/neg{k}"),
                Op::Unary(UnaryOp::Neg),
                vec![v],
                vec![format!("t{k}")],
            )
            .unwrap()[0];
    }
    let y = p
        .add_node(
            "/add",
            Op::Binary(BinaryOp::Add),
            vec![v, keep],
            vec!["y".into()],
        )
        .unwrap()[0];
    p.outputs = vec![y];
    let x: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let (out, stats) =
        evaluate_with_stats(&p, &[("x".into(), Tensor::f32(vec![1000], x.clone()))]).unwrap();
    // ten negations cancel out: y = 2x
    assert_eq!(
        out[0].1.to_f32_vec(),
        x.iter().map(|v| 2.0 * v).collect::<Vec<_>>()
    );
    assert!(
        stats.peak_live_bytes <= 2 * 4000,
        "peak {}",
        stats.peak_live_bytes
    );
    assert!(stats.peak_live_bytes >= 4000);
}

#[test]
fn errors_name_the_problem() {
    let p = mlp();
    let e = evaluate(&p, &[]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "inputs do not match the program: missing `x`"
    );
    let x = Tensor::f32(vec![2, 3], vec![0.0; 6]);
    let e = evaluate(&p, &[("x".into(), x.clone()), ("x".into(), x.clone())]).unwrap_err();
    assert!(e.to_string().contains("given twice `x`"), "{e}");
    let e = evaluate(&p, &[("x".into(), Tensor::i64(vec![2, 3], vec![0; 6]))]).unwrap_err();
    assert_eq!(e.to_string(), "input `x` is i64[2,3], expected f32[2,3]");
    // a shapes-only program
    let mut q = p.clone();
    q.params[0].data = None;
    let e = evaluate(&q, &[("x".into(), x.clone())]).unwrap_err();
    assert_eq!(e, EvalError::ParamWithoutData { name: "w".into() });
    assert!(e.to_string().contains("parameter `w` has no data"));
    // a parameter whose data disagrees with its type
    let mut q = p.clone();
    q.params[0].data = Some(Tensor::f32(vec![2, 3], vec![0.0; 6]));
    let e = evaluate(&q, &[("x".into(), x)]).unwrap_err();
    assert!(
        e.to_string()
            .contains("parameter `w` holds f32[2,3] data but is declared f32[3,2]"),
        "{e}"
    );
}

#[test]
fn gather_error_names_node_index_and_dim() {
    let mut p = Program::new("emb");
    let ids = p.add_input("ids", TensorType::new(DType::I64, vec![2]));
    let table = p.add_param(
        "wte",
        ty(&[4, 2]),
        Some(Tensor::f32(vec![4, 2], vec![0.0; 8])),
    );
    let e = p
        .add_node(
            "/wte/Gather",
            Op::Gather { axis: 0 },
            vec![table, ids],
            vec!["e".into()],
        )
        .unwrap();
    p.outputs = e;
    // Token ids into a parameter table are checked where they enter (index_check): the
    // message names the input, the position, the table and the node.
    let err = evaluate(&p, &[("ids".into(), Tensor::i64(vec![2], vec![1, 9]))]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "input `ids` holds 9 at position [1] (of shape [2]), outside 0..4: it indexes axis 0 of `wte` (node `/wte/Gather`), which has 4 entries"
    );
    // A table that is itself an input keeps ONNX's Gather (checked by the kernel).
    let mut q = Program::new("gather");
    let ids = q.add_input("ids", TensorType::new(DType::I64, vec![2]));
    let table = q.add_input("table", ty(&[4, 2]));
    q.outputs = q
        .add_node(
            "/wte/Gather",
            Op::Gather { axis: 0 },
            vec![table, ids],
            vec!["e".into()],
        )
        .unwrap();
    let err = evaluate(
        &q,
        &[
            ("ids".into(), Tensor::i64(vec![2], vec![1, 9])),
            ("table".into(), Tensor::f32(vec![4, 2], vec![0.0; 8])),
        ],
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "node \"/wte/Gather\" (Gather): Gather: index 9 is out of range for dim 0 of size 4"
    );
}

#[test]
fn reshapes_reuse_dying_buffers_only() {
    // t = -x; r1 = reshape(t) while t is still read later; r2 = reshape(u) where u dies
    let mut p = Program::new("reshape");
    let x = p.add_input("x", ty(&[2, 3]));
    let t = p
        .add_node("/neg", Op::Unary(UnaryOp::Neg), vec![x], vec!["t".into()])
        .unwrap()[0];
    let r1 = p
        .add_node(
            "/r1",
            Op::Reshape { shape: vec![3, 2] },
            vec![t],
            vec!["r1".into()],
        )
        .unwrap()[0];
    let u = p
        .add_node(
            "/add",
            Op::Binary(BinaryOp::Add),
            vec![t, t],
            vec!["u".into()],
        )
        .unwrap()[0];
    let r2 = p
        .add_node(
            "/r2",
            Op::Reshape { shape: vec![6] },
            vec![u],
            vec!["r2".into()],
        )
        .unwrap()[0];
    let rx = p
        .add_node("/rx", Op::Identity, vec![x], vec!["rx".into()])
        .unwrap()[0];
    p.outputs = vec![r1, r2, rx, t];
    let xv = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    let input = Tensor::f32(vec![2, 3], xv.clone());
    let out = evaluate(&p, &[("x".into(), input.clone())]).unwrap();
    let neg: Vec<f32> = xv.iter().map(|v| -v).collect();
    assert_eq!(out[0].1, Tensor::f32(vec![3, 2], neg.clone()));
    assert_eq!(
        out[1].1,
        Tensor::f32(vec![6], neg.iter().map(|v| 2.0 * v).collect())
    );
    assert_eq!(out[2].1, input);
    assert_eq!(out[3].1, Tensor::f32(vec![2, 3], neg));
}
