//! Masked-LM / next-sentence pre-training instances, Google's `create_pretraining_data.py`
//! algorithm, in its compatible form: the same input, vocabulary and seed give the reference
//! script's instances, one for one and in the same order. It uses CPython's generator
//! ([`PyRandom`]) and makes the script's random calls in the script's order. The reference data's
//! `REFERENCE.md` lists that order and its traps: `randint(1, 1)` still draws, the
//! short-circuited `random()` for one-segment chunks, round-half-to-even for the number of
//! predictions, a tie in `truncate_seq_pair` truncating B (the draws trait's `truncate_pair`), and whole-word groups that cross
//! `[SEP]`.
//!
//! The algorithm: documents are shuffled; for each of `dupe_factor` passes and each document,
//! sentences are packed into chunks up to a target length (`max_seq_length − 3`, or with
//! probability `short_seq_prob` a random shorter one). Each chunk is split at a random point into
//! A and B. B is replaced by text from a random other document in half of the cases (always for
//! one-segment chunks), and the unused segments are put back. The pair is truncated from the
//! longer side at random ends, wrapped as `[CLS] A [SEP] B [SEP]`, and masked (15% by default,
//! capped at `max_predictions_per_seq`; 80% `[MASK]`, 10% kept, 10% random word; optionally
//! whole words). The full instance list is shuffled at the end.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::corpus::Corpus;
use crate::masking::MaskOptions;
pub use crate::masking::VocabIds;
use crate::pyrandom::PyRandom;
use bertkit_rng::FastRng;

mod columns;
mod generate;
mod instance;

use columns::Masks;
pub use columns::{InstanceColumns, Instances, RowFields, RowScratch};
use generate::{Scratch, ShuffledDocuments, instances_from_document};
pub use instance::{InstanceRef, TrainingInstance};

/// The knobs of `create_pretraining_data.py`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceOptions {
    /// Maximum sequence length, `[CLS]` and both `[SEP]` included.
    pub max_seq_length: usize,
    /// Maximum masked positions per instance.
    pub max_predictions_per_seq: usize,
    /// Share of tokens masked.
    pub masked_lm_prob: f64,
    /// Probability of a shorter target length.
    pub short_seq_prob: f64,
    /// Passes over the corpus (each with different masks and pairs).
    pub dupe_factor: usize,
    /// Mask whole words (a `##` piece joins the previous candidate).
    pub whole_word_mask: bool,
    /// Seed.
    pub seed: u64,
}

/// The longest sequence the records stage makes: BERT's position table holds 512; longer-context
/// encoders go to 8,192.
pub const MAX_SEQ_LENGTH: usize = 8192;

impl InstanceOptions {
    /// Checks the values: an error names the setting (its flag), the value and what is
    /// accepted.
    pub fn validate(&self) -> Result<(), String> {
        let bad = |name: &str, value: &dyn std::fmt::Display, accepted: &str| {
            Err(format!("{name} is {value}: {accepted}"))
        };
        if !(4..=MAX_SEQ_LENGTH).contains(&self.max_seq_length) {
            return bad(
                "max_seq_length (--max-seq-length)",
                &self.max_seq_length,
                &format!("from 4 ([CLS], two [SEP] and a token) to {MAX_SEQ_LENGTH}"),
            );
        }
        if self.max_predictions_per_seq == 0 || self.max_predictions_per_seq > self.max_seq_length {
            return bad(
                "max_predictions_per_seq (--max-predictions-per-seq)",
                &self.max_predictions_per_seq,
                "at least 1 (0 leaves pre-training nothing but next-sentence prediction) and at \
                 most max_seq_length",
            );
        }
        if !(self.masked_lm_prob > 0.0 && self.masked_lm_prob <= 1.0) {
            return bad(
                "masked_lm_prob (--masked-lm-prob)",
                &self.masked_lm_prob,
                "a share of the tokens, above 0 and at most 1 (BERT: 0.15)",
            );
        }
        if !(0.0..=1.0).contains(&self.short_seq_prob) {
            return bad(
                "short_seq_prob (--short-seq-prob)",
                &self.short_seq_prob,
                "a probability, from 0 to 1 (BERT: 0.1)",
            );
        }
        if self.dupe_factor == 0 {
            return bad(
                "dupe_factor (--dupe-factor)",
                &self.dupe_factor,
                "at least 1 (0 makes no instance)",
            );
        }
        Ok(())
    }

    /// Phase 1 of BERT pre-training: sequences of 128, 20 predictions.
    pub fn phase1() -> Self {
        InstanceOptions {
            max_seq_length: 128,
            max_predictions_per_seq: 20,
            masked_lm_prob: 0.15,
            short_seq_prob: 0.1,
            dupe_factor: 5,
            whole_word_mask: false,
            seed: 12345,
        }
    }

    /// The preset of pre-training phase `phase` (1 or 2), if there is one.
    pub fn phase(phase: u8) -> Option<Self> {
        match phase {
            1 => Some(Self::phase1()),
            2 => Some(Self::phase2()),
            _ => None,
        }
    }

    /// The masking part of the options.
    pub fn masking(&self) -> MaskOptions {
        MaskOptions {
            prob: self.masked_lm_prob,
            max_predictions: self.max_predictions_per_seq,
            whole_word: self.whole_word_mask,
        }
    }

    /// Phase 2: sequences of 512, 80 predictions.
    pub fn phase2() -> Self {
        InstanceOptions {
            max_seq_length: 512,
            max_predictions_per_seq: 80,
            ..Self::phase1()
        }
    }
}

/// `create_training_instances` after reading: shuffles the documents, makes `dupe_factor`
/// passes, and shuffles the instances, all with CPython's generator seeded with `options.seed`.
pub fn create_instances_google<'a>(
    corpus: &'a Corpus,
    vocab: &VocabIds,
    options: &InstanceOptions,
) -> Instances<'a> {
    create_instances_google_with(corpus, vocab, options, &mut PyRandom::new(options.seed))
}

/// [`create_instances_google`] with a given generator (whose word count then tells how many
/// random words the run drew).
pub fn create_instances_google_with<'a>(
    corpus: &'a Corpus,
    vocab: &VocabIds,
    options: &InstanceOptions,
    rng: &mut PyRandom,
) -> Instances<'a> {
    let documents = ShuffledDocuments::new(corpus, rng);
    let mut columns = InstanceColumns::default();
    let mut scratch = Scratch::default();
    for _ in 0..options.dupe_factor {
        for index in 0..documents.len() {
            instances_from_document(
                &documents,
                index,
                vocab,
                options,
                rng,
                &mut columns,
                &mut scratch,
            );
        }
    }
    let mut instances = Instances::from_chunks(corpus, vocab, vec![columns], Masks::Stored);
    instances.shuffle(rng);
    instances
}

/// The default mode: the same algorithm, with documents processed in parallel. The documents
/// and, at the end, the instances are shuffled by a generator seeded with `options.seed`; every
/// (pass, document) draws from its own [`FastRng`] stream, so the result depends on the seed and
/// not on the thread count. The statistics (mask rate, 80/10/10, random-next share, lengths) are
/// those of the algorithm; the instances are not the reference script's (use
/// [`create_instances_google`] for that). Draws that only need the same distribution are made
/// more cheaply than the script makes them: each instance's masks are drawn when it is read
/// (written), from a generator seeded by its document's stream, so no mask is kept in memory
/// meanwhile; masked positions are drawn directly (or from a lazy shuffle with whole-word
/// masking) instead of shuffling every candidate; truncation draws how many tokens each end
/// loses at once instead of a coin per token.
pub fn create_instances<'a>(
    corpus: &'a Corpus,
    vocab: &'a VocabIds,
    options: &InstanceOptions,
) -> Instances<'a> {
    let mut rng = FastRng::new(options.seed);
    let documents = ShuffledDocuments::new(corpus, &mut rng);
    let jobs: Vec<(usize, usize)> = (0..options.dupe_factor)
        .flat_map(|pass| (0..documents.len()).map(move |doc| (pass, doc)))
        .collect();
    let chunks: Vec<InstanceColumns> = jobs
        .par_iter()
        .map_init(Scratch::default, |scratch, &(pass, doc)| {
            let mut draws = FastRng::for_document(options.seed, pass, doc);
            let mut out = InstanceColumns::for_document(documents.get(doc), options);
            instances_from_document(
                &documents, doc, vocab, options, &mut draws, &mut out, scratch,
            );
            out
        })
        .collect();
    let masks = Masks::Drawn {
        vocab,
        options: options.masking(),
    };
    let mut instances = Instances::from_chunks(corpus, vocab, chunks, masks);
    instances.shuffle(&mut rng);
    instances
}

#[cfg(test)]
mod tests {
    use super::*;
    use bertkit_rng::splitmix64;

    /// `documents` documents of 3 to `2 + max_sentences` sentences of 5 to 40 ids in
    /// 1000..6000 (none of them [CLS] or [SEP]), drawn from `seed`.
    fn random_corpus(seed: u64, documents: usize, max_sentences: u64) -> Corpus {
        let mut x = seed;
        let mut next = |n: u64| {
            x += 1;
            splitmix64(x) % n
        };
        let documents: Vec<Vec<Vec<u32>>> = (0..documents)
            .map(|_| {
                (0..3 + next(max_sentences))
                    .map(|_| {
                        (0..5 + next(36))
                            .map(|_| 1000 + next(5000) as u32)
                            .collect()
                    })
                    .collect()
            })
            .collect();
        Corpus::from_documents(documents)
    }

    /// Special tokens 101 to 103 and words 1000..6000, those from `first_continuation` on
    /// being `##` pieces.
    fn test_vocab(first_continuation: usize) -> VocabIds {
        let mut continuation = vec![false; 6000];
        continuation[first_continuation..].fill(true);
        VocabIds {
            cls: 101,
            sep: 102,
            mask: 103,
            words: (1000..6000).collect(),
            continuation,
            words_are_ids: false,
        }
    }

    #[test]
    fn default_whole_word_masks_take_whole_words() {
        // Ids 1000..5000 start words, 5000..6000 are `##` pieces.
        let corpus = random_corpus(7, 30, 8);
        let vocab = test_vocab(5000);
        let options = InstanceOptions {
            dupe_factor: 2,
            whole_word_mask: true,
            ..InstanceOptions::phase1()
        };
        let instances = create_instances(&corpus, &vocab, &options).to_vec();
        assert!(instances.len() > 50);
        let (mut masked, mut tokens) = (0, 0);
        for i in &instances {
            let mut original = i.input_ids.clone();
            for (&p, &id) in i.masked_lm_positions.iter().zip(&i.masked_lm_ids) {
                original[p as usize] = id;
            }
            // Groups: a candidate (not [CLS]/[SEP]) with the `##` candidates after it.
            let candidates: Vec<usize> = (0..original.len())
                .filter(|&p| original[p] != 101 && original[p] != 102)
                .collect();
            let mut groups: Vec<Vec<usize>> = Vec::new();
            for &p in &candidates {
                match groups.last_mut() {
                    Some(g) if original[p] >= 5000 => g.push(p),
                    _ => groups.push(vec![p]),
                }
            }
            let is_masked = |p: usize| i.masked_lm_positions.contains(&(p as u32));
            for g in &groups {
                let n = g.iter().filter(|&&p| is_masked(p)).count();
                assert!(n == 0 || n == g.len(), "a group partly masked: {g:?}");
            }
            let cap = ((original.len() as f64 * 0.15).round_ties_even() as usize).clamp(1, 20);
            assert!(i.masked_lm_positions.len() <= cap);
            masked += i.masked_lm_positions.len();
            tokens += original.len();
        }
        let rate = masked as f64 / tokens as f64;
        assert!((0.12..0.155).contains(&rate), "mask rate {rate}");
    }

    #[test]
    fn drawn_masks_are_the_same_on_every_read_and_well_formed() {
        let corpus = random_corpus(1, 40, 10);
        let vocab = test_vocab(6000);
        let options = InstanceOptions {
            dupe_factor: 3,
            ..InstanceOptions::phase1()
        };
        let instances = create_instances(&corpus, &vocab, &options);
        let first = instances.to_vec();
        assert_eq!(first, instances.to_vec());
        assert!(first.len() > 100, "{} instances", first.len());
        let mut masked = 0;
        for i in &first {
            let len = i.input_ids.len();
            let expected = ((len as f64 * 0.15).round_ties_even() as usize).clamp(1, 20);
            assert_eq!(i.masked_lm_positions.len(), expected);
            assert!(i.masked_lm_positions.windows(2).all(|w| w[0] < w[1]));
            for (&p, &original) in i.masked_lm_positions.iter().zip(&i.masked_lm_ids) {
                let p = p as usize;
                assert!(p != 0 && p != i.first_segment_len - 1 && p != len - 1);
                assert!((1000..6000).contains(&original));
                let now = i.input_ids[p];
                assert!(now == 103 || (1000..6000).contains(&now));
            }
            masked += expected;
        }
        assert_eq!(
            masked,
            first.iter().map(|i| i.masked_lm_ids.len()).sum::<usize>()
        );
    }
}
