//! The error every executor gives.

/// Why a plan cannot run, or a step failed. Messages use the plan's names.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExecError {
    #[error("the plan cannot run: {0}")]
    Plan(String),
    #[error("{0}")]
    Params(String),
    #[error("{0}")]
    Inputs(String),
    #[error("step {step}, rank {rank}, node `{node}` ({op}): {message}")]
    Node {
        step: usize,
        rank: usize,
        node: String,
        op: &'static str,
        message: String,
    },
    #[error("{0}")]
    Run(String),
    /// A wait longer than the collective timeout (the message names the ranks and the
    /// collective).
    #[error("{0}")]
    Timeout(String),
}
