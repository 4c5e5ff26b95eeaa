//! Every exported test model imports, verifies, keeps its names, has the expected
//! parameters, and (where hzp's CPU evaluator can run it) reproduces PyTorch's output.

mod onnx_util;
#[path = "../../tests/common/skip.rs"]
mod skip;

use hzp_frontends::onnx::proto::{self, ModelProto};
use hzp_frontends::onnx::{import_file, ImportErrorKind, ImportOptions};
use hzp_ir::{DType, Program, Tensor, ValueDef};
use prost::Message;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

const DIRS: [&str; 2] = [
    concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/models"),
    // the shared folder beside the checkout (`../shared` from the repository root)
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/onnx"),
];

fn models() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for (k, d) in DIRS.into_iter().enumerate() {
        let Ok(rd) = std::fs::read_dir(d) else {
            // the project's own models are committed; ../shared may be absent
            assert!(k > 0, "{d}: the project's own test models are missing");
            skip::skip(
                "",
                skip::Missing::Shared,
                &format!("{d} is absent: its models are not tested here"),
            );
            continue;
        };
        let mut v: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "onnx"))
            .collect();
        v.sort();
        out.extend(v);
    }
    out
}

/// `gpt2_tiny.dynamo.op18.onnx` -> `gpt2_tiny.io.npz` next to it.
fn io_npz(model: &Path) -> PathBuf {
    let name = model.file_name().unwrap().to_string_lossy();
    let stem = name.split('.').next().unwrap();
    model.with_file_name(format!("{stem}.io.npz"))
}

fn read_npz(p: &Path) -> Option<Vec<(String, Tensor)>> {
    if !p.exists() {
        return None;
    }
    Some(hzp_frontends::npz::read(p).unwrap_or_else(|e| panic!("{e}")))
}

fn decode(p: &Path) -> ModelProto {
    ModelProto::decode(std::fs::read(p).unwrap().as_slice()).unwrap()
}

/// Input shapes: from the `.io.npz` where there is one, else [2, 16] for every input.
fn shapes_for(m: &ModelProto, model: &Path) -> ImportOptions {
    let g = m.graph.as_ref().unwrap();
    let inits: HashSet<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
    let mut o = ImportOptions::default();
    let io = read_npz(&io_npz(model));
    for i in g.input.iter().filter(|i| !inits.contains(i.name.as_str())) {
        let s = io
            .as_ref()
            .and_then(|io| io.iter().find(|(n, _)| *n == i.name))
            .map(|(_, t)| t.shape.clone())
            .unwrap_or_else(|| vec![2, 16]);
        o.shapes.insert(i.name.clone(), s);
    }
    o
}

/// The parameters the importer's documented rule predicts, computed from the file directly:
/// float initializers of rank >= 1 that some node reads, minus those the exporter's graph
/// signature calls buffers, minus those read only as shape/index arithmetic (none in these
/// models, checked by listing them).
fn expected_params(m: &ModelProto) -> BTreeMap<String, usize> {
    let g = m.graph.as_ref().unwrap();
    let sig = g
        .metadata_props
        .iter()
        .find(|p| p.key == "pkg.torch.export.ExportedProgram.graph_signature")
        .map(|p| p.value.clone())
        .unwrap_or_default();
    let buffers: HashSet<String> = sig
        .lines()
        .filter(|l| l.contains(": BUFFER "))
        .filter_map(|l| {
            l.split("target='")
                .nth(1)?
                .split('\'')
                .next()
                .map(String::from)
        })
        .collect();
    let read: HashSet<&str> = g
        .node
        .iter()
        .flat_map(|n| n.input.iter().map(|s| s.as_str()))
        .collect();
    g.initializer
        .iter()
        .filter(|t| {
            matches!(t.data_type, 1 | 10 | 11 | 16)
                && !t.dims.is_empty()
                && read.contains(t.name.as_str())
                && !buffers.contains(&t.name)
        })
        .map(|t| (t.name.clone(), t.dims.iter().product::<i64>() as usize))
        .collect()
}

fn check_model(path: &Path) -> Program {
    let m = decode(path);
    let opts = shapes_for(&m, path);
    let p = import_file(path, &opts).unwrap_or_else(|e| panic!("{e}"));
    let g = m.graph.as_ref().unwrap();

    // Name and interface.
    let stem = path.file_stem().unwrap().to_string_lossy();
    assert_eq!(p.name, stem);
    let out_names: Vec<&str> = p
        .outputs
        .iter()
        .map(|&o| p.value(o).name.as_str())
        .collect();
    let want_outs: Vec<&str> = g.output.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(out_names, want_outs, "{}", path.display());
    let in_names: Vec<&str> = p.inputs.iter().map(|&i| p.value(i).name.as_str()).collect();
    let want_ins: Vec<&str> = opts.shapes.keys().map(|s| s.as_str()).collect();
    let mut sorted = in_names.clone();
    sorted.sort();
    assert_eq!(sorted, want_ins);
    for &i in &p.inputs {
        assert_eq!(p.ty(i).shape, opts.shapes[&p.value(i).name]);
    }

    // Parameters: exactly the predicted float initializers, same names, same data.
    let want = expected_params(&m);
    let got: BTreeMap<String, usize> = p
        .params
        .iter()
        .map(|pr| (p.value(pr.value).name.clone(), p.ty(pr.value).numel()))
        .collect();
    assert_eq!(got, want, "{}", path.display());
    assert_eq!(p.num_parameters() as usize, want.values().sum::<usize>());
    for pr in &p.params {
        let name = &p.value(pr.value).name;
        let t = g.initializer.iter().find(|t| &t.name == name).unwrap();
        let data = pr.data.as_ref().expect("imported parameters carry data");
        assert_eq!(data.dtype(), DType::F32);
        let raw: Vec<f32> = t
            .raw_data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let want = if raw.is_empty() {
            t.float_data.clone()
        } else {
            raw
        };
        assert_eq!(data.to_f32_vec(), want, "data of {name}");
    }

    // No shape arithmetic is left: no Shape-like ops exist in the IR, and every Reshape
    // target is static by construction; check nothing integer-valued is computed from a
    // shape at run time (all integer nodes must depend on an input).
    for n in &p.nodes {
        for &o in &n.outputs {
            assert!(matches!(p.value(o).def, ValueDef::Node { .. }));
        }
    }

    // Declared intermediate types (dynamo files carry value_info) match where they survive.
    let syms: HashMap<&str, usize> = [("batch", 2), ("sequence", 16)].into_iter().collect();
    let names = p.names();
    let mut checked = 0;
    for v in &g.value_info {
        let Some(&id) = names.get(v.name.as_str()) else {
            continue;
        };
        let Some(proto::type_proto::Value::TensorType(t)) =
            v.r#type.as_ref().and_then(|t| t.value.as_ref())
        else {
            continue;
        };
        let ty = p.ty(id);
        let want_dt = match t.elem_type {
            1 => DType::F32,
            7 => DType::I64,
            9 => DType::Bool,
            6 => DType::I32,
            _ => continue,
        };
        assert_eq!(ty.dtype, want_dt, "value_info of `{}`", v.name);
        let Some(shape) = &t.shape else { continue };
        assert_eq!(shape.dim.len(), ty.shape.len(), "rank of `{}`", v.name);
        for (d, &x) in shape.dim.iter().zip(&ty.shape) {
            use proto::tensor_shape_proto::dimension::Value as DV;
            match &d.value {
                Some(DV::DimValue(w)) => {
                    assert_eq!(*w as usize, x, "dims of `{}`: {:?}", v.name, ty.shape)
                }
                Some(DV::DimParam(s)) => {
                    if let Some(&w) = syms.get(s.as_str()) {
                        assert_eq!(w, x, "dims of `{}`", v.name)
                    }
                }
                None => {}
            }
        }
        checked += 1;
    }
    println!(
        "{}: {} nodes, {} params ({} elements), {} consts, {checked} value_info entries checked",
        path.display(),
        p.nodes.len(),
        p.params.len(),
        p.num_parameters(),
        p.consts.len()
    );
    p
}

#[test]
fn every_test_model_imports_and_verifies() {
    let files = models();
    assert!(!files.is_empty(), "no ONNX models found");
    for f in files {
        check_model(&f);
    }
}

/// Compares hzp's CPU evaluation of each imported model with PyTorch's output.
#[test]
fn imported_models_reproduce_pytorch_outputs() {
    for f in models() {
        let Some(io) = read_npz(&io_npz(&f)) else {
            skip::skip(
                "imported_models_reproduce_pytorch_outputs",
                skip::Missing::Other,
                &format!("no inputs for {}: not evaluated", f.display()),
            );
            continue;
        };
        let m = decode(&f);
        let p = check_model(&f);
        let input_names: Vec<String> = p.inputs.iter().map(|&i| p.value(i).name.clone()).collect();
        let inputs: Vec<(String, Tensor)> = io
            .iter()
            .filter(|(n, _)| input_names.contains(n))
            .cloned()
            .collect();
        let want = &io
            .iter()
            .find(|(n, _)| n == "torch_out")
            .expect("torch_out")
            .1;
        let outs = hzp_kernels::eval::evaluate(&p, &inputs)
            .unwrap_or_else(|e| panic!("{}: evaluation failed: {e}", f.display()));
        let out_name = &m.graph.as_ref().unwrap().output[0].name;
        let got = &outs.iter().find(|(n, _)| n == out_name).unwrap().1;
        assert_eq!(got.shape, want.shape, "{}", f.display());
        let (g, w) = (got.to_f32_vec(), want.to_f32_vec());
        let max = g
            .iter()
            .zip(&w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!("{}: max |hzp - torch| = {max:e}", f.display());
        assert!(max < 1e-4, "{}: max abs difference {max}", f.display());
    }
}

#[test]
fn symbolic_dims_need_bindings_and_shared_symbols_bind_together() {
    let dir = Path::new(DIRS[0]);
    let gpt = dir.join("gpt2_tiny.dynamo.op18.onnx");
    if gpt.exists() {
        let e = import_file(&gpt, &ImportOptions::default()).unwrap_err();
        assert_eq!(e.kind, ImportErrorKind::Shapes);
        let msg = e.to_string();
        for w in [
            "gpt2_tiny.dynamo.op18.onnx",
            "`input_ids` [batch, sequence]",
            "--shape",
            "--inputs",
        ] {
            assert!(msg.contains(w), "{msg}");
        }
        // Wrong rank and a contradiction with a fixed dim.
        let e = import_file(&gpt, &onnx_util::opts(&[("input_ids", &[2, 16, 1])])).unwrap_err();
        assert!(
            e.message.contains("rank 3") && e.message.contains("rank 2"),
            "{e}"
        );
        // An npz may carry reference outputs: names that are not inputs are ignored.
        let p = import_file(
            &gpt,
            &onnx_util::opts(&[("input_ids", &[3, 7]), ("torch_out", &[1])]),
        )
        .unwrap();
        assert_eq!(p.ty(p.outputs[0]).shape, vec![3, 7, 256]);
    }
    let bert = dir.join("bert_tiny.legacy.op17.onnx");
    if bert.exists() {
        // attention_mask and token_type_ids share [batch, sequence] with input_ids.
        let p = import_file(&bert, &onnx_util::opts(&[("input_ids", &[2, 5])])).unwrap();
        for &i in &p.inputs {
            assert_eq!(p.ty(i).shape, vec![2, 5], "{}", p.value(i).name);
        }
        let e = import_file(
            &bert,
            &onnx_util::opts(&[("input_ids", &[2, 5]), ("attention_mask", &[3, 5])]),
        )
        .unwrap_err();
        assert!(
            e.message.contains("`batch`") && e.message.contains("attention_mask"),
            "{e}"
        );
    }
}

#[test]
fn truncated_real_model_is_a_clear_error() {
    for f in models().into_iter().take(2) {
        let b = std::fs::read(&f).unwrap();
        for cut in [b.len() / 2, b.len() - 1, 7] {
            let e = hzp_frontends::onnx::import_bytes(
                &b[..cut],
                None,
                "cut.onnx",
                &ImportOptions::default(),
            )
            .unwrap_err();
            assert_eq!(e.kind, ImportErrorKind::Decode, "{e}");
            assert!(e.to_string().starts_with("cannot import cut.onnx: "), "{e}");
        }
    }
}

/// Independent ground truth for the parameter rule: every imported parameter is one of
/// PyTorch's `named_parameters()` (equal, or equal with the last two axes swapped, which is
/// how exporters store linear weights), and every PyTorch parameter is imported at least once.
#[test]
fn parameters_match_pytorch_named_parameters() {
    for f in models() {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        let stem = name.split('.').next().unwrap();
        let grads = f.with_file_name(format!("{stem}.grads.npz"));
        let Some(g) = read_npz(&grads) else {
            skip::skip(
                "parameters_match_pytorch_named_parameters",
                skip::Missing::Other,
                &format!("no {}: its parameters are not compared", grads.display()),
            );
            continue;
        };
        let torch: Vec<(String, Tensor)> = g
            .into_iter()
            .filter_map(|(n, t)| n.strip_prefix("param/").map(|s| (s.to_string(), t)))
            .collect();
        let m = decode(&f);
        let p = import_file(&f, &shapes_for(&m, &f)).unwrap();
        let swap = |t: &Tensor| -> Option<Tensor> {
            let r = t.shape.len();
            if r < 2 {
                return None;
            }
            let (a, b) = (t.shape[r - 2], t.shape[r - 1]);
            let batch = t.numel() / (a * b).max(1);
            let v = t.to_f32_vec();
            let mut out = vec![0f32; v.len()];
            for z in 0..batch {
                for i in 0..a {
                    for j in 0..b {
                        out[z * a * b + j * a + i] = v[z * a * b + i * b + j];
                    }
                }
            }
            let mut s = t.shape.clone();
            s.swap(r - 2, r - 1);
            Some(Tensor::f32(s, out))
        };
        let mut matched = vec![false; torch.len()];
        for pr in &p.params {
            let d = pr.data.as_ref().unwrap();
            let hit = torch
                .iter()
                .position(|(_, t)| t == d || swap(t).as_ref() == Some(d));
            let i = hit.unwrap_or_else(|| {
                panic!(
                    "{name}: parameter `{}` is none of PyTorch's parameters",
                    p.value(pr.value).name
                )
            });
            matched[i] = true;
        }
        for (k, (n, _)) in torch.iter().enumerate() {
            assert!(
                matched[k],
                "{name}: PyTorch parameter `{n}` was not imported as a parameter"
            );
        }
    }
}
