//! hzp's compiler passes.

pub mod summary;
