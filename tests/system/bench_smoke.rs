//! `idemhost bench --smoke`: the benchmark's every run (WASM, native, group commit, pgbench,
//! the paced latency run, 8 consumers) on a few hundred events, for correctness only: each
//! host run is verified by SQL inside the bench, which exits non-zero on a wrong result.

use std::process::Command;

use crate::common::*;

#[test]
fn bench_smoke_runs_every_mode_and_verifies_each() {
    let (stdout, report, modes) = bench(&[
        "--smoke",
        "--database",
        "idemhost_bench_smoke",
        "--duplicates",
        "0.2",
    ]);
    assert_eq!(modes, ["wasm", "native", "batch"], "{stdout}");
    assert!(
        report["runs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["distinct"] == 480
                && r["per_second"].as_f64().unwrap() > 0.0
                && r["switches_per_msg"].as_f64().is_some_and(|s| s > 0.0)),
        "{stdout}"
    );
    // The paced run is the default configuration: group commit (batch_max 16, no linger).
    assert_eq!(report["latency"]["mode"], "batch", "{stdout}");
    assert!(
        stdout.contains("| default config (group commit, WASM) / pgbench's best tps |"),
        "{stdout}"
    );
    assert!(report["latency"]["p99_ms"].as_f64().is_some(), "{stdout}");
    // Beside it, the same load both ways: per message at half its own peak, and the default.
    let same_load = &report["latency"]["at_per_message_load"];
    assert_eq!(same_load["per_message"]["mode"], "wasm", "{stdout}");
    assert_eq!(same_load["default"]["mode"], "batch", "{stdout}");
    assert_eq!(
        same_load["per_message"]["rate"], same_load["default"]["rate"],
        "{stdout}"
    );
    assert_eq!(report["memory"]["consumers"], 8);
    assert!(stdout.contains("| c | wasm msg/s |"), "{stdout}");
    bench_runs_only_the_modes_asked_for();
}

/// `--modes` picks the host runs (here group commit alone, at the transactions
/// `--batch-in-flight` says), and the run still verifies its result by SQL. (Called by the test
/// above: the bench's streams have fixed names, so two benches must not run at once.)
fn bench_runs_only_the_modes_asked_for() {
    let (stdout, _, modes) = bench(&[
        "--smoke",
        "--database",
        "idemhost_bench_modes",
        "--modes",
        "batch",
        "--batch-in-flight",
        "2",
    ]);
    assert_eq!(modes, ["batch"], "{stdout}");
    assert!(stdout.contains("2 tx)"), "{stdout}");
}

/// Runs `idemhost bench` with `args` and the inventory plugin against the suite's servers (by
/// the environment: a private server's password stays off the command line); its stdout, its
/// JSON report and the modes of its host runs.
fn bench(args: &[&str]) -> (String, serde_json::Value, Vec<String>) {
    let out = run_ok(
        Command::new(env!("CARGO_BIN_EXE_idemhost"))
            .arg("bench")
            .args(args)
            .arg("--plugin")
            .arg(plugin_path("inventory"))
            .env("IDEMHOST_BENCH_PG_URL", PG_URL.get())
            .env("IDEMHOST_BENCH_NATS_URL", NATS_URL.get()),
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let report: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let modes = report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["mode"].as_str().map(String::from))
        .collect();
    (stdout, report, modes)
}
