//! Downloads against a local HTTP server (127.0.0.1) with Range support and fault injection.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bertkit_download::{
    Algorithm, Checksum, DownloadError, FetchOptions, Fetched, fetch, mirrored,
};

/// How the server answers `/file`.
#[derive(Clone, Default)]
struct Behaviour {
    /// Drop the connection after this many body bytes, in the first response only.
    drop_first_after: Option<usize>,
    /// Answer 503 to this many requests first.
    fail_first: usize,
    /// Answer these statuses, one each, to the first requests (before `fail_first`'s 503s).
    fail_with: &'static [u16],
    /// Answer 200 with the whole body even to range requests.
    ignore_range: bool,
}

struct Server {
    url: String,
    /// The Range header of every request to /file (None when absent).
    ranges: Arc<Mutex<Vec<Option<String>>>>,
    stop: Arc<AtomicBool>,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn serve(body: Vec<u8>, behaviour: Behaviour) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let ranges = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let (r, s) = (ranges.clone(), stop.clone());
    std::thread::spawn(move || {
        let served = AtomicUsize::new(0);
        for stream in listener.incoming() {
            if s.load(Ordering::SeqCst) {
                break;
            }
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request_line = String::new();
            if reader.read_line(&mut request_line).is_err() {
                continue;
            }
            let mut range = None;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some((k, v)) = line.split_once(':')
                    && k.eq_ignore_ascii_case("range")
                {
                    range = Some(v.trim().to_string());
                }
            }
            let path = request_line
                .split_whitespace()
                .nth(1)
                .unwrap_or("")
                .to_string();
            if path != "/file" {
                let _ = stream.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found");
                continue;
            }
            r.lock().unwrap().push(range.clone());
            let n = served.fetch_add(1, Ordering::SeqCst);
            if let Some(status) = behaviour.fail_with.get(n) {
                let _ = stream.write_all(
                    format!("HTTP/1.1 {status} Failing\r\nContent-Length: 4\r\nConnection: close\r\n\r\nfail")
                        .as_bytes(),
                );
                continue;
            }
            let n = n - behaviour.fail_with.len();
            if n < behaviour.fail_first {
                let _ = stream.write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbusy");
                continue;
            }
            let start = range
                .as_deref()
                .filter(|_| !behaviour.ignore_range)
                .and_then(|r| r.strip_prefix("bytes="))
                .and_then(|r| r.trim_end_matches('-').parse::<usize>().ok());
            let (head, slice) = match start {
                Some(st) if st >= body.len() => {
                    let _ = stream.write_all(b"HTTP/1.1 416 Range Not Satisfiable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                    continue;
                }
                Some(st) => (
                    format!(
                        "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {st}-{}/{}\r\nConnection: close\r\n\r\n",
                        body.len() - st,
                        body.len() - 1,
                        body.len()
                    ),
                    &body[st..],
                ),
                None => (
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    ),
                    &body[..],
                ),
            };
            let _ = stream.write_all(head.as_bytes());
            let cut = if n == behaviour.fail_first {
                behaviour.drop_first_after
            } else {
                None
            };
            let _ = stream.write_all(&slice[..cut.unwrap_or(slice.len()).min(slice.len())]);
            let _ = stream.flush();
        }
    });
    Server {
        url: format!("http://127.0.0.1:{port}/file"),
        ranges,
        stop,
        port,
    }
}

fn body(len: usize) -> Vec<u8> {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn sha256(bytes: &[u8]) -> Checksum {
    Checksum::new(Algorithm::Sha256, &bertkit_test_support::sha256_hex(bytes)).unwrap()
}

fn quick() -> FetchOptions {
    FetchOptions {
        retries: 3,
        backoff: Duration::from_millis(5),
        max_backoff: Duration::from_millis(20),
        ..Default::default()
    }
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn a_dropped_connection_resumes_with_a_range_request() {
    let data = body(1_000_000);
    let server = serve(
        data.clone(),
        Behaviour {
            drop_first_after: Some(300_000),
            ..Default::default()
        },
    );
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("file.bin");
    let outcome = fetch(
        &server.url,
        &dest,
        Some(&sha256(&data)),
        &quick(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), data);
    assert!(
        matches!(
            outcome,
            Fetched::Downloaded {
                attempts: 2,
                resumed_from: 0,
                bytes: 1_000_000
            }
        ),
        "{outcome:?}"
    );
    let ranges = server.ranges.lock().unwrap().clone();
    assert_eq!(ranges.len(), 2);
    assert_eq!(ranges[0], None);
    let resumed_at: u64 = ranges[1]
        .as_deref()
        .unwrap()
        .trim_start_matches("bytes=")
        .trim_end_matches('-')
        .parse()
        .unwrap();
    assert!(resumed_at > 0 && resumed_at <= 300_000, "{resumed_at}");
    assert_eq!(leftovers(dir.path()), vec!["file.bin"]);
}

#[test]
fn a_partial_file_from_a_crash_is_continued() {
    let data = body(500_000);
    let server = serve(data.clone(), Behaviour::default());
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("file.bin");
    std::fs::write(bertkit_stage_io::partial_path(&dest), &data[..200_000]).unwrap();
    let outcome = fetch(
        &server.url,
        &dest,
        Some(&sha256(&data)),
        &quick(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap();
    assert_eq!(
        outcome,
        Fetched::Downloaded {
            bytes: 500_000,
            resumed_from: 200_000,
            attempts: 1
        }
    );
    assert_eq!(std::fs::read(&dest).unwrap(), data);
    assert_eq!(
        server.ranges.lock().unwrap().clone(),
        vec![Some("bytes=200000-".to_string())]
    );
}

#[test]
fn a_server_that_ignores_ranges_restarts_the_file() {
    let data = body(100_000);
    let server = serve(
        data.clone(),
        Behaviour {
            ignore_range: true,
            ..Default::default()
        },
    );
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("file.bin");
    std::fs::write(bertkit_stage_io::partial_path(&dest), &data[..40_000]).unwrap();
    fetch(
        &server.url,
        &dest,
        Some(&sha256(&data)),
        &quick(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), data);
}

#[test]
fn transient_errors_are_retried_up_to_the_limit() {
    let data = body(10_000);
    let server = serve(
        data.clone(),
        Behaviour {
            fail_first: 2,
            ..Default::default()
        },
    );
    let dir = tempfile::tempdir().unwrap();
    let outcome = fetch(
        &server.url,
        &dir.path().join("ok.bin"),
        None,
        &quick(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap();
    assert!(
        matches!(outcome, Fetched::Downloaded { attempts: 3, .. }),
        "{outcome:?}"
    );
    assert_eq!(server.ranges.lock().unwrap().len(), 3);

    let busy = serve(
        data,
        Behaviour {
            fail_first: 100,
            ..Default::default()
        },
    );
    let options = FetchOptions {
        retries: 2,
        ..quick()
    };
    let err = fetch(
        &busy.url,
        &dir.path().join("busy.bin"),
        None,
        &options,
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap_err();
    assert!(
        matches!(err, DownloadError::RetriesExhausted { attempts: 3, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("HTTP 503"), "{err}");
    assert_eq!(
        busy.ranges.lock().unwrap().len(),
        3,
        "exactly retries + 1 requests"
    );
    assert!(!dir.path().join("busy.bin").exists());
}

/// Every status the crate docs call transient is retried: a timeout (408), rate limiting (429)
/// and server errors; the download then completes. (Tried: dropping 429 from the transient
/// statuses fails here; only 503 was tested before.)
#[test]
fn timeouts_rate_limits_and_server_errors_are_retried() {
    let data = body(10_000);
    let server = serve(
        data.clone(),
        Behaviour {
            fail_with: &[408, 429, 500, 502, 504],
            ..Default::default()
        },
    );
    let dir = tempfile::tempdir().unwrap();
    let five_retries = FetchOptions {
        retries: 5,
        ..quick()
    };
    let fetched = fetch(
        &server.url,
        &dir.path().join("ok.bin"),
        None,
        &five_retries,
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap();
    assert!(
        matches!(fetched, Fetched::Downloaded { attempts: 6, .. }),
        "{fetched:?}"
    );
    assert_eq!(std::fs::read(dir.path().join("ok.bin")).unwrap(), data);
    // A client error that is not transient fails at the first answer.
    let forbidden = serve(
        data,
        Behaviour {
            fail_with: &[403],
            ..Default::default()
        },
    );
    let err = fetch(
        &forbidden.url,
        &dir.path().join("no.bin"),
        None,
        &quick(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap_err();
    assert!(
        matches!(err, DownloadError::Http { status: 403, .. }),
        "{err}"
    );
    assert_eq!(forbidden.ranges.lock().unwrap().len(), 1);
}

#[test]
fn not_found_fails_at_once_with_a_clear_message() {
    let server = serve(body(10), Behaviour::default());
    let dir = tempfile::tempdir().unwrap();
    let url = server.url.replace("/file", "/missing");
    let started = std::time::Instant::now();
    let err = fetch(
        &url,
        &dir.path().join("missing.bin"),
        None,
        &quick(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap_err();
    assert!(
        matches!(err, DownloadError::Http { status: 404, .. }),
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.contains("HTTP 404") && message.contains(&url) && message.contains("not found"),
        "{message}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "no retries on a 404"
    );
    assert!(leftovers(dir.path()).is_empty());
}

#[test]
fn a_bad_checksum_never_leaves_a_file() {
    let data = body(50_000);
    let server = serve(data, Behaviour::default());
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("file.bin");
    let wrong = sha256(b"something else");
    let err = fetch(
        &server.url,
        &dest,
        Some(&wrong),
        &quick(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap_err();
    assert!(
        matches!(err, DownloadError::ChecksumMismatch { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("deleted"));
    assert!(
        leftovers(dir.path()).is_empty(),
        "{:?}",
        leftovers(dir.path())
    );
}

#[test]
fn a_complete_file_is_not_fetched_again() {
    let data = body(20_000);
    let server = serve(data.clone(), Behaviour::default());
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("file.bin");
    fetch(
        &server.url,
        &dest,
        Some(&sha256(&data)),
        &quick(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap();
    let again = fetch(
        &server.url,
        &dest,
        Some(&sha256(&data)),
        &quick(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap();
    assert_eq!(again, Fetched::AlreadyPresent { bytes: 20_000 });
    assert_eq!(server.ranges.lock().unwrap().len(), 1);
}

#[test]
fn local_paths_file_urls_and_mirrors_are_sources_too() {
    let dir = tempfile::tempdir().unwrap();
    let mirror = dir.path().join("mirror");
    std::fs::create_dir_all(mirror.join("squad")).unwrap();
    let data = body(3_000);
    std::fs::write(mirror.join("squad/dev.json"), &data).unwrap();
    let source = mirrored(mirror.to_str().unwrap(), "squad/dev.json");
    let out = dir.path().join("out/dev.json");
    assert_eq!(
        fetch(
            &source,
            &out,
            Some(&sha256(&data)),
            &quick(),
            &bertkit_stage_io::stage::Silent
        )
        .unwrap(),
        Fetched::Copied { bytes: 3_000 }
    );
    let out2 = dir.path().join("out/dev2.json");
    fetch(
        &format!("file://{source}"),
        &out2,
        None,
        &quick(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap();
    assert_eq!(std::fs::read(&out2).unwrap(), data);
    let err = fetch(
        &mirrored(mirror.to_str().unwrap(), "nope.json"),
        &dir.path().join("x"),
        None,
        &quick(),
        &bertkit_stage_io::stage::Silent,
    )
    .unwrap_err();
    assert!(err.to_string().contains("nope.json"), "{err}");
}
