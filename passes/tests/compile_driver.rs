//! The library compile driver (`compile_plan`): what `hzp compile` does, without the CLI.

use hzp_ir::plan::BufferKind;
use hzp_ir::{Mesh, RoleKind};
use hzp_passes::compile::{compile_plan, CompileError, CompileEvent, CompileOptions};
use hzp_passes::cost::cluster::ClusterSpec;
use hzp_passes::plan::planner::Strategy;
use hzp_passes::plan::verify::{verify_plan_with, VerifyOptions};
use hzp_passes::train::{LossKind, TrainConfig};
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn mlp() -> hzp_ir::Program {
    hzp_frontends::hzp_file::load(&root().join("examples/models/mlp.hzp")).unwrap()
}

fn options(mesh: &str, strategy: Strategy) -> CompileOptions {
    let cluster = ClusterSpec::load(root().join("examples/clusters/h100-dgx.toml")).unwrap();
    CompileOptions {
        strategy,
        train: TrainConfig {
            loss: LossKind::Mse { target: "y".into() },
            ..TrainConfig::default()
        },
        ..CompileOptions::new("mlp.hzp", Mesh::parse(mesh).unwrap(), cluster)
    }
}

#[test]
fn compiles_a_verified_deterministic_plan_and_reports_its_events() {
    let fwd = mlp();
    for (mesh, strategy) in [
        ("gpu=2", Strategy::Zero3),
        ("node=2,gpu=2", Strategy::AsyncHzp),
    ] {
        let opts = CompileOptions {
            stage_events: true,
            ..options(mesh, strategy)
        };
        let mut events: Vec<String> = Vec::new();
        let a = compile_plan(&fwd, &opts, &mut |ev| {
            events.push(match ev {
                CompileEvent::Note(m) => format!("note {m}"),
                CompileEvent::Planned(_) => "planned".into(),
                CompileEvent::Stage(s, _) => format!("stage {s}"),
                CompileEvent::Rewritten(_) => "rewritten".into(),
                CompileEvent::Assembled(_) => "assembled".into(),
                CompileEvent::Phase(p) => format!("phase {p}"),
            });
            Ok(())
        })
        .unwrap();
        let count = |e: &str| events.iter().filter(|x| *x == e).count();
        assert_eq!(count("planned"), 1, "{events:?}");
        assert_eq!(count("assembled"), 1, "{events:?}");
        assert_eq!(count("rewritten"), 1, "{events:?}");
        for s in ["collectives", "rewrite", "schedule"] {
            assert_eq!(count(&format!("stage {s}")), 1, "{s}: {events:?}");
        }
        let plan = &a.plan;
        assert_eq!(plan.strategy, strategy.name());
        assert_eq!(
            plan.mesh.world_size(),
            Mesh::parse(mesh).unwrap().world_size()
        );
        verify_plan_with(
            plan,
            &VerifyOptions {
                budget: None,
                communicator_per_stream: true,
            },
        )
        .unwrap();
        // roles are set on the collectives' nodes and decide the buffer kinds
        let gathers = plan
            .program
            .nodes
            .iter()
            .filter(|n| n.role.kind == RoleKind::Gather)
            .count();
        assert!(gathers > 0);
        assert!(a.peak_by_kind.contains_key(&BufferKind::Param));
        // same input, same plan
        let b = compile_plan(&fwd, &opts, &mut |_| Ok(())).unwrap();
        assert_eq!(a.plan.content_hash, b.plan.content_hash);
        assert!(!a.plan.content_hash.is_empty());
    }
}

#[test]
fn a_budget_nothing_fits_gives_the_smallest_candidate() {
    let opts = CompileOptions {
        budget: Some(64),
        ..options("gpu=2", Strategy::AsyncHzp)
    };
    match compile_plan(&mlp(), &opts, &mut |_| Ok(())) {
        Err(CompileError::NoFit {
            need,
            budget,
            message,
            ..
        }) => {
            assert_eq!(budget, 64);
            assert!(need > budget, "{need}");
            assert!(!message.is_empty());
        }
        Err(e) => panic!("expected NoFit, got {e}"),
        Ok(_) => panic!("a 64-byte budget fitted"),
    }
}

#[test]
fn an_event_handler_error_stops_the_compile() {
    let opts = options("gpu=2", Strategy::Zero3);
    let e = compile_plan(&mlp(), &opts, &mut |ev| match ev {
        CompileEvent::Stage("schedule", _) => Err("cannot write to stdout".into()),
        _ => Ok(()),
    });
    match e {
        Err(CompileError::Other(m)) => assert_eq!(m, "cannot write to stdout"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("the compile went on after the handler failed"),
    }
}
