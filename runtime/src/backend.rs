//! One interface over the plan executors, so that one conformance suite
//! (`tests/run_e2e.rs`) runs the same plans on every backend this build has and
//! checks each against the unsharded single-rank run.
//!
//! - [`Cpu`]: the CPU executor ([`crate::exec::Executor`]): every rank in this process, one
//!   compute thread and one thread per comm stream each.
//! - [`CudaOneGpu`]: the CUDA executor with every rank of the plan on this machine's one GPU
//!   (`hzp run --backend cuda --ranks-on-one-gpu`): the NCCL path's lowering, streams,
//!   events and memory plan, collectives through the local device communicator.
//!
//! Each backend opens a plan as a [`PlanExecutor`], the contract `hzp run`'s step loop drives
//! every backend through, and [`Backend::run`] drives it the same way (batch, step, and at
//! the end the full parameters), so the suite checks the executors users run.

use crate::exec::{ExecOptions, Executor};
use crate::executor::{ExecError, PlanExecutor, StepStats};
use hzp_ir::{Plan, Tensor};

/// The batch of step `s` (0-based): the plan's global inputs, the learning rate among them.
pub type Inputs<'a> = dyn FnMut(usize) -> Result<Vec<(String, Tensor)>, ExecError> + 'a;

/// What a run gives back.
#[derive(Clone, Debug)]
pub struct BackendRun {
    /// Per step, rank 0's statistics (its loss among them).
    pub steps: Vec<StepStats>,
    /// The full parameters after the last step, by name, in the plan's order.
    pub params: Vec<(String, Tensor)>,
}

/// A plan executor.
pub trait Backend {
    /// A short name for messages (`cpu`, `cuda-one-gpu`).
    fn name(&self) -> &'static str;

    /// `Ok` when this backend can run here; otherwise why not (the build lacks it, a library
    /// or the device is missing), in words a user can act on.
    fn available(&self) -> Result<(), String>;

    /// The largest relative difference from the unsharded single-rank CPU run that this
    /// backend's results are expected to stay within on f32 plans (its products may sum in
    /// another order).
    fn tolerance(&self) -> f64;

    /// Whether it runs the fused `Attention` op (a plan with one is refused otherwise; the
    /// model must be imported with attention written out, `--no-fuse-attention`).
    fn fused_attention(&self) -> bool;

    /// Whether it runs routed mixture-of-experts ops (`MoeDispatch`, `MoeCombine`,
    /// `MoeCombineGrad`; a plan with them is refused otherwise: import with `--no-fuse-moe`).
    fn routed_moe(&self) -> bool;

    /// Loads `plan` for every rank of it, from the full parameters `full_params`.
    fn open(
        &self,
        plan: &Plan,
        full_params: &[(String, Tensor)],
    ) -> Result<Box<dyn PlanExecutor>, ExecError>;

    /// Runs `steps` steps of `plan` from the full parameters `full_params`, step `s` on
    /// `inputs(s)`, through [`Backend::open`]'s executor.
    fn run(
        &self,
        plan: &Plan,
        full_params: &[(String, Tensor)],
        inputs: &mut Inputs<'_>,
        steps: usize,
    ) -> Result<BackendRun, ExecError> {
        let mut ex = self.open(plan, full_params)?;
        let mut stats = Vec::with_capacity(steps);
        for s in 0..steps {
            ex.set_inputs(&inputs(s)?)?;
            stats.push(ex.step()?);
        }
        Ok(BackendRun {
            steps: stats,
            params: ex.parameters()?,
        })
    }
}

/// The CPU executor.
#[derive(Clone, Default)]
pub struct Cpu {
    pub options: ExecOptions,
}

impl Backend for Cpu {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn available(&self) -> Result<(), String> {
        Ok(())
    }

    fn tolerance(&self) -> f64 {
        1e-5
    }

    fn fused_attention(&self) -> bool {
        true
    }

    fn routed_moe(&self) -> bool {
        true
    }

    fn open(
        &self,
        plan: &Plan,
        full_params: &[(String, Tensor)],
    ) -> Result<Box<dyn PlanExecutor>, ExecError> {
        Ok(Box::new(Executor::new(
            plan,
            full_params,
            self.options.clone(),
        )?))
    }
}

/// The CUDA executor, every rank of the plan on this machine's one GPU.
#[derive(Clone)]
pub struct CudaOneGpu {
    pub options: crate::cuda::RunOptions,
}

impl Default for CudaOneGpu {
    fn default() -> CudaOneGpu {
        CudaOneGpu {
            options: crate::cuda::RunOptions {
                comm: Default::default(),
                timeout: crate::watchdog::DEFAULT_TIMEOUT,
                lower: crate::cuda::lower::LowerOptions::from_env(),
                graphs: crate::cuda::graph::from_env(),
            },
        }
    }
}

impl Backend for CudaOneGpu {
    fn name(&self) -> &'static str {
        "cuda-one-gpu"
    }

    fn available(&self) -> Result<(), String> {
        if !crate::cuda::BUILT {
            return Err("this build has no CUDA backend (build with --features cuda)".into());
        }
        crate::cuda::probe::probe().require(&crate::cuda::COMPUTE_LIBS, "the CUDA backend")?;
        crate::cuda::gpu_count().and_then(|n| match n {
            0 => Err("the CUDA driver is installed but sees no GPU".to_string()),
            _ => Ok(()),
        })
    }

    fn tolerance(&self) -> f64 {
        // measured on an H100 (../shared/device/README.md): losses within 7.6e-6 and
        // parameters within 4.1e-5 of the CPU backend after AdamW steps
        1e-4
    }

    fn fused_attention(&self) -> bool {
        false
    }

    fn routed_moe(&self) -> bool {
        // MoeDispatch / MoeCombine / MoeCombineGrad have CUDA kernels (kernels/moe.cu)
        true
    }

    fn open(
        &self,
        plan: &Plan,
        full_params: &[(String, Tensor)],
    ) -> Result<Box<dyn PlanExecutor>, ExecError> {
        crate::cuda::open_one_gpu(plan, full_params, &self.options)
    }
}

/// Every backend of this build, available here or not.
pub fn all() -> Vec<Box<dyn Backend>> {
    vec![Box::new(Cpu::default()), Box::new(CudaOneGpu::default())]
}
