//! Training checkpoints: a folder `step-000123/` per checkpoint holding one safetensors file
//! per rank (`rank-00000.safetensors`: the rank's persistent values, named as in the plan:
//! parameter master shards, compute shards, optimizer moments, step counter) and
//! `manifest.json`, written last: the model, its fingerprint, the plan's hash, mesh and
//! parameter layouts, the run's position (steps done, token samples consumed, schedule) and
//! the size and SHA-256 of every file. A folder without a manifest whose files all match is
//! not a checkpoint.
//!
//! A checkpoint is written under a temporary name in the checkpoint folder and renamed when
//! complete; an existing checkpoint is never written over. Loading verifies every file. A
//! plan other than the writer's (another mesh, rank count or strategy) loads it through the
//! full tensors: each parameter and each of its optimizer states is put back together from
//! the writer's shards (`ParamLayout::states`) and cut for the new plan.

use crate::executor::bytes::{data_bytes, tensor_from_bytes};
use hzp_ir::{DType, Mesh, ParamLayout, Tensor, TensorType};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Names of the states an ACCO plan adds (`hzp_passes::dist::acco`).
const ACCO_PREFIX: &str = "acco.";

/// The manifest's format version (2: the run, each file's rank and tensors, the
/// manifest's own hash).
pub const FORMAT: u32 = 2;

/// Keys of the `__metadata__` every rank's safetensors file carries.
const META_RANK: &str = "hzp.rank";
const META_WORLD: &str = "hzp.world_size";
const META_PLAN: &str = "hzp.plan_hash";
const META_STEP: &str = "hzp.step";

/// A new run identifier: unpredictable enough that two runs never share one.
pub fn new_run_id() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut h = Sha256::new();
    h.update(t.to_le_bytes());
    h.update(std::process::id().to_le_bytes());
    h.update(format!("{:p}", &t).as_bytes());
    sha256_hex(&h.finalize())[..16].to_string()
}
/// The manifest's file name.
pub const MANIFEST: &str = "manifest.json";

/// Why a checkpoint cannot be written or read. Messages name the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {message}")]
    Io { path: String, message: String },
    /// The folder is not a usable checkpoint (damaged, partial): a run resuming skips it.
    #[error("{path}: {message}")]
    Damaged { path: String, message: String },
    /// A complete checkpoint that does not fit this run (another model).
    #[error("{path}: {message}")]
    Mismatch { path: String, message: String },
}

fn io(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

fn damaged(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::Damaged {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// Where a run stands in its token data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataPosition {
    /// The token file, as given.
    pub file: String,
    /// Its token count (a resume with another file of another length says so).
    pub tokens: usize,
    /// Samples (windows) consumed so far: the next step starts at this one.
    pub samples: u64,
    /// Rows per step and tokens per row.
    pub batch: usize,
    pub seq: usize,
    pub shuffle: Option<u64>,
}

/// One tensor of a rank's file, as its safetensors header must state it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// One file of a checkpoint: the rank it holds (the file's own header says so too), its
/// size and hash, and the tensors its header declares.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    pub name: String,
    pub rank: usize,
    pub bytes: u64,
    pub sha256: String,
    pub tensors: Vec<TensorEntry>,
}

/// What `manifest.json` holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: u32,
    /// The run that wrote it: made new when a run starts from scratch, carried over by
    /// `--resume`. Retention (`--keep`) removes only checkpoints of its own run.
    pub run: String,
    /// Steps done when it was written.
    pub step: usize,
    pub model: String,
    /// The name map the plan was compiled with (`hzp compile --names`), when not the one
    /// beside the model: what `hzp checkpoint export` keys the parameters by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub names: Option<String>,
    pub model_fingerprint: String,
    /// The content hash of the plan that wrote it.
    pub plan_hash: String,
    pub strategy: String,
    pub mesh: Mesh,
    pub micro_batches: usize,
    pub layouts: Vec<ParamLayout>,
    pub data: Option<DataPosition>,
    /// The learning-rate schedule of the run (see `crate::schedule`), and the rate of the
    /// last step.
    pub schedule: Option<crate::schedule::LrSchedule>,
    pub lr: f64,
    /// One per rank, in rank order, then nothing else.
    pub files: Vec<FileEntry>,
    /// SHA-256 of this manifest as written with this field empty: an edit anywhere in it
    /// (a swapped file entry, a changed layout) is found on every path that reads it.
    pub manifest_sha256: String,
}

impl Manifest {
    pub fn world_size(&self) -> usize {
        self.mesh.world_size()
    }

    /// The hash the seal holds: SHA-256 of the manifest with `manifest_sha256` empty, as
    /// compact JSON with its keys sorted (so that it does not depend on field order).
    fn seal(&self) -> Result<String, String> {
        let mut m = self.clone();
        m.manifest_sha256.clear();
        let v = serde_json::to_value(&m).map_err(|e| e.to_string())?;
        Ok(sha256_hex(canonical_json(&v).as_bytes()))
    }

    /// The manifest's text, `manifest_sha256` filled in.
    fn sealed_json(&mut self) -> Result<String, String> {
        self.manifest_sha256 = self.seal()?;
        let mut json = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        json.push('\n');
        Ok(json)
    }

    /// Whether `manifest_sha256` is the hash of the rest.
    fn seal_holds(&self) -> bool {
        self.seal().is_ok_and(|h| h == self.manifest_sha256)
    }

    /// What a reader checks before trusting any number in it: the mesh within bounds, each
    /// layout's sizes consistent and its groups the mesh's, the files one per rank in rank
    /// order, names without folders.
    fn check(&self) -> Result<(), String> {
        self.mesh.check_size()?;
        let w = self.world_size();
        if self.files.len() != w {
            return Err(format!(
                "{} rank files listed for a mesh of {w} ranks",
                self.files.len()
            ));
        }
        for (r, f) in self.files.iter().enumerate() {
            if f.rank != r || f.name != rank_file(r) {
                return Err(format!(
                    "file entry {r} is `{}` for rank {} (entries are one per rank, in rank order, named rank-NNNNN.safetensors)",
                    f.name, f.rank
                ));
            }
        }
        for l in &self.layouts {
            let numel = l
                .shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| format!("parameter `{}`: shape {:?} overflows", l.name, l.shape))?;
            let o = self.mesh.group_size(&l.optim_group);
            let p = self.mesh.group_size(&l.params_group);
            match (o, p) {
                (Some(o), Some(p))
                    if numel == l.numel
                        && l.padded >= l.numel
                        && l.padded % o == 0
                        && l.padded % p == 0
                        && l.padded - l.numel <= o.saturating_mul(p) => {}
                _ => {
                    return Err(format!(
                        "parameter `{}`: shape {:?}, {} elements padded to {} over groups {} and {} of mesh {}: not a layout hzp writes",
                        l.name, l.shape, l.numel, l.padded, l.optim_group, l.params_group, self.mesh
                    ))
                }
            }
        }
        Ok(())
    }
}

/// The folder name of the checkpoint after `step` steps.
pub fn step_dir_name(step: usize) -> String {
    format!("step-{step:06}")
}

fn rank_file(r: usize) -> String {
    format!("rank-{r:05}.safetensors")
}

fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F16 => safetensors::Dtype::F16,
        DType::I64 => safetensors::Dtype::I64,
        DType::I32 => safetensors::Dtype::I32,
        DType::Bool => safetensors::Dtype::BOOL,
    }
}

fn hz_dtype(d: safetensors::Dtype) -> Option<DType> {
    Some(match d {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::BF16 => DType::BF16,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::I64 => DType::I64,
        safetensors::Dtype::I32 => DType::I32,
        safetensors::Dtype::BOOL => DType::Bool,
        _ => return None,
    })
}

/// `values` as safetensors bytes (names kept; safetensors orders them itself).
pub fn to_safetensors(values: &[(String, Tensor)]) -> Result<Vec<u8>, String> {
    to_safetensors_with(values, None)
}

/// [`to_safetensors`] with a `__metadata__` header.
fn to_safetensors_with(
    values: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>, String> {
    let mut views = Vec::with_capacity(values.len());
    for (name, t) in values {
        let v = safetensors::tensor::TensorView::new(
            st_dtype(t.dtype()),
            t.shape.clone(),
            data_bytes(&t.data),
        )
        .map_err(|e| format!("`{name}`: {e}"))?;
        views.push((name.as_str(), v));
    }
    safetensors::tensor::serialize(views, metadata).map_err(|e| e.to_string())
}

/// The tensors of safetensors bytes, by name (in name order).
pub fn from_safetensors(bytes: &[u8]) -> Result<Vec<(String, Tensor)>, String> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let mut names: Vec<String> = st.names().into_iter().map(|s| s.to_string()).collect();
    names.sort();
    for name in names {
        let v = st.tensor(&name).map_err(|e| format!("`{name}`: {e}"))?;
        let dtype = hz_dtype(v.dtype())
            .ok_or_else(|| format!("`{name}` has dtype {:?}, which hzp does not use", v.dtype()))?;
        let ty = TensorType::new(dtype, v.shape().to_vec());
        if v.data().len() != ty.size_bytes() {
            return Err(format!("`{name}`: {} bytes for {ty}", v.data().len()));
        }
        let t = match dtype {
            // the bulk of a checkpoint: a straight little-endian read
            DType::F32 => Tensor::f32(
                ty.shape.clone(),
                v.data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            _ => tensor_from_bytes(&ty, v.data()),
        };
        out.push((name, t));
    }
    Ok(out)
}

/// `v` as compact JSON with every object's keys in sorted order.
fn canonical_json(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let parts: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", Value::String(k.clone()), canonical_json(&m[k])))
                .collect();
            format!("{{{}}}", parts.join(","))
        }
        Value::Array(a) => format!(
            "[{}]",
            a.iter().map(canonical_json).collect::<Vec<_>>().join(",")
        ),
        other => other.to_string(),
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `bytes` to a new file `path` (never over an existing one) and syncs it.
fn write_new(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| io(path, e))?;
    f.write_all(bytes).map_err(|e| io(path, e))?;
    f.sync_all().map_err(|e| io(path, e))
}

/// Writes a checkpoint of `per_rank` values into `dir` (created if needed) as
/// `dir/step-NNNNNN/`; `manifest.files` and its seal are filled here. Refuses when that
/// checkpoint exists. The files go into a hidden `.step-NNNNNN.partial-RUN-...` folder
/// first, renamed when complete. Returns the checkpoint's folder and its total bytes.
/// Retention is [`prune`]'s.
///
/// A run of several processes writes the same checkpoint in three parts: one process
/// [`begin`]s it, every process writes its ranks' files into that folder with
/// [`write_rank`], and once all are written the first [`finish`]es it with their entries.
pub fn save(
    dir: &Path,
    manifest: Manifest,
    per_rank: &[Vec<(String, Tensor)>],
) -> Result<(PathBuf, u64), CheckpointError> {
    let tmp = begin(dir, &manifest)?;
    let world = per_rank.len();
    let (plan_hash, step) = (&manifest.plan_hash, manifest.step);
    // the ranks' files are serialized, hashed and written side by side
    let written: Vec<Result<FileEntry, CheckpointError>> = std::thread::scope(|sc| {
        let jobs: Vec<_> = per_rank
            .iter()
            .enumerate()
            .map(|(r, values)| {
                let tmp = &tmp;
                sc.spawn(move || write_rank(tmp, r, world, plan_hash, step, values))
            })
            .collect();
        jobs.into_iter()
            .map(|j| {
                j.join()
                    .unwrap_or_else(|_| Err(io(&tmp, "a thread writing a rank's file failed")))
            })
            .collect()
    });
    let files = match written.into_iter().collect::<Result<Vec<_>, _>>() {
        Ok(f) => f,
        Err(e) => {
            abandon(&tmp);
            return Err(e);
        }
    };
    finish(dir, &tmp, manifest, files)
}

/// Starts checkpoint `manifest.step` of `dir`: checks that it does not exist and creates its
/// hidden temporary folder, which it returns.
pub fn begin(dir: &Path, manifest: &Manifest) -> Result<PathBuf, CheckpointError> {
    if let Ok(m) = std::fs::metadata(dir) {
        if !m.is_dir() {
            return Err(io(dir, "exists and is not a folder"));
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let final_dir = dir.join(step_dir_name(manifest.step));
    if final_dir.exists() {
        return Err(io(
            &final_dir,
            "a checkpoint of this step exists already; it is not written over (resume with --resume, or use another --checkpoint-dir)",
        ));
    }
    // an unpredictable temporary name, created exclusively, that says whose it is
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tmp = dir.join(format!(
        "{}{}-{:x}-{nonce:x}",
        partial_prefix(&manifest.run, manifest.step),
        std::process::id(),
        manifest.step
    ));
    std::fs::create_dir(&tmp).map_err(|e| io(&tmp, e))?;
    Ok(tmp)
}

/// Writes rank `r`'s file (of `world`) of the checkpoint being written in `tmp` (see
/// [`begin`]) and returns its manifest entry.
pub fn write_rank(
    tmp: &Path,
    r: usize,
    world: usize,
    plan_hash: &str,
    step: usize,
    values: &[(String, Tensor)],
) -> Result<FileEntry, CheckpointError> {
    let name = rank_file(r);
    let meta = HashMap::from([
        (META_RANK.to_string(), r.to_string()),
        (META_WORLD.to_string(), world.to_string()),
        (META_PLAN.to_string(), plan_hash.to_string()),
        (META_STEP.to_string(), step.to_string()),
    ]);
    let bytes = to_safetensors_with(values, Some(meta)).map_err(|e| io(&tmp.join(&name), e))?;
    write_new(&tmp.join(&name), &bytes)?;
    let mut tensors: Vec<TensorEntry> = values
        .iter()
        .map(|(n, t)| TensorEntry {
            name: n.clone(),
            dtype: t.dtype(),
            shape: t.shape.clone(),
        })
        .collect();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(FileEntry {
        name,
        rank: r,
        bytes: bytes.len() as u64,
        sha256: sha256_hex(&bytes),
        tensors,
    })
}

/// Removes the temporary folder of a checkpoint that failed.
pub fn abandon(tmp: &Path) {
    let _ = std::fs::remove_dir_all(tmp);
}

/// Completes the checkpoint being written in `tmp` once every rank's file is there:
/// `files` (every rank's entry, in rank order) go into the manifest, which is sealed and
/// written last, and the folder is renamed to `step-NNNNNN`. On failure the temporary folder
/// is removed. Returns the checkpoint's folder and its total bytes.
pub fn finish(
    dir: &Path,
    tmp: &Path,
    mut manifest: Manifest,
    files: Vec<FileEntry>,
) -> Result<(PathBuf, u64), CheckpointError> {
    let final_dir = dir.join(step_dir_name(manifest.step));
    let result = (|| {
        let ranks: Vec<usize> = files.iter().map(|f| f.rank).collect();
        if ranks != (0..files.len()).collect::<Vec<_>>() {
            return Err(io(
                tmp,
                format!("the rank files came as ranks {ranks:?}, not one per rank in order"),
            ));
        }
        let mut total: u64 = files.iter().map(|f| f.bytes).sum();
        manifest.files = files;
        let json = manifest.sealed_json().map_err(|e| io(tmp, e))?;
        write_new(&tmp.join(MANIFEST), json.as_bytes())?;
        total += json.len() as u64;
        std::fs::rename(tmp, &final_dir).map_err(|e| io(&final_dir, e))?;
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(total)
    })();
    let total = match result {
        Ok(t) => t,
        Err(e) => {
            abandon(tmp);
            return Err(e);
        }
    };
    clean_partials(dir, &manifest.run);
    Ok((final_dir, total))
}

/// The start of the temporary folder name a run's checkpoint of `step` is written under.
fn partial_prefix(run: &str, step: usize) -> String {
    format!(".{}.partial-{run}-", step_dir_name(step))
}

/// Checkpoint retention after run `run` wrote the checkpoint of step `written` into `dir`:
/// keeps the newest `keep` checkpoints of that run up to `written` and removes its older
/// ones, never `protect` (the checkpoint the run resumed from). Folders of other runs, of
/// later steps, damaged ones and anything else named `step-*` are reported through `note`
/// and left as they are.
pub fn prune(
    dir: &Path,
    run: &str,
    written: usize,
    keep: usize,
    protect: Option<&Path>,
    note: &mut dyn FnMut(String),
) -> Result<(), CheckpointError> {
    let mut ours = Vec::new();
    let mut steps = list(dir)?;
    steps.sort();
    for (step, path) in steps {
        let theirs = |why: &str| format!("--keep: left {} as it is ({why})", path.display());
        match read_manifest(&path) {
            Ok(m) if m.run == run && step <= written && m.step == step => ours.push(path),
            Ok(m) if m.run != run => note(theirs("a checkpoint of another run")),
            Ok(_) if step > written => note(theirs(&format!(
                "a later step than this run's newest, {written}"
            ))),
            Ok(_) => note(theirs("its manifest names another step")),
            Err(CheckpointError::Damaged { message, .. }) => {
                note(theirs(&format!("not a complete checkpoint: {message}")))
            }
            Err(e) => note(theirs(&format!("unreadable: {e}"))),
        }
    }
    let protect = protect.map(|p| p.canonicalize().unwrap_or_else(|_| p.to_path_buf()));
    let n = ours.len();
    for old in ours.into_iter().take(n.saturating_sub(keep.max(1))) {
        let canon = old.canonicalize().unwrap_or_else(|_| old.clone());
        if protect.as_ref() == Some(&canon) {
            continue;
        }
        std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
    }
    Ok(())
}

/// Removes the hidden `.partial` folders run `run` left in `dir` when it was killed while
/// writing a checkpoint (called once a checkpoint of the run is complete: none of its own
/// is being written then). Other runs' folders are theirs.
fn clean_partials(dir: &Path, run: &str) {
    let mine = format!(".partial-{run}-");
    if run.is_empty() {
        return;
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with(".step-") && name.contains(&mine) && e.path().is_dir() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// The `step-NNNNNN` folders of `dir`, with their step numbers (any order).
pub fn list(dir: &Path) -> Result<Vec<(usize, PathBuf)>, CheckpointError> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(io(dir, e)),
    };
    for e in entries {
        let e = e.map_err(|e| io(dir, e))?;
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(n) = name
            .strip_prefix("step-")
            .and_then(|s| s.parse::<usize>().ok())
        {
            if e.path().is_dir() {
                out.push((n, e.path()));
            }
        }
    }
    Ok(out)
}

/// A checkpoint read back and verified.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    pub path: PathBuf,
    pub manifest: Manifest,
    /// Per rank of the writer: its persistent values by name.
    pub ranks: Vec<Vec<(String, Tensor)>>,
}

/// Reads only the manifest of the checkpoint folder `path`.
pub fn read_manifest(path: &Path) -> Result<Manifest, CheckpointError> {
    let mp = path.join(MANIFEST);
    let text = match std::fs::read_to_string(&mp) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(damaged(
                path,
                "no manifest.json: an incomplete checkpoint (the manifest is written last)",
            ))
        }
        Err(e) => return Err(io(&mp, e)),
    };
    let m: Manifest = serde_json::from_str(&text)
        .map_err(|e| damaged(&mp, format!("not a readable manifest: {e}")))?;
    if m.format != FORMAT {
        return Err(damaged(
            &mp,
            format!("checkpoint format {}; this hzp reads {FORMAT}", m.format),
        ));
    }
    if !m.seal_holds() {
        return Err(damaged(
            &mp,
            "its manifest_sha256 is not the hash of the manifest: the manifest was edited or damaged",
        ));
    }
    m.check().map_err(|e| damaged(&mp, e))?;
    Ok(m)
}

/// Reads and verifies the checkpoint folder `path`: every file there with its size and hash.
pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
    let manifest = read_manifest(path)?;
    let loaded: Vec<Result<Vec<(String, Tensor)>, CheckpointError>> = std::thread::scope(|sc| {
        let jobs: Vec<_> = manifest
            .files
            .iter()
            .map(|f| sc.spawn(move || load_file(path, f)))
            .collect();
        jobs.into_iter()
            .map(|j| {
                j.join()
                    .unwrap_or_else(|_| Err(io(path, "a thread reading a rank's file failed")))
            })
            .collect()
    });
    let ranks = loaded.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(Checkpoint {
        path: path.to_path_buf(),
        manifest,
        ranks,
    })
}

/// Verifies the checkpoint folder `path` as [`load`] does (the manifest and its seal, then
/// every file's size, hash and header) without decoding the tensors; returns the manifest.
pub fn verify(path: &Path) -> Result<Manifest, CheckpointError> {
    let manifest = read_manifest(path)?;
    for f in &manifest.files {
        verified_bytes(path, f)?;
    }
    Ok(manifest)
}

/// One rank's file of the checkpoint at `path`, checked against its manifest entry.
fn load_file(path: &Path, f: &FileEntry) -> Result<Vec<(String, Tensor)>, CheckpointError> {
    let bytes = verified_bytes(path, f)?;
    from_safetensors(&bytes).map_err(|e| damaged(&path.join(&f.name), e))
}

/// The bytes of one rank's file, after its size, hash and header are checked against its
/// manifest entry.
fn verified_bytes(path: &Path, f: &FileEntry) -> Result<Vec<u8>, CheckpointError> {
    if f.name.contains('/') || f.name.contains("..") {
        return Err(damaged(path, format!("the manifest names `{}`", f.name)));
    }
    let fp = path.join(&f.name);
    let bytes = match std::fs::read(&fp) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(damaged(&fp, "missing (listed in the manifest)"))
        }
        Err(e) => return Err(io(&fp, e)),
    };
    if bytes.len() as u64 != f.bytes {
        return Err(damaged(
            &fp,
            format!(
                "{} bytes, the manifest says {} (truncated or changed)",
                bytes.len(),
                f.bytes
            ),
        ));
    }
    let h = sha256_hex(&bytes);
    if h != f.sha256 {
        return Err(damaged(
            &fp,
            format!(
                "SHA-256 {}..., the manifest says {}... (the file was changed or damaged)",
                &h[..12],
                &f.sha256[..12.min(f.sha256.len())]
            ),
        ));
    }
    check_header(&bytes, f).map_err(|e| damaged(&fp, e))?;
    Ok(bytes)
}

/// A rank file's safetensors header against its manifest entry: the rank it says it holds,
/// and the same tensor names, dtypes and shapes (offsets are checked by the reader: each
/// tensor's bytes lie inside the file, one after another, and match its dtype and shape).
fn check_header(bytes: &[u8], f: &FileEntry) -> Result<(), String> {
    let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| e.to_string())?;
    let rank = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get(META_RANK))
        .and_then(|r| r.parse::<usize>().ok());
    if rank != Some(f.rank) {
        return Err(format!(
            "its header says it holds rank {}, the manifest lists it for rank {}",
            rank.map_or("(none)".to_string(), |r| r.to_string()),
            f.rank
        ));
    }
    let mut found: Vec<TensorEntry> = Vec::new();
    for (name, info) in meta.tensors() {
        let dtype = hz_dtype(info.dtype).ok_or_else(|| {
            format!(
                "`{name}` has dtype {:?}, which hzp does not use",
                info.dtype
            )
        })?;
        found.push(TensorEntry {
            name: name.to_string(),
            dtype,
            shape: info.shape.clone(),
        });
    }
    found.sort_by(|a, b| a.name.cmp(&b.name));
    if found.len() != f.tensors.len() {
        return Err(format!(
            "{} tensors in its header, the manifest lists {}",
            found.len(),
            f.tensors.len()
        ));
    }
    for (a, b) in found.iter().zip(&f.tensors) {
        if a != b {
            return Err(format!(
                "its header has `{}` as {} {:?}, the manifest `{}` as {} {:?}",
                a.name, a.dtype, a.shape, b.name, b.dtype, b.shape
            ));
        }
    }
    Ok(())
}

/// The newest checkpoint of `dir` that reads back whole. Damaged or partial ones are skipped,
/// each with a note passed to `note`. `Ok(None)` when `dir` holds no checkpoint at all.
pub fn latest(
    dir: &Path,
    note: &mut dyn FnMut(String),
) -> Result<Option<Checkpoint>, CheckpointError> {
    let mut steps = list(dir)?;
    steps.sort();
    let mut skipped = Vec::new();
    for (_, path) in steps.into_iter().rev() {
        match load(&path) {
            Ok(c) => return Ok(Some(c)),
            Err(e @ CheckpointError::Damaged { .. }) => {
                note(format!("skipping checkpoint {e}"));
                skipped.push(e.to_string());
            }
            Err(e) => return Err(e),
        }
    }
    if skipped.is_empty() {
        Ok(None)
    } else {
        Err(CheckpointError::Damaged {
            path: dir.display().to_string(),
            message: format!("no complete checkpoint: {}", skipped.join("; ")),
        })
    }
}

impl Checkpoint {
    /// The full value of a tensor cut like `l`'s master shard, named `name` on each rank:
    /// the shards of rank 0's optimizer group in group order, padding dropped, in `l.shape`.
    fn assemble(&self, l: &ParamLayout, name: &str) -> Result<Tensor, CheckpointError> {
        let m = &self.manifest;
        let members = m.mesh.group_members(&l.optim_group, 0).ok_or_else(|| {
            damaged(
                &self.path,
                format!("the layout of `{}` names group {}", l.name, l.optim_group),
            )
        })?;
        let shard = l.padded / members.len().max(1);
        let mut flat: Vec<f32> = Vec::with_capacity(l.padded);
        for r in members {
            let (_, t) = self
                .ranks
                .get(r)
                .and_then(|vals| vals.iter().find(|(k, _)| k == name))
                .ok_or_else(|| damaged(&self.path, format!("rank {r} lacks `{name}`")))?;
            // master shards and optimizer states are f32, one chunk of the padded tensor
            if t.dtype() != DType::F32 || t.numel() != shard {
                return Err(damaged(
                    &self.path,
                    format!(
                        "rank {r}'s `{name}` is {}, the layout of `{}` says f32[{shard}]",
                        t.ty(),
                        l.name
                    ),
                ));
            }
            flat.extend(t.to_f32_vec());
        }
        if flat.len() != l.padded {
            return Err(damaged(
                &self.path,
                format!(
                    "`{name}`: {} elements over the group, the layout says {}",
                    flat.len(),
                    l.padded
                ),
            ));
        }
        flat.truncate(l.numel);
        Ok(Tensor::f32(l.shape.clone(), flat))
    }

    /// The full parameters, by name, in layout order.
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>, CheckpointError> {
        self.manifest
            .layouts
            .iter()
            .map(|l| Ok((l.name.clone(), self.assemble(l, &l.name)?)))
            .collect()
    }

    /// The values of a plan with `mesh` and `layouts` (another mesh, rank count or strategy
    /// than the writer's) whose persistent values are `want` (name and type per rank, as
    /// the plan declares them; compute shards are named by the layouts): parameters and
    /// optimizer states put back together and cut for it; compute shards cut from the
    /// parameters in their dtype; other states (the step counter) taken from rank 0. ACCO's
    /// states (named `acco.*`: half-batch gradients, the estimate, the primed flag) start
    /// from zero, so an ACCO plan resumed from another plan's checkpoint spends its first
    /// step priming (no update), and another plan drops them.
    pub fn reshard(
        &self,
        mesh: &Mesh,
        layouts: &[ParamLayout],
        want: &[Vec<(String, TensorType)>],
    ) -> Result<Vec<Vec<(String, Tensor)>>, CheckpointError> {
        let mismatch = |message: String| CheckpointError::Mismatch {
            path: self.path.display().to_string(),
            message,
        };
        // full tensors by name: parameters and their states
        let mut full: HashMap<String, Tensor> = HashMap::new();
        let mut compute_of: HashMap<&str, &ParamLayout> = HashMap::new();
        let mut sharded_like: HashMap<&str, &ParamLayout> = HashMap::new();
        for l in &self.manifest.layouts {
            full.insert(l.name.clone(), self.assemble(l, &l.name)?);
            for s in &l.states {
                full.insert(s.clone(), self.assemble(l, s)?);
            }
        }
        for l in layouts {
            let old = self
                .manifest
                .layouts
                .iter()
                .find(|o| o.name == l.name)
                .ok_or_else(|| {
                    mismatch(format!(
                        "the checkpoint has no parameter `{}`, which this plan trains",
                        l.name
                    ))
                })?;
            if old.shape != l.shape {
                return Err(mismatch(format!(
                    "parameter `{}` is {:?} in the checkpoint and {:?} in this plan",
                    l.name, old.shape, l.shape
                )));
            }
            // ACCO's own states (`acco.*`) are not carried to another plan (see below)
            let kept = |v: &[String]| v.iter().filter(|s| !s.starts_with(ACCO_PREFIX)).count();
            if kept(&old.states) != kept(&l.states) {
                return Err(mismatch(format!(
                    "parameter `{}` has optimizer states {:?} in the checkpoint and {:?} in this plan (another optimizer?)",
                    l.name, old.states, l.states
                )));
            }
            sharded_like.insert(l.name.as_str(), l);
            for s in &l.states {
                sharded_like.insert(s.as_str(), l);
            }
            compute_of.insert(l.compute_shard.as_str(), l);
        }
        if self.manifest.layouts.len() != layouts.len() {
            return Err(mismatch(format!(
                "the checkpoint trains {} parameters, this plan {}",
                self.manifest.layouts.len(),
                layouts.len()
            )));
        }
        let cut = |l: &ParamLayout, t: &Tensor, group: &hzp_ir::Group, r: usize| {
            let mut v = t.to_f32_vec();
            v.resize(l.padded, 0.0);
            let n = mesh.group_size(group).unwrap_or(1).max(1);
            let i = mesh.group_index(group, r).unwrap_or(0);
            let len = v.len() / n;
            v[i * len..(i + 1) * len].to_vec()
        };
        let mut out = Vec::with_capacity(want.len());
        for (r, names) in want.iter().enumerate() {
            let mut vals = Vec::with_capacity(names.len());
            for (name, ty) in names {
                let t = if name.starts_with(ACCO_PREFIX) {
                    // the half-batch gradients and estimate belong to the writer's ranks and
                    // batch halves: the run primes again (its next step commits no update)
                    Tensor::zeros(ty)
                } else if let Some(l) = sharded_like.get(name.as_str()) {
                    let f = full
                        .get(name.as_str())
                        .ok_or_else(|| mismatch(format!("the checkpoint has no `{name}`")))?;
                    Tensor::f32(ty.shape.clone(), cut(l, f, &l.optim_group, r))
                } else if let Some(l) = compute_of.get(name.as_str()) {
                    let f = &full[&l.name];
                    let c: Vec<f64> = cut(l, f, &l.params_group, r)
                        .into_iter()
                        .map(|x| x as f64)
                        .collect();
                    Tensor::from_f64(ty.dtype, ty.shape.clone(), &c)
                } else {
                    let (_, t) =
                        self.ranks[0]
                            .iter()
                            .find(|(k, _)| k == name)
                            .ok_or_else(|| {
                                mismatch(format!(
                                    "the checkpoint has no state `{name}`, which this plan keeps"
                                ))
                            })?;
                    t.clone()
                };
                if t.ty() != *ty {
                    return Err(mismatch(format!(
                        "`{name}` would be {} for rank {r}, the plan keeps {ty}",
                        t.ty()
                    )));
                }
                vals.push((name.clone(), t));
            }
            out.push(vals);
        }
        Ok(out)
    }
}
