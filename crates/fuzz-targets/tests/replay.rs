//! Every target runs, without a panic, over its seeds (real data from the shared folder) and
//! over every input the fuzzers found and kept in `fuzz/regressions/<target>/`, so a parser
//! fixed after a finding stays fixed.

use std::time::Instant;

use bertkit_fuzz_targets::{TARGETS, regressions, regressions_dir, seeds::seeds, target};

#[test]
fn every_target_takes_its_seeds() {
    for t in TARGETS {
        let inputs = seeds(t.name);
        assert!(
            inputs.len() >= 4,
            "target {}: only {} seeds",
            t.name,
            inputs.len()
        );
        for input in &inputs {
            (t.run)(input);
        }
    }
}

/// The seeds reach the parsers' working paths, not only their first refusal: real records
/// files open and read, real SQuAD files parse.
#[test]
fn seeds_are_valid_inputs() {
    use bertkit_records::reader::RecordsFile;
    let dir = tempfile::tempdir().unwrap();
    for (i, bytes) in seeds("records_parquet").iter().enumerate() {
        let path = dir.path().join(format!("{i}.parquet"));
        std::fs::write(&path, bytes).unwrap();
        let file = RecordsFile::open(&path).unwrap();
        let rows: usize = (0..file.row_group_rows().len())
            .map(|g| file.read_row_group(g).unwrap().len())
            .sum();
        assert!(rows >= 1);
    }
    for bytes in seeds("squad_json") {
        let dataset: bertkit_tasks::squad::data::Dataset =
            serde_json::from_slice(&bytes[1..]).expect("a SQuAD seed parses");
        assert_eq!(dataset.data.len(), 1);
    }
}

#[test]
fn every_kept_input_replays() {
    let dir = regressions_dir();
    // Every folder is a target's (a misspelt one would be skipped silently).
    if dir.is_dir() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            if entry.path().is_dir() {
                let name = entry.file_name().to_string_lossy().into_owned();
                assert!(
                    target(&name).is_some(),
                    "{}: no target {name}",
                    dir.display()
                );
            }
        }
    }
    for t in TARGETS {
        for (path, bytes) in regressions(t.name).unwrap() {
            let started = Instant::now();
            (t.run)(&bytes);
            // The fuzzers' limit is 1 s in an optimised build; this test's build is not.
            let seconds = started.elapsed().as_secs_f64();
            assert!(seconds < 20.0, "{}: {seconds:.1} s", path.display());
        }
    }
}
