//! Per-key ordering (`ordering = { key = … }`): 200 keys × 50 versioned events, published
//! shuffled across keys but in order within each key, with 20% duplicate deliveries and some
//! first attempts failing retryably — every key's versions are applied exactly once, in order.

use std::time::Duration;

use crate::common::*;

const NAME: &str = "ordered-v1";
const KEYS: usize = 200;
const VERSIONS: i64 = 50;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_applies_its_versions_once_and_in_order() {
    let env = TestEnv::new("ordering").await;
    env.execute("CREATE TABLE key_versions (id bigserial PRIMARY KEY, key text NOT NULL, version integer NOT NULL)").await;
    let nats = NatsEnv::new("ordering", Duration::from_secs(60)).await;
    let text = config_text(
        &env,
        &nats,
        NAME,
        "testkit",
        "max_in_flight = 16\nmax_deliver = 5\nbackoff = [\"10ms\"]\nordering = { key = \"header:Idemhost-Ordering-Key\" }",
    );
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));

    let (messages, duplicates, failing) =
        versioned_events(&env.host_key().await, KEYS, VERSIONS, 7, true);
    let published = messages.len();
    let messages = messages.into_iter().map(|(_, h, script)| (h, script));
    nats.publish_many(messages).await;
    let total = KEYS as i64 * VERSIONS;
    wait_until(
        Duration::from_secs(240),
        "every version applied",
        || async { (env.scalar("SELECT count(*) FROM key_versions").await >= total).then_some(()) },
    )
    .await;
    nats.wait_drained(NAME, Duration::from_secs(60)).await;
    println!(
        "ordering: {published} deliveries, {duplicates} duplicates, {failing} failing first attempts"
    );

    assert_eq!(env.markers(NAME).await, total);
    assert_eq!(
        env.scalar("SELECT count(*) FROM key_versions").await,
        total,
        "exactly once"
    );
    assert_keys_in_order(&env, VERSIONS).await;
    assert!(
        nats.dead_letters().await.is_empty(),
        "nothing dead-lettered"
    );
    assert!(failing > 0 && duplicates > KEYS);
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// A key whose head fails retryably for longer than `ack_wait` (about 12 s against 2 s), with
/// 20 messages of that key queued behind it and 50 other keys published after them: the
/// queued messages are never redelivered meanwhile (the broker delivered each message exactly
/// once), nothing is dead-lettered, every message is applied once and in key order, and the
/// other keys finish while the hot key still waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_waits_past_ack_wait_without_redeliveries_or_stalling_others() {
    const NAME: &str = "hot-key-v1";
    const QUEUED: i64 = 20;
    const OTHERS: usize = 50;
    let env = TestEnv::new("hotkey").await;
    env.execute(
        "CREATE TABLE key_versions (id bigserial PRIMARY KEY, key text NOT NULL, \
         version integer NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .await;
    let nats = NatsEnv::new("hotkey", Duration::from_secs(60)).await;
    let text = config_text(
        &env,
        &nats,
        NAME,
        "testkit",
        "max_in_flight = 8\nack_wait = \"2s\"\nmax_deliver = 5\nbackoff = [\"3s\"]\n\
         ordering = { key = \"header:Idemhost-Ordering-Key\" }",
    );
    let mut messages = Vec::new();
    let mut push = |key: &str, version: i64, steps: String| {
        let mut h = async_nats::HeaderMap::new();
        h.insert("Idemhost-Ordering-Key", key);
        h.insert("Nats-Msg-Id", format!("{key}-v{version}").as_str());
        messages.push((h, steps));
    };
    // The head fails its first four attempts (3 s apart, in place), then applies.
    push(
        "hot",
        1,
        r#"{"steps":[{"fail_before_attempt":5},{"execute":"INSERT INTO key_versions (key, version) VALUES ('hot', 1)"}]}"#.to_string(),
    );
    for v in 2..=QUEUED + 1 {
        push("hot", v, version_script("hot", v, false));
    }
    for k in 0..OTHERS {
        push(
            &format!("k-{k}"),
            1,
            version_script(&format!("k-{k}"), 1, false),
        );
    }
    let published = messages.len() as u64;
    nats.publish_many(messages).await;
    let host = RunningHost::start(idemhost::Host::new(parse_config(&text)));

    let total = QUEUED + 1 + OTHERS as i64;
    wait_until(Duration::from_secs(90), "every message applied", || async {
        (env.scalar("SELECT count(*) FROM key_versions").await >= total).then_some(())
    })
    .await;
    let info = nats.wait_drained(NAME, Duration::from_secs(60)).await;
    assert_eq!(
        env.scalar("SELECT count(*) FROM key_versions").await,
        total,
        "exactly once"
    );
    assert_eq!(env.markers(NAME).await, total);
    let hot: Vec<i32> =
        sqlx::query_scalar("SELECT version FROM key_versions WHERE key = 'hot' ORDER BY id")
            .fetch_all(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        hot,
        (1..=QUEUED as i32 + 1).collect::<Vec<_>>(),
        "key order"
    );
    let dead_letters = nats.dead_letters().await.len();
    let (others_done, head_done): (f64, f64) = sqlx::query_as(
        "SELECT extract(epoch FROM (SELECT max(applied_at) FROM key_versions WHERE key <> 'hot') \
                 - (SELECT min(applied_at) FROM key_versions))::float8, \
                extract(epoch FROM (SELECT applied_at FROM key_versions WHERE key = 'hot' AND version = 1) \
                 - (SELECT min(applied_at) FROM key_versions))::float8",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    println!(
        "hot key: {} broker deliveries for {published} messages, {dead_letters} dead-lettered; \
         the other keys done {others_done:.1} s after the first apply, the hot key's head {head_done:.1} s",
        info.delivered.consumer_sequence
    );
    assert_eq!(dead_letters, 0, "nothing dead-lettered");
    // Every delivery the broker made was a first one: nothing waiting was redelivered.
    assert_eq!(
        info.delivered.consumer_sequence, published,
        "deliveries made by the broker for {published} messages"
    );
    let others_done_before_head = others_done < head_done;
    assert!(
        others_done_before_head,
        "the other keys finished while the hot key waited"
    );
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}
