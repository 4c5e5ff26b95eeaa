//! The CUDA backend's matrix products, as far as a machine without a GPU can check them: every
//! `Work::Gemm` of the CUDA lowering of tiny training plans (GPT-2, Llama and the Mixtral MoE,
//! both exporters, f32, bf16 and fp16, attention written out) is run through a CPU model of the
//! cuBLAS call the device makes (`Gemm::cublas_calls`, the arguments `device.rs` passes to
//! `cublasGemmStridedBatchedEx`; column-major, as cuBLAS's documentation defines the call)
//! on an arena laid out as the lowering lays it out, and the product must equal hzp's CPU
//! evaluator running the node. Operands a plan keeps as views (a transpose read only by
//! products, `hzp_ir::views`) are written untransposed at their source's bytes, as the GPU
//! holds them. That checks the transpose flags, leading dimensions, batch strides and
//! offsets of the lowering (bf16 views included). The arena has guard bytes before and after
//! it, and a product must leave every byte outside its C as it was (guards and other values
//! alike); a call with a wrong `ldc` or C stride is shown to trip that check. cuBLAS itself
//! is checked on a device
//! (`examples/device/multi_rank_check.sh`).

mod common;
use common::*;
use half::{bf16, f16};
use hzp_ir::{DType, Op, Plan, Tensor, ValueId};
use hzp_runtime::cuda::lower::{self, CublasGemm, Gemm, LowerOptions, Work};
use std::collections::HashMap;
use std::path::Path;

const PLANS: [(&str, &[&str]); 7] = [
    ("gpt2_tiny.legacy.op17", &["--retie"]),
    ("gpt2_tiny.legacy.op17", &["--retie", "--precision", "fp16"]),
    ("gpt2_tiny.dynamo.op18", &["--precision", "bf16"]),
    ("llama_tiny.legacy.op17", &["--precision", "bf16"]),
    ("llama_tiny.dynamo.op18", &[]),
    ("moe_tiny.legacy.op17", &[]),
    ("moe_tiny.dynamo.op18", &["--precision", "bf16"]),
];

fn compile(dir: &Path, k: usize, stem: &str, extra: &[&str]) -> Plan {
    let model = own_models_dir().join(format!("{stem}.onnx"));
    let out = dir.join(format!("plan{k}.json"));
    let mut args = vec![
        "compile",
        s(&model),
        "--shape",
        "input_ids=4x16",
        "--mesh",
        "gpu=1",
        "--no-fuse-attention",
        "--no-fuse-moe",
        "-o",
        s(&out),
    ];
    args.extend(extra);
    let (code, o, e) = hzp(&args);
    assert_eq!(code, 0, "{stem}: {o}{e}");
    Plan::from_json(&std::fs::read_to_string(&out).unwrap(), "plan.json").unwrap()
}

/// A tiny deterministic generator (splitmix64) for operand values in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
    fn tensor(&mut self, dtype: DType, shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| self.next()).collect();
        Tensor::from_f64(dtype, shape.to_vec(), &v)
    }
}

fn put(arena: &mut [u8], off: u64, t: &Tensor) {
    let esz = t.dtype().size_bytes();
    for (i, v) in t.to_f64_vec().into_iter().enumerate() {
        store(arena, GUARD + off as usize + i * esz, t.dtype(), v as f32);
    }
}

fn store(arena: &mut [u8], at: usize, d: DType, v: f32) {
    match d {
        DType::F32 => arena[at..at + 4].copy_from_slice(&v.to_le_bytes()),
        DType::BF16 => arena[at..at + 2].copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
        DType::F16 => arena[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes()),
        d => panic!("a product of {d}"),
    }
}

fn load(arena: &[u8], at: usize, d: DType) -> f32 {
    match d {
        DType::F32 => f32::from_le_bytes(arena[at..at + 4].try_into().unwrap()),
        DType::BF16 => bf16::from_le_bytes(arena[at..at + 2].try_into().unwrap()).to_f32(),
        DType::F16 => f16::from_le_bytes(arena[at..at + 2].try_into().unwrap()).to_f32(),
        d => panic!("a product of {d}"),
    }
}

/// Bytes before and after the lowering's arena, filled with [`GUARD_BYTE`]: every offset
/// below is shifted by `GUARD`, so a write before or past the arena lands in them.
const GUARD: usize = 4096;
const GUARD_BYTE: u8 = 0xa5;

/// The first byte outside `c` (a byte range of `after`) that differs from `before`: a
/// product may write only C. Covers the guard bytes and every other value of the arena.
fn written_outside(before: &[u8], after: &[u8], c: std::ops::Range<usize>) -> Option<usize> {
    assert_eq!(before.len(), after.len());
    let first = |lo: usize, hi: usize| (lo..hi).find(|&i| before[i] != after[i]);
    // whole slices first (a memcmp), byte by byte only to name the byte
    let (lo, hi) = (c.start, c.end);
    (before[..lo] != after[..lo])
        .then(|| first(0, lo))
        .flatten()
        .or_else(|| {
            (before[hi..] != after[hi..])
                .then(|| first(hi, before.len()))
                .flatten()
        })
}

/// What `cublasGemmStridedBatchedEx` computes for one call (alpha 1, beta 0, f32 compute):
/// column-major `C = op(X) op(Y)`, `X` element (i, l) at `i + l*ldx` (or `l + i*ldx`
/// transposed), `Y` element (l, j) at `l + j*ldy` (or `j + l*ldy`), `C` (i, j) at `i + j*ldc`.
fn cublas_model(arena: &mut [u8], d: DType, c: &CublasGemm) {
    let esz = d.size_bytes() as i64;
    let at = |base: u64, elems: i64| -> usize {
        let o = GUARD as i64 + base as i64 + elems * esz;
        assert!(o >= 0, "an offset before the arena and its guard");
        o as usize
    };
    for b in 0..c.batch as i64 {
        for j in 0..c.n as i64 {
            for i in 0..c.m as i64 {
                let mut acc = 0f64;
                for l in 0..c.k as i64 {
                    let xi = if c.trans_x {
                        l + i * c.ldx as i64
                    } else {
                        i + l * c.ldx as i64
                    };
                    let yi = if c.trans_y {
                        j + l * c.ldy as i64
                    } else {
                        l + j * c.ldy as i64
                    };
                    let x = load(arena, at(c.x, b * c.stride_x + xi), d) as f64;
                    let y = load(arena, at(c.y, b * c.stride_y + yi), d) as f64;
                    acc += x * y;
                }
                let ci = at(c.c, b * c.stride_c + i + j * c.ldc as i64);
                store(arena, ci, d, acc as f32);
            }
        }
    }
}

#[test]
fn every_lowered_product_equals_the_cpu_product() {
    let dir = tempdir("cuda-products");
    let mut checked = 0;
    let mut views = 0;
    let mut trans = [0usize; 2];
    // per plan: whether a wrong ldc and a wrong stride of one of its calls tripped the guard
    let mut tripped = [false; PLANS.len()];
    for (k, (stem, extra)) in PLANS.iter().enumerate() {
        let plan = compile(&dir, k, stem, extra);
        let p = &plan.program;
        let low = lower::lower_program_with(&plan, 0, LowerOptions::default())
            .unwrap_or_else(|e| panic!("{stem}: {e}"));
        let producer: HashMap<ValueId, usize> = p
            .nodes
            .iter()
            .enumerate()
            .flat_map(|(ni, n)| n.outputs.iter().map(move |&v| (v, ni)))
            .collect();
        assert!(low.nodes.iter().enumerate().all(|(i, nw)| nw.node == i));
        let mut arena = vec![GUARD_BYTE; GUARD + low.alloc_bytes as usize + GUARD];
        let mut rng = Rng(k as u64 + 1);
        let mut here = 0;
        for nw in &low.nodes {
            let gemms: Vec<&Gemm> = nw
                .work
                .iter()
                .filter_map(|w| match w {
                    Work::Gemm(g) => Some(g),
                    _ => None,
                })
                .collect();
            if gemms.is_empty() {
                continue;
            }
            assert_eq!(
                gemms.len(),
                nw.work.len(),
                "{stem} {}: more than products",
                nw.name
            );
            let node = &p.nodes[nw.node];
            // the operands: random values, written where the lowering reads them
            let mut given: HashMap<ValueId, Tensor> = HashMap::new();
            let mut operands = Vec::new();
            for &v in &node.inputs {
                let src = producer.get(&v).map(|&pi| (pi, &p.nodes[pi]));
                let view = match src {
                    Some((pi, n))
                        if matches!(n.op, Op::Transpose { .. })
                            && low.nodes[pi].work.is_empty() =>
                    {
                        Some(n)
                    }
                    _ => None,
                };
                let t = match view {
                    Some(tn) => {
                        // kept untransposed in its source's bytes
                        let s = tn.inputs[0];
                        let st = given
                            .entry(s)
                            .or_insert_with(|| rng.tensor(p.ty(s).dtype, &p.ty(s).shape))
                            .clone();
                        put(&mut arena, low.loc[s.index()].0, &st);
                        views += 1;
                        hzp_runtime::cpu::eval_op(&tn.op, &[&st]).unwrap().remove(0)
                    }
                    None => {
                        let t = given
                            .entry(v)
                            .or_insert_with(|| rng.tensor(p.ty(v).dtype, &p.ty(v).shape))
                            .clone();
                        put(&mut arena, low.loc[v.index()].0, &t);
                        t
                    }
                };
                operands.push(t);
            }
            let y = node.outputs[0];
            let (yoff, ybytes) = low.loc[y.index()];
            let yoff = GUARD as u64 + yoff;
            let dt = p.ty(y).dtype;
            // NaN where the product has not written
            for i in 0..(ybytes as usize / dt.size_bytes()) {
                store(
                    &mut arena,
                    yoff as usize + i * dt.size_bytes(),
                    dt,
                    f32::NAN,
                );
            }
            let before = arena.clone();
            let c_bytes = yoff as usize..(yoff + ybytes) as usize;
            for g in &gemms {
                assert_eq!(g.dtype, dt);
                trans[0] += g.trans_a as usize;
                trans[1] += g.trans_b as usize;
                for c in g.cublas_calls() {
                    cublas_model(&mut arena, dt, &c);
                    // a wrong ldc or stride: the guard must trip (tried once per plan)
                    let wrong = [
                        CublasGemm {
                            ldc: c.ldc + 1,
                            ..c
                        },
                        CublasGemm {
                            stride_c: c.stride_c + 1,
                            ..c
                        },
                    ];
                    // on a call whose C ends where the node's output ends (the last of its
                    // calls), so that misplaced writes leave the output, not just this call's
                    // part of it
                    let esz = dt.size_bytes() as i64;
                    let extent = (c.batch as i64 - 1) * c.stride_c
                        + (c.n as i64 - 1) * c.ldc as i64
                        + c.m as i64;
                    let ends_output =
                        c.c as i64 + extent * esz == (yoff - GUARD as u64 + ybytes) as i64;
                    if !tripped[k] && c.n > 1 && c.batch > 1 && ends_output {
                        for w in &wrong {
                            let mut a = before.clone();
                            cublas_model(&mut a, dt, w);
                            assert!(
                                written_outside(&before, &a, c_bytes.clone()).is_some(),
                                "{stem} {}: a wrong call {w:?} wrote only C",
                                nw.name
                            );
                        }
                        tripped[k] = true;
                    }
                }
            }
            // the product wrote nothing outside C: not the guard bytes, not another value
            if let Some(i) = written_outside(&before, &arena, c_bytes) {
                panic!(
                    "{stem} {}: a product wrote byte {} of the arena, outside its C at {}..{}",
                    nw.name,
                    i as i64 - GUARD as i64,
                    yoff as usize - GUARD,
                    yoff as usize - GUARD + ybytes as usize
                );
            }
            let refs: Vec<&Tensor> = operands.iter().collect();
            let want = hzp_runtime::cpu::eval_op(&node.op, &refs)
                .unwrap_or_else(|e| panic!("{stem} {}: {e}", node.name))
                .remove(0)
                .to_f64_vec();
            let got: Vec<f64> = (0..want.len())
                .map(|i| load(&arena, yoff as usize + i * dt.size_bytes(), dt) as f64)
                .collect();
            let scale = want.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
            // f32: accumulation order; bf16/f16: one rounding of the result apart
            let tol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= tol * scale.max(b.abs()),
                    "{stem} {} ({:?} of {dt}): element {i} is {a}, the CPU gives {b}",
                    node.name,
                    p.ty(y).shape
                );
            }
            here += 1;
        }
        eprintln!("{stem} {extra:?}: {here} products checked");
        assert!(here >= 10, "{stem}: only {here} products");
        checked += here;
    }
    eprintln!(
        "{checked} products, {views} operands read as views, {} with A transposed, {} with B \
         transposed",
        trans[0], trans[1]
    );
    // the plans exercise both transpose flags and the views behind them
    assert!(views > 0 && trans[0] > 0 && trans[1] > 0);
    assert!(
        tripped.iter().all(|&t| t),
        "a plan without a batched call to try wrong ones on: {tripped:?}"
    );
}
