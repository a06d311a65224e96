//! Provisioning a plugin's role: created when missing, granted the host's functions, the
//! schema, its tables and their own sequences, bounded by per-role settings, and proved unable
//! to reach past its grants.

use sqlx::{PgPool, Row};

use super::quote_ident;
use crate::config::ConsumerConfig;
use crate::pg::describe;
use crate::sql_gate::HOST_RELATIONS;

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
const ROLE_SETTINGS: &[(&str, &str)] = &[
    ("temp_file_limit", "1GB"),
    ("work_mem", "4MB"),
    ("log_min_messages", "fatal"),
    // JIT compilation checks no cancellation: a plan a short statement multiplied compiled
    // for 22 s past a 3 s deadline, holding its transaction.
    ("jit", "off"),
];

/// Sets the plugin's role's bounds (`ALTER ROLE … SET`; new sessions take them, the session
/// reset after each delivery restores them, and no statement a plugin may send changes them).
/// One the host's role may not set is a warning naming the statement to run: a host that is
/// not a superuser may not set `temp_file_limit` or `log_min_messages` on another role.
async fn bound_role(
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
    missing_tables(&mut tx, consumer_name, &schema, tables).await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)")
            .bind(role)
            .fetch_one(&mut *tx)
            .await?;
    let mut functions = format!(
        "{s}.idemhost_claim(text, text, text, text), {s}.idemhost_claim_all(text, text, text[], text), \
         {s}.idemhost_outbox_insert(text, text, text, integer, text, jsonb, bytea), \
         {s}.idemhost_session_clear(text[], text[], boolean)"
    );
    // Functions of later migrations, where the schema has them (a host run with `--no-migrate`
    // on an older schema uses the older forms): the clearing that checks the claim (0012), the
    // group's claim with its seal (0014).
    for later in [
        format!("{s}.idemhost_session_clear(text[], text[], boolean, text)"),
        format!("{s}.idemhost_claim_all(text, text, text[], text, text)"),
    ] {
        let there: bool = sqlx::query_scalar("SELECT to_regprocedure($1) IS NOT NULL")
            .bind(&later)
            .fetch_one(&mut *tx)
            .await?;
        if there {
            functions.push_str(", ");
            functions.push_str(&later);
        }
    }
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
        // One a later migration than the schema's makes is not there yet.
        let there: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(format!("{s}.{relation}"))
            .fetch_one(&mut *tx)
            .await?;
        if there {
            grants.push(format!("REVOKE ALL ON {kind} {s}.{relation} FROM {r}"));
        }
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

/// Refuses a `tables` entry that is not there: the configuration's mistake, not the role's,
/// said as such before anything is created or granted (it was reported as a role that is not
/// ready, with the whole script to create one). Reads only.
pub(crate) async fn missing_tables(
    conn: &mut sqlx::PgConnection,
    consumer_name: &str,
    schema: &str,
    tables: &[String],
) -> anyhow::Result<()> {
    let named: Vec<String> = tables
        .iter()
        .filter(|t| *t != "*")
        .map(|t| qualified(schema, t))
        .collect();
    let absent: Vec<String> = sqlx::query_scalar(
        "SELECT x FROM unnest($1::text[]) x WHERE pg_catalog.to_regclass(x) IS NULL",
    )
    .bind(&named)
    .fetch_all(conn)
    .await?;
    if absent.is_empty() {
        return Ok(());
    }
    let one = absent.len() == 1;
    anyhow::bail!(
        "consumer {consumer_name}: `tables` names {} that do{} not exist: {}. Create {} first \
         (your own migration, applied before the host starts) or correct `tables`",
        if one { "a table" } else { "tables" },
        if one { "es" } else { "" },
        absent.join(", "),
        if one { "it" } else { "them" },
    )
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
            "SELECT COALESCE(has_sequence_privilege($1, to_regclass($2)::oid, $3), false)"
        } else {
            // A relation of a later migration than the schema's is not there (NULL: false).
            "SELECT COALESCE(has_table_privilege($1, to_regclass($2)::oid, $3) \
                 OR has_any_column_privilege($1, to_regclass($2)::oid, 'SELECT, INSERT, UPDATE, REFERENCES'), false)"
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
    // A function it created in the host's schema could be a candidate where the host calls its
    // own there (an overload, one with a defaulted argument more): run as whoever calls it, or
    // make every call ambiguous (review: a database upgraded from PostgreSQL 14 or older keeps
    // CREATE on `public` for PUBLIC).
    let (schema, create, public): (String, bool, bool) = sqlx::query_as(
        "SELECT current_schema()::text, has_schema_privilege($1, current_schema(), 'CREATE'), \
                (SELECT COALESCE(bool_or(a.grantee = 0), false) FROM pg_namespace n, aclexplode(n.nspacl) a \
                 WHERE n.nspname = current_schema() AND a.privilege_type = 'CREATE')",
    )
    .bind(role)
    .fetch_one(&mut *conn)
    .await?;
    if create {
        let who = if public { "PUBLIC" } else { role };
        return Ok(Some(format!(
            "it may create objects in the host's schema {schema} (run: REVOKE CREATE ON SCHEMA {} FROM {who})",
            quote_ident(&schema)
        )));
    }
    Ok(None)
}
