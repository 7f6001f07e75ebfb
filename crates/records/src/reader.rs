//! Reading records files through a memory map, one row group at a time.
//!
//! [`RecordsFile::open`] maps the file and parses its footer once; nothing else is read until a
//! row group is asked for, and then only that group's pages are touched (the kernel pages them
//! in from the map). Row groups are the unit of shuffling and of partitioning across ranks
//! (see the layout notes in [`crate::parquet_file`]).

use std::ops::Range;
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
    /// Each row group's SHA-256 (see [`crate::parquet_file::ROW_GROUP_SHA256_KEY`]); empty
    /// for a file written before digests were stored.
    row_group_sha256: Vec<String>,
    /// Each row group's column chunks: their bytes in the file, checked to lie inside the file
    /// when it was opened.
    column_chunks: Vec<Vec<Range<usize>>>,
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
        check_footer(path, &bytes)?;
        let metadata = parquet_call(path, "the footer", || {
            ArrowReaderMetadata::load(&bytes, ArrowReaderOptions::new())
                .map_err(|e| read_err(path, format!("not a Parquet file: {e}")))
        })?;
        let layout = metadata
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .and_then(|kv| kv.iter().find(|k| k.key == "bertkit.layout"))
            .and_then(|k| k.value.clone());
        match layout.as_deref() {
            Some(crate::parquet_file::LAYOUT) => {}
            None => {
                return Err(read_err(
                    path,
                    "not a bertkit records file: its metadata has no bertkit.layout (records \
                     files are written by `bertkit records`)",
                ));
            }
            Some(other) => {
                return Err(read_err(
                    path,
                    format!(
                        "records layout {other:?}, but this bertkit reads {:?}: make the records \
                         again with this version",
                        crate::parquet_file::LAYOUT
                    ),
                ));
            }
        }
        let row_group_sha256: Vec<String> = match metadata
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .and_then(|kv| {
                kv.iter()
                    .find(|k| k.key == crate::parquet_file::ROW_GROUP_SHA256_KEY)
            })
            .and_then(|k| k.value.as_deref())
        {
            None => Vec::new(),
            Some(json) => {
                let digests: Vec<String> = serde_json::from_str(json).map_err(|e| {
                    read_err(
                        path,
                        format!("{}: {e}", crate::parquet_file::ROW_GROUP_SHA256_KEY),
                    )
                })?;
                let groups = metadata.metadata().num_row_groups();
                if digests.len() != groups {
                    return Err(read_err(
                        path,
                        format!(
                            "{} lists {} digests for {groups} row groups",
                            crate::parquet_file::ROW_GROUP_SHA256_KEY,
                            digests.len()
                        ),
                    ));
                }
                digests
            }
        };
        check_schema(path, metadata.schema())?;
        // parquet's page reader panics on a column chunk whose offset or size is negative
        // (`ColumnChunkMetaData::byte_range` asserts): every chunk is checked first.
        let column_chunks = metadata
            .metadata()
            .row_groups()
            .iter()
            .enumerate()
            .map(|(g, group)| {
                group
                    .columns()
                    .iter()
                    .enumerate()
                    .map(|(i, column)| column_chunk_range(path, bytes.len(), g, i, column))
                    .collect::<Result<_, _>>()
            })
            .collect::<Result<_, RecordsError>>()?;
        Ok(RecordsFile {
            path: path.to_path_buf(),
            bytes,
            metadata,
            row_group_sha256,
            column_chunks,
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

    /// The tokenizer the file was made with, as a model folder stores it: the vocabulary's
    /// text and whether it was uncased (`None` for a file that stores no vocabulary).
    pub fn tokenizer_files(&self) -> Option<bertkit_tokenizer::folder::TokenizerFiles> {
        let vocab = self.metadata_value(VOCAB_KEY)?;
        let parameters = self.metadata_value("bertkit.parameters")?;
        let json: serde_json::Value = serde_json::from_str(&parameters).ok()?;
        Some(bertkit_tokenizer::folder::TokenizerFiles {
            vocab,
            lower_case: json["lower_case"].as_bool()?,
        })
    }

    /// The `max_seq_length` the file was made with (from its `bertkit.parameters`), if it
    /// says.
    pub fn max_seq_length(&self) -> Option<usize> {
        let parameters = self.metadata_value("bertkit.parameters")?;
        let json: serde_json::Value = serde_json::from_str(&parameters).ok()?;
        json["instances"]["max_seq_length"]
            .as_u64()
            .map(|n| n as usize)
    }

    /// The `max_predictions_per_seq` the file was made with (from its `bertkit.parameters`):
    /// the most masked positions a record holds, if it says.
    pub fn max_predictions_per_seq(&self) -> Option<usize> {
        let parameters = self.metadata_value("bertkit.parameters")?;
        let json: serde_json::Value = serde_json::from_str(&parameters).ok()?;
        json["instances"]["max_predictions_per_seq"]
            .as_u64()
            .map(|n| n as usize)
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
        self.check_row_group(index)?;
        for (column, chunk) in self.column_chunks[index].iter().enumerate() {
            crate::thrift_walk::check_column_chunk(&self.bytes[chunk.clone()]).map_err(|e| {
                read_err(
                    &self.path,
                    format!(
                        "row group {index} column {column} (bytes {}..{}): {e}: the file is \
                         damaged",
                        chunk.start, chunk.end
                    ),
                )
            })?;
        }
        parquet_call(&self.path, &format!("row group {index}"), || {
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
                let first_row = out.len();
                decode(&batch, &mut out).map_err(|(row, m)| {
                    read_err(
                        &self.path,
                        format!("row group {index} row {}: {m}", first_row + row),
                    )
                })?;
            }
            Ok(out)
        })
    }
}

/// Walks the footer of the Parquet file `bytes` before the parquet crate parses it (see
/// [`crate::thrift_walk`]). A file too short for a footer, or whose footer length does not fit,
/// is left to parquet, which says so.
fn check_footer(path: &Path, bytes: &[u8]) -> Result<(), RecordsError> {
    let n = bytes.len();
    if n < 12 || &bytes[n - 4..] != b"PAR1" {
        return Ok(());
    }
    let length = u32::from_le_bytes(bytes[n - 8..n - 4].try_into().expect("four bytes")) as usize;
    let Some(start) = (n - 8).checked_sub(length) else {
        return Ok(());
    };
    crate::thrift_walk::check_footer(&bytes[start..n - 8]).map_err(|e| {
        read_err(
            path,
            format!(
                "the footer (bytes {start}..{}): {e}: the file is damaged",
                n - 8
            ),
        )
    })
}

/// Runs `read`, a call into the parquet crate on the bytes of the file at `path`, with a panic
/// in it turned into an error naming the file and `what` was being read.
///
/// The parquet crate's decoders trust parts of a page: a `BYTE_STREAM_SPLIT` page declaring
/// more values than its bytes hold indexes past them and panics (parquet 60; found by the
/// `records_parquet` fuzz target). Files whose row groups carry digests only reach the
/// decoders with the bytes `bertkit records` wrote; a hostile file (or one made before the
/// digests) can reach such a panic, and a damaged records file must stop the run with an error,
/// not take down the process. The parquet values built inside are dropped as the panic
/// unwinds; nothing outlives the call.
fn parquet_call<T>(
    path: &Path,
    what: &str,
    read: impl FnOnce() -> Result<T, RecordsError>,
) -> Result<T, RecordsError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(read)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|m| m.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(read_err(
            path,
            format!("{what}: the parquet crate panicked on it ({message}): the file is damaged"),
        ))
    })
}

/// Column chunk `column` of row group `group`: its bytes in the file, as
/// `ColumnChunkMetaData::byte_range` gives them, or an error where the footer's offset or size
/// is negative or lies past the file's `file_len` bytes (a damaged or hostile footer).
fn column_chunk_range(
    path: &Path,
    file_len: usize,
    group: usize,
    column: usize,
    chunk: &parquet::file::metadata::ColumnChunkMetaData,
) -> Result<Range<usize>, RecordsError> {
    let start = chunk
        .dictionary_page_offset()
        .unwrap_or(chunk.data_page_offset());
    let length = chunk.compressed_size();
    match (usize::try_from(start), usize::try_from(length)) {
        (Ok(s), Ok(l)) if s.checked_add(l).is_some_and(|end| end <= file_len) => Ok(s..s + l),
        _ => Err(read_err(
            path,
            format!(
                "row group {group} column {column}: the footer puts it at offset {start}, size \
                 {length}, in a file of {file_len} bytes: the file is damaged"
            ),
        )),
    }
}

impl RecordsFile {
    /// Checks row group `index`'s bytes against their stored SHA-256 (when the file has
    /// digests): changed bytes would otherwise decode to other ids without an error.
    fn check_row_group(&self, index: usize) -> Result<(), RecordsError> {
        let Some(expected) = self.row_group_sha256.get(index) else {
            return Ok(());
        };
        let chunks = &self.column_chunks[index];
        let start = chunks.iter().map(|c| c.start).min().unwrap_or(0);
        let end = chunks.iter().map(|c| c.end).max().unwrap_or(0);
        use sha2::Digest;
        let actual = bertkit_stage_io::hex(&sha2::Sha256::digest(&self.bytes[start..end]));
        if actual != *expected {
            return Err(read_err(
                &self.path,
                format!(
                    "row group {index} (bytes {start}..{end}) does not match its SHA-256 in the \
                     metadata: the file is damaged; copy it again or make it again with \
                     `bertkit records`"
                ),
            ));
        }
        Ok(())
    }
}

/// Refuses a file whose columns are not those of a records file
/// ([`crate::parquet_file::arrow_schema`]), naming the first column that differs.
fn check_schema(path: &Path, schema: &arrow_schema::Schema) -> Result<(), RecordsError> {
    let expected = crate::parquet_file::arrow_schema();
    let (want, got) = (expected.fields(), schema.fields());
    let problem = if got.len() != want.len() {
        format!(
            "it has {} columns, a records file {}",
            got.len(),
            want.len()
        )
    } else {
        let Some((i, (w, g))) = want
            .iter()
            .zip(got.iter())
            .enumerate()
            .find(|(_, (w, g))| w.name() != g.name() || w.data_type() != g.data_type())
        else {
            return Ok(());
        };
        format!(
            "column {i} is {:?} of type {}, in a records file {:?} of type {}",
            g.name(),
            g.data_type(),
            w.name(),
            w.data_type()
        )
    };
    Err(read_err(
        path,
        format!("not a records file's schema: {problem}"),
    ))
}

fn column<'a, T: 'static>(batch: &'a RecordBatch, name: &str) -> Result<&'a T, String> {
    batch
        .column_by_name(name)
        .and_then(|c| c.as_any().downcast_ref::<T>())
        .ok_or_else(|| format!("column {name} is missing or of the wrong type"))
}

/// Decodes a batch of rows, checking each row's shape: as many segment ids as tokens, segments
/// and next-sentence labels 0 or 1, no negative id, as many masked ids as positions, positions
/// inside the sequence. An error carries the row's index in the batch (0 for a batch-wide one).
fn decode(batch: &RecordBatch, out: &mut Vec<Record>) -> Result<(), (usize, String)> {
    let whole = |m: String| (0, m);
    let ids = column::<ListArray>(batch, "input_ids").map_err(whole)?;
    let segments = column::<ListArray>(batch, "segment_ids").map_err(whole)?;
    let positions = column::<ListArray>(batch, "masked_lm_positions").map_err(whole)?;
    let masked = column::<ListArray>(batch, "masked_lm_ids").map_err(whole)?;
    let labels = column::<Int8Array>(batch, "next_sentence_label").map_err(whole)?;
    let i32s = |list: &ListArray, row: usize, name: &str| -> Result<Vec<u32>, String> {
        let v = list.value(row);
        let v = v
            .as_any()
            .downcast_ref::<Int32Array>()
            .ok_or(format!("{name} is a list of the wrong type"))?;
        v.values()
            .iter()
            .map(|&x| u32::try_from(x).map_err(|_| format!("{name} holds {x}")))
            .collect()
    };
    for row in 0..batch.num_rows() {
        let at = |m: String| (row, m);
        let seg = segments.value(row);
        let seg = seg
            .as_any()
            .downcast_ref::<Int8Array>()
            .ok_or_else(|| at("segment_ids of the wrong type".into()))?;
        let record = Record {
            input_ids: i32s(ids, row, "input_ids").map_err(at)?,
            segment_ids: seg.values().iter().map(|&x| x as u8).collect(),
            masked_lm_positions: i32s(positions, row, "masked_lm_positions").map_err(at)?,
            masked_lm_ids: i32s(masked, row, "masked_lm_ids").map_err(at)?,
            next_sentence_label: labels.value(row) as u8,
        };
        check_row(&record).map_err(at)?;
        out.push(record);
    }
    Ok(())
}

/// What a row must be for the trainer to use it (see [`decode`]).
fn check_row(r: &Record) -> Result<(), String> {
    let tokens = r.input_ids.len();
    if tokens == 0 {
        return Err("an empty sequence".into());
    }
    if r.segment_ids.len() != tokens {
        return Err(format!(
            "{} segment ids for {tokens} tokens",
            r.segment_ids.len()
        ));
    }
    if let Some(s) = r.segment_ids.iter().find(|&&s| s > 1) {
        return Err(format!("segment_ids holds {}, not 0 or 1", *s as i8));
    }
    if r.next_sentence_label > 1 {
        return Err(format!(
            "next_sentence_label is {}, not 0 or 1",
            r.next_sentence_label as i8
        ));
    }
    if r.masked_lm_ids.len() != r.masked_lm_positions.len() {
        return Err(format!(
            "{} masked ids for {} masked positions",
            r.masked_lm_ids.len(),
            r.masked_lm_positions.len()
        ));
    }
    if let Some(p) = r
        .masked_lm_positions
        .iter()
        .find(|&&p| p as usize >= tokens)
    {
        return Err(format!(
            "masked position {p} is outside the sequence of {tokens} tokens"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> Record {
        Record {
            input_ids: vec![2, 7, 4, 3, 9, 3],
            segment_ids: vec![0, 0, 0, 0, 1, 1],
            masked_lm_positions: vec![1, 4],
            masked_lm_ids: vec![8, 9],
            next_sentence_label: 1,
        }
    }

    /// A panic inside a call into the parquet crate (its `BYTE_STREAM_SPLIT` decoder indexes
    /// past a page short of its values) comes out as an error naming the file, what was read
    /// and the panic's message.
    #[test]
    fn a_panic_in_parquet_is_an_error() {
        let path = Path::new("x.parquet");
        let err = parquet_call::<()>(path, "row group 3", || {
            panic!("index out of bounds: the len is 4 but the index is {}", 9)
        })
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            "x.parquet: row group 3: the parquet crate panicked on it (index out of bounds: the \
             len is 4 but the index is 9): the file is damaged"
        );
        let err = parquet_call::<()>(path, "the footer", || std::panic::panic_any("a str"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("(a str)"), "{err}");
        assert_eq!(parquet_call(path, "x", || Ok(7)).unwrap(), 7);
    }

    /// Each way a hostile file's row can be malformed is named (the file and row are added by
    /// the caller); a well-formed row passes.
    #[test]
    fn malformed_rows_are_refused_with_what_is_wrong() {
        assert_eq!(check_row(&good()), Ok(()));
        type Spoil = fn(&mut Record);
        let cases: [(Spoil, &str); 7] = [
            (|r| r.input_ids.clear(), "an empty sequence"),
            (
                |r| {
                    r.segment_ids.pop();
                },
                "5 segment ids for 6 tokens",
            ),
            (|r| r.segment_ids[4] = 2, "segment_ids holds 2, not 0 or 1"),
            (
                |r| r.segment_ids[4] = 255,
                "segment_ids holds -1, not 0 or 1",
            ),
            (
                |r| r.next_sentence_label = 2,
                "next_sentence_label is 2, not 0 or 1",
            ),
            (
                |r| r.masked_lm_ids.push(3),
                "3 masked ids for 2 masked positions",
            ),
            (
                |r| r.masked_lm_positions[1] = 6,
                "masked position 6 is outside the sequence of 6 tokens",
            ),
        ];
        for (spoil, message) in cases {
            let mut r = good();
            spoil(&mut r);
            assert_eq!(check_row(&r), Err(message.to_string()));
        }
    }
}
