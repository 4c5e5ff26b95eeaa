//! Node roles: what a node does in a training step.
//!
//! The pass that emits a node sets its [`Role`]; every later consumer (collective bucketing,
//! prefetch scheduling, the planner's activation estimate, the memory report's buffer kinds,
//! the simulator's model FLOPs) reads the role, never the node's name. Names are for people
//! and may change freely.
//!
//! A role is a kind and a *unit*: the group of nodes the kind applies to, e.g. the gather of
//! `mb0.fwd.3` (micro-batch 0, forward, layer 3) or the reduction of `mb1.h.2`. Collectives
//! of one kind and unit may be bucketed together; those of different units never are.
//!
//! In the text form a role follows the node's name and stream: `role=gather("mb0.fwd.3")`,
//! or `role=loss` when the unit is empty. Compute nodes (the default) print nothing.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The kind of work a node does.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub enum RoleKind {
    /// The model's forward and backward computation (the default).
    #[default]
    Compute,
    /// A forward node computed again in the backward (activation checkpointing). Its FLOPs
    /// are hardware work, not model work.
    Recompute,
    /// The loss and, on several ranks, the global loss (mean over ranks and micro-batches).
    Loss,
    /// Gathering a unit's parameters before use: casts, all-gathers and reshapes.
    Gather,
    /// Reducing gradients: flattening, casts, reduce-scatters, all-reduces, sparse row
    /// exchange.
    Reduce,
    /// Adding reduced gradients of micro-batches into their accumulators.
    Accumulate,
    /// Gradient clipping and the optimizer update (moments, step counter, master weights).
    Optimizer,
    /// Rebuilding compute-precision parameter shards from updated master shards.
    Regather,
}

impl RoleKind {
    pub const ALL: [RoleKind; 8] = [
        RoleKind::Compute,
        RoleKind::Recompute,
        RoleKind::Loss,
        RoleKind::Gather,
        RoleKind::Reduce,
        RoleKind::Accumulate,
        RoleKind::Optimizer,
        RoleKind::Regather,
    ];

    /// The word used in the text form.
    pub fn name(self) -> &'static str {
        match self {
            RoleKind::Compute => "compute",
            RoleKind::Recompute => "recompute",
            RoleKind::Loss => "loss",
            RoleKind::Gather => "gather",
            RoleKind::Reduce => "reduce",
            RoleKind::Accumulate => "accumulate",
            RoleKind::Optimizer => "optimizer",
            RoleKind::Regather => "regather",
        }
    }

    pub fn from_name(s: &str) -> Option<RoleKind> {
        RoleKind::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// A node's role: its kind and the unit it belongs to (empty when the kind has no units).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Role {
    pub kind: RoleKind,
    pub unit: String,
}

impl Role {
    pub fn new(kind: RoleKind, unit: impl Into<String>) -> Role {
        Role {
            kind,
            unit: unit.into(),
        }
    }

    /// A role without a unit.
    pub fn of(kind: RoleKind) -> Role {
        Role::new(kind, String::new())
    }

    pub fn is_compute(&self) -> bool {
        self.kind == RoleKind::Compute && self.unit.is_empty()
    }
}

impl fmt::Display for Role {
    /// `gather("mb0.fwd.3")`, or `loss` without a unit.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind.name())?;
        if !self.unit.is_empty() {
            write!(f, "({:?})", self.unit)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for k in RoleKind::ALL {
            assert_eq!(RoleKind::from_name(k.name()), Some(k));
            assert!(seen.insert(k.name()));
        }
        assert_eq!(RoleKind::from_name("gathers"), None);
        assert_eq!(
            Role::new(RoleKind::Gather, "mb0.fwd.3").to_string(),
            "gather(\"mb0.fwd.3\")"
        );
        assert_eq!(Role::of(RoleKind::Loss).to_string(), "loss");
        assert!(Role::default().is_compute());
        assert!(!Role::new(RoleKind::Compute, "x").is_compute());
    }
}
