//! Every test model (the project's own and ../shared/onnx when present): imports, verifies,
//! prints, parses back to the same program, and evaluates to PyTorch's output within 1e-4.

mod common;
use common::*;
use hzp_ir::{text, verify};

#[test]
fn every_model_imports_round_trips_and_matches_pytorch() {
    let models = all_models();
    assert!(
        models.len() >= 8,
        "expected the 8 own models, found {}",
        models.len()
    );
    for (model, io_path) in models {
        let io = read_npz(&io_path);
        let p = import(&model, &io);
        verify(&p).unwrap_or_else(|e| panic!("{}: {e}", model.display()));

        // Text round trip: parse(print(p)) == p, with data from the program itself.
        let printed = text::print(&p);
        let lookup = |name: &str| {
            p.params
                .iter()
                .find(|x| p.value(x.value).name == name)
                .and_then(|x| x.data.clone())
                .or_else(|| {
                    p.consts
                        .iter()
                        .find(|c| p.value(c.value).name == name)
                        .map(|c| c.data.clone())
                })
        };
        let back = text::parse(&printed, "roundtrip.hzp", &lookup)
            .unwrap_or_else(|e| panic!("{}: reparse failed: {e}", model.display()));
        assert!(back == p, "{}: parse(print(p)) != p", model.display());
        assert_eq!(
            text::print(&back),
            printed,
            "{}: printing is not stable",
            model.display()
        );

        // Forward pass vs PyTorch.
        let inputs = program_inputs(&p, &io);
        let outs = hzp_runtime::eval::evaluate(&p, &inputs)
            .unwrap_or_else(|e| panic!("{}: eval failed: {e}", model.display()));
        let torch = &io.iter().find(|(k, _)| k == "torch_out").unwrap().1;
        assert_eq!(outs.len(), 1);
        let d = max_abs_diff(&outs[0].1, torch);
        eprintln!("{}: max |hzp - torch| = {d:.3e}", model.display());
        assert!(d < 1e-4, "{}: max abs diff {d} >= 1e-4", model.display());
    }
}
