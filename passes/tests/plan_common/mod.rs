//! Helpers shared by the plan tests: programs written in the text form, plans from them.
#![allow(dead_code)]

use hzp_ir::*;
use hzp_passes::plan::memory::{default_kind, default_persistent, plan_memory, MemoryPlan};

pub fn parse(src: &str) -> Program {
    text::parse(src, "t.hzp", &|_| None).unwrap_or_else(|e| panic!("{e}\n{src}"))
}

pub fn plan_mem(p: &Program) -> MemoryPlan {
    plan_memory(p, &default_kind(p), &default_persistent(p))
}

/// A plan of `p` with the memory planner's buffers.
pub fn plan_of(p: Program) -> Plan {
    let m = plan_mem(&p);
    let mesh = p
        .mesh
        .clone()
        .unwrap_or_else(|| Mesh::parse("gpu=4").unwrap());
    Plan::new(
        "t.hzp",
        "asynchzp",
        mesh,
        ShardGroups {
            params: Group::new(["gpu"]),
            grads: Group::new(["gpu"]),
            optim: Group::new(["gpu"]),
        },
        p,
        m.arena_bytes,
        m.buffers,
    )
}

pub fn offset(plan: &MemoryPlan, p: &Program, name: &str) -> u64 {
    let v = p
        .find_value(name)
        .unwrap_or_else(|| panic!("no value {name}"));
    plan.buffers
        .iter()
        .find(|b| b.value == v)
        .unwrap_or_else(|| panic!("no buffer for {name}"))
        .offset
}

/// The good two-stream program: parameters gathered on the all-gather stream ahead of use,
/// each use behind a wait on the gather's event, each gathered copy freed after use.
pub const TWO_STREAMS: &str = r#"program "two_streams"
mesh gpu=4

input %x : f32[8,4]
param %w0 : f32[2,4]
param %w1 : f32[2,4]
%ag0 = AllGather{group=[gpu], axis=0}(%w0) "ag0" @allgather
RecordEvent{event=1}() "rec0" @allgather
%ag1 = AllGather{group=[gpu], axis=0}(%w1) "ag1" @allgather
RecordEvent{event=2}() "rec1" @allgather
WaitEvent{event=1}() "wait0"
%mul0 = Mul(%x, %ag0) "mul0"
Free(%ag0) "free0"
WaitEvent{event=2}() "wait1"
%mul1 = Mul(%mul0, %ag1) "mul1"
Free(%ag1) "free1"
%y = Relu(%mul1) "relu"

output %y
"#;

/// `src` with `from` replaced by `to` (which must occur).
pub fn edit(src: &str, from: &str, to: &str) -> String {
    assert!(src.contains(from), "`{from}` not in the program");
    src.replacen(from, to, 1)
}
