//! The database side of the plugin wall: plugins' SQL runs on connections that *log in* as
//! their consumer's role, so no statement or function can make it act as the host (a role
//! switch that SQL could undo is not a wall). This module provisions and checks those roles,
//! opens their pools, and holds the host key and the names of the `SECURITY DEFINER` functions
//! (migration 0006) through which the host writes markers, plugin versions and outbox rows in
//! a delivery's transaction.

use std::str::FromStr;

use sqlx::postgres::PgConnectOptions;
use sqlx::{PgPool, Row};

use super::describe;
use crate::config::{ConsumerConfig, PostgresConfig, is_plain_identifier};
use crate::sql_gate::HOST_RELATIONS;

/// The host key (never shown to a plugin: sent only as a bound parameter) and the qualified
/// names of the host's functions, read once from the host's own connection.
#[derive(Clone)]
pub struct Wall {
    pub(crate) key: String,
    pub(crate) claim_sql: String,
    pub(crate) claim_all_sql: String,
    pub(crate) outbox_sql: String,
    /// Sent with every COMMIT: the durability the operator configured, re-asserted after the
    /// plugin ran (whatever it set in the transaction).
    pub(crate) commit_sql: String,
    /// Opens a delivery's transaction (see [`Wall::load`]).
    pub(crate) begin_sql: String,
    /// Opens a group-commit transaction: [`Wall::begin_sql`] and the group's `lock_timeout`.
    pub(crate) begin_group_sql: String,
    /// Run in a group between one delivery's handler and the next one's (see
    /// [`Wall::between_sql`]).
    pub(crate) between_sql: String,
    /// Rolls a delivery back and resets the session.
    pub(crate) rollback_sql: String,
}

#[cfg_attr(not(feature = "test-support"), allow(dead_code))]
impl Wall {
    /// Opens a delivery's transaction: `BEGIN ... READ WRITE` and the host's `SET LOCAL`s.
    pub fn begin_sql(&self) -> &str {
        &self.begin_sql
    }

    /// Opens a group-commit transaction: as [`Wall::begin_sql`], and a lock wait longer than
    /// the consumer's `batch_lock_timeout` fails (55P03) instead of waiting. A group holds the
    /// row locks of all its deliveries until its COMMIT, so two groups that lock hot rows in
    /// different orders deadlock, and the server breaks a deadlock only after
    /// `deadlock_timeout` (1 s by default). A group whose wait is given up is sent back one
    /// delivery at a time, each in a transaction without that limit.
    pub fn begin_group_sql(&self) -> &str {
        &self.begin_group_sql
    }

    /// Clears, inside a group's transaction, what one delivery's plugin left in the session
    /// before the next delivery's handler runs: settings, temporary objects, cursors, session
    /// advisory locks (a LISTEN takes effect only at COMMIT, after which the session reset
    /// undoes it), then sets the group's own settings again; its row says whether SQL-level
    /// prepared statements are left or the transaction was made read-only (`SET TRANSACTION
    /// READ ONLY` cannot be undone in it, and would fail the next deliveries' writes). Deliveries of a group share a
    /// transaction, not what their plugin set in it: one round trip per delivery after the
    /// first that ran its handler.
    pub fn between_sql(&self) -> &str {
        &self.between_sql
    }

    /// Ends a delivery's transaction: the host's `SET LOCAL`s, `COMMIT`, the session reset.
    pub fn commit_sql(&self) -> &str {
        &self.commit_sql
    }
}

/// Sent after every COMMIT or ROLLBACK of a delivery, in the same round trip, so nothing a
/// plugin left in the session outlives its delivery: settings (`pg_settings`, `set_config(...,
/// false)`), temporary tables and functions, held cursors, LISTEN (effective at once: these run
/// in a transaction of their own after the delivery's ended), session advisory locks. The last
/// row says whether SQL-level prepared statements are left: then the connection is closed, not
/// kept (`DEALLOCATE ALL` would also drop the client's own). `role` and `session_authorization`
/// are not settings a plugin can move: its connection logs in as its own role, a member of none.
const SESSION_RESET: &str = "RESET ALL; DISCARD TEMP; CLOSE ALL; UNLISTEN *; \
     SELECT pg_advisory_unlock_all(); \
     SELECT EXISTS (SELECT 1 FROM pg_prepared_statements WHERE from_sql)";

/// `SET LOCAL name = 'value'` for each setting (values already escaped), `;`-separated.
fn set_local(settings: &[(&str, String)]) -> String {
    settings
        .iter()
        .map(|(name, value)| format!("SET LOCAL {name} = '{value}'"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// `name` as a quoted identifier.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

impl Wall {
    /// Reads the key, the schema of the host's tables and the server's `synchronous_commit`
    /// through `pool`, a pool of the host's own role. `group_lock_timeout`: the lock wait a
    /// group-commit transaction allows (see [`Wall::begin_group_sql`]; `None`: no limit).
    ///
    /// A delivery's transaction begins (one round trip) with `READ WRITE` at `isolation`, the
    /// host's `synchronous_commit` and `statement_timeout`, and commits with that
    /// `synchronous_commit` again: nothing a plugin set — in its transaction, or for its role
    /// (`ALTER ROLE ... SET`) — decides how the host's own statements and the COMMIT run. The
    /// session is reset as the delivery ends ([`SESSION_RESET`]).
    pub async fn load(
        pool: &PgPool,
        isolation: crate::config::Isolation,
        statement_timeout: std::time::Duration,
        group_lock_timeout: Option<std::time::Duration>,
    ) -> Result<Wall, sqlx::Error> {
        let row = sqlx::query(
            "SELECT current_schema()::text, k.key, current_setting('synchronous_commit') \
             FROM idemhost_key k",
        )
        .fetch_one(pool)
        .await?;
        let schema: String = row.try_get(0)?;
        let key: String = row.try_get(1)?;
        let synchronous_commit: String = row.try_get(2)?;
        let s = quote_ident(&schema);
        // The host's settings of a delivery's transaction, as (name, value); a group's adds its
        // lock timeout. `synchronous_commit` is one of a fixed set of words; quoted all the same.
        let durability = ("synchronous_commit", synchronous_commit.replace('\'', "''"));
        let commit_sql = format!(
            "{}; COMMIT; {SESSION_RESET}",
            set_local(std::slice::from_ref(&durability))
        );
        let rollback_sql = format!("ROLLBACK; {SESSION_RESET}");
        let mut locals = vec![
            durability,
            (
                "statement_timeout",
                statement_timeout.as_millis().max(1).to_string(),
            ),
        ];
        let begin = format!("BEGIN ISOLATION LEVEL {} READ WRITE", isolation.sql());
        let begin_sql = format!("{begin}; {}", set_local(&locals));
        if let Some(t) = group_lock_timeout {
            locals.push(("lock_timeout", t.as_millis().max(1).to_string()));
        }
        let begin_group_sql = format!("{begin}; {}", set_local(&locals));
        // Inside the transaction: `RESET ALL` and the settings after it are the transaction's
        // until it ends. LISTEN is left to the reset after COMMIT: it takes effect only then.
        // The settings go in one SELECT with the lock release and the check (`set_config(...,
        // true)` is `SET LOCAL`): four statements rather than nine, the last one's row the
        // answer.
        let set_configs: Vec<String> = locals
            .iter()
            .map(|(name, value)| format!("pg_catalog.set_config('{name}', '{value}', true)"))
            .collect();
        let between_sql = format!(
            "RESET ALL; DISCARD TEMP; CLOSE ALL; \
             SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_prepared_statements WHERE from_sql) \
             OR pg_catalog.current_setting('transaction_read_only')::bool \
             FROM (SELECT pg_catalog.pg_advisory_unlock_all(), {}) AS host",
            set_configs.join(", ")
        );
        Ok(Wall {
            key,
            claim_sql: format!(
                "SELECT {s}.idemhost_claim($1, $2, $3, $4), pg_catalog.pg_backend_pid()"
            ),
            claim_all_sql: format!("SELECT {s}.idemhost_claim_all($1, $2, $3, $4)"),
            outbox_sql: format!("SELECT {s}.idemhost_outbox_insert($1, $2, $3, $4, $5, $6, $7)"),
            commit_sql,
            begin_sql,
            begin_group_sql,
            between_sql,
            rollback_sql,
        })
    }
}

/// The login role a consumer's plugin runs as: `consumer.role`, else one the host derives from
/// the schema and the consumer name (`idemhost_<schema>_<name>`, a plain identifier).
pub fn plugin_role(postgres: &PostgresConfig, consumer: &ConsumerConfig) -> String {
    if let Some(role) = &consumer.role {
        return role.clone();
    }
    let raw = match &postgres.schema {
        Some(schema) => format!("idemhost_{schema}_{}", consumer.name),
        None => format!("idemhost_{}", consumer.name),
    };
    let mut name: String = raw
        .to_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.len() > 63 {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(raw.as_bytes());
        let hex: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
        name.truncate(54);
        name.push('_');
        name.push_str(&hex);
    }
    debug_assert!(is_plain_identifier(&name));
    name
}

/// The longest backend message a plugin's session accepts: a result's bound
/// ([`crate::sql_gate::MAX_RESULT_BYTES`]) and the framing of its columns.
pub(crate) const PLUGIN_MESSAGE_BYTES: usize = crate::sql_gate::MAX_RESULT_BYTES + (64 << 10);

/// Options for a connection that logs in as `role`: the host's URL with its user replaced and
/// its password dropped (the role's own, if configured, instead).
pub fn role_connect_options(
    postgres: &PostgresConfig,
    failover: &super::Failover,
    role: &str,
    password: Option<&str>,
) -> anyhow::Result<PgConnectOptions> {
    connect_as(
        failover.current_url(),
        postgres.schema.as_deref(),
        &postgres.application_name,
        role,
        password,
    )
}

/// [`role_connect_options`] from the parts of a `[postgres]` section.
pub fn connect_as(
    url: &str,
    schema: Option<&str>,
    application_name: &str,
    role: &str,
    password: Option<&str>,
) -> anyhow::Result<PgConnectOptions> {
    let shown = super::redact_url(url);
    let mut url =
        url::Url::parse(url).map_err(|e| anyhow::anyhow!("invalid postgres.url {shown}: {e}"))?;
    url.set_username(role)
        .and_then(|()| url.set_password(password))
        .map_err(|()| anyhow::anyhow!("postgres.url {shown} cannot carry a user name"))?;
    let mut options = PgConnectOptions::from_str(url.as_str())
        .map_err(|e| anyhow::anyhow!("invalid postgres.url {shown}: {e}"))?
        .application_name(application_name);
    if let Some(schema) = schema {
        options = options.options([("search_path", schema)]);
    }
    // A plugin's sessions get no notices or warnings: the server does not send them (one
    // statement raising a notice per row put 150,000 lines in the host's log). Errors still
    // come back as errors. The session default, so the reset after each delivery keeps it, and
    // the gate refuses every way to change it.
    options = options.options([("client_min_messages", "error")]);
    // A row, an error or a notice longer than a whole result may be is refused from its
    // header, before it is buffered: the host never allocates a value a plugin made the server
    // build (one row holds up to 1 GB), and the connection is closed.
    Ok(options.max_message_size(PLUGIN_MESSAGE_BYTES))
}

/// A pool of connections logged in as `role`, checked by one connection; it follows `failover`.
pub async fn role_pool(
    postgres: &PostgresConfig,
    failover: &std::sync::Arc<super::Failover>,
    role: &str,
    password: Option<&str>,
    max_connections: u32,
) -> anyhow::Result<PgPool> {
    let options = role_connect_options(postgres, failover, role, password)?;
    let pool = failover
        .pool_options()
        .max_connections(max_connections.max(1))
        .acquire_timeout(postgres.acquire_timeout.0)
        .connect_with(options)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "failed to connect to PostgreSQL as the plugin role {role}: {e} (the role needs \
                 LOGIN and an entry in pg_hba.conf; set consumer.role_password if the server \
                 asks for one)"
            )
        })?;
    failover.follow(&pool);
    Ok(pool)
}

/// Makes `role` ready to run `consumer`'s plugin and proves it cannot reach past its grants:
/// creates it when missing (if the host's role may create roles), grants it the host's claim
/// and outbox functions, the schema and `consumer.tables`, then checks what it can reach.
/// An error says exactly what an administrator has to run instead.
pub async fn provision(pool: &PgPool, consumer: &ConsumerConfig, role: &str) -> anyhow::Result<()> {
    provision_role(
        pool,
        &consumer.name,
        role,
        &consumer.tables,
        consumer.role_password.as_deref(),
    )
    .await?;
    bound_role(pool, &consumer.name, role, &consumer.role_settings).await;
    Ok(())
}

/// What the host sets on a plugin's role unless `consumer.role_settings` says otherwise: the
/// server resources one session may take that PostgreSQL can bound per role, and what the
/// server logs on the plugin's behalf.
pub(crate) const ROLE_SETTINGS: &[(&str, &str)] = &[
    ("temp_file_limit", "1GB"),
    ("work_mem", "4MB"),
    ("log_min_messages", "fatal"),
];

/// Sets the plugin's role's bounds (`ALTER ROLE … SET`; new sessions take them, the session
/// reset after each delivery restores them, and no statement a plugin may send changes them).
/// One the host's role may not set is a warning naming the statement to run: a host that is
/// not a superuser may not set `temp_file_limit` or `log_min_messages` on another role.
pub async fn bound_role(
    pool: &PgPool,
    consumer_name: &str,
    role: &str,
    overrides: &std::collections::BTreeMap<String, String>,
) {
    let mut settings: std::collections::BTreeMap<&str, &str> =
        ROLE_SETTINGS.iter().copied().collect();
    for (name, value) in overrides {
        settings.insert(name, value);
    }
    let r = quote_ident(role);
    for (name, value) in settings {
        let sql = if value == "default" {
            format!("ALTER ROLE {r} RESET {}", quote_ident(name))
        } else {
            format!(
                "ALTER ROLE {r} SET {} = '{}'",
                quote_ident(name),
                value.replace('\'', "''")
            )
        };
        let mut result = Ok(());
        // Replicas starting together set the same role: "tuple concurrently updated".
        for _ in 0..3 {
            result = sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                .execute(pool)
                .await
                .map(|_| ());
            match &result {
                Err(e) if describe(e).contains("concurrently") => continue,
                _ => break,
            }
        }
        if let Err(e) = result {
            tracing::warn!(
                consumer = consumer_name,
                error = %describe(&e),
                "the plugin's role is not bounded as configured; as a superuser, run: {sql}"
            );
        }
    }
}

/// [`provision`] from its parts: the consumer's name, its role, the tables to grant and the
/// role's password (set only when the host creates the role).
///
/// Hosts of one schema provision one at a time (see the lock below). Hosts of different
/// schemas may share a role only by naming it (`consumer.role`); their GRANTs on it can then
/// collide ("tuple concurrently updated"), and provisioning is tried again, up to 5 times.
pub async fn provision_role(
    pool: &PgPool,
    consumer_name: &str,
    role: &str,
    tables: &[String],
    password: Option<&str>,
) -> anyhow::Result<()> {
    let mut attempt = 1;
    loop {
        match provision_role_once(pool, consumer_name, role, tables, password).await {
            Err(e) if attempt < 5 && format!("{e:#}").contains("concurrently updated") => {
                attempt += 1;
                tokio::time::sleep(std::time::Duration::from_millis(20 * attempt)).await;
            }
            other => return other,
        }
    }
}

async fn provision_role_once(
    pool: &PgPool,
    consumer_name: &str,
    role: &str,
    tables: &[String],
    password: Option<&str>,
) -> anyhow::Result<()> {
    let r = quote_ident(role);
    let mut tx = pool.begin().await?;
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(&mut *tx)
        .await?;
    let s = quote_ident(&schema);
    // One host at a time (replicas, tests in parallel): concurrent GRANTs on one role collide.
    // The lock is on the host's key table, which no plugin role may read, let alone lock — not
    // an advisory lock: any session can take any advisory key, and a plugin holding the one the
    // host waits for would stall every host's start-up for as long as it kept a delivery open.
    // SHARE ROW EXCLUSIVE conflicts with itself, not with the ACCESS SHARE deliveries take
    // reading the key.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "LOCK TABLE {s}.idemhost_key IN SHARE ROW EXCLUSIVE MODE"
    )))
    .execute(&mut *tx)
    .await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)")
            .bind(role)
            .fetch_one(&mut *tx)
            .await?;
    let functions = format!(
        "{s}.idemhost_claim(text, text, text, text), {s}.idemhost_claim_all(text, text, text[], text), \
         {s}.idemhost_outbox_insert(text, text, text, integer, text, jsonb, bytea)"
    );
    let mut grants = vec![
        format!("GRANT USAGE ON SCHEMA {s} TO {r}"),
        format!("GRANT EXECUTE ON FUNCTION {functions} TO {r}"),
    ];
    for table in tables {
        if table == "*" {
            grants.push(format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {s} TO {r}"
            ));
        } else {
            let t = qualified(&schema, table);
            grants.push(format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE {t} TO {r}"
            ));
        }
    }
    // Sequences: only those of the granted tables (serial and identity columns). `nextval` is
    // not undone by a rollback, so USAGE on another consumer's sequence let a plugin drain it
    // with deliveries that never committed. Earlier versions granted every sequence of the
    // schema: that is taken back first.
    grants.push(format!(
        "REVOKE ALL ON ALL SEQUENCES IN SCHEMA {s} FROM {r}"
    ));
    for sequence in owned_sequences(&mut tx, &schema, tables).await? {
        grants.push(format!("GRANT USAGE ON SEQUENCE {sequence} TO {r}"));
    }
    // Take back anything on the host's relations (the statements above may include them, and
    // column-level grants survive table-level checks).
    for relation in HOST_RELATIONS {
        let kind = if relation.ends_with("_seq") {
            "SEQUENCE"
        } else {
            "TABLE"
        };
        grants.push(format!("REVOKE ALL ON {kind} {s}.{relation} FROM {r}"));
    }
    // The host may then stop a plugin's statement on the server at its deadline.
    let member: bool = if exists {
        sqlx::query_scalar("SELECT pg_has_role(current_user, $1, 'MEMBER')")
            .bind(role)
            .fetch_one(&mut *tx)
            .await?
    } else {
        false
    };
    if !member {
        grants.push(format!("GRANT {r} TO CURRENT_USER"));
    }
    let create = format!(
        "CREATE ROLE {r} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT{}",
        match password {
            Some(_) => " PASSWORD '…'",
            None => "",
        }
    );
    let advice = |why: &str| {
        let mut all = Vec::new();
        if !exists {
            all.push(create.clone());
        }
        all.extend(grants.iter().cloned());
        anyhow::anyhow!(
            "consumer {}: the plugin's role {role} is not ready ({why}); as a role that may \
             create roles and owns the host's schema, run:\n  {};",
            consumer_name,
            all.join(";\n  ")
        )
    };
    if exists && let Some(problem) = unsafe_reason(&mut tx, role).await? {
        anyhow::bail!(
            "consumer {}: refusing to run its plugin as role {role}: {problem}. A plugin's role \
             must be a plain login role granted only its own tables",
            consumer_name
        );
    }
    if !exists {
        let mut sql = format!(
            "CREATE ROLE {r} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT"
        );
        if let Some(password) = password {
            sql.push_str(&format!(" PASSWORD '{}'", password.replace('\'', "''")));
        }
        if let Err(e) = sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut *tx)
            .await
        {
            return Err(advice(&describe(&e)));
        }
    }
    for grant in &grants {
        if let Err(e) = sqlx::query(sqlx::AssertSqlSafe(grant.clone()))
            .execute(&mut *tx)
            .await
        {
            return Err(advice(&describe(&e)));
        }
    }
    if let Some(problem) = unsafe_reason(&mut tx, role).await? {
        anyhow::bail!(
            "consumer {}: refusing to run its plugin as role {role}: {problem}. A plugin's role \
             must be a plain login role granted only its own tables",
            consumer_name
        );
    }
    tx.commit().await?;
    Ok(())
}

/// The sequences owned by `tables` (`*`: every table of `schema`), as qualified names.
async fn owned_sequences(
    conn: &mut sqlx::PgConnection,
    schema: &str,
    tables: &[String],
) -> Result<Vec<String>, sqlx::Error> {
    let all = tables.iter().any(|t| t == "*");
    let named: Vec<String> = tables
        .iter()
        .filter(|t| *t != "*")
        .map(|t| qualified(schema, t))
        .collect();
    sqlx::query_scalar(
        "SELECT DISTINCT format('%I.%I', n.nspname, c.relname) \
         FROM pg_catalog.pg_depend d \
         JOIN pg_catalog.pg_class c ON c.oid = d.objid \
         JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
         JOIN pg_catalog.pg_class t ON t.oid = d.refobjid \
         JOIN pg_catalog.pg_namespace tn ON tn.oid = t.relnamespace \
         WHERE d.classid = 'pg_catalog.pg_class'::regclass \
           AND d.refclassid = 'pg_catalog.pg_class'::regclass \
           AND d.deptype IN ('a', 'i') AND c.relkind = 'S' \
           AND (($1 AND tn.nspname = $2) OR t.oid IN (SELECT pg_catalog.to_regclass(x) FROM unnest($3::text[]) x)) \
         ORDER BY 1",
    )
    .bind(all)
    .bind(schema)
    .bind(&named)
    .fetch_all(conn)
    .await
}

fn qualified(schema: &str, table: &str) -> String {
    match table.split_once('.') {
        Some((s, t)) => format!("{}.{}", quote_ident(s), quote_ident(t)),
        None => format!("{}.{}", quote_ident(schema), quote_ident(table)),
    }
}

/// Why `role` cannot be a plugin's role, if it cannot: attributes or memberships that reach
/// past its grants, or any privilege on a host relation.
async fn unsafe_reason(
    conn: &mut sqlx::PgConnection,
    role: &str,
) -> Result<Option<String>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT r.rolsuper, r.rolcreaterole, r.rolcreatedb, r.rolreplication, r.rolbypassrls, \
                r.rolcanlogin, r.rolname = current_user, \
                (SELECT string_agg(o.rolname, ', ' ORDER BY o.rolname) FROM pg_roles o \
                 WHERE o.oid <> r.oid AND pg_has_role(r.oid, o.oid, 'MEMBER') \
                   AND (o.rolsuper OR o.rolcreaterole OR o.rolbypassrls OR o.rolreplication \
                        OR o.rolname = current_user \
                        OR o.rolname IN ('pg_read_server_files', 'pg_write_server_files', \
                           'pg_execute_server_program', 'pg_read_all_data', 'pg_write_all_data', \
                           'pg_signal_backend', 'pg_read_all_settings', 'pg_monitor') \
                        OR o.oid = (SELECT relowner FROM pg_class WHERE oid = 'processed_message'::regclass))), \
                r.oid = (SELECT relowner FROM pg_class WHERE oid = 'processed_message'::regclass) \
         FROM pg_roles r WHERE r.rolname = $1",
    )
    .bind(role)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = row else {
        return Ok(Some("it does not exist".into()));
    };
    let flags = [
        (0, "it is a superuser"),
        (1, "it may create roles"),
        (2, "it may create databases"),
        (3, "it may start replication"),
        (4, "it bypasses row-level security"),
        (6, "it is the host's own role"),
        (8, "it owns the host's tables"),
    ];
    for (i, why) in flags {
        if row.try_get::<bool, _>(i)? {
            return Ok(Some(why.into()));
        }
    }
    if !row.try_get::<bool, _>(5)? {
        return Ok(Some("it cannot log in (LOGIN)".into()));
    }
    if let Some(roles) = row.try_get::<Option<String>, _>(7)? {
        return Ok(Some(format!("it is a member of {roles}")));
    }
    for relation in HOST_RELATIONS {
        let kind = if relation.ends_with("_seq") {
            "SELECT, USAGE, UPDATE"
        } else {
            "SELECT, INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER"
        };
        let check = if relation.ends_with("_seq") {
            "SELECT has_sequence_privilege($1, $2::regclass::oid, $3)"
        } else {
            "SELECT has_table_privilege($1, $2::regclass::oid, $3) \
                 OR has_any_column_privilege($1, $2::regclass::oid, 'SELECT, INSERT, UPDATE, REFERENCES')"
        };
        let privileged: bool = sqlx::query_scalar(check)
            .bind(role)
            .bind(relation)
            .bind(kind)
            .fetch_one(&mut *conn)
            .await?;
        if privileged {
            return Ok(Some(format!("it has a privilege on the host's {relation}")));
        }
    }
    let authorize: bool = sqlx::query_scalar(
        "SELECT has_function_privilege($1, 'idemhost_authorize(text)'::regprocedure, 'EXECUTE')",
    )
    .bind(role)
    .fetch_one(&mut *conn)
    .await?;
    if authorize {
        return Ok(Some("it may execute idemhost_authorize".into()));
    }
    Ok(None)
}
