//! The one way a stage runs, whichever it is (download, format, shard, records, the pipeline
//! that chains them): it tells a [`Reporter`] what it is doing as it goes, and returns an
//! [`Outcome`], either the work done or an output found up to date, each with the stage's own
//! summary (its manifest, its files).
//!
//! The stages never print. The `bertkit` binary renders the events (a bar with rate and ETA on
//! a terminal, a log line every few seconds otherwise); a library user passes [`Silent`] or a
//! closure.

/// What a stage reports while it runs.
#[derive(Debug, Clone, Copy)]
pub enum Event<'a> {
    /// What the stage is doing now ("reading 3 inputs", "writing shards").
    Message(&'a str),
    /// A recoverable problem: an item skipped and counted, a transfer retried.
    Warning(&'a str),
    /// Work under way on one task (an input being read, a file being downloaded).
    Progress(&'a Progress<'a>),
    /// A task is finished (a file written, a step of the pipeline done).
    Finished {
        /// The task, as named in its progress (a file, a step).
        task: &'a str,
        /// One line on what it did.
        summary: &'a str,
        /// Whether it was found already done (nothing redone).
        up_to_date: bool,
    },
}

/// How far one task has come. Tasks that run at the same time have different names.
#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    /// The task ("input 1/3", a file's URL).
    pub task: &'a str,
    /// Units done so far.
    pub done: u64,
    /// Units in all, when known.
    pub total: Option<u64>,
    /// What the units are: `"bytes"`, or a plural noun.
    pub unit: &'static str,
    /// Further counts, in words ("1200 pages read, 900 documents written").
    pub detail: &'a str,
}

/// Receives a stage's events. Implemented by [`Silent`] and by every `Fn(&Event) + Sync`.
pub trait Reporter: Sync {
    /// Called for each event; must be cheap (stages call it from their worker threads).
    fn report(&self, event: &Event<'_>);
}

/// Ignores every event.
#[derive(Debug, Default, Clone, Copy)]
pub struct Silent;

impl Reporter for Silent {
    fn report(&self, _event: &Event<'_>) {}
}

impl<F: Fn(&Event<'_>) + Sync> Reporter for F {
    fn report(&self, event: &Event<'_>) {
        self(event)
    }
}

/// How a stage run ended, with the stage's summary either way.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome<S> {
    /// The work was done.
    Ran(S),
    /// The output was already complete for these inputs and options; nothing was redone.
    UpToDate(S),
}

impl<S> Outcome<S> {
    /// The summary, either way.
    pub fn summary(&self) -> &S {
        match self {
            Outcome::Ran(s) | Outcome::UpToDate(s) => s,
        }
    }

    /// The summary, either way.
    pub fn into_summary(self) -> S {
        match self {
            Outcome::Ran(s) | Outcome::UpToDate(s) => s,
        }
    }

    /// The same outcome with its summary turned by `f`.
    pub fn map<T>(self, f: impl FnOnce(S) -> T) -> Outcome<T> {
        match self {
            Outcome::Ran(s) => Outcome::Ran(f(s)),
            Outcome::UpToDate(s) => Outcome::UpToDate(f(s)),
        }
    }

    /// Whether nothing was redone.
    pub fn is_up_to_date(&self) -> bool {
        matches!(self, Outcome::UpToDate(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn closures_report_and_outcomes_carry_their_summary() {
        let seen = Mutex::new(Vec::new());
        let reporter = |e: &Event<'_>| {
            if let Event::Finished { task, .. } = e {
                seen.lock().unwrap().push(task.to_string());
            }
        };
        let r: &dyn Reporter = &reporter;
        r.report(&Event::Message("reading"));
        r.report(&Event::Finished {
            task: "a.parquet",
            summary: "3 instances",
            up_to_date: false,
        });
        assert_eq!(*seen.lock().unwrap(), vec!["a.parquet".to_string()]);
        let o = Outcome::UpToDate(7);
        assert!(o.is_up_to_date());
        assert_eq!((*o.summary(), o.into_summary()), (7, 7));
        assert!(!Outcome::Ran(()).is_up_to_date());
        assert_eq!(Outcome::UpToDate(2).map(|n| n * 3), Outcome::UpToDate(6));
    }
}
