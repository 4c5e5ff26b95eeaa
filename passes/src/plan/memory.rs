//! Memory planning: every value that needs storage gets an offset in one per-rank arena,
//! planned ahead of time so that the runtime never allocates during a step.
//!
//! # Streams, events and lifetimes
//!
//! A per-rank program runs its nodes in one issue order; each stream runs its own nodes in that
//! order, one at a time, and streams run concurrently. The only cross-stream ordering is by
//! events: `RecordEvent{e}` on stream S completes when every earlier node of S has completed,
//! and `WaitEvent{e}` on stream T holds T's later nodes until `e` was recorded. Node `a`
//! *happens before* node `b` when that follows from stream order and record -> wait edges
//! ([`HappensBefore`], vector clocks per stream).
//!
//! A value's bytes are in use from its producer to its last reader. Two values may share bytes
//! only if every use of the first (its producer and all its readers) happens before the
//! producer of the second: issue order alone is not enough across streams. A `Free(%x)` is an
//! explicit last use: readers after it do not extend the life of `%x` (the plan verifier
//! rejects them). Persistent values (parameters, states, constants, inputs, and whatever the
//! caller marks) live for the whole step and share bytes with nothing; program outputs live
//! from their producer to the end of the step.
//!
//! # Placement
//!
//! Persistent buffers come first, at the bottom of the arena, in value order. The others are
//! placed greedily, largest first (then earliest producer, then value id), each at the lowest
//! 64-byte-aligned offset that overlaps no placed buffer it may be live together with. The
//! result depends only on the program, so the same input gives the same plan byte for byte.

use hzp_ir::{Buffer, BufferKind, NodeId, Op, Program, StreamKind, ValueDef, ValueId};
use std::collections::{BTreeMap, HashMap};

/// Alignment of every buffer offset (and of the space a buffer takes), in bytes.
pub const ALIGN: u64 = 64;

/// Number of streams of a rank.
pub const NUM_STREAMS: usize = StreamKind::COUNT;

/// A misuse of events found while building [`HappensBefore`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventProblem {
    /// A wait on an event that no node records.
    Unrecorded { wait: NodeId, event: u32 },
    /// A wait issued before the record of its event: a deadlock.
    WaitBeforeRecord {
        wait: NodeId,
        record: NodeId,
        event: u32,
    },
    /// An event recorded more than once in a step.
    RecordedTwice {
        first: NodeId,
        second: NodeId,
        event: u32,
    },
}

/// The happens-before relation of a multi-stream program, as vector clocks.
///
/// `clock[n][s]` is the number of nodes of stream `s` that happen before `n` or are `n`. A
/// wait joins the clock of its event's record (the first record, issued before the wait); a
/// wait without a usable record adds no ordering and is reported in [`HappensBefore::problems`].
#[derive(Clone, Debug)]
pub struct HappensBefore {
    stream: Vec<u8>,
    pos: Vec<u32>,
    clock: Vec<[u32; NUM_STREAMS]>,
    by_stream: [Vec<u32>; NUM_STREAMS],
    /// Event misuses, in issue order.
    pub problems: Vec<EventProblem>,
}

impl HappensBefore {
    pub fn new(p: &Program) -> HappensBefore {
        let n = p.nodes.len();
        let mut problems = Vec::new();
        let mut record_of: HashMap<u32, usize> = HashMap::new();
        for (i, node) in p.nodes.iter().enumerate() {
            if let Op::RecordEvent { event } = node.op {
                if let Some(&first) = record_of.get(&event) {
                    problems.push(EventProblem::RecordedTwice {
                        first: NodeId(first as u32),
                        second: NodeId(i as u32),
                        event,
                    });
                } else {
                    record_of.insert(event, i);
                }
            }
        }
        let mut hb = HappensBefore {
            stream: Vec::with_capacity(n),
            pos: Vec::with_capacity(n),
            clock: Vec::with_capacity(n),
            by_stream: Default::default(),
            problems: Vec::new(),
        };
        let mut last: [Option<usize>; NUM_STREAMS] = [None; NUM_STREAMS];
        for (i, node) in p.nodes.iter().enumerate() {
            let s = node.stream.index();
            let mut c = last[s].map_or([0; NUM_STREAMS], |j| hb.clock[j]);
            if let Op::WaitEvent { event } = node.op {
                match record_of.get(&event) {
                    None => problems.push(EventProblem::Unrecorded {
                        wait: NodeId(i as u32),
                        event,
                    }),
                    Some(&r) if r < i => {
                        for (x, y) in c.iter_mut().zip(hb.clock[r]) {
                            *x = (*x).max(y);
                        }
                    }
                    Some(&r) => problems.push(EventProblem::WaitBeforeRecord {
                        wait: NodeId(i as u32),
                        record: NodeId(r as u32),
                        event,
                    }),
                }
            }
            let position = hb.by_stream[s].len() as u32 + 1;
            c[s] = position;
            hb.stream.push(s as u8);
            hb.pos.push(position);
            hb.clock.push(c);
            hb.by_stream[s].push(i as u32);
            last[s] = Some(i);
        }
        problems.sort_by_key(|e| match e {
            EventProblem::Unrecorded { wait, .. } | EventProblem::WaitBeforeRecord { wait, .. } => {
                *wait
            }
            EventProblem::RecordedTwice { second, .. } => *second,
        });
        hb.problems = problems;
        hb
    }

    /// Whether node `a` completes before node `b` starts, on every rank and every run.
    pub fn happens_before(&self, a: NodeId, b: NodeId) -> bool {
        let (a, b) = (a.index(), b.index());
        a != b
            && a < self.pos.len()
            && b < self.pos.len()
            && self.clock[b][self.stream[a] as usize] >= self.pos[a]
    }

    /// Index (see [`StreamKind::index`]) of the stream node `n` runs on.
    pub fn stream_of(&self, n: NodeId) -> usize {
        self.stream[n.index()] as usize
    }

    /// 1-based position of node `n` among the nodes of its stream.
    pub fn position(&self, n: NodeId) -> u32 {
        self.pos[n.index()]
    }

    /// For each stream, how many of its nodes happen before `n` (strictly).
    pub fn seen_before(&self, n: NodeId) -> [u32; NUM_STREAMS] {
        let mut c = self.clock[n.index()];
        c[self.stream[n.index()] as usize] -= 1;
        c
    }

    /// The nodes of stream `s`, in issue order.
    pub fn nodes_on(&self, s: usize) -> &[u32] {
        &self.by_stream[s]
    }
}

/// A value's life, as seen by the memory planner and the plan verifier.
#[derive(Clone, Debug)]
pub(crate) struct Life {
    /// Index of the producing node; `None`: materialized before the step starts.
    pub def: Option<usize>,
    /// Per stream, the highest position (1-based) of a use; 0: no use on that stream.
    pub last: [u32; NUM_STREAMS],
    /// Highest issue index of a use, if any.
    pub last_issue: Option<usize>,
    /// Lives for the whole step (and across steps): shares bytes with nothing.
    pub whole_step: bool,
    /// Lives from its producer to the end of the step (program outputs, update values).
    pub to_end: bool,
}

impl Life {
    /// Whether every use of `self` happens before the producer of `other`, so `other` may
    /// take over `self`'s bytes.
    pub fn ends_before(&self, other: &Life, hb: &HappensBefore) -> bool {
        if self.whole_step || self.to_end || other.whole_step {
            return false;
        }
        let Some(d) = other.def else { return false };
        let seen = hb.seen_before(NodeId(d as u32));
        self.last.iter().zip(seen).all(|(&l, s)| l <= s)
    }

    /// Whether the two values may be live at the same time (so must not share bytes).
    pub fn conflicts(&self, other: &Life, hb: &HappensBefore) -> bool {
        !self.ends_before(other, hb) && !other.ends_before(self, hb)
    }
}

/// Lives of all values. `whole_step(v)` marks persistent values. With `bound_by_free`, a
/// value's uses stop at its first `Free` (the planner trusts it); without, every reader counts
/// (the verifier checks readers after a `Free` separately).
pub(crate) fn lives(
    p: &Program,
    hb: &HappensBefore,
    whole_step: &dyn Fn(ValueId) -> bool,
    bound_by_free: bool,
) -> Vec<Life> {
    let mut lives: Vec<Life> = (0..p.values.len())
        .map(|i| {
            let v = ValueId(i as u32);
            let def = match p.values[i].def {
                ValueDef::Node { node, .. } if node.index() < p.nodes.len() => Some(node.index()),
                _ => None,
            };
            let mut l = Life {
                def,
                last: [0; NUM_STREAMS],
                last_issue: def,
                whole_step: whole_step(v),
                to_end: false,
            };
            if let Some(d) = def {
                l.last[hb.stream[d] as usize] = hb.pos[d];
            }
            l
        })
        .collect();
    for &o in &p.outputs {
        if let Some(l) = lives.get_mut(o.index()) {
            l.to_end = true;
        }
    }
    for u in &p.updates {
        if let Some(l) = lives.get_mut(u.value.index()) {
            l.to_end = true;
        }
    }
    let mut freed = vec![false; p.values.len()];
    for (i, node) in p.nodes.iter().enumerate() {
        let s = hb.stream[i] as usize;
        for &v in &node.inputs {
            let Some(l) = lives.get_mut(v.index()) else {
                continue;
            };
            if bound_by_free && freed[v.index()] {
                continue;
            }
            l.last[s] = l.last[s].max(hb.pos[i]);
            l.last_issue = Some(l.last_issue.map_or(i, |x| x.max(i)));
        }
        if bound_by_free && matches!(node.op, Op::Free) {
            for &v in &node.inputs {
                if let Some(f) = freed.get_mut(v.index()) {
                    *f = true;
                }
            }
        }
    }
    lives
}

/// The (input, result) pairs of the nodes whose result is its input's bytes: a `Reshape` or
/// `Identity` of one result with the input's dtype and size (the bytes unchanged), a
/// transposed operand (`hzp_ir::views::transposed_operands`: the bytes read column-major by
/// the products that read it), or an in-place result (written over an input that nothing
/// reads afterwards), in node order.
fn view_pairs(p: &Program) -> Vec<(ValueId, ValueId)> {
    let nv = p.values.len();
    let transposed = hzp_ir::views::transposed_operands(p);
    let same = move |x: ValueId, y: ValueId| {
        x.index() < nv
            && y.index() < nv
            && p.ty(x).dtype == p.ty(y).dtype
            && value_bytes(p, x) == value_bytes(p, y)
    };
    let views: Vec<Option<(ValueId, ValueId)>> = p
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            if !n.op.is_view() && !transposed[i] {
                return None;
            }
            let ([x, ..], [y]) = (n.inputs.as_slice(), n.outputs.as_slice()) else {
                return None;
            };
            same(*x, *y).then_some((*x, *y))
        })
        .collect();
    // In-place results: an op's result that may be written over an input it declares
    // (`Op::in_place_pairs`, e.g. a scatter over its data) takes that input's bytes when the
    // input is a computed value (not a view of another) that nothing else reads, and
    // neither leaves the step.
    let mut is_view = vec![false; nv];
    for &(_, y) in views.iter().flatten() {
        is_view[y.index()] = true;
    }
    let users = p.users();
    let escaping = p.escaping_values();
    let in_place: Vec<Option<(ValueId, ValueId)>> = p
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            if views[i].is_some() {
                return None;
            }
            n.op.in_place_pairs().iter().find_map(|&(a, b)| {
                let (&x, &y) = (n.inputs.get(a)?, n.outputs.get(b)?);
                let ok = same(x, y)
                    && matches!(p.value(x).def, ValueDef::Node { .. })
                    && !is_view[x.index()]
                    && users[x.index()] == [hzp_ir::NodeId(i as u32)]
                    && n.inputs.iter().filter(|&&v| v == x).count() == 1
                    && !escaping[x.index()]
                    && !escaping[y.index()];
                ok.then_some((x, y))
            })
        })
        .collect();
    views
        .into_iter()
        .zip(in_place)
        .filter_map(|(v, ip)| v.or(ip))
        .collect()
}

/// Views: for each value, the value whose bytes it is (itself for most values). The result of
/// a `Reshape` or `Identity` is its input's bytes unchanged, so it is the same view root as
/// its input: the planner may give both one buffer and the runtime then has nothing to copy.
/// Structural only (see [`view_roots`] for the ones the planner actually shares).
pub(crate) fn view_sources(p: &Program) -> Vec<ValueId> {
    sources_of(p, &view_pairs(p))
}

/// [`view_sources`] from the program's [`view_pairs`].
fn sources_of(p: &Program, pairs: &[(ValueId, ValueId)]) -> Vec<ValueId> {
    let mut root: Vec<ValueId> = (0..p.values.len()).map(|i| ValueId(i as u32)).collect();
    for &(x, y) in pairs {
        root[y.index()] = root[x.index()];
    }
    root
}

/// The views the planner gives their root's buffer: those of [`view_sources`] except where
/// an update's new value takes part (it keeps a buffer of its own, or its target's). A root
/// may be persistent (a reshaped parameter or input lies in its bytes); the views of a root
/// extend its life, so an update is written over its target only once no view of the
/// target is read any more (see [`plan_memory`]). Members are produced after their root (a
/// reshape reads its input), so the root's producer starts the class's life.
fn view_roots(p: &Program, pairs: &[(ValueId, ValueId)]) -> Vec<ValueId> {
    let mut in_update = vec![false; p.values.len()];
    for u in &p.updates {
        if let Some(f) = in_update.get_mut(u.value.index()) {
            *f = true;
        }
    }
    let mut root: Vec<ValueId> = (0..p.values.len()).map(|i| ValueId(i as u32)).collect();
    for &(x, y) in pairs {
        let r = root[x.index()];
        if value_bytes(p, y) > 0
            && !in_update[x.index()]
            && !in_update[y.index()]
            && !in_update[r.index()]
        {
            root[y.index()] = r;
        }
    }
    root
}

/// Bytes of a value as stored (saturating; a verified program's sizes fit).
pub fn value_bytes(p: &Program, v: ValueId) -> u64 {
    let ty = p.ty(v);
    ty.shape
        .iter()
        .try_fold(ty.dtype.size_bytes() as u64, |a, &d| {
            a.checked_mul(d as u64)
        })
        .unwrap_or(u64::MAX)
}

fn align_up(b: u64) -> u64 {
    b.div_ceil(ALIGN).saturating_mul(ALIGN)
}

/// The result of [`plan_memory`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// One buffer per value with a nonzero size, in value order.
    pub buffers: Vec<Buffer>,
    /// Size of the arena: the highest end of a buffer (buffers take whole 64-byte lines).
    pub arena_bytes: u64,
    /// Bytes live at the peak of [`MemoryPlan::timeline`] (<= `arena_bytes`).
    pub peak_bytes: u64,
    /// Issue index of the (first) peak; `None` for a program without nodes.
    pub peak_index: Option<usize>,
    /// Bytes of each kind live at the peak (kinds with none are left out).
    pub peak_by_kind: BTreeMap<BufferKind, u64>,
    /// For each node in issue order: (its index, bytes live while it runs).
    pub timeline: Vec<(usize, u64)>,
}

/// Where a value can be overwritten from: for each stream t, the positions `lo..hi` on t
/// (0-based, in that stream's order) of the producers that could conflict with it. `lo` is
/// the first node of t issued at or after the value's producer; `hi` the first node of t
/// whose clock has seen every use of the value (all of t for values that live to the end).
/// A producer issued no earlier than the value conflicts with it exactly when its position
/// on its stream lies in the window of that stream (clocks grow along a stream).
pub(crate) fn windows(hb: &HappensBefore, lives: &[Life]) -> Vec<[(u32, u32); NUM_STREAMS]> {
    lives
        .iter()
        .map(|l| {
            let mut w = [(0u32, 0u32); NUM_STREAMS];
            for (t, wt) in w.iter_mut().enumerate() {
                let on = hb.nodes_on(t);
                let lo = match l.def {
                    Some(d) => on.partition_point(|&x| (x as usize) < d),
                    None => 0,
                };
                let hi = if l.whole_step || l.to_end {
                    on.len()
                } else {
                    on.partition_point(|&x| {
                        let seen = hb.seen_before(NodeId(x));
                        !l.last.iter().zip(seen).all(|(&a, b)| a <= b)
                    })
                };
                *wt = (lo as u32, hi.max(lo) as u32);
            }
            w
        })
        .collect()
}

/// The number of nodes on each stream.
pub(crate) fn stream_lens(hb: &HappensBefore) -> [usize; NUM_STREAMS] {
    std::array::from_fn(|t| hb.nodes_on(t).len())
}

/// The stream and 0-based position on it of a value's producer.
pub(crate) fn def_slot(hb: &HappensBefore, l: &Life) -> Option<(usize, u32)> {
    l.def.map(|d| (hb.stream[d] as usize, hb.pos[d] - 1))
}

/// Buffers indexed by their windows (see [`windows`]) and addresses, built once: the
/// buffers a producer may overwrite that share bytes with it, found without visiting every
/// buffer whose window covers it (the plan verifier's conflict check).
///
/// Per stream, each window is split into the canonical nodes of a segment tree over the
/// stream's positions (so the nodes on the path to a position hold exactly the windows that
/// cover it); each node keeps its buffers sorted by offset with the running maximum of their
/// ends, so a query walks back from the first buffer at or past the end of the queried bytes
/// and stops at the first point where no earlier buffer reaches into them.
pub(crate) struct WindowIndex {
    len: [usize; NUM_STREAMS],
    /// Per stream: node -> its entries `first[node]..first[node + 1]`.
    first: [Vec<u32>; NUM_STREAMS],
    /// Per stream: (offset, end, id), by node, then offset.
    entries: [Vec<(u64, u64, u32)>; NUM_STREAMS],
    /// Per stream: the highest end among a node's entries up to this one.
    reach: [Vec<u64>; NUM_STREAMS],
    /// Buffers produced before the step (they conflict with each other).
    before: Vec<u32>,
}

impl WindowIndex {
    /// `items`: (id, window, producer's slot, offset, end) of each buffer.
    /// `len`: the number of nodes on each stream (see [`stream_lens`]).
    pub(crate) fn new(
        len: [usize; NUM_STREAMS],
        items: impl Iterator<
            Item = (
                u32,
                [(u32, u32); NUM_STREAMS],
                Option<(usize, u32)>,
                u64,
                u64,
            ),
        >,
    ) -> WindowIndex {
        let mut raw: [Vec<(u32, u64, u64, u32)>; NUM_STREAMS] = Default::default();
        let mut before = Vec::new();
        for (id, win, def, start, end) in items {
            for (t, &(lo, hi)) in win.iter().enumerate() {
                if lo < hi {
                    canonical_nodes(len[t], lo, hi, |i| raw[t].push((i as u32, start, end, id)));
                }
            }
            if def.is_none() {
                before.push(id);
            }
        }
        let mut first: [Vec<u32>; NUM_STREAMS] = Default::default();
        let mut entries: [Vec<(u64, u64, u32)>; NUM_STREAMS] = Default::default();
        let mut reach: [Vec<u64>; NUM_STREAMS] = Default::default();
        for t in 0..NUM_STREAMS {
            let r = &mut raw[t];
            r.sort_unstable();
            let mut f = vec![0u32; 2 * len[t] + 1];
            for &(node, ..) in r.iter() {
                f[node as usize + 1] += 1;
            }
            for i in 1..f.len() {
                f[i] += f[i - 1];
            }
            let mut m = 0u64;
            let mut prev = u32::MAX;
            reach[t] = r
                .iter()
                .map(|&(node, _, end, _)| {
                    if node != prev {
                        (prev, m) = (node, 0);
                    }
                    m = m.max(end);
                    m
                })
                .collect();
            entries[t] = r.iter().map(|&(_, s, e, id)| (s, e, id)).collect();
            first[t] = f;
        }
        WindowIndex {
            len,
            first,
            entries,
            reach,
            before,
        }
    }

    /// Calls `f` with every indexed buffer that shares a byte with `start..end` and whose
    /// window covers the producer at `def` (values produced no later that it may overwrite),
    /// or, for `def` `None`, with every buffer produced before the step (whatever its bytes).
    pub(crate) fn overlapping(
        &self,
        def: Option<(usize, u32)>,
        start: u64,
        end: u64,
        mut f: impl FnMut(u32),
    ) {
        let Some((t, k)) = def else {
            self.before.iter().for_each(|&i| f(i));
            return;
        };
        let (first, entries, reach) = (&self.first[t], &self.entries[t], &self.reach[t]);
        path_nodes(self.len[t], k, |node| {
            let (a, b) = (first[node] as usize, first[node + 1] as usize);
            let mut j = a + entries[a..b].partition_point(|&(s, _, _)| s < end);
            while j > a && reach[j - 1] > start {
                j -= 1;
                let (_, e, id) = entries[j];
                if e > start {
                    f(id);
                }
            }
        });
    }
}

/// Address ranges `[start, end)`, merged: sorted, disjoint and not touching.
#[derive(Clone, Debug, Default)]
struct Runs(Vec<(u64, u64)>);

impl Runs {
    fn insert(&mut self, start: u64, end: u64) {
        // the runs that overlap or touch [start, end) are i..j
        let i = self.0.partition_point(|&(_, e)| e < start);
        let j = self.0.partition_point(|&(s, _)| s <= end);
        if i == j {
            self.0.insert(i, (start, end));
        } else {
            let merged = (self.0[i].0.min(start), self.0[j - 1].1.max(end));
            self.0[i] = merged;
            self.0.drain(i + 1..j);
        }
    }

    /// The end of the run that overlaps `[at, end)`, if one does. Every offset from `at` up to
    /// that end overlaps the run too (with `end - at` bytes), so a first fit may skip them.
    fn blocking(&self, at: u64, end: u64) -> Option<u64> {
        let j = self.0.partition_point(|&(s, _)| s < end);
        let (_, e) = *self.0.get(j.checked_sub(1)?)?;
        (e > at).then_some(e)
    }
}

/// The placed buffers of [`plan_memory`], indexed so that a first fit meets the space taken by
/// conflicting buffers as merged runs instead of one buffer at a time.
///
/// A buffer `a` produced no later than `b` conflicts with it exactly when `b`'s producer lies
/// in `a`'s window on `b`'s stream (see [`windows`]); two buffers produced before the step
/// always conflict. Per stream, two segment trees over the stream's positions hold the
/// address ranges of placed buffers as [`Runs`]: `cover` by window (each window is split into
/// the tree's canonical nodes, so the nodes on the path to a position hold exactly the
/// buffers whose windows cover it), `defs` by producer (each node holds the buffers produced
/// at positions below it, so the canonical nodes of a window hold exactly the buffers produced
/// in it). Runs merge buffers that touch, so a stack of saved activations is one run, and a
/// first fit costs about the number of gaps it tries, not the number of live buffers.
struct Occupancy {
    /// Per stream: node of the segment tree (`1..2 * len`) -> index in `runs`, or `NONE`.
    cover: [Vec<u32>; NUM_STREAMS],
    defs: [Vec<u32>; NUM_STREAMS],
    len: [usize; NUM_STREAMS],
    /// Buffers produced before the step.
    before: Runs,
    runs: Vec<Runs>,
    /// Scratch: the runs a query looks at.
    scratch: Vec<u32>,
}

const NONE: u32 = u32::MAX;

/// Calls `f` with the canonical nodes of positions `lo..hi` in an iterative segment tree of
/// `len` leaves (nodes `1..2 * len`, leaf of position k at `len + k`).
fn canonical_nodes(len: usize, lo: u32, hi: u32, mut f: impl FnMut(usize)) {
    let (mut l, mut r) = (len + lo as usize, len + hi as usize);
    while l < r {
        if l & 1 == 1 {
            f(l);
            l += 1;
        }
        if r & 1 == 1 {
            r -= 1;
            f(r);
        }
        l >>= 1;
        r >>= 1;
    }
}

/// Calls `f` with the nodes on the path from the leaf of position `k` to the root.
fn path_nodes(len: usize, k: u32, mut f: impl FnMut(usize)) {
    let mut i = len + k as usize;
    while i > 0 {
        f(i);
        i >>= 1;
    }
}

impl Occupancy {
    fn new(len: [usize; NUM_STREAMS]) -> Occupancy {
        Occupancy {
            cover: std::array::from_fn(|t| vec![NONE; 2 * len[t]]),
            defs: std::array::from_fn(|t| vec![NONE; 2 * len[t]]),
            len,
            before: Runs::default(),
            runs: Vec::new(),
            scratch: Vec::new(),
        }
    }

    fn add(runs: &mut Vec<Runs>, slot: &mut u32, start: u64, end: u64) {
        if *slot == NONE {
            *slot = runs.len() as u32;
            runs.push(Runs::default());
        }
        runs[*slot as usize].insert(start, end);
    }

    /// Records a buffer with window `win`, produced at `def`, at bytes `start..end`.
    fn insert(
        &mut self,
        win: &[(u32, u32); NUM_STREAMS],
        def: Option<(usize, u32)>,
        start: u64,
        end: u64,
    ) {
        let Occupancy {
            cover,
            defs,
            len,
            before,
            runs,
            ..
        } = self;
        for (t, &(lo, hi)) in win.iter().enumerate() {
            if lo < hi {
                canonical_nodes(len[t], lo, hi, |i| {
                    Self::add(runs, &mut cover[t][i], start, end)
                });
            }
        }
        match def {
            Some((t, k)) => path_nodes(len[t], k, |i| Self::add(runs, &mut defs[t][i], start, end)),
            None => before.insert(start, end),
        }
    }

    /// The lowest offset from `base` where `need` bytes overlap no recorded buffer that
    /// conflicts with a buffer of window `win` produced at `def`.
    fn first_fit(
        &mut self,
        win: &[(u32, u32); NUM_STREAMS],
        def: Option<(usize, u32)>,
        base: u64,
        need: u64,
    ) -> u64 {
        let mut sets = std::mem::take(&mut self.scratch);
        sets.clear();
        let mut keep = |slot: u32| {
            if slot != NONE {
                sets.push(slot);
            }
        };
        // buffers produced no later whose windows cover this producer
        if let Some((t, k)) = def {
            path_nodes(self.len[t], k, |i| keep(self.cover[t][i]));
        }
        // buffers produced no earlier, in this buffer's windows
        for (t, &(lo, hi)) in win.iter().enumerate() {
            if lo < hi {
                canonical_nodes(self.len[t], lo, hi, |i| keep(self.defs[t][i]));
            }
        }
        let mut at = base;
        loop {
            let mut moved = false;
            let mut skip = |r: &Runs| {
                while let Some(e) = r.blocking(at, at.saturating_add(need)) {
                    at = e;
                    moved = true;
                }
            };
            if def.is_none() {
                skip(&self.before);
            }
            for &s in &sets {
                skip(&self.runs[s as usize]);
            }
            if !moved {
                break;
            }
        }
        self.scratch = sets;
        at
    }
}

/// The updates `(target, value)` whose value may be stored over its target: the target
/// lives the whole step, the value fits in it, no other update takes the same value, and
/// every read of the target happens before the value's producer starts (so the producer and
/// everything after it may overwrite it), or the producer itself is the last reader and
/// reads the target (or a view of it) only as the input that the value replaces in one of
/// its declared in-place pairs (`Op::in_place_pairs`: AdamW's parameter and moments). The
/// runtime then has nothing to copy for that update. `views` is the program's
/// [`view_sources`].
///
/// A value that only reshapes a computed value read by nothing else (a chain of `Reshape` /
/// `Identity`, e.g. a parameter unpacked from a gathered bucket by a `Slice`) is judged by
/// the chain's head: when the head's producer may write over the target, the whole chain lies
/// in the target's bytes and no step of it copies. The result names every value that does:
/// `(target, value)` for the update's value and each member of its chain.
pub(crate) fn in_place_updates(
    p: &Program,
    hb: &HappensBefore,
    lives: &[Life],
    views: &[ValueId],
) -> Vec<(ValueId, ValueId)> {
    let mut uses = vec![0usize; p.values.len()];
    for u in &p.updates {
        uses[u.value.index()] += 1;
    }
    let users = p.users();
    let escaping = p.escaping_values();
    // the update value's chain: itself, then back through single-use reshapes to the head
    let chain = |v: ValueId| -> Vec<ValueId> {
        let mut c = vec![v];
        loop {
            let cur = *c.last().expect("the chain starts with the value");
            let ValueDef::Node { node, .. } = p.value(cur).def else {
                break;
            };
            let n = &p.nodes[node.index()];
            let ([x], true) = (n.inputs.as_slice(), n.op.is_view()) else {
                break;
            };
            let x = *x;
            let head_like = matches!(p.value(x).def, ValueDef::Node { .. })
                && users[x.index()] == [node]
                && uses[x.index()] == 0
                && !escaping[x.index()]
                && p.ty(x).dtype == p.ty(cur).dtype
                && value_bytes(p, x) == value_bytes(p, cur);
            if !head_like {
                break;
            }
            c.push(x);
        }
        c
    };
    // whether producer `d` reads the target `t` only as the input its result `v` replaces
    let replaces = |d: usize, t: ValueId, v: ValueId| -> bool {
        let node = &p.nodes[d];
        let Some(j) = node.outputs.iter().position(|&o| o == v) else {
            return false;
        };
        let mut reads = node
            .inputs
            .iter()
            .enumerate()
            .filter(|(_, &x)| views[x.index()] == views[t.index()]);
        match (reads.next(), reads.next()) {
            (Some((i, _)), None) => node.op.in_place_pairs().contains(&(i, j)),
            _ => false,
        }
    };
    p.updates
        .iter()
        .filter_map(|u| {
            let c = chain(u.value);
            let ok = |head: ValueId| {
                let (t, v) = (&lives[u.target.index()], &lives[head.index()]);
                let Some(d) = v.def else { return false };
                let seen = hb.seen_before(NodeId(d as u32));
                let own = hb.stream_of(NodeId(d as u32));
                let read_before = t.last.iter().zip(seen).all(|(&l, s)| l <= s);
                // on the producer's stream, its own position (seen + 1) may be the last read
                let read_by_producer = || {
                    t.last
                        .iter()
                        .zip(seen)
                        .enumerate()
                        .all(|(x, (&l, s))| l <= s || (x == own && l == s + 1))
                        && value_bytes(p, head) == value_bytes(p, u.target)
                        && replaces(d, u.target, head)
                };
                t.whole_step
                    && !v.whole_step
                    && uses[u.value.index()] == 1
                    && u.target != u.value
                    && value_bytes(p, head) <= value_bytes(p, u.target)
                    && (read_before || read_by_producer())
            };
            // the longest chain whose head may be written over the target (else none); a head
            // other than the value itself must be no view (its bytes are its own to place)
            (0..c.len())
                .rev()
                .find(|&k| (k == 0 || views[c[k].index()] == c[k]) && ok(c[k]))
                .map(|k| c[..=k].iter().map(|&v| (u.target, v)).collect::<Vec<_>>())
        })
        .flatten()
        .collect()
}

/// Plans the arena of a (scheduled) program. `kinds` labels each buffer; `persistent` marks
/// values that live for the whole step (see [`default_persistent`]). Deterministic; never
/// panics on a verified program.
pub fn plan_memory(
    p: &Program,
    kinds: &dyn Fn(ValueId) -> BufferKind,
    persistent: &dyn Fn(ValueId) -> bool,
) -> MemoryPlan {
    let hb = HappensBefore::new(p);
    let lives = lives(p, &hb, persistent, true);
    let sizes: Vec<u64> = (0..p.values.len())
        .map(|i| value_bytes(p, ValueId(i as u32)))
        .collect();
    let mut offset: Vec<u64> = vec![0; p.values.len()];

    // Persistent buffers at the bottom, in value order.
    let mut base: u64 = 0;
    for (i, l) in lives.iter().enumerate() {
        if l.whole_step && sizes[i] > 0 {
            offset[i] = base;
            base = base.saturating_add(align_up(sizes[i]));
        }
    }

    // The others, greedily (largest first, see the first-fit loop below).
    let mut aliased = vec![false; p.values.len()];
    // Reshapes and identities share their input's buffer: the class of a view root lives
    // from the root's producer to the last use of any of its views (and to the end of the
    // step if one of them is an output).
    let pairs = view_pairs(p);
    let roots = view_roots(p, &pairs);
    let mut lives = lives;
    merge_view_lives(&mut lives, &roots, &mut aliased);
    // Update values that can be written over their target (it is not read any more, views
    // included) take its bytes: a re-gathered parameter shard needs no second copy at the end
    // of the step.
    for (t, v) in in_place_updates(p, &hb, &lives, &sources_of(p, &pairs)) {
        offset[v.index()] = offset[t.index()];
        aliased[v.index()] = true;
    }
    let transient: Vec<usize> = (0..p.values.len())
        .filter(|&i| !lives[i].whole_step && sizes[i] > 0 && !aliased[i])
        .collect();
    let start = |i: usize| lives[i].def.map_or(-1, |d| d as i64);
    // First fit: each buffer goes at the lowest offset where it overlaps no placed buffer it
    // conflicts with. A placed buffer `a` conflicts with `b` exactly when the later-issued
    // one's producer lies in the earlier one's window on its stream (see `windows`), or both
    // were produced before the step; `Occupancy` answers that without visiting every placed
    // buffer that may be live together with `b` (saved activations make that set grow with
    // the layers). Two orders, the smaller arena kept (the first on a tie): largest first,
    // and in the order the buffers are produced (which packs a step whose buffers come in
    // many sizes, as bf16 activations beside f32 gradients do, more tightly).
    let wins = windows(&hb, &lives);
    let place = |order: &[usize]| -> (Vec<(usize, u64)>, u64) {
        let mut occ = Occupancy::new(stream_lens(&hb));
        let mut placed = Vec::with_capacity(order.len());
        let mut top = base;
        for &b in order {
            let need = align_up(sizes[b]);
            let def = def_slot(&hb, &lives[b]);
            let at = occ.first_fit(&wins[b], def, base, need);
            occ.insert(&wins[b], def, at, at.saturating_add(need));
            top = top.max(at.saturating_add(need));
            placed.push((b, at));
        }
        (placed, top)
    };
    let mut by_size = transient.clone();
    by_size.sort_by_key(|&i| (std::cmp::Reverse(align_up(sizes[i])), start(i), i));
    let mut by_start = transient;
    by_start.sort_by_key(|&i| (start(i), std::cmp::Reverse(align_up(sizes[i])), i));
    let (a, top_a) = place(&by_size);
    let (b, top_b) = place(&by_start);
    for (i, at) in if top_b < top_a { b } else { a } {
        offset[i] = at;
    }
    // (persistent roots were placed first, transient ones just now)
    for (i, r) in roots.iter().enumerate() {
        if r.index() != i {
            offset[i] = offset[r.index()];
        }
    }

    let buffers: Vec<Buffer> = (0..p.values.len())
        .filter(|&i| sizes[i] > 0)
        .map(|i| Buffer {
            value: ValueId(i as u32),
            offset: offset[i],
            bytes: sizes[i],
            kind: kinds(ValueId(i as u32)),
        })
        .collect();
    let arena_bytes = buffers
        .iter()
        .map(|b| b.offset.saturating_add(align_up(b.bytes)))
        .max()
        .unwrap_or(0);

    let (timeline, peak_index, peak_bytes, peak_by_kind) =
        peaks(p, &buffers, &lives, &aliased, &roots);
    MemoryPlan {
        buffers,
        arena_bytes,
        peak_bytes,
        peak_index,
        peak_by_kind,
        timeline,
    }
}

/// Merges each view's life into its root's (the root lives to the last use of any of its
/// views, and to the end of the step if one of them is an output) and marks the views as
/// aliased (they take no bytes of their own).
fn merge_view_lives(lives: &mut [Life], roots: &[ValueId], aliased: &mut [bool]) {
    for i in 0..lives.len() {
        let r = roots[i].index();
        if r == i {
            continue;
        }
        aliased[i] = true;
        let (m, l) = (lives[i].clone(), &mut lives[r]);
        for (a, b) in l.last.iter_mut().zip(m.last) {
            *a = (*a).max(b);
        }
        l.last_issue = match (l.last_issue, m.last_issue) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        l.to_end |= m.to_end;
    }
}

/// The live bytes per issue position (a buffer is live from its producer, or the start, to
/// its last use, or the end of the step), the position and bytes of the peak, and the
/// bytes live at the peak by kind.
#[allow(clippy::type_complexity)]
fn peaks(
    p: &Program,
    buffers: &[Buffer],
    lives: &[Life],
    aliased: &[bool],
    roots: &[ValueId],
) -> (
    Vec<(usize, u64)>,
    Option<usize>,
    u64,
    BTreeMap<BufferKind, u64>,
) {
    let n = p.nodes.len();
    let interval = |i: usize| -> Option<(usize, usize)> {
        let l = &lives[i];
        if n == 0 {
            return None;
        }
        if l.whole_step {
            return Some((0, n - 1));
        }
        match l.def {
            Some(d) if l.to_end => Some((d, n - 1)),
            Some(d) => Some((d, l.last_issue.unwrap_or(d).max(d))),
            None if l.to_end => Some((0, n - 1)),
            None => l.last_issue.map(|e| (0, e)),
        }
    };
    let mut delta = vec![0i128; n + 1];
    for b in buffers.iter().filter(|b| !aliased[b.value.index()]) {
        if let Some((s, e)) = interval(b.value.index()) {
            delta[s] += b.bytes as i128;
            delta[e + 1] -= b.bytes as i128;
        }
    }
    let mut live: i128 = 0;
    let timeline: Vec<(usize, u64)> = (0..n)
        .map(|i| {
            live += delta[i];
            (i, live.clamp(0, u64::MAX as i128) as u64)
        })
        .collect();
    let mut peak_index = None;
    let mut peak_bytes = 0;
    for &(i, b) in &timeline {
        if peak_index.is_none() || b > peak_bytes {
            peak_index = Some(i);
            peak_bytes = b;
        }
    }
    // At the peak, a class's bytes hold its latest in-place result produced by then, if any
    // (e.g. a gradient scattered over an activation is counted as a gradient), else its root.
    // (per root value: the producer index and kind of that in-place result)
    let mut in_place_at_peak: Vec<Option<(usize, BufferKind)>> = vec![None; p.values.len()];
    if let Some(peak) = peak_index {
        for b in buffers.iter().filter(|b| aliased[b.value.index()]) {
            let i = b.value.index();
            let Some(d) = lives[i].def else { continue };
            // views (reshapes, transposed operands) keep their root's kind
            let in_place = !p.nodes[d].op.in_place_pairs().is_empty();
            let held = &mut in_place_at_peak[roots[i].index()];
            if in_place && d <= peak && held.is_none_or(|(e, _)| d > e) {
                *held = Some((d, b.kind));
            }
        }
    }
    let mut peak_by_kind = BTreeMap::new();
    for b in buffers.iter().filter(|b| !aliased[b.value.index()]) {
        let at_peak = match peak_index {
            Some(k) => interval(b.value.index()).is_some_and(|(s, e)| s <= k && k <= e),
            None => true,
        };
        if at_peak {
            let kind = in_place_at_peak[b.value.index()].map_or(b.kind, |(_, k)| k);
            *peak_by_kind.entry(kind).or_insert(0u64) += b.bytes;
        }
    }
    if peak_index.is_none() {
        peak_bytes = peak_by_kind
            .values()
            .fold(0u64, |a, &b| a.saturating_add(b));
    }
    (timeline, peak_index, peak_bytes, peak_by_kind)
}

/// The usual persistence: parameters, constants, states and inputs (materialized before the
/// step). The new values of updates are not persistent: they live from their producer to the
/// end of the step (when the runtime applies them), or take their target's bytes when the
/// target is no longer read (see [`plan_memory`]).
pub fn default_persistent(p: &Program) -> impl Fn(ValueId) -> bool + '_ {
    move |v| {
        matches!(
            p.values.get(v.index()).map(|x| x.def),
            Some(ValueDef::Input | ValueDef::Param | ValueDef::Const | ValueDef::State)
        )
    }
}

/// A kind from what the program says: parameters, inputs, states (optimizer states),
/// collective results (communication buffers), other node outputs (activations), constants
/// (other). Passes that know more (gradients) pass their own.
pub fn default_kind(p: &Program) -> impl Fn(ValueId) -> BufferKind + '_ {
    move |v| match p.values.get(v.index()).map(|x| x.def) {
        Some(ValueDef::Param) => BufferKind::Param,
        Some(ValueDef::Input) => BufferKind::Input,
        Some(ValueDef::State) => BufferKind::OptimState,
        Some(ValueDef::Node { node, .. }) => match p.nodes.get(node.index()) {
            Some(n) if n.op.is_collective() => BufferKind::CommBuffer,
            _ => BufferKind::Activation,
        },
        _ => BufferKind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*: a small deterministic generator for the random cases below.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
        }
    }

    type Win = [(u32, u32); NUM_STREAMS];
    type Def = Option<(usize, u32)>;

    /// A random buffer: windows on each stream, producer (or none), and a size in lines.
    fn item(r: &mut Rng, len: [usize; NUM_STREAMS]) -> (Win, Def, u64) {
        let def = if r.below(10) == 0 {
            None
        } else {
            let t = r.below(NUM_STREAMS as u64) as usize;
            Some((t, r.below(len[t] as u64) as u32))
        };
        let win = std::array::from_fn(|t| {
            let lo = r.below(len[t] as u64 + 1) as u32;
            // mostly short windows, some long ones (saved activations)
            let span = if r.below(5) == 0 { len[t] as u64 } else { 4 };
            let hi = (lo as u64 + r.below(span + 1)).min(len[t] as u64) as u32;
            (lo, hi)
        });
        (win, def, 1 + r.below(6))
    }

    fn covers(w: &Win, def: Def) -> bool {
        def.is_some_and(|(t, k)| w[t].0 <= k && k < w[t].1)
    }

    /// The relation `Occupancy` indexes: one produced in the other's window, or both before.
    fn conflict(a: &(Win, Def), b: &(Win, Def)) -> bool {
        covers(&a.0, b.1) || covers(&b.0, a.1) || (a.1.is_none() && b.1.is_none())
    }

    #[test]
    fn runs_merge_touching_and_overlapping_ranges() {
        let mut r = Runs::default();
        for (s, e) in [(10, 20), (30, 40), (20, 25), (50, 60), (35, 52), (0, 5)] {
            r.insert(s, e);
        }
        assert_eq!(r.0, vec![(0, 5), (10, 25), (30, 60)]);
        assert_eq!(r.blocking(5, 10), None);
        assert_eq!(r.blocking(4, 10), Some(5));
        assert_eq!(r.blocking(25, 31), Some(60));
        assert_eq!(r.blocking(60, 100), None);
    }

    #[test]
    fn occupancy_first_fit_matches_a_scan_of_every_conflicting_buffer() {
        for seed in 1..40u64 {
            let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let len = [
                1 + r.below(70) as usize,
                r.below(20) as usize,
                1 + r.below(20) as usize,
            ];
            let mut occ = Occupancy::new(len);
            let mut placed: Vec<((Win, Def), u64, u64)> = Vec::new();
            for _ in 0..150 {
                let (win, def, lines) = item(&mut r, len);
                let (base, need) = (64 * r.below(3), 64 * lines);
                let got = occ.first_fit(&win, def, base, need);
                let mut cands: Vec<(u64, u64)> = placed
                    .iter()
                    .filter(|(a, _, _)| conflict(a, &(win, def)))
                    .map(|&(_, o, e)| (o, e))
                    .collect();
                cands.sort_unstable();
                let mut want = base;
                for (o, e) in cands {
                    if o >= want + need {
                        break;
                    }
                    want = want.max(e);
                }
                assert_eq!(got, want, "seed {seed}, after {} buffers", placed.len());
                occ.insert(&win, def, got, got + need);
                placed.push(((win, def), got, got + need));
            }
        }
    }

    #[test]
    fn window_index_finds_exactly_the_covering_buffers_that_share_bytes() {
        for seed in 1..40u64 {
            let mut r = Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) + 7);
            let len = [1 + r.below(60) as usize, 1 + r.below(9) as usize, 0];
            let items: Vec<(Win, Def, u64, u64)> = (0..120)
                .map(|_| {
                    let (win, def, lines) = item(&mut r, len);
                    let o = 64 * r.below(40);
                    (win, def, o, o + 64 * lines)
                })
                .collect();
            let index = WindowIndex::new(
                len,
                items
                    .iter()
                    .enumerate()
                    .map(|(i, &(w, d, o, e))| (i as u32, w, d, o, e)),
            );
            for &(_, def, o, e) in &items {
                let mut got = Vec::new();
                index.overlapping(def, o, e, |i| got.push(i));
                got.sort_unstable();
                let want: Vec<u32> = (0..items.len() as u32)
                    .filter(|&i| {
                        let (w, d, bo, be) = items[i as usize];
                        match def {
                            None => d.is_none(),
                            Some(_) => covers(&w, def) && bo < e && o < be,
                        }
                    })
                    .collect();
                assert_eq!(got, want, "seed {seed}");
            }
        }
    }
}
