//! Bad input from the broker that the e2e tests do not cover: a header block that is not
//! UTF-8 (which the NATS client cannot read at all), a megabyte-sized id, and an event type the
//! plugin does not know. Each ends with every good message applied exactly once, proven by SQL,
//! and the bad one dead-lettered with its reason.

use std::time::{Duration, Instant};

use crate::common::*;
use idemhost::{ClaimSettings, Claimer, Host, Isolation, Outcome};

const CONSUMER: &str = "inventory-reservation-v1";

/// The header of a dead letter, as text.
fn header_of(headers: &async_nats::HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .map(|v| v.as_str().to_string())
        .unwrap_or_default()
}

/// An inventory consumer that gives up quickly (1 s `ack_wait`, 2 deliveries), with stock.
async fn inventory_host(tag: &str) -> (TestEnv, NatsEnv, RunningHost) {
    let env = TestEnv::new(tag).await;
    env.seed_inventory(&[("sku-1", 1000)]).await;
    let nats = NatsEnv::new(tag, Duration::from_secs(60)).await;
    let host = RunningHost::start(Host::new(config(
        &env,
        &nats,
        CONSUMER,
        "inventory",
        "max_in_flight = 4\nack_wait = \"1s\"\nmax_deliver = 2",
    )));
    (env, nats, host)
}

/// A header block that is not UTF-8 makes the client drop the connection each time the message
/// is delivered, so the host never sees it. The server stops one delivery after `max_deliver`;
/// the host keeps that advisory in a stream, fetches the stored message through the raw API
/// and dead-letters it with the reason (headers copied with the bad bytes replaced). Good
/// messages around it apply exactly once; the consumer drains.
#[tokio::test]
async fn non_utf8_headers_are_dead_lettered_and_the_rest_applies_once() {
    let (env, nats, host) = inventory_host("badhdr").await;
    nats.publish_many(good_orders(0..50)).await;
    let started = Instant::now();
    let bad_payload = order_payload("evt-binary", "sku-1", 1);
    publish_raw(
        NATS_URL.trim_start_matches("nats://"),
        &nats.subject(),
        b"Nats-Msg-Id: evt-binary\r\nX-Blob: \xff\xfe\x80 binary\r\n",
        bad_payload.as_bytes(),
    )
    .await;
    // JetStream refuses header blocks over 64 KiB ("header size exceeds maximum allowed of
    // 64k"), so a megabyte id never reaches a consumer; the largest it stores is tested.
    let long_id = "x".repeat(60_000);
    nats.publish(Some(&long_id), &order_payload("long", "sku-1", 1))
        .await;
    nats.publish_many(good_orders(50..100)).await;

    let letters = wait_until(Duration::from_secs(60), "two dead letters", || async {
        let letters = nats.dead_letters().await;
        (letters.len() >= 2).then_some(letters)
    })
    .await;
    let recovered = started.elapsed();
    nats.wait_drained(CONSUMER, Duration::from_secs(60)).await;
    eprintln!("non-UTF-8 headers: dead-lettered {recovered:?} after the publish");

    assert_eq!(env.markers(CONSUMER).await, 100, "every good message, once");
    assert_eq!(env.reserved("sku-1").await, 100);
    let (binary, payload) = letters
        .iter()
        .find(|(h, _)| header_of(h, "Idemhost-Message-Id") == "evt-binary")
        .expect("the unreadable message is dead-lettered under its id");
    assert_eq!(payload, bad_payload.as_bytes());
    let reason = header_of(binary, "Idemhost-Failure-Reason");
    assert!(
        reason.contains("not valid NATS headers in UTF-8"),
        "{reason}"
    );
    assert!(reason.contains("delivered 3 times"), "{reason}");
    assert_eq!(
        header_of(binary, "X-Blob"),
        "\u{fffd}\u{fffd}\u{fffd} binary"
    );
    assert_eq!(
        header_of(binary, "Idemhost-Original-Subject"),
        nats.subject()
    );
    let long = letters
        .iter()
        .find(|(h, _)| header_of(h, "Idemhost-Message-Id").is_empty())
        .expect("the over-long id is dead-lettered");
    assert!(
        header_of(&long.0, "Idemhost-Failure-Reason")
            .contains("60000 bytes, over the 256-byte limit"),
        "{:?}",
        header_of(&long.0, "Idemhost-Failure-Reason")
    );
    assert_eq!(letters.len(), 2, "each bad message dead-lettered once");
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// Waits (up to `within`) for `n` markers, then: the consumer drained, `n` markers and `n`
/// reserved units (one effect each), nothing dead-lettered.
async fn applied_once_each(env: &TestEnv, nats: &NatsEnv, n: i64, within: Duration) {
    wait_until(within, &format!("{n} messages applied"), || async {
        (env.markers(CONSUMER).await >= n).then_some(())
    })
    .await;
    nats.wait_drained(CONSUMER, Duration::from_secs(60)).await;
    assert_eq!(env.markers(CONSUMER).await, n);
    assert_eq!(env.reserved("sku-1").await, n, "each applied once");
    assert!(
        nats.dead_letters().await.is_empty(),
        "nothing dead-lettered"
    );
}

/// A bare carriage return inside a header value (`X-Note: a\rb`): async-nats 0.51 panicked
/// the connection task on it (any publisher could cut the consumer's connection, each time the
/// message was delivered); from 0.52 the client reads it with a space in its place. The message
/// is handled like any other — applied once, not dead-lettered — and the good ones around it too.
#[tokio::test]
async fn a_carriage_return_in_a_header_value_is_read_not_fatal() {
    let (env, nats, host) = inventory_host("crhdr").await;
    nats.publish_many(good_orders(0..20)).await;
    publish_raw(
        NATS_URL.trim_start_matches("nats://"),
        &nats.subject(),
        b"Nats-Msg-Id: evt-cr\r\nX-Note: a\rb\r\n",
        order_payload("evt-cr", "sku-1", 1).as_bytes(),
    )
    .await;
    nats.publish_many(good_orders(20..40)).await;
    applied_once_each(&env, &nats, 41, Duration::from_secs(30)).await;
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// A producer that writes its own status line into a message's header block (`NATS/1.0 404 No
/// Messages`, `408`, `409`, `423`, `100 Idle Heartbeat`: what the server uses to end or
/// annotate a pull request) must not be able to end the host's pull requests each time the
/// message comes, stalling the consumer: they are messages like the others, and every one is
/// applied once, the good ones around them too.
#[tokio::test]
async fn status_lines_forged_by_a_producer_do_not_stall_the_consumer() {
    let (env, nats, host) = inventory_host("fakestatus").await;
    nats.publish_many(good_orders(0..20)).await;
    let forged = [
        "404 No Messages",
        "408 Request Timeout",
        "409 Consumer Deleted",
        "423 Nats-Pin-Id mismatch",
        "100 Idle Heartbeat",
        "503",
    ];
    for (i, status) in forged.iter().enumerate() {
        let id = format!("evt-status-{i}");
        let block = format!("NATS/1.0 {status}\r\nNats-Msg-Id: {id}\r\n\r\n");
        publish_raw_block(
            NATS_URL.trim_start_matches("nats://"),
            &nats.subject(),
            block.as_bytes(),
            order_payload(&id, "sku-1", 1).as_bytes(),
        )
        .await;
    }
    nats.publish_many(good_orders(20..40)).await;
    // Before the host read them as messages, this waited in vain: every forged line ended its
    // pull request and dropped what followed it until `ack_wait` (default 30 s) brought it back.
    applied_once_each(&env, &nats, 46, Duration::from_secs(20)).await;
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// An event type a routing plugin does not know is a terminal failure before any effect (the
/// pipeline dead-letters terminal failures, see `e2e.rs`): no marker is left behind.
#[tokio::test]
async fn an_event_type_the_plugin_does_not_know_is_terminal() {
    let env = TestEnv::new("unknown_type").await;
    let plugin = load_plugin("order-reservation", Duration::from_secs(5));
    let consumer = "order-reservation-v1";
    let c = Claimer::new(
        env.pool.clone(),
        ClaimSettings::new(consumer, Isolation::ReadCommitted),
    );
    let mut m = message("evt-shipped", r#"{"orderId":"o-1"}"#);
    m.event_type = Some("OrderShipped".into());
    let p = c.process(plugin.as_ref(), &m).await;
    assert!(
        matches!(&p.outcome, Outcome::TerminalFailure(r) if r.contains("unexpected event type OrderShipped")),
        "{p:?}"
    );
    assert_eq!(env.markers(consumer).await, 0);
    env.cleanup().await;
}

/// The claim goes to PostgreSQL with its values as bound parameters of the host's claim
/// function: ids made to break out of SQL stay data, are claimed once and are duplicates the
/// second time; an id PostgreSQL cannot store (a NUL) is refused by the server (22021,
/// terminal) with no marker and no effect.
#[tokio::test]
async fn ids_that_look_like_sql_stay_data() {
    let env = TestEnv::new("sql_ids").await;
    env.seed_inventory(&[("sku-1", 1_000)]).await;
    let plugin = load_plugin("testkit", Duration::from_secs(5));
    let consumer = "testkit-v1";
    let c = Claimer::new(
        env.pool.clone(),
        ClaimSettings::new(consumer, Isolation::ReadCommitted),
    );
    let reserve = r#"{"steps":[{"execute":"UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"}]}"#;
    let ids = [
        "o'brien",
        "back\\slash\\",
        "x'); DELETE FROM processed_message; --",
        "E'\\'';",
        "$1 $2 $3",
        "ünïcødé ✓",
        "dollar $$ quoted $q$",
    ];
    for id in ids {
        let first = c.process(plugin.as_ref(), &message(id, reserve)).await;
        assert_eq!(first.outcome, Outcome::Applied, "{id}: {first:?}");
        let again = c.process(plugin.as_ref(), &message(id, reserve)).await;
        assert_eq!(again.outcome, Outcome::Duplicate, "{id}: {again:?}");
    }
    let stored: Vec<String> = sqlx::query_scalar(
        "SELECT message_id FROM processed_message WHERE consumer_name = $1 ORDER BY message_id",
    )
    .bind(consumer)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let mut expected: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
    expected.sort();
    let mut stored_sorted = stored.clone();
    stored_sorted.sort();
    assert_eq!(stored_sorted, expected, "each id stored exactly as sent");
    assert_eq!(env.reserved("sku-1").await, ids.len() as i64);

    let nul = c
        .process(plugin.as_ref(), &message("nul\0id", reserve))
        .await;
    assert!(
        matches!(&nul.outcome, Outcome::TerminalFailure(r) if r.contains("22021")),
        "{nul:?}"
    );
    assert_eq!(env.markers(consumer).await, ids.len() as i64);
    assert_eq!(env.reserved("sku-1").await, ids.len() as i64);
    drop(c);
    env.cleanup().await;
}
