//! A PyTorch user's own model: fresh models (every norm all ones or, Gemma's `1 + w`, all
//! zeros; biases zero) of three families no other test uses (transformers' Granite with a
//! tied LM head, GPT-NeoX, Gemma),
//! exported by frontends/python/hzp_export.py with both exporters, from
//! tests/models/make_byo_models.py (files in tests/models/byo/).
//!
//! With the name map beside the model, hzp's parameters are PyTorch's: named by their
//! state_dict keys, in PyTorch's layout, tied only where PyTorch ties them; 5 AdamW steps
//! give PyTorch's losses and parameters (`<fam>.ref.npz`, computed by PyTorch), and
//! `--save-params` writes every state_dict key. Without a name map (`<fam>.plain.onnx`, as
//! `torch.onnx.export` writes it), hzp names the initializers the exporter merged.

mod common;
use common::hzp_bin;
use hzp_frontends::{load_model, npz, LoadOptions};
use hzp_ir::Tensor;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const FAMILIES: [&str; 3] = ["granite_byo", "neox_byo", "gemma_byo"];
const EXPORTERS: [&str; 2] = ["dynamo", "legacy"];

fn dir() -> PathBuf {
    common::repo().join("tests/models/byo")
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hzp-byo-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn read(path: &Path) -> Vec<(String, Tensor)> {
    npz::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn get<'a>(a: &'a [(String, Tensor)], k: &str) -> Option<&'a Tensor> {
    a.iter().find(|(n, _)| n == k).map(|(_, t)| t)
}

fn hzp(args: &[&str]) -> Output {
    let out = Command::new(hzp_bin()).args(args).output().unwrap();
    assert!(
        !matches!(out.status.code(), Some(101) | Some(70)),
        "hzp {args:?} panicked: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn ok(args: &[&str]) -> (String, String) {
    let out = hzp(args);
    let (o, e) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "hzp {args:?} failed:\n{o}{e}");
    (o, e)
}

fn fails(args: &[&str]) -> String {
    let out = hzp(args);
    assert_eq!(
        out.status.code(),
        Some(1),
        "hzp {args:?} should fail with 1: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn model(fam: &str, exporter: &str) -> String {
    dir()
        .join(format!("{fam}.{exporter}.onnx"))
        .display()
        .to_string()
}

fn io(fam: &str, exporter: &str) -> String {
    dir()
        .join(format!("{fam}.{exporter}.io.npz"))
        .display()
        .to_string()
}

/// PyTorch's parameter keys (the reference's `param/<key>`).
fn torch_keys(fam: &str) -> BTreeSet<String> {
    read(&dir().join(format!("{fam}.ref.npz")))
        .into_iter()
        .filter_map(|(k, _)| k.strip_prefix("param/").map(str::to_string))
        .collect()
}

#[test]
fn byo_parameters_are_named_by_state_dict_keys() {
    for fam in FAMILIES {
        let keys = torch_keys(fam);
        for ex in EXPORTERS {
            let opts = LoadOptions {
                shapes: BTreeMap::from([("input_ids".to_string(), vec![2, 8])]),
                ..Default::default()
            };
            let p = load_model(&model(fam, ex), &opts).unwrap();
            let names: BTreeSet<String> = p
                .params
                .iter()
                .map(|x| p.value(x.value).name.clone())
                .collect();
            // PyTorch's ties (the LM head of Granite and Gemma is their embedding): one
            // parameter, several keys; the map names them, the reference has every key.
            let mut want = keys.clone();
            let map: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(dir().join(format!("{fam}.{ex}.names.json"))).unwrap(),
            )
            .unwrap();
            for tie in map["ties"].as_array().unwrap() {
                for copy in &tie.as_array().unwrap()[1..] {
                    assert!(want.remove(copy.as_str().unwrap()), "{fam}: tie {tie}");
                }
            }
            assert_eq!(names, want, "{fam}.{ex}: parameters vs state_dict keys");
            // each in PyTorch's layout
            let refs = read(&dir().join(format!("{fam}.ref.npz")));
            for x in &p.params {
                let n = &p.value(x.value).name;
                let r = get(&refs, &format!("param/{n}")).unwrap();
                assert_eq!(p.ty(x.value).shape, r.shape, "{fam}.{ex}: `{n}`");
            }
        }
    }
    // A name map given with --names (not beside the model) is recorded in the plan, so
    // `hzp run` reads the model as the plan was compiled from it: its saved file has every
    // state_dict key.
    let fam = "granite_byo";
    let copy = tmp("moved.onnx");
    std::fs::copy(model(fam, "dynamo"), &copy).unwrap();
    let map = dir().join(format!("{fam}.dynamo.names.json"));
    let plan = tmp("moved.plan.json");
    ok(&[
        "compile",
        copy.to_str().unwrap(),
        "--names",
        map.to_str().unwrap(),
        "--inputs",
        &io(fam, "dynamo"),
        "--loss",
        "lm",
        "--mesh",
        "gpu=2",
        "-o",
        plan.to_str().unwrap(),
    ]);
    let saved = tmp("moved.params.npz");
    ok(&[
        "run",
        plan.to_str().unwrap(),
        "--inputs",
        &io(fam, "dynamo"),
        "--save-params",
        saved.to_str().unwrap(),
        "--checkpoint-dir",
        tmp("moved.ckpt").to_str().unwrap(),
    ]);
    let got: BTreeSet<String> = read(&saved).into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        got,
        torch_keys(fam),
        "keys saved by a run of a --names plan"
    );
    // and the checkpoint knows the map: its export has every key too
    let exported = tmp("moved.export.npz");
    ok(&[
        "checkpoint",
        "export",
        tmp("moved.ckpt").to_str().unwrap(),
        "-o",
        exported.to_str().unwrap(),
    ]);
    let got: BTreeSet<String> = read(&exported).into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        got,
        torch_keys(fam),
        "keys of a --names plan's exported checkpoint"
    );
}

#[test]
fn byo_exports_evaluate_to_pytorch_output() {
    for fam in FAMILIES {
        for ex in EXPORTERS {
            let (o, _) = ok(&[
                "eval",
                &model(fam, ex),
                "--inputs",
                &io(fam, ex),
                "--reference",
                &io(fam, ex),
                "--format",
                "json",
            ]);
            let v: serde_json::Value = serde_json::from_str(&o).unwrap();
            assert_eq!(v["within_tolerance"], true, "{fam}.{ex}: {o}");
            assert_eq!(v["outputs"][0]["reference"], "output", "{fam}.{ex}: {o}");
        }
    }
}

/// 5 AdamW steps (torch's defaults, hzp's defaults) with `--loss lm`: the losses within
/// 1e-5 and every state_dict key's tensor within 1e-4 relative of PyTorch's, over the
/// elements whose first gradient is not round-off (AdamW divides a gradient by its own RMS,
/// so an element whose gradient is zero in exact arithmetic, e.g. a key bias's, moves by
/// ~lr on round-off, differently on each side; those only have to stay within 1e-2).
#[test]
fn byo_five_adamw_steps_match_pytorch() {
    for fam in FAMILIES {
        let refs = read(&dir().join(format!("{fam}.ref.npz")));
        let gmax = refs
            .iter()
            .filter(|(k, _)| k.starts_with("grad/"))
            .flat_map(|(_, t)| t.to_f64_vec())
            .fold(0.0f64, |m, x| m.max(x.abs()));
        for ex in EXPORTERS {
            let out = tmp(&format!("{fam}.{ex}.safetensors"));
            let (o, _) = ok(&[
                "train",
                &model(fam, ex),
                "--inputs",
                &io(fam, ex),
                "--loss",
                "lm",
                "--steps",
                "5",
                "--format",
                "json",
                "--save-params",
                out.to_str().unwrap(),
            ]);
            let v: serde_json::Value = serde_json::from_str(&o).unwrap();
            let losses: Vec<f64> = v["losses"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            let want = get(&refs, "loss").unwrap().to_f64_vec();
            assert_eq!(losses.len(), 5);
            for (a, b) in losses.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-5,
                    "{fam}.{ex}: losses {losses:?} vs PyTorch {want:?}"
                );
            }
            check_against_pytorch(fam, &format!("{fam}.{ex}"), &out, &refs, gmax);
        }
        // The user's path on several ranks: compile for 2, run 5 steps with checkpoints,
        // export the last one; it has every state_dict key (what a strict load_state_dict
        // needs) and PyTorch's trained values.
        let plan = tmp(&format!("{fam}.adamw.plan.json"));
        ok(&[
            "compile",
            &model(fam, "dynamo"),
            "--inputs",
            &io(fam, "dynamo"),
            "--loss",
            "lm",
            "--mesh",
            "gpu=2",
            "-o",
            plan.to_str().unwrap(),
        ]);
        let ckpt = tmp(&format!("{fam}.adamw.ckpt"));
        ok(&[
            "run",
            plan.to_str().unwrap(),
            "--inputs",
            &io(fam, "dynamo"),
            "--steps",
            "5",
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ]);
        let out = tmp(&format!("{fam}.adamw.export.safetensors"));
        ok(&[
            "checkpoint",
            "export",
            ckpt.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ]);
        check_against_pytorch(
            fam,
            &format!("{fam} on 2 ranks, exported"),
            &out,
            &refs,
            gmax,
        );

        // A 4-rank plan equals one rank: the batch twice over (the same mean loss, so the
        // same steps as PyTorch's), on gpu=4 and on one rank, for either exporter.
        for ex in EXPORTERS {
            let inputs = read(Path::new(&io(fam, ex)));
            let ids = get(&inputs, "input_ids").unwrap();
            let mut rows = ids.to_i64_vec().unwrap();
            rows.extend_from_within(..);
            let mut shape = ids.shape.clone();
            shape[0] *= 2;
            let batch = tmp(&format!("{fam}.{ex}.batch4.npz"));
            npz::write(
                &batch,
                &[("input_ids".to_string(), Tensor::i64(shape, rows))],
            )
            .unwrap();
            let mut saved = Vec::new();
            for mesh in ["gpu=4", "gpu=1"] {
                let plan = tmp(&format!("{fam}.{ex}.{mesh}.plan.json"));
                ok(&[
                    "compile",
                    &model(fam, ex),
                    "--inputs",
                    batch.to_str().unwrap(),
                    "--loss",
                    "lm",
                    "--mesh",
                    mesh,
                    "-o",
                    plan.to_str().unwrap(),
                ]);
                let out = tmp(&format!("{fam}.{ex}.{mesh}.safetensors"));
                ok(&[
                    "run",
                    plan.to_str().unwrap(),
                    "--inputs",
                    batch.to_str().unwrap(),
                    "--steps",
                    "5",
                    "--save-params",
                    out.to_str().unwrap(),
                ]);
                check_against_pytorch(fam, &format!("{fam}.{ex} on {mesh}"), &out, &refs, gmax);
                saved.push(
                    hzp_runtime::checkpoint::from_safetensors(&std::fs::read(&out).unwrap())
                        .unwrap(),
                );
            }
            for (k, four) in &saved[0] {
                let one = get(&saved[1], k).unwrap();
                let grad = get(&refs, &format!("grad/{k}")).map(|g| g.to_f64_vec());
                let (a, b) = (four.to_f64_vec(), one.to_f64_vec());
                // elements whose gradient is round-off move by the learning rate either way
                let rel = rel_err(&a, &b, |i| {
                    grad.as_ref().is_none_or(|g| g[i].abs() >= 1e-6 * gmax)
                });
                assert!(
                    rel <= 1e-5,
                    "{fam}.{ex}: `{k}` on 4 ranks vs 1: rel err {rel:.3e}"
                );
            }
        }
    }
}

/// `|a - b| / |b|` (L2) over the elements `keep` selects.
fn rel_err(a: &[f64], b: &[f64], keep: impl Fn(usize) -> bool) -> f64 {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for i in (0..a.len()).filter(|&i| keep(i)) {
        d += (a[i] - b[i]).powi(2);
        n += b[i].powi(2);
    }
    d.sqrt() / n.sqrt().max(1e-12)
}

/// The parameters in the .safetensors file `out` against PyTorch's after 5 AdamW steps
/// (`refs`): every state_dict key, PyTorch's shapes, relative error below 1e-4 per tensor
/// (elements whose first gradient is round-off, below 1e-6 of the largest, only within
/// 1e-2: AdamW moves them by about the learning rate in a direction round-off decides).
fn check_against_pytorch(fam: &str, what: &str, out: &Path, refs: &[(String, Tensor)], gmax: f64) {
    let got = hzp_runtime::checkpoint::from_safetensors(&std::fs::read(out).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    let saved: BTreeSet<String> = got.iter().map(|(k, _)| k.clone()).collect();
    assert_eq!(saved, torch_keys(fam), "{what}: keys hzp saved");
    for (k, want) in refs.iter().filter(|(k, _)| k.starts_with("param/")) {
        let key = &k["param/".len()..];
        let have = get(&got, key).unwrap();
        assert_eq!(have.shape, want.shape, "{what}: `{key}`");
        let (a, b) = (have.to_f64_vec(), want.to_f64_vec());
        let grad = get(refs, &format!("grad/{key}")).unwrap().to_f64_vec();
        let real = |i: usize| grad[i].abs() >= 1e-6 * gmax;
        for i in (0..a.len()).filter(|&i| !real(i)) {
            assert!(
                (a[i] - b[i]).abs() <= 1e-2,
                "{what}: `{key}`[{i}] (gradient ~0) {} vs PyTorch {}",
                a[i],
                b[i]
            );
        }
        let rel = rel_err(&a, &b, real);
        assert!(
            rel < 1e-4,
            "{what}: `{key}` after 5 AdamW steps: rel err {rel:.3e}"
        );
    }
}

/// What `torch.onnx.export` gives without the helper: the exporter merged the constant
/// parameters. `show`, `train`, `grad` and `compile` name them; `--untie` gives each reader
/// its own parameter (and the warning for it goes).
#[test]
fn byo_plain_exports_name_the_merged_initializers() {
    // The merged initializers (what the exporter kept; checked in the files by
    // make_byo_models.py's listing): every RMSNorm of Granite is one all-ones tensor, every
    // LayerNorm weight of GPT-NeoX one too, and its LayerNorm biases one all-zeros tensor.
    let cases = [
        ("granite_byo", vec!["model.layers.0.input_layernorm.weight"]),
        (
            "neox_byo",
            vec![
                "gpt_neox.layers.0.input_layernorm.weight",
                "gpt_neox.layers.0.input_layernorm.bias",
            ],
        ),
    ];
    for (fam, merged) in cases {
        let plain = dir()
            .join(format!("{fam}.plain.onnx"))
            .display()
            .to_string();
        let inputs = io(fam, "dynamo");
        let (o, _) = ok(&["show", &plain, "--shape", "input_ids=2x8"]);
        assert!(
            !o.contains("none found"),
            "{fam}: show says none found:\n{o}"
        );
        for m in &merged {
            assert!(
                o.contains(&format!("`{m}` (every element")),
                "{fam}: show does not name `{m}` as merged:\n{o}"
            );
            assert!(
                o.contains(&format!("--untie {m}")),
                "{fam}: no fix for `{m}`:\n{o}"
            );
        }
        // no --retie hint for all-ones / all-zeros tensors (Granite's LM head, which the
        // exporter stored transposed beside the embedding, is a real tie and gets one)
        for line in o.lines().filter(|l| l.contains("--retie")) {
            assert!(
                merged.iter().all(|m| !line.contains(m)),
                "{fam}: --retie hinted for a constant tensor: {line}"
            );
        }
        if fam == "granite_byo" {
            assert!(
                o.contains("equals the transpose of `lm_head.weight`"),
                "{fam}: the tied head is not reported:\n{o}"
            );
        }
        let (_, e) = ok(&[
            "train", &plain, "--inputs", &inputs, "--loss", "lm", "--steps", "1",
        ]);
        for m in &merged {
            assert!(
                e.contains("warning:") && e.contains(&format!("`{m}`")),
                "{fam}: train does not warn of `{m}`:\n{e}"
            );
        }
        let grads = tmp(&format!("{fam}.plain.grads.npz"));
        let (_, e) = ok(&[
            "grad",
            &plain,
            "--inputs",
            &inputs,
            "--loss",
            "lm",
            "-o",
            grads.to_str().unwrap(),
        ]);
        assert!(e.contains(&format!("`{}`", merged[0])), "{fam}: grad:\n{e}");
        let plan = tmp(&format!("{fam}.plain.plan.json"));
        let (_, e) = ok(&[
            "compile",
            &plain,
            "--shape",
            "input_ids=2x8",
            "--mesh",
            "gpu=2",
            "-o",
            plan.to_str().unwrap(),
        ]);
        assert!(
            e.contains(&format!("`{}`", merged[0])),
            "{fam}: compile:\n{e}"
        );

        // --untie: one parameter per reader, and no warning for it
        let before = read(&grads).len();
        let untied = tmp(&format!("{fam}.untied.grads.npz"));
        let (_, e) = ok(&[
            "grad",
            &plain,
            "--inputs",
            &inputs,
            "--loss",
            "lm",
            "--untie",
            merged[0],
            "-o",
            untied.to_str().unwrap(),
        ]);
        assert!(e.contains("untie:"), "{fam}: {e}");
        assert!(
            !e.contains(&format!("warning: `{}`", merged[0])),
            "{fam}: still warned after --untie:\n{e}"
        );
        let after = read(&untied);
        assert!(
            after.len() > before,
            "{fam}: {} -> {} arrays",
            before,
            after.len()
        );
        assert!(get(&after, &format!("grad/{}.1", merged[0]))
            .or_else(|| get(&after, &format!("{}.1", merged[0])))
            .is_some());

        // A plan compiled with --untie records it, and `hzp run` repeats it on the model it
        // loads: its parameters, held-out evaluation and saved file are the untied model's,
        // and 2 SGD steps on 2 ranks equal 2 steps of `hzp train --untie` (one process).
        let plan = tmp(&format!("{fam}.untied.plan.json"));
        ok(&[
            "compile",
            &plain,
            "--inputs",
            &inputs,
            "--loss",
            "lm",
            "--mesh",
            "gpu=2",
            "--optimizer",
            "sgd",
            "--untie",
            merged[0],
            "-o",
            plan.to_str().unwrap(),
        ]);
        let tokens = tmp(&format!("{fam}.tokens.bin"));
        let ids: Vec<u8> = (0..4096u32)
            .flat_map(|i| (((i * 37 + 11) % 64) as u16).to_le_bytes())
            .collect();
        std::fs::write(&tokens, ids).unwrap();
        let (o, e) = ok(&[
            "run",
            plan.to_str().unwrap(),
            "--data",
            tokens.to_str().unwrap(),
            "--val-data",
            tokens.to_str().unwrap(),
            "--eval-every",
            "1",
        ]);
        assert!(
            format!("{o}{e}").contains("val_loss"),
            "{fam}: no held-out loss:\n{o}{e}"
        );
        let ran = tmp(&format!("{fam}.untied.run.npz"));
        ok(&[
            "run",
            plan.to_str().unwrap(),
            "--inputs",
            &inputs,
            "--steps",
            "2",
            "--save-params",
            ran.to_str().unwrap(),
        ]);
        let trained = tmp(&format!("{fam}.untied.train.npz"));
        ok(&[
            "train",
            &plain,
            "--inputs",
            &inputs,
            "--loss",
            "lm",
            "--steps",
            "2",
            "--optimizer",
            "sgd",
            "--untie",
            merged[0],
            "--save-params",
            trained.to_str().unwrap(),
        ]);
        let (ran, trained) = (read(&ran), read(&trained));
        assert_eq!(ran.len(), trained.len(), "{fam}: saved arrays differ");
        assert!(get(&ran, &format!("{}.1", merged[0])).is_some(), "{fam}");
        for (k, t) in &trained {
            let r = get(&ran, k).unwrap_or_else(|| panic!("{fam}: run did not save `{k}`"));
            let (a, b) = (t.to_f64_vec(), r.to_f64_vec());
            let worst = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs() / x.abs().max(1e-3))
                .fold(0.0, f64::max);
            assert!(worst <= 1e-5, "{fam}: `{k}` differs by {worst:e} relative");
        }
    }
}

/// A name map that does not fit the model is an error naming what does not fit.
#[test]
fn byo_name_map_that_does_not_match_is_an_error() {
    let fam = "neox_byo";
    let text = std::fs::read_to_string(dir().join(format!("{fam}.dynamo.names.json"))).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    // an initializer the model does not have
    let mut bad = v.clone();
    let inits = bad["initializers"].as_object_mut().unwrap();
    let first = inits.keys().next().unwrap().clone();
    let entry = inits.remove(&first).unwrap();
    inits.insert("no_such_initializer".into(), entry);
    let p = tmp("unknown.names.json");
    std::fs::write(&p, bad.to_string()).unwrap();
    let e = fails(&[
        "show",
        &model(fam, "dynamo"),
        "--shape",
        "input_ids=2x8",
        "--names",
        p.to_str().unwrap(),
    ]);
    assert!(e.contains("no_such_initializer"), "{e}");
    // a wrong shape
    v["parameters"]["gpt_neox.embed_in.weight"]["shape"] = serde_json::json!([3, 5]);
    let p = tmp("shape.names.json");
    std::fs::write(&p, v.to_string()).unwrap();
    let e = fails(&[
        "show",
        &model(fam, "dynamo"),
        "--shape",
        "input_ids=2x8",
        "--names",
        p.to_str().unwrap(),
    ]);
    assert!(
        e.contains("gpt_neox.embed_in.weight") && e.contains("[3, 5]"),
        "{e}"
    );
}

/// A reference file with two arrays that could be the output: an error naming both and
/// the flag that picks one (it used to compare nothing and report `within_tolerance: null`).
#[test]
fn eval_reference_with_two_candidates_is_an_error() {
    let fam = "neox_byo";
    let arrays = read(Path::new(&io(fam, "dynamo")));
    let ids = get(&arrays, "input_ids").unwrap().clone();
    let out = get(&arrays, "output").unwrap().clone();
    let refp = tmp("two.npz");
    npz::write(
        &refp,
        &[
            ("input_ids".into(), ids),
            ("torch_out".into(), out.clone()),
            ("logits_fp16".into(), out),
        ],
    )
    .unwrap();
    let args = [
        "eval",
        &model(fam, "dynamo"),
        "--inputs",
        &io(fam, "dynamo"),
        "--reference",
        refp.to_str().unwrap(),
    ];
    let e = fails(&args);
    assert!(
        e.contains("torch_out") && e.contains("logits_fp16") && e.contains("--reference-key"),
        "{e}"
    );
    let mut picked = args.to_vec();
    picked.extend(["--reference-key", "torch_out", "--format", "json"]);
    let (o, _) = ok(&picked);
    let v: serde_json::Value = serde_json::from_str(&o).unwrap();
    assert_eq!(v["within_tolerance"], true, "{o}");
    assert_eq!(v["outputs"][0]["reference"], "torch_out", "{o}");
}

/// Layers come from the program's repeated structure, not from names: the plain export
/// (weights renamed `val_N`, equal initializers merged) and the helper's name-preserving
/// export of one model give as many gather units, and, once the fixes hzp's warnings name
/// are applied (`--untie` the merged initializers, `--retie` the head the exporter stored
/// twice), the same collectives and simulated steps within 5%, for ZeRO-3 and for the
/// planner's own choice. (Gemma's plain export is another program: the exporter folded its
/// `1 + w` norms into the merged tensor, so the backward reads the parameter itself and
/// ZeRO-3 gathers it again; only its units are compared.)
#[test]
fn byo_plain_and_named_exports_plan_alike() {
    let layers = |path: &str| -> Vec<u64> {
        let (o, _) = ok(&["show", path, "--shape", "input_ids=8x8", "--format", "json"]);
        let v: serde_json::Value = serde_json::from_str(&o).unwrap();
        v["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["parameters"].as_u64().unwrap())
            .collect()
    };
    let plan =
        |path: &str, fam: &str, v: &str, strategy: Option<&str>, fixes: &[&str]| -> (f64, String) {
            let out = tmp(&format!(
                "{fam}.{v}.{}.plan.json",
                strategy.unwrap_or("auto")
            ));
            let _ = std::fs::remove_file(&out);
            let mut args = vec![
                "compile",
                path,
                "--shape",
                "input_ids=8x8",
                "--mesh",
                "node=2,gpu=4",
                "-o",
                out.to_str().unwrap(),
            ];
            if let Some(s) = strategy {
                args.extend(["--strategy", s]);
            }
            args.extend(fixes);
            ok(&args);
            let (o, _) = ok(&["simulate", out.to_str().unwrap()]);
            let step = o
                .lines()
                .find_map(|l| l.trim().strip_prefix("step time"))
                .and_then(|r| r.split_whitespace().next())
                .and_then(|x| x.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("no step time in:\n{o}"));
            let (o, _) = ok(&["inspect", out.to_str().unwrap()]);
            let collectives: String = o
                .lines()
                .skip_while(|l| !l.starts_with("collectives per step"))
                .take_while(|l| !l.trim().is_empty())
                .map(|l| l.split_whitespace().take(4).collect::<Vec<_>>().join(" ") + "\n")
                .collect();
            (step, collectives)
        };
    let fixes: [(&str, &[&str]); 2] = [
        (
            "granite_byo",
            &[
                "--untie",
                "model.layers.0.input_layernorm.weight",
                "--retie",
            ],
        ),
        (
            "neox_byo",
            &[
                "--untie",
                "gpt_neox.layers.0.input_layernorm.weight,gpt_neox.layers.0.input_layernorm.bias",
                "--untie",
                "gpt_neox.layers.0.attention.query_key_value.bias",
                "--untie",
                "gpt_neox.layers.0.mlp.dense_h_to_4h.bias",
            ],
        ),
    ];
    for fam in FAMILIES {
        let plain = dir()
            .join(format!("{fam}.plain.onnx"))
            .display()
            .to_string();
        let named = model(fam, "dynamo");
        let (lp, ln) = (layers(&plain), layers(&named));
        assert_eq!(lp.len(), ln.len(), "{fam}: layers {lp:?} vs {ln:?}");
        let Some((_, fixes)) = fixes.iter().find(|(f, _)| *f == fam) else {
            continue;
        };
        for strategy in [Some("zero3"), None] {
            let (sp, cp) = plan(&plain, fam, "plain", strategy, fixes);
            let (sn, cn) = plan(&named, fam, "dynamo", strategy, &[]);
            assert_eq!(cp, cn, "{fam} {strategy:?}: collectives differ");
            assert!(
                (sp - sn).abs() <= 0.05 * sn,
                "{fam} {strategy:?}: plain {sp} us vs name-preserving {sn} us"
            );
        }
    }
}
