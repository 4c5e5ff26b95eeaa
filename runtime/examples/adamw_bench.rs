//! Times the fused AdamW kernel in place over a 2.66M-element shard (the per-rank optimizer
//! step of the GPT-2 side-by-side benchmark). A benchmark, not a test.
//!
//!     HZP_NUM_THREADS=1 cargo run --release -p hzp-runtime --example adamw_bench

use hzp_runtime::cpu::optim::{adamw_raw, AdamWStep};
use std::time::Instant;

fn main() {
    let n = 2_662_400;
    let mut w: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let g: Vec<f32> = (0..n)
        .map(|i| ((i * 104729) % 1000) as f32 / 5e5 - 1e-3)
        .collect();
    let mut m = vec![0.01f32; n];
    let mut v = vec![1e-4f32; n];
    let c = AdamWStep::new((0.9, 0.999, 1e-8, 0.01), 1e-3, 0.03, 1e-3);
    let mut best = f64::MAX;
    for _ in 0..20 {
        let t = Instant::now();
        // SAFETY: every pointer covers n elements; results are written over their inputs.
        unsafe {
            adamw_raw(
                n,
                &c,
                w.as_ptr(),
                g.as_ptr(),
                m.as_ptr(),
                v.as_ptr(),
                w.as_mut_ptr(),
                m.as_mut_ptr(),
                v.as_mut_ptr(),
            )
        };
        best = best.min(t.elapsed().as_secs_f64());
    }
    let gbs = (n * 28) as f64 / best / 1e9;
    println!(
        "adamw in place, {n} elements: {:.3} ms ({gbs:.1} GB/s of 28 B/element)",
        best * 1e3
    );
}
