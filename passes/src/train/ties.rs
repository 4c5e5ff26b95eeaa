//! Weight sharing as exporters leave it, and how to restore PyTorch's.
//!
//! Exporters change weight sharing in two ways: the legacy exporter stores a tied embedding
//! once for the lookup and once, transposed, for the LM head (untying them); and both
//! exporters merge initializers whose values are identical (tying weights that were
//! separate). [`find_ties`] finds parameters equal up to a transpose of their last two axes;
//! [`retie`] makes each such group one parameter again. [`shared_parameters`] lists
//! parameters read from more than one layer, which is how a merge by the exporter shows.

use hzp_ir::{Op, Program, ValueDef, ValueId};

/// `copy` holds the same values as `canonical` (transposed over the last two axes if
/// `transposed`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Tie {
    pub canonical: String,
    pub copy: String,
    pub transposed: bool,
}

/// Names that exporters invent for initializers they created (rather than module paths).
fn looks_generated(name: &str) -> bool {
    name.starts_with("onnx::")
        || name
            .strip_prefix("val_")
            .is_some_and(|r| r.chars().all(|c| c.is_ascii_digit()))
}

/// `v` (row-major, shape `shape`) with its last two axes swapped.
pub fn transpose_last2(v: &[f32], shape: &[usize]) -> Vec<f32> {
    let r = shape.len();
    let (m, n) = (shape[r - 2], shape[r - 1]);
    let batch = v.len() / (m * n).max(1);
    let mut out = vec![0.0; v.len()];
    for b in 0..batch {
        for i in 0..m {
            for j in 0..n {
                out[b * m * n + j * m + i] = v[b * m * n + i * n + j];
            }
        }
    }
    out
}

/// Parameters with data that equal another parameter exactly, or its transpose.
pub fn find_ties(p: &Program) -> Vec<Tie> {
    struct Cand {
        name: String,
        shape: Vec<usize>,
        data: Vec<f32>,
        sum: f64,
    }
    let cands: Vec<Cand> = p
        .params
        .iter()
        .filter_map(|prm| {
            let d = prm.data.as_ref()?;
            if !d.dtype().is_float() || d.numel() < 2 {
                return None;
            }
            let data = d.to_f32_vec();
            // A constant tensor (all ones, all zeros) equals every other constant tensor of
            // its size: that says nothing about a weight stored twice.
            if data.iter().all(|&x| x.to_bits() == data[0].to_bits()) {
                return None;
            }
            let sum = data.iter().map(|&x| (x as f64).abs()).sum();
            Some(Cand {
                name: p.value(prm.value).name.clone(),
                shape: d.shape.clone(),
                data,
                sum,
            })
        })
        .collect();
    let mut ties = Vec::new();
    let mut taken = vec![false; cands.len()];
    for i in 0..cands.len() {
        if taken[i] {
            continue;
        }
        for j in i + 1..cands.len() {
            if taken[j] || cands[i].data.len() != cands[j].data.len() {
                continue;
            }
            let (a, b) = (&cands[i], &cands[j]);
            if (a.sum - b.sum).abs() > 1e-6 * a.sum.max(1.0) {
                continue;
            }
            let same = a.shape == b.shape && a.data == b.data;
            let transposed = !same
                && a.shape.len() >= 2
                && b.shape.len() == a.shape.len()
                && {
                    let r = a.shape.len();
                    let mut t = a.shape.clone();
                    t.swap(r - 2, r - 1);
                    t == b.shape
                }
                && transpose_last2(&a.data, &a.shape) == b.data;
            if same || transposed {
                taken[j] = true;
                // Keep the name PyTorch users know; exporter-invented names become copies.
                let (canonical, copy) = if looks_generated(&a.name) && !looks_generated(&b.name) {
                    (b.name.clone(), a.name.clone())
                } else {
                    (a.name.clone(), b.name.clone())
                };
                ties.push(Tie {
                    canonical,
                    copy,
                    transposed,
                });
            }
        }
    }
    ties
}

/// Replaces every use of each tie's copy by its canonical parameter (through a Transpose
/// where needed) and removes the copy.
pub fn retie(p: &mut Program, ties: &[Tie]) -> Result<(), String> {
    let mut removed = Vec::new();
    for t in ties {
        let canon = p
            .find_value(&t.canonical)
            .ok_or_else(|| format!("retie: no parameter `{}`", t.canonical))?;
        let copy = p
            .find_value(&t.copy)
            .ok_or_else(|| format!("retie: no parameter `{}`", t.copy))?;
        let replacement = if t.transposed {
            let perm = hzp_ir::views::last_two_swapped(p.ty(canon).rank());
            let name = hzp_ir::NameSet::from_program(p).fresh(&format!("{}.T", t.canonical));
            let v = p.add_node(
                name.clone(),
                Op::Transpose { perm },
                vec![canon],
                vec![name],
            )?[0];
            // The new node is at the end; it must come before the copy's users.
            let node = p.nodes.pop().expect("just added");
            p.nodes.insert(0, node);
            p.renumber_nodes();
            v
        } else {
            canon
        };
        for n in p.nodes.iter_mut() {
            for i in n.inputs.iter_mut() {
                if *i == copy {
                    *i = replacement;
                }
            }
        }
        for o in p.outputs.iter_mut() {
            if *o == copy {
                *o = replacement;
            }
        }
        p.params.retain(|x| x.value != copy);
        removed.push(copy);
    }
    // The copies are no longer referenced anywhere: drop their values.
    remove_values(p, &removed);
    hzp_ir::verify(p).map_err(|e| format!("retie produced an invalid program: {e}"))
}

/// Removes unreferenced values and renumbers the rest densely.
fn remove_values(p: &mut Program, dead: &[ValueId]) {
    if dead.is_empty() {
        return;
    }
    let mut map = vec![u32::MAX; p.values.len()];
    let mut values = Vec::new();
    for (i, v) in p.values.iter().enumerate() {
        if !dead.contains(&ValueId(i as u32)) {
            map[i] = values.len() as u32;
            values.push(v.clone());
        }
    }
    let r = |v: &mut ValueId| *v = ValueId(map[v.index()]);
    for n in p.nodes.iter_mut() {
        n.inputs.iter_mut().for_each(r);
        n.outputs.iter_mut().for_each(r);
    }
    p.inputs.iter_mut().for_each(r);
    p.outputs.iter_mut().for_each(r);
    p.params.iter_mut().for_each(|x| r(&mut x.value));
    p.consts.iter_mut().for_each(|x| r(&mut x.value));
    p.states.iter_mut().for_each(|x| r(&mut x.value));
    p.updates.iter_mut().for_each(|u| {
        r(&mut u.target);
        r(&mut u.value);
    });
    p.values = values;
}

/// Turns the named parameters into constants (they keep their data and are not trained),
/// e.g. buffers such as rotary frequency tables that an exporter stored as initializers.
///
/// Returns the names that are not parameters of the program: constants already, or
/// initializers the importer folded away (callers say so to the user).
pub fn freeze(p: &mut Program, names: &[String]) -> Result<Vec<String>, String> {
    let mut not_params = Vec::new();
    for name in names {
        let Some(v) = p.find_value(name) else {
            not_params.push(name.clone());
            continue;
        };
        match p.value(v).def {
            ValueDef::Param => {}
            ValueDef::Const => {
                not_params.push(name.clone());
                continue;
            }
            _ => return Err(format!("--freeze: `{name}` is not a parameter")),
        }
        let prm = p
            .params
            .iter()
            .position(|x| x.value == v)
            .expect("is a param");
        let prm = p.params.remove(prm);
        let data = prm
            .data
            .ok_or_else(|| format!("--freeze: parameter `{name}` has no data to freeze"))?;
        p.values[v.index()].def = ValueDef::Const;
        p.consts.push(hzp_ir::Const { value: v, data });
    }
    hzp_ir::verify(p).map_err(|e| format!("freeze produced an invalid program: {e}"))?;
    Ok(not_params)
}

/// A parameter that nodes of several layers read.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SharedParameter {
    pub name: String,
    pub layers: Vec<String>,
}

/// Parameters read by nodes of more than one layer (layers from
/// [`crate::report::layer_of_params`]): how an exporter's merge of identical initializers,
/// or a deliberately tied weight, shows.
pub fn shared_parameters(p: &Program) -> Vec<SharedParameter> {
    let grouping = crate::report::layer_of_params(p);
    let users = p.users();
    let mut out = Vec::new();
    for prm in &p.params {
        let mut layers: Vec<usize> = users[prm.value.index()]
            .iter()
            .filter_map(|n| grouping.of_node.get(n.index()).copied().flatten())
            .collect();
        layers.sort();
        layers.dedup();
        if layers.len() > 1 {
            out.push(SharedParameter {
                name: p.value(prm.value).name.clone(),
                layers: layers.iter().map(|&l| grouping.names[l].clone()).collect(),
            });
        }
    }
    out
}

/// An initializer that an exporter merged: one parameter read in the same place (same op,
/// same input) by nodes of different layers, where PyTorch has one parameter per layer
/// (exporters merge initializers with equal values, such as the all-ones norms of a fresh
/// model).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Merged {
    pub name: String,
    /// The op and input that read it, e.g. `LayerNorm input 1`.
    pub read_as: String,
    /// The nodes that read it so, in program order.
    pub readers: Vec<String>,
    /// Where each reader sits: the layer of the nearest other parameter downstream of it
    /// (else upstream; else the reader's name).
    pub places: Vec<String>,
    /// The value of every element, when the tensor is constant (all ones, all zeros).
    pub constant: Option<f64>,
}

/// Parameters an exporter probably merged (see [`Merged`]). A parameter PyTorch really
/// shares between layers (one module applied several times) looks the same; a name map
/// (`hzp_export.py`) tells them apart.
pub fn merged_initializers(p: &Program) -> Vec<Merged> {
    use std::collections::{BTreeMap, HashSet, VecDeque};
    // (param value) -> role -> readers
    let mut roles: BTreeMap<u32, BTreeMap<(String, usize), Vec<usize>>> = BTreeMap::new();
    let is_param: HashSet<u32> = p.params.iter().map(|x| x.value.0).collect();
    for (ni, n) in p.nodes.iter().enumerate() {
        for (slot, v) in n.inputs.iter().enumerate() {
            if is_param.contains(&v.0) {
                let r = roles
                    .entry(v.0)
                    .or_default()
                    .entry((n.op.name().to_string(), slot))
                    .or_default();
                if r.last() != Some(&ni) {
                    r.push(ni);
                }
            }
        }
    }
    let suspects: HashSet<u32> = roles
        .iter()
        .filter(|(_, r)| r.values().any(|n| n.len() > 1))
        .map(|(&v, _)| v)
        .collect();
    // The nearest parameters upstream and downstream of `node` that are not suspects:
    // where the node sits (a residual stream makes the upstream one ambiguous: every norm
    // of a pre-norm transformer is a few hops below the embedding; the product after it
    // is its layer's).
    let users = p.users();
    let search = |node: usize, down: bool| -> Option<u32> {
        let mut queue = VecDeque::from([node]);
        let mut seen = HashSet::from([node]);
        let mut visited = 0;
        while let Some(n) = queue.pop_front() {
            visited += 1;
            if visited > 256 {
                break;
            }
            let nd = &p.nodes[n];
            let own = |v: &&ValueId| is_param.contains(&v.0) && !suspects.contains(&v.0);
            if down && n != node {
                if let Some(v) = nd.inputs.iter().find(own) {
                    return Some(v.0);
                }
            }
            let next: Vec<usize> = if down {
                nd.outputs
                    .iter()
                    .flat_map(|o| users[o.index()].iter().map(|u| u.index()))
                    .collect()
            } else {
                if let Some(v) = nd.inputs.iter().find(own) {
                    return Some(v.0);
                }
                nd.inputs
                    .iter()
                    .filter_map(|&v| p.producer(v).map(|x| x.index()))
                    .collect()
            };
            for m in next {
                if seen.insert(m) {
                    queue.push_back(m);
                }
            }
        }
        None
    };
    let context = |node: usize| (search(node, false), search(node, true));
    let mut out = Vec::new();
    for prm in &p.params {
        let Some(r) = roles.get(&prm.value.0) else {
            continue;
        };
        for ((op, slot), readers) in r {
            if readers.len() < 2 {
                continue;
            }
            let ctx: Vec<(Option<u32>, Option<u32>)> =
                readers.iter().map(|&n| context(n)).collect();
            let distinct: HashSet<(Option<u32>, Option<u32>)> = ctx.iter().copied().collect();
            if distinct.len() < 2 {
                continue;
            }
            let places = readers
                .iter()
                .zip(&ctx)
                .map(|(&n, (up, down))| {
                    down.or(*up)
                        .and_then(|v| {
                            crate::report::layer_key(&p.values[v as usize].name).map(|(k, _)| k)
                        })
                        .unwrap_or_else(|| p.nodes[n].name.clone())
                })
                .collect();
            let constant = prm.data.as_ref().and_then(|d| {
                let v = d.to_f64_vec();
                (!v.is_empty() && v.iter().all(|&x| x == v[0])).then(|| v[0])
            });
            out.push(Merged {
                name: p.value(prm.value).name.clone(),
                read_as: format!("{op} input {slot}"),
                readers: readers.iter().map(|&n| p.nodes[n].name.clone()).collect(),
                places,
                constant,
            });
            break;
        }
    }
    out
}

/// `--untie NAME`: every node that reads parameter `name`, but the first, reads a copy of
/// its own (a new parameter with the same data, named `NAME.1`, `NAME.2`, ...). Returns the
/// new parameters with the node each one is read by.
pub fn untie(p: &mut Program, name: &str) -> Result<Vec<(String, String)>, String> {
    let v = p
        .find_value(name)
        .ok_or_else(|| format!("--untie {name}: the model has no value `{name}`"))?;
    let prm = p
        .params
        .iter()
        .find(|x| x.value == v)
        .ok_or_else(|| format!("--untie {name}: `{name}` is not a parameter of the model"))?
        .clone();
    let users = p.users()[v.index()].clone();
    if users.len() < 2 {
        return Err(format!(
            "--untie {name}: `{name}` is read by {} node(s); there is nothing to untie",
            users.len()
        ));
    }
    let ty = p.ty(v).clone();
    let mut names = hzp_ir::NameSet::from_program(p);
    let mut made = Vec::new();
    for &u in &users[1..] {
        let new_name = names.fresh(name);
        let nv = p.add_param(new_name.clone(), ty.clone(), prm.data.clone());
        for i in p.nodes[u.index()].inputs.iter_mut() {
            if *i == v {
                *i = nv;
            }
        }
        made.push((new_name, p.nodes[u.index()].name.clone()));
    }
    hzp_ir::verify(p).map_err(|e| format!("--untie produced an invalid program: {e}"))?;
    Ok(made)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hzp_ir::{BinaryOp, DType, Tensor, TensorType};

    /// Two "layers": x -> (* g) -> @ w1 -> (* g) -> @ w2, with `g` one all-ones [4] tensor
    /// read as each layer's norm scale (an exporter's merge), and `h` an all-ones [4] tensor
    /// of its own read by one more Mul (equal to `g`, but a constant: no tie to report).
    fn program() -> Program {
        let mut p = Program::new("t");
        let x = p.add_input("x", TensorType::new(DType::F32, vec![2, 4]));
        let ones = || Some(Tensor::f32(vec![4], vec![1.0; 4]));
        let g = p.add_param("g", TensorType::new(DType::F32, vec![4]), ones());
        let h = p.add_param("h", TensorType::new(DType::F32, vec![4]), ones());
        let w = |i: usize| {
            Some(Tensor::f32(
                vec![4, 4],
                (0..16).map(|k| (k * (i + 1)) as f32 * 0.1).collect(),
            ))
        };
        let w1 = p.add_param("w1", TensorType::new(DType::F32, vec![4, 4]), w(1));
        let w2 = p.add_param("w2", TensorType::new(DType::F32, vec![4, 4]), w(2));
        let mul = Op::Binary(BinaryOp::Mul);
        let a = p
            .add_node("l0/norm", mul.clone(), vec![x, g], vec!["a".into()])
            .unwrap()[0];
        let b = p
            .add_node("l0/mm", Op::MatMul, vec![a, w1], vec!["b".into()])
            .unwrap()[0];
        let c = p
            .add_node("l1/norm", mul.clone(), vec![b, g], vec!["c".into()])
            .unwrap()[0];
        let d = p
            .add_node("l1/mm", Op::MatMul, vec![c, w2], vec!["d".into()])
            .unwrap()[0];
        let e = p
            .add_node("out/scale", mul, vec![d, h], vec!["e".into()])
            .unwrap()[0];
        p.outputs.push(e);
        p
    }

    #[test]
    fn merged_norm_scale_is_found_and_constants_are_no_ties() {
        let p = program();
        let m = merged_initializers(&p);
        assert_eq!(m.len(), 1, "{m:?}");
        assert_eq!(m[0].name, "g");
        assert_eq!(m[0].read_as, "Mul input 1");
        assert_eq!(m[0].readers, vec!["l0/norm", "l1/norm"]);
        assert_eq!(m[0].constant, Some(1.0));
        // `g` and `h` are equal (all ones) but say nothing about a weight stored twice
        assert!(find_ties(&p).is_empty(), "{:?}", find_ties(&p));
    }

    #[test]
    fn untie_gives_each_reader_its_own_parameter() {
        let mut p = program();
        let made = untie(&mut p, "g").unwrap();
        assert_eq!(made, vec![("g.1".to_string(), "l1/norm".to_string())]);
        let users = p.users();
        for name in ["g", "g.1"] {
            let v = p.find_value(name).unwrap();
            assert_eq!(users[v.index()].len(), 1, "`{name}`");
            assert_eq!(
                p.param(v).unwrap().data.as_ref().unwrap().to_f32_vec(),
                vec![1.0; 4]
            );
        }
        assert!(merged_initializers(&p).is_empty());
        assert!(untie(&mut p, "h").unwrap_err().contains("nothing to untie"));
        assert!(untie(&mut p, "x").unwrap_err().contains("not a parameter"));
    }
}
