//! Masked-LM / next-sentence pre-training instances, Google's `create_pretraining_data.py`
//! algorithm, in its compatible form: the same input, vocabulary and seed give the reference
//! script's instances, one for one and in the same order. It uses CPython's generator
//! ([`PyRandom`]) and makes the script's random calls in the script's order. The reference data's
//! `REFERENCE.md` lists that order and its traps: `randint(1, 1)` still draws, the
//! short-circuited `random()` for one-segment chunks, round-half-to-even for the number of
//! predictions, a tie in `truncate_seq_pair` truncating B, and whole-word groups that cross
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

use serde::{Deserialize, Serialize};

use rayon::prelude::*;

use crate::draws::{Draws, FastRng};
use crate::pyrandom::PyRandom;
use crate::tokenizer::FullTokenizer;

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

impl InstanceOptions {
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

    /// Phase 2: sequences of 512, 80 predictions.
    pub fn phase2() -> Self {
        InstanceOptions {
            max_seq_length: 512,
            max_predictions_per_seq: 80,
            ..Self::phase1()
        }
    }
}

/// One training instance, as the reference script's `TrainingInstance`, in vocabulary ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainingInstance {
    /// `[CLS] A [SEP] B [SEP]`, after masking.
    pub input_ids: Vec<u32>,
    /// 0 for `[CLS]`, A and the first `[SEP]`; 1 for B and the last `[SEP]`.
    pub segment_ids: Vec<u8>,
    /// Whether B came from another document.
    pub is_random_next: bool,
    /// Masked positions, ascending.
    pub masked_lm_positions: Vec<usize>,
    /// The original ids at those positions.
    pub masked_lm_ids: Vec<u32>,
}

impl TrainingInstance {
    /// The instance with tokens, in the reference script's JSON fields (`tokens`,
    /// `segment_ids`, `is_random_next`, `masked_lm_positions`, `masked_lm_labels`).
    pub fn to_reference_json(&self, tokenizer: &FullTokenizer) -> serde_json::Value {
        let tokens = |ids: &[u32]| -> Vec<&str> {
            ids.iter()
                .map(|&i| tokenizer.id_to_token(i).unwrap_or("[UNK]"))
                .collect()
        };
        serde_json::json!({
            "tokens": tokens(&self.input_ids),
            "segment_ids": self.segment_ids,
            "is_random_next": self.is_random_next,
            "masked_lm_positions": self.masked_lm_positions,
            "masked_lm_labels": tokens(&self.masked_lm_ids),
        })
    }
}

/// A document: its sentences as vocabulary ids.
pub type Document = Vec<Vec<u32>>;

/// What instance generation needs to know of the vocabulary.
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
            words,
            continuation,
        })
    }
}

/// `create_training_instances` after reading: shuffles the documents, makes `dupe_factor`
/// passes, and shuffles the instances, all with CPython's generator seeded with `options.seed`.
pub fn create_instances_google(
    documents: Vec<Document>,
    vocab: &VocabIds,
    options: &InstanceOptions,
) -> Vec<TrainingInstance> {
    create_instances_google_with(documents, vocab, options, &mut PyRandom::new(options.seed))
}

/// [`create_instances_google`] with a given generator (whose word count then tells how many
/// random words the run drew).
pub fn create_instances_google_with(
    mut documents: Vec<Document>,
    vocab: &VocabIds,
    options: &InstanceOptions,
    rng: &mut PyRandom,
) -> Vec<TrainingInstance> {
    rng.shuffle(&mut documents);
    let mut instances = Vec::new();
    for _ in 0..options.dupe_factor {
        for index in 0..documents.len() {
            instances_from_document(&documents, index, vocab, options, rng, &mut instances);
        }
    }
    rng.shuffle(&mut instances);
    instances
}

/// The default mode: the same algorithm, with documents processed in parallel. The documents
/// and, at the end, the instances are shuffled by a generator seeded with `options.seed`; every
/// (pass, document) draws from its own [`FastRng`] stream, so the result depends on the seed and
/// not on the thread count. The statistics (mask rate, 80/10/10, random-next share, lengths) are
/// those of the algorithm; the instances are not the reference script's (use
/// [`create_instances_google`] for that).
pub fn create_instances(
    mut documents: Vec<Document>,
    vocab: &VocabIds,
    options: &InstanceOptions,
) -> Vec<TrainingInstance> {
    let mut rng = FastRng::new(options.seed);
    rng.shuffle(&mut documents);
    let jobs: Vec<(usize, usize)> = (0..options.dupe_factor)
        .flat_map(|pass| (0..documents.len()).map(move |doc| (pass, doc)))
        .collect();
    let per_document: Vec<Vec<TrainingInstance>> = jobs
        .par_iter()
        .map(|&(pass, doc)| {
            let mut draws = FastRng::for_document(options.seed, pass, doc);
            let mut out = Vec::new();
            instances_from_document(&documents, doc, vocab, options, &mut draws, &mut out);
            out
        })
        .collect();
    let mut instances: Vec<TrainingInstance> = per_document.into_iter().flatten().collect();
    rng.shuffle(&mut instances);
    instances
}

fn instances_from_document<R: Draws>(
    documents: &[Document],
    document_index: usize,
    vocab: &VocabIds,
    options: &InstanceOptions,
    rng: &mut R,
    out: &mut Vec<TrainingInstance>,
) {
    let document = &documents[document_index];
    let max_num_tokens = options.max_seq_length - 3;
    let mut target_seq_length = max_num_tokens;
    if rng.random() < options.short_seq_prob {
        target_seq_length = rng.randint(2, max_num_tokens);
    }
    let mut chunk: Vec<&Vec<u32>> = Vec::new();
    let mut length = 0;
    let mut i = 0usize;
    while i < document.len() {
        let segment = &document[i];
        chunk.push(segment);
        length += segment.len();
        if i == document.len() - 1 || length >= target_seq_length {
            if !chunk.is_empty() {
                let a_end = if chunk.len() >= 2 {
                    rng.randint(1, chunk.len() - 1)
                } else {
                    1
                };
                let mut tokens_a: Vec<u32> = chunk[..a_end]
                    .iter()
                    .flat_map(|s| s.iter().copied())
                    .collect();
                let mut tokens_b: Vec<u32> = Vec::new();
                let is_random_next = chunk.len() == 1 || rng.random() < 0.5;
                if is_random_next {
                    let target_b_length = target_seq_length.saturating_sub(tokens_a.len());
                    let mut random_index = document_index;
                    for _ in 0..10 {
                        random_index = rng.randint(0, documents.len() - 1);
                        if random_index != document_index {
                            break;
                        }
                    }
                    let random_document = &documents[random_index];
                    let start = rng.randint(0, random_document.len() - 1);
                    for segment in &random_document[start..] {
                        tokens_b.extend_from_slice(segment);
                        if tokens_b.len() >= target_b_length {
                            break;
                        }
                    }
                    // Put the unused segments back.
                    i -= chunk.len() - a_end;
                } else {
                    tokens_b.extend(chunk[a_end..].iter().flat_map(|s| s.iter().copied()));
                }
                truncate_seq_pair(&mut tokens_a, &mut tokens_b, max_num_tokens, rng);
                let mut input_ids = Vec::with_capacity(tokens_a.len() + tokens_b.len() + 3);
                input_ids.push(vocab.cls);
                input_ids.extend_from_slice(&tokens_a);
                input_ids.push(vocab.sep);
                let mut segment_ids = vec![0u8; input_ids.len()];
                input_ids.extend_from_slice(&tokens_b);
                input_ids.push(vocab.sep);
                segment_ids.resize(input_ids.len(), 1);
                let (masked_lm_positions, masked_lm_ids) =
                    mask_tokens(&mut input_ids, options, vocab, rng);
                out.push(TrainingInstance {
                    input_ids,
                    segment_ids,
                    is_random_next,
                    masked_lm_positions,
                    masked_lm_ids,
                });
            }
            chunk.clear();
            length = 0;
        }
        i += 1;
    }
}

/// Truncates the longer list (B on a tie) at a random end, one token at a time.
fn truncate_seq_pair<R: Draws>(
    a: &mut Vec<u32>,
    b: &mut Vec<u32>,
    max_num_tokens: usize,
    rng: &mut R,
) {
    while a.len() + b.len() > max_num_tokens {
        let longer = if a.len() > b.len() { &mut *a } else { &mut *b };
        if rng.random() < 0.5 {
            longer.remove(0);
        } else {
            longer.pop();
        }
    }
}

/// `create_masked_lm_predictions`, in place: returns the masked positions (ascending) and the
/// original ids there.
fn mask_tokens<R: Draws>(
    ids: &mut [u32],
    options: &InstanceOptions,
    vocab: &VocabIds,
    rng: &mut R,
) -> (Vec<usize>, Vec<u32>) {
    // Candidate groups as (start, length) runs of `positions`: one position each, or whole
    // words with whole-word masking. Shuffling the groups draws exactly what shuffling the
    // script's list of lists draws.
    let mut positions: Vec<usize> = Vec::with_capacity(ids.len());
    let mut candidates: Vec<(u32, u32)> = Vec::with_capacity(ids.len());
    for (i, &id) in ids.iter().enumerate() {
        if id == vocab.cls || id == vocab.sep {
            continue;
        }
        let continuation = vocab
            .continuation
            .get(id as usize)
            .copied()
            .unwrap_or(false);
        positions.push(i);
        match candidates.last_mut() {
            Some(last) if options.whole_word_mask && continuation => last.1 += 1,
            _ => candidates.push(((positions.len() - 1) as u32, 1)),
        }
    }
    rng.shuffle(&mut candidates);
    let num_to_predict = options
        .max_predictions_per_seq
        .min(1.max((ids.len() as f64 * options.masked_lm_prob).round_ties_even() as usize));
    let mut masked: Vec<(usize, u32)> = Vec::new();
    for &(start, len) in &candidates {
        if masked.len() >= num_to_predict {
            break;
        }
        if masked.len() + len as usize > num_to_predict {
            continue;
        }
        // Groups are disjoint, so none is ever already covered.
        for &index in &positions[start as usize..(start + len) as usize] {
            let original = ids[index];
            ids[index] = if rng.random() < 0.8 {
                vocab.mask
            } else if rng.random() < 0.5 {
                original
            } else {
                vocab.words[rng.randint(0, vocab.words.len() - 1)]
            };
            masked.push((index, original));
        }
    }
    masked.sort_unstable_by_key(|m| m.0);
    masked.into_iter().unzip()
}
