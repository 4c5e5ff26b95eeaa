//! Lowering a plan's per-rank program to CUDA work: for every node, the kernel launches,
//! device copies, cuBLAS products, NCCL collectives and event operations that run it, with
//! every operand an offset in the rank's arena. This part needs no GPU (and no `cuda`
//! feature), so its coverage is tested on any machine; the backend turns it into driver calls.
//!
//! Covered: every compute op the CPU evaluator runs (see [`lower_program`]), with these
//! limits, each refused at load time with the node's name: tensors of rank above 8 in n-d
//! walks; AllGather/ReduceScatter on an axis with a non-trivial dim before it (the shards would
//! not be contiguous: it needs a staging buffer the plan does not have); AllToAll other than
//! split and concat on axis 0; Sub/Div/Pow/Mod of bools; CumSum of bools; ArgMax over an
//! empty axis.

use super::kernels::{ATTENTION_KEYS, ATTENTION_MAX_HEAD, ATTENTION_ROWS, ATTENTION_THREADS, MAXD};
use hzp_ir::{
    numel, BinaryOp, DType, Mesh, Node, Op, Plan, Program, ReduceOp, Tensor, TensorType, UnaryOp,
};
use std::collections::BTreeMap;

use super::work::{around, bcast, bsz, contiguous, elementwise, lane_grid, lanes, walk_kernel};
pub use super::work::{
    dt, Arg, CollKind, Collective, CommKey, CublasGemm, Gemm, Launch, LoweredPlan, Nd, NodeWork,
    SdpaWork, Work,
};

/// Stream index of a node.
fn stream_idx(s: hzp_ir::StreamKind) -> usize {
    match s {
        hzp_ir::StreamKind::Compute => 0,
        hzp_ir::StreamKind::AllGather => 1,
        hzp_ir::StreamKind::ReduceScatter => 2,
    }
}

/// The bytes of one element of `dtype` holding `value` converted as Fill converts it.
pub fn fill_bits(dtype: DType, value: f64) -> u64 {
    let t = Tensor::from_f64(dtype, Vec::<usize>::new(), &[value]);
    let mut b = [0u8; 8];
    let bytes: Vec<u8> = match &t.data {
        hzp_ir::Data::F32(v) => v[0].to_le_bytes().to_vec(),
        hzp_ir::Data::BF16(v) => v[0].to_bits().to_le_bytes().to_vec(),
        hzp_ir::Data::F16(v) => v[0].to_bits().to_le_bytes().to_vec(),
        hzp_ir::Data::I64(v) => v[0].to_le_bytes().to_vec(),
        hzp_ir::Data::I32(v) => v[0].to_le_bytes().to_vec(),
        hzp_ir::Data::Bool(v) => vec![v[0] as u8],
    };
    b[..bytes.len()].copy_from_slice(&bytes);
    u64::from_le_bytes(b)
}

/// Which CUDA kernels run a plan's fused attention (`Attention`, `AttentionGrad`): the
/// choice of `hzp run --attention`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CudaAttention {
    /// Refused, naming the options (the default: hzp's kernels equal the CPU backend on a GPU
    /// but are scalar, slower than attention written out as products and softmax), unless
    /// cuDNN runs the node ([`LowerOptions::cudnn`]).
    #[default]
    Off,
    /// `attn_fwd`, then `attn_dq` and `attn_dkv` (`--attention flash`, or
    /// `HZP_CUDA_ATTENTION=1`): f32/bf16/f16 operands, f32 arithmetic; cuDNN first where it
    /// takes the node ([`LowerOptions::cudnn`]; `HZP_CUDNN=0` keeps hzp's kernels).
    Flash,
    /// PASA (`--attention pasa`): the forward `attn_fwd_pasa_f16` in fp16 throughout (see
    /// `cpu::pasa`), the gradient by the f16 `attn_dq` and `attn_dkv`, which recompute the
    /// probabilities in f32 from the true log-sum-exp PASA saves. f16 attention only.
    Pasa,
}

/// How to lower a plan (the choices `hzp run` passes down).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LowerOptions {
    pub attention: CudaAttention,
    /// Fuse runs of elementwise nodes into generated kernels ([`super::fuse`];
    /// `HZP_CUDA_FUSE=1`).
    pub fuse: bool,
    /// cuDNN is there to run fused attention: `Attention` / `AttentionGrad` nodes that
    /// [`super::sdpa::plan_sdpa`] accepts become [`Work::Sdpa`] (hzp's kernels as their
    /// fallback when `attention` allows them); a node it refuses runs on hzp's kernels with a
    /// note saying why ([`LoweredPlan::notes`]), or, with `attention` off, is refused with the
    /// reason. The executor sets it when libcudnn loads (and `HZP_CUDNN` is not `0`).
    /// [`CudaAttention::Pasa`] keeps every attention node on PASA's kernels.
    pub cudnn: bool,
    /// One `adamw_f32` launch per AdamW node instead of one multi-tensor launch per group of
    /// them ([`super::adamw_multi`]; `HZP_CUDA_ADAMW_PER_NODE=1`).
    pub per_node_adamw: bool,
    /// Run the products [`super::epilogue`] chooses through cuBLASLt with their epilogues
    /// (`HZP_CUDA_LT=1`; off by default: never run on a GPU).
    pub lt_epilogues: bool,
}

impl LowerOptions {
    /// The defaults, with `HZP_CUDA_ATTENTION=1` read as [`CudaAttention::Flash`] and
    /// `HZP_CUDA_FUSE=1` as `fuse`.
    pub fn from_env() -> LowerOptions {
        let flash = std::env::var("HZP_CUDA_ATTENTION").is_ok_and(|v| v == "1");
        LowerOptions {
            attention: if flash {
                CudaAttention::Flash
            } else {
                CudaAttention::Off
            },
            fuse: std::env::var("HZP_CUDA_FUSE").is_ok_and(|v| v == "1"),
            cudnn: false,
            per_node_adamw: std::env::var("HZP_CUDA_ADAMW_PER_NODE").is_ok_and(|v| v == "1"),
            lt_epilogues: std::env::var("HZP_CUDA_LT").is_ok_and(|v| v == "1"),
        }
    }
}

/// The `β` of PASA's pseudo-average shift (see `cpu::pasa`).
pub const PASA_BETA: f32 = crate::cpu::pasa::PASA_BETA;

/// Lowers `plan` for `rank` with [`LowerOptions::from_env`].
pub fn lower_program(plan: &Plan, rank: usize) -> Result<LoweredPlan, String> {
    lower_program_with(plan, rank, LowerOptions::from_env())
}

/// Lowers `plan` for `rank`. Every node is checked here: a plan using an op (or a form of
/// an op) the backend does not run is refused with the node's name, before any device work.
pub fn lower_program_with(
    plan: &Plan,
    rank: usize,
    opts: LowerOptions,
) -> Result<LoweredPlan, String> {
    let p: &Program = &plan.program;
    let mesh: &Mesh = &plan.mesh;
    if rank >= mesh.world_size() {
        return Err(format!(
            "rank {rank} is outside the plan's mesh {mesh} ({} ranks)",
            mesh.world_size()
        ));
    }
    let loc = buffer_locations(plan)?;
    let (events, event_stream) = event_indices(p)?;
    let mut lowering = Lowering {
        p,
        mesh,
        rank,
        stored_transposed: stored_transposed(p, &loc),
        loc: &loc,
        events,
        comm_list: Vec::new(),
        opts,
        notes: Vec::new(),
    };
    let runs = if opts.fuse {
        super::fuse::runs(p, &loc)
    } else {
        Vec::new()
    };
    let mut fused = super::fuse::work_of(&runs);
    let mut nodes = Vec::with_capacity(p.nodes.len());
    for (ni, n) in p.nodes.iter().enumerate() {
        // (every node is lowered, a fused one too: that refuses what the backend cannot run)
        let mut nw = lowering.node(ni, n)?;
        if let Some(work) = fused.remove(&ni) {
            nw.work = work;
        }
        nodes.push(nw);
    }
    let comms = renumber_comms(&lowering.comm_list, &mut nodes);
    let notes = std::mem::take(&mut lowering.notes);
    let updates = update_copies(p, &loc)?;
    if opts.lt_epilogues || (rank == 0 && super::graph::explain()) {
        lt_epilogues(p, &loc, &runs, opts.lt_epilogues, rank, &mut nodes);
    }
    let err_offset = plan.arena_bytes.div_ceil(256) * 256;
    let (consts, tables_end) = if opts.per_node_adamw {
        (Vec::new(), err_offset + 256)
    } else {
        super::adamw_multi::apply(p, &loc, &mut nodes, err_offset + 256)?
    };
    let attention_workspace = (
        tables_end.div_ceil(256) * 256,
        (nodes.iter().flat_map(|nw| &nw.work))
            .filter_map(|w| match w {
                Work::Sdpa(sw) => Some(sw.graph.reserved_bytes()),
                _ => None,
            })
            .max()
            .unwrap_or(0),
    );
    let alloc_bytes = attention_workspace.0 + attention_workspace.1;
    Ok(LoweredPlan {
        rank,
        nodes,
        n_events: event_stream.len(),
        event_stream,
        comms,
        alloc_bytes,
        err_offset,
        consts,
        attention_workspace,
        updates,
        loc,
        fused_source: runs.iter().map(|r| r.source.as_str()).collect(),
        notes,
    })
}

/// The cuBLASLt epilogue each product could take ([`super::epilogue`]): printed with
/// `HZP_CUDA_EXPLAIN=1` (rank 0), and with `wire` (`HZP_CUDA_LT=1`) put in the lowered work.
fn lt_epilogues(
    p: &Program,
    loc: &[(u64, u64)],
    runs: &[super::fuse::Run],
    wire: bool,
    rank: usize,
    nodes: &mut [NodeWork],
) {
    let choices = super::epilogue::choose(p, Some(loc));
    let explain = rank == 0 && super::graph::explain();
    if explain {
        eprint!(
            "hzp: cuBLASLt epilogues{}:\n{}",
            if wire {
                ""
            } else {
                " (not used: HZP_CUDA_LT=1 uses them)"
            },
            super::epilogue::report(p, &choices)
        );
    }
    if wire {
        let mut fused = vec![false; p.nodes.len()];
        for r in runs {
            for &ni in &r.nodes {
                fused[ni] = true;
            }
        }
        for (m, r) in super::epilogue::wire(p, loc, &choices, &fused, nodes) {
            if let (true, Err(why)) = (explain, r) {
                eprintln!(
                    "hzp: cuBLASLt: `{}` stays a cuBLAS product: {why}",
                    p.nodes[m].name
                );
            }
        }
    }
}

/// Every value's (offset, bytes) in the arena: each buffer an aligned range of it, each
/// value with a buffer at least as large as it (values of no bytes need none).
fn buffer_locations(plan: &Plan) -> Result<Vec<(u64, u64)>, String> {
    let p = &plan.program;
    let mut loc = vec![(0u64, 0u64); p.values.len()];
    let mut has = vec![false; p.values.len()];
    for b in &plan.buffers {
        let i = b.value.index();
        if i >= p.values.len() || b.end() > plan.arena_bytes || b.offset % 8 != 0 {
            return Err(format!(
                "a buffer ({} bytes at offset {}) is not an aligned range of the {}-byte arena",
                b.bytes, b.offset, plan.arena_bytes
            ));
        }
        loc[i] = (b.offset, b.bytes);
        has[i] = true;
    }
    for (i, v) in p.values.iter().enumerate() {
        let need = v.ty.size_bytes() as u64;
        if need == 0 {
            loc[i] = (0, 0);
        } else if !has[i] || loc[i].1 < need {
            return Err(format!(
                "value `{}` ({}) has no buffer of {need} bytes in the plan",
                v.name, v.ty
            ));
        } else {
            loc[i].1 = need;
        }
    }
    Ok(loc)
}

/// Events: dense indices in record order (each recorded once), and each one's stream.
fn event_indices(p: &Program) -> Result<(BTreeMap<u32, usize>, Vec<usize>), String> {
    let mut events: BTreeMap<u32, usize> = BTreeMap::new();
    let mut event_stream = Vec::new();
    for n in &p.nodes {
        if let Op::RecordEvent { event } = n.op {
            if events.contains_key(&event) {
                return Err(format!(
                    "event {event} is recorded twice (node `{}`)",
                    n.name
                ));
            }
            events.insert(event, event_stream.len());
            event_stream.push(stream_idx(n.stream));
        }
    }
    Ok((events, event_stream))
}

/// Transposed operands in their input's bytes: nothing to run, read transposed.
fn stored_transposed(p: &Program, loc: &[(u64, u64)]) -> Vec<bool> {
    let mut stored_transposed = vec![false; p.values.len()];
    for (n, t) in p.nodes.iter().zip(hzp_ir::views::transposed_operands(p)) {
        if let (true, [x], [y]) = (t, n.inputs.as_slice(), n.outputs.as_slice()) {
            stored_transposed[y.index()] = loc[y.index()].0 == loc[x.index()].0;
        }
    }
    stored_transposed
}

/// Lowering the nodes of one rank, in program order.
struct Lowering<'a> {
    p: &'a Program,
    mesh: &'a Mesh,
    rank: usize,
    loc: &'a [(u64, u64)],
    /// Event id -> dense index.
    events: BTreeMap<u32, usize>,
    stored_transposed: Vec<bool>,
    /// Communicators in first-use order (renumbered in sorted order at the end).
    comm_list: Vec<CommKey>,
    opts: LowerOptions,
    /// See [`LoweredPlan::notes`].
    notes: Vec<String>,
}

impl Lowering<'_> {
    /// The work of node `ni`.
    fn node(&mut self, ni: usize, n: &Node) -> Result<NodeWork, String> {
        let p = self.p;
        let ins: Vec<(u64, &TensorType)> = n
            .inputs
            .iter()
            .map(|&v| (self.loc[v.index()].0, p.ty(v)))
            .collect();
        let outs: Vec<(u64, &TensorType)> = n
            .outputs
            .iter()
            .map(|&v| (self.loc[v.index()].0, p.ty(v)))
            .collect();
        let stream = stream_idx(n.stream);
        let trans = |k: usize| {
            matches!(n.op, Op::MatMul)
                && n.inputs
                    .get(k)
                    .is_some_and(|v| self.stored_transposed[v.index()])
        };
        let ctx = NodeCtx {
            code: (ni + 1) as i32,
            ins,
            outs,
            trans: [trans(0), trans(1)],
            attention: self.opts.attention,
        };
        let work = match &n.op {
            Op::Transpose { .. } if n.outputs.iter().any(|y| self.stored_transposed[y.index()]) => {
                Vec::new()
            }
            Op::RecordEvent { event } => vec![Work::Record(self.events[event])],
            Op::WaitEvent { event } => match self.events.get(event) {
                Some(&e) => vec![Work::Wait(e)],
                None => {
                    return Err(format!(
                        "node `{}` waits on event {event}, which nothing records",
                        n.name
                    ))
                }
            },
            op if op.is_collective() => self.collective(n, op, &ctx, stream)?,
            // (PASA, asked for by name, stays on its own kernel)
            Op::Attention { scale, causal } | Op::AttentionGrad { scale, causal }
                if self.opts.cudnn && self.opts.attention != CudaAttention::Pasa =>
            {
                let (work, note) = attention_on_cudnn(&n.op, &ctx, *scale, *causal)
                    .map_err(|m| format!("node `{}` ({}): {m}", n.name, n.op.name()))?;
                if let Some(note) = note {
                    self.notes
                        .push(format!("node `{}` ({}): {note}", n.name, n.op.name()));
                }
                work
            }
            op => lower_compute(op, &ctx)
                .map_err(|m| format!("node `{}` ({}): {m}", n.name, op.name()))?,
        };
        Ok(NodeWork {
            node: ni,
            name: n.name.clone(),
            op: n.op.name(),
            stream,
            work,
        })
    }

    /// The work of collective node `n` on `stream`, with its communicator (this rank's
    /// instance of its group on that stream).
    fn collective(
        &mut self,
        n: &Node,
        op: &Op,
        ctx: &NodeCtx,
        stream: usize,
    ) -> Result<Vec<Work>, String> {
        let (mesh, rank) = (self.mesh, self.rank);
        let group = op.group().expect("collectives have a group");
        let members = mesh.group_members(group, rank).ok_or_else(|| {
            format!(
                "node `{}`: group {group} names an axis the mesh {mesh} lacks",
                n.name
            )
        })?;
        let member = members.iter().position(|&m| m == rank).unwrap_or(0);
        let size = members.len();
        let key = CommKey {
            stream,
            axes: group.axes.clone(),
            members,
            member,
        };
        let comm = match self.comm_list.iter().position(|k| *k == key) {
            Some(i) => i,
            None => {
                self.comm_list.push(key);
                self.comm_list.len() - 1
            }
        };
        lower_collective(op, ctx, comm, size)
            .map_err(|m| format!("node `{}` ({}): {m}", n.name, op.name()))
    }
}

/// Every rank creates its communicators in one order: by (stream, axes). Returns them in
/// that order, with the collectives of `nodes` renumbered from first-use order.
fn renumber_comms(comm_list: &[CommKey], nodes: &mut [NodeWork]) -> Vec<CommKey> {
    let mut comms = comm_list.to_vec();
    comms.sort();
    let renumber: Vec<usize> = comm_list
        .iter()
        .map(|k| comms.iter().position(|s| s == k).unwrap_or(0))
        .collect();
    for nw in nodes {
        for w in &mut nw.work {
            if let Work::Collective(c) = w {
                c.comm = renumber[c.comm];
            }
        }
    }
    comms
}

/// The updates as (value offset, target offset, bytes); a value may not overlap another
/// update's target (updates are applied in place).
fn update_copies(p: &Program, loc: &[(u64, u64)]) -> Result<Vec<(u64, u64, u64)>, String> {
    let mut updates = Vec::new();
    for u in &p.updates {
        let (v, t) = (loc[u.value.index()], loc[u.target.index()]);
        if v.1 != t.1 {
            return Err(format!(
                "update of `{}` by `{}` of another size",
                p.value(u.target).name,
                p.value(u.value).name
            ));
        }
        updates.push((v.0, t.0, v.1));
    }
    for &(v, _, vb) in &updates {
        for &(_, t, tb) in &updates {
            if vb > 0 && tb > 0 && v != t && v < t + tb && t < v + vb {
                return Err("an update's new value overlaps another update's target; the CUDA backend applies updates in place and does not run such plans".into());
            }
        }
    }
    Ok(updates)
}

struct NodeCtx<'a> {
    code: i32,
    ins: Vec<(u64, &'a TensorType)>,
    outs: Vec<(u64, &'a TensorType)>,
    /// MatMul operands stored transposed (see [`Gemm::trans_a`]).
    trans: [bool; 2],
    /// The kernels fused attention runs with.
    attention: CudaAttention,
}

fn check_rank(shape: &[usize]) -> Result<(), String> {
    if shape.len() > MAXD {
        return Err(format!(
            "tensors of rank {} (the CUDA kernels take rank {MAXD} at most)",
            shape.len()
        ));
    }
    Ok(())
}

fn copy_nd(
    ty: DType,
    shape: &[usize],
    s_in: Vec<i64>,
    s_out: Vec<i64>,
    modulo: Vec<i64>,
    (x, in_base): (u64, i64),
    (y, out_base): (u64, i64),
) -> Result<Option<Work>, String> {
    check_rank(shape)?;
    let n = numel(shape);
    if n == 0 {
        return Ok(None);
    }
    let mut nd = Nd::new(shape);
    nd.s[0] = s_in;
    nd.s[1] = s_out;
    nd.s[2] = modulo;
    let nd = nd.coalesced(Some(2));
    Ok(Some(elementwise(
        format!("copy_nd_{}", bsz(ty)),
        n,
        vec![
            Arg::I64(n as i64),
            Arg::Nd(nd),
            Arg::I64(in_base),
            Arg::I64(out_base),
            Arg::Ptr(x),
            Arg::Ptr(y),
        ],
    )))
}

fn idx_args(off: u64, ty: &TensorType) -> [Arg; 2] {
    [Arg::Ptr(off), Arg::I32((ty.dtype == DType::I64) as i32)]
}

/// The work of one compute node: one function per op or op family.
fn lower_compute(op: &Op, c: &NodeCtx) -> Result<Vec<Work>, String> {
    let n = c.y().1.numel();
    match op {
        Op::Identity | Op::Copy | Op::Reshape { .. } => copy_through(c),
        Op::Free => Ok(Vec::new()),
        // (before the empty-output case: a dispatch with H = 0 still assigns the slots)
        Op::MoeDispatch { experts, capacity } => moe_dispatch(c, *experts, *capacity),
        Op::MoeCombine => moe_combine(c),
        Op::MoeCombineGrad => moe_combine_grad(c),
        _ if n == 0 && !matches!(op, Op::Split { .. } | Op::TopK { .. }) => Ok(Vec::new()),
        Op::Unary(u) => unary(c, u),
        Op::Binary(b) => binary(c, b),
        Op::Where => where_select(c),
        Op::Cast { to } => cast(c, to),
        Op::MatMul => Ok(vec![Work::Gemm(lower_matmul(c)?)]),
        Op::Softmax { axis } | Op::LogSoftmax { axis } => softmax(op, c, axis),
        Op::GeluTanhGrad => gelu_tanh_grad(c),
        Op::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        } => adamw(c, beta1, beta2, eps, weight_decay),
        Op::SoftmaxCrossEntropy { axis } | Op::SoftmaxCrossEntropyGrad { axis } => {
            cross_entropy(op, c, axis)
        }
        Op::LayerNorm { axis, epsilon }
        | Op::RmsNorm { axis, epsilon }
        | Op::LayerNormGrad { axis, epsilon }
        | Op::RmsNormGrad { axis, epsilon } => norm(op, c, axis, epsilon),
        Op::Reduce { op: rop, axes, .. } => reduce(c, rop, axes),
        Op::ArgMax { axis, .. } => argmax(c, axis),
        Op::CumSum {
            axis,
            exclusive,
            reverse,
        } => cumsum(c, axis, exclusive, reverse),
        Op::Transpose { perm } => transpose(c, perm),
        Op::Slice {
            axes,
            starts,
            steps,
            ..
        } => slice(c, axes, starts, steps),
        Op::Concat { axis } => concat(c, axis),
        Op::Split { axis, .. } => split(c, axis),
        Op::Expand { shape } => expand(c, shape),
        Op::Tile { .. } => tile(c),
        Op::Trilu { upper, k } => trilu(c, upper, k),
        Op::Gather { axis } => gather(c, axis),
        Op::GatherElements { axis } => gather_elements(c, axis),
        Op::GatherND { batch_dims } => gather_nd(c, batch_dims),
        Op::ScatterElements { axis, add } => scatter_elements(c, axis, add),
        Op::ScatterND { add } => scatter_nd(c, add),
        Op::OneHot { axis, depth } => one_hot(c, axis, depth),
        Op::TopK {
            axis, k, largest, ..
        } => topk(c, axis, k, largest),
        Op::Fill { value, dtype, .. } => fill(c, value, dtype),
        Op::Attention { scale, causal } | Op::AttentionGrad { scale, causal } => {
            lower_attention(op, c, *scale, *causal)
        }
        // Lowered by the caller (streams and communicators), never here. Listed by name so
        // that a new op does not compile until it is lowered above or listed.
        Op::AllGather { .. }
        | Op::ReduceScatter { .. }
        | Op::AllReduce { .. }
        | Op::AllToAll { .. }
        | Op::Broadcast { .. }
        | Op::RecordEvent { .. }
        | Op::WaitEvent { .. } => Err(format!(
            "internal: {} reached the compute lowering",
            op.name()
        )),
    }
}

impl<'a> NodeCtx<'a> {
    /// The first input (offset 0 and an empty type for an op without inputs: Fill).
    fn x(&self) -> (u64, &'a TensorType) {
        self.ins.first().copied().unwrap_or((0, &EMPTY))
    }

    /// The first output.
    fn y(&self) -> (u64, &'a TensorType) {
        self.outs.first().copied().unwrap_or((0, &EMPTY))
    }

    /// The error-flag arguments of a kernel that reports bad indices.
    fn err(&self) -> [Arg; 2] {
        [Arg::ErrFlag, Arg::I32(self.code)]
    }
}

fn copy_through(c: &NodeCtx) -> Result<Vec<Work>, String> {
    let (x, _) = c.x();
    let (y, yt) = c.y();
    let n = yt.numel();
    let mut w: Vec<Work> = Vec::new();
    // a reshape may share its input's bytes (the memory plan's views): nothing to copy
    if n > 0 && x != y {
        w.push(Work::Copy {
            src: x,
            dst: y,
            bytes: yt.size_bytes() as u64,
        });
    }
    Ok(w)
}

fn unary(c: &NodeCtx, u: &UnaryOp) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let n = yt.numel();
    let mut w: Vec<Work> = Vec::new();
    let code = u.code() as i32;
    let kernel = if *u == UnaryOp::IsNaN {
        format!("isnan_{}", dt(xt.dtype))
    } else {
        format!("unary_{}", dt(xt.dtype))
    };
    let mut args = vec![];
    if *u != UnaryOp::IsNaN {
        args.push(Arg::I32(code));
    }
    args.extend([Arg::I64(n as i64), Arg::Ptr(x), Arg::Ptr(y)]);
    w.push(elementwise(kernel, n, args));
    Ok(w)
}

fn binary(c: &NodeCtx, b: &BinaryOp) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let n = yt.numel();
    let mut w: Vec<Work> = Vec::new();
    let (bo, bt) = c.ins[1];
    check_rank(&yt.shape)?;
    if xt.dtype == DType::Bool
        && matches!(
            b,
            BinaryOp::Sub | BinaryOp::Div | BinaryOp::Pow | BinaryOp::Mod
        )
    {
        return Err(format!("{} is not defined for bool operands", b.name()));
    }
    let code = b.code() as i32;
    let mut nd = Nd::new(&yt.shape);
    nd.s[0] = bcast(&xt.shape, &yt.shape);
    nd.s[1] = bcast(&bt.shape, &yt.shape);
    let mut args = vec![
        Arg::I32(code),
        Arg::I64(n as i64),
        Arg::Nd(nd.coalesced(None)),
        Arg::Ptr(x),
        Arg::Ptr(bo),
        Arg::Ptr(y),
    ];
    let kernel = if b.is_predicate() {
        format!("compare_{}", dt(xt.dtype))
    } else {
        args.extend(c.err());
        format!("binary_{}", dt(xt.dtype))
    };
    w.push(walk_kernel(kernel, n, args));
    Ok(w)
}

fn where_select(c: &NodeCtx) -> Result<Vec<Work>, String> {
    let (y, yt) = c.y();
    let n = yt.numel();
    let mut w: Vec<Work> = Vec::new();
    check_rank(&yt.shape)?;
    let mut nd = Nd::new(&yt.shape);
    for k in 0..3 {
        nd.s[k] = bcast(&c.ins[k].1.shape, &yt.shape);
    }
    w.push(walk_kernel(
        format!("where_{}", dt(yt.dtype)),
        n,
        vec![
            Arg::I64(n as i64),
            Arg::Nd(nd.coalesced(None)),
            Arg::Ptr(c.ins[0].0),
            Arg::Ptr(c.ins[1].0),
            Arg::Ptr(c.ins[2].0),
            Arg::Ptr(y),
        ],
    ));
    Ok(w)
}

fn cast(c: &NodeCtx, to: &DType) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let n = yt.numel();
    let mut w: Vec<Work> = Vec::new();
    if *to == xt.dtype {
        w.push(Work::Copy {
            src: x,
            dst: y,
            bytes: yt.size_bytes() as u64,
        });
    } else {
        w.push(elementwise(
            format!("cast_{}_{}", dt(xt.dtype), dt(*to)),
            n,
            vec![Arg::I64(n as i64), Arg::Ptr(x), Arg::Ptr(y)],
        ));
    }
    Ok(w)
}

fn softmax(op: &Op, c: &NodeCtx, axis: &usize) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, _) = c.y();
    let mut w: Vec<Work> = Vec::new();
    let (o, d, i) = around(&xt.shape, *axis);
    let log = matches!(op, Op::LogSoftmax { .. }) as i32;
    if d > 0 {
        w.push(lanes(
            format!("softmax_{}", dt(xt.dtype)),
            o * i,
            vec![
                Arg::I64(o as i64),
                Arg::I64(d as i64),
                Arg::I64(i as i64),
                Arg::I32(log),
                Arg::Ptr(x),
                Arg::Ptr(y),
            ],
        ));
    }
    Ok(w)
}

fn gelu_tanh_grad(c: &NodeCtx) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let n = yt.numel();
    let mut w: Vec<Work> = Vec::new();
    let (dy, _) = c.ins[1];
    if n > 0 {
        w.push(elementwise(
            format!("gelu_tanh_grad_{}", dt(xt.dtype)),
            n,
            vec![Arg::I64(n as i64), Arg::Ptr(x), Arg::Ptr(dy), Arg::Ptr(y)],
        ));
    }
    Ok(w)
}

fn adamw(
    c: &NodeCtx,
    beta1: &f64,
    beta2: &f64,
    eps: &f64,
    weight_decay: &f64,
) -> Result<Vec<Work>, String> {
    let (_, yt) = c.y();
    let n = yt.numel();
    let mut w: Vec<Work> = Vec::new();
    if n > 0 {
        let mut args = vec![
            Arg::I64(n as i64),
            Arg::F32((1.0 - beta1) as f32),
            Arg::F32(*beta2 as f32),
            Arg::F32((1.0 - beta2) as f32),
            Arg::F32(*eps as f32),
            Arg::Bits {
                bits: weight_decay.to_bits(),
                len: 8,
            },
        ];
        args.extend(c.ins.iter().map(|(off, _)| Arg::Ptr(*off)));
        args.extend(c.outs.iter().map(|(off, _)| Arg::Ptr(*off)));
        w.push(elementwise("adamw_f32".into(), n, args));
    }
    Ok(w)
}

fn cross_entropy(op: &Op, c: &NodeCtx, axis: &usize) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, _) = c.y();
    let mut w: Vec<Work> = Vec::new();
    let (o, d, i) = around(&xt.shape, *axis);
    let grad = matches!(op, Op::SoftmaxCrossEntropyGrad { .. });
    let (lo, lt) = c.ins[1];
    // the loss gradient (the loss's own buffer when there is none: never read)
    let dy = c.ins.get(2).map_or(y, |(off, _)| *off);
    if o * i > 0 {
        let mut args = vec![
            Arg::I64(o as i64),
            Arg::I64(d as i64),
            Arg::I64(i as i64),
            Arg::I32(grad as i32),
            Arg::Ptr(x),
        ];
        args.extend(idx_args(lo, lt));
        args.extend([Arg::Ptr(dy), Arg::Ptr(y)]);
        args.extend(c.err());
        w.push(lanes(format!("xent_{}", dt(xt.dtype)), o * i, args));
    }
    Ok(w)
}

fn norm(op: &Op, c: &NodeCtx, axis: &usize, epsilon: &f32) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let mut w: Vec<Work> = Vec::new();
    let grad = matches!(op, Op::LayerNormGrad { .. } | Op::RmsNormGrad { .. });
    let rms = matches!(op, Op::RmsNorm { .. } | Op::RmsNormGrad { .. });
    let norm = &xt.shape[*axis..];
    check_rank(norm)?;
    let rows: usize = xt.shape[..*axis].iter().product();
    let d: usize = norm.iter().product();
    let mut nd = Nd::new(norm);
    nd.s[0] = bcast(&c.ins[1].1.shape, norm);
    // the forward's optional bias (s1 of the walk); the gradient's dy and outputs
    let tail = if grad {
        vec![
            Arg::Ptr(c.ins[2].0),
            Arg::Ptr(c.outs[0].0),
            Arg::Ptr(c.outs[1].0),
        ]
    } else {
        let bias = c.ins.get(2).map(|(o, t)| {
            nd.s[1] = bcast(&t.shape, norm);
            Arg::Ptr(*o)
        });
        vec![bias.unwrap_or(Arg::Null), Arg::Ptr(y)]
    };
    let mut args = vec![
        Arg::I64(rows as i64),
        Arg::I64(d as i64),
        Arg::F32(*epsilon),
        Arg::I32(rms as i32),
        Arg::Nd(nd),
        Arg::Ptr(x),
        Arg::Ptr(c.ins[1].0),
    ];
    args.extend(tail);
    let family = if grad { "norm_grad" } else { "norm" };
    if rows * d > 0 {
        w.push(lanes(format!("{family}_{}", dt(xt.dtype)), rows, args));
    } else if !grad {
        // (no normalized elements: the forward is its input)
        w.push(Work::Copy {
            src: x,
            dst: y,
            bytes: yt.size_bytes() as u64,
        });
    }
    Ok(w)
}

fn reduce(c: &NodeCtx, rop: &ReduceOp, axes: &[usize]) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, _) = c.y();
    let mut w: Vec<Work> = Vec::new();
    let mut axes = axes.to_vec();
    axes.sort_unstable();
    axes.dedup();
    let s = &xt.shape;
    check_rank(s)?;
    let cs = contiguous(s);
    let kept: Vec<usize> = (0..s.len()).filter(|d| !axes.contains(d)).collect();
    let mut kn = Nd::new(&kept.iter().map(|&d| s[d]).collect::<Vec<_>>());
    kn.s[0] = kept.iter().map(|&d| cs[d]).collect();
    let mut rn = Nd::new(&axes.iter().map(|&d| s[d]).collect::<Vec<_>>());
    rn.s[0] = axes.iter().map(|&d| cs[d]).collect();
    let nout: usize = kept.iter().map(|&d| s[d]).product();
    let nred: usize = axes.iter().map(|&d| s[d]).product();
    let code = ReduceOp::ALL.iter().position(|r| r == rop).unwrap_or(0) as i32;
    let args = vec![
        Arg::I32(code),
        Arg::I64(nout as i64),
        Arg::I64(nred as i64),
        // (merging keeps every output's and every reduced element's offset, and the
        // order a thread visits the reduced elements in: the same sums, bit for bit)
        Arg::Nd(kn.coalesced(None)),
        Arg::Nd(rn.coalesced(None)),
        Arg::Ptr(x),
        Arg::Ptr(y),
    ];
    let kernel = format!("reduce_{}", dt(xt.dtype));
    if xt.dtype.is_float() {
        w.push(lanes(kernel, nout, args));
    } else {
        w.push(elementwise(kernel, nout, args));
    }
    Ok(w)
}

fn argmax(c: &NodeCtx, axis: &usize) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, _) = c.y();
    let mut w: Vec<Work> = Vec::new();
    let (o, d, i) = around(&xt.shape, *axis);
    if d == 0 {
        return Err(format!("ArgMax over axis {axis} of size 0"));
    }
    w.push(elementwise(
        format!("argmax_{}", dt(xt.dtype)),
        o * i,
        vec![
            Arg::I64(o as i64),
            Arg::I64(d as i64),
            Arg::I64(i as i64),
            Arg::Ptr(x),
            Arg::Ptr(y),
        ],
    ));
    Ok(w)
}

fn cumsum(
    c: &NodeCtx,
    axis: &usize,
    exclusive: &bool,
    reverse: &bool,
) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, _) = c.y();
    let mut w: Vec<Work> = Vec::new();
    if xt.dtype == DType::Bool {
        return Err("CumSum is not defined for bool".into());
    }
    let (o, d, i) = around(&xt.shape, *axis);
    w.push(elementwise(
        format!("cumsum_{}", dt(xt.dtype)),
        o * i,
        vec![
            Arg::I64(o as i64),
            Arg::I64(d as i64),
            Arg::I64(i as i64),
            Arg::I32(*exclusive as i32),
            Arg::I32(*reverse as i32),
            Arg::Ptr(x),
            Arg::Ptr(y),
        ],
    ));
    Ok(w)
}

fn transpose(c: &NodeCtx, perm: &[usize]) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let mut w: Vec<Work> = Vec::new();
    let cs = contiguous(&xt.shape);
    let s_in = perm.iter().map(|&p| cs[p]).collect();
    w.extend(copy_nd(
        xt.dtype,
        &yt.shape,
        s_in,
        contiguous(&yt.shape),
        vec![0; perm.len()],
        (x, 0),
        (y, 0),
    )?);
    Ok(w)
}

fn slice(c: &NodeCtx, axes: &[usize], starts: &[i64], steps: &[i64]) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let mut w: Vec<Work> = Vec::new();
    let cs = contiguous(&xt.shape);
    let mut s_in = cs.clone();
    let mut base = 0i64;
    for k in 0..axes.len() {
        base += starts[k] * cs[axes[k]];
        s_in[axes[k]] = cs[axes[k]] * steps[k];
    }
    let r = yt.rank();
    w.extend(copy_nd(
        xt.dtype,
        &yt.shape,
        s_in,
        contiguous(&yt.shape),
        vec![0; r],
        (x, base),
        (y, 0),
    )?);
    Ok(w)
}

fn concat(c: &NodeCtx, axis: &usize) -> Result<Vec<Work>, String> {
    let (y, yt) = c.y();
    let mut w: Vec<Work> = Vec::new();
    let os = contiguous(&yt.shape);
    let mut at = 0i64;
    for &(io, it) in &c.ins {
        let r = it.rank();
        w.extend(copy_nd(
            it.dtype,
            &it.shape,
            contiguous(&it.shape),
            os.clone(),
            vec![0; r],
            (io, 0),
            (y, at * os[*axis]),
        )?);
        at += it.shape[*axis] as i64;
    }
    Ok(w)
}

fn split(c: &NodeCtx, axis: &usize) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let mut w: Vec<Work> = Vec::new();
    let cs = contiguous(&xt.shape);
    let mut at = 0i64;
    for &(oo, ot) in &c.outs {
        let r = ot.rank();
        w.extend(copy_nd(
            ot.dtype,
            &ot.shape,
            cs.clone(),
            contiguous(&ot.shape),
            vec![0; r],
            (x, at * cs[*axis]),
            (oo, 0),
        )?);
        at += ot.shape[*axis] as i64;
    }
    Ok(w)
}

fn expand(c: &NodeCtx, shape: &[usize]) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, _) = c.y();
    let mut w: Vec<Work> = Vec::new();
    w.extend(copy_nd(
        xt.dtype,
        shape,
        bcast(&xt.shape, shape),
        contiguous(shape),
        vec![0; shape.len()],
        (x, 0),
        (y, 0),
    )?);
    Ok(w)
}

fn tile(c: &NodeCtx) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let mut w: Vec<Work> = Vec::new();
    let modulo = xt.shape.iter().map(|&d| d as i64).collect();
    w.extend(copy_nd(
        xt.dtype,
        &yt.shape,
        contiguous(&xt.shape),
        contiguous(&yt.shape),
        modulo,
        (x, 0),
        (y, 0),
    )?);
    Ok(w)
}

fn trilu(c: &NodeCtx, upper: &bool, k: &i64) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let n = yt.numel();
    let mut w: Vec<Work> = Vec::new();
    let r = xt.rank();
    let (rows, cols) = (xt.shape[r - 2], xt.shape[r - 1]);
    w.push(elementwise(
        format!("trilu_{}", bsz(xt.dtype)),
        n,
        vec![
            Arg::I64(n as i64),
            Arg::I64(rows as i64),
            Arg::I64(cols as i64),
            Arg::I32(*upper as i32),
            Arg::I64(*k),
            Arg::Ptr(x),
            Arg::Ptr(y),
        ],
    ));
    Ok(w)
}

fn gather(c: &NodeCtx, axis: &usize) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let n = yt.numel();
    let mut w: Vec<Work> = Vec::new();
    let (io, it) = c.ins[1];
    let (o, d, i) = around(&xt.shape, *axis);
    let mut args = vec![
        Arg::I64(o as i64),
        Arg::I64(d as i64),
        Arg::I64(it.numel() as i64),
        Arg::I64(i as i64),
    ];
    args.extend(idx_args(io, it));
    args.extend([Arg::Ptr(x), Arg::Ptr(y)]);
    args.extend(c.err());
    w.push(elementwise(format!("gather_{}", bsz(xt.dtype)), n, args));
    Ok(w)
}

fn gather_elements(c: &NodeCtx, axis: &usize) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let n = yt.numel();
    let mut w: Vec<Work> = Vec::new();
    let (io, it) = c.ins[1];
    check_rank(&it.shape)?;
    let mut nd = Nd::new(&it.shape);
    nd.s[0] = contiguous(&xt.shape);
    let mut args = vec![
        Arg::I64(n as i64),
        Arg::Nd(nd),
        Arg::I32(*axis as i32),
        Arg::I64(xt.shape[*axis] as i64),
    ];
    args.extend(idx_args(io, it));
    args.extend([Arg::Ptr(x), Arg::Ptr(y)]);
    args.extend(c.err());
    w.push(elementwise(
        format!("gather_elements_{}", bsz(xt.dtype)),
        n,
        args,
    ));
    Ok(w)
}

fn gather_nd(c: &NodeCtx, batch_dims: &usize) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let n = yt.numel();
    let mut w: Vec<Work> = Vec::new();
    let (io, it) = c.ins[1];
    let b = *batch_dims;
    let last = it.shape[it.rank() - 1];
    check_rank(&xt.shape[b..b + last])?;
    let ds = &xt.shape;
    let slice: usize = ds[b + last..].iter().product();
    let tpb: usize = it.shape[b..it.rank() - 1].iter().product();
    let batch_stride: usize = ds[b..].iter().product();
    let mut nd = Nd::new(&ds[b..b + last]);
    nd.s[0] = (0..last)
        .map(|k| ds[b + k + 1..].iter().product::<usize>() as i64)
        .collect();
    let mut args = vec![
        Arg::I64(n as i64),
        Arg::I64(slice.max(1) as i64),
        Arg::I64(tpb.max(1) as i64),
        Arg::I64(batch_stride as i64),
        Arg::I32(last as i32),
        Arg::Nd(nd),
    ];
    args.extend(idx_args(io, it));
    args.extend([Arg::Ptr(x), Arg::Ptr(y)]);
    args.extend(c.err());
    w.push(elementwise(format!("gather_nd_{}", bsz(xt.dtype)), n, args));
    Ok(w)
}

fn scatter_elements(c: &NodeCtx, axis: &usize, add: &bool) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let mut w: Vec<Work> = Vec::new();
    let (io, it) = c.ins[1];
    let (uo, _) = c.ins[2];
    check_rank(&it.shape)?;
    w.push(Work::Copy {
        src: x,
        dst: y,
        bytes: yt.size_bytes() as u64,
    });
    let mut lane_shape = it.shape.clone();
    lane_shape[*axis] = 1;
    let lanes_n = numel(&lane_shape);
    if it.numel() > 0 {
        let mut nd = Nd::new(&lane_shape);
        nd.s[0] = contiguous(&xt.shape);
        nd.s[1] = contiguous(&it.shape);
        let mut args = vec![
            Arg::I64(lanes_n as i64),
            Arg::Nd(nd),
            Arg::I32(*axis as i32),
            Arg::I64(it.shape[*axis] as i64),
            Arg::I64(xt.shape[*axis] as i64),
        ];
        args.extend(idx_args(io, it));
        args.extend([Arg::Ptr(uo), Arg::Ptr(y), Arg::I32(*add as i32)]);
        args.extend(c.err());
        w.push(elementwise(
            format!("scatter_elements_{}", dt(xt.dtype)),
            lanes_n,
            args,
        ));
    }
    Ok(w)
}

fn scatter_nd(c: &NodeCtx, add: &bool) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let mut w: Vec<Work> = Vec::new();
    let (io, it) = c.ins[1];
    let (uo, _) = c.ins[2];
    let last = it.shape[it.rank() - 1];
    check_rank(&xt.shape[..last])?;
    // the result may lie in the data's own bytes (an in-place pair): then no copy
    if x != y {
        w.push(Work::Copy {
            src: x,
            dst: y,
            bytes: yt.size_bytes() as u64,
        });
    }
    let slice: usize = xt.shape[last..].iter().product();
    let tuples: usize = it.shape[..it.rank() - 1].iter().product();
    if slice > 0 && tuples > 0 {
        let mut nd = Nd::new(&xt.shape[..last]);
        nd.s[0] = (0..last)
            .map(|k| xt.shape[k + 1..].iter().product::<usize>() as i64)
            .collect();
        let mut args = vec![
            Arg::I64(slice as i64),
            Arg::I64(tuples as i64),
            Arg::I32(last as i32),
            Arg::Nd(nd),
        ];
        args.extend(idx_args(io, it));
        args.extend([Arg::Ptr(uo), Arg::Ptr(y), Arg::I32(*add as i32)]);
        args.extend(c.err());
        w.push(elementwise(
            format!("scatter_nd_{}", dt(xt.dtype)),
            slice,
            args,
        ));
    }
    Ok(w)
}

fn one_hot(c: &NodeCtx, axis: &usize, depth: &usize) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, yt) = c.y();
    let n = yt.numel();
    let mut w: Vec<Work> = Vec::new();
    let (vo, vt) = c.ins[1];
    let outer: usize = xt.shape[..*axis].iter().product();
    let inner: usize = xt.shape[*axis..].iter().product();
    let mut args = vec![
        Arg::I64(outer as i64),
        Arg::I64(*depth as i64),
        Arg::I64(inner as i64),
    ];
    args.extend(idx_args(x, xt));
    args.extend([Arg::Ptr(vo), Arg::Ptr(y)]);
    w.push(elementwise(format!("one_hot_{}", dt(vt.dtype)), n, args));
    Ok(w)
}

fn topk(c: &NodeCtx, axis: &usize, k: &usize, largest: &bool) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (y, _) = c.y();
    let mut w: Vec<Work> = Vec::new();
    let (o, d, i) = around(&xt.shape, *axis);
    if *k > 0 && o * i > 0 {
        w.push(elementwise(
            format!("topk_{}", dt(xt.dtype)),
            o * i,
            vec![
                Arg::I64(o as i64),
                Arg::I64(d as i64),
                Arg::I64(i as i64),
                Arg::I64(*k as i64),
                Arg::I32(*largest as i32),
                Arg::Ptr(x),
                Arg::Ptr(y),
                Arg::Ptr(c.outs[1].0),
            ],
        ));
    }
    Ok(w)
}

/// The leading arguments of every `moe_*` kernel but `moe_zero`: (T, K, E, C, H), the
/// choices (with their width) and the slots.
fn moe_args(c: &NodeCtx, ye_shape: [usize; 3], slots: u64) -> Vec<Arg> {
    let (io, it) = c.ins[1];
    let [e, cap, h] = ye_shape;
    let mut args: Vec<Arg> = [it.shape[0], it.shape[1], e, cap, h]
        .iter()
        .map(|&d| Arg::I64(d as i64))
        .collect();
    args.extend(idx_args(io, it));
    args.push(Arg::Ptr(slots));
    args
}

/// The dtype of an MoE node's float data, refused when the kernels have none for it.
fn moe_float(op: &str, d: DType) -> Result<DType, String> {
    match d {
        DType::F32 | DType::BF16 | DType::F16 => Ok(d),
        _ => Err(format!(
            "{op}: no CUDA kernel for {d} data (f32, bf16, f16)"
        )),
    }
}

/// Zeroes `n` elements of `dtype` at `y` (`moe_zero_*`).
fn moe_zero(y: u64, n: usize, dtype: DType) -> Work {
    elementwise(
        format!("moe_zero_{}", bsz(dtype)),
        n,
        vec![Arg::I64(n as i64), Arg::Ptr(y)],
    )
}

/// MoeDispatch: the slots (`moe_slots`, one thread per expert), the buffer zeroed, the kept
/// rows copied.
fn moe_dispatch(c: &NodeCtx, experts: usize, capacity: usize) -> Result<Vec<Work>, String> {
    let (x, xt) = c.x();
    let (buf, bt) = c.y();
    let dtype = moe_float("MoeDispatch", xt.dtype)?;
    let (slots, _) = c.outs[1];
    let (t, k, h) = (xt.shape[0], c.ins[1].1.shape[1], xt.shape[1]);
    let args = moe_args(c, [experts, capacity, h], slots);
    let mut slot_args = args.clone();
    slot_args.remove(4); // (no H)
    slot_args.extend(c.err());
    let mut copy_args = args;
    copy_args.extend([Arg::Ptr(x), Arg::Ptr(buf)]);
    Ok(vec![
        elementwise("moe_slots".into(), experts, slot_args),
        moe_zero(buf, bt.numel(), dtype),
        elementwise(format!("moe_dispatch_{}", bsz(dtype)), t * k * h, copy_args),
    ])
}

/// MoeCombine: one thread per output element (`moe_combine_*`).
fn moe_combine(c: &NodeCtx) -> Result<Vec<Work>, String> {
    let [(ye, yet), _, (slots, _), (w, _)] = c.ins[..] else {
        return Err("internal: MoeCombine takes 4 inputs".into());
    };
    let dtype = moe_float("MoeCombine", yet.dtype)?;
    let (y, yt) = c.y();
    let dims = [yet.shape[0], yet.shape[1], yet.shape[2]];
    let mut args = moe_args(c, dims, slots);
    args.extend([Arg::Ptr(ye), Arg::Ptr(w), Arg::Ptr(y)]);
    args.extend(c.err());
    Ok(vec![elementwise(
        format!("moe_combine_{}", dt(dtype)),
        yt.numel(),
        args,
    )])
}

/// MoeCombineGrad: d_expert_out zeroed, its kept rows written (`moe_combine_grad_rows_*`),
/// then d_weights (`moe_combine_grad_weights_*`, one thread per choice).
fn moe_combine_grad(c: &NodeCtx) -> Result<Vec<Work>, String> {
    let [(ye, yet), (_, it), (slots, _), (w, _), (dy, _)] = c.ins[..] else {
        return Err("internal: MoeCombineGrad takes 5 inputs".into());
    };
    let [(dye, dyet), (dw, _)] = c.outs[..] else {
        return Err("internal: MoeCombineGrad has two outputs".into());
    };
    let dtype = moe_float("MoeCombineGrad", yet.dtype)?;
    let dims = [yet.shape[0], yet.shape[1], yet.shape[2]];
    let choices = it.numel();
    let args = moe_args(c, dims, slots);
    let mut rows = args.clone();
    rows.extend([Arg::Ptr(w), Arg::Ptr(dy), Arg::Ptr(dye)]);
    rows.extend(c.err());
    let mut weights = args;
    weights.extend([Arg::Ptr(ye), Arg::Ptr(dy), Arg::Ptr(dw)]);
    weights.extend(c.err());
    Ok(vec![
        moe_zero(dye, dyet.numel(), dtype),
        elementwise(
            format!("moe_combine_grad_rows_{}", dt(dtype)),
            choices * dims[2],
            rows,
        ),
        elementwise(
            format!("moe_combine_grad_weights_{}", dt(dtype)),
            choices,
            weights,
        ),
    ])
}

fn fill(c: &NodeCtx, value: &f64, dtype: &DType) -> Result<Vec<Work>, String> {
    let (y, yt) = c.y();
    let n = yt.numel();
    let mut w: Vec<Work> = Vec::new();
    w.push(elementwise(
        format!("fill_{}", dt(*dtype)),
        n,
        vec![
            Arg::I64(n as i64),
            Arg::Bits {
                bits: fill_bits(*dtype, *value),
                len: dtype.size_bytes(),
            },
            Arg::Ptr(y),
        ],
    ));
    Ok(w)
}

static EMPTY: TensorType = TensorType {
    dtype: DType::F32,
    shape: Vec::new(),
};

fn lower_matmul(c: &NodeCtx) -> Result<Gemm, String> {
    let (ao, at) = c.ins[0];
    let (bo, bt) = c.ins[1];
    let (yo, _) = c.outs[0];
    let dtype = at.dtype;
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(format!("MatMul of {dtype}"));
    }
    let mut sa = at.shape.clone();
    let mut sb = bt.shape.clone();
    if sa.len() == 1 {
        sa.insert(0, 1);
    }
    if sb.len() == 1 {
        sb.push(1);
    }
    let (m, k) = (sa[sa.len() - 2], sa[sa.len() - 1]);
    let n = sb[sb.len() - 1];
    let batch = hzp_ir::broadcast_shapes(&sa[..sa.len() - 2], &sb[..sb.len() - 2])
        .ok_or("batch dims do not broadcast")?;
    check_rank(&batch)?;
    let esz = dtype.size_bytes() as i64;
    // element strides of each operand's batch dims in the broadcast batch shape
    let ba = bcast_batch(&sa[..sa.len() - 2], &batch, (m * k) as i64);
    let bb = bcast_batch(&sb[..sb.len() - 2], &batch, (k * n) as i64);
    let bc = bcast_batch(&batch, &batch, (m * n) as i64);
    let (inner, outer_shape) = match batch.split_last() {
        Some((&last, rest)) => (last, rest.to_vec()),
        None => (1, vec![]),
    };
    let r = batch.len();
    let (sa_in, sb_in, sc_in) = if r > 0 {
        (ba[r - 1], bb[r - 1], bc[r - 1])
    } else {
        (0, 0, 0)
    };
    let mut calls = Vec::new();
    let outer: usize = outer_shape.iter().product();
    for o in 0..outer {
        let mut rem = o;
        let (mut oa, mut ob, mut oc) = (0i64, 0i64, 0i64);
        for d in (0..outer_shape.len()).rev() {
            let cd = (rem % outer_shape[d]) as i64;
            rem /= outer_shape[d];
            oa += cd * ba[d];
            ob += cd * bb[d];
            oc += cd * bc[d];
        }
        calls.push((
            ao + (oa * esz) as u64,
            bo + (ob * esz) as u64,
            yo + (oc * esz) as u64,
        ));
    }
    Ok(Gemm {
        dtype,
        m,
        n,
        k,
        batch: inner,
        stride_a: sa_in,
        stride_b: sb_in,
        stride_c: sc_in,
        trans_a: c.trans[0],
        trans_b: c.trans[1],
        calls,
    })
}

/// A fused attention node with cuDNN there ([`LowerOptions::cudnn`]): [`Work::Sdpa`] when
/// [`super::sdpa::plan_sdpa`] accepts it (hzp's launches, or why there are none, as its
/// fallback); otherwise hzp's launches and a note naming why cuDNN does not take it, or, when
/// hzp's kernels may not run either, an error giving both reasons.
fn attention_on_cudnn(
    op: &Op,
    c: &NodeCtx,
    scale: f64,
    causal: bool,
) -> Result<(Vec<Work>, Option<String>), String> {
    use super::sdpa::{plan_sdpa, Role, SdpaKind};
    let kind = if matches!(op, Op::AttentionGrad { .. }) {
        SdpaKind::Backward
    } else {
        SdpaKind::Forward
    };
    let ins: Vec<&TensorType> = c.ins.iter().map(|x| x.1).collect();
    let outs: Vec<&TensorType> = c.outs.iter().map(|x| x.1).collect();
    let roles: &[Role] = match kind {
        SdpaKind::Forward => &[Role::Q, Role::K, Role::V, Role::O, Role::Stats],
        SdpaKind::Backward => &[
            Role::Q,
            Role::K,
            Role::V,
            Role::O,
            Role::Stats,
            Role::DO,
            Role::DQ,
            Role::DK,
            Role::DV,
        ],
    };
    let offsets: Vec<u64> = c.ins.iter().chain(&c.outs).map(|x| x.0).collect();
    let refusal = match plan_sdpa(kind, &ins, &outs, scale, causal) {
        Ok(_) if offsets.iter().any(|o| o % 16 != 0) => {
            "an operand is not 16-byte aligned in the arena".to_string()
        }
        Ok(graph) => {
            let operands = roles
                .iter()
                .zip(&offsets)
                .map(|(r, &o)| (r.uid(), o))
                .collect();
            let fallback = lower_attention(op, c, scale, causal);
            return Ok((
                vec![Work::Sdpa(Box::new(SdpaWork {
                    graph,
                    operands,
                    fallback,
                }))],
                None,
            ));
        }
        Err(r) => r.to_string(),
    };
    let why = format!("cuDNN's fused attention does not take it: {refusal}");
    match lower_attention(op, c, scale, causal) {
        Ok(work) => Ok((work, Some(format!("{why}; hzp's attention kernels run it")))),
        Err(e) => Err(format!("{e} ({why})")),
    }
}

/// The launches of a fused attention (`attn_fwd`, or `attn_fwd_pasa_f16` with
/// [`CudaAttention::Pasa`]) or of its gradient (`attn_dq`, then `attn_dkv`). Operands: q, k,
/// v (and o, lse, do for the gradient), then the optional additive mask, read through its
/// broadcast strides over [B, HQ, T, S].
fn lower_attention(op: &Op, c: &NodeCtx, scale: f64, causal: bool) -> Result<Vec<Work>, String> {
    if c.attention == CudaAttention::Off {
        return Err(format!(
            "{} (fused attention): hzp's CUDA attention kernels are correct but scalar, \
             slower than attention written out, so they run only when asked: compile the \
             model with --no-fuse-attention to keep attention as products and softmax on \
             cuBLAS, or run with --attention flash (or HZP_CUDA_ATTENTION=1) for hzp's \
             kernels, --attention pasa for PASA in fp16",
            op.name()
        ));
    }
    let grad = matches!(op, Op::AttentionGrad { .. });
    let ((q, qt), (k, kt), (v, vt)) = (c.ins[0], c.ins[1], c.ins[2]);
    let pasa = c.attention == CudaAttention::Pasa;
    if pasa && qt.dtype != DType::F16 {
        return Err(format!(
            "--attention pasa computes attention in fp16, but this plan's attention is {}: \
             compile the model with --precision fp16",
            qt.dtype
        ));
    }
    let (b, hq, t, d) = (qt.shape[0], qt.shape[1], qt.shape[2], qt.shape[3]);
    let (hkv, s, dv) = (kt.shape[1], kt.shape[2], vt.shape[3]);
    if d > ATTENTION_MAX_HEAD || dv > ATTENTION_MAX_HEAD {
        return Err(format!(
            "{}: head sizes {d} and {dv} (the CUDA attention kernels take at most \
             {ATTENTION_MAX_HEAD}); compile with --no-fuse-attention",
            op.name()
        ));
    }
    let (mask, strides) = match c.ins.get(if grad { 6 } else { 3 }) {
        Some(&(m, mt)) => (Arg::Ptr(m), bcast(&mt.shape, &[b, hq, t, s])),
        None => (Arg::Null, vec![0; 4]),
    };
    let mut dims = vec![
        Arg::I64(b as i64),
        Arg::I64(hq as i64),
        Arg::I64(hkv as i64),
        Arg::I64(t as i64),
        Arg::I64(s as i64),
        Arg::I64(d as i64),
        Arg::I64(dv as i64),
        Arg::F32(scale as f32),
        Arg::I32(causal as i32),
    ];
    dims.extend(strides.into_iter().map(Arg::I64));
    let launch = |kernel: &str, blocks: usize, ptrs: Vec<Arg>| {
        let mut args = dims.clone();
        args.extend(ptrs);
        Work::Kernel(Launch {
            kernel: format!("{kernel}_{}", dt(qt.dtype)),
            grid: lane_grid(blocks),
            block: ATTENTION_THREADS,
            args,
        })
    };
    let query_blocks = b * hq * t.div_ceil(ATTENTION_ROWS);
    if !grad {
        let ((o, _), (lse, _)) = (c.outs[0], c.outs[1]);
        if pasa {
            // (the kernel exists for f16 only: its name has no dtype to add)
            let mut args = dims.clone();
            args.push(Arg::F32(PASA_BETA));
            args.extend([
                Arg::Ptr(q),
                Arg::Ptr(k),
                Arg::Ptr(v),
                mask,
                Arg::Ptr(o),
                Arg::Ptr(lse),
            ]);
            return Ok(vec![Work::Kernel(Launch {
                kernel: "attn_fwd_pasa_f16".into(),
                grid: lane_grid(query_blocks),
                block: ATTENTION_THREADS,
                args,
            })]);
        }
        let ptrs = vec![
            Arg::Ptr(q),
            Arg::Ptr(k),
            Arg::Ptr(v),
            mask,
            Arg::Ptr(o),
            Arg::Ptr(lse),
        ];
        return Ok(vec![launch("attn_fwd", query_blocks, ptrs)]);
    }
    let ((o, _), (lse, _), (dout, _)) = (c.ins[3], c.ins[4], c.ins[5]);
    let ((dq, _), (dk, _), (dvo, _)) = (c.outs[0], c.outs[1], c.outs[2]);
    let common = [
        Arg::Ptr(q),
        Arg::Ptr(k),
        Arg::Ptr(v),
        Arg::Ptr(o),
        Arg::Ptr(lse),
        Arg::Ptr(dout),
        mask,
    ];
    let mut dq_ptrs = common.to_vec();
    dq_ptrs.push(Arg::Ptr(dq));
    let mut dkv_ptrs = common.to_vec();
    dkv_ptrs.extend([Arg::Ptr(dk), Arg::Ptr(dvo)]);
    Ok(vec![
        launch("attn_dq", query_blocks, dq_ptrs),
        launch("attn_dkv", b * hkv * s.div_ceil(ATTENTION_KEYS), dkv_ptrs),
    ])
}

fn bcast_batch(x: &[usize], batch: &[usize], mat: i64) -> Vec<i64> {
    let st: Vec<i64> = bcast(x, batch).into_iter().map(|s| s * mat).collect();
    st
}

fn lower_collective(op: &Op, c: &NodeCtx, comm: usize, size: usize) -> Result<Vec<Work>, String> {
    let (x, xt) = c.ins[0];
    let (y, yt) = c.outs[0];
    let contiguous_axis = |axis: usize| -> Result<(), String> {
        if xt.shape[..axis].iter().product::<usize>() > 1 {
            return Err(format!(
                "on axis {axis} of {xt}: the shards are not contiguous (the CUDA backend runs gathers and scatters on the leading non-trivial axis only)"
            ));
        }
        Ok(())
    };
    let coll = |kind, count: usize, reduce, root| Collective {
        kind,
        comm,
        send: x,
        recv: y,
        count,
        dtype: xt.dtype,
        reduce,
        root,
        size,
    };
    if yt.numel() == 0 {
        return Ok(vec![]);
    }
    let c = match op {
        Op::AllGather { axis, .. } => {
            contiguous_axis(*axis)?;
            coll(CollKind::AllGather, xt.numel(), ReduceOp::Sum, 0)
        }
        Op::ReduceScatter { axis, reduce, .. } => {
            contiguous_axis(*axis)?;
            coll(CollKind::ReduceScatter, xt.numel(), *reduce, 0)
        }
        Op::AllReduce { reduce, .. } => coll(CollKind::AllReduce, xt.numel(), *reduce, 0),
        Op::AllToAll {
            split_axis,
            concat_axis,
            ..
        } => {
            if *split_axis != 0 || *concat_axis != 0 {
                return Err(format!(
                    "split axis {split_axis}, concat axis {concat_axis}: the CUDA backend runs AllToAll on axis 0 only"
                ));
            }
            coll(CollKind::AllToAll, xt.numel(), ReduceOp::Sum, 0)
        }
        Op::Broadcast { root, .. } => coll(CollKind::Broadcast, xt.numel(), ReduceOp::Sum, *root),
        other => return Err(format!("{} is not a collective", other.name())),
    };
    if c.dtype == DType::Bool
        && matches!(c.kind, CollKind::ReduceScatter | CollKind::AllReduce)
        && c.reduce == ReduceOp::Mean
    {
        return Err("a mean of bools".into());
    }
    Ok(vec![Work::Collective(c)])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element's offsets in the four stride arrays, the kernels' way (copy_nd's
    /// modulo on array `modulo`): the walk as the kernels see it.
    fn walk(nd: &Nd, modulo: Option<usize>) -> Vec<[i64; 4]> {
        let n: i64 = nd.shape.iter().product();
        (0..n)
            .map(|i| {
                let mut r = i;
                let mut o = [0i64; 4];
                for k in (0..nd.shape.len()).rev() {
                    let c = r % nd.shape[k];
                    r /= nd.shape[k];
                    for (a, oa) in o.iter_mut().enumerate() {
                        *oa += if Some(a) == modulo {
                            // the modulo array reduces the coordinate of operand 0
                            0
                        } else if a == 0 && modulo.is_some_and(|m| nd.s[m][k] > 0) {
                            (c % nd.s[modulo.unwrap()][k]) * nd.s[0][k]
                        } else {
                            c * nd.s[a][k]
                        };
                    }
                }
                o
            })
            .collect()
    }

    #[test]
    fn coalescing_keeps_every_offset_and_merges_what_it_can() {
        // a small deterministic generator (no test-only dependency)
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        let mut merged_some = 0;
        for case in 0..400 {
            let rank = 1 + next(5) as usize;
            let shape: Vec<usize> = (0..rank).map(|_| 1 + next(4) as usize).collect();
            let mut nd = Nd::new(&shape);
            // operand 0, 1: broadcast views of random sub-shapes or permuted contiguous strides
            for a in 0..2 {
                let sub: Vec<usize> = shape
                    .iter()
                    .map(|&d| if next(3) == 0 { 1 } else { d })
                    .collect();
                nd.s[a] = if next(2) == 0 {
                    bcast(&sub, &shape)
                } else {
                    let mut perm: Vec<usize> = (0..rank).collect();
                    for k in (1..rank).rev() {
                        perm.swap(k, next(k as u64 + 1) as usize);
                    }
                    let cs = contiguous(&perm.iter().map(|&p| shape[p]).collect::<Vec<_>>());
                    let mut st = vec![0; rank];
                    for (k, &p) in perm.iter().enumerate() {
                        st[p] = cs[k];
                    }
                    st
                };
            }
            let modulo = (case % 3 == 0).then_some(2);
            if modulo.is_some() {
                nd.s[2] = shape
                    .iter()
                    .map(|&d| if next(3) == 0 { d as i64 } else { 0 })
                    .collect();
            }
            let c = nd.coalesced(modulo);
            assert_eq!(
                walk(&nd, modulo),
                walk(&c, modulo),
                "case {case}: {nd:?} coalesced to {c:?}"
            );
            assert!(c.shape.len() <= nd.shape.len().max(1));
            if c.shape.len() < shape.iter().filter(|&&d| d > 1).count() {
                merged_some += 1;
            }
        }
        assert!(merged_some > 50, "only {merged_some} cases merged dims");
        // same-shape contiguous operands become one dim
        let shape = [8, 12, 64, 64];
        let mut nd = Nd::new(&shape);
        nd.s[0] = bcast(&shape, &shape);
        nd.s[1] = bcast(&shape, &shape);
        assert_eq!(nd.coalesced(None).shape, vec![8 * 12 * 64 * 64]);
        // a [1, 1, T, T] mask against [B, H, T, T]: two dims
        let mut nd = Nd::new(&shape);
        nd.s[0] = bcast(&[1, 1, 64, 64], &shape);
        nd.s[1] = bcast(&shape, &shape);
        assert_eq!(nd.coalesced(None).shape, vec![8 * 12, 64 * 64]);
    }
}
