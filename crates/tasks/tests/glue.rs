//! GLUE on the real task files (shared data): readers, encoding, and a short fine-tuning run of
//! the real MiniLM checkpoint on MRPC.

use bertkit_tasks::glue::data::{Example, Task, read};
use bertkit_tasks::glue::finetune::{
    FinetuneOptions, GluePredictOptions, encode, finetune, predict_file,
};
use bertkit_tasks::training::TrainSettings;
use bertkit_test_support::require;
use bertkit_tokenizer::FullTokenizer;

#[test]
fn the_task_files_read_with_their_quirks() {
    // MRPC: a byte-order mark, a header, bare quotes inside sentences.
    let mrpc = read(Task::Mrpc, &require("glue/MRPC/dev.tsv")).unwrap();
    assert_eq!(mrpc.len(), 408);
    assert!(
        mrpc[0]
            .text_b
            .as_deref()
            .unwrap()
            .starts_with("\" The foodservice pie business")
    );
    assert_eq!(mrpc.iter().filter(|e| e.label == 1).count(), 279);
    assert_eq!(
        read(Task::Mrpc, &require("glue/MRPC/train.tsv"))
            .unwrap()
            .len(),
        3668
    );
    // CoLA: no header.
    let cola = read(Task::Cola, &require("glue/CoLA/dev.tsv")).unwrap();
    assert_eq!(cola.len(), 1043);
    assert_eq!(
        cola[0].text_a,
        "The sailors rode the breeze clear of the rocks."
    );
    assert!(cola[0].text_b.is_none());
    let sst = read(Task::Sst2, &require("glue/SST-2/dev.tsv")).unwrap();
    assert_eq!(sst.len(), 872);
    // A broken row names the file and line.
    let dir = std::env::temp_dir().join(format!("bertkit-glue-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("dev.tsv");
    std::fs::write(&bad, "sentence\tlabel\ngood\t1\nbad\tmaybe\n").unwrap();
    let err = read(Task::Sst2, &bad).unwrap_err().to_string();
    assert!(
        err.contains("dev.tsv") && err.contains("line 3") && err.contains("\"maybe\""),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn pairs_are_encoded_and_truncated_as_run_classifier() {
    let tokenizer = FullTokenizer::from_vocab_file(&require("minilm/vocab.txt"), true).unwrap();
    let e = Example {
        text_a: "Hello world, this is a longer first sentence.".into(),
        text_b: Some("Short one.".into()),
        label: 1,
    };
    let full = encode(&tokenizer, &e, 128).unwrap();
    let a = tokenizer.tokenize_ids(&e.text_a);
    let b = tokenizer.tokenize_ids(e.text_b.as_deref().unwrap());
    assert_eq!(full.ids.len(), a.len() + b.len() + 3);
    assert_eq!(full.ids[0], 101);
    assert_eq!(full.ids[a.len() + 1], 102);
    assert_eq!(
        full.segments.iter().filter(|&&s| s == 1).count(),
        b.len() + 1
    );
    // Truncation takes from the longer side first.
    let cut = encode(&tokenizer, &e, 10).unwrap();
    assert_eq!(cut.ids.len(), 10);
    assert_eq!(
        cut.segments.iter().filter(|&&s| s == 1).count(),
        b.len() + 1
    );
}

#[test]
fn minilm_fine_tunes_on_mrpc_briefly() {
    let dir = std::env::temp_dir().join(format!("bertkit-mrpc-{}", std::process::id()));
    let options = FinetuneOptions {
        task: Task::Mrpc,
        model: require("minilm"),
        data: require("glue/MRPC"),
        output: Some(dir.clone()),
        settings: TrainSettings {
            epochs: 1.0,
            lr: 5e-5,
            batch: 8,
            accumulation: 1,
            warmup: 0.0,
            seed: 1,
            max_steps: Some(6),
            ..TrainSettings::glue()
        },
        max_seq_length: 64,
        lower_case: true,
        dtype: candle_core::DType::F32,
        earlier: bertkit_train::run_folder::EarlierRun::Refuse,
        reducer: std::rc::Rc::new(bertkit_train::step::Local),
        device: candle_core::Device::Cpu,
    };
    let mut lines = Vec::new();
    let report = finetune(&options, &mut |l| lines.push(l.to_string())).unwrap();
    assert_eq!(report.steps, 6);
    assert_eq!(report.train_examples, 3668);
    assert!(lines[0].contains("classifier.weight"), "{lines:?}");
    assert_eq!(report.dev.examples, 408);
    let accuracy = report.dev.metrics[0].1;
    let f1 = report.dev.metrics[1].1;
    // Both metrics recomputed here from the predictions and the labels read straight from
    // dev.tsv (the first column; a BOM and a header line before the rows). (Tried: F1 over
    // the negative class instead passes a range check and fails this one.)
    let dev = std::fs::read_to_string(require("glue/MRPC/dev.tsv")).unwrap();
    let labels: Vec<usize> = dev
        .lines()
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.split('\t').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(labels.len(), 408);
    let predictions = &report.dev.predictions;
    let right = predictions
        .iter()
        .zip(&labels)
        .filter(|(p, l)| p == l)
        .count();
    let count = |p: usize, l: usize| {
        predictions
            .iter()
            .zip(&labels)
            .filter(|&(&a, &b)| a == p && b == l)
            .count() as f64
    };
    let (tp, fp, fn_) = (count(1, 1), count(1, 0), count(0, 1));
    let f1_by_hand = if tp == 0.0 {
        0.0
    } else {
        2.0 * tp / (2.0 * tp + fp + fn_)
    };
    assert!(
        (accuracy - right as f64 / 408.0).abs() < 1e-12,
        "{accuracy}"
    );
    assert!((f1 - f1_by_hand).abs() < 1e-12, "{f1} vs {f1_by_hand}");
    assert!(
        report.dev.loss.is_finite()
            && report
                .train_loss
                .is_some_and(|(first, _)| first.is_finite())
    );
    // The output folder's logs: a metrics.jsonl line per step, the dev figures on the last
    // (the run's end), and the same in TensorBoard's event files as TensorBoard reads them.
    let metrics: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(metrics.len(), 6);
    assert!(metrics[4].get("dev_accuracy").is_none());
    assert_eq!(metrics[5]["dev_accuracy"].as_f64(), Some(accuracy));
    assert_eq!(metrics[5]["dev_f1"].as_f64(), Some(f1));
    assert_eq!(metrics[5]["dev_loss"].as_f64(), Some(report.dev.loss));
    let scalars = bertkit_test_support::tensorboard_scalars(&dir);
    let steps = |tag: &str| scalars[tag].iter().map(|p| p.0).collect::<Vec<_>>();
    assert_eq!(steps("train/loss"), [1, 2, 3, 4, 5, 6]);
    assert_eq!(steps("dev/accuracy"), [6]);
    assert!((scalars["dev/accuracy"][0].1 - accuracy).abs() < 1e-6);
    // Six steps lower the dev loss below the untrained model's (the same head, initialised
    // from the same seed, evaluated without a step). (Tried: the update's sign flipped raises
    // it and fails this.)
    let untrained = finetune(
        &FinetuneOptions {
            output: None,
            settings: TrainSettings {
                max_steps: Some(0),
                ..options.settings.clone()
            },
            ..options.clone()
        },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(untrained.steps, 0);
    eprintln!(
        "MRPC dev loss: untrained {:.5}, after 6 steps {:.5}",
        untrained.dev.loss, report.dev.loss
    );
    assert!(
        report.dev.loss < untrained.dev.loss - 0.01,
        "dev loss {} after 6 steps, {} untrained",
        report.dev.loss,
        untrained.dev.loss
    );
    // The saved model loads back with its head and the task's labels.
    let saved = bertkit_model::bert::load::<bertkit_model::BertForSequenceClassification>(
        &dir,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
        0,
    )
    .unwrap();
    assert!(saved.params.initialised.is_empty());
    assert_eq!(saved.config.num_labels(), 2);
    // Predicting the dev set with the saved model gives the same predictions and metrics as
    // the evaluation at the end of training, and writes one row per example.
    let rows = dir.join("dev_predictions.tsv");
    let predicted = predict_file(&GluePredictOptions {
        task: Task::Mrpc,
        model: dir.clone(),
        data: require("glue/MRPC/dev.tsv"),
        output: Some(rows.clone()),
        max_seq_length: 64,
        lower_case: true,
        batch: 50,
        device: candle_core::Device::Cpu,
    })
    .unwrap();
    assert_eq!(predicted.predictions, report.dev.predictions);
    assert!((predicted.metrics[0].1 - accuracy).abs() < 1e-12);
    let text = std::fs::read_to_string(&rows).unwrap();
    assert_eq!(text.lines().count(), 409);
    assert!(text.starts_with("index\tprediction\n0\t"));
    std::fs::remove_dir_all(&dir).unwrap();
}
