//! A plan file and the model it names: [`read_plan`] (read and verified, for `run`,
//! `inspect` and `simulate`), the model's forward at the plan's shapes ([`load_forward`]),
//! the evaluation program ([`eval_program`]) and the ties a `--retie` plan trains as one
//! ([`plan_ties`]). Shared by `compile`, `run`, `simulate` and the step loop, none of which
//! imports another for them.

use crate::run_args::RunArgs;
use hzp_frontends::{load_model, LoadOptions};
use hzp_ir::plan::Plan;
use hzp_ir::Program;
use miette::{miette, Result};
use std::path::Path;

/// Reads and checks a plan file.
/// Reads and verifies a plan: `run`, `inspect` and `simulate` accept only a plan the
/// verifier accepts (a hand-edited plan with a recomputed hash included).
pub fn read_plan(path: &Path) -> Result<Plan> {
    let text = hzp_frontends::limits::read_regular_string(path)
        .map_err(|e| miette!("cannot read {}: {e}", path.display()))?;
    let plan = Plan::from_json(&text, &path.display().to_string()).map_err(|e| miette!("{e}"))?;
    let vopts = hzp_passes::plan::verify::VerifyOptions {
        budget: None,
        communicator_per_stream: true,
    };
    if let Err(v) = hzp_passes::plan::verify::verify_plan_with(&plan, &vopts) {
        let list: Vec<String> = v.iter().map(|x| format!("  - {x}")).collect();
        return Err(miette!(
            "{} does not verify, so hzp will not use it (was it edited by hand?):\n{}",
            path.display(),
            list.join("\n")
        ));
    }
    Ok(plan)
}

/// The model's forward program at the plan's per-rank micro-batch shapes, edited as the
/// plan records (see [`apply_plan_edits`]).
pub(crate) fn load_forward(model: &str, plan: &Plan) -> Result<Program> {
    let mut fwd = load_imported(model, plan)?;
    apply_plan_edits(&mut fwd, plan)?;
    Ok(fwd)
}

/// What `hzp compile` did to the model after import (`--freeze`, `--untie`; recorded in the
/// plan), done again on `fwd`, so that its parameters are the plan's. (`--retie` is undone
/// where it matters: see [`plan_ties`].)
pub(crate) fn apply_plan_edits(fwd: &mut Program, plan: &Plan) -> Result<()> {
    let Some(edits) = &plan.model_edits else {
        return Ok(());
    };
    hzp_passes::train::ties::freeze(fwd, &edits.freeze).map_err(|e| miette!("{e}"))?;
    for name in &edits.untie {
        hzp_passes::train::ties::untie(fwd, name).map_err(|e| {
            miette!(
                "the plan was compiled with --untie {name}, which this model does not allow: {e}"
            )
        })?;
    }
    Ok(())
}

/// The model as imported at the plan's per-rank micro-batch shapes, with the name map the
/// plan was compiled with; no edit applied (what the plan's fingerprint is of).
pub(crate) fn load_imported(model: &str, plan: &Plan) -> Result<Program> {
    let m = plan.micro_batches.max(1);
    let p = &plan.program;
    let shapes = p
        .inputs
        .iter()
        .map(|&v| {
            let val = p.value(v);
            let mut s = val.ty.shape.clone();
            if let Some(d) = s.first_mut() {
                *d /= m;
            }
            (val.name.clone(), s)
        })
        .collect();
    // the model's attention in the form the plan has it (fused unless compiled with
    // --no-fuse-attention)
    let fused = p
        .nodes
        .iter()
        .any(|n| matches!(n.op, hzp_ir::Op::Attention { .. }));
    // and its mixture of experts (routed unless compiled with --no-fuse-moe)
    let routed = p
        .nodes
        .iter()
        .any(|n| matches!(n.op, hzp_ir::Op::MoeDispatch { .. }));
    let opts = LoadOptions {
        shapes,
        no_fuse_attention: !fused,
        no_fuse_moe: !routed,
        names: plan
            .model_edits
            .as_ref()
            .and_then(|e| e.names.as_ref())
            .map(std::path::PathBuf::from),
        ..Default::default()
    };
    load_model(model, &opts).map_err(miette::Report::new)
}

/// The model's forward and loss at the plan's per-rank micro-batch shapes, in the plan's
/// compute precision: what evaluation runs with the current parameters. Weights an exporter
/// stored twice and the plan trains as one (`--retie`) are tied again here.
pub(crate) fn eval_program(args: &RunArgs, plan: &Plan) -> Result<Program> {
    let model = args.model.clone().unwrap_or_else(|| plan.model.clone());
    if model.starts_with("preset:") {
        return Err(miette!(
            "--val-data: the plan was compiled from {model}, which has no forward weights to evaluate with; pass --model FILE"
        ));
    }
    let mut fwd = load_forward(&model, plan)?;
    let ties = plan_ties(&fwd, plan);
    hzp_passes::train::ties::retie(&mut fwd, &ties).map_err(|e| miette!("{e}"))?;
    let compute = plan
        .program
        .precision
        .as_ref()
        .map_or(hzp_ir::DType::F32, |pr| pr.compute);
    let spec = plan.loss.as_deref().ok_or_else(|| {
        miette!("the plan does not record its loss (compiled by an older hzp?): recompile it to evaluate")
    })?;
    let loss = crate::commands::loss_from_spec(spec)?;
    let lowered = hzp_passes::train::lower_precision(&fwd, compute).map_err(|e| miette!("{e}"))?;
    hzp_passes::train::attach_loss(&lowered, &loss).map_err(|e| miette!("{e}"))
}

/// The weights of `fwd` an exporter stored twice that the plan trains as one (it was
/// compiled with `--retie`): the canonical one is a parameter of the plan, the copy is not.
pub(crate) fn plan_ties(fwd: &Program, plan: &Plan) -> Vec<hzp_passes::train::ties::Tie> {
    let trained = |n: &str| plan.layouts.iter().any(|l| l.name == n);
    hzp_passes::train::ties::find_ties(fwd)
        .into_iter()
        .filter(|t| trained(&t.canonical) && !trained(&t.copy))
        .collect()
}
