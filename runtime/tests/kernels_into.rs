//! `eval_op_into` against `eval_op`: for every kernel family, on pseudo-random inputs (f32,
//! bf16, f16, integers, bools; broadcasting; layouts that take each fast path and the
//! general walk; sizes that run in parallel), the outputs written in place into larger
//! buffers at an offset are bit-identical to `eval_op`'s and nothing outside them is
//! touched. One workspace serves every case, so stale scratch contents would show.

use half::{bf16, f16};
use hzp_ir::{BinaryOp, DType, Data, Op, ReduceOp, Tensor, TensorType, UnaryOp};
use hzp_runtime::cpu::{eval_op, eval_op_into, DataMut, DataRef, TensorMut, TensorRef, Workspace};

/// Deterministic pseudo-random numbers.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A tensor of `dtype` and `shape` with values in about [-3, 3] (floats, a few NaNs and
/// exact ties when `nan`), [-20, 20] (integers) or coin flips (bools).
pub fn rand(r: &mut Rng, dtype: DType, shape: &[usize], nan: bool) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n)
        .map(|i| match dtype {
            DType::Bool => (r.below(2)) as f64,
            DType::I64 | DType::I32 => r.below(41) as f64 - 20.0,
            _ => {
                if nan && i % 97 == 13 {
                    f64::NAN
                } else if nan && i % 31 == 5 {
                    1.0 // ties
                } else {
                    (3.0 * r.f()) as f64
                }
            }
        })
        .collect();
    Tensor::from_f64(dtype, shape.to_vec(), &v)
}

/// Indices into a dim of size `dim`, negative ones included, as i64 or i32.
pub fn ids(r: &mut Rng, dtype: DType, shape: &[usize], dim: usize) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n)
        .map(|_| {
            let j = r.below(dim as u64) as f64;
            if r.below(3) == 0 {
                j - dim as f64
            } else {
                j
            }
        })
        .collect();
    Tensor::from_f64(dtype, shape.to_vec(), &v)
}

/// A case: an op and its inputs.
pub type Case = (Op, Vec<Tensor>);

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
const ALL: [DType; 6] = [
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::I64,
    DType::I32,
    DType::Bool,
];

/// Every kernel family on inputs that reach its fast paths and its general paths.
pub fn cases() -> Vec<Case> {
    let mut r = Rng::new(7);
    let mut c: Vec<Case> = Vec::new();
    let big = [70_000]; // more than one parallel piece of the flat loops

    // ---- unary
    use UnaryOp::*;
    let float_unary = [
        Neg, Abs, Exp, Log, Sqrt, Rsqrt, Reciprocal, Tanh, Erf, Sigmoid, Relu, Gelu, GeluTanh,
        Silu, Sin, Cos, Floor, Ceil, Sign, IsNaN,
    ];
    for dt in FLOATS {
        for u in float_unary {
            c.push((Op::Unary(u), vec![rand(&mut r, dt, &[3, 17], true)]));
        }
        c.push((Op::Unary(Gelu), vec![rand(&mut r, dt, &big, false)]));
    }
    for dt in [DType::I64, DType::I32] {
        for u in [Neg, Abs, Sign] {
            c.push((Op::Unary(u), vec![rand(&mut r, dt, &[5, 4], false)]));
        }
    }
    for u in [Not, Abs, Sign] {
        c.push((Op::Unary(u), vec![rand(&mut r, DType::Bool, &[9], false)]));
    }

    // ---- binary, broadcasting
    use BinaryOp::*;
    let shapes: [(&[usize], &[usize]); 6] = [
        (&[4, 5], &[4, 5]),
        (&[4, 5], &[]),
        (&[], &[3, 2]),
        (&[2, 1, 5], &[3, 1]),
        (&[3, 4, 5], &[4, 1]),
        (&[1, 6], &[6]),
    ];
    let arith = [Add, Sub, Mul, Div, Pow, Max, Min, Mod];
    let cmp = [Equal, Less, LessOrEqual, Greater, GreaterOrEqual];
    for dt in FLOATS {
        for b in arith.iter().chain(&cmp) {
            for (sa, sb) in shapes {
                c.push((
                    Op::Binary(*b),
                    vec![rand(&mut r, dt, sa, true), rand(&mut r, dt, sb, false)],
                ));
            }
        }
        for e in [1.0, 2.0, 3.0, 0.5] {
            let x = rand(&mut r, dt, &[7, 3], false);
            c.push((Op::Binary(Pow), vec![x, Tensor::from_f64(dt, vec![], &[e])]));
        }
        c.push((
            Op::Binary(Mul),
            vec![rand(&mut r, dt, &big, false), rand(&mut r, dt, &big, false)],
        ));
        c.push((
            Op::Binary(Add),
            vec![rand(&mut r, dt, &big, false), rand(&mut r, dt, &[], false)],
        ));
    }
    for dt in [DType::I64, DType::I32] {
        for b in [Add, Sub, Mul, Max, Min].iter().chain(&cmp) {
            for (sa, sb) in shapes {
                c.push((
                    Op::Binary(*b),
                    vec![rand(&mut r, dt, sa, false), rand(&mut r, dt, sb, false)],
                ));
            }
        }
        for b in [Div, Mod] {
            let d = Tensor::from_f64(dt, vec![3], &[3.0, -2.0, 5.0]);
            c.push((Op::Binary(b), vec![rand(&mut r, dt, &[4, 3], false), d]));
        }
        let e = Tensor::from_f64(dt, vec![4], &[0.0, 1.0, 3.0, 2.0]);
        c.push((Op::Binary(Pow), vec![rand(&mut r, dt, &[2, 4], false), e]));
    }
    for b in [
        And,
        Or,
        Xor,
        Equal,
        Less,
        LessOrEqual,
        Greater,
        GreaterOrEqual,
        Add,
        Mul,
    ] {
        for (sa, sb) in shapes {
            c.push((
                Op::Binary(b),
                vec![
                    rand(&mut r, DType::Bool, sa, false),
                    rand(&mut r, DType::Bool, sb, false),
                ],
            ));
        }
    }

    // ---- where
    let w: [(&[usize], &[usize], &[usize]); 5] = [
        (&[3, 4], &[3, 4], &[3, 4]),
        (&[3, 1], &[3, 4], &[3, 4]),
        (&[3, 1], &[], &[4]),
        (&[3, 1], &[4], &[]),
        (&[2, 1, 4], &[3, 1], &[1, 4]),
    ];
    for dt in ALL {
        for (sc, sx, sy) in w {
            c.push((
                Op::Where,
                vec![
                    rand(&mut r, DType::Bool, sc, false),
                    rand(&mut r, dt, sx, false),
                    rand(&mut r, dt, sy, false),
                ],
            ));
        }
    }

    // ---- cast, identity, fill
    for from in ALL {
        for to in ALL {
            c.push((Op::Cast { to }, vec![rand(&mut r, from, &[6, 5], true)]));
        }
        c.push((Op::Identity, vec![rand(&mut r, from, &[4], false)]));
        c.push((Op::Copy, vec![rand(&mut r, from, &[2, 3], false)]));
        c.push((
            Op::Reshape { shape: vec![3, 2] },
            vec![rand(&mut r, from, &[2, 3], false)],
        ));
        c.push((
            Op::Fill {
                value: -2.75,
                dtype: from,
                shape: vec![3, 5],
            },
            vec![],
        ));
    }

    // ---- matmul: 2-D, rank-1 operands, batched, broadcast batch, big enough for gemm
    // packing and parallel batch entries
    let mm: [(&[usize], &[usize]); 9] = [
        (&[5, 7], &[7, 3]),
        (&[7], &[7, 3]),
        (&[5, 7], &[7]),
        (&[7], &[7]),
        (&[2, 5, 7], &[7, 3]),
        (&[2, 5, 7], &[2, 7, 3]),
        (&[3, 1, 4, 6], &[2, 6, 5]),
        (&[96, 80], &[80, 72]),
        (&[8, 33, 40], &[8, 40, 24]),
    ];
    for dt in FLOATS {
        for (sa, sb) in mm {
            c.push((
                Op::MatMul,
                vec![rand(&mut r, dt, sa, false), rand(&mut r, dt, sb, false)],
            ));
        }
    }
    c.push((
        Op::MatMul,
        vec![
            rand(&mut r, DType::F32, &[0, 4], false),
            rand(&mut r, DType::F32, &[4, 3], false),
        ],
    ));
    c.push((
        Op::MatMul,
        vec![
            rand(&mut r, DType::F32, &[3, 0], false),
            rand(&mut r, DType::F32, &[0, 2], false),
        ],
    ));

    // ---- softmax, norms
    for dt in FLOATS {
        for (shape, axis) in [(&[4, 9][..], 1), (&[3, 5, 4][..], 1), (&[6, 5][..], 0)] {
            c.push((Op::Softmax { axis }, vec![rand(&mut r, dt, shape, false)]));
            c.push((
                Op::LogSoftmax { axis },
                vec![rand(&mut r, dt, shape, false)],
            ));
        }
        c.push((
            Op::Softmax { axis: 1 },
            vec![rand(&mut r, dt, &[64, 600], false)],
        ));
        c.push((
            Op::LogSoftmax { axis: 1 },
            vec![rand(&mut r, dt, &[4, 700], false)],
        ));
        for (shape, axis, ps) in [
            (&[4, 8][..], 1, &[8][..]),
            (&[2, 3, 8][..], 1, &[3, 8][..]),
            (&[2, 3, 8][..], 1, &[8][..]),
            (&[2, 3, 8][..], 2, &[1][..]),
            (&[300, 256][..], 1, &[256][..]),
        ] {
            let x = rand(&mut r, dt, shape, false);
            let s = rand(&mut r, dt, ps, false);
            let b = rand(&mut r, dt, ps, false);
            let epsilon = 1e-5;
            c.push((
                Op::LayerNorm { axis, epsilon },
                vec![x.clone(), s.clone(), b],
            ));
            c.push((Op::LayerNorm { axis, epsilon }, vec![x.clone(), s.clone()]));
            c.push((Op::RmsNorm { axis, epsilon }, vec![x, s]));
        }
    }

    // ---- reductions
    use ReduceOp as R;
    let axes_list: [&[usize]; 6] = [&[2], &[1, 2], &[1], &[0, 2], &[0, 1, 2], &[]];
    for dt in ALL {
        for op in [R::Sum, R::Mean, R::Max, R::Min, R::Prod] {
            if op == R::Mean && !dt.is_float() {
                continue;
            }
            for axes in axes_list {
                for keep_dims in [false, true] {
                    c.push((
                        Op::Reduce {
                            op,
                            axes: axes.to_vec(),
                            keep_dims,
                        },
                        vec![rand(&mut r, dt, &[3, 4, 5], dt != DType::F16)],
                    ));
                }
            }
        }
        c.push((
            Op::Reduce {
                op: R::Sum,
                axes: vec![1, 0],
                keep_dims: false,
            },
            vec![rand(&mut r, dt, &[3, 4, 5], false)],
        ));
        for axis in 0..3 {
            c.push((
                Op::ArgMax {
                    axis,
                    keep_dims: axis == 1,
                },
                vec![rand(&mut r, dt, &[3, 4, 5], true)],
            ));
        }
        if dt != DType::Bool {
            for (axis, exclusive, reverse) in [(0, false, false), (1, true, false), (2, true, true)]
            {
                c.push((
                    Op::CumSum {
                        axis,
                        exclusive,
                        reverse,
                    },
                    vec![rand(&mut r, dt, &[3, 4, 5], false)],
                ));
            }
        }
    }
    c.push((
        Op::Reduce {
            op: R::Sum,
            axes: vec![1],
            keep_dims: false,
        },
        vec![rand(&mut r, DType::F32, &[2000, 40], false)],
    ));

    // ---- movement
    for dt in ALL {
        for (shape, perm) in [
            (&[3, 70, 13][..], &[0, 2, 1][..]),
            (&[4, 5][..], &[1, 0][..]),
            (&[2, 3, 4][..], &[2, 0, 1][..]),
            (&[2, 3, 4, 5][..], &[0, 2, 1, 3][..]),
        ] {
            c.push((
                Op::Transpose {
                    perm: perm.to_vec(),
                },
                vec![rand(&mut r, dt, shape, false)],
            ));
        }
        let x = rand(&mut r, dt, &[6, 7], false);
        for (axes, starts, ends, steps) in [
            (vec![0], vec![1], vec![5], vec![1]),
            (vec![1, 0], vec![6, 0], vec![-1, 6], vec![-2, 3]),
            (vec![1], vec![2], vec![2], vec![1]),
        ] {
            c.push((
                Op::Slice {
                    axes,
                    starts,
                    ends,
                    steps,
                },
                vec![x.clone()],
            ));
        }
        c.push((
            Op::Concat { axis: 1 },
            vec![
                rand(&mut r, dt, &[3, 2, 4], false),
                rand(&mut r, dt, &[3, 5, 4], false),
                rand(&mut r, dt, &[3, 1, 4], false),
            ],
        ));
        c.push((
            Op::Concat { axis: 0 },
            vec![
                rand(&mut r, dt, &[2, 3], false),
                rand(&mut r, dt, &[4, 3], false),
            ],
        ));
        c.push((
            Op::Split {
                axis: 1,
                sizes: vec![2, 0, 3],
            },
            vec![rand(&mut r, dt, &[4, 5, 2], false)],
        ));
        c.push((
            Op::Expand {
                shape: vec![2, 3, 4],
            },
            vec![rand(&mut r, dt, &[3, 1], false)],
        ));
        c.push((
            Op::Tile {
                repeats: vec![2, 1, 3],
            },
            vec![rand(&mut r, dt, &[2, 3, 2], false)],
        ));
        for (upper, k) in [(true, 0), (false, 1), (true, -2)] {
            c.push((
                Op::Trilu { upper, k },
                vec![rand(&mut r, dt, &[2, 4, 5], false)],
            ));
        }
    }

    // ---- indexing
    for dt in ALL {
        for it in [DType::I64, DType::I32] {
            let x = rand(&mut r, dt, &[5, 4, 3], false);
            c.push((
                Op::Gather { axis: 0 },
                vec![x.clone(), ids(&mut r, it, &[2, 3], 5)],
            ));
            c.push((
                Op::Gather { axis: 1 },
                vec![x.clone(), ids(&mut r, it, &[6], 4)],
            ));
            c.push((
                Op::GatherElements { axis: 1 },
                vec![x.clone(), ids(&mut r, it, &[5, 2, 3], 4)],
            ));
            c.push((
                Op::GatherND { batch_dims: 0 },
                vec![x.clone(), ids(&mut r, it, &[3, 2], 4)],
            ));
            c.push((
                Op::GatherND { batch_dims: 1 },
                vec![x.clone(), ids(&mut r, it, &[5, 2, 1], 4)],
            ));
            for add in [false, true] {
                // distinct targets along axis 0 for the non-add case
                let idx = Tensor::from_f64(it, vec![2, 4, 3], &{
                    let mut v = Vec::new();
                    for p in 0..24 {
                        v.push(if p < 12 { 1.0 } else { -1.0 });
                    }
                    v
                });
                c.push((
                    Op::ScatterElements { axis: 0, add },
                    vec![x.clone(), idx, rand(&mut r, dt, &[2, 4, 3], false)],
                ));
                let nd = Tensor::from_f64(it, vec![2, 2], &[0.0, 1.0, 4.0, -1.0]);
                c.push((
                    Op::ScatterND { add },
                    vec![x.clone(), nd, rand(&mut r, dt, &[2, 3], false)],
                ));
            }
            c.push((
                Op::OneHot { axis: 1, depth: 4 },
                vec![ids(&mut r, it, &[3, 2], 5), rand(&mut r, dt, &[2], false)],
            ));
        }
        for (axis, k, largest) in [(2, 2, true), (1, 4, false), (0, 1, true)] {
            c.push((
                Op::TopK {
                    axis,
                    k,
                    largest,
                    sorted: true,
                },
                vec![rand(&mut r, dt, &[3, 4, 5], true)],
            ));
        }
    }
    c.push((
        Op::Gather { axis: 0 },
        vec![
            rand(&mut r, DType::BF16, &[300, 64], false),
            ids(&mut r, DType::I64, &[4, 33], 300),
        ],
    ));
    c
}

/// Bit patterns of the elements (NaN payloads and signed zeros included).
pub fn bits(d: &Data) -> Vec<u64> {
    match d {
        Data::F32(v) => v.iter().map(|x| x.to_bits() as u64).collect(),
        Data::BF16(v) => v.iter().map(|x| x.to_bits() as u64).collect(),
        Data::F16(v) => v.iter().map(|x| x.to_bits() as u64).collect(),
        Data::I64(v) => v.iter().map(|&x| x as u64).collect(),
        Data::I32(v) => v.iter().map(|&x| x as u32 as u64).collect(),
        Data::Bool(v) => v.iter().map(|&x| x as u64).collect(),
    }
}

/// A buffer of `pad + n + pad` elements of `dtype` filled with a sentinel.
fn padded(dtype: DType, n: usize, pad: usize) -> Data {
    let len = n + 2 * pad;
    match dtype {
        DType::F32 => Data::F32(vec![f32::from_bits(0x7fc0_1234); len]),
        DType::BF16 => Data::BF16(vec![bf16::from_bits(0x7fc3); len]),
        DType::F16 => Data::F16(vec![f16::from_bits(0x7e03); len]),
        DType::I64 => Data::I64(vec![i64::MIN + 77; len]),
        DType::I32 => Data::I32(vec![i32::MIN + 77; len]),
        DType::Bool => Data::Bool(vec![true; len]),
    }
}

/// `d[range]` as a writable view.
fn sub_mut(d: &mut Data, s: usize, e: usize) -> DataMut<'_> {
    match d {
        Data::F32(v) => DataMut::F32(&mut v[s..e]),
        Data::BF16(v) => DataMut::BF16(&mut v[s..e]),
        Data::F16(v) => DataMut::F16(&mut v[s..e]),
        Data::I64(v) => DataMut::I64(&mut v[s..e]),
        Data::I32(v) => DataMut::I32(&mut v[s..e]),
        Data::Bool(v) => DataMut::Bool(&mut v[s..e]),
    }
}

/// Runs `op` with `eval_op_into`, each output at offset `pad` of a sentinel-filled buffer;
/// checks the sentinels and returns the outputs.
fn run_into(op: &Op, ins: &[Tensor], ws: &mut Workspace, pad: usize) -> Vec<Tensor> {
    let types: Vec<TensorType> = ins.iter().map(Tensor::ty).collect();
    let refs: Vec<&TensorType> = types.iter().collect();
    let out_types = op.infer(&refs, None).unwrap();
    let mut bufs: Vec<Data> = out_types
        .iter()
        .map(|t| padded(t.dtype, t.numel(), pad))
        .collect();
    let fresh: Vec<Data> = bufs.clone();
    {
        let in_views: Vec<TensorRef> = ins.iter().map(TensorRef::of).collect();
        let mut outs: Vec<TensorMut> = bufs
            .iter_mut()
            .zip(&out_types)
            .map(|(b, t)| TensorMut::new(&t.shape, sub_mut(b, pad, pad + t.numel())))
            .collect();
        eval_op_into(op, &in_views, &mut outs, ws).unwrap_or_else(|e| panic!("{op:?}: {e}"));
    }
    bufs.iter()
        .zip(&fresh)
        .zip(&out_types)
        .map(|((b, f), t)| {
            let (bb, fb) = (bits(b), bits(f));
            let n = t.numel();
            assert_eq!(bb[..pad], fb[..pad], "{op:?}: wrote before its output");
            assert_eq!(
                bb[pad + n..],
                fb[pad + n..],
                "{op:?}: wrote past its output"
            );
            let d = match b {
                Data::F32(v) => Data::F32(v[pad..pad + n].to_vec()),
                Data::BF16(v) => Data::BF16(v[pad..pad + n].to_vec()),
                Data::F16(v) => Data::F16(v[pad..pad + n].to_vec()),
                Data::I64(v) => Data::I64(v[pad..pad + n].to_vec()),
                Data::I32(v) => Data::I32(v[pad..pad + n].to_vec()),
                Data::Bool(v) => Data::Bool(v[pad..pad + n].to_vec()),
            };
            Tensor::new(t.shape.clone(), d)
        })
        .collect()
}

#[test]
fn every_family_matches_eval_op_bit_for_bit_in_place() {
    let mut ws = Workspace::new();
    let cases = cases();
    assert!(cases.len() > 900, "{} cases", cases.len());
    for (round, pad) in [(0, 5), (1, 64)] {
        for (op, ins) in &cases {
            let refs: Vec<&Tensor> = ins.iter().collect();
            let want = eval_op(op, &refs).unwrap_or_else(|e| panic!("{op:?}: {e}"));
            let got = run_into(op, ins, &mut ws, pad);
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(g.shape, w.shape, "{op:?}");
                assert_eq!(g.dtype(), w.dtype(), "{op:?}");
                assert!(
                    bits(&g.data) == bits(&w.data),
                    "round {round}: {op:?} on {:?}: in-place result differs",
                    ins.iter().map(|t| t.ty().to_string()).collect::<Vec<_>>()
                );
            }
        }
    }
}

#[test]
fn workspace_stops_growing_after_one_pass() {
    let mut ws = Workspace::new();
    let cases = cases();
    for (op, ins) in &cases {
        run_into(op, ins, &mut ws, 1);
    }
    let held = ws.bytes();
    assert!(held > 0, "bf16 kernels stage through the workspace");
    for (op, ins) in &cases {
        run_into(op, ins, &mut ws, 1);
    }
    assert_eq!(ws.bytes(), held, "the second pass grew the workspace");
}

#[test]
fn reserve_for_sizes_the_workspace_up_front() {
    let x = TensorType::new(DType::BF16, vec![64, 300]);
    let mut ws = Workspace::new();
    ws.reserve_for(&Op::Softmax { axis: 1 }, std::slice::from_ref(&x))
        .unwrap();
    let held = ws.bytes();
    // input staged and result staged in f32
    assert!(held >= 2 * 64 * 300 * 4, "{held}");
    let t = rand(&mut Rng::new(3), DType::BF16, &[64, 300], false);
    run_into(&Op::Softmax { axis: 1 }, &[t], &mut ws, 0);
    assert_eq!(ws.bytes(), held);
    // integer division placeholders are not zero
    let i = TensorType::new(DType::I64, vec![3]);
    ws.reserve_for(&Op::Binary(BinaryOp::Div), &[i.clone(), i])
        .unwrap();
    // an op with no kernel is an error
    assert!(ws.reserve_for(&Op::Free, &[x]).is_err());
}

#[test]
fn wrong_output_buffers_are_errors() {
    let x = Tensor::f32(vec![2, 3], vec![1.0; 6]);
    let ins = [TensorRef::of(&x)];
    let mut ws = Workspace::new();
    let op = Op::Unary(UnaryOp::Exp);
    // wrong dtype
    let mut o = vec![bf16::ZERO; 6];
    let mut outs = [TensorMut::new(&[2, 3], DataMut::BF16(&mut o))];
    let e = eval_op_into(&op, &ins, &mut outs, &mut ws).unwrap_err();
    assert!(e.contains("Exp") && e.contains("output 0"), "{e}");
    // wrong shape, and a shape whose element count differs from the buffer
    let mut o = vec![0f32; 6];
    let mut outs = [TensorMut::new(&[3, 2], DataMut::F32(&mut o))];
    assert!(eval_op_into(&op, &ins, &mut outs, &mut ws).is_err());
    let mut o = vec![0f32; 5];
    let mut outs = [TensorMut::new(&[2, 3], DataMut::F32(&mut o))];
    assert!(eval_op_into(&op, &ins, &mut outs, &mut ws).is_err());
    // wrong output count
    let e = eval_op_into(&op, &ins, &mut [], &mut ws).unwrap_err();
    assert!(e.contains("0 output buffers"), "{e}");
    // an input whose data does not match its shape
    let short = [TensorRef::new(&[2, 3], DataRef::F32(&[1.0; 4]))];
    let mut o = vec![0f32; 6];
    let mut outs = [TensorMut::new(&[2, 3], DataMut::F32(&mut o))];
    let e = eval_op_into(&op, &short, &mut outs, &mut ws).unwrap_err();
    assert!(e.contains("input 0 has 4 elements"), "{e}");
    // a bad index is an error, not a panic
    let data = Tensor::f32(vec![3, 2], vec![0.0; 6]);
    let idx = Tensor::i64(vec![2], vec![1, 3]);
    let mut o = vec![0f32; 4];
    let mut outs = [TensorMut::new(&[2, 2], DataMut::F32(&mut o))];
    let e = eval_op_into(
        &Op::Gather { axis: 0 },
        &[TensorRef::of(&data), TensorRef::of(&idx)],
        &mut outs,
        &mut ws,
    )
    .unwrap_err();
    assert!(e.contains("index 3 is out of range"), "{e}");
}

#[test]
fn byte_views_check_alignment_length_and_bools() {
    // a u64-backed buffer, like the arena
    let mut arena = vec![0u64; 8];
    // SAFETY: viewing initialized u64s as bytes.
    let bytes: &mut [u8] =
        unsafe { std::slice::from_raw_parts_mut(arena.as_mut_ptr() as *mut u8, 64) };
    match DataMut::from_bytes(DType::F32, &mut bytes[8..24]).unwrap() {
        DataMut::F32(v) => {
            assert_eq!(v.len(), 4);
            v.fill(1.5);
        }
        _ => unreachable!(),
    }
    match DataRef::from_bytes(DType::F32, &bytes[8..24]).unwrap() {
        DataRef::F32(v) => assert_eq!(v, &[1.5; 4]),
        _ => unreachable!(),
    }
    assert_eq!(
        DataRef::from_bytes(DType::BF16, &bytes[2..10])
            .unwrap()
            .len(),
        4
    );
    let e = DataRef::from_bytes(DType::I64, &bytes[4..20]).unwrap_err();
    assert!(e.contains("aligned to 8"), "{e}");
    assert!(DataRef::from_bytes(DType::F32, &bytes[0..6]).is_err());
    // bools: 0/1 only when read; normalized when viewed for writing
    bytes[40] = 7;
    let e = DataRef::from_bytes(DType::Bool, &bytes[40..44]).unwrap_err();
    assert!(e.contains("not 0 or 1"), "{e}");
    match DataMut::from_bytes(DType::Bool, &mut bytes[40..44]).unwrap() {
        DataMut::Bool(v) => assert_eq!(v, &[true, false, false, false]),
        _ => unreachable!(),
    }
    assert!(DataRef::from_bytes(DType::Bool, &bytes[40..44]).is_ok());
}
