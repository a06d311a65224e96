//! The connections a consumer keeps between deliveries (`pg::Connections`): they age out like
//! the pool's own, a failure about the session closes the connection instead of keeping it, and
//! a COMMIT in a transaction an error aborted is a failed commit, never a silent rollback.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use idemhost::test_support::pg::{Connections, Wall};
use sqlx::Row as _;
use sqlx::postgres::PgPoolOptions;

use common::*;

const BEGIN: &str = "BEGIN; SELECT pg_backend_pid()";

async fn begin_pid(conns: &std::sync::Arc<Connections>) -> (idemhost::test_support::pg::Tx, i32) {
    let (tx, rows) = conns.begin(BEGIN).await.unwrap();
    let pid: i32 = rows.last().unwrap().try_get(0).unwrap();
    (tx, pid)
}

/// A pool whose connections live `lifetime`; one connection kept.
async fn kept(env: &TestEnv, lifetime: Option<Duration>) -> std::sync::Arc<Connections> {
    let options =
        idemhost::test_support::pg::connect_options(&PG_URL, Some(&env.schema), &env.schema)
            .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .max_lifetime(lifetime)
        .connect_with(options)
        .await
        .unwrap();
    Connections::new(pool, 1)
}

#[tokio::test]
async fn a_kept_connection_ages_out_with_the_pools_max_lifetime() {
    let env = TestEnv::new("kept_age").await;
    let conns = kept(&env, Some(Duration::from_secs(1))).await;
    let mut pids = HashSet::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(3500) {
        let (tx, pid) = begin_pid(&conns).await;
        pids.insert(pid);
        tx.commit_with("COMMIT").await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        pids.len() >= 3,
        "a connection kept for 3.5 s with a 1 s max_lifetime: backends {pids:?}"
    );
    // Without a lifetime the same connection is kept (the ageing is the pool's, not churn).
    let forever = kept(&env, None).await;
    let mut pids = HashSet::new();
    for _ in 0..20 {
        let (tx, pid) = begin_pid(&forever).await;
        pids.insert(pid);
        tx.commit_with("COMMIT").await.unwrap();
    }
    assert_eq!(pids.len(), 1, "{pids:?}");
    env.cleanup().await;
}

/// A transaction that fails for a reason about the session (25006, 57P01, 55000) closes its
/// connection; a failure about the statement keeps it; any refusal of the host's own `BEGIN`
/// statements closes it.
#[tokio::test]
async fn a_failure_about_the_session_closes_the_kept_connection() {
    let env = TestEnv::new("kept_session").await;
    let conns = kept(&env, None).await;
    let (tx, first) = begin_pid(&conns).await;
    tx.commit_with("COMMIT").await.unwrap();

    // A statement's failure in the transaction: the connection stays.
    let (mut tx, before) = begin_pid(&conns).await;
    let err = sqlx::raw_sql("SELECT 1/0")
        .execute(&mut *tx)
        .await
        .unwrap_err();
    assert!(!idemhost::test_support::pg::session_failed(&err));
    tx.note_failure(&err);
    tx.rollback().await.unwrap();
    assert_eq!(before, first);
    let (tx, same) = begin_pid(&conns).await;
    tx.commit_with("COMMIT").await.unwrap();
    assert_eq!(same, first, "a statement's failure keeps the connection");

    // A failure about the session, later in the transaction (the claim's path): closed.
    for code in ["25006", "57P01", "55000"] {
        let (mut tx, before) = begin_pid(&conns).await;
        let err = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DO $$ BEGIN RAISE EXCEPTION 'session' USING ERRCODE = '{code}'; END $$"
        )))
        .execute(&mut *tx)
        .await
        .unwrap_err();
        assert!(idemhost::test_support::pg::session_failed(&err), "{code}");
        tx.note_failure(&err);
        tx.rollback().await.unwrap();
        let (tx, after) = begin_pid(&conns).await;
        tx.commit_with("COMMIT").await.unwrap();
        assert_ne!(after, before, "after {code} the connection is not kept");
    }

    // The begin statements refused: closed.
    let (tx, before) = begin_pid(&conns).await;
    tx.commit_with("COMMIT").await.unwrap();
    assert!(conns.begin("BEGIN; SELECT 1/0").await.is_err());
    let (tx, after) = begin_pid(&conns).await;
    tx.commit_with("COMMIT").await.unwrap();
    assert_ne!(after, before, "a refused BEGIN closes the connection");
    env.cleanup().await;
}

/// A real standby (a private primary and its streaming replica): `BEGIN ... READ WRITE` is
/// refused (0A000, "during recovery"), and the kept connection that met it is closed, not
/// offered to the next delivery.
#[tokio::test]
async fn a_connection_to_a_standby_is_not_kept() {
    let primary = PrivatePostgres::start();
    let standby = PrivatePostgres::standby_of(&primary);
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&standby.url())
        .await
        .unwrap();
    let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(in_recovery);
    let conns = Connections::new(pool, 1);
    let (tx, before) = begin_pid(&conns).await;
    tx.commit_with("COMMIT").await.unwrap();
    let err = conns
        .begin("BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE")
        .await
        .err()
        .expect("a standby refuses READ WRITE");
    assert_eq!(
        err.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("0A000"),
        "{err}"
    );
    let (tx, after) = begin_pid(&conns).await;
    tx.commit_with("COMMIT").await.unwrap();
    assert_ne!(
        after, before,
        "the connection that met the standby's refusal was closed"
    );
    conns.pool().close().await;
}

/// PostgreSQL answers COMMIT in an aborted transaction with the tag ROLLBACK and no error. The
/// host's commit statement must turn that into an error (no ack), and nothing may commit.
#[tokio::test]
async fn a_commit_of_an_aborted_transaction_fails() {
    let env = TestEnv::new("kept_commit").await;
    env.execute("CREATE TABLE effects (id int)").await;
    let wall = Wall::load(
        &env.pool,
        idemhost::Isolation::ReadCommitted,
        Duration::from_secs(5),
        None,
    )
    .await
    .unwrap();
    let conns = Connections::new(env.pool.clone(), 1);

    // What a bare COMMIT does: no error, nothing committed.
    let (mut tx, _) = conns.begin(wall.begin_sql()).await.unwrap();
    sqlx::raw_sql("INSERT INTO effects VALUES (1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert!(sqlx::raw_sql("SELECT 1/0").execute(&mut *tx).await.is_err());
    assert!(
        tx.commit_with("COMMIT").await.is_ok(),
        "PostgreSQL's behaviour changed"
    );

    // The host's commit: an error.
    let (mut tx, _) = conns.begin(wall.begin_sql()).await.unwrap();
    sqlx::raw_sql("INSERT INTO effects VALUES (2)")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert!(sqlx::raw_sql("SELECT 1/0").execute(&mut *tx).await.is_err());
    let err = tx.commit_with(wall.commit_sql()).await.unwrap_err();
    assert_eq!(
        err.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("25P02"),
        "{err}"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM effects").await, 0);

    // And a healthy transaction still commits through it.
    let (mut tx, _) = conns.begin(wall.begin_sql()).await.unwrap();
    sqlx::raw_sql("INSERT INTO effects VALUES (3)")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit_with(wall.commit_sql()).await.unwrap();
    assert_eq!(env.scalar("SELECT count(*) FROM effects").await, 1);
    env.cleanup().await;
}
