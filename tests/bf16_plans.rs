//! What a bf16 sharded plan holds, against the same plan in fp32: parameters are gathered
//! in bf16 and resharded after the forward like the fp32 plan's, so the bf16 plan's arena is
//! the smaller one (its activations are half the size). A plan that kept each layer's
//! gathered bf16 weights (or a copy of them) from the forward to the backward, that copied
//! the logits in f32 for the loss more than once, or that packed its many-sized buffers
//! loosely, fails this.

mod common;
use common::*;
use std::collections::BTreeSet;

/// The plan of `precision` as `plan.json` in `dir`, and its JSON.
fn plan(dir: &std::path::Path, precision: &str) -> serde_json::Value {
    let out = dir.join(format!("{precision}.json"));
    ok(&[
        "compile",
        "preset:llama,layers=8,hidden=1024",
        "--mesh",
        "gpu=8",
        "--strategy",
        "zero3",
        "--precision",
        precision,
        "-o",
        s(&out),
    ]);
    serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap()
}

/// The layers whose parameters a plan gathers again for the backward (the units named
/// `gather.mb0.bwd.<layer>/...`).
fn regathered_layers(plan: &serde_json::Value) -> BTreeSet<String> {
    let lines = plan["program"].as_array().unwrap();
    lines
        .iter()
        .filter_map(|l| {
            let l = l.as_str()?;
            let at = l.find("gather.mb0.bwd.")? + "gather.mb0.bwd.".len();
            let rest = &l[at..];
            Some(rest[..rest.find('/')?].to_string())
        })
        .collect()
}

#[test]
fn a_bf16_zero3_plan_reshards_like_fp32_and_holds_less() {
    let d = tempdir("bf16-plans");
    let f32 = plan(&d, "fp32");
    let bf16 = plan(&d, "bf16");
    let layers: BTreeSet<String> = (0..8).map(|l| format!("model.layers.{l}")).collect();
    assert_eq!(regathered_layers(&f32), layers);
    assert_eq!(regathered_layers(&bf16), layers);
    // no bf16 copy of a weight: a parameter's cast to bf16 reads the shard or gathered copy
    // as it is
    let copies = bf16["program"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| {
            let l = l.as_str().unwrap_or("");
            l.contains("= Cast{to=bf16}(%gather.") || l.contains("= Cast{to=bf16}(%shard/")
        })
        .count();
    assert_eq!(copies, 0);
    // the loss: the logits cast to f32 once and its gradient, no f32 copy of the logits
    // shifted by a position or padded back (the shift is taken before the LM head)
    let vocab_wide_f32 = bf16["program"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| {
            let l = l.as_str().unwrap_or("");
            l.split(" : f32[").nth(1).is_some_and(|t| {
                let dims: Vec<u64> = (t.split(']').next().unwrap_or("").split(','))
                    .filter_map(|d| d.trim().parse().ok())
                    .collect();
                dims.len() == 3 && dims[2] == 128256
            })
        })
        .count();
    assert_eq!(vocab_wide_f32, 2);
    let arena = |p: &serde_json::Value| p["arena_bytes"].as_u64().unwrap();
    assert!(
        arena(&bf16) < arena(&f32),
        "bf16 arena {} bytes, fp32 {}",
        arena(&bf16),
        arena(&f32)
    );
}
