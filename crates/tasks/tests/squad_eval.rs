//! The official evaluate-v1.1.py's numbers on SQuAD v1.1 dev (10,570 questions), from the
//! reference prediction files: the printed line, and every question's scores.

use std::collections::HashMap;

use bertkit_tasks::squad::data::Dataset;
use bertkit_tasks::squad::eval::evaluate;
use bertkit_test_support::require;

fn predictions(name: &str) -> HashMap<String, String> {
    serde_json::from_str(
        &std::fs::read_to_string(require(format!("reference/{name}.json"))).unwrap(),
    )
    .unwrap()
}

fn expected(name: &str) -> String {
    std::fs::read_to_string(require(format!("reference/{name}.expected.json")))
        .unwrap()
        .trim()
        .to_string()
}

#[test]
fn the_printed_scores_equal_the_official_script() {
    let dev = Dataset::load(&require("squad/dev-v1.1.json")).unwrap();
    for name in ["squad_pred_first_gold", "squad_pred_first5_context_words"] {
        let scores = evaluate(&dev, &predictions(name));
        assert_eq!(scores.total, 10_570);
        assert!(scores.unanswered.is_empty());
        assert_eq!(scores.to_json(), expected(name), "{name}");
    }
}

#[test]
fn every_question_scores_as_the_official_functions() {
    let dev = Dataset::load(&require("squad/dev-v1.1.json")).unwrap();
    let scores = evaluate(&dev, &predictions("squad_pred_first5_context_words"));
    let text = std::fs::read_to_string(require(
        "reference/squad_pred_first5_context_words.per_question.jsonl",
    ))
    .unwrap();
    let reference: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(reference.len(), scores.per_question.len());
    let mut nonzero = 0;
    for (r, q) in reference.iter().zip(&scores.per_question) {
        assert_eq!(r["id"].as_str().unwrap(), q.id);
        assert_eq!(
            r["exact_match"].as_u64().unwrap() == 1,
            q.exact_match.unwrap(),
            "{}",
            q.id
        );
        let f = r["f1"].as_f64().unwrap();
        assert_eq!(f, q.f1.unwrap(), "{}", q.id);
        nonzero += usize::from(f > 0.0);
    }
    assert!(nonzero > 1000, "{nonzero}");
}

#[test]
fn missing_predictions_score_zero() {
    let dev = Dataset::load(&require("squad/dev-v1.1.json")).unwrap();
    let mut preds = predictions("squad_pred_first_gold");
    let removed: Vec<String> = preds.keys().take(1057).cloned().collect();
    for k in &removed {
        preds.remove(k);
    }
    let scores = evaluate(&dev, &preds);
    assert_eq!(scores.unanswered.len(), 1057);
    assert!(
        (scores.exact_match - 90.0).abs() < 1e-9,
        "{}",
        scores.exact_match
    );
}
