//! `.hzp` model files: the IR's text form plus a sidecar `<stem>.weights.npz` holding
//! parameter data and the constants too large to print inline.

use crate::npz;
use hzp_ir::{text, Program, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The sidecar weights file of a `.hzp` file: `dir/model.hzp` -> `dir/model.weights.npz`.
pub fn weights_path(hzp: &Path) -> PathBuf {
    let stem = hzp
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    hzp.with_file_name(format!("{stem}.weights.npz"))
}

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum HzpFileError {
    #[error("cannot read {path}: {cause}")]
    Io { path: String, cause: std::io::Error },
    #[error(transparent)]
    #[diagnostic(transparent)]
    Parse(#[from] text::ParseError),
    #[error(transparent)]
    Npz(#[from] npz::NpzError),
    #[error(transparent)]
    Write(#[from] crate::output::WriteError),
}

/// Loads `path` and, if present, its sidecar weights.
pub fn load(path: &Path) -> Result<Program, HzpFileError> {
    let src = crate::limits::read_regular_string(path).map_err(|cause| HzpFileError::Io {
        path: path.display().to_string(),
        cause,
    })?;
    let wpath = weights_path(path);
    let weights: HashMap<String, Tensor> = if wpath.exists() {
        npz::read(&wpath)?.into_iter().collect()
    } else {
        HashMap::new()
    };
    let lookup = |name: &str| weights.get(name).cloned();
    Ok(text::parse(&src, &path.display().to_string(), &lookup)?)
}

/// The tensors that go into the sidecar (see [`text::sidecar_entries`]).
pub fn sidecar_tensors(p: &Program) -> Vec<(String, Tensor)> {
    text::sidecar_entries(p)
        .into_iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect()
}

/// Writes `path` (text) and its sidecar (if there is any data), each through
/// [`crate::output::write_with`], so a failure never leaves a half-written file.
pub fn save(path: &Path, p: &Program) -> Result<(), HzpFileError> {
    let tensors = sidecar_tensors(p);
    // Both targets are checked before either is written.
    crate::output::check_target(path)?;
    if !tensors.is_empty() {
        crate::output::check_target(&weights_path(path))?;
        npz::write(&weights_path(path), &tensors)?;
    }
    crate::output::write_bytes(path, text::print(p).as_bytes())?;
    Ok(())
}
