//! `idemhost bench --profile DIR`: where each process's CPU goes, per delivery. Each measured
//! drain (and each pgbench run) is recorded system-wide with `perf record` (call graphs from
//! DWARF, so the stacks of a PostgreSQL built without frame pointers unwind); after the run
//! the samples of PostgreSQL's processes and of the bench process (the host runs in it) are
//! sorted into parts by the functions on their stacks, and each part's share of that process's
//! samples is multiplied by the process's CPU per delivery the bench measured: microseconds
//! per delivery, by part. nats-server ships without symbols, so it is not split.
//!
//! A sample goes to the first part, in the order listed, that any of its frames names: for
//! PostgreSQL the statement it serves (a sample inside the host's claim function counts there
//! even when its leaf is an index insert), for the host the work that made it (a send system
//! call under sqlx's frames is PostgreSQL's socket, whichever runtime frame is innermost). The rules are names of functions as
//! `perf script` prints them; a frame without a symbol is skipped. A profiled run is slower
//! than an unprofiled one (every sample copies 16 KiB of stack): compare its parts, not its
//! rates.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::process::{Child, Command};

/// Samples per second and CPU. Low: each sample carries 16 KiB of stack for the unwinding.
const FREQUENCY: &str = "199";

/// A `perf record` under way.
pub(super) struct Recording {
    child: Child,
    file: PathBuf,
}

/// Starts recording every CPU into `dir/name.data` when there is a `dir` (`--profile`).
pub(super) async fn start(dir: Option<&Path>, name: &str) -> anyhow::Result<Option<Recording>> {
    match dir {
        Some(dir) => record(dir, name).await.map(Some),
        None => Ok(None),
    }
}

/// Stops `recording`, if any (see [`Recording::stop`]).
pub(super) async fn stop(recording: Option<Recording>) -> anyhow::Result<Option<PathBuf>> {
    match recording {
        Some(r) => r.stop().await.map(Some),
        None => Ok(None),
    }
}

/// Reads `file` and prints where `what` went: each process's parts, with its CPU per delivery
/// in `per_delivery` (see [`table`]).
pub(super) async fn print(
    file: &Path,
    what: &str,
    per_delivery: &[(Process, Option<f64>)],
) -> anyhow::Result<()> {
    let parts = read(file, std::process::id()).await?;
    let title = format!("where {what} went ({})", file.display());
    println!("{}", table(&title, &parts, per_delivery));
    Ok(())
}

/// Starts recording every CPU into `dir/name.data`.
async fn record(dir: &Path, name: &str) -> anyhow::Result<Recording> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let file = dir.join(format!("{name}.data"));
    let said = dir.join(format!("{name}.perf.log"));
    let mut child = Command::new("perf")
        .args([
            "record",
            "-q",
            "-a",
            "-F",
            FREQUENCY,
            "--call-graph",
            "dwarf,16384",
            "-o",
        ])
        .arg(&file)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        // To a file, not a pipe nobody reads while it records: a full pipe would stall perf.
        .stderr(
            std::fs::File::create(&said).with_context(|| format!("creating {}", said.display()))?,
        )
        .kill_on_drop(true)
        .spawn()
        .context("perf not runnable (--profile needs `perf`: apt-get install linux-perf)")?;
    // perf opens its events before it records; one that cannot (no permission to watch every
    // CPU: perf_event_paranoid, or a container) exits at once, saying why.
    tokio::time::sleep(Duration::from_millis(300)).await;
    if let Some(status) = child.try_wait()? {
        let why = std::fs::read_to_string(&said).unwrap_or_default();
        bail!(
            "perf record exited ({status}) before recording: {} (recording every CPU needs root \
             or CAP_PERFMON, or kernel.perf_event_paranoid ≤ 0)",
            why.trim()
        );
    }
    Ok(Recording { child, file })
}

impl Recording {
    /// Stops recording (SIGINT: perf writes its file and exits) and returns the file.
    async fn stop(mut self) -> anyhow::Result<PathBuf> {
        if let Some(pid) = self.child.id() {
            // SAFETY: `kill` has no memory effects; `pid` is our own child, not yet reaped.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGINT) };
        }
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .context("perf record did not stop within 60 s")??;
        if !status.success() && !self.file.exists() {
            bail!("perf record failed ({status})");
        }
        Ok(self.file)
    }
}

/// Whose a sample is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Process {
    Host,
    Postgres,
    Nats,
}

/// The parts of PostgreSQL's work, in the order they are tried: a sample goes to the first one
/// any of its frames names.
const POSTGRES_PARTS: &[(&str, &[&str])] = &[
    (
        "the host's SECURITY DEFINER functions (claims, outbox rows)",
        &["fmgr_security_definer"],
    ),
    (
        "the session clearing (function, or statements in a group)",
        &[
            "plpgsql_call_handler",
            "ResetAllOptions",
            "DiscardCommand",
            "PerformPortalClose",
            "Async_UnlistenAll",
        ],
    ),
    (
        "parsing and planning statements",
        &[
            "pg_parse_query",
            "raw_parser",
            "pg_analyze_and_rewrite",
            "parse_analyze",
            "pg_plan_queries",
            "pg_plan_query",
        ],
    ),
    (
        "commit (WAL flush included)",
        &["CommitTransactionCommand", "CommitTransaction", "XLogFlush"],
    ),
    (
        "executing the other statements (the handler's, BEGIN)",
        &[
            "PortalRun",
            "PortalStart",
            "exec_bind_message",
            "exec_execute_message",
        ],
    ),
    (
        "reading from and writing to the client",
        &[
            "secure_read",
            "secure_write",
            "pq_getbyte",
            "pq_recvbuf",
            "pq_flush",
            "internal_flush",
            "WaitEventSetWait",
        ],
    ),
];

/// The parts of the host's work, likewise. A name holding `&` needs each of its pieces on the
/// stack: a send or receive system call is tokio's `try_io` under sqlx's or async-nats's
/// frames.
const HOST_PARTS: &[(&str, &[&str])] = &[
    (
        "PostgreSQL socket: send and receive system calls",
        &["Registration::try_io&sqlx", "Registration::poll_io&sqlx"],
    ),
    (
        "NATS socket: send and receive system calls",
        &[
            "Registration::try_io&async_nats",
            "Registration::poll_io&async_nats",
        ],
    ),
    (
        "wasm instances (instantiate, reset, drop)",
        &[
            "instantiate",
            "InstancePre",
            "allocate_instance",
            "deallocate",
            "StoreInner",
            "new_store",
            "pagemap",
            "Instance::new",
        ],
    ),
    ("SQL gate", &["sql_gate::"]),
    ("sqlx (statements, rows)", &["sqlx_"]),
    ("NATS client", &["async_nats::"]),
    ("wasm execution and its host calls", &["wasmtime"]),
    (
        "tokio runtime (polling, parking, timers)",
        &["tokio::runtime", "tokio::time"],
    ),
];

/// One sample: its process and its frames' symbols, innermost first.
#[derive(Debug)]
struct Sample {
    process: Process,
    frames: Vec<String>,
}

/// Reads `perf script -F comm,pid,ip,sym` output: a sample is a line `comm pid` followed by
/// indented `ip symbol` frames, innermost first, and a blank line. Samples of other processes
/// than PostgreSQL's, nats-server and the process `host_pid` are dropped.
fn samples(script: &str, host_pid: u32) -> Vec<Sample> {
    let mut out = Vec::new();
    let mut current: Option<Sample> = None;
    for line in script.lines() {
        if line.trim().is_empty() {
            out.extend(current.take());
            continue;
        }
        if line.starts_with([' ', '\t']) {
            if let Some(sample) = &mut current {
                let mut parts = line.split_whitespace();
                let _ip = parts.next();
                let symbol: Vec<&str> = parts.collect();
                let symbol = symbol.join(" ");
                if !symbol.is_empty() && !symbol.starts_with("[unknown]") {
                    sample.frames.push(symbol);
                }
            }
            continue;
        }
        out.extend(current.take());
        // `comm` may hold spaces; the pid is the last field.
        let mut fields = line.split_whitespace().collect::<Vec<_>>();
        let Some(pid) = fields.pop().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let comm = fields.join(" ");
        let process = if pid == host_pid {
            Process::Host
        } else if comm == "postgres" {
            Process::Postgres
        } else if comm == "nats-server" {
            Process::Nats
        } else {
            continue;
        };
        current = Some(Sample {
            process,
            frames: Vec::new(),
        });
    }
    out.extend(current);
    out
}

/// What a sample with no part named goes to.
const OTHER: &str = "other (kernel scheduling, allocation, …)";

/// The part `frames` belong to: the first of `rules` whose name (each of its `&`-separated
/// pieces) some frame holds.
fn part_of(frames: &[String], rules: &[(&'static str, &[&str])]) -> &'static str {
    let on_stack = |name: &str| {
        name.split('&')
            .all(|piece| frames.iter().any(|f| f.contains(piece)))
    };
    rules
        .iter()
        .find(|(_, names)| names.iter().any(|n| on_stack(n)))
        .map_or(OTHER, |(part, _)| *part)
}

/// Samples per part, for each process.
type Parts = BTreeMap<Process, BTreeMap<&'static str, usize>>;

/// Sorts the samples of `script` into parts.
fn sort(script: &str, host_pid: u32) -> Parts {
    let mut parts: Parts = BTreeMap::new();
    for sample in samples(script, host_pid) {
        let part = match sample.process {
            Process::Postgres => part_of(&sample.frames, POSTGRES_PARTS),
            Process::Host => part_of(&sample.frames, HOST_PARTS),
            Process::Nats => "all (nats-server has no symbols)",
        };
        *parts
            .entry(sample.process)
            .or_default()
            .entry(part)
            .or_default() += 1;
    }
    parts
}

/// Reads `file` with `perf script` and sorts its samples (see [`sort`]).
async fn read(file: &Path, host_pid: u32) -> anyhow::Result<Parts> {
    let out = Command::new("perf")
        .args(["script", "-F", "comm,pid,ip,sym", "-i"])
        .arg(file)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .await
        .context("perf script not runnable")?;
    if !out.status.success() {
        bail!("perf script -i {} failed ({})", file.display(), out.status);
    }
    Ok(sort(&String::from_utf8_lossy(&out.stdout), host_pid))
}

/// The table of `parts`: each process's parts as shares of its samples and, with its CPU per
/// delivery (µs) in `per_delivery`, as µs per delivery.
fn table(title: &str, parts: &Parts, per_delivery: &[(Process, Option<f64>)]) -> String {
    let mut out = format!(
        "\n{title}\n| process | part | samples | share | µs per delivery |\n|---|---|---|---|---|\n"
    );
    for (process, cpu) in per_delivery {
        let Some(counts) = parts.get(process) else {
            continue;
        };
        let total: usize = counts.values().sum();
        let mut rows: Vec<_> = counts.iter().collect();
        rows.sort_by(|a, b| b.1.cmp(a.1));
        for (part, n) in rows {
            let share = *n as f64 / total.max(1) as f64;
            let us = cpu.map_or("–".to_string(), |c| format!("{:.0}", c * share));
            out.push_str(&format!(
                "| {process:?} | {part} | {n} | {:.1} % | {us} |\n",
                share * 100.0
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRIPT: &str = "\
postgres 101
\t    55aa hash_search_with_hash_value
\t    55ab ExecInsertIndexTuples
\t    55ac plpgsql_exec_function
\t    55ad fmgr_security_definer
\t    55ae PortalRun
\t    55af PostgresMain

postgres 102
\t    55b0 ResetAllOptions
\t    55b1 plpgsql_exec_function
\t    55b2 plpgsql_call_handler
\t    55b3 PortalRun
\t    55b4 PostgresMain

postgres 103
\t    55c0 base_yyparse
\t    55c1 raw_parser
\t    55c2 pg_parse_query
\t    55c3 PostgresMain

postgres 104
\t    55d0 [unknown]
\t    55d1 secure_read
\t    55d2 PostgresMain

tokio-rt-worker 7
\t    1 __send
\t    1 tokio::runtime::io::registration::Registration::try_io
\t    2 sqlx_core::net::socket::buffered::BufferedSocket<S>::flush::{{closure}}
\t    3 sqlx_postgres::connection::PgConnection::run
\t    4 wasmtime::runtime::component::func::host::HostFn::entrypoint

tokio-rt-worker 7
\t    1 memset
\t    2 wasmtime::runtime::vm::sys::unix::pagemap::reset_with_pagemap
\t    3 core::ptr::drop_in_place<wasmtime::runtime::store::StoreInner<idemhost::plugin::PluginState>>

pgbench 9
\t    1 PQexec

nats-server 55
\t    1 0x1234
";

    #[test]
    fn samples_go_to_the_part_their_frames_name() {
        let parts = sort(SCRIPT, 7);
        let pg = &parts[&Process::Postgres];
        assert_eq!(
            pg[POSTGRES_PARTS[0].0], 1,
            "inside the claim, whatever the leaf"
        );
        assert_eq!(pg[POSTGRES_PARTS[1].0], 1);
        assert_eq!(pg[POSTGRES_PARTS[2].0], 1);
        assert_eq!(pg[POSTGRES_PARTS[5].0], 1, "[unknown] frames are skipped");
        let host = &parts[&Process::Host];
        assert_eq!(
            host[HOST_PARTS[0].0], 1,
            "a send under sqlx is PostgreSQL's socket"
        );
        assert_eq!(host[HOST_PARTS[2].0], 1);
        assert_eq!(parts[&Process::Nats].values().sum::<usize>(), 1);
        assert_eq!(parts.len(), 3, "pgbench's own samples are not counted");
    }

    #[test]
    fn the_table_gives_each_part_its_share_of_the_cpu_per_delivery() {
        let parts = sort(SCRIPT, 7);
        let t = table(
            "t",
            &parts,
            &[(Process::Postgres, Some(400.0)), (Process::Host, None)],
        );
        assert!(t.contains("| 25.0 % | 100 |"), "{t}");
        assert!(
            t.contains(
                "| Host | PostgreSQL socket: send and receive system calls | 1 | 50.0 % | – |"
            ),
            "{t}"
        );
    }
}
