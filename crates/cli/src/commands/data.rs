//! The data stages' commands: `format`, `shard`, `vocab`, `tokenize`, `records`. Each runs its stage with a [`StageRenderer`] on stderr and prints the stage's
//! summary on stdout.

use std::path::Path;
use std::time::Instant;

use bertkit_format::FormatManifest;
use bertkit_records::instances::InstanceOptions;
use bertkit_records::run::{Compat, RecordsOptions};
use bertkit_stage_io::stage::{Outcome, Reporter};

use crate::flags::data::*;
use crate::render::StageRenderer;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

pub(crate) fn format(command: FormatCommand) -> Result<()> {
    match command {
        FormatCommand::Wiki(args) => {
            let options = bertkit_format::wiki::WikiOptions {
                clean: bertkit_format::wiki::CleanOptions {
                    keep_lists: args.keep_lists,
                },
                keep_disambiguation: args.keep_disambiguation,
                max_bytes: args.common.max_bytes,
                threads: args.common.threads,
                strict: args.strict,
                ..Default::default()
            };
            run_format(&args.common, |output, reporter| {
                bertkit_format::wiki::format_wiki(&args.input, output, &options, reporter)
            })
        }
        FormatCommand::Books(args) => {
            let options = bertkit_format::books::BookOptions {
                max_bytes: args.common.max_bytes,
                threads: args.common.threads,
            };
            run_format(&args.common, |output, reporter| {
                bertkit_format::books::format_books(&args.input, output, &options, reporter)
            })
        }
    }
}

/// Runs a format stage with its progress on stderr, then prints its summary.
fn run_format(
    common: &CommonArgs,
    stage: impl FnOnce(
        &Path,
        &dyn Reporter,
    ) -> std::result::Result<Outcome<FormatManifest>, bertkit_format::FormatError>,
) -> Result<()> {
    let renderer = StageRenderer::new(common.quiet);
    let outcome = stage(&common.output, &renderer)?;
    drop(renderer);
    print_format_summary(&outcome, &common.output);
    Ok(())
}

fn print_format_summary(outcome: &Outcome<FormatManifest>, output: &Path) {
    let manifest = outcome.summary();
    let manifest_path = output.join(FormatManifest::file_name(&manifest.kind));
    match outcome {
        Outcome::UpToDate(_) => println!(
            "{} is up to date (same inputs and options); nothing to do.",
            manifest_path.display()
        ),
        Outcome::Ran(m) => println!(
            "formatted {} input(s) in {:.2} s",
            m.inputs.len(),
            m.elapsed_seconds
        ),
    }
    println!(
        "output: {} ({} file(s))",
        output.display(),
        manifest.outputs.len()
    );
    for f in &manifest.outputs {
        println!(
            "  {}  {} bytes, {} documents, {} sentences",
            f.file, f.bytes, f.documents, f.sentences
        );
    }
    println!("manifest: {}", manifest_path.display());
    println!(
        "counts: {}",
        serde_json::to_string_pretty(&manifest.counts).unwrap_or_default()
    );
}

pub(crate) fn shard(args: ShardArgs) -> Result<()> {
    let ranks = args.ranks.ranks()?;
    let options = bertkit_shard::ShardOptions {
        num_train_shards: args.num_train_shards,
        num_test_shards: args.num_test_shards,
        test_fraction: args.test_fraction,
        seed: args.seed,
        compression: bertkit_shard::Compression::from_name(
            args.compress.as_deref(),
            args.zstd_level,
        )?,
        rank: ranks.rank,
        world_size: ranks.world_size,
        threads: args.threads,
        run_bytes: args.run_mb.max(1) << 20,
    };
    let renderer = StageRenderer::new(args.quiet);
    let outcome = bertkit_shard::shard(&args.input, &args.output, &options, &renderer)?;
    drop(renderer);
    let m = outcome.summary();
    let manifest_path = args.output.join(bertkit_shard::ShardManifest::file_name(
        ranks.rank,
        ranks.world_size,
    ));
    if outcome.is_up_to_date() {
        println!(
            "{} is up to date (same inputs and parameters); nothing to do.",
            manifest_path.display()
        );
    } else {
        println!(
            "sharded {} documents ({} sentences, {:.1} MB) from {} input(s) in {:.2} s",
            m.totals.documents,
            m.totals.sentences,
            m.totals.bytes as f64 / 1e6,
            m.inputs.len(),
            m.elapsed_seconds
        );
    }
    let written: Vec<_> = m.shards.iter().filter(|s| s.file_bytes.is_some()).collect();
    println!(
        "output: {} ({} shard file(s) written by this process)",
        args.output.display(),
        written.len()
    );
    for s in written {
        println!(
            "  {}  {} documents, {} sentences, {} bytes",
            s.file, s.documents, s.sentences, s.bytes
        );
    }
    println!(
        "test fraction {:.4} (asked {}), train imbalance {:.2}% of sentences and {:.2}% of bytes",
        m.totals.test_fraction_achieved,
        args.test_fraction,
        m.totals.train_sentence_imbalance * 100.0,
        m.totals.train_byte_imbalance * 100.0
    );
    println!("manifest: {}", manifest_path.display());
    Ok(())
}

pub(crate) fn tokenize(args: TokenizeArgs) -> Result<()> {
    use bertkit_tokenizer::jsonl::{LineFormat, tokenize_lines};
    let tokenizer = bertkit_tokenizer::FullTokenizer::from_vocab_file(&args.vocab, !args.cased)?;
    let format = if args.jsonl_input {
        LineFormat::Jsonl
    } else {
        LineFormat::Text
    };
    let stdout = std::io::BufWriter::new(std::io::stdout().lock());
    tokenize_lines(&tokenizer, std::io::stdin().lock(), format, stdout)
        .map_err(|e| format!("stdin: {e}"))?;
    Ok(())
}

pub(crate) fn vocab(args: VocabArgs) -> Result<()> {
    let n =
        bertkit_tokenizer::vocab::train_vocab(&args.input, args.size, !args.cased, &args.output)?;
    println!("wrote {} ({n} tokens)", args.output.display());
    Ok(())
}

pub(crate) fn records(args: RecordsArgs) -> Result<()> {
    let preset = InstanceOptions::phase(args.phase).ok_or("--phase must be 1 or 2")?;
    let options = RecordsOptions {
        instances: InstanceOptions {
            max_seq_length: args.max_seq_length.unwrap_or(preset.max_seq_length),
            max_predictions_per_seq: args
                .max_predictions_per_seq
                .unwrap_or(preset.max_predictions_per_seq),
            masked_lm_prob: args.masked_lm_prob,
            short_seq_prob: args.short_seq_prob,
            dupe_factor: args.dupe_factor,
            whole_word_mask: args.whole_word_mask,
            seed: args.seed,
        },
        lower_case: !args.cased,
        compat: if args.compat.is_some() {
            Compat::Google
        } else {
            Compat::None
        },
    };
    if options.instances.max_seq_length < 5 {
        return Err("--max-seq-length must be at least 5".into());
    }
    let started = Instant::now();
    let outcome = if args.output.extension().is_some_and(|e| e == "parquet") {
        bertkit_records::run::records_to_file(
            &args.input,
            &args.vocab,
            &args.output,
            args.jsonl.as_deref(),
            &options,
        )?
        .map(|s| vec![s])
    } else {
        if args.jsonl.is_some() {
            return Err("--jsonl needs a .parquet output (file mode)".into());
        }
        let renderer = StageRenderer::new(false);
        bertkit_records::run::records_to_dir(
            &args.input,
            &args.vocab,
            &args.output,
            &options,
            &renderer,
        )?
    };
    if outcome.is_up_to_date() {
        println!(
            "{} is up to date (same inputs, vocabulary and parameters); nothing to do.",
            args.output.display()
        );
        return Ok(());
    }
    let summaries = outcome.into_summary();
    let written: Vec<_> = summaries.iter().filter(|s| !s.skipped).collect();
    let instances: usize = written.iter().map(|s| s.instances).sum();
    let tokens: usize = written.iter().map(|s| s.tokens).sum();
    let secs = started.elapsed().as_secs_f64();
    println!(
        "wrote {} file(s) ({} up to date): {instances} instances, {tokens} tokens in {secs:.2} s ({:.0} instances/s)",
        written.len(),
        summaries.len() - written.len(),
        instances as f64 / secs.max(1e-9)
    );
    for s in written {
        println!(
            "  {}  {} instances (tokenize {:.3} s, instances {:.3} s, write {:.3} s)",
            s.output.display(),
            s.instances,
            s.seconds.tokenize,
            s.seconds.instances,
            s.seconds.write
        );
    }
    Ok(())
}
