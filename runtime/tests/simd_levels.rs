//! The CPU kernels give the same bits at every vector level (`HZP_SIMD=baseline|avx2`, or
//! the widest the CPU has): the special functions use fused multiply-adds at every level
//! and reductions keep one order whatever the lane width. The test re-runs itself as a
//! child process per level (the level is fixed once per process) and compares digests of
//! the levels it really ran at (a cap above what the CPU has runs at the same level, which
//! is skipped and said), printing which levels were compared.

#[path = "../../tests/common/skip.rs"]
mod skip;
use hzp_ir::{Op, Tensor, UnaryOp};
use hzp_runtime::cpu::eval_op;
use std::process::Command;

const CHILD: &str = "HZP_SIMD_LEVELS_CHILD";

/// Per kernel, FNV-1a over the f32 bit patterns of its outputs (NaNs as one pattern).
fn digest() -> String {
    let n = 4099; // not a multiple of any lane count
    let mut v: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 2000) as f32 / 90.0 - 11.0)
        .collect();
    v[..6].copy_from_slice(&[0.0, -0.0, f32::NAN, f32::INFINITY, -f32::INFINITY, 1e-30]);
    let x = Tensor::f32(vec![n], v.clone());
    let rows = Tensor::f32(vec![1, n], v[..n].to_vec());
    let clean = Tensor::f32(vec![1, n - 6], v[6..].to_vec());
    let clean_n = Tensor::f32(vec![n], v.iter().map(|x| x * 0.5 + 0.25).collect());
    let label = Tensor::i64(vec![1], vec![17]);
    let dy = Tensor::f32(vec![1], vec![0.75]);
    let mut cases: Vec<(Op, Vec<&Tensor>)> = [
        UnaryOp::Exp,
        UnaryOp::Tanh,
        UnaryOp::Erf,
        UnaryOp::Sigmoid,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
    ]
    .into_iter()
    .map(|u| (Op::Unary(u), vec![&x]))
    .collect();
    cases.push((Op::GeluTanhGrad, vec![&x, &x]));
    cases.push((Op::Softmax { axis: 1 }, vec![&clean]));
    cases.push((Op::LogSoftmax { axis: 1 }, vec![&clean]));
    cases.push((Op::Softmax { axis: 1 }, vec![&rows]));
    cases.push((Op::SoftmaxCrossEntropy { axis: 1 }, vec![&clean, &label]));
    cases.push((
        Op::SoftmaxCrossEntropyGrad { axis: 1 },
        vec![&clean, &label, &dy],
    ));
    // the class axis first: 37 positions side by side (sixteen-, four- and one-wide lanes)
    let cols = Tensor::f32(vec![(n - 6) / 37, 37], v[6..6 + (n - 6) / 37 * 37].to_vec());
    let col_labels = Tensor::i64(vec![37], (0..37).map(|k| (k * 5) % 110).collect());
    let col_dy = Tensor::f32(vec![37], (0..37).map(|k| 0.5 + k as f32 / 37.0).collect());
    cases.push((
        Op::SoftmaxCrossEntropy { axis: 0 },
        vec![&cols, &col_labels],
    ));
    cases.push((
        Op::SoftmaxCrossEntropyGrad { axis: 0 },
        vec![&cols, &col_labels, &col_dy],
    ));
    // a sum over the leading axis (bias gradients): f64 per column at any width
    cases.push((
        Op::Reduce {
            op: hzp_ir::ReduceOp::Sum,
            axes: vec![0],
            keep_dims: false,
        },
        vec![&cols],
    ));
    // LayerNorm / RmsNorm gradients over rows of 4093 (sixteen-wide pieces and a tail)
    let dyn_ = Tensor::f32(
        vec![1, n - 6],
        v[6..].iter().map(|x| x * 0.3 - 0.1).collect(),
    );
    let gamma = Tensor::f32(vec![n - 6], v[6..].iter().map(|x| 1.0 + x * 0.01).collect());
    for op in [
        Op::LayerNormGrad {
            axis: 1,
            epsilon: 1e-5,
        },
        Op::RmsNormGrad {
            axis: 1,
            epsilon: 1e-6,
        },
    ] {
        cases.push((op, vec![&clean, &gamma, &dyn_]));
    }
    // AdamW: parameters, gradients (with the special values), positive second moments
    let (m1, v2) = (
        Tensor::f32(vec![n], v.iter().map(|x| x * 0.01).collect()),
        Tensor::f32(vec![n], (0..n).map(|i| (i % 97) as f32 * 1e-4).collect()),
    );
    let (lr, b2) = (
        Tensor::f32(vec![], vec![1e-3]),
        Tensor::f32(vec![], vec![0.03]),
    );
    cases.push((
        Op::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        vec![&clean_n, &x, &m1, &v2, &lr, &b2, &lr],
    ));
    // fused attention, forward and backward: 37 queries over 2 key/value heads of 4 query
    // heads, head size 19 (eight-wide dot products and a tail), a mask with -inf entries
    let w = &v[6..]; // no special values
    let take = |len: usize, off: usize, sc: f32| -> Vec<f32> {
        (0..len).map(|i| w[(off + i * 3) % w.len()] * sc).collect()
    };
    let (aq, ak, av, amask, ado) = (
        Tensor::f32(vec![1, 4, 37, 19], take(4 * 37 * 19, 0, 0.3)),
        Tensor::f32(vec![1, 2, 37, 19], take(2 * 37 * 19, 101, 0.1)),
        Tensor::f32(vec![1, 2, 37, 19], take(2 * 37 * 19, 907, 1.0)),
        Tensor::f32(
            vec![37, 37],
            (0..37 * 37)
                .map(|i| {
                    if i % 11 == 3 {
                        f32::NEG_INFINITY
                    } else {
                        (i % 7) as f32 * 0.1
                    }
                })
                .collect(),
        ),
        Tensor::f32(vec![1, 4, 37, 19], take(4 * 37 * 19, 2003, 0.5)),
    );
    for causal in [false, true] {
        let att = Op::Attention { scale: 0.2, causal };
        let fwd = eval_op(&att, &[&aq, &ak, &av, &amask]).unwrap();
        cases.push((att, vec![&aq, &ak, &av, &amask]));
        let grad = Op::AttentionGrad { scale: 0.2, causal };
        // the forward's results as inputs of the gradient: leaked, as `cases` borrows them
        let (o, lse) = (
            Box::leak(Box::new(fwd[0].clone())),
            Box::leak(Box::new(fwd[1].clone())),
        );
        cases.push((grad, vec![&aq, &ak, &av, &*o, &*lse, &ado, &amask]));
    }
    let mut out = String::new();
    for (op, ins) in cases {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for t in eval_op(&op, &ins).unwrap() {
            for x in t.to_f64_vec() {
                // a NaN's sign and payload depend on the instruction that made it
                let bits = if x.is_nan() {
                    0x7fc0_0000
                } else {
                    (x as f32).to_bits()
                };
                for b in bits.to_le_bytes() {
                    h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
                }
            }
        }
        out.push_str(&format!("{} {h:016x}\n", op.name()));
    }
    out
}

#[test]
fn every_simd_level_gives_the_same_bits() {
    if std::env::var_os(CHILD).is_some() {
        // (on lines of their own: the test harness prints around them)
        println!("\nLEVEL {:?}", hzp_runtime::cpu::math::simd());
        for line in digest().lines() {
            println!("\nDIGEST {line}");
        }
        return;
    }
    let exe = std::env::current_exe().unwrap();
    // (the level the child ran at, its digests)
    let at = |level: Option<&str>| -> (String, String) {
        let mut c = Command::new(&exe);
        c.args([
            "every_simd_level_gives_the_same_bits",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1");
        match level {
            Some(l) => c.env("HZP_SIMD", l),
            None => c.env_remove("HZP_SIMD"),
        };
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        let d: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("DIGEST "))
            .collect();
        assert_eq!(d.len(), 23, "no digests in the child's output: {text}");
        let ran = text
            .lines()
            .find_map(|l| l.strip_prefix("LEVEL "))
            .unwrap_or_else(|| panic!("no level in the child's output: {text}"))
            .to_string();
        (ran, d.join("\n"))
    };
    let (widest_level, widest) = at(None);
    let mut compared = vec![widest_level.clone()];
    for level in ["avx2", "baseline"] {
        let (ran, digest) = at(Some(level));
        if compared.contains(&ran) {
            // this CPU lacks a wider level: capping changed nothing, nothing new to compare
            continue;
        }
        assert_eq!(
            digest, widest,
            "HZP_SIMD={level} ({ran}) vs the widest level ({widest_level})"
        );
        compared.push(ran);
    }
    eprintln!("compared SIMD levels: {}", compared.join(", "));
    if compared.len() < 3 {
        skip::skip(
            "",
            skip::Missing::Other,
            &format!(
                "this CPU offers only {} of the 3 levels (Avx512, Avx2, Baseline); the missing \
                 ones were not compared",
                compared.len()
            ),
        );
    }
    // the baseline is always available, so at least two levels were compared on x86-64
    // CPUs with AVX2 and FMA
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        assert!(compared.len() >= 2, "only {compared:?} compared");
    }
}
