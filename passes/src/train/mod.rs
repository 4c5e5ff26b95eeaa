//! The training step as IR: loss attachment, backward (via [`crate::train::autodiff`]), gradient
//! accumulation over micro-batches, global-norm clipping, and the optimizer update (AdamW or
//! SGD with momentum, exactly as `torch.optim` computes them), all as ordinary ops so that
//! later passes can shard and schedule them.
//!
//! A training-step program has the global batch as inputs, the trainable parameters as
//! parameters, optimizer moments and the step counter as states, the loss as its first
//! output, and one [`Update`] per parameter and state.

pub mod autodiff;
pub mod canzona;
pub mod muon;
pub mod muon_matrix;
mod router_aux;
pub mod simplify;
pub mod ties;

use crate::emit::Emitter;
use crate::train::autodiff::differentiate_scaled;
use crate::train::muon::{Holding, MuonMatrix, MuonSettings};
use hzp_ir::{
    BinaryOp, DType, Op, Precision, Program, ReduceOp, Role, RoleKind, Tensor, TensorType, UnaryOp,
    Update, ValueDef, ValueId,
};
use std::collections::{BTreeMap, HashMap};

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TrainError(pub String);

fn terr(s: impl Into<String>) -> TrainError {
    TrainError(s.into())
}

/// What the loss is computed from.
#[derive(Clone, Debug, PartialEq)]
pub enum LossKind {
    /// Causal LM: mean cross-entropy of `logits[:, :-1]` against `labels[:, 1:]`, where the
    /// labels are the input named here (default `input_ids`) — what transformers computes
    /// with `labels=input_ids`.
    Lm { labels: Option<String> },
    /// Mean cross-entropy of the first output (classes on the last axis) against the integer
    /// input `labels` (added as a graph input if the model does not have it).
    Ce { labels: String },
    /// Mean of the first output.
    Mean,
    /// Mean squared error between the first output and the float input `target`.
    Mse { target: String },
    /// `base + coef * aux`, where `aux` is the routers' load-balancing loss as transformers
    /// computes it (`load_balancing_loss_func`; see [`router_aux`]) over the routed MoE
    /// layers of the micro-batch.
    WithRouterAux { base: Box<LossKind>, coef: f64 },
}

impl LossKind {
    pub fn parse(
        kind: &str,
        labels: Option<&str>,
        target: Option<&str>,
    ) -> Result<LossKind, TrainError> {
        match kind {
            "lm" => Ok(LossKind::Lm {
                labels: labels.map(str::to_string),
            }),
            "ce" => Ok(LossKind::Ce {
                labels: labels
                    .ok_or_else(|| {
                        terr("--loss ce needs --labels NAME (an integer input of class ids)")
                    })?
                    .to_string(),
            }),
            "mean" => Ok(LossKind::Mean),
            "mse" => Ok(LossKind::Mse {
                target: target
                    .ok_or_else(|| {
                        terr(
                            "--loss mse needs --target NAME (a float input shaped like the output)",
                        )
                    })?
                    .to_string(),
            }),
            other => Err(terr(format!(
                "unknown loss `{other}` (expected lm, ce, mean or mse)"
            ))),
        }
    }

    /// This loss plus `coef` times the routers' auxiliary load-balancing loss; a
    /// coefficient of 0 leaves the loss as it is.
    pub fn with_router_aux(self, coef: f64) -> Result<LossKind, TrainError> {
        if !coef.is_finite() || coef < 0.0 {
            return Err(terr(format!(
                "--router-aux-loss {coef}: the coefficient must be a finite number of at least 0"
            )));
        }
        Ok(if coef == 0.0 {
            self
        } else {
            LossKind::WithRouterAux {
                base: Box::new(self),
                coef,
            }
        })
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Optimizer {
    /// `torch.optim.AdamW` (decoupled weight decay, bias correction).
    AdamW {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
    /// `torch.optim.Muon` on the matrices [`crate::train::muon::muon_matrices`] picks and
    /// `torch.optim.AdamW` (these fields, as in [`Optimizer::AdamW`]) on every other
    /// parameter. `lr` is AdamW's rate and the step's rate input; Muon's rate follows it:
    /// `muon.lr * rate / lr`, so a schedule scales both.
    Muon {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        muon: MuonSettings,
    },
    /// `torch.optim.SGD` with momentum (dampening 0, not Nesterov).
    Sgd {
        lr: f64,
        momentum: f64,
        weight_decay: f64,
    },
}

impl Optimizer {
    /// torch's defaults: AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    pub fn adamw_default() -> Optimizer {
        Optimizer::AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub loss: LossKind,
    /// The update; `None` builds a gradient program instead: outputs
    /// `[loss, (grad norm if clipping), grad of each parameter...]` and no updates.
    pub optimizer: Option<Optimizer>,
    /// Clip gradients to this global L2 norm (torch.nn.utils.clip_grad_norm_).
    pub clip_grad_norm: Option<f64>,
    /// Micro-batches per step; the global batch (axis 0 of every input) is split evenly.
    pub micro_batches: usize,
    /// Compute dtype: F32, or BF16 with fp32 master weights, states and loss.
    pub compute: DType,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            loss: LossKind::Lm { labels: None },
            optimizer: Some(Optimizer::adamw_default()),
            clip_grad_norm: None,
            micro_batches: 1,
            compute: DType::F32,
        }
    }
}

fn first_output(p: &Program) -> Result<ValueId, TrainError> {
    p.outputs.first().copied().ok_or_else(|| {
        terr(format!(
            "model `{}` has no outputs to compute a loss from",
            p.name
        ))
    })
}

/// Finds input `name`, or adds it with type `ty`; checks the type either way.
fn input_named(
    p: &mut Program,
    name: &str,
    ty: TensorType,
    what: &str,
) -> Result<ValueId, TrainError> {
    match p.find_value(name) {
        Some(v) if p.value(v).def == ValueDef::Input => {
            let have = p.ty(v);
            if have.shape != ty.shape || (ty.dtype.is_int() != have.dtype.is_int()) {
                return Err(terr(format!(
                    "{what} `{name}` is {have}, but the loss needs {ty}"
                )));
            }
            Ok(v)
        }
        Some(_) => Err(terr(format!(
            "{what} `{name}` is a value of the model, not an input"
        ))),
        None => Ok(p.add_input(name, ty)),
    }
}

/// Returns a copy of the forward program whose only output is the scalar f32 loss.
pub fn attach_loss(fwd: &Program, kind: &LossKind) -> Result<Program, TrainError> {
    let mut p = fwd.clone();
    let y = first_output(&p)?;
    let yt = p.ty(y).clone();
    if !yt.dtype.is_float() {
        return Err(terr(format!(
            "the first output `{}` is {}, not a float tensor a loss can be computed from",
            p.value(y).name,
            yt
        )));
    }
    let loss = emit_loss(&mut p, y, kind)?;
    // Name the loss value `loss` when that name is free, for readable programs.
    if p.find_value("loss").is_none() {
        p.values[loss.index()].name = "loss".into();
    }
    p.outputs = vec![loss];
    p.eliminate_dead_code();
    Ok(p)
}

/// Emits the scalar f32 loss `kind` of the model output `y` into `p`.
fn emit_loss(p: &mut Program, y: ValueId, kind: &LossKind) -> Result<ValueId, TrainError> {
    let yt = p.ty(y).clone();
    Ok(match kind {
        LossKind::WithRouterAux { base, coef } => {
            let base = emit_loss(p, y, base)?;
            router_aux::add_router_aux(p, base, *coef).map_err(terr)?
        }
        LossKind::Lm { labels } => {
            let name = labels.clone().unwrap_or_else(|| "input_ids".into());
            if yt.rank() != 3 {
                return Err(terr(format!(
                    "--loss lm needs logits shaped [batch, seq, vocab]; the first output `{}` is {}",
                    p.value(y).name,
                    yt
                )));
            }
            let (b, t) = (yt.shape[0], yt.shape[1]);
            if t < 2 {
                return Err(terr("--loss lm needs a sequence of at least 2 tokens"));
            }
            let lab = match p.find_value(&name) {
                Some(v) if p.value(v).def == ValueDef::Input && p.ty(v).dtype.is_int() && p.ty(v).shape == vec![b, t] => v,
                Some(v) => {
                    return Err(terr(format!(
                        "--loss lm takes labels from `{name}`, which is {} (needs an integer input shaped [{b},{t}]); name another with --labels",
                        p.ty(v)
                    )))
                }
                None => {
                    return Err(terr(format!(
                        "--loss lm takes labels from the input `{name}`, which the model does not have; name one with --labels"
                    )))
                }
            };
            let head = sliceable_head(p, y);
            let mut e = Emitter::new(p);
            e.enter("loss", Role::of(RoleKind::Loss));
            (|| -> Result<ValueId, String> {
                let shift = Op::Slice {
                    axes: vec![1],
                    starts: vec![0],
                    ends: vec![t as i64 - 1],
                    steps: vec![1],
                };
                // The last position predicts nothing: leave it out before the LM head's
                // product rather than after (the logits are the largest tensor of the step),
                // else before the logits are cast to f32 for the loss (a bf16 copy, not f32)
                let lg = match head {
                    Some((h, w)) => {
                        let hs = e.op(shift, &[h])?;
                        let lg = e.op(Op::MatMul, &[hs, w])?;
                        to_f32(&mut e, lg)?
                    }
                    None => {
                        let ys = e.op(shift, &[y])?;
                        to_f32(&mut e, ys)?
                    }
                };
                let lb = e.op(
                    Op::Slice {
                        axes: vec![1],
                        starts: vec![1],
                        ends: vec![t as i64],
                        steps: vec![1],
                    },
                    &[lab],
                )?;
                cross_entropy(&mut e, lg, lb)
            })()
            .map_err(terr)?
        }
        LossKind::Ce { labels } => {
            let lead = yt.shape[..yt.rank().saturating_sub(1)].to_vec();
            if yt.rank() < 2 {
                return Err(terr("--loss ce needs an output with a class axis last"));
            }
            let lab = input_named(p, labels, TensorType::new(DType::I64, lead), "--labels")?;
            let mut e = Emitter::new(p);
            e.enter("loss", Role::of(RoleKind::Loss));
            (|| -> Result<ValueId, String> {
                let y = to_f32(&mut e, y)?;
                cross_entropy(&mut e, y, lab)
            })()
            .map_err(terr)?
        }
        LossKind::Mean => {
            let mut e = Emitter::new(p);
            e.enter("loss", Role::of(RoleKind::Loss));
            (|| -> Result<ValueId, String> {
                let y = to_f32(&mut e, y)?;
                mean_all(&mut e, y)
            })()
            .map_err(terr)?
        }
        LossKind::Mse { target } => {
            let tv = input_named(
                p,
                target,
                TensorType::new(DType::F32, yt.shape.clone()),
                "--target",
            )?;
            let mut e = Emitter::new(p);
            e.enter("loss", Role::of(RoleKind::Loss));
            (|| -> Result<ValueId, String> {
                let y = to_f32(&mut e, y)?;
                let tv = to_f32(&mut e, tv)?;
                let d = e.op(Op::Binary(BinaryOp::Sub), &[y, tv])?;
                let d2 = e.op(Op::Binary(BinaryOp::Mul), &[d, d])?;
                mean_all(&mut e, d2)
            })()
            .map_err(terr)?
        }
    })
}

/// When the logits `y` are a float `MatMul(h, w)` of hidden states `h` [batch, seq, hidden]
/// and a matrix `w`, read by nothing else: `(h, w)`. Slicing positions of `h` then gives the
/// same rows of the product as slicing the logits.
fn sliceable_head(p: &Program, y: ValueId) -> Option<(ValueId, ValueId)> {
    let ValueDef::Node { node, .. } = p.value(y).def else {
        return None;
    };
    let n = p.nodes.get(node.index())?;
    let (Op::MatMul, [h, w]) = (&n.op, n.inputs.as_slice()) else {
        return None;
    };
    let read_elsewhere = p.nodes.iter().any(|m| m.inputs.contains(&y));
    let ok = p.ty(y).dtype.is_float()
        && p.ty(*h).rank() == 3
        && p.ty(*w).rank() == 2
        && p.ty(*h).shape[..2] == p.ty(y).shape[..2]
        && !read_elsewhere
        && p.outputs.iter().filter(|&&o| o == y).count() == 1;
    ok.then_some((*h, *w))
}

fn to_f32(e: &mut Emitter, v: ValueId) -> Result<ValueId, String> {
    if e.ty(v).dtype == DType::F32 {
        Ok(v)
    } else {
        e.op(Op::Cast { to: DType::F32 }, &[v])
    }
}

fn mean_all(e: &mut Emitter, v: ValueId) -> Result<ValueId, String> {
    let axes: Vec<usize> = (0..e.ty(v).rank()).collect();
    e.op(
        Op::Reduce {
            op: ReduceOp::Mean,
            axes,
            keep_dims: false,
        },
        &[v],
    )
}

/// Mean over all positions of -log softmax(logits)[label]; logits [..., C], labels [...].
/// One fused op per direction: the loss never materializes the log-probabilities, and its
/// gradient is softmax - onehot in one pass over the logits.
fn cross_entropy(e: &mut Emitter, logits: ValueId, labels: ValueId) -> Result<ValueId, String> {
    let r = e.ty(logits).rank();
    let per = e.op(Op::SoftmaxCrossEntropy { axis: r - 1 }, &[logits, labels])?;
    mean_all(e, per)
}

/// Forward + loss + backward for one micro-batch: outputs `[loss, grad of each parameter]`
/// in parameter order. This is what `hzp grad` runs.
pub fn gradient_program(fwd: &Program, kind: &LossKind) -> Result<Program, TrainError> {
    gradient_program_scaled(fwd, kind, 1.0)
}

/// [`gradient_program`] whose gradients are those of `scale * loss` (the loss output itself
/// is not scaled): a sharded step seeds its backward with `1 / (ranks * micro-batches)` so
/// that the reduced gradients are the global mean without a multiply per parameter.
pub fn gradient_program_scaled(
    fwd: &Program,
    kind: &LossKind,
    scale: f64,
) -> Result<Program, TrainError> {
    let mut p = attach_loss(fwd, kind)?;
    // one GeluTanh node per written-out GELU: one pass forward and one (GeluTanhGrad) back
    if crate::train::simplify::fuse_gelu_tanh(&mut p) > 0 {
        p.eliminate_dead_code();
    }
    let loss = p.outputs[0];
    let params: Vec<ValueId> = p.params.iter().map(|x| x.value).collect();
    let grads =
        differentiate_scaled(&mut p, loss, &params, scale).map_err(|e| terr(e.to_string()))?;
    let mut names = hzp_ir::NameSet::from_program(&p);
    for (&prm, &g) in params.iter().zip(&grads) {
        // Give each gradient a findable name: `grad/<parameter name>`. A gradient that is
        // itself another value (e.g. a parameter read once by Identity) keeps its name.
        if p.value(g).def != ValueDef::Param && !p.outputs.contains(&g) {
            let n = names.fresh(&format!("grad/{}", p.value(prm).name));
            p.values[g.index()].name = n;
        }
    }
    p.outputs = std::iter::once(loss).chain(grads).collect();
    // a transposed weight's gradient as one product, without transposing the result
    crate::train::simplify::transpose_products(&mut p);
    p.eliminate_dead_code();
    Ok(p)
}

/// Copies the nodes of `src` into `dst`, reading `src`'s inputs (and any parameter listed
/// there) from `input_map`, and its other parameters and constants from the same-named
/// values of `dst` (created on first use). Returns the values of `src`'s outputs in `dst`.
pub(crate) fn inline(
    dst: &mut Program,
    src: &Program,
    input_map: &HashMap<ValueId, ValueId>,
    suffix: &str,
) -> Result<Vec<ValueId>, TrainError> {
    let mut map: HashMap<ValueId, ValueId> = input_map.clone();
    let mut names = hzp_ir::NameSet::from_program(dst);
    for prm in &src.params {
        if map.contains_key(&prm.value) {
            continue; // the caller supplies this parameter's value
        }
        let name = &src.value(prm.value).name;
        let v = match dst.find_value(name) {
            Some(v) => v,
            None => {
                names.insert(name);
                dst.add_param(name.clone(), src.ty(prm.value).clone(), prm.data.clone())
            }
        };
        map.insert(prm.value, v);
    }
    for c in &src.consts {
        let name = &src.value(c.value).name;
        let v = match dst.find_value(name) {
            Some(v) if dst.value(v).def == ValueDef::Const => v,
            _ => {
                let n = names.fresh(name);
                dst.add_const(n, c.data.clone())
            }
        };
        map.insert(c.value, v);
    }
    for n in &src.nodes {
        let ins: Vec<ValueId> = n
            .inputs
            .iter()
            .map(|v| {
                map.get(v)
                    .copied()
                    .ok_or_else(|| terr(format!("inlining: `{}` has no value", src.value(*v).name)))
            })
            .collect::<Result<_, _>>()?;
        let outs: Vec<String> = n
            .outputs
            .iter()
            .map(|&o| names.fresh(&format!("{}{suffix}", src.value(o).name)))
            .collect();
        let node_name = format!("{}{suffix}", n.name);
        let new = dst
            .add_node(node_name, n.op.clone(), ins, outs)
            .map_err(terr)?;
        if let Some(added) = dst.nodes.last_mut() {
            added.role = n.role.clone();
        }
        for (&o, nv) in n.outputs.iter().zip(new) {
            map.insert(o, nv);
        }
    }
    src.outputs
        .iter()
        .map(|o| {
            map.get(o)
                .copied()
                .ok_or_else(|| terr("inlining: an output has no value"))
        })
        .collect()
}

/// Rewrites a forward program to compute in `compute` (bf16/f16): parameters stay fp32
/// (the master weights) and are cast at their uses; float constants, inputs, casts and
/// fills produce the compute dtype.
pub fn lower_precision(fwd: &Program, compute: DType) -> Result<Program, TrainError> {
    lower_precision_cow(fwd, compute).map(std::borrow::Cow::into_owned)
}

/// [`lower_precision`] that borrows `fwd` itself where there is nothing to lower (f32): the
/// compiler only reads the lowered program, and a copy of a large program is a large share
/// of its memory traffic.
pub fn lower_precision_cow(
    fwd: &Program,
    compute: DType,
) -> Result<std::borrow::Cow<'_, Program>, TrainError> {
    if compute == DType::F32 {
        return Ok(std::borrow::Cow::Borrowed(fwd));
    }
    lower_precision_owned(fwd, compute).map(std::borrow::Cow::Owned)
}

fn lower_precision_owned(fwd: &Program, compute: DType) -> Result<Program, TrainError> {
    let mut p = Program::new(fwd.name.clone());
    p.mesh = fwd.mesh.clone();
    // `fwd` and a cast per parameter and input, sized up front (not regrown and copied)
    let casts = fwd.params.len() + fwd.inputs.len();
    p.values.reserve(fwd.values.len() + casts);
    p.nodes.reserve(fwd.nodes.len() + casts);
    let mut map = HashMap::new();
    let mut names = hzp_ir::FreshNames::over(fwd);
    for &i in &fwd.inputs {
        map.insert(i, p.add_input(fwd.value(i).name.clone(), fwd.ty(i).clone()));
    }
    let mut cast_inputs = HashMap::new();
    for prm in &fwd.params {
        let v = p.add_param(
            fwd.value(prm.value).name.clone(),
            fwd.ty(prm.value).clone(),
            prm.data.clone(),
        );
        map.insert(prm.value, v);
    }
    for c in &fwd.consts {
        let data = if c.data.dtype() == DType::F32 {
            hzp_ir::Tensor::from_f64(compute, c.data.shape.clone(), &c.data.to_f64_vec())
        } else {
            c.data.clone()
        };
        map.insert(c.value, p.add_const(fwd.value(c.value).name.clone(), data));
    }
    // Each f32 parameter or input is cast once, just before the first node that reads it;
    // those read by a product's readers (a bias added to it) before the product, so that a
    // product-and-bias call finds the bias there, and the bias gradient's cast back to f32
    // comes after the weight gradient's product.
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); fwd.values.len()];
    for (i, n) in fwd.nodes.iter().enumerate() {
        for &v in &n.inputs {
            readers[v.index()].push(i);
        }
    }
    // (parameters and inputs are in `map` already; other values pass through `map` as they are)
    let mut cast = |p: &mut Program,
                    map: &HashMap<ValueId, ValueId>,
                    v: ValueId|
     -> Result<Option<ValueId>, TrainError> {
        if !matches!(fwd.value(v).def, ValueDef::Param | ValueDef::Input) {
            return Ok(None);
        }
        let nv = map[&v];
        if p.ty(nv).dtype != DType::F32 {
            return Ok(None);
        }
        if let Some(&c) = cast_inputs.get(&nv) {
            return Ok(Some(c));
        }
        let name = names.fresh(&format!("{}:{}", fwd.value(v).name, compute.name()));
        let c = p
            .add_node(name.clone(), Op::Cast { to: compute }, vec![nv], vec![name])
            .map_err(terr)?[0];
        cast_inputs.insert(nv, c);
        Ok(Some(c))
    };
    for n in &fwd.nodes {
        let mut ins = Vec::new();
        for &v in &n.inputs {
            ins.push(cast(&mut p, &map, v)?.unwrap_or(map[&v]));
        }
        for &o in n.outputs.iter().filter(|_| matches!(n.op, Op::MatMul)) {
            for &r in &readers[o.index()] {
                for &v in &fwd.nodes[r].inputs {
                    cast(&mut p, &map, v)?;
                }
            }
        }
        let op = match &n.op {
            Op::Cast { to: DType::F32 } => Op::Cast { to: compute },
            Op::Fill {
                value,
                dtype: DType::F32,
                shape,
            } => Op::Fill {
                value: *value,
                dtype: compute,
                shape: shape.clone(),
            },
            op => op.clone(),
        };
        let outs = n
            .outputs
            .iter()
            .map(|&o| fwd.value(o).name.clone())
            .collect();
        let new = p
            .add_node(n.name.clone(), op, ins, outs)
            .map_err(|e| terr(format!("lowering to {}: {e}", compute.name())))?;
        if let Some(added) = p.nodes.last_mut() {
            added.role = n.role.clone();
        }
        for (&o, nv) in n.outputs.iter().zip(new) {
            map.insert(o, nv);
        }
    }
    p.outputs = fwd.outputs.iter().map(|o| map[o]).collect();
    Ok(p)
}

/// Builds the whole training step. `fwd` is the forward program at micro-batch shapes; the
/// step's inputs hold `micro_batches` times as many rows (axis 0).
pub fn training_step(fwd: &Program, cfg: &TrainConfig) -> Result<Program, TrainError> {
    let m = cfg.micro_batches.max(1);
    let specialized = fwd.specialized.clone();
    let muon_matrices = match &cfg.optimizer {
        Some(Optimizer::Muon { muon, .. }) => {
            if muon.placement == crate::train::muon::MuonPlacement::Canzona {
                return Err(terr(
                    "--muon-placement canzona gives each Muon matrix one owner among several \
                     optimizer ranks; a one-rank step has one: use --muon-placement replicated \
                     (the default) or a multi-rank plan",
                ));
            }
            Some(muon_parameters(fwd)?)
        }
        _ => None,
    };
    let fwd = lower_precision_cow(fwd, cfg.compute)?;
    let micro = gradient_program(&fwd, &cfg.loss)?;
    let mut p = Program::new(format!("{}.train", fwd.name));
    p.mesh = fwd.mesh.clone();
    if cfg.compute != DType::F32 {
        p.precision = Some(Precision {
            compute: cfg.compute,
            master: DType::F32,
            reduce: DType::F32,
        });
    }
    let globals = declare_step_inputs(&mut p, &micro, specialized, m)?;
    let n_params = micro.params.len();
    let mut loss_parts = Vec::new();
    let mut grad_parts: Vec<Vec<ValueId>> = vec![Vec::new(); n_params];
    for k in 0..m {
        let mut input_map = HashMap::new();
        for &(mi, gi) in &globals {
            let v = if m == 1 {
                gi
            } else {
                let rows = micro.ty(mi).shape[0] as i64;
                let name = format!("{}/micro{k}", micro.value(mi).name);
                p.add_node(
                    name.clone(),
                    Op::Slice {
                        axes: vec![0],
                        starts: vec![k as i64 * rows],
                        ends: vec![(k as i64 + 1) * rows],
                        steps: vec![1],
                    },
                    vec![gi],
                    vec![name],
                )
                .map_err(terr)?[0]
            };
            input_map.insert(mi, v);
        }
        let suffix = if m == 1 {
            String::new()
        } else {
            format!("/micro{k}")
        };
        let outs = inline(&mut p, &micro, &input_map, &suffix)?;
        loss_parts.push(outs[0]);
        for (j, &g) in outs[1..].iter().enumerate() {
            grad_parts[j].push(g);
        }
    }
    let params: Vec<ValueId> = p.params.iter().map(|x| x.value).collect();
    let mut e = Emitter::new(&mut p);
    e.enter("step", Role::of(RoleKind::Accumulate));
    let inv_m = 1.0 / m as f64;
    let mean_of = |e: &mut Emitter, parts: &[ValueId]| -> Result<ValueId, String> {
        let mut acc = parts[0];
        for &x in &parts[1..] {
            acc = e.op(Op::Binary(BinaryOp::Add), &[acc, x])?;
        }
        if parts.len() > 1 {
            let s = e.scalar(inv_m, e.ty(acc).dtype);
            acc = e.op(Op::Binary(BinaryOp::Mul), &[acc, s])?;
        }
        Ok(acc)
    };
    e.enter("step/accumulate", Role::of(RoleKind::Accumulate));
    let loss = mean_of(&mut e, &loss_parts).map_err(terr)?;
    let mut grads = Vec::new();
    for parts in &grad_parts {
        let g = mean_of(&mut e, parts).map_err(terr)?;
        grads.push(g);
    }
    // Gradients in fp32 from here on.
    for g in grads.iter_mut() {
        *g = to_f32(&mut e, *g).map_err(terr)?;
    }
    let mut outputs = vec![loss];
    if let Some(max_norm) = cfg.clip_grad_norm {
        e.enter("step/clip", Role::new(RoleKind::Optimizer, "clip"));
        let (norm, clipped) = clip(&mut e, &grads, max_norm, None).map_err(terr)?;
        grads = clipped;
        outputs.push(norm);
    }
    let mut updates = Vec::new();
    match &cfg.optimizer {
        Some(opt) => {
            e.enter("step/optimizer", Role::of(RoleKind::Optimizer));
            let holding = Holding::Whole;
            let muon = muon_matrices.as_ref().map(|m| (m, &holding));
            optimizer(&mut e, opt, &params, &grads, &mut updates, muon).map_err(terr)?;
        }
        None => {
            // A gradient program: name each gradient after its parameter.
            for (&w, &g) in params.iter().zip(&grads) {
                let want = format!("grad/{}", e.p.value(w).name);
                let is_node = matches!(e.p.value(g).def, ValueDef::Node { .. });
                if is_node && e.p.value(g).name != want && !outputs.contains(&g) {
                    let n = e.fresh(&want);
                    e.p.values[g.index()].name = n;
                }
            }
            outputs.extend(grads.iter().copied());
        }
    }
    drop(e);
    if p.find_value("loss").is_none() {
        p.values[loss.index()].name = "loss".into();
    }
    p.outputs = outputs;
    p.updates = updates;
    p.eliminate_dead_code();
    hzp_ir::verify(&p).map_err(|e| terr(format!("the training step failed verification: {e}")))?;
    Ok(p)
}

/// Declares in `p` the inputs of `m` micro-batches of `micro`'s inputs (concatenated on axis
/// 0, so axis 0 is scaled by `m`); returns (input of `micro`, input of `p`) pairs. A scalar
/// input cannot be split into several micro-batches.
pub(crate) fn declare_batch_inputs(
    p: &mut Program,
    micro: &Program,
    m: usize,
) -> Result<Vec<(ValueId, ValueId)>, TrainError> {
    let mut globals = Vec::new();
    for &i in &micro.inputs {
        let mut ty = micro.ty(i).clone();
        if m > 1 {
            if ty.rank() == 0 {
                return Err(terr(format!(
                    "input `{}` is a scalar; it cannot be split into {m} micro-batches",
                    micro.value(i).name
                )));
            }
            ty.shape[0] *= m;
        }
        globals.push((i, p.add_input(micro.value(i).name.clone(), ty)));
    }
    Ok(globals)
}

/// The training step's inputs (the micro-batch inputs with axis 0 scaled by `m`; the values
/// the model was specialized on, which the step checks too) and parameters (in the model's
/// order); returns (input of `micro`, input of the step) pairs.
fn declare_step_inputs(
    p: &mut Program,
    micro: &Program,
    specialized: BTreeMap<String, Tensor>,
    m: usize,
) -> Result<Vec<(ValueId, ValueId)>, TrainError> {
    let globals = declare_batch_inputs(p, micro, m)?;
    // Inputs the model was specialized on keep their values: the step checks them too.
    for (name, t) in specialized {
        let same = p
            .inputs
            .iter()
            .any(|&v| p.value(v).name == name && p.value(v).ty == t.ty());
        if !same {
            return Err(terr(format!(
                "the model was specialized on the value of input `{name}`, which the training \
                 step {} (micro-batches split it, or the precision policy changes its type); \
                 train with one micro-batch and fp32, or make the model not depend on its value",
                if m > 1 { "splits" } else { "changes" }
            )));
        }
        p.specialized.insert(name, t);
    }
    // Parameters first, in the model's order.
    for prm in &micro.params {
        p.add_param(
            micro.value(prm.value).name.clone(),
            micro.ty(prm.value).clone(),
            prm.data.clone(),
        );
    }
    Ok(globals)
}

/// The matrices Muon updates ([`crate::train::muon::muon_matrices`]); an error when there are none.
pub fn muon_parameters(fwd: &Program) -> Result<BTreeMap<String, MuonMatrix>, TrainError> {
    let m = crate::train::muon::muon_matrices(fwd);
    if m.is_empty() {
        return Err(terr(format!(
            "--optimizer muon: `{}` has no parameter Muon applies to (a 2-D parameter that is \
             not an embedding table read by a Gather and not the LM head); use adamw",
            fwd.name
        )));
    }
    Ok(m)
}

/// torch.nn.utils.clip_grad_norm_: total = ||all grads||_2; g *= min(1, max/(total+1e-6)).
///
/// When `grads` are shards, `shards_of` is the group whose ranks hold the other shards: the
/// partial sum of squares is all-reduced over it before the square root.
pub(crate) fn clip(
    e: &mut Emitter,
    grads: &[ValueId],
    max_norm: f64,
    shards_of: Option<&hzp_ir::Group>,
) -> Result<(ValueId, Vec<ValueId>), String> {
    let mut total: Option<ValueId> = None;
    for &g in grads {
        let sq = e.op(Op::Binary(BinaryOp::Mul), &[g, g])?;
        let s = e.op(
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: (0..e.ty(g).rank()).collect(),
                keep_dims: false,
            },
            &[sq],
        )?;
        total = Some(match total {
            Some(t) => e.op(Op::Binary(BinaryOp::Add), &[t, s])?,
            None => s,
        });
    }
    let mut total = match total {
        Some(t) => t,
        None => e.scalar(0.0, DType::F32),
    };
    if let Some(group) = shards_of {
        total = e.op(
            Op::AllReduce {
                group: group.clone(),
                reduce: ReduceOp::Sum,
            },
            &[total],
        )?;
    }
    let norm = e.op(Op::Unary(UnaryOp::Sqrt), &[total])?;
    let tiny = e.scalar(1e-6, DType::F32);
    let den = e.op(Op::Binary(BinaryOp::Add), &[norm, tiny])?;
    let mx = e.scalar(max_norm, DType::F32);
    let coef = e.op(Op::Binary(BinaryOp::Div), &[mx, den])?;
    let one = e.scalar(1.0, DType::F32);
    let coef = e.op(Op::Binary(BinaryOp::Min), &[coef, one])?;
    let mut out = Vec::new();
    for &g in grads {
        out.push(e.op(Op::Binary(BinaryOp::Mul), &[g, coef])?);
    }
    Ok((norm, out))
}

/// The name of the step program's learning-rate input: an f32 scalar the driver gives at
/// every step (the value of the schedule at that step; the optimizer's `lr` when there is no
/// schedule). A scalar input is never split: every rank and micro-batch reads the same value.
pub const LR_INPUT: &str = "optimizer.lr";

/// `batch` with the learning-rate input ([`LR_INPUT`]) set to `lr`, for a step program that
/// has one (a gradient program has none and is given `batch` unchanged).
pub fn with_lr(p: &Program, batch: &[(String, Tensor)], lr: f64) -> Vec<(String, Tensor)> {
    let mut out: Vec<(String, Tensor)> = batch
        .iter()
        .filter(|(k, _)| k != LR_INPUT)
        .cloned()
        .collect();
    let takes_lr = p.inputs.iter().any(|&i| p.value(i).name == LR_INPUT);
    if takes_lr {
        out.push((LR_INPUT.to_string(), Tensor::f32(vec![], vec![lr as f32])));
    }
    out
}

/// The role unit of a Canzona bucket's nodes (what `hzp inspect` looks for).
pub const CANZONA_UNIT: &str = "canzona";

/// The optimizer update of `params` by `grads` (pushed to `updates`). The learning rate is
/// the step program's input [`LR_INPUT`] (added here). Returns, per parameter, the states
/// the optimizer keeps for it (AdamW's moments, SGD's momentum buffer): shaped like the
/// parameter and cut the same way (see `ParamLayout::states`).
pub(crate) fn optimizer(
    e: &mut Emitter,
    opt: &Optimizer,
    params: &[ValueId],
    grads: &[ValueId],
    updates: &mut Vec<Update>,
    muon: Option<(&BTreeMap<String, MuonMatrix>, &Holding)>,
) -> Result<Vec<Vec<ValueId>>, String> {
    let f = DType::F32;
    if e.p.find_value(LR_INPUT).is_some() {
        return Err(format!(
            "the model already has a value named `{LR_INPUT}`, the name of the optimizer's learning-rate input"
        ));
    }
    let lrv = e.p.add_input(LR_INPUT, TensorType::scalar(f));
    let states = match opt {
        &Optimizer::AdamW {
            lr: _,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => {
            let pairs: Vec<(ValueId, ValueId)> =
                params.iter().copied().zip(grads.iter().copied()).collect();
            let fused = Op::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            };
            adamw(e, &fused, lrv, &pairs, updates)?
        }
        Optimizer::Muon {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            muon: settings,
        } => {
            let (matrices, holding) =
                muon.ok_or("internal: a Muon step built without its matrices")?;
            let fused = Op::AdamW {
                beta1: *beta1,
                beta2: *beta2,
                eps: *eps,
                weight_decay: *weight_decay,
            };
            muon_optimizer(
                e,
                (*lr, settings, &fused),
                lrv,
                (params, grads),
                (matrices, holding),
                updates,
            )?
        }
        &Optimizer::Sgd {
            lr: _,
            momentum,
            weight_decay,
        } => sgd(e, (momentum, weight_decay), lrv, (params, grads), updates)?,
    };
    Ok(states)
}

/// Muon on the matrices (`matrices`, held as `holding` says), the fused AdamW `fused` on
/// every other parameter; Muon's rate is the step's rate input times `settings.lr / lr`.
/// Returns each parameter's states.
#[allow(clippy::type_complexity)]
fn muon_optimizer(
    e: &mut Emitter,
    (lr, settings, fused): (f64, &MuonSettings, &Op),
    lrv: ValueId,
    (params, grads): (&[ValueId], &[ValueId]),
    (matrices, holding): (&BTreeMap<String, MuonMatrix>, &Holding),
    updates: &mut Vec<Update>,
) -> Result<Vec<Vec<ValueId>>, String> {
    let f = DType::F32;
    let b = |e: &mut Emitter, op: BinaryOp, x: ValueId, y: ValueId| e.op(Op::Binary(op), &[x, y]);
    let mut states = Vec::with_capacity(params.len());
    let is_matrix = |w: ValueId, e: &Emitter| matrices.get(&e.p.value(w).name);
    let pairs: Vec<(ValueId, ValueId)> = params
        .iter()
        .copied()
        .zip(grads.iter().copied())
        .filter(|&(w, _)| is_matrix(w, e).is_none())
        .collect();
    let mut adamw_states = adamw(e, fused, lrv, &pairs, updates)?.into_iter();
    // Muon's rate follows the step's rate input: muon.lr * rate / lr
    if lr <= 0.0 {
        return Err(format!(
            "--optimizer muon: Muon's learning rate follows --lr's schedule (muon-lr x \
             rate / lr), so --lr must be above 0, not {lr}"
        ));
    }
    e.enter("step/muon", Role::of(RoleKind::Optimizer));
    let ratio = e.scalar(settings.lr / lr, f);
    let mlr = b(e, BinaryOp::Mul, lrv, ratio)?;
    let run = crate::train::muon::MuonRun {
        settings,
        holding,
        lr: mlr,
    };
    let canzona = match holding {
        Holding::Canzona {
            group,
            size,
            member,
            partition,
        } => Some((group, *size, *member, partition)),
        _ => None,
    };
    // Canzona: each matrix's (master shard, Nesterov update shard) by name
    let mut pending: BTreeMap<String, (ValueId, ValueId)> = BTreeMap::new();
    for (&w, &g) in params.iter().zip(grads) {
        match is_matrix(w, e).cloned() {
            Some(m) => {
                let wname = e.p.value(w).name.clone();
                e.enter(format!("step/muon/{wname}"), Role::of(RoleKind::Optimizer));
                let g = to_f32(e, g)?;
                let buf = if canzona.is_some() {
                    let (buf, u) = crate::train::muon::momentum(e, &run, (w, g), updates)?;
                    pending.insert(wname, (w, u));
                    buf
                } else {
                    crate::train::muon::muon_step(e, &run, &m, (w, g), updates)?
                };
                states.push(vec![buf]);
            }
            None => states.push(
                adamw_states
                    .next()
                    .ok_or("internal: AdamW states of a parameter missing")?,
            ),
        }
    }
    if let Some((group, size, member, partition)) = canzona {
        for (k, bucket) in partition.buckets.iter().enumerate() {
            e.enter(
                format!("step/muon/canzona.{k}.{}x{}", bucket.rows, bucket.cols),
                Role::new(RoleKind::Optimizer, CANZONA_UNIT),
            );
            crate::train::muon::canzona_bucket(
                e,
                &run,
                (group, size, member),
                bucket,
                matrices,
                &pending,
                updates,
            )?;
        }
    }
    Ok(states)
}

/// SGD with `momentum` and `weight_decay` as `torch.optim.SGD`; returns each parameter's
/// states (its momentum buffer, when there is one).
fn sgd(
    e: &mut Emitter,
    (momentum, weight_decay): (f64, f64),
    lrv: ValueId,
    (params, grads): (&[ValueId], &[ValueId]),
    updates: &mut Vec<Update>,
) -> Result<Vec<Vec<ValueId>>, String> {
    let f = DType::F32;
    let b = |e: &mut Emitter, op: BinaryOp, x: ValueId, y: ValueId| e.op(Op::Binary(op), &[x, y]);
    let mut states = Vec::with_capacity(params.len());
    let mom = e.scalar(momentum, f);
    let wdv = e.scalar(weight_decay, f);
    for (&w, &g) in params.iter().zip(grads) {
        let wname = e.p.value(w).name.clone();
        e.enter(format!("step/sgd/{wname}"), Role::of(RoleKind::Optimizer));
        let mut d = g;
        let mut kept = Vec::new();
        if weight_decay != 0.0 {
            let t = b(e, BinaryOp::Mul, w, wdv)?;
            d = b(e, BinaryOp::Add, d, t)?;
        }
        if momentum != 0.0 {
            // buf = momentum * buf + d (the first step's buf is d: buf starts at 0)
            let ty = e.ty(w).clone();
            let bn = e.fresh(&format!("sgd.momentum/{wname}"));
            let buf = e.p.add_state(bn, ty, None);
            let t = b(e, BinaryOp::Mul, buf, mom)?;
            let nb = b(e, BinaryOp::Add, t, d)?;
            updates.push(Update {
                target: buf,
                value: nb,
            });
            d = nb;
            kept.push(buf);
        }
        let s = b(e, BinaryOp::Mul, d, lrv)?;
        let w2 = b(e, BinaryOp::Sub, w, s)?;
        updates.push(Update {
            target: w,
            value: w2,
        });
        states.push(kept);
    }
    Ok(states)
}

/// The fused AdamW update of each (parameter, gradient) pair, with one step counter for all;
/// returns each parameter's moments.
fn adamw(
    e: &mut Emitter,
    fused: &Op,
    lrv: ValueId,
    pairs: &[(ValueId, ValueId)],
    updates: &mut Vec<Update>,
) -> Result<Vec<Vec<ValueId>>, String> {
    let f = DType::F32;
    let b = |e: &mut Emitter, op: BinaryOp, x: ValueId, y: ValueId| e.op(Op::Binary(op), &[x, y]);
    let &Op::AdamW { beta1, beta2, .. } = fused else {
        return Err("internal: adamw() needs an AdamW op".into());
    };
    let mut states = Vec::with_capacity(pairs.len());
    if pairs.is_empty() {
        return Ok(states);
    }
    let step_name = e.fresh("adamw.step");
    let step = e.p.add_state(step_name, TensorType::scalar(f), None);
    let one = e.scalar(1.0, f);
    let t = b(e, BinaryOp::Add, step, one)?;
    updates.push(Update {
        target: step,
        value: t,
    });
    // bias corrections: 1 - beta^t
    let b1 = e.scalar(beta1, f);
    let b2 = e.scalar(beta2, f);
    let p1 = b(e, BinaryOp::Pow, b1, t)?;
    let p2 = b(e, BinaryOp::Pow, b2, t)?;
    let bc1 = b(e, BinaryOp::Sub, one, p1)?;
    let bc2 = b(e, BinaryOp::Sub, one, p2)?;
    let step_size = b(e, BinaryOp::Div, lrv, bc1)?;
    let bc2s = e.op(Op::Unary(UnaryOp::Sqrt), &[bc2])?;
    for &(w, g) in pairs {
        let wname = e.p.value(w).name.clone();
        let ty = e.ty(w).clone();
        let mn = e.fresh(&format!("adamw.m/{wname}"));
        let vn = e.fresh(&format!("adamw.v/{wname}"));
        let m = e.p.add_state(mn, ty.clone(), None);
        let v = e.p.add_state(vn, ty, None);
        e.enter(format!("step/adamw/{wname}"), Role::of(RoleKind::Optimizer));
        let g = to_f32(e, g)?;
        // one fused pass (see Op::AdamW for the formula); the memory plan writes
        // each result over the state it replaces
        let outs = e.ops_named(
            fused.clone(),
            &[w, g, m, v, step_size, bc2s, lrv],
            &["param", "m", "v"],
        )?;
        for (target, value) in [w, m, v].into_iter().zip(outs) {
            updates.push(Update { target, value });
        }
        states.push(vec![m, v]);
    }
    Ok(states)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hzp_ir::{Tensor, TensorType};

    /// logits = h @ w, with `extra_reader` another node reading the logits.
    fn head(extra_reader: bool) -> Program {
        let mut p = Program::new("head");
        let ids = p.add_input("input_ids", TensorType::new(DType::I64, vec![2, 4]));
        let vals = |n: usize, k: f32| (0..n).map(|i| ((i * 7 % 11) as f32 - 5.0) * k).collect();
        let h = p.add_param(
            "h",
            TensorType::new(DType::F32, vec![2, 4, 3]),
            Some(Tensor::f32(vec![2, 4, 3], vals(24, 0.1))),
        );
        let w = p.add_param(
            "w",
            TensorType::new(DType::F32, vec![3, 5]),
            Some(Tensor::f32(vec![3, 5], vals(15, 0.2))),
        );
        let y = p
            .add_node("lm_head", Op::MatMul, vec![h, w], vec!["logits".into()])
            .unwrap()[0];
        p.outputs = vec![y];
        if extra_reader {
            let z = p
                .add_node(
                    "other",
                    Op::Unary(hzp_ir::UnaryOp::Neg),
                    vec![y],
                    vec!["z".into()],
                )
                .unwrap()[0];
            p.outputs.push(z);
        }
        let _ = ids;
        p
    }

    #[test]
    fn lm_loss_drops_the_last_position_before_the_head() {
        let lm = LossKind::Lm { labels: None };
        let pushed = attach_loss(&head(false), &lm).unwrap();
        let kept = attach_loss(&head(true), &lm).unwrap();
        let slices_of = |p: &Program, last_dim: usize| {
            p.nodes
                .iter()
                .filter(|n| matches!(n.op, Op::Slice { .. }))
                .filter(|n| p.ty(n.inputs[0]).shape.last() == Some(&last_dim))
                .count()
        };
        // the hidden states (last dim 3) are sliced, not the logits (last dim 5)
        assert_eq!((slices_of(&pushed, 3), slices_of(&pushed, 5)), (1, 0));
        assert_eq!((slices_of(&kept, 3), slices_of(&kept, 5)), (0, 1));
        let ids = Tensor::i64(vec![2, 4], vec![1, 4, 0, 2, 3, 3, 1, 0]);
        let loss = |p: &Program| {
            let out =
                hzp_runtime::eval::evaluate(p, &[("input_ids".to_string(), ids.clone())]).unwrap();
            out[0].1.to_f64_vec()[0]
        };
        let (a, b) = (loss(&pushed), loss(&kept));
        assert!(
            a.is_finite() && (a - b).abs() <= 1e-6 * b.abs(),
            "{a} vs {b}"
        );
    }

    #[test]
    fn lowering_to_f32_borrows_and_lowering_to_bf16_matches_the_owned_pass() {
        let p = head(true);
        let f32 = lower_precision_cow(&p, DType::F32).unwrap();
        assert!(matches!(f32, std::borrow::Cow::Borrowed(q) if std::ptr::eq(q, &p)));
        assert_eq!(lower_precision(&p, DType::F32).unwrap(), p);
        let bf16 = lower_precision_cow(&p, DType::BF16).unwrap();
        assert!(matches!(bf16, std::borrow::Cow::Owned(_)));
        let owned = lower_precision(&p, DType::BF16).unwrap();
        assert_ne!(owned, p);
        assert_eq!(*bf16, owned);
    }
}
