//! Expert parallelism: the forward program of one rank of an expert-parallel group.
//!
//! A routed MoE layer (docs/moe.md) is `MoeDispatch` (tokens -> `[E, C, H]` buffers), the
//! experts' products on those buffers with the stacked `[E, ...]` expert weights, and
//! `MoeCombine`. With the experts spread over the `n` ranks of an expert-parallel group
//! (the mesh axes of `--expert-parallel`), rank `i` of the group holds experts
//! `i*E/n .. (i+1)*E/n` and, per layer:
//!
//! 1. dispatches its own tokens into the `[E, C, H]` buffer, as without expert parallelism;
//! 2. `AllToAll { split_axis: 0, concat_axis: 1 }` over the group: chunk `j` of the experts
//!    goes to rank `j`, and the chunks received are laid side by side on the capacity axis,
//!    `[E/n, n*C, H]` (the rows from rank `k` are rows `k*C .. (k+1)*C`);
//! 3. runs its experts on those rows with its `[E/n, ...]` slice of every expert weight;
//! 4. `AllToAll { split_axis: 1, concat_axis: 0 }`, the inverse exchange, hands each rank
//!    back `[E, C, H]` for its own tokens, which it combines as without expert parallelism.
//!
//! Every token meets the same expert weights and rows as on one rank, so the result equals
//! the single-rank program. The backward of an `AllToAll` is the inverse `AllToAll`
//! (autodiff), so gradients take the same two exchanges in reverse. An expert weight's
//! gradient on rank `i` already sums the tokens of the whole group; the sharding pass
//! ([`crate::dist::spmd`]) reduces it only over the axes outside the group.
//!
//! What is split is found from the ops, not from names: the region of a layer is every
//! node on a path from the dispatch buffer to the combine's expert input; the expert
//! weights are the parameters that region reads (through weight-only ops such as a
//! transpose), each stacked on axis 0 with `E` rows. The region may hold products, row-wise
//! ops, casts, and slices, splits, transposes and reshapes that keep the expert and
//! capacity axes; anything else is refused by name.

use hzp_ir::{Group, Mesh, NameSet, NodeId, Op, Program, TensorType, ValueDef, ValueId};
use std::collections::{BTreeMap, HashMap, HashSet};

/// What [`expert_parallel_forward`] split.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertSplit {
    /// The expert-parallel group (mesh order) and its size.
    pub group: Group,
    pub size: usize,
    /// Each expert parameter's full shape (`[E, ...]`), by name; in the program it is
    /// `[E / size, ...]`.
    pub params: BTreeMap<String, Vec<usize>>,
    /// The routed layers (their dispatch nodes' names).
    pub layers: Vec<String>,
}

fn refuse(what: impl std::fmt::Display) -> String {
    format!("--expert-parallel: {what}")
}

/// One routed layer of the forward program.
struct Layer {
    dispatch: usize,
    combine: usize,
    experts: usize,
    capacity: usize,
    /// Nodes from the buffer to the combine's expert input.
    region: HashSet<usize>,
    /// Nodes that compute expert weights from parameters (a transpose, a cast).
    weight_nodes: HashSet<usize>,
}

/// The nodes reachable from `from` along data flow (`forward`) or that reach it.
fn reach(p: &Program, users: &[Vec<NodeId>], from: ValueId, forward: bool) -> HashSet<usize> {
    let mut seen = HashSet::new();
    let mut stack = vec![from];
    while let Some(v) = stack.pop() {
        if forward {
            for u in &users[v.index()] {
                if seen.insert(u.index()) {
                    stack.extend(p.nodes[u.index()].outputs.iter().copied());
                }
            }
        } else if let Some(n) = p.producer(v) {
            if seen.insert(n.index()) {
                stack.extend(p.nodes[n.index()].inputs.iter().copied());
            }
        }
    }
    seen
}

/// Whether `op` may run inside an expert region (`region`: on `[E, C, ...]` buffers, whose
/// first two axes must stay; otherwise on a stacked weight, whose first axis must stay).
fn splittable(op: &Op, region: bool) -> bool {
    let kept = if region { 2 } else { 1 };
    match op {
        Op::MatMul | Op::Unary(_) | Op::Binary(_) | Op::Cast { .. } | Op::Identity => true,
        Op::Slice { axes, .. } => axes.iter().all(|&a| a >= kept),
        Op::Split { axis, .. } => *axis >= kept,
        Op::Transpose { perm } => perm.iter().take(kept).enumerate().all(|(i, &a)| i == a),
        Op::Reshape { .. } => true,
        _ => false,
    }
}

fn find_layers(p: &Program, users: &[Vec<NodeId>]) -> Result<Vec<Layer>, String> {
    let mut layers = Vec::new();
    for (i, n) in p.nodes.iter().enumerate() {
        let Op::MoeDispatch { experts, capacity } = n.op else {
            continue;
        };
        let (buf, slots) = (n.outputs[0], n.outputs[1]);
        let combines: Vec<usize> = users[slots.index()]
            .iter()
            .map(|u| u.index())
            .filter(|&u| matches!(p.nodes[u].op, Op::MoeCombine))
            .collect();
        let [combine] = combines[..] else {
            return Err(refuse(format!(
                "the slots of `{}` are read by {} MoeCombine nodes, not one",
                n.name,
                combines.len()
            )));
        };
        let y = p.nodes[combine].inputs[0];
        let region: HashSet<usize> = reach(p, users, buf, true)
            .intersection(&reach(p, users, y, false))
            .copied()
            .collect();
        let from_buffer = y == buf || p.producer(y).is_some_and(|pn| region.contains(&pn.index()));
        if !from_buffer {
            return Err(refuse(format!(
                "the expert input of `{}` is not computed from the buffer of `{}`",
                p.nodes[combine].name, n.name
            )));
        }
        layers.push(Layer {
            dispatch: i,
            combine,
            experts,
            capacity,
            region,
            weight_nodes: HashSet::new(),
        });
    }
    Ok(layers)
}

/// Checks one layer's region and collects its weight nodes and expert parameters.
fn check_layer(
    p: &Program,
    users: &[Vec<NodeId>],
    l: &mut Layer,
    expert_params: &mut BTreeMap<String, Vec<usize>>,
) -> Result<(), String> {
    let d = &p.nodes[l.dispatch];
    let buf = d.outputs[0];
    let (e, c) = (l.experts, l.capacity);
    let mut order: Vec<usize> = l.region.iter().copied().collect();
    order.sort_unstable();
    for &r in &order {
        let n = &p.nodes[r];
        if !splittable(&n.op, true) {
            return Err(refuse(format!(
                "`{}` ({}) inside the experts of `{}` is not an op hzp splits by expert \
                 (products, row-wise ops, casts, and slices, splits, transposes and reshapes \
                 that keep the expert and capacity axes)",
                n.name,
                n.op.name(),
                d.name
            )));
        }
        for &o in &n.outputs {
            let t = p.ty(o);
            if t.rank() < 2 || t.shape[0] != e || t.shape[1] != c {
                return Err(refuse(format!(
                    "`{}` inside the experts of `{}` makes {t}, not an [{e}, {c}, ...] buffer",
                    p.value(o).name,
                    d.name
                )));
            }
            for u in &users[o.index()] {
                if !l.region.contains(&u.index()) && u.index() != l.combine {
                    return Err(refuse(format!(
                        "`{}` of the experts of `{}` is also read by `{}`, outside them",
                        p.value(o).name,
                        d.name,
                        p.nodes[u.index()].name
                    )));
                }
            }
            if p.outputs.contains(&o) {
                return Err(refuse(format!(
                    "`{}` of the experts of `{}` is a program output",
                    p.value(o).name,
                    d.name
                )));
            }
        }
        if let Op::Reshape { shape } = &n.op {
            if shape.len() < 2 || shape[0] != e || shape[1] != c {
                return Err(refuse(format!(
                    "`{}` reshapes across the expert or capacity axis of `{}`",
                    n.name, d.name
                )));
            }
        }
        let rank = p.ty(n.outputs[0]).rank();
        for &v in &n.inputs {
            if v == buf
                || p.producer(v)
                    .is_some_and(|pn| l.region.contains(&pn.index()))
            {
                continue;
            }
            let t = p.ty(v);
            if t.rank() < rank || t.shape.first() == Some(&1) {
                // broadcast over the experts and rows (a scalar, a bias shared by all)
                if depends_on_params(p, v) {
                    return Err(refuse(format!(
                        "`{}` reads `{}` ({t}), a parameter shared by all experts, inside the \
                         experts of `{}`",
                        n.name,
                        p.value(v).name,
                        d.name
                    )));
                }
                if !constant(p, v) {
                    return Err(refuse(format!(
                        "`{}` reads `{}`, computed outside the experts of `{}`",
                        n.name,
                        p.value(v).name,
                        d.name
                    )));
                }
                continue;
            }
            weight_chain(p, users, l, v, rank, expert_params)?;
        }
    }
    Ok(())
}

/// Whether `v` is computed from constants alone.
fn constant(p: &Program, v: ValueId) -> bool {
    leaves_all(p, v, |d| matches!(d, ValueDef::Const))
}

/// Whether `v` depends on a parameter.
fn depends_on_params(p: &Program, v: ValueId) -> bool {
    !leaves_all(p, v, |d| !matches!(d, ValueDef::Param))
}

/// Whether every value `v` is computed from (walking back through nodes, each value once)
/// satisfies `ok` by its definition.
fn leaves_all(p: &Program, v: ValueId, ok: impl Fn(&ValueDef) -> bool) -> bool {
    let mut seen = HashSet::new();
    let mut stack = vec![v];
    while let Some(x) = stack.pop() {
        if !seen.insert(x) {
            continue;
        }
        match p.value(x).def {
            ValueDef::Node { node, .. } => stack.extend(p.nodes[node.index()].inputs.iter()),
            ref d if !ok(d) => return false,
            _ => {}
        }
    }
    true
}

/// `v`, read by the region at its rank, must be a stacked expert weight: computed by
/// weight-only ops from parameters with `E` rows (and constants), read only by the region
/// and by such ops.
fn weight_chain(
    p: &Program,
    users: &[Vec<NodeId>],
    l: &mut Layer,
    v: ValueId,
    rank: usize,
    expert_params: &mut BTreeMap<String, Vec<usize>>,
) -> Result<(), String> {
    let d = &p.nodes[l.dispatch];
    let e = l.experts;
    let t = p.ty(v);
    if t.rank() != rank || t.shape[0] != e {
        return Err(refuse(format!(
            "`{}` ({t}) is read inside the experts of `{}` but is not stacked per expert \
             ([{e}, ...] at the buffers' rank)",
            p.value(v).name,
            d.name
        )));
    }
    match p.value(v).def {
        ValueDef::Param => {
            let name = p.value(v).name.clone();
            match expert_params.get(&name) {
                Some(s) if *s != t.shape => {
                    return Err(refuse(format!("`{name}` is read as two different shapes")))
                }
                _ => {
                    expert_params.insert(name, t.shape.clone());
                }
            }
        }
        ValueDef::Node { node, .. } => {
            let i = node.index();
            let n = &p.nodes[i];
            if !splittable(&n.op, false) || matches!(n.op, Op::MatMul) {
                return Err(refuse(format!(
                    "the expert weight `{}` is computed by `{}` ({}), which is not an op hzp \
                     splits by expert",
                    p.value(v).name,
                    n.name,
                    n.op.name()
                )));
            }
            if let Op::Reshape { shape } = &n.op {
                if shape.first() != Some(&e) {
                    return Err(refuse(format!(
                        "`{}` reshapes across the expert axis of `{}`",
                        n.name, d.name
                    )));
                }
            }
            if l.weight_nodes.insert(i) {
                for &x in &n.inputs {
                    if constant(p, x)
                        && (p.ty(x).rank() < rank || p.ty(x).shape.first() == Some(&1))
                    {
                        continue;
                    }
                    weight_chain(p, users, l, x, rank, expert_params)?;
                }
            }
        }
        _ => {
            return Err(refuse(format!(
                "`{}` is read inside the experts of `{}` but is neither computed there nor a \
                 stacked expert weight",
                p.value(v).name,
                d.name
            )))
        }
    }
    // read only inside this layer's experts
    for u in &users[v.index()] {
        let u = u.index();
        if !l.region.contains(&u) && !l.weight_nodes.contains(&u) && !is_weight_user(p, users, l, u)
        {
            return Err(refuse(format!(
                "the expert weight `{}` is also read by `{}`, outside the experts of `{}`",
                p.value(v).name,
                p.nodes[u].name,
                d.name
            )));
        }
    }
    Ok(())
}

/// Whether node `u` only computes expert weights for the region (it reaches the region
/// through weight-only ops).
fn is_weight_user(p: &Program, users: &[Vec<NodeId>], l: &Layer, u: usize) -> bool {
    let n = &p.nodes[u];
    splittable(&n.op, false)
        && !matches!(n.op, Op::MatMul)
        && n.outputs.iter().all(|&o| {
            users[o.index()]
                .iter()
                .all(|x| l.region.contains(&x.index()) || is_weight_user(p, users, l, x.index()))
        })
}

/// The forward program one rank of expert-parallel group `group` runs (see the module
/// docs), and what was split. Refuses a model without routed MoE layers, an expert count
/// the group does not divide, and expert blocks it cannot split, naming the node.
pub fn expert_parallel_forward(
    fwd: &Program,
    mesh: &Mesh,
    group: &Group,
) -> Result<(Program, ExpertSplit), String> {
    for a in &group.axes {
        if mesh.axis(a).is_none() {
            return Err(refuse(format!("axis `{a}` is not in the mesh {mesh}")));
        }
    }
    let group = Group::new(
        mesh.axes
            .iter()
            .filter(|a| group.axes.contains(&a.name))
            .map(|a| a.name.clone()),
    );
    let n = mesh.size_of(&group);
    let users = fwd.users();
    let mut layers = find_layers(fwd, &users)?;
    if layers.is_empty() {
        return Err(refuse(format!(
            "`{}` has no routed MoE layer (no MoeDispatch): `preset:moe` with its default \
             routing, or an imported MoE model without --no-fuse-moe",
            fwd.name
        )));
    }
    let expert_params = check_layers(fwd, &users, &mut layers, &group, n)?;
    let q = rebuild(fwd, mesh, &group, n, &layers, &expert_params)?;
    let split = ExpertSplit {
        group,
        size: n,
        params: expert_params,
        layers: layers
            .iter()
            .map(|l| fwd.nodes[l.dispatch].name.clone())
            .collect(),
    };
    Ok((q, split))
}

/// Checks every routed layer (the group divides its experts; its region splits) and
/// returns the expert weights' full shapes by name.
fn check_layers(
    fwd: &Program,
    users: &[Vec<NodeId>],
    layers: &mut [Layer],
    group: &Group,
    n: usize,
) -> Result<BTreeMap<String, Vec<usize>>, String> {
    let mut expert_params = BTreeMap::new();
    for l in layers.iter_mut() {
        if l.experts % n != 0 {
            return Err(refuse(format!(
                "`{}` has {} experts, which the {n} ranks of {group} do not divide evenly",
                fwd.nodes[l.dispatch].name, l.experts
            )));
        }
        check_layer(fwd, users, l, &mut expert_params)?;
    }
    if expert_params.is_empty() {
        return Err(refuse("the experts read no stacked expert weight"));
    }
    Ok(expert_params)
}

/// The forward with the expert weights sliced to `[E/n, ...]` and the exchanges around each
/// layer's region.
fn rebuild(
    fwd: &Program,
    mesh: &Mesh,
    group: &Group,
    n: usize,
    layers: &[Layer],
    expert_params: &BTreeMap<String, Vec<usize>>,
) -> Result<Program, String> {
    // Rebuild with the expert weights sliced and the exchanges around each region.
    let mut q = Program::new(fwd.name.clone());
    q.mesh = Some(mesh.clone());
    q.precision = fwd.precision;
    q.specialized = fwd.specialized.clone();
    let mut names = NameSet::from_program(fwd);
    let mut map: HashMap<ValueId, ValueId> = HashMap::with_capacity(fwd.values.len());
    for &i in &fwd.inputs {
        map.insert(i, q.add_input(fwd.value(i).name.clone(), fwd.ty(i).clone()));
    }
    for prm in &fwd.params {
        let v = fwd.value(prm.value);
        let (ty, data) = match expert_params.get(&v.name) {
            Some(shape) => {
                let mut s = shape.clone();
                s[0] /= n;
                (TensorType::new(v.ty.dtype, s), None)
            }
            None => (v.ty.clone(), prm.data.clone()),
        };
        map.insert(prm.value, q.add_param(v.name.clone(), ty, data));
    }
    for c in &fwd.consts {
        map.insert(
            c.value,
            q.add_const(fwd.value(c.value).name.clone(), c.data.clone()),
        );
    }
    for s in &fwd.states {
        map.insert(
            s.value,
            q.add_state(
                fwd.value(s.value).name.clone(),
                fwd.ty(s.value).clone(),
                s.init.clone(),
            ),
        );
    }
    let dispatch_of: HashMap<usize, &Layer> = layers.iter().map(|l| (l.dispatch, l)).collect();
    let combine_of: HashMap<usize, &Layer> = layers.iter().map(|l| (l.combine, l)).collect();
    let in_region: HashSet<usize> = layers
        .iter()
        .flat_map(|l| l.region.iter().copied())
        .collect();
    let in_weights: HashSet<usize> = layers
        .iter()
        .flat_map(|l| l.weight_nodes.iter().copied())
        .collect();
    let mut exchange = |q: &mut Program, at: &str, v: ValueId, split: usize, concat: usize| {
        let name = names.fresh(at);
        q.add_node(
            name.clone(),
            Op::AllToAll {
                group: group.clone(),
                split_axis: split,
                concat_axis: concat,
            },
            vec![v],
            vec![name],
        )
        .map(|o| o[0])
    };
    for (i, node) in fwd.nodes.iter().enumerate() {
        let mut ins: Vec<ValueId> = node.inputs.iter().map(|v| map[v]).collect();
        if combine_of.contains_key(&i) {
            ins[0] = exchange(&mut q, &format!("{}/from_experts", node.name), ins[0], 1, 0)?;
        }
        let op = match &node.op {
            Op::Reshape { shape } if in_region.contains(&i) => {
                let mut s = shape.clone();
                s[0] /= n;
                s[1] *= n;
                Op::Reshape { shape: s }
            }
            Op::Reshape { shape } if in_weights.contains(&i) => {
                let mut s = shape.clone();
                s[0] /= n;
                Op::Reshape { shape: s }
            }
            op => op.clone(),
        };
        let outs = node
            .outputs
            .iter()
            .map(|&o| fwd.value(o).name.clone())
            .collect();
        let new = q
            .add_node(node.name.clone(), op, ins, outs)
            .map_err(|e| refuse(format!("splitting the experts: {e}")))?;
        if let Some(added) = q.nodes.last_mut() {
            added.role = node.role.clone();
        }
        for (&o, nv) in node.outputs.iter().zip(new) {
            map.insert(o, nv);
        }
        if dispatch_of.contains_key(&i) {
            let buf = node.outputs[0];
            let x = exchange(
                &mut q,
                &format!("{}/to_experts", node.name),
                map[&buf],
                0,
                1,
            )?;
            map.insert(buf, x);
        }
    }
    q.outputs = fwd.outputs.iter().map(|o| map[o]).collect();
    Ok(q)
}
