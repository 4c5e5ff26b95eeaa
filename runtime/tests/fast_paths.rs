//! The evaluator's fast paths (fused elementwise runs, strided MatMul operands, MatMuls
//! computed at their transpose) against a node-by-node run of the plain kernels.

use hzp_ir::{BinaryOp, DType, Op, Program, ReduceOp, Tensor, TensorType, UnaryOp, ValueId};
use hzp_runtime::cpu::eval_op;
use hzp_runtime::eval::evaluate_with_stats;
use std::collections::HashMap;

fn ty(shape: &[usize]) -> TensorType {
    TensorType::new(DType::F32, shape.to_vec())
}

/// Deterministic values in about [-1, 1].
fn data(shape: &[usize], seed: u32) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n)
        .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    Tensor::f32(shape.to_vec(), v)
}

/// Every node through `eval_op`, in order, nothing fused or viewed.
fn reference(p: &Program, inputs: &[(String, Tensor)]) -> Vec<Tensor> {
    let mut env: HashMap<ValueId, Tensor> = HashMap::new();
    for (name, t) in inputs {
        env.insert(p.find_value(name).unwrap(), t.clone());
    }
    for prm in &p.params {
        env.insert(prm.value, prm.data.clone().unwrap());
    }
    for c in &p.consts {
        env.insert(c.value, c.data.clone());
    }
    for n in &p.nodes {
        let args: Vec<&Tensor> = n.inputs.iter().map(|v| &env[v]).collect();
        let outs = eval_op(&n.op, &args).unwrap();
        for (&o, t) in n.outputs.iter().zip(outs) {
            env.insert(o, t);
        }
    }
    p.outputs.iter().map(|o| env[o].clone()).collect()
}

fn node(p: &mut Program, op: Op, ins: Vec<ValueId>) -> ValueId {
    let name = format!("v{}", p.values.len());
    p.add_node(name.clone(), op, ins, vec![name]).unwrap()[0]
}

fn bin(p: &mut Program, b: BinaryOp, x: ValueId, y: ValueId) -> ValueId {
    node(p, Op::Binary(b), vec![x, y])
}

fn un(p: &mut Program, u: UnaryOp, x: ValueId) -> ValueId {
    node(p, Op::Unary(u), vec![x])
}

fn close(got: &Tensor, want: &Tensor, tol: f32) {
    assert_eq!(got.shape, want.shape);
    let (g, w) = (got.to_f32_vec(), want.to_f32_vec());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= tol * (1.0 + b.abs()),
            "element {i}: {a} vs {b}"
        );
    }
}

/// A chain of elementwise ops over [rows, cols] with a scalar, a bias over the last axis
/// and a keep-dims row operand; intermediates are returned, read later, or only used
/// inside the chain.
fn chain(rows: usize, cols: usize) -> (Program, Vec<(String, Tensor)>) {
    let mut p = Program::new("chain");
    // x is computed (and dies in the chain), so a result may take over its buffer
    let xt = p.add_input("xt", ty(&[cols, rows]));
    let x = node(&mut p, Op::Transpose { perm: vec![1, 0] }, vec![xt]);
    let r = p.add_input("r", ty(&[rows, 1]));
    let b = p.add_param("b", ty(&[cols]), Some(data(&[cols], 7)));
    let s = p.add_const("s", Tensor::f32(vec![], vec![0.75]));
    let three = p.add_const("three", Tensor::f32(vec![], vec![3.0]));
    let t1 = bin(&mut p, BinaryOp::Mul, x, s);
    let t2 = bin(&mut p, BinaryOp::Add, t1, b);
    let t3 = un(&mut p, UnaryOp::Tanh, t2);
    let t4 = bin(&mut p, BinaryOp::Sub, t3, r);
    let t5 = bin(&mut p, BinaryOp::Pow, t4, three);
    let t6 = bin(&mut p, BinaryOp::Div, t5, t2);
    let t7 = un(&mut p, UnaryOp::Exp, t6);
    let t8 = bin(&mut p, BinaryOp::Max, t7, t4);
    // t2 is also read after the chain
    let red = node(
        &mut p,
        Op::Reduce {
            op: ReduceOp::Sum,
            axes: vec![1],
            keep_dims: true,
        },
        vec![t2],
    );
    p.outputs = vec![t8, t3, red];
    hzp_ir::verify(&p).unwrap();
    let inputs = vec![
        ("xt".to_string(), data(&[cols, rows], 1)),
        ("r".to_string(), data(&[rows, 1], 2)),
    ];
    (p, inputs)
}

#[test]
fn fused_elementwise_runs_compute_what_the_kernels_compute() {
    // one tile and a partial one; and enough elements for the parallel path
    for (rows, cols) in [(5, 1000), (64, 1024), (3, 3)] {
        let (p, inputs) = chain(rows, cols);
        let want = reference(&p, &inputs);
        let (got, stats) = evaluate_with_stats(&p, &inputs).unwrap();
        assert_eq!(got.len(), want.len());
        for ((_, g), w) in got.iter().zip(&want) {
            // the same arithmetic in the same order: equal, not just close
            assert_eq!(g, w, "{rows}x{cols}");
        }
        if rows * cols >= 4096 {
            // fused: only t2, t3 and t8 (and the row sums) are ever materialized
            let full = rows * cols * 4;
            assert!(stats.peak_live_bytes <= 3 * full + rows * 4, "{stats:?}");
        }
    }
}

#[test]
fn transposed_and_reshaped_matmul_operands_are_read_in_place() {
    let mut p = Program::new("views");
    let a = p.add_input("a", ty(&[4, 16, 8]));
    let w = p.add_param("w", ty(&[16, 5]), Some(data(&[16, 5], 3)));
    let c = p.add_param("c", ty(&[64, 3]), Some(data(&[64, 3], 4)));
    let q = p.add_input("q", ty(&[7, 9]));
    let pm = p.add_param("pm", ty(&[6, 7]), Some(data(&[6, 7], 5)));
    // a^T (batched) @ w: a view
    let at = node(
        &mut p,
        Op::Transpose {
            perm: vec![0, 2, 1],
        },
        vec![a],
    );
    let y1 = node(&mut p, Op::MatMul, vec![at, w]);
    // reshape then transpose then matmul: a view of a view
    let af = node(&mut p, Op::Reshape { shape: vec![64, 8] }, vec![a]);
    let aft = node(&mut p, Op::Transpose { perm: vec![1, 0] }, vec![af]);
    let y2 = node(&mut p, Op::MatMul, vec![aft, c]);
    // a MatMul read only by a transpose of its result
    let m = node(&mut p, Op::MatMul, vec![pm, q]);
    let y3 = node(&mut p, Op::Transpose { perm: vec![1, 0] }, vec![m]);
    // a transpose read by a MatMul and by an Add is computed
    let qt = node(&mut p, Op::Transpose { perm: vec![1, 0] }, vec![q]);
    let q2 = p.add_param("q2", ty(&[7, 2]), Some(data(&[7, 2], 6)));
    let y4 = node(&mut p, Op::MatMul, vec![qt, q2]);
    let qq = bin(&mut p, BinaryOp::Add, qt, qt);
    p.outputs = vec![y1, y2, y3, y4, qq];
    hzp_ir::verify(&p).unwrap();
    let inputs = vec![
        ("a".to_string(), data(&[4, 16, 8], 8)),
        ("q".to_string(), data(&[7, 9], 9)),
    ];
    let want = reference(&p, &inputs);
    let (got, stats) = evaluate_with_stats(&p, &inputs).unwrap();
    for ((_, g), w) in got.iter().zip(&want) {
        close(g, w, 1e-5);
    }
    // nothing of `a` was copied and `m` is never materialized: the live intermediates
    // are the results and qt
    let results: usize = want.iter().map(|t| t.size_bytes()).sum();
    assert!(
        stats.peak_live_bytes <= results + 9 * 7 * 4,
        "{} bytes live at the peak",
        stats.peak_live_bytes
    );
}
