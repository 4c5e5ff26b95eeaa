//! Muon (`torch.optim.Muon`) as IR: which parameters it applies to, how each is read as a
//! linear map, and the update itself (momentum, Newton-Schulz orthogonalization in bf16,
//! the shape-dependent learning-rate adjustment, decoupled weight decay).
//!
//! torch.optim.Muon (PyTorch 2.9+, `torch/optim/_muon.py`), per 2-D parameter `W` with
//! gradient `g` and momentum buffer `B` (zero at first):
//! ```text
//! B  = B + (1 - mu) (g - B)                    buf.lerp_(grad, 1 - momentum)
//! U  = B - (B - g) (1 - mu)                     grad.lerp(buf, momentum)   (Nesterov)
//! X  = bf16(U), transposed when rows > cols;  X = X / max(||X||_F, eps)   (bf16)
//! 5x: G = X Xᵀ;  H = b G + c G G;  X = a X + H X   (each product accumulated in f32,
//!     each result rounded to bf16 once, as CPU addmm on bf16 does)
//! W  = W (1 - lr wd) - adjusted_lr X            adjusted_lr = lr sqrt(max(1, A/B))
//!                                               or 0.2 lr sqrt(max(A, B))
//! ```
//! with (a, b, c) = (3.4445, -4.7750, 2.0315), eps 1e-7, mu 0.95, wd 0.1. A and B are the
//! output and input features of the matrix as a linear map: hzp reads them from how the
//! graph multiplies by the weight ([`muon_matrices`]), so a weight an exporter stored
//! `[in, out]` (GPT-2's Conv1D, a legacy export's pre-transposed MatMul weight) gets the
//! same adjustment as one stored `[out, in]`. The Newton-Schulz result of a transposed
//! matrix is the transpose of the result (the same products, transposed), so the iteration
//! runs on the stored layout.

use crate::emit::Emitter;
pub use crate::train::muon_matrix::MuonMatrix;
use hzp_ir::{
    BinaryOp, DType, Group, Op, Program, ReduceOp, Tensor, TensorType, UnaryOp, Update, ValueDef,
    ValueId,
};
use std::collections::{BTreeMap, HashSet};

/// `--muon-lr`'s default (the issue's; torch's own default is 1e-3).
pub const DEFAULT_LR: f64 = 0.02;

/// How the learning rate is scaled by the matrix's shape (torch's `adjust_lr_fn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MuonAdjust {
    /// Keller Jordan's: `sqrt(max(1, A / B))` (torch's default, "original").
    Original,
    /// Moonshot's: `0.2 sqrt(max(A, B))`, matching AdamW's update RMS ("match_rms_adamw").
    MatchRmsAdamw,
}

impl MuonAdjust {
    pub fn parse(s: &str) -> Result<MuonAdjust, String> {
        match s {
            "original" => Ok(MuonAdjust::Original),
            "match_rms_adamw" => Ok(MuonAdjust::MatchRmsAdamw),
            other => Err(format!(
                "unknown Muon learning-rate adjustment `{other}` (expected original or match_rms_adamw)"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MuonAdjust::Original => "original",
            MuonAdjust::MatchRmsAdamw => "match_rms_adamw",
        }
    }

    /// The factor on the learning rate for a map with `out` output and `inp` input features.
    pub fn ratio(self, out: usize, inp: usize) -> f64 {
        let (a, b) = (out as f64, inp as f64);
        match self {
            MuonAdjust::Original => (a / b).max(1.0).sqrt(),
            MuonAdjust::MatchRmsAdamw => 0.2 * a.max(b).sqrt(),
        }
    }
}

/// torch.optim.Muon's settings; [`MuonSettings::torch`] gives its defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct MuonSettings {
    pub lr: f64,
    pub adjust: MuonAdjust,
    pub momentum: f64,
    pub weight_decay: f64,
    pub ns_steps: usize,
    pub coefficients: [f64; 3],
    pub eps: f64,
    /// Newton-Schulz in bf16, as torch (true); false keeps it in f32, for checks that
    /// need round-off not to be amplified (bf16 rounding makes the iteration sensitive to
    /// the last bits of the gradient: see tests/run_e2e.rs).
    pub ns_bf16: bool,
    /// Where the Newton-Schulz work runs in a multi-rank plan.
    pub placement: MuonPlacement,
}

/// Where a multi-rank plan orthogonalizes each matrix (`--muon-placement`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MuonPlacement {
    /// Every member of the optimizer group orthogonalizes every whole matrix and keeps its
    /// shard.
    Replicated,
    /// One owner per matrix (see [`crate::train::canzona`]).
    Canzona,
}

impl MuonPlacement {
    pub fn parse(s: &str) -> Result<MuonPlacement, String> {
        match s {
            "replicated" => Ok(MuonPlacement::Replicated),
            "canzona" => Ok(MuonPlacement::Canzona),
            other => Err(format!(
                "unknown Muon placement `{other}` (expected replicated or canzona)"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MuonPlacement::Replicated => "replicated",
            MuonPlacement::Canzona => "canzona",
        }
    }
}

impl MuonSettings {
    /// torch's defaults (momentum 0.95, Nesterov, weight decay 0.1, 5 Newton-Schulz steps
    /// with (3.4445, -4.7750, 2.0315), eps 1e-7) at learning rate `lr`.
    pub fn torch(lr: f64, adjust: MuonAdjust) -> MuonSettings {
        MuonSettings {
            lr,
            adjust,
            momentum: 0.95,
            weight_decay: 0.1,
            ns_steps: 5,
            coefficients: [3.4445, -4.7750, 2.0315],
            eps: 1e-7,
            ns_bf16: true,
            placement: MuonPlacement::Replicated,
        }
    }
}

/// Ops a weight passes through unchanged on its way to a product.
fn transparent(op: &Op) -> bool {
    matches!(op, Op::Cast { .. } | Op::Identity | Op::Copy)
}

/// The parameters of the forward program `fwd` that Muon updates, by name: every 2-D float
/// parameter a product reads (a linear map), except token-embedding tables (the data of a
/// `Gather`) and the LM head (a matrix of the product that makes the first output, the
/// logits). A 2-D parameter no product reads (a position table a preset slices and adds)
/// is no linear map and stays with AdamW. Each one's output and input features come from
/// how the graph multiplies by it: `x @ W` reads W as `[in, out]`, `x @ Transpose(W)`
/// (ONNX Gemm with transB, a dynamo export's Linear) and `W @ x` as `[out, in]`. A weight
/// read both ways keeps the stored reading `[out, in]` (torch's, from the parameter's
/// shape).
pub fn muon_matrices(fwd: &Program) -> BTreeMap<String, MuonMatrix> {
    let users = fwd.users();
    let head = lm_head_params(fwd);
    let mut out = BTreeMap::new();
    for prm in &fwd.params {
        let ty = fwd.ty(prm.value);
        if ty.rank() != 2 || !ty.dtype.is_float() || head.contains(&prm.value) {
            continue;
        }
        let (rows, cols) = (ty.shape[0], ty.shape[1]);
        // (value, read transposed) reachable from the parameter through transparent ops
        let mut stack = vec![(prm.value, false)];
        let mut seen = HashSet::new();
        let mut embedding = false;
        // Some(true): read as [in, out]; Some(false): as [out, in]
        let mut readings: Vec<bool> = Vec::new();
        while let Some((v, t)) = stack.pop() {
            if !seen.insert((v, t)) {
                continue;
            }
            for &n in &users[v.index()] {
                let node = &fwd.nodes[n.index()];
                match &node.op {
                    Op::Gather { .. } if node.inputs.first() == Some(&v) => embedding = true,
                    Op::MatMul => {
                        if node.inputs.get(1) == Some(&v) {
                            readings.push(!t);
                        }
                        if node.inputs.first() == Some(&v) {
                            readings.push(t);
                        }
                    }
                    Op::Transpose { perm } if perm == &[1, 0] => {
                        stack.push((node.outputs[0], !t));
                    }
                    op if transparent(op) => stack.push((node.outputs[0], t)),
                    _ => {}
                }
            }
        }
        // a matrix no product reads is no linear map (a position table added by slices)
        if embedding || readings.is_empty() {
            continue;
        }
        let in_out = readings.iter().all(|&r| r);
        let (out_features, in_features) = if in_out { (cols, rows) } else { (rows, cols) };
        out.insert(
            fwd.value(prm.value).name.clone(),
            MuonMatrix {
                rows,
                cols,
                out_features,
                in_features,
            },
        );
    }
    out
}

/// The 2-D parameters read by the product that makes the first output (through casts,
/// reshapes, transposes and a bias addition): the LM head.
fn lm_head_params(fwd: &Program) -> HashSet<ValueId> {
    let mut out = HashSet::new();
    let Some(&y) = fwd.outputs.first() else {
        return out;
    };
    let params: HashSet<ValueId> = fwd.params.iter().map(|p| p.value).collect();
    let def = |v: ValueId| match fwd.value(v).def {
        ValueDef::Node { node, .. } => Some(&fwd.nodes[node.index()]),
        _ => None,
    };
    // walk back to the product
    let mut v = y;
    let product = loop {
        let Some(n) = def(v) else { return out };
        match &n.op {
            Op::MatMul => break n,
            Op::Reshape { .. } | Op::Transpose { .. } => v = n.inputs[0],
            op if transparent(op) => v = n.inputs[0],
            Op::Binary(BinaryOp::Add) => {
                // the bias is the operand that is (a cast of) a parameter
                match n.inputs.iter().find(|&&x| !params.contains(&x)) {
                    Some(&x) => v = x,
                    None => return out,
                }
            }
            _ => return out,
        }
    };
    for &x in &product.inputs {
        let mut x = x;
        loop {
            if params.contains(&x) {
                if fwd.ty(x).rank() == 2 {
                    out.insert(x);
                }
                break;
            }
            match def(x) {
                Some(n)
                    if transparent(&n.op)
                        || matches!(n.op, Op::Transpose { .. } | Op::Reshape { .. }) =>
                {
                    x = n.inputs[0]
                }
                _ => break,
            }
        }
    }
    out
}

/// How the step holds the parameters: whole (a one-rank step) or as flat shards of a
/// flattened, zero-padded tensor over the optimizer group (see `spmd`).
pub(crate) enum Holding {
    Whole,
    /// Flat shards over `group` of `size` ranks; `member` is this rank's index in the
    /// group as an i64 scalar (needed when `size > 1`).
    Shards {
        group: Group,
        size: usize,
        member: Option<ValueId>,
    },
    /// Flat shards over `group` of `size > 1` ranks, each matrix orthogonalized by its owner
    /// in `partition` ([`canzona_bucket`]); `member` as above, needed when a bucket has
    /// flipped matrices.
    Canzona {
        group: Group,
        size: usize,
        member: Option<ValueId>,
        partition: crate::train::canzona::Partition,
    },
}

/// What every matrix's step shares: the settings, how parameters are held, and the Muon
/// learning rate of this step (an f32 scalar value).
pub(crate) struct MuonRun<'a> {
    pub settings: &'a MuonSettings,
    pub holding: &'a Holding,
    pub lr: ValueId,
}

fn bin(e: &mut Emitter, op: BinaryOp, x: ValueId, y: ValueId) -> Result<ValueId, String> {
    e.op(Op::Binary(op), &[x, y])
}

/// bf16 rounding of f32 data (the value stays f32): what torch stores in a bf16 tensor.
fn round_bf16(e: &mut Emitter, v: ValueId) -> Result<ValueId, String> {
    let b = e.op(Op::Cast { to: DType::BF16 }, &[v])?;
    e.op(Op::Cast { to: DType::F32 }, &[b])
}

/// Round to nearest even bf16 (finite inputs).
fn bf16_round(x: f32) -> f32 {
    let bits = x.to_bits();
    let r = bits.wrapping_add(0x7fff + ((bits >> 16) & 1));
    f32::from_bits(r & 0xffff_0000)
}

/// The transpose of the last two axes of a matrix or a batch of matrices.
fn transpose(e: &mut Emitter, v: ValueId) -> Result<ValueId, String> {
    let perm = if e.shape(v).len() == 3 {
        vec![0, 2, 1]
    } else {
        vec![1, 0]
    };
    e.op(Op::Transpose { perm }, &[v])
}

/// torch's `_zeropower_via_newtonschulz` of the f32 matrix `u` (`[rows, cols]`), or of each
/// matrix of a batch `[k, rows, cols]` (each normalized by its own norm): the result is f32
/// holding bf16 values.
pub(crate) fn orthogonalize(
    e: &mut Emitter,
    u: ValueId,
    s: &MuonSettings,
) -> Result<ValueId, String> {
    let f = DType::F32;
    let shape = e.shape(u);
    let batched = shape.len() == 3;
    let (rows, cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
    let tall = rows > cols;
    let round_bf16 = |e: &mut Emitter, v: ValueId| {
        if s.ns_bf16 {
            round_bf16(e, v)
        } else {
            Ok(v)
        }
    };
    let mut x = round_bf16(e, u)?;
    if tall {
        x = transpose(e, x)?;
    }
    let sq = bin(e, BinaryOp::Mul, x, x)?;
    let sum = e.op(
        Op::Reduce {
            op: ReduceOp::Sum,
            axes: if batched { vec![1, 2] } else { vec![0, 1] },
            keep_dims: batched,
        },
        &[sq],
    )?;
    let norm = e.op(Op::Unary(UnaryOp::Sqrt), &[sum])?;
    let norm = round_bf16(e, norm)?;
    // clamp(min=eps) of a bf16 tensor: eps as bf16
    let eps = if s.ns_bf16 {
        bf16_round(s.eps as f32) as f64
    } else {
        s.eps
    };
    let epsv = e.scalar(eps, f);
    let norm = bin(e, BinaryOp::Max, norm, epsv)?;
    let q = bin(e, BinaryOp::Div, x, norm)?;
    x = round_bf16(e, q)?;
    let [a, b, c] = s.coefficients;
    let (av, bv, cv) = (e.scalar(a, f), e.scalar(b, f), e.scalar(c, f));
    for _ in 0..s.ns_steps {
        let xt = transpose(e, x)?;
        let gram = e.op(Op::MatMul, &[x, xt])?;
        let gram = round_bf16(e, gram)?;
        // addmm(G, G, G, beta=b, alpha=c): b G + c (G G), rounded once
        let gg = e.op(Op::MatMul, &[gram, gram])?;
        let bg = bin(e, BinaryOp::Mul, gram, bv)?;
        let cgg = bin(e, BinaryOp::Mul, gg, cv)?;
        let h = bin(e, BinaryOp::Add, bg, cgg)?;
        let h = round_bf16(e, h)?;
        // addmm(X, H, X, beta=a): a X + H X, rounded once
        let hx = e.op(Op::MatMul, &[h, x])?;
        let ax = bin(e, BinaryOp::Mul, x, av)?;
        let nx = bin(e, BinaryOp::Add, ax, hx)?;
        x = round_bf16(e, nx)?;
    }
    if tall {
        x = transpose(e, x)?;
    }
    Ok(x)
}

/// Muon's momentum of parameter `w` with gradient `g` (f32, shaped like `w`): pushes the
/// buffer's update; returns the buffer (a state shaped like `w`) and the Nesterov update.
pub(crate) fn momentum(
    e: &mut Emitter,
    run: &MuonRun,
    (w, g): (ValueId, ValueId),
    updates: &mut Vec<Update>,
) -> Result<(ValueId, ValueId), String> {
    let s = run.settings;
    let f = DType::F32;
    let wname = e.p.value(w).name.clone();
    let ty = e.ty(w).clone();
    let bn = e.fresh(&format!("muon.momentum/{wname}"));
    let buf = e.p.add_state(bn, ty.clone(), None);
    // buf.lerp_(grad, 1 - mu) then grad.lerp(buf, mu), as torch's lerp computes them
    // (weight below 0.5: self + w (end - self); otherwise end - (end - self)(1 - w))
    let w1 = e.scalar(1.0 - s.momentum, f);
    let d = bin(e, BinaryOp::Sub, g, buf)?;
    let t = bin(e, BinaryOp::Mul, d, w1)?;
    let nb = bin(e, BinaryOp::Add, buf, t)?;
    updates.push(Update {
        target: buf,
        value: nb,
    });
    let one_minus = (1.0f32 - s.momentum as f32) as f64;
    let w2 = e.scalar(one_minus, f);
    let d = bin(e, BinaryOp::Sub, nb, g)?;
    let t = bin(e, BinaryOp::Mul, d, w2)?;
    let u = bin(e, BinaryOp::Sub, nb, t)?;
    Ok((buf, u))
}

/// One Muon step of parameter `w` (whole `[rows, cols]`, or this rank's flat shard) with
/// gradient `g` (same shape, f32) at Muon learning rate `lr` (an f32 scalar value). Pushes
/// the updates of `w` and its momentum buffer; returns the buffer (a state shaped like
/// `w`). Not for [`Holding::Canzona`] (see [`canzona_bucket`]).
pub(crate) fn muon_step(
    e: &mut Emitter,
    run: &MuonRun,
    m: &MuonMatrix,
    (w, g): (ValueId, ValueId),
    updates: &mut Vec<Update>,
) -> Result<ValueId, String> {
    let (buf, u) = momentum(e, run, (w, g), updates)?;
    let (s, holding) = (run.settings, run.holding);
    let ty = e.ty(w).clone();
    let f = DType::F32;
    // the whole matrix
    let numel = m.rows * m.cols;
    let full = match holding {
        Holding::Whole => u,
        Holding::Shards { group, size, .. } => {
            let mut v = u;
            if *size > 1 {
                v = e.op(
                    Op::AllGather {
                        group: group.clone(),
                        axis: 0,
                    },
                    &[v],
                )?;
            }
            let padded = e.ty(v).shape[0];
            crate::dist::unpad(e, v, numel, padded, &[m.rows, m.cols])?
        }
        Holding::Canzona { .. } => {
            return Err("internal: a Canzona matrix stepped on its own".into());
        }
    };
    let o = orthogonalize(e, full, s)?;
    // back to the holding's form
    let o = match holding {
        Holding::Whole => o,
        Holding::Shards {
            size,
            member,
            group: _,
        } => {
            let mut v = e.op(Op::Reshape { shape: vec![numel] }, &[o])?;
            let per = ty.shape[0];
            let padded = per * size;
            if padded > numel {
                let z = e.zeros(&TensorType::new(f, vec![padded - numel]))?;
                v = e.op(Op::Concat { axis: 0 }, &[v, z])?;
            }
            if *size > 1 {
                let me = member.ok_or("internal: no optimizer-group member index")?;
                v = e.op(
                    Op::Reshape {
                        shape: vec![*size, per],
                    },
                    &[v],
                )?;
                v = e.op(Op::Gather { axis: 0 }, &[v, me])?;
            }
            v
        }
        Holding::Canzona { .. } => {
            return Err("internal: a Canzona matrix stepped on its own".into());
        }
    };
    apply(e, run, m, w, o, updates)?;
    Ok(buf)
}

/// The Newton-Schulz of one Canzona bucket and the update of its matrices. `steps` holds,
/// per matrix name, its master shard `w` (flat, `[per]`) and its Nesterov update shard `u`.
/// The shards of every matrix go to its owner with one all-to-all over the optimizer group
/// (row `r * slots + t` of what a rank sends is its shard of the matrix rank `r` owns in
/// slot `t`, zeros for padding); each rank stacks its slots' whole matrices, orthogonalizes
/// them as one batch, and a second all-to-all returns each result's shards; every rank then
/// applies its shard of every matrix of the bucket. No rank-dependent op: a rank's slots
/// are whatever the others send it; where the bucket has [flipped] matrices, which of its
/// slots to transpose is a row of a constant `[o, slots]` table taken at `member` (this
/// rank's index in the group).
///
/// [flipped]: crate::train::canzona::Bucket::flipped
pub(crate) fn canzona_bucket(
    e: &mut Emitter,
    run: &MuonRun,
    (group, size, member): (&Group, usize, Option<ValueId>),
    bucket: &crate::train::canzona::Bucket,
    matrices: &BTreeMap<String, MuonMatrix>,
    steps: &BTreeMap<String, (ValueId, ValueId)>,
    updates: &mut Vec<Update>,
) -> Result<(), String> {
    let (o, slots) = (size, bucket.slots);
    let numel = bucket.rows * bucket.cols;
    let get = |name: &str| {
        steps
            .get(name)
            .copied()
            .ok_or_else(|| format!("internal: Canzona matrix `{name}` has no step"))
    };
    let first = bucket
        .grid
        .iter()
        .flatten()
        .flatten()
        .next()
        .ok_or("internal: an empty Canzona bucket")?;
    let per = e.shape(get(first)?.0)[0];
    if per * o < numel {
        return Err(format!(
            "internal: Canzona shard of `{first}` ({per} x {o}) smaller than {numel}"
        ));
    }
    let rows = slot_rows(e, bucket, &get, per, o * slots)?;
    let send = e.op(Op::Concat { axis: 0 }, &rows)?;
    let a2a = |e: &mut Emitter, v: ValueId| {
        e.op(
            Op::AllToAll {
                group: group.clone(),
                split_axis: 0,
                concat_axis: 0,
            },
            &[v],
        )
    };
    // this rank's slots stored transposed: bool [slots]
    let flips = if bucket.flipped.is_empty() {
        None
    } else {
        let me = member.ok_or("internal: no optimizer-group member index for Canzona")?;
        let table: Vec<i64> = bucket
            .grid
            .iter()
            .flatten()
            .map(|m| m.as_ref().is_some_and(|n| bucket.flipped.contains(n)) as i64)
            .collect();
        let name = e.fresh("muon.canzona.flipped");
        let table = e.p.add_const(name, Tensor::i64(vec![o, slots], table));
        let mine = e.op(Op::Gather { axis: 0 }, &[table, me])?;
        let one = e.scalar(1.0, DType::I64);
        Some(bin(e, BinaryOp::Equal, mine, one)?)
    };
    // row q * slots + t: member q's shard of this rank's slot t
    let got = a2a(e, send)?;
    let whole = owned_matrices(e, got, (o, slots, per), bucket, flips)?;
    let ortho = orthogonalize(e, whole, run.settings)?;
    let v = matrix_shards(e, ortho, (o, slots, per), numel, flips)?;
    // row q * slots + t: this rank's shard of the matrix member q owns in slot t
    let back = a2a(e, v)?;
    for (q, row) in bucket.grid.iter().enumerate() {
        for (t, m) in row.iter().enumerate() {
            let Some(name) = m else { continue };
            let (w, _) = get(name)?;
            let k = (q * slots + t) as i64;
            let mine = e.op(
                Op::Slice {
                    axes: vec![0],
                    starts: vec![k],
                    ends: vec![k + 1],
                    steps: vec![1],
                },
                &[back],
            )?;
            let mine = e.op(Op::Reshape { shape: vec![per] }, &[mine])?;
            let mm = matrices
                .get(name)
                .ok_or_else(|| format!("internal: `{name}` is no Muon matrix"))?;
            apply(e, run, mm, w, mine, updates)?;
        }
    }
    Ok(())
}

/// A Canzona matrix's (master shard, Nesterov update shard), by name.
type StepOf<'a> = dyn Fn(&str) -> Result<(ValueId, ValueId), String> + 'a;

/// Each member's shard of every slot of `bucket`, in grid order (member q's slot t at row
/// q * slots + t), each `[1, per]`: a matrix's Nesterov update shard, or zeros for an empty
/// slot.
fn slot_rows(
    e: &mut Emitter,
    bucket: &crate::train::canzona::Bucket,
    get: &StepOf,
    per: usize,
    capacity: usize,
) -> Result<Vec<ValueId>, String> {
    let f = DType::F32;
    let mut zero = None;
    let mut rows = Vec::with_capacity(capacity);
    for row in &bucket.grid {
        for m in row {
            let v = match m {
                Some(name) => {
                    let (w, u) = get(name)?;
                    if e.shape(w) != [per] {
                        return Err(format!(
                            "internal: Canzona shards of one bucket differ (`{name}`)"
                        ));
                    }
                    u
                }
                None => match zero {
                    Some(z) => z,
                    None => {
                        let z = e.zeros(&TensorType::new(f, vec![per]))?;
                        zero = Some(z);
                        z
                    }
                },
            };
            rows.push(e.op(
                Op::Reshape {
                    shape: vec![1, per],
                },
                &[v],
            )?);
        }
    }
    Ok(rows)
}

/// `x` where `cond` (bool `[slots]`) is false, `flipped` where it is true; both
/// `[slots, ...]`.
fn select_slots(
    e: &mut Emitter,
    cond: ValueId,
    flipped: ValueId,
    x: ValueId,
) -> Result<ValueId, String> {
    let mut shape = e.shape(x);
    shape[1..].iter_mut().for_each(|d| *d = 1);
    let c = e.op(Op::Reshape { shape }, &[cond])?;
    e.op(Op::Where, &[c, flipped, x])
}

/// The whole matrices of this rank's slots, `[slots, rows, cols]`, from the all-to-all's
/// `got` (row q * slots + t: member q's shard of slot t, `per` elements each); the slots
/// `flips` marks arrive as `[cols, rows]` and are transposed.
fn owned_matrices(
    e: &mut Emitter,
    got: ValueId,
    (o, slots, per): (usize, usize, usize),
    bucket: &crate::train::canzona::Bucket,
    flips: Option<ValueId>,
) -> Result<ValueId, String> {
    let numel = bucket.rows * bucket.cols;
    let v = e.op(
        Op::Reshape {
            shape: vec![o, slots, per],
        },
        &[got],
    )?;
    let v = e.op(
        Op::Transpose {
            perm: vec![1, 0, 2],
        },
        &[v],
    )?;
    let mut v = e.op(
        Op::Reshape {
            shape: vec![slots, o * per],
        },
        &[v],
    )?;
    if o * per > numel {
        v = e.op(
            Op::Slice {
                axes: vec![1],
                starts: vec![0],
                ends: vec![numel as i64],
                steps: vec![1],
            },
            &[v],
        )?;
    }
    let straight = e.op(
        Op::Reshape {
            shape: vec![slots, bucket.rows, bucket.cols],
        },
        &[v],
    )?;
    let Some(flips) = flips else {
        return Ok(straight);
    };
    let t = e.op(
        Op::Reshape {
            shape: vec![slots, bucket.cols, bucket.rows],
        },
        &[v],
    )?;
    let t = e.op(
        Op::Transpose {
            perm: vec![0, 2, 1],
        },
        &[t],
    )?;
    select_slots(e, flips, t, straight)
}

/// The orthogonalized matrices `[slots, rows, cols]` cut back into every member's shards,
/// in the all-to-all's order (row q * slots + t: member q's shard of slot t); the slots
/// `flips` marks go back transposed, as their matrices are stored.
fn matrix_shards(
    e: &mut Emitter,
    ortho: ValueId,
    (o, slots, per): (usize, usize, usize),
    numel: usize,
    flips: Option<ValueId>,
) -> Result<ValueId, String> {
    let f = DType::F32;
    let flat = Op::Reshape {
        shape: vec![slots, numel],
    };
    let mut v = e.op(flat.clone(), &[ortho])?;
    if let Some(flips) = flips {
        let t = e.op(
            Op::Transpose {
                perm: vec![0, 2, 1],
            },
            &[ortho],
        )?;
        let t = e.op(flat, &[t])?;
        v = select_slots(e, flips, t, v)?;
    }
    if o * per > numel {
        let z = e.zeros(&TensorType::new(f, vec![slots, o * per - numel]))?;
        v = e.op(Op::Concat { axis: 1 }, &[v, z])?;
    }
    let v = e.op(
        Op::Reshape {
            shape: vec![slots, o, per],
        },
        &[v],
    )?;
    let v = e.op(
        Op::Transpose {
            perm: vec![1, 0, 2],
        },
        &[v],
    )?;
    e.op(
        Op::Reshape {
            shape: vec![o * slots, per],
        },
        &[v],
    )
}

/// `W (1 - lr wd) - adjusted_lr O` for the orthogonalized update `o` (shaped like `w`).
fn apply(
    e: &mut Emitter,
    run: &MuonRun,
    m: &MuonMatrix,
    w: ValueId,
    o: ValueId,
    updates: &mut Vec<Update>,
) -> Result<(), String> {
    let (s, lr) = (run.settings, run.lr);
    let f = DType::F32;
    // W (1 - lr wd) - adjusted_lr O
    let wd = e.scalar(s.weight_decay, f);
    let one = e.scalar(1.0, f);
    let lwd = bin(e, BinaryOp::Mul, lr, wd)?;
    let decay = bin(e, BinaryOp::Sub, one, lwd)?;
    let neg_ratio = e.scalar(-s.adjust.ratio(m.out_features, m.in_features), f);
    let step = bin(e, BinaryOp::Mul, lr, neg_ratio)?;
    let kept = bin(e, BinaryOp::Mul, w, decay)?;
    let moved = bin(e, BinaryOp::Mul, o, step)?;
    let nw = bin(e, BinaryOp::Add, kept, moved)?;
    updates.push(Update {
        target: w,
        value: nw,
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hzp_ir::text::parse;

    /// An embedding table, a weight read `x @ W` ([in, out]), one read `x @ Wᵀ`
    /// ([out, in]), a head, a 1-D parameter, and a 2-D one only added (no linear map).
    const MODEL: &str = r#"program "m"
input %ids : i64[2,3]
param %emb : f32[10,4]
param %pos : f32[3,4]
param %w1 : f32[4,8]
param %b1 : f32[8]
param %w2 : f32[6,8]
param %head : f32[6,10]
%e = Gather{axis=0}(%emb, %ids) : f32[2,3,4] "embed"
%x = Add(%e, %pos) : f32[2,3,4] "pos"
%h = MatMul(%x, %w1) : f32[2,3,8] "fc1"
%hb = Add(%h, %b1) : f32[2,3,8] "fc1/bias"
%t = Transpose{perm=[1,0]}(%w2) : f32[8,6] "fc2/T"
%g = MatMul(%hb, %t) : f32[2,3,6] "fc2"
%y = MatMul(%g, %head) : f32[2,3,10] "head"
output %y
"#;

    #[test]
    fn matrices_are_read_as_linear_maps_without_embeddings_and_head() {
        let p = parse(MODEL, "m.hzp", &|_| None).unwrap();
        let m = muon_matrices(&p);
        let names: Vec<&str> = m.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["w1", "w2"]);
        let w1 = &m["w1"];
        assert_eq!(
            (w1.rows, w1.cols, w1.out_features, w1.in_features),
            (4, 8, 8, 4)
        );
        let w2 = &m["w2"];
        assert_eq!(
            (w2.rows, w2.cols, w2.out_features, w2.in_features),
            (6, 8, 6, 8)
        );
    }

    #[test]
    fn adjustments_are_torchs() {
        // original: sqrt(max(1, A/B)); match_rms_adamw: 0.2 sqrt(max(A, B))
        assert_eq!(MuonAdjust::Original.ratio(256, 64), 2.0);
        assert_eq!(MuonAdjust::Original.ratio(64, 256), 1.0);
        assert_eq!(MuonAdjust::MatchRmsAdamw.ratio(64, 256), 0.2 * 16.0);
        assert!(MuonAdjust::parse("spectral_unclamped").is_err());
        // torch.tensor(1e-7).to(torch.bfloat16).item() == 1.0011717677116394e-07
        assert_eq!(bf16_round(1e-7).to_bits(), 0x33d7_0000);
    }
}
