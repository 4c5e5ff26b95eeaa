//! Elementwise fusion for the CUDA backend (`HZP_CUDA_FUSE=1`; off by default until it has
//! run on a GPU): runs of consecutive float elementwise nodes of one output shape become one
//! generated kernel, which reads every operand from outside the run once per element, keeps
//! the run's intermediate values in registers, and stores only the values something outside
//! the run reads. On GPT-2 small most of the step's non-product time is such runs (the
//! per-op profile of `HZP_CUDA_PROFILE`: Where, Mul, Add, Sub, each a full pass over memory).
//!
//! # What fuses
//!
//! A node is *fusible* when it is on the compute stream, has one output of a float dtype and
//! of at least one element, and is a float `Unary` (not `Not`/`IsNaN`), a float arithmetic
//! `Binary` (Add .. Mod: not a comparison or a logical op), a `Where` of floats, or a `Cast`
//! between float dtypes. A *run* is a maximal sequence of consecutive nodes of the program
//! (nothing in between, on any stream), all fusible with the same output shape; operands from
//! outside the run may broadcast to it. The run's kernel runs in place of its last node; the
//! others lower to no work.
//!
//! # Why it computes the same bits
//!
//! Each member is evaluated per element exactly as its own kernel does (`unary_f`,
//! `binary_f` in f32, the select of `where_k`, `Cast`'s `from_f`), and its value is rounded
//! to its dtype before any other member reads it (`to_f(from_f<T>(v))`): the stored values
//! equal the unfused ones bit for bit.
//!
//! # Why it is safe
//!
//! Running the members later than their place in the program is safe because nothing runs
//! between them. The memory plan may give a stored output the bytes of an operand the run
//! reads (an operand whose last reader is an earlier member): that is kept only where the
//! operand has the run's shape with no broadcast, so each element is read before the same
//! thread writes it. A run with any other overlap, or with more than 16 outside operands, is
//! split into the longest prefixes that can be kernels (`runs`).

use super::work::{bcast, flat_grid, Arg, Launch, Work};
use hzp_ir::{BinaryOp, DType, Node, Op, Program, StreamKind, UnaryOp, ValueId};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

/// Most members and outside operands one generated kernel takes.
const MAX_MEMBERS: usize = 32;
const MAX_OPERANDS: usize = 16;

/// One fused run: its nodes (consecutive indices), the kernel's launch and its source.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    pub nodes: Vec<usize>,
    /// The values from outside the run it reads, in the kernel's parameter order.
    pub operands: Vec<ValueId>,
    /// The members' values it stores (read outside the run), after the operands.
    pub stored: Vec<ValueId>,
    pub launch: Launch,
    pub source: String,
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::BF16 | DType::F16)
}

/// Whether node `n` may join a run (see the module's docs).
fn fusible(p: &Program, n: &Node) -> bool {
    if n.stream != StreamKind::Compute || n.outputs.len() != 1 {
        return false;
    }
    let yt = p.ty(n.outputs[0]);
    if !is_float(yt.dtype) || yt.numel() == 0 {
        return false;
    }
    let same = |k: usize| n.inputs.get(k).is_some_and(|&v| p.ty(v).dtype == yt.dtype);
    match &n.op {
        Op::Unary(u) => !matches!(u, UnaryOp::Not | UnaryOp::IsNaN) && same(0),
        Op::Binary(b) => binary_code(*b).is_some() && same(0) && same(1),
        Op::Where => {
            n.inputs.len() == 3 && p.ty(n.inputs[0]).dtype == DType::Bool && same(1) && same(2)
        }
        Op::Cast { .. } => n.inputs.len() == 1 && is_float(p.ty(n.inputs[0]).dtype),
        _ => false,
    }
}

/// How many nodes of `p` could join a run (fusible ones, whether or not a neighbour is).
pub fn fusible_nodes(p: &Program) -> usize {
    p.nodes.iter().filter(|n| fusible(p, n)).count()
}

/// `binary_f`'s code of a float arithmetic op (its position in `BinaryOp::ALL`, below 8).
fn binary_code(b: BinaryOp) -> Option<u32> {
    Some(b.code()).filter(|&c| c < 8 && !b.is_predicate())
}

/// The runs of `p` with buffers at `loc` ((offset, bytes) per value), in program order.
pub fn runs(p: &Program, loc: &[(u64, u64)]) -> Vec<Run> {
    // values read after the program (outputs, updates) or by a node, by reader
    let mut readers: BTreeMap<ValueId, Vec<usize>> = BTreeMap::new();
    for (ni, n) in p.nodes.iter().enumerate() {
        // a Free only marks its operand's bytes reusable: it reads nothing
        if matches!(n.op, Op::Free) {
            continue;
        }
        for &v in &n.inputs {
            readers.entry(v).or_default().push(ni);
        }
    }
    let mut kept: BTreeSet<ValueId> = p.outputs.iter().copied().collect();
    kept.extend(p.updates.iter().map(|u| u.value));
    let mut out = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    // A run that cannot be one kernel (too many operands, or a stored output overlapping an
    // operand) is split: its longest buildable prefix of two or more members becomes a
    // kernel and the rest is tried again; a first member that starts no buildable prefix
    // stays unfused.
    let flush = |cur: &mut Vec<usize>, out: &mut Vec<Run>| {
        let mut start = 0;
        while cur.len() - start >= 2 {
            let built = (start + 2..=cur.len())
                .rev()
                .find_map(|end| build(p, loc, &cur[start..end], &readers, &kept, out.len()));
            match built {
                Some(r) => {
                    start += r.nodes.len();
                    out.push(r);
                }
                None => start += 1,
            }
        }
        cur.clear();
    };
    for (ni, n) in p.nodes.iter().enumerate() {
        if !fusible(p, n) {
            flush(&mut cur, &mut out);
            continue;
        }
        let shape = &p.ty(n.outputs[0]).shape;
        let joins = cur
            .last()
            .is_some_and(|&l| &p.ty(p.nodes[l].outputs[0]).shape == shape)
            && cur.len() < MAX_MEMBERS;
        if !joins {
            flush(&mut cur, &mut out);
        }
        cur.push(ni);
    }
    flush(&mut cur, &mut out);
    out
}

/// The walk over `shape` with one stride array per operand, size-1 dims dropped and
/// neighbouring dims merged where every array steps through both as through one.
fn coalesce(shape: &[usize], strides: &[Vec<i64>]) -> (Vec<i64>, Vec<Vec<i64>>) {
    let mut dims: Vec<i64> = Vec::new();
    let mut ss: Vec<Vec<i64>> = vec![Vec::new(); strides.len()];
    for (k, &size) in shape.iter().enumerate() {
        let size = size as i64;
        if size == 1 {
            continue;
        }
        if let Some(last) = dims.len().checked_sub(1) {
            if strides.iter().zip(&ss).all(|(s, o)| o[last] == s[k] * size) {
                dims[last] *= size;
                for (s, o) in strides.iter().zip(ss.iter_mut()) {
                    o[last] = s[k];
                }
                continue;
            }
        }
        dims.push(size);
        for (s, o) in strides.iter().zip(ss.iter_mut()) {
            o.push(s[k]);
        }
    }
    (dims, ss)
}

/// C type of a dtype's elements.
fn ctype(d: DType) -> &'static str {
    match d {
        DType::F32 => "float",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::Bool => "u8",
        DType::I64 => "i64",
        DType::I32 => "i32",
    }
}

/// The run `members` (consecutive, fusible, one shape) as a kernel named `fused_<id>`, or
/// `None` when a stored output overlaps an operand it may not (see the module's docs).
fn build(
    p: &Program,
    loc: &[(u64, u64)],
    members: &[usize],
    readers: &BTreeMap<ValueId, Vec<usize>>,
    kept: &BTreeSet<ValueId>,
    id: usize,
) -> Option<Run> {
    let (first, last) = (members[0], *members.last()?);
    let produced: BTreeMap<ValueId, usize> = members
        .iter()
        .enumerate()
        .map(|(k, &ni)| (p.nodes[ni].outputs[0], k))
        .collect();
    // outside operands, in first-read order
    let mut operands: Vec<ValueId> = Vec::new();
    for &ni in members {
        for &v in &p.nodes[ni].inputs {
            if !produced.contains_key(&v) && !operands.contains(&v) {
                operands.push(v);
            }
        }
    }
    if operands.len() > MAX_OPERANDS {
        return None;
    }
    // members whose value something outside the run reads
    let stored: Vec<usize> = members
        .iter()
        .enumerate()
        .filter(|&(_, &ni)| {
            let y = p.nodes[ni].outputs[0];
            kept.contains(&y)
                || readers
                    .get(&y)
                    .is_some_and(|r| r.iter().any(|&u| u < first || u > last))
        })
        .map(|(k, _)| k)
        .collect();
    let shape = p.ty(p.nodes[last].outputs[0]).shape.clone();
    let n: u64 = shape.iter().map(|&d| d as u64).product();
    // a stored output may share bytes with an operand only as the same unbroadcast tensor
    if !overlaps_allowed(p, loc, members, &stored, &operands, &shape) {
        return None;
    }
    let name = format!("fused_{id}");
    let s = kernel_source(p, members, &produced, &operands, &stored, &name, &shape)?;
    let mut args: Vec<Arg> = operands
        .iter()
        .map(|&v| Arg::Ptr(loc[v.index()].0))
        .collect();
    args.extend(
        stored
            .iter()
            .map(|&k| Arg::Ptr(loc[p.nodes[members[k]].outputs[0].index()].0)),
    );
    Some(Run {
        nodes: members.to_vec(),
        stored: stored
            .iter()
            .map(|&k| p.nodes[members[k]].outputs[0])
            .collect(),
        operands,
        launch: Launch {
            kernel: name,
            grid: flat_grid(n as usize),
            block: 256,
            args,
        },
        source: s,
    })
}

/// Whether every stored output of the run that shares bytes with an operand shares them
/// only as the same unbroadcast tensor (same bytes, shape and dtype).
fn overlaps_allowed(
    p: &Program,
    loc: &[(u64, u64)],
    members: &[usize],
    stored: &[usize],
    operands: &[ValueId],
    shape: &[usize],
) -> bool {
    let range = |v: ValueId| {
        let (o, b) = loc[v.index()];
        (o, o + b.max(p.ty(v).size_bytes() as u64))
    };
    for &k in stored {
        let y = p.nodes[members[k]].outputs[0];
        let (y0, y1) = range(y);
        for &x in operands {
            let (x0, x1) = range(x);
            if x0 < y1 && y0 < x1 {
                let same = x0 == y0 && p.ty(x).shape == shape && p.ty(x).dtype == p.ty(y).dtype;
                if !same {
                    return false;
                }
            }
        }
    }
    true
}

/// The CUDA source of the run's kernel `name`: one thread per element of `shape`, each
/// operand read once at its broadcast offset, every member computed in f32 and rounded to
/// its dtype, the stored outputs written. `None` when a member is not a fusible op.
fn kernel_source(
    p: &Program,
    members: &[usize],
    produced: &BTreeMap<ValueId, usize>,
    operands: &[ValueId],
    stored: &[usize],
    name: &str,
    shape: &[usize],
) -> Option<String> {
    let n: u64 = shape.iter().map(|&d| d as u64).product();
    let (first, last) = (members[0], *members.last()?);
    let strides: Vec<Vec<i64>> = operands
        .iter()
        .map(|&v| bcast(&p.ty(v).shape, shape))
        .collect();
    let (dims, ss) = coalesce(shape, &strides);
    let max_off = operands
        .iter()
        .map(|&v| p.ty(v).numel() as u64)
        .chain([n])
        .max()
        .unwrap_or(0);
    let idx = if max_off <= u32::MAX as u64 {
        "u32"
    } else {
        "u64"
    };
    let mut s = String::new();
    // signature: operands, then stored outputs
    let mut params: Vec<String> = operands
        .iter()
        .enumerate()
        .map(|(j, &v)| format!("const {}* x{j}", ctype(p.ty(v).dtype)))
        .collect();
    params.extend(stored.iter().map(|&k| {
        let y = p.nodes[members[k]].outputs[0];
        format!("{}* y{k}", ctype(p.ty(y).dtype))
    }));
    let _ = writeln!(
        s,
        "// {}: nodes {} .. {} ({} members)",
        name,
        p.nodes[first].name,
        p.nodes[last].name,
        members.len()
    );
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void {name}({}) {{",
        params.join(", ")
    );
    let _ = writeln!(s, "    GRID_LOOP(i, (i64){n}) {{");
    // offsets: innermost dim first
    let _ = writeln!(s, "        {idx} r = ({idx})i, c;");
    for j in 0..operands.len() {
        let _ = writeln!(s, "        {idx} o{j} = 0;");
    }
    for q in (0..dims.len()).rev() {
        if q > 0 {
            let _ = writeln!(s, "        c = r % {}u; r = r / {}u;", dims[q], dims[q]);
        } else {
            let _ = writeln!(s, "        c = r;");
        }
        for (j, sj) in ss.iter().enumerate() {
            if sj[q] != 0 {
                let _ = writeln!(s, "        o{j} += c * {}u;", sj[q]);
            }
        }
    }
    for (j, &v) in operands.iter().enumerate() {
        if p.ty(v).dtype == DType::Bool {
            let _ = writeln!(s, "        const bool a{j} = x{j}[o{j}] != 0;");
        } else {
            let _ = writeln!(s, "        const float a{j} = to_f(x{j}[o{j}]);");
        }
    }
    let arg = |v: ValueId| -> String {
        match produced.get(&v) {
            Some(k) => format!("v{k}"),
            None => format!("a{}", operands.iter().position(|&o| o == v).unwrap_or(0)),
        }
    };
    for (k, &ni) in members.iter().enumerate() {
        let nd = &p.nodes[ni];
        let yd = p.ty(nd.outputs[0]).dtype;
        let expr = match &nd.op {
            Op::Unary(u) => {
                format!("unary_f({}, {})", u.code(), arg(nd.inputs[0]))
            }
            Op::Binary(b) => format!(
                "binary_f({}, {}, {})",
                b.code(),
                arg(nd.inputs[0]),
                arg(nd.inputs[1])
            ),
            Op::Where => format!(
                "({} ? {} : {})",
                arg(nd.inputs[0]),
                arg(nd.inputs[1]),
                arg(nd.inputs[2])
            ),
            Op::Cast { .. } => arg(nd.inputs[0]),
            _ => return None,
        };
        let rounded = if yd == DType::F32 {
            expr
        } else {
            format!("to_f(from_f<{}>({expr}))", ctype(yd))
        };
        let _ = writeln!(s, "        const float v{k} = {rounded};  // {}", nd.name);
    }
    for &k in stored {
        let yd = p.ty(p.nodes[members[k]].outputs[0]).dtype;
        let _ = writeln!(s, "        y{k}[i] = from_f<{}>(v{k});", ctype(yd));
    }
    let _ = writeln!(s, "    }}\n}}");
    Some(s)
}

/// The work of every node of `p` under `runs`: the run's kernel on its last node, nothing on
/// its other members; `None` for nodes outside every run.
pub fn work_of(runs: &[Run]) -> BTreeMap<usize, Vec<Work>> {
    let mut out = BTreeMap::new();
    for r in runs {
        let (&last, rest) = r.nodes.split_last().expect("a run has members");
        for &ni in rest {
            out.insert(ni, Vec::new());
        }
        out.insert(last, vec![Work::Kernel(r.launch.clone())]);
    }
    out
}

/// Bytes the members of `runs` move through memory: unfused (every member reads its inputs
/// and writes its output) and fused (each kernel reads its operands and writes its stored
/// values once), tensor sizes as the plan has them (a broadcast operand counts once).
pub fn traffic(p: &Program, runs: &[Run]) -> (u64, u64) {
    let size = |v: &ValueId| p.ty(*v).size_bytes() as u64;
    let mut unfused = 0;
    let mut fused = 0;
    for r in runs {
        for &ni in &r.nodes {
            let n = &p.nodes[ni];
            unfused += n.inputs.iter().chain(&n.outputs).map(size).sum::<u64>();
        }
        fused += r.operands.iter().chain(&r.stored).map(size).sum::<u64>();
    }
    (unfused, fused)
}
