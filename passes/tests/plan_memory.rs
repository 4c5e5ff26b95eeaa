//! The memory planner on hand-built and generated programs.

mod plan_common;

use hzp_ir::*;
use hzp_passes::plan::memory::{plan_memory, HappensBefore, MemoryPlan};
use hzp_passes::plan::verify::verify_plan;
use plan_common::*;

fn check_report(m: &MemoryPlan) {
    let max = m.timeline.iter().map(|&(_, b)| b).max().unwrap_or(0);
    assert_eq!(m.peak_bytes, max, "the peak is the timeline's maximum");
    assert_eq!(
        m.peak_by_kind.values().sum::<u64>(),
        m.peak_bytes,
        "{:?}",
        m.peak_by_kind
    );
    assert!(m.arena_bytes >= m.peak_bytes);
    for (i, &(k, _)) in m.timeline.iter().enumerate() {
        assert_eq!(i, k);
    }
    for b in &m.buffers {
        assert_eq!(b.offset % 64, 0);
        assert!(b.offset + b.bytes <= m.arena_bytes);
    }
}

const CHAIN: &str = r#"program "chain"
input %x : f32[16,16]
%a = Relu(%x) "a"
%b = Relu(%a) "b"
%c = Relu(%b) "c"
%d = Relu(%c) "d"
%e = Relu(%d) "e"
output %e
"#;

#[test]
fn a_chain_reuses_buffers() {
    let p = parse(CHAIN);
    let m = plan_mem(&p);
    check_report(&m);
    let off = |n: &str| offset(&m, &p, n);
    // the input is persistent, at the bottom; the chain ping-pongs between two buffers
    assert_eq!(off("x"), 0);
    assert_eq!(off("a"), off("c"));
    assert_eq!(off("b"), off("d"));
    assert_ne!(off("a"), off("b"));
    assert_eq!(m.arena_bytes, 3 * 1024);
    // x, a and b are live while b is computed
    assert_eq!(m.peak_bytes, 3 * 1024);
    assert_eq!(m.peak_index, Some(1));
    assert_eq!(
        m.timeline,
        vec![(0, 2048), (1, 3072), (2, 3072), (3, 3072), (4, 3072)]
    );
    assert_eq!(m.peak_by_kind[&BufferKind::Input], 1024);
    assert_eq!(m.peak_by_kind[&BufferKind::Activation], 2048);
}

/// A gradient computed on compute is reduce-scattered on the reduce-scatter stream; later
/// compute produces `h` of the same size. `h` may take the gradient's bytes only when an event
/// orders the reduce-scatter before `h`: issue order alone is not enough.
fn cross_stream(event_back: bool) -> String {
    let back = if event_back {
        "RecordEvent{event=2}() \"rs_done\" @reducescatter\nWaitEvent{event=2}() \"wait_rs\"\n"
    } else {
        ""
    };
    format!(
        r#"program "cross"
mesh gpu=4
input %x : f32[64]
%grad = Relu(%x) "grad"
RecordEvent{{event=1}}() "grad_done"
WaitEvent{{event=1}}() "rs_wait" @reducescatter
%shard = ReduceScatter{{group=[gpu], axis=0, reduce=sum}}(%grad) "rs" @reducescatter
{back}%h = Relu(%x) "h"
%k = Relu(%h) "k"
output %shard, %k
"#
    )
}

#[test]
fn values_read_across_streams_are_not_reused_before_the_event() {
    let p = parse(&cross_stream(false));
    let m = plan_mem(&p);
    check_report(&m);
    assert_ne!(offset(&m, &p, "grad"), offset(&m, &p, "h"));
    verify_plan(&plan_of(p.clone()), None).unwrap_or_else(|v| panic!("{v:#?}"));

    let p = parse(&cross_stream(true));
    let m = plan_mem(&p);
    check_report(&m);
    assert_eq!(offset(&m, &p, "grad"), offset(&m, &p, "h"));
    verify_plan(&plan_of(p.clone()), None).unwrap_or_else(|v| panic!("{v:#?}"));
    // the issue-order timeline is the same either way: reuse needs more than issue order
    assert_eq!(
        plan_mem(&parse(&cross_stream(false))).peak_bytes,
        m.peak_bytes
    );
}

#[test]
fn a_free_ends_a_life() {
    // `a` is freed after `b` reads it; `late` reads it again after the free (a use after
    // free, which the verifier rejects). The planner trusts the free: `c` takes a's bytes.
    let with_free = r#"program "f"
input %x : f32[16,16]
%a = Relu(%x) "a"
%b = Relu(%a) "b"
Free(%a) "free_a"
%c = Relu(%b) "c"
%late = Add(%c, %a) "late"
output %late
"#;
    let p = parse(with_free);
    let m = plan_mem(&p);
    check_report(&m);
    assert_eq!(offset(&m, &p, "a"), offset(&m, &p, "c"));
    let v = verify_plan(&plan_of(p), None).unwrap_err();
    assert!(
        v.iter().any(|x| x
            .message
            .contains("`late` (Add on compute) reads %a after `free_a`")),
        "{v:#?}"
    );
    // without the free, `late` keeps `a` alive and `c` goes elsewhere
    let p = parse(&edit(with_free, "Free(%a) \"free_a\"\n", ""));
    let m = plan_mem(&p);
    assert_ne!(offset(&m, &p, "a"), offset(&m, &p, "c"));
    verify_plan(&plan_of(p), None).unwrap_or_else(|v| panic!("{v:#?}"));
}

#[test]
fn a_free_on_another_stream_is_a_use_too() {
    // `g` is freed on the all-gather stream; compute may reuse its bytes only once an event
    // says the free happened.
    let src = |event_back: bool| {
        format!(
            r#"program "f2"
input %x : f32[16,16]
%g = Relu(%x) "g"
%r = Relu(%g) "r"
RecordEvent{{event=1}}() "r_done"
WaitEvent{{event=1}}() "ag_wait" @allgather
Free(%g) "free_g" @allgather
{}%n = Relu(%r) "n"
output %n
"#,
            if event_back {
                "RecordEvent{event=2}() \"freed\" @allgather\nWaitEvent{event=2}() \"wait_free\"\n"
            } else {
                ""
            }
        )
    };
    let p = parse(&src(false));
    let m = plan_mem(&p);
    assert_ne!(offset(&m, &p, "g"), offset(&m, &p, "n"));
    let p = parse(&src(true));
    let m = plan_mem(&p);
    assert_eq!(offset(&m, &p, "g"), offset(&m, &p, "n"));
    verify_plan(&plan_of(p), None).unwrap_or_else(|v| panic!("{v:#?}"));
}

#[test]
fn reshapes_share_their_input_bytes() {
    // `r` and `i` are views of `a`: one buffer, no copy. `r` is read last by `d`, so `a`'s
    // bytes stay in use until then: `c` may not take them although `a` itself is dead.
    let src = r#"program "views"
input %x : f32[16,16]
%a = Relu(%x) "a"
%r = Reshape{shape=[256]}(%a) "r"
%i = Identity(%r) "i"
%b = Relu(%i) "b"
%c = Relu(%b) "c"
%e = Reshape{shape=[16,16]}(%c) "e"
%d = Add(%e, %x) "d"
%f = Reshape{shape=[256]}(%d) "f"
%g = Add(%f, %r) "g"
%xr = Reshape{shape=[256]}(%x) "xr"
%h = Add(%g, %xr) "h"
output %h
"#;
    let p = parse(src);
    let m = plan_mem(&p);
    check_report(&m);
    let off = |n: &str| offset(&m, &p, n);
    assert_eq!(off("r"), off("a"));
    assert_eq!(off("i"), off("a"));
    assert_eq!(off("e"), off("c"));
    for other in ["b", "c", "d"] {
        assert_ne!(off(other), off("a"), "{other} is live with r");
    }
    // a view of a persistent input lies in the input's bytes too
    assert_eq!(off("xr"), off("x"));
    // views add no bytes to the timeline: a, b and x are live while b is computed
    assert_eq!(m.timeline[3].1, 3 * 1024);
    let plan = plan_of(p.clone());
    verify_plan(&plan, None).unwrap_or_else(|v| panic!("{v:#?}"));

    // the verifier still checks every view against the other buffers: `c` over `a`'s bytes
    // overwrites `r` before `g` reads it
    let mut bad = plan.clone();
    let (a, c) = (p.find_value("a").unwrap(), p.find_value("c").unwrap());
    let at = bad.buffers.iter().find(|b| b.value == a).unwrap().offset;
    for b in bad.buffers.iter_mut() {
        if b.value == c || p.value(b.value).name == "e" {
            b.offset = at;
        }
    }
    let v = verify_plan(&bad, None).unwrap_err();
    assert!(
        v.iter()
            .any(|x| x.message.contains("%r") && x.message.contains("%c")),
        "{v:#?}"
    );
}

#[test]
fn an_update_waits_for_the_views_of_its_target() {
    // `new` may be written over `w` only once nothing reads `w`'s bytes any more: its view
    // `wv` counts as a reader.
    let src = |late: bool| {
        let y = "%y = Add(%wv, %x) \"y\"\n";
        format!(
            "program \"upd\"\ninput %x : f32[16,16]\nparam %w : f32[16,16]\n\
             %wv = Identity(%w) \"wv\"\n{}%new = Relu(%x) \"new\"\n{}output %y\n\
             update %w = %new\n",
            if late { "" } else { y },
            if late { y } else { "" },
        )
    };
    for late in [false, true] {
        let p = parse(&src(late));
        let m = plan_mem(&p);
        check_report(&m);
        assert_eq!(offset(&m, &p, "wv"), offset(&m, &p, "w"));
        assert_eq!(
            offset(&m, &p, "new") == offset(&m, &p, "w"),
            !late,
            "late = {late}"
        );
        verify_plan(&plan_of(p), None).unwrap_or_else(|v| panic!("{v:#?}"));
    }
}

#[test]
fn an_update_unpacked_by_reshapes_is_written_over_its_target_by_the_slice() {
    // A parameter unpacked from a gathered bucket: `Slice` then reshapes. When nothing reads
    // `w` after the slice, the slice writes straight into `w`'s bytes and the reshapes copy
    // nothing; when `w` is read after it (`late`), the chain keeps its own bytes. `shared`:
    // the slice is read by something else too, so only the last reshape may go in place.
    let src = |late: bool, shared: bool| {
        format!(
            "program \"unpack\"\ninput %x : f32[2,32]\nparam %w : f32[32]\n\
             %y0 = Relu(%w) \"y0\"\n\
             %s = Slice{{axes=[1], starts=[0], ends=[16], steps=[1]}}(%x) \"s\"\n\
             %r1 = Reshape{{shape=[4,8]}}(%s) \"r1\"\n%r2 = Reshape{{shape=[32]}}(%r1) \"r2\"\n\
             {}{}output %y0{}\nupdate %w = %r2\n",
            if late { "%y1 = Relu(%w) \"y1\"\n" } else { "" },
            if shared { "%z = Relu(%s) \"z\"\n" } else { "" },
            if shared { ", %z" } else { "" },
        )
    };
    for (late, shared) in [(false, false), (true, false), (false, true)] {
        let p = parse(&src(late, shared));
        let m = plan_mem(&p);
        check_report(&m);
        let w = offset(&m, &p, "w");
        let what = format!("late {late}, shared {shared}");
        assert_eq!(offset(&m, &p, "s") == w, !late && !shared, "{what}");
        assert_eq!(offset(&m, &p, "r1") == w, !late && !shared, "{what}");
        assert_eq!(offset(&m, &p, "r2") == w, !late, "{what}");
        if !late && !shared {
            assert_eq!(offset(&m, &p, "r1"), offset(&m, &p, "s"));
        }
        verify_plan(&plan_of(p), None).unwrap_or_else(|v| panic!("{what}: {v:#?}"));
    }
}

#[test]
fn a_fused_adamw_writes_each_result_over_the_state_it_replaces() {
    // `late`: the parameter is read again after the step; `twice`: the step reads the
    // parameter as its gradient too. Either keeps the new parameter out of the old one's
    // bytes; the moments go in place regardless.
    let src = |late: bool, twice: bool| {
        format!(
            "program \"adamw\"\ninput %g : f32[64]\nparam %w : f32[64]\nstate %m : f32[64]\n\
             state %v : f32[64]\nconst %lr : f32[] = [0.001]\nconst %bc : f32[] = [0.5]\n\
             %w2, %m2, %v2 = AdamW{{beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01}}(%w, {}, \
             %m, %v, %lr, %bc, %lr) \"adamw\"\n{}output {}\n\
             update %w = %w2\nupdate %m = %m2\nupdate %v = %v2\n",
            if twice { "%w" } else { "%g" },
            if late { "%y = Relu(%w) \"y\"\n" } else { "" },
            if late { "%y" } else { "%w2" },
        )
    };
    for (late, twice) in [(false, false), (true, false), (false, true)] {
        let p = parse(&src(late, twice));
        let m = plan_mem(&p);
        check_report(&m);
        let w_in_place = !late && !twice;
        assert_eq!(
            offset(&m, &p, "w2") == offset(&m, &p, "w"),
            w_in_place,
            "late {late}, twice {twice}"
        );
        assert_eq!(offset(&m, &p, "m2"), offset(&m, &p, "m"));
        assert_eq!(offset(&m, &p, "v2"), offset(&m, &p, "v"));
        let plan = plan_of(p.clone());
        verify_plan(&plan, None).unwrap_or_else(|v| panic!("{v:#?}"));
        if w_in_place {
            continue;
        }
        // the verifier refuses the new parameter over the old one when that is still read
        let mut bad = plan;
        let (w, w2) = (p.find_value("w").unwrap(), p.find_value("w2").unwrap());
        let at = bad.buffers.iter().find(|b| b.value == w).unwrap().offset;
        bad.buffers
            .iter_mut()
            .find(|b| b.value == w2)
            .unwrap()
            .offset = at;
        let v = verify_plan(&bad, None).unwrap_err();
        assert!(
            v.iter()
                .any(|x| x.message.contains("%w2") && x.message.contains("%w ")),
            "{v:#?}"
        );
    }
}

#[test]
fn a_scatter_writes_over_data_that_nothing_else_reads() {
    // `late`: the data is read again after the scatter; `view`: the data is a reshape of a
    // value read later. Either keeps the result out of the data's bytes.
    let src = |late: bool, view: bool| {
        format!(
            "program \"sc\"\ninput %x : f32[8,4]\ninput %idx : i64[3,1]\ninput %u : f32[3,4]\n\
             %r = Relu(%x) \"r\"\n{}\
             %s = ScatterND{{add=true}}(%d, %idx, %u) \"s\"\n\
             %y = Add(%s, {}) \"y\"\noutput %y\n",
            if view {
                "%rr = Reshape{shape=[4,8]}(%r) \"rr\"\n%d = Reshape{shape=[8,4]}(%rr) \"d\"\n"
            } else {
                "%d = Neg(%r) \"d\"\n"
            },
            if late {
                "%d"
            } else if view {
                "%r"
            } else {
                "%x"
            },
        )
    };
    for (late, view) in [(false, false), (true, false), (false, true)] {
        let p = parse(&src(late, view));
        let m = plan_mem(&p);
        check_report(&m);
        assert_eq!(
            offset(&m, &p, "s") == offset(&m, &p, "d"),
            !late && !view,
            "late {late}, view {view}"
        );
        verify_plan(&plan_of(p), None).unwrap_or_else(|v| panic!("{v:#?}"));
    }
}

#[test]
fn an_in_place_result_counts_as_its_own_kind_at_the_peak() {
    // `s` (a gradient, say) is scattered over `d` (an activation) and takes its bytes; the
    // peak is at `y`, when those bytes hold `s`
    let p = parse(
        "program \"k\"\ninput %x : f32[8,4]\ninput %idx : i64[3,1]\ninput %u : f32[3,4]\n\
         %d = Neg(%x) \"d\"\n\
         %s = ScatterND{add=true}(%d, %idx, %u) \"s\"\n\
         %y = Concat{axis=0}(%s, %s) \"y\"\noutput %y\n",
    );
    let s = p.find_value("s").unwrap();
    let base = hzp_passes::plan::memory::default_kind(&p);
    let kinds = |v: ValueId| if v == s { BufferKind::Grad } else { base(v) };
    let m = plan_memory(
        &p,
        &kinds,
        &hzp_passes::plan::memory::default_persistent(&p),
    );
    check_report(&m);
    assert_eq!(offset(&m, &p, "s"), offset(&m, &p, "d"));
    assert_eq!(m.peak_by_kind.get(&BufferKind::Grad), Some(&128));
    assert_eq!(
        m.peak_by_kind.get(&BufferKind::Activation),
        Some(&256),
        "{:?}",
        m.peak_by_kind
    );
}

#[test]
fn the_good_two_stream_plan() {
    let p = parse(TWO_STREAMS);
    let m = plan_mem(&p);
    check_report(&m);
    // the two gathered copies are live together (ag1 is prefetched while mul0 runs)
    assert_ne!(offset(&m, &p, "ag0"), offset(&m, &p, "ag1"));
    // mul1 may take ag0's bytes: free0 happens before it on compute
    assert_eq!(offset(&m, &p, "ag0"), offset(&m, &p, "mul1"));
}

#[test]
fn happens_before_follows_streams_and_events() {
    let p = parse(TWO_STREAMS);
    let hb = HappensBefore::new(&p);
    let id = |name: &str| NodeId(p.nodes.iter().position(|n| n.name == name).unwrap() as u32);
    assert!(hb.happens_before(id("ag0"), id("ag1")), "stream order");
    assert!(hb.happens_before(id("ag0"), id("mul0")), "through event 1");
    assert!(hb.happens_before(id("ag1"), id("mul1")), "through event 2");
    assert!(
        !hb.happens_before(id("ag1"), id("mul0")),
        "event 1 is before ag1"
    );
    assert!(
        !hb.happens_before(id("mul0"), id("ag1")),
        "nothing orders compute before"
    );
    assert!(!hb.happens_before(id("mul0"), id("mul0")));
    assert!(hb.problems.is_empty());
}

#[test]
fn planning_is_deterministic() {
    for src in [CHAIN, TWO_STREAMS, &cross_stream(true)] {
        let p = parse(src);
        let a = plan_mem(&p);
        let b = plan_mem(&parse(src));
        assert_eq!(a, b);
        assert_eq!(plan_of(p.clone()).to_json(), plan_of(parse(src)).to_json());
    }
}

/// A small deterministic generator of valid multi-stream programs: compute ops on three
/// sizes, all-gathers on the all-gather stream and reduce-scatters on the reduce-scatter
/// stream, every cross-stream read behind an event, some values freed.
fn generated(seed: u64, n: usize) -> Program {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut rnd = move |k: usize| -> usize {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) % k as u64) as usize
    };
    let mut p = Program::new("gen");
    p.mesh = Some(Mesh::parse("gpu=4").unwrap());
    let sizes = [16usize, 64, 256];
    let mut pool: Vec<Vec<ValueId>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| vec![p.add_input(format!("in{i}"), TensorType::new(DType::F32, vec![s]))])
        .collect();
    let mut event = 0u32;
    let mut freed: Vec<ValueId> = Vec::new();
    let mut last_collective: [Option<ValueId>; 3] = [None; 3];
    // makes node reads of `v` on stream `s` safe: record after its producer, wait on `s`
    let order = |p: &mut Program, v: ValueId, s: StreamKind, event: &mut u32| {
        let Some(prod) = p.producer(v) else { return };
        let probe = p.nodes.len();
        p.nodes.push(Node {
            name: "probe".into(),
            op: Op::Identity,
            inputs: vec![],
            outputs: vec![],
            stream: s,
            role: Default::default(),
        });
        let ok = HappensBefore::new(p).happens_before(prod, NodeId(probe as u32));
        p.nodes.pop();
        if !ok {
            *event += 1;
            let ps = p.nodes[prod.index()].stream;
            let e = *event;
            p.add_node(
                format!("rec{e}"),
                Op::RecordEvent { event: e },
                vec![],
                vec![],
            )
            .unwrap();
            p.nodes.last_mut().unwrap().stream = ps;
            p.add_node(
                format!("wait{e}"),
                Op::WaitEvent { event: e },
                vec![],
                vec![],
            )
            .unwrap();
            p.nodes.last_mut().unwrap().stream = s;
        }
    };
    for i in 0..n {
        let k = rnd(3);
        let live: Vec<ValueId> = pool[k]
            .iter()
            .copied()
            .filter(|v| !freed.contains(v))
            .collect();
        let pick = |r: usize| live[r % live.len()];
        let choice = rnd(10);
        let (op, ins, stream, out_k) = if choice < 2 && k < 2 {
            (
                Op::AllGather {
                    group: Group::new(["gpu"]),
                    axis: 0,
                },
                vec![pick(rnd(live.len()))],
                StreamKind::AllGather,
                k + 1,
            )
        } else if choice < 4 && k > 0 {
            (
                Op::ReduceScatter {
                    group: Group::new(["gpu"]),
                    axis: 0,
                    reduce: ReduceOp::Sum,
                },
                vec![pick(rnd(live.len()))],
                StreamKind::ReduceScatter,
                k - 1,
            )
        } else if choice < 7 {
            (
                Op::Binary(BinaryOp::Add),
                vec![pick(rnd(live.len())), pick(rnd(live.len()))],
                StreamKind::Compute,
                k,
            )
        } else {
            (
                Op::Unary(UnaryOp::Relu),
                vec![pick(rnd(live.len()))],
                StreamKind::Compute,
                k,
            )
        };
        for &v in &ins {
            order(&mut p, v, stream, &mut event);
        }
        // collectives on one group are ordered across streams (one communicator per group)
        if op.is_collective() {
            for (t, last) in last_collective.iter().enumerate() {
                if let Some(c) = *last {
                    if t != stream as usize {
                        order(&mut p, c, stream, &mut event);
                    }
                }
            }
        }
        let is_collective = op.is_collective();
        let out = p
            .add_node(format!("n{i}"), op, ins, vec![format!("v{i}")])
            .unwrap()[0];
        p.nodes.last_mut().unwrap().stream = stream;
        if is_collective {
            last_collective[stream as usize] = Some(out);
        }
        pool[out_k].push(out);
        // now and then free a node value that no later node will read
        if rnd(4) == 0 {
            let cands: Vec<ValueId> = pool[k]
                .iter()
                .copied()
                .filter(|&v| p.producer(v).is_some() && !freed.contains(&v) && v != out)
                .collect();
            if let Some(&v) = cands.first() {
                // every reader must happen before the free
                for r in p.users()[v.index()].clone() {
                    if let Some(&o) = p.nodes[r.index()].outputs.first() {
                        order(&mut p, o, StreamKind::Compute, &mut event);
                    }
                }
                order(&mut p, v, StreamKind::Compute, &mut event);
                p.add_node(format!("free{i}"), Op::Free, vec![v], vec![])
                    .unwrap();
                freed.push(v);
            }
        }
    }
    p.outputs = pool
        .iter()
        .filter_map(|l| l.iter().rev().find(|v| !freed.contains(v)).copied())
        .collect();
    verify(&p).unwrap();
    p
}

#[test]
fn generated_programs_plan_into_verified_plans() {
    let mut worst: f64 = 1.0;
    for seed in 0..40 {
        let p = generated(seed, 60);
        let m = plan_mem(&p);
        check_report(&m);
        assert_eq!(m, plan_mem(&p), "deterministic");
        let plan = plan_of(p.clone());
        verify_plan(&plan, Some(m.arena_bytes))
            .unwrap_or_else(|v| panic!("seed {seed}: {v:#?}\n{}", plan.to_text()));
        worst = worst.max(m.arena_bytes as f64 / m.peak_bytes as f64);
    }
    // first fit by size is close to the issue-order peak on these programs (the rest is
    // alignment and cross-stream lifetimes, which issue order does not see)
    assert!(worst < 1.6, "arena / peak up to {worst:.2}");
}

#[test]
fn kinds_and_persistence_come_from_the_caller() {
    let p = parse(CHAIN);
    let none = |_: ValueId| false;
    let kinds = |_: ValueId| BufferKind::Grad;
    let m = plan_memory(&p, &kinds, &none);
    check_report(&m);
    assert!(m.buffers.iter().all(|b| b.kind == BufferKind::Grad));
    assert_eq!(
        m.peak_by_kind.keys().copied().collect::<Vec<_>>(),
        [BufferKind::Grad]
    );
    // x is no longer pinned: b may take its bytes once a (its only reader) ran
    assert_eq!(offset(&m, &p, "x"), offset(&m, &p, "b"));
    let all = |_: ValueId| true;
    let m = plan_memory(&p, &kinds, &all);
    assert_eq!(m.arena_bytes, 6 * 1024);
    assert_eq!(m.peak_bytes, 6 * 1024);
}

#[test]
fn the_generator_exercises_events_frees_and_all_streams() {
    let (mut waits, mut frees, mut streams) = (0, 0, std::collections::BTreeSet::new());
    for seed in 0..40 {
        let p = generated(seed, 60);
        for n in &p.nodes {
            waits += matches!(n.op, Op::WaitEvent { .. }) as usize;
            frees += matches!(n.op, Op::Free) as usize;
            streams.insert(n.stream);
        }
    }
    assert!(waits > 100 && frees > 100, "{waits} waits, {frees} frees");
    assert_eq!(streams.len(), 3);
}
