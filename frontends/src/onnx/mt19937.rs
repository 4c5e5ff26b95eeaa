//! numpy's legacy random generator, as far as ONNX's reference Dropout uses it:
//! `numpy.random.RandomState(seed).uniform(0.0, 1.0, shape)` for an integer seed.
//!
//! - `RandomState(seed)` with an int seed in `0..2**32` seeds MT19937 with Matsumoto and
//!   Nishimura's `init_genrand` (numpy's `mt19937_seed`; `init_by_array` is only for array
//!   seeds);
//! - `random_sample` (what `uniform(0, 1)` returns: `low + (high - low) * random_sample()`,
//!   exact for `[0, 1)`) is `genrand_res53`: `a = next() >> 5`, `b = next() >> 6`,
//!   `(a * 2**26 + b) / 2**53`, a double with 53 random bits;
//! - `uniform(0, 1, shape)` fills the shape in row-major order.

/// The MT19937 state (624 words) and the read position.
pub(crate) struct Mt19937 {
    mt: [u32; N],
    pos: usize,
}

const N: usize = 624;
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER: u32 = 0x8000_0000;
const LOWER: u32 = 0x7fff_ffff;

impl Mt19937 {
    /// `init_genrand(seed)`: numpy's `RandomState(seed)` for an integer seed.
    pub(crate) fn new(seed: u32) -> Mt19937 {
        let mut mt = [0u32; N];
        mt[0] = seed;
        for i in 1..N {
            let p = mt[i - 1];
            mt[i] = 1_812_433_253u32
                .wrapping_mul(p ^ (p >> 30))
                .wrapping_add(i as u32);
        }
        Mt19937 { mt, pos: N }
    }

    fn twist(&mut self) {
        for i in 0..N {
            let y = (self.mt[i] & UPPER) | (self.mt[(i + 1) % N] & LOWER);
            let mut v = self.mt[(i + M) % N] ^ (y >> 1);
            if y & 1 != 0 {
                v ^= MATRIX_A;
            }
            self.mt[i] = v;
        }
        self.pos = 0;
    }

    /// `genrand_int32`: the next 32-bit output, tempered.
    pub(crate) fn next_u32(&mut self) -> u32 {
        if self.pos >= N {
            self.twist();
        }
        let mut y = self.mt[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }

    /// `genrand_res53` (numpy's `random_sample`): a double in `[0, 1)` from two draws.
    pub(crate) fn next_f64(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67_108_864.0 + b) / 9_007_199_254_740_992.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference values from numpy 2.4 (`/work/venv-torch/bin/python -c "import numpy as np;
    /// print(np.random.RandomState(SEED).uniform(0, 1.0, (K,)).tolist())"`), compared as
    /// bits: the draw must be numpy's exactly, not close to it.
    #[test]
    fn matches_numpy_random_state_uniform() {
        let cases: &[(u32, usize, &[f64])] = &[
            (
                0,
                0,
                &[
                    0.5488135039273248,
                    0.7151893663724195,
                    0.6027633760716439,
                    0.5448831829968969,
                ],
            ),
            (
                4_294_967_295,
                0,
                &[0.0976320289940138, 0.9123828453026218, 0.78903530185164],
            ),
            (12345, 0, &[0.9296160928171479, 0.3163755545817859]),
            // across the second twist (draws 1246..1252 of 32 bits)
            (
                0,
                623,
                &[0.8130538632474607, 0.97622566345382, 0.8897936564455402],
            ),
        ];
        for &(seed, skip, want) in cases {
            let mut r = Mt19937::new(seed);
            for _ in 0..skip {
                r.next_f64();
            }
            for (k, &w) in want.iter().enumerate() {
                let got = r.next_f64();
                assert_eq!(
                    got.to_bits(),
                    w.to_bits(),
                    "seed {seed}, sample {}: {got} != {w}",
                    skip + k
                );
            }
        }
    }

    /// The first raw output of the reference implementation (mt19937ar.c) for seed 5489.
    #[test]
    fn matches_the_reference_init_genrand() {
        let mut r = Mt19937::new(5489);
        assert_eq!(r.next_u32(), 3_499_211_612);
    }
}
