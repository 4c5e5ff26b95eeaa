//! Applies a name map ([`crate::names::NameMap`]) to a decoded model before translation:
//! every initializer the map names becomes the parameter of its `state_dict` key, in
//! PyTorch's layout (an initializer holding a transpose is stored transposed back, and a
//! `Transpose` node gives the graph what it read), one initializer per PyTorch tensor
//! (tied keys share one; an initializer standing for untied keys is split by the nodes that
//! read each).

use super::error::{FResult, Fail, ImportErrorKind};
use super::proto::{attribute_type, AttributeProto, ModelProto, NodeProto, TensorProto};
use super::tensor::{decode_tensor, encode_tensor};
use crate::names::NameMap;
use hzp_ir::Tensor;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

/// One PyTorch tensor an initializer stands for: its canonical key, whether the initializer
/// holds its transpose, and the nodes that read it as this tensor (`None`: all readers).
struct Part {
    canonical: String,
    transpose: bool,
    nodes: Option<Vec<String>>,
}

fn swap2(t: &Tensor) -> Tensor {
    let (m, n) = (t.shape[0], t.shape[1]);
    let v = t.to_f64_vec();
    let mut out = vec![0.0; v.len()];
    for i in 0..m {
        for j in 0..n {
            out[j * m + i] = v[i * n + j];
        }
    }
    Tensor::from_f64(t.dtype(), vec![n, m], &out)
}

/// Rewrites `model` by `map`; returns the keys that are now initializers (parameters by the
/// map's word).
pub(crate) fn apply(
    model: &mut ModelProto,
    map: &NameMap,
    model_dir: Option<&Path>,
) -> FResult<Vec<String>> {
    let d = map.path.display().to_string();
    let err = |m: String| Fail::new(ImportErrorKind::Graph, format!("name map {d}: {m}"));
    let Some(g) = model.graph.as_mut() else {
        return Ok(Vec::new());
    };
    let index: HashMap<String, usize> = g
        .initializer
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.clone(), i))
        .collect();
    let mapped: HashSet<&str> = map.initializers.iter().map(|(n, _)| n.as_str()).collect();

    // Check the whole map first, and group each initializer's keys by PyTorch tensor.
    let mut plan: Vec<(usize, Vec<Part>)> = Vec::new();
    for (init, uses) in &map.initializers {
        let Some(&i) = index.get(init) else {
            let mut have: Vec<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
            have.truncate(8);
            return Err(err(format!(
                "it names initializer `{init}`, which the model does not have (the map was made for another export? export the model again with hzp_export.py; the model's initializers include {})",
                have.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
            )));
        };
        let dims: Vec<i64> = g.initializer[i].dims.clone();
        let mut parts: Vec<Part> = Vec::new();
        for u in uses {
            let s = &map.shapes[&u.key];
            let want: Vec<i64> = if u.transpose {
                if s.len() != 2 {
                    return Err(err(format!(
                        "initializer `{init}` is said to hold the transpose of `{}`, which is not a matrix ({s:?})",
                        u.key
                    )));
                }
                vec![s[1] as i64, s[0] as i64]
            } else {
                s.iter().map(|&x| x as i64).collect()
            };
            if dims != want {
                return Err(err(format!(
                    "`{}` is {s:?} in PyTorch, so initializer `{init}` should be {want:?}{}, but it is {dims:?} (the map was made for another export?)",
                    u.key,
                    if u.transpose { " (its transpose)" } else { "" }
                )));
            }
            let c = map.canonical(&u.key).to_string();
            match parts.iter_mut().find(|p| p.canonical == c) {
                Some(p) => {
                    if p.transpose != u.transpose {
                        return Err(err(format!(
                            "initializer `{init}` stands for tied keys `{c}` and `{}`, one transposed and one not",
                            u.key
                        )));
                    }
                    if let (Some(a), Some(b)) = (&mut p.nodes, &u.nodes) {
                        a.extend(b.iter().cloned());
                    } else {
                        p.nodes = None;
                    }
                }
                None => parts.push(Part {
                    canonical: c,
                    transpose: u.transpose,
                    nodes: u.nodes.clone(),
                }),
            }
        }
        if parts.len() > 1 {
            if let Some(p) = parts.iter().find(|p| p.nodes.is_none()) {
                let keys: Vec<String> =
                    parts.iter().map(|p| format!("`{}`", p.canonical)).collect();
                return Err(err(format!(
                    "initializer `{init}` stands for {}, which PyTorch does not tie, but the map does not say which nodes read `{}` (give `nodes` for each key, or export with hzp_export.py, which never merges parameters)",
                    keys.join(" and "),
                    p.canonical
                )));
            }
        }
        plan.push((i, parts));
    }

    // Names the keys may not take: anything the model defines that the rewrite keeps.
    let mut defined: HashSet<String> = g
        .initializer
        .iter()
        .filter(|t| !mapped.contains(t.name.as_str()))
        .map(|t| t.name.clone())
        .collect();
    for n in &g.node {
        defined.extend(n.output.iter().filter(|o| !o.is_empty()).cloned());
    }
    for v in &g.input {
        if !index.contains_key(&v.name) {
            defined.insert(v.name.clone());
        }
    }
    let outputs: HashSet<String> = g.output.iter().map(|o| o.name.clone()).collect();

    let mut home: BTreeMap<String, ()> = BTreeMap::new();
    let mut new_inits: Vec<TensorProto> = Vec::new();
    let mut front: Vec<NodeProto> = Vec::new();
    let mut rename: HashMap<String, String> = HashMap::new();
    let mut node_rename: HashMap<(String, String), String> = HashMap::new();
    let mut split_inits: HashSet<String> = HashSet::new();
    let mut made = Vec::new();
    for (i, parts) in &plan {
        let t = &g.initializer[*i];
        let init = t.name.clone();
        let single = parts.len() == 1;
        if !single {
            split_inits.insert(init.clone());
        }
        let mut data: Option<Tensor> = None;
        for p in parts {
            let c = &p.canonical;
            if defined.contains(c) {
                return Err(err(format!(
                    "key `{c}` is already the name of another value of the model; cannot name initializer `{init}` by it"
                )));
            }
            if !home.contains_key(c) {
                home.insert(c.clone(), ());
                made.push(c.clone());
                if p.transpose {
                    if data.is_none() {
                        data = Some(decode_tensor(
                            t,
                            &format!("initializer `{init}`"),
                            model_dir,
                        )?);
                    }
                    let back = swap2(data.as_ref().expect("decoded"));
                    new_inits.push(encode_tensor(c, &back));
                } else {
                    let mut tp = t.clone();
                    tp.name = c.clone();
                    new_inits.push(tp);
                }
            }
            // The name the readers of this part read.
            let reader = if p.transpose {
                let out = if single {
                    init.clone()
                } else {
                    format!("{init}::{c}")
                };
                front.push(NodeProto {
                    input: vec![c.clone()],
                    output: vec![out.clone()],
                    name: format!("hzp.names/Transpose/{c}"),
                    op_type: "Transpose".into(),
                    attribute: vec![AttributeProto {
                        name: "perm".into(),
                        r#type: attribute_type::INTS,
                        ints: vec![1, 0],
                        ..Default::default()
                    }],
                    ..Default::default()
                });
                out
            } else if single && outputs.contains(&init) && init != *c {
                front.push(NodeProto {
                    input: vec![c.clone()],
                    output: vec![init.clone()],
                    name: format!("hzp.names/Identity/{c}"),
                    op_type: "Identity".into(),
                    ..Default::default()
                });
                init.clone()
            } else {
                c.clone()
            };
            if single {
                if reader != init {
                    rename.insert(init.clone(), reader);
                }
            } else {
                for n in p.nodes.iter().flatten() {
                    node_rename.insert((n.clone(), init.clone()), reader.clone());
                }
            }
        }
    }

    let removed: HashSet<usize> = plan.iter().map(|(i, _)| *i).collect();
    let mut inits: Vec<TensorProto> = g
        .initializer
        .drain(..)
        .enumerate()
        .filter(|(i, _)| !removed.contains(i))
        .map(|(_, t)| t)
        .collect();
    inits.extend(new_inits);
    g.initializer = inits;
    // ONNX IR < 4 lists initializers among the inputs too
    g.input.retain(|v| !mapped.contains(v.name.as_str()));
    for n in g.node.iter_mut() {
        for x in n.input.iter_mut() {
            if let Some(r) = node_rename.get(&(n.name.clone(), x.clone())) {
                *x = r.clone();
            } else if split_inits.contains(x) {
                return Err(err(format!(
                    "node `{}` reads initializer `{x}`, but the map assigns it to none of the keys `{x}` stands for (add the node to one key's `nodes`)",
                    n.name
                )));
            } else if let Some(r) = rename.get(x) {
                *x = r.clone();
            }
        }
    }
    front.append(&mut g.node);
    g.node = front;
    Ok(made)
}
