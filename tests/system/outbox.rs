//! The transactional outbox through the real NATS and PostgreSQL: an event published by a
//! handler leaves only when its delivery commits, under a broker id derived from (consumer,
//! source message id, position), with the causation id and trace context copied; a rolled-back
//! or duplicate delivery publishes nothing.

use std::time::Duration;

use crate::common::*;

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

    let metrics = scrape(&admin).await;
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

/// 1,000 rows to a subject no stream captures, committed before 100 good events: the good ones
/// arrive within seconds, the stuck ones back off and are set aside after `max_attempts` (listed
/// with their reason), the relay does not spin meanwhile, and `outbox retry` sends them once a
/// stream captures their subject.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stuck_rows_back_off_while_the_rows_behind_them_flow() {
    const STUCK: i64 = 1000;
    const GOOD: i64 = 100;
    let env = TestEnv::new("outbox_stuck").await;
    let nats = NatsEnv::new("outbox_stuck", Duration::from_secs(60)).await;
    let nowhere = format!("nowhere-{}", nats.prefix);
    let good = format!("{}.events.good", nats.prefix);
    env.execute(&format!(
        "INSERT INTO outbox_message (consumer_name, source_message_id, seq, subject, headers, payload) \
         SELECT 'stuck-v1', 'm-' || g, 0, '{nowhere}.' || g, '[]', 'x' FROM generate_series(1, {STUCK}) g"
    ))
    .await;
    env.execute(&format!(
        "INSERT INTO outbox_message (consumer_name, source_message_id, seq, subject, headers, payload) \
         SELECT 'good-v1', 'm-' || g, 0, '{good}', '[]', 'ok' FROM generate_series(1, {GOOD}) g"
    ))
    .await;
    let admin = format!("127.0.0.1:{}", free_port());
    let text = config_text(&env, &nats, NAME, "testkit", "")
        + &format!(
            "\n[admin]\nlisten = \"{admin}\"\n[outbox]\npoll_interval = \"200ms\"\nretry_base = \"500ms\"\nmax_attempts = 3\n"
        );
    let started = std::time::Instant::now();
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));

    // The good events arrive (measured, then asserted, so a run without the fix prints too).
    let mut arrived = None;
    while started.elapsed() < Duration::from_secs(15) {
        if events(&nats, &good).await.len() as i64 >= GOOD {
            arrived = Some(started.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // What the relay costs while only stuck rows are left.
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Passes, not scans: a pass reads the table once per consumer with due rows.
    let (passes_before, cpu_before) = (relay_passes(&admin).await, process_cpu());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (passes, cpu) = (
        relay_passes(&admin).await - passes_before,
        process_cpu() - cpu_before,
    );
    println!(
        "outbox relay: {GOOD} good events behind {STUCK} stuck rows arrived after {arrived:?}; \
         over 5 s with only stuck rows left: {passes} relay passes, {:.0} ms CPU of this test \
         process",
        cpu.as_secs_f64() * 1e3
    );
    let arrived = arrived.expect("the good events arrive within 15 s");
    assert!(arrived < Duration::from_secs(10), "{arrived:?}");
    assert_eq!(events(&nats, &good).await.len() as i64, GOOD, "once each");
    // A pass used to cost three scans of the table, and 200 scans were the bound.
    assert!(passes < 66, "the relay spins: {passes} passes in 5 s");

    let pool = env.pool.clone();
    let all = idemhost::ops::outbox::Filter::default();
    let listed = idemhost::ops::outbox::list(&pool, &all, 5000)
        .await
        .unwrap();
    assert_eq!(listed.len() as i64, STUCK, "every stuck row is listed");
    assert!(
        listed.iter().all(|r| r.set_aside && r.attempts == 3),
        "{:?}",
        &listed[0]
    );
    assert!(
        listed[0]
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains(&nowhere),
        "{:?}",
        listed[0]
    );

    // The operator's view: `idemhost outbox list` (JSON) and `outbox retry --id` through the
    // binary.
    let dir = std::env::temp_dir().join(unique("outbox_cli"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("idemhost.toml");
    std::fs::write(&file, &text).unwrap();
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemhost"))
            .args(args)
            .args(["--config", file.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let json: serde_json::Value =
        serde_json::from_str(&cli(&["outbox", "list", "--json", "--limit", "5000"])).unwrap();
    assert_eq!(json.as_array().unwrap().len() as i64, STUCK);
    let text_list = cli(&["outbox", "list", "--consumer", "stuck-v1", "--limit", "3"]);
    assert!(
        text_list.contains("set aside") && text_list.contains("3 row(s)"),
        "{text_list}"
    );
    let first = listed[0].id.to_string();
    assert!(cli(&["outbox", "retry", "--id", &first]).contains("1 set-aside row(s)"));
    wait_until(
        Duration::from_secs(10),
        "the retried row to fail again",
        || async {
            (env.scalar(&format!(
                "SELECT count(*) FROM outbox_message WHERE id = {first} AND attempts > 0"
            ))
            .await
                == 1)
                .then_some(())
        },
    )
    .await;
    std::fs::remove_dir_all(&dir).unwrap();
    wait_until(
        Duration::from_secs(10),
        "the retried row to be set aside again",
        || async {
            (env.scalar("SELECT count(*) FROM outbox_message WHERE set_aside_at IS NOT NULL")
                .await
                == STUCK)
                .then_some(())
        },
    )
    .await;

    // A stream now captures the subject: retry sends every set-aside row, once.
    let capture = format!("{}_NOWHERE", nats.stream);
    nats.js
        .create_stream(async_nats::jetstream::stream::Config {
            name: capture.clone(),
            subjects: vec![format!("{nowhere}.>")],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        idemhost::ops::outbox::retry(&pool, &all).await.unwrap(),
        STUCK as u64
    );
    wait_until(
        Duration::from_secs(30),
        "the retried rows to be published",
        || async { (env.scalar("SELECT count(*) FROM outbox_message").await == 0).then_some(()) },
    )
    .await;
    assert_eq!(stored_in(&nats.js, &capture).await as i64, STUCK);
    nats.js.delete_stream(&capture).await.unwrap();
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// Messages stream `name` holds.
async fn stored_in(js: &async_nats::jetstream::Context, name: &str) -> u64 {
    let mut stream = js.get_stream(name).await.unwrap();
    stream.info().await.unwrap().state.messages
}

/// CPU time (user + system) this process used so far.
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    // utime and stime: fields 14 and 15 of stat(5), 12 and 13 after the command name.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

/// A broker that stops answering (a private `nats-server` SIGSTOPped) fails the publishes by
/// timeout: the pass is an error, and no row counts an attempt — an outage sets nothing aside.
/// Once the server answers again (and a stream captures the subject) the rows leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_does_not_answer_counts_no_attempt() {
    use idemhost::test_support::relay::{Retry, drain};
    let env = TestEnv::new("outbox_outage").await;
    let subject = format!("{}.events", unique("outage"));
    env.execute(&format!(
        "INSERT INTO outbox_message (consumer_name, source_message_id, seq, subject, headers, payload) \
         SELECT 'outage-v1', 'm-' || g, 0, '{subject}', '[]', 'x' FROM generate_series(1, 5) g"
    ))
    .await;
    let nats = PrivateNats::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::ContextBuilder::new()
        .timeout(Duration::from_millis(500))
        .build(client);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "OUTAGE".into(),
        subjects: vec![subject.clone()],
        ..Default::default()
    })
    .await
    .unwrap();
    let retry = Retry {
        base: Duration::from_millis(10),
        cap: Duration::from_millis(10),
        max_attempts: 1,
    };
    let metrics = idemhost::test_support::Metrics::new();
    nats.signal(libc::SIGSTOP);
    for _ in 0..3 {
        let pass = drain(&env.pool, &js, &metrics, 256, retry).await;
        assert!(
            pass.is_err(),
            "a pass whose publishes timed out is an error"
        );
    }
    nats.signal(libc::SIGCONT);
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM outbox_message WHERE attempts = 0 AND set_aside_at IS NULL"
        )
        .await,
        5,
        "no attempt counted, nothing set aside"
    );
    wait_until(Duration::from_secs(20), "the rows to leave", || async {
        let _ = drain(&env.pool, &js, &metrics, 256, retry).await;
        (env.scalar("SELECT count(*) FROM outbox_message").await == 0).then_some(())
    })
    .await;
    assert_eq!(stored_in(&js, "OUTAGE").await, 5);
    env.cleanup().await;
}

/// The relay's passes so far, from the host's metrics.
async fn relay_passes(admin: &str) -> u64 {
    let metrics = scrape(admin).await;
    sample(&metrics, "idemhost_outbox_relay_passes_total", "")
        .unwrap_or_else(|| panic!("no relay pass counter in {metrics}")) as u64
}

/// A host whose relay passes only when notified (polling every 60 s, out of the way), started
/// and settled; its admin address, for `relay_passes`.
async fn notified_relay(env: &TestEnv, nats: &NatsEnv) -> (RunningHost, String) {
    let admin = format!("127.0.0.1:{}", free_port());
    let text = config_text(env, nats, NAME, "testkit", "")
        + &format!("\n[admin]\nlisten = \"{admin}\"\n[outbox]\npoll_interval = \"60s\"\n");
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    wait_ready(&admin, Duration::from_secs(20)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    (host, admin)
}

/// A row committed to the relay's own schema still wakes it, long before the next poll: it is
/// published once and leaves the table.
async fn a_commit_wakes_it(env: &TestEnv, nats: &NatsEnv) {
    let subject = format!("{}.events.woken", nats.prefix);
    env.execute(&format!(
        "INSERT INTO outbox_message (consumer_name, source_message_id, seq, subject, headers, payload) \
         VALUES ('woken-v1', 'm-1', 0, '{subject}', '[]', 'woken')"
    ))
    .await;
    wait_until(Duration::from_secs(5), "the row to leave", || async {
        (env.scalar("SELECT count(*) FROM outbox_message").await == 0).then_some(())
    })
    .await;
    assert_eq!(events(nats, &subject).await.len(), 1);
}

/// 1,000 notifications on the relay's channel in one transaction (distinct payloads, which
/// PostgreSQL does not fold; what a handler calling pg_notify can send) wake the relay for a
/// few passes, not one pass each; a row committed after them still wakes it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_notifications_costs_a_few_passes() {
    let env = TestEnv::new("outbox_burst").await;
    let nats = NatsEnv::new("outbox_burst", Duration::from_millis(200)).await;
    let (host, admin) = notified_relay(&env, &nats).await;

    let before = relay_passes(&admin).await;
    env.execute(&format!(
        "SELECT count(pg_notify('{}', g::text)) FROM generate_series(1, 1000) g",
        idemhost::test_support::relay::CHANNEL
    ))
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let passes = relay_passes(&admin).await - before;
    println!("1,000 notifications in one transaction: {passes} relay passes");
    assert!(passes <= 50, "{passes} relay passes for one burst");

    // Still woken by a commit, long before the next poll.
    a_commit_wakes_it(&env, &nats).await;
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// Hosts of other schemas in the same database share the relay's channel: 100 commits that
/// write another schema's outbox, one by one, wake this schema's relay for none of its passes
/// (the notification names its schema). Before, each woke it for a pass over its own table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_schemas_outbox_does_not_wake_this_relay() {
    let env = TestEnv::new("outbox_mine").await;
    let other = TestEnv::new("outbox_theirs").await;
    let nats = NatsEnv::new("outbox_mine", Duration::from_millis(200)).await;
    let (host, admin) = notified_relay(&env, &nats).await;

    let before = relay_passes(&admin).await;
    for i in 0..100 {
        other
            .execute(&format!(
                "INSERT INTO outbox_message (consumer_name, source_message_id, seq, subject, headers, payload) \
                 VALUES ('theirs-v1', 'm-{i}', 0, 'theirs.events', '[]', 'x')"
            ))
            .await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let passes = relay_passes(&admin).await - before;
    println!("100 commits to another schema's outbox: {passes} relay passes here");
    assert!(
        passes <= 3,
        "{passes} relay passes for another schema's commits"
    );

    // Its own schema's commit still wakes it at once.
    a_commit_wakes_it(&env, &nats).await;
    host.stop().await;
    nats.cleanup().await;
    other.cleanup().await;
    env.cleanup().await;
}
