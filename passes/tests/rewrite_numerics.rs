//! Collective rewriting on real sharded training steps: the rewritten per-rank program, run
//! on every rank by the lockstep reference runner, trains to the same parameters as the
//! program before rewriting (exact rules: 1e-6 relative; bf16 reductions: a loose bound).

mod sharded_common;
use hzp_ir::{DType, Mesh, Program, Tensor};
use hzp_passes::cost::cluster::ClusterSpec;
use hzp_passes::dist::rewrite::{rewrite_collectives, RewriteOptions, RewriteReport};
use hzp_passes::dist::spmd::{shard_training_step, ShardGroups, ShardedStep};
use hzp_passes::train::{training_step, LossKind, Optimizer, TrainConfig};
use hzp_runtime::reference::ReferenceRunner;
use hzp_runtime::train::Trainer;
use sharded_common::{batch, g, import, rel, root, slow_cluster, with_optimizer_lr};
use std::collections::BTreeMap;

const FILE: &str = "llama_tiny.legacy.op17.onnx";
const ROWS: usize = 8;

fn cfg(compute: DType) -> TrainConfig {
    TrainConfig {
        loss: LossKind::Lm { labels: None },
        optimizer: Some(Optimizer::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        }),
        clip_grad_norm: Some(0.5),
        micro_batches: 1,
        compute,
    }
}

fn train(
    step: &ShardedStep,
    program: &Program,
    init: &[(String, Tensor)],
) -> Vec<(String, Tensor)> {
    let global = with_optimizer_lr(batch("llama_tiny", ROWS), &cfg(DType::F32));
    let mut r = ReferenceRunner::new(program, &step.layouts, init).unwrap();
    for _ in 0..3 {
        r.step(&global).unwrap();
    }
    r.full_parameters()
}

/// Rewrites the sharded step and checks training matches; returns the report.
fn check(
    mesh: &str,
    spec: ShardGroups,
    compute: DType,
    cluster: &ClusterSpec,
    opts: &RewriteOptions,
    tol: f64,
) -> RewriteReport {
    let mesh = Mesh::parse(mesh).unwrap();
    let w = mesh.world_size();
    let single = training_step(&import(FILE, ROWS, 16), &cfg(compute)).unwrap();
    let init = Trainer::new(&single).unwrap().parameters();
    let step =
        shard_training_step(&import(FILE, ROWS / w, 16), &cfg(compute), &mesh, &spec).unwrap();
    let (q, rep) = rewrite_collectives(&step.program, &mesh, cluster, opts).unwrap();
    hzp_ir::verify(&q).unwrap();
    let (q2, _) = rewrite_collectives(&step.program, &mesh, cluster, opts).unwrap();
    assert_eq!(
        hzp_ir::text::print(&q),
        hzp_ir::text::print(&q2),
        "not deterministic"
    );
    let want = train(&step, &step.program, &init);
    let got = train(&step, &q, &init);
    for ((n, a), (_, b)) in want.iter().zip(&got) {
        let e = rel(b, a);
        assert!(e < tol, "{mesh} {spec:?}: `{n}` differs by {e:.3e}\n{rep}");
    }
    rep
}

fn spec(p: &[&str], gr: &[&str], o: &[&str]) -> ShardGroups {
    ShardGroups {
        params: g(p),
        grads: g(gr),
        optim: g(o),
    }
}

#[test]
fn rewritten_steps_train_like_the_originals() {
    let slow = slow_cluster();
    let h100 = ClusterSpec::load(root().join("examples/clusters/h100-dgx.toml")).unwrap();
    let exact = RewriteOptions::default();
    let mut fired: BTreeMap<String, usize> = BTreeMap::new();
    let cases = [
        ("gpu=4", spec(&["gpu"], &["gpu"], &["gpu"])),
        (
            "node=2,gpu=4",
            spec(&["node", "gpu"], &["node", "gpu"], &["node", "gpu"]),
        ),
        ("node=2,gpu=4", spec(&["gpu"], &["gpu"], &["node", "gpu"])),
        ("node=2,gpu=4", spec(&[], &[], &[])),
    ];
    for (mesh, s) in cases {
        for cluster in [&slow, &h100] {
            let rep = check(mesh, s.clone(), DType::F32, cluster, &exact, 1e-6);
            assert!(rep.after.seconds <= rep.before.seconds, "{rep}");
            for (r, n) in rep.rules {
                *fired.entry(r).or_default() += n;
            }
        }
    }
    for rule in ["bucket", "decompose", "hierarchical_allreduce"] {
        assert!(
            fired.get(rule).copied().unwrap_or(0) > 0,
            "{rule}: {fired:?}"
        );
    }
}

#[test]
fn bf16_reductions_stay_close() {
    let opts = RewriteOptions {
        reduce_dtype: Some(DType::BF16),
        ..Default::default()
    };
    let rep = check(
        "node=2,gpu=4",
        spec(&["gpu"], &["gpu"], &["node", "gpu"]),
        DType::BF16,
        &slow_cluster(),
        &opts,
        2e-2,
    );
    assert!(rep.rule("reduce_dtype") > 0, "{rep}");
    assert!(rep.after.seconds < rep.before.seconds, "{rep}");
}
