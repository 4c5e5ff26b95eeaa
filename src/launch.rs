//! `hzp launch`: start one `hzp` process per GPU with the torchrun variables set, forward
//! their output prefixed by rank, and exit with the first failure (stopping the others).

use hzp_runtime::cuda::probe::{self, Lib, LibState};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Flags of `hzp launch`.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Each process gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT \
(and GROUP_RANK = the node rank), as torchrun sets them. Example:\n  \
hzp launch --nproc-per-node 8 -- run plan.json --inputs batch.npz --steps 10 --backend cuda\n\
On the CPU backend (a plan of 2 ranks): hzp launch --nproc-per-node 2 -- run plan.json --inputs batch.npz\n\
Two nodes: run `hzp launch --nproc-per-node 8 --nnodes 2 --node-rank R --master-addr HOST0 --master-port 29500 -- ...` on each."
)]
pub struct LaunchArgs {
    /// Processes to start on this node (one per GPU; on the CPU backend, one per rank).
    #[arg(long, value_name = "N")]
    pub nproc_per_node: usize,
    /// Number of nodes.
    #[arg(long, default_value_t = 1, value_name = "M")]
    pub nnodes: usize,
    /// This node's index, 0..M.
    #[arg(long, default_value_t = 0, value_name = "R")]
    pub node_rank: usize,
    /// Address of rank 0's node.
    #[arg(long, default_value = "127.0.0.1", value_name = "A")]
    pub master_addr: String,
    /// Port rank 0 listens on (default: a free port on one node, 29500 on several).
    #[arg(long, value_name = "P")]
    pub master_port: Option<u16>,
    /// The hzp command each process runs (after `--`), e.g. `run plan.json --backend cuda`.
    #[arg(last = true, required = true, value_name = "HZP ARGS")]
    pub command: Vec<String>,
}

/// Most processes one node starts (one per GPU; no node has more).
pub const MAX_NPROC_PER_NODE: usize = 1024;
/// Largest world `hzp launch` starts: the largest mesh the planner accepts.
pub const MAX_WORLD: usize = hzp_ir::Mesh::MAX_RANKS;

fn free_port() -> std::io::Result<u16> {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    Ok(l.local_addr()?.port())
}

/// Directories to prepend to the children's `LD_LIBRARY_PATH`: where CUDA libraries were
/// found outside the loader's path, and a directory with a `libnccl.so` link when NCCL is
/// installed only as `libnccl.so.2` (the name cudarc loads is `libnccl.so`).
fn library_dirs() -> Vec<String> {
    let pr = probe::probe();
    let mut dirs: Vec<String> = pr
        .extra_dirs()
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    if let LibState::Found { path } = pr.state(Lib::Nccl) {
        let shim = std::env::temp_dir().join(format!("hzp-launch-{}", std::process::id()));
        if std::fs::create_dir_all(&shim).is_ok() {
            let link = shim.join("libnccl.so");
            let _ = std::fs::remove_file(&link);
            #[cfg(unix)]
            if std::os::unix::fs::symlink(path, &link).is_ok() {
                dirs.insert(0, shim.display().to_string());
            }
        }
    }
    dirs
}

/// The torchrun variables of local process `local`.
fn rank_env(a: &LaunchArgs, local: usize, port: u16) -> Vec<(&'static str, String)> {
    let rank = a.node_rank * a.nproc_per_node + local;
    vec![
        ("RANK", rank.to_string()),
        ("LOCAL_RANK", local.to_string()),
        ("WORLD_SIZE", (a.nproc_per_node * a.nnodes).to_string()),
        ("LOCAL_WORLD_SIZE", a.nproc_per_node.to_string()),
        ("GROUP_RANK", a.node_rank.to_string()),
        ("MASTER_ADDR", a.master_addr.clone()),
        ("MASTER_PORT", port.to_string()),
    ]
}

fn status_code(s: ExitStatus) -> i32 {
    if let Some(c) = s.code() {
        return c;
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = s.signal() {
            return 128 + sig;
        }
    }
    1
}

/// The flags' checks: counts, ranks and the world size in range, a command that is not
/// `launch` itself.
fn check_args(a: &LaunchArgs) -> Result<(), String> {
    if a.nproc_per_node == 0 {
        return Err("--nproc-per-node must be at least 1".into());
    }
    if a.nnodes == 0 || a.node_rank >= a.nnodes {
        return Err(format!(
            "--node-rank {} is not below --nnodes {}",
            a.node_rank, a.nnodes
        ));
    }
    if a.command.first().is_some_and(|c| c == "launch") {
        return Err("the command to launch is `launch` itself".into());
    }
    if a.nproc_per_node > MAX_NPROC_PER_NODE {
        return Err(format!(
            "--nproc-per-node {} is more processes than one node runs (at most {MAX_NPROC_PER_NODE}: one per GPU)",
            a.nproc_per_node
        ));
    }
    if a.nnodes > MAX_WORLD {
        return Err(format!(
            "--nnodes {} is more nodes than a mesh has ranks (at most {MAX_WORLD})",
            a.nnodes
        ));
    }
    match a.nproc_per_node.checked_mul(a.nnodes) {
        Some(w) if w <= MAX_WORLD => {}
        _ => {
            return Err(format!(
                "--nproc-per-node {} x --nnodes {} is a world of more than {MAX_WORLD} ranks, the largest mesh hzp plans",
                a.nproc_per_node, a.nnodes
            ))
        }
    }
    Ok(())
}

/// Runs `hzp launch`. Returns the exit code to exit with.
pub fn launch(a: &LaunchArgs) -> miette::Result<i32> {
    let fail = |m: String| miette::miette!("hzp launch: {m}");
    check_args(a).map_err(fail)?;
    let port = match a.master_port {
        Some(0) => return Err(fail("--master-port 0 is not a port".into())),
        Some(p) => p,
        None if a.nnodes == 1 => {
            free_port().map_err(|e| fail(format!("finding a free port: {e}")))?
        }
        None => 29500,
    };
    let exe = std::env::current_exe().map_err(|e| fail(format!("finding the hzp binary: {e}")))?;
    let mut ld = library_dirs();
    if let Ok(old) = std::env::var("LD_LIBRARY_PATH") {
        if !old.is_empty() {
            ld.push(old);
        }
    }
    // From here on SIGINT/SIGTERM/SIGHUP stop the ranks instead of leaving them running.
    signals::catch();
    let out_lock = Arc::new(Mutex::new(()));
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut pumps = Vec::new();
    for local in 0..a.nproc_per_node {
        let rank = a.node_rank * a.nproc_per_node + local;
        let mut cmd = Command::new(&exe);
        cmd.args(&a.command)
            .envs(rank_env(a, local, port))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if !ld.is_empty() {
            cmd.env("LD_LIBRARY_PATH", ld.join(":"));
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop(&mut children);
                return Err(fail(format!("starting rank {rank}: {e}")));
            }
        };
        if let Some(o) = child.stdout.take() {
            pumps.push(pump(o, rank, false, out_lock.clone()));
        }
        if let Some(o) = child.stderr.take() {
            pumps.push(pump(o, rank, true, out_lock.clone()));
        }
        children.push((rank, child));
    }
    // Wait: the first non-zero exit stops the others.
    let mut code = 0;
    let mut running: Vec<bool> = vec![true; children.len()];
    while running.iter().any(|&r| r) {
        if let Some(sig) = signals::received() {
            let others = running.iter().filter(|&&r| r).count();
            {
                let _g = out_lock.lock();
                note!(
                    "hzp launch: received {}; passing it on to the {others} running rank(s) and waiting for them",
                    signals::name(sig)
                );
            }
            stop_on_signal(&mut children, &mut running, sig);
            code = 128 + sig;
            break;
        }
        let mut failed = None;
        for (i, (rank, c)) in children.iter_mut().enumerate() {
            if !running[i] {
                continue;
            }
            match c.try_wait() {
                Ok(Some(s)) => {
                    running[i] = false;
                    if !s.success() && failed.is_none() {
                        failed = Some((*rank, status_code(s)));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    running[i] = false;
                    failed.get_or_insert((*rank, 1));
                    note!("hzp launch: waiting for rank {rank}: {e}");
                }
            }
        }
        if let Some((rank, c)) = failed {
            code = c;
            let others = running.iter().filter(|&&r| r).count();
            let _g = out_lock.lock();
            note!(
                "hzp launch: rank {rank} exited with status {c}{}",
                if others > 0 {
                    format!("; stopping the other {others} rank(s)")
                } else {
                    String::new()
                }
            );
            drop(_g);
            for (i, (_, ch)) in children.iter_mut().enumerate() {
                if running[i] {
                    let _ = ch.kill();
                    let _ = ch.wait();
                    running[i] = false;
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // A rank's output that could not be copied to our stdout is a failure of the launch
    // (a full disk must not look like success).
    let mut lost = None;
    for p in pumps {
        if let Ok(Some(e)) = p.join() {
            lost.get_or_insert(e);
        }
    }
    if let (Some(e), 0) = (lost, code) {
        return Err(fail(format!(
            "cannot write the ranks' output to stdout: {e}"
        )));
    }
    Ok(code)
}

/// Passes signal `sig` on to the running children and reaps them; a child still running
/// after [`SIGNAL_GRACE`] (or when a second signal arrives) is killed.
fn stop_on_signal(children: &mut [(usize, Child)], running: &mut [bool], sig: i32) {
    for (i, (_, c)) in children.iter_mut().enumerate() {
        if running[i] {
            signals::send(c, sig);
        }
    }
    let t0 = std::time::Instant::now();
    let seen = signals::count();
    while running.iter().any(|&r| r) {
        let hurry = t0.elapsed() > SIGNAL_GRACE || signals::count() != seen;
        for (i, (rank, c)) in children.iter_mut().enumerate() {
            if !running[i] {
                continue;
            }
            match c.try_wait() {
                Ok(Some(_)) => running[i] = false,
                Ok(None) if hurry => {
                    note!("hzp launch: rank {rank} is still running; killing it");
                    let _ = c.kill();
                    let _ = c.wait();
                    running[i] = false;
                }
                Ok(None) => {}
                Err(_) => {
                    let _ = c.kill();
                    let _ = c.wait();
                    running[i] = false;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How long the ranks have to end after a signal is passed on before they are killed.
const SIGNAL_GRACE: Duration = Duration::from_secs(10);

/// The launcher's signal handling: SIGINT, SIGTERM and SIGHUP are recorded (the wait loop
/// passes them on to the ranks) instead of ending the launcher and orphaning its children.
mod signals {
    use std::process::Child;
    use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

    static LAST: AtomicI32 = AtomicI32::new(0);
    static COUNT: AtomicUsize = AtomicUsize::new(0);

    #[cfg(unix)]
    extern "C" fn on_signal(sig: libc::c_int) {
        // only atomics: async-signal-safe
        LAST.store(sig, Ordering::SeqCst);
        COUNT.fetch_add(1, Ordering::SeqCst);
    }

    /// Installs the handlers (children get the default dispositions back at exec).
    pub fn catch() {
        #[cfg(unix)]
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: the handler only stores to atomics; sigaction with an empty mask and
            // SA_RESTART, so the output pumps' reads are not interrupted.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
                sa.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
    }

    /// The last signal received, if any.
    pub fn received() -> Option<i32> {
        (COUNT.load(Ordering::SeqCst) > 0).then(|| LAST.load(Ordering::SeqCst))
    }

    /// How many signals have been received.
    pub fn count() -> usize {
        COUNT.load(Ordering::SeqCst)
    }

    /// Sends `sig` to a child (a child that already ended is not signalled: its pid is
    /// reserved until it is reaped, so this never reaches another process).
    pub fn send(c: &mut Child, sig: i32) {
        if !matches!(c.try_wait(), Ok(None)) {
            return;
        }
        #[cfg(unix)]
        if let Ok(pid) = libc::pid_t::try_from(c.id()) {
            // SAFETY: kill has no memory effects; the pid is our unreaped child's.
            unsafe {
                libc::kill(pid, sig);
            }
        }
        #[cfg(not(unix))]
        {
            let _ = sig;
            let _ = c.kill();
        }
    }

    pub fn name(sig: i32) -> String {
        #[cfg(unix)]
        {
            match sig {
                libc::SIGINT => return "SIGINT".into(),
                libc::SIGTERM => return "SIGTERM".into(),
                libc::SIGHUP => return "SIGHUP".into(),
                _ => {}
            }
        }
        format!("signal {sig}")
    }
}

fn stop(children: &mut [(usize, Child)]) {
    for (_, c) in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Copies a child's lines to ours, each prefixed with `[rank R] `.
fn pump(
    src: impl std::io::Read + Send + 'static,
    rank: usize,
    err: bool,
    lock: Arc<Mutex<()>>,
) -> std::thread::JoinHandle<Option<std::io::Error>> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(src);
        let mut line = Vec::new();
        let mut failed = None;
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if line.last() != Some(&b'\n') {
                        line.push(b'\n');
                    }
                    let _g = lock.lock();
                    let prefix = format!("[rank {rank}] ");
                    if err {
                        // Nowhere to report a failing stderr; keep draining the child.
                        let mut e = std::io::stderr().lock();
                        let _ = e.write_all(prefix.as_bytes());
                        let _ = e.write_all(&line);
                    } else if failed.is_none() {
                        let mut o = std::io::stdout().lock();
                        let w = o
                            .write_all(prefix.as_bytes())
                            .and_then(|()| o.write_all(&line))
                            .and_then(|()| o.flush());
                        if let Err(e) = w {
                            failed = Some(e);
                        }
                    }
                }
            }
        }
        failed
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use hzp_runtime::cuda::rendezvous::DistEnv;

    #[test]
    fn every_process_gets_the_variables_torchrun_sets_and_the_runtime_reads() {
        let a = LaunchArgs {
            nproc_per_node: 4,
            nnodes: 2,
            node_rank: 1,
            master_addr: "node0".into(),
            master_port: Some(29400),
            command: vec!["show".into()],
        };
        let env = rank_env(&a, 2, 29400);
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        let d = DistEnv::from_lookup(&get).unwrap();
        assert_eq!(
            (d.rank, d.world_size, d.local_rank, d.local_world_size),
            (6, 8, 2, 4)
        );
        assert_eq!(d.master(), "node0:29400");
        assert_eq!(get("GROUP_RANK").as_deref(), Some("1"));
    }
}
