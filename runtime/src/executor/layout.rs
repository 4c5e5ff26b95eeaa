//! Full parameters cut into each rank's shards as a plan's layouts say, and put back
//! together: the same rules for every backend.

use super::error::ExecError;
use hzp_ir::{DType, Group, Mesh, ParamLayout, Program, Tensor, TensorType, ValueDef, ValueId};
use std::collections::HashMap;

/// Cuts full parameters into each rank's persistent values, as the plan's layouts say: the
/// fp32 master shard (chunk `group_index(optim_group)` of the flattened, zero-padded
/// parameter) and the compute shard state (chunk `group_index(params_group)`, in its dtype);
/// other states take their initial value (zeros when none). Returns, per rank, (value,
/// tensor) pairs.
pub fn cut_parameters(
    p: &Program,
    mesh: &Mesh,
    layouts: &[ParamLayout],
    full: &[(String, Tensor)],
) -> Result<Vec<Vec<(ValueId, Tensor)>>, ExecError> {
    let w = mesh.world_size();
    let mut out: Vec<Vec<(ValueId, Tensor)>> = vec![Vec::new(); w];
    let find = |name: &str| -> Result<&Tensor, ExecError> {
        full.iter()
            .find(|(k, _)| k == name)
            .map(|(_, t)| t)
            .ok_or_else(|| {
                ExecError::Params(format!(
                    "the parameters lack `{name}`, which the plan trains"
                ))
            })
    };
    let flat = |l: &ParamLayout, t: &Tensor| -> Result<Vec<f32>, ExecError> {
        if t.shape != l.shape {
            return Err(ExecError::Params(format!(
                "parameter `{}` is {}, the plan was compiled for {}",
                l.name,
                t.ty(),
                TensorType::new(t.dtype(), l.shape.clone())
            )));
        }
        if l.padded < l.numel || t.numel() != l.numel {
            return Err(ExecError::Params(format!(
                "the layout of `{}` does not match its shape",
                l.name
            )));
        }
        let mut v = t.to_f32_vec();
        v.resize(l.padded, 0.0);
        Ok(v)
    };
    let chunk = |v: &[f32], g: &Group, r: usize, name: &str| -> Result<Vec<f32>, ExecError> {
        let n = mesh.group_size(g).unwrap_or(1);
        let i = mesh.group_index(g, r).unwrap_or(0);
        if n == 0 || !v.len().is_multiple_of(n) {
            return Err(ExecError::Params(format!(
                "`{name}` ({} elements padded) does not split over group {g}",
                v.len()
            )));
        }
        let len = v.len() / n;
        Ok(v[i * len..(i + 1) * len].to_vec())
    };
    for prm in &p.params {
        let name = &p.value(prm.value).name;
        let l = layouts.iter().find(|l| &l.name == name).ok_or_else(|| {
            ExecError::Plan(format!("parameter `{name}` has no layout in the plan"))
        })?;
        let v = flat(l, find(name)?)?;
        let ty = p.ty(prm.value);
        for (r, dst) in out.iter_mut().enumerate() {
            let c = chunk(&v, &l.optim_group, r, name)?;
            if ty.dtype != DType::F32 || ty.shape != [c.len()] {
                return Err(ExecError::Plan(format!(
                    "master shard `{name}` is {ty}, its layout gives f32[{}]",
                    c.len()
                )));
            }
            dst.push((prm.value, Tensor::f32(vec![c.len()], c)));
        }
    }
    for st in &p.states {
        let name = &p.value(st.value).name;
        let ty = p.ty(st.value).clone();
        if let Some(l) = layouts.iter().find(|l| &l.compute_shard == name) {
            let v = flat(l, find(&l.name)?)?;
            for (r, dst) in out.iter_mut().enumerate() {
                let c: Vec<f64> = chunk(&v, &l.params_group, r, &l.name)?
                    .iter()
                    .map(|&x| x as f64)
                    .collect();
                if ty.numel() != c.len() {
                    return Err(ExecError::Plan(format!(
                        "compute shard `{name}` is {ty}, its layout gives {} elements",
                        c.len()
                    )));
                }
                dst.push((st.value, Tensor::from_f64(ty.dtype, ty.shape.clone(), &c)));
            }
        } else {
            let init = st.init.clone().unwrap_or_else(|| Tensor::zeros(&ty));
            for dst in out.iter_mut() {
                dst.push((st.value, init.clone()));
            }
        }
    }
    // A plan value that is neither: nothing to place.
    debug_assert!(p
        .values
        .iter()
        .all(|v| !matches!(v.def, ValueDef::Param) || layouts.iter().any(|l| l.name == v.name)));
    Ok(out)
}

/// Parameter `l` put back together from its shards: `whole(first)` gives it as the instance
/// of its optimizer group that holds rank `first` has it (padding cut). Where the replicas
/// differ by design (`replicas_differ`: an AsyncMesh plan), every instance of the group holds
/// one replica and the model is their mean; otherwise rank 0's instance. Shared by
/// [`parameters_from`] (every backend's full parameters).
pub fn assemble_layout<E>(
    mesh: &Mesh,
    l: &ParamLayout,
    world: usize,
    replicas_differ: bool,
    mut whole: impl FnMut(usize) -> Result<Vec<f32>, E>,
) -> Result<Vec<f32>, E> {
    if !replicas_differ {
        return whole(0);
    }
    let mut firsts: Vec<usize> = (0..world)
        .filter_map(|r| mesh.group_members(&l.optim_group, r)?.first().copied())
        .collect();
    firsts.sort_unstable();
    firsts.dedup();
    let mut sum = vec![0f64; l.numel];
    for &f in &firsts {
        for (acc, x) in sum.iter_mut().zip(whole(f)?) {
            *acc += x as f64;
        }
    }
    let n = firsts.len().max(1) as f64;
    Ok(sum.into_iter().map(|x| (x / n) as f32).collect())
}

/// The full parameters, by name, in layout order, from every rank's master shards
/// (`shards[r]`: rank r's, by name; only the ranks a parameter is assembled from are read).
pub fn parameters_from(
    mesh: &Mesh,
    layouts: &[ParamLayout],
    replicas_differ: bool,
    shards: &HashMap<usize, Vec<(String, Tensor)>>,
) -> Result<Vec<(String, Tensor)>, ExecError> {
    let world = mesh.world_size();
    layouts
        .iter()
        .map(|l| {
            let whole = |first: usize| -> Result<Vec<f32>, ExecError> {
                let members = mesh
                    .group_members(&l.optim_group, first)
                    .unwrap_or_else(|| vec![first]);
                let mut flat: Vec<f32> = Vec::with_capacity(l.padded);
                for m in members {
                    let t = shards
                        .get(&m)
                        .and_then(|s| s.iter().find(|(k, _)| *k == l.name))
                        .map(|(_, t)| t)
                        .ok_or_else(|| {
                            ExecError::Run(format!(
                                "the master shard of `{}` on rank {m} is missing",
                                l.name
                            ))
                        })?;
                    flat.extend(t.to_f32_vec());
                }
                if flat.len() < l.numel {
                    return Err(ExecError::Run(format!(
                        "the master shards of `{}` hold {} elements, the parameter has {}",
                        l.name,
                        flat.len(),
                        l.numel
                    )));
                }
                flat.truncate(l.numel);
                Ok(flat)
            };
            let flat = assemble_layout(mesh, l, world, replicas_differ, whole)?;
            Ok((l.name.clone(), Tensor::f32(l.shape.clone(), flat)))
        })
        .collect()
}
