//! `bertkit evaluate squad` prints exactly what the official evaluate-v1.1.py printed for the
//! reference prediction files; `bertkit bench inference` prints one row per setting.

use std::process::Command;

use bertkit_shared_data::require;

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
        assert!(
            r[2] >= 5.0 && r[3] > 0.0 && r[4] <= r[5] && r[5] <= r[6],
            "{stdout}"
        );
    }
}
