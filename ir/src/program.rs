//! Programs: an arena of values and nodes with typed ids, in topological order.

use crate::dtype::{DType, TensorType};
use crate::mesh::Mesh;
use crate::op::{Op, StreamKind};
use crate::role::Role;
use crate::tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// Index of a value in [`Program::values`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ValueId(pub u32);

/// Index of a node in [`Program::nodes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(pub u32);

impl ValueId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// Where a value comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ValueDef {
    /// A graph input fed at run time (token ids, masks, labels).
    Input,
    /// A trainable parameter (its data, if any, is in [`Program::params`]).
    Param,
    /// A constant (data in [`Program::consts`]).
    Const,
    /// Persistent, non-trainable state carried from step to step (optimizer moments, the
    /// step counter); see [`Program::states`].
    State,
    /// Output `slot` of node `node`.
    Node { node: NodeId, slot: u32 },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Value {
    /// Unique within the program. Parameters keep their ONNX initializer names.
    pub name: String,
    pub ty: TensorType,
    pub def: ValueDef,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// The user's name for the node (the ONNX node name where there was one).
    pub name: String,
    pub op: Op,
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<ValueId>,
    pub stream: StreamKind,
    /// What the node does in a training step (see [`crate::role`]); passes read this, never
    /// the name.
    #[serde(default, skip_serializing_if = "Role::is_compute")]
    pub role: Role,
}

/// A trainable parameter. `data` is `None` for shapes-only programs (presets).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Param {
    pub value: ValueId,
    pub data: Option<Tensor>,
}

/// A constant: never trained, always has data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Const {
    pub value: ValueId,
    pub data: Tensor,
}

/// Persistent state: starts as `init` (zeros when `None`) and changes only through
/// [`Program::updates`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub value: ValueId,
    pub init: Option<Tensor>,
}

/// After a step, `target` (a parameter or a state) takes the value of `value`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Update {
    pub target: ValueId,
    pub value: ValueId,
}

/// Mixed-precision policy of a training program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Precision {
    /// dtype of the forward/backward compute copy of parameters and activations.
    pub compute: DType,
    /// dtype of the parameters themselves (the master weights) and optimizer states.
    pub master: DType,
    /// dtype in which losses and gradients are reduced.
    pub reduce: DType,
}

/// A program: values and nodes in an arena; `nodes` is in topological order (the verifier
/// checks it), which is also the order a single-stream executor runs them in.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Program {
    pub name: String,
    pub mesh: Option<Mesh>,
    pub values: Vec<Value>,
    pub nodes: Vec<Node>,
    pub inputs: Vec<ValueId>,
    pub params: Vec<Param>,
    pub consts: Vec<Const>,
    pub states: Vec<State>,
    pub outputs: Vec<ValueId>,
    /// State transitions of a training step (empty for a forward program).
    pub updates: Vec<Update>,
    pub precision: Option<Precision>,
    /// Inputs the program was specialized on, by input name: the frontend folded their
    /// values (given at import, e.g. a `Reshape` target or `TopK`'s k fed as a graph input)
    /// into the program, so running it with any other value is an error naming the input.
    /// Empty for almost every program. Printed as `input %k : i64[1] = [3]`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub specialized: BTreeMap<String, Tensor>,
}

impl Program {
    pub fn new(name: impl Into<String>) -> Program {
        Program {
            name: name.into(),
            ..Default::default()
        }
    }

    fn push_value(&mut self, name: String, ty: TensorType, def: ValueDef) -> ValueId {
        let id = ValueId(self.values.len() as u32);
        self.values.push(Value { name, ty, def });
        id
    }

    pub fn add_input(&mut self, name: impl Into<String>, ty: TensorType) -> ValueId {
        let id = self.push_value(name.into(), ty, ValueDef::Input);
        self.inputs.push(id);
        id
    }

    pub fn add_param(
        &mut self,
        name: impl Into<String>,
        ty: TensorType,
        data: Option<Tensor>,
    ) -> ValueId {
        let id = self.push_value(name.into(), ty, ValueDef::Param);
        self.params.push(Param { value: id, data });
        id
    }

    pub fn add_const(&mut self, name: impl Into<String>, data: Tensor) -> ValueId {
        let id = self.push_value(name.into(), data.ty(), ValueDef::Const);
        self.consts.push(Const { value: id, data });
        id
    }

    pub fn add_state(
        &mut self,
        name: impl Into<String>,
        ty: TensorType,
        init: Option<Tensor>,
    ) -> ValueId {
        let id = self.push_value(name.into(), ty, ValueDef::State);
        self.states.push(State { value: id, init });
        id
    }

    /// Appends a node; output types come from the op's type rule. `out_names` names the
    /// outputs (one per output); an error names the node.
    pub fn add_node(
        &mut self,
        name: impl Into<String>,
        op: Op,
        inputs: Vec<ValueId>,
        out_names: Vec<String>,
    ) -> Result<Vec<ValueId>, String> {
        let name = name.into();
        let tys: Vec<&TensorType> = inputs.iter().map(|&v| &self.values[v.index()].ty).collect();
        let out_tys = op
            .infer(&tys, self.mesh.as_ref())
            .map_err(|e| format!("node `{name}`: {e}"))?;
        if out_names.len() != out_tys.len() {
            return Err(format!(
                "node `{name}`: {} has {} outputs, {} names were given",
                op.name(),
                out_tys.len(),
                out_names.len()
            ));
        }
        let node = NodeId(self.nodes.len() as u32);
        let outputs = out_tys
            .into_iter()
            .zip(out_names)
            .enumerate()
            .map(|(slot, (ty, n))| {
                self.push_value(
                    n,
                    ty,
                    ValueDef::Node {
                        node,
                        slot: slot as u32,
                    },
                )
            })
            .collect::<Vec<_>>();
        self.nodes.push(Node {
            name,
            op,
            inputs,
            outputs: outputs.clone(),
            stream: StreamKind::Compute,
            role: Role::default(),
        });
        Ok(outputs)
    }

    pub fn value(&self, id: ValueId) -> &Value {
        &self.values[id.index()]
    }

    pub fn ty(&self, id: ValueId) -> &TensorType {
        &self.values[id.index()].ty
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }

    /// The node that produces `id`, if any.
    pub fn producer(&self, id: ValueId) -> Option<NodeId> {
        match self.values[id.index()].def {
            ValueDef::Node { node, .. } => Some(node),
            _ => None,
        }
    }

    pub fn param(&self, id: ValueId) -> Option<&Param> {
        self.params.iter().find(|p| p.value == id)
    }

    pub fn const_data(&self, id: ValueId) -> Option<&Tensor> {
        self.consts.iter().find(|c| c.value == id).map(|c| &c.data)
    }

    /// Name -> value, for lookups by the user's names.
    pub fn names(&self) -> HashMap<&str, ValueId> {
        self.values
            .iter()
            .enumerate()
            .map(|(i, v)| (v.name.as_str(), ValueId(i as u32)))
            .collect()
    }

    pub fn find_value(&self, name: &str) -> Option<ValueId> {
        self.values
            .iter()
            .position(|v| v.name == name)
            .map(|i| ValueId(i as u32))
    }

    /// For each value, the nodes that read it (in node order).
    pub fn users(&self) -> Vec<Vec<NodeId>> {
        let mut users = vec![Vec::new(); self.values.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for &v in &n.inputs {
                let u: &mut Vec<NodeId> = &mut users[v.index()];
                if u.last() != Some(&NodeId(i as u32)) {
                    u.push(NodeId(i as u32));
                }
            }
        }
        users
    }

    /// For each value, whether it leaves the step: a program output, or an update's value or
    /// target. Rewrites must keep these values as they are.
    pub fn escaping_values(&self) -> Vec<bool> {
        let mut out = vec![false; self.values.len()];
        let vs = self.outputs.iter().copied();
        let us = self.updates.iter().flat_map(|u| [u.target, u.value]);
        for v in vs.chain(us) {
            if let Some(f) = out.get_mut(v.index()) {
                *f = true;
            }
        }
        out
    }

    /// Sets every node result's definition to its node's current position: for passes that
    /// reorder or insert nodes in `nodes` directly.
    pub fn renumber_nodes(&mut self) {
        for (i, n) in self.nodes.iter().enumerate() {
            for (slot, &o) in n.outputs.iter().enumerate() {
                self.values[o.index()].def = ValueDef::Node {
                    node: NodeId(i as u32),
                    slot: slot as u32,
                };
            }
        }
    }

    /// Renumbers the values: value `order[i]` becomes value `i` (`order` is a permutation
    /// of all values). For passes that add values whose definitions belong earlier than the
    /// end of the arena, so the text form stays in its interleaved layout.
    pub fn reorder_values(&mut self, order: &[ValueId]) {
        assert_eq!(
            order.len(),
            self.values.len(),
            "reorder_values: not a permutation"
        );
        let mut map = vec![u32::MAX; self.values.len()];
        for (i, v) in order.iter().enumerate() {
            map[v.index()] = i as u32;
        }
        assert!(
            map.iter().all(|&m| m != u32::MAX),
            "reorder_values: not a permutation"
        );
        let remap = |v: &mut ValueId| *v = ValueId(map[v.index()]);
        self.values = order
            .iter()
            .map(|v| self.values[v.index()].clone())
            .collect();
        for n in &mut self.nodes {
            n.inputs
                .iter_mut()
                .chain(n.outputs.iter_mut())
                .for_each(remap);
        }
        self.inputs.iter_mut().for_each(remap);
        self.outputs.iter_mut().for_each(remap);
        self.params.iter_mut().for_each(|x| remap(&mut x.value));
        self.consts.iter_mut().for_each(|x| remap(&mut x.value));
        self.states.iter_mut().for_each(|x| remap(&mut x.value));
        for u in &mut self.updates {
            remap(&mut u.target);
            remap(&mut u.value);
        }
    }

    /// Total number of parameter elements.
    pub fn num_parameters(&self) -> u64 {
        self.params
            .iter()
            .map(|p| self.ty(p.value).numel() as u64)
            .sum()
    }

    /// Removes nodes, constants and values that no output depends on, and renumbers ids
    /// densely, keeping relative order (so printing stays deterministic). Inputs and
    /// parameters are kept even when unused: they are part of the program's interface.
    /// The inputs given in `inputs` whose values differ from those the program was
    /// specialized on, as one message per input naming it (empty when all agree).
    pub fn check_specialized<'a>(
        &self,
        inputs: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
    ) -> Result<(), String> {
        if self.specialized.is_empty() {
            return Ok(());
        }
        let mut bad = Vec::new();
        for (name, t) in inputs {
            if let Some(want) = self.specialized.get(name) {
                if t.shape != want.shape || t.to_f64_vec() != want.to_f64_vec() {
                    bad.push(format!(
                        "input `{name}` is {}, but the program was specialized on `{name}` = {} \
                         when it was imported (its value decides shapes); import the model again \
                         with the new value (`--bind {name}=...` or `--inputs`)",
                        crate::tensor::literal_string(t),
                        crate::tensor::literal_string(want)
                    ));
                }
            }
        }
        bad.sort();
        if bad.is_empty() {
            Ok(())
        } else {
            Err(bad.join("; "))
        }
    }

    pub fn eliminate_dead_code(&mut self) {
        let mut live_v = vec![false; self.values.len()];
        let mut live_n = vec![false; self.nodes.len()];
        for &o in &self.outputs {
            live_v[o.index()] = true;
        }
        for u in &self.updates {
            live_v[u.value.index()] = true;
        }
        for v in self
            .inputs
            .iter()
            .chain(self.params.iter().map(|p| &p.value))
            .chain(self.states.iter().map(|s| &s.value))
        {
            live_v[v.index()] = true;
        }
        for (i, n) in self.nodes.iter().enumerate().rev() {
            // side-effecting ops (collectives, events, frees) are kept
            let effect = matches!(
                n.op,
                Op::Free | Op::RecordEvent { .. } | Op::WaitEvent { .. }
            ) || n.op.is_collective();
            if effect || n.outputs.iter().any(|o| live_v[o.index()]) {
                live_n[i] = true;
                for &v in &n.inputs {
                    live_v[v.index()] = true;
                }
                for &o in &n.outputs {
                    live_v[o.index()] = true;
                }
            }
        }
        self.retain(&live_v, &live_n);
    }

    /// Keeps the marked values and nodes, renumbering densely in order. Compacts the arenas
    /// in place (moves, no clones): on a large program this pass runs many times, and copying
    /// every name and node into fresh vectors was a large share of the compile's memory
    /// traffic.
    fn retain(&mut self, live_v: &[bool], live_n: &[bool]) {
        let mut vmap = vec![u32::MAX; self.values.len()];
        let mut kept = 0u32;
        for (i, m) in vmap.iter_mut().enumerate() {
            if live_v[i] {
                *m = kept;
                kept += 1;
            }
        }
        let mut i = 0;
        self.values.retain(|_| {
            i += 1;
            live_v[i - 1]
        });
        let mut i = 0;
        self.nodes.retain(|_| {
            i += 1;
            live_n[i - 1]
        });
        for (id, n) in self.nodes.iter_mut().enumerate() {
            for v in n.inputs.iter_mut().chain(n.outputs.iter_mut()) {
                *v = ValueId(vmap[v.index()]);
            }
            for (slot, o) in n.outputs.iter().enumerate() {
                self.values[o.index()].def = ValueDef::Node {
                    node: NodeId(id as u32),
                    slot: slot as u32,
                };
            }
        }
        let remap = |v: &mut ValueId| *v = ValueId(vmap[v.index()]);
        self.inputs.iter_mut().for_each(remap);
        self.outputs.iter_mut().for_each(remap);
        self.params.iter_mut().for_each(|p| remap(&mut p.value));
        self.consts.retain(|c| live_v[c.value.index()]);
        self.consts.iter_mut().for_each(|c| remap(&mut c.value));
        self.states.iter_mut().for_each(|s| remap(&mut s.value));
        for u in &mut self.updates {
            remap(&mut u.target);
            remap(&mut u.value);
        }
    }
}

/// Hands out names that do not collide with names already in use.
#[derive(Debug, Default, Clone)]
pub struct NameSet {
    /// (foldhash: names are hashed millions of times when compiling a big model; its seed is
    /// random per process, as std's)
    used: foldhash::HashSet<String>,
    /// Per base given to `fresh`: every `base.i` below this number is used (names are never
    /// released), so the next search starts here instead of at 1.
    next: foldhash::HashMap<String, usize>,
}

impl NameSet {
    pub fn from_program(p: &Program) -> NameSet {
        let mut used =
            foldhash::HashSet::with_capacity_and_hasher(p.values.len() * 2, Default::default());
        used.extend(p.values.iter().map(|v| v.name.clone()));
        NameSet {
            used,
            next: Default::default(),
        }
    }

    /// Marks `name` used; returns false if it already was.
    pub fn insert(&mut self, name: &str) -> bool {
        self.used.insert(name.to_string())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.used.contains(name)
    }

    /// `base` if free, else `base.1`, `base.2`, ...; the result is marked used.
    pub fn fresh(&mut self, base: &str) -> String {
        if self.used.insert(base.to_string()) {
            return base.to_string();
        }
        let mut i = self.next.get(base).copied().unwrap_or(1);
        loop {
            let cand = format!("{base}.{i}");
            i += 1;
            if self.used.insert(cand.clone()) {
                self.next.insert(base.to_string(), i);
                return cand;
            }
        }
    }
}

/// A [`NameSet`] over the names of a program it borrows: a pass that builds a new program
/// from `p` hands out names that collide with none of `p`'s, without copying them all.
#[derive(Debug)]
pub struct FreshNames<'a> {
    program: foldhash::HashSet<&'a str>,
    added: NameSet,
}

impl<'a> FreshNames<'a> {
    pub fn over(p: &'a Program) -> FreshNames<'a> {
        let mut program =
            foldhash::HashSet::with_capacity_and_hasher(p.values.len(), Default::default());
        program.extend(p.values.iter().map(|v| v.name.as_str()));
        FreshNames {
            program,
            added: NameSet::default(),
        }
    }

    /// Marks `name` used; returns false if it already was.
    fn insert(&mut self, name: &str) -> bool {
        !self.program.contains(name) && self.added.insert(name)
    }

    /// As [`NameSet::fresh`], over the program's names and those handed out.
    pub fn fresh(&mut self, base: &str) -> String {
        if self.insert(base) {
            return base.to_string();
        }
        let mut i = self.added.next.get(base).copied().unwrap_or(1);
        loop {
            let cand = format!("{base}.{i}");
            i += 1;
            if self.insert(&cand) {
                self.added.next.insert(base.to_string(), i);
                return cand;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::op::BinaryOp;

    #[test]
    fn dead_code_is_removed_and_ids_stay_dense() {
        let mut p = Program::new("t");
        let x = p.add_input("x", TensorType::new(DType::F32, vec![2]));
        let c = p.add_const("c", Tensor::f32(vec![2], vec![1.0, 2.0]));
        let dead = p.add_const("dead", Tensor::f32(vec![2], vec![0.0, 0.0]));
        let d = p
            .add_node(
                "unused",
                Op::Binary(BinaryOp::Mul),
                vec![x, dead],
                vec!["d".into()],
            )
            .unwrap();
        let y = p
            .add_node(
                "add",
                Op::Binary(BinaryOp::Add),
                vec![x, c],
                vec!["y".into()],
            )
            .unwrap();
        p.outputs = vec![y[0]];
        let _ = d;
        p.eliminate_dead_code();
        assert_eq!(p.nodes.len(), 1);
        assert_eq!(p.consts.len(), 1);
        assert_eq!(p.values.len(), 3);
        assert_eq!(p.value(p.outputs[0]).name, "y");
        crate::verify::verify(&p).unwrap();
    }

    #[test]
    fn fresh_names_do_not_collide() {
        let mut n = NameSet::default();
        assert_eq!(n.fresh("a"), "a");
        assert_eq!(n.fresh("a"), "a.1");
        assert_eq!(n.fresh("a"), "a.2");
    }

    #[test]
    fn fresh_names_over_a_program_avoid_its_names() {
        let mut p = Program::new("t");
        p.add_input("a", TensorType::new(DType::F32, vec![2]));
        p.add_input("a.1", TensorType::new(DType::F32, vec![2]));
        let mut n = FreshNames::over(&p);
        assert_eq!(n.fresh("a"), "a.2");
        assert_eq!(n.fresh("a"), "a.3");
        assert_eq!(n.fresh("b"), "b");
        assert_eq!(n.fresh("b"), "b.1");
    }
}
