//! An in-process communicator: the ranks of a mesh are threads of one process, and each
//! collective is a real exchange of data between them.
//!
//! One [`Communicator`] serves one group instance (the ranks of one group, in
//! [`hzp_ir::Mesh::group_members`] order) on one stream, as NCCL communicators do: its members
//! call [`Communicator::run`] with the same collectives in the same order. A call is a
//! rendezvous: every member publishes where its input and output bytes are, then each member
//! computes its own part of the result by reading the others' inputs in place (no staging
//! copies), and no member leaves before every member has finished reading.
//!
//! Results are exactly those of the lockstep reference runner ([`crate::dist::spmd::ReferenceRunner`]):
//! reductions run in member order (`((x0 + x1) + x2) + ...`, each partial result rounded to
//! the dtype as the `Add` kernel rounds it), so a run is reproducible bit for bit. An
//! all-reduce is split by elements: member `i` reduces the `i`-th chunk and writes it into
//! every member's output, which is the same arithmetic per element, done once.
//!
//! Links can be emulated: a [`LinkModel`] says how long a collective takes, and the call does
//! not return before that time has passed since the last member arrived.

pub mod rendezvous;
pub mod tcp;

use half::{bf16, f16};
use hzp_ir::{DType, Group, Op, ReduceOp};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a collective takes on emulated links.
pub trait LinkModel: Send + Sync {
    /// The duration of `op` over `group` moving `bytes` per rank (the output of an
    /// all-gather, the input of the other collectives); an error when the model's time is
    /// not a duration this machine can wait for.
    fn duration(&self, op: &Op, group: &Group, bytes: u64) -> Result<Duration, String>;
}

/// The bytes per rank a [`LinkModel`] is asked about: the output of an all-gather, the input
/// otherwise (the convention of the cost model).
pub fn collective_bytes(op: &Op, in_bytes: usize, out_bytes: usize) -> u64 {
    match op {
        Op::AllGather { .. } => out_bytes as u64,
        _ => in_bytes as u64,
    }
}

/// Where one member's operands are (set before the arrival barrier, read after it).
#[derive(Default)]
struct Slot {
    /// The caller's label of the collective (the executor: the node's index), compared
    /// across members so that a rank that issued another collective is named.
    node: AtomicUsize,
    /// Calls this member has entered.
    calls: AtomicU64,
    input: AtomicUsize,
    input_len: AtomicUsize,
    output: AtomicUsize,
    output_len: AtomicUsize,
}

#[derive(Default)]
struct Round {
    arrived: usize,
    arrive_gen: u64,
    ready_at: Option<Instant>,
    done: usize,
    done_gen: u64,
    /// An error any member found in its arguments; every member returns it.
    error: Option<String>,
}

/// One group instance on one stream (see the [module docs](self)).
pub struct Communicator {
    n: usize,
    /// The global ranks of the members, for messages.
    members: Vec<usize>,
    /// Names of the callers' labels (the executor's node names), for messages.
    labels: Option<Arc<[String]>>,
    slots: Vec<Slot>,
    round: Mutex<Round>,
    cv: Condvar,
}

/// How the members wait: an abort flag (set when any thread of the run fails) is polled so
/// that a failed run never hangs.
const POLL: Duration = Duration::from_millis(20);

/// The reason a wait ended without its condition.
pub const ABORTED: &str = "aborted: another rank or stream failed";

impl Communicator {
    /// A communicator for `n` members.
    pub fn new(n: usize) -> Communicator {
        Communicator::with_members((0..n.max(1)).collect(), None)
    }

    /// A communicator of the ranks `members` (in member order); `labels` names the labels
    /// callers pass to [`Communicator::run`] (node names), so that a mismatch names them.
    pub fn with_members(members: Vec<usize>, labels: Option<Arc<[String]>>) -> Communicator {
        let n = members.len().max(1);
        let members = if members.is_empty() { vec![0] } else { members };
        Communicator {
            n,
            members,
            labels,
            slots: (0..n).map(|_| Slot::default()).collect(),
            round: Mutex::new(Round::default()),
            cv: Condvar::new(),
        }
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.n
    }

    /// The members' global ranks, in member order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// How many calls each member has entered so far (a member behind the others has not
    /// issued a collective they wait in).
    pub fn calls(&self) -> Vec<u64> {
        self.slots
            .iter()
            .map(|s| s.calls.load(Ordering::Relaxed))
            .collect()
    }

    /// Calls member `m` has entered so far.
    pub fn calls_of(&self, m: usize) -> u64 {
        self.slots
            .get(m)
            .map_or(0, |s| s.calls.load(Ordering::Relaxed))
    }

    fn label(&self, node: usize) -> String {
        match self.labels.as_deref().and_then(|l| l.get(node)) {
            Some(name) => format!("`{name}`"),
            None => format!("#{node}"),
        }
    }

    /// Compares every member's call with member 0's (called by the last to arrive, when all
    /// have published): a different label or byte count is a mismatch that names both.
    fn check_same_call(&self, call: u64) -> Result<(), String> {
        let sig = |j: usize| {
            let s = &self.slots[j];
            (
                s.node.load(Ordering::Relaxed),
                s.input_len.load(Ordering::Relaxed),
                s.output_len.load(Ordering::Relaxed),
            )
        };
        let first = sig(0);
        for j in 1..self.n {
            let other = sig(j);
            if other != first {
                return Err(format!(
                    "collective mismatch: call {call} of the communicator of ranks {:?} is {} ({} bytes in, {} out) on rank {} but {} ({} bytes in, {} out) on rank {}",
                    self.members,
                    self.label(first.0),
                    first.1,
                    first.2,
                    self.members[0],
                    self.label(other.0),
                    other.1,
                    other.2,
                    self.members[j],
                ));
            }
        }
        Ok(())
    }

    /// Runs one collective as member `me`. `dtype` and `in_shape` describe the input (the
    /// same on every member); `input`/`output` are this member's bytes. Returns when the
    /// result is in `output` (and, with `link`, not before the emulated duration).
    ///
    /// # Safety
    /// `input` must stay valid and unmodified, and `output` valid and not accessed by
    /// anyone else, until the call returns; other members read `input` and (all-reduce)
    /// write `output` from their threads meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        &self,
        me: usize,
        op: &Op,
        dtype: DType,
        in_shape: &[usize],
        input: *const u8,
        input_len: usize,
        output: *mut u8,
        output_len: usize,
        link: Option<(&dyn LinkModel, &Group)>,
        abort: &AtomicBool,
        node: usize,
        on_start: Option<&dyn Fn()>,
    ) -> Result<(), String> {
        let n = self.n;
        if me >= n {
            return Err(format!("member {me} of a communicator of {n}"));
        }
        let slot = &self.slots[me];
        let call = slot.calls.fetch_add(1, Ordering::Relaxed);
        slot.node.store(node, Ordering::Relaxed);
        slot.input.store(input as usize, Ordering::Relaxed);
        slot.input_len.store(input_len, Ordering::Relaxed);
        slot.output.store(output as usize, Ordering::Relaxed);
        slot.output_len.store(output_len, Ordering::Relaxed);
        let mine = check_args(op, dtype, in_shape, n, input_len, output_len)
            .map_err(|e| format!("rank {}: {e}", self.members[me]));

        // Arrive: the mutex orders the slot stores before every member's reads.
        let ready_at = {
            let mut r = self.lock()?;
            if let Err(e) = &mine {
                r.error.get_or_insert_with(|| e.clone());
            }
            let gen = r.arrive_gen;
            r.arrived += 1;
            if r.arrived == n {
                if let Err(e) = self.check_same_call(call) {
                    // the mismatch explains a member's argument error better than it does
                    r.error = Some(e);
                }
                r.arrived = 0;
                r.arrive_gen += 1;
                r.ready_at = Some(Instant::now());
                self.cv.notify_all();
            } else {
                while r.arrive_gen == gen {
                    r = self.wait(r, abort)?;
                }
            }
            (r.ready_at.unwrap_or_else(Instant::now), r.error.clone())
        };
        let (ready_at, error) = ready_at;
        if let (None, Some(f)) = (&error, on_start) {
            f();
        }
        let result = match error {
            Some(e) => Err(e),
            // SAFETY: every member has published valid operands (the caller's contract),
            // checked against the op's shapes above.
            None => unsafe { self.compute(me, op, dtype, in_shape) },
        };

        // Leave together: nobody's input may change before everyone has read it.
        {
            let mut r = self.lock()?;
            let gen = r.done_gen;
            r.done += 1;
            if r.done == n {
                r.done = 0;
                r.done_gen += 1;
                r.error = None;
                self.cv.notify_all();
            } else {
                while r.done_gen == gen {
                    r = self.wait(r, abort)?;
                }
            }
        }
        if let (Some((model, group)), Ok(())) = (link, &result) {
            let bytes = collective_bytes(op, input_len, output_len);
            let until = model.duration(op, group, bytes).and_then(|d| {
                ready_at.checked_add(d).ok_or_else(|| {
                    format!(
                        "the emulated link time of {d:?} for {bytes} bytes is too long to wait for"
                    )
                })
            });
            match until {
                Ok(until) => {
                    let now = Instant::now();
                    if until > now {
                        std::thread::sleep(until - now);
                    }
                }
                Err(e) => {
                    return Err(format!(
                        "rank {}: {} on emulated links: {e}",
                        self.members[me],
                        op.name()
                    ))
                }
            }
        }
        result
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Round>, String> {
        self.round
            .lock()
            .map_err(|_| "a communicator's lock was poisoned".to_string())
    }

    fn wait<'a>(
        &self,
        g: std::sync::MutexGuard<'a, Round>,
        abort: &AtomicBool,
    ) -> Result<std::sync::MutexGuard<'a, Round>, String> {
        if abort.load(Ordering::Relaxed) {
            return Err(ABORTED.into());
        }
        self.cv
            .wait_timeout(g, POLL)
            .map(|(g, _)| g)
            .map_err(|_| "a communicator's lock was poisoned".to_string())
    }

    fn input(&self, j: usize) -> (*const u8, usize) {
        let s = &self.slots[j];
        (
            s.input.load(Ordering::Relaxed) as *const u8,
            s.input_len.load(Ordering::Relaxed),
        )
    }

    fn output(&self, j: usize) -> *mut u8 {
        self.slots[j].output.load(Ordering::Relaxed) as *mut u8
    }

    /// # Safety
    /// Between the two barriers of [`Communicator::run`], with checked operands.
    unsafe fn compute(&self, me: usize, op: &Op, dtype: DType, s: &[usize]) -> Result<(), String> {
        let n = self.n;
        let inputs: Vec<*const u8> = (0..n).map(|j| self.input(j).0).collect();
        let out = self.output(me);
        if let Op::AllReduce { reduce, .. } = op {
            // Split by elements: this member reduces its chunk once, into its own output,
            // then copies it to the others' outputs (the same arithmetic per element as
            // every member reducing the whole).
            let es = dtype.size_bytes();
            let total: usize = s.iter().product();
            let (lo, hi) = (total * me / n, total * (me + 1) / n);
            let dst = out.add(lo * es);
            reduce_run(&inputs, dtype, *reduce, lo, dst, hi - lo);
            for j in (0..n).filter(|&j| j != me) {
                std::ptr::copy_nonoverlapping(dst, self.output(j).add(lo * es), (hi - lo) * es);
            }
            return Ok(());
        }
        member_result(me, op, dtype, s, &inputs, out)
    }
}

/// Member `me`'s result of collective `op` from every member's input (`inputs[j]`: member
/// j's bytes, `dtype` and shape `s` each) into `out`: the one arithmetic of every
/// communicator (the threads' [`Communicator`] and the processes' [`tcp::TcpCommunicator`]),
/// reductions in member order, so both give the same bits.
///
/// # Safety
/// The operands were checked with [`check_args`]; every input holds `s` elements, `out` the
/// result, and nothing writes them meanwhile.
pub(crate) unsafe fn member_result(
    me: usize,
    op: &Op,
    dtype: DType,
    s: &[usize],
    inputs: &[*const u8],
    out: *mut u8,
) -> Result<(), String> {
    let n = inputs.len();
    let es = dtype.size_bytes();
    match op {
        Op::AllGather { axis, .. } => {
            let outer: usize = s[..*axis].iter().product();
            let blk = s[*axis..].iter().product::<usize>() * es;
            for (j, &src) in inputs.iter().enumerate() {
                for o in 0..outer {
                    std::ptr::copy_nonoverlapping(
                        src.add(o * blk),
                        out.add((o * n + j) * blk),
                        blk,
                    );
                }
            }
        }
        Op::ReduceScatter { axis, reduce, .. } => {
            let outer: usize = s[..*axis].iter().product();
            let inner: usize = s[*axis + 1..].iter().product();
            let len = s[*axis] / n;
            let run = len * inner;
            for o in 0..outer {
                let src = (o * s[*axis] + me * len) * inner;
                reduce_run(inputs, dtype, *reduce, src, out.add(o * run * es), run);
            }
        }
        Op::AllReduce { reduce, .. } => {
            let total: usize = s.iter().product();
            reduce_run(inputs, dtype, *reduce, 0, out, total);
        }
        Op::AllToAll {
            split_axis,
            concat_axis,
            ..
        } => {
            // Member j's piece `me` along split_axis goes to block j along concat_axis.
            let mut piece = s.to_vec();
            piece[*split_axis] /= n;
            let mut out_shape = piece.clone();
            out_shape[*concat_axis] *= n;
            for (j, &src) in inputs.iter().enumerate() {
                let mut src_at = vec![0; s.len()];
                src_at[*split_axis] = me * piece[*split_axis];
                let mut dst_at = vec![0; s.len()];
                dst_at[*concat_axis] = j * piece[*concat_axis];
                copy_block(src, s, &src_at, out, &out_shape, &dst_at, &piece, es);
            }
        }
        Op::Broadcast { root, .. } => {
            let len = s.iter().product::<usize>() * es;
            std::ptr::copy_nonoverlapping(inputs[*root], out, len);
        }
        other => return Err(format!("{} is not a collective", other.name())),
    }
    Ok(())
}

/// The communicator of one group instance on one stream, as the executor holds it: the
/// members are threads of this process ([`Communicator`]), or this process's member talks to
/// the others over TCP ([`tcp::TcpCommunicator`]). Both compute results with the same
/// arithmetic (`member_result`), so they give the same bits.
pub enum GroupComm {
    Threads(Communicator),
    Tcp(tcp::TcpCommunicator),
}

impl GroupComm {
    /// The members' global ranks, in member order.
    pub fn members(&self) -> &[usize] {
        match self {
            GroupComm::Threads(c) => c.members(),
            GroupComm::Tcp(c) => c.members(),
        }
    }

    /// Calls member `m` has entered (over TCP only this process's member is known; the
    /// others count as 0).
    pub fn calls_of(&self, m: usize) -> u64 {
        match self {
            GroupComm::Threads(c) => c.calls_of(m),
            GroupComm::Tcp(c) if c.member() == m => c.calls(),
            GroupComm::Tcp(_) => 0,
        }
    }

    /// Which members a call of member `m` waits for, in words (for the watchdog).
    pub fn waiting_note(&self, m: usize) -> String {
        match self {
            GroupComm::Threads(c) => {
                let calls = c.calls();
                let mine = calls.get(m).copied().unwrap_or(0);
                let behind: Vec<String> = c
                    .members()
                    .iter()
                    .zip(&calls)
                    .filter(|(_, &k)| k < mine)
                    .map(|(r, k)| format!("rank {r} ({k})"))
                    .collect();
                if behind.is_empty() {
                    "every member has issued it".into()
                } else {
                    format!(
                        "not issued by {} (calls entered on this communicator; rank {}: {mine})",
                        behind.join(", "),
                        c.members().get(m).copied().unwrap_or(0)
                    )
                }
            }
            GroupComm::Tcp(c) => match c.waiting_for() {
                Some(r) => format!(
                    "waiting for rank {r}'s data (call {} on this communicator)",
                    c.calls()
                ),
                None => "every member's data has arrived".into(),
            },
        }
    }

    /// Runs one collective as member `me` (see [`Communicator::run`]).
    ///
    /// # Safety
    /// As [`Communicator::run`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        &self,
        me: usize,
        op: &Op,
        dtype: DType,
        in_shape: &[usize],
        input: *const u8,
        input_len: usize,
        output: *mut u8,
        output_len: usize,
        link: Option<(&dyn LinkModel, &Group)>,
        abort: &AtomicBool,
        node: usize,
        on_start: Option<&dyn Fn()>,
    ) -> Result<(), String> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match self {
                GroupComm::Threads(c) => c.run(
                    me, op, dtype, in_shape, input, input_len, output, output_len, link, abort,
                    node, on_start,
                ),
                GroupComm::Tcp(c) => c.run(
                    me, op, dtype, in_shape, input, input_len, output, output_len, link, abort,
                    node, on_start,
                ),
            }
        }
    }
}

/// Checks one member's operands against the op (sizes, divisibility, supported reduction).
pub(crate) fn check_args(
    op: &Op,
    dtype: DType,
    s: &[usize],
    n: usize,
    input_len: usize,
    output_len: usize,
) -> Result<(), String> {
    let es = dtype.size_bytes();
    let numel: usize = s.iter().product();
    let name = op.name();
    if input_len != numel * es {
        return Err(format!(
            "{name}: the input holds {input_len} bytes, {dtype}{s:?} needs {}",
            numel * es
        ));
    }
    let axis_ok = |a: usize| -> Result<(), String> {
        if a >= s.len() {
            return Err(format!("{name}: axis {a} is out of range for {s:?}"));
        }
        Ok(())
    };
    let divisible = |a: usize| -> Result<(), String> {
        axis_ok(a)?;
        if !s[a].is_multiple_of(n) {
            return Err(format!(
                "{name}: dim {a} of {s:?} does not divide by the group size {n}"
            ));
        }
        Ok(())
    };
    let want_out = match op {
        Op::AllGather { axis, .. } => {
            axis_ok(*axis)?;
            numel * n
        }
        Op::ReduceScatter { axis, reduce, .. } => {
            divisible(*axis)?;
            check_reduce(*reduce, dtype)?;
            numel / n
        }
        Op::AllReduce { reduce, .. } => {
            check_reduce(*reduce, dtype)?;
            numel
        }
        Op::AllToAll {
            split_axis,
            concat_axis,
            ..
        } => {
            divisible(*split_axis)?;
            axis_ok(*concat_axis)?;
            numel
        }
        Op::Broadcast { root, .. } => {
            if *root >= n {
                return Err(format!(
                    "{name}: root {root} is not below the group size {n}"
                ));
            }
            numel
        }
        other => return Err(format!("{} is not a collective", other.name())),
    };
    if output_len != want_out * es {
        return Err(format!(
            "{name}: the output holds {output_len} bytes, the result needs {}",
            want_out * es
        ));
    }
    Ok(())
}

fn check_reduce(how: ReduceOp, dtype: DType) -> Result<(), String> {
    if dtype == DType::Bool && matches!(how, ReduceOp::Mean) {
        return Err("a mean reduction of bool data".into());
    }
    Ok(())
}

/// Copies a `block`-shaped box from `src` (of shape `ss`, starting at `sa`) into `dst` (of
/// shape `ds`, starting at `da`); elements of `es` bytes, row-major.
///
/// # Safety
/// Both boxes lie inside their buffers.
#[allow(clippy::too_many_arguments)]
unsafe fn copy_block(
    src: *const u8,
    ss: &[usize],
    sa: &[usize],
    dst: *mut u8,
    ds: &[usize],
    da: &[usize],
    block: &[usize],
    es: usize,
) {
    block_runs(ss, sa, ds, da, block, es, |so, d_o, n| {
        std::ptr::copy_nonoverlapping(src.add(so), dst.add(d_o), n)
    });
}

/// The contiguous runs of a `block`-shaped box taken from a row-major tensor of shape `ss`
/// (box corner `sa`) to one of shape `ds` (corner `da`), elements of `es` bytes: `run(source
/// byte offset, destination byte offset, bytes)` once per row of the box's last axis, in
/// row-major order. The one walk both the CPU communicator and the CUDA transport plan
/// (`cuda::transport`) copy by.
pub(crate) fn block_runs(
    ss: &[usize],
    sa: &[usize],
    ds: &[usize],
    da: &[usize],
    block: &[usize],
    es: usize,
    mut run: impl FnMut(usize, usize, usize),
) {
    let r = block.len();
    if r == 0 {
        run(0, 0, es);
        return;
    }
    if block.contains(&0) {
        return;
    }
    let strides = |shape: &[usize]| -> Vec<usize> {
        let mut st = vec![1usize; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            st[i] = st[i + 1] * shape[i + 1];
        }
        st
    };
    let (sst, dst_st) = (strides(ss), strides(ds));
    let bytes = block[r - 1] * es;
    let mut idx = vec![0usize; r - 1];
    loop {
        let mut so = sa[r - 1];
        let mut d_o = da[r - 1];
        for k in 0..r - 1 {
            so += (sa[k] + idx[k]) * sst[k];
            d_o += (da[k] + idx[k]) * dst_st[k];
        }
        run(so * es, d_o * es, bytes);
        // next index over the outer dims
        let mut k = r - 1;
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            idx[k] += 1;
            if idx[k] < block[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

/// Reduces elements `from..from + count` of every member's input (`inputs`, in member
/// order) into `dst`.
///
/// # Safety
/// Every input holds at least `from + count` elements of `dtype`, `dst` `count`.
unsafe fn reduce_run(
    inputs: &[*const u8],
    dtype: DType,
    how: ReduceOp,
    from: usize,
    dst: *mut u8,
    count: usize,
) {
    if count == 0 {
        return;
    }
    let n = inputs.len();
    macro_rules! go {
        ($t:ty, $add:expr, $mul:expr, $max:expr, $min:expr, $inv:expr) => {{
            let dst = std::slice::from_raw_parts_mut(dst as *mut $t, count);
            let p0 = inputs[0];
            let first = std::slice::from_raw_parts((p0 as *const $t).add(from), count);
            dst.copy_from_slice(first);
            for j in 1..n {
                let pj = inputs[j];
                let x = std::slice::from_raw_parts((pj as *const $t).add(from), count);
                match how {
                    ReduceOp::Sum | ReduceOp::Mean => {
                        dst.iter_mut().zip(x).for_each(|(a, &b)| *a = $add(*a, b))
                    }
                    ReduceOp::Prod => dst.iter_mut().zip(x).for_each(|(a, &b)| *a = $mul(*a, b)),
                    ReduceOp::Max => dst.iter_mut().zip(x).for_each(|(a, &b)| *a = $max(*a, b)),
                    ReduceOp::Min => dst.iter_mut().zip(x).for_each(|(a, &b)| *a = $min(*a, b)),
                }
            }
            if how == ReduceOp::Mean {
                let s: $t = $inv(n);
                dst.iter_mut().for_each(|a| *a = $mul(*a, s));
            }
        }};
    }
    fn fmax(a: f32, b: f32) -> f32 {
        if a.is_nan() || b.is_nan() {
            f32::NAN
        } else {
            a.max(b)
        }
    }
    fn fmin(a: f32, b: f32) -> f32 {
        if a.is_nan() || b.is_nan() {
            f32::NAN
        } else {
            a.min(b)
        }
    }
    fn half2<T>(
        to: fn(T) -> f32,
        from: fn(f32) -> T,
        f: fn(f32, f32) -> f32,
    ) -> impl Fn(T, T) -> T {
        move |a, b| from(f(to(a), to(b)))
    }
    match dtype {
        DType::F32 => go!(
            f32,
            |a: f32, b: f32| a + b,
            |a: f32, b: f32| a * b,
            fmax,
            fmin,
            |n: usize| (1.0 / n as f64) as f32
        ),
        DType::BF16 => go!(
            bf16,
            half2(bf16::to_f32, bf16::from_f32, |a, b| a + b),
            half2(bf16::to_f32, bf16::from_f32, |a, b| a * b),
            half2(bf16::to_f32, bf16::from_f32, fmax),
            half2(bf16::to_f32, bf16::from_f32, fmin),
            |n: usize| bf16::from_f64(1.0 / n as f64)
        ),
        DType::F16 => go!(
            f16,
            half2(f16::to_f32, f16::from_f32, |a, b| a + b),
            half2(f16::to_f32, f16::from_f32, |a, b| a * b),
            half2(f16::to_f32, f16::from_f32, fmax),
            half2(f16::to_f32, f16::from_f32, fmin),
            |n: usize| f16::from_f64(1.0 / n as f64)
        ),
        DType::I64 => go!(
            i64,
            |a: i64, b: i64| a.wrapping_add(b),
            |a: i64, b: i64| a.wrapping_mul(b),
            |a: i64, b: i64| a.max(b),
            |a: i64, b: i64| a.min(b),
            |n: usize| (1.0 / n as f64) as i64
        ),
        DType::I32 => go!(
            i32,
            |a: i32, b: i32| a.wrapping_add(b),
            |a: i32, b: i32| a.wrapping_mul(b),
            |a: i32, b: i32| a.max(b),
            |a: i32, b: i32| a.min(b),
            |n: usize| (1.0 / n as f64) as i32
        ),
        DType::Bool => {
            // bool bytes are 0/1; sum = or, prod/min = and, max = or
            let dst = std::slice::from_raw_parts_mut(dst, count);
            let p0 = inputs[0];
            dst.copy_from_slice(std::slice::from_raw_parts(p0.add(from), count));
            for &pj in &inputs[1..] {
                let x = std::slice::from_raw_parts(pj.add(from), count);
                match how {
                    ReduceOp::Sum | ReduceOp::Max | ReduceOp::Mean => {
                        dst.iter_mut().zip(x).for_each(|(a, &b)| *a |= b)
                    }
                    ReduceOp::Prod | ReduceOp::Min => {
                        dst.iter_mut().zip(x).for_each(|(a, &b)| *a &= b)
                    }
                }
            }
        }
    }
}
