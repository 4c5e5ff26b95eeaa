//! Property tests of the text form: the parser never panics, and random valid programs
//! round-trip exactly.

mod text_common;

use hzp_ir::text;
use hzp_ir::*;
use proptest::prelude::*;
use std::sync::OnceLock;
use text_common::*;

fn printed_all_ops() -> &'static (String, Program) {
    static CELL: OnceLock<(String, Program)> = OnceLock::new();
    CELL.get_or_init(|| {
        let p = all_ops();
        (text::print(&p), p)
    })
}

/// Parses with the weights of `all_ops`; any result is fine, a panic is not.
fn parse_any(src: &str) {
    let (_, p) = printed_all_ops();
    let w = weights(p);
    if let Err(e) = text::parse(src, "fuzz.hzp", &|n| w.get(n).cloned()) {
        // errors must render and point inside the source
        let shown = e.to_string();
        assert!(shown.starts_with("fuzz.hzp:"));
        let span = e.span();
        assert!(span.offset() + span.len() <= src.len());
        assert!(e.line() >= 1 && e.column() >= 1);
    }
}

#[derive(Clone, Debug)]
enum Mutation {
    Delete { at: usize, len: usize },
    Insert { at: usize, bytes: Vec<u8> },
    Replace { at: usize, byte: u8 },
    Swap { a: usize, b: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let interesting =
        prop::sample::select(b"%\"\\[]{}(),:=@#-.0123456789eE \n\tabcxyzinf".to_vec());
    prop_oneof![
        (any::<usize>(), 1usize..12).prop_map(|(at, len)| Mutation::Delete { at, len }),
        (
            any::<usize>(),
            prop::collection::vec(prop_oneof![any::<u8>(), interesting.clone()], 1..6)
        )
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        (any::<usize>(), prop_oneof![any::<u8>(), interesting])
            .prop_map(|(at, byte)| Mutation::Replace { at, byte }),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Mutation::Swap { a, b }),
    ]
}

fn apply(src: &str, muts: &[Mutation]) -> String {
    let mut b = src.as_bytes().to_vec();
    for m in muts {
        let n = b.len().max(1);
        match m {
            Mutation::Delete { at, len } => {
                let at = at % n;
                let end = (at + len).min(b.len());
                if at < end {
                    b.drain(at..end);
                }
            }
            Mutation::Insert { at, bytes } => {
                let at = at % (b.len() + 1);
                b.splice(at..at, bytes.iter().copied());
            }
            Mutation::Replace { at, byte } => {
                if !b.is_empty() {
                    let at = at % b.len();
                    b[at] = *byte;
                }
            }
            Mutation::Swap { a, b: c } => {
                if !b.is_empty() {
                    let (x, y) = (a % b.len(), c % b.len());
                    b.swap(x, y);
                }
            }
        }
    }
    String::from_utf8_lossy(&b).into_owned()
}

/// Random small programs: chains of elementwise, unary, reshape, transpose and matmul ops on
/// random shapes, with parameters and constants made along the way, odd names and streams.
#[derive(Clone, Debug)]
struct Recipe {
    shape: Vec<usize>,
    steps: Vec<(u8, u16, u16, u16)>,
    names: Vec<String>,
    mesh: bool,
}

fn recipe() -> impl Strategy<Value = Recipe> {
    (
        prop::collection::vec(1usize..5, 1..4),
        prop::collection::vec(any::<(u8, u16, u16, u16)>(), 0..24),
        prop::collection::vec("[a-z%\" .:/#\\\\é]{1,5}", 40),
        any::<bool>(),
    )
        .prop_map(|(shape, steps, names, mesh)| Recipe {
            shape,
            steps,
            names,
            mesh,
        })
}

fn build(r: &Recipe) -> Program {
    let mut p = Program::new(format!("rand {}", r.names[0]));
    if r.mesh {
        p.mesh = Some(Mesh::parse("node=2,gpu=2").unwrap());
    }
    let mut name_i = 0usize;
    let mut fresh = |tag: &str| {
        name_i += 1;
        format!("{}{tag}{name_i}", r.names[name_i % r.names.len()])
    };
    let f = DType::F32;
    let x = p.add_input(fresh("x"), TensorType::new(f, r.shape.clone()));
    let mut vals: Vec<ValueId> = vec![x];
    for &(kind, a, b, c) in &r.steps {
        let pick = |k: u16, vals: &[ValueId]| vals[k as usize % vals.len()];
        let v = pick(a, &vals);
        let ty = p.ty(v).clone();
        let name = fresh("v");
        let result = match kind % 9 {
            0 => {
                let u = [
                    UnaryOp::Neg,
                    UnaryOp::Exp,
                    UnaryOp::Tanh,
                    UnaryOp::Relu,
                    UnaryOp::Gelu,
                    UnaryOp::Sqrt,
                ][b as usize % 6];
                p.add_node(fresh("n"), Op::Unary(u), vec![v], vec![name])
            }
            1 => {
                let w = pick(b, &vals);
                let op =
                    [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Max][c as usize % 4];
                p.add_node(fresh("n"), Op::Binary(op), vec![v, w], vec![name])
            }
            2 => {
                let mut shape = ty.shape.clone();
                shape.reverse();
                if c % 2 == 0 {
                    shape.insert(0, 1);
                }
                p.add_node(fresh("n"), Op::Reshape { shape }, vec![v], vec![name])
            }
            3 => {
                let r = ty.rank();
                let perm: Vec<usize> = (0..r).map(|i| (i + b as usize) % r.max(1)).collect();
                p.add_node(fresh("n"), Op::Transpose { perm }, vec![v], vec![name])
            }
            4 if ty.rank() >= 1 => {
                let k = ty.shape[ty.rank() - 1];
                let n = 1 + c as usize % 4;
                let w = p.add_param(fresh("w"), TensorType::new(f, vec![k, n]), None);
                p.add_node(fresh("n"), Op::MatMul, vec![v, w], vec![name])
            }
            5 => {
                let vals_f: Vec<f32> = (0..ty.numel())
                    .map(|i| f32::from_bits((b as u32) << 16 | (c as u32) ^ (i as u32 * 7919)))
                    .map(|x| if x.is_nan() { 0.5 } else { x })
                    .collect();
                let cst = p.add_const(fresh("c"), Tensor::f32(ty.shape.clone(), vals_f));
                p.add_node(
                    fresh("n"),
                    Op::Binary(BinaryOp::Add),
                    vec![v, cst],
                    vec![name],
                )
            }
            6 => {
                let value = f64::from_bits((a as u64) << 48 | (b as u64) << 20 | c as u64);
                let value = if value.is_nan() { -2.5 } else { value };
                p.add_node(
                    fresh("n"),
                    Op::Fill {
                        value,
                        dtype: f,
                        shape: ty.shape.clone(),
                    },
                    vec![],
                    vec![name],
                )
            }
            7 if r.mesh && ty.rank() >= 1 => {
                let res = p.add_node(
                    fresh("n"),
                    Op::AllGather {
                        group: Group::new(["gpu"]),
                        axis: 0,
                    },
                    vec![v],
                    vec![name],
                );
                if let Some(last) = p.nodes.last_mut() {
                    last.stream = StreamKind::AllGather;
                }
                res
            }
            8 => {
                let eps = f32::from_bits(0x3000_0000 | (b as u32) << 8 | c as u32);
                if ty.rank() >= 1 {
                    let d = ty.shape[ty.rank() - 1];
                    let s = p.add_param(fresh("s"), TensorType::new(f, vec![d]), None);
                    p.add_node(
                        fresh("n"),
                        Op::RmsNorm {
                            axis: ty.rank() - 1,
                            epsilon: eps,
                        },
                        vec![v, s],
                        vec![name],
                    )
                } else {
                    Err("scalar".into())
                }
            }
            _ => Err("skipped".into()),
        };
        if let Ok(out) = result {
            vals.extend(out);
        }
    }
    let last = *vals.last().unwrap_or(&x);
    p.outputs = vec![last, x];
    p
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(256),
        ..ProptestConfig::default()
    })]

    #[test]
    fn parser_never_panics_on_arbitrary_strings(s in any::<String>()) {
        parse_any(&s);
    }

    #[test]
    fn parser_never_panics_on_token_soup(
        s in "([%\"\\[\\]{}(),:=@#\n ]|-?[0-9]{1,25}(\\.[0-9]+)?|f32|i64|bool|input|param|const|mesh|output|order|program|MatMul|Split|Reshape|AllGather|gpu|data|inf|nan|%x|%y|axis|sizes|shape|group|true){0,60}"
    ) {
        parse_any(&s);
    }

    #[test]
    fn parser_never_panics_on_mutated_programs(muts in prop::collection::vec(mutation(), 1..5)) {
        let (src, _) = printed_all_ops();
        parse_any(&apply(src, &muts));
    }

    #[test]
    fn random_programs_round_trip(r in recipe()) {
        let p = build(&r);
        roundtrip(&p);
    }
}

#[test]
fn random_programs_are_not_trivial() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let mut nodes = 0;
    let mut with_order = 0;
    for _ in 0..64 {
        let p = build(&recipe().new_tree(&mut runner).unwrap().current());
        nodes += p.nodes.len();
        with_order += usize::from(text::print(&p).contains("\norder "));
    }
    assert!(nodes > 64 * 4, "only {nodes} nodes in 64 programs");
    assert_eq!(with_order, 0);
}

/// Every integer in a printed program replaced by extreme values, one and two at a time.
#[test]
fn extreme_integers_never_panic() {
    let p = all_ops();
    let src = text::print(&p);
    let w = weights(&p);
    // positions of integer tokens
    let b = src.as_bytes();
    let mut spans = vec![];
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit()
            && (i == 0
                || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'.' || b[i - 1] == b'_'))
        {
            let s = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            spans.push((s, i));
        } else {
            i += 1;
        }
    }
    let vals = [
        "0",
        "1",
        "3",
        "7",
        "8",
        "4611686018427387904",
        "4611686018427387903",
        "9223372036854775807",
        "-9223372036854775808",
        "2305843009213693952",
        "-1",
        "18446744073709551615",
    ];
    let mut n = 0;
    let mut ok = 0;
    for &(s, e) in &spans {
        for v in vals {
            let m = format!("{}{}{}", &src[..s], v, &src[e..]);
            n += 1;
            if text::parse(&m, "x.hzp", &|k| w.get(k).cloned()).is_ok() {
                ok += 1;
            }
        }
    }
    // pairs
    for (a, &(s1, e1)) in spans.iter().enumerate() {
        for &(s2, e2) in spans.iter().skip(a + 1).step_by(7) {
            for v in ["4611686018427387904", "2305843009213693952", "0"] {
                let m = format!("{}{}{}{}{}", &src[..s1], v, &src[e1..s2], v, &src[e2..]);
                n += 1;
                if text::parse(&m, "x.hzp", &|k| w.get(k).cloned()).is_ok() {
                    ok += 1;
                }
            }
        }
    }
    // most variants are rejected, some still type-check; none may panic
    assert!(ok > 0 && ok < n, "{ok} of {n}");
}
