//! The commands that fetch and chain: `download url|sources` and `pipeline`. Each runs its
//! library with a [`StageRenderer`] on stderr and prints the summary on stdout.

use std::time::{Duration, Instant};

use bertkit_download::Fetched;
use bertkit_stage_io::stage::{Event, Reporter};

use crate::flags::data::*;
use crate::render::StageRenderer;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

pub(crate) fn download(command: DownloadCommand) -> Result<()> {
    match command {
        DownloadCommand::Url(args) => download_url(args),
        DownloadCommand::Sources(args) => download_sources(args),
    }
}

fn download_sources(args: DownloadSourcesArgs) -> Result<()> {
    let registry = bertkit_download::sources::Registry::load(&args.registry)?;
    let vars = args.vars.into_iter().collect();
    let options = bertkit_download::sources::SetOptions {
        fetch: bertkit_download::FetchOptions {
            retries: args.retries,
            ..Default::default()
        },
        queue: bertkit_download::queue::QueueOptions {
            jobs: args.jobs,
            per_host: args.per_host,
            min_interval: Duration::from_millis(args.interval_ms),
        },
        ranks: args.ranks.ranks()?,
    };
    let started = Instant::now();
    let renderer = StageRenderer::new(false);
    let outcome = bertkit_download::sources::download_set(
        &registry,
        &args.set,
        &vars,
        &args.output,
        args.mirror.as_deref(),
        &options,
        &renderer,
    )?;
    drop(renderer);
    let up_to_date = outcome.is_up_to_date();
    let done = outcome.into_summary();
    let bytes: u64 = done.iter().map(|(_, f)| f.bytes()).sum();
    if up_to_date {
        println!(
            "{}: set {:?} is complete ({} files, {bytes} bytes); nothing to do.",
            args.output.display(),
            args.set,
            done.len()
        );
        return Ok(());
    }
    let fetched = done
        .iter()
        .filter(|(_, f)| !matches!(f, Fetched::AlreadyPresent { .. }))
        .count();
    println!(
        "set {:?}: {fetched} of {} file(s) fetched{} into {} ({bytes} bytes, {:.1} s)",
        args.set,
        done.len(),
        args.mirror
            .as_ref()
            .map(|m| format!(" from {m}"))
            .unwrap_or_default(),
        args.output.display(),
        started.elapsed().as_secs_f64()
    );
    for (path, fetched) in &done {
        let how = match fetched {
            Fetched::AlreadyPresent { .. } => "already present",
            Fetched::Copied { .. } => "copied",
            Fetched::Downloaded { .. } => "downloaded",
        };
        println!("  {path}  {how}");
    }
    Ok(())
}

fn download_url(args: DownloadUrlArgs) -> Result<()> {
    let checksum = bertkit_download::Checksum::from_one_of(
        args.sha256.as_deref(),
        args.sha1.as_deref(),
        args.md5.as_deref(),
    )?;
    let options = bertkit_download::FetchOptions {
        retries: args.retries,
        ..Default::default()
    };
    let renderer = StageRenderer::new(false);
    let fetched = bertkit_download::fetch(
        &args.url,
        &args.output,
        checksum.as_ref(),
        &options,
        &renderer,
    )?;
    drop(renderer);
    let verified = if checksum.is_some() {
        ", checksum verified"
    } else {
        ""
    };
    match fetched {
        Fetched::AlreadyPresent { bytes } => println!(
            "{} is already complete ({bytes} bytes{verified}); nothing to do.",
            args.output.display()
        ),
        Fetched::Copied { bytes } => println!(
            "copied {} to {} ({bytes} bytes{verified})",
            args.url,
            args.output.display()
        ),
        Fetched::Downloaded {
            bytes,
            resumed_from,
            attempts,
        } => {
            let resumed = if resumed_from > 0 {
                format!(", resumed at {resumed_from}")
            } else {
                String::new()
            };
            println!(
                "downloaded {} to {} ({bytes} bytes{verified}{resumed}, {attempts} request(s))",
                args.url,
                args.output.display()
            )
        }
    }
    Ok(())
}

pub(crate) fn pipeline(args: PipelineArgs) -> Result<()> {
    let mut config = bertkit_pipeline::PipelineConfig::load(&args.config)?;
    config.download.vars.extend(args.vars);
    let registry = bertkit_download::sources::Registry::load(&args.registry)?;
    println!(
        "pipeline {} into {}",
        args.config.display(),
        config.output.display()
    );
    let options = bertkit_pipeline::RunOptions {
        ranks: args.ranks.ranks()?,
        wait_timeout: Duration::from_secs(args.wait_timeout),
        ..Default::default()
    };
    if options.ranks.world_size > 1 {
        println!("  {} (steps of other ranks are not listed)", options.ranks);
    }
    let started = Instant::now();
    let renderer = StageRenderer::new(false);
    // A finished step is a line of the summary table (stdout); the rest is rendered on stderr.
    let reporter = |event: &Event<'_>| match event {
        Event::Finished {
            task,
            summary,
            up_to_date,
        } => {
            let state = if *up_to_date { "up to date" } else { "done" };
            println!("  {task:<18} {state:<10} {summary}");
        }
        other => renderer.report(other),
    };
    let outcome = bertkit_pipeline::run(
        &config,
        &registry,
        args.mirror.as_deref(),
        &options,
        &reporter,
    )?;
    let reports = outcome.summary();
    let redone = reports.iter().filter(|r| !r.up_to_date).count();
    println!(
        "{} step(s) run, {} up to date, {:.2} s in all",
        redone,
        reports.len() - redone,
        started.elapsed().as_secs_f64()
    );
    for dir in ["raw", "formatted", "shards", "records"] {
        println!("  {}", config.output.join(dir).display());
    }
    Ok(())
}
