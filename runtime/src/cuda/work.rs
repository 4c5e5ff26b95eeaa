//! What a lowered plan is made of ([`Work`]: kernel launches, copies, products,
//! collectives, events; [`LoweredPlan`]) and the launch shapes of the kernels (grids,
//! strides of n-d walks, kernel-name suffixes). The per-node lowering (`lower`) and the
//! elementwise fusion (`fuse`) both build work from these, so neither imports the other
//! for them.

use super::kernels::{MAXD, REDUCE_THREADS};

use hzp_ir::{DType, ReduceOp};

/// An n-d walk (the `Nd` struct of the kernel sources): a shape and up to four strides.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Nd {
    pub shape: Vec<i64>,
    pub s: [Vec<i64>; 4],
}

impl Nd {
    pub(super) fn new(shape: &[usize]) -> Nd {
        let n = shape.len();
        Nd {
            shape: shape.iter().map(|&d| d as i64).collect(),
            s: [vec![0; n], vec![0; n], vec![0; n], vec![0; n]],
        }
    }

    /// The same walk over fewer dims: dims of size 1 dropped, and each pair of neighbouring
    /// dims merged where every stride array steps through both as through one (the outer
    /// stride is the inner one times the inner size), so the kernels divide the linear index
    /// fewer times. `modulo`: a stride array read as per-dim moduli (copy_nd's Tile), which
    /// must be 0 on both dims of a merge. Every element keeps its offsets: the walk visits
    /// the same (offset, offset, ..) tuples in the same order.
    /// `HZP_CUDA_NO_COALESCE=1` keeps the walk as it is (to measure what merging saves).
    pub(super) fn coalesced(&self, modulo: Option<usize>) -> Nd {
        if std::env::var_os("HZP_CUDA_NO_COALESCE").is_some_and(|v| v == "1") {
            return self.clone();
        }
        let mut out = Nd::new(&[]);
        for k in 0..self.shape.len() {
            let size = self.shape[k];
            if size == 1 {
                continue;
            }
            if let Some(last) = out.shape.len().checked_sub(1) {
                let merges = (0..4).all(|a| {
                    if Some(a) == modulo {
                        out.s[a][last] == 0 && self.s[a][k] == 0
                    } else {
                        out.s[a][last] == self.s[a][k] * size
                    }
                });
                if merges {
                    out.shape[last] *= size;
                    for a in 0..4 {
                        out.s[a][last] = self.s[a][k];
                    }
                    continue;
                }
            }
            out.shape.push(size);
            for a in 0..4 {
                out.s[a].push(self.s[a][k]);
            }
        }
        if out.shape.is_empty() {
            out.shape.push(1);
            for a in 0..4 {
                out.s[a].push(0);
            }
        }
        out
    }

    /// The struct's bytes as the kernel takes it by value: `int rank` (padded to 8), then
    /// five arrays of `MAXD` i64.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + 5 * 8 * MAXD);
        out.extend_from_slice(&(self.shape.len() as i32).to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
        for arr in std::iter::once(&self.shape).chain(self.s.iter()) {
            for k in 0..MAXD {
                out.extend_from_slice(&arr.get(k).copied().unwrap_or(0).to_le_bytes());
            }
        }
        out
    }
}

/// A kernel argument.
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    I32(i32),
    I64(i64),
    F32(f32),
    /// A device pointer: the arena's base plus this byte offset.
    Ptr(u64),
    /// A null pointer (an absent optional operand).
    Null,
    /// The pointer to the rank's error word (see [`LoweredPlan::err_offset`]).
    ErrFlag,
    /// An n-d walk, by value.
    Nd(Nd),
    /// A value of `len` bytes (1, 2, 4 or 8), little-endian in the low bytes.
    Bits {
        bits: u64,
        len: usize,
    },
}

/// One kernel launch (1-d grid).
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    pub kernel: String,
    pub grid: u32,
    pub block: u32,
    pub args: Vec<Arg>,
}

/// A batched matrix product `C = A B` (row-major, as numpy's matmul), run as cuBLAS's
/// column-major `C^T = B^T A^T`: for each entry of `calls`, `batch` products at the given
/// offsets, strides in elements.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemm {
    pub dtype: DType,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    pub stride_a: i64,
    pub stride_b: i64,
    pub stride_c: i64,
    /// Whether `a` (`b`) is stored transposed: as `[.., k, m]` (`[.., n, k]`) row-major, a
    /// transposed operand the plan keeps in its input's bytes
    /// (`hzp_ir::views::transposed_operands`), read through cuBLAS's transpose flag.
    pub trans_a: bool,
    pub trans_b: bool,
    /// (a, b, c) byte offsets of each strided-batched call.
    pub calls: Vec<(u64, u64, u64)>,
}

/// The arguments of one `cublasGemmStridedBatchedEx` call (column-major, as cuBLAS reads
/// them): `C = op(X) op(Y)` with `X` the call's first operand, `m x k` after `op`, `Y`
/// `k x n`, `C` `m x n` with leading dimension `ldc`; each of the `batch` products steps
/// every pointer by its stride (elements). Offsets are bytes into the arena.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CublasGemm {
    pub trans_x: bool,
    pub trans_y: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub x: u64,
    pub ldx: usize,
    pub stride_x: i64,
    pub y: u64,
    pub ldy: usize,
    pub stride_y: i64,
    pub c: u64,
    pub ldc: usize,
    pub stride_c: i64,
    pub batch: usize,
}

impl Gemm {
    /// The cuBLAS calls that compute this row-major product: row-major `C[m,n] = A[m,k]
    /// B[k,n]` is column-major `C^T = B^T A^T`, so cuBLAS's first operand is `B`. Row-major
    /// `B` `[k,n]` is column-major `B^T` (ld `n`); stored transposed (`[n,k]`, `trans_b`) it
    /// is column-major `B` (ld `k`), which cuBLAS transposes. Likewise `A`: `A^T` (ld `k`), or
    /// stored `[k,m]`: `A` (ld `m`).
    pub fn cublas_calls(&self) -> Vec<CublasGemm> {
        let (trans_y, ldy) = if self.trans_a {
            (true, self.m)
        } else {
            (false, self.k)
        };
        let (trans_x, ldx) = if self.trans_b {
            (true, self.k)
        } else {
            (false, self.n)
        };
        self.calls
            .iter()
            .map(|&(a, b, c)| CublasGemm {
                trans_x,
                trans_y,
                m: self.n,
                n: self.m,
                k: self.k,
                x: b,
                ldx,
                stride_x: self.stride_b,
                y: a,
                ldy,
                stride_y: self.stride_a,
                c,
                ldc: self.n,
                stride_c: self.stride_c,
                batch: self.batch,
            })
            .collect()
    }
}

/// A product run by `cublasLtMatmul` with an epilogue: `gemm` is one f32 product (batch 1,
/// one call) whose C offset is where `D` goes (the last absorbed node's result); `bias` the
/// bias read (BIAS, GELU_AUX_BIAS) or the bias gradient written (DGELU_BGRAD, BGRADA), `aux`
/// the GELU's pre-activation written (GELU_AUX_BIAS) or read (DGELU_BGRAD), `n` elements a
/// row (its leading dimension). Byte offsets into the arena.
#[derive(Clone, Debug, PartialEq)]
pub struct LtGemm {
    pub gemm: Gemm,
    pub epilogue: Epilogue,
    pub bias: Option<u64>,
    pub aux: Option<u64>,
}

/// A collective on this rank's instance of `group` on `stream`.
#[derive(Clone, Debug, PartialEq)]
pub struct Collective {
    pub kind: CollKind,
    /// Key of the communicator (see [`LoweredPlan::comms`]).
    pub comm: usize,
    pub send: u64,
    pub recv: u64,
    /// Elements this rank sends (AllGather: its shard; ReduceScatter: the whole input;
    /// AllReduce/Broadcast: the tensor; AllToAll: the whole input).
    pub count: usize,
    pub dtype: DType,
    pub reduce: ReduceOp,
    pub root: usize,
    /// The group's size.
    pub size: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollKind {
    AllGather,
    ReduceScatter,
    AllReduce,
    AllToAll,
    Broadcast,
}

/// One piece of a node's work, in issue order.
#[derive(Clone, Debug, PartialEq)]
pub enum Work {
    Kernel(Launch),
    /// Device-to-device copy of `bytes` bytes.
    Copy {
        src: u64,
        dst: u64,
        bytes: u64,
    },
    Gemm(Gemm),
    /// A product with a cuBLASLt epilogue (chosen by `cuda::epilogue`, `HZP_CUDA_LT=1`).
    LtGemm(LtGemm),
    Collective(Collective),
    /// Record plan event number `.0` (dense index) on the node's stream.
    Record(usize),
    /// The node's stream waits for plan event `.0` (dense index).
    Wait(usize),
    /// Fused attention on cuDNN (see [`SdpaWork`]).
    Sdpa(Box<SdpaWork>),
}

/// A node's attention run by cuDNN's fused attention ([`super::sdpa`]): the graph, the arena
/// offset of each operand it binds, and what runs the node instead when cuDNN cannot build
/// the graph on the machine at hand (hzp's attention kernels, or why they may not run).
#[derive(Clone, Debug, PartialEq)]
pub struct SdpaWork {
    pub graph: super::sdpa::SdpaGraph,
    /// (unique id, arena byte offset) of each plan operand the graph binds; the graph's
    /// scratch ([`super::sdpa::SdpaGraph::scratch`]) is memory the executor provides.
    pub operands: Vec<(i64, u64)>,
    /// hzp's own launches for the node, or why there are none (`--attention` off).
    pub fallback: Result<Vec<Work>, String>,
}

/// A node's work.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeWork {
    pub node: usize,
    pub name: String,
    pub op: &'static str,
    /// Stream index (0 compute, 1 all-gather, 2 reduce-scatter).
    pub stream: usize,
    pub work: Vec<Work>,
}

/// A communicator this rank joins: the group's axes, the stream, this rank's instance (its
/// members, in group order) and its place in it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct CommKey {
    pub stream: usize,
    pub axes: Vec<String>,
    pub members: Vec<usize>,
    pub member: usize,
}

/// A plan lowered for one rank.
#[derive(Clone, Debug)]
pub struct LoweredPlan {
    pub rank: usize,
    pub nodes: Vec<NodeWork>,
    /// Number of distinct plan events (dense indices).
    pub n_events: usize,
    /// Plan event index -> the stream that records it.
    pub event_stream: Vec<usize>,
    /// The rank's communicators, in the order every rank creates them.
    pub comms: Vec<CommKey>,
    /// Bytes to allocate: the arena, the error word, the AdamW tables and the attention
    /// workspace.
    pub alloc_bytes: u64,
    /// Offset of the 4-byte error word (after the arena, aligned).
    pub err_offset: u64,
    /// Bytes the executor writes once, when it loads the plan, after the error word: the
    /// multi-tensor AdamW tables ([`super::adamw_multi`]), as (offset, bytes).
    pub consts: Vec<(u64, Vec<u8>)>,
    /// The region of the arena cuDNN's attention nodes share, one after another on the
    /// compute stream: (offset, bytes), the largest [`super::sdpa::SdpaGraph::reserved_bytes`]
    /// of the nodes lowered to [`Work::Sdpa`]; (offset, 0) without such nodes. Part of
    /// [`Self::alloc_bytes`]: the executor allocates nothing beside the arena for attention.
    pub attention_workspace: (u64, u64),
    /// (value offset, target offset, bytes) per update, in the plan's order.
    pub updates: Vec<(u64, u64, u64)>,
    /// Buffer of each value: (offset, bytes); bytes 0 for empty values.
    pub loc: Vec<(u64, u64)>,
    /// The generated kernels of the fused runs ([`super::fuse`]), compiled with the fixed
    /// sources; empty without fusion. The same for every rank of a plan.
    pub fused_source: String,
    /// One line per node that does not run where it was meant to (an attention node cuDNN
    /// does not take, and why): what the backend tells the user once.
    pub notes: Vec<String>,
}

/// Kernel-name suffix of a dtype.
pub fn dt(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::I64 => "i64",
        DType::I32 => "i32",
        DType::Bool => "b8",
    }
}

/// Kernel-name suffix of an element size (movement kernels).
pub(super) fn bsz(d: DType) -> &'static str {
    match d.size_bytes() {
        1 => "b1",
        2 => "b2",
        4 => "b4",
        _ => "b8",
    }
}

pub(super) fn contiguous(shape: &[usize]) -> Vec<i64> {
    let mut s = vec![0i64; shape.len()];
    let mut acc = 1i64;
    for k in (0..shape.len()).rev() {
        s[k] = acc;
        acc *= shape[k] as i64;
    }
    s
}

/// Strides of `x` (contiguous) broadcast to `out` (right-aligned; 0 on broadcast dims).
pub(super) fn bcast(x: &[usize], out: &[usize]) -> Vec<i64> {
    let cs = contiguous(x);
    let off = out.len() - x.len();
    (0..out.len())
        .map(|k| {
            if k < off || (x[k - off] == 1 && out[k] != 1) {
                0
            } else {
                cs[k - off]
            }
        })
        .collect()
}

pub(super) fn around(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        shape[..axis].iter().product(),
        shape[axis],
        shape[axis + 1..].iter().product(),
    )
}

/// Blocks of 256 threads for one thread per element (a grid-stride loop covers the rest).
pub(super) fn flat_grid(n: usize) -> u32 {
    n.div_ceil(256).clamp(1, 1 << 20) as u32
}

pub(super) fn lane_grid(lanes: usize) -> u32 {
    lanes.clamp(1, 1 << 20) as u32
}

/// A kernel over an n-d walk whose float kernels take `walk_runs`' warp tiles of 4 elements
/// per lane (`common.cuh`): a quarter of `elementwise`'s blocks. Blocks of 256 threads (a
/// whole number of warps, which the tiles need); any grid is correct.
pub(super) fn walk_kernel(kernel: String, n: usize, args: Vec<Arg>) -> Work {
    Work::Kernel(Launch {
        kernel,
        grid: flat_grid(n.div_ceil(4)),
        block: 256,
        args,
    })
}

pub(super) fn elementwise(kernel: String, n: usize, args: Vec<Arg>) -> Work {
    Work::Kernel(Launch {
        kernel,
        grid: flat_grid(n),
        block: 256,
        args,
    })
}

pub(super) fn lanes(kernel: String, lanes: usize, args: Vec<Arg>) -> Work {
    Work::Kernel(Launch {
        kernel,
        grid: lane_grid(lanes),
        block: REDUCE_THREADS,
        args,
    })
}

/// What a product's cuBLASLt call computes besides the product (the choice is
/// `cuda::epilogue`'s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// The product alone (`CUBLASLT_EPILOGUE_DEFAULT`).
    Default,
    Bias,
    GeluAuxBias,
    Dgelu,
    DgeluBgrad,
    BgradA,
}

impl Epilogue {
    /// cuBLASLt's name.
    pub fn name(self) -> &'static str {
        match self {
            Epilogue::Default => "DEFAULT",
            Epilogue::Bias => "BIAS",
            Epilogue::GeluAuxBias => "GELU_AUX_BIAS",
            Epilogue::Dgelu => "DGELU",
            Epilogue::DgeluBgrad => "DGELU_BGRAD",
            Epilogue::BgradA => "BGRADA",
        }
    }
}
