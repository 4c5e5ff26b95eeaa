//! cuDNN's graph (backend) API on an [`SdpaGraph`]: the tensors and operations become backend
//! descriptors, the operation graph is finalized, an engine configuration is chosen by
//! cuDNN's heuristics (mode A, the first configuration whose execution plan finalizes), the
//! plan's workspace size is read, and a variant pack binds the graph's unique ids to device
//! memory (by-value scalars to host memory the plan owns). Built once per graph at load time;
//! each step only calls `cudnnBackendExecute`.
//!
//! cudarc loads libcudnn on first use and panics when it is missing: callers probe for it
//! first ([`super::probe::Lib::Cudnn`]) and call [`Cudnn::open`] only when it was found.
//! Every failing call becomes an error naming the call, cuDNN's status and its last error
//! message; nothing here panics.

use super::sdpa::{PwMode, ReduceMode, SdpaGraph, SdpaOp, SdpaTensor, SdpaType};
use cudarc::cudnn::sys;
use std::collections::BTreeMap;
use std::ffi::{c_void, CStr};

use sys::cudnnBackendAttributeName_t as A;
use sys::cudnnBackendAttributeType_t as T;
use sys::cudnnBackendDescriptorType_t as D;

/// The oldest cuDNN the graphs are built for (9.0: `cudnnGetLastErrorString`, the fused
/// flash attention patterns).
pub const MIN_VERSION: usize = 90000;

/// cuDNN's last error message (cuDNN 9), or nothing.
fn last_error() -> String {
    let mut buf = [0i8; 1024];
    // SAFETY: the buffer is writable for its length; cuDNN writes a NUL-terminated string.
    unsafe {
        sys::cudnnGetLastErrorString(buf.as_mut_ptr() as *mut _, buf.len());
        let s = CStr::from_ptr(buf.as_ptr() as *const _).to_string_lossy();
        if s.is_empty() {
            String::new()
        } else {
            format!(" ({s})")
        }
    }
}

fn check(st: sys::cudnnStatus_t, what: &str) -> Result<(), String> {
    if st == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("cuDNN: {what}: {st:?}{}", last_error()))
    }
}

/// One backend descriptor, destroyed when dropped.
struct Desc(sys::cudnnBackendDescriptor_t);

impl Drop for Desc {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: created by cudnnBackendCreateDescriptor, destroyed once.
            unsafe { sys::cudnnBackendDestroyDescriptor(self.0) };
        }
    }
}

impl Desc {
    fn new(ty: D) -> Result<Desc, String> {
        let mut d: sys::cudnnBackendDescriptor_t = std::ptr::null_mut();
        // SAFETY: d is a valid out-pointer.
        check(
            unsafe { sys::cudnnBackendCreateDescriptor(ty, &mut d) },
            &format!("creating a {ty:?}"),
        )?;
        Ok(Desc(d))
    }

    /// Sets attribute `name` to the `n` elements at `p` of type `ty`.
    ///
    /// # Safety
    /// `p` points to `n` elements of the C type `ty` names.
    unsafe fn set_raw(&self, name: A, ty: T, n: usize, p: *const c_void) -> Result<(), String> {
        check(
            sys::cudnnBackendSetAttribute(self.0, name, ty, n as i64, p),
            &format!("setting {name:?}"),
        )
    }

    fn i64s(&self, name: A, v: &[i64]) -> Result<(), String> {
        // SAFETY: v holds v.len() i64s.
        unsafe { self.set_raw(name, T::CUDNN_TYPE_INT64, v.len(), v.as_ptr() as _) }
    }

    fn boolean(&self, name: A, v: bool) -> Result<(), String> {
        // SAFETY: a C bool is one byte, as Rust's.
        unsafe { self.set_raw(name, T::CUDNN_TYPE_BOOLEAN, 1, &v as *const bool as _) }
    }

    fn data_type(&self, name: A, v: sys::cudnnDataType_t) -> Result<(), String> {
        // SAFETY: one enum value.
        unsafe { self.set_raw(name, T::CUDNN_TYPE_DATA_TYPE, 1, &v as *const _ as _) }
    }

    fn descs(&self, name: A, v: &[&Desc]) -> Result<(), String> {
        let raw: Vec<sys::cudnnBackendDescriptor_t> = v.iter().map(|d| d.0).collect();
        // SAFETY: raw holds raw.len() descriptors.
        unsafe {
            self.set_raw(
                name,
                T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                raw.len(),
                raw.as_ptr() as _,
            )
        }
    }

    fn handle(&self, name: A, h: sys::cudnnHandle_t) -> Result<(), String> {
        // SAFETY: one handle.
        unsafe { self.set_raw(name, T::CUDNN_TYPE_HANDLE, 1, &h as *const _ as _) }
    }

    fn finalize(&self, what: &str) -> Result<(), String> {
        // SAFETY: a live descriptor.
        check(
            unsafe { sys::cudnnBackendFinalize(self.0) },
            &format!("finalizing {what}"),
        )
    }
}

/// A cuDNN handle, destroyed when dropped.
pub struct Cudnn {
    handle: sys::cudnnHandle_t,
    pub version: usize,
}

// SAFETY: the handle is used by one thread at a time (the compute stream's issuer, or the
// main thread at set-up and teardown).
unsafe impl Send for Cudnn {}
unsafe impl Sync for Cudnn {}

impl Drop for Cudnn {
    fn drop(&mut self) {
        // SAFETY: created by cudnnCreate, destroyed once.
        unsafe { sys::cudnnDestroy(self.handle) };
    }
}

impl Cudnn {
    /// Loads cuDNN (the caller has probed that the library is there), checks its version
    /// and creates a handle on the current context that issues on `stream`.
    ///
    /// # Safety
    /// libcudnn must be loadable (cudarc panics otherwise); a CUDA context must be current and
    /// `stream` one of its streams.
    pub unsafe fn open(stream: *mut c_void) -> Result<Cudnn, String> {
        let version = sys::cudnnGetVersion();
        if version < MIN_VERSION {
            return Err(format!(
                "cuDNN {version} is older than 9.0, which hzp's attention graphs need"
            ));
        }
        let mut handle: sys::cudnnHandle_t = std::ptr::null_mut();
        check(sys::cudnnCreate(&mut handle), "cudnnCreate")?;
        let c = Cudnn { handle, version };
        check(
            sys::cudnnSetStream(handle, stream as sys::cudaStream_t),
            "cudnnSetStream",
        )?;
        Ok(c)
    }
}

/// A finalized execution plan of one graph.
pub struct SdpaPlan {
    plan: Desc,
    /// Bytes of workspace the plan needs.
    pub workspace: u64,
    /// The engine cuDNN's heuristics chose (its global index), for reports.
    pub engine: i64,
    /// The by-value scalars' host memory (uid, value), pointed to by variant packs.
    scalars: Vec<(i64, Box<f32>)>,
    /// The descriptors the plan was built from, kept alive with it.
    _parts: Vec<Desc>,
}

// SAFETY: as Cudnn: used by one thread at a time.
unsafe impl Send for SdpaPlan {}
unsafe impl Sync for SdpaPlan {}

fn dtype(t: SdpaType) -> sys::cudnnDataType_t {
    use sys::cudnnDataType_t as Dt;
    match t {
        SdpaType::F32 => Dt::CUDNN_DATA_FLOAT,
        SdpaType::BF16 => Dt::CUDNN_DATA_BFLOAT16,
        SdpaType::F16 => Dt::CUDNN_DATA_HALF,
        SdpaType::I32 => Dt::CUDNN_DATA_INT32,
        SdpaType::Bool => Dt::CUDNN_DATA_BOOLEAN,
    }
}

fn tensor(t: &SdpaTensor) -> Result<Desc, String> {
    let d = Desc::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    d.data_type(A::CUDNN_ATTR_TENSOR_DATA_TYPE, dtype(t.dtype))?;
    d.i64s(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &t.dims)?;
    d.i64s(A::CUDNN_ATTR_TENSOR_STRIDES, &t.strides)?;
    d.i64s(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[t.uid])?;
    d.i64s(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[16])?;
    d.boolean(A::CUDNN_ATTR_TENSOR_IS_VIRTUAL, t.is_virtual)?;
    if t.by_value.is_some() {
        d.boolean(A::CUDNN_ATTR_TENSOR_IS_BY_VALUE, true)?;
    }
    d.finalize(&format!("tensor {}", t.name))?;
    Ok(d)
}

fn pointwise_mode(m: PwMode) -> sys::cudnnPointwiseMode_t {
    use sys::cudnnPointwiseMode_t as P;
    match m {
        PwMode::Mul => P::CUDNN_POINTWISE_MUL,
        PwMode::Add => P::CUDNN_POINTWISE_ADD,
        PwMode::Sub => P::CUDNN_POINTWISE_SUB,
        PwMode::Div => P::CUDNN_POINTWISE_DIV,
        PwMode::Exp => P::CUDNN_POINTWISE_EXP,
        PwMode::Log => P::CUDNN_POINTWISE_LOG,
        PwMode::Identity => P::CUDNN_POINTWISE_IDENTITY,
        PwMode::GenIndex { .. } => P::CUDNN_POINTWISE_GEN_INDEX,
        PwMode::CmpGe => P::CUDNN_POINTWISE_CMP_GE,
        PwMode::BinarySelect => P::CUDNN_POINTWISE_BINARY_SELECT,
    }
}

/// The operation descriptor of `op` (plus the descriptors it refers to, kept alive).
fn operation(op: &SdpaOp, ts: &BTreeMap<i64, Desc>, keep: &mut Vec<Desc>) -> Result<Desc, String> {
    let t = |uid: &i64| {
        ts.get(uid).ok_or_else(|| {
            format!("cuDNN graph: an operation names uid {uid}, which no tensor has")
        })
    };
    let f32t = sys::cudnnDataType_t::CUDNN_DATA_FLOAT;
    match op {
        SdpaOp::Matmul { a, b, c } => {
            let m = Desc::new(D::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
            m.data_type(A::CUDNN_ATTR_MATMUL_COMP_TYPE, f32t)?;
            m.finalize("a matmul descriptor")?;
            let o = Desc::new(D::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
            o.descs(A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &[t(a)?])?;
            o.descs(A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &[t(b)?])?;
            o.descs(A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &[t(c)?])?;
            o.descs(A::CUDNN_ATTR_OPERATION_MATMUL_DESC, &[&m])?;
            o.finalize("a matmul operation")?;
            keep.push(m);
            Ok(o)
        }
        SdpaOp::Pointwise {
            mode,
            x,
            b,
            t: tt,
            y,
        } => {
            let p = Desc::new(D::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
            let pm = pointwise_mode(*mode);
            // SAFETY: one enum value.
            unsafe {
                p.set_raw(
                    A::CUDNN_ATTR_POINTWISE_MODE,
                    T::CUDNN_TYPE_POINTWISE_MODE,
                    1,
                    &pm as *const _ as _,
                )?
            };
            p.data_type(A::CUDNN_ATTR_POINTWISE_MATH_PREC, f32t)?;
            if let PwMode::GenIndex { axis } = mode {
                p.i64s(A::CUDNN_ATTR_POINTWISE_AXIS, &[*axis])?;
            }
            p.finalize(&format!("a pointwise {} descriptor", mode.name()))?;
            let o = Desc::new(D::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
            o.descs(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&p])?;
            o.descs(A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &[t(x)?])?;
            if let Some(b) = b {
                o.descs(A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[t(b)?])?;
            }
            if let Some(tt) = tt {
                o.descs(A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, &[t(tt)?])?;
            }
            o.descs(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[t(y)?])?;
            o.finalize(&format!("a pointwise {} operation", mode.name()))?;
            keep.push(p);
            Ok(o)
        }
        SdpaOp::Reduction { mode, x, y } => {
            let r = Desc::new(D::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
            let rm = match mode {
                ReduceMode::Max => sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_MAX,
                ReduceMode::Add => sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD,
            };
            // SAFETY: one enum value.
            unsafe {
                r.set_raw(
                    A::CUDNN_ATTR_REDUCTION_OPERATOR,
                    T::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
                    1,
                    &rm as *const _ as _,
                )?
            };
            r.data_type(A::CUDNN_ATTR_REDUCTION_COMP_TYPE, f32t)?;
            r.finalize("a reduction descriptor")?;
            let o = Desc::new(D::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
            o.descs(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &[t(x)?])?;
            o.descs(A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &[t(y)?])?;
            o.descs(A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[&r])?;
            o.finalize("a reduction operation")?;
            keep.push(r);
            Ok(o)
        }
        SdpaOp::Reshape { x, y } => {
            let o = Desc::new(D::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
            o.descs(A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &[t(x)?])?;
            o.descs(A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &[t(y)?])?;
            o.finalize("a reshape operation")?;
            Ok(o)
        }
    }
}

impl Cudnn {
    /// Builds `g` into a finalized execution plan: descriptors, operation graph, heuristics
    /// (mode A, then the fallback list), the first engine configuration whose plan finalizes
    /// and needs at most `max_workspace` bytes (what the arena reserves), its workspace size;
    /// where every engine that finalizes asks more, the first of them.
    pub fn build(&self, g: &SdpaGraph, max_workspace: u64) -> Result<SdpaPlan, String> {
        let mut parts: Vec<Desc> = Vec::new();
        let mut ts: BTreeMap<i64, Desc> = BTreeMap::new();
        for t in &g.tensors {
            ts.insert(t.uid, tensor(t)?);
        }
        let mut ops = Vec::with_capacity(g.ops.len());
        for op in &g.ops {
            ops.push(operation(op, &ts, &mut parts)?);
        }
        let graph = Desc::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.descs(
            A::CUDNN_ATTR_OPERATIONGRAPH_OPS,
            &ops.iter().collect::<Vec<_>>(),
        )?;
        graph.handle(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, self.handle)?;
        graph.finalize("the operation graph")?;

        let mut errors = Vec::new();
        // within the reserved workspace first; then, where only that kept every engine out,
        // whatever the first engine asks (the caller allocates it apart, saying so)
        let mut over = false;
        use sys::cudnnBackendHeurMode_t as Mode;
        let tries = [
            (max_workspace, Mode::CUDNN_HEUR_MODE_A),
            (max_workspace, Mode::CUDNN_HEUR_MODE_FALLBACK),
            (u64::MAX, Mode::CUDNN_HEUR_MODE_A),
            (u64::MAX, Mode::CUDNN_HEUR_MODE_FALLBACK),
        ];
        for (limit, mode) in tries {
            if limit == u64::MAX && !over {
                break;
            }
            match self.plan_by(&graph, mode, limit, &mut over) {
                Ok((plan, workspace, engine, heur, cfgs)) => {
                    let scalars = g
                        .tensors
                        .iter()
                        .filter_map(|t| t.by_value.map(|v| (t.uid, Box::new(v))))
                        .collect();
                    parts.extend(ts.into_values());
                    parts.extend(ops);
                    parts.push(graph);
                    parts.push(heur);
                    parts.extend(cfgs);
                    return Ok(SdpaPlan {
                        plan,
                        workspace,
                        engine,
                        scalars,
                        _parts: parts,
                    });
                }
                Err(e) => errors.push(format!("heuristics {mode:?}: {e}")),
            }
        }
        Err(format!(
            "cuDNN: no engine runs this attention graph: {}",
            errors.join("; ")
        ))
    }

    /// The first engine configuration of heuristics `mode` whose execution plan finalizes
    /// within `max_workspace` bytes of workspace: (plan, workspace bytes, engine index, the
    /// heuristics and configurations, kept alive). Sets `over` when a plan finalized but
    /// asked for more workspace.
    #[allow(clippy::type_complexity)]
    fn plan_by(
        &self,
        graph: &Desc,
        mode: sys::cudnnBackendHeurMode_t,
        max_workspace: u64,
        over: &mut bool,
    ) -> Result<(Desc, u64, i64, Desc, Vec<Desc>), String> {
        let heur = Desc::new(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
        heur.descs(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[graph])?;
        // SAFETY: one enum value.
        unsafe {
            heur.set_raw(
                A::CUDNN_ATTR_ENGINEHEUR_MODE,
                T::CUDNN_TYPE_HEUR_MODE,
                1,
                &mode as *const _ as _,
            )?
        };
        heur.finalize("the engine heuristics")?;
        let mut count = 0i64;
        // SAFETY: asking for the count only (no elements written).
        check(
            unsafe {
                sys::cudnnBackendGetAttribute(
                    heur.0,
                    A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
                    T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                    0,
                    &mut count,
                    std::ptr::null_mut(),
                )
            },
            "counting the heuristics' engine configurations",
        )?;
        if count <= 0 {
            return Err("no engine configuration proposed".into());
        }
        let cfgs: Vec<Desc> = (0..count)
            .map(|_| Desc::new(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
            .collect::<Result<_, _>>()?;
        let mut raw: Vec<sys::cudnnBackendDescriptor_t> = cfgs.iter().map(|d| d.0).collect();
        let mut got = 0i64;
        // SAFETY: raw holds `count` created ENGINECFG descriptors for cuDNN to fill.
        check(
            unsafe {
                sys::cudnnBackendGetAttribute(
                    heur.0,
                    A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
                    T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                    count,
                    &mut got,
                    raw.as_mut_ptr() as *mut c_void,
                )
            },
            "reading the heuristics' engine configurations",
        )?;
        let mut errors = Vec::new();
        for cfg in cfgs.iter().take(got.max(0) as usize) {
            match self.plan_of(cfg) {
                Ok((_, workspace)) if workspace > max_workspace => {
                    *over = true;
                    errors.push(format!(
                        "engine {} needs {workspace} bytes of workspace, more than the \
                         {max_workspace} the arena reserves for it",
                        engine_index(cfg).unwrap_or(-1)
                    ))
                }
                Ok((plan, workspace)) => {
                    let engine = engine_index(cfg).unwrap_or(-1);
                    return Ok((plan, workspace, engine, heur, cfgs));
                }
                Err(e) => errors.push(e),
            }
        }
        Err(format!(
            "none of the {got} engine configurations proposed builds a plan: {}",
            errors.join("; ")
        ))
    }

    fn plan_of(&self, cfg: &Desc) -> Result<(Desc, u64), String> {
        let plan = Desc::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
        plan.handle(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, self.handle)?;
        plan.descs(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[cfg])?;
        plan.finalize("the execution plan")?;
        let mut ws = 0i64;
        let mut n = 0i64;
        // SAFETY: one i64 out.
        check(
            unsafe {
                sys::cudnnBackendGetAttribute(
                    plan.0,
                    A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                    T::CUDNN_TYPE_INT64,
                    1,
                    &mut n,
                    &mut ws as *mut i64 as *mut c_void,
                )
            },
            "reading the plan's workspace size",
        )?;
        Ok((plan, ws.max(0) as u64))
    }

    /// A variant pack binding each bound uid to its device pointer (`ptrs`), the by-value
    /// scalars to `plan`'s host copies, and `workspace` (null when the plan needs none).
    pub fn variant_pack(
        &self,
        plan: &SdpaPlan,
        ptrs: &[(i64, u64)],
        workspace: u64,
    ) -> Result<VariantPack, String> {
        let mut uids: Vec<i64> = Vec::new();
        let mut data: Vec<*mut c_void> = Vec::new();
        for &(uid, p) in ptrs {
            uids.push(uid);
            data.push(p as *mut c_void);
        }
        for (uid, v) in &plan.scalars {
            uids.push(*uid);
            data.push(&**v as *const f32 as *mut c_void);
        }
        let vp = Desc::new(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        vp.i64s(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &uids)?;
        // SAFETY: data holds data.len() pointers.
        unsafe {
            vp.set_raw(
                A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                T::CUDNN_TYPE_VOID_PTR,
                data.len(),
                data.as_ptr() as _,
            )?;
            let ws = workspace as *mut c_void;
            vp.set_raw(
                A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
                T::CUDNN_TYPE_VOID_PTR,
                1,
                &ws as *const *mut c_void as _,
            )?;
        }
        vp.finalize("the variant pack")?;
        Ok(VariantPack(vp))
    }

    /// Runs `plan` with `pack` on the handle's stream.
    ///
    /// # Safety
    /// The pack's pointers are live device memory of the sizes the graph describes, and the
    /// plan's scalars outlive the call (they live in `plan`).
    pub unsafe fn execute(&self, plan: &SdpaPlan, pack: &VariantPack) -> Result<(), String> {
        check(
            sys::cudnnBackendExecute(self.handle, plan.plan.0, pack.0 .0),
            "executing the attention plan",
        )
    }
}

/// A finalized variant pack (what one node's execution binds).
pub struct VariantPack(Desc);
// SAFETY: as Cudnn: used by one thread at a time.
unsafe impl Send for VariantPack {}
unsafe impl Sync for VariantPack {}

/// The global index of the engine of configuration `cfg`.
fn engine_index(cfg: &Desc) -> Result<i64, String> {
    let engine = Desc::new(D::CUDNN_BACKEND_ENGINE_DESCRIPTOR)?;
    let mut raw = engine.0;
    let mut n = 0i64;
    // SAFETY: one created descriptor for cuDNN to fill.
    check(
        unsafe {
            sys::cudnnBackendGetAttribute(
                cfg.0,
                A::CUDNN_ATTR_ENGINECFG_ENGINE,
                T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                1,
                &mut n,
                &mut raw as *mut _ as *mut c_void,
            )
        },
        "reading the configuration's engine",
    )?;
    let mut idx = 0i64;
    // SAFETY: one i64 out.
    check(
        unsafe {
            sys::cudnnBackendGetAttribute(
                engine.0,
                A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX,
                T::CUDNN_TYPE_INT64,
                1,
                &mut n,
                &mut idx as *mut i64 as *mut c_void,
            )
        },
        "reading the engine's index",
    )?;
    Ok(idx)
}

/// Prints `line` to stderr once per process (every rank of a `--ranks-on-one-gpu` run lowers
/// the same nodes: one note each, not one per rank).
pub(super) fn note_once(line: &str) {
    static SEEN: std::sync::Mutex<std::collections::BTreeSet<String>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let fresh = SEEN
        .lock()
        .map(|mut s| s.insert(line.to_string()))
        .unwrap_or(true);
    if fresh {
        eprintln!("hzp: {line}");
    }
}

/// Whether cuDNN runs this process's fused attention: `Ok` when libcudnn was found (and loaded
/// from where it was found) and `HZP_CUDNN` is not `0`; otherwise why not, naming the library
/// and where it was looked for.
pub(super) fn available(pr: &super::probe::Probe) -> Result<(), String> {
    available_with(pr, &|k| std::env::var(k).ok())
}

/// [`available`] with the environment `env`.
fn available_with(pr: &super::probe::Probe, env: super::probe::EnvFn<'_>) -> Result<(), String> {
    if env("HZP_CUDNN").is_some_and(|v| v == "0") {
        return Err("HZP_CUDNN=0 keeps attention on hzp's kernels".into());
    }
    use super::probe::{Lib, LibState};
    pr.require(&[Lib::Cudnn], "cuDNN attention")?;
    if let LibState::Found { path } = pr.state(Lib::Cudnn) {
        // cudarc loads cuDNN by name (libcudnn.so.9 among them): a preloaded file serves only
        // when its name, hence its soname, is cuDNN 9's
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !name.starts_with("libcudnn.so.9") {
            return Err(format!(
                "cuDNN attention: found {}, but hzp needs cuDNN 9 (libcudnn.so.9)",
                path.display()
            ));
        }
    }
    pr.preload(&[Lib::Cudnn])?;
    // the last word is cudarc's own loader (it panics where this says no)
    // SAFETY: only tries to open the library by cudarc's names.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(format!(
            "cuDNN attention: libcudnn was found ({:?}) but does not load under the names cudarc uses ({})",
            pr.state(Lib::Cudnn),
            Lib::Cudnn.loader_names().join(", ")
        ))
    }
}

/// Sets `lower.cudnn` for `plan`: when the plan has fused attention, whether cuDNN is
/// [`available`]; when it is not, one note per attention node naming it and why.
pub(super) fn choose(plan: &hzp_ir::Plan, lower: &mut super::lower::LowerOptions) {
    use hzp_ir::Op;
    let attention: Vec<&hzp_ir::Node> = plan
        .program
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Attention { .. } | Op::AttentionGrad { .. }))
        .collect();
    if attention.is_empty() {
        return;
    }
    match available(&super::probe::probe()) {
        Ok(()) => lower.cudnn = true,
        Err(why) => {
            lower.cudnn = false;
            for n in attention {
                note_once(&format!(
                    "node `{}` ({}): not on cuDNN: {}",
                    n.name,
                    n.op.name(),
                    why.replace('\n', "; ")
                ));
            }
        }
    }
}

/// The attention nodes of one rank that run on cuDNN: the handle and each node's plan and
/// variant pack. Their workspace and scratch are the arena's attention region
/// ([`super::work::LoweredPlan::attention_workspace`]), which they share: nodes run one after
/// another on the compute stream.
pub(super) struct AttentionRunner {
    /// Per node index: its plan and variant pack.
    packs: HashMap<usize, (std::sync::Arc<SdpaPlan>, VariantPack)>,
    cudnn: Cudnn,
    /// The workspace of plans whose engine asks more than the region holds (0: none),
    /// allocated apart at load time.
    apart: cudarc::driver::sys::CUdeviceptr,
}

use std::collections::HashMap;

impl Drop for AttentionRunner {
    fn drop(&mut self) {
        // the packs and plans before the handle, then the memory they pointed into
        self.packs.clear();
        if self.apart != 0 {
            // SAFETY: allocated by malloc_sync in `prepare`, freed once; the context is
            // current (the executor binds it before tearing down).
            unsafe {
                let _ = cudarc::driver::result::free_sync(self.apart);
            }
        }
    }
}

impl AttentionRunner {
    /// Runs node `node`'s attention on the handle's stream.
    ///
    /// # Safety
    /// The arena the packs point into is live; the context is current.
    pub(super) unsafe fn run(&self, node: usize) -> Result<(), String> {
        let (plan, pack) = self
            .packs
            .get(&node)
            .ok_or_else(|| "internal: no cuDNN plan for this attention node".to_string())?;
        self.cudnn.execute(plan, pack)
    }
}

/// Replaces node `i`'s cuDNN work by its fallback (hzp's kernels), with a note, or fails
/// naming both reasons.
fn fall_back(low: &mut super::lower::LoweredPlan, i: usize, why: &str) -> Result<(), String> {
    let nw = &mut low.nodes[i];
    let mut out = Vec::new();
    for w in std::mem::take(&mut nw.work) {
        match w {
            super::work::Work::Sdpa(sw) => match sw.fallback {
                Ok(ws) => out.extend(ws),
                Err(e) => {
                    return Err(format!(
                        "node `{}` ({}): cuDNN could not run its attention ({why}), and {e}",
                        nw.name, nw.op
                    ))
                }
            },
            w => out.push(w),
        }
    }
    nw.work = out;
    note_once(&format!(
        "node `{}` ({}): cuDNN could not run its attention ({why}); hzp's attention kernels run it",
        nw.name, nw.op
    ));
    Ok(())
}

/// Builds the cuDNN plans of `low`'s [`super::work::Work::Sdpa`] nodes (once per distinct
/// graph, each within the workspace the lowering reserved for it where an engine fits, else
/// with its workspace allocated apart, said once) and makes each node's
/// variant pack against the arena at `base`, its workspace and scratch in the arena's
/// attention region; a node whose graph cuDNN cannot build (or every node, when cuDNN does
/// not open) gets its fallback instead. `None` when no node runs on cuDNN. Errors: a node
/// with neither.
///
/// # Safety
/// libcudnn was probed loadable ([`available`]); the context is current; `stream` is its
/// compute stream and `base` the arena (`low.alloc_bytes` bytes).
pub(super) unsafe fn prepare(
    low: &mut super::lower::LoweredPlan,
    stream: *mut c_void,
    base: u64,
) -> Result<Option<AttentionRunner>, String> {
    use super::work::Work;
    let sdpa_nodes: Vec<usize> = (0..low.nodes.len())
        .filter(|&i| low.nodes[i].work.iter().any(|w| matches!(w, Work::Sdpa(_))))
        .collect();
    if sdpa_nodes.is_empty() {
        return Ok(None);
    }
    let cudnn = match Cudnn::open(stream) {
        Ok(c) => c,
        Err(e) => {
            for i in sdpa_nodes {
                fall_back(low, i, &e)?;
            }
            return Ok(None);
        }
    };
    let (region, region_bytes) = low.attention_workspace;
    let mut built: HashMap<String, Result<std::sync::Arc<SdpaPlan>, String>> = HashMap::new();
    let mut chosen = Vec::new();
    for i in sdpa_nodes {
        let Some(Work::Sdpa(sw)) = low.nodes[i]
            .work
            .iter()
            .find(|w| matches!(w, Work::Sdpa(_)))
        else {
            continue;
        };
        if sw.graph.reserved_bytes() > region_bytes {
            let why = format!(
                "internal: the arena's attention region ({region_bytes} bytes) is smaller \
                 than this node's {} bytes",
                sw.graph.reserved_bytes()
            );
            fall_back(low, i, &why)?;
            continue;
        }
        let r = built
            .entry(sw.graph.key())
            .or_insert_with(|| {
                (cudnn.build(&sw.graph, sw.graph.workspace_bound())).map(std::sync::Arc::new)
            })
            .clone();
        match r {
            Ok(plan) => chosen.push((i, plan, sw.clone())),
            Err(e) => fall_back(low, i, &e)?,
        }
    }
    if chosen.is_empty() {
        return Ok(None);
    }
    note_once(&format!(
        "cuDNN {} runs {} attention node(s) with {} distinct graph(s) (engines {:?}); \
         workspace up to {} bytes, in the arena's {region_bytes}-byte attention region",
        cudnn.version,
        chosen.len(),
        built.values().filter(|r| r.is_ok()).count(),
        {
            let mut e: Vec<i64> = chosen.iter().map(|c| c.1.engine).collect();
            e.sort_unstable();
            e.dedup();
            e
        },
        chosen.iter().map(|c| c.1.workspace).max().unwrap_or(0),
    ));
    // engines that asked more than the region (only where no engine fit): one allocation
    let apart_bytes = (chosen.iter())
        .filter(|c| c.1.workspace > c.2.graph.workspace_bound())
        .map(|c| c.1.workspace)
        .max()
        .unwrap_or(0);
    let apart = if apart_bytes > 0 {
        note_once(&format!(
            "cuDNN: no engine runs some attention graph within the workspace the arena \
             reserves; {apart_bytes} bytes allocated apart, outside the memory plan"
        ));
        cudarc::driver::result::malloc_sync(apart_bytes as usize).map_err(|e| {
            format!("allocating cuDNN attention's {apart_bytes}-byte workspace: {e:?}")
        })?
    } else {
        0
    };
    let mut runner = AttentionRunner {
        packs: HashMap::new(),
        cudnn,
        apart,
    };
    for (i, plan, sw) in chosen {
        let mut ptrs: Vec<(i64, u64)> = sw.operands.iter().map(|&(u, o)| (u, base + o)).collect();
        // the workspace first (its reserved bound), then the scratch
        let mut at = base + region + sw.graph.workspace_bound();
        for (role, b) in sw.graph.scratch() {
            ptrs.push((role.uid(), at));
            at += b;
        }
        let ws_ptr = match plan.workspace {
            0 => 0,
            w if w > sw.graph.workspace_bound() => apart,
            _ => base + region,
        };
        match runner.cudnn.variant_pack(&plan, &ptrs, ws_ptr) {
            Ok(pack) => {
                runner.packs.insert(i, (plan, pack));
            }
            Err(e) => fall_back(low, i, &e)?,
        }
    }
    Ok(Some(runner))
}

#[cfg(test)]
mod tests {
    use super::available_with;
    use crate::cuda::probe::probe_in;

    fn dir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("hzp-cudnn-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn why_cudnn_is_not_used_is_said() {
        let none = |_: &str| None;
        // HZP_CUDNN=0 first, whatever the machine has
        let d = dir("off");
        let off = |k: &str| (k == "HZP_CUDNN").then(|| "0".to_string());
        let e = available_with(&probe_in(vec![d.clone()], false), &off).unwrap_err();
        assert!(e.contains("HZP_CUDNN=0"), "{e}");
        // missing: named, with where it was looked for
        let e = available_with(&probe_in(vec![d.clone()], false), &none).unwrap_err();
        assert!(e.contains("libcudnn.so.9 was not found"), "{e}");
        assert!(e.contains(&d.display().to_string()), "{e}");
        // another major version found: named, not loaded
        let d8 = dir("v8");
        std::fs::write(d8.join("libcudnn.so.8"), b"x").unwrap();
        let e = available_with(&probe_in(vec![d8.clone()], false), &none).unwrap_err();
        assert!(
            e.contains("libcudnn.so.8") && e.contains("needs cuDNN 9"),
            "{e}"
        );
        // a file that is no library: loading it fails, naming it
        let d9 = dir("v9");
        std::fs::write(d9.join("libcudnn.so.9"), b"x").unwrap();
        let e = available_with(&probe_in(vec![d9.clone()], false), &none).unwrap_err();
        assert!(
            e.contains(&d9.join("libcudnn.so.9").display().to_string()),
            "{e}"
        );
    }
}
