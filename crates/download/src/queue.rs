//! Fetching many files at once, politely.
//!
//! A [`Job`] is one file to fetch. [`fetch_all`] runs a list of them on `jobs` worker threads
//! and keeps to two limits per host, because public servers punish crawlers: Wikimedia allows two
//! connections per client to its dump servers, and book sites answer bursts with 403s. At most
//! [`QueueOptions::per_host`] files of one host are in flight, and successive transfers from one
//! host start at least [`QueueOptions::min_interval`] apart. Local paths and `file://` sources
//! have no host and no limits.
//!
//! One failed file does not stop the others: every job is tried, and the result lists each
//! file's outcome or error, so a re-run fetches only what is still missing.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use bertkit_stage_io::stage::Reporter;

use crate::{Checksum, DownloadError, FetchOptions, Fetched, fetch};

/// One file to fetch.
#[derive(Debug, Clone)]
pub struct Job {
    /// The relative path it is known by (in the registry and in mirrors).
    pub path: String,
    /// Where it comes from: a URL or a local path.
    pub source: String,
    /// Where it goes.
    pub dest: PathBuf,
    /// The expected digest, if published.
    pub checksum: Option<Checksum>,
}

/// Concurrency and politeness.
#[derive(Debug, Clone)]
pub struct QueueOptions {
    /// Files in flight at once, over all hosts.
    pub jobs: usize,
    /// Files in flight at once from one host.
    pub per_host: usize,
    /// Least time between the starts of two transfers from one host.
    pub min_interval: Duration,
}

impl Default for QueueOptions {
    fn default() -> Self {
        QueueOptions {
            jobs: 4,
            per_host: 2,
            min_interval: Duration::from_millis(500),
        }
    }
}

/// The host of an `http(s)://` URL (`None` for local sources).
pub fn host_of(source: &str) -> Option<&str> {
    let rest = source
        .strip_prefix("https://")
        .or_else(|| source.strip_prefix("http://"))?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    Some(authority.rsplit('@').next().unwrap_or(authority))
}

#[derive(Default)]
struct HostState {
    active: usize,
    last_start: Option<Instant>,
}

/// Admits transfers to hosts under the per-host limits.
struct HostGate {
    per_host: usize,
    min_interval: Duration,
    hosts: Mutex<HashMap<String, HostState>>,
    freed: Condvar,
}

impl HostGate {
    /// Waits until `host` may start another transfer, and counts it as started.
    fn enter(&self, host: &str) {
        let mut hosts = self.hosts.lock().unwrap();
        loop {
            let state = hosts.entry(host.to_string()).or_default();
            if state.active < self.per_host {
                let wait = state
                    .last_start
                    .map(|t| self.min_interval.saturating_sub(t.elapsed()))
                    .unwrap_or_default();
                if wait.is_zero() {
                    state.active += 1;
                    state.last_start = Some(Instant::now());
                    return;
                }
                hosts = self.freed.wait_timeout(hosts, wait).unwrap().0;
            } else {
                hosts = self.freed.wait(hosts).unwrap();
            }
        }
    }

    fn leave(&self, host: &str) {
        if let Some(state) = self.hosts.lock().unwrap().get_mut(host) {
            state.active -= 1;
        }
        self.freed.notify_all();
    }
}

/// Fetches every job (see the module docs). Returns each job's result, in the jobs' order.
pub fn fetch_all(
    jobs: &[Job],
    queue: &QueueOptions,
    options: &FetchOptions,
    reporter: &dyn Reporter,
) -> Vec<Result<Fetched, DownloadError>> {
    let gate = HostGate {
        per_host: queue.per_host.max(1),
        min_interval: queue.min_interval,
        hosts: Mutex::new(HashMap::new()),
        freed: Condvar::new(),
    };
    let next = Mutex::new(0usize);
    let results: Vec<Mutex<Option<Result<Fetched, DownloadError>>>> =
        jobs.iter().map(|_| Mutex::new(None)).collect();
    let workers = queue.jobs.clamp(1, jobs.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                loop {
                    let index = {
                        let mut next = next.lock().unwrap();
                        let i = *next;
                        *next += 1;
                        i
                    };
                    let Some(job) = jobs.get(index) else { break };
                    let host = host_of(&job.source);
                    // A complete destination costs no request, so it does not wait for the host.
                    let result = if job.dest.is_file() || host.is_none() {
                        fetch(
                            &job.source,
                            &job.dest,
                            job.checksum.as_ref(),
                            options,
                            reporter,
                        )
                    } else {
                        let host = host.unwrap_or_default();
                        gate.enter(host);
                        let r = fetch(
                            &job.source,
                            &job.dest,
                            job.checksum.as_ref(),
                            options,
                            reporter,
                        );
                        gate.leave(host);
                        r
                    };
                    *results[index].lock().unwrap() = Some(result);
                }
            });
        }
    });
    results
        .into_iter()
        .map(|r| r.into_inner().unwrap().expect("every job ran"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_of_urls() {
        assert_eq!(
            host_of("https://dumps.wikimedia.org/enwiki/x"),
            Some("dumps.wikimedia.org")
        );
        assert_eq!(
            host_of("http://u:p@127.0.0.1:8080?x"),
            Some("127.0.0.1:8080")
        );
        assert_eq!(host_of("file:///tmp/x"), None);
        assert_eq!(host_of("../shared/data/x"), None);
    }

    #[test]
    fn the_gate_keeps_the_per_host_limit_and_spacing() {
        let gate = HostGate {
            per_host: 2,
            min_interval: Duration::from_millis(30),
            hosts: Mutex::new(HashMap::new()),
            freed: Condvar::new(),
        };
        let active = std::sync::atomic::AtomicUsize::new(0);
        let most = std::sync::atomic::AtomicUsize::new(0);
        let starts = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..6 {
                s.spawn(|| {
                    gate.enter("h");
                    starts.lock().unwrap().push(Instant::now());
                    let now = active.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    most.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(20));
                    active.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    gate.leave("h");
                });
            }
        });
        assert!(most.into_inner() <= 2);
        let mut starts = starts.into_inner().unwrap();
        starts.sort();
        for pair in starts.windows(2) {
            // Allow a little scheduling slack below the configured 30 ms.
            assert!(
                pair[1] - pair[0] >= Duration::from_millis(25),
                "{:?}",
                pair[1] - pair[0]
            );
        }
    }
}
