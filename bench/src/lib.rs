//! `idemhost bench`: the host's throughput and latency side by side with its peers, in one run
//! on one machine. For each concurrency it drains N OrderPlaced events (a share of them
//! duplicate ids) with the WASM inventory plugin, the native handler, and the plugin in group
//! commit; runs the seed's transaction through pgbench at the same client count and, when Node
//! and the seed's consumer are present, that consumer too. Every host run is verified by SQL
//! (markers == distinct ids, reserved sum == distinct ids): a fast wrong answer is an error.
//! Then a paced run at half the peak rate measures end-to-end latency (publish → ack observed
//! on the wire), and a run with 8 consumers configured measures memory.
//!
//! "The seed" is the idempotent-consumer pattern idemhost implements
//! (`../shared/reference/idempotent-consumer-pattern.txt`): its claim transaction, its two
//! tables and its Node.js consumer (`../shared/peers/`) are the peers measured here.
//!
//! Everything runs in its own database (`idemhost_bench` by default, created if missing): its
//! `processed_message` and `inventory` tables are reset before every run.

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use async_nats::jetstream::{self, stream};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use idemhost::{Config, HandleFuture, Handler, Host, Message, RunOptions, TxHandle};
pub use native::NativeInventory;

pub mod examples;
mod latency;
mod native;
pub mod order_flow;
mod peers;
mod profile;
mod targets;
mod usage;

use usage::{context_switches, rss_mib};
pub use usage::{cpu_time, peak_rss_mib};

const CONSUMER: &str = "inventory-reservation-v1";
const STREAM: &str = "IDEMHOST_BENCH";
const SUBJECT: &str = "idemhost_bench.orders";
const SKUS: usize = 1000;

/// What `idemhost bench` runs.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchOptions {
    /// PostgreSQL server; the bench uses (and creates) database `--database` on it. The host,
    /// pgbench and the Node consumer all connect with this URL: without TLS by default, as the
    /// seed's Node consumer connects (with `sslmode=prefer`, libpq's and sqlx's default, a
    /// server with `ssl = on` would encrypt the host's and pgbench's loopback traffic only).
    #[arg(
        long,
        env = "IDEMHOST_BENCH_PG_URL",
        default_value = "postgres://root@127.0.0.1:5432/postgres?sslmode=disable"
    )]
    pub pg_url: String,
    #[arg(long, default_value = "idemhost_bench")]
    pub database: String,
    #[arg(
        long,
        env = "IDEMHOST_BENCH_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,
    /// Events per run.
    #[arg(long, default_value_t = 20_000)]
    pub n: usize,
    /// Share of the N events that repeat an earlier id (published under a fresh broker id).
    #[arg(long, default_value_t = 0.0)]
    pub duplicates: f64,
    /// `max_in_flight` values (and pgbench / Node client counts).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub concurrency: Vec<u32>,
    /// The inventory component.
    #[arg(long, default_value = "plugins/dist/inventory.wasm")]
    pub plugin: PathBuf,
    /// `batch_max` of the group-commit runs (0: skip them; at most 64). With the other
    /// `--batch-*` defaults the run is adaptive group commit at `c` transactions: what a
    /// consumer gets with `batch_max = 16` and `batch_linger = "2ms"` beside `max_in_flight = c`.
    #[arg(long, default_value_t = 16)]
    pub batch_max: u32,
    /// `max_in_flight` (transactions) of the group-commit runs (0: the concurrency of the run).
    #[arg(long, default_value_t = 0)]
    pub batch_in_flight: u32,
    /// The host runs to make at each concurrency, of `wasm`, `native` and `batch`.
    #[arg(long, value_delimiter = ',', default_value = "wasm,native,batch")]
    pub modes: Vec<String>,
    /// `batch_linger` of the group-commit runs: how long a group's first delivery waits for
    /// company while another group runs (`0s`: a group starts as soon as a transaction is free).
    #[arg(long, default_value = "2ms")]
    pub batch_linger: String,
    /// `batch_lock_timeout` of the group-commit runs.
    #[arg(long, default_value = "50ms")]
    pub batch_lock_timeout: String,
    /// `plugins.keep_resident` of the host runs: how much of each pooled memory is reset in
    /// place (kept resident) rather than decommitted after a delivery.
    #[arg(long, default_value = "4MiB")]
    pub keep_resident: String,
    /// Seconds of each pgbench run (0: skip pgbench).
    #[arg(long, default_value_t = 10)]
    pub pgbench_seconds: u32,
    /// The seed's Node consumer (`consumer.mjs`); skipped when absent or without `node`.
    #[arg(long, default_value = "../shared/peers/node-seed")]
    pub node_seed: PathBuf,
    /// Seconds of the paced latency run (0: skip it).
    #[arg(long, default_value_t = 5)]
    pub latency_seconds: u32,
    /// Correctness only: small N, one concurrency, a short pgbench, no Node (what `.ci/run`
    /// runs).
    #[arg(long)]
    pub smoke: bool,
    /// Record each measured drain and pgbench run with `perf record` (every CPU, call graphs)
    /// into this directory, and print where the host's and PostgreSQL's CPU per delivery
    /// went, by part (needs `perf` and the right to watch every CPU; a profiled run is slower,
    /// so compare its parts, not its rates).
    #[arg(long)]
    pub profile: Option<PathBuf>,
}

/// One drain run of the host.
#[derive(Debug, Clone, serde::Serialize)]
pub struct HostRun {
    pub mode: String,
    pub concurrency: u32,
    pub n: usize,
    pub distinct: usize,
    pub per_second: f64,
    pub cpu_us_per_msg: f64,
    /// Context switches of the bench process per delivery (voluntary: a thread went to sleep
    /// waiting for a reply or a wake-up; involuntary: it was preempted).
    pub switches_per_msg: f64,
    /// CPU of the PostgreSQL server's processes per delivery (`None`: not on this machine).
    pub pg_cpu_us_per_msg: Option<f64>,
    /// CPU of nats-server per delivery (`None`: not on this machine).
    pub nats_cpu_us_per_msg: Option<f64>,
    /// The drain's `perf record` file (`--profile`).
    #[serde(skip)]
    pub profile: Option<PathBuf>,
}

/// The servers' processes on this machine, whose CPU time the bench reads before and after a
/// run: PostgreSQL's postmaster (its backends, live and exited, are counted with it) and
/// nats-server.
#[derive(Debug, Clone, Copy, Default)]
struct Servers {
    postgres: Option<u32>,
    nats: Option<u32>,
}

/// CPU time of each server so far.
#[derive(Debug, Clone, Copy)]
struct ServersCpu {
    postgres: Option<Duration>,
    nats: Option<Duration>,
}

impl Servers {
    /// Finds them: the postmaster as the parent of a session's backend, nats-server as the
    /// process listening on the URL's port.
    async fn find(db_url: &str, nats_url: &str) -> Servers {
        let postgres = async {
            let pool = connect(db_url, 1).await.ok()?;
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&pool)
                .await
                .ok()?;
            // Read while the backend lives: the pool's close ends it.
            let postmaster = usage::parent_of(u32::try_from(pid).ok()?);
            pool.close().await;
            postmaster
        }
        .await;
        let nats_port = nats_url
            .split(',')
            .next()
            .and_then(|u| url::Url::parse(u).ok())
            .and_then(|u| u.port())
            .unwrap_or(4222);
        let nats = usage::listener_on(nats_port);
        Servers { postgres, nats }
    }

    fn cpu(&self) -> ServersCpu {
        ServersCpu {
            postgres: self.postgres.and_then(usage::server_cpu),
            nats: self.nats.and_then(usage::server_cpu),
        }
    }
}

impl ServersCpu {
    /// Each server's CPU since `before`, in µs per unit of `work`.
    fn per(&self, before: &ServersCpu, work: f64) -> (Option<f64>, Option<f64>) {
        let per = |now: Option<Duration>, then: Option<Duration>| {
            Some(now?.saturating_sub(then?).as_secs_f64() * 1e6 / work.max(1.0))
        };
        (
            per(self.postgres, before.postgres),
            per(self.nats, before.nats),
        )
    }
}

/// Shown for a figure that may be missing.
fn us(v: Option<f64>) -> String {
    v.map_or("–".to_string(), |v| format!("{v:.0}"))
}

/// Runs the whole bench; prints a table and returns the final JSON report.
pub async fn run(mut o: BenchOptions) -> anyhow::Result<serde_json::Value> {
    if o.smoke {
        o.n = o.n.min(600);
        o.concurrency = vec![4];
        o.pgbench_seconds = o.pgbench_seconds.min(1);
        o.latency_seconds = o.latency_seconds.min(1);
        o.batch_max = o.batch_max.clamp(2, 20);
        // (batch_max is validated ≤ 64 by the config.)
    }
    if !o.plugin.exists() {
        bail!(
            "plugin {} not found (build it with scripts/build-plugins.sh)",
            o.plugin.display()
        );
    }
    let db_url = database_url(&o).await?;
    let servers = Servers::find(&db_url, &o.nats_url).await;
    if servers.postgres.is_none() || servers.nats.is_none() {
        println!(
            "(the CPU of {} is not measured: not a process of this machine)",
            match (servers.postgres, servers.nats) {
                (None, None) => "PostgreSQL and nats-server",
                (None, _) => "PostgreSQL",
                _ => "nats-server",
            }
        );
    }
    let client = async_nats::connect(&o.nats_url)
        .await
        .with_context(|| format!("cannot connect to NATS at {}", o.nats_url))?;
    let js = jetstream::new(client.clone());
    let node = if o.smoke {
        None
    } else {
        peers::Node::find(&o.node_seed).await
    };
    let mut runs = Vec::new();
    let mut pgbench = HashMap::new();
    let mut pgbench_cpu = HashMap::new();
    let mut node_rates = HashMap::new();
    let top = o.concurrency.iter().copied().max().unwrap_or(16);
    if !o.smoke {
        // Not reported: the first drain after the database was created runs on cold caches and
        // would always be the WASM one.
        let warm_up = BenchOptions {
            n: o.n.min(2_000),
            profile: None,
            ..o.clone()
        };
        drain(&warm_up, &db_url, &js, "native", top, &servers).await?;
    }
    for (round, &c) in o.concurrency.iter().enumerate() {
        // WASM and native take turns going first, so neither always meets what the previous
        // run left behind (autovacuum, a checkpoint).
        let order = if round % 2 == 0 {
            ["wasm", "native", "batch"]
        } else {
            ["native", "wasm", "batch"]
        };
        for mode in order {
            if (mode == "batch" && o.batch_max < 2) || !o.modes.iter().any(|m| m == mode) {
                continue;
            }
            let run = drain(&o, &db_url, &js, mode, c, &servers).await?;
            println!(
                "{:<7} c={c:<3} {:>8.0} msg/s  cpu µs/msg: host {:>4.0} postgres {:>4} nats {:>4}  {:>4.1} switches/msg  ({} events, {} distinct: markers and effects verified)",
                run.mode,
                run.per_second,
                run.cpu_us_per_msg,
                us(run.pg_cpu_us_per_msg),
                us(run.nats_cpu_us_per_msg),
                run.switches_per_msg,
                run.n,
                run.distinct
            );
            if let Some(file) = &run.profile {
                let per_delivery = [
                    (profile::Process::Host, Some(run.cpu_us_per_msg)),
                    (profile::Process::Postgres, run.pg_cpu_us_per_msg),
                    (profile::Process::Nats, run.nats_cpu_us_per_msg),
                ];
                profile::print(file, &format!("the CPU of {mode} at c={c}"), &per_delivery).await?;
            }
            runs.push(run);
        }
        if o.pgbench_seconds > 0 {
            reset(&db_url).await?;
            let recording = profile::start(o.profile.as_deref(), &format!("pgbench-c{c}")).await?;
            let before = servers.cpu();
            let ran = peers::pgbench(&db_url, c, o.pgbench_seconds).await;
            let recorded = profile::stop(recording).await?;
            match ran {
                Ok((tps, transactions)) => {
                    // pgbench's backends end with it: their CPU reaches the postmaster's
                    // account only once it has reaped them (read earlier, a run at one client
                    // showed 1 µs per transaction).
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    let (pg_us, _) = servers.cpu().per(&before, transactions as f64);
                    println!(
                        "pgbench c={c:<3} {tps:>8.0} tps (seed transaction)  cpu µs/tx: postgres {:>4}",
                        us(pg_us)
                    );
                    if let Some(file) = &recorded {
                        let title = format!("PostgreSQL's CPU per pgbench transaction at c={c}");
                        profile::print(file, &title, &[(profile::Process::Postgres, pg_us)])
                            .await?;
                    }
                    pgbench.insert(c, tps);
                    if let Some(v) = pg_us {
                        pgbench_cpu.insert(c, v);
                    }
                }
                Err(e) => println!("pgbench c={c}: skipped ({e:#})"),
            }
        }
        if let Some(node) = &node {
            reset(&db_url).await?;
            publish(
                &js,
                "",
                o.n,
                0.0,
                "idemhost_bench_node",
                "IDEMHOST_BENCH_NODE",
            )
            .await?;
            match node.run(&db_url, c, o.n).await {
                Ok(rate) => {
                    verify(&db_url, o.n).await.context("node peer")?;
                    println!("node    c={c:<3} {rate:>8.0} msg/s (the seed's consumer.mjs)");
                    node_rates.insert(c, rate);
                }
                Err(e) => println!("node c={c}: skipped ({e:#})"),
            }
        }
    }
    let latency = latency::runs(&o, &db_url, (&client, &js), top, &runs).await?;
    let rss = eight_consumers(&o, &db_url, &js).await?;
    let _ = js.delete_stream(STREAM).await;
    let _ = js.delete_stream("IDEMHOST_BENCH_DLQ").await;
    let _ = js.delete_stream("IDEMHOST_BENCH_NODE").await;
    Ok(report(
        &o,
        &runs,
        (&pgbench, &pgbench_cpu),
        &node_rates,
        latency,
        rss,
    ))
}

/// The report: a table on stdout, and the JSON value (printed last by the CLI).
fn report(
    o: &BenchOptions,
    runs: &[HostRun],
    (pgbench, pgbench_cpu): (&HashMap<u32, f64>, &HashMap<u32, f64>),
    node: &HashMap<u32, f64>,
    latency: Option<serde_json::Value>,
    rss: serde_json::Value,
) -> serde_json::Value {
    let rate = |mode: &str, c: u32| {
        runs.iter()
            .find(|r| r.mode == mode && r.concurrency == c)
            .map(|r| r.per_second)
    };
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let fmt = |v: Option<f64>, d: usize| v.map_or("–".to_string(), |v| format!("{v:.d$}"));
    let best_pgbench = pgbench
        .values()
        .copied()
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
    println!();
    println!(
        "| c | wasm msg/s | native msg/s | group commit msg/s (WASM; {}) | pgbench tps | node msg/s | wasm/pgbench | wasm/node | wasm/native | group commit/best pgbench |",
        match o.batch_in_flight {
            0 => format!("batch_max {}, linger {}, c tx", o.batch_max, o.batch_linger),
            n => format!(
                "batch_max {}, linger {}, {n} tx",
                o.batch_max, o.batch_linger
            ),
        }
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for &c in &o.concurrency {
        let (w, n, b) = (rate("wasm", c), rate("native", c), rate("batch", c));
        let (p, nd) = (pgbench.get(&c).copied(), node.get(&c).copied());
        println!(
            "| {c} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            fmt(w, 0),
            fmt(n, 0),
            fmt(b, 0),
            fmt(p, 0),
            fmt(nd, 0),
            fmt(ratio(w, p), 2),
            fmt(ratio(w, nd), 2),
            fmt(ratio(w, n), 2),
            fmt(ratio(b, best_pgbench), 2),
        );
        rows.push(serde_json::json!({
            "concurrency": c, "wasm": w, "native": n, "batch": b, "pgbench": p, "node": nd,
            "host_over_pgbench": ratio(w, p), "host_over_node": ratio(w, nd),
            "wasm_over_native": ratio(w, n), "batch_over_best_pgbench": ratio(b, best_pgbench),
        }));
    }
    // The targets are read at 16 in flight, or the largest concurrency of this run.
    let at = if o.concurrency.contains(&16) {
        16
    } else {
        o.concurrency.iter().copied().max().unwrap_or(16)
    };
    let targets = targets::report(&targets::Inputs {
        runs,
        at,
        pgbench_at: pgbench.get(&at).copied(),
        pgbench_cpu_at: pgbench_cpu.get(&at).copied(),
        pgbench_best: best_pgbench,
        node_at: node.get(&at).copied(),
        p99_ms: latency.as_ref().and_then(|l| l["p99_ms"].as_f64()),
        default_mode: default_mode(o, runs),
    });
    serde_json::json!({
        "n": o.n, "duplicates": o.duplicates, "batch_max": o.batch_max,
        "runs": runs, "rows": rows, "pgbench_cpu_us_per_tx": pgbench_cpu, "targets": targets, "latency": latency, "memory": rss,
        "peak_rss_mib": peak_rss_mib(),
    })
}

/// Creates the bench database if missing; its URL.
async fn database_url(o: &BenchOptions) -> anyhow::Result<String> {
    let mut url = url::Url::parse(&o.pg_url).context("--pg-url is not a URL")?;
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&o.pg_url)
        .await
        .with_context(|| format!("cannot connect to PostgreSQL at {}", o.pg_url))?;
    if !o
        .database
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        bail!("--database must be a plain identifier");
    }
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&o.database)
            .fetch_one(&admin)
            .await?;
    if !exists {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE {}",
            o.database
        )))
        .execute(&admin)
        .await
        .context("cannot create the bench database")?;
    }
    admin.close().await;
    url.set_path(&o.database);
    Ok(url.to_string())
}

/// Recreates the seed's two tables (the host's migrations, the example's inventory with 1,000
/// SKUs), as the peers' reset does; returns the new host key (it signs replayed ids).
async fn reset(db_url: &str) -> anyhow::Result<String> {
    let pool = connect(db_url, 2).await?;
    // The bench database is the bench's own: its schema is dropped whole (tables, the outbox
    // trigger function, the migration history).
    sqlx::raw_sql("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
        .execute(&pool)
        .await?;
    seed_tables(&pool, None, 1..=SKUS as i32).await?;
    let key = sqlx::query_scalar("SELECT key FROM idemhost_key")
        .fetch_one(&pool)
        .await?;
    pool.close().await;
    Ok(key)
}

/// The seed's tables in `pool`'s database: the host's migrations (into `schema`, as
/// `postgres.schema` puts them), the example's `inventory`, and SKUs `sku-<n>` for each `n` of
/// `skus`, with stock enough for any run.
pub async fn seed_tables(
    pool: &PgPool,
    schema: Option<&str>,
    skus: std::ops::RangeInclusive<i32>,
) -> anyhow::Result<()> {
    idemhost::migrate(pool, schema).await?;
    sqlx::raw_sql(include_str!(
        "../../examples/order-flow/migrations/0001_inventory.sql"
    ))
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO inventory SELECT 'sku-' || g, 1000000000, 0 FROM generate_series($1, $2) g",
    )
    .bind(*skus.start())
    .bind(*skus.end())
    .execute(pool)
    .await?;
    Ok(())
}

async fn connect(db_url: &str, max: u32) -> anyhow::Result<PgPool> {
    Ok(PgPoolOptions::new()
        .max_connections(max)
        .connect(db_url)
        .await?)
}

/// Checks a finished run by SQL: one marker and one unit reserved per distinct id.
async fn verify(db_url: &str, distinct: usize) -> anyhow::Result<()> {
    let pool = connect(db_url, 1).await?;
    let markers: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_message")
        .fetch_one(&pool)
        .await?;
    let reserved: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(reserved), 0)::bigint FROM inventory")
            .fetch_one(&pool)
            .await?;
    pool.close().await;
    if markers as usize != distinct || reserved as usize != distinct {
        bail!(
            "wrong result: {markers} markers and {reserved} reserved for {distinct} distinct ids"
        );
    }
    Ok(())
}

/// Publishes `n` OrderPlaced to a fresh `stream` on `subject.*`-free `subject`; a `duplicates`
/// share repeats earlier ids under fresh broker ids. Returns the number of distinct ids.
async fn publish(
    js: &jetstream::Context,
    host_key: &str,
    n: usize,
    duplicates: f64,
    subject: &str,
    stream_name: &str,
) -> anyhow::Result<usize> {
    let _ = js.delete_stream(stream_name).await;
    js.create_stream(stream::Config {
        name: stream_name.into(),
        subjects: vec![format!("{subject}.>"), subject.into()],
        ..Default::default()
    })
    .await?;
    let repeats = ((n as f64) * duplicates.clamp(0.0, 0.9)) as usize;
    let distinct = n - repeats;
    let events = (0..n).map(|i| {
        // Repeats are spread evenly among the first distinct ids, under fresh broker ids.
        let k = if i < distinct {
            i
        } else {
            (i - distinct) * distinct / repeats.max(1)
        };
        let (mut headers, payload) = order(k);
        if i >= distinct {
            // The original under its own id (`order` set it), a repeat under a fresh broker id.
            let broker_id = format!("evt-{k}/{i}");
            headers.insert("Nats-Msg-Id", broker_id.as_str());
            // A repeat: the host reads the original id only from a replay it signed.
            use idemhost::headers::{
                REPLAY_ID_HEADER, REPLAY_SIGNATURE_HEADER, REPLAYED_FROM_HEADER,
            };
            let (id, from) = (format!("evt-{k}"), format!("BENCH/{broker_id}"));
            let signature = idemhost::headers::replay_signature(host_key, &id, &from);
            headers.insert(REPLAY_ID_HEADER, id.as_str());
            headers.insert(REPLAYED_FROM_HEADER, from.as_str());
            headers.insert(REPLAY_SIGNATURE_HEADER, signature.as_str());
        }
        (subject.to_string(), headers, payload)
    });
    publish_pipelined(js, events).await?;
    Ok(distinct)
}

/// OrderPlaced number `k` (id `evt-<k>`, one unit of one of the 1,000 SKUs) with its id header.
fn order(k: usize) -> (async_nats::HeaderMap, String) {
    let id = format!("evt-{k}");
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", id.as_str());
    let payload = format!(
        r#"{{"id":"{id}","orderId":"order-{k}","sku":"sku-{}","quantity":1}}"#,
        1 + k % SKUS
    );
    (headers, payload)
}

/// Publishes (subject, headers, payload) triples, up to 512 awaiting the stream's ack at once.
pub async fn publish_pipelined(
    js: &jetstream::Context,
    events: impl IntoIterator<Item = (String, async_nats::HeaderMap, String)>,
) -> anyhow::Result<()> {
    let mut acks = Vec::new();
    for (subject, headers, payload) in events {
        acks.push(
            js.publish_with_headers(subject, headers, payload.into_bytes().into())
                .await?,
        );
        if acks.len() >= 512 {
            for a in acks.drain(..) {
                a.await?;
            }
        }
    }
    for a in acks {
        a.await?;
    }
    Ok(())
}

/// The bench's host config: `consumers` consumers of the bench stream (the k-th filters
/// `<SUBJECT>.<k>` when there are several), with `extra` consumer keys.
fn host_config(
    db_url: &str,
    o: &BenchOptions,
    consumers: usize,
    extra: &str,
) -> anyhow::Result<Config> {
    let mut text = format!(
        "[nats]\nurl = \"{}\"\n[postgres]\nurl = \"{db_url}\"\nmax_connections = {}\n\
         [metrics]\nconsumer_interval = \"0s\"\nmarker_interval = \"0s\"\n[plugins]\nwatch = false\nkeep_resident = \"{}\"\n",
        o.nats_url,
        o.concurrency.iter().max().copied().unwrap_or(16).max(4) * consumers as u32 + 4,
        o.keep_resident,
    );
    for k in 0..consumers {
        let (name, subject) = if consumers == 1 {
            (CONSUMER.to_string(), SUBJECT.to_string())
        } else {
            (format!("{CONSUMER}-{k}"), format!("{SUBJECT}.{k}"))
        };
        text.push_str(&format!(
            "[[consumer]]\ntables = [\"*\"]\npublish_subjects = [\">\"]\nname = \"{name}\"\nstream = \"{STREAM}\"\nsubjects = [\"{subject}\"]\n\
             plugin = \"{}\"\ndead_letter_subject = \"idemhost_bench_dlq.{k}\"\n{extra}\n",
            o.plugin.display()
        ));
    }
    Ok(Config::from_toml(
        &text,
        std::iter::empty(),
        "bench.toml".as_ref(),
        ".".as_ref(),
    )?)
}

/// A host running in this process until the returned sender fires.
fn start_host(
    host: Host,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), idemhost::Error>>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(host.run(RunOptions { migrate: false }, async move {
        let _ = stopped.await;
    }));
    (stop, task)
}

/// Publishes N events, starts the host and times from its first ack until all are acked.
async fn drain(
    o: &BenchOptions,
    db_url: &str,
    js: &jetstream::Context,
    mode: &str,
    c: u32,
    servers: &Servers,
) -> anyhow::Result<HostRun> {
    let host_key = reset(db_url).await?;
    dead_letter_stream(js).await?;
    let distinct = publish(js, &host_key, o.n, o.duplicates, SUBJECT, STREAM).await?;
    let extra = mode_config(o, mode, c);
    let mut host = Host::new(host_config(db_url, o, 1, &extra)?);
    if mode == "native" {
        host = host.with_handler(CONSUMER, Arc::new(RecordedNative));
    }
    let recording = profile::start(o.profile.as_deref(), &format!("{mode}-c{c}")).await?;
    let cpu0 = cpu_time();
    let servers0 = servers.cpu();
    let switches0 = context_switches();
    let (stop, task) = start_host(host);
    let stream = js.get_stream(STREAM).await?;
    let started = Instant::now();
    // The clock starts at the first ack (compiling the plugin and binding are start-up, not
    // throughput) and counts the deliveries acked after it.
    let mut first: Option<(Instant, u64)> = None;
    loop {
        tokio::time::sleep(Duration::from_millis(5)).await;
        if task.is_finished() {
            return Err(task
                .await?
                .err()
                .map_or_else(|| anyhow::anyhow!("host stopped"), anyhow::Error::from));
        }
        let Ok(info) = stream.consumer_info(CONSUMER).await else {
            continue;
        };
        let acked = info.ack_floor.consumer_sequence;
        if first.is_none() && acked > 0 {
            first = Some((Instant::now(), acked));
        }
        if info.num_pending == 0 && info.num_ack_pending == 0 && acked as usize >= o.n {
            break;
        }
        if started.elapsed() > Duration::from_secs(900) {
            bail!("{mode} at {c}: not drained in 15 minutes");
        }
    }
    let (t0, acked0) = first.unwrap_or((started, 0));
    let seconds = t0.elapsed().as_secs_f64().max(1e-6);
    let cpu = (cpu_time() - cpu0).as_secs_f64();
    let (pg_cpu_us_per_msg, nats_cpu_us_per_msg) = servers.cpu().per(&servers0, o.n as f64);
    let switches = context_switches().saturating_sub(switches0);
    let profile = profile::stop(recording).await?;
    let _ = stop.send(());
    task.await??;
    verify(db_url, distinct)
        .await
        .with_context(|| format!("{mode} at {c}"))?;
    Ok(HostRun {
        mode: mode.into(),
        concurrency: c,
        n: o.n,
        distinct,
        per_second: (o.n as u64 - acked0) as f64 / seconds,
        cpu_us_per_msg: cpu / o.n as f64 * 1e6,
        switches_per_msg: switches as f64 / o.n as f64,
        pg_cpu_us_per_msg,
        nats_cpu_us_per_msg,
        profile,
    })
}

/// The native inventory handler with a version to record, as a plugin has: the native run then
/// sends the same SQL as the WASM one (the claim records the version beside the marker), and
/// `wasm/native` is the sandbox's cost alone.
struct RecordedNative;

impl Handler for RecordedNative {
    fn handle<'a>(&'a self, tx: &'a TxHandle, msg: &'a Message) -> HandleFuture<'a> {
        NativeInventory.handle(tx, msg)
    }

    fn describe(&self) -> String {
        NativeInventory.describe()
    }

    fn digest(&self) -> Option<&str> {
        Some("native:inventory")
    }
}

/// The consumer settings of a run of `mode` at `c` in flight: per message (`wasm`, `native`:
/// `batch_max = 1`), or group commit (`batch`, as the `--batch-*` options say).
fn mode_config(o: &BenchOptions, mode: &str, c: u32) -> String {
    match mode {
        "batch" => format!(
            "max_in_flight = {}\nbatch_max = {}\nbatch_linger = \"{}\"\nbatch_lock_timeout = \"{}\"\n",
            match o.batch_in_flight {
                0 => c,
                n => n,
            },
            o.batch_max,
            o.batch_linger,
            o.batch_lock_timeout
        ),
        _ => format!("max_in_flight = {c}\nbatch_max = 1\n"),
    }
}

/// The run that measured the default configuration: `batch` when it ran with the group-commit
/// defaults (`batch_max` 16, no linger, `max_in_flight` transactions), else `wasm`.
fn default_mode(o: &BenchOptions, runs: &[HostRun]) -> &'static str {
    let defaults = o.batch_max == idemhost::config::DEFAULT_BATCH_MAX
        && humantime::parse_duration(&o.batch_linger)
            .is_ok_and(|d| d == idemhost::config::DEFAULT_BATCH_LINGER)
        && humantime::parse_duration(&o.batch_lock_timeout)
            .is_ok_and(|d| d == idemhost::config::DEFAULT_BATCH_LOCK_TIMEOUT)
        && o.batch_in_flight == 0;
    if defaults && runs.iter().any(|r| r.mode == "batch") {
        "batch"
    } else {
        "wasm"
    }
}

/// The stream capturing the consumers' dead letters (none are expected).
async fn dead_letter_stream(js: &jetstream::Context) -> anyhow::Result<()> {
    let _ = js.delete_stream("IDEMHOST_BENCH_DLQ").await;
    js.create_stream(stream::Config {
        name: "IDEMHOST_BENCH_DLQ".into(),
        subjects: vec!["idemhost_bench_dlq.>".into()],
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// Eight consumers configured (one plugin each, 4 in flight), N events spread over them:
/// the process's resident memory before and after.
async fn eight_consumers(
    o: &BenchOptions,
    db_url: &str,
    js: &jetstream::Context,
) -> anyhow::Result<serde_json::Value> {
    reset(db_url).await?;
    dead_letter_stream(js).await?;
    let _ = js.delete_stream(STREAM).await;
    js.create_stream(stream::Config {
        name: STREAM.into(),
        subjects: vec![format!("{SUBJECT}.>")],
        ..Default::default()
    })
    .await?;
    let before = rss_mib();
    let (stop, task) = start_host(Host::new(host_config(db_url, o, 8, "max_in_flight = 4\n")?));
    let per = (o.n / 8).max(1);
    let events = (0..per * 8).map(|i| {
        let (headers, payload) = order(i);
        (format!("{SUBJECT}.{}", i % 8), headers, payload)
    });
    publish_pipelined(js, events).await?;
    let stream = js.get_stream(STREAM).await?;
    let started = Instant::now();
    let mut during: f64 = 0.0;
    'wait: loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        during = during.max(rss_mib());
        if started.elapsed() > Duration::from_secs(900) {
            bail!("8 consumers: not drained in 15 minutes");
        }
        for k in 0..8 {
            match stream.consumer_info(format!("{CONSUMER}-{k}")).await {
                Ok(i)
                    if i.num_pending == 0
                        && i.num_ack_pending == 0
                        && i.ack_floor.consumer_sequence as usize >= per => {}
                _ => continue 'wait,
            }
        }
        break;
    }
    let _ = stop.send(());
    task.await??;
    verify(db_url, per * 8).await.context("8 consumers")?;
    println!(
        "8 consumers: process RSS {before:.0} MiB before the host, {during:.0} MiB at most while they drained {} events",
        per * 8
    );
    Ok(
        serde_json::json!({"consumers": 8, "rss_before_mib": before, "rss_max_mib": during, "events": per * 8}),
    )
}
