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
