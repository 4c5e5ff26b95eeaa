//! Helpers the executor tests share (each test uses some of them).
#![allow(dead_code)]

use hzp_ir::plan::{Buffer, BufferKind, Plan, ShardGroups};
use hzp_ir::{Group, Program};

/// A plan that runs `p` (which names its mesh) with every value in its own 64-byte-aligned
/// slot of the arena, one after another: no two values share bytes, so any schedule is safe.
pub fn plan_of(p: Program) -> Plan {
    let mut buffers = Vec::new();
    let mut at = 0u64;
    for (i, v) in p.values.iter().enumerate() {
        let bytes = (v.ty.numel() * v.ty.dtype.size_bytes()) as u64;
        if bytes > 0 {
            buffers.push(Buffer {
                value: hzp_ir::ValueId(i as u32),
                offset: at,
                bytes,
                kind: BufferKind::Other,
            });
            at += bytes.div_ceil(64) * 64;
        }
    }
    let mesh = p.mesh.clone().expect("the test program names its mesh");
    let none = Group::new(Vec::<String>::new());
    Plan::new(
        "test",
        "test",
        mesh,
        ShardGroups {
            params: none.clone(),
            grads: none.clone(),
            optim: none,
        },
        p,
        at,
        buffers,
    )
}

/// An executor for `p` laid out by [`plan_of`], issuing collectives as `comm` says, with
/// `inputs` set.
pub fn executor(
    p: Program,
    comm: hzp_runtime::exec::CommMode,
    inputs: &[(String, hzp_ir::Tensor)],
) -> Result<hzp_runtime::exec::Executor, String> {
    let opts = hzp_runtime::exec::ExecOptions {
        comm,
        ..hzp_runtime::exec::ExecOptions::default()
    };
    let mut ex =
        hzp_runtime::exec::Executor::new(&plan_of(p), &[], opts).map_err(|e| e.to_string())?;
    ex.set_inputs(inputs).map_err(|e| e.to_string())?;
    Ok(ex)
}
