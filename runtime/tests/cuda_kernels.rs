//! With the `cuda` feature: the kernel sources compile with NVRTC (when libnvrtc is found:
//! on the loader's path, under CUDA_HOME or in pip's nvidia-cuda-nvrtc-cu12), for the
//! architectures hzp targets. Reports clearly when skipped.
#![cfg(feature = "cuda")]

#[path = "../../tests/common/skip.rs"]
mod skip;
use hzp_runtime::cuda::probe::{probe, Lib, LibState};

/// Loads libnvrtc; when it is missing, records `test` as skipped (a failure where CI's
/// `HZP_REQUIRE_NVRTC` is set) and gives false.
fn nvrtc_or_skip(test: &str) -> bool {
    let p = probe();
    if *p.state(Lib::Nvrtc) == LibState::Missing {
        // CI installs NVRTC and sets HZP_REQUIRE_NVRTC: there a missing library fails
        assert!(
            std::env::var_os("HZP_REQUIRE_NVRTC").is_none(),
            "HZP_REQUIRE_NVRTC is set but libnvrtc.so.12 was not found (searched {:?})",
            p.searched
        );
        skip::skip(
            test,
            skip::Missing::Nvrtc,
            &format!(
                "libnvrtc.so.12 not found (searched {:?}); `pip install nvidia-cuda-nvrtc-cu12` \
                 into a venv and set VIRTUAL_ENV to run this test",
                p.searched
            ),
        );
        return false;
    }
    p.preload(&[Lib::Nvrtc]).unwrap();
    true
}

#[test]
fn every_kernel_compiles_with_nvrtc() {
    if !nvrtc_or_skip("every_kernel_compiles_with_nvrtc") {
        return;
    }
    // Ampere and Hopper, to PTX (no driver needed to compile)
    for arch in ["compute_80", "compute_90"] {
        let ptx = hzp_runtime::cuda::compile(&format!("--gpu-architecture={arch}"), false, "")
            .unwrap_or_else(|e| panic!("{arch}: {e}"));
        let text = String::from_utf8_lossy(&ptx);
        let names = hzp_runtime::cuda::kernels::kernel_names();
        for k in &names {
            assert!(
                text.contains(&format!(".entry {k}(")),
                "{arch}: no kernel {k}"
            );
        }
        // and nothing else: the list is exactly what the sources define
        assert_eq!(text.matches(".entry ").count(), names.len(), "{arch}");
    }
}

/// Every kernel is compiled without contracting `a * b + c` (`--fmad=false`), as the CPU
/// backend and the kernels' C++ emulation compute it: a probe kernel's PTX has a separate
/// multiply and add, no `fma`.
#[test]
fn kernels_round_products_and_sums_apart() {
    if !nvrtc_or_skip("kernels_round_products_and_sums_apart") {
        return;
    }
    let probe_src =
        "extern \"C\" __global__ void probe_fmad(float* a) { a[0] = a[1] * a[2] + a[3]; }";
    let ptx = hzp_runtime::cuda::compile("--gpu-architecture=compute_80", false, probe_src)
        .unwrap_or_else(|e| panic!("{e}"));
    let text = String::from_utf8_lossy(&ptx);
    let start = text.find(".entry probe_fmad(").expect("the probe kernel");
    let body = &text[start..];
    let body = &body[..body.find("\n}").map_or(body.len(), |e| e + 2)];
    assert!(
        body.contains("mul.rn.f32") || body.contains("mul.f32"),
        "{body}"
    );
    assert!(!body.contains("fma."), "a contracted multiply-add:\n{body}");
}
