//! The cuBLASLt epilogue choice per matrix product (`runtime/src/cuda/epilogue.rs`) on the
//! tiny GPT-2's one-rank training plans (fp32 and bf16): the report must equal the recorded
//! expectation in `runtime/tests/snapshots/` (`HZP_BLESS=1 cargo test --test cuda_epilogues`
//! rewrites it after a deliberate change; read the diff), and the choices must hold what the
//! module promises whatever the snapshot says: every MLP's first product takes its bias and
//! tanh GELU with the pre-activation kept, the second its bias, the GELU's backward product
//! its derivative and the bias gradient below, and no node is absorbed twice.

mod common;
use common::*;
use hzp_ir::{Op, Plan, UnaryOp};
use hzp_runtime::cuda::epilogue::{self, Epilogue};

fn compile_plan(tag: &str, extra: &[&str]) -> Plan {
    let dir = tempdir(tag);
    let out = dir.join("plan.json");
    let mut args = vec![
        "compile",
        "tests/models/gpt2_tiny.legacy.op17.onnx",
        "--mesh",
        "gpu=1",
        "--no-fuse-attention",
        "--retie",
        "--shape",
        "input_ids=4x16",
        "-o",
        s(&out),
    ];
    args.extend(extra);
    let (code, o, e) = hzp(&args);
    assert_eq!(code, 0, "{o}{e}");
    Plan::from_json(&std::fs::read_to_string(&out).unwrap(), "plan.json").unwrap()
}

fn check_snapshot(file: &str, got: &str) {
    let path = repo().join("runtime/tests/snapshots").join(file);
    if std::env::var_os("HZP_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, got).unwrap();
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run `HZP_BLESS=1 cargo test --test cuda_epilogues` to record it)",
            path.display()
        )
    });
    assert!(
        want == got,
        "{} differs from the choice now (HZP_BLESS=1 rewrites it):\n--- recorded\n{want}\n--- now\n{got}",
        path.display()
    );
}

/// What the module promises on a GPT-2 plan, independent of the snapshot. `fp32`: the f32
/// plan, where every MLP's c_fc takes bias + GELU, c_attn and both c_proj their bias, the
/// GELU's backward product its derivative and c_fc's bias gradient, the other weight
/// gradients their bias gradient. The bf16 plan fuses nothing, each for a named reason: its
/// bf16 copy of a bias is cast after the product, its bias gradient is cast to f32 before the
/// weight gradient's product, and its GELU is written out as elementwise ops.
fn check_promises(plan: &Plan, fp32: bool) -> Vec<epilogue::Choice> {
    let p = &plan.program;
    let low = hzp_runtime::cuda::lower::lower_program(plan, 0).unwrap();
    let choices = epilogue::choose(p, Some(&low.loc));
    let matmuls = p
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::MatMul))
        .count();
    assert_eq!(choices.len(), matmuls);
    let mut seen = std::collections::HashSet::new();
    for c in &choices {
        for &a in &c.absorbs {
            assert!(seen.insert(a), "node {a} absorbed twice");
        }
    }
    let with = |e: Epilogue| choices.iter().filter(|c| c.epilogue == e).count();
    let gelus = p
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Unary(UnaryOp::GeluTanh)))
        .count();
    let layers = 2;
    if fp32 {
        assert_eq!(gelus, layers);
        // c_fc: bias + GELU; c_attn, attn c_proj, mlp c_proj: bias
        assert_eq!(with(Epilogue::GeluAuxBias), layers, "{choices:#?}");
        assert_eq!(with(Epilogue::Bias), 3 * layers, "{choices:#?}");
        // the backward of each GELU: its derivative and c_fc's bias gradient
        assert_eq!(with(Epilogue::DgeluBgrad), layers, "{choices:#?}");
        // the other three linear layers' weight gradients take their bias gradient
        assert_eq!(with(Epilogue::BgradA), 3 * layers, "{choices:#?}");
    } else {
        assert_eq!(gelus, 0);
        assert_eq!(with(Epilogue::Default), choices.len(), "{choices:#?}");
        // the 8 forward products with a bias and the 8 weight gradients: each says why
        let said = |what: &str| {
            choices
                .iter()
                .filter(|c| c.why_not.iter().any(|w| w.contains(what)))
                .count()
        };
        assert_eq!(
            said("is computed after the product"),
            4 * layers,
            "{choices:#?}"
        );
        assert_eq!(said("before the product runs"), 4 * layers, "{choices:#?}");
    }
    for c in &choices {
        let n = &p.nodes[c.node];
        match c.epilogue {
            Epilogue::GeluAuxBias => {
                // the aux is the pre-activation GeluTanhGrad reads (through views)
                let aux = c.aux.expect("an aux");
                assert_eq!(p.nodes[c.absorbs[0]].inputs[0], n.outputs[0]);
                assert_eq!(p.nodes[c.absorbs[0]].outputs[0], aux);
            }
            Epilogue::DgeluBgrad => {
                assert!(matches!(p.nodes[c.absorbs[0]].op, Op::GeluTanhGrad));
                assert!(matches!(p.nodes[c.absorbs[1]].op, Op::Reduce { .. }));
                // the aux it reads is one a forward product keeps
                assert!(choices
                    .iter()
                    .any(|f| f.epilogue == Epilogue::GeluAuxBias && f.aux == c.aux));
            }
            _ => {}
        }
        // every absorbed node runs after the product: the call takes the product's place
        for &a in &c.absorbs {
            if !matches!(p.nodes[a].op, Op::Reduce { .. }) {
                assert!(a > c.node, "{} absorbs an earlier node", n.name);
            }
        }
    }
    choices
}

#[test]
fn gpt2_tiny_epilogues_match_the_recorded_choice() {
    let plan = compile_plan("epi-f32", &[]);
    let choices = check_promises(&plan, true);
    let report = epilogue::report(&plan.program, &choices);
    check_snapshot("cublaslt_epilogues_gpt2_tiny.txt", &report);
}

#[test]
fn gpt2_tiny_bf16_epilogues_match_the_recorded_choice() {
    let plan = compile_plan("epi-bf16", &["--precision", "bf16"]);
    let choices = check_promises(&plan, false);
    let report = epilogue::report(&plan.program, &choices);
    check_snapshot("cublaslt_epilogues_gpt2_tiny_bf16.txt", &report);
}

/// A second reader of the product's result, or of the GELU's pre-activation, keeps the
/// neighbour apart, with the reason named.
#[test]
fn a_second_reader_keeps_the_neighbour_apart() {
    let plan = compile_plan("epi-reader", &[]);
    let mut p = plan.program.clone();
    let before = epilogue::choose(&p, None);
    let gelu = before
        .iter()
        .find(|c| c.epilogue == Epilogue::GeluAuxBias)
        .unwrap()
        .clone();
    // make the loss read the product's raw result too: a second reader of it
    let y = p.nodes[gelu.node].outputs[0];
    p.outputs.push(y);
    let after = epilogue::choose(&p, None);
    let c = after.iter().find(|c| c.node == gelu.node).unwrap();
    assert_eq!(c.epilogue, Epilogue::Default, "{c:?}");
    // the pre-activation read by another node: the bias stays, the GELU does not
    let mut p = plan.program.clone();
    let pre = p.nodes[gelu.absorbs[0]].outputs[0];
    // (a copy of a GELU node turned into an Exp of the pre-activation, at the end)
    let k = p
        .nodes
        .iter()
        .position(|n| matches!(n.op, Op::Unary(UnaryOp::GeluTanh)))
        .unwrap();
    let mut extra = p.nodes[k].clone();
    extra.inputs[0] = pre;
    extra.op = Op::Unary(UnaryOp::Exp);
    p.nodes.push(extra);
    let after = epilogue::choose(&p, None);
    let c = after.iter().find(|c| c.node == gelu.node).unwrap();
    assert_eq!(c.epilogue, Epilogue::Bias, "{c:?}");
    assert!(
        c.why_not.iter().any(|w| w.contains("another reader")),
        "{c:?}"
    );
}
