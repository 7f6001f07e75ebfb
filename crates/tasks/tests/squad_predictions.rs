//! Post-processing equals Google's `run_squad.py` `write_predictions`: the same answers, null
//! odds and n-best lists (texts, logits, probabilities) for the same logits. The logits are a
//! fixed integer pattern over real tokens (many ties, so tie order is tested too; padding gets
//! -10000 on Google's side). Reference: fixtures/squad_predictions_google/README.md.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use bertkit_tasks::pyfloat::repr;
use bertkit_tasks::squad::data::Dataset;
use bertkit_tasks::squad::features::{FeatureOptions, build_features, read_examples};
use bertkit_tasks::squad::postprocess::{FeatureLogits, PostprocessOptions, Prediction, predict};
use bertkit_test_support::{require, sha256_hex};
use bertkit_tokenizer::FullTokenizer;

fn logit(feature: usize, position: usize, salt: usize) -> f32 {
    (((feature * 1_000_003 + position * 7919 + salt) % 2001) as f64 - 1000.0) as f32 / 64.0
}

fn run(data: &str, articles: usize, version_2: bool, threshold: f64) -> Vec<Prediction> {
    let mut dataset = Dataset::load(&require(data)).unwrap();
    dataset.data.truncate(articles);
    let tokenizer = FullTokenizer::from_vocab_file(&require("minilm/vocab.txt"), true).unwrap();
    let examples = read_examples(&dataset, false, version_2).unwrap();
    let features =
        build_features(&examples, &tokenizer, &FeatureOptions::default(), false).unwrap();
    let logits: Vec<FeatureLogits> = features
        .iter()
        .enumerate()
        .map(|(f, feature)| FeatureLogits {
            start: (0..feature.input_ids.len())
                .map(|p| logit(f, p, 17))
                .collect(),
            end: (0..feature.input_ids.len())
                .map(|p| logit(f, p, 91))
                .collect(),
        })
        .collect();
    let options = PostprocessOptions {
        version_2,
        null_score_diff_threshold: threshold,
        ..PostprocessOptions::default()
    };
    predict(&examples, &features, &logits, &tokenizer, &options)
}

fn fixture(dir: &str, name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/squad_predictions_google")
        .join(dir)
        .join(name)
}

fn check(predictions: &[Prediction], dir: &str, version_2: bool) {
    let text = std::fs::read_to_string(fixture(dir, "predictions.json")).unwrap();
    let expected: HashMap<String, String> = serde_json::from_str(&text).unwrap();
    assert_eq!(predictions.len(), expected.len());
    let mut differing = Vec::new();
    for p in predictions {
        let answer = &expected[&p.id];
        if &p.text != answer {
            differing.push((p.id.clone(), p.text.clone(), answer.clone()));
        }
    }
    assert!(
        differing.is_empty(),
        "{} differ: {:?}",
        differing.len(),
        &differing[..differing.len().min(5)]
    );

    let digests = std::fs::read_to_string(fixture(dir, "nbest.digests")).unwrap();
    for (p, line) in predictions.iter().zip(digests.lines()) {
        let canon: String = p
            .n_best
            .iter()
            .map(|c| {
                format!(
                    "{}\t{}\t{}\t{}\n",
                    c.text,
                    repr(c.start_logit),
                    repr(c.end_logit),
                    repr(c.probability)
                )
            })
            .collect();
        let ours = format!(
            "{} {} {}",
            p.id,
            p.n_best.len(),
            &sha256_hex(canon.as_bytes())[..16]
        );
        assert_eq!(ours, line, "n-best of {}: {:?}", p.id, p.n_best);
    }

    if version_2 {
        let text = std::fs::read_to_string(fixture(dir, "null_odds.json")).unwrap();
        let odds: HashMap<String, f64> = serde_json::from_str(&text).unwrap();
        for p in predictions {
            assert_eq!(p.null_score_diff, Some(odds[&p.id]), "{}", p.id);
        }
    }
}

#[test]
fn v1_predictions_and_n_best_equal_write_predictions() {
    let predictions = run("squad/dev-v1.1.json", 3, false, 0.0);
    check(&predictions, "v1.1_first3", false);
}

#[test]
fn v2_predictions_null_odds_and_n_best_equal_write_predictions() {
    let predictions = run("squad/cs224n-dev-v2.0-subset.json", 2, true, 0.0);
    check(&predictions, "v2.0_first2", true);
    // Every null score here is far below the best answer's: no "" at threshold 0, all ""
    // once the threshold is below every difference.
    assert!(predictions.iter().all(|p| !p.text.is_empty()));
    let lowest = predictions
        .iter()
        .filter_map(|p| p.null_score_diff)
        .fold(f64::INFINITY, f64::min);
    let all_null = run("squad/cs224n-dev-v2.0-subset.json", 2, true, lowest - 1.0);
    assert!(all_null.iter().all(|p| p.text.is_empty()));
}
