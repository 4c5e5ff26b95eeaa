//! The flags of `hzp run` ([`RunArgs`]), apart from the run itself so that the step loop
//! (`train_loop`) and the plan reading (`plan_file`) can take them without importing `run`.

use crate::Format;
use std::path::PathBuf;

/// Flags of `hzp run`.
#[derive(clap::Args, Clone, Debug)]
pub struct RunArgs {
    /// A plan written by `hzp compile -o`.
    pub plan: PathBuf,
    /// The global batch: arrays keyed by input name, axis 0 split across the ranks (the
    /// same batch every step; with --data, the inputs other than the tokens).
    #[arg(long, value_name = "IN.npz")]
    pub inputs: Option<PathBuf>,
    /// Number of optimizer steps in all (a resumed run counts the steps done before).
    #[arg(long, default_value_t = 1)]
    pub steps: usize,
    /// The learning rate (the maximum of a schedule); default: the plan's `--lr`.
    #[arg(long)]
    pub lr: Option<f64>,
    #[command(flatten)]
    pub session: crate::session::LoopArgs,
    /// Write checkpoints into this folder (step-NNNNNN/: one safetensors file per rank and
    /// a manifest written last).
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// A checkpoint every K steps (and after the last step).
    #[arg(long, value_name = "K")]
    pub checkpoint_every: Option<usize>,
    /// Keep only the newest N checkpoints.
    #[arg(long, value_name = "N")]
    pub keep: Option<usize>,
    /// Continue from the newest complete checkpoint in --checkpoint-dir (another plan of the
    /// same model reshards it on load).
    #[arg(long)]
    pub resume: bool,
    /// End this invocation after step N (with a checkpoint, when writing them), as if it
    /// were stopped there: the schedule still spans --steps, and --resume goes on.
    #[arg(long, value_name = "N")]
    pub stop_at: Option<usize>,
    /// cpu, or cuda (needs a build with --features cuda).
    #[arg(long, default_value = "cpu", value_parser = crate::choices(&[("cpu", &[]), ("cuda", &[])]))]
    pub backend: String,
    /// Save the trained parameters (keyed by initializer name) to this .npz.
    #[arg(long, value_name = "P.npz")]
    pub save_params: Option<PathBuf>,
    /// Write a Chrome trace (Perfetto) of every node: pid = rank, tid = stream.
    #[arg(long, value_name = "run.json")]
    pub trace: Option<PathBuf>,
    /// async: collectives on background threads, one per comm stream (the plan's schedule);
    /// sync: collectives on the compute thread, in program order (the baseline).
    #[arg(long, default_value = "async", value_parser = crate::choices(&[("async", &[]), ("sync", &[])]))]
    pub comm: String,
    /// Emulate the links of this cluster spec: every collective takes at least the time the
    /// alpha-beta cost model gives.
    #[arg(long, value_name = "SPEC.toml", conflicts_with = "link")]
    pub emulate_links: Option<PathBuf>,
    /// Emulate links by bandwidth: intra=300GB/s,inter=25GB/s[,latency=5us] (intra: the
    /// innermost mesh axis; inter: the others).
    #[arg(long, value_name = "intra=..,inter=..")]
    pub link: Option<String>,
    /// Stop the run when a collective, event wait or step barrier takes longer than this
    /// (seconds, or 500ms / 30s / 5m); every rank stops and prints its flight record.
    #[arg(long, default_value = "300", value_name = "T")]
    pub collective_timeout: String,
    /// On a failed run, write each rank's flight record (its last collectives and their
    /// state) to DIR/rank-<r>.json.
    #[arg(long, value_name = "DIR")]
    pub flight_recorder: Option<PathBuf>,
    /// With --backend cuda: run every rank of the plan in this process on the one GPU, each
    /// with its own arena and streams, collectives through a local device communicator
    /// (checks a multi-rank plan on a machine with one GPU).
    #[arg(long)]
    pub ranks_on_one_gpu: bool,
    /// With --backend cuda, the kernels of a plan's fused attention: flash (cuDNN's fused
    /// attention where cuDNN 9 loads and takes the node, hzp's FlashAttention-2 style kernels
    /// for the rest; the same as HZP_CUDA_ATTENTION=1) or pasa (PASA's forward fully in fp16,
    /// for plans compiled with --precision fp16). Without it, attention nodes cuDNN takes
    /// run on cuDNN and the CUDA backend refuses the others, naming why: hzp's own kernels
    /// equal the CPU backend on a GPU but are scalar, slower than attention written out
    /// (compile with --no-fuse-attention). HZP_CUDNN=0 keeps cuDNN out.
    #[arg(long, value_parser = crate::choices(&[("flash", &[]), ("pasa", &[])]))]
    pub attention: Option<String>,
    /// With --backend cuda, fuse runs of elementwise nodes into kernels generated for the
    /// plan (the same as HZP_CUDA_FUSE=1; off by default until it has run on a GPU).
    #[arg(long)]
    pub fuse_elementwise: bool,
    /// With --backend cuda, issue every step's kernels one by one instead of capturing a step
    /// into a CUDA graph after the first and replaying it (the same as HZP_CUDA_GRAPH=0).
    #[arg(long)]
    pub no_cuda_graph: bool,
    /// Take the parameters from this .npz (keyed by parameter name) instead of the model.
    #[arg(long, value_name = "P.npz")]
    pub params: Option<PathBuf>,
    /// Read the parameters from this model instead of the one the plan names.
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}
