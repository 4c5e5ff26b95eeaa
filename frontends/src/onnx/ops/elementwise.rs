//! Elementwise ops: unary and binary maps, casts, activations, Pow, Mod, Where, Clip, Dropout.

use super::norm::{nan_guarded_softmax, never_fully_masked, safe_softmax};
use super::*;

/// The default-domain ONNX ops of this family and their rules.
pub(super) const OPS: &[(&str, Rule)] = &[
    ("Abs", unary_rule),
    ("Add", binary_rule),
    ("And", binary_rule),
    ("Cast", cast_op),
    ("CastLike", cast_like),
    ("Ceil", unary_rule),
    ("Celu", activation),
    ("Clip", clip),
    ("Cos", unary_rule),
    ("Div", binary_rule),
    ("Dropout", dropout),
    ("Elu", activation),
    ("Equal", binary_rule),
    ("Erf", unary_rule),
    ("Exp", unary_rule),
    ("Floor", unary_rule),
    ("Gelu", gelu),
    ("Greater", binary_rule),
    ("GreaterOrEqual", binary_rule),
    ("HardSigmoid", activation),
    ("HardSwish", activation),
    ("Identity", identity),
    ("IsInf", activation),
    ("IsNaN", unary_rule),
    ("LeakyRelu", activation),
    ("Less", binary_rule),
    ("LessOrEqual", binary_rule),
    ("Log", unary_rule),
    ("Max", variadic),
    ("Mean", variadic),
    ("Min", variadic),
    ("Mish", activation),
    ("Mod", modulo),
    ("Mul", binary_rule),
    ("Neg", unary_rule),
    ("Not", unary_rule),
    ("Or", binary_rule),
    ("PRelu", activation),
    ("Pow", pow),
    ("Reciprocal", unary_rule),
    ("Relu", unary_rule),
    ("Selu", activation),
    ("Sigmoid", unary_rule),
    ("Sign", unary_rule),
    ("Sin", unary_rule),
    ("Softplus", activation),
    ("Softsign", activation),
    ("Sqrt", unary_rule),
    ("Sub", binary_rule),
    ("Sum", variadic),
    ("Swish", swish),
    ("Tanh", unary_rule),
    ("ThresholdedRelu", activation),
    ("Where", where_op),
    ("Xor", binary_rule),
];

pub(super) fn unary(op_type: &str) -> Option<UnaryOp> {
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

pub(super) fn binary(op_type: &str) -> Option<BinaryOp> {
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

/// The elementwise ops of one input that map onto a [`UnaryOp`].
pub(super) fn unary_rule(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let op = unary(&n.p.op_type).ok_or_else(|| node_err("internal: not a unary op"))?;
    let x = n.req(0)?.clone();
    let out = out_name(cx, n, 0);
    one(emit1(cx, &n.ir_name, Op::Unary(op), &[x], out)?)
}

/// The elementwise ops of two (broadcast) inputs that map onto a [`BinaryOp`].
pub(super) fn binary_rule(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let op = binary(&n.p.op_type).ok_or_else(|| node_err("internal: not a binary op"))?;
    let (a, c) = (n.req(0)?.clone(), n.req(1)?.clone());
    let out = out_name(cx, n, 0);
    one(emit1(cx, &n.ir_name, Op::Binary(op), &[a, c], out)?)
}

/// Identity: its input.
pub(super) fn identity(_cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    one(n.req(0)?.clone())
}

pub(super) fn dropout(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
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
pub(super) fn dropout_training(
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
    let mut rng = crate::onnx::mt19937::Mt19937::new(seed);
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

/// The hzp dtype for a Cast target.
pub(super) fn cast_target(to: i64) -> FResult<DType> {
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

pub(super) fn cast(cx: &mut Ctx, n: &NodeCx, to: DType) -> FResult<Outs> {
    let x = n.req(0)?.clone();
    if cx.dtype(&x) == to {
        return one(x);
    }
    let out = out_name(cx, n, 0);
    one(emit1(cx, &n.ir_name, Op::Cast { to }, &[x], out)?)
}

/// Cast to the `to` attribute's type.
pub(super) fn cast_op(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let to = n
        .attr("to")
        .and_then(|a| a.i)
        .ok_or_else(|| node_err("Cast needs the `to` attribute"))?;
    cast(cx, n, cast_target(to)?)
}

/// CastLike: a cast to the second input's type.
pub(super) fn cast_like(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let to = cx.dtype(n.req(1)?);
    cast(cx, n, to)
}

pub(super) fn pow(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
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

pub(super) fn modulo(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
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

pub(super) fn variadic(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
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

/// Where; the NaN guard exporters put around a masked softmax becomes one softmax.
pub(super) fn where_op(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
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

/// Gelu, exact or `approximate="tanh"`.
pub(super) fn gelu(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
    let x = n.req(0)?.clone();
    let u = match n.attr_s("approximate")?.as_deref() {
        None | Some("none") => UnaryOp::Gelu,
        Some("tanh") => UnaryOp::GeluTanh,
        Some(other) => return err(format!("unknown approximate=`{other}`")),
    };
    let out = out_name(cx, n, 0);
    one(emit1(cx, &name, Op::Unary(u), &[x], out)?)
}

/// Clip by optional min and max inputs.
pub(super) fn clip(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
    let name = n.ir_name.clone();
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

/// Activations ONNX defines by formulas, written with hzp's elementwise ops.
pub(super) fn activation(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
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

/// Swish (opset 24): x * sigmoid(alpha * x).
pub(super) fn swish(cx: &mut Ctx, n: &NodeCx) -> FResult<Outs> {
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
