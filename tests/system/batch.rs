//! Group commit (`batch_max`): one transaction for several deliveries, claimed in one statement;
//! after a failure the others run again each behind its own SAVEPOINT. A failing message rolls
//! back only its own marker and effect; a duplicate id inside
//! one batch applies once; through NATS every message is applied once or dead-lettered, and
//! nothing is acked before its batch committed. (`seed.rs` runs the seed's tests (`group_commit::*`) in this
//! mode; `crash.rs` kills the host inside a batch.)

use std::time::Duration;

use crate::common::*;
use idemhost::{ClaimSettings, Claimer, Host, Isolation, Outcome};
use rand::seq::SliceRandom;

const CONSUMER: &str = "testkit-v1";

fn reserve(n: i64) -> String {
    format!(
        r#"{{"steps":[{{"execute":"UPDATE inventory SET reserved = reserved + {n} WHERE sku = 'sku-1'"}}]}}"#
    )
}

/// Each script first reserves, then misbehaves (or not). Only the well-behaved parts commit.
#[tokio::test]
async fn a_failure_in_a_batch_rolls_back_only_its_own_part() {
    let env = TestEnv::new("batch_parts").await;
    env.seed_inventory(&[("sku-1", 1_000)]).await;
    let plugin = load_plugin("testkit", Duration::from_millis(500));
    let c = Claimer::new(
        env.pool.clone(),
        ClaimSettings::new(CONSUMER, Isolation::ReadCommitted),
    );
    let then = |n: i64, tail: &str| {
        format!(
            r#"{{"keep_going":true,"steps":[{{"execute":"UPDATE inventory SET reserved = reserved + {n} WHERE sku = 'sku-1'"}},{tail}]}}"#
        )
    };
    let batch = vec![
        message("ok-1", &reserve(1)),
        message(
            "terminal",
            &then(10, r#"{"fail":"terminal","reason":"no such order"}"#),
        ),
        message("ok-1", &reserve(1)),
        message("trap", &then(100, r#""trap""#)),
        message("swallowed", &then(1000, r#"{"query":"SELECT 1 / 0"}"#)),
        message("loop", &then(10_000, r#""loop""#)),
        message("ok-2", &reserve(2)),
    ];
    let results = c.process_batch(plugin.as_ref(), &batch).await;
    let outcomes: Vec<&str> = results.iter().map(|p| p.outcome.label()).collect();
    assert_eq!(
        outcomes,
        [
            "applied",
            "terminal_failure",
            "duplicate",
            "retryable_failure",
            "terminal_failure",
            "retryable_failure",
            "applied"
        ],
        "{results:?}"
    );
    assert!(
        matches!(&results[3].outcome, Outcome::RetryableFailure(r) if r.contains("plugin trapped"))
    );
    assert!(
        matches!(&results[4].outcome, Outcome::TerminalFailure(r) if r.contains("22012")),
        "{:?}",
        results[4]
    );
    assert!(
        matches!(&results[5].outcome, Outcome::RetryableFailure(r) if r.contains("handler_timeout"))
    );
    assert!(
        results.iter().all(|p| p.tx_attempts == 1),
        "one transaction"
    );
    let ids: Vec<String> = sqlx::query_scalar(
        "SELECT message_id FROM processed_message WHERE consumer_name = $1 ORDER BY message_id",
    )
    .bind(CONSUMER)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(ids, ["ok-1", "ok-2"]);
    assert_eq!(
        env.reserved("sku-1").await,
        3,
        "only ok-1 (once) and ok-2 reserved"
    );

    // A failed part is no false duplicate: the same id applies in a later batch.
    let again = c
        .process_batch(
            plugin.as_ref(),
            &[
                message("terminal", &reserve(10)),
                message("ok-2", &reserve(2)),
            ],
        )
        .await;
    let outcomes: Vec<&str> = again.iter().map(|p| p.outcome.label()).collect();
    assert_eq!(outcomes, ["applied", "duplicate"]);
    assert_eq!(env.reserved("sku-1").await, 13);
    env.cleanup().await;
}

/// The first pass claims the whole batch in one statement: an id twice in the batch and an id
/// committed before are duplicates, the plugin version is recorded beside each new marker, and
/// an id whose first delivery in the batch fails is applied by its second one.
#[tokio::test]
async fn a_batch_claims_its_ids_in_one_statement() {
    let env = TestEnv::new("batch_claim_all").await;
    env.seed_inventory(&[("sku-1", 1_000)]).await;
    let plugin = load_plugin("testkit", Duration::from_millis(500));
    let c = Claimer::new(
        env.pool.clone(),
        ClaimSettings::new(CONSUMER, Isolation::ReadCommitted),
    );
    let before = c
        .process(plugin.as_ref(), &message("old", &reserve(1)))
        .await;
    assert_eq!(before.outcome, Outcome::Applied);
    let batch = [
        message("b", &reserve(1)),
        message("old", &reserve(1)),
        message("b", &reserve(1)),
        message("a", &reserve(1)),
    ];
    let labels = |r: &[idemhost::Processed]| -> Vec<&'static str> {
        r.iter().map(|p| p.outcome.label()).collect()
    };
    let results = c.process_batch(plugin.as_ref(), &batch).await;
    assert_eq!(
        labels(&results),
        ["applied", "duplicate", "duplicate", "applied"]
    );
    assert_eq!(env.reserved("sku-1").await, 3);
    let recorded: Vec<(String, String)> = sqlx::query_as(
        "SELECT message_id, plugin_digest FROM processed_message_handler \
         WHERE consumer_name = $1 ORDER BY message_id",
    )
    .bind(CONSUMER)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    let digest = plugin.digest().to_string();
    assert_eq!(
        recorded,
        [
            ("a".to_string(), digest.clone()),
            ("b".to_string(), digest.clone()),
            ("old".to_string(), digest.clone())
        ]
    );

    let failing = r#"{"steps":[{"execute":"UPDATE inventory SET reserved = reserved + 100 WHERE sku = 'sku-1'"},{"fail":"terminal","reason":"first copy refused"}]}"#;
    let results = c
        .process_batch(
            plugin.as_ref(),
            &[
                message("e", &reserve(1)),
                message("d", failing),
                message("d", &reserve(1)),
            ],
        )
        .await;
    assert_eq!(labels(&results), ["applied", "terminal_failure", "applied"]);
    assert_eq!(
        env.reserved("sku-1").await,
        5,
        "e and the second d, not the first d"
    );
    assert_eq!(env.markers(CONSUMER).await, 5);
    env.cleanup().await;
}

/// Through NATS with `batch_max = 25`: 2,000 orders with 20 % duplicate ids, shuffled, and 20
/// that fail terminally. Every distinct id applies once, the failures are dead-lettered with
/// their reason, everything is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_through_nats_apply_once_and_dead_letter_failures() {
    const DISTINCT: usize = 2_000;
    let consumer = "inventory-reservation-v1";
    let env = TestEnv::new("batch_e2e").await;
    env.seed_inventory(&[("sku-1", 1_000_000)]).await;
    let nats = NatsEnv::new("batch_e2e", Duration::from_secs(120)).await;
    let host = RunningHost::start(Host::new(config(
        &env,
        &nats,
        consumer,
        "inventory",
        "max_in_flight = 4\nbatch_max = 25\nbatch_linger = \"5ms\"",
    )));
    let key = env.host_key().await;
    let mut messages = Vec::new();
    for i in 0..DISTINCT {
        let id = format!("evt-{i}");
        let sku = if i % 100 == 7 { "sku-404" } else { "sku-1" };
        let copies = if i % 5 == 0 { 2 } else { 1 };
        for copy in 0..copies {
            let mut h = async_nats::HeaderMap::new();
            // A copy under another broker id: JetStream keeps it, the marker decides.
            h.insert("Nats-Msg-Id", format!("{id}/{copy}").as_str());
            replayed(&mut h, &key, &id);
            messages.push((h, order_payload(&id, sku, 1)));
        }
    }
    messages.shuffle(&mut rand::rng());
    let published = messages.len();
    nats.publish_many(messages).await;
    let info = nats.wait_drained(consumer, Duration::from_secs(300)).await;
    let failing = DISTINCT / 100;
    assert!(
        info.delivered.consumer_sequence as usize >= published,
        "every published copy was delivered"
    );
    assert_eq!(
        env.markers(consumer).await as usize,
        DISTINCT - failing,
        "every distinct good id once"
    );
    assert_eq!(
        env.reserved("sku-1").await as usize,
        DISTINCT - failing,
        "one effect per marker"
    );
    let letters = nats.dead_letters().await;
    let reasons: Vec<String> = letters
        .iter()
        .filter_map(|(h, _)| h.get("Idemhost-Failure-Reason"))
        .map(|v| v.as_str().to_string())
        .collect();
    // Both copies of a failing id that was duplicated fail on their own.
    let failing_copies = (0..DISTINCT)
        .filter(|i| i % 100 == 7)
        .map(|i| if i % 5 == 0 { 2 } else { 1 })
        .sum::<usize>();
    assert_eq!(reasons.len(), failing_copies, "{reasons:?}");
    assert!(
        reasons
            .iter()
            .all(|r| r.contains("Unknown SKU or insufficient inventory")),
        "{reasons:?}"
    );
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// Transactions that inserted this consumer's markers: rows a transaction inserts share its
/// `xmin`.
async fn marker_transactions(env: &TestEnv, consumer: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(DISTINCT xmin::text) FROM processed_message WHERE consumer_name = $1",
    )
    .bind(consumer)
    .fetch_one(&env.pool)
    .await
    .unwrap()
}

/// `batch_linger = "0s"` with one transaction at a time: at low load each delivery commits
/// alone, as soon as it arrives; when deliveries arrive faster than transactions finish, the
/// next group takes everything gathered meanwhile (up to `batch_max`), instead of many small
/// groups queueing for the one transaction. (Counted by `xmin`: rows one transaction
/// inserted share it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_commit_with_no_linger_adapts_to_the_load() {
    let env = TestEnv::new("batch_adaptive").await;
    let nats = NatsEnv::new("batch_adaptive", Duration::from_secs(60)).await;
    let host = RunningHost::start(Host::new(config(
        &env,
        &nats,
        CONSUMER,
        "testkit",
        "max_in_flight = 1\nbatch_max = 50\nbatch_linger = \"0s\"",
    )));
    // Each delivery holds its transaction 20 ms.
    let slow = r#"{"steps":[{"query":"SELECT pg_sleep(0.02)"}]}"#;
    // Low load: one at a time, each waited for.
    for i in 0..5 {
        nats.publish(Some(&format!("calm-{i}")), slow).await;
        wait_until(Duration::from_secs(30), "the calm delivery", || async {
            (env.markers(CONSUMER).await == i + 1).then_some(())
        })
        .await;
    }
    assert_eq!(marker_transactions(&env, CONSUMER).await, 5, "each alone");
    // A stream faster than the transactions: 100 deliveries 3 ms apart, each holding the one
    // transaction 20 ms (2 s of handler time arriving over 0.3 s). Gathering only while no
    // transaction is free, a group takes what came in during the one before; groups formed
    // as deliveries arrive would each wait for the transaction alone.
    for i in 0..100 {
        nats.publish(Some(&format!("busy-{i}")), slow).await;
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    nats.wait_drained(CONSUMER, Duration::from_secs(120)).await;
    assert_eq!(env.markers(CONSUMER).await, 105);
    let busy = marker_transactions(&env, CONSUMER).await - 5;
    eprintln!("100 deliveries under load committed in {busy} transactions");
    assert!(
        busy <= 20,
        "{busy} transactions for 100 deliveries under load (groups did not grow)"
    );
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// `batch_linger` holds a group's first delivery only while another group of the consumer
/// runs. Idle, a delivery starts at once however long the linger (before, each waited it out:
/// 10 s here); while a slow group holds one of the two transactions, the deliveries arriving
/// behind it gather instead of starting one by one in the free one, and start together as soon
/// as it ends (before, at the pull request's end, up to 5 s later), not at the end of the
/// linger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_linger_waits_for_company_only_while_a_group_runs() {
    let env = TestEnv::new("batch_linger").await;
    let nats = NatsEnv::new("batch_linger", Duration::from_secs(60)).await;
    let host = RunningHost::start(Host::new(config(
        &env,
        &nats,
        CONSUMER,
        "testkit",
        "max_in_flight = 2\nbatch_max = 50\nbatch_linger = \"10s\"",
    )));
    let quick = r#"{"steps":[]}"#;
    for i in 0..3 {
        nats.publish(Some(&format!("calm-{i}")), quick).await;
        wait_until(
            Duration::from_secs(5),
            "a delivery on an idle consumer",
            || async { (env.markers(CONSUMER).await == i + 1).then_some(()) },
        )
        .await;
    }
    assert_eq!(marker_transactions(&env, CONSUMER).await, 3, "each alone");
    // One group holds a transaction 2 s; ten deliveries arrive behind it.
    nats.publish(
        Some("slow"),
        r#"{"steps":[{"query":"SELECT pg_sleep(2.01)"}]}"#,
    )
    .await;
    wait_until(
        Duration::from_secs(5),
        "the slow group to start",
        || async {
            let running: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(2.01)%'",
            )
            .fetch_one(&env.pool)
            .await
            .unwrap();
            (running > 0).then_some(())
        },
    )
    .await;
    for i in 0..10 {
        nats.publish(Some(&format!("behind-{i}")), quick).await;
    }
    wait_until(
        Duration::from_secs(5),
        "the slow group's commit",
        || async { (env.markers(CONSUMER).await >= 4).then_some(()) },
    )
    .await;
    // Once the slow group's transaction is over no group runs: the deliveries lingering
    // behind it start then, not when the pull request or the linger ends.
    wait_until(
        Duration::from_secs(2),
        "the deliveries behind it, once no group runs",
        || async { (env.markers(CONSUMER).await == 14).then_some(()) },
    )
    .await;
    let behind = marker_transactions(&env, CONSUMER).await - 4;
    assert!(
        behind <= 2,
        "the ten deliveries behind a running group committed in {behind} transactions"
    );
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// Deliveries pulled ahead of a busy transaction are told in progress while they wait: with
/// one transaction at a time, groups of up to 4 that each hold it 1.6 s and `ack_wait = "1s"`,
/// the deliveries waiting behind a running group outlive their ack deadline several times
/// over, and the broker redelivers none of them (before, it redelivered them, and the copies
/// were processed again as duplicates).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_waiting_for_a_group_are_not_redelivered() {
    let env = TestEnv::new("batch_waiting").await;
    let nats = NatsEnv::new("batch_waiting", Duration::from_secs(60)).await;
    let host = RunningHost::start(Host::new(config(
        &env,
        &nats,
        CONSUMER,
        "testkit",
        "max_in_flight = 1\nbatch_max = 4\nbatch_linger = \"0s\"\nack_wait = \"1s\"",
    )));
    let slow = r#"{"steps":[{"query":"SELECT pg_sleep(0.4)"}]}"#;
    for i in 0..12 {
        nats.publish(Some(&format!("wait-{i}")), slow).await;
    }
    nats.wait_drained(CONSUMER, Duration::from_secs(120)).await;
    assert_eq!(env.markers(CONSUMER).await, 12);
    let info = nats.consumer_info(CONSUMER).await;
    assert_eq!(info.num_redelivered, 0, "{info:?}");
    assert_eq!(info.delivered.consumer_sequence, 12, "no redeliveries");
    host.stop().await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// Two groups that lock the same two rows in opposite orders deadlock; the server breaks a
/// deadlock only after `deadlock_timeout` (20 s on these sessions, as an operator may set it),
/// so without a limit of its own the waiting group stalls until its handler's deadline (5 s)
/// stops it, and that message is nak'ed. A group waits for a lock no longer than
/// `batch_lock_timeout` (50 ms by default): the group that gave up is sent back one delivery at
/// a time (a second transaction attempt), the other commits, and every message applies once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_locking_rows_in_opposite_orders_give_up_the_wait_not_deadlock() {
    let env = TestEnv::new("batch_deadlock").await;
    env.seed_inventory(&[("sku-a", 1_000), ("sku-b", 1_000)])
        .await;
    let plugin = load_plugin("testkit", Duration::from_secs(5));
    let options =
        idemhost::test_support::pg::connect_options(&PG_URL, Some(&env.schema), &env.schema)
            .unwrap()
            .options([("deadlock_timeout", "20s")]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap();
    let settings = ClaimSettings::new(CONSUMER, Isolation::ReadCommitted);
    assert_eq!(settings.group_lock_timeout, Some(Duration::from_millis(50)));
    let c = Claimer::new(pool, settings);
    // Reserve on `sku`, then hold the lock a while (so the other group takes its first row).
    let hold = |sku: &str| {
        format!(
            r#"{{"steps":[{{"execute":"UPDATE inventory SET reserved = reserved + 1 WHERE sku = '{sku}'"}},{{"query":"SELECT pg_sleep(0.3)"}}]}}"#
        )
    };
    let take = |sku: &str| {
        format!(
            r#"{{"steps":[{{"execute":"UPDATE inventory SET reserved = reserved + 1 WHERE sku = '{sku}'"}}]}}"#
        )
    };
    let first = [
        message("ab-1", &hold("sku-a")),
        message("ab-2", &take("sku-b")),
    ];
    let second = [
        message("ba-1", &hold("sku-b")),
        message("ba-2", &take("sku-a")),
    ];
    let both = async {
        tokio::join!(
            c.process_batch(plugin.as_ref(), &first),
            c.process_batch(plugin.as_ref(), &second)
        )
    };
    let (one, two) = tokio::time::timeout(Duration::from_secs(10), both)
        .await
        .expect("the groups waited on each other until the server broke the deadlock");
    let results: Vec<_> = one.iter().chain(two.iter()).collect();
    assert!(
        results.iter().all(|p| p.outcome == Outcome::Applied),
        "{results:?}"
    );
    assert!(
        results.iter().any(|p| p.tx_attempts == 2),
        "one group gave up its wait and ran again one by one: {results:?}"
    );
    assert_eq!(env.markers(CONSUMER).await, 4);
    assert_eq!(env.reserved("sku-a").await, 2);
    assert_eq!(env.reserved("sku-b").await, 2);
    env.cleanup().await;
}

/// With the SQL gate on, a plugin still reaches session state through a function of the
/// operator's that the gate admits (its name is no refused one): `SELECT leave_state()` sets a
/// setting for the session, takes a session advisory lock, makes a temporary table and
/// LISTENs. The next delivery of the same group sees none of it: the gate is a guard, and the
/// clearing between deliveries is what holds (which is why the gate cannot stand in for it to
/// save its cost: docs/benchmark.md). The same function called from a per-message delivery is
/// cleared at its commit (`kept_connections.rs`).
#[tokio::test]
async fn an_operators_function_cannot_carry_session_state_to_the_next_delivery_of_a_group() {
    let (env, plugin, c) = testkit_behind_the_wall("batch_fn_state").await;
    env.execute(
        "CREATE FUNCTION leave_state() RETURNS int LANGUAGE plpgsql AS $$
         BEGIN
             PERFORM pg_catalog.set_config('work_mem', '1MB', false);
             PERFORM pg_catalog.pg_advisory_lock(4243);
             CREATE TEMP TABLE IF NOT EXISTS leftover (a int);
             EXECUTE 'LISTEN leftover';
             RETURN 1;
         END $$",
    )
    .await;
    let leave = r#"{"steps":[{"query":"SELECT leave_state()"}]}"#;
    // One bit for each kind of state still there.
    let bits = "+ (current_setting('work_mem') = '1MB')::int \
        + 4 * (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())::int \
        + 8 * (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema())::int \
        + 32 * (SELECT count(*) FROM pg_listening_channels())::int";
    assert_eq!(
        what_the_next_delivery_of_a_group_sees(&env, &c, plugin.as_ref(), leave, bits).await,
        64,
        "the second handler saw state the first one left through the function, the gate \
         admitting the call (bits: 1 work_mem, 4 advisory lock, 8 temp table, 32 LISTEN)"
    );
    env.cleanup().await;
}
