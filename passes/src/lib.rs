//! hzp's compiler passes.

pub mod autodiff;
pub mod cluster;
pub mod compile;
pub mod cost;
pub mod emit;
pub mod memory;
pub mod muon;
pub mod rewrite;
pub mod shard_plan;
pub mod simplify;
pub mod simulate;
pub mod spmd;
pub mod summary;
pub mod svg;
pub mod ties;
pub mod train;
pub mod verify_plan;
