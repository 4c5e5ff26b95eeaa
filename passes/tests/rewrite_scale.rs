//! Collective rewriting stays local: on generated per-rank programs with many layers, the
//! work grows with the number of regions, and identical layers are solved once. Prints the
//! time per node for two sizes (a benchmark-style ratio, not a timed assertion).

use hzp_ir::{DType, Group, Mesh, Op, Program, ReduceOp, Role, RoleKind, TensorType, ValueId};
use hzp_passes::cost::cluster::ClusterSpec;
use hzp_passes::dist::rewrite::{rewrite_collectives, RewriteOptions};
use std::path::PathBuf;
use std::time::Instant;

fn add(p: &mut Program, name: &str, op: Op, ins: Vec<ValueId>) -> ValueId {
    add_as(p, name, op, ins, Role::default())
}

fn add_as(p: &mut Program, name: &str, op: Op, ins: Vec<ValueId>, role: Role) -> ValueId {
    let v = p.add_node(name, op, ins, vec![name.to_string()]).unwrap()[0];
    p.nodes.last_mut().unwrap().role = role;
    v
}

/// A transformer-like per-rank step: per layer, four weights gathered over `gpu` (bf16
/// shards), used by matmuls; their gradients cast to f32 and reduce-scattered over
/// `[node,gpu]`, then all-reduced over nothing else. Roles carry the layer
/// (`gather("l3")`, `reduce("l3")`), so buckets stay per layer.
fn generated(layers: usize) -> Program {
    let mesh = Mesh::parse("node=16,gpu=8").unwrap();
    let mut p = Program::new("generated");
    p.mesh = Some(mesh);
    let d = 64;
    let mut h = p.add_input("h", TensorType::new(DType::BF16, vec![8, d]));
    let gpu = Group::new(["gpu"]);
    let world = Group::new(["node", "gpu"]);
    let mut outs = Vec::new();
    for l in 0..layers {
        for k in 0..4 {
            let s = p.add_state(
                format!("shard/l{l}.w{k}"),
                TensorType::new(DType::BF16, vec![d * d / 8]),
                None,
            );
            let scope = format!("gather.l{l}/w{k}");
            let role = Role::new(RoleKind::Gather, format!("l{l}"));
            let a = add_as(
                &mut p,
                &format!("{scope}/AllGather"),
                Op::AllGather {
                    group: gpu.clone(),
                    axis: 0,
                },
                vec![s],
                role.clone(),
            );
            let w = add_as(
                &mut p,
                &format!("{scope}/Reshape"),
                Op::Reshape { shape: vec![d, d] },
                vec![a],
                role.clone(),
            );
            h = add(&mut p, &format!("l{l}/w{k}/MatMul"), Op::MatMul, vec![h, w]);
            let scope = format!("reduce.l{l}/w{k}");
            let role = Role::new(RoleKind::Reduce, format!("l{l}"));
            let c = add_as(
                &mut p,
                &format!("{scope}/Cast"),
                Op::Cast { to: DType::F32 },
                vec![h],
                role.clone(),
            );
            let f = add_as(
                &mut p,
                &format!("{scope}/Reshape"),
                Op::Reshape { shape: vec![8 * d] },
                vec![c],
                role.clone(),
            );
            let r = add_as(
                &mut p,
                &format!("{scope}/ReduceScatter"),
                Op::ReduceScatter {
                    group: world.clone(),
                    axis: 0,
                    reduce: ReduceOp::Sum,
                },
                vec![f],
                role.clone(),
            );
            outs.push(r);
        }
    }
    p.outputs = outs;
    hzp_ir::verify(&p).unwrap();
    p
}

#[test]
fn rewriting_is_local_and_reuses_solutions_across_layers() {
    let cluster = ClusterSpec::load(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/clusters/h100-dgx.toml"),
    )
    .unwrap();
    let mesh = Mesh::parse("node=16,gpu=8").unwrap();
    let opts = RewriteOptions::default();
    let mut per_node = Vec::new();
    for layers in [50, 400] {
        let p = generated(layers);
        let t = Instant::now();
        let (q, rep) = rewrite_collectives(&p, &mesh, &cluster, &opts).unwrap();
        let s = t.elapsed().as_secs_f64();
        hzp_ir::verify(&q).unwrap();
        // One bucket of gathers and one of reductions per layer, solved once for all layers
        // (the first and last layers' regions may differ from the middle ones).
        assert_eq!(rep.buckets, 2 * layers, "{rep}");
        assert!(rep.regions >= 2 * layers, "{rep}");
        assert!(rep.regions_solved <= 8, "{rep}");
        assert!(rep.after.seconds < rep.before.seconds, "{rep}");
        println!(
            "{layers} layers: {} nodes -> {} nodes in {:.3} s ({:.2} us/node)\n{rep}",
            p.nodes.len(),
            q.nodes.len(),
            s,
            s / p.nodes.len() as f64 * 1e6
        );
        per_node.push(s / p.nodes.len() as f64);
    }
    println!(
        "time per node, 400 layers vs 50: {:.2}x (1.0 = linear)",
        per_node[1] / per_node[0]
    );
}
