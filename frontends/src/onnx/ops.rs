//! Per-op translation: ONNX op semantics (opsets 13-21) onto hzp's op set. Attributes that
//! ONNX passes as inputs (shapes, axes, sizes, k, depth) must be import-time constants.

use super::error::{node_err, FResult, Fail, ImportErrorKind};
use super::proto::data_type as dt;
use super::translate::{Ctx, NodeCx, Slot};
use hzp_ir::{broadcast_shapes, BinaryOp, DType, Op, ReduceOp, Tensor, UnaryOp};

/// Op types of the default domain hzp translates.
#[rustfmt::skip]
pub(crate) const DEFAULT_DOMAIN_OPS: &[&str] = &[
    "Abs", "Add", "And", "ArgMax", "ArgMin", "Attention", "Cast", "CastLike", "Ceil", "Celu",
    "Clip", "Concat", "Constant", "ConstantOfShape", "Conv", "Cos", "CumSum", "Div", "Dropout",
    "Einsum", "Elu", "Equal", "Erf", "Exp", "Expand", "Flatten", "Floor", "Gather",
    "GatherElements", "GatherND", "Gelu", "Gemm", "Greater", "GreaterOrEqual", "HardSigmoid",
    "HardSwish", "Identity", "IsInf", "IsNaN", "LayerNormalization", "LeakyRelu", "Less",
    "LessOrEqual", "Log", "LogSoftmax", "MatMul", "Max", "Mean", "Min", "Mish", "Mod", "Mul",
    "Neg", "Not", "OneHot", "Or", "PRelu", "Pad", "Pow", "RMSNormalization", "Range", "Reciprocal",
    "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
    "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare", "Relu", "Reshape",
    "RotaryEmbedding", "ScatterElements", "ScatterND", "Selu", "Shape", "Sigmoid", "Sign", "Sin",
    "Size", "Slice", "Softmax", "Softplus", "Softsign", "Split", "Sqrt", "Squeeze", "Sub", "Sum",
    "Swish", "Tanh", "ThresholdedRelu", "Tile", "TopK", "Transpose", "Trilu", "Unsqueeze", "Where",
    "Xor",
];

/// Whether hzp translates `op_type` of `domain`.
pub(crate) fn is_supported(domain: &str, op_type: &str) -> bool {
    match domain {
        "" | "ai.onnx" => DEFAULT_DOMAIN_OPS.contains(&op_type),
        "com.microsoft" => op_type == "SimplifiedLayerNormalization",
        _ => false,
    }
}

fn unary(op_type: &str) -> Option<UnaryOp> {
    Some(match op_type {
        "Neg" => UnaryOp::Neg,
        "Abs" => UnaryOp::Abs,
        "Exp" => UnaryOp::Exp,
        "Log" => UnaryOp::Log,
        "Sqrt" => UnaryOp::Sqrt,
        "Reciprocal" => UnaryOp::Reciprocal,
        "Tanh" => UnaryOp::Tanh,
        "Erf" => UnaryOp::Erf,
        "Sigmoid" => UnaryOp::Sigmoid,
        "Relu" => UnaryOp::Relu,
        "Sin" => UnaryOp::Sin,
        "Cos" => UnaryOp::Cos,
        "Floor" => UnaryOp::Floor,
        "Ceil" => UnaryOp::Ceil,
        "Sign" => UnaryOp::Sign,
        "Not" => UnaryOp::Not,
        "IsNaN" => UnaryOp::IsNaN,
        _ => return None,
    })
}

fn binary(op_type: &str) -> Option<BinaryOp> {
    Some(match op_type {
        "Add" => BinaryOp::Add,
        "Sub" => BinaryOp::Sub,
        "Mul" => BinaryOp::Mul,
        "Div" => BinaryOp::Div,
        "Equal" => BinaryOp::Equal,
        "Less" => BinaryOp::Less,
        "LessOrEqual" => BinaryOp::LessOrEqual,
        "Greater" => BinaryOp::Greater,
        "GreaterOrEqual" => BinaryOp::GreaterOrEqual,
        "And" => BinaryOp::And,
        "Or" => BinaryOp::Or,
        "Xor" => BinaryOp::Xor,
        _ => return None,
    })
}

type Outs = Vec<Option<Slot>>;

fn one(s: Slot) -> FResult<Outs> {
    Ok(vec![Some(s)])
}

fn err<T>(m: impl Into<String>) -> FResult<T> {
    Err(node_err(m))
}

fn unsupported<T>(m: impl Into<String>) -> FResult<T> {
    Err(Fail::new(ImportErrorKind::Unsupported, m))
}

/// The IR name of output `k` (the ONNX name, or a fresh one for omitted outputs).
fn out_name(cx: &mut Ctx, n: &NodeCx, k: usize) -> String {
    match n.p.output.get(k) {
        Some(o) if !o.is_empty() => o.clone(),
        _ => cx.fresh(&format!("{}:{k}", n.ir_name)),
    }
}

/// A fresh name for an intermediate value of this node.
fn tmp(cx: &mut Ctx, n: &NodeCx, what: &str) -> String {
    let base = match n.p.output.first() {
        Some(o) if !o.is_empty() => o.clone(),
        _ => n.ir_name.clone(),
    };
    cx.fresh(&format!("{base}/{what}"))
}

fn emit1(cx: &mut Ctx, node: &str, op: Op, ins: &[Slot], out: String) -> FResult<Slot> {
    let mut v = cx.emit(node, op, ins, vec![out])?;
    v.pop()
        .ok_or_else(|| node_err("internal: op made no result"))
}

/// Normalizes an ONNX axis (negative counts from the end) for `rank`.
fn norm_axis(a: i64, rank: usize, what: &str) -> FResult<usize> {
    let r = rank as i64;
    let x = if a < 0 { a + r } else { a };
    if x < 0 || x >= r {
        return err(format!("{what} {a} is out of range for rank {rank}"));
    }
    Ok(x as usize)
}

/// Normalizes a list of axes; duplicates are an error.
fn norm_axes(axes: &[i64], rank: usize, what: &str) -> FResult<Vec<usize>> {
    let mut out = Vec::with_capacity(axes.len());
    for &a in axes {
        let x = norm_axis(a, rank, what)?;
        if out.contains(&x) {
            return err(format!("{what} {axes:?} name axis {x} twice"));
        }
        out.push(x);
    }
    Ok(out)
}

/// Integer values of a constant (index/shape inputs).
fn ints(t: &Tensor, what: &str) -> FResult<Vec<i64>> {
    t.to_i64_vec()
        .ok_or_else(|| node_err(format!("{what} must hold integers, got {}", t.dtype())))
}

/// One integer from a scalar or 1-element constant.
fn int_scalar(t: &Tensor, what: &str) -> FResult<i64> {
    if t.numel() != 1 {
        return err(format!(
            "{what} must have one element, got shape {:?}",
            t.shape
        ));
    }
    match t.to_i64_vec() {
        Some(v) => Ok(v[0]),
        None => {
            let f = t.to_f64_vec()[0];
            if f.fract() != 0.0 || !f.is_finite() {
                return err(format!("{what} must be a whole number, got {f}"));
            }
            Ok(f as i64)
        }
    }
}

fn non_neg(v: &[i64], what: &str) -> FResult<Vec<usize>> {
    v.iter()
        .map(|&x| {
            usize::try_from(x).map_err(|_| node_err(format!("{what} {v:?} has a negative entry")))
        })
        .collect()
}

/// The hzp dtype for a Cast target.
fn cast_target(to: i64) -> FResult<DType> {
    let t = i32::try_from(to).unwrap_or(-1);
    match t {
        dt::FLOAT | dt::DOUBLE => Ok(DType::F32),
        dt::FLOAT16 => Ok(DType::F16),
        dt::BFLOAT16 => Ok(DType::BF16),
        dt::INT32 => Ok(DType::I32),
        dt::INT64 => Ok(DType::I64),
        dt::BOOL => Ok(DType::Bool),
        _ => unsupported(format!(
            "casting to {} is not supported (hzp has f32, bf16, f16, i64, i32 and bool; DOUBLE \
             is computed as f32)",
            dt::name(t)
        )),
    }
}

/// Translates one node; returns a slot per ONNX output (`None`: not computed).
pub(crate) fn translate(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let op_type = n.p.op_type.as_str();
    let name = n.ir_name.clone();
    if n.p.domain == "com.microsoft" {
        return match op_type {
            "SimplifiedLayerNormalization" => rms_norm(cx, n),
            _ => unsupported(format!("com.microsoft.{op_type} is not supported")),
        };
    }
    if let Some(u) = unary(op_type) {
        let x = n.req(0)?.clone();
        let out = out_name(cx, n, 0);
        return one(emit1(cx, &name, Op::Unary(u), &[x], out)?);
    }
    if let Some(b) = binary(op_type) {
        let (a, c) = (n.req(0)?.clone(), n.req(1)?.clone());
        let out = out_name(cx, n, 0);
        return one(emit1(cx, &name, Op::Binary(b), &[a, c], out)?);
    }
    match op_type {
        "Identity" => one(n.req(0)?.clone()),
        "Dropout" => dropout(cx, n),
        "Pow" => pow(cx, n),
        "Mod" => modulo(cx, n),
        "Max" | "Min" | "Sum" | "Mean" => variadic(cx, n),
        "Where" => {
            let ins = [n.req(0)?.clone(), n.req(1)?.clone(), n.req(2)?.clone()];
            if let Some((x, axis)) = nan_guarded_softmax(cx, &ins) {
                let out = out_name(cx, n, 0);
                if never_fully_masked(cx, &x, axis) {
                    // No row can be all -inf: the guard never fires.
                    return one(emit1(cx, &name, Op::Softmax { axis }, &[x], out)?);
                }
                return one(safe_softmax(cx, n, x, axis, out)?);
            }
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, Op::Where, &ins, out)?)
        }
        "Cast" => {
            let to = n
                .attr("to")
                .and_then(|a| a.i)
                .ok_or_else(|| node_err("Cast needs the `to` attribute"))?;
            cast(cx, n, cast_target(to)?)
        }
        "CastLike" => {
            let to = cx.dtype(n.req(1)?);
            cast(cx, n, to)
        }
        "MatMul" => {
            let ins = [n.req(0)?.clone(), n.req(1)?.clone()];
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, Op::MatMul, &ins, out)?)
        }
        "Gemm" => gemm(cx, n),
        "Conv" => conv(cx, n),
        "Attention" => attention(cx, n),
        "RotaryEmbedding" => rotary_embedding(cx, n),
        "Swish" => swish(cx, n),
        "Einsum" => einsum(cx, n),
        "Softmax" | "LogSoftmax" => {
            let x = n.req(0)?.clone();
            let axis = norm_axis(n.attr_i("axis", -1)?, cx.shape(&x).len(), "axis")?;
            let op = if op_type == "Softmax" {
                Op::Softmax { axis }
            } else {
                Op::LogSoftmax { axis }
            };
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, op, &[x], out)?)
        }
        "LayerNormalization" => layer_norm(cx, n),
        "RMSNormalization" => rms_norm(cx, n),
        "Gelu" => {
            let x = n.req(0)?.clone();
            let u = match n.attr_s("approximate")?.as_deref() {
                None | Some("none") => UnaryOp::Gelu,
                Some("tanh") => UnaryOp::GeluTanh,
                Some(other) => return err(format!("unknown approximate=`{other}`")),
            };
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, Op::Unary(u), &[x], out)?)
        }
        "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceProd"
        | "ReduceSumSquare" | "ReduceL1" | "ReduceL2" | "ReduceLogSum" | "ReduceLogSumExp" => {
            reduce(cx, n)
        }
        "LeakyRelu" | "PRelu" | "Elu" | "Selu" | "Celu" | "HardSigmoid" | "HardSwish"
        | "Softplus" | "Softsign" | "Mish" | "ThresholdedRelu" | "IsInf" => activation(cx, n),
        "Pad" => pad(cx, n),
        "ArgMax" | "ArgMin" => argmax(cx, n),
        "CumSum" => {
            let x = n.req(0)?.clone();
            let a = int_scalar(cx.static_input(n, 1, "the axis")?, "the axis")?;
            let axis = norm_axis(a, cx.shape(&x).len(), "axis")?;
            let op = Op::CumSum {
                axis,
                exclusive: n.attr_i("exclusive", 0)? != 0,
                reverse: n.attr_i("reverse", 0)? != 0,
            };
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, op, &[x], out)?)
        }
        "Reshape" => {
            let x = n.req(0)?.clone();
            let target = ints(
                cx.static_input(n, 1, "the target shape")?,
                "the target shape",
            )?;
            let shape = reshape_target(&cx.shape(&x), &target, n.attr_i("allowzero", 0)? != 0)?;
            reshape(cx, n, x, shape)
        }
        "Flatten" => {
            let x = n.req(0)?.clone();
            let s = cx.shape(&x);
            let a = n.attr_i("axis", 1)?;
            let r = s.len() as i64;
            let axis = if a < 0 { a + r } else { a };
            if axis < 0 || axis > r {
                return err(format!("axis {a} is out of range for rank {r}"));
            }
            let axis = axis as usize;
            let shape = vec![s[..axis].iter().product(), s[axis..].iter().product()];
            reshape(cx, n, x, shape)
        }
        "Squeeze" => {
            let x = n.req(0)?.clone();
            let s = cx.shape(&x);
            let axes = axes_input(cx, n, 1, "axes")?;
            let axes = match axes {
                Some(a) if !a.is_empty() => norm_axes(&a, s.len(), "axes")?,
                _ => (0..s.len()).filter(|&i| s[i] == 1).collect(),
            };
            if let Some(&a) = axes.iter().find(|&&a| s[a] != 1) {
                return err(format!(
                    "cannot squeeze axis {a} of shape {s:?}: its size is not 1"
                ));
            }
            let shape = (0..s.len())
                .filter(|i| !axes.contains(i))
                .map(|i| s[i])
                .collect();
            reshape(cx, n, x, shape)
        }
        "Unsqueeze" => {
            let x = n.req(0)?.clone();
            let s = cx.shape(&x);
            let axes =
                axes_input(cx, n, 1, "axes")?.ok_or_else(|| node_err("Unsqueeze needs axes"))?;
            let rank = s.len() + axes.len();
            let axes = norm_axes(&axes, rank, "axes")?;
            let mut it = s.iter();
            let shape = (0..rank)
                .map(|i| {
                    if axes.contains(&i) {
                        1
                    } else {
                        it.next().copied().unwrap_or(1)
                    }
                })
                .collect();
            reshape(cx, n, x, shape)
        }
        "Transpose" => {
            let x = n.req(0)?.clone();
            let r = cx.shape(&x).len();
            let perm = match n.attr_ints("perm") {
                Some(p) => non_neg(&p, "perm")?,
                None => (0..r).rev().collect(),
            };
            if perm.iter().copied().eq(0..r) {
                return one(x);
            }
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, Op::Transpose { perm }, &[x], out)?)
        }
        "Slice" => slice(cx, n),
        "Concat" => {
            let ins: Vec<Slot> = n.ins.iter().flatten().cloned().collect();
            let first = ins
                .first()
                .ok_or_else(|| node_err("Concat has no inputs"))?;
            let r = cx.shape(first).len();
            let a = n
                .attr("axis")
                .and_then(|a| a.i)
                .ok_or_else(|| node_err("Concat needs the `axis` attribute"))?;
            let axis = norm_axis(a, r, "axis")?;
            if ins.len() == 1 {
                return one(ins[0].clone());
            }
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, Op::Concat { axis }, &ins, out)?)
        }
        "Split" => split(cx, n),
        "Expand" => {
            let x = n.req(0)?.clone();
            let want = non_neg(
                &ints(
                    cx.static_input(n, 1, "the target shape")?,
                    "the target shape",
                )?,
                "the target shape",
            )?;
            let s = cx.shape(&x);
            let shape = broadcast_shapes(&s, &want)
                .ok_or_else(|| node_err(format!("shape {s:?} does not broadcast with {want:?}")))?;
            if shape == s {
                return one(x);
            }
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, Op::Expand { shape }, &[x], out)?)
        }
        "Tile" => {
            let x = n.req(0)?.clone();
            let reps = non_neg(
                &ints(cx.static_input(n, 1, "the repeats")?, "the repeats")?,
                "the repeats",
            )?;
            let s = cx.shape(&x);
            if reps.iter().all(|&r| r == 1) && reps.len() == s.len() {
                return one(x);
            }
            if s.iter()
                .zip(&reps)
                .any(|(d, r)| d.checked_mul(*r).is_none())
            {
                return err(format!("repeats {reps:?} of shape {s:?} are too large"));
            }
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, Op::Tile { repeats: reps }, &[x], out)?)
        }
        "Trilu" => {
            let x = n.req(0)?.clone();
            let k = match n.input(1) {
                Some(_) => int_scalar(cx.static_input(n, 1, "k")?, "k")?,
                None => 0,
            };
            let op = Op::Trilu {
                upper: n.attr_i("upper", 1)? != 0,
                k,
            };
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, op, &[x], out)?)
        }
        "Gather" | "GatherElements" => {
            let (d, i) = (n.req(0)?.clone(), n.req(1)?.clone());
            let axis = norm_axis(n.attr_i("axis", 0)?, cx.shape(&d).len(), "axis")?;
            let op = if op_type == "Gather" {
                Op::Gather { axis }
            } else {
                Op::GatherElements { axis }
            };
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, op, &[d, i], out)?)
        }
        "GatherND" => {
            let (d, i) = (n.req(0)?.clone(), n.req(1)?.clone());
            let b = n.attr_i("batch_dims", 0)?;
            let batch_dims =
                usize::try_from(b).map_err(|_| node_err(format!("batch_dims {b} is negative")))?;
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, Op::GatherND { batch_dims }, &[d, i], out)?)
        }
        "ScatterElements" | "ScatterND" => {
            let ins = [n.req(0)?.clone(), n.req(1)?.clone(), n.req(2)?.clone()];
            let add = match n.attr_s("reduction")?.as_deref() {
                None | Some("none") => false,
                Some("add") => true,
                Some(r) => {
                    return unsupported(format!(
                        "reduction=`{r}` is not supported (hzp has none and add)"
                    ))
                }
            };
            let op = if op_type == "ScatterElements" {
                let axis = norm_axis(n.attr_i("axis", 0)?, cx.shape(&ins[0]).len(), "axis")?;
                Op::ScatterElements { axis, add }
            } else {
                Op::ScatterND { add }
            };
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, op, &ins, out)?)
        }
        "OneHot" => {
            let mut idx = n.req(0)?.clone();
            if cx.dtype(&idx).is_float() {
                // ONNX takes any numeric indices; hzp's OneHot takes integers.
                let t = tmp(cx, n, "indices");
                idx = emit1(cx, &name, Op::Cast { to: DType::I64 }, &[idx], t)?;
            }
            let d = int_scalar(cx.static_input(n, 1, "the depth")?, "the depth")?;
            let depth =
                usize::try_from(d).map_err(|_| node_err(format!("depth {d} is negative")))?;
            let values = n.req(2)?.clone();
            let axis = norm_axis(n.attr_i("axis", -1)?, cx.shape(&idx).len() + 1, "axis")?;
            let out = out_name(cx, n, 0);
            one(emit1(
                cx,
                &name,
                Op::OneHot { axis, depth },
                &[idx, values],
                out,
            )?)
        }
        "TopK" => {
            let x = n.req(0)?.clone();
            let k = int_scalar(cx.static_input(n, 1, "k")?, "k")?;
            let k = usize::try_from(k).map_err(|_| node_err(format!("k {k} is negative")))?;
            let axis = norm_axis(n.attr_i("axis", -1)?, cx.shape(&x).len(), "axis")?;
            let op = Op::TopK {
                axis,
                k,
                largest: n.attr_i("largest", 1)? != 0,
                sorted: n.attr_i("sorted", 1)? != 0,
            };
            let outs = vec![out_name(cx, n, 0), out_name(cx, n, 1)];
            let r = cx.emit(&name, op, &[x], outs)?;
            Ok(r.into_iter().map(Some).collect())
        }
        "Shape" => {
            let x = n.req(0)?;
            let s = cx.shape(x);
            let r = s.len() as i64;
            let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
            let start = clamp(n.attr_i("start", 0)?);
            let end = clamp(n.attr_i("end", r)?);
            let dims: Vec<i64> = if start < end {
                s[start..end].iter().map(|&d| d as i64).collect()
            } else {
                vec![]
            };
            let out = out_name(cx, n, 0);
            let len = dims.len();
            one(cx.named_const(Tensor::i64(vec![len], dims), out))
        }
        "Size" => {
            let s = cx.shape(n.req(0)?);
            let out = out_name(cx, n, 0);
            let size = s.iter().product::<usize>() as i64;
            one(cx.named_const(Tensor::scalar_i64(size), out))
        }
        "Constant" => constant(cx, n),
        "ConstantOfShape" => {
            let shape = non_neg(
                &ints(cx.static_input(n, 0, "the shape")?, "the shape")?,
                "the shape",
            )?;
            let (value, dtype) = match n.attr("value").and_then(|a| a.t.as_ref()) {
                None => (0.0, DType::F32),
                Some(t) => {
                    let v = cx.decode(t, "attribute `value`")?;
                    if v.numel() != 1 {
                        return err("attribute `value` must have one element");
                    }
                    (v.to_f64_vec()[0], v.dtype())
                }
            };
            let out = out_name(cx, n, 0);
            one(cx.fill(&name, value, dtype, shape, out)?)
        }
        "Range" => range(cx, n),
        "Clip" => {
            let mut x = n.req(0)?.clone();
            let lo = n.input(1).cloned();
            let hi = n.input(2).cloned();
            if let Some(lo) = lo {
                let out = if hi.is_some() {
                    tmp(cx, n, "clip_min")
                } else {
                    out_name(cx, n, 0)
                };
                x = emit1(cx, &name, Op::Binary(BinaryOp::Max), &[x, lo], out)?;
            }
            if let Some(hi) = hi {
                let out = out_name(cx, n, 0);
                x = emit1(cx, &name, Op::Binary(BinaryOp::Min), &[x, hi], out)?;
            }
            one(x)
        }
        _ => unsupported(format!("{op_type} is not supported")),
    }
}

fn dropout(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let training = match n.input(2) {
        Some(_) => int_scalar(cx.static_input(n, 2, "training_mode")?, "training_mode")? != 0,
        None => false,
    };
    if training {
        // ONNX's default ratio is 0.5; a given ratio is a float scalar in [0, 1).
        let (ratio, ratio_f32) = match n.input(1) {
            Some(_) => {
                let t = cx.static_input(n, 1, "the ratio")?;
                if t.numel() != 1 || !t.dtype().is_float() {
                    return err(format!(
                        "the ratio must be one float, got {}{:?}",
                        t.dtype(),
                        t.shape
                    ));
                }
                (t.to_f64_vec()[0], t.dtype() == DType::F32)
            }
            None => (0.5, true),
        };
        if !(0.0..1.0).contains(&ratio) {
            return err(format!("the ratio must be in [0, 1), got {ratio}"));
        }
        if ratio != 0.0 {
            return dropout_training(cx, n, x, ratio, ratio_f32);
        }
        // Training mode with ratio 0 keeps every element (ONNX: the output is the input,
        // the mask all true).
    }
    // Inference: the output is the input and the mask is all true.
    let mut outs = vec![Some(x.clone())];
    if n.n_outputs() > 1 && !n.p.output[1].is_empty() {
        let shape = cx.shape(&x);
        let out = out_name(cx, n, 1);
        outs.push(Some(cx.fill(&n.ir_name, 1.0, DType::Bool, shape, out)?));
    }
    Ok(outs)
}

/// Training-mode Dropout with a non-zero `ratio`: the mask is drawn at import, as ONNX's
/// reference implementation draws it,
/// `numpy.random.RandomState(seed).uniform(0, 1, shape) >= ratio` (MT19937,
/// [`super::mt19937`]), so a given `seed` attribute reproduces the
/// reference's mask bit for bit. Without `seed` (ONNX: "auto generated"), the seed is the
/// 32-bit FNV-1a hash of the node's first output name: deterministic (plans stay
/// byte-identical) and different for each Dropout of a model. The mask is an import-time
/// constant, so it is the same in every evaluation and every training step, and the gradient
/// (through the product with the scaled mask) uses the same mask as the forward. The output
/// is `x * (mask ? 1 / (1 - ratio) : 0)`, the scale computed in the ratio's precision as
/// numpy does.
fn dropout_training(
    cx: &mut Ctx,
    n: &NodeCx,
    x: Slot,
    ratio: f64,
    ratio_f32: bool,
) -> FResult<Outs> {
    let dtype = cx.dtype(&x);
    if !dtype.is_float() {
        return err(format!(
            "Dropout's input must be a float tensor, got {dtype}"
        ));
    }
    let seed = match n.attr("seed") {
        Some(_) => {
            let s = n.attr_i("seed", 0)?;
            u32::try_from(s).map_err(|_| {
                node_err(format!(
                    "attribute `seed` must be in 0..=4294967295 (a numpy RandomState seed), \
                     got {s}"
                ))
            })?
        }
        None => {
            let name = n.p.output.first().map(String::as_str).unwrap_or("");
            name.bytes().fold(0x811c_9dc5u32, |h, b| {
                (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
            })
        }
    };
    let shape = cx.shape(&x);
    let numel = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| node_err(format!("Dropout's input shape {shape:?} is too large")))?;
    if !cx.computes((numel as u64).saturating_mul(dtype.size_bytes() as u64 + 1)) {
        let out = out_name(cx, n, 0);
        let y = cx.placeholder(&n.ir_name, dtype, shape.clone(), out)?;
        let mut outs = vec![Some(y)];
        if n.n_outputs() > 1 && !n.p.output[1].is_empty() {
            let out = out_name(cx, n, 1);
            outs.push(Some(cx.placeholder(&n.ir_name, DType::Bool, shape, out)?));
        }
        return Ok(outs);
    }
    // the scaled mask in x's dtype and the bool mask
    let bytes = (numel as u64).saturating_mul(dtype.size_bytes() as u64 + 1);
    cx.check_fold_budget(&format!("Dropout's mask of {numel} elements"), bytes)?;
    let scale = if ratio_f32 {
        f64::from(1.0f32 / (1.0f32 - ratio as f32))
    } else {
        1.0 / (1.0 - ratio)
    };
    let mut rng = super::mt19937::Mt19937::new(seed);
    let mask: Vec<bool> = (0..numel).map(|_| rng.next_f64() >= ratio).collect();
    let scaled: Vec<f64> = mask.iter().map(|&m| if m { scale } else { 0.0 }).collect();
    let factor = cx.konst(
        Tensor::from_f64(dtype, shape.clone(), &scaled),
        &format!("{}/dropout_scale", n.ir_name),
    );
    let out = out_name(cx, n, 0);
    let y = emit1(cx, &n.ir_name, Op::Binary(BinaryOp::Mul), &[x, factor], out)?;
    let mut outs = vec![Some(y)];
    if n.n_outputs() > 1 && !n.p.output[1].is_empty() {
        let out = out_name(cx, n, 1);
        let m = Tensor::new(shape, hzp_ir::Data::Bool(mask));
        outs.push(Some(cx.named_const(m, out)));
    }
    Ok(outs)
}

fn cast(cx: &mut Ctx, n: &NodeCx, to: DType) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    if cx.dtype(&x) == to {
        return one(x);
    }
    let out = out_name(cx, n, 0);
    one(emit1(cx, &n.ir_name, Op::Cast { to }, &[x], out)?)
}

fn pow(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let mut y = n.req(1)?.clone();
    let dx = cx.dtype(&x);
    if cx.dtype(&y) != dx {
        // ONNX allows an exponent of another type; the result has the base's type.
        let t = tmp(cx, n, "exponent");
        y = emit1(cx, &n.ir_name, Op::Cast { to: dx }, &[y], t)?;
    }
    let out = out_name(cx, n, 0);
    one(emit1(
        cx,
        &n.ir_name,
        Op::Binary(BinaryOp::Pow),
        &[x, y],
        out,
    )?)
}

fn modulo(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let (a, b) = (n.req(0)?.clone(), n.req(1)?.clone());
    let fmod = n.attr_i("fmod", 0)? != 0;
    let float = cx.dtype(&a).is_float();
    let name = n.ir_name.clone();
    // hzp's Mod is the sign-of-divisor remainder for ints and C fmod for floats. Floats
    // with fmod=0 want the divisor's sign: r = fmod(a, b), plus b where r is non-zero and
    // its sign differs from b's. Ints with fmod=1 want the dividend's sign: r = a mod b,
    // minus b where r is non-zero and its sign differs from a's.
    if float == fmod {
        let out = out_name(cx, n, 0);
        return one(emit1(cx, &name, Op::Binary(BinaryOp::Mod), &[a, b], out)?);
    }
    let sign_of = if float { b.clone() } else { a.clone() };
    let dt = cx.dtype(&a);
    let mut bl = Builder {
        cx,
        n,
        name: &name,
        dt,
    };
    let r = bl.bin(BinaryOp::Mod, &a, &b, "remainder")?;
    let zero = bl.k(0.0);
    let r_nonzero = bl.bin(BinaryOp::Equal, &r, &zero, "remainder_is_zero")?;
    let r_nonzero = bl.un(UnaryOp::Not, &r_nonzero, "remainder_nonzero")?;
    let r_neg = bl.bin(BinaryOp::Less, &r, &zero, "remainder_negative")?;
    let s_neg = bl.bin(BinaryOp::Less, &sign_of, &zero, "sign_negative")?;
    let differ = bl.bin(BinaryOp::Xor, &r_neg, &s_neg, "signs_differ")?;
    let fix = bl.bin(BinaryOp::And, &r_nonzero, &differ, "adjust")?;
    let adjust = if float { BinaryOp::Add } else { BinaryOp::Sub };
    let adjusted = bl.bin(adjust, &r, &b, "adjusted")?;
    one(bl.last(Op::Where, &[fix, adjusted, r])?)
}

fn variadic(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let op_type = n.p.op_type.as_str();
    let ins: Vec<Slot> = n.ins.iter().flatten().cloned().collect();
    if ins.is_empty() {
        return err(format!("{op_type} has no inputs"));
    }
    let b = match op_type {
        "Max" => BinaryOp::Max,
        "Min" => BinaryOp::Min,
        _ => BinaryOp::Add,
    };
    let mean = op_type == "Mean";
    let mut acc = ins[0].clone();
    let count = ins.len();
    for (i, x) in ins.into_iter().enumerate().skip(1) {
        let last = i == count - 1 && !mean;
        let out = if last {
            out_name(cx, n, 0)
        } else {
            tmp(cx, n, &format!("acc{i}"))
        };
        acc = emit1(cx, &n.ir_name, Op::Binary(b), &[acc, x], out)?;
    }
    if mean && count > 1 {
        let dtype = cx.dtype(&acc);
        let c = cx.scalar(dtype, count as f64, &format!("{}/count", n.ir_name));
        let out = out_name(cx, n, 0);
        acc = emit1(cx, &n.ir_name, Op::Binary(BinaryOp::Div), &[acc, c], out)?;
    }
    one(acc)
}

fn gemm(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let mut a = n.req(0)?.clone();
    let mut b = n.req(1)?.clone();
    let c = n.input(2).cloned();
    let alpha = n.attr_f("alpha", 1.0)?;
    let beta = n.attr_f("beta", 1.0)?;
    for (s, what) in [(&a, "A"), (&b, "B")] {
        let r = cx.shape(s).len();
        if r != 2 {
            return err(format!("Gemm input {what} must have rank 2, got rank {r}"));
        }
    }
    if n.attr_i("transA", 0)? != 0 {
        let t = tmp(cx, n, "A_T");
        a = emit1(cx, &name, Op::Transpose { perm: vec![1, 0] }, &[a], t)?;
    }
    if n.attr_i("transB", 0)? != 0 {
        let t = tmp(cx, n, "B_T");
        b = emit1(cx, &name, Op::Transpose { perm: vec![1, 0] }, &[b], t)?;
    }
    let use_c = c.is_some() && beta != 0.0;
    let scale = alpha != 1.0;
    let out = if use_c || scale {
        tmp(cx, n, "matmul")
    } else {
        out_name(cx, n, 0)
    };
    let mut y = emit1(cx, &name, Op::MatMul, &[a, b], out)?;
    let dtype = cx.dtype(&y);
    if scale {
        let k = cx.scalar(dtype, alpha as f64, &format!("{name}/alpha"));
        let out = if use_c {
            tmp(cx, n, "scaled")
        } else {
            out_name(cx, n, 0)
        };
        y = emit1(cx, &name, Op::Binary(BinaryOp::Mul), &[y, k], out)?;
    }
    if let (true, Some(mut c)) = (use_c, c) {
        if beta != 1.0 {
            let k = cx.scalar(cx.dtype(&c), beta as f64, &format!("{name}/beta"));
            let t = tmp(cx, n, "C_scaled");
            c = emit1(cx, &name, Op::Binary(BinaryOp::Mul), &[c, k], t)?;
        }
        let out = out_name(cx, n, 0);
        y = emit1(cx, &name, Op::Binary(BinaryOp::Add), &[y, c], out)?;
    }
    one(y)
}

fn layer_norm(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let scale = n.req(1)?.clone();
    let r = cx.shape(&x).len();
    let axis = norm_axis(n.attr_i("axis", -1)?, r, "axis")?;
    let epsilon = n.attr_f("epsilon", 1e-5)?;
    let mut ins = vec![x, scale];
    if let Some(b) = n.input(2) {
        ins.push(b.clone());
    }
    let x = ins[0].clone();
    let out = out_name(cx, n, 0);
    let y = emit1(cx, &n.ir_name, Op::LayerNorm { axis, epsilon }, &ins, out)?;
    let wanted = |k: usize| n.p.output.get(k).is_some_and(|o| !o.is_empty());
    if !wanted(1) && !wanted(2) {
        return one(y);
    }
    // Mean and InvStdDev (in f32, ONNX's default stash type), written out; dead code
    // elimination drops them when nothing reads them.
    let name = n.ir_name.clone();
    let mut b = Builder {
        cx,
        n,
        name: &name,
        dt: DType::F32,
    };
    let xf = if b.cx.dtype(&x) == DType::F32 {
        x
    } else {
        b.tmp(Op::Cast { to: DType::F32 }, &[x], "stash")?
    };
    let mean_op = Op::Reduce {
        op: ReduceOp::Mean,
        axes: (axis..r).collect(),
        keep_dims: true,
    };
    let mean_name = out_name(b.cx, n, 1);
    let mean = emit1(
        b.cx,
        &name,
        mean_op.clone(),
        std::slice::from_ref(&xf),
        mean_name,
    )?;
    let d = b.bin(BinaryOp::Sub, &xf, &mean, "centered")?;
    let sq = b.bin(BinaryOp::Mul, &d, &d, "squared")?;
    let var = b.tmp(mean_op, &[sq], "variance")?;
    let eps = b.k(epsilon as f64);
    let ve = b.bin(BinaryOp::Add, &var, &eps, "variance_eps")?;
    let sd = b.un(UnaryOp::Sqrt, &ve, "stddev")?;
    let inv_name = out_name(b.cx, n, 2);
    let inv = emit1(b.cx, &name, Op::Unary(UnaryOp::Reciprocal), &[sd], inv_name)?;
    Ok(vec![Some(y), Some(mean), Some(inv)])
}

fn rms_norm(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let scale = n.req(1)?.clone();
    let r = cx.shape(&x).len();
    let axis = norm_axis(n.attr_i("axis", -1)?, r, "axis")?;
    let epsilon = n.attr_f("epsilon", 1e-5)?;
    let out = out_name(cx, n, 0);
    one(emit1(
        cx,
        &n.ir_name,
        Op::RmsNorm { axis, epsilon },
        &[x, scale],
        out,
    )?)
}

/// Axes from input `k` (a constant) or, for older opsets, the `axes` attribute.
fn axes_input(cx: &Ctx, n: &NodeCx, k: usize, what: &str) -> FResult<Option<Vec<i64>>> {
    if n.input(k).is_some() {
        Ok(Some(ints(cx.static_input(n, k, what)?, what)?))
    } else {
        Ok(n.attr_ints("axes"))
    }
}

fn reduce(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let r = cx.shape(&x).len();
    let op_type = n.p.op_type.as_str();
    let name = n.ir_name.clone();
    let op = match op_type {
        "ReduceMean" => ReduceOp::Mean,
        "ReduceMax" => ReduceOp::Max,
        "ReduceMin" => ReduceOp::Min,
        "ReduceProd" => ReduceOp::Prod,
        _ => ReduceOp::Sum,
    };
    let keep_dims = n.attr_i("keepdims", 1)? != 0;
    let axes = axes_input(cx, n, 1, "the axes")?.unwrap_or_default();
    let noop = axes.is_empty() && n.attr_i("noop_with_empty_axes", 0)? != 0;
    let mut axes = if axes.is_empty() {
        (0..r).collect()
    } else {
        norm_axes(&axes, r, "axes")?
    };
    axes.sort_unstable();
    // The elementwise part before the reduction.
    let x = match op_type {
        "ReduceSumSquare" | "ReduceL2" => {
            let t = tmp(cx, n, "square");
            emit1(cx, &name, Op::Binary(BinaryOp::Mul), &[x.clone(), x], t)?
        }
        "ReduceL1" => {
            let t = tmp(cx, n, "abs");
            emit1(cx, &name, Op::Unary(UnaryOp::Abs), &[x], t)?
        }
        _ => x,
    };
    if noop {
        // The input is not reduced (the elementwise part still applies).
        return one(x);
    }
    let post = match op_type {
        "ReduceL2" => Some(UnaryOp::Sqrt),
        "ReduceLogSum" => Some(UnaryOp::Log),
        _ => None,
    };
    if op_type == "ReduceLogSumExp" {
        return log_sum_exp(cx, n, x, axes, keep_dims);
    }
    let out = if post.is_some() {
        tmp(cx, n, "reduced")
    } else {
        out_name(cx, n, 0)
    };
    let reduce_op = Op::Reduce {
        op,
        axes,
        keep_dims,
    };
    let y = emit1(cx, &name, reduce_op, &[x], out)?;
    match post {
        Some(u) => {
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, Op::Unary(u), &[y], out)?)
        }
        None => one(y),
    }
}

/// log(sum(exp(x - m))) + m with m = max(x) over the axes, for stability.
fn log_sum_exp(
    cx: &mut Ctx,
    n: &NodeCx,
    x: Slot,
    axes: Vec<usize>,
    keep_dims: bool,
) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let keep = |op| Op::Reduce {
        op,
        axes: axes.clone(),
        keep_dims: true,
    };
    let t = tmp(cx, n, "max");
    let m = emit1(cx, &name, keep(ReduceOp::Max), std::slice::from_ref(&x), t)?;
    let t = tmp(cx, n, "shifted");
    let d = emit1(cx, &name, Op::Binary(BinaryOp::Sub), &[x, m.clone()], t)?;
    let t = tmp(cx, n, "exp");
    let e = emit1(cx, &name, Op::Unary(UnaryOp::Exp), &[d], t)?;
    let t = tmp(cx, n, "sum");
    let s = emit1(cx, &name, keep(ReduceOp::Sum), &[e], t)?;
    let t = tmp(cx, n, "log");
    let l = emit1(cx, &name, Op::Unary(UnaryOp::Log), &[s], t)?;
    let kept = if keep_dims {
        out_name(cx, n, 0)
    } else {
        tmp(cx, n, "kept")
    };
    let y = emit1(cx, &name, Op::Binary(BinaryOp::Add), &[l, m], kept)?;
    if keep_dims {
        return one(y);
    }
    let shape: Vec<usize> = cx
        .shape(&y)
        .iter()
        .enumerate()
        .filter(|(i, _)| !axes.contains(i))
        .map(|(_, &d)| d)
        .collect();
    reshape(cx, n, y, shape)
}

/// Activations ONNX defines by formulas, written with hzp's elementwise ops.
fn activation(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let op_type = n.p.op_type.clone();
    let name = n.ir_name.clone();
    let x = n.req(0)?.clone();
    let dt = cx.dtype(&x);
    if !dt.is_float() {
        return err(format!("{op_type} needs a float input, got {dt}"));
    }
    let mut b = Builder {
        cx,
        n,
        name: &name,
        dt,
    };
    let y = match op_type.as_str() {
        "LeakyRelu" | "PRelu" => {
            let slope = if op_type == "PRelu" {
                n.req(1)?.clone()
            } else {
                let a = n.attr_f("alpha", 0.01)?;
                b.k(a as f64)
            };
            let zero = b.k(0.0);
            let neg = b.bin(BinaryOp::Less, &x, &zero, "negative")?;
            let scaled = b.bin(BinaryOp::Mul, &x, &slope, "scaled")?;
            b.last(Op::Where, &[neg, scaled, x])?
        }
        "Elu" | "Selu" | "Celu" => {
            let default_alpha = if op_type == "Selu" { 1.673_263_2 } else { 1.0 };
            let alpha = n.attr_f("alpha", default_alpha)? as f64;
            // alpha * (exp(x / c) - 1) for x <= 0 (c = alpha for Celu, else 1), x above.
            let zero = b.k(0.0);
            let one_ = b.k(1.0);
            let arg = if op_type == "Celu" {
                let a = b.k(alpha);
                b.bin(BinaryOp::Div, &x, &a, "scaled_input")?
            } else {
                x.clone()
            };
            let e = b.un(UnaryOp::Exp, &arg, "exp")?;
            let em1 = b.bin(BinaryOp::Sub, &e, &one_, "expm1")?;
            let a = b.k(alpha);
            let negpart = b.bin(BinaryOp::Mul, &em1, &a, "negative_part")?;
            let pos = b.bin(BinaryOp::Greater, &x, &zero, "positive")?;
            if op_type == "Selu" {
                let gamma = n.attr_f("gamma", 1.050_701)? as f64;
                let inner = b.tmp(Op::Where, &[pos, x.clone(), negpart], "inner")?;
                let g = b.k(gamma);
                b.last(Op::Binary(BinaryOp::Mul), &[inner, g])?
            } else {
                b.last(Op::Where, &[pos, x.clone(), negpart])?
            }
        }
        "HardSigmoid" | "HardSwish" => {
            let (alpha, beta) = if op_type == "HardSwish" {
                (1.0 / 6.0, 0.5)
            } else {
                (
                    n.attr_f("alpha", 0.2)? as f64,
                    n.attr_f("beta", 0.5)? as f64,
                )
            };
            let (a, c, zero, one_) = (b.k(alpha), b.k(beta), b.k(0.0), b.k(1.0));
            let ax = b.bin(BinaryOp::Mul, &x, &a, "scaled")?;
            let axb = b.bin(BinaryOp::Add, &ax, &c, "shifted")?;
            let lo = b.bin(BinaryOp::Max, &axb, &zero, "clip_low")?;
            if op_type == "HardSigmoid" {
                b.last(Op::Binary(BinaryOp::Min), &[lo, one_])?
            } else {
                let hs = b.bin(BinaryOp::Min, &lo, &one_, "hard_sigmoid")?;
                b.last(Op::Binary(BinaryOp::Mul), &[x, hs])?
            }
        }
        "Softplus" | "Mish" => {
            // softplus(x) = max(x, 0) + log(1 + exp(-|x|)), stable for large |x|.
            let (zero, one_) = (b.k(0.0), b.k(1.0));
            let relu = b.bin(BinaryOp::Max, &x, &zero, "relu")?;
            let ab = b.un(UnaryOp::Abs, &x, "abs")?;
            let nab = b.un(UnaryOp::Neg, &ab, "neg_abs")?;
            let e = b.un(UnaryOp::Exp, &nab, "exp")?;
            let e1 = b.bin(BinaryOp::Add, &e, &one_, "exp_plus_1")?;
            let l = b.un(UnaryOp::Log, &e1, "log")?;
            if op_type == "Softplus" {
                b.last(Op::Binary(BinaryOp::Add), &[relu, l])?
            } else {
                let sp = b.bin(BinaryOp::Add, &relu, &l, "softplus")?;
                let t = b.un(UnaryOp::Tanh, &sp, "tanh")?;
                b.last(Op::Binary(BinaryOp::Mul), &[x, t])?
            }
        }
        "Softsign" => {
            let one_ = b.k(1.0);
            let ab = b.un(UnaryOp::Abs, &x, "abs")?;
            let d = b.bin(BinaryOp::Add, &ab, &one_, "denominator")?;
            b.last(Op::Binary(BinaryOp::Div), &[x, d])?
        }
        "ThresholdedRelu" => {
            let alpha = n.attr_f("alpha", 1.0)? as f64;
            let (a, zero) = (b.k(alpha), b.k(0.0));
            let above = b.bin(BinaryOp::Greater, &x, &a, "above")?;
            b.last(Op::Where, &[above, x, zero])?
        }
        _ => {
            // IsInf
            let pos = n.attr_i("detect_positive", 1)? != 0;
            let neg = n.attr_i("detect_negative", 1)? != 0;
            let mut hits = Vec::new();
            if pos {
                hits.push((b.k(f64::INFINITY), "is_pos_inf"));
            }
            if neg {
                hits.push((b.k(f64::NEG_INFINITY), "is_neg_inf"));
            }
            match hits.as_slice() {
                [] => {
                    let shape = b.cx.shape(&x);
                    let out = out_name(b.cx, n, 0);
                    b.cx.fill(&name, 0.0, DType::Bool, shape, out)?
                }
                [(k, _)] => b.last(Op::Binary(BinaryOp::Equal), &[x, k.clone()])?,
                [(k1, w1), (k2, w2), ..] => {
                    let p = b.bin(BinaryOp::Equal, &x, k1, w1)?;
                    let q = b.bin(BinaryOp::Equal, &x, k2, w2)?;
                    b.last(Op::Binary(BinaryOp::Or), &[p, q])?
                }
            }
        }
    };
    one(y)
}

/// A small helper for formulas: scalar constants of one dtype, intermediate and final ops.
struct Builder<'c, 'g, 'n, 'a> {
    cx: &'c mut Ctx<'g>,
    n: &'n NodeCx<'a>,
    name: &'n str,
    dt: DType,
}

impl Builder<'_, '_, '_, '_> {
    fn k(&mut self, v: f64) -> Slot {
        self.cx.scalar(self.dt, v, &format!("{}/const", self.name))
    }
    fn tmp(&mut self, op: Op, ins: &[Slot], what: &str) -> FResult<Slot> {
        let t = tmp(self.cx, self.n, what);
        emit1(self.cx, self.name, op, ins, t)
    }
    fn bin(&mut self, op: BinaryOp, a: &Slot, b: &Slot, what: &str) -> FResult<Slot> {
        self.tmp(Op::Binary(op), &[a.clone(), b.clone()], what)
    }
    fn un(&mut self, op: UnaryOp, a: &Slot, what: &str) -> FResult<Slot> {
        self.tmp(Op::Unary(op), std::slice::from_ref(a), what)
    }
    fn last(&mut self, op: Op, ins: &[Slot]) -> FResult<Slot> {
        let out = out_name(self.cx, self.n, 0);
        emit1(self.cx, self.name, op, ins, out)
    }
}

/// Pad in `constant` mode: negative pads crop (Slice), positive pads concatenate constant
/// blocks.
fn pad(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let mut x = n.req(0)?.clone();
    let mode = n.attr_s("mode")?.unwrap_or_else(|| "constant".into());
    if mode != "constant" {
        return unsupported(format!(
            "Pad mode `{mode}` is not supported (hzp pads with a constant)"
        ));
    }
    let r = cx.shape(&x).len();
    let pads = ints(cx.static_input(n, 1, "the pads")?, "the pads")?;
    let dt = cx.dtype(&x);
    let value = match n.input(2) {
        Some(_) => {
            let t = cx.static_input(n, 2, "the constant value")?;
            if t.numel() != 1 {
                return err("the constant value must have one element");
            }
            t.to_f64_vec()[0]
        }
        None => 0.0,
    };
    let axes = match n.input(3) {
        Some(_) => norm_axes(
            &ints(cx.static_input(n, 3, "the axes")?, "the axes")?,
            r,
            "axes",
        )?,
        None => (0..r).collect(),
    };
    if pads.len() != 2 * axes.len() {
        return err(format!(
            "pads {pads:?} must have two entries per axis ({} axes)",
            axes.len()
        ));
    }
    let k = axes.len();
    for (i, &a) in axes.iter().enumerate() {
        let (before, after) = (pads[i], pads[i + k]);
        if before == 0 && after == 0 {
            continue;
        }
        let dim = cx.shape(&x)[a] as i64;
        if before < 0 || after < 0 {
            let st = before.saturating_neg().max(0);
            let en = dim.saturating_sub(after.saturating_neg().max(0));
            if st > en {
                return err(format!("pads {pads:?} crop more than dim {a} holds"));
            }
            let t = tmp(cx, n, &format!("crop{a}"));
            let op = Op::Slice {
                axes: vec![a],
                starts: vec![st],
                ends: vec![en],
                steps: vec![1],
            };
            x = emit1(cx, &name, op, &[x], t)?;
        }
        let mut ins = Vec::new();
        for (amount, what) in [(before, "before"), (after, "after")] {
            if what == "after" {
                ins.push(x.clone());
            }
            if amount > 0 {
                let mut shape = cx.shape(&x);
                shape[a] = usize::try_from(amount)
                    .map_err(|_| node_err(format!("pad {amount} is too large")))?;
                let t = tmp(cx, n, &format!("pad{a}_{what}"));
                ins.push(cx.fill(&name, value, dt, shape, t)?);
            }
        }
        if ins.len() > 1 {
            let t = tmp(cx, n, &format!("padded{a}"));
            x = emit1(cx, &name, Op::Concat { axis: a }, &ins, t)?;
        }
    }
    one(x)
}

fn argmax(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let mut x = n.req(0)?.clone();
    let r = cx.shape(&x).len();
    let axis = norm_axis(n.attr_i("axis", 0)?, r, "axis")?;
    let keep_dims = n.attr_i("keepdims", 1)? != 0;
    let last = n.attr_i("select_last_index", 0)? != 0;
    let dim = cx.shape(&x)[axis];
    if last && dim > 1 {
        // The last extremum is the first one of the reversed axis.
        let t = tmp(cx, n, "reversed");
        let op = Op::Slice {
            axes: vec![axis],
            starts: vec![dim as i64 - 1],
            ends: vec![-1],
            steps: vec![-1],
        };
        x = emit1(cx, &n.ir_name, op, &[x], t)?;
    }
    if n.p.op_type == "ArgMin" {
        // The first minimum of x is the first maximum of -x.
        if cx.dtype(&x) == DType::Bool {
            return err("ArgMin of bool is not supported");
        }
        let t = tmp(cx, n, "neg");
        x = emit1(cx, &n.ir_name, Op::Unary(UnaryOp::Neg), &[x], t)?;
    }
    if !(last && dim > 1) {
        let out = out_name(cx, n, 0);
        return one(emit1(
            cx,
            &n.ir_name,
            Op::ArgMax { axis, keep_dims },
            &[x],
            out,
        )?);
    }
    let t = tmp(cx, n, "reversed_index");
    let i = emit1(cx, &n.ir_name, Op::ArgMax { axis, keep_dims }, &[x], t)?;
    let top = cx.scalar(DType::I64, dim as f64 - 1.0, &format!("{}/last", n.ir_name));
    let out = out_name(cx, n, 0);
    one(emit1(
        cx,
        &n.ir_name,
        Op::Binary(BinaryOp::Sub),
        &[top, i],
        out,
    )?)
}

/// The static shape of an ONNX Reshape (`0` copies the input dim unless `allowzero`, one
/// `-1` is inferred).
fn reshape_target(input: &[usize], target: &[i64], allowzero: bool) -> FResult<Vec<usize>> {
    let total: usize = input.iter().product();
    let product = |v: &[usize]| v.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let mut out = Vec::with_capacity(target.len());
    let mut infer = None;
    for (i, &d) in target.iter().enumerate() {
        if d == -1 {
            if infer.is_some() {
                return err(format!("target shape {target:?} has more than one -1"));
            }
            infer = Some(i);
            out.push(1);
        } else if d == 0 && !allowzero {
            let v = input.get(i).copied().ok_or_else(|| {
                node_err(format!(
                    "target shape {target:?} copies dim {i} (0), but the input {input:?} has rank {}",
                    input.len()
                ))
            })?;
            out.push(v);
        } else if d < 0 {
            return err(format!("target shape {target:?} has a negative dim {d}"));
        } else {
            out.push(d as usize);
        }
    }
    if let Some(i) = infer {
        let known = product(&out).unwrap_or(0);
        if total.checked_rem(known) != Some(0) {
            return err(format!(
                "cannot reshape {input:?} ({total} elements) to {target:?}"
            ));
        }
        out[i] = total / known;
    }
    if product(&out) != Some(total) {
        return err(format!(
            "cannot reshape {input:?} ({total} elements) to {target:?} ({:?})",
            out
        ));
    }
    Ok(out)
}

fn reshape(cx: &mut Ctx, n: &NodeCx, x: Slot, shape: Vec<usize>) -> FResult<Outs> {
    if cx.shape(&x) == shape {
        return one(x);
    }
    let out = out_name(cx, n, 0);
    one(emit1(cx, &n.ir_name, Op::Reshape { shape }, &[x], out)?)
}

fn slice(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let s = cx.shape(&x);
    let r = s.len();
    let starts = ints(cx.static_input(n, 1, "the starts")?, "the starts")?;
    let ends = ints(cx.static_input(n, 2, "the ends")?, "the ends")?;
    let axes = match n.input(3) {
        Some(_) => ints(cx.static_input(n, 3, "the axes")?, "the axes")?,
        None => (0..starts.len() as i64).collect(),
    };
    let steps = match n.input(4) {
        Some(_) => ints(cx.static_input(n, 4, "the steps")?, "the steps")?,
        None => vec![1; starts.len()],
    };
    if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
        return err(format!(
            "starts {starts:?}, ends {ends:?}, axes {axes:?} and steps {steps:?} differ in length"
        ));
    }
    let axes = norm_axes(&axes, r, "axes")?;
    let mut op_axes = Vec::new();
    let (mut op_starts, mut op_ends, mut op_steps) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..axes.len() {
        let a = axes[i];
        let dim = s[a] as i64;
        let step = steps[i];
        if step == 0 {
            return err("a step is 0");
        }
        if dim == 0 {
            continue; // empty either way
        }
        // A step longer than the dim selects at most one element either way; clamping it
        // keeps the length arithmetic from overflowing.
        let step = step.clamp(-dim.max(1), dim.max(1));
        let mut st = starts[i];
        let mut en = ends[i];
        if st < 0 {
            st = st.saturating_add(dim);
        }
        if en < 0 {
            en = en.saturating_add(dim);
        }
        if step > 0 {
            st = st.clamp(0, dim);
            en = en.clamp(0, dim);
        } else {
            st = st.clamp(0, (dim - 1).max(0));
            en = en.clamp(-1, dim - 1);
        }
        if step == 1 && st == 0 && en == dim {
            continue;
        }
        op_axes.push(a);
        op_starts.push(st);
        op_ends.push(en);
        op_steps.push(step);
    }
    if op_axes.is_empty() {
        return one(x);
    }
    let op = Op::Slice {
        axes: op_axes,
        starts: op_starts,
        ends: op_ends,
        steps: op_steps,
    };
    let out = out_name(cx, n, 0);
    one(emit1(cx, &n.ir_name, op, &[x], out)?)
}

fn split(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    let s = cx.shape(&x);
    let axis = norm_axis(n.attr_i("axis", 0)?, s.len(), "axis")?;
    let dim = s[axis];
    let sizes: Vec<usize> = if n.input(1).is_some() {
        non_neg(
            &ints(cx.static_input(n, 1, "the split sizes")?, "the split sizes")?,
            "the split sizes",
        )?
    } else if let Some(v) = n.attr_ints("split") {
        non_neg(&v, "the split sizes")?
    } else {
        let parts = match n.attr("num_outputs") {
            Some(a) => {
                a.i.ok_or_else(|| node_err("attribute `num_outputs` must be an integer"))?
            }
            None => n.n_outputs() as i64,
        };
        let parts = usize::try_from(parts)
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| node_err(format!("cannot split into {parts} parts")))?;
        let chunk = dim.div_ceil(parts);
        let mut v = vec![chunk; parts];
        let rest = dim as i64 - (chunk * (parts - 1)) as i64;
        if rest < 0 {
            return err(format!("cannot split a dim of {dim} into {parts} parts"));
        }
        v[parts - 1] = rest as usize;
        v
    };
    if sizes.len() != n.n_outputs() {
        return err(format!(
            "the split sizes {sizes:?} make {} parts, but the node has {} outputs",
            sizes.len(),
            n.n_outputs()
        ));
    }
    if sizes.iter().try_fold(0usize, |a, &b| a.checked_add(b)) != Some(dim) {
        return err(format!(
            "the split sizes {sizes:?} do not add up to dim {axis} of {s:?}"
        ));
    }
    if sizes.len() == 1 {
        return one(x);
    }
    let outs: Vec<String> = (0..sizes.len()).map(|k| out_name(cx, n, k)).collect();
    let r = cx.emit(&n.ir_name, Op::Split { axis, sizes }, &[x], outs)?;
    Ok(r.into_iter().map(Some).collect())
}

fn constant(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let a =
        n.p.attribute
            .first()
            .ok_or_else(|| node_err("Constant has no value attribute"))?;
    if n.p.attribute.len() != 1 {
        return err("Constant must have exactly one attribute");
    }
    let t = match a.name.as_str() {
        "value" => {
            let t =
                a.t.as_ref()
                    .ok_or_else(|| node_err("attribute `value` must be a tensor"))?;
            cx.decode(t, "attribute `value`")?
        }
        "value_float" => Tensor::scalar_f32(
            a.f.ok_or_else(|| node_err("attribute `value_float` must be a float"))?,
        ),
        "value_floats" => Tensor::f32(vec![a.floats.len()], a.floats.clone()),
        "value_int" => Tensor::scalar_i64(
            a.i.ok_or_else(|| node_err("attribute `value_int` must be an integer"))?,
        ),
        "value_ints" => Tensor::i64(vec![a.ints.len()], a.ints.clone()),
        other => {
            return unsupported(format!(
                "Constant with attribute `{other}` is not supported (hzp reads value, \
                 value_float(s) and value_int(s))"
            ))
        }
    };
    let out = out_name(cx, n, 0);
    one(cx.named_const(t, out))
}

fn range(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let start = cx.static_input(n, 0, "the start")?.clone();
    let limit = cx.static_input(n, 1, "the limit")?.clone();
    let delta = cx.static_input(n, 2, "the delta")?.clone();
    for (t, what) in [(&start, "start"), (&limit, "limit"), (&delta, "delta")] {
        if t.numel() != 1 {
            return err(format!("{what} must be a scalar, got shape {:?}", t.shape));
        }
    }
    let dtype = start.dtype();
    if limit.dtype() != dtype || delta.dtype() != dtype {
        return err("start, limit and delta must have one type");
    }
    let out = out_name(cx, n, 0);
    const MAX: i64 = 1 << 28;
    let t = if let (Some(s), Some(l), Some(d)) =
        (start.to_i64_vec(), limit.to_i64_vec(), delta.to_i64_vec())
    {
        let (s, l, d) = (s[0] as i128, l[0] as i128, d[0] as i128);
        if d == 0 {
            return err("delta is 0");
        }
        let count = ((l - s) + d - d.signum()) / d;
        let count = count.max(0);
        if count > MAX as i128 {
            return err(format!("Range would make {count} elements"));
        }
        if !cx.computes(count as u64 * 8 * 2) {
            return one(cx.placeholder(&n.ir_name, dtype, vec![count as usize], out)?);
        }
        cx.check_fold_budget(&format!("Range of {count} elements"), count as u64 * 8 * 2)?;
        if dtype == DType::I64 {
            let v: Vec<i64> = (0..count).map(|i| (s + i * d) as i64).collect();
            Tensor::i64(vec![v.len()], v)
        } else {
            let v: Vec<f64> = (0..count).map(|i| (s + i * d) as f64).collect();
            Tensor::from_f64(dtype, vec![v.len()], &v)
        }
    } else {
        let (s, l, d) = (
            start.to_f64_vec()[0],
            limit.to_f64_vec()[0],
            delta.to_f64_vec()[0],
        );
        if d == 0.0 || !d.is_finite() || !s.is_finite() || !l.is_finite() {
            return err(format!("cannot make a range from {s} to {l} by {d}"));
        }
        let count = ((l - s) / d).ceil().max(0.0);
        if count > MAX as f64 {
            return err(format!("Range would make {count} elements"));
        }
        let count = count as usize;
        if !cx.computes(count as u64 * 8 * 2) {
            return one(cx.placeholder(&n.ir_name, dtype, vec![count], out)?);
        }
        cx.check_fold_budget(&format!("Range of {count} elements"), count as u64 * 8 * 2)?;
        // Like ONNX's reference: start + i * delta, computed in the tensor's type.
        let v: Vec<f64> = (0..count).map(|i| s + i as f64 * d).collect();
        Tensor::from_f64(dtype, vec![count], &v)
    };
    one(cx.named_const(t, out))
}

/// Einsum with one or two operands, each letter at most once per operand (no diagonals),
/// `...` allowed where it covers dims of equal sizes. Written as ReduceSum (letters only one
/// operand has and the output lacks), Transpose/Reshape into one batched MatMul, and a
/// final Reshape/Transpose into the output's order.
fn einsum(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let eq = n
        .attr_s("equation")?
        .ok_or_else(|| node_err("Einsum needs the `equation` attribute"))?;
    let eq: String = eq.chars().filter(|c| !c.is_whitespace()).collect();
    let bad = |why: &str| {
        unsupported::<Outs>(format!(
            "Einsum equation `{eq}` is not supported ({why}; hzp takes one or two operands \
             without repeated letters)"
        ))
    };
    let ins: Vec<Slot> = n.ins.iter().flatten().cloned().collect();
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l.to_string(), Some(r.to_string())),
        None => (eq.clone(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != ins.len() || !(1..=2).contains(&ins.len()) {
        return bad(&format!("{} operands", ins.len()));
    }
    // Expand `...` into letters no term uses.
    let mut spare = ('A'..='Z').chain('a'..='z').filter(|c| !eq.contains(*c));
    let mut ell: Option<Vec<char>> = None;
    let mut ops: Vec<Vec<char>> = Vec::new();
    for (t, s) in terms.iter().zip(&ins) {
        let rank = cx.shape(s).len();
        let letters: Vec<char> = t.replace("...", "").chars().collect();
        if letters.iter().any(|c| !c.is_ascii_alphabetic()) {
            return bad("unexpected characters");
        }
        let v = if t.contains("...") {
            let k = rank
                .checked_sub(letters.len())
                .ok_or_else(|| node_err(format!("`{t}` does not fit rank {rank}")))?;
            let e = match &ell {
                Some(e) if e.len() == k => e.clone(),
                Some(_) => return bad("`...` covers different ranks"),
                None => {
                    let e: Vec<char> = (0..k).filter_map(|_| spare.next()).collect();
                    if e.len() != k {
                        return bad("too many dims");
                    }
                    ell = Some(e.clone());
                    e
                }
            };
            t.replace("...", &e.iter().collect::<String>())
                .chars()
                .collect()
        } else {
            letters
        };
        if v.len() != rank {
            return err(format!(
                "`{t}` has {} letters, but the operand has rank {rank}",
                v.len()
            ));
        }
        if v.iter().enumerate().any(|(i, c)| v[..i].contains(c)) {
            return bad("a repeated letter (diagonal)");
        }
        ops.push(v);
    }
    let out: Vec<char> = match rhs {
        Some(r) => {
            let e: String = ell.clone().unwrap_or_default().into_iter().collect();
            r.replace("...", &e).chars().collect()
        }
        None => {
            // Implicit output: `...` first, then the letters used once, sorted.
            let mut once: Vec<char> = ops
                .iter()
                .flatten()
                .copied()
                .filter(|c| ops.iter().flatten().filter(|d| *d == c).count() == 1)
                .filter(|c| !ell.as_ref().is_some_and(|e| e.contains(c)))
                .collect();
            once.sort_unstable();
            let mut o = ell.clone().unwrap_or_default();
            o.extend(once);
            o
        }
    };
    if out.iter().enumerate().any(|(i, c)| out[..i].contains(c))
        || out.iter().any(|c| !ops.iter().any(|o| o.contains(c)))
    {
        return bad("the output repeats a letter or has one no operand has");
    }
    // Letter sizes must agree.
    let mut size: Vec<(char, usize)> = Vec::new();
    for (o, s) in ops.iter().zip(&ins) {
        for (c, d) in o.iter().zip(cx.shape(s)) {
            match size.iter().find(|(l, _)| l == c) {
                Some((_, x)) if *x != d => {
                    return err(format!(
                        "letter `{c}` is {x} in one operand and {d} in another"
                    ))
                }
                Some(_) => {}
                None => size.push((*c, d)),
            }
        }
    }
    let dim = |c: char| {
        size.iter()
            .find(|(l, _)| *l == c)
            .map(|(_, d)| *d)
            .unwrap_or(1)
    };
    let name = n.ir_name.clone();

    // Sum away letters only one operand has and the output lacks.
    let mut vals = ins.clone();
    for i in 0..ops.len() {
        let others: Vec<char> = ops
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .flat_map(|(_, o)| o.clone())
            .collect();
        let gone: Vec<usize> = (0..ops[i].len())
            .filter(|&k| !out.contains(&ops[i][k]) && !others.contains(&ops[i][k]))
            .collect();
        if !gone.is_empty() {
            let t = tmp(cx, n, &format!("sum{i}"));
            let op = Op::Reduce {
                op: ReduceOp::Sum,
                axes: gone.clone(),
                keep_dims: false,
            };
            vals[i] = emit1(cx, &name, op, &[vals[i].clone()], t)?;
            let kept: Vec<char> = (0..ops[i].len())
                .filter(|k| !gone.contains(k))
                .map(|k| ops[i][k])
                .collect();
            ops[i] = kept;
        }
    }
    let permute = |cx: &mut Ctx, x: Slot, have: &[char], want: &[char], what: &str| {
        let perm: Vec<usize> = want
            .iter()
            .map(|c| have.iter().position(|h| h == c).unwrap_or(0))
            .collect();
        if perm.iter().copied().eq(0..perm.len()) {
            Ok(x)
        } else {
            let t = tmp(cx, n, what);
            emit1(cx, &name, Op::Transpose { perm }, &[x], t)
        }
    };
    let (cur, letters) = if ops.len() == 1 {
        (vals[0].clone(), ops[0].clone())
    } else {
        let (l, r) = (&ops[0], &ops[1]);
        let batch: Vec<char> = l
            .iter()
            .copied()
            .filter(|c| r.contains(c) && out.contains(c))
            .collect();
        let ms: Vec<char> = l.iter().copied().filter(|c| !r.contains(c)).collect();
        let ns: Vec<char> = r.iter().copied().filter(|c| !l.contains(c)).collect();
        let ks: Vec<char> = l
            .iter()
            .copied()
            .filter(|c| r.contains(c) && !out.contains(c))
            .collect();
        let prod = |v: &[char]| v.iter().map(|&c| dim(c)).product::<usize>();
        let bshape: Vec<usize> = batch.iter().map(|&c| dim(c)).collect();
        let order = |a: &[char], b: &[char], c: &[char]| -> Vec<char> {
            a.iter().chain(b).chain(c).copied().collect()
        };
        let a = permute(cx, vals[0].clone(), l, &order(&batch, &ms, &ks), "lhs")?;
        let mut sa = bshape.clone();
        sa.extend([prod(&ms), prod(&ks)]);
        let a = reshape_tmp(cx, n, a, sa, "lhs_matrix")?;
        let b = permute(cx, vals[1].clone(), r, &order(&batch, &ks, &ns), "rhs")?;
        let mut sb = bshape.clone();
        sb.extend([prod(&ks), prod(&ns)]);
        let b = reshape_tmp(cx, n, b, sb, "rhs_matrix")?;
        let t = tmp(cx, n, "matmul");
        let y = emit1(cx, &name, Op::MatMul, &[a, b], t)?;
        let letters = order(&batch, &ms, &ns);
        let shape: Vec<usize> = letters.iter().map(|&c| dim(c)).collect();
        (reshape_tmp(cx, n, y, shape, "product")?, letters)
    };
    one(permute(cx, cur, &letters, &out, "output")?)
}

fn reshape_tmp(cx: &mut Ctx, n: &NodeCx, x: Slot, shape: Vec<usize>, what: &str) -> FResult<Slot> {
    if cx.shape(&x) == shape {
        return Ok(x);
    }
    let t = tmp(cx, n, what);
    emit1(cx, &n.ir_name, Op::Reshape { shape }, &[x], t)
}

/// Largest padded spatial dim Conv takes (keeps its index arithmetic far from overflow).
const MAX_PAD_DIM: usize = 1 << 40;

/// Conv (1-D, 2-D, 3-D, ...; groups, strides, dilations, pads, auto_pad) written as one
/// batched MatMul of the weights with the input's patches (im2col). The patches come from
/// a Reshape/Transpose when the stride equals the kernel (patch embeddings: ViT, CLIP),
/// else from one strided Slice per kernel offset. Padding is zeros concatenated beside the
/// input. The weight keeps its ONNX layout (it is only reshaped), so a trainable weight
/// stays the parameter the file names.
fn conv(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let x = n.req(0)?.clone();
    let w = n.req(1)?.clone();
    let bias = n.input(2).cloned();
    let (xs, ws) = (cx.shape(&x), cx.shape(&w));
    if xs.len() < 3 || ws.len() != xs.len() {
        return err(format!(
            "Conv needs an input [N, C, D...] and a weight [M, C/group, K...] of the same rank \
             (at least 3), got {xs:?} and {ws:?}"
        ));
    }
    let sp = xs.len() - 2; // spatial dims
    let (batch, chans, m) = (xs[0], xs[1], ws[0]);
    let kernel = ws[2..].to_vec();
    if kernel.contains(&0) {
        return err(format!("the weight {ws:?} has an empty kernel"));
    }
    if let Some(k) = n.attr_ints("kernel_shape") {
        if non_neg(&k, "kernel_shape")? != kernel {
            return err(format!(
                "kernel_shape {k:?} differs from the weight's {kernel:?}"
            ));
        }
    }
    let g = n.attr_i("group", 1)?;
    let g = usize::try_from(g)
        .ok()
        .filter(|&g| g > 0)
        .ok_or_else(|| node_err(format!("group {g} must be positive")))?;
    if chans % g != 0 || m % g != 0 || ws[1].checked_mul(g) != Some(chans) {
        return err(format!(
            "{chans} input channels, weight {ws:?} and group {g} do not fit together"
        ));
    }
    let per_axis = |attr: &str, default: usize| -> FResult<Vec<usize>> {
        match n.attr_ints(attr) {
            Some(v) if !v.is_empty() => {
                let v = non_neg(&v, attr)?;
                if v.len() != sp || v.contains(&0) {
                    return err(format!("{attr} {v:?} must be {sp} positive numbers"));
                }
                Ok(v)
            }
            _ => Ok(vec![default; sp]),
        }
    };
    let strides = per_axis("strides", 1)?;
    let dil = per_axis("dilations", 1)?;
    // Extent of the dilated kernel along each axis.
    let ext: Vec<usize> = (0..sp)
        .map(|i| dil[i].saturating_mul(kernel[i] - 1).saturating_add(1))
        .collect();
    let auto_pad = n.attr_s("auto_pad")?.unwrap_or_else(|| "NOTSET".into());
    let (mut pb, mut pe) = (vec![0usize; sp], vec![0usize; sp]);
    match auto_pad.as_str() {
        "NOTSET" => {
            if let Some(p) = n.attr_ints("pads").filter(|p| !p.is_empty()) {
                let p = non_neg(&p, "pads")?;
                if p.len() != 2 * sp {
                    return err(format!("pads {p:?} must have {} entries", 2 * sp));
                }
                pb = p[..sp].to_vec();
                pe = p[sp..].to_vec();
            }
        }
        "VALID" => {}
        "SAME_UPPER" | "SAME_LOWER" => {
            for i in 0..sp {
                let d = xs[2 + i];
                let out = d.div_ceil(strides[i]);
                let total = ((out.max(1) - 1).saturating_mul(strides[i]))
                    .saturating_add(ext[i])
                    .saturating_sub(d);
                let small = total / 2;
                (pb[i], pe[i]) = if auto_pad == "SAME_UPPER" {
                    (small, total - small)
                } else {
                    (total - small, small)
                };
            }
        }
        other => return err(format!("unknown auto_pad `{other}`")),
    }
    let mut out_sp = Vec::with_capacity(sp);
    for i in 0..sp {
        let padded = xs[2 + i].saturating_add(pb[i]).saturating_add(pe[i]);
        if padded < ext[i] || padded > MAX_PAD_DIM {
            return err(format!(
                "the kernel {kernel:?} (dilations {dil:?}) does not fit the padded input {xs:?}"
            ));
        }
        out_sp.push((padded - ext[i]) / strides[i] + 1);
    }
    let dt = cx.dtype(&x);

    // Zero padding.
    let mut xp = x;
    for i in 0..sp {
        let a = 2 + i;
        let mut parts = Vec::new();
        for (amount, after) in [(pb[i], false), (pe[i], true)] {
            if after {
                parts.push(xp.clone());
            }
            if amount > 0 {
                let mut s = cx.shape(&xp);
                s[a] = amount;
                let t = tmp(cx, n, &format!("pad{a}"));
                parts.push(cx.fill(&name, 0.0, dt, s, t)?);
            }
        }
        if parts.len() > 1 {
            let t = tmp(cx, n, &format!("padded{a}"));
            xp = emit1(cx, &name, Op::Concat { axis: a }, &parts, t)?;
        }
    }

    let k: usize = kernel.iter().product();
    let l: usize = out_sp.iter().product();
    let cg = chans / g;
    // Patches as [N, C, K, L] (kernel offsets row-major, then output positions).
    let patches = if strides == kernel && dil.iter().all(|&d| d == 1) {
        // Non-overlapping patches: crop to whole patches, split each axis into
        // (position, offset) and move the offsets before the positions.
        let whole: Vec<usize> = (0..sp).map(|i| out_sp[i] * kernel[i]).collect();
        let ps = cx.shape(&xp);
        if ps[2..] != whole[..] {
            let t = tmp(cx, n, "whole_patches");
            let op = Op::Slice {
                axes: (2..2 + sp).collect(),
                starts: vec![0; sp],
                ends: whole.iter().map(|&d| d as i64).collect(),
                steps: vec![1; sp],
            };
            xp = emit1(cx, &name, op, &[xp], t)?;
        }
        let mut split = vec![batch, chans];
        for i in 0..sp {
            split.push(out_sp[i]);
            split.push(kernel[i]);
        }
        let t = reshape_tmp(cx, n, xp, split, "patch_grid")?;
        let mut perm = vec![0, 1];
        perm.extend((0..sp).map(|i| 3 + 2 * i));
        perm.extend((0..sp).map(|i| 2 + 2 * i));
        let t = if perm.iter().copied().eq(0..perm.len()) {
            t
        } else {
            let o = tmp(cx, n, "patch_offsets_first");
            emit1(cx, &name, Op::Transpose { perm }, &[t], o)?
        };
        reshape_tmp(cx, n, t, vec![batch, chans, k, l], "patches")?
    } else {
        let mut cols = Vec::with_capacity(k);
        for off in 0..k {
            // Row-major kernel offset of index `off`.
            let mut rem = off;
            let mut idx = vec![0usize; sp];
            for i in (0..sp).rev() {
                idx[i] = rem % kernel[i];
                rem /= kernel[i];
            }
            let starts: Vec<i64> = (0..sp).map(|i| (idx[i] * dil[i]) as i64).collect();
            let ends: Vec<i64> = (0..sp)
                .map(|i| (idx[i] * dil[i] + (out_sp[i] - 1) * strides[i] + 1) as i64)
                .collect();
            let op = Op::Slice {
                axes: (2..2 + sp).collect(),
                starts,
                ends,
                steps: strides.iter().map(|&s| s as i64).collect(),
            };
            let t = tmp(cx, n, &format!("offset{off}"));
            let s = emit1(cx, &name, op, std::slice::from_ref(&xp), t)?;
            cols.push(reshape_tmp(
                cx,
                n,
                s,
                vec![batch, chans, 1, l],
                &format!("offset{off}_flat"),
            )?);
        }
        if cols.len() == 1 {
            cols.pop().unwrap_or_else(|| unreachable!())
        } else {
            let t = tmp(cx, n, "patches");
            emit1(cx, &name, Op::Concat { axis: 2 }, &cols, t)?
        }
    };
    let patches = reshape_tmp(cx, n, patches, vec![batch, g, cg * k, l], "patch_rows")?;
    let wm = reshape_tmp(cx, n, w, vec![g, m / g, cg * k], "weight_rows")?;
    let t = tmp(cx, n, "matmul");
    let y = emit1(cx, &name, Op::MatMul, &[wm, patches], t)?;
    let mut shape = vec![batch, m];
    shape.extend(&out_sp);
    match bias {
        None => reshape(cx, n, y, shape),
        Some(b) => {
            let y = reshape_tmp(cx, n, y, shape, "unbiased")?;
            let mut bs = vec![m];
            bs.extend(vec![1; sp]);
            let b = reshape_tmp(cx, n, b, bs, "bias")?;
            let out = out_name(cx, n, 0);
            one(emit1(cx, &name, Op::Binary(BinaryOp::Add), &[y, b], out)?)
        }
    }
}

/// `Where(IsNaN(s), 0, s)` with `s = Softmax(x)`: how both exporters write PyTorch's "safe"
/// softmax of attention (a row whose every score is masked to -inf gives zeros, not NaN).
/// Returns `x` and the softmax axis. Kept as written, such a row's NaNs would still reach
/// the gradient (the softmax backward multiplies by its NaN output), so the pattern is
/// rebuilt by [`safe_softmax`].
fn nan_guarded_softmax(cx: &Ctx, ins: &[Slot; 3]) -> Option<(Slot, usize)> {
    let (Slot::Val(c), Slot::Val(s)) = (&ins[0], &ins[2]) else {
        return None;
    };
    let zero = ins[1].as_const()?;
    if zero.numel() != 1 || zero.to_f64_vec()[0] != 0.0 {
        return None;
    }
    let p = &cx.prog;
    let guard = p.node(p.producer(*c)?);
    if guard.op != Op::Unary(UnaryOp::IsNaN) || guard.inputs[0] != *s {
        return None;
    }
    let sm = p.node(p.producer(*s)?);
    match sm.op {
        Op::Softmax { axis } => Some((Slot::Val(sm.inputs[0]), axis)),
        _ => None,
    }
}

/// Whether `x` is attention scores plus a constant mask none of whose rows along `axis` is
/// all -inf (a causal mask): `Add(scores, mask)` with the scores a MatMul, possibly scaled
/// by a constant. Then no softmax row over `axis` can be fully masked.
fn never_fully_masked(cx: &Ctx, x: &Slot, axis: usize) -> bool {
    let Slot::Val(x) = x else {
        return false;
    };
    let p = &cx.prog;
    let Some(add) = p.producer(*x).map(|i| p.node(i)) else {
        return false;
    };
    if add.op != Op::Binary(BinaryOp::Add) {
        return false;
    }
    let rank = p.ty(*x).rank();
    let is_scores = |v: hzp_ir::ValueId| {
        let Some(node) = p.producer(v).map(|i| p.node(i)) else {
            return false;
        };
        match node.op {
            Op::MatMul => true,
            Op::Binary(BinaryOp::Mul | BinaryOp::Div) => {
                node.inputs
                    .iter()
                    .any(|&i| p.producer(i).is_some_and(|j| p.node(j).op == Op::MatMul))
                    && node.inputs.iter().any(|&i| p.const_data(i).is_some())
            }
            _ => false,
        }
    };
    let (a, b) = (add.inputs[0], add.inputs[1]);
    let (scores, mask) = match (p.const_data(a), p.const_data(b)) {
        (None, Some(m)) => (a, m),
        (Some(m), None) => (b, m),
        _ => return false,
    };
    if !is_scores(scores) || mask.shape.len() > rank {
        return false;
    }
    // The mask as rank `rank`; a row along `axis` is all -inf iff every element of it is.
    let mut shape = vec![1; rank - mask.shape.len()];
    shape.extend(&mask.shape);
    let len = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let vals = mask.to_f64_vec();
    if len == 0 || inner == 0 {
        return false;
    }
    let outer = vals.len() / (len * inner);
    for o in 0..outer {
        for i in 0..inner {
            if (0..len).all(|k| vals[(o * len + k) * inner + i] == f64::NEG_INFINITY) {
                return false;
            }
        }
    }
    true
}

/// Softmax over `axis` that gives zeros for a row of only -inf (ONNX Attention's and
/// PyTorch's convention) with finite gradients: such rows are detected on the input (max
/// is -inf), zeroed before the softmax and zeroed again after it.
fn safe_softmax(cx: &mut Ctx, n: &NodeCx, x: Slot, axis: usize, out: String) -> FResult<Slot> {
    let name = n.ir_name.clone();
    let dt = cx.dtype(&x);
    let mut b = Builder {
        cx,
        n,
        name: &name,
        dt,
    };
    let max = b.tmp(
        Op::Reduce {
            op: ReduceOp::Max,
            axes: vec![axis],
            keep_dims: true,
        },
        std::slice::from_ref(&x),
        "row_max",
    )?;
    let ninf = b.k(f64::NEG_INFINITY);
    let zero = b.k(0.0);
    let dead = b.bin(BinaryOp::Equal, &max, &ninf, "row_masked")?;
    let finite = b.tmp(Op::Where, &[dead.clone(), zero.clone(), x], "finite_rows")?;
    let y = b.tmp(Op::Softmax { axis }, &[finite], "softmax")?;
    emit1(b.cx, &name, Op::Where, &[dead, zero, y], out)
}

/// Swish (opset 24): x * sigmoid(alpha * x).
fn swish(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let x = n.req(0)?.clone();
    let alpha = n.attr_f("alpha", 1.0)? as f64;
    let dt = cx.dtype(&x);
    if !dt.is_float() {
        return err(format!("Swish needs a float input, got {dt}"));
    }
    let mut b = Builder {
        cx,
        n,
        name: &name,
        dt,
    };
    if alpha == 1.0 {
        return one(b.last(Op::Unary(UnaryOp::Silu), &[x])?);
    }
    let a = b.k(alpha);
    let ax = b.bin(BinaryOp::Mul, &x, &a, "scaled")?;
    let s = b.un(UnaryOp::Sigmoid, &ax, "sigmoid")?;
    one(b.last(Op::Binary(BinaryOp::Mul), &[x, s])?)
}

/// [B, S, H*D] -> [B, H, S, D].
fn split_heads(cx: &mut Ctx, n: &NodeCx, x: Slot, heads: usize, what: &str) -> FResult<Slot> {
    let s = cx.shape(&x);
    if heads == 0 || !s[2].is_multiple_of(heads) {
        return err(format!(
            "{what} of shape {s:?} does not split into {heads} heads"
        ));
    }
    let x = reshape_tmp(cx, n, x, vec![s[0], s[1], heads, s[2] / heads], what)?;
    let t = tmp(cx, n, &format!("{what}_heads"));
    emit1(
        cx,
        &n.ir_name,
        Op::Transpose {
            perm: vec![0, 2, 1, 3],
        },
        &[x],
        t,
    )
}

/// An additive [q, kv] bias of 0 (attend) and -inf: key j is visible from query i when
/// `allowed(i, j)`.
fn position_bias(q: usize, kv: usize, allowed: impl Fn(i64, i64) -> bool) -> Tensor {
    let mut v = Vec::with_capacity(q * kv);
    for i in 0..q as i64 {
        for j in 0..kv as i64 {
            v.push(if allowed(i, j) {
                0.0
            } else {
                f32::NEG_INFINITY
            });
        }
    }
    Tensor::f32(vec![q, kv], v)
}

/// Attention (opsets 23-25): scaled dot-product attention with grouped KV heads, a boolean
/// or additive mask (padded with "masked" up to the key length), causal and sliding-window
/// masks aligned to the end of a past cache, soft-capping, key padding by
/// `nonpad_kv_seqlen`, and a past cache (the present outputs are the concatenations). A row
/// with every key masked gives zeros. Written with MatMul, Softmax and elementwise ops.
fn attention(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let (mut q, mut k, mut v) = (n.req(0)?.clone(), n.req(1)?.clone(), n.req(2)?.clone());
    let rank = cx.shape(&q).len();
    if !(rank == 3 || rank == 4) || cx.shape(&k).len() != rank || cx.shape(&v).len() != rank {
        return err(format!(
            "Q, K and V must all be rank 3 or all rank 4, got {:?}, {:?}, {:?}",
            cx.shape(&q),
            cx.shape(&k),
            cx.shape(&v)
        ));
    }
    let dt = cx.dtype(&q);
    if !dt.is_float() {
        return err(format!("Attention needs float inputs, got {dt}"));
    }
    if rank == 3 {
        let heads = |a: &str| -> FResult<usize> {
            let h = n.attr_i(a, 0)?;
            usize::try_from(h)
                .ok()
                .filter(|&h| h > 0)
                .ok_or_else(|| node_err(format!("3-D inputs need a positive `{a}`, got {h}")))
        };
        let (qh, kvh) = (heads("q_num_heads")?, heads("kv_num_heads")?);
        q = split_heads(cx, n, q, qh, "q")?;
        k = split_heads(cx, n, k, kvh, "k")?;
        v = split_heads(cx, n, v, kvh, "v")?;
    }
    let mut past_len = 0usize;
    match (n.input(4).cloned(), n.input(5).cloned()) {
        (Some(pk), Some(pv)) => {
            if n.input(6).is_some() {
                return err("nonpad_kv_seqlen cannot be combined with a past cache");
            }
            past_len = cx.shape(&pk).get(2).copied().unwrap_or(0);
            let t = tmp(cx, n, "key");
            k = emit1(cx, &name, Op::Concat { axis: 2 }, &[pk, k], t)?;
            let t = tmp(cx, n, "value");
            v = emit1(cx, &name, Op::Concat { axis: 2 }, &[pv, v], t)?;
        }
        (None, None) => {}
        _ => return err("past_key and past_value must be given together"),
    }
    let (qs, ks, vs) = (cx.shape(&q), cx.shape(&k), cx.shape(&v));
    let (batch, qh, tq, hd) = (qs[0], qs[1], qs[2], qs[3]);
    let (kvh, tk) = (ks[1], ks[2]);
    if vs[1] != kvh || vs[2] != tk || ks[3] != hd || kvh == 0 || qh % kvh != 0 {
        return err(format!(
            "Q {qs:?}, K {ks:?} and V {vs:?} (as [batch, heads, sequence, head size]) do not \
             fit together"
        ));
    }
    let mut outs: Outs = vec![None; n.n_outputs().max(1)];
    let wanted = |i: usize| n.p.output.get(i).is_some_and(|o| !o.is_empty());
    if wanted(1) {
        outs[1] = Some(k.clone());
    }
    if wanted(2) {
        outs[2] = Some(v.clone());
    }
    // Grouped KV heads: each KV head serves qh / kvh consecutive query heads.
    if qh != kvh {
        let r = qh / kvh;
        for (x, what) in [(&mut k, "key"), (&mut v, "value")] {
            let s = cx.shape(x);
            let t = reshape_tmp(
                cx,
                n,
                x.clone(),
                vec![s[0], s[1], 1, s[2], s[3]],
                &format!("{what}_groups"),
            )?;
            let e = tmp(cx, n, &format!("{what}_repeated"));
            let t = emit1(
                cx,
                &name,
                Op::Expand {
                    shape: vec![s[0], s[1], r, s[2], s[3]],
                },
                &[t],
                e,
            )?;
            *x = reshape_tmp(
                cx,
                n,
                t,
                vec![s[0], qh, s[2], s[3]],
                &format!("{what}_per_head"),
            )?;
        }
    }
    let scale = match n.attr("scale") {
        Some(_) => n.attr_f("scale", 1.0)? as f64,
        None => 1.0 / (hd as f64).sqrt(),
    };
    let mut b = Builder {
        cx,
        n,
        name: &name,
        dt,
    };
    let kt = b.tmp(
        Op::Transpose {
            perm: vec![0, 1, 3, 2],
        },
        &[k],
        "key_t",
    )?;
    let qk = b.tmp(Op::MatMul, &[q, kt], "qk")?;
    let sc = b.k(scale);
    let mut scores = b.bin(BinaryOp::Mul, &qk, &sc, "scores")?;
    let raw_scores = scores.clone();
    let softcap = n.attr_f("softcap", 0.0)? as f64;
    if softcap > 0.0 {
        let c = b.k(softcap);
        let d = b.bin(BinaryOp::Div, &scores, &c, "capped_in")?;
        let t = b.un(UnaryOp::Tanh, &d, "capped_tanh")?;
        scores = b.bin(BinaryOp::Mul, &t, &c, "capped")?;
    }
    // The additive bias.
    let ninf = b.k(f64::NEG_INFINITY);
    let zero = b.k(0.0);
    let mut bias: Option<Slot> = None;
    let mut runtime_mask = false;
    if let Some(mask) = n.input(3).cloned() {
        runtime_mask |= mask.as_const().is_none();
        let mut m = if b.cx.dtype(&mask) == DType::Bool {
            b.tmp(Op::Where, &[mask, zero.clone(), ninf.clone()], "mask_bias")?
        } else if b.cx.dtype(&mask) != dt {
            b.tmp(Op::Cast { to: dt }, &[mask], "mask_bias")?
        } else {
            mask
        };
        let ms = b.cx.shape(&m);
        let last = ms.last().copied().unwrap_or(0);
        if ms.is_empty() || last > tk {
            return err(format!(
                "attn_mask of shape {ms:?} is longer than the {tk} keys"
            ));
        }
        if last < tk {
            let mut ps = ms.clone();
            *ps.last_mut().unwrap_or(&mut 0) = tk - last;
            let t = tmp(b.cx, n, "mask_pad");
            let pad = b.cx.fill(&name, f64::NEG_INFINITY, dt, ps, t)?;
            let axis = ms.len() - 1;
            m = b.tmp(Op::Concat { axis }, &[m, pad], "mask_padded")?;
        }
        bias = Some(m);
    }
    let offset = past_len as i64;
    let mut add_bias = |b: &mut Builder, t: Slot, what: &str| -> FResult<()> {
        bias = Some(match bias.take() {
            None => t,
            Some(prev) => b.bin(BinaryOp::Add, &prev, &t, what)?,
        });
        Ok(())
    };
    if n.attr_i("is_causal", 0)? != 0 {
        if n.input(6).is_some() {
            return unsupported(
                "Attention with is_causal and nonpad_kv_seqlen (a static KV cache) is not \
                 supported",
            );
        }
        let t = position_bias(tq, tk, |i, j| j <= i + offset);
        let c = b.cx.konst(t, &format!("{name}/causal"));
        add_bias(&mut b, c, "causal_bias")?;
    }
    let (left, right) = (
        n.attr_i("left_window_size", -1)?,
        n.attr_i("right_window_size", -1)?,
    );
    if left >= 0 || right >= 0 {
        if n.input(6).is_some() {
            return unsupported(
                "Attention with a sliding window and nonpad_kv_seqlen is not supported",
            );
        }
        let t = position_bias(tq, tk, |i, j| {
            let d = i + offset - j;
            (left < 0 || d <= left) && (right < 0 || -d <= right)
        });
        let c = b.cx.konst(t, &format!("{name}/window"));
        add_bias(&mut b, c, "window_bias")?;
    }
    if let Some(lens) = n.input(6).cloned() {
        runtime_mask |= lens.as_const().is_none();
        let pos = Tensor::i64(vec![1, tk], (0..tk as i64).collect());
        let pos = b.cx.konst(pos, &format!("{name}/key_positions"));
        let lens = reshape_tmp(b.cx, n, lens, vec![batch, 1], "kv_lengths")?;
        let lens = if b.cx.dtype(&lens) == DType::I64 {
            lens
        } else {
            b.tmp(Op::Cast { to: DType::I64 }, &[lens], "kv_lengths_i64")?
        };
        let valid = b.bin(BinaryOp::Less, &pos, &lens, "key_valid")?;
        let valid = reshape_tmp(b.cx, n, valid, vec![batch, 1, 1, tk], "key_valid_4d")?;
        let t = b.tmp(
            Op::Where,
            &[valid, zero.clone(), ninf.clone()],
            "padding_bias",
        )?;
        add_bias(&mut b, t, "bias")?;
    }
    if let Some(bias) = &bias {
        scores = b.bin(BinaryOp::Add, &scores, bias, "masked_scores")?;
    }
    // A row can be fully masked only with a run-time mask or a constant bias that has one.
    let fully_masked_row = runtime_mask
        || bias.as_ref().and_then(|s| s.as_const()).is_some_and(|t| {
            let s = t.shape.clone();
            let last = s.last().copied().unwrap_or(1).max(1);
            t.to_f64_vec()
                .chunks(last)
                .any(|row| row.iter().all(|&x| x == f64::NEG_INFINITY))
        })
        || bias.as_ref().is_some_and(|s| s.as_const().is_none());
    let t = tmp(b.cx, n, "probs");
    let probs = if fully_masked_row {
        safe_softmax(b.cx, n, scores, 3, t)?
    } else {
        emit1(b.cx, &name, Op::Softmax { axis: 3 }, &[scores], t)?
    };
    if wanted(3) {
        outs[3] = Some(match n.attr_i("qk_matmul_output_mode", 0)? {
            0 if softcap <= 0.0 => raw_scores,
            3 => probs.clone(),
            m => {
                return unsupported(format!(
                    "Attention's qk_matmul_output with qk_matmul_output_mode {m} is not \
                     supported (hzp gives mode 0 without softcap, and mode 3)"
                ))
            }
        });
    }
    let y = if rank == 4 {
        let out = out_name(b.cx, n, 0);
        emit1(b.cx, &name, Op::MatMul, &[probs, v], out)?
    } else {
        let y = b.tmp(Op::MatMul, &[probs, v], "heads_out")?;
        let y = b.tmp(
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            &[y],
            "heads_last",
        )?;
        let dv = b.cx.shape(&y)[3];
        let out = out_name(b.cx, n, 0);
        emit1(
            b.cx,
            &name,
            Op::Reshape {
                shape: vec![batch, tq, qh * dv],
            },
            &[y],
            out,
        )?
    };
    outs[0] = Some(y);
    Ok(outs)
}

/// RotaryEmbedding (opset 23): rotates the first `rotary_embedding_dim` (default all) dims
/// of each head by the cos/sin caches, taken at `position_ids` when given (else the caches
/// are per position already), in halves or interleaved pairs.
fn rotary_embedding(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let x = n.req(0)?.clone();
    let (mut cos, mut sin) = (n.req(1)?.clone(), n.req(2)?.clone());
    let xs = cx.shape(&x);
    let dt = cx.dtype(&x);
    // As [B, S, H, D].
    let x4 = match xs.len() {
        4 => {
            let t = tmp(cx, n, "seq_major");
            emit1(
                cx,
                &name,
                Op::Transpose {
                    perm: vec![0, 2, 1, 3],
                },
                &[x],
                t,
            )?
        }
        3 => {
            let h = n.attr_i("num_heads", 0)?;
            let h = usize::try_from(h)
                .ok()
                .filter(|&h| h > 0 && xs[2].is_multiple_of(h))
                .ok_or_else(|| {
                    node_err(format!(
                        "a 3-D input {xs:?} needs `num_heads` dividing its last dim, got {h}"
                    ))
                })?;
            reshape_tmp(cx, n, x, vec![xs[0], xs[1], h, xs[2] / h], "heads")?
        }
        r => return err(format!("the input must have rank 3 or 4, got rank {r}")),
    };
    let s4 = cx.shape(&x4);
    let (bsz, seq, heads, hd) = (s4[0], s4[1], s4[2], s4[3]);
    let rd = match n.attr_i("rotary_embedding_dim", 0)? {
        0 => hd,
        d => usize::try_from(d)
            .ok()
            .filter(|&d| d <= hd && d % 2 == 0)
            .ok_or_else(|| node_err(format!("rotary_embedding_dim {d} does not fit {hd}")))?,
    };
    let half = rd / 2;
    if let Some(pos) = n.input(3).cloned() {
        let t = tmp(cx, n, "cos");
        cos = emit1(cx, &name, Op::Gather { axis: 0 }, &[cos, pos.clone()], t)?;
        let t = tmp(cx, n, "sin");
        sin = emit1(cx, &name, Op::Gather { axis: 0 }, &[sin, pos], t)?;
    }
    for c in [&cos, &sin] {
        let cs = cx.shape(c);
        if cs.len() != 3 || cs[2] != half {
            return err(format!(
                "the cos/sin caches give {cs:?} per token, expected [batch, sequence, {half}]"
            ));
        }
    }
    let (cs, ss) = (cx.shape(&cos), cx.shape(&sin));
    cos = reshape_tmp(cx, n, cos, vec![cs[0], cs[1], 1, half], "cos_4d")?;
    sin = reshape_tmp(cx, n, sin, vec![ss[0], ss[1], 1, half], "sin_4d")?;
    let slice = |cx: &mut Ctx, x: &Slot, st: usize, en: usize, step: i64, what: &str| {
        let t = tmp(cx, n, what);
        let op = Op::Slice {
            axes: vec![3],
            starts: vec![st as i64],
            ends: vec![en as i64],
            steps: vec![step],
        };
        emit1(cx, &name, op, std::slice::from_ref(x), t)
    };
    let rot = if rd == hd {
        x4.clone()
    } else {
        slice(cx, &x4, 0, rd, 1, "rotated_part")?
    };
    let interleaved = n.attr_i("interleaved", 0)? != 0;
    let (x1, x2) = if interleaved {
        (
            slice(cx, &rot, 0, rd, 2, "even")?,
            slice(cx, &rot, 1, rd, 2, "odd")?,
        )
    } else {
        (
            slice(cx, &rot, 0, half, 1, "first_half")?,
            slice(cx, &rot, half, rd, 1, "second_half")?,
        )
    };
    let mut b = Builder {
        cx,
        n,
        name: &name,
        dt,
    };
    let c1 = b.bin(BinaryOp::Mul, &cos, &x1, "cos_x1")?;
    let s2 = b.bin(BinaryOp::Mul, &sin, &x2, "sin_x2")?;
    let real = b.bin(BinaryOp::Sub, &c1, &s2, "real")?;
    let s1 = b.bin(BinaryOp::Mul, &sin, &x1, "sin_x1")?;
    let c2 = b.bin(BinaryOp::Mul, &cos, &x2, "cos_x2")?;
    let imag = b.bin(BinaryOp::Add, &s1, &c2, "imag")?;
    let rotated = if interleaved {
        let pair = vec![bsz, seq, heads, half, 1];
        let r = reshape_tmp(b.cx, n, real, pair.clone(), "real_pair")?;
        let i = reshape_tmp(b.cx, n, imag, pair, "imag_pair")?;
        let p = b.tmp(Op::Concat { axis: 4 }, &[r, i], "pairs")?;
        reshape_tmp(b.cx, n, p, vec![bsz, seq, heads, rd], "rotated")?
    } else {
        b.tmp(Op::Concat { axis: 3 }, &[real, imag], "rotated")?
    };
    let y = if rd == hd {
        rotated
    } else {
        let rest = slice(b.cx, &x4, rd, hd, 1, "passed_part")?;
        b.tmp(Op::Concat { axis: 3 }, &[rotated, rest], "joined")?
    };
    if xs.len() == 4 {
        one(b.last(
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            &[y],
        )?)
    } else {
        reshape(b.cx, n, y, xs)
    }
}
