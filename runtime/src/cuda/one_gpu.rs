//! Every rank of a plan in this process on its one GPU (`hzp run --backend cuda
//! --ranks-on-one-gpu`), as one [`PlanExecutor`]: a [`CudaExecutor`] per rank (`new_local`:
//! the same lowering, streams, events and arena as under NCCL; collectives through the local
//! device communicator), each step issued by one host thread per rank.

use super::device::{compile_kernels, CudaExecutor, CudaOptions};
use super::local::LocalGroup;
use super::lower;
use crate::executor::{cut_parameters, ExecError, PlanExecutor, StepStats};
use crate::watchdog::FlightReport;
use cudarc::driver::{result as drv, CudaContext};
use hzp_ir::{Mesh, ParamLayout, Plan, Program, Tensor};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

pub(super) struct OneGpuExecutor {
    plan: Plan,
    /// Rank r's executor at index r.
    exs: Vec<CudaExecutor>,
    group: Arc<LocalGroup>,
    ranks: Vec<usize>,
    report: Option<FlightReport>,
}

impl OneGpuExecutor {
    /// `plan` from the full parameters, every rank on device 0 (the libraries probed and
    /// preloaded by the caller).
    pub(super) fn new(
        plan: &Plan,
        full_params: &[(String, Tensor)],
        opts: CudaOptions,
    ) -> Result<OneGpuExecutor, ExecError> {
        let world = plan.mesh.world_size();
        let mut opts = opts;
        super::cudnn::choose(plan, &mut opts.lower);
        // every rank's lowering first: refuse what the backend cannot run before the device
        // (the generated kernels are the same for every rank: one image serves them all)
        let mut fused_source = String::new();
        for r in 0..world {
            let low = lower::lower_program_with(plan, r, opts.lower).map_err(ExecError::Plan)?;
            if r == 0 {
                fused_source = low.fused_source;
            }
        }
        let shards = cut_parameters(&plan.program, &plan.mesh, &plan.layouts, full_params)?;
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
        let group = Arc::new(LocalGroup::new(ctx.clone(), opts.timeout));
        let exs = shards
            .iter()
            .enumerate()
            .map(|(r, sh)| CudaExecutor::new_local(plan, sh, opts.clone(), r, &group, &image))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(OneGpuExecutor {
            plan: plan.clone(),
            exs,
            group,
            ranks: (0..world).collect(),
            report: None,
        })
    }

    fn rank(&self, rank: usize) -> Result<&CudaExecutor, ExecError> {
        self.exs
            .get(rank)
            .ok_or_else(|| ExecError::Run(format!("the plan has no rank {rank}")))
    }
}

/// The first error that is not only "another rank failed".
fn first_error(results: &[Result<StepStats, ExecError>]) -> Option<ExecError> {
    let aborted = |e: &ExecError| matches!(e, ExecError::Run(m) if m == crate::comm::ABORTED);
    let errors: Vec<&ExecError> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    errors
        .iter()
        .find(|e| !aborted(e))
        .or(errors.first())
        .map(|e| (*e).clone())
}

/// One step's statistics over the ranks: rank 0's loss, the slowest rank's wall time, the
/// mean busy and exposed times.
fn merged(all: &[StepStats]) -> StepStats {
    let n = all.len().max(1) as u32;
    let of = |f: &dyn Fn(&StepStats) -> Duration| -> Duration {
        all.iter().map(f).sum::<Duration>() / n
    };
    StepStats {
        step: all.first().map_or(0, |s| s.step),
        loss: all.first().and_then(|s| s.loss),
        wall: all.iter().map(|s| s.wall).max().unwrap_or_default(),
        busy: [of(&|s| s.busy[0]), of(&|s| s.busy[1]), of(&|s| s.busy[2])],
        exposed_comm: of(&|s| s.exposed_comm),
    }
}

impl PlanExecutor for OneGpuExecutor {
    fn device(&self) -> String {
        "one GPU".into()
    }

    fn program(&self) -> &Program {
        &self.plan.program
    }

    fn mesh(&self) -> &Mesh {
        &self.plan.mesh
    }

    fn layouts(&self) -> &[ParamLayout] {
        &self.plan.layouts
    }

    fn replicas_differ(&self) -> bool {
        self.plan.asyncmesh.is_some()
    }

    fn local_ranks(&self) -> &[usize] {
        &self.ranks
    }

    fn set_inputs(&mut self, global: &[(String, Tensor)]) -> Result<(), ExecError> {
        for ex in self.exs.iter_mut() {
            CudaExecutor::set_inputs(ex, global)?;
        }
        Ok(())
    }

    fn step(&mut self) -> Result<StepStats, ExecError> {
        self.report = None;
        let group = &self.group;
        let results: Vec<Result<StepStats, ExecError>> = std::thread::scope(|s| {
            let hs: Vec<_> = self
                .exs
                .iter_mut()
                .enumerate()
                .map(|(r, ex)| {
                    std::thread::Builder::new()
                        .name(format!("hzp-r{r}-cuda"))
                        .spawn_scoped(s, move || {
                            let res =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                    CudaExecutor::step(ex)
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
        if let Some(e) = first_error(&results) {
            let reason = e.to_string();
            let mut ranks = Vec::new();
            for ex in &self.exs {
                ranks.extend(CudaExecutor::flight_report(ex, &reason).ranks);
            }
            self.report = Some(FlightReport { reason, ranks });
            return Err(e);
        }
        let all: Vec<StepStats> = results.into_iter().collect::<Result<_, _>>()?;
        Ok(merged(&all))
    }

    fn steps_run(&self) -> usize {
        self.exs.first().map_or(0, |ex| ex.steps_run())
    }

    fn set_steps_run(&mut self, steps: usize) {
        for ex in self.exs.iter_mut() {
            ex.set_steps_run(steps);
        }
    }

    fn master_shards(&self, rank: usize) -> Result<Vec<(String, Tensor)>, ExecError> {
        self.rank(rank)?.master_shards(rank)
    }

    fn persistent(&self, rank: usize) -> Result<Vec<(String, Tensor)>, ExecError> {
        self.rank(rank)?.persistent(rank)
    }

    fn restore(&mut self, per_rank: &[Vec<(String, Tensor)>]) -> Result<(), ExecError> {
        for ex in self.exs.iter_mut() {
            PlanExecutor::restore(ex, per_rank)?;
        }
        Ok(())
    }

    fn value(&self, rank: usize, name: &str) -> Result<Option<Tensor>, ExecError> {
        match self.exs.get(rank) {
            Some(ex) => ex.value(rank, name),
            None => Ok(None),
        }
    }

    fn flight_report(&self) -> Option<FlightReport> {
        self.report.clone()
    }
}
