//! The random draws instance generation makes, behind one trait: CPython's generator
//! ([`PyRandom`]) for the Google-compatible mode, and [`FastRng`] (xoshiro256++) for the
//! default mode, where every (pass, document) has its own stream so documents can be processed
//! in parallel with a result that does not depend on the thread count.

use crate::pyrandom::PyRandom;

/// The three draws of `create_pretraining_data.py`.
pub trait Draws {
    /// A float in [0, 1).
    fn random(&mut self) -> f64;
    /// An integer in `a..=b`.
    fn randint(&mut self, a: usize, b: usize) -> usize;
    /// Shuffles in place (Fisher–Yates).
    fn shuffle<T>(&mut self, x: &mut [T]) {
        for i in (1..x.len()).rev() {
            let j = self.randint(0, i);
            x.swap(i, j);
        }
    }
}

impl Draws for PyRandom {
    fn random(&mut self) -> f64 {
        PyRandom::random(self)
    }

    fn randint(&mut self, a: usize, b: usize) -> usize {
        PyRandom::randint(self, a, b)
    }

    fn shuffle<T>(&mut self, x: &mut [T]) {
        PyRandom::shuffle(self, x)
    }
}

/// SplitMix64, to expand seeds.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// xoshiro256++: small, fast, and good enough for masking and pairing.
#[derive(Debug, Clone)]
pub struct FastRng {
    s: [u64; 4],
}

impl FastRng {
    /// A generator whose state is expanded from `seed` with SplitMix64.
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut s = [0u64; 4];
        for word in &mut s {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            *word = splitmix64(x);
        }
        FastRng { s }
    }

    /// The generator of one (pass, document) of a run seeded with `seed`.
    pub fn for_document(seed: u64, pass: usize, document: usize) -> Self {
        FastRng::new(splitmix64(
            splitmix64(seed ^ 0x5EED) ^ splitmix64(pass as u64) ^ (document as u64).rotate_left(32),
        ))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[0]
            .wrapping_add(self.s[3])
            .rotate_left(23)
            .wrapping_add(self.s[0]);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }
}

impl Draws for FastRng {
    fn random(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Unbiased: Lemire's multiply-and-reject.
    fn randint(&mut self, a: usize, b: usize) -> usize {
        let n = (b - a) as u64 + 1;
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = u128::from(self.next_u64()) * u128::from(n);
            if (m as u64) >= threshold {
                return a + (m >> 64) as usize;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_rng_is_uniform_enough_and_deterministic() {
        let mut r = FastRng::new(1);
        let mut counts = [0u32; 6];
        for _ in 0..60_000 {
            counts[r.randint(0, 5)] += 1;
        }
        assert!(
            counts.iter().all(|&c| (9_500..10_500).contains(&c)),
            "{counts:?}"
        );
        let mean: f64 = (0..100_000).map(|_| r.random()).sum::<f64>() / 100_000.0;
        assert!((mean - 0.5).abs() < 0.005);
        assert_eq!(
            FastRng::for_document(3, 1, 2).next_u64(),
            FastRng::for_document(3, 1, 2).next_u64()
        );
        assert_ne!(
            FastRng::for_document(3, 1, 2).next_u64(),
            FastRng::for_document(3, 2, 1).next_u64()
        );
    }

    /// Each document's first draw decides its short target (10%): over many (pass, document)
    /// streams the first draws must be uniform, not correlated by the seeding.
    #[test]
    fn first_draws_of_document_streams_are_uniform() {
        let mut short = 0;
        let mut below_half = 0;
        for pass in 0..5 {
            for doc in 0..20_000 {
                let first = FastRng::for_document(12345, pass, doc).random();
                short += (first < 0.1) as u32;
                below_half += (first < 0.5) as u32;
            }
        }
        assert!(
            (9_600..10_400).contains(&short),
            "{short} of 100000 below 0.1"
        );
        assert!(
            (49_300..50_700).contains(&below_half),
            "{below_half} of 100000 below 0.5"
        );
    }
}
