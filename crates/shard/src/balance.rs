//! Assigning documents to shards so that the test split holds its fraction of the sentences and
//! the shards of each split are balanced.
//!
//! Documents arrive in shuffled order. Each goes to the split that is further behind its target
//! share of the sentences so far (test if `test · (1 − F) < train · F`), then to the shard of
//! that split with the fewest sentences (ties: lowest index). With random arrival order, this
//! keeps the test share within one document of `F` at every point and the spread between the
//! shards of a split within the size of the last few documents placed, typically a few
//! sentences on a large corpus.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Train or test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// Training shards.
    Train,
    /// Held-out shards.
    Test,
}

/// Where a document goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The split.
    pub split: Split,
    /// Shard index within the split.
    pub shard: usize,
}

/// The state of the assignment.
pub struct Balancer {
    test_fraction: f64,
    train: BinaryHeap<Reverse<(u64, usize)>>,
    test: BinaryHeap<Reverse<(u64, usize)>>,
    train_sentences: u64,
    test_sentences: u64,
}

impl Balancer {
    /// `num_test` may be 0 only with a test fraction of 0.
    pub fn new(num_train: usize, num_test: usize, test_fraction: f64) -> Self {
        Balancer {
            test_fraction,
            train: (0..num_train).map(|i| Reverse((0, i))).collect(),
            test: (0..num_test).map(|i| Reverse((0, i))).collect(),
            train_sentences: 0,
            test_sentences: 0,
        }
    }

    /// Places a document of `sentences` sentences.
    pub fn place(&mut self, sentences: u64) -> Placement {
        let f = self.test_fraction;
        let to_test = !self.test.is_empty()
            && f > 0.0
            && (self.test_sentences as f64) * (1.0 - f) < (self.train_sentences as f64) * f
            || self.train.is_empty();
        let (heap, split, total) = if to_test {
            (&mut self.test, Split::Test, &mut self.test_sentences)
        } else {
            (&mut self.train, Split::Train, &mut self.train_sentences)
        };
        let Reverse((load, shard)) = heap.pop().expect("the split has shards");
        heap.push(Reverse((load + sentences, shard)));
        *total += sentences;
        Placement { split, shard }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_share_and_balance() {
        let mut b = Balancer::new(4, 2, 0.1);
        let mut loads = [[0u64; 4], [0u64; 4]];
        let mut state = 12345u64;
        for _ in 0..10_000 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let s = 1 + (state >> 33) % 200;
            let p = b.place(s);
            loads[(p.split == Split::Test) as usize][p.shard] += s;
        }
        let train: u64 = loads[0].iter().sum();
        let test: u64 = loads[1][..2].iter().sum();
        let share = test as f64 / (train + test) as f64;
        assert!((share - 0.1).abs() < 0.001, "{share}");
        let (max, min) = (
            *loads[0].iter().max().unwrap(),
            *loads[0].iter().min().unwrap(),
        );
        assert!(max - min <= 200, "{loads:?}");
    }

    #[test]
    fn no_test_split() {
        let mut b = Balancer::new(2, 0, 0.0);
        assert_eq!(
            b.place(5),
            Placement {
                split: Split::Train,
                shard: 0
            }
        );
        assert_eq!(
            b.place(5),
            Placement {
                split: Split::Train,
                shard: 1
            }
        );
    }
}
