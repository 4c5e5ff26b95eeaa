//! What a training run needs around the step program, shared by `hzp run` and `hzp train`:
//! batches from a token file, the learning-rate schedule, evaluation on held-out tokens,
//! metrics (`--log`, JSON lines) and progress output.

use hzp_frontends::tokens::{Sampler, TokenDtype, TokenFile};
use hzp_ir::plan::Plan;
use hzp_ir::{DType, Program, Tensor, ValueId};
use hzp_runtime::executor::eval::PlanEvaluator;
use hzp_runtime::executor::PlanExecutor;
use hzp_runtime::schedule::{LrSchedule, ScheduleKind};
use miette::{miette, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Flags of a training run (both `hzp run` and `hzp train`).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct LoopArgs {
    /// Train on this token file: raw little-endian token ids (nanoGPT's train.bin, u16 by
    /// default) or llm.c's .bin (recognised by its header). The input `[B, T]` of the model
    /// gives the global batch and sequence length; step s, row r reads window
    /// (s*B + r) mod floor(N/T) of T tokens.
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// Token width of a raw --data / --val-data file: u16 (default) or u32.
    #[arg(long, value_name = "u16|u32")]
    pub data_dtype: Option<String>,
    /// The integer input the tokens go to (default: input_ids, or the model's only 2-D
    /// integer input).
    #[arg(long, value_name = "NAME")]
    pub data_input: Option<String>,
    /// Permute the windows of each epoch with this seed (default: file order).
    #[arg(long, value_name = "SEED")]
    pub shuffle: Option<u64>,
    /// Learning-rate schedule: constant, cosine or linear (nanoGPT's get_lr, decaying to
    /// --min-lr at the last of --steps).
    #[arg(long, default_value = "constant", value_parser = crate::choices(&[("constant", &[]), ("cosine", &[]), ("linear", &[])]))]
    pub lr_schedule: String,
    /// Steps of linear warmup: lr * (it + 1) / (warmup + 1).
    #[arg(long, default_value_t = 0, value_name = "W")]
    pub warmup: usize,
    /// Where cosine / linear decay ends (default: a tenth of the learning rate).
    #[arg(long, value_name = "X")]
    pub min_lr: Option<f64>,
    /// Held-out token file for evaluation (same format as --data).
    #[arg(long, value_name = "FILE")]
    pub val_data: Option<PathBuf>,
    /// Evaluate every K steps (and after the last step) when --val-data is given.
    #[arg(long, value_name = "K")]
    pub eval_every: Option<usize>,
    /// Batches (of the training batch's shape) per evaluation: the first E of --val-data
    /// (default 4, or as many as the file holds when fewer; at most what it holds).
    #[arg(long, value_name = "E")]
    pub eval_batches: Option<usize>,
    /// Append one JSON object per step to this file (step, loss, lr, tokens_per_s,
    /// step_seconds, grad_norm when clipping, val_loss on evaluation steps).
    #[arg(long, value_name = "metrics.jsonl")]
    pub log: Option<PathBuf>,
}

impl LoopArgs {
    /// Whether anything asks for more than repeating one batch at a constant rate.
    pub fn is_plain(&self) -> bool {
        self.data.is_none()
            && self.val_data.is_none()
            && self.log.is_none()
            && self.lr_schedule == "constant"
            && self.warmup == 0
    }

    pub fn dtype(&self) -> Result<Option<TokenDtype>> {
        self.data_dtype
            .as_deref()
            .map(TokenDtype::parse)
            .transpose()
            .map_err(|e| miette!("{e}"))
    }

    /// The schedule for a run of `steps` steps with maximum `lr`.
    pub fn schedule(&self, lr: f64, steps: usize) -> Result<LrSchedule> {
        let kind = ScheduleKind::parse(&self.lr_schedule).map_err(|e| miette!("{e}"))?;
        let min_lr = self.min_lr.unwrap_or(lr / 10.0);
        LrSchedule::new(kind, lr, self.warmup, min_lr, steps).map_err(|e| miette!("{e}"))
    }

    /// Checks the evaluation flags; returns the evaluation period when evaluating.
    pub fn eval_period(&self, steps: usize) -> Result<Option<usize>> {
        match (&self.val_data, self.eval_every) {
            (None, Some(_)) => Err(miette!("--eval-every needs --val-data FILE")),
            (None, None) => Ok(None),
            (Some(_), k) => {
                if self.eval_batches == Some(0) {
                    return Err(miette!("--eval-batches must be at least 1"));
                }
                match k {
                    Some(0) => Err(miette!("--eval-every must be at least 1")),
                    Some(k) => Ok(Some(k)),
                    None => Ok(Some(steps.max(1))),
                }
            }
        }
    }
}

/// The token input of `p`: `--data-input`, else `input_ids`, else the only 2-D integer
/// input.
pub fn token_input(p: &Program, asked: Option<&str>) -> Result<ValueId> {
    let ints: Vec<ValueId> = p
        .inputs
        .iter()
        .copied()
        .filter(|&v| matches!(p.ty(v).dtype, DType::I64 | DType::I32) && p.ty(v).rank() == 2)
        .collect();
    let names = || {
        p.inputs
            .iter()
            .map(|&v| format!("{} ({})", p.value(v).name, p.ty(v)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(n) = asked {
        return ints
            .iter()
            .copied()
            .find(|&v| p.value(v).name == n)
            .ok_or_else(|| {
                miette!(
                    "--data-input {n}: not a 2-D integer input of the model (its inputs: {})",
                    names()
                )
            });
    }
    if let Some(&v) = ints.iter().find(|&&v| p.value(v).name == "input_ids") {
        return Ok(v);
    }
    match ints.as_slice() {
        [v] => Ok(*v),
        [] => Err(miette!(
            "--data: the model has no 2-D integer input to take tokens (its inputs: {})",
            names()
        )),
        _ => Err(miette!(
            "--data: the model has several 2-D integer inputs; pass --data-input NAME (its inputs: {})",
            names()
        )),
    }
}

/// The training feed (`--data`) for the token input of `p` (a per-rank program of `ranks`
/// ranks: batches of `ranks` times its rows), and with `--val-data` the held-out feed of the
/// same shape. Token ids are checked against the table or classes the input indexes
/// (`hzp_runtime::index_check::index_bounds`). `None` without `--data`.
pub fn open_feeds(
    args: &LoopArgs,
    p: &Program,
    ranks: usize,
) -> Result<Option<(TokenFeed, Option<TokenFeed>)>> {
    let Some(path) = &args.data else {
        if args.val_data.is_some() {
            return Err(miette!(
                "--val-data needs --data (evaluation reads batches of the training shape)"
            ));
        }
        return Ok(None);
    };
    let raw = args.dtype()?;
    let token = token_input(p, args.data_input.as_deref())?;
    let ty = p.ty(token);
    let rows = ty.shape[0] * ranks;
    let vocab = hzp_runtime::index_check::index_bounds(p)
        .get(&token)
        .map(|u| u.bound);
    let open = |path: &Path, shuffle| {
        TokenFeed::open(
            path,
            raw,
            &p.value(token).name,
            ty.dtype,
            rows,
            ty.shape[1],
            vocab,
            shuffle,
        )
    };
    let train = open(path, args.shuffle)?;
    let val = args
        .val_data
        .as_deref()
        .map(|v| open(v, None))
        .transpose()?;
    Ok(Some((train, val)))
}

/// The global batch of one step: the fixed inputs (but the tokens), the feed's batch of
/// samples `first ..`, and the learning rate.
pub fn step_batch(
    p: &Program,
    fixed: &[(String, Tensor)],
    feed: Option<&mut TokenFeed>,
    first: u64,
    lr: f64,
) -> Result<Vec<(String, Tensor)>> {
    let mut batch: Vec<(String, Tensor)> = fixed
        .iter()
        .filter(|(k, _)| feed.as_ref().is_none_or(|f| *k != f.input))
        .cloned()
        .collect();
    if let Some(f) = feed {
        batch.push(f.batch(first)?);
    }
    Ok(hzp_passes::train::with_lr(p, &batch, lr))
}

/// What one step of a training run reports: its line and its `--log` record.
pub struct StepReport {
    /// 1-based.
    pub step: usize,
    pub loss: Option<f64>,
    pub lr: f64,
    pub seconds: f64,
    /// Tokens of the step's batch (from a token file).
    pub tokens: Option<usize>,
    pub grad_norm: Option<f64>,
    pub val_loss: Option<f64>,
}

impl StepReport {
    fn tokens_per_s(&self) -> Option<f64> {
        self.tokens.map(|t| t as f64 / self.seconds.max(1e-12))
    }

    pub fn line(&self) -> String {
        let mut l = format!(
            "step {:>4}  loss {}  lr {:.3e}  ({:.1} ms",
            self.step,
            self.loss.map_or("-".to_string(), |l| format!("{l:.6}")),
            self.lr,
            self.seconds * 1e3
        );
        if let Some(t) = self.tokens_per_s() {
            l.push_str(&format!(", {t:.0} tokens/s"));
        }
        l.push(')');
        if let Some(v) = self.val_loss {
            l.push_str(&format!("  val_loss {v:.6}"));
        }
        l
    }

    pub fn json(&self) -> serde_json::Value {
        let mut rec = serde_json::json!({
            "step": self.step,
            "loss": self.loss,
            "lr": self.lr,
            "step_seconds": self.seconds,
        });
        if let Some(t) = self.tokens_per_s() {
            rec["tokens_per_s"] = serde_json::json!(t);
        }
        if let Some(g) = self.grad_norm {
            rec["grad_norm"] = serde_json::json!(g);
        }
        if let Some(v) = self.val_loss {
            rec["val_loss"] = serde_json::json!(v);
        }
        rec
    }
}

/// Batches of `[rows, seq]` tokens from a token file.
pub struct TokenFeed {
    file: TokenFile,
    sampler: Sampler,
    pub input: String,
    pub rows: usize,
    pub seq: usize,
    dtype: DType,
    vocab: Option<usize>,
}

impl TokenFeed {
    /// `rows` x `seq` batches of `path` for the input named `input` (of `dtype`).
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        path: &Path,
        raw: Option<TokenDtype>,
        input: &str,
        dtype: DType,
        rows: usize,
        seq: usize,
        vocab: Option<usize>,
        shuffle: Option<u64>,
    ) -> Result<TokenFeed> {
        let file = TokenFile::open(path, raw).map_err(|e| miette!("{e}"))?;
        let windows = file.windows(seq);
        if windows == 0 {
            return Err(miette!(
                "{}: {} tokens, fewer than one sequence of {seq}",
                path.display(),
                file.len()
            ));
        }
        Ok(TokenFeed {
            sampler: Sampler::new(windows, shuffle),
            file,
            input: input.to_string(),
            rows,
            seq,
            dtype,
            vocab,
        })
    }

    pub fn tokens(&self) -> usize {
        self.file.len()
    }

    /// Whole batches of `rows` windows the file holds.
    pub fn batches(&self) -> usize {
        self.sampler.windows() / self.rows.max(1)
    }

    /// The line a run prints about its training data.
    pub fn data_line(&self) -> String {
        format!(
            "data: {}, batches of {} x {}{}",
            self.describe(),
            self.rows,
            self.seq,
            self.vocab
                .map_or(String::new(), |v| format!(", ids checked below {v}"))
        )
    }

    pub fn describe(&self) -> String {
        format!(
            "{} ({} file, {} tokens of {}, {} windows of {})",
            self.file.path().display(),
            self.file.format(),
            self.file.len(),
            self.file.dtype().name(),
            self.sampler.windows(),
            self.seq
        )
    }

    /// The batch of samples `first .. first + rows`.
    pub fn batch(&mut self, first: u64) -> Result<(String, Tensor)> {
        let mut ids = Vec::with_capacity(self.rows * self.seq);
        for r in 0..self.rows {
            let w = self.sampler.window(first + r as u64);
            self.file
                .read_window(w, self.seq, self.vocab, &mut ids)
                .map_err(|e| miette!("{e}"))?;
        }
        let shape = vec![self.rows, self.seq];
        let t = match self.dtype {
            DType::I32 => Tensor::from_f64(
                DType::I32,
                shape,
                &ids.iter().map(|&x| x as f64).collect::<Vec<_>>(),
            ),
            _ => Tensor::i64(shape, ids),
        };
        Ok((self.input.clone(), t))
    }
}

/// `--log`: one JSON object per line, appended (a resumed run goes on in the same file).
pub struct Metrics {
    file: Option<(PathBuf, std::fs::File)>,
}

impl Metrics {
    pub fn open(path: Option<&Path>) -> Result<Metrics> {
        let file = match path {
            None => None,
            Some(p) => {
                if let Ok(m) = std::fs::metadata(p) {
                    if !m.is_file() {
                        return Err(miette!("--log {}: not a regular file", p.display()));
                    }
                }
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| miette!("--log {}: {e}", p.display()))?;
                Some((p.to_path_buf(), f))
            }
        };
        Ok(Metrics { file })
    }

    pub fn write(&mut self, v: &serde_json::Value) -> Result<()> {
        if let Some((p, f)) = &mut self.file {
            let mut line = v.to_string();
            line.push('\n');
            f.write_all(line.as_bytes())
                .map_err(|e| miette!("--log {}: {e}", p.display()))?;
        }
        Ok(())
    }
}

/// A progress bar on a terminal (stderr), for runs long enough to want one.
pub fn progress(steps: usize, start: usize) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if steps < 20 || !std::io::stderr().is_terminal() {
        return None;
    }
    let pb = indicatif::ProgressBar::new(steps as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{bar:40} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
    ) {
        pb.set_style(style);
    }
    pb.set_position(start as u64);
    Some(pb)
}

/// Prints a line above the progress bar (or plainly without one).
pub fn say(pb: &Option<indicatif::ProgressBar>, line: &str) -> Result<()> {
    match pb {
        Some(b) => b.println(line),
        None => outln!("{line}"),
    }
    Ok(())
}

/// Forward-only loss on the first `batches` batches of a held-out token file: the model's
/// forward and loss at one chunk of rows, run over the global batch chunk by chunk with the
/// current parameters. The same batches at every rank count; no optimizer state is touched.
pub struct Evaluator {
    program: Program,
    feed: TokenFeed,
    batches: usize,
    chunk: usize,
    /// The evaluation plan on the run's backend ([`Evaluator::on_executor`]); `None`: the
    /// CPU evaluator runs the program.
    plan: Option<PlanEvaluator>,
}

/// Evaluation batches without `--eval-batches`.
pub const DEFAULT_EVAL_BATCHES: usize = 4;

impl Evaluator {
    /// `program`: forward + loss (output 0) at `chunk` rows; `feed`: the global batches.
    ///
    /// `batches`: `--eval-batches`, at most the whole batches the file holds (one when it
    /// holds less than a batch: its windows repeat); default 4, or fewer when the file
    /// holds fewer.
    pub fn new(program: Program, feed: TokenFeed, batches: Option<usize>) -> Result<Evaluator> {
        hzp_frontends::limits::check_result_sizes(&program).map_err(|e| miette::miette!("{e}"))?;
        let held = feed.batches().max(1);
        let batches = match batches {
            None => DEFAULT_EVAL_BATCHES.min(held),
            Some(e) if e > held => {
                return Err(miette!(
                    "--eval-batches {e}: {} holds {} windows of {} tokens, that is {held} batch(es) of {} rows; evaluate at most {held}",
                    feed.file.path().display(),
                    feed.sampler.windows(),
                    feed.seq,
                    feed.rows
                ))
            }
            Some(e) => e,
        };
        let input = program
            .inputs
            .iter()
            .copied()
            .find(|&v| program.value(v).name == feed.input)
            .ok_or_else(|| miette!("the evaluation program has no input `{}`", feed.input))?;
        if let Some(&other) = program.inputs.iter().find(|&&v| v != input) {
            return Err(miette!(
                "--val-data: the model takes `{}` besides the tokens; evaluation feeds only the token input (not built yet for other inputs)",
                program.value(other).name
            ));
        }
        let chunk = program.ty(input).shape[0];
        if chunk == 0 || !feed.rows.is_multiple_of(chunk) {
            return Err(miette!(
                "internal: evaluation chunks of {chunk} rows for batches of {}",
                feed.rows
            ));
        }
        Ok(Evaluator {
            program,
            feed,
            batches,
            chunk,
            plan: None,
        })
    }

    pub fn describe(&self) -> String {
        format!("{} batches of {}", self.batches, self.feed.describe())
    }

    /// Runs the evaluation as a plan ([`hzp_passes::plan::eval::eval_plan`] of the forward
    /// and loss, one rank) on the executor `open` loads it into (the run's backend) instead
    /// of the CPU evaluator. `open` is given the plan and the model's parameters; `model`
    /// names the model in the plan.
    pub fn on_executor(
        &mut self,
        model: &str,
        open: impl FnOnce(&Plan, &[(String, Tensor)]) -> Result<Box<dyn PlanExecutor>>,
    ) -> Result<()> {
        let plan = hzp_passes::plan::eval::eval_plan(&self.program, model)
            .map_err(|e| miette!("evaluation plan: {e}"))?;
        let p = &self.program;
        let params = p
            .params
            .iter()
            .map(|x| {
                let name = &p.value(x.value).name;
                x.data.clone().map(|t| (name.clone(), t)).ok_or_else(|| {
                    miette!("evaluation: the model has no data for parameter `{name}`")
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let ex = open(&plan, &params)?;
        self.plan = Some(PlanEvaluator::new(ex, &params).map_err(|e| miette!("evaluation: {e}"))?);
        Ok(())
    }

    /// Where the evaluation runs: the device of its executor, or the CPU.
    pub fn device(&self) -> String {
        self.plan
            .as_ref()
            .map_or_else(|| "the CPU".to_string(), |e| e.device())
    }

    /// The mean loss over the evaluation batches with parameters `params` (by name; others
    /// keep the model's values).
    pub fn loss(&mut self, params: &[(String, Tensor)]) -> Result<f64> {
        match &mut self.plan {
            Some(e) => e
                .set_parameters(params)
                .map_err(|e| miette!("evaluation: {e}"))?,
            None => {
                for prm in self.program.params.iter_mut() {
                    let name = &self.program.values[prm.value.index()].name;
                    if let Some((_, t)) = params.iter().find(|(k, _)| k == name) {
                        prm.data = Some(t.clone());
                    }
                }
            }
        }
        let mut total = 0.0;
        let mut n = 0usize;
        for b in 0..self.batches {
            let (name, t) = self.feed.batch((b * self.feed.rows) as u64)?;
            let ids = t.to_f64_vec();
            let row = self.feed.seq;
            for c in 0..self.feed.rows / self.chunk {
                let part = &ids[c * self.chunk * row..(c + 1) * self.chunk * row];
                let x = Tensor::from_f64(t.dtype(), vec![self.chunk, row], part);
                total += self.chunk_loss(&[(name.clone(), x)])?;
                n += 1;
            }
        }
        Ok(total / n.max(1) as f64)
    }

    /// The loss of one chunk of rows.
    fn chunk_loss(&mut self, batch: &[(String, Tensor)]) -> Result<f64> {
        if let Some(e) = &mut self.plan {
            return e.loss(batch).map_err(|e| miette!("evaluation: {e}"));
        }
        let outs = hzp_runtime::eval::evaluate(&self.program, batch)
            .map_err(|e| miette!("evaluation: {e}"))?;
        outs.first()
            .map(|(_, t)| t.to_f64_vec())
            .and_then(|v| v.first().copied())
            .ok_or_else(|| miette!("evaluation: the loss program has no output"))
    }
}
