//! The CUDA executor's graph capture and replay (a child of `device.rs`): the driver calls
//! behind [`super::super::graph::GraphPolicy`]'s decisions.
//!
//! Capture: stream 0 begins a capture (relaxed mode: the issuing threads call into the
//! capture from three threads), streams 1 and 2 join it by waiting on a fork event recorded
//! on stream 0, the step's work is issued by the usual threads (the timing events recorded as
//! graph nodes, `CU_EVENT_RECORD_EXTERNAL`, so that the step statistics and the profile read
//! them after each replay), streams 1 and 2 rejoin stream 0 through join events, and stream 0
//! ends the capture. The graph is instantiated and launched on stream 0; a replay launches it
//! again. The host's part of a step that is not stream work (reading the loss and the error
//! word, the updates' copies, the watchdog's polling) runs after the launch, as after an
//! uncaptured step.

use super::super::graph::{self, Fingerprint, GraphPolicy, StepMode};
use super::{drv, drv_err, run_err, sys, CudaExecutor, ExecError, Transport, Work};
use crate::watchdog::CollState;
use std::sync::atomic::Ordering;

/// The executor's graph: the policy, the captured graph and its executable, and the fork and
/// join events of a capture.
pub(super) struct GraphRun {
    pub(super) policy: GraphPolicy,
    held: Option<(sys::CUgraph, sys::CUgraphExec)>,
    joins: Vec<sys::CUevent>,
}

// SAFETY: the graph handles are used by the thread that runs the step (one at a time).
unsafe impl Send for GraphRun {}
unsafe impl Sync for GraphRun {}

impl GraphRun {
    /// No graph (until [`CudaExecutor::set_up_graphs`]).
    pub(super) fn off() -> GraphRun {
        GraphRun {
            policy: GraphPolicy::new(false, None),
            held: None,
            joins: Vec::new(),
        }
    }

    fn destroy(&mut self) {
        if let Some((g, exec)) = self.held.take() {
            // SAFETY: handles this run created; the streams are idle between steps.
            unsafe {
                let _ = sys::cuGraphExecDestroy(exec);
                let _ = sys::cuGraphDestroy(g);
            }
        }
    }

    /// Destroys what it holds (on the executor's way out).
    pub(super) fn tear_down(&mut self) {
        self.destroy();
        for e in self.joins.drain(..) {
            // SAFETY: events this run created.
            let _ = unsafe { drv::event::destroy(e) };
        }
    }
}

/// Why a capture did not give a graph.
enum NoGraph {
    /// Run the step uncaptured (and say why once).
    Fallback(String),
    /// A stream is left capturing: the executor cannot go on.
    Fatal(ExecError),
}

/// Keeps the first failure of a sequence of calls.
fn keep(first: &mut Result<(), String>, r: sys::CUresult, what: &str) {
    if first.is_ok() {
        *first = check(r, what);
    }
}

fn check(r: sys::CUresult, what: &str) -> Result<(), String> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(format!("{what}: {:?}", drv::DriverError(e))),
    }
}

/// Records a timing event: as a graph node while capturing (so a replay records it).
pub(super) fn record_timing(
    e: sys::CUevent,
    stream: sys::CUstream,
    capture: bool,
) -> Result<(), ExecError> {
    if capture {
        // SAFETY: a live event and a stream in this capture.
        let r = unsafe {
            sys::cuEventRecordWithFlags(
                e,
                stream,
                sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32,
            )
        };
        check(r, "recording a timing event into the capture").map_err(run_err)
    } else {
        // SAFETY: a live event and stream of the current context.
        unsafe { drv::event::record(e, stream) }.map_err(|e| drv_err("recording", e))
    }
}

impl CudaExecutor {
    /// Decides, at the end of loading, whether this executor may capture its steps
    /// (`opts.graphs`, and no blocker: see [`graph::blocker`]), and creates the fork and join
    /// events.
    pub(super) fn set_up_graphs(&mut self) -> Result<(), ExecError> {
        let local_groups = match &self.transport {
            Transport::Local { comms, .. } => comms.iter().flatten().count(),
            Transport::Nccl(_) => 0,
        };
        let nccl = match &self.transport {
            Transport::Nccl(comms) if comms.0.iter().flatten().next().is_some() => {
                let mut v = 0i32;
                // SAFETY: NCCL is loaded (this rank created communicators).
                unsafe { super::nccl_sys::ncclGetVersion(&mut v) };
                Some(v)
            }
            _ => None,
        };
        let blocker = graph::blocker(local_groups, nccl);
        self.graph.policy = GraphPolicy::new(self.opts.graphs, blocker);
        if self.graph.policy.enabled() {
            for _ in 0..3 {
                let e = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| drv_err("creating an event", e))?;
                self.graph.joins.push(e);
            }
        }
        Ok(())
    }

    fn fingerprint(&self) -> Fingerprint {
        Fingerprint {
            base: self.h.base,
            alloc_bytes: self.low.alloc_bytes,
        }
    }

    /// Issues step `step` as the policy says: directly, captured then launched, or as the
    /// held graph.
    pub(super) fn issue_graph_step(&mut self, step: usize) -> Result<(), ExecError> {
        let (mode, drop) = self.graph.policy.begin_step(self.fingerprint());
        if drop {
            self.graph.destroy();
        }
        let r = match mode {
            StepMode::Direct => self.issue_step(step, false),
            StepMode::Capture => self.capture_step(step),
            StepMode::Replay => self.replay_step(step),
        };
        if let Some(note) = self.graph.policy.take_note() {
            graph::say_once(&note);
        }
        r
    }

    /// After the step: tells the policy (a failed step drops the graph).
    pub(super) fn graph_step_done(&mut self, ok: bool) {
        if self.graph.policy.step_done(ok) {
            self.graph.destroy();
        }
    }

    /// A checkpoint restore (or anything else the held graph must not outlive).
    pub(super) fn graph_invalidate(&mut self) {
        if self.graph.policy.invalidate() {
            self.graph.destroy();
        }
    }

    fn capture_step(&mut self, step: usize) -> Result<(), ExecError> {
        let calls: Vec<u64> = self
            .calls
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        match self.capture(step) {
            Ok(held) => {
                if graph::explain() {
                    let mut n = 0usize;
                    // SAFETY: a live graph; a null array asks for the count only.
                    unsafe { sys::cuGraphGetNodes(held.0, std::ptr::null_mut(), &mut n) };
                    eprintln!(
                        "hzp: CUDA graph: rank {} captured step {step} ({n} graph nodes); later steps replay it",
                        self.dist.rank
                    );
                }
                self.graph.held = Some(held);
                self.graph.policy.captured(Ok(()));
                self.launch_graph()
            }
            Err(NoGraph::Fallback(why)) => {
                // the captured collectives never ran: count them again when issued
                for (c, n) in self.calls.iter().zip(calls) {
                    c.store(n, Ordering::Relaxed);
                }
                self.graph.policy.captured(Err(why));
                self.issue_step(step, false)
            }
            Err(NoGraph::Fatal(e)) => Err(e),
        }
    }

    /// Captures the step's work and instantiates it.
    fn capture(&self, step: usize) -> Result<(sys::CUgraph, sys::CUgraphExec), NoGraph> {
        let [s0, s1, s2] = self.h.streams;
        let sync = self.opts.comm == crate::executor::CommMode::Sync;
        let j = &self.graph.joins;
        let fb = NoGraph::Fallback;
        // SAFETY (every driver call below): live streams and events of the current context;
        // between steps no stream runs.
        unsafe {
            check(
                sys::cuStreamBeginCapture_v2(
                    s0,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
                ),
                "cuStreamBeginCapture",
            )
            .map_err(fb)?;
            let mut first: Result<(), String> = Ok(());
            if !sync {
                keep(
                    &mut first,
                    sys::cuEventRecord(j[0], s0),
                    "forking the capture",
                );
                for s in [s1, s2] {
                    keep(
                        &mut first,
                        sys::cuStreamWaitEvent(s, j[0], 0),
                        "joining a stream to the capture",
                    );
                }
            }
            let issued = if first.is_ok() {
                self.issue_step(step, true)
            } else {
                Ok(())
            };
            if !sync {
                for (s, e) in [(s1, j[1]), (s2, j[2])] {
                    keep(&mut first, sys::cuEventRecord(e, s), "rejoining a stream");
                    keep(
                        &mut first,
                        sys::cuStreamWaitEvent(s0, e, 0),
                        "rejoining a stream",
                    );
                }
            }
            let mut g: sys::CUgraph = std::ptr::null_mut();
            let end = check(sys::cuStreamEndCapture(s0, &mut g), "cuStreamEndCapture");
            for (k, s) in [s0, s1, s2].into_iter().enumerate() {
                let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
                let r = sys::cuStreamIsCapturing(s, &mut st);
                if r != sys::CUresult::CUDA_SUCCESS
                    || st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
                {
                    return Err(NoGraph::Fatal(run_err(format!(
                        "rank {}: stream {k} is still capturing after a failed CUDA graph capture ({st:?}, {r:?}); rerun with --no-cuda-graph",
                        self.dist.rank
                    ))));
                }
            }
            let failed = first
                .err()
                .or_else(|| {
                    issued
                        .err()
                        .map(|e| format!("issuing the step into it: {e}"))
                })
                .or_else(|| end.err());
            if let Some(why) = failed {
                if !g.is_null() {
                    let _ = sys::cuGraphDestroy(g);
                }
                return Err(fb(why));
            }
            let mut exec: sys::CUgraphExec = std::ptr::null_mut();
            if let Err(why) = check(
                sys::cuGraphInstantiateWithFlags(&mut exec, g, 0),
                "cuGraphInstantiate",
            ) {
                let _ = sys::cuGraphDestroy(g);
                return Err(fb(why));
            }
            Ok((g, exec))
        }
    }

    fn launch_graph(&self) -> Result<(), ExecError> {
        let Some((_, exec)) = self.graph.held else {
            return Err(run_err("internal: no CUDA graph to launch"));
        };
        // SAFETY: a live executable graph; stream 0 of its context.
        check(
            unsafe { sys::cuGraphLaunch(exec, self.h.streams[0]) },
            "cuGraphLaunch",
        )
        .map_err(|e| run_err(format!("rank {}: {e}", self.dist.rank)))
    }

    /// The held graph again; the flight record lists the step's collectives as issued, in
    /// each stream's order, as an uncaptured step's issuing threads record them.
    fn replay_step(&self, step: usize) -> Result<(), ExecError> {
        for (i, nw) in self.low.nodes.iter().enumerate() {
            for w in &nw.work {
                if let Work::Collective(c) = w {
                    let calls = self
                        .calls
                        .get(c.comm)
                        .map_or(0, |k| k.fetch_add(1, Ordering::Relaxed));
                    let now = self.now_us();
                    self.recorder.issue(
                        0,
                        nw.stream,
                        step as u64,
                        i,
                        c.comm,
                        calls,
                        super::coll_bytes(c),
                        now,
                    );
                    self.recorder.mark(0, nw.stream, CollState::Started, now);
                }
            }
        }
        self.launch_graph()
    }
}
