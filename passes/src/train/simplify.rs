//! Semantics-preserving rewrites that leave the later passes fewer, larger ops.

use hzp_ir::{BinaryOp, DType, Op, Program, UnaryOp, ValueDef, ValueId};

/// The scalar value of a one-element constant.
/// Whether `v` is a one-element constant equal to `c` to 1e-6 relative, or to `c` rounded to
/// the constant's dtype (a program lowered to bf16 or f16 holds its constants rounded).
fn is_scalar_near(p: &Program, v: ValueId, c: f64) -> bool {
    let Some(t) = p.const_data(v).filter(|t| t.numel() == 1) else {
        return false;
    };
    let k = t.to_f64_vec()[0];
    let rounded = hzp_ir::Tensor::from_f64(t.dtype(), Vec::<usize>::new(), &[c]).to_f64_vec()[0];
    (k - c).abs() <= 1e-6 * c.abs() || (t.dtype().is_float() && k == rounded)
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
            if is_scalar_near(p, *y, c) {
                Some(*x)
            } else if is_scalar_near(p, *x, c) {
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
/// something else reads them. Constants must match to 1e-6 relative, or equal the value rounded to their dtype. Returns how many it
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

/// `Transpose(MatMul(a, b))` over the last two axes, the product read by nothing else,
/// becomes `MatMul(T(b), T(a))`, where `T(T(x))` is `x` and the other transposes are new
/// nodes (`hzp_ir::views::transposed_operands`: read only by the product, they cost no copy
/// in a plan). The gradient of a transposed weight (`x @ Transpose(w)`, a tied LM head) is
/// such a product: computed this way it is one product and no transpose of the result.
/// Only products of two rank >= 2 float operands qualify (rank-1 operands are promoted
/// differently). The product's node is left for dead code elimination.
/// Returns how many it rewrote.
pub fn transpose_products(p: &mut Program) -> usize {
    let users = p.users();
    let pinned = p.escaping_values();
    let swap2 =
        |op: &Op| matches!(op, Op::Transpose { perm } if hzp_ir::views::swaps_last_two(perm));
    let mut hits: Vec<(usize, [ValueId; 2])> = Vec::new();
    for (t, n) in p.nodes.iter().enumerate() {
        let ([y], [_]) = (n.inputs.as_slice(), n.outputs.as_slice()) else {
            continue;
        };
        if !swap2(&n.op) || pinned[y.index()] || users[y.index()].len() != 1 {
            continue;
        }
        let Some((_, Op::MatMul, &[a, b])) = producer(p, *y) else {
            continue;
        };
        let ok = [a, b].iter().all(|&v| {
            p.ty(v).rank() >= 2 && matches!(p.ty(v).dtype, DType::F32 | DType::BF16 | DType::F16)
        });
        if ok {
            hits.push((t, [a, b]));
        }
    }
    if hits.is_empty() {
        return 0;
    }
    let mut names = hzp_ir::NameSet::from_program(p);
    let mut before: Vec<Vec<hzp_ir::Node>> = vec![Vec::new(); p.nodes.len()];
    for &(t, [a, b]) in &hits {
        let mut operand = |p: &mut Program, x: ValueId| -> ValueId {
            if let Some((_, op, &[src])) = producer(p, x) {
                if swap2(op) {
                    return src;
                }
            }
            let perm = hzp_ir::views::last_two_swapped(p.ty(x).rank());
            let name = names.fresh(&format!("{}.T", p.value(x).name));
            let node_name = format!("{}/operand", p.nodes[t].name);
            let v = p
                .add_node(node_name, Op::Transpose { perm }, vec![x], vec![name])
                .expect("a transpose of a rank >= 2 value")[0];
            before[t].push(p.nodes.pop().expect("just added"));
            v
        };
        let tb = operand(p, b);
        let ta = operand(p, a);
        let n = &mut p.nodes[t];
        n.op = Op::MatMul;
        n.inputs = vec![tb, ta];
    }
    let old = std::mem::take(&mut p.nodes);
    for (i, n) in old.into_iter().enumerate() {
        p.nodes.append(&mut before[i]);
        p.nodes.push(n);
    }
    p.renumber_nodes();
    hits.len()
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

    /// A program lowered to bf16 holds its constants rounded (0.044715 is 0.04467773 in bf16,
    /// sqrt(2/pi) 0.796875): the GELU is still found, and a bf16 constant that is not the
    /// rounded value (0.05) is not.
    #[test]
    fn gelus_with_bf16_rounded_constants_become_one_node() {
        let form = "%hx = Mul(%x, %h) \"m\"\n%p = Pow(%x, %three) \"p\"\n%k = Mul(%p, %a) \"k\"\n\
             %s = Add(%x, %k) \"s\"\n%u = Mul(%s, %c) \"u\"\n%t = Tanh(%u) \"t\"\n\
             %o = Add(%t, %one) \"o\"\n%y = Mul(%hx, %o) \"y\"\n";
        let bf16 = |a: &str| {
            let head = HEAD
                .replace("f32[2,8]", "bf16[2,8]")
                .replace(": f32[]", ": bf16[]")
                .replace("[0.044715]", a)
                .replace("[0.7978846]", "[0.796875]");
            parse(&format!("{head}{form}output %y\n"), "g.hzp", &|_| None).unwrap()
        };
        let mut p = bf16("[0.04467773]");
        assert_eq!(fuse_gelu_tanh(&mut p), 1, "{}", hzp_ir::text::print(&p));
        let mut p = bf16("[0.05]");
        assert_eq!(fuse_gelu_tanh(&mut p), 0);
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

    /// Evaluates with the runtime's CPU evaluator (a dev-dependency), inputs by name.
    fn eval_rt(p: &Program, inputs: &[(&str, Tensor)]) -> Vec<Tensor> {
        let ins: Vec<(String, Tensor)> = inputs
            .iter()
            .map(|(n, t)| (n.to_string(), t.clone()))
            .collect();
        hzp_runtime::eval::evaluate(p, &ins)
            .unwrap()
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }

    fn ramp(shape: &[usize], k: f32) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::f32(
            shape.to_vec(),
            (0..n).map(|i| ((i as f32 * k) % 7.0) - 3.0).collect(),
        )
    }

    #[test]
    fn transposed_products_become_products_of_transposes() {
        // T(T(h) @ d): the tied-head gradient (one operand already a transpose);
        // T(a @ b) with batch dims (two new operand transposes); T(u @ v) read twice (kept)
        let src = r#"program "t"
input %h : f32[6,4]
input %d : f32[6,5]
input %a : f32[2,3,4]
input %b : f32[2,4,5]
%ht = Transpose{perm=[1,0]}(%h) : f32[4,6] "ht"
%g = MatMul(%ht, %d) : f32[4,5] "g"
%gt = Transpose{perm=[1,0]}(%g) : f32[5,4] "gt"
%ab = MatMul(%a, %b) : f32[2,3,5] "ab"
%abt = Transpose{perm=[0,2,1]}(%ab) : f32[2,5,3] "abt"
%abp = Transpose{perm=[2,1,0]}(%ab) : f32[5,3,2] "abp"
output %gt
output %abt
output %abp
"#;
        let mut p = parse(src, "t.hzp", &|_| None).unwrap();
        let ins = [
            ("h", ramp(&[6, 4], 1.3)),
            ("d", ramp(&[6, 5], 0.7)),
            ("a", ramp(&[2, 3, 4], 0.9)),
            ("b", ramp(&[2, 4, 5], 1.1)),
        ];
        let before = eval_rt(&p, &ins);
        // `ab` is read twice: only `g` is rewritten
        assert_eq!(transpose_products(&mut p), 1);
        p.eliminate_dead_code();
        hzp_ir::verify(&p).unwrap();
        let text = hzp_ir::text::print(&p);
        assert!(!text.contains("\"g\""), "{text}");
        assert_eq!(before, eval_rt(&p, &ins));

        let src2 = src
            .replace(
                "%abp = Transpose{perm=[2,1,0]}(%ab) : f32[5,3,2] \"abp\"\n",
                "",
            )
            .replace("output %abp\n", "");
        let mut p = parse(&src2, "t.hzp", &|_| None).unwrap();
        let before = eval_rt(&p, &ins[..]);
        assert_eq!(transpose_products(&mut p), 2);
        p.eliminate_dead_code();
        hzp_ir::verify(&p).unwrap();
        // T(T(h)) is h; d, a and b get one transpose each; every transpose feeds a product
        let transposes = p
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Transpose { .. }))
            .count();
        assert_eq!(transposes, 3, "{}", hzp_ir::text::print(&p));
        assert!(hzp_ir::views::transposed_operands(&p)
            .iter()
            .zip(&p.nodes)
            .all(|(&v, n)| v == matches!(n.op, Op::Transpose { .. })));
        // bf16 operands likewise (their transposes are views too)
        let bf = src2.replace("f32", "bf16");
        let mut q = parse(&bf, "t.hzp", &|_| None).unwrap();
        assert_eq!(transpose_products(&mut q), 2);
        let after = eval_rt(&p, &ins[..]);
        for (x, y) in after.iter().zip(&before) {
            let (x, y) = (x.to_f64_vec(), y.to_f64_vec());
            for (u, v) in x.iter().zip(&y) {
                assert!((u - v).abs() <= 1e-5 * v.abs().max(1.0), "{u} vs {v}");
            }
        }
    }
}
