//! Times single CPU kernels at the shapes of the GPT-2 training benchmark
//! (examples/bench/train_vs_torch.py): the minimum over repetitions, which is robust to
//! other load on the machine. A benchmark, not a test.
//!
//!     HZP_NUM_THREADS=1 cargo run --release -p hzp-runtime --example kernel_bench [FILTER]

use hzp_ir::{BinaryOp, Op, ReduceOp, Tensor, UnaryOp};
use hzp_runtime::cpu::eval_op;
use std::time::Instant;

fn data(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    Tensor::f32(shape.to_vec(), v)
}

/// `n` labels in `0..classes`.
fn labels(n: usize, classes: usize) -> Tensor {
    Tensor::i64(
        vec![n],
        (0..n).map(|i| ((i * 7919) % classes) as i64).collect(),
    )
}

fn main() {
    // as the hzp binary does: large tensors from the heap, not fresh mmaps
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only tunes allocator thresholds.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
    let filter = std::env::args().nth(1).unwrap_or_default();
    let att = [4, 8, 256, 256];
    let cases: Vec<(&str, Op, Vec<Tensor>)> = vec![
        (
            "softmax [4,8,256,256]",
            Op::Softmax { axis: 3 },
            vec![data(&att)],
        ),
        (
            "logsoftmax [4,255,8192]",
            Op::LogSoftmax { axis: 2 },
            vec![data(&[4, 255, 8192])],
        ),
        (
            "softmax-xent [252,8192]",
            Op::SoftmaxCrossEntropy { axis: 1 },
            vec![data(&[252, 8192]), labels(252, 8192)],
        ),
        (
            "softmax-xent grad [252,8192]",
            Op::SoftmaxCrossEntropyGrad { axis: 1 },
            vec![data(&[252, 8192]), labels(252, 8192), data(&[252])],
        ),
        (
            "reduce sum rows [4,8,256,256]",
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![3],
                keep_dims: true,
            },
            vec![data(&att)],
        ),
        (
            "reduce sum cols [1024,2048]",
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![0],
                keep_dims: false,
            },
            vec![data(&[1024, 2048])],
        ),
        (
            "mul [4,256,2048]",
            Op::Binary(BinaryOp::Mul),
            vec![data(&[4, 256, 2048]), data(&[4, 256, 2048])],
        ),
        (
            "add bcast [4,8,256,256]+[4,1,256,256]",
            Op::Binary(BinaryOp::Add),
            vec![data(&att), data(&[4, 1, 256, 256])],
        ),
        (
            "tanh [4,256,2048]",
            Op::Unary(UnaryOp::Tanh),
            vec![data(&[4, 256, 2048])],
        ),
        (
            "gelu-tanh [4,256,1024]",
            Op::Unary(UnaryOp::GeluTanh),
            vec![data(&[4, 256, 1024])],
        ),
        (
            "gelu-tanh grad [4,256,1024]",
            Op::GeluTanhGrad,
            vec![data(&[4, 256, 1024]), data(&[4, 256, 1024])],
        ),
        (
            "transpose [512,8192]",
            Op::Transpose { perm: vec![1, 0] },
            vec![data(&[512, 8192])],
        ),
        (
            "transpose heads [4,256,8,64]",
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            vec![data(&[4, 256, 8, 64])],
        ),
        (
            "matmul [1024,512]x[512,2048]",
            Op::MatMul,
            vec![data(&[1024, 512]), data(&[512, 2048])],
        ),
        (
            "layernorm [4,256,512]",
            Op::LayerNorm {
                axis: 2,
                epsilon: 1e-5,
            },
            vec![data(&[4, 256, 512]), data(&[512]), data(&[512])],
        ),
        (
            "layernorm grad [4,256,512]",
            Op::LayerNormGrad {
                axis: 2,
                epsilon: 1e-5,
            },
            vec![data(&[4, 256, 512]), data(&[512]), data(&[4, 256, 512])],
        ),
    ];
    for (name, op, ins) in cases {
        if !name.contains(&filter) {
            continue;
        }
        let refs: Vec<&Tensor> = ins.iter().collect();
        let mut best = f64::MAX;
        for _ in 0..15 {
            let t = Instant::now();
            let r = eval_op(&op, &refs).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
            drop(r);
        }
        let n: usize = ins[0].numel();
        println!(
            "{name:<40} {:>9.3} ms  {:>6.2} ns/elem",
            best * 1e3,
            best * 1e9 / n as f64
        );
    }
}
