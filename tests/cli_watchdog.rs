//! `hzp run` with injected faults (`HZP_FAULT`) and a short `--collective-timeout`: every
//! fault ends the process with a non-zero exit code well within the timeout plus its grace
//! period, the error names the rank and the collective, and `--flight-recorder DIR` holds one
//! JSON record per rank. Bad `HZP_FAULT` and `--collective-timeout` values are usage errors.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hzp-cli-wd-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs hzp with `HZP_FAULT=fault` (if any); kills it and fails after `limit`.
fn hzp(args: &[&str], fault: Option<&str>, limit: Duration) -> (i32, String, String, Duration) {
    let mut cmd = Command::new(hzp_bin());
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    match fault {
        Some(f) => cmd.env("HZP_FAULT", f),
        None => cmd.env_remove("HZP_FAULT"),
    };
    let t0 = Instant::now();
    let mut child = cmd.spawn().unwrap();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "hzp {args:?} with HZP_FAULT={fault:?} hung for {limit:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = t0.elapsed();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let flat: Vec<&str> = err.split_whitespace().filter(|w| *w != "│").collect();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        flat.join(" "),
        took,
    )
}

/// gpt2_tiny compiled for gpu=2 with `strategy`.
fn plan(dir: &Path, strategy: &str) -> PathBuf {
    let models = own_models_dir();
    let plan = dir.join("plan.json");
    let (code, _, err, _) = hzp(
        &[
            "compile",
            s(&models.join("gpt2_tiny.legacy.op17.onnx")),
            "--inputs",
            s(&models.join("gpt2_tiny.io.npz")),
            "--mesh",
            "gpu=2",
            "--strategy",
            strategy,
            "-o",
            s(&plan),
        ],
        None,
        Duration::from_secs(120),
    );
    assert_eq!(code, 0, "{err}");
    plan
}

fn run_args<'a>(plan: &'a Path, io: &'a Path, fr: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![
        "run",
        s(plan),
        "--inputs",
        s(io),
        "--steps",
        "3",
        "--collective-timeout",
        "2s",
        "--flight-recorder",
        s(fr),
    ];
    v.extend_from_slice(extra);
    v
}

fn record(dir: &Path, rank: usize) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join(format!("rank-{rank}.json")))
        .unwrap_or_else(|e| panic!("rank {rank}'s flight record: {e}"));
    serde_json::from_str(&text).unwrap()
}

/// Timeout 2 s + the grace period (2 s) + start-up: a run that takes longer hung.
const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn every_fault_ends_the_run_naming_the_rank_and_collective() {
    let d = tempdir("faults");
    let io = own_models_dir().join("gpt2_tiny.io.npz");
    let plan = plan(&d, "zero3");

    // healthy: exit 0, no record written
    let fr = d.join("fr-none");
    let (code, _, err, _) = hzp(&run_args(&plan, &io, &fr, &[]), None, LIMIT);
    assert_eq!(code, 0, "{err}");
    assert!(!fr.exists(), "a healthy run wrote a flight record");

    for comm in ["async", "sync"] {
        // panic: the executor catches it, stops the others, reports it
        let fr = d.join(format!("fr-panic-{comm}"));
        let (code, _, err, took) = hzp(
            &run_args(&plan, &io, &fr, &["--comm", comm]),
            Some("rank:1,step:2,kind:panic"),
            LIMIT,
        );
        assert_eq!(code, 1, "{err}");
        assert!(took < Duration::from_secs(30), "{took:?}");
        assert!(err.contains("rank 1's compute thread panicked"), "{err}");
        assert!(err.contains("flight recorder: the last"), "{err}");
        let r1 = record(&fr, 1);
        assert_eq!(r1["rank"], 1);
        assert_eq!(r1["world"], 2);
        assert!(r1["error"].as_str().unwrap().contains("panicked"), "{r1}");
        let r0 = record(&fr, 0);
        assert!(r0["error"].is_null(), "{r0}");
        let colls = r0["collectives"].as_array().unwrap();
        assert!(!colls.is_empty());
        for c in colls {
            for key in ["node", "op", "group", "members", "bytes", "state", "step"] {
                assert!(!c[key].is_null(), "{key} missing in {c}");
            }
            assert!(c["bytes"].as_u64().unwrap() > 0);
            assert_eq!(c["members"], serde_json::json!([0, 1]));
        }
        // step 1 completed every collective it issued
        assert!(colls
            .iter()
            .filter(|c| c["step"] == 1)
            .all(|c| c["state"] == "completed"));

        // a skipped collective: rank 1's next call on the communicator is another one (or
        // nothing): a mismatch or a timeout, both naming rank 1
        let fr = d.join(format!("fr-skip-{comm}"));
        let (code, _, err, took) = hzp(
            &run_args(&plan, &io, &fr, &["--comm", comm]),
            Some("rank:1,step:2,kind:skip-collective"),
            LIMIT,
        );
        assert_ne!(code, 0, "{err}");
        assert!(took < Duration::from_secs(30), "{took:?}");
        assert!(
            (err.contains("collective mismatch") && err.contains("on rank 1"))
                || err.contains("not issued by rank 1"),
            "{err}"
        );
        let r0 = record(&fr, 0);
        let last_failed = r0["collectives"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["state"] != "completed")
            .map(|c| c["node"].as_str().unwrap().to_string())
            .collect::<Vec<_>>();
        assert!(!last_failed.is_empty(), "{r0}");
        assert!(
            last_failed.iter().any(|n| err.contains(&format!("`{n}`"))),
            "{last_failed:?} not named in {err}"
        );

        // wrong bytes: refused by every member, naming both ranks' byte counts
        let fr = d.join(format!("fr-bytes-{comm}"));
        let (code, _, err, _) = hzp(
            &run_args(&plan, &io, &fr, &["--comm", comm]),
            Some("rank:1,step:2,kind:wrong-bytes"),
            LIMIT,
        );
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("collective mismatch"), "{err}");
        assert!(err.contains("on rank 0 but"), "{err}");
        assert!(err.contains("on rank 1"), "{err}");
        assert!(err.contains("step 2, rank"), "{err}");
        let r1 = record(&fr, 1);
        assert!(r1["collectives"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["state"] == "failed" && c["step"] == 2));
    }
}

#[test]
fn a_hung_rank_is_reported_and_the_process_exits() {
    let d = tempdir("hang");
    let io = own_models_dir().join("gpt2_tiny.io.npz");
    let plan = plan(&d, "zero3");
    for comm in ["async", "sync"] {
        let fr = d.join(format!("fr-{comm}"));
        let (code, _, err, took) = hzp(
            &run_args(&plan, &io, &fr, &["--comm", comm]),
            Some("rank:1,step:2,kind:hang"),
            LIMIT,
        );
        // the hung thread ignores the abort: the watchdog ends the process
        assert_eq!(code, 3, "{err}");
        assert!(took >= Duration::from_secs(2), "{took:?}");
        assert!(took < Duration::from_secs(30), "{took:?}");
        assert!(err.contains("collective timeout (2.0 s)"), "{err}");
        assert!(err.contains("not issued by rank 1"), "{err}");
        assert!(
            err.contains("rank 1's compute thread is stuck at the start of step 2"),
            "{err}"
        );
        assert!(err.contains("did not stop within"), "{err}");
        let r0 = record(&fr, 0);
        let r1 = record(&fr, 1);
        assert!(r0["reason"]
            .as_str()
            .unwrap()
            .contains("not issued by rank 1"));
        assert_eq!(r0["reason"], r1["reason"]);
        // rank 0 waits in a collective of step 2 that rank 1 never issued
        let waiting: Vec<&serde_json::Value> = r0["collectives"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["step"] == 2 && c["state"] != "completed")
            .collect();
        assert!(!waiting.is_empty(), "{r0}");
        for w in waiting {
            assert!(!r1["collectives"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["step"] == 2 && c["node"] == w["node"] && c["state"] == "completed"));
        }
    }
}

#[test]
fn bad_fault_and_timeout_values_are_refused() {
    let d = tempdir("bad");
    let io = own_models_dir().join("gpt2_tiny.io.npz");
    let plan = plan(&d, "ddp");
    let fr = d.join("fr");
    for (fault, want) in [
        ("rank:1,step:2,kind:explode", "kind `explode`"),
        ("rank:1,kind:panic", "step:S is missing"),
        (
            "rank:5,step:1,kind:panic",
            "names rank 5, the plan has 2 ranks",
        ),
    ] {
        let (code, _, err, _) = hzp(&run_args(&plan, &io, &fr, &[]), Some(fault), LIMIT);
        assert_eq!(code, 1, "{fault}: {err}");
        assert!(err.contains(want), "{fault}: {err}");
    }
    for bad in ["0", "0ms", "soon", "5x"] {
        let mut args = run_args(&plan, &io, &fr, &[]);
        let at = args.iter().position(|a| *a == "2s").unwrap();
        args[at] = bad;
        let (code, _, err, _) = hzp(&args, None, LIMIT);
        assert_eq!(code, 1, "{bad}: {err}");
        assert!(err.contains("--collective-timeout"), "{bad}: {err}");
    }
    assert!(!fr.exists());
}
