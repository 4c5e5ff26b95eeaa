//! CPU kernels, one per op (being written).

use hzp_ir::{Op, Tensor};

/// Runs one op on concrete tensors. Errors say which op and why (never panic on bad data).
pub fn eval_op(op: &Op, inputs: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let _ = inputs;
    Err(format!("no CPU kernel for {} yet", op.name()))
}
