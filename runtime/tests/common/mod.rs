//! Helpers the executor tests share (each test uses some of them).
#![allow(dead_code)]

use hzp_ir::plan::{Buffer, BufferKind, Plan, ShardGroups};
use hzp_ir::{Group, Program};

/// A plan that runs `p` (which names its mesh) with every value in its own 64-byte-aligned
/// slot of the arena, one after another: no two values share bytes, so any schedule is safe.
pub fn plan_of(p: Program) -> Plan {
    let mut buffers = Vec::new();
    let mut at = 0u64;
    for (i, v) in p.values.iter().enumerate() {
        let bytes = (v.ty.numel() * v.ty.dtype.size_bytes()) as u64;
        if bytes > 0 {
            buffers.push(Buffer {
                value: hzp_ir::ValueId(i as u32),
                offset: at,
                bytes,
                kind: BufferKind::Other,
            });
            at += bytes.div_ceil(64) * 64;
        }
    }
    let mesh = p.mesh.clone().expect("the test program names its mesh");
    let none = Group::new(Vec::<String>::new());
    Plan::new(
        "test",
        "test",
        mesh,
        ShardGroups {
            params: none.clone(),
            grads: none.clone(),
            optim: none,
        },
        p,
        at,
        buffers,
    )
}

/// An executor for `p` laid out by [`plan_of`], issuing collectives as `comm` says, with
/// `inputs` set.
pub fn executor(
    p: Program,
    comm: hzp_runtime::exec::CommMode,
    inputs: &[(String, hzp_ir::Tensor)],
) -> Result<hzp_runtime::exec::Executor, String> {
    let opts = hzp_runtime::exec::ExecOptions {
        comm,
        ..hzp_runtime::exec::ExecOptions::default()
    };
    let mut ex =
        hzp_runtime::exec::Executor::new(&plan_of(p), &[], opts).map_err(|e| e.to_string())?;
    ex.set_inputs(inputs).map_err(|e| e.to_string())?;
    Ok(ex)
}

// ---- for the tests that run CUDA kernel sources as C++ on the CPU

/// Deterministic pseudo-random numbers in [0, 1).
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> f64 {
        let s = &mut self.0;
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        (*s >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub fn bytes_of(t: &hzp_ir::Tensor) -> Vec<u8> {
    match &t.data {
        hzp_ir::tensor::Data::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        hzp_ir::tensor::Data::BF16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        hzp_ir::tensor::Data::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        hzp_ir::tensor::Data::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        hzp_ir::tensor::Data::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        hzp_ir::tensor::Data::Bool(v) => v.iter().map(|&b| b as u8).collect(),
    }
}

/// Runs `c`, failing the test with its output when it does not succeed.
pub fn run_cmd(c: &mut std::process::Command) -> std::process::Output {
    let o = c.output().unwrap_or_else(|e| panic!("{c:?}: {e}"));
    assert!(
        o.status.success(),
        "{c:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// A fresh folder under the system's temporary directory, named for `tag` and this process.
pub fn tempdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("hzp-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The `main` of an emulation program: `main CASE ALLOC INPUT` zeroes an arena of ALLOC bytes,
/// copies in the parts of INPUT ([`emulation_input`]), runs `run_case(CASE, arena)` and
/// writes the listed ranges of the arena to stdout.
pub const EMULATION_MAIN: &str = r#"
int main(int argc, char** argv) {
    long alloc = atol(argv[2]);
    char* A = (char*)calloc(alloc, 1);
    size_t n; char* in = read_all(argv[3], &n); size_t at = 0;
    u64 parts; memcpy(&parts, in, 8); at = 8;
    for (u64 q = 0; q < parts; ++q) { u64 off, len; memcpy(&off, in + at, 8);
        memcpy(&len, in + at + 8, 8); memcpy(A + off, in + at + 16, len); at += 16 + len; }
    run_case(atoi(argv[1]), A);
    u64 outs; memcpy(&outs, in + at, 8); at += 8;
    for (u64 q = 0; q < outs; ++q) { u64 off, len; memcpy(&off, in + at, 8);
        memcpy(&len, in + at + 8, 8); fwrite(A + off, 1, len, stdout); at += 16; }
    return 0;
}
"#;

/// The arena offset of value `name` (a leading `%` allowed) in `low`, lowered from `plan`.
pub fn value_offset(plan: &Plan, low: &hzp_runtime::cuda::lower::LoweredPlan, name: &str) -> u64 {
    let v = plan
        .program
        .find_value(name.trim_start_matches('%'))
        .unwrap_or_else(|| panic!("no value `{name}`"));
    low.loc[v.index()].0
}

/// The input file of [`EMULATION_MAIN`]: each input's (offset, bytes, data), then the ranges
/// to write out: each of `outputs`, then the 4-byte error word.
pub fn emulation_input(
    plan: &Plan,
    low: &hzp_runtime::cuda::lower::LoweredPlan,
    inputs: &std::collections::HashMap<String, hzp_ir::Tensor>,
    outputs: &[&str],
) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend((inputs.len() as u64).to_le_bytes());
    for (name, t) in inputs {
        let data = bytes_of(t);
        b.extend(value_offset(plan, low, name).to_le_bytes());
        b.extend((data.len() as u64).to_le_bytes());
        b.extend(data);
    }
    b.extend((outputs.len() as u64 + 1).to_le_bytes());
    for name in outputs {
        let v = plan
            .program
            .find_value(name.trim_start_matches('%'))
            .unwrap();
        b.extend(value_offset(plan, low, name).to_le_bytes());
        b.extend((plan.program.ty(v).size_bytes() as u64).to_le_bytes());
    }
    b.extend(low.err_offset.to_le_bytes());
    b.extend(4u64.to_le_bytes());
    b
}
