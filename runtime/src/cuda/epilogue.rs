//! cuBLASLt epilogues: for every matrix product of a plan, which of its neighbours
//! cuBLASLt's `cublasLtMatmul` could compute in the same call, and why not where it cannot.
//! Pure Rust over the plan's program (no GPU, no `cuda` feature). The choice is reported
//! (`HZP_CUDA_EXPLAIN=1` prints it when a plan is lowered, `tests/cuda_epilogues.rs` keeps the
//! tiny GPT-2's as a snapshot); the CUDA backend does not call cuBLASLt yet: every product
//! still runs as a cuBLAS GEMM and its neighbours as their own kernels.
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

/// What a product's call computes besides the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// The product alone (`CUBLASLT_EPILOGUE_DEFAULT`).
    Default,
    Bias,
    GeluAuxBias,
    Dgelu,
    DgeluBgrad,
    BgradA,
}

impl Epilogue {
    /// cuBLASLt's name.
    pub fn name(self) -> &'static str {
        match self {
            Epilogue::Default => "DEFAULT",
            Epilogue::Bias => "BIAS",
            Epilogue::GeluAuxBias => "GELU_AUX_BIAS",
            Epilogue::Dgelu => "DGELU",
            Epilogue::DgeluBgrad => "DGELU_BGRAD",
            Epilogue::BgradA => "BGRADA",
        }
    }
}

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
            } else if !ready_at(p, &producer, m, add, &[via]) {
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
                // + GELU, the pre-activation kept as the auxiliary output
                let z = p.nodes[add].outputs[0];
                if let Some((zr, _)) = uses_through_views(p, &u, z) {
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
                        }
                    }
                }
            }
            out.push(c);
            continue;
        }
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
            } else if !ready_at(p, &producer, m, g, &[via]) {
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
                c.aux = Some(view_source(p, &producer, pre));
                let dz = p.nodes[g].outputs[0];
                if let Some((dr, _)) = uses_through_views(p, &u, dz) {
                    if let Some(&(r, _)) = dr.iter().find(|&&(r, _)| is_row_sum(p, r, n)) {
                        c.epilogue = Epilogue::DgeluBgrad;
                        c.absorbs.push(r);
                        absorbed[r] = true;
                    }
                }
            }
            out.push(c);
            continue;
        }
        // ---- a weight gradient X^T dY whose dY is also summed over its rows
        if !batched {
            let dy = node.inputs[1];
            let src = view_source(p, &producer, dy);
            let sums: Vec<usize> = uses_through_views(p, &u, src)
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
                        uses_through_views(p, &u, p.nodes[r].outputs[0]).and_then(|(rs, views)| {
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
                        }
                    }
                } else {
                    c.epilogue = Epilogue::BgradA;
                    c.absorbs.push(r);
                    absorbed[r] = true;
                }
            }
        }
        out.push(c);
    }
    out
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
