//! Times the batched MatMul kernel against one plain gemm call per batch entry (what it
//! did before it left out trailing zero rows and contraction terms): on dense operands
//! (nothing to leave out: what the scans cost) and on mixture-of-experts buffers whose
//! entries are a quarter filled (top 2 of 8 experts, dropless): the forward `buffer @ W`,
//! the input gradient `dY @ Wᵀ` and the weight gradient `bufferᵀ @ dY`. The minimum over
//! repetitions, which is robust to other load on the machine. A benchmark, not a test; one
//! thread, so that both sides run the same gemm calls one after another.
//!
//!     HZP_NUM_THREADS=1 cargo run --release -p hzp-runtime --example matmul_trim

use hzp_runtime::cpu::matmul::{gemm_f32, matmul_views_into, MatView};
use std::time::Instant;

fn data(n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i + salt) * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// `[e, m, k] @ [e, k, n]`, `a` given as `[e, m, k]` or (`a_t`) stored `[e, k, m]`.
fn case(name: &str, (e, m, k, n): (usize, usize, usize, usize), a: &[f32], a_t: bool, b: &[f32]) {
    let mut out = vec![0f32; e * m * n];
    let av = if a_t {
        MatView::contiguous(a, &[e, k, m]).swap_last2()
    } else {
        MatView::contiguous(a, &[e, m, k])
    };
    let bv = MatView::contiguous(b, &[e, k, n]);
    // the plain product: `a` materialized row-major, one gemm call per entry
    let a_rm: Vec<f32> = if a_t {
        let mut v = vec![0f32; e * m * k];
        for x in 0..e {
            for i in 0..m {
                for p in 0..k {
                    v[(x * m + i) * k + p] = a[(x * k + p) * m + i];
                }
            }
        }
        v
    } else {
        a.to_vec()
    };
    let reps = 15;
    let kernel = best_of(reps, || matmul_views_into(&av, &bv, &mut out).unwrap());
    let mut plain_out = vec![0f32; e * m * n];
    let plain = best_of(reps, || {
        for x in 0..e {
            gemm_f32(
                m,
                n,
                k,
                &a_rm[x * m * k..],
                &b[x * k * n..],
                &mut plain_out[x * m * n..],
            );
        }
    });
    let same = out
        .iter()
        .zip(&plain_out)
        .all(|(p, q)| p.to_bits() == q.to_bits());
    println!(
        "{name:<34} [{e},{m},{k}]@[{e},{k},{n}]  kernel {:8.3} ms  plain gemm {:8.3} ms  ratio {:.3}{}",
        kernel * 1e3,
        plain * 1e3,
        kernel / plain,
        if same { "" } else { "  (results differ)" }
    );
}

/// `[e, rows, cols]` with each entry's rows past `filled` zero.
fn buffer(e: usize, rows: usize, cols: usize, filled: usize, salt: usize) -> Vec<f32> {
    let mut v = data(e * rows * cols, salt);
    for x in 0..e {
        v[(x * rows + filled) * cols..(x + 1) * rows * cols].fill(0.0);
    }
    v
}

fn main() {
    println!("threads: {}", hzp_runtime::cpu::threads::num_threads());
    // dense operands: nothing to leave out
    for (name, s) in [
        ("dense experts [E,T,H]@[E,H,2F]", (8, 512, 256, 1024)),
        ("dense experts [E,T,F]@[E,F,H]", (8, 512, 512, 256)),
        ("attention-like [BH,S,S]@[BH,S,D]", (16, 256, 256, 64)),
        ("attention-like [BH,S,D]@[BH,D,S]", (16, 256, 64, 256)),
    ] {
        let (e, m, k, n) = s;
        case(name, s, &data(e * m * k, 1), false, &data(e * k * n, 2));
    }
    // dropless buffers of 512 tokens, top 2 of 8 experts: 128 filled rows of 512
    let (e, t, h, f2, f) = (8, 512, 256, 1024, 512);
    let filled = t * 2 / e;
    let buf = buffer(e, t, h, filled, 3);
    case(
        "moe forward buffer @ W",
        (e, t, h, f2),
        &buf,
        false,
        &data(e * h * f2, 4),
    );
    let dy = buffer(e, t, f2, filled, 5);
    case(
        "moe input grad dY @ Wt",
        (e, t, f2, h),
        &dy,
        false,
        &data(e * f2 * h, 6),
    );
    // weight gradient bufferᵀ @ dY: the contraction over the buffer's rows
    let dy2 = buffer(e, t, f, filled, 7);
    case("moe weight grad buf^T @ dY", (e, h, t, f), &buf, true, &dy2);
}
