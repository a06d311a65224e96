//! What an operator sees at `/metrics`: every series at zero before the first message, the
//! counters after a known mix of outcomes, the process and build series, the separate metrics
//! listener, the shipped dashboard, alerts and probes against the live exposition, and the
//! sampled broker backlog and marker growth.

use std::time::Duration;

use crate::common::*;

const CONSUMER: &str = "metrics-v1";

/// Before any message, every counter and histogram of the consumer is there at 0 (an absent
/// series is what a down host looks like); then two applied, one duplicate, one terminal
/// failure, one retryable failure that runs out of attempts: the counters say exactly that,
/// with the consumer, event type and outcome labels. The metrics listener serves `/metrics`
/// and nothing that deploys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_a_known_mix_of_outcomes() {
    let env = TestEnv::new("metrics").await;
    let nats = NatsEnv::new("metrics", Duration::from_millis(100)).await;
    let admin = format!("127.0.0.1:{}", free_port());
    let metrics_listen = format!("127.0.0.1:{}", free_port());
    let text = config_text(
        &env,
        &nats,
        CONSUMER,
        "testkit",
        // One delivery per transaction: in a group a failure runs the group's other parts again
        // (each instantiating the plugin again), so the counts would depend on how the
        // deliveries fell into groups.
        "max_deliver = 2\nbackoff = [\"10ms\"]\nbatch_max = 1",
    ) + &format!(
        "\n[admin]\nlisten = \"{admin}\"\ntoken = \"t0ken\"\n[metrics]\nlisten = \"{metrics_listen}\"\n"
    );
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    wait_ready(&admin, Duration::from_secs(30)).await;
    let before = scrape(&metrics_listen).await;
    let consumer = format!("consumer=\"{CONSUMER}\"");
    for outcome in [
        "applied",
        "duplicate",
        "retryable_failure",
        "terminal_failure",
    ] {
        let labels = format!("{consumer},event_type=\"other\",outcome=\"{outcome}\"");
        assert_eq!(
            sample(&before, "idemhost_deliveries_total", &labels),
            Some(0.0),
            "{outcome}: {before}"
        );
    }
    for name in [
        "idemhost_outbox_published_total",
        "idemhost_outbox_publish_errors_total",
        "idemhost_outbox_lag_seconds_count",
        "idemhost_end_to_end_seconds_count",
        "idemhost_dead_letters_total",
    ] {
        assert_eq!(
            sample(&before, name, &consumer),
            Some(0.0),
            "{name}: {before}"
        );
    }
    for sampler in ["consumer", "markers"] {
        let labels = format!("sampler=\"{sampler}\"");
        assert_eq!(
            sample(&before, "idemhost_sample_errors_total", &labels),
            Some(0.0),
            "{before}"
        );
    }
    // A backlog of a day lands in a bucket, not only in +Inf.
    let day = format!("le=\"86400.0\",{consumer}");
    assert_eq!(
        sample(&before, "idemhost_end_to_end_seconds_bucket", &day),
        Some(0.0),
        "{before}"
    );
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        before.contains(&format!("idemhost_build_info{{version=\"{version}\",")),
        "{before}"
    );
    let rss = sample(&before, "process_resident_memory_bytes", "").unwrap_or(0.0);
    assert!(rss > 1e6, "{before}");
    let fds = sample(&before, "process_open_fds", "").unwrap_or(0.0);
    assert!(
        fds >= 3.0 && fds <= sample(&before, "process_max_fds", "").unwrap(),
        "{before}"
    );
    assert!(sample(&before, "process_cpu_seconds_total", "").is_some_and(|s| s > 0.0));
    // The metrics listener neither lists nor deploys plugins, token or not.
    let plugins = format!("http://{metrics_listen}/plugins?consumer={CONSUMER}");
    let auth = [("Authorization", "Bearer t0ken")];
    for method in ["GET", "POST"] {
        let refused =
            idemhost::ops::admin::request_ok(method, &plugins, &auth, b"x", Duration::from_secs(5))
                .await
                .unwrap_err();
        assert!(refused.contains("404"), "{method}: {refused}");
    }
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
    // The separate listener serves the same exposition as the admin endpoint.
    let other = scrape(&metrics_listen).await;
    assert_eq!(
        sample(
            &other,
            "idemhost_deliveries_total",
            &format!("{consumer},event_type=\"OrderPlaced\",outcome=\"applied\"")
        ),
        Some(2.0),
        "{other}"
    );
    shipped_names_exist(&other);
    // The Kubernetes probes' paths answer on the metrics listener (the port they name).
    for path in crate::shipped::kubernetes_probe_paths() {
        let url = format!("http://{metrics_listen}{path}");
        idemhost::ops::admin::probe(&url, Duration::from_secs(5))
            .await
            .unwrap_or_else(|e| panic!("probe {path}: {e}"));
    }
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
    // The admin endpoint is bound while the host starts: scraping before it answers is refused.
    wait_ready(&admin, Duration::from_secs(30)).await;
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
        Some(0.0),
        "{text}"
    );
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// Every metric and label the shipped Grafana dashboard and Prometheus alert rules name is on
/// the live exposition `text` (a host that has applied, failed and dead-lettered): a renamed
/// metric or label fails here, not on an operator's empty panel or an alert that never fires.
/// `up`, `job` and `instance` are Prometheus's own.
fn shipped_names_exist(text: &str) {
    use std::collections::{BTreeMap, BTreeSet};
    let mut exposed: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let labels = exposed.entry(line[..name_end].to_string()).or_default();
        if let Some(inner) = line[name_end..].strip_prefix('{') {
            for pair in inner.split("\",") {
                if let Some((label, _)) = pair.split_once('=') {
                    labels.insert(label.trim().to_string());
                }
            }
        }
    }
    let prometheus_own = ["up", "job", "instance"];
    let expressions = crate::shipped::shipped_expressions();
    let mut wrong = Vec::new();
    for (at, expr) in &expressions {
        let (metrics, labels) = crate::shipped::promql_names(expr);
        assert!(!metrics.is_empty(), "{at}: no metric in {expr}");
        for m in metrics
            .iter()
            .filter(|m| !prometheus_own.contains(&m.as_str()))
        {
            if !exposed.contains_key(m) {
                wrong.push(format!("{at}: metric {m} is not exposed"));
            }
        }
        for l in labels
            .iter()
            .filter(|l| !prometheus_own.contains(&l.as_str()))
        {
            if !metrics
                .iter()
                .any(|m| exposed.get(m).is_some_and(|ls| ls.contains(l)))
            {
                wrong.push(format!("{at}: no metric of `{expr}` has the label {l}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}\n{text}");
}
