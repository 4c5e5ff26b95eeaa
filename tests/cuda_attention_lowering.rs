//! Issue 16's CUDA attention kernels, as far as a machine without a GPU can check them: with
//! `HZP_CUDA_ATTENTION=1`, plans with the fused `Attention` op (GPT-2 with its causal mask,
//! Llama with grouped-query heads, BERT with a padding mask) lower for the CUDA backend, each
//! fused node to the launches of kernels the sources define (`attn_fwd`, then `attn_dq` and
//! `attn_dkv` for the gradient) with the operands the kernels take. The kernels themselves
//! compile with NVRTC in `runtime/tests/cuda_kernels.rs`; their numbers are checked on a GPU
//! by `examples/device/multi_rank_check.sh` (PART=attn). Without the variable the lowering
//! refuses such plans (`tests/cli_launch.rs`). This file is its own test binary, so setting
//! the variable here affects no other test. With `--attention pasa` (an explicit
//! `LowerOptions`, independent of the variable) an fp16 plan's forward attention lowers to
//! PASA's `attn_fwd_pasa_f16` and its gradient to the f16 `attn_dq` / `attn_dkv`; a plan
//! whose attention is not fp16 is refused naming `--precision fp16`.

mod common;
use common::*;
use hzp_ir::{Op, Plan};
use hzp_runtime::cuda::lower::{self, Arg, Work};

/// The dimension arguments every attention kernel starts with (`AT_DIM_PARAMS`).
const DIM_ARGS: usize = 13;

fn compile(model: &str, shape: &str, mesh: &str) -> Plan {
    compile_with(model, shape, mesh, &[])
}

fn compile_with(model: &str, shape: &str, mesh: &str, extra: &[&str]) -> Plan {
    let dir = std::env::temp_dir().join(format!("hzp-cuda-attn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join(format!(
        "{}{}.json",
        model.replace('/', "_"),
        extra.join("")
    ));
    let o = std::process::Command::new(hzp_bin())
        .current_dir(repo())
        .args(["compile", model])
        // (a preset sets its own shapes)
        .args(if shape.is_empty() {
            vec![]
        } else {
            vec!["--shape", shape]
        })
        .args(["--mesh", mesh, "--memory", "1GiB", "-o"])
        .arg(&out)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{model}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Plan::from_json(&std::fs::read_to_string(&out).unwrap(), "plan.json").unwrap()
}

#[test]
fn fused_attention_lowers_to_the_attention_kernels() {
    // (this test binary has this one test: nothing else reads the environment concurrently)
    std::env::set_var("HZP_CUDA_ATTENTION", "1");
    let names = hzp_runtime::cuda::kernels::kernel_names();
    let mut seen = [0usize; 3];
    for (model, shape, mesh) in [
        (
            "tests/models/gpt2_tiny.dynamo.op18.onnx",
            "input_ids=4x16",
            "gpu=2",
        ),
        (
            "tests/models/llama_tiny.legacy.op17.onnx",
            "input_ids=4x16",
            "gpu=2",
        ),
        (
            "tests/models/bert_tiny.dynamo.op18.onnx",
            "input_ids=2x16,attention_mask=2x16,token_type_ids=2x16",
            "gpu=1",
        ),
    ] {
        let plan = compile(model, shape, mesh);
        let p = &plan.program;
        let fused = p
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Attention { .. } | Op::AttentionGrad { .. }))
            .count();
        assert!(fused >= 2, "{model}: {fused} fused attention nodes");
        let low = lower::lower_program(&plan, 0).unwrap_or_else(|e| panic!("{model}: {e}"));
        for (nw, node) in low.nodes.iter().zip(&p.nodes) {
            let grad = match node.op {
                Op::Attention { .. } => false,
                Op::AttentionGrad { .. } => true,
                _ => continue,
            };
            let launches: Vec<_> = nw
                .work
                .iter()
                .map(|w| match w {
                    Work::Kernel(l) => l,
                    other => panic!("{model}: `{}` lowers to {other:?}", node.name),
                })
                .collect();
            let want: &[&str] = if grad {
                &["attn_dq", "attn_dkv"]
            } else {
                &["attn_fwd"]
            };
            assert_eq!(launches.len(), want.len(), "{model}: `{}`", node.name);
            let q = p.ty(node.inputs[0]);
            let masked = node.inputs.len() == if grad { 7 } else { 4 };
            for (l, w) in launches.iter().zip(want) {
                assert!(names.contains(&l.kernel), "{model}: no kernel {}", l.kernel);
                assert!(l.kernel.starts_with(w), "{} is not {w}", l.kernel);
                let ptrs = match *w {
                    "attn_fwd" => 6,
                    "attn_dq" => 8,
                    _ => 9,
                };
                assert_eq!(l.args.len(), DIM_ARGS + ptrs, "{}", l.kernel);
                // the dimensions (B, HQ, HKV, T, S, D, DV) hold q's [B, HQ, T, D]
                let dims: Vec<i64> = [0, 1, 3, 5]
                    .iter()
                    .map(|&k| match &l.args[k] {
                        Arg::I64(v) => *v,
                        other => panic!("{other:?}"),
                    })
                    .collect();
                let want_dims: Vec<i64> = q.shape.iter().map(|&d| d as i64).collect();
                assert_eq!(dims, want_dims, "{model}: `{}`", node.name);
                // the mask operand: a pointer when the node has a mask, else null
                let mask = &l.args[DIM_ARGS + if grad { 6 } else { 3 }];
                assert_eq!(matches!(mask, Arg::Ptr(_)), masked, "{model}: {mask:?}");
                assert!(l.block > 0 && l.grid > 0);
            }
            seen[grad as usize] += 1;
            seen[2] += masked as usize;
        }
    }
    assert!(
        seen[0] >= 3 && seen[1] >= 3,
        "forward / gradient nodes lowered: {seen:?}"
    );
    assert!(seen[2] >= 1, "no masked attention was lowered: {seen:?}");
}

#[test]
fn pasa_lowers_fp16_attention_and_refuses_other_precisions() {
    use lower::{CudaAttention, LowerOptions};
    let names = hzp_runtime::cuda::kernels::kernel_names();
    assert!(names.iter().any(|k| k == "attn_fwd_pasa_f16"));
    let pasa = LowerOptions {
        attention: CudaAttention::Pasa,
        ..LowerOptions::default()
    };
    let model = "tests/models/gpt2_tiny.dynamo.op18.onnx";
    let plan = compile_with(model, "input_ids=4x16", "gpu=1", &["--precision", "fp16"]);
    let low = lower::lower_program_with(&plan, 0, pasa).unwrap_or_else(|e| panic!("{e}"));
    let (mut fwd, mut grad) = (0, 0);
    for (nw, node) in low.nodes.iter().zip(&plan.program.nodes) {
        let is_grad = match node.op {
            Op::Attention { .. } => false,
            Op::AttentionGrad { .. } => true,
            _ => continue,
        };
        assert_eq!(plan.program.ty(node.inputs[0]).dtype, hzp_ir::DType::F16);
        let kernels: Vec<(&str, &[Arg])> = nw
            .work
            .iter()
            .map(|w| match w {
                Work::Kernel(l) => (l.kernel.as_str(), l.args.as_slice()),
                other => panic!("`{}` lowers to {other:?}", node.name),
            })
            .collect();
        for (k, _) in &kernels {
            assert!(names.iter().any(|n| n == k), "no kernel {k}");
        }
        if is_grad {
            let ks: Vec<&str> = kernels.iter().map(|k| k.0).collect();
            assert_eq!(ks, ["attn_dq_f16", "attn_dkv_f16"], "`{}`", node.name);
            grad += 1;
        } else {
            assert_eq!(kernels.len(), 1);
            let (k, args) = kernels[0];
            assert_eq!(k, "attn_fwd_pasa_f16");
            // the dimensions, beta, then q, k, v, mask, o, lse
            assert_eq!(args.len(), DIM_ARGS + 1 + 6);
            assert_eq!(args[DIM_ARGS], Arg::F32(lower::PASA_BETA));
            assert!(matches!(args[DIM_ARGS + 1], Arg::Ptr(_)));
            fwd += 1;
        }
    }
    assert!(fwd >= 2 && grad >= 2, "forward {fwd}, gradient {grad}");
    // the same model in fp32 and bf16: refused, naming the flag
    for precision in ["fp32", "bf16"] {
        let plan = compile_with(
            model,
            "input_ids=4x16",
            "gpu=1",
            &["--precision", precision],
        );
        match lower::lower_program_with(&plan, 0, pasa) {
            Ok(_) => panic!("--attention pasa lowered a {precision} plan"),
            Err(e) => assert!(e.contains("--precision fp16"), "{e}"),
        }
    }
    // and no choice: refused, naming the options
    let off = LowerOptions {
        attention: CudaAttention::Off,
        ..LowerOptions::default()
    };
    match lower::lower_program_with(&plan, 0, off) {
        Ok(_) => panic!("fused attention lowered without --attention"),
        Err(e) => assert!(
            e.contains("--attention pasa") && e.contains("--no-fuse-attention"),
            "{e}"
        ),
    }
}

/// Routed mixture-of-experts plans lower for the CUDA backend: the preset (f32 and bf16)
/// and the tiny ONNX MoE model routed on import (both exporters), every node accepted, each
/// MoE node on the `moe_*` kernels the sources define (what those compute:
/// `runtime/tests/cuda_moe.rs`).
#[test]
fn routed_moe_plans_lower_to_the_moe_kernels() {
    let names = hzp_runtime::cuda::kernels::kernel_names();
    for (model, shape, extra) in [
        (
            "preset:moe-tiny",
            "",
            &["--no-fuse-attention", "--precision", "f32"][..],
        ),
        (
            "preset:moe-tiny",
            "",
            &["--no-fuse-attention", "--precision", "bf16"][..],
        ),
        (
            "tests/models/moe_tiny.legacy.op17.onnx",
            "input_ids=4x16",
            &["--no-fuse-attention"][..],
        ),
        (
            "tests/models/moe_tiny.dynamo.op18.onnx",
            "input_ids=4x16",
            &["--no-fuse-attention", "--precision", "bf16"][..],
        ),
    ] {
        let plan = compile_with(model, shape, "gpu=1", extra);
        let p = &plan.program;
        let low = lower::lower_program(&plan, 0).unwrap_or_else(|e| panic!("{model}: {e}"));
        let mut seen = [0usize; 3];
        for nw in &low.nodes {
            let which = match &p.nodes[nw.node].op {
                Op::MoeDispatch { .. } => 0,
                Op::MoeCombine => 1,
                Op::MoeCombineGrad => 2,
                _ => continue,
            };
            seen[which] += 1;
            let kernels: Vec<&str> = nw
                .work
                .iter()
                .map(|w| match w {
                    Work::Kernel(l) => l.kernel.as_str(),
                    other => panic!("{model}: node `{}`: {other:?}", nw.name),
                })
                .collect();
            assert!(!kernels.is_empty(), "{model}: node `{}`", nw.name);
            for k in &kernels {
                assert!(
                    k.starts_with("moe_") && names.iter().any(|n| n == k),
                    "{model}: node `{}` launches {k}",
                    nw.name
                );
            }
        }
        assert!(
            seen.iter().all(|&n| n > 0),
            "{model}: dispatch, combine, combine-gradient nodes: {seen:?}"
        );
    }
}
