//! The order flow's end-to-end rate and the outbox relay's lag: N orders published up front,
//! then one host runs the six consumers of the example (Rust, Python, native provider) and the
//! relay until every order is notified. Prints orders/s for the full chain (four hops, three of
//! them through the outbox) and the relay lag p50/p99 from `idemhost_outbox_lag_seconds`.
//!
//! `cargo run --release -p idemhost-bench --example order_flow_bench -- --n 2000 --in-flight 8`
//! (or `scripts/bench-order-flow.sh`). Not a test: figures vary ±15% run to run on this machine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use sqlx::postgres::PgPoolOptions;

use idemhost_bench::order_flow as provider;

const PG_URL: &str = "postgres://root@127.0.0.1:5432/test";
const NATS_URL: &str = "nats://127.0.0.1:4222";
const SCHEMA: &str = "bench_order_flow";
const STREAM: &str = "BENCH_FLOW";
const P: &str = "bflow";

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The `q` quantile of a Prometheus histogram summed over its label sets, interpolated
/// linearly within the bucket (as `histogram_quantile` does).
fn quantile(metrics: &str, name: &str, q: f64) -> Option<f64> {
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for line in metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}_bucket{{")))
    {
        let le = line.split("le=\"").nth(1)?.split('"').next()?;
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().ok()?
        };
        let count: f64 = line.rsplit(' ').next()?.parse().ok()?;
        match buckets.iter_mut().find(|b| b.0 == le) {
            Some(b) => b.1 += count,
            None => buckets.push((le, count)),
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for (le, cumulative) in buckets {
        if cumulative >= rank {
            if le.is_infinite() {
                return Some(lower);
            }
            let within = (rank - below) / (cumulative - below).max(1.0);
            return Some(lower + (le - lower) * within);
        }
        (lower, below) = (le, cumulative);
    }
    None
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n = arg("--n", 2000);
    let in_flight = arg("--in-flight", 8);
    let admin_pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(PG_URL)
        .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"
    )))
    .execute(&admin_pool)
    .await?;
    let options = PG_URL
        .parse::<sqlx::postgres::PgConnectOptions>()?
        .application_name("bench")
        .options([("search_path", SCHEMA)]);
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await?;
    idemhost_bench::seed_tables(&pool, Some(SCHEMA), 0..=9).await?;
    sqlx::raw_sql(include_str!(
        "../../examples/order-flow/migrations/0002_order_flow.sql"
    ))
    .execute(&pool)
    .await?;

    let client = async_nats::connect(NATS_URL).await?;
    let js = jetstream::new(client);
    let _ = js.delete_stream(STREAM).await;
    js.create_stream(stream::Config {
        name: STREAM.into(),
        subjects: vec![format!("{P}.>")],
        ..Default::default()
    })
    .await?;
    let mut acks = Vec::new();
    for i in 0..n {
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", format!("evt-{i}").as_str());
        h.insert("Idemhost-Event-Type", "OrderPlaced");
        let payload = format!(
            r#"{{"orderId":"o-{i}","sku":"sku-{}","quantity":1}}"#,
            i % 10
        );
        acks.push(
            js.publish_with_headers(format!("{P}.orders.placed"), h, payload.into())
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

    let dist = concat!(env!("CARGO_MANIFEST_DIR"), "/../plugins/dist");
    let consumer = |name: &str, subject: &str, plugin: Option<&str>| {
        let plugin = plugin
            .map(|p| format!("plugin = \"{dist}/{p}.wasm\"\n"))
            .unwrap_or_default();
        format!(
            "\n[[consumer]]\ntables = [\"*\"]\npublish_subjects = [\">\"]\nname = \"{name}\"\nstream = \"{STREAM}\"\nsubjects = [\"{P}.{subject}\"]\n{plugin}\
             dead_letter_subject = \"{P}.dlq.{name}\"\nmax_in_flight = {in_flight}\n"
        )
    };
    let admin = "127.0.0.1:19464";
    let text = format!(
        "[nats]\nurl = \"{NATS_URL}\"\n[postgres]\nurl = \"{PG_URL}\"\nschema = \"{SCHEMA}\"\nmax_connections = {}\n\
         [admin]\nlisten = \"{admin}\"\n[outbox]\npoll_interval = \"100ms\"\n",
        6 * in_flight + 4
    ) + &consumer(
        "inventory-reservation-v1",
        "orders.*",
        Some("order-reservation"),
    ) + &consumer("analytics-v1", "orders.placed", Some("order-analytics"))
        + &consumer(
            "payment-authorization-v1",
            "inventory.reserved",
            Some("order-payment-py"),
        )
        + &consumer(
            "payment-confirmation-v1",
            "payments.authorized",
            Some("order-payment-py"),
        )
        + &consumer(provider::CONSUMER, "payments.authorize", None)
        + &consumer(
            "notification-v1",
            "payments.authorized",
            Some("order-notification"),
        );
    let config = idemhost::Config::from_toml(
        &text,
        std::iter::empty(),
        "bench.toml".as_ref(),
        ".".as_ref(),
    )?;
    let host = idemhost::Host::new(config)
        .with_handler(provider::CONSUMER, Arc::new(provider::FakeProvider));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(host.run(idemhost::RunOptions::default(), async move {
        let _ = stopped.await;
    }));
    // Time from the host's readiness (plugins loaded, consumers bound).
    let ready = format!("http://{admin}/readyz");
    while idemhost::ops::admin::get(&ready, Duration::from_secs(1))
        .await
        .is_err()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = Instant::now();
    let deadline = started + Duration::from_secs(600);
    loop {
        let notified: i64 = sqlx::query_scalar("SELECT count(*) FROM notification")
            .fetch_one(&pool)
            .await?;
        if notified as usize >= n {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {notified} of {n} orders notified after 600 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    let metrics =
        idemhost::ops::admin::get(&format!("http://{admin}/metrics"), Duration::from_secs(5))
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    let _ = stop.send(());
    running.await??;
    let check: (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM inventory_reservation), (SELECT count(*) FROM provider_authorization), \
         (SELECT count(*) FROM payment_attempt WHERE status = 'authorized')",
    )
    .fetch_one(&pool)
    .await?;
    anyhow::ensure!(
        check == (n as i64, n as i64, n as i64),
        "effects {check:?} for {n} orders"
    );
    let lag = |q| quantile(&metrics, "idemhost_outbox_lag_seconds", q).map(|s| s * 1e3);
    let report = serde_json::json!({
        "orders": n,
        "max_in_flight": in_flight,
        "seconds": elapsed.as_secs_f64(),
        "orders_per_second": n as f64 / elapsed.as_secs_f64(),
        "deliveries_per_second": 6.0 * n as f64 / elapsed.as_secs_f64(),
        "outbox_lag_ms_p50": lag(0.5),
        "outbox_lag_ms_p99": lag(0.99),
    });
    println!(
        "order flow: {n} orders, 6 consumers at max_in_flight {in_flight}: {:.1} s, {:.0} orders/s ({:.0} deliveries/s); \
         outbox lag p50 {:.1} ms, p99 {:.1} ms",
        elapsed.as_secs_f64(),
        n as f64 / elapsed.as_secs_f64(),
        6.0 * n as f64 / elapsed.as_secs_f64(),
        lag(0.5).unwrap_or(f64::NAN),
        lag(0.99).unwrap_or(f64::NAN),
    );
    println!("{report}");
    Ok(())
}
