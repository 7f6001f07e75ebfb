//! # bertkit-download: the download stage
//!
//! Fetches a file from an `http(s)://` URL, a `file://` URL or a plain path, so that it never
//! needs babysitting:
//! - **Resume**: bytes arrive in a hidden `.NAME.partial` file beside the destination. After a
//!   dropped connection, or a crash and a re-run, the download continues with an HTTP `Range`
//!   request from where the partial file ends. A server that ignores ranges (200 instead of 206)
//!   is answered by starting over.
//! - **Retries**: timeouts, connection errors, resets, 408, 429 and 5xx are retried up to
//!   `retries` times with exponential backoff and jitter. Other 4xx answers fail at once with a
//!   message naming the status and URL (no retry storm on a 403 or 404).
//! - **Verification**: a SHA-256, SHA-1 or MD5 checksum, as publishers give them, is checked on the
//!   complete file. A file that fails is deleted and never left in place.
//! - **Atomic**: the destination appears only when the whole verified file is renamed into place,
//!   so an existing destination is complete. Re-running is a no-op when it is there (and matches
//!   the checksum, if one is given).
//! - **Mirrors**: [`mirrored`] maps a source onto a local directory or another base URL that
//!   holds the same relative paths, so the whole pipeline can run offline from a mirror.
//!
//! Requests carry a `User-Agent` naming bertkit. Many files at once go through [`queue`]:
//! a few in flight, at most two per host, spaced out, so public servers are not hammered.

#![deny(missing_docs)]

pub mod queue;
pub mod sources;

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use bertkit_stage_io::stage::{Event, Progress, Reporter};
use sha2::Digest;

/// A checksum algorithm publishers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// SHA-256.
    Sha256,
    /// SHA-1 (Wikimedia's `*-sha1sums.txt`).
    Sha1,
    /// MD5 (Wikimedia's `*-md5sums.txt`).
    Md5,
}

/// An expected checksum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checksum {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Lower-case hex digest.
    pub hex: String,
}

impl Checksum {
    /// A checksum from an algorithm and a hex digest (any case).
    pub fn new(algorithm: Algorithm, hex: &str) -> Result<Self, DownloadError> {
        let len = match algorithm {
            Algorithm::Sha256 => 64,
            Algorithm::Sha1 => 40,
            Algorithm::Md5 => 32,
        };
        if hex.len() != len || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(DownloadError::Usage(format!(
                "{hex:?} is not a {len}-digit hex {algorithm:?} digest"
            )));
        }
        Ok(Checksum {
            algorithm,
            hex: hex.to_ascii_lowercase(),
        })
    }

    /// At most one of a SHA-256, SHA-1 or MD5 digest, as a checksum (`None` if none is given).
    pub fn from_one_of(
        sha256: Option<&str>,
        sha1: Option<&str>,
        md5: Option<&str>,
    ) -> Result<Option<Self>, DownloadError> {
        match (sha256, sha1, md5) {
            (Some(h), None, None) => Checksum::new(Algorithm::Sha256, h).map(Some),
            (None, Some(h), None) => Checksum::new(Algorithm::Sha1, h).map(Some),
            (None, None, Some(h)) => Checksum::new(Algorithm::Md5, h).map(Some),
            (None, None, None) => Ok(None),
            _ => Err(DownloadError::Usage(
                "give at most one of sha256, sha1 and md5".into(),
            )),
        }
    }

    /// The digest of a file, in this checksum's algorithm.
    pub fn digest_of(&self, path: &Path) -> io::Result<String> {
        let mut file = File::open(path)?;
        let mut buf = vec![0u8; 1 << 20];
        macro_rules! hash_with {
            ($hasher:expr) => {{
                let mut h = $hasher;
                loop {
                    let n = file.read(&mut buf)?;
                    if n == 0 {
                        break;
                    }
                    h.update(&buf[..n]);
                }
                bertkit_stage_io::hex(&h.finalize())
            }};
        }
        Ok(match self.algorithm {
            Algorithm::Sha256 => hash_with!(sha2::Sha256::new()),
            Algorithm::Sha1 => hash_with!(sha1::Sha1::new()),
            Algorithm::Md5 => hash_with!(md5::Md5::new()),
        })
    }
}

/// Why a download failed.
#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    /// The server answered with a status that retrying will not change.
    #[error("{url}: HTTP {status}{hint}")]
    Http {
        /// The URL.
        url: String,
        /// The status code.
        status: u16,
        /// What it usually means.
        hint: String,
    },
    /// Every attempt failed with a transient error.
    #[error("{url}: gave up after {attempts} attempt(s); last error: {last}")]
    RetriesExhausted {
        /// The URL.
        url: String,
        /// Attempts made.
        attempts: u32,
        /// The last error.
        last: String,
    },
    /// The complete file did not match its checksum (it was deleted).
    #[error(
        "{source_name}: {algorithm:?} checksum mismatch: expected {expected}, got {actual}; the file was deleted"
    )]
    ChecksumMismatch {
        /// Where it came from.
        source_name: String,
        /// The algorithm.
        algorithm: Algorithm,
        /// Expected digest.
        expected: String,
        /// Actual digest.
        actual: String,
    },
    /// Reading or writing a local file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// Bad arguments.
    #[error("{0}")]
    Usage(String),
    /// Some files of a set failed (the others are in place).
    #[error("set {set:?}: {failed} of {total} file(s) failed (re-run to fetch only those):\n  {}", errors.join("\n  "))]
    Incomplete {
        /// The set.
        set: String,
        /// How many failed.
        failed: usize,
        /// How many were tried.
        total: usize,
        /// One line per failed file.
        errors: Vec<String>,
    },
    /// A set failed and its registry entries say what the user can do about it (e.g. how to
    /// pick another dump date).
    #[error("{error}\n{}", hints.join("\n"))]
    Hinted {
        /// What failed.
        error: Box<DownloadError>,
        /// The hints of the set's entries, each once.
        hints: Vec<String>,
    },
}

fn io_err(path: &Path) -> impl Fn(io::Error) -> DownloadError + '_ {
    move |source| DownloadError::Io {
        path: path.into(),
        source,
    }
}

/// How hard to try.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    /// Retries after the first attempt, for transient failures.
    pub retries: u32,
    /// Base of the exponential backoff (doubled per retry, with up to 50% jitter).
    pub backoff: Duration,
    /// Longest wait between attempts.
    pub max_backoff: Duration,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Timeout for the response headers.
    pub response_timeout: Duration,
    /// `User-Agent` header.
    pub user_agent: String,
}

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            retries: 5,
            backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(30),
            response_timeout: Duration::from_secs(60),
            user_agent: format!("bertkit/{} (BERT data pipeline)", env!("CARGO_PKG_VERSION")),
        }
    }
}

/// How a file came to be at its destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetched {
    /// Downloaded over HTTP.
    Downloaded {
        /// File size.
        bytes: u64,
        /// Bytes already present from an earlier partial download.
        resumed_from: u64,
        /// Requests made (1 when nothing went wrong).
        attempts: u32,
    },
    /// Copied from a local path or `file://` URL.
    Copied {
        /// File size.
        bytes: u64,
    },
    /// The destination was already complete (and matched the checksum, if given).
    AlreadyPresent {
        /// File size.
        bytes: u64,
    },
}

impl Fetched {
    /// The file's size.
    pub fn bytes(&self) -> u64 {
        match self {
            Fetched::Downloaded { bytes, .. }
            | Fetched::Copied { bytes }
            | Fetched::AlreadyPresent { bytes } => *bytes,
        }
    }
}

/// `source` fetched from `mirror` instead: a mirror is a local directory or a base URL holding
/// the same relative paths. `relative` is the path under the mirror (for example
/// `wikipedia/enwiki-….bz2`).
pub fn mirrored(mirror: &str, relative: &str) -> String {
    let relative = relative.trim_start_matches('/');
    if mirror.contains("://") {
        format!("{}/{}", mirror.trim_end_matches('/'), relative)
    } else {
        Path::new(mirror)
            .join(relative)
            .to_string_lossy()
            .into_owned()
    }
}

/// Fetches `source` into `dest` (see the crate docs for the guarantees).
pub fn fetch(
    source: &str,
    dest: &Path,
    checksum: Option<&Checksum>,
    options: &FetchOptions,
    reporter: &dyn Reporter,
) -> Result<Fetched, DownloadError> {
    if dest.is_file() {
        let bytes = fs::metadata(dest).map_err(io_err(dest))?.len();
        match checksum {
            None => return Ok(Fetched::AlreadyPresent { bytes }),
            Some(c) if c.digest_of(dest).map_err(io_err(dest))? == c.hex => {
                return Ok(Fetched::AlreadyPresent { bytes });
            }
            // A file that does not match is fetched again (and replaced only if the new one does).
            Some(_) => {}
        }
    }
    if let Some(parent) = dest.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    let partial = bertkit_stage_io::partial_path(dest);
    let outcome = if source.starts_with("http://") || source.starts_with("https://") {
        http_fetch(source, &partial, options, reporter)?
    } else {
        let path = PathBuf::from(source.strip_prefix("file://").unwrap_or(source));
        let bytes = fs::copy(&path, &partial).map_err(io_err(&path))?;
        Fetched::Copied { bytes }
    };
    if let Some(c) = checksum {
        let actual = c.digest_of(&partial).map_err(io_err(&partial))?;
        if actual != c.hex {
            let _ = fs::remove_file(&partial);
            return Err(DownloadError::ChecksumMismatch {
                source_name: source.to_string(),
                algorithm: c.algorithm,
                expected: c.hex.clone(),
                actual,
            });
        }
    }
    File::open(&partial)
        .and_then(|f| f.sync_all())
        .map_err(io_err(&partial))?;
    fs::rename(&partial, dest).map_err(io_err(dest))?;
    Ok(outcome)
}

/// What one attempt ended with.
enum Attempt {
    Done,
    Transient(String),
}

fn is_transient_status(status: u16) -> bool {
    status == 408 || status == 429 || (500..600).contains(&status)
}

fn status_hint(status: u16) -> &'static str {
    match status {
        401 | 403 => " (access denied: the server refuses this file; retrying will not help)",
        404 | 410 => " (not found: check the URL, dump date or mirror layout)",
        416 => " (range not satisfiable)",
        _ => "",
    }
}

fn http_fetch(
    url: &str,
    partial: &Path,
    options: &FetchOptions,
    reporter: &dyn Reporter,
) -> Result<Fetched, DownloadError> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(options.connect_timeout))
        .timeout_recv_response(Some(options.response_timeout))
        .user_agent(options.user_agent.as_str())
        .build()
        .into();
    let resumed_from = fs::metadata(partial).map(|m| m.len()).unwrap_or(0);
    let mut attempts = 0u32;
    let mut jitter = JitterSource::new(url);
    loop {
        attempts += 1;
        match attempt(&agent, url, partial, reporter)? {
            Attempt::Done => {
                let bytes = fs::metadata(partial).map_err(io_err(partial))?.len();
                reporter.report(&Event::Finished {
                    task: url,
                    summary: &format!("{bytes} bytes"),
                    up_to_date: false,
                });
                return Ok(Fetched::Downloaded {
                    bytes,
                    resumed_from,
                    attempts,
                });
            }
            Attempt::Transient(last) => {
                if attempts > options.retries {
                    return Err(DownloadError::RetriesExhausted {
                        url: url.into(),
                        attempts,
                        last,
                    });
                }
                let exp = options
                    .backoff
                    .saturating_mul(1u32 << (attempts - 1).min(16));
                let base = exp.min(options.max_backoff);
                let wait = base + base.mul_f64(0.5 * jitter.next());
                reporter.report(&Event::Warning(&format!(
                    "{url}: {last}; retrying in {:.1} s (attempt {} of {})",
                    wait.as_secs_f64(),
                    attempts + 1,
                    options.retries + 1
                )));
                std::thread::sleep(wait);
            }
        }
    }
}

/// A `Content-Range` header of a 206 response: `bytes START-END/TOTAL` (TOTAL may be `*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContentRange {
    /// First byte sent.
    pub start: u64,
    /// Last byte sent (inclusive).
    pub end: u64,
    /// The whole file's length, when the server says.
    pub total: Option<u64>,
}

impl ContentRange {
    /// Parses the header's value; `None` for anything but a well-formed byte range (end before
    /// start, or past a stated total, included).
    pub fn parse(value: &str) -> Option<Self> {
        let (range, total) = value.trim().strip_prefix("bytes ")?.split_once('/')?;
        let (start, end) = range.trim().split_once('-')?;
        let digits = |s: &str| {
            let s = s.trim();
            (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse::<u64>().ok())
                .flatten()
        };
        let (start, end) = (digits(start)?, digits(end)?);
        let total = match total.trim() {
            "*" => None,
            t => Some(digits(t)?),
        };
        let fits = total.is_none_or(|t| end < t);
        (start <= end && fits).then_some(ContentRange { start, end, total })
    }
}

/// One request: continues the partial file with a range request when it has bytes.
fn attempt(
    agent: &ureq::Agent,
    url: &str,
    partial: &Path,
    reporter: &dyn Reporter,
) -> Result<Attempt, DownloadError> {
    let have = fs::metadata(partial).map(|m| m.len()).unwrap_or(0);
    let mut request = agent.get(url);
    if have > 0 {
        request = request.header("Range", format!("bytes={have}-"));
    }
    let mut response = match request.call() {
        Ok(r) => r,
        Err(e) => return Ok(Attempt::Transient(e.to_string())),
    };
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let (append, total) = match status {
        200 => (
            false,
            header("content-length").and_then(|v| v.parse::<u64>().ok()),
        ),
        206 => {
            let range = header("content-range").unwrap_or_default();
            match ContentRange::parse(&range) {
                Some(r) if r.start == have => (true, r.total),
                _ => {
                    return Ok(Attempt::Transient(format!(
                        "the server resumed at {range:?}, not at byte {have}"
                    )));
                }
            }
        }
        // Range past the end: the partial file already holds everything the server has.
        416 if have > 0 => return Ok(Attempt::Done),
        s if is_transient_status(s) => return Ok(Attempt::Transient(format!("HTTP {s}"))),
        s => {
            return Err(DownloadError::Http {
                url: url.into(),
                status: s,
                hint: status_hint(s).into(),
            });
        }
    };
    let mut file = if append {
        OpenOptions::new().append(true).open(partial)
    } else {
        File::create(partial)
    }
    .map_err(io_err(partial))?;
    let mut done = if append { have } else { 0 };
    let report = |done: u64| {
        reporter.report(&Event::Progress(&Progress {
            task: url,
            done,
            total,
            unit: "bytes",
            detail: "",
        }))
    };
    report(done);
    let mut reader = response.body_mut().as_reader();
    let mut buf = vec![0u8; 256 << 10];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                file.flush().map_err(io_err(partial))?;
                return Ok(Attempt::Transient(format!(
                    "connection broke after {done} bytes: {e}"
                )));
            }
        };
        file.write_all(&buf[..n]).map_err(io_err(partial))?;
        done += n as u64;
        report(done);
    }
    file.flush().map_err(io_err(partial))?;
    if let Some(t) = total
        && done < t
    {
        return Ok(Attempt::Transient(format!(
            "the body ended at {done} of {t} bytes"
        )));
    }
    Ok(Attempt::Done)
}

/// Jitter for backoff: a small xorshift seeded from the URL and the clock.
struct JitterSource(u64);

impl JitterSource {
    fn new(url: &str) -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let h = url.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3)
        });
        JitterSource((t ^ h) | 1)
    }

    /// A number in [0, 1).
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_ranges_parse_only_when_well_formed() {
        let r = |start, end, total| Some(ContentRange { start, end, total });
        assert_eq!(
            ContentRange::parse("bytes 100-199/200"),
            r(100, 199, Some(200))
        );
        assert_eq!(ContentRange::parse("bytes 0-0/*"), r(0, 0, None));
        for bad in [
            "",
            "bytes",
            "bytes 5-4/10",
            "bytes 0-10/10",
            "bytes -1-5/10",
            "bytes +1-5/10",
            "bytes 1-5",
            "items 1-5/10",
            "bytes 99999999999999999999-1/2",
        ] {
            assert_eq!(ContentRange::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn checksums_and_mirrors() {
        assert!(Checksum::new(Algorithm::Sha1, "abc").is_err());
        let c = Checksum::new(Algorithm::Md5, "5EB63BBBE01EEED093CB22BB8F5ACDC3").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("x");
        std::fs::write(&f, "hello world").unwrap();
        assert_eq!(c.digest_of(&f).unwrap(), c.hex);
        assert_eq!(
            mirrored("https://m.example/base/", "/squad/dev.json"),
            "https://m.example/base/squad/dev.json"
        );
        assert_eq!(
            mirrored("../shared/data", "squad/dev.json"),
            "../shared/data/squad/dev.json"
        );
    }
}
