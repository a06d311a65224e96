//! The embedding example run as a user runs it: three starts and stops of the host in one
//! process, a WASM consumer and a native one on the program's own runtime, each run checked by
//! the program for sessions, tasks and threads left behind; and the program's exposition
//! carries the host's counters across the runs beside its own. The program drops its schema,
//! roles and stream as it ends (`--clean-up`). Against the suite's servers
//! (`IDEMHOST_TEST_PG_URL`, `IDEMHOST_TEST_NATS_URL`; else the machine's).

use std::process::Command;

fn from_env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

#[test]
fn the_host_starts_and_stops_three_times_in_one_program_leaving_nothing_behind() {
    let pg_url = from_env(
        "IDEMHOST_TEST_PG_URL",
        "postgres://root@127.0.0.1:5432/test",
    );
    let nats_url = from_env("IDEMHOST_TEST_NATS_URL", "nats://127.0.0.1:4222");
    let schema = format!("t_embedding_{}", std::process::id());
    let plugin = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../plugins/dist/inventory.wasm"
    );
    assert!(
        std::path::Path::new(plugin).exists(),
        "{plugin} is missing: run scripts/build-plugins.sh first"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_embedding"))
        .args([
            "--pg-url",
            &pg_url,
            "--nats-url",
            &nats_url,
            "--plugin",
            plugin,
        ])
        .args([
            "--schema",
            &schema,
            "--runs",
            "3",
            "--messages",
            "15",
            "--clean-up",
        ])
        .output()
        .expect("the example runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for run in 0..3 {
        let applied = 15 * (run + 1);
        assert!(
            stdout.contains(&format!(
                "run {run}: applied {applied} and {applied}; left behind: 0 sessions, 0 tasks, 0 threads"
            )),
            "{stdout}"
        );
    }
    assert!(
        stdout.contains("after 3 runs: 0 tasks and 0 threads more than before the first"),
        "{stdout}"
    );
    // The host's counters went on across the runs, in the program's one exposition.
    for consumer in ["embedded-inventory", "embedded-orders"] {
        let line = stdout
            .lines()
            .find(|l| {
                l.starts_with("idemhost_deliveries_total")
                    && l.contains(&format!("consumer=\"{consumer}\""))
                    && l.contains(&format!("event_type=\"{schema}."))
            })
            .unwrap_or_else(|| panic!("no applied count of {consumer}: {stdout}"));
        assert!(line.ends_with(" 45"), "{line}");
    }
    assert!(stdout.contains("embedding_host_runs_total 3"), "{stdout}");
}
