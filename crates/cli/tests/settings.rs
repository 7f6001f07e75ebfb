//! Settings a run cannot mean are refused before any work, the error naming the setting, the
//! value and what is accepted (issue 68's list): the records stage's generation parameters and
//! a pre-training schedule's decay power.

use bertkit_test_support::{repo_root, require};

use crate::util::{bertkit, book_records, path as p, text};

/// The error line of a refused run (exit 1, no panic).
fn refused(args: &[&str]) -> String {
    let out = bertkit(args);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn nonsense_records_settings_name_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("book.txt");
    std::fs::write(
        &input,
        "One sentence here.\nAnother one there.\n\nA second document.\n",
    )
    .unwrap();
    let vocab = require("minilm/vocab.txt");
    let output = dir.path().join("out.parquet");
    for (flag, value, says) in [
        (
            "--masked-lm-prob",
            "5",
            "masked_lm_prob (--masked-lm-prob) is 5",
        ),
        (
            "--masked-lm-prob",
            "nan",
            "masked_lm_prob (--masked-lm-prob) is NaN",
        ),
        ("--dupe-factor", "0", "dupe_factor (--dupe-factor) is 0"),
        (
            "--max-predictions-per-seq",
            "0",
            "max_predictions_per_seq (--max-predictions-per-seq) is 0",
        ),
        (
            "--max-seq-length",
            "100000",
            "max_seq_length (--max-seq-length) is 100000",
        ),
        (
            "--short-seq-prob",
            "1.5",
            "short_seq_prob (--short-seq-prob) is 1.5",
        ),
    ] {
        let err = refused(&[
            "records",
            "--input",
            p(&input),
            "--vocab",
            p(&vocab),
            "--output",
            p(&output),
            flag,
            value,
        ]);
        assert!(err.contains(says), "{flag} {value}: {err}");
        assert!(!output.exists(), "{flag} {value}: an output was written");
    }
}

#[test]
fn a_decay_power_that_does_not_decay_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let records = book_records(dir.path());
    let config = repo_root().join("pipelines/tiny.toml");
    let run = dir.path().join("run");
    let err = refused(&[
        "pretrain",
        "--config",
        p(&config),
        "--data",
        p(&records),
        "--no-eval",
        "--output",
        p(&run),
        "--set",
        "schedule.power=-2",
    ]);
    assert!(
        err.contains("[schedule] power -2 must be positive"),
        "{err}"
    );
    assert!(!run.join("metrics.jsonl").exists());
}

/// Every environment variable the shipped code reads (a `"BERTKIT_*"` literal in
/// `crates/*/src`, the test support's aside) is in docs/environment.md's table, and every
/// variable the table gives the binary is read somewhere: the reference cannot drift.
#[test]
fn the_environment_reference_lists_every_variable_read() {
    let root = repo_root();
    let doc = std::fs::read_to_string(root.join("docs/environment.md")).unwrap();
    let mut read = std::collections::BTreeSet::new();
    let mut stack = vec![root.join("crates")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if path.is_dir() {
                // The shipped sources: each crate's src/, not its tests or the test support.
                if !matches!(
                    name.as_str(),
                    "tests" | "test-support" | "fixtures" | "target"
                ) {
                    stack.push(path);
                }
            } else if name.ends_with(".rs") && path.components().any(|c| c.as_os_str() == "src") {
                let text = std::fs::read_to_string(&path).unwrap();
                let mut rest = text.as_str();
                while let Some(at) = rest.find("\"BERTKIT_") {
                    let tail = &rest[at + 1..];
                    let end = tail
                        .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                        .unwrap_or(tail.len());
                    read.insert(tail[..end].to_string());
                    rest = &tail[end..];
                }
            }
        }
    }
    // (Tests' own variables, in `#[cfg(test)]` code of the sources.)
    read.remove("BERTKIT_BACKTRACE_TEST_CHILD");
    assert!(read.contains("BERTKIT_THP"), "{read:?}");
    for variable in &read {
        assert!(
            doc.contains(&format!("| `{variable}` |")),
            "{variable} is read by the sources but not in docs/environment.md"
        );
    }
    for line in doc.lines().filter(|l| l.starts_with("| `BERTKIT_")) {
        let variable = line.trim_start_matches("| `").split('`').next().unwrap();
        let for_tests = ["BERTKIT_SHARED_DATA", "BERTKIT_PYTHON"].contains(&variable);
        assert!(
            for_tests || read.contains(variable),
            "docs/environment.md lists {variable}, which no source reads"
        );
    }
}

/// An environment variable's value the binary does not know stops it, naming the variable and
/// its values.
#[test]
fn an_unknown_environment_value_names_the_variable() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(["plot", p(&dir.path().join("metrics.jsonl")), "-o"])
        .arg(dir.path().join("plot.svg"))
        .env("BERTKIT_THP", "yes")
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("BERTKIT_THP=\"yes\": 0 or 1 expected"),
        "{err}"
    );
}

/// The rows of the table under the heading `## {heading}` of docs/configuration.md: each row's
/// first cell, unquoted.
fn documented_keys(heading: &str) -> std::collections::BTreeSet<String> {
    let page = std::fs::read_to_string(repo_root().join("docs/configuration.md")).unwrap();
    let section = page
        .split("\n## ")
        .find(|s| s.starts_with(heading))
        .unwrap_or_else(|| panic!("no section {heading:?} in docs/configuration.md"));
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_string)
        .collect()
}

/// Every key of `table`, dotted (`section.key`, `section.sub.key`).
fn dotted_keys(table: &toml::Table, prefix: &str, out: &mut std::collections::BTreeSet<String>) {
    for (key, value) in table {
        let name = format!("{prefix}{key}");
        match value {
            toml::Value::Table(inner) => dotted_keys(inner, &format!("{name}."), out),
            _ => {
                out.insert(name);
            }
        }
    }
}

/// The flags section of docs/configuration.md is what the binary says of itself: every
/// command's flags, from clap's command tree (`bertkit reference`; `make docs` writes it in).
#[test]
fn the_configuration_reference_lists_every_flag() {
    let page = std::fs::read_to_string(repo_root().join("docs/configuration.md")).unwrap();
    let begin = "<!-- generated by `bertkit reference` (make docs); do not edit by hand -->\n";
    let end = "<!-- end of generated flags -->";
    let written = page
        .split_once(begin)
        .and_then(|(_, rest)| rest.split_once(end))
        .map(|(generated, _)| generated)
        .expect("docs/configuration.md has the generated flags' markers");
    let out = bertkit(&["reference"]);
    assert!(out.status.success());
    let generated = text(&out.stdout);
    assert!(
        generated.contains("### `bertkit pretrain`") && generated.contains("`--overwrite`"),
        "{generated:.400}"
    );
    assert!(
        written == generated,
        "docs/configuration.md's flags differ from `bertkit reference`: run `make docs`"
    );
}

/// The pre-training table lists exactly the keys a run config has (every optional one set),
/// and the pipeline table every key the repository's pipelines use, each a key the config
/// accepts (it refuses unknown ones).
#[test]
fn the_configuration_reference_lists_every_toml_key() {
    use bertkit_train::config::{EvalSection, PretrainConfig};
    let mut config = PretrainConfig::load(&repo_root().join("pipelines/tiny.toml")).unwrap();
    config.model.config = Some("config.json".into());
    config.model.vocab_size = Some(30522);
    config.model.init = Some("earlier-run".into());
    config.model.dropout = Some(0.1);
    config.data.dynamic_masking = Some(bertkit_train::data::DynamicMasking {
        prob: 0.15,
        whole_word: false,
    });
    config.train.peak_tflops = Some(1.0);
    let mut eval = EvalSection::new(vec!["heldout".into()]);
    eval.micro_batch = Some(8);
    config.eval = Some(eval);
    let table: toml::Table = toml::from_str(&toml::to_string(&config).unwrap()).unwrap();
    let mut keys = std::collections::BTreeSet::new();
    dotted_keys(&table, "", &mut keys);
    assert_eq!(documented_keys("Pre-training run configs"), keys);

    let documented = documented_keys("Pipeline configs");
    let data = repo_root().join("pipelines/data.toml");
    let base: toml::Table = toml::from_str(&std::fs::read_to_string(&data).unwrap()).unwrap();
    let mut used = std::collections::BTreeSet::new();
    dotted_keys(&base, "", &mut used);
    // (`download.vars` is a table of the user's own names.)
    used.retain(|k| !k.starts_with("download.vars."));
    used.insert("download.vars".into());
    let missing: Vec<_> = used.difference(&documented).collect();
    assert!(missing.is_empty(), "undocumented: {missing:?}");
    let dir = tempfile::tempdir().unwrap();
    for key in &documented {
        let mut table = base.clone();
        let (section, name) = key.split_once('.').unwrap_or(("", key));
        let place = if section.is_empty() {
            &mut table
        } else {
            table[section].as_table_mut().unwrap()
        };
        place.insert(name.to_string(), toml::Value::Integer(0));
        let path = dir.path().join("pipeline.toml");
        std::fs::write(&path, toml::to_string(&table).unwrap()).unwrap();
        if let Err(e) = bertkit_pipeline::PipelineConfig::load(&path) {
            assert!(!e.to_string().contains("unknown field"), "{key}: {e}");
        }
    }
}
