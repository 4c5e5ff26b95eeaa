//! The step loop takes tensor memory only from the arena: with a counting allocator, what
//! the executor allocates per step (beyond the first, warm-up, step of a run) does not grow
//! with the tensors, for elementwise kernels and collectives on both comm streams.

mod common;
use hzp_ir::Tensor;
use hzp_runtime::exec::{CommMode, Executor};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

struct Counting;
static BYTES: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        BYTES.fetch_add(l.size() as u64, Ordering::Relaxed);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        BYTES.fetch_add(n as u64, Ordering::Relaxed);
        System.realloc(p, l, n)
    }
}

#[global_allocator]
static A: Counting = Counting;

fn executor(n: usize, comm: CommMode) -> Executor {
    let src = format!(
        r#"program "a"
mesh gpu=2

input %x : f32[{n}]
state %s : f32[{n}]
const %h : f32[] = [0.5]

%a = Mul(%x, %h) : f32[{n}] "a"
%b = Tanh(%a) : f32[{n}] "b"
RecordEvent{{event=0}}() "record0"
WaitEvent{{event=0}}() "wait0" @allgather
%g = AllGather{{group=[gpu], axis=0}}(%b) : f32[{m}] "g" @allgather
RecordEvent{{event=1}}() "record1" @allgather
WaitEvent{{event=1}}() "wait1" @reducescatter
%r = ReduceScatter{{group=[gpu], axis=0, reduce=sum}}(%g) : f32[{n}] "r" @reducescatter
RecordEvent{{event=2}}() "record2" @reducescatter
WaitEvent{{event=2}}() "wait2"
%t = Add(%r, %s) : f32[{n}] "t"
%c = Copy(%t) : f32[{n}] "c"

output %c
update %s = %t
"#,
        m = 2 * n
    );
    let p = hzp_ir::text::parse(&src, "alloc", &|_| None).unwrap();
    let x = Tensor::f32(vec![2 * n], (0..2 * n).map(|i| i as f32 * 1e-3).collect());
    common::executor(p, comm, &[("x".to_string(), x)]).unwrap()
}

/// Bytes allocated by `run(steps)`.
fn allocated(ex: &mut Executor, steps: usize) -> u64 {
    let before = BYTES.load(Ordering::Relaxed);
    ex.run(steps).unwrap();
    BYTES.load(Ordering::Relaxed) - before
}

#[test]
fn steps_allocate_nothing_that_grows_with_tensor_sizes() {
    for comm in [CommMode::Async, CommMode::Sync] {
        let mut per_step = Vec::new();
        for n in [1 << 10, 1 << 18] {
            let mut ex = executor(n, comm);
            let short = allocated(&mut ex, 2);
            let long = allocated(&mut ex, 10);
            // 8 more steps; per step, a few stats entries at most
            per_step.push(long.saturating_sub(short) / 8);
        }
        let tensor_bytes = 4u64 << 18;
        eprintln!("{comm:?}: bytes allocated per step for 4 KiB and 1 MiB tensors: {per_step:?}");
        assert!(
            per_step[1] <= per_step[0] + 1024 && per_step[1] < tensor_bytes / 16,
            "{comm:?}: per-step allocation grows with the tensors: {per_step:?}"
        );
    }
}
