//! Hang diagnosis shared by the backends: the flight recorder (every rank's last collectives
//! with their state), the collective timeout, and fault injection for tests.
//!
//! A rank's stream records each collective it reaches (`issued`), when every member of the
//! communicator has arrived and data moves (`started`), and when it returns (`completed` or
//! `failed`). Recording is a lock of the stream's own ring (no other thread writes it) and a
//! few stores; the ring keeps the last [`FlightRecorder::capacity`] entries per stream.
//!
//! When a run fails (an error, a panic, or a wait longer than the collective timeout), the
//! backend stops every rank and hands out a [`FlightReport`]: per rank, its recent collectives
//! in the order they were issued, so a rank that skipped a collective, or issued another one,
//! or never arrived, stands out next to the others. [`FlightReport::summary`] prints it and
//! [`FlightReport::write_dir`] writes one JSON file per rank.
//!
//! Faults for tests come from `HZP_FAULT=rank:R,step:S,kind:K` ([`Fault::parse`]), K one of
//! `panic` (the rank's compute thread panics at the start of step S), `hang` (it stops there
//! and never returns, ignoring every abort), `skip-collective` (the rank leaves out the first
//! collective of step S in program order) and `wrong-bytes` (it issues that collective with
//! one element too few).

use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

/// The default `--collective-timeout`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Entries kept per rank and stream.
pub const DEFAULT_CAPACITY: usize = 64;

/// Parses a timeout: seconds as a plain number (`300`, `2.5`), or with a unit: `500ms`,
/// `30s`, `5m`, `1h`. Zero, negative and non-finite values are refused.
pub fn parse_timeout(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = t.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (t, 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| {
        format!(
            "`{s}` is not a duration (expected seconds, or a number with ms, s, m or h: 30s, 5m)"
        )
    })?;
    let secs = v * scale;
    if !secs.is_finite() || secs <= 0.0 {
        return Err(format!("`{s}`: a timeout must be positive"));
    }
    if secs > 1e9 {
        return Err(format!("`{s}`: a timeout above 10^9 seconds"));
    }
    Duration::try_from_secs_f64(secs).map_err(|e| format!("`{s}`: {e}"))
}

/// What an injected fault does (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    Panic,
    Hang,
    SkipCollective,
    WrongBytes,
}

impl FaultKind {
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Panic => "panic",
            FaultKind::Hang => "hang",
            FaultKind::SkipCollective => "skip-collective",
            FaultKind::WrongBytes => "wrong-bytes",
        }
    }
}

/// An injected fault: `kind` on `rank` in step `step` (1-based, counted over the whole run).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Fault {
    pub rank: usize,
    pub step: usize,
    pub kind: FaultKind,
}

/// The environment variable [`Fault::from_env`] reads.
pub const FAULT_ENV: &str = "HZP_FAULT";

impl Fault {
    /// Parses `rank:R,step:S,kind:K` (each key once, all three required, in any order).
    pub fn parse(s: &str) -> Result<Fault, String> {
        let mut rank = None;
        let mut step = None;
        let mut kind = None;
        for part in s.split(',') {
            let part = part.trim();
            let (k, v) = part.split_once(':').ok_or_else(|| {
                format!("`{part}` is not key:value (expected rank:R,step:S,kind:K)")
            })?;
            let (k, v) = (k.trim(), v.trim());
            let num = |what: &str| -> Result<usize, String> {
                v.parse::<usize>()
                    .map_err(|_| format!("{what} `{v}` is not a non-negative integer"))
            };
            let dup = |set: bool| -> Result<(), String> {
                if set {
                    Err(format!("`{k}` is given twice"))
                } else {
                    Ok(())
                }
            };
            match k {
                "rank" => {
                    dup(rank.is_some())?;
                    rank = Some(num("rank")?);
                }
                "step" => {
                    dup(step.is_some())?;
                    let n = num("step")?;
                    if n == 0 {
                        return Err("step 0: steps count from 1".into());
                    }
                    step = Some(n);
                }
                "kind" => {
                    dup(kind.is_some())?;
                    kind = Some(match v {
                        "panic" => FaultKind::Panic,
                        "hang" => FaultKind::Hang,
                        "skip-collective" => FaultKind::SkipCollective,
                        "wrong-bytes" => FaultKind::WrongBytes,
                        other => {
                            return Err(format!(
                            "kind `{other}` (expected panic, hang, skip-collective or wrong-bytes)"
                        ))
                        }
                    });
                }
                other => return Err(format!("unknown key `{other}` (expected rank, step, kind)")),
            }
        }
        Ok(Fault {
            rank: rank.ok_or("rank:R is missing")?,
            step: step.ok_or("step:S is missing")?,
            kind: kind.ok_or("kind:K is missing")?,
        })
    }

    /// The fault `HZP_FAULT` asks for, if set (an empty value is none).
    pub fn from_env() -> Result<Option<Fault>, String> {
        match std::env::var(FAULT_ENV) {
            Ok(v) if v.trim().is_empty() => Ok(None),
            Ok(v) => Fault::parse(&v)
                .map(Some)
                .map_err(|e| format!("{FAULT_ENV}={v}: {e}")),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(format!("{FAULT_ENV} is not valid UTF-8"))
            }
        }
    }
}

/// Where a recorded collective is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CollState {
    /// The rank reached it (on the GPU: enqueued).
    Issued,
    /// Every member arrived; data moves.
    Started,
    Completed,
    Failed,
}

impl CollState {
    pub fn name(self) -> &'static str {
        match self {
            CollState::Issued => "issued",
            CollState::Started => "started",
            CollState::Completed => "completed",
            CollState::Failed => "failed",
        }
    }
}

/// One recorded collective (names are resolved when a report is made).
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    /// Per rank and stream, from 0 over the recorder's life.
    pub seq: u64,
    /// 1-based.
    pub step: u64,
    /// The node's index in the per-rank program.
    pub node: u32,
    /// The communicator (backend-defined index) and the call's place in its sequence.
    pub comm: u32,
    pub comm_seq: u64,
    /// Per rank: the output of an all-gather, the input otherwise.
    pub bytes: u64,
    pub state: CollState,
    /// Since the start of the run, in microseconds (0: not yet).
    pub issued_us: u64,
    pub started_us: u64,
    pub ended_us: u64,
}

struct Ring {
    entries: Vec<Entry>,
    /// Where the next entry goes once `entries` is full.
    head: usize,
    seq: u64,
}

/// The last collectives of every (rank, stream) (see the [module docs](self)).
pub struct FlightRecorder {
    cap: usize,
    streams: usize,
    rings: Vec<Mutex<Ring>>,
}

impl FlightRecorder {
    /// A recorder for `ranks` x `streams` rings of `capacity` entries each (at least 1).
    pub fn new(ranks: usize, streams: usize, capacity: usize) -> FlightRecorder {
        let cap = capacity.max(1);
        FlightRecorder {
            cap,
            streams,
            rings: (0..ranks * streams)
                .map(|_| {
                    Mutex::new(Ring {
                        entries: Vec::with_capacity(cap),
                        head: 0,
                        seq: 0,
                    })
                })
                .collect(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    fn ring(&self, rank: usize, stream: usize) -> std::sync::MutexGuard<'_, Ring> {
        self.rings[rank * self.streams + stream]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Records that `rank`'s `stream` reached a collective; the entry is its stream's latest
    /// until the next `issue` on that stream.
    #[allow(clippy::too_many_arguments)]
    pub fn issue(
        &self,
        rank: usize,
        stream: usize,
        step: u64,
        node: usize,
        comm: usize,
        comm_seq: u64,
        bytes: u64,
        now_us: u64,
    ) {
        let mut r = self.ring(rank, stream);
        let e = Entry {
            seq: r.seq,
            step,
            node: node as u32,
            comm: comm as u32,
            comm_seq,
            bytes,
            state: CollState::Issued,
            issued_us: now_us.max(1),
            started_us: 0,
            ended_us: 0,
        };
        r.seq += 1;
        if r.entries.len() < self.cap {
            r.entries.push(e);
        } else {
            let h = r.head;
            r.entries[h] = e;
            r.head = (h + 1) % self.cap;
        }
    }

    /// Moves the stream's latest entry to `state` at `now_us`.
    pub fn mark(&self, rank: usize, stream: usize, state: CollState, now_us: u64) {
        let mut r = self.ring(rank, stream);
        let last = if r.entries.len() < self.cap || r.head == 0 {
            r.entries.len().checked_sub(1)
        } else {
            Some(r.head - 1)
        };
        if let Some(i) = last {
            let e = &mut r.entries[i];
            e.state = state;
            match state {
                CollState::Issued => {}
                CollState::Started => e.started_us = now_us.max(1),
                CollState::Completed | CollState::Failed => e.ended_us = now_us.max(1),
            }
        }
    }

    /// Marks every unfinished entry of `rank` completed at `now_us` (a backend whose step
    /// ended with every stream done: the CUDA executor, which enqueues collectives and learns
    /// of their completion only then).
    pub fn settle(&self, rank: usize, now_us: u64) {
        for s in 0..self.streams {
            let mut r = self.ring(rank, s);
            for e in r.entries.iter_mut() {
                if matches!(e.state, CollState::Issued | CollState::Started) {
                    e.state = CollState::Completed;
                    e.ended_us = now_us.max(1);
                }
            }
        }
    }

    /// `rank`'s entries over all its streams, oldest issued first.
    pub fn entries(&self, rank: usize) -> Vec<(usize, Entry)> {
        let mut out = Vec::new();
        for s in 0..self.streams {
            let r = self.ring(rank, s);
            let (a, b) = r.entries.split_at(r.head.min(r.entries.len()));
            out.extend(b.iter().chain(a).map(|e| (s, *e)));
        }
        out.sort_by_key(|(s, e)| (e.issued_us, *s, e.seq));
        out
    }
}

/// One collective of a [`RankRecord`], names resolved.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CollRecord {
    pub seq: u64,
    pub step: u64,
    pub stream: String,
    pub node: String,
    pub op: String,
    pub group: String,
    /// The communicator's ranks, in member order.
    pub members: Vec<usize>,
    /// This call's index in its communicator's sequence (compare it across members).
    pub comm_seq: u64,
    pub bytes: u64,
    pub state: CollState,
    pub issued_ms: f64,
    pub started_ms: Option<f64>,
    pub ended_ms: Option<f64>,
}

/// What one rank's recorder holds when a run fails.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankRecord {
    pub rank: usize,
    pub world: usize,
    /// Why the run stopped (the same on every rank of a report).
    pub reason: String,
    /// This rank's own error, when it had one (rather than being stopped by another's).
    pub error: Option<String>,
    pub collectives: Vec<CollRecord>,
}

/// Every rank's record (see the [module docs](self)).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FlightReport {
    pub reason: String,
    pub ranks: Vec<RankRecord>,
}

impl FlightReport {
    /// The text printed on failure: the reason, then each rank's last `last` collectives.
    pub fn summary(&self, last: usize) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "flight recorder: the last {last} collectives of each rank (oldest first)"
        );
        for r in &self.ranks {
            let _ = writeln!(
                s,
                "rank {}{}:",
                r.rank,
                r.error
                    .as_deref()
                    .map(|e| format!(" (failed: {e})"))
                    .unwrap_or_default()
            );
            if r.collectives.is_empty() {
                let _ = writeln!(s, "  (no collective issued)");
                continue;
            }
            let _ = writeln!(
                s,
                "  {:>5} {:>4} {:<15} {:>8} {:<10} {:>12}  {:<10} node",
                "seq", "step", "stream", "comm#", "state", "bytes", "group"
            );
            let from = r.collectives.len().saturating_sub(last);
            for c in &r.collectives[from..] {
                let _ = writeln!(
                    s,
                    "  {:>5} {:>4} {:<15} {:>8} {:<10} {:>12}  {:<10} {} ({} over ranks {:?})",
                    c.seq,
                    c.step,
                    c.stream,
                    c.comm_seq,
                    c.state.name(),
                    c.bytes,
                    c.group,
                    c.node,
                    c.op,
                    c.members
                );
            }
        }
        s
    }

    /// Writes `DIR/rank-<r>.json` for every rank (creating DIR).
    pub fn write_dir(&self, dir: &Path) -> Result<Vec<std::path::PathBuf>, String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let mut written = Vec::new();
        for r in &self.ranks {
            let path = dir.join(format!("rank-{}.json", r.rank));
            let mut text =
                serde_json::to_string_pretty(r).map_err(|e| format!("rank {}: {e}", r.rank))?;
            text.push('\n');
            std::fs::write(&path, text)
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            written.push(path);
        }
        Ok(written)
    }
}

/// Called when threads of a failed run do not stop within the grace period after the abort
/// (a thread stuck where no abort reaches it). It gets the report; the CLI prints it and
/// exits the process. Without one, the run waits for the stuck threads.
pub type StuckHook = std::sync::Arc<dyn Fn(&FlightReport) + Send + Sync>;

/// How long stopped threads get to finish after an abort before the stuck hook is called.
pub fn grace(timeout: Duration) -> Duration {
    timeout.clamp(Duration::from_millis(200), Duration::from_secs(10))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_parse_with_and_without_units() {
        assert_eq!(parse_timeout("300").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_timeout("2.5").unwrap(), Duration::from_millis(2500));
        assert_eq!(parse_timeout("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_timeout("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_timeout("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_timeout("1h").unwrap(), Duration::from_secs(3600));
        for bad in ["", "0", "-1", "abc", "5x", "nan", "inf", "1e300"] {
            assert!(parse_timeout(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn faults_parse_strictly() {
        assert_eq!(
            Fault::parse("rank:1,step:2,kind:panic").unwrap(),
            Fault {
                rank: 1,
                step: 2,
                kind: FaultKind::Panic
            }
        );
        assert_eq!(
            Fault::parse(" kind:wrong-bytes , rank:0,step:7")
                .unwrap()
                .kind,
            FaultKind::WrongBytes
        );
        for (bad, why) in [
            ("rank:1,step:2", "kind:K is missing"),
            ("rank:1,step:0,kind:hang", "steps count from 1"),
            ("rank:1,rank:2,step:1,kind:hang", "given twice"),
            ("rank:x,step:1,kind:hang", "not a non-negative integer"),
            ("rank:1,step:1,kind:explode", "expected panic, hang"),
            ("rank=1", "not key:value"),
            ("rank:1,step:1,kind:hang,when:now", "unknown key `when`"),
        ] {
            let e = Fault::parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    /// Recording is a few uncontended locks per collective: far below a collective's cost
    /// (microseconds even in process), so the normal path does not slow down measurably.
    #[test]
    fn recording_a_collective_costs_well_under_a_microsecond() {
        let f = FlightRecorder::new(2, 3, DEFAULT_CAPACITY);
        let n = 200_000u64;
        let t = std::time::Instant::now();
        for k in 0..n {
            f.issue(1, 2, 1, k as usize, 0, k, 4096, k + 1);
            f.mark(1, 2, CollState::Started, k + 2);
            f.mark(1, 2, CollState::Completed, k + 3);
        }
        let per = t.elapsed().as_nanos() as f64 / n as f64;
        eprintln!("flight recorder: {per:.0} ns per collective (issue + 2 marks)");
        assert!(per < 2000.0, "{per} ns per collective");
        assert_eq!(f.entries(1).len(), DEFAULT_CAPACITY);
    }

    #[test]
    fn the_ring_keeps_the_last_entries_in_issue_order() {
        let f = FlightRecorder::new(2, 3, 4);
        for k in 0..6u64 {
            f.issue(1, 1, 1, k as usize, 0, k, 16, 10 + k);
            f.mark(1, 1, CollState::Started, 11 + k);
            if k < 5 {
                f.mark(1, 1, CollState::Completed, 12 + k);
            }
        }
        f.issue(1, 2, 1, 99, 1, 0, 8, 12);
        let e = f.entries(1);
        let nodes: Vec<u32> = e.iter().map(|(_, e)| e.node).collect();
        // stream 1 keeps nodes 2..6; stream 2's entry was issued at 12, between 2 and 3
        assert_eq!(nodes, vec![2, 99, 3, 4, 5]);
        assert_eq!(e.last().unwrap().1.state, CollState::Started);
        assert_eq!(e[0].1.state, CollState::Completed);
        assert!(f.entries(0).is_empty());
    }
}
