//! Model presets: GPT, Llama and Mixtral-style MoE forward programs built from a config,
//! shapes only (parameters carry no data), for planning at scales no file could hold.
//!
//! A spec is `preset:NAME[,key=value...]`: a named model (`preset:gpt3-175b`, see
//! [`preset_names`]) or a family (`preset:gpt`, `preset:llama`, `preset:moe`) with settings,
//! e.g. `preset:gpt,layers=4,hidden=512,heads=8,vocab=8192,seq=256,batch=4`. Settings also
//! override a named model: `preset:llama3-70b,seq=4096`.
//!
//! Settings: `layers`, `hidden`, `heads`, `kv_heads` (Llama/MoE), `ffn` (MLP inner size; per
//! expert for MoE), `vocab`, `seq`, `batch` (the micro-batch; alias `micro_batch`),
//! `positions` (GPT's learned position table; grows to `seq` when that is longer), `experts`,
//! `top_k`, `capacity_factor` (a positive number, or `none`: dropless, the default),
//! `dense` (`true`: every expert on every token) and `norm_topk` (`false`: the top-k
//! probabilities are the weights, not renormalized to sum 1) (MoE), `tied` (LM head shares the
//! embedding), `eps` (norm epsilon), `rope_theta` (Llama/MoE).
//! A family spec starts from the family's reference model (`gpt`: gpt2-small, `llama`:
//! llama3-8b, `moe`: mixtral-8x7b) and, unless given, derives `kv_heads = heads`, and
//! `ffn = 4 * hidden` (GPT) or 8/3 * hidden rounded up to a multiple of 256 (Llama/MoE, as
//! Llama does). A named model keeps its own values for settings not given.
//!
//! The programs are the models' real forward graphs, written with the IR op set, with the
//! Hugging Face parameter names and layouts (so layer grouping by name works and tiny
//! presets load the weights of the matching PyTorch models):
//!
//! - input `input_ids: i64[batch, seq]`, output `logits: f32[batch, seq, vocab]`;
//! - causal attention as one `Attention` op per layer (`causal`, scale 1/sqrt(head_dim),
//!   grouped-query K/V read directly); written out with `parse_preset_with(spec, false)`
//!   (`--no-fuse-attention`): a mask built by ops (`Fill` then `Trilu`), never a constant,
//!   masked scores set to -1e9 by `Where` before `Softmax`, K/V heads repeated;
//! - GPT (GPT-2/GPT-3): learned positions (a `Slice` of `transformer.wpe.weight`),
//!   LayerNorm with bias, fused `c_attn` ([hidden, 3*hidden], Conv1D layout), tanh GELU,
//!   biases everywhere, LM head tied to `transformer.wte.weight` through a `Transpose`;
//! - Llama: RmsNorm, RoPE with cos/sin tables computed by ops from positions (`CumSum` of
//!   ones) and a `[head_dim/2]` inverse-frequency constant (so no seq-sized constants),
//!   grouped-query attention (K and V repeated by `Reshape`/`Expand`/`Reshape`), SwiGLU MLP,
//!   `nn.Linear` weights `[out, in]` used through `Transpose`, untied `lm_head.weight`;
//! - MoE (Mixtral): Llama attention; the MLP is a router (`mlp.gate.weight`, softmax over
//!   experts, `TopK`, top-k weights renormalized to sum 1 unless `norm_topk=false`) and
//!   experts stored batched as in transformers 5 (`mlp.experts.gate_up_proj: [experts, 2*ffn, hidden]`,
//!   `mlp.experts.down_proj: [experts, hidden, ffn]`). By default the block is routed
//!   (docs/moe.md): `MoeDispatch` copies each token to the buffers of its top-k experts
//!   (`[experts, capacity, hidden]`), the experts' SwiGLU runs as batched `MatMul`s over
//!   those buffers, and `MoeCombine` sums each token's expert outputs times its routing
//!   weights. The capacity is dropless unless `capacity_factor=F` is given: each expert
//!   then holds `ceil(F * tokens * top_k / experts)` tokens (at most `tokens`), and the
//!   choices past it are dropped by routing priority (GShard's rule: every token's first
//!   choice before any second choice, token order within a choice) and contribute zero;
//!   `capacity_factor=none` is dropless. `dense=true` builds the dense form instead: every
//!   expert on every token, combined with a `[tokens, experts]` gate made by
//!   `ScatterElements` of the top-k weights into zeros; it equals the dropless routed form,
//!   at `experts / top_k` times the expert compute of capacity factor 1.
//!
//! Everything is f32 (the forward program; precision is a later pass's business).

use hzp_ir::{
    BinaryOp, DType, NameSet, Op, Program, ReduceOp, Tensor, TensorType, UnaryOp, ValueId,
};
use std::fmt;

/// The most layers a preset may have (the largest published models have about 200; a
/// program of many thousands of layers only exhausts memory).
pub const MAX_LAYERS: usize = 4096;

/// A preset spec that cannot be built; `spec` is the user's text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, miette::Diagnostic)]
pub struct PresetError {
    pub spec: String,
    pub message: String,
}

impl fmt::Display for PresetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "preset `{}`: {}", self.spec, self.message)
    }
}

/// A model family: the shape of the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// GPT-2 / GPT-3: LayerNorm, learned positions, GELU MLP, biases.
    Gpt,
    /// Llama: RmsNorm, RoPE, grouped-query attention, SwiGLU MLP.
    Llama,
    /// Mixtral: Llama attention with a top-k routed mixture of SwiGLU experts.
    Moe,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Gpt => "gpt",
            Family::Llama => "llama",
            Family::Moe => "moe",
        }
    }
}

/// Everything a preset program is built from.
#[derive(Clone, Debug, PartialEq)]
pub struct PresetConfig {
    /// The program's name.
    pub name: String,
    pub family: Family,
    pub layers: usize,
    pub hidden: usize,
    /// Query heads; `hidden` must divide into them.
    pub heads: usize,
    /// Key/value heads (grouped-query attention); must divide `heads`. Equal to `heads` for GPT.
    pub kv_heads: usize,
    /// MLP inner size (per expert for MoE).
    pub ffn: usize,
    pub vocab: usize,
    /// Sequence length of the program's input.
    pub seq: usize,
    /// Micro-batch size of the program's input.
    pub batch: usize,
    /// GPT: rows of the learned position table (>= `seq`). Unused by Llama/MoE.
    pub max_positions: usize,
    /// MoE: number of experts (0 for dense families).
    pub experts: usize,
    /// MoE: experts per token (0 for dense families).
    pub top_k: usize,
    /// MoE: each expert's capacity as a multiple of its even share `tokens * top_k /
    /// experts` (rounded up, at most `tokens`); `None` is dropless (capacity = tokens).
    pub capacity_factor: Option<f64>,
    /// MoE: the dense form (every expert on every token, weighted by a mostly-zero gate)
    /// instead of routed dispatch and combine.
    pub dense_moe: bool,
    /// MoE: whether the top-k routing weights are renormalized to sum 1 (Mixtral; Qwen3-MoE's
    /// `norm_topk_prob`), or are the softmax probabilities as they are.
    pub norm_topk: bool,
    /// Whether the LM head reuses the token embedding.
    pub tied_embeddings: bool,
    /// LayerNorm / RmsNorm epsilon.
    pub norm_eps: f32,
    /// RoPE base (Llama/MoE).
    pub rope_theta: f64,
}

#[allow(clippy::too_many_arguments)]
fn gpt(
    name: &str,
    layers: usize,
    hidden: usize,
    heads: usize,
    vocab: usize,
    positions: usize,
    seq: usize,
    batch: usize,
) -> PresetConfig {
    PresetConfig {
        name: name.into(),
        family: Family::Gpt,
        layers,
        hidden,
        heads,
        kv_heads: heads,
        ffn: 4 * hidden,
        vocab,
        seq,
        batch,
        max_positions: positions,
        experts: 0,
        top_k: 0,
        capacity_factor: None,
        dense_moe: false,
        norm_topk: true,
        tied_embeddings: true,
        norm_eps: 1e-5,
        rope_theta: 0.0,
    }
}

#[allow(clippy::too_many_arguments)]
fn llama(
    name: &str,
    layers: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    ffn: usize,
    vocab: usize,
    seq: usize,
    rope_theta: f64,
) -> PresetConfig {
    PresetConfig {
        name: name.into(),
        family: Family::Llama,
        layers,
        hidden,
        heads,
        kv_heads,
        ffn,
        vocab,
        seq,
        batch: 1,
        max_positions: seq,
        experts: 0,
        top_k: 0,
        capacity_factor: None,
        dense_moe: false,
        norm_topk: true,
        tied_embeddings: false,
        norm_eps: 1e-5,
        rope_theta,
    }
}

fn moe(base: PresetConfig, experts: usize, top_k: usize) -> PresetConfig {
    PresetConfig {
        family: Family::Moe,
        experts,
        top_k,
        ..base
    }
}

/// The named presets, in the order help text lists them.
const NAMES: &[&str] = &[
    "gpt-tiny",
    "gpt2-small",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "gpt3-1.3b",
    "gpt3-6.7b",
    "gpt3-13b",
    "gpt3-175b",
    "llama-tiny",
    "llama2-7b",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "moe-tiny",
    "mixtral-8x7b",
    "mixtral-8x22b",
];

/// Names accepted after `preset:`: the named models, then the families.
pub fn preset_names() -> Vec<&'static str> {
    let mut v = NAMES.to_vec();
    v.extend(["gpt", "llama", "moe"]);
    v
}

/// The config of a named model (or a family's reference model), if `name` is one.
pub fn named_config(name: &str) -> Option<PresetConfig> {
    let c = match name {
        // The tiny ones match tests/models (2 layers, hidden 64, 4 heads, vocab 256).
        "gpt-tiny" => PresetConfig {
            ffn: 128,
            ..gpt(name, 2, 64, 4, 256, 64, 16, 2)
        },
        "gpt2-small" => gpt(name, 12, 768, 12, 50257, 1024, 1024, 1),
        "gpt2-medium" => gpt(name, 24, 1024, 16, 50257, 1024, 1024, 1),
        "gpt2-large" => gpt(name, 36, 1280, 20, 50257, 1024, 1024, 1),
        "gpt2-xl" => gpt(name, 48, 1600, 25, 50257, 1024, 1024, 1),
        "gpt3-1.3b" => gpt(name, 24, 2048, 16, 50257, 2048, 2048, 1),
        "gpt3-6.7b" => gpt(name, 32, 4096, 32, 50257, 2048, 2048, 1),
        "gpt3-13b" => gpt(name, 40, 5120, 40, 50257, 2048, 2048, 1),
        "gpt3-175b" => gpt(name, 96, 12288, 96, 50257, 2048, 2048, 1),
        "llama-tiny" => PresetConfig {
            batch: 2,
            norm_eps: 1e-6,
            ..llama(name, 2, 64, 4, 2, 128, 256, 16, 10000.0)
        },
        "llama2-7b" => llama(name, 32, 4096, 32, 32, 11008, 32000, 4096, 10000.0),
        "llama3-8b" => llama(name, 32, 4096, 32, 8, 14336, 128256, 8192, 500000.0),
        "llama3-70b" => llama(name, 80, 8192, 64, 8, 28672, 128256, 8192, 500000.0),
        "llama3-405b" => llama(name, 126, 16384, 128, 8, 53248, 128256, 8192, 500000.0),
        "moe-tiny" => moe(
            PresetConfig {
                batch: 2,
                ..llama(name, 2, 64, 4, 2, 64, 256, 16, 1e6)
            },
            4,
            2,
        ),
        "mixtral-8x7b" => moe(llama(name, 32, 4096, 32, 8, 14336, 32000, 4096, 1e6), 8, 2),
        "mixtral-8x22b" => moe(llama(name, 56, 6144, 48, 8, 16384, 32768, 4096, 1e6), 8, 2),
        _ => return None,
    };
    Some(c)
}

fn family_base(name: &str) -> Option<PresetConfig> {
    let (base, family) = match name {
        "gpt" => ("gpt2-small", Family::Gpt),
        "llama" => ("llama3-8b", Family::Llama),
        "moe" | "mixtral" => ("mixtral-8x7b", Family::Moe),
        _ => return None,
    };
    let mut c = named_config(base)?;
    c.family = family;
    Some(c)
}

const KEYS: &[&str] = &[
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "ffn",
    "vocab",
    "seq",
    "batch",
    "positions",
    "experts",
    "top_k",
    "capacity_factor",
    "dense",
    "norm_topk",
    "tied",
    "eps",
    "rope_theta",
];

/// Parses `preset:NAME[,key=value...]` (the `preset:` prefix is optional) into a config.
pub fn parse_config(spec: &str) -> Result<PresetConfig, PresetError> {
    let err = |message: String| PresetError {
        spec: spec.to_string(),
        message,
    };
    let body = spec.trim();
    let body = body.strip_prefix("preset:").unwrap_or(body);
    let mut parts = body.split(',').map(str::trim);
    let name = parts.next().unwrap_or("").to_ascii_lowercase();
    let (mut c, is_family) = match (named_config(&name), family_base(&name)) {
        (Some(c), _) => (c, false),
        (None, Some(c)) => (c, true),
        (None, None) => {
            return Err(err(format!(
            "{} (known: {}; a family takes settings, e.g. preset:gpt,layers=4,hidden=512,heads=8)",
            if name.is_empty() {
                "no preset name given".to_string()
            } else {
                format!("unknown preset `{name}`")
            },
            preset_names().join(", ")
        )))
        }
    };
    let mut given: Vec<&'static str> = Vec::new();
    for part in parts {
        if part.is_empty() {
            continue;
        }
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| err(format!("`{part}` is not a key=value setting")))?;
        let (k, v) = (k.trim().to_ascii_lowercase().replace('-', "_"), v.trim());
        let k = if k == "micro_batch" {
            "batch".to_string()
        } else {
            k
        };
        let key = *KEYS.iter().find(|&&x| x == k).ok_or_else(|| {
            err(format!(
                "unknown setting `{k}` (settings: {})",
                KEYS.join(", ")
            ))
        })?;
        if given.contains(&key) {
            return Err(err(format!("`{key}` is given twice")));
        }
        given.push(key);
        let int = || -> Result<usize, PresetError> {
            v.replace('_', "")
                .parse::<usize>()
                .map_err(|_| err(format!("`{key}={v}`: expected a whole number")))
        };
        let float = || -> Result<f64, PresetError> {
            v.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| err(format!("`{key}={v}`: expected a positive number")))
        };
        let boolean = || -> Result<bool, PresetError> {
            match v.to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" => Ok(true),
                "false" | "0" | "no" => Ok(false),
                _ => Err(err(format!("`{key}={v}`: expected true or false"))),
            }
        };
        let only = |fams: &[Family], what: &str| -> Result<(), PresetError> {
            if fams.contains(&c.family) {
                Ok(())
            } else {
                Err(err(format!(
                    "`{key}` applies to {what} presets only, and this one is {}",
                    c.family.name()
                )))
            }
        };
        match key {
            "layers" => {
                c.layers = int()?;
                if c.layers > MAX_LAYERS {
                    return Err(err(format!(
                        "`layers={v}` is more than the limit of {MAX_LAYERS} layers"
                    )));
                }
            }
            "hidden" => c.hidden = int()?,
            "heads" => c.heads = int()?,
            "kv_heads" => {
                only(&[Family::Llama, Family::Moe], "llama and moe")?;
                c.kv_heads = int()?
            }
            "ffn" => c.ffn = int()?,
            "vocab" => c.vocab = int()?,
            "seq" => c.seq = int()?,
            "batch" => c.batch = int()?,
            "positions" => {
                only(&[Family::Gpt], "gpt")?;
                c.max_positions = int()?
            }
            "experts" => {
                only(&[Family::Moe], "moe")?;
                c.experts = int()?
            }
            "top_k" => {
                only(&[Family::Moe], "moe")?;
                c.top_k = int()?
            }
            "capacity_factor" => {
                only(&[Family::Moe], "moe")?;
                c.capacity_factor = if v.eq_ignore_ascii_case("none") {
                    None
                } else {
                    Some(float().map_err(|_| {
                        err(format!(
                            "`{key}={v}`: expected a positive number, or none (dropless)"
                        ))
                    })?)
                }
            }
            "dense" => {
                only(&[Family::Moe], "moe")?;
                c.dense_moe = boolean()?
            }
            "norm_topk" => {
                only(&[Family::Moe], "moe")?;
                c.norm_topk = boolean()?
            }
            "tied" => c.tied_embeddings = boolean()?,
            "eps" => c.norm_eps = float()? as f32,
            "rope_theta" => {
                only(&[Family::Llama, Family::Moe], "llama and moe")?;
                c.rope_theta = float()?
            }
            _ => unreachable!("every key in KEYS is handled"),
        }
    }
    if is_family {
        if !given.contains(&"kv_heads") {
            c.kv_heads = c.heads;
        }
        if !given.contains(&"ffn") {
            c.ffn = match c.family {
                Family::Gpt => c.hidden.saturating_mul(4),
                Family::Llama | Family::Moe => (c.hidden.saturating_mul(8) / 3).div_ceil(256) * 256,
            };
        }
    }
    if c.family == Family::Gpt {
        c.kv_heads = c.heads;
        if !given.contains(&"positions") && (is_family || c.seq > c.max_positions) {
            c.max_positions = c.seq;
        }
    } else {
        c.max_positions = c.seq;
    }
    c.name = std::iter::once(name.as_str())
        .chain(
            body.split(',')
                .skip(1)
                .map(str::trim)
                .filter(|s| !s.is_empty()),
        )
        .collect::<Vec<_>>()
        .join(",");
    c.validate().map_err(err)?;
    Ok(c)
}

/// Parses a preset spec and builds its program (attention as one fused op per layer).
pub fn parse_preset(spec: &str) -> Result<Program, PresetError> {
    parse_preset_with(spec, true)
}

/// [`parse_preset`], with attention fused (one `Attention` op per layer) or written out
/// (`fuse_attention = false`: scores, causal mask, softmax and products, as before fusion).
pub fn parse_preset_with(spec: &str, fuse_attention: bool) -> Result<Program, PresetError> {
    let c = parse_config(spec)?;
    c.build_with(fuse_attention).map_err(|e| PresetError {
        spec: spec.to_string(),
        message: e.message,
    })
}

/// Tensors larger than this many elements are refused (far beyond any real model, but it
/// keeps every shape product in range).
const MAX_ELEMENTS: u128 = 1 << 50;

impl PresetConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads.max(1)
    }

    /// Checks that the numbers fit together; the message names the settings.
    pub fn validate(&self) -> Result<(), String> {
        let c = self;
        for (k, v) in [
            ("layers", c.layers),
            ("hidden", c.hidden),
            ("heads", c.heads),
            ("kv_heads", c.kv_heads),
            ("ffn", c.ffn),
            ("vocab", c.vocab),
            ("seq", c.seq),
            ("batch", c.batch),
        ] {
            if v == 0 {
                return Err(format!("`{k}` must be at least 1"));
            }
        }
        if !c.hidden.is_multiple_of(c.heads) {
            return Err(format!(
                "hidden={} is not divisible by heads={}",
                c.hidden, c.heads
            ));
        }
        if !c.heads.is_multiple_of(c.kv_heads) {
            return Err(format!(
                "heads={} is not divisible by kv_heads={}",
                c.heads, c.kv_heads
            ));
        }
        match c.family {
            Family::Gpt => {
                if c.kv_heads != c.heads {
                    return Err("gpt presets have kv_heads = heads".into());
                }
                if c.seq > c.max_positions {
                    return Err(format!(
                        "seq={} exceeds the position table (positions={})",
                        c.seq, c.max_positions
                    ));
                }
            }
            Family::Llama | Family::Moe => {
                if !c.head_dim().is_multiple_of(2) {
                    return Err(format!(
                        "RoPE needs an even head size, and hidden/heads = {}",
                        c.head_dim()
                    ));
                }
                if !(c.rope_theta.is_finite() && c.rope_theta > 0.0) {
                    return Err("`rope_theta` must be a positive number".into());
                }
            }
        }
        if !(c.norm_eps.is_finite() && c.norm_eps > 0.0) {
            return Err("`eps` must be a positive number".into());
        }
        if c.family == Family::Moe {
            if c.experts == 0 || c.top_k == 0 {
                return Err("moe presets need experts >= 1 and top_k >= 1".into());
            }
            if c.top_k > c.experts {
                return Err(format!("top_k={} exceeds experts={}", c.top_k, c.experts));
            }
            if c.dense_moe && c.capacity_factor.is_some() {
                return Err(
                    "capacity_factor applies to the routed form, and dense=true computes every expert on every token"
                        .into(),
                );
            }
        } else if c.experts != 0 || c.top_k != 0 {
            return Err("experts and top_k apply to moe presets only".into());
        }
        // The largest tensors of the program, so no shape product can overflow.
        let (b, s, h, f, v) = (c.batch, c.seq, c.hidden, c.ffn, c.vocab);
        let e = c.experts.max(1);
        let biggest = [
            (
                "attention scores (batch*heads*seq*seq)",
                vec![b, c.heads, s, s],
            ),
            ("logits (batch*seq*vocab)", vec![b, s, v]),
            ("the embedding (vocab*hidden)", vec![v, h]),
            ("an attention weight (hidden*hidden)", vec![h, h]),
            ("an MLP weight (experts*2*ffn*hidden)", vec![e, 2, f, h]),
            (
                "MLP activations (experts*batch*seq*2*ffn)",
                vec![e, b, s, 2, f],
            ),
            ("activations (batch*seq*3*hidden)", vec![b, s, 3, h]),
            (
                "the position table (positions*hidden)",
                vec![c.max_positions, h],
            ),
        ];
        for (what, dims) in biggest {
            let n = dims
                .iter()
                .try_fold(1u128, |acc, &d| acc.checked_mul(d as u128))
                .filter(|&n| n <= MAX_ELEMENTS);
            if n.is_none() {
                return Err(format!(
                    "{what} would have more elements than hzp handles ({MAX_ELEMENTS})"
                ));
            }
        }
        if c.layers > 1 << 20 {
            return Err(format!("layers={} is more than hzp handles", c.layers));
        }
        if self.num_parameters_wide() > MAX_ELEMENTS {
            return Err(format!(
                "{} parameters are more than hzp handles ({MAX_ELEMENTS})",
                self.num_parameters_wide()
            ));
        }
        Ok(())
    }

    /// Builds the forward program (parameters without data), attention fused.
    pub fn build(&self) -> Result<Program, PresetError> {
        self.build_with(true)
    }

    /// [`Self::build`], attention fused or written out.
    pub fn build_with(&self, fuse_attention: bool) -> Result<Program, PresetError> {
        let err = |message: String| PresetError {
            spec: format!("preset:{}", self.name),
            message,
        };
        self.validate().map_err(err)?;
        let mut g = Graph {
            p: Program::new(self.name.clone()),
            names: NameSet::default(),
            fuse_attention,
        };
        build_model(&mut g, self)
            .map_err(|m| err(format!("internal error while building: {m}")))?;
        if fuse_attention {
            // the causal mask and score constants only the written-out form reads
            g.p.eliminate_dead_code();
        }
        Ok(g.p)
    }

    /// MoE: the tokens each expert's buffer holds (see [`Self::capacity_factor`]).
    pub fn moe_capacity(&self) -> usize {
        let tokens = self.batch * self.seq;
        match self.capacity_factor {
            None => tokens,
            Some(f) => {
                let share = tokens as f64 * self.top_k as f64 / self.experts.max(1) as f64;
                ((f * share).ceil() as usize).clamp(1, tokens.max(1))
            }
        }
    }

    /// Trainable parameter count, from the config alone (saturates; [`Self::validate`]
    /// bounds it for valid configs).
    pub fn num_parameters(&self) -> u64 {
        u64::try_from(self.num_parameters_wide()).unwrap_or(u64::MAX)
    }

    fn num_parameters_wide(&self) -> u128 {
        let (h, f, v) = (self.hidden as u128, self.ffn as u128, self.vocab as u128);
        let kvd = (self.kv_heads as u128) * (self.head_dim() as u128);
        let head = if self.tied_embeddings { 0 } else { v * h };
        match self.family {
            Family::Gpt => {
                let layer = 4 * h * h + 2 * h * f + 9 * h + f;
                v * h + self.max_positions as u128 * h + self.layers as u128 * layer + 2 * h + head
            }
            Family::Llama | Family::Moe => {
                let attn = 2 * h * h + 2 * h * kvd + 2 * h;
                let mlp = if self.family == Family::Moe {
                    let e = self.experts as u128;
                    e * h + e * 3 * h * f
                } else {
                    3 * h * f
                };
                v * h + self.layers as u128 * (attn + mlp) + h + head
            }
        }
    }
}

/// A program under construction: unique names, one-output nodes named after their output.
struct Graph {
    p: Program,
    names: NameSet,
    /// One `Attention` op per layer instead of the written-out form.
    fuse_attention: bool,
}

type R<T> = Result<T, String>;

impl Graph {
    fn param(&mut self, name: &str, shape: &[usize]) -> ValueId {
        let n = self.names.fresh(name);
        self.p
            .add_param(n, TensorType::new(DType::F32, shape.to_vec()), None)
    }

    fn constant(&mut self, name: &str, t: Tensor) -> ValueId {
        let n = self.names.fresh(name);
        self.p.add_const(n, t)
    }

    fn nodes(&mut self, name: &str, op: Op, ins: &[ValueId], outs: usize) -> R<Vec<ValueId>> {
        let node = self.names.fresh(name);
        let out_names = if outs == 1 {
            vec![node.clone()]
        } else {
            (0..outs)
                .map(|i| self.names.fresh(&format!("{node}.{i}")))
                .collect()
        };
        self.p.add_node(node, op, ins.to_vec(), out_names)
    }

    fn node(&mut self, name: &str, op: Op, ins: &[ValueId]) -> R<ValueId> {
        Ok(self.nodes(name, op, ins, 1)?[0])
    }

    fn bin(&mut self, name: &str, op: BinaryOp, a: ValueId, b: ValueId) -> R<ValueId> {
        self.node(name, Op::Binary(op), &[a, b])
    }

    fn unary(&mut self, name: &str, op: UnaryOp, a: ValueId) -> R<ValueId> {
        self.node(name, Op::Unary(op), &[a])
    }

    fn reshape(&mut self, name: &str, x: ValueId, shape: &[usize]) -> R<ValueId> {
        self.node(
            name,
            Op::Reshape {
                shape: shape.to_vec(),
            },
            &[x],
        )
    }

    fn transpose(&mut self, name: &str, x: ValueId, perm: &[usize]) -> R<ValueId> {
        self.node(
            name,
            Op::Transpose {
                perm: perm.to_vec(),
            },
            &[x],
        )
    }

    /// `x @ w^T` for an `nn.Linear` weight `w: [out, in]`.
    fn linear(&mut self, name: &str, x: ValueId, w: ValueId) -> R<ValueId> {
        let wt = self.transpose(&format!("{name}.weight_t"), w, &[1, 0])?;
        self.node(name, Op::MatMul, &[x, wt])
    }
}

/// Values every layer shares.
struct Shared {
    /// bool[seq, seq], true on and below the diagonal.
    mask: ValueId,
    /// f32[] 1/sqrt(head_dim).
    scale: ValueId,
    /// f32[] the score of masked positions.
    masked: ValueId,
    /// f32[seq, head_dim/2] RoPE tables (Llama/MoE).
    rope: Option<(ValueId, ValueId)>,
}

fn build_model(g: &mut Graph, c: &PresetConfig) -> R<()> {
    let (b, s, h, v) = (c.batch, c.seq, c.hidden, c.vocab);
    let ids =
        g.p.add_input("input_ids", TensorType::new(DType::I64, vec![b, s]));
    g.names.insert("input_ids");

    let shared = shared_values(g, c)?;
    let (prefix, embed_name) = match c.family {
        Family::Gpt => ("transformer.h", "transformer.wte"),
        Family::Llama | Family::Moe => ("model.layers", "model.embed_tokens"),
    };
    let wte = g.param(&format!("{embed_name}.weight"), &[v, h]);
    let mut x = g.node(embed_name, Op::Gather { axis: 0 }, &[wte, ids])?;
    if c.family == Family::Gpt {
        let wpe = g.param("transformer.wpe.weight", &[c.max_positions, h]);
        let pos = g.node(
            "transformer.wpe",
            Op::Slice {
                axes: vec![0],
                starts: vec![0],
                ends: vec![s as i64],
                steps: vec![1],
            },
            &[wpe],
        )?;
        x = g.bin("transformer.embed", BinaryOp::Add, x, pos)?;
    }
    for i in 0..c.layers {
        let pre = format!("{prefix}.{i}");
        x = match c.family {
            Family::Gpt => gpt_block(g, c, &shared, &pre, x)?,
            Family::Llama | Family::Moe => llama_block(g, c, &shared, &pre, x)?,
        };
    }
    let x = match c.family {
        Family::Gpt => {
            let w = g.param("transformer.ln_f.weight", &[h]);
            let bias = g.param("transformer.ln_f.bias", &[h]);
            g.node(
                "transformer.ln_f",
                Op::LayerNorm {
                    axis: 2,
                    epsilon: c.norm_eps,
                },
                &[x, w, bias],
            )?
        }
        Family::Llama | Family::Moe => {
            let w = g.param("model.norm.weight", &[h]);
            g.node(
                "model.norm",
                Op::RmsNorm {
                    axis: 2,
                    epsilon: c.norm_eps,
                },
                &[x, w],
            )?
        }
    };
    let head_w = if c.tied_embeddings {
        wte
    } else {
        g.param("lm_head.weight", &[v, h])
    };
    let head_t = g.transpose("lm_head.weight_t", head_w, &[1, 0])?;
    let logits = g.node("logits", Op::MatMul, &[x, head_t])?;
    g.p.outputs.push(logits);
    Ok(())
}

fn shared_values(g: &mut Graph, c: &PresetConfig) -> R<Shared> {
    let s = c.seq;
    let ones = g.node(
        "causal_mask.ones",
        Op::Fill {
            value: 1.0,
            dtype: DType::Bool,
            shape: vec![s, s],
        },
        &[],
    )?;
    let mask = g.node("causal_mask", Op::Trilu { upper: false, k: 0 }, &[ones])?;
    let hd = c.head_dim();
    let scale = g.constant(
        "attn.scale",
        Tensor::scalar_f32((1.0 / (hd as f64).sqrt()) as f32),
    );
    let masked = g.constant("attn.masked_score", Tensor::scalar_f32(-1e9));
    let rope = match c.family {
        Family::Gpt => None,
        Family::Llama | Family::Moe => {
            let half = hd / 2;
            let inv: Vec<f32> = (0..half)
                .map(|i| (1.0 / c.rope_theta.powf((2 * i) as f64 / hd as f64)) as f32)
                .collect();
            let inv = g.constant("rope.inv_freq", Tensor::f32(vec![half], inv));
            let ones = g.node(
                "rope.ones",
                Op::Fill {
                    value: 1.0,
                    dtype: DType::F32,
                    shape: vec![s],
                },
                &[],
            )?;
            let pos = g.node(
                "rope.positions",
                Op::CumSum {
                    axis: 0,
                    exclusive: true,
                    reverse: false,
                },
                &[ones],
            )?;
            let pos = g.reshape("rope.positions_col", pos, &[s, 1])?;
            let freqs = g.bin("rope.freqs", BinaryOp::Mul, pos, inv)?;
            let cos = g.unary("rope.cos", UnaryOp::Cos, freqs)?;
            let sin = g.unary("rope.sin", UnaryOp::Sin, freqs)?;
            Some((cos, sin))
        }
    };
    Ok(Shared {
        mask,
        scale,
        masked,
        rope,
    })
}

/// Causal attention of `q: [B,nh,S,hd]`, `k: [B,kv,S,hd]`, `v: [B,kv,S,hd]` -> `[B,S,H]`:
/// one `Attention` op, or written out (key/value heads repeated, keys transposed).
fn attention(
    g: &mut Graph,
    c: &PresetConfig,
    sh: &Shared,
    pre: &str,
    q: ValueId,
    k: ValueId,
    v: ValueId,
) -> R<ValueId> {
    let ctx = if g.fuse_attention {
        let scale = 1.0 / (c.head_dim() as f64).sqrt();
        g.nodes(
            &format!("{pre}.attention"),
            Op::Attention {
                scale,
                causal: true,
            },
            &[q, k, v],
            2,
        )?[0]
    } else {
        explicit_attention(g, c, sh, pre, q, k, v)?
    };
    let ctx = g.transpose(&format!("{pre}.context_t"), ctx, &[0, 2, 1, 3])?;
    g.reshape(
        &format!("{pre}.context_merged"),
        ctx,
        &[c.batch, c.seq, c.hidden],
    )
}

/// The written-out attention `softmax(mask(q kᵀ * scale)) v`, [B,nh,S,hd].
fn explicit_attention(
    g: &mut Graph,
    c: &PresetConfig,
    sh: &Shared,
    pre: &str,
    q: ValueId,
    k: ValueId,
    v: ValueId,
) -> R<ValueId> {
    let k = repeat_kv(g, c, &format!("{pre}.k"), k)?;
    let v = repeat_kv(g, c, &format!("{pre}.v"), v)?;
    let k_t = g.transpose(&format!("{pre}.k_t"), k, &[0, 1, 3, 2])?;
    let scores = g.node(&format!("{pre}.scores"), Op::MatMul, &[q, k_t])?;
    let scores = g.bin(&format!("{pre}.scaled"), BinaryOp::Mul, scores, sh.scale)?;
    let scores = g.node(
        &format!("{pre}.masked"),
        Op::Where,
        &[sh.mask, scores, sh.masked],
    )?;
    let probs = g.node(&format!("{pre}.probs"), Op::Softmax { axis: 3 }, &[scores])?;
    g.node(&format!("{pre}.context"), Op::MatMul, &[probs, v])
}

/// `[B,S,n*hd]` -> `[B,n,S,hd]`.
fn split_heads(g: &mut Graph, c: &PresetConfig, name: &str, x: ValueId, n: usize) -> R<ValueId> {
    let x = g.reshape(
        &format!("{name}.heads"),
        x,
        &[c.batch, c.seq, n, c.head_dim()],
    )?;
    g.transpose(&format!("{name}.heads_t"), x, &[0, 2, 1, 3])
}

fn gpt_block(g: &mut Graph, c: &PresetConfig, sh: &Shared, pre: &str, x: ValueId) -> R<ValueId> {
    let (h, f) = (c.hidden, c.ffn);
    let ln = |g: &mut Graph, name: &str, x: ValueId| -> R<ValueId> {
        let w = g.param(&format!("{name}.weight"), &[h]);
        let b = g.param(&format!("{name}.bias"), &[h]);
        g.node(
            name,
            Op::LayerNorm {
                axis: 2,
                epsilon: c.norm_eps,
            },
            &[x, w, b],
        )
    };
    // Conv1D: weight [in, out], y = x @ w + b.
    let conv = |g: &mut Graph, name: &str, x: ValueId, n_in: usize, n_out: usize| -> R<ValueId> {
        let w = g.param(&format!("{name}.weight"), &[n_in, n_out]);
        let b = g.param(&format!("{name}.bias"), &[n_out]);
        let y = g.node(&format!("{name}.matmul"), Op::MatMul, &[x, w])?;
        g.bin(name, BinaryOp::Add, y, b)
    };
    let a = ln(g, &format!("{pre}.ln_1"), x)?;
    let qkv = conv(g, &format!("{pre}.attn.c_attn"), a, h, 3 * h)?;
    let parts = g.nodes(
        &format!("{pre}.attn.split"),
        Op::Split {
            axis: 2,
            sizes: vec![h, h, h],
        },
        &[qkv],
        3,
    )?;
    let q = split_heads(g, c, &format!("{pre}.attn.q"), parts[0], c.heads)?;
    let k = split_heads(g, c, &format!("{pre}.attn.k"), parts[1], c.heads)?;
    let v = split_heads(g, c, &format!("{pre}.attn.v"), parts[2], c.heads)?;
    let ctx = attention(g, c, sh, &format!("{pre}.attn"), q, k, v)?;
    let o = conv(g, &format!("{pre}.attn.c_proj"), ctx, h, h)?;
    let x = g.bin(&format!("{pre}.attn.residual"), BinaryOp::Add, x, o)?;
    let m = ln(g, &format!("{pre}.ln_2"), x)?;
    let m = conv(g, &format!("{pre}.mlp.c_fc"), m, h, f)?;
    let m = g.unary(&format!("{pre}.mlp.act"), UnaryOp::GeluTanh, m)?;
    let m = conv(g, &format!("{pre}.mlp.c_proj"), m, f, h)?;
    g.bin(&format!("{pre}.mlp.residual"), BinaryOp::Add, x, m)
}

/// RoPE on `x: [B,n,S,hd]` (the rotate-half form Hugging Face Llama uses).
fn rope(g: &mut Graph, c: &PresetConfig, sh: &Shared, name: &str, x: ValueId) -> R<ValueId> {
    let (cos, sin) = sh.rope.ok_or("RoPE tables are missing")?;
    let half = c.head_dim() / 2;
    let p = g.nodes(
        &format!("{name}.rope_split"),
        Op::Split {
            axis: 3,
            sizes: vec![half, half],
        },
        &[x],
        2,
    )?;
    let (x1, x2) = (p[0], p[1]);
    let a = g.bin(&format!("{name}.rope_x1cos"), BinaryOp::Mul, x1, cos)?;
    let b = g.bin(&format!("{name}.rope_x2sin"), BinaryOp::Mul, x2, sin)?;
    let r1 = g.bin(&format!("{name}.rope_first"), BinaryOp::Sub, a, b)?;
    let a = g.bin(&format!("{name}.rope_x2cos"), BinaryOp::Mul, x2, cos)?;
    let b = g.bin(&format!("{name}.rope_x1sin"), BinaryOp::Mul, x1, sin)?;
    let r2 = g.bin(&format!("{name}.rope_second"), BinaryOp::Add, a, b)?;
    g.node(&format!("{name}.rope"), Op::Concat { axis: 3 }, &[r1, r2])
}

/// `[B,kv,S,hd]` -> `[B,heads,S,hd]`: each KV head serves heads/kv consecutive query heads.
fn repeat_kv(g: &mut Graph, c: &PresetConfig, name: &str, x: ValueId) -> R<ValueId> {
    let rep = c.heads / c.kv_heads;
    if rep == 1 {
        return Ok(x);
    }
    let (b, s, kv, hd) = (c.batch, c.seq, c.kv_heads, c.head_dim());
    let x = g.reshape(&format!("{name}.kv_unsqueeze"), x, &[b, kv, 1, s, hd])?;
    let x = g.node(
        &format!("{name}.kv_expand"),
        Op::Expand {
            shape: vec![b, kv, rep, s, hd],
        },
        &[x],
    )?;
    g.reshape(&format!("{name}.kv_repeat"), x, &[b, c.heads, s, hd])
}

fn llama_block(g: &mut Graph, c: &PresetConfig, sh: &Shared, pre: &str, x: ValueId) -> R<ValueId> {
    let (h, hd) = (c.hidden, c.head_dim());
    let kvd = c.kv_heads * hd;
    let norm = |g: &mut Graph, name: &str, x: ValueId| -> R<ValueId> {
        let w = g.param(&format!("{name}.weight"), &[h]);
        g.node(
            name,
            Op::RmsNorm {
                axis: 2,
                epsilon: c.norm_eps,
            },
            &[x, w],
        )
    };
    let a = norm(g, &format!("{pre}.input_layernorm"), x)?;
    let at = format!("{pre}.self_attn");
    let proj = |g: &mut Graph, name: &str, x: ValueId, n_out: usize, n_in: usize| -> R<ValueId> {
        let w = g.param(&format!("{at}.{name}.weight"), &[n_out, n_in]);
        g.linear(&format!("{at}.{name}"), x, w)
    };
    let q = proj(g, "q_proj", a, h, h)?;
    let k = proj(g, "k_proj", a, kvd, h)?;
    let v = proj(g, "v_proj", a, kvd, h)?;
    let q = split_heads(g, c, &format!("{at}.q"), q, c.heads)?;
    let q = rope(g, c, sh, &format!("{at}.q"), q)?;
    let k = split_heads(g, c, &format!("{at}.k"), k, c.kv_heads)?;
    let k = rope(g, c, sh, &format!("{at}.k"), k)?;
    let v = split_heads(g, c, &format!("{at}.v"), v, c.kv_heads)?;
    let ctx = attention(g, c, sh, &at, q, k, v)?;
    let o = proj(g, "o_proj", ctx, h, h)?;
    let x = g.bin(&format!("{at}.residual"), BinaryOp::Add, x, o)?;
    let m = norm(g, &format!("{pre}.post_attention_layernorm"), x)?;
    let m = match c.family {
        Family::Moe => moe_mlp(g, c, &format!("{pre}.mlp"), m)?,
        _ => swiglu(g, c, &format!("{pre}.mlp"), m)?,
    };
    g.bin(&format!("{pre}.mlp.residual"), BinaryOp::Add, x, m)
}

fn swiglu(g: &mut Graph, c: &PresetConfig, pre: &str, x: ValueId) -> R<ValueId> {
    let (h, f) = (c.hidden, c.ffn);
    let wg = g.param(&format!("{pre}.gate_proj.weight"), &[f, h]);
    let wu = g.param(&format!("{pre}.up_proj.weight"), &[f, h]);
    let wd = g.param(&format!("{pre}.down_proj.weight"), &[h, f]);
    let gate = g.linear(&format!("{pre}.gate_proj"), x, wg)?;
    let gate = g.unary(&format!("{pre}.act"), UnaryOp::Silu, gate)?;
    let up = g.linear(&format!("{pre}.up_proj"), x, wu)?;
    let a = g.bin(&format!("{pre}.gated"), BinaryOp::Mul, gate, up)?;
    g.linear(&format!("{pre}.down_proj"), a, wd)
}

/// Mixtral's sparse MoE block: routed (dispatch, batched expert products, combine), or
/// computed densely with `dense=true` (see the module doc).
fn moe_mlp(g: &mut Graph, c: &PresetConfig, pre: &str, x: ValueId) -> R<ValueId> {
    let (h, f, e, k) = (c.hidden, c.ffn, c.experts, c.top_k);
    let t = c.batch * c.seq;
    let router = g.param(&format!("{pre}.gate.weight"), &[e, h]);
    let gate_up = g.param(&format!("{pre}.experts.gate_up_proj"), &[e, 2 * f, h]);
    let down = g.param(&format!("{pre}.experts.down_proj"), &[e, h, f]);

    let tokens = g.reshape(&format!("{pre}.tokens"), x, &[t, h])?;
    let logits = g.linear(&format!("{pre}.gate"), tokens, router)?;
    let probs = g.node(
        &format!("{pre}.router_probs"),
        Op::Softmax { axis: 1 },
        &[logits],
    )?;
    let top = g.nodes(
        &format!("{pre}.router_topk"),
        Op::TopK {
            axis: 1,
            k,
            largest: true,
            sorted: true,
        },
        &[probs],
        2,
    )?;
    let weights = if c.norm_topk {
        let sum = g.node(
            &format!("{pre}.router_topk_sum"),
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![1],
                keep_dims: true,
            },
            &[top[0]],
        )?;
        g.bin(&format!("{pre}.router_weights"), BinaryOp::Div, top[0], sum)?
    } else {
        top[0]
    };
    let experts = Experts { gate_up, down };
    let y = if c.dense_moe {
        dense_experts(g, c, pre, tokens, top[1], weights, experts)?
    } else {
        routed_experts(g, c, pre, tokens, top[1], weights, experts)?
    };
    g.reshape(&format!("{pre}.out"), y, &[c.batch, c.seq, h])
}

/// The experts' stacked weights: `gate_up_proj [E, 2F, H]`, `down_proj [E, H, F]`.
struct Experts {
    gate_up: ValueId,
    down: ValueId,
}

/// SwiGLU of every expert over `x: [E, rows, H]` -> `[E, rows, H]` (batched products).
fn expert_mlps(g: &mut Graph, c: &PresetConfig, pre: &str, x: ValueId, w: &Experts) -> R<ValueId> {
    let f = c.ffn;
    let gu_t = g.transpose(&format!("{pre}.experts.gate_up_t"), w.gate_up, &[0, 2, 1])?;
    let gu = g.node(&format!("{pre}.experts.gate_up"), Op::MatMul, &[x, gu_t])?;
    let p = g.nodes(
        &format!("{pre}.experts.split"),
        Op::Split {
            axis: 2,
            sizes: vec![f, f],
        },
        &[gu],
        2,
    )?;
    let act = g.unary(&format!("{pre}.experts.act"), UnaryOp::Silu, p[0])?;
    let a = g.bin(&format!("{pre}.experts.gated"), BinaryOp::Mul, act, p[1])?;
    let d_t = g.transpose(&format!("{pre}.experts.down_t"), w.down, &[0, 2, 1])?;
    g.node(&format!("{pre}.experts.down"), Op::MatMul, &[a, d_t])
}

/// Tokens dispatched to their experts' buffers (capacity [`PresetConfig::moe_capacity`]),
/// the experts run on their buffers, and the results combined with the routing weights:
/// `[T,H]`.
fn routed_experts(
    g: &mut Graph,
    c: &PresetConfig,
    pre: &str,
    tokens: ValueId,
    choices: ValueId,
    weights: ValueId,
    w: Experts,
) -> R<ValueId> {
    let d = g.nodes(
        &format!("{pre}.dispatch"),
        Op::MoeDispatch {
            experts: c.experts,
            capacity: c.moe_capacity(),
        },
        &[tokens, choices],
        2,
    )?;
    let y = expert_mlps(g, c, pre, d[0], &w)?;
    g.node(
        &format!("{pre}.combine"),
        Op::MoeCombine,
        &[y, choices, d[1], weights],
    )
}

/// Every expert on every token, weighted by a dense `[T, E]` gate (zero for the experts a
/// token was not routed to) and summed over experts: `[T,H]`.
fn dense_experts(
    g: &mut Graph,
    c: &PresetConfig,
    pre: &str,
    tokens: ValueId,
    choices: ValueId,
    weights: ValueId,
    w: Experts,
) -> R<ValueId> {
    let (e, t) = (c.experts, c.batch * c.seq);
    let zeros = g.node(
        &format!("{pre}.router_zeros"),
        Op::Fill {
            value: 0.0,
            dtype: DType::F32,
            shape: vec![t, e],
        },
        &[],
    )?;
    let dense = g.node(
        &format!("{pre}.router_dense"),
        Op::ScatterElements {
            axis: 1,
            add: false,
        },
        &[zeros, choices, weights],
    )?;
    // [T,H] @ [E,H,2F] -> [E,T,2F]: the tokens broadcast over the experts.
    let y = expert_mlps(g, c, pre, tokens, &w)?;
    // Weight by the dense gate ([T,E] -> [E,T,1]) and sum over experts.
    let gate = g.transpose(&format!("{pre}.router_dense_t"), dense, &[1, 0])?;
    let gate = g.reshape(&format!("{pre}.router_dense_col"), gate, &[e, t, 1])?;
    let y = g.bin(&format!("{pre}.experts.weighted"), BinaryOp::Mul, y, gate)?;
    g.node(
        &format!("{pre}.experts.combine"),
        Op::Reduce {
            op: ReduceOp::Sum,
            axes: vec![0],
            keep_dims: false,
        },
        &[y],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use hzp_ir::{verify, Data};
    use std::path::{Path, PathBuf};

    fn build(spec: &str) -> Program {
        let p = parse_preset(spec).unwrap_or_else(|e| panic!("{e}"));
        verify(&p).unwrap_or_else(|e| panic!("{spec}: {e}"));
        p
    }

    #[test]
    fn big_models_have_their_parameter_counts() {
        for (spec, lo, hi) in [
            ("preset:gpt3-175b", 174.0e9, 176.0e9),
            ("preset:llama3-70b", 70.5e9, 70.7e9),
            ("preset:mixtral-8x7b", 46.6e9, 46.8e9),
            ("preset:llama3-405b", 405.0e9, 406.5e9),
            ("preset:mixtral-8x22b", 140.0e9, 141.5e9),
            ("preset:llama3-8b", 7.9e9, 8.1e9),
            ("preset:gpt2-small", 124.0e6, 124.7e6),
        ] {
            let p = build(spec);
            let n = p.num_parameters() as f64;
            assert!(n >= lo && n <= hi, "{spec}: {n}");
            assert_eq!(
                p.num_parameters(),
                parse_config(spec).unwrap().num_parameters(),
                "{spec}"
            );
            assert!(
                p.params.iter().all(|q| q.data.is_none()),
                "{spec}: parameters carry data"
            );
            let const_bytes: usize = p.consts.iter().map(|c| c.data.size_bytes()).sum();
            assert!(
                const_bytes < 4096,
                "{spec}: {const_bytes} bytes of constants"
            );
        }
    }

    #[test]
    fn tiny_presets_match_the_test_models() {
        // Counts from tests/models/README.md (the PyTorch models).
        for (spec, n) in [
            ("preset:gpt-tiny", 87_552),
            ("preset:llama-tiny", 106_816),
            ("preset:moe-tiny", 156_480),
        ] {
            assert_eq!(build(spec).num_parameters(), n, "{spec}");
        }
    }

    #[test]
    fn every_preset_builds_and_verifies() {
        for name in preset_names() {
            let p = build(&format!("preset:{name}"));
            let c = parse_config(name).unwrap();
            assert_eq!(p.inputs.len(), 1);
            assert_eq!(
                p.value(p.inputs[0]).ty.to_string(),
                format!("i64[{},{}]", c.batch, c.seq)
            );
            assert_eq!(p.outputs.len(), 1);
            let out = p.value(p.outputs[0]);
            assert_eq!(out.name, "logits");
            assert_eq!(
                out.ty.to_string(),
                format!("f32[{},{},{}]", c.batch, c.seq, c.vocab)
            );
            // Parameter names follow the Hugging Face modules, layer by layer.
            let layer0 = match c.family {
                Family::Gpt => "transformer.h.0.",
                _ => "model.layers.0.",
            };
            assert!(
                p.params
                    .iter()
                    .any(|q| p.value(q.value).name.starts_with(layer0)),
                "{name}"
            );
            let last = format!("{}{}.", &layer0[..layer0.len() - 2], c.layers - 1);
            assert!(
                p.params
                    .iter()
                    .any(|q| p.value(q.value).name.starts_with(&last)),
                "{name}"
            );
        }
    }

    #[test]
    fn moe_is_routed_dropless_unless_told() {
        let count =
            |p: &Program, name: &str| p.nodes.iter().filter(|n| n.op.name() == name).count();
        let dispatch = |p: &Program| {
            p.nodes
                .iter()
                .find_map(|n| match n.op {
                    Op::MoeDispatch { experts, capacity } => Some((experts, capacity)),
                    _ => None,
                })
                .unwrap()
        };
        // moe-tiny: 2 x 16 tokens, 4 experts, top 2
        let routed = build("preset:moe-tiny");
        assert_eq!(count(&routed, "MoeDispatch"), 2);
        assert_eq!(count(&routed, "MoeCombine"), 2);
        assert_eq!(count(&routed, "ScatterElements"), 0);
        assert_eq!(dispatch(&routed), (4, 32));
        for (f, cap) in [
            ("1", 16),
            ("1.25", 20),
            ("0.01", 1),
            ("100", 32),
            ("none", 32),
        ] {
            let p = build(&format!("preset:moe-tiny,capacity_factor={f}"));
            assert_eq!(dispatch(&p), (4, cap), "capacity_factor={f}");
        }
        let plain = build("preset:moe-tiny,norm_topk=false");
        assert_eq!(count(&routed, "Div") - count(&plain, "Div"), 2);
        let dense = build("preset:moe-tiny,dense=true");
        assert_eq!(
            count(&dense, "MoeDispatch") + count(&dense, "MoeCombine"),
            0
        );
        assert_eq!(count(&dense, "ScatterElements"), 2);
        assert_eq!(dense.num_parameters(), routed.num_parameters());
        // mixtral-8x7b: 4096 tokens, 8 experts, top 2: an even share is 1024 tokens
        let p = build("preset:mixtral-8x7b,layers=1,capacity_factor=1");
        assert_eq!(dispatch(&p), (8, 1024));
    }

    #[test]
    fn gpt3_175b_builds_quickly() {
        let t = std::time::Instant::now();
        let p = build("preset:gpt3-175b");
        let dt = t.elapsed();
        eprintln!(
            "gpt3-175b: {} nodes, built and verified in {dt:?}",
            p.nodes.len()
        );
        // 1 s is the target in release builds; debug/test builds get slack.
        assert!(dt.as_secs_f64() < 5.0, "{dt:?}");
        assert!(p.nodes.len() < 100 * 40, "{} nodes", p.nodes.len());
    }

    #[test]
    fn tied_and_untied_heads() {
        let gpt = build("preset:gpt-tiny");
        assert!(gpt.find_value("lm_head.weight").is_none());
        let untied = build("preset:gpt-tiny,tied=false");
        assert_eq!(untied.num_parameters(), gpt.num_parameters() + 256 * 64);
        let llama = build("preset:llama-tiny");
        assert!(llama.find_value("lm_head.weight").is_some());
        let tied = build("preset:llama-tiny,tied=true");
        assert_eq!(tied.num_parameters() + 256 * 64, llama.num_parameters());
    }

    #[test]
    fn custom_configs_parse() {
        let c = parse_config("preset:gpt,layers=4,hidden=512,heads=8,vocab=8192,seq=256,batch=4")
            .unwrap();
        assert_eq!(
            (c.family, c.layers, c.hidden, c.heads, c.kv_heads, c.ffn, c.vocab, c.seq, c.batch),
            (Family::Gpt, 4, 512, 8, 8, 2048, 8192, 256, 4)
        );
        assert_eq!(c.max_positions, 256);
        let p = build("preset:gpt,layers=4,hidden=512,heads=8,vocab=8192,seq=256,batch=4");
        assert_eq!(p.num_parameters(), c.num_parameters());
        assert_eq!(p.value(p.outputs[0]).ty.shape, vec![4, 256, 8192]);

        let c = parse_config("llama,layers=2,hidden=1024,heads=16,kv_heads=4,ffn=2816").unwrap();
        assert_eq!(
            (c.family, c.kv_heads, c.ffn, c.vocab),
            (Family::Llama, 4, 2816, 128256)
        );
        let c = parse_config("preset:llama,hidden=4096,heads=32").unwrap();
        assert_eq!((c.kv_heads, c.ffn), (32, 11008)); // Llama's 8/3 rule
        let c = parse_config("preset:moe,layers=2,hidden=256,heads=4,experts=4,top_k=1").unwrap();
        assert_eq!((c.family, c.experts, c.top_k), (Family::Moe, 4, 1));
        build("preset:moe,layers=2,hidden=256,heads=4,kv-heads=2,experts=4,top_k=1,micro_batch=3");

        // Overrides on a named model keep the rest.
        let c = parse_config("preset:llama3-70b,seq=4096").unwrap();
        assert_eq!(
            (c.layers, c.hidden, c.kv_heads, c.ffn, c.seq),
            (80, 8192, 8, 28672, 4096)
        );
        assert_eq!(c.name, "llama3-70b,seq=4096");
        assert_eq!(
            build("preset:llama3-70b,seq=4096").name,
            "llama3-70b,seq=4096"
        );
        let c = parse_config("preset:GPT3-175B, batch=8").unwrap();
        assert_eq!((c.batch, c.seq, c.max_positions), (8, 2048, 2048));
        // A longer sequence grows GPT's position table.
        let c = parse_config("preset:gpt2-small,seq=2048").unwrap();
        assert_eq!(c.max_positions, 2048);
    }

    #[test]
    fn bad_specs_are_errors() {
        for (spec, want) in [
            ("preset:gpt4", "unknown preset `gpt4`"),
            ("preset:", "no preset name"),
            ("preset:gpt,layerz=3", "unknown setting `layerz`"),
            ("preset:gpt,layers", "not a key=value"),
            ("preset:gpt,layers=-1", "expected a whole number"),
            ("preset:gpt,layers=two", "expected a whole number"),
            ("preset:gpt,layers=0", "`layers` must be at least 1"),
            ("preset:gpt,hidden=100,heads=3", "not divisible by heads=3"),
            (
                "preset:llama,heads=32,kv_heads=5",
                "not divisible by kv_heads=5",
            ),
            (
                "preset:gpt,kv_heads=2",
                "applies to llama and moe presets only",
            ),
            ("preset:llama,experts=4", "applies to moe presets only"),
            (
                "preset:gpt2-small,positions=512",
                "exceeds the position table",
            ),
            ("preset:moe,experts=2,top_k=3", "top_k=3 exceeds experts=2"),
            (
                "preset:llama,capacity_factor=1",
                "applies to moe presets only",
            ),
            ("preset:gpt,dense=true", "applies to moe presets only"),
            ("preset:moe,capacity_factor=0", "positive number"),
            (
                "preset:moe,capacity_factor=lots",
                "positive number, or none",
            ),
            ("preset:moe,dense=maybe", "expected true or false"),
            (
                "preset:moe,dense=true,capacity_factor=1.25",
                "capacity_factor applies to the routed form",
            ),
            ("preset:gpt,seq=4,seq=5", "given twice"),
            ("preset:gpt,tied=maybe", "expected true or false"),
            ("preset:llama,eps=0", "positive number"),
            ("preset:llama,hidden=96,heads=32", "even head size"),
            (
                "preset:gpt,vocab=99999999999,hidden=99999999996",
                "than hzp handles",
            ),
            ("preset:gpt3-175b,seq=99999999999", "than hzp handles"),
        ] {
            let e = parse_preset(spec).unwrap_err().to_string();
            assert!(e.contains(want), "{spec}: {e}");
            assert!(e.starts_with(&format!("preset `{spec}`")), "{e}");
        }
        let e = parse_preset("preset:nope").unwrap_err().to_string();
        assert!(
            e.contains("gpt3-175b") && e.contains("llama3-70b") && e.contains("mixtral-8x7b"),
            "{e}"
        );
        // Arbitrary text never panics.
        for spec in [
            "",
            ",,,",
            "preset:gpt,=",
            "preset:gpt,==,",
            "preset:llama,hidden=18446744073709551615",
            "preset:moe,top_k=0",
        ] {
            assert!(parse_preset(spec).is_err(), "{spec}");
        }
    }

    #[test]
    fn presets_print_and_parse_back() {
        for spec in [
            "preset:gpt-tiny",
            "preset:llama-tiny",
            "preset:moe-tiny",
            "preset:mixtral-8x7b",
        ] {
            let p = build(spec);
            let text = hzp_ir::text::print(&p);
            assert_eq!(
                text,
                hzp_ir::text::print(&build(spec)),
                "{spec}: printing is deterministic"
            );
            let lookup = |name: &str| {
                p.consts
                    .iter()
                    .find(|c| p.value(c.value).name == name)
                    .map(|c| c.data.clone())
            };
            let back =
                hzp_ir::text::parse(&text, spec, &lookup).unwrap_or_else(|e| panic!("{spec}: {e}"));
            assert_eq!(back, p, "{spec}");
        }
    }

    fn models_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/models")
    }

    /// Loads the PyTorch weights of a tiny test model into the preset and compares logits.
    fn matches_pytorch(preset: &str, model: &str) {
        let dir = models_dir();
        let (wpath, iopath) = (
            dir.join(format!("{model}.grads.npz")),
            dir.join(format!("{model}.io.npz")),
        );
        if !wpath.exists() || !iopath.exists() {
            eprintln!("skipping: {} is absent", wpath.display());
            return;
        }
        let weights = crate::npz::read(&wpath).unwrap();
        let io = crate::npz::read(&iopath).unwrap();
        let mut p = build(preset);
        for prm in &mut p.params {
            let name = &p.values[prm.value.index()].name;
            let key = format!("param/{name}");
            let t = &weights
                .iter()
                .find(|(k, _)| *k == key)
                .unwrap_or_else(|| panic!("{model} has no {key}"))
                .1;
            assert_eq!(t.shape, p.values[prm.value.index()].ty.shape, "{name}");
            prm.data = Some(t.clone());
        }
        let get = |k: &str| io.iter().find(|(n, _)| n == k).unwrap().1.clone();
        let out = hzp_kernels::eval::evaluate(&p, &[("input_ids".to_string(), get("input_ids"))])
            .unwrap_or_else(|e| panic!("{preset}: {e}"));
        let want = get("torch_out");
        let got = &out[0].1;
        assert_eq!(got.shape, want.shape);
        let (Data::F32(a), Data::F32(b)) = (&got.data, &want.data) else {
            panic!("logits are not f32")
        };
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst < 1e-4,
            "{preset} vs PyTorch {model}: max abs diff {worst}"
        );
    }

    #[test]
    fn gpt_tiny_matches_pytorch() {
        matches_pytorch("preset:gpt-tiny", "gpt2_tiny");
    }

    #[test]
    fn llama_tiny_matches_pytorch() {
        matches_pytorch("preset:llama-tiny", "llama_tiny");
    }

    #[test]
    fn moe_tiny_matches_pytorch() {
        matches_pytorch("preset:moe-tiny", "moe_tiny");
    }
}
