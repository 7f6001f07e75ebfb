//! One writer per output folder.
//!
//! A run folder (pre-training, fine-tuning) is written by one process at a time: two runs on
//! the same folder (a second terminal, a launcher retrying while the first still runs) would
//! delete each other's partial checkpoints. [`FolderLock::acquire`] takes an exclusive
//! `flock` on `<folder>/.bertkit.lock` and writes who holds it (pid, host, command, start
//! time) into the file; a second writer is refused with those facts. The kernel drops the
//! lock when the holder exits, however it exits, so a killed run never leaves a stale lock
//! behind: the file stays, the lock does not. On Linux, `flock` on NFS is taken as a POSIX
//! lock on the server, so writers on other hosts are refused too.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The lock file's name inside the folder.
pub const LOCK_FILE: &str = ".bertkit.lock";

/// An exclusive hold on a folder, released when dropped (or when the process ends).
#[derive(Debug)]
pub struct FolderLock {
    /// Holding the open file holds the lock.
    _file: File,
    dir: PathBuf,
}

/// Why a folder could not be locked.
#[derive(Debug)]
pub enum LockError {
    /// Another process holds the folder.
    Held {
        /// The folder.
        dir: PathBuf,
        /// Who holds it, as its lock file says (pid, host, command, since when).
        holder: String,
    },
    /// The folder or its lock file could not be made, opened or locked.
    Io {
        /// The lock file (or the folder, when it could not be made).
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
}

impl fmt::Display for LockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockError::Held { dir, holder } => write!(
                f,
                "{} is being written by another run ({holder}): wait for it to end or stop it, \
                 or write to another folder",
                dir.display()
            ),
            LockError::Io { path, source } => {
                write!(f, "{}: cannot lock the folder: {source}", path.display())
            }
        }
    }
}

impl std::error::Error for LockError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LockError::Held { .. } => None,
            LockError::Io { source, .. } => Some(source),
        }
    }
}

impl FolderLock {
    /// Makes `dir` if needed and locks it for this process, or says who holds it.
    pub fn acquire(dir: &Path) -> Result<Self, LockError> {
        let io_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| LockError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_err(&path))?;
        if let Err(e) = try_lock_exclusive(&file) {
            if e.kind() != io::ErrorKind::WouldBlock {
                return Err(LockError::Io { path, source: e });
            }
            let mut recorded = String::new();
            // The holder writes its line right after locking; an empty read means it is
            // between the two.
            let _ = file.read_to_string(&mut recorded);
            return Err(LockError::Held {
                dir: dir.to_path_buf(),
                holder: describe_holder(recorded.trim(), now_unix()),
            });
        }
        let line = format!(
            "pid {} host {} started {} command {}\n",
            std::process::id(),
            hostname(),
            now_unix(),
            command_line()
        );
        (|| {
            file.set_len(0)?;
            file.rewind()?;
            file.write_all(line.as_bytes())
        })()
        .map_err(io_err(&path))?;
        Ok(FolderLock {
            _file: file,
            dir: dir.to_path_buf(),
        })
    }

    /// The locked folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// `pid 12 host h started 1700000000 command bertkit …` as a person reads it, `now` being the
/// current Unix time.
fn describe_holder(recorded: &str, now: u64) -> String {
    let mut words = recorded.splitn(8, ' ');
    let mut field = |name: &str| {
        (words.next() == Some(name))
            .then(|| words.next())
            .flatten()
            .map(str::to_string)
    };
    let (pid, host, started) = (field("pid"), field("host"), field("started"));
    let command = (words.next() == Some("command"))
        .then(|| words.next())
        .flatten();
    let (Some(pid), Some(host), Some(started)) = (pid, host, started) else {
        return "its lock file says nothing yet about who it is".to_string();
    };
    let mut text = format!("pid {pid} on host {host}");
    if let Ok(started) = started.parse::<u64>() {
        text.push_str(&format!(", started {} s ago", now.saturating_sub(started)));
    }
    if let Some(command) = command {
        text.push_str(&format!(": `{command}`"));
    }
    text
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The process's arguments, on one line (at most 300 characters).
fn command_line() -> String {
    let line = std::env::args().collect::<Vec<_>>().join(" ");
    let line = line.replace(['\n', '\r'], " ");
    match line.char_indices().nth(300) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line,
    }
}

#[cfg(unix)]
fn try_lock_exclusive(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor this File owns; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(not(unix))]
fn try_lock_exclusive(_file: &File) -> io::Result<()> {
    // No advisory lock elsewhere: the folder is not guarded.
    Ok(())
}

#[cfg(unix)]
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".to_string();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..end]).replace(' ', "_");
    if name.is_empty() {
        "unknown".to_string()
    } else {
        name
    }
}

#[cfg(not(unix))]
fn hostname() -> String {
    std::env::var("COMPUTERNAME").unwrap_or_else(|_| "unknown".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_writer_is_refused_with_the_first_ones_pid_and_host_until_it_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let first = FolderLock::acquire(&run).unwrap();
        assert_eq!(first.dir(), run);
        let recorded = std::fs::read_to_string(run.join(LOCK_FILE)).unwrap();
        assert!(
            recorded.starts_with(&format!("pid {} host {} ", std::process::id(), hostname())),
            "{recorded}"
        );
        // flock locks belong to the open file: a second open in this process is a second
        // writer, as another process would be.
        let err = FolderLock::acquire(&run).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, LockError::Held { .. }), "{text}");
        assert!(
            text.contains(&format!(
                "pid {} on host {}",
                std::process::id(),
                hostname()
            )) && text.contains("is being written by another run"),
            "{text}"
        );
        drop(first);
        let again = FolderLock::acquire(&run).unwrap();
        drop(again);
    }

    #[test]
    fn a_lock_left_by_a_process_that_ended_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        // The file of a holder that is gone: the file stays, its lock does not.
        std::fs::write(
            dir.path().join(LOCK_FILE),
            "pid 1 host elsewhere started 1 command bertkit pretrain\n",
        )
        .unwrap();
        let lock = FolderLock::acquire(dir.path()).unwrap();
        let recorded = std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap();
        assert!(recorded.starts_with(&format!("pid {} ", std::process::id())));
        assert_eq!(recorded.lines().count(), 1, "{recorded}");
        drop(lock);
    }

    #[test]
    fn the_holder_is_described_from_its_lock_file() {
        assert_eq!(
            describe_holder(
                "pid 42 host gpu-7 started 1000 command bertkit pretrain --config a b.toml",
                1030
            ),
            "pid 42 on host gpu-7, started 30 s ago: `bertkit pretrain --config a b.toml`"
        );
        assert_eq!(
            describe_holder("", 5),
            "its lock file says nothing yet about who it is"
        );
        assert_eq!(
            describe_holder("garbage", 5),
            "its lock file says nothing yet about who it is"
        );
    }

    #[test]
    fn a_folder_that_cannot_be_made_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, "x").unwrap();
        let err = FolderLock::acquire(&file.join("run")).unwrap_err();
        assert!(matches!(err, LockError::Io { .. }));
        assert!(err.to_string().contains("a-file/run"), "{err}");
    }
}
