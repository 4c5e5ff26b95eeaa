//! The skip registry. libtest captures what a passing test prints, so a test that skips (a
//! tool, a library or a fixture this machine lacks) says so through [`skip`]: it appends
//! `<test binary>::<test>: <reason>` to `<target dir>/hzp-skips/skips.txt`, which `.ci/run`
//! (and anyone after `cargo test`) prints. Where the environment variable `CI` is set, a
//! missing thing that CI provides itself ([`Missing::ci_provides`]) fails the test instead.
//!
//! One file, included by each crate's test helpers (`#[path]`), so every crate's tests
//! register their skips the same way.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};

/// What a skipping test lacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Missing {
    /// ONNX's generated node cases (`HZP_ONNX_NODE_CASES`; `.ci/run` installs `onnx` and
    /// generates them).
    OnnxCases,
    /// libnvrtc (`.ci/run` pip-installs it).
    Nvrtc,
    /// A C++ compiler (`.ci/run` installs one when missing).
    Cxx,
    /// `../shared` beside the checkout (`.ci/run` refuses to run without it).
    Shared,
    /// A GPU and its libraries: a failure where `HZP_REQUIRE_GPU` is set (the device
    /// check sets it, so a CUDA leg that cannot run there is not a silent skip).
    Gpu,
    /// Anything else: root, a system tool, a CPU feature, an optional file.
    Other,
}

impl Missing {
    /// Whether CI provides this itself, so that lacking it there is a failure.
    pub fn ci_provides(self) -> bool {
        !matches!(self, Missing::Other | Missing::Gpu)
    }
}

/// The folder the registry lives in: `HZP_SKIPS_DIR` when set, else `<target dir>/hzp-skips`.
/// The target directory is the nearest folder above the test executable holding cargo's
/// `CACHEDIR.TAG`, else `CARGO_TARGET_DIR`, else the workspace's `target`.
pub fn registry_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("HZP_SKIPS_DIR") {
        return PathBuf::from(d);
    }
    let from_exe = std::env::current_exe().ok().and_then(|exe| {
        exe.ancestors()
            .skip(1)
            .find(|d| d.join("CACHEDIR.TAG").is_file())
            .map(Path::to_path_buf)
    });
    let target = from_exe
        .or_else(|| {
            std::env::var_os("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .filter(|p| p.is_absolute())
        })
        .unwrap_or_else(|| {
            let here = Path::new(env!("CARGO_MANIFEST_DIR"));
            let ws = here
                .ancestors()
                .find(|d| d.join("Cargo.lock").is_file())
                .unwrap_or(here);
            ws.join("target")
        });
    target.join("hzp-skips")
}

/// The registry file.
pub fn registry_file() -> PathBuf {
    registry_dir().join("skips.txt")
}

/// The test binary's name (`onnx_import` for `target/debug/deps/onnx_import-0123abcd`).
fn binary_name() -> String {
    let exe = std::env::current_exe().unwrap_or_default();
    let stem = exe
        .file_stem()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_default();
    match stem.rsplit_once('-') {
        Some((name, hash)) if hash.chars().all(|c| c.is_ascii_hexdigit()) => name.to_string(),
        _ => stem,
    }
}

/// The line [`skip`] records. An empty `test` (a helper shared by several tests) is the
/// running test's name, which libtest gives its thread.
pub fn entry(test: &str, reason: &str) -> String {
    let reason = reason.replace('\n', " ");
    let current = std::thread::current();
    let test = match (test, current.name()) {
        ("", Some(name)) => name,
        ("", None) => "(unnamed test)",
        (t, _) => t,
    };
    format!("{}::{test}: {reason}", binary_name())
}

/// Records that `test` (or, when empty, the running test) skipped (all or part of its checks) because it lacks `missing`,
/// `reason` saying what and how to provide it. Panics instead where `CI` is set and CI
/// provides `missing` itself.
pub fn skip(test: &str, missing: Missing, reason: &str) {
    if missing == Missing::Gpu && std::env::var_os("HZP_REQUIRE_GPU").is_some() {
        panic!("{test}: {reason} (HZP_REQUIRE_GPU is set: this must not skip)");
    }
    if missing.ci_provides() && std::env::var_os("CI").is_some() {
        panic!(
            "{test}: {reason} (CI is set, and CI provides {missing:?} itself: this must not skip)"
        );
    }
    let line = entry(test, reason);
    eprintln!("SKIPPED {line}");
    let dir = registry_dir();
    let written = std::fs::create_dir_all(&dir).and_then(|_| {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("skips.txt"))?;
        // one write of the whole line: appends from parallel tests do not interleave
        f.write_all(format!("{line}\n").as_bytes())
    });
    if let Err(e) = written {
        panic!(
            "could not record the skip `{line}` in {}: {e}",
            dir.display()
        );
    }
}

/// The C++ compiler (`CXX`, else `c++`) when it runs; otherwise records that `test` skipped
/// `what` for want of one (a failure where `CI` is set) and gives `None`.
pub fn cxx_compiler(test: &str, what: &str) -> Option<String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let runs = std::process::Command::new(&cxx)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if runs {
        return Some(cxx);
    }
    skip(
        test,
        Missing::Cxx,
        &format!("no C++ compiler `{cxx}` (set CXX) to {what}"),
    );
    None
}
