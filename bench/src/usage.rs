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
    Duration::from_micros(ticks * 1_000_000 / ticks_per_second())
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

/// Fields after the command name of `/proc/<pid>/stat` (field 3, `state`, is index 0).
fn stat_fields(pid: u32) -> Option<Vec<u64>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    Some(
        rest.split_whitespace()
            .map(|f| f.parse().unwrap_or(0))
            .collect(),
    )
}

/// Clock ticks per second of `/proc`'s times.
fn ticks_per_second() -> u64 {
    // SAFETY: sysconf reads a constant of the system.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as u64 } else { 100 }
}

/// Every process id under `/proc`.
fn pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// CPU time of a server and of every process it started, dead ones included: user and system
/// time of `root` and its live children, and the children's times `root` collected as they
/// exited (`cutime`, `cstime`: a PostgreSQL backend whose client disconnected). `None` when
/// `root` is not a process of this machine (a remote server, another PID namespace).
pub fn server_cpu(root: u32) -> Option<Duration> {
    // utime, stime, cutime, cstime are fields 14–17: indices 11–14 here; ppid (field 4) is 1.
    let own = stat_fields(root)?;
    let mut ticks = own.get(11..15)?.iter().sum::<u64>();
    for pid in pids() {
        if pid == root {
            continue;
        }
        if let Some(f) = stat_fields(pid)
            && f.get(1) == Some(&u64::from(root))
        {
            ticks += f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
        }
    }
    Some(Duration::from_micros(
        ticks * 1_000_000 / ticks_per_second(),
    ))
}

/// The parent of process `pid` (a PostgreSQL backend's is the postmaster).
pub fn parent_of(pid: u32) -> Option<u32> {
    stat_fields(pid)?.get(1).map(|&p| p as u32)
}

/// The process listening on TCP `port` of this machine (IPv4 or IPv6), found through the
/// socket's inode: `None` if none is, or its process is not visible here.
pub fn listener_on(port: u16) -> Option<u32> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address is `hex-ip:hex-port`; state 0A is LISTEN; inode is field 10.
            let local_port = f
                .get(1)
                .and_then(|a| a.rsplit_once(':'))
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) && f.get(3) == Some(&"0A") {
                inodes.extend(f.get(9).map(|i| format!("socket:[{i}]")));
            }
        }
    }
    if inodes.is_empty() {
        return None;
    }
    pids().into_iter().find(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
            fds.flatten().any(|fd| {
                std::fs::read_link(fd.path())
                    .is_ok_and(|l| inodes.iter().any(|i| l.as_os_str() == i.as_str()))
            })
        })
    })
}
