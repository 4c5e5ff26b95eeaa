//! The CUDA + NCCL backend of `hzp run --backend cuda`, and what it needs before a GPU:
//! library probing ([`probe`]), the torchrun-style process group ([`rendezvous`]), the kernel
//! sources ([`kernels`]) and the lowering of a plan to kernel launches, cuBLAS products and
//! NCCL collectives ([`lower`]). These build and are tested everywhere; the executor that
//! drives the GPU ([`CudaExecutor`], in `device.rs`; every rank on one GPU in `one_gpu.rs`),
//! a [`PlanExecutor`] like the CPU executor, needs the `cuda` feature, which adds
//! cudarc with dynamic loading (building needs no CUDA; running needs the driver, NVRTC,
//! cuBLAS and, for more than one rank, NCCL: [`probe::Probe::require`] names what is missing
//! before cudarc is touched, since cudarc panics on a missing library).
//!
//! One process per GPU: `hzp launch --nproc-per-node N -- run plan.json ...` sets `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; each process
//! runs its rank of the plan ([`open_process`]); rank 0 creates the NCCL ids and sends them to the
//! others over TCP.

pub mod adamw_multi;
pub mod epilogue;
pub mod fuse;
pub mod graph;
pub mod kernels;
pub mod lower;
pub mod probe;
pub mod sdpa;
/// The process group of a multi-process run (in `comm`, shared with the CPU backend).
pub use crate::comm::rendezvous;
pub mod transport;
pub mod work;

#[cfg(feature = "cuda")]
pub mod cudnn;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub mod local;
#[cfg(feature = "cuda")]
mod one_gpu;

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

use crate::executor::{CommMode, ExecError, PlanExecutor};
use hzp_ir::{Plan, Tensor};
use rendezvous::{DistEnv, Rendezvous};
use std::time::Duration;

/// Whether this build has the CUDA executor.
pub const BUILT: bool = cfg!(feature = "cuda");

/// The libraries every CUDA run needs (NCCL too when ranks are in several processes).
pub const COMPUTE_LIBS: [probe::Lib; 4] = [
    probe::Lib::Driver,
    probe::Lib::Nvrtc,
    probe::Lib::Cublas,
    probe::Lib::CublasLt,
];

/// The number of CUDA devices the driver sees (after probing that the driver library
/// loads). An error says why none can be counted: a build without `cuda`, a missing driver,
/// or a driver that fails to initialize.
pub fn gpu_count() -> Result<usize, String> {
    probe::probe().require(&[probe::Lib::Driver], "counting GPUs")?;
    gpu_count_built()
}

#[cfg(feature = "cuda")]
fn gpu_count_built() -> Result<usize, String> {
    use cudarc::driver::result as drv;
    drv::init().map_err(|e| format!("cuInit failed (no usable GPU?): {e:?}"))?;
    let n = drv::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

#[cfg(not(feature = "cuda"))]
fn gpu_count_built() -> Result<usize, String> {
    Err("this build has no CUDA backend (build with --features cuda)".into())
}

/// How the CUDA executors run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub comm: CommMode,
    /// `--collective-timeout`: the rendezvous, a communicator's set-up, a step's collectives.
    pub timeout: Duration,
    /// How the plan is lowered (`--attention`).
    pub lower: lower::LowerOptions,
    /// Capture each step into a CUDA graph after a warm-up step and replay it ([`graph`];
    /// `--no-cuda-graph` turns it off).
    pub graphs: bool,
}

/// This process's rank of `plan` on its GPU (`dist.local_rank` modulo the device count),
/// collectives over NCCL with the other processes of `rv` (`hzp launch`, torchrun, srun; a
/// group of one for a single process), as a [`PlanExecutor`].
///
/// Errors: a missing library names the library and where it was looked for (before any CUDA
/// call); a plan using an op the backend does not run names the node; a build without the
/// `cuda` feature says so (after reporting missing libraries, which a user needs either way).
pub fn open_process(
    plan: &Plan,
    full_params: &[(String, Tensor)],
    opts: &RunOptions,
    dist: &DistEnv,
    rv: &mut Rendezvous,
) -> Result<Box<dyn PlanExecutor>, ExecError> {
    let mut need = COMPUTE_LIBS.to_vec();
    if plan.mesh.world_size() > 1 {
        need.push(probe::Lib::Nccl);
    }
    probe::probe()
        .require(&need, "hzp run --backend cuda")
        .map_err(ExecError::Run)?;
    open_process_built(plan, full_params, opts, dist, rv)
}

#[cfg(feature = "cuda")]
fn open_process_built(
    plan: &Plan,
    full_params: &[(String, Tensor)],
    opts: &RunOptions,
    dist: &DistEnv,
    rv: &mut Rendezvous,
) -> Result<Box<dyn PlanExecutor>, ExecError> {
    let copts = CudaOptions {
        comm: opts.comm,
        timeout: opts.timeout,
        lower: opts.lower,
        graphs: opts.graphs,
    };
    Ok(Box::new(CudaExecutor::new(
        plan,
        full_params,
        copts,
        dist,
        rv,
    )?))
}

#[cfg(not(feature = "cuda"))]
fn open_process_built(
    _plan: &Plan,
    _full_params: &[(String, Tensor)],
    _opts: &RunOptions,
    _dist: &DistEnv,
    _rv: &mut Rendezvous,
) -> Result<Box<dyn PlanExecutor>, ExecError> {
    Err(ExecError::Run(
        "hzp run --backend cuda: this hzp was built without the `cuda` feature; rebuild with `cargo build --release --features cuda`".into(),
    ))
}

/// Every rank of `plan` in this process on its one GPU (`hzp run --backend cuda
/// --ranks-on-one-gpu`), as one [`PlanExecutor`]: per rank its own arena and compute /
/// all-gather / reduce-scatter streams, the NCCL path's lowering, events and memory plan,
/// collectives through the local device communicator ([`local`]). Errors as
/// [`open_process`]'s.
pub fn open_one_gpu(
    plan: &Plan,
    full_params: &[(String, Tensor)],
    opts: &RunOptions,
) -> Result<Box<dyn PlanExecutor>, ExecError> {
    probe::probe()
        .require(&COMPUTE_LIBS, "hzp run --backend cuda --ranks-on-one-gpu")
        .map_err(ExecError::Run)?;
    open_one_gpu_built(plan, full_params, opts)
}

#[cfg(feature = "cuda")]
fn open_one_gpu_built(
    plan: &Plan,
    full_params: &[(String, Tensor)],
    opts: &RunOptions,
) -> Result<Box<dyn PlanExecutor>, ExecError> {
    probe::probe()
        .preload(&COMPUTE_LIBS)
        .map_err(ExecError::Run)?;
    let copts = CudaOptions {
        comm: opts.comm,
        timeout: opts.timeout,
        lower: opts.lower,
        graphs: opts.graphs,
    };
    Ok(Box::new(one_gpu::OneGpuExecutor::new(
        plan,
        full_params,
        copts,
    )?))
}

#[cfg(not(feature = "cuda"))]
fn open_one_gpu_built(
    _plan: &Plan,
    _full_params: &[(String, Tensor)],
    _opts: &RunOptions,
) -> Result<Box<dyn PlanExecutor>, ExecError> {
    Err(ExecError::Run(
        "hzp run --backend cuda --ranks-on-one-gpu: this hzp was built without the `cuda` feature; rebuild with `cargo build --release --features cuda`".into(),
    ))
}
