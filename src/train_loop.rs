//! The step loop of `hzp run` when it trains for real: token batches, the learning-rate
//! schedule, evaluation, metrics, checkpoints and resume (see `session` and
//! `hzp_runtime::checkpoint`).

use crate::run::RunArgs;
use crate::session::{self, Evaluator, Metrics, TokenFeed};
use hzp_ir::plan::Plan;
use hzp_ir::{Tensor, TensorType};
use hzp_runtime::checkpoint::{self, DataPosition, Manifest};
use hzp_runtime::exec::{Executor, StepStats};
use hzp_runtime::schedule::LrSchedule;
use miette::{miette, Result};

/// Runs `plan` from the step a checkpoint left (or 0) to `--steps`, printing a line per
/// step; returns the steps' statistics.
pub fn run_loop(
    args: &RunArgs,
    plan: &Plan,
    ex: &mut Executor,
    fixed: &[(String, Tensor)],
    schedule: &LrSchedule,
) -> Result<Vec<StepStats>> {
    let w = plan.mesh.world_size();
    let p = &plan.program;
    let s = &args.session;
    let text = args.format == crate::Format::Text;
    // With --format json, stdout holds the JSON document only.
    let println = |line: String| -> Result<()> {
        if text {
            outln!("{line}");
        }
        Ok(())
    };
    let raw = s.dtype()?;
    let mut feed = match &s.data {
        Some(path) => {
            let v = session::token_input(p, s.data_input.as_deref())?;
            let ty = p.ty(v);
            let (rows, seq) = (ty.shape[0] * w, ty.shape[1]);
            let vocab = session::vocab_of(p, v);
            let f = TokenFeed::open(
                path,
                raw,
                &p.value(v).name,
                ty.dtype,
                rows,
                seq,
                vocab,
                s.shuffle,
            )?;
            println(format!(
                "data: {}, batches of {rows} x {seq}{}",
                f.describe(),
                vocab.map_or(String::new(), |v| format!(", ids checked below {v}"))
            ))?;
            Some(f)
        }
        None => None,
    };
    let eval_every = s.eval_period(args.steps)?;
    let mut evaluator = match (&s.val_data, &feed) {
        (Some(vp), Some(f)) => {
            let program = crate::run::eval_program(args, plan)?;
            let v = session::token_input(&program, Some(&f.input))?;
            let vf = TokenFeed::open(
                vp,
                raw,
                &f.input,
                program.ty(v).dtype,
                f.rows,
                f.seq,
                session::vocab_of(p, session::token_input(p, Some(&f.input))?),
                None,
            )?;
            let e = Evaluator::new(program, vf, s.eval_batches)?;
            println(format!("evaluation: {}", e.describe()))?;
            Some(e)
        }
        (Some(_), None) => {
            return Err(miette!(
                "--val-data needs --data (evaluation reads batches of the training shape)"
            ))
        }
        _ => None,
    };
    let ckpt_dir = args.checkpoint_dir.as_deref();
    if ckpt_dir.is_none() && (args.resume || args.checkpoint_every.is_some() || args.keep.is_some())
    {
        return Err(miette!(
            "--resume, --checkpoint-every and --keep need --checkpoint-dir DIR"
        ));
    }
    if args.checkpoint_every == Some(0) || args.keep == Some(0) {
        return Err(miette!("--checkpoint-every and --keep must be at least 1"));
    }

    // Resume.
    let mut start = 0usize;
    let mut samples = 0u64;
    if let (true, Some(dir)) = (args.resume, ckpt_dir) {
        match checkpoint::latest(dir, &mut |n| eprintln!("note: {n}"))
            .map_err(|e| miette!("{e}"))?
        {
            None => eprintln!(
                "note: --resume: no checkpoint in {} yet; starting at step 0",
                dir.display()
            ),
            Some(c) => {
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
                    println(format!(
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
                    println(format!(
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
                start = m.step;
                if let (Some(d), Some(f)) = (&m.data, &feed) {
                    samples = d.samples;
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
                } else if let Some(f) = &feed {
                    samples = (start * f.rows) as u64;
                }
                if let Some(old) = &m.schedule {
                    if old != schedule {
                        eprintln!(
                            "note: the checkpoint's run had learning rate {old}; this run uses {schedule}"
                        );
                    }
                }
                ex.set_steps_run(start);
            }
        }
    }
    let end = args.stop_at.map_or(args.steps, |n| n.min(args.steps));
    if start >= end {
        println(format!(
            "nothing to run: {start} steps done, --steps {}",
            args.steps
        ))?;
        return Ok(Vec::new());
    }

    let mut metrics = Metrics::open(s.log.as_deref())?;
    let pb = if text {
        session::progress(args.steps, start)
    } else {
        None
    };
    let norm_name = (p.outputs.len() > 1).then(|| p.value(p.outputs[1]).name.clone());
    let mut out = Vec::with_capacity(end - start);
    for step in start..end {
        let lr = schedule.at(step);
        let mut batch: Vec<(String, Tensor)> = fixed
            .iter()
            .filter(|(k, _)| feed.as_ref().is_none_or(|f| *k != f.input))
            .cloned()
            .collect();
        if let Some(f) = feed.as_mut() {
            batch.push(f.batch(samples)?);
        }
        let batch = hzp_passes::train::with_lr(p, &batch, lr);
        ex.set_inputs(&batch)
            .map_err(|e| miette!("step {}: {e}", step + 1))?;
        let st = ex.step().map_err(|e| miette!("{e}"))?;
        if let Some(f) = &feed {
            samples += f.rows as u64;
        }
        let done = step + 1;
        let tokens = feed.as_ref().map(|f| f.rows * f.seq);
        let grad_norm = norm_name
            .as_deref()
            .and_then(|n| ex.value(0, n))
            .and_then(|t| t.to_f64_vec().first().copied());
        let val = match (&mut evaluator, eval_every) {
            (Some(e), Some(k)) if done.is_multiple_of(k) || done == args.steps => {
                Some(e.loss(&ex.parameters())?)
            }
            _ => None,
        };
        let secs = st.wall.as_secs_f64();
        let mut line = format!(
            "step {:>4}  loss {}  lr {lr:.3e}  ({:.1} ms",
            st.step,
            st.loss.map_or("-".to_string(), |l| format!("{l:.6}")),
            secs * 1e3
        );
        if let Some(t) = tokens {
            line.push_str(&format!(", {:.0} tokens/s", t as f64 / secs.max(1e-12)));
        }
        line.push(')');
        if let Some(v) = val {
            line.push_str(&format!("  val_loss {v:.6}"));
        }
        if text {
            session::say(&pb, &line)?;
        }
        if let Some(b) = &pb {
            b.set_position(done as u64);
            if let Some(l) = st.loss {
                b.set_message(format!("loss {l:.4}"));
            }
        }
        let mut rec = serde_json::json!({
            "step": done,
            "loss": st.loss,
            "lr": lr,
            "step_seconds": secs,
        });
        if let Some(t) = tokens {
            rec["tokens_per_s"] = serde_json::json!(t as f64 / secs.max(1e-12));
        }
        if let Some(g) = grad_norm {
            rec["grad_norm"] = serde_json::json!(g);
        }
        if let Some(v) = val {
            rec["val_loss"] = serde_json::json!(v);
        }
        metrics.write(&rec)?;
        out.push(st);
        if let Some(dir) = ckpt_dir {
            let due = args
                .checkpoint_every
                .is_some_and(|k| done.is_multiple_of(k));
            if due || done == end {
                let manifest = Manifest {
                    format: checkpoint::FORMAT,
                    step: done,
                    model: plan.model.clone(),
                    model_fingerprint: plan.model_fingerprint.clone(),
                    plan_hash: plan.content_hash.clone(),
                    strategy: plan.strategy.clone(),
                    mesh: plan.mesh.clone(),
                    micro_batches: plan.micro_batches,
                    layouts: plan.layouts.clone(),
                    data: feed
                        .as_ref()
                        .zip(s.data.as_ref())
                        .map(|(f, path)| DataPosition {
                            file: path.display().to_string(),
                            tokens: f.tokens(),
                            samples,
                            batch: f.rows,
                            seq: f.seq,
                            shuffle: s.shuffle,
                        }),
                    schedule: Some(*schedule),
                    lr,
                    files: Vec::new(),
                };
                let per_rank: Vec<Vec<(String, Tensor)>> =
                    (0..w).map(|r| ex.persistent(r)).collect();
                let t0 = std::time::Instant::now();
                let (path, bytes) = checkpoint::save(dir, manifest, &per_rank, args.keep)
                    .map_err(|e| miette!("{e}"))?;
                let say = |l: &str| -> Result<()> {
                    if text {
                        session::say(&pb, l)?;
                    }
                    Ok(())
                };
                say(&format!(
                    "checkpoint {} ({}, {:.1} ms)",
                    path.display(),
                    hzp_ir::plan::format_bytes(bytes),
                    t0.elapsed().as_secs_f64() * 1e3
                ))?;
            }
        }
    }
    if let Some(b) = pb {
        b.finish_and_clear();
    }
    Ok(out)
}
