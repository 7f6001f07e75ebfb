//! A run folder's earlier run, and what a new run does with it.
//!
//! A run folder (pre-training or fine-tuning) holds one run: its checkpoints, its final model,
//! its `metrics.jsonl` and event files. A run started on a folder that holds an earlier one
//! would write over it piecemeal (its metrics truncated, its checkpoints rotated away by the
//! new ones, a later `--resume` mixing both), so it is refused unless the user says which of
//! the two they mean: continue it (`--resume`) or keep it apart and start afresh
//! (`--overwrite`, which moves it into a sibling folder and deletes nothing).
//!
//! Everything here runs under the folder's lock ([`crate::checkpoint::hold`]), by the one
//! process that writes the folder.

use std::path::{Path, PathBuf};

use bertkit_stage_io::lock::{FolderLock, LOCK_FILE};

use crate::{TrainError, checkpoint, io_err};

/// What a run does where its folder holds an earlier run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EarlierRun {
    /// Start afresh; a folder holding an earlier run is refused, naming what it holds.
    #[default]
    Refuse,
    /// Continue it from its newest checkpoint that verifies. With `stop_if_damaged`, a
    /// damaged newest checkpoint stops the run instead of being passed over for an older
    /// one (a user who would rather look than lose the steps between).
    Resume {
        /// Stop, rather than resume from an older checkpoint, where the newest is damaged.
        stop_if_damaged: bool,
    },
    /// Move it into a new sibling folder `NAME.earlier-N` (see [`move_aside`]), then start
    /// afresh.
    MoveAside,
}

impl EarlierRun {
    /// The setting from the command line's `--resume`, `--overwrite` and
    /// `--stop-if-damaged` (which the parser keeps apart: resume and overwrite conflict,
    /// stop-if-damaged needs resume).
    pub fn from_flags(resume: bool, overwrite: bool, stop_if_damaged: bool) -> Self {
        match (resume, overwrite) {
            (true, _) => EarlierRun::Resume { stop_if_damaged },
            (false, true) => EarlierRun::MoveAside,
            (false, false) => EarlierRun::Refuse,
        }
    }

    /// Whether the run continues the folder's earlier run.
    pub fn resumes(self) -> bool {
        matches!(self, EarlierRun::Resume { .. })
    }
}

/// What the run folder `run` holds of an earlier run, in words (`checkpoints up to step 60`,
/// `a final model`, `metrics.jsonl of 5 steps`), or `None` where it holds none.
pub fn earlier_run(run: &Path) -> Option<String> {
    if let Some((step, _)) = checkpoint::newest(run) {
        return Some(format!("checkpoints up to step {step}"));
    }
    if checkpoint::model_folder(run).is_some() {
        return Some("a final model".to_string());
    }
    // (Read only where nothing else says a run was here.)
    let logged = std::fs::read_to_string(run.join("metrics.jsonl"))
        .map(|text| text.lines().filter(|l| !l.trim().is_empty()).count())
        .unwrap_or(0);
    (logged > 0).then(|| format!("metrics.jsonl of {logged} steps"))
}

/// Takes the run folder `run` for a run that does `earlier` with an earlier run there: holds
/// it ([`checkpoint::hold`]: one writer, leftovers of killed writes removed), then, under that
/// hold, refuses an earlier run ([`EarlierRun::Refuse`]), moves it aside
/// ([`EarlierRun::MoveAside`], said through `say`) or leaves it to be resumed. The hold lasts
/// as long as the lock returned.
pub fn take(
    run: &Path,
    earlier: EarlierRun,
    say: &mut dyn FnMut(&str),
) -> Result<FolderLock, TrainError> {
    let lock = checkpoint::hold(run)?;
    prepare(run, earlier, say)?;
    Ok(lock)
}

/// [`take`]'s work on an earlier run, the folder held.
fn prepare(run: &Path, earlier: EarlierRun, say: &mut dyn FnMut(&str)) -> Result<(), TrainError> {
    match earlier {
        EarlierRun::Resume { .. } => Ok(()),
        EarlierRun::Refuse => match earlier_run(run) {
            None => Ok(()),
            Some(held) => Err(TrainError::Config(format!(
                "{} holds an earlier run ({held}): --resume to continue it, --overwrite to move \
                 it aside and start afresh, or write to another folder",
                run.display()
            ))),
        },
        EarlierRun::MoveAside => {
            if let Some(held) = earlier_run(run)
                && let Some(moved) = move_aside(run)?
            {
                say(&format!(
                    "moved the earlier run in {} ({held}) to {}",
                    run.display(),
                    moved.display()
                ));
            }
            Ok(())
        }
    }
}

/// Moves every entry of the run folder `run` but its lock file into a new sibling folder
/// `NAME.earlier-N` (the first `N` from 1 not taken), by renames: nothing is copied or
/// deleted, and a run moved aside is a run folder still (`--resume` on it continues it).
/// Returns that folder, or `None` where `run` held nothing to move.
pub fn move_aside(run: &Path) -> Result<Option<PathBuf>, TrainError> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(run)
        .map_err(io_err(run))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .map_err(io_err(run))?;
    entries.retain(|p| p.file_name().is_some_and(|n| n != LOCK_FILE));
    if entries.is_empty() {
        return Ok(None);
    }
    // `.` and `x/..` name no folder of their own: their real path does (a sibling of `.` must
    // not land inside it).
    let real;
    let (name, parent) = match (run.file_name(), run.parent()) {
        (Some(name), Some(parent)) => (name, parent),
        _ => {
            real = std::fs::canonicalize(run).map_err(io_err(run))?;
            match (real.file_name(), real.parent()) {
                (Some(name), Some(parent)) => (name, parent),
                _ => {
                    return Err(TrainError::Config(format!(
                        "{}: the root folder cannot be moved aside; write the run to a folder \
                         of its own",
                        run.display()
                    )));
                }
            }
        }
    };
    let name = name.to_string_lossy();
    let aside = (1..)
        .map(|n| parent.join(format!("{name}.earlier-{n}")))
        .find(|p| !p.exists())
        .expect("some N is free");
    std::fs::create_dir(&aside).map_err(io_err(&aside))?;
    for entry in entries {
        let to = aside.join(entry.file_name().expect("an entry has a name"));
        std::fs::rename(&entry, &to).map_err(io_err(&entry))?;
    }
    Ok(Some(aside))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder holding a run's metrics, even without its checkpoints (a run with
    /// `--no-checkpoints`), is refused to a new run; an empty one, or an empty metrics file,
    /// is not.
    #[test]
    fn a_folder_with_an_earlier_runs_metrics_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        let refuse = |run: &Path| prepare(run, EarlierRun::Refuse, &mut |_| {});
        refuse(run).unwrap();
        std::fs::write(run.join("metrics.jsonl"), "").unwrap();
        refuse(run).unwrap();
        std::fs::write(run.join("metrics.jsonl"), "{\"step\": 1}\n{\"step\": 2}\n").unwrap();
        let err = refuse(run).unwrap_err().to_string();
        assert!(
            err.contains("holds an earlier run (metrics.jsonl of 2 steps)")
                && err.contains("--resume")
                && err.contains("--overwrite"),
            "{err}"
        );
    }

    /// Moving aside renames every entry but the lock into `NAME.earlier-1`, then
    /// `NAME.earlier-2`; the folder is left holding the lock alone, and an empty folder moves
    /// nothing.
    #[test]
    fn moving_aside_keeps_everything_in_a_new_sibling() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        std::fs::create_dir_all(run.join("checkpoints/step-3")).unwrap();
        std::fs::write(run.join("checkpoints/step-3/state.json"), "{}").unwrap();
        std::fs::write(run.join("metrics.jsonl"), "{\"step\": 3}\n").unwrap();
        std::fs::write(run.join(LOCK_FILE), "holder").unwrap();
        let mut said = Vec::new();
        prepare(&run, EarlierRun::MoveAside, &mut |s| {
            said.push(s.to_string())
        })
        .unwrap();
        let first = dir.path().join("run.earlier-1");
        assert!(first.join("checkpoints/step-3/state.json").is_file());
        assert!(first.join("metrics.jsonl").is_file() && !first.join(LOCK_FILE).exists());
        let left: Vec<_> = std::fs::read_dir(&run).unwrap().flatten().collect();
        assert_eq!(left.len(), 1, "the lock file alone stays");
        assert!(said[0].contains("checkpoints up to step 3") && said[0].contains("run.earlier-1"));
        // Nothing held now: nothing moved, nothing said.
        prepare(&run, EarlierRun::MoveAside, &mut |s| {
            said.push(s.to_string())
        })
        .unwrap();
        assert_eq!(said.len(), 1);
        // Named as `run/x/..`: the sibling is still `run.earlier-N`, beside the folder.
        std::fs::create_dir(run.join("x")).unwrap();
        std::fs::write(run.join("metrics.jsonl"), "{\"step\": 1}\n").unwrap();
        prepare(&run.join("x/.."), EarlierRun::MoveAside, &mut |_| {}).unwrap();
        assert!(dir.path().join("run.earlier-2/metrics.jsonl").is_file());
    }
}
