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
//! of the input, and the number of instances, plus the Arrow schema (as Arrow's own writer
//! stores it), so readers get the exact Arrow types back. Files are written under a hidden
//! `.partial` name and renamed into place.
//!
//! The columns are written through the parquet crate's column writers straight from the flat
//! instance buffers: values, and definition/repetition levels made from the list lengths (the
//! files are byte-identical to what its Arrow writer makes from Arrow arrays, without building
//! those). Rows are gathered in the shuffled order with the next rows prefetched.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::{ArrowSchemaConverter, add_encoded_arrow_schema_to_metadata};
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use parquet::file::writer::{SerializedFileWriter, SerializedRowGroupWriter};
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

/// How far ahead [`ColumnBuffer::list_of`] prefetches.
const PREFETCH_ROWS_AHEAD: usize = 6;

/// Hints the CPU to fetch the first cache lines of `items` (no effect on the result).
#[inline]
fn prefetch<T>(items: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let start = items.as_ptr() as *const i8;
        let bytes = std::mem::size_of_val(items);
        let mut offset = 0;
        while offset < bytes.min(256) {
            // SAFETY: a prefetch is a hint: it never faults, even on an invalid address, and
            // `start + offset` stays inside `items`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.add(offset)) };
            offset += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = items;
}

/// One column of a row group, as the column writer takes it: values, and for list columns the
/// definition and repetition levels (a non-empty list's values have definition level 1 and
/// repetition level 0 for the first, 1 for the rest; an empty list is one level pair (0, 0)).
#[derive(Default)]
struct ColumnBuffer {
    values: Vec<i32>,
    definition: Vec<i16>,
    repetition: Vec<i16>,
}

impl ColumnBuffer {
    fn clear(&mut self) {
        self.values.clear();
        self.definition.clear();
        self.repetition.clear();
    }

    /// Levels of a list of `len` values (the values are appended by the caller).
    fn list_levels(&mut self, len: usize) {
        if len == 0 {
            self.definition.push(0);
            self.repetition.push(0);
            return;
        }
        let start = self.definition.len();
        self.definition.resize(start + len, 1);
        self.repetition.resize(start + len, 1);
        self.repetition[start] = 0;
    }

    fn list_of<'a, T: Copy + 'a>(
        &mut self,
        rows: &[InstanceRef<'a>],
        field: impl Fn(&InstanceRef<'a>) -> &'a [T],
        convert: impl Fn(T) -> i32,
    ) {
        self.clear();
        for (k, row) in rows.iter().enumerate() {
            // Rows come in shuffled order from all over memory: ask for a row a few ahead.
            if let Some(ahead) = rows.get(k + PREFETCH_ROWS_AHEAD) {
                prefetch(field(ahead));
            }
            let items = field(row);
            self.values.extend(items.iter().map(|&v| convert(v)));
            self.list_levels(items.len());
        }
    }

    /// Writes the buffer as the row group's next column.
    fn write<W: std::io::Write + Send>(
        &self,
        group: &mut SerializedRowGroupWriter<'_, W>,
        list: bool,
    ) -> parquet::errors::Result<()> {
        let mut column = group.next_column()?.ok_or_else(|| {
            parquet::errors::ParquetError::General("more columns than the schema".into())
        })?;
        let (definition, repetition) = if list {
            (Some(&self.definition[..]), Some(&self.repetition[..]))
        } else {
            (None, None)
        };
        column
            .typed::<parquet::data_type::Int32Type>()
            .write_batch(&self.values, definition, repetition)?;
        column.close()
    }
}

/// Writes one row group: the six columns in schema order.
fn write_row_group<W: std::io::Write + Send>(
    writer: &mut SerializedFileWriter<W>,
    rows: &[InstanceRef<'_>],
    buffer: &mut ColumnBuffer,
) -> parquet::errors::Result<()> {
    let mut group = writer.next_row_group()?;
    buffer.list_of(rows, |r| r.input_ids, |v| v as i32);
    buffer.write(&mut group, true)?;
    // segment_ids: zeros for each row's first segment, then ones.
    buffer.clear();
    for row in rows {
        let start = buffer.values.len();
        buffer.values.resize(start + row.first_segment_len, 0);
        buffer.values.resize(start + row.input_ids.len(), 1);
        buffer.list_levels(row.input_ids.len());
    }
    buffer.write(&mut group, true)?;
    buffer.list_of(rows, |r| r.masked_lm_positions, |v| v as i32);
    buffer.write(&mut group, true)?;
    buffer.list_of(rows, |r| r.masked_lm_ids, |v| v as i32);
    buffer.write(&mut group, true)?;
    buffer.clear();
    buffer
        .values
        .extend(rows.iter().map(|r| r.is_random_next as i32));
    buffer.write(&mut group, false)?;
    buffer.clear();
    buffer
        .values
        .extend(rows.iter().map(|r| r.input_ids.len() as i32));
    buffer.write(&mut group, false)?;
    group.close()?;
    Ok(())
}

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
    let mut props = WriterProperties::builder()
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
    // The Arrow schema goes in the metadata, as Arrow's own writer puts it, so that readers get
    // the exact Arrow types back (int8 items, non-null lists).
    add_encoded_arrow_schema_to_metadata(&schema, &mut props);
    let parquet_schema = ArrowSchemaConverter::new().convert(&schema)?;
    let partial = bertkit_stage_io::partial_path(path);
    let file = std::io::BufWriter::with_capacity(1 << 20, File::create(&partial)?);
    let mut writer =
        SerializedFileWriter::new(file, parquet_schema.root_schema_ptr(), Arc::new(props))?;
    let mut rows = Vec::with_capacity(ROW_GROUP_ROWS);
    let mut buffer = ColumnBuffer::default();
    let mut all = instances.iter();
    loop {
        rows.clear();
        rows.extend(all.by_ref().take(ROW_GROUP_ROWS));
        if rows.is_empty() {
            break;
        }
        write_row_group(&mut writer, &rows, &mut buffer)?;
    }
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
