//! The CUDA executor's cuBLASLt products with epilogues (a child of `device.rs`;
//! `HZP_CUDA_LT=1`, [`super::super::epilogue`]). Built, never run on a GPU.
//!
//! Each [`LtGemm`] is the column-major call `Gemm::cublas_calls` gives (cuBLAS's `A` is the
//! plan's right operand): layouts of `A` (`m x k`, or `k x m` transposed), `B` and `D`
//! (`m x n`, leading dimension `ldc`), the epilogue, the bias pointer (a vector of `m`: the
//! plan's `N`) and for the GELU ones the auxiliary pointer with `ldc` as its leading dimension.
//! The algorithm is cuBLASLt's first heuristic choice within a workspace allocated once.

use super::super::epilogue::Epilogue;
use super::super::work::LtGemm;
use super::{drv, drv_err, run_err, sys, ExecError, LoweredPlan, Work};
use cudarc::cublaslt::{result as lt, sys as lt_sys};
use std::ffi::c_void;

/// Workspace bytes for cuBLASLt's algorithms.
const WORKSPACE: usize = 32 << 20;

/// The cuBLASLt handle and workspace (none when the lowering has no [`LtGemm`]).
pub(super) struct LtRun {
    handle: Option<lt_sys::cublasLtHandle_t>,
    workspace: sys::CUdeviceptr,
}

// SAFETY: the handle is used by the compute stream's issuing thread (one at a time).
unsafe impl Send for LtRun {}
unsafe impl Sync for LtRun {}

impl LtRun {
    /// A handle and workspace when `low` has cuBLASLt products.
    pub(super) fn new(low: &LoweredPlan) -> Result<LtRun, ExecError> {
        let any = low
            .nodes
            .iter()
            .any(|nw| nw.work.iter().any(|w| matches!(w, Work::LtGemm(_))));
        if !any {
            return Ok(LtRun {
                handle: None,
                workspace: 0,
            });
        }
        let handle = lt::create_handle()
            .map_err(|e| run_err(format!("cuBLASLt: creating a handle: {e:?}")))?;
        // SAFETY: plain allocation on the current context.
        let workspace = unsafe { drv::malloc_sync(WORKSPACE) }
            .map_err(|e| drv_err("allocating cuBLASLt's workspace", e))?;
        Ok(LtRun {
            handle: Some(handle),
            workspace,
        })
    }

    /// Frees the handle and workspace (on the executor's way out, streams idle).
    pub(super) fn tear_down(&mut self) {
        if let Some(h) = self.handle.take() {
            // SAFETY: what `new` created.
            unsafe {
                let _ = lt::destroy_handle(h);
                let _ = drv::free_sync(self.workspace);
            }
        }
    }

    /// Issues `g` on `stream`, operands at `base` + their offsets.
    ///
    /// # Safety
    /// `stream` and `base` are the executor's; every offset lies in its arena.
    pub(super) unsafe fn run(
        &self,
        g: &LtGemm,
        base: sys::CUdeviceptr,
        stream: sys::CUstream,
    ) -> Result<(), String> {
        let handle = self.handle.ok_or("internal: no cuBLASLt handle")?;
        let calls = g.gemm.cublas_calls();
        let [c] = calls[..] else {
            return Err("internal: a cuBLASLt product of more than one call".into());
        };
        let err = |what: &str, e: cudarc::cublaslt::result::CublasError| {
            format!("cuBLASLt: {what}: {e:?}")
        };
        // operands, D, the bias and the auxiliary matrix share the product's type (cuBLASLt's
        // default for the bias and aux types); f32 accumulation and f32 alpha / beta
        let f32t = lt_sys::cudaDataType::CUDA_R_32F;
        let elem = match g.gemm.dtype {
            hzp_ir::DType::F32 => f32t,
            hzp_ir::DType::BF16 => lt_sys::cudaDataType::CUDA_R_16BF,
            hzp_ir::DType::F16 => lt_sys::cudaDataType::CUDA_R_16F,
            other => return Err(format!("internal: a cuBLASLt product of {other}")),
        };
        let desc = lt::create_matmul_desc(lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, f32t)
            .map_err(|e| err("creating the descriptor", e))?;
        let layout = |t: bool, r: usize, k: usize, ld: usize| {
            let (rr, cc) = if t { (k, r) } else { (r, k) };
            lt::create_matrix_layout(elem, rr as u64, cc as u64, ld as i64)
        };
        let a_l = layout(c.trans_x, c.m, c.k, c.ldx).map_err(|e| err("layout of A", e))?;
        let b_l = layout(c.trans_y, c.k, c.n, c.ldy).map_err(|e| err("layout of B", e))?;
        let d_l = layout(false, c.m, c.n, c.ldc).map_err(|e| err("layout of D", e))?;
        let pref = lt::create_matmul_pref().map_err(|e| err("creating a preference", e))?;
        let result = (|| -> Result<(), String> {
            use lt_sys::cublasLtMatmulDescAttributes_t as A;
            let set = |attr: A, v: *const c_void, size: usize| {
                lt::set_matmul_desc_attribute(desc, attr, v, size)
                    .map_err(|e| err("setting an attribute", e))
            };
            let (ta, tb) = (c.trans_x as i32, c.trans_y as i32);
            set(A::CUBLASLT_MATMUL_DESC_TRANSA, &ta as *const i32 as _, 4)?;
            set(A::CUBLASLT_MATMUL_DESC_TRANSB, &tb as *const i32 as _, 4)?;
            use lt_sys::cublasLtEpilogue_t as E;
            let epi = match g.epilogue {
                Epilogue::Default => E::CUBLASLT_EPILOGUE_DEFAULT,
                Epilogue::Bias => E::CUBLASLT_EPILOGUE_BIAS,
                Epilogue::GeluAuxBias => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
                Epilogue::Dgelu => E::CUBLASLT_EPILOGUE_DGELU,
                Epilogue::DgeluBgrad => E::CUBLASLT_EPILOGUE_DGELU_BGRAD,
                Epilogue::BgradA => E::CUBLASLT_EPILOGUE_BGRADA,
            };
            set(
                A::CUBLASLT_MATMUL_DESC_EPILOGUE,
                &epi as *const E as _,
                std::mem::size_of::<E>(),
            )?;
            if let Some(b) = g.bias {
                let ptr = base + b;
                set(
                    A::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &ptr as *const u64 as _,
                    8,
                )?;
            }
            if let Some(a) = g.aux {
                let ptr = base + a;
                let ld = c.ldc as i64;
                set(
                    A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                    &ptr as *const u64 as _,
                    8,
                )?;
                set(
                    A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                    &ld as *const i64 as _,
                    8,
                )?;
            }
            let ws = WORKSPACE as u64;
            lt::set_matmul_pref_attribute(
                pref,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as _,
                8,
            )
            .map_err(|e| err("setting the workspace", e))?;
            let h = lt::get_matmul_algo_heuristic(handle, desc, a_l, b_l, d_l, d_l, pref)
                .map_err(|e| err(&format!("no algorithm for {}", g.epilogue.name()), e))?;
            let (one, zero) = (1f32, 0f32);
            let d = (base + c.c) as *mut c_void;
            lt::matmul(
                handle,
                desc,
                &one as *const f32 as _,
                &zero as *const f32 as _,
                (base + c.x) as *const c_void,
                a_l,
                (base + c.y) as *const c_void,
                b_l,
                d,
                d_l,
                d,
                d_l,
                &h.algo,
                self.workspace as *mut c_void,
                WORKSPACE,
                stream as lt_sys::cudaStream_t,
            )
            .map_err(|e| err(&format!("the {} product", g.epilogue.name()), e))
        })();
        let _ = lt::destroy_matmul_pref(pref);
        let _ = lt::destroy_matrix_layout(a_l);
        let _ = lt::destroy_matrix_layout(b_l);
        let _ = lt::destroy_matrix_layout(d_l);
        let _ = lt::destroy_matmul_desc(desc);
        result
    }
}
