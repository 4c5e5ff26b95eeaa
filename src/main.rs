//! `hzp`: the command-line interface, a thin facade over the crates.

#[macro_use]
mod stdio;
mod bench_compile;
mod commands;
mod compile;
mod data_cmd;
mod files;
mod launch;
mod plan_file;
mod procs;
mod run;
mod run_args;
mod session;
mod simulate;
mod train_loop;

// The compiler builds and frees millions of small vectors for a 100B-scale plan; mimalloc
// takes about a fifth off `hzp compile` next to glibc's allocator.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "hzp",
    version,
    about = "Compile models into AsyncHZP training plans, inspect them, and run them",
    long_about = "hzp reads a model (an ONNX file exported from PyTorch, hzp's own .hzp text IR, \
or preset:NAME for shapes-only GPT/Llama/MoE configs) and turns it into IR that it can print, \
summarize, evaluate and train on the CPU, compile into a per-rank AsyncHZP plan, simulate on a \
modeled cluster, and run on N ranks (threads of one process on the CPU, or one process per rank \
under hzp launch, torchrun or srun; one process per GPU \
with the cuda backend, which needs a build with --features cuda: checked on one H100 / H200, \
every rank of a plan on that GPU; NCCL across several GPUs has not run yet)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Memory budget for the data one input file may declare (arrays of an .npz, a model's
    /// weights and external data), checked before anything is allocated, e.g. 8GiB.
    /// Default: half of this machine's RAM. (Not the per-rank device budget: that is
    /// `--memory` of compile, compare and scale.)
    #[arg(long, global = true, value_name = "BYTES")]
    input_budget: Option<String>,
    /// The older name of --input-budget (still read, with a note).
    #[arg(long, global = true, hide = true, value_name = "BYTES")]
    max_memory: Option<String>,
}

/// The values of a choice flag, for clap: `--help` lists the names and shells complete them;
/// each name's aliases (other or older spellings) are accepted but not listed. Matching
/// ignores case where the flag says `ignore_case = true`.
pub fn choices(values: &[(&'static str, &[&'static str])]) -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(values.iter().map(|(name, aliases)| {
        clap::builder::PossibleValue::new(*name).aliases(aliases.iter().copied())
    }))
}

/// `--recompute`'s values on every command that takes it (`--recompute` alone means on).
pub fn recompute_choices() -> clap::builder::PossibleValuesParser {
    choices(&[
        ("on", &["true", "yes"]),
        ("off", &["false", "no"]),
        ("auto", &[]),
    ])
}

/// `--strategy`'s values (hzp_passes' `Strategy::parse` also takes these aliases).
pub fn strategy_choices() -> clap::builder::PossibleValuesParser {
    choices(&[
        ("asynchzp", &["async-hzp", "async_hzp", "hzp"]),
        ("zero1", &["zero-1"]),
        ("zero2", &["zero-2"]),
        ("zero3", &["zero-3", "fsdp"]),
        ("hsdp", &[]),
        ("ddp", &[]),
        ("acco", &[]),
        ("asyncmesh", &["async-mesh", "async_mesh"]),
    ])
}

/// `--reduce-grads`'s values.
pub fn reduce_grads_choices() -> clap::builder::PossibleValuesParser {
    choices(&[
        (
            "per-microbatch",
            &[
                "microbatch",
                "micro-batch",
                "per-micro-batch",
                "per_microbatch",
            ],
        ),
        ("per-step", &["step", "per_step"]),
    ])
}

/// Flags that say how to read a model.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct ModelArgs {
    /// The model: FILE.onnx, FILE.hzp, or preset:NAME[,key=value...] (e.g. preset:gpt3-175b,
    /// preset:llama,layers=4,hidden=512).
    pub model: String,
    /// Bind symbolic input dims: NAME=AxBxC (repeat the flag or separate with commas),
    /// e.g. --shape input_ids=8x2048.
    #[arg(long = "shape", value_name = "NAME=AxB")]
    pub shapes: Vec<String>,
    /// Give the value of an input that decides a shape (a Reshape target, Slice bounds,
    /// reduce axes, TopK's k fed as a graph input): NAME=1,2,3 (repeat the flag). The
    /// program is specialized on it; running it with another value is an error. Arrays of
    /// --inputs are used the same way.
    #[arg(long = "bind", value_name = "NAME=V,V,...")]
    pub bind: Vec<String>,
    /// Keep an ONNX model's attention as the exporter wrote it (products, mask, softmax)
    /// instead of one fused Attention op per layer (the default fuses it).
    #[arg(long = "no-fuse-attention")]
    pub no_fuse_attention: bool,
    /// Keep an ONNX model's mixture-of-experts blocks as the exporter wrote them (each
    /// choice's expert weights gathered) instead of routing tokens to their experts
    /// (MoeDispatch, batched expert products, MoeCombine; the default).
    #[arg(long = "no-fuse-moe")]
    pub no_fuse_moe: bool,
    /// The name map of an ONNX model (what frontends/python/hzp_export.py writes): which
    /// PyTorch state_dict keys each initializer stands for. Default: <stem>.names.json
    /// beside the model, when it exists.
    #[arg(long = "names", value_name = "FILE.names.json")]
    pub names: Option<PathBuf>,
}

/// Flags that define the training step.
#[derive(clap::Args, Clone, Debug)]
pub struct TrainArgs {
    /// Loss: lm (causal LM on --labels, default input_ids), ce (--labels NAME), mean (of the
    /// first output), mse (--target NAME).
    #[arg(long, default_value = "lm", value_parser = choices(&[("lm", &[]), ("ce", &[]), ("mean", &[]), ("mse", &[])]))]
    pub loss: String,
    /// The integer input holding class ids (ce) or tokens (lm; default input_ids).
    #[arg(long)]
    pub labels: Option<String>,
    /// The float input the output is compared with (mse).
    #[arg(long)]
    pub target: Option<String>,
    /// Add COEF times the routers' auxiliary load-balancing loss, as transformers computes
    /// it for Mixtral and Qwen3-MoE (`router_aux_loss_coef`; statistics per micro-batch).
    /// Needs routed MoE layers; 0 (the default) adds nothing.
    #[arg(long, value_name = "COEF", default_value_t = 0.0)]
    pub router_aux_loss: f64,
    /// adamw, sgd, or muon (torch.optim.Muon on the hidden matrices, AdamW on the rest).
    #[arg(long, default_value = "adamw", value_parser = choices(&[("adamw", &[]), ("sgd", &[]), ("muon", &[])]))]
    pub optimizer: String,
    /// Learning rate (with muon: AdamW's, for the parameters Muon does not update).
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Muon's learning rate (--optimizer muon); a schedule scales it as it scales --lr.
    #[arg(long, default_value_t = hzp_passes::train::muon::DEFAULT_LR)]
    pub muon_lr: f64,
    /// Muon's learning-rate adjustment by matrix shape: original (sqrt(max(1, out/in))) or
    /// match_rms_adamw (0.2 sqrt(max(out, in))).
    #[arg(long, default_value = "original", value_parser = choices(&[("original", &[]), ("match_rms_adamw", &[])]))]
    pub muon_adjust_lr: String,
    /// Muon's Newton-Schulz iteration: bf16 (torch.optim.Muon's) or fp32 (f32 throughout:
    /// the same products without bf16 rounding, which the iteration amplifies).
    #[arg(long, default_value = "bf16", value_parser = choices(&[("bf16", &[]), ("fp32", &["f32"])]))]
    pub muon_ns_precision: String,
    /// Where a multi-rank plan runs Muon's Newton-Schulz: replicated (every optimizer rank
    /// orthogonalizes every matrix) or canzona (one owner rank per matrix, balanced; needs
    /// an optimizer group of several ranks).
    #[arg(long, default_value = "replicated", value_parser = choices(&[("replicated", &[]), ("canzona", &[])]))]
    pub muon_placement: String,
    /// AdamW betas, as B1,B2.
    #[arg(long, default_value = "0.9,0.999")]
    pub betas: String,
    /// AdamW epsilon.
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f64,
    /// Weight decay (AdamW: decoupled, default 0.01; SGD: L2, default 0).
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.0)]
    pub momentum: f64,
    /// Clip gradients to this global L2 norm before the update.
    #[arg(long)]
    pub clip_grad_norm: Option<f64>,
    /// Split the batch (axis 0 of every input) into this many micro-batches and accumulate.
    #[arg(long, default_value_t = 1)]
    pub micro_batches: usize,
    /// fp32, bf16 (bf16 compute, fp32 master weights, states and loss) or fp16 (the same
    /// with fp16 compute, no loss scaling; what `hzp run --attention pasa` needs). Default
    /// fp32; bf16 for a preset (`hzp compile preset:...`).
    #[arg(long, value_parser = choices(&[("fp32", &["f32"]), ("bf16", &[]), ("fp16", &["f16"])]))]
    pub precision: Option<String>,
    /// Tie parameters whose values are equal up to a transpose (undoes an exporter's
    /// untying of tied weights, e.g. GPT-2's embedding and LM head).
    #[arg(long)]
    pub retie: bool,
    /// Give every node that reads this parameter its own copy (NAME, NAME.1, NAME.2, ...):
    /// undoes an exporter's merge of equal-valued initializers (e.g. the all-ones norms of
    /// a fresh model). Comma-separated or repeated.
    #[arg(long, value_name = "NAME")]
    pub untie: Vec<String>,
    /// Treat these parameters as constants (not trained), e.g. buffers an exporter stored
    /// as initializers. Comma-separated or repeated.
    #[arg(long, value_name = "NAME")]
    pub freeze: Vec<String>,
    /// Print the program after this stage and go on: import, loss, autodiff, optimizer.
    #[arg(long, value_name = "STAGE")]
    pub print_after: Vec<String>,
}

#[derive(Clone, Copy, Debug, Default, ValueEnum, PartialEq, Eq)]
pub enum Format {
    #[default]
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Import a model and write it as hzp text IR (to stdout, or to -o FILE.hzp with its
    /// weights in FILE.weights.npz).
    Import {
        #[command(flatten)]
        model: ModelArgs,
        /// Take input shapes from the arrays of this .npz (keys = graph input names).
        #[arg(long, value_name = "IN.npz")]
        inputs: Option<PathBuf>,
        /// Output .hzp file; its weights go beside it in <stem>.weights.npz.
        #[arg(short, long, value_name = "OUT.hzp")]
        output: Option<PathBuf>,
    },
    /// Summarize a model: parameters, per-layer table, op histogram, weight memory.
    Show {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, value_name = "IN.npz")]
        inputs: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Run the forward pass on the CPU and write the outputs (keyed by graph output names).
    Eval {
        #[command(flatten)]
        model: ModelArgs,
        /// Input arrays keyed by graph input name (extra keys are ignored).
        #[arg(long, value_name = "IN.npz")]
        inputs: PathBuf,
        /// Where to write the outputs.
        #[arg(short, long, value_name = "OUT.npz")]
        output: Option<PathBuf>,
        /// Compare each output with the array of the same name in this .npz (or, for a
        /// single output, with its only array that is not an input, e.g. `torch_out`).
        #[arg(long, value_name = "REF.npz")]
        reference: Option<PathBuf>,
        /// The array of --reference to compare a one-output model's output with, when the
        /// file has several that are not inputs (default: the array named after the output,
        /// else the only one).
        #[arg(long, value_name = "NAME")]
        reference_key: Option<String>,
        /// Largest allowed absolute difference from --reference (exit 1 above it).
        #[arg(long, default_value_t = 1e-4)]
        tolerance: f64,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Benchmarks: `hzp bench import MODEL` times reading + verifying a model and reports
    /// peak memory; `hzp bench compile [MODEL] --mesh A --mesh B` times compiles per mesh.
    Bench {
        #[command(subcommand)]
        what: BenchWhat,
    },
    /// Compute the loss and the gradient of every parameter on one batch (CPU), written
    /// to an .npz keyed by parameter (ONNX initializer) name, with `loss`.
    Grad {
        #[command(flatten)]
        model: ModelArgs,
        /// The batch: arrays keyed by graph input name (plus labels/targets the loss needs).
        #[arg(long, value_name = "IN.npz")]
        inputs: PathBuf,
        #[command(flatten)]
        train: TrainArgs,
        /// Where to write `loss` and the gradients.
        #[arg(short, long, value_name = "GRADS.npz")]
        output: PathBuf,
    },
    /// Train for N steps on one CPU rank, printing the loss per step.
    Train {
        #[command(flatten)]
        model: ModelArgs,
        /// The batch used at every step: arrays keyed by graph input name (with --data,
        /// the inputs other than the tokens).
        #[arg(long, value_name = "IN.npz")]
        inputs: Option<PathBuf>,
        #[command(flatten)]
        train: TrainArgs,
        /// Number of optimizer steps.
        #[arg(long, default_value_t = 1)]
        steps: usize,
        #[command(flatten)]
        session: session::LoopArgs,
        /// Save the trained parameters (keyed by initializer name) to this .npz.
        #[arg(long, value_name = "P.npz")]
        save_params: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Compile a training plan for a mesh of ranks (choose shard groups, insert collectives,
    /// put them on comm streams, plan memory, verify) and write plan.json.
    Compile {
        #[command(flatten)]
        model: ModelArgs,
        /// The global batch: arrays keyed by input name (their shapes are what matters).
        #[arg(long, value_name = "IN.npz")]
        inputs: Option<PathBuf>,
        #[command(flatten)]
        train: TrainArgs,
        #[command(flatten)]
        compile: compile::CompileArgs,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Print a compiled plan: groups, memory per kind, collectives, per-stream op lists.
    Inspect {
        /// A plan written by `hzp compile -o`.
        plan: PathBuf,
        /// Cluster spec used to split the traffic by link class (default: the 8xH100 DGX
        /// spec, as `hzp compile`).
        #[arg(long, value_name = "SPEC.toml")]
        cluster: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Run a compiled plan on its ranks (CPU threads of this process, one process per rank
    /// under a launcher, or --backend cuda): loss per step, step time, per-stream busy time
    /// and exposed communication; training runs with data, evaluation and checkpoints.
    Run(run_args::RunArgs),
    /// Start one hzp process per GPU with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...
    /// set (torchrun style); output is prefixed by rank; the first failure stops the rest.
    Launch(launch::LaunchArgs),
    /// Simulate one step of a plan on a modeled cluster: step time, exposed communication,
    /// MFU, tokens/s, memory over the step; optionally a Chrome trace and SVG pictures.
    Simulate(simulate::SimulateArgs),
    /// Compile a model with several strategies (same passes) and compare their simulated
    /// step time, MFU, exposed communication, memory and bytes per link class.
    #[command(mut_arg("strategy", |a| a.hide(true)))]
    Compare {
        #[command(flatten)]
        model: ModelArgs,
        /// The global batch: arrays keyed by input name (their shapes are what matters).
        #[arg(long, value_name = "IN.npz")]
        inputs: Option<PathBuf>,
        #[command(flatten)]
        train: TrainArgs,
        #[command(flatten)]
        compile: compile::CompileArgs,
        #[command(flatten)]
        compare: simulate::CompareArgs,
    },
    /// Checkpoints of `hzp run --checkpoint-dir`: `show` them, `export` the full parameters.
    Checkpoint {
        #[command(subcommand)]
        what: data_cmd::CheckpointWhat,
    },
    /// Token data: `prepare` turns text files into a byte-level token file.
    Data {
        #[command(subcommand)]
        what: data_cmd::DataWhat,
    },
    /// Print a shell completion script: `hzp completions bash > /etc/bash_completion.d/hzp`
    /// (zsh: into a folder of $fpath as `_hzp`; fish: ~/.config/fish/completions/hzp.fish).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the CLI reference (every command's --help) as Markdown: docs/cli-reference.md.
    #[command(hide = true)]
    CliReference,
    /// Weak scaling: simulated throughput and linearity per strategy over world sizes, with
    /// tokens per rank fixed.
    Scale {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        train: TrainArgs,
        #[command(flatten)]
        scale: simulate::ScaleArgs,
    },
}

#[derive(Subcommand)]
enum BenchWhat {
    /// Time and peak memory of reading and verifying a model's forward program.
    Import {
        #[command(flatten)]
        model: ModelArgs,
        /// Repetitions (the median is reported).
        #[arg(long, default_value_t = 5)]
        repeat: usize,
    },
    /// Time (median of --repeat), peak memory and plan size of `hzp compile` for one model on
    /// several meshes, and the ratio of their compile times. Default: preset:gpt3-175b on
    /// node=8,gpu=8 and node=1024,gpu=8 (H100 spec, 80GiB, --recompute auto; the figures in docs/benchmarks.md were taken with recompute on: pass --recompute).
    Compile(Box<bench_compile::BenchCompileArgs>),
}

/// Exit code of an internal error (a bug in hzp): a panic anywhere is reported as one
/// paragraph and exits with this code (EX_SOFTWARE), never with Rust's 101.
const EXIT_INTERNAL: i32 = 70;

/// Turns a panic on any thread into one paragraph on stderr and exit code [`EXIT_INTERNAL`].
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".into());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        // A rank's thread of the plan executor: the executor catches the panic, stops the
        // other ranks and reports it with the flight recorder (and the run exits non-zero).
        let thread = std::thread::current();
        if thread.name().is_some_and(|n| n.starts_with("hzp-r")) {
            note!("{} panicked: {msg}{at}", thread.name().unwrap_or_default());
            return;
        }
        note!(
            "internal error: hzp stopped on a bug, not on something you did wrong: {msg}{at}. Please report it with the command line that caused it."
        );
        std::process::exit(EXIT_INTERNAL);
    }));
}

fn main() {
    process_setup();
    let cli = parse_cli();
    if matches!(
        cli.command,
        Command::Compile { .. }
            | Command::Bench {
                what: BenchWhat::Compile(_)
            }
    ) {
        compile_without_huge_pages();
    }
    apply_global_flags(&cli);
    let result = run_command(cli.command);
    let result = result.and_then(|()| stdio::flush());
    if let Err(e) = result {
        note!("{e:?}");
        std::process::exit(1);
    }
}

/// Process-wide settings made before anything else: SIGPIPE, the allocator's thresholds,
/// the panic hook and how errors are printed.
fn process_setup() {
    // Exit quietly when the reader of our output goes away (`hzp show ... | head`), as
    // command-line tools do, instead of panicking on a broken pipe.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // The evaluator allocates and frees tensors of a few MB to tens of MB at every node.
    // glibc serves such sizes with fresh mmaps (and trims freed heap) by default, so every
    // tensor would pay a page fault per 4 KiB; keep them in the heap and reuse the memory.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only tunes thresholds; called before any allocation-heavy work.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
    keep_freed_memory();
    install_panic_hook();
    // Errors read in a log or by a script must keep each message on one line: wrap them
    // to the terminal's width only when stderr is a terminal (a long path would otherwise
    // break a word such as `read-only` across lines).
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        let _ = miette::set_hook(Box::new(|_| {
            Box::new(miette::MietteHandlerOpts::new().wrap_lines(false).build())
        }));
    }
}

// mimalloc's option setter (in the linked C library; the `mimalloc` crate declares it only
// with its `extended` feature).
extern "C" {
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}
/// `mi_option_purge_delay` in mimalloc v3's `mi_option_t`.
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

/// Tells mimalloc to keep freed memory for reuse instead of returning it to the OS 10 ms
/// after it is freed (unless `MIMALLOC_PURGE_DELAY` is set). The compiler's passes each build
/// a new program and free the last one; with purging, every pass that outlived the delay
/// got fresh pages the kernel had to zero again, so the time spent zeroing pages grew faster
/// than the program (measured at 3624738 on the development machine, docs/benchmarks.md:
/// at 768 GPT layers 34k-54k page faults and over a second of system time, against about 540 faults without purging; the peak resident memory is about
/// a tenth higher than with purging).
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: mi_option_set stores one integer in mimalloc's option table; the option is
        // read when memory is freed, and any value is valid (-1: never purge).
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}

/// Turns transparent huge pages off for this process (unless `MIMALLOC_ALLOW_THP` is set,
/// which then decides, as mimalloc reads it). mimalloc asks for huge pages on its regions;
/// a compile touches hundreds of MiB of fresh heap, and each first touch of a huge page made
/// the kernel find and zero 2 MiB at once, most of the compile's system time, growing faster
/// than the layers (at f791c35, on the development machine: `hzp bench compile preset:gpt --layers 96,192,384,768
/// --recompute false --repeat 3`, system time 1.1-2.1 s -> 0.4-0.85 s for the whole bench;
/// one `hzp compile` of 768 layers 1.63 -> 0.36 s). Only for the compiling commands: `hzp
/// run`'s large tensors keep huge pages.
fn compile_without_huge_pages() {
    #[cfg(target_os = "linux")]
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        // SAFETY: PR_SET_THP_DISABLE only sets a flag of this process that page faults read;
        // a failure (an old kernel) leaves huge pages on, which is only slower.
        unsafe {
            libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
        }
    }
}

/// The command line; a usage error (or `--help`, `--version`) is printed and ends the
/// process here.
fn parse_cli() -> Cli {
    match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            // --help and --version are answers, not errors; a usage error exits with 1, as
            // every other user error does.
            let code = match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => 0,
                _ => 1,
            };
            let printed = e
                .print()
                .map_err(|io| miette::miette!("cannot write to stdout: {io}"));
            match printed.and_then(|()| stdio::flush()) {
                Ok(()) => std::process::exit(code),
                Err(report) => {
                    note!("{report:?}");
                    std::process::exit(1);
                }
            }
        }
    }
}

/// The flags that apply to every command: the thread-count note and `--input-budget`.
fn apply_global_flags(cli: &Cli) {
    if let Some(n) = hzp_runtime::cpu::threads::setting_note() {
        note!("{n}");
    }
    let budget = match (&cli.input_budget, &cli.max_memory) {
        (Some(_), Some(_)) => {
            note!("give the input budget once, as --input-budget (--max-memory is its older name)");
            std::process::exit(1);
        }
        (Some(m), None) => Some(m),
        (None, Some(m)) => {
            note!("note: --max-memory is now --input-budget (the input-file budget; --memory is the per-rank device budget); the older name will stop working in a later release");
            Some(m)
        }
        (None, None) => None,
    };
    if let Some(m) = budget {
        match hzp_passes::cost::cluster::parse_bytes(m) {
            Ok(b) if b > 0 => hzp_frontends::limits::set_max_memory(b),
            Ok(_) => {
                note!("--input-budget {m}: the budget must be more than 0 bytes");
                std::process::exit(1);
            }
            Err(e) => {
                note!("--input-budget {m}: {e}");
                std::process::exit(1);
            }
        }
    }
}

/// Runs one command.
/// The CLI reference: every command's and subcommand's `--help`, as Markdown.
fn cli_reference() -> String {
    use clap::CommandFactory;
    fn walk(cmd: &mut clap::Command, path: &str, out: &mut String) {
        if cmd.is_hide_set() {
            return;
        }
        let name = if path.is_empty() {
            cmd.get_name().to_string()
        } else {
            format!("{path} {}", cmd.get_name())
        };
        let help = cmd.render_long_help().to_string();
        out.push_str(&format!(
            "## `{name}`\n\n```text\n{}\n```\n\n",
            help.trim_end()
        ));
        let mut subs: Vec<clap::Command> = cmd
            .get_subcommands()
            .filter(|s| s.get_name() != "help")
            .cloned()
            .collect();
        for s in &mut subs {
            walk(s, &name, out);
        }
    }
    let mut cmd = Cli::command().bin_name("hzp");
    cmd.build();
    let mut out = String::from(
        "# CLI reference\n\nGenerated from hzp's argument parser by `hzp cli-reference` (hidden); \
         `tests/cli_reference.rs` checks that this page is current. Choice flags list their \
         values; `hzp completions SHELL` completes them in bash, zsh, fish, elvish and \
         PowerShell.\n\n",
    );
    walk(&mut cmd, "", &mut out);
    out
}

fn run_command(command: Command) -> Result<(), miette::Report> {
    match command {
        Command::Completions { shell } => {
            use clap::CommandFactory;
            let mut buf = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "hzp", &mut buf);
            out!("{}", String::from_utf8_lossy(&buf));
            Ok(())
        }
        Command::CliReference => {
            out!("{}", cli_reference());
            Ok(())
        }
        Command::Import {
            model,
            inputs,
            output,
        } => commands::import(&model, inputs.as_deref(), output.as_deref()),
        Command::Show {
            model,
            inputs,
            format,
        } => commands::show(&model, inputs.as_deref(), format),
        Command::Eval {
            model,
            inputs,
            output,
            reference,
            reference_key,
            tolerance,
            format,
        } => commands::eval(
            &model,
            &inputs,
            output.as_deref(),
            reference.as_deref(),
            reference_key.as_deref(),
            tolerance,
            format,
        ),
        Command::Bench {
            what: BenchWhat::Import { model, repeat },
        } => commands::bench_import(&model, repeat),
        Command::Bench {
            what: BenchWhat::Compile(args),
        } => bench_compile::bench_compile(&args),
        Command::Grad {
            model,
            inputs,
            train,
            output,
        } => commands::grad(&model, &inputs, &train, &output),
        Command::Train {
            model,
            inputs,
            train,
            steps,
            session,
            save_params,
            format,
        } => commands::train(
            &model,
            inputs.as_deref(),
            &train,
            steps,
            save_params.as_deref(),
            &session,
            format,
        ),
        Command::Compile {
            model,
            inputs,
            train,
            compile: c,
            format,
        } => compile::compile(&model, inputs.as_deref(), &train, &c, format),
        Command::Inspect {
            plan,
            cluster,
            format,
        } => compile::inspect(&plan, cluster.as_deref(), format),
        Command::Run(args) => run::run(&args),
        Command::Launch(args) => match launch::launch(&args) {
            Ok(0) => Ok(()),
            Ok(code) => std::process::exit(code),
            Err(e) => Err(e),
        },
        Command::Simulate(a) => simulate::simulate_cmd(&a),
        Command::Compare {
            model,
            inputs,
            train,
            compile: c,
            compare,
        } => simulate::compare(&model, inputs.as_deref(), &train, &c, &compare),
        Command::Scale {
            model,
            train,
            scale,
        } => simulate::scale(&model, &train, &scale),
        Command::Checkpoint { what } => data_cmd::checkpoint_cmd(&what),
        Command::Data { what } => data_cmd::data_cmd(&what),
    }
}
