//! # bertkit-test-support: what the tests share
//!
//! A dev-dependency of every crate's tests, never of a shipped crate:
//! - the shared data folder ([`require`], [`shared_data_dir`], [`repo_root`]);
//! - digests of outputs ([`sha256_hex`], [`sha256_file`]);
//! - deterministic parameter values shared with the PyTorch scripts that make reference
//!   fixtures ([`reference_value`], mirrored by `python/reference_weights.py`).
//!
//! ## The shared data folder
//!
//! Tests and benchmarks read real data (a Wikipedia dump chunk, Gutenberg books,
//! SQuAD, GLUE, a pre-trained BERT and reference outputs) from one folder that lives beside the
//! repository and is never committed into it. This crate is the single place that decides where
//! that folder is:
//!
//! 1. the environment variable `BERTKIT_SHARED_DATA`, when set and non-empty;
//! 2. otherwise `../shared/data`, relative to the repository root.
//!
//! A missing folder or file is reported with the path that was tried and how to fix it, never
//! with a bare "No such file or directory".

#![deny(missing_docs)]

use std::fmt;
use std::path::{Path, PathBuf};

/// Name of the environment variable that overrides the shared data folder.
pub const ENV_VAR: &str = "BERTKIT_SHARED_DATA";

/// The shared data folder could not be found, or a file in it is missing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingSharedData {
    /// The path that was tried.
    pub path: PathBuf,
    /// Where the path came from (the environment variable or the default).
    pub origin: &'static str,
    /// The file inside the folder that was asked for, if any.
    pub file: Option<PathBuf>,
}

impl fmt::Display for MissingSharedData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.file {
            None => write!(
                f,
                "bertkit's shared data folder was not found at {} ({}). \
                 Put the data beside the repository as ../shared/data, or set {ENV_VAR} to its path.",
                self.path.display(),
                self.origin
            ),
            Some(file) => write!(
                f,
                "{} is missing from bertkit's shared data folder {} ({}). \
                 See PROVENANCE.md in that folder for what it should hold.",
                file.display(),
                self.path.display(),
                self.origin
            ),
        }
    }
}

impl std::error::Error for MissingSharedData {}

/// The repository root: the folder holding the workspace `Cargo.toml`.
///
/// Found from this crate's own source location at build time, so it does not depend on the
/// current directory a test or binary runs in.
pub fn repo_root() -> PathBuf {
    // crates/test-support -> crates -> repo root
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Resolves the shared data folder, checking that it exists.
pub fn shared_data_dir() -> Result<PathBuf, MissingSharedData> {
    let (path, origin) = match std::env::var_os(ENV_VAR) {
        Some(v) if !v.is_empty() => (PathBuf::from(v), "from $BERTKIT_SHARED_DATA"),
        _ => (
            repo_root().join("..").join("shared").join("data"),
            "default ../shared/data beside the repository",
        ),
    };
    if path.is_dir() {
        Ok(path)
    } else {
        Err(MissingSharedData {
            path,
            origin,
            file: None,
        })
    }
}

/// Resolves a file or folder inside the shared data folder, checking that it exists.
pub fn shared_data_path(relative: impl AsRef<Path>) -> Result<PathBuf, MissingSharedData> {
    let dir = shared_data_dir()?;
    let path = dir.join(relative.as_ref());
    if path.exists() {
        Ok(path)
    } else {
        let origin = if std::env::var_os(ENV_VAR).is_some_and(|v| !v.is_empty()) {
            "from $BERTKIT_SHARED_DATA"
        } else {
            "default ../shared/data beside the repository"
        };
        Err(MissingSharedData {
            path: dir,
            origin,
            file: Some(relative.as_ref().to_path_buf()),
        })
    }
}

/// For tests: the path of a shared data file, or a panic whose message says how to fix it.
#[track_caller]
pub fn require(relative: impl AsRef<Path>) -> PathBuf {
    match shared_data_path(relative) {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    }
}

/// SHA-256 of `bytes`, in lower-case hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    bertkit_stage_io::hex(&sha2::Sha256::digest(bytes))
}

/// SHA-256 of a file's contents, in lower-case hex; panics naming the file if it cannot be
/// read.
#[track_caller]
pub fn sha256_file(path: impl AsRef<Path>) -> String {
    let path = path.as_ref();
    bertkit_stage_io::sha256_of_file(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The parameter value tests and the PyTorch fixture scripts (`python/reference_weights.py`,
/// which this mirrors) both put at flat `index` of the parameter `name` (bertkit's name):
/// a 32-bit mix of `index` and a hash of `name` gives 16 bits `x`, `u = x / 65536 − ½`, then
/// `1 + 0.2u` for LayerNorm weights and `0.1u` for everything else. Exact in binary up to one
/// rounding, so both sides agree bit for bit.
pub fn reference_value(name: &str, index: usize) -> f64 {
    let hash = name
        .bytes()
        .fold(0u64, |h, b| (h * 31 + u64::from(b)) % 65521);
    let mask = (1u64 << 32) - 1;
    let mut x = (index as u64)
        .wrapping_mul(2654435761)
        .wrapping_add(hash * 40503)
        & mask;
    x ^= x >> 15;
    x = x.wrapping_mul(2246822519) & mask;
    x ^= x >> 13;
    let u = (x >> 16) as f64 / 65536.0 - 0.5;
    if name.ends_with("LayerNorm.weight") {
        1.0 + 0.2 * u
    } else {
        0.1 * u
    }
}

/// [`reference_value`] at every index of a parameter of `numel` elements, in row-major order.
pub fn reference_values(name: &str, numel: usize) -> Vec<f64> {
    (0..numel).map(|i| reference_value(name, i)).collect()
}

fn files_under(dir: &Path, base: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, base, out);
        } else {
            out.push(
                path.strip_prefix(base)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
}

/// Checks that every folder under `root` (a crate's `tests/fixtures`) lists each of its files
/// but the README with its SHA-256 (`sha256sum` lines) in its README's `## SHA-256` section,
/// and nothing more, so that a changed fixture shows in review as a changed line. Returns the
/// folders checked; panics naming the folder otherwise.
pub fn check_fixture_digests(root: &Path) -> usize {
    let mut folders = 0;
    for entry in std::fs::read_dir(root).unwrap() {
        let folder = entry.unwrap().path();
        if !folder.is_dir() {
            continue;
        }
        let readme = std::fs::read_to_string(folder.join("README.md"))
            .unwrap_or_else(|e| panic!("{}/README.md: {e}", folder.display()));
        let section = readme
            .split("## SHA-256")
            .nth(1)
            .unwrap_or_else(|| panic!("{}: no SHA-256 section", folder.display()));
        let mut listed: Vec<(String, String)> = section
            .lines()
            .filter_map(|l| l.split_once("  "))
            .filter(|(sha, _)| sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()))
            .map(|(sha, file)| (file.to_string(), sha.to_string()))
            .collect();
        listed.sort();
        let mut files = Vec::new();
        files_under(&folder, &folder, &mut files);
        files.retain(|f| f != "README.md" && !f.contains("__pycache__"));
        files.sort();
        let actual: Vec<(String, String)> = files
            .iter()
            .map(|f| (f.clone(), sha256_file(folder.join(f))))
            .collect();
        assert_eq!(listed, actual, "{}", folder.display());
        folders += 1;
    }
    folders
}

/// The scalars TensorBoard's own event reader (the `tensorboard` Python package's
/// `EventAccumulator`) finds in the event files of folder `dir`, by tag: (step, value). The
/// Python is `BERTKIT_PYTHON` (`make test` installs tensorboard and sets it) or `python3`.
pub fn tensorboard_scalars(dir: &Path) -> std::collections::HashMap<String, Vec<(u64, f64)>> {
    const READ: &str = "import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1])
acc.Reload()
print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()['scalars']}))
";
    let python = std::env::var("BERTKIT_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(&python)
        .args(["-c", READ])
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("{python}: {e}"));
    assert!(
        out.status.success(),
        "{python} with the tensorboard package (make test installs it and sets \
         BERTKIT_PYTHON):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the reader prints JSON")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_file_error_names_file_and_folder() {
        let err = MissingSharedData {
            path: PathBuf::from("/nowhere/data"),
            origin: "from $BERTKIT_SHARED_DATA",
            file: Some(PathBuf::from("wikipedia/x.bz2")),
        };
        let msg = err.to_string();
        assert!(msg.contains("wikipedia/x.bz2"), "{msg}");
        assert!(msg.contains("/nowhere/data"), "{msg}");
        let err = MissingSharedData { file: None, ..err };
        assert!(err.to_string().contains(ENV_VAR));
    }

    #[test]
    fn digests_are_sha256() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn repo_root_holds_the_workspace_manifest() {
        assert!(repo_root().join("Cargo.toml").is_file());
        assert!(repo_root().join("crates").is_dir());
    }
}
