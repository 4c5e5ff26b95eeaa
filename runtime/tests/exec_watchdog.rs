//! The watchdog and the flight recorder of the CPU executor, with injected faults: a rank
//! that skips a collective, issues one with the wrong bytes, or panics stops every rank
//! within the collective timeout, and the error and the flight report name the rank and
//! the collective.

mod common;
use hzp_ir::{DType, Program, Tensor};
use hzp_runtime::exec::{CommMode, ExecError, ExecOptions, Executor};
use hzp_runtime::watchdog::{CollState, Fault, FaultKind};
use std::time::{Duration, Instant};

/// Two ranks; on the all-gather stream an all-gather, then an all-reduce of its result, on
/// the reduce-scatter stream a reduce-scatter: three communicators' worth of collectives.
fn program(with_second: bool) -> Program {
    let mut src = String::from("program \"w\"\nmesh gpu=2\n\ninput %x : f32[4,6]\n\n");
    src.push_str("%a = AllGather{group=[gpu], axis=0}(%x) : f32[8,6] \"ag\" @allgather\n");
    if with_second {
        src.push_str("%b = AllReduce{group=[gpu], reduce=sum}(%a) : f32[8,6] \"ar\" @allgather\n");
    }
    src.push_str("%c = ReduceScatter{group=[gpu], axis=0, reduce=sum}(%x) : f32[2,6] \"rs\" @reducescatter\n\n");
    src.push_str("output %a\n");
    if with_second {
        src.push_str("output %b\n");
    }
    src.push_str("output %c\n");
    hzp_ir::text::parse(&src, "watchdog", &|_| None).unwrap()
}

fn inputs() -> Vec<(String, Tensor)> {
    let v: Vec<f64> = (0..48).map(|i| i as f64 * 0.25 - 3.0).collect();
    vec![("x".into(), Tensor::from_f64(DType::F32, vec![8, 6], &v))]
}

fn executor(p: Program, comm: CommMode, fault: Option<Fault>, timeout: Duration) -> Executor {
    let opts = ExecOptions {
        comm,
        collective_timeout: Some(timeout),
        fault,
        ..ExecOptions::default()
    };
    let mut ex = Executor::new(&common::plan_of(p), &[], opts).unwrap();
    ex.set_inputs(&inputs()).unwrap();
    ex
}

fn fault(kind: FaultKind, step: usize) -> Option<Fault> {
    Some(Fault {
        rank: 1,
        step,
        kind,
    })
}

#[test]
fn a_healthy_run_leaves_no_report_and_records_every_collective_completed() {
    for comm in [CommMode::Async, CommMode::Sync] {
        let mut ex = executor(program(true), comm, None, Duration::from_secs(5));
        ex.run(3).unwrap();
        assert!(ex.flight_report().is_none());
    }
}

#[test]
fn a_skipped_collective_times_out_naming_the_rank_that_did_not_issue_it() {
    // The all-reduce is the last collective of its communicator in the step: when rank 1
    // skips the all-gather (the first collective) in step 2, its all-gather stream issues the
    // all-reduce where rank 0 issues the all-gather: a mismatch, found at once.
    let t0 = Instant::now();
    let mut ex = executor(
        program(true),
        CommMode::Async,
        fault(FaultKind::SkipCollective, 2),
        Duration::from_secs(30),
    );
    let e = ex.run(3).unwrap_err().to_string();
    assert!(t0.elapsed() < Duration::from_secs(10), "{e}");
    assert!(e.contains("collective mismatch"), "{e}");
    assert!(e.contains("`ag`") && e.contains("`ar`"), "{e}");
    assert!(e.contains("rank 1"), "{e}");
    assert!(e.contains("group [gpu]") || e.contains("group gpu"), "{e}");

    // Without a second collective on the stream, rank 0 waits for an all-gather that never
    // comes: the watchdog stops the run after the timeout and names rank 1.
    let t0 = Instant::now();
    let mut ex = executor(
        program(false),
        CommMode::Async,
        fault(FaultKind::SkipCollective, 2),
        Duration::from_millis(400),
    );
    let e = ex.run(3).unwrap_err();
    let took = t0.elapsed();
    assert!(matches!(e, ExecError::Timeout(_)), "{e}");
    let e = e.to_string();
    assert!(took >= Duration::from_millis(400), "{took:?}: {e}");
    assert!(took < Duration::from_secs(5), "{took:?}: {e}");
    assert!(e.contains("collective timeout (0.4 s)"), "{e}");
    assert!(e.contains("rank 0's allgather thread has waited"), "{e}");
    assert!(e.contains("`ag` (AllGather over group"), "{e}");
    assert!(e.contains("not issued by rank 1 (1)"), "{e}");
    assert!(e.contains("192 bytes"), "{e}");

    // The flight report: rank 0's all-gather of step 2 issued and not finished; rank 1 has
    // the all-gather of step 1 only.
    let rep = ex.flight_report().expect("a report").clone();
    assert_eq!(rep.ranks.len(), 2);
    let ag = |r: usize| -> Vec<(u64, CollState)> {
        rep.ranks[r]
            .collectives
            .iter()
            .filter(|c| c.node == "ag")
            .map(|c| (c.step, c.state))
            .collect()
    };
    assert_eq!(
        ag(0),
        vec![(1, CollState::Completed), (2, CollState::Failed)]
    );
    assert_eq!(ag(1), vec![(1, CollState::Completed)]);
    let last0 = rep.ranks[0]
        .collectives
        .iter()
        .rfind(|c| c.node == "ag")
        .unwrap();
    assert_eq!(last0.members, vec![0, 1]);
    assert_eq!(last0.comm_seq, 1);
    assert_eq!(last0.bytes, 192);
    assert_eq!(last0.stream, "allgather");
    assert!(last0.started_ms.is_none());
    // the reduce-scatter of step 2 went through on both
    for r in 0..2 {
        assert!(rep.ranks[r]
            .collectives
            .iter()
            .any(|c| c.node == "rs" && c.step == 2 && c.state == CollState::Completed));
    }
}

#[test]
fn wrong_bytes_are_refused_naming_both_ranks() {
    for comm in [CommMode::Async, CommMode::Sync] {
        let mut ex = executor(
            program(true),
            comm,
            fault(FaultKind::WrongBytes, 1),
            Duration::from_secs(30),
        );
        let e = ex.run(2).unwrap_err().to_string();
        assert!(e.contains("collective mismatch"), "{e}");
        assert!(e.contains("(96 bytes in, 192 out) on rank 0"), "{e}");
        assert!(e.contains("(92 bytes in, 192 out) on rank 1"), "{e}");
        let rep = ex.flight_report().unwrap();
        for r in 0..2 {
            // the all-gather failed on both; the reduce-scatter (another communicator, which
            // the all-gather's stream does not wait for) may have gone through
            let c = &rep.ranks[r].collectives;
            let ag: Vec<_> = c.iter().filter(|c| c.node == "ag").collect();
            assert_eq!(ag.len(), 1, "{c:?}");
            assert_eq!(ag[0].state, CollState::Failed);
            assert!(c.iter().all(|c| c.node != "ar"), "{c:?}");
        }
    }
}

#[test]
fn a_panic_on_one_rank_stops_all_and_is_named() {
    for comm in [CommMode::Async, CommMode::Sync] {
        let t0 = Instant::now();
        let mut ex = executor(
            program(true),
            comm,
            fault(FaultKind::Panic, 2),
            Duration::from_secs(30),
        );
        let e = ex.run(3).unwrap_err().to_string();
        assert!(t0.elapsed() < Duration::from_secs(10));
        assert!(e.contains("rank 1's compute thread panicked"), "{e}");
        assert!(e.contains("injected fault"), "{e}");
        let rep = ex.flight_report().unwrap();
        assert!(rep.ranks[1].error.as_deref().unwrap().contains("panicked"));
        assert!(rep.ranks[0].error.is_none(), "{:?}", rep.ranks[0].error);
        // step 1 completed everywhere; on one thread, rank 1 issued nothing in step 2 (its
        // comm threads, which wait on no event of its compute thread, may have)
        for r in 0..2 {
            let c = &rep.ranks[r].collectives;
            let first: Vec<_> = c.iter().filter(|c| c.step == 1).collect();
            assert_eq!(first.len(), 3, "{c:?}");
            assert!(first.iter().all(|c| c.state == CollState::Completed));
        }
        if comm == CommMode::Sync {
            assert!(rep.ranks[1].collectives.iter().all(|c| c.step == 1));
        }
    }
}

#[test]
fn a_fault_for_a_rank_the_plan_lacks_is_refused() {
    let opts = ExecOptions {
        fault: Some(Fault {
            rank: 2,
            step: 1,
            kind: FaultKind::Hang,
        }),
        ..ExecOptions::default()
    };
    let e = match Executor::new(&common::plan_of(program(true)), &[], opts) {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("names rank 2, the plan has 2 ranks"), "{e}");
}
