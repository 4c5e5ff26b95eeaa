//! Mixture-of-experts plans as a user compiles them: expert parallelism on a Mixtral-sized
//! preset (what each rank holds, the AllToAll collectives and their stream), the choice of
//! `--expert-parallel auto`, and clear refusals.

mod common;
use common::*;

/// `hzp inspect --format json` of a plan compiled with `args`.
fn inspect_json(dir: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let plan = dir.join("plan.json");
    let mut a = vec!["compile"];
    a.extend_from_slice(args);
    a.extend_from_slice(&["-o", s(&plan)]);
    ok(&a);
    serde_json::from_str(&ok(&["inspect", s(&plan), "--format", "json"])).unwrap()
}

#[test]
fn mixtral_with_experts_over_gpu_holds_an_eighth_of_the_experts_per_rank() {
    let d = tempdir("moe-mixtral");
    let model = "preset:mixtral-8x7b,capacity_factor=1.25";
    let with = inspect_json(
        &d,
        &[model, "--mesh", "node=16,gpu=8", "--expert-parallel", "gpu"],
    );
    let x = &with["experts"];
    assert_eq!(x["split_over"], "[gpu]");
    assert_eq!(x["ranks"], 8);
    let (per_rank, total) = (
        x["weights_per_rank_before_zero"].as_u64().unwrap(),
        x["weights_total"].as_u64().unwrap(),
    );
    // 32 layers of 8 experts, each 3 matrices of 4096 x 14336
    assert_eq!(total, 32 * 8 * 3 * 4096 * 14336);
    assert_eq!(per_rank * 8, total);
    // the tokens' exchanges: over the expert-parallel group, on a comm stream; 32 layers,
    // two exchanges each way in the forward and the backward (with the capacity factor
    // the plan fits without recompute: a rank holds its experts' bf16 shards as they are,
    // no copy of them kept through the step)
    let a2a: Vec<&serde_json::Value> = with["collectives"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["op"] == "AllToAll")
        .collect();
    assert_eq!(a2a.len(), 1, "{a2a:?}");
    assert_eq!(a2a[0]["group"], "[gpu]");
    assert_eq!(a2a[0]["stream"], "reducescatter");
    assert_eq!(a2a[0]["count"], 32 * 4);
    // without expert parallelism: no exchange, and every rank gathers every expert
    let without = inspect_json(&d, &[model, "--mesh", "node=16,gpu=8"]);
    assert!(without.get("experts").is_none());
    assert!(!without["collectives"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["op"] == "AllToAll"));
    let gathered = |v: &serde_json::Value| v["peak_by_kind"]["comm_buffer"].as_u64().unwrap();
    assert!(
        gathered(&with) < gathered(&without),
        "gathered parameters at the peak: {} with experts over gpu, {} without",
        gathered(&with),
        gathered(&without)
    );
}

#[test]
fn expert_parallel_auto_weighs_each_choice_and_says_so() {
    let d = tempdir("moe-auto");
    let plan = d.join("plan.json");
    let (code, _, err) = hzp(&[
        "compile",
        "preset:moe-tiny",
        "--mesh",
        "node=2,gpu=2",
        "--expert-parallel",
        "auto",
        "-o",
        s(&plan),
    ]);
    assert_eq!(code, 0, "{err}");
    // moe-tiny has 4 experts: gpu (2), node (2) and node,gpu (4) divide them
    for choice in [
        "no expert parallelism",
        "experts over [gpu]",
        "experts over [node]",
        "experts over [node,gpu]",
    ] {
        assert!(err.contains(choice), "{choice}: {err}");
    }
    assert!(err.contains("--expert-parallel auto chose"), "{err}");
    let chosen = err
        .lines()
        .find(|l| l.contains("--expert-parallel auto chose"))
        .unwrap();
    let text = ok(&["inspect", s(&plan)]);
    if chosen.contains("no expert parallelism") {
        assert!(!text.contains("experts: split over"), "{text}");
    } else {
        assert!(text.contains("experts: split over"), "{text}");
    }
}

#[test]
fn expert_parallelism_is_refused_clearly() {
    let d = tempdir("moe-refused");
    let plan = d.join("plan.json");
    let o = s(&plan);
    fails_with(
        &[
            "compile",
            "preset:moe-tiny",
            "--mesh",
            "gpu=4",
            "--expert-parallel",
            "node",
            "-o",
            o,
        ],
        &[
            "--expert-parallel node",
            "`node` is not an axis of the mesh gpu=4",
        ],
    );
    fails_with(
        &[
            "compile",
            "preset:llama-tiny",
            "--mesh",
            "gpu=2",
            "--expert-parallel",
            "gpu",
            "-o",
            o,
        ],
        &["--expert-parallel", "no routed MoE layer"],
    );
    fails_with(
        &[
            "compile",
            "preset:moe-tiny",
            "--mesh",
            "gpu=8",
            "--expert-parallel",
            "gpu",
            "-o",
            o,
        ],
        &["4 experts", "do not divide"],
    );
    fails_with(
        &[
            "compile",
            "preset:moe-tiny",
            "--mesh",
            "gpu=2",
            "--expert-parallel",
            "gpu",
            "--strategy",
            "acco",
            "-o",
            o,
        ],
        &["--expert-parallel [gpu] with --strategy acco is not built"],
    );
    assert!(!plan.exists(), "a refused compile writes no plan");
}
