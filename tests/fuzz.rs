//! Fuzz targets for what hzp reads from users: the ONNX importer, the text IR parser, the
//! `.npz` reader and `plan.json` loading (parse + verify).
//!
//! - `regression_corpus` (always run) feeds every file under `tests/fuzz/crashes/<target>/`
//!   to its target: inputs that once crashed or hung stay fixed; and every file under
//!   `tests/fuzz/corpus/<target>/`, which must reach the stage its name records (see below),
//!   no fewer files than [`CORPUS_FILES`].
//! - Targets: `onnx`, `text`, `npz`, `plan` mutate bytes; `onnx-fields` and `plan-fields`
//!   mutate the decoded structure (a model's nodes, attributes, initializers and inputs; a
//!   plan's JSON fields and program lines) and encode it again, recomputing the plan's
//!   content hash, so the input gets past decoding and the hash check (see
//!   [`mutate_onnx_fields`], [`mutate_plan_fields`]). Each run prints how far its inputs got.
//! - `fuzz` (ignored; `examples/fuzz/run.sh SECONDS [TARGET]` runs it in release mode) mutates
//!   seeds (the test models, their inputs, `.hzp` files, a compiled plan) for SECONDS per
//!   target with a small mutation fuzzer (bit flips, byte and chunk edits, splices, numbers
//!   that matter), under `catch_unwind`. An input that panics, or takes over 5 s, is written
//!   to `tests/fuzz/crashes/<target>/` and the run fails naming it. It also keeps a corpus:
//!   for each target and each stage its inputs reached, the smallest input seen, shrunk (chunks
//!   cut while the input still reaches that stage) and kept when at most [`CORPUS_MAX_BYTES`],
//!   as `tests/fuzz/corpus/<target>/<stage>` (the stage's words joined by `-`), replacing a
//!   larger file for that stage. The corpus is also fuzzed from, after the seeds.
//!
//! No nightly toolchain or cargo-fuzz is needed.

mod common;
use common::*;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A target runs one input and says how far it got (counted per target by `fuzz`, so a run
/// shows how much of the input gets past the first check).
type Target = fn(&[u8]) -> &'static str;

fn onnx_stage(r: Result<hzp_ir::Program, hzp_frontends::onnx::ImportError>) -> &'static str {
    use hzp_frontends::onnx::ImportErrorKind as K;
    match r {
        Ok(_) => "imported",
        Err(e) => match e.kind {
            K::Decode => "not protobuf / no graph",
            K::Opset | K::Unsupported => "opset or op type refused",
            K::Graph | K::TensorData | K::Shapes => "graph, data or shapes refused",
            _ => "refused while translating",
        },
    }
}

fn onnx_target(b: &[u8]) -> &'static str {
    onnx_stage(hzp_frontends::onnx::import_bytes(
        b,
        None,
        "fuzz.onnx",
        &hzp_frontends::onnx::ImportOptions::default(),
    ))
}

fn text_target(b: &[u8]) -> &'static str {
    let s = String::from_utf8_lossy(b);
    let Ok(p) = hzp_ir::text::parse(&s, "fuzz.hzp", &|_| None) else {
        return "not parsed";
    };
    let verified = hzp_ir::verify(&p).is_ok();
    // What parses must print and parse back.
    let again = hzp_ir::text::print(&p);
    let _ = hzp_ir::text::parse(&again, "fuzz.hzp", &|_| None);
    if verified {
        "parsed and verified"
    } else {
        "parsed, refused by the verifier"
    }
}

fn npz_target(b: &[u8]) -> &'static str {
    match hzp_frontends::npz::read_bytes(b, "fuzz.npz") {
        Ok(_) => "read",
        Err(_) => "refused",
    }
}

fn plan_target(b: &[u8]) -> &'static str {
    use hzp_ir::plan::PlanError;
    let s = String::from_utf8_lossy(b);
    match hzp_ir::Plan::from_json(&s, "fuzz.json") {
        Err(PlanError::Json { .. } | PlanError::NotAPlan { .. } | PlanError::Version { .. }) => {
            "not plan JSON"
        }
        Err(PlanError::Modified { .. }) => "content hash differs",
        Err(PlanError::Invalid { .. }) => "hash ok, program or fields refused",
        Ok(plan) => match hzp_passes::plan::verify::verify_plan(&plan, None) {
            Ok(_) => "loaded and verified",
            Err(_) => "loaded, refused by the plan verifier",
        },
    }
}

/// The ONNX importer on a model whose graph inputs are bound to shapes (a symbolic dim is 3,
/// a fixed dim is kept, whatever it is), so that a mutated model reaches translation and
/// constant folding instead of stopping at unbound dims. Used by the structure-aware mode.
fn onnx_bound_target(b: &[u8]) -> &'static str {
    use hzp_frontends::onnx::proto::{tensor_shape_proto::dimension::Value, type_proto};
    use prost::Message;
    let Ok(m) = hzp_frontends::onnx::proto::ModelProto::decode(b) else {
        return "not protobuf / no graph";
    };
    let mut opts = hzp_frontends::onnx::ImportOptions::default();
    for v in m.graph.iter().flat_map(|g| &g.input) {
        let Some(type_proto::Value::TensorType(t)) =
            v.r#type.as_ref().and_then(|t| t.value.as_ref())
        else {
            continue;
        };
        let Some(shape) = &t.shape else { continue };
        let dims: Vec<usize> = shape
            .dim
            .iter()
            .map(|d| match d.value {
                Some(Value::DimValue(x)) => usize::try_from(x).unwrap_or(0),
                _ => 3,
            })
            .collect();
        opts.shapes.insert(v.name.clone(), dims);
    }
    onnx_stage(hzp_frontends::onnx::import_bytes(
        b,
        None,
        "fuzz.onnx",
        &opts,
    ))
}

const TARGETS: [(&str, Target); 6] = [
    ("onnx", onnx_target),
    ("text", text_target),
    ("npz", npz_target),
    ("plan", plan_target),
    ("onnx-fields", onnx_bound_target),
    ("plan-fields", plan_target),
];

fn crashes_dir(target: &str) -> PathBuf {
    repo().join("tests/fuzz/crashes").join(target)
}

fn corpus_dir(target: &str) -> PathBuf {
    repo().join("tests/fuzz/corpus").join(target)
}

/// The committed corpus's file count: `regression_corpus` must replay at least these.
const CORPUS_FILES: usize = 21;

/// The largest input the corpus keeps.
const CORPUS_MAX_BYTES: usize = 8192;

/// A stage as a file name: its words (letters and digits) joined by `-`.
fn stage_file(stage: &str) -> String {
    stage
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join("-")
}

fn files_in(d: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(d)
        .map(|r| r.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.retain(|p| {
        p.is_file()
            && p.file_name().is_some_and(|n| {
                let n = n.to_string_lossy();
                n != "README.md" && !n.starts_with('.')
            })
    });
    v.sort();
    v
}

/// Runs `f` on `input`: how far it got, or Err(panic message) if it panicked.
fn run_one(f: Target, input: &[u8]) -> Result<&'static str, String> {
    std::panic::catch_unwind(AssertUnwindSafe(|| f(input))).map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(panic)".into())
    })
}

#[test]
fn regression_corpus() {
    // Bounded like the CLI: a crashing input must not take the suite's memory.
    hzp_frontends::limits::set_max_memory(256 << 20);
    let (mut crashes, mut corpus) = (0, 0);
    for (name, f) in TARGETS {
        let kept = files_in(&corpus_dir(name));
        for file in files_in(&crashes_dir(name)).iter().chain(&kept) {
            let input = std::fs::read(file).unwrap();
            let start = Instant::now();
            let stage = match run_one(f, &input) {
                Ok(stage) => stage,
                Err(m) => panic!("{} ({name}) panics again: {m}", file.display()),
            };
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{} ({name}) takes {:?}",
                file.display(),
                start.elapsed()
            );
            if kept.contains(file) {
                // a corpus file is named after the stage it reached when it was kept
                let recorded = file.file_name().unwrap().to_string_lossy();
                assert_eq!(
                    stage_file(stage),
                    recorded,
                    "{} ({name}) now stops at `{stage}`",
                    file.display()
                );
                assert!(input.len() <= CORPUS_MAX_BYTES, "{}", file.display());
                corpus += 1;
            } else {
                crashes += 1;
            }
        }
    }
    println!("{crashes} past crashes and {corpus} corpus inputs, none panics");
    assert!(
        corpus >= CORPUS_FILES,
        "{corpus} corpus inputs, fewer than the {CORPUS_FILES} committed"
    );
}

// ------------------------------------------------------------------ the fuzzer

/// xorshift64*: small, fast, deterministic per seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const INTERESTING: [&[u8]; 14] = [
    b"\x00",
    b"\xff",
    b"\x7f",
    b"\x80",
    b"\xff\xff\xff\xff",
    b"\x00\x00\x00\x80",
    b"\xff\xff\xff\xff\xff\xff\xff\x7f",
    b"-1",
    b"0",
    b"4294967296",
    b"18446744073709551615",
    b"NaN",
    b"1e308",
    b"99999999999",
];

fn mutate(rng: &mut Rng, input: &[u8], seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let len = v.len();
        match rng.below(9) {
            0 if len > 0 => {
                let i = rng.below(len);
                v[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                v[i] = rng.next() as u8;
            }
            2 if len > 0 => {
                // delete a chunk
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                v.drain(i..i + n);
            }
            3 => {
                // insert an interesting value
                let i = rng.below(len + 1);
                let x = INTERESTING[rng.below(INTERESTING.len())];
                v.splice(i..i, x.iter().copied());
            }
            4 if len > 0 => {
                // overwrite with an interesting value
                let i = rng.below(len);
                let x = INTERESTING[rng.below(INTERESTING.len())];
                for (k, &b) in x.iter().enumerate() {
                    if let Some(slot) = v.get_mut(i + k) {
                        *slot = b;
                    }
                }
            }
            5 if len > 1 => {
                // duplicate a chunk
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(256));
                let chunk: Vec<u8> = v[i..i + n].to_vec();
                let at = rng.below(len + 1);
                v.splice(at..at, chunk);
            }
            6 if !seeds.is_empty() => {
                // splice in a piece of another seed
                let s = &seeds[rng.below(seeds.len())];
                if !s.is_empty() {
                    let i = rng.below(s.len());
                    let n = 1 + rng.below((s.len() - i).min(512));
                    let at = rng.below(len + 1);
                    v.splice(at..at, s[i..i + n].iter().copied());
                }
            }
            7 if len > 0 => {
                // truncate
                v.truncate(rng.below(len));
            }
            _ => {
                // change an ASCII digit (numbers in text and JSON)
                let digits: Vec<usize> = (0..len).filter(|&i| v[i].is_ascii_digit()).collect();
                if !digits.is_empty() {
                    let i = digits[rng.below(digits.len())];
                    v[i] = b'0' + rng.below(10) as u8;
                }
            }
        }
    }
    v
}

// ------------------------------------------------------------------ structure-aware mutation
//
// Byte mutations rarely get past the first check: a mutated plan fails its content hash, a
// mutated `.onnx` file fails protobuf decoding. The `-fields` targets mutate the decoded
// structure instead and encode it again: `plan-fields` edits one JSON field (numbers, strings,
// arrays, keys; the program text line by line) and recomputes the content hash, so the plan
// reaches the program parser and the plan verifier; `onnx-fields` edits one field of the
// decoded model (a node's op type, inputs, outputs or attributes, an initializer's dims, type
// or data, a graph input's dims or type, the opset) and re-encodes it, so the model reaches
// translation and constant folding.

const NUMBERS: [i64; 14] = [
    0,
    1,
    -1,
    2,
    3,
    7,
    64,
    65536,
    1 << 31,
    -(1 << 31),
    1 << 32,
    1 << 48,
    i64::MAX,
    i64::MIN,
];

fn pick_number(rng: &mut Rng, old: i64) -> i64 {
    match rng.below(4) {
        0 => old.wrapping_add(1),
        1 => old.wrapping_sub(1),
        2 => old.wrapping_mul(2),
        _ => NUMBERS[rng.below(NUMBERS.len())],
    }
}

/// Mutates the text of a plan's program line by line (or byte-wise within a line).
fn mutate_lines(rng: &mut Rng, text: &str) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    if lines.is_empty() {
        return text.to_string();
    }
    let i = rng.below(lines.len());
    match rng.below(5) {
        0 => {
            lines.remove(i);
        }
        1 => {
            let l = lines[i].clone();
            let at = rng.below(lines.len() + 1);
            lines.insert(at, l);
        }
        2 => {
            let j = rng.below(lines.len());
            lines.swap(i, j);
        }
        3 => {
            // change one number in the line
            let l = &lines[i];
            let starts: Vec<usize> = l
                .char_indices()
                .filter(|&(k, c)| {
                    c.is_ascii_digit() && (k == 0 || !l.as_bytes()[k - 1].is_ascii_digit())
                })
                .map(|(k, _)| k)
                .collect();
            if !starts.is_empty() {
                let k = starts[rng.below(starts.len())];
                let end = l[k..]
                    .find(|c: char| !c.is_ascii_digit())
                    .map_or(l.len(), |e| k + e);
                let old: i64 = l[k..end].parse().unwrap_or(0);
                let new = pick_number(rng, old).to_string();
                lines[i] = format!("{}{}{}", &l[..k], new, &l[end..]);
            }
        }
        _ => {
            let m = mutate(rng, lines[i].as_bytes(), &[]);
            lines[i] = String::from_utf8_lossy(&m).into_owned();
        }
    }
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

/// Mutates one randomly chosen node of a JSON tree.
fn mutate_json(rng: &mut Rng, v: &mut serde_json::Value, depth: usize) {
    use serde_json::Value;
    // descend into a child most of the time
    let descend = depth < 12 && rng.below(4) != 0;
    match v {
        Value::Object(m) if !m.is_empty() => {
            let keys: Vec<String> = m.keys().cloned().collect();
            let k = keys[rng.below(keys.len())].clone();
            if descend || k == "content_hash" {
                if let Some(c) = m.get_mut(&k) {
                    mutate_json(rng, c, depth + 1);
                }
            } else if rng.below(2) == 0 {
                m.remove(&k);
            } else {
                m.insert(k, Value::Null);
            }
        }
        Value::Array(a) if !a.is_empty() => {
            let i = rng.below(a.len());
            if descend {
                mutate_json(rng, &mut a[i], depth + 1);
            } else {
                match rng.below(3) {
                    0 => {
                        a.remove(i);
                    }
                    1 => {
                        let x = a[i].clone();
                        a.insert(rng.below(a.len() + 1), x);
                    }
                    _ => {
                        let j = rng.below(a.len());
                        a.swap(i, j);
                    }
                }
            }
        }
        Value::Number(n) => {
            *v = if rng.below(6) == 0 {
                serde_json::json!(-0.5)
            } else {
                let old = n.as_i64().unwrap_or(0);
                let x = pick_number(rng, old);
                if x >= 0 {
                    Value::from(x as u64)
                } else {
                    Value::from(x)
                }
            };
        }
        Value::String(t) => {
            *t = if t.contains('\n') {
                mutate_lines(rng, t)
            } else {
                let m = mutate(rng, t.as_bytes(), &[]);
                String::from_utf8_lossy(&m).into_owned()
            };
        }
        Value::Bool(b) => *b = !*b,
        _ => {
            *v = match rng.below(3) {
                0 => Value::from(0),
                1 => Value::from(""),
                _ => Value::Array(vec![]),
            }
        }
    }
}

/// A plan with one field changed and its content hash recomputed.
fn mutate_plan_fields(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(input) else {
        return input.to_vec();
    };
    for _ in 0..1 + rng.below(2) {
        mutate_json(rng, &mut v, 0);
    }
    if let Some(m) = v.as_object_mut() {
        let h = hzp_ir::plan::content_hash_of(&serde_json::Value::Object(m.clone()));
        m.insert("content_hash".into(), serde_json::Value::from(h));
    }
    serde_json::to_vec(&v).unwrap()
}

/// Op types the importer translates (and a few it does not), for op-type swaps.
const OP_TYPES: [&str; 24] = [
    "Add",
    "MatMul",
    "Reshape",
    "Transpose",
    "Gather",
    "Concat",
    "Slice",
    "Softmax",
    "Where",
    "Expand",
    "Unsqueeze",
    "Squeeze",
    "Cast",
    "Shape",
    "ConstantOfShape",
    "Range",
    "Split",
    "ReduceMean",
    "LayerNormalization",
    "Gemm",
    "Trilu",
    "TopK",
    "Dropout",
    "Loop",
];

/// A model with one field of its graph changed, encoded again.
fn mutate_onnx_fields(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    use hzp_frontends::onnx::proto::{tensor_shape_proto::dimension::Value as Dim, type_proto};
    use prost::Message;
    let Ok(mut m) = hzp_frontends::onnx::proto::ModelProto::decode(input) else {
        return input.to_vec();
    };
    let Some(g) = m.graph.as_mut() else {
        return input.to_vec();
    };
    for _ in 0..1 + rng.below(2) {
        match rng.below(10) {
            0..=3 if !g.node.is_empty() => {
                let names: Vec<String> = g
                    .node
                    .iter()
                    .flat_map(|n| n.output.iter().cloned())
                    .chain(g.initializer.iter().map(|t| t.name.clone()))
                    .collect();
                let k = rng.below(g.node.len());
                let n = &mut g.node[k];
                match rng.below(8) {
                    0 => n.op_type = OP_TYPES[rng.below(OP_TYPES.len())].to_string(),
                    1 if !n.input.is_empty() => {
                        let i = rng.below(n.input.len());
                        n.input[i] = if names.is_empty() || rng.below(4) == 0 {
                            String::new()
                        } else {
                            names[rng.below(names.len())].clone()
                        };
                    }
                    2 if !n.input.is_empty() => {
                        let i = rng.below(n.input.len());
                        n.input.remove(i);
                    }
                    3 if !names.is_empty() => n.input.push(names[rng.below(names.len())].clone()),
                    4 if !n.output.is_empty() && !names.is_empty() => {
                        let i = rng.below(n.output.len());
                        n.output[i] = names[rng.below(names.len())].clone();
                    }
                    5 => {
                        let d = n.clone();
                        g.node.insert(rng.below(g.node.len() + 1), d);
                    }
                    6 => {
                        g.node.remove(k);
                    }
                    _ if !n.attribute.is_empty() => {
                        let a = rng.below(n.attribute.len());
                        let a = &mut n.attribute[a];
                        if let Some(i) = a.i {
                            a.i = Some(pick_number(rng, i));
                        } else if !a.ints.is_empty() {
                            let j = rng.below(a.ints.len());
                            match rng.below(3) {
                                0 => {
                                    a.ints.remove(j);
                                }
                                1 => a.ints.push(pick_number(rng, 0)),
                                _ => a.ints[j] = pick_number(rng, a.ints[j]),
                            }
                        } else if let Some(f) = a.f {
                            a.f = Some([0.0, -1.0, f32::NAN, f32::INFINITY, f * 2.0][rng.below(5)]);
                        } else if let Some(t) = a.t.as_mut() {
                            if t.dims.is_empty() {
                                t.dims.push(pick_number(rng, 1));
                            } else {
                                let j = rng.below(t.dims.len());
                                t.dims[j] = pick_number(rng, t.dims[j]);
                            }
                        } else {
                            a.r#type = rng.below(16) as i32;
                        }
                    }
                    _ => n.attribute.clear(),
                }
            }
            4..=6 if !g.initializer.is_empty() => {
                let k = rng.below(g.initializer.len());
                let t = &mut g.initializer[k];
                match rng.below(5) {
                    0 if !t.dims.is_empty() => {
                        let j = rng.below(t.dims.len());
                        t.dims[j] = pick_number(rng, t.dims[j]);
                    }
                    1 => {
                        if t.dims.is_empty() || rng.below(2) == 0 {
                            t.dims.push(pick_number(rng, 1));
                        } else {
                            t.dims.pop();
                        }
                    }
                    2 => t.data_type = rng.below(18) as i32,
                    3 if !t.raw_data.is_empty() => {
                        let n = rng.below(t.raw_data.len());
                        t.raw_data.truncate(n);
                    }
                    _ => {
                        // move the data between fields
                        if !t.raw_data.is_empty() {
                            t.int64_data = vec![pick_number(rng, 0); 1 + rng.below(4)];
                            t.raw_data.clear();
                        } else {
                            t.raw_data = vec![0xff; 1 + rng.below(64)];
                        }
                    }
                }
            }
            7 | 8 if !g.input.is_empty() => {
                let k = rng.below(g.input.len());
                if let Some(type_proto::Value::TensorType(t)) =
                    g.input[k].r#type.as_mut().and_then(|t| t.value.as_mut())
                {
                    match (rng.below(3), t.shape.as_mut()) {
                        (0, _) => t.elem_type = rng.below(18) as i32,
                        (1, Some(s)) if !s.dim.is_empty() => {
                            let j = rng.below(s.dim.len());
                            s.dim[j].value = Some(Dim::DimValue(pick_number(rng, 2)));
                        }
                        (_, Some(s)) => {
                            if s.dim.is_empty() || rng.below(2) == 0 {
                                s.dim.push(Default::default());
                            } else {
                                s.dim.pop();
                            }
                        }
                        _ => t.shape = None,
                    }
                }
            }
            _ => {
                if let Some(o) = m.opset_import.first_mut() {
                    o.version = [1, 12, 13, 17, 18, 21, 25, 26, i64::MAX][rng.below(9)];
                }
            }
        }
    }
    m.encode_to_vec()
}

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let read = |p: PathBuf| std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let models = own_models_dir();
    // the `-fields` targets start from the same seeds as their byte-mutating twins
    let mut out: Vec<Vec<u8>> = match target.trim_end_matches("-fields") {
        "onnx" => ["gpt2_tiny.legacy.op17.onnx", "llama_tiny.dynamo.op18.onnx"]
            .iter()
            .map(|f| read(models.join(f)))
            .chain([tiny_onnx()])
            .collect(),
        "npz" => vec![
            read(repo().join("examples/models/mlp.io.npz")),
            read(repo().join("examples/models/mlp.weights.npz")),
            read(models.join("gpt2_tiny.io.npz")),
        ],
        "text" => {
            let mut v = vec![read(repo().join("examples/models/mlp.hzp"))];
            let snaps = repo().join("tests/snapshots");
            for f in files_in(&snaps).into_iter().take(8) {
                let text = std::fs::read(&f).unwrap();
                // insta snapshots: the program text follows the `---` header.
                let body = match text
                    .windows(5)
                    .position(|w| w == b"---\n\n" || w == b"\n---\n")
                {
                    Some(i) => text[i + 5..].to_vec(),
                    None => text,
                };
                v.push(body);
            }
            v
        }
        "plan" => {
            let dir = std::env::temp_dir().join(format!("hzp-fuzz-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let plan = dir.join("plan.json");
            let st = std::process::Command::new(hzp_bin())
                .args([
                    "compile",
                    repo().join("examples/models/mlp.hzp").to_str().unwrap(),
                    "--shape",
                    "x=8x8",
                    "--mesh",
                    "gpu=2",
                    "--loss",
                    "mean",
                    "--micro-batches",
                    "1",
                    "-o",
                    plan.to_str().unwrap(),
                ])
                .output()
                .unwrap();
            assert!(
                st.status.success(),
                "{}",
                String::from_utf8_lossy(&st.stderr)
            );
            // and a plan of about 5 KB (one MatMul, SGD, two ranks), so that the corpus can
            // keep small plans that get past the hash check
            let tiny = dir.join("tiny.hzp");
            std::fs::write(
                &tiny,
                "program \"tiny\"\n\ninput %x : f32[2,2]\nparam %w : f32[2,2]\n\n\
                 %y = MatMul(%x, %w) : f32[2,2] \"mm\"\n\noutput %y\n",
            )
            .unwrap();
            let tiny_plan = dir.join("tiny.json");
            let st = std::process::Command::new(hzp_bin())
                .args([
                    "compile",
                    tiny.to_str().unwrap(),
                    "--mesh",
                    "gpu=2",
                    "--loss",
                    "mean",
                ])
                .args(["--micro-batches", "1", "--optimizer", "sgd", "-o"])
                .arg(&tiny_plan)
                .output()
                .unwrap();
            assert!(
                st.status.success(),
                "{}",
                String::from_utf8_lossy(&st.stderr)
            );
            vec![read(plan), read(tiny_plan)]
        }
        _ => unreachable!(),
    };
    out.extend(files_in(&crashes_dir(target)).into_iter().map(read));
    out.extend(files_in(&corpus_dir(target)).into_iter().map(read));
    out
}

/// A model of a few hundred bytes that imports: `z = Softmax(MatMul(x + y, w))` with `x`, `y`
/// of [2, 3] and `w` a [3, 2] initializer, so that small mutated models reach import.
fn tiny_onnx() -> Vec<u8> {
    use hzp_frontends::onnx::proto::*;
    use prost::Message;
    let input = |name: &str| ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: 1,
                shape: Some(TensorShapeProto {
                    dim: [2, 3]
                        .iter()
                        .map(|&v| tensor_shape_proto::Dimension {
                            value: Some(tensor_shape_proto::dimension::Value::DimValue(v)),
                            ..Default::default()
                        })
                        .collect(),
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    };
    let node = |op: &str, ins: &[&str], out: &str| NodeProto {
        op_type: op.into(),
        name: out.into(),
        input: ins.iter().map(|s| s.to_string()).collect(),
        output: vec![out.into()],
        ..Default::default()
    };
    ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(GraphProto {
            name: "g".into(),
            node: vec![
                node("Add", &["x", "y"], "s"),
                node("MatMul", &["s", "w"], "m"),
                node("Softmax", &["m"], "z"),
            ],
            initializer: vec![TensorProto {
                name: "w".into(),
                dims: vec![3, 2],
                data_type: 1,
                float_data: vec![0.5, -1.0, 2.0, 0.25, -0.75, 1.5],
                ..Default::default()
            }],
            input: vec![input("x"), input("y")],
            output: vec![ValueInfoProto {
                name: "z".into(),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// Cuts chunks out of `input` (halves, then quarters, ... down to single bytes) while `f`
/// still stops at `stage` on what is left, until `deadline`.
fn shrink(f: Target, input: &[u8], stage: &str, deadline: Instant) -> Vec<u8> {
    let mut cur = input.to_vec();
    let mut chunk = cur.len().div_ceil(2);
    while chunk >= 1 && Instant::now() < deadline {
        let mut i = 0;
        while i < cur.len() && Instant::now() < deadline {
            let mut cand = cur[..i].to_vec();
            cand.extend_from_slice(&cur[(i + chunk).min(cur.len())..]);
            let t = Instant::now();
            let same = run_one(f, &cand).is_ok_and(|s| s == stage);
            if same && t.elapsed() < Duration::from_secs(1) {
                cur = cand;
            } else {
                i += chunk;
            }
        }
        chunk /= 2;
    }
    cur
}

/// Keeps `input` as the corpus file of `stage` for target `name` when it is at most
/// [`CORPUS_MAX_BYTES`] and smaller than the file there (or there is none). Says what it did.
fn keep_in_corpus(name: &str, stage: &str, input: &[u8]) -> Option<String> {
    let file = corpus_dir(name).join(stage_file(stage));
    let old = std::fs::read(&file).ok();
    if input.len() > CORPUS_MAX_BYTES || old.as_ref().is_some_and(|o| o.len() <= input.len()) {
        return None;
    }
    std::fs::create_dir_all(corpus_dir(name)).unwrap();
    std::fs::write(&file, input).unwrap();
    Some(format!(
        "{} ({} bytes, was {})",
        file.display(),
        input.len(),
        old.map_or("absent".into(), |o| format!("{} bytes", o.len()))
    ))
}

/// `HZP_FUZZ_SECONDS` per target (default 10), `HZP_FUZZ_TARGET` to pick one.
#[test]
#[ignore = "long-running; run with examples/fuzz/run.sh SECONDS"]
fn fuzz() {
    hzp_frontends::limits::set_max_memory(256 << 20);
    let secs: u64 = std::env::var("HZP_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let only = std::env::var("HZP_FUZZ_TARGET").ok();
    // Quiet panics: they are findings, reported below.
    std::panic::set_hook(Box::new(|_| {}));
    let mut found = Vec::new();
    for (name, f) in TARGETS {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let seeds = seeds(name);
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (secs << 8) ^ name.len() as u64);
        let start = Instant::now();
        let mut runs = 0u64;
        let mut stages: std::collections::BTreeMap<&str, u64> = Default::default();
        // per stage, the smallest input that reached it
        let mut smallest: std::collections::BTreeMap<&str, Vec<u8>> = Default::default();
        while start.elapsed() < Duration::from_secs(secs) {
            let base = &seeds[rng.below(seeds.len())];
            let input = match name {
                "onnx-fields" => mutate_onnx_fields(&mut rng, base),
                "plan-fields" => mutate_plan_fields(&mut rng, base),
                _ => mutate(&mut rng, base, &seeds),
            };
            let t = Instant::now();
            let r = run_one(f, &input);
            let slow = t.elapsed() > Duration::from_secs(5);
            runs += 1;
            if let Ok(stage) = r {
                *stages.entry(stage).or_default() += 1;
                if !slow && smallest.get(stage).is_none_or(|s| input.len() < s.len()) {
                    smallest.insert(stage, input.clone());
                }
            }
            if r.is_err() || slow {
                let dir = crashes_dir(name);
                std::fs::create_dir_all(&dir).unwrap();
                let mut h = std::collections::hash_map::DefaultHasher::new();
                std::hash::Hash::hash(&input, &mut h);
                let file = dir.join(format!(
                    "{}-{:016x}",
                    if slow { "slow" } else { "crash" },
                    std::hash::Hasher::finish(&h)
                ));
                std::fs::write(&file, &input).unwrap();
                found.push(format!(
                    "{name}: {} ({})",
                    file.display(),
                    r.err().unwrap_or_else(|| format!("took {:?}", t.elapsed()))
                ));
            }
        }
        // the corpus: each stage's smallest input, shrunk (a tenth of the time per stage,
        // 2 to 30 s)
        for (stage, input) in &smallest {
            let deadline = Instant::now() + Duration::from_secs((secs / 10).clamp(2, 30));
            let small = shrink(f, input, stage, deadline);
            match keep_in_corpus(name, stage, &small) {
                Some(kept) => eprintln!("fuzz {name}: kept {kept}"),
                None if small.len() > CORPUS_MAX_BYTES => eprintln!(
                    "fuzz {name}: `{stage}`: the smallest input is {} bytes, not kept",
                    small.len()
                ),
                None => {}
            }
        }
        let pct = |n: u64| 100.0 * n as f64 / runs.max(1) as f64;
        eprintln!(
            "fuzz {name}: {runs} inputs in {:.0} s, {} findings so far; {}",
            start.elapsed().as_secs_f64(),
            found.len(),
            stages
                .iter()
                .map(|(k, &n)| format!("{k} {:.1}%", pct(n)))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let _ = std::panic::take_hook();
    assert!(found.is_empty(), "findings:\n{}", found.join("\n"));
}
