//! The peers `idemhost bench` measures the host against: the seed's transaction through
//! pgbench (the ceiling of a per-message host on this database), and the seed's Node.js consumer.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context as _, bail};
use tokio::process::Command;

/// The seed's transaction, as `../shared/peers/pgbench/seed_tx.sql` runs it: claim a fresh
/// marker, reserve one unit of a random SKU, commit.
const SEED_TX: &str = "\\set i random(1, 100000000)
\\set s random(1, 1000)
BEGIN;
INSERT INTO processed_message (consumer_name, message_id) VALUES ('inventory-reservation-v1', 'pgb-' || :client_id || '-' || :i || '-' || random()) ON CONFLICT DO NOTHING RETURNING message_id;
UPDATE inventory SET available = available - 1, reserved = reserved + 1 WHERE sku = 'sku-' || :s AND available >= 1;
COMMIT;
";

/// pgbench's tps for the seed transaction at `clients` clients over `seconds`, and the number
/// of transactions it ran.
pub(super) async fn pgbench(
    db_url: &str,
    clients: u32,
    seconds: u32,
) -> anyhow::Result<(f64, u64)> {
    let text = run_pgbench(db_url, clients, seconds, &[]).await?;
    let tps = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("tps = ")?
                .split_whitespace()
                .next()?
                .parse::<f64>()
                .ok()
        })
        .context("no tps line in pgbench's output")?;
    let transactions = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("number of transactions actually processed: ")?
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<u64>()
                .ok()
        })
        .context("no transaction count in pgbench's output")?;
    Ok((tps, transactions))
}

/// Latency of the seed transaction run by pgbench at a steady `rate`.
pub(super) struct Paced {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub transactions: usize,
}

/// The seed transaction at `rate` per second (`pgbench -R`), each one's latency taken from its
/// scheduled start to its end (pgbench's per-transaction log: time plus schedule lag).
pub(super) async fn pgbench_paced(
    db_url: &str,
    clients: u32,
    rate: f64,
    seconds: u32,
) -> anyhow::Result<Paced> {
    let dir = std::env::temp_dir().join(format!("idemhost-bench-log-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let prefix = format!("--log-prefix={}", dir.join("seed").display());
    let rate = format!("{rate:.0}");
    let ran = run_pgbench(db_url, clients, seconds, &["-R", &rate, "-l", &prefix]).await;
    let mut us = Vec::new();
    for entry in std::fs::read_dir(&dir)? {
        let text = std::fs::read_to_string(entry?.path())?;
        for line in text.lines() {
            // client, transaction, time µs, script, epoch s, epoch µs[, schedule lag µs]
            let f: Vec<&str> = line.split_whitespace().collect();
            let field = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
            if let Some(time) = field(2) {
                us.push(time + field(6).unwrap_or(0.0));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    ran?;
    if us.is_empty() {
        bail!("pgbench logged no transaction");
    }
    us.sort_by(f64::total_cmp);
    let q = |p: f64| us[((us.len() as f64 * p) as usize).min(us.len() - 1)] / 1e3;
    Ok(Paced {
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        max_ms: q(1.0),
        transactions: us.len(),
    })
}

/// Runs the seed transaction through pgbench with `extra` options; its standard output.
async fn run_pgbench(
    db_url: &str,
    clients: u32,
    seconds: u32,
    extra: &[&str],
) -> anyhow::Result<String> {
    let script =
        std::env::temp_dir().join(format!("idemhost-bench-seed-{}.sql", std::process::id()));
    std::fs::write(&script, SEED_TX)?;
    let out = Command::new("pgbench")
        .args(["-n", "-M", "prepared"])
        .args(extra)
        .arg("-c")
        .arg(clients.to_string())
        .arg("-j")
        .arg(clients.min(2).to_string())
        .arg("-T")
        .arg(seconds.to_string())
        .arg("-f")
        .arg(&script)
        .arg(db_url)
        .stdin(Stdio::null())
        .output()
        .await
        .context("pgbench not runnable")?;
    let _ = std::fs::remove_file(&script);
    if !out.status.success() {
        bail!(
            "pgbench failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The seed's Node consumer, installed in a writable copy of its folder.
pub(super) struct Node {
    dir: PathBuf,
}

impl Node {
    /// `None` (the peer is skipped) without `node`/`npm` or the folder.
    pub(super) async fn find(seed: &Path) -> Option<Node> {
        if !seed.join("consumer.mjs").exists() {
            return None;
        }
        let node = Command::new("node").arg("--version").output().await.ok()?;
        if !node.status.success() {
            return None;
        }
        let dir = PathBuf::from("target/peers/node-seed");
        if !dir.join("node_modules").exists() {
            std::fs::create_dir_all(&dir).ok()?;
            for file in ["consumer.mjs", "package.json", "package-lock.json"] {
                std::fs::copy(seed.join(file), dir.join(file)).ok()?;
            }
            println!(
                "installing the Node peer's packages (npm ci) in {}",
                dir.display()
            );
            let ci = Command::new("npm")
                .args(["ci", "--silent", "--no-audit", "--no-fund"])
                .current_dir(&dir)
                .status()
                .await
                .ok()?;
            if !ci.success() {
                println!("npm ci failed: the Node peer is skipped");
                return None;
            }
        }
        Some(Node { dir })
    }

    /// Drains `n` events from stream `IDEMHOST_BENCH_NODE` with `concurrency`; its msg/s.
    pub(super) async fn run(
        &self,
        db_url: &str,
        concurrency: u32,
        n: usize,
    ) -> anyhow::Result<f64> {
        let out = Command::new("node")
            .arg("consumer.mjs")
            .arg(format!("--db={db_url}"))
            .arg("--stream=IDEMHOST_BENCH_NODE")
            .arg(format!("--durable=node-peer-{concurrency}"))
            .arg(format!("--concurrency={concurrency}"))
            .arg(format!("--expect={n}"))
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .output()
            .await?;
        if !out.status.success() {
            bail!(
                "consumer.mjs failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let report: serde_json::Value = text
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str(l).ok())
            .context("no report line from consumer.mjs")?;
        report["per_second"]
            .as_f64()
            .context("no per_second in consumer.mjs's report")
    }
}
