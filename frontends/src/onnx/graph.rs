//! Whole-graph checks and analyses that run before translation: who defines each name,
//! topological order (with cycle reporting), liveness, and which float initializers are
//! trainable parameters.

use super::error::{graph_err, FResult};
use super::proto::{data_type as dt, GraphProto, NodeProto, TensorProto, ValueInfoProto};
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};

/// How a node is named in messages: "Reshape `/h.0/Reshape_3`", or, for a node without a
/// name, "Reshape node writing `x`".
pub(crate) fn node_label(n: &NodeProto) -> String {
    let op = if n.domain.is_empty() || n.domain == "ai.onnx" {
        n.op_type.clone()
    } else {
        format!("{}.{}", n.domain, n.op_type)
    };
    if !n.name.is_empty() {
        format!("{op} `{}`", n.name)
    } else if let Some(o) = n.output.iter().find(|o| !o.is_empty()) {
        format!("{op} node writing `{o}`")
    } else {
        format!("{op} node without name or outputs")
    }
}

/// What defines a name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Def {
    Input(usize),
    Init(usize),
    /// Output `slot` of node `node` (index into `GraphProto::node`).
    Node(usize, usize),
}

pub(crate) struct GraphInfo<'g> {
    pub graph: &'g GraphProto,
    /// Every defined name.
    pub defs: HashMap<&'g str, Def>,
    /// Graph inputs that are not initializers, in file order.
    pub inputs: Vec<&'g ValueInfoProto>,
    /// All nodes in a topological order (file order where the file allows it).
    pub order: Vec<usize>,
    /// Nodes some graph output depends on.
    pub live: Vec<bool>,
    /// Names read by live nodes or listed as graph outputs.
    pub used: HashSet<&'g str>,
}

impl<'g> GraphInfo<'g> {
    pub fn new(g: &'g GraphProto) -> FResult<GraphInfo<'g>> {
        let mut defs: HashMap<&str, Def> = HashMap::new();
        let twice = |name: &str, a: &str, b: &str| {
            graph_err(format!("`{name}` is defined twice: {a} and {b}"))
        };
        let describe = |d: Def| -> String {
            match d {
                Def::Input(_) => "a graph input".to_string(),
                Def::Init(_) => "an initializer".to_string(),
                Def::Node(i, _) => format!("an output of {}", node_label(&g.node[i])),
            }
        };
        for (i, t) in g.initializer.iter().enumerate() {
            if t.name.is_empty() {
                return Err(graph_err(format!("initializer #{i} has no name")));
            }
            if let Some(&d) = defs.get(t.name.as_str()) {
                return Err(twice(&t.name, &describe(d), "an initializer"));
            }
            defs.insert(&t.name, Def::Init(i));
        }
        if let Some(s) = g.sparse_initializer.first() {
            let name = s.values.as_ref().map(|v| v.name.as_str()).unwrap_or("");
            return Err(graph_err(format!(
                "the graph has sparse initializers (e.g. `{name}`), which hzp does not read"
            )));
        }
        let mut inputs = Vec::new();
        let mut seen_inputs = HashSet::new();
        for (i, v) in g.input.iter().enumerate() {
            if v.name.is_empty() {
                return Err(graph_err(format!("graph input #{i} has no name")));
            }
            if !seen_inputs.insert(v.name.as_str()) {
                return Err(graph_err(format!(
                    "graph input `{}` is listed twice",
                    v.name
                )));
            }
            // Old exporters list initializers as inputs too: those are initializers.
            if defs.contains_key(v.name.as_str()) {
                continue;
            }
            defs.insert(&v.name, Def::Input(i));
            inputs.push(v);
        }
        for (ni, n) in g.node.iter().enumerate() {
            for (slot, o) in n.output.iter().enumerate() {
                if o.is_empty() {
                    continue;
                }
                if let Some(&d) = defs.get(o.as_str()) {
                    return Err(twice(
                        o,
                        &describe(d),
                        &format!("an output of {}", node_label(n)),
                    ));
                }
                defs.insert(o, Def::Node(ni, slot));
            }
        }

        // Every name read must be defined.
        let mut missing = Vec::new();
        for n in &g.node {
            for i in &n.input {
                if !i.is_empty() && !defs.contains_key(i.as_str()) {
                    missing.push(format!(
                        "{} reads `{i}`, which no node, input or initializer defines",
                        node_label(n)
                    ));
                }
            }
        }
        for o in &g.output {
            if o.name.is_empty() {
                missing.push("a graph output has no name".to_string());
            } else if !defs.contains_key(o.name.as_str()) {
                missing.push(format!(
                    "graph output `{}` is not defined by any node, input or initializer",
                    o.name
                ));
            }
        }
        if !missing.is_empty() {
            let total = missing.len();
            missing.truncate(5);
            let more = if total > 5 {
                format!(" (and {} more)", total - 5)
            } else {
                String::new()
            };
            return Err(graph_err(format!("{}{more}", missing.join("; "))));
        }
        if g.output.is_empty() {
            return Err(graph_err("the graph has no outputs"));
        }

        let order = topo_order(g, &defs)?;

        // Liveness, backwards from the graph outputs.
        let mut live = vec![false; g.node.len()];
        let mut used: HashSet<&str> = HashSet::new();
        let mut stack: Vec<&str> = g.output.iter().map(|o| o.name.as_str()).collect();
        while let Some(name) = stack.pop() {
            if !used.insert(name) {
                continue;
            }
            if let Some(&Def::Node(ni, _)) = defs.get(name) {
                if !live[ni] {
                    live[ni] = true;
                    for i in &g.node[ni].input {
                        if !i.is_empty() {
                            stack.push(i);
                        }
                    }
                }
            }
        }

        Ok(GraphInfo {
            graph: g,
            defs,
            inputs,
            order,
            live,
            used,
        })
    }

    /// Live nodes in topological order.
    pub fn live_order(&self) -> impl Iterator<Item = usize> + '_ {
        self.order.iter().copied().filter(|&i| self.live[i])
    }

    /// The initializer called `name`, if any.
    pub fn init(&self, name: &str) -> Option<&'g TensorProto> {
        match self.defs.get(name) {
            Some(&Def::Init(i)) => self.graph.initializer.get(i),
            _ => None,
        }
    }
}

/// Kahn's algorithm; ready nodes are taken in file order, so a sorted file keeps its order.
fn topo_order(g: &GraphProto, defs: &HashMap<&str, Def>) -> FResult<Vec<usize>> {
    let n = g.node.len();
    let mut indeg = vec![0usize; n];
    let mut succs: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, node) in g.node.iter().enumerate() {
        for inp in &node.input {
            if let Some(&Def::Node(p, _)) = defs.get(inp.as_str()) {
                indeg[i] += 1;
                succs[p].push(i);
            }
        }
    }
    let mut ready: BinaryHeap<Reverse<usize>> =
        (0..n).filter(|&i| indeg[i] == 0).map(Reverse).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(Reverse(i)) = ready.pop() {
        order.push(i);
        for &s in &succs[i] {
            indeg[s] -= 1;
            if indeg[s] == 0 {
                ready.push(Reverse(s));
            }
        }
    }
    if order.len() == n {
        return Ok(order);
    }
    // Every node left has a predecessor that is also left: walk predecessors until a node
    // repeats; the walk from that node on is a cycle.
    let left: BTreeSet<usize> = (0..n).filter(|&i| indeg[i] > 0).collect();
    let pred_left = |i: usize| -> Option<usize> {
        g.node[i]
            .input
            .iter()
            .find_map(|inp| match defs.get(inp.as_str()) {
                Some(&Def::Node(p, _)) if left.contains(&p) => Some(p),
                _ => None,
            })
    };
    let start = left.first().copied().unwrap_or(0);
    let mut path = vec![start];
    let mut pos: HashMap<usize, usize> = HashMap::from([(start, 0)]);
    let mut cur = start;
    let cycle: Vec<usize> = loop {
        match pred_left(cur) {
            Some(p) => {
                if let Some(&at) = pos.get(&p) {
                    let mut c = path[at..].to_vec();
                    c.reverse();
                    break c;
                }
                pos.insert(p, path.len());
                path.push(p);
                cur = p;
            }
            None => break path.clone(),
        }
    };
    let shown: Vec<String> = cycle
        .iter()
        .take(8)
        .map(|&i| node_label(&g.node[i]))
        .collect();
    let more = if cycle.len() > 8 {
        format!(" -> ... ({} nodes in all)", cycle.len())
    } else {
        String::new()
    };
    Err(graph_err(format!(
        "the graph has a cycle ({} of {n} nodes cannot be ordered): {} -> back to the first{more}",
        left.len(),
        shown.join(" -> ")
    )))
}

/// Input positions whose values a translation reads at import time (shapes, axes, sizes):
/// data flowing there never meets run-time values. Shape and Size read only the type.
pub(crate) fn is_static_input(op_type: &str, idx: usize) -> bool {
    match op_type {
        "Reshape" | "Expand" | "Tile" | "Squeeze" | "Unsqueeze" | "Split" | "TopK" | "OneHot"
        | "Trilu" | "CumSum" | "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin"
        | "ReduceProd" | "ReduceSumSquare" | "ReduceL1" | "ReduceL2" | "ReduceLogSum"
        | "ReduceLogSumExp" => idx == 1,
        "Pad" => idx >= 1,
        "Slice" => idx >= 1,
        "Dropout" => idx >= 1,
        "Range" | "ConstantOfShape" | "Shape" | "Size" | "Constant" => true,
        _ => false,
    }
}

/// Exporter metadata: the dynamo exporter records which initializers were parameters and
/// which were buffers (`pkg.torch.export.ExportedProgram.graph_signature`).
#[derive(Default)]
pub(crate) struct Signature {
    pub params: HashSet<String>,
    pub buffers: HashSet<String>,
}

impl Signature {
    pub fn parse(text: &str) -> Signature {
        let mut s = Signature::default();
        for line in text.lines() {
            let target = line
                .split_once("target='")
                .and_then(|(_, rest)| rest.split_once('\''))
                .map(|(t, _)| t.to_string());
            let Some(target) = target else { continue };
            if line.contains(": PARAMETER ") {
                s.params.insert(target);
            } else if line.contains(": BUFFER ") || line.contains(": CONSTANT_TENSOR ") {
                s.buffers.insert(target);
            }
        }
        s
    }
}

fn is_float_type(t: i32) -> bool {
    matches!(t, dt::FLOAT | dt::FLOAT16 | dt::BFLOAT16 | dt::DOUBLE)
}

/// Which initializers become trainable parameters (by index into `graph.initializer`); the
/// rule is documented on the [`onnx`](super) module. Only live nodes count.
///
/// Implementation: walk the live nodes in order, tracking which values depend on run-time
/// data and, for the others, which eligible float initializers flow into them; when a node
/// mixes run-time data with such values, those initializers are parameters.
pub(crate) fn classify_params(info: &GraphInfo, sig: &Signature) -> Vec<bool> {
    let g = info.graph;
    let eligible: Vec<bool> = g
        .initializer
        .iter()
        .map(|t| {
            is_float_type(t.data_type)
                && !sig.buffers.contains(&t.name)
                && (!t.dims.is_empty() || sig.params.contains(&t.name))
        })
        .collect();
    let mut is_param = vec![false; g.initializer.len()];
    // Per value: does it depend on run-time data; which eligible initializers flow into it
    // (only tracked while the value is not run-time).
    let mut runtime: HashSet<&str> = info.inputs.iter().map(|v| v.name.as_str()).collect();
    let mut taint: HashMap<&str, BTreeSet<usize>> = HashMap::new();
    for (i, t) in g.initializer.iter().enumerate() {
        if eligible[i] {
            taint.insert(&t.name, BTreeSet::from([i]));
        }
    }
    for ni in info.live_order() {
        let n = &g.node[ni];
        let dynamic: Vec<&str> = n
            .input
            .iter()
            .enumerate()
            .filter(|(k, name)| !name.is_empty() && !is_static_input(&n.op_type, *k))
            .map(|(_, name)| name.as_str())
            .collect();
        let is_rt = dynamic.iter().any(|v| runtime.contains(v));
        let mut flow = BTreeSet::new();
        for v in &dynamic {
            if let Some(t) = taint.get(v) {
                flow.extend(t.iter().copied());
            }
        }
        if is_rt {
            for i in flow {
                is_param[i] = true;
            }
            for o in &n.output {
                if !o.is_empty() {
                    runtime.insert(o);
                }
            }
        } else if !flow.is_empty() {
            for o in &n.output {
                if !o.is_empty() {
                    taint.insert(o, flow.clone());
                }
            }
        }
    }
    is_param
}
