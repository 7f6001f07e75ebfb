//! `bertkit evaluate squad` prints exactly what the official evaluate-v1.1.py printed for the
//! reference prediction files.

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
