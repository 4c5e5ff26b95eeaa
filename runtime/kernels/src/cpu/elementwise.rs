//! Elementwise kernels: unary ops, binary ops with numpy broadcasting, Where and Cast.
//! Floats compute in f32 (bf16/f16 widened, rounded back on store); integers wrap on
//! overflow; integer Div truncates toward zero and Mod takes the divisor's sign.

use super::elem::{floats, out_stage_len, stage_len, store_f32, typed, typed_mut, Elem};
use super::into::{DataMut, DataRef, TensorRef, Workspace};
use super::layout::{zip3_broadcast_into, zip_broadcast_into};
use super::math;
use super::threads::{for_each_range, SendPtr};
use half::{bf16, f16};
use hzp_ir::{BinaryOp, DType, UnaryOp};

// ---------------------------------------------------------------- special functions

/// Reference erfc in f64 (for tests of the f32 versions in `math`), relative error below ~1.2e-7 everywhere (Chebyshev-fitted exponential
/// form), which keeps the far tails of erf/GELU accurate.
pub fn erfc_f64(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

/// erf in f64: a Maclaurin series near 0 (where 1 - erfc would lose relative accuracy),
/// erfc elsewhere.
pub fn erf_f64(x: f64) -> f64 {
    if x.is_nan() {
        return f64::NAN;
    }
    if x.abs() < 0.5 {
        // erf x = 2/sqrt(pi) * sum (-1)^n x^(2n+1) / (n! (2n+1))
        let x2 = x * x;
        let mut term = x; // (-1)^n x^(2n+1) / n!
        let mut sum = x;
        for n in 1..20 {
            term *= -x2 / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * std::f64::consts::FRAC_2_SQRT_PI
    } else {
        1.0 - erfc_f64(x)
    }
}

/// Elements per parallel piece of the flat loops.
const PIECE: usize = 1 << 16;

/// `out = u(x)` in f32, in parallel pieces.
fn float_unary(u: UnaryOp, x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len());
    let p = SendPtr(out.as_mut_ptr());
    // SAFETY: `out` holds x.len() elements and is exclusively borrowed; the pieces write
    // disjoint ranges of it.
    unsafe {
        for_each_range(x.len(), PIECE, |s, e| {
            unary_raw(u, &x[s..e], p.get().add(s))
        });
    }
}

/// Whether [`unary_into`] computes `u` (the float unary ops).
pub fn is_float_unary(u: UnaryOp) -> bool {
    !matches!(u, UnaryOp::Not | UnaryOp::IsNaN)
}

/// `out = u(x)` elementwise in f32, the same arithmetic as the Unary kernel. Lengths must
/// be equal.
pub fn unary_into(u: UnaryOp, x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len());
    // SAFETY: `out` is a distinct, exclusively borrowed slice of x.len() elements.
    unsafe { unary_raw(u, x, out.as_mut_ptr()) }
}

/// # Safety
/// `out` must be valid for `x.len()` writes and must not overlap `x`.
unsafe fn unary_raw(u: UnaryOp, x: &[f32], out: *mut f32) {
    use math::map_raw as map;
    match u {
        UnaryOp::Neg => map(x, out, |v| -v),
        UnaryOp::Abs => map(x, out, f32::abs),
        UnaryOp::Exp => map(x, out, math::exp),
        UnaryOp::Log => map(x, out, f32::ln),
        UnaryOp::Sqrt => map(x, out, f32::sqrt),
        UnaryOp::Rsqrt => map(x, out, |v| 1.0 / v.sqrt()),
        UnaryOp::Reciprocal => map(x, out, |v| 1.0 / v),
        UnaryOp::Tanh => map(x, out, math::tanh),
        UnaryOp::Erf => map(x, out, math::erf),
        UnaryOp::Sigmoid => map(x, out, math::sigmoid),
        UnaryOp::Relu => map(x, out, |v| if v > 0.0 || v.is_nan() { v } else { 0.0 }),
        UnaryOp::Gelu => map(x, out, math::gelu),
        UnaryOp::GeluTanh => map(x, out, math::gelu_tanh),
        UnaryOp::Silu => map(x, out, |v| v * math::sigmoid(v)),
        UnaryOp::Sin => map(x, out, f32::sin),
        UnaryOp::Cos => map(x, out, f32::cos),
        UnaryOp::Floor => map(x, out, f32::floor),
        UnaryOp::Ceil => map(x, out, f32::ceil),
        UnaryOp::Sign => map(x, out, |v| {
            if v > 0.0 {
                1.0
            } else if v < 0.0 {
                -1.0
            } else {
                v // 0, -0 and NaN stay
            }
        }),
        // rejected by the type rule; kept total
        UnaryOp::Not | UnaryOp::IsNaN => map(x, out, |v| v),
    }
}

/// Integer element types with the wrapping arithmetic the kernels use.
pub trait IntElem: Elem + Ord {
    const ZERO: Self;
    const ONE: Self;
    const MIN: Self;
    const MAX: Self;
    fn wadd(self, o: Self) -> Self;
    fn wsub(self, o: Self) -> Self;
    fn wmul(self, o: Self) -> Self;
    fn wneg(self) -> Self;
    fn wabs(self) -> Self;
    /// Truncating division; the caller rules out a zero divisor.
    fn wdiv(self, o: Self) -> Self;
    fn wrem(self, o: Self) -> Self;
    fn to_i64(self) -> i64;
    fn from_i64(v: i64) -> Self;
}

macro_rules! impl_int {
    ($t:ty) => {
        impl IntElem for $t {
            const ZERO: Self = 0;
            const ONE: Self = 1;
            const MIN: Self = <$t>::MIN;
            const MAX: Self = <$t>::MAX;
            fn wadd(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            fn wsub(self, o: Self) -> Self {
                self.wrapping_sub(o)
            }
            fn wmul(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            fn wneg(self) -> Self {
                self.wrapping_neg()
            }
            fn wabs(self) -> Self {
                self.wrapping_abs()
            }
            fn wdiv(self, o: Self) -> Self {
                self.wrapping_div(o)
            }
            fn wrem(self, o: Self) -> Self {
                self.wrapping_rem(o)
            }
            fn to_i64(self) -> i64 {
                self as i64
            }
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    };
}
impl_int!(i64);
impl_int!(i32);

fn int_unary<T: IntElem>(u: UnaryOp, t: &TensorRef, out: &mut DataMut) -> Result<(), String> {
    let x = typed::<T>(t)?;
    let o = typed_mut::<T>(out)?;
    let mut go = |f: fn(T) -> T| o.iter_mut().zip(x).for_each(|(o, &v)| *o = f(v));
    match u {
        UnaryOp::Neg => go(|v| v.wneg()),
        UnaryOp::Abs => go(|v| v.wabs()),
        UnaryOp::Sign => go(|v| T::from_i64(v.to_i64().signum())),
        UnaryOp::Exp
        | UnaryOp::Log
        | UnaryOp::Sqrt
        | UnaryOp::Rsqrt
        | UnaryOp::Reciprocal
        | UnaryOp::Tanh
        | UnaryOp::Erf
        | UnaryOp::Sigmoid
        | UnaryOp::Relu
        | UnaryOp::Gelu
        | UnaryOp::GeluTanh
        | UnaryOp::Silu
        | UnaryOp::Sin
        | UnaryOp::Cos
        | UnaryOp::Floor
        | UnaryOp::Ceil
        | UnaryOp::Not
        | UnaryOp::IsNaN => {
            return Err(format!(
                "{} needs a float input, got {}",
                u.name(),
                T::DTYPE
            ))
        }
    }
    Ok(())
}

/// A unary op into `out` (the inferred output: same dtype as `t`, or bool for IsNaN).
pub fn unary(
    u: UnaryOp,
    t: &TensorRef,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    match (t.data, u) {
        (DataRef::Bool(x), UnaryOp::Not) => {
            let o = typed_mut::<bool>(out)?;
            o.iter_mut().zip(x).for_each(|(o, &b)| *o = !b);
            Ok(())
        }
        (DataRef::Bool(x), UnaryOp::Abs | UnaryOp::Sign) => {
            typed_mut::<bool>(out)?.copy_from_slice(x);
            Ok(())
        }
        (DataRef::Bool(_), _) => Err(format!("{} is not defined for bool", u.name())),
        (_, UnaryOp::Not) => Err(format!("Not needs bool input, got {}", t.dtype())),
        (DataRef::I64(_), _) => int_unary::<i64>(u, t, out),
        (DataRef::I32(_), _) => int_unary::<i32>(u, t, out),
        (_, UnaryOp::IsNaN) => {
            let [xs] = ws.f32s.take([stage_len(t.data)]);
            let x = floats(t.data, xs);
            let o = typed_mut::<bool>(out)?;
            o.iter_mut().zip(x).for_each(|(o, v)| *o = v.is_nan());
            Ok(())
        }
        _ => {
            let [xs, os] = ws.f32s.take([stage_len(t.data), out_stage_len(out)]);
            let x = floats(t.data, xs);
            store_f32(out, os, |o| float_unary(u, x, o));
            Ok(())
        }
    }
}

// ---------------------------------------------------------------- binary

/// One f32 operand of an elementwise op over `n` elements: `n` values, or one value
/// broadcast.
#[derive(Clone, Copy, Debug)]
pub enum Arg<'a> {
    Full(&'a [f32]),
    Scalar(f32),
}

/// Whether [`binary_into`] computes `op` (the float arithmetic ops).
pub fn is_float_arith(op: BinaryOp) -> bool {
    matches!(
        op,
        BinaryOp::Add
            | BinaryOp::Sub
            | BinaryOp::Mul
            | BinaryOp::Div
            | BinaryOp::Pow
            | BinaryOp::Max
            | BinaryOp::Min
            | BinaryOp::Mod
    )
}

fn nan_max(x: f32, y: f32) -> f32 {
    if x.is_nan() || y.is_nan() {
        f32::NAN
    } else {
        x.max(y)
    }
}

fn nan_min(x: f32, y: f32) -> f32 {
    if x.is_nan() || y.is_nan() {
        f32::NAN
    } else {
        x.min(y)
    }
}

/// `out = a op b` elementwise in f32 (`op` one of [`is_float_arith`]), the same
/// arithmetic as the Binary kernel. Full operands must be as long as `out`.
pub fn binary_into(op: BinaryOp, a: Arg, b: Arg, out: &mut [f32]) {
    for x in [a, b] {
        if let Arg::Full(x) = x {
            assert_eq!(x.len(), out.len());
        }
    }
    // SAFETY: `out` is exclusively borrowed (so overlaps no operand) and as long as the
    // full operands.
    unsafe { binary_raw(op, a, b, out.len(), out.as_mut_ptr()) }
}

/// # Safety
/// Full operands hold at least `n` elements; `out` is valid for `n` writes and overlaps
/// no operand.
unsafe fn binary_raw(op: BinaryOp, a: Arg, b: Arg, n: usize, out: *mut f32) {
    unsafe fn zip(a: Arg, b: Arg, n: usize, out: *mut f32, f: impl Fn(f32, f32) -> f32 + Copy) {
        match (a, b) {
            (Arg::Full(a), Arg::Full(b)) => math::zip_raw(&a[..n], b, out, f),
            (Arg::Full(a), Arg::Scalar(y)) => math::map_raw(&a[..n], out, move |x| f(x, y)),
            (Arg::Scalar(x), Arg::Full(b)) => math::map_raw(&b[..n], out, move |y| f(x, y)),
            (Arg::Scalar(x), Arg::Scalar(y)) => {
                let v = f(x, y);
                (0..n).for_each(|i| *out.add(i) = v);
            }
        }
    }
    match op {
        BinaryOp::Add => zip(a, b, n, out, |x, y| x + y),
        BinaryOp::Sub => zip(a, b, n, out, |x, y| x - y),
        BinaryOp::Mul => zip(a, b, n, out, |x, y| x * y),
        BinaryOp::Div => zip(a, b, n, out, |x, y| x / y),
        // small integer exponents as products (exact for 2; for 3 what PyTorch computes)
        BinaryOp::Pow => match b {
            Arg::Scalar(2.0) => zip(a, b, n, out, |x, _| x * x),
            Arg::Scalar(3.0) => zip(a, b, n, out, |x, _| x * x * x),
            Arg::Scalar(1.0) => zip(a, b, n, out, |x, _| x),
            _ => zip(a, b, n, out, f32::powf),
        },
        BinaryOp::Max => zip(a, b, n, out, nan_max),
        BinaryOp::Min => zip(a, b, n, out, nan_min),
        BinaryOp::Mod => zip(a, b, n, out, |x, y| x % y),
        // not arithmetic: callers send comparisons and logic elsewhere (is_float_arith)
        BinaryOp::Equal
        | BinaryOp::Less
        | BinaryOp::LessOrEqual
        | BinaryOp::Greater
        | BinaryOp::GreaterOrEqual
        | BinaryOp::And
        | BinaryOp::Or
        | BinaryOp::Xor => unreachable!("{} is not float arithmetic", op.name()),
    }
}

/// A float binary op with broadcasting into `out`: f32 results for arithmetic, bool for
/// comparisons (`pred`). `num` receives arithmetic results when `Some`.
fn float_binary(
    op: BinaryOp,
    (a, sa): (&[f32], &[usize]),
    (b, sb): (&[f32], &[usize]),
    shape: &[usize],
    out: FloatOut,
) -> Result<(), String> {
    let n: usize = shape.iter().product();
    let pred = |out: FloatOut, f: fn(f32, f32) -> bool| match out {
        FloatOut::Pred(o) => {
            zip_broadcast_into((a, sa), (b, sb), shape, o, f);
            Ok(())
        }
        FloatOut::Num(_) => Err("internal: comparison into a number buffer".to_string()),
    };
    let out = match (op, out) {
        (BinaryOp::Equal, o) => return pred(o, |x, y| x == y),
        (BinaryOp::Less, o) => return pred(o, |x, y| x < y),
        (BinaryOp::LessOrEqual, o) => return pred(o, |x, y| x <= y),
        (BinaryOp::Greater, o) => return pred(o, |x, y| x > y),
        (BinaryOp::GreaterOrEqual, o) => return pred(o, |x, y| x >= y),
        (BinaryOp::And | BinaryOp::Or | BinaryOp::Xor, _) => {
            return Err(format!("{} needs bool operands", op.name()))
        }
        (_, FloatOut::Num(o)) => o,
        (_, FloatOut::Pred(_)) => return Err("internal: arithmetic into a bool buffer".into()),
    };
    // arithmetic from here on
    // an operand with as many elements as the result has its layout (broadcasting only
    // adds leading 1s to it); with scalar operands that is one flat loop
    fn arg(v: &[f32], n: usize) -> Option<Arg<'_>> {
        if v.len() == n {
            Some(Arg::Full(v))
        } else if v.len() == 1 {
            Some(Arg::Scalar(v[0]))
        } else {
            None
        }
    }
    if let (Some(x), Some(y)) = (arg(a, n), arg(b, n)) {
        assert_eq!(out.len(), n);
        let p = SendPtr(out.as_mut_ptr());
        fn part(a: Arg<'_>, s: usize, e: usize) -> Arg<'_> {
            match a {
                Arg::Full(a) => Arg::Full(&a[s..e]),
                scalar => scalar,
            }
        }
        // SAFETY: full operands hold n elements, and so does the exclusively borrowed
        // `out`; the pieces write disjoint ranges of it.
        unsafe {
            for_each_range(n, PIECE, |s, e| {
                binary_raw(op, part(x, s, e), part(y, s, e), e - s, p.get().add(s))
            });
        }
        return Ok(());
    }
    let (a, b) = ((a, sa), (b, sb));
    // the common ops with their closures inlined (a fn pointer would not vectorize)
    match op {
        BinaryOp::Add => zip_broadcast_into(a, b, shape, out, |x, y| x + y),
        BinaryOp::Sub => zip_broadcast_into(a, b, shape, out, |x, y| x - y),
        BinaryOp::Mul => zip_broadcast_into(a, b, shape, out, |x, y| x * y),
        BinaryOp::Div => zip_broadcast_into(a, b, shape, out, |x, y| x / y),
        BinaryOp::Pow => zip_broadcast_into(a, b, shape, out, f32::powf),
        BinaryOp::Max => zip_broadcast_into(a, b, shape, out, nan_max),
        BinaryOp::Min => zip_broadcast_into(a, b, shape, out, nan_min),
        BinaryOp::Mod => zip_broadcast_into(a, b, shape, out, |x, y| x % y),
        BinaryOp::Equal
        | BinaryOp::Less
        | BinaryOp::LessOrEqual
        | BinaryOp::Greater
        | BinaryOp::GreaterOrEqual
        | BinaryOp::And
        | BinaryOp::Or
        | BinaryOp::Xor => return Err(format!("internal: {} reached float arithmetic", op.name())),
    }
    Ok(())
}

/// Where a float binary op's result goes.
enum FloatOut<'a> {
    Num(&'a mut [f32]),
    Pred(&'a mut [bool]),
}

/// Integer power by squaring, wrapping on overflow. A negative exponent truncates 1/b^-e
/// toward zero like C (so only |b| = 1 gives a nonzero result); 0 to a negative power is an
/// error.
fn int_pow<T: IntElem>(b: T, e: T) -> Result<T, String> {
    let e = e.to_i64();
    if e < 0 {
        return match b.to_i64() {
            0 => Err("Pow: 0 raised to a negative integer power".into()),
            1 => Ok(T::ONE),
            -1 => Ok(if e % 2 == 0 { T::ONE } else { T::ONE.wneg() }),
            _ => Ok(T::ZERO),
        };
    }
    let mut e = e as u64;
    let mut base = b;
    let mut acc = T::ONE;
    while e > 0 {
        if e & 1 == 1 {
            acc = acc.wmul(base);
        }
        base = base.wmul(base);
        e >>= 1;
    }
    Ok(acc)
}

fn int_binary<T: IntElem>(
    op: BinaryOp,
    x: &TensorRef,
    y: &TensorRef,
    shape: &[usize],
    out: &mut DataMut,
) -> Result<(), String> {
    let (a, b) = ((typed::<T>(x)?, x.shape), (typed::<T>(y)?, y.shape));
    if matches!(op, BinaryOp::Div | BinaryOp::Mod) && b.0.contains(&T::ZERO) {
        return Err(format!("{}: integer division by zero", op.name()));
    }
    let pred = |out: &mut DataMut, f: fn(T, T) -> bool| {
        zip_broadcast_into(a, b, shape, typed_mut::<bool>(out)?, f);
        Ok(())
    };
    match op {
        BinaryOp::Equal => return pred(out, |x, y| x == y),
        BinaryOp::Less => return pred(out, |x, y| x < y),
        BinaryOp::LessOrEqual => return pred(out, |x, y| x <= y),
        BinaryOp::Greater => return pred(out, |x, y| x > y),
        BinaryOp::GreaterOrEqual => return pred(out, |x, y| x >= y),
        BinaryOp::And | BinaryOp::Or | BinaryOp::Xor => {
            return Err(format!("{} needs bool operands", op.name()))
        }
        BinaryOp::Add
        | BinaryOp::Sub
        | BinaryOp::Mul
        | BinaryOp::Div
        | BinaryOp::Mod
        | BinaryOp::Max
        | BinaryOp::Min
        | BinaryOp::Pow => {}
    }
    let o = typed_mut::<T>(out)?;
    let mut num = |f: fn(T, T) -> T| zip_broadcast_into(a, b, shape, &mut *o, f);
    match op {
        BinaryOp::Add => num(|x, y| x.wadd(y)),
        BinaryOp::Sub => num(|x, y| x.wsub(y)),
        BinaryOp::Mul => num(|x, y| x.wmul(y)),
        BinaryOp::Div => num(|x, y| x.wdiv(y)),
        BinaryOp::Mod => num(|x, y| {
            let r = x.wrem(y);
            if r != T::ZERO && ((r < T::ZERO) != (y < T::ZERO)) {
                r.wadd(y)
            } else {
                r
            }
        }),
        BinaryOp::Max => num(|x, y| x.max(y)),
        BinaryOp::Min => num(|x, y| x.min(y)),
        BinaryOp::Equal
        | BinaryOp::Less
        | BinaryOp::LessOrEqual
        | BinaryOp::Greater
        | BinaryOp::GreaterOrEqual
        | BinaryOp::And
        | BinaryOp::Or
        | BinaryOp::Xor => unreachable!("returned above"),
        BinaryOp::Pow => {
            // it can fail: the first error in row-major order
            let mut err = None;
            zip_broadcast_into(a, b, shape, o, |x, y| match int_pow(x, y) {
                Ok(v) => v,
                Err(e) => {
                    err.get_or_insert(e);
                    T::ZERO
                }
            });
            if let Some(e) = err {
                return Err(e);
            }
        }
    }
    Ok(())
}

fn bool_binary(
    op: BinaryOp,
    x: &TensorRef,
    y: &TensorRef,
    shape: &[usize],
    out: &mut DataMut,
) -> Result<(), String> {
    let (a, b) = (typed::<bool>(x)?, typed::<bool>(y)?);
    let f: fn(bool, bool) -> bool = match op {
        BinaryOp::And | BinaryOp::Mul | BinaryOp::Min => |x, y| x & y,
        BinaryOp::Or | BinaryOp::Add | BinaryOp::Max => |x, y| x | y,
        BinaryOp::Xor => |x, y| x ^ y,
        BinaryOp::Equal => |x, y| x == y,
        BinaryOp::Less => |x, y| !x & y,
        BinaryOp::LessOrEqual => |x, y| x <= y,
        BinaryOp::Greater => |x, y| x & !y,
        BinaryOp::GreaterOrEqual => |x, y| x >= y,
        BinaryOp::Sub | BinaryOp::Div | BinaryOp::Pow | BinaryOp::Mod => {
            return Err(format!("{} is not defined for bool operands", op.name()))
        }
    };
    let o = typed_mut::<bool>(out)?;
    zip_broadcast_into((a, x.shape), (b, y.shape), shape, o, f);
    Ok(())
}

/// A binary op with numpy broadcasting to `shape` (the inferred output shape), into `out`.
pub fn binary(
    op: BinaryOp,
    x: &TensorRef,
    y: &TensorRef,
    shape: &[usize],
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    match x.dtype() {
        DType::I64 => int_binary::<i64>(op, x, y, shape, out),
        DType::I32 => int_binary::<i32>(op, x, y, shape, out),
        DType::Bool => bool_binary(op, x, y, shape, out),
        _ => {
            let [xs, ys, os] =
                ws.f32s
                    .take([stage_len(x.data), stage_len(y.data), out_stage_len(out)]);
            let (a, b) = ((floats(x.data, xs), x.shape), (floats(y.data, ys), y.shape));
            if let DataMut::Bool(o) = out {
                return float_binary(op, a, b, shape, FloatOut::Pred(o));
            }
            store_f32(out, os, |o| float_binary(op, a, b, shape, FloatOut::Num(o)))
        }
    }
}

// ---------------------------------------------------------------- where

fn where_typed<T: Elem>(
    c: &TensorRef,
    x: &TensorRef,
    y: &TensorRef,
    shape: &[usize],
    out: &mut DataMut,
) -> Result<(), String> {
    let cond = typed::<bool>(c)?;
    let (a, b) = (typed::<T>(x)?, typed::<T>(y)?);
    zip3_broadcast_into(
        (cond, c.shape),
        (a, x.shape),
        (b, y.shape),
        shape,
        typed_mut::<T>(out)?,
        |c, a, b| if c { a } else { b },
    );
    Ok(())
}

pub fn where_(
    c: &TensorRef,
    x: &TensorRef,
    y: &TensorRef,
    shape: &[usize],
    out: &mut DataMut,
) -> Result<(), String> {
    super::elem::by_dtype!(x.dtype(), where_typed(c, x, y, shape, out))
}

// ---------------------------------------------------------------- cast

/// Converts `t` into `out` (of the target dtype). Float to int truncates toward zero
/// (saturating at the int range, NaN -> 0); numbers to bool test != 0; bool to numbers
/// gives 0/1; ints to floats round to nearest.
pub fn cast(t: &TensorRef, out: &mut DataMut) -> Result<(), String> {
    if t.dtype() == out.dtype() {
        return super::elem::copy_data(t.data, out);
    }
    fn from_ints(v: impl Iterator<Item = i64>, out: &mut DataMut) {
        match out {
            DataMut::F32(o) => o.iter_mut().zip(v).for_each(|(o, x)| *o = x as f32),
            DataMut::BF16(o) => o
                .iter_mut()
                .zip(v)
                .for_each(|(o, x)| *o = bf16::from_f64(x as f64)),
            DataMut::F16(o) => o
                .iter_mut()
                .zip(v)
                .for_each(|(o, x)| *o = f16::from_f64(x as f64)),
            DataMut::I64(o) => o.iter_mut().zip(v).for_each(|(o, x)| *o = x),
            DataMut::I32(o) => o.iter_mut().zip(v).for_each(|(o, x)| *o = x as i32),
            DataMut::Bool(o) => o.iter_mut().zip(v).for_each(|(o, x)| *o = x != 0),
        }
    }
    fn from_floats(v: impl Iterator<Item = f32>, out: &mut DataMut) {
        match out {
            DataMut::F32(o) => o.iter_mut().zip(v).for_each(|(o, x)| *o = x),
            DataMut::BF16(o) => o
                .iter_mut()
                .zip(v)
                .for_each(|(o, x)| *o = bf16::from_f32(x)),
            DataMut::F16(o) => o.iter_mut().zip(v).for_each(|(o, x)| *o = f16::from_f32(x)),
            DataMut::I64(o) => o.iter_mut().zip(v).for_each(|(o, x)| *o = x as i64),
            DataMut::I32(o) => o.iter_mut().zip(v).for_each(|(o, x)| *o = x as i32),
            DataMut::Bool(o) => o.iter_mut().zip(v).for_each(|(o, x)| *o = x != 0.0),
        }
    }
    match t.data {
        // ints and bools -> any
        DataRef::I64(v) => from_ints(v.iter().copied(), out),
        DataRef::I32(v) => from_ints(v.iter().map(|&x| x as i64), out),
        DataRef::Bool(v) => from_ints(v.iter().map(|&x| x as i64), out),
        // floats -> any: via f32 (exact for bf16/f16)
        DataRef::F32(v) => from_floats(v.iter().copied(), out),
        DataRef::BF16(v) => from_floats(v.iter().map(|x| x.to_f32()), out),
        DataRef::F16(v) => from_floats(v.iter().map(|x| x.to_f32()), out),
    }
    Ok(())
}

/// `out = dy * gelu_tanh'(x)` (`Op::GeluTanhGrad`): f32 math, in parallel pieces.
pub fn gelu_tanh_grad(
    x: &TensorRef,
    dy: &TensorRef,
    out: &mut DataMut,
    ws: &mut Workspace,
) -> Result<(), String> {
    let [xs, ds, os] = ws
        .f32s
        .take([stage_len(x.data), stage_len(dy.data), out_stage_len(out)]);
    let (xv, dv) = (floats(x.data, xs), floats(dy.data, ds));
    if xv.len() != dv.len() {
        return Err("internal: GeluTanhGrad operands of different lengths".into());
    }
    store_f32(out, os, |o| {
        let n = o.len().min(xv.len());
        let po = SendPtr(o.as_mut_ptr());
        for_each_range(n, PIECE, |a, b| {
            // SAFETY: pieces are disjoint ranges of `o` (n elements); x and dy are separate
            // buffers from the output.
            unsafe {
                math::zip_raw(&xv[a..b], &dv[a..b], po.get().add(a), |x, d| {
                    d * math::gelu_tanh_grad(x)
                })
            }
        });
    });
    Ok(())
}
