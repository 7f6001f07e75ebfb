//! # bertkit-stage-io: what every data stage shares
//!
//! bertkit's stages hand off through files and manifests. Each manifest fingerprints its inputs
//! (absolute path, size, modification time, SHA-256) so that a re-run with unchanged inputs can
//! be skipped, and every file a stage writes appears atomically (written under a temporary
//! name, then renamed). This crate holds those few shared pieces:
//! - [`InputFile`]: an input's fingerprint, and whether a file is still the one fingerprinted;
//! - [`HashingReader`]: a reader that hashes (SHA-256) and counts what passes through it;
//! - [`write_atomically`]: write a file whole or not at all;
//! - [`stage`]: the one way a stage runs: progress [`stage::Event`]s to a [`stage::Reporter`],
//!   and an [`stage::Outcome`] (ran, or up to date) with the stage's summary;
//! - [`crc32c`]: CRC-32C and TensorFlow's masked form (checkpoints, event files);
//! - [`cost`]: what a step cost the process (wall and CPU seconds, its own peak memory);
//! - [`prefetch`]: a memory hint for scattered reads (hash tables, shuffled rows);
//! - [`text`]: reading formatted text (one sentence per line, blank lines between documents,
//!   plain or zstd), as the shard and records stages take it;
//! - [`expand_inputs`]: files as given, folders as their matching files in sorted order;
//! - [`hex`]: lower-case hex of a digest;
//! - [`read_text`]: a small text file (a config, a vocabulary, a JSON or TSV data file) whose
//!   bytes that are not UTF-8 are an error naming their line and byte offset;
//! - [`lock`]: one writer per output folder (a second run on a run folder is refused, naming
//!   the first's pid and host);
//! - [`Ranks`]: this process's share of the work in a multi-process run (`RANK`/`WORLD_SIZE`,
//!   Slurm and Open MPI variables).

#![deny(missing_docs)]

pub mod cost;
pub mod crc32c;
pub mod lock;
pub mod prefetch;
mod ranks;
pub mod stage;
pub mod text;
pub use ranks::{RANK_VARIABLES, Ranks};

use std::cell::Cell;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// An input file's fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputFile {
    /// Absolute path.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    pub modified_unix_ns: u128,
    /// SHA-256 of the file's bytes (filled in by the stage once it has read the file).
    pub sha256: String,
}

impl InputFile {
    /// Stats a regular file; the hash is left empty for the stage to fill in as it reads.
    pub fn stat(path: &Path) -> io::Result<Self> {
        let abs = fs::canonicalize(path)?;
        let meta = fs::metadata(&abs)?;
        if !meta.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file",
            ));
        }
        let modified_unix_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        Ok(InputFile {
            path: abs.to_string_lossy().into_owned(),
            bytes: meta.len(),
            modified_unix_ns,
            sha256: String::new(),
        })
    }

    /// Whether the file recorded as `self` (with its SHA-256, as a manifest keeps it) is
    /// unchanged in `current` (as [`InputFile::stat`] finds it now): the same path and size,
    /// and the same modification time or, when only the time moved (a file rewritten or
    /// touched with the same bytes, as an upstream step that ran again leaves it), the same
    /// SHA-256 of its bytes now. So a step runs again only when an input's contents changed;
    /// a file is read for this only when its size matches and its time does not.
    pub fn same_file_as(&self, current: &InputFile) -> bool {
        if self.path != current.path || self.bytes != current.bytes {
            return false;
        }
        if self.modified_unix_ns == current.modified_unix_ns {
            return true;
        }
        !self.sha256.is_empty()
            && sha256_of_file(Path::new(&current.path)).is_ok_and(|h| h == self.sha256)
    }
}

/// The hex SHA-256 of a file's bytes, read in chunks.
pub fn sha256_of_file(path: &Path) -> io::Result<String> {
    let reader = HashingReader::new(io::BufReader::with_capacity(1 << 20, fs::File::open(path)?));
    reader.finish()
}

/// Whether the `recorded` input list is the same files, unchanged, in the same order, as
/// `current` (see [`InputFile::same_file_as`]).
pub fn same_inputs(recorded: &[InputFile], current: &[InputFile]) -> bool {
    recorded.len() == current.len() && recorded.iter().zip(current).all(|(r, c)| r.same_file_as(c))
}

/// A reader that hashes (SHA-256) and counts the bytes that pass through it. The count is
/// shared, so it can be read while the reader is owned by a decoder.
pub struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
    count: Rc<Cell<u64>>,
}

impl<R: Read> HashingReader<R> {
    /// Wraps a reader.
    pub fn new(inner: R) -> Self {
        HashingReader {
            inner,
            hasher: Sha256::new(),
            count: Rc::new(Cell::new(0)),
        }
    }

    /// A handle on the number of bytes read so far.
    pub fn counter(&self) -> Rc<Cell<u64>> {
        self.count.clone()
    }

    /// Reads what is left (so the hash covers the whole input) and returns the hex SHA-256.
    pub fn finish(mut self) -> io::Result<String> {
        io::copy(&mut self, &mut io::sink())?;
        Ok(hex(&self.hasher.finalize()))
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.count.set(self.count.get() + n as u64);
        Ok(n)
    }
}

/// Expands input paths: a file is kept as given; a folder becomes its files (not hidden, not
/// recursive) whose names `accept`s, sorted by name. On error, returns the path that failed.
pub fn expand_inputs(
    inputs: &[PathBuf],
    accept: impl Fn(&str) -> bool,
) -> Result<Vec<PathBuf>, (PathBuf, io::Error)> {
    let mut files = Vec::new();
    for input in inputs {
        if !input.is_dir() {
            files.push(input.clone());
            continue;
        }
        let mut found = Vec::new();
        for entry in fs::read_dir(input).map_err(|e| (input.clone(), e))? {
            let path = entry.map_err(|e| (input.clone(), e))?.path();
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if path.is_file() && !name.starts_with('.') && accept(&name) {
                found.push(path);
            }
        }
        found.sort();
        files.extend(found);
    }
    Ok(files)
}

/// Reads a whole text file. Bytes that are not UTF-8, or a NUL byte ([`text::nul_message`]),
/// are an `InvalidData` error saying where:
/// the line (1-based) and the byte offset of the first invalid byte, which
/// `std::fs::read_to_string` does not say. The error's text does not repeat the path; callers
/// name the file, as they do for every I/O error.
pub fn read_text(path: &Path) -> io::Result<String> {
    let bytes = fs::read(path)?;
    if let Some((line, offset)) = text::find_nul(&bytes) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            text::nul_message(line, offset, ""),
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        let offset = e.utf8_error().valid_up_to();
        let bytes = e.as_bytes();
        let line = 1 + bytes[..offset].iter().filter(|&&b| b == b'\n').count();
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("line {line} (byte offset {offset}) is not valid UTF-8"),
        )
    })
}

/// Lower-case hex of a digest.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// The hidden temporary name a file is written under before it is renamed into place:
/// `dir/.name.partial`.
pub fn partial_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.partial"))
}

/// Writes `contents` to `path` whole or not at all: to the partial path, synced, then renamed.
pub fn write_atomically(path: &Path, contents: &[u8]) -> io::Result<()> {
    let tmp = partial_path(path);
    let mut f = fs::File::create(&tmp)?;
    f.write_all(contents)?;
    f.sync_all()?;
    fs::rename(&tmp, path)
}

/// Gives `path` the permissions a file created now gets (`0o666` less the umask), for files a
/// library creates as private temporaries and renames into place (the safetensors crate's
/// writer makes them `0600` whatever the umask). The mode is read off a probe file created
/// beside `path`, so no process-wide umask is touched. Elsewhere than Unix, nothing.
pub fn give_created_mode(path: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let probe = path.with_file_name(format!(
            ".{}.mode-probe",
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        ));
        let mode = {
            let file = fs::File::create(&probe)?;
            let mode = file.metadata()?.permissions().mode() & 0o777;
            drop(file);
            fs::remove_file(&probe)?;
            mode
        };
        fs::set_permissions(path, fs::Permissions::from_mode(mode))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file made private by its writer gets the mode `File::create` gives, and no probe is
    /// left beside it.
    #[cfg(unix)]
    #[test]
    fn a_private_file_gets_the_created_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let made = dir.path().join("made");
        let private = dir.path().join("private");
        fs::File::create(&made).unwrap();
        fs::write(&private, b"x").unwrap();
        fs::set_permissions(&private, fs::Permissions::from_mode(0o600)).unwrap();
        give_created_mode(&private).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&private), mode(&made));
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn read_text_says_where_the_bytes_are_not_utf8() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.toml");
        fs::write(&path, b"a = 1\nb = \"caf\xe9\"\n").unwrap();
        let err = read_text(&path).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert_eq!(
            err.to_string(),
            "line 2 (byte offset 14) is not valid UTF-8"
        );
        fs::write(&path, "a = \"café\"\n").unwrap();
        assert_eq!(read_text(&path).unwrap(), "a = \"café\"\n");
    }

    #[test]
    fn hashing_reader_hashes_the_whole_input() {
        let mut r = HashingReader::new(&b"hello world"[..]);
        let counter = r.counter();
        let mut first = [0u8; 5];
        r.read_exact(&mut first).unwrap();
        assert_eq!(counter.get(), 5);
        // sha256("hello world")
        assert_eq!(
            r.finish().unwrap(),
            "b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9"
        );
    }

    #[test]
    fn folders_expand_to_sorted_matching_files() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["b.txt", "a.txt", ".hidden.txt", "c.json"] {
            fs::write(dir.path().join(name), "x").unwrap();
        }
        let single = dir.path().join("c.json");
        let files = expand_inputs(&[dir.path().to_path_buf(), single.clone()], |n| {
            n.ends_with(".txt")
        })
        .unwrap();
        assert_eq!(
            files,
            vec![dir.path().join("a.txt"), dir.path().join("b.txt"), single]
        );
    }

    #[test]
    fn atomic_write_and_fingerprint() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.json");
        write_atomically(&path, b"{}").unwrap();
        assert!(!partial_path(&path).exists());
        let a = InputFile::stat(&path).unwrap();
        assert_eq!(a.bytes, 2);
        let again = InputFile::stat(&path).unwrap();
        assert!(same_inputs(
            std::slice::from_ref(&a),
            std::slice::from_ref(&again)
        ));
        write_atomically(&path, b"{ }").unwrap();
        let b = InputFile::stat(&path).unwrap();
        assert!(!a.same_file_as(&b));
        // The same bytes written again (a new modification time): unchanged when the recorded
        // input has its SHA-256, changed without it (nothing to compare the bytes with).
        let recorded = InputFile {
            sha256: sha256_of_file(&path).unwrap(),
            ..b.clone()
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        write_atomically(&path, b"{ }").unwrap();
        let rewritten = InputFile::stat(&path).unwrap();
        assert_ne!(rewritten.modified_unix_ns, b.modified_unix_ns);
        assert!(recorded.same_file_as(&rewritten));
        assert!(!b.same_file_as(&rewritten));
        // Other bytes of the same size: changed.
        write_atomically(&path, b"[ ]").unwrap();
        assert!(!recorded.same_file_as(&InputFile::stat(&path).unwrap()));
        assert!(InputFile::stat(dir.path()).is_err());
    }
}
