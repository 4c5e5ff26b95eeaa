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

pub mod fuse;
pub mod kernels;
pub mod lower;
pub mod probe;
pub mod rendezvous;
pub mod transport;
pub mod work;

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

/// What [`run_plan`] gives back.
#[derive(Clone, Debug)]
pub struct CudaRunResult {
    /// This process's rank.
    pub rank: usize,
    pub steps: Vec<StepStats>,
    /// The full parameters after the last step (when asked for; every rank has them).
    pub params: Option<Vec<(String, Tensor)>>,
}

/// How [`run_plan`] and [`run_plan_one_gpu`] run.
#[derive(Clone)]
pub struct RunOptions {
    pub comm: CommMode,
    /// `--collective-timeout`: the rendezvous, a communicator's set-up, a step's collectives.
    pub timeout: Duration,
    /// Gets the flight report of a failed step (this process's ranks) before the error is
    /// returned.
    pub on_failure: Option<crate::watchdog::StuckHook>,
    /// How the plan is lowered (`--attention`).
    pub lower: lower::LowerOptions,
}

/// What the caller of [`run_plan`] / [`run_plan_one_gpu`] hears during the run.
pub struct StepHooks<'a> {
    /// After each step of each of this process's ranks: (rank, the step's statistics).
    pub on_step: &'a mut dyn FnMut(usize, &StepStats),
    /// Called with the full parameters after the steps (1-based) `params_after` picks, before
    /// that step's `on_step`. Every rank of the plan takes part in gathering them, so
    /// `params_after` must give every process the same answers.
    pub on_params: Option<ParamsHook<'a>>,
}

/// The full parameters after a step (1-based), by name.
pub type OnParams<'a> = dyn FnMut(usize, &[(String, Tensor)]) -> Result<(), ExecError> + 'a;

/// See [`StepHooks::on_params`].
pub struct ParamsHook<'a> {
    pub params_after: &'a dyn Fn(usize) -> bool,
    pub on_params: &'a mut OnParams<'a>,
}

impl<'a> StepHooks<'a> {
    /// Hooks that only hear the steps.
    pub fn steps(on_step: &'a mut dyn FnMut(usize, &StepStats)) -> StepHooks<'a> {
        StepHooks {
            on_step,
            on_params: None,
        }
    }

    /// Whether the parameters are wanted after step `step` (1-based).
    #[cfg(feature = "cuda")]
    fn params_due(&self, step: usize) -> bool {
        self.on_params
            .as_ref()
            .is_some_and(|h| (h.params_after)(step))
    }
}

/// What [`run_plan_one_gpu`] gives back.
#[derive(Clone, Debug)]
pub struct OneGpuResult {
    /// Per rank, per step.
    pub steps: Vec<Vec<StepStats>>,
    /// The full parameters after the last step (when asked for).
    pub params: Option<Vec<(String, Tensor)>>,
}

/// Runs `steps` steps of `plan` with every rank in this process on its one GPU (`hzp run
/// --backend cuda --ranks-on-one-gpu`): per rank its own arena and compute / all-gather /
/// reduce-scatter streams, the NCCL path's lowering, events and memory plan, collectives
/// through the local device communicator ([`local`]). `hooks.on_step(rank, stats)` after each step
/// of each rank. Errors as [`run_plan`]'s; a failure on one rank stops the others.
pub fn run_plan_one_gpu(
    plan: &Plan,
    full_params: &[(String, Tensor)],
    inputs: &mut dyn FnMut(usize) -> Result<Vec<(String, Tensor)>, ExecError>,
    steps: usize,
    opts: &RunOptions,
    want_params: bool,
    hooks: &mut StepHooks<'_>,
) -> Result<OneGpuResult, ExecError> {
    let need = COMPUTE_LIBS;
    probe::probe()
        .require(&need, "hzp run --backend cuda --ranks-on-one-gpu")
        .map_err(ExecError::Run)?;
    one_gpu_built(plan, full_params, inputs, steps, opts, want_params, hooks)
}

#[cfg(feature = "cuda")]
fn one_gpu_built(
    plan: &Plan,
    full_params: &[(String, Tensor)],
    inputs: &mut dyn FnMut(usize) -> Result<Vec<(String, Tensor)>, ExecError>,
    steps: usize,
    opts: &RunOptions,
    want_params: bool,
    hooks: &mut StepHooks<'_>,
) -> Result<OneGpuResult, ExecError> {
    use cudarc::driver::{result as drv, CudaContext};
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    let need = COMPUTE_LIBS;
    probe::probe().preload(&need).map_err(ExecError::Run)?;
    let world = plan.mesh.world_size();
    // every rank's lowering first: refuse what the backend cannot run before the device
    // (the generated kernels are the same for every rank: one image serves them all)
    let mut fused_source = String::new();
    for r in 0..world {
        let low = lower::lower_program_with(plan, r, opts.lower).map_err(ExecError::Plan)?;
        if r == 0 {
            fused_source = low.fused_source;
        }
    }
    let shards =
        crate::exec::cut_parameters(&plan.program, &plan.mesh, &plan.layouts, full_params)?;
    drv::init().map_err(|e| {
        ExecError::Run(format!(
            "CUDA: cuInit (the driver loaded, but found no usable GPU): {e:?}"
        ))
    })?;
    let ctx = CudaContext::new(0)
        .map_err(|e| ExecError::Run(format!("CUDA: creating the context: {e:?}")))?;
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| ExecError::Run(format!("CUDA: reading the compute capability: {e:?}")))?;
    let image = compile_kernels(major, minor, &fused_source)?;
    let group = Arc::new(local::LocalGroup::new(ctx.clone(), opts.timeout));
    let copts = CudaOptions {
        comm: opts.comm,
        timeout: opts.timeout,
        lower: opts.lower,
    };
    let mut exs = Vec::with_capacity(world);
    for (r, sh) in shards.iter().enumerate() {
        exs.push(CudaExecutor::new_local(
            plan,
            sh,
            copts.clone(),
            r,
            &group,
            &image,
        )?);
    }
    let mut per_rank: Vec<Vec<StepStats>> = vec![Vec::with_capacity(steps); world];
    for k in 0..steps {
        let batch = inputs(k)?;
        for ex in exs.iter_mut() {
            ex.set_inputs(&batch)?;
        }
        let group = &group;
        let results: Vec<Result<StepStats, ExecError>> = std::thread::scope(|s| {
            let hs: Vec<_> = exs
                .iter_mut()
                .enumerate()
                .map(|(r, ex)| {
                    std::thread::Builder::new()
                        .name(format!("hzp-r{r}-cuda"))
                        .spawn_scoped(s, move || {
                            let res =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                    ex.step()
                                }))
                                .unwrap_or_else(|_| {
                                    Err(ExecError::Run(format!("rank {r}'s step panicked")))
                                });
                            if res.is_err() {
                                group.abort.store(true, Ordering::SeqCst);
                            }
                            res
                        })
                })
                .collect();
            hs.into_iter()
                .map(|h| match h {
                    Ok(h) => h
                        .join()
                        .unwrap_or_else(|_| Err(ExecError::Run("a rank's thread panicked".into()))),
                    Err(e) => Err(ExecError::Run(format!("cannot start a thread: {e}"))),
                })
                .collect()
        });
        // the first error that is not only "another rank failed"
        let mut first: Option<ExecError> = None;
        for res in &results {
            if let Err(e) = res {
                let aborted = matches!(e, ExecError::Run(m) if m == crate::comm::ABORTED);
                if first.is_none()
                    || !aborted
                        && matches!(&first, Some(ExecError::Run(m)) if m == crate::comm::ABORTED)
                {
                    first = Some(e.clone());
                }
            }
        }
        if let Some(e) = first {
            if let Some(h) = &opts.on_failure {
                let reason = e.to_string();
                let mut ranks = Vec::new();
                for ex in &exs {
                    ranks.extend(ex.flight_report(&reason).ranks);
                }
                h(&crate::watchdog::FlightReport { reason, ranks });
            }
            return Err(e);
        }
        if hooks.params_due(k + 1) {
            let all = exs
                .iter()
                .map(|ex| ex.master_bytes())
                .collect::<Result<Vec<_>, _>>()?;
            let params = assemble_parameters(plan, &all)?;
            if let Some(h) = hooks.on_params.as_mut() {
                (h.on_params)(k + 1, &params)?;
            }
        }
        for (r, res) in results.into_iter().enumerate() {
            let st = res?;
            (hooks.on_step)(r, &st);
            per_rank[r].push(st);
        }
    }
    let params = if want_params {
        let all = exs
            .iter()
            .map(|ex| ex.master_bytes())
            .collect::<Result<Vec<_>, _>>()?;
        Some(assemble_parameters(plan, &all)?)
    } else {
        None
    };
    drop(exs);
    Ok(OneGpuResult {
        steps: per_rank,
        params,
    })
}

#[cfg(not(feature = "cuda"))]
fn one_gpu_built(
    _plan: &Plan,
    _full_params: &[(String, Tensor)],
    _inputs: &mut dyn FnMut(usize) -> Result<Vec<(String, Tensor)>, ExecError>,
    _steps: usize,
    _opts: &RunOptions,
    _want_params: bool,
    _hooks: &mut StepHooks<'_>,
) -> Result<OneGpuResult, ExecError> {
    Err(ExecError::Run(
        "hzp run --backend cuda --ranks-on-one-gpu: this hzp was built without the `cuda` feature; rebuild with `cargo build --release --features cuda`".into(),
    ))
}

/// Runs `steps` steps of `plan` as this process's rank (from the torchrun variables; a
/// single process when none are set), step `s` (0-based) on the global batch `inputs(s)`
/// (the learning rate among them), calling `hooks` after each step. With `want_params`, gathers the full parameters at the end.
///
/// Errors: a missing library names the library and where it was looked for (before any CUDA
/// call); a plan using an op the backend does not run names the node; a build without the
/// `cuda` feature says so (after reporting missing libraries, which a user needs either way).
pub fn run_plan(
    plan: &Plan,
    full_params: &[(String, Tensor)],
    inputs: &mut dyn FnMut(usize) -> Result<Vec<(String, Tensor)>, ExecError>,
    steps: usize,
    opts: &RunOptions,
    want_params: bool,
    hooks: &mut StepHooks<'_>,
) -> Result<CudaRunResult, ExecError> {
    let world = plan.mesh.world_size();
    let mut need = COMPUTE_LIBS.to_vec();
    if world > 1 {
        need.push(probe::Lib::Nccl);
    }
    probe::probe()
        .require(&need, "hzp run --backend cuda")
        .map_err(ExecError::Run)?;
    run_built(plan, full_params, inputs, steps, opts, want_params, hooks)
}

#[cfg(feature = "cuda")]
fn run_built(
    plan: &Plan,
    full_params: &[(String, Tensor)],
    inputs: &mut dyn FnMut(usize) -> Result<Vec<(String, Tensor)>, ExecError>,
    steps: usize,
    opts: &RunOptions,
    want_params: bool,
    hooks: &mut StepHooks<'_>,
) -> Result<CudaRunResult, ExecError> {
    let on_failure = opts.on_failure.clone();
    let opts = CudaOptions {
        comm: opts.comm,
        timeout: opts.timeout,
        lower: opts.lower,
    };
    let mut ex = CudaExecutor::new(plan, full_params, opts)?;
    let mut out = Vec::with_capacity(steps);
    for k in 0..steps {
        ex.set_inputs(&inputs(k)?)?;
        let s = match ex.step() {
            Ok(s) => s,
            Err(e) => {
                if let Some(h) = &on_failure {
                    h(&ex.flight_report(&e.to_string()));
                }
                return Err(e);
            }
        };
        if hooks.params_due(k + 1) {
            let params = ex.parameters()?;
            if let Some(h) = hooks.on_params.as_mut() {
                (h.on_params)(k + 1, &params)?;
            }
        }
        (hooks.on_step)(ex.rank(), &s);
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
    _opts: &RunOptions,
    _want_params: bool,
    _hooks: &mut StepHooks<'_>,
) -> Result<CudaRunResult, ExecError> {
    Err(ExecError::Run(
        "hzp run --backend cuda: this hzp was built without the `cuda` feature; rebuild with `cargo build --release --features cuda`".into(),
    ))
}

/// The full parameters from every rank's [`CudaExecutor::master_bytes`] (`all[r]`). An
/// AsyncMesh plan's replicas differ by design: the model is their mean, as the CPU
/// executor's `Executor::parameters` gives it.
pub fn assemble_parameters(
    plan: &Plan,
    all: &[Vec<u8>],
) -> Result<Vec<(String, Tensor)>, ExecError> {
    let p = &plan.program;
    let world = plan.mesh.world_size();
    let mut out = Vec::new();
    for l in &plan.layouts {
        let Some(k) = p
            .params
            .iter()
            .position(|x| p.value(x.value).name == l.name)
        else {
            continue;
        };
        // byte offset of parameter k in every rank's concatenation
        let off: usize = p.params[..k]
            .iter()
            .map(|x| p.ty(x.value).size_bytes())
            .sum();
        let len = p.ty(p.params[k].value).size_bytes();
        // the parameter as the optimizer group that holds rank `first` has it
        let whole = |first: usize| -> Result<Vec<f32>, ExecError> {
            let members = plan
                .mesh
                .group_members(&l.optim_group, first)
                .unwrap_or_else(|| vec![first]);
            let mut flat: Vec<f32> = Vec::with_capacity(l.padded);
            for m in members {
                let b = all
                    .get(m)
                    .and_then(|b| b.get(off..off + len))
                    .ok_or_else(|| {
                        ExecError::Run(format!("rank {m} sent too few parameter bytes"))
                    })?;
                flat.extend(
                    b.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                );
            }
            flat.truncate(l.numel);
            Ok(flat)
        };
        let flat =
            crate::exec::assemble_layout(&plan.mesh, l, world, plan.asyncmesh.is_some(), whole)?;
        out.push((l.name.clone(), Tensor::f32(l.shape.clone(), flat)));
    }
    Ok(out)
}
