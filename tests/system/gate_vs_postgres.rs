//! The SQL gate judged against PostgreSQL itself. Statements are generated from the corners
//! where a hand-written scanner and the server disagree (comments ended by `\r`, typed and
//! escape-string literals with backslashes, dollar quotes, `U&"..."` identifiers, quoted and
//! qualified names, case, a second statement hidden after `;`), and every one the gate accepts
//! is then run by the server — as a superuser, so no privilege hides what it would do — inside a
//! transaction that is rolled back. What the server did must be what the gate judged: no host
//! relation read or written (the transaction's own table statistics), no setting changed, no
//! temporary object, advisory lock, cursor or prepared statement left, the transaction still the
//! one it ran in, and no host function called.
//!
//!   scripts/test.sh --test system gate_vs_postgres::

use std::sync::LazyLock;

use crate::common::*;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use sqlx::{Connection, PgConnection};

/// One schema for every case, with the host's tables and the example's.
struct Shared {
    runtime: tokio::runtime::Runtime,
    schema: String,
    conn: tokio::sync::Mutex<PgConnection>,
}

static SHARED: LazyLock<Shared> = LazyLock::new(|| {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (schema, conn) = runtime.block_on(async {
        // Earlier runs' schemas (this one lives as long as the test process).
        let admin = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&PG_URL)
            .await
            .unwrap();
        let old: Vec<String> = sqlx::query_scalar(
            "SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, 't_gate_')",
        )
        .fetch_all(&admin)
        .await
        .unwrap();
        for schema in old {
            let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP SCHEMA \"{schema}\" CASCADE"
            )))
            .execute(&admin)
            .await;
        }
        let env = TestEnv::new("gate").await;
        env.seed_inventory(&[("sku-1", 10)]).await;
        env.execute(
            "INSERT INTO processed_message (consumer_name, message_id) VALUES ('c', 'm');
             INSERT INTO processed_message_handler VALUES ('c', 'm', 'd');",
        )
        .await;
        let options =
            idemhost::test_support::pg::connect_options(&PG_URL, Some(&env.schema), "gate-check")
                .unwrap();
        let conn = PgConnection::connect_with(&options).await.unwrap();
        (env.schema.clone(), conn)
    });
    Shared {
        runtime,
        schema,
        conn: tokio::sync::Mutex::new(conn),
    }
});

/// Host relations, as PostgreSQL's statistics name them.
const HOST: &[&str] = &[
    "processed_message",
    "processed_message_handler",
    "dead_letter_repair",
    "outbox_message",
    "idemhost_key",
    "_sqlx_migrations",
];

fn relation() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("inventory".to_string()),
        Just("processed_message".to_string()),
        Just("\"processed_message\"".to_string()),
        Just("PROCESSED_MESSAGE".to_string()),
        Just("U&\"processed\\005fmessage\"".to_string()),
        Just("U&\"processed!005fmessage\" UESCAPE '!'".to_string()),
        Just("{schema}.processed_message".to_string()),
        Just("\"{schema}\" . \"processed_message_handler\"".to_string()),
        Just("outbox_message".to_string()),
        Just("idemhost_key".to_string()),
        Just("_sqlx_migrations".to_string()),
        Just("pg_settings".to_string()),
        Just("/* c */ processed_message".to_string()),
    ]
}

fn call() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("lower('x')".to_string()),
        Just("current_setting('lock_timeout')".to_string()),
        Just("set_config('lock_timeout', '7', false)".to_string()),
        Just("pg_catalog.set_config('lock_timeout', '7', true)".to_string()),
        Just("\"set_config\"('lock_timeout', '7', false)".to_string()),
        Just("U&\"set\\005fconfig\"('lock_timeout', '7', false)".to_string()),
        Just("pg_advisory_lock(7)".to_string()),
        Just("pg_advisory_xact_lock(7)".to_string()),
        Just("query_to_xml('select count(*) from processed_message', true, true, '')".to_string()),
        Just(
            "query_to_xml('select set_config(''lock_timeout'', ''7'', false)', true, true, '')"
                .to_string()
        ),
        Just("{schema}.idemhost_claim('k', 'c', 'i', NULL)".to_string()),
        Just("pg_sleep(0)".to_string()),
        // Harmless calls, so the generator still reaches the accepting side as often now that
        // every advisory lock is refused.
        Just("abs(-7)".to_string()),
        Just("pg_catalog.now()".to_string()),
    ]
}

/// A statement the server may run, built around a relation and a call.
fn statement() -> impl Strategy<Value = String> {
    (0..10u8, relation(), call()).prop_map(|(kind, rel, f)| match kind {
        0 => format!("SELECT count(*) FROM {rel}"),
        1 => format!("SELECT {f}"),
        2 => format!("SELECT {f} FROM inventory"),
        3 => format!("TABLE {rel} LIMIT 1"),
        4 => format!("DELETE FROM {rel} WHERE random() < 0"),
        5 => format!(
            "WITH d AS (DELETE FROM {rel} WHERE random() < 0 RETURNING 1) SELECT count(*) FROM d"
        ),
        6 => format!("VALUES ((SELECT count(*) FROM {rel}))"),
        7 => format!("SELECT * INTO TEMP t_gate FROM {rel}"),
        8 => format!("SELECT 1 FROM inventory WHERE sku IN (SELECT {f}::text)"),
        _ => format!("SELECT * FROM {rel} LIMIT 1 FOR UPDATE"),
    })
}

/// Something PostgreSQL's scanner skips or reads as one token, around which a hand-written
/// scanner may lose its place.
fn wrapper() -> impl Strategy<Value = (String, String)> {
    prop_oneof![
        Just((String::new(), String::new())),
        Just(("/* /* nested */ */ ".to_string(), String::new())),
        Just((String::new(), " --x\r".to_string())),
        Just((String::new(), " --x\r; {second}".to_string())),
        Just((String::new(), "; {second}".to_string())),
        Just((String::new(), ";\n-- c\n{second}".to_string())),
        Just(("SELECT name'\\' , ".to_string(), "".to_string())),
        Just(("SELECT 'a'';{second}--' AS x; ".to_string(), String::new())),
        Just(("SELECT E'\\';{second}--' AS x; ".to_string(), String::new())),
        Just(("SELECT $q$;{second}$q$ AS x; ".to_string(), String::new())),
        Just(("SELECT 1 --\r".to_string(), String::new())),
    ]
}

fn scramble(sql: &str, mask: u64) -> String {
    // Case changes outside quotes only matter to the server for unquoted identifiers and
    // keywords; inside quotes they make another name, which is fine to generate too.
    sql.chars()
        .enumerate()
        .map(|(i, c)| {
            if (mask >> (i % 64)) & 1 == 1 {
                c.to_ascii_uppercase()
            } else {
                c
            }
        })
        .collect()
}

/// What the server shows of the transaction: host relation access, settings, leftovers.
const STATE_SQL: &str = "SELECT \
    (SELECT coalesce(sum(seq_scan + coalesce(idx_scan, 0) + n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint \
       FROM pg_stat_xact_user_tables WHERE schemaname = current_schema() AND relname = ANY($1)), \
    (SELECT md5(string_agg(name || '=' || setting, ',' ORDER BY name)) FROM pg_settings), \
    (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()), \
    (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()), \
    (SELECT count(*) FROM pg_cursors WHERE name <> ''), \
    (SELECT count(*) FROM pg_prepared_statements WHERE from_sql), \
    (SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_xact_user_functions WHERE funcname LIKE 'idemhost%'), \
    current_setting('idemhost_test.marker', true)";

type State = (i64, String, i64, i64, i64, i64, i64, Option<String>);

async fn state(conn: &mut PgConnection) -> State {
    let host: Vec<String> = HOST.iter().map(|s| s.to_string()).collect();
    sqlx::query_as(STATE_SQL)
        .bind(host)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// Runs `sql` as the host would run a plugin's (extended protocol, one statement), as a
/// superuser, in a transaction rolled back; `Err` says what differed from the gate's judgement.
async fn server_agrees(sql: &str) -> Result<bool, String> {
    let mut conn = SHARED.conn.lock().await;
    sqlx::raw_sql(
        "BEGIN; SET LOCAL track_functions = 'all'; SET LOCAL idemhost_test.marker = 'same'; \
         SET LOCAL statement_timeout = '2s'",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    let before = state(&mut conn).await;
    let ran = sqlx::query(sqlx::AssertSqlSafe(sql.to_string()))
        .execute(&mut *conn)
        .await;
    let result = match ran {
        // The server refused it: nothing ran.
        Err(_) => Ok(false),
        Ok(_) => {
            let after = state(&mut conn).await;
            let mut differences = Vec::new();
            if after.0 != before.0 {
                differences.push("it read or wrote a host relation");
            }
            if after.1 != before.1 {
                differences.push("it changed a setting");
            }
            if after.2 != 0 {
                differences.push("it made a temporary object");
            }
            if after.4 != 0 || after.5 != 0 {
                differences.push("it left a cursor or a prepared statement");
            }
            if after.6 != before.6 {
                differences.push("it called a host function");
            }
            if after.7.as_deref() != Some("same") {
                differences.push("it ended the transaction");
            }
            if differences.is_empty() {
                Ok(true)
            } else {
                Err(differences.join(", "))
            }
        }
    };
    sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
    // Session-level advisory locks outlive the transaction (transaction-level ones do not).
    let kept: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    sqlx::raw_sql("SELECT pg_advisory_unlock_all()")
        .execute(&mut *conn)
        .await
        .unwrap();
    match result {
        Ok(_) if kept > 0 => Err("it took a session-level advisory lock".into()),
        other => other,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 800, ..ProptestConfig::default() })]

    /// Whatever the gate accepts, the server runs as nothing more than a data statement on the
    /// plugin's own tables.
    #[test]
    fn the_gate_never_accepts_what_the_server_runs_otherwise(
        stmt in statement(),
        second in statement(),
        (before, after) in wrapper(),
        mask in any::<u64>(),
    ) {
        let shared = &*SHARED;
        let fill = |s: &str| s.replace("{schema}", &shared.schema).replace("{second}", &second.replace("{schema}", &shared.schema));
        let sql = scramble(&format!("{}{}{}", fill(&before), fill(&stmt), fill(&after)), mask);
        if idemhost::test_support::check(&sql).is_ok() {
            let verdict = shared.runtime.block_on(server_agrees(&sql));
            prop_assert!(verdict.is_ok(), "the gate accepted {sql:?}, but {}", verdict.err().unwrap_or_default());
        }
    }
}

/// The generator reaches both sides: statements the gate accepts and the server runs, and
/// statements it refuses.
#[test]
fn generated_statements_reach_both_verdicts() {
    let shared = &*SHARED;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut accepted, mut ran, mut refused) = (0, 0, 0);
    for _ in 0..300 {
        let stmt = statement().new_tree(&mut runner).unwrap().current();
        let sql = stmt.replace("{schema}", &shared.schema);
        if idemhost::test_support::check(&sql).is_ok() {
            accepted += 1;
            if shared.runtime.block_on(server_agrees(&sql)) == Ok(true) {
                ran += 1;
            }
        } else {
            refused += 1;
        }
    }
    assert!(
        accepted >= 30 && ran >= 20 && refused >= 100,
        "accepted {accepted}, ran {ran}, refused {refused}"
    );
}

/// Ways to send a notification, each of which PostgreSQL 15 runs as one statement (checked
/// below): the statement, the function under every name that resolves to it, and the function
/// anywhere an expression may stand. The channel and payloads are digits and `_`, which the case
/// scrambling leaves alone.
fn notify() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("NOTIFY _7".to_string()),
        Just("NOTIFY \"_7\", '1'".to_string()),
        Just("SELECT pg_notify('_7', '1')".to_string()),
        Just("SELECT pg_catalog.pg_notify('_7', '1')".to_string()),
        Just("SELECT \"pg_catalog\".\"pg_notify\"('_7', '1')".to_string()),
        Just("SELECT U&\"pg\\005fnotify\"('_7', '1')".to_string()),
        Just("SELECT U&\"pg!005fnotify\" UESCAPE '!' ('_7', '1')".to_string()),
        Just("SELECT * FROM pg_notify('_7', '1')".to_string()),
        Just("WITH n AS (SELECT pg_notify('_7', '1')) SELECT * FROM n".to_string()),
        Just("SELECT (SELECT pg_notify('_7', '1'))".to_string()),
        Just("VALUES (pg_notify('_7', '1'))".to_string()),
        Just("SELECT 1 WHERE pg_notify('_7', '1') IS NULL".to_string()),
        Just("SELECT count(*) FROM inventory, LATERAL pg_notify('_7', '1') AS x".to_string()),
        Just("SELECT CASE WHEN true THEN pg_notify('_7', '1') END".to_string()),
        Just("SELECT ROW(pg_notify('_7', '1'))".to_string()),
        Just("SELECT coalesce(pg_notify('_7', '1'))".to_string()),
        Just(
            "SELECT 1 FROM inventory WHERE sku IN (SELECT pg_notify('_7', '1')::text)".to_string()
        ),
    ]
}

/// A plugin that notifies wakes every listener of the channel (the outbox relay's is
/// `idemhost_outbox`) however often it likes. Whatever sends a notification when PostgreSQL
/// runs it — each generated statement is run and committed as a plugin's would be, and a
/// listener on another connection says whether one arrived — the gate refuses.
#[test]
fn the_gate_refuses_whatever_notifies() {
    let shared = &*SHARED;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // The connections are dropped (and closed) within the runtime, before it goes.
    let _context = runtime.enter();
    let (conn, listener) = runtime.block_on(async {
        let options = idemhost::test_support::pg::connect_options(
            &PG_URL,
            Some(&shared.schema),
            "gate-notify",
        )
        .unwrap();
        let conn = PgConnection::connect_with(&options).await.unwrap();
        let mut listener = sqlx::postgres::PgListener::connect(&PG_URL).await.unwrap();
        listener.listen("_7").await.unwrap();
        (conn, listener)
    });
    let cell = std::cell::RefCell::new((conn, listener, 0u32, 0u32));
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 400,
        ..ProptestConfig::default()
    });
    let result = runner.run(
        &(notify(), wrapper(), any::<u64>()),
        |(stmt, (before, after), mask)| {
            let sql = scramble(
                &format!("{before}{stmt}{after}").replace("{second}", "SELECT 1"),
                mask,
            );
            let mut guard = cell.borrow_mut();
            let (conn, listener, cases, notified) = &mut *guard;
            *cases += 1;
            let sentinel = format!("end-{cases}");
            let arrived = runtime.block_on(async {
                // As the host runs a plugin's statement (extended protocol, one statement);
                // autocommit, so a notification it sends is delivered.
                let _ = sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                    .execute(&mut *conn)
                    .await;
                // Notifications arrive in commit order: once the sentinel is in, the
                // statement's would have been too.
                sqlx::query("SELECT pg_notify('_7', $1)")
                    .bind(&sentinel)
                    .execute(&mut *conn)
                    .await
                    .unwrap();
                let mut arrived = false;
                loop {
                    let n =
                        tokio::time::timeout(std::time::Duration::from_secs(10), listener.recv())
                            .await
                            .expect("the sentinel notification within 10 s")
                            .unwrap();
                    if n.payload() == sentinel {
                        return arrived;
                    }
                    arrived = true;
                }
            });
            if arrived {
                *notified += 1;
                prop_assert!(
                    idemhost::test_support::check(&sql).is_err(),
                    "the gate accepted {sql:?}, which sent a notification"
                );
            }
            Ok(())
        },
    );
    if let Err(e) = result {
        panic!("{e}");
    }
    let (_, _, cases, notified) = *cell.borrow();
    println!("{cases} generated statements, {notified} of them sent a notification");
    assert!(
        notified > 0,
        "no generated statement reached the server as a notification"
    );
}
