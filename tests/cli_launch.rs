//! `hzp launch` (processes, rank-prefixed output, exit status) and the CUDA backend's
//! lowering of compiled plans (every node of real plans maps to kernels that exist in the
//! NVRTC sources), both without a GPU.

use std::process::Command;

fn hzp(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hzp"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    // No CLI run may end in a panic (Rust's exit code 101).
    assert_ne!(
        out.status.code(),
        Some(101),
        "hzp {args:?} panicked: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn launch_runs_one_process_per_rank_and_prefixes_their_output() {
    let (code, out, err) = hzp(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--",
        "show",
        "examples/models/mlp.hzp",
    ]);
    assert_eq!(code, 0, "{err}");
    let (_, alone, _) = hzp(&["show", "examples/models/mlp.hzp"]);
    for r in 0..2 {
        let prefix = format!("[rank {r}] ");
        let mine: Vec<&str> = out
            .lines()
            .filter_map(|l| l.strip_prefix(prefix.as_str()))
            .collect();
        assert_eq!(mine, alone.lines().collect::<Vec<_>>(), "rank {r}:\n{out}");
    }
    assert!(out.lines().all(|l| l.starts_with("[rank ")), "{out}");
}

#[test]
fn launch_exits_with_the_first_failure_and_names_the_rank() {
    let (code, _, err) = hzp(&[
        "launch",
        "--nproc-per-node",
        "3",
        "--",
        "show",
        "no-such-model.hzp",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("hzp launch: rank "), "{err}");
    assert!(err.contains("exited with status 1"), "{err}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("[rank ") && l.contains("no-such-model.hzp")),
        "{err}"
    );
}

#[test]
fn launch_checks_its_flags() {
    for (args, word) in [
        (
            vec!["launch", "--nproc-per-node", "0", "--", "show", "x"],
            "--nproc-per-node",
        ),
        (
            vec![
                "launch",
                "--nproc-per-node",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "--",
                "show",
                "x",
            ],
            "--node-rank",
        ),
        (
            vec!["launch", "--nproc-per-node", "1", "--", "launch"],
            "itself",
        ),
        (
            vec!["launch", "--nproc-per-node", "1025", "--", "show", "x"],
            "at most 1024",
        ),
        (
            vec![
                "launch",
                "--nproc-per-node",
                "1",
                "--nnodes",
                "2000000",
                "--",
                "show",
                "x",
            ],
            "--nnodes 2000000",
        ),
        (
            vec![
                "launch",
                "--nproc-per-node",
                "1024",
                "--nnodes",
                "1025",
                "--",
                "show",
                "x",
            ],
            "more than 1048576 ranks",
        ),
    ] {
        let (code, _, err) = hzp(&args);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.contains(word), "{args:?}: {err}");
    }
    // the largest world is accepted (it fails later, on the missing model, in every rank;
    // one process per node keeps this cheap)
    let (code, _, err) = hzp(&[
        "launch",
        "--nproc-per-node",
        "1",
        "--nnodes",
        "1048576",
        "--node-rank",
        "1048575",
        "--master-port",
        "29500",
        "--",
        "show",
        "no-such-model.hzp",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no-such-model.hzp"), "{err}");
}

/// `hzp` with extra environment variables.
fn hzp_env(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hzp"))
        .args(args)
        // what this test process may have inherited from a launcher of its own
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("SLURM_STEP_NUM_TASKS")
        .env_remove("OMPI_COMM_WORLD_SIZE")
        .env_remove("PMI_SIZE")
        .envs(env.iter().copied())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_cpu_run_reads_the_launchers_variables_and_says_what_is_missing() {
    let run = ["run", "no-such-plan.json", "--steps", "1"];
    // torchrun's, srun's or no launcher's: it gets as far as reading the plan
    for env in [
        vec![("RANK", "1"), ("WORLD_SIZE", "2")],
        vec![
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_PROCID", "3"),
            ("SLURM_STEP_NODELIST", "node[01-02]"),
        ],
        vec![("RANK", "0"), ("WORLD_SIZE", "1")],
        vec![],
    ] {
        let (code, err) = hzp_env(&run, &env);
        assert_eq!(code, 1, "{env:?}: {err}");
        assert!(err.contains("no-such-plan.json"), "{env:?}: {err}");
    }
    for (env, words) in [
        (
            vec![("OMPI_COMM_WORLD_SIZE", "8")],
            vec!["mpirun", "RANK, WORLD_SIZE"],
        ),
        (
            vec![("SLURM_STEP_NUM_TASKS", "2"), ("SLURM_PROCID", "0")],
            vec!["MASTER_ADDR", "SLURM_STEP_NODELIST"],
        ),
        (
            vec![("SLURM_STEP_NUM_TASKS", "2"), ("SLURM_PROCID", "2")],
            vec!["SLURM_PROCID=2 is not below SLURM_STEP_NUM_TASKS=2"],
        ),
        (vec![("RANK", "x"), ("WORLD_SIZE", "2")], vec!["RANK=\"x\""]),
    ] {
        let (code, err) = hzp_env(&run, &env);
        assert_eq!(code, 1, "{env:?}: {err}");
        for w in words {
            assert!(err.contains(w), "{env:?}: `{w}` in {err}");
        }
        assert!(!err.contains("no-such-plan.json"), "{env:?}: {err}");
    }
}

fn free_port() -> String {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    l.local_addr().unwrap().port().to_string()
}

/// Two `hzp run` processes with the environment `env(rank)`, as a launcher starts them;
/// returns rank 0's stdout (both must succeed).
fn two_processes(args: &[String], env: &dyn Fn(usize) -> Vec<(String, String)>) -> String {
    let children: Vec<_> = (0..2)
        .map(|r| {
            Command::new(env!("CARGO_BIN_EXE_hzp"))
                .args(args)
                .env_remove("RANK")
                .env_remove("WORLD_SIZE")
                .env_remove("MASTER_PORT")
                .env_remove("MASTER_ADDR")
                .env_remove("SLURM_PROCID")
                .env_remove("SLURM_STEP_NUM_TASKS")
                .envs(env(r))
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for (r, o) in outs.iter().enumerate() {
        assert!(
            o.status.success(),
            "rank {r}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    assert!(outs[1].stdout.is_empty(), "rank 1 printed: {:?}", outs[1]);
    String::from_utf8_lossy(&outs[0].stdout).into_owned()
}

fn losses(json: &str) -> Vec<f64> {
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"));
    v["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// Every parameter of an .npz, as bits.
fn param_bits(p: &std::path::Path) -> Vec<(String, Vec<u32>)> {
    let mut v: Vec<(String, Vec<u32>)> = hzp_frontends::npz::read(p)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.to_f32_vec().iter().map(|x| x.to_bits()).collect()))
        .collect();
    v.sort();
    v
}

/// The CPU backend as one process per rank: under `hzp launch`, and as torchrun and srun
/// start it (their variables set by hand), a 2-rank plan gives the losses and the trained
/// parameters of the threaded run bit for bit; with checkpoints written by both processes
/// and `--resume` (srun) as well; a launcher's world that is not the plan's is an error.
#[test]
fn cpu_runs_as_one_process_per_rank_equal_the_threaded_run() {
    let d = tempdir().join("procs");
    std::fs::create_dir_all(&d).unwrap();
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let model = repo.join("tests/models/gpt2_tiny.legacy.op17.onnx");
    let io = repo.join("tests/models/gpt2_tiny.io.npz");
    let plan = d.join("plan.json");
    let s = |p: &std::path::Path| p.display().to_string();
    let (code, _, err) = hzp(&[
        "compile",
        &s(&model),
        "--inputs",
        &s(&io),
        "--mesh",
        "gpu=2",
        "-o",
        &s(&plan),
    ]);
    assert_eq!(code, 0, "{err}");
    let run = |save: &str, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "run",
            &s(&plan),
            "--inputs",
            &s(&io),
            "--steps",
            "3",
            "--lr",
            "0.01",
            "--format",
            "json",
            "--save-params",
            &s(&d.join(save)),
        ]
        .iter()
        .map(|x| x.to_string())
        .collect();
        a.extend(extra.iter().map(|x| x.to_string()));
        a
    };
    // the threaded run
    let (code, out, err) = hzp(&run("threads.npz", &[])
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>());
    assert_eq!(code, 0, "{err}");
    let want = losses(&out);
    assert_eq!(want.len(), 3);
    let want_params = param_bits(&d.join("threads.npz"));

    // hzp launch: rank 0's report, prefixed
    let mut a = vec![
        "launch".to_string(),
        "--nproc-per-node".into(),
        "2".into(),
        "--".into(),
    ];
    a.extend(run("launch.npz", &[]));
    let (code, out, err) = hzp(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains("[rank 1]"), "{out}");
    let json: String = out
        .lines()
        .filter_map(|l| l.strip_prefix("[rank 0] "))
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(losses(&json), want, "hzp launch");
    assert_eq!(param_bits(&d.join("launch.npz")), want_params, "hzp launch");

    // torchrun's variables
    let port = free_port();
    let out = two_processes(&run("torchrun.npz", &[]), &|r| {
        vec![
            ("RANK".into(), r.to_string()),
            ("LOCAL_RANK".into(), r.to_string()),
            ("WORLD_SIZE".into(), "2".into()),
            ("LOCAL_WORLD_SIZE".into(), "2".into()),
            ("MASTER_ADDR".into(), "127.0.0.1".into()),
            ("MASTER_PORT".into(), port.clone()),
        ]
    });
    assert_eq!(losses(&out), want, "torchrun");
    assert_eq!(param_bits(&d.join("torchrun.npz")), want_params, "torchrun");

    // srun's, stopped after step 2 with a checkpoint, then resumed to step 3
    let ck = d.join("ck");
    let port = free_port();
    let slurm = |r: usize| {
        vec![
            ("SLURM_PROCID".into(), r.to_string()),
            ("SLURM_LOCALID".into(), r.to_string()),
            ("SLURM_STEP_NUM_TASKS".into(), "2".into()),
            ("SLURM_STEP_NODELIST".into(), "localhost".into()),
            ("MASTER_PORT".into(), port.clone()),
        ]
    };
    let ckf = ["--checkpoint-dir", &s(&ck), "--checkpoint-every", "1"];
    let mut first = ckf.to_vec();
    first.extend(["--stop-at", "2"]);
    let out = two_processes(&run("srun-stopped.npz", &first), &slurm);
    assert_eq!(losses(&out), want[..2], "srun, steps 1-2");
    let (code, shown, err) = hzp(&["checkpoint", "show", &s(&ck)]);
    assert_eq!(code, 0, "{err}");
    assert!(shown.contains("step-000002"), "{shown}");
    let mut resume = ckf.to_vec();
    resume.push("--resume");
    let out = two_processes(&run("srun.npz", &resume), &slurm);
    assert_eq!(losses(&out), want[2..], "srun, resumed");
    assert_eq!(
        param_bits(&d.join("srun.npz")),
        want_params,
        "srun, resumed"
    );

    // a world that is not the plan's mesh
    let (code, err) = hzp_env(
        &run("x.npz", &[])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "3"),
            ("MASTER_PORT", &free_port()),
        ],
    );
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("started 3 processes") && err.contains("gpu=2 has 2 ranks"),
        "{err}"
    );
}

/// The processes whose parent is `pid` (from /proc), with their command lines.
#[cfg(target_os = "linux")]
fn children_of(pid: u32) -> Vec<(u32, Vec<String>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // the fields after the command name `(...)`: state, ppid, ...
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            let cmdline = std::fs::read(format!("/proc/{child}/cmdline")).unwrap_or_default();
            let args = cmdline
                .split(|&b| b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            out.push((child, args));
        }
    }
    out
}

/// A process that exists and is not a zombie.
#[cfg(target_os = "linux")]
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z")
    })
}

#[cfg(target_os = "linux")]
#[test]
fn a_signal_to_launch_is_passed_on_and_its_ranks_are_reaped() {
    use std::time::{Duration, Instant};
    // SIGTERM (15) and SIGINT (2)
    for sig in [15, 2] {
        let log = tempdir().join(format!("launch-signal-{sig}.err"));
        let mut launcher = Command::new(env!("CARGO_BIN_EXE_hzp"))
            .args([
                "launch",
                "--nproc-per-node",
                "2",
                "--",
                "train",
                "examples/models/mlp.hzp",
                "--inputs",
                "examples/models/mlp.io.npz",
                "--loss",
                "mse",
                "--target",
                "y",
                "--steps",
                "100000000",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        // wait until both ranks run `hzp train` (past exec)
        let t0 = Instant::now();
        let ranks = loop {
            let kids: Vec<u32> = children_of(launcher.id())
                .into_iter()
                .filter(|(_, a)| a.get(1).map(String::as_str) == Some("train"))
                .map(|(p, _)| p)
                .collect();
            if kids.len() == 2 {
                break kids;
            }
            if t0.elapsed() > Duration::from_secs(60) || launcher.try_wait().unwrap().is_some() {
                let _ = launcher.kill();
                panic!(
                    "the ranks did not start: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let status = Command::new("kill")
            .args([format!("-{sig}"), launcher.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let t0 = Instant::now();
        let code = loop {
            if let Some(s) = launcher.try_wait().unwrap() {
                break s.code();
            }
            if t0.elapsed() > Duration::from_secs(20) {
                let _ = launcher.kill();
                let _ = launcher.wait();
                for &r in &ranks {
                    let _ = Command::new("kill").args(["-9", &r.to_string()]).status();
                }
                panic!("hzp launch did not end within 20 s of signal {sig}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let err = std::fs::read_to_string(&log).unwrap();
        // the launcher reaped its ranks before it exited: none is left running
        let left: Vec<u32> = ranks.iter().copied().filter(|&r| alive(r)).collect();
        for &r in &left {
            let _ = Command::new("kill").args(["-9", &r.to_string()]).status();
        }
        assert!(
            left.is_empty(),
            "signal {sig}: ranks {left:?} still run:
{err}"
        );
        assert_eq!(code, Some(128 + sig), "signal {sig}: {err}");
        assert!(err.contains("hzp launch: received SIG"), "{err}");
    }
}

fn tempdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("hzp-cli-launch-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_fused_attention_plan_is_refused_by_the_cuda_lowering_naming_the_flag() {
    use hzp_runtime::cuda::lower;
    let out = tempdir().join("fused.json");
    let (code, _, err) = hzp(&[
        "compile",
        "tests/models/gpt2_tiny.dynamo.op18.onnx",
        "--shape",
        "input_ids=4x16",
        "--mesh",
        "gpu=2",
        "--memory",
        "1GiB",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let plan =
        hzp_ir::Plan::from_json(&std::fs::read_to_string(&out).unwrap(), "plan.json").unwrap();
    assert!(plan
        .program
        .nodes
        .iter()
        .any(|n| matches!(n.op, hzp_ir::Op::Attention { .. })));
    let e = match lower::lower_program(&plan, 0) {
        Ok(_) => panic!("a plan with fused attention lowered for CUDA"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("--no-fuse-attention"), "{e}");
}

#[test]
fn compiled_plans_lower_to_kernels_that_exist() {
    use hzp_runtime::cuda::{kernels, lower};
    let names = kernels::kernel_names();
    let dir = tempdir();
    for (model, shape, mesh, strategy) in [
        (
            "tests/models/gpt2_tiny.dynamo.op18.onnx",
            "input_ids=4x16",
            "gpu=2",
            "asynchzp",
        ),
        (
            "tests/models/llama_tiny.dynamo.op18.onnx",
            "input_ids=8x16",
            "node=2,gpu=2",
            "zero3",
        ),
    ] {
        let out = dir.join(format!("{strategy}.json"));
        let (code, _, err) = hzp(&[
            "compile",
            model,
            "--shape",
            shape,
            "--mesh",
            mesh,
            "--strategy",
            strategy,
            "--memory",
            "1GiB",
            // the CUDA backend has no fused attention kernel yet (checked below)
            "--no-fuse-attention",
            "-o",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{model}: {err}");
        let text = std::fs::read_to_string(&out).unwrap();
        let plan = hzp_ir::Plan::from_json(&text, "plan.json").unwrap();
        let mut n_collectives = 0;
        let (mut n_transposed, mut n_trans_gemms) = (0, 0);
        for rank in 0..plan.mesh.world_size() {
            let low = lower::lower_program(&plan, rank).unwrap_or_else(|e| panic!("{model}: {e}"));
            assert_eq!(low.nodes.len(), plan.program.nodes.len());
            // AdamW nodes of a multi-tensor group: the last launches for all of them
            let mut grouped = vec![false; plan.program.nodes.len()];
            for g in hzp_runtime::cuda::adamw_multi::groups(&plan.program, &low.loc) {
                let (&last, rest) = g.split_last().unwrap();
                assert!(matches!(
                    low.nodes[last].work.as_slice(),
                    [lower::Work::Kernel(l)] if l.kernel == "adamw_multi_f32"
                ));
                for &ni in rest {
                    grouped[ni] = true;
                }
            }
            for (ni, (nw, node)) in low.nodes.iter().zip(&plan.program.nodes).enumerate() {
                let empty = node
                    .outputs
                    .iter()
                    .all(|&v| plan.program.ty(v).numel() == 0);
                let has_work = !nw.work.is_empty();
                // a reshape or transposed operand stored in its input's bytes has nothing
                // to copy
                let offset = |v: hzp_ir::ValueId| {
                    plan.buffers.iter().find(|b| b.value == v).map(|b| b.offset)
                };
                let in_place = matches!(
                    node.op,
                    hzp_ir::Op::Reshape { .. }
                        | hzp_ir::Op::Identity
                        | hzp_ir::Op::Transpose { .. }
                ) && offset(node.inputs[0]) == offset(node.outputs[0]);
                if in_place && matches!(node.op, hzp_ir::Op::Transpose { .. }) {
                    n_transposed += 1;
                }
                let silent =
                    matches!(node.op, hzp_ir::Op::Free) || empty || in_place || grouped[ni];
                assert!(
                    has_work || silent,
                    "{model}: node `{}` ({}) lowers to nothing",
                    nw.name,
                    nw.op
                );
                for w in &nw.work {
                    match w {
                        lower::Work::Kernel(l) => {
                            assert!(
                                names.contains(&l.kernel),
                                "{model}: node `{}` launches `{}`, which the sources do not define",
                                nw.name,
                                l.kernel
                            );
                            assert!(l.grid >= 1 && l.block >= 1);
                        }
                        lower::Work::Gemm(g) => {
                            // an operand stored transposed is read through cuBLAS's flag
                            let stored_t = |k: usize| {
                                let v = node.inputs[k];
                                plan.program.producer(v).is_some_and(|t| {
                                    let tn = plan.program.node(t);
                                    matches!(tn.op, hzp_ir::Op::Transpose { .. })
                                        && offset(tn.inputs[0]) == offset(v)
                                })
                            };
                            assert_eq!((g.trans_a, g.trans_b), (stored_t(0), stored_t(1)));
                            n_trans_gemms += (g.trans_a || g.trans_b) as usize;
                        }
                        lower::Work::Collective(c) => {
                            n_collectives += 1;
                            assert!(c.comm < low.comms.len());
                            assert_eq!(low.comms[c.comm].members.len(), c.size);
                        }
                        _ => {}
                    }
                }
            }
            // every rank creates its communicators in the same (stream, group) order
            let keys: Vec<_> = low
                .comms
                .iter()
                .map(|k| (k.stream, k.axes.clone()))
                .collect();
            let mut sorted = keys.clone();
            sorted.sort();
            assert_eq!(keys, sorted);
        }
        assert!(n_collectives > 0, "{model}: a sharded plan has collectives");
        // the backward's weight and input gradients read transposed operands in place
        assert!(n_transposed > 0 && n_trans_gemms > 0, "{model}");
    }
}

#[test]
fn attention_kernel_choice_is_checked() {
    let out = tempdir().join("attn-choice.json");
    let (code, _, err) = hzp(&[
        "compile",
        "tests/models/gpt2_tiny.dynamo.op18.onnx",
        "--inputs",
        "tests/models/gpt2_tiny.io.npz",
        "--mesh",
        "gpu=1",
        "--precision",
        "fp16",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let plan = out.to_str().unwrap();
    let inputs = "tests/models/gpt2_tiny.io.npz";
    // the CPU backend has its own kernels
    let (code, _, err) = hzp(&["run", plan, "--inputs", inputs, "--attention", "pasa"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("--attention chooses the CUDA backend"),
        "{err}"
    );
    // and so is fusing elementwise kernels a CUDA choice
    let (code, _, err) = hzp(&["run", plan, "--inputs", inputs, "--fuse-elementwise"]);
    assert_ne!(code, 0);
    assert!(err.contains("--fuse-elementwise fuses the CUDA"), "{err}");
    // and CUDA graphs
    let (code, _, err) = hzp(&["run", plan, "--inputs", inputs, "--no-cuda-graph"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("--no-cuda-graph is an option of --backend cuda"),
        "{err}"
    );
    // an unknown choice, named
    let (code, _, err) = hzp(&[
        "run",
        plan,
        "--inputs",
        inputs,
        "--backend",
        "cuda",
        "--attention",
        "fast",
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("'fast'") && err.contains("--attention") && err.contains("flash, pasa"),
        "{err}"
    );
}
