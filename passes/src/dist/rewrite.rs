//! Collective rewriting: equality saturation with `egg` on local regions of a per-rank
//! (SPMD) program, extraction by the cost model.
//!
//! The pass runs after collective insertion and before scheduling. It works on any program
//! (collectives anywhere) in two stages:
//!
//! 1. **Bucketing.** Collectives of one kind on one group (same axis, reduce op, dtype and
//!    stream) whose node names share a *bucket key* (the name up to its first `/`, e.g.
//!    `gather` for `gather/wte/AllGather`) are packed greedily, in program order, into
//!    buckets of at most [`RewriteOptions::bucket_bytes`]. A bucket flattens and concatenates
//!    its inputs, runs one collective and slices the results back out (for an AllGather the
//!    gathered buffer interleaves per rank: it is viewed as `[group_size, total]` and each
//!    member takes its columns). A collective joins a bucket only if no member's result is
//!    used before every member's input exists (so fusing never creates a cycle), and a bucket
//!    is kept only if the cost model says the fused form is cheaper.
//! 2. **Equality saturation on local regions.** A region is a collective plus the
//!    collectives, casts and views (Reshape, Slice, Transpose, Concat, zero Fill, Identity)
//!    connected to it whose values do not escape it, at most
//!    [`RewriteOptions::max_region_nodes`] nodes. Each region becomes an e-graph over the
//!    region's inputs; rules add equal forms; the cheapest form under the cost model is
//!    extracted and replaces the region when it is cheaper than the original. Identical
//!    regions (same ops, shapes and groups: every layer of a transformer) are solved once.
//!
//! Rules (all exact unless noted), with `ChunkSwap(k, n1, n2)` = view dim `k` as
//! `[n1, n2, rest]` and swap the first two (lowered to Reshape, Transpose, Reshape):
//! - `decompose`: `AllGather[a,b..](x) = AllGather[a](AllGather[b..](x))` and
//!   `ReduceScatter[a,b..](x) = ReduceScatter[b..](ReduceScatter[a](x))` (the first listed
//!   axis is the most significant digit of [`Mesh::group_index`], so it is gathered last and
//!   scattered first);
//! - `reorder_axes`: `AllGather[a,R](x) = ChunkSwap(n_R, n_a)(AllGather[R,a](x))` and
//!   `ReduceScatter[a,R](x) = ReduceScatter[R,a](ChunkSwap(n_a, n_R)(x))`, so the slow axis
//!   can run on the small end of the collective;
//! - `hierarchical_allreduce`: `AllReduce[G](x) = AllGather[H](AllReduce[G\H](
//!   ReduceScatter[H](x)))` for `H` the innermost axes of `G` (flattening and zero-padding
//!   when no dim divides);
//! - `rs_ag`: `AllGather[G,k](ReduceScatter[G,k](x)) = AllReduce[G](x)`, both ways;
//! - `cast_past_collective`, `cast_past_view`, `cast_past_concat`: a Cast commutes with
//!   AllGather, AllToAll, Broadcast and views (so a narrowing cast can go before the wire and
//!   a widening one after it); `cast_fold`: `Cast[a](Cast[b](x:a)) = x` when `b` holds `a`;
//! - `reduce_dtype` (only with [`RewriteOptions::reduce_dtype`], not exact: the sum rounds
//!   in that dtype): `ReduceScatter/AllReduce(x:f32) = Cast[f32](op(Cast[bf16](x)))`;
//! - `drop_trivial`: a collective over a group of size 1, a Cast to the same dtype, a
//!   Reshape to the same shape are their input; `reshape_fold`: nested Reshapes.
//!
//! Cost: a collective costs the cheapest single-communicator algorithm of
//! [`CostModel::collective_time`] (ring, or tree for AllReduce and Broadcast): the
//! hierarchical algorithm is what `decompose` spells out, so it is not credited to one op.
//! Other ops cost their roofline time; every op that does work also costs [`OP_OVERHEAD_S`]
//! (so among equal-time forms the one with fewer ops wins).
//!
//! The result keeps the original streams of untouched nodes; new collectives go on the
//! all-gather stream (AllGather) or the reduce-scatter stream (the others), like
//! [`crate::dist::streams::assign_streams`]; everything else computes. RecordEvent/WaitEvent nodes
//! of the input are dropped and, if there were any, events are inserted again with
//! [`crate::dist::streams::insert_events`]. Nodes keep a topological order close to the original
//! (new nodes go where their region was, or as early as their inputs allow).

use crate::cost::cluster::ClusterSpec;
use crate::cost::{Algorithm, CollectiveKind, CostModel};
use crate::dist::streams::stream_for;
use egg::{Analysis, CostFunction, DidMerge, EGraph, Extractor, Id, Language};
use hzp_ir::{
    DType, Group, Mesh, Node, Op, Param, Program, ReduceOp, Role, StreamKind, TensorType, ValueDef,
    ValueId,
};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::fmt;

/// Seconds charged to every op that does work, on top of its modelled time.
pub const OP_OVERHEAD_S: f64 = 1e-9;

/// What the pass may do.
#[derive(Clone, Debug, PartialEq)]
pub struct RewriteOptions {
    /// Largest bucket of fused collectives, bytes (the larger of a collective's input and
    /// output); 0 turns bucketing off. Default 64 MiB.
    pub bucket_bytes: u64,
    /// Reduce in this dtype on the wire (e.g. bf16): lets casts move across ReduceScatter
    /// and AllReduce, which changes the rounding of the sum. `None` (default): exact.
    pub reduce_dtype: Option<DType>,
    /// Hierarchical decomposition of collectives over several axes.
    pub decompose: bool,
    /// Moving casts across data-movement collectives (exact).
    pub cast_placement: bool,
    /// Largest region (nodes of the program) given to one e-graph.
    pub max_region_nodes: usize,
    /// Saturation stops when an e-graph has this many e-nodes...
    pub egraph_node_limit: usize,
    /// ...or after this many rounds of rule application.
    pub iter_limit: usize,
}

impl Default for RewriteOptions {
    fn default() -> Self {
        RewriteOptions {
            bucket_bytes: 64 << 20,
            reduce_dtype: None,
            decompose: true,
            cast_placement: true,
            max_region_nodes: 48,
            egraph_node_limit: 4000,
            iter_limit: 8,
        }
    }
}

/// Communication of a program as the cost model sees it (per rank, one step).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Traffic {
    pub collectives: usize,
    /// Sum of the collectives' times, seconds (no overlap).
    pub seconds: f64,
    /// Bytes one rank sends per link class, in the mesh's order of link classes.
    pub bytes_per_link: Vec<(String, f64)>,
}

/// What the pass did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RewriteReport {
    pub before: Traffic,
    pub after: Traffic,
    /// Buckets formed and the collectives they absorbed.
    pub buckets: usize,
    pub bucketed_collectives: usize,
    /// Regions given to an e-graph, how many were replaced, how many distinct ones were
    /// solved (the rest reused a solution).
    pub regions: usize,
    pub regions_changed: usize,
    pub regions_solved: usize,
    /// Per rule: how many e-nodes it created that the extracted result uses (bucketing counts
    /// as `bucket`).
    pub rules: BTreeMap<String, usize>,
    /// Whether the input had events (they were dropped and inserted again).
    pub events_reinserted: bool,
}

impl RewriteReport {
    pub fn rule(&self, name: &str) -> usize {
        self.rules.get(name).copied().unwrap_or(0)
    }
}

fn fmt_traffic(f: &mut fmt::Formatter<'_>, t: &Traffic) -> fmt::Result {
    write!(
        f,
        "{} collectives, {:.3} ms",
        t.collectives,
        t.seconds * 1e3
    )?;
    for (l, b) in &t.bytes_per_link {
        write!(f, ", {l} {}", hzp_ir::format_bytes(*b as u64))?;
    }
    Ok(())
}

impl fmt::Display for RewriteReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("collective rewriting\n  before: ")?;
        fmt_traffic(f, &self.before)?;
        f.write_str("\n  after:  ")?;
        fmt_traffic(f, &self.after)?;
        writeln!(
            f,
            "\n  buckets: {} ({} collectives fused)",
            self.buckets, self.bucketed_collectives
        )?;
        writeln!(
            f,
            "  regions: {} ({} replaced, {} solved)",
            self.regions, self.regions_changed, self.regions_solved
        )?;
        for (r, n) in &self.rules {
            writeln!(f, "  rule {r}: {n}")?;
        }
        Ok(())
    }
}

/// Rewrites the collectives of the per-rank program `p` on `mesh` (see the module docs).
/// The result verifies and is deterministic.
pub fn rewrite_collectives(
    p: &Program,
    mesh: &Mesh,
    cluster: &ClusterSpec,
    opts: &RewriteOptions,
) -> Result<(Program, RewriteReport), String> {
    rewrite(std::borrow::Cow::Borrowed(p), mesh, cluster, opts)
}

/// [`rewrite_collectives`] that takes the program: it is freed as soon as the first stage
/// has rebuilt it, so that a large step is not held three times over (the input, the
/// bucketed program and the one the regions are rewritten into).
pub fn rewrite_collectives_owned(
    p: Program,
    mesh: &Mesh,
    cluster: &ClusterSpec,
    opts: &RewriteOptions,
) -> Result<(Program, RewriteReport), String> {
    rewrite(std::borrow::Cow::Owned(p), mesh, cluster, opts)
}

fn rewrite(
    p: std::borrow::Cow<'_, Program>,
    mesh: &Mesh,
    cluster: &ClusterSpec,
    opts: &RewriteOptions,
) -> Result<(Program, RewriteReport), String> {
    if let Some(pm) = &p.mesh {
        if pm != mesh {
            return Err(format!(
                "collective rewriting: the program's mesh is {pm}, but the pass was given {mesh}"
            ));
        }
    }
    if let Some(d) = opts.reduce_dtype {
        if !d.is_float() {
            return Err(format!(
                "collective rewriting: reduce dtype {d} is not a floating-point type"
            ));
        }
    }
    hzp_ir::verify(&p).map_err(|e| format!("collective rewriting: the input program: {e}"))?;
    let cm = CostModel::new(cluster.clone(), mesh.clone())
        .map_err(|e| format!("collective rewriting: {e}"))?;
    let coster = Coster { cm, mesh };
    let mut report = RewriteReport::default();
    let had_events = p
        .nodes
        .iter()
        .any(|n| matches!(n.op, Op::RecordEvent { .. } | Op::WaitEvent { .. }));
    report.events_reinserted = had_events;
    report.before = coster.traffic(&p);
    let mut q = if opts.bucket_bytes > 0 || had_events {
        let q = if opts.bucket_bytes > 0 {
            bucket(&p, &coster, opts, had_events, &mut report)?
        } else {
            strip_events(&p)?
        };
        drop(p);
        q
    } else {
        p.into_owned()
    };
    q = saturate_regions(&q, &coster, opts, &mut report)?;
    if had_events {
        q = crate::dist::streams::insert_events(&q);
    }
    hzp_ir::verify(&q)
        .map_err(|e| format!("collective rewriting produced an invalid program: {e}"))?;
    report.after = coster.traffic(&q);
    Ok((q, report))
}

// ---------------------------------------------------------------------------------------------
// Costs

struct Coster<'a> {
    cm: CostModel,
    mesh: &'a Mesh,
}

/// Seconds charged for a collective the cost model cannot price (never chosen).
const UNPRICEABLE_S: f64 = 1e9;

impl Coster<'_> {
    /// The cheapest single-communicator algorithm for a collective op.
    fn collective(
        &self,
        op: &Op,
        ins: &[&TensorType],
        outs: &[&TensorType],
    ) -> Option<crate::cost::CollectiveCost> {
        let kind = CollectiveKind::of(op)?;
        let group = op.group()?;
        let bytes = kind.full_bytes(ins, outs);
        let mut best: Option<crate::cost::CollectiveCost> = None;
        for alg in [Algorithm::Ring, Algorithm::Tree] {
            if !alg.supports(kind) {
                continue;
            }
            if let Ok(c) = self.cm.collective_time(kind, bytes, group, alg) {
                if best.as_ref().is_none_or(|b| c.seconds < b.seconds) {
                    best = Some(c);
                }
            }
        }
        best
    }

    /// Seconds of one op (collective or not), overhead included; views cost (almost) 0.
    fn op_seconds(&self, op: &Op, ins: &[&TensorType], out: &TensorType) -> f64 {
        if op.is_view() {
            return OP_OVERHEAD_S * 1e-3;
        }
        if op.is_collective() {
            if self.mesh.group_size(op.group().expect("collective")) == Some(1) {
                return OP_OVERHEAD_S;
            }
            return self
                .collective(op, ins, &[out])
                .map_or(UNPRICEABLE_S, |c| c.seconds + OP_OVERHEAD_S);
        }
        self.cm.compute_time(op, ins, &[out], out.dtype) + OP_OVERHEAD_S
    }

    fn traffic(&self, p: &Program) -> Traffic {
        let mut t = Traffic::default();
        let mut per_link: Vec<(String, f64)> = self
            .cm
            .group_link_classes(&Group::new(self.mesh.axes.iter().map(|a| a.name.clone())))
            .iter()
            .map(|l| (l.name.clone(), 0.0))
            .collect();
        for n in &p.nodes {
            if !n.op.is_collective() {
                continue;
            }
            t.collectives += 1;
            let ins: Vec<&TensorType> = n.inputs.iter().map(|&v| p.ty(v)).collect();
            let outs: Vec<&TensorType> = n.outputs.iter().map(|&v| p.ty(v)).collect();
            if let Some(c) = self.collective(&n.op, &ins, &outs) {
                t.seconds += c.seconds;
                for (l, b) in &c.bytes_sent_per_rank_per_link {
                    match per_link.iter_mut().find(|(x, _)| x == l) {
                        Some((_, x)) => *x += b,
                        None => per_link.push((l.clone(), *b)),
                    }
                }
            }
        }
        t.bytes_per_link = per_link;
        t
    }
}

// ---------------------------------------------------------------------------------------------
// Rebuilding programs: removed nodes, new nodes, substitutions, and a priority topological
// order.

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum VRef {
    Old(ValueId),
    New(usize),
}

struct NewNode {
    name: String,
    op: Op,
    inputs: Vec<VRef>,
    stream: StreamKind,
    role: Role,
    /// Position key: original node i has key 2i; a new node with key 2i-1 goes just before
    /// node i (or as soon after as its inputs allow).
    key: i64,
}

struct Edit<'a> {
    p: &'a Program,
    removed: Vec<bool>,
    subst: HashMap<ValueId, VRef>,
    new: Vec<NewNode>,
    /// The role of nodes added by [`Edit::push`]: that of the node(s) they stand for.
    role: Role,
    /// The names in use: `p`'s (borrowed) and those [`Edit::fresh`] handed out; built at
    /// the first `fresh` (an edit that only removes nodes needs none).
    names: Option<hzp_ir::FreshNames<'a>>,
}

impl<'a> Edit<'a> {
    fn new(p: &'a Program) -> Edit<'a> {
        Edit {
            p,
            removed: vec![false; p.nodes.len()],
            subst: HashMap::new(),
            new: Vec::new(),
            role: Role::default(),
            names: None,
        }
    }

    fn push(&mut self, base: &str, op: Op, inputs: Vec<VRef>, key: i64) -> VRef {
        let name = self.fresh(base);
        let stream = stream_for(&op);
        self.new.push(NewNode {
            name,
            op,
            inputs,
            stream,
            role: self.role.clone(),
            key,
        });
        VRef::New(self.new.len() - 1)
    }

    /// `base` if free, else `base.1`, `base.2`, ... (as [`hzp_ir::NameSet::fresh`]).
    fn fresh(&mut self, base: &str) -> String {
        let p = self.p;
        self.names
            .get_or_insert_with(|| hzp_ir::FreshNames::over(p))
            .fresh(base)
    }

    fn resolve(&self, mut r: VRef) -> Result<VRef, String> {
        for _ in 0..=self.subst.len() {
            match r {
                VRef::Old(v) => match self.subst.get(&v) {
                    Some(&n) => r = n,
                    None => return Ok(r),
                },
                VRef::New(_) => return Ok(r),
            }
        }
        Err("collective rewriting: substitutions form a cycle".into())
    }

    /// The live items (old nodes `0..nold`, new nodes after them) in a topological order
    /// that follows their keys.
    fn order(&self) -> Result<Vec<usize>, String> {
        let p = self.p;
        let nold = p.nodes.len();
        // Items: old nodes 0..nold, new nodes nold..
        let total = nold + self.new.len();
        let key = |i: usize| -> (i64, usize) {
            if i < nold {
                (2 * i as i64, i)
            } else {
                (self.new[i - nold].key, i)
            }
        };
        let producer = |r: VRef| -> Result<Option<usize>, String> {
            match self.resolve(r)? {
                VRef::Old(v) => match p.producer(v) {
                    Some(n) if self.removed[n.index()] => Err(format!(
                        "collective rewriting: value `{}` lost its producer",
                        p.value(v).name
                    )),
                    Some(n) => Ok(Some(n.index())),
                    None => Ok(None),
                },
                VRef::New(k) => Ok(Some(nold + k)),
            }
        };
        let mut indeg = vec![0usize; total];
        let mut users: Vec<Vec<usize>> = vec![Vec::new(); total];
        let mut live = vec![false; total];
        for (i, l) in live.iter_mut().enumerate() {
            *l = i >= nold || !self.removed[i];
        }
        for i in 0..total {
            if !live[i] {
                continue;
            }
            let ins: Vec<VRef> = if i < nold {
                p.nodes[i].inputs.iter().map(|&v| VRef::Old(v)).collect()
            } else {
                self.new[i - nold].inputs.clone()
            };
            let mut seen = HashSet::new();
            for r in ins {
                if let Some(src) = producer(r)? {
                    if seen.insert(src) {
                        indeg[i] += 1;
                        users[src].push(i);
                    }
                }
            }
        }
        let mut heap: BinaryHeap<Reverse<(i64, usize)>> = (0..total)
            .filter(|&i| live[i] && indeg[i] == 0)
            .map(|i| Reverse(key(i)))
            .collect();
        let mut order = Vec::with_capacity(total);
        while let Some(Reverse((_, i))) = heap.pop() {
            order.push(i);
            for &u in &users[i] {
                indeg[u] -= 1;
                if indeg[u] == 0 {
                    heap.push(Reverse(key(u)));
                }
            }
        }
        let nlive = live.iter().filter(|&&l| l).count();
        if order.len() != nlive {
            return Err("collective rewriting: the rewritten program has a cycle".into());
        }
        Ok(order)
    }

    /// The program with the edits applied, nodes in a topological order that follows the
    /// keys.
    fn finish(self) -> Result<Program, String> {
        let p = self.p;
        let nold = p.nodes.len();
        let order = self.order()?;
        let (mut q, mut vmap) = declarations_of(p);
        let base = vmap.clone();
        let m = |v: &ValueId| base[v.index()].expect("non-node value");
        let mut newv: Vec<Option<ValueId>> = vec![None; self.new.len()];
        let get = |r: VRef,
                   vmap: &Vec<Option<ValueId>>,
                   newv: &Vec<Option<ValueId>>|
         -> Result<ValueId, String> {
            match self.resolve(r)? {
                VRef::Old(v) => vmap[v.index()],
                VRef::New(k) => newv[k],
            }
            .ok_or_else(|| "collective rewriting: a value is used before it is defined".into())
        };
        for i in order {
            if i < nold {
                let n: &Node = &p.nodes[i];
                let ins = n
                    .inputs
                    .iter()
                    .map(|&v| get(VRef::Old(v), &vmap, &newv))
                    .collect::<Result<Vec<_>, _>>()?;
                let outs = n.outputs.iter().map(|&o| p.value(o).name.clone()).collect();
                let new = q.add_node(n.name.clone(), n.op.clone(), ins, outs)?;
                let added = q.nodes.last_mut().expect("just added");
                added.stream = n.stream;
                added.role = n.role.clone();
                for (&o, nv) in n.outputs.iter().zip(new) {
                    vmap[o.index()] = Some(nv);
                }
            } else {
                let n = &self.new[i - nold];
                let ins = n
                    .inputs
                    .iter()
                    .map(|&r| get(r, &vmap, &newv))
                    .collect::<Result<Vec<_>, _>>()?;
                let new = q.add_node(n.name.clone(), n.op.clone(), ins, vec![n.name.clone()])?;
                let added = q.nodes.last_mut().expect("just added");
                added.stream = n.stream;
                added.role = n.role.clone();
                newv[i - nold] = Some(new[0]);
            }
        }
        q.outputs = p
            .outputs
            .iter()
            .map(|&v| get(VRef::Old(v), &vmap, &newv))
            .collect::<Result<_, _>>()?;
        q.updates = p
            .updates
            .iter()
            .map(|u| {
                Ok(hzp_ir::Update {
                    target: m(&u.target),
                    value: get(VRef::Old(u.value), &vmap, &newv)?,
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(q)
    }
}

/// A program with `p`'s name, mesh, precision and every value that is not a node's output
/// (inputs, parameters, constants, states), and the map of those values from `p`.
fn declarations_of(p: &Program) -> (Program, Vec<Option<ValueId>>) {
    let mut q = Program::new(p.name.clone());
    q.mesh = p.mesh.clone();
    q.precision = p.precision;
    // The rewritten program is about the size of `p`: sized up front, its arenas are not
    // regrown (and copied) while it is rebuilt.
    q.values.reserve(p.values.len() + p.values.len() / 8);
    q.nodes.reserve(p.nodes.len() + p.nodes.len() / 8);
    let mut vmap: Vec<Option<ValueId>> = vec![None; p.values.len()];
    for (i, v) in p.values.iter().enumerate() {
        if !matches!(v.def, ValueDef::Node { .. }) {
            vmap[i] = Some(ValueId(q.values.len() as u32));
            q.values.push(v.clone());
        }
    }
    let base = vmap.clone();
    let m = |v: &ValueId| base[v.index()].expect("non-node value");
    q.inputs = p.inputs.iter().map(m).collect();
    q.params = p
        .params
        .iter()
        .map(|x| Param {
            value: m(&x.value),
            data: x.data.clone(),
        })
        .collect();
    q.consts = p
        .consts
        .iter()
        .map(|c| hzp_ir::Const {
            value: m(&c.value),
            data: c.data.clone(),
        })
        .collect();
    q.states = p
        .states
        .iter()
        .map(|s| hzp_ir::State {
            value: m(&s.value),
            init: s.init.clone(),
        })
        .collect();
    (q, vmap)
}

fn strip_events(p: &Program) -> Result<Program, String> {
    let mut e = Edit::new(p);
    for (i, n) in p.nodes.iter().enumerate() {
        if matches!(n.op, Op::RecordEvent { .. } | Op::WaitEvent { .. }) {
            e.removed[i] = true;
        }
    }
    e.finish()
}

// ---------------------------------------------------------------------------------------------
// Stage 1: bucketing

/// The scope a bucket's nodes are named in: its first member's name up to the first `/`
/// (names only; which collectives share a bucket is decided by their roles).
fn bucket_scope(name: &str) -> &str {
    name.split_once('/').map_or(name, |(k, _)| k)
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct BucketSig {
    /// Collectives of one role (kind and unit) may share a bucket.
    key: Role,
    kind: u8,
    group: Group,
    reduce: u8,
    dtype: DType,
    stream: StreamKind,
}

struct OpenBucket {
    members: Vec<usize>,
    bytes: u64,
    max_in: i64,
    /// The first position where a member's result is read.
    min_out: i64,
}

/// Open buckets at a time; the one idle longest is closed beyond this.
const MAX_OPEN_BUCKETS: usize = 32;

fn reduce_index(r: ReduceOp) -> u8 {
    ReduceOp::ALL
        .iter()
        .position(|&x| x == r)
        .expect("every reduce op is listed") as u8
}

fn bucket(
    p: &Program,
    coster: &Coster,
    opts: &RewriteOptions,
    strip_events: bool,
    report: &mut RewriteReport,
) -> Result<Program, String> {
    let users = p.users();
    let mut escapes = vec![false; p.values.len()];
    for &v in &p.outputs {
        escapes[v.index()] = true;
    }
    for u in &p.updates {
        escapes[u.value.index()] = true;
    }
    let def_pos = |v: ValueId| p.producer(v).map_or(-1, |n| n.index() as i64);
    let first_use = |v: ValueId| {
        if escapes[v.index()] {
            i64::MAX
        } else {
            users[v.index()]
                .first()
                .map_or(i64::MAX, |n| n.index() as i64)
        }
    };
    let mut open: BTreeMap<BucketSig, OpenBucket> = BTreeMap::new();
    let mut done: Vec<(BucketSig, OpenBucket)> = Vec::new();
    for (i, n) in p.nodes.iter().enumerate() {
        let cand = match &n.op {
            Op::AllGather { group, axis: 0 } => Some((0u8, group, 0u8)),
            Op::ReduceScatter {
                group,
                axis: 0,
                reduce,
            } => Some((1, group, reduce_index(*reduce))),
            Op::AllReduce { group, reduce } => Some((2, group, reduce_index(*reduce))),
            _ => None,
        };
        if let Some((kind, group, reduce)) = cand {
            let (x, y) = (n.inputs[0], n.outputs[0]);
            if p.ty(x).rank() > 0 || kind == 2 {
                let sig = BucketSig {
                    key: n.role.clone(),
                    kind,
                    group: group.clone(),
                    reduce,
                    dtype: p.ty(x).dtype,
                    stream: n.stream,
                };
                let bytes = p.ty(x).size_bytes().max(p.ty(y).size_bytes()) as u64;
                // Joining is safe iff the input does not depend on a member's result.
                let fits = open.get(&sig).is_some_and(|b| {
                    b.bytes + bytes <= opts.bucket_bytes && !depends_on(p, x, &b.members, b.min_out)
                });
                if fits {
                    let b = open.get_mut(&sig).expect("checked");
                    b.members.push(i);
                    b.bytes += bytes;
                    b.max_in = b.max_in.max(def_pos(x));
                    b.min_out = b.min_out.min(first_use(y));
                } else {
                    let b = OpenBucket {
                        members: vec![i],
                        bytes,
                        max_in: def_pos(x),
                        min_out: first_use(y),
                    };
                    if let Some(old) = open.insert(sig.clone(), b) {
                        done.push((sig, old));
                    }
                    if open.len() > MAX_OPEN_BUCKETS {
                        let oldest = open
                            .iter()
                            .min_by_key(|(_, b)| b.members.last().copied())
                            .map(|(s, _)| s.clone())
                            .expect("not empty");
                        let b = open.remove(&oldest).expect("present");
                        done.push((oldest, b));
                    }
                }
            }
        }
    }
    done.extend(open);
    done.retain(|(_, b)| b.members.len() >= 2);
    // Program order of the buckets' first members, for deterministic names.
    done.sort_by_key(|(_, b)| b.members[0]);
    let mut e = Edit::new(p);
    if strip_events {
        for (i, n) in p.nodes.iter().enumerate() {
            if matches!(n.op, Op::RecordEvent { .. } | Op::WaitEvent { .. }) {
                e.removed[i] = true;
            }
        }
    }
    for (_, b) in &done {
        if !bucket_pays(p, coster, &b.members) {
            continue;
        }
        let scope = format!("{}/bucket", bucket_scope(&p.nodes[b.members[0]].name));
        emit_bucket(&mut e, p, &b.members, &scope, 2 * b.max_in + 1)?;
        report.buckets += 1;
        report.bucketed_collectives += b.members.len();
        *report.rules.entry("bucket".into()).or_default() += 1;
    }
    if report.buckets == 0 && !strip_events {
        return Ok(p.clone());
    }
    e.finish()
}

/// Whether `x` depends on the result of one of `members` (sorted node positions), whose
/// results are first read at position `min_out`: a dependency path leaves a member through a
/// reader at `min_out` or later, so only producers from there on are searched.
fn depends_on(p: &Program, x: ValueId, members: &[usize], min_out: i64) -> bool {
    let mut stack = vec![x];
    let mut seen = HashSet::new();
    while let Some(v) = stack.pop() {
        let Some(n) = p.producer(v).map(|n| n.index()) else {
            continue;
        };
        if members.binary_search(&n).is_ok() {
            return true;
        }
        if (n as i64) < min_out || !seen.insert(n) {
            continue;
        }
        stack.extend(p.nodes[n].inputs.iter().copied());
    }
    false
}

fn flat_ty(t: &TensorType) -> TensorType {
    TensorType::new(t.dtype, vec![t.numel()])
}

/// Whether fusing `members` (same kind, group, dtype) is cheaper than running them one by one.
fn bucket_pays(p: &Program, coster: &Coster, members: &[usize]) -> bool {
    let mut separate = 0.0;
    let mut in_elems = 0usize;
    let mut out_elems = 0usize;
    let mut slices = 0.0;
    let first = &p.nodes[members[0]];
    let dtype = p.ty(first.inputs[0]).dtype;
    for &i in members {
        let n = &p.nodes[i];
        let (x, y) = (p.ty(n.inputs[0]), p.ty(n.outputs[0]));
        separate += coster.op_seconds(&n.op, &[x], y);
        in_elems += x.numel();
        out_elems += y.numel();
        slices += coster.op_seconds(
            &Op::Slice {
                axes: vec![0],
                starts: vec![0],
                ends: vec![y.numel() as i64],
                steps: vec![1],
            },
            &[&flat_ty(y)],
            &flat_ty(y),
        );
    }
    let xin = TensorType::new(dtype, vec![in_elems]);
    let xout = TensorType::new(dtype, vec![out_elems]);
    let concat = coster.op_seconds(&Op::Concat { axis: 0 }, &[&xin], &xin);
    let fused = coster.op_seconds(&first.op, &[&xin], &xout);
    concat + fused + slices < separate
}

fn emit_bucket(
    e: &mut Edit,
    p: &Program,
    members: &[usize],
    scope: &str,
    key: i64,
) -> Result<(), String> {
    let first = p.nodes[members[0]].op.clone();
    e.role = p.nodes[members[0]].role.clone();
    let n = p
        .mesh
        .as_ref()
        .and_then(|m| m.group_size(first.group().expect("collective")))
        .ok_or("collective rewriting: a bucket's group is not in the mesh")?;
    let ins: Vec<ValueId> = members.iter().map(|&i| p.nodes[i].inputs[0]).collect();
    let outs: Vec<ValueId> = members.iter().map(|&i| p.nodes[i].outputs[0]).collect();
    let numel: Vec<usize> = ins.iter().map(|&v| p.ty(v).numel()).collect();
    let reshape = |shape: Vec<usize>| Op::Reshape { shape };
    let slice = |axis: usize, a: usize, b: usize| Op::Slice {
        axes: vec![axis],
        starts: vec![a as i64],
        ends: vec![b as i64],
        steps: vec![1],
    };
    for &i in members {
        e.removed[i] = true;
    }
    let total: usize = numel.iter().sum();
    match first {
        Op::AllGather { .. } | Op::AllReduce { .. } => {
            let mut parts = Vec::new();
            for (k, &x) in ins.iter().enumerate() {
                parts.push(if p.ty(x).rank() == 1 {
                    VRef::Old(x)
                } else {
                    e.push(
                        &format!("{scope}/Reshape"),
                        reshape(vec![numel[k]]),
                        vec![VRef::Old(x)],
                        key,
                    )
                });
            }
            let cat = e.push(
                &format!("{scope}/Concat"),
                Op::Concat { axis: 0 },
                parts,
                key,
            );
            let coll = e.push(
                &format!("{scope}/{}", first.name()),
                first.clone(),
                vec![cat],
                key,
            );
            let is_ag = matches!(first, Op::AllGather { .. });
            let view = if is_ag {
                e.push(
                    &format!("{scope}/Reshape"),
                    reshape(vec![n, total]),
                    vec![coll],
                    key,
                )
            } else {
                coll
            };
            let axis = usize::from(is_ag);
            let mut off = 0;
            for (k, &y) in outs.iter().enumerate() {
                let s = e.push(
                    &format!("{scope}/Slice"),
                    slice(axis, off, off + numel[k]),
                    vec![view],
                    key,
                );
                off += numel[k];
                let r = e.push(
                    &format!("{scope}/Reshape"),
                    reshape(p.ty(y).shape.clone()),
                    vec![s],
                    key,
                );
                e.subst.insert(y, r);
            }
        }
        Op::ReduceScatter { .. } => {
            // Each input is [n, numel/n] in rank-chunk order: concat the chunks side by side.
            let mut parts = Vec::new();
            for (k, &x) in ins.iter().enumerate() {
                parts.push(e.push(
                    &format!("{scope}/Reshape"),
                    reshape(vec![n, numel[k] / n]),
                    vec![VRef::Old(x)],
                    key,
                ));
            }
            let cat = e.push(
                &format!("{scope}/Concat"),
                Op::Concat { axis: 1 },
                parts,
                key,
            );
            let flat = e.push(
                &format!("{scope}/Reshape"),
                reshape(vec![total]),
                vec![cat],
                key,
            );
            let coll = e.push(
                &format!("{scope}/{}", first.name()),
                first.clone(),
                vec![flat],
                key,
            );
            let mut off = 0;
            for (k, &y) in outs.iter().enumerate() {
                let len = numel[k] / n;
                let s = e.push(
                    &format!("{scope}/Slice"),
                    slice(0, off, off + len),
                    vec![coll],
                    key,
                );
                off += len;
                let r = e.push(
                    &format!("{scope}/Reshape"),
                    reshape(p.ty(y).shape.clone()),
                    vec![s],
                    key,
                );
                e.subst.insert(y, r);
            }
        }
        _ => unreachable!("only AllGather, ReduceScatter and AllReduce are bucketed"),
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Stage 2: the e-graph language

/// Ops of a region, with attributes that can be hashed and ordered.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum ROp {
    /// Input `k` of the region.
    Leaf(u32),
    Fill {
        bits: u64,
        dtype: DType,
        shape: Vec<usize>,
    },
    Cast(DType),
    Identity,
    Reshape(Vec<usize>),
    Transpose(Vec<usize>),
    Slice {
        axes: Vec<usize>,
        starts: Vec<i64>,
        ends: Vec<i64>,
        steps: Vec<i64>,
    },
    Concat(usize),
    /// View dim `axis` as `[n1, n2, rest]` and swap `n1` and `n2`.
    ChunkSwap {
        axis: usize,
        n1: usize,
        n2: usize,
    },
    AllGather {
        group: Group,
        axis: usize,
    },
    ReduceScatter {
        group: Group,
        axis: usize,
        reduce: u8,
    },
    AllReduce {
        group: Group,
        reduce: u8,
    },
    AllToAll {
        group: Group,
        split_axis: usize,
        concat_axis: usize,
    },
    Broadcast {
        group: Group,
        root: usize,
    },
}

impl ROp {
    fn from_op(op: &Op) -> Option<ROp> {
        Some(match op {
            Op::Fill {
                value,
                dtype,
                shape,
            } => ROp::Fill {
                bits: value.to_bits(),
                dtype: *dtype,
                shape: shape.clone(),
            },
            Op::Cast { to } => ROp::Cast(*to),
            Op::Identity => ROp::Identity,
            Op::Reshape { shape } => ROp::Reshape(shape.clone()),
            Op::Transpose { perm } => ROp::Transpose(perm.clone()),
            Op::Slice {
                axes,
                starts,
                ends,
                steps,
            } => ROp::Slice {
                axes: axes.clone(),
                starts: starts.clone(),
                ends: ends.clone(),
                steps: steps.clone(),
            },
            Op::Concat { axis } => ROp::Concat(*axis),
            Op::AllGather { group, axis } => ROp::AllGather {
                group: group.clone(),
                axis: *axis,
            },
            Op::ReduceScatter {
                group,
                axis,
                reduce,
            } => ROp::ReduceScatter {
                group: group.clone(),
                axis: *axis,
                reduce: reduce_index(*reduce),
            },
            Op::AllReduce { group, reduce } => ROp::AllReduce {
                group: group.clone(),
                reduce: reduce_index(*reduce),
            },
            Op::AllToAll {
                group,
                split_axis,
                concat_axis,
            } => ROp::AllToAll {
                group: group.clone(),
                split_axis: *split_axis,
                concat_axis: *concat_axis,
            },
            Op::Broadcast { group, root } => ROp::Broadcast {
                group: group.clone(),
                root: *root,
            },
            _ => return None,
        })
    }

    /// The IR op (`None` for leaves and ChunkSwap, which lowers to three ops).
    fn to_op(&self) -> Option<Op> {
        Some(match self {
            ROp::Leaf(_) | ROp::ChunkSwap { .. } => return None,
            ROp::Fill { bits, dtype, shape } => Op::Fill {
                value: f64::from_bits(*bits),
                dtype: *dtype,
                shape: shape.clone(),
            },
            ROp::Cast(d) => Op::Cast { to: *d },
            ROp::Identity => Op::Identity,
            ROp::Reshape(s) => Op::Reshape { shape: s.clone() },
            ROp::Transpose(p) => Op::Transpose { perm: p.clone() },
            ROp::Slice {
                axes,
                starts,
                ends,
                steps,
            } => Op::Slice {
                axes: axes.clone(),
                starts: starts.clone(),
                ends: ends.clone(),
                steps: steps.clone(),
            },
            ROp::Concat(a) => Op::Concat { axis: *a },
            ROp::AllGather { group, axis } => Op::AllGather {
                group: group.clone(),
                axis: *axis,
            },
            ROp::ReduceScatter {
                group,
                axis,
                reduce,
            } => Op::ReduceScatter {
                group: group.clone(),
                axis: *axis,
                reduce: ReduceOp::ALL[*reduce as usize],
            },
            ROp::AllReduce { group, reduce } => Op::AllReduce {
                group: group.clone(),
                reduce: ReduceOp::ALL[*reduce as usize],
            },
            ROp::AllToAll {
                group,
                split_axis,
                concat_axis,
            } => Op::AllToAll {
                group: group.clone(),
                split_axis: *split_axis,
                concat_axis: *concat_axis,
            },
            ROp::Broadcast { group, root } => Op::Broadcast {
                group: group.clone(),
                root: *root,
            },
        })
    }

    fn is_collective(&self) -> bool {
        matches!(
            self,
            ROp::AllGather { .. }
                | ROp::ReduceScatter { .. }
                | ROp::AllReduce { .. }
                | ROp::AllToAll { .. }
                | ROp::Broadcast { .. }
        )
    }

    fn group(&self) -> Option<&Group> {
        match self {
            ROp::AllGather { group, .. }
            | ROp::ReduceScatter { group, .. }
            | ROp::AllReduce { group, .. }
            | ROp::AllToAll { group, .. }
            | ROp::Broadcast { group, .. } => Some(group),
            _ => None,
        }
    }

    /// A view: no data moves (the cast rules may pass it).
    fn is_view(&self) -> bool {
        matches!(
            self,
            ROp::Identity
                | ROp::Reshape(_)
                | ROp::Transpose(_)
                | ROp::Slice { .. }
                | ROp::ChunkSwap { .. }
        )
    }
}

/// The ChunkSwap view: `(shape with dim axis split in three, transpose perm)`.
fn chunk_swap_view(
    shape: &[usize],
    axis: usize,
    n1: usize,
    n2: usize,
) -> Option<(Vec<usize>, Vec<usize>)> {
    let d = *shape.get(axis)?;
    if n1 == 0 || n2 == 0 || !d.is_multiple_of(n1 * n2) {
        return None;
    }
    let mut s = shape[..axis].to_vec();
    s.extend([n1, n2, d / (n1 * n2)]);
    s.extend_from_slice(&shape[axis + 1..]);
    let mut perm: Vec<usize> = (0..s.len()).collect();
    perm.swap(axis, axis + 1);
    Some((s, perm))
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct RNode {
    op: ROp,
    children: Vec<Id>,
}

impl Language for RNode {
    type Discriminant = ROp;

    fn discriminant(&self) -> ROp {
        self.op.clone()
    }

    fn matches(&self, other: &Self) -> bool {
        self.op == other.op && self.children.len() == other.children.len()
    }

    fn children(&self) -> &[Id] {
        &self.children
    }

    fn children_mut(&mut self) -> &mut [Id] {
        &mut self.children
    }
}

fn infer(op: &ROp, ins: &[&TensorType], mesh: &Mesh, leaves: &[TensorType]) -> Option<TensorType> {
    match op {
        ROp::Leaf(k) => leaves.get(*k as usize).cloned(),
        ROp::ChunkSwap { axis, n1, n2 } => {
            let [x] = ins else { return None };
            chunk_swap_view(&x.shape, *axis, *n1, *n2)?;
            Some((*x).clone())
        }
        _ => {
            let mut t = op.to_op()?.infer(ins, Some(mesh)).ok()?;
            (t.len() == 1).then(|| t.remove(0))
        }
    }
}

struct Types {
    mesh: Mesh,
    leaves: Vec<TensorType>,
}

impl Analysis<RNode> for Types {
    type Data = Option<TensorType>;

    fn make(eg: &mut EGraph<RNode, Self>, n: &RNode, _id: Id) -> Option<TensorType> {
        let tys: Vec<TensorType> = n
            .children
            .iter()
            .map(|&c| eg[c].data.clone())
            .collect::<Option<_>>()?;
        let refs: Vec<&TensorType> = tys.iter().collect();
        infer(&n.op, &refs, &eg.analysis.mesh, &eg.analysis.leaves)
    }

    fn merge(&mut self, a: &mut Self::Data, b: Self::Data) -> DidMerge {
        if a.is_none() && b.is_some() {
            *a = b;
            DidMerge(true, false)
        } else {
            DidMerge(false, a != &b)
        }
    }
}

type EG = EGraph<RNode, Types>;

fn node_seconds(coster: &Coster, op: &ROp, ins: &[&TensorType], out: &TensorType) -> f64 {
    match op {
        ROp::Leaf(_) => 0.0,
        ROp::ChunkSwap { .. } => {
            // a transpose copy
            let perm: Vec<usize> = (0..out.rank()).collect();
            coster.op_seconds(&Op::Transpose { perm }, ins, out)
        }
        _ => coster.op_seconds(&op.to_op().expect("not a leaf"), ins, out),
    }
}

struct Cost<'a, 'b> {
    eg: &'a EG,
    coster: &'a Coster<'b>,
}

impl CostFunction<RNode> for Cost<'_, '_> {
    type Cost = f64;

    fn cost<C: FnMut(Id) -> f64>(&mut self, n: &RNode, mut costs: C) -> f64 {
        let tys: Vec<&TensorType> = n
            .children
            .iter()
            .filter_map(|&c| self.eg[c].data.as_ref())
            .collect();
        let own = if tys.len() == n.children.len() {
            let a = &self.eg.analysis;
            infer(&n.op, &tys, &a.mesh, &a.leaves).map_or(UNPRICEABLE_S, |out| {
                node_seconds(self.coster, &n.op, &tys, &out)
            })
        } else {
            UNPRICEABLE_S
        };
        n.children.iter().fold(own, |acc, &c| acc + costs(c))
    }
}

// ---------------------------------------------------------------------------------------------
// Stage 2: regions

struct Region {
    /// Node indices, in program order.
    nodes: Vec<usize>,
    leaves: Vec<ValueId>,
    /// Values of region nodes read outside the region (or program outputs / updates).
    roots: Vec<ValueId>,
}

fn find_regions(p: &Program, opts: &RewriteOptions) -> Vec<Region> {
    let users = p.users();
    let mut escapes = vec![false; p.values.len()];
    for &v in &p.outputs {
        escapes[v.index()] = true;
    }
    for u in &p.updates {
        escapes[u.value.index()] = true;
    }
    let ok: Vec<bool> = p
        .nodes
        .iter()
        .map(|n| n.outputs.len() == 1 && ROp::from_op(&n.op).is_some())
        .collect();
    let cap = opts.max_region_nodes.max(1);
    let mut assigned = vec![false; p.nodes.len()];
    let mut regions = Vec::new();
    for seed in 0..p.nodes.len() {
        if assigned[seed] || !ok[seed] || !p.nodes[seed].op.is_collective() {
            continue;
        }
        let mut set: std::collections::BTreeSet<usize> = [seed].into();
        let mut changed = true;
        while changed && set.len() < cap {
            changed = false;
            let snapshot: Vec<usize> = set.iter().copied().collect();
            for &j in &snapshot {
                for &v in &p.nodes[j].inputs {
                    let Some(q) = p.producer(v).map(|q| q.index()) else {
                        continue;
                    };
                    if set.len() >= cap || set.contains(&q) || assigned[q] || !ok[q] {
                        continue;
                    }
                    let out = p.nodes[q].outputs[0];
                    if escapes[out.index()]
                        || !users[out.index()].iter().all(|u| set.contains(&u.index()))
                    {
                        continue;
                    }
                    set.insert(q);
                    changed = true;
                }
                for &o in &p.nodes[j].outputs {
                    for u in &users[o.index()] {
                        let u = u.index();
                        if set.len() >= cap || set.contains(&u) || assigned[u] || !ok[u] {
                            continue;
                        }
                        let inside = p.nodes[u]
                            .inputs
                            .iter()
                            .all(|&v| p.producer(v).is_some_and(|q| set.contains(&q.index())));
                        if inside {
                            set.insert(u);
                            changed = true;
                        }
                    }
                }
            }
        }
        let nodes: Vec<usize> = set.into_iter().collect();
        let in_set: HashSet<usize> = nodes.iter().copied().collect();
        let mut leaves = Vec::new();
        let mut roots = Vec::new();
        for &j in &nodes {
            assigned[j] = true;
            for &v in &p.nodes[j].inputs {
                let inside = p.producer(v).is_some_and(|q| in_set.contains(&q.index()));
                if !inside && !leaves.contains(&v) {
                    leaves.push(v);
                }
            }
            let o = p.nodes[j].outputs[0];
            if escapes[o.index()]
                || users[o.index()]
                    .iter()
                    .any(|u| !in_set.contains(&u.index()))
            {
                roots.push(o);
            }
        }
        regions.push(Region {
            nodes,
            leaves,
            roots,
        });
    }
    regions
}

/// A region up to renaming: what the e-graph sees. Refs below `leaves.len()` are leaves,
/// the others region nodes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct RegionKey {
    nodes: Vec<(ROp, Vec<u32>)>,
    leaves: Vec<TensorType>,
    roots: Vec<u32>,
}

fn region_key(p: &Program, r: &Region) -> RegionKey {
    let nl = r.leaves.len() as u32;
    let pos: HashMap<ValueId, u32> = r
        .nodes
        .iter()
        .enumerate()
        .map(|(k, &j)| (p.nodes[j].outputs[0], nl + k as u32))
        .collect();
    let refer = |v: &ValueId| {
        pos.get(v).copied().unwrap_or_else(|| {
            r.leaves
                .iter()
                .position(|l| l == v)
                .expect("an input of a region is a leaf or a region value") as u32
        })
    };
    RegionKey {
        nodes: r
            .nodes
            .iter()
            .map(|&j| {
                let n = &p.nodes[j];
                (
                    ROp::from_op(&n.op).expect("region ops are regionable"),
                    n.inputs.iter().map(refer).collect(),
                )
            })
            .collect(),
        leaves: r.leaves.iter().map(|&v| p.ty(v).clone()).collect(),
        roots: r.roots.iter().map(refer).collect(),
    }
}

/// The solution of a region: its new nodes (refs as in [`RegionKey`], the original region
/// node whose name a node may keep) and roots.
struct Template {
    changed: bool,
    nodes: Vec<(ROp, Vec<u32>, TensorType, Option<u32>)>,
    roots: Vec<u32>,
    rules: Vec<(&'static str, usize)>,
}

// ---------------------------------------------------------------------------------------------
// Stage 2: saturation

struct Sat<'a> {
    eg: EG,
    created: Vec<(RNode, &'static str)>,
    mesh: &'a Mesh,
    opts: &'a RewriteOptions,
}

/// `wide` represents every value of `narrow` exactly.
fn holds(wide: DType, narrow: DType) -> bool {
    use DType::*;
    wide == narrow
        || matches!(
            (narrow, wide),
            (BF16 | F16, F32) | (I32, I64) | (Bool, I32 | I64 | F32 | BF16 | F16)
        )
}

impl Sat<'_> {
    fn ty(&self, id: Id) -> Option<TensorType> {
        self.eg[id].data.clone()
    }

    fn size(&self, g: &Group) -> usize {
        self.mesh.group_size(g).unwrap_or(0)
    }

    fn nodes_of(&self, id: Id) -> Vec<RNode> {
        self.eg[id].nodes.clone()
    }

    /// Adds `op(children)` if it type-checks.
    fn mk(&mut self, op: ROp, children: Vec<Id>, rule: &'static str) -> Option<Id> {
        let tys: Vec<TensorType> = children
            .iter()
            .map(|&c| self.ty(c))
            .collect::<Option<_>>()?;
        let refs: Vec<&TensorType> = tys.iter().collect();
        let a = &self.eg.analysis;
        infer(&op, &refs, &a.mesh, &a.leaves)?;
        let node = RNode { op, children };
        if self.eg.lookup(node.clone()).is_none() {
            self.created.push((node.clone(), rule));
        }
        Some(self.eg.add(node))
    }

    fn mk1(&mut self, op: ROp, x: Id, rule: &'static str) -> Option<Id> {
        self.mk(op, vec![x], rule)
    }

    /// `AllReduce[inner ∪ outer](x)` as ReduceScatter over `inner`, AllReduce over `outer`,
    /// AllGather over `inner`.
    fn hierarchical_ar(
        &mut self,
        x: Id,
        inner: &Group,
        outer: &Group,
        reduce: u8,
        rule: &'static str,
    ) -> Option<Id> {
        let xt = self.ty(x)?;
        let nh = self.size(inner);
        if nh <= 1 {
            return None;
        }
        let around = |s: &mut Self, v: Id, axis: usize| -> Option<Id> {
            let rs = s.mk1(
                ROp::ReduceScatter {
                    group: inner.clone(),
                    axis,
                    reduce,
                },
                v,
                rule,
            )?;
            let mid = if outer.axes.is_empty() {
                rs
            } else {
                s.mk1(
                    ROp::AllReduce {
                        group: outer.clone(),
                        reduce,
                    },
                    rs,
                    rule,
                )?
            };
            s.mk1(
                ROp::AllGather {
                    group: inner.clone(),
                    axis,
                },
                mid,
                rule,
            )
        };
        if let Some(k) = (0..xt.rank()).find(|&k| xt.shape[k].is_multiple_of(nh)) {
            return around(self, x, k);
        }
        let e = xt.numel();
        let flat = if xt.rank() == 1 {
            x
        } else {
            self.mk1(ROp::Reshape(vec![e]), x, rule)?
        };
        let padded_len = e.div_ceil(nh) * nh;
        let padded = if padded_len == e {
            flat
        } else {
            let z = self.mk(
                ROp::Fill {
                    bits: 0f64.to_bits(),
                    dtype: xt.dtype,
                    shape: vec![padded_len - e],
                },
                vec![],
                rule,
            )?;
            self.mk(ROp::Concat(0), vec![flat, z], rule)?
        };
        let ag = around(self, padded, 0)?;
        let un = if padded_len == e {
            ag
        } else {
            self.mk1(
                ROp::Slice {
                    axes: vec![0],
                    starts: vec![0],
                    ends: vec![e as i64],
                    steps: vec![1],
                },
                ag,
                rule,
            )?
        };
        if xt.rank() == 1 {
            Some(un)
        } else {
            self.mk1(ROp::Reshape(xt.shape.clone()), un, rule)
        }
    }

    /// Terms equal to node `n`, with the rule that found each.
    /// Every rewrite of node `n` (its class's members): the nodes each rule offers as equal,
    /// with the rule's name, in a fixed order (the rules' order below).
    fn apply(&mut self, n: &RNode) -> Vec<(Id, &'static str)> {
        let mut out: Vec<(Id, &'static str)> = Vec::new();
        let Some(&x) = n.children.first() else {
            return out;
        };
        let Some(xt) = self.ty(x) else {
            return out;
        };
        self.drop_trivial(n, x, &xt, &mut out);
        self.fold_and_place_casts(n, x, &mut out);
        self.cast_after(n, x, &mut out);
        self.reduce_dtype(n, x, &xt, &mut out);
        self.collective_rules(n, x, &mut out);
        out
    }

    /// `drop_trivial`: a collective over one rank, a cast to its own dtype, a reshape to its own shape, an identity: its input.
    fn drop_trivial(
        &mut self,
        n: &RNode,
        x: Id,
        xt: &TensorType,
        out: &mut Vec<(Id, &'static str)>,
    ) {
        // drop_trivial
        let trivial = match &n.op {
            op if op.is_collective() => self.size(op.group().expect("collective")) == 1,
            ROp::Cast(to) => xt.dtype == *to,
            ROp::Reshape(s) | ROp::Transpose(s) if matches!(n.op, ROp::Reshape(_)) => {
                xt.shape == *s
            }
            ROp::Identity => true,
            _ => false,
        };
        if trivial {
            out.push((x, "drop_trivial"));
        }
    }

    /// Of a cast: `cast_fold` (cast of a cast that holds the values), `cast_past_view` / `cast_past_collective` / `cast_past_concat` (the cast moved before a view, a data-moving collective or a concat, or a zero fill cast), `reduce_dtype` (a reduction of a wider value cast to the wire dtype); of a reshape: `reshape_fold`.
    fn fold_and_place_casts(&mut self, n: &RNode, x: Id, out: &mut Vec<(Id, &'static str)>) {
        let opts = self.opts;
        match &n.op {
            ROp::Cast(to) => {
                let to = *to;
                for m in self.nodes_of(x) {
                    let y = m.children.first().copied();
                    match &m.op {
                        ROp::Cast(mid) => {
                            let y = y.expect("unary");
                            if self.ty(y).is_some_and(|t| t.dtype == to && holds(*mid, to)) {
                                out.push((y, "cast_fold"));
                            }
                        }
                        op if opts.cast_placement
                            && (op.is_view()
                                || matches!(
                                    op,
                                    ROp::AllGather { .. }
                                        | ROp::AllToAll { .. }
                                        | ROp::Broadcast { .. }
                                )) =>
                        {
                            let rule = if op.is_view() {
                                "cast_past_view"
                            } else {
                                "cast_past_collective"
                            };
                            let c = self.mk1(ROp::Cast(to), y.expect("unary"), rule);
                            if let Some(t) = c.and_then(|c| self.mk1(op.clone(), c, rule)) {
                                out.push((t, rule));
                            }
                        }
                        ROp::Concat(axis) if opts.cast_placement => {
                            let parts: Option<Vec<Id>> = m
                                .children
                                .iter()
                                .map(|&c| self.mk1(ROp::Cast(to), c, "cast_past_concat"))
                                .collect();
                            if let Some(t) = parts
                                .and_then(|ps| self.mk(ROp::Concat(*axis), ps, "cast_past_concat"))
                            {
                                out.push((t, "cast_past_concat"));
                            }
                        }
                        ROp::ReduceScatter { .. } | ROp::AllReduce { .. }
                            if opts.reduce_dtype == Some(to) =>
                        {
                            let y = y.expect("unary");
                            let wider = self.ty(y).is_some_and(|t| {
                                t.dtype.is_float() && t.dtype.size_bytes() > to.size_bytes()
                            });
                            if wider {
                                let c = self.mk1(ROp::Cast(to), y, "reduce_dtype");
                                if let Some(t) =
                                    c.and_then(|c| self.mk1(m.op.clone(), c, "reduce_dtype"))
                                {
                                    out.push((t, "reduce_dtype"));
                                }
                            }
                        }
                        _ => {}
                    }
                }
                // Cast of a zero fill: a zero fill of the new dtype.
                for m in self.nodes_of(x) {
                    if let ROp::Fill { bits, shape, .. } = &m.op {
                        if opts.cast_placement && f64::from_bits(*bits) == 0.0 {
                            let f = ROp::Fill {
                                bits: 0f64.to_bits(),
                                dtype: to,
                                shape: shape.clone(),
                            };
                            if let Some(t) = self.mk(f, vec![], "cast_past_concat") {
                                out.push((t, "cast_past_concat"));
                            }
                        }
                    }
                }
            }
            ROp::Reshape(s) => {
                for m in self.nodes_of(x) {
                    if let ROp::Reshape(_) = m.op {
                        if let Some(t) =
                            self.mk1(ROp::Reshape(s.clone()), m.children[0], "reshape_fold")
                        {
                            out.push((t, "reshape_fold"));
                        }
                    }
                }
            }
            _ => {}
        }
    }

    /// `cast_past_view` / `cast_past_collective`: a view or a data-moving collective of a cast, as the cast after it.
    fn cast_after(&mut self, n: &RNode, x: Id, out: &mut Vec<(Id, &'static str)>) {
        let opts = self.opts;
        let moves_data_only = matches!(
            n.op,
            ROp::AllGather { .. } | ROp::AllToAll { .. } | ROp::Broadcast { .. }
        );
        // A collective that only moves data, or a view, of a cast: the cast after it.
        if opts.cast_placement && (moves_data_only || n.op.is_view()) {
            let rule = if n.op.is_view() {
                "cast_past_view"
            } else {
                "cast_past_collective"
            };
            for m in self.nodes_of(x) {
                if let ROp::Cast(to) = m.op {
                    let t = self.mk1(n.op.clone(), m.children[0], rule);
                    if let Some(c) = t.and_then(|t| self.mk1(ROp::Cast(to), t, rule)) {
                        out.push((c, rule));
                    }
                }
            }
        }
    }

    /// `reduce_dtype`: a reduction carried out in the narrower `reduce_dtype` on the wire, cast back.
    fn reduce_dtype(
        &mut self,
        n: &RNode,
        x: Id,
        xt: &TensorType,
        out: &mut Vec<(Id, &'static str)>,
    ) {
        let opts = self.opts;
        // Reductions in a narrower dtype on the wire.
        if let (Some(r), ROp::ReduceScatter { .. } | ROp::AllReduce { .. }) =
            (opts.reduce_dtype, &n.op)
        {
            if xt.dtype.is_float() && r.size_bytes() < xt.dtype.size_bytes() {
                let c = self.mk1(ROp::Cast(r), x, "reduce_dtype");
                let t = c.and_then(|c| self.mk1(n.op.clone(), c, "reduce_dtype"));
                if let Some(b) = t.and_then(|t| self.mk1(ROp::Cast(xt.dtype), t, "reduce_dtype")) {
                    out.push((b, "reduce_dtype"));
                }
            }
        }
    }

    /// `rs_ag` (reduce-scatter then all-gather over one group is an all-reduce, and back), `decompose` and `reorder_axes` (a collective over several axes as one per axis), `hierarchical_allreduce`.
    fn collective_rules(&mut self, n: &RNode, x: Id, out: &mut Vec<(Id, &'static str)>) {
        let opts = self.opts;
        match &n.op {
            ROp::AllGather { group, axis } => {
                for m in self.nodes_of(x) {
                    if let ROp::ReduceScatter {
                        group: g2,
                        axis: a2,
                        reduce,
                    } = &m.op
                    {
                        if g2 == group && a2 == axis {
                            let ar = ROp::AllReduce {
                                group: group.clone(),
                                reduce: *reduce,
                            };
                            if let Some(t) = self.mk1(ar, m.children[0], "rs_ag") {
                                out.push((t, "rs_ag"));
                            }
                        }
                    }
                }
                if opts.decompose && group.axes.len() >= 2 {
                    let g0 = Group::new([group.axes[0].clone()]);
                    let rest = Group::new(group.axes[1..].iter().cloned());
                    let ag = |g: &Group| ROp::AllGather {
                        group: g.clone(),
                        axis: *axis,
                    };
                    let t = self.mk1(ag(&rest), x, "decompose");
                    if let Some(t) = t.and_then(|t| self.mk1(ag(&g0), t, "decompose")) {
                        out.push((t, "decompose"));
                    }
                    let mut swapped = rest.clone();
                    swapped.axes.push(group.axes[0].clone());
                    let cs = ROp::ChunkSwap {
                        axis: *axis,
                        n1: self.size(&rest),
                        n2: self.size(&g0),
                    };
                    let t = self.mk1(ag(&swapped), x, "reorder_axes");
                    if let Some(t) = t.and_then(|t| self.mk1(cs, t, "reorder_axes")) {
                        out.push((t, "reorder_axes"));
                    }
                }
            }
            ROp::ReduceScatter {
                group,
                axis,
                reduce,
            } if opts.decompose && group.axes.len() >= 2 => {
                let g0 = Group::new([group.axes[0].clone()]);
                let rest = Group::new(group.axes[1..].iter().cloned());
                let rs = |g: &Group| ROp::ReduceScatter {
                    group: g.clone(),
                    axis: *axis,
                    reduce: *reduce,
                };
                let t = self.mk1(rs(&g0), x, "decompose");
                if let Some(t) = t.and_then(|t| self.mk1(rs(&rest), t, "decompose")) {
                    out.push((t, "decompose"));
                }
                let mut swapped = rest.clone();
                swapped.axes.push(group.axes[0].clone());
                let cs = ROp::ChunkSwap {
                    axis: *axis,
                    n1: self.size(&g0),
                    n2: self.size(&rest),
                };
                let t = self.mk1(cs, x, "reorder_axes");
                if let Some(t) = t.and_then(|t| self.mk1(rs(&swapped), t, "reorder_axes")) {
                    out.push((t, "reorder_axes"));
                }
            }
            ROp::AllReduce { group, reduce } => {
                let in_mesh_order: Vec<String> = self
                    .mesh
                    .axes
                    .iter()
                    .filter(|a| group.axes.contains(&a.name))
                    .map(|a| a.name.clone())
                    .collect();
                let m = in_mesh_order.len();
                for t in 1..=m {
                    if t < m && !opts.decompose {
                        continue;
                    }
                    let inner = Group::new(in_mesh_order[m - t..].iter().cloned());
                    let outer = Group::new(
                        group
                            .axes
                            .iter()
                            .filter(|a| !inner.axes.contains(a))
                            .cloned(),
                    );
                    let rule = if t == m {
                        "rs_ag"
                    } else {
                        "hierarchical_allreduce"
                    };
                    if let Some(id) = self.hierarchical_ar(x, &inner, &outer, *reduce, rule) {
                        out.push((id, rule));
                    }
                }
            }
            _ => {}
        }
    }

    fn run(&mut self) {
        for _ in 0..self.opts.iter_limit {
            let mut snap: Vec<(Id, RNode)> = self
                .eg
                .classes()
                .flat_map(|c| c.nodes.iter().map(move |n| (c.id, n.clone())))
                .collect();
            snap.sort();
            let mut changed = false;
            for (cid, n) in snap {
                if self.eg.total_number_of_nodes() > self.opts.egraph_node_limit {
                    break;
                }
                for (id, _) in self.apply(&n) {
                    changed |= self.eg.union(cid, id);
                }
            }
            self.eg.rebuild();
            if !changed || self.eg.total_number_of_nodes() > self.opts.egraph_node_limit {
                break;
            }
        }
    }
}

fn solve(key: &RegionKey, coster: &Coster, opts: &RewriteOptions) -> Template {
    let nl = key.leaves.len();
    let mut eg = EG::new(Types {
        mesh: coster.mesh.clone(),
        leaves: key.leaves.clone(),
    });
    let mut ids: Vec<Id> = (0..nl)
        .map(|k| {
            eg.add(RNode {
                op: ROp::Leaf(k as u32),
                children: vec![],
            })
        })
        .collect();
    let mut tys: Vec<TensorType> = key.leaves.clone();
    let mut orig_cost = 0.0;
    let mut orig_nodes = Vec::new();
    for (op, refs) in &key.nodes {
        let node = RNode {
            op: op.clone(),
            children: refs.iter().map(|&r| ids[r as usize]).collect(),
        };
        let ins: Vec<&TensorType> = refs.iter().map(|&r| &tys[r as usize]).collect();
        let out = infer(op, &ins, coster.mesh, &key.leaves).unwrap_or_else(|| ins[0].clone());
        orig_cost += node_seconds(coster, op, &ins, &out);
        tys.push(out);
        orig_nodes.push(node.clone());
        ids.push(eg.add(node));
    }
    let unchanged = Template {
        changed: false,
        nodes: vec![],
        roots: vec![],
        rules: vec![],
    };
    let mut sat = Sat {
        eg,
        created: Vec::new(),
        mesh: coster.mesh,
        opts,
    };
    sat.run();
    let Sat { eg, created, .. } = sat;
    let canon = |n: &RNode| n.clone().map_children(|c| eg.find(c));
    let orig_of: HashMap<RNode, u32> = orig_nodes
        .iter()
        .enumerate()
        .rev()
        .map(|(j, n)| (canon(n), j as u32))
        .collect();
    let mut rule_of: HashMap<RNode, &'static str> = HashMap::new();
    for (n, r) in &created {
        rule_of.entry(canon(n)).or_insert(r);
    }
    let ext = Extractor::new(&eg, Cost { eg: &eg, coster });
    let mut t = Template {
        changed: false,
        nodes: Vec::new(),
        roots: Vec::new(),
        rules: Vec::new(),
    };
    let mut memo: HashMap<Id, u32> = HashMap::new();
    let mut new_cost = 0.0;
    let mut rules: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut stack: Vec<(Id, bool)> = key
        .roots
        .iter()
        .rev()
        .map(|&r| (eg.find(ids[r as usize]), false))
        .collect();
    // Post-order over the chosen nodes (children first).
    while let Some((c, expanded)) = stack.pop() {
        if memo.contains_key(&c) {
            continue;
        }
        let node = ext.find_best_node(c).clone();
        if let ROp::Leaf(k) = node.op {
            memo.insert(c, k);
            continue;
        }
        if !expanded {
            stack.push((c, true));
            for &ch in node.children.iter().rev() {
                let ch = eg.find(ch);
                if !memo.contains_key(&ch) {
                    stack.push((ch, false));
                }
            }
            continue;
        }
        let refs: Vec<u32> = node.children.iter().map(|&ch| memo[&eg.find(ch)]).collect();
        let Some(out) = eg[c].data.clone() else {
            return unchanged;
        };
        let ins: Vec<TensorType> = node
            .children
            .iter()
            .map(|&ch| eg[ch].data.clone())
            .collect::<Option<_>>()
            .unwrap_or_default();
        let ins_r: Vec<&TensorType> = ins.iter().collect();
        new_cost += node_seconds(coster, &node.op, &ins_r, &out);
        if let Some(r) = rule_of.get(&node) {
            *rules.entry(r).or_default() += 1;
        }
        t.nodes
            .push((node.op.clone(), refs, out, orig_of.get(&node).copied()));
        memo.insert(c, (nl + t.nodes.len() - 1) as u32);
    }
    t.roots = key
        .roots
        .iter()
        .map(|&r| memo[&eg.find(ids[r as usize])])
        .collect();
    if new_cost < orig_cost * (1.0 - 1e-12) {
        t.changed = true;
        t.rules = rules.into_iter().collect();
        t
    } else {
        unchanged
    }
}

fn saturate_regions(
    p: &Program,
    coster: &Coster,
    opts: &RewriteOptions,
    report: &mut RewriteReport,
) -> Result<Program, String> {
    let regions = find_regions(p, opts);
    let mut cache: HashMap<RegionKey, std::rc::Rc<Template>> = HashMap::new();
    let mut e = Edit::new(p);
    let mut escapes = vec![false; p.values.len()];
    for &v in &p.outputs {
        escapes[v.index()] = true;
    }
    for u in &p.updates {
        escapes[u.value.index()] = true;
    }
    for r in &regions {
        report.regions += 1;
        let key = region_key(p, r);
        let t = match cache.get(&key) {
            Some(t) => t.clone(),
            None => {
                report.regions_solved += 1;
                let t = std::rc::Rc::new(solve(&key, coster, opts));
                cache.insert(key, t.clone());
                t
            }
        };
        if !t.changed {
            continue;
        }
        report.regions_changed += 1;
        for (rule, n) in &t.rules {
            *report.rules.entry(rule.to_string()).or_default() += n;
        }
        instantiate(&mut e, p, r, &t, &escapes)?;
    }
    if report.regions_changed == 0 {
        return Ok(p.clone());
    }
    e.finish()
}

fn instantiate(
    e: &mut Edit,
    p: &Program,
    r: &Region,
    t: &Template,
    escapes: &[bool],
) -> Result<(), String> {
    let nl = r.leaves.len();
    let seed = r
        .nodes
        .iter()
        .copied()
        .find(|&j| p.nodes[j].op.is_collective())
        .unwrap_or(r.nodes[0]);
    // A new node is named in the scope of, and has the role of, the original node it
    // stands for (see below).
    let scope_of = |j: usize| {
        let name = &p.nodes[j].name;
        let scope = name.rsplit_once('/').map_or(name.as_str(), |(s, _)| s);
        (scope.to_string(), p.nodes[j].role.clone())
    };
    let scope = scope_of(seed);
    // Names: a node keeps the scope of the original node it stands for, else of its first
    // reader, else of the root it computes.
    let mut scopes: Vec<Option<(String, Role)>> = vec![None; t.nodes.len()];
    // Keys: a root goes where its original producer was; a node feeding others goes no later
    // than its first reader.
    let mut keys = vec![i64::MAX; t.nodes.len()];
    for (k, &rt) in t.roots.iter().enumerate() {
        if (rt as usize) >= nl {
            let i = rt as usize - nl;
            let orig = p
                .producer(r.roots[k])
                .expect("a root is a node value")
                .index() as i64;
            keys[i] = keys[i].min(2 * orig - 1);
            if scopes[i].is_none() {
                scopes[i] = Some(scope_of(orig as usize));
            }
        }
    }
    for i in (0..t.nodes.len()).rev() {
        if keys[i] == i64::MAX {
            keys[i] = 2 * r.nodes[0] as i64 - 1;
        }
        if let Some(j) = t.nodes[i].3 {
            scopes[i] = Some(scope_of(r.nodes[j as usize]));
        }
        let sc = scopes[i].get_or_insert_with(|| scope.clone()).clone();
        for &c in &t.nodes[i].1 {
            if (c as usize) >= nl {
                let j = c as usize - nl;
                keys[j] = keys[j].min(keys[i]);
                if scopes[j].is_none() {
                    scopes[j] = Some(sc.clone());
                }
            }
        }
    }
    for &j in &r.nodes {
        e.removed[j] = true;
    }
    let mut refs: Vec<VRef> = r.leaves.iter().map(|&v| VRef::Old(v)).collect();
    let mut reused = HashSet::new();
    for (i, (op, children, ty, orig)) in t.nodes.iter().enumerate() {
        let ins: Vec<VRef> = children.iter().map(|&c| refs[c as usize]).collect();
        let key = keys[i];
        let (scope, role) = scopes[i].as_ref().unwrap_or(&scope);
        e.role = role.clone();
        let v = if let ROp::ChunkSwap { axis, n1, n2 } = op {
            let (view, perm) = chunk_swap_view(&ty.shape, *axis, *n1, *n2)
                .ok_or("collective rewriting: a chunk swap does not divide its dim")?;
            let a = e.push(
                &format!("{scope}/Reshape"),
                Op::Reshape { shape: view },
                ins,
                key,
            );
            let b = e.push(
                &format!("{scope}/Transpose"),
                Op::Transpose { perm },
                vec![a],
                key,
            );
            e.push(
                &format!("{scope}/Reshape"),
                Op::Reshape {
                    shape: ty.shape.clone(),
                },
                vec![b],
                key,
            )
        } else {
            let o = op.to_op().expect("not a leaf");
            match orig {
                Some(j) if reused.insert(*j) => {
                    let node = &p.nodes[r.nodes[*j as usize]];
                    let name = p.value(node.outputs[0]).name.clone();
                    e.new.push(NewNode {
                        name,
                        stream: node.stream,
                        role: node.role.clone(),
                        op: o,
                        inputs: ins,
                        key,
                    });
                    VRef::New(e.new.len() - 1)
                }
                _ => {
                    let base = format!("{scope}/{}", o.name());
                    e.push(&base, o, ins, key)
                }
            }
        };
        refs.push(v);
    }
    for (k, &rt) in t.roots.iter().enumerate() {
        let root = r.roots[k];
        let mut v = refs[rt as usize];
        if (rt as usize) < nl && escapes[root.index()] {
            // An output or update must not alias an input of the region.
            let orig = p.producer(root).expect("node value").index();
            let (sc, role) = scope_of(orig);
            e.role = role;
            v = e.push(
                &format!("{sc}/Copy"),
                Op::Copy,
                vec![v],
                2 * orig as i64 - 1,
            );
        }
        e.subst.insert(root, v);
    }
    Ok(())
}
