//! The connections a consumer keeps between deliveries (`pg::Connections`): they age out like
//! the pool's own, a failure about the session closes the connection instead of keeping it, and
//! a COMMIT in a transaction an error aborted is a failed commit, never a silent rollback.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use idemhost::test_support::pg::{Connections, Wall};
use sqlx::Row as _;
use sqlx::postgres::PgPoolOptions;

use crate::common::*;

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
        tx.commit_plain("COMMIT").await.unwrap();
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
        tx.commit_plain("COMMIT").await.unwrap();
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
    tx.commit_plain("COMMIT").await.unwrap();

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
    tx.commit_plain("COMMIT").await.unwrap();
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
        tx.commit_plain("COMMIT").await.unwrap();
        assert_ne!(after, before, "after {code} the connection is not kept");
    }

    // The begin statements refused: closed.
    let (tx, before) = begin_pid(&conns).await;
    tx.commit_plain("COMMIT").await.unwrap();
    assert!(conns.begin("BEGIN; SELECT 1/0").await.is_err());
    let (tx, after) = begin_pid(&conns).await;
    tx.commit_plain("COMMIT").await.unwrap();
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
    tx.commit_plain("COMMIT").await.unwrap();
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
    tx.commit_plain("COMMIT").await.unwrap();
    assert_ne!(
        after, before,
        "the connection that met the standby's refusal was closed"
    );
    conns.pool().close().await;
}

/// The wall of `env`'s schema, as a READ COMMITTED consumer with a 5 s statement timeout sees it.
async fn wall(env: &TestEnv) -> Wall {
    Wall::load(
        &env.pool,
        idemhost::Isolation::ReadCommitted,
        Duration::from_secs(5),
        None,
    )
    .await
    .unwrap()
}

/// A transaction that writes, then fails a statement, and is ended with the wall's commit: the
/// commit fails with 25P02 (in failed transaction), and nothing of it commits.
async fn aborted_commit_fails(conns: &std::sync::Arc<Connections>, wall: &Wall, what: &str) {
    let (mut tx, _) = conns.begin(wall.begin_sql()).await.unwrap();
    sqlx::raw_sql("INSERT INTO effects VALUES (2)")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert!(sqlx::raw_sql("SELECT 1/0").execute(&mut *tx).await.is_err());
    let err = tx.commit_plain(wall.commit_sql()).await.unwrap_err();
    assert_eq!(
        err.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("25P02"),
        "{what}: {err}"
    );
}

/// PostgreSQL answers COMMIT in an aborted transaction with the tag ROLLBACK and no error. The
/// host's commit statement must turn that into an error (no ack), and nothing may commit.
#[tokio::test]
async fn a_commit_of_an_aborted_transaction_fails() {
    let env = TestEnv::new("kept_commit").await;
    env.execute("CREATE TABLE effects (id int)").await;
    let wall = wall(&env).await;
    let conns = Connections::new(env.pool.clone(), 1);

    // What a bare COMMIT does: no error, nothing committed.
    let (mut tx, _) = conns.begin(wall.begin_sql()).await.unwrap();
    sqlx::raw_sql("INSERT INTO effects VALUES (1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert!(sqlx::raw_sql("SELECT 1/0").execute(&mut *tx).await.is_err());
    assert!(
        tx.commit_plain("COMMIT").await.is_ok(),
        "PostgreSQL's behaviour changed"
    );

    // The host's commit: an error.
    aborted_commit_fails(&conns, &wall, "the host's commit").await;
    assert_eq!(env.scalar("SELECT count(*) FROM effects").await, 0);

    // And a healthy transaction still commits through it.
    let (mut tx, _) = conns.begin(wall.begin_sql()).await.unwrap();
    sqlx::raw_sql("INSERT INTO effects VALUES (3)")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit_plain(wall.commit_sql()).await.unwrap();
    assert_eq!(env.scalar("SELECT count(*) FROM effects").await, 1);
    env.cleanup().await;
}

/// The plugin role's sessions of the consumers a host ran (`pg_stat_activity`).
async fn role_sessions(env: &TestEnv, role: &str) -> i64 {
    env.scalar(&format!(
        "SELECT count(*) FROM pg_stat_activity WHERE usename = '{role}'"
    ))
    .await
}

/// A `Host::run` that returned has closed every connection it opened, its plugins' role pools
/// included: an embedder runs hosts one after another in its own process (`idemhost bench`
/// does), and each run used to leave its plugin role's pool open (90 idle sessions after nine
/// runs, then `too many clients already`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_returned_leaves_no_session_open() {
    let env = TestEnv::new("closes").await;
    env.seed_inventory(&[("sku-1", 1_000)]).await;
    let nats = NatsEnv::new("closes", Duration::from_millis(100)).await;
    let consumer = "closes-v1";
    let role = env.plugin_role(consumer);
    for run in 0..3 {
        let host = RunningHost::start(idemhost::Host::new(config(
            &env,
            &nats,
            consumer,
            "inventory",
            "max_in_flight = 4\nbatch_max = 1",
        )));
        for i in 0..8 {
            let id = format!("evt-{run}-{i}");
            nats.publish(Some(&id), &order_payload(&id, "sku-1", 1))
                .await;
        }
        wait_until(Duration::from_secs(30), "the run's deliveries", || async {
            (env.markers(consumer).await == 8 * (run + 1)).then_some(())
        })
        .await;
        assert!(
            role_sessions(&env, &role).await > 0,
            "the deliveries ran on the role's sessions"
        );
        host.stop().await;
        // The pool's Terminate reaches the server before `run` returns; the backend may take a
        // moment to leave pg_stat_activity.
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut open = role_sessions(&env, &role).await;
        while open > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            open = role_sessions(&env, &role).await;
        }
        assert_eq!(open, 0, "run {run}: the plugin role's sessions are closed");
    }
    nats.cleanup().await;
    env.cleanup().await;
}

/// The session's clearing as a delivery commits, in each of its forms: the call of
/// `idemhost_session_clear` that also checks the claim (migration 0012), the call without that
/// check (0010) and, on a schema migrated before 0010 (a host run with `--no-migrate`), the
/// statements it replaced. Either way a setting, a temporary table, a held cursor, a LISTEN and
/// a session advisory lock left by the delivery are gone after its COMMIT, the effect
/// committed, and a commit of an aborted transaction fails.
#[tokio::test]
async fn both_forms_of_the_clearing_clear_the_session() {
    let env = TestEnv::new("kept_clear").await;
    env.execute("CREATE TABLE effects (id int)").await;
    for form in ["checking", "function", "statements"] {
        match form {
            "function" => {
                env.execute("DROP FUNCTION idemhost_session_clear(text[], text[], boolean, text)")
                    .await
            }
            "statements" => {
                env.execute("DROP FUNCTION idemhost_session_clear(text[], text[], boolean)")
                    .await
            }
            _ => {}
        }
        let wall = wall(&env).await;
        assert_eq!(
            wall.commit_sql().contains("idemhost_session_clear"),
            form != "statements",
            "{form}: {}",
            wall.commit_sql()
        );
        assert_eq!(
            wall.commit_sql()
                .contains(", false, NULL::pg_catalog.text)"),
            form == "checking",
            "{form}: {}",
            wall.commit_sql()
        );
        let conns = Connections::new(env.pool.clone(), 1);
        let (mut tx, _) = conns.begin(wall.begin_sql()).await.unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        sqlx::raw_sql(
            "INSERT INTO effects VALUES (1);
             SELECT set_config('work_mem', '1MB', false);
             SELECT set_config('synchronous_commit', 'off', true);
             CREATE TEMP TABLE leftover (a int);
             DECLARE held CURSOR WITH HOLD FOR SELECT 1;
             LISTEN leftover;
             SELECT pg_advisory_lock(4243);",
        )
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit_plain(wall.commit_sql()).await.unwrap();
        // The kept connection again: the same session.
        let (mut tx, _) = conns.begin("BEGIN").await.unwrap();
        let seen: (i32, String, i64, i64, i64, i64) = sqlx::query_as(
            "SELECT pg_backend_pid(), current_setting('work_mem'), \
             (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()), \
             (SELECT count(*) FROM pg_cursors WHERE name = 'held'), \
             (SELECT count(*) FROM pg_listening_channels()), \
             (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())",
        )
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        tx.rollback().await.unwrap();
        assert_eq!(seen.0, pid, "{form}: the same session");
        assert_ne!(seen.1, "1MB", "{form}: the setting is reset");
        assert_eq!(
            (seen.2, seen.3, seen.4, seen.5),
            (0, 0, 0, 0),
            "{form}: temporary table, cursor, LISTEN, advisory lock"
        );
        aborted_commit_fails(&conns, &wall, form).await;
    }
    assert_eq!(env.scalar("SELECT count(*) FROM effects").await, 3);
    env.cleanup().await;
}

/// A pool of the consumer's own (a plugin role's) of `size` connections, all of them kept.
async fn own_pool(env: &TestEnv, size: u32) -> std::sync::Arc<Connections> {
    let options =
        idemhost::test_support::pg::connect_options(&PG_URL, Some(&env.schema), &env.schema)
            .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .unwrap();
    Connections::of_own_pool(pool, size as usize)
}

/// Under load a consumer's own pool has no connection left (each is in a delivery); its
/// connections stay kept all the same, instead of going back to the pool, which checks each one
/// with a round trip as it is given back and another as it is taken: two of a delivery's six
/// round trips before.
#[tokio::test]
async fn an_own_pools_connections_stay_kept_under_load() {
    let env = TestEnv::new("kept_load").await;
    let conns = own_pool(&env, 2).await;
    let mut pids = HashSet::new();
    for _ in 0..20 {
        // Both connections in a transaction at once: the pool is exhausted as each ends.
        let ((a, pa), (b, pb)) = tokio::join!(begin_pid(&conns), begin_pid(&conns));
        a.commit_plain("COMMIT").await.unwrap();
        b.commit_plain("COMMIT").await.unwrap();
        pids.extend([pa, pb]);
    }
    assert_eq!(pids.len(), 2, "the same two sessions throughout: {pids:?}");
    assert_eq!(conns.pool().size(), 2);
    // A connection given back to the pool shows there as idle once its check answered.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        conns.pool().num_idle(),
        0,
        "connections went back to the pool (each with its round trips) instead of being kept"
    );
    conns.pool().close().await;
}

/// A transaction waiting for a connection of the consumer's own pool takes one a finished
/// transaction keeps, at once: nobody else would give the pool one back, and waiting on the pool
/// alone would wait out its `acquire_timeout` (5 s here) while the connection sits kept.
#[tokio::test]
async fn a_transaction_waiting_on_an_own_pool_takes_a_kept_connection() {
    let env = TestEnv::new("kept_wait").await;
    let conns = own_pool(&env, 2).await;
    // Both connections in a transaction, two more transactions waiting, then both end at once.
    let ((first, p1), (second, p2)) = tokio::join!(begin_pid(&conns), begin_pid(&conns));
    let waiting: Vec<_> = (0..2)
        .map(|_| {
            let conns = conns.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let (tx, pid) = begin_pid(&conns).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
                tx.commit_plain("COMMIT").await.unwrap();
                (started.elapsed(), pid)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (a, b) = tokio::join!(first.commit_plain("COMMIT"), second.commit_plain("COMMIT"));
    a.unwrap();
    b.unwrap();
    for waiter in waiting {
        let (waited, then) = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("the waiting transaction began")
            .unwrap();
        assert!([p1, p2].contains(&then), "a kept connection was taken");
        assert!(
            waited < Duration::from_secs(3),
            "a waiting transaction began {waited:?} after it asked (the pool's acquire_timeout is 5 s)"
        );
    }
    conns.pool().close().await;
}

/// After the primary moved, a connection kept from before the move is closed, not used for the
/// next delivery: it may be to the old primary, still taking writes (promoted over without
/// fencing). Kept connections went on taking claims there until they aged out (a minute).
#[tokio::test]
async fn a_connection_kept_from_before_a_move_is_not_used_again() {
    let env = TestEnv::new("kept_move").await;
    let config = idemhost::Config::from_toml(
        &env.postgres_toml(),
        Vec::new(),
        std::path::Path::new("test.toml"),
        std::path::Path::new("."),
    )
    .unwrap();
    let failover = idemhost::test_support::pg::Failover::find(&config.postgres)
        .await
        .unwrap();
    let conns = own_pool(&env, 2).await;
    conns.follow(failover.clone());
    let (tx, before) = begin_pid(&conns).await;
    tx.commit_plain("COMMIT").await.unwrap();
    let (tx, again) = begin_pid(&conns).await;
    tx.commit_plain("COMMIT").await.unwrap();
    assert_eq!(again, before, "kept while nothing moved");
    failover.note_move();
    let (tx, after) = begin_pid(&conns).await;
    tx.commit_plain("COMMIT").await.unwrap();
    assert_ne!(
        after, before,
        "the connection kept from before the move was used again"
    );
    conns.pool().close().await;
}

/// A connection of the test's schema, through `addr` when given (host and port).
async fn connection(env: &TestEnv, addr: Option<std::net::SocketAddr>) -> sqlx::PgConnection {
    use sqlx::ConnectOptions as _;
    let mut options =
        idemhost::test_support::pg::connect_options(&PG_URL, Some(&env.schema), &env.schema)
            .unwrap();
    if let Some(addr) = addr {
        options = options.host(&addr.ip().to_string()).port(addr.port());
    }
    options.connect().await.unwrap()
}

/// A statement sent ahead of another (sqlx's `send_ahead`, patched in `vendor/`: how a
/// delivery's `BEGIN` rides on its claim, and a group's clearing on the next handler's first
/// statement) that fails keeps the statement behind it from running at all: the server skips
/// every message up to the Sync. A `BEGIN` the server refused therefore never lets the claim
/// behind it run — and commit — on its own.
#[tokio::test]
async fn a_failed_statement_sent_ahead_keeps_the_next_one_from_running() {
    let env = TestEnv::new("ahead_fails").await;
    let mut conn = connection(&env, None).await;
    sqlx::raw_sql("CREATE TABLE ahead_rows (n int)")
        .execute(&mut conn)
        .await
        .unwrap();
    let insert = "INSERT INTO ahead_rows VALUES ($1)";
    // Prepared and kept by sqlx: what is sent ahead of it goes in its own Sync.
    sqlx::query(insert)
        .bind(1)
        .execute(&mut conn)
        .await
        .unwrap();
    for (i, ahead) in [
        vec!["SELECT 1 / 0"],
        vec!["BEGIN ISOLATION LEVEL NONSENSE"],
        vec!["BEGIN", "SET LOCAL statement_timeout = 'not a duration'"],
    ]
    .into_iter()
    .enumerate()
    {
        for sql in &ahead {
            conn.send_ahead(*sql);
        }
        let n = i32::try_from(i).unwrap() + 2;
        let ran = sqlx::query(insert).bind(n).execute(&mut conn).await;
        assert!(ran.is_err(), "{ahead:?}: the statement behind ran");
        assert!(
            conn.ahead_failed(),
            "{ahead:?}: the failure was not the ahead's"
        );
        let _ = sqlx::raw_sql("ROLLBACK").execute(&mut conn).await;
    }
    // Then the connection works as before, and only the first row is there.
    sqlx::query(insert)
        .bind(9)
        .execute(&mut conn)
        .await
        .unwrap();
    let rows: Vec<i32> = sqlx::query_scalar("SELECT n FROM ahead_rows ORDER BY n")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    assert_eq!(rows, [1, 9]);
    env.cleanup().await;
}

/// A loopback proxy to PostgreSQL that counts what the client sends in separate writes (one
/// per round trip of a client that waits for each answer).
async fn counting_proxy() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let url = url::Url::parse(&PG_URL).unwrap();
    let server = format!(
        "{}:{}",
        url.host_str().unwrap_or("127.0.0.1"),
        url.port().unwrap_or(5432)
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let writes = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = writes.clone();
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.unwrap();
        let upstream = tokio::net::TcpStream::connect(server).await.unwrap();
        let (mut client_read, mut client_write) = client.into_split();
        let (mut up_read, mut up_write) = upstream.into_split();
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut up_read, &mut client_write).await;
        });
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n) = client_read.read(&mut buf).await {
            if n == 0 || up_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
            counted.fetch_add(1, Ordering::SeqCst);
        }
    });
    (addr, writes)
}

/// What is sent ahead of a statement the connection has prepared goes in that statement's
/// round trip: a delivery's `BEGIN` and `SET LOCAL`s with its claim, a group's clearing with the
/// next handler's first statement. Each took a round trip of its own before.
#[tokio::test]
async fn statements_sent_ahead_share_the_next_ones_round_trip() {
    use std::sync::atomic::Ordering;
    let env = TestEnv::new("ahead_trip").await;
    let (addr, writes) = counting_proxy().await;
    let mut conn = connection(&env, Some(addr)).await;
    let claim = "SELECT $1::int4, pg_catalog.pg_backend_pid()";
    // Prepared and kept on the first run.
    sqlx::query(claim)
        .bind(1)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    for round in 0..3 {
        let before = writes.load(Ordering::SeqCst);
        for sql in [
            "BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE",
            "SET LOCAL statement_timeout = '5000'",
        ] {
            conn.send_ahead(sql);
        }
        let (n, _): (i32, i32) = sqlx::query_as(claim)
            .bind(round)
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(n, round);
        assert_eq!(
            writes.load(Ordering::SeqCst) - before,
            1,
            "round {round}: the BEGIN took a round trip of its own"
        );
        assert!(
            !conn.transaction_idle(),
            "round {round}: no transaction began"
        );
        // The clearing ahead of the next statement, with its row.
        let before = writes.load(Ordering::SeqCst);
        conn.send_ahead("RESET ALL");
        conn.send_ahead("SELECT pg_catalog.current_setting('statement_timeout') = '0', 1");
        sqlx::query(claim)
            .bind(round)
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            writes.load(Ordering::SeqCst) - before,
            1,
            "round {round}: the clearing"
        );
        let rows = conn.take_ahead_rows();
        assert_eq!(rows, [Some(b"t".to_vec())], "round {round}: its row");
        sqlx::raw_sql("COMMIT").execute(&mut conn).await.unwrap();
    }
    env.cleanup().await;
}
