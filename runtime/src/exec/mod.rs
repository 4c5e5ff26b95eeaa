//! The plan executor: runs a compiled [`Plan`] on W ranks as threads of this process.
//!
//! Per rank: one arena of `plan.arena_bytes` (allocated once, 64-byte aligned) holding every
//! value at its planned offset; one compute thread and one background thread per comm stream
//! (all-gather, reduce-scatter), each running its stream's nodes in program order.
//! `RecordEvent` / `WaitEvent` are real synchronisation between a rank's threads
//! ([`sync::EventTable`]); collectives are real exchanges between the ranks' threads through
//! one [`Communicator`] per (group instance, stream). After every stream of every rank has
//! finished a step, each rank applies the program's updates (the new value's bytes are copied
//! over the target's), and the next step starts.
//!
//! `CommMode::Sync` is the baseline: each rank runs every node, collectives included, in
//! program order on its compute thread.
//!
//! Safety rests on the plan: two buffers whose bytes overlap are never in use at the same
//! time. [`Executor::new`] checks what it can cheaply (every buffer inside the arena and as
//! large as its value, events recorded once and before their waits, groups in the mesh, no
//! node writing over its own inputs); callers must also have run the plan verifier
//! (`hzp_passes::plan::verify`), which checks the happens-before order of overlapping
//! buffers. `hzp run` and the tests do.

pub mod arena;
pub mod sync;

use crate::comm::rendezvous::Rendezvous;
use crate::comm::tcp::{self, CommSpec};
use crate::comm::{Communicator, GroupComm, LinkModel};
use crate::cpu::{eval_op_into, TensorMut, TensorRef, Workspace};
pub use crate::executor::{
    assemble_layout, cut_parameters, CommMode, ExecError, PlanExecutor, StepStats, TraceEvent,
};
use crate::watchdog::{
    CollRecord, CollState, Fault, FaultKind, FlightRecorder, FlightReport, RankRecord, StuckHook,
};
use arena::{data_bytes, data_mut, data_ref, scalar_f64, tensor_from_bytes, write_tensor, Arena};
use hzp_ir::{
    Group, Mesh, Op, ParamLayout, Plan, Program, StreamKind, Tensor, TensorType, ValueId,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use sync::{EventTable, StepBarrier};

/// How to run.
#[derive(Clone, Default)]
pub struct ExecOptions {
    pub comm: CommMode,
    /// Emulated links: every collective takes at least what the model says.
    pub link: Option<Arc<dyn LinkModel>>,
    /// Record a timeline of every node (see [`Executor::trace`]).
    pub trace: bool,
    /// The longest a thread may wait in one collective, event wait or step barrier before
    /// the run is stopped (`None`: [`crate::watchdog::DEFAULT_TIMEOUT`]).
    pub collective_timeout: Option<Duration>,
    /// An injected fault (tests; `HZP_FAULT`).
    pub fault: Option<Fault>,
    /// Called when threads of a failed run do not stop (see [`StuckHook`]).
    pub on_stuck: Option<StuckHook>,
    /// Flight-recorder entries kept per rank and stream (0: the default).
    pub flight_capacity: usize,
}

impl std::fmt::Debug for ExecOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecOptions")
            .field("comm", &self.comm)
            .field("link", &self.link.is_some())
            .field("trace", &self.trace)
            .field("collective_timeout", &self.collective_timeout)
            .field("fault", &self.fault)
            .field("on_stuck", &self.on_stuck.is_some())
            .finish()
    }
}

impl ExecError {
    /// An error that only says another thread failed first.
    fn is_abort(&self) -> bool {
        matches!(self, ExecError::Run(m) if m == crate::comm::ABORTED)
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Loc {
    off: usize,
    bytes: usize,
}

enum Kind {
    Compute,
    /// A MatMul of float operands, each read as stored (`None`) or, for a transposed operand
    /// the plan keeps in its input's bytes, through a view of the stored shape (`Some`) with
    /// the last two axes swapped.
    MatMul([Option<Vec<usize>>; 2]),
    /// Identity / Copy / Reshape (the bytes unchanged), or a transposed operand in its
    /// input's bytes (`hzp_ir::views::transposed_operands`; nothing to run).
    Move,
    Nop,
    Record(usize),
    Wait(usize),
    Collective,
}

struct NodeRt {
    kind: Kind,
    stream: usize,
    ins: Vec<(Loc, TensorType)>,
    outs: Vec<(Loc, TensorType)>,
}

/// Per rank and collective node: its communicator and this rank's place in it.
#[derive(Clone, Copy)]
struct CommRef {
    comm: usize,
    member: usize,
}

/// Executes a plan (see the [module docs](self)).
pub struct Executor {
    program: Program,
    mesh: Mesh,
    layouts: Vec<ParamLayout>,
    /// The replicas of each parameter differ by design (an asyncmesh plan): the model is
    /// their mean (see [`Executor::parameters`]).
    replicas_differ: bool,
    world: usize,
    nodes: Vec<NodeRt>,
    loc: Vec<Loc>,
    /// The ranks this process runs (every rank, or one under a launcher), ascending.
    local: Vec<usize>,
    /// Per rank: its index in `arenas` when this process runs it.
    slot: Vec<Option<usize>>,
    /// The arenas of the local ranks.
    arenas: Vec<Arena>,
    /// Per (stream, group instance): its communicator, when a local rank is a member.
    comms: Vec<Option<GroupComm>>,
    comm_of: Vec<Vec<Option<CommRef>>>,
    n_events: usize,
    /// (value, target) pairs of updates; through `staging` when values and targets overlap.
    updates: Vec<(Loc, Loc)>,
    staging: Option<Vec<Arena>>,
    opts: ExecOptions,
    trace: Vec<TraceEvent>,
    steps_run: usize,
    recorder: FlightRecorder,
    /// The first collective in program order (where skip-collective and wrong-bytes faults
    /// strike).
    first_collective: Option<usize>,
    /// The flight report of the last failed run.
    report: Option<FlightReport>,
    /// The clock of the flight recorder and the watchdog.
    born: Instant,
    /// Token ids and labels are range-checked in every batch (see `set_inputs`).
    index_check: crate::index_check::IndexChecker,
}

/// [`Progress::at`] of a thread outside a step (or done).
const IDLE: u64 = u64::MAX;
/// ... at a step barrier.
const AT_BARRIER: u64 = u64::MAX - 1;
/// ... at the start of a step, before its first node.
const AT_STEP_START: u64 = u64::MAX - 2;

/// Where a thread is, for the watchdog: one relaxed store per node, two more around a wait.
struct Progress {
    /// The node it runs (its index), or one of the markers above.
    at: AtomicU64,
    /// When (µs on the executor's clock, +1) its current wait began; 0 when not waiting.
    since: AtomicU64,
    step: AtomicU64,
}

impl Default for Progress {
    fn default() -> Progress {
        Progress {
            at: AtomicU64::new(IDLE),
            since: AtomicU64::new(0),
            step: AtomicU64::new(0),
        }
    }
}

impl Progress {
    fn set(&self, at: u64, since: u64) {
        self.at.store(at, Ordering::Relaxed);
        self.since.store(since, Ordering::Relaxed);
    }
}

/// What the watchdog reads of a run.
struct RunShared<'a> {
    lists: &'a [(usize, usize, Vec<usize>)],
    progress: &'a [Progress],
    rank_errors: &'a Mutex<Vec<Option<String>>>,
}

fn plan_err(s: impl Into<String>) -> ExecError {
    ExecError::Plan(s.into())
}

fn value_bytes(ty: &TensorType) -> Option<usize> {
    ty.shape
        .iter()
        .try_fold(ty.dtype.size_bytes(), |a, &d| a.checked_mul(d))
}

/// The program's mesh is the plan's.
fn check_mesh(plan: &Plan) -> Result<(), ExecError> {
    match &plan.program.mesh {
        Some(m) if *m == plan.mesh => Ok(()),
        Some(m) => Err(plan_err(format!(
            "the program's mesh {m} is not the plan's mesh {}",
            plan.mesh
        ))),
        None => Err(plan_err("the program has no mesh")),
    }
}

/// Every value at its buffer: each buffer an aligned range of the arena, each value with
/// a buffer at least as large as it (values of no bytes need none). The locations have the
/// values' own sizes.
fn value_locations(plan: &Plan) -> Result<Vec<Loc>, ExecError> {
    let p = &plan.program;
    let mut loc = vec![Loc::default(); p.values.len()];
    let mut has = vec![false; p.values.len()];
    for b in &plan.buffers {
        let i = b.value.index();
        if i >= p.values.len() {
            return Err(plan_err(format!("a buffer names value {}", b.value.0)));
        }
        if b.end() > plan.arena_bytes || b.offset % 8 != 0 {
            return Err(plan_err(format!(
                "the buffer of `{}` ({} bytes at offset {}) is not an aligned range of the \
                 {}-byte arena",
                p.values[i].name, b.bytes, b.offset, plan.arena_bytes
            )));
        }
        loc[i] = Loc {
            off: b.offset as usize,
            bytes: b.bytes as usize,
        };
        has[i] = true;
    }
    for (i, v) in p.values.iter().enumerate() {
        let need = value_bytes(&v.ty)
            .ok_or_else(|| plan_err(format!("value `{}` ({}) is too large", v.name, v.ty)))?;
        if need == 0 {
            loc[i] = Loc { off: 0, bytes: 0 };
            continue;
        }
        if !has[i] || loc[i].bytes < need {
            return Err(plan_err(format!(
                "value `{}` ({}, {need} bytes) has {}",
                v.name,
                v.ty,
                if has[i] {
                    format!("a buffer of only {} bytes", loc[i].bytes)
                } else {
                    "no buffer".to_string()
                }
            )));
        }
        loc[i].bytes = need;
    }
    Ok(loc)
}

/// Events: dense indices; each recorded once. Event id -> (index, the node recording it).
fn event_indices(p: &Program) -> Result<HashMap<u32, (usize, usize)>, ExecError> {
    let mut event_idx: HashMap<u32, (usize, usize)> = HashMap::new();
    for (ni, n) in p.nodes.iter().enumerate() {
        if let Op::RecordEvent { event } = n.op {
            let k = event_idx.len();
            if event_idx.insert(event, (k, ni)).is_some() {
                return Err(plan_err(format!(
                    "event {event} is recorded twice (node `{}`)",
                    n.name
                )));
            }
        }
    }
    Ok(event_idx)
}

/// Transposed operands in their input's bytes: the stored (input) shape of each.
fn stored_shapes(p: &Program, loc: &[Loc]) -> Vec<Option<Vec<usize>>> {
    let mut stored_as: Vec<Option<Vec<usize>>> = vec![None; p.values.len()];
    for (n, t) in p.nodes.iter().zip(hzp_ir::views::transposed_operands(p)) {
        if let (true, [x], [y]) = (t, n.inputs.as_slice(), n.outputs.as_slice()) {
            if loc[y.index()].off == loc[x.index()].off {
                stored_as[y.index()] = Some(p.ty(*x).shape.clone());
            }
        }
    }
    stored_as
}

/// What each node is to the executor, with its operands' locations and types; waits come
/// after their records, and no node writes over its inputs except where its op says it may.
fn runtime_nodes(
    p: &Program,
    loc: &[Loc],
    event_idx: &HashMap<u32, (usize, usize)>,
) -> Result<Vec<NodeRt>, ExecError> {
    let mut nodes = Vec::with_capacity(p.nodes.len());
    let ty = |v: ValueId| p.ty(v).clone();
    let stored_as = stored_shapes(p, loc);
    for (ni, n) in p.nodes.iter().enumerate() {
        let kind = node_kind(n, ni, event_idx, &stored_as)?;
        let ins: Vec<(Loc, TensorType)> =
            n.inputs.iter().map(|&v| (loc[v.index()], ty(v))).collect();
        let outs: Vec<(Loc, TensorType)> =
            n.outputs.iter().map(|&v| (loc[v.index()], ty(v))).collect();
        check_no_overwrite(n, &kind, &ins, &outs)?;
        nodes.push(NodeRt {
            kind,
            stream: n.stream.index(),
            ins,
            outs,
        });
    }
    Ok(nodes)
}

/// The [`Kind`] of node `ni`.
fn node_kind(
    n: &hzp_ir::Node,
    ni: usize,
    event_idx: &HashMap<u32, (usize, usize)>,
    stored_as: &[Option<Vec<usize>>],
) -> Result<Kind, ExecError> {
    Ok(match &n.op {
        Op::RecordEvent { event } => Kind::Record(event_idx[event].0),
        Op::WaitEvent { event } => match event_idx.get(event) {
            Some(&(k, r)) if r < ni => Kind::Wait(k),
            Some(_) => {
                return Err(plan_err(format!(
                    "node `{}` waits on event {event} before it is recorded (a deadlock)",
                    n.name
                )))
            }
            None => {
                return Err(plan_err(format!(
                    "node `{}` waits on event {event}, which nothing records",
                    n.name
                )))
            }
        },
        Op::Free => Kind::Nop,
        Op::Identity | Op::Copy | Op::Reshape { .. } => Kind::Move,
        Op::Transpose { .. } if stored_as[n.outputs[0].index()].is_some() => Kind::Move,
        Op::MatMul if n.inputs.iter().any(|v| stored_as[v.index()].is_some()) => {
            let view = |k: usize| stored_as[n.inputs[k].index()].clone();
            Kind::MatMul([view(0), view(1)])
        }
        op if op.is_collective() => Kind::Collective,
        _ => Kind::Compute,
    })
}

/// Refuses a node whose result overlaps one of its inputs, unless it is a move lying in its
/// input's very bytes or an in-place pair its op declares.
fn check_no_overwrite(
    n: &hzp_ir::Node,
    kind: &Kind,
    ins: &[(Loc, TensorType)],
    outs: &[(Loc, TensorType)],
) -> Result<(), ExecError> {
    // A move may lie in its input's very bytes (the planner shares a reshape's buffer
    // with its input): then it has nothing to do.
    let in_place_move = matches!(kind, Kind::Move)
        && ins.len() == 1
        && outs.len() == 1
        && ins[0].0.off == outs[0].0.off
        && ins[0].0.bytes == outs[0].0.bytes;
    // An op may write a result exactly over an input it declares (an optimizer
    // update in place, see `Op::in_place_pairs`); any other overlap is refused.
    let pairs = n.op.in_place_pairs();
    for (oi, (o, _)) in outs.iter().enumerate() {
        for (ii, (i, _)) in ins.iter().enumerate() {
            let declared = pairs.contains(&(ii, oi)) && i.off == o.off && i.bytes == o.bytes;
            if !in_place_move
                && !declared
                && o.bytes > 0
                && i.bytes > 0
                && o.off < i.off + i.bytes
                && i.off < o.off + o.bytes
            {
                return Err(plan_err(format!(
                    "node `{}` writes its result over one of its inputs",
                    n.name
                )));
            }
        }
    }
    Ok(())
}

/// Per-rank communicator table of each collective node.
type CommTable = Vec<Vec<Option<CommRef>>>;

/// Communicators: the members of one per (stream, group instance); and each rank's
/// communicator of each collective node.
fn communicators(p: &Program, mesh: &Mesh) -> Result<(Vec<Vec<usize>>, CommTable), ExecError> {
    let world = mesh.world_size();
    let mut comms: Vec<Vec<usize>> = Vec::new();
    let mut comm_key: HashMap<(usize, Vec<usize>), usize> = HashMap::new();
    let mut comm_of = vec![vec![None; p.nodes.len()]; world];
    for (ni, n) in p.nodes.iter().enumerate() {
        let Some(group) = n.op.group() else { continue };
        for (r, row) in comm_of.iter_mut().enumerate() {
            let members = mesh.group_members(group, r).ok_or_else(|| {
                plan_err(format!(
                    "node `{}` runs on group {group}, which names an axis the mesh {mesh} lacks",
                    n.name
                ))
            })?;
            let member = members.iter().position(|&m| m == r).unwrap_or(0);
            let size = members.len();
            debug_assert_eq!(size, members.len());
            let key = (n.stream.index(), members.clone());
            let comm = *comm_key.entry(key).or_insert_with(|| {
                comms.push(members);
                comms.len() - 1
            });
            row[ni] = Some(CommRef { comm, member });
        }
    }
    Ok((comms, comm_of))
}

/// The communicators of the local ranks (`slot[r]`: whether rank r runs here) from their
/// members: threads of this process when every member runs here, TCP to the other
/// processes (connected through `rv`) otherwise.
fn connect_comms(
    p: &Program,
    members: Vec<Vec<usize>>,
    slot: &[Option<usize>],
    rv: Option<&mut Rendezvous>,
    opts: &ExecOptions,
) -> Result<Vec<Option<GroupComm>>, ExecError> {
    let labels: Arc<[String]> = p.nodes.iter().map(|n| n.name.clone()).collect();
    let here = |m: &usize| slot.get(*m).copied().flatten().is_some();
    let mut comms: Vec<Option<GroupComm>> = Vec::with_capacity(members.len());
    let mut remote = Vec::new();
    for (index, m) in members.into_iter().enumerate() {
        let n_here = m.iter().filter(|r| here(r)).count();
        if n_here == m.len() {
            comms.push(Some(GroupComm::Threads(Communicator::with_members(
                m,
                Some(labels.clone()),
            ))));
        } else if n_here == 0 {
            comms.push(None);
        } else if n_here == 1 {
            comms.push(None);
            remote.push(CommSpec { index, members: m });
        } else {
            return Err(plan_err(format!(
                "the communicator of ranks {m:?} has {n_here} members in this process and others elsewhere; run one rank per process"
            )));
        }
    }
    if remote.is_empty() {
        return Ok(comms);
    }
    let rv =
        rv.ok_or_else(|| plan_err("internal: ranks of other processes without a rendezvous"))?;
    let timeout = opts
        .collective_timeout
        .unwrap_or(crate::watchdog::DEFAULT_TIMEOUT);
    for (index, c) in tcp::connect(rv, &remote, labels, timeout).map_err(ExecError::Run)? {
        comms[index] = Some(GroupComm::Tcp(c));
    }
    Ok(comms)
}

/// The updates as (value, target) copies, and the per-rank staging arenas if any.
type UpdateCopies = (Vec<(Loc, Loc)>, Option<Vec<Arena>>);

/// The updates as (value, target) copies, and, when a value is read after another
/// update overwrote it, a staging arena per rank.
fn update_copies(p: &Program, loc: &[Loc], world: usize) -> Result<UpdateCopies, ExecError> {
    let mut updates = Vec::new();
    for u in &p.updates {
        let (v, t) = (loc[u.value.index()], loc[u.target.index()]);
        if v.bytes != t.bytes {
            return Err(plan_err(format!(
                "update of `{}` by `{}` of another size",
                p.value(u.target).name,
                p.value(u.value).name
            )));
        }
        updates.push((v, t));
    }
    let overlap = |a: Loc, b: Loc| {
        a.bytes > 0 && b.bytes > 0 && a.off < b.off + b.bytes && b.off < a.off + a.bytes
    };
    let needs_staging = updates.iter().any(|&(v, _)| {
        updates
            .iter()
            .any(|&(_, t)| overlap(v, t) && v.off != t.off)
    });
    let staging = if needs_staging {
        let total: usize = updates.iter().map(|(v, _)| v.bytes.div_ceil(8) * 8).sum();
        Some(
            (0..world)
                .map(|_| Arena::new(total).map_err(plan_err))
                .collect::<Result<Vec<_>, _>>()?,
        )
    } else {
        None
    };
    Ok((updates, staging))
}

/// An injected fault names a rank of the plan, and a collective where it needs one.
fn check_fault(
    opts: &ExecOptions,
    world: usize,
    first_collective: Option<usize>,
) -> Result<(), ExecError> {
    if let Some(f) = &opts.fault {
        if f.rank >= world {
            return Err(plan_err(format!(
                "the injected fault names rank {}, the plan has {world} rank{}",
                f.rank,
                if world == 1 { "" } else { "s" }
            )));
        }
        if matches!(f.kind, FaultKind::SkipCollective | FaultKind::WrongBytes)
            && first_collective.is_none()
        {
            return Err(plan_err(format!(
                "the injected fault {} needs a collective, the plan has none",
                f.kind.name()
            )));
        }
    }
    Ok(())
}

/// What the threads of one [`Executor::run`] share.
struct RunState {
    /// The node lists of each thread: (rank, stream, nodes).
    lists: Vec<(usize, usize, Vec<usize>)>,
    sync_mode: bool,
    steps: usize,
    /// Steps run before this run.
    base_step: usize,
    epoch: Instant,
    barrier: StepBarrier,
    abort: AtomicBool,
    failure: Mutex<Option<ExecError>>,
    /// Each rank's own error (not the aborts another's caused), for the flight report.
    rank_errors: Mutex<Vec<Option<String>>>,
    events: Vec<EventTable>,
    progress: Vec<Progress>,
    finished: AtomicUsize,
    /// Per step, rank and stream: [busy, wait] in ns.
    stats: Vec<Mutex<Vec<[u64; 4]>>>,
    walls: Mutex<Vec<Duration>>,
    losses: Mutex<Vec<Option<f64>>>,
    traces: Mutex<Vec<Vec<TraceEvent>>>,
}

impl RunState {
    fn new(ex: &Executor, steps: usize) -> RunState {
        let w = ex.world;
        let lists = ex.thread_lists();
        let n_threads = lists.len();
        RunState {
            sync_mode: ex.opts.comm == CommMode::Sync,
            steps,
            barrier: StepBarrier::new(n_threads),
            abort: AtomicBool::new(false),
            failure: Mutex::new(None),
            rank_errors: Mutex::new(vec![None; w]),
            events: (0..w).map(|_| EventTable::new(ex.n_events)).collect(),
            progress: (0..n_threads).map(|_| Progress::default()).collect(),
            finished: AtomicUsize::new(0),
            stats: (0..steps)
                .map(|_| Mutex::new(vec![[0u64; 4]; w * 3]))
                .collect(),
            walls: Mutex::new(Vec::with_capacity(steps)),
            losses: Mutex::new(Vec::with_capacity(steps)),
            epoch: Instant::now(),
            base_step: ex.steps_run,
            traces: Mutex::new(Vec::new()),
            lists,
        }
    }

    /// Stops the run with `e`: the first real error wins over the aborts it caused.
    fn fail(&self, e: ExecError) {
        self.abort.store(true, Ordering::Relaxed);
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        // the first real error wins over the aborts it caused
        if f.is_none() || (!e.is_abort() && f.as_ref().is_some_and(ExecError::is_abort)) {
            *f = Some(e);
        }
    }
}

/// Each step's [`StepStats`] from the threads' per-step records.
fn step_stats(
    stats: Vec<Mutex<Vec<[u64; 4]>>>,
    walls: &[Duration],
    losses: &[Option<f64>],
    base_step: usize,
    w: usize,
) -> Vec<StepStats> {
    let mut out = Vec::with_capacity(stats.len());
    for (k, st) in stats.into_iter().enumerate() {
        let st = st.into_inner().unwrap_or_else(|e| e.into_inner());
        let mut busy = [0u64; 3];
        let mut exposed = 0u64;
        // ranks of other processes have nothing recorded here
        for per_rank in st.chunks(3) {
            for s in 0..3 {
                busy[s] += per_rank[s][0];
            }
            exposed += per_rank[0][1];
        }
        let mean = |x: u64| Duration::from_nanos(x / w as u64);
        out.push(StepStats {
            step: base_step + k + 1,
            loss: losses.get(k).copied().flatten(),
            wall: walls.get(k).copied().unwrap_or_default(),
            busy: [mean(busy[0]), mean(busy[1]), mean(busy[2])],
            exposed_comm: mean(exposed),
        });
    }
    out
}

impl Executor {
    /// Prepares `plan` with the model's full parameters (by name): allocates each rank's
    /// arena, cuts the parameters into master and compute shards as the plan's layouts say,
    /// places states and constants. Inputs are set with [`Executor::set_inputs`].
    pub fn new(
        plan: &Plan,
        full_params: &[(String, Tensor)],
        opts: ExecOptions,
    ) -> Result<Executor, ExecError> {
        Executor::build(plan, full_params, opts, None)
    }

    /// As [`Executor::new`], for one process of a multi-process run: this process runs rank
    /// `rv.rank()` of the plan (the launcher started one process per rank, `rv` connects
    /// them) and its collectives go over TCP to the other processes
    /// ([`crate::comm::tcp`]), with the same results as the threads of [`Executor::new`].
    /// Every process must call it with the same plan.
    pub fn new_process(
        plan: &Plan,
        full_params: &[(String, Tensor)],
        opts: ExecOptions,
        rv: &mut Rendezvous,
    ) -> Result<Executor, ExecError> {
        Executor::build(plan, full_params, opts, Some(rv))
    }

    fn build(
        plan: &Plan,
        full_params: &[(String, Tensor)],
        opts: ExecOptions,
        rv: Option<&mut Rendezvous>,
    ) -> Result<Executor, ExecError> {
        let p = &plan.program;
        check_mesh(plan)?;
        let mesh = plan.mesh.clone();
        let world = mesh.world_size();
        let arena_bytes = usize::try_from(plan.arena_bytes)
            .map_err(|_| plan_err("the arena does not fit this machine's address space"))?;
        let loc = value_locations(plan)?;
        let event_idx = event_indices(p)?;
        let nodes = runtime_nodes(p, &loc, &event_idx)?;
        let (members, comm_of) = communicators(p, &mesh)?;
        let local: Vec<usize> = match &rv {
            None => (0..world).collect(),
            Some(rv) => {
                if rv.world_size() != world {
                    return Err(plan_err(format!(
                        "the launcher started {} process{}, the plan's mesh {mesh} has {world} rank{}: start one process per rank",
                        rv.world_size(),
                        if rv.world_size() == 1 { "" } else { "es" },
                        if world == 1 { "" } else { "s" }
                    )));
                }
                vec![rv.rank()]
            }
        };
        let mut slot = vec![None; world];
        for (i, &r) in local.iter().enumerate() {
            slot[r] = Some(i);
        }
        let comms = connect_comms(p, members, &slot, rv, &opts)?;
        let arenas = local
            .iter()
            .map(|_| Arena::new(arena_bytes).map_err(plan_err))
            .collect::<Result<Vec<_>, _>>()?;
        let (updates, staging) = update_copies(p, &loc, local.len())?;
        let first_collective = nodes
            .iter()
            .position(|n| matches!(n.kind, Kind::Collective));
        check_fault(&opts, world, first_collective)?;
        let recorder = FlightRecorder::new(
            world,
            StreamKind::COUNT,
            if opts.flight_capacity == 0 {
                crate::watchdog::DEFAULT_CAPACITY
            } else {
                opts.flight_capacity
            },
        );
        let mut ex = Executor {
            index_check: crate::index_check::IndexChecker::new(p),
            program: p.clone(),
            mesh,
            layouts: plan.layouts.clone(),
            replicas_differ: plan.asyncmesh.is_some(),
            world,
            nodes,
            loc,
            local,
            slot,
            arenas,
            comms,
            comm_of,
            n_events: event_idx.len(),
            updates,
            staging,
            opts,
            trace: Vec::new(),
            steps_run: 0,
            recorder,
            first_collective,
            report: None,
            born: Instant::now(),
        };
        ex.place_persistent(full_params)?;
        Ok(ex)
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The per-rank program.
    pub fn program(&self) -> &Program {
        &self.program
    }

    fn write(&self, rank: usize, v: ValueId, t: &Tensor) -> Result<(), ExecError> {
        let l = self.loc[v.index()];
        let want = self.program.ty(v);
        if t.ty() != *want {
            return Err(ExecError::Params(format!(
                "internal: `{}` is {} but {} was placed",
                self.program.value(v).name,
                want,
                t.ty()
            )));
        }
        // SAFETY: no thread runs; the range is this value's buffer, inside the arena.
        let out = unsafe { self.arena(rank)?.bytes_mut(l.off, l.bytes) };
        write_tensor(t, out).map_err(ExecError::Run)
    }

    fn read(&self, rank: usize, v: ValueId) -> Tensor {
        let l = self.loc[v.index()];
        // SAFETY: no thread runs (only called between runs).
        let a = self.arena(rank).expect("a rank this process runs");
        let b = unsafe { a.bytes(l.off, l.bytes) };
        tensor_from_bytes(self.program.ty(v), b)
    }

    /// The arena of `rank`, one this process runs.
    fn arena(&self, rank: usize) -> Result<&Arena, ExecError> {
        self.slot
            .get(rank)
            .copied()
            .flatten()
            .map(|i| &self.arenas[i])
            .ok_or_else(|| ExecError::Run(format!("rank {rank} runs in another process")))
    }

    /// The ranks this process runs: every rank of the plan, or (under a launcher) one.
    pub fn local_ranks(&self) -> &[usize] {
        &self.local
    }

    /// Master shards, compute shards, other states and constants into every arena.
    fn place_persistent(&mut self, full: &[(String, Tensor)]) -> Result<(), ExecError> {
        let shards = cut_parameters(&self.program, &self.mesh, &self.layouts, full)?;
        for (r, per_rank) in shards.into_iter().enumerate() {
            if self.slot[r].is_none() {
                continue;
            }
            for (v, t) in per_rank {
                self.write(r, v, &t)?;
            }
        }
        let consts: Vec<(ValueId, Tensor)> = self
            .program
            .consts
            .iter()
            .map(|c| (c.value, c.data.clone()))
            .collect();
        for &r in &self.local {
            for (v, t) in &consts {
                self.write(r, *v, t)?;
            }
        }
        Ok(())
    }

    /// Sets the global batch: every input of the per-rank program is given with `W` times
    /// its rows; rank r takes rows `[r*b, (r+1)*b)` (b: the per-rank rows, micro-batches
    /// included). A scalar input (the learning rate) is given once and every rank reads it.
    /// The batch stays until set again.
    /// Token ids and class labels out of range are an error (nothing is set then).
    pub fn set_inputs(&mut self, global: &[(String, Tensor)]) -> Result<(), ExecError> {
        self.index_check.check(global).map_err(ExecError::Inputs)?;
        let w = self.world;
        let inputs = self.program.inputs.clone();
        for v in inputs {
            let val = self.program.value(v);
            let (_, t) = global.iter().find(|(k, _)| *k == val.name).ok_or_else(|| {
                ExecError::Inputs(format!(
                    "no array `{}` in the inputs (the plan takes {} per rank, {} in all)",
                    val.name,
                    val.ty,
                    global_type(&val.ty, w)
                ))
            })?;
            let want = global_type(&val.ty, w);
            if t.ty() != want {
                return Err(ExecError::Inputs(format!(
                    "input `{}` is {}, but the plan needs {} (the global batch for {w} rank{} of {})",
                    val.name,
                    t.ty(),
                    want,
                    if w == 1 { "" } else { "s" },
                    val.ty
                )));
            }
            let l = self.loc[v.index()];
            let src = data_bytes(&t.data);
            // A scalar (the learning rate) is every rank's; other inputs are cut on axis 0.
            let replicated = want.rank() == 0;
            for (i, &r) in self.local.iter().enumerate() {
                let at = if replicated { 0 } else { r * l.bytes };
                // SAFETY: between runs; this input's buffer.
                let out = unsafe { self.arenas[i].bytes_mut(l.off, l.bytes) };
                out.copy_from_slice(&src[at..at + l.bytes]);
            }
        }
        Ok(())
    }

    /// Runs one step.
    pub fn step(&mut self) -> Result<StepStats, ExecError> {
        let mut s = self.run(1)?;
        Ok(s.remove(0))
    }

    /// Runs `steps` steps on the batch set last; the threads are started once.
    pub fn run(&mut self, steps: usize) -> Result<Vec<StepStats>, ExecError> {
        if steps == 0 {
            return Ok(Vec::new());
        }
        let run = RunState::new(self, steps);
        self.report = None;
        let this = &*self;
        std::thread::scope(|scope| {
            for slot in 0..run.lists.len() {
                this.spawn_worker(scope, &run, slot)?;
            }
            this.spawn_watchdog(scope, &run)
        })?;
        let RunState {
            base_step,
            failure,
            rank_errors,
            stats,
            walls,
            losses,
            traces,
            ..
        } = run;
        if let Some(e) = failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
            let errors = rank_errors.into_inner().unwrap_or_else(|e| e.into_inner());
            self.report = Some(self.flight_report_of(&e.to_string(), &errors));
            return Err(e);
        }
        let walls = walls.into_inner().unwrap_or_else(|e| e.into_inner());
        let losses = losses.into_inner().unwrap_or_else(|e| e.into_inner());
        let out = step_stats(stats, &walls, &losses, base_step, self.local.len());
        self.steps_run += steps;
        if self.opts.trace {
            for t in traces.into_inner().unwrap_or_else(|e| e.into_inner()) {
                self.trace.extend(t);
            }
            self.trace
                .sort_by_key(|e| (e.rank, e.stream.index(), e.start, e.node));
        }
        Ok(out)
    }

    /// The node lists of each thread: (rank, stream, nodes). In sync mode one thread per
    /// rank runs every node but the events; otherwise each rank has a compute thread and a
    /// thread per comm stream with nodes.
    fn thread_lists(&self) -> Vec<(usize, usize, Vec<usize>)> {
        let sync_mode = self.opts.comm == CommMode::Sync;
        let mut lists: Vec<(usize, usize, Vec<usize>)> = Vec::new();
        for &r in &self.local {
            if sync_mode {
                let all = (0..self.nodes.len())
                    .filter(|&i| !matches!(self.nodes[i].kind, Kind::Record(_) | Kind::Wait(_)))
                    .collect();
                lists.push((r, 0, all));
            } else {
                for s in 0..3 {
                    let on: Vec<usize> = (0..self.nodes.len())
                        .filter(|&i| self.nodes[i].stream == s)
                        .collect();
                    if s == 0 || !on.is_empty() {
                        lists.push((r, s, on));
                    }
                }
            }
        }
        lists
    }

    /// Starts the thread of `run.lists[slot]`.
    fn spawn_worker<'scope, 'env>(
        &'env self,
        scope: &'scope std::thread::Scope<'scope, 'env>,
        run: &'env RunState,
        slot: usize,
    ) -> Result<(), ExecError> {
        let (r, s, _) = run.lists[slot];
        std::thread::Builder::new()
            .name(format!("hzp-r{r}-{}", StreamKind::ALL[s].name()))
            .spawn_scoped(scope, move || self.worker(run, slot))
            .map_err(|e| ExecError::Run(format!("cannot start a thread: {e}")))?;
        Ok(())
    }

    /// The body of the thread of `run.lists[slot]`: runs its nodes for every step; a
    /// failure (or a panic) stops the run.
    fn worker(&self, run: &RunState, slot: usize) {
        let (r, s, list) = (run.lists[slot].0, run.lists[slot].1, &run.lists[slot].2);
        let ctx = ThreadCtx {
            ex: self,
            rank: r,
            stream: s,
            list,
            barrier: &run.barrier,
            abort: &run.abort,
            events: &run.events[r],
            sync_mode: run.sync_mode,
            progress: &run.progress[slot],
        };
        let steps = run.steps;
        let mut trace = if self.opts.trace {
            Vec::with_capacity(list.len() * steps)
        } else {
            Vec::new()
        };
        let mut scratch = Scratch::default();
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            ctx.run(
                steps,
                run.base_step,
                run.epoch,
                &run.stats,
                &run.walls,
                &run.losses,
                &mut trace,
                &mut scratch,
            )
        }))
        .unwrap_or_else(|payload| {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            Err(ExecError::Run(format!(
                "rank {r}'s {} thread panicked: {msg}",
                StreamKind::ALL[s].name()
            )))
        });
        ctx.progress.set(IDLE, 0);
        if let Err(e) = res {
            if !e.is_abort() {
                let mut re = run.rank_errors.lock().unwrap_or_else(|e| e.into_inner());
                re[r].get_or_insert_with(|| e.to_string());
            }
            run.fail(e);
        }
        if self.opts.trace {
            run.traces
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(trace);
        }
        run.finished.fetch_add(1, Ordering::Release);
    }

    /// Starts the watchdog: a wait longer than the timeout stops the run; threads that do
    /// not stop after that get the stuck hook.
    fn spawn_watchdog<'scope, 'env>(
        &'env self,
        scope: &'scope std::thread::Scope<'scope, 'env>,
        run: &'env RunState,
    ) -> Result<(), ExecError> {
        std::thread::Builder::new()
            .name("hzp-watchdog".into())
            .spawn_scoped(scope, move || {
                let shared = RunShared {
                    lists: &run.lists,
                    progress: &run.progress,
                    rank_errors: &run.rank_errors,
                };
                let fail = |e: ExecError| run.fail(e);
                self.watch(&shared, &run.abort, &run.finished, &run.failure, &fail)
            })
            .map_err(|e| ExecError::Run(format!("cannot start a thread: {e}")))?;
        Ok(())
    }

    /// The nodes run so far, when the executor was made with `trace: true`.
    pub fn trace(&self) -> &[TraceEvent] {
        &self.trace
    }

    /// Rank `rank`'s program outputs (the loss first), by name.
    pub fn outputs(&self, rank: usize) -> Vec<(String, Tensor)> {
        if self.slot.get(rank).copied().flatten().is_none() {
            return Vec::new();
        }
        self.program
            .outputs
            .iter()
            .map(|&o| (self.program.value(o).name.clone(), self.read(rank, o)))
            .collect()
    }

    /// The full parameters, put back together from the master shards of rank 0's optimizer
    /// group, by name, in layout order. In an asyncmesh plan, whose replicas differ by design,
    /// the mean over the replicas (every instance of the optimizer group), as decentralized
    /// training reports its model.
    pub fn parameters(&self) -> Vec<(String, Tensor)> {
        self.parameters_with(&HashMap::new())
    }

    /// [`Executor::parameters`] in one process of a multi-process run: the master shards of
    /// the ranks of other processes come from `others` (rank -> its
    /// [`Executor::master_shards`]). Parameters a rank needed for is missing from are left
    /// out.
    pub fn parameters_with(
        &self,
        others: &HashMap<usize, Vec<(String, Tensor)>>,
    ) -> Vec<(String, Tensor)> {
        let shard = |m: usize, v: ValueId| -> Option<Tensor> {
            if self.slot.get(m).copied().flatten().is_some() {
                return Some(self.read(m, v));
            }
            let name = &self.program.value(v).name;
            others
                .get(&m)?
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, t)| t.clone())
        };
        self.layouts
            .iter()
            .filter_map(|l| {
                let v = self.program.find_value(&l.name)?;
                let whole = |first: usize| -> Result<Vec<f32>, ()> {
                    let mut flat: Vec<f32> = Vec::with_capacity(l.padded);
                    for m in self.mesh.group_members(&l.optim_group, first).ok_or(())? {
                        flat.extend(shard(m, v).ok_or(())?.to_f32_vec());
                    }
                    flat.truncate(l.numel);
                    Ok(flat)
                };
                let flat =
                    assemble_layout(&self.mesh, l, self.world, self.replicas_differ, whole).ok()?;
                Some((l.name.clone(), Tensor::f32(l.shape.clone(), flat)))
            })
            .collect()
    }

    /// The parameter master shards of `rank` (a rank this process runs; empty otherwise),
    /// by name: what [`Executor::parameters_with`] needs of it.
    pub fn master_shards(&self, rank: usize) -> Vec<(String, Tensor)> {
        if self.slot.get(rank).copied().flatten().is_none() {
            return Vec::new();
        }
        let p = &self.program;
        p.params
            .iter()
            .filter(|x| self.layouts.iter().any(|l| l.name == p.value(x.value).name))
            .map(|x| (p.value(x.value).name.clone(), self.read(rank, x.value)))
            .collect()
    }

    /// The plan's mesh.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// How the plan cuts each parameter (and its optimizer states).
    pub fn layouts(&self) -> &[ParamLayout] {
        &self.layouts
    }

    /// Steps run so far.
    pub fn steps_run(&self) -> usize {
        self.steps_run
    }

    /// Every persistent value of `rank` (its parameter master shards, then its states:
    /// compute shards, optimizer moments, the step counter), by name, in program order:
    /// what a checkpoint keeps of the rank.
    pub fn persistent(&self, rank: usize) -> Vec<(String, Tensor)> {
        if self.slot.get(rank).copied().flatten().is_none() {
            return Vec::new();
        }
        let p = &self.program;
        crate::executor::persistent_values(p)
            .into_iter()
            .map(|v| (p.value(v).name.clone(), self.read(rank, v)))
            .collect()
    }

    /// Sets the persistent values of every rank (as [`Executor::persistent`] gives them):
    /// `per_rank[r]` must name each of rank r's parameters and states once, with its type.
    /// Every rank's values are checked; those of the ranks this process runs are set.
    pub fn restore(&mut self, per_rank: &[Vec<(String, Tensor)>]) -> Result<(), ExecError> {
        let matched = crate::executor::check_restore(&self.program, self.world, per_rank)?;
        for (r, values) in matched.into_iter().enumerate() {
            if self.slot[r].is_none() {
                continue;
            }
            for (v, t) in values {
                self.write(r, v, t)?;
            }
        }
        Ok(())
    }

    /// Counts `steps` as already run (a run resumed from a checkpoint numbers its steps on).
    pub fn set_steps_run(&mut self, steps: usize) {
        self.steps_run = steps;
    }

    /// The value named `name` on `rank` (persistent values hold their current contents;
    /// other values what the last step left).
    pub fn value(&self, rank: usize, name: &str) -> Option<Tensor> {
        let v = self.program.find_value(name)?;
        self.slot.get(rank)?.as_ref()?;
        Some(self.read(rank, v))
    }

    fn apply_updates(&self, rank: usize) {
        let Some(i) = self.slot[rank] else { return };
        let a = &self.arenas[i];
        match &self.staging {
            None => {
                for &(v, t) in &self.updates {
                    if v.off != t.off && v.bytes > 0 {
                        // SAFETY: all streams of this rank are done with the step and no
                        // collective reads it; value and target do not overlap here.
                        unsafe {
                            std::ptr::copy_nonoverlapping(a.ptr(v.off), a.ptr(t.off), v.bytes)
                        };
                    }
                }
            }
            Some(st) => {
                let s = &st[i];
                let mut at = 0;
                for &(v, _) in &self.updates {
                    // SAFETY: as above; the staging arena is this rank's own.
                    unsafe { std::ptr::copy_nonoverlapping(a.ptr(v.off), s.ptr(at), v.bytes) };
                    at += v.bytes.div_ceil(8) * 8;
                }
                let mut at = 0;
                for &(v, t) in &self.updates {
                    unsafe { std::ptr::copy_nonoverlapping(s.ptr(at), a.ptr(t.off), v.bytes) };
                    at += v.bytes.div_ceil(8) * 8;
                }
            }
        }
    }

    /// The flight report of the last run that failed (cleared by the next run that starts).
    pub fn flight_report(&self) -> Option<&FlightReport> {
        self.report.as_ref()
    }

    fn now_us(&self) -> u64 {
        self.born.elapsed().as_micros() as u64 + 1
    }

    /// The injected fault that strikes `rank` in `step`, if any.
    fn fault_at(&self, rank: usize, step: u64) -> Option<FaultKind> {
        match &self.opts.fault {
            Some(f) if f.rank == rank && f.step as u64 == step => Some(f.kind),
            _ => None,
        }
    }

    /// Every rank's record from the flight recorder.
    fn flight_report_of(&self, reason: &str, errors: &[Option<String>]) -> FlightReport {
        let p = &self.program;
        let ranks = (0..self.world)
            .map(|r| {
                let collectives = self
                    .recorder
                    .entries(r)
                    .into_iter()
                    .map(|(s, e)| {
                        let n = &p.nodes[e.node as usize];
                        let ms = |us: u64| (us > 0).then(|| us as f64 / 1000.0);
                        CollRecord {
                            seq: e.seq,
                            step: e.step,
                            stream: StreamKind::ALL[s].name().to_string(),
                            node: n.name.clone(),
                            op: n.op.name().to_string(),
                            group: n.op.group().map(|g| g.to_string()).unwrap_or_default(),
                            members: self
                                .comms
                                .get(e.comm as usize)
                                .and_then(Option::as_ref)
                                .map(|c| c.members().to_vec())
                                .unwrap_or_default(),
                            comm_seq: e.comm_seq,
                            bytes: e.bytes,
                            state: e.state,
                            issued_ms: e.issued_us as f64 / 1000.0,
                            started_ms: ms(e.started_us),
                            ended_ms: ms(e.ended_us),
                        }
                    })
                    .collect();
                RankRecord {
                    rank: r,
                    world: self.world,
                    reason: reason.to_string(),
                    error: errors.get(r).cloned().flatten(),
                    collectives,
                }
            })
            .collect();
        FlightReport {
            reason: reason.to_string(),
            ranks,
        }
    }

    /// Describes where thread `slot` is.
    fn where_is(&self, sh: &RunShared, slot: usize, now: u64) -> String {
        let (r, s, _) = &sh.lists[slot];
        let pr = &sh.progress[slot];
        let at = pr.at.load(Ordering::Relaxed);
        let since = pr.since.load(Ordering::Relaxed);
        let step = pr.step.load(Ordering::Relaxed);
        let who = format!("rank {r}'s {} thread", StreamKind::ALL[*s].name());
        let waited = Duration::from_micros(now.saturating_sub(since));
        match at {
            IDLE => format!("{who} is done"),
            AT_BARRIER => format!(
                "{who} has waited {:.1} s at the end of step {step} for the other threads",
                waited.as_secs_f64()
            ),
            AT_STEP_START => format!("{who} is stuck at the start of step {step}"),
            ni => {
                let ni = ni as usize;
                let n = &self.program.nodes[ni];
                if since == 0 {
                    return format!(
                        "{who} is running `{}` ({}) in step {step}",
                        n.name,
                        n.op.name()
                    );
                }
                match self.nodes[ni].kind {
                    Kind::Collective => {
                        let mut msg = format!(
                            "{who} has waited {:.1} s in {}",
                            waited.as_secs_f64(),
                            self.describe_collective(*r, ni, step)
                        );
                        if let Some(c) = self.comm_of[*r][ni] {
                            if let Some(comm) = &self.comms[c.comm] {
                                msg += "; ";
                                msg += &comm.waiting_note(c.member);
                            }
                        }
                        msg
                    }
                    _ => format!(
                        "{who} has waited {:.1} s in `{}` ({}) in step {step}",
                        waited.as_secs_f64(),
                        n.name,
                        n.op.name()
                    ),
                }
            }
        }
    }

    /// `name` (Op over group g, ranks [..], B bytes, step s).
    fn describe_collective(&self, rank: usize, ni: usize, step: u64) -> String {
        let n = &self.program.nodes[ni];
        let node = &self.nodes[ni];
        let bytes = crate::comm::collective_bytes(
            &n.op,
            node.ins.first().map_or(0, |(l, _)| l.bytes),
            node.outs.first().map_or(0, |(l, _)| l.bytes),
        );
        let members = self.comm_of[rank][ni]
            .and_then(|c| self.comms[c.comm].as_ref())
            .map(|c| format!("{:?}", c.members()))
            .unwrap_or_default();
        format!(
            "`{}` ({} over group {}, ranks {members}, {bytes} bytes, step {step})",
            n.name,
            n.op.name(),
            n.op.group().map(|g| g.to_string()).unwrap_or_default()
        )
    }

    /// The watchdog of one run (see [`ExecOptions::collective_timeout`]).
    fn watch(
        &self,
        sh: &RunShared,
        abort: &AtomicBool,
        finished: &AtomicUsize,
        failure: &Mutex<Option<ExecError>>,
        fail: &(dyn Fn(ExecError) + Sync),
    ) {
        let timeout = self
            .opts
            .collective_timeout
            .unwrap_or(crate::watchdog::DEFAULT_TIMEOUT);
        let grace = crate::watchdog::grace(timeout);
        let n = sh.lists.len();
        let poll = (timeout / 20).clamp(Duration::from_millis(1), Duration::from_millis(50));
        let limit = timeout.as_micros() as u64;
        let mut aborted_at: Option<Instant> = None;
        while finished.load(Ordering::Acquire) < n {
            std::thread::sleep(poll);
            if abort.load(Ordering::Relaxed) {
                let t = *aborted_at.get_or_insert_with(Instant::now);
                if t.elapsed() < grace || finished.load(Ordering::Acquire) == n {
                    continue;
                }
                let now = self.now_us();
                let stuck: Vec<String> = (0..n)
                    .filter(|&i| sh.progress[i].at.load(Ordering::Relaxed) != IDLE)
                    .map(|i| self.where_is(sh, i, now))
                    .collect();
                let reason = failure
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_ref()
                    .map(|e| e.to_string())
                    .unwrap_or_default();
                let errors = sh
                    .rank_errors
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                let report = self.flight_report_of(
                    &format!(
                        "{reason}; {} thread{} did not stop within {:.1} s of the abort: {}",
                        stuck.len(),
                        if stuck.len() == 1 { "" } else { "s" },
                        grace.as_secs_f64(),
                        stuck.join("; ")
                    ),
                    &errors,
                );
                if let Some(h) = &self.opts.on_stuck {
                    h(&report);
                }
                return;
            }
            let now = self.now_us();
            let overdue = sh.progress.iter().any(|p| {
                let since = p.since.load(Ordering::Relaxed);
                since != 0 && now.saturating_sub(since) > limit
            });
            if !overdue {
                continue;
            }
            // The waits, the collectives first (they name the rank that is missing), the
            // longest first; then the threads that are not waiting (one may be the cause).
            let mut waits: Vec<(u8, u64, usize)> = Vec::new();
            let mut running = Vec::new();
            for (i, p) in sh.progress.iter().enumerate() {
                let since = p.since.load(Ordering::Relaxed);
                let at = p.at.load(Ordering::Relaxed);
                if at == IDLE {
                    continue;
                }
                if since == 0 {
                    running.push(i);
                    continue;
                }
                let class = match at {
                    AT_BARRIER => 2,
                    ni if matches!(
                        self.nodes.get(ni as usize).map(|n| &n.kind),
                        Some(Kind::Collective)
                    ) =>
                    {
                        0
                    }
                    _ => 1,
                };
                waits.push((class, since, i));
            }
            waits.sort();
            let mut parts: Vec<String> = waits
                .iter()
                .take(6)
                .map(|&(_, _, i)| self.where_is(sh, i, now))
                .collect();
            if waits.len() > 6 {
                parts.push(format!("{} more threads wait", waits.len() - 6));
            }
            parts.extend(running.iter().take(4).map(|&i| self.where_is(sh, i, now)));
            fail(ExecError::Timeout(format!(
                "collective timeout ({:.1} s): {}",
                timeout.as_secs_f64(),
                parts.join("; ")
            )));
        }
    }

    fn loss(&self) -> Option<f64> {
        let o = *self.program.outputs.first()?;
        let l = self.loc[o.index()];
        // SAFETY: called after the end-of-step barrier, before updates of the next step.
        let b = unsafe { self.arenas[0].bytes(l.off, l.bytes) };
        scalar_f64(self.program.ty(o).dtype, b)
    }
}

fn global_type(per_rank: &TensorType, w: usize) -> TensorType {
    let mut shape = per_rank.shape.clone();
    if let Some(d) = shape.first_mut() {
        *d *= w;
    }
    TensorType::new(per_rank.dtype, shape)
}

struct ThreadCtx<'a> {
    ex: &'a Executor,
    rank: usize,
    stream: usize,
    list: &'a [usize],
    barrier: &'a StepBarrier,
    abort: &'a AtomicBool,
    events: &'a EventTable,
    sync_mode: bool,
    progress: &'a Progress,
}

/// A thread's reusable kernel scratch: the workspace and the view lists (so that running a
/// node allocates nothing once the first step has sized them).
#[derive(Default)]
struct Scratch<'a> {
    ws: Workspace,
    ins: Vec<TensorRef<'a>>,
    outs: Vec<TensorMut<'a>>,
}

impl<'a> ThreadCtx<'a> {
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        steps: usize,
        base_step: usize,
        epoch: Instant,
        stats: &[Mutex<Vec<[u64; 4]>>],
        walls: &Mutex<Vec<Duration>>,
        losses: &Mutex<Vec<Option<f64>>>,
        trace: &mut Vec<TraceEvent>,
        scratch: &mut Scratch<'a>,
    ) -> Result<(), ExecError> {
        let ex = self.ex;
        let leader = ex.local.first() == Some(&self.rank) && self.stream == 0;
        let run_err = ExecError::Run;
        for (k, step_stats) in stats.iter().enumerate().take(steps) {
            let stamp = (base_step + k + 1) as u64;
            self.progress.step.store(stamp, Ordering::Relaxed);
            self.barrier_wait().map_err(run_err)?;
            self.progress.set(AT_STEP_START, 0);
            if self.stream == 0 {
                match ex.fault_at(self.rank, stamp) {
                    Some(FaultKind::Panic) => panic!(
                        "injected fault (HZP_FAULT): rank {} panics at the start of step {stamp}",
                        self.rank
                    ),
                    Some(FaultKind::Hang) => loop {
                        // a thread stuck where no abort reaches it (as a hung kernel would be)
                        std::thread::sleep(Duration::from_secs(1));
                    },
                    _ => {}
                }
            }
            let t0 = Instant::now();
            // [busy per stream..., wait]
            let mut busy = [0u64; 3];
            let mut waited = 0u64;
            for &ni in self.list {
                let node = &ex.nodes[ni];
                let start = Instant::now();
                self.progress.at.store(ni as u64, Ordering::Relaxed);
                let charged = match node.kind {
                    Kind::Record(e) => {
                        self.events.record(e, stamp);
                        None
                    }
                    Kind::Wait(e) => {
                        self.progress.since.store(ex.now_us(), Ordering::Relaxed);
                        let r = self.events.wait(e, stamp, self.abort);
                        self.progress.since.store(0, Ordering::Relaxed);
                        r.map_err(run_err)?;
                        waited += start.elapsed().as_nanos() as u64;
                        None
                    }
                    Kind::Nop => None,
                    _ => {
                        self.exec_node(ni, stamp, scratch).map_err(|message| {
                            if message == crate::comm::ABORTED {
                                return ExecError::Run(message);
                            }
                            let n = &ex.program.nodes[ni];
                            ExecError::Node {
                                step: base_step + k + 1,
                                rank: self.rank,
                                node: n.name.clone(),
                                op: n.op.name(),
                                message,
                            }
                        })?;
                        Some(start.elapsed())
                    }
                };
                if let Some(d) = charged {
                    let ns = d.as_nanos() as u64;
                    busy[node.stream] += ns;
                    if self.sync_mode && matches!(node.kind, Kind::Collective) {
                        waited += ns;
                    }
                }
                if ex.opts.trace && !matches!(node.kind, Kind::Nop) {
                    trace.push(TraceEvent {
                        rank: self.rank,
                        stream: StreamKind::ALL[node.stream],
                        node: ni,
                        step: base_step + k + 1,
                        start: start - epoch,
                        dur: start.elapsed(),
                    });
                }
            }
            {
                let mut st = step_stats.lock().unwrap_or_else(|e| e.into_inner());
                for (s, &b) in busy.iter().enumerate() {
                    st[self.rank * 3 + s][0] += b;
                }
                if self.stream == 0 {
                    st[self.rank * 3][1] += waited;
                }
            }
            self.barrier_wait().map_err(run_err)?;
            if leader {
                losses
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(ex.loss());
            }
            if self.stream == 0 {
                ex.apply_updates(self.rank);
            }
            self.barrier_wait().map_err(run_err)?;
            if leader {
                walls
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(t0.elapsed());
            }
        }
        Ok(())
    }

    /// The step barrier, watched.
    fn barrier_wait(&self) -> Result<(), String> {
        self.progress.set(AT_BARRIER, self.ex.now_us());
        let r = self.barrier.wait(self.abort);
        self.progress.since.store(0, Ordering::Relaxed);
        r
    }

    /// Runs one collective node: flight recorder, watchdog progress, injected faults.
    fn exec_collective(&self, ni: usize, step: u64) -> Result<(), String> {
        let ex = self.ex;
        let node = &ex.nodes[ni];
        let op = &ex.program.nodes[ni].op;
        let arena = ex.arena(self.rank).map_err(|e| e.to_string())?;
        let c = ex.comm_of[self.rank][ni].ok_or("no communicator")?;
        let comm = ex.comms[c.comm].as_ref().ok_or("no communicator")?;
        let (i, ity) = &node.ins[0];
        let (o, _) = &node.outs[0];
        let mut in_len = i.bytes;
        if ex.first_collective == Some(ni) {
            match ex.fault_at(self.rank, step) {
                Some(FaultKind::SkipCollective) => return Ok(()),
                Some(FaultKind::WrongBytes) => {
                    // one element short (long when there is none): the others must notice
                    let es = ity.dtype.size_bytes();
                    in_len = if in_len >= es {
                        in_len - es
                    } else {
                        in_len + es
                    };
                }
                _ => {}
            }
        }
        let link = match (&ex.opts.link, op.group()) {
            (Some(l), Some(g)) => Some((l.as_ref(), g)),
            _ => None,
        };
        let bytes = crate::comm::collective_bytes(op, i.bytes, o.bytes);
        let (rank, stream) = (self.rank, node.stream);
        let rec = &ex.recorder;
        rec.issue(
            rank,
            stream,
            step,
            ni,
            c.comm,
            comm.calls_of(c.member),
            bytes,
            ex.now_us(),
        );
        self.progress.since.store(ex.now_us(), Ordering::Relaxed);
        let started = || rec.mark(rank, stream, CollState::Started, ex.now_us());
        // SAFETY: the input and output buffers stay in use by this node until the call
        // returns (the plan's buffer discipline); a short `in_len` is refused before any
        // member reads.
        let r = unsafe {
            comm.run(
                c.member,
                op,
                ity.dtype,
                &ity.shape,
                arena.ptr(i.off),
                in_len,
                arena.ptr(o.off),
                o.bytes,
                link.map(|(l, g)| (l as &dyn LinkModel, g as &Group)),
                self.abort,
                ni,
                Some(&started),
            )
        };
        self.progress.since.store(0, Ordering::Relaxed);
        let state = if r.is_ok() {
            CollState::Completed
        } else {
            CollState::Failed
        };
        rec.mark(rank, stream, state, ex.now_us());
        r.map_err(|m| {
            if m == crate::comm::ABORTED {
                m
            } else {
                format!(
                    "{m} (group {}, ranks {:?}, {bytes} bytes per rank)",
                    op.group().map(|g| g.to_string()).unwrap_or_default(),
                    comm.members()
                )
            }
        })
    }

    /// Runs a compute, move or collective node of this thread's rank.
    fn exec_node(&self, ni: usize, step: u64, scratch: &mut Scratch<'a>) -> Result<(), String> {
        let ex = self.ex;
        let node = &ex.nodes[ni];
        let arena = ex.arena(self.rank).map_err(|e| e.to_string())?;
        let op = &ex.program.nodes[ni].op;
        match node.kind {
            Kind::Move => {
                let (i, _) = &node.ins[0];
                let (o, _) = &node.outs[0];
                if i.bytes != o.bytes {
                    return Err(format!(
                        "moves {} bytes into a {}-byte result",
                        i.bytes, o.bytes
                    ));
                }
                if i.off == o.off {
                    // the result shares its input's bytes (checked in `new`): nothing to move
                    return Ok(());
                }
                // SAFETY: the plan keeps a node's result apart from its inputs (checked in
                // `new`) and from every buffer in use meanwhile (the verifier).
                unsafe {
                    std::ptr::copy_nonoverlapping(arena.ptr(i.off), arena.ptr(o.off), i.bytes)
                };
                Ok(())
            }
            Kind::Collective => self.exec_collective(ni, step),
            Kind::MatMul(ref stored) => {
                let ([(la, ta), (lb, tb)], [(lc, tc)]) = (&node.ins[..], &node.outs[..]) else {
                    return Err("internal: a MatMul takes two inputs and one result".into());
                };
                // SAFETY: inputs are not written while this node runs, the result's bytes
                // are this node's alone (see the generic case below); offsets are 8-aligned
                // and hold values of these types.
                let (a, b, mut c) = unsafe {
                    (
                        data_ref(ta.dtype, arena.bytes(la.off, la.bytes)),
                        data_ref(tb.dtype, arena.bytes(lb.off, lb.bytes)),
                        data_mut(tc.dtype, arena.bytes_mut(lc.off, lc.bytes)),
                    )
                };
                crate::cpu::matmul::matmul_stored(
                    (a, &ta.shape, stored[0].as_deref()),
                    (b, &tb.shape, stored[1].as_deref()),
                    &mut c,
                    &mut scratch.ws,
                )
            }
            _ if matches!(op, Op::ScatterND { .. }) && node.ins[0].0.off == node.outs[0].0.off => {
                let add = matches!(op, Op::ScatterND { add: true });
                // over the data's own bytes (a declared in-place pair): scatter only
                let (idx, upd, (o, oty)) = (&node.ins[1], &node.ins[2], &node.outs[0]);
                // SAFETY: indices and updates are other values (not written while this node
                // runs); the result's bytes are the data's, which nothing else reads now.
                let (idx, upd, mut out) = unsafe {
                    (
                        TensorRef {
                            shape: &idx.1.shape,
                            data: data_ref(idx.1.dtype, arena.bytes(idx.0.off, idx.0.bytes)),
                        },
                        TensorRef {
                            shape: &upd.1.shape,
                            data: data_ref(upd.1.dtype, arena.bytes(upd.0.off, upd.0.bytes)),
                        },
                        data_mut(oty.dtype, arena.bytes_mut(o.off, o.bytes)),
                    )
                };
                crate::cpu::scatter_nd_in_place(
                    oty.dtype,
                    &oty.shape,
                    &idx,
                    &upd,
                    add,
                    &mut out,
                    &mut scratch.ws,
                )
            }
            _ if matches!(op, Op::AdamW { .. }) => self.exec_in_place(op, node, arena),
            _ => {
                scratch.ins.clear();
                scratch.outs.clear();
                for (l, ty) in &node.ins {
                    // SAFETY: inputs are not written while this node runs; offsets are
                    // 8-aligned and hold values of this type.
                    let data = unsafe { data_ref(ty.dtype, arena.bytes(l.off, l.bytes)) };
                    scratch.ins.push(TensorRef {
                        shape: &ty.shape,
                        data,
                    });
                }
                for (l, ty) in &node.outs {
                    // SAFETY: the result's buffer is this node's alone while it runs (the
                    // plan's buffer discipline; `new` checked it overlaps no input).
                    let data = unsafe { data_mut(ty.dtype, arena.bytes_mut(l.off, l.bytes)) };
                    scratch.outs.push(TensorMut {
                        shape: &ty.shape,
                        data,
                    });
                }
                let r = eval_op_into(op, &scratch.ins, &mut scratch.outs, &mut scratch.ws);
                scratch.ins.clear();
                scratch.outs.clear();
                r
            }
        }
    }
}

impl ThreadCtx<'_> {
    /// Runs an op whose results may lie exactly in the bytes of inputs they replace
    /// (`Op::in_place_pairs`) through its raw-pointer kernel: no slice of an input is ever
    /// alive while the result over it is written.
    fn exec_in_place(&self, op: &Op, node: &NodeRt, arena: &Arena) -> Result<(), String> {
        match op {
            Op::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let (ins, outs) = (&node.ins, &node.outs);
                if ins.len() != 7 || outs.len() != 3 {
                    return Err("internal: AdamW with a wrong arity".into());
                }
                let n = ins[0].1.numel();
                let scalar = |k: usize| -> Result<f32, String> {
                    let (l, ty) = &ins[k];
                    // SAFETY: a 4-byte scalar input, not written while this node runs.
                    let b = unsafe { arena.bytes(l.off, l.bytes) };
                    match scalar_f64(ty.dtype, b) {
                        Some(x) => Ok(x as f32),
                        None => Err("AdamW: a scalar input is not one f32".into()),
                    }
                };
                let c = crate::cpu::optim::AdamWStep::new(
                    (*beta1, *beta2, *eps, *weight_decay),
                    scalar(4)?,
                    scalar(5)?,
                    scalar(6)?,
                );
                let p = |l: &Loc| arena.ptr(l.off) as *mut f32;
                // SAFETY: `new` checked that each result overlaps no input except exactly
                // the one it replaces; the plan keeps all seven buffers to this node while
                // it runs; every buffer holds n f32 (the type rule).
                unsafe {
                    crate::cpu::optim::adamw_raw(
                        n,
                        &c,
                        p(&ins[0].0),
                        p(&ins[1].0),
                        p(&ins[2].0),
                        p(&ins[3].0),
                        p(&outs[0].0),
                        p(&outs[1].0),
                        p(&outs[2].0),
                    )
                };
                Ok(())
            }
            other => Err(format!("internal: no in-place kernel for {}", other.name())),
        }
    }
}

impl PlanExecutor for Executor {
    fn device(&self) -> String {
        "the CPU".into()
    }

    fn program(&self) -> &Program {
        &self.program
    }

    fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    fn layouts(&self) -> &[ParamLayout] {
        &self.layouts
    }

    fn replicas_differ(&self) -> bool {
        self.replicas_differ
    }

    fn local_ranks(&self) -> &[usize] {
        &self.local
    }

    fn set_inputs(&mut self, global: &[(String, Tensor)]) -> Result<(), ExecError> {
        Executor::set_inputs(self, global)
    }

    fn step(&mut self) -> Result<StepStats, ExecError> {
        Executor::step(self)
    }

    fn run(&mut self, steps: usize) -> Result<Vec<StepStats>, ExecError> {
        // the threads are started once for all the steps
        Executor::run(self, steps)
    }

    fn steps_run(&self) -> usize {
        self.steps_run
    }

    fn set_steps_run(&mut self, steps: usize) {
        self.steps_run = steps;
    }

    fn master_shards(&self, rank: usize) -> Result<Vec<(String, Tensor)>, ExecError> {
        self.arena(rank)?;
        Ok(Executor::master_shards(self, rank))
    }

    fn persistent(&self, rank: usize) -> Result<Vec<(String, Tensor)>, ExecError> {
        self.arena(rank)?;
        Ok(Executor::persistent(self, rank))
    }

    fn restore(&mut self, per_rank: &[Vec<(String, Tensor)>]) -> Result<(), ExecError> {
        Executor::restore(self, per_rank)
    }

    fn value(&self, rank: usize, name: &str) -> Result<Option<Tensor>, ExecError> {
        Ok(Executor::value(self, rank, name))
    }

    fn flight_report(&self) -> Option<FlightReport> {
        self.report.clone()
    }

    fn trace(&self) -> &[TraceEvent] {
        &self.trace
    }
}
