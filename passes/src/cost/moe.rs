//! What a routed mixture of experts' batched products cost: the rows its buffers fill.
//!
//! A `MoeDispatch { experts: E, capacity: C }` buffer `[E, C, H]` holds each expert's
//! tokens in a prefix of its `C` rows; the rest are zero (docs/moe.md). The batched
//! products over it (`buffer @ W`, and in the backward `dY @ Wᵀ` and `bufferᵀ @ dY`) need
//! only the filled rows: the CPU kernels leave out trailing zero rows and trailing zero
//! contraction terms (`hzp_kernels::cpu::matmul`), as a grouped GEMM on a GPU would.
//! [`filled_fractions`] finds those products in a program, from the ops and shapes, not
//! from names, and gives the fraction of each one's FLOPs ([`super::op_flops`]) that the
//! filled rows take.
//!
//! **Assumed: balanced routing.** Which expert a token picks is only known when the
//! program runs, so a dropless layer (`C >= T`, `T` tokens with `K` choices each) is
//! charged the even share, `min(C, ceil(T K / E))` rows per expert ([`expected_rows`]).
//! An unbalanced step costs more on the most loaded expert; the sum over experts is `T K`
//! rows either way, which is what a sequential CPU run pays. A layer with a capacity
//! factor (`C < T`) is charged its `C` rows: the capacity is the imbalance allowance a
//! fixed-shape implementation computes whether the rows are filled or not, and a full
//! expert does fill them.
//!
//! The fill follows the buffers through ops that keep an empty row empty: the
//! zero-preserving unary ops (not `Sigmoid`, `Exp` or `Cos`, which are nonzero at zero),
//! `Cast`, `Mul` by anything, `Div` of a filled numerator, `Add`/`Sub`/`Max`/`Min` of two
//! filled values (or of one and zeros), `Slice`/`Split`/`Concat` along another axis (a
//! `Concat` with zeros too: a `Slice`'s gradient pads with them), `Transpose`, a `Reshape`
//! that keeps the last two dims, an `AllToAll` (expert parallelism's exchanges keep the share
//! of filled rows), and batched products (a product's result has its row
//! operand's fill); `MoeCombineGrad`'s expert-output gradient is filled like the buffer. A
//! product is charged the fraction of its row operand's rows that are filled times the
//! fraction of its contraction that is (a transposed buffer, or a filled right operand).

use hzp_ir::{BinaryOp, Op, Program, TensorType, UnaryOp};

/// The expected filled rows of each expert's `capacity` rows when `tokens` tokens with
/// `choices` choices each (`tokens * top_k`) are routed to `experts` experts: the balanced
/// share `min(capacity, ceil(choices / experts))` for a dropless layer (`capacity >=
/// tokens`), `capacity` for one with a capacity factor (see the module docs).
pub fn expected_rows(tokens: usize, choices: usize, experts: usize, capacity: usize) -> usize {
    if capacity < tokens || experts == 0 {
        return capacity;
    }
    capacity.min(choices.div_ceil(experts))
}

/// A value's known empty rows: along the axis `from_end` from the end (1 = the last axis),
/// only the leading `fraction` of the rows may be nonzero.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Fill {
    from_end: usize,
    fraction: f64,
}

/// A product's share of its FLOPs that the filled rows take (rows of the row operand times
/// the filled part of the contraction), and its result's fill: the row operand's rows, or
/// the right operand's columns.
fn product_fill(
    (ta, tb): (Option<&TensorType>, Option<&TensorType>),
    (a, b): (Option<Fill>, Option<Fill>),
) -> (f64, Option<Fill>) {
    let ranks = (
        ta.map_or(0, |t| t.shape.len()),
        tb.map_or(0, |t| t.shape.len()),
    );
    if ranks.0 < 2 || ranks.1 < 2 {
        return (1.0, None);
    }
    let at = |e: usize| a.filter(|f| f.from_end == e).map(|f| f.fraction);
    let bt = |e: usize| b.filter(|f| f.from_end == e).map(|f| f.fraction);
    let rows = at(2).unwrap_or(1.0);
    let depth = at(1).unwrap_or(1.0).min(bt(2).unwrap_or(1.0));
    let fill = match (at(2), bt(1)) {
        (Some(r), _) => Some(Fill {
            from_end: 2,
            fraction: r,
        }),
        (None, Some(c)) => Some(Fill {
            from_end: 1,
            fraction: c,
        }),
        _ => None,
    };
    (rows * depth, fill)
}

/// Per node of `p`, the fraction of its [`super::op_flops`] that the filled rows of expert
/// buffers take: below 1 for a product over a dropless `MoeDispatch` buffer or one derived
/// from it row by row (see the module docs), 1 for every other node.
pub fn filled_fractions(p: &Program) -> Vec<f64> {
    let mut fill: Vec<Option<Fill>> = vec![None; p.values.len()];
    // values that are zero throughout (a zero Fill: the gradient of a Slice pads with one)
    let mut zero = vec![false; p.values.len()];
    let mut out = vec![1.0; p.nodes.len()];
    for (ni, n) in p.nodes.iter().enumerate() {
        if let (Op::Fill { value, .. }, Some(&v)) = (&n.op, n.outputs.first()) {
            zero[v.index()] = *value == 0.0;
        }
        let get = |i: usize| -> Option<Fill> { n.inputs.get(i).and_then(|v| fill[v.index()]) };
        let is_zero = |i: usize| n.inputs.get(i).is_some_and(|v| zero[v.index()]);
        let ty = |i: usize| -> Option<&TensorType> { n.inputs.get(i).map(|&v| p.ty(v)) };
        let out_ty = n.outputs.first().map(|&v| p.ty(v));
        let same_shape =
            |i: usize| matches!((ty(i), out_ty), (Some(a), Some(o)) if a.shape == o.shape);
        let result: Option<Fill> = match &n.op {
            Op::MoeDispatch { experts, capacity } => {
                let tokens = ty(0).and_then(|t| t.shape.first().copied()).unwrap_or(0);
                let choices = ty(1).map_or(0, |t| t.shape.iter().product());
                buffer_fill(tokens, choices, *experts, *capacity)
            }
            Op::MoeCombineGrad => {
                // d_expert_out [E, C, H], filled where the buffer is
                let (e, c) = match out_ty.map(|t| &t.shape[..]) {
                    Some([e, c, _]) => (*e, *c),
                    _ => (0, 0),
                };
                let choices = ty(1).map_or(0, |t| t.shape.iter().product());
                let tokens = ty(1).and_then(|t| t.shape.first().copied()).unwrap_or(0);
                buffer_fill(tokens, choices, e, c)
            }
            Op::Unary(u) if zero_preserving(*u) => get(0),
            Op::Cast { .. } | Op::Identity | Op::Copy => get(0),
            // expert parallelism's exchanges (`dist::expert`) move whole rows between ranks:
            // what a rank receives holds the same share of filled rows, one prefix per
            // sender, which a grouped product leaves out as it does one prefix (the CPU
            // kernels trim only the last sender's)
            Op::AllToAll { .. } => get(0),
            Op::Binary(BinaryOp::Mul) => {
                let from = |i: usize| get(i).filter(|_| same_shape(i));
                match (from(0), from(1)) {
                    (Some(a), Some(b)) if a.from_end == b.from_end => Some(Fill {
                        fraction: a.fraction.min(b.fraction),
                        ..a
                    }),
                    (Some(f), _) | (None, Some(f)) => Some(f),
                    _ => None,
                }
            }
            Op::Binary(BinaryOp::Div) => get(0).filter(|_| same_shape(0)),
            Op::Binary(BinaryOp::Add | BinaryOp::Sub | BinaryOp::Max | BinaryOp::Min) => {
                match (get(0), get(1)) {
                    (Some(a), Some(b))
                        if a.from_end == b.from_end && same_shape(0) && same_shape(1) =>
                    {
                        Some(Fill {
                            fraction: a.fraction.max(b.fraction),
                            ..a
                        })
                    }
                    // with zeros: the filled operand's rows
                    (Some(f), None) if is_zero(1) && same_shape(0) => Some(f),
                    (None, Some(f)) if is_zero(0) && same_shape(1) => Some(f),
                    _ => None,
                }
            }
            Op::Slice { axes, .. } => {
                let rank = ty(0).map_or(0, |t| t.shape.len());
                get(0).filter(|f| !axes.contains(&(rank.wrapping_sub(f.from_end))))
            }
            Op::Split { axis, .. } => {
                let rank = ty(0).map_or(0, |t| t.shape.len());
                get(0).filter(|f| *axis != rank.wrapping_sub(f.from_end))
            }
            Op::Concat { axis } => {
                // filled pieces (along the same axis) and zero ones
                let rank = out_ty.map_or(0, |t| t.shape.len());
                let all: Option<Vec<Option<Fill>>> = (0..n.inputs.len())
                    .map(|i| {
                        if is_zero(i) {
                            Some(None)
                        } else {
                            get(i).map(Some)
                        }
                    })
                    .collect();
                all.and_then(|fs| {
                    let filled: Vec<Fill> = fs.into_iter().flatten().collect();
                    let first = *filled.first()?;
                    let along = *axis == rank.wrapping_sub(first.from_end);
                    (!along && filled.iter().all(|f| f.from_end == first.from_end)).then(|| Fill {
                        fraction: filled.iter().map(|f| f.fraction).fold(0.0, f64::max),
                        ..first
                    })
                })
            }
            Op::Transpose { perm } => get(0).and_then(|f| {
                let rank = perm.len();
                let axis = rank.checked_sub(f.from_end)?;
                let j = perm.iter().position(|&q| q == axis)?;
                Some(Fill {
                    from_end: rank - j,
                    ..f
                })
            }),
            Op::Reshape { .. } => get(0).filter(|f| {
                let (Some(a), Some(o)) = (ty(0), out_ty) else {
                    return false;
                };
                f.from_end <= 2
                    && a.shape.len() >= 2
                    && o.shape.len() >= 2
                    && a.shape[a.shape.len() - 2..] == o.shape[o.shape.len() - 2..]
            }),
            Op::MatMul => {
                let (frac, f) = product_fill((ty(0), ty(1)), (get(0), get(1)));
                out[ni] = frac;
                f
            }
            _ => None,
        };
        // a Split's pieces are all filled like its input; other ops' first result
        let filled_outputs = if matches!(n.op, Op::Split { .. }) {
            &n.outputs[..]
        } else {
            &n.outputs[..n.outputs.len().min(1)]
        };
        if let Some(f) = result.filter(|f| f.fraction < 1.0) {
            for v in filled_outputs {
                fill[v.index()] = Some(f);
            }
        }
    }
    out
}

/// The fill of a `[experts, capacity, H]` buffer (rows: second from the end).
fn buffer_fill(tokens: usize, choices: usize, experts: usize, capacity: usize) -> Option<Fill> {
    if capacity == 0 {
        return None;
    }
    let rows = expected_rows(tokens, choices, experts, capacity);
    Some(Fill {
        from_end: 2,
        fraction: rows as f64 / capacity as f64,
    })
}

/// Unary ops whose value at zero is zero (so an empty row stays empty).
fn zero_preserving(u: UnaryOp) -> bool {
    use UnaryOp::*;
    matches!(
        u,
        Neg | Abs | Sqrt | Tanh | Erf | Relu | Gelu | GeluTanh | Silu | Sin | Floor | Ceil | Sign
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 8 tokens with 2 choices of 4 experts: dropless (capacity 8) fills 4 rows of 8 per
    /// expert; the fill follows row-wise ops, not ones that are nonzero at zero or add a
    /// dense value, and a capacity below the tokens is charged whole. The expected
    /// fractions are written out by hand.
    #[test]
    fn the_fill_follows_the_buffer_through_row_wise_ops_only() {
        let src = r#"
program "t"
input %x : f32[8,16]
input %c : i64[8,2]
input %bias : f32[4,8,32]
param %w : f32[4,16,32]
param %v : f32[4,32,16]
%d.0, %d.1 = MoeDispatch{experts=4, capacity=8}(%x, %c) : f32[4,8,16], i64[8,2]
%up = MatMul(%d.0, %w) : f32[4,8,32]
%act = Silu(%up) : f32[4,8,32]
%h0, %h1 = Split{axis=2, sizes=[16,16]}(%act) : f32[4,8,16], f32[4,8,16]
%gated = Mul(%h0, %h1) : f32[4,8,16]
%cat = Concat{axis=2}(%gated, %h1) : f32[4,8,32]
%down = MatMul(%cat, %v) : f32[4,8,16]
%sig = Sigmoid(%d.0) : f32[4,8,16]
%after_sig = MatMul(%sig, %w) : f32[4,8,32]
%biased = Add(%up, %bias) : f32[4,8,32]
%after_bias = MatMul(%biased, %v) : f32[4,8,16]
%dt = Transpose{perm=[0,2,1]}(%d.0) : f32[4,16,8]
%dw = MatMul(%dt, %up) : f32[4,16,32]
%both = MatMul(%dt, %d.0) : f32[4,16,16]
%e.0, %e.1 = MoeDispatch{experts=4, capacity=6}(%x, %c) : f32[4,6,16], i64[8,2]
%capped = MatMul(%e.0, %w) : f32[4,6,32]
"#;
        let p = hzp_ir::text::parse(src, "t.hzp", &|_| None).unwrap();
        let f = filled_fractions(&p);
        let of = |name: &str| {
            let i = p
                .nodes
                .iter()
                .position(|n| p.value(n.outputs[0]).name == name)
                .unwrap_or_else(|| panic!("no {name}"));
            f[i]
        };
        assert_eq!(of("up"), 0.5);
        assert_eq!(of("down"), 0.5);
        assert_eq!(of("after_sig"), 1.0);
        assert_eq!(of("after_bias"), 1.0);
        // the contraction over the buffer's rows
        assert_eq!(of("dw"), 0.5);
        assert_eq!(of("both"), 0.5);
        assert_eq!(of("capped"), 1.0);
        assert_eq!(of("act"), 1.0);
    }

    #[test]
    fn expected_rows_are_the_balanced_share_when_dropless() {
        // 32 tokens, top 2 of 4 experts, dropless (C = T): 16 rows each
        assert_eq!(expected_rows(32, 64, 4, 32), 16);
        // rounded up
        assert_eq!(expected_rows(10, 20, 3, 10), 7);
        // top_k = experts: every expert gets every token
        assert_eq!(expected_rows(8, 32, 4, 8), 8);
        // with a capacity factor (C < T) the capacity is charged
        assert_eq!(expected_rows(32, 64, 4, 20), 20);
        assert_eq!(expected_rows(32, 64, 0, 32), 32);
    }
}
