//! `hzp checkpoint show|export` and `hzp data prepare`.

use crate::Format;
use hzp_runtime::checkpoint;
use miette::{miette, Result};
use std::path::{Path, PathBuf};

/// `hzp checkpoint ...`
#[derive(clap::Subcommand)]
pub enum CheckpointWhat {
    /// Steps, model, mesh, strategy and sizes of a checkpoint folder (step-NNNNNN/) or of
    /// every checkpoint in a --checkpoint-dir.
    Show {
        /// A checkpoint (step-NNNNNN/) or a folder of them.
        dir: PathBuf,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Write the full parameters of a checkpoint (the newest complete one of a folder),
    /// keyed by the model's initializer names, as .safetensors or .npz.
    Export {
        /// A checkpoint (step-NNNNNN/) or a folder of them.
        dir: PathBuf,
        /// A .safetensors or .npz file (by extension).
        #[arg(short, long, value_name = "OUT", default_value = "params.safetensors")]
        output: PathBuf,
    },
}

/// `hzp data ...`
#[derive(clap::Subcommand)]
pub enum DataWhat {
    /// Turn text files into a byte-level token file (vocabulary 256, one little-endian u16
    /// per byte, nanoGPT's raw format). Folders are walked (files in name order).
    Prepare {
        /// Files or folders.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// Only files whose name ends with this (e.g. .py) when walking folders.
        #[arg(long, value_name = "SUFFIX")]
        suffix: Option<String>,
        /// The training tokens.
        #[arg(short, long, value_name = "train.bin")]
        output: PathBuf,
        /// Also write the last --val-fraction of the bytes here (held out).
        #[arg(long, value_name = "val.bin")]
        val_output: Option<PathBuf>,
        #[arg(long, default_value_t = 0.1)]
        val_fraction: f64,
    },
}

/// The checkpoint folders `dir` names: itself when it holds a manifest, else its
/// `step-NNNNNN` folders (oldest first).
fn checkpoints_in(dir: &Path) -> Result<Vec<PathBuf>> {
    if dir.join(checkpoint::MANIFEST).is_file() {
        return Ok(vec![dir.to_path_buf()]);
    }
    if !dir.is_dir() {
        return Err(miette!("{}: not a folder", dir.display()));
    }
    let mut list = checkpoint::list(dir).map_err(|e| miette!("{e}"))?;
    list.sort();
    if list.is_empty() {
        return Err(miette!(
            "{}: no checkpoint (no manifest.json, no step-NNNNNN folders)",
            dir.display()
        ));
    }
    Ok(list.into_iter().map(|(_, p)| p).collect())
}

pub fn checkpoint_cmd(what: &CheckpointWhat) -> Result<()> {
    match what {
        CheckpointWhat::Show { dir, format } => {
            let mut rows = Vec::new();
            for path in checkpoints_in(dir)? {
                let row = match checkpoint::verify(&path) {
                    Ok(m) => {
                        let bytes: u64 = m.files.iter().map(|f| f.bytes).sum();
                        let params: usize = m.layouts.iter().map(|l| l.numel).sum();
                        serde_json::json!({
                            "path": path.display().to_string(),
                            "step": m.step,
                            "model": m.model,
                            "model_fingerprint": m.model_fingerprint,
                            "strategy": m.strategy,
                            "mesh": m.mesh.to_string(),
                            "ranks": m.world_size(),
                            "parameters": params,
                            "bytes": bytes,
                            "lr": m.lr,
                            "samples": m.data.as_ref().map(|d| d.samples),
                            "complete": true,
                        })
                    }
                    Err(e) => serde_json::json!({
                        "path": path.display().to_string(),
                        "complete": false,
                        "error": e.to_string(),
                    }),
                };
                rows.push(row);
            }
            if *format == Format::Json {
                let s = serde_json::to_string_pretty(&rows).map_err(|e| miette!("{e}"))?;
                outln!("{s}");
                return Ok(());
            }
            for r in &rows {
                if r["complete"] == true {
                    outln!(
                        "{}: step {}, {} ({} parameters, fingerprint {}...), {} on {} ({} ranks), {}, lr {:.3e}{}",
                        r["path"].as_str().unwrap_or(""),
                        r["step"],
                        r["model"].as_str().unwrap_or(""),
                        r["parameters"],
                        r["model_fingerprint"].as_str().unwrap_or("").chars().take(12).collect::<String>(),
                        r["strategy"].as_str().unwrap_or(""),
                        r["mesh"].as_str().unwrap_or(""),
                        r["ranks"],
                        hzp_ir::plan::format_bytes(r["bytes"].as_u64().unwrap_or(0)),
                        r["lr"].as_f64().unwrap_or(0.0),
                        r["samples"].as_u64().map_or(String::new(), |s| format!(", {s} samples read"))
                    );
                } else {
                    outln!(
                        "{}: not a complete checkpoint ({})",
                        r["path"].as_str().unwrap_or(""),
                        r["error"].as_str().unwrap_or("")
                    );
                }
            }
            Ok(())
        }
        CheckpointWhat::Export { dir, output } => {
            // the output may be no checkpoint it could read, nor lie inside one
            let ins: Vec<(String, PathBuf)> = if dir.join(checkpoint::MANIFEST).is_file() {
                vec![("the checkpoint exported".into(), dir.clone())]
            } else {
                checkpoint::list(dir)
                    .map_err(|e| miette!("{e}"))?
                    .into_iter()
                    .map(|(_, p)| (format!("a checkpoint in {}", dir.display()), p))
                    .collect()
            };
            crate::files::check_outputs(&[("-o", output.as_path())], &ins)?;
            // one checkpoint, or the newest complete one of a folder (as --resume picks it)
            let c = if dir.join(checkpoint::MANIFEST).is_file() {
                checkpoint::load(dir).map_err(|e| miette!("{e}"))?
            } else {
                checkpoint::latest(dir, &mut |n| eprintln!("note: {n}"))
                    .map_err(|e| miette!("{e}"))?
                    .ok_or_else(|| {
                        miette!(
                            "{}: no checkpoint (no manifest.json, no step-NNNNNN folders)",
                            dir.display()
                        )
                    })?
            };
            let mut params = c.parameters().map_err(|e| miette!("{e}"))?;
            // PyTorch's ties by the model's name map (beside the model the checkpoint names):
            // every state_dict key is written, so a strict load_state_dict takes the file
            let names = c.manifest.names.as_deref().map(Path::new);
            let map = hzp_frontends::names::find_for_model(&c.manifest.model, names)
                .map_err(|e| miette!("the checkpoint's model {}: {e}", c.manifest.model))?;
            if let Some(map) = map {
                params = crate::commands::with_tied_copies(
                    params,
                    &crate::commands::map_ties(Some(&map)),
                    "",
                );
            }
            let ext = output.extension().and_then(|e| e.to_str()).unwrap_or("");
            match ext {
                "safetensors" => {
                    let bytes = checkpoint::to_safetensors(&params).map_err(|e| miette!("{e}"))?;
                    crate::files::write_bytes(output, &[dir.as_path()], &bytes)?;
                }
                "npz" => crate::files::write_npz(output, &[dir.as_path()], &params)?,
                _ => {
                    return Err(miette!(
                        "-o {}: give a .safetensors or .npz file name",
                        output.display()
                    ))
                }
            }
            outln!(
                "exported {} parameters of {} (step {}) to {}",
                params.len(),
                c.path.display(),
                c.manifest.step,
                output.display()
            );
            Ok(())
        }
    }
}

fn walk(p: &Path, suffix: Option<&str>, out: &mut Vec<PathBuf>) -> Result<()> {
    let m = std::fs::metadata(p).map_err(|e| miette!("{}: {e}", p.display()))?;
    if m.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(p)
            .map_err(|e| miette!("{}: {e}", p.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for e in entries {
            let is_dir = e.is_dir();
            let keep = is_dir
                || suffix.is_none_or(|s| {
                    e.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.ends_with(s))
                });
            if keep {
                walk(&e, suffix, out)?;
            }
        }
    } else if m.is_file() {
        out.push(p.to_path_buf());
    }
    Ok(())
}

pub fn data_cmd(what: &DataWhat) -> Result<()> {
    let DataWhat::Prepare {
        inputs,
        suffix,
        output,
        val_output,
        val_fraction,
    } = what;
    if !(0.0..1.0).contains(val_fraction) {
        return Err(miette!(
            "--val-fraction must be in [0, 1), got {val_fraction}"
        ));
    }
    let mut files = Vec::new();
    for i in inputs {
        walk(i, suffix.as_deref(), &mut files)?;
    }
    let mut bytes = Vec::new();
    for f in &files {
        if Some(f.as_path()) == Some(output.as_path()) || val_output.as_deref() == Some(f.as_path())
        {
            continue;
        }
        bytes.extend(std::fs::read(f).map_err(|e| miette!("{}: {e}", f.display()))?);
    }
    if bytes.is_empty() {
        return Err(miette!("no bytes read from {} file(s)", files.len()));
    }
    let ins: Vec<(&str, &Path)> = files
        .iter()
        .map(|p| ("an input file", p.as_path()))
        .collect();
    let mut outs = vec![("-o", output.as_path())];
    outs.extend(val_output.as_deref().map(|v| ("--val-output", v)));
    crate::files::check_outputs(&outs, &ins)?;
    let n_val = if val_output.is_some() {
        (bytes.len() as f64 * val_fraction) as usize
    } else {
        0
    };
    let split = bytes.len() - n_val;
    crate::files::write_bytes(
        output,
        &files,
        &hzp_frontends::tokens::byte_tokens(&bytes[..split]),
    )?;
    outln!(
        "{}: {} byte-level tokens (vocabulary 256, u16) from {} file(s)",
        output.display(),
        split,
        files.len()
    );
    if let Some(v) = val_output {
        crate::files::write_bytes(
            v,
            &files,
            &hzp_frontends::tokens::byte_tokens(&bytes[split..]),
        )?;
        outln!("{}: {} tokens held out", v.display(), n_val);
    }
    Ok(())
}
