//! A lockstep reference runner for per-rank (SPMD) programs: every rank of the mesh runs
//! the same program, node by node, in one thread; each collective is a real exchange of the
//! ranks' tensors in a fixed order. Streams and events do not matter here (issue order is a
//! topological order). This is the oracle that distributed plans are checked against
//! (sharded on N ranks == unsharded on one), not the fast executor.

use crate::cpu::eval_op;
use crate::cpu::{DataMut, DataRef, Workspace};
use crate::eval::EvalError;
use hzp_ir::{BinaryOp, Mesh, Node, Op, ParamLayout, Program, ReduceOp, Tensor, ValueDef, ValueId};

fn malformed(s: impl Into<String>) -> EvalError {
    EvalError::Malformed(s.into())
}

/// An error of node `n`.
fn node_err(n: &Node, message: String) -> EvalError {
    EvalError::Node {
        node: n.name.clone(),
        op: n.op.name(),
        message,
    }
}

/// `vals[rank][value]`: each rank's values computed so far in a step.
type RankValues = Vec<Vec<Option<Tensor>>>;

/// The ranks' persistent tensors and how to run a step.
pub struct ReferenceRunner {
    program: Program,
    mesh: Mesh,
    layouts: Vec<ParamLayout>,
    /// `persistent[rank][k]`: the tensor of `slots[k]` (parameters and states) on `rank`.
    persistent: Vec<Vec<Tensor>>,
    slots: Vec<ValueId>,
    /// Token ids and labels are range-checked in every batch.
    index_check: crate::index_check::IndexChecker,
}

impl ReferenceRunner {
    /// Cuts `full_params` (by name) into each rank's shards as `layouts` say; other states
    /// start at their initial value (zeros when none).
    pub fn new(
        program: &Program,
        layouts: &[ParamLayout],
        full_params: &[(String, Tensor)],
    ) -> Result<ReferenceRunner, EvalError> {
        let mesh = program
            .mesh
            .clone()
            .ok_or_else(|| malformed("an SPMD program needs a mesh"))?;
        // Each rank's master and compute shards, cut as the executor cuts them; other states
        // start at their initial value (zeros when none).
        let cut = crate::executor::cut_parameters(program, &mesh, layouts, full_params)
            .map_err(|e| malformed(e.to_string()))?;
        let slots: Vec<ValueId> = cut
            .first()
            .map(|r| r.iter().map(|(v, _)| *v).collect())
            .unwrap_or_default();
        let persistent: Vec<Vec<Tensor>> = cut
            .into_iter()
            .map(|r| r.into_iter().map(|(_, t)| t).collect())
            .collect();
        Ok(ReferenceRunner {
            index_check: crate::index_check::IndexChecker::new(program),
            program: program.clone(),
            mesh,
            layouts: layouts.to_vec(),
            persistent,
            slots,
        })
    }

    /// Runs one step on the global batch: rank r takes rows `[r*b, (r+1)*b)` of axis 0 of
    /// every input (a scalar input, the learning rate, is every rank's). Returns rank 0's outputs (all ranks agree on the loss).
    pub fn step(
        &mut self,
        global: &[(String, Tensor)],
    ) -> Result<Vec<(String, Tensor)>, EvalError> {
        self.index_check
            .check(global)
            .map_err(EvalError::IndexRange)?;
        let mut vals = self.step_values(global)?;
        let p = &self.program;
        // A MatMul reads a transposed operand (`hzp_ir::views::transposed_operands`) through a
        // strided view of the transpose's input, as the executor does (the product's bits
        // can depend on its operands' layout).
        let transposed = hzp_ir::views::transposed_operands(p);
        for n in &p.nodes {
            if matches!(
                n.op,
                Op::Free | Op::RecordEvent { .. } | Op::WaitEvent { .. }
            ) {
                continue;
            }
            let results = if let Some(group) = n.op.group() {
                self.collective_results(n, group, &vals)?
            } else {
                self.local_results(n, &transposed, &vals)?
            };
            for (r, outs) in results.into_iter().enumerate() {
                for (&o, t) in n.outputs.iter().zip(outs) {
                    vals[r][o.index()] = Some(t);
                }
            }
        }
        let outs = p
            .outputs
            .iter()
            .map(|&o| {
                (
                    p.value(o).name.clone(),
                    vals[0][o.index()].clone().expect("computed"),
                )
            })
            .collect();
        self.apply_updates(&mut vals)?;
        Ok(outs)
    }

    /// Each rank's values at the start of a step: its rows of every input (a scalar input
    /// whole), its persistent tensors and the constants.
    fn step_values(&self, global: &[(String, Tensor)]) -> Result<RankValues, EvalError> {
        let p = &self.program;
        let w = self.mesh.world_size();
        let nv = p.values.len();
        let mut vals: RankValues = vec![vec![None; nv]; w];
        for &i in &p.inputs {
            let v = p.value(i);
            let (_, t) =
                global
                    .iter()
                    .find(|(k, _)| *k == v.name)
                    .ok_or_else(|| EvalError::InputNames {
                        missing: vec![v.name.clone()],
                        unexpected: vec![],
                        duplicate: vec![],
                    })?;
            if v.ty.rank() == 0 {
                // a scalar (the learning rate) is every rank's
                if t.ty() != v.ty {
                    return Err(EvalError::InputType {
                        name: v.name.clone(),
                        expected: v.ty.clone(),
                        got: t.ty(),
                    });
                }
                for rv in vals.iter_mut() {
                    rv[i.index()] = Some(t.clone());
                }
                continue;
            }
            let b = v.ty.shape.first().copied().unwrap_or(1);
            if t.shape.first().copied() != Some(b * w) || t.shape[1..] != v.ty.shape[1..] {
                let mut want = v.ty.shape.clone();
                if let Some(d) = want.first_mut() {
                    *d *= w;
                }
                return Err(EvalError::InputType {
                    name: v.name.clone(),
                    expected: hzp_ir::TensorType::new(v.ty.dtype, want),
                    got: t.ty(),
                });
            }
            for (r, rv) in vals.iter_mut().enumerate() {
                let sl = Op::Slice {
                    axes: vec![0],
                    starts: vec![(r * b) as i64],
                    ends: vec![((r + 1) * b) as i64],
                    steps: vec![1],
                };
                let part = eval_op(&sl, &[t]).map_err(malformed)?.remove(0);
                rv[i.index()] = Some(part);
            }
        }
        for (r, rv) in vals.iter_mut().enumerate() {
            for (k, &v) in self.slots.iter().enumerate() {
                rv[v.index()] = Some(self.persistent[r][k].clone());
            }
            for c in &p.consts {
                rv[c.value.index()] = Some(c.data.clone());
            }
        }
        Ok(vals)
    }

    /// Each rank's result of collective node `n` on `group`.
    fn collective_results(
        &self,
        n: &Node,
        group: &hzp_ir::Group,
        vals: &RankValues,
    ) -> Result<Vec<Vec<Tensor>>, EvalError> {
        let x = n.inputs[0];
        (0..self.mesh.world_size())
            .map(|r| {
                let members = self
                    .mesh
                    .group_members(group, r)
                    .ok_or_else(|| node_err(n, format!("group {group} is not in the mesh")))?;
                let ins: Vec<&Tensor> = members
                    .iter()
                    .map(|&m| vals[m][x.index()].as_ref().expect("computed"))
                    .collect();
                let idx = self.mesh.group_index(group, r).unwrap_or(0);
                collective(&n.op, &ins, idx)
                    .map(|t| vec![t])
                    .map_err(|m| node_err(n, m))
            })
            .collect()
    }

    /// Each rank's results of the non-collective node `n`; a MatMul reads a transposed
    /// operand (`transposed[node]`: the node is one) through a view of its stored input.
    fn local_results(
        &self,
        n: &Node,
        transposed: &[bool],
        vals: &RankValues,
    ) -> Result<Vec<Vec<Tensor>>, EvalError> {
        let p = &self.program;
        let stored_transposed = |v: ValueId| {
            p.producer(v)
                .filter(|t| transposed[t.index()])
                .map(|t| p.nodes[t.index()].inputs[0])
        };
        let node_err = |m: String| node_err(n, m);
        let stored: Vec<Option<ValueId>> = match n.op {
            Op::MatMul => n.inputs.iter().map(|&v| stored_transposed(v)).collect(),
            _ => vec![],
        };
        (0..self.mesh.world_size())
            .map(|r| {
                let get = |v: ValueId| vals[r][v.index()].as_ref().expect("computed");
                if stored.iter().any(Option::is_some) {
                    // each operand: its own tensor, or the transpose's input read swapped
                    let operand = |k: usize| match stored[k] {
                        Some(x) => (get(x), Some(get(x).shape.as_slice())),
                        None => (get(n.inputs[k]), None),
                    };
                    let ((ta, sa), (tb, sb)) = (operand(0), operand(1));
                    let mut out = Tensor::zeros(p.ty(n.outputs[0]));
                    crate::cpu::matmul::matmul_stored(
                        (
                            DataRef::of(&ta.data),
                            p.ty(n.inputs[0]).shape.as_slice(),
                            sa,
                        ),
                        (
                            DataRef::of(&tb.data),
                            p.ty(n.inputs[1]).shape.as_slice(),
                            sb,
                        ),
                        &mut DataMut::of(&mut out.data),
                        &mut Workspace::new(),
                    )
                    .map_err(node_err)?;
                    return Ok(vec![out]);
                }
                let ins: Vec<&Tensor> = n.inputs.iter().map(|&v| get(v)).collect();
                eval_op(&n.op, &ins).map_err(node_err)
            })
            .collect()
    }

    /// The program's updates, on every rank: each target's persistent tensor takes its
    /// new value.
    fn apply_updates(&mut self, vals: &mut RankValues) -> Result<(), EvalError> {
        let p = &self.program;
        for (r, rv) in vals.iter_mut().enumerate() {
            for u in &p.updates {
                let k = self
                    .slots
                    .iter()
                    .position(|&s| s == u.target)
                    .ok_or_else(|| malformed("update of a value that is not persistent"))?;
                self.persistent[r][k] = rv[u.value.index()].take().expect("computed");
                // an update value read again by another update stays available
                rv[u.value.index()] = Some(self.persistent[r][k].clone());
            }
        }
        Ok(())
    }

    /// The full parameters, put back together from the ranks' master shards.
    pub fn full_parameters(&self) -> Vec<(String, Tensor)> {
        self.layouts
            .iter()
            .filter_map(|l| {
                let k = self
                    .slots
                    .iter()
                    .position(|&s| self.program.value(s).name == l.name)?;
                debug_assert_eq!(self.program.value(self.slots[k]).def, ValueDef::Param);
                let members = self.mesh.group_members(&l.optim_group, 0)?;
                let mut flat: Vec<f32> = Vec::with_capacity(l.padded);
                for m in members {
                    flat.extend(self.persistent[m][k].to_f32_vec());
                }
                flat.truncate(l.numel);
                Some((l.name.clone(), Tensor::f32(l.shape.clone(), flat)))
            })
            .collect()
    }
}

fn add(a: &Tensor, b: &Tensor) -> Result<Tensor, String> {
    Ok(eval_op(&Op::Binary(BinaryOp::Add), &[a, b])?.remove(0))
}

/// One rank's result of a collective, given its group's inputs in group order and its index.
fn collective(op: &Op, ins: &[&Tensor], idx: usize) -> Result<Tensor, String> {
    let n = ins.len();
    let reduce = |how: ReduceOp| -> Result<Tensor, String> {
        let bop = match how {
            ReduceOp::Sum | ReduceOp::Mean => BinaryOp::Add,
            ReduceOp::Max => BinaryOp::Max,
            ReduceOp::Min => BinaryOp::Min,
            ReduceOp::Prod => BinaryOp::Mul,
        };
        let mut acc = ins[0].clone();
        for t in &ins[1..] {
            acc = if bop == BinaryOp::Add {
                add(&acc, t)?
            } else {
                eval_op(&Op::Binary(bop), &[&acc, t])?.remove(0)
            };
        }
        if how == ReduceOp::Mean {
            let s = Tensor::from_f64(acc.dtype(), Vec::<usize>::new(), &[1.0 / n as f64]);
            acc = eval_op(&Op::Binary(BinaryOp::Mul), &[&acc, &s])?.remove(0);
        }
        Ok(acc)
    };
    let piece = |t: &Tensor, axis: usize, parts: usize, i: usize| -> Result<Tensor, String> {
        let len = t.shape[axis] / parts;
        Ok(eval_op(
            &Op::Slice {
                axes: vec![axis],
                starts: vec![(i * len) as i64],
                ends: vec![((i + 1) * len) as i64],
                steps: vec![1],
            },
            &[t],
        )?
        .remove(0))
    };
    match op {
        Op::AllGather { axis, .. } => Ok(eval_op(&Op::Concat { axis: *axis }, ins)?.remove(0)),
        Op::ReduceScatter {
            axis, reduce: how, ..
        } => piece(&reduce(*how)?, *axis, n, idx),
        Op::AllReduce { reduce: how, .. } => reduce(*how),
        Op::AllToAll {
            split_axis,
            concat_axis,
            ..
        } => {
            let parts: Vec<Tensor> = ins
                .iter()
                .map(|t| piece(t, *split_axis, n, idx))
                .collect::<Result<_, _>>()?;
            let refs: Vec<&Tensor> = parts.iter().collect();
            Ok(eval_op(&Op::Concat { axis: *concat_axis }, &refs)?.remove(0))
        }
        Op::Broadcast { root, .. } => Ok(ins[*root].clone()),
        other => Err(format!("{} is not a collective", other.name())),
    }
}
