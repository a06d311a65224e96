//! Plugins that misbehave — refused SQL, traps, endless loops, memory bombs, swallowed database
//! errors — are contained: the delivery rolls back with a clear reason and the host keeps
//! serving the next one.

use std::time::{Duration, Instant};

use crate::common::*;
use idemhost::{ClaimSettings, Claimer, Isolation, Outcome};

const CONSUMER: &str = "testkit-v1";

/// A claimer behind the plugin wall: the plugin logs in as its own role, granted `inventory`.
async fn claimer(env: &TestEnv) -> Claimer {
    env.plugin_claimer(
        ClaimSettings::new(CONSUMER, Isolation::ReadCommitted),
        &["inventory"],
    )
    .await
}

/// A delivery that must still work after a hostile one.
async fn healthy_delivery_still_applies(c: &Claimer, plugin: &idemhost::WasmHandler, id: &str) {
    let script = r#"{"steps":[{"execute":"UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"}]}"#;
    assert_eq!(
        c.process(plugin, &message(id, script)).await.outcome,
        Outcome::Applied
    );
}

/// Statements that control the transaction or session, or touch the marker table, are refused
/// with an error the plugin sees — and a refusal fails the attempt even when the plugin swallows
/// it and returns ok: nothing of the delivery commits, no marker is written.
#[tokio::test]
async fn a_swallowed_refusal_still_fails_the_attempt() {
    let env = TestEnv::new("refused").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let plugin = load_plugin("testkit", Duration::from_secs(5));
    let c = claimer(&env).await;
    let refused = [
        "COMMIT",
        "ROLLBACK",
        "SAVEPOINT s",
        "SET ROLE postgres",
        "SET session_authorization postgres",
        "RESET ALL",
        "LISTEN x",
        "COPY inventory TO PROGRAM 'cat'",
        "SELECT 1; COMMIT",
        "DELETE FROM processed_message",
        "SELECT set_config('statement_timeout', '0', true)",
    ];
    for (i, sql) in refused.iter().enumerate() {
        let script = format!(
            r#"{{"keep_going":true,"steps":[{{"execute":"UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"}},{{"execute":{}}}]}}"#,
            serde_json::json!(sql)
        );
        let p = c
            .process(
                plugin.as_ref(),
                &message(&format!("evt-refused-{i}"), &script),
            )
            .await;
        assert!(
            matches!(&p.outcome, Outcome::RetryableFailure(r) if r.contains("refused")),
            "{sql}: {p:?}"
        );
    }
    assert_eq!(
        env.markers(CONSUMER).await,
        0,
        "no refused delivery committed"
    );
    assert_eq!(env.reserved("sku-1").await, 0, "no half effect committed");
    healthy_delivery_still_applies(&c, &plugin, "evt-after-refusals").await;
    env.cleanup().await;
}

/// A trapping plugin fails the delivery as retryable, rolls back, and leaves the host serving.
#[tokio::test]
async fn trapping_plugin_rolls_back_and_host_keeps_serving() {
    let env = TestEnv::new("trap").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let plugin = load_plugin("testkit", Duration::from_secs(5));
    let c = claimer(&env).await;
    let script = r#"{"steps":[{"execute":"UPDATE inventory SET reserved = reserved + 100 WHERE sku = 'sku-1'"},"trap"]}"#;
    let p = c
        .process(plugin.as_ref(), &message("evt-trap", script))
        .await;
    assert!(
        matches!(&p.outcome, Outcome::RetryableFailure(r) if r.contains("plugin trapped")),
        "{p:?}"
    );
    assert_eq!(env.markers(CONSUMER).await, 0);
    assert_eq!(env.reserved("sku-1").await, 0);
    healthy_delivery_still_applies(&c, &plugin, "evt-after-trap").await;
    env.cleanup().await;
}

/// A plugin looping forever is interrupted at its deadline, rolled back, and does not stop
/// other deliveries from running meanwhile.
#[tokio::test]
async fn endless_loop_is_interrupted_at_the_deadline() {
    const LOOP_DEADLINE: Duration = Duration::from_secs(2);
    let env = TestEnv::new("loop").await;
    // The loop's effect is on its own row: on the healthy delivery's row it would hold that
    // row's lock until its rollback, and the healthy delivery would wait for it.
    env.seed_inventory(&[("sku-1", 10), ("sku-loop", 10)]).await;
    let looping_plugin = load_plugin("testkit", LOOP_DEADLINE);
    // The healthy delivery has its own, generous deadline: what is under test is that it gets
    // to run while the loop spins, not how fast a loaded machine runs it.
    let healthy_plugin = load_plugin("testkit", Duration::from_secs(30));
    let c = claimer(&env).await;
    let script = r#"{"steps":[{"execute":"UPDATE inventory SET reserved = reserved + 100 WHERE sku = 'sku-loop'"},"loop"]}"#;
    let looping_msg = message("evt-loop", script);
    let started = Instant::now();
    // Both on one task: the healthy delivery only completes before the loop's deadline if the
    // looping plugin yields, and only makes progress if the database's replies reach it.
    let (looping, healthy_done) = tokio::join!(
        async {
            let p = c.process(looping_plugin.as_ref(), &looping_msg).await;
            (p, started.elapsed())
        },
        async {
            healthy_delivery_still_applies(&c, &healthy_plugin, "evt-beside-loop").await;
            started.elapsed()
        },
    );
    let (looping, looping_done) = looping;
    assert!(
        matches!(&looping.outcome, Outcome::RetryableFailure(r) if r.contains("handler_timeout")),
        "{looping:?}"
    );
    assert!(
        healthy_done < looping_done,
        "the healthy delivery ran while the plugin looped: done after {healthy_done:?}, \
         the loop was interrupted after {looping_done:?}"
    );
    assert!(
        looping_done >= LOOP_DEADLINE && looping_done < LOOP_DEADLINE + Duration::from_secs(5),
        "interrupted promptly at its deadline: {looping_done:?}"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM processed_message WHERE message_id = 'evt-loop'")
            .await,
        0
    );
    assert_eq!(
        env.reserved("sku-1").await,
        1,
        "the healthy delivery's effect"
    );
    assert_eq!(env.reserved("sku-loop").await, 0, "the loop's rolled back");
    healthy_delivery_still_applies(&c, &looping_plugin, "evt-after-loop").await;
    env.cleanup().await;
}

/// Growing memory past `memory_limit` traps the instance with a clear reason.
#[tokio::test]
async fn memory_bomb_hits_the_limit() {
    let env = TestEnv::new("membomb").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let plugin = load_plugin("testkit", Duration::from_secs(10));
    let c = claimer(&env).await;
    let p = c
        .process(
            plugin.as_ref(),
            &message("evt-bomb", r#"{"steps":[{"alloc_mib":512}]}"#),
        )
        .await;
    assert!(
        matches!(&p.outcome, Outcome::RetryableFailure(r) if r.contains("memory_limit")),
        "{p:?}"
    );
    assert_eq!(env.markers(CONSUMER).await, 0);
    healthy_delivery_still_applies(&c, &plugin, "evt-after-bomb").await;
    env.cleanup().await;
}

/// A plugin that swallows a database error and returns ok does not get its aborted
/// transaction "committed": the delivery fails with the database error's class.
#[tokio::test]
async fn swallowed_database_error_is_not_committed() {
    let env = TestEnv::new("swallow").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let plugin = load_plugin("testkit", Duration::from_secs(5));
    let c = claimer(&env).await;
    let script = r#"{"keep_going":true,"steps":[
        {"execute":"UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"},
        {"query":"SELECT 1 / 0"},
        {"execute":"UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"}]}"#;
    let p = c
        .process(plugin.as_ref(), &message("evt-swallow", script))
        .await;
    assert!(
        matches!(&p.outcome, Outcome::TerminalFailure(r) if r.contains("handler returned ok after a database error") && r.contains("22012")),
        "{p:?}"
    );
    assert_eq!(env.markers(CONSUMER).await, 0);
    assert_eq!(env.reserved("sku-1").await, 0);
    env.cleanup().await;
}

/// Query results and parameters convert both ways; types without a sql-value are refused
/// with a hint, and a NULL parameter fits any column.
#[tokio::test]
async fn values_round_trip_through_the_gate() {
    let env = TestEnv::new("values").await;
    sqlx::query(
        "CREATE TABLE kv (k text PRIMARY KEY, n bigint, f float8, b boolean, j jsonb, raw bytea)",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    let plugin = load_plugin("testkit", Duration::from_secs(5));
    let c = env
        .plugin_claimer(
            ClaimSettings::new(CONSUMER, Isolation::ReadCommitted),
            &["inventory", "kv"],
        )
        .await;
    let script = r#"{"steps":[
        {"execute":"INSERT INTO kv VALUES ($1, $2, $3, $4, $5::text::jsonb, NULL)","params":["a", 42, 1.5, true, "{\"x\":1}"]},
        {"execute":"INSERT INTO kv (k, n) VALUES ($1, $2)","params":["b", null]},
        {"query":"SELECT k, n, f, b, j, raw FROM kv ORDER BY k"}]}"#;
    assert_eq!(
        c.process(plugin.as_ref(), &message("evt-values", script))
            .await
            .outcome,
        Outcome::Applied
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM kv WHERE n IS NULL AND k = 'b'")
            .await,
        1
    );
    assert_eq!(
        env.scalar("SELECT (j->>'x')::bigint FROM kv WHERE k = 'a'")
            .await,
        1
    );

    let p = c
        .process(
            plugin.as_ref(),
            &message(
                "evt-numeric",
                r#"{"steps":[{"query":"SELECT 1.5::numeric AS amount"}]}"#,
            ),
        )
        .await;
    assert!(
        matches!(&p.outcome, Outcome::RetryableFailure(r) if r.contains("amount") && r.contains("::text")),
        "{p:?}"
    );
    env.cleanup().await;
}

/// `consumer.role`: the plugin's connections log in as a role granted only the consumer's
/// tables — a statement naming another table is refused before it reaches the server (which
/// would lock it before checking privileges), and the delivery rolls back — while
/// the host still claims, records the plugin version and writes the outbox through its own
/// functions.
#[tokio::test]
async fn a_consumer_role_confines_the_plugin() {
    let env = TestEnv::new("role").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    for sql in [
        "CREATE TABLE secret (x integer)",
        "INSERT INTO secret VALUES (42)",
    ] {
        env.execute(sql).await;
    }
    let mut settings = ClaimSettings::new(CONSUMER, Isolation::ReadCommitted);
    settings.publish_subjects = std::sync::Arc::from(vec!["role.>".to_string()]);
    let c = env.plugin_claimer(settings, &["inventory"]).await;
    let plugin = load_plugin("testkit", Duration::from_secs(5));

    healthy_delivery_still_applies(&c, &plugin, "evt-granted").await;
    let p = c
        .process(
            plugin.as_ref(),
            &message(
                "evt-secret",
                r#"{"steps":[{"query":"SELECT x FROM secret"}]}"#,
            ),
        )
        .await;
    match &p.outcome {
        Outcome::RetryableFailure(r) => {
            assert!(
                r.contains("`secret` is a relation this consumer's role has no privilege on"),
                "{r}"
            )
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let publish = r#"{"steps":[{"publish":"role.events","payload":"x"}]}"#;
    assert_eq!(
        c.process(plugin.as_ref(), &message("evt-publish", publish))
            .await
            .outcome,
        Outcome::Applied
    );
    let elsewhere = r#"{"steps":[{"publish":"other.events","payload":"x"}]}"#;
    assert!(matches!(
        c.process(plugin.as_ref(), &message("evt-elsewhere", elsewhere))
            .await
            .outcome,
        Outcome::RetryableFailure(r) if r.contains("publish_subjects")
    ));
    assert_eq!(
        env.markers(CONSUMER).await,
        2,
        "the refused deliveries left no marker"
    );
    assert_eq!(env.reserved("sku-1").await, 1);
    assert_eq!(
        env.scalar("SELECT count(*) FROM processed_message_handler")
            .await,
        2,
        "versions recorded by the host"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM outbox_message").await,
        1,
        "outbox written by the host"
    );
    env.cleanup().await;
}

/// An attempt ends within its deadline and the rollback grace, whatever `statement_timeout`
/// is: a `query` refused at a row leaves the rest of the result in flight, and the rollback
/// used to wait for all of it (handler 0.9 ms, transaction 30 s with `statement_timeout` 30 s
/// and `handler_timeout` 3 s). Swept over the ways a result is refused midway (too many rows,
/// too many bytes, a type with no sql-value) with a slow tail behind each.
#[tokio::test]
async fn a_refused_result_does_not_hold_the_rollback() {
    let env = TestEnv::new("slowtail").await;
    env.seed_inventory(&[("sku-1", 10)]).await;
    let plugin = load_plugin("testkit", Duration::from_secs(3));
    let mut settings = ClaimSettings::new(CONSUMER, Isolation::ReadCommitted);
    settings.statement_timeout = Duration::from_secs(30);
    settings.attempt_timeout = Some(Duration::from_secs(3));
    let c = env.plugin_claimer(settings, &["inventory"]).await;
    // Each row after the refused one sleeps 10 ms: 30 s for the rest of the result.
    let slow = "CASE WHEN x > 3 THEN pg_catalog.pg_sleep(0.01) END IS NULL";
    for (i, sql) in [
        format!("SELECT x, {slow} FROM generate_series(1, 20000) x"),
        format!("SELECT repeat('x', 4000000), {slow} FROM generate_series(1, 3000) x"),
        format!("SELECT x::numeric::money, {slow} FROM generate_series(1, 3000) x"),
    ]
    .iter()
    .enumerate()
    {
        let script = serde_json::json!({"steps":[{"query": sql}]}).to_string();
        let started = Instant::now();
        let p = c
            .process(plugin.as_ref(), &message(&format!("evt-tail-{i}"), &script))
            .await;
        let took = started.elapsed();
        assert!(matches!(p.outcome, Outcome::RetryableFailure(_)), "{p:?}");
        // The deadline (3 s) plus the rollback grace (1 s), with room for a loaded machine.
        assert!(
            took < Duration::from_secs(6),
            "{sql}: the attempt took {took:?}"
        );
    }
    assert_eq!(env.markers(CONSUMER).await, 0);
    healthy_delivery_still_applies(&c, &plugin, "evt-after-tails").await;
    env.cleanup().await;
}
