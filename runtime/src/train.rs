//! Running training steps on one CPU rank: a [`Trainer`] holds the current parameters and
//! optimizer states of a training-step program (see `hzp_passes::train`) and applies the
//! program's updates after each step.

use crate::eval::{evaluate, EvalError};
use hzp_ir::{Param, Program, Tensor, ValueDef};

/// Executes a training-step program step after step.
pub struct Trainer {
    /// The step program with its states turned into parameters (so the evaluator binds
    /// them), and the update values appended to its outputs.
    program: Program,
    /// Number of the step program's own outputs (the loss first).
    n_outputs: usize,
    /// For each update, the index in `program.params` of its target.
    targets: Vec<usize>,
    /// How many of `program.params` are the model's trainable parameters (the rest are
    /// states).
    n_params: usize,
}

impl Trainer {
    /// Prepares `step`; states start at their initial value (zeros when none is given).
    /// Every parameter must have data.
    pub fn new(step: &Program) -> Result<Trainer, EvalError> {
        let mut program = step.clone();
        let n_params = program.params.len();
        if let Some(prm) = program.params.iter().find(|p| p.data.is_none()) {
            return Err(EvalError::ParamWithoutData {
                name: program.value(prm.value).name.clone(),
            });
        }
        for st in std::mem::take(&mut program.states) {
            let ty = program.ty(st.value).clone();
            let data = st.init.unwrap_or_else(|| Tensor::zeros(&ty));
            program.values[st.value.index()].def = ValueDef::Param;
            program.params.push(Param {
                value: st.value,
                data: Some(data),
            });
        }
        let n_outputs = program.outputs.len();
        let mut targets = Vec::new();
        for u in std::mem::take(&mut program.updates) {
            let idx = program
                .params
                .iter()
                .position(|p| p.value == u.target)
                .ok_or_else(|| {
                    EvalError::Malformed(format!(
                        "update of `{}`, which is neither a parameter nor a state",
                        program.value(u.target).name
                    ))
                })?;
            targets.push(idx);
            program.outputs.push(u.value);
        }
        Ok(Trainer {
            program,
            n_outputs,
            targets,
            n_params,
        })
    }

    /// Runs one step on `inputs` (the global batch, by input name); returns the program's
    /// outputs (the loss first) and applies the updates.
    pub fn step(
        &mut self,
        inputs: &[(String, Tensor)],
    ) -> Result<Vec<(String, Tensor)>, EvalError> {
        let mut outs = evaluate(&self.program, inputs)?;
        let updates = outs.split_off(self.n_outputs);
        for (&idx, (_, t)) in self.targets.iter().zip(updates) {
            self.program.params[idx].data = Some(t);
        }
        Ok(outs)
    }

    /// The model's parameters as they are now, by name, in program order.
    pub fn parameters(&self) -> Vec<(String, Tensor)> {
        self.program.params[..self.n_params]
            .iter()
            .map(|p| {
                (
                    self.program.value(p.value).name.clone(),
                    p.data.clone().expect("parameters have data"),
                )
            })
            .collect()
    }

    /// The optimizer states as they are now, by name.
    pub fn states(&self) -> Vec<(String, Tensor)> {
        self.program.params[self.n_params..]
            .iter()
            .map(|p| {
                (
                    self.program.value(p.value).name.clone(),
                    p.data.clone().expect("states have data"),
                )
            })
            .collect()
    }
}
