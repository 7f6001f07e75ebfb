//! SQuAD features equal Google's `run_squad.py` `convert_examples_to_features`, feature for
//! feature, on SQuAD v1.1 dev (training and prediction mode) and the SQuAD 2.0 dev subset
//! (training with impossible questions). The reference is per-article digests of every
//! feature's ids, segments, token → word map, max-context positions and targets, made by
//! Google's code (fixtures/squad_features_google/README.md).

use std::collections::HashMap;
use std::path::Path;

use bertkit_tasks::squad::data::Dataset;
use bertkit_tasks::squad::features::{FeatureOptions, build_features, read_examples};
use bertkit_test_support::{require, sha256_hex};
use bertkit_tokenizer::FullTokenizer;

fn digests(data: &str, training: bool, version_2: bool) -> Vec<String> {
    let dataset = Dataset::load(&require(data)).unwrap();
    let tokenizer = FullTokenizer::from_vocab_file(&require("minilm/vocab.txt"), true).unwrap();
    let examples = read_examples(&dataset, training, version_2).unwrap();
    assert!(examples.skipped.is_empty(), "{:?}", examples.skipped);
    let features =
        build_features(&examples, &tokenizer, &FeatureOptions::default(), training).unwrap();
    let mut article_of = HashMap::new();
    for (a, article) in dataset.data.iter().enumerate() {
        for p in &article.paragraphs {
            for q in &p.qas {
                article_of.insert(q.id.clone(), a);
            }
        }
    }
    let join = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
    let mut groups: Vec<(usize, usize, String)> = Vec::new();
    for f in &features {
        let id = &examples.examples[f.example_index].id;
        let map: Vec<String> = f
            .token_to_word
            .iter()
            .enumerate()
            .filter_map(|(p, w)| w.map(|w| format!("{p}:{w}")))
            .collect();
        let max: Vec<String> = f
            .max_context
            .iter()
            .enumerate()
            .filter(|(_, m)| **m)
            .map(|(p, _)| p.to_string())
            .collect();
        let canon = [
            join(&f.input_ids),
            join(&f.segment_ids),
            map.join(" "),
            max.join(" "),
            format!("{} {}", f.start_position, f.end_position),
        ]
        .join("|");
        let digest = sha256_hex(canon.as_bytes());
        let line = format!(
            "{id} {} {} {}\n",
            f.window,
            f.input_ids.len(),
            &digest[..16]
        );
        let article = article_of[id];
        match groups.last_mut() {
            Some((a, n, lines)) if *a == article => {
                *n += 1;
                lines.push_str(&line);
            }
            _ => groups.push((article, 1, line)),
        }
    }
    groups
        .iter()
        .map(|(a, n, lines)| format!("{a} {n} {}", sha256_hex(lines.as_bytes())))
        .collect()
}

fn reference(name: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/squad_features_google")
        .join(name);
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn compare(ours: Vec<String>, theirs: Vec<String>) {
    assert_eq!(ours.len(), theirs.len(), "articles");
    for (o, t) in ours.iter().zip(&theirs) {
        assert_eq!(o, t, "article digest differs (article features digest)");
    }
}

#[test]
fn v1_training_features_equal_run_squad() {
    compare(
        digests("squad/dev-v1.1.json", true, false),
        reference("v1.1_train.articles"),
    );
}

#[test]
fn v1_prediction_features_equal_run_squad() {
    compare(
        digests("squad/dev-v1.1.json", false, false),
        reference("v1.1_predict.articles"),
    );
}

#[test]
fn v2_training_features_with_impossible_questions_equal_run_squad() {
    compare(
        digests("squad/cs224n-dev-v2.0-subset.json", true, true),
        reference("v2.0_subset_train.articles"),
    );
}
