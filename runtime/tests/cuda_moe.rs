//! The CUDA backend's mixture-of-experts kernels (`runtime/src/cuda/kernels/moe.cu`), as far
//! as a machine without a GPU can check them: small programs of MoeDispatch, MoeCombine and
//! MoeCombineGrad are lowered for the CUDA backend, and the lowering's launches run on the
//! CPU as C++ -- the same `moe.cu` source, with a small CUDA shim and the helpers it uses cut
//! out of `common.cuh`, every thread of each launch's grid in turn, at the lowering's arena
//! offsets and arguments. Every output (the slots, the dispatched buffer, the combined rows,
//! both gradients) must equal hzp's CPU kernels (`runtime/kernels/src/cpu/moe.rs`) bit for
//! bit, in f32, bf16 and f16, with i32 and i64 choices, with and without drops and with a
//! token choosing an expert twice; a bad expert index or slot must set the error word to the
//! node's code. NVRTC compiles the source in `runtime/tests/cuda_kernels.rs`; the launch on a
//! GPU is `examples/device/multi_rank_check.sh` (PART=moe).

mod common;
#[path = "../../tests/common/skip.rs"]
mod skip;

use common::{bytes_of, emulation_input, plan_of, run_cmd, tempdir, Rng, EMULATION_MAIN};
use hzp_ir::{DType, Op, Plan, Tensor};
use hzp_runtime::cuda::lower::{lower_program, Arg, LoweredPlan, Work};
use hzp_runtime::executor::PlanExecutor;
use std::collections::HashMap;
use std::path::Path;

/// The CUDA shim, the helpers `moe.cu` uses cut out of `common.cuh`, and `moe.cu` itself.
fn emulation_prelude() -> String {
    let common = hzp_runtime::cuda::kernels::COMMON;
    // from `start` to the end of its line, or (block) to the next "\n}\n"
    let cut = |start: &str, block: bool| -> String {
        let i = common
            .find(start)
            .unwrap_or_else(|| panic!("no `{start}` in common.cuh"));
        let end = if block { "\n}\n" } else { "\n" };
        let j = i + common[i..].find(end).expect("an end") + end.len();
        common[i..j].to_string()
    };
    let mut s = String::from(
        r#"#include <stdio.h>
#include <stdlib.h>
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
static inline float __uint_as_float(u32 i) { float f; memcpy(&f, &i, 4); return f; }
static inline u32 __float_as_uint(float f) { u32 i; memcpy(&i, &f, 4); return i; }
static inline int atomicCAS(int* a, int compare, int v) { int o = *a; if (o == compare) *a = v; return o; }
struct Dim { unsigned x; };
static Dim blockIdx, threadIdx, blockDim, gridDim;
static inline float to_f(float v) { return v; }
template <typename T> T from_f(float v);
template <> float from_f<float>(float v) { return v; }
// f16 through the compiler's _Float16 (IEEE binary16, round to nearest even), where the
// kernels use the GPU's cvt instructions
static inline float to_f(f16 v) { _Float16 h; memcpy(&h, &v.x, 2); return (float)h; }
template <> f16 from_f<f16>(float v) { _Float16 h = (_Float16)v; f16 r; memcpy(&r.x, &h, 2); return r; }
"#,
    );
    s += &cut("__device__ __forceinline__ float to_f(bf16 v)", false);
    s += &cut(
        "template <> __device__ __forceinline__ bf16 from_f<bf16>",
        true,
    );
    s += &cut("#define GRID_LOOP(", false);
    s += &cut("    for (i64 i = (i64)blockIdx.x", false);
    s += &cut("__device__ __forceinline__ void fail(", false);
    s += &cut("__device__ __forceinline__ i64 load_index(", true);
    s += hzp_runtime::cuda::kernels::MOE;
    s += r#"
struct P { char* p; template <class T> operator T*() const { return (T*)p; } };
static char* read_all(const char* path, size_t* n) {
    FILE* f = fopen(path, "rb"); if (!f) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END); *n = ftell(f); fseek(f, 0, SEEK_SET);
    char* b = (char*)malloc(*n + 1); if (fread(b, 1, *n, f) != *n) exit(3); fclose(f); return b;
}
#define LAUNCH(G, B, CALL) \
    gridDim.x = G; blockDim.x = B; \
    for (blockIdx.x = 0; blockIdx.x < gridDim.x; ++blockIdx.x) \
        for (threadIdx.x = 0; threadIdx.x < blockDim.x; ++threadIdx.x) CALL;
"#;
    s
}

/// One program to emulate: its plan, the lowering, the CPU reference of its outputs.
struct Case {
    name: String,
    plan: Plan,
    low: LoweredPlan,
    inputs: HashMap<String, Tensor>,
}

impl Case {
    fn new(name: &str, src: &str, inputs: HashMap<String, Tensor>) -> Case {
        let p = hzp_ir::text::parse(src, name, &|_| None).unwrap_or_else(|e| panic!("{e}"));
        let plan = plan_of(p);
        let low = lower_program(&plan, 0).unwrap_or_else(|e| panic!("{name}: {e}"));
        Case {
            name: name.into(),
            plan,
            low,
            inputs,
        }
    }

    /// The C++ function that runs every launch of the lowering in order.
    fn function(&self, k: usize) -> String {
        let mut s = format!("static void case{k}(char* A) {{\n");
        for nw in &self.low.nodes {
            for w in &nw.work {
                let Work::Kernel(l) = w else {
                    panic!("{}: node `{}`: {w:?} is not a kernel", self.name, nw.name)
                };
                let args: Vec<String> = l
                    .args
                    .iter()
                    .map(|a| match a {
                        Arg::I64(v) => format!("(i64){v}LL"),
                        Arg::I32(v) => format!("(int){v}"),
                        Arg::Ptr(o) => format!("P{{A + {o}}}"),
                        Arg::ErrFlag => format!("P{{A + {}}}", self.low.err_offset),
                        other => panic!("an MoE kernel argument {other:?}"),
                    })
                    .collect();
                s += &format!(
                    "    LAUNCH({}, {}, {}({}))\n",
                    l.grid,
                    l.block,
                    l.kernel,
                    args.join(", ")
                );
            }
        }
        s + "}\n"
    }
}

/// Compiles the cases into one program and runs each: per case, the named outputs' bytes
/// and the error word.
fn emulate(cxx: &str, dir: &Path, cases: &[Case], outputs: &[&[&str]]) -> Vec<(Vec<u8>, i32)> {
    let mut src = emulation_prelude();
    for (k, c) in cases.iter().enumerate() {
        src += &c.function(k);
    }
    src += "static void run_case(int k, char* A) {\n    switch (k) {\n";
    for k in 0..cases.len() {
        src += &format!("    case {k}: case{k}(A); break;\n");
    }
    src += "    }\n}\n";
    src += EMULATION_MAIN;
    let cpp = dir.join("moe.cpp");
    let exe = dir.join("moe");
    std::fs::write(&cpp, &src).unwrap();
    run_cmd(
        std::process::Command::new(cxx)
            .args([
                "-O1",
                "-std=c++17",
                "-fno-fast-math",
                "-ffp-contract=off",
                "-o",
            ])
            .arg(&exe)
            .arg(&cpp),
    );
    cases
        .iter()
        .zip(outputs)
        .enumerate()
        .map(|(k, (c, outs))| {
            let inp = dir.join(format!("in{k}.bin"));
            std::fs::write(&inp, emulation_input(&c.plan, &c.low, &c.inputs, outs)).unwrap();
            let o = run_cmd(
                std::process::Command::new(&exe)
                    .arg(k.to_string())
                    .arg(c.low.alloc_bytes.to_string())
                    .arg(&inp),
            );
            let mut out = o.stdout;
            let err = i32::from_le_bytes(out[out.len() - 4..].try_into().unwrap());
            out.truncate(out.len() - 4);
            (out, err)
        })
        .collect()
}

/// (T, K, E, C, H, data dtype, choices dtype, whether a token may choose an expert twice)
type Shape = (usize, usize, usize, usize, usize, DType, DType, bool);

const SHAPES: [Shape; 12] = [
    (7, 2, 4, 2, 3, DType::F32, DType::I64, false),
    (9, 3, 4, 4, 5, DType::BF16, DType::I64, false),
    (5, 1, 3, 1, 4, DType::F32, DType::I32, false),
    (8, 2, 4, 8, 2, DType::F32, DType::I64, false),
    (6, 4, 3, 3, 3, DType::BF16, DType::I32, true),
    (33, 2, 8, 5, 17, DType::F32, DType::I64, true),
    (16, 2, 4, 4, 64, DType::F16, DType::I64, false),
    (300, 2, 8, 40, 7, DType::F32, DType::I32, false),
    (300, 2, 8, 90, 5, DType::BF16, DType::I64, true),
    (1, 1, 1, 1, 1, DType::F32, DType::I64, false),
    (12, 3, 2, 20, 9, DType::F16, DType::I32, true),
    (64, 4, 16, 6, 33, DType::F32, DType::I64, false),
];

/// The choices: distinct experts per token (a top-k), or drawn independently (repeats).
fn choices(rng: &mut Rng, t: usize, k: usize, e: usize, repeats: bool) -> Vec<i64> {
    let mut out = Vec::with_capacity(t * k);
    for _ in 0..t {
        if repeats {
            out.extend((0..k).map(|_| ((rng.next() * e as f64) as i64).min(e as i64 - 1)));
        } else {
            let mut order: Vec<(f64, i64)> = (0..e as i64).map(|x| (rng.next(), x)).collect();
            order.sort_by(|a, b| a.0.total_cmp(&b.0));
            out.extend(order[..k].iter().map(|p| p.1));
        }
    }
    out
}

fn random(rng: &mut Rng, dtype: DType, shape: Vec<usize>) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| 6.0 * rng.next() - 3.0).collect();
    Tensor::from_f64(dtype, shape, &v)
}

const OUTPUTS: [&str; 5] = ["%slots", "%buf", "%y", "%dye", "%dw"];

/// The programs of [`SHAPES`] on random operands, each with the CPU kernels' bytes of
/// [`OUTPUTS`], and how many choices were kept, dropped, and tokens chose an expert twice.
fn random_cases() -> (Vec<Case>, Vec<Vec<Vec<u8>>>, [usize; 3]) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut cases = Vec::new();
    let mut wants = Vec::new();
    let (mut dropped, mut kept, mut repeated) = (0usize, 0usize, 0usize);
    for (k_case, &(t, k, e, c, h, d, id, repeats)) in SHAPES.iter().enumerate() {
        let ch = choices(&mut rng, t, k, e, repeats);
        repeated += (0..t)
            .filter(|&tok| {
                let row = &ch[tok * k..tok * k + k];
                (0..k).any(|a| row[a + 1..].contains(&row[a]))
            })
            .count();
        let ch_t = Tensor::from_f64(
            id,
            vec![t, k],
            &ch.iter().map(|&x| x as f64).collect::<Vec<_>>(),
        );
        let x = random(&mut rng, d, vec![t, h]);
        let w = random(&mut rng, d, vec![t, k]);
        let dy = random(&mut rng, d, vec![t, h]);
        let ye = random(&mut rng, d, vec![e, c, h]);
        // the CPU kernels: dispatch, then combine and its gradient on the dispatch's slots
        let ev = |op: Op, ins: &[&Tensor]| hzp_runtime::cpu::eval_op(&op, ins).unwrap();
        let disp = ev(
            Op::MoeDispatch {
                experts: e,
                capacity: c,
            },
            &[&x, &ch_t],
        );
        let slots = &disp[1];
        let n_drop = slots.to_f64_vec().iter().filter(|&&s| s < 0.0).count();
        dropped += n_drop;
        kept += t * k - n_drop;
        let y = ev(Op::MoeCombine, &[&ye, &ch_t, slots, &w]);
        let grad = ev(Op::MoeCombineGrad, &[&ye, &ch_t, slots, &w, &dy]);
        let want: Vec<Vec<u8>> = [&disp[1], &disp[0], &y[0], &grad[0], &grad[1]]
            .iter()
            .map(|t| bytes_of(t))
            .collect();
        wants.push(want);
        let src = format!(
            r#"program "moe"
mesh gpu=1

input %x : {d}[{t},{h}]
input %ch : {id}[{t},{k}]
input %w : {d}[{t},{k}]
input %dy : {d}[{t},{h}]
input %ye : {d}[{e},{c},{h}]
%buf, %slots = MoeDispatch{{experts={e}, capacity={c}}}(%x, %ch) : {d}[{e},{c},{h}], i64[{t},{k}] "dispatch"
%y = MoeCombine(%ye, %ch, %slots, %w) : {d}[{t},{h}] "combine"
%dye, %dw = MoeCombineGrad(%ye, %ch, %slots, %w, %dy) : {d}[{e},{c},{h}], {d}[{t},{k}] "combine_grad"
output %buf
output %slots
output %y
output %dye
output %dw
"#
        );
        let inputs = HashMap::from([
            ("%x".to_string(), x),
            ("%ch".to_string(), ch_t),
            ("%w".to_string(), w),
            ("%dy".to_string(), dy),
            ("%ye".to_string(), ye),
        ]);
        cases.push(Case::new(&format!("moe{k_case}"), &src, inputs));
    }
    (cases, wants, [kept, dropped, repeated])
}

#[test]
fn moe_kernels_equal_the_cpu_kernels_bit_for_bit() {
    // CI's machine has a C++ compiler (Rust's linker needs one): there this must run
    let Some(cxx) = skip::cxx_compiler(
        "moe_kernels_equal_the_cpu_kernels_bit_for_bit",
        "emulate the MoE kernels",
    ) else {
        return;
    };
    let dir = tempdir("cuda-moe");
    let (cases, wants, [kept, dropped, repeated]) = random_cases();
    let outs: Vec<&[&str]> = cases.iter().map(|_| &OUTPUTS[..]).collect();
    let got = emulate(&cxx, &dir, &cases, &outs);
    let mut checked = 0usize;
    for (k_case, ((case, (bytes, err)), want)) in cases.iter().zip(&got).zip(&wants).enumerate() {
        assert_eq!(*err, 0, "{}: the error word is set", case.name);
        let mut at = 0;
        for (name, w) in OUTPUTS.iter().zip(want) {
            let g = &bytes[at..at + w.len()];
            at += w.len();
            if g != &w[..] {
                let first = g.iter().zip(w).position(|(a, b)| a != b).unwrap();
                panic!(
                    "{} {:?}: {name} differs from the CPU kernel at byte {first} of {}",
                    case.name,
                    SHAPES[k_case],
                    w.len()
                );
            }
            checked += 1;
        }
        assert_eq!(at, bytes.len());
    }
    eprintln!(
        "{} programs, {checked} outputs equal: {kept} choices kept, {dropped} dropped, \
         {repeated} tokens choosing an expert twice",
        cases.len()
    );
    // the cases exercise what they are meant to
    assert!(dropped > 0 && kept > 0 && repeated > 0);
}

/// A bad expert index (MoeDispatch, MoeCombine) or slot (MoeCombine, MoeCombineGrad) sets
/// the error word to the node's code (its index + 1), which the executor reports, instead
/// of reading or writing out of bounds; the good choices are still computed as on the CPU.
#[test]
fn bad_experts_and_slots_set_the_error_word() {
    let Some(cxx) = skip::cxx_compiler(
        "bad_experts_and_slots_set_the_error_word",
        "emulate the MoE kernels",
    ) else {
        return;
    };
    let dir = tempdir("cuda-moe-bad");
    let (t, k, e, c, h) = (4, 2, 3, 2, 3);
    let mut rng = Rng(7);
    let ye = random(&mut rng, DType::F32, vec![e, c, h]);
    let w = random(&mut rng, DType::F32, vec![t, k]);
    let dy = random(&mut rng, DType::F32, vec![t, h]);
    let x = random(&mut rng, DType::F32, vec![t, h]);
    let dispatch = format!(
        r#"program "bad"
mesh gpu=1

input %x : f32[{t},{h}]
input %ch : i64[{t},{k}]
%buf, %slots = MoeDispatch{{experts={e}, capacity={c}}}(%x, %ch) : f32[{e},{c},{h}], i64[{t},{k}] "dispatch"
output %buf
output %slots
"#
    );
    let combine = format!(
        r#"program "bad"
mesh gpu=1

input %ye : f32[{e},{c},{h}]
input %ch : i64[{t},{k}]
input %slots : i64[{t},{k}]
input %w : f32[{t},{k}]
input %dy : f32[{t},{h}]
%y = MoeCombine(%ye, %ch, %slots, %w) : f32[{t},{h}] "combine"
%dye, %dw = MoeCombineGrad(%ye, %ch, %slots, %w, %dy) : f32[{e},{c},{h}], f32[{t},{k}] "combine_grad"
output %y
output %dye
output %dw
"#
    );
    let good = vec![0, 1, 1, 2, 2, 0, 0, 1];
    let mut bad_expert = good.clone();
    bad_expert[3] = e as i64; // token 1's second choice
    let mut negative = good.clone();
    negative[4] = -1;
    let good_slots = vec![0, 0, 1, 0, 1, -1, -1, -1];
    let mut big_slot = good_slots.clone();
    big_slot[2] = c as i64;
    let mut bad_slot = good_slots.clone();
    bad_slot[0] = -2;
    let tk = |v: &Vec<i64>| Tensor::i64(vec![t, k], v.clone());
    let disp =
        |ch: &Vec<i64>| HashMap::from([("%x".to_string(), x.clone()), ("%ch".to_string(), tk(ch))]);
    let comb = |ch: &Vec<i64>, s: &Vec<i64>| {
        HashMap::from([
            ("%ye".to_string(), ye.clone()),
            ("%ch".to_string(), tk(ch)),
            ("%slots".to_string(), tk(s)),
            ("%w".to_string(), w.clone()),
            ("%dy".to_string(), dy.clone()),
        ])
    };
    // (case, the code the error word must hold: 0 for none)
    let cases = vec![
        (Case::new("d_good", &dispatch, disp(&good)), 0),
        (Case::new("d_big", &dispatch, disp(&bad_expert)), 1),
        (Case::new("d_negative", &dispatch, disp(&negative)), 1),
        (Case::new("c_good", &combine, comb(&good, &good_slots)), 0),
        (
            Case::new("c_expert", &combine, comb(&bad_expert, &good_slots)),
            1,
        ),
        (Case::new("c_big_slot", &combine, comb(&good, &big_slot)), 1),
        (Case::new("c_bad_slot", &combine, comb(&good, &bad_slot)), 1),
    ];
    let outs: Vec<&[&str]> = cases
        .iter()
        .map(|(c, _)| {
            if c.name.starts_with("d_") {
                &["%slots", "%buf"][..]
            } else {
                &["%y", "%dye", "%dw"][..]
            }
        })
        .collect();
    let (cs, codes): (Vec<Case>, Vec<i32>) = cases.into_iter().unzip();
    let got = emulate(&cxx, &dir, &cs, &outs);
    for ((case, (bytes, err)), code) in cs.iter().zip(&got).zip(&codes) {
        assert_eq!(err, code, "{}: the error word", case.name);
        // the CPU kernels refuse exactly the bad cases
        let ins = |names: &[&str]| -> Vec<Tensor> {
            names.iter().map(|n| case.inputs[*n].clone()).collect()
        };
        if case.name.starts_with("d_") {
            let i = ins(&["%x", "%ch"]);
            let r = hzp_runtime::cpu::eval_op(
                &Op::MoeDispatch {
                    experts: e,
                    capacity: c,
                },
                &[&i[0], &i[1]],
            );
            assert_eq!(r.is_err(), *code != 0, "{}: {r:?}", case.name);
            if let Ok(r) = r {
                let want = [bytes_of(&r[1]), bytes_of(&r[0])].concat();
                assert_eq!(bytes, &want, "{}", case.name);
            } else {
                // the good choices keep the CPU's slots; the bad one is dropped (-1)
                let slots: Vec<i64> = bytes[..8 * t * k]
                    .chunks(8)
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                let ch = case.inputs["%ch"].to_f64_vec();
                for (at, &s) in slots.iter().enumerate() {
                    let x = ch[at] as i64;
                    assert!(
                        (0..e as i64).contains(&x) || s == -1,
                        "{}: {slots:?}",
                        case.name
                    );
                }
            }
        } else {
            let i = ins(&["%ye", "%ch", "%slots", "%w", "%dy"]);
            let r = hzp_runtime::cpu::eval_op(&Op::MoeCombine, &[&i[0], &i[1], &i[2], &i[3]]);
            assert_eq!(r.is_err(), *code != 0, "{}: {r:?}", case.name);
            if let Ok(y) = r {
                let g = hzp_runtime::cpu::eval_op(
                    &Op::MoeCombineGrad,
                    &[&i[0], &i[1], &i[2], &i[3], &i[4]],
                )
                .unwrap();
                let want = [bytes_of(&y[0]), bytes_of(&g[0]), bytes_of(&g[1])].concat();
                assert_eq!(bytes, &want, "{}", case.name);
            }
        }
    }
}

/// Opens an executor for a plan, or says why not.
type OpenExecutor<'a> = dyn Fn(&Plan) -> Result<Box<dyn PlanExecutor>, String> + 'a;

/// Runs every program of [`random_cases`] through executors `open` makes (`Err`: none
/// here, for the first program: the check is skipped and `false` returned): every output
/// must equal the CPU kernels bit for bit, and a bad expert index must fail the step
/// naming the node and the index. Prints a `RESULT` line per program (`what` names the
/// executor).
fn check_executor(what: &str, open: &OpenExecutor<'_>) -> Result<(), String> {
    let (cases, wants, _) = random_cases();
    let inputs_of = |case: &Case| -> Vec<(String, Tensor)> {
        case.inputs
            .iter()
            .map(|(n, t)| (n.trim_start_matches('%').to_string(), t.clone()))
            .collect()
    };
    for (k_case, (case, want)) in cases.iter().zip(&wants).enumerate() {
        let mut ex = match open(&case.plan) {
            Ok(ex) => ex,
            Err(e) if k_case == 0 => return Err(e),
            Err(e) => panic!("{what} {}: {e}", case.name),
        };
        ex.set_inputs(&inputs_of(case)).unwrap();
        ex.step()
            .unwrap_or_else(|e| panic!("{what} {}: {e}", case.name));
        for (name, w) in OUTPUTS.iter().zip(want) {
            let got = ex
                .value(0, name.trim_start_matches('%'))
                .unwrap()
                .unwrap_or_else(|| panic!("{what} {}: no {name}", case.name));
            let g = bytes_of(&got);
            assert!(
                g == *w,
                "{what} {} {:?}: {name} differs from the CPU kernel at byte {:?} of {}",
                case.name,
                SHAPES[k_case],
                g.iter().zip(w).position(|(a, b)| a != b),
                w.len()
            );
        }
        println!(
            "RESULT moe kernels {what} {} {:?}: PASS (bitwise)",
            case.name, SHAPES[k_case]
        );
    }
    // a bad expert index: the step fails naming the node, nothing read out of bounds
    let bad = &cases[0];
    let mut ex = open(&bad.plan).unwrap();
    let mut inputs = inputs_of(bad);
    let ch = inputs.iter_mut().find(|(n, _)| n == "ch").unwrap();
    let mut v = ch.1.to_f64_vec();
    v[1] = 99.0;
    ch.1 = Tensor::from_f64(ch.1.dtype(), ch.1.shape.clone(), &v);
    ex.set_inputs(&inputs).unwrap();
    let e = ex.step().expect_err("a bad expert index").to_string();
    assert!(
        e.contains("dispatch") && e.contains("expert index"),
        "{what}: {e}"
    );
    println!("RESULT moe kernels {what} bad expert index: PASS ({e})");
    Ok(())
}

/// The harness of the GPU check below, with the CPU executor (`hzp run`'s CPU backend) in
/// place of the GPU's: the same programs, inputs and reads.
#[test]
fn the_cpu_executor_passes_the_gpu_check() {
    check_executor("cpu", &|plan: &Plan| {
        let ex = hzp_runtime::exec::Executor::new(plan, &[], Default::default())
            .map_err(|e| e.to_string())?;
        Ok(Box::new(ex) as Box<dyn PlanExecutor>)
    })
    .unwrap();
}

/// The programs run on the GPU through the CUDA executor (`hzp run --backend cuda`'s path:
/// the lowering, NVRTC's build of the sources, the launches): every output equal to the CPU
/// kernels bit for bit, and a bad expert index refused as a node error naming it. Without a
/// GPU it says SKIPPED, unless HZP_REQUIRE_GPU is set (the device check,
/// `examples/device/multi_rank_check.sh` PART=moe, sets it): then it fails.
#[cfg(feature = "cuda")]
#[test]
fn moe_kernels_on_the_gpu_equal_the_cpu_kernels() {
    use hzp_runtime::cuda::{lower::LowerOptions, open_one_gpu, RunOptions};
    let opts = RunOptions {
        comm: hzp_runtime::exec::CommMode::Sync,
        timeout: std::time::Duration::from_secs(60),
        lower: LowerOptions::default(),
        // (one step each: nothing to capture)
        graphs: false,
    };
    let open = |plan: &Plan| open_one_gpu(plan, &[], &opts).map_err(|e| e.to_string());
    if let Err(e) = check_executor("cuda", &open) {
        skip::skip(
            "moe_kernels_on_the_gpu_equal_the_cpu_kernels",
            skip::Missing::Gpu,
            &format!("no GPU: {e}"),
        );
    }
}
