//! hzp's runtime: CPU kernels, the program evaluator and trainer, the plan executor with
//! its in-process communicators, the lockstep reference runner, and the CUDA backend; the
//! [`backend::Backend`] trait puts the CPU and CUDA executors behind one interface.

pub mod backend;
pub mod checkpoint;
pub mod comm;
pub mod cpu;
/// CUDA + NCCL backend: probing, rendezvous and lowering always; the executor with `cuda`.
pub mod cuda;
pub mod eval;
pub mod exec;
pub mod fuse;
pub mod index_check;
pub mod reference;
pub mod schedule;
pub mod train;
pub mod watchdog;
