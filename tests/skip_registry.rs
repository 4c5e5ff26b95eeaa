//! The skip registry (`tests/common/skip.rs`): a skip is recorded as one line in the
//! registry file, and where `CI` is set a skip of something CI provides fails the test. Each
//! case runs this test binary again as a child (with its own `HZP_SKIPS_DIR`, so the real
//! registry is left alone) and reads what the child did.

#[path = "common/skip.rs"]
mod skip;
use skip::Missing;
use std::process::Command;

/// Runs the test `child` of this binary with `HZP_SKIP_CHILD` set and `env`; returns (exit
/// success, stderr, the registry file's text).
fn run_child(child: &str, env: &[(&str, &str)]) -> (bool, String, String) {
    let dir = std::env::temp_dir().join(format!(
        "hzp-skip-registry-{}-{child}-{}",
        std::process::id(),
        env.len()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", child, "--nocapture", "--test-threads=1"])
        .env("HZP_SKIP_CHILD", "1")
        .env("HZP_SKIPS_DIR", &dir)
        .env_remove("CI");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text = std::fs::read_to_string(dir.join("skips.txt")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string(),
        text,
    )
}

/// The child: skips twice, for a GPU (never provided by CI) and a C++ compiler (provided).
#[test]
fn child_that_skips() {
    if std::env::var_os("HZP_SKIP_CHILD").is_none() {
        return;
    }
    // an empty name is the running test's (libtest names the thread after it)
    skip::skip("", Missing::Other, "no GPU\nhere");
    skip::skip("child_that_skips", Missing::Cxx, "no C++ compiler `c++`");
}

#[test]
fn skips_are_recorded_and_fail_under_ci_when_ci_provides_the_thing() {
    // without CI: both skips recorded, one line each, named by binary and test
    let (ok, err, text) = run_child("child_that_skips", &[]);
    assert!(ok, "{err}");
    assert_eq!(
        text,
        "skip_registry::child_that_skips: no GPU here\n\
         skip_registry::child_that_skips: no C++ compiler `c++`\n"
    );
    // with CI: the GPU's skip is recorded, the C++ compiler's fails the test
    let (ok, err, text) = run_child("child_that_skips", &[("CI", "1")]);
    assert!(!ok, "a skip of the C++ compiler passed under CI: {err}");
    assert!(err.contains("CI provides Cxx itself"), "{err}");
    assert_eq!(text, "skip_registry::child_that_skips: no GPU here\n");
    assert!(!Missing::Other.ci_provides());
    for m in [
        Missing::OnnxCases,
        Missing::Nvrtc,
        Missing::Cxx,
        Missing::Shared,
    ] {
        assert!(m.ci_provides(), "{m:?}");
    }
}
