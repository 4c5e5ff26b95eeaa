//! What the cuDNN attention graphs (`cuda::sdpa`) compute, without a GPU: a small
//! interpreter runs each graph as cuDNN's graph API defines its operations (batched matmul
//! broadcasting an operand with fewer heads over consecutive groups of the output's heads,
//! pointwise ops broadcasting dims of 1, reductions onto the dims of extent 1, `GEN_INDEX`,
//! `CMP_GE`, `BINARY_SELECT`, reshape as a view: the operand's elements laid out by its
//! strides and read back by the result's), reading and writing the bound tensors through their
//! dims and strides over the plan's dense `[b,h,s,d]` bytes. The forward's `O` and statistics
//! and the backward's dQ, dK, dV are compared with hzp's CPU attention (`cpu::eval_op`):
//! causal or not, grouped-query heads, query and key lengths that differ. Exact arithmetic
//! (no rounding to the I/O type) checks the graph's structure tightly; with bf16 rounding
//! where the graph converts to the I/O type, loosely.

use half::{bf16, f16};
use hzp_ir::{DType, Op, Tensor, TensorType};
use hzp_runtime::cpu::eval_op;
use hzp_runtime::cuda::sdpa::{
    plan_sdpa, PwMode, ReduceMode, Role, SdpaGraph, SdpaKind, SdpaOp, SdpaTensor, SdpaType,
};
use std::collections::HashMap;

/// A logical (dense, row-major over its dims) value.
#[derive(Clone, Debug)]
struct Val {
    dims: Vec<usize>,
    data: Vec<f64>,
}

fn numel(d: &[usize]) -> usize {
    d.iter().product()
}

/// The multi-index of linear index `i` over `dims`.
fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for k in (0..dims.len()).rev() {
        idx[k] = i % dims[k];
        i /= dims[k];
    }
    idx
}

fn ravel(idx: &[usize], dims: &[usize]) -> usize {
    idx.iter().zip(dims).fold(0, |acc, (i, d)| acc * d + i)
}

fn offset(idx: &[usize], strides: &[i64]) -> usize {
    idx.iter()
        .zip(strides)
        .map(|(&i, &s)| i as i64 * s)
        .sum::<i64>() as usize
}

fn udims(t: &SdpaTensor) -> Vec<usize> {
    t.dims.iter().map(|&d| d as usize).collect()
}

struct Interp<'a> {
    g: &'a SdpaGraph,
    /// Round values to the I/O type where the graph's tensors have it.
    rounding: bool,
    vals: HashMap<i64, Val>,
}

impl Interp<'_> {
    fn round(&self, t: SdpaType, x: f64) -> f64 {
        if !self.rounding {
            return x;
        }
        match t {
            SdpaType::BF16 => bf16::from_f64(x).to_f64(),
            SdpaType::F16 => f16::from_f64(x).to_f64(),
            SdpaType::F32 => x as f32 as f64,
            SdpaType::I32 | SdpaType::Bool => x,
        }
    }

    fn t(&self, uid: i64) -> &SdpaTensor {
        self.g.tensor(uid).unwrap()
    }

    fn get(&self, uid: i64) -> &Val {
        self.vals
            .get(&uid)
            .unwrap_or_else(|| panic!("{} read before it is written", self.t(uid).name))
    }

    /// Binds a bound tensor to the plan's bytes `mem` through its dims and strides.
    fn bind(&mut self, role: Role, mem: &[f64]) {
        let t = self.t(role.uid()).clone();
        let dims = udims(&t);
        let data = (0..numel(&dims))
            .map(|i| self.round(t.dtype, mem[offset(&unravel(i, &dims), &t.strides)]))
            .collect();
        self.vals.insert(t.uid, Val { dims, data });
    }

    /// A bound output's value laid out in the plan's bytes (`len` elements).
    fn read_out(&self, role: Role, len: usize) -> Vec<f64> {
        let t = self.t(role.uid());
        let v = self.get(t.uid);
        let mut mem = vec![f64::NAN; len];
        for (i, x) in v.data.iter().enumerate() {
            mem[offset(&unravel(i, &v.dims), &t.strides)] = *x;
        }
        mem
    }

    fn put(&mut self, y: i64, data: Vec<f64>) {
        let t = self.t(y).clone();
        let data = data.into_iter().map(|x| self.round(t.dtype, x)).collect();
        self.vals.insert(
            y,
            Val {
                dims: udims(&t),
                data,
            },
        );
    }

    /// The element of `v` that output index `idx` reads (dims of 1 broadcast).
    fn at(v: &Val, idx: &[usize]) -> f64 {
        let j: Vec<usize> = idx
            .iter()
            .zip(&v.dims)
            .map(|(&i, &d)| if d == 1 { 0 } else { i })
            .collect();
        v.data[ravel(&j, &v.dims)]
    }

    fn run(&mut self) {
        let g = self.g;
        for t in &g.tensors {
            if let Some(v) = t.by_value {
                self.vals.insert(
                    t.uid,
                    Val {
                        dims: udims(t),
                        data: vec![v as f64],
                    },
                );
            }
        }
        for op in &g.ops {
            match op {
                SdpaOp::Matmul { a, b, c } => {
                    let (va, vb) = (self.get(*a).clone(), self.get(*b).clone());
                    let cd = udims(self.t(*c));
                    let n = cd.len();
                    let k = va.dims[n - 1];
                    let mut out = vec![0.0; numel(&cd)];
                    for (ci, o) in out.iter_mut().enumerate() {
                        let idx = unravel(ci, &cd);
                        // a batch dim with fewer entries serves consecutive groups of C's
                        let batch = |v: &Val| -> Vec<usize> {
                            (0..n - 2).map(|i| idx[i] / (cd[i] / v.dims[i])).collect()
                        };
                        let (ba, bb) = (batch(&va), batch(&vb));
                        let (r, col) = (idx[n - 2], idx[n - 1]);
                        let mut acc = 0.0;
                        for kk in 0..k {
                            let mut ia = ba.clone();
                            ia.extend([r, kk]);
                            let mut ib = bb.clone();
                            ib.extend([kk, col]);
                            acc += va.data[ravel(&ia, &va.dims)] * vb.data[ravel(&ib, &vb.dims)];
                        }
                        *o = acc;
                    }
                    self.put(*c, out);
                }
                SdpaOp::Pointwise { mode, x, b, t, y } => {
                    let yd = udims(self.t(*y));
                    let vx = self.get(*x).clone();
                    let vb = b.map(|u| self.get(u).clone());
                    let vt = t.map(|u| self.get(u).clone());
                    let out = (0..numel(&yd))
                        .map(|i| {
                            let idx = unravel(i, &yd);
                            let xv = Self::at(&vx, &idx);
                            let bv = vb.as_ref().map(|v| Self::at(v, &idx));
                            match mode {
                                PwMode::Mul => xv * bv.unwrap(),
                                PwMode::Add => xv + bv.unwrap(),
                                PwMode::Sub => xv - bv.unwrap(),
                                PwMode::Div => xv / bv.unwrap(),
                                PwMode::Exp => xv.exp(),
                                PwMode::Log => xv.ln(),
                                PwMode::Identity => xv,
                                PwMode::GenIndex { axis } => idx[*axis as usize] as f64,
                                PwMode::CmpGe => (xv >= bv.unwrap()) as u8 as f64,
                                PwMode::BinarySelect => {
                                    if Self::at(vt.as_ref().unwrap(), &idx) != 0.0 {
                                        xv
                                    } else {
                                        bv.unwrap()
                                    }
                                }
                            }
                        })
                        .collect();
                    self.put(*y, out);
                }
                SdpaOp::Reduction { mode, x, y } => {
                    let yd = udims(self.t(*y));
                    let vx = self.get(*x).clone();
                    let init = match mode {
                        ReduceMode::Max => f64::NEG_INFINITY,
                        ReduceMode::Add => 0.0,
                    };
                    let mut out = vec![init; numel(&yd)];
                    for (i, v) in vx.data.iter().enumerate() {
                        let idx = unravel(i, &vx.dims);
                        let j: Vec<usize> = idx
                            .iter()
                            .zip(&yd)
                            .map(|(&i, &d)| if d == 1 { 0 } else { i })
                            .collect();
                        let o = &mut out[ravel(&j, &yd)];
                        *o = match mode {
                            ReduceMode::Max => o.max(*v),
                            ReduceMode::Add => *o + v,
                        };
                    }
                    self.put(*y, out);
                }
                SdpaOp::Reshape { x, y } => {
                    // x's elements laid out by x's strides, read back by y's
                    let (tx, ty) = (self.t(*x).clone(), self.t(*y).clone());
                    let vx = self.get(*x).clone();
                    let len = numel(&vx.dims);
                    let mut mem = vec![f64::NAN; len];
                    for (i, v) in vx.data.iter().enumerate() {
                        mem[offset(&unravel(i, &vx.dims), &tx.strides)] = *v;
                    }
                    let yd = udims(&ty);
                    let out = (0..numel(&yd))
                        .map(|i| mem[offset(&unravel(i, &yd), &ty.strides)])
                        .collect();
                    self.put(*y, out);
                }
            }
        }
    }
}

struct Rng(u64);
impl Rng {
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (((self.0 >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0) as f32
            })
            .collect()
    }
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec()
}

/// Largest |a - b| over the largest |b|.
fn rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    hq: usize,
    hkv: usize,
    t: usize,
    s: usize,
    d: usize,
    causal: bool,
}

/// The graphs' outputs against `cpu::eval_op`, exact (`rounding` false: tolerance `tol`) or
/// with bf16 rounding.
fn compare(c: Case, rounding: bool, tol: f64) {
    let Case {
        b,
        hq,
        hkv,
        t,
        s,
        d,
        causal,
    } = c;
    let scale = 1.0 / (d as f64).sqrt();
    let mut rng = Rng(0x5eed ^ (hq * 131 + t * 7 + s) as u64);
    // inputs representable in bf16, so the rounding run reads what the reference reads
    let mk = |v: Vec<f32>, shape: Vec<usize>| {
        let r: Vec<f32> = v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect();
        Tensor::f32(shape, r)
    };
    let q = mk(rng.vec(b * hq * t * d), vec![b, hq, t, d]);
    let k = mk(rng.vec(b * hkv * s * d), vec![b, hkv, s, d]);
    let v = mk(rng.vec(b * hkv * s * d), vec![b, hkv, s, d]);
    let dout = mk(rng.vec(b * hq * t * d), vec![b, hq, t, d]);
    let fwd = Op::Attention { scale, causal };
    let out = eval_op(&fwd, &[&q, &k, &v]).unwrap();
    let (o, lse) = (&out[0], &out[1]);
    let grad = Op::AttentionGrad { scale, causal };
    let gr = eval_op(&grad, &[&q, &k, &v, o, lse, &dout]).unwrap();

    let bt = |shape: &[usize]| TensorType::new(DType::BF16, shape.to_vec());
    let (tq, tk, to) = (bt(&[b, hq, t, d]), bt(&[b, hkv, s, d]), bt(&[b, hq, t, d]));
    let tl = TensorType::new(DType::F32, vec![b, hq, t]);
    let tag = format!("{c:?} rounding={rounding}");

    // forward
    let gf = plan_sdpa(
        SdpaKind::Forward,
        &[&tq, &tk, &tk],
        &[&to, &tl],
        scale,
        causal,
    )
    .unwrap();
    let mut it = Interp {
        g: &gf,
        rounding,
        vals: HashMap::new(),
    };
    it.bind(Role::Q, &f64s(&q));
    it.bind(Role::K, &f64s(&k));
    it.bind(Role::V, &f64s(&v));
    it.run();
    let eo = rel(&it.read_out(Role::O, o.numel()), &f64s(o));
    let el = rel(&it.read_out(Role::Stats, lse.numel()), &f64s(lse));
    assert!(
        eo <= tol && el <= tol,
        "{tag}: forward O {eo:.2e}, stats {el:.2e}"
    );

    // backward, from the reference's O and statistics
    let gb = plan_sdpa(
        SdpaKind::Backward,
        &[&tq, &tk, &tk, &to, &tl, &to],
        &[&tq, &tk, &tk],
        scale,
        causal,
    )
    .unwrap();
    let mut it = Interp {
        g: &gb,
        rounding,
        vals: HashMap::new(),
    };
    it.bind(Role::Q, &f64s(&q));
    it.bind(Role::K, &f64s(&k));
    it.bind(Role::V, &f64s(&v));
    let o_in: Vec<f64> = if rounding {
        f64s(o)
            .into_iter()
            .map(|x| bf16::from_f64(x).to_f64())
            .collect()
    } else {
        f64s(o)
    };
    it.bind(Role::O, &o_in);
    it.bind(Role::Stats, &f64s(lse));
    it.bind(Role::DO, &f64s(&dout));
    it.run();
    for (role, want) in [(Role::DQ, &gr[0]), (Role::DK, &gr[1]), (Role::DV, &gr[2])] {
        let e = rel(&it.read_out(role, want.numel()), &f64s(want));
        assert!(e <= tol, "{tag}: backward {role:?} {e:.2e}");
    }
}

const CASES: [Case; 4] = [
    Case {
        b: 2,
        hq: 2,
        hkv: 2,
        t: 6,
        s: 6,
        d: 8,
        causal: true,
    },
    Case {
        b: 1,
        hq: 4,
        hkv: 2,
        t: 5,
        s: 7,
        d: 8,
        causal: false,
    },
    Case {
        b: 2,
        hq: 6,
        hkv: 2,
        t: 9,
        s: 4,
        d: 16,
        causal: true,
    },
    Case {
        b: 1,
        hq: 4,
        hkv: 1,
        t: 3,
        s: 8,
        d: 8,
        causal: true,
    },
];

#[test]
fn the_graphs_compute_attention_and_its_gradient() {
    for c in CASES {
        compare(c, false, 1e-5);
    }
}

#[test]
fn the_graphs_in_bf16_stay_near_attention() {
    for c in CASES {
        compare(c, true, 3e-2);
    }
}

#[test]
fn the_interpreter_tells_a_wrong_graph() {
    // K read without its transposed strides: the scores are no longer Q·Kᵀ
    let c = CASES[1];
    let bt = |shape: &[usize]| TensorType::new(DType::BF16, shape.to_vec());
    let (tq, tk, to) = (
        bt(&[c.b, c.hq, c.t, c.d]),
        bt(&[c.b, c.hkv, c.s, c.d]),
        bt(&[c.b, c.hq, c.t, c.d]),
    );
    let tl = TensorType::new(DType::F32, vec![c.b, c.hq, c.t]);
    let mut g = plan_sdpa(SdpaKind::Forward, &[&tq, &tk, &tk], &[&to, &tl], 0.5, false).unwrap();
    let k = g
        .tensors
        .iter_mut()
        .find(|t| t.uid == Role::K.uid())
        .unwrap();
    k.strides = vec![
        (c.hkv * c.s * c.d) as i64,
        (c.s * c.d) as i64,
        c.s as i64,
        1,
    ];
    let mut rng = Rng(7);
    let q = Tensor::f32(vec![c.b, c.hq, c.t, c.d], rng.vec(c.b * c.hq * c.t * c.d));
    let kk = Tensor::f32(vec![c.b, c.hkv, c.s, c.d], rng.vec(c.b * c.hkv * c.s * c.d));
    let out = eval_op(
        &Op::Attention {
            scale: 0.5,
            causal: false,
        },
        &[&q, &kk, &kk],
    )
    .unwrap();
    let mut it = Interp {
        g: &g,
        rounding: false,
        vals: HashMap::new(),
    };
    it.bind(Role::Q, &f64s(&q));
    it.bind(Role::K, &f64s(&kk));
    it.bind(Role::V, &f64s(&kk));
    it.run();
    assert!(rel(&it.read_out(Role::O, out[0].numel()), &f64s(&out[0])) > 1e-3);
}
