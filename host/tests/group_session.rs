//! Deliveries of a group-commit transaction share the transaction, not what their plugin left
//! in the session. With the SQL gate off (the `ungated` failpoint: what PostgreSQL's walls hold
//! on their own, as `wall.rs` checks for deliveries each in its own transaction), the first
//! delivery's handler changes every kind of session state the gate would have refused; the
//! second one's handler, in the same transaction, records what it still sees. Alone in its test
//! binary: the failpoint is read once per process.

mod common;

use std::time::Duration;

use common::*;
use idemhost::{ClaimSettings, Isolation, Outcome};

const CONSUMER: &str = "testkit-v1";

#[tokio::test]
async fn a_group_clears_the_session_between_deliveries() {
    // SAFETY: set before any thread of this test reads the environment; the only test here.
    unsafe { std::env::set_var("IDEMHOST_FAILPOINT", "ungated") };
    let env = TestEnv::new("group_session").await;
    env.seed_inventory(&[("sku-1", 1_000)]).await;
    let plugin = load_plugin("testkit", Duration::from_secs(5));
    let c = env
        .plugin_claimer(
            ClaimSettings::new(CONSUMER, Isolation::ReadCommitted),
            &["inventory"],
        )
        .await;
    let leave = r#"{"steps":[
        {"query":"SELECT set_config('work_mem', '1MB', false)"},
        {"execute":"UPDATE pg_settings SET setting = 'off' WHERE name = 'synchronous_commit'"},
        {"query":"SELECT pg_advisory_lock(4242)"},
        {"execute":"CREATE TEMP TABLE leftover (a int)"},
        {"execute":"DECLARE held CURSOR WITH HOLD FOR SELECT 1"},
        {"execute":"LISTEN leftover"}
    ]}"#;
    // 64, plus one bit for each kind of state still there.
    let sql = "UPDATE inventory SET reserved = 64 \
        + (current_setting('work_mem') = '1MB')::int \
        + 2 * (current_setting('synchronous_commit') = 'off')::int \
        + 4 * (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())::int \
        + 8 * (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema())::int \
        + 16 * (SELECT count(*) FROM pg_cursors WHERE name = 'held')::int \
        + 32 * (SELECT count(*) FROM pg_listening_channels())::int \
        + 128 * (current_setting('lock_timeout') <> '50ms')::int \
        + 256 * (current_setting('statement_timeout') <> '5s')::int \
        WHERE sku = 'sku-1'";
    let record = serde_json::json!({"steps": [{"execute": sql}]}).to_string();
    let results = c
        .process_batch(
            plugin.as_ref(),
            &[
                message("leaves-state", leave),
                message("records-state", &record),
            ],
        )
        .await;
    assert!(
        results
            .iter()
            .all(|p| p.outcome == Outcome::Applied && p.tx_attempts == 1),
        "one group: {results:?}"
    );
    assert_eq!(
        env.reserved("sku-1").await,
        64,
        "the second handler saw state the first one left (bits: 1 work_mem, 2 synchronous_commit, \
         4 advisory lock, 8 temp table, 16 cursor, 32 LISTEN; 128 and 256: the group's lock_timeout \
         and statement_timeout lost)"
    );
    env.cleanup().await;
}
