//! The chain the project exists for, as README gives it: `make pretrain-phase1
//! pretrain-phase2 finetune-squad` pre-trains, then fine-tunes the model phase 2 wrote, with no
//! other variable saying which. Here in its CPU smoke form: a tiny model, two steps a stage,
//! records of one book, a small SQuAD split, the test's own `bertkit` (BERTKIT=, nothing built).

use std::path::Path;
use std::process::Command;

use bertkit_test_support::{repo_root, require, shared_data_dir};

use crate::util::{bertkit, book_records, ok, path as p, text};

/// `make ARGS` in the repository, its output (commands echoed) whatever the outcome.
fn make(args: &[String]) -> (bool, String) {
    let out = Command::new("make")
        .args(args)
        .current_dir(repo_root())
        // Not the jobserver of a make this test may run under.
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .output()
        .expect("make runs");
    (
        out.status.success(),
        format!("{}{}", text(&out.stdout), text(&out.stderr)),
    )
}

/// A model folder in the transformers layout with the MiniLM vocabulary, uncased.
fn assert_model_folder(dir: &Path) {
    for f in ["config.json", "model.safetensors", "tokenizer_config.json"] {
        assert!(dir.join(f).is_file(), "{}", dir.join(f).display());
    }
    assert_eq!(
        std::fs::read(dir.join("vocab.txt")).unwrap(),
        std::fs::read(require("minilm/vocab.txt")).unwrap(),
        "{}",
        dir.display()
    );
    // The weights as readable as the files beside them (the umask's modes, not 0600).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |f: &str| std::fs::metadata(dir.join(f)).unwrap().permissions().mode() & 0o777;
        assert_eq!(
            mode("model.safetensors"),
            mode("config.json"),
            "{}",
            dir.display()
        );
    }
}

#[test]
fn make_pretrains_both_phases_then_fine_tunes_the_model_phase_2_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let records = book_records(dir.path());
    let records_root = dir.path().join("records");
    for phase in ["phase1", "phase2"] {
        std::fs::create_dir_all(records_root.join(phase)).unwrap();
        std::fs::copy(&records, records_root.join(phase).join("book.parquet")).unwrap();
    }
    // A small SQuAD split: two articles to train on, the next one to predict.
    let squad = dir.path().join("squad");
    ok(bertkit(&[
        "split",
        "squad",
        "--input",
        p(&require("squad/dev-v1.1.json")),
        "--train-articles",
        "2",
        "-o",
        p(&squad.join("a")),
    ]));
    ok(bertkit(&[
        "split",
        "squad",
        "--input",
        p(&squad.join("a/dev.json")),
        "--train-articles",
        "1",
        "-o",
        p(&squad.join("b")),
    ]));
    let runs = dir.path().join("runs");
    let out = dir.path().join("out");
    let var = |k: &str, v: &Path| format!("{k}={}", v.display());
    let mut args: Vec<String> = ["pretrain-phase1", "pretrain-phase2", "finetune-squad"]
        .map(String::from)
        .to_vec();
    args.extend([
        "DEVICE=cpu".into(),
        "MAX_STEPS=2".into(),
        "PRESET=tiny".into(),
        var("BERTKIT", Path::new(env!("CARGO_BIN_EXE_bertkit"))),
        var("MIRROR", &shared_data_dir().unwrap()),
        var("RECORDS", &records_root),
        var("RUNS", &runs),
        var("OUT", &out),
        var("SQUAD_TRAIN", &squad.join("a/train.json")),
        var("SQUAD_DEV", &squad.join("b/train.json")),
    ]);
    let (passed, log) = make(&args);
    assert!(passed, "{log}");
    // Phase 2 started from phase 1's model, and fine-tuning from phase 2's.
    assert!(
        log.contains(&format!("--set model.init={}/phase1", runs.display())),
        "{log}"
    );
    assert!(
        log.contains(&format!(
            "== fine-tuning {}/phase2 on SQuAD",
            runs.display()
        )) && log.contains(&format!("--model \"{}/phase2\"", runs.display())),
        "{log}"
    );
    assert!(log.contains("\"exact_match\""), "{log}");
    for phase in ["phase1", "phase2"] {
        assert_model_folder(&runs.join(phase));
        assert_model_folder(&runs.join(phase).join("checkpoints/step-2"));
    }
    let finetuned = out.join("finetune/squad");
    assert_model_folder(&finetuned);
    assert!(finetuned.join("predictions/predictions.json").is_file());

    // Run again, the chain resumes each stage where it ended rather than refusing or
    // starting over.
    let (again, log) = make(&args);
    assert!(again && log.contains("steps 2..2"), "{log}");

    // A checkpoint and a run folder are model folders for every command that takes one.
    let lines = dir.path().join("lines.txt");
    std::fs::write(&lines, "the man who was thursday\n").unwrap();
    for model in [runs.join("phase2/checkpoints/step-2"), runs.join("phase1")] {
        let features = dir.path().join("features.jsonl");
        ok(bertkit(&[
            "extract-features",
            "--model",
            p(&model),
            "--input",
            p(&lines),
            "--layers",
            "-1",
            "-o",
            p(&features),
        ]));
        assert!(
            std::fs::read_to_string(&features)
                .unwrap()
                .contains("\"[CLS]\"")
        );
    }
}
