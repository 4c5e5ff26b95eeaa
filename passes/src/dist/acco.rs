//! ACCO, "Accumulate While You Communicate" (Nabli et al., arXiv 2406.02613): the gradient
//! reduction and the sharded optimizer step of one half-batch run while the other half is
//! computed, with the paper's two-stage correction so that every committed update uses
//! gradients taken at (an estimate of) the parameters it updates.
//!
//! The layout is ZeRO-1's: every rank holds the whole parameters in compute precision, the
//! fp32 master weights and AdamW's moments are cut into 1/W shards over the world. Each step
//! program splits the rank's batch into two halves (phases) of `micro_batches / 2`
//! micro-batches and runs, per rank:
//!
//! ```text
//! phase 1  compute: G~  = grad at est (the estimated parameters) on half 1
//!          comm:    g   = reduce-scatter(G_prev)            (G_prev: phase 2 of the last step)
//!                   master, m, v = AdamW(master, (g~_prev + g) / 2)      (the committed step)
//!                   w   = all-gather(master)
//! phase 2  compute: G   = grad at w on half 2               (kept for the next step)
//!          comm:    g~  = reduce-scatter(G~)                (kept for the next step)
//!                   est = all-gather(AdamW(master, g~).param) (moments not kept: an estimate)
//! ```
//!
//! Each phase's communication and optimizer work reads only what the previous phase left, so
//! it overlaps that phase's compute; the step's order issues the reduce-scatter at the
//! phase's start, the optimizer after the phase's last forward, and the all-gather right
//! after it, so the all-gather overlaps the last backward. Both gradients of a committed
//! update are taken at (an estimate of) the parameters being updated, which is the paper's
//! correction of the one-step delay: `g` at w_t itself, `g~` at est = AdamW(w_t, half-batch
//! gradient), an estimate of w_t made one phase earlier.
//!
//! The first step has no gradients to commit: a scalar state `acco.primed` (0, then 1)
//! makes it keep the parameters, moments and step count, and its phase 1 reads the
//! parameters themselves instead of the (not yet made) estimate. So N step programs make
//! N - 1 optimizer updates; update k equals a synchronous AdamW step on the full batch of
//! step k - 1 when both halves' gradients agree (the estimate is exact).
//!
//! States per parameter `w` (besides the master shard `w`, `shard/w` and AdamW's moments):
//! `acco.est/w` (the estimate, whole, compute dtype), `acco.grad/w` (this rank's phase-2
//! gradient, whole and unreduced, gradient dtype) and `acco.gest/w` (the reduced phase-1
//! gradient on this rank's 1/W shard, fp32, cut like the master and listed with the
//! optimizer states so checkpoints reshard it).

use crate::dist::spmd::{ShardGroups, ShardedStep};
use crate::dist::streams::{assign_streams, insert_events_with};
use crate::emit::Emitter;
use crate::train::{self, Optimizer, TrainConfig, TrainError, LR_INPUT};
use hzp_ir::{
    BinaryOp, DType, Group, Mesh, NodeId, Op, ParamLayout, Precision, Program, ReduceOp, Role,
    RoleKind, TensorType, UnaryOp, Update, ValueId,
};
use std::collections::HashMap;

fn err(s: impl Into<String>) -> TrainError {
    TrainError(s.into())
}

/// Name prefixes of the states ACCO adds per parameter.
pub const EST_PREFIX: &str = "acco.est/";
pub const GRAD_PREFIX: &str = "acco.grad/";
pub const GEST_PREFIX: &str = "acco.gest/";
/// The scalar state that is 0 in the first step and 1 after.
pub const PRIMED: &str = "acco.primed";

/// The shard groups of an ACCO plan: ZeRO-1's (parameters and gradients whole, optimizer
/// states over the world).
pub fn groups(mesh: &Mesh) -> ShardGroups {
    let world = Group::new(mesh.axes.iter().map(|a| a.name.clone()));
    let none = Group::new(Vec::<String>::new());
    ShardGroups {
        params: none.clone(),
        grads: none,
        optim: world,
    }
}

/// What the ACCO step supports; everything else is refused with the reason.
fn check(cfg: &TrainConfig) -> Result<(f64, f64, f64, f64), TrainError> {
    let (beta1, beta2, eps, wd) = match &cfg.optimizer {
        Some(Optimizer::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
            ..
        }) => (*beta1, *beta2, *eps, *weight_decay),
        Some(Optimizer::Muon { .. }) => {
            return Err(err(
                "--strategy acco is built for AdamW; Muon keeps whole matrices on owner ranks \
                 (use --muon-placement canzona with another strategy)",
            ))
        }
        Some(Optimizer::Sgd { .. }) => {
            return Err(err("--strategy acco is built for AdamW, not SGD"))
        }
        None => return Err(err("a sharded training step needs an optimizer")),
    };
    if cfg.clip_grad_norm.is_some() {
        return Err(err(
            "--clip-grad-norm is not built for --strategy acco (the committed gradient is \
             the mean of two half-batch gradients reduced at different times)",
        ));
    }
    if cfg.micro_batches < 2 || !cfg.micro_batches.is_multiple_of(2) {
        return Err(err(format!(
            "an ACCO step splits the batch into two halves; it needs an even number of \
             micro-batches, not {}",
            cfg.micro_batches
        )));
    }
    Ok((beta1, beta2, eps, wd))
}

/// Per-parameter declarations of the step.
struct Param {
    numel: usize,
    padded: usize,
    shape: Vec<usize>,
    master: ValueId,
    shard: ValueId,
    est: ValueId,
    grad: ValueId,
    gest: ValueId,
    m: ValueId,
    v: ValueId,
}

/// The ACCO per-rank step for `mesh` (see the module docs). `grad_dtype` is the dtype
/// gradients are accumulated and reduced in.
pub fn acco_step(
    fwd: &Program,
    cfg: &TrainConfig,
    mesh: &Mesh,
    grad_dtype: DType,
) -> Result<ShardedStep, TrainError> {
    let (beta1, beta2, eps, weight_decay) = check(cfg)?;
    if !grad_dtype.is_float() {
        return Err(err(format!(
            "gradients must be reduced in a float dtype, not {grad_dtype}"
        )));
    }
    let spec = groups(mesh);
    let world = spec.optim.clone();
    let w = mesh.world_size();
    let m = cfg.micro_batches;
    let half = m / 2;
    let compute = cfg.compute;
    let fwd_lp = train::lower_precision_cow(fwd, compute)?;
    // gradients of loss / (W * half): their sum over ranks and a phase's micro-batches is the
    // mean over that half-batch
    let micro = train::gradient_program_scaled(&fwd_lp, &cfg.loss, 1.0 / (w * half) as f64)?;
    let loss_node = micro
        .nodes
        .iter()
        .position(|n| n.outputs.contains(&micro.outputs[0]))
        .ok_or_else(|| err("internal: the loss is not computed by a node"))?;

    let mut q = Program::new(format!("{}.rank", fwd.name));
    q.mesh = Some(mesh.clone());
    if compute != DType::F32 || grad_dtype != DType::F32 {
        q.precision = Some(Precision {
            compute,
            master: DType::F32,
            reduce: grad_dtype,
        });
    }
    let globals = train::declare_batch_inputs(&mut q, &micro, m)?;
    if q.find_value(LR_INPUT).is_some() {
        return Err(err(format!(
            "the model already has a value named `{LR_INPUT}`, the name of the optimizer's \
             learning-rate input"
        )));
    }
    let lr = q.add_input(LR_INPUT, TensorType::scalar(DType::F32));
    let (params, layouts) = declare_params(&mut q, &micro, &spec, w, compute, grad_dtype);
    let f = DType::F32;
    let mut consts: HashMap<ValueId, ValueId> = HashMap::new();
    for c in &micro.consts {
        let name = hzp_ir::NameSet::from_program(&q).fresh(&micro.value(c.value).name);
        consts.insert(c.value, q.add_const(name, c.data.clone()));
    }
    let step = q.add_state("adamw.step", TensorType::scalar(f), None);
    let primed = q.add_state(PRIMED, TensorType::scalar(f), None);

    let mut e = Emitter::new(&mut q);
    let b = Builder {
        micro: &micro,
        params: &params,
        globals: &globals,
        consts: &consts,
        world: &world,
        w,
        m,
        grad_dtype,
        compute,
        loss_node,
        adamw: Op::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        },
        lr,
    };
    let built = b.emit(&mut e, step, primed).map_err(err)?;
    drop(e);
    q.outputs = vec![built.loss];
    q.values[built.loss.index()].name = "loss".into();
    q.updates = built.updates;
    q.eliminate_dead_code();
    assign_streams(&mut q);
    hzp_ir::verify(&q).map_err(|e| err(format!("the ACCO step failed verification: {e}")))?;
    // issued in the order emitted: that order is the overlap (see the module docs)
    let order: Vec<NodeId> = (0..q.nodes.len()).map(|i| NodeId(i as u32)).collect();
    let q = insert_events_with(&q, &order, &[]);
    hzp_ir::verify(&q).map_err(|e| {
        err(format!(
            "the ACCO step failed verification after scheduling: {e}"
        ))
    })?;
    Ok(ShardedStep {
        program: q,
        layouts,
        groups: spec,
        rewrite_report: None,
        row_exchanged: Vec::new(),
        experts: None,
    })
}

/// Declares each parameter's per-rank values (the f32 master shard, the compute-dtype
/// shard and estimate, the gradient buffer, the gradient estimate's shard and the AdamW
/// moments) in `q`, with its layout.
fn declare_params(
    q: &mut Program,
    micro: &Program,
    spec: &ShardGroups,
    w: usize,
    compute: DType,
    grad_dtype: DType,
) -> (Vec<Param>, Vec<ParamLayout>) {
    let world = &spec.optim;
    let f = DType::F32;
    let mut params = Vec::with_capacity(micro.params.len());
    let mut layouts = Vec::with_capacity(micro.params.len());
    for prm in &micro.params {
        let name = micro.value(prm.value).name.clone();
        let ty = micro.ty(prm.value).clone();
        let numel = ty.numel();
        let padded = numel.div_ceil(w).max(1) * w;
        let s = padded / w;
        let master = q.add_param(name.clone(), TensorType::new(f, vec![s]), None);
        let shard_name = format!("shard/{name}");
        let shard = q.add_state(
            shard_name.clone(),
            TensorType::new(compute, vec![padded]),
            None,
        );
        let est = q.add_state(
            format!("{EST_PREFIX}{name}"),
            TensorType::new(compute, vec![padded]),
            None,
        );
        let grad = q.add_state(
            format!("{GRAD_PREFIX}{name}"),
            TensorType::new(grad_dtype, vec![padded]),
            None,
        );
        let gest_name = format!("{GEST_PREFIX}{name}");
        let gest = q.add_state(gest_name.clone(), TensorType::new(f, vec![s]), None);
        let (mn, vn) = (format!("adamw.m/{name}"), format!("adamw.v/{name}"));
        let mv = q.add_state(mn.clone(), TensorType::new(f, vec![s]), None);
        let vv = q.add_state(vn.clone(), TensorType::new(f, vec![s]), None);
        layouts.push(ParamLayout {
            name: name.clone(),
            shape: ty.shape.clone(),
            numel,
            padded,
            optim_group: world.clone(),
            params_group: spec.params.clone(),
            compute_shard: shard_name,
            compute_dtype: compute,
            accumulate_group: None,
            states: vec![mn, vn, gest_name],
            expert_group: None,
        });
        params.push(Param {
            numel,
            padded,
            shape: ty.shape.clone(),
            master,
            shard,
            est,
            grad,
            gest,
            m: mv,
            v: vv,
        });
    }
    (params, layouts)
}

struct Builder<'a> {
    micro: &'a Program,
    params: &'a [Param],
    globals: &'a [(ValueId, ValueId)],
    consts: &'a HashMap<ValueId, ValueId>,
    world: &'a Group,
    w: usize,
    m: usize,
    grad_dtype: DType,
    compute: DType,
    loss_node: usize,
    adamw: Op,
    lr: ValueId,
}

/// An issued collective over every parameter: one bucket, or (on one rank) the values.
enum Pending {
    Bucket(ValueId),
    Each(Vec<ValueId>),
}

struct Built {
    loss: ValueId,
    updates: Vec<Update>,
}

/// One AdamW application's results per parameter, and the step count it used.
struct Stepped {
    param: Vec<ValueId>,
    m: Vec<ValueId>,
    v: Vec<ValueId>,
}

impl Builder<'_> {
    fn emit(&self, e: &mut Emitter, step: ValueId, primed: ValueId) -> Result<Built, String> {
        let f = DType::F32;
        let n = self.params.len();
        let half = self.m / 2;
        e.enter("acco", Role::new(RoleKind::Optimizer, "acco.primed"));
        let zero = e.scalar(0.0, f);
        let one = e.scalar(1.0, f);
        let is_primed = e.op(Op::Binary(BinaryOp::Greater), &[primed, zero])?;

        // Phase 1. The reduction of the last step's phase-2 gradients goes out first.
        e.enter("acco.commit", Role::new(RoleKind::Reduce, "acco.commit"));
        let prev: Vec<ValueId> = self.params.iter().map(|p| p.grad).collect();
        let mut g_pending = Some(self.reduce_scatter(e, &prev)?);
        // Phase 1 reads the estimate; the first step, which has none, reads the parameters.
        e.enter("acco.phase1", Role::new(RoleKind::Gather, "acco.phase1"));
        let mut p1 = Vec::with_capacity(n);
        for p in self.params {
            let v = e.op(Op::Where, &[is_primed, p.est, p.shard])?;
            p1.push(crate::dist::unpad(e, v, p.numel, p.padded, &p.shape)?);
        }
        let mut losses = Vec::with_capacity(self.m);
        let mut commit: Option<(Stepped, ValueId, Pending)> = None;
        let mut est_grads: Vec<Option<ValueId>> = vec![None; n];
        for mb in 0..half {
            let last = mb + 1 == half;
            let (loss, grads) = self.micro_batch(e, mb, &p1, |e| {
                if !last {
                    return Ok(());
                }
                // The committed step, after the phase's last forward (the reduce-scatter has
                // had the forwards to finish in); its all-gather overlaps the last backward.
                let pending = g_pending.take().ok_or("internal: unpacked twice")?;
                commit = Some(self.commit(e, pending, step, primed, is_primed)?);
                Ok(())
            })?;
            losses.push(loss);
            self.accumulate(e, &mut est_grads, grads)?;
        }
        let (committed, step2, w_pending) =
            commit.ok_or("internal: the committed step was not emitted")?;

        // Phase 2. The phase-1 gradients go out first.
        e.enter(
            "acco.estimate",
            Role::new(RoleKind::Reduce, "acco.estimate"),
        );
        let est_grads: Vec<ValueId> = est_grads
            .into_iter()
            .map(|g| g.ok_or("internal: a phase-1 gradient is missing"))
            .collect::<Result<_, _>>()?;
        let mut gt_pending = Some(self.reduce_scatter(e, &est_grads)?);
        let mut gt: Vec<ValueId> = Vec::new();
        e.enter("acco.phase2", Role::new(RoleKind::Gather, "acco.phase2"));
        let w_full = self.ag_unpack(e, w_pending)?;
        let mut p2 = Vec::with_capacity(n);
        for (p, &v) in self.params.iter().zip(&w_full) {
            p2.push(crate::dist::unpad(e, v, p.numel, p.padded, &p.shape)?);
        }
        let mut est_full: Option<Pending> = None;
        let mut grads2: Vec<Option<ValueId>> = vec![None; n];
        for mb in half..self.m {
            let last = mb + 1 == self.m;
            let (loss, grads) = self.micro_batch(e, mb, &p2, |e| {
                if !last {
                    return Ok(());
                }
                // The estimate of the next parameters: AdamW on the phase-1 gradient from the
                // committed state; its moments are dropped.
                e.enter(
                    "acco.estimate",
                    Role::new(RoleKind::Reduce, "acco.estimate"),
                );
                gt = self.rs_unpack(e, gt_pending.take().ok_or("internal: unpacked twice")?)?;
                e.enter(
                    "acco.estimate",
                    Role::new(RoleKind::Optimizer, "acco.estimate"),
                );
                let t = e.op(Op::Binary(BinaryOp::Add), &[step2, one])?;
                let est =
                    self.adamw_all(e, &committed.param, &gt, &committed.m, &committed.v, t)?;
                e.enter(
                    "acco.estimate",
                    Role::new(RoleKind::Regather, "acco.estimate"),
                );
                est_full = Some(self.all_gather(e, &est.param)?);
                Ok(())
            })?;
            losses.push(loss);
            self.accumulate(e, &mut grads2, grads)?;
        }
        let est_pending = est_full.ok_or("internal: the estimate was not emitted")?;

        // The loss: the mean over both halves and the ranks; then the estimate lands.
        e.enter("loss", Role::of(RoleKind::Loss));
        let loss = self.mean_loss(e, &losses)?;
        e.enter(
            "acco.estimate",
            Role::new(RoleKind::Regather, "acco.estimate"),
        );
        let est_full = self.ag_unpack(e, est_pending)?;
        e.enter("acco", Role::new(RoleKind::Optimizer, "acco.primed"));
        let primed2 = e.op(Op::Binary(BinaryOp::Max), &[primed, one])?;
        let mut updates = vec![
            Update {
                target: step,
                value: step2,
            },
            Update {
                target: primed,
                value: primed2,
            },
        ];
        for (j, p) in self.params.iter().enumerate() {
            let g2 = grads2[j].ok_or("internal: a phase-2 gradient is missing")?;
            for (target, value) in [
                (p.master, committed.param[j]),
                (p.m, committed.m[j]),
                (p.v, committed.v[j]),
                (p.shard, w_full[j]),
                (p.est, est_full[j]),
                (p.grad, g2),
                (p.gest, gt[j]),
            ] {
                updates.push(Update { target, value });
            }
        }
        Ok(Built { loss, updates })
    }

    /// The committed step: AdamW on the mean of the kept and the just reduced half-batch
    /// gradients (the first step keeps everything), then the all-gather of the new
    /// parameters. Returns the new master shards and moments, the step count, the gather.
    fn commit(
        &self,
        e: &mut Emitter,
        pending: Pending,
        step: ValueId,
        primed: ValueId,
        is_primed: ValueId,
    ) -> Result<(Stepped, ValueId, Pending), String> {
        let f = DType::F32;
        e.enter("acco.commit", Role::new(RoleKind::Reduce, "acco.commit"));
        let g = self.rs_unpack(e, pending)?;
        e.enter("acco.commit", Role::new(RoleKind::Optimizer, "acco.commit"));
        let mut mean = Vec::with_capacity(g.len());
        let half = e.scalar(0.5, f);
        for (j, p) in self.params.iter().enumerate() {
            let s = e.op(Op::Binary(BinaryOp::Add), &[p.gest, g[j]])?;
            mean.push(e.op(Op::Binary(BinaryOp::Mul), &[s, half])?);
        }
        let masters: Vec<ValueId> = self.params.iter().map(|p| p.master).collect();
        let ms: Vec<ValueId> = self.params.iter().map(|p| p.m).collect();
        let vs: Vec<ValueId> = self.params.iter().map(|p| p.v).collect();
        let one = e.scalar(1.0, f);
        let t = e.op(Op::Binary(BinaryOp::Add), &[step, one])?;
        let new = self.adamw_all(e, &masters, &mean, &ms, &vs, t)?;
        // the first step keeps everything
        let keep = |e: &mut Emitter, new: &[ValueId], old: &[ValueId]| {
            new.iter()
                .zip(old)
                .map(|(&a, &b)| e.op(Op::Where, &[is_primed, a, b]))
                .collect::<Result<Vec<_>, String>>()
        };
        let kept = Stepped {
            param: keep(e, &new.param, &masters)?,
            m: keep(e, &new.m, &ms)?,
            v: keep(e, &new.v, &vs)?,
        };
        let step2 = e.op(Op::Binary(BinaryOp::Add), &[step, primed])?;
        e.enter("acco.commit", Role::new(RoleKind::Regather, "acco.commit"));
        let full = self.all_gather(e, &kept.param)?;
        Ok((kept, step2, full))
    }

    /// Copies the micro program for micro-batch `mb` reading parameters `params`; `mid` runs
    /// after its forward (the loss). Returns the loss and each parameter's flat padded
    /// gradient in the gradient dtype.
    fn micro_batch(
        &self,
        e: &mut Emitter,
        mb: usize,
        params: &[ValueId],
        mut mid: impl FnMut(&mut Emitter) -> Result<(), String>,
    ) -> Result<(ValueId, Vec<ValueId>), String> {
        let micro = self.micro;
        let mut vmap: HashMap<ValueId, ValueId> = self.consts.clone();
        for (k, prm) in micro.params.iter().enumerate() {
            vmap.insert(prm.value, params[k]);
        }
        let rows_of = |mi: ValueId| micro.ty(mi).shape.first().copied().unwrap_or(1) as i64;
        e.enter(
            format!("acco.mb{mb}"),
            Role::new(RoleKind::Compute, format!("mb{mb}")),
        );
        for &(mi, gi) in self.globals {
            let rows = rows_of(mi);
            let v = e.op(
                Op::Slice {
                    axes: vec![0],
                    starts: vec![mb as i64 * rows],
                    ends: vec![(mb as i64 + 1) * rows],
                    steps: vec![1],
                },
                &[gi],
            )?;
            vmap.insert(mi, v);
        }
        let tag = format!("/mb{mb}");
        for (i, node) in micro.nodes.iter().enumerate() {
            if i == self.loss_node + 1 {
                mid(e)?;
            }
            let ins: Vec<ValueId> = node
                .inputs
                .iter()
                .map(|v| {
                    vmap.get(v).copied().ok_or_else(|| {
                        format!("internal: `{}` is not mapped", micro.value(*v).name)
                    })
                })
                .collect::<Result<_, _>>()?;
            // the model's kind (compute or loss), with this micro-batch's unit
            let phase = if i <= self.loss_node { "fwd" } else { "bwd" };
            let role = Role::new(node.role.kind, format!("mb{mb}.{phase}"));
            let got = crate::dist::copy_node(e, micro, node, ins, &tag, role)?;
            for (&o, g) in node.outputs.iter().zip(got) {
                vmap.insert(o, g);
            }
        }
        if self.loss_node + 1 >= micro.nodes.len() {
            mid(e)?;
        }
        let get = |v: &ValueId| {
            vmap.get(v)
                .copied()
                .ok_or_else(|| format!("internal: output `{}` is not mapped", micro.value(*v).name))
        };
        let loss = get(&micro.outputs[0])?;
        e.enter(
            format!("acco.mb{mb}/grad"),
            Role::new(RoleKind::Accumulate, format!("mb{mb}")),
        );
        let mut grads = Vec::with_capacity(self.params.len());
        for (j, gv) in micro.outputs[1..].iter().enumerate() {
            let p = &self.params[j];
            let v = get(gv)?;
            grads.push(crate::dist::flat_padded(
                e,
                v,
                p.numel,
                p.padded,
                self.grad_dtype,
            )?);
        }
        Ok((loss, grads))
    }

    fn accumulate(
        &self,
        e: &mut Emitter,
        acc: &mut [Option<ValueId>],
        grads: Vec<ValueId>,
    ) -> Result<(), String> {
        for (a, g) in acc.iter_mut().zip(grads) {
            *a = Some(match *a {
                Some(x) => e.op(Op::Binary(BinaryOp::Add), &[x, g])?,
                None => g,
            });
        }
        Ok(())
    }

    /// Issues one reduce-scatter of every parameter's flat padded gradient over the world,
    /// as one bucket (`[W, s_j]` pieces side by side). Nothing reads the result until
    /// [`Self::rs_unpack`], so the compute stream does not wait for it before then.
    fn reduce_scatter(&self, e: &mut Emitter, full: &[ValueId]) -> Result<Pending, String> {
        let w = self.w;
        if w == 1 {
            return Ok(Pending::Each(full.to_vec()));
        }
        let sizes: Vec<usize> = self.params.iter().map(|p| p.padded / w).collect();
        let mut pieces = Vec::with_capacity(full.len());
        for (&g, &s) in full.iter().zip(&sizes) {
            pieces.push(e.op(Op::Reshape { shape: vec![w, s] }, &[g])?);
        }
        let total: usize = sizes.iter().sum();
        let bucket = if pieces.len() == 1 {
            pieces[0]
        } else {
            e.op(Op::Concat { axis: 1 }, &pieces)?
        };
        let flat = e.op(
            Op::Reshape {
                shape: vec![w * total],
            },
            &[bucket],
        )?;
        Ok(Pending::Bucket(e.op(
            Op::ReduceScatter {
                group: self.world.clone(),
                axis: 0,
                reduce: ReduceOp::Sum,
            },
            &[flat],
        )?))
    }

    /// Each parameter's fp32 1/W gradient shard from an issued reduce-scatter.
    fn rs_unpack(&self, e: &mut Emitter, pending: Pending) -> Result<Vec<ValueId>, String> {
        let shards = match pending {
            Pending::Each(v) => v,
            Pending::Bucket(b) if self.params.len() == 1 => vec![b],
            Pending::Bucket(b) => e.ops(
                Op::Split {
                    axis: 0,
                    sizes: self.params.iter().map(|p| p.padded / self.w).collect(),
                },
                &[b],
            )?,
        };
        shards
            .into_iter()
            .map(|v| {
                if e.ty(v).dtype == DType::F32 {
                    Ok(v)
                } else {
                    e.op(Op::Cast { to: DType::F32 }, &[v])
                }
            })
            .collect()
    }

    /// Casts every fp32 master shard to the compute dtype and issues one all-gather of them
    /// over the world as one bucket; [`Self::ag_unpack`] reads it.
    fn all_gather(&self, e: &mut Emitter, shards: &[ValueId]) -> Result<Pending, String> {
        let mut cast = Vec::with_capacity(shards.len());
        for &s in shards {
            cast.push(if self.compute == DType::F32 {
                s
            } else {
                e.op(Op::Cast { to: self.compute }, &[s])?
            });
        }
        if self.w == 1 {
            // a copy: the compute tensor is its own state, updated separately
            let copies = cast
                .into_iter()
                .map(|v| e.op(Op::Copy, &[v]))
                .collect::<Result<_, _>>()?;
            return Ok(Pending::Each(copies));
        }
        let bucket = if cast.len() == 1 {
            cast[0]
        } else {
            e.op(Op::Concat { axis: 0 }, &cast)?
        };
        Ok(Pending::Bucket(e.op(
            Op::AllGather {
                group: self.world.clone(),
                axis: 0,
            },
            &[bucket],
        )?))
    }

    /// Each parameter's whole padded tensor from an issued all-gather.
    fn ag_unpack(&self, e: &mut Emitter, pending: Pending) -> Result<Vec<ValueId>, String> {
        let w = self.w;
        let all = match pending {
            Pending::Each(v) => return Ok(v),
            Pending::Bucket(b) => b,
        };
        let sizes: Vec<usize> = self.params.iter().map(|p| p.padded / w).collect();
        let total: usize = sizes.iter().sum();
        let rows = e.op(
            Op::Reshape {
                shape: vec![w, total],
            },
            &[all],
        )?;
        let parts = if sizes.len() == 1 {
            vec![rows]
        } else {
            e.ops(Op::Split { axis: 1, sizes }, &[rows])?
        };
        parts
            .into_iter()
            .zip(self.params)
            .map(|(v, p)| {
                e.op(
                    Op::Reshape {
                        shape: vec![p.padded],
                    },
                    &[v],
                )
            })
            .collect()
    }

    /// AdamW (the fused op, torch's formula) on every parameter at step count `t` (a scalar
    /// value): returns the new parameters and moments.
    fn adamw_all(
        &self,
        e: &mut Emitter,
        params: &[ValueId],
        grads: &[ValueId],
        ms: &[ValueId],
        vs: &[ValueId],
        t: ValueId,
    ) -> Result<Stepped, String> {
        let f = DType::F32;
        let Op::AdamW { beta1, beta2, .. } = self.adamw else {
            return Err("internal: not an AdamW op".into());
        };
        let bin =
            |e: &mut Emitter, op: BinaryOp, x: ValueId, y: ValueId| e.op(Op::Binary(op), &[x, y]);
        let one = e.scalar(1.0, f);
        let b1 = e.scalar(beta1, f);
        let b2 = e.scalar(beta2, f);
        let p1 = bin(e, BinaryOp::Pow, b1, t)?;
        let p2 = bin(e, BinaryOp::Pow, b2, t)?;
        let bc1 = bin(e, BinaryOp::Sub, one, p1)?;
        let bc2 = bin(e, BinaryOp::Sub, one, p2)?;
        let step_size = bin(e, BinaryOp::Div, self.lr, bc1)?;
        let bc2s = e.op(Op::Unary(UnaryOp::Sqrt), &[bc2])?;
        let mut out = Stepped {
            param: Vec::with_capacity(params.len()),
            m: Vec::with_capacity(params.len()),
            v: Vec::with_capacity(params.len()),
        };
        for j in 0..params.len() {
            let outs = e.ops_named(
                self.adamw.clone(),
                &[params[j], grads[j], ms[j], vs[j], step_size, bc2s, self.lr],
                &["param", "m", "v"],
            )?;
            out.param.push(outs[0]);
            out.m.push(outs[1]);
            out.v.push(outs[2]);
        }
        Ok(out)
    }

    fn mean_loss(&self, e: &mut Emitter, losses: &[ValueId]) -> Result<ValueId, String> {
        let f = DType::F32;
        let mut total: Option<ValueId> = None;
        for &l in losses {
            let l = if e.ty(l).dtype != f {
                e.op(Op::Cast { to: f }, &[l])?
            } else {
                l
            };
            total = Some(match total {
                Some(t) => e.op(Op::Binary(BinaryOp::Add), &[t, l])?,
                None => l,
            });
        }
        let mut v = total.ok_or("internal: no micro-batch loss")?;
        let s = e.scalar(1.0 / (losses.len() * self.w) as f64, f);
        if self.w > 1 {
            v = e.op(
                Op::AllReduce {
                    group: self.world.clone(),
                    reduce: ReduceOp::Sum,
                },
                &[v],
            )?;
        }
        e.op(Op::Binary(BinaryOp::Mul), &[v, s])
    }
}
