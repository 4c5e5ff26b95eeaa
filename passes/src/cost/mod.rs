//! The analytical cost model: FLOPs and bytes of every op, a roofline for compute time, and an
//! alpha-beta model for collectives on the axes of a mesh. Pure functions of shapes and a
//! [`ClusterSpec`]; the sharding planner ranks choices with it and the simulator replays a
//! schedule with it.
//!
//! # Compute
//!
//! `time = launch_overhead + max(flops / (peak * efficiency), bytes / (memory_bandwidth *
//! memory_efficiency))`. MatMuls run on the matrix units at the peak of their compute dtype
//! (`peak_bf16`, `peak_fp16`, `peak_fp32`) times `matmul_efficiency`; every other op runs on the
//! vector units at the fp32 (non-tensor) peak times `vector_efficiency`. Ops that do no work
//! (views, events, frees) cost 0, without the launch overhead. A fused `Attention` /
//! `AttentionGrad` runs its products on the matrix units and its softmax on the vector units. Collectives cost 0 here: their
//! time comes from [`collective_time`].
//!
//! FLOP counts ([`op_flops`]) per output element unless noted; a transcendental or
//! special-function op (exp, log, tanh, erf, sin, cos, sqrt, rsqrt, reciprocal) counts
//! [`TRANSCENDENTAL_FLOPS`]:
//!
//! | op | FLOPs |
//! |---|---|
//! | MatMul | `2 * M * N * K * batch` (= 2 * numel(out) * K) |
//! | Neg Abs Relu Sign Floor Ceil Not IsNaN, binary ops, Where, Cast | 1 |
//! | Exp Log Tanh Erf Sin Cos Sqrt Rsqrt Reciprocal | T |
//! | Sigmoid | T + 2 (exp(-x), 1 +, reciprocal counted in T) |
//! | Silu | T + 3 |
//! | Gelu (erf) | T + 4 |
//! | GeluTanh | T + 7 (x^3, two scales, add, tanh, 1 +, 0.5 x) |
//! | Pow | 2T + 1 (exp(y ln x)) |
//! | Softmax, LogSoftmax | T + 4 per element (max, subtract, exp, sum, scale) |
//! | SoftmaxCrossEntropy | T + 3 per logit (max, subtract, exp, sum) |
//! | SoftmaxCrossEntropyGrad | 2T + 5 per logit (the forward's sums again, then exp, scale, subtract) |
//! | GeluTanhGrad | T + 14 per element |
//! | AdamW | T + 13 per parameter element (the sqrt, and 13 multiplies, adds and divides) |
//! | LayerNorm | 7 per element (6 without bias) + T + 3 per normalized row |
//! | RmsNorm | 4 per element + T + 2 per normalized row |
//! | LayerNormGrad | 17 per element (the statistics, then two sweeps: the row sums of g = dy * scale and g * xhat, then dx) + T + 5 per normalized row |
//! | RmsNormGrad | 14 per element + T + 4 per normalized row |
//! | Attention | per (query, key) pair a head computes: `2 D + 2 Dv` (q.k and p v) + T + 4 (online softmax); pairs = `B Hq T S`, about half with `causal` ([`attention_pairs`]) |
//! | AttentionGrad | per pair, as FlashAttention-2's backward: q.k again, dO.v, p dO into dV, ds k into dQ, ds q into dK: `6 D + 4 Dv` (2.5x the forward's products for D = Dv) + T + 4 |
//! | Reduce sum/max/min/prod, ArgMax, CumSum | numel(input) (+ numel(output) for mean) |
//! | TopK | numel(input) * ceil(log2(max(k, 2))) comparisons |
//! | ScatterElements/ScatterND with add | numel(updates) |
//! | MoeCombine | `2 T K H` (a multiply-add per choice and hidden element) |
//! | MoeCombineGrad | `4 T K H` (the weighted gradient rows and the weights' dot products) |
//! | MoeDispatch | 0 (a copy per choice) |
//! | data movement, indexing, Fill, OneHot, Copy, collectives, memory, events | 0 |
//!
//! Bytes ([`op_bytes`]) are bytes read plus bytes written, assuming each operand is touched
//! once: inputs + outputs by default. Exceptions: Reshape and Identity are views (0); Slice
//! reads only the slice (2 * output); Gather, GatherElements and GatherND read the gathered
//! rows, not the whole table (2 * output + indices); MoeCombine and MoeCombineGrad read the
//! experts' rows the `T K` choices name, not the whole `[E,C,H]` buffer; Fill writes its
//! output; Free and the event ops touch nothing.
//!
//! The experts' products of a routed MoE layer are batched MatMuls over the dispatched
//! `[E, C, H]` tensor. [`op_flops`] sees one op and its shapes, so it charges `E C` rows per
//! product: `capacity_factor * T K` rows (about `top_k / experts` of the dense form's `E T`)
//! with a capacity factor, `E T` (the dense count) when the layer is dropless (`C = T`).
//! Most of a dropless buffer's rows are zero, and the kernels leave them out; with the
//! program at hand, [`moe::filled_fractions`] gives each product's share of its FLOPs that
//! the filled rows take, assuming balanced routing (the balanced share `ceil(T K / E)` rows
//! per expert; `C` with a capacity factor), and [`Roofline::with_flop_fraction`] applies it.
//! The simulator charges that (docs/moe.md).
//!
//! # Collectives
//!
//! Alpha-beta per link class: a message of `m` bytes over a link costs `latency + m /
//! (bandwidth * efficiency)`. With `S` the full tensor (see [`collective_time`] for what it is
//! per kind) and `n` the group size:
//!
//! | algorithm | AllGather, ReduceScatter, AllToAll | AllReduce | Broadcast |
//! |---|---|---|---|
//! | Ring | `(n-1) (a + S/(n B))` | `2 (n-1) (a + S/(n B))` | `(n-1) a + S/B` (pipelined chain) |
//! | Tree | unsupported | `2 L (a + S/B)` | `L (a + S/B)` (binomial, `L = ceil(log2 n)`) |
//! | Hierarchical | one ring per axis (below) | RS inner, AR outer, AG inner | outer axis first |
//!
//! Ring and Tree run over the whole group at once: every step waits for the slowest edge, so
//! `B` is the smallest effective bandwidth and `a` the largest latency of the group's links.
//! Hierarchical runs one ring per axis, each on its own link class: ReduceScatter innermost axis
//! first (each later axis works on a tensor already divided by the inner sizes), AllGather
//! outermost first (gathering tensors that still lack the inner factors), AllReduce =
//! ReduceScatter over the inner axes, AllReduce over the outermost, AllGather back over the
//! inner axes; Broadcast and AllToAll run each axis on the full `S` (outermost first for
//! Broadcast, innermost first for AllToAll). Axes of size 1 are skipped.
//!
//! Concurrent collectives on one link class share its bandwidth fairly:
//! [`CollectiveCost::time_with_sharing`] and [`shared_bandwidth_time`] scale the bandwidth term
//! by the number of streams, the latency term stays.

pub mod cluster;
pub mod moe;

use crate::cost::cluster::{ClusterError, ClusterSpec, Link};
use hzp_ir::{numel, BinaryOp, DType, Group, Mesh, Op, ReduceOp, TensorType, UnaryOp};
use serde::{Deserialize, Serialize};
use std::fmt;

/// FLOPs charged for one transcendental / special-function evaluation (exp, log, tanh, erf,
/// sin, cos, sqrt, rsqrt, reciprocal): GPUs run these on special-function units at a fraction
/// of the FMA rate, and library implementations take a few instructions.
pub const TRANSCENDENTAL_FLOPS: f64 = 4.0;

const T: f64 = TRANSCENDENTAL_FLOPS;

fn numel_f(t: &TensorType) -> f64 {
    t.shape.iter().map(|&d| d as f64).product()
}

fn bytes_f(t: &TensorType) -> f64 {
    numel_f(t) * t.dtype.size_bytes() as f64
}

fn sum_bytes(ts: &[&TensorType]) -> f64 {
    ts.iter().map(|t| bytes_f(t)).sum()
}

fn unary_flops(u: UnaryOp) -> f64 {
    match u {
        UnaryOp::Neg
        | UnaryOp::Abs
        | UnaryOp::Relu
        | UnaryOp::Sign
        | UnaryOp::Floor
        | UnaryOp::Ceil
        | UnaryOp::Not
        | UnaryOp::IsNaN => 1.0,
        UnaryOp::Exp
        | UnaryOp::Log
        | UnaryOp::Tanh
        | UnaryOp::Erf
        | UnaryOp::Sin
        | UnaryOp::Cos
        | UnaryOp::Sqrt
        | UnaryOp::Rsqrt
        | UnaryOp::Reciprocal => T,
        UnaryOp::Sigmoid => T + 2.0,
        UnaryOp::Silu => T + 3.0,
        UnaryOp::Gelu => T + 4.0,
        UnaryOp::GeluTanh => T + 7.0,
    }
}

fn binary_flops(b: BinaryOp) -> f64 {
    match b {
        BinaryOp::Pow => 2.0 * T + 1.0,
        _ => 1.0,
    }
}

/// Elements of `x` per normalized row (axes `axis..rank`) and the number of rows.
fn rows(x: &TensorType, axis: usize) -> (f64, f64) {
    let axis = axis.min(x.rank());
    let inner = numel(&x.shape[axis..]) as f64;
    let outer = numel(&x.shape[..axis]) as f64;
    (inner, outer)
}

/// Floating-point operations of one op. `ins`/`outs` are its operand and result types (as
/// [`Op::infer`] takes and returns them); missing operands count as empty. See the module docs
/// for the table of counts.
pub fn op_flops(op: &Op, ins: &[&TensorType], outs: &[&TensorType]) -> f64 {
    let out_numel = outs.first().map_or(0.0, |t| numel_f(t));
    let in_numel = ins.first().map_or(0.0, |t| numel_f(t));
    match op {
        Op::Unary(u) => unary_flops(*u) * out_numel,
        Op::Binary(b) => binary_flops(*b) * out_numel,
        Op::Where | Op::Cast { .. } => out_numel,
        Op::MatMul => {
            // K is the last dim of the left operand for every rank (a rank-1 left operand is
            // a row vector); numel(out) = batch * M * N.
            let k = ins
                .first()
                .and_then(|a| a.shape.last())
                .copied()
                .unwrap_or(0) as f64;
            2.0 * out_numel * k
        }
        Op::Softmax { .. } | Op::LogSoftmax { .. } => (T + 4.0) * in_numel,
        Op::SoftmaxCrossEntropy { .. } => (T + 3.0) * ins.first().map_or(0.0, |t| numel_f(t)),
        Op::SoftmaxCrossEntropyGrad { .. } => (2.0 * T + 5.0) * out_numel,
        Op::AdamW { .. } => (T + 13.0) * out_numel,
        Op::GeluTanhGrad => (T + 14.0) * out_numel,
        Op::LayerNorm { axis, .. } => {
            let Some(x) = ins.first() else { return 0.0 };
            let (inner, outer) = rows(x, *axis);
            let per_elem = if ins.len() >= 3 { 7.0 } else { 6.0 };
            outer * (inner * per_elem + T + 3.0)
        }
        Op::RmsNorm { axis, .. } => {
            let Some(x) = ins.first() else { return 0.0 };
            let (inner, outer) = rows(x, *axis);
            outer * (inner * 4.0 + T + 2.0)
        }
        Op::LayerNormGrad { axis, .. } | Op::RmsNormGrad { axis, .. } => {
            let Some(x) = ins.first() else { return 0.0 };
            let (inner, outer) = rows(x, *axis);
            if matches!(op, Op::LayerNormGrad { .. }) {
                outer * (inner * 17.0 + T + 5.0)
            } else {
                outer * (inner * 14.0 + T + 4.0)
            }
        }
        Op::Attention { .. } | Op::AttentionGrad { .. } => {
            let (products, softmax) = attention_flops(op, ins);
            products + softmax
        }
        Op::Reduce { op: r, .. } => {
            if *r == ReduceOp::Mean {
                in_numel + out_numel
            } else {
                in_numel
            }
        }
        Op::ArgMax { .. } | Op::CumSum { .. } => in_numel,
        Op::TopK { k, .. } => in_numel * ((*k).max(2) as f64).log2().ceil(),
        Op::MoeCombine | Op::MoeCombineGrad => {
            let per = if matches!(op, Op::MoeCombine) {
                2.0
            } else {
                4.0
            };
            let choices = ins.get(1).map_or(0.0, |t| numel_f(t));
            let h = ins
                .first()
                .and_then(|t| t.shape.last())
                .map_or(0.0, |&h| h as f64);
            per * choices * h
        }
        Op::ScatterElements { add, .. } | Op::ScatterND { add } => {
            if *add {
                ins.get(2).map_or(0.0, |t| numel_f(t))
            } else {
                0.0
            }
        }
        Op::Identity
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Split { .. }
        | Op::Expand { .. }
        | Op::Tile { .. }
        | Op::Trilu { .. }
        | Op::Gather { .. }
        | Op::GatherElements { .. }
        | Op::GatherND { .. }
        | Op::OneHot { .. }
        | Op::MoeDispatch { .. }
        | Op::Fill { .. }
        | Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllReduce { .. }
        | Op::AllToAll { .. }
        | Op::Broadcast { .. }
        | Op::Copy
        | Op::Free
        | Op::RecordEvent { .. }
        | Op::WaitEvent { .. } => 0.0,
    }
}

/// An attention's FLOPs as (products on the matrix units, softmax work on the vector
/// units); see the module docs. (0, 0) for other ops.
pub fn attention_flops(op: &Op, ins: &[&TensorType]) -> (f64, f64) {
    let (Op::Attention { causal, .. } | Op::AttentionGrad { causal, .. }) = op else {
        return (0.0, 0.0);
    };
    let [Some(q), Some(k), Some(v)] = [0, 1, 2].map(|i| ins.get(i)) else {
        return (0.0, 0.0);
    };
    let (Some(&d), Some(&dv)) = (q.shape.last(), v.shape.last()) else {
        return (0.0, 0.0);
    };
    let (d, dv) = (d as f64, dv as f64);
    let pairs = attention_pairs(q, k, *causal);
    let products = if matches!(op, Op::Attention { .. }) {
        2.0 * d + 2.0 * dv
    } else {
        6.0 * d + 4.0 * dv
    };
    (pairs * products, pairs * (T + 4.0))
}

/// The (query, key) pairs an attention with q [B,Hq,T,D] and k [B,Hkv,S,D] computes:
/// `B Hq T S`, or with `causal` (key j <= query i) only the pairs on or below the diagonal.
pub fn attention_pairs(q: &TensorType, k: &TensorType, causal: bool) -> f64 {
    if q.rank() != 4 || k.rank() != 4 {
        return 0.0;
    }
    let heads = (q.shape[0] * q.shape[1]) as f64;
    let (t, s) = (q.shape[2] as f64, k.shape[2] as f64);
    if !causal {
        return heads * t * s;
    }
    // row i sees min(i + 1, S) keys
    let full = t.min(s); // rows 0..full see i + 1 keys
    heads * (full * (full + 1.0) / 2.0 + (t - full) * s)
}

/// Bytes an op reads plus bytes it writes in device memory. See the module docs for the
/// exceptions to "inputs + outputs".
pub fn op_bytes(op: &Op, ins: &[&TensorType], outs: &[&TensorType]) -> f64 {
    let out = sum_bytes(outs);
    match op {
        // views take their input's bytes; frees and events move none
        Op::Reshape { .. }
        | Op::Identity
        | Op::Free
        | Op::RecordEvent { .. }
        | Op::WaitEvent { .. } => 0.0,
        // reads only the part it keeps
        Op::Slice { .. } => 2.0 * out,
        // reads the indices and the rows it gathers
        Op::Gather { .. } | Op::GatherElements { .. } | Op::GatherND { .. } => {
            2.0 * out + ins.get(1).map_or(0.0, |t| bytes_f(t))
        }
        // reads the experts' rows its choices name, and the rest of its inputs
        Op::MoeCombine | Op::MoeCombineGrad => {
            let (Some(ye), Some(choices)) = (ins.first(), ins.get(1)) else {
                return sum_bytes(ins) + out;
            };
            let h = ye.shape.last().copied().unwrap_or(0) as f64;
            let rows = (numel_f(choices) * h).min(numel_f(ye)) * ye.dtype.size_bytes() as f64;
            sum_bytes(ins) - bytes_f(ye) + rows + out
        }
        // writes only
        Op::Fill { .. } => out,
        // reads every input once and writes every output once
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Where
        | Op::GeluTanhGrad
        | Op::Cast { .. }
        | Op::MatMul
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::SoftmaxCrossEntropy { .. }
        | Op::SoftmaxCrossEntropyGrad { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::LayerNormGrad { .. }
        | Op::RmsNormGrad { .. }
        | Op::Attention { .. }
        | Op::AttentionGrad { .. }
        | Op::Reduce { .. }
        | Op::ArgMax { .. }
        | Op::CumSum { .. }
        | Op::Transpose { .. }
        | Op::Concat { .. }
        | Op::Split { .. }
        | Op::Expand { .. }
        | Op::Tile { .. }
        | Op::Trilu { .. }
        | Op::ScatterElements { .. }
        | Op::ScatterND { .. }
        | Op::OneHot { .. }
        | Op::TopK { .. }
        | Op::MoeDispatch { .. }
        | Op::AdamW { .. }
        | Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllReduce { .. }
        | Op::AllToAll { .. }
        | Op::Broadcast { .. }
        | Op::Copy => sum_bytes(ins) + out,
    }
}

/// Which resource bounds an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Bound {
    /// No work at all (views, events).
    None,
    Compute,
    Memory,
}

/// The roofline of one op on one device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Roofline {
    pub flops: f64,
    pub bytes: f64,
    /// `flops / (peak * efficiency)`.
    pub compute_s: f64,
    /// `bytes / (memory_bandwidth * memory_efficiency)`.
    pub memory_s: f64,
    /// The launch overhead charged (0 for ops without work).
    pub overhead_s: f64,
    /// `overhead_s + max(compute_s, memory_s)`.
    pub seconds: f64,
    pub bound: Bound,
}

impl Roofline {
    /// The roofline of the op doing `fraction` (in `[0, 1]`) of its FLOPs: a product over
    /// an expert buffer's filled rows ([`moe::filled_fractions`]). The bytes stay (the
    /// result is written whole). `self` unchanged for a fraction of 1 or one out of range.
    pub fn with_flop_fraction(self, fraction: f64) -> Roofline {
        if !(0.0..1.0).contains(&fraction) || self.flops <= 0.0 {
            return self;
        }
        let compute_s = self.compute_s * fraction;
        let bound = if self.bound == Bound::None {
            Bound::None
        } else if compute_s >= self.memory_s {
            Bound::Compute
        } else {
            Bound::Memory
        };
        Roofline {
            flops: self.flops * fraction,
            compute_s,
            seconds: self.overhead_s + compute_s.max(self.memory_s),
            bound,
            ..self
        }
    }
}

/// Peak FLOP/s of the matrix units for a compute dtype (integers use the fp32 peak).
pub fn matmul_peak(spec: &ClusterSpec, dtype: DType) -> f64 {
    let d = &spec.device;
    match dtype {
        DType::BF16 => d.peak_flops_bf16,
        DType::F16 => d.peak_flops_fp16.unwrap_or(d.peak_flops_bf16),
        DType::F32 | DType::I64 | DType::I32 | DType::Bool => d.peak_flops_fp32,
    }
}

/// The roofline of `op` with operand types `ins` and result types `outs`. `dtype` is the
/// precision the op computes in (it picks the matmul peak; e.g. bf16 for a mixed-precision plan
/// even if the types say f32). Collectives get 0 here (see [`collective_time`]).
pub fn roofline(
    op: &Op,
    ins: &[&TensorType],
    outs: &[&TensorType],
    spec: &ClusterSpec,
    dtype: DType,
) -> Roofline {
    let d = &spec.device;
    if op.is_collective() {
        return Roofline {
            flops: 0.0,
            bytes: 0.0,
            compute_s: 0.0,
            memory_s: 0.0,
            overhead_s: 0.0,
            seconds: 0.0,
            bound: Bound::None,
        };
    }
    let flops = op_flops(op, ins, outs);
    let bytes = op_bytes(op, ins, outs);
    let matrix = matmul_peak(spec, dtype) * d.matmul_efficiency;
    let vector = d.peak_flops_fp32 * d.vector_efficiency;
    let compute_s = match op {
        _ if flops <= 0.0 => 0.0,
        Op::MatMul => flops / matrix,
        // fused attention: its products on the matrix units, its softmax on the vector units
        Op::Attention { .. } | Op::AttentionGrad { .. } => {
            let (products, softmax) = attention_flops(op, ins);
            products / matrix + softmax / vector
        }
        _ => flops / vector,
    };
    let memory_s = if bytes > 0.0 {
        bytes / (d.memory_bandwidth * d.memory_efficiency)
    } else {
        0.0
    };
    let (bound, overhead_s) = if flops == 0.0 && bytes == 0.0 {
        (Bound::None, 0.0)
    } else if compute_s >= memory_s {
        (Bound::Compute, d.launch_overhead)
    } else {
        (Bound::Memory, d.launch_overhead)
    };
    Roofline {
        flops,
        bytes,
        compute_s,
        memory_s,
        overhead_s,
        seconds: overhead_s + compute_s.max(memory_s),
        bound,
    }
}

/// Seconds `op` takes on one device: [`roofline`]'s `seconds`.
pub fn compute_time(
    op: &Op,
    ins: &[&TensorType],
    outs: &[&TensorType],
    spec: &ClusterSpec,
    dtype: DType,
) -> f64 {
    roofline(op, ins, outs, spec, dtype).seconds
}

// ---------------------------------------------------------------------------------------------
// Collectives

/// The collectives of the IR.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CollectiveKind {
    AllGather,
    ReduceScatter,
    AllReduce,
    AllToAll,
    Broadcast,
}

impl CollectiveKind {
    /// The kind of a collective op; `None` for other ops.
    pub fn of(op: &Op) -> Option<CollectiveKind> {
        Some(match op {
            Op::AllGather { .. } => CollectiveKind::AllGather,
            Op::ReduceScatter { .. } => CollectiveKind::ReduceScatter,
            Op::AllReduce { .. } => CollectiveKind::AllReduce,
            Op::AllToAll { .. } => CollectiveKind::AllToAll,
            Op::Broadcast { .. } => CollectiveKind::Broadcast,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllGather => "AllGather",
            CollectiveKind::ReduceScatter => "ReduceScatter",
            CollectiveKind::AllReduce => "AllReduce",
            CollectiveKind::AllToAll => "AllToAll",
            CollectiveKind::Broadcast => "Broadcast",
        }
    }

    /// The `bytes_per_rank` argument of [`collective_time`] for an op with these operand and
    /// result types: the output for AllGather, the input otherwise.
    pub fn full_bytes(self, ins: &[&TensorType], outs: &[&TensorType]) -> f64 {
        match self {
            CollectiveKind::AllGather => outs.first().map_or(0.0, |t| bytes_f(t)),
            _ => ins.first().map_or(0.0, |t| bytes_f(t)),
        }
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a collective is carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Algorithm {
    /// One ring over the whole group (pairwise exchange for AllToAll, pipelined chain for
    /// Broadcast), paced by the group's slowest link.
    Ring,
    /// Binomial tree over the whole group: AllReduce (reduce then broadcast) and Broadcast.
    Tree,
    /// One ring per mesh axis, each on its own link class.
    Hierarchical,
}

impl Algorithm {
    pub const ALL: [Algorithm; 3] = [Algorithm::Ring, Algorithm::Tree, Algorithm::Hierarchical];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
            Algorithm::Hierarchical => "hierarchical",
        }
    }

    /// Whether this algorithm implements `kind`.
    pub fn supports(self, kind: CollectiveKind) -> bool {
        match self {
            Algorithm::Tree => {
                matches!(kind, CollectiveKind::AllReduce | CollectiveKind::Broadcast)
            }
            _ => true,
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a collective cannot be costed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CostError {
    #[error("group {group} names axis `{axis}`, which is not in the mesh {mesh}")]
    UnknownAxis {
        group: String,
        axis: String,
        mesh: String,
    },
    #[error("group {group} lists axis `{axis}` twice")]
    DuplicateAxis { group: String, axis: String },
    #[error(transparent)]
    NoLink(#[from] ClusterError),
    #[error("the {algorithm} algorithm does not implement {kind} (use ring or hierarchical)")]
    Unsupported {
        kind: CollectiveKind,
        algorithm: Algorithm,
    },
    #[error("collective size {0} is not a finite, non-negative number of bytes")]
    BadSize(f64),
}

/// One step of a collective: a ring or tree over some axes of the group.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CollectivePhase {
    /// What this phase does (a Hierarchical AllReduce has ReduceScatter, AllReduce and
    /// AllGather phases).
    pub kind: CollectiveKind,
    pub algorithm: Algorithm,
    /// The mesh axes of this phase, outermost first.
    pub axes: Vec<String>,
    /// Ranks in one instance of this phase.
    pub group_size: usize,
    /// The full tensor size this phase works on (same meaning as `bytes_per_rank` of
    /// [`collective_time`], for this phase's kind).
    pub bytes: f64,
    /// Latency term: messages in sequence times the (slowest) link latency.
    pub latency_s: f64,
    /// Bandwidth term if each link class alone paced the phase, per link class; the phase
    /// takes the largest.
    pub link_times: Vec<(String, f64)>,
    /// Mean bytes one rank sends over each link class in this phase.
    pub bytes_sent_per_rank_per_link: Vec<(String, f64)>,
}

impl CollectivePhase {
    /// `latency_s + max(link_times)`.
    pub fn seconds(&self) -> f64 {
        self.latency_s + self.link_times.iter().map(|(_, t)| *t).fold(0.0, f64::max)
    }

    /// Seconds when `streams(link)` collectives share each link class fairly.
    pub fn seconds_shared(&self, streams: &dyn Fn(&str) -> usize) -> f64 {
        self.latency_s
            + self
                .link_times
                .iter()
                .map(|(l, t)| t * streams(l).max(1) as f64)
                .fold(0.0, f64::max)
    }
}

/// The cost of one collective on one rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CollectiveCost {
    pub kind: CollectiveKind,
    pub algorithm: Algorithm,
    /// Wall time, the sum of the phases' times.
    pub seconds: f64,
    /// Mean bytes one rank sends over each link class (link name, bytes), in the order the
    /// link classes are first used. Every rank sends the same amount in ring phases; in tree and
    /// broadcast phases this is the total traffic divided by the ranks.
    pub bytes_sent_per_rank_per_link: Vec<(String, f64)>,
    pub phases: Vec<CollectivePhase>,
}

impl CollectiveCost {
    fn from_phases(
        kind: CollectiveKind,
        algorithm: Algorithm,
        phases: Vec<CollectivePhase>,
    ) -> Self {
        let mut per_link: Vec<(String, f64)> = Vec::new();
        for p in &phases {
            for (l, b) in &p.bytes_sent_per_rank_per_link {
                add_to(&mut per_link, l, *b);
            }
        }
        CollectiveCost {
            kind,
            algorithm,
            seconds: phases.iter().map(CollectivePhase::seconds).sum(),
            bytes_sent_per_rank_per_link: per_link,
            phases,
        }
    }

    /// Bytes one rank sends over the link class `link` (0 if unused).
    pub fn bytes_on(&self, link: &str) -> f64 {
        self.bytes_sent_per_rank_per_link
            .iter()
            .find(|(l, _)| l == link)
            .map_or(0.0, |(_, b)| *b)
    }

    /// Seconds when `streams(link)` concurrent collectives (this one included) share each link
    /// class: each phase's bandwidth term on a link is multiplied by its stream count (fair
    /// share), latencies stay. With one stream everywhere this is `seconds`.
    pub fn time_with_sharing(&self, streams: impl Fn(&str) -> usize) -> f64 {
        self.phases.iter().map(|p| p.seconds_shared(&streams)).sum()
    }
}

fn add_to(v: &mut Vec<(String, f64)>, link: &str, b: f64) {
    match v.iter_mut().find(|(l, _)| l == link) {
        Some((_, x)) => *x += b,
        None => v.push((link.to_string(), b)),
    }
}

/// Time of a transfer whose bandwidth term is `bandwidth_s` on its own when `streams`
/// transfers share the link fairly: `latency_s + bandwidth_s * max(streams, 1)`.
pub fn shared_bandwidth_time(latency_s: f64, bandwidth_s: f64, streams: usize) -> f64 {
    latency_s + bandwidth_s * streams.max(1) as f64
}

/// A group axis with its size and link, in mesh order.
struct AxisLink<'a> {
    name: &'a str,
    size: usize,
    link: &'a Link,
}

/// The group's axes of size > 1, outermost first (mesh order), with their links.
fn resolve<'a>(
    group: &'a Group,
    mesh: &'a Mesh,
    spec: &'a ClusterSpec,
) -> Result<Vec<AxisLink<'a>>, CostError> {
    for (i, a) in group.axes.iter().enumerate() {
        if group.axes[..i].contains(a) {
            return Err(CostError::DuplicateAxis {
                group: group.to_string(),
                axis: a.clone(),
            });
        }
        if mesh.axis(a).is_none() {
            return Err(CostError::UnknownAxis {
                group: group.to_string(),
                axis: a.clone(),
                mesh: mesh.to_string(),
            });
        }
    }
    let mut out = Vec::new();
    for ax in &mesh.axes {
        if ax.size > 1 && group.axes.contains(&ax.name) {
            out.push(AxisLink {
                name: &ax.name,
                size: ax.size,
                link: spec.link_for_axis(&ax.name)?,
            });
        }
    }
    Ok(out)
}

/// Messages per link class of a spanning structure over the mixed-radix group `axes` (outermost
/// first): a broadcast done axis by axis sends `prod(outer sizes) * (size - 1)` messages on axis
/// j, `n - 1` in all. A ring in mixed-radix order has the same counts plus its closing edge,
/// which crosses the outermost axis (`n` in all).
fn edge_counts(axes: &[AxisLink], ring: bool) -> Vec<f64> {
    let mut outer = 1.0;
    let mut counts = Vec::new();
    for (j, a) in axes.iter().enumerate() {
        let mut c = outer * (a.size as f64 - 1.0);
        if ring && j == 0 {
            c += 1.0;
        }
        counts.push(c);
        outer *= a.size as f64;
    }
    counts
}

/// Peers of a rank whose outermost differing axis is axis j: `(size_j - 1) * prod(inner
/// sizes)`, `n - 1` in all. An AllToAll sends the same amount to every peer.
fn peer_counts(axes: &[AxisLink]) -> Vec<f64> {
    (0..axes.len())
        .map(|j| {
            let inner: f64 = axes[j + 1..].iter().map(|a| a.size as f64).product();
            (axes[j].size as f64 - 1.0) * inner
        })
        .collect()
}

/// One ring or tree phase over `axes` (all at once, paced by the slowest link).
fn flat_phase(
    kind: CollectiveKind,
    algorithm: Algorithm,
    axes: &[AxisLink],
    bytes: f64,
) -> CollectivePhase {
    let n: usize = axes.iter().map(|a| a.size).product();
    let nf = n as f64;
    let alpha = axes.iter().map(|a| a.link.latency).fold(0.0, f64::max);
    // (messages in sequence, bytes per message, wire bytes per rank, ring-shaped?)
    let (steps, bandwidth_bytes, wire, ring) = match (algorithm, kind) {
        (Algorithm::Tree, CollectiveKind::AllReduce) => {
            let l = nf.log2().ceil();
            (
                2.0 * l,
                2.0 * l * bytes,
                2.0 * (nf - 1.0) / nf * bytes,
                false,
            )
        }
        (Algorithm::Tree, _) => {
            let l = nf.log2().ceil();
            (l, l * bytes, (nf - 1.0) / nf * bytes, false)
        }
        (_, CollectiveKind::Broadcast) => (nf - 1.0, bytes, (nf - 1.0) / nf * bytes, false),
        (_, CollectiveKind::AllReduce) => {
            let s = 2.0 * (nf - 1.0);
            (s, s * bytes / nf, s * bytes / nf, true)
        }
        _ => {
            let s = nf - 1.0;
            (s, s * bytes / nf, s * bytes / nf, true)
        }
    };
    let mut link_times: Vec<(String, f64)> = Vec::new();
    for a in axes {
        if !link_times.iter().any(|(l, _)| *l == a.link.name) {
            link_times.push((
                a.link.name.clone(),
                bandwidth_bytes / a.link.effective_bandwidth(),
            ));
        }
    }
    let counts = if kind == CollectiveKind::AllToAll && algorithm != Algorithm::Tree {
        peer_counts(axes)
    } else {
        edge_counts(axes, ring)
    };
    let total: f64 = counts.iter().sum();
    let mut sent = Vec::new();
    for (a, c) in axes.iter().zip(&counts) {
        add_to(
            &mut sent,
            &a.link.name,
            if total > 0.0 { wire * c / total } else { 0.0 },
        );
    }
    CollectivePhase {
        kind,
        algorithm,
        axes: axes.iter().map(|a| a.name.to_string()).collect(),
        group_size: n,
        bytes,
        latency_s: steps * alpha,
        link_times,
        bytes_sent_per_rank_per_link: sent,
    }
}

/// Time and traffic of one collective over `group` of `mesh` on `spec`'s links.
///
/// `bytes_per_rank` is the full tensor as one rank sees it at the large end of the collective:
/// - AllGather: the gathered output (each rank contributes `bytes_per_rank / n`);
/// - ReduceScatter: the unreduced input (each rank keeps `bytes_per_rank / n`);
/// - AllReduce: the buffer (input = output);
/// - AllToAll: each rank's input (= its output), of which it sends `(n-1)/n`;
/// - Broadcast: the broadcast buffer.
///
/// [`CollectiveKind::full_bytes`] gives it from an op's types. A group with no axis of size > 1
/// costs nothing. See the module docs for the formulas.
pub fn collective_time(
    kind: CollectiveKind,
    bytes_per_rank: f64,
    group: &Group,
    mesh: &Mesh,
    spec: &ClusterSpec,
    algorithm: Algorithm,
) -> Result<CollectiveCost, CostError> {
    if !bytes_per_rank.is_finite() || bytes_per_rank < 0.0 {
        return Err(CostError::BadSize(bytes_per_rank));
    }
    if !algorithm.supports(kind) {
        return Err(CostError::Unsupported { kind, algorithm });
    }
    let axes = resolve(group, mesh, spec)?;
    if axes.is_empty() {
        return Ok(CollectiveCost::from_phases(kind, algorithm, vec![]));
    }
    let s = bytes_per_rank;
    let phases = match algorithm {
        Algorithm::Ring | Algorithm::Tree => vec![flat_phase(kind, algorithm, &axes, s)],
        Algorithm::Hierarchical => {
            let k = axes.len();
            let one = |j: usize, kind: CollectiveKind, bytes: f64| {
                flat_phase(kind, Algorithm::Ring, &axes[j..j + 1], bytes)
            };
            // Product of the sizes of the axes inner to j.
            let inner = |j: usize| -> f64 { axes[j + 1..].iter().map(|a| a.size as f64).product() };
            match kind {
                CollectiveKind::ReduceScatter => {
                    (0..k).rev().map(|j| one(j, kind, s / inner(j))).collect()
                }
                CollectiveKind::AllGather => (0..k).map(|j| one(j, kind, s / inner(j))).collect(),
                CollectiveKind::AllReduce => {
                    let mut v: Vec<CollectivePhase> = (1..k)
                        .rev()
                        .map(|j| one(j, CollectiveKind::ReduceScatter, s / inner(j)))
                        .collect();
                    v.push(one(0, CollectiveKind::AllReduce, s / inner(0)));
                    v.extend((1..k).map(|j| one(j, CollectiveKind::AllGather, s / inner(j))));
                    v
                }
                CollectiveKind::Broadcast => (0..k).map(|j| one(j, kind, s)).collect(),
                CollectiveKind::AllToAll => (0..k).rev().map(|j| one(j, kind, s)).collect(),
            }
        }
    };
    let mut cost = CollectiveCost::from_phases(kind, algorithm, phases);
    // Traffic of a phase on a sub-group happens in every instance of that sub-group at once,
    // so per-rank means already hold; except for broadcast phases, which run in only one
    // instance per outer coordinate: scale them to the mean over all ranks.
    if algorithm == Algorithm::Hierarchical && kind == CollectiveKind::Broadcast {
        let mut outer = 1.0;
        let n: f64 = axes.iter().map(|a| a.size as f64).product();
        for p in &mut cost.phases {
            let size = p.group_size as f64;
            let instances = outer;
            let share = instances * size / n;
            for (_, b) in &mut p.bytes_sent_per_rank_per_link {
                *b *= share;
            }
            outer *= size;
        }
        let phases = std::mem::take(&mut cost.phases);
        cost = CollectiveCost::from_phases(kind, algorithm, phases);
    }
    Ok(cost)
}

/// A [`ClusterSpec`] and the mesh a plan runs on: the cost model the planner and the simulator
/// query.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    spec: ClusterSpec,
    mesh: Mesh,
}

impl CostModel {
    /// Checks that every axis of `mesh` has a link class in `spec`.
    pub fn new(spec: ClusterSpec, mesh: Mesh) -> Result<CostModel, ClusterError> {
        spec.validate_mesh(&mesh)?;
        Ok(CostModel { spec, mesh })
    }

    /// The cluster's default mesh.
    pub fn with_default_mesh(spec: ClusterSpec) -> Result<CostModel, ClusterError> {
        let mesh = spec.mesh.clone();
        CostModel::new(spec, mesh)
    }

    pub fn spec(&self) -> &ClusterSpec {
        &self.spec
    }

    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// Device memory per rank, bytes.
    pub fn memory_budget(&self) -> u64 {
        self.spec.device.memory_bytes
    }

    pub fn roofline(
        &self,
        op: &Op,
        ins: &[&TensorType],
        outs: &[&TensorType],
        dtype: DType,
    ) -> Roofline {
        roofline(op, ins, outs, &self.spec, dtype)
    }

    pub fn compute_time(
        &self,
        op: &Op,
        ins: &[&TensorType],
        outs: &[&TensorType],
        dtype: DType,
    ) -> f64 {
        compute_time(op, ins, outs, &self.spec, dtype)
    }

    pub fn collective_time(
        &self,
        kind: CollectiveKind,
        bytes_per_rank: f64,
        group: &Group,
        algorithm: Algorithm,
    ) -> Result<CollectiveCost, CostError> {
        collective_time(
            kind,
            bytes_per_rank,
            group,
            &self.mesh,
            &self.spec,
            algorithm,
        )
    }

    /// The fastest algorithm for this collective (ties go to the earlier of Ring, Tree,
    /// Hierarchical).
    pub fn best_collective(
        &self,
        kind: CollectiveKind,
        bytes_per_rank: f64,
        group: &Group,
    ) -> Result<CollectiveCost, CostError> {
        let mut best: Option<CollectiveCost> = None;
        for alg in Algorithm::ALL {
            if !alg.supports(kind) {
                continue;
            }
            let c = self.collective_time(kind, bytes_per_rank, group, alg)?;
            if best.as_ref().is_none_or(|b| c.seconds < b.seconds) {
                best = Some(c);
            }
        }
        // Ring supports every kind, so `best` is set.
        best.ok_or(CostError::Unsupported {
            kind,
            algorithm: Algorithm::Ring,
        })
    }

    /// The cost of a collective op with these operand/result types; `Ok(None)` for other ops.
    pub fn op_collective_time(
        &self,
        op: &Op,
        ins: &[&TensorType],
        outs: &[&TensorType],
        algorithm: Algorithm,
    ) -> Result<Option<CollectiveCost>, CostError> {
        let (Some(kind), Some(group)) = (CollectiveKind::of(op), op.group()) else {
            return Ok(None);
        };
        self.collective_time(kind, kind.full_bytes(ins, outs), group, algorithm)
            .map(Some)
    }

    /// The distinct link classes a collective over `group` uses, outermost axis first. Axes
    /// not in the mesh (or of size 1) are skipped.
    pub fn group_link_classes(&self, group: &Group) -> Vec<&Link> {
        let mut out: Vec<&Link> = Vec::new();
        for ax in &self.mesh.axes {
            if ax.size <= 1 || !group.axes.contains(&ax.name) {
                continue;
            }
            if let Ok(l) = self.spec.link_for_axis(&ax.name) {
                if !out.iter().any(|o| o.name == l.name) {
                    out.push(l);
                }
            }
        }
        out
    }
}
