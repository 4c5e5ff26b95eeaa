//! The CUDA executor (feature `cuda`): one process per GPU runs one rank of a lowered plan.
//!
//! Per rank: one device allocation (the arena, plus a 4-byte error word after it) holding
//! every value at its planned offset; one CUDA stream per plan stream; one host thread per
//! plan stream issuing that stream's work in program order (the compute thread launches
//! kernels and cuBLAS products, the background threads issue the NCCL collectives), so the
//! compute thread never waits to launch a collective. `RecordEvent`/`WaitEvent` are CUDA
//! events; a waiting thread first waits on the host until the recording thread has *issued*
//! the record of this step (never for its completion), then makes its stream wait on the
//! event. NCCL communicators: one per (group instance, stream); rank 0 creates the unique ids
//! and hands them to the others over the TCP rendezvous.
//!
//! Timing: CUDA events around every node give each stream's busy time; the compute stream's
//! exposed communication is the time it stands still at waits on events of comm streams
//! (events recorded just before and just after each such wait). In sync mode every node,
//! collectives included, is issued on the compute stream in program order, and the
//! collectives' time is the exposed communication.

use super::kernels;
use super::local::{coll_bytes, describe, LocalComm, LocalGroup};
use super::lower::{Arg, CollKind, Collective, Gemm, LoweredPlan, NodeWork, Work};
use super::probe::{self, Lib};
use crate::comm::rendezvous::{DistEnv, Rendezvous};
use crate::executor::bytes::{data_bytes, scalar_f64, tensor_from_bytes, write_tensor};
use crate::executor::{cut_parameters, CommMode, ExecError, PlanExecutor, StepStats};
use crate::watchdog::{CollRecord, CollState, FlightRecorder, FlightReport, RankRecord};
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result as drv, sys, CudaContext};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use cudarc::nvrtc::sys as nvrtc_sys;
use hzp_ir::{DType, Plan, ReduceOp, Tensor, ValueId};
use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[path = "graph_exec.rs"]
mod graph_exec;
use graph_exec::{record_timing, GraphRun};
#[path = "lt_exec.rs"]
mod lt_exec;

/// How to run on the GPU.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    pub comm: CommMode,
    /// How long the rendezvous, host-side event waits, a communicator's set-up and a step's
    /// collectives may take (`--collective-timeout`): past it, NCCL communicators are aborted
    /// and the step fails naming what it waited for.
    pub timeout: Duration,
    /// How the plan is lowered (`--attention`).
    pub lower: super::lower::LowerOptions,
    /// Capture a step into a CUDA graph and replay it ([`super::graph`]; off with
    /// `--no-cuda-graph` or `HZP_CUDA_GRAPH=0`).
    pub graphs: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            comm: CommMode::Async,
            timeout: Duration::from_secs(300),
            lower: super::lower::LowerOptions::from_env(),
            graphs: super::graph::from_env(),
        }
    }
}

fn run_err(s: impl Into<String>) -> ExecError {
    ExecError::Run(s.into())
}

/// A timing event's milliseconds as a duration (an error, not a panic, for a reading that
/// is negative or not a number).
fn ms_duration(ms: f32) -> Result<Duration, ExecError> {
    Duration::try_from_secs_f64(ms as f64 / 1e3).map_err(|_| {
        run_err(format!(
            "CUDA: a timing event read {ms} ms, which is not a duration"
        ))
    })
}

fn drv_err(what: &str, e: drv::DriverError) -> ExecError {
    let name = e
        .error_name()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    run_err(format!("CUDA: {what}: {name}"))
}

/// Raw driver handles shared with the issuing threads.
#[derive(Clone, Copy)]
struct Handles {
    streams: [sys::CUstream; 3],
    base: sys::CUdeviceptr,
}
// SAFETY: CUDA streams and device pointers may be used from any thread of the context.
unsafe impl Send for Handles {}
unsafe impl Sync for Handles {}

struct Events(Vec<sys::CUevent>);
// SAFETY: events may be recorded and waited on from any thread of the context.
unsafe impl Send for Events {}
unsafe impl Sync for Events {}

struct Comms(Vec<Option<nccl_sys::ncclComm_t>>);

/// How a rank's collectives move data: NCCL (one process per GPU), or the local device
/// communicator (every rank in this process on one GPU, `--ranks-on-one-gpu`).
enum Transport {
    Nccl(Comms),
    Local {
        group: Arc<LocalGroup>,
        /// Per communicator key of the lowering: the instance (None: a group of one).
        comms: Vec<Option<Arc<LocalComm>>>,
    },
}
// SAFETY: each communicator is used by the one thread of its stream (and at set-up/teardown
// by the main thread while no other runs).
unsafe impl Send for Comms {}
unsafe impl Sync for Comms {}

struct Blas(sys_handle::Handle);
mod sys_handle {
    pub struct Handle(pub cudarc::cublas::sys::cublasHandle_t);
    // SAFETY: the handle is used only by the compute-stream thread (or the sync thread).
    unsafe impl Send for Handle {}
    unsafe impl Sync for Handle {}
}

/// Host-side "the record of event e for step s was issued".
struct Issued {
    stamp: Mutex<Vec<u64>>,
    cv: Condvar,
}

/// One rank of a plan on this process's GPU.
pub struct CudaExecutor {
    plan: Plan,
    low: LoweredPlan,
    dist: DistEnv,
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    functions: HashMap<String, sys::CUfunction>,
    h: Handles,
    /// Plan events (dense index).
    events: Events,
    /// Per node: (start, end) timing events; per compute-stream wait on a comm stream, the
    /// (before, after) pair in `wait_timing`.
    node_timing: Events,
    wait_timing: Vec<Option<(usize, usize)>>,
    transport: Transport,
    blas: Blas,
    opts: CudaOptions,
    steps_run: usize,
    /// The collectives this rank issued (enqueued), for the report of a failed step.
    recorder: FlightRecorder,
    born: Instant,
    /// A step failed: NCCL communicators are aborted, not destroyed, on the way out.
    failed: bool,
    /// Calls issued per communicator key (the flight recorder's `comm_seq`).
    calls: Vec<AtomicU64>,
    /// `HZP_CUDA_PROFILE=1`: GPU time per node summed over the steps after the first,
    /// printed to stderr when the executor is dropped.
    profile: Option<OpProfile>,
    /// Token ids and labels are range-checked in every batch (see `set_inputs`).
    index_check: crate::index_check::IndexChecker,
    /// This rank, as a list (what [`PlanExecutor::local_ranks`] gives).
    local: [usize; 1],
    /// The flight report of the last step that failed.
    report: Option<FlightReport>,
    /// The attention nodes that run on cuDNN (see `super::cudnn::prepare`).
    attention: Option<super::cudnn::AttentionRunner>,
    /// The step's CUDA graph ([`super::graph`]).
    graph: GraphRun,
    /// cuBLASLt's handle and workspace, for the products with epilogues (`HZP_CUDA_LT=1`).
    lt: lt_exec::LtRun,
}

// SAFETY: all raw handles are owned by the executor and used under the rules above.
unsafe impl Send for CudaExecutor {}
// SAFETY: the issuing threads share the executor read-only: module and function handles are
// immutable once loaded and usable from any thread of the context; each stream, its
// communicators and the cuBLAS handle (compute stream) are used by one thread at a time.
unsafe impl Sync for CudaExecutor {}

/// Initialises the driver and opens this process's GPU (`LOCAL_RANK` modulo the device
/// count).
fn open_device(dist: &DistEnv) -> Result<Arc<CudaContext>, ExecError> {
    drv::init().map_err(|e| drv_err("cuInit (the driver loaded, but found no usable GPU)", e))?;
    let count = drv::device::get_count().map_err(|e| drv_err("cuDeviceGetCount", e))?;
    if count <= 0 {
        return Err(run_err(
            "hzp run --backend cuda: the CUDA driver loaded but reports no CUDA device",
        ));
    }
    if dist.local_world_size > count as usize {
        return Err(run_err(format!(
            "LOCAL_WORLD_SIZE is {} but this machine has {count} CUDA device(s)",
            dist.local_world_size
        )));
    }
    let ordinal = dist.local_rank % count as usize;
    CudaContext::new(ordinal).map_err(|e| drv_err("creating the context", e))
}

/// Loads the kernels: `image` when given (compiled once for every rank of this process),
/// else compiled here for the device's compute capability.
fn load_module(
    ctx: &CudaContext,
    image: Option<&[u8]>,
    extra: &str,
) -> Result<sys::CUmodule, ExecError> {
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| drv_err("reading the compute capability", e))?;
    let compiled;
    let image: &[u8] = match image {
        Some(image) => image,
        None => {
            compiled = compile_kernels(major, minor, extra)?;
            &compiled
        }
    };
    // SAFETY: the image is a complete cubin from NVRTC; the context is current.
    unsafe { drv::module::load_data(image.as_ptr() as *const c_void) }
        .map_err(|e| drv_err("loading the compiled kernels", e))
}

/// The kernel functions: with every rank in this process, the local communicator's
/// kernels first; then every kernel the lowering launches.
fn kernel_functions(
    module: sys::CUmodule,
    low: &LoweredPlan,
    local: bool,
) -> Result<HashMap<String, sys::CUfunction>, ExecError> {
    let mut functions = HashMap::new();
    if local {
        for k in super::local_kernel_names() {
            let name = CString::new(k.clone()).expect("kernel names are ASCII");
            // SAFETY: module is loaded.
            let f = unsafe { drv::module::get_function(module, name) }
                .map_err(|e| drv_err(&format!("kernel `{k}`"), e))?;
            functions.insert(k, f);
        }
    }
    for nw in &low.nodes {
        for w in &nw.work {
            if let Work::Kernel(l) = w {
                if !functions.contains_key(&l.kernel) {
                    let name = CString::new(l.kernel.clone()).expect("kernel names are ASCII");
                    // SAFETY: module is loaded.
                    let f = unsafe { drv::module::get_function(module, name) }.map_err(|e| {
                        drv_err(&format!("kernel `{}` (node `{}`)", l.kernel, nw.name), e)
                    })?;
                    functions.insert(l.kernel.clone(), f);
                }
            }
        }
    }
    Ok(functions)
}

/// The arena (one allocation for the whole run, cleared) and the three streams.
fn allocate(low: &LoweredPlan) -> Result<Handles, ExecError> {
    // SAFETY: plain allocation on the current context.
    let base = unsafe { drv::malloc_sync(low.alloc_bytes as usize) }
        .map_err(|e| drv_err(&format!("allocating the {}-byte arena", low.alloc_bytes), e))?;
    // SAFETY: base..base+alloc_bytes was just allocated.
    unsafe { drv::memset_d8_sync(base, 0, low.alloc_bytes as usize) }
        .map_err(|e| drv_err("clearing the arena", e))?;
    upload_consts(low, base)?;
    let mut streams = [std::ptr::null_mut(); 3];
    for s in streams.iter_mut() {
        *s = drv::stream::create(drv::stream::StreamKind::NonBlocking)
            .map_err(|e| drv_err("creating a stream", e))?;
    }
    Ok(Handles { streams, base })
}

/// The lowering's constant tables (the multi-tensor AdamW tables), after the error word.
fn upload_consts(low: &LoweredPlan, base: sys::CUdeviceptr) -> Result<(), ExecError> {
    for (off, bytes) in &low.consts {
        if off + bytes.len() as u64 > low.alloc_bytes {
            return Err(run_err(format!(
                "internal: a {}-byte table at {off} is outside the {}-byte allocation",
                bytes.len(),
                low.alloc_bytes
            )));
        }
        // SAFETY: inside the allocation (checked above); no stream runs yet.
        unsafe { drv::memcpy_htod_sync(base + off, bytes) }
            .map_err(|e| drv_err("copying the AdamW tables to the GPU", e))?;
    }
    Ok(())
}

/// The plan's events, the nodes' timing events, and where each compute-stream wait on a
/// comm stream has its (before, after) pair among them.
type EventSet = (Events, Vec<sys::CUevent>, Vec<Option<(usize, usize)>>);

/// Creates the plan's events (no timing), then per node a (start, end) timing pair, and
/// for a compute-stream node that starts by waiting on a comm stream's event a
/// (before, after) pair.
fn create_events(low: &LoweredPlan) -> Result<EventSet, ExecError> {
    let mk = |flags| drv::event::create(flags).map_err(|e| drv_err("creating an event", e));
    let events = Events(
        (0..low.n_events)
            .map(|_| mk(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .collect::<Result<_, _>>()?,
    );
    let mut timing = Vec::new();
    let mut wait_timing = vec![None; low.nodes.len()];
    for (i, nw) in low.nodes.iter().enumerate() {
        timing.push(mk(sys::CUevent_flags::CU_EVENT_DEFAULT)?);
        timing.push(mk(sys::CUevent_flags::CU_EVENT_DEFAULT)?);
        if nw.stream == 0 {
            if let Some(Work::Wait(e)) = nw.work.first() {
                if low.event_stream[*e] != 0 {
                    timing.push(mk(sys::CUevent_flags::CU_EVENT_DEFAULT)?);
                    timing.push(mk(sys::CUevent_flags::CU_EVENT_DEFAULT)?);
                    wait_timing[i] = Some((timing.len() - 2, timing.len() - 1));
                }
            }
        }
    }
    Ok((events, timing, wait_timing))
}

/// The local device communicator of each communicator key of the lowering (none for a
/// group of one).
fn local_transport(group: &Arc<LocalGroup>, low: &LoweredPlan) -> Result<Transport, ExecError> {
    Ok(Transport::Local {
        group: group.clone(),
        comms: low
            .comms
            .iter()
            .map(|k| {
                if k.members.len() <= 1 {
                    Ok(None)
                } else {
                    group.comm(k.stream, &k.axes, &k.members).map(Some)
                }
            })
            .collect::<Result<_, String>>()
            .map_err(run_err)?,
    })
}

impl CudaExecutor {
    /// Probes the libraries, opens this process's GPU (`dist.local_rank` modulo the device
    /// count), compiles the kernels, allocates the arena, places this rank's parameter shards,
    /// states and constants, and creates the NCCL communicators, their ids handed out over
    /// `rv` (the process group of `dist`, which every process of the plan joined; a group of
    /// one for a single process). `rv` is only used here: what the processes do together
    /// later (gathering parameters, checkpoints) is the caller's.
    pub fn new(
        plan: &Plan,
        full_params: &[(String, Tensor)],
        opts: CudaOptions,
        dist: &DistEnv,
        rv: &mut Rendezvous,
    ) -> Result<CudaExecutor, ExecError> {
        let world = plan.mesh.world_size();
        if dist.world_size != world || rv.world_size() != world || rv.rank() != dist.rank {
            return Err(ExecError::Plan(format!(
                "the plan's mesh {} has {world} ranks, but {} process(es) run it (start {world}: hzp launch --nproc-per-node {world} -- run ...; or all ranks on one GPU: hzp run --backend cuda --ranks-on-one-gpu)",
                plan.mesh, dist.world_size
            )));
        }
        let mut need = vec![Lib::Driver, Lib::Nvrtc, Lib::Cublas, Lib::CublasLt];
        if world > 1 || nccl_groups_of_one() {
            need.push(Lib::Nccl);
        }
        let pr = probe::probe();
        pr.require(&need, "hzp run --backend cuda")
            .map_err(run_err)?;
        pr.preload(&need).map_err(run_err)?;
        let mut opts = opts;
        super::cudnn::choose(plan, &mut opts.lower);
        // Refuse what the backend cannot run before touching the device.
        let low = super::lower::lower_program_with(plan, dist.rank, opts.lower)
            .map_err(ExecError::Plan)?;
        let shards = cut_parameters(&plan.program, &plan.mesh, &plan.layouts, full_params)?;
        let rank = dist.rank;
        Self::open(plan, low, &shards[rank], opts, dist.clone(), Some(rv), None)
    }

    /// Rank `rank` of `plan` in a process that runs every rank on its one GPU: its own arena
    /// and streams, the same lowering, events and memory plan as under NCCL, collectives
    /// through `group` (see [`super::local`]). `image` is the compiled kernels (compiled
    /// once for all ranks); `shards` this rank's parameter shards.
    pub fn new_local(
        plan: &Plan,
        shards: &[(ValueId, Tensor)],
        opts: CudaOptions,
        rank: usize,
        group: &Arc<LocalGroup>,
        image: &[u8],
    ) -> Result<CudaExecutor, ExecError> {
        let world = plan.mesh.world_size();
        let low =
            super::lower::lower_program_with(plan, rank, opts.lower).map_err(ExecError::Plan)?;
        let dist = DistEnv {
            rank,
            world_size: world,
            local_rank: 0,
            local_world_size: 1,
            master_addr: String::new(),
            master_port: 0,
        };
        Self::open(
            plan,
            low,
            shards,
            opts,
            dist,
            None,
            Some((group.clone(), image)),
        )
    }

    fn open(
        plan: &Plan,
        mut low: LoweredPlan,
        shards: &[(ValueId, Tensor)],
        opts: CudaOptions,
        dist: DistEnv,
        rv: Option<&mut Rendezvous>,
        local: Option<(Arc<LocalGroup>, &[u8])>,
    ) -> Result<CudaExecutor, ExecError> {
        let ctx = open_device(&dist)?;
        let module = load_module(
            &ctx,
            local.as_ref().map(|(_, image)| *image),
            &low.fused_source,
        )?;
        let h = allocate(&low)?;
        for line in &low.notes {
            super::cudnn::note_once(line);
        }
        // SAFETY: cuDNN nodes exist only when the library was probed loadable (`choose`); the
        // context is current, streams[0] its compute stream, base the arena.
        let attention = unsafe { super::cudnn::prepare(&mut low, h.streams[0] as _, h.base) }
            .map_err(ExecError::Plan)?;
        // (after cuDNN: a node it cannot run launches hzp's kernels instead)
        let functions = kernel_functions(module, &low, local.is_some())?;
        let lt = lt_exec::LtRun::new(&low)?;
        let (events, timing, wait_timing) = create_events(&low)?;
        let blas_h = blas::create_handle()
            .map_err(|e| run_err(format!("cuBLAS: creating a handle: {e:?}")))?;
        // SAFETY: both handles are live.
        unsafe { blas::set_stream(blas_h, h.streams[0] as _) }
            .map_err(|e| run_err(format!("cuBLAS: setting the stream: {e:?}")))?;

        let transport = match &local {
            Some((group, _)) => local_transport(group, &low)?,
            None => Transport::Nccl(Comms(Vec::new())),
        };
        let mut ex = CudaExecutor {
            index_check: crate::index_check::IndexChecker::new(&plan.program),
            plan: plan.clone(),
            low,
            local: [dist.rank],
            dist,
            ctx,
            module,
            functions,
            h,
            events,
            node_timing: Events(timing),
            wait_timing,
            transport,
            blas: Blas(sys_handle::Handle(blas_h)),
            opts,
            steps_run: 0,
            recorder: FlightRecorder::new(1, 3, crate::watchdog::DEFAULT_CAPACITY),
            born: Instant::now(),
            failed: false,
            calls: Vec::new(),
            profile: std::env::var("HZP_CUDA_PROFILE")
                .is_ok_and(|v| v == "1")
                .then(OpProfile::default),
            report: None,
            attention,
            graph: GraphRun::off(),
            lt,
        };
        ex.calls = (0..ex.low.comms.len()).map(|_| AtomicU64::new(0)).collect();
        if let Some(rv) = rv {
            ex.check_same_plan(rv)?;
            ex.create_comms(rv)?;
        }
        ex.set_up_graphs()?;
        ex.place(shards)?;
        Ok(ex)
    }

    /// This rank's parameter shards, then the constants, into the arena.
    fn place(&mut self, shards: &[(ValueId, Tensor)]) -> Result<(), ExecError> {
        for (v, t) in shards {
            self.write(*v, t)?;
        }
        let consts: Vec<(ValueId, Tensor)> = self
            .plan
            .program
            .consts
            .iter()
            .map(|c| (c.value, c.data.clone()))
            .collect();
        for (v, t) in &consts {
            self.write(*v, t)?;
        }
        Ok(())
    }

    /// Every rank must run the same plan: all-gather the content hashes.
    fn check_same_plan(&mut self, rv: &mut Rendezvous) -> Result<(), ExecError> {
        let hash = self.plan.content_hash.clone();
        let all = rv
            .all_gather(hash.as_bytes())
            .map_err(|e| run_err(e.to_string()))?;
        if let Some((r, h)) = all
            .iter()
            .enumerate()
            .find(|(_, h)| h.as_slice() != self.plan.content_hash.as_bytes())
        {
            return Err(run_err(format!(
                "rank {r} runs a different plan (content hash {}) than rank {} ({})",
                String::from_utf8_lossy(h),
                self.dist.rank,
                self.plan.content_hash
            )));
        }
        Ok(())
    }

    /// NCCL communicators: rank 0 makes one unique id per (communicator key, instance) and
    /// broadcasts them; each rank joins its instances in the one order every rank uses.
    fn create_comms(&mut self, rv: &mut Rendezvous) -> Result<(), ExecError> {
        let mesh = self.plan.mesh.clone();
        let world = mesh.world_size();
        // instances of each key: the distinct member lists over all ranks, by first member
        let mut table: Vec<Vec<Vec<usize>>> = Vec::new();
        for k in &self.low.comms {
            let g = hzp_ir::Group {
                axes: k.axes.clone(),
            };
            let mut inst: Vec<Vec<usize>> = Vec::new();
            for r in 0..world {
                let m = mesh.group_members(&g, r).unwrap_or_default();
                if !inst.contains(&m) {
                    inst.push(m);
                }
            }
            inst.sort();
            table.push(inst);
        }
        let n_ids: usize = table
            .iter()
            .zip(&self.low.comms)
            .filter(|(_, k)| k.members.len() > 1 || nccl_groups_of_one())
            .map(|(t, _)| t.len())
            .sum();
        const ID: usize = 128;
        let ids = if n_ids == 0 {
            Vec::new()
        } else if self.dist.rank == 0 {
            let mut b = Vec::with_capacity(n_ids * ID);
            for _ in 0..n_ids {
                let id = nccl::get_uniqueid()
                    .map_err(|e| run_err(format!("NCCL: ncclGetUniqueId: {e:?}")))?;
                b.extend(id.internal.iter().map(|&c| c as u8));
            }
            rv.broadcast(Some(&b)).map_err(|e| run_err(e.to_string()))?
        } else {
            rv.broadcast(None).map_err(|e| run_err(e.to_string()))?
        };
        if ids.len() != n_ids * ID {
            return Err(run_err(format!(
                "rank 0 sent {} bytes of NCCL ids, expected {}",
                ids.len(),
                n_ids * ID
            )));
        }
        let mut at = 0;
        let mut comms = Vec::new();
        for (k, inst) in self.low.comms.iter().zip(&table) {
            if k.members.len() <= 1 && !nccl_groups_of_one() {
                comms.push(None);
                continue;
            }
            let which = inst.iter().position(|m| *m == k.members).unwrap_or(0);
            let slot = at + which;
            at += inst.len();
            let mut id = nccl_sys::ncclUniqueId { internal: [0; 128] };
            for (d, s) in id.internal.iter_mut().zip(&ids[slot * ID..(slot + 1) * ID]) {
                *d = *s as _;
            }
            let what = format!(
                "rank {}: joining the NCCL communicator of group [{}] (ranks {:?}) on stream {}",
                self.dist.rank,
                k.axes.join(","),
                k.members,
                k.stream
            );
            let mut comm = std::ptr::null_mut();
            let mut cfg = NcclConfig::non_blocking();
            // SAFETY: a fresh communicator handle; every member calls this with the same id;
            // the config is the 2.17 prefix of ncclConfig_t, its size and version say so.
            let r = unsafe {
                nccl_sys::ncclCommInitRankConfig(
                    &mut comm,
                    k.members.len() as i32,
                    id,
                    k.member as i32,
                    &mut cfg as *mut NcclConfig as *mut nccl_sys::ncclConfig_t,
                )
            };
            if !matches!(
                r,
                nccl_sys::ncclResult_t::ncclSuccess | nccl_sys::ncclResult_t::ncclInProgress
            ) {
                // the communicators joined so far go with the error
                self.transport = Transport::Nccl(Comms(comms));
                self.failed = true;
                return Err(run_err(format!("{what}: {}", nccl_result(r, comm))));
            }
            comms.push(Some(comm));
            // non-blocking: the set-up goes on in NCCL's threads; wait for it, within the
            // timeout (a peer that never joins is noticed, not waited on forever)
            if let Err(e) = wait_comm_ready(comm, Instant::now() + self.opts.timeout) {
                self.transport = Transport::Nccl(Comms(comms));
                self.failed = true;
                return Err(run_err(format!("{what}: {e}")));
            }
        }
        self.transport = Transport::Nccl(Comms(comms));
        Ok(())
    }

    fn write(&self, v: ValueId, t: &Tensor) -> Result<(), ExecError> {
        let (off, bytes) = self.low.loc[v.index()];
        let mut host = vec![0u8; bytes as usize];
        write_tensor(t, &mut host).map_err(run_err)?;
        if bytes > 0 {
            // SAFETY: the value's buffer lies inside the arena; synchronous copy.
            unsafe { drv::memcpy_htod_sync(self.h.base + off, &host) }
                .map_err(|e| drv_err("copying to the GPU", e))?;
        }
        Ok(())
    }

    fn read(&self, v: ValueId) -> Result<Tensor, ExecError> {
        let (off, bytes) = self.low.loc[v.index()];
        let mut host = vec![0u8; bytes as usize];
        if bytes > 0 {
            // SAFETY: inside the arena; no stream runs between steps.
            unsafe { drv::memcpy_dtoh_sync(&mut host, self.h.base + off) }
                .map_err(|e| drv_err("copying from the GPU", e))?;
        }
        Ok(tensor_from_bytes(self.plan.program.ty(v), &host))
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.dist.rank
    }

    /// Sets the global batch; this rank takes rows `[r*b, (r+1)*b)` of every input. Token
    /// ids and class labels out of range are an error (nothing is set then).
    pub fn set_inputs(&mut self, global: &[(String, Tensor)]) -> Result<(), ExecError> {
        self.index_check.check(global).map_err(ExecError::Inputs)?;
        let w = self.plan.mesh.world_size();
        let r = self.dist.rank;
        for &v in &self.plan.program.inputs.clone() {
            let val = self.plan.program.value(v).clone();
            let (_, t) = global.iter().find(|(k, _)| *k == val.name).ok_or_else(|| {
                ExecError::Inputs(format!("no array `{}` in the inputs", val.name))
            })?;
            let mut want = val.ty.clone();
            if let Some(d) = want.shape.first_mut() {
                *d *= w;
            }
            if t.ty() != want {
                return Err(ExecError::Inputs(format!(
                    "input `{}` is {}, but the plan needs {want} (the global batch for {w} ranks of {})",
                    val.name,
                    t.ty(),
                    val.ty
                )));
            }
            let (off, bytes) = self.low.loc[v.index()];
            let src = data_bytes(&t.data);
            // a scalar (the learning rate) is every rank's; other inputs are cut on axis 0
            let at = if val.ty.rank() == 0 {
                0
            } else {
                r * bytes as usize
            };
            let part = &src[at..at + bytes as usize];
            if bytes > 0 {
                // SAFETY: the input's buffer; between steps.
                unsafe { drv::memcpy_htod_sync(self.h.base + off, part) }
                    .map_err(|e| drv_err("copying inputs to the GPU", e))?;
            }
        }
        Ok(())
    }

    /// Runs one step; every rank must call it. Issued as it is, captured into a CUDA graph
    /// or as the graph captured before ([`super::graph`], `graph_exec.rs`).
    pub fn step(&mut self) -> Result<StepStats, ExecError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| drv_err("binding the context", e))?;
        let step = self.steps_run + 1;
        let t0 = Instant::now();
        let r = match self.issue_graph_step(step) {
            Ok(()) => self.finish_step(step, t0),
            Err(e) => {
                self.fail();
                Err(e)
            }
        };
        self.graph_step_done(r.is_ok());
        r
    }

    /// Issues the step's work to the streams (`capture`: into the capture the streams are in,
    /// timing events recorded as graph nodes).
    fn issue_step(&self, step: usize, capture: bool) -> Result<(), ExecError> {
        let issued = Issued {
            stamp: Mutex::new(vec![0; self.low.n_events]),
            cv: Condvar::new(),
        };
        let abort = AtomicBool::new(false);
        let sync = self.opts.comm == CommMode::Sync;
        let threads: Vec<usize> = if sync { vec![0] } else { vec![0, 1, 2] };
        let this = self;
        let results: Vec<Result<(), ExecError>> = std::thread::scope(|s| {
            let hs: Vec<_> = threads
                .iter()
                .map(|&st| {
                    let (issued, abort) = (&issued, &abort);
                    s.spawn(move || {
                        let r = this.issue_stream(st, sync, capture, step as u64, issued, abort);
                        if r.is_err() {
                            abort.store(true, Ordering::SeqCst);
                            issued.cv.notify_all();
                        }
                        r
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(run_err("an issuing thread panicked")))
                })
                .collect()
        });
        results.into_iter().collect()
    }

    /// The step after its work was issued: waits for the streams, checks the error word,
    /// applies the updates, reads the loss and the timing events.
    fn finish_step(&mut self, step: usize, t0: Instant) -> Result<StepStats, ExecError> {
        let sync = self.opts.comm == CommMode::Sync;
        if let Err(e) = self.finish_streams(step, t0) {
            self.fail();
            return Err(e);
        }
        self.recorder.settle(0, self.now_us());
        self.check_error_word(step)?;
        // updates, in order, on the compute stream
        for &(v, t, bytes) in &self.low.updates {
            if bytes > 0 && v != t {
                // SAFETY: both ranges inside the arena; the streams are idle.
                unsafe { drv::memcpy_dtod_sync(self.h.base + t, self.h.base + v, bytes as usize) }
                    .map_err(|e| drv_err("applying the updates", e))?;
            }
        }
        let wall = t0.elapsed();
        let loss = match self.plan.program.outputs.first() {
            Some(&o) => {
                let t = self.read(o)?;
                let b = data_bytes(&t.data).to_vec();
                scalar_f64(t.dtype(), &b)
            }
            None => None,
        };
        let mut busy = [Duration::ZERO; 3];
        let mut exposed = Duration::ZERO;
        for (i, nw) in self.low.nodes.iter().enumerate() {
            let ms = self.elapsed(2 * i, 2 * i + 1)?;
            if let (Some(p), true) = (self.profile.as_mut(), step > 1) {
                p.add(i, ms as f64, self.low.nodes.len());
            }
            let d = ms_duration(ms)?;
            let is_coll = nw.work.iter().any(|w| matches!(w, Work::Collective(_)));
            busy[nw.stream] += d;
            if sync && is_coll {
                exposed += d;
            }
            if let (false, Some((a, b))) = (sync, self.wait_timing[i]) {
                exposed += ms_duration(self.elapsed(a, b)?)?;
            }
        }
        self.steps_run = step;
        if let (Some(p), true) = (self.profile.as_mut(), step > 1) {
            p.steps += 1;
        }
        Ok(StepStats {
            step,
            loss,
            wall,
            busy,
            exposed_comm: exposed,
        })
    }

    fn now_us(&self) -> u64 {
        self.born.elapsed().as_micros() as u64 + 1
    }

    /// Marks the run failed: NCCL communicators are aborted (a peer blocked in a collective
    /// with this rank is released with an error instead of waiting forever), the local
    /// group's other ranks stop waiting.
    fn fail(&mut self) {
        self.failed = true;
        match &mut self.transport {
            Transport::Nccl(comms) => {
                for c in comms.0.iter_mut() {
                    if let Some(h) = c.take() {
                        // SAFETY: a communicator this rank created; abort frees it.
                        let _ = unsafe { nccl::comm_abort(h) };
                    }
                }
            }
            Transport::Local { group, .. } => group.abort.store(true, Ordering::SeqCst),
        }
    }

    /// Waits for the step's work on every stream, polling: NCCL's asynchronous errors (a
    /// peer that died), the local group's abort flag, and the collective timeout.
    fn finish_streams(&self, step: usize, t0: Instant) -> Result<(), ExecError> {
        let deadline = t0 + self.opts.timeout;
        let mut spins = 0u32;
        loop {
            let mut pending = Vec::new();
            for (k, &st) in self.h.streams.iter().enumerate() {
                // SAFETY: a live stream of the current context.
                match unsafe { sys::cuStreamQuery(st) } {
                    sys::CUresult::CUDA_SUCCESS => {}
                    sys::CUresult::CUDA_ERROR_NOT_READY => pending.push(k),
                    e => {
                        return Err(drv_err(
                            &format!("rank {}: step {step}, stream {k}", self.dist.rank),
                            drv::DriverError(e),
                        ))
                    }
                }
            }
            if pending.is_empty() {
                return Ok(());
            }
            if let Transport::Nccl(comms) = &self.transport {
                for (i, c) in comms.0.iter().enumerate() {
                    let Some(c) = *c else { continue };
                    let mut st = nccl_sys::ncclResult_t::ncclSuccess;
                    // SAFETY: a live communicator.
                    unsafe { nccl_sys::ncclCommGetAsyncError(c, &mut st) };
                    if !matches!(
                        st,
                        nccl_sys::ncclResult_t::ncclSuccess
                            | nccl_sys::ncclResult_t::ncclInProgress
                    ) {
                        return Err(run_err(format!(
                            "rank {}: step {step}: the NCCL communicator of {} failed: {}; its last collective: {}",
                            self.dist.rank,
                            self.comm_name(i),
                            nccl_result(st, c),
                            self.last_collective(i)
                        )));
                    }
                }
            }
            if let Transport::Local { group, .. } = &self.transport {
                if group.abort.load(Ordering::Relaxed) {
                    return Err(run_err(crate::comm::ABORTED));
                }
            }
            if Instant::now() >= deadline {
                let waits: Vec<String> = self
                    .recorder
                    .entries(0)
                    .into_iter()
                    .filter(|(_, e)| e.step == step as u64 && e.state != CollState::Completed)
                    .map(|(_, e)| {
                        format!(
                            "`{}` ({}, call {} of its communicator)",
                            self.low.nodes[e.node as usize].name,
                            self.comm_name(e.comm as usize),
                            e.comm_seq
                        )
                    })
                    .collect();
                return Err(ExecError::Timeout(format!(
                    "collective timeout ({:.1} s): rank {}'s step {step} has not finished on stream(s) {pending:?}; its collectives of the step that may not have finished: {}",
                    self.opts.timeout.as_secs_f64(),
                    self.dist.rank,
                    if waits.is_empty() { "none".to_string() } else { waits.join(", ") }
                )));
            }
            spins += 1;
            std::thread::sleep(if spins < 100 {
                Duration::from_micros(50)
            } else {
                Duration::from_millis(1)
            });
        }
    }

    /// `group [gpu] (ranks [0, 1], stream 1)` of communicator key `k`.
    fn comm_name(&self, k: usize) -> String {
        match self.low.comms.get(k) {
            Some(c) => format!(
                "group [{}] (ranks {:?}, stream {})",
                c.axes.join(","),
                c.members,
                c.stream
            ),
            None => format!("communicator {k}"),
        }
    }

    /// The last collective this rank issued on communicator key `k`.
    fn last_collective(&self, k: usize) -> String {
        self.recorder
            .entries(0)
            .into_iter()
            .rev()
            .find(|(_, e)| e.comm as usize == k)
            .map(|(_, e)| {
                format!(
                    "`{}` (step {}, call {}, {} bytes)",
                    self.low.nodes[e.node as usize].name, e.step, e.comm_seq, e.bytes
                )
            })
            .unwrap_or_else(|| "none".into())
    }

    /// This rank's flight record (its last collectives as enqueued; `completed` once the
    /// step they belong to finished on the device).
    pub fn flight_report(&self, reason: &str) -> FlightReport {
        let collectives = self
            .recorder
            .entries(0)
            .into_iter()
            .map(|(s, e)| {
                let nw = &self.low.nodes[e.node as usize];
                let key = self.low.comms.get(e.comm as usize);
                let ms = |us: u64| (us > 0).then(|| us as f64 / 1000.0);
                CollRecord {
                    seq: e.seq,
                    step: e.step,
                    stream: ["compute", "allgather", "reducescatter"][s.min(2)].to_string(),
                    node: nw.name.clone(),
                    op: nw.op.to_string(),
                    group: key
                        .map(|k| format!("[{}]", k.axes.join(",")))
                        .unwrap_or_default(),
                    members: key.map(|k| k.members.clone()).unwrap_or_default(),
                    comm_seq: e.comm_seq,
                    bytes: e.bytes,
                    state: e.state,
                    issued_ms: e.issued_us as f64 / 1000.0,
                    started_ms: ms(e.started_us),
                    ended_ms: ms(e.ended_us),
                }
            })
            .collect();
        FlightReport {
            reason: reason.to_string(),
            ranks: vec![RankRecord {
                rank: self.dist.rank,
                world: self.dist.world_size,
                reason: reason.to_string(),
                error: None,
                collectives,
            }],
        }
    }

    fn elapsed(&self, a: usize, b: usize) -> Result<f32, ExecError> {
        // SAFETY: both events were recorded this step and the streams are synchronized.
        unsafe { drv::event::elapsed(self.node_timing.0[a], self.node_timing.0[b]) }
            .map_err(|e| drv_err("reading the timing events", e))
    }

    fn check_error_word(&self, step: usize) -> Result<(), ExecError> {
        let mut word = [0i32; 1];
        // SAFETY: the 4-byte error word after the arena.
        unsafe { drv::memcpy_dtoh_sync(&mut word, self.h.base + self.low.err_offset) }
            .map_err(|e| drv_err("reading the error word", e))?;
        if word[0] == 0 {
            return Ok(());
        }
        let ni = (word[0] - 1) as usize;
        let n = &self.plan.program.nodes[ni.min(self.plan.program.nodes.len() - 1)];
        let message = match n.op.name() {
            "Div" | "Mod" => "integer division by zero",
            "Pow" => "0 raised to a negative integer power",
            "SoftmaxCrossEntropy" | "SoftmaxCrossEntropyGrad" => {
                "a label is outside the class range 0..classes"
            }
            "MoeDispatch" | "MoeCombine" | "MoeCombineGrad" => {
                "an expert index is outside 0..experts, or a slot outside the capacity (or -1)"
            }
            _ => "an index is out of range",
        };
        Err(ExecError::Node {
            step,
            rank: self.dist.rank,
            node: n.name.clone(),
            op: n.op.name(),
            message: message.into(),
        })
    }

    /// Issues stream `st`'s nodes (all nodes in sync mode) in program order.
    fn issue_stream(
        &self,
        st: usize,
        sync: bool,
        capture: bool,
        step: u64,
        issued: &Issued,
        abort: &AtomicBool,
    ) -> Result<(), ExecError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| drv_err("binding the context", e))?;
        let stream = self.h.streams[st];
        let t = &self.node_timing.0;
        for (i, nw) in self.low.nodes.iter().enumerate() {
            if !sync && nw.stream != st {
                continue;
            }
            if abort.load(Ordering::SeqCst) {
                return Err(run_err("stopped: another stream failed"));
            }
            let node_err = |m: String| ExecError::Node {
                step: step as usize,
                rank: self.dist.rank,
                node: nw.name.clone(),
                op: nw.op,
                message: m,
            };
            // SAFETY (all driver calls below): live handles of the current context; every
            // pointer is base + an offset inside the arena, as lowered from the plan.
            unsafe {
                if let (false, Some((a, _))) = (sync, self.wait_timing[i]) {
                    record_timing(t[a], stream, capture)?;
                }
                record_timing(t[2 * i], stream, capture)?;
                for w in &nw.work {
                    match w {
                        Work::Record(e) => {
                            if !sync {
                                drv::event::record(self.events.0[*e], stream)
                                    .map_err(|e| drv_err("recording an event", e))?;
                                let mut g = issued.stamp.lock().map_err(|_| run_err("poisoned"))?;
                                g[*e] = step;
                                issued.cv.notify_all();
                            }
                        }
                        Work::Wait(e) => {
                            if !sync {
                                self.wait_issued(*e, step, issued, abort)?;
                                drv::stream::wait_event(
                                    stream,
                                    self.events.0[*e],
                                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                                )
                                .map_err(|e| drv_err("waiting on an event", e))?;
                            }
                        }
                        Work::Copy { src, dst, bytes } => {
                            drv::memcpy_dtod_async(
                                self.h.base + dst,
                                self.h.base + src,
                                *bytes as usize,
                                stream,
                            )
                            .map_err(|e| drv_err("copying", e))?;
                        }
                        Work::Kernel(l) => self.launch(l, stream).map_err(node_err)?,
                        Work::Gemm(g) => self.gemm(g).map_err(node_err)?,
                        Work::Sdpa(_) => {
                            if stream != self.h.streams[0] {
                                return Err(node_err(
                                    "internal: cuDNN attention issued off the compute stream"
                                        .into(),
                                ));
                            }
                            self.attention
                                .as_ref()
                                .ok_or_else(|| "internal: no cuDNN for this node".to_string())
                                .and_then(|a| a.run(i))
                                .map_err(node_err)?
                        }
                        Work::LtGemm(g) => self.lt.run(g, self.h.base, stream).map_err(node_err)?,
                        Work::Collective(c) => {
                            let calls = self
                                .calls
                                .get(c.comm)
                                .map_or(0, |k| k.fetch_add(1, Ordering::Relaxed));
                            self.recorder.issue(
                                0,
                                nw.stream,
                                step,
                                i,
                                c.comm,
                                calls,
                                coll_bytes(c),
                                self.now_us(),
                            );
                            let r = self.collective(c, stream, abort);
                            let state = if r.is_ok() {
                                CollState::Started
                            } else {
                                CollState::Failed
                            };
                            self.recorder.mark(0, nw.stream, state, self.now_us());
                            r.map_err(|m| {
                                if m == crate::comm::ABORTED {
                                    run_err(m)
                                } else {
                                    node_err(m)
                                }
                            })?
                        }
                    }
                }
                record_timing(t[2 * i + 1], stream, capture)?;
                if let (false, Some((_, b))) = (sync, self.wait_timing[i]) {
                    record_timing(t[b], stream, capture)?;
                }
            }
        }
        Ok(())
    }

    fn wait_issued(
        &self,
        e: usize,
        step: u64,
        issued: &Issued,
        abort: &AtomicBool,
    ) -> Result<(), ExecError> {
        let deadline = Instant::now() + self.opts.timeout;
        let mut g = issued.stamp.lock().map_err(|_| run_err("poisoned"))?;
        while g[e] < step {
            if abort.load(Ordering::SeqCst) {
                return Err(run_err("stopped: another stream failed"));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(run_err(format!(
                    "timed out waiting for event {e} to be recorded"
                )));
            }
            g = issued
                .cv
                .wait_timeout(g, left.min(Duration::from_millis(100)))
                .map_err(|_| run_err("poisoned"))?
                .0;
        }
        Ok(())
    }

    unsafe fn launch(&self, l: &super::lower::Launch, stream: sys::CUstream) -> Result<(), String> {
        let f = *self
            .functions
            .get(&l.kernel)
            .ok_or_else(|| format!("kernel `{}` not loaded", l.kernel))?;
        // each argument's bytes, 8-byte aligned storage
        let mut store: Vec<Vec<u64>> = Vec::with_capacity(l.args.len());
        for a in &l.args {
            let bytes: Vec<u8> = match a {
                Arg::I32(v) => v.to_le_bytes().to_vec(),
                Arg::I64(v) => v.to_le_bytes().to_vec(),
                Arg::F32(v) => v.to_le_bytes().to_vec(),
                Arg::Ptr(off) => (self.h.base + off).to_le_bytes().to_vec(),
                Arg::Null => 0u64.to_le_bytes().to_vec(),
                Arg::ErrFlag => (self.h.base + self.low.err_offset).to_le_bytes().to_vec(),
                Arg::Nd(nd) => nd.to_bytes(),
                Arg::Bits { bits, len } => bits.to_le_bytes()[..*len].to_vec(),
            };
            let mut words = vec![0u64; bytes.len().div_ceil(8)];
            // SAFETY: words holds at least bytes.len() bytes.
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                words.as_mut_ptr() as *mut u8,
                bytes.len(),
            );
            store.push(words);
        }
        let mut params: Vec<*mut c_void> = store
            .iter_mut()
            .map(|w| w.as_mut_ptr() as *mut c_void)
            .collect();
        drv::launch_kernel(f, (l.grid, 1, 1), (l.block, 1, 1), 0, stream, &mut params).map_err(
            |e| {
                format!(
                    "launching `{}`: {:?}",
                    l.kernel,
                    e.error_name().map(|c| c.to_owned())
                )
            },
        )
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<(), String> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let ty = match g.dtype {
            DType::F32 => blas_sys::cudaDataType::CUDA_R_32F,
            DType::BF16 => blas_sys::cudaDataType::CUDA_R_16BF,
            DType::F16 => blas_sys::cudaDataType::CUDA_R_16F,
            d => return Err(format!("MatMul of {d}")),
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        // the argument arithmetic is `Gemm::cublas_calls` (tests/cuda_products.rs checks it
        // against the CPU's products through a CPU model of this call)
        for c in g.cublas_calls() {
            blas::gemm_strided_batched_ex(
                self.blas.0 .0,
                op(c.trans_x),
                op(c.trans_y),
                c.m as i32,
                c.n as i32,
                c.k as i32,
                &alpha as *const f32 as *const c_void,
                (self.h.base + c.x) as *const c_void,
                ty,
                c.ldx as i32,
                c.stride_x,
                (self.h.base + c.y) as *const c_void,
                ty,
                c.ldy as i32,
                c.stride_y,
                &beta as *const f32 as *const c_void,
                (self.h.base + c.c) as *mut c_void,
                ty,
                c.ldc as i32,
                c.stride_c,
                c.batch as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
            .map_err(|e| format!("cuBLAS: {e:?}"))?;
        }
        Ok(())
    }

    unsafe fn collective(
        &self,
        c: &Collective,
        stream: sys::CUstream,
        abort: &AtomicBool,
    ) -> Result<(), String> {
        let esz = c.dtype.size_bytes();
        let (send, recv) = (self.h.base + c.send, self.h.base + c.recv);
        let key = &self.low.comms[c.comm];
        let what = || describe(c, &key.axes, &key.members, key.stream);
        let one = |stream| {
            // a group of one: the result is the input
            drv::memcpy_dtod_async(recv, send, c.count * esz, stream)
                .map_err(|e| format!("CUDA: the copy of {}: {e:?}", what()))
        };
        let comm = match &self.transport {
            Transport::Local { group, comms } => {
                return match comms.get(c.comm).cloned().flatten() {
                    None => one(stream),
                    Some(lc) => lc.run(
                        key.member,
                        c,
                        self.h.base,
                        stream,
                        &self.functions,
                        group,
                        abort,
                    ),
                };
            }
            Transport::Nccl(comms) => match comms.0.get(c.comm).copied().flatten() {
                None => return one(stream),
                Some(comm) => comm,
            },
        };
        let ty = match c.dtype {
            DType::F32 => nccl_sys::ncclDataType_t::ncclFloat32,
            DType::BF16 => nccl_sys::ncclDataType_t::ncclBfloat16,
            DType::F16 => nccl_sys::ncclDataType_t::ncclFloat16,
            DType::I64 => nccl_sys::ncclDataType_t::ncclInt64,
            DType::I32 => nccl_sys::ncclDataType_t::ncclInt32,
            DType::Bool => nccl_sys::ncclDataType_t::ncclUint8,
        };
        let op = match (c.reduce, c.dtype == DType::Bool) {
            (ReduceOp::Sum, false) => nccl_sys::ncclRedOp_t::ncclSum,
            (ReduceOp::Mean, _) => nccl_sys::ncclRedOp_t::ncclAvg,
            (ReduceOp::Prod, false) => nccl_sys::ncclRedOp_t::ncclProd,
            (ReduceOp::Max, _) | (ReduceOp::Sum, true) => nccl_sys::ncclRedOp_t::ncclMax,
            (ReduceOp::Min, _) | (ReduceOp::Prod, true) => nccl_sys::ncclRedOp_t::ncclMin,
        };
        let s = stream as nccl_sys::cudaStream_t;
        let (sp, rp) = (send as *const c_void, recv as *mut c_void);
        let r = match c.kind {
            CollKind::AllGather => nccl::all_gather(sp, rp, c.count, ty, comm, s),
            CollKind::ReduceScatter => {
                nccl::reduce_scatter(sp, rp, c.count / c.size, ty, op, comm, s)
            }
            CollKind::AllReduce => nccl::all_reduce(sp, rp, c.count, ty, op, comm, s),
            CollKind::Broadcast => nccl::broadcast(sp, rp, c.count, ty, c.root as i32, comm, s),
            CollKind::AllToAll => {
                let chunk = c.count / c.size;
                nccl::group_start()
                    .map_err(|e| format!("{}: ncclGroupStart: {:?}", what(), e.0))?;
                for peer in 0..c.size {
                    let off = (peer * chunk * esz) as u64;
                    nccl::send(
                        (send + off) as *const c_void,
                        chunk,
                        ty,
                        peer as i32,
                        comm,
                        s,
                    )
                    .map_err(|e| format!("{}: {}", what(), nccl_result(e.0, comm)))?;
                    nccl::recv((recv + off) as *mut c_void, chunk, ty, peer as i32, comm, s)
                        .map_err(|e| format!("{}: {}", what(), nccl_result(e.0, comm)))?;
                }
                nccl::group_end()
            }
        };
        match r {
            // non-blocking communicator: the call is queued once NCCL says it is
            Ok(nccl::NcclStatus::InProgress) => {
                wait_comm_ready(comm, Instant::now() + self.opts.timeout)
                    .map_err(|e| format!("{}: {e}", what()))
            }
            Ok(_) => Ok(()),
            Err(e) => Err(format!("{}: {}", what(), nccl_result(e.0, comm))),
        }
    }

    /// The values `values` of this rank read back from the GPU, by name.
    fn read_named(
        &self,
        values: impl Iterator<Item = ValueId>,
    ) -> Result<Vec<(String, Tensor)>, ExecError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| drv_err("binding the context", e))?;
        values
            .map(|v| Ok((self.plan.program.value(v).name.clone(), self.read(v)?)))
            .collect()
    }

    /// Checks that `rank` is this executor's.
    fn mine(&self, rank: usize) -> Result<(), ExecError> {
        if rank == self.dist.rank {
            Ok(())
        } else {
            Err(run_err(format!(
                "rank {rank} runs elsewhere (this executor runs rank {})",
                self.dist.rank
            )))
        }
    }
}

impl PlanExecutor for CudaExecutor {
    fn device(&self) -> String {
        "the GPU".into()
    }

    fn program(&self) -> &hzp_ir::Program {
        &self.plan.program
    }

    fn mesh(&self) -> &hzp_ir::Mesh {
        &self.plan.mesh
    }

    fn layouts(&self) -> &[hzp_ir::ParamLayout] {
        &self.plan.layouts
    }

    fn replicas_differ(&self) -> bool {
        self.plan.asyncmesh.is_some()
    }

    fn local_ranks(&self) -> &[usize] {
        &self.local
    }

    fn set_inputs(&mut self, global: &[(String, Tensor)]) -> Result<(), ExecError> {
        CudaExecutor::set_inputs(self, global)
    }

    fn step(&mut self) -> Result<StepStats, ExecError> {
        self.report = None;
        CudaExecutor::step(self).inspect_err(|e| {
            self.report = Some(CudaExecutor::flight_report(self, &e.to_string()));
        })
    }

    fn steps_run(&self) -> usize {
        self.steps_run
    }

    fn set_steps_run(&mut self, steps: usize) {
        self.steps_run = steps;
    }

    fn master_shards(&self, rank: usize) -> Result<Vec<(String, Tensor)>, ExecError> {
        self.mine(rank)?;
        let p = &self.plan.program;
        let layouts = &self.plan.layouts;
        self.read_named(
            p.params
                .iter()
                .map(|x| x.value)
                .filter(|&v| layouts.iter().any(|l| l.name == p.value(v).name)),
        )
    }

    fn persistent(&self, rank: usize) -> Result<Vec<(String, Tensor)>, ExecError> {
        self.mine(rank)?;
        let p = &self.plan.program;
        self.read_named(crate::executor::persistent_values(p).into_iter())
    }

    fn restore(&mut self, per_rank: &[Vec<(String, Tensor)>]) -> Result<(), ExecError> {
        let p = &self.plan.program;
        let mut matched = crate::executor::check_restore(p, self.plan.mesh.world_size(), per_rank)?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| drv_err("binding the context", e))?;
        for (v, t) in matched.swap_remove(self.dist.rank) {
            self.write(v, t)?;
        }
        self.graph_invalidate();
        Ok(())
    }

    fn value(&self, rank: usize, name: &str) -> Result<Option<Tensor>, ExecError> {
        if rank != self.dist.rank {
            return Ok(None);
        }
        match self.plan.program.find_value(name) {
            None => Ok(None),
            Some(v) => {
                self.ctx
                    .bind_to_thread()
                    .map_err(|e| drv_err("binding the context", e))?;
                self.read(v).map(Some)
            }
        }
    }

    fn flight_report(&self) -> Option<FlightReport> {
        self.report.clone()
    }
}

/// GPU time per node of the lowered plan (`HZP_CUDA_PROFILE=1`), from the per-node timing
/// events every step records anyway: the steps after the first, summed.
#[derive(Default)]
struct OpProfile {
    steps: usize,
    node_ms: Vec<f64>,
}

impl OpProfile {
    fn add(&mut self, node: usize, ms: f64, nodes: usize) {
        self.node_ms.resize(nodes, 0.0);
        self.node_ms[node] += ms;
    }

    /// The report: per stream, the time per op kind (largest first), then the costliest nodes.
    fn report(&self, rank: usize, nodes: &[NodeWork]) -> String {
        use std::fmt::Write;
        let per_step = |ms: f64| ms / self.steps.max(1) as f64;
        let mut out = format!(
            "CUDA time per step by op (rank {rank}, mean of {} step{} after the first; \
             per-node timing events, so a node's time includes waiting on its stream):\n",
            self.steps,
            if self.steps == 1 { "" } else { "s" }
        );
        for (si, stream) in ["compute", "all-gather", "reduce-scatter"]
            .iter()
            .enumerate()
        {
            let mut by_op: std::collections::BTreeMap<&str, (f64, usize)> = Default::default();
            for (nw, ms) in nodes.iter().zip(&self.node_ms) {
                if nw.stream == si {
                    let e = by_op.entry(nw.op).or_default();
                    e.0 += ms;
                    e.1 += 1;
                }
            }
            let total: f64 = by_op.values().map(|v| v.0).sum();
            if by_op.is_empty() {
                continue;
            }
            let _ = writeln!(out, "  {stream} stream: {:.2} ms", per_step(total));
            let mut rows: Vec<_> = by_op.into_iter().collect();
            rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0).then(a.0.cmp(b.0)));
            for (op, (ms, n)) in rows {
                let _ = writeln!(
                    out,
                    "    {op:<22} {:>10.3} ms {:>5.1}%  ({n} node{})",
                    per_step(ms),
                    100.0 * ms / total.max(1e-12),
                    if n == 1 { "" } else { "s" }
                );
            }
        }
        let mut idx: Vec<usize> = (0..self.node_ms.len().min(nodes.len())).collect();
        idx.sort_by(|&a, &b| self.node_ms[b].total_cmp(&self.node_ms[a]).then(a.cmp(&b)));
        let _ = writeln!(out, "  costliest nodes:");
        for &i in idx.iter().take(12) {
            let _ = writeln!(
                out,
                "    {:>10.3} ms  {} ({}, stream {})",
                per_step(self.node_ms[i]),
                nodes[i].name,
                nodes[i].op,
                nodes[i].stream
            );
        }
        out
    }
}

impl Drop for CudaExecutor {
    fn drop(&mut self) {
        if let Some(p) = self.profile.as_ref().filter(|p| p.steps > 0) {
            eprint!("{}", p.report(self.dist.rank, &self.low.nodes));
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: tear-down of handles this executor created; errors are ignored on the way out.
        unsafe {
            if let Transport::Nccl(comms) = &self.transport {
                for c in comms.0.iter().flatten() {
                    if self.failed {
                        // a peer may be gone: abort (never blocks), then the streams drain
                        let _ = nccl::comm_abort(*c);
                    }
                }
            }
            for &s in &self.h.streams {
                let _ = drv::stream::synchronize(s);
            }
            self.graph.tear_down();
            self.lt.tear_down();
            if let (Transport::Nccl(comms), false) = (&self.transport, self.failed) {
                for c in comms.0.iter().flatten() {
                    let _ = nccl::comm_destroy(*c);
                }
            }
            let _ = blas::destroy_handle(self.blas.0 .0);
            // cuDNN's plans, handle and workspace while its stream still exists
            drop(self.attention.take());
            for &e in self.events.0.iter().chain(&self.node_timing.0) {
                let _ = drv::event::destroy(e);
            }
            for &s in &self.h.streams {
                let _ = drv::stream::destroy(s);
            }
            let _ = drv::free_sync(self.h.base);
            let _ = drv::module::unload(self.module);
        }
    }
}

/// Compiles the kernel sources, and `extra` (a lowering's generated kernels,
/// [`super::lower::LoweredPlan::fused_source`]), for compute capability `major.minor` to a
/// cubin (no PTX JIT, so a driver older than the NVRTC is fine).
pub fn compile_kernels(major: i32, minor: i32, extra: &str) -> Result<Vec<u8>, ExecError> {
    compile(
        &format!("--gpu-architecture=sm_{major}{minor}"),
        true,
        extra,
    )
    .map_err(|e| run_err(format!("NVRTC: {e}")))
}

/// How NVRTC treats `a * b + c` in every kernel hzp compiles: rounded twice, never fused
/// (see [`compile`]).
pub const NVRTC_FMAD: &str = "--fmad=false";

/// Compiles the kernel sources followed by `extra` with NVRTC for `arch` (e.g.
/// `--gpu-architecture=compute_80`); returns the cubin (`cubin`) or the PTX. Errors carry
/// NVRTC's log.
pub fn compile(arch: &str, cubin: bool, extra: &str) -> Result<Vec<u8>, String> {
    let src = CString::new(format!("{}\n{extra}", kernels::source()))
        .map_err(|_| "the kernel source holds a NUL byte")?;
    let name = CString::new("hzp_kernels.cu").expect("no NUL");
    // No contraction of a * b + c into one rounding (`--fmad=false`): the CPU backend and
    // the C++ emulation of the generated kernels (tests/cuda_fusion.rs, `-ffp-contract=off`)
    // round the product and the sum apart, so the GPU must too for their bits to agree.
    // NVRTC's default is no fast math.
    let opts: Vec<CString> = [arch, "--std=c++17", NVRTC_FMAD]
        .iter()
        .map(|o| CString::new(*o).expect("no NUL"))
        .collect();
    let ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let ok = nvrtc_sys::nvrtcResult::NVRTC_SUCCESS;
    // SAFETY: NVRTC calls with valid C strings and out-pointers; the program is destroyed
    // on every path.
    unsafe {
        let mut prog = std::ptr::null_mut();
        let r = nvrtc_sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        );
        if r != ok {
            return Err(format!("nvrtcCreateProgram: {r:?}"));
        }
        let r = nvrtc_sys::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr());
        let result = if r != ok {
            let mut n = 0usize;
            nvrtc_sys::nvrtcGetProgramLogSize(prog, &mut n);
            let mut log = vec![0 as std::ffi::c_char; n.max(1)];
            nvrtc_sys::nvrtcGetProgramLog(prog, log.as_mut_ptr());
            let log = CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
            Err(format!("compiling the kernels failed ({r:?}):\n{log}"))
        } else {
            let mut n = 0usize;
            let r = if cubin {
                nvrtc_sys::nvrtcGetCUBINSize(prog, &mut n)
            } else {
                nvrtc_sys::nvrtcGetPTXSize(prog, &mut n)
            };
            if r != ok {
                Err(format!("reading the compiled code: {r:?}"))
            } else {
                let mut out = vec![0u8; n];
                let r = if cubin {
                    nvrtc_sys::nvrtcGetCUBIN(prog, out.as_mut_ptr() as *mut std::ffi::c_char)
                } else {
                    nvrtc_sys::nvrtcGetPTX(prog, out.as_mut_ptr() as *mut std::ffi::c_char)
                };
                if r != ok {
                    Err(format!("reading the compiled code: {r:?}"))
                } else {
                    Ok(out)
                }
            }
        };
        nvrtc_sys::nvrtcDestroyProgram(&mut prog);
        result
    }
}

/// `ncclConfig_t` as NCCL 2.17 defined it (a prefix of every later version): `size` and
/// `version` tell a newer NCCL which fields follow, the rest take their defaults.
#[repr(C)]
struct NcclConfig {
    size: usize,
    magic: u32,
    version: u32,
    blocking: i32,
    cga_cluster_size: i32,
    min_ctas: i32,
    max_ctas: i32,
    net_name: *const std::ffi::c_char,
    split_share: i32,
}

impl NcclConfig {
    /// NCCL_CONFIG_INITIALIZER with `blocking = 0`.
    fn non_blocking() -> NcclConfig {
        const UNDEF: i32 = i32::MIN;
        NcclConfig {
            size: std::mem::size_of::<NcclConfig>(),
            magic: 0xcafe_beef,
            version: 21700,
            blocking: 0,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
            split_share: UNDEF,
        }
    }
}

/// NCCL's name of a result and, with a communicator, its last error message.
fn nccl_result(r: nccl_sys::ncclResult_t, comm: nccl_sys::ncclComm_t) -> String {
    // SAFETY: NCCL returns static or thread-local C strings (or null).
    let last = unsafe {
        let p = nccl_sys::ncclGetLastError(comm);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    if last.is_empty() {
        format!("{r:?}")
    } else {
        format!("{r:?} ({last})")
    }
}

/// Polls a non-blocking communicator until its pending operation is done, an error, or the
/// deadline (the caller then aborts it: [`CudaExecutor::fail`], or the drop of a failed
/// executor).
fn wait_comm_ready(comm: nccl_sys::ncclComm_t, deadline: Instant) -> Result<(), String> {
    loop {
        let mut st = nccl_sys::ncclResult_t::ncclInProgress;
        // SAFETY: a live communicator.
        let r = unsafe { nccl_sys::ncclCommGetAsyncError(comm, &mut st) };
        if r != nccl_sys::ncclResult_t::ncclSuccess {
            return Err(format!("ncclCommGetAsyncError: {}", nccl_result(r, comm)));
        }
        match st {
            nccl_sys::ncclResult_t::ncclSuccess => return Ok(()),
            nccl_sys::ncclResult_t::ncclInProgress => {
                if Instant::now() >= deadline {
                    // the caller's failure path aborts the communicator
                    return Err("timed out (a peer did not join or did not take part)".into());
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            e => return Err(nccl_result(e, comm)),
        }
    }
}

/// `HZP_NCCL_GROUPS_OF_ONE=1`: NCCL communicators for groups of one rank too (normally a
/// copy), so that NCCL's set-up, collectives, error polling and tear-down run on a machine
/// with one GPU (the device check's world-size-1 run).
fn nccl_groups_of_one() -> bool {
    std::env::var_os("HZP_NCCL_GROUPS_OF_ONE").is_some_and(|v| v == "1")
}
