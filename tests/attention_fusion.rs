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
