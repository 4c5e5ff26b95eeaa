//! The local device communicator (feature `cuda`): the collectives of `hzp run --backend
//! cuda --ranks-on-one-gpu`, where every rank of a plan is a [`super::CudaExecutor`] of this
//! process on the one GPU, with its own arena and streams.
//!
//! A collective is a rendezvous of its members' issuing threads on the host, as NCCL's
//! enqueue is, and device work on each member's own comm stream, as NCCL's kernels are:
//! 1. each member records its *arrival* event on its stream (everything its stream did
//!    before, the input included, is then ordered before the event) and publishes its
//!    buffers' device addresses; the last to arrive checks that every member issued the same
//!    collective (kind, dtype, element count);
//! 2. each member's stream waits on every other member's arrival event, then runs its part of
//!    the [`transport_plan`] (device copies and `coll_acc_*` / `coll_scale_*` kernels, the CPU
//!    communicator's member order), then records its *done* event;
//! 3. after a second host rendezvous each member's stream waits on every other member's done
//!    event, so no stream goes on to overwrite an input (or read an output) another member
//!    is still using.
//!
//! Event reuse is safe: a member re-records its arrival event only after the second
//! rendezvous of the previous call, which every member passes after it has enqueued its waits
//! on the arrival events; likewise for the done events and the first rendezvous.
//! Host waits poll the group's abort flag and give up after the collective timeout, with a
//! message that names the rank, the collective, its group and bytes, and the members missing.

use super::lower::{CollKind, Collective};
use super::transport::{dtype_tag, reduce_code, transport_plan, Buf, Step};
use cudarc::driver::{result as drv, sys, CudaContext};
use hzp_ir::{DType, Group, Op};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const POLL: Duration = Duration::from_millis(10);

/// What a member published for one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sig {
    kind: CollKind,
    dtype: DType,
    count: usize,
    root: usize,
    reduce: u8,
}

#[derive(Default)]
struct Round {
    arrived: usize,
    gen: u64,
    /// (input, output) device addresses per member.
    ptrs: Vec<(u64, u64)>,
    sigs: Vec<Option<Sig>>,
    /// Which members have arrived in the current phase.
    here: Vec<bool>,
    error: Option<String>,
}

/// One group instance on one stream.
pub struct LocalComm {
    pub members: Vec<usize>,
    pub axes: Vec<String>,
    pub stream: usize,
    arrive: Vec<sys::CUevent>,
    done: Vec<sys::CUevent>,
    round: Mutex<Round>,
    cv: Condvar,
    calls: Vec<AtomicU64>,
}

// SAFETY: the events are used from the members' issuing threads, each recording only its
// own and waiting on the others' under the protocol of the module docs; CUDA events may be
// used from any thread of the context.
unsafe impl Send for LocalComm {}
unsafe impl Sync for LocalComm {}

/// A communicator's identity: (stream, members).
type CommId = (usize, Vec<usize>);

/// Every communicator of the ranks of one process, and their shared abort flag.
pub struct LocalGroup {
    ctx: Arc<CudaContext>,
    comms: Mutex<HashMap<CommId, Arc<LocalComm>>>,
    /// Set when any rank fails: every host wait gives up.
    pub abort: AtomicBool,
    pub timeout: Duration,
}

impl LocalGroup {
    pub fn new(ctx: Arc<CudaContext>, timeout: Duration) -> LocalGroup {
        LocalGroup {
            ctx,
            comms: Mutex::new(HashMap::new()),
            abort: AtomicBool::new(false),
            timeout,
        }
    }

    /// The communicator of `members` on `stream` (created by the first member to ask; the
    /// context must be current).
    pub fn comm(
        &self,
        stream: usize,
        axes: &[String],
        members: &[usize],
    ) -> Result<Arc<LocalComm>, String> {
        let mut g = self
            .comms
            .lock()
            .map_err(|_| "the local communicators' lock was poisoned".to_string())?;
        if let Some(c) = g.get(&(stream, members.to_vec())) {
            return Ok(c.clone());
        }
        let n = members.len();
        let mk = || {
            drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| format!("CUDA: creating a communicator event: {e:?}"))
        };
        let arrive = (0..n).map(|_| mk()).collect::<Result<Vec<_>, _>>()?;
        let done = (0..n).map(|_| mk()).collect::<Result<Vec<_>, _>>()?;
        let c = Arc::new(LocalComm {
            members: members.to_vec(),
            axes: axes.to_vec(),
            stream,
            arrive,
            done,
            round: Mutex::new(Round {
                ptrs: vec![(0, 0); n],
                sigs: vec![None; n],
                here: vec![false; n],
                ..Round::default()
            }),
            cv: Condvar::new(),
            calls: (0..n).map(|_| AtomicU64::new(0)).collect(),
        });
        g.insert((stream, members.to_vec()), c.clone());
        Ok(c)
    }
}

impl Drop for LocalGroup {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        if let Ok(g) = self.comms.get_mut() {
            for c in g.values() {
                for &e in c.arrive.iter().chain(&c.done) {
                    // SAFETY: events this group created; no stream uses them any more (the
                    // executors synchronized their streams before dropping their handles).
                    let _ = unsafe { drv::event::destroy(e) };
                }
            }
        }
    }
}

/// The collective as an op over flat buffers (what the lowering hands NCCL).
fn flat_op(c: &Collective) -> Op {
    let group = Group::new(Vec::<String>::new());
    let reduce = c.reduce;
    match c.kind {
        CollKind::AllGather => Op::AllGather { group, axis: 0 },
        CollKind::ReduceScatter => Op::ReduceScatter {
            group,
            axis: 0,
            reduce,
        },
        CollKind::AllReduce => Op::AllReduce { group, reduce },
        CollKind::AllToAll => Op::AllToAll {
            group,
            split_axis: 0,
            concat_axis: 0,
        },
        CollKind::Broadcast => Op::Broadcast {
            group,
            root: c.root,
        },
    }
}

/// Bytes per rank, as the flight recorder counts them (the output of an all-gather).
pub fn coll_bytes(c: &Collective) -> u64 {
    let n = (c.count * c.dtype.size_bytes()) as u64;
    match c.kind {
        CollKind::AllGather => n * c.size as u64,
        _ => n,
    }
}

/// `AllGather over group [gpu] (ranks [0, 1], stream 1) of 4096 bytes`.
pub fn describe(c: &Collective, axes: &[String], members: &[usize], stream: usize) -> String {
    format!(
        "{:?} over group [{}] (ranks {members:?}, stream {stream}) of {} bytes",
        c.kind,
        axes.join(","),
        coll_bytes(c)
    )
}

impl LocalComm {
    /// Calls member `m` has entered.
    pub fn calls_of(&self, m: usize) -> u64 {
        self.calls.get(m).map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// One host rendezvous (see the module docs); `phase` names it in a timeout.
    #[allow(clippy::too_many_arguments)]
    fn rendezvous(
        &self,
        me: usize,
        group: &LocalGroup,
        rank_abort: &AtomicBool,
        what: &dyn Fn() -> String,
        phase: &str,
        publish: impl FnOnce(&mut Round),
        check: impl FnOnce(&Round) -> Option<String>,
    ) -> Result<Round2, String> {
        let n = self.members.len();
        let mut r = self
            .round
            .lock()
            .map_err(|_| "a local communicator's lock was poisoned".to_string())?;
        publish(&mut r);
        r.here[me] = true;
        let gen = r.gen;
        r.arrived += 1;
        if r.arrived == n {
            if let Some(e) = check(&r) {
                r.error.get_or_insert(e);
            }
            r.arrived = 0;
            r.here.iter_mut().for_each(|h| *h = false);
            r.gen += 1;
            self.cv.notify_all();
        } else {
            let deadline = Instant::now() + group.timeout;
            while r.gen == gen {
                if group.abort.load(Ordering::Relaxed) || rank_abort.load(Ordering::Relaxed) {
                    return Err(crate::comm::ABORTED.into());
                }
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = r
                        .here
                        .iter()
                        .enumerate()
                        .filter(|(_, &h)| !h)
                        .map(|(j, _)| self.members[j])
                        .collect();
                    let calls: Vec<u64> = (0..n).map(|j| self.calls_of(j)).collect();
                    return Err(format!(
                        "collective timeout ({:.1} s): rank {} waited in {} ({phase}) for ranks {missing:?}; calls entered per member {calls:?}",
                        group.timeout.as_secs_f64(),
                        self.members[me],
                        what()
                    ));
                }
                r = self
                    .cv
                    .wait_timeout(r, POLL)
                    .map_err(|_| "a local communicator's lock was poisoned".to_string())?
                    .0;
            }
        }
        Ok(Round2 {
            ptrs: r.ptrs.clone(),
            error: r.error.clone(),
        })
    }

    /// Issues collective `c` as member `me` on `stream`, whose buffers are at `base` +
    /// `c.send` / `c.recv`; `functions` holds the `coll_*` kernels of the caller's module.
    ///
    /// # Safety
    /// `stream` is the member's live comm stream in the current context; the buffers lie in
    /// the member's arena and stay untouched by its other streams until the collective's
    /// events say so (the plan's events order them).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        &self,
        me: usize,
        c: &Collective,
        base: u64,
        stream: sys::CUstream,
        functions: &HashMap<String, sys::CUfunction>,
        group: &LocalGroup,
        rank_abort: &AtomicBool,
    ) -> Result<(), String> {
        let n = self.members.len();
        let what = || describe(c, &self.axes, &self.members, self.stream);
        let call = self.calls[me].fetch_add(1, Ordering::Relaxed);
        let sig = Sig {
            kind: c.kind,
            dtype: c.dtype,
            count: c.count,
            root: c.root,
            reduce: reduce_code(c.reduce) as u8,
        };
        drv::event::record(self.arrive[me], stream)
            .map_err(|e| format!("CUDA: recording an arrival event: {e:?}"))?;
        let members = &self.members;
        let r = self.rendezvous(
            me,
            group,
            rank_abort,
            &what,
            "arrival",
            |r| {
                r.ptrs[me] = (base + c.send, base + c.recv);
                r.sigs[me] = Some(sig);
            },
            |r| {
                let first = r.sigs[0];
                r.sigs.iter().enumerate().find(|(_, s)| **s != first).map(|(j, s)| {
                    format!(
                        "collective mismatch: call {call} of the communicator of ranks {members:?} is {first:?} on rank {} but {s:?} on rank {}",
                        members[0], members[j]
                    )
                })
            },
        )?;
        if let Some(e) = r.error {
            // every member saw it (it was set before the rendezvous opened): the run ends
            return Err(e);
        }
        for j in (0..n).filter(|&j| j != me) {
            drv::stream::wait_event(
                stream,
                self.arrive[j],
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(|e| format!("CUDA: waiting on rank {}'s arrival: {e:?}", members[j]))?;
        }
        let flat = flat_op(c);
        let plan = transport_plan(&flat, c.dtype, &[c.count], n)
            .map_err(|e| format!("{}: {e}", what()))?;
        let addr = |b: Buf, off: usize| -> u64 {
            match b {
                Buf::In(j) => r.ptrs[j].0 + off as u64,
                Buf::Out(j) => r.ptrs[j].1 + off as u64,
            }
        };
        let tag = dtype_tag(c.dtype);
        for st in &plan[me] {
            match *st {
                Step::Copy {
                    src,
                    src_off,
                    dst,
                    dst_off,
                    bytes,
                } => drv::memcpy_dtod_async(addr(dst, dst_off), addr(src, src_off), bytes, stream)
                    .map_err(|e| format!("CUDA: a copy of {}: {e:?}", what()))?,
                Step::Acc {
                    src,
                    src_off,
                    dst,
                    dst_off,
                    count,
                    how,
                } => {
                    let f = kernel(functions, &format!("coll_acc_{tag}"))?;
                    let mut op = reduce_code(how);
                    let mut cnt = count as i64;
                    let mut d = addr(dst, dst_off);
                    let mut s = addr(src, src_off);
                    let mut params: [*mut c_void; 4] = [
                        &mut op as *mut i32 as *mut c_void,
                        &mut cnt as *mut i64 as *mut c_void,
                        &mut d as *mut u64 as *mut c_void,
                        &mut s as *mut u64 as *mut c_void,
                    ];
                    drv::launch_kernel(f, grid(count), (256, 1, 1), 0, stream, &mut params)
                        .map_err(|e| format!("CUDA: coll_acc_{tag} of {}: {e:?}", what()))?;
                }
                Step::Scale {
                    dst,
                    dst_off,
                    count,
                    n,
                } => {
                    let f = kernel(functions, &format!("coll_scale_{tag}"))?;
                    let mut cnt = count as i64;
                    let mut d = addr(dst, dst_off);
                    let mut s = scale_bits(c.dtype, n);
                    let mut params: [*mut c_void; 3] = [
                        &mut cnt as *mut i64 as *mut c_void,
                        &mut d as *mut u64 as *mut c_void,
                        s.as_mut_ptr() as *mut c_void,
                    ];
                    drv::launch_kernel(f, grid(count), (256, 1, 1), 0, stream, &mut params)
                        .map_err(|e| format!("CUDA: coll_scale_{tag} of {}: {e:?}", what()))?;
                }
            }
        }
        drv::event::record(self.done[me], stream)
            .map_err(|e| format!("CUDA: recording a done event: {e:?}"))?;
        self.rendezvous(me, group, rank_abort, &what, "leaving", |_| {}, |_| None)?;
        for j in (0..n).filter(|&j| j != me) {
            drv::stream::wait_event(
                stream,
                self.done[j],
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(|e| format!("CUDA: waiting on rank {}'s part: {e:?}", members[j]))?;
        }
        Ok(())
    }
}

/// What a rendezvous hands back.
struct Round2 {
    ptrs: Vec<(u64, u64)>,
    error: Option<String>,
}

fn kernel(
    functions: &HashMap<String, sys::CUfunction>,
    name: &str,
) -> Result<sys::CUfunction, String> {
    functions
        .get(name)
        .copied()
        .ok_or_else(|| format!("kernel `{name}` not loaded"))
}

fn grid(count: usize) -> (u32, u32, u32) {
    (count.div_ceil(256).clamp(1, 4096) as u32, 1, 1)
}

/// A mean's `1/n` in the dtype, as the CPU communicator rounds it, in 8 bytes (the kernel
/// reads its element size).
fn scale_bits(dtype: DType, n: usize) -> [u64; 1] {
    let inv = 1.0 / n as f64;
    let v: u64 = match dtype {
        DType::F32 => (inv as f32).to_bits() as u64,
        DType::BF16 => half::bf16::from_f64(inv).to_bits() as u64,
        DType::F16 => half::f16::from_f64(inv).to_bits() as u64,
        DType::I64 => inv as i64 as u64,
        DType::I32 => inv as i32 as u32 as u64,
        DType::Bool => 0,
    };
    [v]
}
