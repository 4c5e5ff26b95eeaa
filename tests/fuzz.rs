//! Fuzz targets for what hzp reads from users: the ONNX importer, the text IR parser, the
//! `.npz` reader and `plan.json` loading (parse + verify).
//!
//! - `regression_corpus` (always run) feeds every file under `tests/fuzz/crashes/<target>/`
//!   to its target: inputs that once crashed or hung stay fixed.
//! - `fuzz` (ignored; `examples/fuzz/run.sh SECONDS [TARGET]` runs it in release mode) mutates
//!   seeds (the test models, their inputs, `.hzp` files, a compiled plan) for SECONDS per
//!   target with a small mutation fuzzer (bit flips, byte and chunk edits, splices, numbers
//!   that matter), under `catch_unwind`. An input that panics, or takes over 5 s, is written
//!   to `tests/fuzz/crashes/<target>/` and the run fails naming it.
//!
//! No nightly toolchain or cargo-fuzz is needed.

mod common;
use common::*;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

type Target = fn(&[u8]);

fn onnx_target(b: &[u8]) {
    let _ = hzp_frontends::onnx::import_bytes(
        b,
        None,
        "fuzz.onnx",
        &hzp_frontends::onnx::ImportOptions::default(),
    );
}

fn text_target(b: &[u8]) {
    let s = String::from_utf8_lossy(b);
    if let Ok(p) = hzp_ir::text::parse(&s, "fuzz.hzp", &|_| None) {
        let _ = hzp_ir::verify(&p);
        // What parses must print and parse back.
        let again = hzp_ir::text::print(&p);
        let _ = hzp_ir::text::parse(&again, "fuzz.hzp", &|_| None);
    }
}

fn npz_target(b: &[u8]) {
    let _ = hzp_frontends::npz::read_bytes(b, "fuzz.npz");
}

fn plan_target(b: &[u8]) {
    let s = String::from_utf8_lossy(b);
    if let Ok(plan) = hzp_ir::Plan::from_json(&s, "fuzz.json") {
        let _ = hzp_passes::plan::verify::verify_plan(&plan, None);
    }
}

const TARGETS: [(&str, Target); 4] = [
    ("onnx", onnx_target),
    ("text", text_target),
    ("npz", npz_target),
    ("plan", plan_target),
];

fn crashes_dir(target: &str) -> PathBuf {
    repo().join("tests/fuzz/crashes").join(target)
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

/// Runs `f` on `input`; Err(panic message) if it panicked.
fn run_one(f: Target, input: &[u8]) -> Result<(), String> {
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
    let mut ran = 0;
    for (name, f) in TARGETS {
        for file in files_in(&crashes_dir(name)) {
            let input = std::fs::read(&file).unwrap();
            let start = Instant::now();
            if let Err(m) = run_one(f, &input) {
                panic!("{} ({name}) panics again: {m}", file.display());
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{} ({name}) takes {:?}",
                file.display(),
                start.elapsed()
            );
            ran += 1;
        }
    }
    println!("{ran} corpus inputs, none panics");
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

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let read = |p: PathBuf| std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let models = own_models_dir();
    let mut out: Vec<Vec<u8>> = match target {
        "onnx" => ["gpt2_tiny.legacy.op17.onnx", "llama_tiny.dynamo.op18.onnx"]
            .iter()
            .map(|f| read(models.join(f)))
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
            vec![read(plan)]
        }
        _ => unreachable!(),
    };
    out.extend(files_in(&crashes_dir(target)).into_iter().map(read));
    out
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
        while start.elapsed() < Duration::from_secs(secs) {
            let base = &seeds[rng.below(seeds.len())];
            let input = mutate(&mut rng, base, &seeds);
            let t = Instant::now();
            let r = run_one(f, &input);
            let slow = t.elapsed() > Duration::from_secs(5);
            runs += 1;
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
        eprintln!(
            "fuzz {name}: {runs} inputs in {:.0} s, {} findings so far",
            start.elapsed().as_secs_f64(),
            found.len()
        );
    }
    let _ = std::panic::take_hook();
    assert!(found.is_empty(), "findings:\n{}", found.join("\n"));
}
