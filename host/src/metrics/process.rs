//! The process's own figures under the names every Prometheus client uses (`process_*`), read
//! from `/proc/self` at scrape time: CPU seconds, resident and virtual memory, open and allowed
//! file descriptors, threads, start time. Where `/proc` is missing (not Linux) none is shown.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

#[derive(Debug)]
pub(super) struct ProcessCollector;

/// What `/proc/self/stat` says, in the units the metrics use.
#[derive(Debug, PartialEq)]
struct Stat {
    cpu_seconds: f64,
    threads: i64,
    /// Seconds since boot at which the process started.
    started_after_boot: f64,
    virtual_bytes: i64,
    resident_bytes: i64,
}

/// Parses `/proc/self/stat`: the fields after the command, which is in parentheses and may
/// itself hold spaces and parentheses (so the last `)` ends it).
fn parse_stat(stat: &str, ticks_per_second: f64, page_bytes: i64) -> Option<Stat> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // rest starts at field 3 (state); fields are 1-based in proc(5).
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
    let ticks = |n: usize| field(n).map(|t| t as f64 / ticks_per_second);
    Some(Stat {
        cpu_seconds: ticks(14)? + ticks(15)?,
        threads: i64::try_from(field(20)?).ok()?,
        started_after_boot: ticks(22)?,
        virtual_bytes: i64::try_from(field(23)?).ok()?,
        resident_bytes: i64::try_from(field(24)?).ok()?.saturating_mul(page_bytes),
    })
}

/// The boot time (`btime` of `/proc/stat`), in seconds since the epoch.
fn boot_time() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|t| t.trim().parse::<f64>().ok())
}

fn open_fds() -> Option<i64> {
    let entries = std::fs::read_dir("/proc/self/fd").ok()?;
    // The directory handle being read is one of them.
    i64::try_from(entries.count()).ok().map(|n| n - 1)
}

fn max_fds() -> Option<i64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into the struct it is given.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    (ok && limit.rlim_cur != libc::RLIM_INFINITY)
        .then(|| i64::try_from(limit.rlim_cur).ok())
        .flatten()
}

fn sysconf(name: libc::c_int) -> Option<i64> {
    // SAFETY: sysconf only reads a configuration value.
    let v = unsafe { libc::sysconf(name) };
    (v > 0).then_some(v)
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: impl Into<Option<f64>>,
) -> std::fmt::Result {
    let Some(value) = value.into() else {
        return Ok(());
    };
    let metric = ConstGauge::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(raw) = std::fs::read_to_string("/proc/self/stat") else {
            return Ok(());
        };
        let ticks = sysconf(libc::_SC_CLK_TCK).unwrap_or(100) as f64;
        let page = sysconf(libc::_SC_PAGESIZE).unwrap_or(4096);
        let Some(stat) = parse_stat(&raw, ticks, page) else {
            return Ok(());
        };
        let cpu = ConstCounter::new(stat.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "User and system CPU time spent, in seconds",
            None,
            MetricType::Counter,
        )?)?;
        gauge(
            &mut encoder,
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            stat.resident_bytes as f64,
        )?;
        gauge(
            &mut encoder,
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes",
            stat.virtual_bytes as f64,
        )?;
        gauge(
            &mut encoder,
            "process_open_fds",
            "Open file descriptors",
            open_fds().map(|n| n as f64),
        )?;
        gauge(
            &mut encoder,
            "process_max_fds",
            "The limit of open file descriptors (RLIMIT_NOFILE)",
            max_fds().map(|n| n as f64),
        )?;
        gauge(
            &mut encoder,
            "process_threads",
            "Threads of the process",
            stat.threads as f64,
        )?;
        gauge(
            &mut encoder,
            "process_start_time_seconds",
            "Start time of the process since the Unix epoch, in seconds",
            boot_time().map(|b| b + stat.started_after_boot),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command name holding `) ` and spaces does not shift the fields.
    #[test]
    fn stat_fields_after_a_hostile_command_name() {
        let line = "4242 (a) b (c) 5 6) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 150 0 0 20 0 \
                    7 0 12345 104857600 2560 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1";
        let stat = parse_stat(line, 100.0, 4096).expect("parsed");
        assert_eq!(
            stat,
            Stat {
                cpu_seconds: 4.0,
                threads: 7,
                started_after_boot: 123.45,
                virtual_bytes: 104_857_600,
                resident_bytes: 2560 * 4096,
            }
        );
        assert_eq!(parse_stat("4242 (truncated", 100.0, 4096), None);
        assert_eq!(parse_stat("4242 (x) S 1 2", 100.0, 4096), None);
    }

    /// The live process: its figures are there and plausible.
    #[test]
    fn the_live_process_is_described() {
        let raw = std::fs::read_to_string("/proc/self/stat").expect("linux");
        let stat = parse_stat(&raw, 100.0, 4096).expect("parsed");
        assert!(stat.threads >= 1 && stat.resident_bytes > 0, "{stat:?}");
        assert!(open_fds().is_some_and(|n| n >= 3));
        assert!(boot_time().is_some_and(|b| b > 1.0e9));
    }
}
