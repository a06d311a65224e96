//! End to end through the real NATS JetStream and PostgreSQL: the host pulls, claims, runs the
//! WASM plugin, commits, and acks (or naks, or dead-letters) — proven by SQL and by the
//! durable consumer's state.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use idemhost::{Config, Host};
use rand::seq::{IndexedRandom, SliceRandom};

const CONSUMER: &str = "inventory-reservation-v1";

/// 1,000 OrderPlaced with 20% duplicate ids in shuffled order: markers == distinct ids, the
/// reserved sum == distinct ids × quantity, everything acked and nothing redelivered.
#[tokio::test]
async fn thousand_orders_with_duplicates_apply_once_each() {
    let env = TestEnv::new("e2e1k").await;
    let skus: Vec<String> = (1..=20).map(|i| format!("sku-{i}")).collect();
    let seeds: Vec<(&str, i64)> = skus.iter().map(|s| (s.as_str(), 1_000_000)).collect();
    env.seed_inventory(&seeds).await;
    // The broker's own dedupe window is kept tiny, and duplicates are published in a later
    // batch than their original, so the host (not the broker) sees every duplicate.
    let window = Duration::from_millis(100);
    let nats = NatsEnv::new("e2e1k", window).await;

    // 10 batches of 100; 200 of the 900 slots after the first batch repeat a distinct id
    // from an earlier batch (never twice in one batch: the broker would drop that).
    let mut rng = rand::rng();
    let mut published: Vec<String> = Vec::new();
    let mut batches: Vec<Vec<String>> = Vec::new();
    let mut dup_slots: Vec<bool> = (0..900).map(|i| i < 200).collect();
    dup_slots.shuffle(&mut rng);
    let mut next_id = 0;
    for b in 0..10 {
        let dups = if b == 0 {
            0
        } else {
            dup_slots[(b - 1) * 100..b * 100]
                .iter()
                .filter(|d| **d)
                .count()
        };
        let mut batch: Vec<String> = published.choose_multiple(&mut rng, dups).cloned().collect();
        while batch.len() < 100 {
            batch.push(format!("evt-{next_id}"));
            next_id += 1;
        }
        published.extend(batch[dups..].iter().cloned());
        batch.shuffle(&mut rng);
        batches.push(batch);
    }
    let distinct: HashSet<&String> = batches.iter().flatten().collect();
    assert_eq!(distinct.len(), 800);

    let host = RunningHost::start(Host::new(config(
        &env,
        &nats,
        CONSUMER,
        "inventory",
        "max_in_flight = 8\nack_wait = \"5s\"",
    )));
    for batch in &batches {
        for id in batch {
            let sku = &skus[id.trim_start_matches("evt-").parse::<usize>().unwrap() % skus.len()];
            let ack = nats.publish(Some(id), &order_payload(id, sku, 2)).await;
            assert!(!ack.duplicate, "the broker must not drop {id}");
        }
        tokio::time::sleep(window * 3 + Duration::from_millis(50)).await;
    }

    let info = nats
        .wait_drained(&nats_durable(), Duration::from_secs(120))
        .await;
    assert_eq!(info.delivered.stream_sequence, 1000);
    assert_eq!(env.markers(CONSUMER).await, 800);
    assert_eq!(
        env.scalar("SELECT sum(reserved)::bigint FROM inventory")
            .await,
        1600
    );
    assert_eq!(
        env.scalar("SELECT sum(available)::bigint FROM inventory")
            .await,
        20 * 1_000_000 - 1600
    );
    // Nothing is redelivered after everything was acked (ack_wait 5s has passed by then).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let after = nats.consumer_info(&nats_durable()).await;
    assert_eq!(after.delivered.consumer_sequence, 1000, "no redeliveries");
    assert_eq!(after.num_redelivered, 0);
    assert_eq!(after.num_ack_pending, 0);
    assert!(nats.dead_letters().await.is_empty());

    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

fn nats_durable() -> String {
    CONSUMER.to_string()
}

/// A Python plugin (componentize-py links the interpreter as 38 core modules in one component)
/// runs at its consumer's `max_in_flight`: every delivery is applied at its first attempt.
/// When the instance pool allowed 8 core instances per component, 3 Python instances fitted at
/// `max_in_flight = 8` and the other deliveries trapped ("maximum concurrent limit ... for core
/// instances reached"), were nak'ed and came back a second later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_plugin_runs_at_its_consumers_concurrency() {
    let env = TestEnv::new("e2epy").await;
    env.seed_inventory(&[("sku-1", 1_000)]).await;
    let nats = NatsEnv::new("e2epy", Duration::from_millis(100)).await;
    // One delivery per transaction: 8 handlers, so 8 instances, at once.
    let host = RunningHost::start(Host::new(config(
        &env,
        &nats,
        CONSUMER,
        "inventory-py",
        "max_in_flight = 8\nbatch_max = 1\nack_wait = \"30s\"",
    )));
    let n = 96;
    for i in 0..n {
        let id = format!("evt-{i}");
        nats.publish(Some(&id), &order_payload(&id, "sku-1", 1))
            .await;
    }
    let info = nats
        .wait_drained(&nats_durable(), Duration::from_secs(120))
        .await;
    // Deliveries counted by the broker, redeliveries included (`num_redelivered` counts only
    // the unacknowledged ones).
    assert_eq!(
        info.delivered.consumer_sequence, n,
        "every message delivered once, applied at its first attempt"
    );
    assert_eq!(env.markers(CONSUMER).await, n as i64);
    assert_eq!(env.reserved("sku-1").await, n as i64);
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// Terminal failures (unknown SKU, malformed JSON), a payload over `max_payload` and refused ids
/// (missing, empty, too long)
/// are dead-lettered with the original id, headers and payload plus the reason, then
/// terminated; none leaves a marker or an effect.
#[tokio::test]
async fn terminal_failures_are_dead_lettered_with_reason() {
    let env = TestEnv::new("e2edlq").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let nats = NatsEnv::new("e2edlq", Duration::from_secs(60)).await;
    let host = RunningHost::start(Host::new(config(
        &env,
        &nats,
        CONSUMER,
        "inventory",
        "max_in_flight = 4\nmax_payload = \"64KiB\"",
    )));

    nats.publish(Some("evt-nosku"), &order_payload("evt-nosku", "sku-404", 1))
        .await;
    let huge = format!(
        r#"{{"id":"evt-huge","orderId":"o","sku":"sku-1","quantity":1,"pad":"{}"}}"#,
        "x".repeat(200_000)
    );
    nats.publish(Some("evt-huge"), &huge).await;
    nats.publish(Some("evt-bad"), "{ not json").await;
    nats.publish(None, &order_payload("none", "sku-1", 1)).await;
    nats.publish(Some(&"x".repeat(300)), &order_payload("long", "sku-1", 1))
        .await;
    nats.publish(Some("evt-ok"), &order_payload("evt-ok", "sku-1", 1))
        .await;

    nats.wait_drained(CONSUMER, Duration::from_secs(30)).await;
    let letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 5, "{}", letters.len());
    let reason_of = |id: Option<&str>| {
        letters
            .iter()
            .find(|(h, r)| h.get("Idemhost-Message-Id").map(|v| v.as_str()) == id && !r.is_empty())
            .and_then(|(h, _)| {
                h.get("Idemhost-Failure-Reason")
                    .map(|v| v.as_str().to_string())
            })
            .unwrap_or_default()
    };
    assert!(
        reason_of(Some("evt-nosku"))
            .contains("Unknown SKU or insufficient inventory for order-evt-nosku")
    );
    assert!(reason_of(Some("evt-bad")).contains("malformed OrderPlaced"));
    assert!(
        reason_of(Some("evt-huge")).contains("is 200")
            && reason_of(Some("evt-huge"))
                .contains("over the consumer's max_payload of 65536 bytes"),
        "{}",
        reason_of(Some("evt-huge"))
    );
    let refused: Vec<String> = letters
        .iter()
        .filter(|(h, _)| h.get("Idemhost-Message-Id").is_none())
        .map(|(h, _)| {
            h.get("Idemhost-Failure-Reason")
                .unwrap()
                .as_str()
                .to_string()
        })
        .collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(
        refused
            .iter()
            .any(|r| r.contains("missing message id header Nats-Msg-Id")),
        "{refused:?}"
    );
    assert!(
        refused
            .iter()
            .any(|r| r.contains("300 bytes, over the 256-byte limit")),
        "{refused:?}"
    );
    let (headers, payload) = letters
        .iter()
        .find(|(h, _)| h.get("Idemhost-Message-Id").map(|v| v.as_str()) == Some("evt-nosku"))
        .unwrap();
    assert_eq!(payload, order_payload("evt-nosku", "sku-404", 1).as_bytes());
    assert_eq!(
        headers.get("Idemhost-Event-Type").map(|v| v.as_str()),
        Some("OrderPlaced")
    );
    assert_eq!(
        headers
            .get("Nats-Msg-Id")
            .map(|v| v.as_str())
            .and_then(|v| v.rsplit_once('/'))
            .map(|(prefix, seq)| (prefix, seq.parse::<u64>().is_ok())),
        Some(("inventory-reservation-v1/evt-nosku", true))
    );
    assert_eq!(
        headers.get("Idemhost-Consumer").map(|v| v.as_str()),
        Some(CONSUMER)
    );
    assert_eq!(
        headers.get("Idemhost-Original-Subject").map(|v| v.as_str()),
        Some(nats.subject().as_str())
    );

    assert_eq!(env.markers(CONSUMER).await, 1, "only evt-ok");
    assert_eq!(env.reserved("sku-1").await, 1);
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// A retryable failure is nak'ed with backoff and redelivered; the attempt that succeeds
/// applies once. Out of attempts (`max_deliver`), the message is dead-lettered.
#[tokio::test]
async fn retryable_failures_are_redelivered_then_applied_or_dead_lettered() {
    let env = TestEnv::new("e2eretry").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let nats = NatsEnv::new("e2eretry", Duration::from_secs(60)).await;
    let host = RunningHost::start(Host::new(config(
        &env,
        &nats,
        "testkit-v1",
        "testkit",
        "max_in_flight = 2\nmax_deliver = 3\nbackoff = [\"50ms\", \"100ms\"]",
    )));
    let reserve =
        r#"{"execute":"UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"}"#;
    nats.publish(
        Some("evt-third-time"),
        &format!(r#"{{"steps":[{reserve},{{"fail_before_attempt":3}}]}}"#),
    )
    .await;
    nats.publish(
        Some("evt-never"),
        &format!(r#"{{"steps":[{reserve},{{"fail_before_attempt":99}}]}}"#),
    )
    .await;

    let info = nats
        .wait_drained("testkit-v1", Duration::from_secs(30))
        .await;
    assert_eq!(info.delivered.consumer_sequence, 6, "3 deliveries each");
    assert_eq!(
        env.scalar("SELECT count(*) FROM processed_message WHERE message_id = 'evt-third-time'")
            .await,
        1
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM processed_message WHERE message_id = 'evt-never'")
            .await,
        0
    );
    assert_eq!(
        env.reserved("sku-1").await,
        1,
        "failed attempts left no effect"
    );
    let letters = nats.dead_letters().await;
    assert_eq!(letters.len(), 1);
    let reason = letters[0]
        .0
        .get("Idemhost-Failure-Reason")
        .unwrap()
        .as_str()
        .to_string();
    assert!(
        reason.contains("attempt 3 < 99") && reason.contains("after 3 deliveries"),
        "{reason}"
    );
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// A dead letter carries PostgreSQL's SQLSTATE when a statement's failure dead-lettered it,
/// from the statement through the handler's answer to the broker: a check violation the handler
/// passed on as retryable, out of attempts (23514); a division by zero the handler answered
/// with its own terminal error (22012, at once). A handler's own failure with no statement
/// behind it carries none, and a producer's forged header is not passed on as the host's word.
#[tokio::test]
async fn a_dead_letter_carries_the_sqlstate_of_the_statement_that_failed() {
    let env = TestEnv::new("e2esqlstate").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let nats = NatsEnv::new("e2esqlstate", Duration::from_secs(60)).await;
    let host = RunningHost::start(Host::new(config(
        &env,
        &nats,
        "testkit-v1",
        "testkit",
        "max_in_flight = 2\nmax_deliver = 2\nbackoff = [\"50ms\"]\nbatch_max = 1",
    )));
    let forged = |id: &str, payload: &str| {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id);
        headers.insert("Idemhost-Failure-Sqlstate", "00000");
        (headers, payload.to_string())
    };
    nats.publish_many([
        forged(
            "evt-check",
            r#"{"steps":[{"execute":"UPDATE inventory SET reserved = -1 WHERE sku = 'sku-1'"}]}"#,
        ),
        forged(
            "evt-zero",
            r#"{"keep_going":true,"steps":[{"query":"SELECT 1/0"},{"fail":"terminal","reason":"gave up"}]}"#,
        ),
        forged(
            "evt-own",
            r#"{"steps":[{"fail":"terminal","reason":"not mine"}]}"#,
        ),
    ])
    .await;
    nats.wait_drained("testkit-v1", Duration::from_secs(30))
        .await;
    let letters = nats.dead_letters().await;
    let header = |id: &str, name: &str| {
        letters
            .iter()
            .find(|(h, _)| h.get("Idemhost-Message-Id").map(|v| v.as_str()) == Some(id))
            .unwrap_or_else(|| panic!("no dead letter of {id}"))
            .0
            .get_all(name)
            .map(|v| v.as_str().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(letters.len(), 3);
    assert_eq!(header("evt-check", "Idemhost-Failure-Sqlstate"), ["23514"]);
    assert_eq!(header("evt-check", "Idemhost-Delivery-Attempt"), ["2"]);
    assert_eq!(header("evt-zero", "Idemhost-Failure-Sqlstate"), ["22012"]);
    assert_eq!(header("evt-zero", "Idemhost-Delivery-Attempt"), ["1"]);
    assert!(header("evt-zero", "Idemhost-Failure-Reason")[0].contains("gave up"));
    assert_eq!(
        header("evt-own", "Idemhost-Failure-Sqlstate"),
        Vec::<String>::new()
    );
    assert_eq!(env.reserved("sku-1").await, 0);
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// Stopping the host in the middle of a run loses and doubles nothing: what committed is
/// acked, what did not is redelivered to the restarted host.
#[tokio::test]
async fn shutdown_mid_run_loses_and_doubles_nothing() {
    let env = TestEnv::new("e2estop").await;
    env.seed_inventory(&[("sku-1", 1_000_000)]).await;
    let nats = NatsEnv::new("e2estop", Duration::from_secs(60)).await;
    for i in 0..400 {
        let id = format!("evt-{i}");
        nats.publish(Some(&id), &order_payload(&id, "sku-1", 1))
            .await;
    }
    let cfg = config(
        &env,
        &nats,
        CONSUMER,
        "inventory",
        "max_in_flight = 4\nack_wait = \"3s\"",
    );
    let host = RunningHost::start(Host::new(cfg.clone()));
    wait_until(Duration::from_secs(30), "some progress", || async {
        (env.markers(CONSUMER).await >= 100).then_some(())
    })
    .await;
    host.stop().await;
    let at_stop = env.markers(CONSUMER).await;
    assert!(at_stop < 400, "stopped mid-run ({at_stop})");

    let host = RunningHost::start(Host::new(cfg));
    nats.wait_drained(CONSUMER, Duration::from_secs(60)).await;
    assert_eq!(env.markers(CONSUMER).await, 400);
    assert_eq!(env.reserved("sku-1").await, 400);
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// The same pipeline runs a native Rust handler registered by an embedding program.
#[tokio::test]
async fn native_handler_runs_through_the_same_pipeline() {
    let env = TestEnv::new("e2enative").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let nats = NatsEnv::new("e2enative", Duration::from_millis(100)).await;
    let mut cfg = config(&env, &nats, CONSUMER, "inventory", "");
    cfg.consumers[0].plugin = None;
    let admin = format!("127.0.0.1:{}", free_port());
    cfg.admin.listen = Some(admin.clone());
    let host = RunningHost::start(
        Host::new(cfg).with_handler(CONSUMER, Arc::new(idemhost_bench::NativeInventory)),
    );
    let get = |path: &str| {
        let url = format!("http://{admin}{path}");
        async move { idemhost::ops::admin::probe(&url, Duration::from_secs(5)).await }
    };
    wait_ready(&admin, Duration::from_secs(20)).await;
    get("/healthz").await.unwrap();
    let not_found = get("/nope").await.unwrap_err();
    assert!(not_found.contains("HTTP/1.1 404"), "{not_found}");
    // A native handler is listed, and cannot be swapped.
    let url = format!("http://{admin}/plugins");
    let listed = idemhost::ops::admin::request("GET", &url, &[], &[], Duration::from_secs(5))
        .await
        .unwrap();
    assert!(
        listed.body.contains("\"swappable\": false"),
        "{}",
        listed.body
    );
    assert!(
        listed.body.contains("\"digest\": \"native:"),
        "{}",
        listed.body
    );
    nats.publish(Some("evt-1"), &order_payload("evt-1", "sku-1", 2))
        .await;
    nats.publish(Some("evt-2"), &order_payload("evt-2", "sku-404", 1))
        .await;
    tokio::time::sleep(Duration::from_millis(150)).await; // past the broker's dedupe window
    nats.publish(Some("evt-1"), &order_payload("evt-1", "sku-1", 2))
        .await;
    nats.wait_drained(CONSUMER, Duration::from_secs(30)).await;
    assert_eq!(env.markers(CONSUMER).await, 1);
    assert_eq!(env.reserved("sku-1").await, 2);
    assert_eq!(nats.dead_letters().await.len(), 1);
    host.stop().await;
    let stopped = get("/healthz").await.unwrap_err();
    assert!(
        stopped.contains("cannot connect"),
        "the endpoint stops with the host: {stopped}"
    );
    nats.cleanup().await;
    env.cleanup().await;
}

/// A consumer whose subjects would match its own dead-letter subject in the same stream is
/// refused at start-up instead of consuming its dead letters.
#[tokio::test]
async fn consuming_own_dead_letters_is_refused() {
    let env = TestEnv::new("e2eowndlq").await;
    let nats = NatsEnv::new("e2eowndlq", Duration::from_secs(60)).await;
    let mut cfg = config(&env, &nats, CONSUMER, "inventory", "");
    cfg.consumers[0].subjects = vec![format!("{}.>", nats.prefix)];
    let err = start_error(cfg).await;
    assert!(err.contains("would consume its own dead letters"), "{err}");
    nats.cleanup().await;
    env.cleanup().await;
}

/// A consumer with several `subjects`: on NATS 2.10 and newer one durable consumer with
/// `filter_subjects` receives exactly those subjects; on an older server (which would ignore
/// the field and deliver the whole stream) the host refuses to start, says why, and leaves the
/// durable of an earlier run with one subject as it was. The server matrix runs this on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_subjects_are_one_consumer_from_nats_2_10() {
    let env = TestEnv::new("e2esubjects").await;
    env.execute("CREATE TABLE subject_effect (subject text NOT NULL)")
        .await;
    let nats = NatsEnv::new("e2esubjects", Duration::from_secs(60)).await;
    let subject = |s: &str| format!("{}.orders.{s}", nats.prefix);
    let mut cfg = config(&env, &nats, "subjects-v1", "testkit", "");
    cfg.consumers[0].subjects = vec![subject("placed"), subject("cancelled")];
    let version = nats.js.client().server_info().version;
    if idemhost::test_support::partition::server_at_least(&nats.client, (2, 10)).is_err() {
        // The consumer ran before with one subject and applied a message: the refused start
        // must leave its durable, and so its position in the stream, as it was.
        let mut one = cfg.clone();
        one.consumers[0].subjects.truncate(1);
        let host = RunningHost::start(Host::new(one));
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", "subjects-before");
        let script = r#"{"steps":[{"execute":"INSERT INTO subject_effect VALUES ('placed')"}]}"#;
        nats.js
            .publish_with_headers(subject("placed"), h, script.into())
            .await
            .unwrap()
            .await
            .unwrap();
        let before = nats
            .wait_drained("subjects-v1", Duration::from_secs(30))
            .await;
        host.stop().await;
        let err = start_error(cfg).await;
        assert!(err.contains("needs a NATS server 2.10 or newer"), "{err}");
        let stream = nats.js.get_stream(&nats.stream).await.unwrap();
        let after = stream
            .consumer_info("subjects-v1")
            .await
            .expect("the refused start left the durable");
        assert_eq!(
            (
                after.ack_floor.stream_sequence,
                &after.config.filter_subject
            ),
            (
                before.ack_floor.stream_sequence,
                &before.config.filter_subject
            ),
            "the durable's position and filter after the refusal"
        );
        assert_eq!(env.scalar("SELECT count(*) FROM subject_effect").await, 1);
    } else {
        let host = RunningHost::start(Host::new(cfg));
        for kind in ["placed", "cancelled", "shipped"] {
            let mut h = async_nats::HeaderMap::new();
            h.insert("Nats-Msg-Id", format!("subjects-{kind}").as_str());
            let script = format!(
                r#"{{"steps":[{{"execute":"INSERT INTO subject_effect VALUES ($1)","params":["{kind}"]}}]}}"#
            );
            nats.js
                .publish_with_headers(subject(kind), h, script.into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
        wait_until(Duration::from_secs(30), "both subjects handled", || async {
            (env.scalar("SELECT count(*) FROM subject_effect").await >= 2).then_some(())
        })
        .await;
        nats.wait_drained("subjects-v1", Duration::from_secs(30))
            .await;
        let handled: Vec<String> =
            sqlx::query_scalar("SELECT subject FROM subject_effect ORDER BY subject")
                .fetch_all(&env.pool)
                .await
                .unwrap();
        assert_eq!(handled, ["cancelled", "placed"], "server {version}");
        host.stop().await;
    }
    println!("several subjects on nats-server {version}: checked");
    nats.cleanup().await;
    env.cleanup().await;
}

/// With `create_stream`, the dead-letter stream is named after the dead-letter subject: two
/// configurations of one consumer name with different dead-letter subjects (a demo and a
/// container of the same consumer, say) each get a stream capturing their own subject, instead
/// of the second finding the first's stream, which does not capture its subject, and nak'ing
/// its dead letters forever.
#[tokio::test]
async fn dead_letter_streams_follow_the_subject_not_the_consumer_name() {
    let env = TestEnv::new("dlqname").await;
    env.seed_inventory(&[("sku-1", 1)]).await;
    let nats = NatsEnv::new("dlqname", Duration::from_secs(60)).await;
    let mut dlq_streams = Vec::new();
    for (round, quantity) in [(1, 5), (2, 7)] {
        // Outside the test stream's `<prefix>.>`, so the host creates the dead-letter stream.
        let dlq = format!("{}_dlq{round}.inventory", nats.prefix);
        let text = format!(
            "[nats]\nurl = \"{NATS_URL}\"\n{}\n[[consumer]]\ntables = [\"*\"]\npublish_subjects = [\">\"]\nname = \"{CONSUMER}\"\nstream = \"{}\"\nsubjects = [\"{}\"]\nplugin = \"{}\"\ndead_letter_subject = \"{dlq}\"\ncreate_stream = true\n",
            env.postgres_toml(),
            nats.stream,
            nats.subject(),
            plugin_path("inventory").display(),
        );
        let config =
            Config::from_toml(&text, std::iter::empty(), "t.toml".as_ref(), ".".as_ref()).unwrap();
        let host = RunningHost::start(Host::new(config));
        let id = format!("evt-too-big-{round}");
        nats.publish(Some(&id), &order_payload(&id, "sku-1", quantity))
            .await;
        nats.wait_drained(CONSUMER, Duration::from_secs(30)).await;
        host.stop().await;
        let stream = nats.js.stream_by_subject(dlq.clone()).await.unwrap();
        let mut info = nats.js.get_stream(&stream).await.unwrap();
        assert_eq!(
            info.info().await.unwrap().state.messages,
            1,
            "{dlq} holds its dead letter"
        );
        dlq_streams.push(stream);
    }
    assert_ne!(dlq_streams[0], dlq_streams[1]);
    assert_eq!(env.markers(CONSUMER).await, 0);
    for s in dlq_streams {
        nats.js.delete_stream(&s).await.unwrap();
    }
    nats.cleanup().await;
    env.cleanup().await;
}

/// Runs a native-handler host with an admin endpoint on `cfg`, waits for `/readyz` 200, runs
/// `outage`, expects 503 naming `reason`, runs `recover`, and expects 200 again.
async fn readyz_through_outage(
    mut cfg: Config,
    outage: impl FnOnce(),
    reason: &str,
    recover: impl FnOnce(),
) {
    let admin = format!("127.0.0.1:{}", free_port());
    cfg.admin.listen = Some(admin.clone());
    let host = RunningHost::start(
        Host::new(cfg).with_handler(CONSUMER, Arc::new(idemhost_bench::NativeInventory)),
    );
    let readyz = format!("http://{admin}/readyz");
    let ready = || idemhost::ops::admin::probe(&readyz, Duration::from_secs(5));
    wait_ready(&admin, Duration::from_secs(20)).await;

    outage();
    let why = wait_until(Duration::from_secs(20), "/readyz 503", || async {
        ready().await.err()
    })
    .await;
    assert!(why.contains("503") && why.contains(reason), "{why}");

    recover();
    wait_until(
        Duration::from_secs(30),
        "/readyz 200 after recovery",
        || async { ready().await.ok() },
    )
    .await;
    host.stop().await;
}

/// `/readyz` follows the live connections, not only start-up: 200 while bound and connected,
/// 503 naming NATS while a (private) server is down, 200 again once the client reconnected.
#[tokio::test]
async fn readyz_reports_a_lost_nats_connection_and_recovers() {
    let env = TestEnv::new("readyz").await;
    let server = std::cell::RefCell::new(PrivateNats::start());
    let url = server.borrow().url();
    let nats = NatsEnv::at(&url, "readyz", Duration::from_secs(60)).await;
    let mut cfg = config(&env, &nats, CONSUMER, "inventory", "");
    cfg.nats.url = url;
    readyz_through_outage(
        cfg,
        || server.borrow_mut().kill(),
        "NATS disconnected",
        || server.borrow_mut().restart(),
    )
    .await;
    env.cleanup().await;
}

/// `/readyz` turns 503 naming PostgreSQL while a (private) server is down after an immediate
/// shutdown, and 200 again once it is back and the pool reconnected.
#[tokio::test]
async fn readyz_reports_a_lost_postgres_and_recovers() {
    let pg = PrivatePostgres::start();
    let nats = NatsEnv::new("readypg", Duration::from_secs(60)).await;
    let text = format!(
        "[nats]\nurl = \"{NATS_URL}\"\n[postgres]\nurl = \"{}\"\nacquire_timeout = \"500ms\"\n[[consumer]]\ntables = [\"*\"]\npublish_subjects = [\">\"]\nname = \"{CONSUMER}\"\nstream = \"{}\"\nsubjects = [\"{}\"]\ndead_letter_subject = \"{}\"\n",
        pg.url(),
        nats.stream,
        nats.subject(),
        nats.dlq(),
    );
    let cfg =
        Config::from_toml(&text, std::iter::empty(), "t.toml".as_ref(), ".".as_ref()).unwrap();
    readyz_through_outage(
        cfg,
        || pg.stop_immediate(),
        "PostgreSQL does not answer",
        || pg.start_again(),
    )
    .await;
    nats.cleanup().await;
}

/// `idemhost consumer pause --for 1m` (NATS 2.11+): while the consumer is paused on the server,
/// the running host gets none of its messages; `idemhost consumer resume` lets them through,
/// each applied once. On 2.9 / 2.10 the command refuses and says what to do instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_consumer_delivers_nothing_until_resumed() {
    let env = TestEnv::new("e2epause").await;
    env.seed_inventory(&[("sku-1", 1000)]).await;
    let nats = NatsEnv::new("e2epause", Duration::from_secs(60)).await;
    let text = config_text(&env, &nats, CONSUMER, "inventory", "");
    let file = std::env::temp_dir().join(format!("{}.toml", unique("e2epause")));
    std::fs::write(&file, &text).unwrap();
    let cli = |verb: &str, extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_idemhost"))
            .args(["consumer", verb, "--config", file.to_str().unwrap()])
            .args(["--consumer", CONSUMER])
            .args(extra)
            .output()
            .unwrap()
    };
    let host = RunningHost::start(Host::new(parse_config(&text)));
    nats.publish_many(good_orders(0..1)).await;
    wait_until(Duration::from_secs(30), "the first order", || async {
        (env.markers(CONSUMER).await == 1).then_some(())
    })
    .await;
    let paused = cli("pause", &["--for", "1m"]);
    let said = String::from_utf8_lossy(&paused.stderr).into_owned()
        + &String::from_utf8_lossy(&paused.stdout);
    if idemhost::test_support::partition::server_at_least(&nats.client, (2, 11)).is_err() {
        assert!(!paused.status.success());
        assert!(said.contains("needs a NATS server 2.11 or newer"), "{said}");
    } else {
        assert!(paused.status.success(), "{said}");
        assert!(said.contains("paused until"), "{said}");
        nats.publish_many(good_orders(1..21)).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            env.markers(CONSUMER).await,
            1,
            "nothing delivered while paused"
        );
        let resumed = cli("resume", &[]);
        assert!(resumed.status.success());
        assert!(String::from_utf8_lossy(&resumed.stdout).contains("delivering"));
        wait_until(
            Duration::from_secs(30),
            "the 20 orders after resume",
            || async { (env.markers(CONSUMER).await == 21).then_some(()) },
        )
        .await;
        nats.wait_drained(CONSUMER, Duration::from_secs(30)).await;
        assert_eq!(env.reserved("sku-1").await, 21, "each applied once");
    }
    host.stop().await;
    let _ = std::fs::remove_file(&file);
    nats.cleanup().await;
    env.cleanup().await;
}
