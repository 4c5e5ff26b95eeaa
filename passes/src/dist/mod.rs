//! The distributed half of the compiler: from a single-rank training step to the per-rank
//! (SPMD) step of a plan.
//!
//! - [`spmd`]: collective insertion (gather / reduce / accumulate / re-gather around the
//!   training step, micro-batches, recompute) and the prefetch schedule;
//! - [`rewrite`]: collective rewriting and bucketing by equality saturation, costed by
//!   [`crate::cost`];
//! - [`streams`]: stream assignment and cross-stream events, shared by both;
//! - [`acco`]: the ACCO step (ZeRO-1 layout, half-batch phases whose reduction and
//!   optimizer overlap the other half's compute), built beside `spmd` from the same pieces.
//! - [`asyncmesh`]: sparse asynchronous parameter averaging across a slow axis, added to a
//!   per-replica step `spmd` built on the other axes.
//!
//! Dependencies run one way: `spmd` -> `rewrite` -> `streams`; the sharding planner
//! ([`crate::plan::planner`]) calls into `spmd`, never the reverse.

pub mod acco;
pub mod asyncmesh;
pub mod rewrite;
pub mod spmd;
pub mod streams;
