//! The discrete-event simulator: replays one rank's step of a plan on a modeled cluster.
//!
//! A plan is SPMD: every rank runs the same program on the same shapes, and the cost model is
//! symmetric, so one representative rank's timeline is every rank's. Collectives are assumed to
//! start on all members of a group at once (they do, since every rank reaches them at the same
//! simulated time).
//!
//! # Execution model
//!
//! - Three streams (compute, all-gather, reduce-scatter) run their nodes in program (issue)
//!   order, one at a time; the streams run concurrently.
//! - A node starts when its stream is free, every value it reads has been produced (events
//!   order these across streams in a verified plan; the simulator checks data readiness too),
//!   and, for `WaitEvent{e}`, when `RecordEvent{e}` has completed. A wait is drawn from the
//!   moment its stream reaches it to its release, so blocked time is visible.
//! - `RecordEvent` completes when every earlier node of its stream has (it takes no time).
//! - Compute nodes take their roofline time ([`crate::cost::roofline`]) in the dtype of their
//!   first operand (so a bf16 matmul runs at the bf16 peak); views, frees and events take 0.
//!   A product over a mixture of experts' buffers is charged its filled rows' share of the
//!   FLOPs, assuming balanced routing ([`crate::cost::moe::filled_fractions`]).
//! - Collectives take the alpha-beta time of the cost model ([`crate::cost::collective_time`])
//!   with the fastest algorithm for their size and group (as the planner assumes), or the one
//!   given in [`SimOptions::algorithm`]. A collective is a sequence of phases (one per mesh axis
//!   for hierarchical algorithms); each phase is a latency segment followed by a transfer whose
//!   bandwidth term on each link class is the cost model's.
//!
//! # Bandwidth sharing
//!
//! Concurrent transfers on one link class share it fairly: with `k` transfers active on link
//! class `l`, each progresses on `l` at `1/k` of its full rate. A transfer that uses several link
//! classes (a flat ring across nodes) progresses at the pace of its slowest share:
//! `d(fraction done)/dt = min over its links of 1 / (k_l * w_l)`, where `w_l` is its bandwidth
//! term on `l` alone. With one transfer per link class this is the cost model's
//! `latency + max_l w_l`; with `k` everywhere it is [`crate::cost::CollectiveCost::time_with_sharing`].
//! Rates are re-evaluated whenever a transfer starts or ends (a fluid model). Latency
//! segments do not use bandwidth. Compute does not contend with communication for memory
//! bandwidth (not modeled).
//!
//! # Outputs
//!
//! Step time (the last node's end), per-stream busy time, compute-stream time blocked on
//! communication (waits) and after its last node (tail), exposed communication (step time
//! minus compute busy time: the compute stream only ever waits for communication), per link
//! class bytes per rank and busy time, MFU, tokens per second, the critical path, every
//! node's start and end, and the memory timeline.
//!
//! # Memory timeline
//!
//! Every buffer of the plan is allocated when its producer starts and freed when the last of
//! its readers (in simulated time; readers after a `Free` do not count) ends; parameters,
//! states and inputs live for the whole step; program outputs and update values from their
//! producer to the end, except update values the plan stores over their target (same offset)
//! and reshapes stored in their input's bytes, which take no bytes of their own (a reshape's
//! readers keep its input's buffer alive instead). The memory planner ([`crate::plan::memory::plan_memory`])
//! measures the same lifetimes in issue order (one node at a time): [`SimOptions::serialize`]
//! runs the plan that way, and its peak equals the planner's `peak_bytes` exactly (tested). Run concurrently, the
//! streams overlap lifetimes that issue order keeps apart, so the concurrent peak may exceed
//! the issue-order peak; it never exceeds the arena, whose placement keeps apart every two
//! buffers that may be live together under any timing (tested).

pub mod svg;

use crate::cost::cluster::ClusterSpec;
use crate::cost::{self, Algorithm, CollectiveKind, CostError, CostModel};
use crate::plan::memory::{self, HappensBefore};
use hzp_ir::trace::{tid_of_stream, Trace, TraceEvent};
use hzp_ir::{BufferKind, DType, Op, Plan, Program, StreamKind, TensorType, ValueDef, ValueId};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// Knobs of a simulation.
#[derive(Clone, Debug, Default)]
pub struct SimOptions {
    /// The algorithm of every collective; `None`: the fastest one for each (as the planner).
    pub algorithm: Option<Algorithm>,
    /// Run every node one at a time in issue order (no overlap at all): the baseline the
    /// memory planner's timeline assumes.
    pub serialize: bool,
    /// Turn off bandwidth sharing between concurrent transfers.
    pub no_sharing: bool,
    /// Measured seconds per node name (calibration); these replace the cost model's times.
    pub measured: Option<HashMap<String, f64>>,
}

/// Why a plan cannot be simulated.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SimError {
    #[error("the cluster spec does not fit the plan's mesh: {0}")]
    Cluster(String),
    #[error("node `{node}`: {source}")]
    Cost {
        node: String,
        source: Box<CostError>,
    },
    #[error(
        "the plan deadlocks at {time_us:.3} us: {}",
        .blocked.join("; ")
    )]
    Deadlock { time_us: f64, blocked: Vec<String> },
}

/// What a node is, for statistics, traces and pictures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpClass {
    /// A compute node that does work.
    Compute,
    /// A node that takes no time (views, frees, records).
    Free,
    /// A collective.
    Collective,
    /// A `WaitEvent` (its span is the time its stream was blocked).
    Wait,
}

/// One node's simulated run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OpTiming {
    /// Index of the node in the program.
    pub node: usize,
    pub stream: StreamKind,
    pub class: OpClass,
    /// Seconds from the start of the step.
    pub start: f64,
    pub end: f64,
    /// The time the node takes alone (no sharing, no waiting); for a wait, 0.
    pub isolated_s: f64,
    /// Payload bytes of a collective (its larger side), 0 otherwise.
    pub bytes: u64,
    pub flops: f64,
}

/// One link class over the step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinkUsage {
    pub name: String,
    /// Whether the link leaves a node (it carries a mesh axis outside the node-local ones).
    pub cross_node: bool,
    /// Bytes one rank sends over this link class per step.
    pub bytes_per_rank: f64,
    /// Seconds in which at least one collective phase on this link class was under way
    /// (its latency or its transfer).
    pub busy_s: f64,
}

/// The memory of one rank over the step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryTimeline {
    /// `(seconds, live bytes per kind in [`BufferKind::ALL`] order)`, one point after each
    /// group of allocations and frees at one instant, in time order.
    pub points: Vec<(f64, [u64; 7])>,
    pub peak_bytes: u64,
    /// When the peak was first reached.
    pub peak_time_s: f64,
    /// Bytes of each kind live at the peak (kinds with none left out).
    pub peak_by_kind: BTreeMap<String, u64>,
    /// The memory planner's peak (issue order) for the same plan.
    pub planned_peak_bytes: u64,
    /// The plan's arena size.
    pub arena_bytes: u64,
}

impl MemoryTimeline {
    /// Total live bytes of a point.
    pub fn total(p: &[u64; 7]) -> u64 {
        p.iter().sum()
    }
}

/// The result of [`simulate`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Simulation {
    pub model: String,
    pub strategy: String,
    pub cluster: String,
    pub mesh: String,
    pub world_size: usize,
    pub serialized: bool,
    pub step_s: f64,
    /// Busy seconds per stream (compute, all-gather, reduce-scatter), waits excluded.
    pub stream_busy_s: [f64; 3],
    /// Longest dependency chain with every node's isolated time (a lower bound of the step).
    pub critical_path_s: f64,
    /// `step_s - stream_busy_s[0]`: the time the compute stream is not computing.
    pub exposed_comm_s: f64,
    /// Compute-stream time blocked in waits on communication.
    pub compute_wait_s: f64,
    /// Time from the compute stream's last node to the end of the step.
    pub tail_s: f64,
    pub links: Vec<LinkUsage>,
    /// FLOPs of the step's compute nodes, recomputation excluded (per rank).
    pub model_flops: f64,
    /// FLOPs of every compute node (per rank).
    pub hardware_flops: f64,
    /// Peak FLOP/s MFU is measured against: the device's matmul peak in the dtype most matmul
    /// FLOPs use.
    pub peak_flops: f64,
    pub mfu: f64,
    /// Tokens one rank processes per step, and what they were counted from.
    pub tokens_per_rank: u64,
    pub token_source: String,
    pub tokens_per_s: f64,
    pub memory: MemoryTimeline,
    pub ops: Vec<OpTiming>,
}

impl Simulation {
    /// `exposed_comm_s / step_s` (0 for an empty step).
    pub fn exposed_comm_fraction(&self) -> f64 {
        if self.step_s > 0.0 {
            self.exposed_comm_s / self.step_s
        } else {
            0.0
        }
    }

    /// Bytes one rank sends per step over link classes that leave the node.
    pub fn cross_node_bytes(&self) -> f64 {
        self.links
            .iter()
            .filter(|l| l.cross_node)
            .map(|l| l.bytes_per_rank)
            .sum()
    }

    /// The Chrome trace of `ranks` ranks (the plan is SPMD: every rank has the same timeline;
    /// `pid` = rank). Nodes that take no time are left out; waits that block are kept (`cat`
    /// "wait"). `args` hold `node`, `op`, `bytes` (collectives' payload) and `flops`.
    pub fn to_trace(&self, plan: &Plan, ranks: usize) -> Trace {
        let mut t = Trace::new();
        t.set_other("source", "hzp simulate");
        t.set_other("model", self.model.as_str());
        t.set_other("strategy", self.strategy.as_str());
        t.set_other("cluster", self.cluster.as_str());
        t.set_other("mesh", self.mesh.as_str());
        t.set_other("plan_hash", plan.content_hash.as_str());
        t.set_other("step_us", self.step_s * 1e6);
        t.set_other("serialized", self.serialized);
        let ranks = ranks.clamp(1, self.world_size.max(1));
        for r in 0..ranks as u32 {
            t.add_rank_metadata(r);
            for o in &self.ops {
                if o.end <= o.start {
                    continue;
                }
                let node = &plan.program.nodes[o.node];
                let cat = match o.class {
                    OpClass::Compute | OpClass::Free => "compute",
                    OpClass::Collective => "collective",
                    OpClass::Wait => "wait",
                };
                let mut e = TraceEvent::complete(
                    r,
                    tid_of_stream(o.stream),
                    &node.name,
                    cat,
                    o.start * 1e6,
                    (o.end - o.start) * 1e6,
                    &node.name,
                    node.op.name(),
                    o.bytes,
                );
                if o.flops > 0.0 {
                    e.args
                        .insert("flops".into(), serde_json::Value::from(o.flops));
                }
                t.push(e);
            }
        }
        t
    }
}

// ---------------------------------------------------------------------------------------------
// Costs of nodes

struct Phase {
    latency_s: f64,
    /// (link index, seconds at full bandwidth)
    work: Vec<(usize, f64)>,
}

struct NodeCost {
    class: OpClass,
    isolated_s: f64,
    /// For collectives costed by the model: their phases. Empty: a fixed duration.
    phases: Vec<Phase>,
    bytes: u64,
    flops: f64,
    /// (link index, bytes sent per rank)
    sent: Vec<(usize, f64)>,
}

fn types<'a>(p: &'a Program, vs: &[ValueId]) -> Vec<&'a TensorType> {
    vs.iter().map(|&v| p.ty(v)).collect()
}

fn node_costs(
    p: &Program,
    model: &CostModel,
    link_index: &HashMap<&str, usize>,
    opts: &SimOptions,
) -> Result<Vec<NodeCost>, SimError> {
    let mut out = Vec::with_capacity(p.nodes.len());
    // transposed operands are their input's bytes read by the products: nothing runs
    let transposed = hzp_ir::views::transposed_operands(p);
    // products over expert buffers do only their filled rows' FLOPs (balanced routing)
    let filled = crate::cost::moe::filled_fractions(p);
    for (i, n) in p.nodes.iter().enumerate() {
        let ins = types(p, &n.inputs);
        let outs = types(p, &n.outputs);
        let measured = opts.measured.as_ref().and_then(|m| m.get(&n.name)).copied();
        let c = match &n.op {
            Op::WaitEvent { .. } => NodeCost {
                class: OpClass::Wait,
                isolated_s: 0.0,
                phases: vec![],
                bytes: 0,
                flops: 0.0,
                sent: vec![],
            },
            op if op.is_collective() => {
                let kind = CollectiveKind::of(op).expect("a collective");
                let group = op.group().expect("a collective has a group");
                let full = kind.full_bytes(&ins, &outs);
                let cc = match opts.algorithm {
                    Some(a) if a.supports(kind) => model.collective_time(kind, full, group, a),
                    _ => model.best_collective(kind, full, group),
                }
                .map_err(|source| SimError::Cost {
                    node: n.name.clone(),
                    source: Box::new(source),
                })?;
                let bytes = ins
                    .iter()
                    .chain(&outs)
                    .map(|t| t.size_bytes() as u64)
                    .max()
                    .unwrap_or(0);
                let sent = cc
                    .bytes_sent_per_rank_per_link
                    .iter()
                    .filter_map(|(l, b)| link_index.get(l.as_str()).map(|&i| (i, *b)))
                    .collect();
                let phases = if measured.is_some() {
                    vec![]
                } else {
                    cc.phases
                        .iter()
                        .map(|ph| Phase {
                            latency_s: ph.latency_s,
                            work: ph
                                .link_times
                                .iter()
                                .filter_map(|(l, t)| link_index.get(l.as_str()).map(|&i| (i, *t)))
                                .collect(),
                        })
                        .collect()
                };
                NodeCost {
                    class: OpClass::Collective,
                    isolated_s: measured.unwrap_or(cc.seconds),
                    phases,
                    bytes,
                    flops: 0.0,
                    sent,
                }
            }
            op => {
                let dtype = ins.first().map_or(DType::F32, |t| t.dtype);
                let r = model
                    .roofline(op, &ins, &outs, dtype)
                    .with_flop_fraction(filled[i]);
                let s = match op {
                    Op::RecordEvent { .. } => 0.0,
                    _ if transposed[i] => 0.0,
                    _ => measured.unwrap_or(r.seconds),
                };
                NodeCost {
                    class: if s > 0.0 {
                        OpClass::Compute
                    } else {
                        OpClass::Free
                    },
                    isolated_s: s,
                    phases: vec![],
                    bytes: 0,
                    flops: r.flops,
                    sent: vec![],
                }
            }
        };
        out.push(c);
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// The event loop

/// What a stream is doing.
enum Active {
    /// A node with a fixed end time.
    Fixed { node: usize, end: f64 },
    /// A collective in phase `phase`: in its latency segment until `latency_end`, then
    /// transferring with `remaining` (fraction of the phase's transfer) left.
    Coll {
        node: usize,
        phase: usize,
        latency_end: Option<f64>,
        remaining: f64,
    },
}

struct StreamState {
    nodes: Vec<usize>,
    next: usize,
    /// When the stream finished its previous node (it reached `nodes[next]`).
    free_at: f64,
    active: Option<Active>,
}

/// Relative tolerance when comparing simulated times.
const EPS: f64 = 1e-12;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= EPS * a.abs().max(b.abs()).max(1e-9)
}

/// The transfer rate (fraction of the phase per second) of a phase given the transfers per
/// link class.
fn rate(phase: &Phase, load: &[usize], sharing: bool) -> f64 {
    let mut r = f64::INFINITY;
    for &(l, w) in &phase.work {
        if w > 0.0 {
            let k = if sharing { load[l].max(1) } else { 1 } as f64;
            r = r.min(1.0 / (k * w));
        }
    }
    r
}

struct Run {
    start: Vec<f64>,
    end: Vec<f64>,
    link_busy: Vec<f64>,
}

/// Replays the streams of `p` with node costs `costs` until every stream is done (see the
/// module docs' execution model); `sharing`: concurrent transfers on one link class share
/// its bandwidth.
fn run_concurrent(
    p: &Program,
    costs: &[NodeCost],
    nlinks: usize,
    sharing: bool,
) -> Result<Run, SimError> {
    let n = p.nodes.len();
    let mut sim = Replay {
        p,
        costs,
        sharing,
        streams: hzp_ir::StreamKind::ALL
            .iter()
            .map(|&s| StreamState {
                nodes: (0..n).filter(|&i| p.nodes[i].stream == s).collect(),
                next: 0,
                free_at: 0.0,
                active: None,
            })
            .collect(),
        recorded: HashMap::new(),
        done: vec![false; n],
        start: vec![f64::NAN; n],
        end: vec![f64::NAN; n],
        link_busy: vec![0.0; nlinks],
        now: 0.0,
    };
    loop {
        sim.start_ready();
        if sim
            .streams
            .iter()
            .all(|s| s.active.is_none() && s.next >= s.nodes.len())
        {
            break;
        }
        let load = sim.link_loads(nlinks);
        let t_next = sim.next_change(&load);
        if !t_next.is_finite() {
            return Err(sim.deadlock());
        }
        sim.charge_links(t_next - sim.now);
        sim.advance(t_next, &load);
        sim.now = t_next;
    }
    Ok(Run {
        start: sim.start,
        end: sim.end,
        link_busy: sim.link_busy,
    })
}

/// The state of [`run_concurrent`]'s replay.
struct Replay<'a> {
    p: &'a Program,
    costs: &'a [NodeCost],
    sharing: bool,
    streams: Vec<StreamState>,
    /// Event -> when it was recorded.
    recorded: HashMap<u32, f64>,
    done: Vec<bool>,
    start: Vec<f64>,
    end: Vec<f64>,
    link_busy: Vec<f64>,
    now: f64,
}

impl Replay<'_> {
    /// Whether node i can start: its inputs are done and, for a wait, its event recorded.
    fn ready(&self, i: usize) -> bool {
        let node = &self.p.nodes[i];
        if let Op::WaitEvent { event } = node.op {
            if !self.recorded.contains_key(&event) {
                return false;
            }
        }
        node.inputs
            .iter()
            .all(|&v| self.p.producer(v).is_none_or(|src| self.done[src.index()]))
    }

    /// Starts (and finishes, for nodes that take no time) whatever can run now.
    fn start_ready(&mut self) {
        let now = self.now;
        let mut progress = true;
        while progress {
            progress = false;
            for k in 0..self.streams.len() {
                let st = &self.streams[k];
                if st.active.is_some() || st.next >= st.nodes.len() {
                    continue;
                }
                let i = st.nodes[st.next];
                if !self.ready(i) {
                    continue;
                }
                let c = &self.costs[i];
                self.start[i] = if c.class == OpClass::Wait {
                    st.free_at
                } else {
                    now
                };
                progress = true;
                let zero = c.class == OpClass::Wait
                    || (c.phases.is_empty() && c.isolated_s <= 0.0)
                    || (!c.phases.is_empty()
                        && c.phases
                            .iter()
                            .all(|ph| ph.latency_s <= 0.0 && ph.work.iter().all(|w| w.1 <= 0.0)));
                let st = &mut self.streams[k];
                if zero {
                    self.end[i] = now;
                    self.done[i] = true;
                    if let Op::RecordEvent { event } = self.p.nodes[i].op {
                        self.recorded.entry(event).or_insert(now);
                    }
                    st.next += 1;
                    st.free_at = now;
                } else if c.phases.is_empty() {
                    st.active = Some(Active::Fixed {
                        node: i,
                        end: now + c.isolated_s,
                    });
                } else {
                    st.active = Some(Active::Coll {
                        node: i,
                        phase: 0,
                        latency_end: Some(now + c.phases[0].latency_s),
                        remaining: 1.0,
                    });
                }
            }
        }
    }

    /// Per link class, how many active transfers use it.
    fn link_loads(&self, nlinks: usize) -> Vec<usize> {
        let mut load = vec![0usize; nlinks];
        for st in &self.streams {
            if let Some(Active::Coll {
                node,
                phase,
                latency_end: None,
                ..
            }) = &st.active
            {
                for &(l, w) in &self.costs[*node].phases[*phase].work {
                    if w > 0.0 {
                        load[l] += 1;
                    }
                }
            }
        }
        load
    }

    /// The next instant something changes (infinite when nothing is active).
    fn next_change(&self, load: &[usize]) -> f64 {
        let mut t_next = f64::INFINITY;
        for st in &self.streams {
            match &st.active {
                Some(Active::Fixed { end, .. }) => t_next = t_next.min(*end),
                Some(Active::Coll {
                    latency_end: Some(t),
                    ..
                }) => t_next = t_next.min(*t),
                Some(Active::Coll {
                    node,
                    phase,
                    latency_end: None,
                    remaining,
                }) => {
                    let r = rate(&self.costs[*node].phases[*phase], load, self.sharing);
                    t_next = t_next.min(self.now + remaining / r);
                }
                None => {}
            }
        }
        t_next
    }

    /// The error when no stream can go on: what each blocked stream waits for.
    fn deadlock(&self) -> SimError {
        let blocked = self
            .streams
            .iter()
            .zip(hzp_ir::StreamKind::ALL)
            .filter(|(s, _)| s.next < s.nodes.len())
            .map(|(s, k)| {
                let node = &self.p.nodes[s.nodes[s.next]];
                let why = match node.op {
                    Op::WaitEvent { event } => format!("waits for event {event}"),
                    _ => "waits for an input no stream will produce".to_string(),
                };
                format!("stream {} at `{}` {why}", k.name(), node.name)
            })
            .collect();
        SimError::Deadlock {
            time_us: self.now * 1e6,
            blocked,
        }
    }

    /// A link class is busy while a collective phase on it is in its latency or transfer.
    fn charge_links(&mut self, dt: f64) {
        let mut occupied = vec![false; self.link_busy.len()];
        for st in &self.streams {
            if let Some(Active::Coll { node, phase, .. }) = &st.active {
                for &(l, w) in &self.costs[*node].phases[*phase].work {
                    occupied[l] |= w > 0.0;
                }
            }
        }
        for (l, busy) in self.link_busy.iter_mut().enumerate() {
            if occupied[l] {
                *busy += dt;
            }
        }
    }

    /// Advances every stream to `t_next` and finishes what ends there.
    fn advance(&mut self, t_next: f64, load: &[usize]) {
        let (now, dt, costs, sharing) = (self.now, t_next - self.now, self.costs, self.sharing);
        for st in self.streams.iter_mut() {
            let finished = match st.active.as_mut() {
                None => None,
                Some(Active::Fixed { node, end }) => {
                    (*end <= t_next || close(*end, t_next)).then_some(*node)
                }
                Some(Active::Coll {
                    node,
                    phase,
                    latency_end,
                    remaining,
                }) => {
                    let c = &costs[*node];
                    let mut fin = false;
                    match *latency_end {
                        Some(t) => {
                            if t <= t_next || close(t, t_next) {
                                *latency_end = None;
                                *remaining = 1.0;
                                // A phase without transfer work ends with its latency.
                                if rate(&c.phases[*phase], load, sharing).is_infinite() {
                                    *remaining = 0.0;
                                }
                            }
                        }
                        None => {
                            let r = rate(&c.phases[*phase], load, sharing);
                            let t_end = now + *remaining / r;
                            if t_end <= t_next || close(t_end, t_next) {
                                *remaining = 0.0;
                            } else {
                                *remaining -= dt * r;
                            }
                        }
                    }
                    if latency_end.is_none() && *remaining <= 0.0 {
                        *phase += 1;
                        if *phase >= c.phases.len() {
                            fin = true;
                        } else {
                            *latency_end = Some(t_next + c.phases[*phase].latency_s);
                            *remaining = 1.0;
                        }
                    }
                    fin.then_some(*node)
                }
            };
            if let Some(i) = finished {
                self.end[i] = t_next;
                self.done[i] = true;
                st.active = None;
                st.next += 1;
                st.free_at = t_next;
            }
        }
    }
}

/// One node at a time, in issue order, each at its isolated time.
fn run_serial(costs: &[NodeCost], nlinks: usize) -> Run {
    let mut t = 0.0;
    let mut start = Vec::with_capacity(costs.len());
    let mut end = Vec::with_capacity(costs.len());
    let mut link_busy = vec![0.0; nlinks];
    for c in costs {
        start.push(t);
        t += c.isolated_s;
        end.push(t);
        for ph in &c.phases {
            let bw = ph.work.iter().map(|w| w.1).fold(0.0, f64::max);
            for &(l, w) in &ph.work {
                if w > 0.0 {
                    link_busy[l] += ph.latency_s + bw;
                }
            }
        }
    }
    Run {
        start,
        end,
        link_busy,
    }
}

/// Longest chain of stream order, event and data edges, with isolated times.
fn critical_path(p: &Program, costs: &[NodeCost]) -> f64 {
    let n = p.nodes.len();
    let mut fin = vec![0.0f64; n];
    let mut last_on: [Option<usize>; 3] = [None; 3];
    let mut record: HashMap<u32, usize> = HashMap::new();
    let mut best = 0.0f64;
    for i in 0..n {
        let node = &p.nodes[i];
        let s = node.stream.index();
        let mut ready = last_on[s].map_or(0.0, |j| fin[j]);
        if let Op::WaitEvent { event } = node.op {
            if let Some(&r) = record.get(&event) {
                ready = ready.max(fin[r]);
            }
        }
        for &v in &node.inputs {
            if let Some(src) = p.producer(v) {
                ready = ready.max(fin[src.index()]);
            }
        }
        fin[i] = ready + costs[i].isolated_s;
        if let Op::RecordEvent { event } = node.op {
            record.entry(event).or_insert(i);
        }
        last_on[s] = Some(i);
        best = best.max(fin[i]);
    }
    best
}

// ---------------------------------------------------------------------------------------------
// Memory

fn kind_index(k: BufferKind) -> usize {
    BufferKind::ALL
        .iter()
        .position(|&x| x == k)
        .expect("ALL lists every kind")
}

fn memory_timeline(plan: &Plan, run: &Run, step: f64) -> MemoryTimeline {
    let p = &plan.program;
    let n = p.nodes.len();
    // Start order: (start time, issue index).
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| run.start[a].total_cmp(&run.start[b]).then(a.cmp(&b)));
    let mut seq = vec![0usize; n];
    for (k, &i) in order.iter().enumerate() {
        seq[i] = k;
    }
    let persistent = memory::default_persistent(p);
    let mut to_end = vec![false; p.values.len()];
    for &o in &p.outputs {
        to_end[o.index()] = true;
    }
    for u in &p.updates {
        to_end[u.value.index()] = true;
    }
    // Last reader in time of every value (readers after its first Free excluded).
    let mut last: Vec<Option<usize>> = vec![None; p.values.len()];
    let mut freed = vec![false; p.values.len()];
    for (i, node) in p.nodes.iter().enumerate() {
        for &v in &node.inputs {
            if freed[v.index()] {
                continue;
            }
            let later = |j: usize| (run.end[i], seq[i]) > (run.end[j], seq[j]);
            if last[v.index()].is_none_or(later) {
                last[v.index()] = Some(i);
            }
        }
        if matches!(node.op, Op::Free) {
            for &v in &node.inputs {
                freed[v.index()] = true;
            }
        }
    }
    // An update value the plan stores over its target (same offset) takes no bytes of its own.
    let offset: HashMap<ValueId, u64> = plan.buffers.iter().map(|b| (b.value, b.offset)).collect();
    let mut aliased = vec![false; p.values.len()];
    for u in &p.updates {
        if u.target != u.value
            && persistent(u.target)
            && offset.contains_key(&u.target)
            && offset.get(&u.target) == offset.get(&u.value)
        {
            aliased[u.value.index()] = true;
        }
    }
    // A reshape or identity the plan stores in its input's bytes (see
    // `memory::view_sources`) takes no bytes of its own: its uses extend its root's life.
    let views = memory::view_sources(p);
    for (i, r) in views.iter().enumerate() {
        let (m, r) = (ValueId(i as u32), *r);
        if r == m || !offset.contains_key(&m) || offset.get(&m) != offset.get(&r) {
            continue;
        }
        aliased[i] = true;
        to_end[r.index()] |= to_end[i];
        if let Some(l) = last[i] {
            let later = |j: usize| (run.end[l], seq[l]) > (run.end[j], seq[j]);
            if last[r.index()].is_none_or(later) {
                last[r.index()] = Some(l);
            }
        }
    }
    // Events: (time, seq, 0 = alloc | 1 = free, kind, bytes); persistent ones first.
    let mut base = [0u64; 7];
    let mut events: Vec<(f64, usize, u8, usize, u64)> = Vec::new();
    for b in &plan.buffers {
        let v = b.value;
        if aliased[v.index()] {
            continue;
        }
        let k = kind_index(b.kind);
        let def = match p.values[v.index()].def {
            ValueDef::Node { node, .. } if node.index() < n => Some(node.index()),
            _ => None,
        };
        if persistent(v) || (def.is_none() && to_end[v.index()]) {
            base[k] += b.bytes;
            continue;
        }
        let (ts, ss) = match def {
            Some(d) => (run.start[d], seq[d]),
            None => (0.0, 0),
        };
        if def.is_none() && last[v.index()].is_none() {
            continue; // never materialized during the step
        }
        events.push((ts, ss, 0, k, b.bytes));
        if to_end[v.index()] {
            continue;
        }
        let l = match (last[v.index()], def) {
            (Some(l), Some(d)) if (run.end[l], seq[l]) >= (run.end[d], seq[d]) => l,
            (Some(l), None) => l,
            (_, Some(d)) => d,
            (None, None) => unreachable!("skipped above"),
        };
        events.push((run.end[l], seq[l], 1, k, b.bytes));
    }
    let (points, peak, peak_at) = sweep(events, base, step);
    let peak_by_kind = BufferKind::ALL
        .iter()
        .zip(peak_at.1)
        .filter(|(_, b)| *b > 0)
        .map(|(k, b)| (k.name().to_string(), b))
        .collect();
    MemoryTimeline {
        points,
        peak_bytes: peak,
        peak_time_s: peak_at.0,
        peak_by_kind,
        planned_peak_bytes: 0,
        arena_bytes: plan.arena_bytes,
    }
}

/// Live bytes by kind over time from allocation and free events (time, issue sequence,
/// 0 = alloc | 1 = free, kind, bytes) on top of the persistent `base`: the points of the
/// timeline (one per instant, the last at `step`), the peak total and when it happens with
/// its bytes by kind.
#[allow(clippy::type_complexity)]
fn sweep(
    mut events: Vec<(f64, usize, u8, usize, u64)>,
    base: [u64; 7],
    step: f64,
) -> (Vec<(f64, [u64; 7])>, u64, (f64, [u64; 7])) {
    events.sort_by(|a, b| {
        a.0.total_cmp(&b.0)
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
            .then(a.3.cmp(&b.3))
    });
    let mut live = base;
    let mut points = vec![(0.0, live)];
    let mut peak = MemoryTimeline::total(&live);
    let mut peak_at = (0.0, live);
    let mut i = 0;
    while i < events.len() {
        let key = (events[i].0, events[i].1, events[i].2);
        while i < events.len() && (events[i].0, events[i].1, events[i].2) == key {
            let (_, _, what, k, b) = events[i];
            if what == 0 {
                live[k] += b;
            } else {
                live[k] = live[k].saturating_sub(b);
            }
            i += 1;
        }
        let total = MemoryTimeline::total(&live);
        if total > peak {
            peak = total;
            peak_at = (key.0, live);
        }
        match points.last_mut() {
            Some(last) if last.0 == key.0 => last.1 = live,
            _ => points.push((key.0, live)),
        }
    }
    if points.last().is_none_or(|l| l.0 < step) {
        points.push((step, live));
    }
    (points, peak, peak_at)
}

// ---------------------------------------------------------------------------------------------
// Tokens

/// Tokens one rank handles per step: the elements of the first integer input of rank >= 2
/// (token ids, batch x sequence, all micro-batches); without one, the leading dimension of the
/// first input (samples).
fn tokens(p: &Program) -> (u64, String) {
    for &i in &p.inputs {
        let t = p.ty(i);
        if matches!(t.dtype, DType::I64 | DType::I32) && t.rank() >= 2 {
            return (
                t.numel() as u64,
                format!("elements of input `{}` {}", p.value(i).name, t),
            );
        }
    }
    match p.inputs.first() {
        Some(&i) => {
            let t = p.ty(i);
            (
                t.shape.first().copied().unwrap_or(1) as u64,
                format!("samples: leading dim of input `{}` {}", p.value(i).name, t),
            )
        }
        None => (0, "the plan has no inputs".into()),
    }
}

// ---------------------------------------------------------------------------------------------

/// Simulates one step of `plan` on `spec` (its mesh must be the plan's; every mesh axis needs a
/// link class).
pub fn simulate(
    plan: &Plan,
    spec: &ClusterSpec,
    opts: &SimOptions,
) -> Result<Simulation, SimError> {
    let p = &plan.program;
    let model = CostModel::new(spec.clone(), plan.mesh.clone())
        .map_err(|e| SimError::Cluster(e.to_string()))?;
    let link_index: HashMap<&str, usize> = spec
        .links
        .iter()
        .enumerate()
        .map(|(i, l)| (l.name.as_str(), i))
        .collect();
    let costs = node_costs(p, &model, &link_index, opts)?;
    let run = if opts.serialize {
        run_serial(&costs, spec.links.len())
    } else {
        run_concurrent(p, &costs, spec.links.len(), !opts.no_sharing)?
    };
    let n = p.nodes.len();
    let step = (0..n).map(|i| run.end[i]).fold(0.0, f64::max);
    let mut busy = [0.0f64; 3];
    let mut compute_wait = 0.0;
    let mut compute_last_end = 0.0f64;
    let mut ops = Vec::with_capacity(n);
    for (i, c) in costs.iter().enumerate() {
        let node = &p.nodes[i];
        let s = node.stream.index();
        let d = run.end[i] - run.start[i];
        if c.class == OpClass::Wait {
            if s == 0 {
                compute_wait += d;
            }
        } else {
            busy[s] += d;
        }
        if s == 0 {
            compute_last_end = compute_last_end.max(run.end[i]);
        }
        ops.push(OpTiming {
            node: i,
            stream: node.stream,
            class: c.class,
            start: run.start[i],
            end: run.end[i],
            isolated_s: c.isolated_s,
            bytes: c.bytes,
            flops: c.flops,
        });
    }
    let links = link_usage(plan, spec, &link_index, &costs, &run);
    let (hardware, model_flops, peak_flops, mfu) = flop_rates(p, spec, &costs, step);
    let (tok, token_source) = tokens(p);
    let world = plan.mesh.world_size();
    let tokens_per_s = if step > 0.0 {
        tok as f64 * world as f64 / step
    } else {
        0.0
    };
    let mut memory = memory_timeline(plan, &run, step);
    // The planner's peak: the same lifetimes one node at a time in issue order.
    let issue_order = Run {
        start: (0..n).map(|i| i as f64).collect(),
        end: (0..n).map(|i| i as f64 + 0.5).collect(),
        link_busy: vec![],
    };
    memory.planned_peak_bytes = memory_timeline(plan, &issue_order, n as f64).peak_bytes;
    Ok(Simulation {
        model: plan.model.clone(),
        strategy: plan.strategy.clone(),
        cluster: spec.name.clone(),
        mesh: plan.mesh.to_string(),
        world_size: world,
        serialized: opts.serialize,
        step_s: step,
        stream_busy_s: busy,
        critical_path_s: critical_path(p, &costs),
        exposed_comm_s: (step - busy[0]).max(0.0),
        compute_wait_s: compute_wait,
        tail_s: (step - compute_last_end).max(0.0),
        links,
        model_flops,
        hardware_flops: hardware,
        peak_flops,
        mfu,
        tokens_per_rank: tok,
        token_source,
        tokens_per_s,
        memory,
        ops,
    })
}

/// Traffic and busy time per link class the step uses; cross-node: the link classes of mesh
/// axes outside the node-local group.
fn link_usage(
    plan: &Plan,
    spec: &ClusterSpec,
    link_index: &HashMap<&str, usize>,
    costs: &[NodeCost],
    run: &Run,
) -> Vec<LinkUsage> {
    let local = crate::cost::cluster::node_local_group(&plan.mesh, spec);
    let mut cross = vec![false; spec.links.len()];
    for ax in &plan.mesh.axes {
        if ax.size > 1 && !local.axes.contains(&ax.name) {
            if let Ok(l) = spec.link_for_axis(&ax.name) {
                cross[link_index[l.name.as_str()]] = true;
            }
        }
    }
    let mut sent = vec![0.0f64; spec.links.len()];
    for c in costs {
        for &(l, b) in &c.sent {
            sent[l] += b;
        }
    }
    spec.links
        .iter()
        .enumerate()
        .filter(|(i, _)| sent[*i] > 0.0 || run.link_busy[*i] > 0.0)
        .map(|(i, l)| LinkUsage {
            name: l.name.clone(),
            cross_node: cross[i],
            bytes_per_rank: sent[i],
            busy_s: run.link_busy[i],
        })
        .collect()
}

/// Hardware FLOPs of the compute stream, model FLOPs (without recompute), the peak they are
/// measured against (the matrix peak of the dtype most product FLOPs use) and the MFU.
fn flop_rates(
    p: &Program,
    spec: &ClusterSpec,
    costs: &[NodeCost],
    step: f64,
) -> (f64, f64, f64, f64) {
    let mut hardware = 0.0;
    let mut model_flops = 0.0;
    let mut matmul_by_dtype: BTreeMap<&'static str, (f64, DType)> = BTreeMap::new();
    for (i, c) in costs.iter().enumerate() {
        let node = &p.nodes[i];
        if node.stream != StreamKind::Compute || c.flops <= 0.0 {
            continue;
        }
        hardware += c.flops;
        if node.role.kind != hzp_ir::RoleKind::Recompute {
            model_flops += c.flops;
        }
        if matches!(
            node.op,
            Op::MatMul | Op::Attention { .. } | Op::AttentionGrad { .. }
        ) {
            let dt = node.inputs.first().map_or(DType::F32, |&v| p.ty(v).dtype);
            matmul_by_dtype.entry(dt.name()).or_insert((0.0, dt)).0 += c.flops;
        }
    }
    let dominant = matmul_by_dtype
        .values()
        .fold(None::<(f64, DType)>, |a, &(f, d)| match a {
            Some((fa, _)) if fa >= f => a,
            _ => Some((f, d)),
        })
        .map_or(DType::BF16, |x| x.1);
    let peak_flops = cost::matmul_peak(spec, dominant);
    let mfu = if step > 0.0 && peak_flops > 0.0 {
        model_flops / (step * peak_flops)
    } else {
        0.0
    };
    (hardware, model_flops, peak_flops, mfu)
}

/// The happens-before relation of the plan (re-exported for checks on simulated timings).
pub fn happens_before(plan: &Plan) -> HappensBefore {
    HappensBefore::new(&plan.program)
}

// ---------------------------------------------------------------------------------------------
// Calibration

/// Measured durations from a trace: per node name, the median over its complete events
/// (steps and ranks).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Measurements {
    /// Seconds per node name.
    pub per_node: BTreeMap<String, f64>,
    /// Median measured step, seconds, if the trace says (see [`measurements_from_trace`]).
    pub step_s: Option<f64>,
    /// Complete events read (with `args.node`).
    pub events: usize,
}

/// Reads the measured durations of a trace written by `hzp run --trace` (or `hzp simulate
/// --trace`): every `"X"` event with a string `args.node`; per node, the median duration.
/// The step: the median of `"X"` events with `"cat": "step"`, if any; otherwise, per rank,
/// the span of its events divided by `otherData.steps` (default 1), median over ranks.
/// Waits (`"cat": "wait"`) are left out: the simulator derives them.
pub fn measurements_from_trace(t: &Trace) -> Measurements {
    let mut per: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut steps: Vec<f64> = Vec::new();
    let mut span: BTreeMap<u32, (f64, f64)> = BTreeMap::new();
    let mut events = 0;
    for e in t.spans() {
        let dur = e.dur.unwrap_or(0.0) * 1e-6;
        if e.cat == "step" {
            steps.push(dur);
            continue;
        }
        let s = span.entry(e.pid).or_insert((f64::INFINITY, 0.0));
        s.0 = s.0.min(e.ts);
        s.1 = s.1.max(e.end());
        if e.cat == "wait" {
            continue;
        }
        if let Some(node) = e.node() {
            per.entry(node.to_string()).or_default().push(dur);
            events += 1;
        }
    }
    let step_s = if !steps.is_empty() {
        Some(median(&mut steps))
    } else if !span.is_empty() {
        let n = t
            .other_data
            .get("steps")
            .and_then(|v| v.as_f64())
            .filter(|&x| x >= 1.0)
            .unwrap_or(1.0);
        let mut v: Vec<f64> = span.values().map(|(a, b)| (b - a) * 1e-6 / n).collect();
        Some(median(&mut v))
    } else {
        None
    };
    Measurements {
        per_node: per
            .into_iter()
            .map(|(k, mut v)| (k, median(&mut v)))
            .collect(),
        step_s,
        events,
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Predicted (analytical, isolated) vs measured time of the nodes of one op kind.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KindError {
    pub op: String,
    pub nodes: usize,
    pub predicted_s: f64,
    pub measured_s: f64,
    /// `(predicted - measured) / measured`.
    pub relative_error: f64,
}

/// How far the analytical model is from a measured run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Calibration {
    /// Nodes of the plan that take time and were found in the trace, of those that take time.
    pub matched_nodes: usize,
    pub timed_nodes: usize,
    /// Node names of the trace that the plan does not have.
    pub unknown_nodes: usize,
    pub per_kind: Vec<KindError>,
    /// The analytical simulation's step and the calibrated one (measured node times).
    pub predicted_step_s: f64,
    pub calibrated_step_s: f64,
    /// The step the trace measured, if it tells.
    pub measured_step_s: Option<f64>,
    /// `(predicted_step - measured_step) / measured_step`, against the measured step when the
    /// trace has one, else against the calibrated simulation.
    pub step_relative_error: f64,
}

/// Compares the analytical simulation `predicted` of `plan` with measurements, and simulates
/// again with the measured node times (nodes missing from the trace keep analytical times).
pub fn calibrate(
    plan: &Plan,
    spec: &ClusterSpec,
    opts: &SimOptions,
    predicted: &Simulation,
    m: &Measurements,
) -> Result<(Calibration, Simulation), SimError> {
    let p = &plan.program;
    let mut kinds: BTreeMap<&'static str, (usize, f64, f64)> = BTreeMap::new();
    let mut matched = 0;
    let mut timed = 0;
    for o in &predicted.ops {
        let node = &p.nodes[o.node];
        if matches!(node.op, Op::WaitEvent { .. } | Op::RecordEvent { .. }) {
            continue;
        }
        let meas = m.per_node.get(&node.name);
        if o.isolated_s > 0.0 || meas.is_some_and(|&x| x > 0.0) {
            timed += 1;
        }
        if let Some(&x) = meas {
            matched += 1;
            let e = kinds.entry(node.op.name()).or_insert((0, 0.0, 0.0));
            e.0 += 1;
            e.1 += o.isolated_s;
            e.2 += x;
        }
    }
    let names: std::collections::HashSet<&str> = p.nodes.iter().map(|n| n.name.as_str()).collect();
    let unknown = m
        .per_node
        .keys()
        .filter(|k| !names.contains(k.as_str()))
        .count();
    let rel = |pred: f64, meas: f64| {
        if meas > 0.0 {
            (pred - meas) / meas
        } else if pred > 0.0 {
            f64::INFINITY
        } else {
            0.0
        }
    };
    let per_kind = kinds
        .into_iter()
        .map(|(op, (nodes, pr, me))| KindError {
            op: op.to_string(),
            nodes,
            predicted_s: pr,
            measured_s: me,
            relative_error: rel(pr, me),
        })
        .collect();
    let copts = SimOptions {
        measured: Some(m.per_node.clone().into_iter().collect()),
        ..opts.clone()
    };
    let calibrated = simulate(plan, spec, &copts)?;
    let reference = m.step_s.unwrap_or(calibrated.step_s);
    Ok((
        Calibration {
            matched_nodes: matched,
            timed_nodes: timed,
            unknown_nodes: unknown,
            per_kind,
            predicted_step_s: predicted.step_s,
            calibrated_step_s: calibrated.step_s,
            measured_step_s: m.step_s,
            step_relative_error: rel(predicted.step_s, reference),
        },
        calibrated,
    ))
}
