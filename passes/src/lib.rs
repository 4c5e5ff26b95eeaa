//! hzp's compiler passes, in layers (each folder uses only the ones above it):
//!
//! - [`emit`], [`report`]: building nodes with names and roles; program summaries;
//! - [`cost`]: the modeled cluster ([`cost::cluster`]) and the analytical cost model;
//! - [`train`]: the single-rank training step (loss, autodiff, optimizer, precision);
//! - [`dist`]: collective insertion, rewriting and streams (single rank -> SPMD step);
//! - [`plan`]: memory planning, plan verification and the sharding planner;
//! - [`simulate`]: the discrete-event simulator and its SVG timeline;
//! - [`compile`]: the driver that runs them in order ([`compile::compile_plan`]).

pub mod compile;
pub mod cost;
pub mod dist;
pub mod emit;
pub mod plan;
pub mod report;
pub mod simulate;
pub mod train;
