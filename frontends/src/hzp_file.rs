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
}

/// Loads `path` and, if present, its sidecar weights.
pub fn load(path: &Path) -> Result<Program, HzpFileError> {
    let src = std::fs::read_to_string(path).map_err(|cause| HzpFileError::Io {
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

/// Writes `path` (text) and its sidecar (if there is any data). Both are written to a
/// temporary file first and renamed, so a failure never leaves a half-written file.
pub fn save(path: &Path, p: &Program) -> Result<(), HzpFileError> {
    let io = |cause| HzpFileError::Io {
        path: path.display().to_string(),
        cause,
    };
    let tensors = sidecar_tensors(p);
    if !tensors.is_empty() {
        npz::write(&weights_path(path), &tensors)?;
    }
    let tmp = path.with_extension("hzp.tmp");
    std::fs::write(&tmp, text::print(p)).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    Ok(())
}
