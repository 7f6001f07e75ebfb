//! The random draws instance generation makes, behind one trait: CPython's generator
//! ([`PyRandom`]) for the Google-compatible mode, and [`FastRng`] (xoshiro256++) for the
//! default mode, where every (pass, document) has its own stream so documents can be processed
//! in parallel with a result that does not depend on the thread count.

use crate::pyrandom::PyRandom;

/// The three draws of `create_pretraining_data.py`.
pub trait Draws {
    /// Whether the caller must make exactly the reference script's draws (CPython's generator);
    /// otherwise it may draw the same distribution its own, cheaper way.
    const REPLAYS_SCRIPT: bool = false;

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

    /// A fair coin: `random() < 0.5`.
    fn coin(&mut self) -> bool {
        self.random() < 0.5
    }

    /// How many of `n` fair coins come up heads.
    fn heads(&mut self, n: usize) -> usize {
        (0..n).filter(|_| self.coin()).count()
    }

    /// A seed for another generator (53 random bits here; 64 where the generator has them).
    fn seed(&mut self) -> u64 {
        (self.random() * (1u64 << 53) as f64) as u64
    }

    /// Visits the items of `x` in a uniformly random order until `visit` returns false
    /// (`visit` gets the generator for draws of its own). This shuffles all of `x` first, as
    /// the reference script does.
    fn visit_shuffled<T: Copy>(
        &mut self,
        x: &mut [T],
        mut visit: impl FnMut(&mut Self, T) -> bool,
    ) {
        self.shuffle(x);
        for &item in x.iter() {
            if !visit(self, item) {
                break;
            }
        }
    }
}

impl Draws for PyRandom {
    const REPLAYS_SCRIPT: bool = true;

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

/// xoshiro256++: small, fast, and good enough for masking and pairing. Coins come 64 to a
/// draw, and [`Draws::visit_shuffled`] shuffles lazily (forward Fisher–Yates, one draw per item
/// visited), so masking 20 of 128 candidates draws 20 times, not 127.
#[derive(Debug, Clone)]
pub struct FastRng {
    s: [u64; 4],
    /// Unused coin bits, and how many.
    coins: u64,
    coins_left: u32,
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
        FastRng {
            s,
            coins: 0,
            coins_left: 0,
        }
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

    /// Unbiased: Lemire's multiply-and-reject (the division only on the rare possible
    /// rejection).
    fn randint(&mut self, a: usize, b: usize) -> usize {
        let n = (b - a) as u64 + 1;
        let mut m = u128::from(self.next_u64()) * u128::from(n);
        if (m as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(n);
            }
        }
        a + (m >> 64) as usize
    }

    /// Whole random words at a time, then the coins left over (so that coins and heads share
    /// one supply of bits).
    fn heads(&mut self, n: usize) -> usize {
        let mut heads = 0;
        let mut left = n;
        while left >= 64 {
            heads += self.next_u64().count_ones() as usize;
            left -= 64;
        }
        if left > self.coins_left as usize {
            heads += self.coins.count_ones() as usize;
            left -= self.coins_left as usize;
            self.coins = self.next_u64();
            self.coins_left = 64;
        }
        if left > 0 {
            let taken = self.coins & (u64::MAX >> (64 - left));
            heads += taken.count_ones() as usize;
            // `left` is below 64 here: whole words were counted above.
            self.coins >>= left;
            self.coins_left -= left as u32;
        }
        heads
    }

    fn seed(&mut self) -> u64 {
        self.next_u64()
    }

    fn coin(&mut self) -> bool {
        if self.coins_left == 0 {
            self.coins = self.next_u64();
            self.coins_left = 64;
        }
        let heads = self.coins & 1 == 1;
        self.coins >>= 1;
        self.coins_left -= 1;
        heads
    }

    fn visit_shuffled<T: Copy>(
        &mut self,
        x: &mut [T],
        mut visit: impl FnMut(&mut Self, T) -> bool,
    ) {
        let n = x.len();
        for k in 0..n {
            let j = self.randint(k, n - 1);
            x.swap(k, j);
            if !visit(self, x[k]) {
                break;
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

    /// Coins are fair and independent of each other (pairs equally likely); a lazy shuffle
    /// visits every item first equally often and, visited to the end, is a permutation.
    #[test]
    fn coins_and_lazy_shuffles_are_uniform() {
        let mut r = FastRng::new(9);
        let mut pairs = [0u32; 4];
        for _ in 0..40_000 {
            pairs[usize::from(r.coin()) * 2 + usize::from(r.coin())] += 1;
        }
        assert!(
            pairs.iter().all(|&c| (9_600..10_400).contains(&c)),
            "{pairs:?}"
        );
        let mut first = [0u32; 8];
        for _ in 0..80_000 {
            let mut x: Vec<usize> = (0..8).collect();
            let mut seen = Vec::new();
            r.visit_shuffled(&mut x, |_, i| {
                seen.push(i);
                true
            });
            first[seen[0]] += 1;
            seen.sort_unstable();
            assert_eq!(seen, (0..8).collect::<Vec<_>>());
        }
        assert!(
            first.iter().all(|&c| (9_600..10_400).contains(&c)),
            "{first:?}"
        );
        let mut visited = 0;
        r.visit_shuffled(&mut [1, 2, 3, 4], |_, _| {
            visited += 1;
            visited < 2
        });
        assert_eq!(visited, 2);
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
