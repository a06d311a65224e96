//! Deliveries of a group-commit transaction share the transaction, not what their plugin left
//! in the session. With the SQL gate off (the `ungated` failpoint: what PostgreSQL's walls hold
//! on their own, as `wall.rs` checks for deliveries each in its own transaction), the first
//! delivery's handler changes every kind of session state the gate would have refused; the
//! second one's handler, in the same transaction, records what it still sees. In a test binary
//! of its own: the failpoint is read once per process.

mod common;

use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use common::*;
use idemhost::{ClaimSettings, Claimer, Isolation, Outcome, WasmHandler};

const CONSUMER: &str = "testkit-v1";

/// The SQL gate off (once per process), a schema with stock, the testkit plugin and a claimer
/// behind the plugin wall.
async fn ungated(tag: &str) -> (TestEnv, Arc<WasmHandler>, Claimer) {
    static UNGATED: Once = Once::new();
    // SAFETY: set once, before any statement of these tests reads it; nothing else here sets
    // or reads the environment meanwhile.
    UNGATED.call_once(|| unsafe {
        std::env::set_var("IDEMHOST_FAILPOINT", "ungated");
        // The savepoint path's name, known to the tests (a plugin could learn it: see
        // `a_plugin_that_knows_the_savepoint_name_cannot_undo_a_claim`).
        std::env::set_var("IDEMHOST_TEST_SAVEPOINT_NAME", "idemhost_known");
    });
    testkit_behind_the_wall(tag).await
}

#[tokio::test]
async fn a_group_clears_the_session_between_deliveries() {
    let (env, plugin, c) = ungated("group_session").await;
    let leave = r#"{"steps":[
        {"query":"SELECT set_config('work_mem', '1MB', false)"},
        {"execute":"UPDATE pg_settings SET setting = 'off' WHERE name = 'synchronous_commit'"},
        {"query":"SELECT pg_advisory_lock(4242)"},
        {"execute":"CREATE TEMP TABLE leftover (a int)"},
        {"execute":"DECLARE held CURSOR WITH HOLD FOR SELECT 1"},
        {"execute":"LISTEN leftover"}
    ]}"#;
    // One bit for each kind of state still there.
    let bits = "+ (current_setting('work_mem') = '1MB')::int \
        + 2 * (current_setting('synchronous_commit') = 'off')::int \
        + 4 * (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())::int \
        + 8 * (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema())::int \
        + 16 * (SELECT count(*) FROM pg_cursors WHERE name = 'held')::int \
        + 32 * (SELECT count(*) FROM pg_listening_channels())::int \
        + 128 * (current_setting('lock_timeout') <> '50ms')::int \
        + 256 * (current_setting('statement_timeout') <> '5s')::int";
    assert_eq!(
        what_the_next_delivery_of_a_group_sees(&env, &c, plugin.as_ref(), leave, bits).await,
        64,
        "the second handler saw state the first one left (bits: 1 work_mem, 2 synchronous_commit, \
         4 advisory lock, 8 temp table, 16 cursor, 32 LISTEN; 128 and 256: the group's lock_timeout \
         and statement_timeout lost)"
    );
    env.cleanup().await;
}

/// A handler that makes its group's transaction read-only (`SET TRANSACTION READ ONLY`, which
/// nothing undoes inside it) does not fail the deliveries after it: the group is run again one
/// delivery per transaction, and each applies once.
#[tokio::test]
async fn a_read_only_turn_does_not_fail_the_rest_of_the_group() {
    let (env, plugin, c) = ungated("group_read_only").await;
    let turns = r#"{"steps":[
        {"execute":"UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"},
        {"execute":"SET TRANSACTION READ ONLY"}
    ]}"#;
    let writes = r#"{"steps":[{"execute":"UPDATE inventory SET reserved = reserved + 10 WHERE sku = 'sku-1'"}]}"#;
    let results = c
        .process_batch(
            plugin.as_ref(),
            &[message("turns-read-only", turns), message("writes", writes)],
        )
        .await;
    assert!(
        results.iter().all(|p| p.outcome == Outcome::Applied),
        "{results:?}"
    );
    assert_eq!(env.reserved("sku-1").await, 11, "each applied once");
    assert_eq!(env.markers(CONSUMER).await, 2);
    env.cleanup().await;
}

// The host depends on no advisory lock: the gate refuses them all now, and with it off a plugin
// holding the keys the host once used still stalls nothing.

/// A plugin cannot stall the host's own bookkeeping with advisory locks, which any session may
/// take under any key: while a delivery holds the key the host once serialized role
/// provisioning with (`hashtext('idemhost.provision')`, transaction-level, which the gate let
/// through), another host provisioning a consumer role in the same schema goes through at once
/// instead of waiting for the plugin's transaction to end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_holding_advisory_locks_cannot_stall_provisioning() {
    let (env, _, _) = ungated("advisory").await;
    let delivery = hold_advisory_key(&env, "hashtext('idemhost.provision')").await;
    let started = Instant::now();
    let other = env.plugin_role("other-v1");
    tokio::time::timeout(
        Duration::from_secs(2),
        idemhost::test_support::pg::wall::provision_role(&env.pool, "other-v1", &other, &[], None),
    )
    .await
    .expect("provisioning waited for the plugin's advisory lock")
    .unwrap();
    eprintln!(
        "provisioned beside the plugin's lock in {:?}",
        started.elapsed()
    );
    assert!(
        env.scalar(&format!(
            "SELECT count(*) FROM pg_roles WHERE rolname = '{other}'"
        ))
        .await
            == 1
    );
    assert_eq!(delivery.await.unwrap().outcome, Outcome::Applied);
    env.cleanup().await;
}

/// The same for the host's migrations: sqlx serializes them on an advisory key derived from the
/// database's name (`0x3d32ad9e × crc32(name)`), which a plugin can compute and hold. While a
/// delivery holds it, another host migrating the schema goes through at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_holding_the_migration_key_cannot_stall_migrations() {
    let (env, _, _) = ungated("migkey").await;
    let database: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    let key = 0x3d32ad9e_i64 * i64::from(crc32(database.as_bytes()));
    let delivery = hold_advisory_key(&env, &key.to_string()).await;
    let started = Instant::now();
    tokio::time::timeout(
        Duration::from_secs(2),
        idemhost::migrate(&env.pool, Some(&env.schema)),
    )
    .await
    .expect("migrating waited for the plugin's advisory lock")
    .unwrap();
    eprintln!(
        "migrated beside the plugin's lock in {:?}",
        started.elapsed()
    );
    assert_eq!(delivery.await.unwrap().outcome, Outcome::Applied);
    env.cleanup().await;
}

/// CRC-32 (ISO-HDLC, the zlib one), as sqlx derives its migration lock key.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Starts a delivery whose plugin takes the transaction-level advisory lock `key` (an SQL
/// expression) and keeps its transaction open 4 s; returns once the lock is held.
async fn hold_advisory_key(
    env: &TestEnv,
    key: &str,
) -> tokio::task::JoinHandle<idemhost::Processed> {
    let c = env
        .plugin_claimer(
            ClaimSettings::new(CONSUMER, Isolation::ReadCommitted),
            &["inventory"],
        )
        .await;
    let plugin = load_plugin("testkit", Duration::from_secs(10));
    let hold = format!(
        r#"{{"steps":[{{"query":"SELECT pg_advisory_xact_lock({key})"}},{{"query":"SELECT pg_sleep(4)"}}]}}"#
    );
    let delivery = tokio::spawn(async move {
        c.process(plugin.as_ref(), &message("evt-hold", &hold))
            .await
    });
    let plugin_role = env.plugin_role(CONSUMER);
    wait_until(Duration::from_secs(10), "the plugin holds its lock", || {
        let sql = format!(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
             WHERE l.locktype = 'advisory' AND l.granted AND a.usename = '{plugin_role}'"
        );
        async move { (env.scalar(&sql).await > 0).then_some(()) }
    })
    .await;
    delivery
}

/// With the gate off a plugin can end the host's transaction itself: `ROLLBACK` (taking the
/// claim with it), then write. Its next statement would run in a transaction of its own and
/// commit at once, without a marker, and the host's COMMIT would only warn. The host reads the
/// transaction status the server reports after every statement: the statement that ended the
/// transaction fails the attempt and closes the session, so nothing after it runs. Found by
/// review: before, the delivery was acked with its effect and no marker. `ROLLBACK AND CHAIN`
/// leaves a transaction open (a new one): the commit checks the claim's transaction id — inside
/// the session's clearing (migration 0012), and on a schema without that form of it (a host run
/// with `--no-migrate` on an older schema) with a statement of its own.
#[tokio::test]
async fn a_plugin_that_ends_the_transaction_commits_nothing_after_it() {
    let (env, plugin, mut c) = ungated("group_ended").await;
    for form in ["the clearing", "a statement"] {
        if form == "a statement" {
            env.execute("DROP FUNCTION idemhost_session_clear(text[], text[], boolean, text)")
                .await;
            c = env
                .plugin_claimer(
                    ClaimSettings::new(CONSUMER, Isolation::ReadCommitted),
                    &["inventory"],
                )
                .await;
        }
        for (id, end) in [
            ("rolls-back", "ROLLBACK"),
            ("commits", "COMMIT"),
            ("rolls-back-and-chains", "ROLLBACK AND CHAIN"),
        ] {
            let id = format!("{id}-{}", form.len());
            let steps = serde_json::json!({"steps": [
                {"execute": end},
                {"execute": "UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"}
            ]})
            .to_string();
            let p = c.process(plugin.as_ref(), &message(&id, &steps)).await;
            // Ended: refused at once (the session reports no transaction). Ended and another
            // begun: the commit finds another transaction than the claim's and fails.
            let failed = match end {
                "ROLLBACK AND CHAIN" => matches!(&p.outcome, Outcome::TerminalFailure(r)
                    if r.contains("not the one the delivery claimed in")),
                _ => matches!(p.outcome, Outcome::RetryableFailure(_)),
            };
            assert!(failed, "{form}: {id}: {p:?}");
        }
    }
    assert_eq!(env.reserved("sku-1").await, 0, "no write after the end");
    // The plugin's own COMMIT committed its claim (and nothing after it): a redelivery is a
    // duplicate. The rolled-back claims are gone.
    assert_eq!(
        env.scalar("SELECT count(*) FROM processed_message WHERE message_id LIKE 'commits-%'")
            .await,
        env.markers(CONSUMER).await
    );
    assert_eq!(env.markers(CONSUMER).await, 2, "one per form");
    env.cleanup().await;
}

/// A script that reserves `n` of `sku-1`.
fn reserve(n: i64) -> String {
    serde_json::json!({"steps": [{"execute": format!(
        "UPDATE inventory SET reserved = reserved + {n} WHERE sku = 'sku-1'"
    )}]})
    .to_string()
}

/// A delivery that fails on its own: its group runs again behind savepoints.
const SAVEPOINTS_NEXT: &str =
    r#"{"steps":[{"fail":"terminal","reason":"runs the group again with savepoints"}]}"#;

/// With the gate off, in a group run again behind savepoints (after a delivery failed on its
/// own), a plugin that knew the host's savepoint name could release its own and roll back to
/// the one before, taking its claim and keeping its later write. The name is drawn per
/// transaction now: the old one names no savepoint, the statement fails, and only that
/// delivery fails.
#[tokio::test]
async fn a_plugin_cannot_roll_back_past_its_own_savepoint() {
    let (env, plugin, c) = ungated("group_savepoint").await;
    let (write, fail) = (reserve, SAVEPOINTS_NEXT);
    let escape = serde_json::json!({"steps": [
        {"execute": "RELEASE SAVEPOINT idemhost_message"},
        {"execute": "ROLLBACK TO SAVEPOINT idemhost_message"},
        {"execute": "UPDATE inventory SET reserved = reserved + 100 WHERE sku = 'sku-1'"}
    ]})
    .to_string();
    let results = c
        .process_batch(
            plugin.as_ref(),
            &[
                message("writes-1", &write(1)),
                message("fails", fail),
                message("escapes", &escape),
            ],
        )
        .await;
    assert_eq!(results[0].outcome, Outcome::Applied, "{results:?}");
    assert!(
        !matches!(results[2].outcome, Outcome::Applied),
        "{results:?}"
    );
    assert_eq!(env.reserved("sku-1").await, 1, "{results:?}");
    assert_eq!(
        env.scalar("SELECT count(*) FROM processed_message WHERE message_id = 'writes-1'")
            .await,
        1
    );
    env.cleanup().await;
}

/// With the gate off, a plugin that learned the name of the host's savepoint in a group run
/// again behind savepoints (it shows in pg_stat_activity to the consumer's other sessions while
/// the SAVEPOINT runs; the test build names it for the tests) can roll back to it. Found by
/// review: rolling back to its own undid its claim and kept its later write (acked, the effect
/// without a marker); releasing its own first, it rolled back an earlier part's claim and
/// effect, and that part was reported applied (acked, its effect lost). Every part reported
/// applied must now still hold its claim before the commit; the group runs again one delivery
/// per transaction, where the host has no savepoint.
#[tokio::test]
async fn a_plugin_that_knows_the_savepoint_name_cannot_undo_a_claim() {
    let (env, plugin, c) = ungated("group_known_savepoint").await;
    let (write, fail) = (reserve, SAVEPOINTS_NEXT);
    let undo = |release: bool, n: i64| {
        let mut steps = Vec::new();
        if release {
            steps.push(serde_json::json!({"execute": "RELEASE SAVEPOINT idemhost_known"}));
        }
        steps.push(serde_json::json!({"execute": "ROLLBACK TO SAVEPOINT idemhost_known"}));
        let write: serde_json::Value = serde_json::from_str(&reserve(n)).unwrap();
        steps.push(write["steps"][0].clone());
        serde_json::json!({ "steps": steps }).to_string()
    };
    for (round, release, undone, own) in [(1, false, 1, 100), (2, true, 10, 1_000)] {
        let before = env.reserved("sku-1").await;
        let ids = [
            format!("writes-{round}"),
            format!("fails-{round}"),
            format!("undoes-{round}"),
        ];
        let results = c
            .process_batch(
                plugin.as_ref(),
                &[
                    message(&ids[0], &write(undone)),
                    message(&ids[1], fail),
                    message(&ids[2], &undo(release, own)),
                ],
            )
            .await;
        for (id, result) in ids.iter().zip(&results) {
            let markers = env
                .scalar(&format!(
                    "SELECT count(*) FROM processed_message WHERE message_id = '{id}'"
                ))
                .await;
            assert_eq!(
                result.outcome == Outcome::Applied,
                markers == 1,
                "round {round}, {id}: {results:?}"
            );
        }
        assert_eq!(results[0].outcome, Outcome::Applied, "{results:?}");
        assert_ne!(results[2].outcome, Outcome::Applied, "{results:?}");
        assert_eq!(
            env.reserved("sku-1").await - before,
            undone,
            "round {round}: {results:?}"
        );
    }
    env.cleanup().await;
}

/// With the gate off a plugin can deallocate the statements sqlx keeps prepared on its session
/// and prepare its own under their names: a host statement run by name after that runs the
/// plugin's SQL with the host's parameters — the host key first. Found by review: the outbox
/// insert (run while the handler holds the session) and, in a group, the clearing between two
/// deliveries and the next part's claim. Every host statement that runs after plugin code in a
/// transaction is now unnamed or simple: the hijack takes nothing, the session it spoilt is
/// closed, the group's next handler sees no state the first left, and the key is not stolen.
#[tokio::test]
async fn a_plugin_cannot_take_over_the_hosts_prepared_statements() {
    let (env, plugin, _) = ungated("group_hijack").await;
    let mut settings = ClaimSettings::new(CONSUMER, Isolation::ReadCommitted);
    settings.publish_subjects = Arc::from(vec![">".to_string()]);
    let c = env.plugin_claimer(settings, &["inventory"]).await;
    // Every statement sqlx prepared on this session, replaced: with parameters, by one that
    // writes its first into `inventory` and answers like a successful claim; without, by one
    // that answers `false` (as the clearing does when there is nothing it cannot undo).
    let hijack = "DO $$ DECLARE r record; BEGIN \
        FOR r IN SELECT name, parameter_types FROM pg_prepared_statements WHERE NOT from_sql LOOP \
          EXECUTE format('DEALLOCATE %I', r.name); \
          IF cardinality(r.parameter_types) > 0 THEN \
            EXECUTE format('PREPARE %I(%s) AS WITH w AS (INSERT INTO inventory VALUES ($1::text, 0, 0)) \
              SELECT true, pg_backend_pid(), pg_current_xact_id_if_assigned()::text', \
              r.name, array_to_string(r.parameter_types::text[], ',')); \
          ELSE \
            EXECUTE format('PREPARE %I AS SELECT false', r.name); \
          END IF; \
        END LOOP; END $$";
    let publish = serde_json::json!({"publish": "hijack.events", "payload": "{}"});
    let alone = serde_json::json!({"steps": [
        publish.clone(),
        {"execute": hijack},
        publish,
        {"execute": "UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"}
    ]})
    .to_string();
    let p = c
        .process(plugin.as_ref(), &message("hijack-alone", &alone))
        .await;
    assert_eq!(p.outcome, Outcome::Applied, "{p:?}");
    // In a group: the hijacker leaves a setting, the next handler records what it sees.
    let leave = serde_json::json!({"steps": [
        {"execute": "UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"},
        {"query": "SELECT set_config('work_mem', '1MB', false)"},
        {"execute": hijack}
    ]})
    .to_string();
    let record = serde_json::json!({"steps": [{"execute": "UPDATE inventory SET reserved = \
        reserved + 100 + 1000 * (current_setting('work_mem') = '1MB')::int WHERE sku = 'sku-1'"}]})
    .to_string();
    let record = record.as_str();
    let fails = r#"{"steps":[{"execute":"SELECT 1/0"}]}"#;
    for (tag, group) in [
        (
            "first pass",
            vec![("g1-leave", leave.as_str()), ("g1-record", record)],
        ),
        // A part that fails on its own sends the group round again behind savepoints, where
        // each part has a claim of its own.
        (
            "savepoints",
            vec![
                ("g2-leave", leave.as_str()),
                ("g2-fails", fails),
                ("g2-record", record),
            ],
        ),
    ] {
        let messages: Vec<_> = group.iter().map(|(id, steps)| message(id, steps)).collect();
        let results = c.process_batch(plugin.as_ref(), &messages).await;
        for ((id, _), p) in group.iter().zip(&results) {
            let expected = if id.ends_with("fails") {
                !matches!(p.outcome, Outcome::Applied)
            } else {
                p.outcome == Outcome::Applied
            };
            assert!(expected, "{tag}: {id}: {p:?}");
        }
    }
    let key = env.host_key().await;
    assert_eq!(
        env.scalar(&format!(
            "SELECT count(*) FROM inventory WHERE sku = '{key}'"
        ))
        .await,
        0,
        "the host key was written by the plugin's statement"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM inventory WHERE sku <> 'sku-1'")
            .await,
        0,
        "no hijacked statement ran"
    );
    // 1 (alone) + 2 × (1 + 100): each applied once, and no handler saw work_mem = 1MB.
    assert_eq!(env.reserved("sku-1").await, 203);
    assert_eq!(
        env.markers(CONSUMER).await,
        5,
        "a marker for each applied delivery"
    );
    env.cleanup().await;
}

/// In a group sent round again behind savepoints (one part failed on its own), a plugin that
/// ends the transaction and begins another (`ROLLBACK AND CHAIN`, gate off) rolls back the
/// earlier parts' claims and effects; the next part's claim then runs in the new transaction.
/// The host kept the last claim's transaction id, so the commit passed and the earlier parts
/// were reported applied with nothing committed (review). A claim that reports another
/// transaction than the first one now fails: no delivery is reported applied without its
/// marker and its effect.
#[tokio::test]
async fn a_chained_rollback_in_a_group_reports_nothing_applied_it_undid() {
    let (env, plugin, c) = ungated("group_chain").await;
    let write = |n: i64| {
        serde_json::json!({"steps": [{"execute": format!(
            "UPDATE inventory SET reserved = reserved + {n} WHERE sku = 'sku-1'"
        )}]})
        .to_string()
    };
    let chain = serde_json::json!({"steps": [
        {"execute": "UPDATE inventory SET reserved = reserved + 10 WHERE sku = 'sku-1'"},
        {"execute": "ROLLBACK AND CHAIN"},
        {"execute": "UPDATE inventory SET reserved = reserved + 100 WHERE sku = 'sku-1'"}
    ]})
    .to_string();
    let group = [
        ("c-first", write(1)),
        (
            "c-fails",
            r#"{"steps":[{"execute":"SELECT 1/0"}]}"#.to_string(),
        ),
        ("c-chain", chain),
        ("c-after", write(1000)),
    ];
    let messages: Vec<_> = group.iter().map(|(id, steps)| message(id, steps)).collect();
    let results = c.process_batch(plugin.as_ref(), &messages).await;
    let mut applied = 0;
    let mut expected = 0;
    for ((id, _), p) in group.iter().zip(&results) {
        if p.outcome == Outcome::Applied {
            applied += 1;
            expected += match *id {
                "c-first" => 1,
                "c-after" => 1000,
                other => panic!("{other} applied: {p:?}"),
            };
            let marker = env
                .scalar(&format!(
                    "SELECT count(*) FROM processed_message WHERE message_id = '{id}'"
                ))
                .await;
            assert_eq!(
                marker, 1,
                "{id} reported applied without its marker: {results:?}"
            );
        }
    }
    assert_eq!(env.markers(CONSUMER).await, applied, "{results:?}");
    assert_eq!(env.reserved("sku-1").await, expected, "{results:?}");
    env.cleanup().await;
}

/// With the gate off a plugin can `DEALLOCATE ALL`: the statements the driver prepared on its
/// session are gone while the driver still counts on them, and every later claim on that kept
/// connection failed (26000) until it aged out — good messages of the consumer burnt attempts
/// and could be dead-lettered. Such a failure now closes the connection: only the next
/// delivery on it fails once, and every message applies.
#[tokio::test]
async fn a_deallocated_session_is_closed_not_kept() {
    let (env, plugin, c) = ungated("group_dealloc").await;
    let drop_all = r#"{"steps":[{"execute":"DEALLOCATE ALL"},{"execute":"UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"}]}"#;
    let write = r#"{"steps":[{"execute":"UPDATE inventory SET reserved = reserved + 10 WHERE sku = 'sku-1'"}]}"#;
    let first = c
        .process(plugin.as_ref(), &message("d-first", drop_all))
        .await;
    assert_eq!(first.outcome, Outcome::Applied, "{first:?}");
    let mut failed = 0;
    for i in 0..6 {
        let id = format!("d-{i}");
        let p = c.process(plugin.as_ref(), &message(&id, write)).await;
        if p.outcome != Outcome::Applied {
            failed += 1;
            let again = c.process(plugin.as_ref(), &message(&id, write)).await;
            assert_eq!(again.outcome, Outcome::Applied, "{id} again: {again:?}");
        }
    }
    assert!(
        failed <= 1,
        "{failed} deliveries failed on the spoilt connection"
    );
    assert_eq!(env.reserved("sku-1").await, 61);
    assert_eq!(env.markers(CONSUMER).await, 7);
    env.cleanup().await;
}

/// SQL-level prepared statements a handler leaves are looked for once per group, by its commit
/// (the clearing between two handlers no longer lists them: that was most of its cost). The
/// commit then fails and the group runs again one delivery per transaction, so nothing a later
/// handler did while it could see them is committed.
#[tokio::test]
async fn a_prepared_statement_left_in_a_group_reaches_nothing_committed() {
    let (env, plugin, c) = ungated("group_prepared").await;
    let leave = r#"{"steps":[
        {"execute":"UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"},
        {"execute":"PREPARE left_behind AS SELECT 1"}
    ]}"#;
    let record = serde_json::json!({"steps": [{"execute": "UPDATE inventory SET reserved = \
        reserved + 100 + 1000 * (SELECT count(*) FROM pg_prepared_statements WHERE from_sql)::int \
        WHERE sku = 'sku-1'"}]})
    .to_string();
    let record = record.as_str();
    let results = c
        .process_batch(
            plugin.as_ref(),
            &[message("leaves", leave), message("records", record)],
        )
        .await;
    assert!(
        results.iter().all(|p| p.outcome == Outcome::Applied),
        "{results:?}"
    );
    assert_eq!(
        env.reserved("sku-1").await,
        101,
        "each applied once, and the second saw no prepared statement"
    );
    env.cleanup().await;
}

/// A group claims all its deliveries up front. A plugin that ends the transaction itself
/// (`COMMIT`, gate off) in the first delivery committed the claims of the later ones, whose
/// handlers had not run: their redeliveries were duplicates and their effects lost (found by
/// `wall.rs`, depending on how deliveries fell into groups). The group's seal (migration 0014)
/// fails any commit but the host's: nothing of the group commits, and the later deliveries
/// apply.
#[tokio::test]
async fn a_plugin_commit_does_not_commit_its_groups_later_claims() {
    let (env, plugin, c) = ungated("group_commit_early").await;
    for end in ["COMMIT", "COMMIT AND CHAIN", "END"] {
        let early = serde_json::json!({"steps": [{"execute": end}]}).to_string();
        let later = r#"{"steps":[{"execute":"UPDATE inventory SET reserved = reserved + 10 WHERE sku = 'sku-1'"}]}"#;
        let tag = end.replace(' ', "-").to_lowercase();
        let before = env.reserved("sku-1").await;
        let results = c
            .process_batch(
                plugin.as_ref(),
                &[
                    message(&format!("{tag}-early"), &early),
                    message(&format!("{tag}-later-1"), later),
                    message(&format!("{tag}-later-2"), later),
                ],
            )
            .await;
        assert!(
            results[1..].iter().all(|p| p.outcome == Outcome::Applied),
            "{end}: {results:?}"
        );
        assert_eq!(
            env.reserved("sku-1").await - before,
            20,
            "{end}: each applied once"
        );
    }
    env.cleanup().await;
}

/// The clearing between a group's handlers is statements prepared once per session. A plugin
/// (gate off) can replace one with its own under the same name (`DEALLOCATE` + `PREPARE`): one
/// that does nothing, so the next handler sees the last one's settings, deallocated again
/// before the commit so that the commit finds no prepared statement of its; or one that returns
/// rows without end, for the host to keep (found by review). The commit checks that every one
/// of them is there as the host prepared it, and the host keeps a few small rows of them at
/// most: nothing a handler saw of another's session is committed, and each applies once.
#[tokio::test]
async fn a_plugin_cannot_replace_the_groups_clearing() {
    let (env, plugin, c) = ungated("group_replace").await;
    let plain = r#"{"steps":[{"execute":"UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"}]}"#;
    // Every statement the host prepared that is one of the clearing's, replaced.
    let replace = |with: &str| {
        format!(
            "DO $$ DECLARE r record; BEGIN \
             FOR r IN SELECT name FROM pg_prepared_statements WHERE NOT from_sql \
               AND (statement IN ('RESET ALL', 'DISCARD TEMP', 'CLOSE ALL', 'UNLISTEN *') \
                    OR statement LIKE 'SELECT pg_catalog.current_setting(''transaction_read_only'')%') LOOP \
               EXECUTE format('DEALLOCATE %I', r.name); \
               EXECUTE format('PREPARE %I AS {with}', r.name); \
             END LOOP; END $$"
        )
    };
    let hide = "DO $$ DECLARE r record; BEGIN \
        FOR r IN SELECT name FROM pg_prepared_statements WHERE from_sql LOOP \
          EXECUTE format('DEALLOCATE %I', r.name); END LOOP; END $$";
    let record = serde_json::json!({"steps": [
        {"execute": "UPDATE inventory SET reserved = reserved + 100 \
            + 1000 * (current_setting('work_mem') = '1MB')::int WHERE sku = 'sku-1'"},
        {"execute": hide}
    ]})
    .to_string();
    let mut expected = 0;
    for (round, with) in [
        "SELECT false",
        "SELECT false",
        "SELECT repeat(''x'', 100000) FROM generate_series(1, 1000)",
    ]
    .into_iter()
    .enumerate()
    {
        // A group first, so that the clearing's statements are prepared on the session.
        let warm: Vec<_> = (0..2)
            .map(|i| message(&format!("warm-{round}-{i}"), plain))
            .collect();
        let results = c.process_batch(plugin.as_ref(), &warm).await;
        assert!(
            results.iter().all(|p| p.outcome == Outcome::Applied),
            "{results:?}"
        );
        expected += 2;
        let leave = serde_json::json!({"steps": [
            {"execute": "UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-1'"},
            {"query": "SELECT set_config('work_mem', '1MB', false)"},
            {"execute": replace(with)}
        ]})
        .to_string();
        let group = [
            message(&format!("leave-{round}"), &leave),
            message(&format!("record-{round}"), &record),
        ];
        let results = c.process_batch(plugin.as_ref(), &group).await;
        assert!(
            results.iter().all(|p| p.outcome == Outcome::Applied),
            "{with}: {results:?}"
        );
        expected += 101;
        assert_eq!(
            env.reserved("sku-1").await,
            expected,
            "{with}: each applied once, and no committed handler saw work_mem = 1MB"
        );
    }
    env.cleanup().await;
}
