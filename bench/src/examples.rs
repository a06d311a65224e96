//! What the benchmark examples share: the bench schema (1,000 SKUs), the bench stream of N
//! OrderPlaced events, a one-consumer config, and the process's CPU time and peak RSS.

use async_nats::jetstream::{self, stream};
use idemhost::Config;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

pub const PG_URL: &str = "postgres://root@127.0.0.1:5432/test";
pub const NATS_URL: &str = "nats://127.0.0.1:4222";
pub const SCHEMA: &str = "bench_throughput";
pub const CONSUMER: &str = "inventory-reservation-v1";

#[allow(unused_imports)]
pub use crate::{cpu_time, peak_rss_mib};

/// Drops and recreates the bench schema with the seed's tables and 1,000 SKUs; a pool on it.
pub async fn reset_schema() -> anyhow::Result<PgPool> {
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(PG_URL)
        .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"
    )))
    .execute(&admin)
    .await?;
    admin.close().await;
    let options = PG_URL
        .parse::<sqlx::postgres::PgConnectOptions>()?
        .application_name("bench")
        .options([("search_path", SCHEMA)]);
    let pool = PgPoolOptions::new()
        .max_connections(20)
        .connect_with(options)
        .await?;
    crate::seed_tables(&pool, Some(SCHEMA), 1..=1000).await?;
    Ok(pool)
}

/// Recreates the bench stream and its dead-letter stream and publishes `n` OrderPlaced events.
pub async fn publish_all(js: &jetstream::Context, n: usize) -> anyhow::Result<()> {
    publish_all_replicated(js, n, 1).await
}

/// [`publish_all`] into streams of `num_replicas` copies (a cluster's R3).
pub async fn publish_all_replicated(
    js: &jetstream::Context,
    n: usize,
    num_replicas: usize,
) -> anyhow::Result<()> {
    let _ = js.delete_stream("BENCH").await;
    let _ = js.delete_stream("BENCH_DLQ").await;
    for (name, subject) in [("BENCH", "bench.orders"), ("BENCH_DLQ", "bench.dlq")] {
        js.create_stream(stream::Config {
            name: name.into(),
            subjects: vec![subject.into()],
            num_replicas,
            ..Default::default()
        })
        .await?;
    }
    let mut pending = Vec::new();
    for i in 0..n {
        let id = format!("evt-{i}");
        let payload = format!(
            r#"{{"id":"{id}","orderId":"order-{i}","sku":"sku-{}","quantity":1}}"#,
            1 + i % 1000
        );
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id.as_str());
        pending.push(
            js.publish_with_headers("bench.orders", headers, payload.into_bytes().into())
                .await?,
        );
        if pending.len() >= 512 {
            for p in pending.drain(..) {
                p.await?;
            }
        }
    }
    for p in pending {
        p.await?;
    }
    Ok(())
}

/// One consumer of the bench stream; `top` adds top-level tables (`[admin]`, `[host]`).
pub fn config(in_flight: u32, plugin: Option<String>, top: &str) -> anyhow::Result<Config> {
    let plugin = plugin
        .map(|p| format!("plugin = \"{p}\"\n"))
        .unwrap_or_default();
    // `KEEP_RESIDENT=16MiB` compares the instance pool's reset budget (`plugins.keep_resident`).
    let top = match std::env::var("KEEP_RESIDENT") {
        Ok(size) => format!("{top}\n[plugins]\nkeep_resident = \"{size}\"\n"),
        Err(_) => top.to_string(),
    };
    let text = format!(
        "[nats]\nurl = \"{NATS_URL}\"\n[postgres]\nurl = \"{PG_URL}\"\nschema = \"{SCHEMA}\"\nmax_connections = {}\n\
         [[consumer]]\ntables = [\"*\"]\npublish_subjects = [\">\"]\nname = \"{CONSUMER}\"\nstream = \"BENCH\"\nsubjects = [\"bench.orders\"]\n{plugin}\
         max_in_flight = {in_flight}\ndead_letter_subject = \"bench.dlq\"\n{top}",
        in_flight + 2
    );
    Ok(Config::from_toml(
        &text,
        std::iter::empty(),
        "bench.toml".as_ref(),
        ".".as_ref(),
    )?)
}
