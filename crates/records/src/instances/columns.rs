//! Instances in columns: what a run keeps of each instance (32 bytes, no tokens), the order
//! they are written in, and reading one back as a row (with its masks, stored or drawn).

use crate::corpus::{Corpus, DocumentRef};
use crate::draws::Draws;
use crate::masking::{MaskOptions, MaskScratch, VocabIds, draw_masks, mask_tokens};
use bertkit_stage_io::prefetch::prefetch;

use super::InstanceOptions;
use super::instance::{InstanceRef, TrainingInstance};

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
    pub(super) fn stored_masks(&self) -> std::ops::Range<usize> {
        let [start, len] = self.masks.map(|v| v as usize);
        start..start + len
    }

    pub(super) fn mask_seed(&self) -> u64 {
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
    /// Masks the next instance's `ids` now (the script's order) and stores the masks: the
    /// positions, the original ids there, and what replaces them.
    pub(super) fn mask_and_store<R: Draws>(
        &mut self,
        ids: &mut [u32],
        options: &MaskOptions,
        vocab: &VocabIds,
        rng: &mut R,
        scratch: &mut MaskScratch,
    ) {
        let first_mask = self.masked_positions.len();
        mask_tokens(
            ids,
            options,
            vocab,
            rng,
            scratch,
            &mut self.masked_positions,
            &mut self.masked_ids,
        );
        self.masked_values.extend(
            self.masked_positions[first_mask..]
                .iter()
                .map(|&p| ids[p as usize]),
        );
    }

    /// Empty columns with room for the instances one pass over `document` makes (with masks
    /// drawn when read), so that the buffer rarely grows (growing a large buffer copies it
    /// into freshly faulted pages). Pages of room that stays unused are never touched.
    pub(super) fn for_document(document: DocumentRef<'_>, options: &InstanceOptions) -> Self {
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
    pub(super) fn end_instance(
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
pub(super) enum Masks<'a> {
    /// Stored in the chunks.
    Stored,
    /// Drawn when an instance is read, by a [`FastRng`](bertkit_rng::FastRng) seeded with its
    /// seed: the same masks each time, and none kept in memory meanwhile.
    Drawn {
        vocab: &'a VocabIds,
        options: MaskOptions,
    },
}

impl<'a> Instances<'a> {
    /// Chunks' instances in chunk order (not shuffled), with segments in `corpus` framed by
    /// `[CLS]` and `[SEP]`, and `masks` stored or drawn.
    pub(super) fn from_chunks(
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
    pub(super) fn shuffle<R: Draws>(&mut self, rng: &mut R) {
        rng.shuffle(&mut self.order);
    }
}
