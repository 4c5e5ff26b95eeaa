//! A small helper for passes that append nodes to a program: fresh names, scalar constants,
//! and one-line op emission with errors that name the pass's node.

use hzp_ir::{DType, Group, NameSet, Op, Program, Role, Tensor, TensorType, ValueId};
use std::collections::HashMap;

pub struct Emitter<'a> {
    pub p: &'a mut Program,
    names: NameSet,
    /// Prefix for the names of emitted nodes and values (e.g. the forward node's name).
    pub scope: String,
    /// The role of emitted nodes (see [`hzp_ir::role`]); set with the scope by [`Self::enter`].
    pub role: Role,
    scalars: HashMap<(u64, DType), ValueId>,
}

impl<'a> Emitter<'a> {
    pub fn new(p: &'a mut Program) -> Emitter<'a> {
        let names = NameSet::from_program(p);
        Emitter {
            p,
            names,
            scope: String::new(),
            role: Role::default(),
            scalars: HashMap::new(),
        }
    }

    /// Names the next emitted nodes `<scope>/...` and gives them `role`.
    pub fn enter(&mut self, scope: impl Into<String>, role: Role) {
        self.scope = scope.into();
        self.role = role;
    }

    pub fn ty(&self, v: ValueId) -> &TensorType {
        self.p.ty(v)
    }

    pub fn shape(&self, v: ValueId) -> Vec<usize> {
        self.p.ty(v).shape.clone()
    }

    pub fn fresh(&mut self, base: &str) -> String {
        self.names.fresh(base)
    }

    /// Emits a node with several outputs.
    pub fn ops(&mut self, op: Op, inputs: &[ValueId]) -> Result<Vec<ValueId>, String> {
        self.ops_named(op, inputs, &[])
    }

    /// Emits a node with several outputs, named `<node>/<label>` by `labels` (when there is
    /// one per output; `<node>:<index>` otherwise).
    pub fn ops_named(
        &mut self,
        op: Op,
        inputs: &[ValueId],
        labels: &[&str],
    ) -> Result<Vec<ValueId>, String> {
        let base = if self.scope.is_empty() {
            op.name().to_string()
        } else {
            format!("{}/{}", self.scope, op.name())
        };
        let n_out = {
            let tys: Vec<&TensorType> = inputs.iter().map(|&v| self.p.ty(v)).collect();
            op.infer(&tys, self.p.mesh.as_ref())
                .map_err(|e| format!("{base}: {e}"))?
                .len()
        };
        let node_name = self.names.fresh(&base);
        let outs: Vec<String> = (0..n_out)
            .map(|i| {
                if n_out == 1 {
                    node_name.clone()
                } else if labels.len() == n_out {
                    self.names.fresh(&format!("{node_name}/{}", labels[i]))
                } else {
                    self.names.fresh(&format!("{node_name}:{i}"))
                }
            })
            .collect();
        let outs = self.p.add_node(node_name, op, inputs.to_vec(), outs)?;
        if let Some(n) = self.p.nodes.last_mut() {
            n.role = self.role.clone();
        }
        Ok(outs)
    }

    /// Emits a node with one output.
    pub fn op(&mut self, op: Op, inputs: &[ValueId]) -> Result<ValueId, String> {
        let name = op.name();
        let outs = self.ops(op, inputs)?;
        match outs.as_slice() {
            [v] => Ok(*v),
            _ => Err(format!("{name} has {} outputs, expected one", outs.len())),
        }
    }

    /// A scalar constant of `dtype` (deduplicated).
    pub fn scalar(&mut self, value: f64, dtype: DType) -> ValueId {
        let key = (value.to_bits(), dtype);
        if let Some(&v) = self.scalars.get(&key) {
            return v;
        }
        let name = self.names.fresh(&format!("c:{value:?}:{}", dtype.name()));
        let v = self
            .p
            .add_const(name, Tensor::from_f64(dtype, Vec::<usize>::new(), &[value]));
        self.scalars.insert(key, v);
        v
    }

    /// A tensor of zeros shaped like `ty`.
    pub fn zeros(&mut self, ty: &TensorType) -> Result<ValueId, String> {
        self.op(
            Op::Fill {
                value: 0.0,
                dtype: ty.dtype,
                shape: ty.shape.clone(),
            },
            &[],
        )
    }

    /// This rank's index in `group` (of `size` members) as an i64 scalar, from an
    /// all-to-all of the constant `0..size` (named from `base`): member j sends piece r to
    /// member r, so member r receives r from every member (no rank-dependent op).
    pub fn member_index(
        &mut self,
        base: &str,
        group: &Group,
        size: usize,
    ) -> Result<ValueId, String> {
        let name = self.fresh(base);
        let ranks = self
            .p
            .add_const(name, Tensor::i64(vec![size], (0..size as i64).collect()));
        let got = self.op(
            Op::AllToAll {
                group: group.clone(),
                split_axis: 0,
                concat_axis: 0,
            },
            &[ranks],
        )?;
        let one = self.op(
            Op::Slice {
                axes: vec![0],
                starts: vec![0],
                ends: vec![1],
                steps: vec![1],
            },
            &[got],
        )?;
        self.op(Op::Reshape { shape: vec![] }, &[one])
    }
}
