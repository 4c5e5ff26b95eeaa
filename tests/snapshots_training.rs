//! Snapshots of the training programs of a tiny model (examples/models/mlp.hzp): after the
//! loss, after autodiff, and the whole step (2 micro-batches, clipping, AdamW).
//! Re-bless with `INSTA_UPDATE=always cargo test --test snapshots_training` after review.

mod common;
use common::repo;
use hzp_passes::train::{self, LossKind, Optimizer, TrainConfig};

fn mlp() -> hzp_ir::Program {
    hzp_frontends::hzp_file::load(&repo().join("examples/models/mlp.hzp")).unwrap()
}

fn mse() -> LossKind {
    LossKind::Mse { target: "y".into() }
}

#[test]
fn after_loss() {
    let p = train::attach_loss(&mlp(), &mse()).unwrap();
    insta::assert_snapshot!(hzp_ir::text::print(&p));
}

#[test]
fn after_autodiff() {
    let p = train::gradient_program(&mlp(), &mse()).unwrap();
    insta::assert_snapshot!(hzp_ir::text::print(&p));
}

#[test]
fn whole_step() {
    let cfg = TrainConfig {
        loss: mse(),
        optimizer: Some(Optimizer::adamw_default()),
        clip_grad_norm: Some(1.0),
        micro_batches: 2,
        compute: hzp_ir::DType::F32,
    };
    // the model takes 2 rows; the step takes 4 (two micro-batches)
    let mut fwd = mlp();
    let x = fwd.inputs[0];
    fwd.values[x.index()].ty.shape = vec![2, 8];
    let fwd = reshape_batch(fwd);
    let p = train::training_step(&fwd, &cfg).unwrap();
    let a = hzp_ir::text::print(&p);
    assert_eq!(
        a,
        hzp_ir::text::print(&train::training_step(&fwd, &cfg).unwrap()),
        "not deterministic"
    );
    insta::assert_snapshot!(a);
}

/// Re-infers the node types after an input's batch changed (the MLP has no reshapes).
fn reshape_batch(p: hzp_ir::Program) -> hzp_ir::Program {
    let mut q = hzp_ir::Program::new(p.name.clone());
    let mut map = std::collections::HashMap::new();
    for &i in &p.inputs {
        map.insert(i, q.add_input(p.value(i).name.clone(), p.ty(i).clone()));
    }
    for prm in &p.params {
        map.insert(
            prm.value,
            q.add_param(
                p.value(prm.value).name.clone(),
                p.ty(prm.value).clone(),
                prm.data.clone(),
            ),
        );
    }
    for n in &p.nodes {
        let ins = n.inputs.iter().map(|v| map[v]).collect();
        let outs = n.outputs.iter().map(|&o| p.value(o).name.clone()).collect();
        let new = q.add_node(n.name.clone(), n.op.clone(), ins, outs).unwrap();
        for (o, v) in n.outputs.iter().zip(new) {
            map.insert(*o, v);
        }
    }
    q.outputs = p.outputs.iter().map(|o| map[o]).collect();
    q
}
