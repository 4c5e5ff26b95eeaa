//! The CUDA backend's row kernels (`runtime/src/cuda/kernels/reduce.cu`: `softmax_k`,
//! `xent_k`, `norm_k`, `norm_grad_k`), as far as a machine without a GPU can check them.
//! Small programs of Softmax, LogSoftmax, SoftmaxCrossEntropy(Grad), LayerNorm, RmsNorm and
//! their gradients are lowered for the CUDA backend, and the lowering's launches run on the
//! CPU as C++: the same `reduce.cu` and `common.cuh` source, with a small CUDA shim in which
//! each block of a launch runs as `blockDim.x` (the lowering's 256) real threads,
//! `__syncthreads()` a C++20 `std::barrier` of the block, `__shared__` arrays statics (one
//! block runs at a time), compiled with `-ffp-contract=off` (NVRTC is given
//! `--fmad=false`). Every output is compared with hzp's CPU executor (the kernels of
//! `runtime/kernels/src/cpu/norm.rs`) in f32, bf16 and f16, on rows of 3, 64 and 300
//! elements (and a class axis that is not last for the softmaxes and the cross-entropy).
//!
//! What must hold, and why not always bit for bit:
//! - LayerNorm / RmsNorm forward and the gradient's `dy * xhat`: equal bit for bit. Both
//!   sides sum the statistics in f64 (in different orders, f32 terms: the sums agree to far
//!   below an f32 ulp, and on these inputs the rounded mean and rstd are the same), then do
//!   the same f32 operations per element.
//! - The norm gradient's `dx`: the CPU sums `g` and `g * xhat` in f32 lanes of at most 16
//!   terms before f64, the kernel in f64, so the two means differ by up to 2^-20 of the
//!   sum of the terms' magnitudes; `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))` can
//!   cancel. Asserted: |got - cpu| <= 1 ulp of the output type at the CPU's value
//!   + 2^-20 * rstd * (|g| + mean|g| + |xhat| * (1 + mean|g * xhat|)).
//! - Softmax, LogSoftmax and the cross-entropy's loss and gradient: the exponential differs
//!   (the CPU's own polynomial `math::exp`, the C++ library's `expf` here, CUDA's `expf` on
//!   a GPU: each within a couple of f32 ulps) and the CPU sums exp(x - m) in f32 lanes.
//!   Asserted: |got - cpu| <= 1 ulp of the output type at the CPU's value + 2^-20 * S, S
//!   the magnitude of the element's terms: the probability (softmax), |x - m| + |lse|
//!   (LogSoftmax), |m| + |lse| + |x[label]| (loss), p * |dy| (+ |dy| at the label)
//!   (gradient).
//!
//! A label outside the classes sets the error word to the node's code, the lane's output
//! zero and the other lanes as on the CPU (where the step fails). A mutated source (one
//! operation of `norm_grad_k` and one of `xent_k` changed) must fail the comparison. NVRTC compiles the source in
//! `runtime/tests/cuda_kernels.rs`.

mod common;
#[path = "../../tests/common/skip.rs"]
mod skip;

use common::{bytes_of, emulation_input, plan_of, run_cmd, tempdir, Rng, EMULATION_MAIN};
use hzp_ir::{DType, Plan, Tensor};
use hzp_runtime::cuda::lower::{lower_program, Arg, LoweredPlan, Work};
use hzp_runtime::executor::PlanExecutor;
use std::collections::HashMap;
use std::path::Path;

/// The values of `bytes` read as `dtype`, widened to f64.
fn floats_of(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    match dtype {
        DType::F32 => bytes
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
            .collect(),
        DType::BF16 => bytes
            .chunks(2)
            .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16) as f64)
            .collect(),
        DType::F16 => bytes
            .chunks(2)
            .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f64())
            .collect(),
        d => panic!("not a float dtype: {d}"),
    }
}

/// The distance from |v| to the next larger value of `dtype` (its ulp there).
fn ulp(dtype: DType, v: f64) -> f64 {
    let (mant, min_exp) = match dtype {
        DType::F32 => (23, -126),
        DType::BF16 => (7, -126),
        DType::F16 => (10, -14),
        d => panic!("not a float dtype: {d}"),
    };
    let e = if v == 0.0 {
        min_exp
    } else {
        (v.abs().log2().floor() as i32).max(min_exp)
    };
    2f64.powi(e - mant)
}

/// The CUDA shim, `common.cuh` (its two f16 conversions, inline PTX, written with the
/// compiler's `_Float16`), the dtype lists of `elementwise.cu`, and `reduce.cu` with the
/// replacements `edit` asks (the mutation check).
fn emulation_prelude(edits: &[(&str, &str)]) -> String {
    let mut common = hzp_runtime::cuda::kernels::COMMON.to_string();
    for (from, to) in [
        (
            r#"    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));"#,
            "    _Float16 h; memcpy(&h, &v.x, 2); f = (float)h;",
        ),
        (
            r#"    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.x) : "f"(v));"#,
            "    _Float16 h = (_Float16)v; memcpy(&r.x, &h, 2);",
        ),
    ] {
        assert!(common.contains(from), "no `{from}` in common.cuh");
        common = common.replace(from, to);
    }
    let elementwise = hzp_runtime::cuda::kernels::ELEMENTWISE;
    let types: String = elementwise
        .lines()
        .filter(|l| l.starts_with("#define FLOAT_TYPES(") || l.starts_with("#define INT_TYPES("))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(
        types.lines().count(),
        2,
        "the dtype lists of elementwise.cu"
    );
    let mut reduce = hzp_runtime::cuda::kernels::REDUCE.to_string();
    for (from, to) in edits {
        assert_eq!(
            reduce.matches(from).count(),
            1,
            "`{from}` once in reduce.cu"
        );
        reduce = reduce.replace(from, to);
    }
    let mut s = String::from(
        r#"#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <barrier>
#include <thread>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __global__
#define __shared__ static
struct Dim { unsigned x; };
// blocks run one after another: the block's coordinates are plain statics, the thread's
// own index is the thread's
static Dim blockIdx, blockDim, gridDim;
static thread_local Dim threadIdx;
static std::barrier<>* block_barrier;
static inline void __syncthreads() { block_barrier->arrive_and_wait(); }
static inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline int atomicCAS(int* a, int compare, int v) {
    __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}
"#,
    );
    s += &common;
    s += &types;
    s += &reduce;
    s += r#"
struct P { char* p; template <class T> operator T*() const { return (T*)p; } };
static char* read_all(const char* path, size_t* n) {
    FILE* f = fopen(path, "rb"); if (!f) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END); *n = ftell(f); fseek(f, 0, SEEK_SET);
    char* b = (char*)malloc(*n + 1); if (fread(b, 1, *n, f) != *n) exit(3); fclose(f); return b;
}
// each block: blockDim.x threads meeting at the block's barrier
#define LAUNCH(G, B, CALL) { \
    gridDim.x = G; blockDim.x = B; \
    for (blockIdx.x = 0; blockIdx.x < gridDim.x; ++blockIdx.x) { \
        std::barrier<> bar(B); block_barrier = &bar; \
        std::vector<std::thread> ts; \
        for (unsigned t = 0; t < (unsigned)(B); ++t) \
            ts.emplace_back([&, t] { threadIdx.x = t; CALL; }); \
        for (auto& th : ts) th.join(); \
    } }
"#;
    s
}

/// An n-d walk argument as a C++ `Nd` value.
fn nd_literal(nd: &hzp_runtime::cuda::work::Nd) -> String {
    let arr = |v: &[i64]| {
        let mut a: Vec<String> = v.iter().map(|x| format!("{x}LL")).collect();
        a.resize(8, "0".into());
        format!("{{{}}}", a.join(", "))
    };
    format!(
        "Nd{{{}, {}, {}, {}, {}, {}}}",
        nd.shape.len(),
        arr(&nd.shape),
        arr(&nd.s[0]),
        arr(&nd.s[1]),
        arr(&nd.s[2]),
        arr(&nd.s[3])
    )
}

/// What a case's outputs are compared by (see the module's comment).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Softmax,
    LogSoftmax,
    Loss,
    LossGrad,
    Norm,
    NormGrad,
}

/// One program to emulate: its plan, the lowering, its inputs, the outputs compared.
struct Case {
    name: String,
    kind: Kind,
    dtype: DType,
    plan: Plan,
    low: LoweredPlan,
    inputs: HashMap<String, Tensor>,
    outputs: Vec<&'static str>,
}

impl Case {
    fn new(
        name: &str,
        kind: Kind,
        dtype: DType,
        src: &str,
        inputs: HashMap<String, Tensor>,
        outputs: Vec<&'static str>,
    ) -> Case {
        let p = hzp_ir::text::parse(src, name, &|_| None).unwrap_or_else(|e| panic!("{e}"));
        let plan = plan_of(p);
        let low = lower_program(&plan, 0).unwrap_or_else(|e| panic!("{name}: {e}"));
        Case {
            name: name.into(),
            kind,
            dtype,
            plan,
            low,
            inputs,
            outputs,
        }
    }

    /// The C++ function that runs every launch of the lowering in order; the kernels
    /// launched.
    fn function(&self, k: usize) -> (String, Vec<String>) {
        let mut s = format!("static void case{k}(char* A) {{\n");
        let mut kernels = Vec::new();
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
                        Arg::F32(v) => format!("__uint_as_float({}u)", v.to_bits()),
                        Arg::Ptr(o) => format!("P{{A + {o}}}"),
                        Arg::Null => "P{nullptr}".into(),
                        Arg::ErrFlag => format!("P{{A + {}}}", self.low.err_offset),
                        Arg::Nd(nd) => nd_literal(nd),
                        other => panic!("a row kernel argument {other:?}"),
                    })
                    .collect();
                s += &format!(
                    "    LAUNCH({}, {}, {}({}))\n",
                    l.grid,
                    l.block,
                    l.kernel,
                    args.join(", ")
                );
                kernels.push(l.kernel.clone());
            }
        }
        (s + "}\n", kernels)
    }

    /// The CPU executor's outputs (`Err`: the step's error).
    fn cpu(&self) -> Result<Vec<Tensor>, String> {
        let mut ex: Box<dyn PlanExecutor> = Box::new(
            hzp_runtime::exec::Executor::new(&self.plan, &[], Default::default())
                .map_err(|e| e.to_string())?,
        );
        let inputs: Vec<(String, Tensor)> = self
            .inputs
            .iter()
            .map(|(n, t)| (n.trim_start_matches('%').to_string(), t.clone()))
            .collect();
        ex.set_inputs(&inputs).map_err(|e| e.to_string())?;
        ex.step().map_err(|e| e.to_string())?;
        Ok(self
            .outputs
            .iter()
            .map(|n| {
                ex.value(0, n.trim_start_matches('%'))
                    .unwrap()
                    .unwrap_or_else(|| panic!("{}: no {n}", self.name))
            })
            .collect())
    }
}

const CXX_FLAGS: [&str; 5] = [
    "-O1",
    "-std=c++20",
    "-pthread",
    "-fno-fast-math",
    "-ffp-contract=off",
];

/// The C++ compiler when it runs and has C++20's `<barrier>`; otherwise records the skip
/// of `test` (a failure where `CI` is set) and gives `None`.
fn cxx20(test: &str, dir: &Path) -> Option<String> {
    let cxx = skip::cxx_compiler(test, "emulate the row kernels")?;
    let src = dir.join("barrier.cpp");
    std::fs::write(
        &src,
        "#include <barrier>\n#include <thread>\nint main() { std::barrier<> b(1); \
         b.arrive_and_wait(); std::thread t([] {}); t.join(); }\n",
    )
    .unwrap();
    let ok = std::process::Command::new(&cxx)
        .args(CXX_FLAGS)
        .arg("-o")
        .arg(dir.join("barrier"))
        .arg(&src)
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(cxx);
    }
    skip::skip(
        test,
        skip::Missing::Cxx,
        &format!("`{cxx}` does not compile C++20's <barrier> (-std=c++20 -pthread) to emulate the row kernels"),
    );
    None
}

/// Compiles the cases into one program (`edits`: replacements in `reduce.cu`) and runs
/// each: per case, the outputs' bytes and the error word; and the kernels launched.
fn emulate(
    cxx: &str,
    dir: &Path,
    cases: &[Case],
    edits: &[(&str, &str)],
) -> (Vec<(Vec<u8>, i32)>, Vec<String>) {
    let mut src = emulation_prelude(edits);
    let mut launched = Vec::new();
    for (k, c) in cases.iter().enumerate() {
        let (f, ks) = c.function(k);
        src += &f;
        launched.extend(ks);
    }
    src += "static void run_case(int k, char* A) {\n    switch (k) {\n";
    for k in 0..cases.len() {
        src += &format!("    case {k}: case{k}(A); break;\n");
    }
    src += "    }\n}\n";
    src += EMULATION_MAIN;
    let cpp = dir.join("reduce.cpp");
    let exe = dir.join("reduce");
    std::fs::write(&cpp, &src).unwrap();
    run_cmd(
        std::process::Command::new(cxx)
            .args(CXX_FLAGS)
            .arg("-o")
            .arg(&exe)
            .arg(&cpp),
    );
    let got = cases
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let inp = dir.join(format!("in{k}.bin"));
            std::fs::write(
                &inp,
                emulation_input(&c.plan, &c.low, &c.inputs, &c.outputs),
            )
            .unwrap();
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
        .collect();
    (got, launched)
}

fn random(rng: &mut Rng, dtype: DType, shape: Vec<usize>, lo: f64, hi: f64) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| lo + (hi - lo) * rng.next()).collect();
    Tensor::from_f64(dtype, shape, &v)
}

const EPS: f32 = 1e-5;

/// The cases: every kernel family on rows of 3, 64 and 300 elements in f32, bf16 and f16,
/// and the softmaxes and the cross-entropy along an axis that is not last.
/// `labels`: the cross-entropy's labels (`None`: drawn in range).
fn cases(labels: Option<Vec<i64>>) -> Vec<Case> {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut out = Vec::new();
    let dtypes = [DType::F32, DType::BF16, DType::F16];
    // (leading shape, the normalized / class length, the axis' position from the end)
    let shapes: [(&[usize], usize, bool); 4] = [
        (&[3], 64, true),
        (&[2], 300, true),
        (&[4], 3, true),
        (&[3], 7, false),
    ];
    for &(lead, d, last) in shapes.iter() {
        for (di, &dt) in dtypes.iter().enumerate() {
            let rows: usize = lead.iter().product();
            // the lanes' shape and axis: [rows, d] axis 1, or [d, rows] axis 0
            let (xs, axis) = if last {
                (vec![rows, d], 1)
            } else {
                (vec![d, rows], 0)
            };
            let shp = |v: &[usize]| {
                v.iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let xsh = shp(&xs);
            let tag = format!("{dt}_{}", shp(&xs).replace(',', "x"));
            let x = random(&mut rng, dt, xs.clone(), -4.0, 4.0);
            // softmax and log-softmax
            for (kind, op) in [(Kind::Softmax, "Softmax"), (Kind::LogSoftmax, "LogSoftmax")] {
                let src = format!(
                    "program \"r\"\nmesh gpu=1\n\ninput %x : {dt}[{xsh}]\n\
                     %y = {op}{{axis={axis}}}(%x) : {dt}[{xsh}] \"n\"\noutput %y\n"
                );
                out.push(Case::new(
                    &format!("{op}_{tag}"),
                    kind,
                    dt,
                    &src,
                    HashMap::from([("%x".to_string(), x.clone())]),
                    vec!["%y"],
                ));
            }
            // the cross-entropy: i64 labels, i32 for bf16
            let ldt = if dt == DType::BF16 {
                DType::I32
            } else {
                DType::I64
            };
            let l: Vec<f64> = match &labels {
                Some(v) => v.iter().take(rows).map(|&x| x as f64).collect(),
                None => (0..rows)
                    .map(|_| ((rng.next() * d as f64) as usize).min(d - 1) as f64)
                    .collect(),
            };
            let lt = Tensor::from_f64(ldt, vec![rows], &l);
            let dy = random(&mut rng, dt, vec![rows], 0.25, 2.0);
            let src = format!(
                "program \"r\"\nmesh gpu=1\n\ninput %x : {dt}[{xsh}]\ninput %l : {ldt}[{rows}]\n\
                 %loss = SoftmaxCrossEntropy{{axis={axis}}}(%x, %l) : {dt}[{rows}] \"loss\"\n\
                 output %loss\n"
            );
            let ins = HashMap::from([("%x".to_string(), x.clone()), ("%l".to_string(), lt)]);
            out.push(Case::new(
                &format!("xent_{tag}"),
                Kind::Loss,
                dt,
                &src,
                ins.clone(),
                vec!["%loss"],
            ));
            let src = format!(
                "program \"r\"\nmesh gpu=1\n\ninput %x : {dt}[{xsh}]\ninput %l : {ldt}[{rows}]\n\
                 input %dy : {dt}[{rows}]\n\
                 %dx = SoftmaxCrossEntropyGrad{{axis={axis}}}(%x, %l, %dy) : {dt}[{xsh}] \"loss_grad\"\n\
                 output %dx\n"
            );
            let mut gins = ins;
            gins.insert("%dy".to_string(), dy);
            out.push(Case::new(
                &format!("xent_grad_{tag}"),
                Kind::LossGrad,
                dt,
                &src,
                gins,
                vec!["%dx"],
            ));
            if !last {
                continue;
            }
            // the norms over the last axis: LayerNorm with and without a bias, RmsNorm
            let xn = random(&mut rng, dt, xs.clone(), -3.0, 5.0);
            let scale = random(&mut rng, dt, vec![d], 0.5, 1.5);
            let bias = random(&mut rng, dt, vec![d], -1.0, 1.0);
            let dyn_ = random(&mut rng, dt, xs.clone(), -2.0, 2.0);
            for (op, with_bias) in [
                ("LayerNorm", true),
                ("LayerNorm", false),
                ("RmsNorm", false),
            ] {
                // (the bias-less LayerNorm on every other dtype, to keep the count small)
                if op == "LayerNorm" && !with_bias && di == 1 {
                    continue;
                }
                let (bias_in, bias_arg) = if with_bias {
                    (format!("input %b : {dt}[{d}]\n"), ", %b")
                } else {
                    (String::new(), "")
                };
                let src = format!(
                    "program \"r\"\nmesh gpu=1\n\ninput %x : {dt}[{xsh}]\ninput %s : {dt}[{d}]\n\
                     {bias_in}%y = {op}{{axis=1, epsilon={EPS:e}}}(%x, %s{bias_arg}) : {dt}[{xsh}] \"n\"\n\
                     output %y\n"
                );
                let mut ins = HashMap::from([
                    ("%x".to_string(), xn.clone()),
                    ("%s".to_string(), scale.clone()),
                ]);
                if with_bias {
                    ins.insert("%b".to_string(), bias.clone());
                }
                let b = if with_bias { "_bias" } else { "" };
                out.push(Case::new(
                    &format!("{op}{b}_{tag}"),
                    Kind::Norm,
                    dt,
                    &src,
                    ins,
                    vec!["%y"],
                ));
            }
            for op in ["LayerNormGrad", "RmsNormGrad"] {
                let src = format!(
                    "program \"r\"\nmesh gpu=1\n\ninput %x : {dt}[{xsh}]\ninput %s : {dt}[{d}]\n\
                     input %dy : {dt}[{xsh}]\n\
                     %dx, %yh = {op}{{axis=1, epsilon={EPS:e}}}(%x, %s, %dy) : {dt}[{xsh}], {dt}[{xsh}] \"g\"\n\
                     output %dx\noutput %yh\n"
                );
                let ins = HashMap::from([
                    ("%x".to_string(), xn.clone()),
                    ("%s".to_string(), scale.clone()),
                    ("%dy".to_string(), dyn_.clone()),
                ]);
                out.push(Case::new(
                    &format!("{op}_{tag}"),
                    Kind::NormGrad,
                    dt,
                    &src,
                    ins,
                    vec!["%dx", "%yh"],
                ));
            }
        }
    }
    out
}

/// Per element of output `o` of `case`: the magnitude S of its terms (see the module's
/// comment), from the inputs in f64; `None` where the output must be equal bit for bit.
fn magnitudes(case: &Case, o: usize) -> Option<Vec<f64>> {
    let x = case.inputs["%x"].to_f64_vec();
    let shape = case.inputs["%x"].shape.clone();
    match case.kind {
        Kind::Norm => None,
        Kind::NormGrad if o == 1 => None,
        Kind::NormGrad => {
            let d = shape[1];
            let s = case.inputs["%s"].to_f64_vec();
            let dy = case.inputs["%dy"].to_f64_vec();
            let rms = case.name.starts_with("Rms");
            let mut out = Vec::new();
            for (xr, gr) in x.chunks(d).zip(dy.chunks(d)) {
                let mean = if rms {
                    0.0
                } else {
                    xr.iter().sum::<f64>() / d as f64
                };
                let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
                let rstd = 1.0 / (var + EPS as f64).sqrt();
                let g: Vec<f64> = gr.iter().zip(&s).map(|(a, b)| a * b).collect();
                let xh: Vec<f64> = xr.iter().map(|v| (v - mean) * rstd).collect();
                let mg = g.iter().map(|v| v.abs()).sum::<f64>() / d as f64;
                let mgx = g.iter().zip(&xh).map(|(a, b)| (a * b).abs()).sum::<f64>() / d as f64;
                for j in 0..d {
                    out.push(rstd * (g[j].abs() + mg + xh[j].abs() * (1.0 + mgx)));
                }
            }
            Some(out)
        }
        Kind::Softmax | Kind::LogSoftmax | Kind::Loss | Kind::LossGrad => {
            // lanes (outer, dim, inner) as the kernels walk them
            let (dim, inner) = lane_shape(case);
            let outer = x.len() / (dim * inner);
            let labels = case.inputs.get("%l").map(|t| t.to_f64_vec());
            let dy = case.inputs.get("%dy").map(|t| t.to_f64_vec());
            let n = if case.kind == Kind::Loss {
                outer * inner
            } else {
                x.len()
            };
            let mut out = vec![0.0; n];
            for o in 0..outer {
                for i in 0..inner {
                    let lane = o * inner + i;
                    let at = |d: usize| (o * dim + d) * inner + i;
                    let m = (0..dim).map(|d| x[at(d)]).fold(f64::MIN, f64::max);
                    let s: f64 = (0..dim).map(|d| (x[at(d)] - m).exp()).sum();
                    let lse = s.ln();
                    match case.kind {
                        Kind::Softmax => {
                            (0..dim).for_each(|d| out[at(d)] = (x[at(d)] - m).exp() / s)
                        }
                        Kind::LogSoftmax => {
                            (0..dim).for_each(|d| out[at(d)] = (x[at(d)] - m).abs() + lse.abs())
                        }
                        Kind::Loss => {
                            let l = labels.as_ref().unwrap()[lane] as usize;
                            out[lane] = m.abs() + lse.abs() + x[at(l.min(dim - 1))].abs();
                        }
                        _ => {
                            let l = labels.as_ref().unwrap()[lane] as usize;
                            let g = dy.as_ref().unwrap()[lane].abs();
                            for d in 0..dim {
                                let p = (x[at(d)] - m).exp() / s;
                                out[at(d)] = p * g + if d == l { g } else { 0.0 };
                            }
                        }
                    }
                }
            }
            Some(out)
        }
    }
}

/// (dim, inner) of the lanes of a softmax or cross-entropy case, from its launch.
fn lane_shape(case: &Case) -> (usize, usize) {
    for nw in &case.low.nodes {
        for w in &nw.work {
            if let Work::Kernel(l) = w {
                if let (Arg::I64(d), Arg::I64(i)) = (&l.args[1], &l.args[2]) {
                    return (*d as usize, *i as usize);
                }
            }
        }
    }
    panic!("{}: no lane launch", case.name)
}

/// The comparison of one case's emulated outputs with the CPU's: the largest excess over
/// the bound (0 when within it; any excess for an output that must be equal bit for bit is
/// reported as infinite), and a description of the worst element.
fn compare(case: &Case, got: &[u8], want: &[Tensor]) -> (f64, String) {
    let mut at = 0;
    let mut worst = (0.0, String::new());
    for (o, w) in want.iter().enumerate() {
        let wb = bytes_of(w);
        let g = &got[at..at + wb.len()];
        at += wb.len();
        match magnitudes(case, o) {
            None => {
                if g != &wb[..] {
                    let first = g.iter().zip(&wb).position(|(a, b)| a != b).unwrap();
                    return (
                        f64::INFINITY,
                        format!(
                            "{} {}: differs from the CPU at byte {first} of {}",
                            case.name,
                            case.outputs[o],
                            wb.len()
                        ),
                    );
                }
            }
            Some(mag) => {
                let gv = floats_of(case.dtype, g);
                let wv = floats_of(case.dtype, &wb);
                assert_eq!(mag.len(), wv.len(), "{}", case.name);
                for (j, ((a, b), s)) in gv.iter().zip(&wv).zip(&mag).enumerate() {
                    let bound = ulp(case.dtype, *b) + s * 2f64.powi(-20);
                    let diff = (a - b).abs();
                    let excess = if diff.is_nan() {
                        f64::INFINITY
                    } else {
                        diff / bound
                    };
                    if excess > worst.0 {
                        worst = (
                            excess,
                            format!(
                                "{} {}[{j}]: {a} vs the CPU's {b} (bound {bound:e}, S {s:e})",
                                case.name, case.outputs[o]
                            ),
                        );
                    }
                }
            }
        }
    }
    assert_eq!(at, got.len(), "{}", case.name);
    worst
}

#[test]
fn row_kernels_equal_the_cpu_kernels_within_the_stated_bounds() {
    const TEST: &str = "row_kernels_equal_the_cpu_kernels_within_the_stated_bounds";
    let dir = tempdir("cuda-reduce");
    let Some(cxx) = cxx20(TEST, &dir) else {
        return;
    };
    let cases = cases(None);
    let (got, launched) = emulate(&cxx, &dir, &cases, &[]);
    let mut worst = (0.0f64, String::new());
    let mut bitwise = 0;
    for (case, (bytes, err)) in cases.iter().zip(&got) {
        assert_eq!(*err, 0, "{}: the error word is set", case.name);
        let want = case
            .cpu()
            .unwrap_or_else(|e| panic!("{}: the CPU: {e}", case.name));
        let (excess, what) = compare(case, bytes, &want);
        bitwise += (0..case.outputs.len())
            .filter(|&o| magnitudes(case, o).is_none())
            .count();
        eprintln!("{}: worst {excess:.3} of the bound {what}", case.name);
        if excess > worst.0 {
            worst = (excess, what);
        }
    }
    // every family in every dtype ran
    for fam in ["softmax", "xent", "norm", "norm_grad"] {
        for dt in ["f32", "bf16", "f16"] {
            let k = format!("{fam}_{dt}");
            assert!(launched.contains(&k), "no launch of {k}: {launched:?}");
        }
    }
    eprintln!(
        "{} programs ({bitwise} outputs equal bit for bit); the worst element: {:.3} of its bound ({})",
        cases.len(),
        worst.0,
        worst.1
    );
    assert!(worst.0 <= 1.0, "over the bound: {}", worst.1);
}

/// A label outside the classes (too large, negative; i64 and i32 labels): the error word
/// holds the node's code (1: its only node), the lane's loss or gradient row is zero, and
/// the other lanes are as on the CPU with the labels in range (within the bounds above);
/// the CPU executor refuses the step, naming the label.
#[test]
fn a_label_out_of_range_sets_the_error_word() {
    const TEST: &str = "a_label_out_of_range_sets_the_error_word";
    let dir = tempdir("cuda-reduce-bad");
    let Some(cxx) = cxx20(TEST, &dir) else {
        return;
    };
    let (rows, d) = (4usize, 300usize);
    let mut rng = Rng(11);
    let x = random(&mut rng, DType::F32, vec![rows, d], -4.0, 4.0);
    let dy = random(&mut rng, DType::F32, vec![rows], 0.25, 2.0);
    // (labels, label dtype, bad lanes)
    let sets: [(Vec<i64>, DType, Vec<usize>); 3] = [
        (vec![5, 300, 17, 299], DType::I64, vec![1]),
        (vec![-1, 0, 1000, 2], DType::I32, vec![0, 2]),
        (vec![3, 4, 5, 6], DType::I64, vec![]),
    ];
    let mut bad_cases = Vec::new();
    let mut twins = Vec::new();
    for (k, (labels, ldt, _)) in sets.iter().enumerate() {
        for grad in [false, true] {
            let (body, out, kind) = if grad {
                (
                    format!("input %dy : f32[{rows}]\n%y = SoftmaxCrossEntropyGrad{{axis=1}}(%x, %l, %dy) : f32[{rows},{d}] \"xent\"\n"),
                    "%y",
                    Kind::LossGrad,
                )
            } else {
                (
                    format!("%y = SoftmaxCrossEntropy{{axis=1}}(%x, %l) : f32[{rows}] \"xent\"\n"),
                    "%y",
                    Kind::Loss,
                )
            };
            let src = format!(
                "program \"r\"\nmesh gpu=1\n\ninput %x : f32[{rows},{d}]\ninput %l : {ldt}[{rows}]\n{body}output %y\n"
            );
            let mk = |l: &[i64]| {
                let lf: Vec<f64> = l.iter().map(|&v| v as f64).collect();
                let mut ins = HashMap::from([
                    ("%x".to_string(), x.clone()),
                    ("%l".to_string(), Tensor::from_f64(*ldt, vec![rows], &lf)),
                ]);
                if grad {
                    ins.insert("%dy".to_string(), dy.clone());
                }
                ins
            };
            let fixed: Vec<i64> = labels.iter().map(|&l| l.clamp(0, d as i64 - 1)).collect();
            let name = format!("bad{k}_{}", if grad { "grad" } else { "loss" });
            bad_cases.push(Case::new(
                &name,
                kind,
                DType::F32,
                &src,
                mk(labels),
                vec![out],
            ));
            twins.push(Case::new(
                &name,
                kind,
                DType::F32,
                &src,
                mk(&fixed),
                vec![out],
            ));
        }
    }
    let (got, _) = emulate(&cxx, &dir, &bad_cases, &[]);
    for (((case, twin), (bytes, err)), k) in bad_cases
        .iter()
        .zip(&twins)
        .zip(&got)
        .zip((0..sets.len()).flat_map(|k| [k, k]))
    {
        let bad = &sets[k].2;
        assert_eq!(
            *err,
            if bad.is_empty() { 0 } else { 1 },
            "{}: the error word",
            case.name
        );
        let cpu = case.cpu();
        if bad.is_empty() {
            assert!(cpu.is_ok(), "{}: {cpu:?}", case.name);
        } else {
            let e = cpu.expect_err("the CPU refuses a bad label");
            assert!(e.contains("label"), "{}: {e}", case.name);
        }
        // the bad lanes are zero; the others as the CPU's with the labels in range
        let per = if case.kind == Kind::LossGrad { d } else { 1 };
        let mut want = twin.cpu().unwrap();
        let mut w = want[0].to_f64_vec();
        for &lane in bad {
            let gb = &bytes[4 * lane * per..4 * (lane + 1) * per];
            assert!(
                gb.iter().all(|&b| b == 0),
                "{}: lane {lane} is not zero",
                case.name
            );
            w[lane * per..(lane + 1) * per].fill(0.0);
        }
        want[0] = Tensor::from_f64(DType::F32, want[0].shape.clone(), &w);
        let (excess, what) = compare(twin, bytes, &want);
        assert!(excess <= 1.0, "over the bound: {what}");
    }
}

/// The comparison can fail: with one operation of `norm_grad_k` and one of `xent_k`
/// changed (`- xh * mgx` made `+`, the gradient's `-= g` at the label made `+=`), every
/// norm gradient and cross-entropy gradient case is over its bound.
#[test]
fn a_mutated_kernel_fails_the_comparison() {
    const TEST: &str = "a_mutated_kernel_fails_the_comparison";
    let dir = tempdir("cuda-reduce-mutant");
    let Some(cxx) = cxx20(TEST, &dir) else {
        return;
    };
    let cases: Vec<Case> = cases(None)
        .into_iter()
        .filter(|c| matches!(c.kind, Kind::NormGrad | Kind::LossGrad))
        .collect();
    let edits = [
        ("rstd * (g - mg - xh * mgx)", "rstd * (g - mg + xh * mgx)"),
        ("if (d == l) v -= g;", "if (d == l) v += g;"),
    ];
    let (got, _) = emulate(&cxx, &dir, &cases, &edits);
    for (case, (bytes, err)) in cases.iter().zip(&got) {
        assert_eq!(*err, 0, "{}", case.name);
        let (excess, what) = compare(case, bytes, &case.cpu().unwrap());
        assert!(
            excess > 1.0,
            "{}: the mutant passes ({excess}: {what})",
            case.name
        );
    }
    assert!(cases.len() >= 12, "{} cases", cases.len());
}
