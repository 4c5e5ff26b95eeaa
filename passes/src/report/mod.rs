//! Program summaries for `hzp show`: totals, interface, op histogram and a per-layer table.
//!
//! Layers come from parameter names ([`layer_of_params`]), which the sharding planner reuses:
//! a layer is the unit whose parameters are gathered together.

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

/// Layers of a program, derived from parameter names.
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
    for (i, prm) in p.params.iter().enumerate() {
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

    let first = assign_nodes(p, &value_layer, &node_name_layer);
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
    let second = assign_nodes(p, &value_layer, &node_name_layer);

    // Execution order: by each layer's first node; unused layers keep their order, last.
    let mut first_node = vec![usize::MAX; names.len()];
    for (n, l) in second.of_node.iter().enumerate() {
        if let Some(l) = *l {
            first_node[l] = first_node[l].min(n);
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
        of_node.push(from_param.or(name_layer[i]).or(from_inputs));
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
                "transformer.wpe",
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
        for l in &s.layers[2..4] {
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
