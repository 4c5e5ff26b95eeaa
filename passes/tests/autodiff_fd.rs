//! Gradient rules checked against central finite differences (an oracle independent of the
//! rules): for each op, loss = sum(op(x...) * w) with a fixed random w, and the gradient of
//! every float input compared with (loss(x + h) - loss(x - h)) / 2h.

use hzp_ir::{BinaryOp, DType, Op, Program, ReduceOp, Tensor, TensorType, UnaryOp, ValueId};
use hzp_passes::train::autodiff::differentiate;
use hzp_runtime::eval::evaluate;

/// Deterministic pseudo-random numbers in [-1, 1).
fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

enum In {
    /// A float input that is differentiated, with this shape.
    F(Vec<usize>),
    /// A positive float input (for Log, Sqrt, Pow bases ...).
    Pos(Vec<usize>),
    /// A fixed (non-differentiated) tensor.
    Fixed(Tensor),
}

/// Builds loss = sum(op(inputs)[out] * w), returns (program, float params, loss).
fn build(op: &Op, ins: &[In], out: usize) -> (Program, Vec<ValueId>, ValueId) {
    let mut p = Program::new("fd");
    let mut args = Vec::new();
    let mut params = Vec::new();
    for (i, inp) in ins.iter().enumerate() {
        let v = match inp {
            In::F(s) | In::Pos(s) => {
                let n: usize = s.iter().product();
                let mut d = rand_vec(n, 7 + i as u64);
                if matches!(inp, In::Pos(_)) {
                    d.iter_mut().for_each(|x| *x = x.abs() + 0.5);
                }
                let v = p.add_param(
                    format!("x{i}"),
                    TensorType::new(DType::F32, s.clone()),
                    Some(Tensor::f32(s.clone(), d)),
                );
                params.push(v);
                v
            }
            In::Fixed(t) => p.add_const(format!("k{i}"), t.clone()),
        };
        args.push(v);
    }
    let n_out = {
        let tys: Vec<_> = args.iter().map(|&v| p.ty(v)).collect();
        op.infer(&tys, None).unwrap().len()
    };
    let outs = p
        .add_node(
            "op",
            op.clone(),
            args,
            (0..n_out).map(|i| format!("y{i}")).collect(),
        )
        .unwrap();
    let y = outs[out];
    let yt = p.ty(y).clone();
    let w = p.add_const("w", Tensor::f32(yt.shape.clone(), rand_vec(yt.numel(), 99)));
    let prod = p
        .add_node(
            "prod",
            Op::Binary(BinaryOp::Mul),
            vec![y, w],
            vec!["prod".into()],
        )
        .unwrap()[0];
    let axes: Vec<usize> = (0..yt.rank()).collect();
    let loss = p
        .add_node(
            "loss",
            Op::Reduce {
                op: ReduceOp::Sum,
                axes,
                keep_dims: false,
            },
            vec![prod],
            vec!["loss".into()],
        )
        .unwrap()[0];
    (p, params, loss)
}

fn loss_of(p: &Program) -> f64 {
    let outs = evaluate(p, &[]).unwrap();
    outs[0].1.to_f64_vec()[0]
}

fn check(op: Op, ins: Vec<In>, out: usize) {
    let (p, params, loss) = build(&op, &ins, out);
    check_program(p, &params, loss, op.name());
}

/// Differentiates `loss` of `p` with respect to `params` (parameters with data) and compares
/// the gradients with central finite differences. Returns the differentiated program.
fn check_program(mut p: Program, params: &[ValueId], loss: ValueId, what: &str) -> Program {
    let mut fwd = p.clone();
    fwd.outputs = vec![loss];
    let grads = differentiate(&mut p, loss, params).unwrap_or_else(|e| panic!("{what}: {e}"));
    p.outputs = grads.clone();
    hzp_ir::verify(&p).unwrap_or_else(|e| panic!("{what}: {e}"));
    let got = evaluate(&p, &[]).unwrap_or_else(|e| panic!("{what}: {e}"));
    let h = 1e-2f32;
    for (k, &pv) in params.iter().enumerate() {
        let g = got[k].1.to_f64_vec();
        let pi = fwd.params.iter().position(|x| x.value == pv).unwrap();
        let base = fwd.params[pi].data.clone().unwrap();
        let mut fd = Vec::new();
        for j in 0..base.numel() {
            let mut plus = base.to_f32_vec();
            plus[j] += h;
            let mut minus = base.to_f32_vec();
            minus[j] -= h;
            let mut q = fwd.clone();
            q.params[pi].data = Some(Tensor::f32(base.shape.clone(), plus));
            let lp = loss_of(&q);
            q.params[pi].data = Some(Tensor::f32(base.shape.clone(), minus));
            let lm = loss_of(&q);
            fd.push((lp - lm) / (2.0 * h as f64));
        }
        let num: f64 = g
            .iter()
            .zip(&fd)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f64>()
            .sqrt();
        let den: f64 = fd.iter().map(|b| b * b).sum::<f64>().sqrt().max(1e-3);
        assert!(
            num / den < 2e-2,
            "{what} input {k}: autodiff {g:?} vs finite differences {fd:?} (rel err {})",
            num / den
        );
    }
    p
}

use In::*;

#[test]
fn elementwise_unary() {
    for u in [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Tanh,
        UnaryOp::Erf,
        UnaryOp::Sigmoid,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Abs,
        UnaryOp::Relu,
    ] {
        check(Op::Unary(u), vec![F(vec![2, 3])], 0);
    }
    for u in [
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Reciprocal,
    ] {
        check(Op::Unary(u), vec![Pos(vec![2, 3])], 0);
    }
}

#[test]
fn elementwise_binary_with_broadcasting() {
    for b in [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Max,
        BinaryOp::Min,
    ] {
        check(Op::Binary(b), vec![F(vec![2, 3, 4]), F(vec![3, 1])], 0);
    }
    check(
        Op::Binary(BinaryOp::Div),
        vec![F(vec![2, 3]), Pos(vec![3])],
        0,
    );
    check(
        Op::Binary(BinaryOp::Pow),
        vec![Pos(vec![2, 3]), F(vec![2, 3])],
        0,
    );
    let cond = Tensor::new(
        vec![2, 3],
        hzp_ir::Data::Bool(vec![true, false, true, false, false, true]),
    );
    check(Op::Where, vec![Fixed(cond), F(vec![2, 3]), F(vec![3])], 0);
}

#[test]
fn matmul_shapes() {
    check(Op::MatMul, vec![F(vec![2, 3, 4]), F(vec![4, 5])], 0);
    check(Op::MatMul, vec![F(vec![3, 4]), F(vec![2, 4, 2])], 0);
    check(Op::MatMul, vec![F(vec![4]), F(vec![4, 3])], 0);
    check(Op::MatMul, vec![F(vec![2, 4]), F(vec![4])], 0);
}

#[test]
fn normalizations_and_softmax() {
    check(Op::Softmax { axis: 1 }, vec![F(vec![2, 5])], 0);
    check(Op::LogSoftmax { axis: 2 }, vec![F(vec![2, 2, 5])], 0);
    // the fused cross-entropy over the last axis and over a middle one (strided lanes)
    let labels = Tensor::i64(vec![2, 2], vec![4, 0, 2, 3]);
    check(
        Op::SoftmaxCrossEntropy { axis: 2 },
        vec![F(vec![2, 2, 5]), Fixed(labels.clone())],
        0,
    );
    check(
        Op::SoftmaxCrossEntropy { axis: 1 },
        vec![F(vec![2, 5, 2]), Fixed(labels)],
        0,
    );
    check(
        Op::LayerNorm {
            axis: 1,
            epsilon: 1e-5,
        },
        vec![F(vec![3, 6]), F(vec![6]), F(vec![6])],
        0,
    );
    check(
        Op::RmsNorm {
            axis: 2,
            epsilon: 1e-6,
        },
        vec![F(vec![2, 2, 4]), F(vec![4])],
        0,
    );
    // rows long enough for the fused gradient's sixteen-wide pieces (40 = 32 + a tail)
    check(
        Op::LayerNorm {
            axis: 1,
            epsilon: 1e-5,
        },
        vec![F(vec![2, 40]), F(vec![40]), F(vec![40])],
        0,
    );
    check(
        Op::RmsNorm {
            axis: 1,
            epsilon: 1e-6,
        },
        vec![F(vec![3, 40]), F(vec![40])],
        0,
    );
}

#[test]
fn reductions() {
    for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
        check(
            Op::Reduce {
                op,
                axes: vec![1],
                keep_dims: false,
            },
            vec![F(vec![2, 3, 2])],
            0,
        );
        check(
            Op::Reduce {
                op,
                axes: vec![0, 2],
                keep_dims: true,
            },
            vec![F(vec![2, 3, 2])],
            0,
        );
    }
    check(
        Op::CumSum {
            axis: 1,
            exclusive: false,
            reverse: false,
        },
        vec![F(vec![2, 4])],
        0,
    );
    check(
        Op::CumSum {
            axis: 1,
            exclusive: true,
            reverse: true,
        },
        vec![F(vec![2, 4])],
        0,
    );
}

#[test]
fn data_movement() {
    check(Op::Reshape { shape: vec![3, 4] }, vec![F(vec![2, 6])], 0);
    check(
        Op::Transpose {
            perm: vec![2, 0, 1],
        },
        vec![F(vec![2, 3, 4])],
        0,
    );
    check(
        Op::Expand {
            shape: vec![2, 3, 4],
        },
        vec![F(vec![3, 1])],
        0,
    );
    check(
        Op::Tile {
            repeats: vec![2, 3],
        },
        vec![F(vec![2, 2])],
        0,
    );
    check(
        Op::Concat { axis: 1 },
        vec![F(vec![2, 2]), F(vec![2, 3])],
        0,
    );
    check(
        Op::Split {
            axis: 1,
            sizes: vec![1, 3],
        },
        vec![F(vec![2, 4])],
        1,
    );
    check(
        Op::Slice {
            axes: vec![0, 1],
            starts: vec![1, 1],
            ends: vec![3, 3],
            steps: vec![1, 1],
        },
        vec![F(vec![3, 4])],
        0,
    );
    check(Op::Trilu { upper: false, k: 0 }, vec![F(vec![3, 3])], 0);
    check(Op::Cast { to: DType::F32 }, vec![F(vec![3])], 0);
}

#[test]
fn strided_and_reversed_slices() {
    // steps 2 and 3 (GPT-J's x[..., ::2] and x[..., 1::2]), a reversed axis, a reversed
    // strided one, and an empty slice
    for (starts, ends, steps) in [
        (vec![0, 1], vec![3, 7], vec![1, 2]),
        (vec![1, 0], vec![3, 7], vec![1, 3]),
        (vec![2, 6], vec![-1, -1], vec![-1, -2]),
        (vec![0, 5], vec![3, 0], vec![1, -3]),
        (vec![0, 4], vec![3, 4], vec![1, 1]),
    ] {
        check(
            Op::Slice {
                axes: vec![0, 1],
                starts,
                ends,
                steps,
            },
            vec![F(vec![3, 7])],
            0,
        );
    }
}

#[test]
fn indexing() {
    let idx = Tensor::i64(vec![2, 3], vec![0, 4, 1, 1, -1, 2]);
    check(
        Op::Gather { axis: 0 },
        vec![F(vec![5, 3]), Fixed(idx.clone())],
        0,
    );
    check(
        Op::Gather { axis: 1 },
        vec![F(vec![2, 5, 2]), Fixed(idx)],
        0,
    );
    let ie = Tensor::i64(vec![2, 2], vec![0, 2, 1, 1]);
    check(
        Op::GatherElements { axis: 1 },
        vec![F(vec![2, 3]), Fixed(ie)],
        0,
    );
    let ind = Tensor::i64(vec![2, 2], vec![0, 1, 1, 2]);
    check(
        Op::GatherND { batch_dims: 0 },
        vec![F(vec![2, 3, 2]), Fixed(ind)],
        0,
    );
    check(
        Op::TopK {
            axis: 1,
            k: 2,
            largest: true,
            sorted: true,
        },
        vec![F(vec![2, 5])],
        0,
    );
    // scatter (overwrite and add): gradients of the data and of the updates
    let si = Tensor::i64(vec![2, 2], vec![0, 2, 1, 0]);
    for add in [false, true] {
        check(
            Op::ScatterElements { axis: 1, add },
            vec![F(vec![2, 3]), Fixed(si.clone()), F(vec![2, 2])],
            0,
        );
    }
    let sn = Tensor::i64(vec![2, 1], vec![2, 0]);
    for add in [false, true] {
        check(
            Op::ScatterND { add },
            vec![F(vec![3, 2]), Fixed(sn.clone()), F(vec![2, 2])],
            0,
        );
    }
}

#[test]
fn a_missing_rule_names_the_op_and_node() {
    let (mut p, params, loss) = build(
        &Op::Reduce {
            op: ReduceOp::Prod,
            axes: vec![0],
            keep_dims: false,
        },
        &[F(vec![3])],
        0,
    );
    let e = differentiate(&mut p, loss, &params)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Reduce") && e.contains("`op`"), "{e}");
}

/// A parameter `name` of `shape` with seeded values.
fn tied_param(p: &mut Program, name: &str, shape: &[usize], seed: u64) -> ValueId {
    let n = shape.iter().product();
    let t = Tensor::f32(shape.to_vec(), rand_vec(n, seed));
    p.add_param(name, TensorType::new(DType::F32, shape.to_vec()), Some(t))
}

/// Node `name` with one result named after it.
fn tied_node(p: &mut Program, name: &str, op: Op, ins: Vec<ValueId>) -> ValueId {
    p.add_node(name, op, ins, vec![name.into()]).unwrap()[0]
}

/// `x @ Transpose(w)` for a `[3, 5]` result `y = x @ w^T`, then the scalar loss
/// `sum(y * c)` with fixed weights `c`; returns `(transpose of w, loss)`.
fn tied_head(p: &mut Program, x: ValueId, w: ValueId) -> (ValueId, ValueId) {
    let wt = tied_node(p, "wt", Op::Transpose { perm: vec![1, 0] }, vec![w]);
    let y = tied_node(p, "y", Op::MatMul, vec![x, wt]);
    let c = p.add_const("c", Tensor::f32(vec![3, 5], rand_vec(15, 3)));
    let prod = tied_node(p, "prod", Op::Binary(BinaryOp::Mul), vec![y, c]);
    let sum = Op::Reduce {
        op: ReduceOp::Sum,
        axes: vec![0, 1],
        keep_dims: false,
    };
    (wt, tied_node(p, "loss", sum, vec![prod]))
}

/// `x @ Transpose(w)` (a tied LM head): the backward reads `w` itself where it needs the
/// transpose of `Transpose(w)`, instead of transposing it back; the gradients still match
/// finite differences.
#[test]
fn the_transpose_of_a_transpose_is_its_input() {
    let mut p = Program::new("tied");
    let x = tied_param(&mut p, "x", &[3, 4], 1);
    let w = tied_param(&mut p, "w", &[5, 4], 2);
    let (wt, loss) = tied_head(&mut p, x, w);
    let q = check_program(p, &[x, w], loss, "tied head");
    let transposes_of_wt = q
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Transpose { .. }) && n.inputs.contains(&wt))
        .count();
    assert_eq!(transposes_of_wt, 0, "{}", hzp_ir::text::print(&q));
}

/// A tied embedding: `w` is gathered (the embedding) and read through `Transpose(w)` (the LM
/// head). Its two gradients are summed by scatter-adding the embedding rows into the head's
/// gradient: no zeros tensor and no dense `Add`, and the gradient still matches finite
/// differences (a repeated index included).
#[test]
fn a_tied_embedding_scatters_into_the_head_gradient() {
    let mut p = Program::new("tied_embedding");
    let w = tied_param(&mut p, "w", &[5, 4], 4);
    let ids = p.add_const("ids", Tensor::i64(vec![3], vec![1, 3, 1]));
    let emb = tied_node(&mut p, "emb", Op::Gather { axis: 0 }, vec![w, ids]);
    let (_, loss) = tied_head(&mut p, emb, w);
    let mut q = check_program(p, &[w], loss, "tied embedding");
    q.eliminate_dead_code();
    let adds_of_w_shape = q
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Binary(BinaryOp::Add)) && q.ty(n.outputs[0]).shape == [5, 4])
        .count();
    let zero_fills = q
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Fill { .. }))
        .count();
    assert_eq!(
        (adds_of_w_shape, zero_fills),
        (0, 0),
        "{}",
        hzp_ir::text::print(&q)
    );
}

#[test]
fn fused_attention() {
    // grouped-query (4 query heads over 2 key/value heads), causal and not, with a learned
    // additive mask (T5's position bias: its gradient is the score gradient summed to the
    // mask's shape) and without
    for causal in [false, true] {
        check(
            Op::Attention { scale: 0.6, causal },
            vec![
                F(vec![1, 4, 5, 3]),
                F(vec![1, 2, 5, 3]),
                F(vec![1, 2, 5, 2]),
                F(vec![4, 5, 5]),
            ],
            0,
        );
        check(
            Op::Attention { scale: 0.6, causal },
            vec![
                F(vec![2, 2, 4, 3]),
                F(vec![2, 1, 6, 3]),
                F(vec![2, 1, 6, 4]),
            ],
            0,
        );
    }
}

#[path = "../../frontends/tests/onnx_util/mod.rs"]
mod onnx_util;

/// An ONNX Dropout in training mode (its mask drawn at import from `seed`): the gradient goes
/// through the mask the forward used. y = Dropout(x * w), loss = sum(y), so dloss/dw is
/// x * scale where the mask (Dropout's second output) keeps the element and 0 elsewhere.
#[test]
fn training_dropout_backpropagates_through_the_forward_mask() {
    use onnx_util::*;
    let n = 32;
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(n as i64)]));
    let w = Tensor::f32(vec![n], rand_vec(n, 3));
    m.inits.push(init("w", &w));
    m.inits.push(init("ratio", &Tensor::scalar_f32(0.25)));
    m.inits.push(init(
        "train",
        &Tensor::new(vec![], hzp_ir::Data::Bool(vec![true])),
    ));
    m.nodes
        .push(node("Mul", "mul", &["x", "w"], &["xw"], vec![]));
    m.nodes.push(node(
        "Dropout",
        "drop",
        &["xw", "ratio", "train"],
        &["y", "mask"],
        vec![a_i("seed", 7)],
    ));
    m.outputs.push(out("y"));
    m.outputs.push(out("mask"));
    let mut p = m.import(&[]).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p.params.len(), 1, "w is the one parameter");
    let wv = p.params[0].value;
    let x = Tensor::f32(vec![n], rand_vec(n, 5));
    let feed = vec![("x".to_string(), x.clone())];
    let fwd = evaluate(&p, &feed).unwrap();
    let mask = match &fwd[1].1.data {
        hzp_ir::Data::Bool(b) => b.clone(),
        d => panic!("the mask is bool, got {d:?}"),
    };
    assert!(mask.contains(&true) && mask.contains(&false), "{mask:?}");
    let y = p.outputs[0];
    let loss = p
        .add_node(
            "loss",
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![0],
                keep_dims: false,
            },
            vec![y],
            vec!["loss".into()],
        )
        .unwrap()[0];
    let grads = differentiate(&mut p, loss, &[wv]).unwrap();
    p.outputs = grads;
    hzp_ir::verify(&p).unwrap();
    let g = evaluate(&p, &feed).unwrap()[0].1.to_f32_vec();
    let scale = 1.0f32 / (1.0 - 0.25);
    for (i, ((&gi, &xi), &keep)) in g.iter().zip(&x.to_f32_vec()).zip(&mask).enumerate() {
        let want = if keep { xi * scale } else { 0.0 };
        assert!(
            (gi - want).abs() <= 1e-6,
            "element {i}: dw {gi}, expected {want}"
        );
    }
}

/// Routed mixture of experts: dispatch (the tokens' gradient), combine (the experts'
/// outputs' and the weights' gradients), with choices that overflow the capacity, so the
/// dropped ones must get no gradient.
#[test]
fn moe_dispatch_and_combine() {
    // 5 tokens, 2 choices each among 3 experts of capacity 2: expert 0 is chosen 5 times
    let choices = Tensor::i64(vec![5, 2], vec![0, 1, 0, 2, 1, 0, 0, 2, 2, 0]);
    check(
        Op::MoeDispatch {
            experts: 3,
            capacity: 2,
        },
        vec![F(vec![5, 4]), Fixed(choices.clone())],
        0,
    );
    // the slots GShard's rule gives these choices (first choices, then second choices)
    let slots = Tensor::i64(vec![5, 2], vec![0, 1, 1, 0, 0, -1, -1, 1, 1, -1]);
    check(
        Op::MoeCombine,
        vec![
            F(vec![3, 2, 4]),
            Fixed(choices.clone()),
            Fixed(slots),
            F(vec![5, 2]),
        ],
        0,
    );
    // the two in one program with a nonlinearity between: x -> dispatch -> tanh -> combine
    let mut p = Program::new("moe");
    let x = p.add_param(
        "x",
        TensorType::new(DType::F32, vec![5, 4]),
        Some(Tensor::f32(vec![5, 4], rand_vec(20, 3))),
    );
    let w = p.add_param(
        "w",
        TensorType::new(DType::F32, vec![5, 2]),
        Some(Tensor::f32(vec![5, 2], rand_vec(10, 4))),
    );
    let ch = p.add_const("choices", choices);
    let d = p
        .add_node(
            "dispatch",
            Op::MoeDispatch {
                experts: 3,
                capacity: 2,
            },
            vec![x, ch],
            vec!["buf".into(), "slots".into()],
        )
        .unwrap();
    let act = p
        .add_node(
            "act",
            Op::Unary(UnaryOp::Tanh),
            vec![d[0]],
            vec!["act".into()],
        )
        .unwrap()[0];
    let y = p
        .add_node(
            "combine",
            Op::MoeCombine,
            vec![act, ch, d[1], w],
            vec!["y".into()],
        )
        .unwrap()[0];
    let sq = p
        .add_node(
            "sq",
            Op::Binary(BinaryOp::Mul),
            vec![y, y],
            vec!["sq".into()],
        )
        .unwrap()[0];
    let loss = p
        .add_node(
            "loss",
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![0, 1],
                keep_dims: false,
            },
            vec![sq],
            vec!["loss".into()],
        )
        .unwrap()[0];
    check_program(p, &[x, w], loss, "dispatch, tanh, combine");
}

/// Parameters of a preset (shapes only) filled with deterministic random values, the same
/// for the same parameter name.
fn with_random_params(mut p: Program) -> Program {
    for prm in &mut p.params {
        let v = &p.values[prm.value.index()];
        let seed = v
            .name
            .bytes()
            .fold(17u64, |h, b| h.wrapping_mul(31) ^ b as u64);
        let d = rand_vec(v.ty.numel(), seed)
            .iter()
            .map(|x| x * 0.3)
            .collect();
        prm.data = Some(Tensor::f32(v.ty.shape.clone(), d));
    }
    p
}

/// The loss and every parameter's gradient, by parameter name.
fn loss_and_grads(fwd: &Program, ids: &Tensor) -> (Vec<f32>, Vec<(String, Vec<f32>)>) {
    use hzp_passes::train::{gradient_program, LossKind};
    let g = gradient_program(fwd, &LossKind::Lm { labels: None }).unwrap();
    let out = evaluate(&g, &[("input_ids".to_string(), ids.clone())]).unwrap();
    let logits = evaluate(fwd, &[("input_ids".to_string(), ids.clone())]).unwrap();
    let mut all = logits[0].1.to_f32_vec();
    all.extend(out[0].1.to_f32_vec());
    let grads = fwd
        .params
        .iter()
        .zip(&out[1..])
        .map(|(prm, (_, t))| (fwd.value(prm.value).name.clone(), t.to_f32_vec()))
        .collect();
    (all, grads)
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .fold(0.0, f64::max);
    let den = b.iter().map(|y| (*y as f64).abs()).fold(1e-6, f64::max);
    num / den
}

/// The routed MoE preset without drops against its dense form (every expert on every
/// token, a mostly-zero gate), an oracle the routed ops take no part in: logits, loss and
/// every parameter's gradient; with a small capacity the routed form must differ.
#[test]
fn dropless_routed_moe_equals_the_dense_form() {
    use hzp_frontends::presets::parse_preset;
    let routed = with_random_params(parse_preset("preset:moe-tiny").unwrap());
    let dense = with_random_params(parse_preset("preset:moe-tiny,dense=true").unwrap());
    let has = |p: &Program, name: &str| p.nodes.iter().any(|n| n.op.name() == name);
    assert!(has(&routed, "MoeDispatch") && has(&routed, "MoeCombine"));
    assert!(!has(&dense, "MoeDispatch"));
    let ids = Tensor::i64(
        vec![2, 16],
        rand_vec(32, 5)
            .iter()
            .map(|x| ((x + 1.0) * 127.0) as i64)
            .collect(),
    );
    let (out_r, grads_r) = loss_and_grads(&routed, &ids);
    let (out_d, grads_d) = loss_and_grads(&dense, &ids);
    let err = max_rel(&out_r, &out_d);
    eprintln!("routed vs dense: logits and loss max rel err {err}");
    assert!(err < 1e-6, "logits and loss differ: max rel err {err}");
    assert_eq!(grads_r.len(), grads_d.len());
    for ((nr, gr), (nd, gd)) in grads_r.iter().zip(&grads_d) {
        assert_eq!(nr, nd);
        let err = max_rel(gr, gd);
        assert!(err < 1e-5, "gradient of {nr}: max rel err {err}");
    }
    // A capacity of one token per expert drops most choices: the logits change.
    let small = with_random_params(parse_preset("preset:moe-tiny,capacity_factor=0.01").unwrap());
    let (out_s, _) = loss_and_grads(&small, &ids);
    assert!(max_rel(&out_s, &out_d) > 1e-3);
}

/// The routed MoE preset (dropless) with the PyTorch model's weights: loss and every
/// parameter's gradient against what torch autograd computed for transformers' Mixtral
/// (tests/models/moe_tiny.grads.npz, made by tests/models/make_models.py).
#[test]
fn routed_moe_tiny_matches_torch_autograd() {
    use hzp_frontends::{npz, presets::parse_preset};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/models");
    let torch = npz::read(&dir.join("moe_tiny.grads.npz")).unwrap();
    let io = npz::read(&dir.join("moe_tiny.io.npz")).unwrap();
    let get = |set: &[(String, Tensor)], k: &str| {
        set.iter()
            .find(|(n, _)| n == k)
            .unwrap_or_else(|| panic!("no {k}"))
            .1
            .clone()
    };
    let mut p = parse_preset("preset:moe-tiny").unwrap();
    assert!(p.nodes.iter().any(|n| n.op.name() == "MoeDispatch"));
    for prm in &mut p.params {
        let name = &p.values[prm.value.index()].name;
        prm.data = Some(get(&torch, &format!("param/{name}")));
    }
    let (out, grads) = loss_and_grads(&p, &get(&io, "input_ids"));
    let loss = *out.last().unwrap();
    let want = get(&torch, "loss").to_f32_vec()[0];
    assert!((loss - want).abs() < 1e-4, "loss {loss} vs torch {want}");
    for (name, g) in &grads {
        let err = max_rel(g, &get(&torch, &format!("grad/{name}")).to_f32_vec());
        assert!(
            err < 1e-4,
            "gradient of {name}: max rel err {err} against torch"
        );
    }
}

/// `preset:moe-tiny` with the loss `lm + 0.05 * aux`, the routers' load-balancing loss,
/// against transformers' Mixtral with `output_router_logits=True` and
/// `router_aux_loss_coef=0.05` (tests/models/make_moe_aux_refs.py wrote moe_tiny.aux.npz):
/// the total loss and every gradient. The gradient differs from the plain LM loss's, so a
/// dropped or wrong aux term fails.
#[test]
fn routed_moe_tiny_with_router_aux_loss_matches_transformers() {
    use hzp_frontends::{npz, presets::parse_preset};
    use hzp_passes::train::{gradient_program, LossKind};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/models");
    let params = npz::read(&dir.join("moe_tiny.grads.npz")).unwrap();
    let io = npz::read(&dir.join("moe_tiny.io.npz")).unwrap();
    let aux = npz::read(&dir.join("moe_tiny.aux.npz")).unwrap();
    let get = |set: &[(String, Tensor)], k: &str| {
        set.iter()
            .find(|(n, _)| n == k)
            .unwrap_or_else(|| panic!("no {k}"))
            .1
            .clone()
    };
    let mut p = parse_preset("preset:moe-tiny").unwrap();
    for prm in &mut p.params {
        let name = &p.values[prm.value.index()].name;
        prm.data = Some(get(&params, &format!("param/{name}")));
    }
    let coef = get(&aux, "coef").to_f64_vec()[0];
    let kind = LossKind::Lm { labels: None }.with_router_aux(coef).unwrap();
    let g = gradient_program(&p, &kind).unwrap();
    let out = evaluate(&g, &[("input_ids".to_string(), get(&io, "input_ids"))]).unwrap();
    let loss = out[0].1.to_f32_vec()[0];
    let want = get(&aux, "loss").to_f32_vec()[0];
    assert!(
        (loss - want).abs() < 1e-4,
        "loss {loss} vs transformers {want}"
    );
    for (prm, (_, t)) in p.params.iter().zip(&out[1..]) {
        let name = &p.values[prm.value.index()].name;
        let want = get(&aux, &format!("grad/{name}")).to_f32_vec();
        let got = t.to_f32_vec();
        let abs = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let rel = max_rel(&got, &want);
        assert!(
            abs < 1e-5 && rel < 1e-4,
            "gradient of {name}: max abs err {abs}, rel {rel} against transformers"
        );
    }
    // The aux term moves the routers' gradients: the plain LM loss's differ from the oracle.
    let lm = npz::read(&dir.join("moe_tiny.grads.npz")).unwrap();
    let router = "model.layers.0.mlp.gate.weight";
    let (a, b) = (
        get(&aux, &format!("grad/{router}")).to_f32_vec(),
        get(&lm, &format!("grad/{router}")).to_f32_vec(),
    );
    assert!(
        max_rel(&a, &b) > 1e-3,
        "the oracle's aux term does not move {router}"
    );
}

/// One routed MoE layer with a capacity that drops half the choices, against numpy's GShard
/// formulation (one-hot cumulative sums per priority, float64; tests/models/make_moe_drops.py
/// wrote tests/models/moe_drops.npz): which choices are kept, and the layer's output.
#[test]
fn routed_moe_layer_with_drops_matches_numpy_gshard() {
    use hzp_frontends::npz;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/models");
    let want = npz::read(&dir.join("moe_drops.npz")).unwrap();
    let get = |k: &str| {
        want.iter()
            .find(|(n, _)| n == k)
            .unwrap_or_else(|| panic!("no {k}"))
            .1
            .clone()
    };
    let x = get("x");
    let (t, h) = (x.shape[0], x.shape[1]);
    let router = get("gate.weight");
    let experts = router.shape[0];
    let capacity = get("capacity").to_f64_vec()[0] as usize;
    let k = get("top_k").to_f64_vec()[0] as usize;
    let f = get("experts.down_proj").shape[2];

    let mut p = Program::new("moe layer");
    let xv = p.add_input("x", x.ty());
    let param = |p: &mut Program, name: &str| {
        let t = get(name);
        p.add_param(name, t.ty(), Some(t))
    };
    let wr = param(&mut p, "gate.weight");
    let gu = param(&mut p, "experts.gate_up_proj");
    let dw = param(&mut p, "experts.down_proj");
    let op = |p: &mut Program, name: &str, op: Op, ins: &[ValueId], n: usize| {
        let outs = (0..n).map(|i| format!("{name}.{i}")).collect();
        p.add_node(name, op, ins.to_vec(), outs).unwrap()
    };
    let wr_t = op(&mut p, "wr_t", Op::Transpose { perm: vec![1, 0] }, &[wr], 1)[0];
    let logits = op(&mut p, "logits", Op::MatMul, &[xv, wr_t], 1)[0];
    let probs = op(&mut p, "probs", Op::Softmax { axis: 1 }, &[logits], 1)[0];
    let topk = Op::TopK {
        axis: 1,
        k,
        largest: true,
        sorted: true,
    };
    let top = op(&mut p, "top", topk, &[probs], 2);
    let sum = Op::Reduce {
        op: ReduceOp::Sum,
        axes: vec![1],
        keep_dims: true,
    };
    let sum = op(&mut p, "sum", sum, &[top[0]], 1)[0];
    let w = op(&mut p, "w", Op::Binary(BinaryOp::Div), &[top[0], sum], 1)[0];
    let dispatch = Op::MoeDispatch { experts, capacity };
    let d = op(&mut p, "dispatch", dispatch, &[xv, top[1]], 2);
    let gu_t = op(
        &mut p,
        "gu_t",
        Op::Transpose {
            perm: vec![0, 2, 1],
        },
        &[gu],
        1,
    )[0];
    let g = op(&mut p, "gu", Op::MatMul, &[d[0], gu_t], 1)[0];
    let split = Op::Split {
        axis: 2,
        sizes: vec![f, f],
    };
    let s = op(&mut p, "split", split, &[g], 2);
    let act = op(&mut p, "act", Op::Unary(UnaryOp::Silu), &[s[0]], 1)[0];
    let a = op(&mut p, "a", Op::Binary(BinaryOp::Mul), &[act, s[1]], 1)[0];
    let dw_t = op(
        &mut p,
        "dw_t",
        Op::Transpose {
            perm: vec![0, 2, 1],
        },
        &[dw],
        1,
    )[0];
    let ye = op(&mut p, "ye", Op::MatMul, &[a, dw_t], 1)[0];
    let y = op(&mut p, "y", Op::MoeCombine, &[ye, top[1], d[1], w], 1)[0];
    p.outputs = vec![y, d[1]];
    hzp_ir::verify(&p).unwrap();
    let out = evaluate(&p, &[("x".to_string(), x)]).unwrap();

    let kept: Vec<bool> = get("kept").to_f64_vec().iter().map(|&v| v != 0.0).collect();
    let slots = out[1].1.to_f64_vec();
    assert_eq!(kept.len(), t * k);
    assert!(kept.iter().any(|&b| !b), "the reference must drop choices");
    let got: Vec<bool> = slots.iter().map(|&s| s >= 0.0).collect();
    assert_eq!(got, kept, "kept choices (token-major [T,K])");
    let err = max_rel(&out[0].1.to_f32_vec(), &get("y").to_f32_vec());
    assert_eq!(out[0].1.shape, vec![t, h]);
    assert!(err < 1e-5, "MoE layer vs numpy: max rel err {err}");
}
