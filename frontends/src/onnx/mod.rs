//! ONNX importer (being written).
