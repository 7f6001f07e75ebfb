//! The random draws instance generation makes, behind one trait: CPython's generator
//! ([`PyRandom`]) for the Google-compatible mode, and [`FastRng`] (xoshiro256++) for the
//! default mode, where every (pass, document) has its own stream so documents can be processed
//! in parallel with a result that does not depend on the thread count.
//!
//! The trait's provided methods make the reference script's draws, in its order. The default
//! mode's generator overrides those where a cheaper draw gives the same distribution: coins 64
//! to a word, lazy shuffles, truncation counts drawn at once, masked positions drawn directly,
//! and masks drawn when an instance is written (from a seed kept with it). Instance generation
//! and masking are written once, against the trait; the two modes differ only here.

use std::ops::Range;

use bertkit_rng::FastRng;

use crate::pyrandom::PyRandom;

/// The draws of `create_pretraining_data.py`.
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

    /// A fair coin: `random() < 0.5`.
    fn coin(&mut self) -> bool {
        self.random() < 0.5
    }

    /// Where a new instance's masks come from: `None` when they are drawn now, from this
    /// generator, between the instance's draws and the next one's (the script's order); else
    /// the seed of the generator that draws them when the instance is written.
    fn deferred_mask_seed(&mut self) -> Option<u64> {
        None
    }

    /// Truncates a pair of lists of `a_len` and `b_len` tokens to `max_num_tokens`: a token at a
    /// time from the longer one (B on a tie), from its front or back at the toss of a coin.
    /// Returns the ranges of A and B that are left.
    fn truncate_pair(
        &mut self,
        a_len: usize,
        b_len: usize,
        max_num_tokens: usize,
    ) -> (Range<usize>, Range<usize>) {
        let (mut a, mut b) = (0..a_len, 0..b_len);
        while a.len() + b.len() > max_num_tokens {
            let longer = if a.len() > b.len() { &mut a } else { &mut b };
            if self.coin() {
                longer.start += 1;
            } else {
                longer.end -= 1;
            }
        }
        (a, b)
    }

    /// Calls `visit` on `wanted` distinct positions `i` of `ids` with `eligible(ids[i])` (all of
    /// them if fewer), in a uniformly random order; `eligible_count` is how many there are.
    /// `visit` gets the generator, for draws of its own, and `ids`, to change the position.
    /// The script lists every eligible position and shuffles the list.
    fn visit_positions(
        &mut self,
        ids: &mut [u32],
        eligible: impl Fn(u32) -> bool,
        eligible_count: usize,
        wanted: usize,
        scratch: &mut PositionScratch,
        visit: impl FnMut(&mut Self, &mut [u32], u32),
    ) where
        Self: Sized,
    {
        let _ = eligible_count;
        visit_listed_positions(self, ids, eligible, wanted, scratch, visit);
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

/// Buffers [`Draws::visit_positions`] reuses from one sequence to the next.
#[derive(Debug, Default)]
pub struct PositionScratch {
    /// The eligible positions.
    listed: Vec<u32>,
    /// A bit per position: visited.
    visited: Vec<u64>,
}

/// [`Draws::visit_positions`] the script's way: every eligible position listed, then visited
/// in the generator's shuffled order.
fn visit_listed_positions<R: Draws>(
    rng: &mut R,
    ids: &mut [u32],
    eligible: impl Fn(u32) -> bool,
    wanted: usize,
    scratch: &mut PositionScratch,
    mut visit: impl FnMut(&mut R, &mut [u32], u32),
) {
    let listed = &mut scratch.listed;
    listed.clear();
    listed.extend((0..ids.len() as u32).filter(|&i| eligible(ids[i as usize])));
    let mut visited = 0;
    rng.visit_shuffled(listed, |rng, index| {
        if visited >= wanted {
            return false;
        }
        visit(rng, ids, index);
        visited += 1;
        true
    });
}

/// How many tokens [`Draws::truncate_pair`] takes from A and from B: from the longer one until
/// both are as long (B on a tie), then from B and A in turn.
pub(crate) fn truncated_tokens(
    a_len: usize,
    b_len: usize,
    max_num_tokens: usize,
) -> (usize, usize) {
    let excess = (a_len + b_len).saturating_sub(max_num_tokens);
    let a_first = excess.min(a_len.saturating_sub(b_len));
    let b_first = excess.min(b_len.saturating_sub(a_len));
    let in_turn = excess - a_first - b_first;
    (a_first + in_turn / 2, b_first + in_turn.div_ceil(2))
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

impl Draws for FastRng {
    fn random(&mut self) -> f64 {
        FastRng::random(self)
    }

    fn randint(&mut self, a: usize, b: usize) -> usize {
        FastRng::randint(self, a, b)
    }

    fn deferred_mask_seed(&mut self) -> Option<u64> {
        Some(self.next_u64())
    }

    /// How many tokens each list loses is worked out first, and the number taken from its
    /// front drawn at once (the count of heads in as many coins): the same distribution.
    fn truncate_pair(
        &mut self,
        a_len: usize,
        b_len: usize,
        max_num_tokens: usize,
    ) -> (Range<usize>, Range<usize>) {
        let (a_lost, b_lost) = truncated_tokens(a_len, b_len, max_num_tokens);
        let a_front = self.heads(a_lost);
        let b_front = self.heads(b_lost);
        (
            a_front..a_len - (a_lost - a_front),
            b_front..b_len - (b_lost - b_front),
        )
    }

    /// While at most half the eligible positions are wanted, a uniformly random set of them is
    /// drawn directly (a drawn ineligible or visited position is drawn again, so a draw is kept
    /// with probability at least 1/2) instead of listing and shuffling every one.
    fn visit_positions(
        &mut self,
        ids: &mut [u32],
        eligible: impl Fn(u32) -> bool,
        eligible_count: usize,
        wanted: usize,
        scratch: &mut PositionScratch,
        mut visit: impl FnMut(&mut Self, &mut [u32], u32),
    ) {
        if 2 * wanted > eligible_count {
            return visit_listed_positions(self, ids, eligible, wanted, scratch, visit);
        }
        let bits = &mut scratch.visited;
        bits.clear();
        bits.resize(ids.len().div_ceil(64), 0);
        let mut visited = 0;
        while visited < wanted {
            let index = self.randint(0, ids.len() - 1);
            let bit = 1 << (index % 64);
            if bits[index / 64] & bit != 0 || !eligible(ids[index]) {
                continue;
            }
            bits[index / 64] |= bit;
            visit(self, ids, index as u32);
            visited += 1;
        }
    }

    fn coin(&mut self) -> bool {
        FastRng::coin(self)
    }

    fn visit_shuffled<T: Copy>(&mut self, x: &mut [T], visit: impl FnMut(&mut Self, T) -> bool) {
        FastRng::visit_shuffled(self, x, visit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The script's loop, counting the tokens taken from each list.
    fn truncated_one_by_one(a_len: usize, b_len: usize, max_num_tokens: usize) -> (usize, usize) {
        let (mut a, mut b) = (a_len, b_len);
        while a + b > max_num_tokens {
            if a > b {
                a -= 1;
            } else {
                b -= 1;
            }
        }
        (a_len - a, b_len - b)
    }

    #[test]
    fn truncation_counts_are_the_token_by_token_loops() {
        for a in 0..45 {
            for b in 0..45 {
                for max in 0..70 {
                    assert_eq!(
                        truncated_tokens(a, b, max),
                        truncated_one_by_one(a, b, max),
                        "a {a}, b {b}, max {max}"
                    );
                }
            }
        }
    }

    #[test]
    fn default_truncation_takes_fronts_binomially() {
        // B loses 100 tokens (A none): the front share is Binomial(100, 1/2).
        let mut rng = FastRng::new(5);
        let n = 20_000;
        let (mut sum, mut squares) = (0.0, 0.0);
        for _ in 0..n {
            let (a, b) = rng.truncate_pair(3, 200, 103);
            assert_eq!((a, b.len()), (0..3, 100));
            let front = b.start as f64;
            sum += front;
            squares += front * front;
        }
        let mean = sum / n as f64;
        let variance = squares / n as f64 - mean * mean;
        assert!((mean - 50.0).abs() < 0.2, "mean {mean}");
        assert!((22.5..27.5).contains(&variance), "variance {variance}");
    }

    #[test]
    fn heads_are_fair_for_every_count() {
        let mut rng = FastRng::new(11);
        for n in [0, 1, 2, 63, 64, 65, 127, 130] {
            let draws = 20_000;
            let total: usize = (0..draws)
                .map(|i| {
                    // Interleaved with single coins, so that leftover bits are used too.
                    if i % 3 == 0 {
                        rng.coin();
                    }
                    let h = rng.heads(n);
                    assert!(h <= n);
                    h
                })
                .sum();
            let mean = total as f64 / draws as f64;
            assert!(
                (mean - n as f64 / 2.0).abs() < 0.05 * n as f64 + 0.01,
                "n {n}: {mean}"
            );
        }
    }
}
