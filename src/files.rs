//! The files a command reads and writes: the input guard (never write over a file the
//! command reads, sidecars included) and the one way output files are written
//! ([`hzp_frontends::output`]).

use hzp_frontends::{hzp_file, npz, output};
use hzp_ir::Tensor;
use miette::{miette, Result};
use std::path::{Path, PathBuf};

/// Every file reading the model `spec` touches: the model itself, a `.hzp` file's
/// `.weights.npz` sidecar, and the external-data files an ONNX model names. Presets read
/// no file.
pub fn model_files(spec: &str) -> Vec<PathBuf> {
    if spec.starts_with("preset:") {
        return Vec::new();
    }
    let p = PathBuf::from(spec);
    let mut out = vec![p.clone()];
    if p.extension().is_some_and(|e| e.eq_ignore_ascii_case("hzp")) {
        out.push(hzp_file::weights_path(&p));
    }
    if p.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("onnx"))
    {
        out.extend(hzp_frontends::onnx::external_data_files(&p));
    }
    out
}

/// The files of the model `spec`, each with the role it plays (for [`check_outputs`]).
pub fn model_roles(spec: &str, what: &str) -> Vec<(String, PathBuf)> {
    model_files(spec)
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let role = if i == 0 {
                what.to_string()
            } else {
                format!("a file of {what}")
            };
            (role, p)
        })
        .collect()
}

/// `p` made absolute, its longest existing prefix resolved (links, `..`) and the rest
/// appended as written (`.` dropped, `..` taken back): the name a file will have once
/// written, for comparing paths that do not exist yet.
fn resolved(p: &Path) -> PathBuf {
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()
            .unwrap_or_else(|_| PathBuf::from("."))
            .join(p)
    };
    let mut base = abs.clone();
    let mut rest: Vec<std::ffi::OsString> = Vec::new();
    loop {
        if let Ok(c) = std::fs::canonicalize(&base) {
            let mut out = c;
            for part in rest.iter().rev() {
                match part.to_str() {
                    Some(".") => {}
                    Some("..") => {
                        out.pop();
                    }
                    _ => out.push(part),
                }
            }
            return out;
        }
        match (base.file_name().map(|n| n.to_os_string()), base.parent()) {
            (Some(n), Some(parent)) => {
                rest.push(n);
                base = parent.to_path_buf();
            }
            _ => return abs,
        }
    }
}

/// Whether `a` and `b` name one file or folder (or will, once written).
pub fn same_path(a: &Path, b: &Path) -> bool {
    resolved(a) == resolved(b) || matches!((identity(a), identity(b)), (Some(x), Some(y)) if x == y)
}

/// Whether `p` lies strictly inside the folder `dir`.
pub fn inside(p: &Path, dir: &Path) -> bool {
    let (p, d) = (resolved(p), resolved(dir));
    p != d && p.starts_with(&d)
}

/// The one rule for the files of an invocation, checked before any work starts: no output
/// is (under any name: links, `./x`) or lies inside any input (a file, or a folder such as
/// the checkpoint being resumed or exported), and no two outputs are one path. Each role
/// is a phrase naming the flag (`--save-params`, `the model the plan names`); the message
/// names both roles. Each output must also be a target [`output::write_with`] accepts.
pub fn check_outputs<R: AsRef<str>, P: AsRef<Path>, S: AsRef<str>, Q: AsRef<Path>>(
    outputs: &[(R, P)],
    inputs: &[(S, Q)],
) -> Result<()> {
    let ins: Vec<(&str, &Path, PathBuf)> = inputs
        .iter()
        .map(|(r, p)| (r.as_ref(), p.as_ref(), resolved(p.as_ref())))
        .collect();
    let mut seen: Vec<(&str, &Path, PathBuf)> = Vec::new();
    for (role, out) in outputs {
        let (role, out) = (role.as_ref(), out.as_ref());
        let r = resolved(out);
        for (irole, ipath, ir) in &ins {
            let same = *ir == r
                || matches!((identity(out), identity(ipath)), (Some(a), Some(b)) if a == b);
            if same {
                let what = if out == *ipath {
                    format!("it is {irole}")
                } else {
                    format!("it is the same file as {irole} ({})", ipath.display())
                };
                return Err(miette!(
                    "refusing to write {role} {}: {what}, which this command reads; give {role} another path",
                    out.display(),
                ));
            }
            if ipath.is_dir() && r.starts_with(ir) {
                return Err(miette!(
                    "refusing to write {role} {}: it is inside {irole} ({}), which this command reads; give {role} a path outside it",
                    out.display(),
                    ipath.display()
                ));
            }
        }
        for (orole, opath, or) in &seen {
            let same = *or == r
                || matches!((identity(out), identity(opath)), (Some(a), Some(b)) if a == b);
            if same {
                return Err(miette!(
                    "{orole} ({}) and {role} ({}) are the same file: the second would overwrite the first; give each its own path",
                    opath.display(),
                    out.display()
                ));
            }
        }
        output::check_target(out).map_err(|e| miette!("{e}"))?;
        seen.push((role, out, r));
    }
    Ok(())
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
