//! The seed's database-invariant cases, each run per message and in group commit
//! (`tests/system/seed.rs` makes a test of each in both modes).

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use idemhost::{ClaimSettings, Claimer, Isolation, Message, Outcome, Processed, WasmHandler};

const CONSUMER: &str = "inventory-reservation-v1";

/// A consumer's claim pipeline, and whether its deliveries run in group commit.
#[derive(Clone)]
struct Pipeline {
    claimer: Arc<Claimer>,
    group_commit: bool,
}

/// One delivery through the claim pipeline: its own transaction, or (group commit) a batch in
/// which a neighbour fails first and is rolled back to its savepoint.
async fn deliver(c: &Pipeline, plugin: &WasmHandler, msg: &Message) -> Processed {
    if !c.group_commit {
        return c.claimer.process(plugin, msg).await;
    }
    let neighbour = message(&format!("neighbour-of-{}", msg.id), "{not json");
    let mut results = c
        .claimer
        .process_batch(plugin, &[neighbour, msg.clone()])
        .await;
    assert!(
        matches!(&results[0].outcome, Outcome::TerminalFailure(r) if r.contains("malformed")),
        "{:?}",
        results[0]
    );
    results.pop().unwrap()
}

/// Runs one delivery through the claim pipeline on its own task (and connection).
fn spawn_delivery(
    c: &Pipeline,
    plugin: &Arc<WasmHandler>,
    msg: &Message,
) -> tokio::task::JoinHandle<Processed> {
    let (c, p, m) = (c.clone(), plugin.clone(), msg.clone());
    tokio::spawn(async move { deliver(&c, p.as_ref(), &m).await })
}

/// Seeds 10 units of sku-1 and holds its row lock in an open transaction, so a delivery that
/// claimed its marker pauses at its inventory update until the lock is released.
async fn paused_inventory(env: &TestEnv) -> sqlx::Transaction<'static, sqlx::Postgres> {
    env.seed_inventory(&[("sku-1", 10)]).await;
    let mut row_lock = env.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM inventory WHERE sku = 'sku-1' FOR UPDATE")
        .execute(&mut *row_lock)
        .await
        .unwrap();
    row_lock
}

/// In group-commit mode the group waits on a competing claim or row as long as the server lets
/// it, so the seed's timelines play out inside the group: with `batch_lock_timeout` the group
/// would give such a wait up after 50 ms and send the delivery back alone (`batch.rs` tests
/// that).
fn claimer(env: &TestEnv, consumer: &str, isolation: Isolation, group_commit: bool) -> Pipeline {
    let mut settings = ClaimSettings::new(consumer, isolation);
    if group_commit {
        settings.group_lock_timeout = None;
    }
    Pipeline {
        claimer: Arc::new(Claimer::new(env.pool.clone(), settings)),
        group_commit,
    }
}

/// Case 1: One event delivered twice, one after the other: one marker, one decrement.
pub(crate) async fn duplicate_delivery_is_acked_without_second_effect(group_commit: bool) {
    let env = TestEnv::new("seed1").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let plugin = load_plugin("inventory", Duration::from_secs(5));
    let c = claimer(&env, CONSUMER, Isolation::ReadCommitted, group_commit);
    let msg = message("evt-7", &order_payload("evt-7", "sku-1", 1));

    assert_eq!(
        deliver(&c, plugin.as_ref(), &msg).await.outcome,
        Outcome::Applied
    );
    assert_eq!(
        deliver(&c, plugin.as_ref(), &msg).await.outcome,
        Outcome::Duplicate
    );

    assert_eq!(env.markers(CONSUMER).await, 1);
    assert_eq!(env.available("sku-1").await, 9);
    assert_eq!(env.reserved("sku-1").await, 1);
    env.cleanup().await;
}

/// Case 2: Two transactions for the same (consumer, id) on separate connections, released
/// together: exactly one applies, every time.
pub(crate) async fn simultaneous_deliveries_apply_exactly_once(group_commit: bool) {
    let env = TestEnv::new("seed2").await;
    env.seed_inventory(&[("sku-1", 1000)]).await;
    let plugin = load_plugin("inventory", Duration::from_secs(5));
    let c = claimer(&env, CONSUMER, Isolation::ReadCommitted, group_commit);
    for round in 0..25 {
        let id = format!("evt-race-{round}");
        let msg = message(&id, &order_payload(&id, "sku-1", 2));
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let run = |c: Pipeline,
                   p: Arc<idemhost::WasmHandler>,
                   m: idemhost::Message,
                   b: Arc<tokio::sync::Barrier>| {
            tokio::spawn(async move {
                b.wait().await;
                deliver(&c, p.as_ref(), &m).await.outcome
            })
        };
        let a = run(c.clone(), plugin.clone(), msg.clone(), barrier.clone());
        let b = run(c.clone(), plugin.clone(), msg.clone(), barrier.clone());
        let mut outcomes = vec![a.await.unwrap(), b.await.unwrap()];
        outcomes.sort_by_key(|o| o.label());
        assert_eq!(
            outcomes,
            vec![Outcome::Applied, Outcome::Duplicate],
            "round {round}"
        );
    }
    assert_eq!(env.markers(CONSUMER).await, 25);
    assert_eq!(env.reserved("sku-1").await, 50);
    env.cleanup().await;
}

/// Case 3: The business update fails after the claim: rollback leaves neither marker nor effect,
/// and the outcome is a failure (never acked as done).
pub(crate) async fn failed_business_update_rolls_back_marker_and_effect(group_commit: bool) {
    let env = TestEnv::new("seed3").await;
    env.seed_inventory(&[("sku-1", 1)]).await;
    let plugin = load_plugin("inventory", Duration::from_secs(5));
    let c = claimer(&env, CONSUMER, Isolation::ReadCommitted, group_commit);

    let too_many = message("evt-big", &order_payload("evt-big", "sku-1", 5));
    let p = deliver(&c, plugin.as_ref(), &too_many).await;
    assert_eq!(
        p.outcome,
        Outcome::TerminalFailure("Unknown SKU or insufficient inventory for order-evt-big".into())
    );
    assert!(!p.outcome.committed());
    let unknown = message("evt-nosku", &order_payload("evt-nosku", "sku-404", 1));
    assert!(matches!(
        deliver(&c, plugin.as_ref(), &unknown).await.outcome,
        Outcome::TerminalFailure(_)
    ));
    let malformed = message("evt-bad", "{not json");
    let p = deliver(&c, plugin.as_ref(), &malformed).await;
    assert!(
        matches!(&p.outcome, Outcome::TerminalFailure(r) if r.contains("malformed OrderPlaced")),
        "{p:?}"
    );

    assert_eq!(env.markers(CONSUMER).await, 0);
    assert_eq!(env.available("sku-1").await, 1);
    assert_eq!(env.reserved("sku-1").await, 0);

    // A failed attempt is not a false duplicate: once stock exists, the same id applies.
    sqlx::query("UPDATE inventory SET available = 10 WHERE sku = 'sku-1'")
        .execute(&env.pool)
        .await
        .unwrap();
    assert_eq!(
        deliver(&c, plugin.as_ref(), &too_many).await.outcome,
        Outcome::Applied
    );
    assert_eq!(env.reserved("sku-1").await, 5);
    env.cleanup().await;
}

/// Case 4: READ COMMITTED: the first delivery is paused after claiming (its inventory row is
/// locked), then commits; the second waited on the marker and reports a duplicate.
pub(crate) async fn waiting_claim_is_duplicate_when_winner_commits(group_commit: bool) {
    let env = TestEnv::new("seed4").await;
    let row_lock = paused_inventory(&env).await;
    let plugin = load_plugin("inventory", Duration::from_secs(20));
    let c = claimer(&env, CONSUMER, Isolation::ReadCommitted, group_commit);
    let msg = message("evt-4", &order_payload("evt-4", "sku-1", 3));

    let first = spawn_delivery(&c, &plugin, &msg);
    env.wait_for_lock_wait("UPDATE inventory").await; // first claimed, now paused
    let second = spawn_delivery(&c, &plugin, &msg);
    env.wait_for_lock_wait("idemhost_claim").await; // second waits on the marker

    row_lock.commit().await.unwrap();
    let first = first.await.unwrap();
    let second = second.await.unwrap();
    assert_eq!(first.outcome, Outcome::Applied);
    assert_eq!(second.outcome, Outcome::Duplicate);
    assert!(
        second.claim_time >= Duration::from_millis(1),
        "the second claim waited: {:?}",
        second.claim_time
    );
    assert_eq!(env.markers(CONSUMER).await, 1);
    assert_eq!(env.reserved("sku-1").await, 3);
    env.cleanup().await;
}

/// Case 5: READ COMMITTED: as 4, but the first delivery rolls back (its statement is cancelled);
/// the waiting second delivery then owns the marker and applies once.
pub(crate) async fn waiting_claim_applies_when_winner_rolls_back(group_commit: bool) {
    let env = TestEnv::new("seed5").await;
    let row_lock = paused_inventory(&env).await;
    let plugin = load_plugin("inventory", Duration::from_secs(20));
    let c = claimer(&env, CONSUMER, Isolation::ReadCommitted, group_commit);
    let msg = message("evt-5", &order_payload("evt-5", "sku-1", 3));

    let first = spawn_delivery(&c, &plugin, &msg);
    let first_pid = env.wait_for_lock_wait("UPDATE inventory").await;
    let second = spawn_delivery(&c, &plugin, &msg);
    env.wait_for_lock_wait("idemhost_claim").await;

    sqlx::query("SELECT pg_cancel_backend($1)")
        .bind(first_pid)
        .execute(&env.pool)
        .await
        .unwrap();
    let first = first.await.unwrap();
    assert!(
        matches!(&first.outcome, Outcome::RetryableFailure(r) if r.contains("57014")),
        "{first:?}"
    );
    // The second now owns the marker and waits for the row like the first did.
    env.wait_for_lock_wait("UPDATE inventory").await;
    row_lock.commit().await.unwrap();
    assert_eq!(second.await.unwrap().outcome, Outcome::Applied);
    assert_eq!(env.markers(CONSUMER).await, 1);
    assert_eq!(env.reserved("sku-1").await, 3);
    env.cleanup().await;
}

/// Case 6: One message id, two consumer names: each commits its own marker and effect.
pub(crate) async fn two_consumer_names_each_apply_the_same_message(group_commit: bool) {
    let env = TestEnv::new("seed6").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let plugin = load_plugin("inventory", Duration::from_secs(5));
    let msg = message("evt-6", &order_payload("evt-6", "sku-1", 1));
    let inventory = claimer(&env, CONSUMER, Isolation::ReadCommitted, group_commit);
    let analytics = claimer(&env, "analytics-v1", Isolation::ReadCommitted, group_commit);

    assert_eq!(
        deliver(&inventory, plugin.as_ref(), &msg).await.outcome,
        Outcome::Applied
    );
    assert_eq!(
        deliver(&analytics, plugin.as_ref(), &msg).await.outcome,
        Outcome::Applied
    );
    assert_eq!(
        deliver(&analytics, plugin.as_ref(), &msg).await.outcome,
        Outcome::Duplicate
    );

    assert_eq!(env.markers(CONSUMER).await, 1);
    assert_eq!(env.markers("analytics-v1").await, 1);
    assert_eq!(env.reserved("sku-1").await, 2);
    env.cleanup().await;
}

/// Installs a trigger that raises SQLSTATE 40001 on the first `failures` inventory updates;
/// a sequence (not rolled back with the transaction) counts every attempt that got there.
async fn force_serialization_failures(env: &TestEnv, failures: i64) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE SEQUENCE update_attempts;
         CREATE FUNCTION force_40001() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF nextval('update_attempts') <= {failures} THEN
             RAISE EXCEPTION 'forced serialization failure' USING ERRCODE = 'serialization_failure';
           END IF;
           RETURN NEW;
         END $$;
         CREATE TRIGGER force_40001 BEFORE UPDATE ON inventory FOR EACH ROW EXECUTE FUNCTION force_40001();"
    )))
    .execute(&env.pool)
    .await
    .unwrap();
}

/// Case 8a: REPEATABLE READ and SERIALIZABLE: forced 40001 twice → the whole transaction (claim
/// included, same id) runs three times and applies once.
pub(crate) async fn serialization_failure_retries_whole_transaction_with_same_id(
    group_commit: bool,
) {
    for isolation in [Isolation::RepeatableRead, Isolation::Serializable] {
        let env = TestEnv::new("seed8a").await;
        env.seed_inventory(&[("sku-1", 10)]).await;
        force_serialization_failures(&env, 2).await;
        let plugin = load_plugin("inventory", Duration::from_secs(5));
        let c = claimer(&env, CONSUMER, isolation, group_commit);
        let msg = message("evt-8", &order_payload("evt-8", "sku-1", 1));

        let p = deliver(&c, plugin.as_ref(), &msg).await;
        assert_eq!(p.outcome, Outcome::Applied, "{isolation:?}");
        assert_eq!(p.tx_attempts, 3, "{isolation:?}");
        assert_eq!(
            env.scalar("SELECT last_value FROM update_attempts").await,
            3
        );
        let ids: Vec<String> = sqlx::query_scalar("SELECT message_id FROM processed_message")
            .fetch_all(&env.pool)
            .await
            .unwrap();
        assert_eq!(ids, vec!["evt-8".to_string()]);
        assert_eq!(env.reserved("sku-1").await, 1);
        env.cleanup().await;
    }
}

/// Case 8b: Past the attempt limit the delivery is a retryable failure (nak'ed, never acked) and
/// nothing committed.
pub(crate) async fn serialization_failure_past_limit_is_retryable_and_commits_nothing(
    group_commit: bool,
) {
    for isolation in [Isolation::RepeatableRead, Isolation::Serializable] {
        let env = TestEnv::new("seed8b").await;
        env.seed_inventory(&[("sku-1", 10)]).await;
        force_serialization_failures(&env, 1_000).await;
        let plugin = load_plugin("inventory", Duration::from_secs(5));
        let c = claimer(&env, CONSUMER, isolation, group_commit);
        let msg = message("evt-8b", &order_payload("evt-8b", "sku-1", 1));

        let p = deliver(&c, plugin.as_ref(), &msg).await;
        assert!(
            matches!(&p.outcome, Outcome::RetryableFailure(r) if r.contains("40001") && r.contains("after 5 transaction attempts")),
            "{p:?}"
        );
        assert!(!p.outcome.committed());
        assert_eq!(p.tx_attempts, 5);
        assert_eq!(
            env.scalar("SELECT last_value FROM update_attempts").await,
            5
        );
        assert_eq!(env.markers(CONSUMER).await, 0);
        assert_eq!(env.reserved("sku-1").await, 0);
        env.cleanup().await;
    }
}

/// Case 8c: A real concurrent update at REPEATABLE READ: the row changes after the delivery's
/// snapshot, PostgreSQL raises 40001, and the retried transaction applies once.
pub(crate) async fn concurrent_update_under_repeatable_read_is_retried(group_commit: bool) {
    let env = TestEnv::new("seed8c").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let plugin = load_plugin("inventory", Duration::from_secs(20));
    let c = claimer(&env, CONSUMER, Isolation::RepeatableRead, group_commit);
    let msg = message("evt-8c", &order_payload("evt-8c", "sku-1", 1));

    let mut other = env.pool.begin().await.unwrap();
    sqlx::query("UPDATE inventory SET available = available + 100 WHERE sku = 'sku-1'")
        .execute(&mut *other)
        .await
        .unwrap();
    let delivery = spawn_delivery(&c, &plugin, &msg);
    env.wait_for_lock_wait("UPDATE inventory").await;
    other.commit().await.unwrap();

    let p = delivery.await.unwrap();
    assert_eq!(p.outcome, Outcome::Applied);
    assert_eq!(p.tx_attempts, 2);
    assert_eq!(env.markers(CONSUMER).await, 1);
    assert_eq!(env.available("sku-1").await, 109);
    assert_eq!(env.reserved("sku-1").await, 1);
    env.cleanup().await;
}
