//! The CUDA + NCCL backend of `hzp run --backend cuda`, and what it needs before a GPU:
//! library probing ([`probe`]), the torchrun-style process group ([`rendezvous`]), the kernel
//! sources ([`kernels`]) and the lowering of a plan to kernel launches, cuBLAS products and
//! NCCL collectives ([`lower`]). These build and are tested everywhere; the executor that
//! drives the GPU ([`CudaExecutor`], in `device.rs`) needs the `cuda` feature, which adds
//! cudarc with dynamic loading (building needs no CUDA; running needs the driver, NVRTC,
//! cuBLAS and, for more than one rank, NCCL: [`probe::Probe::require`] names what is missing
//! before cudarc is touched, since cudarc panics on a missing library).
//!
//! One process per GPU: `hzp launch --nproc-per-node N -- run plan.json ...` sets `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; each process
//! runs its rank of the plan ([`run_plan`]); rank 0 creates the NCCL ids and sends them to the
//! others over TCP.

pub mod kernels;
pub mod lower;
pub mod probe;
pub mod rendezvous;
pub mod transport;

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub mod local;

/// The `coll_*` kernels of the local device communicator (`kernels/collective.cu`): an
/// accumulation for every dtype, a mean's scale for every dtype but bool.
pub fn local_kernel_names() -> Vec<String> {
    let mut v = Vec::new();
    for t in ["f32", "bf16", "f16", "i64", "i32", "b8"] {
        v.push(format!("coll_acc_{t}"));
        if t != "b8" {
            v.push(format!("coll_scale_{t}"));
        }
    }
    v
}
#[cfg(feature = "cuda")]
pub use device::{compile, compile_kernels, CudaExecutor, CudaOptions};

use crate::exec::{CommMode, ExecError, StepStats};
use hzp_ir::{Plan, Tensor};
use std::time::Duration;

/// Whether this build has the CUDA executor.
pub const BUILT: bool = cfg!(feature = "cuda");

/// What [`run_plan`] gives back.
#[derive(Clone, Debug)]
pub struct CudaRunResult {
    /// This process's rank.
    pub rank: usize,
    pub steps: Vec<StepStats>,
    /// The full parameters after the last step (when asked for; every rank has them).
    pub params: Option<Vec<(String, Tensor)>>,
}

/// Runs `steps` steps of `plan` as this process's rank (from the torchrun variables; a
/// single process when none are set), step `s` (0-based) on the global batch `inputs(s)`
/// (the learning rate among them), calling `on_step` after each step. With `want_params`, gathers the full parameters at the end.
///
/// Errors: a missing library names the library and where it was looked for (before any CUDA
/// call); a plan using an op the backend does not run names the node; a build without the
/// `cuda` feature says so (after reporting missing libraries, which a user needs either way).
pub fn run_plan(
    plan: &Plan,
    full_params: &[(String, Tensor)],
    inputs: &mut dyn FnMut(usize) -> Result<Vec<(String, Tensor)>, ExecError>,
    steps: usize,
    comm: CommMode,
    want_params: bool,
    on_step: &mut dyn FnMut(usize, &StepStats),
) -> Result<CudaRunResult, ExecError> {
    let world = plan.mesh.world_size();
    let mut need = vec![
        probe::Lib::Driver,
        probe::Lib::Nvrtc,
        probe::Lib::Cublas,
        probe::Lib::CublasLt,
    ];
    if world > 1 {
        need.push(probe::Lib::Nccl);
    }
    probe::probe()
        .require(&need, "hzp run --backend cuda")
        .map_err(ExecError::Run)?;
    run_built(plan, full_params, inputs, steps, comm, want_params, on_step)
}

#[cfg(feature = "cuda")]
fn run_built(
    plan: &Plan,
    full_params: &[(String, Tensor)],
    inputs: &mut dyn FnMut(usize) -> Result<Vec<(String, Tensor)>, ExecError>,
    steps: usize,
    comm: CommMode,
    want_params: bool,
    on_step: &mut dyn FnMut(usize, &StepStats),
) -> Result<CudaRunResult, ExecError> {
    let opts = CudaOptions {
        comm,
        timeout: Duration::from_secs(300),
    };
    let mut ex = CudaExecutor::new(plan, full_params, opts)?;
    let mut out = Vec::with_capacity(steps);
    for k in 0..steps {
        ex.set_inputs(&inputs(k)?)?;
        let s = ex.step()?;
        on_step(ex.rank(), &s);
        out.push(s);
    }
    let params = if want_params {
        Some(ex.parameters()?)
    } else {
        None
    };
    Ok(CudaRunResult {
        rank: ex.rank(),
        steps: out,
        params,
    })
}

#[cfg(not(feature = "cuda"))]
fn run_built(
    _plan: &Plan,
    _full_params: &[(String, Tensor)],
    _inputs: &mut dyn FnMut(usize) -> Result<Vec<(String, Tensor)>, ExecError>,
    _steps: usize,
    _comm: CommMode,
    _want_params: bool,
    _on_step: &mut dyn FnMut(usize, &StepStats),
) -> Result<CudaRunResult, ExecError> {
    let _ = Duration::ZERO;
    Err(ExecError::Run(
        "hzp run --backend cuda: this hzp was built without the `cuda` feature; rebuild with `cargo build --release --features cuda`".into(),
    ))
}
