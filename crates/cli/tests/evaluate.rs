//! `bertkit evaluate squad` prints exactly what the official evaluate-v1.1.py printed for the
//! reference prediction files; `bertkit bench inference` prints one row per setting.

use std::process::Command;

use bertkit_test_support::require;

#[test]
fn evaluate_squad_prints_the_official_line() {
    for name in ["squad_pred_first_gold", "squad_pred_first5_context_words"] {
        let out = Command::new(env!("CARGO_BIN_EXE_bertkit"))
            .args(["evaluate", "squad", "--data"])
            .arg(require("squad/dev-v1.1.json"))
            .arg("--predictions")
            .arg(require(format!("reference/{name}.json")))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let expected =
            std::fs::read_to_string(require(format!("reference/{name}.expected.json"))).unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), expected.trim());
    }
}

/// A predictions file answering 3 of SQuAD's 10,570 dev questions: the scores as the official
/// script computes them (the rest 0), ten questions named, the rest counted, not 10,567 lines.
#[test]
fn a_partial_predictions_file_names_ten_unanswered_questions_and_counts_the_rest() {
    let data = require("squad/dev-v1.1.json");
    let dataset: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&data).unwrap()).unwrap();
    let ids: Vec<String> = dataset["data"][0]["paragraphs"][0]["qas"]
        .as_array()
        .unwrap()
        .iter()
        .take(3)
        .map(|q| q["id"].as_str().unwrap().to_string())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let predictions = dir.path().join("predictions.json");
    let answers: serde_json::Map<String, serde_json::Value> = ids
        .iter()
        .map(|id| (id.clone(), serde_json::json!("Denver Broncos")))
        .collect();
    std::fs::write(&predictions, serde_json::Value::Object(answers).to_string()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(["evaluate", "squad", "--data"])
        .arg(&data)
        .arg("--predictions")
        .arg(&predictions)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        stderr.matches("will receive score 0.").count(),
        10,
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "... and 10557 more questions without a prediction, each scored 0 (10567 in all)"
        ),
        "{stderr}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"exact_match\""));
}

#[test]
fn bench_inference_prints_a_row_per_setting() {
    let out = Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(["bench", "inference", "--model"])
        .arg(require("minilm"))
        .args(["--seq", "16,32", "--batch", "1,2", "--seconds", "0.1"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<Vec<f64>> = stdout
        .lines()
        .skip(2)
        .map(|l| l.split_whitespace().map(|x| x.parse().unwrap()).collect())
        .collect();
    assert_eq!(rows.len(), 4, "{stdout}");
    for r in &rows {
        // The issue time is part of the latency (on the CPU nearly all of it).
        assert!(
            r[2] >= 5.0 && r[3] > 0.0 && r[4] <= r[5] && r[5] <= r[6] && r[7] > 0.0,
            "{stdout}"
        );
    }
}

/// The official v2.0 script's output (crates/tasks/tests/fixtures/squad_v2_official).
fn v2_expected(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tasks/tests/fixtures/squad_v2_official")
        .join(format!("{name}.expected.json"));
    std::fs::read_to_string(path).unwrap()
}

#[test]
fn evaluate_squad_v2_prints_what_the_official_script_prints() {
    let data = require("squad/cs224n-dev-v2.0-subset.json");
    let dataset: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&data).unwrap()).unwrap();
    // The predictions the fixture was made with (see its README), written in file order.
    let (mut preds, mut na) = (Vec::new(), Vec::new());
    let mut i = 0usize;
    for article in dataset["data"].as_array().unwrap() {
        for p in article["paragraphs"].as_array().unwrap() {
            for q in p["qas"].as_array().unwrap() {
                let text = match i % 3 {
                    0 => q["answers"]
                        .get(0)
                        .map(|a| a["text"].as_str().unwrap().to_string())
                        .unwrap_or_default(),
                    1 => String::new(),
                    _ => p["context"]
                        .as_str()
                        .unwrap()
                        .split_whitespace()
                        .take(5)
                        .collect::<Vec<_>>()
                        .join(" "),
                };
                let id = serde_json::to_string(q["id"].as_str().unwrap()).unwrap();
                preds.push(format!("{id}: {}", serde_json::to_string(&text).unwrap()));
                na.push(format!("{id}: {}", ((i * 7919) % 1000) as f64 / 1000.0));
                i += 1;
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let (p, n) = (dir.path().join("preds.json"), dir.path().join("na.json"));
    std::fs::write(&p, format!("{{{}}}", preds.join(", "))).unwrap();
    std::fs::write(&n, format!("{{{}}}", na.join(", "))).unwrap();
    for (name, extra) in [
        ("plain", vec![]),
        ("na_probs", vec!["--na-prob-file", n.to_str().unwrap()]),
        (
            "na_probs_thresh_0.5",
            vec![
                "--na-prob-file",
                n.to_str().unwrap(),
                "--na-prob-thresh",
                "0.5",
            ],
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_bertkit"))
            .args(["evaluate", "squad", "--data"])
            .arg(&data)
            .arg("--predictions")
            .arg(&p)
            .args(&extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            v2_expected(name),
            "{name}"
        );
    }
}

#[test]
fn split_squad_writes_the_documented_halves() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(["split", "squad", "--input"])
        .arg(require("squad/dev-v1.1.json"))
        .arg("-o")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("38 articles, 8582 questions"), "{stdout}");
    assert!(stdout.contains("10 articles, 1988 questions"), "{stdout}");
    // The halves are SQuAD files: the official scoring of first-gold answers on the dev half
    // is 100.
    let dev: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("dev.json")).unwrap())
            .unwrap();
    assert_eq!(dev["version"], "1.1");
    let mut gold = serde_json::Map::new();
    for a in dev["data"].as_array().unwrap() {
        for p in a["paragraphs"].as_array().unwrap() {
            for q in p["qas"].as_array().unwrap() {
                gold.insert(
                    q["id"].as_str().unwrap().into(),
                    q["answers"][0]["text"].clone(),
                );
            }
        }
    }
    let preds = dir.path().join("gold.json");
    std::fs::write(&preds, serde_json::Value::Object(gold).to_string()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(["evaluate", "squad", "--data"])
        .arg(dir.path().join("dev.json"))
        .arg("--predictions")
        .arg(&preds)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        r#"{"exact_match": 100.0, "f1": 100.0}"#
    );
    // Asking for more articles than there are is an error, not an empty half.
    let bad = Command::new(env!("CARGO_BIN_EXE_bertkit"))
        .args(["split", "squad", "--train-articles", "48", "--input"])
        .arg(require("squad/dev-v1.1.json"))
        .arg("-o")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("both halves"));
}
