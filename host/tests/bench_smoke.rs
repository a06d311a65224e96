//! `idemhost bench --smoke`: the benchmark's every run (WASM, native, group commit, pgbench,
//! the paced latency run, 8 consumers) on a few hundred events, for correctness only: each
//! host run is verified by SQL inside the bench, which exits non-zero on a wrong result.

mod common;

use std::process::Command;

use common::*;

#[test]
fn bench_smoke_runs_every_mode_and_verifies_each() {
    let out = run_ok(
        Command::new(env!("CARGO_BIN_EXE_idemhost"))
            .args([
                "bench",
                "--smoke",
                "--database",
                "idemhost_bench_smoke",
                "--duplicates",
                "0.2",
            ])
            .arg("--plugin")
            .arg(plugin_path("inventory")),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let modes: Vec<&str> = report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["mode"].as_str())
        .collect();
    assert_eq!(modes, ["wasm", "native", "batch"], "{stdout}");
    assert!(
        report["runs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["distinct"] == 480 && r["per_second"].as_f64().unwrap() > 0.0),
        "{stdout}"
    );
    assert!(report["latency"]["p99_ms"].as_f64().is_some(), "{stdout}");
    assert_eq!(report["memory"]["consumers"], 8);
    assert!(stdout.contains("| c | wasm msg/s |"), "{stdout}");
}
