//! What a step of work cost the process: wall time, CPU time (all threads) and peak memory.
//!
//! A [`Meter`] started before a step and read after it gives the step's own [`Cost`]. The peak
//! resident set is the step's own on Linux: starting a meter resets the process's high-water
//! mark (`/proc/self/clear_refs`, value 5) to its current resident set, so one process running
//! several stages one after another (the pipeline) reports each stage's peak, not the largest
//! so far. Where the reset is refused (other systems, some sandboxes) the peak is the process's
//! since it started, and [`Cost::peak_is_own`] says so. Not meant for steps that run at the same
//! time in one process: the high-water mark is one per process.

use std::time::Instant;

/// A step's cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cost {
    /// Wall-clock seconds.
    pub wall_seconds: f64,
    /// CPU seconds, user and system, of every thread of the process.
    pub cpu_seconds: f64,
    /// The largest resident set in bytes (see [`Cost::peak_is_own`]); `None` where the system
    /// does not tell.
    pub peak_rss_bytes: Option<u64>,
    /// Whether `peak_rss_bytes` is this step's own peak, not the process's since it started.
    pub peak_is_own: bool,
    /// The resident set when the step started: what earlier work left in the process (an
    /// allocator keeps freed memory a while), counted in the peak too.
    pub start_rss_bytes: Option<u64>,
}

impl Cost {
    /// "12.3 s, 20.1 CPU-s, peak 183 MiB from 40" (the peak marked "≤" when it is the
    /// process's since it started; "from": the resident set the step started with).
    pub fn describe(&self) -> String {
        let mut s = format!("{:.1} s, {:.1} CPU-s", self.wall_seconds, self.cpu_seconds);
        if let Some(peak) = self.peak_rss_bytes {
            let bound = if self.peak_is_own { "" } else { "≤ " };
            s.push_str(&format!(", peak {bound}{} MiB", peak >> 20));
            if let Some(start) = self.start_rss_bytes {
                s.push_str(&format!(" from {}", start >> 20));
            }
        }
        s
    }
}

/// Measures one step: [`Meter::start`] before it, [`Meter::finish`] after it.
#[derive(Debug)]
pub struct Meter {
    started: Instant,
    cpu_at_start: f64,
    peak_reset: bool,
    start_rss: Option<u64>,
}

impl Meter {
    /// Starts measuring (and resets the process's peak resident set where the system allows).
    pub fn start() -> Self {
        let peak_reset = reset_peak_rss();
        Meter {
            started: Instant::now(),
            cpu_at_start: process_cpu_seconds(),
            peak_reset,
            start_rss: status_kib("VmRSS:").map(|k| k << 10),
        }
    }

    /// The cost since [`Meter::start`].
    pub fn finish(&self) -> Cost {
        Cost {
            wall_seconds: self.started.elapsed().as_secs_f64(),
            cpu_seconds: (process_cpu_seconds() - self.cpu_at_start).max(0.0),
            peak_rss_bytes: status_kib("VmHWM:").map(|k| k << 10),
            peak_is_own: self.peak_reset,
            start_rss_bytes: self.start_rss,
        }
    }
}

/// User + system CPU seconds of the whole process so far.
pub fn process_cpu_seconds() -> f64 {
    #[cfg(unix)]
    {
        // SAFETY: getrusage writes into the zeroed struct it is given and reads nothing else.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } == 0 {
            let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
            return seconds(usage.ru_utime) + seconds(usage.ru_stime);
        }
    }
    0.0
}

/// A `kB` figure of `/proc/self/status` (`VmHWM:` the peak resident set, `VmRSS:` the
/// current one), where the system reports it.
fn status_kib(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// Resets the peak resident set to the current one; false where that is refused.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_sees_its_own_cpu_time_and_peak() {
        // A big allocation, touched and freed, raises the process's high-water mark.
        let big = vec![1u8; 256 << 20];
        std::hint::black_box(&big);
        drop(big);
        let meter = Meter::start();
        // Spin until this thread has had 200 ms of CPU (not of wall time: on a loaded machine
        // 200 ms of wall time can hold far less CPU).
        let thread_cpu = || {
            let mut t = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: a valid clock id and a pointer to a timespec we own.
            unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
            t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
        };
        let spun_from = thread_cpu();
        let mut x = 0u64;
        while thread_cpu() - spun_from < 0.2 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let cost = meter.finish();
        assert!(cost.wall_seconds >= 0.2, "{cost:?}");
        // The process's CPU time: this thread's, and whatever other tests ran meanwhile on the
        // other cores.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        assert!(
            cost.cpu_seconds >= 0.19 && cost.cpu_seconds < cost.wall_seconds * cores + 0.1,
            "{cost:?}"
        );
        if cfg!(target_os = "linux") {
            let peak = cost.peak_rss_bytes.expect("VmHWM on Linux");
            assert!(
                cost.start_rss_bytes.expect("VmRSS on Linux") <= peak,
                "{cost:?}"
            );
            if cost.peak_is_own {
                // The 256 MiB freed before the step is not this step's peak.
                assert!(peak < 200 << 20, "{cost:?}");
            } else {
                assert!(peak >= 256 << 20, "{cost:?}");
            }
        }
        assert!(cost.describe().contains("CPU-s"), "{}", cost.describe());
    }
}
