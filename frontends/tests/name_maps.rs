//! Name maps (`hzp_frontends::names`) applied by the ONNX importer, on hand-built models:
//! an initializer the exporter merged (one all-ones tensor read by two nodes) split back
//! into the two PyTorch keys it stands for, a weight stored transposed named by its key in
//! PyTorch's layout, and maps that do not fit the model refused with the reason.

mod onnx_util;
use hzp_frontends::names::NameMap;
use hzp_frontends::onnx::{import_bytes, ImportOptions};
use hzp_ir::Tensor;
use onnx_util::*;
use std::path::Path;
use std::sync::Arc;

/// y = ((x * ones) * ones) @ wt, with `ones` [3] read by nodes `n1` and `n2`, and `wt`
/// [3, 4] (PyTorch's `lin.weight` [4, 3], transposed).
fn model() -> (M, Vec<f32>) {
    let wt: Vec<f32> = (0..12).map(|i| i as f32 * 0.25 - 1.0).collect();
    let mut m = M::new();
    m.inputs.push(vi("x", FLOAT, &[D::V(2), D::V(3)]));
    m.inits
        .push(init("ones", &Tensor::f32(vec![3], vec![1.0; 3])));
    m.inits
        .push(init("onnx::MatMul_1", &Tensor::f32(vec![3, 4], wt.clone())));
    m.nodes
        .push(node("Mul", "n1", &["x", "ones"], &["a"], vec![]));
    m.nodes
        .push(node("Mul", "n2", &["a", "ones"], &["b"], vec![]));
    m.nodes.push(node(
        "MatMul",
        "mm",
        &["b", "onnx::MatMul_1"],
        &["y"],
        vec![],
    ));
    m.outputs.push(out("y"));
    (m, wt)
}

fn map(v: serde_json::Value) -> Result<NameMap, String> {
    NameMap::from_json(&v, Path::new("m.names.json"))
}

fn with_map(m: &M, names: NameMap) -> Result<hzp_ir::Program, String> {
    let mut o: ImportOptions = opts(&[]);
    o.names = Some(Arc::new(names));
    import_bytes(&m.bytes(), None, "test.onnx", &o).map_err(|e| e.to_string())
}

fn good() -> serde_json::Value {
    serde_json::json!({
        "format": "hzp.names/1",
        "initializers": {
            "ones": [{"key": "ln1.weight", "transpose": false, "nodes": ["n1"]},
                     {"key": "ln2.weight", "transpose": false, "nodes": ["n2"]}],
            "onnx::MatMul_1": [{"key": "lin.weight", "transpose": true}]
        },
        "ties": [],
        "parameters": {"ln1.weight": {"shape": [3]}, "ln2.weight": {"shape": [3]},
                       "lin.weight": {"shape": [4, 3]}}
    })
}

#[test]
fn a_merged_initializer_becomes_one_parameter_per_key_and_transposes_are_undone() {
    let (m, wt) = model();
    let p = with_map(&m, map(good()).unwrap()).unwrap();
    let mut names: Vec<(String, Vec<usize>)> = p
        .params
        .iter()
        .map(|x| (p.value(x.value).name.clone(), p.ty(x.value).shape.clone()))
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![
            ("lin.weight".to_string(), vec![4, 3]),
            ("ln1.weight".to_string(), vec![3]),
            ("ln2.weight".to_string(), vec![3]),
        ]
    );
    // lin.weight holds PyTorch's layout: row o is column o of the stored transpose
    let lin = p
        .params
        .iter()
        .find(|x| p.value(x.value).name == "lin.weight")
        .unwrap();
    let data = lin.data.as_ref().unwrap().to_f32_vec();
    for o in 0..4 {
        for i in 0..3 {
            assert_eq!(data[o * 3 + i], wt[i * 4 + o]);
        }
    }
    // each Mul reads its own parameter
    let users = p.users();
    for key in ["ln1.weight", "ln2.weight"] {
        let v = p.find_value(key).unwrap();
        assert_eq!(users[v.index()].len(), 1, "`{key}` readers");
    }
    // the forward is the same function: y = x @ wt, computed here by hand
    let x: Vec<f32> = vec![0.5, -1.0, 2.0, 1.5, 0.25, -0.75];
    let y = run(&p, &[("x", Tensor::f32(vec![2, 3], x.clone()))]);
    let got = y[0].1.to_f32_vec();
    for r in 0..2 {
        for o in 0..4 {
            let want: f32 = (0..3).map(|i| x[r * 3 + i] * wt[i * 4 + o]).sum();
            assert!((got[r * 4 + o] - want).abs() < 1e-6, "y[{r},{o}]");
        }
    }
}

#[test]
fn maps_that_do_not_fit_the_model_are_refused() {
    let (m, _) = model();
    // untied keys on one initializer without saying which node reads which
    let mut v = good();
    v["initializers"]["ones"][0]
        .as_object_mut()
        .unwrap()
        .remove("nodes");
    let e = with_map(&m, map(v).unwrap()).unwrap_err();
    assert!(e.contains("`ones`") && e.contains("nodes"), "{e}");
    // a reader left out of every key's nodes
    let mut v = good();
    v["initializers"]["ones"][1]["nodes"] = serde_json::json!([]);
    let e = with_map(&m, map(v).unwrap()).unwrap_err();
    assert!(e.contains("`n2`") && e.contains("`ones`"), "{e}");
    // an initializer the model does not have
    let mut v = good();
    let e0 = v["initializers"]["ones"].clone();
    v["initializers"]["twos"] = e0;
    let e = with_map(&m, map(v).unwrap()).unwrap_err();
    assert!(e.contains("`twos`") && e.contains("does not have"), "{e}");
    // a wrong shape
    let mut v = good();
    v["parameters"]["lin.weight"]["shape"] = serde_json::json!([3, 4]);
    let e = with_map(&m, map(v).unwrap()).unwrap_err();
    assert!(e.contains("`lin.weight`") && e.contains("[3, 4]"), "{e}");
    // a key the map's parameters lack
    let mut v = good();
    v["parameters"]
        .as_object_mut()
        .unwrap()
        .remove("ln2.weight");
    let e = map(v).unwrap_err();
    assert!(e.contains("`ln2.weight`"), "{e}");
}

#[test]
fn tied_keys_share_one_parameter() {
    // `ones` is read by both Muls as one tensor PyTorch ties under two keys
    let (m, _) = model();
    let v = serde_json::json!({
        "initializers": {
            "ones": [{"key": "a.weight"}, {"key": "b.weight"}],
            "onnx::MatMul_1": [{"key": "lin.weight", "transpose": true}]
        },
        "ties": [["a.weight", "b.weight"]],
        "parameters": {"a.weight": {"shape": [3]}, "b.weight": {"shape": [3]},
                       "lin.weight": {"shape": [4, 3]}}
    });
    let names = map(v).unwrap();
    assert_eq!(
        names.tie_copies(),
        vec![("a.weight".to_string(), "b.weight".to_string())]
    );
    let p = with_map(&m, names).unwrap();
    let mut got: Vec<String> = p
        .params
        .iter()
        .map(|x| p.value(x.value).name.clone())
        .collect();
    got.sort();
    assert_eq!(got, vec!["a.weight", "lin.weight"]);
}
