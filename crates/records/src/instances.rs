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

use crate::corpus::{Corpus, DocumentRef};
use crate::draws::Draws;
pub use crate::masking::VocabIds;
use crate::masking::{MaskOptions, MaskScratch, draw_masks, mask_tokens};
use crate::pyrandom::PyRandom;
use bertkit_rng::FastRng;
use bertkit_stage_io::prefetch::prefetch;
use bertkit_tokenizer::FullTokenizer;

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

/// One training instance, as the reference script's `TrainingInstance`, in vocabulary ids
/// (owned; runs keep instances in [`InstanceColumns`] and hand out [`InstanceRef`]s).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainingInstance {
    /// `[CLS] A [SEP] B [SEP]`, after masking.
    pub input_ids: Vec<u32>,
    /// Tokens of segment 0 (`[CLS]`, A and the first `[SEP]`); the rest are segment 1.
    pub first_segment_len: usize,
    /// Whether B came from another document.
    pub is_random_next: bool,
    /// Masked positions, ascending.
    pub masked_lm_positions: Vec<u32>,
    /// The original ids at those positions.
    pub masked_lm_ids: Vec<u32>,
}

impl TrainingInstance {
    /// The instance borrowed as an [`InstanceRef`].
    pub fn as_ref(&self) -> InstanceRef<'_> {
        InstanceRef {
            input_ids: &self.input_ids,
            first_segment_len: self.first_segment_len,
            is_random_next: self.is_random_next,
            masked_lm_positions: &self.masked_lm_positions,
            masked_lm_ids: &self.masked_lm_ids,
        }
    }
}

/// One training instance, borrowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceRef<'a> {
    /// `[CLS] A [SEP] B [SEP]`, after masking.
    pub input_ids: &'a [u32],
    /// Tokens of segment 0 (`[CLS]`, A and the first `[SEP]`); the rest are segment 1.
    pub first_segment_len: usize,
    /// Whether B came from another document.
    pub is_random_next: bool,
    /// Masked positions, ascending.
    pub masked_lm_positions: &'a [u32],
    /// The original ids at those positions.
    pub masked_lm_ids: &'a [u32],
}

impl InstanceRef<'_> {
    /// Segment ids: 0 for the first segment, 1 for the rest.
    pub fn segment_ids(&self) -> Vec<u8> {
        let len = self.input_ids.len();
        let mut ids = vec![0u8; len];
        ids[self.first_segment_len.min(len)..].fill(1);
        ids
    }

    /// An owned copy.
    pub fn to_owned(&self) -> TrainingInstance {
        TrainingInstance {
            input_ids: self.input_ids.to_vec(),
            first_segment_len: self.first_segment_len,
            is_random_next: self.is_random_next,
            masked_lm_positions: self.masked_lm_positions.to_vec(),
            masked_lm_ids: self.masked_lm_ids.to_vec(),
        }
    }

    /// The instance with tokens, in the reference script's JSON fields (`tokens`,
    /// `segment_ids`, `is_random_next`, `masked_lm_positions`, `masked_lm_labels`).
    pub fn to_reference_json(&self, tokenizer: &FullTokenizer) -> serde_json::Value {
        let tokens = |ids: &[u32]| -> Vec<&str> {
            ids.iter()
                .map(|&i| tokenizer.id_to_token(i).unwrap_or("[UNK]"))
                .collect()
        };
        serde_json::json!({
            "tokens": tokens(self.input_ids),
            "segment_ids": self.segment_ids(),
            "is_random_next": self.is_random_next,
            "masked_lm_positions": self.masked_lm_positions,
            "masked_lm_labels": tokens(self.masked_lm_ids),
        })
    }
}

/// Instances stored column by column in flat buffers, without their tokens: segments A and B
/// are ranges of a token source (the corpus). Masks are either stored (what replaces the
/// tokens at the masked positions: 12 bytes per mask) or, in the default mode, drawn when the
/// instance is read, from a seed kept with it. An instance takes 32 bytes (plus its stored
/// masks) instead of 4 per token, and making one copies nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InstanceColumns {
    /// Each instance's fields other than its masks, together: the writer reads instances in
    /// shuffled order, and one cache line per instance is one miss instead of one per field.
    fields: Vec<InstanceMeta>,
    masked_positions: Vec<u32>,
    /// The source's ids at the masked positions.
    masked_ids: Vec<u32>,
    /// The ids the instance holds there (`[MASK]`, the same id, or a random word).
    masked_values: Vec<u32>,
    /// Stored masks that belong to an instance already (the rest are the next one's).
    claimed_masks: usize,
    tokens: usize,
}

/// What [`InstanceColumns`] keeps of an instance: 32 bytes, aligned so that none straddles
/// two cache lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(align(32))]
struct InstanceMeta {
    /// Start and length of segment A, then of segment B, in the token source.
    segments: [u32; 4],
    first_segment_len: u32,
    /// Stored masks: where they start in the mask columns, and how many. Drawn masks: the
    /// seed of the instance's generator, low half first.
    masks: [u32; 2],
    is_random_next: bool,
}

impl InstanceMeta {
    fn stored_masks(&self) -> std::ops::Range<usize> {
        let [start, len] = self.masks.map(|v| v as usize);
        start..start + len
    }

    fn mask_seed(&self) -> u64 {
        u64::from(self.masks[0]) | u64::from(self.masks[1]) << 32
    }
}

/// An instance's fields other than its input ids and masks (see [`Instances::append_row`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowFields {
    /// Tokens of segment 0 (`[CLS]`, A and the first `[SEP]`); the rest are segment 1.
    pub first_segment_len: usize,
    /// Whether B came from another document.
    pub is_random_next: bool,
}

/// Buffers [`Instances::append_row`] reuses from one row to the next.
#[derive(Default)]
pub struct RowScratch {
    mask: MaskScratch,
}

impl InstanceColumns {
    /// Empty columns with room for the instances one pass over `document` makes (with masks
    /// drawn when read), so that the buffer rarely grows (growing a large buffer copies it
    /// into freshly faulted pages). Pages of room that stays unused are never touched.
    fn for_document(document: DocumentRef<'_>, options: &InstanceOptions) -> Self {
        let target = (options.max_seq_length.saturating_sub(3)).max(1);
        InstanceColumns {
            fields: Vec::with_capacity(document.tokens() / target + 2),
            ..InstanceColumns::default()
        }
    }

    /// Instances held.
    pub fn len(&self) -> usize {
        self.fields.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }

    /// Adds an instance: with the masks appended since the last one (`mask_seed` `None`), or
    /// with masks to be drawn from `mask_seed` when it is read.
    fn end_instance(
        &mut self,
        segments: [std::ops::Range<usize>; 2],
        first_segment_len: usize,
        is_random_next: bool,
        tokens: usize,
        mask_seed: Option<u64>,
    ) {
        let [a, b] = segments;
        let masks = match mask_seed {
            Some(seed) => [seed as u32, (seed >> 32) as u32],
            None => {
                let start = self.claimed_masks;
                self.claimed_masks = self.masked_positions.len();
                [start as u32, (self.claimed_masks - start) as u32]
            }
        };
        self.fields.push(InstanceMeta {
            segments: [a.start, a.len(), b.start, b.len()].map(|v| v as u32),
            first_segment_len: first_segment_len as u32,
            masks,
            is_random_next,
        });
        self.tokens += tokens;
    }
}

/// A run's instances: generated in chunks (one per document and pass in the parallel mode),
/// listed in their final, shuffled order, with the token source their segments point into.
#[derive(Debug, Clone)]
pub struct Instances<'a> {
    source: std::borrow::Cow<'a, [u32]>,
    /// `[CLS]` and `[SEP]` around the segments (`[CLS] A [SEP] B [SEP]`), or nothing (owned
    /// instances, whose segment A is the whole sequence).
    framing: Option<(u32, u32)>,
    chunks: Vec<InstanceColumns>,
    /// (chunk, index in chunk) of each instance, in order.
    order: Vec<(u32, u32)>,
    masks: Masks<'a>,
}

/// Where an [`Instances`]' masks come from.
#[derive(Debug, Clone)]
enum Masks<'a> {
    /// Stored in the chunks.
    Stored,
    /// Drawn when an instance is read, by a [`FastRng`] seeded with its seed: the same masks
    /// each time, and none kept in memory meanwhile.
    Drawn {
        vocab: &'a VocabIds,
        options: MaskOptions,
    },
}

impl<'a> Instances<'a> {
    /// Chunks' instances in chunk order (not shuffled), with segments in `corpus` framed by
    /// `[CLS]` and `[SEP]`, and `masks` stored or drawn.
    fn from_chunks(
        corpus: &'a Corpus,
        vocab: &VocabIds,
        chunks: Vec<InstanceColumns>,
        masks: Masks<'a>,
    ) -> Self {
        let order = chunks
            .iter()
            .enumerate()
            .flat_map(|(c, chunk)| (0..chunk.len() as u32).map(move |i| (c as u32, i)))
            .collect();
        Instances {
            source: std::borrow::Cow::Borrowed(corpus.ids()),
            framing: Some((vocab.cls, vocab.sep)),
            chunks,
            order,
            masks,
        }
    }

    /// Owned instances, in order.
    pub fn from_owned(instances: &[TrainingInstance]) -> Instances<'static> {
        let mut source = Vec::new();
        let mut columns = InstanceColumns::default();
        for instance in instances {
            let start = source.len();
            source.extend_from_slice(&instance.input_ids);
            columns
                .masked_positions
                .extend(&instance.masked_lm_positions);
            columns.masked_ids.extend(&instance.masked_lm_ids);
            // The input ids are the masked ones already: the values are what they hold.
            columns.masked_values.extend(
                instance
                    .masked_lm_positions
                    .iter()
                    .map(|&p| instance.input_ids[p as usize]),
            );
            columns.end_instance(
                [start..source.len(), source.len()..source.len()],
                instance.first_segment_len,
                instance.is_random_next,
                instance.input_ids.len(),
                None,
            );
        }
        Instances {
            source: std::borrow::Cow::Owned(source),
            framing: None,
            order: (0..columns.len() as u32).map(|i| (0, i)).collect(),
            chunks: vec![columns],
            masks: Masks::Stored,
        }
    }

    /// Instances held.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Tokens in all instances.
    pub fn tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.tokens).sum()
    }

    /// Appends instance `k` (in order): its input ids to `ids`, its masked positions
    /// (ascending) to `masked_positions` and the original ids there to `masked_ids`; returns
    /// its other fields.
    #[inline]
    pub fn append_row(
        &self,
        k: usize,
        ids: &mut Vec<u32>,
        masked_positions: &mut Vec<u32>,
        masked_ids: &mut Vec<u32>,
        scratch: &mut RowScratch,
    ) -> RowFields {
        let (c, i) = self.order[k];
        let chunk = &self.chunks[c as usize];
        let meta = chunk.fields[i as usize];
        let [a_start, a_len, b_start, b_len] = meta.segments.map(|v| v as usize);
        let start = ids.len();
        if let Some((cls, _)) = self.framing {
            ids.push(cls);
        }
        ids.extend_from_slice(&self.source[a_start..a_start + a_len]);
        if let Some((_, sep)) = self.framing {
            ids.push(sep);
        }
        ids.extend_from_slice(&self.source[b_start..b_start + b_len]);
        if let Some((_, sep)) = self.framing {
            ids.push(sep);
        }
        match &self.masks {
            Masks::Stored => {
                let masks = meta.stored_masks();
                let positions = &chunk.masked_positions[masks.clone()];
                for (&p, &value) in positions.iter().zip(&chunk.masked_values[masks.clone()]) {
                    ids[start + p as usize] = value;
                }
                masked_positions.extend_from_slice(positions);
                masked_ids.extend_from_slice(&chunk.masked_ids[masks]);
            }
            Masks::Drawn { vocab, options } => draw_masks(
                &mut ids[start..],
                options,
                vocab,
                meta.mask_seed(),
                &mut scratch.mask,
                masked_positions,
                masked_ids,
            ),
        }
        RowFields {
            first_segment_len: meta.first_segment_len as usize,
            is_random_next: meta.is_random_next,
        }
    }

    /// Hints the CPU to fetch instance `k`'s fields (ahead of [`Instances::prefetch_data`]).
    #[inline]
    pub fn prefetch_fields(&self, k: usize) {
        let (c, i) = self.order[k];
        let fields = &self.chunks[c as usize].fields;
        prefetch(&fields[i as usize..i as usize + 1]);
    }

    /// Hints the CPU to fetch the tokens and stored masks [`Instances::append_row`] will read
    /// for instance `k` (reading its fields: fetch those first).
    #[inline]
    pub fn prefetch_data(&self, k: usize) {
        let (c, i) = self.order[k];
        let chunk = &self.chunks[c as usize];
        let meta = &chunk.fields[i as usize];
        let [a_start, a_len, b_start, b_len] = meta.segments.map(|v| v as usize);
        prefetch(&self.source[a_start..a_start + a_len]);
        prefetch(&self.source[b_start..b_start + b_len]);
        if let Masks::Stored = self.masks {
            let masks = meta.stored_masks();
            prefetch(&chunk.masked_positions[masks.clone()]);
            prefetch(&chunk.masked_values[masks.clone()]);
            prefetch(&chunk.masked_ids[masks]);
        }
    }

    /// Calls `f` with each instance, in order.
    pub fn for_each(&self, mut f: impl FnMut(InstanceRef<'_>)) {
        let (mut ids, mut positions, mut masked_ids) = (Vec::new(), Vec::new(), Vec::new());
        let mut scratch = RowScratch::default();
        for k in 0..self.len() {
            ids.clear();
            positions.clear();
            masked_ids.clear();
            let fields =
                self.append_row(k, &mut ids, &mut positions, &mut masked_ids, &mut scratch);
            f(InstanceRef {
                input_ids: &ids,
                first_segment_len: fields.first_segment_len,
                is_random_next: fields.is_random_next,
                masked_lm_positions: &positions,
                masked_lm_ids: &masked_ids,
            });
        }
    }

    /// Every instance, owned, in order.
    pub fn to_vec(&self) -> Vec<TrainingInstance> {
        let mut all = Vec::with_capacity(self.len());
        self.for_each(|instance| all.push(instance.to_owned()));
        all
    }

    /// Shuffles the order with `rng` (the draws of shuffling a list of this length).
    fn shuffle<R: Draws>(&mut self, rng: &mut R) {
        rng.shuffle(&mut self.order);
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

/// Buffers reused from one instance to the next.
#[derive(Default)]
struct Scratch {
    /// The instance being masked: `[CLS] A [SEP] B [SEP]`.
    ids: Vec<u32>,
    mask: MaskScratch,
}

/// A corpus's documents in a shuffled order.
struct ShuffledDocuments<'a> {
    corpus: &'a Corpus,
    order: Vec<u32>,
}

impl<'a> ShuffledDocuments<'a> {
    /// Shuffling the order draws what shuffling the script's list of documents draws.
    fn new<R: Draws>(corpus: &'a Corpus, rng: &mut R) -> Self {
        let mut order: Vec<u32> = (0..corpus.len() as u32).collect();
        rng.shuffle(&mut order);
        ShuffledDocuments { corpus, order }
    }

    fn len(&self) -> usize {
        self.order.len()
    }

    fn get(&self, index: usize) -> DocumentRef<'a> {
        self.corpus.document(self.order[index] as usize)
    }
}

/// The instances of document `document_index` (one pass), appended to `out`.
fn instances_from_document<R: Draws>(
    documents: &ShuffledDocuments<'_>,
    document_index: usize,
    vocab: &VocabIds,
    options: &InstanceOptions,
    rng: &mut R,
    out: &mut InstanceColumns,
    scratch: &mut Scratch,
) {
    let source = documents.corpus.ids();
    let document = documents.get(document_index);
    let max_num_tokens = options.max_seq_length - 3;
    let mut target_seq_length = max_num_tokens;
    if rng.random() < options.short_seq_prob {
        target_seq_length = rng.randint(2, max_num_tokens);
    }
    // The current chunk: sentences `chunk_start..chunk_start + chunk_len` of the document.
    // Sentences are contiguous in the corpus, so segments A and B are token ranges of it.
    let mut chunk_start = 0;
    let mut chunk_len = 0;
    let mut length = 0;
    let mut i = 0usize;
    while i < document.len() {
        if chunk_len == 0 {
            chunk_start = i;
        }
        chunk_len += 1;
        length += document.sentence_range(i).len();
        if i == document.len() - 1 || length >= target_seq_length {
            let a_end = if chunk_len >= 2 {
                rng.randint(1, chunk_len - 1)
            } else {
                1
            };
            let a_range = document.sentences_range(chunk_start, chunk_start + a_end);
            let is_random_next = chunk_len == 1 || rng.random() < 0.5;
            let b_range = if is_random_next {
                let target_b_length = target_seq_length.saturating_sub(a_range.len());
                let mut random_index = document_index;
                for _ in 0..10 {
                    random_index = rng.randint(0, documents.len() - 1);
                    if random_index != document_index {
                        break;
                    }
                }
                let random_document = documents.get(random_index);
                let start = rng.randint(0, random_document.len() - 1);
                let mut end = start;
                let mut b_len = 0;
                while end < random_document.len() {
                    b_len += random_document.sentence_range(end).len();
                    end += 1;
                    if b_len >= target_b_length {
                        break;
                    }
                }
                // Put the unused segments back.
                i -= chunk_len - a_end;
                random_document.sentences_range(start, end)
            } else {
                document.sentences_range(chunk_start + a_end, chunk_start + chunk_len)
            };
            let (a, b) = truncate_seq_pair(a_range.len(), b_range.len(), max_num_tokens, rng);
            let a = a_range.start + a.start..a_range.start + a.end;
            let b = b_range.start + b.start..b_range.start + b.end;
            let first_segment_len = a.len() + 2;
            let len = a.len() + b.len() + 3;
            let mask_seed = if R::REPLAYS_SCRIPT {
                // The script masks here, between this pair's draws and the next one's.
                let ids = &mut scratch.ids;
                ids.clear();
                ids.push(vocab.cls);
                ids.extend_from_slice(&source[a.clone()]);
                ids.push(vocab.sep);
                ids.extend_from_slice(&source[b.clone()]);
                ids.push(vocab.sep);
                let first_mask = out.masked_positions.len();
                mask_tokens(
                    ids,
                    &options.masking(),
                    vocab,
                    rng,
                    &mut scratch.mask,
                    &mut out.masked_positions,
                    &mut out.masked_ids,
                );
                out.masked_values.extend(
                    out.masked_positions[first_mask..]
                        .iter()
                        .map(|&p| ids[p as usize]),
                );
                None
            } else {
                Some(rng.seed())
            };
            out.end_instance([a, b], first_segment_len, is_random_next, len, mask_seed);
            chunk_len = 0;
            length = 0;
        }
        i += 1;
    }
}

/// Truncates the longer list (B on a tie) at a random end, one token at a time; returns the
/// ranges of A and B that are left. Unless the script's draws are replayed, how many tokens
/// each list loses is worked out first and the number taken from its front drawn at once (the
/// count of heads in as many coins): the same distribution.
fn truncate_seq_pair<R: Draws>(
    a_len: usize,
    b_len: usize,
    max_num_tokens: usize,
    rng: &mut R,
) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    let (mut a, mut b) = (0..a_len, 0..b_len);
    if !R::REPLAYS_SCRIPT {
        let (a_lost, b_lost) = truncated_tokens(a_len, b_len, max_num_tokens);
        let a_front = rng.heads(a_lost);
        let b_front = rng.heads(b_lost);
        return (
            a_front..a_len - (a_lost - a_front),
            b_front..b_len - (b_lost - b_front),
        );
    }
    while a.len() + b.len() > max_num_tokens {
        let longer = if a.len() > b.len() { &mut a } else { &mut b };
        if rng.coin() {
            longer.start += 1;
        } else {
            longer.end -= 1;
        }
    }
    (a, b)
}

/// How many tokens [`truncate_seq_pair`] takes from A and from B: from the longer one until
/// both are as long (B on a tie), then from B and A in turn.
fn truncated_tokens(a_len: usize, b_len: usize, max_num_tokens: usize) -> (usize, usize) {
    let excess = (a_len + b_len).saturating_sub(max_num_tokens);
    let a_first = excess.min(a_len.saturating_sub(b_len));
    let b_first = excess.min(b_len.saturating_sub(a_len));
    let in_turn = excess - a_first - b_first;
    (a_first + in_turn / 2, b_first + in_turn.div_ceil(2))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bertkit_rng::splitmix64;

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
            let (a, b) = truncate_seq_pair(3, 200, 103, &mut rng);
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
