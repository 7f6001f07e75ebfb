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
