//! A run's checkpoints, for pre-training and fine-tuning alike: `checkpoints/step-N/` in the
//! run folder, holding
//!
//! - `model.safetensors`: the optimiser's f32 master weights under transformers' names, so the
//!   folder (with `config.json`) loads as a model in the model crate and in transformers;
//! - `config.json`: the model's configuration;
//! - `vocab.txt` and `tokenizer_config.json`: the tokenizer the model was trained with (for
//!   pre-training, the records' vocabulary and casing), so that every checkpoint is a complete
//!   model folder that fine-tuning, prediction and conversion take as it is;
//! - `optimizer.safetensors`: the moments (`m.<name>`, `v.<name>`);
//! - `state.json`: what the loop needs besides tensors to go on exactly (its step, data
//!   position, loss scaler, settings), a type of the loop's own;
//! - `checksums.json`: every other file's SHA-256, read back from the disk once written
//!   ([`verify`]): a resume takes the newest checkpoint that verifies ([`newest_verified`]), and
//!   `bertkit check checkpoint RUN` checks them all.
//!
//! A checkpoint is written into a hidden `.step-N.partial/` folder and renamed into place, and
//! `state.json` is written last: a folder named `step-N` with a `state.json` is whole. Old
//! checkpoints (all but the newest `keep`, and any of a later step than the one written: what
//! a resume from an earlier, verified checkpoint passed over) are renamed out of sight before
//! they are deleted. A kill at any moment leaves whole checkpoints and at most hidden
//! leftovers, which the next write removes.
//!
//! At its end a run also writes its final model at the top of the run folder ([`write_model`]:
//! the same four model files, no optimiser state), so the run folder itself is the model
//! folder a user hands on (to `bertkit finetune --model RUN`, to transformers'
//! `from_pretrained`). [`model_folder`] says which folder a path stands for.

use bertkit_stage_io::lock::FolderLock;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::Serialize;
use serde::de::DeserializeOwned;

use bertkit_tokenizer::folder::TokenizerFiles;

use crate::optim::Optimizer;
use crate::{TrainError, io_err};

/// The files that make a folder a model folder (besides the tokenizer's), in the order
/// [`write_model`] writes them: the weights last, so a folder with them is whole.
const MODEL_FILES: [&str; 2] = ["config.json", "model.safetensors"];

/// The model folder `path` stands for: `path` itself where it holds `config.json` and
/// `model.safetensors` (a model folder, a checkpoint, or a run folder with its final model),
/// else the newest checkpoint of the run folder `path` (a run that has not ended yet).
pub fn model_folder(path: &Path) -> Option<PathBuf> {
    if MODEL_FILES.iter().all(|f| path.join(f).is_file()) {
        return Some(path.to_path_buf());
    }
    newest(path).map(|(_, dir)| dir)
}

/// The checkpoints of a run folder, oldest first: (step, folder). Each was whole when it
/// appeared (written under a hidden name, then renamed); whether it still is, [`verify`] says.
pub fn list(run: &Path) -> Vec<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(run.join("checkpoints"))
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let e = e.ok()?;
            let step = e
                .file_name()
                .to_str()?
                .strip_prefix("step-")?
                .parse::<u64>()
                .ok()?;
            e.file_type().ok()?.is_dir().then(|| (step, e.path()))
        })
        .collect();
    found.sort();
    found
}

/// The newest checkpoint of a run folder.
pub fn newest(run: &Path) -> Option<(u64, PathBuf)> {
    list(run).pop()
}

/// The optimiser's f32 master weights under transformers' names.
fn weights(optimizer: &Optimizer) -> Result<HashMap<String, Tensor>, TrainError> {
    Ok(optimizer
        .master_tensors()?
        .into_iter()
        .map(|(k, v)| (bertkit_model::params::hf_name(&k, true), v))
        .collect())
}

fn save_tensors(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<(), TrainError> {
    candle_core::safetensors::save(tensors, path)
        .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", path.display())))?;
    bertkit_stage_io::give_created_mode(path).map_err(io_err(path))
}

fn write_tokenizer(tokenizer: Option<&TokenizerFiles>, dir: &Path) -> Result<(), TrainError> {
    match tokenizer {
        Some(t) => t
            .write_into(dir)
            .map_err(|e| TrainError::Checkpoint(e.to_string())),
        None => Ok(()),
    }
}

/// Writes `run/checkpoints/step-<step>/` atomically from the optimiser's master weights and
/// moments, the model's `config_json`, the `tokenizer` it is trained with (where known) and
/// the loop's `state`, then deletes all but the newest `keep` checkpoints. Returns its folder.
pub fn save(
    run: &Path,
    step: u64,
    optimizer: &Optimizer,
    config_json: &str,
    tokenizer: Option<&TokenizerFiles>,
    state: &impl Serialize,
    keep: usize,
) -> Result<PathBuf, TrainError> {
    let root = run.join("checkpoints");
    let name = format!("step-{step}");
    let dir = root.join(&name);
    let partial = root.join(format!(".{name}.partial"));
    remove_leftovers(&root)?;
    std::fs::create_dir_all(&partial).map_err(io_err(&partial))?;
    save_tensors(&weights(optimizer)?, &partial.join("model.safetensors"))?;
    save_tensors(
        &optimizer.moment_tensors()?,
        &partial.join("optimizer.safetensors"),
    )?;
    let write = |file: &str, text: &str| {
        let path = partial.join(file);
        std::fs::write(&path, text).map_err(io_err(&path))
    };
    write("config.json", config_json)?;
    write_tokenizer(tokenizer, &partial)?;
    write(
        "state.json",
        &serde_json::to_string_pretty(state).expect("a checkpoint's state serialises"),
    )?;
    write(
        CHECKSUMS,
        &serde_json::to_string_pretty(&checksums(&partial)?).expect("digests serialise"),
    )?;
    if dir.exists() {
        discard(&dir)?;
    }
    std::fs::rename(&partial, &dir).map_err(io_err(&dir))?;
    // Checkpoints of later steps are of the timeline this run left (a resume from an earlier,
    // verified checkpoint passed over them: damaged); then the oldest beyond `keep`.
    let (later, all): (Vec<_>, Vec<_>) = list(run).into_iter().partition(|(s, _)| *s > step);
    for (_, stale) in later {
        discard(&stale)?;
    }
    let excess = all.len().saturating_sub(keep.max(1));
    for (_, old) in all.into_iter().take(excess) {
        discard(&old)?;
    }
    Ok(dir)
}

/// The file of a checkpoint that holds every other file's SHA-256.
const CHECKSUMS: &str = "checksums.json";

/// Every file of the checkpoint folder `dir` but [`CHECKSUMS`], by name, with its SHA-256
/// (read back from the disk).
fn checksums(dir: &Path) -> Result<BTreeMap<String, String>, TrainError> {
    let mut sums = BTreeMap::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let path = entry.map_err(io_err(dir))?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if path.is_file() && name != CHECKSUMS {
            let digest = bertkit_stage_io::sha256_of_file(&path).map_err(io_err(&path))?;
            sums.insert(name, digest);
        }
    }
    Ok(sums)
}

/// What [`verify`] found of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verified {
    /// Every file its `checksums.json` names has the digest recorded (that many files).
    Whole(usize),
    /// It has no `checksums.json` (written before checkpoints recorded digests): nothing to
    /// check against.
    Unrecorded,
}

/// Checks the checkpoint folder `dir` against its `checksums.json`: an error naming the first
/// file that is missing or whose SHA-256 differs from the one recorded (a damaged
/// checkpoint), or an unreadable record.
pub fn verify(dir: &Path) -> Result<Verified, TrainError> {
    let verified = verify_files(dir, &|_| true)?;
    // Nothing recorded to check against: the file every checkpoint has must still be there.
    let state = dir.join("state.json");
    if verified == Verified::Unrecorded && !state.is_file() {
        return Err(TrainError::Checkpoint(format!(
            "{}: missing: not a whole checkpoint",
            state.display()
        )));
    }
    Ok(verified)
}

/// [`verify`] of the files a model is loaded from alone (not the optimiser's state nor the
/// loop's): what `--model` of a checkpoint reads. A model folder that records no digests (not
/// a checkpoint) passes as [`Verified::Unrecorded`].
pub fn verify_model(dir: &Path) -> Result<Verified, TrainError> {
    verify_files(dir, &|name| {
        name != "optimizer.safetensors" && name != "state.json"
    })
}

/// [`verify`] of the recorded files whose names pass `wanted`.
fn verify_files(dir: &Path, wanted: &dyn Fn(&str) -> bool) -> Result<Verified, TrainError> {
    let record_path = dir.join(CHECKSUMS);
    let text = match std::fs::read_to_string(&record_path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Verified::Unrecorded),
        Err(e) => return Err(io_err(&record_path)(e)),
    };
    let recorded: BTreeMap<String, String> = serde_json::from_str(&text)
        .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", record_path.display())))?;
    // The record names files of this folder alone: a name that reaches elsewhere (`..`, `/`,
    // an absolute path such as /dev/zero, which would be read forever) is damage too.
    if let Some(name) = recorded
        .keys()
        .find(|n| n.is_empty() || n.contains(['/', '\\', '\0']) || *n == "." || *n == "..")
    {
        return Err(TrainError::Checkpoint(format!(
            "{}: names {name:?}, not a file of the checkpoint folder: damaged",
            record_path.display()
        )));
    }
    for (name, want) in recorded.iter().filter(|(name, _)| wanted(name)) {
        let path = dir.join(name);
        let got = bertkit_stage_io::sha256_of_file(&path).map_err(|e| {
            TrainError::Checkpoint(format!(
                "{}: {e} (the checkpoint records it)",
                path.display()
            ))
        })?;
        if &got != want {
            return Err(TrainError::Checkpoint(format!(
                "{}: its SHA-256 differs from the one the checkpoint recorded: damaged",
                path.display()
            )));
        }
    }
    Ok(Verified::Whole(recorded.len()))
}

/// The newest checkpoint of the run folder `run` that [`verify`] passes (or that records no
/// digests), and what was wrong with each newer one, passed over (a resume goes on from the
/// newest good state; the next checkpoint it writes removes the damaged ones).
pub fn newest_verified(run: &Path) -> (Option<(u64, PathBuf)>, Vec<String>) {
    let mut passed_over = Vec::new();
    for (step, dir) in list(run).into_iter().rev() {
        match verify(&dir) {
            Ok(_) => return (Some((step, dir)), passed_over),
            Err(e) => passed_over.push(e.to_string()),
        }
    }
    (None, passed_over)
}

/// The checkpoint a resume of the run folder `run` goes on from: the newest that verifies
/// ([`newest_verified`]), each newer one passed over said through `warn`; `None` where the
/// run has none; an error where it has some and none verifies (a run from scratch would
/// write over them), or, with `stop_if_damaged`, where the newest does not verify.
pub fn resume_point(
    run: &Path,
    stop_if_damaged: bool,
    warn: &mut dyn FnMut(&str),
) -> Result<Option<(u64, PathBuf)>, TrainError> {
    let (found, passed_over) = newest_verified(run);
    if found.is_none() && !passed_over.is_empty() {
        return Err(TrainError::Checkpoint(format!(
            "no checkpoint of {} verifies: {}",
            run.display(),
            passed_over.join("; ")
        )));
    }
    let from = found
        .as_ref()
        .map(|(step, _)| format!(" (step {step})"))
        .unwrap_or_default();
    if stop_if_damaged && !passed_over.is_empty() {
        return Err(TrainError::Checkpoint(format!(
            "{}; stopped (--stop-if-damaged): without it the run resumes from the newest \
             checkpoint that verifies{from}",
            passed_over.join("; ")
        )));
    }
    for damaged in &passed_over {
        warn(&format!(
            "{damaged}; resuming from the newest checkpoint that verifies{from}"
        ));
    }
    Ok(found)
}

/// Writes the run's final model at the top of the run folder `run`: `config.json`, the
/// optimiser's f32 master weights as `model.safetensors` and the `tokenizer`'s files, each file
/// atomically and the weights last (a folder is a model folder once they are there).
pub fn write_model(
    run: &Path,
    optimizer: &Optimizer,
    config_json: &str,
    tokenizer: Option<&TokenizerFiles>,
) -> Result<(), TrainError> {
    write_tokenizer(tokenizer, run)?;
    let config = run.join(MODEL_FILES[0]);
    bertkit_stage_io::write_atomically(&config, config_json.as_bytes()).map_err(io_err(&config))?;
    let weights_path = run.join(MODEL_FILES[1]);
    let partial = bertkit_stage_io::partial_path(&weights_path);
    save_tensors(&weights(optimizer)?, &partial)?;
    std::fs::rename(&partial, &weights_path).map_err(io_err(&weights_path))
}

/// Takes away the final model at the top of the run folder `run` (the weights first, so a
/// kill halfway leaves no folder that passes for a model): a run that goes on from its
/// newest checkpoint makes it stale, and that checkpoint holds the same weights.
pub fn remove_model(run: &Path) -> Result<(), TrainError> {
    for file in MODEL_FILES.iter().rev() {
        let path = run.join(file);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&path)(e)),
        }
    }
    Ok(())
}

/// Bytes of a checkpoint folder's files (0 for what cannot be read).
pub fn bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// Deletes a checkpoint folder: renamed out of sight first, so that a kill halfway through
/// the deletion leaves a hidden leftover (removed by the next [`save`]), never a `step-N`
/// folder with some files gone.
fn discard(dir: &Path) -> Result<(), TrainError> {
    let name = dir
        .file_name()
        .map_or_else(Default::default, |n| n.to_string_lossy());
    let hidden = dir.with_file_name(format!(".{name}.deleting"));
    std::fs::rename(dir, &hidden).map_err(io_err(dir))?;
    std::fs::remove_dir_all(&hidden).map_err(io_err(&hidden))
}

/// Takes the run folder `run` for this process ([`FolderLock`]: a second run on it is refused,
/// naming this one's pid and host) and removes what killed checkpoint writes and deletions
/// left in it. Only the holder may clean: another live run's `.step-N.partial` is its write in
/// progress. A run holds the folder from before it reads a checkpoint to its end.
pub fn hold(run: &Path) -> Result<FolderLock, TrainError> {
    let lock = FolderLock::acquire(run)?;
    remove_leftovers(&run.join("checkpoints"))?;
    Ok(lock)
}

/// Removes what killed writes and deletions left in `root`: hidden `.step-N.partial` and
/// `.step-N.deleting` folders.
fn remove_leftovers(root: &Path) -> Result<(), TrainError> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(".step-") && (name.ends_with(".partial") || name.ends_with(".deleting"))
        {
            let path = entry.path();
            std::fs::remove_dir_all(&path).map_err(io_err(&path))?;
        }
    }
    Ok(())
}

/// Reads the checkpoint folder `dir` written at `step`: sets the optimiser's moments and f32
/// master weights (and from them the model's parameters) and returns the loop's saved state.
pub fn restore<S: DeserializeOwned>(
    dir: &Path,
    step: u64,
    optimizer: &mut Optimizer,
    device: &Device,
) -> Result<S, TrainError> {
    let unreadable = |file: &str, e: &dyn std::fmt::Display| {
        TrainError::Checkpoint(format!("{}: {e}", dir.join(file).display()))
    };
    let state_path = dir.join("state.json");
    let text = bertkit_stage_io::read_text(&state_path).map_err(io_err(&state_path))?;
    let state: S = serde_json::from_str(&text).map_err(|e| unreadable("state.json", &e))?;
    let moments = candle_core::safetensors::load(dir.join("optimizer.safetensors"), device)
        .map_err(|e| unreadable("optimizer.safetensors", &e))?;
    let masters: HashMap<String, Tensor> =
        candle_core::safetensors::load(dir.join("model.safetensors"), device)
            .map_err(|e| unreadable("model.safetensors", &e))?
            .into_iter()
            .filter_map(|(k, v)| bertkit_model::params::canonical_name(&k).map(|k| (k, v)))
            .collect();
    optimizer
        .restore(&moments, &masters, step)
        .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", dir.display())))?;
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a kill mid-write or mid-deletion leaves is cleaned when a run takes the folder (a
    /// finished run resumed writes no checkpoint that would clean it), and never by a run the
    /// folder is refused to.
    #[test]
    fn holding_a_run_folder_cleans_leftovers_and_a_refused_run_touches_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let root = run.join("checkpoints");
        for name in ["step-1", ".step-2.deleting", ".step-3.partial"] {
            std::fs::create_dir_all(root.join(name)).unwrap();
            std::fs::write(root.join(name).join("model.safetensors"), b"x").unwrap();
        }
        let held = hold(&run).unwrap();
        let names = |root: &Path| {
            let mut v: Vec<String> = std::fs::read_dir(root)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        assert_eq!(names(&root), ["step-1"]);
        // The holder's write in progress: a second run must not clean it.
        std::fs::create_dir_all(root.join(".step-4.partial")).unwrap();
        let refused = hold(&run).unwrap_err();
        assert!(matches!(refused, TrainError::Lock(_)), "{refused}");
        assert_eq!(names(&root), [".step-4.partial", "step-1"]);
        drop(held);
    }

    /// A checkpoint records its files' digests and verifies; a flipped byte, a truncated or a
    /// removed file is named as damage; a resume goes on from the newest checkpoint that
    /// verifies, saying what it passed over, and its next checkpoint removes the damaged ones
    /// (the newest good one is never rotated away); with none verifying, a resume refuses.
    #[test]
    fn a_damaged_checkpoint_is_named_and_passed_over() {
        use candle_core::{DType, Var};
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let mut vars = std::collections::BTreeMap::new();
        let t = Tensor::new(&[0.5f32, -1.0, 2.0], &Device::Cpu).unwrap();
        vars.insert("encoder.weight".to_string(), Var::from_tensor(&t).unwrap());
        let optimizer = Optimizer::new(crate::optim::OptimizerConfig::lamb(), &vars).unwrap();
        assert_eq!(optimizer.master_dtype(), DType::F32);
        let save_at = |step: u64| {
            save(
                &run,
                step,
                &optimizer,
                "{}",
                None,
                &serde_json::json!({ "step": step }),
                1,
            )
            .unwrap()
        };
        let first = save_at(1);
        assert_eq!(verify(&first).unwrap(), Verified::Whole(4));
        let second = save_at(2);
        // `keep` 1: the first went once the second was whole.
        assert_eq!(list(&run), [(2, second.clone())]);
        let third = {
            // (keep 2 from here, to have a good one to fall back on)
            save(
                &run,
                3,
                &optimizer,
                "{}",
                None,
                &serde_json::json!({"step": 3}),
                2,
            )
            .unwrap()
        };
        // The optimiser's state damaged: the checkpoint fails, its model still loads; without
        // its record, a checkpoint lacking state.json is not whole.
        let moments = third.join("optimizer.safetensors");
        let kept = std::fs::read(&moments).unwrap();
        std::fs::write(&moments, &kept[..kept.len() / 2]).unwrap();
        assert!(verify(&third).is_err());
        assert_eq!(verify_model(&third).unwrap(), Verified::Whole(4));
        std::fs::write(&moments, &kept).unwrap();
        let record = std::fs::read(third.join(CHECKSUMS)).unwrap();
        let state = std::fs::read(third.join("state.json")).unwrap();
        std::fs::remove_file(third.join(CHECKSUMS)).unwrap();
        std::fs::remove_file(third.join("state.json")).unwrap();
        assert!(
            verify(&third)
                .unwrap_err()
                .to_string()
                .contains("state.json: missing: not a whole checkpoint")
        );
        assert_eq!(verify_model(&third).unwrap(), Verified::Unrecorded);
        assert_eq!(newest(&run), Some((3, third.clone())));
        std::fs::write(third.join(CHECKSUMS), record).unwrap();
        std::fs::write(third.join("state.json"), state).unwrap();
        let model = third.join("model.safetensors");
        let bytes = std::fs::read(&model).unwrap();
        for (damage, says) in [
            ("flip", "differs from the one the checkpoint recorded"),
            ("truncate", "differs from the one the checkpoint recorded"),
            ("remove", "the checkpoint records it"),
        ] {
            match damage {
                "flip" => {
                    let mut b = bytes.clone();
                    let at = b.len() - 3;
                    b[at] ^= 0x40;
                    std::fs::write(&model, b).unwrap();
                }
                "truncate" => std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap(),
                _ => std::fs::remove_file(&model).unwrap(),
            }
            let err = verify(&third).unwrap_err().to_string();
            assert!(
                err.contains("model.safetensors") && err.contains(says),
                "{damage}: {err}"
            );
            let mut warned = Vec::new();
            let found = resume_point(&run, false, &mut |w| warned.push(w.to_string())).unwrap();
            assert_eq!(found, Some((2, second.clone())), "{damage}");
            assert!(
                warned.len() == 1 && warned[0].contains("(step 2)"),
                "{warned:?}"
            );
            // Asked to stop instead: an error naming the damage and what a resume would do.
            let err = resume_point(&run, true, &mut |_| {})
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("model.safetensors")
                    && err.contains("stopped (--stop-if-damaged)")
                    && err.contains("verifies (step 2)"),
                "{err}"
            );
        }
        // The resumed run's next checkpoint (step 3 again, of the new timeline) replaces the
        // damaged one; one of a later step is removed as stale.
        std::fs::create_dir_all(run.join("checkpoints/step-9")).unwrap();
        std::fs::write(run.join("checkpoints/step-9/state.json"), "{}").unwrap();
        save(
            &run,
            3,
            &optimizer,
            "{}",
            None,
            &serde_json::json!({"step": 3}),
            2,
        )
        .unwrap();
        let steps: Vec<u64> = list(&run).into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, [2, 3]);
        assert!(matches!(verify(&third).unwrap(), Verified::Whole(_)));
        // Every checkpoint damaged: a resume refuses rather than start over them.
        for (_, dir) in list(&run) {
            std::fs::write(dir.join("config.json"), "{\"other\": 1}").unwrap();
        }
        let err = resume_point(&run, false, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no checkpoint of") && err.contains("verifies"),
            "{err}"
        );
    }
}
