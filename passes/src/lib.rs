//! hzp's compiler passes.

pub mod autodiff;
pub mod cluster;
pub mod cost;
pub mod emit;
pub mod summary;
pub mod ties;
pub mod train;
