//! The discrete-event simulator: hand-computed timelines, bandwidth sharing, the invariants on
//! compiled plans (step >= busiest stream and critical path, no overlap on a stream, memory
//! peaks), traces that pass the Trace Event check, calibration, and well-formed SVG.

mod plan_common;

use hzp_ir::trace::{validate, Trace};
use hzp_ir::*;
use hzp_passes::cost::cluster::ClusterSpec;
use hzp_passes::cost::{collective_time, Algorithm, CollectiveKind};
use hzp_passes::dist::spmd::{shard_training_step, ShardGroups};
use hzp_passes::plan::memory::{default_kind, default_persistent, plan_memory};
use hzp_passes::simulate::{
    calibrate, measurements_from_trace, simulate, OpClass, SimOptions, Simulation,
};
use hzp_passes::train::TrainConfig;
use plan_common::{parse, plan_of, TWO_STREAMS};

/// Round numbers: 1 GB/s of memory bandwidth, 1 us launch overhead, 1 TFLOP/s; one link class
/// of 1 GB/s and 10 us latency on `gpu`, another on `node`.
const SPEC: &str = r#"
name = "toy"
mesh = "node=2,gpu=4"
devices_per_node = 4

[device]
memory = "1GiB"
peak_bf16 = "1TFLOPS"
peak_fp32 = "1TFLOPS"
memory_bandwidth = "1GB/s"
matmul_efficiency = 1.0
vector_efficiency = 1.0
memory_efficiency = 1.0
launch_overhead = "1us"

[[links]]
name = "fast"
axes = ["gpu"]
bandwidth = "1GB/s"
latency = "10us"

[[links]]
name = "slow"
axes = ["node"]
bandwidth = "0.1GB/s"
latency = "20us"
"#;

fn spec() -> ClusterSpec {
    ClusterSpec::from_toml_str(SPEC, "toy.toml").unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-12)
}

fn op<'a>(plan: &Plan, s: &'a Simulation, name: &str) -> &'a hzp_passes::simulate::OpTiming {
    s.ops
        .iter()
        .find(|o| plan.program.nodes[o.node].name == name)
        .unwrap_or_else(|| panic!("no node {name}"))
}

#[test]
fn two_streams_by_hand() {
    let plan = plan_of(parse(TWO_STREAMS));
    let s = simulate(&plan, &spec(), &SimOptions::default()).unwrap();
    // AllGather of f32[8,4] = 128 bytes over gpu=4 (ring): 3 (10 us + 32 B / 1 GB/s).
    let ag = 3.0 * (10e-6 + 32.0 / 1e9);
    // Mul reads 2 x 128 B and writes 128 B; Relu reads and writes 128 B; plus 1 us launch.
    let mul = 1e-6 + 384.0 / 1e9;
    let relu = 1e-6 + 256.0 / 1e9;
    assert!(close(op(&plan, &s, "ag0").end, ag));
    assert!(close(op(&plan, &s, "ag1").start, ag));
    assert!(close(op(&plan, &s, "ag1").end, 2.0 * ag));
    // the compute stream waits for each gather: the wait spans the blocked time
    let w0 = op(&plan, &s, "wait0");
    assert_eq!(w0.class, OpClass::Wait);
    assert!(close(w0.start, 0.0) && close(w0.end, ag));
    assert!(close(op(&plan, &s, "mul0").start, ag));
    assert!(close(op(&plan, &s, "wait1").start, ag + mul));
    assert!(close(op(&plan, &s, "mul1").start, 2.0 * ag));
    let step = 2.0 * ag + mul + relu;
    assert!(close(s.step_s, step), "{} vs {step}", s.step_s);
    assert!(close(s.critical_path_s, step));
    assert!(close(s.stream_busy_s[0], 2.0 * mul + relu));
    assert!(close(s.stream_busy_s[1], 2.0 * ag));
    assert!(close(s.exposed_comm_s, step - (2.0 * mul + relu)));
    assert!(close(s.compute_wait_s, 2.0 * ag - mul));
    assert_eq!(s.tail_s, 0.0);
    // 3 ring messages of 32 B per gather, all on the fast link
    assert_eq!(s.links.len(), 1);
    assert_eq!(s.links[0].name, "fast");
    assert!(close(s.links[0].bytes_per_rank, 2.0 * 3.0 * 32.0));
    assert!(!s.links[0].cross_node);
    assert!(close(s.links[0].busy_s, 2.0 * ag));
    // FLOPs: two muls and a relu over 32 elements, no matmul: MFU against the fp32 peak
    assert!(close(s.model_flops, 96.0));
    assert!(close(s.mfu, 96.0 / (step * 1e12)));
    // tokens: no integer input; 8 samples per rank x 4 ranks
    assert_eq!(s.tokens_per_rank, 8);
    assert!(close(s.tokens_per_s, 32.0 / step));
}

/// A transposed operand (a transpose only matrix products read) is its input's bytes: nothing
/// runs for it. A transpose read by anything else is charged as a copy.
#[test]
fn transposed_operands_take_no_time() {
    let src = r#"program "tv"
mesh gpu=4

input %x : f32[8,16]
input %w : f32[12,16]
%wt = Transpose{perm=[1,0]}(%w) : f32[16,12] "wt"
%y = MatMul(%x, %wt) : f32[8,12] "y"
%yt = Transpose{perm=[1,0]}(%y) : f32[12,8] "yt"
%z = Relu(%yt) : f32[12,8] "z"
output %z
"#;
    let plan = plan_of(parse(src));
    let s = simulate(&plan, &spec(), &SimOptions::default()).unwrap();
    let t = |n: &str| op(&plan, &s, n).end - op(&plan, &s, n).start;
    assert_eq!(t("wt"), 0.0);
    // 384 bytes read and written at 1 GB/s, plus the 1 us launch
    assert!(close(t("yt"), 1e-6 + 768.0 / 1e9), "{}", t("yt"));
}

/// An all-gather and a reduce-scatter start together on the same link class: they share its
/// bandwidth until the shorter ends, then the longer runs at full rate.
#[test]
fn concurrent_transfers_share_a_link() {
    let src = r#"program "share"
mesh gpu=4

param %w : f32[65536]
param %g : f32[1048576]
%ag = AllGather{group=[gpu], axis=0}(%w) "ag" @allgather
%rs = ReduceScatter{group=[gpu], axis=0, reduce=sum}(%g) "rs" @reducescatter
RecordEvent{event=1}() "rec_ag" @allgather
RecordEvent{event=2}() "rec_rs" @reducescatter
WaitEvent{event=1}() "wait_ag"
WaitEvent{event=2}() "wait_rs"
%a = Relu(%ag) "relu_ag"
%b = Relu(%rs) "relu_rs"

output %a
output %b
"#;
    let plan = plan_of(parse(src));
    let sp = spec();
    let mesh = Mesh::parse("gpu=4").unwrap();
    let gpu = Group::new(["gpu"]);
    let a = collective_time(
        CollectiveKind::AllGather,
        4.0 * 65536.0 * 4.0,
        &gpu,
        &mesh,
        &sp,
        Algorithm::Ring,
    )
    .unwrap();
    let b = collective_time(
        CollectiveKind::ReduceScatter,
        1048576.0 * 4.0,
        &gpu,
        &mesh,
        &sp,
        Algorithm::Ring,
    )
    .unwrap();
    let (la, wa) = (a.phases[0].latency_s, a.phases[0].link_times[0].1);
    let (lb, wb) = (b.phases[0].latency_s, b.phases[0].link_times[0].1);
    assert!(close(la, lb) && wa < wb);
    let s = simulate(&plan, &sp, &SimOptions::default()).unwrap();
    // both latencies end together; then both transfer at half rate until `ag` is done
    assert!(close(op(&plan, &s, "ag").end, la + 2.0 * wa));
    assert!(close(op(&plan, &s, "rs").end, lb + wa + wb));
    assert!(s.step_s > s.critical_path_s);
    assert!(close(s.links[0].busy_s, la + wa + wb));
    // the cost model's sharing formula for two transfers over the whole overlap
    assert!(close(a.time_with_sharing(|_| 2), la + 2.0 * wa));
    // without sharing each takes its isolated time and the step is the critical path
    let ns = SimOptions {
        no_sharing: true,
        ..SimOptions::default()
    };
    let s = simulate(&plan, &sp, &ns).unwrap();
    assert!(close(op(&plan, &s, "ag").end, a.seconds));
    assert!(close(op(&plan, &s, "rs").end, b.seconds));
    assert!(close(s.step_s, s.critical_path_s));
}

#[test]
fn a_wait_without_a_record_is_a_deadlock_naming_the_node() {
    let src = plan_common::edit(
        TWO_STREAMS,
        "RecordEvent{event=2}() \"rec1\" @allgather\n",
        "",
    );
    // the text form verifies, the plan verifier would refuse it; the simulator says why
    let p = parse(&src);
    let plan = plan_of(p);
    let e = simulate(&plan, &spec(), &SimOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("deadlocks"), "{e}");
    assert!(e.contains("`wait1` waits for event 2"), "{e}");
}

/// A real per-rank step: a tiny GPT sharded over `mesh` with groups `spec`.
fn gpt_plan(mesh: &str, groups: [&[&str]; 3]) -> Plan {
    preset_plan(
        "preset:gpt,layers=2,hidden=64,heads=4,vocab=128,seq=16,batch=2",
        mesh,
        groups,
    )
}

/// A real per-rank step of `preset` sharded over `mesh` with groups `spec`.
fn preset_plan(preset: &str, mesh: &str, groups: [&[&str]; 3]) -> Plan {
    let fwd = hzp_frontends::presets::parse_preset(preset).unwrap();
    let mesh = Mesh::parse(mesh).unwrap();
    let spec = ShardGroups {
        params: Group::new(groups[0].iter().copied()),
        grads: Group::new(groups[1].iter().copied()),
        optim: Group::new(groups[2].iter().copied()),
    };
    let step = shard_training_step(&fwd, &TrainConfig::default(), &mesh, &spec).unwrap();
    let p = step.program;
    let m = plan_memory(&p, &default_kind(&p), &default_persistent(&p));
    Plan::new(
        "tiny-gpt",
        "asynchzp",
        mesh,
        step.groups,
        p,
        m.arena_bytes,
        m.buffers,
    )
}

fn plans() -> Vec<Plan> {
    vec![
        gpt_plan("gpu=4", [&["gpu"], &["gpu"], &["gpu"]]),
        gpt_plan("node=2,gpu=2", [&["gpu"], &["gpu"], &["node", "gpu"]]),
        gpt_plan("node=2,gpu=2", [&["node", "gpu"]; 3]),
        gpt_plan("node=2,gpu=2", [&[], &[], &[]]),
    ]
}

fn check_invariants(plan: &Plan, s: &Simulation) {
    let p = &plan.program;
    let tol = 1e-9 * s.step_s.max(1e-12);
    // step >= the busiest stream and >= the critical path
    let busiest = s.stream_busy_s.iter().copied().fold(0.0, f64::max);
    assert!(s.step_s + tol >= busiest, "{} < {busiest}", s.step_s);
    assert!(s.step_s + tol >= s.critical_path_s);
    // no two nodes overlap on one stream; program order on each stream
    for stream in [
        StreamKind::Compute,
        StreamKind::AllGather,
        StreamKind::ReduceScatter,
    ] {
        let on: Vec<_> = s.ops.iter().filter(|o| o.stream == stream).collect();
        for w in on.windows(2) {
            assert!(
                w[0].end <= w[1].start + tol,
                "{} [{}, {}] overlaps {} [{}, {}]",
                p.nodes[w[0].node].name,
                w[0].start,
                w[0].end,
                p.nodes[w[1].node].name,
                w[1].start,
                w[1].end
            );
        }
    }
    // every node starts after its inputs exist and after the record it waits for
    let mut record_end = std::collections::HashMap::new();
    for o in &s.ops {
        let n = &p.nodes[o.node];
        assert!(o.end + tol >= o.start && o.start >= -tol);
        if o.class != OpClass::Wait {
            assert!(
                o.end - o.start + tol >= o.isolated_s,
                "{} ran faster",
                n.name
            );
        }
        for &v in &n.inputs {
            if let Some(src) = p.producer(v) {
                assert!(
                    s.ops[src.index()].end <= o.start + tol,
                    "{} too early",
                    n.name
                );
            }
        }
        if let Op::RecordEvent { event } = n.op {
            record_end.insert(event, o.end);
        }
        if let Op::WaitEvent { event } = n.op {
            assert!(record_end[&event] <= o.end + tol);
        }
    }
    // memory: the concurrent peak never exceeds the arena
    assert!(s.memory.peak_bytes <= s.memory.arena_bytes);
    assert!(s.exposed_comm_s + tol >= s.compute_wait_s + s.tail_s - tol);
}

/// The experts' products of a dropless routed MoE, data-parallel on 2 ranks (16 tokens a
/// rank, top 2 of 4 experts): each is charged the balanced share of its buffer's rows,
/// ceil(16 * 2 / 4) = 8 of 16, so half the FLOPs of the same product of the dense form
/// (every expert on all 16 tokens: the same shapes, counted by shape), forward and
/// backward; the step is shorter. With a capacity factor the capacity is charged.
#[test]
fn dropless_expert_products_take_their_filled_rows() {
    let sp = spec();
    let groups: [&[&str]; 3] = [&["gpu"]; 3];
    let sim = |preset: &str| {
        let plan = preset_plan(preset, "gpu=2", groups);
        let s = simulate(&plan, &sp, &SimOptions::default()).unwrap();
        check_invariants(&plan, &s);
        // flops of each expert product (a MatMul with a result batched over the experts)
        let mut flops: Vec<(String, f64)> = s
            .ops
            .iter()
            .filter_map(|o| {
                let n = &plan.program.nodes[o.node];
                let out = n.outputs.first().map(|&v| &plan.program.ty(v).shape[..]);
                (n.op == Op::MatMul && matches!(out, Some([4, _, _])))
                    .then(|| (n.name.clone(), o.flops))
            })
            .collect();
        flops.sort_by(|a, b| a.0.cmp(&b.0));
        (flops, s.step_s)
    };
    let (dense, dense_s) = sim("preset:moe-tiny,dense=true");
    let (dropless, dropless_s) = sim("preset:moe-tiny");
    let (capacity, _) = sim("preset:moe-tiny,capacity_factor=1.5");
    // gate_up and down of 2 layers: forward, input and weight gradients
    assert_eq!(dense.len(), 12, "{dense:?}");
    assert_eq!(dropless.len(), dense.len());
    for ((nd, fd), (nr, fr)) in dense.iter().zip(&dropless) {
        assert_eq!(nd, nr);
        assert!(
            *fd > 0.0 && close(*fr, fd / 2.0),
            "{nr}: {fr} vs dense {fd}"
        );
    }
    assert!(dropless_s < dense_s, "{dropless_s} vs dense {dense_s}");
    // C = ceil(1.5 * 16 * 2 / 4) = 12 rows of 16, all charged
    for ((nd, fd), (nc, fc)) in dense.iter().zip(&capacity) {
        assert_eq!(nd, nc);
        assert!(close(*fc, fd * 12.0 / 16.0), "{nc}: {fc} vs dense {fd}");
    }
}

#[test]
fn invariants_on_compiled_plans() {
    let sp = spec();
    for plan in plans() {
        let sim = simulate(&plan, &sp, &SimOptions::default()).unwrap();
        check_invariants(&plan, &sim);
        // without bandwidth sharing the event loop reproduces the critical path exactly
        let ns = SimOptions {
            no_sharing: true,
            ..SimOptions::default()
        };
        let s2 = simulate(&plan, &sp, &ns).unwrap();
        check_invariants(&plan, &s2);
        assert!(
            close(s2.step_s, s2.critical_path_s),
            "{}: {} vs {}",
            plan.mesh,
            s2.step_s,
            s2.critical_path_s
        );
        // serialized: no overlap at all, the sum of every node's time
        let ser = SimOptions {
            serialize: true,
            ..SimOptions::default()
        };
        let s3 = simulate(&plan, &sp, &ser).unwrap();
        let sum: f64 = s3.ops.iter().map(|o| o.isolated_s).sum();
        assert!(close(s3.step_s, sum));
        assert!(s3.step_s + 1e-12 >= sim.step_s);
        // deterministic
        let again = simulate(&plan, &sp, &SimOptions::default()).unwrap();
        assert_eq!(again, sim);
    }
}

#[test]
fn memory_peak_matches_the_memory_plan() {
    let sp = spec();
    let mut programs: Vec<Plan> = plans();
    programs.push(plan_of(parse(TWO_STREAMS)));
    for plan in programs {
        let p = &plan.program;
        let m = plan_memory(p, &default_kind(p), &default_persistent(p));
        let ser = SimOptions {
            serialize: true,
            ..SimOptions::default()
        };
        let s = simulate(&plan, &sp, &ser).unwrap();
        // one node at a time in issue order: exactly the planner's timeline and peak
        assert_eq!(s.memory.peak_bytes, m.peak_bytes, "{}", plan.mesh);
        assert_eq!(s.memory.planned_peak_bytes, m.peak_bytes);
        let by_kind: std::collections::BTreeMap<String, u64> = m
            .peak_by_kind
            .iter()
            .map(|(k, v)| (k.name().to_string(), *v))
            .collect();
        assert_eq!(s.memory.peak_by_kind, by_kind);
        // concurrently: reported against the same planned peak, bounded by the arena
        let c = simulate(&plan, &sp, &SimOptions::default()).unwrap();
        assert_eq!(c.memory.planned_peak_bytes, m.peak_bytes);
        assert!(c.memory.peak_bytes <= plan.arena_bytes);
        // the timeline starts with the persistent buffers and ends at the step's end
        let last = c.memory.points.last().unwrap();
        assert!(close(last.0, c.step_s));
        assert!(c.memory.points.windows(2).all(|w| w[0].0 <= w[1].0));
    }
}

#[test]
fn trace_of_a_4_rank_plan_is_valid() {
    let plan = gpt_plan("node=2,gpu=2", [&["gpu"], &["gpu"], &["node", "gpu"]]);
    let s = simulate(&plan, &spec(), &SimOptions::default()).unwrap();
    let t = s.to_trace(&plan, 4);
    let text = t.to_json();
    let summary = validate(&text, "sim.json").unwrap();
    assert_eq!(summary.pids, vec![0, 1, 2, 3]);
    assert_eq!(summary.metadata_events, 4 * 4);
    assert!((summary.end_us - s.step_s * 1e6).abs() < 1e-2);
    let back = Trace::from_json(&text, "sim.json").unwrap();
    let per_rank = back.spans().filter(|e| e.pid == 0).count();
    assert_eq!(per_rank * 4, summary.complete_events);
    // every span names its node and op; collectives carry their bytes
    assert!(back.spans().all(|e| e.node().is_some() && e.op().is_some()));
    assert!(back
        .spans()
        .any(|e| e.op() == Some("AllGather") && e.bytes().unwrap() > 0 && e.tid == 1));
    assert_eq!(text, s.to_trace(&plan, 4).to_json());
}

#[test]
fn calibration_with_a_measured_trace() {
    let plan = gpt_plan("gpu=4", [&["gpu"], &["gpu"], &["gpu"]]);
    let sp = spec();
    let opts = SimOptions {
        no_sharing: true,
        ..SimOptions::default()
    };
    let s = simulate(&plan, &sp, &opts).unwrap();
    // a "measured" run: every node twice as slow as predicted, on 2 ranks
    let mut t = s.to_trace(&plan, 2);
    for e in t.trace_events.iter_mut() {
        e.ts *= 2.0;
        if let Some(d) = e.dur.as_mut() {
            *d *= 2.0;
        }
    }
    let text = t.to_json();
    let m = measurements_from_trace(&Trace::from_json(&text, "run.json").unwrap());
    assert!(m.events > 0);
    let (c, cal) = calibrate(&plan, &sp, &opts, &s, &m).unwrap();
    assert!(
        close(cal.step_s, 2.0 * s.step_s),
        "{} vs {}",
        cal.step_s,
        s.step_s
    );
    assert!(!c.per_kind.is_empty());
    for k in &c.per_kind {
        assert!((k.relative_error + 0.5).abs() < 1e-6, "{k:?}");
    }
    assert_eq!(c.unknown_nodes, 0);
    assert_eq!(c.matched_nodes, c.timed_nodes);
    let measured = c.measured_step_s.unwrap();
    assert!((measured - 2.0 * s.step_s).abs() < 1e-6 * measured);
    assert!((c.step_relative_error + 0.5).abs() < 1e-6);
}

/// A minimal XML well-formedness check: balanced tags, quoted attributes, known entities.
fn check_xml(s: &str) {
    let body = s
        .strip_prefix("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n")
        .expect("XML declaration");
    let mut stack: Vec<String> = Vec::new();
    let mut rest = body;
    let mut roots = 0;
    while let Some(i) = rest.find('<') {
        check_text(&rest[..i]);
        let j = rest[i..].find('>').expect("unclosed tag") + i;
        let tag = &rest[i + 1..j];
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(stack.pop().as_deref(), Some(name), "mismatched </{name}>");
        } else {
            let self_closing = tag.ends_with('/');
            let inner = tag.trim_end_matches('/');
            let name: String = inner.chars().take_while(|c| !c.is_whitespace()).collect();
            assert!(
                !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'),
                "bad tag {tag}"
            );
            check_attrs(&inner[name.len()..]);
            if stack.is_empty() {
                roots += 1;
            }
            if !self_closing {
                stack.push(name);
            }
        }
        rest = &rest[j + 1..];
    }
    assert!(rest.trim().is_empty());
    assert!(stack.is_empty(), "unclosed {stack:?}");
    assert_eq!(roots, 1);
}

fn check_text(t: &str) {
    let mut r = t;
    while let Some(i) = r.find('&') {
        let j = r[i..].find(';').expect("entity") + i;
        assert!(
            ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"].contains(&&r[i..=j]),
            "bad entity {}",
            &r[i..=j]
        );
        r = &r[j + 1..];
    }
    assert!(!t.contains('>') && !t.contains('<'));
}

fn check_attrs(a: &str) {
    let mut r = a.trim();
    while !r.is_empty() {
        let eq = r.find('=').expect("attribute without value");
        let name = r[..eq].trim();
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == ':'),
            "bad attribute name {name}"
        );
        let v = &r[eq + 1..];
        assert!(v.starts_with('"'), "unquoted attribute {name}");
        let end = v[1..].find('"').expect("unterminated attribute") + 1;
        check_text(&v[1..end]);
        r = v[end + 1..].trim_start();
    }
}

#[test]
fn svg_pictures_are_well_formed_and_deterministic() {
    let plan = gpt_plan("node=2,gpu=2", [&["gpu"], &["gpu"], &["node", "gpu"]]);
    let s = simulate(&plan, &spec(), &SimOptions::default()).unwrap();
    let g = hzp_passes::simulate::svg::gantt(&plan, &s);
    check_xml(&g);
    assert!(g.contains(">compute</text>") && g.contains(">all-gather</text>"));
    assert!(g.contains("url(#waits)"), "waits are drawn");
    assert_eq!(g, hzp_passes::simulate::svg::gantt(&plan, &s));
    let m = hzp_passes::simulate::svg::memory_plot(&s);
    check_xml(&m);
    assert!(m.contains("arena") && m.contains("activation"));
    assert_eq!(m, hzp_passes::simulate::svg::memory_plot(&s));
    // names are escaped
    assert_eq!(
        hzp_passes::simulate::svg::escape("a<b & \"c\""),
        "a&lt;b &amp; &quot;c&quot;"
    );
    // the checker itself rejects broken XML
    assert!(std::panic::catch_unwind(|| check_xml(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg><g></svg>"
    ))
    .is_err());
}
