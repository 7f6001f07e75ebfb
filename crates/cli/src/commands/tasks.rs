//! The task commands: `evaluate`, `finetune`, `predict` and `split` (SQuAD and GLUE).

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use bertkit_tasks::glue::data::Task;
use bertkit_tasks::squad::data::Dataset;
use std::rc::Rc;

use bertkit_tasks::squad::finetune as squad;
use bertkit_tasks::training::TrainSettings;
use bertkit_train::step::GradientReducer;

use crate::flags::tasks::*;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

pub(crate) fn evaluate(command: EvaluateCommand) -> Result<()> {
    let EvaluateCommand::Squad(args) = command;
    let dataset = Dataset::load(&args.data)?;
    let predictions = bertkit_tasks::squad::eval::read_predictions(&args.predictions)?;
    let scores = score_squad(
        &dataset,
        &predictions,
        args.version_2,
        args.na_prob_file.as_deref(),
        args.na_prob_thresh,
    )?;
    println!("{scores}");
    Ok(())
}

/// The official script's output for `predictions`: v2.0 when asked or when the data file says
/// so (with no-answer probabilities from `na_prob_file`), else v1.1.
fn score_squad(
    dataset: &Dataset,
    predictions: &HashMap<String, String>,
    version_2: bool,
    na_prob_file: Option<&Path>,
    na_prob_thresh: f64,
) -> Result<String> {
    if version_2 || dataset.version.starts_with("v2") || dataset.version.starts_with('2') {
        let na_probs = match na_prob_file {
            Some(path) => Some(bertkit_tasks::squad::eval_v2::read_na_probs(path)?),
            None => None,
        };
        let scores = bertkit_tasks::squad::eval_v2::evaluate_v2(
            dataset,
            predictions,
            na_probs.as_deref(),
            na_prob_thresh,
        );
        say_unanswered(&scores.unanswered, |id| {
            format!("Missing prediction for {id} (scored 0)")
        });
        return Ok(scores.to_json());
    }
    if dataset.version != "1.1" {
        eprintln!(
            "Evaluation expects v-1.1, but got dataset with v-{}",
            dataset.version
        );
    }
    let scores = bertkit_tasks::squad::eval::evaluate(dataset, predictions);
    say_unanswered(&scores.unanswered, |id| {
        format!("Unanswered question {id} will receive score 0.")
    });
    Ok(scores.to_json())
}

/// The questions a predictions file leaves unanswered, a line each as the official scripts say
/// them, up to [`UNANSWERED_LINES`], then their count (a partial file leaves thousands).
fn say_unanswered(ids: &[String], line: impl Fn(&str) -> String) {
    for id in ids.iter().take(UNANSWERED_LINES) {
        eprintln!("{}", line(id));
    }
    if ids.len() > UNANSWERED_LINES {
        eprintln!(
            "... and {} more questions without a prediction, each scored 0 ({} in all)",
            ids.len() - UNANSWERED_LINES,
            ids.len()
        );
    }
}

/// Unanswered questions named one by one before the rest are counted.
const UNANSWERED_LINES: usize = 10;

pub(crate) fn finetune(command: FinetuneCommand) -> Result<()> {
    match command {
        FinetuneCommand::Glue(args) => finetune_glue(args),
        FinetuneCommand::Squad(args) => finetune_squad(args),
    }
}

/// `12 steps (train loss 0.69 -> 0.41)`, `steps 5..12 (resumed, …)`, or, for a resumed run
/// that had already finished, `nothing left to run (resumed at step 12, where the run ends)`.
fn steps_text(started_at: usize, steps: usize, train_loss: Option<(f64, f64)>) -> String {
    let Some((first, last)) = train_loss else {
        return format!("nothing left to run (resumed at step {steps}, where the run ends)");
    };
    let loss = format!("train loss {first:.4} -> {last:.4}");
    if started_at == 0 {
        format!("{steps} steps ({loss})")
    } else {
        format!("steps {started_at}..{steps} (resumed, {loss})")
    }
}

fn finetune_glue(args: FinetuneGlueArgs) -> Result<()> {
    let ranks = args.train.ranks.ranks()?;
    let device = args.train.device.clone();
    super::as_rank(ranks, &device, |reducer| finetune_glue_rank(args, reducer))
}

fn finetune_glue_rank(args: FinetuneGlueArgs, reducer: Rc<dyn GradientReducer>) -> Result<()> {
    let task = Task::parse(&args.task)?;
    let data = args.data;
    let speaks = reducer.ranks().rank == 0;
    let lower_case = bertkit_tasks::model_dir::lower_case(&args.model, args.train.cased)?;
    let options = bertkit_tasks::glue::finetune::FinetuneOptions {
        task,
        model: args.model,
        data,
        output: args.output.clone(),
        settings: args.train.settings(TrainSettings::glue()),
        earlier: args.train.run_folder.earlier(),
        max_seq_length: args.max_seq_length,
        lower_case,
        dtype: bertkit_model::parse_dtype(&args.train.dtype)?,
        device: super::rank_device(reducer.as_ref(), &args.train.device)?,
        reducer,
    };
    let report = bertkit_tasks::glue::finetune::finetune(&options, &mut |line| {
        if speaks {
            eprintln!("{line}")
        }
    })?;
    if !speaks {
        return Ok(());
    }
    let metrics: Vec<String> = report
        .dev
        .metrics
        .iter()
        .map(|(k, v)| format!("{k} {v:.4}"))
        .collect();
    println!(
        "{}: {} on {} examples in {:.1} s; dev ({} examples): loss {:.4}, {}",
        task.folder(),
        steps_text(report.started_at, report.steps, report.train_loss),
        report.train_examples,
        report.seconds,
        report.dev.examples,
        report.dev.loss,
        metrics.join(", ")
    );
    if let Some(out) = args.output {
        println!("model: {}", out.display());
    }
    Ok(())
}

fn finetune_squad(args: FinetuneSquadArgs) -> Result<()> {
    let ranks = args.train_flags.ranks.ranks()?;
    let device = args.train_flags.device.clone();
    super::as_rank(ranks, &device, |reducer| finetune_squad_rank(args, reducer))
}

fn finetune_squad_rank(args: FinetuneSquadArgs, reducer: Rc<dyn GradientReducer>) -> Result<()> {
    let speaks = reducer.ranks().rank == 0;
    let lower_case = bertkit_tasks::model_dir::lower_case(&args.model, args.train_flags.cased)?;
    let device = super::rank_device(reducer.as_ref(), &args.train_flags.device)?;
    let options = squad::SquadFinetuneOptions {
        model: args.model.clone(),
        train: Dataset::load(&args.train)?,
        output: args.output.clone(),
        settings: args.train_flags.settings(TrainSettings::squad()),
        earlier: args.train_flags.run_folder.earlier(),
        predict: args.squad.options(lower_case, device.clone()),
        dtype: bertkit_model::parse_dtype(&args.train_flags.dtype)?,
        reducer,
    };
    let report = squad::finetune(&options, &mut |line| {
        if speaks {
            eprintln!("{line}")
        }
    })?;
    if speaks {
        println!(
            "squad: {} on {} windows ({} questions, {} skipped) in {:.1} s{}",
            steps_text(
                report.log.started_at,
                report.log.steps,
                report.log.first_and_last_tenth()
            ),
            report.train_features,
            report.train_examples,
            report.skipped,
            report.log.seconds,
            if report.log.skipped > 0 {
                format!(", {} fp16 steps skipped", report.log.skipped)
            } else {
                String::new()
            }
        );
        println!("model: {}", args.output.display());
    }
    if let Some(dev) = &args.dev {
        // Every rank predicts its share of the dev set; rank 0 writes and scores.
        predict_squad_rank(
            PredictSquadArgs {
                model: args.output.clone(),
                data: dev.clone(),
                output: args.output.join("predictions"),
                evaluate: true,
                cased: args.train_flags.cased,
                dtype: "f32".into(),
                device: args.train_flags.device.clone(),
                products: args.train_flags.products,
                squad: args.squad,
            },
            options.reducer.as_ref(),
        )?;
    }
    Ok(())
}

pub(crate) fn predict(command: PredictCommand) -> Result<()> {
    match command {
        PredictCommand::Squad(args) => predict_squad(args),
        PredictCommand::Glue(args) => predict_glue(args),
    }
}

fn predict_squad(args: PredictSquadArgs) -> Result<()> {
    let device = args.device.clone();
    super::as_rank(bertkit_stage_io::Ranks::from_env()?, &device, |reducer| {
        predict_squad_rank(args, reducer.as_ref())
    })
}

/// `predict squad` as one of the reducer's ranks: the forward passes are shared out, rank 0
/// writes the files and scores.
fn predict_squad_rank(args: PredictSquadArgs, reducer: &dyn GradientReducer) -> Result<()> {
    let speaks = reducer.ranks().rank == 0;
    let device = super::rank_device(reducer, &args.device)?;
    let dtype = bertkit_model::parse_dtype(&args.dtype)?;
    let model = squad::load_for_prediction(&args.model, dtype, &device)?;
    let lower_case = bertkit_tasks::model_dir::lower_case(&args.model, args.cased)?;
    let tokenizer = bertkit_tasks::model_dir::load_tokenizer(&args.model, lower_case)?;
    let dataset = Dataset::load(&args.data)?;
    let options = args.squad.options(lower_case, device);
    let report = squad::predict_dataset(
        &model,
        &tokenizer,
        &dataset,
        &options,
        speaks.then_some(args.output.as_path()),
        reducer,
        &mut |line| {
            if speaks {
                eprintln!("{line}")
            }
        },
    )?;
    if !speaks {
        return Ok(());
    }
    println!(
        "predicted {} questions ({} windows) in {:.1} s ({:.1} windows/s)",
        report.examples,
        report.features,
        report.model_seconds,
        report.features as f64 / report.model_seconds.max(1e-9)
    );
    for f in &report.files {
        println!("wrote {}", f.display());
    }
    if args.evaluate {
        let predictions: HashMap<String, String> = report
            .predictions
            .iter()
            .map(|p| (p.id.clone(), p.text.clone()))
            .collect();
        let null_odds = args.output.join("null_odds.json");
        let scores = score_squad(
            &dataset,
            &predictions,
            args.squad.version_2,
            args.squad.version_2.then_some(null_odds.as_path()),
            1.0,
        )?;
        println!("{scores}");
    }
    Ok(())
}

fn predict_glue(args: PredictGlueArgs) -> Result<()> {
    let task = Task::parse(&args.task)?;
    let data = args.data;
    let lower_case = bertkit_tasks::model_dir::lower_case(&args.model, args.cased)?;
    let evaluation = bertkit_tasks::glue::finetune::predict_file(
        &bertkit_tasks::glue::finetune::GluePredictOptions {
            task,
            model: args.model,
            data: data.clone(),
            output: args.output.clone(),
            max_seq_length: args.max_seq_length,
            lower_case,
            batch: args.batch,
            device: bertkit_model::parse_device(&args.device)?,
        },
    )?;
    let metrics: Vec<String> = evaluation
        .metrics
        .iter()
        .map(|(k, v)| format!("{k} {v:.4}"))
        .collect();
    println!(
        "{}: {} examples of {}: loss {:.4}, {}",
        task.folder(),
        evaluation.examples,
        data.display(),
        evaluation.loss,
        metrics.join(", ")
    );
    if let Some(out) = args.output {
        println!("wrote {}", out.display());
    }
    Ok(())
}

pub(crate) fn split(command: SplitCommand) -> Result<()> {
    let SplitCommand::Squad(args) = command;
    let dataset = Dataset::load(&args.input)?;
    let (train, dev) = dataset.split_articles(args.train_articles)?;
    std::fs::create_dir_all(&args.output).map_err(|e| format!("{}: {e}", args.output.display()))?;
    for (name, part) in [("train.json", &train), ("dev.json", &dev)] {
        let path = args.output.join(name);
        part.save(&path)?;
        println!(
            "{}: {} articles, {} questions",
            path.display(),
            part.data.len(),
            part.question_count()
        );
    }
    Ok(())
}

pub(crate) fn extract_features(args: ExtractFeaturesArgs) -> Result<()> {
    use bertkit_tasks::features::{FeatureFormat, FeatureOptions, parse_layers};
    let format = match args.format.as_str() {
        "jsonl" => FeatureFormat::Jsonl,
        "npy" => FeatureFormat::Npy,
        other => return Err(format!("--format {other:?}: jsonl or npy").into()),
    };
    let options = FeatureOptions {
        layers: parse_layers(&args.layers).map_err(|e| format!("--layers: {e}"))?,
        max_seq_length: args.max_seq_length,
        batch: args.batch_size.max(1),
        lower_case: bertkit_tasks::model_dir::lower_case(&args.model, args.cased)?,
        dtype: bertkit_model::parse_dtype(&args.dtype)?,
        device: bertkit_model::parse_device(&args.device)?,
        format,
    };
    let started = Instant::now();
    let mut logged = Instant::now();
    let done = bertkit_tasks::features::extract_features(
        &args.model,
        &args.input,
        &args.output,
        &options,
        &mut |lines| {
            if logged.elapsed().as_secs() >= 10 {
                logged = Instant::now();
                let rate = lines as f64 / started.elapsed().as_secs_f64();
                eprintln!("{lines} lines ({rate:.0} lines/s)");
            }
        },
    )?;
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "{}: {} lines, {} tokens, layers {:?} of width {} ({:.1} s, {:.0} lines/s){}",
        args.output.display(),
        done.lines,
        done.tokens,
        done.layers,
        done.hidden,
        seconds,
        done.lines as f64 / seconds.max(1e-9),
        if done.truncated > 0 {
            format!(
                "; {} line(s) cut to {} tokens",
                done.truncated, done.max_seq_length
            )
        } else {
            String::new()
        }
    );
    Ok(())
}
