//! Model frontends: everything that turns a user's model into an [`hzp_ir::Program`].
//!
//! - [`onnx`]: ONNX files exported from PyTorch (legacy and dynamo exporters).
//! - [`presets`]: GPT / Llama / MoE programs by config, shapes only.
//! - [`npz`]: reading and writing `.npz` tensor archives (inputs, outputs, weights).

pub mod npz;
pub mod onnx;
pub mod presets;
