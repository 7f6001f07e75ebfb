//! # bertkit-test-support: what the tests share
//!
//! A dev-dependency of every crate's tests, never of a shipped crate:
//! - the shared data folder ([`require`], [`shared_data_dir`], [`repo_root`]);
//! - digests of outputs ([`sha256_hex`], [`sha256_file`]).
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
    match std::fs::read(path) {
        Ok(bytes) => sha256_hex(&bytes),
        Err(e) => panic!("{}: {e}", path.display()),
    }
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
