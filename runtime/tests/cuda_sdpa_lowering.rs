//! Fused attention in the CUDA lowering with cuDNN there (`LowerOptions::cudnn`), without a
//! GPU: accepted nodes become `Work::Sdpa` binding the plan's operand offsets (hzp's kernels
//! as fallback, or why not); refused ones run hzp's kernels with a note naming the node and
//! the reason, or are refused with both reasons when hzp's kernels may not run.

mod common;
use common::plan_of;
use hzp_ir::plan::Plan;
use hzp_runtime::cuda::lower::{lower_program_with, CudaAttention, LowerOptions, Work};
use hzp_runtime::cuda::sdpa::{Role, SdpaKind};

fn src(dt: &str, mask: bool) -> String {
    let (mask_in, mask_arg) = if mask {
        (format!("input %m : {dt}[1,1,32,32]\n"), ", %m")
    } else {
        (String::new(), "")
    };
    format!(
        r#"program "attn"
mesh gpu=1

input %q : {dt}[2,4,32,64]
input %k : {dt}[2,2,32,64]
input %v : {dt}[2,2,32,64]
input %do : {dt}[2,4,32,64]
{mask_in}%o, %lse = Attention{{scale=0.125, causal=true}}(%q, %k, %v{mask_arg}) : {dt}[2,4,32,64], f32[2,4,32] "attn"
%dq, %dk, %dv = AttentionGrad{{scale=0.125, causal=true}}(%q, %k, %v, %o, %lse, %do{mask_arg}) : {dt}[2,4,32,64], {dt}[2,2,32,64], {dt}[2,2,32,64] "attn_grad"
output %o
output %dq
output %dk
output %dv
"#
    )
}

fn plan(dt: &str, mask: bool) -> Plan {
    plan_of(hzp_ir::text::parse(&src(dt, mask), "attn", &|_| None).unwrap())
}

fn opts(attention: CudaAttention, cudnn: bool) -> LowerOptions {
    LowerOptions {
        attention,
        cudnn,
        ..LowerOptions::default()
    }
}

fn offset(p: &Plan, name: &str) -> u64 {
    let v = p.program.find_value(name).unwrap();
    p.buffers.iter().find(|b| b.value == v).unwrap().offset
}

#[test]
fn accepted_attention_runs_on_cudnn_with_the_plan_operands() {
    let p = plan("bf16", false);
    let low = lower_program_with(&p, 0, opts(CudaAttention::Flash, true)).unwrap();
    assert!(low.notes.is_empty(), "{:?}", low.notes);
    let mut seen = 0;
    for nw in &low.nodes {
        let Some(Work::Sdpa(sw)) = nw.work.first() else {
            continue;
        };
        assert_eq!(nw.work.len(), 1);
        seen += 1;
        let (kind, names): (SdpaKind, &[(&str, Role)]) = if nw.name == "attn" {
            (
                SdpaKind::Forward,
                &[
                    ("q", Role::Q),
                    ("k", Role::K),
                    ("v", Role::V),
                    ("o", Role::O),
                    ("lse", Role::Stats),
                ],
            )
        } else {
            (
                SdpaKind::Backward,
                &[
                    ("q", Role::Q),
                    ("k", Role::K),
                    ("v", Role::V),
                    ("o", Role::O),
                    ("lse", Role::Stats),
                    ("do", Role::DO),
                    ("dq", Role::DQ),
                    ("dk", Role::DK),
                    ("dv", Role::DV),
                ],
            )
        };
        assert_eq!(sw.graph.kind, kind, "{}", nw.name);
        let want: Vec<(i64, u64)> = names
            .iter()
            .map(|(n, r)| (r.uid(), offset(&p, n)))
            .collect();
        assert_eq!(sw.operands, want, "{}", nw.name);
        // every bound tensor of the graph has memory: a plan operand or the graph's scratch
        let scratch: Vec<Role> = sw.graph.scratch().iter().map(|s| s.0).collect();
        for r in sw.graph.bound() {
            assert!(
                sw.operands.iter().any(|o| o.0 == r.uid()) || scratch.contains(&r),
                "{}: {r:?} has no memory",
                nw.name
            );
        }
        // grouped-query attention (4 query heads on 2 key/value heads), causal
        assert_eq!((sw.graph.shape.hq, sw.graph.shape.hkv), (4, 2));
        assert!(sw.graph.shape.causal);
        sw.graph.check().unwrap();
        // hzp's kernels, should cuDNN not build the graph on the machine at hand
        let fb = sw.fallback.as_ref().unwrap();
        assert!(fb
            .iter()
            .all(|w| matches!(w, Work::Kernel(l) if l.kernel.starts_with("attn_"))));
    }
    assert_eq!(seen, 2);
}

/// cuDNN's workspace and the backward's row sums live in one region of the arena the
/// executor allocates: after the plan's buffers and the error word, sized for the largest
/// node, disjoint from every operand. The backward's bound holds its f32 dQ accumulator and
/// row sums and, with grouped K/V, bf16 dK and dV partials per query head.
#[test]
fn cudnn_attention_workspace_is_a_region_of_the_arena() {
    let p = plan("bf16", false);
    let low = lower_program_with(&p, 0, opts(CudaAttention::Flash, true)).unwrap();
    let (at, bytes) = low.attention_workspace;
    assert!(at >= low.err_offset + 4 && at % 256 == 0, "{at}");
    assert_eq!(at + bytes, low.alloc_bytes);
    for (o, b) in &low.consts {
        assert!(o + b.len() as u64 <= at);
    }
    let graphs: Vec<_> = (low.nodes.iter().flat_map(|nw| &nw.work))
        .filter_map(|w| match w {
            Work::Sdpa(sw) => Some(sw.graph.clone()),
            _ => None,
        })
        .collect();
    let need = graphs.iter().map(|g| g.reserved_bytes()).max().unwrap();
    assert_eq!(bytes, need);
    let bwd = graphs
        .iter()
        .find(|g| g.kind == SdpaKind::Backward)
        .unwrap();
    // q [2,4,32,64], k and v [2,2,32,64], bf16
    let (b, hq, t, s, d) = (2u64, 4, 32, 32, 64);
    let floor = 4 * b * hq * t * d + 4 * b * hq * t + 2 * 2 * b * hq * s * d;
    assert!(bwd.workspace_bound() >= floor, "{}", bwd.workspace_bound());
    let fwd = graphs.iter().find(|g| g.kind == SdpaKind::Forward).unwrap();
    assert!(fwd.workspace_bound() < bwd.workspace_bound());
    // no operand of the plan reaches into it
    for (off, len) in &low.loc {
        assert!(*len == 0 || off + len <= p.arena_bytes);
    }
    assert!(p.arena_bytes <= at);
    // without cuDNN there is no region
    let plain = lower_program_with(&p, 0, opts(CudaAttention::Flash, false)).unwrap();
    assert_eq!(plain.attention_workspace.1, 0);
    assert_eq!(plain.alloc_bytes, plain.attention_workspace.0);
}

#[test]
fn without_attention_kernels_the_fallback_says_why() {
    let p = plan("f16", false);
    let low = lower_program_with(&p, 0, opts(CudaAttention::Off, true)).unwrap();
    let sdpa: Vec<_> = low
        .nodes
        .iter()
        .filter_map(|nw| match nw.work.first() {
            Some(Work::Sdpa(sw)) => Some(sw),
            _ => None,
        })
        .collect();
    assert_eq!(sdpa.len(), 2);
    for sw in sdpa {
        let e = sw.fallback.as_ref().unwrap_err();
        assert!(e.contains("--attention flash"), "{e}");
    }
}

#[test]
fn refused_attention_runs_on_hzp_kernels_with_a_note() {
    // fp32: cuDNN's fused attention takes bf16 and fp16 only
    let p = plan("f32", false);
    let low = lower_program_with(&p, 0, opts(CudaAttention::Flash, true)).unwrap();
    assert_eq!(low.notes.len(), 2, "{:?}", low.notes);
    assert!(
        low.notes[0].starts_with(
            "node `attn` (Attention): cuDNN's fused attention does not take it: f32 operands"
        ),
        "{}",
        low.notes[0]
    );
    assert!(low.notes[1].starts_with("node `attn_grad` (AttentionGrad)"));
    assert!(low
        .notes
        .iter()
        .all(|n| n.ends_with("hzp's attention kernels run it")));
    for nw in &low.nodes {
        assert!(!nw.work.iter().any(|w| matches!(w, Work::Sdpa(_))));
    }
    let kernels: Vec<&str> = low
        .nodes
        .iter()
        .flat_map(|nw| &nw.work)
        .filter_map(|w| match w {
            Work::Kernel(l) => Some(l.kernel.as_str()),
            _ => None,
        })
        .collect();
    assert!(kernels.contains(&"attn_fwd_f32"), "{kernels:?}");
    assert!(kernels.contains(&"attn_dq_f32"), "{kernels:?}");

    // an additive mask: the same, with that reason
    let p = plan("bf16", true);
    let low = lower_program_with(&p, 0, opts(CudaAttention::Flash, true)).unwrap();
    assert_eq!(low.notes.len(), 2, "{:?}", low.notes);
    assert!(
        low.notes[0].contains("an additive mask"),
        "{}",
        low.notes[0]
    );
}

#[test]
fn refused_attention_without_hzp_kernels_gives_both_reasons() {
    let p = plan("f32", false);
    let e = lower_program_with(&p, 0, opts(CudaAttention::Off, true)).unwrap_err();
    assert!(e.starts_with("node `attn` (Attention)"), "{e}");
    assert!(e.contains("--no-fuse-attention"), "{e}");
    assert!(
        e.contains("cuDNN's fused attention does not take it: f32 operands"),
        "{e}"
    );
}

#[test]
fn without_cudnn_nothing_changes() {
    let p = plan("bf16", false);
    let low = lower_program_with(&p, 0, opts(CudaAttention::Flash, false)).unwrap();
    assert!(low.notes.is_empty());
    assert!(!low
        .nodes
        .iter()
        .flat_map(|nw| &nw.work)
        .any(|w| matches!(w, Work::Sdpa(_))));
    assert!(lower_program_with(&p, 0, opts(CudaAttention::Off, false)).is_err());
}

#[test]
fn pasa_stays_on_its_kernel() {
    let p = plan("f16", false);
    let low = lower_program_with(&p, 0, opts(CudaAttention::Pasa, true)).unwrap();
    let works: Vec<&Work> = low.nodes.iter().flat_map(|nw| &nw.work).collect();
    assert!(!works.iter().any(|w| matches!(w, Work::Sdpa(_))));
    assert!(works
        .iter()
        .any(|w| matches!(w, Work::Kernel(l) if l.kernel == "attn_fwd_pasa_f16")));
}
