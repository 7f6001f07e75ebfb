//! # bertkit-rng: the seeded draws every stage makes
//!
//! One place for bertkit's pseudo-random numbers, so that a seed fixes a whole run, from the
//! shard shuffle to the dropout masks:
//! - [`splitmix64`] (Steele, Lea and Flood) turns any 64-bit counter or key into well-mixed
//!   bits: shuffle keys of documents, weight initialisation, dropout masks and data order are
//!   derived from it;
//! - [`SplitMix64`] is the generator that counts up by [`SPLITMIX_INCREMENT`] and mixes;
//! - [`shuffle`] permutes a slice with a chain of splitmix64 from one key;
//! - [`FastRng`] (xoshiro256++) is the stream the records stage draws its instances and masks
//!   from: coins come 64 to a draw, and [`FastRng::visit_shuffled`] shuffles lazily.
//!
//! Google's generator (CPython's MT19937, for the records stage's `--compat google`) is not
//! here: it exists to replay one script's draws and lives with that replay.
//!
//! None of these is for cryptography.

#![deny(missing_docs)]

/// The increment splitmix64 adds: a stream's state advances by it per draw.
pub const SPLITMIX_INCREMENT: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64 of `z`: add the golden-ratio increment, then the finaliser.
#[inline]
pub fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(SPLITMIX_INCREMENT);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The splitmix64 generator: the state counts up by [`SPLITMIX_INCREMENT`], each output is the
/// finaliser of the state.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A stream whose first output is `splitmix64(seed)`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let out = splitmix64(self.state);
        self.state = self.state.wrapping_add(SPLITMIX_INCREMENT);
        out
    }

    /// Skips `draws` outputs: the stream continues as if they had been drawn (the state only
    /// counts up, so this is one addition). Lets a stream be cut into blocks drawn in parallel.
    #[inline]
    pub fn skip(&mut self, draws: u64) {
        self.state = self
            .state
            .wrapping_add(SPLITMIX_INCREMENT.wrapping_mul(draws));
    }

    /// A float in [0, 1) with 53 random bits.
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Fisher–Yates shuffle of `items`, its draws a chain of splitmix64 from `key`.
pub fn shuffle<T>(items: &mut [T], key: u64) {
    let mut state = key;
    for i in (1..items.len()).rev() {
        state = splitmix64(state);
        let j = (state % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
}

/// xoshiro256++ (Blackman and Vigna): small, fast, and good enough for masking and pairing.
/// Coins come 64 to a draw, and [`FastRng::visit_shuffled`] shuffles lazily (forward
/// Fisher–Yates, one draw per item visited), so masking 20 of 128 candidates draws 20 times,
/// not 127.
#[derive(Debug, Clone)]
pub struct FastRng {
    s: [u64; 4],
    /// Unused coin bits, and how many.
    coins: u64,
    coins_left: u32,
}

impl FastRng {
    /// A generator whose state is expanded from `seed` with splitmix64.
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut s = [0u64; 4];
        for word in &mut s {
            x = x.wrapping_add(SPLITMIX_INCREMENT);
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
    #[inline]
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

    /// A float in [0, 1) with 53 random bits.
    #[inline]
    pub fn random(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// An integer in `a..=b`, unbiased: Lemire's multiply-and-reject (the division only on the
    /// rare possible rejection).
    #[inline]
    pub fn randint(&mut self, a: usize, b: usize) -> usize {
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

    /// A fair coin, from a supply of 64 coins per draw.
    #[inline]
    pub fn coin(&mut self) -> bool {
        if self.coins_left == 0 {
            self.coins = self.next_u64();
            self.coins_left = 64;
        }
        let heads = self.coins & 1 == 1;
        self.coins >>= 1;
        self.coins_left -= 1;
        heads
    }

    /// How many of `n` fair coins come up heads: whole random words at a time, then the coins
    /// left over (so that coins and heads share one supply of bits).
    pub fn heads(&mut self, n: usize) -> usize {
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

    /// Visits the items of `x` in a uniformly random order until `visit` returns false
    /// (`visit` gets the generator for draws of its own); only the visited items cost a draw.
    pub fn visit_shuffled<T: Copy>(
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
    /// Skipping k draws lands where drawing them would.
    #[test]
    fn skip_lands_where_drawing_would() {
        for k in [0u64, 1, 2, 1000, 1 << 33] {
            let mut drawn = SplitMix64::new(77);
            let mut skipped = drawn.clone();
            if k < 10_000 {
                for _ in 0..k {
                    drawn.next_u64();
                }
            } else {
                drawn.state = drawn.state.wrapping_add(SPLITMIX_INCREMENT.wrapping_mul(k));
            }
            skipped.skip(k);
            assert_eq!(skipped.next_u64(), drawn.next_u64(), "{k}");
        }
    }

    use super::*;

    #[test]
    fn splitmix_known_values_and_shuffle_permutes() {
        // The reference sequence of splitmix64 seeded with 0 starts 0xE220A8397B1DCDAF.
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        let mut stream = SplitMix64::new(0);
        assert_eq!(stream.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(stream.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        let mut v: Vec<u32> = (0..50).collect();
        shuffle(&mut v, 9);
        assert_ne!(v, (0..50).collect::<Vec<_>>());
        v.sort();
        assert_eq!(v, (0..50).collect::<Vec<_>>());
    }

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
