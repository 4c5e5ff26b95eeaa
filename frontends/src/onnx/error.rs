//! The importer's error type.

use std::fmt;

/// What went wrong, for callers and tests that want to tell cases apart. The message says
/// the same in words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ImportErrorKind {
    /// The file could not be read.
    Io,
    /// The bytes are not an ONNX model (empty, truncated, not protobuf, no graph).
    Decode,
    /// The model imports an opset or domain hzp does not read.
    Opset,
    /// The model uses op types (or attribute values) hzp has no translation for.
    Unsupported,
    /// The graph is malformed: a name nobody defines, a value defined twice, a cycle.
    Graph,
    /// A tensor's data is missing, inconsistent, or stored outside the model's folder.
    TensorData,
    /// Symbolic input dims are not bound, or a binding contradicts the declared shape.
    Shapes,
    /// A node cannot be translated (wrong inputs, a run-time value where hzp needs a
    /// constant, a type error).
    Node,
    /// The imported program failed hzp's verifier (an importer bug).
    Verify,
}

/// An import failure. Displays as one paragraph naming the file:
/// `cannot import model.onnx: node `/h.0/Reshape_3` (Reshape): ...`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, miette::Diagnostic)]
pub struct ImportError {
    /// The file (or the display name given to `import_bytes`).
    pub file: String,
    pub kind: ImportErrorKind,
    /// What went wrong, in the user's terms (ONNX node names, op types, initializer names).
    pub message: String,
}

impl fmt::Display for ImportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot import {}: {}", self.file, self.message)
    }
}

impl ImportError {
    pub(crate) fn new(file: &str, kind: ImportErrorKind, message: impl Into<String>) -> Self {
        ImportError {
            file: file.to_string(),
            kind,
            message: message.into(),
        }
    }
}

/// An error before the file name is attached.
#[derive(Clone, Debug)]
pub(crate) struct Fail {
    pub kind: ImportErrorKind,
    pub message: String,
    /// Graph inputs whose given values would let the import go on: a value that decides a
    /// shape is computed from them. The driver imports again, specialized on them.
    pub specialize: Vec<String>,
}

impl Fail {
    pub fn new(kind: ImportErrorKind, message: impl Into<String>) -> Fail {
        Fail {
            kind,
            message: message.into(),
            specialize: Vec::new(),
        }
    }

    pub fn into_error(self, file: &str) -> ImportError {
        ImportError::new(file, self.kind, self.message)
    }
}

pub(crate) type FResult<T> = Result<T, Fail>;

/// Shorthands.
pub(crate) fn node_err(message: impl Into<String>) -> Fail {
    Fail::new(ImportErrorKind::Node, message)
}

pub(crate) fn data_err(message: impl Into<String>) -> Fail {
    Fail::new(ImportErrorKind::TensorData, message)
}

pub(crate) fn graph_err(message: impl Into<String>) -> Fail {
    Fail::new(ImportErrorKind::Graph, message)
}
