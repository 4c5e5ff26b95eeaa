//! Helpers shared by the tests of sharded steps and collective rewriting: the test models'
//! batches and imports, a bandwidth-bound cluster, a relative distance.
#![allow(dead_code)]

use hzp_frontends::{load_model, npz, LoadOptions};
use hzp_ir::{Program, Tensor};
use hzp_passes::cost::cluster::ClusterSpec;
use std::path::PathBuf;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The batch of test model `name` (`tests/models/NAME.io.npz`, without PyTorch's output)
/// repeated to `rows` rows.
pub fn batch(name: &str, rows: usize) -> Vec<(String, Tensor)> {
    let io = npz::read(&root().join(format!("tests/models/{name}.io.npz"))).unwrap();
    io.into_iter()
        .filter(|(k, _)| k != "torch_out")
        .map(|(k, t)| {
            let reps = rows / t.shape[0];
            let parts: Vec<&Tensor> = (0..reps).map(|_| &t).collect();
            let cat = hzp_runtime::cpu::eval_op(&hzp_ir::Op::Concat { axis: 0 }, &parts).unwrap();
            (k, cat.into_iter().next().unwrap())
        })
        .collect()
}

/// `batch` with the learning-rate input of a training step built with `cfg` (the rate of its
/// optimizer; none for a gradient program).
pub fn with_optimizer_lr(
    batch: Vec<(String, Tensor)>,
    cfg: &hzp_passes::train::TrainConfig,
) -> Vec<(String, Tensor)> {
    use hzp_passes::train::{Optimizer, LR_INPUT};
    match &cfg.optimizer {
        Some(
            Optimizer::AdamW { lr, .. } | Optimizer::Sgd { lr, .. } | Optimizer::Muon { lr, .. },
        ) => {
            let mut b = batch;
            b.push((LR_INPUT.to_string(), Tensor::f32(vec![], vec![*lr as f32])));
            b
        }
        None => batch,
    }
}

/// Test model `file` imported with `input_ids` of `rows` x `seq`.
pub fn import(file: &str, rows: usize, seq: usize) -> Program {
    let mut shapes = std::collections::BTreeMap::new();
    shapes.insert("input_ids".to_string(), vec![rows, seq]);
    load_model(
        root().join("tests/models").join(file).to_str().unwrap(),
        &LoadOptions {
            shapes,
            ..Default::default()
        },
    )
    .unwrap()
}

/// Collective rewriting on the 8xH100 DGX spec of `examples/clusters`, default options.
pub fn h100_rewrite() -> hzp_passes::dist::spmd::Rewrite {
    hzp_passes::dist::spmd::Rewrite {
        cluster: ClusterSpec::from_toml_str(
            include_str!("../../../examples/clusters/h100-dgx.toml"),
            "h100-dgx.toml",
        )
        .unwrap(),
        options: Default::default(),
    }
}

/// Links so slow that the bandwidth term dominates even for tiny test tensors, with the
/// slow axis (`node`) ten times slower than `gpu`; memory is fast, so local copies are cheap.
pub fn slow_cluster() -> ClusterSpec {
    ClusterSpec::from_toml_str(
        r#"
name = "slow"
mesh = "node=2,gpu=4"
devices_per_node = 4
[device]
memory = "1GiB"
peak_bf16 = "1000TFLOPS"
peak_fp32 = "1000TFLOPS"
memory_bandwidth = "1000TB/s"
[[links]]
name = "fast"
axes = ["gpu"]
bandwidth = "10MB/s"
latency = "1us"
[[links]]
name = "slow"
axes = ["node"]
bandwidth = "1MB/s"
latency = "1us"
"#,
        "slow.toml",
    )
    .unwrap()
}

/// ||a - b|| / ||b||.
pub fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
    let d: f64 = x
        .iter()
        .zip(&y)
        .map(|(p, q)| (p - q).powi(2))
        .sum::<f64>()
        .sqrt();
    let n: f64 = y.iter().map(|q| q * q).sum::<f64>().sqrt();
    d / n.max(1e-12)
}

/// Per parameter of `fwd`, which elements have a gradient on `batch` that is not round-off
/// (at least 1e-5 of the parameter's largest, above the round-off of f32 sums of a few
/// hundred terms). AdamW divides each gradient by its own
/// running RMS, so an element whose gradient is zero in exact arithmetic (an attention key
/// bias: softmax ignores a per-row constant) moves by O(lr) in a direction set by round-off,
/// differently for every summation order; such elements can only be held by a whole-model
/// check. (tests/run_e2e.rs applies the same rule to the executor.)
pub fn meaningful(
    fwd: &Program,
    cfg: &hzp_passes::train::TrainConfig,
    batch: &[(String, Tensor)],
) -> Vec<Vec<bool>> {
    let gcfg = hzp_passes::train::TrainConfig {
        optimizer: None,
        micro_batches: 1,
        ..cfg.clone()
    };
    let gp = hzp_passes::train::training_step(fwd, &gcfg).unwrap();
    let inputs: Vec<(String, Tensor)> = gp
        .inputs
        .iter()
        .map(|&v| {
            let name = &gp.value(v).name;
            batch.iter().find(|(k, _)| k == name).cloned().unwrap()
        })
        .collect();
    let outs = hzp_runtime::eval::evaluate(&gp, &inputs).unwrap();
    outs[outs.len() - fwd.params.len()..]
        .iter()
        .map(|(_, g)| {
            let g = g.to_f64_vec();
            let gmax = g.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            g.iter().map(|x| x.abs() >= 1e-5 * gmax).collect()
        })
        .collect()
}

/// ||a - b|| / ||b|| over the elements `keep` marks.
pub fn rel_masked(a: &Tensor, b: &Tensor, keep: &[bool]) -> f64 {
    let pick = |t: &Tensor| -> Vec<f32> {
        let v = t.to_f64_vec();
        (0..v.len())
            .filter(|&i| keep[i])
            .map(|i| v[i] as f32)
            .collect()
    };
    let (x, y) = (pick(a), pick(b));
    rel(
        &Tensor::f32(vec![x.len()], x),
        &Tensor::f32(vec![y.len()], y),
    )
}

/// The group of the mesh axes `axes`, in that order.
pub fn g(axes: &[&str]) -> hzp_ir::Group {
    hzp_ir::Group::new(axes.iter().copied())
}

/// An f32 LM training step with SGD (momentum 0.9, lr 0.1) or default AdamW, clipping to
/// `clip` when given. (AdamW hardly sees a wrong gradient scale, m / sqrt(v) cancels it; SGD
/// does.)
pub fn train_cfg(clip: Option<f64>, sgd: bool) -> hzp_passes::train::TrainConfig {
    use hzp_passes::train::{LossKind, Optimizer, TrainConfig};
    TrainConfig {
        loss: LossKind::Lm { labels: None },
        optimizer: Some(if sgd {
            Optimizer::Sgd {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.0,
            }
        } else {
            Optimizer::adamw_default()
        }),
        clip_grad_norm: clip,
        micro_batches: 1,
        compute: hzp_ir::DType::F32,
    }
}

/// `preset:moe-tiny` (4 experts, top 2) at `rows` sequences of 16 tokens, settings `extra`
/// (e.g. `,capacity_factor=0.5`) appended, with parameters from a fixed generator seeded by
/// each parameter's name (the preset has shapes only).
pub fn seeded_moe_tiny(rows: usize, extra: &str) -> Program {
    let mut p =
        hzp_frontends::presets::parse_preset(&format!("preset:moe-tiny,batch={rows}{extra}"))
            .unwrap();
    for prm in &mut p.params {
        let v = &p.values[prm.value.index()];
        let mut s = v
            .name
            .bytes()
            .fold(7u64, |h, b| h.wrapping_mul(31) ^ b as u64)
            | 1;
        let d = (0..v.ty.numel())
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.6
            })
            .collect();
        prm.data = Some(Tensor::f32(v.ty.shape.clone(), d));
    }
    p
}
