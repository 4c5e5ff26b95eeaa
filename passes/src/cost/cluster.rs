//! Cluster specifications: what one device can do and how fast the links between devices are.
//!
//! A [`ClusterSpec`] is read from TOML (see `examples/clusters/*.toml`):
//!
//! ```toml
//! name = "h100-dgx"
//! mesh = "node=128,gpu=8"        # the default mesh: outermost axis first
//! devices_per_node = 8
//!
//! [device]
//! name = "NVIDIA H100 SXM5 80GB"
//! memory = "80GiB"               # bytes: a number or "80GiB", "64GB", ...
//! peak_bf16 = "989TFLOPS"        # dense tensor-core peak used by matmuls in bf16
//! peak_fp32 = "67TFLOPS"         # non-tensor fp32 peak (also used by non-matmul ops)
//! memory_bandwidth = "3.35TB/s"
//! matmul_efficiency = 0.6        # optional, fraction of peak matmuls reach
//!
//! [[links]]
//! name = "nvlink"
//! axes = ["gpu"]                 # mesh axes whose neighbours talk over this link
//! bandwidth = "450GB/s"          # per direction, per device
//! latency = "3us"                # per message (the alpha of alpha-beta)
//! ```
//!
//! Quantities accept plain numbers (bytes, bytes/s, FLOP/s, seconds) or strings with units:
//! [`parse_bytes`], [`parse_rate`], [`parse_flops`], [`parse_duration`]. Decimal prefixes
//! (`KB`, `GB`, ...) are powers of 1000 and binary ones (`KiB`, `GiB`, ...) powers of 1024; a
//! lower-case `b` means bits (`400Gb/s` = 50e9 bytes/s).
//!
//! A mesh axis finds its link by name; a split axis (`gpu.0`, `gpu.1` from `gpu=2x4`) inherits
//! the link of the axis it was split from unless a link names it exactly.
//!
//! Errors name the file, the line and the key (`links[1].bandwidth`) where they can.

use hzp_ir::{Group, Mesh};
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

/// Default fraction of the dtype's peak that matmuls reach.
pub const DEFAULT_MATMUL_EFFICIENCY: f64 = 0.6;
/// Default fraction of the vector (non-tensor) peak that non-matmul ops reach.
pub const DEFAULT_VECTOR_EFFICIENCY: f64 = 0.6;
/// Default fraction of the memory bandwidth that streaming (bandwidth-bound) kernels reach.
pub const DEFAULT_MEMORY_EFFICIENCY: f64 = 0.8;

/// A cluster: one kind of device, a default mesh, and link classes bound to mesh axes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The mesh used when the user gives none (e.g. `node=128,gpu=8`).
    #[serde(serialize_with = "ser_mesh", deserialize_with = "de_mesh")]
    pub mesh: Mesh,
    /// Devices in one node (one host).
    pub devices_per_node: usize,
    pub device: DeviceSpec,
    pub links: Vec<Link>,
}

/// What one device can do. Rates are per second; memory in bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Device memory in bytes (TOML key `memory`).
    #[serde(rename = "memory", deserialize_with = "de_bytes")]
    pub memory_bytes: u64,
    /// Dense bf16 peak FLOP/s of the matrix units (TOML key `peak_bf16`).
    #[serde(rename = "peak_bf16", deserialize_with = "de_flops")]
    pub peak_flops_bf16: f64,
    /// Dense fp16 peak FLOP/s; the bf16 peak when absent (TOML key `peak_fp16`).
    #[serde(
        rename = "peak_fp16",
        default,
        deserialize_with = "de_opt_flops",
        skip_serializing_if = "Option::is_none"
    )]
    pub peak_flops_fp16: Option<f64>,
    /// fp32 peak FLOP/s without tensor cores (TOML key `peak_fp32`). Matmuls in f32 and every
    /// non-matmul op use it.
    #[serde(rename = "peak_fp32", deserialize_with = "de_flops")]
    pub peak_flops_fp32: f64,
    /// Memory bandwidth in bytes/s (TOML key `memory_bandwidth`).
    #[serde(deserialize_with = "de_rate")]
    pub memory_bandwidth: f64,
    /// Fraction of the peak matmuls reach, in (0, 1].
    #[serde(default = "default_matmul_eff")]
    pub matmul_efficiency: f64,
    /// Fraction of the vector peak non-matmul ops reach, in (0, 1].
    #[serde(default = "default_vector_eff")]
    pub vector_efficiency: f64,
    /// Fraction of the memory bandwidth kernels reach, in (0, 1].
    #[serde(default = "default_memory_eff")]
    pub memory_efficiency: f64,
    /// Fixed cost added to every op that does work (kernel launch), in seconds; default 0.
    #[serde(default, deserialize_with = "de_duration")]
    pub launch_overhead: f64,
}

/// A link class (NVLink, InfiniBand, ...) and the mesh axes that communicate over it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    pub name: String,
    /// Mesh axes whose neighbours are connected by this link (`gpu`, or a split `gpu.1`).
    pub axes: Vec<String>,
    /// Bytes/s per direction per device (what one rank can send while it also receives).
    #[serde(deserialize_with = "de_rate")]
    pub bandwidth: f64,
    /// Seconds per message: the alpha of the alpha-beta model.
    #[serde(deserialize_with = "de_duration")]
    pub latency: f64,
    /// Fraction of `bandwidth` that collectives achieve, in (0, 1]; default 1.
    #[serde(default = "one")]
    pub efficiency: f64,
}

impl Link {
    /// Bandwidth a collective sees on this link: `bandwidth * efficiency`, bytes/s.
    pub fn effective_bandwidth(&self) -> f64 {
        self.bandwidth * self.efficiency
    }
}

fn default_matmul_eff() -> f64 {
    DEFAULT_MATMUL_EFFICIENCY
}
fn default_vector_eff() -> f64 {
    DEFAULT_VECTOR_EFFICIENCY
}
fn default_memory_eff() -> f64 {
    DEFAULT_MEMORY_EFFICIENCY
}
fn one() -> f64 {
    1.0
}

/// An error in a cluster spec: where it is (file, line, column, key) and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterError {
    pub file: Option<String>,
    /// 1-based.
    pub line: Option<usize>,
    /// 1-based.
    pub column: Option<usize>,
    /// The key, as a path: `mesh`, `device.memory`, `links[1].bandwidth`.
    pub key: Option<String>,
    pub message: String,
}

impl ClusterError {
    fn at_key(key: impl Into<String>, message: impl Into<String>) -> ClusterError {
        ClusterError {
            file: None,
            line: None,
            column: None,
            key: Some(key.into()),
            message: message.into(),
        }
    }
}

impl fmt::Display for ClusterError {
    /// `clusters/x.toml:12:3: links[1].bandwidth: bandwidth must be > 0`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(file) = &self.file {
            f.write_str(file)?;
            if let Some(line) = self.line {
                write!(f, ":{line}")?;
                if let Some(col) = self.column {
                    write!(f, ":{col}")?;
                }
            }
            f.write_str(": ")?;
        } else if let Some(line) = self.line {
            write!(f, "line {line}: ")?;
        }
        if let Some(key) = &self.key {
            write!(f, "{key}: ")?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for ClusterError {}

/// The largest cluster spec file read (specs are a few KiB).
const MAX_SPEC_BYTES: u64 = 16 << 20;

impl ClusterSpec {
    /// Reads and validates a spec from a TOML file.
    pub fn load(path: impl AsRef<Path>) -> Result<ClusterSpec, ClusterError> {
        let path = path.as_ref();
        let file = path.display().to_string();
        let fail = |message: String| ClusterError {
            file: Some(file.clone()),
            line: None,
            column: None,
            key: None,
            message,
        };
        // A spec is a small regular file: a FIFO or a device would block or never end.
        match std::fs::metadata(path) {
            Ok(m) if !m.is_file() => {
                return Err(fail(
                    "cannot read the cluster spec: it is not a regular file".into(),
                ))
            }
            Ok(m) if m.len() > MAX_SPEC_BYTES => {
                return Err(fail(format!(
                "the cluster spec is {} bytes, more than the limit of {MAX_SPEC_BYTES} for a spec",
                m.len()
            )))
            }
            _ => {}
        }
        let src = std::fs::read_to_string(path)
            .map_err(|e| fail(format!("cannot read the cluster spec: {e}")))?;
        ClusterSpec::from_toml_str(&src, &file)
    }

    /// Parses and validates a spec; `file_name` only names the source in errors.
    pub fn from_toml_str(src: &str, file_name: &str) -> Result<ClusterSpec, ClusterError> {
        let index = KeyIndex::new(src);
        let spec: ClusterSpec = toml::from_str(src).map_err(|e| {
            let (line, column) = match e.span() {
                Some(span) => {
                    let (l, c) = line_col(src, span.start);
                    (Some(l), Some(c))
                }
                None => (None, None),
            };
            ClusterError {
                file: Some(file_name.to_string()),
                line,
                column,
                key: line.and_then(|l| index.key_at(l)),
                message: e.message().trim().to_string(),
            }
        })?;
        spec.validate().map_err(|mut e| {
            e.file = Some(file_name.to_string());
            if let Some(key) = &e.key {
                e.line = index.line_of(key);
            }
            e
        })?;
        Ok(spec)
    }

    /// This spec as TOML (quantities as plain numbers); [`ClusterSpec::from_toml_str`] reads it back.
    pub fn to_toml_string(&self) -> Result<String, String> {
        toml::to_string(self).map_err(|e| e.to_string())
    }

    /// Checks values (positive rates, efficiencies in (0, 1], unique link names and axes) and
    /// that every axis of the default mesh has a link. Errors carry the key, not the line.
    pub fn validate(&self) -> Result<(), ClusterError> {
        if self.name.trim().is_empty() {
            return Err(ClusterError::at_key("name", "the cluster needs a name"));
        }
        if self.devices_per_node == 0 {
            return Err(ClusterError::at_key(
                "devices_per_node",
                "devices_per_node must be at least 1",
            ));
        }
        let d = &self.device;
        if d.memory_bytes == 0 {
            return Err(ClusterError::at_key("device.memory", "memory must be > 0"));
        }
        positive("device.peak_bf16", d.peak_flops_bf16)?;
        if let Some(p) = d.peak_flops_fp16 {
            positive("device.peak_fp16", p)?;
        }
        positive("device.peak_fp32", d.peak_flops_fp32)?;
        positive("device.memory_bandwidth", d.memory_bandwidth)?;
        fraction("device.matmul_efficiency", d.matmul_efficiency)?;
        fraction("device.vector_efficiency", d.vector_efficiency)?;
        fraction("device.memory_efficiency", d.memory_efficiency)?;
        non_negative("device.launch_overhead", d.launch_overhead)?;
        at_most_an_hour("device.launch_overhead", d.launch_overhead)?;
        if self.links.is_empty() {
            return Err(ClusterError::at_key(
                "links",
                "the cluster needs at least one [[links]] entry",
            ));
        }
        let mut owner: BTreeMap<&str, &str> = BTreeMap::new();
        for (i, l) in self.links.iter().enumerate() {
            let key = |k: &str| format!("links[{i}].{k}");
            if l.name.trim().is_empty() {
                return Err(ClusterError::at_key(key("name"), "a link needs a name"));
            }
            if self.links[..i].iter().any(|o| o.name == l.name) {
                return Err(ClusterError::at_key(
                    key("name"),
                    format!("link name `{}` is used twice", l.name),
                ));
            }
            if l.axes.is_empty() {
                return Err(ClusterError::at_key(
                    key("axes"),
                    format!("link `{}` binds no mesh axis", l.name),
                ));
            }
            for a in &l.axes {
                if a.trim().is_empty() {
                    return Err(ClusterError::at_key(key("axes"), "empty axis name"));
                }
                if let Some(prev) = owner.insert(a, &l.name) {
                    return Err(ClusterError::at_key(
                        key("axes"),
                        format!(
                            "axis `{a}` is bound to both link `{prev}` and link `{}`",
                            l.name
                        ),
                    ));
                }
            }
            positive(&key("bandwidth"), l.bandwidth)?;
            if l.bandwidth < MIN_LINK_BANDWIDTH {
                return Err(ClusterError::at_key(
                    key("bandwidth"),
                    format!(
                        "must be at least {MIN_LINK_BANDWIDTH} B/s, got {} B/s (a collective's time would not be a duration)",
                        l.bandwidth
                    ),
                ));
            }
            non_negative(&key("latency"), l.latency)?;
            at_most_an_hour(&key("latency"), l.latency)?;
            fraction(&key("efficiency"), l.efficiency)?;
        }
        self.validate_mesh(&self.mesh).map_err(|mut e| {
            e.key = Some("mesh".into());
            e
        })
    }

    /// Checks that every axis of `mesh` (the default one or a user's) has a link class.
    pub fn validate_mesh(&self, mesh: &Mesh) -> Result<(), ClusterError> {
        for a in &mesh.axes {
            self.link_for_axis(&a.name)?;
        }
        Ok(())
    }

    /// The link class of a mesh axis. An exact binding wins; otherwise a split axis (`gpu.1`)
    /// inherits the link of the axis it was split from (`gpu`).
    pub fn link_for_axis(&self, axis: &str) -> Result<&Link, ClusterError> {
        let mut name = axis;
        loop {
            if let Some(l) = self.links.iter().find(|l| l.axes.iter().any(|a| a == name)) {
                return Ok(l);
            }
            match name.rsplit_once('.') {
                Some((base, idx)) if !idx.is_empty() && idx.bytes().all(|b| b.is_ascii_digit()) => {
                    name = base;
                }
                _ => break,
            }
        }
        let covered: Vec<String> = self
            .links
            .iter()
            .map(|l| format!("{} -> {}", l.name, l.axes.join(",")))
            .collect();
        Err(ClusterError::at_key(
            "links",
            format!(
                "mesh axis `{axis}` has no link class in cluster `{}` (links: {}); add it to the \
                 `axes` of a [[links]] entry",
                self.name,
                if covered.is_empty() {
                    "none".to_string()
                } else {
                    covered.join("; ")
                }
            ),
        ))
    }

    /// The link with this name.
    pub fn link(&self, name: &str) -> Option<&Link> {
        self.links.iter().find(|l| l.name == name)
    }

    /// Number of nodes `mesh` spans: world size / devices per node, rounded up.
    pub fn nodes(&self, mesh: &Mesh) -> usize {
        mesh.world_size().div_ceil(self.devices_per_node.max(1))
    }
}

/// The slowest link a spec may declare, in bytes/s: below it a collective's modeled time
/// could exceed what a `Duration` holds (and no real link is that slow).
pub const MIN_LINK_BANDWIDTH: f64 = 1.0;
/// The longest per-message latency (or launch overhead) a spec may declare, in seconds.
pub const MAX_LINK_LATENCY: f64 = 3600.0;

fn at_most_an_hour(key: &str, v: f64) -> Result<(), ClusterError> {
    if v <= MAX_LINK_LATENCY {
        Ok(())
    } else {
        Err(ClusterError::at_key(
            key,
            format!("must be at most {MAX_LINK_LATENCY} s (an hour), got {v} s"),
        ))
    }
}

fn positive(key: &str, v: f64) -> Result<(), ClusterError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(ClusterError::at_key(
            key,
            format!("must be a finite number > 0, got {v}"),
        ))
    }
}

fn non_negative(key: &str, v: f64) -> Result<(), ClusterError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(ClusterError::at_key(
            key,
            format!("must be a finite number >= 0, got {v}"),
        ))
    }
}

fn fraction(key: &str, v: f64) -> Result<(), ClusterError> {
    if v.is_finite() && v > 0.0 && v <= 1.0 {
        Ok(())
    } else {
        Err(ClusterError::at_key(
            key,
            format!("must be in (0, 1], got {v}"),
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// Units

/// Splits `"3.35 TB/s"` into `(3.35, "TB/s")`. The number may use `_` separators and an
/// exponent (`67e12`); an `e`/`E` not followed by digits starts the unit (`1EFLOPS`).
fn split_number(s: &str) -> Result<(f64, &str), String> {
    let s = s.trim();
    let b = s.as_bytes();
    let mut i = 0;
    if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
        i += 1;
    }
    while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.' || b[i] == b'_') {
        i += 1;
    }
    if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
        let mut j = i + 1;
        if j < b.len() && (b[j] == b'+' || b[j] == b'-') {
            j += 1;
        }
        if j < b.len() && b[j].is_ascii_digit() {
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
            i = j;
        }
    }
    let num: String = s[..i].chars().filter(|&c| c != '_').collect();
    if num.is_empty() || !num.bytes().any(|c| c.is_ascii_digit()) {
        return Err(format!("`{s}` does not start with a number"));
    }
    let v: f64 = num
        .parse()
        .map_err(|_| format!("`{}` is not a number", &s[..i]))?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("`{s}` must be a finite, non-negative quantity"));
    }
    Ok((v, s[i..].trim()))
}

/// Multiplier of a byte or bit unit: `B`, `KB`.. `PB` (x1000), `KiB`.. `PiB` (x1024), and the
/// bit forms `b`, `Kb`.. `Pb` (x1000 / 8). Prefixes K/k both mean kilo.
fn byte_unit(u: &str) -> Option<f64> {
    let (prefix, rest) = match u.char_indices().nth(1) {
        _ if u == "B" || u == "b" => ("", u),
        Some((i, _)) => u.split_at(i),
        None => return None,
    };
    let (scale, rest) = if let Some(r) = rest.strip_prefix('i') {
        let p = match prefix {
            "K" | "k" => 1024f64,
            "M" => 1024f64.powi(2),
            "G" => 1024f64.powi(3),
            "T" => 1024f64.powi(4),
            "P" => 1024f64.powi(5),
            _ => return None,
        };
        (p, r)
    } else {
        let p = match prefix {
            "" => 1.0,
            "K" | "k" => 1e3,
            "M" => 1e6,
            "G" => 1e9,
            "T" => 1e12,
            "P" => 1e15,
            _ => return None,
        };
        (p, rest)
    };
    match rest {
        "B" => Some(scale),
        "b" => Some(scale / 8.0),
        _ => None,
    }
}

const BYTE_UNITS: &str = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (or bits: b, Kb, Mb, Gb, Tb)";

/// Bytes from a number with a unit: `"80GiB"` = 80 * 2^30, `"64GB"` = 64e9, `"512"` = 512.
/// Fractions round to the nearest byte.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let (v, unit) = split_number(s)?;
    let scale = if unit.is_empty() {
        1.0
    } else {
        byte_unit(unit)
            .ok_or_else(|| format!("`{s}`: unknown size unit `{unit}` (expected {BYTE_UNITS})"))?
    };
    let bytes = (v * scale).round();
    if bytes.is_nan() || bytes < 0.0 {
        return Err(format!("`{s}` is not a size (negative)"));
    }
    if bytes >= u64::MAX as f64 {
        return Err(format!("`{s}` is too large"));
    }
    Ok(bytes as u64)
}

/// Bytes per second: `"450GB/s"` = 450e9, `"400Gb/s"` = 50e9, `"3.35TB/s"`, `"25GBps"`,
/// `"100Gbps"`; a plain number is bytes/s.
pub fn parse_rate(s: &str) -> Result<f64, String> {
    let (v, unit) = split_number(s)?;
    if unit.is_empty() {
        return Ok(v);
    }
    let per = unit
        .strip_suffix("/s")
        .or_else(|| unit.strip_suffix("ps"))
        .map(str::trim_end)
        .ok_or_else(|| {
            format!("`{s}`: a bandwidth needs a unit per second, like GB/s or Gb/s, got `{unit}`")
        })?;
    let scale = byte_unit(per).ok_or_else(|| {
        format!("`{s}`: unknown size unit `{per}` in a bandwidth (expected {BYTE_UNITS}, then /s)")
    })?;
    Ok(v * scale)
}

/// FLOP/s: `"989TFLOPS"`, `"989 TFLOP/s"`, `"19.5TFLOPs"`, `"1.2PFLOPS"`; a plain number is
/// FLOP/s. Prefixes are decimal (K, M, G, T, P, E).
pub fn parse_flops(s: &str) -> Result<f64, String> {
    let (v, unit) = split_number(s)?;
    if unit.is_empty() {
        return Ok(v);
    }
    let lower = unit.to_ascii_lowercase();
    let prefix = ["flops", "flop/s"]
        .iter()
        .find_map(|suf| lower.strip_suffix(suf))
        .ok_or_else(|| format!("`{s}`: expected a FLOP rate like 989TFLOPS, got unit `{unit}`"))?;
    let scale = match prefix.trim_end() {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "g" => 1e9,
        "t" => 1e12,
        "p" => 1e15,
        "e" => 1e18,
        p => {
            return Err(format!(
                "`{s}`: unknown prefix `{p}` (expected K, M, G, T, P or E)"
            ))
        }
    };
    Ok(v * scale)
}

/// Seconds: `"3us"` (also `µs`), `"1.5ms"`, `"200ns"`, `"2s"`; a plain number is seconds.
pub fn parse_duration(s: &str) -> Result<f64, String> {
    let (v, unit) = split_number(s)?;
    let scale = match unit {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" | "μs" => 1e-6,
        "ns" => 1e-9,
        _ => {
            return Err(format!(
                "`{s}`: unknown time unit `{unit}` (expected s, ms, us or ns)"
            ))
        }
    };
    Ok(v * scale)
}

// ---------------------------------------------------------------------------------------------
// serde helpers: a quantity is a number or a string with a unit.

#[derive(Clone, Copy)]
enum Quantity {
    Bytes,
    Rate,
    Flops,
    Duration,
}

impl Quantity {
    fn what(self) -> &'static str {
        match self {
            Quantity::Bytes => "a size (a number of bytes or a string like \"80GiB\")",
            Quantity::Rate => "a bandwidth (bytes/s or a string like \"450GB/s\")",
            Quantity::Flops => "a FLOP rate (FLOP/s or a string like \"989TFLOPS\")",
            Quantity::Duration => "a duration (seconds or a string like \"3us\")",
        }
    }

    fn parse(self, s: &str) -> Result<f64, String> {
        match self {
            Quantity::Bytes => parse_bytes(s).map(|b| b as f64),
            Quantity::Rate => parse_rate(s),
            Quantity::Flops => parse_flops(s),
            Quantity::Duration => parse_duration(s),
        }
    }
}

struct QuantityVisitor(Quantity);

impl Visitor<'_> for QuantityVisitor {
    type Value = f64;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.0.what())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<f64, E> {
        self.0.parse(v).map_err(E::custom)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
        if v < 0 {
            return Err(E::custom(format!("expected {}, got {v}", self.0.what())));
        }
        Ok(v as f64)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
        Ok(v as f64)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
        if !v.is_finite() || v < 0.0 {
            return Err(E::custom(format!("expected {}, got {v}", self.0.what())));
        }
        Ok(v)
    }
}

fn de_quantity<'de, D: Deserializer<'de>>(d: D, q: Quantity) -> Result<f64, D::Error> {
    d.deserialize_any(QuantityVisitor(q))
}

fn de_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let v = de_quantity(d, Quantity::Bytes)?;
    if v >= u64::MAX as f64 {
        return Err(de::Error::custom("the size is too large"));
    }
    Ok(v.round() as u64)
}

fn de_rate<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    de_quantity(d, Quantity::Rate)
}

fn de_flops<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    de_quantity(d, Quantity::Flops)
}

fn de_opt_flops<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    de_quantity(d, Quantity::Flops).map(Some)
}

fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    de_quantity(d, Quantity::Duration)
}

fn de_mesh<'de, D: Deserializer<'de>>(d: D) -> Result<Mesh, D::Error> {
    let s = String::deserialize(d)?;
    Mesh::parse(&s).map_err(de::Error::custom)
}

fn ser_mesh<S: Serializer>(m: &Mesh, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&m.to_string())
}

// ---------------------------------------------------------------------------------------------
// Locating keys in the source, for error messages.

/// 1-based (line, column) of a byte offset.
fn line_col(src: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(src.len());
    let before = src.get(..offset).unwrap_or(src);
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

/// Key paths (`device.memory`, `links[1].bandwidth`) of the `key = value` lines and table
/// headers of a TOML source, with their lines. A line scan that covers the usual layout of a
/// spec (top-level keys, `[table]`, `[[array]]`, dotted keys); keys it does not find are still
/// named in errors, only without a line.
struct KeyIndex {
    entries: Vec<(String, usize)>,
}

impl KeyIndex {
    fn new(src: &str) -> KeyIndex {
        let mut entries = Vec::new();
        let mut prefix = String::new();
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for (i, raw) in src.lines().enumerate() {
            let line_no = i + 1;
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(rest) = line.strip_prefix("[[") {
                if let Some(end) = rest.find("]]") {
                    let name = clean_key(&rest[..end]);
                    let n = counts.entry(name.clone()).or_insert(0);
                    prefix = format!("{name}[{n}]");
                    *n += 1;
                    entries.push((prefix.clone(), line_no));
                }
                continue;
            }
            if let Some(rest) = line.strip_prefix('[') {
                if let Some(end) = rest.find(']') {
                    prefix = clean_key(&rest[..end]);
                    entries.push((prefix.clone(), line_no));
                }
                continue;
            }
            if let Some((key, _)) = line.split_once('=') {
                let key = clean_key(key);
                if key.is_empty() || key.contains(['"', '\'', ' ', '{', ',', '[']) {
                    continue;
                }
                let path = if prefix.is_empty() {
                    key
                } else {
                    format!("{prefix}.{key}")
                };
                entries.push((path, line_no));
            }
        }
        KeyIndex { entries }
    }

    /// The line of a key path, or of its nearest enclosing key that has one.
    fn line_of(&self, path: &str) -> Option<usize> {
        let mut p = path;
        loop {
            if let Some((_, l)) = self.entries.iter().find(|(k, _)| k == p) {
                return Some(*l);
            }
            let cut = p.rfind(['.', '['])?;
            p = &p[..cut];
        }
    }

    /// The key path written on a line.
    fn key_at(&self, line: usize) -> Option<String> {
        self.entries
            .iter()
            .find(|(_, l)| *l == line)
            .map(|(k, _)| k.clone())
    }
}

/// `"a" . b ` -> `a.b`.
fn clean_key(k: &str) -> String {
    k.split('.')
        .map(|p| p.trim().trim_matches('"').trim_matches('\''))
        .collect::<Vec<_>>()
        .join(".")
}

/// The innermost axes that stay inside one node: the longest suffix of the mesh whose size
/// is at most the cluster's devices per node and whose axes all use intra-node link classes
/// (those of the node-local axes of the cluster's own mesh, e.g. `nvlink` for
/// `node=128,gpu=8`). So `node=2,gpu=4` on 8-GPU nodes is two nodes (its `node` axis is on the
/// inter-node link), and a split `gpu=2x4` stays inside a node.
pub fn node_local_group(mesh: &Mesh, cluster: &ClusterSpec) -> Group {
    let intra = intra_node_links(cluster);
    let mut size = 1usize;
    let mut start = mesh.axes.len();
    for (i, a) in mesh.axes.iter().enumerate().rev() {
        let local_link = cluster
            .link_for_axis(&a.name)
            .is_ok_and(|l| intra.contains(&l.name));
        match size.checked_mul(a.size) {
            Some(s) if s <= cluster.devices_per_node.max(1) && local_link => {
                size = s;
                start = i;
            }
            _ => break,
        }
    }
    Group::new(mesh.axes[start..].iter().map(|a| a.name.clone()))
}

/// Link classes of the innermost axes of the cluster's own mesh that fit in one node.
fn intra_node_links(cluster: &ClusterSpec) -> Vec<String> {
    let mut size = 1usize;
    let mut out: Vec<String> = Vec::new();
    for a in cluster.mesh.axes.iter().rev() {
        match size.checked_mul(a.size) {
            Some(s) if s <= cluster.devices_per_node.max(1) => size = s,
            _ => break,
        }
        if let Ok(l) = cluster.link_for_axis(&a.name) {
            if !out.contains(&l.name) {
                out.push(l.name.clone());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_numbers_and_units() {
        assert_eq!(split_number("3.35TB/s").unwrap(), (3.35, "TB/s"));
        assert_eq!(split_number("67e12").unwrap(), (67e12, ""));
        assert_eq!(split_number("1EFLOPS").unwrap(), (1.0, "EFLOPS"));
        assert_eq!(split_number("1_000 B").unwrap(), (1000.0, "B"));
        assert!(split_number("GB").is_err());
        assert!(split_number("-3GB").is_err());
        assert!(split_number(".").is_err());
    }

    #[test]
    fn links_whose_collective_times_are_no_duration_are_refused() {
        let base = include_str!("../../../examples/clusters/h100-dgx.toml");
        let with = |from: &str, to: &str| {
            assert!(base.contains(from), "{from}");
            ClusterSpec::from_toml_str(&base.replacen(from, to, 1), "x.toml")
        };
        for (from, to, want) in [
            (
                "bandwidth = \"450GB/s\"",
                "bandwidth = 1e-300",
                "links[0].bandwidth",
            ),
            (
                "bandwidth = \"400Gb/s\"",
                "bandwidth = 0.5",
                "links[1].bandwidth",
            ),
            ("latency = \"3us\"", "latency = 1e300", "links[0].latency"),
            ("latency = \"10us\"", "latency = 3601", "links[1].latency"),
        ] {
            let e = with(from, to).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("x.toml"), "{to}: {e}");
        }
        // the limits themselves are accepted
        with("bandwidth = \"450GB/s\"", "bandwidth = 1").unwrap();
        with("latency = \"3us\"", "latency = 3600").unwrap();
    }

    #[test]
    fn key_index_finds_tables_and_arrays() {
        let src = "name = \"x\"\n\n[device]\nmemory = 1\n[[links]]\nname = \"a\"\n[[links]]\n\"bandwidth\" = 2\n";
        let idx = KeyIndex::new(src);
        assert_eq!(idx.line_of("name"), Some(1));
        assert_eq!(idx.line_of("device.memory"), Some(4));
        assert_eq!(idx.line_of("links[1].bandwidth"), Some(8));
        assert_eq!(idx.line_of("links[1].latency"), Some(7));
        assert_eq!(idx.key_at(6).as_deref(), Some("links[0].name"));
        assert_eq!(line_col("ab\ncd", 4), (2, 2));
    }
}
