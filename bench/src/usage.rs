//! What the bench process used: CPU time, context switches, resident memory (from `/proc` and
//! `getrusage`).

use std::time::Duration;

/// utime + stime of this process.
pub fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks: u64 = fields.get(11).and_then(|u| u.parse().ok()).unwrap_or(0)
        + fields.get(12).and_then(|s| s.parse().ok()).unwrap_or(0);
    Duration::from_millis(ticks * 1000 / 100)
}

/// Context switches of every thread of this process so far (voluntary and involuntary).
pub(super) fn context_switches() -> u64 {
    // SAFETY: getrusage writes into the zeroed struct it is given and reads nothing else.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0;
    }
    (usage.ru_nvcsw + usage.ru_nivcsw).max(0) as u64
}

fn status_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

pub(super) fn rss_mib() -> f64 {
    status_mib("VmRSS:")
}

/// The process's peak resident memory (VmHWM).
pub fn peak_rss_mib() -> f64 {
    status_mib("VmHWM:")
}
