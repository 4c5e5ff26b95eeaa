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
