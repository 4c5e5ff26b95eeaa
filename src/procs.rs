//! `hzp run` (either backend) as one process per rank under a launcher (`hzp launch`, torchrun,
//! srun): where this process stands ([`discover`]), the connection to the others
//! ([`Procs`]: the CUDA backend's TCP rendezvous at `MASTER_ADDR:MASTER_PORT`), and what the
//! processes do together besides the step's collectives: gathering the parameters, agreeing
//! on the checkpoint to resume, writing one checkpoint from every process.

use hzp_ir::plan::Plan;
use hzp_ir::Tensor;
use hzp_runtime::checkpoint::{self, FileEntry, Manifest};
use hzp_runtime::cuda::rendezvous::{DistEnv, Rendezvous, MAX_FRAME};
use hzp_runtime::executor::PlanExecutor;
use miette::{miette, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The rendezvous port under srun when `MASTER_PORT` is not set: this plus the job id
/// modulo 10000 (two jobs on one node get different ports), or 29500 without a job id.
pub const SLURM_PORT_BASE: u16 = 20000;

/// Where this process stands when a launcher started it as one of several: torchrun's and
/// `hzp launch`'s `RANK` / `WORLD_SIZE` (with `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`),
/// else srun's `SLURM_PROCID` / `SLURM_STEP_NUM_TASKS` (`SLURM_NTASKS` when srun did not set
/// the step's count) / `SLURM_LOCALID`, the address from `MASTER_ADDR` / `MASTER_PORT` when
/// set, else the first host of `SLURM_STEP_NODELIST` (or `SLURM_JOB_NODELIST`) and port
/// [`SLURM_PORT_BASE`] + `SLURM_JOB_ID` mod 10000. `None`: a process alone (world size 1 or
/// no launcher).
pub fn discover(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<DistEnv>, String> {
    if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
        let env = DistEnv::from_lookup(get)?;
        return Ok((env.world_size > 1).then_some(env));
    }
    let Some(procid) = get("SLURM_PROCID") else {
        return Ok(None);
    };
    let (var, tasks) = match (get("SLURM_STEP_NUM_TASKS"), get("SLURM_NTASKS")) {
        (Some(t), _) => ("SLURM_STEP_NUM_TASKS", t),
        (None, Some(t)) if get("SLURM_STEP_ID").is_some() => ("SLURM_NTASKS", t),
        // an sbatch script runs with SLURM_NTASKS too: only srun's tasks are several
        _ => return Ok(None),
    };
    let num = |k: &str, v: &str| -> Result<usize, String> {
        v.trim()
            .parse::<usize>()
            .map_err(|_| format!("environment variable {k}={v:?} is not a non-negative integer"))
    };
    let world = num(var, &tasks)?;
    if world <= 1 {
        return Ok(None);
    }
    let rank = num("SLURM_PROCID", &procid)?;
    if rank >= world {
        return Err(format!("SLURM_PROCID={rank} is not below {var}={world}"));
    }
    let master_addr = match get("MASTER_ADDR") {
        Some(a) => a,
        None => {
            let list = get("SLURM_STEP_NODELIST")
                .or_else(|| get("SLURM_JOB_NODELIST"))
                .ok_or(
                    "srun started this process as one of several (SLURM_PROCID, SLURM_STEP_NUM_TASKS), but neither MASTER_ADDR nor SLURM_STEP_NODELIST / SLURM_JOB_NODELIST says where rank 0 runs: set MASTER_ADDR (and MASTER_PORT) to rank 0's host",
                )?;
            first_host(&list).ok_or_else(|| {
                format!(
                    "SLURM_STEP_NODELIST={list:?} names no host: set MASTER_ADDR to rank 0's host"
                )
            })?
        }
    };
    let port = match get("MASTER_PORT") {
        Some(p) => p,
        None => match get("SLURM_JOB_ID").and_then(|j| j.trim().parse::<u64>().ok()) {
            Some(j) => (SLURM_PORT_BASE as u64 + j % 10000).to_string(),
            None => "29500".into(),
        },
    };
    let local = get("SLURM_LOCALID").unwrap_or_else(|| "0".into());
    let local_world = get("SLURM_NTASKS_PER_NODE")
        .filter(|v| v.trim().parse::<usize>().is_ok())
        .unwrap_or_else(|| world.to_string());
    let vars: HashMap<&str, String> = HashMap::from([
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", local),
        ("LOCAL_WORLD_SIZE", local_world),
        ("MASTER_ADDR", master_addr),
        ("MASTER_PORT", port),
    ]);
    let env = DistEnv::from_lookup(&|k| vars.get(k).cloned()).map_err(|e| {
        e.replace("LOCAL_RANK", "SLURM_LOCALID")
            .replace("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")
    })?;
    Ok(Some(env))
}

/// The first host of a Slurm host list: `node[03-05,7],gpu1` gives `node03`.
pub fn first_host(list: &str) -> Option<String> {
    let first = list.split(',').next()?.trim();
    let host = match first.split_once('[') {
        None => first.to_string(),
        Some((prefix, rest)) => {
            let n: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            if n.is_empty() {
                return None;
            }
            format!("{prefix}{n}")
        }
    };
    (!host.is_empty()).then_some(host)
}

/// This process's place in a multi-process run and its connection to the others.
pub struct Procs {
    pub rv: Rendezvous,
}

impl Procs {
    /// Joins the other processes at `MASTER_ADDR:MASTER_PORT` within `timeout` and checks
    /// that every one runs the same plan.
    pub fn connect(env: &DistEnv, plan: &Plan, timeout: Duration) -> Result<Procs> {
        let mut rv = Rendezvous::connect(env, timeout).map_err(|e| miette!("{e}"))?;
        let all = rv
            .all_gather(plan.content_hash.as_bytes())
            .map_err(|e| miette!("{e}"))?;
        if let Some((r, h)) = all
            .iter()
            .enumerate()
            .find(|(_, h)| h.as_slice() != plan.content_hash.as_bytes())
        {
            return Err(miette!(
                "rank {r} runs another plan (content hash {}) than rank {} ({}): every process must run the same plan file",
                String::from_utf8_lossy(h),
                env.rank,
                plan.content_hash
            ));
        }
        Ok(Procs { rv })
    }

    pub fn rank(&self) -> usize {
        self.rv.rank()
    }

    /// Every process's `mine`, in rank order, in pieces small enough for the rendezvous's
    /// frames.
    pub fn all_gather_blob(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let w = self.rv.world_size().max(1);
        let chunk = ((MAX_FRAME - 64 - 8 * w) / w).max(1);
        let lens = self
            .rv
            .all_gather(&(mine.len() as u64).to_le_bytes())
            .map_err(|e| miette!("{e}"))?;
        let lens: Vec<usize> = lens
            .iter()
            .map(|b| {
                let a: [u8; 8] = b.as_slice().try_into().unwrap_or([0; 8]);
                u64::from_le_bytes(a) as usize
            })
            .collect();
        let rounds = lens.iter().map(|l| l.div_ceil(chunk)).max().unwrap_or(0);
        let mut out: Vec<Vec<u8>> = lens.iter().map(|&l| Vec::with_capacity(l)).collect();
        for k in 0..rounds {
            let lo = (k * chunk).min(mine.len());
            let hi = ((k + 1) * chunk).min(mine.len());
            let got = self
                .rv
                .all_gather(&mine[lo..hi])
                .map_err(|e| miette!("{e}"))?;
            for (o, g) in out.iter_mut().zip(got) {
                o.extend_from_slice(&g);
            }
        }
        for (r, (o, &l)) in out.iter().zip(&lens).enumerate() {
            if o.len() != l {
                return Err(miette!("rank {r} announced {l} bytes and sent {}", o.len()));
            }
        }
        Ok(out)
    }

    /// The full parameters, on every process: the master shards of every rank gathered.
    pub fn parameters(&mut self, ex: &dyn PlanExecutor) -> Result<Vec<(String, Tensor)>> {
        let mut mine: Vec<(String, Tensor)> = Vec::new();
        for &r in ex.local_ranks() {
            let shards = ex.master_shards(r).map_err(|e| miette!("{e}"))?;
            mine.extend(shards.into_iter().map(|(n, t)| (format!("{r}/{n}"), t)));
        }
        let bytes = checkpoint::to_safetensors(&mine).map_err(|e| miette!("{e}"))?;
        let all = self.all_gather_blob(&bytes)?;
        let mut others: HashMap<usize, Vec<(String, Tensor)>> = HashMap::new();
        for (from, b) in all.iter().enumerate() {
            let list = checkpoint::from_safetensors(b)
                .map_err(|e| miette!("the parameters rank {from} sent: {e}"))?;
            for (key, t) in list {
                let (r, name) = key
                    .split_once('/')
                    .and_then(|(r, n)| Some((r.parse::<usize>().ok()?, n.to_string())))
                    .ok_or_else(|| miette!("rank {from} sent a shard named {key:?}"))?;
                others.entry(r).or_default().push((name, t));
            }
        }
        ex.parameters_with(&others).map_err(|e| miette!("{e}"))
    }

    /// Every process found checkpoint `step` (None: none) to resume from, or the error says
    /// which found what.
    pub fn agree_on_resume(&mut self, found: Option<(usize, &Path)>) -> Result<()> {
        let mine = found.map_or("none".to_string(), |(s, _)| s.to_string());
        let all = self
            .rv
            .all_gather(mine.as_bytes())
            .map_err(|e| miette!("{e}"))?;
        let all: Vec<String> = all
            .iter()
            .map(|b| String::from_utf8_lossy(b).to_string())
            .collect();
        if all.iter().any(|s| *s != mine) {
            let list: Vec<String> = all
                .iter()
                .enumerate()
                .map(|(r, s)| format!("rank {r}: {s}"))
                .collect();
            return Err(miette!(
                "--resume: the processes found different newest checkpoints ({}); is --checkpoint-dir one folder every process sees (a shared file system on several nodes)?",
                list.join(", ")
            ));
        }
        Ok(())
    }

    /// Writes the checkpoint of `manifest.step` into `dir` from every process: rank 0
    /// creates the temporary folder, every process writes the files of its ranks into it,
    /// and once all are written rank 0 writes the manifest and renames the folder; every
    /// process returns when it is complete (or with the first error any had). `dir` must be
    /// one folder for every process (a shared file system on several nodes).
    pub fn save_checkpoint(
        &mut self,
        ex: &dyn PlanExecutor,
        dir: &Path,
        manifest: Manifest,
    ) -> Result<(PathBuf, u64)> {
        let world = ex.mesh().world_size();
        let rank = self.rank();
        let begun = if rank == 0 {
            checkpoint::begin(dir, &manifest)
                .map(|t| t.display().to_string())
                .map_err(|e| e.to_string())
        } else {
            Ok(String::new())
        };
        let msg = match &begun {
            Ok(t) => format!("ok {t}"),
            Err(e) => format!("error {e}"),
        };
        let from0 = self
            .rv
            .broadcast((rank == 0).then_some(msg.as_bytes()))
            .map_err(|e| miette!("{e}"))?;
        let from0 = String::from_utf8_lossy(&from0).to_string();
        let tmp = match from0.split_once(' ') {
            Some(("ok", t)) => PathBuf::from(t),
            Some((_, e)) => return Err(miette!("{e}")),
            None => return Err(miette!("rank 0 sent a malformed checkpoint folder")),
        };
        if !tmp.is_dir() {
            // say so, but take part in the gather so no process waits for this one
            note!(
                "rank {rank}: the checkpoint folder {} that rank 0 made is not there: is --checkpoint-dir shared by every process?",
                tmp.display()
            );
        }
        let mut entries: Vec<Result<FileEntry, String>> = Vec::new();
        for &r in ex.local_ranks() {
            let written = ex
                .persistent(r)
                .map_err(|e| e.to_string())
                .and_then(|values| {
                    checkpoint::write_rank(
                        &tmp,
                        r,
                        world,
                        &manifest.plan_hash,
                        manifest.step,
                        &values,
                    )
                    .map_err(|e| e.to_string())
                });
            entries.push(written.map_err(|e| format!("rank {r}: {e}")));
        }
        let json = serde_json::to_vec(
            &entries
                .iter()
                .map(|e| match e {
                    Ok(f) => serde_json::json!({ "ok": f }),
                    Err(m) => serde_json::json!({ "error": m }),
                })
                .collect::<Vec<_>>(),
        )
        .map_err(|e| miette!("{e}"))?;
        let all = self.all_gather_blob(&json)?;
        let mut files: Vec<FileEntry> = Vec::new();
        let mut errors: Vec<String> = Vec::new();
        for (from, b) in all.iter().enumerate() {
            let list: Vec<serde_json::Value> = serde_json::from_slice(b)
                .map_err(|e| miette!("rank {from} sent malformed checkpoint entries: {e}"))?;
            for v in list {
                if let Some(m) = v.get("error").and_then(|m| m.as_str()) {
                    errors.push(m.to_string());
                } else {
                    let f: FileEntry = serde_json::from_value(v["ok"].clone())
                        .map_err(|e| miette!("rank {from} sent a malformed file entry: {e}"))?;
                    files.push(f);
                }
            }
        }
        files.sort_by_key(|f| f.rank);
        let done = if rank == 0 {
            let r = if errors.is_empty() {
                checkpoint::finish(dir, &tmp, manifest, files).map_err(|e| e.to_string())
            } else {
                checkpoint::abandon(&tmp);
                Err(errors.join("; "))
            };
            let msg = match &r {
                Ok((p, bytes)) => format!("ok {bytes} {}", p.display()),
                Err(e) => format!("error {e}"),
            };
            self.rv
                .broadcast(Some(msg.as_bytes()))
                .map_err(|e| miette!("{e}"))?;
            r
        } else {
            let b = self.rv.broadcast(None).map_err(|e| miette!("{e}"))?;
            let s = String::from_utf8_lossy(&b).to_string();
            match s.split_once(' ') {
                Some(("ok", rest)) => {
                    let (bytes, p) = rest.split_once(' ').unwrap_or(("0", rest));
                    Ok((PathBuf::from(p), bytes.parse().unwrap_or(0)))
                }
                Some((_, e)) => Err(e.to_string()),
                None => Err("rank 0 sent a malformed answer".to_string()),
            }
        };
        done.map_err(|e| miette!("{e}"))
    }
}
