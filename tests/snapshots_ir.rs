//! Snapshots of the printed IR of the project's own tiny models (batch 2, sequence 16).
//! Re-bless with `INSTA_UPDATE=always cargo test --test snapshots_ir` after reviewing a diff.

mod common;
use common::*;

fn snapshot(file: &str) {
    let dir = own_models_dir();
    let model = file.split('.').next().unwrap();
    let io = read_npz(&dir.join(format!("{model}.io.npz")));
    let p = import(&dir.join(file), &io);
    let text = hzp_ir::text::print(&p);
    insta::assert_snapshot!(file.replace('.', "_"), text);
}

#[test]
fn gpt2_legacy() {
    snapshot("gpt2_tiny.legacy.op17.onnx");
}

#[test]
fn gpt2_dynamo() {
    snapshot("gpt2_tiny.dynamo.op18.onnx");
}

#[test]
fn llama_dynamo() {
    snapshot("llama_tiny.dynamo.op18.onnx");
}

#[test]
fn bert_legacy() {
    snapshot("bert_tiny.legacy.op17.onnx");
}

#[test]
fn moe_dynamo() {
    snapshot("moe_tiny.dynamo.op18.onnx");
}
