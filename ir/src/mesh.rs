//! Hierarchical device meshes and the groups collectives run on.

use serde::{Deserialize, Serialize};
use std::fmt;

/// One named mesh axis (e.g. `node=16`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MeshAxis {
    pub name: String,
    pub size: usize,
}

/// A data-parallel world as named axes, outermost first, innermost (fastest links) last.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Mesh {
    pub axes: Vec<MeshAxis>,
}

impl Mesh {
    /// Parses `node=16,gpu=8`. An axis may be split: `gpu=2x4` becomes `gpu.0=2,gpu.1=4`.
    pub fn parse(s: &str) -> Result<Mesh, String> {
        let mut axes = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, size) = part.split_once('=').ok_or_else(|| {
                format!("mesh axis `{part}` must look like NAME=SIZE (e.g. gpu=8)")
            })?;
            let name = name.trim();
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
            {
                return Err(format!("mesh axis name `{name}` must be alphanumeric"));
            }
            let factors: Vec<&str> = size.split('x').collect();
            let mut parsed = Vec::new();
            for f in &factors {
                let n: usize = f.trim().parse().map_err(|_| {
                    format!("mesh axis `{name}` has size `{size}`, which is not a positive integer (or AxB split)")
                })?;
                if n == 0 {
                    return Err(format!("mesh axis `{name}` has size 0"));
                }
                parsed.push(n);
            }
            if parsed.len() == 1 {
                axes.push(MeshAxis {
                    name: name.to_string(),
                    size: parsed[0],
                });
            } else {
                for (i, n) in parsed.into_iter().enumerate() {
                    axes.push(MeshAxis {
                        name: format!("{name}.{i}"),
                        size: n,
                    });
                }
            }
        }
        if axes.is_empty() {
            return Err("mesh is empty: give at least one axis, e.g. gpu=8".into());
        }
        for (i, a) in axes.iter().enumerate() {
            if axes[..i].iter().any(|b| b.name == a.name) {
                return Err(format!("mesh axis `{}` appears twice", a.name));
            }
        }
        let mesh = Mesh { axes };
        mesh.check_size()?;
        Ok(mesh)
    }

    /// The most ranks a mesh may have (a plan for more is not something hzp can build or
    /// check in reasonable time and memory).
    pub const MAX_RANKS: usize = 1 << 20;

    /// Checks that the product of the axis sizes is at most [`Mesh::MAX_RANKS`] (computed
    /// without overflow).
    pub fn check_size(&self) -> Result<(), String> {
        let mut n: usize = 1;
        for a in &self.axes {
            if a.size == 0 {
                return Err(format!("mesh axis `{}` has size 0", a.name));
            }
            n = match n.checked_mul(a.size) {
                Some(n) if n <= Self::MAX_RANKS => n,
                _ => {
                    return Err(format!(
                    "mesh {self} has more than {} ranks (the product of its axis sizes), the limit",
                    Self::MAX_RANKS
                ))
                }
            };
        }
        Ok(())
    }

    /// Total number of ranks.
    pub fn world_size(&self) -> usize {
        self.axes.iter().map(|a| a.size).product()
    }

    pub fn axis(&self, name: &str) -> Option<&MeshAxis> {
        self.axes.iter().find(|a| a.name == name)
    }

    /// Size of a group: product of its axes' sizes; `None` if an axis is not in the mesh.
    pub fn group_size(&self, group: &Group) -> Option<usize> {
        group.axes.iter().try_fold(1usize, |acc, n| {
            self.axis(n).and_then(|a| acc.checked_mul(a.size))
        })
    }

    /// [`Self::group_size`] for a group already checked against the mesh (1 otherwise: the
    /// passes that use it take groups built from the mesh's own axes).
    pub fn size_of(&self, group: &Group) -> usize {
        self.group_size(group).unwrap_or(1)
    }
}

impl Mesh {
    /// A rank's coordinate on each axis; ranks are numbered row-major, outermost axis first.
    pub fn coords(&self, rank: usize) -> Vec<usize> {
        let mut c = vec![0; self.axes.len()];
        let mut r = rank;
        for (i, a) in self.axes.iter().enumerate().rev() {
            c[i] = r % a.size;
            r /= a.size;
        }
        c
    }

    /// The rank with these coordinates.
    pub fn rank_of(&self, coords: &[usize]) -> usize {
        self.axes
            .iter()
            .zip(coords)
            .fold(0, |acc, (a, &c)| acc * a.size + c)
    }

    /// A rank's index within `group`: mixed radix over the group's axes in the order the
    /// group lists them (the first listed is the most significant). This order is the
    /// order in which collectives concatenate and split shards.
    pub fn group_index(&self, group: &Group, rank: usize) -> Option<usize> {
        let c = self.coords(rank);
        group.axes.iter().try_fold(0usize, |acc, name| {
            let i = self.axes.iter().position(|a| &a.name == name)?;
            Some(acc * self.axes[i].size + c[i])
        })
    }

    /// The ranks of `rank`'s group (those that differ from it only on the group's axes),
    /// ordered by [`Mesh::group_index`].
    pub fn group_members(&self, group: &Group, rank: usize) -> Option<Vec<usize>> {
        let n = self.group_size(group)?;
        let idx: Vec<usize> = group
            .axes
            .iter()
            .map(|name| self.axes.iter().position(|a| &a.name == name))
            .collect::<Option<_>>()?;
        let base = self.coords(rank);
        let mut out = Vec::with_capacity(n);
        for k in 0..n {
            let mut c = base.clone();
            let mut rem = k;
            for &i in idx.iter().rev() {
                c[i] = rem % self.axes[i].size;
                rem /= self.axes[i].size;
            }
            out.push(self.rank_of(&c));
        }
        Some(out)
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, a) in self.axes.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}={}", a.name, a.size)?;
        }
        Ok(())
    }
}

/// A set of mesh axes. The ranks of a rank's group are those that differ from it only in
/// these axes, so one SPMD program describes every rank.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Group {
    pub axes: Vec<String>,
}

impl Group {
    pub fn new<S: Into<String>>(axes: impl IntoIterator<Item = S>) -> Group {
        Group {
            axes: axes.into_iter().map(Into::into).collect(),
        }
    }

    /// The axes of `self` that `other` lacks, in `self`'s order.
    pub fn minus(&self, other: &Group) -> Group {
        Group::new(
            self.axes
                .iter()
                .filter(|x| !other.axes.contains(x))
                .cloned(),
        )
    }

    /// Whether every axis of `self` is one of `other`'s.
    pub fn is_subset_of(&self, other: &Group) -> bool {
        self.axes.iter().all(|x| other.axes.contains(x))
    }
}

impl fmt::Display for Group {
    /// `[node,gpu]`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}]", self.axes.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_nested_and_split_axes() {
        let m = Mesh::parse("node=16,gpu=2x4").unwrap();
        assert_eq!(m.world_size(), 128);
        assert_eq!(m.to_string(), "node=16,gpu.0=2,gpu.1=4");
        assert_eq!(m.group_size(&Group::new(["gpu.0", "gpu.1"])), Some(8));
        assert_eq!(m.group_size(&Group::new(["tpu"])), None);
    }

    #[test]
    fn group_members_follow_the_listed_axis_order() {
        let m = Mesh::parse("node=2,gpu=4").unwrap();
        assert_eq!(m.coords(6), vec![1, 2]);
        assert_eq!(m.rank_of(&[1, 2]), 6);
        // gpu-major order over [gpu, node]: index = gpu * 2 + node
        let g = Group::new(["gpu", "node"]);
        assert_eq!(m.group_index(&g, 6), Some(5));
        assert_eq!(
            m.group_members(&g, 6).unwrap(),
            vec![0, 4, 1, 5, 2, 6, 3, 7]
        );
        assert_eq!(
            m.group_members(&Group::new(["gpu"]), 5).unwrap(),
            vec![4, 5, 6, 7]
        );
        assert_eq!(
            m.group_members(&Group::new(Vec::<String>::new()), 5)
                .unwrap(),
            vec![5]
        );
    }

    #[test]
    fn rejects_bad_meshes() {
        for bad in ["", "gpu", "gpu=0", "gpu=x", "gpu=2,gpu=2", "g u=2"] {
            assert!(Mesh::parse(bad).is_err(), "{bad}");
        }
    }
}
