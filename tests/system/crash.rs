//! The seed's seventh test and its siblings: the host *process* is SIGKILLed at a named
//! failpoint (after the claim, inside the handler, before the commit, after the commit but
//! before the ack), then restarted; by SQL, every message has exactly one effect. Needs `--features failpoints`.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::*;

const CONSUMER: &str = "inventory-reservation-v1";

fn write_config(env: &TestEnv, nats: &NatsEnv, dir: &Path, extra: &str) -> PathBuf {
    let text = format!(
        "[nats]\nurl = \"{NATS_URL}\"\n{}\n[host]\nshutdown_timeout = \"10s\"\nlog_format = \"json\"\n\n\
         [[consumer]]\ntables = [\"*\"]\npublish_subjects = [\">\"]\nname = \"{CONSUMER}\"\nstream = \"{}\"\nsubjects = [\"{}\"]\nplugin = \"{}\"\n\
         dead_letter_subject = \"{}\"\nmax_in_flight = 1\nack_wait = \"2s\"\n{extra}\n",
        env.postgres_toml(),
        nats.stream,
        nats.subject(),
        plugin_path("inventory").display(),
        nats.dlq(),
    );
    let path = dir.join("idemhost.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Kills the host at `failpoint` with 10 messages waiting, checks that `committed` of them
/// had committed, restarts it and checks every message has exactly one effect. `extra`: more
/// consumer keys (group commit).
async fn crash_then_recover(
    failpoint: &str,
    committed: std::ops::RangeInclusive<i64>,
    extra: &str,
) {
    let env = TestEnv::new(&format!("crash_{failpoint}")).await;
    env.seed_inventory(&[("sku-1", 100)]).await;
    let nats = NatsEnv::new(&format!("crash_{failpoint}"), Duration::from_millis(100)).await;
    let dir = std::env::temp_dir().join(unique("idemhost_crash"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = write_config(&env, &nats, &dir, extra);
    for i in 0..10 {
        let id = format!("evt-{i}");
        nats.publish(Some(&id), &order_payload(&id, "sku-1", 1))
            .await;
    }

    let mut host = spawn_host(&config, Some(failpoint), &dir.join("first.log"));
    let status = wait_exit(&mut host, Duration::from_secs(30)).await;
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "killed at {failpoint}: {status:?}"
    );
    let markers = env.markers(CONSUMER).await;
    assert!(
        committed.contains(&markers),
        "state at the crash ({failpoint}): {markers} markers"
    );
    assert_eq!(env.reserved("sku-1").await, markers);
    // Which message committed before the kill: deliveries run concurrently, so not
    // necessarily the first published.
    let committed: Vec<String> = sqlx::query_scalar(
        "SELECT message_id FROM processed_message WHERE consumer_name = $1 ORDER BY message_id",
    )
    .bind(CONSUMER)
    .fetch_all(&env.pool)
    .await
    .unwrap();

    let log = dir.join("second.log");
    let restarted = std::time::Instant::now();
    let mut host = spawn_host(&config, None, &log);
    nats.wait_drained(CONSUMER, Duration::from_secs(60)).await;
    eprintln!(
        "crash at {failpoint}: drained {:?} after the restart",
        restarted.elapsed()
    );
    assert_eq!(
        env.markers(CONSUMER).await,
        10,
        "after recovery ({failpoint})"
    );
    assert_eq!(
        env.reserved("sku-1").await,
        10,
        "one effect per message ({failpoint})"
    );
    assert_eq!(env.available("sku-1").await, 90);

    // Graceful stop: SIGTERM → exit 0.
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(host.id() as i32, libc::SIGTERM) };
    let status = wait_exit(&mut host, Duration::from_secs(30)).await;
    assert!(status.success(), "SIGTERM exits 0: {status:?}");

    let text = std::fs::read_to_string(&log).unwrap();
    let outcomes: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("outcome").is_some())
        .collect();
    let mut duplicates: Vec<&str> = outcomes
        .iter()
        .filter(|v| v["outcome"] == "duplicate")
        .filter_map(|v| v["span"]["message_id"].as_str())
        .collect();
    duplicates.sort_unstable();
    assert_eq!(
        duplicates, committed,
        "the redelivered committed message is a duplicate, acked"
    );
    assert_eq!(
        outcomes.len(),
        10,
        "one outcome line per delivery after the restart"
    );
    nats.cleanup().await;
    env.cleanup().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// 7. Crash after COMMIT, before the ack: the redelivery finds the marker, has no second
/// effect, and is acked.
#[tokio::test]
async fn crash_after_commit_before_ack_has_no_second_effect() {
    crash_then_recover("after_commit_before_ack", 1..=1, "").await;
}

/// Crash right after the claim: nothing committed; the redelivery applies once.
#[tokio::test]
async fn crash_after_claim_loses_nothing() {
    crash_then_recover("after_claim", 0..=0, "").await;
}

/// Crash inside the handler, after its statement ran in the transaction: nothing committed;
/// the redelivery applies once.
#[tokio::test]
async fn crash_inside_the_handler_loses_nothing() {
    crash_then_recover("in_handler", 0..=0, "").await;
}

/// Crash after the handler, before COMMIT: nothing committed; the redelivery applies once.
#[tokio::test]
async fn crash_before_commit_loses_nothing() {
    crash_then_recover("before_commit", 0..=0, "").await;
}

/// Group commit: a batch of up to 10 killed before its COMMIT leaves nothing; the restart
/// applies every message once.
#[tokio::test]
async fn crash_before_a_batch_commit_loses_nothing() {
    crash_then_recover("before_commit", 0..=0, "batch_max = 10").await;
}

/// Group commit: killed at the first ack after a batch committed, every message of the batch
/// is redelivered and acked as a duplicate, with no second effect.
#[tokio::test]
async fn crash_after_a_batch_commit_has_no_second_effect() {
    crash_then_recover("after_commit_before_ack", 1..=10, "batch_max = 10").await;
}

/// Events for the crash test: the source consumer publishes one per message; its payload is
/// the downstream consumer's script, recording the event once.
fn source_script(events: &str, i: usize) -> String {
    let downstream = format!(
        r#"{{"steps":[{{"execute":"INSERT INTO downstream_effect (event) VALUES ($1)","params":["e-{i}"]}}]}}"#
    );
    let step = serde_json::json!({"publish": events, "payload": downstream});
    format!(r#"{{"steps":[{step}]}}"#)
}

/// The relay SIGKILLed after publishing a batch and before deleting its rows: after the
/// restart it publishes them again under the same ids, and downstream there is still exactly
/// one event — and one effect — per source message.
#[tokio::test]
async fn crash_between_outbox_publish_and_delete_sends_each_event_once() {
    const SOURCE: &str = "outbox-source-v1";
    const DOWNSTREAM: &str = "outbox-downstream-v1";
    let env = TestEnv::new("crash_outbox").await;
    env.execute("CREATE TABLE downstream_effect (event text NOT NULL)")
        .await;
    let nats = NatsEnv::new("crash_outbox", Duration::from_secs(120)).await;
    let events = format!("{}.events.thing", nats.prefix);
    // A short ack_wait: deliveries in flight at the kill come back quickly.
    let text = config_text(&env, &nats, SOURCE, "testkit", "ack_wait = \"2s\"")
        + &format!(
            "\n[[consumer]]\ntables = [\"*\"]\npublish_subjects = [\">\"]\nname = \"{DOWNSTREAM}\"\nstream = \"{}\"\nsubjects = [\"{events}\"]\nplugin = \"{}\"\ndead_letter_subject = \"{}.dlq2\"\nack_wait = \"2s\"\n",
            nats.stream,
            plugin_path("testkit").display(),
            nats.prefix
        );
    let dir = std::env::temp_dir().join(unique("idemhost_crash_outbox"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("idemhost.toml");
    std::fs::write(&config, text).unwrap();
    for i in 0..10 {
        nats.publish(Some(&format!("src-{i}")), &source_script(&events, i))
            .await;
    }

    let mut host = spawn_host(
        &config,
        Some("outbox_after_publish"),
        &dir.join("first.log"),
    );
    let status = wait_exit(&mut host, Duration::from_secs(60)).await;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    let left = env.scalar("SELECT count(*) FROM outbox_message").await;
    assert!(left >= 1, "the published batch's rows are still there");

    let mut host = spawn_host(&config, None, &dir.join("second.log"));
    wait_until(
        Duration::from_secs(60),
        "every event applied downstream",
        || async {
            (env.markers(DOWNSTREAM).await == 10
                && env.scalar("SELECT count(*) FROM outbox_message").await == 0)
                .then_some(())
        },
    )
    .await;
    nats.wait_drained(DOWNSTREAM, Duration::from_secs(30)).await;
    assert_eq!(env.markers(SOURCE).await, 10);
    assert_eq!(
        env.scalar("SELECT count(*) FROM downstream_effect").await,
        10,
        "one effect per event"
    );
    assert_eq!(
        env.scalar("SELECT count(DISTINCT event) FROM downstream_effect")
            .await,
        10
    );
    let mut subjects = nats
        .js
        .get_stream(&nats.stream)
        .await
        .unwrap()
        .info_with_subjects(events.clone())
        .await
        .unwrap();
    let mut stored = 0;
    while let Some(entry) = futures::StreamExt::next(&mut subjects).await {
        stored += entry.unwrap().1;
    }
    assert_eq!(
        stored, 10,
        "the republished batch was absorbed by the stream's duplicate window"
    );
    unsafe { libc::kill(host.id() as i32, libc::SIGTERM) };
    assert!(
        wait_exit(&mut host, Duration::from_secs(30))
            .await
            .success()
    );
    nats.cleanup().await;
    env.cleanup().await;
    let _ = std::fs::remove_dir_all(&dir);
}
