//! PostgreSQL plumbing shared by every delivery: the pool, the host's migrations, URL redaction
//! and the one place where a database error is classified (retry the transaction, retry later,
//! or give up on the message).

use std::str::FromStr;

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use tracing::debug;

use crate::config::PostgresConfig;
pub(crate) use crate::config::postgres_url::{redact_url, redact_urls};
use crate::outcome::{Failure, FailureKind, Rollback};

pub(crate) mod failover;
mod tx;
pub mod wall;
pub use failover::Failover;
#[cfg(feature = "test-support")]
pub use tx::session_failed;
pub(crate) use tx::{Backend, Begin, CURRENT_XID, CommitSql, last_ahead_flag, last_flag};
pub use tx::{Connections, Tx};
pub use wall::Wall;

/// The failure of a statement that failed with `error`, logged as `reason`: its kind from the
/// SQLSTATE ([`classify`]), the SQLSTATE kept, and what the pipeline decides by.
pub(crate) fn failure(reason: String, error: &sqlx::Error) -> Failure {
    let kind = classify(error);
    Failure {
        kind,
        cause: if kind == FailureKind::RetryTransaction {
            Rollback::Conflict
        } else {
            Rollback::Database
        },
        reason,
        sqlstate: match error {
            sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
            _ => None,
        },
        lock_wait: lock_not_available(error),
        past_limits: past_server_limits(error),
        unavailable: server_unavailable(error),
    }
}

/// Classifies a database error by SQLSTATE. Integrity (class 23), data (class 22) and
/// program-limit (class 54: a value, array or statement past what the server allows) errors
/// are terminal; 40001 and 40P01 retry the transaction; everything else — including syntax and
/// undefined-object errors, which a plugin or migration fix cures — is retryable, so messages
/// wait for the fix rather than going to the dead-letter subject at once.
pub(crate) fn classify(error: &sqlx::Error) -> FailureKind {
    match error {
        sqlx::Error::Database(db) => classify_sqlstate(db.code().as_deref().unwrap_or("")),
        _ => FailureKind::Retryable,
    }
}

/// Classifies a SQLSTATE code (see [`classify`]).
pub(crate) fn classify_sqlstate(code: &str) -> FailureKind {
    match code {
        "40001" | "40P01" => FailureKind::RetryTransaction,
        c if c.starts_with("23") || c.starts_with("22") || c.starts_with("54") => {
            FailureKind::Terminal
        }
        _ => FailureKind::Retryable,
    }
}

/// Whether `error` is past one of the server's own limits on what a statement may build
/// (class 54, `program_limit_exceeded`: a text or array past 1 GB, a statement too complex).
/// The same statement over the same data fails the same way every time, after the server
/// spent what it took to get there (a `string_agg` past 1 GB: 683 MiB in one server process
/// first), so no answer of the handler makes the delivery run again.
pub(crate) fn past_server_limits(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().is_some_and(|c| c.starts_with("54")))
}

/// Whether `error` says the server is away or no longer takes writes, rather than anything
/// about the statement: the connection failed or was cut (class 08, I/O, TLS, the pool closed or
/// out of time), the server is shutting down or starting (57P01–57P03), or it is read-only
/// (25006: a standby, or a primary demoted by a failover). Such an attempt may wait for the
/// server and run again without counting (see `Claimer::wait_for_database`); whether the server
/// was really away is what that wait checks first.
pub(crate) fn server_unavailable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("08") || matches!(&*c, "57P01" | "57P02" | "57P03" | "25006")
        }),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}

/// Whether `error` is `lock_not_available` (55P03): a lock wait outlasted `lock_timeout`, or a
/// `NOWAIT` found the lock taken. A group-commit transaction waits on locks only that long (see
/// [`Wall::begin_group_sql`]); past it the group is sent back one delivery at a time.
pub(crate) fn lock_not_available(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

/// Renders a database error for logs and plugins: `SQLSTATE: message` for server errors. The
/// message quotes whatever a plugin's statement made the server quote (a 20 MB value in an
/// `invalid input syntax` error): it is escaped and cut to 1 KiB (`text::MAX_REASON_BYTES`).
pub fn describe(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => format!("{code}: {}", crate::text::reason(db.message())),
            None => crate::text::reason(db.message()),
        },
        other => crate::text::reason(&other.to_string()),
    }
}

/// Options for connecting: the URL, an optional schema put first on the search path, and the
/// session's `application_name`.
pub fn connect_options(
    url: &str,
    schema: Option<&str>,
    application_name: &str,
) -> Result<PgConnectOptions, sqlx::Error> {
    let mut options = PgConnectOptions::from_str(url)?.application_name(application_name);
    if let Some(schema) = schema {
        options = options.options([("search_path", schema)]);
    }
    Ok(options)
}

/// The settings a connection is given at login (its startup packet's `options`), by name.
pub(crate) type LoginSettings = Vec<(&'static str, String)>;

/// Refuses a connection on which a setting of `login` is not the value given at its login
/// (`pg_settings`: `source` is `client` and `reset_val` that value): a connection pooler in
/// front of PostgreSQL that drops startup parameters (PgBouncer's `ignore_startup_parameters =
/// options`) would leave the host's sessions on the wrong `search_path` — its tables, its
/// migrations — and the plugin role's without their `statement_timeout` and
/// `synchronous_commit`; one that handed out a server connection opened with another client's
/// options would carry that client's. One query per new connection.
pub async fn check_login_settings(
    conn: &mut sqlx::PgConnection,
    login: &[(&'static str, String)],
) -> Result<(), sqlx::Error> {
    if login.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = login.iter().map(|(n, _)| *n).collect();
    let found: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT name, source, reset_val FROM pg_catalog.pg_settings WHERE name = ANY($1)",
    )
    .bind(&names)
    .fetch_all(conn)
    .await?;
    let lost: Vec<&str> = login
        .iter()
        .filter(|(name, value)| {
            !found
                .iter()
                .any(|(n, source, v)| n == name && source == "client" && v == value)
        })
        .map(|(name, _)| *name)
        .collect();
    if lost.is_empty() {
        return Ok(());
    }
    Err(sqlx::Error::Configuration(
        format!(
            "the server did not apply the settings the host gives at login ({}): a connection \
             pooler in front of PostgreSQL that drops startup parameters (PgBouncer's \
             ignore_startup_parameters = options)? Connect the host to PostgreSQL directly \
             (docs/scaling.md, Poolers)",
            lost.join(", ")
        )
        .into(),
    ))
}

/// The settings a connection to `schema` (when set) is given at login: its `search_path`.
pub(crate) fn schema_login(schema: Option<&str>) -> LoginSettings {
    schema
        .map(|s| ("search_path", s.to_string()))
        .into_iter()
        .collect()
}

/// Opens the pool and checks one connection, so an unreachable server is reported at start-up
/// with its (redacted) URL rather than at the first message. Of several servers, the first that
/// offers the session `target_session_attrs` asks for (`failover`).
pub async fn connect(
    config: &PostgresConfig,
    max_connections: u32,
) -> Result<PgPool, crate::Error> {
    Ok(connect_following(config, max_connections).await?.0)
}

/// [`connect`], and the [`Failover`] that keeps the pool (and the pools it is given to follow)
/// on the server `postgres.url` asks for.
pub(crate) async fn connect_following(
    config: &PostgresConfig,
    max_connections: u32,
) -> anyhow::Result<(PgPool, std::sync::Arc<Failover>)> {
    let failover = Failover::find(config).await?;
    let shown = redact_url(failover.current_url());
    let login = schema_login(config.schema.as_deref());
    let pool = failover
        .pool_options(&login)
        .max_connections(max_connections)
        .acquire_timeout(config.acquire_timeout.0)
        .connect_with(failover.options())
        .await;
    let pool = match pool {
        Ok(pool) => pool,
        Err(e) => {
            let why = connect_failure(&e, &failover.options(), &login).await;
            let why =
                why.reword(|why| format!("failed to connect to PostgreSQL at {shown}: {why}"));
            return Err(why.into());
        }
    };
    failover.follow(&pool);
    Ok((pool, failover))
}

/// Why connecting with `options` failed, as an operator can act on it. A pool reports only that
/// it timed out (it retried until `acquire_timeout`): one more direct attempt names the cause
/// (refused, unreachable, rejected, the settings given at `login` not applied). A server's error
/// is shown with its SQLSTATE and without the line of the server's source it came from; the
/// common ones say what to check.
pub(crate) async fn connect_failure(
    error: &sqlx::Error,
    options: &PgConnectOptions,
    login: &[(&'static str, String)],
) -> crate::error::Cause {
    use sqlx::ConnectOptions as _;
    let attempt;
    let error = match error {
        sqlx::Error::PoolTimedOut => {
            let direct = async {
                let mut conn = options.connect().await?;
                let checked = check_login_settings(&mut conn, login).await;
                let _ = sqlx::Connection::close(conn).await;
                checked
            };
            attempt = tokio::time::timeout(std::time::Duration::from_secs(5), direct).await;
            match &attempt {
                Ok(Err(cause)) => cause,
                Ok(Ok(_)) | Err(_) => {
                    let text = format!(
                        "{error} (no connection within postgres.acquire_timeout; the server answers \
                         now: it may be starting, or at max_connections)"
                    );
                    return crate::error::Cause::database(error, text);
                }
            }
        }
        other => other,
    };
    let hint = match error {
        sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
            " (nothing listens there: is PostgreSQL running, on that host and port?)"
        }
        sqlx::Error::Io(_) => " (check the host and port in postgres.url, and the network)",
        sqlx::Error::Tls(_) => " (TLS: see sslmode in postgres.url)",
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some("28000") => {
                " (the user in postgres.url is not allowed in: a role that does not exist, or no pg_hba.conf entry for it)"
            }
            Some("28P01") => " (wrong password for the user in postgres.url)",
            Some("3D000") => " (create the database, or fix its name in postgres.url)",
            Some("53300") => " (the server is at max_connections)",
            Some("57P03") => " (the server is starting up or shutting down; try again)",
            Some("08P01") if db.message().contains("startup parameter") => {
                " (a connection pooler in front of PostgreSQL? The host needs its own sessions, \
                 with the settings it gives at login: connect it directly, docs/scaling.md, Poolers)"
            }
            _ => "",
        },
        _ => "",
    };
    crate::error::Cause::database(error, format!("{}{hint}", describe(error)))
}

/// The host's own migrations (`migrations/`), embedded in the binary. Without sqlx's lock: that
/// is an advisory lock under a key derived from the database's name, which any session — a
/// plugin's included — can take and hold for as long as its transaction lasts, stalling every
/// host's start-up on that database. [`migrate`] locks the migrations table instead.
pub(crate) static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    locking: false,
    ..sqlx::migrate!("../migrations")
};

/// Applies the host's migrations (idempotent), creating the configured schema first when it
/// does not exist yet. Concurrent hosts serialize on a lock on the migrations table
/// (`_sqlx_migrations`, one per schema), which no plugin role may touch (see
/// `crate::sql_gate::HOST_RELATIONS`); `SHARE UPDATE EXCLUSIVE` conflicts with itself and not
/// with the rows the migrator writes there from its own connection.
pub async fn migrate(pool: &PgPool, schema: Option<&str>) -> Result<(), crate::Error> {
    Ok(migrate_releasing(pool, schema).await?)
}

/// [`migrate`], in the crate's own error handling.
async fn migrate_releasing(pool: &PgPool, schema: Option<&str>) -> anyhow::Result<()> {
    let mut lock = migrate_holding(pool, schema).await?;
    sqlx::query("COMMIT")
        .execute(&mut lock)
        .await
        .map_err(|e| anyhow::anyhow!("failed to release the migrations lock: {}", describe(&e)))?;
    let _ = sqlx::Connection::close(lock).await;
    Ok(())
}

/// [`migrate`], returning the connection whose open transaction still holds the migrations
/// lock: every other host's start (and every other `plugin test`) waits until it ends. What
/// the caller does in that transaction commits with it (or, closed, rolls back).
pub(crate) async fn migrate_holding(
    pool: &PgPool,
    schema: Option<&str>,
) -> anyhow::Result<sqlx::PgConnection> {
    let missing = match schema {
        // A host that owns its schema need not be allowed to create schemas.
        Some(schema) => !sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)",
        )
        .bind(schema)
        .fetch_one(pool)
        .await
        .map_err(|e| {
            let text = format!("failed to look for schema {schema}: {}", describe(&e));
            crate::error::Cause::database(&e, text)
        })?,
        None => false,
    };
    if let Some(schema) = schema.filter(|_| missing) {
        // The name is validated as a plain identifier by the config; quoting keeps it exact.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA IF NOT EXISTS \"{schema}\""
        )))
        .execute(pool)
        .await
        .map_err(|e| {
            let text = format!("failed to create schema {schema}: {}", describe(&e));
            crate::error::Cause::database(&e, text)
        })?;
    }
    let mut attempt = 1;
    let lock = loop {
        match lock_migrations(pool).await {
            Ok(lock) => break lock,
            // Two hosts creating the migrations table at once: one of them loses the race on
            // the catalog; the table exists when it tries again.
            Err(e) if attempt < 3 => {
                debug!(error = %e, "migrations table not ready; trying again");
                attempt += 1;
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => {
                return Err(anyhow::anyhow!(
                    "failed to lock the migrations table: {}",
                    describe(&e)
                ));
            }
        }
    };
    MIGRATOR
        .run(pool)
        .await
        .map_err(|e| anyhow::anyhow!("failed to apply idemhost migrations: {e}"))?;
    Ok(lock)
}

/// The schema the host's objects are in: `configured` (`postgres.schema`), else the session's
/// current one (`public` when its search path names none that exists).
pub(crate) async fn schema_name(pool: &PgPool, configured: Option<&str>) -> anyhow::Result<String> {
    Ok(match configured {
        Some(schema) => schema.to_string(),
        None => sqlx::query_scalar::<_, Option<String>>("SELECT current_schema()::text")
            .fetch_one(pool)
            .await?
            .unwrap_or_else(|| "public".into()),
    })
}

/// For `--no-migrate`: refuses a schema that lacks one of this binary's migrations (it would
/// fail later, on a function or a column that is not there) and names what to run.
pub(crate) async fn check_migrated(pool: &PgPool) -> anyhow::Result<()> {
    let applied: Vec<i64> = match sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT version FROM {} WHERE success",
        wall::quote_ident(&MIGRATOR.table_name)
    )))
    .fetch_all(pool)
    .await
    {
        Ok(applied) => applied,
        // Never migrated: no migrations table in the schema.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => Vec::new(),
        Err(e) => anyhow::bail!("failed to read the applied migrations: {}", describe(&e)),
    };
    let missing: Vec<String> = MIGRATOR
        .iter()
        .filter(|m| !applied.contains(&m.version))
        .map(|m| format!("{:04} {}", m.version, m.description))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "the schema lacks {} of this host's migrations ({}); with --no-migrate the host does not \
         apply them: run `idemhost migrate --config …` first (docs/upgrading.md)",
        missing.len(),
        missing.join(", ")
    )
}

/// Creates the migrations table if missing and takes the host's migration lock on it, in a
/// transaction on a connection of its own — not one of the pool's, which may hold a single
/// connection the migrator needs (`idemhost migrate`). The lock is held until that transaction
/// is committed; dropped, the connection closes and the server rolls it back.
async fn lock_migrations(pool: &PgPool) -> Result<sqlx::PgConnection, sqlx::Error> {
    use sqlx::Connection as _;
    use sqlx::migrate::Migrate as _;
    let mut conn = sqlx::PgConnection::connect_with(&pool.connect_options()).await?;
    conn.ensure_migrations_table(&MIGRATOR.table_name)
        .await
        .map_err(|e| match e {
            sqlx::migrate::MigrateError::Execute(e) => e,
            other => sqlx::Error::Protocol(other.to_string()),
        })?;
    sqlx::query("BEGIN").execute(&mut conn).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "LOCK TABLE {} IN SHARE UPDATE EXCLUSIVE MODE",
        wall::quote_ident(&MIGRATOR.table_name)
    )))
    .execute(&mut conn)
    .await?;
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_classified() {
        assert_eq!(classify_sqlstate("40001"), FailureKind::RetryTransaction);
        assert_eq!(classify_sqlstate("40P01"), FailureKind::RetryTransaction);
        assert_eq!(classify_sqlstate("23505"), FailureKind::Terminal);
        assert_eq!(classify_sqlstate("23514"), FailureKind::Terminal);
        assert_eq!(classify_sqlstate("22012"), FailureKind::Terminal);
        assert_eq!(classify_sqlstate("54000"), FailureKind::Terminal);
        assert_eq!(classify_sqlstate("54001"), FailureKind::Terminal);
        assert_eq!(classify_sqlstate("53200"), FailureKind::Retryable);
        assert_eq!(classify_sqlstate("57014"), FailureKind::Retryable);
        assert_eq!(classify_sqlstate("08006"), FailureKind::Retryable);
        assert_eq!(classify_sqlstate("42P01"), FailureKind::Retryable);
    }

    /// A closed port: the pool's timeout alone said nothing of why; the failure names the
    /// refusal and what to check.
    #[tokio::test]
    async fn a_refused_connection_is_named_not_a_pool_timeout() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let options =
            connect_options(&format!("postgres://x@127.0.0.1:{port}/x"), None, "t").unwrap();
        let why = connect_failure(&sqlx::Error::PoolTimedOut, &options, &[])
            .await
            .to_string();
        assert!(
            why.contains("refused") && why.contains("is PostgreSQL running"),
            "{why}"
        );
    }
}
