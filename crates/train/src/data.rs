//! Pre-training batches from the records stage's Parquet files.
//!
//! - **Units**: every row group of every file is a unit (2048 instances). Files are read
//!   through memory maps ([`bertkit_records::reader`]), a row group at a time.
//! - **Order**: each epoch shuffles the units with the seed and the epoch number, and the rows
//!   of each unit with the seed, epoch and unit. Rank `r` of `w` takes units `i % w == r`; every
//!   rank stops an epoch after the same number of batches (what the smallest share holds), so
//!   data-parallel ranks stay in step.
//! - **Batches**: `micro_batch` consecutive samples, padded to the longest sequence of the batch
//!   rounded up to `pad_multiple` (8 suits tensor cores; a larger multiple, such as 64 for phase
//!   2, gives a few fixed shapes, like length bins); masked-LM slots padded to
//!   `max_predictions` with weight 0.
//! - **Cursor**: `(epoch, batches consumed in the epoch)` fixes the next batch exactly, so a
//!   checkpoint stores it and a resumed run continues with the next unseen batch.
//! - **Prefetch**: [`BatchStream`] decodes and pads on a background thread, a few batches ahead.
//!
//! Host memory holds one decoded unit per batch being built and the prefetch queue.

use std::path::{Path, PathBuf};
use std::sync::mpsc;

use bertkit_model::rng::{shuffle, splitmix64 as splitmix};
use bertkit_records::reader::{Record, RecordsFile};
use bertkit_stage_io::Ranks;
use serde::{Deserialize, Serialize};

use crate::TrainError;

/// Where the data stands: the next batch is batch `batch` of epoch `epoch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Cursor {
    /// Epoch (pass over the data), from 0.
    pub epoch: u64,
    /// Batches of this epoch already consumed (by this rank).
    pub batch: u64,
}

/// How batches are made.
#[derive(Debug, Clone)]
pub struct DataOptions {
    /// Sequences per micro-batch.
    pub micro_batch: usize,
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
}

/// Masking at load time (RoBERTa / LDDL style): every epoch sees new masks.
///
/// The stored masks are undone first (the original ids are put back at the masked
/// positions), then `prob` of the positions other than `[CLS]` and `[SEP]` (at least one, at
/// most `max_predictions`) are chosen: 80% become `[MASK]`, 10% a random id, 10% stay. The
/// draws depend only on the seed, the epoch and the row's place, so runs and resumes repeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DynamicMasking {
    /// Share of positions to predict.
    #[serde(default = "default_mask_prob")]
    pub prob: f64,
    /// The `[MASK]` id (103 in BERT's vocabularies).
    #[serde(default = "default_mask_id")]
    pub mask_token_id: u32,
    /// The `[CLS]` id (101).
    #[serde(default = "default_cls_id")]
    pub cls_token_id: u32,
    /// The `[SEP]` id (102).
    #[serde(default = "default_sep_id")]
    pub sep_token_id: u32,
    /// Random replacements are drawn below this id (the vocabulary size).
    #[serde(default = "default_vocab")]
    pub vocab_size: u32,
}

fn default_mask_prob() -> f64 {
    0.15
}
fn default_mask_id() -> u32 {
    103
}
fn default_cls_id() -> u32 {
    101
}
fn default_sep_id() -> u32 {
    102
}
fn default_vocab() -> u32 {
    30522
}

impl DynamicMasking {
    /// Re-masks `record` with draws from `key`.
    pub fn apply(&self, record: &mut Record, max_predictions: usize, key: u64) {
        for (&p, &id) in record.masked_lm_positions.iter().zip(&record.masked_lm_ids) {
            if let Some(slot) = record.input_ids.get_mut(p as usize) {
                *slot = id;
            }
        }
        let mut candidates: Vec<u32> = (0..record.input_ids.len() as u32)
            .filter(|&i| {
                let id = record.input_ids[i as usize];
                id != self.cls_token_id && id != self.sep_token_id
            })
            .collect();
        shuffle(&mut candidates, key);
        let wanted = ((record.input_ids.len() as f64 * self.prob).round() as usize)
            .clamp(1, max_predictions)
            .min(candidates.len());
        let mut chosen: Vec<u32> = candidates[..wanted].to_vec();
        chosen.sort_unstable();
        let mut state = splitmix(key ^ 0x5EED);
        record.masked_lm_ids = chosen
            .iter()
            .map(|&p| record.input_ids[p as usize])
            .collect();
        for &p in &chosen {
            state = splitmix(state);
            let roll = state % 10;
            let slot = &mut record.input_ids[p as usize];
            if roll < 8 {
                *slot = self.mask_token_id;
            } else if roll == 8 {
                state = splitmix(state);
                *slot = (state % u64::from(self.vocab_size)) as u32;
            }
        }
        record.masked_lm_positions = chosen;
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
    /// The cursor after this batch.
    pub next: Cursor,
}

impl Batch {
    /// Pads `records` into a batch.
    pub fn pad(
        records: &[Record],
        pad_multiple: usize,
        max_predictions: usize,
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

/// The records files of a run and their row groups.
pub struct Dataset {
    files: Vec<RecordsFile>,
    /// (file, row group, rows), in file order.
    units: Vec<(usize, usize, usize)>,
    options: DataOptions,
}

impl Dataset {
    /// Opens every `.parquet` file of `inputs` (files, or folders read in name order).
    pub fn open(inputs: &[PathBuf], options: DataOptions) -> Result<Self, TrainError> {
        if options.micro_batch == 0 {
            return Err(TrainError::Config("micro_batch must be at least 1".into()));
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
            let file = RecordsFile::open(path).map_err(|e| TrainError::Data(e.to_string()))?;
            for (g, rows) in file.row_group_rows().into_iter().enumerate() {
                units.push((f, g, rows));
            }
            files.push(file);
        }
        let dataset = Dataset {
            files,
            units,
            options,
        };
        if dataset.batches_per_epoch() == 0 {
            return Err(TrainError::Data(format!(
                "{} sequences in all cannot make one batch of {} per rank ({})",
                dataset.units.iter().map(|u| u.2).sum::<usize>(),
                dataset.options.micro_batch,
                dataset.options.ranks
            )));
        }
        Ok(dataset)
    }

    /// The files, in order.
    pub fn paths(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path()).collect()
    }

    /// Sequences in all files.
    pub fn sequences(&self) -> usize {
        self.units.iter().map(|u| u.2).sum()
    }

    /// This rank's units for `epoch`, in order.
    fn epoch_units(&self, epoch: u64, rank: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.units.len()).collect();
        shuffle(&mut order, splitmix(self.options.seed ^ splitmix(epoch)));
        let w = self.options.ranks.world_size;
        order
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % w == rank)
            .map(|(_, u)| u)
            .collect()
    }

    /// Batches per epoch (the same for every rank).
    pub fn batches_per_epoch(&self) -> u64 {
        (0..self.options.ranks.world_size)
            .map(|r| {
                let rows: usize = self
                    .epoch_units(0, r)
                    .iter()
                    .map(|&u| self.units[u].2)
                    .sum();
                (rows / self.options.micro_batch) as u64
            })
            .min()
            .unwrap_or(0)
    }

    fn unit_rows(&self, epoch: u64, unit: usize) -> Result<Vec<Record>, TrainError> {
        let (f, g, _) = self.units[unit];
        let mut rows = self.files[f]
            .read_row_group(g)
            .map_err(|e| TrainError::Data(e.to_string()))?;
        let key = splitmix(self.options.seed ^ splitmix(epoch ^ splitmix(unit as u64 + 1)));
        shuffle(&mut rows, key);
        if let Some(masking) = &self.options.dynamic_masking {
            for (i, row) in rows.iter_mut().enumerate() {
                masking.apply(
                    row,
                    self.options.max_predictions,
                    splitmix(key ^ splitmix(i as u64 + 7)),
                );
            }
        }
        Ok(rows)
    }

    /// The batches from `cursor` on, forever (epoch after epoch), decoded on a background
    /// thread.
    pub fn stream(self: &std::sync::Arc<Self>, cursor: Cursor) -> BatchStream {
        let (tx, rx) = mpsc::sync_channel(self.options.prefetch.max(1));
        let data = self.clone();
        let handle = std::thread::spawn(move || {
            let mut cursor = cursor;
            loop {
                let per_epoch = data.batches_per_epoch();
                if cursor.batch >= per_epoch {
                    cursor = Cursor {
                        epoch: cursor.epoch + 1,
                        batch: 0,
                    };
                }
                if let Err(e) = data.epoch_from(cursor, &tx) {
                    let _ = tx.send(Err(e));
                    return;
                }
                cursor = Cursor {
                    epoch: cursor.epoch + 1,
                    batch: 0,
                };
                if tx.send(Ok(None)).is_err() {
                    return;
                }
            }
        });
        BatchStream {
            rx,
            _handle: handle,
        }
    }

    /// Sends the batches of `cursor.epoch` from `cursor.batch` on; returns early when the
    /// receiver is gone.
    fn epoch_from(
        &self,
        cursor: Cursor,
        tx: &mpsc::SyncSender<Result<Option<Batch>, TrainError>>,
    ) -> Result<(), TrainError> {
        let b = self.options.micro_batch;
        let per_epoch = self.batches_per_epoch();
        let units = self.epoch_units(cursor.epoch, self.options.ranks.rank);
        // Skip whole units before the first sample wanted, using the row counts alone.
        let mut skip = cursor.batch as usize * b;
        let mut first = 0;
        while first < units.len() && skip >= self.units[units[first]].2 {
            skip -= self.units[units[first]].2;
            first += 1;
        }
        let mut pending: Vec<Record> = Vec::with_capacity(b);
        let mut batch_index = cursor.batch;
        for (k, &unit) in units.iter().enumerate().skip(first) {
            let rows = self.unit_rows(cursor.epoch, unit)?;
            let start = if k == first { skip } else { 0 };
            for record in rows.into_iter().skip(start) {
                pending.push(record);
                if pending.len() == b {
                    batch_index += 1;
                    let next = Cursor {
                        epoch: cursor.epoch,
                        batch: batch_index,
                    };
                    let batch = Batch::pad(
                        &pending,
                        self.options.pad_multiple,
                        self.options.max_predictions,
                        next,
                    );
                    pending.clear();
                    if tx.send(Ok(Some(batch))).is_err() {
                        return Ok(());
                    }
                    if batch_index >= per_epoch {
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

    #[test]
    fn dynamic_masking_undoes_the_stored_masks_and_draws_new_ones() {
        let original: Vec<u32> = (0..40).map(|i| 1000 + i).collect();
        let mut ids = original.clone();
        ids[0] = 101;
        ids[39] = 102;
        let mut stored = ids.clone();
        stored[5] = 103;
        let record = Record {
            input_ids: stored,
            segment_ids: vec![0; 40],
            masked_lm_positions: vec![5],
            masked_lm_ids: vec![1005],
            next_sentence_label: 0,
        };
        let m = DynamicMasking {
            prob: 0.15,
            mask_token_id: 103,
            cls_token_id: 101,
            sep_token_id: 102,
            vocab_size: 30522,
        };
        let mut a = record.clone();
        m.apply(&mut a, 20, 1);
        let mut b = record.clone();
        m.apply(&mut b, 20, 2);
        assert_eq!(a.masked_lm_positions.len(), 6);
        assert_ne!(a.masked_lm_positions, b.masked_lm_positions);
        for r in [&a, &b] {
            assert!(r.masked_lm_positions.windows(2).all(|w| w[0] < w[1]));
            assert!(!r.masked_lm_positions.contains(&0) && !r.masked_lm_positions.contains(&39));
            // Putting the labels back gives the unmasked sequence.
            let mut restored = r.input_ids.clone();
            for (&p, &id) in r.masked_lm_positions.iter().zip(&r.masked_lm_ids) {
                restored[p as usize] = id;
            }
            assert_eq!(restored, ids);
        }
        let mut again = record.clone();
        m.apply(&mut again, 20, 1);
        assert_eq!(again, a);
        // The 80/10/10 split over many draws.
        let (mut masked, mut total) = (0, 0);
        for key in 0..400 {
            let mut r = record.clone();
            m.apply(&mut r, 20, key);
            masked += r
                .masked_lm_positions
                .iter()
                .filter(|&&p| r.input_ids[p as usize] == 103)
                .count();
            total += r.masked_lm_positions.len();
        }
        let share = masked as f64 / total as f64;
        assert!((share - 0.8).abs() < 0.03, "{share}");
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
