//! The in-process communicator against the lockstep reference runner (`ReferenceRunner`): every
//! collective kind, on random data, over groups of one and two axes in both axis orders,
//! gives rank 0 the same bits; every rank gets the collective's definition (checked in f64
//! against a direct computation from the global data); sync and async modes agree bitwise.

mod common;
use hzp_ir::{DType, Group, Mesh, Program, ReduceOp, Tensor};
use hzp_runtime::exec::{CommMode, Executor};
use hzp_runtime::reference::ReferenceRunner;

/// Deterministic pseudo-random numbers in [-1, 1).
fn random(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

const COLLECTIVES: &[(&str, &str)] = &[
    ("ag1", "AllGather{group=[gpu], axis=1}(%x) : f32[4,12]"),
    ("ag0", "AllGather{group=[gpu,node], axis=0}(%x) : f32[16,6]"),
    (
        "rs",
        "ReduceScatter{group=[node,gpu], axis=0, reduce=sum}(%x) : f32[1,6]",
    ),
    (
        "rsm",
        "ReduceScatter{group=[gpu], axis=1, reduce=mean}(%x) : f32[4,3]",
    ),
    ("ar", "AllReduce{group=[node], reduce=sum}(%x) : f32[4,6]"),
    (
        "arw",
        "AllReduce{group=[gpu,node], reduce=sum}(%x) : f32[4,6]",
    ),
    (
        "armax",
        "AllReduce{group=[node,gpu], reduce=max}(%x) : f32[4,6]",
    ),
    ("armin", "AllReduce{group=[gpu], reduce=min}(%x) : f32[4,6]"),
    ("arp", "AllReduce{group=[gpu], reduce=prod}(%x) : f32[4,6]"),
    (
        "a2a",
        "AllToAll{group=[gpu], split_axis=0, concat_axis=1}(%x) : f32[2,12]",
    ),
    (
        "a2b",
        "AllToAll{group=[node,gpu], split_axis=0, concat_axis=1}(%x) : f32[1,24]",
    ),
    ("bc", "Broadcast{group=[gpu,node], root=1}(%x) : f32[4,6]"),
    (
        "arbf",
        "AllReduce{group=[node,gpu], reduce=sum}(%y) : bf16[4,6]",
    ),
    (
        "rsbf",
        "ReduceScatter{group=[gpu], axis=0, reduce=mean}(%y) : bf16[2,6]",
    ),
];

fn program(stream: &str) -> Program {
    let mut src = String::from(
        "program \"c\"\nmesh node=2,gpu=2\n\ninput %x : f32[4,6]\ninput %y : bf16[4,6]\n\n",
    );
    for (name, body) in COLLECTIVES {
        src.push_str(&format!("%{name} = {body} \"{name}\" {stream}\n"));
    }
    src.push('\n');
    for (name, _) in COLLECTIVES {
        src.push_str(&format!("output %{name}\n"));
    }
    hzp_ir::text::parse(&src, "collectives", &|_| None).unwrap()
}

fn global() -> Vec<(String, Tensor)> {
    vec![
        (
            "x".to_string(),
            Tensor::from_f64(DType::F32, vec![16, 6], &random(96, 1)),
        ),
        (
            "y".to_string(),
            Tensor::from_f64(DType::BF16, vec![16, 6], &random(96, 2)),
        ),
    ]
}

/// Rank r's rows of a global [16, 6] array, as f64.
fn rows(t: &Tensor, r: usize) -> Vec<f64> {
    t.to_f64_vec()[r * 24..(r + 1) * 24].to_vec()
}

/// The definition of each collective for `rank`, in f64, straight from the global data.
fn expected(name: &str, mesh: &Mesh, rank: usize, g: &[(String, Tensor)]) -> Vec<f64> {
    let x = &g[0].1;
    let y = &g[1].1;
    let grp = |axes: &[&str]| Group::new(axes.iter().copied());
    let members = |axes: &[&str]| mesh.group_members(&grp(axes), rank).unwrap();
    let idx = |axes: &[&str]| mesh.group_index(&grp(axes), rank).unwrap();
    let reduce = |axes: &[&str], t: &Tensor, how: ReduceOp| -> Vec<f64> {
        let ms = members(axes);
        let mut acc = rows(t, ms[0]);
        for &m in &ms[1..] {
            for (a, b) in acc.iter_mut().zip(rows(t, m)) {
                *a = match how {
                    ReduceOp::Sum | ReduceOp::Mean => *a + b,
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Prod => *a * b,
                }
            }
        }
        if how == ReduceOp::Mean {
            acc.iter_mut().for_each(|a| *a /= ms.len() as f64);
        }
        acc
    };
    // element (i, j) of a [4, 6] row-major block
    let at = |v: &[f64], i: usize, j: usize| v[i * 6 + j];
    match name {
        "ag1" => {
            let ms = members(&["gpu"]);
            let mut out = Vec::new();
            for i in 0..4 {
                for &m in &ms {
                    let v = rows(x, m);
                    out.extend((0..6).map(|j| at(&v, i, j)));
                }
            }
            out
        }
        "ag0" => members(&["gpu", "node"])
            .iter()
            .flat_map(|&m| rows(x, m))
            .collect(),
        "rs" => {
            let v = reduce(&["node", "gpu"], x, ReduceOp::Sum);
            let i = idx(&["node", "gpu"]);
            v[i * 6..(i + 1) * 6].to_vec()
        }
        "rsm" => {
            let v = reduce(&["gpu"], x, ReduceOp::Mean);
            let i = idx(&["gpu"]);
            (0..4)
                .flat_map(|r| (0..3).map(move |j| (r, i * 3 + j)))
                .map(|(r, j)| at(&v, r, j))
                .collect()
        }
        "ar" => reduce(&["node"], x, ReduceOp::Sum),
        "arw" => reduce(&["gpu", "node"], x, ReduceOp::Sum),
        "armax" => reduce(&["node", "gpu"], x, ReduceOp::Max),
        "armin" => reduce(&["gpu"], x, ReduceOp::Min),
        "arp" => reduce(&["gpu"], x, ReduceOp::Prod),
        "a2a" => {
            // piece idx (rows 2*idx..) of each member, concatenated along columns
            let i = idx(&["gpu"]);
            let ms = members(&["gpu"]);
            let mut out = Vec::new();
            for r in 0..2 {
                for &m in &ms {
                    let v = rows(x, m);
                    out.extend((0..6).map(|j| at(&v, 2 * i + r, j)));
                }
            }
            out
        }
        "a2b" => {
            // row idx of each member, concatenated along columns
            let i = idx(&["node", "gpu"]);
            members(&["node", "gpu"])
                .iter()
                .flat_map(|&m| rows(x, m)[i * 6..(i + 1) * 6].to_vec())
                .collect()
        }
        "bc" => rows(x, members(&["gpu", "node"])[1]),
        "arbf" => reduce(&["node", "gpu"], y, ReduceOp::Sum),
        "rsbf" => {
            let v = reduce(&["gpu"], y, ReduceOp::Mean);
            let i = idx(&["gpu"]);
            v[i * 12..(i + 1) * 12].to_vec()
        }
        other => panic!("{other}"),
    }
}

fn run(stream: &str, comm: CommMode) -> (Executor, Program) {
    let p = program(stream);
    let mut ex = common::executor(p.clone(), comm, &global()).unwrap();
    ex.step().unwrap();
    (ex, p)
}

#[test]
fn every_collective_matches_the_reference_runner_and_its_definition() {
    let (ex, p) = run("@reducescatter", CommMode::Async);
    let mesh = Mesh::parse("node=2,gpu=2").unwrap();
    let mut spmd = ReferenceRunner::new(&p, &[], &[]).unwrap();
    let want0 = spmd.step(&global()).unwrap();
    let got0 = ex.outputs(0);
    for ((gn, g), (wn, w)) in got0.iter().zip(&want0) {
        assert_eq!(gn, wn);
        assert_eq!(g, w, "{gn}: rank 0 differs from ReferenceRunner");
    }
    for r in 0..4 {
        for (name, t) in ex.outputs(r) {
            let want = expected(&name, &mesh, r, &global());
            let got = t.to_f64_vec();
            assert_eq!(got.len(), want.len(), "{name} rank {r}");
            let tol = if t.dtype() == DType::BF16 { 2e-2 } else { 1e-6 };
            for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= tol,
                    "{name} rank {r} element {k}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn sync_async_and_stream_placement_agree_bitwise() {
    let base: Vec<Vec<(String, Tensor)>> = {
        let (ex, _) = run("@reducescatter", CommMode::Async);
        (0..4).map(|r| ex.outputs(r)).collect()
    };
    for (stream, comm) in [
        ("@allgather", CommMode::Async),
        ("", CommMode::Async),
        ("@reducescatter", CommMode::Sync),
    ] {
        let (ex, _) = run(stream, comm);
        for (r, b) in base.iter().enumerate() {
            assert_eq!(&ex.outputs(r), b, "{stream:?} {comm:?} rank {r}");
        }
    }
}
