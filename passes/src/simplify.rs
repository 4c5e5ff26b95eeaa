//! Semantics-preserving rewrites that leave the later passes fewer, larger ops.

use hzp_ir::{BinaryOp, Op, Program, UnaryOp, ValueDef, ValueId};

/// The scalar value of a one-element constant.
fn scalar(p: &Program, v: ValueId) -> Option<f64> {
    let t = p.const_data(v)?;
    (t.numel() == 1).then(|| t.to_f64_vec()[0])
}

fn near(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs()
}

/// The node producing `v` and its op and inputs.
fn producer(p: &Program, v: ValueId) -> Option<(usize, &Op, &[ValueId])> {
    match p.value(v).def {
        ValueDef::Node { node, .. } => {
            let n = p.nodes.get(node.index())?;
            Some((node.index(), &n.op, n.inputs.as_slice()))
        }
        _ => None,
    }
}

/// `v = op(a, b)` with `b` a scalar constant near `c` (either operand order): `a`.
fn with_const(p: &Program, v: ValueId, op: BinaryOp, c: f64) -> Option<ValueId> {
    let (_, o, ins) = producer(p, v)?;
    match (o, ins) {
        (Op::Binary(b), [x, y]) if *b == op => {
            if scalar(p, *y).is_some_and(|k| near(k, c)) {
                Some(*x)
            } else if scalar(p, *x).is_some_and(|k| near(k, c)) {
                Some(*y)
            } else {
                None
            }
        }
        _ => None,
    }
}

/// `v = x^3` as `Pow(x, 3)` or `x * x * x` (any grouping): `x`.
fn cube_of(p: &Program, v: ValueId) -> Option<ValueId> {
    if let Some(x) = with_const(p, v, BinaryOp::Pow, 3.0) {
        let (_, _, ins) = producer(p, v)?;
        return (ins[0] == x).then_some(x);
    }
    let (_, o, ins) = producer(p, v)?;
    let (Op::Binary(BinaryOp::Mul), [a, b]) = (o, ins) else {
        return None;
    };
    let square = |s: ValueId| match producer(p, s) {
        Some((_, Op::Binary(BinaryOp::Mul), [u, w])) if u == w => Some(*u),
        _ => None,
    };
    match (square(*a), square(*b)) {
        (Some(x), _) if x == *b => Some(x),
        (_, Some(x)) if x == *a => Some(x),
        _ => None,
    }
}

/// `v = Add(x, Mul(x^3, 0.044715))` (either order): `x`.
fn inner_of(p: &Program, v: ValueId) -> Option<ValueId> {
    let (_, o, ins) = producer(p, v)?;
    let (Op::Binary(BinaryOp::Add), [a, b]) = (o, ins) else {
        return None;
    };
    for (x, k) in [(*a, *b), (*b, *a)] {
        if let Some(c) = with_const(p, k, BinaryOp::Mul, 0.044715) {
            if cube_of(p, c) == Some(x) {
                return Some(x);
            }
        }
    }
    None
}

/// `v = Add(Tanh(Mul(inner, sqrt(2/pi))), 1)` (either order): the `x` of `inner`.
fn one_plus_tanh_of(p: &Program, v: ValueId) -> Option<ValueId> {
    let t = with_const(p, v, BinaryOp::Add, 1.0)?;
    let (_, o, ins) = producer(p, t)?;
    let (Op::Unary(UnaryOp::Tanh), [u]) = (o, ins) else {
        return None;
    };
    let inner = with_const(p, *u, BinaryOp::Mul, (2.0 / std::f64::consts::PI).sqrt())?;
    inner_of(p, inner)
}

/// Rewrites each tanh-approximated GELU written out elementwise, as exporters leave
/// `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))` (products and sums in either
/// operand order, the half on either factor, `x^3` as `Pow(x, 3)` or products), into one
/// `GeluTanh(x)` node. The result's node is rewritten in place (its value keeps its name and
/// readers); the intermediate nodes are left for dead code elimination, and stay where
/// something else reads them. Constants must match to 1e-6 relative. Returns how many it
/// rewrote.
pub fn fuse_gelu_tanh(p: &mut Program) -> usize {
    let mut found: Vec<(usize, ValueId)> = Vec::new();
    for (i, n) in p.nodes.iter().enumerate() {
        let (Op::Binary(BinaryOp::Mul), [a, b], [_]) =
            (&n.op, n.inputs.as_slice(), n.outputs.as_slice())
        else {
            continue;
        };
        let mut hit = None;
        for (l, r) in [(*a, *b), (*b, *a)] {
            // (0.5 x) * (1 + tanh(..)), or x * (0.5 (1 + tanh(..)))
            let x = match (with_const(p, l, BinaryOp::Mul, 0.5), one_plus_tanh_of(p, r)) {
                (Some(h), Some(x)) if h == x => Some(x),
                _ => with_const(p, r, BinaryOp::Mul, 0.5)
                    .and_then(|q| one_plus_tanh_of(p, q))
                    .filter(|&x| x == l),
            };
            if x.is_some() {
                hit = x;
                break;
            }
        }
        if let Some(x) = hit {
            if p.ty(x) == p.ty(n.outputs[0]) && p.ty(x).dtype.is_float() {
                found.push((i, x));
            }
        }
    }
    for &(i, x) in &found {
        let n = &mut p.nodes[i];
        n.op = Op::Unary(UnaryOp::GeluTanh);
        n.inputs = vec![x];
    }
    found.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hzp_ir::text::parse;
    use hzp_ir::Tensor;

    const HEAD: &str = "program \"g\"\ninput %x : f32[2,8]\nconst %h : f32[] = [0.5]\n\
        const %one : f32[] = [1.0]\nconst %three : f32[] = [3.0]\nconst %a : f32[] = [0.044715]\n\
        const %c : f32[] = [0.7978846]\nconst %b : f32[] = [0.05]\n";

    fn run(p: &Program) -> Vec<f64> {
        let x: Vec<f32> = (0..16).map(|i| i as f32 * 0.4 - 3.0).collect();
        eval_f64(p, Tensor::f32(vec![2, 8], x))
    }

    /// Evaluates a small elementwise program node by node with the IR's own reference
    /// semantics (f64), so this test needs no runtime.
    fn eval_f64(p: &Program, x: Tensor) -> Vec<f64> {
        let mut vals: Vec<Option<Vec<f64>>> = vec![None; p.values.len()];
        vals[p.inputs[0].index()] = Some(x.to_f64_vec());
        let get = |vals: &Vec<Option<Vec<f64>>>, v: ValueId| -> Vec<f64> {
            vals[v.index()]
                .clone()
                .or_else(|| p.const_data(v).map(|t| t.to_f64_vec()))
                .unwrap()
        };
        for n in &p.nodes {
            let ins: Vec<Vec<f64>> = n.inputs.iter().map(|&v| get(&vals, v)).collect();
            let len = ins.iter().map(|v| v.len()).max().unwrap();
            let at = |k: usize, i: usize| ins[k][if ins[k].len() == 1 { 0 } else { i }];
            let out: Vec<f64> = (0..len)
                .map(|i| match &n.op {
                    Op::Binary(BinaryOp::Mul) => at(0, i) * at(1, i),
                    Op::Binary(BinaryOp::Add) => at(0, i) + at(1, i),
                    Op::Binary(BinaryOp::Pow) => at(0, i).powf(at(1, i)),
                    Op::Unary(UnaryOp::Tanh) => at(0, i).tanh(),
                    Op::Unary(UnaryOp::GeluTanh) => {
                        let v = at(0, i);
                        let c = (2.0 / std::f64::consts::PI).sqrt();
                        0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh())
                    }
                    other => panic!("{other:?}"),
                })
                .collect();
            vals[n.outputs[0].index()] = Some(out);
        }
        get(&vals, p.outputs[0])
    }

    fn prog(body: &str) -> Program {
        parse(&format!("{HEAD}{body}output %y\n"), "g.hzp", &|_| None).unwrap()
    }

    #[test]
    fn written_out_gelus_become_one_node() {
        let forms = [
            // as the exporters write it: (0.5 x) * (1 + tanh(c (x + a x^3)))
            "%hx = Mul(%x, %h) \"m\"\n%p = Pow(%x, %three) \"p\"\n%k = Mul(%p, %a) \"k\"\n\
             %s = Add(%x, %k) \"s\"\n%u = Mul(%s, %c) \"u\"\n%t = Tanh(%u) \"t\"\n\
             %o = Add(%t, %one) \"o\"\n%y = Mul(%hx, %o) \"y\"\n",
            // operands swapped everywhere, x^3 as products, the half on the other factor
            "%x2 = Mul(%x, %x) \"x2\"\n%p = Mul(%x, %x2) \"p\"\n%k = Mul(%a, %p) \"k\"\n\
             %s = Add(%k, %x) \"s\"\n%u = Mul(%c, %s) \"u\"\n%t = Tanh(%u) \"t\"\n\
             %o = Add(%one, %t) \"o\"\n%ho = Mul(%h, %o) \"ho\"\n%y = Mul(%ho, %x) \"y\"\n",
        ];
        for f in forms {
            let mut p = prog(f);
            let before = run(&p);
            assert_eq!(fuse_gelu_tanh(&mut p), 1, "{f}");
            p.eliminate_dead_code();
            assert_eq!(p.nodes.len(), 1, "{}", hzp_ir::text::print(&p));
            assert_eq!(p.nodes[0].op, Op::Unary(UnaryOp::GeluTanh));
            for (a, b) in run(&p).iter().zip(&before) {
                assert!((a - b).abs() <= 1e-6, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn near_misses_are_left_alone() {
        // another constant (0.05 for 0.044715), another variable, an intermediate read by
        // another output (fused, but the intermediate's node stays)
        let wrong = "%hx = Mul(%x, %h) \"m\"\n%p = Pow(%x, %three) \"p\"\n%k = Mul(%p, %b) \"k\"\n\
             %s = Add(%x, %k) \"s\"\n%u = Mul(%s, %c) \"u\"\n%t = Tanh(%u) \"t\"\n\
             %o = Add(%t, %one) \"o\"\n%y = Mul(%hx, %o) \"y\"\n";
        assert_eq!(fuse_gelu_tanh(&mut prog(wrong)), 0);
        let other_x = "%z = Tanh(%x) \"z\"\n%hx = Mul(%z, %h) \"m\"\n%p = Pow(%x, %three) \"p\"\n\
             %k = Mul(%p, %a) \"k\"\n%s = Add(%x, %k) \"s\"\n%u = Mul(%s, %c) \"u\"\n\
             %t = Tanh(%u) \"t\"\n%o = Add(%t, %one) \"o\"\n%y = Mul(%hx, %o) \"y\"\n";
        assert_eq!(fuse_gelu_tanh(&mut prog(other_x)), 0);
        let shared =
            "%hx = Mul(%x, %h) \"m\"\n%p = Pow(%x, %three) \"p\"\n%k = Mul(%p, %a) \"k\"\n\
             %s = Add(%x, %k) \"s\"\n%u = Mul(%s, %c) \"u\"\n%t = Tanh(%u) \"t\"\n\
             %o = Add(%t, %one) \"o\"\n%y = Mul(%hx, %o) \"y\"\n";
        let mut p = parse(
            &format!("{HEAD}{shared}output %y\noutput %t\n"),
            "g.hzp",
            &|_| None,
        )
        .unwrap();
        assert_eq!(fuse_gelu_tanh(&mut p), 1);
        p.eliminate_dead_code();
        assert!(p.nodes.iter().any(|n| n.op == Op::Unary(UnaryOp::Tanh)));
    }
}
