//! The records stage's Parquet files (layout `bertkit-records-v1`, described in
//! `schemas/records.schema.json`).
//!
//! One row per training instance, unpadded:
//! - `input_ids: list<int32>`: vocabulary ids of `[CLS] A [SEP] B [SEP]`, after masking;
//! - `segment_ids: list<int8>`: 0 for `[CLS]`, A and the first `[SEP]`, 1 for the rest;
//! - `masked_lm_positions: list<int32>`: masked positions, ascending;
//! - `masked_lm_ids: list<int32>`: vocabulary ids of the original tokens there;
//! - `next_sentence_label: int8`: 1 when B is a random next (as NVIDIA's loaders expect), else 0;
//! - `seq_len: int32`: the length of `input_ids`, for length-bucketed batching.
//!
//! Integer columns are `BYTE_STREAM_SPLIT`-encoded (Parquet format 2.11, read by pyarrow 16
//! and later): ids below 2^16 leave two of the four byte streams all zero, so zstd compresses
//! the ids 2.5 times faster and 17% smaller than plain values. `segment_ids` (a run of 0s then
//! a run of 1s per row) are dictionary-encoded: two RLE runs per row. Then zstd level 1 (level
//! 3 made files 8% smaller and the whole stage 15-25% slower), and no column statistics
//! (nothing reads them). See BENCHMARKS.md. One data page per column chunk.
//!
//! Row groups of [`ROW_GROUP_ROWS`] rows: about 1 MiB of ids at phase 1 and 4 MiB at
//! phase 2. That is small enough for a memory-mapped reader to shuffle at row-group granularity
//! and decode one group at a time, and large enough for zstd to compress well. The key-value
//! metadata holds the layout name, the generation parameters, the SHA-256 of the vocabulary and
//! of the input, and the number of instances, plus the Arrow schema (as Arrow's own writer
//! stores it), so readers get the exact Arrow types back. Files are written under a hidden
//! `.partial` name and renamed into place.
//!
//! Parquet's page checksums are optional and the parquet crate writes none, and zstd frames
//! as Parquet writes them carry no checksum either: bytes changed on a bad disk or in a bad
//! copy can decode to other ids without any error. So the metadata also holds
//! [`ROW_GROUP_SHA256_KEY`]: the SHA-256 of each row group's bytes (its column chunks, which
//! lie back to back in the file), which [`crate::reader::RecordsFile`] checks before decoding a
//! group. Files without it (written before it existed) are read unchecked.
//!
//! The column chunks are encoded by a private module (`parquet_chunks`) straight from the flat instance
//! buffers, gathered a row group at a time in the shuffled order (the next rows prefetched).
//! Row groups are encoded in parallel, a few per thread at a time, and written in order, so
//! the output does not depend on the thread count; the parquet crate writes the page headers
//! and the footer.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::{ArrowSchemaConverter, add_encoded_arrow_schema_to_metadata};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use sha2::{Digest, Sha256};

use parquet::schema::types::SchemaDescriptor;
use rayon::prelude::*;

use crate::instances::{Instances, RowScratch};
use crate::parquet_chunks::{ChunkEncoder, ColumnValues, EncodedChunk};

/// Name of the file layout, stored in the metadata under `bertkit.layout`.
pub const LAYOUT: &str = "bertkit-records-v1";

/// Rows per row group.
pub const ROW_GROUP_ROWS: usize = 2048;

fn list_of(name: &str, item: DataType) -> Field {
    Field::new(
        name,
        DataType::List(Arc::new(Field::new("item", item, false))),
        false,
    )
}

/// The Arrow schema of a records file.
pub fn arrow_schema() -> Schema {
    Schema::new(vec![
        list_of("input_ids", DataType::Int32),
        list_of("segment_ids", DataType::Int8),
        list_of("masked_lm_positions", DataType::Int32),
        list_of("masked_lm_ids", DataType::Int32),
        Field::new("next_sentence_label", DataType::Int8, false),
        Field::new("seq_len", DataType::Int32, false),
    ])
}

thread_local! {
    /// Each thread's row-group buffers and chunk encoder, kept between the row groups and
    /// files it encodes.
    static WRITER_BUFFERS: std::cell::Cell<Option<(RowGroupColumns, ChunkEncoder)>> =
        const { std::cell::Cell::new(None) };
}

/// How far ahead [`RowGroupColumns::gather`] prefetches.
const PREFETCH_ROWS_AHEAD: usize = 6;

/// A row group's columns, gathered from its rows (reused from group to group).
#[derive(Default)]
struct RowGroupColumns {
    input_ids: Vec<u32>,
    seq_lens: Vec<u32>,
    first_segment_lens: Vec<u32>,
    masked_lm_positions: Vec<u32>,
    masked_lm_ids: Vec<u32>,
    masked_lm_lens: Vec<u32>,
    next_sentence_labels: Vec<u32>,
    scratch: RowScratch,
}

impl RowGroupColumns {
    fn gather(&mut self, instances: &Instances<'_>, rows: std::ops::Range<usize>) {
        self.input_ids.clear();
        self.seq_lens.clear();
        self.first_segment_lens.clear();
        self.masked_lm_positions.clear();
        self.masked_lm_ids.clear();
        self.masked_lm_lens.clear();
        self.next_sentence_labels.clear();
        for k in rows.clone() {
            // Rows come in shuffled order from all over memory: ask for a row's fields well
            // ahead, and for its tokens and masks (found through its fields) a few rows ahead.
            if k + 2 * PREFETCH_ROWS_AHEAD < rows.end {
                instances.prefetch_fields(k + 2 * PREFETCH_ROWS_AHEAD);
            }
            if k + PREFETCH_ROWS_AHEAD < rows.end {
                instances.prefetch_data(k + PREFETCH_ROWS_AHEAD);
            }
            let start = self.input_ids.len();
            let masks_start = self.masked_lm_positions.len();
            let row = instances.append_row(
                k,
                &mut self.input_ids,
                &mut self.masked_lm_positions,
                &mut self.masked_lm_ids,
                &mut self.scratch,
            );
            self.seq_lens.push((self.input_ids.len() - start) as u32);
            self.first_segment_lens.push(row.first_segment_len as u32);
            self.masked_lm_lens
                .push((self.masked_lm_positions.len() - masks_start) as u32);
            self.next_sentence_labels
                .push(u32::from(row.is_random_next));
        }
    }
}

/// Encodes one row group: the six column chunks in schema order.
fn encode_row_group(
    schema: &SchemaDescriptor,
    instances: &Instances<'_>,
    rows: std::ops::Range<usize>,
    columns: &mut RowGroupColumns,
    encoder: &mut ChunkEncoder,
) -> parquet::errors::Result<Vec<EncodedChunk>> {
    columns.gather(instances, rows.clone());
    let n = rows.len();
    let c = &*columns;
    let values = [
        ColumnValues::IntLists {
            values: &c.input_ids,
            lengths: &c.seq_lens,
            token_ids: true,
        },
        ColumnValues::ZeroOneLists {
            lengths: &c.seq_lens,
            zeros: &c.first_segment_lens,
        },
        ColumnValues::IntLists {
            values: &c.masked_lm_positions,
            lengths: &c.masked_lm_lens,
            token_ids: false,
        },
        ColumnValues::IntLists {
            values: &c.masked_lm_ids,
            lengths: &c.masked_lm_lens,
            token_ids: false,
        },
        ColumnValues::Ints(&c.next_sentence_labels),
        ColumnValues::Ints(&c.seq_lens),
    ];
    values
        .into_iter()
        .enumerate()
        .map(|(i, column)| encoder.encode(&schema.column(i), n, column))
        .collect()
}

/// [`encode_row_group`] with the calling thread's buffers and chunk encoder, kept between the
/// row groups and files it encodes (memory touched once, zstd contexts set up once).
fn encode_row_group_with_thread_buffers(
    schema: &SchemaDescriptor,
    instances: &Instances<'_>,
    rows: std::ops::Range<usize>,
) -> parquet::errors::Result<Vec<EncodedChunk>> {
    let (mut columns, mut encoder) = match WRITER_BUFFERS.take() {
        Some(buffers) => buffers,
        None => (RowGroupColumns::default(), ChunkEncoder::new()?),
    };
    let encoded = encode_row_group(schema, instances, rows, &mut columns, &mut encoder);
    WRITER_BUFFERS.set(Some((columns, encoder)));
    encoded
}

/// Row groups encoded at once, in parallel, before they are written in order: a few per
/// thread, so that threads are kept busy while the encoded groups waiting to be written stay
/// a bounded amount of memory (a row group is about 1 MiB of ids at phase 1).
const ROW_GROUPS_IN_FLIGHT_PER_THREAD: usize = 2;

/// The metadata key of the row groups' SHA-256 digests: a JSON array of lower-case hex
/// strings, one per row group in order, each over the group's column chunks as they lie in the
/// file.
pub const ROW_GROUP_SHA256_KEY: &str = "bertkit.row_group_sha256";

/// Writes instances to `path` atomically, with `metadata` (key, value) pairs added to the
/// layout name and the instance count.
pub fn write_instances(
    path: &Path,
    instances: &Instances,
    metadata: &[(String, String)],
) -> parquet::errors::Result<()> {
    let schema = arrow_schema();
    let mut kv = vec![
        KeyValue::new("bertkit.layout".to_string(), LAYOUT.to_string()),
        KeyValue::new("bertkit.instances".to_string(), instances.len().to_string()),
    ];
    kv.extend(
        metadata
            .iter()
            .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
    );
    // The column chunks are encoded by `parquet_chunks`: the properties only carry the
    // metadata (and the writer's defaults for what it still writes: the footer).
    let mut props = WriterProperties::builder()
        .set_key_value_metadata(Some(kv))
        .build();
    // The Arrow schema goes in the metadata, as Arrow's own writer puts it, so that readers get
    // the exact Arrow types back (int8 items, non-null lists).
    add_encoded_arrow_schema_to_metadata(&schema, &mut props);
    let parquet_schema = ArrowSchemaConverter::new().convert(&schema)?;
    let partial = bertkit_stage_io::partial_path(path);
    let file = std::io::BufWriter::with_capacity(1 << 20, File::create(&partial)?);
    let mut writer =
        SerializedFileWriter::new(file, parquet_schema.root_schema_ptr(), Arc::new(props))?;
    // Row groups are encoded in parallel (on the thread pool, whose threads keep their
    // buffers), a batch at a time, and written in order.
    let groups: Vec<std::ops::Range<usize>> = (0..instances.len())
        .step_by(ROW_GROUP_ROWS)
        .map(|start| start..(start + ROW_GROUP_ROWS).min(instances.len()))
        .collect();
    let batch = ROW_GROUPS_IN_FLIGHT_PER_THREAD * rayon::current_num_threads();
    let mut digests = Vec::with_capacity(groups.len());
    for groups in groups.chunks(batch.max(1)) {
        let encoded: Vec<_> = groups
            .par_iter()
            .map(|rows| {
                let chunks =
                    encode_row_group_with_thread_buffers(&parquet_schema, instances, rows.clone())?;
                let mut sha = Sha256::new();
                for chunk in &chunks {
                    sha.update(chunk.bytes());
                }
                Ok((chunks, bertkit_stage_io::hex(&sha.finalize())))
            })
            .collect::<Vec<parquet::errors::Result<_>>>();
        for result in encoded {
            let (chunks, digest) = result?;
            let mut group = writer.next_row_group()?;
            for chunk in chunks {
                chunk.append_to(&mut group)?;
            }
            group.close()?;
            digests.push(digest);
        }
    }
    writer.append_key_value_metadata(KeyValue::new(
        ROW_GROUP_SHA256_KEY.to_string(),
        serde_json::to_string(&digests).expect("strings serialise"),
    ));
    let file = writer
        .into_inner()?
        .into_inner()
        .map_err(|e| parquet::errors::ParquetError::External(Box::new(e.into_error())))?;
    file.sync_all()?;
    std::fs::rename(&partial, path)?;
    Ok(())
}

/// The key-value metadata of a records file (to check whether it is complete and current).
pub fn read_metadata(path: &Path) -> Option<Vec<(String, String)>> {
    let file = File::open(path).ok()?;
    let reader = parquet::file::reader::SerializedFileReader::new(file).ok()?;
    use parquet::file::reader::FileReader;
    let kv = reader
        .metadata()
        .file_metadata()
        .key_value_metadata()?
        .clone();
    Some(
        kv.into_iter()
            .map(|k| (k.key, k.value.unwrap_or_default()))
            .collect(),
    )
}
