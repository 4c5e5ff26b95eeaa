//! Collective rewriting, rule by rule, on small per-rank programs: each rewritten program is
//! run on every rank of the mesh by the lockstep reference runner and compared with the
//! original. Data-movement rules must be bitwise exact; reductions may reassociate sums.

mod sharded_common;
use hzp_ir::{DType, Group, Mesh, Op, Program, ReduceOp, Tensor, TensorType};
use hzp_passes::dist::rewrite::{
    rewrite_collectives, rewrite_collectives_owned, RewriteOptions, RewriteReport,
};
use hzp_runtime::reference::ReferenceRunner;
use sharded_common::{g, slow_cluster};

fn mesh() -> Mesh {
    Mesh::parse("node=2,gpu=4").unwrap()
}

fn world() -> Group {
    g(&["node", "gpu"])
}

/// A program with one input `x` of `ty` per rank; `body` builds the result; the output is
/// the result of every rank, gathered to all (so rank 0's output shows every rank).
fn program(
    ty: TensorType,
    body: impl FnOnce(&mut Program, hzp_ir::ValueId) -> hzp_ir::ValueId,
) -> Program {
    let mut p = Program::new("t");
    p.mesh = Some(mesh());
    let x = p.add_input("x", ty);
    let y = body(&mut p, x);
    let n = p.ty(y).numel();
    let flat = node(&mut p, "out/Reshape", Op::Reshape { shape: vec![n] }, y);
    let all = node(
        &mut p,
        "out/AllGather",
        Op::AllGather {
            group: world(),
            axis: 0,
        },
        flat,
    );
    p.outputs = vec![all];
    hzp_ir::verify(&p).unwrap();
    p
}

fn node(p: &mut Program, name: &str, op: Op, x: hzp_ir::ValueId) -> hzp_ir::ValueId {
    p.add_node(name, op, vec![x], vec![name.to_string()])
        .unwrap()[0]
}

/// Deterministic input for all ranks (rows of every rank stacked).
fn input(p: &Program) -> Vec<(String, Tensor)> {
    let x = p.inputs[0];
    let ty = p.ty(x);
    let mut shape = ty.shape.clone();
    shape[0] *= mesh().world_size();
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n)
        .map(|i| ((i * 7919 % 1013) as f64 - 500.0) / 97.0)
        .collect();
    vec![("x".into(), Tensor::from_f64(ty.dtype, shape, &v))]
}

fn run(p: &Program) -> Vec<f64> {
    let mut r = ReferenceRunner::new(p, &[], &[]).unwrap();
    let out = r.step(&input(p)).unwrap();
    out[0].1.to_f64_vec()
}

fn rewrite(p: &Program, opts: &RewriteOptions) -> (Program, RewriteReport) {
    let (q, rep) = rewrite_collectives(p, &mesh(), &slow_cluster(), opts).unwrap();
    hzp_ir::verify(&q).unwrap();
    // deterministic, and the same when the pass is handed the program to consume
    let (q2, rep2) = rewrite_collectives_owned(p.clone(), &mesh(), &slow_cluster(), opts).unwrap();
    assert_eq!(hzp_ir::text::print(&q), hzp_ir::text::print(&q2));
    assert_eq!(rep.to_string(), rep2.to_string());
    (q, rep)
}

/// Relative error in the 2-norm.
fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let d: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).powi(2))
        .sum::<f64>()
        .sqrt();
    let n: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    d / n.max(1e-12)
}

fn collectives(p: &Program) -> Vec<String> {
    p.nodes
        .iter()
        .filter(|n| n.op.is_collective())
        .map(|n| {
            let g = n.op.group().unwrap();
            format!("{}{}:{}", n.op.name(), g, p.ty(n.inputs[0]).dtype)
        })
        .collect()
}

fn no_bucketing() -> RewriteOptions {
    RewriteOptions {
        bucket_bytes: 0,
        ..Default::default()
    }
}

#[test]
fn allgather_over_two_axes_is_decomposed_in_group_index_order() {
    for axis in [0usize, 1] {
        let p = program(TensorType::new(DType::F32, vec![4, 64]), |p, x| {
            node(
                p,
                "gather/w/AllGather",
                Op::AllGather {
                    group: world(),
                    axis,
                },
                x,
            )
        });
        let (q, rep) = rewrite(&p, &no_bucketing());
        let cs = collectives(&q);
        assert!(
            cs.iter().any(|c| c == "AllGather[node]:f32")
                && cs.iter().any(|c| c == "AllGather[gpu]:f32"),
            "{cs:?}\n{rep}"
        );
        assert!(
            rep.rule("decompose") + rep.rule("reorder_axes") > 0,
            "{rep}"
        );
        assert!(rep.after.seconds < rep.before.seconds, "{rep}");
        assert_eq!(run(&q), run(&p), "axis {axis}");
    }
    // The listed order [gpu, node] (gpu most significant) too.
    let p = program(TensorType::new(DType::F32, vec![4, 64]), |p, x| {
        node(
            p,
            "gather/w/AllGather",
            Op::AllGather {
                group: g(&["gpu", "node"]),
                axis: 0,
            },
            x,
        )
    });
    let (q, _) = rewrite(&p, &no_bucketing());
    assert!(collectives(&q).len() > collectives(&p).len());
    assert_eq!(run(&q), run(&p));
}

#[test]
fn reduce_scatter_over_two_axes_is_decomposed() {
    for group in [world(), g(&["gpu", "node"])] {
        let p = program(TensorType::new(DType::F32, vec![64, 8]), |p, x| {
            node(
                p,
                "reduce/w/ReduceScatter",
                Op::ReduceScatter {
                    group: group.clone(),
                    axis: 0,
                    reduce: ReduceOp::Sum,
                },
                x,
            )
        });
        let (q, rep) = rewrite(&p, &no_bucketing());
        let cs = collectives(&q);
        assert!(
            cs.iter().any(|c| c == "ReduceScatter[node]:f32")
                && cs.iter().any(|c| c == "ReduceScatter[gpu]:f32"),
            "{cs:?}\n{rep}"
        );
        let e = max_rel(&run(&q), &run(&p));
        assert!(e < 1e-6, "{group}: {e}");
    }
}

#[test]
fn allreduce_becomes_reduce_scatter_allreduce_allgather() {
    // [6,5]: no dim divides 4, nor does the element count: flattened and padded.
    for shape in [vec![8, 16], vec![6, 5]] {
        let p = program(TensorType::new(DType::F32, shape.clone()), |p, x| {
            node(
                p,
                "reduce/w/AllReduce",
                Op::AllReduce {
                    group: world(),
                    reduce: ReduceOp::Sum,
                },
                x,
            )
        });
        let (q, rep) = rewrite(&p, &no_bucketing());
        let cs = collectives(&q);
        assert!(
            cs.contains(&"ReduceScatter[gpu]:f32".to_string())
                && cs.contains(&"AllReduce[node]:f32".to_string())
                && cs.contains(&"AllGather[gpu]:f32".to_string()),
            "{shape:?}: {cs:?}\n{rep}"
        );
        assert!(rep.rule("hierarchical_allreduce") > 0, "{rep}");
        let e = max_rel(&run(&q), &run(&p));
        assert!(e < 1e-6, "{shape:?}: {e}");
    }
}

#[test]
fn reduce_scatter_then_allgather_is_an_allreduce() {
    let p = program(TensorType::new(DType::F32, vec![16, 3]), |p, x| {
        let r = node(
            p,
            "reduce/w/ReduceScatter",
            Op::ReduceScatter {
                group: g(&["gpu"]),
                axis: 0,
                reduce: ReduceOp::Sum,
            },
            x,
        );
        node(
            p,
            "reduce/w/AllGather",
            Op::AllGather {
                group: g(&["gpu"]),
                axis: 0,
            },
            r,
        )
    });
    let (q, rep) = rewrite(&p, &no_bucketing());
    let cs = collectives(&q);
    assert_eq!(cs[0], "AllReduce[gpu]:f32", "{cs:?}\n{rep}");
    assert!(rep.rule("rs_ag") > 0, "{rep}");
    let e = max_rel(&run(&q), &run(&p));
    assert!(e < 1e-6, "{e}");
}

#[test]
fn narrowing_cast_moves_before_the_gather_and_widening_stays_after() {
    let p = program(TensorType::new(DType::F32, vec![4, 32]), |p, x| {
        let a = node(
            p,
            "gather/w/AllGather",
            Op::AllGather {
                group: g(&["gpu"]),
                axis: 0,
            },
            x,
        );
        node(p, "gather/w/Cast", Op::Cast { to: DType::BF16 }, a)
    });
    let (q, rep) = rewrite(&p, &no_bucketing());
    assert_eq!(collectives(&q)[0], "AllGather[gpu]:bf16", "{rep}");
    assert!(rep.rule("cast_past_collective") > 0, "{rep}");
    assert_eq!(run(&q), run(&p));

    let p = program(TensorType::new(DType::BF16, vec![4, 32]), |p, x| {
        let a = node(
            p,
            "gather/w/AllGather",
            Op::AllGather {
                group: g(&["gpu"]),
                axis: 0,
            },
            x,
        );
        node(p, "gather/w/Cast", Op::Cast { to: DType::F32 }, a)
    });
    let (q, _) = rewrite(&p, &no_bucketing());
    assert_eq!(collectives(&q)[0], "AllGather[gpu]:bf16");
}

#[test]
fn casts_cross_reductions_only_with_a_reduce_dtype() {
    // bf16 gradient, cast to f32, padded, reduce-scattered: the shape of the sharded step.
    let build = || {
        program(TensorType::new(DType::BF16, vec![6, 5]), |p, x| {
            let c = node(p, "reduce/w/Cast", Op::Cast { to: DType::F32 }, x);
            let f = node(p, "reduce/w/Reshape", Op::Reshape { shape: vec![30] }, c);
            let z = p
                .add_node(
                    "reduce/w/Fill",
                    Op::Fill {
                        value: 0.0,
                        dtype: DType::F32,
                        shape: vec![2],
                    },
                    vec![],
                    vec!["reduce/w/Fill".into()],
                )
                .unwrap()[0];
            let cat = p
                .add_node(
                    "reduce/w/Concat",
                    Op::Concat { axis: 0 },
                    vec![f, z],
                    vec!["reduce/w/Concat".into()],
                )
                .unwrap()[0];
            node(
                p,
                "reduce/w/ReduceScatter",
                Op::ReduceScatter {
                    group: g(&["gpu"]),
                    axis: 0,
                    reduce: ReduceOp::Sum,
                },
                cat,
            )
        })
    };
    let p = build();
    let (q, _) = rewrite(&p, &no_bucketing());
    assert_eq!(collectives(&q)[0], "ReduceScatter[gpu]:f32");
    assert_eq!(run(&q), run(&p));

    let opts = RewriteOptions {
        reduce_dtype: Some(DType::BF16),
        ..no_bucketing()
    };
    let (q, rep) = rewrite(&p, &opts);
    assert_eq!(collectives(&q)[0], "ReduceScatter[gpu]:bf16", "{rep}");
    assert!(rep.rule("reduce_dtype") > 0, "{rep}");
    // 4 bf16 inputs summed in bf16: within a few bf16 ulps of the f32 sum.
    let (a, b) = (run(&q), run(&p));
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 0.02 * scale, "{x} vs {y}");
    }
}

/// `k` independent gathers of different sizes, named `key/param<i>/AllGather`.
fn gathers(key: &str, k: usize, rank: usize) -> Program {
    program(TensorType::new(DType::F32, vec![4, 8]), |p, x| {
        let mut outs = Vec::new();
        for i in 0..k {
            let n = 8 + 4 * i;
            let s = node(
                p,
                &format!("{key}/param{i}/Slice"),
                Op::Slice {
                    axes: vec![1],
                    starts: vec![0],
                    ends: vec![(n / 4).min(8) as i64],
                    steps: vec![1],
                },
                x,
            );
            let shape = if rank == 1 {
                vec![4 * (n / 4).min(8)]
            } else {
                vec![4, (n / 4).min(8)]
            };
            let r = node(
                p,
                &format!("{key}/param{i}/Reshape"),
                Op::Reshape { shape },
                s,
            );
            let a = node(
                p,
                &format!("{key}/param{i}/AllGather"),
                Op::AllGather {
                    group: g(&["gpu"]),
                    axis: 0,
                },
                r,
            );
            let m = p.ty(a).numel();
            outs.push(node(
                p,
                &format!("{key}/param{i}/Flat"),
                Op::Reshape { shape: vec![m] },
                a,
            ));
        }
        p.add_node(
            "use/Concat",
            Op::Concat { axis: 0 },
            outs,
            vec!["use/Concat".into()],
        )
        .unwrap()[0]
    })
}

#[test]
fn adjacent_collectives_of_one_key_are_bucketed_up_to_the_byte_target() {
    for rank in [1, 2] {
        let p = gathers("gather", 4, rank);
        let (q, rep) = rewrite(&p, &RewriteOptions::default());
        let gpu_gathers = q
            .nodes
            .iter()
            .filter(|n| n.op.is_collective() && n.name.starts_with("gather/"))
            .count();
        assert_eq!(gpu_gathers, 1, "{rep}");
        assert_eq!(rep.buckets, 1);
        assert_eq!(rep.bucketed_collectives, 4);
        assert_eq!(run(&q), run(&p));
    }
    // Gathered sizes are 128, 192, 256 and 320 bytes: a 576-byte target holds the first three.
    let p = gathers("gather", 4, 1);
    let opts = RewriteOptions {
        bucket_bytes: 576,
        ..Default::default()
    };
    let (q, rep) = rewrite(&p, &opts);
    assert_eq!((rep.buckets, rep.bucketed_collectives), (1, 3), "{rep}");
    assert_eq!(run(&q), run(&p));
    // Collectives of different roles (kind or unit) never share a bucket, whatever their
    // names; the names do not decide.
    let mut names = p.clone();
    for n in names.nodes.iter_mut() {
        if n.name.starts_with("gather/param0/") || n.name.starts_with("gather/param2/") {
            n.role = hzp_ir::Role::new(hzp_ir::RoleKind::Gather, "unit1");
        }
    }
    let (q, rep) = rewrite(&names, &RewriteOptions::default());
    assert_eq!((rep.buckets, rep.bucketed_collectives), (2, 4), "{rep}");
    assert_eq!(run(&q), run(&names));
}

#[test]
fn bucketing_never_fuses_across_a_data_dependency() {
    // The second gather reads the first one's result.
    let p = program(TensorType::new(DType::F32, vec![2, 4]), |p, x| {
        let a = node(
            p,
            "gather/a/AllGather",
            Op::AllGather {
                group: g(&["gpu"]),
                axis: 0,
            },
            x,
        );
        node(
            p,
            "gather/b/AllGather",
            Op::AllGather {
                group: g(&["gpu"]),
                axis: 0,
            },
            a,
        )
    });
    let (q, rep) = rewrite(&p, &RewriteOptions::default());
    assert_eq!(rep.buckets, 0, "{rep}");
    assert_eq!(run(&q), run(&p));
}

#[test]
fn programs_with_events_get_them_back() {
    let p = gathers("gather", 3, 1);
    let mut with_events = p.clone();
    hzp_passes::dist::streams::assign_streams(&mut with_events);
    let with_events = hzp_passes::dist::streams::insert_events(&with_events);
    assert!(with_events
        .nodes
        .iter()
        .any(|n| matches!(n.op, Op::RecordEvent { .. })));
    let (q, rep) = rewrite(&with_events, &RewriteOptions::default());
    assert!(rep.events_reinserted);
    assert!(q.nodes.iter().any(|n| matches!(n.op, Op::WaitEvent { .. })));
    assert_eq!(run(&q), run(&p));
}

#[test]
fn bad_options_and_meshes_are_errors() {
    let p = gathers("gather", 2, 1);
    let opts = RewriteOptions {
        reduce_dtype: Some(DType::I32),
        ..Default::default()
    };
    let e = rewrite_collectives(&p, &mesh(), &slow_cluster(), &opts).unwrap_err();
    assert!(e.contains("i32"), "{e}");
    let e = rewrite_collectives(
        &p,
        &Mesh::parse("gpu=8").unwrap(),
        &slow_cluster(),
        &RewriteOptions::default(),
    )
    .unwrap_err();
    assert!(e.contains("mesh"), "{e}");
}
