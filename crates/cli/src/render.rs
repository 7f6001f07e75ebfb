//! How the binary shows what the stages report: progress and notes on stderr (a bar per task
//! with rate and ETA on a terminal, a log line every 10 s per task otherwise), summaries on
//! stdout (printed by each command).

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bertkit_stage_io::stage::{Event, Progress, Reporter};

/// Renders [`Event`]s on stderr.
pub struct StageRenderer {
    quiet: bool,
    terminal: bool,
    multi: indicatif::MultiProgress,
    tasks: Mutex<HashMap<String, Task>>,
}

/// One task's progress as shown so far.
struct Task {
    bar: Option<indicatif::ProgressBar>,
    logged_at: Instant,
    logged_done: u64,
}

/// How often a task's progress is logged when stderr is not a terminal.
const LOG_EVERY: Duration = Duration::from_secs(10);

impl StageRenderer {
    /// A renderer; `quiet` keeps only warnings.
    pub fn new(quiet: bool) -> Self {
        StageRenderer {
            quiet,
            terminal: std::io::stderr().is_terminal(),
            multi: indicatif::MultiProgress::new(),
            tasks: Mutex::new(HashMap::new()),
        }
    }

    /// Prints a line above the bars.
    fn line(&self, line: &str) {
        if self.terminal {
            let _ = self.multi.println(line);
        } else {
            eprintln!("{line}");
        }
    }

    fn progress(&self, p: &Progress<'_>) {
        let mut tasks = self.tasks.lock().unwrap();
        let task = tasks.entry(p.task.to_string()).or_insert_with(|| {
            // A task of known size (a download) says so when it starts; others only log as
            // they go.
            if let (false, Some(total)) = (self.terminal, p.total) {
                eprintln!(
                    "{}: {} of {}",
                    p.task,
                    amount(p.done, p.unit),
                    amount(total, p.unit)
                );
            }
            Task {
                bar: self.terminal.then(|| self.bar(p)),
                logged_at: Instant::now(),
                logged_done: p.done,
            }
        });
        if let Some(bar) = &task.bar {
            if let Some(total) = p.total {
                bar.set_length(total);
            }
            bar.set_position(p.done);
            bar.set_message(format!("{} {}", p.task, p.detail));
        } else if task.logged_at.elapsed() >= LOG_EVERY {
            let rate = (p.done.saturating_sub(task.logged_done)) as f64
                / task.logged_at.elapsed().as_secs_f64();
            let of = p
                .total
                .map_or(String::new(), |t| format!(" of {}", amount(t, p.unit)));
            eprintln!(
                "{}: {}{of} ({}/s) {}",
                p.task,
                amount(p.done, p.unit),
                amount(rate as u64, p.unit),
                p.detail
            );
            task.logged_at = Instant::now();
            task.logged_done = p.done;
        }
    }

    fn bar(&self, p: &Progress<'_>) -> indicatif::ProgressBar {
        let bar = self.multi.add(match p.total {
            Some(t) => indicatif::ProgressBar::new(t),
            None => indicatif::ProgressBar::new_spinner(),
        });
        let template = match (p.unit, p.total) {
            ("bytes", Some(_)) => {
                "{wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {msg}"
            }
            ("bytes", None) => "{spinner} {bytes} {bytes_per_sec} {msg}",
            (_, Some(_)) => "{wide_bar} {pos}/{len} ETA {eta} {msg}",
            (_, None) => "{spinner} {pos} {msg}",
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template(template)
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar
    }

    /// Ends a task's bar.
    fn end(&self, task: &str) {
        if let Some(bar) = self.tasks.lock().unwrap().remove(task).and_then(|t| t.bar) {
            bar.finish_and_clear();
        }
    }

    /// Clears every bar left (a run that stopped on an error).
    pub fn finish(&self) {
        for (_, task) in self.tasks.lock().unwrap().drain() {
            if let Some(bar) = task.bar {
                bar.abandon();
            }
        }
    }
}

impl Reporter for StageRenderer {
    fn report(&self, event: &Event<'_>) {
        match event {
            Event::Warning(w) => self.line(&format!("warning: {w}")),
            _ if self.quiet => {}
            Event::Message(m) => self.line(m),
            Event::Progress(p) => self.progress(p),
            Event::Finished { task, summary, .. } => {
                self.end(task);
                self.line(&format!("{task}: {summary}"));
            }
        }
    }
}

impl Drop for StageRenderer {
    fn drop(&mut self) {
        self.finish();
    }
}

/// `n` units in words: bytes as MB, anything else as a count.
fn amount(n: u64, unit: &str) -> String {
    if unit == "bytes" {
        format!("{:.1} MB", n as f64 / 1e6)
    } else {
        format!("{n} {unit}")
    }
}

/// Pre-training progress: a bar with ETA on a terminal (a full line every 50 steps), a full
/// line every 10 s otherwise.
pub struct TrainProgress {
    terminal: bool,
    bar: indicatif::ProgressBar,
    last: u64,
    logged_at: Instant,
}

impl TrainProgress {
    /// Steps `first..last` of a run.
    pub fn new(first: u64, last: u64) -> Self {
        let terminal = std::io::stderr().is_terminal();
        let bar = indicatif::ProgressBar::new(last);
        bar.set_position(first);
        if terminal {
            bar.set_style(
                indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} ETA {eta} {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
        } else {
            bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        TrainProgress {
            terminal,
            bar,
            last,
            logged_at: Instant::now(),
        }
    }

    /// After a step.
    pub fn step(&mut self, m: &bertkit_train::trainer::StepMetrics) {
        let line = format!(
            "step {} loss {:.4} (mlm {:.4}, nsp {:.4}) acc {:.3}/{:.3} lr {:.3e} |g| {:.3} {:.1} seq/s {:.0} tok/s {:.3} TFLOP/s{}{}",
            m.step,
            m.loss,
            m.mlm_loss,
            m.nsp_loss,
            m.mlm_accuracy,
            m.nsp_accuracy,
            m.lr,
            m.grad_norm,
            m.seq_per_s,
            m.tokens_per_s,
            m.tflops,
            m.mfu
                .map(|u| format!(" MFU {:.1}%", u * 100.0))
                .unwrap_or_default(),
            if m.skipped {
                format!(" skipped (loss scale {})", m.loss_scale)
            } else {
                String::new()
            },
        );
        let line = match &m.eval {
            Some(e) => format!(
                "{line}\n  held-out ({} sequences): loss {:.4} (mlm {:.4}, nsp {:.4}) acc {:.3}/{:.3}",
                e.eval_sequences,
                e.eval_loss,
                e.eval_mlm_loss,
                e.eval_nsp_loss,
                e.eval_mlm_accuracy,
                e.eval_nsp_accuracy
            ),
            None => line,
        };
        self.bar.set_position(m.step);
        if self.terminal {
            self.bar.set_message(format!("loss {:.3}", m.loss));
            if m.step.is_multiple_of(50) || m.eval.is_some() {
                self.bar.println(line);
            }
        } else if self.logged_at.elapsed() >= LOG_EVERY || m.step == self.last || m.eval.is_some() {
            eprintln!("{line}");
            self.logged_at = Instant::now();
        }
    }

    /// Clears the bar.
    pub fn finish(self) {
        self.bar.finish_and_clear();
    }
}
