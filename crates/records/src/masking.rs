//! Masked-LM masking: which positions of a sequence a model must predict, and what it sees
//! there (80% `[MASK]`, 10% a random word, 10% unchanged), as `create_masked_lm_predictions`
//! chooses them. The one implementation of masking: the records stage masks with it when it
//! writes instances, and the trainer's dynamic masking re-masks with it at load time.
//!
//! - [`VocabIds`]: what masking needs to know of the vocabulary (`[CLS]`, `[SEP]`, `[MASK]`,
//!   the words a random replacement is drawn from, which tokens continue a word);
//! - [`MaskOptions`]: the share of positions, the cap per sequence, whole-word masking;
//! - [`draw_masks`]: one sequence's masks from a seed, the default mode's draws (a uniformly
//!   random set of positions, drawn directly); the Google-compatible mode replays the script's
//!   draws through the same code with CPython's generator.

use bertkit_rng::FastRng;
use serde::{Deserialize, Serialize};

use crate::draws::{Draws, PositionScratch};
use bertkit_tokenizer::FullTokenizer;

/// How many positions are masked, and which may be.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MaskOptions {
    /// Share of a sequence's tokens to predict (rounded half to even, at least one).
    pub prob: f64,
    /// At most this many per sequence.
    pub max_predictions: usize,
    /// Mask whole words (a `##` piece joins the previous candidate).
    pub whole_word: bool,
}

/// Draws the masks of `ids` (a `[CLS] A [SEP] B [SEP]` sequence, unmasked) from `seed`, in
/// place: appends the masked positions (ascending) to `positions` and the original ids there
/// to `labels`. The same seed gives the same masks.
pub fn draw_masks(
    ids: &mut [u32],
    options: &MaskOptions,
    vocab: &VocabIds,
    seed: u64,
    scratch: &mut MaskScratch,
    positions: &mut Vec<u32>,
    labels: &mut Vec<u32>,
) {
    mask_tokens(
        ids,
        options,
        vocab,
        &mut FastRng::new(seed),
        scratch,
        positions,
        labels,
    );
}

/// What masking (and instance generation) needs to know of the vocabulary.
#[derive(Debug, Clone)]
pub struct VocabIds {
    /// `[CLS]`.
    pub cls: u32,
    /// `[SEP]`.
    pub sep: u32,
    /// `[MASK]`.
    pub mask: u32,
    /// The reference script's `vocab_words` (distinct tokens in file order) as ids.
    pub words: Vec<u32>,
    /// Whether each id's token starts with `##`.
    pub continuation: Vec<bool>,
    /// Whether `words[k]` is `k` (a vocabulary without repeated tokens): then a random word is
    /// its index, without a look-up at a random place of `words` (a cache miss, once per
    /// random-word mask).
    pub(crate) words_are_ids: bool,
}

impl VocabIds {
    /// From a tokenizer's vocabulary; `None` if `[CLS]`, `[SEP]` or `[MASK]` is missing.
    pub fn new(tokenizer: &FullTokenizer) -> Option<Self> {
        let words = tokenizer.vocab_word_ids();
        let continuation = (0..tokenizer.vocab_size() as u32)
            .map(|i| {
                tokenizer
                    .id_to_token(i)
                    .is_some_and(|t| t.starts_with("##"))
            })
            .collect();
        Some(VocabIds {
            cls: tokenizer.token_to_id("[CLS]")?,
            sep: tokenizer.token_to_id("[SEP]")?,
            mask: tokenizer.token_to_id("[MASK]")?,
            words_are_ids: words.iter().enumerate().all(|(k, &w)| w as usize == k),
            words,
            continuation,
        })
    }

    /// Tokens in the vocabulary (ids are below this).
    pub fn size(&self) -> usize {
        self.continuation.len()
    }

    /// `vocab_words[k]`.
    #[inline]
    fn word(&self, k: usize) -> u32 {
        if self.words_are_ids {
            k as u32
        } else {
            self.words[k]
        }
    }
}

/// Buffers masking reuses from one sequence to the next.
#[derive(Debug, Default)]
pub struct MaskScratch {
    positions: Vec<u32>,
    candidates: Vec<(u32, u32)>,
    single: PositionScratch,
    masked_bits: Vec<u64>,
    originals: Vec<u32>,
}

/// The positions of `ids` that may be masked: all but `[CLS]` and `[SEP]`.
fn list_candidates(ids: &[u32], positions: &mut Vec<u32>, is_special: &impl Fn(u32) -> bool) {
    positions.clear();
    positions.extend((0..ids.len() as u32).filter(|&i| !is_special(ids[i as usize])));
}

/// `create_masked_lm_predictions`, in place: appends the masked positions (ascending) and the
/// original ids there.
pub(crate) fn mask_tokens<R: Draws>(
    ids: &mut [u32],
    options: &MaskOptions,
    vocab: &VocabIds,
    rng: &mut R,
    scratch: &mut MaskScratch,
    masked_positions: &mut Vec<u32>,
    masked_ids: &mut Vec<u32>,
) {
    let MaskScratch {
        positions,
        candidates,
        single,
        masked_bits,
        originals,
    } = scratch;
    let num_to_predict = options
        .max_predictions
        .min(1.max((ids.len() as f64 * options.prob).round_ties_even() as usize));
    // Which positions are masked (a bit each, read back in ascending order: no sort), and the
    // original ids there.
    masked_bits.clear();
    masked_bits.resize(ids.len().div_ceil(64), 0);
    originals.resize(ids.len(), 0);
    let mut masked = 0;
    let mask =
        |rng: &mut R, ids: &mut [u32], bits: &mut [u64], originals: &mut [u32], index: u32| {
            let index = index as usize;
            originals[index] = ids[index];
            ids[index] = if rng.random() < 0.8 {
                vocab.mask
            } else if rng.random() < 0.5 {
                ids[index]
            } else {
                vocab.word(rng.randint(0, vocab.words.len() - 1))
            };
            bits[index / 64] |= 1 << (index % 64);
        };
    let is_special = |id: u32| id == vocab.cls || id == vocab.sep;
    let candidate_count = ids.len() - ids.iter().filter(|&&id| is_special(id)).count();
    if options.whole_word {
        // Candidate groups as (start, length) runs of `positions`: a `##` piece joins the
        // group before it. Shuffling the groups draws what shuffling the script's list of
        // lists draws.
        list_candidates(ids, positions, &is_special);
        candidates.clear();
        for (k, &i) in positions.iter().enumerate() {
            let continuation = vocab
                .continuation
                .get(ids[i as usize] as usize)
                .copied()
                .unwrap_or(false);
            match candidates.last_mut() {
                Some(last) if continuation => last.1 += 1,
                _ => candidates.push((k as u32, 1)),
            }
        }
        rng.visit_shuffled(candidates, |rng, (start, len)| {
            if masked >= num_to_predict {
                return false;
            }
            if masked + len as usize > num_to_predict {
                return true;
            }
            // Groups are disjoint, so none is ever already covered.
            for &index in &positions[start as usize..(start + len) as usize] {
                mask(rng, ids, masked_bits, originals, index);
                masked += 1;
            }
            true
        });
    } else {
        // Every position is a group of its own.
        rng.visit_positions(
            ids,
            |id| !is_special(id),
            candidate_count,
            num_to_predict,
            single,
            |rng, ids, index| mask(rng, ids, masked_bits, originals, index),
        );
    }
    for (word_index, &word) in masked_bits.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            let position = word_index * 64 + bits.trailing_zeros() as usize;
            masked_positions.push(position as u32);
            masked_ids.push(originals[position]);
            bits &= bits - 1;
        }
    }
}
