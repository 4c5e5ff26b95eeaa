//! The op set: compute ops (forward, backward and optimizer), collectives on mesh
//! groups, memory ops and stream events. Every op has static attributes; shapes are static.
//!
//! One op, one place: its name and attributes (for the text form) and its type rule live here;
//! its kernel lives in the runtime; its gradient rule in the autodiff pass.

use crate::dtype::{DType, Shape, TensorType};
use crate::mesh::{Group, Mesh};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UnaryOp {
    Neg,
    Abs,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Reciprocal,
    Tanh,
    Erf,
    Sigmoid,
    Relu,
    /// Exact (erf) GELU.
    Gelu,
    /// tanh-approximated GELU.
    GeluTanh,
    /// x * sigmoid(x).
    Silu,
    Sin,
    Cos,
    Floor,
    Ceil,
    Sign,
    /// Logical not (bool only).
    Not,
    /// Float -> bool: true where the element is NaN.
    IsNaN,
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 21] = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Reciprocal,
        UnaryOp::Tanh,
        UnaryOp::Erf,
        UnaryOp::Sigmoid,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Floor,
        UnaryOp::Ceil,
        UnaryOp::Sign,
        UnaryOp::Not,
        UnaryOp::IsNaN,
    ];

    /// The op's code in the CUDA kernels' switches (`runtime/src/cuda/kernels/elementwise.cu`):
    /// stated per op, so that a new op gets a code of its own, never another op's.
    pub fn code(self) -> u32 {
        match self {
            UnaryOp::Neg => 0,
            UnaryOp::Abs => 1,
            UnaryOp::Exp => 2,
            UnaryOp::Log => 3,
            UnaryOp::Sqrt => 4,
            UnaryOp::Rsqrt => 5,
            UnaryOp::Reciprocal => 6,
            UnaryOp::Tanh => 7,
            UnaryOp::Erf => 8,
            UnaryOp::Sigmoid => 9,
            UnaryOp::Relu => 10,
            UnaryOp::Gelu => 11,
            UnaryOp::GeluTanh => 12,
            UnaryOp::Silu => 13,
            UnaryOp::Sin => 14,
            UnaryOp::Cos => 15,
            UnaryOp::Floor => 16,
            UnaryOp::Ceil => 17,
            UnaryOp::Sign => 18,
            UnaryOp::Not => 19,
            UnaryOp::IsNaN => 20,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "Neg",
            UnaryOp::Abs => "Abs",
            UnaryOp::Exp => "Exp",
            UnaryOp::Log => "Log",
            UnaryOp::Sqrt => "Sqrt",
            UnaryOp::Rsqrt => "Rsqrt",
            UnaryOp::Reciprocal => "Reciprocal",
            UnaryOp::Tanh => "Tanh",
            UnaryOp::Erf => "Erf",
            UnaryOp::Sigmoid => "Sigmoid",
            UnaryOp::Relu => "Relu",
            UnaryOp::Gelu => "Gelu",
            UnaryOp::GeluTanh => "GeluTanh",
            UnaryOp::Silu => "Silu",
            UnaryOp::Sin => "Sin",
            UnaryOp::Cos => "Cos",
            UnaryOp::Floor => "Floor",
            UnaryOp::Ceil => "Ceil",
            UnaryOp::Sign => "Sign",
            UnaryOp::Not => "Not",
            UnaryOp::IsNaN => "IsNaN",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Max,
    Min,
    /// Remainder with the sign of the divisor for ints (ONNX Mod, fmod=0), C fmod for floats.
    Mod,
    Equal,
    Less,
    LessOrEqual,
    Greater,
    GreaterOrEqual,
    And,
    Or,
    Xor,
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 16] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Pow,
        BinaryOp::Max,
        BinaryOp::Min,
        BinaryOp::Mod,
        BinaryOp::Equal,
        BinaryOp::Less,
        BinaryOp::LessOrEqual,
        BinaryOp::Greater,
        BinaryOp::GreaterOrEqual,
        BinaryOp::And,
        BinaryOp::Or,
        BinaryOp::Xor,
    ];

    /// The op's code in the CUDA kernels' switches (`runtime/src/cuda/kernels/elementwise.cu`):
    /// arithmetic 0-7, comparisons 8-12, logic 13-15; stated per op.
    pub fn code(self) -> u32 {
        match self {
            BinaryOp::Add => 0,
            BinaryOp::Sub => 1,
            BinaryOp::Mul => 2,
            BinaryOp::Div => 3,
            BinaryOp::Pow => 4,
            BinaryOp::Max => 5,
            BinaryOp::Min => 6,
            BinaryOp::Mod => 7,
            BinaryOp::Equal => 8,
            BinaryOp::Less => 9,
            BinaryOp::LessOrEqual => 10,
            BinaryOp::Greater => 11,
            BinaryOp::GreaterOrEqual => 12,
            BinaryOp::And => 13,
            BinaryOp::Or => 14,
            BinaryOp::Xor => 15,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "Add",
            BinaryOp::Sub => "Sub",
            BinaryOp::Mul => "Mul",
            BinaryOp::Div => "Div",
            BinaryOp::Pow => "Pow",
            BinaryOp::Max => "Max",
            BinaryOp::Min => "Min",
            BinaryOp::Mod => "Mod",
            BinaryOp::Equal => "Equal",
            BinaryOp::Less => "Less",
            BinaryOp::LessOrEqual => "LessOrEqual",
            BinaryOp::Greater => "Greater",
            BinaryOp::GreaterOrEqual => "GreaterOrEqual",
            BinaryOp::And => "And",
            BinaryOp::Or => "Or",
            BinaryOp::Xor => "Xor",
        }
    }

    /// Comparisons and logic ops produce bool.
    pub fn is_predicate(self) -> bool {
        matches!(
            self,
            BinaryOp::Equal
                | BinaryOp::Less
                | BinaryOp::LessOrEqual
                | BinaryOp::Greater
                | BinaryOp::GreaterOrEqual
                | BinaryOp::And
                | BinaryOp::Or
                | BinaryOp::Xor
        )
    }

    pub fn is_logical(self) -> bool {
        matches!(self, BinaryOp::And | BinaryOp::Or | BinaryOp::Xor)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
    Min,
    Prod,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Mean,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Prod,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Prod => "prod",
        }
    }

    pub fn from_name(s: &str) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|r| r.name() == s)
    }
}

/// Which stream of a rank runs an op. The compute stream is the default.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub enum StreamKind {
    #[default]
    Compute,
    AllGather,
    ReduceScatter,
}

impl StreamKind {
    /// Every stream of a rank, in [`StreamKind::index`] order.
    pub const ALL: [StreamKind; 3] = [
        StreamKind::Compute,
        StreamKind::AllGather,
        StreamKind::ReduceScatter,
    ];

    /// How many streams a rank has.
    pub const COUNT: usize = StreamKind::ALL.len();

    /// The stream's position in [`StreamKind::ALL`]: the index of per-stream arrays (vector
    /// clocks, busy times, trace thread ids) everywhere.
    pub fn index(self) -> usize {
        match self {
            StreamKind::Compute => 0,
            StreamKind::AllGather => 1,
            StreamKind::ReduceScatter => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            StreamKind::Compute => "compute",
            StreamKind::AllGather => "allgather",
            StreamKind::ReduceScatter => "reducescatter",
        }
    }

    pub fn from_name(s: &str) -> Option<StreamKind> {
        StreamKind::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// An op with all its attributes. Inputs and outputs are SSA values of the node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    // ---- elementwise (numpy broadcasting for binary ops and Where) ----
    Unary(UnaryOp),
    Binary(BinaryOp),
    /// (cond: bool, x, y) -> x where cond else y.
    Where,
    /// (x, dy) -> dy * d/dx GeluTanh(x), elementwise over two float tensors of one shape:
    /// the gradient of the tanh-approximated GELU in one pass.
    GeluTanhGrad,
    Cast {
        to: DType,
    },
    Identity,

    // ---- linear algebra ----
    /// numpy `matmul`: rank-1 operands promoted, batch dims broadcast.
    MatMul,

    // ---- normalization / activation over an axis ----
    Softmax {
        axis: usize,
    },
    LogSoftmax {
        axis: usize,
    },
    /// (logits, labels: int, logits' shape without `axis`) -> per-position loss
    /// `logsumexp(logits) - logits[label]` along `axis` (ONNX SoftmaxCrossEntropyLoss with
    /// reduction none and no weights). Labels must lie in `0..dim`.
    SoftmaxCrossEntropy {
        axis: usize,
    },
    /// (logits, labels, dloss) -> dlogits = (softmax(logits) - onehot(label)) * dloss along
    /// `axis`: the gradient of [`Op::SoftmaxCrossEntropy`].
    SoftmaxCrossEntropyGrad {
        axis: usize,
    },
    /// (x, scale, bias?): normalize over axes `axis..rank`.
    LayerNorm {
        axis: usize,
        epsilon: f32,
    },
    /// (x, scale): x / sqrt(mean(x^2 over axes `axis..rank`) + eps) * scale.
    RmsNorm {
        axis: usize,
        epsilon: f32,
    },
    /// (x, scale, dy) -> (dx, dy * xhat): the gradient of [`Op::LayerNorm`] (with or
    /// without a bias) with respect to x, and the output gradient times the normalized x,
    /// whose sum over the leading axes is the scale's gradient. The statistics are
    /// recomputed from x; `epsilon` is the forward's.
    LayerNormGrad {
        axis: usize,
        epsilon: f32,
    },
    /// (x, scale, dy) -> (dx, dy * xhat): [`Op::LayerNormGrad`] for [`Op::RmsNorm`].
    RmsNormGrad {
        axis: usize,
        epsilon: f32,
    },

    // ---- attention ----
    /// (q `[B,Hq,T,D]`, k `[B,Hkv,S,D]`, v `[B,Hkv,S,Dv]`, mask?) -> (o `[B,Hq,T,Dv]`, lse f32
    /// `[B,Hq,T]`): scaled dot-product attention `o = softmax(scale q kᵀ + mask) v` per batch
    /// and query head, query head h reading key/value head `h / (Hq / Hkv)` (grouped-query
    /// attention: Hkv divides Hq, the key/value repeat folded in). `mask` is additive, of q's
    /// dtype, broadcastable to `[B,Hq,T,S]`; `causal` masks key j > query i (top-left aligned,
    /// as PyTorch's `is_causal`). `lse` is each row's log-sum-exp of the masked, scaled
    /// scores, what [`Op::AttentionGrad`] recomputes the probabilities from. A row whose
    /// every score is -inf gives zeros and `lse = -inf` (PyTorch's safe softmax of SDPA).
    Attention {
        scale: f64,
        causal: bool,
    },
    /// (q, k, v, o, lse, do, mask?) -> (dq, dk, dv): the gradient of [`Op::Attention`]
    /// (same attributes), the probabilities recomputed block by block from `lse`; dk and dv
    /// are summed over the query heads that share a key/value head.
    AttentionGrad {
        scale: f64,
        causal: bool,
    },

    // ---- reductions ----
    Reduce {
        op: ReduceOp,
        axes: Vec<usize>,
        keep_dims: bool,
    },
    ArgMax {
        axis: usize,
        keep_dims: bool,
    },
    /// Running sum along an axis.
    CumSum {
        axis: usize,
        exclusive: bool,
        reverse: bool,
    },

    // ---- data movement ----
    Reshape {
        shape: Shape,
    },
    Transpose {
        perm: Vec<usize>,
    },
    /// Per listed axis: elements start, start+step, ... while < end (step > 0) or > end
    /// (step < 0). Starts and ends are already clamped to the dimension.
    Slice {
        axes: Vec<usize>,
        starts: Vec<i64>,
        ends: Vec<i64>,
        steps: Vec<i64>,
    },
    Concat {
        axis: usize,
    },
    Split {
        axis: usize,
        sizes: Vec<usize>,
    },
    /// Broadcast to `shape` (numpy rules; the result is exactly `shape`).
    Expand {
        shape: Shape,
    },
    Tile {
        repeats: Vec<usize>,
    },
    /// (x): zero the part above (`upper = false`) or below (`upper = true`) diagonal `k` of the
    /// last two dims, keeping the triangle.
    Trilu {
        upper: bool,
        k: i64,
    },

    // ---- indexing ----
    /// (data, indices): ONNX Gather (negative indices wrap).
    Gather {
        axis: usize,
    },
    /// (data, indices): ONNX GatherElements.
    GatherElements {
        axis: usize,
    },
    /// (data, indices): ONNX GatherND.
    GatherND {
        batch_dims: usize,
    },
    /// (data, indices, updates): ONNX ScatterElements with reduction none/add.
    ScatterElements {
        axis: usize,
        add: bool,
    },
    /// (data, indices, updates): ONNX ScatterND with reduction none/add.
    ScatterND {
        add: bool,
    },
    /// (indices, values = `[off, on]`): one-hot along `axis` (inserted dim) of size `depth`.
    OneHot {
        axis: usize,
        depth: usize,
    },
    /// (x) -> (values, indices: i64).
    TopK {
        axis: usize,
        k: usize,
        largest: bool,
        sorted: bool,
    },

    // ---- mixture of experts (static shapes; docs/moe.md) ----
    /// (x `[T,H]`, experts: int `[T,K]`) -> (dispatched `[experts, capacity, H]` of x's
    /// dtype, slots: i64 `[T,K]`): token t's copy for its j-th choice goes to row
    /// `slots[t,j]` of expert `experts[t,j]`'s buffer. Each expert holds at most `capacity`
    /// tokens; they are taken by routing priority (GShard): every token's first choice
    /// before any token's second choice, in token order within a choice. A choice that
    /// finds its expert full is dropped (`slots = -1`) and contributes nothing; rows no
    /// token fills are zero. `capacity = T` drops nothing when a token's choices are
    /// distinct experts. Expert indices must lie in `0..experts`.
    MoeDispatch {
        experts: usize,
        capacity: usize,
    },
    /// (expert_out `[E,C,H]`, experts `[T,K]`, slots `[T,K]`, weights `[T,K]`) -> `[T,H]`:
    /// `y[t] = sum over j with slots[t,j] >= 0 of weights[t,j] * expert_out[experts[t,j],
    /// slots[t,j]]`, summed in j order from zero (a dropped choice contributes zero). The
    /// inverse of [`Op::MoeDispatch`], whose outputs give `experts` and `slots`.
    MoeCombine,
    /// (expert_out, experts, slots, weights, dy `[T,H]`) -> (d_expert_out `[E,C,H]`,
    /// d_weights `[T,K]`): the gradient of [`Op::MoeCombine`]. `d_expert_out` holds
    /// `weights[t,j] * dy[t]` in the row of each kept choice and zero in rows no choice
    /// fills; `d_weights[t,j]` is `dy[t] · expert_out[experts[t,j], slots[t,j]]`, zero when
    /// dropped.
    MoeCombineGrad,

    // ---- creation ----
    /// () -> a tensor of `dtype[shape]` filled with `value`.
    Fill {
        value: f64,
        dtype: DType,
        shape: Shape,
    },

    // ---- optimizer ----
    /// (param, grad, m, v, step_size, bias2_sqrt, lr) -> (param', m', v'): one decoupled-
    /// weight-decay Adam step, elementwise over f32 tensors of one shape (the three last
    /// inputs are f32 scalars: `lr / (1 - beta1^t)`, `sqrt(1 - beta2^t)` and this step's
    /// learning rate), as torch.optim.AdamW:
    /// `m' = m + (1 - beta1)(g - m)`, `v' = beta2 v + (1 - beta2) g^2`,
    /// `param' = decay * param - step_size * m' / (sqrt(v') / bias2_sqrt + eps)` with
    /// `decay = 1 - lr * weight_decay` (computed in f64, then rounded to f32, as torch
    /// computes it from Python floats). The learning rate is an input, not an attribute,
    /// so a schedule changes it from step to step. Each result may be written over the
    /// input it replaces (see [`Op::in_place_pairs`]).
    AdamW {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },

    // ---- collectives on a mesh group ----
    /// Concatenates the group's shards along `axis`.
    AllGather {
        group: Group,
        axis: usize,
    },
    /// Reduces over the group and keeps this rank's 1/n slice along `axis`.
    ReduceScatter {
        group: Group,
        axis: usize,
        reduce: ReduceOp,
    },
    AllReduce {
        group: Group,
        reduce: ReduceOp,
    },
    /// Splits `split_axis` into n chunks, sends chunk i to rank i, concatenates received chunks
    /// along `concat_axis`.
    AllToAll {
        group: Group,
        split_axis: usize,
        concat_axis: usize,
    },
    Broadcast {
        group: Group,
        root: usize,
    },

    // ---- memory ----
    /// (x) -> a copy of x in a buffer of its own.
    Copy,
    /// (x) -> (): the buffer of x may be reused from here on.
    Free,

    // ---- stream events ----
    /// () -> (): records event `event` on this node's stream.
    RecordEvent {
        event: u32,
    },
    /// () -> (): this node's stream waits until `event` was recorded.
    WaitEvent {
        event: u32,
    },
}

/// An attribute value, as the text form writes it.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Int(i64),
    Float(f64),
    Bool(bool),
    Ints(Vec<i64>),
    /// A bare word: a dtype, a reduce op, a unary/binary op name.
    Word(String),
    /// `[node,gpu]`
    Group(Group),
}

fn ints<T: Copy + TryInto<i64>>(v: &[T]) -> Attr {
    Attr::Ints(
        v.iter()
            .map(|&x| x.try_into().unwrap_or(i64::MAX))
            .collect(),
    )
}

/// Attribute lookup for [`Op::from_parts`].
struct Attrs<'a> {
    op: &'a str,
    map: &'a BTreeMap<String, Attr>,
}

impl Attrs<'_> {
    fn get(&self, k: &str) -> Result<&Attr, String> {
        self.map
            .get(k)
            .ok_or_else(|| format!("op `{}` needs attribute `{k}`", self.op))
    }
    fn int(&self, k: &str) -> Result<i64, String> {
        match self.get(k)? {
            Attr::Int(i) => Ok(*i),
            other => Err(format!(
                "attribute `{k}` of `{}` must be an integer, got {other:?}",
                self.op
            )),
        }
    }
    fn usize(&self, k: &str) -> Result<usize, String> {
        let i = self.int(k)?;
        usize::try_from(i).map_err(|_| {
            format!(
                "attribute `{k}` of `{}` must be non-negative, got {i}",
                self.op
            )
        })
    }
    fn u32(&self, k: &str) -> Result<u32, String> {
        let i = self.int(k)?;
        u32::try_from(i).map_err(|_| format!("attribute `{k}` of `{}` is out of range", self.op))
    }
    fn float(&self, k: &str) -> Result<f64, String> {
        match self.get(k)? {
            Attr::Float(f) => Ok(*f),
            Attr::Int(i) => Ok(*i as f64),
            other => Err(format!(
                "attribute `{k}` of `{}` must be a number, got {other:?}",
                self.op
            )),
        }
    }
    fn bool(&self, k: &str) -> Result<bool, String> {
        match self.get(k)? {
            Attr::Bool(b) => Ok(*b),
            other => Err(format!(
                "attribute `{k}` of `{}` must be true or false, got {other:?}",
                self.op
            )),
        }
    }
    fn ints(&self, k: &str) -> Result<Vec<i64>, String> {
        match self.get(k)? {
            Attr::Ints(v) => Ok(v.clone()),
            other => Err(format!(
                "attribute `{k}` of `{}` must be a list of integers, got {other:?}",
                self.op
            )),
        }
    }
    fn usizes(&self, k: &str) -> Result<Vec<usize>, String> {
        self.ints(k)?
            .into_iter()
            .map(|i| {
                usize::try_from(i).map_err(|_| {
                    format!(
                        "attribute `{k}` of `{}` must hold non-negative integers",
                        self.op
                    )
                })
            })
            .collect()
    }
    fn word(&self, k: &str) -> Result<&str, String> {
        match self.get(k)? {
            Attr::Word(w) => Ok(w),
            other => Err(format!(
                "attribute `{k}` of `{}` must be a word, got {other:?}",
                self.op
            )),
        }
    }
    fn dtype(&self, k: &str) -> Result<DType, String> {
        let w = self.word(k)?;
        DType::from_name(w).ok_or_else(|| format!("unknown dtype `{w}`"))
    }
    fn reduce(&self, k: &str) -> Result<ReduceOp, String> {
        let w = self.word(k)?;
        ReduceOp::from_name(w).ok_or_else(|| {
            format!("unknown reduction `{w}` (expected sum, mean, max, min or prod)")
        })
    }
    fn group(&self, k: &str) -> Result<Group, String> {
        match self.get(k)? {
            Attr::Group(g) => Ok(g.clone()),
            Attr::Ints(v) if v.is_empty() => Ok(Group { axes: vec![] }),
            other => Err(format!(
                "attribute `{k}` of `{}` must be a group like [node,gpu], got {other:?}",
                self.op
            )),
        }
    }
}

impl Op {
    /// Every op name the text form knows, for error messages and tests.
    pub fn all_names() -> Vec<&'static str> {
        let mut v: Vec<&'static str> = UnaryOp::ALL.iter().map(|u| u.name()).collect();
        v.extend(BinaryOp::ALL.iter().map(|b| b.name()));
        v.extend([
            "Where",
            "GeluTanhGrad",
            "Cast",
            "Identity",
            "MatMul",
            "Softmax",
            "LogSoftmax",
            "SoftmaxCrossEntropy",
            "SoftmaxCrossEntropyGrad",
            "LayerNorm",
            "RmsNorm",
            "LayerNormGrad",
            "RmsNormGrad",
            "Attention",
            "AttentionGrad",
            "Reduce",
            "ArgMax",
            "CumSum",
            "Reshape",
            "Transpose",
            "Slice",
            "Concat",
            "Split",
            "Expand",
            "Tile",
            "Trilu",
            "Gather",
            "GatherElements",
            "GatherND",
            "ScatterElements",
            "ScatterND",
            "OneHot",
            "TopK",
            "MoeDispatch",
            "MoeCombine",
            "MoeCombineGrad",
            "Fill",
            "AdamW",
            "AllGather",
            "ReduceScatter",
            "AllReduce",
            "AllToAll",
            "Broadcast",
            "Copy",
            "Free",
            "RecordEvent",
            "WaitEvent",
        ]);
        v
    }

    /// The op's name in the text form.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Where => "Where",
            Op::GeluTanhGrad => "GeluTanhGrad",
            Op::Cast { .. } => "Cast",
            Op::Identity => "Identity",
            Op::MatMul => "MatMul",
            Op::Softmax { .. } => "Softmax",
            Op::LogSoftmax { .. } => "LogSoftmax",
            Op::SoftmaxCrossEntropy { .. } => "SoftmaxCrossEntropy",
            Op::SoftmaxCrossEntropyGrad { .. } => "SoftmaxCrossEntropyGrad",
            Op::LayerNorm { .. } => "LayerNorm",
            Op::RmsNorm { .. } => "RmsNorm",
            Op::LayerNormGrad { .. } => "LayerNormGrad",
            Op::RmsNormGrad { .. } => "RmsNormGrad",
            Op::Attention { .. } => "Attention",
            Op::AttentionGrad { .. } => "AttentionGrad",
            Op::Reduce { .. } => "Reduce",
            Op::ArgMax { .. } => "ArgMax",
            Op::CumSum { .. } => "CumSum",
            Op::Reshape { .. } => "Reshape",
            Op::Transpose { .. } => "Transpose",
            Op::Slice { .. } => "Slice",
            Op::Concat { .. } => "Concat",
            Op::Split { .. } => "Split",
            Op::Expand { .. } => "Expand",
            Op::Tile { .. } => "Tile",
            Op::Trilu { .. } => "Trilu",
            Op::Gather { .. } => "Gather",
            Op::GatherElements { .. } => "GatherElements",
            Op::GatherND { .. } => "GatherND",
            Op::ScatterElements { .. } => "ScatterElements",
            Op::ScatterND { .. } => "ScatterND",
            Op::OneHot { .. } => "OneHot",
            Op::TopK { .. } => "TopK",
            Op::MoeDispatch { .. } => "MoeDispatch",
            Op::MoeCombine => "MoeCombine",
            Op::MoeCombineGrad => "MoeCombineGrad",
            Op::Fill { .. } => "Fill",
            Op::AdamW { .. } => "AdamW",
            Op::AllGather { .. } => "AllGather",
            Op::ReduceScatter { .. } => "ReduceScatter",
            Op::AllReduce { .. } => "AllReduce",
            Op::AllToAll { .. } => "AllToAll",
            Op::Broadcast { .. } => "Broadcast",
            Op::Copy => "Copy",
            Op::Free => "Free",
            Op::RecordEvent { .. } => "RecordEvent",
            Op::WaitEvent { .. } => "WaitEvent",
        }
    }

    /// (input, output) index pairs where the op may write the output over the input's
    /// bytes: every element of the output is computed from the inputs at the same index
    /// before it is stored (a scatter's output is its data with the updates applied in
    /// order, so it may be its data's bytes too). The memory planner uses them for in-place
    /// updates and for results that take over an input nothing reads afterwards.
    pub fn in_place_pairs(&self) -> &'static [(usize, usize)] {
        match self {
            Op::AdamW { .. } => &[(0, 0), (2, 1), (3, 2)],
            // the data is copied unchanged, then the updates are stored or added at their
            // indices: over the data's own bytes the copy is nothing to do
            Op::ScatterND { .. } => &[(0, 0)],
            _ => &[],
        }
    }

    /// Whether the output is the input's bytes read another way (`Reshape`, `Identity`): no
    /// data moves, and planners may let the output share the input's buffer. (`Copy` is the
    /// op that does move.) The one definition every pass and backend uses.
    pub fn is_view(&self) -> bool {
        matches!(self, Op::Reshape { .. } | Op::Identity)
    }

    pub fn is_collective(&self) -> bool {
        matches!(
            self,
            Op::AllGather { .. }
                | Op::ReduceScatter { .. }
                | Op::AllReduce { .. }
                | Op::AllToAll { .. }
                | Op::Broadcast { .. }
        )
    }

    /// The group a collective runs on.
    pub fn group(&self) -> Option<&Group> {
        match self {
            Op::AllGather { group, .. }
            | Op::ReduceScatter { group, .. }
            | Op::AllReduce { group, .. }
            | Op::AllToAll { group, .. }
            | Op::Broadcast { group, .. } => Some(group),
            _ => None,
        }
    }

    /// Attributes in a fixed order, as the text form prints them.
    pub fn attrs(&self) -> Vec<(&'static str, Attr)> {
        use Attr::*;
        match self {
            Op::Unary(_)
            | Op::Binary(_)
            | Op::Where
            | Op::GeluTanhGrad
            | Op::Identity
            | Op::MatMul
            | Op::MoeCombine
            | Op::MoeCombineGrad
            | Op::Copy
            | Op::Free => vec![],
            Op::Cast { to } => vec![("to", Word(to.name().into()))],
            Op::Softmax { axis }
            | Op::LogSoftmax { axis }
            | Op::SoftmaxCrossEntropy { axis }
            | Op::SoftmaxCrossEntropyGrad { axis } => vec![("axis", Int(*axis as i64))],
            Op::LayerNorm { axis, epsilon }
            | Op::RmsNorm { axis, epsilon }
            | Op::LayerNormGrad { axis, epsilon }
            | Op::RmsNormGrad { axis, epsilon } => vec![
                ("axis", Int(*axis as i64)),
                ("epsilon", Float(*epsilon as f64)),
            ],
            Op::Attention { scale, causal } | Op::AttentionGrad { scale, causal } => {
                vec![("scale", Float(*scale)), ("causal", Bool(*causal))]
            }
            Op::Reduce {
                op,
                axes,
                keep_dims,
            } => vec![
                ("op", Word(op.name().into())),
                ("axes", ints(axes)),
                ("keep_dims", Bool(*keep_dims)),
            ],
            Op::ArgMax { axis, keep_dims } => {
                vec![("axis", Int(*axis as i64)), ("keep_dims", Bool(*keep_dims))]
            }
            Op::CumSum {
                axis,
                exclusive,
                reverse,
            } => vec![
                ("axis", Int(*axis as i64)),
                ("exclusive", Bool(*exclusive)),
                ("reverse", Bool(*reverse)),
            ],
            Op::Reshape { shape } => vec![("shape", ints(shape))],
            Op::Transpose { perm } => vec![("perm", ints(perm))],
            Op::Slice {
                axes,
                starts,
                ends,
                steps,
            } => vec![
                ("axes", ints(axes)),
                ("starts", Ints(starts.clone())),
                ("ends", Ints(ends.clone())),
                ("steps", Ints(steps.clone())),
            ],
            Op::Concat { axis } => vec![("axis", Int(*axis as i64))],
            Op::Split { axis, sizes } => {
                vec![("axis", Int(*axis as i64)), ("sizes", ints(sizes))]
            }
            Op::Expand { shape } => vec![("shape", ints(shape))],
            Op::Tile { repeats } => vec![("repeats", ints(repeats))],
            Op::Trilu { upper, k } => vec![("upper", Bool(*upper)), ("k", Int(*k))],
            Op::Gather { axis } | Op::GatherElements { axis } => {
                vec![("axis", Int(*axis as i64))]
            }
            Op::GatherND { batch_dims } => vec![("batch_dims", Int(*batch_dims as i64))],
            Op::ScatterElements { axis, add } => {
                vec![("axis", Int(*axis as i64)), ("add", Bool(*add))]
            }
            Op::ScatterND { add } => vec![("add", Bool(*add))],
            Op::OneHot { axis, depth } => {
                vec![("axis", Int(*axis as i64)), ("depth", Int(*depth as i64))]
            }
            Op::TopK {
                axis,
                k,
                largest,
                sorted,
            } => vec![
                ("axis", Int(*axis as i64)),
                ("k", Int(*k as i64)),
                ("largest", Bool(*largest)),
                ("sorted", Bool(*sorted)),
            ],
            Op::MoeDispatch { experts, capacity } => vec![
                ("experts", Int(*experts as i64)),
                ("capacity", Int(*capacity as i64)),
            ],
            Op::Fill {
                value,
                dtype,
                shape,
            } => vec![
                ("value", Float(*value)),
                ("dtype", Word(dtype.name().into())),
                ("shape", ints(shape)),
            ],
            Op::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => vec![
                ("beta1", Float(*beta1)),
                ("beta2", Float(*beta2)),
                ("eps", Float(*eps)),
                ("weight_decay", Float(*weight_decay)),
            ],
            Op::AllGather { group, axis } => {
                vec![("group", Group(group.clone())), ("axis", Int(*axis as i64))]
            }
            Op::ReduceScatter {
                group,
                axis,
                reduce,
            } => vec![
                ("group", Group(group.clone())),
                ("axis", Int(*axis as i64)),
                ("reduce", Word(reduce.name().into())),
            ],
            Op::AllReduce { group, reduce } => vec![
                ("group", Group(group.clone())),
                ("reduce", Word(reduce.name().into())),
            ],
            Op::AllToAll {
                group,
                split_axis,
                concat_axis,
            } => vec![
                ("group", Group(group.clone())),
                ("split_axis", Int(*split_axis as i64)),
                ("concat_axis", Int(*concat_axis as i64)),
            ],
            Op::Broadcast { group, root } => {
                vec![("group", Group(group.clone())), ("root", Int(*root as i64))]
            }
            Op::RecordEvent { event } | Op::WaitEvent { event } => {
                vec![("event", Int(*event as i64))]
            }
        }
    }

    /// Rebuilds an op from its text-form name and attributes.
    pub fn from_parts(name: &str, map: &BTreeMap<String, Attr>) -> Result<Op, String> {
        let a = Attrs { op: name, map };
        let unary = UnaryOp::ALL.into_iter().find(|u| u.name() == name);
        let binary = BinaryOp::ALL.into_iter().find(|b| b.name() == name);
        let op = match name {
            _ if unary.is_some() => Op::Unary(unary.expect("checked")),
            _ if binary.is_some() => Op::Binary(binary.expect("checked")),
            "Where" => Op::Where,
            "Identity" => Op::Identity,
            "GeluTanhGrad" => Op::GeluTanhGrad,
            "MatMul" => Op::MatMul,
            "MoeCombine" => Op::MoeCombine,
            "MoeCombineGrad" => Op::MoeCombineGrad,
            "Copy" => Op::Copy,
            "Free" => Op::Free,
            "Cast" => Op::Cast { to: a.dtype("to")? },
            "Softmax" => Op::Softmax {
                axis: a.usize("axis")?,
            },
            "LogSoftmax" => Op::LogSoftmax {
                axis: a.usize("axis")?,
            },
            "SoftmaxCrossEntropy" => Op::SoftmaxCrossEntropy {
                axis: a.usize("axis")?,
            },
            "SoftmaxCrossEntropyGrad" => Op::SoftmaxCrossEntropyGrad {
                axis: a.usize("axis")?,
            },
            "LayerNorm" => Op::LayerNorm {
                axis: a.usize("axis")?,
                epsilon: a.float("epsilon")? as f32,
            },
            "RmsNorm" => Op::RmsNorm {
                axis: a.usize("axis")?,
                epsilon: a.float("epsilon")? as f32,
            },
            "LayerNormGrad" => Op::LayerNormGrad {
                axis: a.usize("axis")?,
                epsilon: a.float("epsilon")? as f32,
            },
            "RmsNormGrad" => Op::RmsNormGrad {
                axis: a.usize("axis")?,
                epsilon: a.float("epsilon")? as f32,
            },
            "Attention" => Op::Attention {
                scale: a.float("scale")?,
                causal: a.bool("causal")?,
            },
            "AttentionGrad" => Op::AttentionGrad {
                scale: a.float("scale")?,
                causal: a.bool("causal")?,
            },
            "Reduce" => Op::Reduce {
                op: a.reduce("op")?,
                axes: a.usizes("axes")?,
                keep_dims: a.bool("keep_dims")?,
            },
            "ArgMax" => Op::ArgMax {
                axis: a.usize("axis")?,
                keep_dims: a.bool("keep_dims")?,
            },
            "CumSum" => Op::CumSum {
                axis: a.usize("axis")?,
                exclusive: a.bool("exclusive")?,
                reverse: a.bool("reverse")?,
            },
            "Reshape" => Op::Reshape {
                shape: a.usizes("shape")?,
            },
            "Transpose" => Op::Transpose {
                perm: a.usizes("perm")?,
            },
            "Slice" => Op::Slice {
                axes: a.usizes("axes")?,
                starts: a.ints("starts")?,
                ends: a.ints("ends")?,
                steps: a.ints("steps")?,
            },
            "Concat" => Op::Concat {
                axis: a.usize("axis")?,
            },
            "Split" => Op::Split {
                axis: a.usize("axis")?,
                sizes: a.usizes("sizes")?,
            },
            "Expand" => Op::Expand {
                shape: a.usizes("shape")?,
            },
            "Tile" => Op::Tile {
                repeats: a.usizes("repeats")?,
            },
            "Trilu" => Op::Trilu {
                upper: a.bool("upper")?,
                k: a.int("k")?,
            },
            "Gather" => Op::Gather {
                axis: a.usize("axis")?,
            },
            "GatherElements" => Op::GatherElements {
                axis: a.usize("axis")?,
            },
            "GatherND" => Op::GatherND {
                batch_dims: a.usize("batch_dims")?,
            },
            "ScatterElements" => Op::ScatterElements {
                axis: a.usize("axis")?,
                add: a.bool("add")?,
            },
            "ScatterND" => Op::ScatterND {
                add: a.bool("add")?,
            },
            "OneHot" => Op::OneHot {
                axis: a.usize("axis")?,
                depth: a.usize("depth")?,
            },
            "TopK" => Op::TopK {
                axis: a.usize("axis")?,
                k: a.usize("k")?,
                largest: a.bool("largest")?,
                sorted: a.bool("sorted")?,
            },
            "MoeDispatch" => Op::MoeDispatch {
                experts: a.usize("experts")?,
                capacity: a.usize("capacity")?,
            },
            "Fill" => Op::Fill {
                value: a.float("value")?,
                dtype: a.dtype("dtype")?,
                shape: a.usizes("shape")?,
            },
            "AdamW" => Op::AdamW {
                beta1: a.float("beta1")?,
                beta2: a.float("beta2")?,
                eps: a.float("eps")?,
                weight_decay: a.float("weight_decay")?,
            },
            "AllGather" => Op::AllGather {
                group: a.group("group")?,
                axis: a.usize("axis")?,
            },
            "ReduceScatter" => Op::ReduceScatter {
                group: a.group("group")?,
                axis: a.usize("axis")?,
                reduce: a.reduce("reduce")?,
            },
            "AllReduce" => Op::AllReduce {
                group: a.group("group")?,
                reduce: a.reduce("reduce")?,
            },
            "AllToAll" => Op::AllToAll {
                group: a.group("group")?,
                split_axis: a.usize("split_axis")?,
                concat_axis: a.usize("concat_axis")?,
            },
            "Broadcast" => Op::Broadcast {
                group: a.group("group")?,
                root: a.usize("root")?,
            },
            "RecordEvent" => Op::RecordEvent {
                event: a.u32("event")?,
            },
            "WaitEvent" => Op::WaitEvent {
                event: a.u32("event")?,
            },
            _ => return Err(format!("unknown op `{name}`")),
        };
        // Reject attributes the op does not have, so typos do not pass silently.
        let known: Vec<&str> = op.attrs().iter().map(|(k, _)| *k).collect();
        if let Some(extra) = map.keys().find(|k| !known.contains(&k.as_str())) {
            let hint = if name == "Gelu" && extra == "approximate" {
                " (the tanh approximation is its own op: write GeluTanh)"
            } else {
                ""
            };
            return Err(format!(
                "op `{name}` has no attribute `{extra}` (it has: {}){hint}",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ));
        }
        Ok(op)
    }
}

/// numpy broadcasting of two shapes.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Shape> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = if da == db {
            da
        } else if da == 1 {
            db
        } else if db == 1 {
            da
        } else {
            return None;
        };
    }
    Some(out)
}

fn fmt_shape(s: &[usize]) -> String {
    format!(
        "[{}]",
        s.iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(",")
    )
}

fn check_arity(op: &Op, ins: &[&TensorType], min: usize, max: usize) -> Result<(), String> {
    if ins.len() < min || ins.len() > max {
        let want = if min == max {
            format!("{min}")
        } else {
            format!("{min} to {max}")
        };
        return Err(format!(
            "{} takes {want} inputs, got {}",
            op.name(),
            ins.len()
        ));
    }
    Ok(())
}

fn check_axis(op: &Op, axis: usize, rank: usize) -> Result<(), String> {
    if axis >= rank {
        return Err(format!(
            "{}: axis {axis} is out of range for rank {rank}",
            op.name()
        ));
    }
    Ok(())
}

impl Op {
    /// The type rule: output types from input types. `mesh` gives group sizes for collectives.
    pub fn infer(
        &self,
        ins: &[&TensorType],
        mesh: Option<&Mesh>,
    ) -> Result<Vec<TensorType>, String> {
        let name = self.name();
        let one = |t: TensorType| Ok(vec![t]);
        match self {
            Op::Unary(u) => {
                check_arity(self, ins, 1, 1)?;
                let t = ins[0];
                match u {
                    UnaryOp::Not if t.dtype != DType::Bool => {
                        Err(format!("Not needs bool input, got {}", t.dtype))
                    }
                    UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign => one(t.clone()),
                    UnaryOp::Not => one(t.clone()),
                    UnaryOp::IsNaN if t.dtype.is_float() => {
                        one(TensorType::new(DType::Bool, t.shape.clone()))
                    }
                    // float in, float of the same dtype out
                    UnaryOp::IsNaN
                    | UnaryOp::Exp
                    | UnaryOp::Log
                    | UnaryOp::Sqrt
                    | UnaryOp::Rsqrt
                    | UnaryOp::Reciprocal
                    | UnaryOp::Tanh
                    | UnaryOp::Erf
                    | UnaryOp::Sigmoid
                    | UnaryOp::Relu
                    | UnaryOp::Gelu
                    | UnaryOp::GeluTanh
                    | UnaryOp::Silu
                    | UnaryOp::Sin
                    | UnaryOp::Cos
                    | UnaryOp::Floor
                    | UnaryOp::Ceil => {
                        if t.dtype.is_float() {
                            one(t.clone())
                        } else {
                            Err(format!("{name} needs a float input, got {}", t.dtype))
                        }
                    }
                }
            }
            Op::Binary(b) => {
                check_arity(self, ins, 2, 2)?;
                let (x, y) = (ins[0], ins[1]);
                if x.dtype != y.dtype {
                    return Err(format!(
                        "{name} operands have different dtypes: {} and {}",
                        x.dtype, y.dtype
                    ));
                }
                if b.is_logical() && x.dtype != DType::Bool {
                    return Err(format!("{name} needs bool operands, got {}", x.dtype));
                }
                let shape = broadcast_shapes(&x.shape, &y.shape).ok_or_else(|| {
                    format!(
                        "{name}: shapes {} and {} do not broadcast",
                        fmt_shape(&x.shape),
                        fmt_shape(&y.shape)
                    )
                })?;
                let dtype = if b.is_predicate() {
                    DType::Bool
                } else {
                    x.dtype
                };
                one(TensorType::new(dtype, shape))
            }
            Op::Where => {
                check_arity(self, ins, 3, 3)?;
                if ins[0].dtype != DType::Bool {
                    return Err(format!(
                        "Where condition must be bool, got {}",
                        ins[0].dtype
                    ));
                }
                if ins[1].dtype != ins[2].dtype {
                    return Err(format!(
                        "Where branches have different dtypes: {} and {}",
                        ins[1].dtype, ins[2].dtype
                    ));
                }
                let s = broadcast_shapes(&ins[0].shape, &ins[1].shape)
                    .and_then(|s| broadcast_shapes(&s, &ins[2].shape))
                    .ok_or_else(|| {
                        format!(
                            "Where: shapes {}, {} and {} do not broadcast",
                            fmt_shape(&ins[0].shape),
                            fmt_shape(&ins[1].shape),
                            fmt_shape(&ins[2].shape)
                        )
                    })?;
                one(TensorType::new(ins[1].dtype, s))
            }
            Op::Cast { to } => {
                check_arity(self, ins, 1, 1)?;
                one(TensorType::new(*to, ins[0].shape.clone()))
            }
            Op::Identity | Op::Copy => {
                check_arity(self, ins, 1, 1)?;
                one(ins[0].clone())
            }
            Op::Free => {
                check_arity(self, ins, 1, 1)?;
                Ok(vec![])
            }
            Op::GeluTanhGrad => {
                check_arity(self, ins, 2, 2)?;
                let (x, dy) = (ins[0], ins[1]);
                if !x.dtype.is_float() || x != dy {
                    return Err(format!(
                        "GeluTanhGrad needs two float tensors of one type, got {x} and {dy}"
                    ));
                }
                one(x.clone())
            }
            Op::MatMul => {
                check_arity(self, ins, 2, 2)?;
                let (a, b) = (ins[0], ins[1]);
                if a.dtype != b.dtype || !a.dtype.is_float() {
                    return Err(format!(
                        "MatMul needs float operands of one dtype, got {} and {}",
                        a.dtype, b.dtype
                    ));
                }
                if a.rank() == 0 || b.rank() == 0 {
                    return Err("MatMul operands must have rank >= 1".into());
                }
                let mut sa = a.shape.clone();
                let mut sb = b.shape.clone();
                let a1 = sa.len() == 1;
                let b1 = sb.len() == 1;
                if a1 {
                    sa.insert(0, 1);
                }
                if b1 {
                    sb.push(1);
                }
                let (m, k) = (sa[sa.len() - 2], sa[sa.len() - 1]);
                let (k2, n) = (sb[sb.len() - 2], sb[sb.len() - 1]);
                if k != k2 {
                    return Err(format!(
                        "MatMul: inner dimensions differ: {} x {}",
                        fmt_shape(&a.shape),
                        fmt_shape(&b.shape)
                    ));
                }
                let mut batch = broadcast_shapes(&sa[..sa.len() - 2], &sb[..sb.len() - 2])
                    .ok_or_else(|| {
                        format!(
                            "MatMul: batch dims of {} and {} do not broadcast",
                            fmt_shape(&a.shape),
                            fmt_shape(&b.shape)
                        )
                    })?;
                if !a1 {
                    batch.push(m);
                }
                if !b1 {
                    batch.push(n);
                }
                one(TensorType::new(a.dtype, batch))
            }
            Op::Softmax { axis } | Op::LogSoftmax { axis } => {
                check_arity(self, ins, 1, 1)?;
                check_axis(self, *axis, ins[0].rank())?;
                if !ins[0].dtype.is_float() {
                    return Err(format!("{name} needs a float input"));
                }
                one(ins[0].clone())
            }
            Op::SoftmaxCrossEntropy { axis } | Op::SoftmaxCrossEntropyGrad { axis } => {
                let grad = matches!(self, Op::SoftmaxCrossEntropyGrad { .. });
                let n = if grad { 3 } else { 2 };
                check_arity(self, ins, n, n)?;
                let (x, lab) = (ins[0], ins[1]);
                check_axis(self, *axis, x.rank())?;
                if !x.dtype.is_float() {
                    return Err(format!("{name} needs float logits, got {x}"));
                }
                let mut lead = x.shape.clone();
                lead.remove(*axis);
                if !lab.dtype.is_int() || lab.shape != lead {
                    return Err(format!(
                        "{name}: labels must be integers shaped {} (the logits {x} without axis {axis}), got {lab}",
                        fmt_shape(&lead)
                    ));
                }
                if grad {
                    let dy = ins[2];
                    if !dy.dtype.is_float() || dy.shape != lead {
                        return Err(format!(
                            "{name}: the loss gradient must be float shaped {}, got {dy}",
                            fmt_shape(&lead)
                        ));
                    }
                    one(x.clone())
                } else {
                    one(TensorType::new(x.dtype, lead))
                }
            }
            Op::LayerNorm { axis, .. }
            | Op::RmsNorm { axis, .. }
            | Op::LayerNormGrad { axis, .. }
            | Op::RmsNormGrad { axis, .. } => {
                let grad = matches!(self, Op::LayerNormGrad { .. } | Op::RmsNormGrad { .. });
                let (min, max) = match self {
                    Op::LayerNorm { .. } => (2, 3),
                    Op::RmsNorm { .. } => (2, 2),
                    _ => (3, 3),
                };
                check_arity(self, ins, min, max)?;
                let x = ins[0];
                check_axis(self, *axis, x.rank())?;
                if grad {
                    if !x.dtype.is_float() {
                        return Err(format!("{name} needs a float input, got {x}"));
                    }
                    if ins[2] != x {
                        return Err(format!(
                            "{name}: the output gradient must be typed like the input {x}, got {}",
                            ins[2]
                        ));
                    }
                }
                let norm = &x.shape[*axis..];
                let params = if grad { &ins[1..2] } else { &ins[1..] };
                for (i, p) in params.iter().enumerate() {
                    if p.dtype != x.dtype {
                        return Err(format!(
                            "{name}: parameter {} has dtype {}, input has {}",
                            i + 1,
                            p.dtype,
                            x.dtype
                        ));
                    }
                    // scale and bias broadcast against the normalized dims
                    if p.rank() > norm.len()
                        || broadcast_shapes(&p.shape, norm).as_deref() != Some(norm)
                    {
                        return Err(format!(
                            "{name}: parameter shape {} does not fit normalized dims {}",
                            fmt_shape(&p.shape),
                            fmt_shape(norm)
                        ));
                    }
                }
                if grad {
                    Ok(vec![x.clone(), x.clone()])
                } else {
                    one(x.clone())
                }
            }
            Op::Attention { scale, .. } | Op::AttentionGrad { scale, .. } => {
                let grad = matches!(self, Op::AttentionGrad { .. });
                let (n, what) = if grad {
                    (6, "(q, k, v, o, lse, do, mask?)")
                } else {
                    (3, "(q, k, v, mask?)")
                };
                if ins.len() < n || ins.len() > n + 1 {
                    return Err(format!(
                        "{name} takes {what}: {n} or {} inputs, got {}",
                        n + 1,
                        ins.len()
                    ));
                }
                let dims = attention_dims(name, ins[0], ins[1], ins[2], *scale)?;
                let [b, hq, t, _, _, dv] = dims;
                let o = TensorType::new(ins[0].dtype, vec![b, hq, t, dv]);
                let lse = TensorType::new(DType::F32, vec![b, hq, t]);
                let mask = ins.get(n);
                if let Some(m) = mask {
                    let full = [b, hq, t, dims[4]];
                    if m.dtype != ins[0].dtype
                        || m.rank() > 4
                        || broadcast_shapes(&m.shape, &full).as_deref() != Some(&full[..])
                    {
                        return Err(format!(
                            "{name}: the mask must be an additive {} mask broadcastable to {}, got {m}",
                            ins[0].dtype,
                            fmt_shape(&full)
                        ));
                    }
                }
                if !grad {
                    return Ok(vec![o, lse]);
                }
                for (k, want, what) in [(3, &o, "o"), (4, &lse, "lse"), (5, &o, "do")] {
                    if ins[k] != want {
                        return Err(format!(
                            "{name}: {what} must be {want} (from q, k and v), got {}",
                            ins[k]
                        ));
                    }
                }
                Ok(vec![ins[0].clone(), ins[1].clone(), ins[2].clone()])
            }
            Op::Reduce {
                op,
                axes,
                keep_dims,
            } => {
                check_arity(self, ins, 1, 1)?;
                let x = ins[0];
                for &a in axes {
                    check_axis(self, a, x.rank())?;
                }
                if matches!(op, ReduceOp::Mean) && !x.dtype.is_float() {
                    return Err("Reduce mean needs a float input".into());
                }
                let mut s = Vec::new();
                for (i, &d) in x.shape.iter().enumerate() {
                    if axes.contains(&i) {
                        if *keep_dims {
                            s.push(1);
                        }
                    } else {
                        s.push(d);
                    }
                }
                one(TensorType::new(x.dtype, s))
            }
            Op::ArgMax { axis, keep_dims } => {
                check_arity(self, ins, 1, 1)?;
                check_axis(self, *axis, ins[0].rank())?;
                let mut s = ins[0].shape.clone();
                if *keep_dims {
                    s[*axis] = 1;
                } else {
                    s.remove(*axis);
                }
                one(TensorType::new(DType::I64, s))
            }
            Op::CumSum { axis, .. } => {
                check_arity(self, ins, 1, 1)?;
                check_axis(self, *axis, ins[0].rank())?;
                one(ins[0].clone())
            }
            Op::Reshape { shape } => {
                check_arity(self, ins, 1, 1)?;
                let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
                if n != Some(ins[0].numel()) {
                    return Err(format!(
                        "Reshape from {} to {} changes the element count ({} vs {})",
                        fmt_shape(&ins[0].shape),
                        fmt_shape(shape),
                        ins[0].numel(),
                        n.map_or("overflow".to_string(), |n| n.to_string())
                    ));
                }
                one(TensorType::new(ins[0].dtype, shape.clone()))
            }
            Op::Transpose { perm } => {
                check_arity(self, ins, 1, 1)?;
                let r = ins[0].rank();
                let mut seen = vec![false; r];
                if perm.len() != r
                    || perm
                        .iter()
                        .any(|&p| p >= r || std::mem::replace(&mut seen[p], true))
                {
                    return Err(format!(
                        "Transpose: perm {perm:?} is not a permutation of rank {r}"
                    ));
                }
                one(TensorType::new(
                    ins[0].dtype,
                    perm.iter().map(|&p| ins[0].shape[p]).collect::<Vec<_>>(),
                ))
            }
            Op::Slice {
                axes,
                starts,
                ends,
                steps,
            } => {
                check_arity(self, ins, 1, 1)?;
                let x = ins[0];
                if axes.len() != starts.len()
                    || axes.len() != ends.len()
                    || axes.len() != steps.len()
                {
                    return Err("Slice: axes, starts, ends and steps differ in length".into());
                }
                let mut s = x.shape.clone();
                for i in 0..axes.len() {
                    let a = axes[i];
                    check_axis(self, a, x.rank())?;
                    let (st, en, step) = (starts[i], ends[i], steps[i]);
                    let dim = x.shape[a] as i64;
                    if step == 0 {
                        return Err("Slice: step 0".into());
                    }
                    // starts/ends are clamped to the dim, so the spans below cannot overflow;
                    // the step may be anything, so divide without adding it.
                    let len = if step > 0 {
                        if st < 0 || en > dim {
                            return Err(format!("Slice: range {st}..{en} is outside dim {dim}"));
                        }
                        if en > st {
                            let span = (en - st) as u64;
                            span.div_ceil(step as u64) as i64
                        } else {
                            0
                        }
                    } else {
                        if st >= dim || en < -1 || st < -1 {
                            return Err(format!(
                                "Slice: range {st}..{en} (step {step}) is outside dim {dim}"
                            ));
                        }
                        if st > en {
                            let span = (st - en) as u64;
                            span.div_ceil(step.unsigned_abs()) as i64
                        } else {
                            0
                        }
                    };
                    s[a] = len as usize;
                }
                one(TensorType::new(x.dtype, s))
            }
            Op::Concat { axis } => {
                if ins.is_empty() {
                    return Err("Concat needs at least one input".into());
                }
                let first = ins[0];
                check_axis(self, *axis, first.rank())?;
                let mut s = first.shape.clone();
                let mut total = 0usize;
                for t in ins {
                    if t.dtype != first.dtype || t.rank() != first.rank() {
                        return Err("Concat inputs differ in dtype or rank".into());
                    }
                    for d in 0..t.rank() {
                        if d != *axis && t.shape[d] != first.shape[d] {
                            return Err(format!(
                                "Concat on axis {axis}: shapes {} and {} differ off the axis",
                                fmt_shape(&first.shape),
                                fmt_shape(&t.shape)
                            ));
                        }
                    }
                    total = total
                        .checked_add(t.shape[*axis])
                        .ok_or("Concat: the result is too large")?;
                }
                s[*axis] = total;
                one(TensorType::new(first.dtype, s))
            }
            Op::Split { axis, sizes } => {
                check_arity(self, ins, 1, 1)?;
                check_axis(self, *axis, ins[0].rank())?;
                let total = sizes.iter().try_fold(0usize, |a, &d| a.checked_add(d));
                if total != Some(ins[0].shape[*axis]) {
                    return Err(format!(
                        "Split sizes {sizes:?} do not add up to dim {}",
                        ins[0].shape[*axis]
                    ));
                }
                Ok(sizes
                    .iter()
                    .map(|&n| {
                        let mut s = ins[0].shape.clone();
                        s[*axis] = n;
                        TensorType::new(ins[0].dtype, s)
                    })
                    .collect())
            }
            Op::Expand { shape } => {
                check_arity(self, ins, 1, 1)?;
                if broadcast_shapes(&ins[0].shape, shape).as_deref() != Some(shape.as_slice()) {
                    return Err(format!(
                        "Expand: {} does not broadcast to {}",
                        fmt_shape(&ins[0].shape),
                        fmt_shape(shape)
                    ));
                }
                one(TensorType::new(ins[0].dtype, shape.clone()))
            }
            Op::Tile { repeats } => {
                check_arity(self, ins, 1, 1)?;
                if repeats.len() != ins[0].rank() {
                    return Err("Tile: repeats must have one entry per dim".into());
                }
                let s = ins[0]
                    .shape
                    .iter()
                    .zip(repeats)
                    .map(|(d, r)| d.checked_mul(*r))
                    .collect::<Option<Vec<_>>>()
                    .ok_or("Tile: the result is too large")?;
                one(TensorType::new(ins[0].dtype, s))
            }
            Op::Trilu { .. } => {
                check_arity(self, ins, 1, 1)?;
                if ins[0].rank() < 2 {
                    return Err("Trilu needs rank >= 2".into());
                }
                one(ins[0].clone())
            }
            Op::Gather { axis } => {
                check_arity(self, ins, 2, 2)?;
                let (d, i) = (ins[0], ins[1]);
                check_axis(self, *axis, d.rank())?;
                if !i.dtype.is_int() {
                    return Err(format!(
                        "Gather indices must be i64 or i32, got {}",
                        i.dtype
                    ));
                }
                let mut s = d.shape[..*axis].to_vec();
                s.extend(&i.shape);
                s.extend(&d.shape[*axis + 1..]);
                one(TensorType::new(d.dtype, s))
            }
            Op::GatherElements { axis } => {
                check_arity(self, ins, 2, 2)?;
                check_axis(self, *axis, ins[0].rank())?;
                if !ins[1].dtype.is_int() || ins[1].rank() != ins[0].rank() {
                    return Err(
                        "GatherElements: indices must be integer with the data's rank".into(),
                    );
                }
                one(TensorType::new(ins[0].dtype, ins[1].shape.clone()))
            }
            Op::GatherND { batch_dims } => {
                check_arity(self, ins, 2, 2)?;
                let (d, i) = (ins[0], ins[1]);
                let b = *batch_dims;
                if !i.dtype.is_int() || i.rank() < 1 {
                    return Err("GatherND: indices must be integer with rank >= 1".into());
                }
                let last = i.shape[i.rank() - 1];
                if b >= i.rank() || b + last > d.rank() || d.shape[..b] != i.shape[..b] {
                    return Err(format!(
                        "GatherND: data {} and indices {} do not fit batch_dims {b}",
                        fmt_shape(&d.shape),
                        fmt_shape(&i.shape)
                    ));
                }
                let mut s = i.shape[..i.rank() - 1].to_vec();
                s.extend(&d.shape[b + last..]);
                one(TensorType::new(d.dtype, s))
            }
            Op::ScatterElements { axis, .. } => {
                check_arity(self, ins, 3, 3)?;
                check_axis(self, *axis, ins[0].rank())?;
                if ins[1].shape != ins[2].shape
                    || ins[2].dtype != ins[0].dtype
                    || !ins[1].dtype.is_int()
                {
                    return Err("ScatterElements: indices and updates must match in shape; updates the data's dtype".into());
                }
                one(ins[0].clone())
            }
            Op::ScatterND { .. } => {
                check_arity(self, ins, 3, 3)?;
                let (d, i, u) = (ins[0], ins[1], ins[2]);
                if !i.dtype.is_int() || i.rank() < 1 || u.dtype != d.dtype {
                    return Err(
                        "ScatterND: integer indices of rank >= 1 and updates of the data's dtype"
                            .into(),
                    );
                }
                let last = i.shape[i.rank() - 1];
                let mut want = i.shape[..i.rank() - 1].to_vec();
                if last > d.rank() {
                    return Err("ScatterND: index tuples longer than the data's rank".into());
                }
                want.extend(&d.shape[last..]);
                if u.shape != want {
                    return Err(format!(
                        "ScatterND: updates have shape {}, expected {}",
                        fmt_shape(&u.shape),
                        fmt_shape(&want)
                    ));
                }
                one(d.clone())
            }
            Op::OneHot { axis, depth } => {
                check_arity(self, ins, 2, 2)?;
                if !ins[0].dtype.is_int() || ins[1].numel() != 2 {
                    return Err(
                        "OneHot: integer indices and a 2-element [off, on] values tensor".into(),
                    );
                }
                if *axis > ins[0].rank() {
                    return Err(format!("OneHot: axis {axis} out of range"));
                }
                let mut s = ins[0].shape.clone();
                s.insert(*axis, *depth);
                one(TensorType::new(ins[1].dtype, s))
            }
            Op::TopK { axis, k, .. } => {
                check_arity(self, ins, 1, 1)?;
                check_axis(self, *axis, ins[0].rank())?;
                if *k > ins[0].shape[*axis] {
                    return Err(format!("TopK: k={k} exceeds dim {}", ins[0].shape[*axis]));
                }
                let mut s = ins[0].shape.clone();
                s[*axis] = *k;
                Ok(vec![
                    TensorType::new(ins[0].dtype, s.clone()),
                    TensorType::new(DType::I64, s),
                ])
            }
            Op::MoeDispatch { experts, capacity } => {
                check_arity(self, ins, 2, 2)?;
                let (x, ids) = (ins[0], ins[1]);
                if *experts == 0 || *capacity == 0 {
                    return Err(format!(
                        "MoeDispatch needs experts >= 1 and capacity >= 1, got experts={experts} capacity={capacity}"
                    ));
                }
                if !x.dtype.is_float() || x.rank() != 2 {
                    return Err(format!(
                        "MoeDispatch: the tokens must be float [T,H], got {x}"
                    ));
                }
                if !ids.dtype.is_int() || ids.rank() != 2 || ids.shape[0] != x.shape[0] {
                    return Err(format!(
                        "MoeDispatch: the expert choices must be integers [T,K] with T = {}, got {ids}",
                        x.shape[0]
                    ));
                }
                if experts
                    .checked_mul(*capacity)
                    .and_then(|r| r.checked_mul(x.shape[1]))
                    .is_none()
                {
                    return Err("MoeDispatch: the dispatched tensor is too large".into());
                }
                Ok(vec![
                    TensorType::new(x.dtype, vec![*experts, *capacity, x.shape[1]]),
                    TensorType::new(DType::I64, ids.shape.clone()),
                ])
            }
            Op::MoeCombine | Op::MoeCombineGrad => {
                let grad = matches!(self, Op::MoeCombineGrad);
                let n = if grad { 5 } else { 4 };
                check_arity(self, ins, n, n)?;
                let (ye, ids, slots, w) = (ins[0], ins[1], ins[2], ins[3]);
                if !ye.dtype.is_float() || ye.rank() != 3 {
                    return Err(format!(
                        "{name}: the experts' outputs must be float [E,C,H], got {ye}"
                    ));
                }
                if !ids.dtype.is_int() || ids.rank() != 2 {
                    return Err(format!(
                        "{name}: the expert choices must be integers [T,K], got {ids}"
                    ));
                }
                if slots.dtype != DType::I64 || slots.shape != ids.shape {
                    return Err(format!(
                        "{name}: the slots must be i64 shaped like the choices {ids}, got {slots}"
                    ));
                }
                if w.dtype != ye.dtype || w.shape != ids.shape {
                    return Err(format!(
                        "{name}: the weights must be {} shaped like the choices {ids}, got {w}",
                        ye.dtype
                    ));
                }
                let y = TensorType::new(ye.dtype, vec![ids.shape[0], ye.shape[2]]);
                if !grad {
                    return one(y);
                }
                if ins[4] != &y {
                    return Err(format!(
                        "{name}: the output gradient must be {y}, got {}",
                        ins[4]
                    ));
                }
                Ok(vec![ye.clone(), w.clone()])
            }
            Op::Fill { dtype, shape, .. } => {
                check_arity(self, ins, 0, 0)?;
                one(TensorType::new(*dtype, shape.clone()))
            }
            Op::AdamW { .. } => {
                check_arity(self, ins, 7, 7)?;
                let p = ins[0];
                for (k, what) in [(0, "parameter"), (1, "gradient"), (2, "m"), (3, "v")] {
                    if ins[k].dtype != DType::F32 || ins[k].shape != p.shape {
                        return Err(format!(
                            "AdamW: the {what} must be f32 shaped like the parameter {p}, got {}",
                            ins[k]
                        ));
                    }
                }
                for (k, what) in [
                    (4, "step size"),
                    (5, "bias correction"),
                    (6, "learning rate"),
                ] {
                    if ins[k].dtype != DType::F32 || ins[k].numel() != 1 {
                        return Err(format!("AdamW: the {what} must be one f32, got {}", ins[k]));
                    }
                }
                Ok(vec![p.clone(), p.clone(), p.clone()])
            }
            Op::RecordEvent { .. } | Op::WaitEvent { .. } => {
                check_arity(self, ins, 0, 0)?;
                Ok(vec![])
            }
            Op::AllGather { group, axis } | Op::ReduceScatter { group, axis, .. } => {
                check_arity(self, ins, 1, 1)?;
                check_axis(self, *axis, ins[0].rank())?;
                let n = group_size(self, group, mesh)?;
                let mut s = ins[0].shape.clone();
                if matches!(self, Op::AllGather { .. }) {
                    s[*axis] = s[*axis]
                        .checked_mul(n)
                        .ok_or("AllGather: the result is too large")?;
                } else {
                    if !s[*axis].is_multiple_of(n) {
                        return Err(format!(
                            "ReduceScatter: dim {} of {} is not divisible by the group size {n} (pad first)",
                            axis,
                            fmt_shape(&s)
                        ));
                    }
                    s[*axis] /= n;
                }
                one(TensorType::new(ins[0].dtype, s))
            }
            Op::AllReduce { group, .. } => {
                check_arity(self, ins, 1, 1)?;
                group_size(self, group, mesh)?;
                one(ins[0].clone())
            }
            Op::AllToAll {
                group,
                split_axis,
                concat_axis,
            } => {
                check_arity(self, ins, 1, 1)?;
                check_axis(self, *split_axis, ins[0].rank())?;
                check_axis(self, *concat_axis, ins[0].rank())?;
                let n = group_size(self, group, mesh)?;
                let mut s = ins[0].shape.clone();
                if !s[*split_axis].is_multiple_of(n) {
                    return Err(format!(
                        "AllToAll: split dim is not divisible by the group size {n}"
                    ));
                }
                s[*split_axis] /= n;
                s[*concat_axis] = s[*concat_axis]
                    .checked_mul(n)
                    .ok_or("AllToAll: the result is too large")?;
                one(TensorType::new(ins[0].dtype, s))
            }
            Op::Broadcast { group, root } => {
                check_arity(self, ins, 1, 1)?;
                let n = group_size(self, group, mesh)?;
                if *root >= n {
                    return Err(format!(
                        "Broadcast: root {root} is outside the group of {n}"
                    ));
                }
                one(ins[0].clone())
            }
        }
    }
}

/// The dimensions `[B, Hq, T, D, S, Dv]` of an attention's q `[B,Hq,T,D]`, k `[B,Hkv,S,D]` and
/// v `[B,Hkv,S,Dv]`, checked: one float dtype, Hkv dividing Hq, a finite scale.
pub fn attention_dims(
    name: &str,
    q: &TensorType,
    k: &TensorType,
    v: &TensorType,
    scale: f64,
) -> Result<[usize; 6], String> {
    if !q.dtype.is_float() || k.dtype != q.dtype || v.dtype != q.dtype {
        return Err(format!(
            "{name} needs float q, k and v of one dtype, got {q}, {k} and {v}"
        ));
    }
    if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
        return Err(format!(
            "{name} needs q [B,Hq,T,D], k [B,Hkv,S,D] and v [B,Hkv,S,Dv], got {q}, {k} and {v}"
        ));
    }
    let (qs, ks, vs) = (&q.shape, &k.shape, &v.shape);
    let (b, hq, t, d) = (qs[0], qs[1], qs[2], qs[3]);
    let (hkv, s) = (ks[1], ks[2]);
    if ks[0] != b || ks[3] != d || vs[0] != b || vs[1] != hkv || vs[2] != s {
        return Err(format!(
            "{name}: q {q}, k {k} and v {v} do not fit [B,Hq,T,D], [B,Hkv,S,D], [B,Hkv,S,Dv]"
        ));
    }
    if hkv == 0 || !hq.is_multiple_of(hkv) {
        return Err(format!(
            "{name}: the {hkv} key/value heads do not divide the {hq} query heads"
        ));
    }
    if !scale.is_finite() {
        return Err(format!("{name}: the scale must be finite, got {scale}"));
    }
    Ok([b, hq, t, d, s, vs[3]])
}

fn group_size(op: &Op, group: &Group, mesh: Option<&Mesh>) -> Result<usize, String> {
    let mesh =
        mesh.ok_or_else(|| format!("{} needs a mesh, and the program has none", op.name()))?;
    mesh.group_size(group).ok_or_else(|| {
        format!(
            "{}: group {group} names an axis that is not in the mesh {mesh}",
            op.name()
        )
    })
}

#[cfg(test)]
mod tests {

    #[test]
    fn moe_type_rules() {
        let t = |d: DType, s: &[usize]| TensorType::new(d, s.to_vec());
        let (f, i) = (DType::F32, DType::I64);
        let dispatch = Op::MoeDispatch {
            experts: 4,
            capacity: 3,
        };
        let outs = dispatch
            .infer(&[&t(f, &[6, 8]), &t(i, &[6, 2])], None)
            .unwrap();
        assert_eq!(outs, vec![t(f, &[4, 3, 8]), t(i, &[6, 2])]);
        let combine_ins = [
            t(f, &[4, 3, 8]),
            t(i, &[6, 2]),
            t(i, &[6, 2]),
            t(f, &[6, 2]),
        ];
        let refs: Vec<&TensorType> = combine_ins.iter().collect();
        assert_eq!(
            Op::MoeCombine.infer(&refs, None).unwrap(),
            vec![t(f, &[6, 8])]
        );
        let dy = t(f, &[6, 8]);
        let mut grad_refs = refs.clone();
        grad_refs.push(&dy);
        assert_eq!(
            Op::MoeCombineGrad.infer(&grad_refs, None).unwrap(),
            vec![t(f, &[4, 3, 8]), t(f, &[6, 2])]
        );
        let err = |op: &Op, ins: &[TensorType]| {
            let r: Vec<&TensorType> = ins.iter().collect();
            op.infer(&r, None).unwrap_err()
        };
        for (op, ins, want) in [
            (
                Op::MoeDispatch {
                    experts: 4,
                    capacity: 0,
                },
                vec![t(f, &[6, 8]), t(i, &[6, 2])],
                "capacity >= 1",
            ),
            (
                dispatch.clone(),
                vec![t(f, &[6, 8]), t(i, &[5, 2])],
                "with T = 6",
            ),
            (
                dispatch.clone(),
                vec![t(i, &[6, 8]), t(i, &[6, 2])],
                "float [T,H]",
            ),
            (
                Op::MoeDispatch {
                    experts: usize::MAX,
                    capacity: 2,
                },
                vec![t(f, &[6, 8]), t(i, &[6, 2])],
                "too large",
            ),
            (
                Op::MoeCombine,
                vec![
                    t(f, &[4, 3, 8]),
                    t(i, &[6, 2]),
                    t(i, &[6, 1]),
                    t(f, &[6, 2]),
                ],
                "the slots must be i64",
            ),
            (
                Op::MoeCombine,
                vec![
                    t(f, &[4, 3, 8]),
                    t(i, &[6, 2]),
                    t(i, &[6, 2]),
                    t(DType::BF16, &[6, 2]),
                ],
                "the weights must be f32",
            ),
            (
                Op::MoeCombineGrad,
                vec![
                    t(f, &[4, 3, 8]),
                    t(i, &[6, 2]),
                    t(i, &[6, 2]),
                    t(f, &[6, 2]),
                    t(f, &[6, 4]),
                ],
                "output gradient must be f32[6,8]",
            ),
        ] {
            let e = err(&op, &ins);
            assert!(e.contains(want), "{}: {e}", op.name());
        }
    }

    #[test]
    fn kernel_codes_are_distinct_and_dense() {
        // the CUDA switches are written for codes 0..N in ALL's order; a new op must take a
        // new code (a repeated code would run it as another op)
        let u: Vec<u32> = UnaryOp::ALL.iter().map(|o| o.code()).collect();
        assert_eq!(u, (0..UnaryOp::ALL.len() as u32).collect::<Vec<_>>());
        let b: Vec<u32> = BinaryOp::ALL.iter().map(|o| o.code()).collect();
        assert_eq!(b, (0..BinaryOp::ALL.len() as u32).collect::<Vec<_>>());
        // comparisons are 8..=12 and logic 13..=15, as the kernels' predicate paths assume
        for o in BinaryOp::ALL {
            assert_eq!(
                o.is_predicate(),
                (8..=15).contains(&o.code()),
                "{}",
                o.name()
            );
        }
    }
    use super::*;

    fn t(d: DType, s: &[usize]) -> TensorType {
        TensorType::new(d, s.to_vec())
    }

    #[test]
    fn broadcasting() {
        assert_eq!(broadcast_shapes(&[2, 1, 4], &[3, 1]), Some(vec![2, 3, 4]));
        assert_eq!(broadcast_shapes(&[2], &[3]), None);
        assert_eq!(broadcast_shapes(&[], &[5]), Some(vec![5]));
    }

    #[test]
    fn matmul_shapes() {
        let f = DType::F32;
        let r = Op::MatMul
            .infer(&[&t(f, &[2, 16, 64]), &t(f, &[64, 32])], None)
            .unwrap();
        assert_eq!(r[0].shape, vec![2, 16, 32]);
        let r = Op::MatMul
            .infer(&[&t(f, &[64]), &t(f, &[64, 32])], None)
            .unwrap();
        assert_eq!(r[0].shape, vec![32]);
        assert!(Op::MatMul
            .infer(&[&t(f, &[2, 3]), &t(f, &[4, 5])], None)
            .is_err());
    }

    #[test]
    fn every_op_round_trips_through_its_attributes() {
        let g = Group::new(["gpu"]);
        let ops = vec![
            Op::Cast { to: DType::BF16 },
            Op::LayerNorm {
                axis: 2,
                epsilon: 1e-5,
            },
            Op::LayerNormGrad {
                axis: 1,
                epsilon: 1e-6,
            },
            Op::RmsNormGrad {
                axis: 2,
                epsilon: 1e-5,
            },
            Op::Reduce {
                op: ReduceOp::Mean,
                axes: vec![1, 2],
                keep_dims: true,
            },
            Op::Slice {
                axes: vec![1],
                starts: vec![3],
                ends: vec![-1],
                steps: vec![-1],
            },
            Op::Fill {
                value: -0.5,
                dtype: DType::F32,
                shape: vec![2, 2],
            },
            Op::ReduceScatter {
                group: g.clone(),
                axis: 0,
                reduce: ReduceOp::Sum,
            },
            Op::AllToAll {
                group: g,
                split_axis: 0,
                concat_axis: 1,
            },
            Op::TopK {
                axis: 1,
                k: 2,
                largest: true,
                sorted: true,
            },
            Op::Unary(UnaryOp::GeluTanh),
            Op::Binary(BinaryOp::GreaterOrEqual),
            Op::WaitEvent { event: 7 },
            Op::Attention {
                scale: 0.125,
                causal: true,
            },
            Op::AttentionGrad {
                scale: 0.3,
                causal: false,
            },
        ];
        for op in ops {
            let map: BTreeMap<String, Attr> = op
                .attrs()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
            assert_eq!(Op::from_parts(op.name(), &map).unwrap(), op);
        }
        let mut bad = BTreeMap::new();
        bad.insert("axs".to_string(), Attr::Int(1));
        assert!(Op::from_parts("Softmax", &bad)
            .unwrap_err()
            .contains("axis"));
    }
}
