//! The demo pipeline end to end from the shared data folder as a mirror: every step runs, a
//! second run finds every step up to date, and after a change only the steps downstream of it
//! run again.

use bertkit_pipeline::{PipelineConfig, RunOptions, run};
use bertkit_stage_io::stage::Silent;
use bertkit_test_support::{repo_root, shared_data_dir};

#[test]
fn demo_pipeline_runs_every_step_and_reruns_as_a_no_op() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = PipelineConfig::load(&repo_root().join("pipelines/demo.toml")).unwrap();
    config.output = dir.path().join("demo");
    let registry =
        bertkit_download::sources::Registry::load(&repo_root().join("pipelines/sources.toml"))
            .unwrap();
    let mirror = shared_data_dir().unwrap();

    let first = run(
        &config,
        &registry,
        mirror.to_str(),
        &RunOptions::default(),
        &Silent,
    )
    .unwrap();
    assert!(!first.is_up_to_date());
    let first = first.into_summary();
    let steps: Vec<&str> = first.iter().map(|r| r.step.as_str()).collect();
    assert_eq!(
        steps,
        [
            "download demo",
            "format wiki",
            "format books",
            "shard",
            "records phase 1",
            "records phase 2",
            "records phase 1 held-out",
            "records phase 2 held-out"
        ]
    );
    assert!(first.iter().all(|r| !r.up_to_date), "{first:?}");
    assert!(
        first[1].summary.starts_with("97 documents"),
        "{}",
        first[1].summary
    );
    assert!(
        first[3].summary.starts_with("100 documents into 5 shards"),
        "{}",
        first[3].summary
    );
    // Each phase's sequences: at most its length (and most of them near it), framed by [CLS]
    // and [SEP], with exactly round(15% of the tokens) masks (at least 1, at most the cap).
    // (Tried: phase 2 made with phase 1's preset fails here; a file-exists check did not.)
    for (phase, max_len, max_masks) in [(1, 128, 20), (2, 512, 80)] {
        let (mut rows, mut long) = (0, 0);
        for shard in 0..4 {
            let path = config
                .output
                .join(format!("records/phase{phase}/shard_{shard:05}.parquet"));
            let file = bertkit_records::reader::RecordsFile::open(&path).unwrap();
            for group in 0..file.row_group_rows().len() {
                for r in file.read_row_group(group).unwrap() {
                    let len = r.input_ids.len();
                    assert!(len <= max_len, "phase {phase}: {len} tokens");
                    assert_eq!((r.input_ids[0], r.input_ids[len - 1]), (101, 102));
                    let wanted =
                        ((len as f64 * 0.15).round_ties_even() as usize).clamp(1, max_masks);
                    assert_eq!(
                        r.masked_lm_positions.len(),
                        wanted,
                        "phase {phase}, {len} tokens"
                    );
                    assert_eq!(r.masked_lm_ids.len(), wanted);
                    rows += 1;
                    long += usize::from(len > max_len * 9 / 10);
                }
            }
        }
        // The target length is the maximum except for short_seq_prob (10%) of instances and
        // documents' ends.
        assert!(
            long * 2 > rows,
            "phase {phase}: {long} of {rows} near {max_len}"
        );
    }

    // The held-out records: the one test shard's, per phase, for pre-training's evaluation.
    for phase in [1, 2] {
        let dir = config.output.join(format!("records/phase{phase}-heldout"));
        let files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".parquet"))
            .collect();
        assert_eq!(files, ["shard_00000.parquet"], "{}", dir.display());
        let file = bertkit_records::reader::RecordsFile::open(&dir.join(&files[0])).unwrap();
        assert!(file.row_group_rows().iter().sum::<usize>() > 50);
    }

    let second = run(
        &config,
        &registry,
        mirror.to_str(),
        &RunOptions::default(),
        &Silent,
    )
    .unwrap();
    assert!(second.is_up_to_date());
    let second = second.into_summary();
    assert!(second.iter().all(|r| r.up_to_date), "{second:?}");

    // After a change, exactly the steps downstream of it run again.
    let rerun = |config: &PipelineConfig| -> Vec<String> {
        run(
            config,
            &registry,
            mirror.to_str(),
            &RunOptions::default(),
            &Silent,
        )
        .unwrap()
        .into_summary()
        .into_iter()
        .filter(|r| !r.up_to_date)
        .map(|r| r.step)
        .collect()
    };
    // A new book among the raw books: the books are formatted again, then everything after.
    let books = config.output.join("raw/gutenberg");
    let emma = std::fs::read_to_string(books.join("austen-emma.txt")).unwrap();
    let cut = emma.char_indices().nth(30_000).unwrap().0;
    std::fs::write(books.join("extra-book.txt"), &emma[..cut]).unwrap();
    assert_eq!(
        rerun(&config),
        [
            "format books",
            "shard",
            "records phase 1",
            "records phase 2",
            "records phase 1 held-out",
            "records phase 2 held-out"
        ]
    );
    // Another shard seed: sharding and the records.
    config.shard.seed += 1;
    let records = [
        "records phase 1",
        "records phase 2",
        "records phase 1 held-out",
        "records phase 2 held-out",
    ];
    assert_eq!(rerun(&config), [&["shard"][..], &records[..]].concat());
    // Another records seed: the records alone.
    config.records.seed += 1;
    assert_eq!(rerun(&config), records);
    // A book and the vocabulary rewritten with the same bytes (new modification times):
    // nothing runs, since steps compare contents when only the time moved. (Tried: with
    // inputs compared by modification time alone, as before, the book reruns its formatting
    // and everything after it, and this fails.)
    std::thread::sleep(std::time::Duration::from_millis(20));
    for file in [
        "raw/gutenberg/melville-moby_dick.txt",
        "raw/minilm/vocab.txt",
    ] {
        let path = config.output.join(file);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes).unwrap();
    }
    assert!(rerun(&config).is_empty());
}

#[test]
fn the_full_data_config_parses() {
    let config = PipelineConfig::load(&repo_root().join("pipelines/data.toml")).unwrap();
    assert_eq!(config.shard.num_train_shards, 256);
    assert_eq!(config.records.phases, vec![1, 2]);
    assert_eq!(config.download.vars["date"], "20240101");
}

/// A misspelt key is named, with the file, rather than reported as a missing one.
#[test]
fn a_config_typo_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(repo_root().join("pipelines/demo.toml"))
        .unwrap()
        .replace("num_train_shards", "num_train_shard");
    let path = dir.path().join("typo.toml");
    std::fs::write(&path, text).unwrap();
    let err = PipelineConfig::load(&path).unwrap_err().to_string();
    assert!(err.contains("typo.toml"), "{err}");
    assert!(err.contains("unknown field `num_train_shard`"), "{err}");
}

/// The format and records paths take the download's variables (one `date` names the dump to
/// fetch and to format); a variable no one set stops the run before anything is fetched.
#[test]
fn config_paths_take_the_download_variables() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = PipelineConfig::load(&repo_root().join("pipelines/demo.toml")).unwrap();
    config.output = dir.path().join("demo");
    config.format.wiki = vec!["wikipedia/enwiki-{date}.xml.bz2".into()];
    let registry =
        bertkit_download::sources::Registry::load(&repo_root().join("pipelines/sources.toml"))
            .unwrap();
    let mirror = shared_data_dir().unwrap();
    let err = run(
        &config,
        &registry,
        mirror.to_str(),
        &RunOptions::default(),
        &Silent,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("wikipedia/enwiki-{date}.xml.bz2") && err.contains("needs --var date="),
        "{err}"
    );
    assert!(!dir.path().join("demo/raw").exists(), "nothing fetched");

    let data = PipelineConfig::load(&repo_root().join("pipelines/data.toml")).unwrap();
    let vars: std::collections::HashMap<_, _> = data.download.vars.clone().into_iter().collect();
    let wiki = bertkit_download::sources::fill(&data.format.wiki[0], &vars).unwrap();
    assert_eq!(
        wiki,
        "wikipedia/enwiki-20240101-pages-articles-multistream.xml.bz2"
    );
    let vocab = bertkit_download::sources::fill(&data.records.vocab, &vars).unwrap();
    assert_eq!(vocab, "weights/bert-base-uncased/vocab.txt");
}
