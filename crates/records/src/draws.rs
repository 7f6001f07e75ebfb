//! The random draws instance generation makes, behind one trait: CPython's generator
//! ([`PyRandom`]) for the Google-compatible mode, and [`FastRng`] (xoshiro256++) for the
//! default mode, where every (pass, document) has its own stream so documents can be processed
//! in parallel with a result that does not depend on the thread count.

use bertkit_rng::FastRng;

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

impl Draws for FastRng {
    fn random(&mut self) -> f64 {
        FastRng::random(self)
    }

    fn randint(&mut self, a: usize, b: usize) -> usize {
        FastRng::randint(self, a, b)
    }

    fn heads(&mut self, n: usize) -> usize {
        FastRng::heads(self, n)
    }

    fn seed(&mut self) -> u64 {
        self.next_u64()
    }

    fn coin(&mut self) -> bool {
        FastRng::coin(self)
    }

    fn visit_shuffled<T: Copy>(&mut self, x: &mut [T], visit: impl FnMut(&mut Self, T) -> bool) {
        FastRng::visit_shuffled(self, x, visit)
    }
}
