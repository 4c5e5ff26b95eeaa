//! Learning-rate schedules, as nanoGPT's `get_lr` computes them: a linear warmup over the
//! first `warmup` steps, then constant, cosine or linear decay from the maximum to `min_lr`
//! over the run's steps. The value is fed to the step program's learning-rate input at every
//! step, so one compiled plan serves every schedule.

use std::fmt;

/// The shape of the schedule after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    Constant,
    Cosine,
    Linear,
}

impl ScheduleKind {
    pub fn parse(s: &str) -> Result<ScheduleKind, String> {
        match s {
            "constant" => Ok(ScheduleKind::Constant),
            "cosine" => Ok(ScheduleKind::Cosine),
            "linear" => Ok(ScheduleKind::Linear),
            other => Err(format!(
                "--lr-schedule `{other}`: expected constant, cosine or linear"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Constant => "constant",
            ScheduleKind::Cosine => "cosine",
            ScheduleKind::Linear => "linear",
        }
    }
}

/// A learning-rate schedule over a run of `steps` steps.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    /// The maximum (the optimizer's `--lr`).
    pub lr: f64,
    /// Steps of linear warmup.
    pub warmup: usize,
    /// Where the decay ends (cosine, linear).
    pub min_lr: f64,
    /// The run's total steps: the decay reaches `min_lr` at this step.
    pub steps: usize,
}

impl LrSchedule {
    /// Checks the numbers: finite, `0 <= min_lr <= lr`.
    pub fn new(
        kind: ScheduleKind,
        lr: f64,
        warmup: usize,
        min_lr: f64,
        steps: usize,
    ) -> Result<LrSchedule, String> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(format!(
                "the learning rate must be a finite number >= 0, got {lr}"
            ));
        }
        if !(min_lr.is_finite() && min_lr >= 0.0 && min_lr <= lr) {
            return Err(format!(
                "--min-lr must be a finite number between 0 and the learning rate {lr}, got {min_lr}"
            ));
        }
        Ok(LrSchedule {
            kind,
            lr,
            warmup,
            min_lr,
            steps,
        })
    }

    /// The learning rate of step `it` (0-based), exactly nanoGPT's `get_lr(it)` with
    /// `warmup_iters = warmup` and `lr_decay_iters = steps` (the constant schedule keeps the
    /// maximum after warmup).
    pub fn at(&self, it: usize) -> f64 {
        if it < self.warmup {
            return self.lr * (it as f64 + 1.0) / (self.warmup as f64 + 1.0);
        }
        if self.kind == ScheduleKind::Constant {
            return self.lr;
        }
        if it > self.steps {
            return self.min_lr;
        }
        // at it == warmup == steps the decay is over (nanoGPT would divide 0 by 0)
        let ratio = if self.steps > self.warmup {
            (it - self.warmup) as f64 / (self.steps - self.warmup) as f64
        } else {
            1.0
        };
        let coeff = match self.kind {
            ScheduleKind::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos()),
            ScheduleKind::Linear => 1.0 - ratio,
            ScheduleKind::Constant => 1.0,
        };
        self.min_lr + coeff * (self.lr - self.min_lr)
    }
}

impl fmt::Display for LrSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            ScheduleKind::Constant => write!(f, "constant {}", self.lr)?,
            k => write!(
                f,
                "{} from {} to {} over {} steps",
                k.name(),
                self.lr,
                self.min_lr,
                self.steps
            )?,
        }
        if self.warmup > 0 {
            write!(f, ", {} warmup steps", self.warmup)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// nanoGPT's get_lr, transcribed from its formula for the test.
    fn nanogpt(it: usize, lr: f64, warmup: usize, decay: usize, min_lr: f64) -> f64 {
        if it < warmup {
            return lr * (it + 1) as f64 / (warmup + 1) as f64;
        }
        if it > decay {
            return min_lr;
        }
        let r = (it - warmup) as f64 / (decay - warmup) as f64;
        min_lr + 0.5 * (1.0 + (std::f64::consts::PI * r).cos()) * (lr - min_lr)
    }

    #[test]
    fn cosine_is_nanogpts_get_lr() {
        let s = LrSchedule::new(ScheduleKind::Cosine, 6e-4, 10, 6e-5, 100).unwrap();
        for it in 0..120 {
            assert_eq!(s.at(it), nanogpt(it, 6e-4, 10, 100, 6e-5), "it {it}");
        }
        assert_eq!(s.at(0), 6e-4 / 11.0);
        assert_eq!(s.at(10), 6e-4);
        assert_eq!(s.at(100), 6e-5);
    }

    #[test]
    fn linear_and_constant() {
        let s = LrSchedule::new(ScheduleKind::Linear, 1.0, 0, 0.0, 4).unwrap();
        let got: Vec<f64> = (0..5).map(|i| s.at(i)).collect();
        assert_eq!(got, vec![1.0, 0.75, 0.5, 0.25, 0.0]);
        let c = LrSchedule::new(ScheduleKind::Constant, 0.5, 1, 0.0, 4).unwrap();
        assert_eq!(
            (0..3).map(|i| c.at(i)).collect::<Vec<_>>(),
            vec![0.25, 0.5, 0.5]
        );
        // warmup as long as the run: no 0/0
        let w = LrSchedule::new(ScheduleKind::Cosine, 1.0, 3, 0.1, 3).unwrap();
        assert_eq!(w.at(3), 0.1);
    }

    #[test]
    fn bad_numbers_are_refused() {
        assert!(LrSchedule::new(ScheduleKind::Cosine, f64::NAN, 0, 0.0, 1).is_err());
        assert!(LrSchedule::new(ScheduleKind::Cosine, 1e-3, 0, 1e-2, 1).is_err());
        assert!(LrSchedule::new(ScheduleKind::Cosine, -1.0, 0, 0.0, 1).is_err());
        assert!(ScheduleKind::parse("step").is_err());
    }
}
