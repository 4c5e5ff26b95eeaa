//! Properties of compiled plans on random small programs: random MLP-like forward programs
//! (1-4 layers, random widths, with or without bias, relu/gelu/tanh), random meshes of 1-8
//! ranks over 1-3 axes, random nested shard groups P ⊆ G ⊆ O and random schedules. For each:
//! - the per-rank step, its memory plan and the plan verify (`verify_plan_with`, one
//!   communicator per stream, no budget);
//! - the bytes its collectives move per rank and step equal the formulas of the AsyncHZP
//!   step (DESIGN.md), derived from the parameter layouts (padded sizes), the group sizes and
//!   the schedule: per collective kind and group, the count and the bytes.
//!
//! Bytes a rank moves in one collective over a group of s ranks, for a buffer of B bytes
//! (the gathered output, the scattered input, the reduced value): all-gather and
//! reduce-scatter (s-1)/s × B, all-reduce 2(s-1)/s × B (ring). Totals are kept multiplied by
//! the world size W, which every group size divides, so they are exact integers.

use hzp_ir::plan::Plan;
use hzp_ir::{DType, Group, Mesh, Op, Program};
use hzp_passes::cost::cluster::ClusterSpec;
use hzp_passes::dist::rewrite::RewriteOptions;
use hzp_passes::dist::spmd::ReduceGrads;
use hzp_passes::dist::spmd::{
    shard_training_step_rewritten, Rewrite, ScheduleOptions, ShardGroups,
};
use hzp_passes::plan::memory::{default_kind, default_persistent, plan_memory};
use hzp_passes::plan::verify::{verify_plan_with, VerifyOptions};
use hzp_passes::report::layer_of_params;
use hzp_passes::train::{self, LossKind, Optimizer, TrainConfig};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, HashSet};

#[derive(Clone, Debug)]
struct Layer {
    width: usize,
    bias: bool,
    /// Relu, Gelu or Tanh after the layer (never after the last one).
    act: Option<&'static str>,
}

#[derive(Clone, Debug)]
struct Case {
    batch: usize,
    input_width: usize,
    layers: Vec<Layer>,
    /// (name, size) of each mesh axis, outermost first.
    axes: Vec<(String, usize)>,
    /// Axes of P, G and O: the first `np`, `ng` and `no` axes of a random order (np <= ng <=
    /// no), so the groups nest.
    order: Vec<usize>,
    np: usize,
    ng: usize,
    no: usize,
    sched: ScheduleOptions,
    micro_batches: usize,
    compute: DType,
    mse: bool,
    clip: bool,
    sgd: bool,
}

fn layer() -> impl Strategy<Value = Layer> {
    (
        1usize..10,
        any::<bool>(),
        prop_oneof![Just("Relu"), Just("Gelu"), Just("Tanh")],
    )
        .prop_map(|(width, bias, act)| Layer {
            width,
            bias,
            act: Some(act),
        })
}

/// 1-3 axes whose sizes (1-4, mostly 2 or more) multiply to at most 8.
fn axes() -> impl Strategy<Value = Vec<(String, usize)>> {
    prop::collection::vec(prop::sample::select(vec![1usize, 2, 2, 3, 4]), 1..4)
        .prop_filter("at most 8 ranks", |s| s.iter().product::<usize>() <= 8)
        .prop_map(|sizes| {
            // axis names the cluster spec knows (a split axis `gpu.N` has the link of `gpu`)
            let names = ["node", "gpu.0", "gpu.1"];
            let skip = names.len() - sizes.len();
            sizes
                .into_iter()
                .enumerate()
                .map(|(i, s)| (names[skip + i].to_string(), s))
                .collect()
        })
}

fn case() -> impl Strategy<Value = Case> {
    let model = (1usize..5, 1usize..10, prop::collection::vec(layer(), 1..5));
    let groups = axes().prop_flat_map(|axes| {
        let n = axes.len();
        (
            Just(axes),
            Just((0..n).collect::<Vec<usize>>()).prop_shuffle(),
            // three sorted counts, reflected half the time so that wide groups are as
            // likely as narrow ones
            (prop::collection::vec(0..=n, 3), any::<bool>()).prop_map(move |(mut v, wide)| {
                v.sort();
                if wide {
                    v = vec![n - v[2], n - v[1], n - v[0]];
                }
                v
            }),
        )
    });
    let sched = (
        any::<bool>(),
        any::<bool>(),
        0usize..4,
        prop::option::of(0u64..2048),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(per_step, reshard, depth, inflight, recompute, bf16_grads)| ScheduleOptions {
                reduce_grads: if per_step {
                    ReduceGrads::PerStep
                } else {
                    ReduceGrads::PerMicrobatch
                },
                reshard_after_forward: reshard,
                prefetch_depth: depth,
                max_inflight_bytes: inflight,
                recompute,
                grad_dtype: if bf16_grads { DType::BF16 } else { DType::F32 },
                narrow_grads: None,
                // (the MLPs here look nothing up)
                sparse_grads: true,
                // (no routed layers here)
                expert_parallel: None,
            },
        );
    let training = (
        1usize..4,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    );
    (model, groups, sched, training).prop_map(
        |((batch, input_width, mut layers), (axes, order, npgo), sched, training)| {
            if let Some(last) = layers.last_mut() {
                last.act = None;
            }
            let (micro_batches, bf16, mse, clip, sgd) = training;
            Case {
                batch,
                input_width,
                layers,
                axes,
                order,
                np: npgo[0],
                ng: npgo[1],
                no: npgo[2],
                sched,
                micro_batches,
                compute: if bf16 { DType::BF16 } else { DType::F32 },
                mse,
                clip,
                sgd,
            }
        },
    )
}

/// The forward program of one micro-batch of one rank, as text IR.
fn forward_text(c: &Case) -> String {
    let mut s = String::from("program \"mlp\"\n\n");
    s += &format!("input %x : f32[{},{}]\n", c.batch, c.input_width);
    let mut width = c.input_width;
    for (i, l) in c.layers.iter().enumerate() {
        s += &format!("param %fc{i}.weight : f32[{width},{}]\n", l.width);
        if l.bias {
            s += &format!("param %fc{i}.bias : f32[{}]\n", l.width);
        }
        width = l.width;
    }
    let mut x = "x".to_string();
    for (i, l) in c.layers.iter().enumerate() {
        s += &format!("%h{i} = MatMul(%{x}, %fc{i}.weight) \"fc{i}/MatMul\"\n");
        x = format!("h{i}");
        if l.bias {
            s += &format!("%hb{i} = Add(%{x}, %fc{i}.bias) \"fc{i}/Add\"\n");
            x = format!("hb{i}");
        }
        if let Some(act) = l.act {
            s += &format!("%a{i} = {act}(%{x}) \"fc{i}/{act}\"\n");
            x = format!("a{i}");
        }
    }
    s += &format!("\noutput %{x}\n");
    s
}

fn mesh_of(c: &Case) -> Mesh {
    let text: Vec<String> = c.axes.iter().map(|(n, s)| format!("{n}={s}")).collect();
    Mesh::parse(&text.join(",")).unwrap()
}

fn spec_of(c: &Case) -> ShardGroups {
    let take = |k: usize| Group {
        axes: c.order[..k].iter().map(|&i| c.axes[i].0.clone()).collect(),
    };
    ShardGroups {
        params: take(c.np),
        grads: take(c.ng),
        optim: take(c.no),
    }
}

fn config(c: &Case) -> TrainConfig {
    TrainConfig {
        loss: if c.mse {
            LossKind::Mse { target: "y".into() }
        } else {
            LossKind::Mean
        },
        optimizer: Some(if c.sgd {
            Optimizer::Sgd {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.0,
            }
        } else {
            Optimizer::adamw_default()
        }),
        clip_grad_norm: c.clip.then_some(1.0),
        micro_batches: c.micro_batches,
        compute: c.compute,
    }
}

/// A group as a key: its axes, sorted (the plan orders them P first, then G\P, ...).
fn key(op: &str, g: &Group) -> (String, BTreeSet<String>) {
    (op.to_string(), g.axes.iter().cloned().collect())
}

/// Count and bytes × W per (collective, group) of the plan's program.
fn measured(p: &Program, mesh: &Mesh) -> BTreeMap<(String, BTreeSet<String>), (usize, u128)> {
    let w = mesh.world_size() as u128;
    let mut out: BTreeMap<_, (usize, u128)> = BTreeMap::new();
    for n in &p.nodes {
        let (group, buffer, factor) = match &n.op {
            Op::AllGather { group, .. } => (group, n.outputs[0], 1),
            Op::ReduceScatter { group, .. } => (group, n.inputs[0], 1),
            Op::AllReduce { group, .. } => (group, n.inputs[0], 2),
            op if op.is_collective() => panic!("unexpected collective {} in the plan", op.name()),
            _ => continue,
        };
        let s = mesh.group_size(group).unwrap() as u128;
        let b = p.ty(buffer).size_bytes() as u128;
        let e = out.entry(key(n.op.name(), group)).or_default();
        e.0 += 1;
        e.1 += factor * (s - 1) * b * w / s;
    }
    out
}

/// The parameters each micro-batch gathers again for its backward (with reshard after
/// forward): those a backward node of the single-rank gradient program reads, and, with
/// recompute, those read by the forward nodes that recompute what the backward reads (a
/// forward value is kept, not recomputed, when it is an input or an output, or when a
/// forward node of another layer reads it). Not those of the layer the forward reads last
/// (through its parameters or values computed from them and constants alone): that layer
/// stays gathered into the backward.
fn regathered(fwd: &Program, cfg: &TrainConfig, recompute: bool) -> HashSet<String> {
    let mut out = regathered_all(fwd, cfg, recompute);
    let lowered = train::lower_precision(fwd, cfg.compute).unwrap();
    let with_loss = train::attach_loss(&lowered, &cfg.loss).unwrap();
    let layers = layer_of_params(&with_loss);
    let layer_of: BTreeMap<&str, usize> = with_loss
        .params
        .iter()
        .zip(&layers.of_param)
        .map(|(q, &l)| (with_loss.value(q.value).name.as_str(), l))
        .collect();
    let mut derived: BTreeMap<hzp_ir::ValueId, usize> = with_loss
        .params
        .iter()
        .map(|q| (q.value, layer_of[with_loss.value(q.value).name.as_str()]))
        .collect();
    let mut last = None;
    for n in &with_loss.nodes {
        let Some(&l) = n.inputs.iter().find_map(|v| derived.get(v)) else {
            continue;
        };
        last = Some(l);
        if n.inputs.iter().all(|v| {
            derived.contains_key(v) || matches!(with_loss.value(*v).def, hzp_ir::ValueDef::Const)
        }) {
            for &o in &n.outputs {
                derived.insert(o, l);
            }
        }
    }
    out.retain(|name| last.is_none() || layer_of.get(name.as_str()).copied() != last);
    out
}

fn regathered_all(fwd: &Program, cfg: &TrainConfig, recompute: bool) -> HashSet<String> {
    let lowered = train::lower_precision(fwd, cfg.compute).unwrap();
    let with_loss = train::attach_loss(&lowered, &cfg.loss).unwrap();
    let grad = train::gradient_program(&lowered, &cfg.loss).unwrap();
    let layers = layer_of_params(&with_loss);
    let fwd_layer: BTreeMap<&str, Option<usize>> = with_loss
        .nodes
        .iter()
        .zip(&layers.of_node)
        .map(|(n, l)| (n.name.as_str(), *l))
        .collect();
    let params: HashSet<_> = grad.params.iter().map(|q| q.value).collect();
    let is_fwd = |n: usize| fwd_layer.contains_key(grad.nodes[n].name.as_str());
    let users = grad.users();
    let mut out = HashSet::new();
    let mut wanted = Vec::new();
    for (i, n) in grad.nodes.iter().enumerate() {
        if is_fwd(i) {
            continue;
        }
        for &v in &n.inputs {
            if params.contains(&v) {
                out.insert(grad.value(v).name.clone());
            } else {
                wanted.push(v);
            }
        }
    }
    let layer = |n: usize| fwd_layer[grad.nodes[n].name.as_str()];
    if !recompute {
        // A value the forward computes from parameters and constants alone (a parameter
        // cast to the compute dtype), read by the backward and by no forward node of another
        // layer, is computed again in the backward: its parameters are gathered again.
        let mut derived: HashSet<hzp_ir::ValueId> = params.clone();
        for (i, n) in grad.nodes.iter().enumerate() {
            let from_weights = n.inputs.iter().all(|v| {
                derived.contains(v) || matches!(grad.value(*v).def, hzp_ir::ValueDef::Const)
            }) && n.inputs.iter().any(|v| derived.contains(v));
            let local = n.outputs.iter().all(|o| {
                !grad.outputs.contains(o)
                    && users[o.index()]
                        .iter()
                        .all(|u| !is_fwd(u.index()) || layer(u.index()) == layer(i))
            });
            if is_fwd(i) && from_weights && layer(i).is_some() && local {
                derived.extend(n.outputs.iter().copied());
            }
        }
        while let Some(v) = wanted.pop() {
            if params.contains(&v) || !derived.contains(&v) {
                continue;
            }
            let pn = grad.producer(v).unwrap().index();
            for &x in &grad.nodes[pn].inputs {
                if params.contains(&x) {
                    out.insert(grad.value(x).name.clone());
                } else {
                    wanted.push(x);
                }
            }
        }
        return out;
    }
    let recomputable = |v: hzp_ir::ValueId| -> bool {
        let Some(pn) = grad.producer(v) else {
            return false;
        };
        let pn = pn.index();
        if !is_fwd(pn) || grad.outputs.contains(&v) || layer(pn).is_none() {
            return false;
        }
        !users[v.index()]
            .iter()
            .any(|u| is_fwd(u.index()) && layer(u.index()) != layer(pn))
    };
    let mut seen = HashSet::new();
    while let Some(v) = wanted.pop() {
        if !recomputable(v) || !seen.insert(v) {
            continue;
        }
        let pn = grad.producer(v).unwrap().index();
        for &x in &grad.nodes[pn].inputs {
            if params.contains(&x) {
                out.insert(grad.value(x).name.clone());
            } else {
                wanted.push(x);
            }
        }
    }
    out
}

/// What the formulas say: count and bytes × W per (collective, group).
fn expected(
    c: &Case,
    fwd: &Program,
    cfg: &TrainConfig,
    mesh: &Mesh,
    step: &hzp_passes::dist::spmd::ShardedStep,
) -> BTreeMap<(String, BTreeSet<String>), (usize, u128)> {
    let w = mesh.world_size() as u128;
    let size = |g: &Group| mesh.group_size(g).unwrap() as u128;
    let minus = |a: &Group, b: &Group| Group {
        axes: a
            .axes
            .iter()
            .filter(|x| !b.axes.contains(x))
            .cloned()
            .collect(),
    };
    let world = Group {
        axes: c.axes.iter().map(|a| a.0.clone()).collect(),
    };
    let g = &step.groups;
    let (p, gs, o) = (size(&g.params), size(&g.grads), size(&g.optim));
    let m = c.micro_batches as u128;
    let cd = c.compute.size_bytes() as u128;
    let gd = c.sched.grad_dtype.size_bytes() as u128;
    let again = regathered(fwd, cfg, c.sched.recompute);
    let mut out: BTreeMap<_, (usize, u128)> = BTreeMap::new();
    let mut add = |op: &str, group: &Group, count: u128, bytes_times_w: u128| {
        if size(group) > 1 && count > 0 {
            let e = out.entry(key(op, group)).or_default();
            e.0 += count as usize;
            e.1 += bytes_times_w;
        }
    };
    // (s-1)/s × B, times W
    let part = |s: u128, b: u128| (s - 1) * b * w / s;
    let grad_reductions = if c.sched.reduce_grads == ReduceGrads::PerMicrobatch {
        m
    } else {
        1
    };
    for l in &step.layouts {
        let padded = l.padded as u128;
        assert_eq!(l.padded % o as usize, 0, "{} is not padded to o", l.name);
        assert!(l.padded >= l.numel && l.padded - l.numel < o as usize);
        // parameter all-gathers over P: per micro-batch, one for the forward, and one more for
        // the backward if it reads the parameter (or recomputes a reader) after resharding
        let per_mb = 1 + u128::from(c.sched.reshard_after_forward && again.contains(&l.name));
        add(
            "AllGather",
            &g.params,
            m * per_mb,
            m * per_mb * part(p, padded * cd),
        );
        // gradient reduce-scatters over G: after every micro-batch, or once per step
        add(
            "ReduceScatter",
            &g.grads,
            grad_reductions,
            grad_reductions * part(gs, padded * gd),
        );
        // to the O-shard: reduce-scatter over O\G of the 1/g shard
        add(
            "ReduceScatter",
            &minus(&g.optim, &g.grads),
            1,
            part(o / gs, padded / gs * gd),
        );
        // across replicas: all-reduce of the 1/o shard over W\O
        add(
            "AllReduce",
            &minus(&world, &g.optim),
            1,
            2 * part(w / o, padded / o * gd),
        );
        // the new parameter shard: all-gather over O\P of the 1/o shards into the 1/p
        // shard, compute dtype
        add(
            "AllGather",
            &minus(&g.optim, &g.params),
            1,
            part(o / p, padded / p * cd),
        );
    }
    // the mean loss over ranks (one f32)
    add("AllReduce", &world, 1, 2 * part(w, 4));
    // clipping: the partial sums of squares of the O-shards (one f32)
    if c.clip {
        add("AllReduce", &g.optim, 1, 2 * part(o, 4));
    }
    out
}

/// `rewrite`: build the step with collective rewriting (default options: hierarchical
/// decomposition, bucketing, RS+AG = AR, exact cast placement) and check only that the plan
/// verifies: rewriting picks collectives by predicted time, which may move more bytes per
/// rank (a decomposed all-reduce of a scalar, padded buckets), so the formulas are those of
/// the plan as inserted (`hzp compile --no-rewrite`).
fn check(c: &Case, rewrite: bool) -> Result<(), TestCaseError> {
    let text = forward_text(c);
    let fwd = hzp_ir::text::parse(&text, "random.hzp", &|_| None)
        .map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
    let mesh = mesh_of(c);
    let spec = spec_of(c);
    let cfg = config(c);
    let rw = rewrite.then(|| Rewrite {
        cluster: ClusterSpec::load(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../examples/clusters/h100-dgx.toml"
        )))
        .unwrap(),
        options: RewriteOptions::default(),
    });
    let step = shard_training_step_rewritten(
        &fwd,
        &cfg,
        &mesh,
        &spec,
        &c.sched,
        rw.as_ref(),
        &mut |_, _| {},
    )
    .map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
    let prog = &step.program;
    let mem = plan_memory(prog, &default_kind(prog), &default_persistent(prog));
    let plan = Plan::new(
        "random.hzp",
        "asynchzp",
        mesh.clone(),
        step.groups.clone(),
        prog.clone(),
        mem.arena_bytes,
        mem.buffers.clone(),
    )
    .with_training(step.layouts.clone(), c.micro_batches, String::new());
    let opts = VerifyOptions {
        budget: None,
        communicator_per_stream: true,
    };
    if let Err(v) = verify_plan_with(&plan, &opts) {
        let list: Vec<String> = v.iter().map(|v| format!("  - {v}")).collect();
        return Err(TestCaseError::fail(format!(
            "the plan failed verification:\n{}\n{text}",
            list.join("\n")
        )));
    }
    if !rewrite {
        prop_assert_eq!(
            measured(prog, &mesh),
            expected(c, &fwd, &cfg, &mesh, &step),
            "collectives (count, bytes x W) differ from the formulas\n{}",
            text
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn plans_verify_and_move_the_bytes_of_the_formulas(c in case()) {
        check(&c, false)?;
    }

    #[test]
    fn rewritten_plans_verify(c in case()) {
        check(&c, true)?;
    }
}

/// One case spelled out: ZeRO-3-like groups on two axes with odd sizes (padding), two
/// micro-batches, per-micro-batch reduction, recompute and clipping.
#[test]
fn a_hand_picked_case() {
    let c = Case {
        batch: 2,
        input_width: 5,
        layers: vec![
            Layer {
                width: 7,
                bias: true,
                act: Some("Gelu"),
            },
            Layer {
                width: 3,
                bias: true,
                act: None,
            },
        ],
        axes: vec![("node".into(), 2), ("gpu".into(), 3)],
        order: vec![1, 0],
        np: 1,
        ng: 1,
        no: 2,
        sched: ScheduleOptions {
            recompute: true,
            ..ScheduleOptions::default()
        },
        micro_batches: 2,
        compute: DType::F32,
        mse: true,
        clip: true,
        sgd: false,
    };
    check(&c, false).unwrap();
    check(&c, true).unwrap();
}
