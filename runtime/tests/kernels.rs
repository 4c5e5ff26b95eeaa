//! Each CPU kernel against small hand-computed examples, plus error cases.

use half::{bf16, f16};
use hzp_ir::{BinaryOp, DType, Data, Group, Op, ReduceOp, Tensor, UnaryOp};
use hzp_runtime::cpu::eval_op;

fn run(op: Op, ins: &[&Tensor]) -> Vec<Tensor> {
    eval_op(&op, ins).unwrap_or_else(|e| panic!("{op:?}: {e}"))
}

fn run1(op: Op, ins: &[&Tensor]) -> Tensor {
    run(op, ins).remove(0)
}

fn f(shape: &[usize], v: &[f32]) -> Tensor {
    Tensor::f32(shape.to_vec(), v.to_vec())
}

fn i(shape: &[usize], v: &[i64]) -> Tensor {
    Tensor::i64(shape.to_vec(), v.to_vec())
}

fn b(shape: &[usize], v: &[bool]) -> Tensor {
    Tensor::new(shape.to_vec(), Data::Bool(v.to_vec()))
}

fn assert_close(got: &Tensor, shape: &[usize], want: &[f32], tol: f32) {
    assert_eq!(got.shape, shape, "shape");
    let g = got.to_f32_vec();
    assert_eq!(g.len(), want.len());
    for (k, (a, e)) in g.iter().zip(want).enumerate() {
        let ok = (a - e).abs() <= tol * (1.0 + e.abs()) || (a.is_nan() && e.is_nan());
        assert!(ok, "element {k}: got {a}, want {e} (all: {g:?})");
    }
}

/// Deterministic pseudo-random floats in [-1, 1).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

// ------------------------------------------------------------------ shape arithmetic (i64)

#[test]
fn i64_binary_ops_and_broadcasting() {
    let x = i(&[2, 3], &[1, 2, 3, 4, 5, 6]);
    let y = i(&[3], &[10, 20, 30]);
    assert_eq!(
        run1(Op::Binary(BinaryOp::Add), &[&x, &y]),
        i(&[2, 3], &[11, 22, 33, 14, 25, 36])
    );
    let s = Tensor::scalar_i64(2);
    assert_eq!(
        run1(Op::Binary(BinaryOp::Mul), &[&x, &s]),
        i(&[2, 3], &[2, 4, 6, 8, 10, 12])
    );
    assert_eq!(
        run1(Op::Binary(BinaryOp::Sub), &[&s, &x]),
        i(&[2, 3], &[1, 0, -1, -2, -3, -4])
    );
    // column [2,1] against row [3]
    let c = i(&[2, 1], &[1, 2]);
    assert_eq!(
        run1(Op::Binary(BinaryOp::Add), &[&c, &y]),
        i(&[2, 3], &[11, 21, 31, 12, 22, 32])
    );
    assert_eq!(
        run1(Op::Binary(BinaryOp::Equal), &[&x, &i(&[3], &[1, 5, 3])]),
        b(&[2, 3], &[true, false, true, false, true, false])
    );
    assert_eq!(
        run1(Op::Binary(BinaryOp::Less), &[&x, &s]),
        b(&[2, 3], &[true, false, false, false, false, false])
    );
    assert_eq!(
        run1(Op::Binary(BinaryOp::GreaterOrEqual), &[&x, &i(&[], &[4])]),
        b(&[2, 3], &[false, false, false, true, true, true])
    );
    assert_eq!(
        run1(Op::Binary(BinaryOp::Max), &[&x, &i(&[], &[4])]),
        i(&[2, 3], &[4, 4, 4, 4, 5, 6])
    );
}

#[test]
fn integer_div_truncates_and_mod_follows_divisor() {
    let x = i(&[4], &[7, -7, 7, -7]);
    let y = i(&[4], &[2, 2, -2, -2]);
    assert_eq!(
        run1(Op::Binary(BinaryOp::Div), &[&x, &y]),
        i(&[4], &[3, -3, -3, 3])
    );
    assert_eq!(
        run1(Op::Binary(BinaryOp::Mod), &[&x, &y]),
        i(&[4], &[1, 1, -1, -1])
    );
    // float Mod is C fmod (sign of the dividend)
    let r = run1(
        Op::Binary(BinaryOp::Mod),
        &[&f(&[2], &[-7.5, 7.5]), &f(&[2], &[2.0, -2.0])],
    );
    assert_close(&r, &[2], &[-1.5, 1.5], 0.0);
    let e = eval_op(&Op::Binary(BinaryOp::Div), &[&x, &i(&[], &[0])]).unwrap_err();
    assert!(e.contains("division by zero"), "{e}");
    // i32 too
    let a = Tensor::new(vec![2], Data::I32(vec![-9, 9]));
    let d = Tensor::new(vec![1], Data::I32(vec![4]));
    assert_eq!(
        run1(Op::Binary(BinaryOp::Div), &[&a, &d]).data,
        Data::I32(vec![-2, 2])
    );
    assert_eq!(
        run1(Op::Binary(BinaryOp::Mod), &[&a, &d]).data,
        Data::I32(vec![3, 1])
    );
}

#[test]
fn pow_ints_and_floats() {
    let x = i(&[4], &[2, -3, 5, 2]);
    let e = i(&[4], &[10, 3, 0, -1]);
    assert_eq!(
        run1(Op::Binary(BinaryOp::Pow), &[&x, &e]),
        i(&[4], &[1024, -27, 1, 0])
    );
    let r = run1(
        Op::Binary(BinaryOp::Pow),
        &[&f(&[3], &[2.0, 4.0, 9.0]), &f(&[], &[0.5])],
    );
    assert_close(&r, &[3], &[2f32.sqrt(), 2.0, 3.0], 1e-6);
}

#[test]
fn logic_ops_and_not() {
    let x = b(&[4], &[true, true, false, false]);
    let y = b(&[4], &[true, false, true, false]);
    assert_eq!(
        run1(Op::Binary(BinaryOp::And), &[&x, &y]),
        b(&[4], &[true, false, false, false])
    );
    assert_eq!(
        run1(Op::Binary(BinaryOp::Or), &[&x, &y]),
        b(&[4], &[true, true, true, false])
    );
    assert_eq!(
        run1(Op::Binary(BinaryOp::Xor), &[&x, &y]),
        b(&[4], &[false, true, true, false])
    );
    assert_eq!(
        run1(Op::Unary(UnaryOp::Not), &[&x]),
        b(&[4], &[false, false, true, true])
    );
    assert!(eval_op(
        &Op::Binary(BinaryOp::And),
        &[&i(&[1], &[1]), &i(&[1], &[1])]
    )
    .is_err());
}

#[test]
fn int_unary_neg_abs_sign() {
    let x = i(&[3], &[-2, 0, 5]);
    assert_eq!(run1(Op::Unary(UnaryOp::Neg), &[&x]), i(&[3], &[2, 0, -5]));
    assert_eq!(run1(Op::Unary(UnaryOp::Abs), &[&x]), i(&[3], &[2, 0, 5]));
    assert_eq!(run1(Op::Unary(UnaryOp::Sign), &[&x]), i(&[3], &[-1, 0, 1]));
    assert!(eval_op(&Op::Unary(UnaryOp::Exp), &[&x]).is_err());
}

#[test]
fn where_broadcasts_three_ways() {
    let c = b(&[2, 1], &[true, false]);
    let x = i(&[3], &[1, 2, 3]);
    let y = i(&[], &[-1]);
    assert_eq!(
        run1(Op::Where, &[&c, &x, &y]),
        i(&[2, 3], &[1, 2, 3, -1, -1, -1])
    );
    let r = run1(
        Op::Where,
        &[
            &b(&[2], &[false, true]),
            &f(&[2], &[1.0, 2.0]),
            &f(&[2], &[3.0, 4.0]),
        ],
    );
    assert_close(&r, &[2], &[3.0, 2.0], 0.0);
}

#[test]
fn cast_truncates_and_converts_bools() {
    let x = f(&[6], &[1.9, -1.9, 0.0, 2.5, -0.5, 1e10]);
    assert_eq!(
        run1(Op::Cast { to: DType::I64 }, &[&x]),
        i(&[6], &[1, -1, 0, 2, 0, 10_000_000_000])
    );
    assert_eq!(
        run1(Op::Cast { to: DType::I32 }, &[&f(&[2], &[3.7, -3.7])]).data,
        Data::I32(vec![3, -3])
    );
    assert_eq!(
        run1(Op::Cast { to: DType::Bool }, &[&x]),
        b(&[6], &[true, true, false, true, true, true])
    );
    assert_eq!(
        run1(Op::Cast { to: DType::F32 }, &[&b(&[2], &[true, false])]),
        f(&[2], &[1.0, 0.0])
    );
    assert_eq!(
        run1(Op::Cast { to: DType::I64 }, &[&b(&[2], &[true, false])]),
        i(&[2], &[1, 0])
    );
    assert_eq!(
        run1(Op::Cast { to: DType::F32 }, &[&i(&[2], &[-3, 7])]),
        f(&[2], &[-3.0, 7.0])
    );
    // f32 -> bf16 rounds to nearest; bf16 -> f16 -> f32 round trips small values
    let h = run1(
        Op::Cast { to: DType::BF16 },
        &[&f(&[2], &[1.0, 1.0 + 1.0 / 256.0])],
    );
    assert_eq!(
        h.data,
        Data::BF16(vec![bf16::from_f32(1.0), bf16::from_f32(1.0)])
    );
    let g = run1(Op::Cast { to: DType::F16 }, &[&h]);
    assert_eq!(g.data, Data::F16(vec![f16::from_f32(1.0); 2]));
    let back = run1(Op::Cast { to: DType::I64 }, &[&g]);
    assert_eq!(back, i(&[2], &[1, 1]));
    // every dtype pair runs and keeps the shape
    let all = [
        f(&[2], &[1.0, 0.0]),
        Tensor::new(vec![2], Data::BF16(vec![bf16::ONE, bf16::ZERO])),
        Tensor::new(vec![2], Data::F16(vec![f16::ONE, f16::ZERO])),
        i(&[2], &[1, 0]),
        Tensor::new(vec![2], Data::I32(vec![1, 0])),
        b(&[2], &[true, false]),
    ];
    for src in &all {
        for to in DType::ALL {
            let r = run1(Op::Cast { to }, &[src]);
            assert_eq!(r.dtype(), to);
            assert_eq!(r.to_f64_vec(), vec![1.0, 0.0], "{:?} -> {to}", src.dtype());
        }
    }
}

#[test]
fn reshape_identity_copy() {
    let x = i(&[2, 3], &[1, 2, 3, 4, 5, 6]);
    assert_eq!(
        run1(Op::Reshape { shape: vec![3, 2] }, &[&x]),
        i(&[3, 2], &[1, 2, 3, 4, 5, 6])
    );
    assert_eq!(run1(Op::Identity, &[&x]), x);
    assert_eq!(run1(Op::Copy, &[&x]), x);
    assert!(eval_op(&Op::Reshape { shape: vec![4] }, &[&x]).is_err());
}

#[test]
fn concat_and_split() {
    let a = i(&[2, 1], &[1, 2]);
    let c = i(&[2, 2], &[3, 4, 5, 6]);
    assert_eq!(
        run1(Op::Concat { axis: 1 }, &[&a, &c]),
        i(&[2, 3], &[1, 3, 4, 2, 5, 6])
    );
    assert_eq!(
        run1(
            Op::Concat { axis: 0 },
            &[&i(&[1], &[7]), &i(&[0], &[]), &i(&[2], &[8, 9])]
        ),
        i(&[3], &[7, 8, 9])
    );
    let x = i(&[2, 3], &[1, 2, 3, 4, 5, 6]);
    let parts = run(
        Op::Split {
            axis: 1,
            sizes: vec![1, 2],
        },
        &[&x],
    );
    assert_eq!(parts[0], i(&[2, 1], &[1, 4]));
    assert_eq!(parts[1], i(&[2, 2], &[2, 3, 5, 6]));
    assert!(eval_op(&Op::Concat { axis: 0 }, &[&a, &c]).is_err());
}

#[test]
fn gather_wraps_negative_indices_and_rejects_out_of_range() {
    let shape = i(&[4], &[2, 16, 12, 64]);
    assert_eq!(
        run1(Op::Gather { axis: 0 }, &[&shape, &i(&[], &[-1])]),
        i(&[], &[64])
    );
    assert_eq!(
        run1(Op::Gather { axis: 0 }, &[&shape, &i(&[2], &[0, -3])]),
        i(&[2], &[2, 16])
    );
    let x = f(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let r = run1(Op::Gather { axis: 1 }, &[&x, &i(&[2, 2], &[2, 0, -1, 1])]);
    assert_close(
        &r,
        &[2, 2, 2],
        &[3.0, 1.0, 3.0, 2.0, 6.0, 4.0, 6.0, 5.0],
        0.0,
    );
    // embedding lookup with i32 ids
    let ids = Tensor::new(vec![2], Data::I32(vec![1, 0]));
    let r = run1(Op::Gather { axis: 0 }, &[&x, &ids]);
    assert_close(&r, &[2, 3], &[4.0, 5.0, 6.0, 1.0, 2.0, 3.0], 0.0);
    let e = eval_op(&Op::Gather { axis: 1 }, &[&x, &i(&[1], &[3])]).unwrap_err();
    assert!(
        e.contains("index 3") && e.contains("dim 1") && e.contains("size 3"),
        "{e}"
    );
    let e = eval_op(&Op::Gather { axis: 0 }, &[&x, &i(&[1], &[-3])]).unwrap_err();
    assert!(e.contains("index -3"), "{e}");
}

#[test]
fn slice_positive_and_negative_steps() {
    let x = i(&[2, 5], &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    let op = Op::Slice {
        axes: vec![1],
        starts: vec![1],
        ends: vec![5],
        steps: vec![2],
    };
    assert_eq!(run1(op, &[&x]), i(&[2, 2], &[1, 3, 6, 8]));
    // reverse the whole axis: start 4, end -1 (clamped "before the start"), step -1
    let op = Op::Slice {
        axes: vec![1],
        starts: vec![4],
        ends: vec![-1],
        steps: vec![-1],
    };
    assert_eq!(run1(op, &[&x]), i(&[2, 5], &[4, 3, 2, 1, 0, 9, 8, 7, 6, 5]));
    let op = Op::Slice {
        axes: vec![0, 1],
        starts: vec![1, 3],
        ends: vec![2, 0],
        steps: vec![1, -2],
    };
    assert_eq!(run1(op, &[&x]), i(&[1, 2], &[8, 6]));
    // empty result
    let op = Op::Slice {
        axes: vec![1],
        starts: vec![5],
        ends: vec![5],
        steps: vec![1],
    };
    assert_eq!(run1(op, &[&x]), i(&[2, 0], &[]));
    let bad = Op::Slice {
        axes: vec![1],
        starts: vec![0],
        ends: vec![9],
        steps: vec![1],
    };
    assert!(eval_op(&bad, &[&x]).is_err());
}

#[test]
fn expand_tile_transpose() {
    let x = i(&[2, 1], &[1, 2]);
    assert_eq!(
        run1(
            Op::Expand {
                shape: vec![2, 2, 3]
            },
            &[&x]
        ),
        i(&[2, 2, 3], &[1, 1, 1, 2, 2, 2, 1, 1, 1, 2, 2, 2])
    );
    assert!(eval_op(&Op::Expand { shape: vec![3, 3] }, &[&x]).is_err());
    let y = i(&[2, 2], &[1, 2, 3, 4]);
    assert_eq!(
        run1(
            Op::Tile {
                repeats: vec![2, 2]
            },
            &[&y]
        ),
        i(&[4, 4], &[1, 2, 1, 2, 3, 4, 3, 4, 1, 2, 1, 2, 3, 4, 3, 4])
    );
    assert_eq!(
        run1(
            Op::Tile {
                repeats: vec![1, 3]
            },
            &[&i(&[1, 2], &[5, 6])]
        ),
        i(&[1, 6], &[5, 6, 5, 6, 5, 6])
    );
    let z = i(&[2, 3, 2], &(0..12).collect::<Vec<_>>());
    // out[a][b][c] = z[c][a][b] with perm [2,0,1]
    let t = run1(
        Op::Transpose {
            perm: vec![2, 0, 1],
        },
        &[&z],
    );
    assert_eq!(t.shape, vec![2, 2, 3]);
    let zv = z.to_i64_vec().unwrap();
    let tv = t.to_i64_vec().unwrap();
    for a in 0..2 {
        for bb in 0..2 {
            for c in 0..3 {
                assert_eq!(tv[(a * 2 + bb) * 3 + c], zv[(bb * 3 + c) * 2 + a]);
            }
        }
    }
    assert!(eval_op(
        &Op::Transpose {
            perm: vec![0, 0, 1]
        },
        &[&z]
    )
    .is_err());
}

#[test]
fn trilu_masks() {
    let ones = f(&[3, 3], &[1.0; 9]);
    let lower = run1(Op::Trilu { upper: false, k: 0 }, &[&ones]);
    assert_close(&lower, &[3, 3], &[1., 0., 0., 1., 1., 0., 1., 1., 1.], 0.0);
    let upper = run1(Op::Trilu { upper: true, k: 1 }, &[&ones]);
    assert_close(&upper, &[3, 3], &[0., 1., 1., 0., 0., 1., 0., 0., 0.], 0.0);
    let bl = run1(
        Op::Trilu {
            upper: false,
            k: -1,
        },
        &[&b(&[2, 2, 2], &[true; 8])],
    );
    assert_eq!(
        bl,
        b(
            &[2, 2, 2],
            &[false, false, true, false, false, false, true, false]
        )
    );
}

#[test]
fn cumsum_variants() {
    let x = i(&[2, 3], &[1, 2, 3, 4, 5, 6]);
    let op = |exclusive, reverse| Op::CumSum {
        axis: 1,
        exclusive,
        reverse,
    };
    assert_eq!(
        run1(op(false, false), &[&x]),
        i(&[2, 3], &[1, 3, 6, 4, 9, 15])
    );
    assert_eq!(
        run1(op(true, false), &[&x]),
        i(&[2, 3], &[0, 1, 3, 0, 4, 9])
    );
    assert_eq!(
        run1(op(false, true), &[&x]),
        i(&[2, 3], &[6, 5, 3, 15, 11, 6])
    );
    assert_eq!(
        run1(op(true, true), &[&x]),
        i(&[2, 3], &[5, 3, 0, 11, 6, 0])
    );
    let r = run1(
        Op::CumSum {
            axis: 0,
            exclusive: false,
            reverse: false,
        },
        &[&f(&[2, 2], &[1.0, 2.0, 3.0, 4.0])],
    );
    assert_close(&r, &[2, 2], &[1.0, 2.0, 4.0, 6.0], 0.0);
}

#[test]
fn fill_all_dtypes() {
    let r = run1(
        Op::Fill {
            value: 2.7,
            dtype: DType::I64,
            shape: vec![2],
        },
        &[],
    );
    assert_eq!(r, i(&[2], &[2, 2]));
    let r = run1(
        Op::Fill {
            value: -0.5,
            dtype: DType::F32,
            shape: vec![],
        },
        &[],
    );
    assert_eq!(r, f(&[], &[-0.5]));
    let r = run1(
        Op::Fill {
            value: 1.0,
            dtype: DType::Bool,
            shape: vec![1, 2],
        },
        &[],
    );
    assert_eq!(r, b(&[1, 2], &[true, true]));
    let r = run1(
        Op::Fill {
            value: 0.0,
            dtype: DType::BF16,
            shape: vec![0, 3],
        },
        &[],
    );
    assert_eq!(r.shape, vec![0, 3]);
}

#[test]
fn reductions() {
    let x = f(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let red = |op, axes: &[usize], keep_dims| Op::Reduce {
        op,
        axes: axes.to_vec(),
        keep_dims,
    };
    assert_close(
        &run1(red(ReduceOp::Sum, &[1], false), &[&x]),
        &[2],
        &[6.0, 15.0],
        0.0,
    );
    assert_close(
        &run1(red(ReduceOp::Sum, &[0], true), &[&x]),
        &[1, 3],
        &[5.0, 7.0, 9.0],
        0.0,
    );
    assert_close(
        &run1(red(ReduceOp::Mean, &[0, 1], false), &[&x]),
        &[],
        &[3.5],
        0.0,
    );
    assert_close(
        &run1(red(ReduceOp::Max, &[0], false), &[&x]),
        &[3],
        &[4.0, 5.0, 6.0],
        0.0,
    );
    assert_close(
        &run1(red(ReduceOp::Min, &[1], true), &[&x]),
        &[2, 1],
        &[1.0, 4.0],
        0.0,
    );
    assert_close(
        &run1(red(ReduceOp::Prod, &[1], false), &[&x]),
        &[2],
        &[6.0, 120.0],
        0.0,
    );
    // middle axis of a rank-3 tensor (the non-contiguous path)
    let y = i(&[2, 3, 2], &(0..12).collect::<Vec<_>>());
    assert_eq!(
        run1(red(ReduceOp::Sum, &[1], false), &[&y]),
        i(&[2, 2], &[6, 9, 24, 27])
    );
    assert_eq!(
        run1(red(ReduceOp::Max, &[0, 2], true), &[&y]),
        i(&[1, 3, 1], &[7, 9, 11])
    );
    assert_eq!(
        run1(red(ReduceOp::Prod, &[0], false), &[&i(&[3], &[2, -3, 4])]),
        i(&[], &[-24])
    );
    // leading axes (the vectorized column sums) give the bits of the general walk (the same
    // axes behind a size-1 axis) and the f64 sums
    let vals: Vec<f32> = (0..105)
        .map(|k| ((k * 37) % 23) as f32 * 0.37 - 4.0)
        .collect();
    let (lead, behind) = (f(&[5, 7, 3], &vals), f(&[1, 5, 7, 3], &vals));
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let a = run1(red(op, &[0, 1], false), &[&lead]).to_f32_vec();
        let b = run1(red(op, &[1, 2], false), &[&behind]).to_f32_vec();
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let scale = if op == ReduceOp::Mean { 35.0 } else { 1.0 };
        for (c, &got) in a.iter().enumerate() {
            let want: f64 = (0..35).map(|r| vals[r * 3 + c] as f64).sum::<f64>() / scale;
            assert!(
                (got as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{got} vs {want}"
            );
        }
    }
    // empty axes: no reduction (the type rule keeps the shape)
    assert_eq!(run1(red(ReduceOp::Sum, &[], false), &[&y]), y);
    // NaN propagates through max
    let n = f(&[3], &[1.0, f32::NAN, 2.0]);
    assert!(run1(red(ReduceOp::Max, &[0], false), &[&n]).to_f32_vec()[0].is_nan());
    assert!(eval_op(&red(ReduceOp::Mean, &[0], false), &[&i(&[2], &[1, 2])]).is_err());
    assert!(eval_op(&red(ReduceOp::Sum, &[2], false), &[&x]).is_err());
}

#[test]
fn argmax_first_of_ties() {
    let x = f(&[2, 3], &[1.0, 3.0, 3.0, 5.0, 2.0, 5.0]);
    assert_eq!(
        run1(
            Op::ArgMax {
                axis: 1,
                keep_dims: false
            },
            &[&x]
        ),
        i(&[2], &[1, 0])
    );
    assert_eq!(
        run1(
            Op::ArgMax {
                axis: 0,
                keep_dims: true
            },
            &[&x]
        ),
        i(&[1, 3], &[1, 0, 1])
    );
}

// ------------------------------------------------------------------ float elementwise

#[test]
fn float_unary_values() {
    let x = f(&[4], &[-2.0, -0.5, 0.0, 1.5]);
    let u = |op| run1(Op::Unary(op), &[&x]);
    let m = |g: fn(f64) -> f64| -> Vec<f32> {
        [-2.0f64, -0.5, 0.0, 1.5]
            .iter()
            .map(|&v| g(v) as f32)
            .collect()
    };
    assert_close(&u(UnaryOp::Neg), &[4], &m(|v| -v), 0.0);
    assert_close(&u(UnaryOp::Abs), &[4], &m(f64::abs), 0.0);
    assert_close(&u(UnaryOp::Exp), &[4], &m(f64::exp), 1e-6);
    assert_close(&u(UnaryOp::Tanh), &[4], &m(f64::tanh), 1e-6);
    assert_close(
        &u(UnaryOp::Sigmoid),
        &[4],
        &m(|v| 1.0 / (1.0 + (-v).exp())),
        1e-6,
    );
    assert_close(&u(UnaryOp::Relu), &[4], &m(|v| v.max(0.0)), 0.0);
    assert_close(
        &u(UnaryOp::Silu),
        &[4],
        &m(|v| v / (1.0 + (-v).exp())),
        1e-6,
    );
    assert_close(&u(UnaryOp::Sin), &[4], &m(f64::sin), 1e-6);
    assert_close(&u(UnaryOp::Cos), &[4], &m(f64::cos), 1e-6);
    assert_close(&u(UnaryOp::Floor), &[4], &m(f64::floor), 0.0);
    assert_close(&u(UnaryOp::Ceil), &[4], &m(f64::ceil), 0.0);
    assert_close(&u(UnaryOp::Sign), &[4], &[-1.0, -1.0, 0.0, 1.0], 0.0);
    let g = u(UnaryOp::GeluTanh);
    let gt = |v: f64| {
        0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh())
    };
    assert_close(&g, &[4], &m(gt), 1e-6);
    let p = f(&[3], &[0.25, 1.0, 4.0]);
    assert_close(
        &run1(Op::Unary(UnaryOp::Log), &[&p]),
        &[3],
        &[0.25f32.ln(), 0.0, 4f32.ln()],
        1e-6,
    );
    assert_close(
        &run1(Op::Unary(UnaryOp::Sqrt), &[&p]),
        &[3],
        &[0.5, 1.0, 2.0],
        0.0,
    );
    assert_close(
        &run1(Op::Unary(UnaryOp::Rsqrt), &[&p]),
        &[3],
        &[2.0, 1.0, 0.5],
        1e-7,
    );
    assert_close(
        &run1(Op::Unary(UnaryOp::Reciprocal), &[&p]),
        &[3],
        &[4.0, 1.0, 0.25],
        0.0,
    );
    let n = run1(Op::Unary(UnaryOp::IsNaN), &[&f(&[2], &[f32::NAN, 1.0])]);
    assert_eq!(n, b(&[2], &[true, false]));
}

#[test]
fn erf_and_exact_gelu_match_reference_values() {
    // reference values of erf (from tables, 16 digits)
    let xs = [0.0f32, 0.1, 0.5, 1.0, 2.0, -3.0];
    let want: Vec<f32> = [
        0.0f64,
        0.112_462_916_018_284_9,
        0.520_499_877_813_046_5,
        0.842_700_792_949_714_9,
        0.995_322_265_018_952_7,
        -0.999_977_909_503_001_4,
    ]
    .iter()
    .map(|&v| v as f32)
    .collect();
    let r = run1(Op::Unary(UnaryOp::Erf), &[&f(&[6], &xs)]);
    assert_close(&r, &[6], &want, 2e-7);
    // gelu(x) = 0.5 x (1 + erf(x / sqrt 2)); gelu(-5) = -5 * 0.5 * erfc(5/sqrt2)
    let r = run1(Op::Unary(UnaryOp::Gelu), &[&f(&[3], &[1.0, -1.0, -5.0])]);
    let e1 = 0.682_689_492_137_085_9_f64; // erf(1/sqrt 2)
    let want = [
        (0.5 * (1.0 + e1)) as f32,
        (-0.5 * (1.0 - e1)) as f32,
        (-5.0 * 0.5 * 5.733_031_437_583_878e-7) as f32, // erfc(5/sqrt2)
    ];
    assert_close(&r, &[3], &want, 1e-6);
}

#[test]
fn float_binary_and_bf16_rounding() {
    let x = f(&[2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let y = f(&[2], &[0.5, -1.0]);
    assert_close(
        &run1(Op::Binary(BinaryOp::Add), &[&x, &y]),
        &[2, 2],
        &[1.5, 1.0, 3.5, 3.0],
        0.0,
    );
    assert_close(
        &run1(Op::Binary(BinaryOp::Div), &[&x, &y]),
        &[2, 2],
        &[2.0, -2.0, 6.0, -4.0],
        0.0,
    );
    assert_close(
        &run1(Op::Binary(BinaryOp::Min), &[&x, &y]),
        &[2, 2],
        &[0.5, -1.0, 0.5, -1.0],
        0.0,
    );
    // bf16 computes in f32 and rounds on store: 1 + 2^-9 is not representable in bf16
    let a = Tensor::new(vec![1], Data::BF16(vec![bf16::from_f32(1.0)]));
    let c = Tensor::new(vec![1], Data::BF16(vec![bf16::from_f32(0.001953125)]));
    let r = run1(Op::Binary(BinaryOp::Add), &[&a, &c]);
    assert_eq!(r.data, Data::BF16(vec![bf16::from_f32(1.0)]));
    assert!(eval_op(&Op::Binary(BinaryOp::Add), &[&x, &f(&[3], &[1.0; 3])]).is_err());
    assert!(eval_op(&Op::Binary(BinaryOp::Add), &[&x, &i(&[1], &[1])]).is_err());
}

// ------------------------------------------------------------------ softmax / norms

#[test]
fn softmax_of_1_2_3() {
    let x = f(&[3], &[1.0, 2.0, 3.0]);
    let s = run1(Op::Softmax { axis: 0 }, &[&x]);
    assert_close(&s, &[3], &[0.090_030_57, 0.244_728_48, 0.665_240_94], 1e-6);
    let l = run1(Op::LogSoftmax { axis: 0 }, &[&x]);
    assert_close(&l, &[3], &[-2.407_606, -1.407_606, -0.407_606], 1e-6);
    // large values stay finite (max subtraction)
    let big = run1(Op::Softmax { axis: 0 }, &[&f(&[2], &[1000.0, 1000.0])]);
    assert_close(&big, &[2], &[0.5, 0.5], 0.0);
    // along axis 0 of a [3,2] (strided lanes) equals the per-column softmax
    let m = f(&[3, 2], &[1.0, 0.0, 2.0, 0.0, 3.0, 0.0]);
    let s = run1(Op::Softmax { axis: 0 }, &[&m]);
    let t = 1.0 / 3.0;
    assert_close(
        &s,
        &[3, 2],
        &[0.090_030_57, t, 0.244_728_48, t, 0.665_240_94, t],
        1e-6,
    );
    assert!(eval_op(&Op::Softmax { axis: 1 }, &[&x]).is_err());
}

#[test]
fn softmax_cross_entropy_and_its_gradient() {
    // rows [1,2,3] (label 2) and [3,2,1] (label 0): loss = log(e + e^2 + e^3) - 3
    let x = f(&[2, 3], &[1.0, 2.0, 3.0, 3.0, 2.0, 1.0]);
    let lab = i(&[2], &[2, 0]);
    let loss = run1(Op::SoftmaxCrossEntropy { axis: 1 }, &[&x, &lab]);
    assert_close(&loss, &[2], &[0.407_606, 0.407_606], 1e-6);
    // gradient: (softmax - onehot) * dy
    let dy = f(&[2], &[1.0, 0.5]);
    let g = run1(Op::SoftmaxCrossEntropyGrad { axis: 1 }, &[&x, &lab, &dy]);
    let (a, b, c) = (0.090_030_57, 0.244_728_48, 0.665_240_94);
    assert_close(
        &g,
        &[2, 3],
        &[a, b, c - 1.0, 0.5 * (c - 1.0), 0.5 * b, 0.5 * a],
        1e-6,
    );
    // along axis 0 of the transposed logits (strided lanes), with int32 labels: the same
    let xt = f(&[3, 2], &[1.0, 3.0, 2.0, 2.0, 3.0, 1.0]);
    let l32 = Tensor::new(vec![2], hzp_ir::Data::I32(vec![2, 0]));
    let loss_t = run1(Op::SoftmaxCrossEntropy { axis: 0 }, &[&xt, &l32]);
    assert_close(&loss_t, &[2], &[0.407_606, 0.407_606], 1e-6);
    let gt = run1(Op::SoftmaxCrossEntropyGrad { axis: 0 }, &[&xt, &l32, &dy]);
    assert_close(
        &gt,
        &[3, 2],
        &[a, 0.5 * (c - 1.0), b, 0.5 * b, c - 1.0, 0.5 * a],
        1e-6,
    );
    // a class axis in the middle (3 blocks of 300 classes x 85 positions: 64-, 16-, four-
    // and one-wide lane groups, sums over more than 256 classes) agrees with the class axis
    // last on the transposed logits
    let (o, d, n) = (3usize, 300usize, 85usize);
    let val =
        |b: usize, c: usize, p: usize| ((b * 7919 + c * 104_729 + p * 31) % 1000) as f32 / 97.0;
    let mid: Vec<f32> = (0..o * d * n)
        .map(|k| val(k / (d * n), k / n % d, k % n))
        .collect();
    let last: Vec<f32> = (0..o * n * d)
        .map(|k| val(k / (n * d), k % d, k / d % n))
        .collect();
    let labs: Vec<i64> = (0..o * n).map(|k| ((k * 131) % d) as i64).collect();
    let dys: Vec<f32> = (0..o * n).map(|k| 0.5 + k as f32 / 64.0).collect();
    let (xm, xl) = (f(&[o, d, n], &mid), f(&[o, n, d], &last));
    let (lb, dyv) = (i(&[o, n], &labs), f(&[o, n], &dys));
    let (loss_m, loss_l) = (
        run1(Op::SoftmaxCrossEntropy { axis: 1 }, &[&xm, &lb]),
        run1(Op::SoftmaxCrossEntropy { axis: 2 }, &[&xl, &lb]),
    );
    assert_close(&loss_m, &[o, n], &loss_l.to_f32_vec(), 1e-5);
    let gm = run1(Op::SoftmaxCrossEntropyGrad { axis: 1 }, &[&xm, &lb, &dyv]);
    let gl = run1(Op::SoftmaxCrossEntropyGrad { axis: 2 }, &[&xl, &lb, &dyv]).to_f32_vec();
    let gl_mid: Vec<f32> = (0..o * d * n)
        .map(|k| gl[(k / (d * n)) * n * d + (k % n) * d + k / n % d])
        .collect();
    assert_close(&gm, &[o, d, n], &gl_mid, 1e-6);
    // large logits stay finite
    let big = f(&[1, 2], &[1000.0, 1000.0]);
    let l = run1(Op::SoftmaxCrossEntropy { axis: 1 }, &[&big, &i(&[1], &[1])]);
    assert_close(&l, &[1], &[std::f32::consts::LN_2], 1e-6);
    // a label outside the classes is an error naming it (no wrapping)
    for bad in [3, -1] {
        let e = eval_op(
            &Op::SoftmaxCrossEntropy { axis: 1 },
            &[&x, &i(&[2], &[0, bad])],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains(&format!("label {bad} at position 1")), "{e}");
    }
}

#[test]
fn fused_adamw_gives_the_bits_of_the_unfused_formula_in_place_too() {
    use hzp_ir::BinaryOp::*;
    let n = 1037; // several stack chunks and a tail
    let gen = |k: u64| -> Vec<f32> {
        (0..n as u64)
            .map(|i| (((i * 7919 + k * 104_729) % 2001) as f32 / 1000.0 - 1.0) * 0.1)
            .collect()
    };
    let (w, g, m) = (gen(1), gen(2), gen(3));
    let v: Vec<f32> = gen(4).iter().map(|x| x * x).collect();
    let t = |d: &Vec<f32>| f(&[n], d);
    let (lr, bc) = (f(&[], &[1e-3 / 0.271]), f(&[], &[0.0632_f32.sqrt()]));
    let (beta1, beta2, eps, weight_decay) = (0.9, 0.999, 1e-8, 0.01);
    // the learning rate input, and the decay factor as torch forms it (f64, rounded once)
    let lr_now = f(&[], &[1e-3]);
    let decay = 1.0 - 1e-3_f32 as f64 * weight_decay;
    let op = Op::AdamW {
        beta1,
        beta2,
        eps,
        weight_decay,
    };
    let got = run(op, &[&t(&w), &t(&g), &t(&m), &t(&v), &lr, &bc, &lr_now]);
    // the fourteen elementwise ops the optimizer emitted before the fused op
    let s = |x: f64| f(&[], &[x as f32]);
    let b = |o, x: &Tensor, y: &Tensor| run1(Op::Binary(o), &[x, y]);
    let wd = b(Mul, &t(&w), &s(decay));
    let m2 = b(
        Add,
        &t(&m),
        &b(Mul, &b(Sub, &t(&g), &t(&m)), &s(1.0 - beta1)),
    );
    let g2 = b(Mul, &b(Mul, &t(&g), &t(&g)), &s(1.0 - beta2));
    let v2 = b(Add, &b(Mul, &t(&v), &s(beta2)), &g2);
    let sv = run1(Op::Unary(hzp_ir::UnaryOp::Sqrt), &[&v2]);
    let den = b(Add, &b(Div, &sv, &bc), &s(eps));
    let w2 = b(Sub, &wd, &b(Mul, &b(Div, &m2, &den), &lr));
    for (k, want) in [w2, m2, v2].iter().enumerate() {
        assert_eq!(got[k].to_f64_vec(), want.to_f64_vec(), "output {k}");
    }
    // in place (results over the inputs they replace), as the executor runs it
    let (mut iw, mut im, mut iv) = (w.clone(), m.clone(), v.clone());
    let c = hzp_runtime::cpu::optim::AdamWStep::new(
        (beta1, beta2, eps, weight_decay),
        1e-3 / 0.271,
        0.0632_f32.sqrt(),
        1e-3,
    );
    let (pw, pm, pv) = (iw.as_mut_ptr(), im.as_mut_ptr(), iv.as_mut_ptr());
    // SAFETY: n elements each; each result is exactly the input it replaces.
    unsafe { hzp_runtime::cpu::optim::adamw_raw(n, &c, pw, g.as_ptr(), pm, pv, pw, pm, pv) };
    for (k, mine) in [iw, im, iv].iter().enumerate() {
        let want: Vec<f64> = mine.iter().map(|&x| x as f64).collect();
        assert_eq!(got[k].to_f64_vec(), want, "in place, output {k}");
    }
}

#[test]
fn layer_norm_and_rms_norm() {
    let x = f(&[2, 4], &[1.0, 2.0, 3.0, 4.0, -1.0, -1.0, 1.0, 1.0]);
    let scale = f(&[4], &[1.0, 2.0, 1.0, 1.0]);
    let bias = f(&[4], &[0.0, 0.0, 0.0, 0.5]);
    let eps = 1e-5f32;
    let r = run1(
        Op::LayerNorm {
            axis: 1,
            epsilon: eps,
        },
        &[&x, &scale, &bias],
    );
    // row 0: mean 2.5, var 1.25
    let s0 = 1.0 / (1.25f32 + eps).sqrt();
    // row 1: mean 0, var 1
    let s1 = 1.0 / (1.0f32 + eps).sqrt();
    assert_close(
        &r,
        &[2, 4],
        &[
            -1.5 * s0,
            -0.5 * s0 * 2.0,
            0.5 * s0,
            1.5 * s0 + 0.5,
            -s1,
            -2.0 * s1,
            s1,
            s1 + 0.5,
        ],
        1e-6,
    );
    // without bias, and normalizing over two axes
    let r = run1(
        Op::LayerNorm {
            axis: 0,
            epsilon: 0.0,
        },
        &[&f(&[2, 1], &[1.0, 3.0]), &f(&[], &[1.0])],
    );
    assert_close(&r, &[2, 1], &[-1.0, 1.0], 1e-6);
    let r = run1(
        Op::RmsNorm {
            axis: 1,
            epsilon: 0.0,
        },
        &[&f(&[1, 2], &[3.0, 4.0]), &f(&[2], &[1.0, 2.0])],
    );
    let rms = (12.5f32).sqrt();
    assert_close(&r, &[1, 2], &[3.0 / rms, 8.0 / rms], 1e-6);
    assert!(eval_op(
        &Op::LayerNorm {
            axis: 1,
            epsilon: eps
        },
        &[&x, &f(&[3], &[1.0; 3])]
    )
    .is_err());
}

/// The LayerNorm (`rms == false`) / RmsNorm gradient of one row in f64, from the formula:
/// (dx, dy * xhat).
fn norm_grad_f64(x: &[f32], s: &[f32], dy: &[f32], eps: f64, rms: bool) -> (Vec<f64>, Vec<f64>) {
    let d = x.len() as f64;
    let x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let mean = if rms { 0.0 } else { x.iter().sum::<f64>() / d };
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d;
    let rstd = 1.0 / (var + eps).sqrt();
    let xh: Vec<f64> = x.iter().map(|v| (v - mean) * rstd).collect();
    let g: Vec<f64> = dy
        .iter()
        .zip(s)
        .map(|(&a, &b)| a as f64 * b as f64)
        .collect();
    let mg = if rms { 0.0 } else { g.iter().sum::<f64>() / d };
    let mgx = g.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / d;
    let dx = g
        .iter()
        .zip(&xh)
        .map(|(gi, h)| rstd * (gi - mg - h * mgx))
        .collect();
    let yh = dy.iter().zip(&xh).map(|(&a, h)| a as f64 * h).collect();
    (dx, yh)
}

#[test]
fn layer_norm_and_rms_norm_gradients_match_the_formula() {
    let mut g = Lcg(11);
    // rows of 7 (tail only), 40 and 300 (sixteen-wide pieces, a second piece and a tail),
    // normalized over the last axis or the last two; a scale over part of the dims
    for (shape, axis, scale_shape) in [
        (vec![3, 7], 1, vec![7]),
        (vec![2, 3, 40], 2, vec![40]),
        (vec![2, 300], 1, vec![300]),
        (vec![2, 3, 100], 1, vec![1, 100]),
    ] {
        let n: usize = shape.iter().product();
        let d: usize = shape[axis..].iter().product();
        let x: Vec<f32> = g.vec(n).iter().map(|v| v * 3.0 + 0.5).collect();
        let dy = g.vec(n);
        let sn: usize = scale_shape.iter().product();
        let sv: Vec<f32> = g.vec(sn).iter().map(|v| 1.0 + v * 0.5).collect();
        // the scale broadcast to one row of the normalized dims
        let srow: Vec<f32> = (0..d).map(|j| sv[j % sn]).collect();
        for rms in [false, true] {
            let eps = 1e-5f32;
            let op = if rms {
                Op::RmsNormGrad { axis, epsilon: eps }
            } else {
                Op::LayerNormGrad { axis, epsilon: eps }
            };
            let out = run(
                op,
                &[&f(&shape, &x), &f(&scale_shape, &sv), &f(&shape, &dy)],
            );
            assert_eq!(out.len(), 2);
            let (mut dx, mut yh) = (Vec::new(), Vec::new());
            for r in 0..n / d {
                let at = r * d..(r + 1) * d;
                let (a, b) = norm_grad_f64(&x[at.clone()], &srow, &dy[at], eps as f64, rms);
                dx.extend(a.iter().map(|&v| v as f32));
                yh.extend(b.iter().map(|&v| v as f32));
            }
            assert_close(&out[0], &shape, &dx, 2e-5);
            assert_close(&out[1], &shape, &yh, 2e-5);
        }
    }
    // bf16 operands compute in f32 and round on store
    let bf = |v: Vec<f32>, shape: &[usize]| {
        let w: Vec<f64> = v.iter().map(|&x| x as f64).collect();
        Tensor::from_f64(DType::BF16, shape.to_vec(), &w)
    };
    let wide = |t: &Tensor| Tensor::from_f64(DType::F32, t.shape.clone(), &t.to_f64_vec());
    let (x, dy, s) = (
        bf(g.vec(80), &[2, 40]),
        bf(g.vec(80), &[2, 40]),
        bf(vec![1.0; 40], &[40]),
    );
    let op = Op::LayerNormGrad {
        axis: 1,
        epsilon: 1e-5,
    };
    let out = run(op.clone(), &[&x, &s, &dy]);
    assert_eq!(out[0].dtype(), DType::BF16);
    let want = run(op.clone(), &[&wide(&x), &wide(&s), &wide(&dy)]);
    assert_close(&out[0], &[2, 40], &want[0].to_f32_vec(), 1e-2);
    // the output gradient must be typed like the input
    assert!(eval_op(&op, &[&x, &s, &wide(&x)]).is_err());
}

// ------------------------------------------------------------------ matmul

fn naive_matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for r in 0..m {
        for col in 0..n {
            let mut s = 0f64;
            for t in 0..k {
                s += a[r * k + t] as f64 * b[t * n + col] as f64;
            }
            c[r * n + col] = s as f32;
        }
    }
    c
}

#[test]
fn matmul_matches_naive_loops() {
    let mut g = Lcg(7);
    for &(m, k, n) in &[(1, 1, 1), (3, 5, 4), (17, 33, 9), (64, 48, 70)] {
        let a = g.vec(m * k);
        let bm = g.vec(k * n);
        let r = run1(Op::MatMul, &[&f(&[m, k], &a), &f(&[k, n], &bm)]);
        assert_close(&r, &[m, n], &naive_matmul(&a, &bm, m, k, n), 1e-5);
    }
}

#[test]
fn matmul_batch_broadcast_and_rank1() {
    let mut g = Lcg(11);
    let (m, k, n) = (3, 4, 5);
    // a: [2,1,m,k], b: [3,k,n] -> [2,3,m,n]
    let a = g.vec(2 * m * k);
    let bm = g.vec(3 * k * n);
    let r = run1(Op::MatMul, &[&f(&[2, 1, m, k], &a), &f(&[3, k, n], &bm)]);
    let mut want = Vec::new();
    for i in 0..2 {
        for j in 0..3 {
            want.extend(naive_matmul(
                &a[i * m * k..(i + 1) * m * k],
                &bm[j * k * n..(j + 1) * k * n],
                m,
                k,
                n,
            ));
        }
    }
    assert_close(&r, &[2, 3, m, n], &want, 1e-5);
    // batched a with one b (folded into one product)
    let r = run1(Op::MatMul, &[&f(&[2, m, k], &a), &f(&[k, n], &bm[..k * n])]);
    let mut want = naive_matmul(&a[..m * k], &bm[..k * n], m, k, n);
    want.extend(naive_matmul(&a[m * k..], &bm[..k * n], m, k, n));
    assert_close(&r, &[2, m, n], &want, 1e-5);
    // rank-1 on either side
    let v = g.vec(k);
    let r = run1(Op::MatMul, &[&f(&[k], &v), &f(&[k, n], &bm[..k * n])]);
    assert_close(&r, &[n], &naive_matmul(&v, &bm[..k * n], 1, k, n), 1e-5);
    let r = run1(Op::MatMul, &[&f(&[m, k], &a[..m * k]), &f(&[k], &v)]);
    assert_close(&r, &[m], &naive_matmul(&a[..m * k], &v, m, k, 1), 1e-5);
    let r = run1(Op::MatMul, &[&f(&[k], &v), &f(&[k], &v)]);
    assert_close(&r, &[], &naive_matmul(&v, &v, 1, k, 1), 1e-5);
    // batched a with rank-1 b
    let r = run1(Op::MatMul, &[&f(&[2, m, k], &a), &f(&[k], &v)]);
    let mut want = naive_matmul(&a[..m * k], &v, m, k, 1);
    want.extend(naive_matmul(&a[m * k..], &v, m, k, 1));
    assert_close(&r, &[2, m], &want, 1e-5);
    // k = 0 gives zeros
    let r = run1(Op::MatMul, &[&f(&[2, 0], &[]), &f(&[0, 3], &[])]);
    assert_close(&r, &[2, 3], &[0.0; 6], 0.0);
    // bf16 is computed in f32 and rounded on store
    let ab = Tensor::new(
        vec![1, 2],
        Data::BF16(vec![bf16::from_f32(1.0), bf16::from_f32(2.0)]),
    );
    let bb = Tensor::new(
        vec![2, 1],
        Data::BF16(vec![bf16::from_f32(3.0), bf16::from_f32(4.0)]),
    );
    assert_eq!(
        run1(Op::MatMul, &[&ab, &bb]).data,
        Data::BF16(vec![bf16::from_f32(11.0)])
    );
    assert!(eval_op(
        &Op::MatMul,
        &[&f(&[2, 3], &[0.0; 6]), &f(&[2, 3], &[0.0; 6])]
    )
    .is_err());
}

// ------------------------------------------------------------------ indexing

#[test]
fn gather_elements_and_gather_nd() {
    let x = f(&[2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let r = run1(
        Op::GatherElements { axis: 1 },
        &[&x, &i(&[2, 2], &[0, 0, 1, -2])],
    );
    assert_close(&r, &[2, 2], &[1.0, 1.0, 4.0, 3.0], 0.0);
    let r = run1(Op::GatherElements { axis: 0 }, &[&x, &i(&[1, 2], &[1, 0])]);
    assert_close(&r, &[1, 2], &[3.0, 2.0], 0.0);
    assert!(eval_op(&Op::GatherElements { axis: 1 }, &[&x, &i(&[2, 1], &[0, 2])]).is_err());
    assert!(eval_op(
        &Op::GatherElements { axis: 1 },
        &[&x, &i(&[3, 1], &[0, 0, 0])]
    )
    .is_err());
    // GatherND examples from the ONNX spec
    let d = i(&[2, 2], &[0, 1, 2, 3]);
    assert_eq!(
        run1(
            Op::GatherND { batch_dims: 0 },
            &[&d, &i(&[2, 2], &[0, 0, 1, 1])]
        ),
        i(&[2], &[0, 3])
    );
    assert_eq!(
        run1(Op::GatherND { batch_dims: 0 }, &[&d, &i(&[2, 1], &[1, 0])]),
        i(&[2, 2], &[2, 3, 0, 1])
    );
    let d3 = i(&[2, 2, 2], &[0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(
        run1(Op::GatherND { batch_dims: 1 }, &[&d3, &i(&[2, 1], &[1, 0])]),
        i(&[2, 2], &[2, 3, 4, 5])
    );
    assert!(eval_op(&Op::GatherND { batch_dims: 0 }, &[&d, &i(&[1, 2], &[0, 2])]).is_err());
}

#[test]
fn scatter_elements_and_nd_with_add() {
    let data = f(&[1, 5], &[1.0, 2.0, 3.0, 4.0, 5.0]);
    let idx = i(&[1, 2], &[1, 1]);
    let upd = f(&[1, 2], &[1.1, 2.1]);
    let r = run1(
        Op::ScatterElements { axis: 1, add: true },
        &[&data, &idx, &upd],
    );
    assert_close(&r, &[1, 5], &[1.0, 5.2, 3.0, 4.0, 5.0], 1e-6);
    let r = run1(
        Op::ScatterElements {
            axis: 1,
            add: false,
        },
        &[&data, &i(&[1, 2], &[-1, 0]), &upd],
    );
    assert_close(&r, &[1, 5], &[2.1, 2.0, 3.0, 4.0, 1.1], 0.0);
    let d2 = i(&[3, 3], &[0; 9]);
    let r = run1(
        Op::ScatterElements {
            axis: 0,
            add: false,
        },
        &[
            &d2,
            &i(&[2, 3], &[1, 0, 2, 0, 2, 1]),
            &i(&[2, 3], &[1, 2, 3, 4, 5, 6]),
        ],
    );
    assert_eq!(r, i(&[3, 3], &[4, 2, 0, 1, 0, 6, 0, 5, 3]));
    assert!(eval_op(
        &Op::ScatterElements {
            axis: 1,
            add: false
        },
        &[&data, &i(&[1, 2], &[5, 0]), &upd]
    )
    .is_err());
    // ScatterND: ONNX example 1, and add with duplicate indices
    let d = i(&[8], &[1, 2, 3, 4, 5, 6, 7, 8]);
    let r = run1(
        Op::ScatterND { add: false },
        &[&d, &i(&[4, 1], &[4, 3, 1, 7]), &i(&[4], &[9, 10, 11, 12])],
    );
    assert_eq!(r, i(&[8], &[1, 11, 3, 10, 9, 6, 7, 12]));
    let r = run1(
        Op::ScatterND { add: true },
        &[&d, &i(&[2, 1], &[0, 0]), &i(&[2], &[5, 6])],
    );
    assert_eq!(r, i(&[8], &[12, 2, 3, 4, 5, 6, 7, 8]));
    // slices: rows of a [2,2]
    let r = run1(
        Op::ScatterND { add: true },
        &[
            &f(&[2, 2], &[0.0; 4]),
            &i(&[1, 1], &[1]),
            &f(&[1, 2], &[1.0, 2.0]),
        ],
    );
    assert_close(&r, &[2, 2], &[0.0, 0.0, 1.0, 2.0], 0.0);
}

#[test]
fn one_hot_axes_and_ranges() {
    let ids = i(&[3], &[0, 2, -1]);
    let vals = f(&[2], &[0.0, 1.0]);
    let r = run1(Op::OneHot { axis: 1, depth: 3 }, &[&ids, &vals]);
    assert_close(&r, &[3, 3], &[1., 0., 0., 0., 0., 1., 0., 0., 1.], 0.0);
    let r = run1(Op::OneHot { axis: 0, depth: 3 }, &[&ids, &vals]);
    assert_close(&r, &[3, 3], &[1., 0., 0., 0., 0., 0., 0., 1., 1.], 0.0);
    // out of range: an all-off row
    let r = run1(
        Op::OneHot { axis: 1, depth: 2 },
        &[&i(&[1], &[5]), &i(&[2], &[-1, 7])],
    );
    assert_eq!(r, i(&[1, 2], &[-1, -1]));
}

#[test]
fn topk_sorted_with_ties_by_lower_index() {
    let x = f(&[2, 4], &[1.0, 3.0, 3.0, 2.0, 5.0, 5.0, 5.0, 0.0]);
    let r = run(
        Op::TopK {
            axis: 1,
            k: 2,
            largest: true,
            sorted: true,
        },
        &[&x],
    );
    assert_close(&r[0], &[2, 2], &[3.0, 3.0, 5.0, 5.0], 0.0);
    assert_eq!(r[1], i(&[2, 2], &[1, 2, 0, 1]));
    let r = run(
        Op::TopK {
            axis: 1,
            k: 3,
            largest: false,
            sorted: true,
        },
        &[&x],
    );
    assert_close(&r[0], &[2, 3], &[1.0, 2.0, 3.0, 0.0, 5.0, 5.0], 0.0);
    assert_eq!(r[1], i(&[2, 3], &[0, 3, 1, 3, 0, 1]));
    // along axis 0 (strided lanes), ints
    let y = i(&[3, 2], &[1, 9, 7, 9, 7, 2]);
    let r = run(
        Op::TopK {
            axis: 0,
            k: 2,
            largest: true,
            sorted: true,
        },
        &[&y],
    );
    assert_eq!(r[0], i(&[2, 2], &[7, 9, 7, 9]));
    assert_eq!(r[1], i(&[2, 2], &[1, 0, 2, 1]));
    assert!(eval_op(
        &Op::TopK {
            axis: 0,
            k: 4,
            largest: true,
            sorted: true
        },
        &[&y]
    )
    .is_err());
}

// ------------------------------------------------------------------ errors

#[test]
fn bad_inputs_are_errors_not_panics() {
    let x = f(&[2, 3], &[0.0; 6]);
    // inconsistent tensor (public fields)
    let broken = Tensor {
        shape: vec![4],
        data: Data::F32(vec![1.0]),
    };
    assert!(eval_op(&Op::Identity, &[&broken]).is_err());
    assert!(eval_op(&Op::Binary(BinaryOp::Add), &[&x]).is_err());
    assert!(eval_op(&Op::Where, &[&x, &x, &x]).is_err());
    assert!(eval_op(&Op::Gather { axis: 2 }, &[&x, &i(&[1], &[0])]).is_err());
    assert!(eval_op(&Op::Gather { axis: 0 }, &[&x, &f(&[1], &[0.0])]).is_err());
    assert!(eval_op(
        &Op::Split {
            axis: 0,
            sizes: vec![1, 2]
        },
        &[&x]
    )
    .is_err());
    assert!(eval_op(
        &Op::CumSum {
            axis: 0,
            exclusive: false,
            reverse: false
        },
        &[&b(&[1], &[true])]
    )
    .is_err());
    let huge = Op::Fill {
        value: 0.0,
        dtype: DType::F32,
        shape: vec![usize::MAX, 4],
    };
    assert!(eval_op(&huge, &[]).is_err());
    let g = Group::new(["gpu"]);
    let e = eval_op(&Op::AllGather { group: g, axis: 0 }, &[&x]).unwrap_err();
    assert_eq!(
        e,
        "AllGather needs a communicator; run the plan with the executor"
    );
    assert!(eval_op(&Op::Free, &[&x]).is_err());
    assert!(eval_op(&Op::RecordEvent { event: 1 }, &[]).is_err());
}
