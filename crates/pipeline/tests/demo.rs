//! The demo pipeline end to end from the shared data folder as a mirror: every step runs, and a
//! second run finds every step up to date.

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
            "records phase 2"
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
    for phase in [1, 2] {
        for shard in 0..4 {
            assert!(
                config
                    .output
                    .join(format!("records/phase{phase}/shard_{shard:05}.parquet"))
                    .is_file()
            );
        }
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
