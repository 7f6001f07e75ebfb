//! The official evaluate-v2.0.py's output on the SQuAD 2.0 dev subset, for predictions built
//! the same way as those it was run on (see fixtures/squad_v2_official/README.md).

use std::collections::HashMap;
use std::path::Path;

use bertkit_tasks::squad::data::Dataset;
use bertkit_tasks::squad::eval_v2::evaluate_v2;
use bertkit_test_support::require;

fn expected(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/squad_v2_official")
        .join(format!("{name}.expected.json"));
    std::fs::read_to_string(path)
        .unwrap()
        .trim_end()
        .to_string()
}

type Predictions = (HashMap<String, String>, Vec<(String, f64)>);

fn predictions(dev: &Dataset) -> Predictions {
    let mut preds = HashMap::new();
    let mut na = Vec::new();
    for (i, (p, q)) in dev.questions().enumerate() {
        let text = match i % 3 {
            0 => q
                .answers
                .first()
                .map(|a| a.text.clone())
                .unwrap_or_default(),
            1 => String::new(),
            _ => p
                .context
                .split_whitespace()
                .take(5)
                .collect::<Vec<_>>()
                .join(" "),
        };
        preds.insert(q.id.clone(), text);
        na.push((q.id.clone(), ((i * 7919) % 1000) as f64 / 1000.0));
    }
    (preds, na)
}

#[test]
fn printed_scores_equal_the_official_v2_script() {
    let dev = Dataset::load(&require("squad/cs224n-dev-v2.0-subset.json")).unwrap();
    let (preds, na) = predictions(&dev);
    let plain = evaluate_v2(&dev, &preds, None, 1.0);
    assert!(plain.unanswered.is_empty());
    assert_eq!(plain.to_json(), expected("plain"));
    assert_eq!(
        evaluate_v2(&dev, &preds, Some(&na), 1.0).to_json(),
        expected("na_probs")
    );
    let t = evaluate_v2(&dev, &preds, Some(&na), 0.5);
    assert_eq!(t.to_json(), expected("na_probs_thresh_0.5"));
    assert_eq!(t.get("HasAns_total"), Some(2910.0));
}

#[test]
fn a_missing_prediction_scores_zero_and_is_listed() {
    let dev = Dataset::load(&require("squad/cs224n-dev-v2.0-subset.json")).unwrap();
    let (mut preds, _) = predictions(&dev);
    let first = dev.questions().next().unwrap().1.id.clone();
    let full = evaluate_v2(&dev, &preds, None, 1.0);
    preds.remove(&first);
    let missing = evaluate_v2(&dev, &preds, None, 1.0);
    assert_eq!(missing.unanswered, vec![first]);
    assert_eq!(missing.get("total"), Some(6078.0));
    // Question 0 had its gold answer: one exact match fewer.
    let drop = full.get("exact").unwrap() - missing.get("exact").unwrap();
    assert!((drop - 100.0 / 6078.0).abs() < 1e-9, "{drop}");
}
