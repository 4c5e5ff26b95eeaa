//! The cuDNN attention graphs hzp builds (`cuda::sdpa`), without a GPU: GPT-2 small's causal
//! bf16 attention (batch 8, 12 heads, 1024 tokens, head size 64) and a grouped-query fp16
//! case, forward and backward, compared line by line with the reviewed recording
//! `tests/data/cuda_sdpa_graphs.txt`; every graph's consistency; every refusal.
//!
//! After a deliberate change of the graphs, `HZP_SDPA_RECORD=1 cargo test -p hzp-runtime
//! --test cuda_sdpa` rewrites the recording (review the diff against cuDNN's documented
//! graph before committing it).

use hzp_ir::{DType, TensorType};
use hzp_runtime::cuda::sdpa::{plan_sdpa, Refusal, Role, SdpaGraph, SdpaKind, SdpaOp};

const RECORDING: &str = "tests/data/cuda_sdpa_graphs.txt";

fn tt(dtype: DType, shape: &[usize]) -> TensorType {
    TensorType::new(dtype, shape.to_vec())
}

/// The operand types of an attention node: (inputs, outputs).
struct Node {
    ins: Vec<TensorType>,
    outs: Vec<TensorType>,
}

#[allow(clippy::too_many_arguments)]
fn node(
    kind: SdpaKind,
    dt: DType,
    b: usize,
    hq: usize,
    hkv: usize,
    t: usize,
    s: usize,
    d: usize,
) -> Node {
    let q = tt(dt, &[b, hq, t, d]);
    let k = tt(dt, &[b, hkv, s, d]);
    let v = tt(dt, &[b, hkv, s, d]);
    let o = tt(dt, &[b, hq, t, d]);
    let lse = tt(DType::F32, &[b, hq, t]);
    match kind {
        SdpaKind::Forward => Node {
            ins: vec![q, k, v],
            outs: vec![o, lse],
        },
        SdpaKind::Backward => Node {
            ins: vec![q.clone(), k.clone(), v.clone(), o.clone(), lse, o],
            outs: vec![q, k, v],
        },
    }
}

fn plan(n: &Node, kind: SdpaKind, scale: f64, causal: bool) -> Result<SdpaGraph, Refusal> {
    let ins: Vec<&TensorType> = n.ins.iter().collect();
    let outs: Vec<&TensorType> = n.outs.iter().collect();
    plan_sdpa(kind, &ins, &outs, scale, causal)
}

fn cases() -> Vec<(&'static str, SdpaGraph)> {
    let mut v = Vec::new();
    for kind in [SdpaKind::Forward, SdpaKind::Backward] {
        let gpt2 = node(kind, DType::BF16, 8, 12, 12, 1024, 1024, 64);
        let gqa = node(kind, DType::F16, 2, 8, 2, 256, 256, 128);
        let tag = |k: &str| -> &'static str {
            match (kind, k) {
                (SdpaKind::Forward, "gpt2") => "gpt2-small causal bf16 forward",
                (SdpaKind::Backward, "gpt2") => "gpt2-small causal bf16 backward",
                (SdpaKind::Forward, _) => "gqa 8/2 heads non-causal f16 forward",
                (SdpaKind::Backward, _) => "gqa 8/2 heads non-causal f16 backward",
            }
        };
        v.push((tag("gpt2"), plan(&gpt2, kind, 0.125, true).unwrap()));
        v.push((
            tag("gqa"),
            plan(&gqa, kind, 1.0 / (128f64).sqrt(), false).unwrap(),
        ));
    }
    v
}

fn render_all() -> String {
    let mut out = String::new();
    for (name, g) in cases() {
        out.push_str(&format!("# {name}\n"));
        out.push_str(&g.render());
        out.push('\n');
    }
    out
}

#[test]
fn graphs_match_the_reviewed_recording() {
    let got = render_all();
    if std::env::var("HZP_SDPA_RECORD").is_ok_and(|v| v == "1") {
        std::fs::write(RECORDING, &got).unwrap();
    }
    let want = std::fs::read_to_string(RECORDING)
        .unwrap_or_else(|e| panic!("{RECORDING}: {e} (HZP_SDPA_RECORD=1 writes it)"));
    for (i, (g, w)) in got.lines().zip(want.lines()).enumerate() {
        assert_eq!(g, w, "{RECORDING}:{}: the graph differs", i + 1);
    }
    assert_eq!(
        got.lines().count(),
        want.lines().count(),
        "{RECORDING}: line count"
    );
    // rendering is deterministic
    assert_eq!(got, render_all());
}

#[test]
fn every_graph_is_consistent() {
    for (name, g) in cases() {
        g.check().unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn layouts_are_the_plan_layouts() {
    let n = node(SdpaKind::Forward, DType::BF16, 8, 12, 12, 1024, 1024, 64);
    let g = plan(&n, SdpaKind::Forward, 0.125, true).unwrap();
    let t = |r: Role| g.tensor(r.uid()).unwrap().clone();
    // [b, h, s, d] dense
    assert_eq!(t(Role::Q).dims, vec![8, 12, 1024, 64]);
    assert_eq!(t(Role::Q).strides, vec![12 * 1024 * 64, 1024 * 64, 64, 1]);
    // K read as Kᵀ over the same bytes
    assert_eq!(t(Role::K).dims, vec![8, 12, 64, 1024]);
    assert_eq!(t(Role::K).strides, vec![12 * 1024 * 64, 1024 * 64, 1, 64]);
    // the statistics: [b, h, s_q, 1] fp32, the bytes of lse [B, Hq, T]
    let st = t(Role::Stats);
    assert_eq!(
        (st.dims.clone(), st.dtype.name()),
        (vec![8, 12, 1024, 1], "f32")
    );
    assert_eq!(st.strides, vec![12 * 1024, 1024, 1, 1]);
    assert_eq!(t(Role::Scale).by_value, Some(0.125));
    assert_eq!(
        g.bound(),
        vec![Role::Q, Role::K, Role::V, Role::O, Role::Stats]
    );
    assert!(g.scratch().is_empty());
    // the causal mask is there, and not without causal
    let selects = |g: &SdpaGraph| {
        g.ops
            .iter()
            .filter(|o| matches!(o, SdpaOp::Pointwise { t: Some(_), .. }))
            .count()
    };
    assert_eq!(selects(&g), 1);
    let nc = plan(&n, SdpaKind::Forward, 0.125, false).unwrap();
    assert_eq!(selects(&nc), 0);
    assert!(nc.tensor(Role::MaskValue.uid()).is_none());
    // the backward's row sums are scratch memory hzp provides
    let nb = node(SdpaKind::Backward, DType::BF16, 8, 12, 12, 1024, 1024, 64);
    let gb = plan(&nb, SdpaKind::Backward, 0.125, true).unwrap();
    assert_eq!(gb.scratch(), vec![(Role::RowSum, 8 * 12 * 1024 * 4)]);
}

#[test]
fn a_broken_graph_fails_the_check() {
    let n = node(SdpaKind::Backward, DType::BF16, 1, 2, 1, 16, 16, 8);
    let g = plan(&n, SdpaKind::Backward, 0.5, true).unwrap();
    g.check().unwrap();
    // an operation dropped: something is read before it is written
    let mut dropped = g.clone();
    dropped.ops.remove(2);
    assert!(dropped.check().is_err());
    // an operand's dims changed
    let mut bent = g.clone();
    bent.tensors[0].dims[2] += 1;
    assert!(bent.check().is_err());
    // a duplicated uid
    let mut dup = g;
    let u = dup.tensors[1].uid;
    dup.tensors[0].uid = u;
    assert!(dup.check().unwrap_err().contains("twice"));
}

#[test]
fn every_refusal_names_its_reason() {
    let f = SdpaKind::Forward;
    let ok = node(f, DType::BF16, 2, 4, 4, 32, 32, 64);
    assert!(plan(&ok, f, 0.125, true).is_ok());
    let check = |n: &Node, kind: SdpaKind, scale: f64, want: Refusal, words: &str| {
        let e = plan(n, kind, scale, true).unwrap_err();
        assert_eq!(e, want);
        assert!(e.to_string().contains(words), "{e}");
    };
    // fp32 I/O
    check(
        &node(f, DType::F32, 2, 4, 4, 32, 32, 64),
        f,
        0.1,
        Refusal::Precision(DType::F32),
        "bf16 or fp16",
    );
    // head size: not a multiple of 8, above 256
    check(
        &node(f, DType::BF16, 2, 4, 4, 32, 32, 60),
        f,
        0.1,
        Refusal::HeadDim(60),
        "multiple of 8",
    );
    check(
        &node(f, DType::BF16, 2, 4, 4, 32, 32, 264),
        f,
        0.1,
        Refusal::HeadDim(264),
        "at most 256",
    );
    // value head size differs
    let mut dv = node(f, DType::BF16, 2, 4, 4, 32, 32, 64);
    dv.ins[2] = tt(DType::BF16, &[2, 4, 32, 32]);
    dv.outs[0] = tt(DType::BF16, &[2, 4, 32, 32]);
    check(
        &dv,
        f,
        0.1,
        Refusal::ValueHeadDim { d: 64, dv: 32 },
        "value head size",
    );
    // an additive mask
    let mut masked = node(f, DType::BF16, 2, 4, 4, 32, 32, 64);
    masked.ins.push(tt(DType::BF16, &[1, 1, 32, 32]));
    check(
        &masked,
        f,
        0.1,
        Refusal::AdditiveMask,
        "only the causal mask",
    );
    let mut masked_b = node(SdpaKind::Backward, DType::BF16, 2, 4, 4, 32, 32, 64);
    masked_b.ins.push(tt(DType::BF16, &[1, 1, 32, 32]));
    check(
        &masked_b,
        SdpaKind::Backward,
        0.1,
        Refusal::AdditiveMask,
        "only the causal mask",
    );
    // mixed types
    let mut mixed = node(f, DType::BF16, 2, 4, 4, 32, 32, 64);
    mixed.ins[1] = tt(DType::F16, &[2, 4, 32, 64]);
    check(&mixed, f, 0.1, Refusal::MixedTypes, "one type");
    // heads that do not group
    check(
        &node(f, DType::BF16, 2, 6, 4, 32, 32, 64),
        f,
        0.1,
        Refusal::Heads { hq: 6, hkv: 4 },
        "not a multiple",
    );
    // an empty dim
    check(
        &node(f, DType::BF16, 2, 4, 4, 0, 32, 64),
        f,
        0.1,
        Refusal::Empty,
        "empty",
    );
    // a scale that is not finite
    check(
        &node(f, DType::BF16, 2, 4, 4, 32, 32, 64),
        f,
        f64::INFINITY,
        Refusal::Scale(f64::INFINITY),
        "not finite",
    );
    // statistics not fp32
    let mut lse = node(f, DType::BF16, 2, 4, 4, 32, 32, 64);
    lse.outs[1] = tt(DType::BF16, &[2, 4, 32]);
    check(&lse, f, 0.1, Refusal::Stats(DType::BF16), "not f32");
    // operands not of rank 4, or disagreeing
    let mut r3 = node(f, DType::BF16, 2, 4, 4, 32, 32, 64);
    r3.ins[0] = tt(DType::BF16, &[8, 32, 64]);
    let e = plan(&r3, f, 0.1, true).unwrap_err();
    assert!(matches!(e, Refusal::Shapes(_)), "{e:?}");
    assert!(e.to_string().contains("rank 4"), "{e}");
    let mut wrong_o = node(f, DType::BF16, 2, 4, 4, 32, 32, 64);
    wrong_o.outs[0] = tt(DType::BF16, &[2, 4, 16, 64]);
    let e = plan(&wrong_o, f, 0.1, true).unwrap_err();
    assert!(matches!(e, Refusal::Shapes(_)), "{e:?}");
    let mut short = node(f, DType::BF16, 2, 4, 4, 32, 32, 64);
    short.ins.pop();
    assert!(matches!(
        plan(&short, f, 0.1, true).unwrap_err(),
        Refusal::Shapes(_)
    ));
}
