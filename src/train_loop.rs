//! The step loop of `hzp run` when it trains for real: token batches, the learning-rate
//! schedule, evaluation, metrics, checkpoints and resume (see `session` and
//! `hzp_runtime::checkpoint`).

use crate::run_args::RunArgs;
use crate::session::{self, Evaluator, Metrics, TokenFeed};
use hzp_ir::plan::Plan;
use hzp_ir::{Tensor, TensorType};
use hzp_runtime::checkpoint::{self, Checkpoint, DataPosition, Manifest};
use hzp_runtime::executor::{PlanExecutor, StepStats};
use hzp_runtime::schedule::LrSchedule;
use miette::{miette, Result};
use std::path::Path;

/// Opens an executor for an evaluation plan on the run's backend, given the plan and the
/// model's parameters.
pub type OpenEval<'a> = &'a dyn Fn(&Plan, &[(String, Tensor)]) -> Result<Box<dyn PlanExecutor>>;

/// Runs `plan` from the step a checkpoint left (or 0) to `--steps`, printing a line per
/// step; returns the steps' statistics. Evaluation (`--val-data`) runs on an executor
/// `open_eval` opens (in the process of rank 0).
pub fn run_loop(
    args: &RunArgs,
    plan: &Plan,
    ex: &mut dyn PlanExecutor,
    fixed: &[(String, Tensor)],
    schedule: &LrSchedule,
    open_eval: OpenEval<'_>,
    mut procs: Option<&mut crate::procs::Procs>,
) -> Result<Vec<StepStats>> {
    let p = &plan.program;
    // in a multi-process run, rank 0 reports (stdout, --log, evaluation)
    let rank0 = procs.as_ref().is_none_or(|p| p.rank() == 0);
    let s = &args.session;
    let mut lp = StepLoop {
        args,
        plan,
        schedule,
        text: args.format == crate::Format::Text,
        feed: None,
        samples: 0,
        run: checkpoint::new_run_id(),
        resumed_from: None,
        noted: Default::default(),
    };
    let eval_every = s.eval_period(args.steps)?;
    let mut evaluator = lp.open_feeds(rank0.then_some(open_eval))?;
    let ckpt_dir = args.checkpoint_dir.as_deref();
    check_checkpoint_flags(args)?;
    let start = match (args.resume, ckpt_dir) {
        (true, Some(dir)) => lp.resume(ex, dir, procs.as_deref_mut())?,
        _ => 0,
    };
    let end = args.stop_at.map_or(args.steps, |n| n.min(args.steps));
    if start >= end {
        lp.println(format!(
            "nothing to run: {start} steps done, --steps {}",
            args.steps
        ))?;
        return Ok(Vec::new());
    }

    let mut metrics = Metrics::open(s.log.as_deref().filter(|_| rank0))?;
    let pb = if lp.text {
        session::progress(args.steps, start)
    } else {
        None
    };
    let norm_name = (p.outputs.len() > 1).then(|| p.value(p.outputs[1]).name.clone());
    let mut out = Vec::with_capacity(end - start);
    for step in start..end {
        let lr = schedule.at(step);
        let batch = session::step_batch(p, fixed, lp.feed.as_mut(), lp.samples, lr)?;
        ex.set_inputs(&batch)
            .map_err(|e| miette!("step {}: {e}", step + 1))?;
        let st = ex.step().map_err(|e| miette!("{e}"))?;
        if let Some(f) = &lp.feed {
            lp.samples += f.rows as u64;
        }
        let done = step + 1;
        let val_loss = match (&mut evaluator, eval_every) {
            (Some(e), Some(k)) if done.is_multiple_of(k) || done == args.steps => {
                let params = match procs.as_deref_mut() {
                    None => ex.parameters().map_err(|e| miette!("{e}"))?,
                    Some(p) => p.parameters(ex)?,
                };
                if rank0 {
                    Some(e.loss(&params)?)
                } else {
                    None
                }
            }
            _ => None,
        };
        let report = session::StepReport {
            step: st.step,
            loss: st.loss,
            lr,
            seconds: st.wall.as_secs_f64(),
            tokens: lp.feed.as_ref().map(|f| f.rows * f.seq),
            grad_norm: match norm_name.as_deref() {
                Some(n) => ex
                    .value(ex.local_ranks().first().copied().unwrap_or(0), n)
                    .map_err(|e| miette!("{e}"))?
                    .and_then(|t| t.to_f64_vec().first().copied()),
                None => None,
            },
            val_loss,
        };
        if lp.text {
            session::say(&pb, &report.line())?;
        }
        if let Some(b) = &pb {
            b.set_position(done as u64);
            if let Some(l) = st.loss {
                b.set_message(format!("loss {l:.4}"));
            }
        }
        metrics.write(&report.json())?;
        out.push(st);
        if let Some(dir) = ckpt_dir {
            let due = args
                .checkpoint_every
                .is_some_and(|k| done.is_multiple_of(k));
            if due || done == end {
                lp.save_checkpoint(ex, dir, done, lr, &pb, procs.as_deref_mut())?;
            }
        }
    }
    if let Some(b) = pb {
        b.finish_and_clear();
    }
    Ok(out)
}

/// What the step loop keeps between steps besides the executor: the token feed and the
/// position in it.
struct StepLoop<'a> {
    args: &'a RunArgs,
    plan: &'a Plan,
    schedule: &'a LrSchedule,
    text: bool,
    feed: Option<TokenFeed>,
    /// Samples read from the feed so far (a resumed run counts those before it).
    samples: u64,
    /// The run's identifier in its checkpoints: new, or the resumed checkpoint's.
    run: String,
    /// The checkpoint this invocation resumed from: retention never removes it.
    resumed_from: Option<std::path::PathBuf>,
    /// Retention notes already printed (each is said once per run).
    noted: std::cell::RefCell<std::collections::HashSet<String>>,
}

/// The checkpoint flags: `--resume`, `--checkpoint-every` and `--keep` need
/// `--checkpoint-dir`; a period or count of 0 is refused.
fn check_checkpoint_flags(args: &RunArgs) -> Result<()> {
    if args.checkpoint_dir.is_none()
        && (args.resume || args.checkpoint_every.is_some() || args.keep.is_some())
    {
        return Err(miette!(
            "--resume, --checkpoint-every and --keep need --checkpoint-dir DIR"
        ));
    }
    if args.checkpoint_every == Some(0) || args.keep == Some(0) {
        return Err(miette!("--checkpoint-every and --keep must be at least 1"));
    }
    Ok(())
}

impl StepLoop<'_> {
    /// Opens `--data` (kept as the loop's feed) and `--val-data` (returned as the
    /// evaluator), saying what each reads. With `open_eval` (the process that evaluates),
    /// the evaluation runs as a plan on the executor it opens.
    fn open_feeds(&mut self, open_eval: Option<OpenEval<'_>>) -> Result<Option<Evaluator>> {
        let (args, plan, s) = (self.args, self.plan, &self.args.session);
        let (feed, val_feed) = match session::open_feeds(s, &plan.program, plan.mesh.world_size())?
        {
            Some((f, v)) => (Some(f), v),
            None => (None, None),
        };
        self.feed = feed;
        if let Some(f) = &self.feed {
            self.println(f.data_line())?;
        }
        let Some(vf) = val_feed else {
            return Ok(None);
        };
        let mut e = Evaluator::new(
            crate::plan_file::eval_program(args, plan)?,
            vf,
            s.eval_batches,
        )?;
        if let Some(open) = open_eval {
            e.on_executor(&plan.model, open)?;
        }
        let where_ = if e.device() == "the CPU" {
            String::new()
        } else {
            // the CUDA executors take parameters from the host (no device-to-device copy)
            " (on the GPU: a forward+loss plan, the parameters copied to it through host memory)"
                .to_string()
        };
        self.println(format!("evaluation: {}{where_}", e.describe()))?;
        Ok(Some(e))
    }

    /// A line on stdout (with `--format json`, stdout holds the JSON document only).
    fn println(&self, line: String) -> Result<()> {
        if self.text {
            outln!("{line}");
        }
        Ok(())
    }

    /// `--resume`: restores the newest checkpoint in `dir` (if any) and the data position;
    /// returns the step to start at.
    fn resume(
        &mut self,
        ex: &mut dyn PlanExecutor,
        dir: &Path,
        procs: Option<&mut crate::procs::Procs>,
    ) -> Result<usize> {
        let found =
            checkpoint::latest(dir, &mut |n| eprintln!("note: {n}")).map_err(|e| miette!("{e}"))?;
        if let Some(p) = procs {
            p.agree_on_resume(found.as_ref().map(|c| (c.manifest.step, c.path.as_path())))?;
        }
        let Some(c) = found else {
            eprintln!(
                "note: --resume: no checkpoint in {} yet; starting at step 0",
                dir.display()
            );
            return Ok(0);
        };
        self.restore(ex, &c)?;
        let m = &c.manifest;
        let start = m.step;
        self.run = m.run.clone();
        self.resumed_from = Some(c.path.clone());
        if let (Some(d), Some(f)) = (&m.data, &self.feed) {
            self.samples = d.samples;
            if d.tokens != f.tokens() || d.seq != f.seq {
                eprintln!(
                    "note: the checkpoint read {} ({} tokens, sequences of {}); this run reads {} tokens in sequences of {}: the data position (sample {}) is kept",
                    d.file,
                    d.tokens,
                    d.seq,
                    f.tokens(),
                    f.seq,
                    d.samples
                );
            }
        } else if let Some(f) = &self.feed {
            self.samples = (start * f.rows) as u64;
        }
        if let Some(d) = &m.data {
            let now = self.args.session.shuffle;
            if d.shuffle != now {
                let seed = |s: Option<u64>| {
                    s.map_or("no shuffling".to_string(), |s| format!("--shuffle {s}"))
                };
                eprintln!(
                    "note: the checkpoint's run read its data with {}; this run uses {}: the windows after sample {} follow the new order, so some are seen twice and some not at all in this epoch",
                    seed(d.shuffle),
                    seed(now),
                    d.samples
                );
            }
        }
        if let Some(old) = &m.schedule {
            if old != self.schedule {
                eprintln!(
                    "note: the checkpoint's run had learning rate {old}; this run uses {}",
                    self.schedule
                );
            }
        }
        ex.set_steps_run(start);
        Ok(start)
    }

    /// Puts checkpoint `c` into the executor: as written when it is of this plan,
    /// resharded otherwise; refuses one of another model.
    fn restore(&self, ex: &mut dyn PlanExecutor, c: &Checkpoint) -> Result<()> {
        let (plan, p) = (self.plan, &self.plan.program);
        let w = plan.mesh.world_size();
        let m = &c.manifest;
        if !m.model_fingerprint.is_empty()
            && !plan.model_fingerprint.is_empty()
            && m.model_fingerprint != plan.model_fingerprint
        {
            return Err(miette!(
                "{}: written for another model ({} with parameter fingerprint {}...); this plan trains {} ({}...)",
                c.path.display(),
                m.model,
                &m.model_fingerprint[..12.min(m.model_fingerprint.len())],
                plan.model,
                &plan.model_fingerprint[..12.min(plan.model_fingerprint.len())]
            ));
        }
        if m.plan_hash == plan.content_hash {
            ex.restore(&c.ranks)
                .map_err(|e| miette!("{}: {e}", c.path.display()))?;
            self.println(format!(
                "resumed from {} (step {})",
                c.path.display(),
                m.step
            ))?;
        } else {
            let want: Vec<Vec<(String, TensorType)>> = (0..w)
                .map(|_| {
                    p.params
                        .iter()
                        .map(|x| x.value)
                        .chain(p.states.iter().map(|s| s.value))
                        .map(|v| (p.value(v).name.clone(), p.ty(v).clone()))
                        .collect()
                })
                .collect();
            let values = c
                .reshard(&plan.mesh, &plan.layouts, &want)
                .map_err(|e| miette!("{e}"))?;
            ex.restore(&values)
                .map_err(|e| miette!("{}: {e}", c.path.display()))?;
            self.println(format!(
                "resumed from {} (step {}), resharded from {} ({}, {} rank{}) to {} ({}, {w} rank{})",
                c.path.display(),
                m.step,
                m.mesh,
                m.strategy,
                m.world_size(),
                if m.world_size() == 1 { "" } else { "s" },
                plan.mesh,
                plan.strategy,
                if w == 1 { "" } else { "s" }
            ))?;
        }
        Ok(())
    }

    /// Writes the checkpoint of step `done` (run at learning rate `lr`) into `dir`.
    fn save_checkpoint(
        &self,
        ex: &dyn PlanExecutor,
        dir: &Path,
        done: usize,
        lr: f64,
        pb: &Option<indicatif::ProgressBar>,
        procs: Option<&mut crate::procs::Procs>,
    ) -> Result<()> {
        let (args, plan, s) = (self.args, self.plan, &self.args.session);
        let manifest = Manifest {
            format: checkpoint::FORMAT,
            run: self.run.clone(),
            step: done,
            model: plan.model.clone(),
            names: plan.model_edits.as_ref().and_then(|e| e.names.clone()),
            model_fingerprint: plan.model_fingerprint.clone(),
            plan_hash: plan.content_hash.clone(),
            strategy: plan.strategy.clone(),
            mesh: plan.mesh.clone(),
            micro_batches: plan.micro_batches,
            layouts: plan.layouts.clone(),
            data: self
                .feed
                .as_ref()
                .zip(s.data.as_ref())
                .map(|(f, path)| DataPosition {
                    file: path.display().to_string(),
                    tokens: f.tokens(),
                    samples: self.samples,
                    batch: f.rows,
                    seq: f.seq,
                    shuffle: s.shuffle,
                }),
            schedule: Some(*self.schedule),
            lr,
            files: Vec::new(),
            manifest_sha256: String::new(),
        };
        let t0 = std::time::Instant::now();
        let rank0 = procs.as_ref().is_none_or(|p| p.rank() == 0);
        let (path, bytes) = match procs {
            // every process writes its ranks' files; rank 0 the manifest, last
            Some(p) => p.save_checkpoint(ex, dir, manifest)?,
            None => {
                let per_rank: Vec<Vec<(String, Tensor)>> = (0..plan.mesh.world_size())
                    .map(|r| ex.persistent(r))
                    .collect::<Result<_, _>>()
                    .map_err(|e| miette!("{e}"))?;
                checkpoint::save(dir, manifest, &per_rank).map_err(|e| miette!("{e}"))?
            }
        };
        if let (Some(keep), true) = (args.keep, rank0) {
            let mut notes = Vec::new();
            checkpoint::prune(
                dir,
                &self.run,
                done,
                keep,
                self.resumed_from.as_deref(),
                &mut |n| notes.push(n),
            )
            .map_err(|e| miette!("{e}"))?;
            for n in notes {
                if self.noted.borrow_mut().insert(n.clone()) {
                    eprintln!("note: {n}");
                }
            }
        }
        if self.text {
            session::say(
                pb,
                &format!(
                    "checkpoint {} ({}, {:.1} ms)",
                    path.display(),
                    hzp_ir::plan::format_bytes(bytes),
                    t0.elapsed().as_secs_f64() * 1e3
                ),
            )?;
        }
        Ok(())
    }
}
