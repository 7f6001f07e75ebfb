//! Reading records files through a memory map, one row group at a time.
//!
//! [`RecordsFile::open`] maps the file and parses its footer once; nothing else is read until a
//! row group is asked for, and then only that group's pages are touched (the kernel pages them
//! in from the map). Row groups are the unit of shuffling and of partitioning across ranks
//! (see the layout notes in [`crate::parquet_file`]).

use std::path::{Path, PathBuf};

use arrow_array::{Array, Int8Array, Int32Array, ListArray, RecordBatch};
use bytes::Bytes;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};

use crate::masking::VocabIds;
use crate::run::RecordsError;
use bertkit_tokenizer::FullTokenizer;

/// The metadata key under which every records file keeps the text of the vocabulary it was made
/// with (`vocab.txt`, one token per line): its ids, special tokens and size travel with the
/// records.
pub const VOCAB_KEY: &str = "bertkit.vocab";

/// One pre-training instance as stored (unpadded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// `[CLS] A [SEP] B [SEP]` after masking.
    pub input_ids: Vec<u32>,
    /// 0 for `[CLS]`, A and the first `[SEP]`; 1 after.
    pub segment_ids: Vec<u8>,
    /// Masked positions, ascending.
    pub masked_lm_positions: Vec<u32>,
    /// Original ids at those positions.
    pub masked_lm_ids: Vec<u32>,
    /// 1 when B is a random next.
    pub next_sentence_label: u8,
}

/// A memory-mapped records file.
pub struct RecordsFile {
    path: PathBuf,
    bytes: Bytes,
    metadata: ArrowReaderMetadata,
}

fn read_err(path: &Path, message: impl std::fmt::Display) -> RecordsError {
    RecordsError::Usage(format!("{}: {message}", path.display()))
}

impl RecordsFile {
    /// Maps `path` and reads its footer; checks that it is a records file.
    pub fn open(path: &Path) -> Result<Self, RecordsError> {
        let file = std::fs::File::open(path).map_err(|e| read_err(path, e))?;
        // SAFETY: records files are written once under a temporary name and renamed into place;
        // nothing writes to a finished file while it is mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| read_err(path, e))?;
        let bytes = Bytes::from_owner(map);
        let metadata = ArrowReaderMetadata::load(&bytes, ArrowReaderOptions::new())
            .map_err(|e| read_err(path, format!("not a Parquet file: {e}")))?;
        let layout = metadata
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .and_then(|kv| kv.iter().find(|k| k.key == "bertkit.layout"))
            .and_then(|k| k.value.clone());
        if layout.as_deref() != Some(crate::parquet_file::LAYOUT) {
            return Err(read_err(
                path,
                format!(
                    "layout {layout:?}, expected {:?} (written by `bertkit records`)",
                    crate::parquet_file::LAYOUT
                ),
            ));
        }
        Ok(RecordsFile {
            path: path.to_path_buf(),
            bytes,
            metadata,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Rows in each row group.
    pub fn row_group_rows(&self) -> Vec<usize> {
        self.metadata
            .metadata()
            .row_groups()
            .iter()
            .map(|g| g.num_rows() as usize)
            .collect()
    }

    /// A key-value metadata entry (`bertkit.parameters`, …).
    pub fn metadata_value(&self, key: &str) -> Option<String> {
        self.metadata
            .metadata()
            .file_metadata()
            .key_value_metadata()?
            .iter()
            .find(|k| k.key == key)?
            .value
            .clone()
    }

    /// The vocabulary the file was made with, as masking needs it (special ids, words, `##`
    /// pieces), and its SHA-256.
    pub fn vocabulary(&self) -> Result<(VocabIds, String), RecordsError> {
        let text = self.metadata_value(VOCAB_KEY).ok_or_else(|| {
            read_err(
                &self.path,
                format!(
                    "no vocabulary in the metadata ({VOCAB_KEY}): made by an older `bertkit \
                     records`; run it again to add it"
                ),
            )
        })?;
        let sha256 = self
            .metadata_value("bertkit.vocab_sha256")
            .unwrap_or_default();
        let tokenizer = FullTokenizer::from_vocab_text(&self.path, &text, true)?;
        let ids = VocabIds::new(&tokenizer).ok_or_else(|| {
            read_err(
                &self.path,
                "the stored vocabulary lacks [CLS], [SEP] or [MASK]",
            )
        })?;
        Ok((ids, sha256))
    }

    /// Decodes row group `index`.
    pub fn read_row_group(&self, index: usize) -> Result<Vec<Record>, RecordsError> {
        let groups = self.metadata.metadata().num_row_groups();
        if index >= groups {
            return Err(read_err(
                &self.path,
                format!("no row group {index}: the file has {groups}"),
            ));
        }
        let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(
            self.bytes.clone(),
            self.metadata.clone(),
        )
        .with_row_groups(vec![index])
        .with_batch_size(8192)
        .build()
        .map_err(|e| read_err(&self.path, format!("row group {index}: {e}")))?;
        let mut out = Vec::new();
        for batch in reader {
            let batch =
                batch.map_err(|e| read_err(&self.path, format!("row group {index}: {e}")))?;
            decode(&batch, &mut out)
                .map_err(|m| read_err(&self.path, format!("row group {index}: {m}")))?;
        }
        Ok(out)
    }
}

fn column<'a, T: 'static>(batch: &'a RecordBatch, name: &str) -> Result<&'a T, String> {
    batch
        .column_by_name(name)
        .and_then(|c| c.as_any().downcast_ref::<T>())
        .ok_or_else(|| format!("column {name} is missing or of the wrong type"))
}

fn decode(batch: &RecordBatch, out: &mut Vec<Record>) -> Result<(), String> {
    let ids = column::<ListArray>(batch, "input_ids")?;
    let segments = column::<ListArray>(batch, "segment_ids")?;
    let positions = column::<ListArray>(batch, "masked_lm_positions")?;
    let masked = column::<ListArray>(batch, "masked_lm_ids")?;
    let labels = column::<Int8Array>(batch, "next_sentence_label")?;
    let i32s = |list: &ListArray, row: usize| -> Result<Vec<u32>, String> {
        let v = list.value(row);
        let v = v
            .as_any()
            .downcast_ref::<Int32Array>()
            .ok_or("a list of the wrong type")?;
        Ok(v.values().iter().map(|&x| x as u32).collect())
    };
    for row in 0..batch.num_rows() {
        let seg = segments.value(row);
        let seg = seg
            .as_any()
            .downcast_ref::<Int8Array>()
            .ok_or("segment_ids of the wrong type")?;
        out.push(Record {
            input_ids: i32s(ids, row)?,
            segment_ids: seg.values().iter().map(|&x| x as u8).collect(),
            masked_lm_positions: i32s(positions, row)?,
            masked_lm_ids: i32s(masked, row)?,
            next_sentence_label: labels.value(row) as u8,
        });
    }
    Ok(())
}
