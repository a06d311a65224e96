//! What an operator sees: `/metrics` after a known mix of outcomes.

mod common;

use std::time::Duration;

use common::*;

const CONSUMER: &str = "metrics-v1";

/// The value of the sample `name{labels}` in an OpenMetrics exposition (labels in order).
fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
    let key = if labels.is_empty() {
        name.to_string()
    } else {
        format!("{name}{{{labels}}}")
    };
    text.lines()
        .find_map(|l| l.strip_prefix(&key)?.strip_prefix(' ')?.parse().ok())
}

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

    let url = format!("http://{admin}/metrics");
    let text = idemhost::admin::http::get(&url, Duration::from_secs(5))
        .await
        .unwrap();
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
    assert_eq!(env.markers(CONSUMER).await, 2);
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}
