//! A snapshot of the printed form of a small program.

mod text_common;

use hzp_ir::*;
use text_common::*;

fn small() -> Program {
    let mut p = Program::new("tiny_mlp");
    p.mesh = Some(Mesh::parse("node=2,gpu=4").unwrap());
    let ids = p.add_input("input_ids", t(DType::I64, &[2, 4]));
    let wte = p.add_param("transformer.wte.weight", t(DType::F32, &[16, 8]), None);
    let pos = p.add_const(
        "onnx::Mul_7",
        Tensor::f32(vec![8], vec![0.5, -1.0, 2.0, 1e-3, 0.1, 3.0, -0.0, 1e20]),
    );
    let mask = p.add_const(
        "mask",
        Tensor::new(
            vec![4, 8],
            Data::Bool((0..32).map(|i| i % 2 == 0).collect()),
        ),
    );
    let x = one(&mut p, "/wte/Gather", Op::Gather { axis: 0 }, &[wte, ids]);
    let y = one(&mut p, "scaled", Op::Binary(BinaryOp::Mul), &[x, pos]);
    let z = one(&mut p, "masked", Op::Where, &[mask, y, x]);
    let parts = node(
        &mut p,
        "split",
        Op::Split {
            axis: 2,
            sizes: vec![4, 4],
        },
        &[z],
        &["a", "b"],
    );
    let scale = p.add_param("ln.weight", t(DType::F32, &[4]), None);
    let ln = one(
        &mut p,
        "ln",
        Op::LayerNorm {
            axis: 2,
            epsilon: 1e-5,
        },
        &[parts[0], scale],
    );
    let g = one(
        &mut p,
        "gathered",
        Op::AllGather {
            group: Group::new(["gpu"]),
            axis: 0,
        },
        &[ln],
    );
    let n = p.nodes.len();
    p.nodes[n - 1].stream = StreamKind::AllGather;
    node(&mut p, "rec", Op::RecordEvent { event: 1 }, &[], &[]);
    let n = p.nodes.len();
    p.nodes[n - 1].stream = StreamKind::AllGather;
    node(&mut p, "wait", Op::WaitEvent { event: 1 }, &[], &[]);
    node(&mut p, "free x", Op::Free, &[x], &[]);
    p.outputs = vec![g, parts[1]];
    p
}

#[test]
fn small_program_snapshot() {
    let p = small();
    let s = roundtrip(&p);
    insta::assert_snapshot!(s);
}
