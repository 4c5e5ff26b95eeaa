//! Library probing: what the CUDA backend reports before it touches cudarc (which panics on
//! a missing library).

#[path = "../../tests/common/skip.rs"]
mod skip;
use hzp_runtime::cuda::probe::{probe, probe_in, Lib, LibState};

fn tempdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("hzp-probe-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn missing_libraries_are_named_with_the_places_searched() {
    let empty = tempdir("empty");
    let p = probe_in(vec![empty.clone()], false);
    assert_eq!(p.missing(), Lib::ALL.to_vec());
    let e = p
        .require(&[Lib::Driver, Lib::Nccl], "hzp run --backend cuda")
        .unwrap_err();
    let first = e.lines().next().unwrap();
    assert!(
        first.starts_with(
            "hzp run --backend cuda: the CUDA driver library libcuda.so.1 was not found (searched: "
        ),
        "{e}"
    );
    assert!(
        first.ends_with("install the NVIDIA driver or set LD_LIBRARY_PATH"),
        "{e}"
    );
    assert!(first.contains(&empty.display().to_string()), "{e}");
    assert!(
        e.contains("the NCCL library libnccl.so.2 was not found"),
        "{e}"
    );
    // what is not asked for is not reported
    assert!(!e.contains("cuBLAS"), "{e}");
}

#[test]
fn a_library_outside_the_loader_path_is_found_with_its_directory() {
    let d = tempdir("found");
    std::fs::write(d.join("libnccl.so.2"), b"not really a library").unwrap();
    std::fs::write(d.join("libcublasLt.so.12"), b"x").unwrap();
    let p = probe_in(vec![d.clone()], false);
    assert_eq!(
        p.state(Lib::Nccl),
        &LibState::Found {
            path: d.join("libnccl.so.2")
        }
    );
    // libcublasLt is not libcublas
    assert_eq!(p.state(Lib::Cublas), &LibState::Missing);
    assert!(p.require(&[Lib::Nccl], "x").is_ok());
    assert_eq!(p.extra_dirs(), vec![d.clone()]);
    // cudarc loads NCCL as libnccl.so, so preloading cannot help: the advice says what to do
    let e = p.preload(&[Lib::Nccl]).unwrap_err();
    assert!(
        e.contains("libnccl.so") && e.contains("LD_LIBRARY_PATH"),
        "{e}"
    );
}

#[test]
fn on_a_machine_without_the_driver_the_real_probe_says_so() {
    let p = probe();
    if !matches!(p.state(Lib::Driver), LibState::Missing) {
        skip::skip(
            "on_a_machine_without_the_driver_the_real_probe_says_so",
            skip::Missing::Other,
            &format!(
                "this machine has a CUDA driver ({:?})",
                p.state(Lib::Driver)
            ),
        );
        return;
    }
    let e = p
        .require(&[Lib::Driver], "hzp run --backend cuda")
        .unwrap_err();
    assert!(
        e.contains("libcuda.so.1") && e.contains("NVIDIA driver"),
        "{e}"
    );
}

#[test]
fn cudnn_is_probed_like_the_other_libraries() {
    let empty = tempdir("cudnn-empty");
    let p = probe_in(vec![empty.clone()], false);
    assert_eq!(p.state(Lib::Cudnn), &LibState::Missing);
    let e = p.require(&[Lib::Cudnn], "cuDNN attention").unwrap_err();
    assert!(
        e.starts_with("cuDNN attention: the cuDNN library libcudnn.so.9 was not found (searched: "),
        "{e}"
    );
    assert!(e.contains(&empty.display().to_string()), "{e}");
    assert!(e.contains("nvidia-cudnn-cu12"), "{e}");
    // found outside the loader's path (pip's nvidia/cudnn/lib), its parts beside it
    let d = tempdir("cudnn-found");
    std::fs::write(d.join("libcudnn_graph.so.9"), b"x").unwrap();
    std::fs::write(d.join("libcudnn.so.9"), b"x").unwrap();
    let p = probe_in(vec![d.clone()], false);
    assert_eq!(
        p.state(Lib::Cudnn),
        &LibState::Found {
            path: d.join("libcudnn.so.9")
        }
    );
    assert!(p.require(&[Lib::Cudnn], "x").is_ok());
    // the fake file is no library: preloading it says which file failed to load
    let e = p.preload(&[Lib::Cudnn]).unwrap_err();
    assert!(e.contains("libcudnn"), "{e}");
}
