//! hzp's compiler passes.

pub mod autodiff;
pub mod cluster;
pub mod cost;
pub mod emit;
pub mod memory;
pub mod summary;
pub mod ties;
pub mod train;
pub mod spmd;
pub mod verify_plan;
pub mod shard_plan;
