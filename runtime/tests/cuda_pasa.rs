//! With the `cuda` feature and a GPU: the CUDA kernel `attn_fwd_pasa_f16` (PASA's fp16
//! forward) against exact attention in f64 and against its step-by-step CPU emulation
//! (`hzp_runtime::cpu::pasa`), on the paper's overflow-prone inputs (queries and keys with a
//! large bias and amplitude) and on benign ones; and the same kernel with `beta = 0` (no
//! shift: plain fp16 flash attention, the same roundings) overflowing where PASA does not.
//! Without a GPU it says SKIPPED, unless HZP_REQUIRE_GPU is set (the device check,
//! `examples/device/multi_rank_check.sh` PART=pasa, sets it): then it fails.

#![cfg(feature = "cuda")]

#[path = "../../tests/common/skip.rs"]
mod skip;
use cudarc::driver::{result as drv, sys, CudaContext};
use half::f16;
use hzp_runtime::cpu::pasa::{exact_f64, flash_fp16, pasa_fp16, Head, PASA_BETA, PASA_BLOCK};
use hzp_runtime::cuda::kernels::{ATTENTION_ROWS, ATTENTION_THREADS};
use hzp_runtime::cuda::probe::{probe, Lib};
use std::ffi::{c_void, CString};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, bias: f64, amp: f64) -> Vec<f16> {
        (0..n)
            .map(|_| f16::from_f64(bias + amp * self.next()))
            .collect()
    }
}

/// One attention: q [B, HQ, T, D], k and v [B, HKV, S, D].
struct Case {
    name: String,
    b: usize,
    hq: usize,
    hkv: usize,
    t: usize,
    d: usize,
    causal: bool,
    overflow: bool,
    q: Vec<f16>,
    k: Vec<f16>,
    v: Vec<f16>,
}

impl Case {
    #[allow(clippy::too_many_arguments)]
    fn new(
        seed: u64,
        b: usize,
        hq: usize,
        hkv: usize,
        t: usize,
        d: usize,
        causal: bool,
        bias: f64,
        amp: f64,
    ) -> Case {
        let mut r = Rng(seed);
        Case {
            name: format!(
                "B={b} HQ={hq} HKV={hkv} T={t} D={d} bias={bias} amp={amp} causal={causal}"
            ),
            b,
            hq,
            hkv,
            t,
            d,
            causal,
            overflow: bias > 0.0,
            q: r.vec(b * hq * t * d, bias, amp),
            k: r.vec(b * hkv * t * d, bias, amp),
            v: r.vec(b * hkv * t * d, 0.0, 1.0),
        }
    }

    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }

    /// The (batch, query head) `bh`'s operands.
    fn head(&self, bh: usize) -> Head<'_> {
        let (t, d) = (self.t, self.d);
        let (b, h) = (bh / self.hq, bh % self.hq);
        let kv = b * self.hkv + h / (self.hq / self.hkv);
        Head {
            q: &self.q[bh * t * d..(bh + 1) * t * d],
            k: &self.k[kv * t * d..(kv + 1) * t * d],
            v: &self.v[kv * t * d..(kv + 1) * t * d],
            mask: None,
            t,
            s: t,
            d,
            dv: d,
            scale: self.scale(),
            causal: self.causal,
        }
    }
}

struct Gpu {
    _ctx: std::sync::Arc<CudaContext>,
    f: sys::CUfunction,
}

/// The GPU and the kernel, or why not.
fn gpu() -> Result<Gpu, String> {
    let p = probe();
    let need = [Lib::Driver, Lib::Nvrtc];
    p.require(&need, "the PASA kernel check")?;
    p.preload(&need)?;
    let ctx = CudaContext::new(0).map_err(|e| format!("no usable GPU: {e:?}"))?;
    ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    let (major, minor) = ctx.compute_capability().map_err(|e| format!("{e:?}"))?;
    let image = hzp_runtime::cuda::compile_kernels(major, minor, "").map_err(|e| e.to_string())?;
    // SAFETY: a complete cubin from NVRTC, the context current on this thread.
    let module = unsafe { drv::module::load_data(image.as_ptr() as *const c_void) }
        .map_err(|e| format!("loading the kernels: {e:?}"))?;
    // SAFETY: the module is loaded.
    let f =
        unsafe { drv::module::get_function(module, CString::new("attn_fwd_pasa_f16").unwrap()) }
            .map_err(|e| format!("attn_fwd_pasa_f16: {e:?}"))?;
    Ok(Gpu { _ctx: ctx, f })
}

fn bits(x: &[f16]) -> Vec<u16> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Runs `attn_fwd_pasa_f16` on `c` with `beta`: output [B, HQ, T, D] and lse [B, HQ, T].
fn run(g: &Gpu, c: &Case, beta: f32) -> (Vec<f16>, Vec<f32>) {
    let (q, k, v) = (bits(&c.q), bits(&c.k), bits(&c.v));
    let n_out = c.b * c.hq * c.t * c.d;
    let n_lse = c.b * c.hq * c.t;
    let mut out = vec![0u16; n_out];
    let mut lse = vec![0f32; n_lse];
    // SAFETY: every device buffer is allocated with the size the kernel reads or writes
    // (the layouts in attention.cu), the arguments match `AT_DIM_PARAMS, float beta, q, k, v,
    // mask, o, lse`, and every buffer is freed after the synchronization.
    unsafe {
        let dq = drv::malloc_sync(q.len() * 2).unwrap();
        let dk = drv::malloc_sync(k.len() * 2).unwrap();
        let dv = drv::malloc_sync(v.len() * 2).unwrap();
        let dout = drv::malloc_sync(n_out * 2).unwrap();
        let dlse = drv::malloc_sync(n_lse * 4).unwrap();
        drv::memcpy_htod_sync(dq, &q).unwrap();
        drv::memcpy_htod_sync(dk, &k).unwrap();
        drv::memcpy_htod_sync(dv, &v).unwrap();
        let i = |x: usize| (x as i64).to_le_bytes().to_vec();
        let args: Vec<Vec<u8>> = vec![
            i(c.b),
            i(c.hq),
            i(c.hkv),
            i(c.t),
            i(c.t),
            i(c.d),
            i(c.d),
            c.scale().to_le_bytes().to_vec(),
            (c.causal as i32).to_le_bytes().to_vec(),
            i(0),
            i(0),
            i(0),
            i(0),
            beta.to_le_bytes().to_vec(),
            dq.to_le_bytes().to_vec(),
            dk.to_le_bytes().to_vec(),
            dv.to_le_bytes().to_vec(),
            0u64.to_le_bytes().to_vec(),
            dout.to_le_bytes().to_vec(),
            dlse.to_le_bytes().to_vec(),
        ];
        let mut store: Vec<[u64; 1]> = args
            .iter()
            .map(|b| {
                let mut w = [0u8; 8];
                w[..b.len()].copy_from_slice(b);
                [u64::from_le_bytes(w)]
            })
            .collect();
        let mut params: Vec<*mut c_void> = store
            .iter_mut()
            .map(|w| w.as_mut_ptr() as *mut c_void)
            .collect();
        let blocks = (c.b * c.hq * c.t.div_ceil(ATTENTION_ROWS)) as u32;
        drv::launch_kernel(
            g.f,
            (blocks, 1, 1),
            (ATTENTION_THREADS, 1, 1),
            0,
            std::ptr::null_mut(),
            &mut params,
        )
        .unwrap();
        drv::ctx::synchronize().unwrap();
        drv::memcpy_dtoh_sync(&mut out, dout).unwrap();
        drv::memcpy_dtoh_sync(&mut lse, dlse).unwrap();
        for p in [dq, dk, dv, dout, dlse] {
            drv::free_sync(p).unwrap();
        }
    }
    (out.into_iter().map(f16::from_bits).collect(), lse)
}

/// (relative RMSE, largest error / largest |reference|, largest relative lse error); NaN
/// when `out` has a non-finite value.
fn errors(out: &[f16], lse: &[f32], ref_out: &[f64], ref_lse: &[f64]) -> (f64, f64, f64) {
    if out.iter().any(|x| !x.is_finite()) {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let n = out.len() as f64;
    let (mut se, mut sr, mut emax, mut omax) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (a, &b) in out.iter().zip(ref_out) {
        let e = a.to_f64() - b;
        se += e * e;
        sr += b * b;
        emax = emax.max(e.abs());
        omax = omax.max(b.abs());
    }
    let mut lmax = 0.0f64;
    for (&a, &b) in lse.iter().zip(ref_lse) {
        lmax = lmax.max((a as f64 - b).abs() / b.abs().max(1.0));
    }
    ((se / n).sqrt() / (sr / n).sqrt(), emax / omax, lmax)
}

#[test]
fn pasa_kernel_matches_exact_attention_where_plain_fp16_overflows() {
    let g = match gpu() {
        Ok(g) => g,
        Err(e) => {
            skip::skip(
                "pasa_kernel_matches_exact_attention_where_plain_fp16_overflows",
                skip::Missing::Gpu,
                &format!("no GPU: {e}"),
            );
            return;
        }
    };
    let cases = [
        Case::new(1, 1, 2, 2, 64, 128, false, 30.0, 1.0),
        Case::new(2, 2, 4, 1, 300, 128, false, 25.0, 2.0),
        Case::new(3, 1, 2, 1, 300, 64, true, 50.0, 0.5),
        Case::new(4, 1, 1, 1, 97, 128, true, 24.0, 1.0),
        Case::new(5, 2, 2, 2, 77, 64, true, 0.0, 1.5),
        Case::new(6, 1, 1, 1, 33, 5, false, 0.0, 1.5),
    ];
    let mut failures = Vec::new();
    for c in &cases {
        let heads = c.b * c.hq;
        let (mut ex_o, mut ex_l, mut cpu_o, mut cpu_plain) = (vec![], vec![], vec![], vec![]);
        for bh in 0..heads {
            let h = c.head(bh);
            let (o, l) = exact_f64(&h).unwrap();
            ex_o.extend(o);
            ex_l.extend(l);
            cpu_o.extend(pasa_fp16(&h, PASA_BLOCK, PASA_BETA, true).unwrap().out);
            cpu_plain.extend(flash_fp16(&h, PASA_BLOCK).unwrap().out);
        }
        let (o, l) = run(&g, c, PASA_BETA);
        let e = errors(&o, &l, &ex_o, &ex_l);
        // the kernel against its CPU emulation (the same roundings; dot products summed in
        // another order, so not always the same bits)
        let cpu_f64: Vec<f64> = cpu_o.iter().map(|x| x.to_f64()).collect();
        let vs_cpu = errors(&o, &l, &cpu_f64, &ex_l);
        let (plain, _) = run(&g, c, 0.0);
        let plain_bad = plain.iter().filter(|x| !x.is_finite()).count();
        let cpu_plain_bad = cpu_plain.iter().filter(|x| !x.is_finite()).count();
        println!(
            "RESULT pasa {}: PASA vs f64 rel RMSE {:.2e} max {:.2e} lse {:.2e}; vs CPU emulation rel RMSE {:.2e} max {:.2e}; beta=0 (plain fp16) non-finite {plain_bad} of {} (CPU emulation {cpu_plain_bad})",
            c.name, e.0, e.1, e.2, vs_cpu.0, vs_cpu.1, plain.len()
        );
        if !(e.0 <= 1e-2 && e.1 <= 3e-2 && e.2 <= 1e-3) {
            failures.push(format!("{}: PASA errors {e:?}", c.name));
        }
        if !(vs_cpu.0 <= 2e-3 && vs_cpu.1 <= 1e-2) {
            failures.push(format!("{}: PASA vs its CPU emulation {vs_cpu:?}", c.name));
        }
        if c.overflow && plain_bad == 0 {
            failures.push(format!("{}: plain fp16 (beta 0) stayed finite", c.name));
        }
        if !c.overflow {
            let p = errors(&plain, &l, &ex_o, &ex_l);
            if !(p.0 <= 1e-2 && p.1 <= 3e-2) {
                failures.push(format!("{}: plain fp16 on benign inputs {p:?}", c.name));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
