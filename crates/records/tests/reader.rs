//! The memory-mapped reader returns exactly what was written, row group by row group, and
//! refuses files that are not records files.

use bertkit_records::instances::{Instances, TrainingInstance};
use bertkit_records::parquet_file::{ROW_GROUP_ROWS, write_instances};
use bertkit_records::reader::RecordsFile;

fn instance(i: usize) -> TrainingInstance {
    let n = 5 + i % 50;
    TrainingInstance {
        // Ids past 2^16 (multilingual vocabularies) and 2^24 use every byte stream.
        input_ids: (0..n)
            .map(|j| ((i * 7 + j) * 4099) as u32 % 200_003)
            .collect(),
        first_segment_len: n / 2 + 1,
        is_random_next: i.is_multiple_of(3),
        // Every seventh instance has no masks: an empty list is written and read back.
        masked_lm_positions: if i.is_multiple_of(7) {
            vec![]
        } else {
            vec![1, 3 + (i % 2) as u32]
        },
        masked_lm_ids: if i.is_multiple_of(7) {
            vec![]
        } else {
            vec![i as u32, 9001 * i as u32]
        },
    }
}

#[test]
fn row_groups_read_back_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.parquet");
    let count = ROW_GROUP_ROWS * 2 + 100;
    let instances: Vec<TrainingInstance> = (0..count).map(instance).collect();
    write_instances(&path, &Instances::from_owned(&instances), &[]).unwrap();
    let file = RecordsFile::open(&path).unwrap();
    assert_eq!(
        file.row_group_rows(),
        vec![ROW_GROUP_ROWS, ROW_GROUP_ROWS, 100]
    );
    assert_eq!(
        file.metadata_value("bertkit.instances"),
        Some(count.to_string())
    );
    let mut all = Vec::new();
    for g in 0..3 {
        all.extend(file.read_row_group(g).unwrap());
    }
    assert_eq!(all.len(), count);
    for (r, i) in all.iter().zip(&instances) {
        assert_eq!(r.input_ids, i.input_ids);
        assert_eq!(r.segment_ids, i.as_ref().segment_ids());
        assert_eq!(
            r.segment_ids.iter().filter(|&&s| s == 0).count(),
            i.first_segment_len
        );
        assert_eq!(r.next_sentence_label, u8::from(i.is_random_next));
        assert_eq!(r.masked_lm_positions, i.masked_lm_positions);
        assert_eq!(r.masked_lm_ids, i.masked_lm_ids);
    }
    assert!(file.read_row_group(3).is_err());

    let not_records = dir.path().join("y.parquet");
    std::fs::write(&not_records, b"PAR1 nothing").unwrap();
    let err = RecordsFile::open(&not_records).err().unwrap().to_string();
    assert!(
        err.contains("y.parquet") && err.contains("not a Parquet file"),
        "{err}"
    );
}

/// Bytes changed inside a row group's pages (a bad disk, a bad copy) would decode to other ids
/// without any error from zstd or Parquet: the group's stored SHA-256 catches them, and only
/// that group is refused.
#[test]
fn a_damaged_row_group_is_refused_by_its_digest() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.parquet");
    let instances: Vec<TrainingInstance> = (0..ROW_GROUP_ROWS * 2).map(instance).collect();
    write_instances(&path, &Instances::from_owned(&instances), &[]).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    // The pages lie between the leading magic and the footer (whose length precedes the
    // trailing magic); a byte three quarters in is in the second group's pages.
    let n = bytes.len();
    let footer = u32::from_le_bytes(bytes[n - 8..n - 4].try_into().unwrap()) as usize;
    let pages = 4..n - 8 - footer;
    bytes[pages.start + pages.len() * 3 / 4] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let file = RecordsFile::open(&path).unwrap();
    assert_eq!(file.read_row_group(0).unwrap().len(), ROW_GROUP_ROWS);
    let err = file.read_row_group(1).unwrap_err().to_string();
    assert!(
        err.contains("x.parquet: row group 1 (bytes ")
            && err.contains("does not match its SHA-256"),
        "{err}"
    );
}

/// A file of `rows` instances in one row group, and its bytes.
fn one_group(dir: &std::path::Path, rows: usize) -> (std::path::PathBuf, Vec<u8>) {
    let path = dir.join("x.parquet");
    let instances: Vec<TrainingInstance> = (0..rows).map(instance).collect();
    write_instances(&path, &Instances::from_owned(&instances), &[]).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    (path, bytes)
}

/// A page header carrying a field the parquet crate does not know, a list declaring
/// 2^31 - 1 doubles, in a file whose row-group digest matches (as a hostile writer makes it):
/// the parquet crate would skip those doubles one by one past the end of the file for seconds
/// (the `records_parquet` fuzz target found it); the header is refused before it reads it.
#[test]
fn a_hostile_page_header_is_refused_before_parquet_reads_it() {
    use sha2::Digest;
    let dir = tempfile::tempdir().unwrap();
    let (path, mut bytes) = one_group(dir.path(), 100);
    let n = bytes.len();
    let footer_len = u32::from_le_bytes(bytes[n - 8..n - 4].try_into().unwrap()) as usize;
    let pages = 4..n - 8 - footer_len;
    let digest = |b: &[u8]| bertkit_stage_io::hex(&sha2::Sha256::digest(&b[pages.clone()]));
    let old_digest = digest(&bytes);
    // The first column chunk (input_ids, no dictionary page) starts right after the magic
    // with its page header: type, uncompressed and compressed sizes (three i32 fields, 0x15),
    // then field 5, the data page header (0x2c), whose first eight bytes become field 6 (not
    // one parquet knows) holding a list (0x69) of 2^31 - 1 doubles (0xf7, varint 0x7fffffff).
    let data_page_header = 4 + bytes[4..40].iter().position(|&b| b == 0x2c).unwrap() + 1;
    bytes[data_page_header..data_page_header + 8]
        .copy_from_slice(&[0x69, 0xf7, 0xff, 0xff, 0xff, 0xff, 0x07, 0x00]);
    let new_digest = digest(&bytes);
    let footer = n - 8 - footer_len..n - 8;
    let at = footer.start
        + bytes[footer.clone()]
            .windows(64)
            .position(|w| w == old_digest.as_bytes())
            .expect("the footer holds the row group's digest");
    bytes[at..at + 64].copy_from_slice(new_digest.as_bytes());
    std::fs::write(&path, &bytes).unwrap();

    let file = RecordsFile::open(&path).unwrap();
    let start = std::time::Instant::now();
    let err = file.read_row_group(0).unwrap_err().to_string();
    assert!(
        err.contains("x.parquet: row group 0 column 0 (bytes 4..")
            && err.contains("2147483647 elements or bytes declared")
            && err.contains("the file is damaged"),
        "{err}"
    );
    assert!(start.elapsed().as_secs_f64() < 0.5, "{:?}", start.elapsed());
}

/// A Parquet file that says it is a records file but has other columns is refused when it is
/// opened, naming the first column that differs.
#[test]
fn a_file_with_other_columns_is_refused_when_opened() {
    use std::sync::Arc;

    use arrow_array::{Int64Array, RecordBatch};
    use arrow_schema::{DataType, Field, Schema};
    use parquet::arrow::ArrowWriter;
    use parquet::file::metadata::KeyValue;
    use parquet::file::properties::WriterProperties;

    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, fields: Vec<Field>| {
        let path = dir.path().join(name);
        let columns = fields.len();
        let schema = Arc::new(Schema::new(fields));
        let props = WriterProperties::builder()
            .set_key_value_metadata(Some(vec![KeyValue::new(
                "bertkit.layout".to_string(),
                bertkit_records::parquet_file::LAYOUT.to_string(),
            )]))
            .build();
        let file = std::fs::File::create(&path).unwrap();
        let mut writer = ArrowWriter::try_new(file, schema.clone(), Some(props)).unwrap();
        let arrays = (0..columns)
            .map(|_| Arc::new(Int64Array::from(vec![1i64, 2])) as _)
            .collect();
        writer
            .write(&RecordBatch::try_new(schema, arrays).unwrap())
            .unwrap();
        writer.close().unwrap();
        RecordsFile::open(&path).err().unwrap().to_string()
    };
    // The records file's column names, every column an Int64 (so one batch fits them all).
    let fields: Vec<Field> = bertkit_records::parquet_file::arrow_schema()
        .fields()
        .iter()
        .map(|f| Field::new(f.name(), DataType::Int64, false))
        .collect();
    let err = write("wrong_type.parquet", fields.clone());
    assert!(
        err.contains("wrong_type.parquet: not a records file's schema: column 0 is \"input_ids\" of type Int64, in a records file \"input_ids\" of type List("),
        "{err}"
    );
    let err = write("short.parquet", fields[..2].to_vec());
    assert!(
        err.contains(
            "short.parquet: not a records file's schema: it has 2 columns, a records file 6"
        ),
        "{err}"
    );
}

/// Hostile footers the fuzz target found, refused at once by the footer walk:
/// - a list of 237 million booleans where a column's path is: the parquet crate skips such a
///   list an element at a time without reading a byte, for most of a second;
/// - a field parquet reads by its id (a schema element's repetition) given another wire type:
///   parquet reads it as its own type all the same, so its reading went elsewhere than the
///   footer's wire types say, into such a list of booleans.
#[test]
fn hostile_footers_are_refused_at_once() {
    for (kept, message) in [
        (
            "timeout-footer-list-of-booleans",
            "the footer (bytes 85..1691): byte 530 of the footer: a collection of booleans",
        ),
        (
            "timeout-footer-field-of-another-type",
            "the footer (bytes 61..1667): byte 23 of the footer: SchemaElement field 3 has wire \
             type bool, the Parquet format types it i32",
        ),
    ] {
        let path = bertkit_test_support::repo_root()
            .join("fuzz/regressions/records_parquet")
            .join(kept);
        let start = std::time::Instant::now();
        let err = RecordsFile::open(&path).err().unwrap().to_string();
        assert!(
            err.contains(&format!("{kept}: {message}: the file is damaged")),
            "{err}"
        );
        assert!(start.elapsed().as_secs_f64() < 0.2, "{:?}", start.elapsed());
    }
}
