//! Helpers shared by the text-form tests.
#![allow(dead_code)]

use half::{bf16, f16};
use hzp_ir::text;
use hzp_ir::*;
use std::collections::HashMap;

pub fn t(d: DType, s: &[usize]) -> TensorType {
    TensorType::new(d, s.to_vec())
}

/// The weights lookup for `p`: what a sidecar file written from `p` would hold.
pub fn weights(p: &Program) -> HashMap<String, Tensor> {
    text::sidecar_entries(p)
        .into_iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect()
}

/// Prints, parses back, and checks exact equality and a stable text; returns the text.
pub fn roundtrip(p: &Program) -> String {
    verify(p).expect("test program must verify");
    let s = text::print(p);
    let w = weights(p);
    let q = match text::parse(&s, "t.hzp", &|n| w.get(n).cloned()) {
        Ok(q) => q,
        Err(e) => panic!("{e}\n--- text ---\n{s}"),
    };
    assert_eq!(&q, p, "round trip differs; text:\n{s}");
    assert_eq!(text::print(&q), s);
    s
}

pub fn node(p: &mut Program, name: &str, op: Op, ins: &[ValueId], outs: &[&str]) -> Vec<ValueId> {
    p.add_node(
        name,
        op,
        ins.to_vec(),
        outs.iter().map(|s| s.to_string()).collect(),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

pub fn one(p: &mut Program, name: &str, op: Op, ins: &[ValueId]) -> ValueId {
    node(p, name, op, ins, &[name])[0]
}

/// A program that uses every op in the op set at least once, with a mesh, every dtype,
/// names that need quotes, constants inline and in the weights file, and all streams.
pub fn all_ops() -> Program {
    let mut p = Program::new("all \"ops\"");
    p.mesh = Some(Mesh::parse("node=2,gpu=4").unwrap());
    let f = DType::F32;
    let x = p.add_input("x", t(f, &[2, 4, 8]));
    let ids = p.add_input("onnx::ids", t(DType::I64, &[2, 4]));
    let b = p.add_input("mask b", t(DType::Bool, &[2, 4, 8]));
    let idx = p.add_input("idx", t(DType::I64, &[2, 2, 8]));
    let upd = p.add_input("upd", t(f, &[2, 2, 8]));
    let _i32in = p.add_input("i32_in", t(DType::I32, &[3]));
    let _bf16in = p.add_input("bf16_in", t(DType::BF16, &[]));
    let _f16in = p.add_input("f16_in", t(DType::F16, &[0, 3]));
    let w_data: Vec<f32> = (0..64).map(|i| (i as f32) * 0.37 - 3.0).collect();
    let w = p.add_param(
        "transformer.h.0.attn/w",
        t(f, &[8, 8]),
        Some(Tensor::f32(vec![8, 8], w_data)),
    );
    let scale = p.add_param("ln \"scale\"\\", t(f, &[8]), None);
    let bias = p.add_param(
        "ln.bias",
        t(f, &[8]),
        Some(Tensor::f32(vec![8], vec![0.5; 8])),
    );
    let nd = p.add_const("nd", Tensor::i64(vec![3, 2], vec![0, 1, 1, 2, 1, 3]));
    let upd2 = p.add_const(
        "upd2",
        Tensor::f32(vec![3, 8], (0..24).map(|i| i as f32).collect()),
    );
    let onoff = p.add_const("onoff", Tensor::f32(vec![2], vec![0.0, 1.0]));
    p.add_const(
        "bf",
        Tensor::new(
            vec![4],
            Data::BF16(vec![
                bf16::from_f32(1.5),
                bf16::from_f32(-0.0),
                bf16::INFINITY,
                bf16::from_f32(3.1e-3),
            ]),
        ),
    );
    p.add_const(
        "hf",
        Tensor::new(
            vec![2, 2],
            Data::F16(vec![
                f16::from_f32(65504.0),
                f16::from_f32(-1e-7),
                f16::NEG_INFINITY,
                f16::from_f32(0.1),
            ]),
        ),
    );
    p.add_const(
        "big_hf",
        Tensor::new(
            vec![20],
            Data::F16((0..20).map(|i| f16::from_f32(i as f32)).collect()),
        ),
    );
    p.add_const(
        "i32s",
        Tensor::new(vec![3], Data::I32(vec![i32::MIN, 0, i32::MAX])),
    );
    p.add_const(
        "bools",
        Tensor::new(vec![2, 2], Data::Bool(vec![true, false, false, true])),
    );
    p.add_const(
        "big_bools",
        Tensor::new(vec![17], Data::Bool((0..17).map(|i| i % 3 == 0).collect())),
    );
    p.add_const("i64s", Tensor::i64(vec![2], vec![i64::MIN, i64::MAX]));
    p.add_const(
        "floats",
        Tensor::f32(
            vec![6],
            vec![
                f32::MIN_POSITIVE / 8.0,
                f32::MAX,
                0.1,
                -0.0,
                f32::INFINITY,
                1e-45,
            ],
        ),
    );
    p.add_const("scalar", Tensor::scalar_f32(2.5));
    p.add_const("empty", Tensor::i64(vec![0], vec![]));

    for u in UnaryOp::ALL {
        let input = if u == UnaryOp::Not { b } else { x };
        one(&mut p, &format!("u.{}", u.name()), Op::Unary(u), &[input]);
    }
    for bo in BinaryOp::ALL {
        let input = if bo.is_logical() { b } else { x };
        one(
            &mut p,
            &format!("b.{}", bo.name()),
            Op::Binary(bo),
            &[input, input],
        );
    }
    one(&mut p, "where", Op::Where, &[b, x, x]);
    one(&mut p, "gelu.grad", Op::GeluTanhGrad, &[x, x]);
    one(&mut p, "cast", Op::Cast { to: DType::BF16 }, &[x]);
    one(&mut p, "identity", Op::Identity, &[x]);
    let mm = one(&mut p, "/h.0/attn/MatMul_output_0", Op::MatMul, &[x, w]);
    one(&mut p, "softmax", Op::Softmax { axis: 2 }, &[mm]);
    one(&mut p, "logsoftmax", Op::LogSoftmax { axis: 1 }, &[mm]);
    // x [2,4,8] over its last axis against ids [2,4]
    let xent = one(
        &mut p,
        "xent",
        Op::SoftmaxCrossEntropy { axis: 2 },
        &[x, ids],
    );
    p.add_state("adamw m", t(f, &[2, 4, 8]), None);
    let (m, s0) = (
        p.find_value("adamw m").unwrap(),
        p.add_const("step", Tensor::scalar_f32(1e-3)),
    );
    p.add_node(
        "adamw",
        Op::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        vec![x, x, m, m, s0, s0, s0],
        vec!["adamw.w".into(), "adamw.m".into(), "adamw.v".into()],
    )
    .unwrap();
    one(
        &mut p,
        "xent.grad",
        Op::SoftmaxCrossEntropyGrad { axis: 2 },
        &[x, ids, xent],
    );
    one(
        &mut p,
        "ln",
        Op::LayerNorm {
            axis: 2,
            epsilon: 1e-5,
        },
        &[x, scale, bias],
    );
    one(
        &mut p,
        "rms",
        Op::RmsNorm {
            axis: 2,
            epsilon: 1e-6,
        },
        &[x, scale],
    );
    p.add_node(
        "ln.grad",
        Op::LayerNormGrad {
            axis: 2,
            epsilon: 1e-5,
        },
        vec![x, scale, x],
        vec!["ln.dx".into(), "ln.dyxhat".into()],
    )
    .unwrap();
    p.add_node(
        "rms.grad",
        Op::RmsNormGrad {
            axis: 2,
            epsilon: 1e-6,
        },
        vec![x, scale, x],
        vec!["rms.dx".into(), "rms.dyxhat".into()],
    )
    .unwrap();
    // grouped-query attention: 4 query heads over 2 key/value heads, a [T,S] mask
    let q4 = p.add_input("q4", t(f, &[1, 4, 3, 8]));
    let kv4 = p.add_input("kv4", t(f, &[1, 2, 5, 8]));
    let mask4 = p.add_input("mask4", t(f, &[3, 5]));
    let att = p
        .add_node(
            "attn",
            Op::Attention {
                scale: 0.35355339059327373,
                causal: true,
            },
            vec![q4, kv4, kv4, mask4],
            vec!["attn.o".into(), "attn.lse".into()],
        )
        .unwrap();
    p.add_node(
        "attn.grad",
        Op::AttentionGrad {
            scale: 0.35355339059327373,
            causal: true,
        },
        vec![q4, kv4, kv4, att[0], att[1], att[0], mask4],
        vec!["attn.dq".into(), "attn.dk".into(), "attn.dv".into()],
    )
    .unwrap();
    one(
        &mut p,
        "reduce",
        Op::Reduce {
            op: ReduceOp::Mean,
            axes: vec![1, 2],
            keep_dims: true,
        },
        &[x],
    );
    one(
        &mut p,
        "argmax",
        Op::ArgMax {
            axis: 2,
            keep_dims: false,
        },
        &[x],
    );
    one(
        &mut p,
        "cumsum",
        Op::CumSum {
            axis: 1,
            exclusive: true,
            reverse: false,
        },
        &[x],
    );
    one(&mut p, "reshape", Op::Reshape { shape: vec![8, 8] }, &[x]);
    one(
        &mut p,
        "transpose",
        Op::Transpose {
            perm: vec![0, 2, 1],
        },
        &[x],
    );
    one(
        &mut p,
        "slice",
        Op::Slice {
            axes: vec![1],
            starts: vec![3],
            ends: vec![-1],
            steps: vec![-1],
        },
        &[x],
    );
    one(&mut p, "concat", Op::Concat { axis: 0 }, &[x, x, x]);
    node(
        &mut p,
        "split",
        Op::Split {
            axis: 2,
            sizes: vec![3, 5],
        },
        &[x],
        &["split.0", "split:1"],
    );
    one(
        &mut p,
        "expand",
        Op::Expand {
            shape: vec![3, 2, 4, 8],
        },
        &[x],
    );
    one(
        &mut p,
        "tile",
        Op::Tile {
            repeats: vec![1, 2, 1],
        },
        &[x],
    );
    one(&mut p, "trilu", Op::Trilu { upper: true, k: -1 }, &[x]);
    one(&mut p, "gather", Op::Gather { axis: 0 }, &[w, ids]);
    one(
        &mut p,
        "gather_el",
        Op::GatherElements { axis: 1 },
        &[x, idx],
    );
    one(
        &mut p,
        "gather_nd",
        Op::GatherND { batch_dims: 0 },
        &[x, nd],
    );
    one(
        &mut p,
        "scatter_el",
        Op::ScatterElements { axis: 1, add: true },
        &[x, idx, upd],
    );
    one(
        &mut p,
        "scatter_nd",
        Op::ScatterND { add: false },
        &[x, nd, upd2],
    );
    one(
        &mut p,
        "onehot",
        Op::OneHot { axis: 2, depth: 10 },
        &[ids, onoff],
    );
    node(
        &mut p,
        "topk",
        Op::TopK {
            axis: 2,
            k: 3,
            largest: true,
            sorted: false,
        },
        &[x],
        &["topk.values", "topk.indices"],
    );
    // mixture of experts: 8 tokens of 8, 2 choices each among 3 experts of capacity 4
    let tokens = one(
        &mut p,
        "moe.tokens",
        Op::Reshape { shape: vec![8, 8] },
        &[x],
    );
    let choices = p.add_const(
        "moe.choices",
        Tensor::i64(vec![8, 2], (0..16).map(|i| (i * 7 % 3) as i64).collect()),
    );
    let weights = p.add_const(
        "moe.weights",
        Tensor::f32(vec![8, 2], (0..16).map(|i| i as f32 / 16.0).collect()),
    );
    let moe = node(
        &mut p,
        "moe.dispatch",
        Op::MoeDispatch {
            experts: 3,
            capacity: 4,
        },
        &[tokens, choices],
        &["moe.dispatched", "moe.slots"],
    );
    let combined = one(
        &mut p,
        "moe.combine",
        Op::MoeCombine,
        &[moe[0], choices, moe[1], weights],
    );
    node(
        &mut p,
        "moe.combine.grad",
        Op::MoeCombineGrad,
        &[moe[0], choices, moe[1], weights, combined],
        &["moe.d_expert_out", "moe.d_weights"],
    );
    one(
        &mut p,
        "fill",
        Op::Fill {
            value: -0.1,
            dtype: DType::F16,
            shape: vec![2, 2],
        },
        &[],
    );
    let g = one(
        &mut p,
        "allgather",
        Op::AllGather {
            group: Group::new(["gpu"]),
            axis: 0,
        },
        &[x],
    );
    one(
        &mut p,
        "reducescatter",
        Op::ReduceScatter {
            group: Group::new(["node", "gpu"]),
            axis: 2,
            reduce: ReduceOp::Sum,
        },
        &[x],
    );
    one(
        &mut p,
        "allreduce",
        Op::AllReduce {
            group: Group::new(Vec::<String>::new()),
            reduce: ReduceOp::Max,
        },
        &[x],
    );
    one(
        &mut p,
        "alltoall",
        Op::AllToAll {
            group: Group::new(["gpu"]),
            split_axis: 2,
            concat_axis: 0,
        },
        &[x],
    );
    one(
        &mut p,
        "broadcast",
        Op::Broadcast {
            group: Group::new(["node"]),
            root: 1,
        },
        &[x],
    );
    let c = one(&mut p, "copy", Op::Copy, &[x]);
    node(&mut p, "free \"c\"", Op::Free, &[c], &[]);
    node(&mut p, "rec", Op::RecordEvent { event: 3 }, &[], &[]);
    node(&mut p, "wait", Op::WaitEvent { event: u32::MAX }, &[], &[]);
    let n = p.nodes.len();
    p.nodes[n - 2].stream = StreamKind::AllGather;
    p.nodes[n - 1].stream = StreamKind::ReduceScatter;
    for node in p.nodes.iter_mut() {
        if matches!(node.op, Op::AllGather { .. }) {
            node.stream = StreamKind::AllGather;
        }
        if matches!(node.op, Op::ReduceScatter { .. }) {
            node.stream = StreamKind::ReduceScatter;
        }
    }
    p.outputs = vec![g, mm, x, g];
    p
}
