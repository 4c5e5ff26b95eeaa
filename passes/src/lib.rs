//! hzp's compiler passes.

pub mod autodiff;
pub mod cluster;
pub mod cost;
pub mod emit;
pub mod memory;
pub mod shard_plan;
pub mod spmd;
pub mod summary;
pub mod ties;
pub mod train;
pub mod verify_plan;
