//! The plan: what `hzp compile` writes and `hzp run` reads.
//!
//! A [`Plan`] is the per-rank SPMD program of one training step with every decision made:
//! streams and events (scheduling), the shard groups P, G and O, and the offset of every
//! buffer in a per-rank arena (memory planning). It is stored as `plan.json` ([`Plan::to_json`],
//! [`Plan::from_json`]) and printed for people with [`Plan::to_text`].
//!
//! # The JSON form
//!
//! ```text
//! {
//!   "version": 3,
//!   "content_hash": "<sha-256 of the canonical JSON of everything else, hex>",
//!   "model": "...", "strategy": "...",
//!   "mesh": {"axes": [{"name": "gpu", "size": 4}]},
//!   "groups": {"params": {"axes": ["gpu"]}, "grads": ..., "optim": ...},
//!   "arena_bytes": 4096,
//!   "buffers": [{"value": 3, "offset": 0, "bytes": 1024, "kind": "activation"}, ...],
//!   "program": ["program \"m\"", "mesh gpu=4", "", "param %w : f32[4,4]", ...],
//!   "data": [{"name": "w", "dtype": "f32", "shape": [4,4], "base64": "..."}]
//! }
//! ```
//!
//! - `program` is the program in the text form ([`crate::text`]), one string per line, so the
//!   plan diffs line by line and is read back by the same (never panicking, verifying) parser.
//!   Value ids (`buffers[].value`) are the program's ids, which the text form preserves.
//! - `data` holds what the text form keeps out of line ([`crate::text::sidecar_entries`]):
//!   parameter data where there is any (presets of large models have none) and large constants
//!   and initial states, as little-endian bytes in base64 (exact for every dtype, NaN and
//!   infinities included, and about 1.33 bytes per byte of data).
//! - The canonical JSON is the same object without `content_hash`, keys sorted, no whitespace;
//!   its SHA-256 is the content hash ([`content_hash_of`]). Reading refuses another format version
//!   before anything else, then a content hash that does not match.

use crate::dtype::DType;
use crate::layout::ParamLayout;
use crate::mesh::{Group, Mesh};
use crate::program::{Program, ValueId};
use crate::tensor::{Data, Tensor};
use crate::text;
use half::{bf16, f16};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fmt::{self, Write as _};

/// The plan format this hzp writes and reads. Version 3 added node roles to the program
/// (`role=...` in the text form); a version 2 plan has none, so it is refused with the
/// version message and must be compiled again.
pub const PLAN_VERSION: u32 = 3;

/// Largest dimension and element count a plan may declare (as the text form).
const MAX_SIZE: u64 = 1 << 62;

/// The three shard groups of AsyncHZP: parameters are sharded over P, gradients are
/// reduce-scattered over G, optimizer states are sharded over O.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardGroups {
    pub params: Group,
    pub grads: Group,
    pub optim: Group,
}

/// What a buffer holds (for memory reports).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferKind {
    Param,
    Grad,
    OptimState,
    Activation,
    CommBuffer,
    Input,
    Other,
}

impl BufferKind {
    pub const ALL: [BufferKind; 7] = [
        BufferKind::Param,
        BufferKind::Grad,
        BufferKind::OptimState,
        BufferKind::Activation,
        BufferKind::CommBuffer,
        BufferKind::Input,
        BufferKind::Other,
    ];

    /// The name used in JSON and text (`optim_state`).
    pub fn name(self) -> &'static str {
        match self {
            BufferKind::Param => "param",
            BufferKind::Grad => "grad",
            BufferKind::OptimState => "optim_state",
            BufferKind::Activation => "activation",
            BufferKind::CommBuffer => "comm_buffer",
            BufferKind::Input => "input",
            BufferKind::Other => "other",
        }
    }
}

impl fmt::Display for BufferKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The bytes `offset..offset + bytes` of the per-rank arena hold `value`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Buffer {
    pub value: ValueId,
    pub offset: u64,
    pub bytes: u64,
    pub kind: BufferKind,
}

impl Buffer {
    /// One past the last byte (saturating: a plan read from a file may hold anything).
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.bytes)
    }
}

/// The sparse asynchronous averaging of an `asyncmesh` plan (`hzp compile --strategy
/// asyncmesh`): the replicas are the ranks along `slow_axis`; every step each parameter
/// shard averages a cycling chunk of about `sparsity / sync_every` of its elements over that
/// axis, and keeps an EMA (factor `ema_beta`) of its own per-step change to correct the
/// average's staleness. The program holds the nodes; this records the knobs for people and
/// for `hzp inspect`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AsyncMeshSpec {
    pub slow_axis: String,
    pub sync_every: usize,
    pub sparsity: f64,
    pub ema_beta: f64,
}

/// How the model was edited after import, before it was compiled (`hzp compile`'s
/// `--names`, `--freeze`, `--untie`, `--retie`): what `hzp run` repeats on the model it
/// loads, so that its parameters, evaluation and saved files are the plan's.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEdits {
    /// The name map given with `--names` (as given), when not the one beside the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub names: Option<String>,
    /// Parameters made constants, in the order given.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub freeze: Vec<String>,
    /// Parameters whose readers each got their own copy, in the order given.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub untie: Vec<String>,
    /// Weights stored twice train as one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retie: bool,
}

impl ModelEdits {
    /// No edit at all (the plan then records none).
    pub fn is_empty(&self) -> bool {
        self == &ModelEdits::default()
    }
}

/// A compiled training plan (see the [module docs](self)).
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub version: u32,
    /// The model as the user named it (a file or a preset).
    pub model: String,
    /// The strategy it was compiled with (`asynchzp`, `zero3`, `ddp`, ...).
    pub strategy: String,
    pub mesh: Mesh,
    pub groups: ShardGroups,
    /// The per-rank SPMD program, streams and events included.
    pub program: Program,
    /// Size of the per-rank arena every buffer lies in.
    pub arena_bytes: u64,
    pub buffers: Vec<Buffer>,
    /// How each parameter is cut into shards (what `hzp run` needs to shard the model's
    /// parameters and to put them back together).
    pub layouts: Vec<ParamLayout>,
    /// Micro-batches per step (each rank's input holds this many, concatenated on axis 0).
    pub micro_batches: usize,
    /// Hex SHA-256 of the model's parameters (see [`model_fingerprint`]); empty when unknown.
    pub model_fingerprint: String,
    /// The optimizer's learning rate it was compiled with (`--lr`): what `hzp run` feeds the
    /// step's learning-rate input at every step, or the maximum of a schedule. `None` for a
    /// plan without an optimizer.
    pub lr: Option<f64>,
    /// The loss it trains, as the flags gave it (`lm`, `lm labels=NAME`, `ce labels=NAME`,
    /// `mse target=NAME`, `mean`): what an evaluation of the forward computes. `None` when
    /// unknown.
    pub loss: Option<String>,
    /// The sparse asynchronous averaging of an `asyncmesh` plan (see [`AsyncMeshSpec`]);
    /// `None` for every other strategy (and then absent from the JSON).
    pub asyncmesh: Option<AsyncMeshSpec>,
    /// The mesh axes whose ranks split the experts of the routed MoE layers (`hzp compile
    /// --expert-parallel`); `None` when every rank holds every expert (and then absent
    /// from the JSON).
    pub expert_parallel: Option<Group>,
    /// How the model was edited before it was compiled (see [`ModelEdits`]); `None` when it
    /// was not (and then absent from the JSON).
    pub model_edits: Option<ModelEdits>,
    /// Hex SHA-256 of the canonical JSON of everything else (see [`Plan::compute_hash`]).
    pub content_hash: String,
}

/// Why a `plan.json` could not be read. Messages name the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("{file} is not valid plan JSON: {message} (line {line}, column {column})")]
    Json {
        file: String,
        message: String,
        line: usize,
        column: usize,
    },
    #[error("{file} is not an hzp plan: {message}")]
    NotAPlan { file: String, message: String },
    #[error(
        "{file} was written by plan format version {found}; this hzp reads version {PLAN_VERSION}"
    )]
    Version { file: String, found: u64 },
    #[error("{file} was modified after it was compiled: its content hash does not match")]
    Modified {
        file: String,
        recorded: String,
        computed: String,
    },
    #[error("{file}: {message}")]
    Invalid { file: String, message: String },
}

impl Plan {
    /// A plan with its content hash filled in.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: impl Into<String>,
        strategy: impl Into<String>,
        mesh: Mesh,
        groups: ShardGroups,
        program: Program,
        arena_bytes: u64,
        buffers: Vec<Buffer>,
    ) -> Plan {
        let mut plan = Plan {
            version: PLAN_VERSION,
            model: model.into(),
            strategy: strategy.into(),
            mesh,
            groups,
            program,
            arena_bytes,
            buffers,
            layouts: Vec::new(),
            micro_batches: 1,
            model_fingerprint: String::new(),
            lr: None,
            loss: None,
            asyncmesh: None,
            expert_parallel: None,
            model_edits: None,
            content_hash: String::new(),
        };
        plan.content_hash = plan.compute_hash();
        plan
    }

    /// A training plan, every field given, with an empty content hash: the caller sets it,
    /// computed together with the JSON ([`Plan::to_json_and_hash`]) or with
    /// [`Plan::compute_hash`], on whichever thread suits it.
    #[allow(clippy::too_many_arguments)]
    pub fn assemble(
        model: impl Into<String>,
        strategy: impl Into<String>,
        mesh: Mesh,
        groups: ShardGroups,
        program: Program,
        arena_bytes: u64,
        buffers: Vec<Buffer>,
        layouts: Vec<ParamLayout>,
        micro_batches: usize,
        model_fingerprint: String,
    ) -> Plan {
        Plan {
            version: PLAN_VERSION,
            model: model.into(),
            strategy: strategy.into(),
            mesh,
            groups,
            program,
            arena_bytes,
            buffers,
            layouts,
            micro_batches,
            model_fingerprint,
            lr: None,
            loss: None,
            asyncmesh: None,
            expert_parallel: None,
            model_edits: None,
            content_hash: String::new(),
        }
    }

    /// The same plan recording the optimizer's learning rate (the content hash is
    /// recomputed).
    pub fn with_lr(mut self, lr: Option<f64>) -> Plan {
        self.lr = lr;
        self.content_hash = self.compute_hash();
        self
    }

    /// The same plan with parameter layouts, micro-batch count and model fingerprint set
    /// (the content hash is recomputed).
    pub fn with_training(
        mut self,
        layouts: Vec<ParamLayout>,
        micro_batches: usize,
        model_fingerprint: String,
    ) -> Plan {
        self.layouts = layouts;
        self.micro_batches = micro_batches;
        self.model_fingerprint = model_fingerprint;
        self.content_hash = self.compute_hash();
        self
    }

    /// The plan's gradient group as people read it: `[node,gpu]`, or
    /// `[node,gpu] (accumulated in [gpu] for 322 of 723 parameters)` when some parameters'
    /// gradients accumulate in a narrower group (`ParamLayout::accumulate_group`).
    pub fn grads_label(&self) -> String {
        let narrow: Vec<&Group> = self
            .layouts
            .iter()
            .filter_map(|l| l.accumulate_group.as_ref())
            .collect();
        match narrow.first() {
            None => self.groups.grads.to_string(),
            Some(g) => format!(
                "{} (accumulated in {g} for {} of {} parameters)",
                self.groups.grads,
                narrow.len(),
                self.layouts.len()
            ),
        }
    }

    /// Hex SHA-256 of the canonical JSON of the plan without its `content_hash` (see
    /// [`content_hash_of`]).
    pub fn compute_hash(&self) -> String {
        let printed = text::print(&self.program);
        hash_repr(&mut self.repr(&printed, None))
    }

    /// The JSON form, pretty-printed, ending in a newline. Deterministic: the same plan gives
    /// the same bytes. The content hash written is the one computed now, so a plan written by
    /// this function always reads back.
    pub fn to_json(&self) -> String {
        self.to_json_and_hash().0
    }

    /// The JSON form (as [`Plan::to_json`]) and the content hash it records, computed once.
    pub fn to_json_and_hash(&self) -> (String, String) {
        let printed = text::print(&self.program);
        let mut repr = self.repr(&printed, None);
        let hash = hash_repr(&mut repr);
        repr.content_hash = Some(Cow::Borrowed(&hash));
        // Sized up front (the indented program lines and the buffer and layout objects,
        // generously): grown by doubling, the tens of MiB of a large plan were copied
        // several times into fresh pages.
        let cap = printed.len() * 2 + (self.buffers.len() + self.layouts.len()) * 512 + 4096;
        let mut out = Vec::with_capacity(cap);
        serde_json::to_writer_pretty(&mut out, &repr)
            .expect("serializing strings, numbers and lists to JSON cannot fail");
        out.push(b'\n');
        let s = String::from_utf8(out).expect("serde_json writes UTF-8");
        (s, hash)
    }

    /// Reads a plan. `file_name` is used in messages. Refuses another format version (before
    /// looking at anything else), a content hash that does not match, and a program that does
    /// not parse or verify. Never panics.
    pub fn from_json(text: &str, file_name: &str) -> Result<Plan, PlanError> {
        let json_err = |e: serde_json::Error| PlanError::Json {
            file: file_name.to_string(),
            message: strip_position(&e.to_string()),
            line: e.line(),
            column: e.column(),
        };
        let invalid = |message: String| PlanError::Invalid {
            file: file_name.to_string(),
            message,
        };

        // The version first: another version may be laid out differently.
        let probe: VersionProbe = serde_json::from_str(text).map_err(json_err)?;
        let found = match probe.version {
            None => {
                return Err(PlanError::NotAPlan {
                    file: file_name.to_string(),
                    message: "it has no `version` field".into(),
                })
            }
            Some(v) => v.as_u64().ok_or_else(|| PlanError::NotAPlan {
                file: file_name.to_string(),
                message: format!("its `version` is {v}, not a format number"),
            })?,
        };
        if found != PLAN_VERSION as u64 {
            return Err(PlanError::Version {
                file: file_name.to_string(),
                found,
            });
        }

        let mut repr: PlanRepr = serde_json::from_str(text).map_err(json_err)?;
        let recorded = match repr.content_hash.take() {
            Some(h) => h.into_owned(),
            None => {
                return Err(PlanError::NotAPlan {
                    file: file_name.to_string(),
                    message: "it has no `content_hash` field".into(),
                })
            }
        };
        let computed = hash_repr(&mut repr);
        if recorded != computed {
            return Err(PlanError::Modified {
                file: file_name.to_string(),
                recorded,
                computed,
            });
        }

        check_mesh(&repr.mesh).map_err(|m| invalid(format!("mesh: {m}")))?;

        // Out-of-line data by name.
        let mut data: HashMap<&str, Tensor> = HashMap::new();
        for d in &repr.data {
            let t = tensor_from_parts(d)
                .map_err(|m| invalid(format!("`data` entry `{}`: {m}", d.name.as_ref() as &str)))?;
            if data.insert(d.name.as_ref(), t).is_some() {
                return Err(invalid(format!(
                    "`data` holds `{}` twice",
                    d.name.as_ref() as &str
                )));
            }
        }
        let asked: std::cell::RefCell<HashSet<String>> = Default::default();
        let lookup = |name: &str| -> Option<Tensor> {
            asked.borrow_mut().insert(name.to_string());
            data.get(name).cloned()
        };
        let mut src = String::with_capacity(repr.program.iter().map(|l| l.len() + 1).sum());
        for line in &repr.program {
            src.push_str(line);
            src.push('\n');
        }
        let program = text::parse(&src, &format!("{file_name} (program)"), &lookup)
            .map_err(|e| invalid(format!("the program does not read back: {e}")))?;
        let asked = asked.into_inner();
        if let Some(d) = repr.data.iter().find(|d| !asked.contains(d.name.as_ref())) {
            return Err(invalid(format!(
                "`data` holds `{}`, which the program does not take from `data`",
                d.name.as_ref() as &str
            )));
        }
        for b in repr.buffers.iter() {
            if b.value.index() >= program.values.len() {
                return Err(invalid(format!(
                    "a buffer at offset {} refers to value {}, and the program has {} values",
                    b.offset,
                    b.value.0,
                    program.values.len()
                )));
            }
        }

        Ok(Plan {
            version: PLAN_VERSION,
            model: repr.model.into_owned(),
            strategy: repr.strategy.into_owned(),
            mesh: repr.mesh.into_owned(),
            groups: repr.groups.into_owned(),
            program,
            arena_bytes: repr.arena_bytes,
            buffers: repr.buffers.into_owned(),
            layouts: repr.layouts.into_owned(),
            micro_batches: repr.micro_batches,
            model_fingerprint: repr.model_fingerprint.into_owned(),
            lr: repr.lr,
            loss: repr.loss.map(Cow::into_owned),
            asyncmesh: repr.asyncmesh,
            expert_parallel: repr.expert_parallel,
            model_edits: repr.model_edits,
            content_hash: recorded,
        })
    }

    /// The plan for people: a header (format version, model, strategy, mesh, shard groups,
    /// arena size, content hash), the program in the text form, and the buffer table in arena
    /// order. Deterministic.
    pub fn to_text(&self) -> String {
        let name = |v: ValueId| {
            self.program
                .values
                .get(v.index())
                .map_or_else(|| format!("<missing {v}>"), |x| text::value_ref(&x.name))
        };
        let mut out = String::new();
        let _ = writeln!(out, "# hzp plan, format version {}", self.version);
        let _ = writeln!(out, "# model:    {}", self.model);
        let _ = writeln!(out, "# strategy: {}", self.strategy);
        let _ = writeln!(
            out,
            "# mesh:     {} ({} ranks)",
            self.mesh,
            self.mesh
                .axes
                .iter()
                .try_fold(1u64, |a, x| a.checked_mul(x.size as u64))
                .map_or("too many".to_string(), |n| n.to_string())
        );
        let _ = writeln!(
            out,
            "# groups:   params P={} grads G={} optim O={}",
            self.groups.params, self.groups.grads, self.groups.optim
        );
        if let Some(e) = &self.expert_parallel {
            let _ = writeln!(out, "# experts:  split over {e}");
        }
        let _ = writeln!(
            out,
            "# arena:    {} ({} bytes) per rank, {} buffers",
            format_bytes(self.arena_bytes),
            self.arena_bytes,
            self.buffers.len()
        );
        let _ = writeln!(out, "# hash:     sha256:{}", self.compute_hash());
        out.push('\n');
        out.push_str(&text::print(&self.program));
        out.push('\n');
        let _ = writeln!(out, "# buffers (offset, bytes, kind, value), arena order");
        let mut order: Vec<&Buffer> = self.buffers.iter().collect();
        order.sort_by_key(|b| (b.offset, b.value, b.bytes));
        let w = self.arena_bytes.to_string().len().max(6);
        for b in order {
            let _ = writeln!(
                out,
                "buffer {:>w$} {:>w$} {:<11} {}",
                b.offset,
                b.bytes,
                b.kind.name(),
                name(b.value),
            );
        }
        out
    }

    fn repr<'a>(&'a self, printed: &'a str, hash: Option<&'a str>) -> PlanRepr<'a> {
        let data = text::sidecar_entries(&self.program)
            .into_iter()
            .map(|(n, t)| DataEntry::new(n, t))
            .collect();
        PlanRepr {
            version: self.version,
            content_hash: hash.map(Cow::Borrowed),
            model: Cow::Borrowed(&self.model),
            strategy: Cow::Borrowed(&self.strategy),
            mesh: Cow::Borrowed(&self.mesh),
            groups: Cow::Borrowed(&self.groups),
            arena_bytes: self.arena_bytes,
            buffers: Cow::Borrowed(&self.buffers),
            layouts: Cow::Borrowed(&self.layouts),
            micro_batches: self.micro_batches,
            model_fingerprint: Cow::Borrowed(&self.model_fingerprint),
            lr: self.lr,
            loss: self.loss.as_deref().map(Cow::Borrowed),
            asyncmesh: self.asyncmesh.clone(),
            expert_parallel: self.expert_parallel.clone(),
            model_edits: self.model_edits.clone(),
            program: printed.lines().map(Cow::Borrowed).collect(),
            data,
        }
    }
}

/// `1.50 GiB`, `512 B`: binary units, three significant digits.
pub fn format_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut v = b as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    let digits = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    format!("{v:.digits$} {}", UNITS[u])
}

fn strip_position(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg.to_string(),
    }
}

fn check_mesh(m: &Mesh) -> Result<(), String> {
    let mut n: u64 = 1;
    for (i, a) in m.axes.iter().enumerate() {
        if a.size == 0 {
            return Err(format!("axis `{}` has size 0", a.name));
        }
        if m.axes[..i].iter().any(|b| b.name == a.name) {
            return Err(format!("axis `{}` appears twice", a.name));
        }
        n = n
            .checked_mul(a.size as u64)
            .filter(|&n| n <= MAX_SIZE)
            .ok_or("the world size overflows (the limit is 2^62)")?;
    }
    Ok(())
}

fn hash_repr(repr: &mut PlanRepr<'_>) -> String {
    debug_assert!(repr.content_hash.is_none());
    // The program's lines (most of a large plan) are hashed as they are; the rest goes
    // through a JSON value, which sorts the keys. (A value tree of every line was the
    // largest allocation of the plan's last phase.)
    let program = std::mem::take(&mut repr.program);
    let v = serde_json::to_value(&*repr);
    repr.program = program;
    let v = v.expect("serializing strings, numbers and lists to JSON cannot fail");
    let serde_json::Value::Object(m) = &v else {
        unreachable!("a plan serializes to a JSON object")
    };
    let mut h = Sha256::new();
    // (`to_value` wrote the emptied program as `[]`: left out, and the lines written instead)
    write_object(
        &mut h,
        m,
        &["content_hash", "program"],
        Some(("program", &repr.program)),
    );
    hex(&h.finish())
}

/// The content hash of a plan's JSON object: the hex SHA-256 of its canonical form, which is
/// the object without `content_hash`, keys sorted, no whitespace (as Python's
/// `json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)` writes it).
pub fn content_hash_of(v: &serde_json::Value) -> String {
    let mut h = Sha256::new();
    match v {
        // The object without its `content_hash` entry, written in place (a clone of the
        // plan's whole JSON tree to drop one key was a visible share of the compile time).
        serde_json::Value::Object(m) => write_object(&mut h, m, &["content_hash"], None),
        other => write_canonical(&mut h, other),
    }
    hex(&h.finish())
}

/// Writes a JSON object in canonical form (keys sorted), leaving out the keys in `skip`;
/// `lines` is one more entry, a list of strings.
fn write_object(
    h: &mut Sha256,
    m: &serde_json::Map<String, serde_json::Value>,
    skip: &[&str],
    lines: Option<(&str, &[Cow<'_, str>])>,
) {
    enum Entry<'v, 'l> {
        Json(&'v serde_json::Value),
        Lines(&'l [Cow<'l, str>]),
    }
    let mut entries: Vec<(&str, Entry)> = m
        .iter()
        .filter(|&(k, _)| !skip.contains(&k.as_str()))
        .map(|(k, x)| (k.as_str(), Entry::Json(x)))
        .collect();
    if let Some((k, l)) = lines {
        entries.push((k, Entry::Lines(l)));
    }
    entries.sort_by_key(|&(k, _)| k);
    h.update(b"{");
    for (i, (k, x)) in entries.into_iter().enumerate() {
        if i > 0 {
            h.update(b",");
        }
        write_string(h, k);
        h.update(b":");
        match x {
            Entry::Json(x) => write_canonical(h, x),
            Entry::Lines(l) => {
                h.update(b"[");
                for (j, s) in l.iter().enumerate() {
                    if j > 0 {
                        h.update(b",");
                    }
                    write_string(h, s);
                }
                h.update(b"]");
            }
        }
    }
    h.update(b"}");
}

fn write_canonical(h: &mut Sha256, v: &serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Null => h.update(b"null"),
        Value::Bool(b) => h.update(if *b { b"true" } else { b"false" }),
        Value::Number(n) => h.update(n.to_string().as_bytes()),
        Value::String(s) => write_string(h, s),
        Value::Array(a) => {
            h.update(b"[");
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                write_canonical(h, x);
            }
            h.update(b"]");
        }
        Value::Object(m) => write_object(h, m, &[], None),
    }
}

fn write_string(h: &mut Sha256, s: &str) {
    let _ = serde_json::to_writer(&mut *h, s);
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// The fingerprint of a model's parameters: hex SHA-256 over each parameter's name, dtype and
/// shape, and its data where it has any, in the order given. `hzp run` refuses a plan whose
/// fingerprint differs from the model it is handed.
pub fn model_fingerprint<'a>(
    params: impl IntoIterator<Item = (&'a str, &'a crate::TensorType, Option<&'a Tensor>)>,
) -> String {
    let mut h = Sha256::new();
    for (name, ty, data) in params {
        h.update(name.as_bytes());
        h.update(&[0]);
        h.update(ty.to_string().as_bytes());
        h.update(&[0]);
        if let Some(t) = data {
            h.update(&data_bytes(&t.data));
        }
        h.update(&[1]);
    }
    hex(&h.finish())
}

fn one() -> usize {
    1
}

// ---------------------------------------------------------------------------------------------
// The JSON layout.

#[derive(Deserialize)]
struct VersionProbe {
    version: Option<serde_json::Value>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanRepr<'a> {
    version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none", borrow)]
    content_hash: Option<Cow<'a, str>>,
    #[serde(borrow)]
    model: Cow<'a, str>,
    #[serde(borrow)]
    strategy: Cow<'a, str>,
    mesh: Cow<'a, Mesh>,
    groups: Cow<'a, ShardGroups>,
    arena_bytes: u64,
    buffers: Cow<'a, [Buffer]>,
    #[serde(default)]
    layouts: Cow<'a, [ParamLayout]>,
    #[serde(default = "one")]
    micro_batches: usize,
    #[serde(default, borrow)]
    model_fingerprint: Cow<'a, str>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lr: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none", borrow)]
    loss: Option<Cow<'a, str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    asyncmesh: Option<AsyncMeshSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    expert_parallel: Option<Group>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model_edits: Option<ModelEdits>,
    #[serde(borrow)]
    program: Vec<Cow<'a, str>>,
    #[serde(default, borrow)]
    data: Vec<DataEntry<'a>>,
}

/// Out-of-line tensor data: `{"name": "w", "dtype": "f32", "shape": [2,3], "base64": "..."}`
/// with the elements as little-endian bytes.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct DataEntry<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
    dtype: DType,
    shape: Vec<u64>,
    base64: String,
}

impl<'a> DataEntry<'a> {
    fn new(name: &'a str, t: &Tensor) -> DataEntry<'a> {
        DataEntry {
            name: Cow::Borrowed(name),
            dtype: t.dtype(),
            shape: t.shape.iter().map(|&d| d as u64).collect(),
            base64: base64_encode(&data_bytes(&t.data)),
        }
    }
}

fn data_bytes(d: &Data) -> Vec<u8> {
    let mut out = Vec::with_capacity(d.len() * d.dtype().size_bytes());
    match d {
        Data::F32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Data::BF16(v) => v.iter().for_each(|x| out.extend(x.to_bits().to_le_bytes())),
        Data::F16(v) => v.iter().for_each(|x| out.extend(x.to_bits().to_le_bytes())),
        Data::I64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Data::I32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Data::Bool(v) => out.extend(v.iter().map(|&b| b as u8)),
    }
    out
}

fn tensor_from_parts(raw: &DataEntry<'_>) -> Result<Tensor, String> {
    let mut n: u64 = 1;
    let mut zero = false;
    for &d in &raw.shape {
        if d > MAX_SIZE {
            return Err(format!("dimension {d} is too large (the limit is 2^62)"));
        }
        zero |= d == 0;
        n = n.saturating_mul(d);
    }
    if zero {
        n = 0;
    } else if n > MAX_SIZE {
        return Err("the element count is too large (the limit is 2^62)".into());
    }
    let bytes = base64_decode(&raw.base64)?;
    let size = raw.dtype.size_bytes() as u64;
    if bytes.len() as u64 != n.saturating_mul(size) {
        return Err(format!(
            "{} data for shape {:?} must be {} bytes, the base64 holds {}",
            raw.dtype,
            raw.shape,
            n.saturating_mul(size),
            bytes.len()
        ));
    }
    let arr2 = |c: &[u8]| [c[0], c[1]];
    let arr4 = |c: &[u8]| [c[0], c[1], c[2], c[3]];
    let arr8 = |c: &[u8]| [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]];
    let data = match raw.dtype {
        DType::F32 => Data::F32(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(arr4(c)))
                .collect(),
        ),
        DType::BF16 => Data::BF16(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes(arr2(c))))
                .collect(),
        ),
        DType::F16 => Data::F16(
            bytes
                .chunks_exact(2)
                .map(|c| f16::from_bits(u16::from_le_bytes(arr2(c))))
                .collect(),
        ),
        DType::I64 => Data::I64(
            bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(arr8(c)))
                .collect(),
        ),
        DType::I32 => Data::I32(
            bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(arr4(c)))
                .collect(),
        ),
        DType::Bool => {
            if bytes.iter().any(|&b| b > 1) {
                return Err("bool data must be bytes 0 or 1".into());
            }
            Data::Bool(bytes.iter().map(|&b| b == 1).collect())
        }
    };
    let shape = raw.shape.iter().map(|&d| d as usize).collect();
    Ok(Tensor { shape, data })
}

// ---------------------------------------------------------------------------------------------
// Base64 (RFC 4648, standard alphabet, padded).

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64_encode(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for (i, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            if i <= c.len() {
                s.push(B64[(n >> shift & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

fn base64_decode(s: &str) -> Result<Vec<u8>, String> {
    let bad = || "`base64` is not valid base64".to_string();
    let b = s.as_bytes();
    if !b.len().is_multiple_of(4) {
        return Err(bad());
    }
    let val = |c: u8| -> Option<u32> {
        match c {
            b'A'..=b'Z' => Some((c - b'A') as u32),
            b'a'..=b'z' => Some((c - b'a') as u32 + 26),
            b'0'..=b'9' => Some((c - b'0') as u32 + 52),
            b'+' => Some(62),
            b'/' => Some(63),
            _ => None,
        }
    };
    let mut out = Vec::with_capacity(b.len() / 4 * 3);
    let nchunks = b.len() / 4;
    for (k, c) in b.chunks_exact(4).enumerate() {
        let pad = if k + 1 == nchunks {
            c.iter().rev().take_while(|&&x| x == b'=').count()
        } else {
            0
        };
        if pad > 2 {
            return Err(bad());
        }
        let mut n = 0u32;
        for &x in &c[..4 - pad] {
            n = n << 6 | val(x).ok_or_else(bad)?;
        }
        n <<= 6 * pad as u32;
        let got = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        // canonical: the bits under the padding must be zero
        if (pad == 1 && got[2] != 0) || (pad == 2 && (got[1] != 0 || got[2] != 0)) {
            return Err(bad());
        }
        out.extend_from_slice(&got[..3 - pad]);
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// SHA-256, from the `sha2` crate (SHA-NI / AVX2 where the CPU has them): a 100B-scale plan's
// canonical form is tens of MiB.

/// A streaming SHA-256; write bytes with [`std::io::Write`] or [`Sha256::update`]. The
/// canonical JSON writer sends many tiny pieces; they are gathered into blocks first.
pub struct Sha256 {
    inner: sha2::Sha256,
    buf: Vec<u8>,
}

impl Default for Sha256 {
    fn default() -> Self {
        Sha256::new()
    }
}

const SHA_BUF: usize = 1 << 16;

impl Sha256 {
    pub fn new() -> Sha256 {
        Sha256 {
            inner: <sha2::Sha256 as sha2::Digest>::new(),
            buf: Vec::with_capacity(SHA_BUF),
        }
    }

    pub fn update(&mut self, data: &[u8]) {
        if self.buf.len() + data.len() > SHA_BUF {
            sha2::Digest::update(&mut self.inner, &self.buf);
            self.buf.clear();
            if data.len() > SHA_BUF {
                sha2::Digest::update(&mut self.inner, data);
                return;
            }
        }
        self.buf.extend_from_slice(data);
    }

    pub fn finish(mut self) -> [u8; 32] {
        sha2::Digest::update(&mut self.inner, &self.buf);
        let mut out = [0u8; 32];
        out.copy_from_slice(&sha2::Digest::finalize(self.inner));
        out
    }
}

impl std::io::Write for Sha256 {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Hex SHA-256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(data);
    hex(&h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_known_answers() {
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            sha256_hex(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        // streaming in odd pieces gives the same digest as one piece
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut h = Sha256::new();
        for c in data.chunks(37) {
            h.update(c);
        }
        assert_eq!(hex(&h.finish()), sha256_hex(&data));
    }

    #[test]
    fn base64_round_trips_and_refuses_junk() {
        for n in 0..10 {
            let b: Vec<u8> = (0..n).map(|i| (i * 91 + 7) as u8).collect();
            let s = base64_encode(&b);
            assert_eq!(base64_decode(&s).unwrap(), b, "{s}");
        }
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
        for bad in ["Zm8", "Zm9=Zm8=", "Z===", "Zm!=", "Zm9="] {
            assert!(base64_decode(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bytes_in_human_units() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(80 << 30), "80.0 GiB");
        assert_eq!(format_bytes(u64::MAX), "16.0 EiB");
    }
}
