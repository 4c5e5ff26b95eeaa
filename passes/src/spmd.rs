//! Collective insertion: turns a single-rank training step into the per-rank (SPMD) step of
//! a hierarchical ZeRO plan, given the shard groups P (parameters), G (gradients) and O
//! (optimizer states) of a mesh.
//!
//! Per rank and parameter `w` (n elements, padded to `n_pad`, a multiple of o):
//! - the trainable parameter is the rank's fp32 master shard `w`: `[n_pad / o]`;
//! - a state `shard/w` holds the rank's compute-dtype shard `[n_pad / p]`;
//! - forward and backward read `Reshape(Slice(AllGather_P(shard/w)))`;
//! - the full gradient is padded, reduce-scattered over G, then over O\G, all-reduced over
//!   the rest of the world (W\O), and scaled by 1/W (the loss is the mean over ranks);
//! - the optimizer updates the master shard and its states on the 1/o shard;
//! - `shard/w` is rebuilt by casting the new master and all-gathering it over O\P.
//!
//! Shards nest: a group lists its axes P first, then G\P, then O\G, so a rank's O-shard is
//! a slice of its G-shard, which is a slice of its P-shard. Global-norm clipping sums the
//! squares of each rank's O-shards and all-reduces that partial sum over O.
//!
//! Collectives go on the all-gather and reduce-scatter streams; every use across streams is
//! ordered by a RecordEvent / WaitEvent pair (see [`insert_events`]).

use crate::emit::Emitter;
use crate::train::{self, TrainConfig, TrainError};
pub use hzp_ir::ParamLayout;
use hzp_ir::{
    BinaryOp, DType, Group, Mesh, Op, Program, ReduceOp, StreamKind, TensorType, Update, ValueDef,
    ValueId,
};
use std::collections::{HashMap, HashSet};

/// The three shard groups, as sets of mesh axes.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardSpec {
    pub params: Group,
    pub grads: Group,
    pub optim: Group,
}

/// A per-rank training step and the layout of its parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardedStep {
    pub program: Program,
    pub layouts: Vec<ParamLayout>,
    pub groups: ShardSpec,
}

fn err(s: impl Into<String>) -> TrainError {
    TrainError(s.into())
}

/// Orders the axes of P, G and O so that shards nest (see the module docs); checks that the
/// axes exist and that P ⊆ G ⊆ O.
pub fn canonical_groups(mesh: &Mesh, spec: &ShardSpec) -> Result<ShardSpec, TrainError> {
    let in_mesh_order = |g: &Group, what: &str| -> Result<Vec<String>, TrainError> {
        for a in &g.axes {
            if mesh.axis(a).is_none() {
                return Err(err(format!(
                    "the {what} group names axis `{a}`, which is not in the mesh {mesh}"
                )));
            }
        }
        Ok(mesh
            .axes
            .iter()
            .filter(|a| g.axes.contains(&a.name))
            .map(|a| a.name.clone())
            .collect())
    };
    let p = in_mesh_order(&spec.params, "parameter")?;
    let g = in_mesh_order(&spec.grads, "gradient")?;
    let o = in_mesh_order(&spec.optim, "optimizer-state")?;
    if !p.iter().all(|a| g.contains(a)) || !g.iter().all(|a| o.contains(a)) {
        return Err(err(format!(
            "shard groups must nest, params ⊆ grads ⊆ optim; got params {}, grads {}, optim {}",
            spec.params, spec.grads, spec.optim
        )));
    }
    let mut gg = p.clone();
    gg.extend(g.iter().filter(|a| !p.contains(a)).cloned());
    let mut oo = gg.clone();
    oo.extend(o.iter().filter(|a| !gg.contains(a)).cloned());
    Ok(ShardSpec {
        params: Group { axes: p },
        grads: Group { axes: gg },
        optim: Group { axes: oo },
    })
}

fn minus(a: &Group, b: &Group) -> Group {
    Group {
        axes: a
            .axes
            .iter()
            .filter(|x| !b.axes.contains(x))
            .cloned()
            .collect(),
    }
}

fn size(mesh: &Mesh, g: &Group) -> usize {
    mesh.group_size(g).unwrap_or(1)
}

/// Builds the per-rank step. `fwd` is the forward program at the per-rank micro-batch
/// shapes; `cfg` as for [`train::training_step`] (its optimizer is required).
pub fn shard_training_step(
    fwd: &Program,
    cfg: &TrainConfig,
    mesh: &Mesh,
    spec: &ShardSpec,
) -> Result<ShardedStep, TrainError> {
    let opt = cfg
        .optimizer
        .clone()
        .ok_or_else(|| err("a sharded training step needs an optimizer"))?;
    let spec = canonical_groups(mesh, spec)?;
    let world = Group {
        axes: mesh.axes.iter().map(|a| a.name.clone()).collect(),
    };
    let (p, g, o, w) = (
        size(mesh, &spec.params),
        size(mesh, &spec.grads),
        size(mesh, &spec.optim),
        mesh.world_size(),
    );
    let o_minus_g = minus(&spec.optim, &spec.grads);
    let o_minus_p = minus(&spec.optim, &spec.params);
    let replicas = minus(&world, &spec.optim);

    // The single-rank step without clipping or optimizer: outputs [loss, grads...].
    let single_cfg = TrainConfig {
        optimizer: None,
        clip_grad_norm: None,
        ..cfg.clone()
    };
    let t = train::training_step(fwd, &single_cfg)?;
    let compute = cfg.compute;

    let mut q = Program::new(format!("{}.rank", fwd.name));
    q.mesh = Some(mesh.clone());
    q.precision = t.precision;
    let mut map: HashMap<ValueId, ValueId> = HashMap::new();
    for &i in &t.inputs {
        map.insert(i, q.add_input(t.value(i).name.clone(), t.ty(i).clone()));
    }
    let mut layouts = Vec::new();
    let mut masters = Vec::new();
    let mut shards = Vec::new();
    for prm in &t.params {
        let name = t.value(prm.value).name.clone();
        let ty = t.ty(prm.value).clone();
        let n = ty.numel();
        let padded = n.div_ceil(o).max(1) * o;
        let master = q.add_param(
            name.clone(),
            TensorType::new(DType::F32, vec![padded / o]),
            None,
        );
        let shard_name = format!("shard/{name}");
        let shard = q.add_state(
            shard_name.clone(),
            TensorType::new(compute, vec![padded / p]),
            None,
        );
        masters.push(master);
        shards.push(shard);
        layouts.push(ParamLayout {
            name,
            shape: ty.shape.clone(),
            numel: n,
            padded,
            optim_group: spec.optim.clone(),
            params_group: spec.params.clone(),
            compute_shard: shard_name,
            compute_dtype: compute,
        });
    }
    let mut e = Emitter::new(&mut q);
    // Gather each parameter for its uses.
    for (k, prm) in t.params.iter().enumerate() {
        let l = &layouts[k];
        e.scope = format!("gather/{}", l.name);
        let run = |e: &mut Emitter| -> Result<ValueId, String> {
            let mut v = shards[k];
            if p > 1 {
                v = e.op(
                    Op::AllGather {
                        group: spec.params.clone(),
                        axis: 0,
                    },
                    &[v],
                )?;
            }
            if l.padded > l.numel {
                v = e.op(
                    Op::Slice {
                        axes: vec![0],
                        starts: vec![0],
                        ends: vec![l.numel as i64],
                        steps: vec![1],
                    },
                    &[v],
                )?;
            }
            e.op(
                Op::Reshape {
                    shape: l.shape.clone(),
                },
                &[v],
            )
        };
        let full = run(&mut e).map_err(err)?;
        map.insert(prm.value, full);
    }
    drop(e);
    let outs = train::inline(&mut q, &t, &map, "")?;
    let loss_local = outs[0];
    let grads_full = &outs[1..];

    let mut e = Emitter::new(&mut q);
    // Reduce each gradient to the rank's O-shard.
    let mut grads = Vec::new();
    for (k, &gf) in grads_full.iter().enumerate() {
        let l = layouts[k].clone();
        e.scope = format!("reduce/{}", l.name);
        let run = |e: &mut Emitter| -> Result<ValueId, String> {
            let mut v = gf;
            if e.ty(v).dtype != DType::F32 {
                v = e.op(Op::Cast { to: DType::F32 }, &[v])?;
            }
            v = e.op(
                Op::Reshape {
                    shape: vec![l.numel],
                },
                &[v],
            )?;
            if l.padded > l.numel {
                let z = e.zeros(&TensorType::new(DType::F32, vec![l.padded - l.numel]))?;
                v = e.op(Op::Concat { axis: 0 }, &[v, z])?;
            }
            if g > 1 {
                v = e.op(
                    Op::ReduceScatter {
                        group: spec.grads.clone(),
                        axis: 0,
                        reduce: ReduceOp::Sum,
                    },
                    &[v],
                )?;
            }
            if o > g {
                v = e.op(
                    Op::ReduceScatter {
                        group: o_minus_g.clone(),
                        axis: 0,
                        reduce: ReduceOp::Sum,
                    },
                    &[v],
                )?;
            }
            if w > o {
                v = e.op(
                    Op::AllReduce {
                        group: replicas.clone(),
                        reduce: ReduceOp::Sum,
                    },
                    &[v],
                )?;
            }
            if w > 1 {
                let s = e.scalar(1.0 / w as f64, DType::F32);
                v = e.op(Op::Binary(BinaryOp::Mul), &[v, s])?;
            }
            Ok(v)
        };
        grads.push(run(&mut e).map_err(err)?);
    }
    let mut outputs = Vec::new();
    // The global loss: the mean of the ranks' losses.
    e.scope = "loss".into();
    let loss = (|| -> Result<ValueId, String> {
        let mut v = loss_local;
        if w > 1 {
            v = e.op(
                Op::AllReduce {
                    group: world.clone(),
                    reduce: ReduceOp::Sum,
                },
                &[v],
            )?;
            let s = e.scalar(1.0 / w as f64, DType::F32);
            v = e.op(Op::Binary(BinaryOp::Mul), &[v, s])?;
        }
        Ok(v)
    })()
    .map_err(err)?;
    outputs.push(loss);
    if let Some(max_norm) = cfg.clip_grad_norm {
        e.scope = "clip".into();
        let shards_of = (o > 1).then_some(&spec.optim);
        let (norm, clipped) = train::clip(&mut e, &grads, max_norm, shards_of).map_err(err)?;
        grads = clipped;
        outputs.push(norm);
    }
    let mut updates: Vec<Update> = Vec::new();
    e.scope = "optimizer".into();
    train::optimizer(&mut e, &opt, &masters, &grads, &mut updates).map_err(err)?;
    // Rebuild each compute shard from the new master shard.
    for (k, &master) in masters.iter().enumerate() {
        let new_master = updates
            .iter()
            .find(|u| u.target == master)
            .map(|u| u.value)
            .ok_or_else(|| err("the optimizer did not update a parameter"))?;
        e.scope = format!("regather/{}", layouts[k].name);
        let run = |e: &mut Emitter| -> Result<ValueId, String> {
            let mut v = new_master;
            if compute != DType::F32 {
                v = e.op(Op::Cast { to: compute }, &[v])?;
            }
            if o > p {
                v = e.op(
                    Op::AllGather {
                        group: o_minus_p.clone(),
                        axis: 0,
                    },
                    &[v],
                )?;
            }
            if v == new_master {
                // fp32 with P = O: the shard is a copy of the master
                v = e.op(Op::Copy, &[v])?;
            }
            Ok(v)
        };
        let v = run(&mut e).map_err(err)?;
        updates.push(Update {
            target: shards[k],
            value: v,
        });
    }
    drop(e);
    q.outputs = outputs;
    q.updates = updates;
    if let Some(v) = q.outputs.first().copied() {
        if q.find_value("loss").is_none() {
            q.values[v.index()].name = "loss".into();
        }
    }
    q.eliminate_dead_code();
    assign_streams(&mut q);
    let q = insert_events(&q);
    hzp_ir::verify(&q).map_err(|e| err(format!("the sharded step failed verification: {e}")))?;
    Ok(ShardedStep {
        program: q,
        layouts,
        groups: spec,
    })
}

/// Puts all-gathers on the all-gather stream and the other collectives on the
/// reduce-scatter stream; everything else computes.
pub fn assign_streams(p: &mut Program) {
    for n in p.nodes.iter_mut() {
        n.stream = match n.op {
            Op::AllGather { .. } => StreamKind::AllGather,
            Op::ReduceScatter { .. } | Op::AllReduce { .. } | Op::AllToAll { .. } => {
                StreamKind::ReduceScatter
            }
            _ => StreamKind::Compute,
        };
    }
}

/// Orders every use across streams: after the producer, a RecordEvent on its stream; before
/// the first reader on each other stream, a WaitEvent. Values that exist before the step
/// (inputs, parameters, states, constants) need none.
pub fn insert_events(p: &Program) -> Program {
    let mut out = Program::new(p.name.clone());
    out.mesh = p.mesh.clone();
    out.precision = p.precision;
    // Values are copied in order; nodes are re-added with events interleaved.
    let mut map: HashMap<ValueId, ValueId> = HashMap::new();
    for (i, v) in p.values.iter().enumerate() {
        let id = ValueId(i as u32);
        match v.def {
            ValueDef::Input => {
                map.insert(id, out.add_input(v.name.clone(), v.ty.clone()));
            }
            ValueDef::Param => {
                let data = p.param(id).and_then(|x| x.data.clone());
                map.insert(id, out.add_param(v.name.clone(), v.ty.clone(), data));
            }
            ValueDef::Const => {
                let data = p.const_data(id).cloned().expect("const has data");
                map.insert(id, out.add_const(v.name.clone(), data));
            }
            ValueDef::State => {
                let init = p
                    .states
                    .iter()
                    .find(|s| s.value == id)
                    .and_then(|s| s.init.clone());
                map.insert(id, out.add_state(v.name.clone(), v.ty.clone(), init));
            }
            ValueDef::Node { .. } => {}
        }
    }
    // For each value, the streams of the nodes that read it.
    let mut reader_streams: Vec<HashSet<StreamKind>> = vec![HashSet::new(); p.values.len()];
    for n in &p.nodes {
        for &v in &n.inputs {
            reader_streams[v.index()].insert(n.stream);
        }
    }
    let mut event_of: HashMap<usize, u32> = HashMap::new(); // producer node -> event
    let mut waited: HashMap<StreamKind, HashSet<u32>> = HashMap::new();
    let mut next_event = 0u32;
    let mut names = hzp_ir::NameSet::from_program(p);
    for (ni, n) in p.nodes.iter().enumerate() {
        // The producers on other streams that this node needs.
        for &v in &n.inputs {
            let Some(src) = p.producer(v) else { continue };
            let src_stream = p.nodes[src.index()].stream;
            if src_stream == n.stream {
                continue;
            }
            let ev = *event_of
                .get(&src.index())
                .expect("recorded after its producer");
            if waited.entry(n.stream).or_default().insert(ev) {
                let name = names.fresh(&format!("wait{ev}"));
                out.add_node(name, Op::WaitEvent { event: ev }, vec![], vec![])
                    .expect("events have no inputs");
                out.nodes.last_mut().expect("just added").stream = n.stream;
            }
        }
        let ins = n.inputs.iter().map(|v| map[v]).collect();
        let outs = n.outputs.iter().map(|&o| p.value(o).name.clone()).collect();
        let new = out
            .add_node(n.name.clone(), n.op.clone(), ins, outs)
            .expect("the program verified before");
        out.nodes.last_mut().expect("just added").stream = n.stream;
        for (&o, nv) in n.outputs.iter().zip(new) {
            map.insert(o, nv);
        }
        // Record after this node if a reader on another stream needs it.
        let needed_elsewhere = n
            .outputs
            .iter()
            .any(|&o| reader_streams[o.index()].iter().any(|&s| s != n.stream));
        if needed_elsewhere {
            let ev = next_event;
            next_event += 1;
            event_of.insert(ni, ev);
            let name = names.fresh(&format!("record{ev}"));
            out.add_node(name, Op::RecordEvent { event: ev }, vec![], vec![])
                .expect("events have no inputs");
            out.nodes.last_mut().expect("just added").stream = n.stream;
        }
    }
    out.outputs = p.outputs.iter().map(|v| map[v]).collect();
    out.updates = p
        .updates
        .iter()
        .map(|u| Update {
            target: map[&u.target],
            value: map[&u.value],
        })
        .collect();
    out
}
