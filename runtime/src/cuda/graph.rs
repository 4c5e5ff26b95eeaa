//! When the CUDA executor captures a step into a CUDA graph and replays it: the decision
//! logic, pure Rust (no GPU, no `cuda` feature), so it is tested on any machine; the driver
//! calls are the executor's (`device.rs`).
//!
//! A lowered plan is static: every kernel argument is a constant of the lowering or a byte
//! offset into the rank's arena, every product, copy and collective the same each step. The
//! host writes a step's batch, its learning rate and other scalar inputs into their arena
//! buffers before the step (`set_inputs`), and a checkpoint restore writes values into theirs;
//! a graph reads those buffers when it runs, so none of this changes the graph. What the graph
//! does depend on is where the arena is and how large ([`Fingerprint`]): a change of either
//! drops it. The first `warmup` steps of a run (and of a run after a restore or a failed step)
//! run uncaptured, so that lazy set-up (cuBLAS's workspace, NCCL's first-call buffers, module
//! loading) happens outside the capture; the next step is captured (recording, not running,
//! its work), then launched as a graph; later steps launch the graph again.
//!
//! What the step does on the host stays outside the captured region: the issuing threads'
//! event bookkeeping and the flight record run while capturing, and on replay the executor
//! records the collectives as issued without issuing them; reading the loss and the error
//! word, the updates' copies, the timing events' read-out and the watchdog's polling all come
//! after the captured region has been launched.
//!
//! Where capture cannot work the executor runs every step uncaptured and says why once on
//! stderr: `--no-cuda-graph` (silently), a blocker found at load time (every rank on one GPU
//! with collectives between them: the local communicator's streams wait on each other's events
//! across the ranks' captures, which CUDA refuses; an NCCL without graph support), or a
//! capture or instantiation that failed.

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether graphs are asked for by the environment: on unless `HZP_CUDA_GRAPH=0`.
pub fn from_env() -> bool {
    std::env::var("HZP_CUDA_GRAPH").map_or(true, |v| v != "0")
}

/// `HZP_CUDA_EXPLAIN=1`: the executor says when it captured a step (and the lowering's
/// choices elsewhere).
pub fn explain() -> bool {
    std::env::var("HZP_CUDA_EXPLAIN").is_ok_and(|v| v == "1")
}

/// What a graph is bound to: the arena's device address and the allocation's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    pub base: u64,
    pub alloc_bytes: u64,
}

/// How the executor runs one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepMode {
    /// Issue the step's work to the streams as they are.
    Direct,
    /// Capture the step's work into a graph, then launch it (on failure: say why, run
    /// [`StepMode::Direct`]).
    Capture,
    /// Launch the captured graph.
    Replay,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// Never captured, for the reason (`None`: `--no-cuda-graph`, said by nobody).
    Off(Option<String>),
    /// This many more uncaptured steps before the capture.
    Warming(usize),
    /// A graph captured for this fingerprint.
    Captured(Fingerprint),
}

/// The decision logic (see the module docs). The executor calls [`GraphPolicy::begin_step`]
/// before a step, [`GraphPolicy::captured`] after trying a capture and
/// [`GraphPolicy::step_done`] after the step; [`GraphPolicy::invalidate`] after anything that
/// must not see the old graph; a `true` from these means "destroy the graph you hold".
#[derive(Clone, Debug)]
pub struct GraphPolicy {
    state: State,
    warmup: usize,
    /// What the current step does (set by `begin_step`).
    mode: StepMode,
    /// The fingerprint of the current step.
    at: Option<Fingerprint>,
    /// A message for stderr, taken by [`GraphPolicy::take_note`].
    note: Option<String>,
}

/// Uncaptured steps before the first capture.
pub const WARMUP_STEPS: usize = 1;

impl GraphPolicy {
    /// `enabled`: graphs asked for (not `--no-cuda-graph`); `blocker`: why this executor
    /// cannot capture (found at load time), said once.
    pub fn new(enabled: bool, blocker: Option<String>) -> GraphPolicy {
        let (state, note) = match (enabled, blocker) {
            (false, _) => (State::Off(None), None),
            (true, Some(why)) => (
                State::Off(Some(why.clone())),
                Some(format!(
                    "CUDA graphs off: {why}; every step runs uncaptured"
                )),
            ),
            (true, None) => (State::Warming(WARMUP_STEPS), None),
        };
        GraphPolicy {
            state,
            warmup: WARMUP_STEPS,
            mode: StepMode::Direct,
            at: None,
            note,
        }
    }

    /// Whether graphs may still be used (not turned off or given up).
    pub fn enabled(&self) -> bool {
        !matches!(self.state, State::Off(_))
    }

    /// What to do for the next step, whose arena is `fp`. A graph captured for another
    /// fingerprint is dropped (the `bool`: destroy it) and the warm-up starts again.
    pub fn begin_step(&mut self, fp: Fingerprint) -> (StepMode, bool) {
        self.at = Some(fp);
        let mut drop = false;
        self.mode = match self.state {
            State::Off(_) => StepMode::Direct,
            State::Warming(0) => StepMode::Capture,
            State::Warming(_) => StepMode::Direct,
            State::Captured(f) if f == fp => StepMode::Replay,
            State::Captured(_) => {
                drop = true;
                self.state = State::Warming(self.warmup);
                StepMode::Direct
            }
        };
        (self.mode, drop)
    }

    /// The outcome of a [`StepMode::Capture`]: `Ok` (a graph is held now) or why not, which
    /// turns graphs off for the rest of the run and is said once.
    pub fn captured(&mut self, r: Result<(), String>) {
        match r {
            Ok(()) => {
                if let Some(fp) = self.at {
                    self.state = State::Captured(fp);
                }
            }
            Err(why) => {
                self.note = Some(format!(
                    "CUDA graph capture failed: {why}; every step runs uncaptured"
                ));
                self.state = State::Off(Some(why));
            }
        }
    }

    /// After the step: `ok` whether it succeeded. A failed step drops the graph (the `bool`)
    /// and starts the warm-up again; a good uncaptured step counts down the warm-up.
    pub fn step_done(&mut self, ok: bool) -> bool {
        if !ok {
            return self.invalidate();
        }
        if let State::Warming(n) = &mut self.state {
            if self.mode == StepMode::Direct {
                *n = n.saturating_sub(1);
            }
        }
        false
    }

    /// Something the graph must not outlive happened (a checkpoint restore, a failed step):
    /// drop it (the `bool`) and warm up again.
    pub fn invalidate(&mut self) -> bool {
        match self.state {
            State::Off(_) => false,
            State::Warming(_) => {
                self.state = State::Warming(self.warmup);
                false
            }
            State::Captured(_) => {
                self.state = State::Warming(self.warmup);
                true
            }
        }
    }

    /// The message to print, once.
    pub fn take_note(&mut self) -> Option<String> {
        self.note.take()
    }
}

/// Prints `msg` on stderr unless a message of graphs was printed by this process already
/// (every rank on one GPU has an executor each: one line, not one per rank).
pub fn say_once(msg: &str) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::SeqCst) {
        eprintln!("hzp: {msg}");
    }
}

/// Why an executor cannot capture, from what it found at load time: `local_groups`, the
/// local communicator's groups of more than one rank (every rank on one GPU); `nccl`, NCCL's
/// version when the rank has NCCL communicators of more than one rank (`None`: no such
/// communicator). NCCL captures collectives from 2.9.6 on.
pub fn blocker(local_groups: usize, nccl: Option<i32>) -> Option<String> {
    if local_groups > 0 {
        return Some(format!(
            "every rank on one GPU with collectives between them ({local_groups} local group(s)): \
             the ranks' streams wait on each other's events, which one rank's capture cannot hold"
        ));
    }
    match nccl {
        Some(v) if v < 20906 => Some(format!(
            "NCCL {} cannot be captured into a CUDA graph (2.9.6 or later can)",
            nccl_version_text(v)
        )),
        _ => None,
    }
}

/// NCCL's version code as text (2.9.6 is 20906; before 2.9, 2.8.4 was 2804).
pub fn nccl_version_text(v: i32) -> String {
    if v >= 10000 {
        format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
    } else {
        format!("{}.{}.{}", v / 1000, (v / 100) % 10, v % 100)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FP: Fingerprint = Fingerprint {
        base: 0x7f00_0000_0000,
        alloc_bytes: 1 << 20,
    };

    /// Runs steps: each (mode wanted, whether the capture succeeds) and gives the modes.
    fn run(p: &mut GraphPolicy, steps: usize) -> Vec<StepMode> {
        (0..steps)
            .map(|_| {
                let (m, drop) = p.begin_step(FP);
                assert!(!drop);
                if m == StepMode::Capture {
                    p.captured(Ok(()));
                }
                assert!(!p.step_done(true));
                m
            })
            .collect()
    }

    #[test]
    fn one_warm_step_then_a_capture_then_replays() {
        let mut p = GraphPolicy::new(true, None);
        use StepMode::*;
        assert_eq!(run(&mut p, 5), [Direct, Capture, Replay, Replay, Replay]);
        assert_eq!(p.take_note(), None);
    }

    #[test]
    fn off_runs_every_step_directly_and_says_nothing() {
        let mut p = GraphPolicy::new(false, None);
        assert_eq!(run(&mut p, 4), [StepMode::Direct; 4]);
        assert!(!p.enabled());
        assert_eq!(p.take_note(), None);
    }

    #[test]
    fn a_blocker_is_said_once_and_nothing_is_captured() {
        let mut p = GraphPolicy::new(true, blocker(2, None));
        assert_eq!(run(&mut p, 3), [StepMode::Direct; 3]);
        let note = p.take_note().unwrap();
        assert!(note.contains("every rank on one GPU"), "{note}");
        assert_eq!(p.take_note(), None);
    }

    #[test]
    fn a_failed_capture_turns_graphs_off_and_says_why_once() {
        let mut p = GraphPolicy::new(true, None);
        assert_eq!(p.begin_step(FP), (StepMode::Direct, false));
        p.step_done(true);
        assert_eq!(p.begin_step(FP), (StepMode::Capture, false));
        p.captured(Err("cuStreamBeginCapture: CUDA_ERROR_NOT_SUPPORTED".into()));
        assert!(!p.step_done(true));
        let note = p.take_note().unwrap();
        assert!(note.contains("CUDA_ERROR_NOT_SUPPORTED"), "{note}");
        assert_eq!(run(&mut p, 3), [StepMode::Direct; 3]);
        assert_eq!(p.take_note(), None);
    }

    #[test]
    fn a_restore_drops_the_graph_and_warms_up_again() {
        let mut p = GraphPolicy::new(true, None);
        run(&mut p, 3);
        assert!(p.invalidate(), "the held graph must be destroyed");
        use StepMode::*;
        assert_eq!(run(&mut p, 3), [Direct, Capture, Replay]);
        // a restore before any capture has no graph to drop
        let mut p = GraphPolicy::new(true, None);
        assert!(!p.invalidate());
        assert_eq!(run(&mut p, 2), [Direct, Capture]);
    }

    #[test]
    fn a_failed_step_drops_the_graph() {
        let mut p = GraphPolicy::new(true, None);
        run(&mut p, 3);
        assert_eq!(p.begin_step(FP), (StepMode::Replay, false));
        assert!(p.step_done(false));
        use StepMode::*;
        assert_eq!(run(&mut p, 2), [Direct, Capture]);
    }

    #[test]
    fn another_arena_drops_the_graph() {
        let mut p = GraphPolicy::new(true, None);
        run(&mut p, 2);
        let moved = Fingerprint {
            base: FP.base + 4096,
            ..FP
        };
        assert_eq!(p.begin_step(moved), (StepMode::Direct, true));
        p.step_done(true);
        assert_eq!(p.begin_step(moved), (StepMode::Capture, false));
        p.captured(Ok(()));
        p.step_done(true);
        assert_eq!(p.begin_step(moved), (StepMode::Replay, false));
        p.step_done(true);
        // and back: that graph is for `moved`
        assert_eq!(p.begin_step(FP), (StepMode::Direct, true));
    }

    #[test]
    fn a_failed_warm_step_restarts_the_warm_up() {
        let mut p = GraphPolicy::new(true, None);
        assert_eq!(p.begin_step(FP).0, StepMode::Direct);
        assert!(!p.step_done(false));
        assert_eq!(p.begin_step(FP).0, StepMode::Direct);
        p.step_done(true);
        assert_eq!(p.begin_step(FP).0, StepMode::Capture);
    }

    #[test]
    fn nccl_versions() {
        assert_eq!(nccl_version_text(21903), "2.19.3");
        assert_eq!(nccl_version_text(2804), "2.8.4");
        assert!(blocker(0, Some(2804)).unwrap().contains("2.8.4"));
        assert_eq!(blocker(0, Some(20906)), None);
        assert_eq!(blocker(0, Some(21903)), None);
        assert_eq!(blocker(0, None), None);
    }
}
