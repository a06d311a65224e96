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

/// pgbench's tps for the seed transaction at `clients` clients over `seconds`.
pub(super) async fn pgbench(db_url: &str, clients: u32, seconds: u32) -> anyhow::Result<f64> {
    let script =
        std::env::temp_dir().join(format!("idemhost-bench-seed-{}.sql", std::process::id()));
    std::fs::write(&script, SEED_TX)?;
    let out = Command::new("pgbench")
        .args(["-n", "-M", "prepared"])
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
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "pgbench failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    text.lines()
        .find_map(|l| {
            l.strip_prefix("tps = ")?
                .split_whitespace()
                .next()?
                .parse::<f64>()
                .ok()
        })
        .context("no tps line in pgbench's output")
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
