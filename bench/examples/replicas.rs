//! Replica scaling: N OrderPlaced events drained by 1, 2 and 3 `idemhost run` processes sharing
//! one durable consumer (release binary, the WASM inventory plugin), each run from a fresh schema
//! and stream; effects checked by SQL. `scripts/bench-replicas.sh` prints pgbench's seed
//! transaction at the same total concurrency beside it. Not a test: ±15% run to run here.
//!
//! `cargo run --release -p idemhost-bench --example replicas -- --n 20000 --in-flight 8 --replicas 1,2,3`
//! Against a cluster (`scripts/bench-cluster.sh`): `--nats URL,URL,URL --stream-replicas 3`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;

use idemhost_bench::examples::*;

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: usize = arg("--n", "20000").parse()?;
    let in_flight: u32 = arg("--in-flight", "8").parse()?;
    let counts: Vec<usize> = arg("--replicas", "1,2,3")
        .split(',')
        .map(|r| r.parse())
        .collect::<Result<_, _>>()?;
    let nats_url = arg("--nats", NATS_URL);
    let stream_replicas: usize = arg("--stream-replicas", "1").parse()?;
    let bin = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/idemhost");
    let plugin = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../plugins/dist/inventory.wasm"
    );
    let dir = std::env::temp_dir().join("idemhost-bench-replicas");
    std::fs::create_dir_all(&dir)?;
    let servers: Vec<async_nats::ServerAddr> = nats_url
        .split(',')
        .map(|u| u.parse())
        .collect::<Result<_, _>>()?;
    let js = jetstream::new(async_nats::connect(servers).await?);
    let mut rows = Vec::new();
    for replicas in counts {
        let pool = reset_schema().await?;
        publish_all_replicated(&js, n, stream_replicas).await?;
        let text = format!(
            "[nats]\nurl = \"{nats_url}\"\n[postgres]\nurl = \"{PG_URL}\"\nschema = \"{SCHEMA}\"\nmax_connections = {}\n\
             [metrics]\nmarker_interval = \"0s\"\n\
             [[consumer]]\ntables = [\"*\"]\npublish_subjects = [\">\"]\nname = \"{CONSUMER}\"\nstream = \"BENCH\"\nsubjects = [\"bench.orders\"]\nplugin = \"{plugin}\"\n\
             max_in_flight = {in_flight}\ndead_letter_subject = \"bench.dlq\"\n",
            in_flight + 2
        );
        let config = dir.join("idemhost.toml");
        std::fs::write(&config, text)?;
        let started = Instant::now();
        let mut children: Vec<Child> = (0..replicas)
            .map(|_| {
                Command::new(bin)
                    .args([
                        "run",
                        "--config",
                        config.to_str().unwrap_or_default(),
                        "--no-migrate",
                    ])
                    .env("RUST_LOG", "warn")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
            })
            .collect::<Result<_, _>>()?;
        let stream = js.get_stream("BENCH").await?;
        let deadline = started + Duration::from_secs(600);
        loop {
            // Not found until the first replica has bound the durable consumer.
            if let Ok(info) = stream.consumer_info(CONSUMER).await
                && info.num_pending == 0
                && info.num_ack_pending == 0
                && info.delivered.consumer_sequence > 0
            {
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "not drained after 600 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let elapsed = started.elapsed();
        for c in &mut children {
            // SAFETY: a signal to our own child process.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            c.wait()?;
        }
        let (markers, reserved): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM processed_message), (SELECT sum(reserved)::bigint FROM inventory)",
        )
        .fetch_one(&pool)
        .await?;
        anyhow::ensure!(
            markers == n as i64 && reserved == n as i64,
            "markers {markers}, reserved {reserved}, n {n}"
        );
        let rate = n as f64 / elapsed.as_secs_f64();
        println!(
            "replicas={replicas} in_flight={in_flight} total_concurrency={} {rate:.0} msg/s ({:.1} s, start-up included)",
            replicas as u32 * in_flight,
            elapsed.as_secs_f64()
        );
        rows.push(serde_json::json!({"replicas": replicas, "total_concurrency": replicas as u32 * in_flight, "per_second": rate}));
    }
    println!("{}", serde_json::json!({ "n": n, "runs": rows }));
    Ok(())
}
