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
//!   cargo test --features idemhost/failpoints --test wall

mod common;

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream;
use common::*;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

const WALL: &str = "wall-v1";
const HEALTHY: &str = "healthy-v1";
/// Where the lo_export / COPY attempts try to write.
const FILE: &str = "/tmp/idemhost-wall-breach";

/// One escape attempt: a name and the testkit steps (JSON).
struct Attack {
    name: &'static str,
    steps: String,
}

fn sql_step(kind: &str, sql: &str) -> String {
    format!(r#"{{"{kind}":{}}}"#, serde_json::json!(sql))
}

fn execute(sql: &str) -> String {
    sql_step("execute", sql)
}

fn query(sql: &str) -> String {
    sql_step("query", sql)
}

fn publish(subject: &str, headers: &[(&str, &str)]) -> String {
    format!(
        r#"{{"publish":{},"payload":"x","headers":{}}}"#,
        serde_json::json!(subject),
        serde_json::json!(headers)
    )
}

/// A business write that a successful escape would commit along with it.
fn effect() -> String {
    execute("UPDATE inventory SET reserved = reserved + 1 WHERE sku = 'sku-w'")
}

/// The escape attempts, by class. Each one ends with the business write and (swallowing every
/// error: `keep_going`) an `ok` from the plugin.
fn attacks(schema: &str, victim_stream: &str, kv_bucket: &str, allowed: &str) -> Vec<Attack> {
    let s = schema;
    let mut out = Vec::new();
    let mut add = |name: &'static str, steps: Vec<String>| {
        out.push(Attack {
            name,
            steps: steps.join(","),
        })
    };
    // -- role: become the host or another role, now or for later deliveries
    add("set role", vec![execute("SET ROLE root")]);
    add(
        "set_config role",
        vec![query("SELECT set_config('role', 'root', false)")],
    );
    add(
        "set_config role local",
        vec![query("SELECT set_config('role', 'root', true)")],
    );
    add("reset role", vec![execute("RESET ROLE")]);
    add(
        "session authorization",
        vec![execute("SET SESSION AUTHORIZATION root")],
    );
    add(
        "set_config session_authorization",
        vec![query(
            "SELECT set_config('session_authorization', 'root', false)",
        )],
    );
    add(
        "query_to_xml runs set_config",
        vec![query(
            "SELECT query_to_xml('select set_config(''role'', ''root'', false)', true, true, '')",
        )],
    );
    add(
        "pg_settings role",
        vec![execute(
            "UPDATE pg_settings SET setting = 'root' WHERE name = 'role'",
        )],
    );
    add(
        "cr ends a comment",
        vec![execute("SELECT 1 --x\r; SET ROLE root")],
    );
    add(
        "typed literal backslash",
        vec![execute("SELECT name'\\'; RESET ROLE; --'")],
    );
    add(
        "create superuser",
        vec![execute("CREATE ROLE wall_evil SUPERUSER LOGIN")],
    );
    add(
        "grant to self",
        vec![execute("GRANT ALL ON secret TO CURRENT_USER")],
    );
    add("read ungranted table", vec![query("SELECT x FROM secret")]);
    add(
        "write ungranted table",
        vec![execute("INSERT INTO secret VALUES (666)")],
    );
    add(
        "alter own defaults",
        vec![execute(
            "ALTER ROLE CURRENT_USER SET synchronous_commit = off",
        )],
    );
    // -- settings that later deliveries or the host's own statements would run with
    add(
        "pg_settings synchronous_commit",
        vec![execute(
            "UPDATE pg_settings SET setting = 'off' WHERE name = 'synchronous_commit'",
        )],
    );
    add(
        "set_config synchronous_commit session",
        vec![query(
            "SELECT set_config('synchronous_commit', 'off', false)",
        )],
    );
    add(
        "set_config synchronous_commit for this commit",
        vec![query(
            "SELECT set_config('synchronous_commit', 'off', true)",
        )],
    );
    add(
        "wedge read only",
        vec![query(
            "SELECT set_config('default_transaction_read_only', 'on', false)",
        )],
    );
    add(
        "search_path to pg_temp",
        vec![query(
            "SELECT set_config('search_path', 'pg_temp, public', false)",
        )],
    );
    add(
        "client_encoding",
        vec![query(
            "SELECT set_config('client_encoding', 'LATIN1', false)",
        )],
    );
    add(
        "set statement_timeout",
        vec![execute("SET statement_timeout = 0")],
    );
    add(
        "values hides set_config",
        vec![query(
            "VALUES ((SELECT set_config('lock_timeout', '1', false)))",
        )],
    );
    add(
        "explain analyze runs set_config",
        vec![query(
            "EXPLAIN ANALYZE SELECT set_config('synchronous_commit', 'off', false)",
        )],
    );
    // -- shadowing and the host's tables
    add(
        "temp marker table",
        vec![execute(
            "CREATE TEMP TABLE processed_message (consumer_name text, message_id text, processed_at timestamptz)",
        )],
    );
    add(
        "select into temp marker table",
        vec![execute(
            "SELECT * INTO TEMP processed_message FROM inventory",
        )],
    );
    add(
        "temp table behind a cr comment",
        vec![execute(
            "SELECT 1 --\rCREATE TEMP TABLE processed_message (consumer_name text, message_id text)",
        )],
    );
    add(
        "delete markers",
        vec![execute("DELETE FROM processed_message")],
    );
    add(
        "forge a marker",
        vec![execute(
            "INSERT INTO processed_message (consumer_name, message_id) VALUES ('healthy-v1', 'forged-1')",
        )],
    );
    add(
        "merge a forged marker",
        vec![execute(
            "MERGE INTO processed_message m USING (VALUES ('healthy-v1', 'forged-3')) v(c, i) \
             ON m.message_id = v.i WHEN NOT MATCHED THEN INSERT (consumer_name, message_id) VALUES (v.c, v.i)",
        )],
    );
    add(
        "qualified host table",
        vec![execute(&format!("DELETE FROM \"{s}\".processed_message"))],
    );
    add(
        "unicode escaped name",
        vec![execute("DELETE FROM U&\"processed\\005fmessage\"")],
    );
    add(
        "truncate markers",
        vec![execute("TRUNCATE processed_message")],
    );
    add(
        "lock markers",
        vec![execute("LOCK TABLE processed_message")],
    );
    add(
        "row locks on markers",
        vec![query("SELECT * FROM processed_message FOR UPDATE")],
    );
    add(
        "versions",
        vec![execute(
            "UPDATE processed_message_handler SET plugin_digest = 'x'",
        )],
    );
    add(
        "outbox row",
        vec![execute(&format!(
            "INSERT INTO outbox_message (consumer_name, source_message_id, seq, subject, headers, payload) \
             VALUES ('x', 'y', 0, '$JS.API.STREAM.DELETE.{victim_stream}', '[]', '')"
        ))],
    );
    add(
        "read the host key",
        vec![query("SELECT key FROM idemhost_key")],
    );
    add(
        "claim with a guessed key",
        vec![query(&format!(
            "SELECT \"{s}\".idemhost_claim('guess', 'healthy-v1', 'forged-2', NULL)"
        ))],
    );
    add(
        "outbox function with a guessed key",
        vec![query(&format!(
            "SELECT \"{s}\".idemhost_outbox_insert('guess', 'x', 'y', 0, '$KV.{kv_bucket}.k', '[]'::jsonb, ''::bytea)"
        ))],
    );
    add(
        "authorize directly",
        vec![query(&format!(
            "SELECT \"{s}\".idemhost_authorize('guess')"
        ))],
    );
    add(
        "repair log",
        vec![execute("DELETE FROM dead_letter_repair")],
    );
    // -- the server: files, large objects, other sessions, session-lasting state
    add(
        "lo_export",
        vec![query(&format!(
            "SELECT lo_export(lo_from_bytea(0, 'x'), '{FILE}')"
        ))],
    );
    add(
        "large object",
        vec![query("SELECT lo_from_bytea(0, 'kept')")],
    );
    add(
        "read a server file",
        vec![query("SELECT pg_read_file('/etc/passwd')")],
    );
    add(
        "copy to a file",
        vec![execute(&format!("COPY inventory TO '{FILE}'"))],
    );
    add(
        "copy to a program",
        vec![execute(
            "COPY inventory TO PROGRAM 'touch /tmp/idemhost-wall-program'",
        )],
    );
    add(
        "end other sessions",
        vec![query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid()",
        )],
    );
    add(
        "session advisory lock",
        vec![query("SELECT pg_advisory_lock(42)")],
    );
    add("listen", vec![execute("LISTEN wall")]);
    add(
        "notify the relay",
        vec![query("SELECT pg_notify('idemhost_outbox', 'x')")],
    );
    add(
        "held cursor",
        vec![execute("DECLARE c CURSOR WITH HOLD FOR SELECT 1")],
    );
    add(
        "prepared statement",
        vec![execute("PREPARE wall_p AS SELECT 1")],
    );
    add("commit early", vec![execute("COMMIT")]);
    add("savepoint and release", vec![execute("SAVEPOINT s")]);
    add(
        "do block",
        vec![execute(
            "DO $$ BEGIN PERFORM set_config('role', 'root', false); END $$",
        )],
    );
    // -- the outbox: subjects and headers
    add(
        "delete a stream",
        vec![publish(
            &format!("$JS.API.STREAM.DELETE.{victim_stream}"),
            &[],
        )],
    );
    add(
        "write a kv key",
        vec![publish(&format!("$KV.{kv_bucket}.k"), &[])],
    );
    add("system subject", vec![publish("$SYS.REQ.SERVER.PING", &[])]);
    add("reply inbox", vec![publish("_INBOX.wall", &[])]);
    add(
        "subject not allowed",
        vec![publish("elsewhere.events", &[])],
    );
    add(
        "broker id header",
        vec![publish(
            &format!("{allowed}.x"),
            &[("Nats-Msg-Id", "forged")],
        )],
    );
    add(
        "expected stream header",
        vec![publish(
            &format!("{allowed}.x"),
            &[("Nats-Expected-Last-Sequence", "0")],
        )],
    );
    add(
        "host id header",
        vec![publish(
            &format!("{allowed}.x"),
            &[("Idemhost-Message-Id", "forged")],
        )],
    );
    add(
        "header injection",
        vec![publish(
            &format!("{allowed}.x"),
            &[("X-A", "a\r\nNats-Msg-Id: forged")],
        )],
    );
    // -- bounds the plugin cannot move
    add(
        "sleep past the deadline",
        vec![query("SELECT pg_sleep(30)")],
    );
    add(
        "widen the timeout, then sleep",
        vec![
            query("SELECT set_config('statement_timeout', '0', true)"),
            query("SELECT pg_sleep(30)"),
        ],
    );
    add(
        "too many rows",
        vec![query("SELECT generate_series(1, 20000)")],
    );
    add(
        "too many bytes",
        vec![query(
            "SELECT repeat('x', 4000000) FROM generate_series(1, 5)",
        )],
    );
    add("loop", vec![r#""loop""#.to_string()]);
    add("memory bomb", vec![r#"{"alloc_mib": 512}"#.to_string()]);
    add("swallowed database error", vec![execute("SELECT 1/0")]);
    // -- functional notation: `(x).f` calls f(x) without a function-call node
    add(
        "ts_stat runs set_config",
        vec![query(
            "SELECT (('SELECT set_config(''client_encoding'', ''LATIN1'', false)::tsvector'::text).ts_stat).word",
        )],
    );
    add(
        "ts_stat runs pg_notify",
        vec![query(
            "SELECT (('SELECT pg_notify(''other_app'', ''x'')::text::tsvector'::text).ts_stat).word",
        )],
    );
    add(
        "advisory lock by notation",
        vec![query("SELECT (42::bigint).pg_advisory_lock")],
    );
    add(
        "large object by notation",
        vec![query("SELECT (0::oid).lo_create")],
    );
    add(
        "end own session by notation",
        vec![query("SELECT (pg_backend_pid()).pg_terminate_backend")],
    );
    out
}

/// A testkit payload: the attack's steps, then the business write; every error swallowed.
fn attack_payload(attack: &Attack) -> String {
    format!(
        r#"{{"keep_going":true,"steps":[{},{}]}}"#,
        attack.steps,
        effect()
    )
}

/// What a probe delivery records of the session it runs in.
const PROBE_SQL: &str = "INSERT INTO probe \
    SELECT $1, pg_backend_pid(), current_user, session_user, \
        current_setting('synchronous_commit'), current_setting('search_path'), \
        current_setting('statement_timeout'), current_setting('default_transaction_read_only'), \
        current_setting('transaction_read_only'), current_setting('client_encoding'), \
        current_setting('lock_timeout'), \
        (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()), \
        (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()), \
        (SELECT count(*) FROM pg_listening_channels()), \
        (SELECT count(*) FROM pg_cursors WHERE name <> ''), \
        (SELECT count(*) FROM pg_prepared_statements WHERE from_sql)";

const TABLES_SQL: &str = "
    CREATE TABLE probe (label text PRIMARY KEY, pid int, cur_user text, sess_user text,
        synchronous_commit text, search_path text, statement_timeout text,
        default_read_only text, read_only text, client_encoding text, lock_timeout text,
        temp_relations bigint, advisory_locks bigint, listening bigint, cursors bigint,
        prepared bigint);
    CREATE TABLE applied (message_id text NOT NULL);
    CREATE TABLE secret (x integer);
    INSERT INTO secret VALUES (42);
    INSERT INTO inventory VALUES ('sku-w', 1000000, 0), ('sku-h', 1000000, 0);";

/// A `probe` row: label, pid, eight settings and user names, five leftover counts.
type ProbeRow = (
    String,
    i32,
    String,
    String,
    String,
    String,
    String,
    String,
    String,
    String,
    String,
    i64,
    i64,
    i64,
    i64,
    i64,
);

/// How the host and the plugin's role are set up.
#[derive(Clone, Copy, PartialEq, Debug)]
enum SetUp {
    /// No `consumer.role`; the host connects as a superuser and provisions the role.
    Default,
    /// The host logs in as a non-superuser owning its schema; an administrator made the role.
    Hardened,
    /// The default with the SQL gate off.
    Ungated,
}

/// The database side of one set-up.
struct Db {
    schema: String,
    /// The host's role (for the hardened set-up) and its pool; root's otherwise.
    host_user: String,
    pool: PgPool,
    admin: PgPool,
    /// Roles to drop at the end.
    roles: Vec<String>,
    /// `consumer.role` lines for the two consumers (hardened only).
    role_lines: [String; 2],
}

async fn admin_pool() -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .connect(&PG_URL)
        .await
        .unwrap()
}

async fn run(admin: &PgPool, sql: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
        .execute(admin)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

impl Db {
    async fn new(setup: SetUp) -> Db {
        init_logs();
        let tag = unique("wall");
        let schema = format!("t_{tag}");
        let admin = admin_pool().await;
        let (host_user, roles, role_lines) = if setup == SetUp::Hardened {
            let host = format!("h_{tag}");
            let plugin = format!("p_{tag}");
            let healthy = format!("q_{tag}");
            for sql in [
                format!("CREATE ROLE {host} LOGIN NOSUPERUSER"),
                format!("CREATE SCHEMA {schema} AUTHORIZATION {host}"),
                format!("CREATE ROLE {plugin} LOGIN NOINHERIT"),
                format!("CREATE ROLE {healthy} LOGIN NOINHERIT"),
                // The host may then stop their statements at the deadline.
                format!("GRANT {plugin}, {healthy} TO {host}"),
            ] {
                run(&admin, &sql).await;
            }
            let lines = [
                format!("role = \"{plugin}\"\n"),
                format!("role = \"{healthy}\"\n"),
            ];
            (host.clone(), vec![plugin, healthy, host], lines)
        } else {
            run(&admin, &format!("CREATE SCHEMA {schema}")).await;
            (
                "root".to_string(),
                Vec::new(),
                [String::new(), String::new()],
            )
        };
        let url = format!("postgres://{host_user}@127.0.0.1:5432/test");
        let pool = schema_pool(&url, &schema, 4).await;
        run(&pool, TABLES_SQL).await;
        Db {
            schema,
            host_user,
            pool,
            admin,
            roles,
            role_lines,
        }
    }

    fn postgres_toml(&self) -> String {
        format!(
            "[postgres]\nurl = \"postgres://{}@127.0.0.1:5432/test\"\nschema = \"{}\"\nmax_connections = 8\napplication_name = \"{}\"\n",
            self.host_user, self.schema, self.schema
        )
    }

    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar::<_, Option<i64>>(sqlx::AssertSqlSafe(sql.to_string()))
            .fetch_one(&self.admin_in_schema().await)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .unwrap_or(0)
    }

    /// A superuser connection on this schema, for the checks (whatever the host's role).
    async fn admin_in_schema(&self) -> PgPool {
        let options =
            idemhost::pg::connect_options(&PG_URL, Some(&self.schema), "wall-check").unwrap();
        PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .unwrap()
    }

    async fn cleanup(self) {
        self.pool.close().await;
        run(&self.admin, &format!("DROP SCHEMA {} CASCADE", self.schema)).await;
        let mut roles = self.roles;
        let provisioned: Vec<String> =
            sqlx::query_scalar("SELECT rolname::text FROM pg_roles WHERE starts_with(rolname, $1)")
                .bind(format!("idemhost_{}_", self.schema))
                .fetch_all(&self.admin)
                .await
                .unwrap();
        roles.extend(provisioned);
        for role in roles {
            let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""
            )))
            .execute(&self.admin)
            .await;
        }
    }
}

fn headers(nats_id: &str, message_id: Option<&str>) -> async_nats::HeaderMap {
    let mut h = async_nats::HeaderMap::new();
    h.insert("Nats-Msg-Id", nats_id);
    if let Some(id) = message_id {
        h.insert("Idemhost-Message-Id", id);
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
        messages.push((headers(&format!("{id}-a"), Some(&id)), twice(&id)));
        messages.push((headers(&format!("{id}-b"), Some(&id)), twice(&id)));
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
        let expected = (
            role.as_str(),
            role.as_str(),
            host_commit.as_str(),
            db.schema.as_str(),
            "30s",
            "off",
            "off",
            "UTF8",
            "0",
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
            p.10.as_str(),
        );
        if seen != expected || (p.11, p.12, p.13, p.14, p.15) != (0, 0, 0, 0, 0) {
            breaches.push(format!(
                "{name}: the next delivery's session is not clean: {seen:?} leftovers {:?}",
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
        let defaults = db
            .scalar(&format!(
                "SELECT count(*) FROM pg_db_role_setting WHERE setrole = '{role}'::regrole"
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
    for sql in [
        format!("CREATE ROLE {member} LOGIN IN ROLE root"),
        format!("CREATE ROLE {peeker} LOGIN"),
        format!(
            "GRANT SELECT ON {}.processed_message TO {peeker}",
            db.schema
        ),
    ] {
        run(&db.admin, &sql).await;
    }
    for (role, why) in [
        ("root", "superuser"),
        (member.as_str(), "member of root"),
        (peeker.as_str(), "privilege on the host's processed_message"),
    ] {
        let error = start_error(one_consumer(&db, &nats, &format!("role = \"{role}\""))).await;
        assert!(
            error.contains("refusing to run its plugin") && error.contains(why),
            "{role}: {error}"
        );
    }
    let mut db = db;
    db.roles.extend([member, peeker]);
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
    let switch = r#"{"steps":[{"query":"SELECT set_config('client_encoding', 'LATIN1', false)"}]}"#;
    let fail =
        r#"{"steps":[{"fail":"terminal","reason":"makes the batch run again with savepoints"}]}"#;
    // One batch: the switch, a failure (the batch runs again, message by message), the id.
    nats.publish_many([
        (headers("enc-switch", None), switch.to_string()),
        (headers("enc-fail", None), fail.to_string()),
        (headers("enc-a", Some(id)), insert(id)),
    ])
    .await;
    nats.wait_drained(WALL, Duration::from_secs(60)).await;
    // The same message again, past the broker.
    nats.publish_many([(headers("enc-b", Some(id)), insert(id))])
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
