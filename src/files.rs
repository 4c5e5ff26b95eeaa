//! The files a command reads and writes: the input guard (never write over a file the
//! command reads, sidecars included) and the one way output files are written
//! ([`hzp_frontends::output`]).

use hzp_frontends::{hzp_file, npz, output};
use hzp_ir::Tensor;
use miette::{miette, Result};
use std::path::{Path, PathBuf};

/// Every file reading the model `spec` touches: the model itself and, for a `.hzp` file,
/// its `.weights.npz` sidecar. Presets read no file.
pub fn model_files(spec: &str) -> Vec<PathBuf> {
    if spec.starts_with("preset:") {
        return Vec::new();
    }
    let p = PathBuf::from(spec);
    let mut out = vec![p.clone()];
    if p.extension().is_some_and(|e| e.eq_ignore_ascii_case("hzp")) {
        out.push(hzp_file::weights_path(&p));
    }
    out
}

/// The identity of an existing file: (device, inode) on Unix, its canonical path elsewhere.
#[cfg(unix)]
fn identity(p: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()))
}

#[cfg(not(unix))]
fn identity(p: &Path) -> Option<PathBuf> {
    std::fs::canonicalize(p).ok()
}

/// Refuses to write `out` when it is one of `inputs` (the same file under any name: a
/// symlink, a hard link, `./x` for `x`).
pub fn check_not_input<P: AsRef<Path>>(out: &Path, inputs: &[P]) -> Result<()> {
    if let Some(o) = identity(out) {
        for i in inputs {
            if identity(i.as_ref()).as_ref() == Some(&o) {
                return Err(miette!(
                    "refusing to write {}: it is {}, which this command reads",
                    out.display(),
                    if i.as_ref() == out {
                        "one of the input files".to_string()
                    } else {
                        format!("the same file as {}", i.as_ref().display())
                    }
                ));
            }
        }
    }
    Ok(())
}

/// Checks an output path before any work is done: not one of `inputs`, and a target that
/// [`output::write_with`] will accept (regular file or absent, writable).
pub fn check_output<P: AsRef<Path>>(out: &Path, inputs: &[P]) -> Result<()> {
    check_not_input(out, inputs)?;
    output::check_target(out).map_err(|e| miette!("{e}"))
}

/// Writes `bytes` to `out` safely, after the input guard.
pub fn write_bytes<P: AsRef<Path>>(out: &Path, inputs: &[P], bytes: &[u8]) -> Result<()> {
    check_not_input(out, inputs)?;
    output::write_bytes(out, bytes).map_err(|e| miette!("{e}"))
}

/// Writes tensors as an `.npz` to `out` safely, after the input guard.
pub fn write_npz<P: AsRef<Path>>(
    out: &Path,
    inputs: &[P],
    tensors: &[(String, Tensor)],
) -> Result<()> {
    check_not_input(out, inputs)?;
    npz::write(out, tensors).map_err(|e| miette!("{e}"))
}

/// Writes parameters for `--save-params`: safetensors when `out` ends in `.safetensors`
/// (what `safetensors.torch.load_file` reads), else an `.npz`.
pub fn write_params<P: AsRef<Path>>(
    out: &Path,
    inputs: &[P],
    tensors: &[(String, Tensor)],
) -> Result<()> {
    if out
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"))
    {
        let bytes = hzp_runtime::checkpoint::to_safetensors(tensors).map_err(|e| miette!("{e}"))?;
        write_bytes(out, inputs, &bytes)
    } else {
        write_npz(out, inputs, tensors)
    }
}
