//! Op translations on small hand-built models: structure (folding, desugaring, parameter
//! classification) and numerics against values computed here from the ONNX op semantics.

mod onnx_util;

use hzp_frontends::onnx::proto::{AttributeProto, StringStringEntryProto};
use hzp_frontends::onnx::{import_bytes, ImportErrorKind, ImportOptions};
use hzp_ir::{DType, Data, Op, Program, Tensor, ValueDef};
use onnx_util::*;
use prost::Message;

fn elem(t: &Tensor) -> i32 {
    match t.dtype() {
        DType::F32 => FLOAT,
        DType::I64 => INT64,
        DType::Bool => BOOL,
        DType::I32 => 6,
        DType::F16 => 10,
        DType::BF16 => 16,
    }
}

/// An input of a single-node model: a graph input (fed at run time) or an initializer.
enum In<'a> {
    Run(&'a str, Tensor),
    Init(&'a str, Tensor),
    None,
}

fn dims(t: &Tensor) -> Vec<D> {
    t.shape.iter().map(|&d| D::V(d as i64)).collect()
}

/// Builds a one-node model, imports it, evaluates it; returns the program and the outputs.
fn one_node(
    op: &str,
    ins: Vec<In>,
    attrs: Vec<AttributeProto>,
    n_out: usize,
) -> (Program, Vec<Tensor>) {
    let mut m = M::new();
    let mut names = Vec::new();
    let mut feed = Vec::new();
    for i in ins {
        match i {
            In::Run(n, t) => {
                m.inputs.push(vi(n, elem(&t), &dims(&t)));
                names.push(n.to_string());
                feed.push((n, t));
            }
            In::Init(n, t) => {
                m.inits.push(init(n, &t));
                names.push(n.to_string());
            }
            In::None => names.push(String::new()),
        }
    }
    let outs: Vec<String> = (0..n_out).map(|k| format!("out{k}")).collect();
    let ins_ref: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    let outs_ref: Vec<&str> = outs.iter().map(|s| s.as_str()).collect();
    m.nodes
        .push(node(op, &format!("the_{op}"), &ins_ref, &outs_ref, attrs));
    for o in &outs {
        m.outputs.push(out(o));
    }
    let p = m.import(&[]).unwrap_or_else(|e| panic!("{e}"));
    let res = run(&p, &feed);
    let tensors = outs
        .iter()
        .map(|o| res.iter().find(|(n, _)| n == o).unwrap().1.clone())
        .collect();
    (p, tensors)
}

fn arange(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::f32(
        shape.to_vec(),
        (0..n).map(|i| i as f32 * 0.25 - 1.0).collect(),
    )
}

fn close(a: &Tensor, b: &Tensor) {
    assert_eq!(a.shape, b.shape);
    assert_eq!(a.dtype(), b.dtype());
    for (x, y) in a.to_f64_vec().iter().zip(b.to_f64_vec()) {
        assert!(
            *x == y || (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
            "{:?} vs {:?}",
            a,
            b
        );
    }
}

fn i64s(shape: &[usize], v: &[i64]) -> Tensor {
    Tensor::i64(shape.to_vec(), v.to_vec())
}

#[test]
fn shape_arithmetic_folds_into_one_static_reshape() {
    let mut m = M::new();
    m.inputs
        .push(vi("x", FLOAT, &[D::P("b"), D::V(3), D::V(4)]));
    m.inits.push(init("zero", &Tensor::scalar_i64(0)));
    m.inits.push(init("axes0", &i64s(&[1], &[0])));
    m.inits.push(init("minus1", &i64s(&[1], &[-1])));
    m.nodes.push(node("Shape", "shape", &["x"], &["s"], vec![]));
    m.nodes.push(node(
        "Gather",
        "gather",
        &["s", "zero"],
        &["g"],
        vec![a_i("axis", 0)],
    ));
    m.nodes
        .push(node("Unsqueeze", "unsq", &["g", "axes0"], &["u"], vec![]));
    m.nodes.push(node(
        "Concat",
        "concat",
        &["u", "minus1"],
        &["c"],
        vec![a_i("axis", 0)],
    ));
    m.nodes
        .push(node("Reshape", "/h.0/Reshape", &["x", "c"], &["y"], vec![]));
    m.outputs.push(out("y"));
    for b in [2usize, 5] {
        let p = m.import(&[("x", &[b, 3, 4])]).unwrap();
        assert_eq!(p.nodes.len(), 1, "{:?}", p.nodes);
        assert_eq!(p.nodes[0].op, Op::Reshape { shape: vec![b, 12] });
        assert_eq!(p.nodes[0].name, "/h.0/Reshape");
        assert!(p.consts.is_empty() && p.params.is_empty());
        let x = arange(&[b, 3, 4]);
        let y = &run(&p, &[("x", x.clone())])[0];
        assert_eq!(y.0, "y");
        close(&y.1, &x.clone().reshaped(vec![b, 12]));
    }
}

#[test]
fn gemm_desugars_with_transposes_alpha_and_beta() {
    let a = arange(&[2, 3]);
    let b = arange(&[4, 3]); // transB
    let c = Tensor::f32(vec![4], vec![1.0, -2.0, 0.5, 3.0]);
    let (p, res) = one_node(
        "Gemm",
        vec![
            In::Run("a", a.clone()),
            In::Init("b", b.clone()),
            In::Init("c", c.clone()),
        ],
        vec![a_i("transB", 1), a_f("alpha", 0.5), a_f("beta", 2.0)],
        1,
    );
    let (av, bv, cv) = (a.to_f32_vec(), b.to_f32_vec(), c.to_f32_vec());
    let mut want = vec![0f32; 8];
    for i in 0..2 {
        for j in 0..4 {
            let dot: f32 = (0..3).map(|k| av[i * 3 + k] * bv[j * 3 + k]).sum();
            want[i * 4 + j] = 0.5 * dot + 2.0 * cv[j];
        }
    }
    close(&res[0], &Tensor::f32(vec![2, 4], want));
    // b and c are trainable; the transpose of b is a run-time op (b must stay a parameter).
    let names: Vec<&str> = p
        .params
        .iter()
        .map(|q| p.value(q.value).name.as_str())
        .collect();
    assert_eq!(names, vec!["b", "c"]);
    assert!(p.nodes.iter().any(|n| matches!(n.op, Op::Transpose { .. })));
}

#[test]
fn slice_clamps_and_negative_steps() {
    let x = arange(&[4, 6]);
    let (_, res) = one_node(
        "Slice",
        vec![
            In::Run("x", x.clone()),
            In::Init("st", i64s(&[2], &[-1, 1])),
            In::Init("en", i64s(&[2], &[i64::MIN, 100])),
            In::Init("ax", i64s(&[2], &[-1, 0])),
            In::Init("sp", i64s(&[2], &[-2, 1])),
        ],
        vec![],
        1,
    );
    // rows 1..4, columns 5, 3, 1
    let xv = x.to_f32_vec();
    let mut want = vec![];
    for r in 1..4 {
        for c in [5, 3, 1] {
            want.push(xv[r * 6 + c]);
        }
    }
    close(&res[0], &Tensor::f32(vec![3, 3], want));
}

#[test]
fn split_by_num_outputs_and_by_sizes() {
    let x = arange(&[5, 2]);
    let (_, res) = one_node(
        "Split",
        vec![In::Run("x", x.clone())],
        vec![a_i("num_outputs", 3)],
        3,
    );
    let shapes: Vec<Vec<usize>> = res.iter().map(|t| t.shape.clone()).collect();
    assert_eq!(shapes, vec![vec![2, 2], vec![2, 2], vec![1, 2]]);
    assert_eq!(res[2].to_f32_vec(), x.to_f32_vec()[8..].to_vec());
    let (_, res) = one_node(
        "Split",
        vec![
            In::Run("x", x.clone()),
            In::Init("sizes", i64s(&[2], &[1, 1])),
        ],
        vec![a_i("axis", -1)],
        2,
    );
    let xv = x.to_f32_vec();
    assert_eq!(
        res[1].to_f32_vec(),
        (0..5).map(|r| xv[r * 2 + 1]).collect::<Vec<_>>()
    );
}

#[test]
fn squeeze_unsqueeze_flatten_are_reshapes() {
    let x = arange(&[1, 3, 1, 2]);
    let (p, res) = one_node("Squeeze", vec![In::Run("x", x.clone())], vec![], 1);
    assert_eq!(res[0].shape, vec![3, 2]);
    assert!(matches!(p.nodes[0].op, Op::Reshape { .. }));
    let (_, res) = one_node(
        "Squeeze",
        vec![In::Run("x", x.clone()), In::Init("a", i64s(&[1], &[-2]))],
        vec![],
        1,
    );
    assert_eq!(res[0].shape, vec![1, 3, 2]);
    let (_, res) = one_node(
        "Unsqueeze",
        vec![In::Run("x", x.clone()), In::Init("a", i64s(&[2], &[-1, 0]))],
        vec![],
        1,
    );
    assert_eq!(res[0].shape, vec![1, 1, 3, 1, 2, 1]);
    let (_, res) = one_node(
        "Flatten",
        vec![In::Run("x", x.clone())],
        vec![a_i("axis", -1)],
        1,
    );
    assert_eq!(res[0].shape, vec![3, 2]);
    assert_eq!(res[0].to_f32_vec(), x.to_f32_vec());
    let (_, res) = one_node("Flatten", vec![In::Run("x", x)], vec![a_i("axis", 0)], 1);
    assert_eq!(res[0].shape, vec![1, 6]);
}

#[test]
fn reductions() {
    let x = arange(&[2, 3, 4]);
    let xv = x.to_f32_vec();
    let (_, res) = one_node(
        "ReduceSum",
        vec![In::Run("x", x.clone()), In::Init("a", i64s(&[2], &[-1, 0]))],
        vec![a_i("keepdims", 0)],
        1,
    );
    let want: Vec<f32> = (0..3)
        .map(|j| {
            (0..2)
                .flat_map(|i| (0..4).map(move |k| (i, k)))
                .map(|(i, k)| xv[i * 12 + j * 4 + k])
                .sum()
        })
        .collect();
    close(&res[0], &Tensor::f32(vec![3], want));
    // Before opset 18 ReduceMean takes axes as an attribute.
    let mut m = M::new();
    m.opset = 13;
    m.inputs.push(vi("x", FLOAT, &[D::V(2), D::V(3), D::V(4)]));
    m.nodes.push(node(
        "ReduceMean",
        "rm",
        &["x"],
        &["y"],
        vec![a_ints("axes", &[1])],
    ));
    m.outputs.push(out("y"));
    let p = m.import(&[]).unwrap();
    let y = &run(&p, &[("x", x.clone())])[0].1;
    let want: Vec<f32> = (0..2)
        .flat_map(|i| (0..4).map(move |k| (i, k)))
        .map(|(i, k)| (0..3).map(|j| xv[i * 12 + j * 4 + k]).sum::<f32>() / 3.0)
        .collect();
    close(y, &Tensor::f32(vec![2, 1, 4], want));
    // No axes: all axes, or nothing with noop_with_empty_axes.
    let (_, res) = one_node("ReduceMax", vec![In::Run("x", x.clone())], vec![], 1);
    close(
        &res[0],
        &Tensor::f32(
            vec![1, 1, 1],
            vec![xv.iter().cloned().fold(f32::MIN, f32::max)],
        ),
    );
    let (p, res) = one_node(
        "ReduceMax",
        vec![In::Run("x", x.clone())],
        vec![a_i("noop_with_empty_axes", 1)],
        1,
    );
    close(&res[0], &x);
    assert!(p.nodes.iter().all(|n| n.op == Op::Identity));
}

#[test]
fn variadic_mean_max_sum() {
    let a = arange(&[2, 3]);
    let b = Tensor::f32(vec![3], vec![0.0, 10.0, -10.0]);
    let c = Tensor::f32(vec![2, 1], vec![1.0, -1.0]);
    let get = |op: &str| {
        one_node(
            op,
            vec![
                In::Run("a", a.clone()),
                In::Run("b", b.clone()),
                In::Run("c", c.clone()),
            ],
            vec![],
            1,
        )
        .1[0]
            .clone()
    };
    let (av, bv, cv) = (a.to_f32_vec(), b.to_f32_vec(), c.to_f32_vec());
    let f = |g: &dyn Fn(f32, f32, f32) -> f32| {
        Tensor::f32(
            vec![2, 3],
            (0..6).map(|i| g(av[i], bv[i % 3], cv[i / 3])).collect(),
        )
    };
    close(&get("Sum"), &f(&|x, y, z| x + y + z));
    close(&get("Mean"), &f(&|x, y, z| (x + y + z) / 3.0));
    close(&get("Max"), &f(&|x, y, z| x.max(y).max(z)));
    close(&get("Min"), &f(&|x, y, z| x.min(y).min(z)));
}

#[test]
fn clip_argmin_pow_cast() {
    let x = arange(&[2, 4]);
    let xv = x.to_f32_vec();
    let (_, res) = one_node(
        "Clip",
        vec![
            In::Run("x", x.clone()),
            In::Init("lo", Tensor::scalar_f32(-0.5)),
            In::Init("hi", Tensor::scalar_f32(0.25)),
        ],
        vec![],
        1,
    );
    close(
        &res[0],
        &Tensor::f32(vec![2, 4], xv.iter().map(|v| v.clamp(-0.5, 0.25)).collect()),
    );
    let (_, res) = one_node(
        "Clip",
        vec![
            In::Run("x", x.clone()),
            In::None,
            In::Init("hi", Tensor::scalar_f32(0.0)),
        ],
        vec![],
        1,
    );
    close(
        &res[0],
        &Tensor::f32(vec![2, 4], xv.iter().map(|v| v.min(0.0)).collect()),
    );
    let y = Tensor::f32(vec![2, 3], vec![3.0, 1.0, 1.0, -2.0, 5.0, -2.0]);
    let (_, res) = one_node(
        "ArgMin",
        vec![In::Run("y", y)],
        vec![a_i("axis", 1), a_i("keepdims", 0)],
        1,
    );
    assert_eq!(res[0], i64s(&[2], &[1, 0]));
    let (_, res) = one_node(
        "Pow",
        vec![
            In::Run("x", x.clone()),
            In::Init("e", Tensor::scalar_i64(2)),
        ],
        vec![],
        1,
    );
    close(
        &res[0],
        &Tensor::f32(vec![2, 4], xv.iter().map(|v| v * v).collect()),
    );
    // DOUBLE is computed as f32; UINT8 has no hzp type.
    let (_, res) = one_node(
        "Cast",
        vec![In::Run("x", x.clone())],
        vec![a_i("to", 11)],
        1,
    );
    close(&res[0], &x);
    let (_, res) = one_node("Cast", vec![In::Run("x", x.clone())], vec![a_i("to", 7)], 1);
    assert_eq!(
        res[0].to_i64_vec().unwrap(),
        xv.iter().map(|&v| v as i64).collect::<Vec<_>>()
    );
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(2)]));
    m.nodes
        .push(node("Cast", "c8", &["x"], &["y"], vec![a_i("to", 2)]));
    m.outputs.push(out("y"));
    let e = m.import(&[]).unwrap_err();
    assert_eq!(e.kind, ImportErrorKind::Unsupported);
    assert!(e.message.contains("Cast `c8`: casting to UINT8"), "{e}");
}

#[test]
fn einsum_matmul_like() {
    let a = arange(&[2, 3, 4]);
    let b = arange(&[2, 5, 4]);
    let (_, res) = one_node(
        "Einsum",
        vec![In::Run("a", a.clone()), In::Run("b", b.clone())],
        vec![a_s("equation", "bij,bkj->bki")],
        1,
    );
    let (av, bv) = (a.to_f32_vec(), b.to_f32_vec());
    let mut want = vec![0f32; 2 * 5 * 3];
    for bb in 0..2 {
        for k in 0..5 {
            for i in 0..3 {
                want[bb * 15 + k * 3 + i] = (0..4)
                    .map(|j| av[bb * 12 + i * 4 + j] * bv[bb * 20 + k * 4 + j])
                    .sum();
            }
        }
    }
    close(&res[0], &Tensor::f32(vec![2, 5, 3], want));
    let mut m = M::new();
    m.inputs.push(vi("a", FLOAT, &[D::V(2), D::V(2)]));
    m.nodes.push(node(
        "Einsum",
        "e",
        &["a"],
        &["y"],
        vec![a_s("equation", "ii->i")],
    ));
    m.outputs.push(out("y"));
    let e = m.import(&[]).unwrap_err();
    assert!(e.message.contains("`ii->i` is not supported"), "{e}");
}

#[test]
fn creation_ops_fold() {
    // y = x + Range(0, 1.5, 0.5) + ConstantOfShape([3], 2) + Constant(value_floats)
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(3)]));
    m.inits.push(init("s", &Tensor::scalar_f32(0.0)));
    m.inits.push(init("l", &Tensor::scalar_f32(1.5)));
    m.inits.push(init("d", &Tensor::scalar_f32(0.5)));
    m.inits.push(init("shape", &i64s(&[1], &[3])));
    m.nodes
        .push(node("Range", "range", &["s", "l", "d"], &["r"], vec![]));
    m.nodes.push(node(
        "ConstantOfShape",
        "cos",
        &["shape"],
        &["k"],
        vec![a_t("value", init("", &Tensor::f32(vec![1], vec![2.0])))],
    ));
    m.nodes.push(node(
        "Constant",
        "c",
        &[],
        &["cf"],
        vec![AttributeProto {
            name: "value_floats".into(),
            floats: vec![10.0, 20.0, 30.0],
            r#type: 6,
            ..Default::default()
        }],
    ));
    m.nodes
        .push(node("Add", "a1", &["r", "k"], &["rk"], vec![]));
    m.nodes
        .push(node("Add", "a2", &["rk", "cf"], &["rkc"], vec![]));
    m.nodes
        .push(node("Add", "a3", &["x", "rkc"], &["y"], vec![]));
    m.outputs.push(out("y"));
    let p = m.import(&[]).unwrap();
    assert_eq!(p.nodes.len(), 1);
    assert!(
        p.params.is_empty(),
        "scalar literals and folded values are constants"
    );
    assert_eq!(p.consts.len(), 1);
    assert_eq!(
        p.consts[0].data,
        Tensor::f32(vec![3], vec![12.0, 22.5, 33.0])
    );
    let y = &run(&p, &[("x", Tensor::f32(vec![3], vec![1.0, 1.0, 1.0]))])[0].1;
    close(y, &Tensor::f32(vec![3], vec![13.0, 23.5, 34.0]));
    // Integer ranges count like ONNX: ceil((limit - start) / delta).
    let (_, res) = one_node(
        "Range",
        vec![
            In::Init("s", Tensor::scalar_i64(10)),
            In::Init("l", Tensor::scalar_i64(3)),
            In::Init("d", Tensor::scalar_i64(-3)),
        ],
        vec![],
        1,
    );
    assert_eq!(res[0], i64s(&[3], &[10, 7, 4]));
}

#[test]
fn indexing_ops() {
    let x = arange(&[3, 4]);
    let xv = x.to_f32_vec();
    let (_, res) = one_node(
        "Gather",
        vec![In::Run("x", x.clone()), In::Init("i", i64s(&[2], &[-1, 0]))],
        vec![a_i("axis", 1)],
        1,
    );
    close(
        &res[0],
        &Tensor::f32(
            vec![3, 2],
            (0..3).flat_map(|r| [xv[r * 4 + 3], xv[r * 4]]).collect(),
        ),
    );
    let (_, res) = one_node(
        "TopK",
        vec![
            In::Run("x", Tensor::f32(vec![1, 5], vec![1.0, 5.0, 3.0, 4.0, 2.0])),
            In::Init("k", i64s(&[1], &[2])),
        ],
        vec![],
        2,
    );
    close(&res[0], &Tensor::f32(vec![1, 2], vec![5.0, 4.0]));
    assert_eq!(res[1], i64s(&[1, 2], &[1, 3]));
    let (_, res) = one_node(
        "OneHot",
        vec![
            In::Run("i", i64s(&[3], &[0, 2, -1])),
            In::Init("depth", Tensor::scalar_i64(3)),
            In::Init("v", Tensor::f32(vec![2], vec![0.0, 1.0])),
        ],
        vec![a_i("axis", 0)],
        1,
    );
    close(
        &res[0],
        &Tensor::f32(
            vec![3, 3],
            vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0],
        ),
    );
    let (_, res) = one_node(
        "ScatterElements",
        vec![
            In::Run("x", x.clone()),
            In::Init("i", i64s(&[1, 2], &[1, 1])),
            In::Init("u", Tensor::f32(vec![1, 2], vec![10.0, 20.0])),
        ],
        vec![a_i("axis", 1), a_s("reduction", "add")],
        1,
    );
    let mut want = xv.clone();
    want[1] += 30.0;
    close(&res[0], &Tensor::f32(vec![3, 4], want));
    let (_, res) = one_node(
        "Trilu",
        vec![
            In::Run("x", x.clone()),
            In::Init("k", Tensor::scalar_i64(1)),
        ],
        vec![a_i("upper", 0)],
        1,
    );
    let want: Vec<f32> = (0..12)
        .map(|i| {
            if (i % 4) as i64 - (i / 4) as i64 <= 1 {
                xv[i]
            } else {
                0.0
            }
        })
        .collect();
    close(&res[0], &Tensor::f32(vec![3, 4], want));
    let (_, res) = one_node(
        "CumSum",
        vec![
            In::Run("x", x.clone()),
            In::Init("a", Tensor::scalar_i64(0)),
        ],
        vec![a_i("reverse", 1)],
        1,
    );
    let want: Vec<f32> = (0..12)
        .map(|i| (i / 4..3).map(|r| xv[r * 4 + i % 4]).sum())
        .collect();
    close(&res[0], &Tensor::f32(vec![3, 4], want));
    let (_, res) = one_node(
        "Expand",
        vec![
            In::Run("x", Tensor::f32(vec![3, 1], vec![1.0, 2.0, 3.0])),
            In::Init("s", i64s(&[3], &[2, 1, 2])),
        ],
        vec![],
        1,
    );
    close(
        &res[0],
        &Tensor::f32(
            vec![2, 3, 2],
            vec![1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0],
        ),
    );
    let (_, res) = one_node(
        "Tile",
        vec![
            In::Run("x", Tensor::f32(vec![2], vec![1.0, 2.0])),
            In::Init("r", i64s(&[1], &[3])),
        ],
        vec![],
        1,
    );
    close(
        &res[0],
        &Tensor::f32(vec![6], vec![1.0, 2.0, 1.0, 2.0, 1.0, 2.0]),
    );
}

#[test]
fn outputs_keep_their_names() {
    // y = Identity(x) (an alias), x itself is an output, and z = Identity(w) of a constant.
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(2)]));
    m.inits.push(init("w", &Tensor::scalar_f32(3.0)));
    m.nodes.push(node("Identity", "id", &["x"], &["y"], vec![]));
    m.nodes
        .push(node("Identity", "idw", &["w"], &["z"], vec![]));
    m.outputs = vec![out("y"), out("x"), out("z")];
    let p = m.import(&[]).unwrap();
    let names: Vec<&str> = p
        .outputs
        .iter()
        .map(|&o| p.value(o).name.as_str())
        .collect();
    assert_eq!(names, vec!["y", "x", "z"]);
    let r = run(&p, &[("x", Tensor::f32(vec![2], vec![1.0, 2.0]))]);
    assert_eq!(r[0].1, Tensor::f32(vec![2], vec![1.0, 2.0]));
    assert_eq!(r[2].1, Tensor::scalar_f32(3.0));
}

#[test]
fn which_initializers_are_parameters() {
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(2), D::V(4)]));
    // weight: meets the input -> parameter
    m.inits.push(init("weight", &arange(&[4, 4])));
    // scalar literal -> constant
    m.inits.push(init("half", &Tensor::scalar_f32(0.5)));
    // float used only to compute a reshape target -> constant
    m.inits
        .push(init("dims_f", &Tensor::f32(vec![2], vec![4.0, 2.0])));
    // float buffer named by the exporter's graph signature -> constant
    m.inits.push(init(
        "rope.inv_freq",
        &Tensor::f32(vec![4], vec![1.0, 0.1, 0.01, 0.001]),
    ));
    // float initializer nothing reads -> dropped
    m.inits.push(init("unused", &arange(&[3])));
    // integer initializer -> constant
    m.inits.push(init("perm_i", &i64s(&[1], &[1])));
    m.nodes
        .push(node("MatMul", "mm", &["x", "weight"], &["h"], vec![]));
    m.nodes
        .push(node("Mul", "mul", &["h", "half"], &["h2"], vec![]));
    m.nodes.push(node(
        "Mul",
        "rope",
        &["h2", "rope.inv_freq"],
        &["h3"],
        vec![],
    ));
    m.nodes.push(node(
        "Cast",
        "cast",
        &["dims_f"],
        &["dims"],
        vec![a_i("to", 7)],
    ));
    m.nodes
        .push(node("Reshape", "rs", &["h3", "dims"], &["y"], vec![]));
    m.outputs.push(out("y"));
    let mut proto = m.proto();
    proto.graph.as_mut().unwrap().metadata_props.push(StringStringEntryProto {
        key: "pkg.torch.export.ExportedProgram.graph_signature".into(),
        value: "# inputs\np_weight: PARAMETER target='weight'\nb_rope_inv_freq: BUFFER target='rope.inv_freq' persistent=False\nx: USER_INPUT\n".into(),
    });
    let p = import_bytes(
        &proto.encode_to_vec(),
        None,
        "t.onnx",
        &ImportOptions::default(),
    )
    .unwrap();
    let params: Vec<&str> = p
        .params
        .iter()
        .map(|q| p.value(q.value).name.as_str())
        .collect();
    assert_eq!(params, vec!["weight"]);
    let consts: Vec<&str> = p
        .consts
        .iter()
        .map(|c| p.value(c.value).name.as_str())
        .collect();
    assert_eq!(consts, vec!["half", "rope.inv_freq"]);
    assert_eq!(p.ty(p.outputs[0]).shape, vec![4, 2]);
    // Without the signature the buffer is trained like any float weight.
    let p = m.import(&[]).unwrap();
    let params: Vec<&str> = p
        .params
        .iter()
        .map(|q| p.value(q.value).name.as_str())
        .collect();
    assert_eq!(params, vec!["weight", "rope.inv_freq"]);
    // Graph inputs that are also initializers (old exporters) are initializers.
    let mut m2 = M::new();
    m2.inputs.push(vi("x", FLOAT, &[D::V(4)]));
    m2.inputs.push(vi("b", FLOAT, &[D::V(4)]));
    m2.inits.push(init("b", &arange(&[4])));
    m2.nodes
        .push(node("Add", "add", &["x", "b"], &["y"], vec![]));
    m2.outputs.push(out("y"));
    let p = m2.import(&[]).unwrap();
    assert_eq!(p.inputs.len(), 1);
    assert_eq!(p.params.len(), 1);
    assert!(matches!(p.value(p.params[0].value).def, ValueDef::Param));
}

#[test]
fn typed_tensor_fields_and_narrow_types() {
    // float_data / int64_data instead of raw_data; UINT8 data widened to i32.
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(2)]));
    let mut w = init("w", &Tensor::f32(vec![2], vec![0.0, 0.0]));
    w.raw_data.clear();
    w.float_data = vec![1.5, -2.0];
    m.inits.push(w);
    let mut idx = init("idx", &i64s(&[1], &[0]));
    idx.raw_data.clear();
    idx.int64_data = vec![1];
    m.inits.push(idx);
    let mut u8t = init("u8", &Tensor::new(vec![2], Data::Bool(vec![false, false])));
    u8t.data_type = 2;
    u8t.raw_data = vec![200, 7];
    m.inits.push(u8t);
    m.nodes
        .push(node("Add", "add", &["x", "w"], &["s"], vec![]));
    m.nodes
        .push(node("Gather", "g", &["s", "idx"], &["y"], vec![]));
    m.nodes.push(node("Identity", "i", &["u8"], &["z"], vec![]));
    m.outputs = vec![out("y"), out("z")];
    let p = m.import(&[]).unwrap();
    let r = run(&p, &[("x", Tensor::f32(vec![2], vec![1.0, 1.0]))]);
    close(&r[0].1, &Tensor::f32(vec![1], vec![-1.0]));
    assert_eq!(r[1].1, Tensor::new(vec![2], Data::I32(vec![200, 7])));
}

fn map(x: &Tensor, f: impl Fn(f32) -> f32) -> Tensor {
    Tensor::f32(x.shape.clone(), x.to_f32_vec().into_iter().map(f).collect())
}

#[test]
fn activations_by_formula() {
    let x = Tensor::f32(
        vec![2, 4],
        vec![-3.0, -1.0, -0.25, 0.0, 0.5, 1.0, 2.5, 40.0],
    );
    let run1 = |op: &str, attrs: Vec<AttributeProto>| {
        one_node(op, vec![In::Run("x", x.clone())], attrs, 1)
            .1
            .remove(0)
    };
    close(
        &run1("LeakyRelu", vec![a_f("alpha", 0.1)]),
        &map(&x, |v| if v < 0.0 { 0.1 * v } else { v }),
    );
    close(
        &run1("Elu", vec![]),
        &map(&x, |v| if v > 0.0 { v } else { v.exp() - 1.0 }),
    );
    close(
        &run1("Celu", vec![a_f("alpha", 2.0)]),
        &map(&x, |v| {
            v.max(0.0) + (2.0 * ((v / 2.0).exp() - 1.0)).min(0.0)
        }),
    );
    let (a, g) = (1.673_263_2f32, 1.050_701f32);
    close(
        &run1("Selu", vec![]),
        &map(&x, |v| g * if v > 0.0 { v } else { a * (v.exp() - 1.0) }),
    );
    close(
        &run1("HardSigmoid", vec![a_f("alpha", 0.5)]),
        &map(&x, |v| (0.5 * v + 0.5).clamp(0.0, 1.0)),
    );
    close(
        &run1("HardSwish", vec![]),
        &map(&x, |v| v * (v / 6.0 + 0.5).clamp(0.0, 1.0)),
    );
    let softplus = |v: f32| if v > 20.0 { v } else { (1.0 + v.exp()).ln() };
    close(&run1("Softplus", vec![]), &map(&x, softplus));
    close(&run1("Mish", vec![]), &map(&x, |v| v * softplus(v).tanh()));
    close(&run1("Softsign", vec![]), &map(&x, |v| v / (1.0 + v.abs())));
    close(
        &run1("ThresholdedRelu", vec![a_f("alpha", 0.5)]),
        &map(&x, |v| if v > 0.5 { v } else { 0.0 }),
    );
    let slope = Tensor::f32(vec![4], vec![0.1, 0.2, 0.3, 0.4]);
    let (_, res) = one_node(
        "PRelu",
        vec![In::Run("x", x.clone()), In::Init("slope", slope.clone())],
        vec![],
        1,
    );
    let sv = slope.to_f32_vec();
    let want: Vec<f32> = x
        .to_f32_vec()
        .iter()
        .enumerate()
        .map(|(i, &v)| if v < 0.0 { v * sv[i % 4] } else { v })
        .collect();
    close(&res[0], &Tensor::f32(vec![2, 4], want));
    let y = Tensor::f32(
        vec![4],
        vec![f32::INFINITY, -1.0, f32::NEG_INFINITY, f32::NAN],
    );
    let (_, res) = one_node("IsInf", vec![In::Run("y", y.clone())], vec![], 1);
    assert_eq!(
        res[0],
        Tensor::new(vec![4], Data::Bool(vec![true, false, true, false]))
    );
    let (_, res) = one_node(
        "IsInf",
        vec![In::Run("y", y)],
        vec![a_i("detect_positive", 0)],
        1,
    );
    assert_eq!(
        res[0],
        Tensor::new(vec![4], Data::Bool(vec![false, false, true, false]))
    );
}

#[test]
fn mod_in_both_sign_conventions() {
    let a = Tensor::f32(vec![6], vec![5.5, -5.5, 5.5, -5.5, 3.0, -4.0]);
    let b = Tensor::f32(
        vec![6],
        vec![2.0, 2.0, -2.0, -2.0, f32::INFINITY, f32::INFINITY],
    );
    let ins = || vec![In::Run("a", a.clone()), In::Run("b", b.clone())];
    // fmod=1: C fmod, the dividend's sign; fmod=0 on floats: the divisor's sign (numpy mod).
    let (_, r) = one_node("Mod", ins(), vec![a_i("fmod", 1)], 1);
    close(
        &r[0],
        &Tensor::f32(vec![6], vec![1.5, -1.5, 1.5, -1.5, 3.0, -4.0]),
    );
    let (_, r) = one_node("Mod", ins(), vec![], 1);
    close(
        &r[0],
        &Tensor::f32(vec![6], vec![1.5, 0.5, -0.5, -1.5, 3.0, f32::INFINITY]),
    );
    let ai = i64s(&[4], &[7, -7, 7, -7]);
    let bi = i64s(&[4], &[3, 3, -3, -3]);
    let ins = || vec![In::Run("a", ai.clone()), In::Run("b", bi.clone())];
    let (_, r) = one_node("Mod", ins(), vec![], 1);
    assert_eq!(r[0], i64s(&[4], &[1, 2, -2, -1]));
    let (_, r) = one_node("Mod", ins(), vec![a_i("fmod", 1)], 1);
    assert_eq!(r[0], i64s(&[4], &[1, -1, 1, -1]));
}

#[test]
fn reduce_formulas() {
    let x = Tensor::f32(vec![2, 3], vec![1.0, -2.0, 3.0, 0.5, 4.0, -1.0]);
    let xv = x.to_f32_vec();
    let rows = |f: &dyn Fn(&[f32]) -> f32| Tensor::f32(vec![2], vec![f(&xv[..3]), f(&xv[3..])]);
    let ax = || In::Init("axes", i64s(&[1], &[1]));
    let get = |op: &str| {
        one_node(
            op,
            vec![In::Run("x", x.clone()), ax()],
            vec![a_i("keepdims", 0)],
            1,
        )
        .1
        .remove(0)
    };
    close(
        &get("ReduceSumSquare"),
        &rows(&|r| r.iter().map(|v| v * v).sum()),
    );
    close(
        &get("ReduceL1"),
        &rows(&|r| r.iter().map(|v| v.abs()).sum()),
    );
    close(
        &get("ReduceL2"),
        &rows(&|r| r.iter().map(|v| v * v).sum::<f32>().sqrt()),
    );
    close(
        &get("ReduceLogSumExp"),
        &rows(&|r| r.iter().map(|v| v.exp()).sum::<f32>().ln()),
    );
    let big = Tensor::f32(vec![1, 2], vec![1000.0, 1000.0]);
    let (_, r) = one_node("ReduceLogSumExp", vec![In::Run("x", big)], vec![], 1);
    close(&r[0], &Tensor::f32(vec![1, 1], vec![1000.0 + 2f32.ln()]));
    let pos = map(&x, f32::abs);
    let (_, r) = one_node(
        "ReduceLogSum",
        vec![In::Run("x", pos.clone()), ax()],
        vec![],
        1,
    );
    let pv = pos.to_f32_vec();
    close(
        &r[0],
        &Tensor::f32(
            vec![2, 1],
            vec![
                pv[..3].iter().sum::<f32>().ln(),
                pv[3..].iter().sum::<f32>().ln(),
            ],
        ),
    );
}

#[test]
fn argmax_select_last_index() {
    let x = Tensor::f32(vec![2, 4], vec![1.0, 3.0, 3.0, 0.0, 2.0, 2.0, 1.0, 2.0]);
    let attrs = || {
        vec![
            a_i("axis", 1),
            a_i("keepdims", 0),
            a_i("select_last_index", 1),
        ]
    };
    let (_, r) = one_node("ArgMax", vec![In::Run("x", x.clone())], attrs(), 1);
    assert_eq!(r[0], i64s(&[2], &[2, 3]));
    let (_, r) = one_node("ArgMin", vec![In::Run("x", x.clone())], attrs(), 1);
    assert_eq!(r[0], i64s(&[2], &[3, 2]));
    let (_, r) = one_node("ArgMax", vec![In::Run("x", x)], vec![a_i("axis", 1)], 1);
    assert_eq!(r[0], i64s(&[2, 1], &[1, 0]));
}

#[test]
fn pad_constant_mode() {
    let x = arange(&[2, 3]);
    let xv = x.to_f32_vec();
    // rows: one before, none after; columns: crop one before, two after.
    let (_, r) = one_node(
        "Pad",
        vec![
            In::Run("x", x.clone()),
            In::Init("pads", i64s(&[4], &[1, -1, 0, 2])),
            In::Init("v", Tensor::scalar_f32(9.0)),
        ],
        vec![],
        1,
    );
    let mut want = vec![9.0; 4];
    for row in 0..2 {
        want.extend([xv[row * 3 + 1], xv[row * 3 + 2], 9.0, 9.0]);
    }
    close(&r[0], &Tensor::f32(vec![3, 4], want));
    let (_, r) = one_node(
        "Pad",
        vec![
            In::Run("x", x),
            In::Init("pads", i64s(&[2], &[0, 1])),
            In::None,
            In::Init("axes", i64s(&[1], &[-2])),
        ],
        vec![],
        1,
    );
    let mut want = xv.clone();
    want.extend([0.0; 3]);
    close(&r[0], &Tensor::f32(vec![3, 3], want));
}

#[test]
fn layer_norm_mean_and_inv_std_dev_outputs() {
    let x = Tensor::f32(vec![2, 3], vec![1.0, 2.0, 6.0, -1.0, 0.0, 4.0]);
    let g = Tensor::f32(vec![3], vec![1.0, 0.5, 2.0]);
    let (_, r) = one_node(
        "LayerNormalization",
        vec![In::Run("x", x.clone()), In::Init("g", g.clone())],
        vec![a_f("epsilon", 1e-3)],
        3,
    );
    let (xv, gv) = (x.to_f32_vec(), g.to_f32_vec());
    let (mut y, mut mean, mut inv) = (vec![], vec![], vec![]);
    for row in xv.chunks(3) {
        let m = row.iter().sum::<f32>() / 3.0;
        let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f32>() / 3.0;
        let is = 1.0 / (var + 1e-3).sqrt();
        y.extend(row.iter().zip(&gv).map(|(v, s)| (v - m) * is * s));
        mean.push(m);
        inv.push(is);
    }
    close(&r[0], &Tensor::f32(vec![2, 3], y));
    close(&r[1], &Tensor::f32(vec![2, 1], mean));
    close(&r[2], &Tensor::f32(vec![2, 1], inv));
}

#[test]
fn dropout_is_the_identity_with_an_all_true_mask() {
    let x = arange(&[2, 2]);
    let (_, r) = one_node(
        "Dropout",
        vec![
            In::Run("x", x.clone()),
            In::Init("ratio", Tensor::scalar_f32(0.5)),
        ],
        vec![],
        2,
    );
    close(&r[0], &x);
    assert_eq!(r[1], Tensor::new(vec![2, 2], Data::Bool(vec![true; 4])));
}

/// Training mode draws the mask as ONNX's reference does, numpy's
/// `RandomState(seed).uniform(0, 1, shape) >= ratio`: for seed 0 the draws are 0.5488,
/// 0.7152, 0.6028, 0.5449 (numpy 2.4), so ratio 0.6 keeps elements 1 and 2, scaled by 2.5.
#[test]
fn training_dropout_draws_numpys_mask_from_the_seed() {
    let x = Tensor::f32(vec![2, 2], vec![1.0, 2.0, 3.0, 4.0]);
    let train = Tensor::new(vec![], Data::Bool(vec![true]));
    let (p, r) = one_node(
        "Dropout",
        vec![
            In::Run("x", x.clone()),
            In::Init("ratio", Tensor::scalar_f32(0.6)),
            In::Init("train", train.clone()),
        ],
        vec![a_i("seed", 0)],
        2,
    );
    close(&r[0], &Tensor::f32(vec![2, 2], vec![0.0, 5.0, 7.5, 0.0]));
    assert_eq!(
        r[1],
        Tensor::new(vec![2, 2], Data::Bool(vec![false, true, true, false]))
    );
    // the same seed, the same mask: deterministic programs
    let (p2, _) = one_node(
        "Dropout",
        vec![
            In::Run("x", x.clone()),
            In::Init("ratio", Tensor::scalar_f32(0.6)),
            In::Init("train", train.clone()),
        ],
        vec![a_i("seed", 0)],
        2,
    );
    assert_eq!(hzp_ir::text::print(&p), hzp_ir::text::print(&p2));
    // without a seed: still a mask of 0s and 2.5s, drawn from the output name's hash
    let (_, r) = one_node(
        "Dropout",
        vec![
            In::Run("x", Tensor::f32(vec![64], vec![1.0; 64])),
            In::Init("ratio", Tensor::scalar_f32(0.6)),
            In::Init("train", train.clone()),
        ],
        vec![],
        1,
    );
    // (the scale is 1 / (1 - ratio) in f32, as numpy computes it for an f32 ratio)
    let scale = 1.0f32 / (1.0f32 - 0.6f32);
    let y = r[0].to_f32_vec();
    assert!(y.iter().all(|&v| v == 0.0 || v == scale), "{y:?}");
    assert!(y.contains(&0.0) && y.contains(&scale), "{y:?}");
    // a seed numpy's RandomState refuses, and a ratio outside [0, 1), are errors
    for (attrs, ratio, want) in [
        (
            vec![a_i("seed", -1)],
            0.5,
            "attribute `seed` must be in 0..=4294967295",
        ),
        (vec![], 1.0, "the ratio must be in [0, 1), got 1"),
    ] {
        let mut m = M::new();
        m.inputs.push(vi("x", FLOAT, &[D::V(2)]));
        m.inits.push(init("train", &train));
        m.inits.push(init("ratio", &Tensor::scalar_f32(ratio)));
        m.nodes.push(node(
            "Dropout",
            "d",
            &["x", "ratio", "train"],
            &["y"],
            attrs,
        ));
        m.outputs.push(out("y"));
        let e = m.import(&[]).unwrap_err();
        assert!(
            e.message.contains("Dropout `d`") && e.message.contains(want),
            "{e}"
        );
    }
}

#[test]
fn einsum_general_forms() {
    let a = arange(&[2, 3]);
    let b = arange(&[3]);
    let (av, bv) = (a.to_f32_vec(), b.to_f32_vec());
    let e1 = |eq: &str, x: &Tensor| {
        one_node(
            "Einsum",
            vec![In::Run("x", x.clone())],
            vec![a_s("equation", eq)],
            1,
        )
        .1
        .remove(0)
    };
    let e2 = |eq: &str, x: &Tensor, y: &Tensor| {
        one_node(
            "Einsum",
            vec![In::Run("x", x.clone()), In::Run("y", y.clone())],
            vec![a_s("equation", eq)],
            1,
        )
        .1
        .remove(0)
    };
    close(
        &e1("ij->ji", &a),
        &Tensor::f32(
            vec![3, 2],
            (0..6).map(|k| av[(k % 2) * 3 + k / 2]).collect(),
        ),
    );
    close(
        &e1("ij->i", &a),
        &Tensor::f32(vec![2], vec![av[..3].iter().sum(), av[3..].iter().sum()]),
    );
    close(&e1("ij", &a), &a);
    close(&e1("ij->", &a), &Tensor::f32(vec![], vec![av.iter().sum()]));
    // Outer product (RoPE-style), dot product, matrix-vector, implicit output, ellipsis.
    close(
        &e2("i,j->ij", &b, &b),
        &Tensor::f32(vec![3, 3], (0..9).map(|k| bv[k / 3] * bv[k % 3]).collect()),
    );
    close(
        &e2("i,i", &b, &b),
        &Tensor::f32(vec![], vec![bv.iter().map(|v| v * v).sum()]),
    );
    close(
        &e2("ij,j->i", &a, &b),
        &Tensor::f32(
            vec![2],
            (0..2)
                .map(|i| (0..3).map(|j| av[i * 3 + j] * bv[j]).sum())
                .collect(),
        ),
    );
    close(
        &e2("ij,jk", &a, &arange(&[3, 1])),
        &e2("ij,jk->ik", &a, &arange(&[3, 1])),
    );
    let c = arange(&[2, 2, 3]);
    let d = arange(&[2, 3, 4]);
    let bmm = e2("...ij,...jk->...ik", &c, &d);
    let (cv, dv) = (c.to_f32_vec(), d.to_f32_vec());
    let mut want = vec![0f32; 16];
    for z in 0..2 {
        for i in 0..2 {
            for k in 0..4 {
                want[z * 8 + i * 4 + k] = (0..3)
                    .map(|j| cv[z * 6 + i * 3 + j] * dv[z * 12 + j * 4 + k])
                    .sum();
            }
        }
    }
    close(&bmm, &Tensor::f32(vec![2, 2, 4], want));
}

#[test]
fn every_listed_op_type_is_translated() {
    // Each listed op gets past the unsupported-op check (it may still fail on the made-up
    // inputs, but not as Unsupported-op-type).
    let ops = hzp_frontends::onnx::supported_op_types();
    let mut sorted = ops.clone();
    sorted.sort_unstable();
    assert_eq!(ops, sorted);
    for op in ops {
        let mut m = M::new();
        m.inputs.push(vi("x", FLOAT, &[D::V(2), D::V(2)]));
        m.nodes.push(node(op, "n", &["x", "x"], &["y"], vec![]));
        m.outputs.push(out("y"));
        if let Err(e) = m.import(&[]) {
            assert!(!e.message.contains("hzp does not support"), "{op}: {e}");
        }
    }
}

#[test]
fn odd_inputs_to_every_op_never_panic() {
    let kinds: Vec<(i32, Vec<D>)> = vec![
        (FLOAT, vec![]),
        (FLOAT, vec![D::V(0), D::V(3)]),
        (INT64, vec![D::V(3)]),
        (BOOL, vec![D::V(1), D::V(2), D::V(1)]),
    ];
    for op in hzp_frontends::onnx::supported_op_types() {
        for (elem, dims) in &kinds {
            for arity in 0..4 {
                for as_init in [false, true] {
                    let mut m = M::new();
                    let dims: Vec<D> = dims
                        .iter()
                        .map(|d| match d {
                            D::V(v) => D::V(*v),
                            D::P(p) => D::P(p),
                        })
                        .collect();
                    if as_init {
                        let n: i64 = dims
                            .iter()
                            .map(|d| if let D::V(v) = d { *v } else { 1 })
                            .product();
                        let shape: Vec<usize> = dims
                            .iter()
                            .map(|d| if let D::V(v) = d { *v as usize } else { 1 })
                            .collect();
                        let t = match *elem {
                            FLOAT => Tensor::f32(shape, vec![0.5; n as usize]),
                            INT64 => Tensor::i64(shape, vec![1; n as usize]),
                            _ => Tensor::new(shape, Data::Bool(vec![true; n as usize])),
                        };
                        m.inits.push(init("x", &t));
                    } else {
                        m.inputs.push(vi("x", *elem, &dims));
                    }
                    let ins = vec!["x"; arity];
                    m.nodes.push(node(op, "n", &ins, &["y", "z"], vec![]));
                    m.outputs.push(out("y"));
                    let r = std::panic::catch_unwind(|| m.import(&[]));
                    assert!(r.is_ok(), "{op} panicked with {arity} inputs of {elem}");
                }
            }
        }
    }
}

/// Direct N-d convolution from the ONNX definition (for checking the im2col translation).
#[allow(clippy::too_many_arguments)]
fn conv_reference(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    strides: &[usize],
    dil: &[usize],
    pads: &[usize],
    group: usize,
    out_sp: &[usize],
) -> Tensor {
    let (xs, ws) = (&x.shape, &w.shape);
    let sp = xs.len() - 2;
    let (n, c, m) = (xs[0], xs[1], ws[0]);
    let (cg, mg) = (c / group, m / group);
    let (xv, wv) = (x.to_f32_vec(), w.to_f32_vec());
    let l: usize = out_sp.iter().product();
    let k: usize = ws[2..].iter().product();
    let mut out = vec![0f32; n * m * l];
    let unravel = |mut i: usize, dims: &[usize]| {
        let mut v = vec![0usize; dims.len()];
        for a in (0..dims.len()).rev() {
            v[a] = i % dims[a];
            i /= dims[a];
        }
        v
    };
    for ni in 0..n {
        for mi in 0..m {
            let gi = mi / mg;
            for li in 0..l {
                let o = unravel(li, out_sp);
                let mut acc = b.map_or(0.0, |b| b.to_f32_vec()[mi]);
                for ci in 0..cg {
                    for ki in 0..k {
                        let kk = unravel(ki, &ws[2..]);
                        let mut flat = ni * c + gi * cg + ci;
                        let mut inside = true;
                        for a in 0..sp {
                            let pos = (o[a] * strides[a] + kk[a] * dil[a]) as i64 - pads[a] as i64;
                            if pos < 0 || pos >= xs[2 + a] as i64 {
                                inside = false;
                            }
                            flat = flat * xs[2 + a] + pos.max(0) as usize;
                        }
                        if inside {
                            acc += xv[flat] * wv[(mi * cg + ci) * k + ki];
                        }
                    }
                }
                out[(ni * m + mi) * l + li] = acc;
            }
        }
    }
    let mut shape = vec![n, m];
    shape.extend(out_sp);
    Tensor::f32(shape, out)
}

/// (weight shape, attributes, strides, dilations, begin pads, group, output dims)
type ConvCase = (
    Vec<usize>,
    Vec<AttributeProto>,
    Vec<usize>,
    Vec<usize>,
    Vec<usize>,
    usize,
    Vec<usize>,
);

#[test]
fn conv_as_patches_times_weights() {
    let x2 = arange(&[2, 4, 7, 6]);
    let cases: Vec<ConvCase> = vec![
        // plain 3x3
        (
            vec![3, 4, 3, 3],
            vec![],
            vec![1, 1],
            vec![1, 1],
            vec![0, 0],
            1,
            vec![5, 4],
        ),
        // padded, strided, dilated, grouped
        (
            vec![4, 2, 3, 2],
            vec![
                a_ints("pads", &[1, 2, 2, 0]),
                a_ints("strides", &[2, 1]),
                a_ints("dilations", &[2, 1]),
                a_i("group", 2),
            ],
            vec![2, 1],
            vec![2, 1],
            vec![1, 2],
            2,
            vec![3, 7],
        ),
        // patch embedding: stride = kernel, the input cropped to whole patches
        (
            vec![5, 4, 2, 3],
            vec![a_ints("strides", &[2, 3]), a_ints("kernel_shape", &[2, 3])],
            vec![2, 3],
            vec![1, 1],
            vec![0, 0],
            1,
            vec![3, 2],
        ),
        // depthwise with SAME_UPPER padding and stride 2: pads (1, 0) and (1, 1)
        (
            vec![4, 1, 3, 3],
            vec![
                a_s("auto_pad", "SAME_UPPER"),
                a_ints("strides", &[2, 2]),
                a_i("group", 4),
            ],
            vec![2, 2],
            vec![1, 1],
            vec![1, 0],
            4,
            vec![4, 3],
        ),
    ];
    for (ws, attrs, strides, dil, pads, group, out_sp) in cases {
        let w = arange(&ws);
        let wv: Vec<f32> = w.to_f32_vec().iter().map(|v| v * 0.1).collect();
        let w = Tensor::f32(ws.clone(), wv);
        let b = Tensor::f32(vec![ws[0]], (0..ws[0]).map(|i| i as f32 - 1.5).collect());
        let (p, res) = one_node(
            "Conv",
            vec![
                In::Run("x", x2.clone()),
                In::Init("w", w.clone()),
                In::Init("b", b.clone()),
            ],
            attrs,
            1,
        );
        let want = conv_reference(&x2, &w, Some(&b), &strides, &dil, &pads, group, &out_sp);
        close(&res[0], &want);
        let names: Vec<&str> = p
            .params
            .iter()
            .map(|q| p.value(q.value).name.as_str())
            .collect();
        assert_eq!(names, vec!["w", "b"], "the weight and bias stay parameters");
    }
    // 1-D (Whisper-style), no bias, stride 2, pads 1
    let x1 = arange(&[1, 3, 9]);
    let w1 = Tensor::f32(
        vec![2, 3, 3],
        (0..18).map(|i| (i as f32 * 0.37).sin()).collect(),
    );
    let (_, res) = one_node(
        "Conv",
        vec![In::Run("x", x1.clone()), In::Init("w", w1.clone())],
        vec![a_ints("pads", &[1, 1]), a_ints("strides", &[2])],
        1,
    );
    let want = conv_reference(&x1, &w1, None, &[2], &[1], &[1], 1, &[5]);
    close(&res[0], &want);
}

fn wave(shape: &[usize], seed: f32) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::f32(
        shape.to_vec(),
        (0..n).map(|i| ((i as f32 + 1.0) * seed).sin()).collect(),
    )
}

/// Attention from its definition on [B, H, S, D] data: key j is visible from query i when
/// `visible(b, i, j)`; a query with no visible key gives zeros.
fn attention_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    visible: impl Fn(usize, usize, usize) -> bool,
) -> Tensor {
    let (qs, ks, vs) = (&q.shape, &k.shape, &v.shape);
    let (b, hq, t, d) = (qs[0], qs[1], qs[2], qs[3]);
    let (hk, s, dv) = (ks[1], ks[2], vs[3]);
    let (qv, kv, vv) = (q.to_f32_vec(), k.to_f32_vec(), v.to_f32_vec());
    let mut out = vec![0f32; b * hq * t * dv];
    for bi in 0..b {
        for h in 0..hq {
            let g = h / (hq / hk);
            for i in 0..t {
                let scores: Vec<Option<f32>> = (0..s)
                    .map(|j| {
                        visible(bi, i, j).then(|| {
                            (0..d)
                                .map(|x| {
                                    qv[((bi * hq + h) * t + i) * d + x]
                                        * kv[((bi * hk + g) * s + j) * d + x]
                                })
                                .sum::<f32>()
                                * scale
                        })
                    })
                    .collect();
                let m = scores
                    .iter()
                    .flatten()
                    .fold(f32::NEG_INFINITY, |a, &x| a.max(x));
                let e: Vec<f32> = scores
                    .iter()
                    .map(|x| x.map_or(0.0, |x| (x - m).exp()))
                    .collect();
                let z: f32 = e.iter().sum();
                for x in 0..dv {
                    let o = &mut out[((bi * hq + h) * t + i) * dv + x];
                    for j in 0..s {
                        if z > 0.0 {
                            *o += e[j] / z * vv[((bi * hk + g) * s + j) * dv + x];
                        }
                    }
                }
            }
        }
    }
    Tensor::f32(vec![b, hq, t, dv], out)
}

/// Runs one node of `opset` with run-time inputs (an empty name: an omitted input); returns
/// its outputs.
fn one_node_opset(
    opset: i64,
    op: &str,
    ins: &[(&str, Tensor)],
    attrs: Vec<AttributeProto>,
    n_out: usize,
) -> Vec<Tensor> {
    let mut m = M::new();
    m.opset = opset;
    for (n, t) in ins.iter().filter(|(n, _)| !n.is_empty()) {
        m.inputs.push(vi(n, elem(t), &dims(t)));
    }
    let names: Vec<&str> = ins.iter().map(|(n, _)| *n).collect();
    let feed: Vec<(&str, Tensor)> = ins
        .iter()
        .filter(|(n, _)| !n.is_empty())
        .map(|(n, t)| (*n, t.clone()))
        .collect();
    let outs: Vec<String> = (0..n_out).map(|k| format!("out{k}")).collect();
    let outs_ref: Vec<&str> = outs.iter().map(|s| s.as_str()).collect();
    m.nodes.push(node(op, "n", &names, &outs_ref, attrs));
    for o in &outs {
        m.outputs.push(out(o));
    }
    let p = m.import(&[]).unwrap_or_else(|e| panic!("{e}"));
    let res = run(&p, &feed);
    outs.iter()
        .map(|o| res.iter().find(|(n, _)| n == o).unwrap().1.clone())
        .collect()
}

#[test]
fn attention_op_masks_groups_and_layouts() {
    let (q, k, v) = (
        wave(&[2, 4, 3, 8], 0.37),
        wave(&[2, 2, 5, 8], 0.11),
        wave(&[2, 2, 5, 6], 0.23),
    );
    let scale = 1.0 / 8f32.sqrt();
    // Boolean mask [q, kv]: query 1 sees no key (its output is zeros).
    let allow = |i: usize, j: usize| i != 1 && !(i + j).is_multiple_of(3);
    let mask = Tensor::new(
        vec![3, 5],
        Data::Bool((0..15).map(|x| allow(x / 5, x % 5)).collect()),
    );
    let got = one_node_opset(
        23,
        "Attention",
        &[
            ("q", q.clone()),
            ("k", k.clone()),
            ("v", v.clone()),
            ("mask", mask),
        ],
        vec![],
        1,
    );
    close(
        &got[0],
        &attention_reference(&q, &k, &v, scale, |_, i, j| allow(i, j)),
    );
    // Causal (aligned to the start when there is no cache) with an explicit scale.
    let got = one_node_opset(
        23,
        "Attention",
        &[("q", q.clone()), ("k", k.clone()), ("v", v.clone())],
        vec![a_i("is_causal", 1), a_f("scale", 0.5)],
        1,
    );
    close(
        &got[0],
        &attention_reference(&q, &k, &v, 0.5, |_, i, j| j <= i),
    );
    // 3-D inputs [B, S, H*D] with head counts; key lengths per batch (opset 24).
    let to3 = |t: &Tensor| {
        let s = &t.shape;
        let (b, h, n, d) = (s[0], s[1], s[2], s[3]);
        let x = t.to_f32_vec();
        let mut y = vec![0f32; x.len()];
        for bi in 0..b {
            for hi in 0..h {
                for ni in 0..n {
                    for di in 0..d {
                        y[((bi * n + ni) * h + hi) * d + di] = x[((bi * h + hi) * n + ni) * d + di];
                    }
                }
            }
        }
        Tensor::f32(vec![b, n, h * d], y)
    };
    let lens = Tensor::i64(vec![2], vec![5, 3]);
    let none = Tensor::f32(vec![], vec![0.0]);
    let got = one_node_opset(
        24,
        "Attention",
        &[
            ("q", to3(&q)),
            ("k", to3(&k)),
            ("v", to3(&v)),
            ("", none.clone()),
            ("", none.clone()),
            ("", none),
            ("lens", lens),
        ],
        vec![a_i("q_num_heads", 4), a_i("kv_num_heads", 2)],
        1,
    );
    let want = attention_reference(&q, &k, &v, scale, |b, _, j| j < [5, 3][b]);
    close(&got[0], &to3(&want));
}

#[test]
fn rotary_embedding_halves_and_interleaved() {
    // x [B=1, H=2, S=3, D=6], rotating the first 4 dims, cos/sin caches by position.
    let x = wave(&[1, 2, 3, 6], 0.3);
    let cos = wave(&[5, 2], 0.7);
    let sin = wave(&[5, 2], 1.3);
    let pos = Tensor::i64(vec![1, 3], vec![4, 0, 2]);
    for interleaved in [0, 1] {
        let got = one_node_opset(
            23,
            "RotaryEmbedding",
            &[
                ("x", x.clone()),
                ("cos", cos.clone()),
                ("sin", sin.clone()),
                ("pos", pos.clone()),
            ],
            vec![
                a_i("interleaved", interleaved),
                a_i("rotary_embedding_dim", 4),
            ],
            1,
        );
        let (xv, cv, sv) = (x.to_f32_vec(), cos.to_f32_vec(), sin.to_f32_vec());
        let mut want = xv.clone();
        for h in 0..2 {
            for s in 0..3 {
                let p = [4, 0, 2][s];
                let base = (h * 3 + s) * 6;
                for i in 0..2 {
                    let (a, b) = if interleaved == 1 {
                        (base + 2 * i, base + 2 * i + 1)
                    } else {
                        (base + i, base + 2 + i)
                    };
                    let (c, sn) = (cv[p * 2 + i], sv[p * 2 + i]);
                    want[a] = c * xv[a] - sn * xv[b];
                    want[b] = sn * xv[a] + c * xv[b];
                }
            }
        }
        close(&got[0], &Tensor::f32(vec![1, 2, 3, 6], want));
    }
}

// ---------------------------------------------------------------------------------------------
// Sequences (static lengths, constant positions): SplitToSequence, SequenceConstruct,
// SequenceAt, SequenceLength, SequenceInsert, SequenceErase, ConcatFromSequence.

/// `x[r][c]` of a row-major `[rows, cols]` f32 tensor given as its values.
fn at2(v: &[f64], cols: usize, r: usize, c: usize) -> f64 {
    v[r * cols + c]
}

fn output(res: &[(String, Tensor)], name: &str) -> Tensor {
    res.iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no output {name}"))
        .1
        .clone()
}

#[test]
fn split_to_sequence_with_sizes_then_at_and_concat() {
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(2), D::V(6)]));
    m.inits.push(init("sizes", &i64s(&[3], &[1, 3, 2])));
    m.inits.push(init("one", &Tensor::scalar_i64(1)));
    m.inits.push(init("last", &Tensor::scalar_i64(-1)));
    m.nodes.push(node(
        "SplitToSequence",
        "split",
        &["x", "sizes"],
        &["seq"],
        vec![a_i("axis", 1)],
    ));
    m.nodes
        .push(node("SequenceAt", "at1", &["seq", "one"], &["mid"], vec![]));
    m.nodes.push(node(
        "SequenceAt",
        "atlast",
        &["seq", "last"],
        &["tail"],
        vec![],
    ));
    m.nodes
        .push(node("SequenceLength", "len", &["seq"], &["n"], vec![]));
    m.nodes.push(node(
        "ConcatFromSequence",
        "cat",
        &["seq"],
        &["whole"],
        vec![a_i("axis", 1)],
    ));
    for o in ["mid", "tail", "n", "whole"] {
        m.outputs.push(out(o));
    }
    let p = m.import(&[]).unwrap_or_else(|e| panic!("{e}"));
    let x = arange(&[2, 6]);
    let xv = x.to_f64_vec();
    let res = run(&p, &[("x", x.clone())]);
    // columns 1..4 and 4..6, written out element by element
    let mut mid = Vec::new();
    let mut tail = Vec::new();
    for r in 0..2 {
        for c in 1..4 {
            mid.push(at2(&xv, 6, r, c) as f32);
        }
        for c in 4..6 {
            tail.push(at2(&xv, 6, r, c) as f32);
        }
    }
    close(&output(&res, "mid"), &Tensor::f32(vec![2, 3], mid));
    close(&output(&res, "tail"), &Tensor::f32(vec![2, 2], tail));
    assert_eq!(output(&res, "n").to_f64_vec(), vec![3.0]);
    close(&output(&res, "whole"), &x);
}

#[test]
fn split_to_sequence_into_ones_without_keepdims_then_stack() {
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(3), D::V(2), D::V(4)]));
    m.inits.push(init("two", &Tensor::scalar_i64(2)));
    m.nodes.push(node(
        "SplitToSequence",
        "split",
        &["x"],
        &["seq"],
        vec![a_i("axis", 0), a_i("keepdims", 0)],
    ));
    m.nodes.push(node(
        "SequenceAt",
        "at2",
        &["seq", "two"],
        &["third"],
        vec![],
    ));
    m.nodes.push(node(
        "ConcatFromSequence",
        "stack",
        &["seq"],
        &["stacked"],
        vec![a_i("axis", -1), a_i("new_axis", 1)],
    ));
    m.outputs.push(out("third"));
    m.outputs.push(out("stacked"));
    let p = m.import(&[]).unwrap_or_else(|e| panic!("{e}"));
    let x = arange(&[3, 2, 4]);
    let xv = x.to_f64_vec();
    let res = run(&p, &[("x", x)]);
    let third: Vec<f32> = (0..8).map(|k| xv[2 * 8 + k] as f32).collect();
    close(&output(&res, "third"), &Tensor::f32(vec![2, 4], third));
    // stacked[i][j][k] = x[k][i][j]
    let mut stacked = Vec::new();
    for i in 0..2 {
        for j in 0..4 {
            for k in 0..3 {
                stacked.push(xv[k * 8 + i * 4 + j] as f32);
            }
        }
    }
    close(
        &output(&res, "stacked"),
        &Tensor::f32(vec![2, 4, 3], stacked),
    );
}

#[test]
fn split_to_sequence_by_a_scalar_size_leaves_a_shorter_last_chunk() {
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(10), D::V(2)]));
    m.inits.push(init("four", &Tensor::scalar_i64(4)));
    m.inits.push(init("last", &Tensor::scalar_i64(-1)));
    m.nodes.push(node(
        "SplitToSequence",
        "split",
        &["x", "four"],
        &["seq"],
        vec![],
    ));
    m.nodes
        .push(node("SequenceAt", "at", &["seq", "last"], &["y"], vec![]));
    m.nodes
        .push(node("SequenceLength", "len", &["seq"], &["n"], vec![]));
    m.outputs.push(out("y"));
    m.outputs.push(out("n"));
    let p = m.import(&[]).unwrap_or_else(|e| panic!("{e}"));
    let x = arange(&[10, 2]);
    let xv = x.to_f64_vec();
    let res = run(&p, &[("x", x)]);
    let y: Vec<f32> = (8 * 2..10 * 2).map(|i| xv[i] as f32).collect();
    close(&output(&res, "y"), &Tensor::f32(vec![2, 2], y));
    assert_eq!(output(&res, "n").to_f64_vec(), vec![3.0]);
}

#[test]
fn sequence_construct_insert_erase_then_concat() {
    let mut m = M::new();
    for n in ["a", "b", "c"] {
        m.inputs.push(vi(n, FLOAT, &[D::V(1), D::V(3)]));
    }
    m.inits.push(init("zero", &Tensor::scalar_i64(0)));
    m.inits.push(init("one", &Tensor::scalar_i64(1)));
    m.nodes.push(node(
        "SequenceConstruct",
        "make",
        &["a", "b"],
        &["s0"],
        vec![],
    ));
    // [c, a, b], then without position 1: [c, b]
    m.nodes.push(node(
        "SequenceInsert",
        "ins",
        &["s0", "c", "zero"],
        &["s1"],
        vec![],
    ));
    m.nodes.push(node(
        "SequenceErase",
        "del",
        &["s1", "one"],
        &["s2"],
        vec![],
    ));
    // appended at the end without a position, then the last one dropped again
    m.nodes.push(node(
        "SequenceInsert",
        "push",
        &["s2", "a"],
        &["s3"],
        vec![],
    ));
    m.nodes
        .push(node("SequenceErase", "pop", &["s3"], &["s4"], vec![]));
    m.nodes.push(node(
        "ConcatFromSequence",
        "cat",
        &["s4"],
        &["y"],
        vec![a_i("axis", 0)],
    ));
    m.outputs.push(out("y"));
    let p = m.import(&[]).unwrap_or_else(|e| panic!("{e}"));
    let a = Tensor::f32(vec![1, 3], vec![1.0, 2.0, 3.0]);
    let b = Tensor::f32(vec![1, 3], vec![4.0, 5.0, 6.0]);
    let c = Tensor::f32(vec![1, 3], vec![7.0, 8.0, 9.0]);
    let res = run(&p, &[("a", a), ("b", b), ("c", c)]);
    close(
        &output(&res, "y"),
        &Tensor::f32(vec![2, 3], vec![7.0, 8.0, 9.0, 4.0, 5.0, 6.0]),
    );
}

#[test]
fn sequence_positions_computed_at_run_time_are_refused_naming_the_node() {
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(4), D::V(2)]));
    m.inputs.push(vi("pos", INT64, &[]));
    m.nodes
        .push(node("SplitToSequence", "split", &["x"], &["seq"], vec![]));
    m.nodes.push(node(
        "SequenceAt",
        "pick_row",
        &["seq", "pos"],
        &["y"],
        vec![],
    ));
    m.outputs.push(out("y"));
    let e = m.import(&[]).unwrap_err().to_string();
    assert!(
        e.contains("pick_row") && e.contains("position") && e.contains("pos"),
        "{e}"
    );
    // out of range
    let mut m2 = M::new();
    m2.inputs.push(vi("x", FLOAT, &[D::V(4), D::V(2)]));
    m2.inits.push(init("p", &Tensor::scalar_i64(4)));
    m2.nodes
        .push(node("SplitToSequence", "split", &["x"], &["seq"], vec![]));
    m2.nodes.push(node(
        "SequenceAt",
        "pick_row",
        &["seq", "p"],
        &["y"],
        vec![],
    ));
    m2.outputs.push(out("y"));
    let e = m2.import(&[]).unwrap_err().to_string();
    assert!(
        e.contains("pick_row") && e.contains("position 4 is out of range"),
        "{e}"
    );
    // a sequence read by an op that takes tensors
    let mut m3 = M::new();
    m3.inputs.push(vi("x", FLOAT, &[D::V(4), D::V(2)]));
    m3.nodes
        .push(node("SplitToSequence", "split", &["x"], &["seq"], vec![]));
    m3.nodes.push(node("Relu", "act", &["seq"], &["y"], vec![]));
    m3.outputs.push(out("y"));
    let e = m3.import(&[]).unwrap_err().to_string();
    assert!(
        e.contains("act") && e.contains("is a sequence") && e.contains("Relu"),
        "{e}"
    );
    // a sequence as a graph output
    let mut m4 = M::new();
    m4.inputs.push(vi("x", FLOAT, &[D::V(4), D::V(2)]));
    m4.nodes
        .push(node("SplitToSequence", "split", &["x"], &["seq"], vec![]));
    m4.outputs.push(out("seq"));
    let e = m4.import(&[]).unwrap_err().to_string();
    assert!(e.contains("`seq` is a sequence"), "{e}");
}
