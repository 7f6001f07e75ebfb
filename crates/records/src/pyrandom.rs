//! CPython's `random.Random`, bit for bit: MT19937 (mt19937ar) seeded with `init_by_array`,
//! and the `random()`, `getrandbits`, `_randbelow`, `randint` and `shuffle` that Google's
//! `create_pretraining_data.py` calls. Needed to reproduce that script instance for instance.

const N: usize = 624;
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_B0DF;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7FFF_FFFF;

/// CPython's `random.Random` (3.x), seeded from an integer.
#[derive(Clone)]
pub struct PyRandom {
    mt: [u32; N],
    index: usize,
    /// 32-bit words drawn so far (matches `words_after` in the reference RNG traces).
    pub words: u64,
}

impl PyRandom {
    /// `random.Random(seed)`: `init_by_array` with `abs(seed)` split into 32-bit words, least
    /// significant first (at least one word).
    pub fn new(seed: u64) -> Self {
        let mut key = vec![seed as u32];
        if seed >> 32 != 0 {
            key.push((seed >> 32) as u32);
        }
        let mut rng = PyRandom {
            mt: [0; N],
            index: N,
            words: 0,
        };
        rng.init_by_array(&key);
        rng
    }

    fn init_genrand(&mut self, s: u32) {
        self.mt[0] = s;
        for i in 1..N {
            let prev = self.mt[i - 1];
            self.mt[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        self.index = N;
    }

    fn init_by_array(&mut self, key: &[u32]) {
        self.init_genrand(19_650_218);
        let (mut i, mut j) = (1usize, 0usize);
        for _ in 0..N.max(key.len()) {
            let prev = self.mt[i - 1];
            self.mt[i] = (self.mt[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= N {
                self.mt[0] = self.mt[N - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..N - 1 {
            let prev = self.mt[i - 1];
            self.mt[i] = (self.mt[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_566_083_941))
                .wrapping_sub(i as u32);
            i += 1;
            if i >= N {
                self.mt[0] = self.mt[N - 1];
                i = 1;
            }
        }
        self.mt[0] = 0x8000_0000;
    }

    fn generate(&mut self) {
        let mag01 = |y: u32| if y & 1 == 1 { MATRIX_A } else { 0 };
        for kk in 0..N - M {
            let y = (self.mt[kk] & UPPER_MASK) | (self.mt[kk + 1] & LOWER_MASK);
            self.mt[kk] = self.mt[kk + M] ^ (y >> 1) ^ mag01(y);
        }
        for kk in N - M..N - 1 {
            let y = (self.mt[kk] & UPPER_MASK) | (self.mt[kk + 1] & LOWER_MASK);
            self.mt[kk] = self.mt[kk + M - N] ^ (y >> 1) ^ mag01(y);
        }
        let y = (self.mt[N - 1] & UPPER_MASK) | (self.mt[0] & LOWER_MASK);
        self.mt[N - 1] = self.mt[M - 1] ^ (y >> 1) ^ mag01(y);
        self.index = 0;
    }

    /// One tempered 32-bit word (`genrand_uint32`).
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= N {
            self.generate();
        }
        let mut y = self.mt[self.index];
        self.index += 1;
        self.words += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9D2C_5680;
        y ^= (y << 15) & 0xEFC6_0000;
        y ^ (y >> 18)
    }

    /// `random()`: a float in [0, 1) with 53 random bits, from two words.
    pub fn random(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67_108_864.0 + b) * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `getrandbits(k)` for 1 ≤ k ≤ 32: one word.
    pub fn getrandbits(&mut self, k: u32) -> u32 {
        debug_assert!((1..=32).contains(&k));
        self.next_u32() >> (32 - k)
    }

    /// `_randbelow(n)` for n ≥ 1: rejection sampling with `k = bit_length(n)` bits.
    pub fn randbelow(&mut self, n: u32) -> u32 {
        let k = 32 - n.leading_zeros();
        let mut r = self.getrandbits(k);
        while r >= n {
            r = self.getrandbits(k);
        }
        r
    }

    /// `randint(a, b)`: `a + _randbelow(b - a + 1)`.
    pub fn randint(&mut self, a: usize, b: usize) -> usize {
        a + self.randbelow((b - a + 1) as u32) as usize
    }

    /// `shuffle(x)`: Fisher–Yates from the end.
    pub fn shuffle<T>(&mut self, x: &mut [T]) {
        for i in (1..x.len()).rev() {
            let j = self.randbelow((i + 1) as u32) as usize;
            x.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_cpython_for_seed_12345() {
        let mut r = PyRandom::new(12345);
        let words: Vec<u32> = (0..6).map(|_| r.next_u32()).collect();
        assert_eq!(
            words,
            [
                1789368711, 3146859322, 43676229, 3522623596, 3544234957, 3448207591
            ]
        );
        let mut r = PyRandom::new(12345);
        assert_eq!(r.random(), 0.41661987254534116);
        assert_eq!(r.random(), 0.010169169457068361);
        assert_eq!(r.random(), 0.8252065092537432);
        assert_eq!(r.words, 6);
    }

    #[test]
    fn randbelow_rejects_with_bit_length_of_n() {
        // n = 1 takes one bit and loops until it is 0: at least one word.
        let mut r = PyRandom::new(1);
        assert_eq!(r.randbelow(1), 0);
        assert!(r.words >= 1);
        let mut v: Vec<u32> = (0..10).collect();
        PyRandom::new(7).shuffle(&mut v);
        let mut sorted = v.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
    }
}
