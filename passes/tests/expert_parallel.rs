//! Expert parallelism against one rank: a routed MoE whose experts are split over the ranks
//! of some mesh axes (`AllToAll` around the experts, expert weights sharded over the other
//! axes) trains exactly as one rank running the same micro-batches one after another.

mod sharded_common;
use hzp_ir::{Mesh, Op, Program, Tensor};
use hzp_passes::dist::spmd::{shard_training_step_rewritten, ScheduleOptions, ShardGroups};
use hzp_passes::train::{training_step, TrainConfig};
use hzp_runtime::reference::ReferenceRunner;
use hzp_runtime::train::Trainer;
use sharded_common::{g, h100_rewrite, rel, with_optimizer_lr};

use sharded_common::seeded_moe_tiny as moe;

fn cfg(sgd: bool, clip: Option<f64>) -> TrainConfig {
    sharded_common::train_cfg(clip, sgd)
}

struct Case<'a> {
    /// The model at `rows` sequences per rank (`None`: [`moe`] with `extra`).
    model: Option<&'a dyn Fn(usize) -> Program>,
    mesh: &'a str,
    /// Sequences per rank.
    per_rank: usize,
    spec: ShardGroups,
    experts_over: &'a [&'a str],
    /// Preset settings after the batch (`,capacity_factor=0.5`).
    extra: &'a str,
    sgd: bool,
    clip: Option<f64>,
    rewrite: bool,
    /// Micro-batches per rank, and the schedule's other knobs.
    micro: usize,
    sched: ScheduleOptions,
}

/// Runs the case for 5 steps on every rank (the lockstep reference runner) and on one rank
/// over the same micro-batches; returns the expert-parallel step for further checks.
fn matches_one_rank(c: &Case) -> hzp_passes::dist::spmd::ShardedStep {
    let mesh = Mesh::parse(c.mesh).unwrap();
    let w = mesh.world_size();
    let m = c.micro.max(1);
    let rows = c.per_rank * w * m;
    let ids: Vec<i64> = (0..rows * 16).map(|i| (i * 37 % 251) as i64).collect();
    let cfg = TrainConfig {
        micro_batches: m,
        ..cfg(c.sgd, c.clip)
    };
    let global = with_optimizer_lr(
        vec![("input_ids".to_string(), Tensor::i64(vec![rows, 16], ids))],
        &cfg,
    );
    let single_cfg = TrainConfig {
        micro_batches: w * m,
        ..cfg.clone()
    };
    let model = |rows: usize| match c.model {
        Some(f) => f(rows),
        None => moe(rows, c.extra),
    };
    let single = training_step(&model(c.per_rank), &single_cfg).unwrap();
    let mut t = Trainer::new(&single).unwrap();
    let init = t.parameters();
    let sched = ScheduleOptions {
        expert_parallel: Some(g(c.experts_over)),
        ..c.sched.clone()
    };
    let rewrite = h100_rewrite();
    let step = shard_training_step_rewritten(
        &model(c.per_rank),
        &cfg,
        &mesh,
        &c.spec,
        &sched,
        c.rewrite.then_some(&rewrite),
        &mut |_, _| {},
    )
    .unwrap();
    let mut r = ReferenceRunner::new(&step.program, &step.layouts, &init).unwrap();
    for s in 0..5 {
        let a = t.step(&global).unwrap();
        let b = r.step(&global).unwrap();
        let (la, lb) = (a[0].1.to_f64_vec()[0], b[0].1.to_f64_vec()[0]);
        assert!(
            (la - lb).abs() <= 1e-5 * la.abs(),
            "{} step {s}: loss {lb} vs one rank's {la}",
            c.mesh
        );
    }
    for ((n, a), (m, b)) in t.parameters().iter().zip(&r.full_parameters()) {
        assert_eq!(n, m);
        let e = rel(b, a);
        assert!(e < 1e-5, "{}: `{n}` differs by {e:.3e} relative", c.mesh);
    }
    step
}

/// A case with the defaults: `preset:moe-tiny` dropless, one sequence and one micro-batch per
/// rank, AdamW without clipping, no rewriting, the default schedule.
fn case<'a>(mesh: &'a str, spec: ShardGroups, experts_over: &'a [&'a str]) -> Case<'a> {
    Case {
        model: None,
        mesh,
        per_rank: 1,
        spec,
        experts_over,
        extra: "",
        sgd: false,
        clip: None,
        rewrite: false,
        micro: 1,
        sched: ScheduleOptions::default(),
    }
}

fn zero3(axes: &[&str]) -> ShardGroups {
    ShardGroups {
        params: g(axes),
        grads: g(axes),
        optim: g(axes),
    }
}

#[test]
fn experts_over_four_gpus_match_one_rank_dropless() {
    let step = matches_one_rank(&case("gpu=4", zero3(&["gpu"]), &["gpu"]));
    let q = &step.program;
    // two routed layers, two exchanges each way in the forward and two in the backward
    let a2a = q
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::AllToAll { .. }) && n.role.kind != hzp_ir::RoleKind::Reduce)
        .count();
    assert_eq!(a2a, 8, "AllToAll nodes around the experts");
    let split = step.experts.as_ref().unwrap();
    assert_eq!(split.size, 4);
    // each rank keeps one expert: its master shard of a stacked weight is 1/4 of it, not
    // sharded again (P, G and O are the expert-parallel axis itself)
    for (name, shape) in &split.params {
        assert_eq!(shape[0], 4, "`{name}` is stacked over the 4 experts");
        let l = step.layouts.iter().find(|l| &l.name == name).unwrap();
        assert_eq!(l.shape, *shape);
        let master = q
            .params
            .iter()
            .find(|p| &q.value(p.value).name == name)
            .unwrap();
        assert_eq!(
            q.ty(master.value).numel() * 4,
            l.numel,
            "`{name}`'s master shard"
        );
    }
}

#[test]
fn experts_over_gpu_on_two_nodes_match_one_rank_with_clipping() {
    matches_one_rank(&Case {
        clip: Some(0.05),
        ..case("node=2,gpu=2", zero3(&["node", "gpu"]), &["gpu"])
    });
}

#[test]
fn experts_over_gpu_with_hierarchical_groups_and_rewriting_match_one_rank() {
    // AsyncHZP's shape: parameters and gradients inside a node, optimizer states over all
    matches_one_rank(&Case {
        per_rank: 2,
        sgd: true,
        rewrite: true,
        ..case(
            "node=2,gpu=2",
            ShardGroups {
                params: g(&["gpu"]),
                grads: g(&["gpu"]),
                optim: g(&["node", "gpu"]),
            },
            &["gpu"],
        )
    });
}

#[test]
fn experts_over_both_axes_with_drops_match_one_rank() {
    // a capacity factor drops choices: the drops belong to each rank's micro-batch, so N
    // expert-parallel ranks drop what one rank drops on the same micro-batches
    matches_one_rank(&Case {
        extra: ",capacity_factor=0.5",
        sgd: true,
        ..case(
            "node=2,gpu=2",
            ShardGroups {
                params: g(&["gpu"]),
                grads: g(&["node", "gpu"]),
                optim: g(&["node", "gpu"]),
            },
            &["node", "gpu"],
        )
    });
}

#[test]
fn experts_split_with_micro_batches_recompute_and_per_step_reduction_match_one_rank() {
    // two micro-batches per rank: each one's exchanges are its own; the recomputed forward
    // exchanges again; gradients reduced once per step
    for (recompute, reduce_grads) in [
        (true, hzp_passes::dist::spmd::ReduceGrads::PerMicrobatch),
        (false, hzp_passes::dist::spmd::ReduceGrads::PerStep),
    ] {
        matches_one_rank(&Case {
            micro: 2,
            sched: ScheduleOptions {
                recompute,
                reduce_grads,
                ..ScheduleOptions::default()
            },
            ..case("node=2,gpu=2", zero3(&["node", "gpu"]), &["gpu"])
        });
    }
}

#[test]
fn both_exporters_moe_models_split_their_experts_and_match_one_rank() {
    // transformers' Mixtral as each exporter wrote it, routed on import: the stacked
    // expert weights are found from the ops, not their names
    for file in ["moe_tiny.legacy.op17.onnx", "moe_tiny.dynamo.op18.onnx"] {
        let imported = |rows: usize| sharded_common::import(file, rows, 16);
        let step = matches_one_rank(&Case {
            model: Some(&imported),
            ..case("node=2,gpu=2", zero3(&["node", "gpu"]), &["gpu"])
        });
        let split = step.experts.unwrap();
        assert_eq!(split.layers.len(), 2, "{file}: routed layers");
        // two stacked weights per layer (gate-up and down), 4 experts each
        assert_eq!(split.params.len(), 4, "{file}: {:?}", split.params);
        assert!(split.params.values().all(|s| s[0] == 4), "{file}");
    }
}

#[test]
fn expert_parallelism_refuses_what_it_cannot_split() {
    let mesh = Mesh::parse("gpu=8").unwrap();
    let run = |fwd: &Program, axes: &[&str]| {
        shard_training_step_rewritten(
            fwd,
            &cfg(false, None),
            &mesh,
            &zero3(&["gpu"]),
            &ScheduleOptions {
                expert_parallel: Some(g(axes)),
                ..ScheduleOptions::default()
            },
            None,
            &mut |_, _| {},
        )
        .map(|_| ())
        .unwrap_err()
        .to_string()
    };
    // 4 experts do not split over 8 ranks
    let e = run(&moe(1, ""), &["gpu"]);
    assert!(
        e.contains("4 experts") && e.contains("do not divide"),
        "{e}"
    );
    // the dense form has no routed layer
    let e = run(&moe(1, ",dense=true"), &["gpu"]);
    assert!(e.contains("no routed MoE layer"), "{e}");
    // an axis the mesh lacks
    let e = run(&moe(1, ""), &["node"]);
    assert!(e.contains("`node` is not in the mesh"), "{e}");
}

#[test]
fn experts_over_nodes_outside_the_shard_groups_match_one_rank() {
    // ZeRO-3 inside each node, the experts split across nodes: a dense weight's gradient is
    // all-reduced over the nodes, an expert weight's is not (each node holds other experts)
    matches_one_rank(&Case {
        sgd: true,
        ..case("node=2,gpu=2", zero3(&["gpu"]), &["node"])
    });
}

#[test]
fn the_cost_model_charges_split_experts_their_filled_rows() {
    // dropless: each expert's buffer is mostly empty rows; the exchanges move whole rows,
    // so the products after them are charged the same share of filled rows as one rank's
    use hzp_passes::cost::moe::filled_fractions;
    let fwd = moe(2, "");
    let mesh = Mesh::parse("gpu=4").unwrap();
    let (split, _) =
        hzp_passes::dist::expert::expert_parallel_forward(&fwd, &mesh, &g(&["gpu"])).unwrap();
    let products = |p: &Program| -> Vec<f64> {
        let f = filled_fractions(p);
        let mut v: Vec<f64> = p
            .nodes
            .iter()
            .zip(&f)
            .filter(|(n, _)| matches!(n.op, Op::MatMul))
            .map(|(_, &x)| x)
            .filter(|&x| x < 1.0)
            .collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let (one, ep) = (products(&fwd), products(&split));
    // two layers, two expert products each; 32 tokens, top 2 of 4 experts: 16 of 32 rows
    assert_eq!(one, vec![0.5; 4]);
    assert_eq!(ep, one);
}
