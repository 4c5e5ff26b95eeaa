//! RecordEvent / WaitEvent are real synchronisation between a rank's stream threads: the
//! all-gather stream must wait for a value the compute stream produces only after slow
//! matrix products, and the compute stream must wait for the gather. The value changes every
//! step, so a wait that did not hold would gather last step's value.

mod common;
use common::plan_of;
use hzp_ir::{DType, Tensor};
use hzp_runtime::exec::{CommMode, ExecOptions, Executor};

const SRC: &str = r#"program "ev"
mesh gpu=2

input %x : f32[96,96]
input %id : f32[1,96]
state %s : f32[96,96]
const %one : f32[] = [1.0]
const %zero : f32[] = [0.0]

%m1 = MatMul(%x, %x) : f32[96,96] "mm1"
%m2 = MatMul(%m1, %x) : f32[96,96] "mm2"
%m3 = MatMul(%m2, %x) : f32[96,96] "mm3"
%m4 = MatMul(%m3, %x) : f32[96,96] "mm4"
%z = Mul(%m4, %zero) : f32[96,96] "z"
%t = Add(%s, %one) : f32[96,96] "t"
%u = Add(%t, %z) : f32[96,96] "u"
%a = Add(%u, %id) : f32[96,96] "a"
RecordEvent{event=0}() "record0"
WaitEvent{event=0}() "wait0" @allgather
%g = AllGather{group=[gpu], axis=0}(%a) : f32[192,96] "g" @allgather
RecordEvent{event=1}() "record1" @allgather
WaitEvent{event=1}() "wait1"
%out = Mul(%g, %one) : f32[192,96] "out"

output %out
update %s = %t
"#;

fn inputs() -> Vec<(String, Tensor)> {
    vec![
        (
            "x".to_string(),
            Tensor::f32(vec![192, 96], vec![0.01; 192 * 96]),
        ),
        (
            "id".to_string(),
            Tensor::f32(
                vec![2, 96],
                (0..192).map(|i| (i / 96) as f32 * 100.0).collect(),
            ),
        ),
    ]
}

fn check(comm: CommMode) {
    let p = hzp_ir::text::parse(SRC, "ev", &|_| None).unwrap();
    let mut ex = common::executor(p, comm, &inputs()).unwrap();
    for step in 1..=20 {
        let st = ex.step().unwrap();
        assert_eq!(st.step, step);
        for r in 0..2 {
            let out = ex.outputs(r).remove(0).1.to_f64_vec();
            // rows 0..96 come from rank 0 (step), rows 96..192 from rank 1 (step + 100)
            for (k, v) in out.iter().enumerate() {
                let want = step as f64 + if k >= 96 * 96 { 100.0 } else { 0.0 };
                assert_eq!(*v, want, "{comm:?} step {step}, rank {r}, element {k}");
            }
        }
        if comm == CommMode::Async {
            // the compute stream waited on the gather at least once in a while; the gather
            // stream was busy with it
            assert!(st.busy[1] > std::time::Duration::ZERO);
        }
    }
}

#[test]
fn comm_stream_waits_for_compute_and_compute_for_comm() {
    check(CommMode::Async);
}

#[test]
fn sync_mode_runs_everything_in_program_order() {
    check(CommMode::Sync);
}

#[test]
fn plans_with_broken_events_are_refused() {
    // a wait on an event nothing records
    let bad = SRC.replace("RecordEvent{event=0}() \"record0\"\n", "");
    let p = hzp_ir::text::parse(&bad, "ev", &|_| None).unwrap();
    let e = Executor::new(&plan_of(p), &[], ExecOptions::default())
        .err()
        .unwrap();
    assert!(e.to_string().contains("nothing records"), "{e}");
    // a wait before its record
    let bad = SRC.replace(
        "%m1 = MatMul",
        "WaitEvent{event=1}() \"early\"\n%m1 = MatMul",
    );
    let p = hzp_ir::text::parse(&bad, "ev", &|_| None).unwrap();
    let e = Executor::new(&plan_of(p), &[], ExecOptions::default())
        .err()
        .unwrap();
    assert!(e.to_string().contains("before it is recorded"), "{e}");
    // a buffer outside the arena
    let p = hzp_ir::text::parse(SRC, "ev", &|_| None).unwrap();
    let mut plan = plan_of(p);
    plan.buffers[0].offset = plan.arena_bytes;
    let e = Executor::new(&plan, &[], ExecOptions::default())
        .err()
        .unwrap();
    assert!(e.to_string().contains("arena"), "{e}");
}

#[test]
fn a_missing_or_misshapen_input_is_an_error_naming_it() {
    let p = hzp_ir::text::parse(SRC, "ev", &|_| None).unwrap();
    let mut ex = Executor::new(&plan_of(p), &[], ExecOptions::default()).unwrap();
    let e = ex.set_inputs(&inputs()[..1]).err().unwrap().to_string();
    assert!(e.contains("`id`"), "{e}");
    let mut wrong = inputs();
    wrong[0].1 = Tensor::f32(vec![96, 96], vec![0.0; 96 * 96]);
    let e = ex.set_inputs(&wrong).err().unwrap().to_string();
    assert!(e.contains("f32[192,96]"), "{e}");
    let _ = DType::F32;
}
