//! Transposed operands: the `Transpose` nodes whose result need not be stored apart from
//! their input.
//!
//! A matrix product reads its operands at any row and column stride, so a transpose of the
//! last two axes that only matrix products read can be the very bytes of its input, read
//! column-major. The memory planner gives such a transpose its input's buffer (as it does a
//! reshape), and a backend that finds the two at one offset runs nothing for the transpose
//! and reads the operand transposed (CPU: gemm with swapped strides; CUDA: cuBLAS's
//! transpose flag). Everything that decides this reads [`transposed_operands`], so planner,
//! verifier, simulator and backends agree.

use crate::{DType, Op, Program};

/// Whether `perm` swaps the last two axes and keeps the others in place.
pub fn swaps_last_two(perm: &[usize]) -> bool {
    let r = perm.len();
    r >= 2
        && perm[r - 2] == r - 1
        && perm[r - 1] == r - 2
        && perm[..r - 2].iter().enumerate().all(|(i, &q)| i == q)
}

/// The permutation of a rank-`r` tensor that swaps its last two axes (`r >= 2`; the identity
/// below that).
pub fn last_two_swapped(r: usize) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..r).collect();
    if r >= 2 {
        perm.swap(r - 2, r - 1);
    }
    perm
}

/// For every node, whether it is a transposed operand: a single-result float (f32, bf16 or
/// f16) `Transpose` of the last two axes whose result is read only by float `MatMul`s of
/// two rank >= 2 operands, is not a program output nor part of an update, and whose input is
/// not itself a transposed operand (so a backend needs one level of strides only).
pub fn transposed_operands(p: &Program) -> Vec<bool> {
    let nv = p.values.len();
    let pinned = p.escaping_values();
    let is_float = |v: crate::ValueId| {
        v.index() < nv && matches!(p.ty(v).dtype, DType::F32 | DType::BF16 | DType::F16)
    };
    // readers that are float products of matrices (or anything else: `false`)
    let mut read_ok = vec![true; nv];
    for n in &p.nodes {
        let product = matches!(n.op, Op::MatMul)
            && n.inputs.len() == 2
            && n.inputs.iter().all(|&v| is_float(v) && p.ty(v).rank() >= 2);
        if !product {
            for &v in &n.inputs {
                if let Some(f) = read_ok.get_mut(v.index()) {
                    *f = false;
                }
            }
        }
    }
    let mut is_view_value = vec![false; nv];
    let mut out = vec![false; p.nodes.len()];
    for (i, n) in p.nodes.iter().enumerate() {
        let Op::Transpose { perm } = &n.op else {
            continue;
        };
        let ([x], [y]) = (n.inputs.as_slice(), n.outputs.as_slice()) else {
            continue;
        };
        let ok = swaps_last_two(perm)
            && is_float(*x)
            && p.ty(*y).dtype == p.ty(*x).dtype
            && !pinned[y.index()]
            && !pinned[x.index()]
            && read_ok[y.index()]
            && !is_view_value[x.index()];
        if ok {
            out[i] = true;
            is_view_value[y.index()] = true;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text;

    fn program(src: &str) -> Program {
        text::parse(src, "t.hzp", &|_| None).unwrap()
    }

    #[test]
    fn perm_rule() {
        assert!(swaps_last_two(&[1, 0]));
        assert!(swaps_last_two(&[0, 2, 1]));
        assert!(!swaps_last_two(&[0, 1]));
        assert!(!swaps_last_two(&[1, 0, 2]));
        assert!(!swaps_last_two(&[2, 1, 0]));
        assert!(!swaps_last_two(&[0]));
        for r in 2..5 {
            assert!(swaps_last_two(&last_two_swapped(r)));
        }
    }

    #[test]
    fn only_products_read_a_transposed_operand() {
        let p = program(
            r#"program "t"
input %x : f32[4,8]
param %w : f32[16,8]
%wt = Transpose{perm=[1,0]}(%w) : f32[8,16] "wt"
%y = MatMul(%x, %wt) : f32[4,16] "y"
%xt = Transpose{perm=[1,0]}(%x) : f32[8,4] "xt"
%z = MatMul(%xt, %y) : f32[8,16] "z"
%zt = Transpose{perm=[1,0]}(%z) : f32[16,8] "zt"
%s = Add(%zt, %w) : f32[16,8] "s"
output %s
"#,
        );
        // wt and xt feed products; zt feeds an Add
        let names: Vec<&str> = p
            .nodes
            .iter()
            .zip(transposed_operands(&p))
            .filter(|(_, t)| *t)
            .map(|(n, _)| p.value(n.outputs[0]).name.as_str())
            .collect();
        assert_eq!(names, ["wt", "xt"]);
    }
}
