//! hzp's runtime: CPU kernels, the program evaluator and trainer, the plan executor with
//! its in-process communicators, the lockstep reference runner, and the CUDA backend. Both
//! backends implement [`executor::PlanExecutor`], the contract `hzp run`'s step loop drives;
//! [`backend::Backend`] opens them for the conformance suite.

pub mod backend;
pub mod checkpoint;
pub mod comm;
/// CUDA + NCCL backend: probing, rendezvous and lowering always; the executor with `cuda`.
pub mod cuda;
pub mod exec;
pub mod executor;
pub mod reference;
pub mod schedule;
pub mod train;
pub mod watchdog;

/// The CPU kernels, the evaluator, its fusion and the index checks live in `hzp-kernels`
/// (which the importer uses without the runtime); re-exported here under their old paths.
pub use hzp_kernels::{cpu, eval, fuse, index_check};
