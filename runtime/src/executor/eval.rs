//! Evaluation through the executor contract: a [`PlanExecutor`] loaded with an evaluation
//! plan (`hzp_passes::plan::eval::eval_plan`: one rank, whole fp32 parameters, forward and
//! loss only) is given the current parameters and a batch, runs the forward and reads the
//! loss (output 0). The same code serves every backend: on the CPU executor it computes what
//! the CPU evaluator computes; on a CUDA executor it runs on the GPU.

use super::{ExecError, PlanExecutor};
use hzp_ir::Tensor;

/// Losses of an evaluation plan on one executor.
pub struct PlanEvaluator {
    ex: Box<dyn PlanExecutor>,
    /// Every parameter of the evaluation plan, by name, as the executor keeps it (fp32
    /// vectors): the model's values until [`PlanEvaluator::set_parameters`] replaces them.
    params: Vec<(String, Tensor)>,
}

impl PlanEvaluator {
    /// `ex` runs an evaluation plan of one rank; `model` holds the model's parameters by name
    /// (full tensors), the values of those the training does not set (frozen ones).
    pub fn new(
        ex: Box<dyn PlanExecutor>,
        model: &[(String, Tensor)],
    ) -> Result<PlanEvaluator, ExecError> {
        if ex.mesh().world_size() != 1 || !ex.program().updates.is_empty() {
            return Err(ExecError::Plan(
                "an evaluation plan runs on one rank and updates nothing".into(),
            ));
        }
        let p = ex.program();
        let mut params = Vec::with_capacity(p.params.len());
        for prm in &p.params {
            let name = &p.value(prm.value).name;
            let (_, t) = model.iter().find(|(k, _)| k == name).ok_or_else(|| {
                ExecError::Params(format!("evaluation: no value for parameter `{name}`"))
            })?;
            params.push((name.clone(), flat(t)));
        }
        Ok(PlanEvaluator { ex, params })
    }

    /// Where the evaluation runs (the executor's device).
    pub fn device(&self) -> String {
        self.ex.device()
    }

    /// Puts `params` (full tensors by name) into the executor; parameters not named keep
    /// their values. A name the plan does not have is ignored (the training may keep
    /// values the forward does not read).
    pub fn set_parameters(&mut self, params: &[(String, Tensor)]) -> Result<(), ExecError> {
        for (name, t) in params {
            if let Some((_, mine)) = self.params.iter_mut().find(|(k, _)| k == name) {
                let f = flat(t);
                if f.shape != mine.shape {
                    return Err(ExecError::Params(format!(
                        "evaluation: parameter `{name}` has {} elements, the plan {}",
                        f.numel(),
                        mine.numel()
                    )));
                }
                *mine = f;
            }
        }
        self.ex.restore(std::slice::from_ref(&self.params))
    }

    /// The loss (output 0) of the forward on `batch` (every input of the plan).
    pub fn loss(&mut self, batch: &[(String, Tensor)]) -> Result<f64, ExecError> {
        self.ex.set_inputs(batch)?;
        let st = self.ex.step()?;
        st.loss
            .ok_or_else(|| ExecError::Run("evaluation: the plan has no loss output".into()))
    }
}

/// `t` as the fp32 vector of its elements (how a plan keeps a whole parameter).
fn flat(t: &Tensor) -> Tensor {
    Tensor::f32(vec![t.numel()], t.to_f32_vec())
}
