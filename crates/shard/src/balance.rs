//! Assigning documents to shards so that the test split holds its fraction of the sentences and
//! the shards of each split are balanced.
//!
//! Documents arrive in shuffled order, in windows of bounded size. Within a window they are
//! placed largest first (longest-processing-time order, ties by shuffle key): each goes to the
//! split after which the test share of the sentences is closest to its target `F` (so a book
//! never overshoots the test split), then to the shard of that split whose larger normalised load
//! (its sentences over the split's mean, its bytes over the split's mean) is smallest, so that
//! sentences and bytes are balanced together (books have shorter sentences than encyclopedia
//! articles, so balancing sentences alone leaves bytes uneven). Large documents (books) are placed early in their window and the many
//! small ones then even the shards out, so at the end of every window the test share is within
//! half a small document of `F` and the shards of a split differ by about the size of the smallest
//! documents. The window's documents are still written in shuffled order.

use std::cmp::Reverse;

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

/// Running loads of one split.
struct SplitLoads {
    /// (sentences, bytes) per shard.
    shards: Vec<(u64, u64)>,
    sentences: u64,
    bytes: u64,
}

impl SplitLoads {
    fn new(n: usize) -> Self {
        SplitLoads {
            shards: vec![(0, 0); n],
            sentences: 0,
            bytes: 0,
        }
    }

    /// The shard whose larger normalised load (sentences over the mean, bytes over the mean,
    /// after adding the document) is smallest; ties by the sum, then the lowest index.
    fn place(&mut self, sentences: u64, bytes: u64) -> usize {
        let n = self.shards.len() as f64;
        let mean_s = ((self.sentences + sentences) as f64 / n).max(1.0);
        let mean_b = ((self.bytes + bytes) as f64 / n).max(1.0);
        let mut best = (f64::INFINITY, f64::INFINITY, 0usize);
        for (i, &(s, b)) in self.shards.iter().enumerate() {
            let ns = (s + sentences) as f64 / mean_s;
            let nb = (b + bytes) as f64 / mean_b;
            let key = (ns.max(nb), ns + nb, i);
            if key.0 < best.0 || (key.0 == best.0 && key.1 < best.1) {
                best = key;
            }
        }
        let shard = best.2;
        self.shards[shard].0 += sentences;
        self.shards[shard].1 += bytes;
        self.sentences += sentences;
        self.bytes += bytes;
        shard
    }
}

/// The state of the assignment.
pub struct Balancer {
    test_fraction: f64,
    train: SplitLoads,
    test: SplitLoads,
}

impl Balancer {
    /// `num_test` may be 0 only with a test fraction of 0.
    pub fn new(num_train: usize, num_test: usize, test_fraction: f64) -> Self {
        Balancer {
            test_fraction,
            train: SplitLoads::new(num_train),
            test: SplitLoads::new(num_test),
        }
    }

    /// Places a window of documents given their (sentences, bytes), largest first (by
    /// sentences, ties in window order). The smallest documents, up to `defer_bytes` in all, are
    /// not placed (`None`): the caller carries them into the next window, where they even out
    /// that window's large documents. With `defer_bytes` 0 everything is placed.
    pub fn place_window(
        &mut self,
        sizes: &[(u64, u64)],
        defer_bytes: u64,
    ) -> Vec<Option<Placement>> {
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        order.sort_by_key(|&i| (Reverse(sizes[i].0), i));
        let mut deferred = 0;
        let mut deferred_bytes = 0;
        for &i in order.iter().rev() {
            if deferred_bytes + sizes[i].1 > defer_bytes {
                break;
            }
            deferred += 1;
            deferred_bytes += sizes[i].1;
        }
        let mut placements = vec![None; sizes.len()];
        for &i in &order[..sizes.len() - deferred] {
            placements[i] = Some(self.place(sizes[i].0, sizes[i].1));
        }
        placements
    }

    /// Places one document.
    pub fn place(&mut self, sentences: u64, bytes: u64) -> Placement {
        // The split after which the test share is closest to its target.
        let f = self.test_fraction;
        let target = f * (self.test.sentences + self.train.sentences + sentences) as f64;
        let miss_if_test = ((self.test.sentences + sentences) as f64 - target).abs();
        let miss_if_train = (self.test.sentences as f64 - target).abs();
        let to_test = !self.test.shards.is_empty() && f > 0.0 && miss_if_test < miss_if_train;
        if to_test {
            Placement {
                split: Split::Test,
                shard: self.test.place(sentences, bytes),
            }
        } else {
            Placement {
                split: Split::Train,
                shard: self.train.place(sentences, bytes),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_share_and_balance() {
        let mut b = Balancer::new(4, 2, 0.1);
        let mut loads = [[0u64; 4], [0u64; 4]];
        let mut sizes = bertkit_rng::SplitMix64::new(12345);
        for _ in 0..10_000 {
            let s = 1 + sizes.next_u64() % 200;
            let p = b.place(s, s * 120);
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
    fn windows_place_large_documents_first() {
        // Two books and many small documents, the books last in arrival order.
        let mut sizes = vec![(10u64, 1400u64); 400];
        sizes.extend([(3000, 372_000), (2500, 310_000)]);
        let mut b = Balancer::new(2, 0, 0.0);
        let placements: Vec<Placement> = b
            .place_window(&sizes, 0)
            .into_iter()
            .map(Option::unwrap)
            .collect();
        let mut loads = [(0u64, 0u64); 2];
        for (p, s) in placements.iter().zip(&sizes) {
            loads[p.shard].0 += s.0;
            loads[p.shard].1 += s.1;
        }
        // Sentences and bytes both within 1% of the mean.
        let spread = |a: u64, b: u64| a.abs_diff(b) as f64 / ((a + b) as f64 / 2.0);
        assert!(spread(loads[0].0, loads[1].0) < 0.01, "{loads:?}");
        assert!(spread(loads[0].1, loads[1].1) < 0.01, "{loads:?}");
        // With a deferral budget, the smallest documents wait for the next window.
        let mut b = Balancer::new(2, 0, 0.0);
        let deferred = b.place_window(&sizes, 1400 * 100);
        assert_eq!(deferred.iter().filter(|p| p.is_none()).count(), 100);
        assert!(deferred[400].is_some() && deferred[401].is_some());
        assert_ne!(
            placements[400].shard, placements[401].shard,
            "the books go to different shards"
        );
    }

    #[test]
    fn no_test_split() {
        let mut b = Balancer::new(2, 0, 0.0);
        assert_eq!(
            b.place(5, 50),
            Placement {
                split: Split::Train,
                shard: 0
            }
        );
        assert_eq!(
            b.place(5, 50),
            Placement {
                split: Split::Train,
                shard: 1
            }
        );
    }
}
