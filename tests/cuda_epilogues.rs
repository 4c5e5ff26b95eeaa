//! The cuBLASLt epilogue choice per matrix product (`runtime/src/cuda/epilogue.rs`) on the
//! tiny GPT-2's one-rank training plans (fp32 and bf16): the report must equal the recorded
//! expectation in `runtime/tests/snapshots/` (`HZP_BLESS=1 cargo test --test cuda_epilogues`
//! rewrites it after a deliberate change; read the diff), and the choices must hold what the
//! module promises whatever the snapshot says: every MLP's first product takes its bias and
//! tanh GELU with the pre-activation kept, the second its bias, the GELU's backward product
//! its derivative and the bias gradient below, and no node is absorbed twice.

mod common;
use common::*;
use hzp_ir::{Op, Plan, UnaryOp};
use hzp_runtime::cuda::epilogue::{self, Epilogue};

fn compile_plan(tag: &str, extra: &[&str]) -> Plan {
    let dir = tempdir(tag);
    let out = dir.join("plan.json");
    let mut args = vec![
        "compile",
        "tests/models/gpt2_tiny.legacy.op17.onnx",
        "--mesh",
        "gpu=1",
        "--no-fuse-attention",
        "--retie",
        "--shape",
        "input_ids=4x16",
        "-o",
        s(&out),
    ];
    args.extend(extra);
    let (code, o, e) = hzp(&args);
    assert_eq!(code, 0, "{o}{e}");
    Plan::from_json(&std::fs::read_to_string(&out).unwrap(), "plan.json").unwrap()
}

fn check_snapshot(file: &str, got: &str) {
    let path = repo().join("runtime/tests/snapshots").join(file);
    if std::env::var_os("HZP_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, got).unwrap();
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run `HZP_BLESS=1 cargo test --test cuda_epilogues` to record it)",
            path.display()
        )
    });
    assert!(
        want == got,
        "{} differs from the choice now (HZP_BLESS=1 rewrites it):\n--- recorded\n{want}\n--- now\n{got}",
        path.display()
    );
}

/// What the module promises on a GPT-2 plan (f32 or bf16), independent of the snapshot:
/// every MLP's c_fc takes bias + GELU, c_attn and both c_proj their bias, the GELU's backward
/// product its derivative and c_fc's bias gradient, the other weight gradients their bias
/// gradient.
fn check_promises(plan: &Plan, fp32: bool) -> Vec<epilogue::Choice> {
    let p = &plan.program;
    let low = hzp_runtime::cuda::lower::lower_program(plan, 0).unwrap();
    let choices = epilogue::choose(p, Some(&low.loc));
    let matmuls = p
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::MatMul))
        .count();
    assert_eq!(choices.len(), matmuls);
    let mut seen = std::collections::HashSet::new();
    for c in &choices {
        for &a in &c.absorbs {
            assert!(seen.insert(a), "node {a} absorbed twice");
        }
    }
    let with = |e: Epilogue| choices.iter().filter(|c| c.epilogue == e).count();
    let gelus = p
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Unary(UnaryOp::GeluTanh)))
        .count();
    let layers = 2;
    // f32 and bf16 alike (bf16's GELU is found with its constants rounded to bf16; each
    // bias is cast to bf16 before its product and its gradient back to f32 after the
    // weight gradient's product)
    assert_eq!(gelus, layers, "fp32: {fp32}");
    // c_fc: bias + GELU; c_attn, attn c_proj, mlp c_proj: bias
    assert_eq!(with(Epilogue::GeluAuxBias), layers, "{choices:#?}");
    assert_eq!(with(Epilogue::Bias), 3 * layers, "{choices:#?}");
    // the backward of each GELU: its derivative and c_fc's bias gradient
    assert_eq!(with(Epilogue::DgeluBgrad), layers, "{choices:#?}");
    // the other three linear layers' weight gradients take their bias gradient
    assert_eq!(with(Epilogue::BgradA), 3 * layers, "{choices:#?}");
    for c in &choices {
        let n = &p.nodes[c.node];
        match c.epilogue {
            Epilogue::GeluAuxBias => {
                // the aux is the pre-activation GeluTanhGrad reads (through views)
                let aux = c.aux.expect("an aux");
                assert_eq!(p.nodes[c.absorbs[0]].inputs[0], n.outputs[0]);
                assert_eq!(p.nodes[c.absorbs[0]].outputs[0], aux);
            }
            Epilogue::DgeluBgrad => {
                assert!(matches!(p.nodes[c.absorbs[0]].op, Op::GeluTanhGrad));
                assert!(matches!(p.nodes[c.absorbs[1]].op, Op::Reduce { .. }));
                // the aux it reads is one a forward product keeps
                assert!(choices
                    .iter()
                    .any(|f| f.epilogue == Epilogue::GeluAuxBias && f.aux == c.aux));
            }
            _ => {}
        }
        // every absorbed node runs after the product: the call takes the product's place
        for &a in &c.absorbs {
            if !matches!(p.nodes[a].op, Op::Reduce { .. }) {
                assert!(a > c.node, "{} absorbs an earlier node", n.name);
            }
        }
    }
    choices
}

#[test]
fn gpt2_tiny_epilogues_match_the_recorded_choice() {
    let plan = compile_plan("epi-f32", &[]);
    let choices = check_promises(&plan, true);
    let report = epilogue::report(&plan.program, &choices);
    check_snapshot("cublaslt_epilogues_gpt2_tiny.txt", &report);
}

#[test]
fn gpt2_tiny_bf16_epilogues_match_the_recorded_choice() {
    let plan = compile_plan("epi-bf16", &["--precision", "bf16"]);
    let choices = check_promises(&plan, false);
    let report = epilogue::report(&plan.program, &choices);
    check_snapshot("cublaslt_epilogues_gpt2_tiny_bf16.txt", &report);
}

/// A second reader of the product's result, or of the GELU's pre-activation, keeps the
/// neighbour apart, with the reason named.
#[test]
fn a_second_reader_keeps_the_neighbour_apart() {
    let plan = compile_plan("epi-reader", &[]);
    let mut p = plan.program.clone();
    let before = epilogue::choose(&p, None);
    let gelu = before
        .iter()
        .find(|c| c.epilogue == Epilogue::GeluAuxBias)
        .unwrap()
        .clone();
    // make the loss read the product's raw result too: a second reader of it
    let y = p.nodes[gelu.node].outputs[0];
    p.outputs.push(y);
    let after = epilogue::choose(&p, None);
    let c = after.iter().find(|c| c.node == gelu.node).unwrap();
    assert_eq!(c.epilogue, Epilogue::Default, "{c:?}");
    // the pre-activation read by another node: the bias stays, the GELU does not
    let mut p = plan.program.clone();
    let pre = p.nodes[gelu.absorbs[0]].outputs[0];
    // (a copy of a GELU node turned into an Exp of the pre-activation, at the end)
    let k = p
        .nodes
        .iter()
        .position(|n| matches!(n.op, Op::Unary(UnaryOp::GeluTanh)))
        .unwrap();
    let mut extra = p.nodes[k].clone();
    extra.inputs[0] = pre;
    extra.op = Op::Unary(UnaryOp::Exp);
    p.nodes.push(extra);
    let after = epilogue::choose(&p, None);
    let c = after.iter().find(|c| c.node == gelu.node).unwrap();
    assert_eq!(c.epilogue, Epilogue::Bias, "{c:?}");
    assert!(
        c.why_not.iter().any(|w| w.contains("another reader")),
        "{c:?}"
    );
}

/// The cuBLASLt call of an [`LtGemm`] as cuBLASLt's documentation defines it, on the CPU:
/// column-major `P = op(A) op(B)` (`m x n`, `A` `m x k`), then the epilogue (bias of `m`
/// per row of `D`; the auxiliary matrix with `D`'s leading dimension; GELU the tanh form;
/// BGRADA sums `op(A)` over `k`). `arena` holds one element per `esize` bytes (every value the
/// call touches has the product's type); results are computed in f32 and stored rounded to
/// that type.
fn lt_model(arena: &mut [f32], g: &hzp_runtime::cuda::work::LtGemm) {
    let [c] = g.gemm.cublas_calls()[..] else {
        panic!("one call")
    };
    let esize = g.gemm.dtype.size_bytes() as u64;
    let at = |off: u64| (off / esize) as usize;
    let bf16 = g.gemm.dtype == hzp_ir::DType::BF16;
    let round = |v: f32| {
        if bf16 {
            half::bf16::from_f32(v).to_f32()
        } else {
            v
        }
    };
    let el = |arena: &[f32], base: u64, t: bool, ld: usize, r: usize, k: usize| {
        // element (r, k) of op(X), X stored column-major with leading dimension ld
        if t {
            arena[at(base) + k + r * ld]
        } else {
            arena[at(base) + r + k * ld]
        }
    };
    let gelu = |x: f32| 0.5 * x * (1.0 + (0.797_884_6_f32 * (x + 0.044715 * x * x * x)).tanh());
    let dgelu = |x: f32| {
        let t = (0.797_884_6_f32 * (x + 0.044715 * x * x * x)).tanh();
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.797_884_6 * (1.0 + 3.0 * 0.044715 * x * x)
    };
    let mut p = vec![0f32; c.m * c.n];
    for j in 0..c.n {
        for i in 0..c.m {
            let mut s = 0f64;
            for k in 0..c.k {
                s += el(arena, c.x, c.trans_x, c.ldx, i, k) as f64
                    * el(arena, c.y, c.trans_y, c.ldy, k, j) as f64;
            }
            p[i + j * c.m] = s as f32;
        }
    }
    let mut bgrad = vec![0f64; c.m];
    for j in 0..c.n {
        for i in 0..c.m {
            let mut v = p[i + j * c.m];
            match g.epilogue {
                Epilogue::Bias => v += arena[at(g.bias.unwrap()) + i],
                Epilogue::GeluAuxBias => {
                    let pre = v + arena[at(g.bias.unwrap()) + i];
                    arena[at(g.aux.unwrap()) + i + j * c.ldc] = round(pre);
                    v = gelu(pre);
                }
                Epilogue::Dgelu | Epilogue::DgeluBgrad => {
                    v *= dgelu(arena[at(g.aux.unwrap()) + i + j * c.ldc]);
                    bgrad[i] += v as f64;
                }
                _ => {}
            }
            arena[at(c.c) + i + j * c.ldc] = round(v);
        }
    }
    if g.epilogue == Epilogue::BgradA {
        for (i, b) in bgrad.iter_mut().enumerate() {
            *b = (0..c.k)
                .map(|k| el(arena, c.x, c.trans_x, c.ldx, i, k) as f64)
                .sum();
        }
    }
    if matches!(g.epilogue, Epilogue::DgeluBgrad | Epilogue::BgradA) {
        for (i, b) in bgrad.iter().enumerate() {
            arena[at(g.bias.unwrap()) + i] = round(*b as f32);
        }
    }
}

/// With `HZP_CUDA_LT=1` the lowering wires the chosen epilogues: each product's work is one
/// `LtGemm`, the absorbed nodes do no work, and the call, run through a CPU model of
/// cuBLASLt on an arena laid out as the lowering lays it out, gives what the CPU evaluator
/// gives running the product and the nodes it absorbs (within 1e-4: the model sums in
/// another order): that checks the offsets of D, the bias and the pre-activation, the leading
/// dimensions and which dimension a bias (gradient) runs along. In bf16 the model rounds what
/// it stores to bf16 and the CPU rounds each node's result, so they agree within 1e-2 of the
/// largest value.
#[test]
fn wired_epilogues_compute_what_the_nodes_they_replace_compute() {
    wired_epilogues_agree("f32", 1e-4);
}

#[test]
fn wired_bf16_epilogues_compute_what_the_nodes_they_replace_compute() {
    wired_epilogues_agree("bf16", 1e-2);
}

fn wired_epilogues_agree(precision: &str, tol: f64) {
    use hzp_runtime::cuda::lower::{LowerOptions, Work};
    let plan = compile_plan(
        &format!("epi-wire-{precision}"),
        &["--precision", precision],
    );
    let p = &plan.program;
    let opts = LowerOptions {
        lt_epilogues: true,
        ..LowerOptions::default()
    };
    let low = hzp_runtime::cuda::lower::lower_program_with(&plan, 0, opts).unwrap();
    let choices = epilogue::choose(p, Some(&low.loc));
    let mut wired = 0;
    let mut rng = 0x2545f4914f6cdd1du64;
    let mut rand = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    for c in choices.iter().filter(|c| c.epilogue != Epilogue::Default) {
        // the call runs at the product or, where only that keeps the plan's memory, at the
        // first absorbed node; every other absorbed node does no work
        let hosts: Vec<(usize, hzp_runtime::cuda::work::LtGemm)> = std::iter::once(c.node)
            .chain(c.absorbs.iter().copied())
            .flat_map(|i| {
                low.nodes[i].work.iter().filter_map(move |w| match w {
                    Work::LtGemm(g) => Some((i, g.clone())),
                    _ => None,
                })
            })
            .collect();
        let [(host, g)] = &hosts[..] else {
            panic!("`{}`: {hosts:?}", p.nodes[c.node].name)
        };
        let first_after = c.absorbs.iter().copied().filter(|&a| a > c.node).min();
        assert!(*host == c.node || Some(*host) == first_after, "{host}");
        assert_eq!(g.epilogue, c.epilogue);
        let esize = g.gemm.dtype.size_bytes() as u64;
        assert_eq!(g.gemm.dtype.name(), precision);
        assert!(!low.nodes[c.node]
            .work
            .iter()
            .any(|w| matches!(w, Work::Gemm(_))));
        for &a in c.absorbs.iter().filter(|&&a| a != *host) {
            assert!(
                low.nodes[a].work.is_empty(),
                "absorbed `{}` still works",
                p.nodes[a].name
            );
        }
        // the chain's nodes (the product, views between, the absorbed) on the CPU
        let mut chain: Vec<usize> = vec![c.node];
        chain.extend(&c.absorbs);
        let produced = |v: hzp_ir::ValueId, chain: &[usize]| {
            chain.iter().any(|&i| p.nodes[i].outputs.contains(&v))
        };
        // views between the chain's nodes
        loop {
            let missing = chain
                .iter()
                .flat_map(|&i| p.nodes[i].inputs.clone())
                .find(|&v| {
                    !produced(v, &chain)
                        && p.nodes
                            .iter()
                            .position(|n| n.outputs.contains(&v))
                            .is_some_and(|q| {
                                matches!(p.nodes[q].op, Op::Reshape { .. })
                                    && produced(p.nodes[q].inputs[0], &chain)
                            })
                });
            match missing {
                Some(v) => chain.push(p.nodes.iter().position(|n| n.outputs.contains(&v)).unwrap()),
                None => break,
            }
        }
        chain.sort();
        let mut arena = vec![0f32; (low.alloc_bytes / esize) as usize];
        let mut vals: std::collections::HashMap<hzp_ir::ValueId, hzp_ir::Tensor> =
            Default::default();
        for &i in &chain {
            for &v in &p.nodes[i].inputs {
                if produced(v, &chain) || vals.contains_key(&v) {
                    continue;
                }
                // the value, and where it is a view of another its source's bytes too
                let ty = p.ty(v);
                let q = p.nodes.iter().position(|n| n.outputs.contains(&v));
                if let Some(q) = q.filter(|&q| {
                    matches!(p.nodes[q].op, Op::Transpose { .. })
                        && low.loc[p.nodes[q].inputs[0].index()].0 == low.loc[v.index()].0
                }) {
                    // a transpose kept as a view: the GPU holds its source's bytes
                    let x = p.nodes[q].inputs[0];
                    let xt = p.ty(x);
                    let data: Vec<f64> = (0..xt.numel()).map(|_| rand()).collect();
                    let xs = hzp_ir::Tensor::from_f64(xt.dtype, xt.shape.clone(), &data);
                    let o = (low.loc[x.index()].0 / esize) as usize;
                    for (k, d) in xs.to_f64_vec().iter().enumerate() {
                        arena[o + k] = *d as f32;
                    }
                    let t = hzp_runtime::cpu::eval_op(&p.nodes[q].op, &[&xs]).unwrap();
                    vals.insert(v, t.into_iter().next().unwrap());
                    continue;
                }
                let data: Vec<f64> = (0..ty.numel()).map(|_| rand()).collect();
                let t = hzp_ir::Tensor::from_f64(ty.dtype, ty.shape.clone(), &data);
                let mut src = v;
                while let Some(q) = p.nodes.iter().position(|n| n.outputs.contains(&src)) {
                    if !matches!(p.nodes[q].op, Op::Reshape { .. }) {
                        break;
                    }
                    src = p.nodes[q].inputs[0];
                }
                for w in [v, src] {
                    let o = (low.loc[w.index()].0 / esize) as usize;
                    for (k, x) in t.to_f64_vec().iter().enumerate() {
                        arena[o + k] = *x as f32;
                    }
                }
                vals.insert(v, t);
            }
        }
        for &i in &chain {
            let n = &p.nodes[i];
            let ins: Vec<&hzp_ir::Tensor> = n.inputs.iter().map(|v| &vals[v]).collect();
            let out = hzp_runtime::cpu::eval_op(&n.op, &ins).unwrap();
            for (v, t) in n.outputs.iter().zip(out) {
                vals.insert(*v, t);
            }
        }
        lt_model(&mut arena, g);
        // what the call writes: D, the bias gradient, GELU_AUX_BIAS's pre-activation
        let aux_out = (c.epilogue == Epilogue::GeluAuxBias)
            .then_some(c.aux)
            .flatten();
        for v in [c.d, aux_out, c.bias].into_iter().flatten() {
            if c.bias == Some(v) && matches!(c.epilogue, Epilogue::Bias | Epilogue::GeluAuxBias) {
                continue;
            }
            let want = vals[&v].to_f64_vec();
            let o = (low.loc[v.index()].0 / esize) as usize;
            let scale = want.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
            for (k, w) in want.iter().enumerate() {
                let got = arena[o + k] as f64;
                assert!(
                    (got - w).abs() <= tol * scale,
                    "`{}` {}: `{}` element {k}: {got} against the CPU's {w}",
                    p.nodes[c.node].name,
                    c.epilogue.name(),
                    p.value(v).name
                );
            }
        }
        wired += 1;
    }
    assert_eq!(wired, 16, "products wired");
    // without HZP_CUDA_LT the work is the plain lowering's
    let plain =
        hzp_runtime::cuda::lower::lower_program_with(&plan, 0, LowerOptions::default()).unwrap();
    assert!(plain
        .nodes
        .iter()
        .all(|nw| !nw.work.iter().any(|w| matches!(w, Work::LtGemm(_)))));
}

/// The bf16 plan's GELU backward product cannot write the GELU gradient at the product (the
/// plan lends that buffer to the weight gradient in between), so its call runs at the GELU
/// gradient's node; where an operand it reads would be overwritten before that node, it is
/// not wired at all, and says why.
#[test]
fn a_late_call_is_refused_where_its_operand_is_overwritten() {
    use hzp_runtime::cuda::lower::{LowerOptions, Work};
    let plan = compile_plan("epi-late", &["--precision", "bf16"]);
    let p = &plan.program;
    let plain =
        hzp_runtime::cuda::lower::lower_program_with(&plan, 0, LowerOptions::default()).unwrap();
    let choices = epilogue::choose(p, Some(&plain.loc));
    let fused = vec![false; p.nodes.len()];
    let c = choices
        .iter()
        .find(|c| c.epilogue == Epilogue::DgeluBgrad)
        .unwrap()
        .clone();
    let one = std::slice::from_ref(&c);
    // as planned: wired, the call at the GELU gradient's node
    let mut nodes = plain.nodes.clone();
    let r = epilogue::wire(p, &plain.loc, one, &fused, &mut nodes);
    assert!(r[0].1.is_ok(), "{r:?}");
    let host = c.absorbs[0];
    assert!(nodes[host]
        .work
        .iter()
        .any(|w| matches!(w, Work::LtGemm(_))));
    // a value defined between the product and that node moved onto the incoming gradient
    let dy = p.nodes[c.node].inputs[0];
    let v = (c.node + 1..host)
        .flat_map(|i| p.nodes[i].outputs.clone())
        .find(|&v| {
            plain.loc[v.index()].1 > 0
                && !c.absorbs.iter().any(|&a| p.nodes[a].outputs.contains(&v))
        })
        .expect("a value between the product and the GELU gradient");
    let mut loc = plain.loc.clone();
    loc[v.index()].0 = loc[dy.index()].0;
    let mut nodes = plain.nodes.clone();
    let r = epilogue::wire(p, &loc, one, &fused, &mut nodes);
    let why = r[0].1.as_ref().unwrap_err();
    assert!(why.contains("is overwritten by"), "{why}");
    assert_eq!(nodes, plain.nodes, "nothing rewired");
}
