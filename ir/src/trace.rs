//! Chrome Trace Event JSON: the format both `hzp simulate --trace` (predicted) and
//! `hzp run --trace` (measured) write, so a prediction and a measurement open side by side
//! in Perfetto or `chrome://tracing`, and `hzp simulate --calibrate` can read a measured run.
//!
//! Conventions (shared by every writer in hzp):
//! - one `"ph":"X"` (complete) event per op, `"ts"` and `"dur"` in microseconds;
//! - `"pid"` = rank, `"tid"` = stream: [`TID_COMPUTE`], [`TID_ALL_GATHER`],
//!   [`TID_REDUCE_SCATTER`] (see [`tid_of_stream`]);
//! - `"name"` = the op's name, `"cat"` = a category (`"compute"`, `"collective"`, `"wait"`, ...),
//!   `"args"` = `{"node": node name, "op": op name, "bytes": n}`;
//! - `"ph":"M"` metadata events name the processes (`process_name`, "rank N") and threads
//!   (`thread_name`, the stream's name);
//! - the top level is `{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}`.
//!
//! [`validate`] checks a JSON text against the subset of the Trace Event format that hzp
//! writes (and that Perfetto reads): field types, known phases, non-negative times, metadata
//! events well formed, and complete events on one thread either disjoint or properly nested.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::op::StreamKind;

/// Thread id of the compute stream.
pub const TID_COMPUTE: u32 = 0;
/// Thread id of the all-gather stream.
pub const TID_ALL_GATHER: u32 = 1;
/// Thread id of the reduce-scatter stream.
pub const TID_REDUCE_SCATTER: u32 = 2;

/// The trace thread id of a stream.
pub fn tid_of_stream(s: StreamKind) -> u32 {
    match s {
        StreamKind::Compute => TID_COMPUTE,
        StreamKind::AllGather => TID_ALL_GATHER,
        StreamKind::ReduceScatter => TID_REDUCE_SCATTER,
    }
}

/// The stream of a trace thread id, if it is one of the three.
pub fn stream_of_tid(tid: u32) -> Option<StreamKind> {
    match tid {
        TID_COMPUTE => Some(StreamKind::Compute),
        TID_ALL_GATHER => Some(StreamKind::AllGather),
        TID_REDUCE_SCATTER => Some(StreamKind::ReduceScatter),
        _ => None,
    }
}

/// One trace event. Only the fields hzp uses; unknown fields of a read trace are ignored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cat: String,
    /// Phase: `"X"` (complete), `"M"` (metadata), `"i"` (instant), ...
    pub ph: String,
    /// Start, microseconds.
    #[serde(default)]
    pub ts: f64,
    /// Duration, microseconds (`"X"` events only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    #[serde(default)]
    pub pid: u32,
    #[serde(default)]
    pub tid: u32,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub args: BTreeMap<String, Json>,
}

impl TraceEvent {
    /// A complete (`"X"`) event for one op on one rank's stream. `node` is the plan's node
    /// name (the key calibration matches on), `op` the op's name, `bytes` what it moves (0
    /// for compute ops).
    #[allow(clippy::too_many_arguments)]
    pub fn complete(
        rank: u32,
        tid: u32,
        name: &str,
        cat: &str,
        ts_us: f64,
        dur_us: f64,
        node: &str,
        op: &str,
        bytes: u64,
    ) -> TraceEvent {
        let mut args = BTreeMap::new();
        args.insert("node".to_string(), Json::from(node));
        args.insert("op".to_string(), Json::from(op));
        args.insert("bytes".to_string(), Json::from(bytes));
        TraceEvent {
            name: name.to_string(),
            cat: cat.to_string(),
            ph: "X".to_string(),
            ts: ts_us,
            dur: Some(dur_us),
            pid: rank,
            tid,
            args,
        }
    }

    /// `process_name` metadata: names the process `pid` in the viewer.
    pub fn process_name(pid: u32, name: &str) -> TraceEvent {
        TraceEvent::metadata("process_name", pid, 0, name)
    }

    /// `thread_name` metadata: names thread `tid` of process `pid` in the viewer.
    pub fn thread_name(pid: u32, tid: u32, name: &str) -> TraceEvent {
        TraceEvent::metadata("thread_name", pid, tid, name)
    }

    fn metadata(kind: &str, pid: u32, tid: u32, name: &str) -> TraceEvent {
        let mut args = BTreeMap::new();
        args.insert("name".to_string(), Json::from(name));
        TraceEvent {
            name: kind.to_string(),
            cat: String::new(),
            ph: "M".to_string(),
            ts: 0.0,
            dur: None,
            pid,
            tid,
            args,
        }
    }

    /// `args.node`, if present and a string.
    pub fn node(&self) -> Option<&str> {
        self.args.get("node").and_then(Json::as_str)
    }

    /// `args.op`, if present and a string.
    pub fn op(&self) -> Option<&str> {
        self.args.get("op").and_then(Json::as_str)
    }

    /// `args.bytes`, if present and a non-negative integer.
    pub fn bytes(&self) -> Option<u64> {
        self.args.get("bytes").and_then(Json::as_u64)
    }

    /// End time in microseconds (`ts + dur`, `ts` for events without a duration).
    pub fn end(&self) -> f64 {
        self.ts + self.dur.unwrap_or(0.0)
    }
}

/// A whole trace file.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    #[serde(rename = "traceEvents")]
    pub trace_events: Vec<TraceEvent>,
    #[serde(rename = "displayTimeUnit", default = "default_unit")]
    pub display_time_unit: String,
    #[serde(rename = "otherData", default)]
    pub other_data: BTreeMap<String, Json>,
}

fn default_unit() -> String {
    "ms".to_string()
}

/// What went wrong reading or validating a trace.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TraceError {
    #[error("{file}: not JSON: {msg}")]
    Json { file: String, msg: String },
    #[error("{file}: not a Chrome trace: {msg}")]
    Format { file: String, msg: String },
    #[error("{file}: traceEvents[{index}] ({name}): {msg}")]
    Event {
        file: String,
        index: usize,
        name: String,
        msg: String,
    },
}

impl Trace {
    /// An empty trace with `displayTimeUnit` "ms".
    pub fn new() -> Trace {
        Trace {
            trace_events: Vec::new(),
            display_time_unit: default_unit(),
            other_data: BTreeMap::new(),
        }
    }

    /// Adds the `process_name` ("rank N") and `thread_name` (the three streams) metadata for
    /// `rank`.
    pub fn add_rank_metadata(&mut self, rank: u32) {
        self.trace_events
            .push(TraceEvent::process_name(rank, &format!("rank {rank}")));
        for s in [
            StreamKind::Compute,
            StreamKind::AllGather,
            StreamKind::ReduceScatter,
        ] {
            self.trace_events
                .push(TraceEvent::thread_name(rank, tid_of_stream(s), s.name()));
        }
    }

    /// Appends one event.
    pub fn push(&mut self, e: TraceEvent) {
        self.trace_events.push(e);
    }

    /// Sets one `otherData` entry (e.g. "source": "hzp simulate", "plan_hash": ...).
    pub fn set_other(&mut self, key: &str, value: impl Into<Json>) {
        self.other_data.insert(key.to_string(), value.into());
    }

    /// The JSON text: deterministic (events in insertion order, object keys sorted, times
    /// printed with at most 3 decimals, i.e. nanosecond resolution; an event's end is rounded
    /// and its duration derived, so spans that do not overlap still do not), one event per
    /// line.
    pub fn to_json(&self) -> String {
        let mut out = String::from("{\"traceEvents\": [\n");
        for (i, e) in self.trace_events.iter().enumerate() {
            out.push_str("  ");
            write_event(&mut out, e);
            if i + 1 < self.trace_events.len() {
                out.push(',');
            }
            out.push('\n');
        }
        out.push_str("],\n\"displayTimeUnit\": ");
        out.push_str(&Json::from(self.display_time_unit.as_str()).to_string());
        out.push_str(",\n\"otherData\": ");
        let other: serde_json::Map<String, Json> = self
            .other_data
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        out.push_str(&Json::Object(other).to_string());
        out.push_str("\n}\n");
        out
    }

    /// Reads a trace, validating it first ([`validate`]); `file` names it in errors.
    pub fn from_json(text: &str, file: &str) -> Result<Trace, TraceError> {
        validate(text, file)?;
        serde_json::from_str(text).map_err(|e| TraceError::Format {
            file: file.to_string(),
            msg: e.to_string(),
        })
    }

    /// The complete (`"X"`) events.
    pub fn spans(&self) -> impl Iterator<Item = &TraceEvent> {
        self.trace_events.iter().filter(|e| e.ph == "X")
    }
}

/// A time in microseconds rounded to whole nanoseconds.
fn round_ns(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// Prints a time in microseconds with at most 3 decimals and no trailing zeros.
fn fmt_us(out: &mut String, v: f64) {
    let r = round_ns(v);
    if r == r.trunc() && r.abs() < 1e15 {
        let _ = write!(out, "{}", r as i64);
    } else {
        let s = format!("{r:.3}");
        out.push_str(s.trim_end_matches('0').trim_end_matches('.'));
    }
}

fn write_event(out: &mut String, e: &TraceEvent) {
    out.push_str("{\"name\": ");
    out.push_str(&Json::from(e.name.as_str()).to_string());
    if !e.cat.is_empty() {
        out.push_str(", \"cat\": ");
        out.push_str(&Json::from(e.cat.as_str()).to_string());
    }
    out.push_str(", \"ph\": ");
    out.push_str(&Json::from(e.ph.as_str()).to_string());
    out.push_str(", \"ts\": ");
    fmt_us(out, e.ts);
    if let Some(d) = e.dur {
        // Round the end, not the duration, so that spans that touch or are disjoint stay so.
        out.push_str(", \"dur\": ");
        fmt_us(out, (round_ns(e.ts + d) - round_ns(e.ts)).max(0.0));
    }
    let _ = write!(out, ", \"pid\": {}, \"tid\": {}", e.pid, e.tid);
    if !e.args.is_empty() {
        let args: serde_json::Map<String, Json> =
            e.args.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        out.push_str(", \"args\": ");
        out.push_str(&Json::Object(args).to_string());
    }
    out.push('}');
}

/// What [`validate`] found in a valid trace.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TraceSummary {
    /// Number of complete (`"X"`) events.
    pub complete_events: usize,
    /// Number of metadata (`"M"`) events.
    pub metadata_events: usize,
    /// Distinct pids (ranks) with events, sorted.
    pub pids: Vec<u32>,
    /// Largest `ts + dur` over complete events, microseconds.
    pub end_us: f64,
}

const PHASES: &[&str] = &[
    "B", "E", "X", "i", "I", "C", "b", "n", "e", "s", "t", "f", "P", "N", "O", "D", "M", "R", "c",
];
const METADATA: &[&str] = &[
    "process_name",
    "process_labels",
    "process_sort_index",
    "thread_name",
    "thread_sort_index",
];

/// A complete event on one thread: start, end (us) and its index in `traceEvents`.
type Span = (f64, f64, usize);

/// Checks `text` against the Trace Event format (the JSON-object form). Rules:
/// the top level is an object with a `traceEvents` array (and, if present, `displayTimeUnit`
/// "ms" or "ns" and an object `otherData`); every event is an object with a string `name`, a
/// known one-letter `ph`, and non-negative integer `pid`/`tid` where given; `"X"` events have
/// finite `ts >= 0` and `dur >= 0`; `"M"` events are one of the known metadata kinds, and the
/// `*_name` ones carry a string `args.name`; `args`, when present, is an object; complete events
/// of one (pid, tid) either do not overlap or nest (a child ends no later than its parent).
pub fn validate(text: &str, file: &str) -> Result<TraceSummary, TraceError> {
    let v: Json = serde_json::from_str(text).map_err(|e| TraceError::Json {
        file: file.to_string(),
        msg: e.to_string(),
    })?;
    validate_value(&v, file)
}

/// [`validate`] on parsed JSON.
pub fn validate_value(v: &Json, file: &str) -> Result<TraceSummary, TraceError> {
    let events = trace_events(v, file)?;
    let mut summary = TraceSummary::default();
    // (pid, tid) -> [(ts, end, index)]
    let mut lanes: BTreeMap<(u64, u64), Vec<Span>> = BTreeMap::new();
    for (index, ev) in events.iter().enumerate() {
        check_event(ev, index, file, &mut summary, &mut lanes)?;
    }
    check_nesting(events, lanes, file)?;
    summary.pids.sort_unstable();
    Ok(summary)
}

/// The top-level object's checks; returns its `traceEvents` array.
fn trace_events<'a>(v: &'a Json, file: &str) -> Result<&'a Vec<Json>, TraceError> {
    let fmt_err = |msg: &str| TraceError::Format {
        file: file.to_string(),
        msg: msg.to_string(),
    };
    let obj = v
        .as_object()
        .ok_or_else(|| fmt_err("the top level must be an object"))?;
    let events = obj
        .get("traceEvents")
        .ok_or_else(|| fmt_err("missing \"traceEvents\""))?
        .as_array()
        .ok_or_else(|| fmt_err("\"traceEvents\" must be an array"))?;
    if let Some(u) = obj.get("displayTimeUnit") {
        match u.as_str() {
            Some("ms") | Some("ns") => {}
            _ => return Err(fmt_err("\"displayTimeUnit\" must be \"ms\" or \"ns\"")),
        }
    }
    if let Some(o) = obj.get("otherData") {
        if !o.is_object() {
            return Err(fmt_err("\"otherData\" must be an object"));
        }
    }
    Ok(events)
}

/// Checks event `index` of `traceEvents`; counts it in `summary` and files a complete
/// event's span under its (pid, tid) in `lanes`.
fn check_event(
    ev: &Json,
    index: usize,
    file: &str,
    summary: &mut TraceSummary,
    lanes: &mut BTreeMap<(u64, u64), Vec<Span>>,
) -> Result<(), TraceError> {
    let name = ev
        .get("name")
        .and_then(Json::as_str)
        .unwrap_or("?")
        .to_string();
    let err = |msg: String| TraceError::Event {
        file: file.to_string(),
        index,
        name: name.clone(),
        msg,
    };
    let e = ev
        .as_object()
        .ok_or_else(|| err("an event must be an object".into()))?;
    if !matches!(e.get("name"), Some(Json::String(_))) {
        return Err(err("\"name\" must be a string".into()));
    }
    let ph = e
        .get("ph")
        .and_then(Json::as_str)
        .ok_or_else(|| err("\"ph\" must be a string".into()))?;
    if !PHASES.contains(&ph) {
        return Err(err(format!("unknown phase \"ph\": {ph:?}")));
    }
    if let Some(c) = e.get("cat") {
        if !c.is_string() {
            return Err(err("\"cat\" must be a string".into()));
        }
    }
    let id = |key: &str| -> Result<u64, TraceError> {
        match e.get(key) {
            None => Ok(0),
            Some(x) => x
                .as_u64()
                .ok_or_else(|| err(format!("\"{key}\" must be a non-negative integer"))),
        }
    };
    let pid = id("pid")?;
    let tid = id("tid")?;
    if let Some(a) = e.get("args") {
        if !a.is_object() {
            return Err(err("\"args\" must be an object".into()));
        }
    }
    let num = |key: &str| -> Result<Option<f64>, TraceError> {
        match e.get(key) {
            None => Ok(None),
            Some(x) => {
                let f = x
                    .as_f64()
                    .ok_or_else(|| err(format!("\"{key}\" must be a number")))?;
                if !f.is_finite() || f < 0.0 {
                    return Err(err(format!("\"{key}\" must be finite and >= 0 (got {f})")));
                }
                Ok(Some(f))
            }
        }
    };
    match ph {
        "X" => {
            let ts = num("ts")?.ok_or_else(|| err("an \"X\" event needs \"ts\"".into()))?;
            let dur = num("dur")?.ok_or_else(|| err("an \"X\" event needs \"dur\"".into()))?;
            summary.complete_events += 1;
            summary.end_us = summary.end_us.max(ts + dur);
            if !summary.pids.contains(&(pid as u32)) {
                summary.pids.push(pid as u32);
            }
            lanes
                .entry((pid, tid))
                .or_default()
                .push((ts, ts + dur, index));
        }
        "M" => {
            if !METADATA.contains(&name.as_str()) {
                return Err(err(format!(
                    "unknown metadata event (expected one of {})",
                    METADATA.join(", ")
                )));
            }
            if name.ends_with("_name") {
                let ok = e
                    .get("args")
                    .and_then(|a| a.get("name"))
                    .is_some_and(Json::is_string);
                if !ok {
                    return Err(err(format!("{name} needs a string \"args\".\"name\"")));
                }
            }
            summary.metadata_events += 1;
        }
        _ => {
            num("ts")?.ok_or_else(|| err(format!("a \"{ph}\" event needs \"ts\"")))?;
        }
    }
    Ok(())
}

/// Complete events on one thread: disjoint or nested. Sort by start, longer first, and
/// keep a stack of open parents.
fn check_nesting(
    events: &[Json],
    lanes: BTreeMap<(u64, u64), Vec<Span>>,
    file: &str,
) -> Result<(), TraceError> {
    const EPS: f64 = 1e-3; // the writer's resolution (1 ns)
    for ((pid, tid), mut spans) in lanes {
        spans.sort_by(|a, b| {
            a.0.total_cmp(&b.0)
                .then(b.1.total_cmp(&a.1))
                .then(a.2.cmp(&b.2))
        });
        let mut stack: Vec<Span> = Vec::new();
        for s in spans {
            while stack.last().is_some_and(|top| top.1 <= s.0 + EPS) {
                stack.pop();
            }
            if let Some(top) = stack.last() {
                if s.1 > top.1 + EPS {
                    let name = events[s.2]
                        .get("name")
                        .and_then(Json::as_str)
                        .unwrap_or("?")
                        .to_string();
                    let other = events[top.2]
                        .get("name")
                        .and_then(Json::as_str)
                        .unwrap_or("?");
                    return Err(TraceError::Event {
                        file: file.to_string(),
                        index: s.2,
                        name,
                        msg: format!(
                            "overlaps traceEvents[{}] ({other}) on pid {pid} tid {tid} \
                             without nesting: [{}, {}] vs [{}, {}] us",
                            top.2, s.0, s.1, top.0, top.1
                        ),
                    });
                }
            }
            stack.push(s);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Trace {
        let mut t = Trace::new();
        t.add_rank_metadata(0);
        t.push(TraceEvent::complete(
            0, 0, "matmul", "compute", 0.0, 10.5, "fc1", "MatMul", 0,
        ));
        t.push(TraceEvent::complete(
            0,
            1,
            "ag",
            "collective",
            2.0,
            4.25,
            "ag_fc1",
            "AllGather",
            4096,
        ));
        t.push(TraceEvent::complete(
            0, 0, "add", "compute", 10.5, 1.0, "add1", "Add", 0,
        ));
        t.set_other("source", "test");
        t
    }

    #[test]
    fn round_trip_and_valid() {
        let t = sample();
        let text = t.to_json();
        let s = validate(&text, "t.json").unwrap();
        assert_eq!(s.complete_events, 3);
        assert_eq!(s.metadata_events, 4);
        assert_eq!(s.pids, vec![0]);
        assert!((s.end_us - 11.5).abs() < 1e-9);
        let back = Trace::from_json(&text, "t.json").unwrap();
        assert_eq!(back, t);
        assert_eq!(back.spans().nth(1).unwrap().node(), Some("ag_fc1"));
        assert_eq!(back.spans().nth(1).unwrap().bytes(), Some(4096));
        // deterministic
        assert_eq!(text, sample().to_json());
    }

    #[test]
    fn times_print_at_ns_resolution() {
        let mut s = String::new();
        fmt_us(&mut s, 1.23456);
        s.push(' ');
        fmt_us(&mut s, 7.0);
        s.push(' ');
        fmt_us(&mut s, 0.5);
        assert_eq!(s, "1.235 7 0.5");
        // back-to-back spans whose ends round up and starts round down stay disjoint
        let mut t = Trace::new();
        t.push(TraceEvent::complete(
            0, 0, "a", "", 0.0834, 0.0042, "a", "A", 0,
        ));
        t.push(TraceEvent::complete(
            0, 0, "b", "", 0.0876, 0.003, "b", "B", 0,
        ));
        validate(&t.to_json(), "t.json").unwrap();
    }

    #[test]
    fn rejects_bad_traces() {
        let bad = |text: &str, want: &str| {
            let e = validate(text, "x.json").unwrap_err().to_string();
            assert!(e.contains(want), "{e} should mention {want}");
        };
        bad("[1,2]", "top level must be an object");
        bad("{}", "missing \"traceEvents\"");
        bad(r#"{"traceEvents": 3}"#, "must be an array");
        bad(
            r#"{"traceEvents": [{"name":"a","ph":"Q","ts":0}]}"#,
            "unknown phase",
        );
        bad(
            r#"{"traceEvents": [{"name":"a","ph":"X","ts":0}]}"#,
            "needs \"dur\"",
        );
        bad(
            r#"{"traceEvents": [{"name":"a","ph":"X","ts":-1,"dur":1}]}"#,
            "\"ts\" must be finite and >= 0",
        );
        bad(
            r#"{"traceEvents": [{"name":"a","ph":"X","ts":0,"dur":1,"pid":-2}]}"#,
            "\"pid\" must be a non-negative integer",
        );
        bad(
            r#"{"traceEvents": [{"name":"process_name","ph":"M","pid":0}]}"#,
            "needs a string \"args\".\"name\"",
        );
        bad(
            r#"{"traceEvents": [{"name":"a","ph":"X","ts":0,"dur":1,"args":[]}]}"#,
            "\"args\" must be an object",
        );
        bad(
            r#"{"traceEvents": [], "displayTimeUnit": "s"}"#,
            "displayTimeUnit",
        );
        bad(
            r#"{"traceEvents": [{"name":"a","ph":"X","ts":0,"dur":5},
                                {"name":"b","ph":"X","ts":3,"dur":5}]}"#,
            "overlaps traceEvents[0] (a)",
        );
        // nested and touching spans are fine; other threads are independent
        validate(
            r#"{"traceEvents": [{"name":"a","ph":"X","ts":0,"dur":5},
                                {"name":"b","ph":"X","ts":1,"dur":2},
                                {"name":"c","ph":"X","ts":5,"dur":2},
                                {"name":"d","ph":"X","ts":1,"dur":9,"tid":1}]}"#,
            "ok.json",
        )
        .unwrap();
    }
}
