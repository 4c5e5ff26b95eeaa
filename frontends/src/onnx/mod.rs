//! ONNX importer: reads a `.onnx` file (opsets 13 to 25 of the default domain) exported from
//! PyTorch (TorchScript or dynamo exporter) into an [`hzp_ir::Program`].
//!
//! What it does, in order:
//! 1. decodes the protobuf ([`proto`], prost messages with ONNX's field numbers);
//! 2. checks the opsets, that every name read is defined, orders the nodes topologically
//!    (a cycle is an error naming its nodes) and finds the nodes the outputs depend on;
//! 3. lists every op type it cannot translate in one error;
//! 4. binds symbolic input dims from [`ImportOptions::shapes`] (one error lists every input
//!    still unbound);
//! 5. translates node by node, folding constants as it goes: a node whose inputs are all
//!    known at import time is evaluated with hzp's CPU kernels and becomes a constant, so
//!    shape subgraphs (`Shape -> Gather -> Unsqueeze -> Concat -> Reshape`) end as one
//!    `Reshape` with a static target;
//! 6. removes dead code and runs hzp's verifier.
//!
//! Only nodes some graph output depends on are translated (dead nodes may use any op).
//!
//! **Parameters.** An initializer becomes a trainable parameter when it holds floats and its
//! values meet run-time data, i.e. it flows (through any chain of ops) into a node that also
//! reads a value computed from the graph inputs. Everything else is a constant, folded where
//! possible:
//! - integer and bool initializers;
//! - rank-0 float initializers: exporters store literals such as `0.5`, `1e-6` or `sqrt(2)`
//!   that way (the dynamo exporter does); one that the exporter's graph signature
//!   (`pkg.torch.export.ExportedProgram.graph_signature` metadata) names as a PARAMETER stays
//!   a parameter;
//! - initializers that graph signature names as a BUFFER or CONSTANT_TENSOR (e.g.
//!   `model.rotary_emb.inv_freq`);
//! - float initializers consumed only as shape/index arithmetic (they reach only Reshape
//!   targets, Slice bounds and the like, or nothing that depends on the inputs);
//! - float initializers nothing (live) reads are dropped.
//!
//! Parameter names are the initializer names exactly, in initializer order; graph inputs and
//! outputs keep their ONNX names (an output whose value has another name gets an `Identity`).
//! Tied weights that the exporter stored twice (e.g. a transposed copy of an embedding)
//! become two parameters.
//!
//! **Dtypes.** hzp has no float64, so DOUBLE initializers, constants, graph inputs and casts
//! to DOUBLE are carried out in f32 (documented precision loss, the same rule as hzp's `.npz`
//! reader); narrow integer data and inputs (INT8, UINT8, INT16, UINT16) are read as i32 and
//! UINT32/UINT64 as i64 (values kept exactly), but casts *to* those types are rejected
//! (their wrap-around would be lost).
//!
//! **Ops.** [`supported_op_types`] lists the default-domain ops; `com.microsoft`'s
//! `SimplifiedLayerNormalization` is read as RMSNorm. Ops whose ONNX inputs are really
//! attributes (Reshape's shape, Slice's bounds, reduce axes, TopK's k, ...) need those inputs
//! to be computable at import time. When such a value is computed from graph inputs whose
//! values were given ([`ImportOptions::values`], [`ImportOptions::bind`]), the import is done
//! again with those inputs folded as constants: the program is *specialized* on them and
//! records their values ([`hzp_ir::Program::specialized`]), and the evaluator refuses other
//! values. Without a value the error names the node and the input and says how to give one.
//! `Dropout` in training mode (a non-zero ratio) draws its mask at import as ONNX's
//! reference implementation does, numpy's `RandomState(seed).uniform` (`onnx/mt19937.rs`; without
//! a `seed` attribute, the FNV-1a hash of the node's first output name seeds it): the mask is
//! a constant of the program, the same in every evaluation and training step.

mod ctx;
mod error;
mod graph;
mod mt19937;
mod ops;
pub mod proto;
mod rename;
mod tensor;
mod translate;

pub use error::{ImportError, ImportErrorKind};
pub use tensor::encode_tensor;

use hzp_ir::Program;
use std::collections::BTreeMap;
use std::path::Path;

/// Options of an import.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ImportOptions {
    /// Shapes for graph inputs, by input name (from `--shape input_ids=2x16` or from the
    /// arrays of an inputs `.npz`). Needed for inputs with symbolic dims; an input whose
    /// symbolic dims all appear in other bound inputs (e.g. `attention_mask [batch,
    /// sequence]` next to a bound `input_ids [batch, sequence]`) is bound from them. Names
    /// that are not graph inputs are ignored (an inputs `.npz` may hold reference outputs).
    pub shapes: BTreeMap<String, Vec<usize>>,
    /// Values of graph inputs, by input name (the arrays of an inputs `.npz`). Used only for
    /// an input from which a value that decides a shape is computed (a `Reshape` target,
    /// `Slice` bounds, reduce axes, `TopK`'s k, ...): the program is then specialized on it
    /// (see [`hzp_ir::Program::specialized`]). Other names are ignored.
    pub values: BTreeMap<String, hzp_ir::Tensor>,
    /// Values given as numbers (`--bind NAME=1,2,3`), read with the input's declared element
    /// type; the shape is the input's (bound or declared), or `[n]` for a rank-1 input and a
    /// scalar for a rank-0 one. Takes precedence over `values`.
    pub bind: BTreeMap<String, Vec<f64>>,
    /// Shapes only (`hzp show`): results computed at import (folded constants) are computed
    /// while they fit [`SHAPES_ONLY_BUDGET`] bytes together (so a model at ordinary shapes
    /// imports exactly as without this); past it, a result is not computed: an op with an IR
    /// equivalent stays a run-time op, a `Range` or a training-mode `Dropout` mask becomes a
    /// `Fill` of its type (a placeholder: its values are wrong, its type is right), and a
    /// value that decides a shape cannot come from one (an error says so). Such a program is
    /// for its types, counts and parameters (what `show` prints), never for evaluation.
    pub shapes_only: bool,
    /// A name map ([`crate::names::NameMap`], from `hzp_export.py`): applied to the model
    /// before translation, so parameters are named by their PyTorch `state_dict` keys, in
    /// PyTorch's layout, one per PyTorch tensor.
    pub names: Option<std::sync::Arc<crate::names::NameMap>>,
}

/// With [`ImportOptions::shapes_only`], the bytes of import-time results computed before
/// larger ones are left uncomputed.
pub const SHAPES_ONLY_BUDGET: u64 = 256 << 20;

/// The op types of the default ONNX domain the importer translates, sorted.
pub fn supported_op_types() -> Vec<&'static str> {
    ops::default_domain_ops()
}

/// The opsets of the default ONNX domain the importer reads.
pub const OPSETS: std::ops::RangeInclusive<i64> = ctx::MIN_OPSET..=ctx::MAX_OPSET;

/// Imports an ONNX file. The program is named after the file stem; external data is read
/// from the file's folder.
pub fn import_file(path: &Path, opts: &ImportOptions) -> Result<Program, ImportError> {
    let display = path.display().to_string();
    let bytes = crate::limits::read_regular(path).map_err(|e| {
        ImportError::new(
            &display,
            ImportErrorKind::Io,
            format!("the file cannot be read: {e}"),
        )
    })?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => Path::new(".").to_path_buf(),
    };
    import_bytes(&bytes, Some(&dir), &display, opts)
}

/// The external-data files an ONNX model at `path` names (resolved against its folder,
/// each once, in first-use order): what a command reading the model also reads, so that no
/// output is written over one of them. A file that cannot be read or decoded names none
/// (importing it reports why).
pub fn external_data_files(path: &Path) -> Vec<std::path::PathBuf> {
    use prost::Message;
    let Ok(bytes) = crate::limits::read_regular(path) else {
        return Vec::new();
    };
    let Ok(model) = proto::ModelProto::decode(bytes.as_slice()) else {
        return Vec::new();
    };
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => Path::new(".").to_path_buf(),
    };
    let mut out: Vec<std::path::PathBuf> = Vec::new();
    let mut add = |t: &proto::TensorProto| {
        if t.data_location != proto::data_location::EXTERNAL {
            return;
        }
        for e in &t.external_data {
            if e.key == "location" && !e.value.is_empty() {
                let p = dir.join(&e.value);
                if !out.contains(&p) {
                    out.push(p);
                }
            }
        }
    };
    fn walk(g: &proto::GraphProto, add: &mut dyn FnMut(&proto::TensorProto)) {
        g.initializer.iter().for_each(&mut *add);
        for n in &g.node {
            for a in &n.attribute {
                a.t.iter().chain(&a.tensors).for_each(&mut *add);
                for sub in a.g.iter().chain(&a.graphs) {
                    walk(sub, add);
                }
            }
        }
    }
    if let Some(g) = &model.graph {
        walk(g, &mut add);
    }
    out
}

/// Imports an ONNX model from memory. `model_dir` is the folder external data paths are
/// relative to (`None`: a model with external data is rejected); `display_name` names the
/// model in errors and gives the program its name (its file stem).
pub fn import_bytes(
    bytes: &[u8],
    model_dir: Option<&Path>,
    display_name: &str,
    opts: &ImportOptions,
) -> Result<Program, ImportError> {
    let stem = Path::new(display_name)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "model".to_string());
    translate::import(bytes, model_dir, &stem, opts).map_err(|f| f.into_error(display_name))
}
