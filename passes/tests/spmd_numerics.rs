//! Sharded training steps against the unsharded one: for several meshes and shard groups,
//! 5 AdamW steps of the per-rank program on every rank (the lockstep reference runner) give
//! the same parameters as one rank training on the whole batch.

mod sharded_common;
use hzp_ir::Mesh;
use hzp_passes::dist::spmd::ReduceGrads;
use hzp_passes::dist::spmd::{shard_training_step_rewritten, ScheduleOptions, ShardGroups};
use sharded_common::{
    batch, g, h100_rewrite, import, meaningful, rel, rel_masked, with_optimizer_lr,
};

thread_local! {
    /// Whether `check_with` rewrites collectives (set per test).
    static REWRITE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}
use hzp_passes::train::{training_step, Optimizer, TrainConfig};
use hzp_runtime::reference::ReferenceRunner;
use hzp_runtime::train::Trainer;

fn cfg(clip: Option<f64>, sgd: bool) -> TrainConfig {
    sharded_common::train_cfg(clip, sgd)
}

fn check(file: &str, model: &str, mesh: &str, spec: ShardGroups, clip: Option<f64>, sgd: bool) {
    check_with(
        file,
        model,
        mesh,
        spec,
        cfg(clip, sgd),
        &ScheduleOptions::default(),
        1e-5,
    )
}

fn check_with(
    file: &str,
    model: &str,
    mesh: &str,
    spec: ShardGroups,
    cfg: TrainConfig,
    sched: &ScheduleOptions,
    tol: f64,
) {
    let mesh = Mesh::parse(mesh).unwrap();
    let w = mesh.world_size();
    let m = cfg.micro_batches;
    let rows = 8;
    let global = with_optimizer_lr(batch(model, rows), &cfg);
    // one rank, whole batch (in the same micro-batches)
    let single = training_step(&import(file, rows / m, 16), &cfg).unwrap();
    let mut t = Trainer::new(&single).unwrap();
    let init = t.parameters();
    // W ranks, rows / W each
    // with collective rewriting on the H100 spec (buckets, hierarchical decomposition)
    let rewrite = h100_rewrite();
    let sharded = shard_training_step_rewritten(
        &import(file, rows / w / m, 16),
        &cfg,
        &mesh,
        &spec,
        sched,
        REWRITE.with(|r| r.get()).then_some(&rewrite),
        &mut |_, _| {},
    )
    .unwrap();
    hzp_ir::verify(&sharded.program).unwrap();
    let mut r = ReferenceRunner::new(&sharded.program, &sharded.layouts, &init).unwrap();
    for step in 0..5 {
        let a = t.step(&global).unwrap();
        let b = r.step(&global).unwrap();
        // the loss, and the gradient norm when clipping
        for ((n, x), (_, y)) in a.iter().zip(&b) {
            let (la, lb) = (x.to_f64_vec()[0], y.to_f64_vec()[0]);
            assert!(
                (la - lb).abs() <= tol * la.abs(),
                "{mesh} {spec:?} {sched:?} step {step}: {n} {lb} vs {la}"
            );
        }
    }
    let want = t.parameters();
    let got = r.full_parameters();
    assert_eq!(want.len(), got.len());
    // Under AdamW, per parameter over the elements whose gradient is not round-off, and the
    // whole model over every element; under SGD, every parameter whole.
    let adamw = matches!(cfg.optimizer, Some(Optimizer::AdamW { .. }));
    // (the gradient of the whole batch, whatever the micro-batching)
    let keep = adamw.then(|| meaningful(&import(file, rows, 16), &cfg, &global));
    let flat = |ps: &[(String, hzp_ir::Tensor)]| -> hzp_ir::Tensor {
        let v: Vec<f32> = ps
            .iter()
            .flat_map(|(_, t)| t.to_f64_vec().into_iter().map(|x| x as f32))
            .collect();
        hzp_ir::Tensor::f32(vec![v.len()], v)
    };
    let whole = rel(&flat(&got), &flat(&want));
    assert!(
        whole < tol,
        "{file} on {mesh} with {spec:?} {sched:?}: the whole model differs by {whole:.3e} relative"
    );
    for (i, ((n, a), (m, b))) in want.iter().zip(&got).enumerate() {
        assert_eq!(n, m);
        let e = match &keep {
            Some(k) if k[i].len() == a.numel() => rel_masked(b, a, &k[i]),
            _ => rel(b, a),
        };
        assert!(
            e < tol,
            "{file} on {mesh} with {spec:?} {sched:?}: `{n}` differs by {e:.3e} relative"
        );
    }
}

#[test]
fn zero3_ddp_hsdp_and_hierarchical_match_one_rank() {
    let f = "llama_tiny.legacy.op17.onnx";
    let m = "llama_tiny";
    let spec = |p: &[&str], gr: &[&str], o: &[&str]| ShardGroups {
        params: g(p),
        grads: g(gr),
        optim: g(o),
    };
    // ZeRO-3 on one axis
    for sgd in [false, true] {
        check(f, m, "gpu=2", spec(&["gpu"], &["gpu"], &["gpu"]), None, sgd);
        // DDP
        check(f, m, "gpu=4", spec(&[], &[], &[]), None, sgd);
        // HSDP: shard in the node, replicate across nodes
        check(
            f,
            m,
            "node=2,gpu=2",
            spec(&["gpu"], &["gpu"], &["gpu"]),
            None,
            sgd,
        );
        // AsyncHZP-style: parameters and gradients in the node, optimizer states over the world
        check(
            f,
            m,
            "node=2,gpu=2",
            spec(&["gpu"], &["gpu"], &["node", "gpu"]),
            Some(0.5),
            sgd,
        );
        // ZeRO-3 over both axes, with clipping
        check(
            f,
            m,
            "node=2,gpu=4",
            spec(&["node", "gpu"], &["node", "gpu"], &["node", "gpu"]),
            Some(0.5),
            sgd,
        );
        // ZeRO-1 / ZeRO-2 shapes: only states (and gradients) sharded
        check(
            f,
            m,
            "node=2,gpu=2",
            spec(&[], &[], &["node", "gpu"]),
            None,
            sgd,
        );
        check(
            f,
            m,
            "node=2,gpu=2",
            spec(&[], &["node", "gpu"], &["node", "gpu"]),
            None,
            sgd,
        );
    }
}

/// Every schedule computes the same step: micro-batches reduced per micro-batch or per
/// step, parameters kept or gathered again for the backward, prefetch bounded by depth or
/// by bytes, activations recomputed.
#[test]
fn schedules_match_one_rank() {
    let spec = |p: &[&str], gr: &[&str], o: &[&str]| ShardGroups {
        params: g(p),
        grads: g(gr),
        optim: g(o),
    };
    let mut c = cfg(Some(0.5), false);
    c.micro_batches = 2;
    let scheds = [
        ScheduleOptions {
            reduce_grads: ReduceGrads::PerStep,
            reshard_after_forward: false,
            prefetch_depth: 0,
            ..ScheduleOptions::default()
        },
        ScheduleOptions {
            recompute: true,
            prefetch_depth: 2,
            ..ScheduleOptions::default()
        },
        ScheduleOptions {
            recompute: true,
            reshard_after_forward: false,
            max_inflight_bytes: Some(1),
            ..ScheduleOptions::default()
        },
    ];
    for (f, m) in [
        ("llama_tiny.legacy.op17.onnx", "llama_tiny"),
        ("gpt2_tiny.dynamo.op18.onnx", "gpt2_tiny"),
    ] {
        for (k, s) in scheds.iter().enumerate() {
            // every other case with collective rewriting
            REWRITE.with(|r| r.set(k % 2 == 0));
            check_with(
                f,
                m,
                "node=2,gpu=2",
                spec(&["gpu"], &["gpu"], &["node", "gpu"]),
                c.clone(),
                s,
                1e-5,
            );
        }
    }
    // bf16 gradients on the wire and in the accumulator: close, not exact
    let s = ScheduleOptions {
        grad_dtype: hzp_ir::DType::BF16,
        ..ScheduleOptions::default()
    };
    check_with(
        "llama_tiny.legacy.op17.onnx",
        "llama_tiny",
        "gpu=4",
        spec(&["gpu"], &["gpu"], &["gpu"]),
        c.clone(),
        &s,
        2e-2,
    );
}

/// Some parameters' gradients reduced per micro-batch inside the node and accumulated there,
/// the others over the whole G; the node axis of the narrow ones reduced once per step. Same
/// step as one rank, with and without collective rewriting.
#[test]
fn narrow_gradient_groups_match_one_rank() {
    let mut c = cfg(Some(0.5), false);
    c.micro_batches = 2;
    let fwd = import("llama_tiny.legacy.op17.onnx", 8, 8);
    // every other parameter, so both kinds meet in one layer and in one bucket
    let params: std::collections::BTreeSet<String> = fwd
        .params
        .iter()
        .step_by(2)
        .map(|p| fwd.value(p.value).name.clone())
        .collect();
    assert!(params.len() >= 2);
    let s = ScheduleOptions {
        narrow_grads: Some(hzp_passes::dist::spmd::NarrowGrads {
            group: g(&["gpu"]),
            params,
        }),
        ..ScheduleOptions::default()
    };
    for rewrite in [false, true] {
        REWRITE.with(|r| r.set(rewrite));
        check_with(
            "llama_tiny.legacy.op17.onnx",
            "llama_tiny",
            "node=2,gpu=2",
            ShardGroups {
                params: g(&["gpu"]),
                grads: g(&["node", "gpu"]),
                optim: g(&["node", "gpu"]),
            },
            c.clone(),
            &s,
            1e-5,
        );
    }
}

/// A narrow group that does not hold the parameter group, or per-step reduction, is refused
/// with a message that says why.
#[test]
fn narrow_gradient_groups_are_checked() {
    let mut c = cfg(None, false);
    c.micro_batches = 2;
    let fwd = import("llama_tiny.legacy.op17.onnx", 8, 8);
    let mesh = Mesh::parse("node=2,gpu=2").unwrap();
    let first = fwd.value(fwd.params[0].value).name.clone();
    let spec = ShardGroups {
        params: g(&["gpu"]),
        grads: g(&["node", "gpu"]),
        optim: g(&["node", "gpu"]),
    };
    let narrow = |grp: &[&str], name: &str| hzp_passes::dist::spmd::NarrowGrads {
        group: g(grp),
        params: [name.to_string()].into_iter().collect(),
    };
    let run = |s: &ScheduleOptions| {
        shard_training_step_rewritten(&fwd, &c, &mesh, &spec, s, None, &mut |_, _| {})
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let e = run(&ScheduleOptions {
        narrow_grads: Some(narrow(&["node"], &first)),
        ..ScheduleOptions::default()
    });
    assert!(e.contains("must hold the parameter group"), "{e}");
    let e = run(&ScheduleOptions {
        narrow_grads: Some(narrow(&["gpu"], "no.such.weight")),
        ..ScheduleOptions::default()
    });
    assert!(e.contains("`no.such.weight`"), "{e}");
    let e = run(&ScheduleOptions {
        reduce_grads: ReduceGrads::PerStep,
        narrow_grads: Some(narrow(&["gpu"], &first)),
        ..ScheduleOptions::default()
    });
    assert!(e.contains("per-micro-batch"), "{e}");
}

/// The schedule lets reductions overlap compute: the compute stream does not read a
/// reduce-scatter's result before the next reduction is issued (it goes on with the next
/// layer's backward meanwhile), except for the last one, whose result the optimizer needs.
#[test]
fn compute_does_not_wait_for_a_reduction_before_the_next_is_issued() {
    let spec = ShardGroups {
        params: g(&["gpu"]),
        grads: g(&["gpu"]),
        optim: g(&["gpu"]),
    };
    let n = each_read_after_the_next_is_issued(&spec, "reduction", &|n| {
        matches!(n.op, hzp_ir::Op::ReduceScatter { .. })
    });
    assert!(n >= 3, "{n} reductions");
}

/// Parameters kept whole (P = 1) are re-gathered from the new optimizer shards after the
/// step, one unit per layer: each layer's new parameters go out while the next layers'
/// optimizer steps run, and nothing on the compute stream waits for one before the next is
/// issued.
#[test]
fn compute_does_not_wait_for_a_regather_before_the_next_is_issued() {
    let spec = ShardGroups {
        params: g(&[]),
        grads: g(&["gpu"]),
        optim: g(&["gpu"]),
    };
    let n = each_read_after_the_next_is_issued(&spec, "re-gather", &|n| {
        matches!(n.op, hzp_ir::Op::AllGather { .. }) && n.name.starts_with("regather.")
    });
    assert!(n >= 3, "{n} re-gathers");
}

/// Compiles llama_tiny on gpu=2 with `spec`, with and without collective rewriting, and
/// checks that the compute stream first reads each collective `is` picks only after the next
/// one is issued. Returns how many there were (with rewriting).
fn each_read_after_the_next_is_issued(
    spec: &ShardGroups,
    what: &str,
    is: &dyn Fn(&hzp_ir::Node) -> bool,
) -> usize {
    let mut count = 0;
    for rewrite in [false, true] {
        let p = &llama_step(spec, rewrite);
        let users = p.users();
        let picked: Vec<usize> = p
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| is(n))
            .map(|(i, _)| i)
            .collect();
        count = picked.len();
        for w in picked.windows(2) {
            let (r, next) = (w[0], w[1]);
            let first_compute_reader = p.nodes[r]
                .outputs
                .iter()
                .flat_map(|o| users[o.index()].iter())
                .filter(|u| p.nodes[u.index()].stream == hzp_ir::StreamKind::Compute)
                .map(|u| u.index())
                .min();
            if let Some(f) = first_compute_reader {
                assert!(
                    f > next,
                    "rewrite {rewrite}: the {what} `{}` is read by `{}` on the compute stream \
                     before the next {what} `{}` is issued",
                    p.nodes[r].name,
                    p.nodes[f].name,
                    p.nodes[next].name
                );
            }
        }
    }
    count
}

/// After bucketing, an accumulator's first gradient is a slice of the bucket computed on the
/// compute stream: it is read as it is, not copied first (the copy only mattered when the
/// compute stream read the collective's own result).
#[test]
fn no_accumulator_copies_a_bucket_slice() {
    let spec = ShardGroups {
        params: g(&["gpu"]),
        grads: g(&["gpu"]),
        optim: g(&["gpu"]),
    };
    let is_copy =
        |n: &&hzp_ir::Node| matches!(n.op, hzp_ir::Op::Copy) && n.name.starts_with("accumulate.");
    for rewrite in [false, true] {
        let p = &llama_step(&spec, rewrite);
        // accumulator copies of a value computed on the compute stream (not a collective's)
        let copies = p
            .nodes
            .iter()
            .filter(is_copy)
            .filter(|n| {
                p.producer(n.inputs[0])
                    .is_some_and(|pn| !p.node(pn).op.is_collective())
            })
            .count();
        let all = p.nodes.iter().filter(is_copy).count();
        assert!(all > 0 || rewrite, "without rewriting the copies stay");
        assert_eq!(copies, 0, "rewrite {rewrite}: {copies} copies");
    }
}

/// llama_tiny's sharded step on gpu=2 with `spec` (4 rows of 16 tokens per rank), with or
/// without collective rewriting on the H100 spec.
fn llama_step(spec: &ShardGroups, rewrite: bool) -> hzp_ir::Program {
    llama_step_with(
        spec,
        &cfg(None, false),
        &ScheduleOptions::default(),
        rewrite,
    )
    .program
}

/// [`llama_step`] with a training config and schedule, the whole sharded step.
fn llama_step_with(
    spec: &ShardGroups,
    cfg: &TrainConfig,
    sched: &ScheduleOptions,
    rewrite: bool,
) -> hzp_passes::dist::spmd::ShardedStep {
    let rw = h100_rewrite();
    shard_training_step_rewritten(
        &import("llama_tiny.legacy.op17.onnx", 4, 16),
        cfg,
        &Mesh::parse("gpu=2").unwrap(),
        spec,
        sched,
        rewrite.then_some(&rw),
        &mut |_, _| {},
    )
    .unwrap()
}

/// An untied embedding's gradient (llama_tiny: a 256 x 64 table, 64 lookups per rank on
/// gpu=2) goes out as the looked-up rows and their indices, fewer bytes than the table: the
/// table is not reduce-scattered; with `sparse_grads` off it is. Both give one rank's
/// training (SGD, which a wrong gradient shows in).
#[test]
fn an_untied_embedding_exchanges_its_rows_not_the_table() {
    let spec = ShardGroups {
        params: g(&["gpu"]),
        grads: g(&["gpu"]),
        optim: g(&["gpu"]),
    };
    for sparse in [true, false] {
        let sched = ScheduleOptions {
            sparse_grads: sparse,
            ..ScheduleOptions::default()
        };
        let step = llama_step_with(&spec, &cfg(None, true), &sched, false);
        // reported for compile's note: 64 rows of 64 f32 and their i64 indices go to the
        // other rank instead of the 256 x 64 f32 table
        let want = if sparse {
            vec![(
                "model.embed_tokens.weight".to_string(),
                64 * (64 * 4 + 8),
                256 * 64 * 4,
            )]
        } else {
            vec![]
        };
        assert_eq!(step.row_exchanged, want);
        let p = step.program;
        let count = |f: &dyn Fn(&hzp_ir::Node) -> bool| {
            p.nodes
                .iter()
                .filter(|n| n.name.contains("embed_tokens") && f(n))
                .count()
        };
        let table = count(&|n| matches!(n.op, hzp_ir::Op::ReduceScatter { .. }));
        let rows =
            count(&|n| matches!(n.op, hzp_ir::Op::AllGather { .. }) && n.name.contains("/rows/"));
        assert_eq!(
            (table, rows),
            if sparse { (0, 2) } else { (1, 0) },
            "sparse {sparse}"
        );
        check_with(
            "llama_tiny.legacy.op17.onnx",
            "llama_tiny",
            "gpu=2",
            spec.clone(),
            cfg(None, true),
            &sched,
            1e-5,
        );
    }
}

/// A routed MoE whose experts drop choices (capacity factor 0.5): ZeRO-3 on 2 ranks and on
/// `node=2,gpu=2`, each rank running its own micro-batch, equals one rank running the same
/// micro-batches one after another for 5 SGD steps. The capacity and the drops belong to a
/// micro-batch, so they do not depend on how many ranks share the batch.
#[test]
fn routed_moe_with_drops_matches_one_rank_on_the_same_micro_batches() {
    let preset = |rows: usize| sharded_common::seeded_moe_tiny(rows, ",capacity_factor=0.5");
    let spec = ShardGroups {
        params: g(&["gpu"]),
        grads: g(&["gpu"]),
        optim: g(&["gpu"]),
    };
    for (mesh, per_rank) in [("gpu=2", 2), ("node=2,gpu=2", 1)] {
        let mesh = Mesh::parse(mesh).unwrap();
        let w = mesh.world_size();
        let rows = per_rank * w;
        let ids: Vec<i64> = (0..rows * 16).map(|i| (i * 37 % 251) as i64).collect();
        let cfg = cfg(None, true);
        let global = with_optimizer_lr(
            vec![(
                "input_ids".to_string(),
                hzp_ir::Tensor::i64(vec![rows, 16], ids),
            )],
            &cfg,
        );
        let single_cfg = TrainConfig {
            micro_batches: w,
            ..cfg.clone()
        };
        let single = training_step(&preset(per_rank), &single_cfg).unwrap();
        // T = 16 per_rank tokens, 4 experts, top 2: capacity 0.5 * T * 2 / 4
        let capacity = per_rank * 4;
        assert!(single.nodes.iter().any(|n| n.op
            == hzp_ir::Op::MoeDispatch {
                experts: 4,
                capacity
            }));
        let mut t = Trainer::new(&single).unwrap();
        let init = t.parameters();
        let sharded = shard_training_step_rewritten(
            &preset(per_rank),
            &cfg,
            &mesh,
            &spec,
            &ScheduleOptions::default(),
            None,
            &mut |_, _| {},
        )
        .unwrap();
        let mut r = ReferenceRunner::new(&sharded.program, &sharded.layouts, &init).unwrap();
        for step in 0..5 {
            let a = t.step(&global).unwrap();
            let b = r.step(&global).unwrap();
            let (la, lb) = (a[0].1.to_f64_vec()[0], b[0].1.to_f64_vec()[0]);
            assert!(
                (la - lb).abs() <= 1e-5 * la.abs(),
                "{mesh} step {step}: loss {lb} vs {la}"
            );
        }
        for ((n, a), (m, b)) in t.parameters().iter().zip(&r.full_parameters()) {
            assert_eq!(n, m);
            let e = rel(b, a);
            assert!(e < 1e-5, "{mesh}: `{n}` differs by {e:.3e} relative");
        }
    }
}
