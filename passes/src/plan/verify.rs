//! The plan verifier: the invariants of DESIGN.md, checked on a finished [`Plan`].
//!
//! - the program passes [`hzp_ir::verify`], and its mesh is the plan's;
//! - every value used by a node is materialized on that node's stream before it runs: a value
//!   produced on another stream must be produced by a node that happens before the reader
//!   (through events; see [`HappensBefore`]); a `Free(%x)` comes after every reader of `%x`;
//! - every communicator sees the same collectives in the same order on every rank. The program
//!   is SPMD and has no control flow, so no collective is issued conditionally and each stream
//!   issues its collectives in one order on every rank. What can still go wrong: the groups
//!   name axes the mesh lacks, or two collectives over the same ranks are issued on different
//!   streams with nothing ordering them, so that ranks may match them in different orders
//!   (a hang). The latter is rejected;
//! - events: every wait has a record, no event is recorded twice, no wait is issued before its
//!   record (a deadlock: streams run their nodes in issue order);
//! - no buffer is overwritten while read: of two buffers whose bytes overlap, every use of one
//!   happens before the producer of the other; parameters, constants and states live for the
//!   whole step, program outputs and update values until its end;
//! - every value with a nonzero size has a buffer of at least its size inside the arena;
//! - the arena fits the budget, if one is given.
//!
//! Every violation is collected (not only the first) and names the nodes involved.

use crate::plan::memory::{lives, value_bytes, EventProblem, HappensBefore, Life, NUM_STREAMS};
use hzp_ir::{format_bytes, Buffer, Group, Mesh, NodeId, Op, Plan, Program, ValueDef, ValueId};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

/// Which invariant a violation breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Check {
    /// The program does not verify, or its mesh is not the plan's.
    Program,
    /// A shard group (P, G, O) names an axis the mesh lacks.
    Groups,
    /// A value is read on a stream it was not materialized on.
    Materialized,
    /// A `Free` that frees too early or frees what must stay.
    Free,
    /// Collectives that may hang.
    Collective,
    /// Waits without records, double records, waits before their records.
    Event,
    /// Buffers that are missing, too small, outside the arena, or overwritten while read.
    Buffer,
    /// The arena exceeds the budget.
    Budget,
}

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanViolation {
    pub check: Check,
    /// Names of the nodes involved (the program's node names), in the order the message
    /// mentions them.
    pub nodes: Vec<String>,
    pub message: String,
}

impl fmt::Display for PlanViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PlanViolation {}

/// Options of [`verify_plan_with`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyOptions {
    /// The arena may take at most this many bytes per rank.
    pub budget: Option<u64>,
    /// The runtime gives every stream communicators of its own, so collectives issued on
    /// different streams never match each other and need no order between them. Off (the
    /// strict default): one communicator per group, shared by the streams.
    pub communicator_per_stream: bool,
}

/// Checks a plan; returns every violation found. `budget`: the arena may take at most this
/// many bytes per rank. Collectives on one group are taken to share a communicator across
/// streams (see [`VerifyOptions`]).
pub fn verify_plan(plan: &Plan, budget: Option<u64>) -> Result<(), Vec<PlanViolation>> {
    verify_plan_with(
        plan,
        &VerifyOptions {
            budget,
            ..VerifyOptions::default()
        },
    )
}

/// [`verify_plan`] with options.
pub fn verify_plan_with(plan: &Plan, opts: &VerifyOptions) -> Result<(), Vec<PlanViolation>> {
    let budget = opts.budget;
    let p = &plan.program;
    let mut out = mesh_and_groups(plan);
    if let Err(e) = hzp_ir::verify(p) {
        out.push(PlanViolation {
            check: Check::Program,
            nodes: Vec::new(),
            message: format!("the program does not verify: {e}"),
        });
        // The other checks assume a well-formed program.
        return Err(out);
    }
    let mut v = Verifier {
        p,
        hb: HappensBefore::new(p),
        out,
    };
    v.events();
    v.materialized();
    v.frees();
    if !opts.communicator_per_stream {
        v.collective_order();
    }
    v.buffers(plan);
    if let Some(budget) = budget {
        if plan.arena_bytes > budget {
            v.out.push(PlanViolation {
                check: Check::Budget,
                nodes: Vec::new(),
                message: format!(
                    "the plan needs {} ({} bytes) of memory per rank, over the budget of {} \
                     ({} bytes) by {}",
                    format_bytes(plan.arena_bytes),
                    plan.arena_bytes,
                    format_bytes(budget),
                    budget,
                    format_bytes(plan.arena_bytes - budget)
                ),
            });
        }
    }
    if v.out.is_empty() {
        Ok(())
    } else {
        Err(v.out)
    }
}

struct Verifier<'a> {
    p: &'a Program,
    hb: HappensBefore,
    out: Vec<PlanViolation>,
}

impl Verifier<'_> {
    fn name(&self, n: NodeId) -> String {
        self.p.nodes[n.index()].name.clone()
    }

    /// `` `ag0` (AllGather on allgather) ``
    fn describe(&self, n: NodeId) -> String {
        let node = &self.p.nodes[n.index()];
        format!(
            "`{}` ({} on {})",
            node.name,
            node.op.name(),
            node.stream.name()
        )
    }

    fn value(&self, v: ValueId) -> String {
        hzp_ir::text::value_ref(&self.p.value(v).name)
    }

    fn push(&mut self, check: Check, nodes: &[NodeId], message: String) {
        let nodes = nodes.iter().map(|&n| self.name(n)).collect();
        self.out.push(PlanViolation {
            check,
            nodes,
            message,
        });
    }

    fn events(&mut self) {
        let problems = std::mem::take(&mut self.hb.problems);
        for e in &problems {
            match *e {
                EventProblem::Unrecorded { wait, event } => self.push(
                    Check::Event,
                    &[wait],
                    format!(
                        "{} waits on event {event}, which no node records",
                        self.describe(wait)
                    ),
                ),
                EventProblem::WaitBeforeRecord {
                    wait,
                    record,
                    event,
                } => self.push(
                    Check::Event,
                    &[wait, record],
                    format!(
                        "{} waits on event {event} before {} records it in issue order: the \
                         streams would deadlock",
                        self.describe(wait),
                        self.describe(record)
                    ),
                ),
                EventProblem::RecordedTwice {
                    first,
                    second,
                    event,
                } => self.push(
                    Check::Event,
                    &[first, second],
                    format!(
                        "event {event} is recorded twice in a step, by {} and by {}",
                        self.describe(first),
                        self.describe(second)
                    ),
                ),
            }
        }
        self.hb.problems = problems;
    }

    fn materialized(&mut self) {
        let p = self.p;
        for (i, node) in p.nodes.iter().enumerate() {
            let b = NodeId(i as u32);
            for (k, &v) in node.inputs.iter().enumerate() {
                if node.inputs[..k].contains(&v) {
                    continue;
                }
                let Some(a) = p.producer(v) else { continue };
                if !self.hb.happens_before(a, b) {
                    self.push(
                        Check::Materialized,
                        &[b, a],
                        format!(
                            "{} reads {}, produced by {}, with no event ordering them: record \
                             an event on {} after `{}` and wait on it on {} before `{}`",
                            self.describe(b),
                            self.value(v),
                            self.describe(a),
                            p.nodes[a.index()].stream.name(),
                            p.nodes[a.index()].name,
                            node.stream.name(),
                            node.name
                        ),
                    );
                }
            }
        }
    }

    fn frees(&mut self) {
        let p = self.p;
        let users = p.users();
        let mut outputs = vec![false; p.values.len()];
        for &o in &p.outputs {
            outputs[o.index()] = true;
        }
        let mut updated = vec![false; p.values.len()];
        for u in &p.updates {
            updated[u.value.index()] = true;
        }
        let mut freed_by: HashMap<ValueId, NodeId> = HashMap::new();
        for (i, node) in p.nodes.iter().enumerate() {
            if !matches!(node.op, Op::Free) {
                continue;
            }
            let f = NodeId(i as u32);
            let Some(&x) = node.inputs.first() else {
                continue;
            };
            if let Some(&first) = freed_by.get(&x) {
                self.push(
                    Check::Free,
                    &[f, first],
                    format!(
                        "{} frees {}, which {} already freed",
                        self.describe(f),
                        self.value(x),
                        self.describe(first)
                    ),
                );
                continue;
            }
            freed_by.insert(x, f);
            let what = match p.value(x).def {
                ValueDef::Param => Some("a parameter"),
                ValueDef::Const => Some("a constant"),
                ValueDef::State => Some("a state"),
                _ if outputs[x.index()] => Some("a program output"),
                _ if updated[x.index()] => Some("the new value of an update"),
                _ => None,
            };
            if let Some(what) = what {
                self.push(
                    Check::Free,
                    &[f],
                    format!(
                        "{} frees {}, {what}, which must live until the end of the step",
                        self.describe(f),
                        self.value(x)
                    ),
                );
            }
            for &r in &users[x.index()] {
                if r != f && !self.hb.happens_before(r, f) {
                    let when = if r > f {
                        "after"
                    } else {
                        "possibly after (no event orders them)"
                    };
                    self.push(
                        Check::Free,
                        &[r, f],
                        format!(
                            "{} reads {} {when} {} freed it",
                            self.describe(r),
                            self.value(x),
                            self.describe(f)
                        ),
                    );
                }
            }
        }
    }

    fn collective_order(&mut self) {
        let p = self.p;
        // communicator (the set of axes) -> per stream, the last collective issued on it
        let mut last: BTreeMap<Vec<String>, [Option<NodeId>; NUM_STREAMS]> = BTreeMap::new();
        for (i, node) in p.nodes.iter().enumerate() {
            let Some(group) = node.op.group() else {
                continue;
            };
            let c = NodeId(i as u32);
            let mut key = group.axes.clone();
            key.sort();
            key.dedup();
            let s = self.hb.stream_of(c);
            let slots = last.entry(key).or_insert([None; NUM_STREAMS]);
            let prev = *slots;
            slots[s] = Some(c);
            for (t, q) in prev.into_iter().enumerate() {
                let Some(q) = q else { continue };
                if t != s && !self.hb.happens_before(q, c) {
                    self.push(
                        Check::Collective,
                        &[q, c],
                        format!(
                            "{} and {} run on the same ranks ({} and {}) on different streams \
                             with no event ordering them: ranks may match them in different \
                             orders and hang",
                            self.describe(q),
                            self.describe(c),
                            p.nodes[q.index()]
                                .op
                                .group()
                                .map_or(String::new(), |g| g.to_string()),
                            group
                        ),
                    );
                }
            }
        }
    }

    /// The buffer checks: each value's buffer (one, big enough, inside the arena; every
    /// value with bytes has one), then no two buffers that share bytes live at the same
    /// time.
    fn buffers(&mut self, plan: &Plan) {
        let ok = self.buffer_table(plan);
        let p = self.p;
        let whole_step = |v: ValueId| {
            matches!(
                p.value(v).def,
                ValueDef::Param | ValueDef::Const | ValueDef::State
            )
        };
        let lives = lives(p, &self.hb, &whole_step, false);
        let users = p.users();
        // Values that live the whole step share bytes with nothing: check them by address.
        let (whole, ok): (Vec<usize>, Vec<usize>) = ok
            .into_iter()
            .filter(|&k| plan.buffers[k].bytes > 0)
            .partition(|&k| lives[plan.buffers[k].value.index()].whole_step);
        // A reshape or identity may lie in its input's very bytes: the two are one view of the
        // same data (see `memory::view_sources`); each is still checked against all others.
        let views = crate::plan::memory::view_sources(p);
        // An update value may lie in its target's bytes when the target is no longer read
        // (see `memory::in_place_updates`).
        let in_place: HashSet<(ValueId, ValueId)> =
            crate::plan::memory::in_place_updates(p, &self.hb, &lives, &views)
                .into_iter()
                .collect();
        let mut found = whole_step_overlaps(plan, &whole, &ok, &views, &in_place);
        found.extend(self.window_overlaps(plan, &ok, &lives, &views));
        self.report_overlaps(plan, found, &lives, &users);
    }

    /// Checks each buffer alone and that every value with bytes has one; returns the
    /// buffers that passed (by index).
    fn buffer_table(&mut self, plan: &Plan) -> Vec<usize> {
        let p = self.p;
        let nv = p.values.len();
        let mut has: Vec<Option<usize>> = vec![None; nv];
        let mut ok: Vec<usize> = Vec::new();
        for (k, b) in plan.buffers.iter().enumerate() {
            if b.value.index() >= nv {
                self.push(
                    Check::Buffer,
                    &[],
                    format!(
                        "the buffer at offset {} refers to value {}, and the program has {nv} \
                         values",
                        b.offset, b.value.0
                    ),
                );
                continue;
            }
            let v = b.value;
            if has[v.index()].is_some() {
                self.push(
                    Check::Buffer,
                    &[],
                    format!("{} has more than one buffer", self.value(v)),
                );
                continue;
            }
            has[v.index()] = Some(k);
            let need = value_bytes(p, v);
            if b.bytes < need {
                self.push(
                    Check::Buffer,
                    &[],
                    format!(
                        "the buffer of {} holds {} bytes, the value needs {need}",
                        self.value(v),
                        b.bytes
                    ),
                );
            }
            if b.end() > plan.arena_bytes || b.offset.checked_add(b.bytes).is_none() {
                self.push(
                    Check::Buffer,
                    &[],
                    format!(
                        "the buffer of {} (bytes {}..{}) lies outside the arena of {} bytes",
                        self.value(v),
                        b.offset,
                        b.end(),
                        plan.arena_bytes
                    ),
                );
            }
            ok.push(k);
        }
        for (i, h) in has.iter().enumerate() {
            let v = ValueId(i as u32);
            if h.is_none() && value_bytes(p, v) > 0 {
                self.push(
                    Check::Buffer,
                    &[],
                    format!("{} ({}) has no buffer in the plan", self.value(v), p.ty(v)),
                );
            }
        }
        ok
    }

    /// Pairs of buffers that share bytes and whose values may be live together, among
    /// those that do not live the whole step: a producer can only overwrite values whose
    /// windows cover it (see `memory::windows`); they are indexed by window and address,
    /// and each pair that shares bytes is checked once, from its later-produced side.
    fn window_overlaps(
        &self,
        plan: &Plan,
        ok: &[usize],
        lives: &[Life],
        views: &[ValueId],
    ) -> Vec<(usize, usize)> {
        let mut found = Vec::new();
        let wins = crate::plan::memory::windows(&self.hb, lives);
        let index = crate::plan::memory::WindowIndex::new(
            crate::plan::memory::stream_lens(&self.hb),
            ok.iter().enumerate().map(|(x, &k)| {
                let b = plan.buffers[k];
                let v = b.value.index();
                (
                    x as u32,
                    wins[v],
                    crate::plan::memory::def_slot(&self.hb, &lives[v]),
                    b.offset,
                    b.end(),
                )
            }),
        );
        let mut stamp: Vec<u32> = vec![u32::MAX; ok.len()];
        for (x, &i) in ok.iter().enumerate() {
            let a = plan.buffers[i];
            let v = a.value.index();
            let def = crate::plan::memory::def_slot(&self.hb, &lives[v]);
            index.overlapping(def, a.offset, a.end(), |y| {
                let y = y as usize;
                if y == x || stamp[y] == x as u32 {
                    return;
                }
                stamp[y] = x as u32;
                let j = ok[y];
                let b = plan.buffers[j];
                if b.offset >= a.end() || a.offset >= b.end() || same_view(views, &a, &b) {
                    return;
                }
                let (la, lb) = (&lives[v], &lives[b.value.index()]);
                if la.conflicts(lb, &self.hb) {
                    found.push((i.min(j), i.max(j)));
                }
            });
        }
        found
    }

    /// Reports each overlapping pair, in address order, as a person reads the arena.
    fn report_overlaps(
        &mut self,
        plan: &Plan,
        mut found: Vec<(usize, usize)>,
        lives: &[Life],
        users: &[Vec<NodeId>],
    ) {
        found.sort_unstable();
        found.dedup();
        found.sort_by_key(|&(i, j)| {
            let (a, b) = (&plan.buffers[i], &plan.buffers[j]);
            let (a, b) = if (a.offset, a.end(), a.value) <= (b.offset, b.end(), b.value) {
                (a, b)
            } else {
                (b, a)
            };
            (a.offset, a.end(), a.value, b.offset, b.end(), b.value)
        });
        for (i, j) in found {
            let (a, b) = (plan.buffers[i], plan.buffers[j]);
            let (la, lb) = (&lives[a.value.index()], &lives[b.value.index()]);
            let (o, e) = (b.offset.max(a.offset), b.end().min(a.end()));
            // Name the value produced later (the overwriter) second.
            let (first, second) =
                if la.def.map_or(-1, |d| d as i64) <= lb.def.map_or(-1, |d| d as i64) {
                    (a.value, b.value)
                } else {
                    (b.value, a.value)
                };
            let (why, nodes) = self.why_live_together(first, second, lives, users);
            self.push(
                Check::Buffer,
                &nodes,
                format!(
                    "the buffers of {} and {} share bytes {o}..{e}, and {why}",
                    self.value(first),
                    self.value(second)
                ),
            );
        }
    }

    /// Why `first` (produced no later than `second`) may still be live when `second` is
    /// produced, with the nodes that show it.
    fn why_live_together(
        &self,
        first: ValueId,
        second: ValueId,
        lives: &[Life],
        users: &[Vec<NodeId>],
    ) -> (String, Vec<NodeId>) {
        let p = self.p;
        let (lf, ls) = (&lives[first.index()], &lives[second.index()]);
        let kind = |v: ValueId, l: &Life| -> Option<&'static str> {
            match p.value(v).def {
                ValueDef::Param => Some("is a parameter, which lives for the whole step"),
                ValueDef::Const => Some("is a constant, which lives for the whole step"),
                ValueDef::State => Some("is a state, which lives for the whole step"),
                _ if l.to_end => Some("lives until the end of the step"),
                _ => None,
            }
        };
        for (v, l) in [(first, lf), (second, ls)] {
            if let Some(k) = kind(v, l) {
                return (format!("{} {k}", self.value(v)), Vec::new());
            }
        }
        let Some(d) = ls.def else {
            return (
                format!(
                    "both are materialized before the step starts ({} is read during it)",
                    self.value(first)
                ),
                Vec::new(),
            );
        };
        let d = NodeId(d as u32);
        let uses = lf
            .def
            .map(|x| NodeId(x as u32))
            .into_iter()
            .chain(users[first.index()].iter().copied());
        for u in uses {
            if u == d {
                return (
                    format!(
                        "{} reads {} while it writes {} over it",
                        self.describe(d),
                        self.value(first),
                        self.value(second)
                    ),
                    vec![d],
                );
            }
            if !self.hb.happens_before(u, d) {
                let verb = if Some(u.index()) == lf.def {
                    "writes"
                } else {
                    "reads"
                };
                return (
                    format!(
                        "{} {verb} {} with no ordering before {} writes {}",
                        self.describe(u),
                        self.value(first),
                        self.describe(d),
                        self.value(second)
                    ),
                    vec![u, d],
                );
            }
        }
        (
            format!("{} may be live together", self.value(second)),
            vec![d],
        )
    }
}

/// The plan's mesh against the program's, the shard groups and the groups of collectives
/// against the mesh. Safe on programs that do not verify.
/// The most micro-batches a plan may have (as `--micro-batches` allows).
pub const MAX_MICRO_BATCHES: usize = 65_536;

fn mesh_and_groups(plan: &Plan) -> Vec<PlanViolation> {
    let mut out = Vec::new();
    let p = &plan.program;
    if let Some(m) = &p.mesh {
        if *m != plan.mesh {
            out.push(PlanViolation {
                check: Check::Program,
                nodes: Vec::new(),
                message: format!(
                    "the program's mesh {m} is not the plan's mesh {}",
                    plan.mesh
                ),
            });
        }
    }
    if let Err(e) = plan.mesh.check_size() {
        out.push(PlanViolation {
            check: Check::Program,
            nodes: Vec::new(),
            message: format!("the plan's {e}"),
        });
    }
    // Micro-batches: each rank's inputs hold that many, concatenated on axis 0.
    if plan.micro_batches == 0 || plan.micro_batches > MAX_MICRO_BATCHES {
        out.push(PlanViolation {
            check: Check::Program,
            nodes: Vec::new(),
            message: format!(
                "the plan has {} micro-batches; it must have 1 to {MAX_MICRO_BATCHES}",
                plan.micro_batches
            ),
        });
    } else {
        for &v in &p.inputs {
            let Some(val) = p.values.get(v.index()) else {
                continue;
            };
            // a scalar input (the learning rate) is every micro-batch's: nothing to split
            let Some(&rows) = val.ty.shape.first() else {
                continue;
            };
            if rows % plan.micro_batches != 0 {
                out.push(PlanViolation {
                    check: Check::Program,
                    nodes: Vec::new(),
                    message: format!(
                        "input `{}` is {} per rank, whose first dim does not split into the plan's {} micro-batches",
                        val.name, val.ty, plan.micro_batches
                    ),
                });
            }
        }
    }
    let g = &plan.groups;
    // Shard groups nest: P ⊆ G ⊆ O.
    for (inner, outer, what) in [
        (
            &g.params,
            &g.grads,
            "parameter group P is not inside the gradient group G",
        ),
        (
            &g.grads,
            &g.optim,
            "gradient group G is not inside the optimizer group O",
        ),
    ] {
        if !inner.axes.iter().all(|a| outer.axes.contains(a)) {
            out.push(PlanViolation {
                check: Check::Groups,
                nodes: Vec::new(),
                message: format!("the {what} ({inner} vs {outer})"),
            });
        }
    }
    for (what, group) in [
        ("parameter group P", &g.params),
        ("gradient group G", &g.grads),
        ("optimizer group O", &g.optim),
    ] {
        if let Some(msg) = group_problem(group, &plan.mesh) {
            out.push(PlanViolation {
                check: Check::Groups,
                nodes: Vec::new(),
                message: format!("the {what} {group} {msg}"),
            });
        }
    }
    for node in &p.nodes {
        let Some(group) = node.op.group() else {
            continue;
        };
        if let Some(msg) = group_problem(group, &plan.mesh) {
            out.push(PlanViolation {
                check: Check::Collective,
                nodes: vec![node.name.clone()],
                message: format!(
                    "`{}` ({} on {}) runs on group {group}, which {msg}",
                    node.name,
                    node.op.name(),
                    node.stream.name()
                ),
            });
        }
    }
    out
}

/// What is wrong with a group on a mesh, if anything.
fn group_problem(group: &Group, mesh: &Mesh) -> Option<String> {
    let missing: Vec<&str> = group
        .axes
        .iter()
        .filter(|a| mesh.axis(a).is_none())
        .map(String::as_str)
        .collect();
    if !missing.is_empty() {
        return Some(format!(
            "names {} `{}` that the mesh {mesh} does not have",
            if missing.len() == 1 { "axis" } else { "axes" },
            missing.join("`, `")
        ));
    }
    for (i, a) in group.axes.iter().enumerate() {
        if group.axes[..i].contains(a) {
            return Some(format!("names axis `{a}` twice"));
        }
    }
    None
}
/// Whether buffers `a` and `b` are one view of the same data at the same bytes.
fn same_view(views: &[ValueId], a: &Buffer, b: &Buffer) -> bool {
    views[a.value.index()] == views[b.value.index()] && a.offset == b.offset && a.bytes == b.bytes
}

/// Pairs of a whole-step buffer (`whole`) with any other buffer that share bytes, found
/// without scanning every earlier buffer (that was quadratic in the layers when one
/// whole-step buffer spanned much of the arena): in offset order, each buffer meets the
/// whole-step buffers still open at its start; a buffer also meets the whole-step buffers
/// that start inside it (binary search). Both only enumerate pairs that really share bytes.
/// An update in its target's bytes (`in_place`) and two views of one value are no conflict.
fn whole_step_overlaps(
    plan: &Plan,
    whole: &[usize],
    ok: &[usize],
    views: &[ValueId],
    in_place: &HashSet<(ValueId, ValueId)>,
) -> Vec<(usize, usize)> {
    let mut found = Vec::new();
    let is_whole = {
        let mut w = vec![false; plan.buffers.len()];
        for &k in whole {
            w[k] = true;
        }
        w
    };
    let key = |k: usize| (plan.buffers[k].offset, plan.buffers[k].end(), k);
    let mut whole_by_addr: Vec<usize> = whole.to_vec();
    whole_by_addr.sort_by_key(|&k| key(k));
    let mut by_addr: Vec<usize> = whole.iter().chain(ok).copied().collect();
    by_addr.sort_by_key(|&k| key(k));
    let pair = |i: usize, j: usize, found: &mut Vec<(usize, usize)>| {
        if i == j {
            return;
        }
        // As the scan saw it: b whole-step, a the other (both whole-step: b the lower).
        let (bi, ai) = if is_whole[j] && (!is_whole[i] || j < i) {
            (j, i)
        } else {
            (i, j)
        };
        let (b, a) = (plan.buffers[bi], plan.buffers[ai]);
        let exempt =
            in_place.contains(&(b.value, a.value)) && a.offset >= b.offset && a.end() <= b.end();
        if !exempt && !same_view(views, &a, &b) {
            found.push((i.min(j), i.max(j)));
        }
    };
    let mut open: Vec<usize> = Vec::new();
    for &i in &by_addr {
        let a = plan.buffers[i];
        open.retain(|&j| plan.buffers[j].end() > a.offset);
        for &j in &open {
            pair(i, j, &mut found);
        }
        let from = whole_by_addr.partition_point(|&k| plan.buffers[k].offset <= a.offset);
        for &j in &whole_by_addr[from..] {
            if plan.buffers[j].offset >= a.end() {
                break;
            }
            pair(i, j, &mut found);
        }
        if is_whole[i] {
            open.push(i);
        }
    }
    found
}
