//! Transposed operands (`hzp_ir::views::transposed_operands`): a plan may keep a transpose
//! that only matrix products read in its input's very bytes, and the executor then reads the
//! operand through strides instead of running the transpose. Checked against the evaluator
//! and against the same program with every value in bytes of its own; a transpose read by
//! anything else may not share its input's bytes.

mod common;
use common::plan_of;
use hzp_ir::plan::Plan;
use hzp_ir::{DType, Tensor};
use hzp_runtime::exec::{ExecOptions, Executor};

const SRC: &str = r#"program "tv"
mesh gpu=1

input %x : f32[24,32]
input %w : f32[40,32]
%wt = Transpose{perm=[1,0]}(%w) : f32[32,40] "wt"
%y = MatMul(%x, %wt) : f32[24,40] "y"
%xt = Transpose{perm=[1,0]}(%x) : f32[32,24] "xt"
%z = MatMul(%xt, %y) : f32[32,40] "z"
%zt = Transpose{perm=[1,0]}(%z) : f32[40,32] "zt"
%s = Add(%zt, %w) : f32[40,32] "s"
output %s
"#;

fn inputs_of(dtype: DType) -> Vec<(String, Tensor)> {
    let ramp =
        |n: usize, k: f64| -> Vec<f64> { (0..n).map(|i| ((i as f64 * k) % 5.0) - 2.5).collect() };
    vec![
        (
            "x".into(),
            Tensor::from_f64(dtype, vec![24, 32], &ramp(24 * 32, 0.37)),
        ),
        (
            "w".into(),
            Tensor::from_f64(dtype, vec![40, 32], &ramp(40 * 32, 0.61)),
        ),
    ]
}

fn inputs() -> Vec<(String, Tensor)> {
    inputs_of(DType::F32)
}

/// `plan` with the buffer of each value named in `shared` moved onto its input's bytes.
fn sharing(mut plan: Plan, shared: &[(&str, &str)]) -> Plan {
    for (y, x) in shared {
        let (y, x) = (
            plan.program.find_value(y).unwrap(),
            plan.program.find_value(x).unwrap(),
        );
        let at = plan.buffers.iter().find(|b| b.value == x).unwrap().offset;
        plan.buffers
            .iter_mut()
            .find(|b| b.value == y)
            .unwrap()
            .offset = at;
    }
    plan
}

fn run(plan: &Plan) -> Result<Vec<f64>, String> {
    run_with(plan, &inputs())
}

fn run_with(plan: &Plan, inputs: &[(String, Tensor)]) -> Result<Vec<f64>, String> {
    let mut ex = Executor::new(plan, &[], ExecOptions::default()).map_err(|e| e.to_string())?;
    ex.set_inputs(inputs).map_err(|e| e.to_string())?;
    ex.run(1).map_err(|e| e.to_string())?;
    Ok(ex.outputs(0).remove(0).1.to_f64_vec())
}

#[test]
fn transposed_operands_are_read_in_place() {
    let p = hzp_ir::text::parse(SRC, "tv", &|_| None).unwrap();
    let t = hzp_ir::views::transposed_operands(&p);
    let names: Vec<&str> = p
        .nodes
        .iter()
        .zip(&t)
        .filter(|(_, &t)| t)
        .map(|(n, _)| n.name.as_str())
        .collect();
    assert_eq!(names, ["wt", "xt"]);

    let want = hzp_runtime::eval::evaluate(&p, &inputs()).unwrap()[0]
        .1
        .to_f64_vec();
    let separate = run(&plan_of(p.clone())).unwrap();
    let shared = run(&sharing(plan_of(p.clone()), &[("wt", "w"), ("xt", "x")])).unwrap();
    for got in [&separate, &shared] {
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }
    }
    // `zt` is read by an Add: it must be computed, never left in its input's bytes
    let err = run(&sharing(plan_of(p), &[("zt", "z")])).unwrap_err();
    assert!(
        err.contains("writes its result over one of its inputs"),
        "{err}"
    );
}

/// bf16 and f16 products read their transposed operands in place too (the CUDA backend
/// through cuBLAS's transpose flags, the CPU executor through strides after widening):
/// the same results as the program with every value in its own bytes, within a unit in the
/// last place of the 16-bit result.
#[test]
fn half_precision_transposed_operands_are_read_in_place() {
    for (dtype, name) in [(DType::BF16, "bf16"), (DType::F16, "f16")] {
        let src = SRC.replace("f32", name);
        let p = hzp_ir::text::parse(&src, "tv", &|_| None).unwrap();
        let t = hzp_ir::views::transposed_operands(&p);
        let views = p.nodes.iter().zip(&t).filter(|(_, &t)| t).count();
        assert_eq!(views, 2, "{name}");
        let inputs = inputs_of(dtype);
        let want = hzp_runtime::eval::evaluate(&p, &inputs).unwrap()[0]
            .1
            .to_f64_vec();
        let separate = run_with(&plan_of(p.clone()), &inputs).unwrap();
        let shared = run_with(&sharing(plan_of(p), &[("wt", "w"), ("xt", "x")]), &inputs).unwrap();
        let ulp = if dtype == DType::BF16 {
            1.0 / 128.0
        } else {
            1.0 / 1024.0
        };
        for got in [&separate, &shared] {
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= ulp * b.abs().max(1.0),
                    "{name}: {a} vs {b}"
                );
            }
        }
    }
}
