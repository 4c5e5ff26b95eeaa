//! The evaluation plan: a forward+loss program (what `hzp run --val-data` evaluates) as a
//! plan for one rank that the plan executors load like a training plan.
//!
//! [`eval_plan`] puts the program on the mesh `gpu=1` and gives every parameter the form a
//! training plan gives its master shard: an fp32 vector of all its elements, cut by a
//! [`ParamLayout`] over a group of one rank (so the whole parameter). A reshape (and, for a
//! parameter of another dtype, a cast) at the head of the program turns it back into the
//! tensor the forward reads. There are no collectives, no states and no updates: the
//! parameters are read, never written, and a step computes the outputs (the loss first).
//! The arena comes from the memory planner ([`super::memory::plan_memory`]) with the
//! compile's buffer kinds. Deterministic: the same program gives the same plan.

use super::memory;
use hzp_ir::plan::{Plan, ShardGroups};
use hzp_ir::{DType, Group, Mesh, Op, ParamLayout, Program, TensorType, ValueId};

/// The strategy an evaluation plan records.
pub const EVAL_STRATEGY: &str = "eval";

/// The plan of one rank that runs `fwd` (a forward+loss program without states or updates)
/// with its parameters fed whole as fp32 vectors (`f32[numel]`, named as in `fwd`); `model`
/// is recorded as the plan's model. Parameter data of `fwd` is left out of the plan: the
/// executor is given the parameters.
pub fn eval_plan(fwd: &Program, model: &str) -> Result<Plan, String> {
    if !fwd.states.is_empty() || !fwd.updates.is_empty() {
        return Err(format!(
            "the evaluation program `{}` keeps states or updates; it must be forward and loss only",
            fwd.name
        ));
    }
    if fwd.outputs.is_empty() {
        return Err(format!(
            "the evaluation program `{}` has no output (its loss)",
            fwd.name
        ));
    }
    if let Some(n) = fwd.nodes.iter().find(|n| n.op.is_collective()) {
        return Err(format!(
            "the evaluation program `{}` has a collective (`{}`); it runs on one rank",
            fwd.name, n.name
        ));
    }
    let mesh = Mesh::parse("gpu=1")?;
    let mut p = fwd.clone();
    p.mesh = Some(mesh.clone());
    let layouts = flatten_params(&mut p)?;
    let kinds = |v: ValueId| crate::compile::buffer_kind(&p, v);
    let mem = memory::plan_memory(&p, &kinds, &memory::default_persistent(&p));
    let whole = Group::new(["gpu"]);
    let groups = ShardGroups {
        params: whole.clone(),
        grads: whole.clone(),
        optim: whole,
    };
    let mut plan = Plan::assemble(
        model,
        EVAL_STRATEGY,
        mesh,
        groups,
        p,
        mem.arena_bytes,
        mem.buffers,
        layouts,
        1,
        String::new(),
    );
    plan.content_hash = plan.compute_hash();
    Ok(plan)
}

/// Makes each parameter of `p` an fp32 vector of its elements, read through a reshape (and
/// a cast back to its dtype) placed at the head of the program; returns the parameters'
/// layouts (one rank holds all of each).
fn flatten_params(p: &mut Program) -> Result<Vec<ParamLayout>, String> {
    let whole = Group::new(["gpu"]);
    let old_nodes = p.nodes.len();
    let mut layouts = Vec::with_capacity(p.params.len());
    let mut replace: Vec<(ValueId, ValueId)> = Vec::new();
    let params: Vec<ValueId> = p.params.iter().map(|x| x.value).collect();
    for v in params {
        let ty = p.ty(v).clone();
        let name = p.value(v).name.clone();
        let numel = ty.numel();
        p.values[v.index()].ty = TensorType::new(DType::F32, vec![numel]);
        let shaped = p.add_node(
            format!("eval/reshape/{name}"),
            Op::Reshape {
                shape: ty.shape.clone(),
            },
            vec![v],
            vec![fresh(p, &format!("eval/{name}"))],
        )?[0];
        let read = if ty.dtype == DType::F32 {
            shaped
        } else {
            p.add_node(
                format!("eval/cast/{name}"),
                Op::Cast { to: ty.dtype },
                vec![shaped],
                vec![fresh(p, &format!("eval/{name}/{}", ty.dtype.name()))],
            )?[0]
        };
        replace.push((v, read));
        layouts.push(ParamLayout {
            name: name.clone(),
            shape: ty.shape.clone(),
            numel,
            padded: numel,
            optim_group: whole.clone(),
            params_group: whole.clone(),
            compute_shard: name,
            compute_dtype: ty.dtype,
            accumulate_group: None,
            states: Vec::new(),
            expert_group: None,
        });
    }
    let map = |x: &mut ValueId| {
        if let Some((_, r)) = replace.iter().find(|(v, _)| v == x) {
            *x = *r;
        }
    };
    for n in &mut p.nodes[..old_nodes] {
        n.inputs.iter_mut().for_each(map);
    }
    p.outputs.iter_mut().for_each(map);
    for prm in &mut p.params {
        prm.data = None;
    }
    // the new nodes first: the program stays in topological order
    p.nodes.rotate_left(old_nodes);
    p.renumber_nodes();
    Ok(layouts)
}

/// A name no value of `p` has, from `base`.
fn fresh(p: &Program, base: &str) -> String {
    let mut names = hzp_ir::FreshNames::over(p);
    names.fresh(base)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hzp_ir::{BinaryOp, ReduceOp};

    fn tiny() -> Program {
        let mut p = Program::new("tiny");
        let x = p.add_input("x", TensorType::new(DType::F32, vec![2, 3]));
        let w = p.add_param("w", TensorType::new(DType::F32, vec![3, 2]), None);
        let b = p.add_param("b", TensorType::new(DType::BF16, vec![2]), None);
        let y = p
            .add_node("mm", Op::MatMul, vec![x, w], vec!["y".into()])
            .unwrap()[0];
        let bf = p
            .add_node("c", Op::Cast { to: DType::F32 }, vec![b], vec!["bf".into()])
            .unwrap()[0];
        let z = p
            .add_node(
                "add",
                Op::Binary(BinaryOp::Add),
                vec![y, bf],
                vec!["z".into()],
            )
            .unwrap()[0];
        let l = p
            .add_node(
                "loss",
                Op::Reduce {
                    op: ReduceOp::Mean,
                    axes: vec![0, 1],
                    keep_dims: false,
                },
                vec![z],
                vec!["loss".into()],
            )
            .unwrap()[0];
        p.outputs.push(l);
        p
    }

    #[test]
    fn one_rank_whole_fp32_parameters_no_collectives_verified() {
        let plan = eval_plan(&tiny(), "tiny.onnx").unwrap();
        assert_eq!(plan.mesh.world_size(), 1);
        assert_eq!(plan.program.mesh.as_ref(), Some(&plan.mesh));
        let p = &plan.program;
        assert!(p.nodes.iter().all(|n| !n.op.is_collective()));
        assert!(p.updates.is_empty() && p.states.is_empty());
        for (prm, numel) in p.params.iter().zip([6, 2]) {
            assert_eq!(*p.ty(prm.value), TensorType::new(DType::F32, vec![numel]));
            assert!(prm.data.is_none());
        }
        assert_eq!(plan.layouts.len(), 2);
        assert_eq!(plan.layouts[1].compute_dtype, DType::BF16);
        // nothing reads a parameter but its reshape
        for n in &p.nodes {
            if n.inputs
                .iter()
                .any(|v| p.params.iter().any(|x| x.value == *v))
            {
                assert!(matches!(n.op, Op::Reshape { .. }), "{}", n.name);
            }
        }
        crate::plan::verify::verify_plan(&plan, None).unwrap();
        assert_eq!(plan.content_hash, plan.compute_hash());
        // deterministic
        assert_eq!(
            eval_plan(&tiny(), "tiny.onnx").unwrap().to_json(),
            plan.to_json()
        );
    }

    #[test]
    fn refuses_a_program_with_updates() {
        let mut p = tiny();
        let w = p.params[0].value;
        let s = p.add_state("s", TensorType::new(DType::F32, vec![3, 2]), None);
        p.updates.push(hzp_ir::Update {
            target: s,
            value: w,
        });
        assert!(eval_plan(&p, "m")
            .unwrap_err()
            .contains("states or updates"));
    }
}
