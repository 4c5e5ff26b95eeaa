//! Times `MatMul` with each operand read as stored or through a transposed (strided) view,
//! at the shapes of the per-rank GPT-2 side-by-side step. A benchmark, not a test.
//!
//!     HZP_NUM_THREADS=1 cargo run --release -p hzp-runtime --example matmul_layouts

use hzp_runtime::cpu::matmul::{matmul_views_into, MatView};
use std::time::Instant;

fn data(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

fn main() {
    let shapes = [
        (252, 256, 8192),
        (8192, 252, 256),
        (256, 256, 768),
        (256, 256, 1024),
        (256, 1024, 256),
        (1024, 256, 256),
        (256, 768, 256),
    ];
    for (m, k, n) in shapes {
        let a = data(m * k);
        let b = data(k * n);
        let mut out = vec![0f32; m * n];
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let av = if ta {
                MatView::contiguous(&a, &[k, m]).permuted(&[1, 0])
            } else {
                MatView::contiguous(&a, &[m, k])
            };
            let bv = if tb {
                MatView::contiguous(&b, &[n, k]).permuted(&[1, 0])
            } else {
                MatView::contiguous(&b, &[k, n])
            };
            let mut best = f64::MAX;
            for _ in 0..10 {
                let t = Instant::now();
                matmul_views_into(&av, &bv, &mut out).unwrap();
                best = best.min(t.elapsed().as_secs_f64());
            }
            let gf = 2.0 * (m * k * n) as f64 / best / 1e9;
            println!(
                "[{m},{k}]{}x[{k},{n}]{}  {:8.3} ms  {gf:6.1} GFLOP/s",
                if ta { "T" } else { " " },
                if tb { "T" } else { " " },
                best * 1e3
            );
        }
    }
}
