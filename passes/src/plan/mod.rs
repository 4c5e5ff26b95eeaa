//! Planning and checking a plan: the memory planner ([`memory`]: liveness, arena offsets),
//! the plan verifier ([`verify`]), and the sharding planner ([`planner`]: shard groups,
//! micro-batches and recompute for a memory budget, ranked by the cost model).
//!
//! The planner builds candidate steps with [`crate::dist::spmd`]; nothing in `dist` calls
//! back into `plan`.

pub mod eval;
pub mod memory;
pub mod planner;
pub mod verify;
