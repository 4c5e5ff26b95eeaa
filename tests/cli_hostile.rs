//! The CLI on hostile input: files it must not destroy, numbers it must refuse,
//! limits it must enforce, and exit codes (1 for every user error, never 101).

mod common;
use common::*;
use hzp_frontends::npz;
use hzp_ir::{Data, Tensor};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn gpt2() -> PathBuf {
    own_models_dir().join("gpt2_tiny.legacy.op17.onnx")
}

fn gpt2_io() -> PathBuf {
    own_models_dir().join("gpt2_tiny.io.npz")
}

fn llama() -> PathBuf {
    own_models_dir().join("llama_tiny.dynamo.op18.onnx")
}

fn llama_io() -> PathBuf {
    own_models_dir().join("llama_tiny.io.npz")
}

fn mlp() -> PathBuf {
    repo().join("examples/models/mlp.hzp")
}

fn mlp_io() -> PathBuf {
    repo().join("examples/models/mlp.io.npz")
}

fn is_root() -> bool {
    // SAFETY-free check: root owns /proc/self's process when its effective uid is 0.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

/// A private character device equal to /dev/full (major 1, minor 7) in `dir`, when root.
fn full_device(dir: &Path) -> Option<PathBuf> {
    if !is_root() {
        skip::skip(
            "",
            skip::Missing::Other,
            "not root, cannot mknod: the device-node case",
        );
        return None;
    }
    let p = dir.join("full");
    let ok = Command::new("mknod")
        .args([s(&p), "c", "1", "7"])
        .status()
        .is_ok_and(|st| st.success());
    if !ok {
        skip::skip(
            "",
            skip::Missing::Other,
            "mknod failed: the device-node case",
        );
        return None;
    }
    Some(p)
}

fn mkfifo(p: &Path) -> bool {
    Command::new("mkfifo")
        .arg(p)
        .status()
        .is_ok_and(|st| st.success())
}

fn is_char_device(p: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_char_device())
}

fn is_fifo(p: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_fifo())
}

// ------------------------------------------------------------------ safe output files

#[test]
fn output_to_a_device_node_is_refused_and_the_node_kept() {
    let d = tempdir("device");
    let Some(full) = full_device(&d) else { return };
    let (m, mi) = (mlp(), mlp_io());
    let err = fails_with(
        &["eval", s(&m), "--inputs", s(&mi), "-o", s(&full)],
        &["cannot write", "full", "character device"],
    );
    assert!(is_char_device(&full), "{err}");
    // The same for every kind of output: a plan, a trace, a picture, parameters.
    let args: Vec<Vec<&str>> = vec![
        vec![
            "compile",
            "preset:gpt,layers=2,hidden=64,heads=2,vocab=128,seq=16,batch=2",
            "--mesh",
            "gpu=2",
            "-o",
            s(&full),
        ],
        vec!["import", s(&m), "-o", s(&full)],
        vec![
            "train",
            s(&m),
            "--inputs",
            s(&mi),
            "--loss",
            "mse",
            "--target",
            "y",
            "--save-params",
            s(&full),
        ],
    ];
    for a in &args {
        fails_with(a, &["cannot write", "character device"]);
        assert!(is_char_device(&full), "{a:?} replaced the device node");
    }
}

#[test]
fn output_to_a_fifo_is_refused_without_blocking() {
    let d = tempdir("fifo");
    let fifo = d.join("out.npz");
    if !mkfifo(&fifo) {
        skip::skip("", skip::Missing::Other, "mkfifo is not available");
        return;
    }
    fails_with(
        &["eval", s(&mlp()), "--inputs", s(&mlp_io()), "-o", s(&fifo)],
        &["out.npz", "FIFO"],
    );
    assert!(is_fifo(&fifo));
    // And as an input: an error, not a hang (inputs, plans, cluster specs, traces).
    fails_with(
        &["eval", s(&mlp()), "--inputs", s(&fifo)],
        &["out.npz", "FIFO"],
    );
    fails_with(&["inspect", s(&fifo)], &["out.npz", "FIFO"]);
    fails_with(
        &[
            "compile",
            "preset:gpt",
            "--mesh",
            "gpu=2",
            "--cluster",
            s(&fifo),
        ],
        &["out.npz", "not a regular file"],
    );
}

#[test]
fn a_symlink_planted_at_the_old_temporary_name_is_not_followed() {
    let d = tempdir("symlink");
    let victim = d.join("victim.txt");
    std::fs::write(&victim, b"keep me").unwrap();
    let plan = d.join("plan.json");
    for name in ["plan.json.tmp", ".plan.json.tmp"] {
        std::os::unix::fs::symlink(&victim, d.join(name)).unwrap();
    }
    let (code, _, err) = hzp(&[
        "compile",
        "preset:gpt,layers=2,hidden=64,heads=2,vocab=128,seq=16,batch=2",
        "--mesh",
        "gpu=2",
        "-o",
        s(&plan),
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
    assert!(std::fs::read_to_string(&plan)
        .unwrap()
        .contains("content_hash"));
    // No temporary file is left behind.
    let left: Vec<String> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp") && n != "plan.json.tmp" && n != ".plan.json.tmp")
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn an_existing_read_only_file_is_kept() {
    let d = tempdir("readonly");
    let out = d.join("out.npz");
    std::fs::write(&out, b"precious").unwrap();
    let mut perm = std::fs::metadata(&out).unwrap().permissions();
    perm.set_readonly(true);
    std::fs::set_permissions(&out, perm).unwrap();
    fails_with(
        &["eval", s(&mlp()), "--inputs", s(&mlp_io()), "-o", s(&out)],
        &["out.npz", "read-only"],
    );
    assert_eq!(std::fs::read(&out).unwrap(), b"precious");
}

#[test]
fn the_input_guard_covers_sidecar_weights_and_links() {
    let d = tempdir("guard");
    // A copy of the .hzp model with its sidecar.
    let model = d.join("mlp.hzp");
    let weights = d.join("mlp.weights.npz");
    std::fs::copy(mlp(), &model).unwrap();
    std::fs::copy(repo().join("examples/models/mlp.weights.npz"), &weights).unwrap();
    let before = std::fs::read(&weights).unwrap();
    fails_with(
        &[
            "eval",
            s(&model),
            "--inputs",
            s(&mlp_io()),
            "-o",
            s(&weights),
        ],
        &["refusing to write", "mlp.weights.npz"],
    );
    fails_with(
        &[
            "train",
            s(&model),
            "--inputs",
            s(&mlp_io()),
            "--loss",
            "mse",
            "--target",
            "y",
            "--save-params",
            s(&weights),
        ],
        &["refusing to write", "mlp.weights.npz"],
    );
    // import -o over the model itself would write its sidecar over the input's sidecar.
    fails_with(
        &["import", s(&model), "-o", s(&model)],
        &["refusing to write"],
    );
    assert_eq!(std::fs::read(&weights).unwrap(), before);
    // A hard link to an input is the same file.
    let io = d.join("io.npz");
    std::fs::copy(mlp_io(), &io).unwrap();
    let link = d.join("link.npz");
    std::fs::hard_link(&io, &link).unwrap();
    fails_with(
        &["eval", s(&model), "--inputs", s(&io), "-o", s(&link)],
        &["refusing to write", "the same file as"],
    );
}

// ------------------------------------------------------------------ exit codes

#[test]
fn usage_errors_exit_1_and_help_exits_0() {
    for args in [
        vec![],
        vec!["no-such-command"],
        vec!["eval"],
        vec!["show", "preset:gpt", "--no-such-flag"],
        vec!["compile", "preset:gpt", "--micro-batches", "-3"],
    ] {
        let (code, _, err) = hzp(&args);
        assert_eq!(code, 1, "hzp {args:?}: {err}");
    }
    let (code, out, _) = hzp(&["--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("Usage"), "{out}");
    let (code, _, _) = hzp(&["--version"]);
    assert_eq!(code, 0);
}

#[test]
fn overflowing_sizes_are_errors_with_their_limit() {
    let preset = "preset:gpt,layers=2,hidden=64,heads=2,vocab=128,seq=16,batch=2";
    fails_with(
        &[
            "compile",
            preset,
            "--mesh",
            "node=4294967296,gpu=4294967296",
        ],
        &["--mesh", "1048576 ranks"],
    );
    fails_with(
        &[
            "compile",
            preset,
            "--mesh",
            "gpu=2",
            "--micro-batches",
            "9223372036854775808",
        ],
        &["--micro-batches 9223372036854775808", "limit of 65536"],
    );
    // A count that used to wrap to 8 in mesh x micro-batches.
    fails_with(
        &[
            "compile",
            s(&llama()),
            "--inputs",
            s(&llama_io()),
            "--mesh",
            "gpu=2",
            "--micro-batches",
            "9223372036854775812",
        ],
        &["limit of 65536"],
    );
    fails_with(
        &[
            "compile",
            preset,
            "--mesh",
            "gpu=2",
            "--prefetch-depth",
            "18446744073709551615",
        ],
        &["--prefetch-depth 18446744073709551615", "limit of 4096"],
    );
    fails_with(
        &["show", "preset:gpt,layers=100000"],
        &["`layers=100000`", "limit of 4096 layers"],
    );
}

#[test]
fn muon_flags_are_checked() {
    let io = mlp_io();
    let m = mlp();
    let base = [
        "train",
        s(&m),
        "--inputs",
        s(&io),
        "--loss",
        "mse",
        "--target",
        "y",
    ];
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).map(|x| x.to_string()).collect()
    };
    for (extra, needles) in [
        (
            &["--optimizer", "muon", "--muon-lr=-1"][..],
            &["--muon-lr -1", "Muon's learning rate"][..],
        ),
        (
            &["--optimizer", "muon", "--muon-lr=NaN"],
            &["--muon-lr NaN"],
        ),
        (
            &["--muon-lr", "0.1"],
            &["--muon-lr", "needs --optimizer muon"],
        ),
        (
            &["--optimizer", "sgd", "--muon-adjust-lr", "match_rms_adamw"],
            &["--muon-adjust-lr needs --optimizer muon"],
        ),
        (
            &["--optimizer", "muon", "--muon-adjust-lr", "spectral"],
            &[
                "'spectral'",
                "--muon-adjust-lr",
                "original, match_rms_adamw",
            ],
        ),
        (
            &["--optimizer", "muon", "--muon-ns-precision", "f16"],
            &["'f16'", "--muon-ns-precision", "bf16, fp32"],
        ),
        (
            &["--muon-ns-precision", "fp32"],
            &["--muon-ns-precision needs --optimizer muon"],
        ),
        (
            &["--optimizer", "muon", "--lr=0"],
            &["--lr must be above 0"],
        ),
        (
            &["--muon-placement", "canzona"],
            &["--muon-placement", "needs --optimizer muon"],
        ),
        (
            &["--optimizer", "muon", "--muon-placement", "sharded"],
            &["'sharded'", "--muon-placement", "replicated, canzona"],
        ),
        // hzp train runs one rank: no owners to choose among
        (
            &["--optimizer", "muon", "--muon-placement", "canzona"],
            &["--muon-placement canzona", "one-rank step"],
        ),
        // fc2 makes the output (the head) and fc1 is frozen: no matrix left for Muon
        (
            &["--optimizer", "muon", "--freeze", "fc1.weight"],
            &["no parameter Muon applies to", "use adamw"],
        ),
    ] {
        let a = with(extra);
        let a: Vec<&str> = a.iter().map(|x| x.as_str()).collect();
        fails_with(&a, needles);
    }
    // and the MLP's first layer is one: it trains
    let a = with(&["--optimizer", "muon", "--steps", "2"]);
    let a: Vec<&str> = a.iter().map(|x| x.as_str()).collect();
    let (code, out, err) = hzp(&a);
    assert_eq!(code, 0, "{out}{err}");
}

#[test]
fn nonsense_numbers_are_refused() {
    let io = mlp_io();
    let m = mlp();
    let base = [
        "train",
        s(&m),
        "--inputs",
        s(&io),
        "--loss",
        "mse",
        "--target",
        "y",
    ];
    for (flag, value, needle) in [
        ("--lr", "-1", "--lr -1"),
        ("--lr", "NaN", "--lr NaN"),
        ("--lr", "inf", "--lr inf"),
        ("--betas", "2,3", "--betas 2,3"),
        ("--betas", "0.9,NaN", "--betas 0.9,NaN"),
        ("--eps", "-1e-8", "--eps"),
        ("--weight-decay", "NaN", "--weight-decay NaN"),
        ("--clip-grad-norm", "-1", "--clip-grad-norm -1"),
        ("--clip-grad-norm", "0", "--clip-grad-norm 0"),
        ("--momentum", "-0.5", "--momentum -0.5"),
    ] {
        let mut a: Vec<&str> = base.to_vec();
        if flag == "--momentum" {
            a.extend(["--optimizer", "sgd"]);
        }
        // `--flag=VALUE`, so that clap takes a negative number as the value.
        let arg = format!("{flag}={value}");
        a.push(&arg);
        fails_with(&a, &[needle]);
    }
    for tol in ["NaN", "-1", "inf"] {
        fails_with(
            &[
                "eval",
                s(&gpt2()),
                "--inputs",
                s(&gpt2_io()),
                "--reference",
                s(&gpt2_io()),
                &format!("--tolerance={tol}"),
            ],
            &["--tolerance"],
        );
    }
    fails_with(
        &["compile", "preset:gpt", "--mesh", "gpu=2", "--memory=-5GiB"],
        &["--memory", "negative"],
    );
    fails_with(
        &["show", "preset:gpt", "--input-budget=-1"],
        &["--input-budget"],
    );
    // the older name still works, with a note
    let (code, _, err) = hzp(&["show", "preset:gpt", "--max-memory", "1GiB"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("--max-memory is now --input-budget"), "{err}");
}

#[test]
fn thread_counts_are_capped_with_a_note() {
    let (code, out, err) = hzp_env(
        &["eval", s(&mlp()), "--inputs", s(&mlp_io())],
        &[("HZP_NUM_THREADS", "100000")],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("evaluated"), "{out}");
    assert!(
        err.contains("HZP_NUM_THREADS=100000 is more than this machine's"),
        "{err}"
    );
}

/// `hzp bench compile --layers`: one row per layer count and the ratio from each to the
/// next; a preset that already sets layers, a zero count and several meshes are refused.
#[test]
fn the_layers_benchmark_reports_ratios_and_refuses_nonsense() {
    let preset = "preset:gpt,hidden=64,heads=2,vocab=128,seq=16,batch=2";
    let (code, out, err) = hzp(&[
        "bench", "compile", preset, "--layers", "1,2,4", "--meshes", "gpu=2", "--repeat", "1",
    ]);
    assert_eq!(code, 0, "{err}");
    for line in [
        "layers 2 / 1 (x2.00): wall x",
        "layers 4 / 2 (x2.00): wall x",
    ] {
        assert!(out.contains(line), "{out}");
    }
    assert!(out.contains("CPU x") && out.contains("peak RSS x"), "{out}");
    fails_with(
        &["bench", "compile", "preset:gpt,layers=2", "--layers", "4"],
        &["already sets layers="],
    );
    fails_with(
        &["bench", "compile", preset, "--layers", "0,2"],
        &["at least 1"],
    );
    fails_with(
        &[
            "bench", "compile", preset, "--layers", "1", "--meshes", "gpu=2", "--meshes", "gpu=4",
        ],
        &["one mesh"],
    );
    // the old spelling still works, with a note
    let (code, _, err) = hzp(&[
        "bench", "compile", preset, "--layers", "1", "--mesh", "gpu=2", "--repeat", "1",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("reads --mesh as --meshes"), "{err}");
    fails_with(
        &["bench", "compile", s(&mlp()), "--layers", "1"],
        &["needs a preset model"],
    );
}

// ------------------------------------------------------------------ token ids

/// The GPT-2 inputs with one token id replaced.
fn ids_with(d: &Path, value: i64) -> PathBuf {
    let mut arrays = read_npz(&gpt2_io());
    for (k, t) in arrays.iter_mut() {
        if k == "input_ids" {
            if let Data::I64(v) = &mut t.data {
                v[5] = value;
            }
        }
    }
    let p = d.join(format!("ids{value}.npz"));
    npz::write(&p, &arrays).unwrap();
    p
}

#[test]
fn token_ids_outside_the_vocabulary_are_rejected_everywhere() {
    let d = tempdir("ids");
    for bad in [-1i64, 256] {
        let io = ids_with(&d, bad);
        let needle = format!("`input_ids` holds {bad} at position [0, 5]");
        fails_with(
            &["eval", s(&gpt2()), "--inputs", s(&io)],
            &[&needle, "outside 0..256"],
        );
        fails_with(
            &["train", s(&gpt2()), "--inputs", s(&io), "--steps", "1"],
            &[&needle],
        );
        fails_with(
            &[
                "grad",
                s(&gpt2()),
                "--inputs",
                s(&io),
                "-o",
                s(&d.join("g.npz")),
            ],
            &[&needle],
        );
    }
    // `hzp run` on a zero3 plan whose embedding gradient is exchanged as rows.
    let plan = d.join("z3.json");
    let (code, _, err) = hzp(&[
        "compile",
        s(&llama()),
        "--inputs",
        s(&llama_io()),
        "--mesh",
        "gpu=2",
        "--strategy",
        "zero3",
        "-o",
        s(&plan),
    ]);
    assert_eq!(code, 0, "{err}");
    let mut arrays = read_npz(&llama_io());
    for (k, t) in arrays.iter_mut() {
        if k == "input_ids" {
            if let Data::I64(v) = &mut t.data {
                v[3] = -1;
            }
        }
    }
    let io = d.join("llama_neg.npz");
    npz::write(&io, &arrays).unwrap();
    fails_with(
        &["run", s(&plan), "--inputs", s(&io), "--steps", "1"],
        &["`input_ids` holds -1", "negative ids are rejected"],
    );
}

// ------------------------------------------------------------------ limits

/// An .npz whose one deflated entry inflates to `bytes` of zeros (a few KiB on disk).
fn zip_bomb(path: &Path, bytes: usize) {
    zip_bomb_with(path, Vec::new(), bytes);
}

/// `arrays`, then an entry `big` that inflates to `bytes` of zeros, all deflated.
fn zip_bomb_with(path: &Path, mut arrays: Vec<(String, Tensor)>, bytes: usize) {
    let n = bytes / 4;
    arrays.push((
        "big".to_string(),
        Tensor::new(vec![n], Data::F32(vec![0.0; n])),
    ));
    let raw = npz::write_bytes(&arrays).unwrap();
    // Re-pack with deflate: the archive stays small, the declared size is the full array.
    let mut src = zip::ZipArchive::new(std::io::Cursor::new(raw)).unwrap();
    let f = std::fs::File::create(path).unwrap();
    let mut w = zip::ZipWriter::new(f);
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    for i in 0..src.len() {
        let mut e = src.by_index(i).unwrap();
        w.start_file(e.name().to_string(), opts).unwrap();
        std::io::copy(&mut e, &mut w).unwrap();
    }
    w.finish().unwrap();
}

/// `hzp show` needs shapes only: it reads the headers of --inputs' arrays, not their data,
/// so an unused array over the memory budget does not stop it (eval, which reads the
/// data, refuses the same file).
#[test]
fn show_reads_the_shapes_of_inputs_without_their_data() {
    let d = tempdir("show-shapes");
    let io = d.join("gpt2_big.npz");
    zip_bomb_with(&io, read_npz(&gpt2_io()), 64 << 20);
    let (code, plain, err) = hzp(&["show", s(&gpt2()), "--inputs", s(&gpt2_io())]);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = hzp(&[
        "show",
        s(&gpt2()),
        "--inputs",
        s(&io),
        "--input-budget",
        "16MiB",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, plain, "the same summary as from the inputs alone");
    fails_with(
        &[
            "eval",
            s(&gpt2()),
            "--inputs",
            s(&io),
            "--input-budget",
            "16MiB",
        ],
        &["array `big`", "memory budget of 16.0 MiB"],
    );
}

#[test]
fn a_declared_size_over_the_memory_budget_is_refused_before_reading() {
    let d = tempdir("bomb");
    let bomb = d.join("bomb.npz");
    zip_bomb(&bomb, 64 << 20);
    assert!(std::fs::metadata(&bomb).unwrap().len() < 1 << 20);
    // As --inputs, unused by the model: still read, still bounded.
    fails_with(
        &[
            "eval",
            s(&mlp()),
            "--inputs",
            s(&bomb),
            "--input-budget",
            "16MiB",
        ],
        &[
            "bomb.npz",
            "array `big`",
            "memory budget of 16.0 MiB",
            "--input-budget",
        ],
    );
    // Within the budget it reads (and then lacks the model's input).
    fails_with(
        &[
            "eval",
            s(&mlp()),
            "--inputs",
            s(&bomb),
            "--input-budget",
            "1GiB",
        ],
        &["has no array `x`"],
    );
}

#[test]
fn shapes_that_would_fold_huge_constants_stop_at_the_budget() {
    // Binding a huge sequence length used to fold position ranges and masks of gigabytes
    // at import (about 19 GB and 100 s for this one).
    let start = std::time::Instant::now();
    let d = tempdir("hzpfoldbudget");
    fails_with(
        &[
            "compile",
            s(&gpt2()),
            "--shape",
            "input_ids=1x268435456",
            "--input-budget",
            "1GiB",
            "--mesh",
            "gpu=1",
            "-o",
            s(&d.join("plan.json")),
        ],
        &["Range of 268435456 elements", "memory budget of 1.0 GiB"],
    );
    assert!(start.elapsed().as_secs() < 30, "{:?}", start.elapsed());
}

/// `show` reads shapes only: constants the import would compute (the position range of
/// 4 Mi tokens, 64 MiB) are not computed past the memory budget instead of failing it; a
/// shape whose tensors cannot exist is still an error, naming the node, not a budget stop.
#[test]
fn show_reads_shapes_without_computing_huge_constants() {
    let (code, out, err) = hzp(&[
        "show",
        s(&gpt2()),
        "--shape",
        "input_ids=1x4194304",
        "--input-budget",
        "16MiB",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("i64[1,4194304]"), "{out}");
    fails_with(
        &["show", s(&gpt2()), "--shape", "input_ids=1x268435456"],
        &[
            "LessOrEqual `/transformer/LessOrEqual`",
            "[1, 1, 268435456, 268435456], which is too large",
        ],
    );
}

// ------------------------------------------------------------------ .hzp contradictions

#[test]
fn a_hzp_model_refuses_shapes_that_contradict_its_inputs() {
    fails_with(
        &["show", s(&mlp()), "--shape", "x=8x8"],
        &["declares input `x` as f32[4,8]", "[8, 8]"],
    );
    // compile: the global batch over 2 ranks is 8 rows, each rank's 4 = the declared shape.
    let d = tempdir("hzpshape");
    let plan = d.join("plan.json");
    let (code, _, err) = hzp(&[
        "compile",
        s(&mlp()),
        "--shape",
        "x=8x8",
        "--mesh",
        "gpu=2",
        "--loss",
        "mean",
        "-o",
        s(&plan),
    ]);
    assert_eq!(code, 0, "{err}");
    fails_with(
        &[
            "compile",
            s(&mlp()),
            "--shape",
            "x=16x8",
            "--mesh",
            "gpu=2",
            "--loss",
            "mean",
        ],
        &["declares input `x` as f32[4,8]"],
    );
}

#[test]
fn unknown_attributes_in_a_hzp_file_are_errors() {
    let d = tempdir("attrs");
    let src = std::fs::read_to_string(mlp())
        .unwrap()
        .replace("Gelu(%hb)", "Gelu{approximate=\"tanh\"}(%hb)");
    let model = d.join("mlp.hzp");
    std::fs::write(&model, src).unwrap();
    std::fs::copy(
        repo().join("examples/models/mlp.weights.npz"),
        d.join("mlp.weights.npz"),
    )
    .unwrap();
    fails_with(
        &["eval", s(&model), "--inputs", s(&mlp_io())],
        &["`Gelu` has no attribute `approximate`", "GeluTanh"],
    );
}

// ------------------------------------------------------------------ plan integrity

#[test]
fn forged_plans_are_rejected_by_inspect_simulate_and_run() {
    let d = tempdir("forged");
    let plan = d.join("plan.json");
    let (code, _, err) = hzp(&[
        "compile",
        s(&llama()),
        "--inputs",
        s(&llama_io()),
        "--mesh",
        "gpu=2",
        "-o",
        s(&plan),
    ]);
    assert_eq!(code, 0, "{err}");
    let text = std::fs::read_to_string(&plan).unwrap();
    let mut good = hzp_ir::Plan::from_json(&text, "plan.json").unwrap();
    // Forge: micro-batches that do not divide the inputs, groups that do not nest.
    let mut forged = Vec::new();
    let mut p = good.clone();
    p.micro_batches = 3;
    forged.push((p, "micro-batches"));
    let mut p = good.clone();
    p.groups.params = hzp_ir::Group {
        axes: vec!["gpu".into()],
    };
    p.groups.grads = hzp_ir::Group { axes: vec![] };
    forged.push((p, "not inside the gradient group"));
    good.content_hash = good.compute_hash();
    for (i, (mut p, needle)) in forged.into_iter().enumerate() {
        p.content_hash = p.compute_hash();
        let f = d.join(format!("forged{i}.json"));
        std::fs::write(&f, p.to_json()).unwrap();
        fails_with(&["inspect", s(&f)], &["does not verify", needle]);
        fails_with(&["simulate", s(&f)], &["does not verify", needle]);
        fails_with(
            &["run", s(&f), "--inputs", s(&llama_io()), "--steps", "1"],
            &["does not verify", needle],
        );
    }
}

// ------------------------------------------------------------------ full devices

/// Every subcommand with stdout, then stderr, on a full device: exit 1 (or the command's
/// own result where it writes nothing there), never a panic.
#[test]
fn every_subcommand_survives_a_full_stdout_and_stderr() {
    let d = tempdir("fulldev");
    let Some(full) = full_device(&d) else { return };
    let plan = d.join("plan.json");
    let (code, _, err) = hzp(&[
        "compile",
        s(&llama()),
        "--inputs",
        s(&llama_io()),
        "--mesh",
        "gpu=2",
        "-o",
        s(&plan),
    ]);
    assert_eq!(code, 0, "{err}");
    // a checkpoint for `hzp checkpoint`, a text file for `hzp data prepare`
    let ck = d.join("ck");
    let (code, _, err) = hzp(&[
        "run",
        s(&plan),
        "--inputs",
        s(&llama_io()),
        "--steps",
        "1",
        "--checkpoint-dir",
        s(&ck),
    ]);
    assert_eq!(code, 0, "{err}");
    let text = d.join("text.txt");
    std::fs::write(&text, "some text to turn into tokens\n").unwrap();
    let preset = "preset:gpt,layers=2,hidden=64,heads=2,vocab=128,seq=16,batch=2";
    let cmds: Vec<Vec<String>> = vec![
        vec!["checkpoint".into(), "show".into(), s(&ck).into()],
        vec![
            "checkpoint".into(),
            "export".into(),
            s(&ck).into(),
            "-o".into(),
            s(&d.join("export.npz")).into(),
        ],
        vec![
            "data".into(),
            "prepare".into(),
            s(&text).into(),
            "-o".into(),
            s(&d.join("tokens.bin")).into(),
        ],
        vec![
            "bench".into(),
            "compile".into(),
            preset.into(),
            "--mesh".into(),
            "gpu=2".into(),
            "--repeat".into(),
            "1".into(),
        ],
        vec![
            "bench".into(),
            "compile".into(),
            "preset:gpt,hidden=64,heads=2,vocab=128,seq=16,batch=2".into(),
            "--layers".into(),
            "1,2".into(),
            "--mesh".into(),
            "gpu=2".into(),
            "--repeat".into(),
            "1".into(),
        ],
        vec!["import".into(), s(&mlp()).into()],
        vec!["show".into(), preset.into()],
        vec![
            "eval".into(),
            s(&mlp()).into(),
            "--inputs".into(),
            s(&mlp_io()).into(),
        ],
        vec![
            "grad".into(),
            s(&mlp()).into(),
            "--inputs".into(),
            s(&mlp_io()).into(),
            "--loss".into(),
            "mse".into(),
            "--target".into(),
            "y".into(),
            "-o".into(),
            s(&d.join("g.npz")).into(),
        ],
        vec![
            "train".into(),
            s(&mlp()).into(),
            "--inputs".into(),
            s(&mlp_io()).into(),
            "--loss".into(),
            "mse".into(),
            "--target".into(),
            "y".into(),
        ],
        vec![
            "compile".into(),
            preset.into(),
            "--mesh".into(),
            "gpu=2".into(),
        ],
        vec!["inspect".into(), s(&plan).into()],
        vec![
            "run".into(),
            s(&plan).into(),
            "--inputs".into(),
            s(&llama_io()).into(),
            "--steps".into(),
            "1".into(),
        ],
        vec!["simulate".into(), s(&plan).into()],
        vec![
            "compare".into(),
            preset.into(),
            "--mesh".into(),
            "gpu=2".into(),
            "--strategies".into(),
            "zero3,ddp".into(),
        ],
        vec![
            "scale".into(),
            preset.into(),
            "--ranks".into(),
            "8,16".into(),
            "--cluster".into(),
            s(&repo().join("examples/clusters/h100-dgx.toml")).into(),
        ],
        vec![
            "bench".into(),
            "import".into(),
            preset.into(),
            "--repeat".into(),
            "1".into(),
        ],
        vec!["--help".into()],
        vec![
            "launch".into(),
            "--nproc-per-node".into(),
            "1".into(),
            "--".into(),
            "show".into(),
            preset.into(),
        ],
    ];
    for args in &cmds {
        for stream in ["stdout", "stderr"] {
            let dev = std::fs::OpenOptions::new().write(true).open(&full).unwrap();
            let mut c = Command::new(hzp_bin());
            c.args(args).stdin(Stdio::null());
            if stream == "stdout" {
                c.stdout(dev).stderr(Stdio::piped());
            } else {
                c.stderr(dev).stdout(Stdio::piped());
            }
            let out = c.output().unwrap();
            let code = out.status.code().unwrap_or(-1);
            let text = String::from_utf8_lossy(if stream == "stdout" {
                &out.stderr
            } else {
                &out.stdout
            })
            .into_owned();
            assert_ne!(
                code, 101,
                "hzp {args:?} with {stream} full panicked: {text}"
            );
            assert!(
                code == 0 || code == 1,
                "hzp {args:?} with {stream} full exited {code}: {text}"
            );
            if stream == "stdout" {
                // Every one of these prints to stdout, so the failure must be reported.
                assert_eq!(
                    code, 1,
                    "hzp {args:?}: a full stdout went unreported: {text}"
                );
                assert!(
                    text.contains("stdout") || text.contains("No space left"),
                    "hzp {args:?}: {text}"
                );
            }
        }
    }
    assert!(is_char_device(&full));
}

// ------------------------------------------------------------------ huge results in eval

/// An ONNX model of one node `op` over the graph input `x` (f32, shape `x_shape`) and the
/// int64 constants `consts` (name, values), whose output `y` hzp infers.
fn one_node_onnx(
    op: &str,
    x_shape: &[i64],
    ins: &[&str],
    consts: &[(&str, Tensor)],
    attrs: Vec<hzp_frontends::onnx::proto::AttributeProto>,
) -> Vec<u8> {
    use hzp_frontends::onnx::proto::*;
    use prost::Message;
    let dim = x_shape
        .iter()
        .map(|&d| tensor_shape_proto::Dimension {
            denotation: String::new(),
            value: Some(tensor_shape_proto::dimension::Value::DimValue(d)),
        })
        .collect();
    let x = ValueInfoProto {
        name: "x".into(),
        r#type: Some(TypeProto {
            denotation: String::new(),
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: 1,
                shape: Some(TensorShapeProto { dim }),
            })),
        }),
        doc_string: String::new(),
    };
    let node = NodeProto {
        input: ins.iter().map(|s| s.to_string()).collect(),
        output: vec!["y".into()],
        name: format!("huge_{}", op.to_lowercase()),
        op_type: op.into(),
        attribute: attrs,
        ..Default::default()
    };
    ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: 18,
        }],
        producer_name: "hzp-tests".into(),
        graph: Some(GraphProto {
            node: vec![node],
            name: "g".into(),
            initializer: consts
                .iter()
                .map(|(n, t)| hzp_frontends::onnx::encode_tensor(n, t))
                .collect(),
            input: vec![x],
            output: vec![ValueInfoProto {
                name: "y".into(),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// Expand, Tile, OneHot and Concat whose constant operands make a result of 2^44 elements
/// (or, for Concat, of more than a small --input-budget): `hzp eval` refuses before
/// allocating, naming the node, the shape and the budget, instead of aborting.
#[test]
fn constant_driven_results_over_the_budget_are_refused_by_eval() {
    use hzp_frontends::onnx::proto::AttributeProto;
    let d = tempdir("huge-results");
    let axis = |v: i64| AttributeProto {
        name: "axis".into(),
        r#type: hzp_frontends::onnx::proto::attribute_type::INT,
        i: Some(v),
        ..Default::default()
    };
    let i64s = |v: Vec<i64>| Tensor::i64(vec![v.len()], v);
    // (op, the model, x's shape, the result's shape and size as the error gives them)
    type Case = (
        &'static str,
        Vec<u8>,
        Vec<usize>,
        &'static str,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        (
            "Expand",
            one_node_onnx(
                "Expand",
                &[1, 1],
                &["x", "shape"],
                &[("shape", i64s(vec![1 << 22, 1 << 22]))],
                vec![],
            ),
            vec![1, 1],
            "[4194304, 4194304]",
            "64.0 TiB",
        ),
        (
            "Tile",
            one_node_onnx(
                "Tile",
                &[4],
                &["x", "repeats"],
                &[("repeats", i64s(vec![1 << 42]))],
                vec![],
            ),
            vec![4],
            "[17592186044416]",
            "64.0 TiB",
        ),
        (
            "OneHot",
            one_node_onnx(
                "OneHot",
                &[4],
                &["x", "depth", "values"],
                &[
                    ("depth", Tensor::i64(vec![], vec![1 << 42])),
                    ("values", Tensor::f32(vec![2], vec![0.0, 1.0])),
                ],
                vec![axis(-1)],
            ),
            vec![4],
            "[4, 4398046511104]",
            "64.0 TiB",
        ),
    ];
    for (op, bytes, x_shape, shape, size) in cases {
        let model = d.join(format!("{op}.onnx"));
        std::fs::write(&model, bytes).unwrap();
        let io = d.join(format!("{op}.npz"));
        let n: usize = x_shape.iter().product();
        npz::write(&io, &[("x".into(), Tensor::f32(x_shape, vec![1.0; n]))]).unwrap();
        let err = fails_with(
            &["eval", s(&model), "--inputs", s(&io)],
            &[
                &format!("node `huge_{}` ({op})", op.to_lowercase()),
                shape,
                size,
                "memory budget",
                "--input-budget",
            ],
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    // Concat of one 256 KiB constant four times (and x) under a 1 MiB budget: the model
    // and its constant fit, the result (1 MiB and 4 bytes) does not
    let quarter = Tensor::f32(vec![1 << 16], vec![0.5; 1 << 16]);
    let model = d.join("Concat.onnx");
    std::fs::write(
        &model,
        one_node_onnx(
            "Concat",
            &[1],
            &["a", "x", "a", "a", "a"],
            &[("a", quarter)],
            vec![axis(0)],
        ),
    )
    .unwrap();
    let io = d.join("Concat.npz");
    npz::write(&io, &[("x".into(), Tensor::f32(vec![1], vec![1.0]))]).unwrap();
    fails_with(
        &[
            "eval",
            s(&model),
            "--inputs",
            s(&io),
            "--input-budget",
            "1MiB",
        ],
        &[
            "node `huge_concat` (Concat)",
            "[262145]",
            "memory budget of 1.0 MiB",
        ],
    );
    // within the budget the same model evaluates
    let out = d.join("concat_out.npz");
    let (code, _, err) = hzp(&[
        "eval",
        s(&model),
        "--inputs",
        s(&io),
        "--input-budget",
        "64MiB",
        "-o",
        s(&out),
    ]);
    assert_eq!(code, 0, "{err}");
    let y = read_npz(&out);
    assert_eq!(y[0].1.shape, vec![262145]);
}
