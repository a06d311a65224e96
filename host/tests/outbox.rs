//! The transactional outbox through the real NATS and PostgreSQL: an event published by a
//! handler leaves only when its delivery commits, under a broker id derived from (consumer,
//! source message id, position), with the causation id and trace context copied; a rolled-back
//! or duplicate delivery publishes nothing.

mod common;

use std::time::Duration;

use common::*;

const NAME: &str = "outbox-v1";

fn publish_step(subject: &str, payload: &str) -> String {
    format!(
        r#"{{"publish":"{subject}","payload":"{payload}","headers":[["Idemhost-Event-Type","ThingHappened"]]}}"#
    )
}

/// Every event stored on `subject`, as (headers, payload text).
async fn events(nats: &NatsEnv, subject: &str) -> Vec<(async_nats::HeaderMap, String)> {
    let stored = nats.stored(subject).await;
    stored
        .into_iter()
        .map(|(h, p)| (h, String::from_utf8_lossy(&p).to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_leave_only_with_their_commit() {
    let env = TestEnv::new("outbox").await;
    let nats = NatsEnv::new("outbox", Duration::from_millis(200)).await;
    env.execute("CREATE TABLE ob_errors (error text)").await;
    let admin = format!("127.0.0.1:{}", free_port());
    let text = config_text(&env, &nats, NAME, "testkit", "max_deliver = 1")
        + &format!("\n[admin]\nlisten = \"{admin}\"\n[outbox]\npoll_interval = \"50ms\"\n");
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    let out = format!("{}.events.thing", nats.prefix);
    let step = |payload: &str| publish_step(&out, payload);

    // One event, with the source's trace context.
    let mut h = async_nats::HeaderMap::new();
    h.insert("Nats-Msg-Id", "ok-1");
    h.insert(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    );
    let script = format!(r#"{{"steps":[{}]}}"#, step("first"));
    nats.js
        .publish_with_headers(nats.subject(), h, script.into())
        .await
        .unwrap()
        .await
        .unwrap();
    // Two events from one delivery.
    nats.publish(
        Some("ok-2"),
        &format!(r#"{{"steps":[{},{}]}}"#, step("second-a"), step("second-b")),
    )
    .await;
    // Published, then failed: rolled back with its event.
    nats.publish(
        Some("fail-1"),
        &format!(r#"{{"steps":[{},{{"fail":"terminal"}}]}}"#, step("never")),
    )
    .await;
    // Refused events are errors the handler sees, and fail the delivery.
    let refused = format!(
        r#"{{"keep_going":true,"steps":[{{"publish":"{out}","headers":[["Nats-Msg-Id","x"]]}},{{"publish":"a.*"}},{{"record_errors":"ob_errors"}}]}}"#
    );
    nats.publish(Some("refused-1"), &refused).await;
    nats.wait_drained(NAME, Duration::from_secs(30)).await;
    // ok-1 again past the broker's window: a duplicate, which publishes nothing.
    tokio::time::sleep(Duration::from_millis(300)).await;
    nats.publish(Some("ok-1"), &format!(r#"{{"steps":[{}]}}"#, step("again")))
        .await;
    nats.wait_drained(NAME, Duration::from_secs(30)).await;

    wait_until(
        Duration::from_secs(30),
        "the relay to publish 3 events",
        || async {
            let n = events(&nats, &out).await.len();
            (n >= 3 && env.scalar("SELECT count(*) FROM outbox_message").await == 0).then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await; // nothing more comes
    let got = events(&nats, &out).await;
    let summary: Vec<(String, String, String)> = got
        .iter()
        .map(|(h, p)| {
            let get = |k: &str| h.get(k).map(|v| v.as_str().to_string()).unwrap_or_default();
            (get("Nats-Msg-Id"), get("Idemhost-Causation-Id"), p.clone())
        })
        .collect();
    // Deliveries run concurrently, so ok-1 and ok-2 may commit in either order; one delivery's
    // events keep their order.
    let position = |payload: &str| summary.iter().position(|e| e.2 == payload);
    assert!(position("second-a") < position("second-b"), "{summary:?}");
    let mut summary = summary.clone();
    summary.sort();
    assert_eq!(
        summary,
        vec![
            ("outbox-v1/ok-1/0".into(), "ok-1".into(), "first".into()),
            ("outbox-v1/ok-2/0".into(), "ok-2".into(), "second-a".into()),
            ("outbox-v1/ok-2/1".into(), "ok-2".into(), "second-b".into()),
        ],
        "exactly the committed deliveries' events"
    );
    let first = &got.iter().find(|(_, p)| p == "first").unwrap().0;
    assert_eq!(
        first.get("traceparent").map(|v| v.as_str()),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    );
    assert_eq!(
        first.get("Idemhost-Event-Type").map(|v| v.as_str()),
        Some("ThingHappened")
    );
    // A refused event fails its delivery even though the handler swallowed the refusal:
    // nothing of it committed, and it was dead-lettered with the refusal as its reason.
    assert_eq!(env.scalar("SELECT count(*) FROM ob_errors").await, 0);
    assert_eq!(
        env.scalar("SELECT count(*) FROM processed_message WHERE message_id = 'refused-1'")
            .await,
        0
    );
    let letters = nats.dead_letters().await;
    let reason = letters
        .iter()
        .filter_map(|(h, _)| h.get("Idemhost-Failure-Reason").map(|v| v.to_string()))
        .find(|r| r.contains("refused"))
        .unwrap_or_default();
    assert!(
        reason.contains("Nats-Msg-Id is set by the host"),
        "{letters:?}"
    );

    let metrics =
        idemhost::admin::http::get(&format!("http://{admin}/metrics"), Duration::from_secs(5))
            .await
            .unwrap();
    let line = format!("idemhost_outbox_published_total{{consumer=\"{NAME}\"}} 3");
    assert!(metrics.lines().any(|l| l == line), "{metrics}");
    assert!(
        metrics.contains(&format!(
            "idemhost_outbox_lag_seconds_count{{consumer=\"{NAME}\"}} 3"
        )),
        "{metrics}"
    );
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}
