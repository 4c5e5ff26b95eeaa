//! cuBLASLt epilogues: for every matrix product of a plan, which of its neighbours
//! cuBLASLt's `cublasLtMatmul` could compute in the same call, and why not where it cannot.
//! Pure Rust over the plan's program (no GPU, no `cuda` feature). The choice is reported
//! (`HZP_CUDA_EXPLAIN=1` prints it when a plan is lowered, `tests/cuda_epilogues.rs` keeps the
//! tiny GPT-2's as a snapshot) and, with `HZP_CUDA_LT=1` (off by default: never run on a
//! GPU), [`wire`] puts it in the lowered work as `Work::LtGemm`, which the executor runs with
//! `cublasLtMatmul`; otherwise every product runs as a cuBLAS GEMM and its neighbours as their
//! own kernels.
//!
//! A product `Y[M,N] = A[M,K] B[K,N]` (row-major; cuBLAS computes the column-major `Y^T =
//! B^T A^T`, so cuBLAS's matrix `D` is `Y^T`, `N` rows, and its `A` operand is the plan's `B`):
//! - `BIAS`: `Y + b` with `b` of `N` elements (shape `[N]` or `[1, N]`), the sum `Y`'s only
//!   reader;
//! - `GELU_AUX_BIAS`: that sum's only other use is the tanh GELU, whose backward
//!   (`GeluTanhGrad`) reads the sum as the pre-activation: cuBLASLt stores the GELU as `D` and
//!   the pre-activation as its auxiliary output (`EPILOGUE_AUX_POINTER`, leading dimension a
//!   multiple of 8 elements, so `N % 8 == 0`);
//! - `DGELU` / `DGELU_BGRAD`: a product whose only reader is `GeluTanhGrad(pre, Y)` (the
//!   incoming gradient times the GELU's derivative at the saved pre-activation, `pre` read as
//!   the auxiliary input), and with `_BGRAD` the sum of that gradient over its rows (the bias
//!   gradient of the layer below), a `Reduce{sum}` over every axis but the last;
//! - `BGRADA`: a weight gradient `dW = X^T dY` whose second operand `dY[M,N]` is also summed
//!   over its rows by a `Reduce{sum}` (the bias gradient): cuBLASLt sums its `A` operand (the
//!   plan's `dY`) over the product's `k` (`M`).
//!
//! Reshapes that keep the last dim are looked through (rows merged or split; the lowering
//! runs them as views or copies). A neighbour is only absorbed where it runs after the product
//! (so the one call can take the product's place in the program) and its inputs are there
//! when the product runs; other reasons a product is not fused: a dtype cuBLASLt's epilogues
//! do not take (f32, bf16, f16 only), a batched product (the epilogues take one matrix), a
//! second reader of the intermediate (which would need it stored anyway), the erf GELU
//! (cuBLASLt's GELU is the tanh approximation).

use hzp_ir::{BinaryOp, DType, Op, Program, ReduceOp, UnaryOp, ValueId};
use std::fmt::Write as _;

pub use super::work::Epilogue;

/// The choice for one product.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// The MatMul node.
    pub node: usize,
    pub epilogue: Epilogue,
    /// The nodes the call computes too (besides views between them).
    pub absorbs: Vec<usize>,
    /// The auxiliary value (GELU's pre-activation: stored, or read back by DGELU).
    pub aux: Option<ValueId>,
    /// Why a neighbour was not absorbed (empty when nothing was in reach).
    pub why_not: Vec<String>,
    /// The value the call's `D` holds (the last absorbed node's result, or the product's).
    pub d: Option<ValueId>,
    /// The bias (BIAS, GELU_AUX_BIAS: read) or the bias gradient (DGELU_BGRAD, BGRADA:
    /// written).
    pub bias: Option<ValueId>,
}

/// Readers of each value (node indices, program order) and whether it leaves the program
/// (an output or an update's value).
struct Uses {
    readers: Vec<Vec<usize>>,
    escapes: Vec<bool>,
}

impl Uses {
    fn new(p: &Program) -> Uses {
        let mut readers = vec![Vec::new(); p.values.len()];
        for (i, n) in p.nodes.iter().enumerate() {
            for &v in &n.inputs {
                if readers[v.index()].last() != Some(&i) {
                    readers[v.index()].push(i);
                }
            }
        }
        let mut escapes = vec![false; p.values.len()];
        for &v in &p.outputs {
            escapes[v.index()] = true;
        }
        for u in &p.updates {
            escapes[u.value.index()] = true;
        }
        Uses { readers, escapes }
    }
}

fn float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::BF16 | DType::F16)
}

/// Whether node `i` is a Reshape that keeps its input's last dim.
fn row_view(p: &Program, i: usize) -> bool {
    let n = &p.nodes[i];
    matches!(n.op, Op::Reshape { .. })
        && p.ty(n.inputs[0]).shape.last() == p.ty(n.outputs[0]).shape.last()
}

/// (reader node, the value it reads) pairs, and the row views passed on the way.
type ViewUses = (Vec<(usize, ValueId)>, Vec<usize>);

/// The uses of `v` through row views: (reader node, the value it reads), and the views
/// passed; `None` if `v` or a view of it leaves the program.
fn uses_through_views(p: &Program, u: &Uses, v: ValueId) -> Option<ViewUses> {
    let mut out = Vec::new();
    let mut views = Vec::new();
    let mut stack = vec![v];
    while let Some(x) = stack.pop() {
        if u.escapes[x.index()] {
            return None;
        }
        for &r in &u.readers[x.index()] {
            if row_view(p, r) {
                views.push(r);
                stack.push(p.nodes[r].outputs[0]);
            } else {
                out.push((r, x));
            }
        }
    }
    out.sort();
    views.sort();
    Some((out, views))
}

/// The value `v` is a row view of (following Reshapes back), and `v` itself otherwise.
fn view_source(p: &Program, producer: &[Option<usize>], mut v: ValueId) -> ValueId {
    while let Some(i) = producer[v.index()] {
        if !row_view(p, i) {
            break;
        }
        v = p.nodes[i].inputs[0];
    }
    v
}

fn name(p: &Program, i: usize) -> String {
    format!("`{}`", p.nodes[i].name)
}

/// Whether `r` (a node after the product `m`) may be computed by `m`'s call: every input it
/// has besides `via` is produced before `m`.
fn ready_at(p: &Program, producer: &[Option<usize>], m: usize, r: usize, via: &[ValueId]) -> bool {
    p.nodes[r]
        .inputs
        .iter()
        .all(|v| via.contains(v) || producer[v.index()].is_none_or(|i| i < m))
}

/// `Reduce{sum}` over every axis but the last (the rows), of a value whose last dim is `n`.
fn is_row_sum(p: &Program, i: usize, n: usize) -> bool {
    let node = &p.nodes[i];
    let Op::Reduce {
        op: ReduceOp::Sum,
        axes,
        ..
    } = &node.op
    else {
        return false;
    };
    let shape = &p.ty(node.inputs[0]).shape;
    shape.last() == Some(&n) && *axes == (0..shape.len() - 1).collect::<Vec<_>>()
}

/// The choice for every MatMul of `p`, in program order. `loc`: the lowering's buffer of each
/// value (offset, bytes), when known: a Reshape whose output shares its input's bytes runs
/// nothing, so where it stands does not order anything (without `loc` every view counts as
/// running where the plan put it).
pub fn choose(p: &Program, loc: Option<&[(u64, u64)]>) -> Vec<Choice> {
    let u = Uses::new(p);
    let mut producer = vec![None; p.values.len()];
    for (i, n) in p.nodes.iter().enumerate() {
        for &v in &n.outputs {
            producer[v.index()] = Some(i);
        }
    }
    let mut absorbed = vec![false; p.nodes.len()];
    let mut out = Vec::new();
    for (m, node) in p.nodes.iter().enumerate() {
        if !matches!(node.op, Op::MatMul) {
            continue;
        }
        let mut c = Choice {
            node: m,
            epilogue: Epilogue::Default,
            absorbs: Vec::new(),
            aux: None,
            why_not: Vec::new(),
            d: None,
            bias: None,
        };
        let y = node.outputs[0];
        let yt = p.ty(y);
        let n = yt.shape.last().copied().unwrap_or(1);
        if !float(yt.dtype) {
            c.why_not
                .push(format!("{} products have no epilogues", yt.dtype));
            out.push(c);
            continue;
        }
        let batched = yt.shape.len() != 2 || node.inputs.iter().any(|&v| p.ty(v).shape.len() != 2);
        let Some((readers, _)) = uses_through_views(p, &u, y) else {
            out.push(c);
            continue;
        };
        let cx = Cx {
            p,
            u: &u,
            producer: &producer,
            loc,
        };
        let at = At {
            m,
            n,
            batched,
            readers: &readers,
        };
        if forward_bias(&cx, &at, &mut c, &mut absorbed)
            || backward_dgelu(&cx, &at, &mut c, &mut absorbed)
        {
            out.push(c);
            continue;
        }
        weight_grad_bias(&cx, &at, node, &mut c, &mut absorbed);
        out.push(c);
    }
    out
}

/// What the choice of one product reads: the program, its uses, each value's producer and
/// the lowering's buffers.
#[derive(Clone, Copy)]
struct Cx<'a> {
    p: &'a Program,
    u: &'a Uses,
    producer: &'a [Option<usize>],
    loc: Option<&'a [(u64, u64)]>,
}

/// The product being chosen for: its node, its result's last dim, whether it is batched,
/// and the readers of its result (through views).
struct At<'a> {
    m: usize,
    n: usize,
    batched: bool,
    readers: &'a [(usize, ValueId)],
}

/// The forward epilogues: `+ bias`, and `+ bias` then GELU with the pre-activation kept.
/// Whether the product's result goes to a bias add (then the choice is made).
fn forward_bias(cx: &Cx, at: &At, c: &mut Choice, absorbed: &mut [bool]) -> bool {
    let (p, u, producer) = (cx.p, cx.u, cx.producer);
    let (m, n, batched, readers) = (at.m, at.n, at.batched, at.readers);
    let yt = p.ty(p.nodes[m].outputs[0]);
    // ---- forward: + bias (+ GELU)
    let bias_add = readers.iter().find_map(|&(r, via)| match p.nodes[r].op {
        Op::Binary(BinaryOp::Add) => {
            let other = p.nodes[r].inputs.iter().copied().find(|&v| v != via)?;
            let ot = p.ty(other);
            let per_col = ot.numel() == n
                && ot.shape.last() == Some(&n)
                && ot.shape.len() <= 2
                && p.ty(p.nodes[r].outputs[0]).shape == p.ty(via).shape;
            per_col.then_some((r, via, other))
        }
        _ => None,
    });
    if let Some((add, via, bias)) = bias_add {
        if batched {
            c.why_not.push(format!(
                "a batched product: the bias epilogue of {} takes one matrix",
                name(p, add)
            ));
        } else if readers.len() > 1 {
            let other = readers.iter().find(|&&(r, _)| r != add).map(|&(r, _)| r);
            c.why_not.push(format!(
                "its result has another reader than the bias add {}: {}",
                name(p, add),
                other.map_or("?".into(), |r| name(p, r))
            ));
        } else if !ready_at(p, producer, m, add, &[via]) {
            c.why_not.push(format!(
                "the bias of {} is computed after the product",
                name(p, add)
            ));
        } else if p.ty(bias).dtype != yt.dtype {
            c.why_not.push(format!(
                "the bias of {} is {}, the product {}",
                name(p, add),
                p.ty(bias).dtype,
                yt.dtype
            ));
        } else {
            c.epilogue = Epilogue::Bias;
            c.absorbs.push(add);
            absorbed[add] = true;
            c.d = Some(p.nodes[add].outputs[0]);
            c.bias = Some(bias);
            // + GELU, the pre-activation kept as the auxiliary output
            let z = p.nodes[add].outputs[0];
            if let Some((zr, _)) = uses_through_views(p, u, z) {
                let gelu: Vec<usize> = zr
                    .iter()
                    .filter(|&&(r, _)| matches!(p.nodes[r].op, Op::Unary(UnaryOp::GeluTanh)))
                    .map(|&(r, _)| r)
                    .collect();
                let erf = zr
                    .iter()
                    .find(|&&(r, _)| matches!(p.nodes[r].op, Op::Unary(UnaryOp::Gelu)));
                let grads_of_pre = zr.iter().all(|&(r, via)| {
                    gelu.contains(&r)
                        || (matches!(p.nodes[r].op, Op::GeluTanhGrad)
                            && p.nodes[r].inputs[0] == via)
                });
                if let Some(&(e, _)) = erf {
                    c.why_not.push(format!(
                        "{} is the erf GELU; cuBLASLt's GELU epilogue is the tanh approximation",
                        name(p, e)
                    ));
                } else if gelu.len() == 1 {
                    if !grads_of_pre {
                        let other = zr
                            .iter()
                            .find(|&&(r, _)| {
                                r != gelu[0] && !matches!(p.nodes[r].op, Op::GeluTanhGrad)
                            })
                            .map_or("?".into(), |&(r, _)| name(p, r));
                        c.why_not.push(format!(
                            "the pre-activation of {} has another reader: {other}",
                            name(p, gelu[0])
                        ));
                    } else if n % 8 != 0 {
                        c.why_not.push(format!(
                            "{}: the pre-activation's leading dimension {n} is not a multiple of 8 (cuBLASLt's auxiliary output)",
                            name(p, gelu[0])
                        ));
                    } else {
                        c.epilogue = Epilogue::GeluAuxBias;
                        c.absorbs.push(gelu[0]);
                        absorbed[gelu[0]] = true;
                        c.aux = Some(z);
                        c.d = Some(p.nodes[gelu[0]].outputs[0]);
                    }
                }
            }
        }
        return true;
    }
    false
}

/// The backward epilogues: GELU's gradient, and with it the bias gradient of the layer below.
/// Whether the product's result goes to a GELU gradient (then the choice is made).
fn backward_dgelu(cx: &Cx, at: &At, c: &mut Choice, absorbed: &mut [bool]) -> bool {
    let (p, u, producer) = (cx.p, cx.u, cx.producer);
    let (m, n, batched, readers) = (at.m, at.n, at.batched, at.readers);
    // ---- backward: GELU's gradient (+ the bias gradient of the layer below)
    let dgelu = readers.iter().find(|&&(r, via)| {
        matches!(p.nodes[r].op, Op::GeluTanhGrad) && p.nodes[r].inputs[1] == via
    });
    if let Some(&(g, via)) = dgelu {
        let pre = p.nodes[g].inputs[0];
        if batched {
            c.why_not.push(format!(
                "a batched product: {} needs one matrix",
                name(p, g)
            ));
        } else if readers.len() > 1 {
            c.why_not
                .push(format!("its result has another reader than {}", name(p, g)));
        } else if !ready_at(p, producer, m, g, &[via]) {
            c.why_not.push(format!(
                "the pre-activation {} read by {} is computed after the product",
                p.value(pre).name,
                name(p, g)
            ));
        } else if n % 8 != 0 {
            c.why_not.push(format!(
                "{}: the pre-activation's leading dimension {n} is not a multiple of 8",
                name(p, g)
            ));
        } else {
            c.epilogue = Epilogue::Dgelu;
            c.absorbs.push(g);
            absorbed[g] = true;
            c.aux = Some(view_source(p, producer, pre));
            let dz = p.nodes[g].outputs[0];
            c.d = Some(dz);
            if let Some((dr, _)) = uses_through_views(p, u, dz) {
                if let Some(&(r, _)) = dr.iter().find(|&&(r, _)| is_row_sum(p, r, n)) {
                    c.epilogue = Epilogue::DgeluBgrad;
                    c.absorbs.push(r);
                    absorbed[r] = true;
                    c.bias = Some(p.nodes[r].outputs[0]);
                }
            }
        }
        return true;
    }
    false
}

/// A weight gradient `Xᵀ dY` whose `dY` is also summed over its rows: the bias gradient as
/// the product's epilogue.
fn weight_grad_bias(cx: &Cx, at: &At, node: &hzp_ir::Node, c: &mut Choice, absorbed: &mut [bool]) {
    let (p, u, producer, loc) = (cx.p, cx.u, cx.producer, cx.loc);
    let (m, n, batched) = (at.m, at.n, at.batched);
    let y = node.outputs[0];
    // ---- a weight gradient X^T dY whose dY is also summed over its rows
    if !batched {
        let dy = node.inputs[1];
        let src = view_source(p, producer, dy);
        let sums: Vec<usize> = uses_through_views(p, u, src)
            .map(|(rs, _)| {
                rs.into_iter()
                    .map(|(r, _)| r)
                    .filter(|&r| is_row_sum(p, r, n))
                    .collect()
            })
            .unwrap_or_default();
        if let Some(&r) = sums.first() {
            if absorbed[r] {
                c.why_not.push(format!(
                    "the bias gradient {} is taken by an earlier product's epilogue",
                    name(p, r)
                ));
            } else if r < m {
                // its first reader, a view counted unless it shares its input's bytes
                // (then the lowering runs nothing for it; a copied view runs where the
                // plan put it)
                let free = |i: usize| {
                    loc.is_some_and(|l| {
                        let n = &p.nodes[i];
                        l[n.inputs[0].index()].0 == l[n.outputs[0].index()].0
                    })
                };
                let first =
                    uses_through_views(p, u, p.nodes[r].outputs[0]).and_then(|(rs, views)| {
                        (rs.iter().map(|&(x, _)| x))
                            .chain(views.into_iter().filter(|&v| !free(v)))
                            .min()
                    });
                match first {
                    Some(x) if x < m => c.why_not.push(format!(
                        "the bias gradient {} is read by {} before the product runs (node {x} < {m}): the call would have to move ahead of the memory plan's order",
                        name(p, r),
                        name(p, x)
                    )),
                    _ => {
                        c.epilogue = Epilogue::BgradA;
                        c.absorbs.push(r);
                        absorbed[r] = true;
                        c.d = Some(y);
                        c.bias = Some(p.nodes[r].outputs[0]);
                    }
                }
            } else {
                c.epilogue = Epilogue::BgradA;
                c.absorbs.push(r);
                absorbed[r] = true;
                c.d = Some(y);
                c.bias = Some(p.nodes[r].outputs[0]);
            }
        }
    }
}

/// One line per product: its name, shapes and dtype, the epilogue, what it absorbs, and why
/// not where a neighbour stayed apart; then the counts per epilogue.
pub fn report(p: &Program, choices: &[Choice]) -> String {
    let mut s = String::new();
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for c in choices {
        let n = &p.nodes[c.node];
        let shapes: Vec<String> = n
            .inputs
            .iter()
            .map(|&v| format!("{:?}", p.ty(v).shape))
            .collect();
        let _ = write!(
            s,
            "{} {} {}: {}",
            name(p, c.node),
            shapes.join("x"),
            p.ty(n.outputs[0]).dtype,
            c.epilogue.name()
        );
        if !c.absorbs.is_empty() {
            let a: Vec<String> = c.absorbs.iter().map(|&i| name(p, i)).collect();
            let _ = write!(s, " absorbs {}", a.join(", "));
        }
        if let Some(v) = c.aux {
            let _ = write!(s, "; aux `{}`", p.value(v).name);
        }
        if !c.why_not.is_empty() {
            let _ = write!(s, "; not fused: {}", c.why_not.join("; "));
        }
        s.push('\n');
        match counts.iter_mut().find(|(k, _)| *k == c.epilogue.name()) {
            Some((_, k)) => *k += 1,
            None => counts.push((c.epilogue.name(), 1)),
        }
    }
    let total: Vec<String> = counts.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let _ = writeln!(s, "{} products: {}", choices.len(), total.join(", "));
    s
}

/// Live range of every value in node positions: (first, last); values no node produces
/// (inputs, parameters, constants, states) and values that leave the program live throughout.
fn live_ranges(p: &Program, u: &Uses) -> Vec<(usize, usize)> {
    let mut r = vec![(0usize, usize::MAX); p.values.len()];
    for (i, n) in p.nodes.iter().enumerate() {
        for &v in &n.outputs {
            let last = if u.escapes[v.index()] {
                usize::MAX
            } else {
                u.readers[v.index()].last().copied().unwrap_or(i)
            };
            r[v.index()] = (i, last);
        }
    }
    r
}

/// Rewrites the lowered work of the chosen products (`HZP_CUDA_LT=1`): the product's `Gemm`
/// becomes an [`LtGemm`](super::work::LtGemm) that writes `D` where the last absorbed node
/// wrote its result, the absorbed nodes and the views that only fed them do no work. Wired
/// only where the lowering can keep the plan's memory: an f32, bf16 or f16 product of one
/// call (operands, `D`, the bias and the auxiliary matrix all of that type, accumulated in
/// f32), placed where every buffer it touches is its own:
/// - at the product, when every result the call writes earlier than the plan did (`D`, the
///   pre-activation, a bias gradient) has a buffer no other value holds between the product
///   and the node that wrote it;
/// - otherwise at the first absorbed node, when the product records no event, what the call
///   reads (its operands, the bias, the pre-activation) keeps its bytes until there, and the
///   results it writes earlier than planned hold their buffers from there.
///
/// No node it replaces may be a member of an elementwise fused run (`fused`, per node) or
/// record or wait for an event. Gives per chosen product whether it was wired or why not.
pub fn wire(
    p: &Program,
    loc: &[(u64, u64)],
    choices: &[Choice],
    fused: &[bool],
    nodes: &mut [super::work::NodeWork],
) -> Vec<(usize, Result<(), String>)> {
    let u = Uses::new(p);
    let mut producer = vec![None; p.values.len()];
    for (i, n) in p.nodes.iter().enumerate() {
        for &v in &n.outputs {
            producer[v.index()] = Some(i);
        }
    }
    let w = Wiring {
        p,
        loc,
        live: live_ranges(p, &u),
        producer,
        u,
    };
    let mut out = Vec::new();
    for c in choices.iter().filter(|c| c.epilogue != Epilogue::Default) {
        match w.one(c, fused, nodes) {
            Ok((at, lt, gone)) => {
                w.apply(c.node, at, lt, &gone, nodes);
                out.push((c.node, Ok(())));
            }
            Err(e) => out.push((c.node, Err(e))),
        }
    }
    out
}

/// What [`wire`] reads of the plan: its program, buffers, each value's live range (program
/// positions of its definition and last reader) and producer.
struct Wiring<'a> {
    p: &'a Program,
    loc: &'a [(u64, u64)],
    live: Vec<(usize, usize)>,
    producer: Vec<Option<usize>>,
    u: Uses,
}

fn has_events(nw: &super::work::NodeWork) -> bool {
    use super::work::Work;
    nw.work
        .iter()
        .any(|w| matches!(w, Work::Record(_) | Work::Wait(_)))
}

impl Wiring<'_> {
    /// The call for choice `c`: where it runs (a node), the call, and the nodes whose work
    /// goes away (absorbed, and the views only they read).
    fn one(
        &self,
        c: &Choice,
        fused: &[bool],
        nodes: &[super::work::NodeWork],
    ) -> Result<(usize, super::work::LtGemm, Vec<usize>), String> {
        use super::work::{LtGemm, Work};
        let (p, loc, m) = (self.p, self.loc, c.node);
        let gemms: Vec<&super::work::Gemm> = (nodes[m].work.iter())
            .filter_map(|w| match w {
                Work::Gemm(g) => Some(g),
                _ => None,
            })
            .collect();
        let [g] = gemms[..] else {
            return Err("not one cuBLAS product".into());
        };
        if !float(g.dtype) || g.batch != 1 || g.calls.len() != 1 {
            return Err(format!(
                "wired for one f32, bf16 or f16 product only ({}, batch {}, {} calls)",
                g.dtype,
                g.batch,
                g.calls.len()
            ));
        }
        // the chain: the product's result, the absorbed results, views that only feed them
        let mut chain: Vec<ValueId> = p.nodes[m].outputs.clone();
        for &a in &c.absorbs {
            chain.extend(&p.nodes[a].outputs);
        }
        let dead_views = dead_views(p, &self.u, m, &c.absorbs);
        let gone: Vec<usize> = c.absorbs.iter().chain(&dead_views).copied().collect();
        if let Some(&f) = gone.iter().find(|&&a| fused[a]) {
            return Err(format!("{} is in an elementwise fused run", name(p, f)));
        }
        for &v in &dead_views {
            chain.extend(&p.nodes[v].outputs);
        }
        let at = match self.writes_from(c, &chain, m) {
            Ok(()) => m,
            Err(early) => self.late(c, &chain, nodes).map_err(|late| {
                format!("at the product: {early}; at the first absorbed node: {late}")
            })?,
        };
        if let Some(&a) = gone.iter().find(|&&a| a != at && has_events(&nodes[a])) {
            return Err(format!(
                "{} records or waits for an event another stream depends on",
                name(p, a)
            ));
        }
        let mut gemm = g.clone();
        if let Some(d) = c.d {
            gemm.calls[0].2 = loc[d.index()].0;
        }
        let off = |v: Option<ValueId>| v.map(|v| loc[v.index()].0);
        let lt = LtGemm {
            gemm,
            epilogue: c.epilogue,
            bias: off(c.bias),
            aux: off(c.aux),
        };
        Ok((at, lt, gone))
    }

    /// Whether every result the call writes earlier than the plan (produced after node `at`)
    /// has its buffer to itself from `at` to where the plan wrote it.
    fn writes_from(&self, c: &Choice, chain: &[ValueId], at: usize) -> Result<(), String> {
        for o in [c.d, c.aux, c.bias].into_iter().flatten() {
            let Some(q) = self.producer[o.index()].filter(|&q| q > at) else {
                continue;
            };
            if let Some(wv) = self.holder(o, chain, |(def, last)| def <= q && last >= at) {
                return Err(format!(
                    "`{}`'s buffer holds `{}` between node {at} and node {q}",
                    self.p.value(o).name,
                    self.p.value(wv).name
                ));
            }
        }
        Ok(())
    }

    /// Another value than `o` and the chain's whose buffer overlaps `o`'s and whose live
    /// range satisfies `when`.
    fn holder(
        &self,
        o: ValueId,
        chain: &[ValueId],
        when: impl Fn((usize, usize)) -> bool,
    ) -> Option<ValueId> {
        let a = self.loc[o.index()];
        (self.live.iter().enumerate())
            .map(|(w, &lw)| (ValueId(w as u32), lw))
            .find(|&(wv, lw)| {
                wv != o && !chain.contains(&wv) && overlap(self.loc[wv.index()], a) && when(lw)
            })
            .map(|x| x.0)
    }

    /// The call at the first absorbed node after the product, where it may run there.
    fn late(
        &self,
        c: &Choice,
        chain: &[ValueId],
        nodes: &[super::work::NodeWork],
    ) -> Result<usize, String> {
        let (p, m) = (self.p, c.node);
        let Some(&q0) = c.absorbs.iter().filter(|&&a| a > m).min() else {
            return Err("nothing absorbed after the product".into());
        };
        if has_events(&nodes[m]) {
            return Err("the product records or waits for an event".into());
        }
        let mut reads: Vec<ValueId> = p.nodes[m].inputs.clone();
        match c.epilogue {
            Epilogue::Bias | Epilogue::GeluAuxBias => reads.extend(c.bias),
            Epilogue::Dgelu | Epilogue::DgeluBgrad => reads.extend(c.aux),
            _ => {}
        }
        for &i in &reads {
            if let Some(wv) = self.holder(i, chain, |(def, _)| def > m && def < q0) {
                return Err(format!(
                    "`{}` is overwritten by `{}` before node {q0}",
                    p.value(i).name,
                    p.value(wv).name
                ));
            }
        }
        self.writes_from(c, chain, q0)?;
        Ok(q0)
    }

    /// Puts the call in node `at`'s work (in place of the product's `Gemm`, or after the
    /// absorbed node's waits and before its records) and empties the work of `gone`.
    fn apply(
        &self,
        m: usize,
        at: usize,
        lt: super::work::LtGemm,
        gone: &[usize],
        nodes: &mut [super::work::NodeWork],
    ) {
        use super::work::Work;
        if at == m {
            for w in nodes[m].work.iter_mut() {
                if matches!(w, Work::Gemm(_)) {
                    *w = Work::LtGemm(lt.clone());
                }
            }
        } else {
            nodes[m].work.retain(|w| !matches!(w, Work::Gemm(_)));
        }
        for &a in gone {
            if a == at {
                let old = std::mem::take(&mut nodes[a].work);
                let waits = old.iter().filter(|w| matches!(w, Work::Wait(_))).cloned();
                let records = old.iter().filter(|w| matches!(w, Work::Record(_))).cloned();
                nodes[a].work = waits
                    .chain(std::iter::once(Work::LtGemm(lt.clone())))
                    .chain(records)
                    .collect();
            } else {
                nodes[a].work.clear();
            }
        }
    }
}

fn overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// Row views reached from product `m`'s result whose every reader is absorbed or another such
/// view (their copies would only carry the product's unwritten result).
fn dead_views(p: &Program, u: &Uses, m: usize, absorbs: &[usize]) -> Vec<usize> {
    let mut dead: Vec<usize> = Vec::new();
    let Some((_, views)) = uses_through_views(p, u, p.nodes[m].outputs[0]) else {
        return dead;
    };
    // innermost first: a view is dead when all its readers are absorbed or dead
    let mut changed = true;
    while changed {
        changed = false;
        for &v in &views {
            if dead.contains(&v) {
                continue;
            }
            let o = p.nodes[v].outputs[0];
            let all = !u.escapes[o.index()]
                && u.readers[o.index()]
                    .iter()
                    .all(|r| absorbs.contains(r) || dead.contains(r));
            if all {
                dead.push(v);
                changed = true;
            }
        }
    }
    dead.sort();
    dead
}
