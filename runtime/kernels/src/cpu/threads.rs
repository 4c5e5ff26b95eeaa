//! How many threads the CPU kernels use: `HZP_NUM_THREADS` if set (1 = single-threaded;
//! capped at the number of cores), else the number of cores. Parallel kernels run on hzp's own rayon pool of that many
//! threads. The evaluator runs a whole program inside the pool ([`install`]), so the thread
//! that runs the serial kernels is one of the pool's: no extra thread competes for the
//! cores with the pool's workers.

use rayon::prelude::*;
use std::sync::OnceLock;

/// The thread count for a value of `HZP_NUM_THREADS` on a machine with `cores` cores, and
/// a note for the user when the value was not taken as given: more threads than cores are
/// capped at the core count (more would only contend, and a huge count would try to start
/// that many threads), and a value that is not a positive integer is ignored.
pub fn resolve(var: Option<&str>, cores: usize) -> (usize, Option<String>) {
    let cores = cores.max(1);
    let Some(v) = var else {
        return (cores, None);
    };
    match v.trim().parse::<u64>() {
        Ok(n) if n >= 1 && n <= cores as u64 => (n as usize, None),
        Ok(n) if n > cores as u64 => (
            cores,
            Some(format!(
                "note: HZP_NUM_THREADS={n} is more than this machine's {cores} cores; using {cores} threads"
            )),
        ),
        _ => (
            cores,
            Some(format!(
                "note: HZP_NUM_THREADS=`{v}` is not a positive integer; using all {cores} cores"
            )),
        ),
    }
}

fn resolved() -> &'static (usize, Option<String>) {
    static R: OnceLock<(usize, Option<String>)> = OnceLock::new();
    R.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let var = std::env::var("HZP_NUM_THREADS").ok();
        resolve(var.as_deref(), cores)
    })
}

/// The kernels' thread count (at least 1, at most the number of cores).
pub fn num_threads() -> usize {
    resolved().0
}

/// What the user should be told about `HZP_NUM_THREADS` (capped or ignored), if anything.
pub fn setting_note() -> Option<&'static str> {
    resolved().1.as_deref()
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

#[cfg(test)]
mod resolve_tests {
    use super::resolve;

    #[test]
    fn thread_counts_are_capped_at_the_cores_with_a_note() {
        assert_eq!(resolve(None, 8), (8, None));
        assert_eq!(resolve(Some("3"), 8), (3, None));
        let (n, note) = resolve(Some("100000"), 8);
        assert_eq!(n, 8);
        assert!(note
            .unwrap()
            .contains("HZP_NUM_THREADS=100000 is more than this machine's 8 cores"));
        let (n, note) = resolve(Some("18446744073709551616"), 2);
        assert_eq!(n, 2);
        assert!(note.unwrap().contains("not a positive integer"));
        for bad in ["0", "-1", "many", ""] {
            let (n, note) = resolve(Some(bad), 4);
            assert_eq!(n, 4, "{bad}");
            assert!(note.is_some(), "{bad}");
        }
    }
}
