//! Attention fusion on every test model (`tests/models/`, `tests/models/extra/`,
//! `../shared/onnx/`): each self-attention layer becomes one `Attention` op, and the fused
//! program computes what the explicit one does. (The numerics against PyTorch, forward,
//! gradients and AdamW steps, are the other end-to-end tests', run with fusion on, the
//! default.)

mod common;

use common::*;
use hzp_frontends::{load_model, LoadOptions};
use hzp_ir::{Op, Program, Tensor};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Every model with its inputs: the common list plus `tests/models/extra/`.
fn models() -> Vec<(PathBuf, PathBuf)> {
    let mut all = all_models();
    let extra = own_models_dir().join("extra");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&extra)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "onnx"))
        .collect();
    files.sort();
    for f in files {
        let stem = f.file_name().unwrap().to_string_lossy().to_string();
        let io = extra.join(format!("{}.io.npz", stem.split('.').next().unwrap()));
        all.push((f, io));
    }
    all
}

fn load(model: &Path, io: &[(String, Tensor)], fuse: bool) -> Program {
    load_with(model, io, fuse, true)
}

/// [`load`] with attention fused when `fuse`, mixtures of experts routed when `route`.
fn load_with(model: &Path, io: &[(String, Tensor)], fuse: bool, route: bool) -> Program {
    let opts = LoadOptions {
        shapes: io
            .iter()
            .filter(|(k, _)| k != "torch_out")
            .map(|(k, t)| (k.clone(), t.shape.clone()))
            .collect(),
        values: io
            .iter()
            .filter(|(k, _)| k != "torch_out")
            .cloned()
            .collect(),
        no_fuse_attention: !fuse,
        no_fuse_moe: !route,
        ..Default::default()
    };
    load_model(model.to_str().unwrap(), &opts)
        .unwrap_or_else(|e| panic!("importing {}: {e}", model.display()))
}

/// The model's transformer layers, from its parameter names: the distinct indices of the
/// outermost `h.N.` / `layers.N.` / `layer.N.` / `block.N.` of each name (T5's
/// `block.N.layer.M.` counts its blocks).
fn layers(p: &Program) -> usize {
    let mut seen = BTreeSet::new();
    for prm in &p.params {
        let name = &p.value(prm.value).name;
        let parts: Vec<&str> = name.split('.').collect();
        for w in parts.windows(2) {
            if ["h", "layers", "layer", "block", "blocks"].contains(&w[0]) {
                if let Ok(i) = w[1].parse::<usize>() {
                    seen.insert(i);
                    break;
                }
            }
        }
    }
    seen.len()
}

fn count_attention(p: &Program) -> usize {
    p.nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Attention { .. }))
        .count()
}

/// Models whose attention is not scaled dot-product attention: Gemma 2 soft-caps its
/// scores (`tanh(s / cap) * cap` before the mask; config `attn_logit_softcapping`), so its
/// attention must stay explicit.
fn soft_capped(model: &Path) -> bool {
    model
        .file_name()
        .unwrap()
        .to_string_lossy()
        .starts_with("gemma2")
}

#[test]
fn every_attention_layer_is_fused() {
    for (model, io_path) in models() {
        let io = read_npz(&io_path);
        let fused = load(&model, &io, true);
        hzp_ir::verify(&fused).unwrap();
        let explicit = load(&model, &io, false);
        let n = layers(&explicit);
        assert!(n > 0, "{}: no layers found", model.display());
        let want = if soft_capped(&model) { 0 } else { n };
        assert_eq!(
            count_attention(&fused),
            want,
            "{}: fused attention ops (the model has {n} layers)",
            model.display()
        );
        assert_eq!(count_attention(&explicit), 0, "{}", model.display());
        // the fused program computes the explicit one's outputs
        let a = hzp_runtime::eval::evaluate(&explicit, &program_inputs(&explicit, &io)).unwrap();
        let b = hzp_runtime::eval::evaluate(&fused, &program_inputs(&fused, &io)).unwrap();
        assert_eq!(a.len(), b.len());
        for ((_, x), (_, y)) in a.iter().zip(&b) {
            let scale = x.to_f64_vec().iter().fold(1e-6f64, |m, v| m.max(v.abs()));
            let d = max_abs_diff(x, y);
            assert!(
                d <= 1e-5 * scale,
                "{}: fused vs explicit differ by {d} (scale {scale})",
                model.display()
            );
        }
    }
}

fn count_ops(p: &Program, name: &str) -> usize {
    p.nodes.iter().filter(|n| n.op.name() == name).count()
}

/// Gathers of whole matrices by index (each top-k choice's expert weights): `Gather` or
/// `GatherND` whose data has rank 3.
fn weight_gathers(p: &Program) -> usize {
    p.nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Gather { .. } | Op::GatherND { .. }))
        .filter(|n| p.ty(n.inputs[0]).shape.len() == 3)
        .count()
}

/// Every mixture-of-experts model (both exports of the tiny Mixtral, the extra Qwen2-MoE
/// with its shared expert) is routed on import: one `MoeDispatch` and one `MoeCombine` per
/// layer, no per-choice weight gather left; `--no-fuse-moe` keeps the gathers; both forms
/// equal PyTorch's output. A model without per-choice weight gathers has nothing routed.
/// (Gradients and AdamW steps of both forms against PyTorch: tests/training.rs.)
#[test]
fn moe_blocks_are_routed_on_import_and_match_pytorch() {
    let mut seen = Vec::new();
    for (model, io_path) in models() {
        let io = read_npz(&io_path);
        let routed = load_with(&model, &io, true, true);
        let written = load_with(&model, &io, true, false);
        assert_eq!(count_ops(&written, "MoeDispatch"), 0, "{}", model.display());
        if weight_gathers(&written) == 0 {
            assert_eq!(count_ops(&routed, "MoeDispatch"), 0, "{}", model.display());
            continue;
        }
        seen.push(model.file_name().unwrap().to_string_lossy().to_string());
        hzp_ir::verify(&routed).unwrap();
        let n = layers(&written);
        assert_eq!(weight_gathers(&written), 2 * n, "{}", model.display());
        assert_eq!(count_ops(&routed, "MoeDispatch"), n, "{}", model.display());
        assert_eq!(count_ops(&routed, "MoeCombine"), n, "{}", model.display());
        assert_eq!(weight_gathers(&routed), 0, "{}", model.display());
        let torch = &io.iter().find(|(k, _)| k == "torch_out").unwrap().1;
        for p in [&routed, &written] {
            let outs = hzp_runtime::eval::evaluate(p, &program_inputs(p, &io)).unwrap();
            let d = max_abs_diff(&outs[0].1, torch);
            assert!(d < 1e-4, "{}: max |hzp - torch| = {d}", model.display());
        }
    }
    for want in ["moe_tiny.legacy.op17.onnx", "moe_tiny.dynamo.op18.onnx"] {
        assert!(
            seen.iter().any(|s| s == want),
            "{want} not routed: {seen:?}"
        );
    }
}
