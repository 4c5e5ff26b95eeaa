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
            (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
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
