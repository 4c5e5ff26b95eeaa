//! The routers' auxiliary load-balancing loss, as transformers' `load_balancing_loss_func`
//! computes it for Mixtral and Qwen3-MoE (no attention mask): over the rows of every routed
//! layer together (`N = layers * tokens`), `tokens_per_expert[e]` is the share of the
//! `N * top_k` choices that picked expert `e`, `router_prob[e]` the mean router probability
//! of `e`, and the loss is `experts * sum_e tokens_per_expert[e] * router_prob[e]`.
//!
//! The routers are found from the ops, not from names: every `MoeDispatch` takes its
//! choices from a `TopK` over the router's probabilities (a `Softmax` on the last axis) or
//! over its logits (then the probabilities are a `Softmax` of them). The one-hot counts are
//! integer-derived and carry no gradient; the gradient flows through the mean
//! probabilities, as in PyTorch.

use crate::emit::Emitter;
use hzp_ir::{BinaryOp, DType, Op, Program, ReduceOp, Tensor, UnaryOp, ValueDef, ValueId};

/// One routed layer: its router probabilities' source and its top-k choices.
struct Router {
    /// `[T, E]`: probabilities when `is_probs`, else logits.
    scores: ValueId,
    is_probs: bool,
    /// `[T, K]` expert indices.
    choices: ValueId,
    experts: usize,
}

fn producer(p: &Program, v: ValueId) -> Option<(&hzp_ir::Node, u32)> {
    match p.value(v).def {
        ValueDef::Node { node, slot } => Some((p.node(node), slot)),
        _ => None,
    }
}

/// The routed layers of `p`, in program order (each set of choices once).
fn routers(p: &Program) -> Result<Vec<Router>, String> {
    let mut out: Vec<Router> = Vec::new();
    for n in &p.nodes {
        let Op::MoeDispatch { experts, .. } = n.op else {
            continue;
        };
        let choices = n.inputs[1];
        if out.iter().any(|r| r.choices == choices) {
            continue;
        }
        let what = || {
            format!(
                "--router-aux-loss: the choices `{}` of a MoeDispatch",
                p.value(choices).name
            )
        };
        let topk = match producer(p, choices) {
            Some((t, 1)) if matches!(t.op, Op::TopK { largest: true, .. }) => t,
            _ => return Err(format!("{} do not come from a TopK's indices", what())),
        };
        let Op::TopK { axis, .. } = topk.op else {
            unreachable!("matched above")
        };
        let scores = topk.inputs[0];
        let st = p.ty(scores);
        if st.rank() != 2 || axis != 1 || st.shape[1] != experts {
            return Err(format!(
                "{} come from a TopK on axis {axis} of {st}; the auxiliary loss needs router scores [tokens, {experts}] with the experts last",
                what()
            ));
        }
        let is_probs = match producer(p, scores) {
            Some((s, _)) if matches!(s.op, Op::Softmax { axis: 1 }) => true,
            Some((s, _)) if matches!(s.op, Op::Unary(UnaryOp::Sigmoid)) => {
                return Err(format!(
                    "{} are a top-k of sigmoid scores; transformers' load-balancing loss is defined for softmax routers",
                    what()
                ))
            }
            _ => false,
        };
        out.push(Router {
            scores,
            is_probs,
            choices,
            experts,
        });
    }
    Ok(out)
}

/// Adds `coef * aux` to the scalar f32 loss `base` of `p` and returns the sum.
pub(crate) fn add_router_aux(p: &mut Program, base: ValueId, coef: f64) -> Result<ValueId, String> {
    let rs = routers(p)?;
    let Some(first) = rs.first() else {
        return Err(format!(
            "--router-aux-loss {coef}: model `{}` has no routed MoE layer (no MoeDispatch; the dense form `dense=true` and imported MoE graphs keep none)",
            p.name
        ));
    };
    let experts = first.experts;
    if let Some(r) = rs.iter().find(|r| r.experts != experts) {
        return Err(format!(
            "--router-aux-loss: routed layers have {experts} and {} experts; transformers' loss concatenates the router logits of layers with one expert count",
            r.experts
        ));
    }
    let rows: usize = rs.iter().map(|r| p.ty(r.scores).shape[0]).sum();
    let onehot_values = p.add_const(
        "loss.router_aux.onehot_values",
        Tensor::from_f64(DType::F32, vec![2], &[0.0, 1.0]),
    );
    let mut e = Emitter::new(p);
    e.enter("loss/router_aux", hzp_ir::Role::of(hzp_ir::RoleKind::Loss));
    let sum = |axes: Vec<usize>| Op::Reduce {
        op: ReduceOp::Sum,
        axes,
        keep_dims: false,
    };
    let (mut counts, mut probs) = (None, None);
    for r in &rs {
        let mut s = r.scores;
        if e.ty(s).dtype != DType::F32 {
            s = e.op(Op::Cast { to: DType::F32 }, &[s])?;
        }
        if !r.is_probs {
            s = e.op(Op::Softmax { axis: 1 }, &[s])?;
        }
        // [T, K, E] one-hot of the choices, summed over tokens and choices: [E].
        let oh = e.op(
            Op::OneHot {
                axis: 2,
                depth: experts,
            },
            &[r.choices, onehot_values],
        )?;
        let c = e.op(sum(vec![0, 1]), &[oh])?;
        let q = e.op(sum(vec![0]), &[s])?;
        counts = Some(match counts {
            None => c,
            Some(a) => e.op(Op::Binary(BinaryOp::Add), &[a, c])?,
        });
        probs = Some(match probs {
            None => q,
            Some(a) => e.op(Op::Binary(BinaryOp::Add), &[a, q])?,
        });
    }
    let (counts, probs) = (counts.expect("one router"), probs.expect("one router"));
    let prod = e.op(Op::Binary(BinaryOp::Mul), &[counts, probs])?;
    let total = e.op(sum(vec![0]), &[prod])?;
    // experts * sum((counts / N) * (probs / N)), times the coefficient.
    let n = rows as f64;
    let scale = e.scalar(coef * experts as f64 / (n * n), DType::F32);
    let aux = e.op(Op::Binary(BinaryOp::Mul), &[total, scale])?;
    e.op(Op::Binary(BinaryOp::Add), &[base, aux])
}

#[cfg(test)]
mod tests {
    use crate::train::{attach_loss, LossKind};
    use hzp_ir::{DType, Op, Program, Tensor, TensorType};

    /// One routed layer: `x [6,3] @ router [3,4]`, top-2 of the probabilities (or of the
    /// logits), dispatched and combined without experts; the output is the combined tokens.
    fn layer(topk_of_logits: bool) -> Program {
        let (t, h, e) = (6, 3, 4);
        let vals = |n: usize, k: f32| (0..n).map(|i| ((i * 7 % 11) as f32 - 5.0) * k).collect();
        let mut p = Program::new("layer");
        let x = p.add_input("x", TensorType::new(DType::F32, vec![t, h]));
        let w = p.add_param(
            "router",
            TensorType::new(DType::F32, vec![h, e]),
            Some(Tensor::f32(vec![h, e], vals(h * e, 0.3))),
        );
        let node = |p: &mut Program, name: &str, op: Op, ins: Vec<_>, outs: &[&str]| {
            let outs = outs.iter().map(|s| s.to_string()).collect();
            p.add_node(name, op, ins, outs).unwrap()
        };
        let logits = node(&mut p, "gate", Op::MatMul, vec![x, w], &["logits"])[0];
        let probs = node(
            &mut p,
            "sm",
            Op::Softmax { axis: 1 },
            vec![logits],
            &["probs"],
        )[0];
        let scores = if topk_of_logits { logits } else { probs };
        let topk = Op::TopK {
            axis: 1,
            k: 2,
            largest: true,
            sorted: true,
        };
        let top = node(&mut p, "topk", topk, vec![scores], &["top", "choices"]);
        let dispatch = Op::MoeDispatch {
            experts: e,
            capacity: t,
        };
        let d = node(
            &mut p,
            "dispatch",
            dispatch,
            vec![x, top[1]],
            &["d", "slots"],
        );
        let y = node(
            &mut p,
            "combine",
            Op::MoeCombine,
            vec![d[0], top[1], d[1], top[0]],
            &["y"],
        )[0];
        p.outputs = vec![y];
        p
    }

    fn aux(coef: f64) -> LossKind {
        LossKind::Mean.with_router_aux(coef).unwrap()
    }

    #[test]
    fn a_model_without_routed_layers_is_refused() {
        // The router alone: its probabilities, no MoeDispatch.
        let mut p = layer(false);
        p.outputs = vec![p.find_value("probs").unwrap()];
        p.eliminate_dead_code();
        let err = attach_loss(&p, &aux(0.1)).unwrap_err().to_string();
        assert!(err.contains("no routed MoE layer"), "{err}");
        assert!(LossKind::Mean.with_router_aux(-1.0).is_err());
        assert!(LossKind::Mean.with_router_aux(f64::NAN).is_err());
        assert_eq!(LossKind::Mean.with_router_aux(0.0).unwrap(), LossKind::Mean);
    }

    /// A top-k over the logits picks what a top-k over the probabilities picks; the aux
    /// loss then takes the softmax itself, and both programs add the same aux term (their
    /// base losses differ: the combine weights are logits in one, probabilities in the
    /// other).
    #[test]
    fn a_top_k_of_logits_gets_its_probabilities_from_a_softmax() {
        use hzp_runtime::eval::evaluate;
        let x: Vec<f32> = (0..18).map(|i| ((i * 5 % 7) as f32 - 3.0) * 0.4).collect();
        let feed = [("x".to_string(), Tensor::f32(vec![6, 3], x))];
        let run = |p: &Program| evaluate(p, &feed).unwrap()[0].1.to_f32_vec()[0];
        let softmaxes = |p: &Program| p.nodes.iter().filter(|n| n.op.name() == "Softmax").count();
        let (probs, logits) = (layer(false), layer(true));
        let (a, b) = (
            attach_loss(&probs, &aux(0.5)).unwrap(),
            attach_loss(&logits, &aux(0.5)).unwrap(),
        );
        assert_eq!(softmaxes(&a), 1, "the router's own softmax is reused");
        assert_eq!(
            softmaxes(&b),
            1,
            "the aux loss adds the softmax a logit top-k lacks"
        );
        let plain = |p: &Program| run(&attach_loss(p, &LossKind::Mean).unwrap());
        let (ta, tb) = (run(&a) - plain(&probs), run(&b) - plain(&logits));
        assert!((ta - tb).abs() < 1e-6, "aux terms {ta} vs {tb}");
        assert!(ta > 1e-3, "the aux term adds nothing: {ta}");
    }
}
