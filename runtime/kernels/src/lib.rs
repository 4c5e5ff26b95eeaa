//! hzp's CPU kernels ([`cpu`]: one kernel per op, [`cpu::eval_op`]) and the program
//! evaluator built on them ([`eval::evaluate`], with its elementwise [`fuse`]ion and the
//! [`index_check`] of integer inputs). The runtime re-exports these modules under the same
//! names; the ONNX importer folds constants with [`cpu::eval_op`] without depending on the
//! runtime.

pub mod cpu;
pub mod eval;
pub mod fuse;
pub mod index_check;
