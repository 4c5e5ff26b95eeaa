//! The local device communicator's transport plan (`cuda::transport`), run on host bytes,
//! gives the CPU communicator's results bit for bit: every collective kind, every dtype and
//! reduction, groups of 1 to 5 members, odd chunk sizes. Also: every member writes only
//! outputs, every reduction starts from member 0 and accumulates in member order, and plans
//! are refused as the communicator refuses arguments. And the reduction kernels themselves
//! (`kernels/collective.cu`, `coll_acc_*` / `coll_scale_*`), compiled as C++ for the CPU
//! (needs `c++` or `CXX`; skipped without one, a failure where `CI` is set), compute what a
//! direct loop written here computes, bit for bit, NaNs included.

#[path = "../../tests/common/skip.rs"]
mod skip;

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

// ------------------------------------------------------- the reduction kernels on the CPU

/// One launch of a reduction kernel: `coll_acc_<tag>(op, n, dst, src)`, or, with `scale`,
/// `coll_scale_<tag>(n, dst, s)`.
struct KernelCase {
    dtype: DType,
    op: i32,
    dst: Vec<u8>,
    src: Vec<u8>,
    scale: Option<Vec<u8>>,
}

/// The kernels' dtype suffix and the C++ type of an element.
fn tag_and_type(d: DType) -> (&'static str, &'static str) {
    match d {
        DType::F32 => ("f32", "float"),
        DType::BF16 => ("bf16", "bf16"),
        DType::F16 => ("f16", "f16"),
        DType::I64 => ("i64", "i64"),
        DType::I32 => ("i32", "i32"),
        DType::Bool => ("b8", "u8"),
    }
}

/// `collective.cu` with what it needs from `common.cuh` (cut from that file, except the f16
/// conversions, which are PTX there and `_Float16` here), and a `main` that launches each
/// case over a grid of 2 blocks of 3 threads (so the grid-stride loop wraps) and prints the
/// destination bytes in hex, one line per case.
fn kernel_program(collective: &str, cases: &[KernelCase]) -> String {
    let common = hzp_runtime::cuda::kernels::COMMON;
    let line = |start: &str| -> String {
        let i = common.find(start).unwrap_or_else(|| panic!("no `{start}`"));
        common[i..i + common[i..].find('\n').unwrap() + 1].to_string()
    };
    let block = |start: &str| -> String {
        let i = common.find(start).unwrap_or_else(|| panic!("no `{start}`"));
        common[i..i + common[i..].find("\n}\n").unwrap() + 3].to_string()
    };
    let mut s = String::from(
        r#"#include <math.h>
#include <stdio.h>
#include <string.h>
#define __device__
#define __forceinline__ inline
#define __global__
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef int i32;
struct bf16 { u16 x; };
struct f16 { u16 x; };
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(u32 i) { float f; memcpy(&f, &i, 4); return f; }
static inline u32 __float_as_uint(float f) { u32 i; memcpy(&i, &f, 4); return i; }
static inline float to_f(f16 v) { _Float16 h; memcpy(&h, &v.x, 2); return (float)h; }
struct Dim { unsigned x; };
static Dim blockIdx, threadIdx, blockDim, gridDim;
"#,
    );
    s += &line("__device__ __forceinline__ float to_f(float v)");
    s += &line("__device__ __forceinline__ float to_f(bf16 v)");
    s += &line("template <typename T> __device__ __forceinline__ T from_f(float v);");
    s += &line("template <> __device__ __forceinline__ float from_f<float>(float v)");
    s += &block("template <> __device__ __forceinline__ bf16 from_f<bf16>(float v)");
    s += "template <> inline f16 from_f<f16>(float v) { _Float16 h = (_Float16)v; f16 r; memcpy(&r.x, &h, 2); return r; }\n";
    s += &line("__device__ __forceinline__ bool is_nan(");
    let i = common.find("#define GRID_LOOP(").expect("GRID_LOOP");
    let j = i + common[i..].find("\\\n").expect("a continued #define") + 2;
    s += &common[i..j + common[j..].find('\n').unwrap() + 1];
    s += &line("__device__ __forceinline__ float nan_max(");
    s += &line("__device__ __forceinline__ float nan_min(");
    s += &line("template <typename T> struct Uns;");
    s += &line("template <> struct Uns<i64>");
    s += &line("template <> struct Uns<i32>");
    s += collective;
    let hex = |b: &[u8]| {
        b.iter()
            .map(|x| format!("{x:#04x}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    s += "static void print(const u8* b, size_t n) { for (size_t i = 0; i < n; ++i) \
          printf(\"%02x\", b[i]); printf(\"\\n\"); }\n";
    s += "int main() {\n    gridDim.x = 2; blockDim.x = 3;\n";
    for c in cases {
        let (tag, ty) = tag_and_type(c.dtype);
        let n = c.dst.len() / c.dtype.size_bytes();
        s += &format!("    {{ alignas(8) static u8 dst[] = {{{}}};\n", hex(&c.dst));
        let call = match &c.scale {
            None => {
                s += &format!(
                    "      alignas(8) static const u8 src[] = {{{}}};\n",
                    hex(&c.src)
                );
                format!(
                    "coll_acc_{tag}({}, {n}, ({ty}*)dst, (const {ty}*)src)",
                    c.op
                )
            }
            Some(k) => {
                s += &format!(
                    "      static const u8 sb[] = {{{}}}; {ty} s; memcpy(&s, sb, sizeof s);\n",
                    hex(k)
                );
                format!("coll_scale_{tag}({n}, ({ty}*)dst, s)")
            }
        };
        s += &format!(
            "      for (blockIdx.x = 0; blockIdx.x < gridDim.x; ++blockIdx.x)\n        \
             for (threadIdx.x = 0; threadIdx.x < blockDim.x; ++threadIdx.x) {call};\n      \
             print(dst, sizeof dst); }}\n"
        );
    }
    s += "    return 0;\n}\n";
    s
}

/// Compiles and runs [`kernel_program`]: each case's destination bytes after the launch.
fn run_kernels(cxx: &str, collective: &str, cases: &[KernelCase], name: &str) -> Vec<Vec<u8>> {
    let dir = std::env::temp_dir().join(format!("hzp-coll-kernels-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, exe) = (dir.join("k.cpp"), dir.join("k"));
    std::fs::write(&src, kernel_program(collective, cases)).unwrap();
    let out = std::process::Command::new(cxx)
        .args(["-std=c++17", "-O1", "-fno-fast-math", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{} does not compile:\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let run = std::process::Command::new(&exe).output().unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let text = String::from_utf8(run.stdout).unwrap();
    let got: Vec<Vec<u8>> = text
        .lines()
        .map(|l| {
            (0..l.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&l[i..i + 2], 16).unwrap())
                .collect()
        })
        .collect();
    assert_eq!(got.len(), cases.len());
    let _ = std::fs::remove_dir_all(&dir);
    got
}

/// An element as f32 (floats) and back, rounding to nearest even.
fn f32_of(d: DType, b: &[u8]) -> f32 {
    match d {
        DType::F32 => f32::from_le_bytes(b.try_into().unwrap()),
        DType::BF16 => half::bf16::from_le_bytes(b.try_into().unwrap()).to_f32(),
        DType::F16 => half::f16::from_le_bytes(b.try_into().unwrap()).to_f32(),
        _ => unreachable!(),
    }
}

fn bytes_of_f32(d: DType, v: f32) -> Vec<u8> {
    match d {
        DType::F32 => v.to_le_bytes().to_vec(),
        DType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
        DType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
        _ => unreachable!(),
    }
}

/// What a case must leave in its destination, element by element: op 0 sum, 1 product,
/// 2 max, 3 min (floats in f32, NaN-propagating max and min, rounded back to the dtype;
/// integers wrapping; bools: sum and max or, product and min and); a scale multiplies.
fn direct(c: &KernelCase) -> Vec<u8> {
    let es = c.dtype.size_bytes();
    let mut out = Vec::new();
    for (i, a) in c.dst.chunks(es).enumerate() {
        let b = match &c.scale {
            Some(k) => k.as_slice(),
            None => &c.src[i * es..(i + 1) * es],
        };
        let op = if c.scale.is_some() { 1 } else { c.op };
        match c.dtype {
            DType::F32 | DType::BF16 | DType::F16 => {
                let (x, y) = (f32_of(c.dtype, a), f32_of(c.dtype, b));
                let r = match op {
                    0 => x + y,
                    1 => x * y,
                    _ if x.is_nan() || y.is_nan() => f32::NAN,
                    2 => x.max(y),
                    _ => x.min(y),
                };
                out.extend(bytes_of_f32(c.dtype, r));
            }
            DType::I64 => {
                let x = i64::from_le_bytes(a.try_into().unwrap());
                let y = i64::from_le_bytes(b.try_into().unwrap());
                let r = [x.wrapping_add(y), x.wrapping_mul(y), x.max(y), x.min(y)][op as usize];
                out.extend(r.to_le_bytes());
            }
            DType::I32 => {
                let x = i32::from_le_bytes(a.try_into().unwrap());
                let y = i32::from_le_bytes(b.try_into().unwrap());
                let r = [x.wrapping_add(y), x.wrapping_mul(y), x.max(y), x.min(y)][op as usize];
                out.extend(r.to_le_bytes());
            }
            DType::Bool => out.push(if op == 1 || op == 3 {
                a[0] & b[0]
            } else {
                a[0] | b[0]
            }),
        }
    }
    out
}

/// The cases whose kernel output differs from [`direct`]'s: bits, or NaN against NaN for
/// floats (a NaN's payload is not specified).
fn mismatches(cases: &[KernelCase], got: &[Vec<u8>]) -> Vec<String> {
    let mut bad = Vec::new();
    for (k, (c, g)) in cases.iter().zip(got).enumerate() {
        let want = direct(c);
        let es = c.dtype.size_bytes();
        let floats = matches!(c.dtype, DType::F32 | DType::BF16 | DType::F16);
        for (i, (x, y)) in g.chunks(es).zip(want.chunks(es)).enumerate() {
            let same =
                x == y || (floats && f32_of(c.dtype, x).is_nan() && f32_of(c.dtype, y).is_nan());
            if !same {
                bad.push(format!(
                    "case {k} ({} {}, op {}): element {i} is {x:02x?}, the direct loop gives {y:02x?}",
                    tag_and_type(c.dtype).0,
                    if c.scale.is_some() { "scale" } else { "acc" },
                    c.op
                ));
                break;
            }
        }
    }
    bad
}

/// Every kernel of `collective.cu` (acc: 6 dtypes x 4 ops; scale: 5 dtypes) on 37 elements:
/// random values, NaNs and infinities among the floats, integers over their whole range (so
/// sums and products wrap).
fn kernel_cases() -> Vec<KernelCase> {
    let mut cases = Vec::new();
    let n = 37;
    let mut seed = 7u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let all = [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::I64,
        DType::I32,
        DType::Bool,
    ];
    for (k, &dtype) in all.iter().enumerate() {
        let mut data = |j: u64| -> Vec<u8> {
            let mut b = bytes_of(dtype, n, 1000 + 10 * k as u64 + j);
            let es = dtype.size_bytes();
            for e in 0..n {
                let r = next();
                let special = match dtype {
                    DType::F32 | DType::BF16 | DType::F16 if r % 9 == 0 => Some(bytes_of_f32(
                        dtype,
                        [f32::NAN, f32::INFINITY, -0.0][(r >> 8) as usize % 3],
                    )),
                    DType::I64 if r % 3 == 0 => Some(next().to_le_bytes().to_vec()),
                    DType::I32 if r % 3 == 0 => Some((next() as u32).to_le_bytes().to_vec()),
                    _ => None,
                };
                if let Some(v) = special {
                    b[e * es..(e + 1) * es].copy_from_slice(&v);
                }
            }
            b
        };
        for op in 0..4 {
            cases.push(KernelCase {
                dtype,
                op,
                dst: data(2 * op as u64),
                src: data(2 * op as u64 + 1),
                scale: None,
            });
        }
        if dtype != DType::Bool {
            let scale = match dtype {
                DType::I64 => (-3i64).to_le_bytes().to_vec(),
                DType::I32 => 7i32.to_le_bytes().to_vec(),
                d => bytes_of_f32(d, 1.0 / 3.0),
            };
            cases.push(KernelCase {
                dtype,
                op: 0,
                dst: data(9),
                src: Vec::new(),
                scale: Some(scale),
            });
        }
    }
    cases
}

#[test]
fn the_reduction_kernels_compute_what_a_direct_loop_computes() {
    // the op codes the kernels take, as collective.cu's comment and switch define them
    use hzp_runtime::cuda::transport::reduce_code;
    assert_eq!(reduce_code(ReduceOp::Sum), 0);
    assert_eq!(reduce_code(ReduceOp::Mean), 0);
    assert_eq!(reduce_code(ReduceOp::Prod), 1);
    assert_eq!(reduce_code(ReduceOp::Max), 2);
    assert_eq!(reduce_code(ReduceOp::Min), 3);
    let Some(cxx) = skip::cxx_compiler(
        "the_reduction_kernels_compute_what_a_direct_loop_computes",
        "run the reduction kernels on the CPU",
    ) else {
        return;
    };
    let cases = kernel_cases();
    assert_eq!(cases.len(), 6 * 4 + 5);
    let collective = hzp_runtime::cuda::kernels::COLLECTIVE;
    let got = run_kernels(&cxx, collective, &cases, "real");
    let bad = mismatches(&cases, &got);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    // the comparison can fail: max without NaN propagation, and integer sums in the wrong
    // width, are caught
    for (from, to) in [
        (
            "case 2: return nan_max(a, b);",
            "case 2: return fmaxf(a, b);",
        ),
        (
            "default: r = (T)((U)a + (U)b);",
            "default: r = (T)((u32)a + (u32)b);",
        ),
    ] {
        assert_eq!(collective.matches(from).count(), 1, "{from}");
        let broken = collective.replace(from, to);
        let got = run_kernels(&cxx, &broken, &cases, "broken");
        assert!(
            !mismatches(&cases, &got).is_empty(),
            "`{to}` in collective.cu went unnoticed"
        );
    }
}
