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
    // No CLI run may end in a panic (Rust's exit code 101; issue 19).
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

#[test]
fn launch_refuses_a_cpu_run_which_would_run_the_whole_plan_in_every_process() {
    for args in [
        vec!["run", "plan.json", "--inputs", "b.npz"],
        vec!["run", "plan.json", "--backend", "cpu"],
        vec!["run", "plan.json", "--backend=cpu", "--steps", "2"],
    ] {
        let mut all = vec!["launch", "--nproc-per-node", "2", "--"];
        all.extend(&args);
        let (code, out, err) = hzp(&all);
        assert_eq!(code, 1, "{all:?}: {err}");
        assert!(
            err.contains("runs every rank of the plan as threads of one process")
                && err.contains("without `hzp launch`"),
            "{all:?}: {err}"
        );
        // refused before any process started
        assert!(!out.contains("[rank ") && !err.contains("[rank "), "{err}");
    }
    // --backend cuda passes the check (and fails in the ranks: no such plan)
    let (code, _, err) = hzp(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--",
        "run",
        "no-such-plan.json",
        "--backend",
        "cuda",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("[rank ") && err.contains("no-such-plan.json"),
        "{err}"
    );
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
fn a_cpu_run_started_as_one_of_several_processes_is_refused() {
    let run = ["run", "no-such-plan.json", "--steps", "1"];
    for env in [
        vec![("RANK", "1"), ("WORLD_SIZE", "2")],
        vec![("SLURM_STEP_NUM_TASKS", "4"), ("SLURM_PROCID", "3")],
        vec![("OMPI_COMM_WORLD_SIZE", "8")],
    ] {
        let (code, err) = hzp_env(&run, &env);
        assert_eq!(code, 1, "{env:?}: {err}");
        assert!(
            err.contains("CPU backend runs every rank of the plan as threads of this one process")
                && err.contains("without a launcher"),
            "{env:?}: {err}"
        );
        assert!(!err.contains("no-such-plan.json"), "{env:?}: {err}");
    }
    // one process of one (or no launcher at all) runs: it gets as far as reading the plan
    for env in [vec![("RANK", "0"), ("WORLD_SIZE", "1")], vec![]] {
        let (code, err) = hzp_env(&run, &env);
        assert_eq!(code, 1, "{env:?}: {err}");
        assert!(err.contains("no-such-plan.json"), "{env:?}: {err}");
    }
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
            for (nw, node) in low.nodes.iter().zip(&plan.program.nodes) {
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
                let silent = matches!(node.op, hzp_ir::Op::Free) || empty || in_place;
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
