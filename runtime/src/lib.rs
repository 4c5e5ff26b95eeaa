//! hzp's runtime: CPU kernels and the program evaluator (later: the plan executor,
//! communicators and the CUDA backend).

pub mod cpu;
pub mod eval;
pub mod fuse;
pub mod spmd;
pub mod train;
