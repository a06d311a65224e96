//! The plugin wall, tried as a hostile plugin author would: the `testkit` component sends the
//! SQL and publishes of each escape attempt through the running `idemhost` binary, one consumer
//! with `max_in_flight = 1` so the next deliveries reuse the attempt's connection. After every
//! attempt a probe delivery records the session it runs in (user, safety settings, leftovers)
//! and a message is delivered twice. Then, by SQL and by the broker: nothing breached, every
//! probe clean, every twice-delivered message applied once, the other consumer served.
//!
//! Three set-ups: the default (no `consumer.role`: the host provisions one; the host connects as
//! a superuser), the hardened one (the host logs in as a non-superuser that owns its schema, the
//! plugin's role made by an administrator), and the default with the SQL gate switched off
//! (failpoint `ungated`), which shows what PostgreSQL's own walls hold without the guard.
//!
//!   scripts/test.sh --test system wall::

use std::collections::HashMap;
use std::time::Duration;

use crate::common::*;
use async_nats::jetstream;

/// The attacks and the database they run against, in `tests/system/wall/`.
mod attacks;
mod db;
use attacks::*;
use db::*;

const WALL: &str = "wall-v1";
const HEALTHY: &str = "healthy-v1";
/// Where the lo_export / COPY attempts try to write.
const FILE: &str = "/tmp/idemhost-wall-breach";

/// Headers under broker id `nats_id`; with `replay` (the host key, a message id), a signed
/// replay of that id (a second delivery the marker must decide).
fn headers(nats_id: &str, replay: Option<(&str, &str)>) -> async_nats::HeaderMap {
    let mut h = async_nats::HeaderMap::new();
    h.insert("Nats-Msg-Id", nats_id);
    if let Some((key, id)) = replay {
        replayed(&mut h, key, id);
    }
    h
}

/// Runs every attack through a host of `setup`; returns the attacks that breached, with why.
async fn attack_the_wall(setup: SetUp) {
    let _ = std::fs::remove_file(FILE);
    let _ = std::fs::remove_file("/tmp/idemhost-wall-program");
    let db = Db::new(setup).await;
    let wall = NatsEnv::new("wall", Duration::from_secs(120)).await;
    let healthy = NatsEnv::new("wallok", Duration::from_secs(120)).await;
    // A stream and a KV key the plugin must not reach.
    let victim = NatsEnv::new("victim", Duration::from_secs(120)).await;
    let bucket = unique("wallkv");
    // The stream a KV bucket is (async-nats cannot create one on NATS 2.9 directly).
    wall.js
        .create_stream(jetstream::stream::Config {
            name: format!("KV_{bucket}"),
            subjects: vec![format!("$KV.{bucket}.>")],
            max_messages_per_subject: 1,
            allow_rollup: true,
            allow_direct: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let kv = wall.js.get_key_value(&bucket).await.unwrap();
    kv.put("k", "original".into()).await.unwrap();
    let allowed = format!("{}.events", wall.prefix);
    let key_before = db
        .scalar("SELECT hashtext(key)::bigint FROM idemhost_key")
        .await;

    let dir = tempfile_dir(&db.schema);
    let config = format!(
        "[nats]\nurl = \"{NATS_URL}\"\n{}\n[host]\nshutdown_timeout = \"10s\"\n\n\
         [[consumer]]\nname = \"{WALL}\"\nstream = \"{}\"\nsubjects = [\"{}\"]\nplugin = \"{}\"\n\
         dead_letter_subject = \"{}\"\nmax_in_flight = 1\nmax_deliver = 1\nhandler_timeout = \"1s\"\n\
         statement_timeout = \"30s\"\nmemory_limit = \"64MiB\"\ntables = [\"inventory\", \"probe\", \"applied\"]\n\
         publish_subjects = [\"{allowed}.>\"]\n{}\n\
         [[consumer]]\nname = \"{HEALTHY}\"\nstream = \"{}\"\nsubjects = [\"{}\"]\nplugin = \"{}\"\n\
         dead_letter_subject = \"{}\"\nmax_in_flight = 4\ntables = [\"inventory\"]\n{}\n",
        db.postgres_toml(),
        wall.stream,
        wall.subject(),
        plugin_path("testkit").display(),
        wall.dlq(),
        db.role_lines[0],
        healthy.stream,
        healthy.subject(),
        plugin_path("inventory").display(),
        healthy.dlq(),
        db.role_lines[1],
    );
    let config_path = dir.join("wall.toml");
    std::fs::write(&config_path, config).unwrap();
    let log = dir.join("host.log");
    let failpoint = (setup == SetUp::Ungated).then_some("ungated");
    let mut host = spawn_host(&config_path, failpoint, &log);
    let admin = format!("127.0.0.1:{}", 0);
    let _ = admin;
    // The healthy consumer's first half.
    let orders = |from: usize| {
        (from..from + 50).map(|i| {
            let id = format!("order-{i}");
            (headers(&id, None), order_payload(&id, "sku-h", 1))
        })
    };
    healthy.publish_many(orders(0)).await;

    let attacks = attacks(&db.schema, &victim.stream, &bucket, &allowed);
    assert!(attacks.len() >= 40, "{} attacks", attacks.len());
    let probe = |label: &str| {
        format!(
            r#"{{"steps":[{{"execute":{},"params":[{}]}}]}}"#,
            serde_json::json!(PROBE_SQL),
            serde_json::json!(label)
        )
    };
    let twice = |id: &str| {
        format!(
            r#"{{"steps":[{{"execute":"INSERT INTO applied (message_id) VALUES ($1)","params":[{}]}}]}}"#,
            serde_json::json!(id)
        )
    };
    let key = db.host_key().await;
    let mut messages = vec![(headers("probe-start", None), probe("start"))];
    for (i, attack) in attacks.iter().enumerate() {
        messages.push((
            headers(&format!("attack-{i}"), None),
            attack_payload(attack),
        ));
        messages.push((
            headers(&format!("probe-{i}"), None),
            probe(&format!("after-{i}")),
        ));
        let id = format!("twice-{i}");
        messages.push((headers(&format!("{id}-a"), Some((&key, &id))), twice(&id)));
        messages.push((headers(&format!("{id}-b"), Some((&key, &id))), twice(&id)));
    }
    wall.publish_many(messages).await;
    healthy.publish_many(orders(50)).await;

    wall.wait_drained(WALL, Duration::from_secs(600)).await;
    healthy
        .wait_drained(HEALTHY, Duration::from_secs(120))
        .await;
    // The relay had its chance to publish what committed.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let check = db.admin_in_schema().await;
    let mut breaches: Vec<String> = Vec::new();
    let role: String = sqlx::query_scalar("SELECT cur_user FROM probe WHERE label = 'start'")
        .fetch_one(&check)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "no start probe ({e}); host log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        });
    let host_commit: String = sqlx::query_scalar("SELECT current_setting('synchronous_commit')")
        .fetch_one(&check)
        .await
        .unwrap();
    let host_commit = format!("{host_commit} from client");
    assert_ne!(
        role, db.host_user,
        "the plugin must not run as the host's role"
    );
    let rows: Vec<ProbeRow> = sqlx::query_as("SELECT * FROM probe")
        .fetch_all(&check)
        .await
        .unwrap();
    let probes: HashMap<String, _> = rows.into_iter().map(|r| (r.0.clone(), r)).collect();
    let start_pid = probes["start"].1;
    let mut reused = 0;
    for (i, attack) in attacks.iter().enumerate() {
        let name = attack.name;
        let Some(p) = probes.get(&format!("after-{i}")) else {
            breaches.push(format!("{name}: the probe after it did not apply"));
            continue;
        };
        // The durability and the statement timeout are the ones the plugin's connection logged
        // in with (startup options), which no role or database setting outranks and to which
        // the clearing's `RESET ALL` returns: the delivery's transaction sets neither.
        let expected = (
            role.as_str(),
            role.as_str(),
            host_commit.as_str(),
            db.schema.as_str(),
            "30s from client",
            "off",
            "off",
            "UTF8",
        );
        let seen = (
            p.2.as_str(),
            p.3.as_str(),
            p.4.as_str(),
            p.5.as_str(),
            p.6.as_str(),
            p.7.as_str(),
            p.8.as_str(),
            p.9.as_str(),
        );
        // `lock_timeout` is the host's own: none for a delivery alone, `batch_lock_timeout`
        // (50 ms) for one in a group (an attack sets it to 1 ms).
        let lock_timeout_ok = matches!(p.10.as_str(), "0" | "50ms");
        if seen != expected || !lock_timeout_ok || (p.11, p.12, p.13, p.14, p.15) != (0, 0, 0, 0, 0)
        {
            breaches.push(format!(
                "{name}: the next delivery's session is not clean: {seen:?} lock_timeout {} leftovers {:?}",
                p.10,
                (p.11, p.12, p.13, p.14, p.15)
            ));
        }
        if p.1 == start_pid {
            reused += 1;
        }
        let id = format!("twice-{i}");
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM applied WHERE message_id = $1")
            .bind(&id)
            .fetch_one(&check)
            .await
            .unwrap();
        if applied != 1 {
            breaches.push(format!(
                "{name}: the message after it was applied {applied} times"
            ));
        }
        if setup != SetUp::Ungated {
            let marker: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM processed_message WHERE consumer_name = $1 AND message_id = $2",
            )
            .bind(WALL)
            .bind(format!("attack-{i}"))
            .fetch_one(&check)
            .await
            .unwrap();
            if marker != 0 {
                breaches.push(format!(
                    "{name}: committed although the host refused part of it"
                ));
            }
        }
    }
    // The connection was reused between deliveries (the probes are about reuse): most probes
    // ran on the first probe's session; attacks that end their session (the deadline) move on.
    assert!(reused >= 10, "only {reused} probes on the first session");

    let global = [
        ("secret", "SELECT count(*) FROM secret WHERE x = 42", 1),
        ("secret rows", "SELECT count(*) FROM secret", 1),
        (
            "markers of other consumers",
            "SELECT count(*) FROM processed_message WHERE consumer_name NOT IN ('wall-v1', 'healthy-v1')",
            0,
        ),
        (
            "forged markers",
            "SELECT count(*) FROM processed_message WHERE message_id LIKE 'forged%'",
            0,
        ),
        (
            "healthy markers",
            "SELECT count(*) FROM processed_message WHERE consumer_name = 'healthy-v1'",
            100,
        ),
        (
            "healthy effects",
            "SELECT reserved FROM inventory WHERE sku = 'sku-h'",
            100,
        ),
        (
            "reserved outbox subjects",
            "SELECT count(*) FROM outbox_message WHERE subject LIKE '$%' OR subject LIKE '\\_INBOX%'",
            0,
        ),
        (
            "versions",
            "SELECT count(*) FROM processed_message_handler WHERE plugin_digest = 'x'",
            0,
        ),
        (
            "superuser made",
            "SELECT count(*) FROM pg_roles WHERE rolname = 'wall_evil'",
            0,
        ),
    ];
    for (what, sql, want) in global {
        let got = db.scalar(sql).await;
        if got != want {
            breaches.push(format!("{what}: {got}, expected {want}"));
        }
    }
    if db
        .scalar("SELECT hashtext(key)::bigint FROM idemhost_key")
        .await
        != key_before
    {
        breaches.push("the host key changed".into());
    }
    if setup != SetUp::Ungated {
        // The role's defaults are the host's bounds (`consumer.role_settings`: those the host
        // may set), nothing else: no setting a plugin chose, on no database.
        let defaults = db
            .scalar(&format!(
                "SELECT count(*) FROM pg_db_role_setting, unnest(setconfig) AS c \
                 WHERE setrole = '{role}'::regrole AND (setdatabase <> 0 OR c NOT IN \
                 ('jit=off', 'log_min_messages=fatal', 'temp_file_limit=1GB', 'work_mem=4MB'))"
            ))
            .await;
        if defaults != 0 {
            breaches.push("the plugin's role has defaults of its own".into());
        }
    }
    for file in [FILE, "/tmp/idemhost-wall-program"] {
        if std::path::Path::new(file).exists() {
            breaches.push(format!("{file} was written"));
        }
    }
    if victim.js.get_stream(&victim.stream).await.is_err() {
        breaches.push("the victim stream was deleted".into());
    }
    let value = kv.get("k").await.unwrap().unwrap_or_default();
    if value.as_ref() != b"original" {
        breaches.push("the KV key was written".into());
    }
    // Still serving: the host process is alive.
    assert!(host.try_wait().unwrap().is_none(), "the host died");
    unsafe_kill(&host);
    let _ = host.wait();

    eprintln!(
        "wall {setup:?}: {} escape attempts, {} breached; {reused} probes reused the first session",
        attacks.len(),
        breaches.len()
    );
    if !breaches.is_empty() {
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        let warnings: String = log
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .take(40)
            .collect::<Vec<_>>()
            .join("\n");
        panic!(
            "{setup:?}: breaches:\n  {}\nhost warnings ({}):\n{warnings}",
            breaches.join("\n  "),
            log.len()
        );
    }
    let _ = kv;
    let _ = wall.js.delete_stream(format!("KV_{bucket}")).await;
    victim.cleanup().await;
    wall.cleanup().await;
    healthy.cleanup().await;
    check.close().await;
    db.cleanup().await;
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempfile_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("idemhost-{tag}"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// SIGTERM: the host drains and stops.
fn unsafe_kill(child: &std::process::Child) {
    // SAFETY: kill(2) on a child's pid has no memory-safety preconditions.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
}

/// Default set-up: no `consumer.role` in the config; the host (a superuser here) provisions
/// the plugin's login role. Every escape attempt fails and breaches nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_escape_in_the_default_set_up() {
    attack_the_wall(SetUp::Default).await;
}

/// Hardened set-up: the host is not a superuser; the plugin's role was made by an
/// administrator. Every escape attempt fails and breaches nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_escape_in_the_hardened_set_up() {
    attack_the_wall(SetUp::Hardened).await;
}

/// The SQL gate switched off: PostgreSQL's walls (the login role, the host's functions and
/// key, the session reset, the re-asserted settings) hold on their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_escape_without_the_gate() {
    attack_the_wall(SetUp::Ungated).await;
}

/// The config of one testkit consumer for `db`, with extra consumer keys.
fn one_consumer(db: &Db, nats: &NatsEnv, extra: &str) -> idemhost::Config {
    parse_config(&format!(
        "[nats]\nurl = \"{NATS_URL}\"\n{}\n[[consumer]]\nname = \"{WALL}\"\nstream = \"{}\"\n\
         subjects = [\"{}\"]\nplugin = \"{}\"\ndead_letter_subject = \"{}\"\n{extra}\n",
        db.postgres_toml(),
        nats.stream,
        nats.subject(),
        plugin_path("testkit").display(),
        nats.dlq(),
    ))
}

/// A host that may not create roles, with no `consumer.role`, refuses to start — it never runs
/// the plugin as itself — and says exactly what an administrator has to run.
#[tokio::test]
async fn without_a_role_a_host_that_cannot_create_one_says_what_to_run() {
    let db = Db::new(SetUp::Hardened).await;
    let nats = NatsEnv::new("norole", Duration::from_secs(60)).await;
    let error = start_error(one_consumer(&db, &nats, "tables = [\"inventory\"]")).await;
    let role = format!("idemhost_{}_wall_v1", db.schema);
    for expected in [
        format!("CREATE ROLE \"{role}\" LOGIN"),
        format!("GRANT USAGE ON SCHEMA \"{}\" TO \"{role}\"", db.schema),
        format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE \"{}\".\"inventory\" TO \"{role}\"",
            db.schema
        ),
        format!("GRANT \"{role}\" TO CURRENT_USER"),
    ] {
        assert!(
            error.contains(&expected),
            "{expected:?} missing from: {error}"
        );
    }
    nats.cleanup().await;
    db.cleanup().await;
}

/// Roles that would let a plugin reach past its grants are refused at start: a superuser, the
/// host's own role, a member of the host's role, one with a privilege on a host table.
#[tokio::test]
async fn a_role_that_reaches_past_its_grants_is_refused() {
    let db = Db::new(SetUp::Default).await;
    let nats = NatsEnv::new("badrole", Duration::from_secs(60)).await;
    let tag = db.schema.replace("t_", "");
    let member = format!("m_{tag}");
    let peeker = format!("k_{tag}");
    let creator = format!("c_{tag}");
    for sql in [
        format!("CREATE ROLE {member} LOGIN IN ROLE root"),
        format!("CREATE ROLE {peeker} LOGIN"),
        format!(
            "GRANT SELECT ON {}.processed_message TO {peeker}",
            db.schema
        ),
        format!("CREATE ROLE {creator} LOGIN"),
        format!("GRANT CREATE ON SCHEMA {} TO {creator}", db.schema),
    ] {
        run(&db.admin, &sql).await;
    }
    // A role that may create in the host's schema could add an overload of the host's
    // functions there, a candidate where the host calls its own (review, found with PUBLIC's
    // CREATE on `public` of a database upgraded from PostgreSQL 14).
    for (role, why) in [
        ("root", "superuser"),
        (member.as_str(), "member of root"),
        (peeker.as_str(), "privilege on the host's processed_message"),
        (creator.as_str(), "may create objects in the host's schema"),
    ] {
        let error = start_error(one_consumer(&db, &nats, &format!("role = \"{role}\""))).await;
        assert!(
            error.contains("refusing to run its plugin") && error.contains(why),
            "{role}: {error}"
        );
    }
    let mut db = db;
    db.roles.extend([member, peeker, creator]);
    nats.cleanup().await;
    db.cleanup().await;
}

/// Group commit, gate off: a plugin switches the session's `client_encoding` (which would make
/// the next claim in the same transaction store a different id than the one sent, so a
/// redelivery would apply again). The host's claim function refuses to run on a session that is
/// not UTF-8 (retryable), and the message is applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_client_encoding_cannot_make_a_claim_miss() {
    let db = Db::new(SetUp::Default).await;
    let nats = NatsEnv::new("enc", Duration::from_secs(60)).await;
    let dir = tempfile_dir(&format!("{}-enc", db.schema));
    let path = dir.join("enc.toml");
    std::fs::write(
        &path,
        format!(
            "[nats]\nurl = \"{NATS_URL}\"\n{}\n[[consumer]]\nname = \"{WALL}\"\nstream = \"{}\"\n\
             subjects = [\"{}\"]\nplugin = \"{}\"\ndead_letter_subject = \"{}\"\ntables = [\"applied\"]\n\
             batch_max = 8\nbatch_linger = \"300ms\"\nmax_deliver = 5\nbackoff = [\"100ms\"]\n",
            db.postgres_toml(),
            nats.stream,
            nats.subject(),
            plugin_path("testkit").display(),
            nats.dlq(),
        ),
    )
    .unwrap();
    let log = dir.join("host.log");
    let mut host = spawn_host(&path, Some("ungated"), &log);
    let id = "msg-\u{e9}-1";
    let insert = |label: &str| {
        format!(
            r#"{{"steps":[{{"execute":"INSERT INTO applied (message_id) VALUES ($1)","params":[{}]}}]}}"#,
            serde_json::json!(label)
        )
    };
    let key = db.host_key().await;
    let switch = r#"{"steps":[{"query":"SELECT set_config('client_encoding', 'LATIN1', false)"}]}"#;
    let fail =
        r#"{"steps":[{"fail":"terminal","reason":"makes the batch run again with savepoints"}]}"#;
    // One batch: the switch, a failure (the batch runs again, message by message), the id.
    nats.publish_many([
        (headers("enc-switch", None), switch.to_string()),
        (headers("enc-fail", None), fail.to_string()),
        (headers("enc-a", Some((&key, id))), insert(id)),
    ])
    .await;
    nats.wait_drained(WALL, Duration::from_secs(60)).await;
    // The same message again, past the broker.
    nats.publish_many([(headers("enc-b", Some((&key, id))), insert(id))])
        .await;
    nats.wait_drained(WALL, Duration::from_secs(60)).await;
    unsafe_kill(&host);
    let _ = host.wait();
    // Every row, however its id was stored: a claim read in another encoding stores another id.
    let applied = db.scalar("SELECT count(*) FROM applied").await;
    let markers = db
        .scalar(&format!(
            "SELECT count(*) FROM processed_message WHERE consumer_name = '{WALL}' AND message_id LIKE 'msg-%'"
        ))
        .await;
    let exact = db
        .scalar(&format!(
            "SELECT count(*) FROM processed_message WHERE consumer_name = '{WALL}' AND message_id = '{id}'"
        ))
        .await;
    assert_eq!(exact, 1, "the marker holds the id as sent");
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(
        (applied, markers),
        (1, 1),
        "host log:\n{}",
        log_text
            .lines()
            .filter(|l| l.contains("WARN"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    nats.cleanup().await;
    db.cleanup().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The host's functions look nothing up through the caller's search path: they fix their own
/// and name every table with its schema and every function, operator and type with
/// `pg_catalog`, and so does the trigger function their outbox insert fires. A session whose
/// search path puts, before `pg_catalog`, a schema of look-alikes — tables of the host's names,
/// a `sha256` and `convert_to` that make every key match, `=` and `<>` operators that always
/// agree, a `pg_notify` that records who ran it — gets a refusal for a guessed key, and the real
/// key claims into the host's own tables and inserts an outbox row without running the
/// look-alike (review, with the gate off and a schema the plugin could create in: the trigger
/// named `pg_notify` unqualified, and without the functions' fixed path it ran the plugin's
/// own as the host's role).
#[tokio::test]
async fn the_host_functions_ignore_a_callers_search_path() {
    let env = TestEnv::new("shadow").await;
    let s = &env.schema;
    let shadow = format!("{s}_shadow");
    env.execute(&format!(
        "CREATE SCHEMA {shadow};
         CREATE TABLE {shadow}.idemhost_key (key text);
         INSERT INTO {shadow}.idemhost_key VALUES ('guess');
         CREATE TABLE {shadow}.processed_message (consumer_name text, message_id text, UNIQUE (consumer_name, message_id));
         CREATE TABLE {shadow}.processed_message_handler (consumer_name text, message_id text, plugin_digest text, UNIQUE (consumer_name, message_id));
         CREATE FUNCTION {shadow}.sha256(bytea) RETURNS bytea LANGUAGE sql AS $$ SELECT '\\x00'::bytea $$;
         CREATE FUNCTION {shadow}.convert_to(text, name) RETURNS bytea LANGUAGE sql AS $$ SELECT '\\x00'::bytea $$;
         CREATE FUNCTION {shadow}.current_setting(text) RETURNS text LANGUAGE sql AS $$ SELECT 'UTF8'::text $$;
         CREATE FUNCTION {shadow}.agree(bytea, bytea) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
         CREATE FUNCTION {shadow}.never(text, text) RETURNS boolean LANGUAGE sql AS $$ SELECT false $$;
         CREATE OPERATOR {shadow}.= (LEFTARG = bytea, RIGHTARG = bytea, FUNCTION = {shadow}.agree);
         CREATE OPERATOR {shadow}.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = {shadow}.never);
         CREATE FUNCTION {shadow}.unnest(text[]) RETURNS SETOF text LANGUAGE sql AS $$ SELECT 'shadowed'::text $$;
         CREATE TABLE {shadow}.loot (who text);
         CREATE FUNCTION {shadow}.pg_notify(text, text) RETURNS void LANGUAGE sql
             AS $$ INSERT INTO {shadow}.loot SELECT current_user::text $$;"
    ))
    .await;
    let mut conn = env.pool.acquire().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET search_path = {shadow}, pg_catalog, {s}, pg_temp"
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    for call in [
        format!("SELECT {s}.idemhost_claim('guess', 'c', 'forged', 'd')::text"),
        format!("SELECT {s}.idemhost_claim_all('guess', 'c', ARRAY['forged'], 'd')"),
        format!(
            "SELECT {s}.idemhost_outbox_insert('guess', 'c', 'forged', 0, 'x', '[]'::jsonb, ''::bytea)::text"
        ),
    ] {
        let refused = sqlx::query_scalar::<_, Option<String>>(sqlx::AssertSqlSafe(call.clone()))
            .fetch_all(&mut *conn)
            .await
            .expect_err(&call);
        let code = refused.as_database_error().and_then(|e| e.code());
        assert_eq!(code.as_deref(), Some("42501"), "{call}: {refused}");
    }
    let key = env.host_key().await;
    let claimed: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT {s}.idemhost_claim($1, 'c', 'real', 'd')"
    )))
    .bind(&key)
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    let group: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT {s}.idemhost_claim_all($1, 'c', ARRAY['g1', 'g2'], 'd')"
    )))
    .bind(&key)
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    // The outbox function inserts a row, which fires the outbox's trigger (it notifies the
    // relay): that runs as the host's role too, and must not find the look-alike `pg_notify`.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {s}.idemhost_outbox_insert($1, 'c', 'real', 0, 'x', '[]'::jsonb, ''::bytea)::text"
    )))
    .bind(&key)
    .execute(&mut *conn)
    .await
    .unwrap();
    drop(conn);
    assert!(claimed);
    assert_eq!(group, ["g1", "g2"]);
    assert_eq!(
        env.scalar(&format!("SELECT count(*) FROM {shadow}.loot"))
            .await,
        0,
        "the outbox's trigger ran a look-alike pg_notify as the host's role"
    );
    assert_eq!(
        env.scalar(&format!("SELECT count(*) FROM {s}.outbox_message"))
            .await,
        1
    );
    assert_eq!(
        env.scalar(&format!("SELECT count(*) FROM {s}.processed_message"))
            .await,
        3,
        "the real key claims into the host's own marker table"
    );
    assert_eq!(
        env.scalar(&format!(
            "SELECT count(*) FROM {s}.processed_message_handler"
        ))
        .await,
        3
    );
    assert_eq!(
        env.scalar(&format!(
            "SELECT (SELECT count(*) FROM {shadow}.processed_message) + (SELECT count(*) FROM {shadow}.processed_message_handler)"
        ))
        .await,
        0,
        "nothing went to the look-alikes"
    );
    env.execute(&format!("DROP SCHEMA {shadow} CASCADE")).await;
    env.cleanup().await;
}

/// A marker's plugin version row goes with it — deleted (`markers prune`, an operator's
/// DELETE) or truncated — as the foreign key's cascade did before a trigger per statement
/// replaced it (the key's check per claimed row was the claim's most expensive part); and a
/// version row left without its marker (removed with triggers off) never fails a later claim
/// of that id: the claim overwrites it.
#[tokio::test]
async fn a_markers_version_row_goes_with_it() {
    let env = TestEnv::new("cascade").await;
    let key = env.host_key().await;
    let claim = |id: &'static str| {
        let (pool, key) = (env.pool.clone(), key.clone());
        async move {
            sqlx::query_scalar::<_, bool>("SELECT idemhost_claim($1, 'c', $2, 'sha256:one')")
                .bind(key)
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    for id in ["a", "b", "c"] {
        assert!(claim(id).await);
    }
    let versions = || env.scalar("SELECT count(*) FROM processed_message_handler");
    assert_eq!(versions().await, 3);
    env.execute("DELETE FROM processed_message WHERE message_id = 'a'")
        .await;
    assert_eq!(versions().await, 2, "deleted with its marker");
    env.execute("TRUNCATE processed_message").await;
    assert_eq!(versions().await, 0, "truncated with the markers");
    // A version row without its marker, as a delete with triggers off leaves it.
    env.execute("INSERT INTO processed_message_handler VALUES ('c', 'b', 'sha256:stale')")
        .await;
    assert!(claim("b").await, "the id is claimed again");
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM processed_message_handler WHERE message_id = 'b' AND plugin_digest = 'sha256:one'"
        )
        .await,
        1,
        "the claim's own version overwrote the stale one"
    );
    env.cleanup().await;
}

/// The host's functions check the caller's key against a digest written into them (migration
/// 0013): the right key claims; a wrong one, an empty one, the key with a byte more, the digest
/// itself and SHA-256(key) (which HMAC would use for a long key) are refused with 42501; the
/// digest in the catalog is not SHA-256(key); and the key cannot change or go, since the
/// functions would no longer know it.
#[tokio::test]
async fn the_functions_know_the_key_only_by_a_digest_of_their_own() {
    let env = TestEnv::new("key_digest").await;
    let key = env.host_key().await;
    let claim = |given: String, id: &'static str| {
        let pool = env.pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>("SELECT idemhost_claim($1, 'c', $2, NULL)")
                .bind(given)
                .bind(id)
                .fetch_one(&pool)
                .await
        }
    };
    assert!(claim(key.clone(), "right").await.unwrap());
    let sha256_hex = |text: &str| {
        use sha2::Digest;
        sha2::Sha256::digest(text.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let body: String = sqlx::query_scalar(
        "SELECT prosrc FROM pg_proc WHERE oid = 'idemhost_claim(text, text, text, text)'::regprocedure",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    let written = body
        .split("pg_catalog.decode('")
        .nth(1)
        .and_then(|rest| rest.split('\'').next())
        .expect("the digest in the function's body")
        .to_string();
    assert_ne!(written, sha256_hex(&key), "never SHA-256(key) itself");
    assert!(!body.contains(&key), "the key is not in the body");
    for wrong in [
        String::new(),
        format!("{key}x"),
        key[..key.len() - 1].to_string(),
        key.to_uppercase(),
        written.clone(),
        sha256_hex(&key),
    ] {
        let e = claim(wrong.clone(), "wrong").await.unwrap_err();
        let code = e
            .as_database_error()
            .and_then(|d| d.code())
            .unwrap_or_default();
        assert_eq!(code, "42501", "{wrong:?}: {e}");
    }
    assert_eq!(
        env.scalar("SELECT count(*) FROM processed_message").await,
        1
    );
    for change in [
        "UPDATE idemhost_key SET key = 'chosen'",
        "DELETE FROM idemhost_key",
        "TRUNCATE idemhost_key",
        // Triggers off, as logical replication's apply runs.
        "SET session_replication_role = replica; UPDATE idemhost_key SET key = 'chosen'",
    ] {
        let e = sqlx::raw_sql(sqlx::AssertSqlSafe(change))
            .execute(&env.pool)
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("the host key cannot change"),
            "{change}: {e}"
        );
    }
    assert_eq!(env.host_key().await, key);
    env.cleanup().await;
}
