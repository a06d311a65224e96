//! The escape attempts of `wall.rs`: each one a hostile plugin's SQL and publishes, sent
//! through the `testkit` component.

use super::*;

/// One escape attempt: a name and the testkit steps (JSON).
pub struct Attack {
    pub name: &'static str,
    pub steps: String,
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
pub fn attacks(schema: &str, victim_stream: &str, kv_bucket: &str, allowed: &str) -> Vec<Attack> {
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
    // The role's own defaults, then its session ended so that the next delivery logs in
    // afresh: the host's values given at login outrank the role's.
    add(
        "alter own timeout and durability, then a new session",
        vec![
            execute("ALTER ROLE CURRENT_USER SET statement_timeout = 0"),
            execute("ALTER ROLE CURRENT_USER SET synchronous_commit = off"),
            query("SELECT pg_terminate_backend(pg_backend_pid())"),
        ],
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
pub fn attack_payload(attack: &Attack) -> String {
    format!(
        r#"{{"keep_going":true,"steps":[{},{}]}}"#,
        attack.steps,
        effect()
    )
}
