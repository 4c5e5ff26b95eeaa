//! The CUDA backend's multi-tensor AdamW (`runtime/src/cuda/adamw_multi.rs`), as far as a
//! machine without a GPU can check it:
//! - the grouping over the tiny GPT-2's real one-rank training plan: every AdamW node in one
//!   launch, at the last member's place, every other node's work unchanged, the table's
//!   operands those of the per-node launches;
//! - the kernel `adamw_multi_f32`, cut out of `kernels/elementwise.cu` with the element step
//!   it shares with `adamw_f32`, compiled as C++ for the CPU (`-ffp-contract=off`, as NVRTC
//!   compiles with `--fmad=false`) and run block by block, thread by thread, over the real
//!   plan's table and over tensors of assorted sizes (one element, a chunk, a chunk and one,
//!   several chunks and a tail, different constants per tensor, results in place and apart):
//!   the results equal the CPU backend's AdamW bit for bit. The CPU kernel computes each
//!   element with the same f32 operations in the same order (`cpu/optim.rs`), and sqrt and
//!   division are correctly rounded on both sides (NVRTC's defaults `--prec-sqrt=true`,
//!   `--prec-div=true`), so no tolerance is allowed.
//!
//! The launch on a GPU (grid, table upload) is the device check's `PART=adamw`.

mod common;
use common::*;
use hzp_ir::{DType, Op, Plan, Tensor};
use hzp_runtime::cuda::adamw_multi::{self, Entry};
use hzp_runtime::cuda::lower::{self, Arg, LowerOptions, Work};
use std::path::Path;

fn compile_plan(dir: &Path, model: &str, extra: &[&str]) -> Plan {
    let out = dir.join("plan.json");
    let mut args = vec![
        "compile",
        model,
        "--mesh",
        "gpu=1",
        "--no-fuse-attention",
        "--shape",
        "input_ids=4x16",
        "-o",
        s(&out),
    ];
    args.extend(extra);
    let (code, o, e) = hzp(&args);
    assert_eq!(code, 0, "{model}: {o}{e}");
    Plan::from_json(&std::fs::read_to_string(&out).unwrap(), "plan.json").unwrap()
}

fn lowering(plan: &Plan, per_node_adamw: bool) -> lower::LoweredPlan {
    let opts = LowerOptions {
        per_node_adamw,
        ..LowerOptions::default()
    };
    lower::lower_program_with(plan, 0, opts).unwrap_or_else(|e| panic!("{e}"))
}

fn launches<'a>(low: &'a lower::LoweredPlan, kernel: &str) -> Vec<(usize, &'a lower::Launch)> {
    let mut v = Vec::new();
    for (i, nw) in low.nodes.iter().enumerate() {
        for w in &nw.work {
            if let Work::Kernel(l) = w {
                if l.kernel == kernel {
                    v.push((i, l));
                }
            }
        }
    }
    v
}

fn adamw_nodes(plan: &Plan) -> Vec<usize> {
    (plan.program.nodes.iter().enumerate())
        .filter(|(_, n)| matches!(n.op, Op::AdamW { .. }))
        .map(|(i, _)| i)
        .collect()
}

#[test]
fn one_launch_updates_every_parameter_of_the_tiny_gpt2() {
    let dir = tempdir("adamw-group");
    let plan = compile_plan(
        &dir,
        "tests/models/gpt2_tiny.legacy.op17.onnx",
        &["--retie"],
    );
    let p = &plan.program;
    let nodes = adamw_nodes(&plan);
    assert!(nodes.len() >= 10, "{} AdamW nodes", nodes.len());
    let multi = lowering(&plan, false);
    let single = lowering(&plan, true);
    // per node: one adamw_f32 launch each, no table
    assert_eq!(launches(&single, "adamw_f32").len(), nodes.len());
    assert!(single.consts.is_empty());
    // grouped: one launch, at the last AdamW node, for all of them
    assert!(launches(&multi, "adamw_f32").is_empty());
    let ml = launches(&multi, "adamw_multi_f32");
    assert_eq!(ml.len(), 1, "{} multi-tensor launches", ml.len());
    let (at_node, l) = ml[0];
    assert_eq!(at_node, *nodes.last().unwrap());
    let groups = adamw_multi::groups(p, &multi.loc);
    assert_eq!(groups, vec![nodes.clone()]);
    // the members are consecutive: nothing runs between them, so running them all at the last
    // one's place changes what no other node sees
    assert!(nodes.windows(2).all(|w| w[1] == w[0] + 1), "{nodes:?}");
    // every other node's work is the per-node lowering's, in the same order
    for (i, (a, b)) in multi.nodes.iter().zip(&single.nodes).enumerate() {
        if nodes.contains(&i) {
            assert_eq!(a.work.is_empty(), i != at_node);
        } else {
            assert_eq!(a.work, b.work, "node {i} `{}`", a.name);
        }
    }
    // the table: after the error word, inside the allocation; its entries are the per-node
    // launches' operands (the same offsets and constants)
    assert_eq!(multi.consts.len(), 1);
    let (at, bytes) = &multi.consts[0];
    assert!(*at >= multi.err_offset + 4 && at + bytes.len() as u64 <= multi.alloc_bytes);
    assert_eq!(
        l.args,
        vec![
            Arg::Ptr(0),
            Arg::Ptr(*at),
            Arg::Ptr(at + (nodes.len() * adamw_multi::ENTRY_BYTES) as u64),
            Arg::I64(adamw_multi::CHUNK as i64)
        ]
    );
    let (_, single_launches): (Vec<usize>, Vec<&lower::Launch>) =
        launches(&single, "adamw_f32").into_iter().unzip();
    let mut blocks = 0;
    for (k, sl) in single_launches.iter().enumerate() {
        let e = &bytes[k * adamw_multi::ENTRY_BYTES..(k + 1) * adamw_multi::ENTRY_BYTES];
        let u64_at = |j: usize| u64::from_le_bytes(e[8 * j..8 * j + 8].try_into().unwrap());
        let f32_at = |b: usize| f32::from_le_bytes(e[b..b + 4].try_into().unwrap());
        // adamw_f32(n, one_m_b1, b2, one_m_b2, eps, weight_decay, 7 inputs, 3 outputs)
        let ptr = |j: usize| match sl.args[j] {
            Arg::Ptr(o) => o,
            ref a => panic!("{a:?}"),
        };
        let ops: Vec<u64> = (6..16).map(ptr).collect();
        let [w, g, m, v, st, b2, lr, w2, m2, v2] = ops[..] else {
            unreachable!()
        };
        assert_eq!(
            (0..10).map(u64_at).collect::<Vec<_>>(),
            vec![w, g, m, v, st, b2, lr, w2, m2, v2],
            "entry {k}"
        );
        assert_eq!(Arg::I64(u64_at(10) as i64), sl.args[0]);
        for (j, b) in [(1, 88), (2, 92), (3, 96), (4, 100)] {
            assert_eq!(Arg::F32(f32_at(b)), sl.args[j]);
        }
        assert_eq!(
            Arg::Bits {
                bits: u64_at(13),
                len: 8
            },
            sl.args[5]
        );
        blocks += (u64_at(10) as usize).div_ceil(adamw_multi::CHUNK);
    }
    assert_eq!(l.grid as usize, blocks);
    assert_eq!(
        bytes.len(),
        nodes.len() * adamw_multi::ENTRY_BYTES + 8 * blocks
    );
}

/// A node between two AdamW nodes, or a member reading another's result, splits the group.
#[test]
fn grouping_stops_at_other_nodes_and_dependent_members() {
    let dir = tempdir("adamw-split");
    let plan = compile_plan(
        &dir,
        "tests/models/gpt2_tiny.legacy.op17.onnx",
        &["--retie"],
    );
    let nodes = adamw_nodes(&plan);
    assert!(nodes.len() >= 4);
    // move the first AdamW node after a non-AdamW node placed in the middle of the run
    let mut p = plan.program.clone();
    let k = nodes[nodes.len() / 2];
    let other = (0..nodes[0])
        .rev()
        .find(|&i| !matches!(p.nodes[i].op, Op::AdamW { .. }))
        .unwrap();
    let moved = p.nodes.remove(other);
    p.nodes.insert(k - 1, moved);
    let loc = lowering(&plan, true).loc;
    let g = adamw_multi::groups(&p, &loc);
    assert_eq!(g.len(), 2, "{g:?}");
    assert_eq!(g.iter().map(Vec::len).sum::<usize>(), nodes.len());
    assert!(g[0].last().unwrap() + 2 == g[1][0]);
    // a member reading another member's result (param' of the first as the second's grad)
    let mut p = plan.program.clone();
    let (a, b) = nodes
        .iter()
        .flat_map(|&a| nodes.iter().map(move |&b| (a, b)))
        .find(|&(a, b)| a != b && p.ty(p.nodes[a].outputs[0]) == p.ty(p.nodes[b].inputs[1]))
        .expect("two parameters of one shape");
    p.nodes[b].inputs[1] = p.nodes[a].outputs[0];
    let g = adamw_multi::groups(&p, &loc);
    assert!(!g.is_empty());
    assert!(
        g.iter().all(|g| !(g.contains(&a) && g.contains(&b))),
        "{g:?}"
    );
}

/// The C++ program that runs `adamw_multi_f32` cut out of the kernel sources: argv: arena file
/// (read and written back), table offset, chunk-list offset, grid, chunk.
fn emulation_source() -> String {
    let ew = hzp_runtime::cuda::kernels::ELEMENTWISE;
    let cut = |start: &str| -> String {
        let i = ew.find(start).unwrap_or_else(|| panic!("no `{start}`"));
        let j = i + ew[i..].find("\n}\n").expect("a closing brace") + 3;
        ew[i..j].to_string()
    };
    let mut s = String::from(
        r#"#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define __device__
#define __forceinline__ inline
#define __global__
typedef unsigned long long u64;
typedef long long i64;
struct Dim { unsigned x; };
static Dim blockIdx, threadIdx, blockDim, gridDim;
"#,
    );
    s += &cut("__device__ __forceinline__ void adamw_elem(");
    // the table's structs, then the kernel
    let i = ew.find("struct AdamWTensor {").expect("the table's entry");
    let k = "extern \"C\" __global__ void adamw_multi_f32(";
    let j = ew.find(k).expect("the kernel");
    s += &ew[i..j];
    s += &cut(k);
    s += r#"int main(int argc, char** argv) {
    FILE* f = fopen(argv[1], "rb"); if (!f) return 2;
    fseek(f, 0, SEEK_END); size_t n = ftell(f); fseek(f, 0, SEEK_SET);
    char* A = (char*)malloc(n); if (fread(A, 1, n, f) != n) return 3; fclose(f);
    u64 table = strtoull(argv[2], 0, 10), chunks = strtoull(argv[3], 0, 10);
    gridDim.x = (unsigned)atoi(argv[4]); blockDim.x = 256; i64 chunk = atoll(argv[5]);
    for (blockIdx.x = 0; blockIdx.x < gridDim.x; ++blockIdx.x)
        for (threadIdx.x = 0; threadIdx.x < blockDim.x; ++threadIdx.x)
            adamw_multi_f32(A, (const AdamWTensor*)(A + table), (const AdamWChunk*)(A + chunks), chunk);
    f = fopen(argv[1], "wb"); fwrite(A, 1, n, f); fclose(f);
    return 0;
}
"#;
    s
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

/// Builds the emulation once.
fn emulator(dir: &Path, cxx: &str) -> std::path::PathBuf {
    let cpp = dir.join("adamw_multi.cpp");
    let exe = dir.join("adamw_multi");
    std::fs::write(&cpp, emulation_source()).unwrap();
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
    exe
}

/// Runs the emulated launch of `entries` (chunks of `chunk`) over `arena`, the table placed
/// after it; gives the arena afterwards (without the table).
fn emulate(dir: &Path, exe: &Path, arena: &[u8], entries: &[Entry], chunk: usize) -> Vec<u8> {
    let (table, blocks) = adamw_multi::table(entries, chunk).unwrap();
    let at = arena.len().div_ceil(256) * 256;
    let Work::Kernel(l) = adamw_multi::launch(entries, at as u64, blocks, chunk) else {
        unreachable!()
    };
    let [Arg::Ptr(0), Arg::Ptr(t), Arg::Ptr(c), Arg::I64(ch)] = l.args[..] else {
        panic!("{:?}", l.args)
    };
    let mut all = arena.to_vec();
    all.resize(at, 0);
    all.extend(&table);
    let file = dir.join("arena.bin");
    std::fs::write(&file, &all).unwrap();
    run_cmd(
        std::process::Command::new(exe)
            .arg(&file)
            .arg(t.to_string())
            .arg(c.to_string())
            .arg(l.grid.to_string())
            .arg(ch.to_string()),
    );
    let out = std::fs::read(&file).unwrap();
    assert_eq!(&out[at..], &table[..], "the kernel wrote into its table");
    out[..arena.len()].to_vec()
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64) as f32
    }
}

fn f32s(b: &[u8], off: u64, n: usize) -> Vec<f32> {
    b[off as usize..off as usize + 4 * n]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn put(b: &mut [u8], off: u64, v: &[f32]) {
    for (k, x) in v.iter().enumerate() {
        let o = off as usize + 4 * k;
        b[o..o + 4].copy_from_slice(&x.to_le_bytes());
    }
}

/// Random operands for every entry (v non-negative, the scalars as a schedule makes them),
/// written into `arena`; gives what the CPU backend's AdamW makes of them, per entry.
fn fill_and_expect(arena: &mut [u8], entries: &[Entry], rng: &mut Rng) -> Vec<[Vec<f32>; 3]> {
    for e in entries {
        let n = e.n;
        let r = |rng: &mut Rng, s: f32| (0..n).map(|_| (rng.next() * 2.0 - 1.0) * s).collect();
        let w: Vec<f32> = r(rng, 3.0);
        let g: Vec<f32> = r(rng, 1.0);
        let m: Vec<f32> = r(rng, 0.1);
        let v: Vec<f32> = (0..n).map(|_| rng.next() * 0.01).collect();
        put(arena, e.ins[0], &w);
        put(arena, e.ins[1], &g);
        put(arena, e.ins[2], &m);
        put(arena, e.ins[3], &v);
        put(arena, e.ins[4], &[1e-3 * (1.0 + rng.next())]);
        put(arena, e.ins[5], &[0.1 + rng.next() * 0.9]);
        put(arena, e.ins[6], &[3e-4 * (1.0 + rng.next())]);
    }
    // the reference from the arena as it holds them (operands a plan shares are read once)
    entries
        .iter()
        .map(|e| {
            let ins: Vec<Tensor> = (0..7)
                .map(|k| {
                    let n = if k < 4 { e.n } else { 1 };
                    let shape = if k < 4 { vec![e.n] } else { vec![] };
                    Tensor::from_f64(
                        DType::F32,
                        shape,
                        &f32s(arena, e.ins[k], n)
                            .iter()
                            .map(|&x| x as f64)
                            .collect::<Vec<_>>(),
                    )
                })
                .collect();
            let (beta1, beta2, eps, weight_decay) = e.hyper;
            let op = Op::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            };
            let out = hzp_runtime::cpu::eval_op(&op, &ins.iter().collect::<Vec<_>>()).unwrap();
            std::array::from_fn(|k| out[k].to_f64_vec().iter().map(|&x| x as f32).collect())
        })
        .collect()
}

fn check(got: &[u8], entries: &[Entry], want: &[[Vec<f32>; 3]], what: &str) -> usize {
    let mut checked = 0;
    for (e, w) in entries.iter().zip(want) {
        for (k, wk) in w.iter().enumerate() {
            let g = f32s(got, e.outs[k], e.n);
            for (i, (a, b)) in g.iter().zip(wk).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits(),
                    "{what}: tensor of node {} (n {}), result {k}, element {i}: {a:e} against the CPU's {b:e}",
                    e.node,
                    e.n
                );
            }
            checked += e.n;
        }
    }
    checked
}

#[test]
fn the_kernel_equals_the_cpu_adamw_on_assorted_sizes() {
    let Some(cxx) = skip::cxx_compiler(
        "the_kernel_equals_the_cpu_adamw_on_assorted_sizes",
        "emulate the multi-tensor AdamW kernel",
    ) else {
        return;
    };
    let dir = tempdir("adamw-sizes");
    let exe = emulator(&dir, &cxx);
    let chunk = adamw_multi::CHUNK;
    let sizes = [
        1,
        7,
        255,
        256,
        257,
        chunk - 1,
        chunk,
        chunk + 1,
        3 * chunk + 77,
        1000,
    ];
    // each tensor's operands apart; even ones update in place, odd ones into other bytes;
    // one shared set of scalars for the first half, own scalars for the rest
    let mut at = 0u64;
    let mut alloc = |bytes: usize| {
        let o = at;
        at += (bytes as u64).div_ceil(256) * 256;
        o
    };
    let shared = [alloc(4), alloc(4), alloc(4)];
    let mut entries = Vec::new();
    for (t, &n) in sizes.iter().enumerate() {
        let ins4: [u64; 4] = std::array::from_fn(|_| alloc(4 * n));
        let sc = if t < sizes.len() / 2 {
            shared
        } else {
            [alloc(4), alloc(4), alloc(4)]
        };
        let outs = if t % 2 == 0 {
            [ins4[0], ins4[2], ins4[3]]
        } else {
            std::array::from_fn(|_| alloc(4 * n))
        };
        let wd = [0.0, 0.1, 0.01][t % 3];
        entries.push(Entry {
            node: t,
            ins: [ins4[0], ins4[1], ins4[2], ins4[3], sc[0], sc[1], sc[2]],
            outs,
            n,
            hyper: (0.9, if t % 2 == 0 { 0.999 } else { 0.95 }, 1e-8, wd),
        });
    }
    let mut checked = 0;
    for (seed, chunk) in [(1u64, chunk), (2, 64), (3, 1000)] {
        let mut arena = vec![0u8; at as usize];
        let mut rng = Rng(0x9e3779b97f4a7c15 ^ seed);
        let want = fill_and_expect(&mut arena, &entries, &mut rng);
        let got = emulate(&dir, &exe, &arena, &entries, chunk);
        checked += check(&got, &entries, &want, &format!("chunk {chunk}"));
        // bytes that are no result are untouched
        let mut mask = vec![false; arena.len()];
        for e in &entries {
            for o in e.outs {
                mask[o as usize..o as usize + 4 * e.n].fill(true);
            }
        }
        let stray = (0..arena.len()).find(|&i| !mask[i] && got[i] != arena[i]);
        assert_eq!(
            stray, None,
            "chunk {chunk}: a byte outside the results changed"
        );
    }
    eprintln!("{checked} results equal the CPU backend's bit for bit");
}

#[test]
fn the_kernel_equals_the_cpu_adamw_on_the_tiny_gpt2_plan() {
    let Some(cxx) = skip::cxx_compiler(
        "the_kernel_equals_the_cpu_adamw_on_the_tiny_gpt2_plan",
        "emulate the multi-tensor AdamW kernel",
    ) else {
        return;
    };
    let dir = tempdir("adamw-plan");
    let exe = emulator(&dir, &cxx);
    let plan = compile_plan(
        &dir,
        "tests/models/gpt2_tiny.legacy.op17.onnx",
        &["--retie"],
    );
    let low = lowering(&plan, false);
    let p = &plan.program;
    let groups = adamw_multi::groups(p, &low.loc);
    let entries: Vec<Entry> = groups[0]
        .iter()
        .filter_map(|&ni| adamw_multi::entry(p, &low.loc, ni))
        .collect();
    // the table the lowering uploads is this one
    assert_eq!(
        low.consts[0].1,
        adamw_multi::table(&entries, adamw_multi::CHUNK).unwrap().0
    );
    // the real offsets (results over their inputs, as the memory plan placed them), with the
    // lowering's chunk and a small one that cuts every tensor into several blocks
    for (seed, chunk) in [(5u64, adamw_multi::CHUNK), (6, 96)] {
        let mut arena = vec![0u8; plan.arena_bytes as usize];
        let mut rng = Rng(0x2545f4914f6cdd1d ^ seed);
        let want = fill_and_expect(&mut arena, &entries, &mut rng);
        let got = emulate(&dir, &exe, &arena, &entries, chunk);
        let n = check(&got, &entries, &want, &format!("plan, chunk {chunk}"));
        assert!(n > 0);
    }
}
