//! The plan verifier: accepts a good two-stream plan and rejects each broken variant with a
//! message that names the ops.

mod plan_common;

use hzp_ir::*;
use hzp_passes::plan::verify::{
    verify_plan, verify_plan_with, Check, PlanViolation, VerifyOptions,
};
use plan_common::*;

fn violations(plan: &Plan, budget: Option<u64>) -> Vec<PlanViolation> {
    match verify_plan(plan, budget) {
        Ok(()) => panic!("the plan was accepted:\n{}", plan.to_text()),
        Err(v) => v,
    }
}

/// The violation of `check` that names all of `nodes`; panics listing what there was.
fn find<'a>(v: &'a [PlanViolation], check: Check, nodes: &[&str]) -> &'a PlanViolation {
    v.iter()
        .find(|x| {
            x.check == check
                && nodes.iter().all(|n| {
                    x.nodes.iter().any(|m| m == n) && x.message.contains(&format!("`{n}`"))
                })
        })
        .unwrap_or_else(|| panic!("no {check:?} violation naming {nodes:?} in {v:#?}"))
}

#[test]
fn a_good_two_stream_plan_is_accepted() {
    let plan = plan_of(parse(TWO_STREAMS));
    verify_plan(&plan, None).unwrap_or_else(|v| panic!("{v:#?}"));
    verify_plan(&plan, Some(plan.arena_bytes)).unwrap_or_else(|v| panic!("{v:#?}"));
    // and still after a trip through plan.json
    let back = Plan::from_json(&plan.to_json(), "plan.json").unwrap();
    verify_plan(&back, Some(plan.arena_bytes)).unwrap_or_else(|v| panic!("{v:#?}"));
}

#[test]
fn a_missing_wait_is_rejected() {
    let src = edit(TWO_STREAMS, "WaitEvent{event=1}() \"wait0\"\n", "");
    let v = violations(&plan_of(parse(&src)), None);
    let x = find(&v, Check::Materialized, &["mul0", "ag0"]);
    assert_eq!(
        x.message,
        "`mul0` (Mul on compute) reads %ag0, produced by `ag0` (AllGather on allgather), with \
         no event ordering them: record an event on allgather after `ag0` and wait on it on \
         compute before `mul0`"
    );
    find(&v, Check::Materialized, &["free0", "ag0"]);
    // the value read after the wait on event 2 is fine
    assert!(!v
        .iter()
        .any(|x| x.nodes.contains(&"mul1".to_string()) && x.check == Check::Materialized));
}

#[test]
fn a_wait_on_an_unrecorded_event_is_rejected() {
    let src = edit(TWO_STREAMS, "WaitEvent{event=1}()", "WaitEvent{event=7}()");
    let v = violations(&plan_of(parse(&src)), None);
    let x = find(&v, Check::Event, &["wait0"]);
    assert_eq!(
        x.message,
        "`wait0` (WaitEvent on compute) waits on event 7, which no node records"
    );
    // and so nothing orders the read
    find(&v, Check::Materialized, &["mul0", "ag0"]);
}

#[test]
fn an_event_recorded_twice_is_rejected() {
    let src = edit(
        TWO_STREAMS,
        "RecordEvent{event=2}() \"rec1\" @allgather\n",
        "RecordEvent{event=2}() \"rec1\" @allgather\nRecordEvent{event=1}() \"again\" @allgather\n",
    );
    let v = violations(&plan_of(parse(&src)), None);
    let x = find(&v, Check::Event, &["rec0", "again"]);
    assert_eq!(
        x.message,
        "event 1 is recorded twice in a step, by `rec0` (RecordEvent on allgather) and by \
         `again` (RecordEvent on allgather)"
    );
}

#[test]
fn a_wait_before_its_record_is_rejected() {
    let src = edit(
        TWO_STREAMS,
        "input %x : f32[8,4]\n",
        "input %x : f32[8,4]\nWaitEvent{event=2}() \"early\"\n",
    );
    let v = violations(&plan_of(parse(&src)), None);
    let x = find(&v, Check::Event, &["early", "rec1"]);
    assert!(x.message.contains("deadlock"), "{}", x.message);
}

#[test]
fn overlapping_buffers_with_concurrent_lifetimes_are_rejected() {
    let mut plan = plan_of(parse(TWO_STREAMS));
    let p = &plan.program;
    let (ag0, ag1) = (p.find_value("ag0").unwrap(), p.find_value("ag1").unwrap());
    let at = plan.buffers.iter().find(|b| b.value == ag0).unwrap().offset;
    // ag1 is gathered on the all-gather stream while mul0 may still read ag0 on compute
    plan.buffers
        .iter_mut()
        .find(|b| b.value == ag1)
        .unwrap()
        .offset = at;
    let v = violations(&plan, None);
    assert_eq!(v.len(), 2, "{v:#?}");
    let x = find(&v, Check::Buffer, &["mul0", "ag1"]);
    assert_eq!(
        x.message,
        format!(
            "the buffers of %ag0 and %ag1 share bytes {at}..{}, and `mul0` (Mul on compute) \
             reads %ag0 with no ordering before `ag1` (AllGather on allgather) writes %ag1",
            at + 128
        )
    );
    // the planner put mul1 on ag0's bytes: an op that overwrites its own input
    let x = find(&v, Check::Buffer, &["mul1"]);
    assert!(
        x.message
            .ends_with("`mul1` (Mul on compute) reads %ag1 while it writes %mul1 over it"),
        "{}",
        x.message
    );

    // a parameter's bytes are never free
    let mut plan = plan_of(parse(TWO_STREAMS));
    let y = plan.program.find_value("y").unwrap();
    let w0 = plan.program.find_value("w0").unwrap();
    let at = plan.buffers.iter().find(|b| b.value == w0).unwrap().offset;
    plan.buffers
        .iter_mut()
        .find(|b| b.value == y)
        .unwrap()
        .offset = at;
    let v = violations(&plan, None);
    assert!(
        v.iter().any(|x| x.check == Check::Buffer
            && x.message
                .contains("%w0 is a parameter, which lives for the whole step")),
        "{v:#?}"
    );
}

#[test]
fn a_buffer_that_starts_before_a_parameter_and_runs_into_it_is_rejected() {
    // The overlap check meets each pair from the side that starts later; this one starts
    // before the parameter's bytes and ends inside them.
    let mut plan = plan_of(parse(TWO_STREAMS));
    let y = plan.program.find_value("y").unwrap();
    let y_bytes = plan.buffers.iter().find(|b| b.value == y).unwrap().bytes;
    assert!(y_bytes > 4);
    let w0 = plan.program.find_value("w0").unwrap();
    let at = plan.buffers.iter().find(|b| b.value == w0).unwrap().offset;
    // Room below the parameter: move everything up past y's size first.
    for b in plan.buffers.iter_mut() {
        b.offset += y_bytes;
    }
    plan.arena_bytes += y_bytes;
    plan.buffers
        .iter_mut()
        .find(|b| b.value == y)
        .unwrap()
        .offset = at + y_bytes - 4;
    let v = violations(&plan, None);
    assert!(
        v.iter().any(|x| x.check == Check::Buffer
            && x.message
                .contains("%w0 is a parameter, which lives for the whole step")),
        "{v:#?}"
    );
}

#[test]
fn broken_buffer_tables_are_rejected() {
    let base = plan_of(parse(TWO_STREAMS));
    let x = base.program.find_value("x").unwrap();
    let mut plan = base.clone();
    plan.buffers.retain(|b| b.value != x);
    let v = violations(&plan, None);
    assert!(
        v[0].message.contains("%x (f32[8,4]) has no buffer"),
        "{v:#?}"
    );

    let mut plan = base.clone();
    plan.buffers[0].bytes = 4;
    let v = violations(&plan, None);
    assert!(v[0].message.contains("holds 4 bytes"), "{v:#?}");

    let mut plan = base.clone();
    plan.arena_bytes -= 64;
    let v = violations(&plan, None);
    assert!(v[0].message.contains("lies outside the arena"), "{v:#?}");

    let mut plan = base.clone();
    plan.buffers.push(Buffer {
        value: ValueId(999),
        offset: 0,
        bytes: 4,
        kind: BufferKind::Other,
    });
    let v = violations(&plan, None);
    assert!(v[0].message.contains("refers to value 999"), "{v:#?}");
}

#[test]
fn a_collective_on_an_axis_not_in_the_mesh_is_rejected() {
    let mut plan = plan_of(parse(TWO_STREAMS));
    plan.program.nodes[2].op = Op::AllGather {
        group: Group::new(["tpu"]),
        axis: 0,
    };
    let v = violations(&plan, None);
    let x = find(&v, Check::Collective, &["ag1"]);
    assert_eq!(
        x.message,
        "`ag1` (AllGather on allgather) runs on group [tpu], which names axis `tpu` that the \
         mesh gpu=4 does not have"
    );

    let mut plan = plan_of(parse(TWO_STREAMS));
    plan.groups.optim = Group::new(["node", "gpu"]);
    let v = violations(&plan, None);
    assert_eq!(
        v[0].message,
        "the optimizer group O [node,gpu] names axis `node` that the mesh gpu=4 does not have"
    );
    assert_eq!(v[0].check, Check::Groups);
}

/// The second gather moves to the reduce-scatter stream.
fn two_comm_streams(ordered: bool) -> String {
    let mut src = edit(
        TWO_STREAMS,
        "%ag1 = AllGather{group=[gpu], axis=0}(%w1) \"ag1\" @allgather\nRecordEvent{event=2}() \"rec1\" @allgather\n",
        "%ag1 = AllGather{group=[gpu], axis=0}(%w1) \"ag1\" @reducescatter\nRecordEvent{event=2}() \"rec1\" @reducescatter\n",
    );
    if ordered {
        src = edit(
            &src,
            "%ag1 = AllGather",
            "WaitEvent{event=1}() \"rs_waits\" @reducescatter\n%ag1 = AllGather",
        );
    }
    src
}

#[test]
fn same_group_collectives_on_different_streams_need_an_order() {
    let v = violations(&plan_of(parse(&two_comm_streams(false))), None);
    assert_eq!(v.len(), 1, "{v:#?}");
    let x = find(&v, Check::Collective, &["ag0", "ag1"]);
    assert_eq!(
        x.message,
        "`ag0` (AllGather on allgather) and `ag1` (AllGather on reducescatter) run on the same \
         ranks ([gpu] and [gpu]) on different streams with no event ordering them: ranks may \
         match them in different orders and hang"
    );
    // ordered by an event: fine
    let plan = plan_of(parse(&two_comm_streams(true)));
    verify_plan(&plan, None).unwrap_or_else(|v| panic!("{v:#?}"));
    // with a communicator per stream, streams never match each other's collectives
    let opts = VerifyOptions {
        budget: None,
        communicator_per_stream: true,
    };
    verify_plan_with(&plan_of(parse(&two_comm_streams(false))), &opts)
        .unwrap_or_else(|v| panic!("{v:#?}"));
}

#[test]
fn a_read_after_free_is_rejected() {
    let src = edit(TWO_STREAMS, "Free(%ag0) \"free0\"\n", "");
    let src = edit(
        &src,
        "%mul0 = Mul(%x, %ag0) \"mul0\"\n",
        "Free(%ag0) \"free0\"\n%mul0 = Mul(%x, %ag0) \"mul0\"\n",
    );
    let v = violations(&plan_of(parse(&src)), None);
    let x = find(&v, Check::Free, &["mul0", "free0"]);
    assert_eq!(
        x.message,
        "`mul0` (Mul on compute) reads %ag0 after `free0` (Free on compute) freed it"
    );

    let src = edit(TWO_STREAMS, "Free(%ag0) \"free0\"", "Free(%w0) \"free0\"");
    let v = violations(&plan_of(parse(&src)), None);
    find(&v, Check::Free, &["free0"]);
    assert!(v[0].message.contains("%w0, a parameter"), "{v:#?}");
}

#[test]
fn the_budget_is_enforced_with_the_numbers() {
    let plan = plan_of(parse(TWO_STREAMS));
    assert!(verify_plan(&plan, Some(plan.arena_bytes)).is_ok());
    let budget = plan.arena_bytes - 64;
    let v = violations(&plan, Some(budget));
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].check, Check::Budget);
    assert_eq!(
        v[0].message,
        format!(
            "the plan needs {} ({} bytes) of memory per rank, over the budget of {} ({budget} \
             bytes) by 64 B",
            format_bytes(plan.arena_bytes),
            plan.arena_bytes,
            format_bytes(budget)
        )
    );
    // human units for large numbers
    let mut big = plan.clone();
    big.arena_bytes = 90 << 30;
    let v = violations(&big, Some(80 << 30));
    let budget_msg = v.iter().find(|x| x.check == Check::Budget).unwrap();
    assert!(
        budget_msg
            .message
            .starts_with("the plan needs 90.0 GiB (96636764160 bytes) of memory per rank, over the budget of 80.0 GiB"),
        "{}",
        budget_msg.message
    );
}

#[test]
fn a_program_that_does_not_verify_is_reported_not_a_panic() {
    let mut plan = plan_of(parse(TWO_STREAMS));
    plan.program.nodes[4].inputs = vec![ValueId(12345)];
    let v = violations(&plan, None);
    assert_eq!(v[0].check, Check::Program);
    assert!(v[0].message.contains("missing value"), "{v:#?}");
}
