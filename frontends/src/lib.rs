//! Model frontends: everything that turns a user's model into an [`hzp_ir::Program`].
//!
//! - [`onnx`]: ONNX files exported from PyTorch (legacy and dynamo exporters).
//! - [`hzp_file`]: hzp's own text form (`.hzp`) with its sidecar weights.
//! - [`presets`]: GPT / Llama / MoE programs by config, shapes only.
//! - [`npz`]: reading and writing `.npz` tensor archives (inputs, outputs, weights).
//! - [`output`]: the one safe way every command writes a file.
//!
//! [`load_model`] picks the frontend from the model argument the user gave.

pub mod attention;
pub mod hzp_file;
pub mod limits;
pub mod moe;
pub mod names;
pub mod npz;
pub mod onnx;
pub mod output;
pub mod presets;
pub mod tokens;

use hzp_ir::Program;
use std::collections::BTreeMap;
use std::path::Path;

/// How to read a model: bindings for symbolic input dims (ONNX exports).
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Input name -> static shape, from `--shape NAME=AxB` or the arrays of `--inputs`.
    pub shapes: BTreeMap<String, Vec<usize>>,
    /// Input values a value that decides a shape may be computed from (the arrays of
    /// `--inputs`); see [`onnx::ImportOptions::values`].
    pub values: BTreeMap<String, hzp_ir::Tensor>,
    /// `--bind NAME=1,2,3`: input values as numbers; see [`onnx::ImportOptions::bind`].
    pub bind: BTreeMap<String, Vec<f64>>,
    /// `--no-fuse-attention`: keep an ONNX model's attention as the exporter wrote it
    /// (products, mask, softmax) instead of one fused `Attention` op per layer
    /// ([`attention::fuse_attention`]).
    pub no_fuse_attention: bool,
    /// `--no-fuse-moe`: keep an ONNX model's mixture-of-experts blocks as the exporter
    /// wrote them (each choice's expert weights gathered) instead of the routed form
    /// ([`moe::fuse_moe`]).
    pub no_fuse_moe: bool,
    /// Read shapes only (`hzp show`): see [`onnx::ImportOptions::shapes_only`].
    pub shapes_only: bool,
    /// `--names FILE`: the name map of an ONNX model. Without it, `<stem>.names.json` beside
    /// the model is read when it exists ([`names::find_for_model`]).
    pub names: Option<std::path::PathBuf>,
}

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum LoadError {
    #[error(transparent)]
    Onnx(#[from] onnx::ImportError),
    #[error(transparent)]
    #[diagnostic(transparent)]
    Hzp(#[from] hzp_file::HzpFileError),
    #[error(transparent)]
    Preset(#[from] presets::PresetError),
    #[error("{0}")]
    Unknown(String),
}

/// Reads a model given as `path.onnx`, `path.hzp` or `preset:NAME[,key=value...]`.
pub fn load_model(spec: &str, opts: &LoadOptions) -> Result<Program, LoadError> {
    let names = names::find_for_model(spec, opts.names.as_deref()).map_err(LoadError::Unknown)?;
    if spec.starts_with("preset:") {
        return Ok(presets::parse_preset_with(spec, !opts.no_fuse_attention)?);
    }
    let path = Path::new(spec);
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    if !path.exists() {
        return Err(LoadError::Unknown(format!(
            "model `{spec}` does not exist (give an .onnx file, an .hzp file, or preset:NAME; presets: {})",
            presets::preset_names().join(", ")
        )));
    }
    match ext.as_deref() {
        Some("onnx") => {
            let o = onnx::ImportOptions {
                shapes: opts.shapes.clone(),
                values: opts.values.clone(),
                bind: opts.bind.clone(),
                shapes_only: opts.shapes_only,
                names: names.map(std::sync::Arc::new),
            };
            let mut p = onnx::import_file(path, &o)?;
            if !opts.no_fuse_attention {
                attention::fuse_attention(&mut p).map_err(|e| {
                    LoadError::Unknown(format!(
                        "{spec}: fusing attention failed ({e}); --no-fuse-attention keeps it explicit"
                    ))
                })?;
            }
            if !opts.no_fuse_moe && !opts.shapes_only {
                moe::fuse_moe(&mut p).map_err(|e| {
                    LoadError::Unknown(format!(
                        "{spec}: routing the mixture of experts failed ({e}); --no-fuse-moe keeps it as written"
                    ))
                })?;
            }
            Ok(p)
        }
        Some("hzp") => {
            let p = hzp_file::load(path)?;
            check_declared_inputs(&p, &opts.shapes, spec)?;
            Ok(p)
        }
        _ => Err(LoadError::Unknown(format!(
            "cannot tell what kind of model `{spec}` is: hzp reads .onnx files, .hzp files and preset:NAME"
        ))),
    }
}

/// A `.hzp` file declares its input shapes; a shape given for one of its inputs (by
/// `--shape`, or by an array of `--inputs`) must be that shape, or the program would be
/// built for one shape and run with another.
fn check_declared_inputs(
    p: &Program,
    shapes: &BTreeMap<String, Vec<usize>>,
    spec: &str,
) -> Result<(), LoadError> {
    for &v in &p.inputs {
        let val = p.value(v);
        if let Some(given) = shapes.get(&val.name) {
            if *given != val.ty.shape {
                return Err(LoadError::Unknown(format!(
                    "{spec} declares input `{}` as {}, but the shape given for it (by --shape or an array of --inputs{}) is {:?}: a .hzp file's input shapes are fixed; give that shape, or import the model again at the shape you want",
                    val.name,
                    val.ty,
                    ", after splitting the batch over ranks and micro-batches where the command does",
                    given
                )));
            }
        }
    }
    Ok(())
}
