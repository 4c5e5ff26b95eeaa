//! The analytical cost model against hand-computed formulas.

use hzp_ir::{BinaryOp, DType, Group, Mesh, Op, ReduceOp, TensorType, UnaryOp};
use hzp_passes::cost::cluster::ClusterSpec;
use hzp_passes::cost::{
    collective_time, compute_time, op_bytes, op_flops, roofline, shared_bandwidth_time, Algorithm,
    Bound, CollectiveKind, CostError, CostModel, TRANSCENDENTAL_FLOPS as T,
};
use std::path::PathBuf;

const GIB: f64 = (1u64 << 30) as f64;
const NV_B: f64 = 450e9;
const NV_A: f64 = 3e-6;
const IB_B: f64 = 50e9;
const IB_A: f64 = 10e-6;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-30)
}

macro_rules! assert_close {
    ($a:expr, $b:expr) => {{
        let (a, b) = ($a as f64, $b as f64);
        assert!(
            close(a, b),
            "{} = {a} but expected {} = {b}",
            stringify!($a),
            stringify!($b)
        );
    }};
}

fn t(d: DType, s: &[usize]) -> TensorType {
    TensorType::new(d, s.to_vec())
}

fn h100() -> ClusterSpec {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/clusters/h100-dgx.toml");
    ClusterSpec::load(p).unwrap()
}

fn model(mesh: &str) -> CostModel {
    CostModel::new(h100(), Mesh::parse(mesh).unwrap()).unwrap()
}

/// Flops and bytes of `op` with types inferred from `ins`.
fn fb(op: &Op, ins: Vec<TensorType>) -> (f64, f64, Vec<TensorType>) {
    let ins: Vec<&TensorType> = ins.iter().collect();
    let outs = op.infer(&ins, None).unwrap();
    let o: Vec<&TensorType> = outs.iter().collect();
    (op_flops(op, &ins, &o), op_bytes(op, &ins, &o), outs)
}

#[test]
fn matmul_flops_and_bytes() {
    let f = DType::F32;
    let (flops, bytes, _) = fb(&Op::MatMul, vec![t(f, &[2, 16, 64]), t(f, &[64, 32])]);
    assert_eq!(flops, (2 * 2 * 16 * 64 * 32) as f64);
    assert_eq!(bytes, ((2 * 16 * 64 + 64 * 32 + 2 * 16 * 32) * 4) as f64);
    // Vector times matrix: M = 1.
    let (flops, _, _) = fb(&Op::MatMul, vec![t(f, &[64]), t(f, &[64, 32])]);
    assert_eq!(flops, (2 * 64 * 32) as f64);
    // Broadcast batch dims: [3,1,4,5] x [2,5,6] -> [3,2,4,6], K = 5.
    let (flops, _, _) = fb(&Op::MatMul, vec![t(f, &[3, 1, 4, 5]), t(f, &[2, 5, 6])]);
    assert_eq!(flops, (2 * 3 * 2 * 4 * 6 * 5) as f64);
    // bf16 halves the bytes.
    let (_, bytes, _) = fb(
        &Op::MatMul,
        vec![t(DType::BF16, &[8, 8]), t(DType::BF16, &[8, 8])],
    );
    assert_eq!(bytes, (3 * 64 * 2) as f64);
}

#[test]
fn elementwise_flops() {
    let f = DType::F32;
    let x = t(f, &[8, 8]);
    let (flops, bytes, _) = fb(&Op::Binary(BinaryOp::Add), vec![x.clone(), x.clone()]);
    assert_eq!((flops, bytes), (64.0, (3 * 64 * 4) as f64));
    // Broadcasting: flops follow the output, bytes the operands as stored.
    let (flops, bytes, _) = fb(&Op::Binary(BinaryOp::Mul), vec![x.clone(), t(f, &[8])]);
    assert_eq!((flops, bytes), (64.0, ((64 + 8 + 64) * 4) as f64));
    assert_eq!(fb(&Op::Unary(UnaryOp::Exp), vec![x.clone()]).0, 64.0 * T);
    assert_eq!(fb(&Op::Unary(UnaryOp::Relu), vec![x.clone()]).0, 64.0);
    assert_eq!(
        fb(&Op::Unary(UnaryOp::Gelu), vec![x.clone()]).0,
        64.0 * (T + 4.0)
    );
    assert_eq!(
        fb(&Op::Unary(UnaryOp::Silu), vec![x.clone()]).0,
        64.0 * (T + 3.0)
    );
    assert_eq!(
        fb(&Op::Binary(BinaryOp::Pow), vec![x.clone(), x.clone()]).0,
        64.0 * (2.0 * T + 1.0)
    );
    let c = t(DType::Bool, &[8, 8]);
    let (flops, bytes, _) = fb(&Op::Where, vec![c, x.clone(), x.clone()]);
    assert_eq!((flops, bytes), (64.0, (64 + 3 * 64 * 4) as f64));
    let (flops, bytes, _) = fb(&Op::Cast { to: DType::BF16 }, vec![x]);
    assert_eq!((flops, bytes), (64.0, (64 * 4 + 64 * 2) as f64));
}

#[test]
fn normalization_and_reduction_flops() {
    let f = DType::F32;
    let x = t(f, &[4, 10]);
    assert_eq!(
        fb(&Op::Softmax { axis: 1 }, vec![x.clone()]).0,
        40.0 * (T + 4.0)
    );
    assert_eq!(
        fb(&Op::LogSoftmax { axis: 1 }, vec![x.clone()]).0,
        40.0 * (T + 4.0)
    );
    let ln = Op::LayerNorm {
        axis: 1,
        epsilon: 1e-5,
    };
    let w = t(f, &[10]);
    assert_eq!(
        fb(&ln, vec![x.clone(), w.clone(), w.clone()]).0,
        4.0 * (10.0 * 7.0 + T + 3.0)
    );
    assert_eq!(
        fb(&ln, vec![x.clone(), w.clone()]).0,
        4.0 * (10.0 * 6.0 + T + 3.0)
    );
    // Normalizing over both axes: one row of 40.
    let ln0 = Op::LayerNorm {
        axis: 0,
        epsilon: 1e-5,
    };
    assert_eq!(fb(&ln0, vec![x.clone(), x.clone()]).0, 40.0 * 6.0 + T + 3.0);
    let rms = Op::RmsNorm {
        axis: 1,
        epsilon: 1e-6,
    };
    assert_eq!(fb(&rms, vec![x.clone(), w]).0, 4.0 * (10.0 * 4.0 + T + 2.0));

    let sum = Op::Reduce {
        op: ReduceOp::Sum,
        axes: vec![1],
        keep_dims: false,
    };
    let (flops, bytes, _) = fb(&sum, vec![x.clone()]);
    assert_eq!((flops, bytes), (40.0, ((40 + 4) * 4) as f64));
    let mean = Op::Reduce {
        op: ReduceOp::Mean,
        axes: vec![1],
        keep_dims: true,
    };
    assert_eq!(fb(&mean, vec![x.clone()]).0, 44.0);
    assert_eq!(
        fb(
            &Op::ArgMax {
                axis: 1,
                keep_dims: false
            },
            vec![x.clone()]
        )
        .0,
        40.0
    );
    let topk = Op::TopK {
        axis: 1,
        k: 4,
        largest: true,
        sorted: true,
    };
    assert_eq!(fb(&topk, vec![x]).0, 40.0 * 2.0);
}

#[test]
fn data_movement_and_indexing_cost_bytes_only() {
    let f = DType::F32;
    let x = t(f, &[6, 10]);
    let (flops, bytes, _) = fb(&Op::Transpose { perm: vec![1, 0] }, vec![x.clone()]);
    assert_eq!((flops, bytes), (0.0, (2 * 60 * 4) as f64));
    let (flops, bytes, _) = fb(&Op::Reshape { shape: vec![60] }, vec![x.clone()]);
    assert_eq!((flops, bytes), (0.0, 0.0));
    let slice = Op::Slice {
        axes: vec![0],
        starts: vec![0],
        ends: vec![2],
        steps: vec![1],
    };
    let (flops, bytes, _) = fb(&slice, vec![x.clone()]);
    assert_eq!((flops, bytes), (0.0, (2 * 20 * 4) as f64));
    let (flops, bytes, _) = fb(&Op::Concat { axis: 0 }, vec![x.clone(), x.clone()]);
    assert_eq!((flops, bytes), (0.0, (4 * 60 * 4) as f64));
    // Embedding lookup: reads the 8 gathered rows, not the table.
    let table = t(f, &[1000, 64]);
    let idx = t(DType::I64, &[8]);
    let (flops, bytes, outs) = fb(&Op::Gather { axis: 0 }, vec![table, idx]);
    assert_eq!(outs[0].shape, vec![8, 64]);
    assert_eq!((flops, bytes), (0.0, (2 * 8 * 64 * 4 + 8 * 8) as f64));
    let fill = Op::Fill {
        value: 0.0,
        dtype: f,
        shape: vec![5, 5],
    };
    assert_eq!(fb(&fill, vec![]).0, 0.0);
    assert_eq!(fb(&fill, vec![]).1, 100.0);
    assert_eq!(fb(&Op::Copy, vec![x.clone()]).1, (2 * 60 * 4) as f64);
    let sc = Op::ScatterElements { axis: 0, add: true };
    let i = t(DType::I64, &[2, 10]);
    let u = t(f, &[2, 10]);
    let (flops, bytes, _) = fb(&sc, vec![x.clone(), i.clone(), u.clone()]);
    assert_eq!((flops, bytes), (20.0, ((60 + 20 + 60) * 4 + 20 * 8) as f64));
    assert_eq!(
        fb(
            &Op::ScatterElements {
                axis: 0,
                add: false
            },
            vec![x, i, u]
        )
        .0,
        0.0
    );
    assert_eq!(op_flops(&Op::Free, &[], &[]), 0.0);
    assert_eq!(op_bytes(&Op::RecordEvent { event: 1 }, &[], &[]), 0.0);
}

#[test]
fn collectives_have_no_flops_and_no_compute_time() {
    let mesh = Mesh::parse("gpu=8").unwrap();
    let op = Op::AllGather {
        group: Group::new(["gpu"]),
        axis: 0,
    };
    let x = t(DType::BF16, &[16, 4]);
    let outs = op.infer(&[&x], Some(&mesh)).unwrap();
    assert_eq!(op_flops(&op, &[&x], &[&outs[0]]), 0.0);
    assert_eq!(
        op_bytes(&op, &[&x], &[&outs[0]]),
        ((16 * 4 + 128 * 4) * 2) as f64
    );
    assert_eq!(
        compute_time(&op, &[&x], &[&outs[0]], &h100(), DType::BF16),
        0.0
    );
}

fn toy_spec() -> ClusterSpec {
    ClusterSpec::from_toml_str(
        r#"
name = "toy"
mesh = "gpu=2"
devices_per_node = 2
[device]
memory = "1GiB"
peak_bf16 = "1TFLOPS"
peak_fp16 = "2TFLOPS"
peak_fp32 = 1e11
memory_bandwidth = "1GB/s"
matmul_efficiency = 0.5
vector_efficiency = 0.25
memory_efficiency = 1.0
launch_overhead = "5us"
[[links]]
name = "l"
axes = ["gpu"]
bandwidth = "1GB/s"
latency = 0
"#,
        "toy.toml",
    )
    .unwrap()
}

#[test]
fn roofline_picks_the_bound() {
    let spec = toy_spec();
    let bf = DType::BF16;
    // 2*256^3 = 33.5 MFLOP at 0.5 TFLOP/s = 67 us; 3*256*256*2 bytes at 1 GB/s = 393 us.
    let a = t(bf, &[256, 256]);
    let outs = Op::MatMul.infer(&[&a, &a], None).unwrap();
    let r = roofline(&Op::MatMul, &[&a, &a], &[&outs[0]], &spec, bf);
    assert_eq!(r.bound, Bound::Memory);
    assert_close!(r.compute_s, 2.0 * 256f64.powi(3) / 0.5e12);
    assert_close!(r.memory_s, 3.0 * 256.0 * 256.0 * 2.0 / 1e9);
    assert_close!(r.seconds, 5e-6 + r.memory_s);
    // With memory made nearly free, the same matmul is compute bound.
    let mut fast = spec.clone();
    fast.device.memory_bandwidth = 1e15;
    let r = roofline(&Op::MatMul, &[&a, &a], &[&outs[0]], &fast, bf);
    assert_eq!(r.bound, Bound::Compute);
    assert_close!(r.seconds, 5e-6 + 2.0 * 256f64.powi(3) / 0.5e12);
    // The dtype picks the peak: fp16 2 TF, fp32 0.1 TF.
    let r16 = roofline(&Op::MatMul, &[&a, &a], &[&outs[0]], &fast, DType::F16);
    assert_close!(r16.compute_s, 2.0 * 256f64.powi(3) / (2e12 * 0.5));
    let r32 = roofline(&Op::MatMul, &[&a, &a], &[&outs[0]], &fast, DType::F32);
    assert_close!(r32.compute_s, 2.0 * 256f64.powi(3) / (1e11 * 0.5));
    // Non-matmul ops use the vector peak and efficiency.
    let x = t(DType::F32, &[1000]);
    let r = roofline(&Op::Unary(UnaryOp::Exp), &[&x], &[&x], &fast, DType::F32);
    assert_eq!(r.bound, Bound::Compute);
    assert_close!(r.compute_s, 1000.0 * T / (1e11 * 0.25));
    let r = roofline(&Op::Unary(UnaryOp::Exp), &[&x], &[&x], &spec, DType::F32);
    assert_eq!(r.bound, Bound::Memory);
    assert_close!(r.seconds, 5e-6 + 8000.0 / 1e9);
    // No work, no launch.
    let r = roofline(
        &Op::Reshape {
            shape: vec![10, 100],
        },
        &[&x],
        &[&x],
        &spec,
        DType::F32,
    );
    assert_eq!((r.bound, r.seconds), (Bound::None, 0.0));
}

#[test]
fn h100_roofline_classifies_big_matmuls_and_adds() {
    let spec = h100();
    let bf = DType::BF16;
    let a = t(bf, &[4096, 4096]);
    let outs = Op::MatMul.infer(&[&a, &a], None).unwrap();
    let r = roofline(&Op::MatMul, &[&a, &a], &[&outs[0]], &spec, bf);
    assert_eq!(r.bound, Bound::Compute);
    assert_close!(r.seconds, 2.0 * 4096f64.powi(3) / (989e12 * 0.6));
    let add = Op::Binary(BinaryOp::Add);
    let r = roofline(&add, &[&a, &a], &[&a], &spec, bf);
    assert_eq!(r.bound, Bound::Memory);
    assert_close!(r.seconds, 3.0 * 4096.0 * 4096.0 * 2.0 / (3.35e12 * 0.8));
}

#[test]
fn ring_allgather_and_reducescatter_over_nvlink() {
    let m = model("node=2,gpu=8");
    let g = Group::new(["gpu"]);
    let expected = 7.0 * (NV_A + GIB / 8.0 / NV_B);
    for kind in [
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllToAll,
    ] {
        let c = m.collective_time(kind, GIB, &g, Algorithm::Ring).unwrap();
        assert_close!(c.seconds, expected);
        assert_eq!(c.bytes_sent_per_rank_per_link.len(), 1);
        assert_close!(c.bytes_on("nvlink"), 7.0 / 8.0 * GIB);
        assert_eq!(c.bytes_on("ib"), 0.0);
    }
    let ar = m
        .collective_time(CollectiveKind::AllReduce, GIB, &g, Algorithm::Ring)
        .unwrap();
    assert_close!(ar.seconds, 2.0 * expected);
    assert_close!(ar.bytes_on("nvlink"), 2.0 * 7.0 / 8.0 * GIB);
    // The free function gives the same numbers.
    let c = collective_time(
        CollectiveKind::AllGather,
        GIB,
        &g,
        m.mesh(),
        m.spec(),
        Algorithm::Ring,
    )
    .unwrap();
    assert_close!(c.seconds, expected);
}

#[test]
fn flat_ring_over_two_axes_is_paced_by_the_slowest_link() {
    let m = model("node=2,gpu=4");
    let g = Group::new(["node", "gpu"]);
    let s = GIB;
    let c = m
        .collective_time(CollectiveKind::AllGather, s, &g, Algorithm::Ring)
        .unwrap();
    assert_close!(c.seconds, 7.0 * (IB_A + s / 8.0 / IB_B));
    // 8 ring edges: 2 cross nodes (one per node boundary, closing edge included), 6 stay inside.
    assert_close!(c.bytes_on("ib"), 7.0 / 8.0 * s * 2.0 / 8.0);
    assert_close!(c.bytes_on("nvlink"), 7.0 / 8.0 * s * 6.0 / 8.0);
    // Group axes are taken in mesh order whatever order the group lists them in.
    let c2 = m
        .collective_time(
            CollectiveKind::AllGather,
            s,
            &Group::new(["gpu", "node"]),
            Algorithm::Ring,
        )
        .unwrap();
    assert_eq!(c, c2);
    // AllToAll sends to every peer: 4 of the 7 peers are on the other node.
    let a2a = m
        .collective_time(CollectiveKind::AllToAll, s, &g, Algorithm::Ring)
        .unwrap();
    assert_close!(a2a.bytes_on("ib"), s / 8.0 * 4.0);
    assert_close!(a2a.bytes_on("nvlink"), s / 8.0 * 3.0);
}

#[test]
fn hierarchical_is_the_sum_of_its_parts() {
    let m = model("node=2,gpu=4");
    let both = Group::new(["node", "gpu"]);
    let gpu = Group::new(["gpu"]);
    let node = Group::new(["node"]);
    let s = GIB;
    let part = |k, b, g: &Group| m.collective_time(k, b, g, Algorithm::Ring).unwrap().seconds;
    use CollectiveKind::*;

    let rs = m
        .collective_time(ReduceScatter, s, &both, Algorithm::Hierarchical)
        .unwrap();
    let rs_inner = 3.0 * (NV_A + s / 4.0 / NV_B);
    let rs_outer = 1.0 * (IB_A + (s / 4.0) / 2.0 / IB_B);
    assert_close!(rs.seconds, rs_inner + rs_outer);
    assert_close!(
        rs.seconds,
        part(ReduceScatter, s, &gpu) + part(ReduceScatter, s / 4.0, &node)
    );
    assert_eq!(rs.phases.len(), 2);
    assert_eq!(rs.phases[0].axes, vec!["gpu".to_string()]);
    assert_close!(rs.bytes_on("nvlink"), 3.0 / 4.0 * s);
    assert_close!(rs.bytes_on("ib"), 1.0 / 2.0 * s / 4.0);

    let ag = m
        .collective_time(AllGather, s, &both, Algorithm::Hierarchical)
        .unwrap();
    assert_close!(
        ag.seconds,
        part(AllGather, s / 4.0, &node) + part(AllGather, s, &gpu)
    );
    assert_eq!(ag.phases[0].axes, vec!["node".to_string()]);

    let ar = m
        .collective_time(AllReduce, s, &both, Algorithm::Hierarchical)
        .unwrap();
    let ar_outer = 2.0 * 1.0 * (IB_A + (s / 4.0) / 2.0 / IB_B);
    assert_close!(ar.seconds, 2.0 * rs_inner + ar_outer);
    assert_close!(
        ar.seconds,
        part(ReduceScatter, s, &gpu) + part(AllReduce, s / 4.0, &node) + part(AllGather, s, &gpu)
    );
    let kinds: Vec<CollectiveKind> = ar.phases.iter().map(|p| p.kind).collect();
    assert_eq!(kinds, [ReduceScatter, AllReduce, AllGather]);
    // Far cheaper than a flat ring that pushes everything through InfiniBand.
    let flat = m
        .collective_time(AllReduce, s, &both, Algorithm::Ring)
        .unwrap();
    assert!(ar.seconds < flat.seconds);
    assert_close!(ar.bytes_on("ib"), s / 4.0);

    let a2a = m
        .collective_time(AllToAll, s, &both, Algorithm::Hierarchical)
        .unwrap();
    assert_close!(
        a2a.seconds,
        part(AllToAll, s, &gpu) + part(AllToAll, s, &node)
    );

    let bc = m
        .collective_time(Broadcast, s, &both, Algorithm::Hierarchical)
        .unwrap();
    assert_close!(
        bc.seconds,
        part(Broadcast, s, &node) + part(Broadcast, s, &gpu)
    );
    assert_close!(bc.seconds, (IB_A + s / IB_B) + (3.0 * NV_A + s / NV_B));
    // Mean over all 8 ranks: 7 copies of S leave a sender in all.
    let total: f64 = bc.bytes_sent_per_rank_per_link.iter().map(|(_, b)| b).sum();
    assert_close!(total, 7.0 / 8.0 * s);
    assert_close!(bc.bytes_on("ib"), s / 8.0);
}

#[test]
fn three_level_allreduce_nests() {
    let spec = ClusterSpec::load(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/clusters/asynchzp-paper.toml"),
    )
    .unwrap();
    let m = CostModel::new(spec, Mesh::parse("node=4,group=2,card=8").unwrap()).unwrap();
    let s = GIB;
    let all = Group::new(["node", "group", "card"]);
    let c = m
        .collective_time(CollectiveKind::AllReduce, s, &all, Algorithm::Hierarchical)
        .unwrap();
    let kinds: Vec<(CollectiveKind, String, f64)> = c
        .phases
        .iter()
        .map(|p| (p.kind, p.axes[0].clone(), p.bytes))
        .collect();
    use CollectiveKind::*;
    assert_eq!(
        kinds,
        [
            (ReduceScatter, "card".to_string(), s),
            (ReduceScatter, "group".to_string(), s / 8.0),
            (AllReduce, "node".to_string(), s / 16.0),
            (AllGather, "group".to_string(), s / 8.0),
            (AllGather, "card".to_string(), s),
        ]
    );
    let ring = |n: f64, a: f64, b: f64, size: f64| (n - 1.0) * (a + size / n / b);
    let expected = 2.0 * ring(8.0, 3e-6, 400e9, s)
        + 2.0 * ring(2.0, 5e-6, 50e9, s / 8.0)
        + 2.0 * ring(4.0, 10e-6, 25e9, s / 16.0);
    assert_close!(c.seconds, expected);
    let links: Vec<&str> = m
        .group_link_classes(&all)
        .iter()
        .map(|l| l.name.as_str())
        .collect();
    assert_eq!(links, ["roce", "intra-node", "fullmesh"]);
}

#[test]
fn tree_algorithms() {
    let m = model("node=2,gpu=8");
    let g = Group::new(["gpu"]);
    let s = 1e6;
    let ar = m
        .collective_time(CollectiveKind::AllReduce, s, &g, Algorithm::Tree)
        .unwrap();
    assert_close!(ar.seconds, 2.0 * 3.0 * (NV_A + s / NV_B));
    assert_close!(ar.bytes_on("nvlink"), 2.0 * 7.0 / 8.0 * s);
    let bc = m
        .collective_time(CollectiveKind::Broadcast, s, &g, Algorithm::Tree)
        .unwrap();
    assert_close!(bc.seconds, 3.0 * (NV_A + s / NV_B));
    let ring_bc = m
        .collective_time(CollectiveKind::Broadcast, s, &g, Algorithm::Ring)
        .unwrap();
    assert_close!(ring_bc.seconds, 7.0 * NV_A + s / NV_B);
    // A group of 5 needs ceil(log2 5) = 3 levels.
    let m5 = model("gpu=5");
    let c = m5
        .collective_time(CollectiveKind::Broadcast, s, &g, Algorithm::Tree)
        .unwrap();
    assert_close!(c.seconds, 3.0 * (NV_A + s / NV_B));
    for kind in [
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllToAll,
    ] {
        assert!(matches!(
            m.collective_time(kind, s, &g, Algorithm::Tree),
            Err(CostError::Unsupported { .. })
        ));
    }
}

#[test]
fn best_collective_trades_latency_for_bandwidth() {
    let m = model("node=2,gpu=8");
    let g = Group::new(["gpu"]);
    let small = m
        .best_collective(CollectiveKind::AllReduce, 1024.0, &g)
        .unwrap();
    assert_eq!(small.algorithm, Algorithm::Tree);
    let big = m
        .best_collective(CollectiveKind::AllReduce, GIB, &g)
        .unwrap();
    assert_eq!(big.algorithm, Algorithm::Ring);
    let m = model("node=2,gpu=4");
    let both = Group::new(["node", "gpu"]);
    let big = m
        .best_collective(CollectiveKind::AllReduce, GIB, &both)
        .unwrap();
    assert_eq!(big.algorithm, Algorithm::Hierarchical);
    let ag = m
        .best_collective(CollectiveKind::AllGather, GIB, &both)
        .unwrap();
    assert_eq!(ag.algorithm, Algorithm::Hierarchical);
}

#[test]
fn split_axes_and_trivial_groups() {
    let m = model("node=2,gpu=2x4");
    let g = Group::new(["gpu.0", "gpu.1"]);
    let s = GIB;
    let c = m
        .collective_time(
            CollectiveKind::ReduceScatter,
            s,
            &g,
            Algorithm::Hierarchical,
        )
        .unwrap();
    assert_close!(
        c.seconds,
        3.0 * (NV_A + s / 4.0 / NV_B) + 1.0 * (NV_A + s / 4.0 / 2.0 / NV_B)
    );
    assert_eq!(m.group_link_classes(&g).len(), 1);
    // Size-1 axes and empty groups cost nothing.
    let m = model("node=1,gpu=8");
    for alg in [Algorithm::Ring, Algorithm::Hierarchical] {
        let c = m
            .collective_time(CollectiveKind::AllGather, s, &Group::new(["node"]), alg)
            .unwrap();
        assert_eq!((c.seconds, c.phases.len()), (0.0, 0));
        let c = m
            .collective_time(
                CollectiveKind::AllReduce,
                s,
                &Group::new(Vec::<String>::new()),
                alg,
            )
            .unwrap();
        assert_eq!(c.seconds, 0.0);
    }
    assert!(m.group_link_classes(&Group::new(["node"])).is_empty());
}

#[test]
fn bad_collective_inputs_are_errors() {
    let m = model("node=2,gpu=8");
    let k = CollectiveKind::AllGather;
    assert!(matches!(
        m.collective_time(k, 1.0, &Group::new(["rack"]), Algorithm::Ring),
        Err(CostError::UnknownAxis { .. })
    ));
    assert!(matches!(
        m.collective_time(k, 1.0, &Group::new(["gpu", "gpu"]), Algorithm::Ring),
        Err(CostError::DuplicateAxis { .. })
    ));
    for bad in [f64::NAN, -1.0, f64::INFINITY] {
        assert!(matches!(
            m.collective_time(k, bad, &Group::new(["gpu"]), Algorithm::Ring),
            Err(CostError::BadSize(_))
        ));
    }
    // A mesh axis without a link class is refused up front.
    let err = CostModel::new(h100(), Mesh::parse("rack=2,gpu=8").unwrap()).unwrap_err();
    assert!(err.message.contains("rack"), "{err}");
    // The free function, given such a mesh anyway, reports the missing link.
    let mesh = Mesh::parse("rack=2,gpu=8").unwrap();
    let r = collective_time(
        k,
        1.0,
        &Group::new(["rack"]),
        &mesh,
        &h100(),
        Algorithm::Ring,
    );
    assert!(matches!(r, Err(CostError::NoLink(_))));
}

#[test]
fn concurrent_streams_share_bandwidth() {
    assert_eq!(shared_bandwidth_time(1.0, 2.0, 3), 7.0);
    assert_eq!(shared_bandwidth_time(1.0, 2.0, 0), 3.0);
    let m = model("node=2,gpu=4");
    let s = GIB;
    let gpu = Group::new(["gpu"]);
    let c = m
        .collective_time(CollectiveKind::AllGather, s, &gpu, Algorithm::Ring)
        .unwrap();
    assert_close!(c.time_with_sharing(|_| 1), c.seconds);
    assert_close!(
        c.time_with_sharing(|l| if l == "nvlink" { 2 } else { 1 }),
        3.0 * NV_A + 2.0 * 3.0 * s / 4.0 / NV_B
    );
    // Sharing IB does not slow an NVLink-only collective.
    assert_close!(
        c.time_with_sharing(|l| if l == "ib" { 4 } else { 1 }),
        c.seconds
    );
    // A flat ring over both axes is paced by IB; doubling NVLink streams leaves it IB-bound
    // (450/2 GB/s still beats 50 GB/s), doubling IB streams doubles its bandwidth term.
    let both = Group::new(["node", "gpu"]);
    let f = m
        .collective_time(CollectiveKind::AllGather, s, &both, Algorithm::Ring)
        .unwrap();
    assert_close!(
        f.time_with_sharing(|l| if l == "nvlink" { 2 } else { 1 }),
        f.seconds
    );
    assert_close!(
        f.time_with_sharing(|l| if l == "ib" { 2 } else { 1 }),
        7.0 * IB_A + 2.0 * 7.0 * s / 8.0 / IB_B
    );
}

#[test]
fn collective_ops_are_costed_from_their_types() {
    let m = model("node=2,gpu=8");
    let mesh = m.mesh().clone();
    let g = Group::new(["gpu"]);
    let x = t(DType::BF16, &[128, 1024]);
    let ag = Op::AllGather {
        group: g.clone(),
        axis: 0,
    };
    let outs = ag.infer(&[&x], Some(&mesh)).unwrap();
    let c = m
        .op_collective_time(&ag, &[&x], &[&outs[0]], Algorithm::Ring)
        .unwrap()
        .unwrap();
    let full = (8 * 128 * 1024 * 2) as f64;
    assert_close!(c.seconds, 7.0 * (NV_A + full / 8.0 / NV_B));
    let rs = Op::ReduceScatter {
        group: g,
        axis: 0,
        reduce: ReduceOp::Sum,
    };
    let y = t(DType::F32, &[1024, 16]);
    let outs = rs.infer(&[&y], Some(&mesh)).unwrap();
    let c = m
        .op_collective_time(&rs, &[&y], &[&outs[0]], Algorithm::Ring)
        .unwrap()
        .unwrap();
    let full = (1024 * 16 * 4) as f64;
    assert_close!(c.seconds, 7.0 * (NV_A + full / 8.0 / NV_B));
    assert_eq!(
        m.op_collective_time(&Op::MatMul, &[], &[], Algorithm::Ring)
            .unwrap(),
        None
    );
    assert_eq!(m.memory_budget(), 80 << 30);
}

#[test]
fn moe_ops_and_routed_expert_products() {
    let f = DType::F32;
    let i = DType::I64;
    // 6 tokens of 8, 2 choices each, 3 experts of capacity 4
    let (flops, bytes, outs) = fb(
        &Op::MoeDispatch {
            experts: 3,
            capacity: 4,
        },
        vec![t(f, &[6, 8]), t(i, &[6, 2])],
    );
    assert_eq!(flops, 0.0);
    assert_eq!(bytes, ((6 * 8 + 3 * 4 * 8) * 4 + 2 * 6 * 2 * 8) as f64);
    assert_eq!(outs[0], t(f, &[3, 4, 8]));
    let combine_ins = vec![
        t(f, &[3, 4, 8]),
        t(i, &[6, 2]),
        t(i, &[6, 2]),
        t(f, &[6, 2]),
    ];
    let (flops, bytes, _) = fb(&Op::MoeCombine, combine_ins.clone());
    assert_eq!(flops, (2 * 6 * 2 * 8) as f64);
    // the 12 rows the choices name (of 12 in the buffer), indices, weights, the output
    assert_eq!(bytes, (12 * 8 * 4 + 2 * 12 * 8 + 12 * 4 + 6 * 8 * 4) as f64);
    let mut grad_ins = combine_ins;
    grad_ins.push(t(f, &[6, 8]));
    let (flops, _, _) = fb(&Op::MoeCombineGrad, grad_ins);
    assert_eq!(flops, (4 * 6 * 2 * 8) as f64);

    // preset:mixtral-8x7b's experts by shape (one op at a time): with capacity factor 1
    // their products are top_k / experts of the dense form's; dropless (capacity = tokens)
    // has the dense form's shapes (its filled rows: the next test).
    let expert_flops = |spec: &str| -> f64 {
        let p = hzp_frontends::presets::parse_preset(spec).unwrap();
        p.nodes
            .iter()
            .filter(|n| n.op == Op::MatMul && n.name.contains(".experts."))
            .map(|n| {
                let ins: Vec<&TensorType> = n.inputs.iter().map(|&v| p.ty(v)).collect();
                let outs: Vec<&TensorType> = n.outputs.iter().map(|&v| p.ty(v)).collect();
                op_flops(&n.op, &ins, &outs)
            })
            .sum()
    };
    let base = "preset:mixtral-8x7b,layers=1,seq=512";
    let dense = expert_flops(&format!("{base},dense=true"));
    let routed = expert_flops(&format!("{base},capacity_factor=1"));
    let dropless = expert_flops(base);
    assert!(dense > 0.0);
    assert_close!(routed / dense, 2.0 / 8.0);
    assert_close!(dropless, dense);
}

/// The experts' products of `preset:moe` (Mixtral's shapes, one layer) forward and
/// backward: FLOPs by shape ([`op_flops`]) and FLOPs of the filled rows (times
/// [`filled_fractions`]). A dropless layer's filled rows are the balanced share `T K / E`
/// rows per expert, so its products do `top_k / experts` of the dense form's work; the
/// dense form's FLOPs (every expert on every token, no buffer) are counted by shape only,
/// with nothing of the fill analysis.
#[test]
fn dropless_expert_products_cost_top_k_over_experts_of_dense() {
    use hzp_passes::cost::moe::filled_fractions;
    use hzp_passes::train::{gradient_program, LossKind};
    // (flops by shape, flops of the filled rows) of the expert products of the step
    let expert_flops = |spec: &str| -> (f64, f64) {
        let fwd = hzp_frontends::presets::parse_preset(spec).unwrap();
        let p = gradient_program(&fwd, &LossKind::Lm { labels: None }).unwrap();
        let frac = filled_fractions(&p);
        let (mut shaped, mut filled, mut count) = (0.0, 0.0, 0);
        for (i, n) in p.nodes.iter().enumerate() {
            // the expert products: a result batched over the 8 experts, whatever the names
            let ins: Vec<&TensorType> = n.inputs.iter().map(|&v| p.ty(v)).collect();
            let batched = |t: &TensorType| t.shape.len() == 3 && t.shape[0] == 8;
            if n.op != Op::MatMul || !batched(p.ty(n.outputs[0])) {
                continue;
            }
            count += 1;
            let outs: Vec<&TensorType> = n.outputs.iter().map(|&v| p.ty(v)).collect();
            let f = op_flops(&n.op, &ins, &outs);
            shaped += f;
            filled += f * frac[i];
        }
        // gate_up and down, forward, input gradient and weight gradient
        assert_eq!(count, 6, "{spec}");
        (shaped, filled)
    };
    // 256 tokens (one sequence), top 2 of 8 experts
    let base =
        "preset:moe,layers=1,seq=256,batch=1,hidden=512,ffn=1024,heads=8,kv_heads=8,vocab=1000";
    let dense = expert_flops(&format!("{base},dense=true"));
    let dropless = expert_flops(base);
    let capacity = expert_flops(&format!("{base},capacity_factor=1.25"));
    // by shape, dropless is the dense form's work; its filled rows are a quarter of it
    assert!(dense.0 > 0.0);
    assert_eq!(dense.1, dense.0);
    assert_eq!(dropless.0, dense.0);
    assert_close!(dropless.1 / dense.0, 2.0 / 8.0);
    // with a capacity factor the capacity is charged: ceil(1.25 * 256 * 2 / 8) = 80 rows
    assert_eq!(capacity.1, capacity.0);
    assert_close!(capacity.1 / dense.0, 80.0 / 256.0);
    // an odd split rounds up: 100 tokens, 2 choices of 8 experts, ceil(200 / 8) = 25 rows
    let odd = "preset:moe,layers=1,seq=50,batch=2,hidden=64,ffn=128,heads=4,kv_heads=4,vocab=100";
    let (odd_dense, odd_dropless) = (
        expert_flops(&format!("{odd},dense=true")),
        expert_flops(odd),
    );
    assert_close!(odd_dropless.1 / odd_dense.0, 25.0 / 100.0);
}

/// The MoE blocks of the tiny Mixtral's ONNX exports, routed on import (the products on
/// the stacked weights, row-wise ops between them as the exporter wrote them): every
/// product batched over the 4 experts, forward and backward, is charged its filled rows,
/// the balanced share ceil(32 * 2 / 4) = 16 of the buffer's 32 (2 x 16 tokens).
#[test]
fn imported_moe_blocks_are_charged_their_filled_rows() {
    use hzp_frontends::{load_model, npz, LoadOptions};
    use hzp_passes::cost::moe::filled_fractions;
    use hzp_passes::train::{gradient_program, LossKind};
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/models");
    let io = npz::read(&dir.join("moe_tiny.io.npz")).unwrap();
    let ids = io.iter().find(|(k, _)| k == "input_ids").unwrap().1.clone();
    assert_eq!(ids.shape, vec![2, 16]);
    for model in ["moe_tiny.legacy.op17.onnx", "moe_tiny.dynamo.op18.onnx"] {
        let opts = LoadOptions {
            shapes: [("input_ids".to_string(), ids.shape.clone())].into(),
            values: [("input_ids".to_string(), ids.clone())].into(),
            ..Default::default()
        };
        let fwd = load_model(dir.join(model).to_str().unwrap(), &opts).unwrap();
        assert!(fwd.nodes.iter().any(|n| n.op.name() == "MoeDispatch"));
        let p = gradient_program(&fwd, &LossKind::Lm { labels: None }).unwrap();
        let frac = filled_fractions(&p);
        let products: Vec<f64> = p
            .nodes
            .iter()
            .zip(&frac)
            .filter(|(n, _)| {
                let out = n.outputs.first().map(|&v| &p.ty(v).shape[..]);
                n.op == Op::MatMul && matches!(out, Some([4, _, _]))
            })
            .map(|(_, &f)| f)
            .collect();
        // 2 layers: gate, up and down products, each with its input and weight gradients
        assert!(products.len() >= 12, "{model}: {} products", products.len());
        assert!(products.iter().all(|&f| f == 0.5), "{model}: {products:?}");
    }
}
