//! The executor contract: what every plan executor (the CPU executor in `exec/`, the CUDA
//! executors in `cuda/`) offers the step loop of `hzp run`, and what they share: errors,
//! step statistics, the cutting of full parameters into each rank's shards and their
//! assembly, and the byte form of tensors in device buffers ([`bytes`]). This module depends
//! on neither backend; both depend on it.
//!
//! A [`PlanExecutor`] runs one compiled plan for some of its ranks (every rank, or under a
//! launcher the one rank of this process): the caller feeds each step's global batch and
//! scalar inputs ([`PlanExecutor::set_inputs`], the learning rate among them), runs a step
//! ([`PlanExecutor::step`]), reads the persistent values of its ranks for a checkpoint
//! ([`PlanExecutor::persistent`]), puts them back ([`PlanExecutor::restore`]), and on a
//! failure reads the flight record. What crosses processes (gathering the full parameters,
//! writing one checkpoint from several processes) is the caller's: it combines the
//! [`PlanExecutor::master_shards`] of every process with [`parameters_from`].

pub mod bytes;
mod error;
pub mod eval;
mod layout;

pub use error::ExecError;
pub use layout::{assemble_layout, cut_parameters, parameters_from};

use crate::watchdog::FlightReport;
use hzp_ir::{Mesh, ParamLayout, Program, StreamKind, Tensor, ValueId};
use std::collections::HashMap;
use std::time::Duration;

/// Where collectives are issued.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CommMode {
    /// On background threads, one per comm stream (the plan's schedule).
    #[default]
    Async,
    /// On the compute thread, in program order (the baseline).
    Sync,
}

/// What one step cost (means over the ranks, except the wall time).
#[derive(Clone, Debug, PartialEq)]
pub struct StepStats {
    /// 1-based.
    pub step: usize,
    /// Output 0 (the loss) of rank 0, if the program has outputs.
    pub loss: Option<f64>,
    /// From the start of the step to the end of its updates.
    pub wall: Duration,
    /// Per stream ([`StreamKind::index`]): time spent running nodes (collectives included; waits
    /// on events excluded). In sync mode a collective counts for the stream the plan put it
    /// on, though the compute thread ran it.
    pub busy: [Duration; 3],
    /// Time the compute thread could not compute because of communication: blocked on
    /// events of comm streams (async), or running collectives (sync).
    pub exposed_comm: Duration,
}

impl StepStats {
    /// Busy time of the comm streams.
    pub fn comm(&self) -> Duration {
        self.busy[1] + self.busy[2]
    }
}

/// One node run, for the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    pub rank: usize,
    pub stream: StreamKind,
    pub node: usize,
    /// 1-based.
    pub step: usize,
    /// Since the start of the run.
    pub start: Duration,
    pub dur: Duration,
}

/// A plan loaded for some of its ranks on one backend, run step by step.
///
/// Every rank of the plan runs each step together: under a launcher every process must call
/// `set_inputs` and `step` for the same steps. Values are named as in the per-rank program.
pub trait PlanExecutor {
    /// Where the ranks run, for reports (`the CPU`, `the GPU`, `one GPU`).
    fn device(&self) -> String;

    /// The per-rank program.
    fn program(&self) -> &Program;

    /// The plan's mesh.
    fn mesh(&self) -> &Mesh;

    /// How the plan cuts each parameter (and its optimizer states).
    fn layouts(&self) -> &[ParamLayout];

    /// Whether the replicas of a parameter differ by design (an AsyncMesh plan): the model is
    /// then their mean (see [`assemble_layout`]).
    fn replicas_differ(&self) -> bool;

    /// The ranks this executor runs: every rank of the plan, or (under a launcher) one.
    fn local_ranks(&self) -> &[usize];

    /// Sets the global batch: every input of the per-rank program with `W` times its rows
    /// (rank r takes rows `[r*b, (r+1)*b)`); a scalar input (the learning rate) once, every
    /// rank's. Token ids and labels out of range are an error (nothing is set then).
    fn set_inputs(&mut self, global: &[(String, Tensor)]) -> Result<(), ExecError>;

    /// Runs one step on the batch set last.
    fn step(&mut self) -> Result<StepStats, ExecError>;

    /// Runs `steps` steps on the batch set last.
    fn run(&mut self, steps: usize) -> Result<Vec<StepStats>, ExecError> {
        (0..steps).map(|_| self.step()).collect()
    }

    /// Steps run so far.
    fn steps_run(&self) -> usize;

    /// Counts `steps` as already run (a run resumed from a checkpoint numbers its steps on).
    fn set_steps_run(&mut self, steps: usize);

    /// The parameter master shards of `rank` (one this executor runs), by name.
    fn master_shards(&self, rank: usize) -> Result<Vec<(String, Tensor)>, ExecError>;

    /// Every persistent value of `rank` (one this executor runs): its parameter master
    /// shards, then its states (compute shards, optimizer moments, the step counter), by
    /// name, in program order: what a checkpoint keeps of the rank.
    fn persistent(&self, rank: usize) -> Result<Vec<(String, Tensor)>, ExecError>;

    /// Sets the persistent values of every rank (as [`PlanExecutor::persistent`] gives
    /// them): `per_rank[r]` names each of rank r's parameters and states once, with its type.
    /// Every rank's values are checked; those of the ranks this executor runs are set.
    fn restore(&mut self, per_rank: &[Vec<(String, Tensor)>]) -> Result<(), ExecError>;

    /// The value named `name` on `rank` after the last step (None: no such value, or a rank
    /// this executor does not run).
    fn value(&self, rank: usize, name: &str) -> Result<Option<Tensor>, ExecError>;

    /// The flight report of the last step that failed.
    fn flight_report(&self) -> Option<FlightReport>;

    /// The nodes run so far, when the executor records a timeline (the CPU's `--trace`).
    fn trace(&self) -> &[TraceEvent] {
        &[]
    }

    /// The full parameters, by name, in layout order, from the master shards of this
    /// executor's ranks and `others` (rank -> its [`PlanExecutor::master_shards`], for the
    /// ranks of other processes).
    fn parameters_with(
        &self,
        others: &HashMap<usize, Vec<(String, Tensor)>>,
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        let mut all = others.clone();
        for &r in self.local_ranks() {
            all.insert(r, self.master_shards(r)?);
        }
        parameters_from(self.mesh(), self.layouts(), self.replicas_differ(), &all)
    }

    /// The full parameters, when this executor runs every rank.
    fn parameters(&self) -> Result<Vec<(String, Tensor)>, ExecError> {
        self.parameters_with(&HashMap::new())
    }
}

/// The values a checkpoint keeps of a rank of `p`: its parameters (master shards), then its
/// states (compute shards, optimizer moments, the step counter), in program order.
pub fn persistent_values(p: &Program) -> Vec<ValueId> {
    p.params
        .iter()
        .map(|x| x.value)
        .chain(p.states.iter().map(|s| s.value))
        .collect()
}

/// Checks `per_rank` (values for [`PlanExecutor::restore`]) against the persistent values of
/// `p` on a mesh of `world` ranks: one list per rank, each naming every parameter and state
/// once with its type. Gives each rank's values matched to the program's, in
/// [`persistent_values`] order.
pub fn check_restore<'a>(
    p: &Program,
    world: usize,
    per_rank: &'a [Vec<(String, Tensor)>],
) -> Result<Vec<Vec<(ValueId, &'a Tensor)>>, ExecError> {
    if per_rank.len() != world {
        return Err(ExecError::Params(format!(
            "values for {} ranks given to a plan of {world}",
            per_rank.len()
        )));
    }
    let persistent = persistent_values(p);
    let mut matched = Vec::with_capacity(world);
    for (r, values) in per_rank.iter().enumerate() {
        if values.len() != persistent.len() {
            return Err(ExecError::Params(format!(
                "rank {r}: {} values given, the plan keeps {}",
                values.len(),
                persistent.len()
            )));
        }
        let mut rank = Vec::with_capacity(persistent.len());
        for &v in &persistent {
            let name = &p.value(v).name;
            let (_, t) = values
                .iter()
                .find(|(k, _)| k == name)
                .ok_or_else(|| ExecError::Params(format!("rank {r}: no value for `{name}`")))?;
            if t.ty() != *p.ty(v) {
                return Err(ExecError::Params(format!(
                    "rank {r}: `{name}` is {}, the plan keeps {}",
                    t.ty(),
                    p.ty(v)
                )));
            }
            rank.push((v, t));
        }
        matched.push(rank);
    }
    Ok(matched)
}
