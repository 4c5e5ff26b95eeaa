//! cuDNN's fused scaled dot-product attention, described without cuDNN: for one
//! [`Op::Attention`](hzp_ir::Op::Attention) or [`Op::AttentionGrad`](hzp_ir::Op::AttentionGrad)
//! node, the operation graph of cuDNN's graph (backend) API that computes it ([`SdpaGraph`]:
//! tensors with their unique ids, dims, strides and types, and the matmul, pointwise,
//! reduction and reshape operations between them), or why cuDNN's fused attention does not
//! take the node ([`Refusal`]). [`plan_sdpa`] builds it; [`SdpaGraph::render`] writes it as
//! text, one line per tensor and per operation, always the same for the same node (the test
//! `runtime/tests/cuda_sdpa.rs` compares it with a reviewed recording).
//!
//! The graph follows the pattern of cuDNN's flash fused attention, expressed with the
//! backend's primitive operations (what the cuDNN frontend builds for its `sdpa` node):
//!
//! - forward: `S = Q·Kᵀ` (K described transposed: dims `[b,h_kv,d,s]`), `S·scale` (a
//!   by-value scalar), the causal mask (row and column indices from `GEN_INDEX`, `row >= col`
//!   by `CMP_GE`, masked scores replaced by a very negative by-value scalar through
//!   `BINARY_SELECT`), the softmax with its statistics (row max, `exp(S - max)`, row sum,
//!   `stats = max + log(sum)`, `P = exp / sum`), then `O = P·V`. The statistics tensor is
//!   `[b,h,s_q,1]` fp32: the bytes of the plan's `lse` `[B,Hq,T]`.
//! - backward: the row sums `Σ dO∘O` (into a scratch tensor hzp provides, [`SdpaGraph::scratch`]),
//!   the probabilities recomputed from the statistics (`P = exp(S - stats)`, masked as
//!   forward), `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P∘(dP - Σ dO∘O)·scale`, `dQ = dS·K`,
//!   `dK = dSᵀ·Q`; transposes are reshape operations onto transposed strides.
//! - grouped-query attention: K and V keep their `h_kv` heads (the matmuls broadcast each over
//!   its `h_q / h_kv` query heads); in the backward dK and dV are computed per query head and
//!   summed over each group by a reduction over a `[b,h_kv,g,s,d]` view.
//!
//! I/O is bf16 or fp16, arithmetic fp32 (every matmul's and pointwise's compute type; the
//! score, statistics and gradient intermediates are fp32). Every tensor is dense row-major
//! `[b,h,s,d]`, as the plan stores them.

use hzp_ir::{DType, TensorType};
use std::fmt::{self, Write as _};

/// Forward (`Attention`) or backward (`AttentionGrad`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SdpaKind {
    Forward,
    Backward,
}

/// A tensor's element type in the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SdpaType {
    F32,
    BF16,
    F16,
    I32,
    Bool,
}

impl SdpaType {
    pub fn name(self) -> &'static str {
        match self {
            SdpaType::F32 => "f32",
            SdpaType::BF16 => "bf16",
            SdpaType::F16 => "f16",
            SdpaType::I32 => "i32",
            SdpaType::Bool => "bool",
        }
    }
}

/// The role of a tensor hzp binds to memory (the variant pack's unique ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Q,
    K,
    V,
    O,
    Stats,
    DO,
    DQ,
    DK,
    DV,
    /// The by-value softmax scale.
    Scale,
    /// The by-value value masked scores take.
    MaskValue,
    /// The backward's row sums `Σ dO∘O` (fp32 `[b,h,s_q,1]`): memory hzp provides.
    RowSum,
}

impl Role {
    /// The tensor's unique id in the graph.
    pub fn uid(self) -> i64 {
        match self {
            Role::Q => 1,
            Role::K => 2,
            Role::V => 3,
            Role::O => 4,
            Role::Stats => 5,
            Role::DO => 6,
            Role::DQ => 7,
            Role::DK => 8,
            Role::DV => 9,
            Role::Scale => 10,
            Role::MaskValue => 11,
            Role::RowSum => 12,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Q => "Q",
            Role::K => "K",
            Role::V => "V",
            Role::O => "O",
            Role::Stats => "Stats",
            Role::DO => "dO",
            Role::DQ => "dQ",
            Role::DK => "dK",
            Role::DV => "dV",
            Role::Scale => "scale",
            Role::MaskValue => "mask_value",
            Role::RowSum => "rowsum_dO_O",
        }
    }
}

/// One tensor of the graph.
#[derive(Clone, Debug, PartialEq)]
pub struct SdpaTensor {
    pub uid: i64,
    pub name: String,
    pub dims: Vec<i64>,
    pub strides: Vec<i64>,
    pub dtype: SdpaType,
    /// An intermediate cuDNN keeps to itself (no memory).
    pub is_virtual: bool,
    /// A scalar passed by value (host memory in the variant pack): its value.
    pub by_value: Option<f32>,
    /// What hzp binds to it (None for virtual tensors).
    pub role: Option<Role>,
}

/// A pointwise mode (cuDNN's `CUDNN_POINTWISE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PwMode {
    Mul,
    Add,
    Sub,
    Div,
    Exp,
    Log,
    /// Type conversion (`IDENTITY` onto an output of another type).
    Identity,
    /// The index along `axis` of each element.
    GenIndex {
        axis: i64,
    },
    CmpGe,
    /// `y = t ? x : b`.
    BinarySelect,
}

impl PwMode {
    pub fn name(self) -> String {
        match self {
            PwMode::Mul => "mul".into(),
            PwMode::Add => "add".into(),
            PwMode::Sub => "sub".into(),
            PwMode::Div => "div".into(),
            PwMode::Exp => "exp".into(),
            PwMode::Log => "log".into(),
            PwMode::Identity => "identity".into(),
            PwMode::GenIndex { axis } => format!("gen_index axis={axis}"),
            PwMode::CmpGe => "cmp_ge".into(),
            PwMode::BinarySelect => "binary_select".into(),
        }
    }
}

/// A reduction mode (cuDNN's `CUDNN_REDUCE_TENSOR_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceMode {
    Max,
    Add,
}

/// One operation of the graph; operands are tensor uids. Every compute type is fp32.
#[derive(Clone, Debug, PartialEq)]
pub enum SdpaOp {
    /// `c = a·b` over the last two dims, batched over the leading ones (an operand with
    /// fewer heads is broadcast over the heads of the output).
    Matmul { a: i64, b: i64, c: i64 },
    /// `y = mode(x[, b][, t])`.
    Pointwise {
        mode: PwMode,
        x: i64,
        b: Option<i64>,
        t: Option<i64>,
        y: i64,
    },
    /// `y` = `x` reduced over the dims where `y` has extent 1.
    Reduction { mode: ReduceMode, x: i64, y: i64 },
    /// `y` = `x`'s elements under `y`'s dims and strides (transposes and head splits).
    Reshape { x: i64, y: i64 },
}

/// The shapes and attributes of one attention node.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SdpaShape {
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    /// Query length.
    pub t: usize,
    /// Key/value length.
    pub s: usize,
    /// Head size (q, k and v alike).
    pub d: usize,
    pub io: SdpaType,
    pub scale: f64,
    pub causal: bool,
}

/// The cuDNN operation graph of one attention node.
#[derive(Clone, Debug, PartialEq)]
pub struct SdpaGraph {
    pub kind: SdpaKind,
    pub shape: SdpaShape,
    pub tensors: Vec<SdpaTensor>,
    pub ops: Vec<SdpaOp>,
}

/// Why cuDNN's fused attention does not take a node (hzp's own kernels run it instead).
#[derive(Clone, Debug, PartialEq)]
pub enum Refusal {
    /// fp32 (or another non-16-bit type) operands: the fused kernels take bf16 and fp16.
    Precision(DType),
    /// q, k, v (and o, do) of different types.
    MixedTypes,
    /// Operands not of rank 4, or shapes that do not agree.
    Shapes(String),
    /// Head size not a multiple of 8, or above 256.
    HeadDim(usize),
    /// The value head size differs from the query/key head size.
    ValueHeadDim { d: usize, dv: usize },
    /// Query heads not a multiple of key/value heads.
    Heads { hq: usize, hkv: usize },
    /// An additive mask operand (only the causal mask is described).
    AdditiveMask,
    /// An empty dim.
    Empty,
    /// A scale that is not a finite number.
    Scale(f64),
    /// The statistics (`lse`) not fp32.
    Stats(DType),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Precision(t) => write!(
                f,
                "{t} operands (cuDNN's fused attention takes bf16 or fp16; compile with --precision bf16 or fp16)"
            ),
            Refusal::MixedTypes => write!(f, "q, k, v, o and do are not all of one type"),
            Refusal::Shapes(m) => write!(f, "operand shapes: {m}"),
            Refusal::HeadDim(d) => write!(
                f,
                "head size {d} (cuDNN's fused attention takes a multiple of 8, at most 256)"
            ),
            Refusal::ValueHeadDim { d, dv } => write!(
                f,
                "value head size {dv} differs from the query/key head size {d}"
            ),
            Refusal::Heads { hq, hkv } => write!(
                f,
                "{hq} query heads are not a multiple of {hkv} key/value heads"
            ),
            Refusal::AdditiveMask => write!(
                f,
                "an additive mask operand (only the causal mask runs on cuDNN)"
            ),
            Refusal::Empty => write!(f, "an empty dimension"),
            Refusal::Scale(s) => write!(f, "the scale {s} is not finite"),
            Refusal::Stats(t) => write!(f, "the log-sum-exp is {t}, not f32"),
        }
    }
}

/// The most negative finite f32: what masked scores become. Finite, so that a row's max is
/// never infinite (`exp(masked - max)` is exactly 0 all the same).
pub const MASK_VALUE: f32 = f32::MIN;

/// Dense row-major strides of `dims`.
fn dense(dims: &[i64]) -> Vec<i64> {
    let mut s = vec![1i64; dims.len()];
    for k in (0..dims.len().saturating_sub(1)).rev() {
        s[k] = s[k + 1] * dims[k + 1];
    }
    s
}

/// `dims`/`strides` with the last two dims swapped (a transposed view of the same bytes).
fn swap_last(v: &[i64]) -> Vec<i64> {
    let mut v = v.to_vec();
    let n = v.len();
    v.swap(n - 2, n - 1);
    v
}

struct Builder {
    tensors: Vec<SdpaTensor>,
    ops: Vec<SdpaOp>,
    next_virtual: i64,
}

impl Builder {
    fn new() -> Builder {
        Builder {
            tensors: Vec::new(),
            ops: Vec::new(),
            next_virtual: 100,
        }
    }

    /// A tensor hzp binds (`role`), dense over `dims` unless `strides` is given.
    fn io(&mut self, role: Role, dims: Vec<i64>, strides: Option<Vec<i64>>, t: SdpaType) -> i64 {
        let strides = strides.unwrap_or_else(|| dense(&dims));
        self.tensors.push(SdpaTensor {
            uid: role.uid(),
            name: role.name().into(),
            dims,
            strides,
            dtype: t,
            is_virtual: false,
            by_value: None,
            role: Some(role),
        });
        role.uid()
    }

    fn scalar(&mut self, role: Role, value: f32) -> i64 {
        self.tensors.push(SdpaTensor {
            uid: role.uid(),
            name: role.name().into(),
            dims: vec![1, 1, 1, 1],
            strides: vec![1, 1, 1, 1],
            dtype: SdpaType::F32,
            is_virtual: false,
            by_value: Some(value),
            role: Some(role),
        });
        role.uid()
    }

    /// A virtual tensor, dense over `dims` unless `strides` is given.
    fn virt(&mut self, name: &str, dims: Vec<i64>, strides: Option<Vec<i64>>, t: SdpaType) -> i64 {
        let uid = self.next_virtual;
        self.next_virtual += 1;
        let strides = strides.unwrap_or_else(|| dense(&dims));
        self.tensors.push(SdpaTensor {
            uid,
            name: name.into(),
            dims,
            strides,
            dtype: t,
            is_virtual: true,
            by_value: None,
            role: None,
        });
        uid
    }

    fn dims(&self, uid: i64) -> Vec<i64> {
        self.tensors
            .iter()
            .find(|t| t.uid == uid)
            .map(|t| t.dims.clone())
            .unwrap_or_default()
    }

    fn matmul(&mut self, a: i64, b: i64, c: i64) {
        self.ops.push(SdpaOp::Matmul { a, b, c });
    }

    /// A pointwise op onto a new virtual tensor of `x`'s dims (`t` its type).
    fn pw(&mut self, name: &str, mode: PwMode, x: i64, b: Option<i64>, ty: SdpaType) -> i64 {
        let y = self.virt(name, self.dims(x), None, ty);
        self.pw_into(mode, x, b, None, y);
        y
    }

    fn pw_into(&mut self, mode: PwMode, x: i64, b: Option<i64>, t: Option<i64>, y: i64) {
        self.ops.push(SdpaOp::Pointwise { mode, x, b, t, y });
    }

    fn reduce(&mut self, mode: ReduceMode, x: i64, y: i64) {
        self.ops.push(SdpaOp::Reduction { mode, x, y });
    }

    fn reshape(&mut self, x: i64, y: i64) {
        self.ops.push(SdpaOp::Reshape { x, y });
    }

    /// `S·scale`, then the causal mask when `causal`: the masked, scaled scores.
    fn scaled_masked(&mut self, s: i64, scale: i64, causal: bool, mask_value: Option<i64>) -> i64 {
        let scaled = self.pw("S_scaled", PwMode::Mul, s, Some(scale), SdpaType::F32);
        let (true, Some(mv)) = (causal, mask_value) else {
            return scaled;
        };
        let row = self.pw(
            "row_index",
            PwMode::GenIndex { axis: 2 },
            scaled,
            None,
            SdpaType::I32,
        );
        let col = self.pw(
            "col_index",
            PwMode::GenIndex { axis: 3 },
            scaled,
            None,
            SdpaType::I32,
        );
        let keep = self.pw("causal_keep", PwMode::CmpGe, row, Some(col), SdpaType::Bool);
        let masked = self.virt("S_masked", self.dims(scaled), None, SdpaType::F32);
        self.pw_into(PwMode::BinarySelect, scaled, Some(mv), Some(keep), masked);
        masked
    }
}

fn io_type(t: DType) -> Result<SdpaType, Refusal> {
    match t {
        DType::BF16 => Ok(SdpaType::BF16),
        DType::F16 => Ok(SdpaType::F16),
        other => Err(Refusal::Precision(other)),
    }
}

/// The cuDNN graph of an attention node of `kind` with the plan's operand types (`ins`: q, k,
/// v, then mask for the forward; q, k, v, o, lse, do, then mask for the backward; `outs`: o,
/// lse for the forward, dq, dk, dv for the backward), or why cuDNN's fused attention does not
/// take it.
pub fn plan_sdpa(
    kind: SdpaKind,
    ins: &[&TensorType],
    outs: &[&TensorType],
    scale: f64,
    causal: bool,
) -> Result<SdpaGraph, Refusal> {
    let (n_in, n_out) = match kind {
        SdpaKind::Forward => (3, 2),
        SdpaKind::Backward => (6, 3),
    };
    if ins.len() > n_in {
        return Err(Refusal::AdditiveMask);
    }
    if ins.len() != n_in || outs.len() != n_out {
        return Err(Refusal::Shapes(format!(
            "{} inputs and {} outputs (expected {n_in} and {n_out})",
            ins.len(),
            outs.len()
        )));
    }
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let io = io_type(q.dtype)?;
    // every operand but the statistics shares q's type
    let (lse, same): (&TensorType, Vec<&TensorType>) = match kind {
        SdpaKind::Forward => (outs[1], vec![k, v, outs[0]]),
        SdpaKind::Backward => (
            ins[4],
            vec![k, v, ins[3], ins[5], outs[0], outs[1], outs[2]],
        ),
    };
    if same.iter().any(|t| t.dtype != q.dtype) {
        return Err(Refusal::MixedTypes);
    }
    if lse.dtype != DType::F32 {
        return Err(Refusal::Stats(lse.dtype));
    }
    if [q, k, v].iter().any(|t| t.shape.len() != 4) {
        return Err(Refusal::Shapes(format!(
            "q {:?}, k {:?}, v {:?} (expected rank 4: [batch, heads, sequence, head size])",
            q.shape, k.shape, v.shape
        )));
    }
    let (b, hq, t, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let (hkv, s, dv) = (k.shape[1], k.shape[2], v.shape[3]);
    if k.shape[0] != b || v.shape[0] != b || v.shape[1] != hkv || v.shape[2] != s || k.shape[3] != d
    {
        return Err(Refusal::Shapes(format!(
            "q {:?}, k {:?}, v {:?} do not agree",
            q.shape, k.shape, v.shape
        )));
    }
    if [b, hq, t, d, hkv, s, dv].contains(&0) {
        return Err(Refusal::Empty);
    }
    if d % 8 != 0 || d > 256 {
        return Err(Refusal::HeadDim(d));
    }
    if dv != d {
        return Err(Refusal::ValueHeadDim { d, dv });
    }
    if hq % hkv != 0 {
        return Err(Refusal::Heads { hq, hkv });
    }
    if !scale.is_finite() {
        return Err(Refusal::Scale(scale));
    }
    // the outputs' shapes: what the plan's verifier guarantees, checked so that a wrong plan
    // is refused here rather than read out of bounds by cuDNN
    let want: Vec<Vec<usize>> = match kind {
        SdpaKind::Forward => vec![vec![b, hq, t, d], vec![b, hq, t]],
        SdpaKind::Backward => vec![q.shape.clone(), k.shape.clone(), v.shape.clone()],
    };
    let mut got: Vec<&TensorType> = outs.to_vec();
    if kind == SdpaKind::Backward {
        got.extend([ins[3], ins[4], ins[5]]);
    }
    let mut want = want;
    if kind == SdpaKind::Backward {
        want.extend([vec![b, hq, t, d], vec![b, hq, t], vec![b, hq, t, d]]);
    }
    for (g, w) in got.iter().zip(&want) {
        if &g.shape != w {
            return Err(Refusal::Shapes(format!(
                "an operand of shape {:?} where {w:?} belongs",
                g.shape
            )));
        }
    }
    let shape = SdpaShape {
        b,
        hq,
        hkv,
        t,
        s,
        d,
        io,
        scale,
        causal,
    };
    Ok(match kind {
        SdpaKind::Forward => forward(shape),
        SdpaKind::Backward => backward(shape),
    })
}

fn dims4(a: usize, b: usize, c: usize, d: usize) -> Vec<i64> {
    vec![a as i64, b as i64, c as i64, d as i64]
}

fn forward(sh: SdpaShape) -> SdpaGraph {
    let SdpaShape {
        b,
        hq,
        hkv,
        t,
        s,
        d,
        io,
        ..
    } = sh;
    let f32t = SdpaType::F32;
    let mut g = Builder::new();
    let q = g.io(Role::Q, dims4(b, hq, t, d), None, io);
    // K read as Kᵀ: dims [b, hkv, d, s] over K's [b, hkv, s, d] bytes
    let k_dims = dims4(b, hkv, s, d);
    let k = g.io(
        Role::K,
        swap_last(&k_dims),
        Some(swap_last(&dense(&k_dims))),
        io,
    );
    let v = g.io(Role::V, dims4(b, hkv, s, d), None, io);
    let o = g.io(Role::O, dims4(b, hq, t, d), None, io);
    let stats = g.io(Role::Stats, dims4(b, hq, t, 1), None, f32t);
    let scale = g.scalar(Role::Scale, sh.scale as f32);
    let mv = sh.causal.then(|| g.scalar(Role::MaskValue, MASK_VALUE));

    let scores = g.virt("S", dims4(b, hq, t, s), None, f32t);
    g.matmul(q, k, scores);
    let masked = g.scaled_masked(scores, scale, sh.causal, mv);
    let max = g.virt("row_max", dims4(b, hq, t, 1), None, f32t);
    g.reduce(ReduceMode::Max, masked, max);
    let shifted = g.pw("S_minus_max", PwMode::Sub, masked, Some(max), f32t);
    let e = g.pw("exp", PwMode::Exp, shifted, None, f32t);
    let sum = g.virt("row_sum", dims4(b, hq, t, 1), None, f32t);
    g.reduce(ReduceMode::Add, e, sum);
    let log_sum = g.pw("log_row_sum", PwMode::Log, sum, None, f32t);
    g.pw_into(PwMode::Add, max, Some(log_sum), None, stats);
    let p = g.pw("P", PwMode::Div, e, Some(sum), io);
    g.matmul(p, v, o);
    SdpaGraph {
        kind: SdpaKind::Forward,
        shape: sh,
        tensors: g.tensors,
        ops: g.ops,
    }
}

fn backward(sh: SdpaShape) -> SdpaGraph {
    let SdpaShape {
        b,
        hq,
        hkv,
        t,
        s,
        d,
        io,
        ..
    } = sh;
    let f32t = SdpaType::F32;
    let group = hq / hkv;
    let mut g = Builder::new();
    let q = g.io(Role::Q, dims4(b, hq, t, d), None, io);
    let kv_dims = dims4(b, hkv, s, d);
    // K and V read transposed by the products with them on the right ([b, hkv, d, s])
    let k = g.io(
        Role::K,
        swap_last(&kv_dims),
        Some(swap_last(&dense(&kv_dims))),
        io,
    );
    let v = g.io(
        Role::V,
        swap_last(&kv_dims),
        Some(swap_last(&dense(&kv_dims))),
        io,
    );
    let o = g.io(Role::O, dims4(b, hq, t, d), None, io);
    let stats = g.io(Role::Stats, dims4(b, hq, t, 1), None, f32t);
    let d_o = g.io(Role::DO, dims4(b, hq, t, d), None, io);
    let dq = g.io(Role::DQ, dims4(b, hq, t, d), None, io);
    // dK, dV: with grouped heads, the per-group sum lands in a [b, hkv, 1, s, d] view
    let (dk, dv) = if group == 1 {
        (
            g.io(Role::DK, kv_dims.clone(), None, io),
            g.io(Role::DV, kv_dims.clone(), None, io),
        )
    } else {
        let d5 = vec![b as i64, hkv as i64, 1, s as i64, d as i64];
        (
            g.io(Role::DK, d5.clone(), None, io),
            g.io(Role::DV, d5, None, io),
        )
    };
    let rowsum = g.io(Role::RowSum, dims4(b, hq, t, 1), None, f32t);
    let scale = g.scalar(Role::Scale, sh.scale as f32);
    let mv = sh.causal.then(|| g.scalar(Role::MaskValue, MASK_VALUE));

    // Σ dO∘O per row
    let doo = g.pw("dO_times_O", PwMode::Mul, d_o, Some(o), f32t);
    g.reduce(ReduceMode::Add, doo, rowsum);
    // the probabilities, recomputed from the statistics
    let scores = g.virt("S", dims4(b, hq, t, s), None, f32t);
    g.matmul(q, k, scores);
    let masked = g.scaled_masked(scores, scale, sh.causal, mv);
    let shifted = g.pw("S_minus_stats", PwMode::Sub, masked, Some(stats), f32t);
    let p = g.pw("P", PwMode::Exp, shifted, None, f32t);
    let p_io = g.pw("P_io", PwMode::Identity, p, None, io);
    let pt_dims = dims4(b, hq, s, t);
    let pt = g.virt(
        "P_transposed",
        pt_dims.clone(),
        Some(swap_last(&dense(&dims4(b, hq, t, s)))),
        io,
    );
    g.reshape(p_io, pt);
    // dV = Pᵀ·dO (summed over each group of query heads)
    product_onto_kv(&mut g, pt, d_o, dv, sh, "dV");
    // dS = P∘(dO·Vᵀ - rowsum)·scale
    let dp = g.virt("dP", dims4(b, hq, t, s), None, f32t);
    g.matmul(d_o, v, dp);
    let dp_sub = g.pw("dP_minus_rowsum", PwMode::Sub, dp, Some(rowsum), f32t);
    let ds = g.pw("dS", PwMode::Mul, p, Some(dp_sub), f32t);
    let ds_io = g.pw("dS_scaled", PwMode::Mul, ds, Some(scale), io);
    // dQ = dS·K: K back from its transposed reading
    let k_plain = g.virt("K_plain", kv_dims.clone(), None, io);
    g.reshape(k, k_plain);
    g.matmul(ds_io, k_plain, dq);
    // dK = dSᵀ·Q
    let dst = g.virt(
        "dS_transposed",
        pt_dims,
        Some(swap_last(&dense(&dims4(b, hq, t, s)))),
        io,
    );
    g.reshape(ds_io, dst);
    product_onto_kv(&mut g, dst, q, dk, sh, "dK");
    SdpaGraph {
        kind: SdpaKind::Backward,
        shape: sh,
        tensors: g.tensors,
        ops: g.ops,
    }
}

/// `out = a·b` where `a·b` has the query heads and `out` the key/value heads: directly when
/// they are as many, else per query head (fp32), viewed as `[b, hkv, g, s, d]` and summed over
/// the group.
fn product_onto_kv(g: &mut Builder, a: i64, bm: i64, out: i64, sh: SdpaShape, name: &str) {
    let group = sh.hq / sh.hkv;
    if group == 1 {
        g.matmul(a, bm, out);
        return;
    }
    let full = g.virt(
        &format!("{name}_per_query_head"),
        dims4(sh.b, sh.hq, sh.s, sh.d),
        None,
        SdpaType::F32,
    );
    g.matmul(a, bm, full);
    let grouped = g.virt(
        &format!("{name}_grouped"),
        vec![
            sh.b as i64,
            sh.hkv as i64,
            group as i64,
            sh.s as i64,
            sh.d as i64,
        ],
        None,
        SdpaType::F32,
    );
    g.reshape(full, grouped);
    g.reduce(ReduceMode::Add, grouped, out);
}

impl SdpaGraph {
    /// The tensor with unique id `uid`.
    pub fn tensor(&self, uid: i64) -> Option<&SdpaTensor> {
        self.tensors.iter().find(|t| t.uid == uid)
    }

    /// The tensors hzp binds to memory, by role (by-value scalars excluded).
    pub fn bound(&self) -> Vec<Role> {
        self.tensors
            .iter()
            .filter(|t| !t.is_virtual && t.by_value.is_none())
            .filter_map(|t| t.role)
            .collect()
    }

    /// Bytes of device memory hzp provides besides the plan's operands (the backward's row
    /// sums), each 256-byte aligned: `(role, bytes)`.
    pub fn scratch(&self) -> Vec<(Role, u64)> {
        self.tensors
            .iter()
            .filter(|t| t.role == Some(Role::RowSum))
            .map(|t| {
                let n: i64 = t.dims.iter().product();
                (Role::RowSum, (n as u64 * 4).div_ceil(256) * 256)
            })
            .collect()
    }

    /// Bytes of cuDNN workspace the lowering reserves for this graph in the planned arena:
    /// cuDNN's fused backward accumulates dQ in f32 (`b*hq*t*d` floats) beside a per-row sum
    /// (`b*hq*t` floats), and with grouped K/V it keeps per-query-head dK and dV partials in the
    /// I/O type (`b*hq*s*d` elements each); 1 MiB on top for the engines' own counters and
    /// alignment. The forward takes the 1 MiB. An engine configuration that asks more is
    /// passed over (`cudnn::Cudnn::build`); where every engine asks more, the executor
    /// allocates the first one's workspace apart, saying so.
    pub fn workspace_bound(&self) -> u64 {
        let sh = &self.shape;
        let slack = 1u64 << 20;
        if self.kind == SdpaKind::Forward {
            return slack;
        }
        let (b, hq, t, s, d) = (
            sh.b as u64,
            sh.hq as u64,
            sh.t as u64,
            sh.s as u64,
            sh.d as u64,
        );
        let io = match sh.io {
            SdpaType::F32 | SdpaType::I32 => 4,
            SdpaType::BF16 | SdpaType::F16 => 2,
            SdpaType::Bool => 1,
        };
        let dq = 4 * b * hq * t * d;
        let rows = 4 * b * hq * t;
        let gqa = if sh.hq != sh.hkv {
            2 * io * b * hq * s * d
        } else {
            0
        };
        (dq + rows + gqa + slack).div_ceil(256) * 256
    }

    /// Bytes this graph's node needs in the arena's attention region: its workspace bound,
    /// then its scratch ([`Self::scratch`]).
    pub fn reserved_bytes(&self) -> u64 {
        self.workspace_bound() + self.scratch().iter().map(|s| s.1).sum::<u64>()
    }

    /// A key naming the graph: equal keys, equal graphs (what a cache of built plans is keyed
    /// by).
    pub fn key(&self) -> String {
        self.render()
    }

    /// The graph as text: a header line, then one line per tensor (by uid) and per operation
    /// (in order). The same graph always renders the same.
    pub fn render(&self) -> String {
        let sh = &self.shape;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "sdpa {} io={} compute=f32 b={} hq={} hkv={} t={} s={} d={} causal={} scale={:?}",
            match self.kind {
                SdpaKind::Forward => "forward",
                SdpaKind::Backward => "backward",
            },
            sh.io.name(),
            sh.b,
            sh.hq,
            sh.hkv,
            sh.t,
            sh.s,
            sh.d,
            sh.causal,
            sh.scale as f32
        );
        let mut tensors: Vec<&SdpaTensor> = self.tensors.iter().collect();
        tensors.sort_by_key(|t| t.uid);
        for t in tensors {
            let kind = if t.is_virtual {
                "virtual".to_string()
            } else if let Some(v) = t.by_value {
                format!("by_value={v:?}")
            } else {
                "bound".to_string()
            };
            let _ = writeln!(
                out,
                "tensor {} {} {} dims={:?} strides={:?} {kind}",
                t.uid,
                t.name,
                t.dtype.name(),
                t.dims,
                t.strides
            );
        }
        let name = |uid: i64| {
            self.tensor(uid)
                .map(|t| t.name.clone())
                .unwrap_or_else(|| format!("?{uid}"))
        };
        for op in &self.ops {
            let line = match op {
                SdpaOp::Matmul { a, b, c } => {
                    format!("matmul a={} b={} c={}", name(*a), name(*b), name(*c))
                }
                SdpaOp::Pointwise { mode, x, b, t, y } => {
                    let mut l = format!("pointwise {} x={}", mode.name(), name(*x));
                    if let Some(b) = b {
                        let _ = write!(l, " b={}", name(*b));
                    }
                    if let Some(t) = t {
                        let _ = write!(l, " t={}", name(*t));
                    }
                    let _ = write!(l, " y={}", name(*y));
                    l
                }
                SdpaOp::Reduction { mode, x, y } => format!(
                    "reduction {} x={} y={}",
                    match mode {
                        ReduceMode::Max => "max",
                        ReduceMode::Add => "add",
                    },
                    name(*x),
                    name(*y)
                ),
                SdpaOp::Reshape { x, y } => format!("reshape x={} y={}", name(*x), name(*y)),
            };
            let _ = writeln!(out, "op {line}");
        }
        out
    }

    /// Checks the graph is well formed: unique uids, every operand defined, every virtual
    /// tensor written once before it is read, every bound output written once, and the
    /// dims of each operation's operands consistent with it. An error names what is wrong.
    pub fn check(&self) -> Result<(), String> {
        let mut seen = std::collections::BTreeSet::new();
        for t in &self.tensors {
            if !seen.insert(t.uid) {
                return Err(format!("uid {} is used twice", t.uid));
            }
            if t.dims.len() != t.strides.len() || t.dims.iter().any(|&d| d < 1) {
                return Err(format!("tensor {} has bad dims/strides", t.name));
            }
        }
        let mut written = std::collections::BTreeSet::new();
        let inputs: Vec<Role> = match self.kind {
            SdpaKind::Forward => vec![Role::Q, Role::K, Role::V],
            SdpaKind::Backward => vec![Role::Q, Role::K, Role::V, Role::O, Role::Stats, Role::DO],
        };
        for t in &self.tensors {
            if t.by_value.is_some() || t.role.is_some_and(|r| inputs.contains(&r)) {
                written.insert(t.uid);
            }
        }
        let get = |uid: i64| {
            self.tensor(uid)
                .ok_or_else(|| format!("an operation names uid {uid}, which no tensor has"))
        };
        for op in &self.ops {
            let (reads, y): (Vec<i64>, i64) = match op {
                SdpaOp::Matmul { a, b, c } => {
                    let (ta, tb, tc) = (get(*a)?, get(*b)?, get(*c)?);
                    let n = tc.dims.len();
                    if ta.dims.len() != n || tb.dims.len() != n {
                        return Err(format!("matmul {}: ranks differ", tc.name));
                    }
                    let ok = ta.dims[n - 2] == tc.dims[n - 2]
                        && tb.dims[n - 1] == tc.dims[n - 1]
                        && ta.dims[n - 1] == tb.dims[n - 2]
                        && (0..n - 2).all(|i| {
                            let bc = |x: i64| x == tc.dims[i] || tc.dims[i] % x == 0;
                            bc(ta.dims[i]) && bc(tb.dims[i])
                        });
                    if !ok {
                        return Err(format!(
                            "matmul {}: {:?} x {:?} -> {:?}",
                            tc.name, ta.dims, tb.dims, tc.dims
                        ));
                    }
                    (vec![*a, *b], *c)
                }
                SdpaOp::Pointwise { x, b, t, y, .. } => {
                    let ty = get(*y)?;
                    for u in [Some(*x), *b, *t].into_iter().flatten() {
                        let tu = get(u)?;
                        let bc = tu.dims.len() == ty.dims.len()
                            && tu.dims.iter().zip(&ty.dims).all(|(a, b)| a == b || *a == 1);
                        if !bc {
                            return Err(format!(
                                "pointwise {}: operand {} {:?} does not broadcast to {:?}",
                                ty.name, tu.name, tu.dims, ty.dims
                            ));
                        }
                    }
                    let mut r = vec![*x];
                    r.extend(b.iter().chain(t.iter()).copied());
                    (r, *y)
                }
                SdpaOp::Reduction { x, y, .. } => {
                    let (tx, ty) = (get(*x)?, get(*y)?);
                    let ok = tx.dims.len() == ty.dims.len()
                        && tx.dims.iter().zip(&ty.dims).all(|(a, b)| a == b || *b == 1);
                    if !ok {
                        return Err(format!(
                            "reduction {}: {:?} -> {:?}",
                            ty.name, tx.dims, ty.dims
                        ));
                    }
                    (vec![*x], *y)
                }
                SdpaOp::Reshape { x, y } => {
                    let (tx, ty) = (get(*x)?, get(*y)?);
                    let n = |t: &SdpaTensor| t.dims.iter().product::<i64>();
                    if n(tx) != n(ty) {
                        return Err(format!("reshape {}: element counts differ", ty.name));
                    }
                    (vec![*x], *y)
                }
            };
            for r in reads {
                if !written.contains(&r) {
                    return Err(format!("{} is read before it is written", get(r)?.name));
                }
            }
            if !written.insert(y) {
                return Err(format!("{} is written twice", get(y)?.name));
            }
        }
        for t in &self.tensors {
            if !written.contains(&t.uid) {
                return Err(format!("{} is never written", t.name));
            }
        }
        Ok(())
    }
}
