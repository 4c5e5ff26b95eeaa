//! The local device communicator's transport plan (`cuda::transport`), run on host bytes,
//! gives the CPU communicator's results bit for bit: every collective kind, every dtype and
//! reduction, groups of 1 to 5 members, odd chunk sizes. Also: every member writes only
//! outputs, every reduction starts from member 0 and accumulates in member order, and plans
//! are refused as the communicator refuses arguments.

use hzp_ir::{DType, Group, Op, ReduceOp};
use hzp_runtime::comm::Communicator;
use hzp_runtime::cuda::transport::{run_on_host, transport_plan, Buf, Step};
use std::sync::atomic::AtomicBool;

fn bytes_of(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut out = Vec::with_capacity(n * dtype.size_bytes());
    for _ in 0..n {
        let r = next();
        // values in [-4, 4) with a fractional part, so that rounding matters
        let v = ((r >> 11) as f64 / (1u64 << 53) as f64) * 8.0 - 4.0;
        match dtype {
            DType::F32 => out.extend((v as f32).to_le_bytes()),
            DType::BF16 => out.extend(half::bf16::from_f64(v).to_le_bytes()),
            DType::F16 => out.extend(half::f16::from_f64(v).to_le_bytes()),
            DType::I64 => out.extend(((v * 1000.0) as i64).to_le_bytes()),
            DType::I32 => out.extend(((v * 1000.0) as i32).to_le_bytes()),
            DType::Bool => out.push((r & 1) as u8),
        }
    }
    out
}

/// The CPU communicator's outputs: one thread per member.
fn cpu_outputs(
    op: &Op,
    dtype: DType,
    shape: &[usize],
    inputs: &[Vec<u8>],
    out_len: usize,
) -> Vec<Vec<u8>> {
    let n = inputs.len();
    let comm = Communicator::new(n);
    let abort = AtomicBool::new(false);
    let mut outputs = vec![vec![0xAAu8; out_len]; n];
    std::thread::scope(|s| {
        for (me, out) in outputs.iter_mut().enumerate() {
            let (comm, abort, input) = (&comm, &abort, &inputs[me]);
            s.spawn(move || {
                // SAFETY: each member's buffers live until every member has returned.
                unsafe {
                    comm.run(
                        me,
                        op,
                        dtype,
                        shape,
                        input.as_ptr(),
                        input.len(),
                        out.as_mut_ptr(),
                        out.len(),
                        None,
                        abort,
                        0,
                        None,
                    )
                }
                .unwrap();
            });
        }
    });
    outputs
}

fn out_len(op: &Op, numel: usize, n: usize, es: usize) -> usize {
    es * match op {
        Op::AllGather { .. } => numel * n,
        Op::ReduceScatter { .. } => numel / n,
        _ => numel,
    }
}

fn check(op: &Op, dtype: DType, shape: &[usize], n: usize, seed: u64) {
    let es = dtype.size_bytes();
    let numel: usize = shape.iter().product();
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|j| bytes_of(dtype, numel, seed * 31 + j as u64))
        .collect();
    let ol = out_len(op, numel, n, es);
    let want = cpu_outputs(op, dtype, shape, &inputs, ol);
    let plan = transport_plan(op, dtype, shape, n).unwrap();
    assert_eq!(plan.len(), n);
    // the device runs members concurrently: run them in reverse order here to show the
    // result does not depend on it
    let mut got = vec![vec![0x55u8; ol]; n];
    let reversed: Vec<Vec<Step>> = plan.iter().rev().cloned().collect();
    run_on_host(&reversed, dtype, &inputs, &mut got).unwrap();
    assert_eq!(
        got,
        want,
        "{} {dtype} {shape:?} over {n} (reversed member order)",
        op.name()
    );
    let mut got = vec![vec![0x55u8; ol]; n];
    run_on_host(&plan, dtype, &inputs, &mut got).unwrap();
    assert_eq!(got, want, "{} {dtype} {shape:?} over {n}", op.name());

    // structure: a reduction starts with member 0's input and accumulates 1, 2, ... in order
    for steps in &plan {
        let mut expect_next: Option<usize> = None;
        for st in steps {
            match st {
                Step::Copy { src, dst, .. } => {
                    assert!(matches!(dst, Buf::Out(_)));
                    expect_next = (*src == Buf::In(0) && is_reduce(op)).then_some(1);
                }
                Step::Acc { src, .. } => {
                    let k = expect_next.expect("an accumulation without its start");
                    assert_eq!(*src, Buf::In(k), "member order");
                    expect_next = Some(k + 1);
                }
                Step::Scale { .. } => assert_eq!(expect_next, Some(n)),
            }
        }
    }
}

fn is_reduce(op: &Op) -> bool {
    matches!(op, Op::ReduceScatter { .. } | Op::AllReduce { .. })
}

#[test]
fn the_transport_plan_gives_the_cpu_communicators_bits() {
    let g = || Group::new(["gpu"]);
    let floats = [DType::F32, DType::BF16, DType::F16];
    let all = [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::I64,
        DType::I32,
        DType::Bool,
    ];
    let mut cases = 0;
    for n in 1..=5usize {
        for (k, dtype) in all.iter().enumerate() {
            let seed = (n * 10 + k) as u64;
            // all-gather over each axis of an odd shape
            for axis in 0..3 {
                check(
                    &Op::AllGather { group: g(), axis },
                    *dtype,
                    &[3, 2, 5],
                    n,
                    seed,
                );
                cases += 1;
            }
            // all-reduce: chunks of numel/n elements, uneven (7 * 3 = 21)
            let hows: &[ReduceOp] = if *dtype == DType::Bool {
                &[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod]
            } else {
                &[
                    ReduceOp::Sum,
                    ReduceOp::Mean,
                    ReduceOp::Max,
                    ReduceOp::Min,
                    ReduceOp::Prod,
                ]
            };
            for &reduce in hows {
                if floats.contains(dtype) || reduce != ReduceOp::Mean {
                    check(
                        &Op::AllReduce { group: g(), reduce },
                        *dtype,
                        &[7, 3],
                        n,
                        seed,
                    );
                    cases += 1;
                }
                // reduce-scatter over axis 0 and 1 of a shape divisible by n
                check(
                    &Op::ReduceScatter {
                        group: g(),
                        axis: 0,
                        reduce,
                    },
                    *dtype,
                    &[2 * n, 3],
                    n,
                    seed,
                );
                check(
                    &Op::ReduceScatter {
                        group: g(),
                        axis: 1,
                        reduce,
                    },
                    *dtype,
                    &[3, n, 2],
                    n,
                    seed,
                );
                cases += 2;
            }
            check(
                &Op::AllToAll {
                    group: g(),
                    split_axis: 0,
                    concat_axis: 1,
                },
                *dtype,
                &[2 * n, 3],
                n,
                seed,
            );
            check(
                &Op::AllToAll {
                    group: g(),
                    split_axis: 1,
                    concat_axis: 0,
                },
                *dtype,
                &[3, n],
                n,
                seed,
            );
            check(
                &Op::Broadcast {
                    group: g(),
                    root: n - 1,
                },
                *dtype,
                &[4, 3],
                n,
                seed,
            );
            cases += 3;
        }
    }
    assert!(cases > 300, "{cases}");
}

#[test]
fn plans_are_refused_as_the_communicator_refuses_arguments() {
    let g = Group::new(["gpu"]);
    let e = transport_plan(
        &Op::ReduceScatter {
            group: g.clone(),
            axis: 0,
            reduce: ReduceOp::Sum,
        },
        DType::F32,
        &[5, 2],
        2,
    )
    .unwrap_err();
    assert!(e.contains("does not divide by the group size 2"), "{e}");
    let e = transport_plan(
        &Op::AllGather {
            group: g.clone(),
            axis: 3,
        },
        DType::F32,
        &[5, 2],
        2,
    )
    .unwrap_err();
    assert!(e.contains("axis 3 is out of range"), "{e}");
    let e = transport_plan(&Op::Broadcast { group: g, root: 2 }, DType::F32, &[4], 2).unwrap_err();
    assert!(e.contains("root 2"), "{e}");
    let e = transport_plan(&Op::Copy, DType::F32, &[4], 2).unwrap_err();
    assert!(e.contains("not a collective"), "{e}");
}

#[test]
fn an_all_reduce_reduces_each_chunk_once_and_copies_it_to_the_others() {
    let plan = transport_plan(
        &Op::AllReduce {
            group: Group::new(["gpu"]),
            reduce: ReduceOp::Sum,
        },
        DType::F32,
        &[10],
        4,
    )
    .unwrap();
    // member 1 reduces elements 2..5 (10 * 1 / 4 .. 10 * 2 / 4) into its output, then copies
    // them to members 0, 2, 3
    let m1 = &plan[1];
    assert_eq!(
        m1[0],
        Step::Copy {
            src: Buf::In(0),
            src_off: 8,
            dst: Buf::Out(1),
            dst_off: 8,
            bytes: 12
        }
    );
    assert_eq!(
        m1.iter().filter(|s| matches!(s, Step::Acc { .. })).count(),
        3
    );
    let copies: Vec<usize> = m1[4..]
        .iter()
        .map(|s| match s {
            Step::Copy {
                src: Buf::Out(1),
                dst,
                src_off: 8,
                dst_off: 8,
                bytes: 12,
            } => dst.member(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(copies, vec![0, 2, 3]);
}
