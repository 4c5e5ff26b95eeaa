//! The CUDA backend's elementwise fusion (`runtime/src/cuda/fuse.rs`, `HZP_CUDA_FUSE=1`), as
//! far as a machine without a GPU can check it: every generated kernel of the training plans
//! of the tiny GPT-2 and Llama (f32 and bf16) is compiled as C++ for the CPU (the kernels'
//! own `unary_f` / `binary_f` and `GRID_LOOP` taken from the sources), run on random
//! operands at the lowering's arena offsets, every thread of the launch's grid in turn, and its stored outputs must equal hzp's
//! CPU evaluator running the run's nodes one by one, bit for bit (NaN where it gives NaN).
//! That checks the fusion's choice of members, operands and stored values, the index
//! arithmetic of broadcast operands and the roundings; what it cannot check (the launch on a
//! GPU) is `examples/device/multi_rank_check.sh` with `FUSE=1`. NVRTC compiles the same
//! sources in `runtime/tests/cuda_kernels.rs`'s fused test.

mod common;
use common::*;
use half::bf16;
use hzp_ir::{DType, Plan, Tensor};
use hzp_runtime::cuda::fuse::{self, Run};
use hzp_runtime::cuda::lower::{self, Arg, LowerOptions};
use std::collections::HashMap;
use std::path::Path;

/// The training plans the fusion is checked on: (model, shape, extra flags).
const PLANS: [(&str, &str, &[&str]); 4] = [
    (
        "tests/models/gpt2_tiny.legacy.op17.onnx",
        "input_ids=4x16",
        &["--retie"],
    ),
    (
        "tests/models/gpt2_tiny.dynamo.op18.onnx",
        "input_ids=4x16",
        &["--precision", "bf16"],
    ),
    (
        "tests/models/llama_tiny.legacy.op17.onnx",
        "input_ids=4x16",
        &[],
    ),
    (
        "tests/models/llama_tiny.dynamo.op18.onnx",
        "input_ids=4x16",
        &["--precision", "bf16"],
    ),
];

fn compile(dir: &Path, k: usize, model: &str, shape: &str, extra: &[&str]) -> Plan {
    let out = dir.join(format!("plan{k}.json"));
    let out_s = out.to_str().unwrap();
    let mut args = vec![
        "compile",
        model,
        "--mesh",
        "gpu=1",
        "--no-fuse-attention",
        "-o",
        out_s,
    ];
    if !shape.is_empty() {
        args.extend(["--shape", shape]);
    }
    args.extend(extra);
    let (code, o, e) = hzp(&args);
    assert_eq!(code, 0, "{model}: {o}{e}");
    Plan::from_json(&std::fs::read_to_string(&out).unwrap(), "plan.json").unwrap()
}

/// Rank 0's lowering of `plan` with fusion on.
fn fused_lowering(plan: &Plan) -> lower::LoweredPlan {
    let opts = LowerOptions {
        fuse: true,
        ..LowerOptions::default()
    };
    lower::lower_program_with(plan, 0, opts).unwrap_or_else(|e| panic!("{e}"))
}

/// The CPU stand-ins for what the generated kernels use from the CUDA sources: the real
/// `unary_f` / `binary_f` (and the helpers they call), cut out of the sources; bf16
/// conversions written out (round to nearest even, as `common.cuh`'s).
fn emulation_prelude() -> String {
    let cut = |src: &str, start: &str| -> String {
        let i = src.find(start).unwrap_or_else(|| panic!("no `{start}`"));
        let j = i + src[i..].find("\n}\n").expect("a closing brace") + 3;
        src[i..j].to_string()
    };
    let common = hzp_runtime::cuda::kernels::COMMON;
    let ew = hzp_runtime::cuda::kernels::ELEMENTWISE;
    let line = |src: &str, start: &str| -> String {
        let i = src.find(start).unwrap_or_else(|| panic!("no `{start}`"));
        src[i..i + src[i..].find('\n').unwrap() + 1].to_string()
    };
    let mut s = String::from(
        r#"#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define __device__
#define __forceinline__ inline
#define __global__
#define __trap() abort()
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
struct bf16 { u16 x; };
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(u32 i) { float f; memcpy(&f, &i, 4); return f; }
static inline u32 __float_as_uint(float f) { u32 i; memcpy(&i, &f, 4); return i; }
static inline float to_f(float v) { return v; }
static inline float to_f(bf16 v) { return __uint_as_float(((u32)v.x) << 16); }
template <typename T> T from_f(float v);
template <> float from_f<float>(float v) { return v; }
template <> bf16 from_f<bf16>(float v) {
    u32 u = __float_as_uint(v);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) { r.x = (u16)((u >> 16) | 0x40u); }
    else { u += 0x7fffu + ((u >> 16) & 1u); r.x = (u16)(u >> 16); }
    return r;
}
struct Dim { unsigned x; };
static Dim blockIdx, threadIdx, blockDim, gridDim;
"#,
    );
    // GRID_LOOP as the kernels have it (the #define and its continuation line)
    let i = common.find("#define GRID_LOOP(").expect("GRID_LOOP");
    let j = i + common[i..].find("\\\n").expect("a continued #define") + 2;
    let j = j + common[j..].find('\n').unwrap() + 1;
    s += &common[i..j];
    s += &line(common, "__device__ __forceinline__ bool is_nan(");
    s += &line(common, "__device__ __forceinline__ float nan_max(");
    s += &line(common, "__device__ __forceinline__ float nan_min(");
    s += &cut(ew, "__device__ __forceinline__ float unary_f(");
    s += &cut(ew, "__device__ __forceinline__ float binary_f(");
    s += r#"struct P { char* p; template <class T> operator T*() const { return (T*)p; } };
static char* read_all(const char* path, size_t* n) {
    FILE* f = fopen(path, "rb"); if (!f) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END); *n = ftell(f); fseek(f, 0, SEEK_SET);
    char* b = (char*)malloc(*n + 1); if (fread(b, 1, *n, f) != *n) exit(3); fclose(f); return b;
}
"#;
    s
}

/// A random tensor of `ty`'s dtype and shape: floats in [-3, 3) (rounded to bf16 for bf16),
/// bools as 0/1.
fn random(ty: &hzp_ir::TensorType, seed: &mut u64) -> Tensor {
    let n = ty.numel();
    let mut next = || {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        (*seed >> 11) as f64 / (1u64 << 53) as f64
    };
    let v: Vec<f64> = (0..n)
        .map(|_| {
            let u = next();
            if ty.dtype == DType::Bool {
                (u < 0.5) as u8 as f64
            } else {
                6.0 * u - 3.0
            }
        })
        .collect();
    Tensor::from_f64(ty.dtype, ty.shape.clone(), &v)
}

fn bytes_of(t: &Tensor) -> Vec<u8> {
    use hzp_ir::tensor::Data;
    match &t.data {
        Data::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Data::BF16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        Data::Bool(v) => v.iter().map(|&b| b as u8).collect(),
        d => panic!("no fused operand of {:?}", d.dtype()),
    }
}

/// Units in the last place between element `k` of `got` (dtype `d`) and of `want`: 0 when
/// the bits are equal or both are NaN, `u32::MAX` when only one is NaN.
fn ulps(d: DType, got: &[u8], want: &Tensor, k: usize) -> u32 {
    use hzp_ir::tensor::Data;
    // floats as integers that order like them (sign-magnitude to two's complement)
    let key = |bits: u32, sign: u32| -> i64 {
        if bits & sign != 0 {
            -((bits & !sign) as i64)
        } else {
            bits as i64
        }
    };
    let (g, w, sign, nan) = match (&want.data, d) {
        (Data::F32(v), DType::F32) => {
            let g = f32::from_le_bytes(got[4 * k..4 * k + 4].try_into().unwrap());
            (
                g.to_bits(),
                v[k].to_bits(),
                1u32 << 31,
                (g.is_nan(), v[k].is_nan()),
            )
        }
        (Data::BF16(v), DType::BF16) => {
            let g = bf16::from_bits(u16::from_le_bytes(
                got[2 * k..2 * k + 2].try_into().unwrap(),
            ));
            (
                g.to_bits() as u32,
                v[k].to_bits() as u32,
                1u32 << 15,
                (g.is_nan(), v[k].is_nan()),
            )
        }
        _ => panic!("stored value of {d}"),
    };
    match nan {
        (true, true) => 0,
        (false, false) => key(g, sign).abs_diff(key(w, sign)).min(u32::MAX as u64) as u32,
        _ => u32::MAX,
    }
}

/// Whether node `n` computes a transcendental function (exp, log, tanh, erf and what is
/// made of them, sin, cos, a general power), whose CUDA code (`unary_f`, `binary_f`) and CPU
/// kernel may round differently: there the stored values may differ from the CPU's by a
/// few units in the last place; everywhere else they must be equal.
fn transcendental(n: &hzp_ir::Node) -> bool {
    use hzp_ir::{BinaryOp, Op, UnaryOp as U};
    match &n.op {
        Op::Unary(u) => matches!(
            u,
            U::Exp
                | U::Log
                | U::Tanh
                | U::Erf
                | U::Sigmoid
                | U::Gelu
                | U::GeluTanh
                | U::Silu
                | U::Sin
                | U::Cos
        ),
        Op::Binary(b) => *b == BinaryOp::Pow,
        _ => false,
    }
}

fn run_cmd(c: &mut std::process::Command) -> std::process::Output {
    let o = c.output().unwrap_or_else(|e| panic!("{c:?}: {e}"));
    assert!(
        o.status.success(),
        "{c:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

#[test]
fn fused_kernels_equal_the_nodes_they_replace() {
    // CI's machine has a C++ compiler (Rust's linker needs one): there this must run
    let Some(cxx) = skip::cxx_compiler(
        "fused_kernels_equal_the_nodes_they_replace",
        "emulate the fused kernels",
    ) else {
        return;
    };
    let dir = tempdir("fusion");
    let mut checked_runs = 0;
    let mut split_runs = 0;
    let mut checked_elements = 0usize;
    let (mut worst, mut worst_approx) = (0u32, 0u32);
    for (k, (model, shape, extra)) in PLANS.iter().enumerate() {
        let plan = compile(&dir, k, model, shape, extra);
        let low = fused_lowering(&plan);
        let p = &plan.program;
        let runs: Vec<Run> = fuse::runs(p, &low.loc);
        assert!(!runs.is_empty(), "{model}: nothing fused");
        assert_eq!(
            low.fused_source,
            runs.iter().map(|r| r.source.as_str()).collect::<String>()
        );
        // every run's kernel replaces its last node; its other members do no work
        for r in &runs {
            let (&last, rest) = r.nodes.split_last().unwrap();
            assert!(rest.iter().all(|&ni| low.nodes[ni].work.is_empty()));
            assert_eq!(low.nodes[last].work.len(), 1);
            assert!(r.nodes.windows(2).all(|w| w[1] == w[0] + 1));
        }
        let members: usize = runs.iter().map(|r| r.nodes.len()).sum();
        // a run that starts where the previous one ended, at the same shape, is the
        // remainder of a split (fuse::runs: too many operands, or an overlap)
        let shape_of = |ni: usize| &p.ty(p.nodes[ni].outputs[0]).shape;
        let split = runs
            .windows(2)
            .filter(|w| {
                let (a, b) = (*w[0].nodes.last().unwrap(), w[1].nodes[0]);
                b == a + 1 && shape_of(a) == shape_of(b)
            })
            .count();
        split_runs += split;
        eprintln!(
            "{model} {extra:?}: {} runs of {members} nodes (of {}), largest {}, {split} split",
            runs.len(),
            p.nodes.len(),
            runs.iter().map(|r| r.nodes.len()).max().unwrap()
        );
        // the emulation program: each run's kernel on the arena patched with its operands
        let mut src = emulation_prelude();
        src += &low.fused_source;
        src += "int main(int argc, char** argv) {\n";
        src += &format!(
            "    char* A = (char*)calloc({}, 1);\n    int k = atoi(argv[1]);\n",
            low.alloc_bytes
        );
        src += "    size_t n; char* in = read_all(argv[2], &n); size_t at = 0;\n";
        src += "    u64 parts; memcpy(&parts, in, 8); at = 8;\n";
        src += "    for (u64 q = 0; q < parts; ++q) { u64 off, len; memcpy(&off, in + at, 8); \
                memcpy(&len, in + at + 8, 8); memcpy(A + off, in + at + 16, len); at += 16 + len; }\n";
        src += "    switch (k) {\n";
        for (j, r) in runs.iter().enumerate() {
            let args: Vec<String> = r
                .launch
                .args
                .iter()
                .map(|a| match a {
                    Arg::Ptr(o) => format!("P{{A + {o}}}"),
                    other => panic!("fused kernel argument {other:?}"),
                })
                .collect();
            src += &format!(
                "    case {j}: gridDim.x = {}; blockDim.x = {}; \
                 for (blockIdx.x = 0; blockIdx.x < gridDim.x; ++blockIdx.x) \
                 for (threadIdx.x = 0; threadIdx.x < blockDim.x; ++threadIdx.x) {}({}); break;\n",
                r.launch.grid,
                r.launch.block,
                r.launch.kernel,
                args.join(", ")
            );
        }
        src += "    }\n    u64 outs; memcpy(&outs, in + at, 8); at += 8;\n";
        src += "    for (u64 q = 0; q < outs; ++q) { u64 off, len; memcpy(&off, in + at, 8); \
                memcpy(&len, in + at + 8, 8); fwrite(A + off, 1, len, stdout); at += 16; }\n";
        src += "    return 0;\n}\n";
        let cpp = dir.join(format!("fused{k}.cpp"));
        let exe = dir.join(format!("fused{k}"));
        std::fs::write(&cpp, &src).unwrap();
        run_cmd(
            std::process::Command::new(&cxx)
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
        let mut seed = 0x9e3779b97f4a7c15u64 ^ k as u64;
        for (j, r) in runs.iter().enumerate() {
            // the operands, random; the reference: the run's nodes one by one on the CPU
            let mut vals: HashMap<hzp_ir::ValueId, Tensor> = HashMap::new();
            let mut input = Vec::new();
            input.extend((r.operands.len() as u64).to_le_bytes());
            for &v in &r.operands {
                let t = random(p.ty(v), &mut seed);
                let b = bytes_of(&t);
                input.extend(low.loc[v.index()].0.to_le_bytes());
                input.extend((b.len() as u64).to_le_bytes());
                input.extend(b);
                vals.insert(v, t);
            }
            for &ni in &r.nodes {
                let n = &p.nodes[ni];
                let ins: Vec<&Tensor> = n.inputs.iter().map(|v| &vals[v]).collect();
                let out = hzp_runtime::cpu::eval_op(&n.op, &ins)
                    .unwrap_or_else(|e| panic!("node `{}`: {e}", n.name));
                vals.insert(n.outputs[0], out.into_iter().next().unwrap());
            }
            input.extend((r.stored.len() as u64).to_le_bytes());
            for &v in &r.stored {
                input.extend(low.loc[v.index()].0.to_le_bytes());
                input.extend((p.ty(v).size_bytes() as u64).to_le_bytes());
            }
            let inp = dir.join(format!("in{k}_{j}.bin"));
            std::fs::write(&inp, &input).unwrap();
            let o = run_cmd(
                std::process::Command::new(&exe)
                    .arg(j.to_string())
                    .arg(&inp),
            );
            let approx = r.nodes.iter().any(|&ni| transcendental(&p.nodes[ni]));
            let mut at = 0;
            for &v in &r.stored {
                let ty = p.ty(v);
                let got = &o.stdout[at..at + ty.size_bytes()];
                at += ty.size_bytes();
                let want = &vals[&v];
                for e in 0..ty.numel() {
                    let d = ulps(ty.dtype, got, want, e);
                    worst = worst.max(if approx { 0 } else { d });
                    worst_approx = worst_approx.max(if approx { d } else { 0 });
                    assert!(
                        d == 0 || (approx && d <= 4),
                        "{model} {extra:?}: run {j} ({} .. {}), value `{}` element {e}: {d} ulps",
                        p.nodes[r.nodes[0]].name,
                        p.nodes[*r.nodes.last().unwrap()].name,
                        p.value(v).name
                    );
                }
                checked_elements += ty.numel();
            }
            assert_eq!(at, o.stdout.len());
            checked_runs += 1;
        }
    }
    eprintln!(
        "{checked_runs} fused kernels, {checked_elements} stored elements: {worst} ulps apart \
         without transcendental functions, at most {worst_approx} with them"
    );
    assert!(checked_runs >= 8, "{checked_runs}");
    // the tiny plans have runs that one kernel cannot take whole: their parts are checked too
    assert!(split_runs >= 1, "no split run was checked");
}

/// With the `cuda` feature and NVRTC found: the fixed sources with the plans' generated
/// kernels compile to PTX for Ampere and Hopper, every generated kernel present.
#[cfg(feature = "cuda")]
#[test]
fn fused_kernels_compile_with_nvrtc() {
    use hzp_runtime::cuda::probe::{probe, Lib, LibState};
    let pr = probe();
    if *pr.state(Lib::Nvrtc) == LibState::Missing {
        assert!(
            std::env::var_os("HZP_REQUIRE_NVRTC").is_none(),
            "HZP_REQUIRE_NVRTC is set but libnvrtc.so.12 was not found (searched {:?})",
            pr.searched
        );
        skip::skip(
            "fused_kernels_compile_with_nvrtc",
            skip::Missing::Nvrtc,
            &format!("libnvrtc.so.12 not found (searched {:?})", pr.searched),
        );
        return;
    }
    pr.preload(&[Lib::Nvrtc]).unwrap();
    let dir = tempdir("fusion-nvrtc");
    let mut kernels = 0;
    for (k, (model, shape, extra)) in PLANS.iter().enumerate() {
        let plan = compile(&dir, k, model, shape, extra);
        let low = fused_lowering(&plan);
        let names: Vec<&str> = low
            .nodes
            .iter()
            .flat_map(|n| &n.work)
            .filter_map(|w| match w {
                hzp_runtime::cuda::lower::Work::Kernel(l) if l.kernel.starts_with("fused_") => {
                    Some(l.kernel.as_str())
                }
                _ => None,
            })
            .collect();
        assert!(!names.is_empty());
        for arch in ["compute_80", "compute_90"] {
            let ptx = hzp_runtime::cuda::compile(
                &format!("--gpu-architecture={arch}"),
                false,
                &low.fused_source,
            )
            .unwrap_or_else(|e| panic!("{model} {arch}: {e}"));
            let text = String::from_utf8_lossy(&ptx);
            for n in &names {
                assert!(text.contains(&format!(".entry {n}(")), "{arch}: no {n}");
            }
        }
        kernels += names.len();
    }
    eprintln!("{kernels} generated kernels compiled with NVRTC");
}

/// GPT-2 small (`preset:gpt`, attention written out), f32 and bf16: how much of the step's
/// elementwise work fuses and the memory traffic of the fused nodes before and after (what
/// README's CUDA section quotes; `cargo test --test cuda_fusion gpt2_small -- --nocapture`).
#[test]
fn gpt2_small_fusion_counts() {
    let dir = tempdir("fusion-gpt2s");
    for (k, extra) in [["--precision", "fp32"], ["--precision", "bf16"]]
        .iter()
        .enumerate()
    {
        let plan = compile(&dir, 100 + k, "preset:gpt", "", extra);
        let low = fused_lowering(&plan);
        let p = &plan.program;
        let runs = fuse::runs(p, &low.loc);
        let members: usize = runs.iter().map(|r| r.nodes.len()).sum();
        let (before, after) = fuse::traffic(p, &runs);
        eprintln!(
            "preset:gpt {extra:?}: {} runs replace {members} of {} nodes ({} fusible; {} \
             launches fewer); their memory traffic {:.2} GB -> {:.2} GB per step",
            runs.len(),
            p.nodes.len(),
            fuse::fusible_nodes(p),
            members - runs.len(),
            before as f64 / 1e9,
            after as f64 / 1e9
        );
        assert!(runs.len() >= 24, "{}", runs.len());
        assert!(after < before);
    }
}
