//! The seed's order flow end to end through the real NATS and PostgreSQL: OrderPlaced →
//! inventory reservation (Rust plugin) → InventoryReserved → payment attempt (Python plugin) →
//! `payments.authorize` command → fake provider (native handler) → PaymentAuthorized → payment
//! confirmation (the Python plugin again, under its own consumer name) and notification (Rust
//! plugin); analytics (Rust plugin) reads OrderPlaced too. Every event crosses a hop through the
//! transactional outbox.

use idemhost_bench::order_flow as provider;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;

use crate::common::*;

const RESERVATION: &str = "inventory-reservation-v1";
const ANALYTICS: &str = "analytics-v1";
const PAYMENT: &str = "payment-authorization-v1";
const CONFIRMATION: &str = "payment-confirmation-v1";
const NOTIFICATION: &str = "notification-v1";
const SKUS: usize = 10;
const ALL: [&str; 6] = [
    RESERVATION,
    ANALYTICS,
    PAYMENT,
    CONFIRMATION,
    provider::CONSUMER,
    NOTIFICATION,
];

/// A schema with the example's tables and stock, and a host running the five consumers.
async fn order_flow(tag: &str) -> (TestEnv, NatsEnv, RunningHost, String) {
    let env = TestEnv::new(tag).await;
    env.execute(include_str!(
        "../../examples/order-flow/migrations/0002_order_flow.sql"
    ))
    .await;
    let stock: Vec<(String, i64)> = (0..SKUS).map(|i| (format!("sku-{i}"), 1_000_000)).collect();
    let stock: Vec<(&str, i64)> = stock.iter().map(|(s, n)| (s.as_str(), *n)).collect();
    env.seed_inventory(&stock).await;
    let nats = NatsEnv::new(tag, Duration::from_secs(120)).await;
    let p = &nats.prefix;
    let consumer = |name: &str, subjects: &[&str], plugin: Option<&str>| {
        let subjects: Vec<String> = subjects.iter().map(|s| format!("\"{p}.{s}\"")).collect();
        let plugin = plugin
            .map(|pl| format!("plugin = \"{}\"\n", plugin_path(pl).display()))
            .unwrap_or_default();
        format!(
            "\n[[consumer]]\ntables = [\"*\"]\npublish_subjects = [\">\"]\nname = \"{name}\"\nstream = \"{}\"\nsubjects = [{}]\n{plugin}\
             dead_letter_subject = \"{p}.dlq.{name}\"\nmax_in_flight = 4\nack_wait = \"5s\"\nbackoff = [\"50ms\"]\n",
            nats.stream,
            subjects.join(", ")
        )
    };
    let admin = format!("127.0.0.1:{}", free_port());
    let text = format!(
        "[nats]\nurl = \"{NATS_URL}\"\n{}max_connections = 26\n[host]\nshutdown_timeout = \"10s\"\n\
         [admin]\nlisten = \"{admin}\"\n[outbox]\npoll_interval = \"100ms\"\n",
        env.postgres_toml().replace("max_connections = 8\n", "")
    ) + &consumer(RESERVATION, &["orders.*"], Some("order-reservation"))
        + &consumer(ANALYTICS, &["orders.placed"], Some("order-analytics"))
        + &consumer(PAYMENT, &["inventory.reserved"], Some("order-payment-py"))
        + &consumer(
            CONFIRMATION,
            &["payments.authorized"],
            Some("order-payment-py"),
        )
        + &consumer(provider::CONSUMER, &["payments.authorize"], None)
        + &consumer(
            NOTIFICATION,
            &["payments.authorized"],
            Some("order-notification"),
        );
    let host = idemhost::Host::new(parse_config(&text))
        .with_handler(provider::CONSUMER, Arc::new(provider::FakeProvider));
    let host = RunningHost::start(host);
    // A cold compile cache (a fresh CI machine) makes start-up compile the Python component,
    // tens of seconds on 2 shared cores while the other tests run: the flow's own time limits
    // start once every consumer is bound.
    wait_ready(&admin, Duration::from_secs(300)).await;
    (env, nats, host, admin)
}

async fn publish(nats: &NatsEnv, subject: &str, id: &str, event_type: &str, payload: &str) {
    let mut h = async_nats::HeaderMap::new();
    h.insert("Nats-Msg-Id", id);
    h.insert("Idemhost-Event-Type", event_type);
    nats.js
        .publish_with_headers(
            format!("{}.{subject}", nats.prefix),
            h,
            payload.to_string().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

fn placed(order: &str, sku: &str, quantity: i64) -> String {
    format!(r#"{{"orderId":"{order}","sku":"{sku}","quantity":{quantity}}}"#)
}

/// Messages stored on `<prefix>.<subject>`: (broker id, whether it was injected as a
/// duplicate).
async fn stored(nats: &NatsEnv, subject: &str) -> Vec<(String, bool)> {
    let stored = nats.stored(&format!("{}.{subject}", nats.prefix)).await;
    stored
        .into_iter()
        .map(|(h, _)| {
            let id = h.get("Nats-Msg-Id").map(|v| v.as_str().to_string());
            (
                id.unwrap_or_default(),
                h.get("Idemhost-Test-Duplicate").is_some(),
            )
        })
        .collect()
}

/// Re-publishes one message in five seen on `<prefix>.>` (chosen by a hash of its id, so the
/// run is reproducible) as a second delivery of the same message: the original id as a signed
/// replay's (`key` is the host key), a fresh broker id — a duplicate at every hop of the flow.
async fn duplicator(nats: &NatsEnv, key: String) -> tokio::task::JoinHandle<()> {
    let mut sub = nats
        .client
        .subscribe(format!("{}.>", nats.prefix))
        .await
        .unwrap();
    let js = nats.js.clone();
    let dlq = format!("{}.dlq.", nats.prefix);
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            let Some(h) = m.headers.clone() else { continue };
            if h.get("Idemhost-Test-Duplicate").is_some() || m.subject.as_str().starts_with(&dlq) {
                continue;
            }
            let Some(id) = h.get("Nats-Msg-Id").map(|v| v.as_str().to_string()) else {
                continue;
            };
            let hash = id
                .bytes()
                .fold(7u32, |a, b| a.wrapping_mul(31).wrapping_add(b as u32));
            if hash % 5 != 0 {
                continue;
            }
            let mut copy = h.clone();
            copy.insert("Nats-Msg-Id", format!("dup/{id}").as_str());
            replayed(&mut copy, &key, &id);
            copy.insert("Idemhost-Test-Duplicate", "1");
            if let Ok(ack) = js
                .publish_with_headers(m.subject.clone(), copy, m.payload.clone())
                .await
            {
                let _ = ack.await;
            }
        }
    })
}

/// 500 orders, one delivery in five duplicated at every hop: exactly one reservation, payment
/// attempt, authorization, notification and analytics row per order; every outbox event
/// published once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_orders_with_duplicates_at_every_hop() {
    const ORDERS: usize = 500;
    let (env, nats, host, admin) = order_flow("orderflow").await;
    let dup = duplicator(&nats, env.host_key().await).await;
    let started = Instant::now();
    for i in 0..ORDERS {
        let payload = placed(
            &format!("o-{i}"),
            &format!("sku-{}", i % SKUS),
            1 + (i % 3) as i64,
        );
        publish(
            &nats,
            "orders.placed",
            &format!("evt-o-{i}"),
            "OrderPlaced",
            &payload,
        )
        .await;
    }
    let n = ORDERS as i64;
    wait_until(
        Duration::from_secs(300),
        "every order notified and every payment authorized",
        || async {
            let done = env.scalar("SELECT count(*) FROM notification").await == n
                && env
                    .scalar("SELECT count(*) FROM payment_attempt WHERE status = 'authorized'")
                    .await
                    == n
                && env.scalar("SELECT count(*) FROM order_analytics").await == n;
            done.then_some(())
        },
    )
    .await;
    let elapsed = started.elapsed();
    for c in ALL {
        nats.wait_drained(c, Duration::from_secs(60)).await;
    }
    wait_until(Duration::from_secs(30), "the outbox to empty", || async {
        (env.scalar("SELECT count(*) FROM outbox_message").await == 0).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    dup.abort();
    println!(
        "order flow: {ORDERS} orders through 6 consumers in {:.1}s ({:.0} orders/s, debug build)",
        elapsed.as_secs_f64(),
        ORDERS as f64 / elapsed.as_secs_f64()
    );

    for (table, what) in [
        ("inventory_reservation", "reservations"),
        ("payment_attempt", "payment attempts"),
        ("provider_authorization", "authorizations"),
        ("notification", "notifications"),
        ("order_analytics", "analytics rows"),
    ] {
        assert_eq!(
            env.scalar(&format!("SELECT count(*) FROM {table}")).await,
            n,
            "{what}"
        );
        assert_eq!(
            env.scalar(&format!("SELECT count(DISTINCT order_id) FROM {table}"))
                .await,
            n,
            "{what} per order"
        );
    }
    let quantities: i64 = (0..ORDERS).map(|i| 1 + (i % 3) as i64).sum();
    assert_eq!(
        env.scalar("SELECT sum(reserved)::bigint FROM inventory")
            .await,
        quantities
    );
    assert_eq!(
        env.scalar("SELECT sum(amount)::bigint FROM provider_authorization")
            .await,
        quantities * 1250
    );
    // One marker per message id per consumer; duplicates were delivered and absorbed.
    for c in ALL {
        assert_eq!(env.markers(c).await, n, "{c}");
    }
    for subject in [
        "orders.placed",
        "inventory.reserved",
        "payments.authorize",
        "payments.authorized",
    ] {
        let msgs = stored(&nats, subject).await;
        let originals: std::collections::HashSet<&str> =
            msgs.iter().filter(|m| !m.1).map(|m| m.0.as_str()).collect();
        let copies = msgs.iter().filter(|m| m.1).count();
        assert_eq!(
            msgs.iter().filter(|m| !m.1).count(),
            ORDERS,
            "{subject}: each event published once"
        );
        assert_eq!(originals.len(), ORDERS, "{subject}: distinct ids");
        assert!(
            (ORDERS / 10..ORDERS * 3 / 10).contains(&copies),
            "{subject}: {copies} duplicates injected"
        );
    }
    let metrics = scrape(&admin).await;
    let duplicates: f64 = metrics
        .lines()
        .filter(|l| {
            l.starts_with("idemhost_deliveries_total{") && l.contains("outcome=\"duplicate\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        duplicates >= (ORDERS * 4 / 10) as f64,
        "duplicate deliveries absorbed: {duplicates}"
    );
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// The same OrderPlaced fact under two message ids: both markers are admitted, the business
/// key `UNIQUE (order_id, sku)` admits one reservation — the second is acked as applied with
/// no effect and no event, not a crash loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semantic_duplicate_reserves_once() {
    let (env, nats, host, _) = order_flow("semantic").await;
    let fact = placed("o-same", "sku-1", 2);
    publish(&nats, "orders.placed", "evt-a", "OrderPlaced", &fact).await;
    publish(&nats, "orders.placed", "evt-b", "OrderPlaced", &fact).await;
    wait_until(Duration::from_secs(40), "the order notified", || async {
        (env.scalar("SELECT count(*) FROM notification").await == 1).then_some(())
    })
    .await;
    for c in ALL {
        nats.wait_drained(c, Duration::from_secs(60)).await;
    }
    assert_eq!(
        env.markers(RESERVATION).await,
        2,
        "both message ids admitted by the marker"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM inventory_reservation")
            .await,
        1
    );
    assert_eq!(env.reserved("sku-1").await, 2);
    assert_eq!(env.scalar("SELECT count(*) FROM payment_attempt").await, 1);
    assert_eq!(
        stored(&nats, "inventory.reserved").await.len(),
        1,
        "one event"
    );
    assert!(
        stored(&nats, &format!("dlq.{RESERVATION}"))
            .await
            .is_empty(),
        "nothing dead-lettered"
    );
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// OrderCancelled before its OrderPlaced: the cancellation is recorded, and the placement
/// that arrives later reserves nothing and publishes nothing (both are applied). A
/// cancellation after its placement releases the stock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancellation_before_its_order_wins() {
    let (env, nats, host, _) = order_flow("cancel").await;
    let cancel = r#"{"orderId":"o-early"}"#;
    publish(
        &nats,
        "orders.cancelled",
        "evt-c1",
        "OrderCancelled",
        cancel,
    )
    .await;
    nats.wait_drained(RESERVATION, Duration::from_secs(60))
        .await;
    publish(
        &nats,
        "orders.placed",
        "evt-p1",
        "OrderPlaced",
        &placed("o-early", "sku-2", 3),
    )
    .await;
    // And the usual order: placed, then cancelled.
    publish(
        &nats,
        "orders.placed",
        "evt-p2",
        "OrderPlaced",
        &placed("o-late", "sku-3", 4),
    )
    .await;
    nats.wait_drained(RESERVATION, Duration::from_secs(60))
        .await;
    wait_until(
        Duration::from_secs(120),
        "o-late's payment requested",
        || async { (env.scalar("SELECT count(*) FROM payment_attempt").await == 1).then_some(()) },
    )
    .await;
    publish(
        &nats,
        "orders.cancelled",
        "evt-c2",
        "OrderCancelled",
        r#"{"orderId":"o-late"}"#,
    )
    .await;
    nats.wait_drained(RESERVATION, Duration::from_secs(60))
        .await;

    assert_eq!(env.markers(RESERVATION).await, 4, "all four applied");
    let state = |order: &'static str| {
        let pool = env.pool.clone();
        async move {
            sqlx::query_as::<_, (String, i32)>(
                "SELECT status, version FROM order_state WHERE order_id = $1",
            )
            .bind(order)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(state("o-early").await, ("cancelled".to_string(), 1));
    assert_eq!(
        env.scalar("SELECT count(*) FROM inventory_reservation WHERE order_id = 'o-early'")
            .await,
        0,
        "the late OrderPlaced reserved nothing"
    );
    assert_eq!(env.reserved("sku-2").await, 0);
    assert_eq!(state("o-late").await, ("cancelled".to_string(), 2));
    assert_eq!(env.reserved("sku-3").await, 0, "released");
    assert_eq!(env.available("sku-3").await, 1_000_000);
    assert_eq!(
        env.scalar("SELECT count(*) FROM inventory_reservation WHERE order_id = 'o-late' AND status = 'released'").await,
        1
    );
    let events = stored(&nats, "inventory.reserved").await;
    assert_eq!(events.len(), 1, "only o-late was ever reserved: {events:?}");
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}
