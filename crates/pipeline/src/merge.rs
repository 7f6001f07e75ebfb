//! Merge points: where the ranks of a multi-process run wait for each other.
//!
//! Ranks share the output folder (a shared file system on a cluster). When a rank finishes its
//! part of a step, it writes the marker `<output>/.ranks/<step>.rank-R-of-W`, holding the run's
//! fingerprint (a hash of the config, the mirror and the world size), and then waits until
//! every rank's marker for that step holds the same fingerprint. A step that reads what other
//! ranks wrote (format reads all downloads, shard reads all formatted text, records reads all
//! shards) starts only after such a merge point.
//!
//! Markers stay after the run. A re-run with the same config passes a merge point at once when
//! the other ranks finished that step before (their outputs are on disk and the steps skip
//! finished work); a changed config has a new fingerprint and waits for fresh markers. Delete
//! `<output>/.ranks` to make every rank wait for the others again.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bertkit_stage_io::Ranks;

use crate::PipelineError;

/// The merge points of one run.
pub struct MergePoints {
    dir: PathBuf,
    fingerprint: String,
    ranks: Ranks,
    timeout: Duration,
    poll: Duration,
}

impl MergePoints {
    /// Merge points under `output`, for a run identified by `fingerprint`.
    pub fn new(output: &Path, fingerprint: String, ranks: Ranks, timeout: Duration) -> Self {
        MergePoints {
            dir: output.join(".ranks"),
            fingerprint,
            ranks,
            timeout,
            poll: Duration::from_millis(200),
        }
    }

    fn marker(&self, step: &str, rank: usize) -> PathBuf {
        let step: String = step
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        self.dir
            .join(format!("{step}.rank-{rank}-of-{}", self.ranks.world_size))
    }

    /// Marks this rank's part of `step` done and waits for every other rank's (no-op for one
    /// process). `waiting` is called once if the wait is not immediate.
    pub fn arrive(&self, step: &str, waiting: &mut dyn FnMut(&str)) -> Result<(), PipelineError> {
        if self.ranks.world_size == 1 {
            return Ok(());
        }
        let mine = self.marker(step, self.ranks.rank);
        std::fs::create_dir_all(&self.dir)
            .and_then(|()| bertkit_stage_io::write_atomically(&mine, self.fingerprint.as_bytes()))
            .map_err(|e| PipelineError::Merge {
                step: step.into(),
                message: format!("{}: {e}", mine.display()),
            })?;
        let started = Instant::now();
        let mut told = false;
        loop {
            let missing: Vec<usize> = (0..self.ranks.world_size)
                .filter(|&r| {
                    std::fs::read_to_string(self.marker(step, r))
                        .ok()
                        .as_deref()
                        != Some(self.fingerprint.as_str())
                })
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if started.elapsed() >= self.timeout {
                return Err(PipelineError::Merge {
                    step: step.into(),
                    message: format!(
                        "{}: gave up after {:.0} s waiting for rank(s) {missing:?} to finish it \
                         (markers in {})",
                        self.ranks,
                        self.timeout.as_secs_f64(),
                        self.dir.display()
                    ),
                });
            }
            if !told {
                waiting(&format!("{step}: waiting for rank(s) {missing:?}"));
                told = true;
            }
            std::thread::sleep(self.poll);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_wait_for_each_other_and_time_out_alone() {
        let dir = tempfile::tempdir().unwrap();
        let point = |rank, fp: &str, timeout| {
            MergePoints::new(
                dir.path(),
                fp.into(),
                Ranks::new(rank, 2).unwrap(),
                Duration::from_millis(timeout),
            )
        };
        // Alone, rank 0 times out naming the missing rank.
        let err = point(0, "a", 300).arrive("shard", &mut |_| {}).unwrap_err();
        assert!(err.to_string().contains("[1]"), "{err}");
        // Together they pass.
        std::thread::scope(|s| {
            let a = s.spawn(|| point(0, "a", 5000).arrive("shard", &mut |_| {}));
            std::thread::sleep(Duration::from_millis(300));
            let b = s.spawn(|| point(1, "a", 5000).arrive("shard", &mut |_| {}));
            a.join().unwrap().unwrap();
            b.join().unwrap().unwrap();
        });
        // A different run (fingerprint) does not accept the old markers.
        assert!(point(0, "b", 300).arrive("shard", &mut |_| {}).is_err());
        // One process never waits.
        MergePoints::new(dir.path(), "c".into(), Ranks::single(), Duration::ZERO)
            .arrive("shard", &mut |_| {})
            .unwrap();
    }
}
