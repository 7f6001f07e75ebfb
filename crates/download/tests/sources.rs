//! The source registry: the demo set from the shared data folder as a mirror, checksum files,
//! templates and mirror-only entries.

use std::collections::HashMap;

use bertkit_download::sources::{Registry, SetOptions, download_set, lookup_checksum};
use bertkit_download::{Algorithm, Fetched};
use bertkit_test_support::{repo_root, shared_data_dir};

fn registry() -> Registry {
    Registry::load(&repo_root().join("pipelines/sources.toml")).unwrap()
}

#[test]
fn the_registry_parses_and_names_the_issue_sets() {
    let r = registry();
    for set in [
        "demo",
        "wikipedia",
        "gutenberg",
        "squad-v1.1",
        "squad-v2.0",
        "glue",
        "bert-base-uncased-google",
        "hf",
    ] {
        assert!(r.sets().contains(&set), "missing set {set}");
    }
    for s in &r.source {
        assert!(
            s.url.is_empty() || s.url.starts_with("https://"),
            "{}",
            s.url
        );
    }
}

#[test]
fn the_demo_set_downloads_from_the_shared_data_mirror_with_verified_checksums() {
    let dir = tempfile::tempdir().unwrap();
    let mirror = shared_data_dir().unwrap();
    let vars = HashMap::new();
    let done = download_set(
        &registry(),
        "demo",
        &vars,
        dir.path(),
        mirror.to_str(),
        &SetOptions::default(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap();
    assert!(!done.is_up_to_date());
    let done = done.into_summary();
    assert_eq!(done.len(), 10);
    for (path, outcome) in &done {
        assert!(
            matches!(outcome, Fetched::Copied { .. }),
            "{path}: {outcome:?}"
        );
        assert_eq!(
            std::fs::read(dir.path().join(path)).unwrap(),
            std::fs::read(mirror.join(path)).unwrap(),
            "{path}"
        );
    }
    let again = download_set(
        &registry(),
        "demo",
        &vars,
        dir.path(),
        mirror.to_str(),
        &SetOptions::default(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap();
    assert!(again.is_up_to_date(), "nothing to fetch the second time");
    let again = again.into_summary();
    assert!(
        again
            .iter()
            .all(|(_, o)| matches!(o, Fetched::AlreadyPresent { .. }))
    );
    // Without a mirror, mirror-only entries say so before anything is fetched from the network.
    let dir2 = tempfile::tempdir().unwrap();
    let gutenberg_only = Registry {
        source: registry()
            .source
            .into_iter()
            .filter(|s| s.url.is_empty())
            .collect(),
    };
    let err = download_set(
        &gutenberg_only,
        "demo",
        &vars,
        dir2.path(),
        None,
        &SetOptions::default(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("only available from a mirror"),
        "{err}"
    );
}

#[test]
fn checksum_files_and_templates() {
    let dir = tempfile::tempdir().unwrap();
    let mirror = dir.path().join("mirror");
    std::fs::create_dir_all(mirror.join("wikipedia")).unwrap();
    let dump = b"<mediawiki></mediawiki>";
    std::fs::write(
        mirror.join("wikipedia/enwiki-20240101-pages-articles-multistream.xml.bz2"),
        dump,
    )
    .unwrap();
    std::fs::write(
        mirror.join("wikipedia/enwiki-20240101-pages-articles-multistream-index.txt.bz2"),
        b"index",
    )
    .unwrap();
    use sha1::Digest;
    let sums = format!(
        "{}  enwiki-20240101-pages-articles-multistream.xml.bz2\n{}  enwiki-20240101-pages-articles-multistream-index.txt.bz2\n",
        bertkit_stage_io::hex(&sha1::Sha1::digest(dump)),
        bertkit_stage_io::hex(&sha1::Sha1::digest(b"index")),
    );
    std::fs::write(mirror.join("wikipedia/enwiki-20240101-sha1sums.txt"), &sums).unwrap();
    let vars = HashMap::from([("date".to_string(), "20240101".to_string())]);
    let out = dir.path().join("out");
    let done = download_set(
        &registry(),
        "wikipedia",
        &vars,
        &out,
        mirror.to_str(),
        &SetOptions::default(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap();
    let done = done.into_summary();
    assert_eq!(done.len(), 2);
    assert!(
        out.join("wikipedia/enwiki-20240101-pages-articles-multistream.xml.bz2")
            .is_file()
    );

    // A dump that does not match the published sums is refused and not kept.
    std::fs::write(
        mirror.join("wikipedia/enwiki-20240101-pages-articles-multistream.xml.bz2"),
        b"tampered",
    )
    .unwrap();
    let out2 = dir.path().join("out2");
    let err = download_set(
        &registry(),
        "wikipedia",
        &vars,
        &out2,
        mirror.to_str(),
        &SetOptions::default(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap_err();
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
    assert!(
        !out2
            .join("wikipedia/enwiki-20240101-pages-articles-multistream.xml.bz2")
            .exists()
    );

    assert!(lookup_checksum(&sums, "nope.bz2", Algorithm::Sha1).is_none());
    // A template variable that is not given is a clear error.
    let err = download_set(
        &registry(),
        "hf",
        &HashMap::new(),
        &out,
        mirror.to_str(),
        &SetOptions::default(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap_err();
    assert!(err.to_string().contains("--var repo="), "{err}");
}

/// A dump date the mirror no longer keeps says how to pick another (the registry's hint),
/// once, under what failed (here its checksum file, fetched first).
#[test]
fn a_dump_date_gone_from_the_mirror_says_how_to_pick_another() {
    let dir = tempfile::tempdir().unwrap();
    let mirror = dir.path().join("mirror");
    std::fs::create_dir_all(&mirror).unwrap();
    let vars = HashMap::from([("date".to_string(), "20000101".to_string())]);
    let err = download_set(
        &registry(),
        "wikipedia",
        &vars,
        &dir.path().join("out"),
        mirror.to_str(),
        &SetOptions::default(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("enwiki-20000101-sha1sums.txt"), "{err}");
    assert_eq!(
        err.matches("https://dumps.wikimedia.org/enwiki/ whose page")
            .count(),
        1,
        "{err}"
    );
    assert!(err.contains("make data WIKI_DATE=YYYYMMDD"), "{err}");
}
