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
//! the ids 2.5 times faster and 17% smaller than plain values. `segment_ids` (runs of 0 and 1)
//! stay plain. Then zstd level 1 (level 3 made files 8% smaller and the whole stage 15-25%
//! slower), and no column statistics (nothing reads them). See BENCHMARKS.md.
//!
//! Row groups of [`ROW_GROUP_ROWS`] rows: about 1 MiB of ids at phase 1 and 4 MiB at
//! phase 2. That is small enough for a memory-mapped reader to shuffle at row-group granularity
//! and decode one group at a time, and large enough for zstd to compress well. The key-value
//! metadata holds the layout name, the generation parameters, the SHA-256 of the vocabulary and
//! of the input, and the number of instances. Files are written under a hidden `.partial` name
//! and renamed into place.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow_array::{ArrayRef, Int8Array, Int32Array, RecordBatch};
use arrow_buffer::OffsetBuffer;
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;

use crate::instances::{InstanceRef, Instances};

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

/// A `list<item>` column from per-row slices, built as one values buffer and one offsets buffer.
fn list_column<'a, T: Copy + 'a, A: arrow_array::types::ArrowPrimitiveType>(
    rows: &[InstanceRef<'a>],
    item: DataType,
    field: impl Fn(&InstanceRef<'a>) -> &'a [T],
    convert: impl Fn(T) -> A::Native,
) -> ArrayRef {
    let total: usize = rows.iter().map(|r| field(r).len()).sum();
    let mut values: Vec<A::Native> = Vec::with_capacity(total);
    let mut offsets: Vec<i32> = Vec::with_capacity(rows.len() + 1);
    offsets.push(0);
    for row in rows {
        values.extend(field(row).iter().map(|&v| convert(v)));
        offsets.push(values.len() as i32);
    }
    list_array::<A>(item, values, offsets)
}

fn list_array<A: arrow_array::types::ArrowPrimitiveType>(
    item: DataType,
    values: Vec<A::Native>,
    offsets: Vec<i32>,
) -> ArrayRef {
    let values = arrow_array::PrimitiveArray::<A>::new(values.into(), None);
    Arc::new(arrow_array::ListArray::new(
        Arc::new(Field::new("item", item, false)),
        OffsetBuffer::new(offsets.into()),
        Arc::new(values),
        None,
    ))
}

/// The `segment_ids` column: zeros for each row's first segment, then ones.
fn segment_column(rows: &[InstanceRef<'_>]) -> ArrayRef {
    let total: usize = rows.iter().map(|r| r.input_ids.len()).sum();
    let mut values: Vec<i8> = Vec::with_capacity(total);
    let mut offsets: Vec<i32> = Vec::with_capacity(rows.len() + 1);
    offsets.push(0);
    for row in rows {
        let start = values.len();
        values.resize(start + row.first_segment_len, 0);
        values.resize(start + row.input_ids.len(), 1);
        offsets.push(values.len() as i32);
    }
    list_array::<arrow_array::types::Int8Type>(DataType::Int8, values, offsets)
}

/// One row group's columns.
fn batch(rows: &[InstanceRef<'_>], schema: &Arc<Schema>) -> parquet::errors::Result<RecordBatch> {
    use arrow_array::types::Int32Type;
    let columns: Vec<ArrayRef> = vec![
        list_column::<_, Int32Type>(rows, DataType::Int32, |r| r.input_ids, |v| v as i32),
        segment_column(rows),
        list_column::<_, Int32Type>(
            rows,
            DataType::Int32,
            |r| r.masked_lm_positions,
            |v| v as i32,
        ),
        list_column::<_, Int32Type>(rows, DataType::Int32, |r| r.masked_lm_ids, |v| v as i32),
        Arc::new(Int8Array::from_iter_values(
            rows.iter().map(|r| r.is_random_next as i8),
        )),
        Arc::new(Int32Array::from_iter_values(
            rows.iter().map(|r| r.input_ids.len() as i32),
        )),
    ];
    Ok(RecordBatch::try_new(schema.clone(), columns)?)
}

/// Writes instances to `path` atomically, with `metadata` (key, value) pairs added to the
/// layout name and the instance count.
pub fn write_instances(
    path: &Path,
    instances: &Instances,
    metadata: &[(String, String)],
) -> parquet::errors::Result<()> {
    let schema = Arc::new(arrow_schema());
    let mut kv = vec![
        KeyValue::new("bertkit.layout".to_string(), LAYOUT.to_string()),
        KeyValue::new("bertkit.instances".to_string(), instances.len().to_string()),
    ];
    kv.extend(
        metadata
            .iter()
            .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
    );
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(1)?))
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        // Ids are high-cardinality: dictionary pages cost time and zstd does better alone.
        .set_dictionary_enabled(false)
        .set_encoding(Encoding::BYTE_STREAM_SPLIT)
        // Runs of 0 and 1: plain values compress as well and skip the byte split.
        .set_column_encoding(
            ColumnPath::from(vec!["segment_ids".into(), "list".into(), "item".into()]),
            Encoding::PLAIN,
        )
        .set_statistics_enabled(parquet::file::properties::EnabledStatistics::None)
        .set_key_value_metadata(Some(kv))
        .build();
    let partial = bertkit_stage_io::partial_path(path);
    let file = File::create(&partial)?;
    let mut writer = ArrowWriter::try_new(file, schema.clone(), Some(props))?;
    let mut rows = Vec::with_capacity(ROW_GROUP_ROWS);
    let mut all = instances.iter();
    loop {
        rows.clear();
        rows.extend(all.by_ref().take(ROW_GROUP_ROWS));
        if rows.is_empty() {
            break;
        }
        writer.write(&batch(&rows, &schema)?)?;
    }
    let file = writer.into_inner()?;
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
