//! idemhost embedded in a program of its own (docs/embedding.md).
//!
//! The program owns the tokio runtime, the shutdown signal and the metrics exposition; idemhost
//! is a library call in it. Two consumers share one host: `embedded-inventory` runs the WASM
//! inventory plugin, `embedded-orders` a native Rust handler ([`OrderRecorder`]). The host is
//! started and stopped `--runs` times in the one process; after each run the program checks
//! that the host left nothing behind — no PostgreSQL session, no task on the runtime, no thread
//! — and fails if it did.
//!
//! ```text
//! cargo run -p idemhost-embedding -- --pg-url postgres://root@127.0.0.1:5432/postgres \
//!     --nats-url nats://127.0.0.1:4222 --plugin plugins/dist/inventory.wasm --runs 3
//! ```
//!
//! `--schema` names the schema, the stream (upper-cased) and the host's sessions (default
//! `embedding_<pid>`); `--clean-up` drops them, and the roles the host made, at the end.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use idemhost::{
    Config, HandleFuture, Handler, HandlerError, Host, HostMetrics, Message, RunOptions, SqlValue,
    TxHandle,
};

/// The native consumer's handler: records each order's id and body in `embedded_order`, in the
/// delivery's transaction (its only database access), beside the host's marker.
struct OrderRecorder;

impl Handler for OrderRecorder {
    fn handle<'a>(&'a self, tx: &'a TxHandle, msg: &'a Message) -> HandleFuture<'a> {
        Box::pin(async move {
            let body = std::str::from_utf8(&msg.payload)
                .map_err(|_| HandlerError::Terminal("the order is not UTF-8 text".into()))?;
            tx.execute(
                "INSERT INTO embedded_order (message_id, body) VALUES ($1, $2)",
                &[SqlValue::Text(msg.id.clone()), SqlValue::Text(body.into())],
            )
            .await
            .map_err(|e| HandlerError::Retryable(e.to_string()))?;
            Ok(())
        })
    }

    fn describe(&self) -> String {
        "native order recorder".into()
    }
}

/// What the program is told (see the module's documentation).
struct Options {
    pg_url: String,
    nats_url: String,
    plugin: String,
    schema: String,
    runs: usize,
    messages: usize,
    /// Drop what the program made when it ends, however it ends.
    clean_up: bool,
}

impl Options {
    fn parse() -> anyhow::Result<Options> {
        let mut o = Options {
            pg_url: "postgres://root@127.0.0.1:5432/postgres".into(),
            nats_url: "nats://127.0.0.1:4222".into(),
            plugin: "plugins/dist/inventory.wasm".into(),
            schema: format!("embedding_{}", std::process::id()),
            runs: 3,
            messages: 20,
            clean_up: false,
        };
        let mut args = std::env::args().skip(1);
        while let Some(flag) = args.next() {
            if flag == "--clean-up" {
                o.clean_up = true;
                continue;
            }
            let value = args
                .next()
                .with_context(|| format!("{flag} needs a value"))?;
            match flag.as_str() {
                "--pg-url" => o.pg_url = value,
                "--nats-url" => o.nats_url = value,
                "--plugin" => o.plugin = value,
                "--schema" => o.schema = value,
                "--runs" => o.runs = value.parse().context("--runs")?,
                "--messages" => o.messages = value.parse().context("--messages")?,
                other => bail!("unknown option {other}"),
            }
        }
        if !o
            .schema
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            bail!("--schema: lower-case letters, digits and _ only");
        }
        Ok(o)
    }

    /// The host's configuration: both consumers on one stream of their own, on `schema`,
    /// every session named after it (how the program finds the host's sessions).
    fn config(&self) -> anyhow::Result<Config> {
        let s = &self.schema;
        let text = format!(
            r#"
[postgres]
url = "{pg}"
schema = "{s}"
application_name = "{s}"
max_connections = 8

[nats]
url = "{nats}"

[host]
shutdown_timeout = "10s"

[[consumer]]
name = "embedded-inventory"
stream = "{stream}"
subjects = ["{s}.inventory"]
create_stream = true
plugin = "{plugin}"
tables = ["inventory"]
max_in_flight = 4
dead_letter_subject = "{s}.dlq.inventory"

[[consumer]]
name = "embedded-orders"
stream = "{stream}"
subjects = ["{s}.orders"]
create_stream = true
tables = ["embedded_order"]
max_in_flight = 4
dead_letter_subject = "{s}.dlq.orders"
"#,
            pg = self.pg_url,
            nats = self.nats_url,
            stream = self.stream(),
            plugin = self.plugin,
        );
        Ok(Config::from_toml(
            &text,
            std::iter::empty(),
            "embedding.toml".as_ref(),
            ".".as_ref(),
        )?)
    }

    fn stream(&self) -> String {
        self.schema.to_uppercase()
    }
}

/// The program's own tables, made before the host's first start (the plugin roles are granted
/// the tables that exist then).
async fn prepare(pool: &PgPool, schema: &str) -> anyhow::Result<()> {
    for statement in [
        format!("CREATE SCHEMA IF NOT EXISTS {schema}"),
        format!(
            "CREATE TABLE IF NOT EXISTS {schema}.inventory (sku text PRIMARY KEY, \
             available bigint NOT NULL, reserved bigint NOT NULL)"
        ),
        format!(
            "INSERT INTO {schema}.inventory VALUES ('sku-1', 1000000, 0) ON CONFLICT DO NOTHING"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {schema}.embedded_order (message_id text PRIMARY KEY, \
             body text NOT NULL)"
        ),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(pool)
            .await?;
    }
    Ok(())
}

/// Drops what a run of the program made: its schema, the plugin roles the host provisioned for
/// the schema's consumers (`idemhost_<schema>_…`), the stream. Best effort.
async fn clean_up(o: &Options) {
    let Ok(admin) = PgPoolOptions::new()
        .max_connections(1)
        .connect(&o.pg_url)
        .await
    else {
        return;
    };
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {} CASCADE",
        o.schema
    )))
    .execute(&admin)
    .await;
    let roles: Vec<String> =
        sqlx::query_scalar("SELECT rolname::text FROM pg_roles WHERE starts_with(rolname, $1)")
            .bind(format!("idemhost_{}_", o.schema))
            .fetch_all(&admin)
            .await
            .unwrap_or_default();
    for role in roles {
        let statement = format!("DROP ROLE \"{}\"", role.replace('"', "\"\""));
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&admin)
            .await;
    }
    admin.close().await;
    if let Ok(client) = async_nats::connect(&o.nats_url).await {
        let _ = async_nats::jetstream::new(client)
            .delete_stream(o.stream())
            .await;
    }
}

/// The names of this process's threads.
fn threads() -> BTreeSet<(u64, String)> {
    let mut out = BTreeSet::new();
    if let Ok(entries) = std::fs::read_dir("/proc/self/task") {
        for entry in entries.flatten() {
            let tid = entry.file_name().to_string_lossy().parse().unwrap_or(0);
            let name = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            out.insert((tid, name.trim().to_string()));
        }
    }
    out
}

/// Threads made since `before`, leaving out the SQL gate's parsers: the process's own,
/// started once at the first plugin statement and kept for every later host.
fn new_threads(before: &BTreeSet<(u64, String)>) -> Vec<String> {
    threads()
        .difference(before)
        .filter(|(_, name)| !name.starts_with("idemhost-sql-ga"))
        .map(|(tid, name)| format!("{name} ({tid})"))
        .collect()
}

/// Polls `left` until it reports nothing or `within` passes; what it reported last.
async fn settles<T: Default + PartialEq, F: Future<Output = anyhow::Result<T>>>(
    within: Duration,
    mut left: impl FnMut() -> F,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + within;
    loop {
        let now = left().await?;
        if now == T::default() || Instant::now() > deadline {
            return Ok(now);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn run(o: &Options) -> anyhow::Result<()> {
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(
            o.pg_url
                .parse::<PgConnectOptions>()?
                .application_name("embedding-program"),
        )
        .await
        .context("connecting to PostgreSQL")?;
    prepare(&admin, &o.schema).await?;
    let nats = async_nats::connect(&o.nats_url)
        .await
        .context("connecting to NATS")?;
    let js = async_nats::jetstream::new(nats.clone());

    // The program's metrics: one registry of its own, and the host's families beside it.
    let mut registry = Registry::default();
    let runs_total = Counter::<u64>::default();
    registry.register(
        "embedding_host_runs",
        "Host runs started",
        runs_total.clone(),
    );
    let host_metrics = HostMetrics::new();

    let runtime = tokio::runtime::Handle::current();
    let tasks_before_all = runtime.metrics().num_alive_tasks();
    let threads_before_all = threads();
    for run in 0..o.runs {
        let tasks_before = runtime.metrics().num_alive_tasks();
        let threads_before = threads();
        // The program's shutdown signal, which the host shares.
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut stopped_rx = stopped.clone();
        let host = Host::new(o.config()?)
            .with_handler("embedded-orders", Arc::new(OrderRecorder))
            .with_metrics(&host_metrics);
        runs_total.inc();
        let running = tokio::spawn(host.run(RunOptions::default(), async move {
            let _ = stopped_rx.wait_for(|s| *s).await;
        }));
        for k in 0..o.messages {
            for (subject, body) in [
                (
                    format!("{}.inventory", o.schema),
                    format!(
                        r#"{{"id":"i-{run}-{k}","orderId":"o-{run}-{k}","sku":"sku-1","quantity":1}}"#
                    ),
                ),
                (format!("{}.orders", o.schema), format!("order {run}-{k}")),
            ] {
                let mut headers = async_nats::HeaderMap::new();
                let id = format!("{subject}-{run}-{k}");
                headers.insert("Nats-Msg-Id", id.as_str());
                // The stream may not exist until the host made it.
                let deadline = Instant::now() + Duration::from_secs(60);
                loop {
                    match js
                        .publish_with_headers(subject.clone(), headers.clone(), body.clone().into())
                        .await
                    {
                        Ok(ack) => match ack.await {
                            Ok(_) => break,
                            Err(e) if Instant::now() > deadline => bail!("publishing: {e}"),
                            Err(_) => {}
                        },
                        Err(e) if Instant::now() > deadline => bail!("publishing: {e}"),
                        Err(_) => {}
                    }
                    if running.is_finished() {
                        bail!("the host stopped: {:?}", running.await);
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        let want = (o.messages * (run + 1)) as i64;
        let applied = settles(Duration::from_secs(60), || async {
            let counts: (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT (SELECT count(*) FROM {s}.processed_message \
                 WHERE consumer_name = 'embedded-inventory'), \
                 (SELECT count(*) FROM {s}.embedded_order)",
                s = o.schema
            )))
            .fetch_one(&admin)
            .await?;
            // Nothing left to wait for once both reached what was sent.
            Ok(i64::from(counts != (want, want)))
        })
        .await?;
        if applied != 0 {
            bail!("run {run}: not every message was applied within 60 s");
        }
        let _ = stop.send(true);
        running.await.context("the host's task")??;

        // What the run left behind: sessions (every one the host opened is named after the
        // schema, the plugin roles' too), tasks on this runtime, threads of this process.
        let sessions = settles(Duration::from_secs(5), || async {
            Ok(sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE application_name = $1",
            )
            .bind(&o.schema)
            .fetch_one(&admin)
            .await?)
        })
        .await?;
        let tasks = settles(Duration::from_secs(5), || async {
            Ok(runtime
                .metrics()
                .num_alive_tasks()
                .saturating_sub(tasks_before))
        })
        .await?;
        // Blocking-pool threads the host's loads used end after the runtime's keep-alive.
        let threads_left = settles(Duration::from_secs(15), || async {
            Ok(new_threads(&threads_before))
        })
        .await?;
        println!(
            "run {run}: applied {want} and {want}; left behind: {sessions} sessions, {tasks} tasks, {} threads",
            threads_left.len()
        );
        if sessions != 0 || tasks != 0 || !threads_left.is_empty() {
            bail!(
                "run {run} left behind {sessions} PostgreSQL sessions, {tasks} tasks and threads {threads_left:?}"
            );
        }
    }
    println!(
        "after {} runs: {} tasks and {} threads more than before the first (the SQL gate's parsers excepted)",
        o.runs,
        runtime
            .metrics()
            .num_alive_tasks()
            .saturating_sub(tasks_before_all),
        new_threads(&threads_before_all).len()
    );

    // One exposition: the host's families, then the program's own (its `# EOF` ends both).
    let mut own = String::new();
    prometheus_client::encoding::text::encode(&mut own, &registry)?;
    let exposition = format!("{}{own}", host_metrics.families());
    for line in exposition.lines().filter(|l| {
        l.starts_with("embedding_host_runs_total")
            || (l.starts_with("idemhost_deliveries_total") && l.contains("outcome=\"applied\""))
    }) {
        println!("{line}");
    }
    nats.drain().await.ok();
    admin.close().await;
    Ok(())
}

fn main() -> std::process::ExitCode {
    let options = match Options::parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e:#}");
            return std::process::ExitCode::from(2);
        }
    };
    // The program's runtime; the host runs on it like any other task. A short keep-alive
    // for blocking threads, so that what a run used ends soon after it.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_keep_alive(Duration::from_secs(1))
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: failed to start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let result = run(&options).await;
        if options.clean_up {
            clean_up(&options).await;
        }
        result
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
