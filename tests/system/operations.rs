//! What an operator sees at `/metrics`: the counters after a known mix of outcomes, and the
//! sampled broker backlog and marker growth.

use std::time::Duration;

use crate::common::*;

const CONSUMER: &str = "metrics-v1";

/// Two applied, one duplicate, one terminal failure, one retryable failure that runs out of
/// attempts: the counters say exactly that, with the consumer, event type and outcome labels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_a_known_mix_of_outcomes() {
    let env = TestEnv::new("metrics").await;
    let nats = NatsEnv::new("metrics", Duration::from_millis(100)).await;
    let admin = format!("127.0.0.1:{}", free_port());
    let text = config_text(
        &env,
        &nats,
        CONSUMER,
        "testkit",
        "max_deliver = 2\nbackoff = [\"10ms\"]",
    ) + &format!("\n[admin]\nlisten = \"{admin}\"\n");
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    let ok = r#"{"steps":[]}"#;
    nats.publish(Some("a1"), ok).await;
    nats.publish(Some("a2"), ok).await;
    nats.publish(Some("t1"), r#"{"steps":[{"fail":"terminal"}]}"#)
        .await;
    nats.publish(Some("r1"), r#"{"steps":[{"fail":"retryable"}]}"#)
        .await;
    tokio::time::sleep(Duration::from_millis(150)).await; // past the broker's dedupe window
    nats.publish(Some("a1"), ok).await;
    nats.wait_drained(CONSUMER, Duration::from_secs(30)).await;

    let text = scrape(&admin).await;
    let deliveries = |outcome: &str| {
        let labels =
            format!("consumer=\"{CONSUMER}\",event_type=\"OrderPlaced\",outcome=\"{outcome}\"");
        sample(&text, "idemhost_deliveries_total", &labels).unwrap_or(0.0)
    };
    assert_eq!(deliveries("applied"), 2.0, "{text}");
    assert_eq!(deliveries("duplicate"), 1.0, "{text}");
    assert_eq!(deliveries("terminal_failure"), 1.0, "{text}");
    assert_eq!(deliveries("retryable_failure"), 2.0, "{text}");
    let consumer = format!("consumer=\"{CONSUMER}\"");
    let metric = |name: &str| sample(&text, name, &consumer).unwrap_or(-1.0);
    assert_eq!(metric("idemhost_dead_letters_total"), 2.0, "{text}");
    assert_eq!(metric("idemhost_redeliveries_total"), 1.0, "{text}");
    assert_eq!(metric("idemhost_in_flight"), 0.0, "{text}");
    assert_eq!(
        metric("idemhost_transaction_seconds_count"),
        6.0,
        "every processed delivery: {text}"
    );
    // The handler ran for a1, a2, t1 and twice for r1 — not for the duplicate.
    assert_eq!(metric("idemhost_handler_seconds_count"), 5.0, "{text}");
    assert_eq!(
        metric("idemhost_end_to_end_seconds_count"),
        3.0,
        "acked: {text}"
    );
    let digest = runtime()
        .load(
            &plugin_path("testkit"),
            idemhost::PluginLimits {
                timeout: Duration::from_secs(5),
                memory: 64 << 20,
            },
        )
        .unwrap()
        .digest()
        .to_string();
    let info = format!("consumer=\"{CONSUMER}\",digest=\"{digest}\"");
    assert_eq!(
        sample(&text, "idemhost_plugin_info", &info),
        Some(1.0),
        "{text}"
    );
    // Every handler call instantiated the plugin once.
    assert_eq!(
        sample(&text, "idemhost_plugin_instantiate_seconds_count", &info),
        Some(5.0),
        "{text}"
    );
    let rollbacks = |reason: &str| {
        let labels = format!("consumer=\"{CONSUMER}\",reason=\"{reason}\"");
        sample(&text, "idemhost_rollbacks_total", &labels).unwrap_or(-1.0)
    };
    assert_eq!(rollbacks("handler_terminal"), 1.0, "{text}");
    assert_eq!(rollbacks("handler_retryable"), 2.0, "{text}");
    assert_eq!(rollbacks("serialization_conflict"), 0.0, "{text}");
    assert_eq!(rollbacks("database_error"), 0.0, "{text}");
    assert_eq!(env.markers(CONSUMER).await, 2);
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// A message stuck in retries (nak'ed with a long backoff) shows as ack-pending, and the
/// oldest-unacknowledged age grows; marker rows and age are sampled from the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backlog_and_marker_growth_are_sampled() {
    const NAME: &str = "sampled-v1";
    let env = TestEnv::new("sampled").await;
    let nats = NatsEnv::new("sampled", Duration::from_secs(60)).await;
    let admin = format!("127.0.0.1:{}", free_port());
    let text = config_text(
        &env,
        &nats,
        NAME,
        "testkit",
        "max_deliver = 50\nbackoff = [\"1h\"]",
    ) + &format!(
        "\n[admin]\nlisten = \"{admin}\"\n[metrics]\nconsumer_interval = \"100ms\"\nmarker_interval = \"100ms\"\n"
    );
    // An old marker of this consumer, made by hand: its age is what the sampler must report.
    sqlx::query("INSERT INTO processed_message (consumer_name, message_id, processed_at) VALUES ($1, 'old', now() - interval '3 days')")
        .bind(NAME)
        .execute(&env.pool)
        .await
        .unwrap();
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    for id in ["s1", "s2", "s3"] {
        nats.publish(Some(id), r#"{"steps":[]}"#).await;
    }
    nats.publish(Some("stuck"), r#"{"steps":[{"fail_before_attempt":99}]}"#)
        .await;
    let consumer = format!("consumer=\"{NAME}\"");
    let text = wait_until(
        Duration::from_secs(30),
        "the samplers to see 4 markers and an unacked message older than 1s",
        || async {
            let text = scrape(&admin).await;
            let v = |name: &str| sample(&text, name, &consumer).unwrap_or(-1.0);
            (v("idemhost_markers") == 4.0
                && v("idemhost_ack_pending") == 1.0
                && v("idemhost_oldest_unacked_seconds") >= 1.0)
                .then_some(text)
        },
    )
    .await;
    let v = |name: &str| sample(&text, name, &consumer).unwrap_or(-1.0);
    assert_eq!(v("idemhost_pending"), 0.0, "{text}");
    let oldest_marker = v("idemhost_oldest_marker_seconds");
    assert!(
        (3.0 * 86_400.0..3.0 * 86_400.0 + 120.0).contains(&oldest_marker),
        "{text}"
    );
    assert!(v("idemhost_marker_bytes") > 0.0, "{text}");
    assert!(
        sample(&text, "idemhost_marker_table_bytes", "").unwrap_or(0.0) > 8192.0,
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "idemhost_sample_errors_total",
            "sampler=\"consumer\""
        ),
        None,
        "{text}"
    );
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}
