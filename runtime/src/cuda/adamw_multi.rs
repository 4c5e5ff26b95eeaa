//! The multi-tensor AdamW step: a group of the plan's `Op::AdamW` nodes becomes one launch of
//! `adamw_multi_f32` (`kernels/elementwise.cu`) instead of one `adamw_f32` launch per
//! parameter. The kernel reads a table in device memory: one 112-byte entry per tensor (the
//! byte offsets of its seven operands and three results from the arena's base, its length and
//! its node's constants), then one 8-byte (tensor, chunk) entry per block. The table holds
//! offsets, not pointers, so it is the same for every run of the plan: the lowering places it
//! after the error word ([`super::work::LoweredPlan::consts`]) and the executor uploads it
//! once.
//!
//! Which nodes form a group ([`groups`]): maximal runs of AdamW nodes that are consecutive in
//! program order (no other node between them, so running them at the last member's place
//! changes nothing any other node sees) on one stream, whose byte ranges are independent: no
//! member writes bytes another member reads or writes, and each result is either exactly the
//! input it replaces (the memory plan's in-place update) or apart from every input of its
//! node. Threads of one launch run in no set order, so these are what make the one launch
//! equal to the nodes one after another. Runs of one node stay per-node launches.
//!
//! Pure Rust (no GPU, no `cuda` feature): the grouping and the table are tested on any machine,
//! and the kernel is emulated as C++ against the CPU backend (`tests/cuda_adamw.rs`).

use super::work::{Arg, Launch, Work};
use hzp_ir::{Op, Program};

/// Elements per block of the launch (256 threads, 64 elements each).
pub const CHUNK: usize = 16384;

/// Threads per block.
pub const THREADS: u32 = 256;

/// Bytes of one tensor's entry (the kernel's `AdamWTensor`).
pub const ENTRY_BYTES: usize = 112;

/// One tensor of a group: what the kernel's `AdamWTensor` holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// The node.
    pub node: usize,
    /// Byte offsets of param, grad, m, v, step size, bias2 sqrt, lr (the node's inputs in
    /// order), then param', m', v' (its outputs).
    pub ins: [u64; 7],
    pub outs: [u64; 3],
    pub n: usize,
    /// (beta1, beta2, eps, weight decay), the node's attributes.
    pub hyper: (f64, f64, f64, f64),
}

impl Entry {
    fn bytes(&self) -> Vec<u8> {
        let (beta1, beta2, eps, wd) = self.hyper;
        let mut b = Vec::with_capacity(ENTRY_BYTES);
        let [w, g, m, v, step, bias2, lr] = self.ins;
        let [w2, m2, v2] = self.outs;
        for o in [w, g, m, v, step, bias2, lr, w2, m2, v2] {
            b.extend(o.to_le_bytes());
        }
        b.extend((self.n as i64).to_le_bytes());
        // the constants rounded to f32 as the per-node kernel's arguments are
        for f in [
            (1.0 - beta1) as f32,
            beta2 as f32,
            (1.0 - beta2) as f32,
            eps as f32,
        ] {
            b.extend(f.to_le_bytes());
        }
        b.extend(wd.to_le_bytes());
        debug_assert_eq!(b.len(), ENTRY_BYTES);
        b
    }
}

/// The table of `entries` (their entries, then one (tensor, chunk) pair per block of
/// `chunk` elements; empty tensors have no block) and the number of blocks.
pub fn table(entries: &[Entry], chunk: usize) -> Result<(Vec<u8>, u32), String> {
    let mut b: Vec<u8> = entries.iter().flat_map(Entry::bytes).collect();
    let mut blocks = 0u64;
    for (t, e) in entries.iter().enumerate() {
        for c in 0..e.n.div_ceil(chunk) {
            let (t, c) = (u32::try_from(t), u32::try_from(c));
            let (Ok(t), Ok(c)) = (t, c) else {
                return Err("a multi-tensor AdamW table beyond 2^32 tensors or chunks".into());
            };
            b.extend(t.to_le_bytes());
            b.extend(c.to_le_bytes());
            blocks += 1;
        }
    }
    let blocks = u32::try_from(blocks)
        .ok()
        .filter(|&n| n < (1 << 31))
        .ok_or("a multi-tensor AdamW launch of more than 2^31 blocks")?;
    Ok((b, blocks))
}

/// The launch of a group whose table lies at byte `at` of the allocation.
pub fn launch(entries: &[Entry], at: u64, blocks: u32, chunk: usize) -> Work {
    Work::Kernel(Launch {
        kernel: "adamw_multi_f32".into(),
        grid: blocks,
        block: THREADS,
        args: vec![
            Arg::Ptr(0),
            Arg::Ptr(at),
            Arg::Ptr(at + (entries.len() * ENTRY_BYTES) as u64),
            Arg::I64(chunk as i64),
        ],
    })
}

/// Node `ni`'s entry, when it is an AdamW node with elements.
pub fn entry(p: &Program, loc: &[(u64, u64)], ni: usize) -> Option<Entry> {
    let n = &p.nodes[ni];
    let Op::AdamW {
        beta1,
        beta2,
        eps,
        weight_decay,
    } = n.op
    else {
        return None;
    };
    let ins: [u64; 7] = std::array::from_fn(|k| loc[n.inputs[k].index()].0);
    let outs: [u64; 3] = std::array::from_fn(|k| loc[n.outputs[k].index()].0);
    let elems = p.ty(n.outputs[0]).numel();
    (n.inputs.len() == 7 && n.outputs.len() == 3 && elems > 0).then_some(Entry {
        node: ni,
        ins,
        outs,
        n: elems,
        hyper: (beta1, beta2, eps, weight_decay),
    })
}

fn overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// Whether node `b` may run in one launch with the members `a` (see the module's rules).
fn independent(p: &Program, loc: &[(u64, u64)], members: &[usize], b: usize) -> bool {
    let nb = &p.nodes[b];
    let range = |v: hzp_ir::ValueId| loc[v.index()];
    // within the node: each result is its own input's bytes, or apart from every input
    for (k, &o) in nb.outputs.iter().enumerate() {
        for (j, &i) in nb.inputs.iter().enumerate() {
            let same = [(0, 0), (2, 1), (3, 2)].contains(&(j, k)) && range(i) == range(o);
            if !same && overlap(range(i), range(o)) {
                return false;
            }
        }
        for &o2 in &nb.outputs[k + 1..] {
            if overlap(range(o), range(o2)) {
                return false;
            }
        }
    }
    members.iter().all(|&a| {
        let na = &p.nodes[a];
        // a result of one is no byte another reads or writes
        let clash = |x: &hzp_ir::Node, y: &hzp_ir::Node| {
            x.outputs.iter().any(|&o| {
                y.inputs
                    .iter()
                    .chain(y.outputs.iter())
                    .any(|&i| overlap(range(o), range(i)))
            })
        };
        !clash(na, nb) && !clash(nb, na)
    })
}

/// The groups of AdamW nodes that run as one launch each (see the module's rules), in program
/// order; each has at least two nodes.
pub fn groups(p: &Program, loc: &[(u64, u64)]) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let flush = |cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>| {
        if cur.len() >= 2 {
            out.push(std::mem::take(cur));
        } else {
            cur.clear();
        }
    };
    for ni in 0..p.nodes.len() {
        if entry(p, loc, ni).is_none() {
            flush(&mut cur, &mut out);
            continue;
        }
        let fits = cur.last().is_some_and(|&l| {
            l + 1 == ni && p.nodes[l].stream == p.nodes[ni].stream && independent(p, loc, &cur, ni)
        });
        if !fits {
            flush(&mut cur, &mut out);
            if !independent(p, loc, &[], ni) {
                continue;
            }
        }
        cur.push(ni);
    }
    flush(&mut cur, &mut out);
    out
}

/// Bytes to place in the allocation: (offset, bytes) each.
pub type Tables = Vec<(u64, Vec<u8>)>;

/// Lowers every group of `p` to one launch: the group's last node gets the launch (its other
/// members no work, as a fused run's), and each group's table is placed from byte `at` on
/// (256-byte aligned). Gives the tables (offset, bytes) and the end of the last.
pub fn apply(
    p: &Program,
    loc: &[(u64, u64)],
    nodes: &mut [super::work::NodeWork],
    mut at: u64,
) -> Result<(Tables, u64), String> {
    let mut consts = Vec::new();
    for g in groups(p, loc) {
        let entries: Vec<Entry> = g.iter().filter_map(|&ni| entry(p, loc, ni)).collect();
        let (bytes, blocks) = table(&entries, CHUNK)?;
        for &ni in &g {
            nodes[ni].work.clear();
        }
        let last = *g.last().expect("a group has nodes");
        nodes[last].work.push(launch(&entries, at, blocks, CHUNK));
        let len = bytes.len() as u64;
        consts.push((at, bytes));
        at = (at + len).div_ceil(256) * 256;
    }
    Ok((consts, at))
}
