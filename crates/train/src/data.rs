//! Pre-training batches from the records stage's Parquet files.
//!
//! - **Units**: every row group of every file is a unit (2048 instances). Files are read
//!   through memory maps ([`bertkit_records::reader`]), a row group at a time.
//! - **Order**: each epoch shuffles the units with the seed and the epoch number, and the rows
//!   of each unit with the seed, epoch and unit; the epoch's sequences are the units' rows in
//!   that order, whatever the number of ranks.
//! - **Steps**: optimiser step `k` of an epoch takes the `global_batch` sequences from
//!   `k × global_batch` on. Rank `r` of `w` takes the `r`-th of `w` equal consecutive parts of
//!   them and cuts its part into `micro_batch` consecutive sequences at a time. So every
//!   factorisation of the global batch into ranks × accumulation × micro-batch trains on the
//!   same sequences at each step, and with the same micro-batch size on the same micro-batches
//!   (two ranks with one micro-batch each are one process with two). An epoch ends after the
//!   last whole global batch.
//! - **Batches**: `micro_batch` sequences, padded to the longest sequence of the batch
//!   rounded up to `pad_multiple` (8 suits tensor cores; a larger multiple, such as 64 for phase
//!   2, gives a few fixed shapes, like length bins); masked-LM slots padded to
//!   `max_predictions` with weight 0. Each batch knows its first sequence's place in its step
//!   ([`Batch::step_offset`]), which keys its dropout masks.
//! - **Cursor**: `(epoch, sequences of the epoch consumed)`, at a step boundary, fixes the next
//!   step exactly for any number of ranks, so a checkpoint stores it and a run resumed on
//!   another number of processes continues with the next unseen step.
//! - **Prefetch**: [`BatchStream`] decodes and pads on a background thread, a few batches ahead.
//!
//! Host memory holds one decoded unit, the micro-batch being built and the prefetch queue.

use std::path::{Path, PathBuf};
use std::sync::mpsc;

use bertkit_records::masking::{MaskOptions, MaskScratch, VocabIds, draw_masks};
use bertkit_records::reader::{Record, RecordsFile};
use bertkit_rng::{shuffle, splitmix64 as splitmix};
use bertkit_stage_io::Ranks;
use bertkit_tokenizer::folder::TokenizerFiles;
use serde::{Deserialize, Serialize};

use crate::TrainError;

/// Where the data stands: the next optimiser step starts at sequence `sequence` of epoch
/// `epoch`'s order (a multiple of the global batch; the same on every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Cursor {
    /// Epoch (pass over the data), from 0.
    pub epoch: u64,
    /// Sequences of this epoch's order already consumed, by all ranks together.
    pub sequence: u64,
}

/// How batches are made.
#[derive(Debug, Clone)]
pub struct DataOptions {
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Sequences per optimiser step over all ranks: a multiple of `micro_batch` × ranks.
    pub global_batch: usize,
    /// Pad sequence length up to a multiple of this.
    pub pad_multiple: usize,
    /// Masked-LM slots per sequence (20 in phase 1, 80 in phase 2).
    pub max_predictions: usize,
    /// Shuffle seed.
    pub seed: u64,
    /// This process's share.
    pub ranks: Ranks,
    /// Batches decoded ahead of use.
    pub prefetch: usize,
    /// Re-mask every sequence at load time instead of using the records' static masks.
    pub dynamic_masking: Option<DynamicMasking>,
    /// Token ids must be below this (the model's vocabulary size): a row holding one that is
    /// not is an error naming its file and row, found on the host before anything reaches the
    /// device.
    pub vocab_size: Option<usize>,
}

/// Masking at load time (RoBERTa / LDDL style): every epoch sees new masks.
///
/// The stored masks are undone first (the original ids are put back at the masked
/// positions), then new ones are drawn by the records stage's own masking
/// ([`bertkit_records::masking`]: the same 80/10/10, rounding and cap), with the special ids and
/// words of the vocabulary stored in the records files. The draws depend only on the seed, the
/// epoch and the row's place, so runs and resumes repeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DynamicMasking {
    /// Share of positions to predict (capped by `max_predictions`).
    #[serde(default = "default_mask_prob")]
    pub prob: f64,
    /// Mask whole words (a `##` piece goes with the word it continues).
    #[serde(default)]
    pub whole_word: bool,
}

fn default_mask_prob() -> f64 {
    0.15
}

/// Dynamic masking with what it needs: the records' vocabulary and reused buffers.
struct Remasker {
    options: MaskOptions,
    vocab: VocabIds,
}

impl Remasker {
    /// Re-masks `record` with draws from `key`.
    fn apply(&self, record: &mut Record, key: u64, scratch: &mut MaskScratch) {
        for (&p, &id) in record.masked_lm_positions.iter().zip(&record.masked_lm_ids) {
            if let Some(slot) = record.input_ids.get_mut(p as usize) {
                *slot = id;
            }
        }
        record.masked_lm_positions.clear();
        record.masked_lm_ids.clear();
        draw_masks(
            &mut record.input_ids,
            &self.options,
            &self.vocab,
            key,
            scratch,
            &mut record.masked_lm_positions,
            &mut record.masked_lm_ids,
        );
    }
}

/// One padded batch on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Sequences.
    pub size: usize,
    /// Padded length.
    pub seq_len: usize,
    /// Masked-LM slots per sequence.
    pub predictions: usize,
    /// `[size * seq_len]` token ids (0 = `[PAD]`).
    pub input_ids: Vec<u32>,
    /// `[size * seq_len]` segment ids.
    pub segment_ids: Vec<u32>,
    /// `[size * seq_len]` 1 for tokens, 0 for padding.
    pub attention_mask: Vec<u32>,
    /// `[size * predictions]` masked positions (0 in padding slots).
    pub masked_positions: Vec<u32>,
    /// `[size * predictions]` original ids there.
    pub masked_ids: Vec<u32>,
    /// `[size * predictions]` 1.0 for real slots, 0.0 for padding slots.
    pub masked_weights: Vec<f32>,
    /// `[size]` 1 when B is a random next.
    pub nsp_labels: Vec<u32>,
    /// Real (unpadded) tokens in the batch.
    pub tokens: usize,
    /// The place of the batch's first sequence in its optimiser step's global batch (rank
    /// share and micro-batch included).
    pub step_offset: usize,
    /// Where the stream continues after this batch's step (the checkpoint's cursor once the
    /// step is done).
    pub next: Cursor,
}

impl Batch {
    /// Pads `records` into a batch whose first sequence is sequence `step_offset` of its
    /// step, which is followed by `next`.
    pub fn pad(
        records: &[Record],
        pad_multiple: usize,
        max_predictions: usize,
        step_offset: usize,
        next: Cursor,
    ) -> Batch {
        let longest = records.iter().map(|r| r.input_ids.len()).max().unwrap_or(1);
        let m = pad_multiple.max(1);
        let seq_len = longest.div_ceil(m) * m;
        let size = records.len();
        let mut b = Batch {
            size,
            seq_len,
            predictions: max_predictions,
            input_ids: vec![0; size * seq_len],
            segment_ids: vec![0; size * seq_len],
            attention_mask: vec![0; size * seq_len],
            masked_positions: vec![0; size * max_predictions],
            masked_ids: vec![0; size * max_predictions],
            masked_weights: vec![0.0; size * max_predictions],
            nsp_labels: Vec::with_capacity(size),
            tokens: 0,
            step_offset,
            next,
        };
        for (i, r) in records.iter().enumerate() {
            let row = i * seq_len;
            for (j, (&id, &seg)) in r.input_ids.iter().zip(&r.segment_ids).enumerate() {
                b.input_ids[row + j] = id;
                b.segment_ids[row + j] = u32::from(seg);
                b.attention_mask[row + j] = 1;
            }
            b.tokens += r.input_ids.len();
            let slot = i * max_predictions;
            for (j, (&p, &id)) in r
                .masked_lm_positions
                .iter()
                .zip(&r.masked_lm_ids)
                .take(max_predictions)
                .enumerate()
            {
                b.masked_positions[slot + j] = p;
                b.masked_ids[slot + j] = id;
                b.masked_weights[slot + j] = 1.0;
            }
            b.nsp_labels.push(u32::from(r.next_sentence_label));
        }
        b
    }
}

/// The vocabulary stored in `files`, which must all hold the same one (by SHA-256); `None`
/// when none holds one (records from before vocabularies were stored).
fn shared_vocabulary(files: &[RecordsFile]) -> Result<Option<VocabIds>, TrainError> {
    let Some(first) = files.first() else {
        return Ok(None);
    };
    if first
        .metadata_value(bertkit_records::reader::VOCAB_KEY)
        .is_none()
    {
        return Ok(None);
    }
    let (vocab, sha256) = first.vocabulary()?;
    for file in &files[1..] {
        let other = file
            .metadata_value("bertkit.vocab_sha256")
            .unwrap_or_default();
        if other != sha256 {
            return Err(TrainError::Data(format!(
                "{} was made with another vocabulary than {} (SHA-256 {other} against {sha256}): \
                 a run reads records of one vocabulary",
                file.path().display(),
                first.path().display()
            )));
        }
    }
    Ok(Some(vocab))
}

/// The records files of a run and their row groups.
pub struct Dataset {
    files: Vec<RecordsFile>,
    /// (file, row group, rows), in file order.
    units: Vec<(usize, usize, usize)>,
    options: DataOptions,
    /// The vocabulary stored in the records (all files agree), when they carry one.
    vocab: Option<VocabIds>,
    /// The same vocabulary as a model folder stores it, with the records' casing.
    tokenizer: Option<TokenizerFiles>,
    remasker: Option<Remasker>,
}

impl Dataset {
    /// Opens every `.parquet` file of `inputs` (files, or folders read in name order).
    pub fn open(inputs: &[PathBuf], options: DataOptions) -> Result<Self, TrainError> {
        let per_round = options.micro_batch * options.ranks.world_size;
        if options.micro_batch == 0 || !options.global_batch.is_multiple_of(per_round) {
            return Err(TrainError::Config(format!(
                "a global batch of {} sequences cannot be cut into micro-batches of {} on {} \
                 rank(s): it must be a positive multiple of their product",
                options.global_batch, options.micro_batch, options.ranks.world_size
            )));
        }
        let paths = bertkit_stage_io::expand_inputs(inputs, |name| name.ends_with(".parquet"))
            .map_err(|(p, e)| TrainError::Data(format!("{}: {e}", p.display())))?;
        if paths.is_empty() {
            return Err(TrainError::Data(format!(
                "no .parquet records in {}",
                inputs
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let mut files = Vec::new();
        let mut units = Vec::new();
        for (f, path) in paths.iter().enumerate() {
            let file = RecordsFile::open(path)?;
            for (g, rows) in file.row_group_rows().into_iter().enumerate() {
                units.push((f, g, rows));
            }
            files.push(file);
        }
        let vocab = shared_vocabulary(&files)?;
        let tokenizer = vocab.as_ref().and_then(|_| files[0].tokenizer_files());
        let remasker = match &options.dynamic_masking {
            None => None,
            Some(masking) => Some(Remasker {
                options: MaskOptions {
                    prob: masking.prob,
                    max_predictions: options.max_predictions,
                    whole_word: masking.whole_word,
                },
                vocab: match &vocab {
                    Some(v) => v.clone(),
                    // The first file's error says which file and why.
                    None => files[0].vocabulary()?.0,
                },
            }),
        };
        let dataset = Dataset {
            files,
            units,
            options,
            vocab,
            tokenizer,
            remasker,
        };
        if dataset.steps_per_epoch() == 0 {
            return Err(TrainError::Data(format!(
                "{} sequences in all cannot make one global batch of {}",
                dataset.sequences(),
                dataset.options.global_batch
            )));
        }
        Ok(dataset)
    }

    /// The vocabulary the records were made with (stored in every file), if they carry one.
    pub fn vocabulary(&self) -> Option<&VocabIds> {
        self.vocab.as_ref()
    }

    /// The records' vocabulary and casing as a model folder stores them (`vocab.txt`,
    /// `tokenizer_config.json`), so that a model trained on them is a complete folder.
    pub fn tokenizer_files(&self) -> Option<&TokenizerFiles> {
        self.tokenizer.as_ref()
    }

    /// The longest sequence the records can hold: the largest `max_seq_length` their files
    /// were made with (`None` when a file does not say).
    pub fn max_seq_length(&self) -> Option<usize> {
        self.files
            .iter()
            .map(|f| f.max_seq_length())
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .max()
    }

    /// The most masked positions a record can hold: the largest `max_predictions_per_seq`
    /// their files were made with (`None` when a file does not say).
    pub fn max_predictions_per_seq(&self) -> Option<usize> {
        self.files
            .iter()
            .map(|f| f.max_predictions_per_seq())
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .max()
    }

    /// The files, in order.
    pub fn paths(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path()).collect()
    }

    /// Sequences in all files.
    pub fn sequences(&self) -> usize {
        self.units.iter().map(|u| u.2).sum()
    }

    /// The units in `epoch`'s order (the same on every rank).
    fn epoch_units(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.units.len()).collect();
        shuffle(&mut order, splitmix(self.options.seed ^ splitmix(epoch)));
        order
    }

    /// Optimiser steps per epoch: the whole global batches the sequences make.
    pub fn steps_per_epoch(&self) -> u64 {
        (self.sequences() / self.options.global_batch) as u64
    }

    /// Micro-batches per optimiser step on each rank.
    pub fn accumulation(&self) -> usize {
        self.options.global_batch / (self.options.micro_batch * self.options.ranks.world_size)
    }

    /// This rank's micro-batches per epoch.
    pub fn batches_per_epoch(&self) -> u64 {
        self.steps_per_epoch() * self.accumulation() as u64
    }

    fn unit_rows(&self, epoch: u64, unit: usize) -> Result<Vec<Record>, TrainError> {
        let (f, g, _) = self.units[unit];
        let mut rows = self.files[f].read_row_group(g)?;
        if let Some(limit) = self.options.vocab_size {
            self.check_ids(&rows, f, g, limit)?;
        }
        let key = splitmix(self.options.seed ^ splitmix(epoch ^ splitmix(unit as u64 + 1)));
        shuffle(&mut rows, key);
        if let Some(remasker) = &self.remasker {
            let mut scratch = MaskScratch::default();
            for (i, row) in rows.iter_mut().enumerate() {
                remasker.apply(row, splitmix(key ^ splitmix(i as u64 + 7)), &mut scratch);
            }
        }
        Ok(rows)
    }

    /// Every token id and masked-LM label of a row group's `rows` below `limit`.
    fn check_ids(
        &self,
        rows: &[Record],
        f: usize,
        g: usize,
        limit: usize,
    ) -> Result<(), TrainError> {
        for (i, r) in rows.iter().enumerate() {
            for (column, ids) in [
                ("input_ids", &r.input_ids),
                ("masked_lm_ids", &r.masked_lm_ids),
            ] {
                if let Some(id) = ids.iter().find(|&&id| id as usize >= limit) {
                    return Err(TrainError::Data(format!(
                        "{}: row group {g} row {i}: {column} holds {id}, outside the model's \
                         vocabulary of {limit}",
                        self.files[f].path().display()
                    )));
                }
            }
        }
        Ok(())
    }

    /// This rank's batches from `cursor` (a step boundary) on, forever (epoch after epoch),
    /// decoded on a background thread.
    pub fn stream(self: &std::sync::Arc<Self>, cursor: Cursor) -> BatchStream {
        let (tx, rx) = mpsc::sync_channel(self.options.prefetch.max(1));
        let data = self.clone();
        let handle = std::thread::spawn(move || {
            let g = data.options.global_batch as u64;
            if !cursor.sequence.is_multiple_of(g) {
                let _ = tx.send(Err(TrainError::Data(format!(
                    "cursor {cursor:?} is not at a step boundary of the global batch {g}"
                ))));
                return;
            }
            let mut cursor = cursor;
            loop {
                if cursor.sequence < data.steps_per_epoch() * g {
                    if let Err(e) = data.epoch_from(cursor, &tx) {
                        let _ = tx.send(Err(e));
                        return;
                    }
                    if tx.send(Ok(None)).is_err() {
                        return;
                    }
                }
                cursor = Cursor {
                    epoch: cursor.epoch + 1,
                    sequence: 0,
                };
            }
        });
        BatchStream {
            rx,
            _handle: handle,
        }
    }

    /// Sends this rank's batches of `cursor.epoch` from the step at `cursor.sequence` on;
    /// returns early when the receiver is gone. Only the units holding this rank's sequences
    /// are decoded, each once per epoch.
    fn epoch_from(
        &self,
        cursor: Cursor,
        tx: &mpsc::SyncSender<Result<Option<Batch>, TrainError>>,
    ) -> Result<(), TrainError> {
        let (m, g) = (self.options.micro_batch, self.options.global_batch);
        let share = g / self.options.ranks.world_size;
        let order = self.epoch_units(cursor.epoch);
        // Where each unit's rows start in the epoch's order.
        let mut starts = Vec::with_capacity(order.len() + 1);
        starts.push(0usize);
        for &u in &order {
            starts.push(starts.last().copied().unwrap_or(0) + self.units[u].2);
        }
        let mut decoded: Option<(usize, Vec<Record>)> = None;
        let mut pending: Vec<Record> = Vec::with_capacity(m);
        for step in cursor.sequence / g as u64..self.steps_per_epoch() {
            let step_start = step as usize * g;
            let next = Cursor {
                epoch: cursor.epoch,
                sequence: (step + 1) * g as u64,
            };
            let first = self.options.ranks.rank * share;
            for offset in first..first + share {
                let place = step_start + offset;
                let k = starts.partition_point(|&s| s <= place) - 1;
                if decoded.as_ref().is_none_or(|(d, _)| *d != k) {
                    decoded = Some((k, self.unit_rows(cursor.epoch, order[k])?));
                }
                let rows = &decoded.as_ref().expect("decoded above").1;
                pending.push(rows[place - starts[k]].clone());
                if pending.len() == m {
                    let batch = Batch::pad(
                        &pending,
                        self.options.pad_multiple,
                        self.options.max_predictions,
                        offset + 1 - m,
                        next,
                    );
                    pending.clear();
                    if tx.send(Ok(Some(batch))).is_err() {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }
}

/// Batches from a background thread.
pub struct BatchStream {
    rx: mpsc::Receiver<Result<Option<Batch>, TrainError>>,
    _handle: std::thread::JoinHandle<()>,
}

impl BatchStream {
    /// The next batch (crossing into the next epoch as needed).
    pub fn next_batch(&mut self) -> Result<Batch, TrainError> {
        loop {
            match self.rx.recv() {
                Ok(Ok(Some(batch))) => return Ok(batch),
                Ok(Ok(None)) => continue,
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(TrainError::Data("the data thread stopped".into())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_and_slots() {
        let r = Record {
            input_ids: vec![101, 5, 103, 102],
            segment_ids: vec![0, 0, 0, 0],
            masked_lm_positions: vec![2],
            masked_lm_ids: vec![7],
            next_sentence_label: 1,
        };
        let b = Batch::pad(
            &[
                r.clone(),
                Record {
                    input_ids: vec![101, 102],
                    segment_ids: vec![0, 1],
                    ..r
                },
            ],
            8,
            3,
            0,
            Cursor::default(),
        );
        assert_eq!((b.size, b.seq_len, b.predictions), (2, 8, 3));
        assert_eq!(&b.input_ids[..8], &[101, 5, 103, 102, 0, 0, 0, 0]);
        assert_eq!(&b.attention_mask[8..16], &[1, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&b.segment_ids[8..10], &[0, 1]);
        assert_eq!(b.masked_weights, vec![1.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
        assert_eq!(b.nsp_labels, vec![1, 1]);
        assert_eq!(b.tokens, 6);
    }

    /// A vocabulary laid out as `bertkit vocab` writes one: `[PAD] [UNK] [CLS] [SEP] [MASK]`
    /// at 0..5, not BERT's 0, 100, 101, 102, 103; then 55 words.
    fn trained_layout_vocab() -> VocabIds {
        let mut text = String::from("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n");
        for w in 5..60 {
            text.push_str(&format!("w{w}\n"));
        }
        let tokenizer =
            bertkit_tokenizer::FullTokenizer::from_vocab_text(Path::new("vocab.txt"), &text, true)
                .unwrap();
        VocabIds::new(&tokenizer).unwrap()
    }

    #[test]
    fn dynamic_masking_undoes_the_stored_masks_and_draws_new_ones() {
        let vocab = trained_layout_vocab();
        assert_eq!(
            (vocab.cls, vocab.sep, vocab.mask, vocab.size()),
            (2, 3, 4, 60)
        );
        let mut ids: Vec<u32> = (0..40).map(|i| 10 + i).collect();
        ids[0] = 2;
        ids[20] = 3;
        ids[39] = 3;
        let mut stored = ids.clone();
        stored[5] = 4;
        let record = Record {
            input_ids: stored,
            segment_ids: vec![0; 40],
            masked_lm_positions: vec![5],
            masked_lm_ids: vec![15],
            next_sentence_label: 0,
        };
        let m = Remasker {
            options: MaskOptions {
                prob: 0.15,
                max_predictions: 20,
                whole_word: false,
            },
            vocab,
        };
        let mut scratch = MaskScratch::default();
        let mut a = record.clone();
        m.apply(&mut a, 1, &mut scratch);
        let mut b = record.clone();
        m.apply(&mut b, 2, &mut scratch);
        // round(40 × 0.15) = 6 positions.
        assert_eq!(a.masked_lm_positions.len(), 6);
        assert_ne!(a.masked_lm_positions, b.masked_lm_positions);
        for r in [&a, &b] {
            assert!(r.masked_lm_positions.windows(2).all(|w| w[0] < w[1]));
            for special in [0, 20, 39] {
                assert!(!r.masked_lm_positions.contains(&special), "{special}");
            }
            // Putting the labels back gives the unmasked sequence.
            let mut restored = r.input_ids.clone();
            for (&p, &id) in r.masked_lm_positions.iter().zip(&r.masked_lm_ids) {
                restored[p as usize] = id;
            }
            assert_eq!(restored, ids);
        }
        let mut again = record.clone();
        m.apply(&mut again, 1, &mut scratch);
        assert_eq!(again, a);
        // The 80/10/10 split over many draws, with this vocabulary's [MASK] and words.
        let (mut masked, mut kept, mut total) = (0, 0, 0);
        for key in 0..1000 {
            let mut r = record.clone();
            m.apply(&mut r, key, &mut scratch);
            for (&p, &label) in r.masked_lm_positions.iter().zip(&r.masked_lm_ids) {
                let seen = r.input_ids[p as usize];
                assert!(seen < 60 && seen != 103, "{seen}");
                masked += usize::from(seen == 4);
                kept += usize::from(seen == label);
                total += 1;
            }
        }
        let share = |n: usize| n as f64 / total as f64;
        assert!((share(masked) - 0.8).abs() < 0.02, "{}", share(masked));
        // Kept: 10%, plus a random word that happens to be the original (1 in 60 of 10%).
        assert!((share(kept) - 0.1017).abs() < 0.015, "{}", share(kept));
    }

    #[test]
    fn shuffles_are_permutations() {
        let mut v: Vec<u32> = (0..100).collect();
        shuffle(&mut v, 3);
        assert_ne!(v, (0..100).collect::<Vec<_>>());
        v.sort();
        assert_eq!(v, (0..100).collect::<Vec<_>>());
    }
}
