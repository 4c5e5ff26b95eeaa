//! Program summaries for `hzp show`: totals, interface, op histogram and a per-layer table.
//!
//! Layers come from the program's repeated structure, and from parameter names where it has
//! none ([`layer_of_params`]); the sharding planner reuses them: a layer is the unit whose
//! parameters are gathered together.

use hzp_ir::{DType, NodeId, Program, ValueDef, ValueId};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

/// A program at a glance. Field names are the stable keys of `hzp show --format json`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub name: String,
    /// Trainable elements, all parameters together.
    pub parameters: u64,
    /// Bytes of the parameters in their declared dtypes.
    pub parameter_bytes: u64,
    /// Number of parameter tensors.
    pub parameter_tensors: u64,
    /// Whether any parameter carries data (false for shapes-only presets).
    pub parameters_have_data: bool,
    /// Constant elements, all constants together.
    pub constants: u64,
    pub constant_bytes: u64,
    /// Number of constant tensors.
    pub constant_tensors: u64,
    pub nodes: u64,
    pub inputs: Vec<ValueSummary>,
    pub outputs: Vec<ValueSummary>,
    /// Op name -> number of nodes, sorted by name.
    pub op_histogram: BTreeMap<String, u64>,
    /// Layers in execution order (see [`layer_of_params`]); nodes that belong to no layer
    /// are counted in a last row named `other`.
    pub layers: Vec<LayerSummary>,
}

/// A graph input or output.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ValueSummary {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// One row of the layer table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerSummary {
    pub name: String,
    /// Trainable elements of the layer's parameters.
    pub parameters: u64,
    /// Bytes of the layer's parameters.
    pub bytes: u64,
    /// Nodes assigned to the layer.
    pub nodes: u64,
}

/// The name of the row that collects nodes outside every layer.
pub const OTHER: &str = "other";

/// Summarizes a program (which need not carry parameter data).
pub fn summarize(p: &Program) -> Summary {
    let value_summary = |v: ValueId| {
        let val = p.value(v);
        ValueSummary {
            name: val.name.clone(),
            dtype: val.ty.dtype,
            shape: val.ty.shape.clone(),
        }
    };
    let mut op_histogram = BTreeMap::new();
    for n in &p.nodes {
        *op_histogram.entry(n.op.name().to_string()).or_insert(0u64) += 1;
    }
    let grouping = layer_of_params(p);
    let mut layers: Vec<LayerSummary> = grouping
        .names
        .iter()
        .map(|name| LayerSummary {
            name: name.clone(),
            parameters: 0,
            bytes: 0,
            nodes: 0,
        })
        .collect();
    for (prm, &g) in p.params.iter().zip(&grouping.of_param) {
        let ty = p.ty(prm.value);
        layers[g].parameters += ty.numel() as u64;
        layers[g].bytes += ty.size_bytes() as u64;
    }
    let mut other = 0u64;
    for g in &grouping.of_node {
        match g {
            Some(g) => layers[*g].nodes += 1,
            None => other += 1,
        }
    }
    if other > 0 {
        layers.push(LayerSummary {
            name: OTHER.to_string(),
            parameters: 0,
            bytes: 0,
            nodes: other,
        });
    }
    let param_ty = || p.params.iter().map(|q| p.ty(q.value));
    let const_ty = || p.consts.iter().map(|c| p.ty(c.value));
    Summary {
        name: p.name.clone(),
        parameters: param_ty().map(|t| t.numel() as u64).sum(),
        parameter_bytes: param_ty().map(|t| t.size_bytes() as u64).sum(),
        parameter_tensors: p.params.len() as u64,
        parameters_have_data: p.params.iter().any(|q| q.data.is_some()),
        constants: const_ty().map(|t| t.numel() as u64).sum(),
        constant_bytes: const_ty().map(|t| t.size_bytes() as u64).sum(),
        constant_tensors: p.consts.len() as u64,
        nodes: p.nodes.len() as u64,
        inputs: p.inputs.iter().map(|&v| value_summary(v)).collect(),
        outputs: p.outputs.iter().map(|&v| value_summary(v)).collect(),
        op_histogram,
        layers,
    }
}

/// `124.4M`: a count with an SI suffix (K, M, B for billions, T), one decimal.
pub fn human_count(n: u64) -> String {
    const UNITS: [(f64, &str); 4] = [(1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")];
    let x = n as f64;
    for (scale, unit) in UNITS {
        if x >= scale {
            return format!("{:.1}{unit}", x / scale);
        }
    }
    n.to_string()
}

/// `474.6 MiB`: bytes in binary units, one decimal (`12 B` below a KiB).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut x = n as f64 / 1024.0;
    let mut i = 0;
    while x >= 1024.0 && i + 1 < UNITS.len() {
        x /= 1024.0;
        i += 1;
    }
    format!("{x:.1} {}", UNITS[i])
}

fn tensors(n: u64) -> String {
    if n == 1 {
        "1 tensor".to_string()
    } else {
        format!("{n} tensors")
    }
}

fn type_str(v: &ValueSummary) -> String {
    hzp_ir::TensorType::new(v.dtype, v.shape.clone()).to_string()
}

/// Rows of cells as an aligned table: first column left-aligned, the rest right-aligned.
fn table(out: &mut String, rows: &[Vec<String>]) {
    let ncol = rows.iter().map(Vec::len).max().unwrap_or(0);
    let width: Vec<usize> = (0..ncol)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in rows {
        let mut line = String::from("  ");
        for (c, cell) in r.iter().enumerate() {
            if c == 0 {
                let _ = write!(line, "{cell:<w$}", w = width[0]);
            } else {
                let _ = write!(line, "  {cell:>w$}", w = width[c]);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

impl Summary {
    /// A readable report: totals, interface, the layer table and the op histogram.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "program {}", self.name);
        let data = if self.parameter_tensors == 0 || self.parameters_have_data {
            ""
        } else {
            ", shapes only"
        };
        let totals = vec![
            vec![
                "parameters".to_string(),
                format!(
                    "{} ({}) in {}, {}{data}",
                    human_count(self.parameters),
                    self.parameters,
                    tensors(self.parameter_tensors),
                    human_bytes(self.parameter_bytes)
                ),
            ],
            vec![
                "constants".to_string(),
                format!(
                    "{} in {}, {}",
                    human_count(self.constants),
                    tensors(self.constant_tensors),
                    human_bytes(self.constant_bytes)
                ),
            ],
            vec!["nodes".to_string(), self.nodes.to_string()],
        ];
        // Left-align the values of the totals (they are sentences, not numbers).
        let w = totals.iter().map(|r| r[0].len()).max().unwrap_or(0);
        for r in &totals {
            let _ = writeln!(s, "  {:<w$}  {}", r[0], r[1]);
        }
        for (title, vals) in [("inputs", &self.inputs), ("outputs", &self.outputs)] {
            let _ = writeln!(s, "\n{title}");
            if vals.is_empty() {
                s.push_str("  (none)\n");
            }
            let rows: Vec<Vec<String>> = vals
                .iter()
                .map(|v| vec![v.name.clone(), type_str(v)])
                .collect();
            table(&mut s, &rows);
        }
        let _ = writeln!(s, "\nlayers ({})", self.layers.len());
        let mut rows = vec![vec![
            "layer".to_string(),
            "parameters".to_string(),
            "bytes".to_string(),
            "nodes".to_string(),
        ]];
        rows.extend(self.layers.iter().map(|l| {
            vec![
                l.name.clone(),
                human_count(l.parameters),
                human_bytes(l.bytes),
                l.nodes.to_string(),
            ]
        }));
        table(&mut s, &rows);
        let _ = writeln!(s, "\nops ({} kinds)", self.op_histogram.len());
        let rows: Vec<Vec<String>> = self
            .op_histogram
            .iter()
            .map(|(k, v)| vec![k.clone(), v.to_string()])
            .collect();
        table(&mut s, &rows);
        s
    }
}

// ---------------------------------------------------------------------------------------
// Layer grouping
// ---------------------------------------------------------------------------------------

/// Layers of a program (see [`layer_of_params`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerGrouping {
    /// Layer names in execution order (the order of each layer's first node); layers whose
    /// parameters no node reads come last.
    pub names: Vec<String>,
    /// For each entry of `Program::params`, its layer (an index into `names`).
    pub of_param: Vec<usize>,
    /// For each node, its layer, or `None` for nodes outside every layer.
    pub of_node: Vec<Option<usize>>,
}

impl LayerGrouping {
    /// The layer of parameter value `v`, if `v` is a parameter.
    pub fn layer_of_value(&self, p: &Program, v: ValueId) -> Option<usize> {
        p.params
            .iter()
            .position(|q| q.value == v)
            .map(|i| self.of_param[i])
    }
}

/// The layer a name points at: `(key, numbered)`.
///
/// Names are split on `.` and `/` (empty parts dropped). If a part is a number, the key is
/// the parts up to and including the first number (`transformer.h.3.attn.c_attn.weight` ->
/// `transformer.h.3`, `/model/layers.3/self_attn/MatMul` -> `model.layers.3`) and the layer is
/// numbered. Otherwise the key is the module path, every part but the last
/// (`transformer.wte.weight` -> `transformer.wte`). A name of one part (`onnx::MatMul_656`,
/// `val_44`) says nothing: `None`.
pub fn layer_key(name: &str) -> Option<(String, bool)> {
    let parts: Vec<&str> = name.split(['.', '/']).filter(|s| !s.is_empty()).collect();
    if let Some(i) = parts
        .iter()
        .position(|s| s.bytes().all(|b| b.is_ascii_digit()))
    {
        return Some((parts[..=i].join("."), true));
    }
    (parts.len() >= 2).then(|| (parts[..parts.len() - 1].join("."), false))
}

/// Groups parameters (and nodes) into layers.
///
/// 0. Where the program repeats a block of parameter reads ([`repeated_blocks`]: the layers
///    of a transformer), each block is a layer, and the reads before, between and after the
///    repeated regions are one layer each; a node with a read in a block belongs to that
///    block's layer. So the plain and the name-preserving export of one model get the same
///    layers. The rules below place what is left (every parameter of a program without
///    repeated structure, and parameters no node reads).
/// 1. A parameter with a structured name belongs to its [`layer_key`].
/// 2. A node belongs to the layer of the first parameter it reads; else to the layer its
///    name points at, if that layer exists (ONNX node names like
///    `/model/layers.3/mlp/MatMul`); else to the layer of the input produced last (forward
///    propagation: a layer's activations stay in the layer until the next layer's
///    parameters are read); else to none.
/// 3. A parameter without a structured name (exporters rename transposed weights
///    `onnx::MatMul_656` or `val_44`) joins the layer of its first reader, judged without
///    such parameters: the layer of a parameter the reader reads, else the layer of the
///    reader's name, else that of a parameter read by a direct consumer of the reader (a
///    bias added right after a MatMul: post-norm layers start with one), else the
///    propagated layer if it is a numbered one. Otherwise it is a layer of its own, named
///    after the parameter (an LM head after the final norm).
/// 4. Nodes are assigned again with every parameter placed.
pub fn layer_of_params(p: &Program) -> LayerGrouping {
    let mut names: Vec<String> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut intern = |key: &str, names: &mut Vec<String>| -> usize {
        *index.entry(key.to_string()).or_insert_with(|| {
            names.push(key.to_string());
            names.len() - 1
        })
    };
    // Layer of each parameter value (by value index).
    let mut value_layer: Vec<Option<usize>> = vec![None; p.values.len()];
    let mut unnamed: Vec<usize> = Vec::new();
    let mut numbered: Vec<bool> = Vec::new();
    let sources = param_sources(p);
    let regions = repeated_blocks(p, &sources);
    let mut in_block = vec![false; p.params.len()];
    // The layer of each node with a parameter read in a block: that block's, even where the
    // parameter is one an exporter merged and so belongs to an earlier block.
    let mut read_layer: Vec<Option<usize>> = vec![None; p.nodes.len()];
    for (region, block_names) in regions.iter().zip(block_names(p, &regions)) {
        for (b, name) in region.blocks.iter().zip(block_names) {
            if b.params.is_empty() {
                continue;
            }
            let l = intern(&name, &mut names);
            numbered.resize(names.len(), false);
            numbered[l] = region.repeated;
            for &i in &b.params {
                value_layer[p.params[i].value.index()] = Some(l);
                in_block[i] = true;
            }
            for &n in &b.nodes {
                read_layer[n].get_or_insert(l);
            }
        }
    }
    for (i, prm) in p.params.iter().enumerate() {
        if in_block[i] {
            continue;
        }
        match layer_key(&p.value(prm.value).name) {
            Some((key, num)) => {
                let l = intern(&key, &mut names);
                numbered.resize(names.len(), false);
                numbered[l] = num;
                value_layer[prm.value.index()] = Some(l);
            }
            None => unnamed.push(i),
        }
    }
    let name_index: HashMap<String, usize> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.clone(), i))
        .collect();
    let node_name_layer: Vec<Option<usize>> = p
        .nodes
        .iter()
        .map(|n| layer_key(&n.name).and_then(|(k, _)| name_index.get(&k).copied()))
        .collect();

    let first = assign_nodes(p, &value_layer, &read_layer, &node_name_layer);
    if !unnamed.is_empty() {
        let users = p.users();
        for &i in &unnamed {
            let v = p.params[i].value;
            let reader = users.get(v.index()).and_then(|u| u.first()).copied();
            let found = reader.and_then(|n| {
                let node = p.node(n);
                let direct = node.inputs.iter().find_map(|x| value_layer[x.index()]);
                let consumer = || {
                    node.outputs.iter().find_map(|o| {
                        users.get(o.index())?.iter().find_map(|&u| {
                            p.node(u).inputs.iter().find_map(|x| {
                                is_param(p, *x).then(|| value_layer[x.index()]).flatten()
                            })
                        })
                    })
                };
                direct
                    .or(node_name_layer[n.index()])
                    .or_else(consumer)
                    .or(first.propagated[n.index()].filter(|&l| numbered.get(l) == Some(&true)))
            });
            let layer = match found {
                Some(l) => l,
                None => {
                    let name = p.value(v).name.clone();
                    intern(&name, &mut names)
                }
            };
            value_layer[v.index()] = Some(layer);
        }
    }
    let second = assign_nodes(p, &value_layer, &read_layer, &node_name_layer);

    // Execution order: by each layer's first node that reads an activation (an exporter
    // may hoist every weight's transpose to the top), else its first node; unused layers
    // keep their order, last.
    let mut first_node = vec![(usize::MAX, usize::MAX); names.len()];
    for (n, l) in second.of_node.iter().enumerate() {
        if let Some(l) = *l {
            let key = if reads_activations(&p.nodes[n], &sources) {
                (n, n)
            } else {
                (usize::MAX, n)
            };
            first_node[l] = first_node[l].min(key);
        }
    }
    let mut order: Vec<usize> = (0..names.len()).collect();
    order.sort_by_key(|&l| (first_node[l], l));
    let mut rank = vec![0; names.len()];
    for (new, &old) in order.iter().enumerate() {
        rank[old] = new;
    }
    let of_param = p
        .params
        .iter()
        .map(|q| rank[value_layer[q.value.index()].unwrap_or(0)])
        .collect();
    LayerGrouping {
        names: order.iter().map(|&l| names[l].clone()).collect(),
        of_param,
        of_node: second.of_node.iter().map(|l| l.map(|l| rank[l])).collect(),
    }
}

// ---------------------------------------------------------------------------------------
// Repeated structure
// ---------------------------------------------------------------------------------------

/// Parameter reads above which the search for repeated blocks is skipped (it is quadratic
/// in the reads); layers then come from names alone.
const MAX_READS_FOR_BLOCKS: usize = 1 << 14;

/// Reads a block has at least: a single repeated read (two norms in a row) is not a layer.
const MIN_BLOCK_READS: usize = 2;

/// One block of a repeated region.
#[derive(Clone, Debug, Default)]
struct Block {
    /// Parameters (indices into `Program::params`) first read in the block.
    params: Vec<usize>,
    /// Nodes with a read in the block (a merged initializer's later readers included).
    nodes: Vec<usize>,
}

/// A stretch of reads: a repeated region (its blocks, in order) or the reads around or
/// between such regions (one block).
#[derive(Clone, Debug)]
struct Region {
    /// Reads `start..end`.
    start: usize,
    end: usize,
    blocks: Vec<Block>,
    repeated: bool,
}

/// The program's repeated blocks, found from its structure alone (no names): the layers of
/// a transformer are one block each, whatever the exporter called their weights.
///
/// Every read of a parameter by a node, in program order, gets a signature: the reading
/// op, the input slot, and the parameter's dtype and shape. The longest stretch of reads
/// that is periodic (period P of at least [`MIN_BLOCK_READS`], at least two periods) is a region of blocks of P reads;
/// among equally long stretches the shortest period wins, then the earliest start. The
/// reads before and after a region are searched again (an encoder and a decoder are two
/// regions). A parameter belongs to the block of its first read, so an initializer an
/// exporter merged across layers joins the first layer that reads it, and the read pattern
/// of every layer stays the same whether or not its weights were merged or renamed.
fn repeated_blocks(p: &Program, from_params: &[Option<Vec<usize>>]) -> Vec<Region> {
    let mut sig_ids: HashMap<(&str, usize, DType, &[usize]), u32> = HashMap::new();
    // (parameter, signature, node)
    let mut reads: Vec<(usize, u32, usize)> = Vec::new();
    for (ni, n) in p.nodes.iter().enumerate() {
        if !reads_activations(n, from_params) {
            continue;
        }
        for (slot, v) in n.inputs.iter().enumerate() {
            let Some(params) = &from_params[v.index()] else {
                continue;
            };
            let ty = p.ty(*v);
            let next = sig_ids.len() as u32;
            let sig = *sig_ids
                .entry((n.op.name(), slot, ty.dtype, ty.shape.as_slice()))
                .or_insert(next);
            reads.extend(params.iter().map(|&i| (i, sig, ni)));
        }
    }
    if reads.len() > MAX_READS_FOR_BLOCKS {
        return Vec::new();
    }
    let sigs: Vec<u32> = reads.iter().map(|r| r.1).collect();
    let mut first_read = vec![usize::MAX; p.params.len()];
    for (at, &(i, _, _)) in reads.iter().enumerate() {
        first_read[i] = first_read[i].min(at);
    }
    let mut spans = Vec::new();
    find_periodic(&sigs, 0, sigs.len(), &mut spans);
    spans.sort();
    let block = |from: usize, to: usize| Block {
        params: (0..first_read.len())
            .filter(|&i| first_read[i] >= from && first_read[i] < to)
            .collect(),
        nodes: {
            let mut n: Vec<usize> = reads[from..to].iter().map(|r| r.2).collect();
            n.dedup();
            n
        },
    };
    let repeated: Vec<Region> = spans
        .into_iter()
        .map(|(start, period, count)| Region {
            start,
            end: start + period * count,
            blocks: (0..count)
                .map(|j| block(start + j * period, start + (j + 1) * period))
                .collect(),
            repeated: true,
        })
        .filter(|r| r.blocks.iter().filter(|b| !b.params.is_empty()).count() >= 2)
        .collect();
    if repeated.is_empty() {
        return Vec::new();
    }
    // The reads around and between the regions: one block each (the embeddings before the
    // layers, the final norm and the head after them).
    let mut out = Vec::new();
    let mut at = 0;
    for r in repeated {
        if r.start > at {
            out.push(Region {
                start: at,
                end: r.start,
                blocks: vec![block(at, r.start)],
                repeated: false,
            });
        }
        at = r.end;
        out.push(r);
    }
    if at < reads.len() {
        out.push(Region {
            start: at,
            end: reads.len(),
            blocks: vec![block(at, reads.len())],
            repeated: false,
        });
    }
    out
}

/// The longest periodic stretch of `s[lo..hi]` (see [`repeated_blocks`]) as
/// `(start, period, periods)`, pushed to `out`, then the same for what lies before and
/// after it.
fn find_periodic(s: &[u32], lo: usize, hi: usize, out: &mut Vec<(usize, usize, usize)>) {
    // (covered reads, period, start, periods)
    let mut best: Option<(usize, usize, usize, usize)> = None;
    let better = |a: (usize, usize, usize, usize), b: Option<(usize, usize, usize, usize)>| {
        b.is_none_or(|b| {
            (a.0, std::cmp::Reverse(a.1), std::cmp::Reverse(a.2))
                > (b.0, std::cmp::Reverse(b.1), std::cmp::Reverse(b.2))
        })
    };
    for period in MIN_BLOCK_READS..=(hi - lo) / 2 {
        let mut run = 0;
        for i in lo..hi - period {
            if s[i] == s[i + period] {
                run += 1;
                if run >= period {
                    let periods = (run + period) / period;
                    let cand = (periods * period, period, i + 1 - run, periods);
                    if better(cand, best) {
                        best = Some(cand);
                    }
                }
            } else {
                run = 0;
            }
        }
    }
    if let Some((covered, period, start, periods)) = best {
        out.push((start, period, periods));
        find_periodic(s, lo, start, out);
        find_periodic(s, start + covered, hi, out);
    }
}

/// The layer key most of a block's parameters carry (numbered keys only, or any), ties to
/// the key seen first.
fn common_key(p: &Program, b: &Block, numbered_only: bool) -> Option<String> {
    let mut count: BTreeMap<String, (usize, std::cmp::Reverse<usize>)> = BTreeMap::new();
    for (order, &i) in b.params.iter().enumerate() {
        let name = &p.value(p.params[i].value).name;
        if let Some((k, numbered)) = layer_key(name) {
            // a number that ends the name is a copy's (`add_4.1` of --untie), not a layer's
            let module = k.len() < name.len();
            if (numbered && module) || !numbered_only {
                count.entry(k).or_insert((0, std::cmp::Reverse(order))).0 += 1;
            }
        }
    }
    count.into_iter().max_by_key(|(_, c)| *c).map(|(k, _)| k)
}

/// A name for each block of each region. A repeated block: the numbered layer key most of
/// its own parameters carry (`model.layers.3`), when no other block claims it; else the
/// key of a named block with its number moved by the distance (`model.layers.0` in block 0
/// names block 5 `model.layers.5`); else `layers.J` (`regionR.layers.J` after the first
/// region). The block around the layers: the key most of its parameters carry, else
/// `embeddings` (before the layers), `head` (after) or `betweenR`.
fn block_names(p: &Program, regions: &[Region]) -> Vec<Vec<String>> {
    let mut used: std::collections::HashSet<String> = std::collections::HashSet::new();
    let unique = |name: String, used: &mut std::collections::HashSet<String>| {
        let mut name = name;
        while used.contains(&name) {
            name.push('_');
        }
        used.insert(name.clone());
        name
    };
    let first_repeated = regions.iter().position(|r| r.repeated);
    let last_repeated = regions.iter().rposition(|r| r.repeated);
    let mut out = Vec::new();
    let mut repeated_seen = 0;
    for (r, region) in regions.iter().enumerate() {
        if !region.repeated {
            let fallback = if Some(r) < first_repeated {
                "embeddings".to_string()
            } else if Some(r) > last_repeated {
                "head".to_string()
            } else {
                format!("between{r}")
            };
            let key = common_key(p, &region.blocks[0], false).filter(|k| !used.contains(k));
            out.push(vec![unique(key.unwrap_or(fallback), &mut used)]);
            continue;
        }
        let mut own: Vec<Option<String>> = region
            .blocks
            .iter()
            .map(|b| common_key(p, b, true))
            .collect();
        for j in 0..own.len() {
            if let Some(k) = &own[j] {
                if used.contains(k) || own[..j].contains(&own[j]) {
                    own[j] = None;
                }
            }
        }
        // The first named block whose key ends in its number: the pattern for the rest.
        let pattern = own.iter().enumerate().find_map(|(j, k)| {
            let (head, num) = k.as_ref()?.rsplit_once('.')?;
            Some((j, head.to_string(), num.parse::<usize>().ok()?))
        });
        let mut names = Vec::new();
        for (j, k) in own.iter().enumerate() {
            let derived = pattern.as_ref().and_then(|(j0, head, n0)| {
                let n = (n0 + j).checked_sub(*j0)?;
                Some(format!("{head}.{n}"))
            });
            let name = k
                .clone()
                .or(derived.filter(|d| !own.contains(&Some(d.clone()))))
                .unwrap_or_else(|| match repeated_seen {
                    0 => format!("layers.{j}"),
                    s => format!("region{s}.layers.{j}"),
                });
            names.push(unique(name, &mut used));
        }
        repeated_seen += 1;
        out.push(names);
    }
    out
}

/// For each node: whether an input depends on a graph input or a state (else the node
/// computes from parameters and constants alone).
/// Per value: the parameters (indices into `Program::params`) it is computed from alone (a
/// transpose, cast or `1 + w` of a weight; constants from none), or `None` once it depends
/// on a graph input or a state. Where such a value meets the activations is where the
/// parameters are read, so an exporter that hoists every weight's transpose to the top of
/// the graph does not change the order of the reads.
fn param_sources(p: &Program) -> Vec<Option<Vec<usize>>> {
    let mut from: Vec<Option<Vec<usize>>> = p
        .values
        .iter()
        .map(|v| match v.def {
            ValueDef::Const => Some(Vec::new()),
            _ => None,
        })
        .collect();
    for (i, q) in p.params.iter().enumerate() {
        from[q.value.index()] = Some(vec![i]);
    }
    for n in &p.nodes {
        if reads_activations(n, &from) {
            continue;
        }
        let mut all: Vec<usize> = n
            .inputs
            .iter()
            .flat_map(|v| from[v.index()].clone().unwrap_or_default())
            .collect();
        all.sort_unstable();
        all.dedup();
        for o in &n.outputs {
            from[o.index()] = Some(all.clone());
        }
    }
    from
}

/// Whether an input of `n` depends on a graph input or a state (see [`param_sources`]).
fn reads_activations(n: &hzp_ir::Node, from_params: &[Option<Vec<usize>>]) -> bool {
    n.inputs.iter().any(|v| from_params[v.index()].is_none())
}

fn is_param(p: &Program, v: ValueId) -> bool {
    p.values
        .get(v.index())
        .is_some_and(|x| x.def == ValueDef::Param)
}

struct NodeLayers {
    /// The layer of each node (rule 2).
    of_node: Vec<Option<usize>>,
    /// The layer each node would get from its inputs' producers alone.
    propagated: Vec<Option<usize>>,
}

fn assign_nodes(
    p: &Program,
    param_layer: &[Option<usize>],
    read_layer: &[Option<usize>],
    name_layer: &[Option<usize>],
) -> NodeLayers {
    let mut of_node: Vec<Option<usize>> = Vec::with_capacity(p.nodes.len());
    let mut propagated = Vec::with_capacity(p.nodes.len());
    for (i, n) in p.nodes.iter().enumerate() {
        let from_param = n
            .inputs
            .iter()
            .filter(|v| is_param(p, **v))
            .find_map(|v| param_layer.get(v.index()).copied().flatten());
        // The input produced last (largest producer index) that has a layer.
        let from_inputs = n
            .inputs
            .iter()
            .filter_map(|&v| {
                let prod: NodeId = p.producer(v).filter(|q| q.index() < i)?;
                of_node[prod.index()].map(|l| (prod, l))
            })
            .max_by_key(|(prod, _)| *prod)
            .map(|(_, l)| l);
        propagated.push(from_inputs);
        of_node.push(
            read_layer[i]
                .or(from_param)
                .or(name_layer[i])
                .or(from_inputs),
        );
    }
    NodeLayers {
        of_node,
        propagated,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hzp_ir::{BinaryOp, Op, Tensor, TensorType, UnaryOp};

    fn f32t(shape: &[usize]) -> TensorType {
        TensorType::new(DType::F32, shape.to_vec())
    }

    /// embed -> 2 blocks (one with an exporter-renamed weight) -> head.
    fn small() -> Program {
        let mut p = Program::new("small");
        let ids = p.add_input("ids", TensorType::new(DType::I64, vec![2, 3]));
        let emb = p.add_param("embed.weight", f32t(&[10, 4]), None);
        let w0 = p.add_param("blocks.0.linear.weight", f32t(&[4, 4]), None);
        let b0 = p.add_param("blocks.0.linear.bias", f32t(&[4]), None);
        let w1 = p.add_param("onnx::MatMul_9", f32t(&[4, 4]), None);
        let n1 = p.add_param("blocks.1.norm.weight", f32t(&[4]), None);
        let head = p.add_param("head.weight", f32t(&[4, 10]), None);
        let two = p.add_const("two", Tensor::scalar_f32(2.0));
        let node = |p: &mut Program, name: &str, op: Op, ins: Vec<ValueId>| {
            p.add_node(name, op, ins, vec![name.to_string()]).unwrap()[0]
        };
        let x = node(&mut p, "gather", Op::Gather { axis: 0 }, vec![emb, ids]);
        let x = node(&mut p, "mm0", Op::MatMul, vec![x, w0]);
        let x = node(&mut p, "add0", Op::Binary(BinaryOp::Add), vec![x, b0]);
        let x = node(&mut p, "relu0", Op::Unary(UnaryOp::Relu), vec![x]);
        let x = node(
            &mut p,
            "norm1",
            Op::RmsNorm {
                axis: 2,
                epsilon: 1e-5,
            },
            vec![x, n1],
        );
        let x = node(&mut p, "mm1", Op::MatMul, vec![x, w1]);
        let x = node(&mut p, "scale", Op::Binary(BinaryOp::Mul), vec![x, two]);
        let y = node(&mut p, "logits", Op::MatMul, vec![x, head]);
        let _dangling = node(
            &mut p,
            "fill",
            Op::Fill {
                value: 0.0,
                dtype: DType::F32,
                shape: vec![2],
            },
            vec![],
        );
        p.outputs.push(y);
        hzp_ir::verify(&p).unwrap();
        p
    }

    #[test]
    fn layer_keys() {
        let k = |s: &str| layer_key(s);
        assert_eq!(
            k("transformer.h.3.attn.c_attn.weight"),
            Some(("transformer.h.3".into(), true))
        );
        assert_eq!(
            k("model.layers.12.mlp.experts.gate_up_proj"),
            Some(("model.layers.12".into(), true))
        );
        assert_eq!(
            k("encoder.layer.0.output.LayerNorm.bias"),
            Some(("encoder.layer.0".into(), true))
        );
        assert_eq!(
            k("/model/layers.3/self_attn/q_proj/MatMul"),
            Some(("model.layers.3".into(), true))
        );
        assert_eq!(k("0.weight"), Some(("0".into(), true)));
        assert_eq!(
            k("transformer.wte.weight"),
            Some(("transformer.wte".into(), false))
        );
        assert_eq!(k("lm_head.weight"), Some(("lm_head".into(), false)));
        assert_eq!(k("onnx::MatMul_656"), None);
        assert_eq!(k("val_44"), None);
        assert_eq!(k(""), None);
    }

    #[test]
    fn small_program_summary() {
        let p = small();
        let s = summarize(&p);
        assert_eq!(s.parameters, 40 + 16 + 4 + 16 + 4 + 40);
        assert_eq!(s.parameter_bytes, 4 * s.parameters);
        assert_eq!((s.parameter_tensors, s.parameters_have_data), (6, false));
        assert_eq!(
            (s.constants, s.constant_bytes, s.constant_tensors),
            (1, 4, 1)
        );
        assert_eq!(s.nodes, 9);
        assert_eq!(s.inputs[0].name, "ids");
        assert_eq!(s.outputs[0].shape, vec![2, 3, 10]);
        assert_eq!(s.op_histogram.get("MatMul"), Some(&3));
        assert_eq!(
            s.op_histogram.keys().cloned().collect::<Vec<_>>(),
            ["Add", "Fill", "Gather", "MatMul", "Mul", "Relu", "RmsNorm"]
        );
        let rows: Vec<(&str, u64, u64)> = s
            .layers
            .iter()
            .map(|l| (l.name.as_str(), l.parameters, l.nodes))
            .collect();
        // The renamed weight joins block 1 (its reader follows block 1's norm); the scale
        // after it stays in block 1; the fill with no inputs is "other".
        assert_eq!(
            rows,
            [
                ("embed", 40, 1),
                ("blocks.0", 20, 3),
                ("blocks.1", 20, 3),
                ("head", 40, 1),
                ("other", 0, 1)
            ]
        );
        let total: u64 = s.layers.iter().map(|l| l.parameters).sum();
        assert_eq!(total, s.parameters);

        let text = s.to_text();
        assert!(text.starts_with("program small\n"), "{text}");
        assert!(
            text.contains("parameters  120 (120) in 6 tensors, 480 B, shapes only"),
            "{text}"
        );
        assert!(text.contains("\n  ids  i64[2,3]\n"), "{text}");
        assert!(text.contains("constants   1 in 1 tensor, 4 B"), "{text}");
        assert!(
            text.contains("\n  blocks.1          20   80 B      3\n"),
            "{text}"
        );

        let json = serde_json::to_value(&s).unwrap();
        for key in [
            "name",
            "parameters",
            "parameter_bytes",
            "constants",
            "constant_bytes",
            "nodes",
            "inputs",
            "outputs",
            "op_histogram",
            "layers",
        ] {
            assert!(json.get(key).is_some(), "missing {key}");
        }
        assert_eq!(json["inputs"][0]["dtype"], "i64");
        assert_eq!(json["layers"][1]["name"], "blocks.0");
    }

    #[test]
    fn renamed_weights_follow_post_norm_and_pre_norm_layers() {
        // Post-norm (BERT): layer 1's renamed query weight is read right after layer 0's
        // closing LayerNorm, and its bias add names layer 1.
        let mut p = Program::new("post");
        let x = p.add_input("x", f32t(&[2, 4]));
        let ln0 = p.add_param("enc.layer.0.out.LayerNorm.weight", f32t(&[4]), None);
        let w = p.add_param("val_7", f32t(&[4, 4]), None);
        let b = p.add_param("enc.layer.1.query.bias", f32t(&[4]), None);
        let y = p
            .add_node(
                "n1",
                Op::LayerNorm {
                    axis: 1,
                    epsilon: 1e-5,
                },
                vec![x, ln0],
                vec!["y".into()],
            )
            .unwrap()[0];
        let z = p
            .add_node("n2", Op::MatMul, vec![y, w], vec!["z".into()])
            .unwrap()[0];
        let o = p
            .add_node(
                "n3",
                Op::Binary(BinaryOp::Add),
                vec![z, b],
                vec!["o".into()],
            )
            .unwrap()[0];
        p.outputs.push(o);
        let g = layer_of_params(&p);
        assert_eq!(g.names, ["enc.layer.0", "enc.layer.1"]);
        assert_eq!(g.of_param, [0, 1, 1]);
        assert_eq!(g.of_node, [Some(0), Some(1), Some(1)]);

        // Pre-norm (Llama): the renamed down projection closes layer 0 even though layer 1's
        // norm follows the residual add.
        let mut p = Program::new("pre");
        let x = p.add_input("x", f32t(&[2, 4]));
        let n0 = p.add_param(
            "model.layers.0.post_attention_layernorm.weight",
            f32t(&[4]),
            None,
        );
        let down = p.add_param("onnx::MatMul_1", f32t(&[4, 4]), None);
        let n1 = p.add_param("model.layers.1.input_layernorm.weight", f32t(&[4]), None);
        let head = p.add_param("val_9", f32t(&[4, 3]), None);
        let fin = p.add_param("model.norm.weight", f32t(&[4]), None);
        let h = p
            .add_node(
                "a",
                Op::RmsNorm {
                    axis: 1,
                    epsilon: 1e-5,
                },
                vec![x, n0],
                vec!["h".into()],
            )
            .unwrap()[0];
        let d = p
            .add_node("b", Op::MatMul, vec![h, down], vec!["d".into()])
            .unwrap()[0];
        let r = p
            .add_node("c", Op::Binary(BinaryOp::Add), vec![x, d], vec!["r".into()])
            .unwrap()[0];
        let h = p
            .add_node(
                "d",
                Op::RmsNorm {
                    axis: 1,
                    epsilon: 1e-5,
                },
                vec![r, n1],
                vec!["h1".into()],
            )
            .unwrap()[0];
        let f = p
            .add_node(
                "e",
                Op::RmsNorm {
                    axis: 1,
                    epsilon: 1e-5,
                },
                vec![h, fin],
                vec!["f".into()],
            )
            .unwrap()[0];
        let l = p
            .add_node("f", Op::MatMul, vec![f, head], vec!["l".into()])
            .unwrap()[0];
        p.outputs.push(l);
        let g = layer_of_params(&p);
        assert_eq!(
            g.names,
            ["model.layers.0", "model.layers.1", "model.norm", "val_9"]
        );
        assert_eq!(g.of_param, [0, 0, 1, 3, 2]);
        assert_eq!(
            g.of_node,
            [Some(0), Some(0), Some(0), Some(1), Some(2), Some(3)]
        );
    }

    /// A stack of `layers` pre-norm blocks (norm, product, bias, relu, product, residual
    /// add) between an embedding and a head. `name(kind, layer)` names the parameters;
    /// `merged` makes every norm read one weight (an exporter's merge of equal
    /// initializers); `hoisted` transposes every product's weight at the top of the program
    /// (as the legacy exporter does).
    fn stack(
        layers: usize,
        name: &dyn Fn(&str, usize) -> String,
        merged: bool,
        hoisted: bool,
    ) -> Program {
        let mut p = Program::new("stack");
        let ids = p.add_input("ids", TensorType::new(DType::I64, vec![2, 3]));
        let emb = p.add_param(name("embed", 0), f32t(&[10, 4]), None);
        let mut params = Vec::new();
        for l in 0..layers {
            let norm = if merged && l > 0 {
                params[0]
            } else {
                p.add_param(name("norm", l), f32t(&[4]), None)
            };
            let w1 = p.add_param(name("w1", l), f32t(&[8, 4]), None);
            let b1 = p.add_param(name("b1", l), f32t(&[8]), None);
            let w2 = p.add_param(name("w2", l), f32t(&[4, 8]), None);
            params.extend([norm, w1, b1, w2]);
        }
        let head = p.add_param(name("head", 0), f32t(&[4, 10]), None);
        let mut k = 0;
        let mut node = |p: &mut Program, op: Op, ins: Vec<ValueId>| {
            k += 1;
            let n = format!("n{k}");
            p.add_node(&n, op, ins, vec![n.clone()]).unwrap()[0]
        };
        let t = |p: &mut Program,
                 node: &mut dyn FnMut(&mut Program, Op, Vec<ValueId>) -> ValueId,
                 w| { node(p, Op::Transpose { perm: vec![1, 0] }, vec![w]) };
        let mut ws: Vec<(ValueId, ValueId)> = Vec::new();
        if hoisted {
            for l in 0..layers {
                let a = t(&mut p, &mut node, params[4 * l + 1]);
                let b = t(&mut p, &mut node, params[4 * l + 3]);
                ws.push((a, b));
            }
        }
        let mut x = node(&mut p, Op::Gather { axis: 0 }, vec![emb, ids]);
        for l in 0..layers {
            let (w1, w2) = match ws.get(l) {
                Some(&w) => w,
                None => (
                    t(&mut p, &mut node, params[4 * l + 1]),
                    t(&mut p, &mut node, params[4 * l + 3]),
                ),
            };
            let h = node(
                &mut p,
                Op::RmsNorm {
                    axis: 2,
                    epsilon: 1e-5,
                },
                vec![x, params[4 * l]],
            );
            let h = node(&mut p, Op::MatMul, vec![h, w1]);
            let h = node(
                &mut p,
                Op::Binary(BinaryOp::Add),
                vec![h, params[4 * l + 2]],
            );
            let h = node(&mut p, Op::Unary(UnaryOp::Relu), vec![h]);
            let h = node(&mut p, Op::MatMul, vec![h, w2]);
            x = node(&mut p, Op::Binary(BinaryOp::Add), vec![x, h]);
        }
        let y = node(&mut p, Op::MatMul, vec![x, head]);
        p.outputs.push(y);
        hzp_ir::verify(&p).unwrap();
        p
    }

    /// The layers of a program as parameter positions per layer, in layer order.
    fn partition(p: &Program) -> Vec<Vec<usize>> {
        let g = layer_of_params(p);
        let mut out = vec![Vec::new(); g.names.len()];
        for (i, &l) in g.of_param.iter().enumerate() {
            out[l].push(i);
        }
        out
    }

    #[test]
    fn layers_come_from_repeated_structure_not_names() {
        let named = |kind: &str, l: usize| match kind {
            "embed" => "model.embed.weight".to_string(),
            "head" => "lm_head.weight".to_string(),
            k => format!("model.layers.{l}.{k}.weight"),
        };
        let renamed = |kind: &str, l: usize| {
            format!(
                "val_{}",
                kind.bytes().map(u32::from).sum::<u32>() as usize * 10 + l
            )
        };
        let reference = stack(3, &named, false, false);
        let g = layer_of_params(&reference);
        assert_eq!(
            g.names,
            [
                "model.embed",
                "model.layers.0",
                "model.layers.1",
                "model.layers.2",
                "lm_head"
            ]
        );
        // the same program with exporter-made names, or with every weight transposed at the
        // top, has the same layers
        let want = partition(&reference);
        for (p, what) in [
            (stack(3, &renamed, false, false), "renamed"),
            (stack(3, &named, false, true), "hoisted transposes"),
            (stack(3, &renamed, false, true), "renamed and hoisted"),
        ] {
            assert_eq!(partition(&p), want, "{what}");
            let nodes = |g: &LayerGrouping| {
                let mut n = vec![0; g.names.len()];
                for l in g.of_node.iter().flatten() {
                    n[*l] += 1;
                }
                n
            };
            assert_eq!(nodes(&layer_of_params(&p)), nodes(&g), "{what}");
        }
        let r = stack(3, &renamed, false, false);
        assert_eq!(layer_of_params(&r).of_node, g.of_node);
        let r = layer_of_params(&stack(3, &renamed, false, false));
        assert_eq!(
            r.names,
            ["embeddings", "layers.0", "layers.1", "layers.2", "head"]
        );

        // A merged norm weight belongs to the first layer, but each layer's norm node stays
        // in its own layer (names alone put every reader in layer 0).
        let merged = stack(3, &named, true, false);
        let m = layer_of_params(&merged);
        assert_eq!(m.names, g.names);
        assert_eq!(m.of_node, g.of_node);
        // mutation check: without the repeated structure (one layer), names decide
        let one = layer_of_params(&stack(1, &renamed, false, false));
        assert!(
            one.names.iter().all(|n| n.starts_with("val_")),
            "{:?}",
            one.names
        );
    }

    #[test]
    fn preset_summaries() {
        let p = hzp_frontends::presets::parse_preset("preset:gpt-tiny").unwrap();
        let s = summarize(&p);
        assert_eq!(s.parameters, 87_552);
        let names: Vec<&str> = s.layers.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "transformer.wte",
                "transformer.h.0",
                "transformer.h.1",
                "transformer.ln_f",
            ]
        );
        // (the written-out attention's shared causal mask was a layer "other" of its own)
        let explicit = hzp_frontends::presets::parse_preset_with("preset:gpt-tiny", false).unwrap();
        let names: Vec<String> = summarize(&explicit)
            .layers
            .into_iter()
            .map(|l| l.name)
            .collect();
        assert_eq!(names.last().map(String::as_str), Some("other"));
        for l in &s.layers[1..3] {
            assert_eq!(l.parameters, 33_472, "{}", l.name);
            assert!(l.nodes > 20, "{}: {} nodes", l.name, l.nodes);
        }
        assert_eq!(s.layers.iter().map(|l| l.nodes).sum::<u64>(), s.nodes);

        let p = hzp_frontends::presets::parse_preset("preset:llama3-70b").unwrap();
        let s = summarize(&p);
        let layers: Vec<&LayerSummary> = s
            .layers
            .iter()
            .filter(|l| l.name.starts_with("model.layers."))
            .collect();
        assert_eq!(layers.len(), 80);
        assert_eq!(layers[0].name, "model.layers.0");
        assert_eq!(layers[79].name, "model.layers.79");
        assert!(layers.iter().all(|l| l.parameters == layers[0].parameters));
        let text = s.to_text();
        assert!(text.contains("70.6B"), "{text}");
        assert!(text.contains("GiB"), "{text}");
    }

    #[test]
    fn human_units() {
        assert_eq!(human_count(999), "999");
        assert_eq!(human_count(124_439_808), "124.4M");
        assert_eq!(human_count(174_591_037_440), "174.6B");
        assert_eq!(human_count(1_500), "1.5K");
        assert_eq!(human_bytes(12), "12 B");
        assert_eq!(human_bytes(497_759_232), "474.7 MiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
    }
}
