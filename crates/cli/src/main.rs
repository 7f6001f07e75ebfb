//! `bertkit`: the command line over the stage crates. It parses arguments ([`flags`]), runs
//! the libraries ([`commands`], one module per command group), renders their progress
//! ([`render`]) and prints summaries; all the work lives in the libraries.

use std::process::ExitCode;

use clap::Parser;

mod alloc;
mod commands;
mod flags;
mod render;

use flags::{Cli, Command};

/// Tensor buffers are large and short-lived: mimalloc (see the workspace Cargo.toml), with a
/// byte count `bench memory` turns on.
#[global_allocator]
static ALLOCATOR: alloc::Counting = alloc::Counting;

/// mimalloc's `mi_option_purge_delay` (the 16th entry of `mi_option_e`, v2 and v3 alike).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Allocator settings for tensors and records, both measured on 2 cores:
/// - for the commands that train or run a model, freed memory stays mapped instead of going
///   back to the OS 10 ms later: each training step frees and re-allocates the same large
///   buffers, and purging them cost a page fault per 4 KiB on the next step (SQuAD fine-tuning
///   of MiniLM: 60 s -> 31 s for 3 steps). The data stages keep mimalloc's purging: they free
///   buffers of ever-changing sizes (one shard after another), and without it their resident
///   set kept what every earlier shard had freed (records, 4 shards of 20 MB: 217 MB peak
///   against 99 MB, for ~0.2 s more system time of 1.8 CPU-s);
/// - no transparent huge pages: mimalloc asks for them on its arenas, and each first touch of
///   an arena page then zeroes 2 MiB (`bertkit records` spent a third of its time there;
///   1.29 s -> 1.05 s without, training unchanged within noise). Since the records stage
///   touches less memory, huge pages make its small runs faster (fewer faults) but double its
///   peak RSS and stall it in compaction on larger inputs (BENCHMARKS.md), so they stay off.
///
/// `MIMALLOC_PURGE_DELAY` in the environment still wins over the first; `BERTKIT_THP=1` keeps
/// huge pages (`0` or unset: off; another value is an error naming the variable).
fn configure_allocator(command: &Command) -> Result<(), String> {
    let huge_pages = match std::env::var("BERTKIT_THP").ok().as_deref() {
        None | Some("" | "0") => false,
        Some("1") => true,
        Some(other) => return Err(format!("BERTKIT_THP={other:?}: 0 or 1 expected")),
    };
    let data_stage = matches!(
        command,
        Command::Format(_)
            | Command::Shard(_)
            | Command::Tokenize(_)
            | Command::Vocab(_)
            | Command::Records(_)
            | Command::Download(_)
            | Command::Pipeline(_)
    );
    if !data_stage && std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets an integer option of the allocator; no memory is touched.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
    #[cfg(target_os = "linux")]
    if !huge_pages {
        // SAFETY: a process-wide flag for future page faults; no memory is touched. Failure
        // (an old kernel) only leaves huge pages on.
        unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = huge_pages;
    Ok(())
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    use commands::{bench, data, model, pipeline, tasks, train};
    match cli.command {
        Command::Format(c) => data::format(c),
        Command::Shard(args) => data::shard(args),
        Command::Tokenize(args) => data::tokenize(args),
        Command::Vocab(args) => data::vocab(args),
        Command::Records(args) => data::records(args),
        Command::Download(c) => pipeline::download(c),
        Command::Pipeline(args) => pipeline::pipeline(args),
        Command::Forward(args) => train::forward(args),
        Command::ExtractFeatures(args) => tasks::extract_features(args),
        Command::Convert(c) => model::convert(c),
        Command::Pretrain(args) => train::pretrain(args),
        Command::Plot(args) => train::plot(args),
        Command::Plan(args) => train::plan(args),
        Command::Bench(c) => bench::bench(c),
        Command::Check(c) => model::check(c),
        Command::Evaluate(c) => tasks::evaluate(c),
        Command::Finetune(c) => tasks::finetune(c),
        Command::Predict(c) => tasks::predict(c),
        Command::Split(c) => tasks::split(c),
        Command::Reference => {
            print!("{}", commands::reference::markdown());
            Ok(())
        }
    }
}

/// candle attaches a captured backtrace to its errors whenever `RUST_BACKTRACE` is set, and
/// prints it as part of the message: in a release binary a column of `<unknown>` frames after
/// the error. The message alone is the error, so library backtraces are off unless
/// `RUST_LIB_BACKTRACE` asks for them; panics still honour `RUST_BACKTRACE`.
fn quiet_library_backtraces() {
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        // SAFETY: the first thing main does, before any other thread exists.
        unsafe { std::env::set_var("RUST_LIB_BACKTRACE", "0") };
    }
}

fn main() -> ExitCode {
    quiet_library_backtraces();
    let cli = Cli::parse();
    if let Err(e) = configure_allocator(&cli.command) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    if cli.command.no_tf32() {
        bertkit_model::set_tf32(false);
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::quiet_library_backtraces;

    const CHILD: &str = "BERTKIT_BACKTRACE_TEST_CHILD";
    const NAME: &str = "tests::a_library_error_is_its_message_alone_under_rust_backtrace";

    /// Backtrace capture reads the environment once per process, so the check runs in a child:
    /// this test binary again, with `RUST_BACKTRACE=1`, running only this test.
    #[test]
    fn a_library_error_is_its_message_alone_under_rust_backtrace() {
        if std::env::var_os(CHILD).is_some() {
            quiet_library_backtraces();
            let e = candle_core::Error::Msg("dtype mismatch".into()).bt();
            assert_eq!(e.to_string(), "dtype mismatch");
            return;
        }
        let child = |lib_backtrace: Option<&str>| {
            let mut c = std::process::Command::new(std::env::current_exe().unwrap());
            c.args(["--exact", NAME, "--test-threads", "1"])
                .env(CHILD, "1")
                .env("RUST_BACKTRACE", "1")
                .env_remove("RUST_LIB_BACKTRACE");
            if let Some(v) = lib_backtrace {
                c.env("RUST_LIB_BACKTRACE", v);
            }
            c.output().unwrap()
        };
        let quiet = child(None);
        assert!(
            quiet.status.success(),
            "{}",
            String::from_utf8_lossy(&quiet.stdout)
        );
        // Asked for explicitly, the frames are there: the check above can fail.
        let asked = child(Some("1"));
        assert!(!asked.status.success());
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&asked.stdout),
            String::from_utf8_lossy(&asked.stderr)
        );
        // The failed assertion's left side, escaped: the message, then the frames.
        assert!(said.contains(r#"left: "dtype mismatch\n"#), "{said}");
    }
}
