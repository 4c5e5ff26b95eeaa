//! How many threads the CPU kernels use: `HZP_NUM_THREADS` if set (1 = single-threaded),
//! else the number of cores. Parallel kernels run on hzp's own rayon pool of that many
//! threads. The evaluator runs a whole program inside the pool ([`install`]), so the thread
//! that runs the serial kernels is one of the pool's: no extra thread competes for the
//! cores with the pool's workers.

use rayon::prelude::*;
use std::sync::OnceLock;

/// The kernels' thread count (at least 1).
pub fn num_threads() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("HZP_NUM_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    })
}

/// The pool, when there is more than one thread (and it could be built).
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let n = num_threads();
        (n > 1)
            .then(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("hzp-{i}"))
                    .build()
                    .ok()
            })
            .flatten()
    })
    .as_ref()
}

/// Runs `f` on a thread of the pool (at once when already on one, or when single-threaded);
/// the parallel kernels `f` calls, gemm's included, then use the pool.
pub fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    match pool() {
        Some(p) => p.install(f),
        None => f(),
    }
}

/// `f(i, chunk)` for every `chunk`-sized piece `i` of `out`, in parallel when
/// [`num_threads`] > 1.
pub fn for_each_chunk<T: Send>(out: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    if pool().is_some() {
        install(|| {
            out.par_chunks_mut(chunk)
                .enumerate()
                .for_each(|(i, c)| f(i, c))
        });
    } else {
        out.chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c));
    }
}

/// `f(i)` for every `i < n`, in parallel when [`num_threads`] > 1.
pub fn for_each_index(n: usize, f: impl Fn(usize) + Sync) {
    if pool().is_some() {
        install(|| (0..n).into_par_iter().for_each(&f));
    } else {
        (0..n).for_each(f);
    }
}

/// `f(start, end)` over pieces of `0..n` of at least `min_piece` elements, in parallel when
/// [`num_threads`] > 1 and there are several pieces.
pub fn for_each_range(n: usize, min_piece: usize, f: impl Fn(usize, usize) + Sync) {
    let t = num_threads();
    if t == 1 || n < 2 * min_piece {
        if n > 0 {
            f(0, n);
        }
        return;
    }
    let piece = n.div_ceil(4 * t).max(min_piece);
    for_each_index(n.div_ceil(piece), |i| {
        f(i * piece, ((i + 1) * piece).min(n))
    });
}

/// A raw pointer that may cross to worker threads, for outputs that the workers write in
/// disjoint parts.
#[derive(Clone, Copy, Debug)]
pub struct SendPtr<T>(pub *mut T);
// SAFETY: users only write disjoint parts of memory that outlives the parallel section.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    pub fn get(self) -> *mut T {
        self.0
    }
}
