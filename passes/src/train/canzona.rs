//! Canzona placement of Muon's Newton-Schulz work (`--muon-placement canzona`): each Muon
//! matrix gets ONE owner rank in the optimizer group O, which orthogonalizes it whole; the
//! owners come from a static, load-balanced partition (after Canzona, "A Unified,
//! Asynchronous, and Load-Balanced Framework for Distributed Matrix-based Optimizers",
//! 2026: whole matrices, owners chosen so every rank's optimizer work is even).
//!
//! A plan is one program every rank runs with the same shapes, so hzp uses the
//! *uniform-slot* form: the matrices are grouped into buckets of one shape up to a
//! transpose (GPT-2's `c_fc` `[768, 3072]` and `c_proj` `[3072, 768]` share one: the
//! Newton-Schulz of `Xᵀ` is that of `X` transposed, and Muon orthogonalizes a tall matrix
//! as its transpose anyway); a bucket of `L` matrices over `o` ranks has `ceil(L / o)` slots
//! on every rank and each rank orthogonalizes its slots as one batched Newton-Schulz
//! (`[slots, rows, cols]`). A bucket takes the orientation most of its matrices are stored
//! in (the wide one on a tie); the others are [`Bucket::flipped`]: their owner transposes
//! them on arrival and back before returning the shards.
//! Every rank owns `floor(L / o)` matrices of the bucket; the `L mod o` remaining ones go,
//! over all buckets together, by greedy LPT (largest Newton-Schulz cost first, to the rank
//! with the least assigned cost so far; ties to the lowest rank): the rank loads of useful
//! work are balanced. The other slots are padding (zero matrices) that every rank still
//! runs: [`Partition::executed_flops`] is what each rank computes,
//! [`Partition::useful_flops`] what its owned matrices need.

use crate::train::muon_matrix::MuonMatrix;
use std::collections::{BTreeMap, BTreeSet};

/// One bucket: matrices of one shape up to a transpose.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// The shape the bucket's Newton-Schulz runs on.
    pub rows: usize,
    pub cols: usize,
    /// The matrices stored as `[cols, rows]` (transposed on their owner).
    pub flipped: BTreeSet<String>,
    /// Slots per rank: `ceil(len / o)`.
    pub slots: usize,
    /// `grid[r][t]`: the matrix rank `r` orthogonalizes in slot `t` (None: padding).
    pub grid: Vec<Vec<Option<String>>>,
    /// Multiply-add FLOPs of one Newton-Schulz run on one matrix of the bucket.
    pub flops_each: u64,
}

/// The owners of every Muon matrix over `o` ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    pub o: usize,
    /// Buckets by shape (the shorter side, then the longer), ascending.
    pub buckets: Vec<Bucket>,
}

impl Partition {
    /// Each matrix's owner rank and slot: name -> (bucket index, rank, slot).
    pub fn owners(&self) -> BTreeMap<String, (usize, usize, usize)> {
        let mut out = BTreeMap::new();
        for (b, bucket) in self.buckets.iter().enumerate() {
            for (r, row) in bucket.grid.iter().enumerate() {
                for (t, m) in row.iter().enumerate() {
                    if let Some(m) = m {
                        out.insert(m.clone(), (b, r, t));
                    }
                }
            }
        }
        out
    }

    /// Newton-Schulz FLOPs of the matrices each rank owns.
    pub fn useful_flops(&self) -> Vec<u64> {
        let mut out = vec![0u64; self.o];
        for b in &self.buckets {
            for (r, row) in b.grid.iter().enumerate() {
                out[r] += row.iter().filter(|m| m.is_some()).count() as u64 * b.flops_each;
            }
        }
        out
    }

    /// Newton-Schulz FLOPs every rank runs (all slots, padding included).
    pub fn executed_flops(&self) -> u64 {
        self.buckets
            .iter()
            .map(|b| b.slots as u64 * b.flops_each)
            .sum()
    }

    /// Max over mean of [`Partition::useful_flops`] (1.0 is perfect balance).
    pub fn imbalance(&self) -> f64 {
        let u = self.useful_flops();
        let total: u64 = u.iter().sum();
        if total == 0 {
            return 1.0;
        }
        let mean = total as f64 / self.o as f64;
        *u.iter().max().unwrap_or(&0) as f64 / mean
    }

    /// Lines for `hzp inspect` and notes.
    pub fn describe(&self) -> Vec<String> {
        let useful = self.useful_flops();
        let total: u64 = useful.iter().sum();
        let exec = self.executed_flops();
        let mut out = vec![format!(
            "muon placement canzona over {} ranks: {} buckets; Newton-Schulz FLOPs per rank \
             (owned matrices) max {} mean {} imbalance max/mean {:.4}; every rank runs {} \
             (uniform slots, {:.1}% padding)",
            self.o,
            self.buckets.len(),
            useful.iter().max().copied().unwrap_or(0),
            total / self.o.max(1) as u64,
            self.imbalance(),
            exec,
            if exec == 0 {
                0.0
            } else {
                100.0 * (1.0 - total as f64 / (exec as f64 * self.o as f64))
            }
        )];
        for b in &self.buckets {
            let n = b.grid.iter().flatten().filter(|m| m.is_some()).count();
            let flipped = if b.flipped.is_empty() {
                String::new()
            } else {
                format!(" ({} stored {}x{})", b.flipped.len(), b.cols, b.rows)
            };
            out.push(format!(
                "  bucket {}x{}: {} matrices{flipped}, {} slots per rank, {} FLOPs each",
                b.rows, b.cols, n, b.slots, b.flops_each
            ));
        }
        for (r, f) in useful.iter().enumerate() {
            let owned: Vec<&str> = self
                .buckets
                .iter()
                .flat_map(|b| b.grid[r].iter().flatten().map(|s| s.as_str()))
                .collect();
            out.push(format!("  rank {r}: {f} FLOPs: {}", owned.join(", ")));
        }
        out
    }
}

/// The partition of `matrices` (by name; a `BTreeMap`, so the order is the names') over `o`
/// ranks, with `steps` Newton-Schulz steps. Deterministic: same input, same partition.
pub fn partition(matrices: &BTreeMap<String, MuonMatrix>, o: usize, steps: usize) -> Partition {
    let o = o.max(1);
    // by (shorter side, longer side): (name, cost, stored tall)
    type Members = Vec<(String, u64, bool)>;
    let mut by_shape: BTreeMap<(usize, usize), Members> = BTreeMap::new();
    for (name, m) in matrices {
        by_shape
            .entry((m.rows.min(m.cols), m.rows.max(m.cols)))
            .or_default()
            .push((name.clone(), m.ns_flops(steps), m.rows > m.cols));
    }
    let mut buckets: Vec<Bucket> = Vec::new();
    // the remainder matrices of every bucket: (cost, bucket, name)
    let mut rest: Vec<(u64, usize, String)> = Vec::new();
    for (b, ((short, long), ms)) in by_shape.into_iter().enumerate() {
        // the orientation most members are stored in (wide on a tie); the rest flip
        let tall = 2 * ms.iter().filter(|m| m.2).count() > ms.len();
        let (rows, cols) = if tall { (long, short) } else { (short, long) };
        let flipped: BTreeSet<String> = ms
            .iter()
            .filter(|m| short != long && m.2 != tall)
            .map(|m| m.0.clone())
            .collect();
        let ms: Vec<(String, u64)> = ms.into_iter().map(|(n, c, _)| (n, c)).collect();
        let flops_each = ms.first().map(|m| m.1).unwrap_or(0);
        let slots = ms.len().div_ceil(o);
        let full = ms.len() / o;
        let mut grid = vec![vec![None; slots]; o];
        let mut it = ms.into_iter();
        // the first `full` slots of every rank, rank-major
        for row in grid.iter_mut() {
            for slot in row.iter_mut().take(full) {
                *slot = it.next().map(|m| m.0);
            }
        }
        rest.extend(it.map(|(name, c)| (c, b, name)));
        buckets.push(Bucket {
            rows,
            cols,
            flipped,
            slots,
            grid,
            flops_each,
        });
    }
    // greedy LPT over the remainders: largest first (ties: bucket, then name), each to the
    // rank with the least load that has no remainder of that bucket yet (ties: lowest rank)
    let mut load: Vec<u64> = vec![0; o];
    for b in &buckets {
        for (r, row) in b.grid.iter().enumerate() {
            load[r] += row.iter().filter(|m| m.is_some()).count() as u64 * b.flops_each;
        }
    }
    rest.sort_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    for (c, b, name) in rest {
        let last = buckets[b].slots - 1;
        let r = (0..o)
            .filter(|&r| buckets[b].grid[r][last].is_none())
            .min_by_key(|&r| (load[r], r))
            .expect("a bucket's remainder is fewer than its ranks");
        buckets[b].grid[r][last] = Some(name);
        load[r] += c;
    }
    Partition { o, buckets }
}

/// The partition a compiled plan runs, when it was compiled with Canzona placement (its
/// program has nodes of role unit [`crate::train::CANZONA_UNIT`]): recomputed with
/// [`partition`] from what the plan records, the layouts of the parameters that keep a
/// Muon momentum (names and shapes) and the size of their optimizer group, the same inputs
/// the builder partitioned (the builder's 5 Newton-Schulz steps). `None` otherwise.
pub fn of_plan(plan: &hzp_ir::plan::Plan) -> Option<Partition> {
    let unit = crate::train::CANZONA_UNIT;
    if !plan.program.nodes.iter().any(|n| n.role.unit == unit) {
        return None;
    }
    let mut o = None;
    let mut ms = BTreeMap::new();
    for l in &plan.layouts {
        if l.shape.len() != 2 || !l.states.iter().any(|s| s.starts_with("muon.momentum/")) {
            continue;
        }
        o = plan.mesh.group_size(&l.optim_group);
        ms.insert(
            l.name.clone(),
            MuonMatrix {
                rows: l.shape[0],
                cols: l.shape[1],
                out_features: l.shape[0],
                in_features: l.shape[1],
            },
        );
    }
    Some(partition(&ms, o?, 5))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mat(rows: usize, cols: usize) -> MuonMatrix {
        MuonMatrix {
            rows,
            cols,
            out_features: cols,
            in_features: rows,
        }
    }

    /// GPT-2 small's Muon matrices (12 layers, d = 768; Conv1D weights stored [in, out]).
    pub(crate) fn gpt2_small() -> BTreeMap<String, MuonMatrix> {
        let mut m = BTreeMap::new();
        for l in 0..12 {
            m.insert(format!("h.{l}.attn.c_attn.weight"), mat(768, 2304));
            m.insert(format!("h.{l}.attn.c_proj.weight"), mat(768, 768));
            m.insert(format!("h.{l}.mlp.c_fc.weight"), mat(768, 3072));
            m.insert(format!("h.{l}.mlp.c_proj.weight"), mat(3072, 768));
        }
        m
    }

    #[test]
    fn every_matrix_has_one_owner_and_slots_are_uniform() {
        let ms = gpt2_small();
        for o in [1, 2, 3, 4, 5, 8, 16, 64] {
            let p = partition(&ms, o, 5);
            let owners = p.owners();
            assert_eq!(owners.len(), ms.len(), "o={o}");
            for b in &p.buckets {
                assert_eq!(b.grid.len(), o);
                assert!(b.grid.iter().all(|r| r.len() == b.slots));
                let n = b.grid.iter().flatten().filter(|m| m.is_some()).count();
                assert_eq!(b.slots, n.div_ceil(o));
                // every rank owns floor or ceil of the bucket's share
                for r in &b.grid {
                    let k = r.iter().filter(|m| m.is_some()).count();
                    assert!(k == n / o || k == n.div_ceil(o));
                }
            }
            let total: u64 = ms.values().map(|m| m.ns_flops(5)).sum();
            assert_eq!(p.useful_flops().iter().sum::<u64>(), total);
        }
    }

    /// A shape and its transpose share a bucket in the orientation most of them are stored
    /// in; GPT-2 small's c_fc and mlp.c_proj fill 3 slots over 8 ranks with no padding.
    #[test]
    fn a_shape_and_its_transpose_share_a_bucket() {
        let p = partition(&gpt2_small(), 8, 5);
        let shapes: Vec<(usize, usize, usize, usize)> = p
            .buckets
            .iter()
            .map(|b| (b.rows, b.cols, b.slots, b.flipped.len()))
            .collect();
        assert_eq!(
            shapes,
            vec![(768, 768, 2, 0), (768, 2304, 2, 0), (768, 3072, 3, 12)]
        );
        let mixed = &p.buckets[2];
        assert!(mixed
            .flipped
            .iter()
            .all(|n| n.ends_with("mlp.c_proj.weight")));
        assert!(
            mixed.grid.iter().flatten().all(|m| m.is_some()),
            "padding left"
        );
        // 2 tall and 1 wide: the bucket is tall, the wide one flips; a square never flips
        let mut ms = BTreeMap::new();
        ms.insert("a".to_string(), mat(6, 4));
        ms.insert("b".to_string(), mat(6, 4));
        ms.insert("c".to_string(), mat(4, 6));
        ms.insert("d".to_string(), mat(5, 5));
        let p = partition(&ms, 2, 5);
        let b = p.buckets.iter().find(|b| b.rows * b.cols == 24).unwrap();
        assert_eq!((b.rows, b.cols), (6, 4));
        assert_eq!(b.flipped.iter().collect::<Vec<_>>(), vec!["c"]);
        assert!(p
            .buckets
            .iter()
            .all(|b| b.rows != 5 || b.flipped.is_empty()));
        assert!(p
            .describe()
            .iter()
            .any(|l| l.contains("3 matrices (1 stored 4x6)")));
    }

    #[test]
    fn deterministic_and_balanced() {
        let ms = gpt2_small();
        let a = partition(&ms, 8, 5);
        // the same input in another insertion order gives the same partition
        let mut other = BTreeMap::new();
        for (k, v) in ms.iter().rev() {
            other.insert(k.clone(), v.clone());
        }
        assert_eq!(a, partition(&other, 8, 5));
        // three jobs of 3, 3, 2 over 2 ranks: LPT puts 3 and 3 apart, 2 on rank 0
        let mut small = BTreeMap::new();
        small.insert("a".to_string(), mat(4, 6));
        small.insert("b".to_string(), mat(4, 6));
        small.insert("c".to_string(), mat(4, 4));
        let p = partition(&small, 2, 5);
        let u = p.useful_flops();
        let (big, little) = (mat(4, 6).ns_flops(5), mat(4, 4).ns_flops(5));
        assert_eq!(u, vec![big + little, big]);
    }

    /// GPT-2 small over 8 ranks: the imbalance of the owned Newton-Schulz work, against
    /// Graham's bound for greedy LPT (makespan <= (4/3 - 1/(3m)) OPT, Graham 1969; the mean
    /// load is at most OPT, so max/mean within the bound implies the LPT guarantee).
    #[test]
    fn gpt2_small_over_8_ranks_is_within_the_lpt_bound() {
        let p = partition(&gpt2_small(), 8, 5);
        for l in p.describe() {
            println!("{l}");
        }
        let bound = 4.0 / 3.0 - 1.0 / 24.0;
        let imb = p.imbalance();
        println!("imbalance {imb:.4} (bound {bound:.4})");
        assert!(imb <= bound, "imbalance {imb} above {bound}");
        assert!(imb < 1.05, "imbalance {imb}");
    }
}
