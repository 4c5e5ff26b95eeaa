//! hzp's runtime: CPU kernels and the program evaluator (later: the plan executor,
//! communicators and the CUDA backend).

pub mod checkpoint;
pub mod comm;
pub mod cpu;
/// CUDA + NCCL backend: probing, rendezvous and lowering always; the executor with `cuda`.
pub mod cuda;
pub mod eval;
pub mod exec;
pub mod fuse;
pub mod index_check;
pub mod schedule;
pub mod spmd;
pub mod train;
pub mod watchdog;
