//! The distributed half of the compiler: from a single-rank training step to the per-rank
//! (SPMD) step of a plan.
//!
//! - [`spmd`]: collective insertion (gather / reduce / accumulate / re-gather around the
//!   training step, micro-batches, recompute) and the prefetch schedule;
//! - [`rewrite`]: collective rewriting and bucketing by equality saturation, costed by
//!   [`crate::cost`];
//! - [`streams`]: stream assignment and cross-stream events, shared by both;
//! - [`acco`]: the ACCO step (ZeRO-1 layout, half-batch phases whose reduction and
//!   optimizer overlap the other half's compute), built beside `spmd` from the same pieces.
//! - [`expert`]: expert parallelism, the forward of one rank of an expert-parallel group
//!   (routed MoE layers' experts split over the group, `AllToAll` around them);
//! - [`asyncmesh`]: sparse asynchronous parameter averaging across a slow axis, added to a
//!   per-replica step `spmd` built on the other axes.
//!
//! Dependencies run one way: `spmd` -> `rewrite` -> `streams`; the sharding planner
//! ([`crate::plan::planner`]) calls into `spmd`, never the reverse.

pub mod acco;
pub mod asyncmesh;
pub mod expert;
pub mod rewrite;
pub mod spmd;
pub mod streams;

use crate::emit::Emitter;
use hzp_ir::{DType, Node, Op, Program, Role, TensorType, ValueId};

/// The payload bytes of a collective node as the reports count them (per rank, per call):
/// its largest operand (an all-gather's output, a reduce-scatter's input, an all-reduce's
/// buffer).
pub fn collective_bytes(p: &Program, n: &Node) -> u64 {
    n.inputs
        .iter()
        .chain(&n.outputs)
        .map(|&v| p.ty(v).size_bytes() as u64)
        .max()
        .unwrap_or(0)
}

/// Adds a copy of `node` (a node of `from`) reading `ins`, its own and its outputs' names
/// suffixed by `tag` (made unique), with `role`; returns the copy's outputs.
pub(crate) fn copy_node(
    e: &mut Emitter,
    from: &Program,
    node: &Node,
    ins: Vec<ValueId>,
    tag: &str,
    role: Role,
) -> Result<Vec<ValueId>, String> {
    let outs: Vec<String> = node
        .outputs
        .iter()
        .map(|&o| e.fresh(&format!("{}{tag}", from.value(o).name)))
        .collect();
    let name = e.fresh(&format!("{}{tag}", node.name));
    let got = e.p.add_node(name, node.op.clone(), ins, outs)?;
    if let Some(added) = e.p.nodes.last_mut() {
        added.role = role;
    }
    Ok(got)
}

/// A parameter held flat and zero-padded (`[padded]`) as the model reads it: the padding
/// dropped, reshaped to `shape` (`numel` elements).
pub(crate) fn unpad(
    e: &mut Emitter,
    v: ValueId,
    numel: usize,
    padded: usize,
    shape: &[usize],
) -> Result<ValueId, String> {
    let mut v = v;
    if padded > numel {
        v = e.op(
            Op::Slice {
                axes: vec![0],
                starts: vec![0],
                ends: vec![numel as i64],
                steps: vec![1],
            },
            &[v],
        )?;
    }
    e.op(
        Op::Reshape {
            shape: shape.to_vec(),
        },
        &[v],
    )
}

/// A gradient as the flat, zero-padded `[padded]` tensor its reduction cuts, in `dtype`.
pub(crate) fn flat_padded(
    e: &mut Emitter,
    v: ValueId,
    numel: usize,
    padded: usize,
    dtype: DType,
) -> Result<ValueId, String> {
    let mut v = v;
    if e.ty(v).dtype != dtype {
        v = e.op(Op::Cast { to: dtype }, &[v])?;
    }
    v = e.op(Op::Reshape { shape: vec![numel] }, &[v])?;
    if padded > numel {
        let z = e.zeros(&TensorType::new(dtype, vec![padded - numel]))?;
        v = e.op(Op::Concat { axis: 0 }, &[v, z])?;
    }
    Ok(v)
}
