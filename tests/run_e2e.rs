//! The conformance suite of the plan executors (`hzp_runtime::backend`) against single-rank
//! training: for every model in tests/models (both exporters), on meshes gpu=2, gpu=4,
//! node=2,gpu=2 and node=2,gpu=4 and for the strategies asynchzp, zero3, hsdp and ddp, five
//! AdamW steps of each backend this machine can run (the CPU executor always; the CUDA
//! executor with every rank on the one GPU when a GPU and its libraries are found, else
//! skipped with a printed reason) give the parameters and losses of `Trainer` on the
//! unsharded step with the same global batch, within the backend's tolerance (1e-5 relative
//! per parameter on the CPU). Plans are compiled as `hzp compile` does
//! (`hzp_passes::compile::compile_plan` with its defaults: collective rewriting, one bucket
//! per unit) with two micro-batches wherever a rank has two rows (one on `node=2,gpu=4`);
//! for a backend without fused attention the model is imported with attention written out.

mod common;
use common::*;
use hzp_ir::plan::Plan;
use hzp_ir::{Mesh, Program, Tensor};
use hzp_passes::compile::{compile_plan, CompileOptions};
use hzp_passes::cost::cluster::ClusterSpec;
use hzp_passes::plan::planner::Strategy;
use hzp_passes::train::{training_step, LossKind, Optimizer, TrainConfig};
use hzp_runtime::backend::Backend;
use hzp_runtime::exec::{ExecOptions, Executor};
use hzp_runtime::train::Trainer;
use std::path::Path;

const MESHES: [&str; 4] = ["gpu=2", "gpu=4", "node=2,gpu=2", "node=2,gpu=4"];
const STRATEGIES: [&str; 4] = ["asynchzp", "zero3", "hsdp", "ddp"];
const ROWS: usize = 8;
const STEPS: usize = 5;

fn config(loss: &str) -> TrainConfig {
    TrainConfig {
        loss: LossKind::parse(loss, None, None).unwrap(),
        optimizer: Some(Optimizer::AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }),
        clip_grad_norm: None,
        micro_batches: 1,
        compute: hzp_ir::DType::F32,
    }
}

/// A global batch of ROWS rows from the model's two example rows: token ids shifted per pair
/// of rows, so that the ranks see different data; masks and token types repeated.
fn global_batch(io: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    io.iter()
        .filter(|(k, _)| k != "torch_out")
        .map(|(k, t)| {
            let v = t.to_i64_vec().expect("integer inputs");
            let rows = t.shape[0];
            let row = v.len() / rows;
            let mut out = Vec::with_capacity(row * ROWS);
            for r in 0..ROWS {
                let src = &v[(r % rows) * row..(r % rows + 1) * row];
                let shift = (r / rows) as i64 * 37;
                if k == "input_ids" {
                    out.extend(src.iter().map(|&x| (x + shift).rem_euclid(256)));
                } else {
                    out.extend_from_slice(src);
                }
            }
            let mut shape = t.shape.clone();
            shape[0] = ROWS;
            (k.clone(), Tensor::i64(shape, out))
        })
        .collect()
}

fn import_at(model: &Path, batch: &[(String, Tensor)], rows: usize) -> Program {
    import_at_with(model, batch, rows, true)
}

/// [`import_at`], with attention fused into one op or (`fused: false`) written out.
fn import_at_with(model: &Path, batch: &[(String, Tensor)], rows: usize, fused: bool) -> Program {
    import_at_for(model, batch, rows, (fused, true))
}

/// [`import_at`] in the forms a backend runs: (attention fused, mixtures of experts routed).
fn import_at_for(
    model: &Path,
    batch: &[(String, Tensor)],
    rows: usize,
    (fused, routed): (bool, bool),
) -> Program {
    let shaped: Vec<(String, Tensor)> = batch
        .iter()
        .map(|(k, t)| {
            let mut s = t.shape.clone();
            s[0] = rows;
            (
                k.clone(),
                Tensor::zeros(&hzp_ir::TensorType::new(t.dtype(), s)),
            )
        })
        .collect();
    import_in_form(model, &shaped, !fused, !routed)
}

/// What `hzp compile` does, in-process, through the library driver with its defaults
/// (planner, collective rewriting with one bucket per unit, memory plan, verification).
fn build_plan(fwd: &Program, mesh: &Mesh, strategy: &str, cfg: &TrainConfig) -> Plan {
    let cluster = ClusterSpec::load(repo().join("examples/clusters/h100-dgx.toml")).unwrap();
    let opts = CompileOptions {
        strategy: Strategy::parse(strategy).unwrap(),
        train: cfg.clone(),
        ..CompileOptions::new("test", mesh.clone(), cluster)
    };
    compile_plan(fwd, &opts, &mut |_| Ok(())).unwrap().plan
}

/// Relative L2 error of `a` against `b` over the elements `keep` marks.
fn rel(a: &Tensor, b: &Tensor, keep: &[bool]) -> f64 {
    assert_eq!(a.shape, b.shape);
    let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
    let (mut d, mut n) = (0.0, 0.0);
    for i in (0..x.len()).filter(|&i| keep[i]) {
        d += (x[i] - y[i]) * (x[i] - y[i]);
        n += y[i] * y[i];
    }
    d.sqrt() / n.sqrt().max(1e-30)
}

/// Per parameter, which elements have a gradient that is not round-off (at least 1e-5 of
/// the parameter's largest, above the round-off of f32 sums of a few hundred terms): AdamW
/// divides each gradient by its own running RMS, so an element whose gradient is zero in
/// exact arithmetic (an attention key bias: softmax ignores a per-row constant) moves by
/// O(lr) in a direction set by round-off, differently for any other summation order. Those elements are held by the whole-model check only (as in
/// tests/training.rs).
fn meaningful(fwd: &Program, cfg: &TrainConfig, batch: &[(String, Tensor)]) -> Vec<Vec<bool>> {
    let gcfg = TrainConfig {
        optimizer: None,
        ..cfg.clone()
    };
    let gp = training_step(fwd, &gcfg).unwrap();
    let outs = hzp_runtime::eval::evaluate(&gp, &program_inputs(&gp, batch)).unwrap();
    let grads = &outs[outs.len() - fwd.params.len()..];
    grads
        .iter()
        .map(|(_, g)| {
            let g = g.to_f64_vec();
            let gmax = g.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            g.iter().map(|x| x.abs() >= 1e-5 * gmax).collect()
        })
        .collect()
}

fn check_model(stem: &str, loss: &str) {
    check_model_with(stem, config(loss), &MESHES, &STRATEGIES);
}

fn check_model_with(stem: &str, cfg: TrainConfig, meshes: &[&str], strategies: &[&str]) {
    let model = own_models_dir().join(format!("{stem}.onnx"));
    let model_name = stem.split('.').next().unwrap();
    let io = read_npz(&own_models_dir().join(format!("{model_name}.io.npz")));
    let batch = global_batch(&io);

    // The reference: one rank, the whole batch.
    let fwd1 = import_at(&model, &batch, ROWS);
    let full: Vec<(String, Tensor)> = fwd1
        .params
        .iter()
        .map(|p| (fwd1.value(p.value).name.clone(), p.data.clone().unwrap()))
        .collect();
    // the one-rank step has no owners to place Newton-Schulz on: the reference replicates
    let cfg1 = one_rank_config(&cfg);
    let step1 = training_step(&fwd1, &cfg1).unwrap();
    let mut trainer = Trainer::new(&step1).unwrap();
    let inputs1 = program_inputs(&step1, &batch);
    let mut ref_losses = Vec::new();
    for _ in 0..STEPS {
        ref_losses.push(trainer.step(&inputs1).unwrap()[0].1.to_f64_vec()[0]);
    }
    let want = trainer.parameters();
    let keep = meaningful(&fwd1, &cfg, &batch);

    let mut failures = Vec::new();
    let mut ran = 0;
    for backend in hzp_runtime::backend::all() {
        if let Err(why) = backend.available() {
            skip::skip(
                "",
                backend_missing(backend.as_ref()),
                &format!("{stem}: backend {} not run: {why}", backend.name()),
            );
            continue;
        }
        ran += 1;
        failures.extend(conformance(
            backend.as_ref(),
            (stem, &model, &batch),
            &cfg,
            (meshes, strategies),
            &full,
            (&ref_losses, &want),
            &keep,
        ));
    }
    assert!(ran >= 1, "no backend ran (the CPU backend always can)");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// One backend on every mesh and strategy; the failures, described.
fn conformance(
    backend: &dyn Backend,
    (stem, model, batch): (&str, &Path, &[(String, Tensor)]),
    cfg: &TrainConfig,
    (meshes, strategies): (&[&str], &[&str]),
    full: &[(String, Tensor)],
    (ref_losses, want): (&[f64], &[(String, Tensor)]),
    keep: &[Vec<bool>],
) -> Vec<String> {
    let all: Vec<Vec<bool>> = want.iter().map(|(_, t)| vec![true; t.numel()]).collect();
    let mut failures = Vec::new();
    for &mesh_s in meshes {
        let mesh = Mesh::parse(mesh_s).unwrap();
        let w = mesh.world_size();
        // two micro-batches where a rank has at least two rows
        let m = if ROWS / w >= 2 { 2 } else { 1 };
        let fwd = import_at_for(
            model,
            batch,
            ROWS / w / m,
            (backend.fused_attention(), backend.routed_moe()),
        );
        let mcfg = TrainConfig {
            micro_batches: m,
            ..cfg.clone()
        };
        for &strategy in strategies {
            let plan = build_plan(&fwd, &mesh, strategy, &mcfg);
            assert_eq!(plan.micro_batches, m);
            let inputs = program_inputs(&plan.program, batch);
            let run = match backend.run(&plan, full, &mut |_| Ok(inputs.clone()), STEPS) {
                Ok(run) => run,
                Err(e) => {
                    failures.push(format!("{stem} on {mesh_s} ({strategy}): {e}"));
                    continue;
                }
            };
            let (stats, got) = (run.steps, run.params);
            assert_eq!(got.len(), want.len(), "{stem} {mesh_s} {strategy}");
            let mut worst = (0.0f64, String::new());
            for (((gn, g), (wn, wt)), k) in got.iter().zip(want).zip(keep) {
                assert_eq!(gn, wn);
                let r = rel(g, wt, k);
                if r > worst.0 || r.is_nan() {
                    worst = (r, gn.clone());
                }
            }
            // the whole model, every element
            let cat = |v: &[(String, Tensor)]| {
                Tensor::f32(
                    vec![v.iter().map(|(_, t)| t.numel()).sum::<usize>()],
                    v.iter().flat_map(|(_, t)| t.to_f32_vec()).collect(),
                )
            };
            let whole = rel(&cat(&got), &cat(want), &all.concat());
            let dl = stats
                .iter()
                .zip(ref_losses)
                .map(|(s, l)| (s.loss.unwrap() - l).abs() / l.abs())
                .fold(0.0, f64::max);
            // written so that NaN fails too
            let within = |x: f64| x <= backend.tolerance();
            if !within(worst.0) || !within(dl) || !within(whole) {
                failures.push(format!(
                    "{stem} on {} {mesh_s} ({strategy}, groups P={} G={} O={}): worst parameter `{}` \
                     off by {:.3e} relative; whole model {whole:.3e}; losses off by {dl:.3e}",
                    backend.name(),
                    plan.groups.params,
                    plan.groups.grads,
                    plan.groups.optim,
                    worst.1,
                    worst.0
                ));
            }
        }
    }
    failures
}

#[test]
fn gpt2_legacy() {
    check_model("gpt2_tiny.legacy.op17", "lm");
}

#[test]
fn gpt2_dynamo() {
    check_model("gpt2_tiny.dynamo.op18", "lm");
}

#[test]
fn llama_legacy() {
    check_model("llama_tiny.legacy.op17", "lm");
}

#[test]
fn llama_dynamo() {
    check_model("llama_tiny.dynamo.op18", "lm");
}

#[test]
fn bert_legacy() {
    check_model("bert_tiny.legacy.op17", "mean");
}

#[test]
fn bert_dynamo() {
    check_model("bert_tiny.dynamo.op18", "mean");
}

#[test]
fn moe_legacy() {
    check_model("moe_tiny.legacy.op17", "lm");
}

#[test]
fn moe_dynamo() {
    check_model("moe_tiny.dynamo.op18", "lm");
}

/// Muon (torch.optim.Muon on the hidden matrices, AdamW on the rest): the optimizer group's
/// shards of each matrix's Nesterov momentum are all-gathered, every rank of the group
/// orthogonalizes the whole matrix and keeps its shard of the result; N ranks equal one.
///
/// With torch's bf16 Newton-Schulz, a gradient summed in another order (any rank count,
/// DDP included) rounds some bf16 elements the other way and the non-contractive iteration
/// carries that to about 2e-2 on a matrix after 5 steps (torch against itself shows the
/// same, tests/models/make_muon_refs.py's control), so the 1e-5 check runs Newton-Schulz in
/// f32 (`ns_bf16: false`): the same sharding, gathers and shard selection.
fn muon_config() -> TrainConfig {
    let (lr, beta1, beta2, eps, weight_decay) = (1e-3, 0.9, 0.999, 1e-8, 0.01);
    TrainConfig {
        optimizer: Some(Optimizer::Muon {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            muon: hzp_passes::train::muon::MuonSettings {
                ns_bf16: false,
                ..hzp_passes::train::muon::MuonSettings::torch(
                    hzp_passes::train::muon::DEFAULT_LR,
                    hzp_passes::train::muon::MuonAdjust::Original,
                )
            },
        }),
        ..config("lm")
    }
}

/// `cfg` with Muon's placement replicated (what a one-rank step runs).
fn one_rank_config(cfg: &TrainConfig) -> TrainConfig {
    let mut c = cfg.clone();
    if let Some(Optimizer::Muon { muon, .. }) = &mut c.optimizer {
        muon.placement = hzp_passes::train::muon::MuonPlacement::Replicated;
    }
    c
}

/// Muon with Canzona placement: each matrix orthogonalized by one owner in O.
fn canzona_config() -> TrainConfig {
    let mut c = muon_config();
    if let Some(Optimizer::Muon { muon, .. }) = &mut c.optimizer {
        muon.placement = hzp_passes::train::muon::MuonPlacement::Canzona;
    }
    c
}

#[test]
fn muon_canzona_gpt2_legacy() {
    check_model_with(
        "gpt2_tiny.legacy.op17",
        canzona_config(),
        &["gpu=2", "gpu=4", "node=2,gpu=2"],
        &["asynchzp", "zero3"],
    );
}

#[test]
fn muon_canzona_llama_dynamo() {
    check_model_with(
        "llama_tiny.dynamo.op18",
        canzona_config(),
        &["gpu=2", "gpu=4", "node=2,gpu=2"],
        &["asynchzp", "zero3"],
    );
}

/// The Canzona plan runs Newton-Schulz only in its buckets (batched over each rank's slots),
/// exchanges with all-to-alls, and each rank's Newton-Schulz products are at most half the
/// replicated plan's here.
#[test]
fn canzona_plan_orthogonalizes_only_owned_slots() {
    let model = own_models_dir().join("gpt2_tiny.legacy.op17.onnx");
    let io = read_npz(&own_models_dir().join("gpt2_tiny.io.npz"));
    let batch = global_batch(&io);
    let mesh = Mesh::parse("gpu=4").unwrap();
    let fwd = import_at(&model, &batch, ROWS / 4);
    let flops = |p: &Program| -> (u64, usize, usize) {
        let (mut f, mut batched, mut a2a) = (0u64, 0, 0);
        for n in &p.nodes {
            if n.role.kind != hzp_ir::RoleKind::Optimizer {
                continue;
            }
            match n.op {
                hzp_ir::Op::MatMul => {
                    let a = &p.ty(n.inputs[0]).shape;
                    let b = &p.ty(n.inputs[1]).shape;
                    if a.len() == 3 {
                        batched += 1;
                    }
                    let k: usize = a[..a.len() - 1].iter().product();
                    f += (k * a[a.len() - 1] * b[b.len() - 1]) as u64;
                }
                hzp_ir::Op::AllToAll { .. } => a2a += 1,
                _ => {}
            }
        }
        (f, batched, a2a)
    };
    let rep = build_plan(&fwd, &mesh, "zero3", &muon_config());
    let can = build_plan(&fwd, &mesh, "zero3", &canzona_config());
    assert_eq!(rep.groups.optim, can.groups.optim);
    let (fr, br, _) = flops(&rep.program);
    let (fc, bc, ac) = flops(&can.program);
    assert_eq!(br, 0);
    assert!(bc > 0, "no batched Newton-Schulz in the Canzona plan");
    assert!(ac >= 2, "no all-to-all to the owners");
    let canzona_nodes = can
        .program
        .nodes
        .iter()
        .filter(|n| n.role.unit == hzp_passes::train::CANZONA_UNIT)
        .count();
    assert!(canzona_nodes > 0);
    // what inspect reports is the partition the builder ran
    let ms = hzp_passes::train::muon_parameters(&fwd).unwrap();
    assert_eq!(
        hzp_passes::train::canzona::of_plan(&can),
        Some(hzp_passes::train::canzona::partition(&ms, 4, 5))
    );
    assert_eq!(hzp_passes::train::canzona::of_plan(&rep), None);
    eprintln!("Newton-Schulz multiply-adds per rank: replicated {fr}, canzona {fc}");
    // the tiny model's buckets hold 2 matrices: over 4 ranks one slot each (half padding),
    // against both matrices on every rank
    assert!(fc * 2 <= fr, "canzona {fc} vs replicated {fr}");
}

#[test]
fn muon_gpt2_legacy() {
    check_model_with(
        "gpt2_tiny.legacy.op17",
        muon_config(),
        &["gpu=2", "gpu=4", "node=2,gpu=2"],
        &["asynchzp", "zero3", "ddp"],
    );
}

#[test]
fn muon_llama_dynamo() {
    check_model_with(
        "llama_tiny.dynamo.op18",
        muon_config(),
        &["gpu=2", "gpu=4", "node=2,gpu=2"],
        &["asynchzp", "zero3", "ddp"],
    );
}

#[test]
fn every_model_in_tests_models_is_covered() {
    let mut stems: Vec<String> = std::fs::read_dir(own_models_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".onnx"))
        .map(|f| f.trim_end_matches(".onnx").to_string())
        .collect();
    stems.sort();
    assert_eq!(
        stems,
        [
            "bert_tiny.dynamo.op18",
            "bert_tiny.legacy.op17",
            "gpt2_tiny.dynamo.op18",
            "gpt2_tiny.legacy.op17",
            "llama_tiny.dynamo.op18",
            "llama_tiny.legacy.op17",
            "moe_tiny.dynamo.op18",
            "moe_tiny.legacy.op17",
        ],
        "a model was added to tests/models: give it a test above"
    );
}

/// The tiny Llama (dynamo export) on node=2,gpu=2 with zero3: its global batch, its
/// per-rank forward, its full parameters and the compiled plan.
#[allow(clippy::type_complexity)]
fn llama_zero3_plan() -> (Vec<(String, Tensor)>, Program, Vec<(String, Tensor)>, Plan) {
    let model = own_models_dir().join("llama_tiny.dynamo.op18.onnx");
    let io = read_npz(&own_models_dir().join("llama_tiny.io.npz"));
    let batch = global_batch(&io);
    let cfg = config("lm");
    let mesh = Mesh::parse("node=2,gpu=2").unwrap();
    let fwd = import_at(&model, &batch, ROWS / 4);
    let full: Vec<(String, Tensor)> = fwd
        .params
        .iter()
        .map(|p| (fwd.value(p.value).name.clone(), p.data.clone().unwrap()))
        .collect();
    let plan = build_plan(&fwd, &mesh, "zero3", &cfg);
    (batch, fwd, full, plan)
}

/// Bitwise: the executor (async and sync) and the lockstep reference runner give the same
/// parameters and losses on a real plan.
#[test]
fn async_sync_and_reference_runner_agree_bitwise() {
    let (batch, _, full, plan) = llama_zero3_plan();
    let mut spmd =
        hzp_runtime::reference::ReferenceRunner::new(&plan.program, &plan.layouts, &full).unwrap();
    let inputs = program_inputs(&plan.program, &batch);
    let ref_losses: Vec<f64> = (0..3)
        .map(|_| spmd.step(&inputs).unwrap()[0].1.to_f64_vec()[0])
        .collect();
    let want = spmd.full_parameters();
    for comm in [
        hzp_runtime::exec::CommMode::Async,
        hzp_runtime::exec::CommMode::Sync,
    ] {
        let opts = ExecOptions {
            comm,
            ..ExecOptions::default()
        };
        let mut ex = Executor::new(&plan, &full, opts).unwrap();
        ex.set_inputs(&program_inputs(&plan.program, &batch))
            .unwrap();
        let losses: Vec<f64> = ex.run(3).unwrap().iter().map(|s| s.loss.unwrap()).collect();
        assert_eq!(losses, ref_losses, "{comm:?}");
        let got = ex.parameters();
        assert_eq!(got.len(), want.len());
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            let (g, w) = (g.to_f64_vec(), w.to_f64_vec());
            let differ = g
                .iter()
                .zip(&w)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            let worst = g
                .iter()
                .zip(&w)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert_eq!(
                differ,
                0,
                "{comm:?}: {name}: {differ} of {} elements differ, by up to {worst:e}",
                g.len()
            );
        }
    }
}

/// Token ids are range-checked by every executor where a batch enters, not only by the CLI:
/// on a zero3 plan whose embedding gradient is exchanged as rows (indices all-gathered, each
/// rank scatter-adding the rows of its shard), a negative or too-large id would otherwise be
/// in no rank's shard and its row would be dropped silently.
#[test]
fn executors_reject_out_of_range_token_ids_on_a_row_exchanged_plan() {
    let (batch, fwd, full, plan) = llama_zero3_plan();
    assert!(
        plan.program
            .nodes
            .iter()
            .any(|n| matches!(n.op, hzp_ir::Op::AllToAll { .. })),
        "the plan exchanges no embedding gradient as rows"
    );
    let ids_in = fwd.find_value("input_ids").unwrap();
    let vocab = hzp_runtime::index_check::index_bounds(&fwd)[&ids_in].bound;
    let good = program_inputs(&plan.program, &batch);
    for bad_id in [-1i64, vocab as i64] {
        let mut bad = good.clone();
        let (_, ids) = bad.iter_mut().find(|(k, _)| k == "input_ids").unwrap();
        match &mut ids.data {
            hzp_ir::Data::I64(v) => v[3] = bad_id,
            d => panic!("input_ids are {d:?}"),
        }
        let mut ex = Executor::new(&plan, &full, ExecOptions::default()).unwrap();
        let e = ex.set_inputs(&bad).unwrap_err().to_string();
        assert!(
            e.contains(&format!("`input_ids` holds {bad_id}")),
            "executor: {e}"
        );
        // the good batch is still accepted afterwards, and steps
        ex.set_inputs(&good).unwrap();
        ex.run(1).unwrap();
        let mut spmd =
            hzp_runtime::reference::ReferenceRunner::new(&plan.program, &plan.layouts, &full)
                .unwrap();
        let e = spmd.step(&bad).unwrap_err().to_string();
        assert!(
            e.contains(&format!("`input_ids` holds {bad_id}")),
            "reference runner: {e}"
        );
    }
}

/// The executor contract's checkpoint half, on every backend this machine has: the values
/// `persistent` reads back after one step, restored into a freshly opened executor of the
/// same plan (`restore`, the step counter set), give the uninterrupted run's next steps and
/// parameters bit for bit; values of the wrong type or for the wrong number of ranks are
/// refused by name.
#[test]
fn persistent_values_restore_bitwise_on_every_backend() {
    let model = own_models_dir().join("llama_tiny.dynamo.op18.onnx");
    let batch = global_batch(&read_npz(&own_models_dir().join("llama_tiny.io.npz")));
    let mesh = Mesh::parse("node=2,gpu=2").unwrap();
    let w = mesh.world_size();
    let mut ran = 0;
    for backend in hzp_runtime::backend::all() {
        if let Err(why) = backend.available() {
            skip::skip(
                "persistent_values_restore_bitwise_on_every_backend",
                backend_missing(backend.as_ref()),
                &format!("backend {} not run: {why}", backend.name()),
            );
            continue;
        }
        let name = backend.name();
        let fwd = import_at_for(
            &model,
            &batch,
            ROWS / w,
            (backend.fused_attention(), backend.routed_moe()),
        );
        let full: Vec<(String, Tensor)> = fwd
            .params
            .iter()
            .map(|p| (fwd.value(p.value).name.clone(), p.data.clone().unwrap()))
            .collect();
        let plan = build_plan(&fwd, &mesh, "zero3", &config("lm"));
        let inputs = program_inputs(&plan.program, &batch);
        let mut whole = backend.open(&plan, &full).unwrap();
        whole.set_inputs(&inputs).unwrap();
        let want: Vec<f64> = (0..3)
            .map(|_| whole.step().unwrap().loss.unwrap())
            .collect();
        let mut first = backend.open(&plan, &full).unwrap();
        first.set_inputs(&inputs).unwrap();
        assert_eq!(first.step().unwrap().loss.unwrap(), want[0], "{name}");
        let saved: Vec<Vec<(String, Tensor)>> =
            (0..w).map(|r| first.persistent(r).unwrap()).collect();
        drop(first);
        let mut again = backend.open(&plan, &full).unwrap();
        // refused: one rank short, and a value of another type
        let err = again.restore(&saved[..w - 1]).unwrap_err().to_string();
        assert!(
            err.contains(&format!("ranks given to a plan of {w}")),
            "{name}: {err}"
        );
        let mut wrong = saved.clone();
        wrong[0][0].1 = Tensor::f32(vec![1], vec![0.0]);
        let err = again.restore(&wrong).unwrap_err().to_string();
        assert!(
            err.contains(&format!("`{}` is f32[1]", wrong[0][0].0)),
            "{name}: {err}"
        );
        again.restore(&saved).unwrap();
        again.set_steps_run(1);
        again.set_inputs(&inputs).unwrap();
        let got: Vec<f64> = (0..2)
            .map(|_| {
                let s = again.step().unwrap();
                assert!(s.step >= 2, "{name}: steps are numbered on: {}", s.step);
                s.loss.unwrap()
            })
            .collect();
        assert_eq!(got, want[1..], "{name}");
        let (a, b) = (whole.parameters().unwrap(), again.parameters().unwrap());
        assert_eq!(a.len(), b.len());
        for ((n, x), (_, y)) in a.iter().zip(&b) {
            assert_eq!(x, y, "{name}: parameter {n} differs after the restore");
        }
        ran += 1;
    }
    assert!(ran >= 1, "the CPU backend is always there");
}

/// What a backend that cannot run here lacks: the GPU for the CUDA ones (a failure where
/// `HZP_REQUIRE_GPU` is set).
fn backend_missing(b: &dyn hzp_runtime::backend::Backend) -> skip::Missing {
    if b.name().starts_with("cuda") {
        skip::Missing::Gpu
    } else {
        skip::Missing::Other
    }
}

/// Evaluation through the executor contract (what `hzp run --val-data` does on every
/// backend): the evaluation plan of a tiny model's forward and loss, loaded by the CPU
/// executor and given other parameters than the model's, gives the CPU evaluator's loss
/// with those parameters; and the CUDA backend lowers the same plan (the lowering is pure
/// Rust: what runs on a GPU is `examples/device/multi_rank_check.sh`'s `data` part).
#[test]
fn eval_plan_runs_the_evaluators_forward_and_lowers_for_cuda() {
    use hzp_ir::DType;
    use hzp_runtime::cuda::lower::{lower_program_with, LowerOptions};
    use hzp_runtime::executor::eval::PlanEvaluator;
    for (stem, compute) in [
        ("gpt2_tiny.legacy.op17", DType::F32),
        ("llama_tiny.dynamo.op18", DType::BF16),
    ] {
        let model = own_models_dir().join(format!("{stem}.onnx"));
        let io_name = format!("{}.io.npz", stem.split('.').next().unwrap());
        let batch = global_batch(&read_npz(&own_models_dir().join(io_name)));
        // attention written out: what a plan compiled for CUDA with --no-fuse-attention has
        let fwd = import_at_with(&model, &batch, ROWS, false);
        let lowered = hzp_passes::train::lower_precision(&fwd, compute).unwrap();
        let prog =
            hzp_passes::train::attach_loss(&lowered, &LossKind::Lm { labels: None }).unwrap();
        let plan = hzp_passes::plan::eval::eval_plan(&prog, stem).unwrap();
        for fuse in [false, true] {
            let opts = LowerOptions {
                fuse,
                ..LowerOptions::from_env()
            };
            lower_program_with(&plan, 0, opts)
                .unwrap_or_else(|e| panic!("{stem}: lowering the evaluation plan: {e}"));
        }
        let model_params: Vec<(String, Tensor)> = prog
            .params
            .iter()
            .map(|x| (prog.value(x.value).name.clone(), x.data.clone().unwrap()))
            .collect();
        // "trained" parameters: the model's, scaled
        let trained: Vec<(String, Tensor)> = model_params
            .iter()
            .map(|(k, t)| {
                let v: Vec<f64> = t.to_f64_vec().iter().map(|x| x * 0.9).collect();
                (k.clone(), Tensor::from_f64(t.dtype(), t.shape.clone(), &v))
            })
            .collect();
        let ex = Executor::new(&plan, &model_params, ExecOptions::default()).unwrap();
        let mut pe = PlanEvaluator::new(Box::new(ex), &model_params).unwrap();
        let inputs = program_inputs(&prog, &batch);
        let before = pe.loss(&inputs).unwrap();
        pe.set_parameters(&trained).unwrap();
        let got = pe.loss(&inputs).unwrap();
        let cpu_loss = |params: &[(String, Tensor)]| {
            let mut q = prog.clone();
            for prm in q.params.iter_mut() {
                let name = &q.values[prm.value.index()].name;
                let (_, t) = params.iter().find(|(k, _)| k == name).unwrap();
                prm.data = Some(t.clone());
            }
            hzp_runtime::eval::evaluate(&q, &inputs).unwrap()[0]
                .1
                .to_f64_vec()[0]
        };
        let (want_before, want) = (cpu_loss(&model_params), cpu_loss(&trained));
        for (g, w) in [(before, want_before), (got, want)] {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs(),
                "{stem}: the evaluation plan's loss {g}, the CPU evaluator's {w}"
            );
        }
        assert!(
            (want - want_before).abs() > 1e-4,
            "{stem}: the parameters change the loss"
        );
    }
}
