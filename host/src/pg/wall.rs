//! The database side of the plugin wall: plugins' SQL runs on connections that *log in* as
//! their consumer's role, so no statement or function can make it act as the host (a role
//! switch that SQL could undo is not a wall). This module provisions and checks those roles,
//! opens their pools, and holds the host key and the names of the `SECURITY DEFINER` functions
//! (migration 0006) through which the host writes markers, plugin versions and outbox rows in
//! a delivery's transaction.

use std::str::FromStr;

use sqlx::postgres::PgConnectOptions;
use sqlx::{PgPool, Row};

use crate::config::{ConsumerConfig, PostgresConfig, is_plain_identifier};

/// The host key (never shown to a plugin: sent only as a bound parameter) and the qualified
/// names of the host's functions, read once from the host's own connection.
#[derive(Clone)]
pub struct Wall {
    pub(crate) key: String,
    pub(crate) claim_sql: String,
    pub(crate) claim_all_sql: String,
    /// The group's claim also writes a seal (migration 0014): a random value bound with the
    /// claim, which only the host's commit names (`SET LOCAL idemhost.seal`); a deferred
    /// trigger fails any other commit of the transaction — one a plugin's own `COMMIT` made
    /// (gate off) before the later deliveries of its group ran, which committed their claims
    /// without their effects.
    pub(crate) sealed: bool,
    pub(crate) outbox_sql: String,
    /// Sent as every COMMIT: the session cleared, the durability the operator configured
    /// re-asserted after the plugin ran (whatever it set in the transaction), COMMIT.
    pub(crate) commit_sql: super::CommitSql,
    /// Opens a delivery's transaction (see [`Wall::load`]).
    pub(crate) begin_sql: String,
    /// Opens a group-commit transaction: [`Wall::begin_sql`] and the group's `lock_timeout`.
    pub(crate) begin_group_sql: String,
    /// [`Wall::begin_sql`] as its statements, to send ahead of a claim (see
    /// `Connections::begin_then`).
    pub(crate) begin_statements: Vec<String>,
    /// [`Wall::begin_group_sql`] as its statements.
    pub(crate) begin_group_statements: Vec<String>,
    /// Run in a group between one delivery's handler and the next one's (see
    /// [`Wall::between_sql`]).
    pub(crate) between_sql: String,
    /// Sent in a group ahead of the next delivery's first statement (see
    /// [`Wall::between_statements`]).
    pub(crate) between_statements: Vec<String>,
    /// Ends a group's transaction: as [`Wall::commit_sql`], and the commit fails instead when a
    /// plugin left SQL-level prepared statements in the session (see
    /// [`Wall::between_statements`]).
    pub(crate) group_commit_sql: super::CommitSql,
    /// Rolls a delivery back and resets the session.
    pub(crate) rollback_sql: String,
    /// What the consumer's role may use of the relations its plugin named.
    pub(crate) grants: std::sync::Arc<grants::RelationGrants>,
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

    /// What a group sends between one delivery's handler and the next one's, ahead of the next
    /// one's first statement, in its round trip (each prepared once per session, so the server
    /// neither parses nor plans them again): settings back to their defaults, temporary objects
    /// dropped, cursors closed, LISTEN undone, session advisory locks released, the group's
    /// settings again (`set_config(..., true)`, as `SET LOCAL`); its row says whether the
    /// transaction was made read-only. It does not look
    /// for SQL-level prepared statements a plugin left (listing them made the server copy every
    /// statement the session keeps, each time: most of what the clearing cost): the group's
    /// commit does ([`Wall::group_commit_sql`]), and fails when there are any, so the group runs
    /// again one delivery per transaction. A plugin that prepared its own statement under the
    /// name of one of these (with the gate off) so that the next delivery skipped the clearing
    /// therefore gets nothing committed from that run.
    pub fn between_statements(&self) -> &[String] {
        &self.between_statements
    }

    /// Ends a delivery's transaction: the session cleared, the host's durability set again,
    /// `COMMIT` (see [`SESSION_CLEAR`]).
    pub fn commit_sql(&self) -> &str {
        self.commit_sql.plain()
    }
}

/// What the host clears of a plugin's session as each delivery ends, so nothing a plugin left
/// in it outlives its delivery: settings (`pg_settings`, `set_config(..., false)`), temporary
/// tables and functions, held cursors, LISTEN. Sent in the delivery's own round trip — before
/// its COMMIT, inside the transaction (where they take effect with the commit: a LISTEN of the
/// transaction is cancelled by the UNLISTEN after it), or after its ROLLBACK (which would undo
/// them). Session advisory locks are released in the statement after these, which says whether
/// SQL-level prepared statements are left ([`PREPARED_LEFT`]): then the connection is closed,
/// not kept (`DEALLOCATE ALL` would also drop the client's own). `role` and
/// `session_authorization` are not settings a plugin can move: its connection logs in as its
/// own role, a member of none.
///
/// It is one call of the host's `idemhost_session_clear` (migration 0010), whose statements keep
/// their plans in the session; on a schema migrated before it, these statements, which the
/// server parses and plans for every delivery. What each form costs the server was measured
/// (`scripts/bench-wall.sh`): the call least, and before the COMMIT less than after it, where
/// it ran in a transaction of its own.
const SESSION_CLEAR: &str = "RESET ALL; DISCARD TEMP; CLOSE ALL; UNLISTEN *";

/// Whether SQL-level prepared statements are left in the session: from the function behind the
/// `pg_prepared_statements` view (planning the view's expansion for every delivery cost the
/// server more than the check itself).
const PREPARED_LEFT: &str =
    "EXISTS (SELECT 1 FROM pg_catalog.pg_prepared_statement() AS p WHERE p.from_sql)";

/// `begin`, then `SET LOCAL name = 'value'` for each setting (values already escaped): the
/// statements that open a delivery's transaction.
fn begin_statements(begin: &str, settings: &[(&str, String)]) -> Vec<String> {
    std::iter::once(begin.to_string())
        .chain(
            settings
                .iter()
                .map(|(name, value)| format!("SET LOCAL {name} = '{value}'")),
        )
        .collect()
}

/// Which form of the clearing the schema has (see [`clear_sql`]).
#[derive(Clone, Copy, PartialEq)]
enum ClearForm {
    /// No `idemhost_session_clear` (a schema migrated before 0010): statements.
    Statements,
    /// `idemhost_session_clear(text[], text[], boolean)` (0010).
    Function,
    /// `idemhost_session_clear(text[], text[], boolean, text)` (0012): it also checks the
    /// claim's transaction id it is given.
    Checking,
}

/// The session's clearing ([`SESSION_CLEAR`]) followed by `settings` set for the rest of the
/// transaction: one call of `schema.idemhost_session_clear` when the schema has it, else the
/// statements. Its row is true when prepared statements are left or, with `read_only`, the
/// transaction was made read-only. With `claimed_in` (the checking form only), the call's last
/// argument is that SQL literal.
fn clear_sql(
    schema: &str,
    form: ClearForm,
    settings: &[(&str, String)],
    read_only: bool,
    claimed_in: Option<&str>,
) -> String {
    if form != ClearForm::Statements {
        // Every argument typed, so that no other overload could ever be a candidate for the call.
        let array = |values: Vec<String>| {
            if values.is_empty() {
                "NULL::pg_catalog.text[]".to_string()
            } else {
                format!("ARRAY[{}]::pg_catalog.text[]", values.join(", "))
            }
        };
        let names = array(settings.iter().map(|(n, _)| format!("'{n}'")).collect());
        let values = array(settings.iter().map(|(_, v)| format!("'{v}'")).collect());
        let check = match (form, claimed_in) {
            (ClearForm::Checking, Some(literal)) => format!(", {literal}::pg_catalog.text"),
            (ClearForm::Checking, None) => ", NULL::pg_catalog.text".to_string(),
            _ => String::new(),
        };
        return format!(
            "SELECT {schema}.idemhost_session_clear({names}, {values}, {read_only}{check})"
        );
    }
    let set: Vec<String> = std::iter::once("pg_catalog.pg_advisory_unlock_all()".into())
        .chain(
            settings
                .iter()
                .map(|(name, value)| format!("pg_catalog.set_config('{name}', '{value}', true)")),
        )
        .collect();
    let read_only = if read_only {
        " OR pg_catalog.current_setting('transaction_read_only')::bool"
    } else {
        ""
    };
    format!(
        "{SESSION_CLEAR}; SELECT {PREPARED_LEFT}{read_only} FROM (SELECT {}) AS host",
        set.join(", ")
    )
}

/// How long a plugin role's session may sit idle inside a transaction before the server ends it
/// (`idle_in_transaction_session_timeout`, given at login): past the handler's whole deadline
/// and a margin, which a live host never is — between two statements of a delivery's
/// transaction it runs one handler at most. A host that stalls there (SIGSTOP, a frozen VM)
/// would otherwise keep its claim's row lock, and with it the message, from the replica the
/// broker gives it to next, for as long as the stall lasts.
pub(crate) fn idle_in_transaction_timeout(
    handler_timeout: std::time::Duration,
) -> std::time::Duration {
    handler_timeout + std::time::Duration::from_secs(5)
}

/// The settings a delivery's statements and its COMMIT run with: the server's
/// `synchronous_commit` (as the host read it) and the consumer's `statement_timeout` in
/// milliseconds. Either set in each transaction (`SET LOCAL`, then again after the clearing),
/// or carried by the consumer's connections from their login ([`role_pool`]'s `login`), where
/// a plugin cannot move them for later deliveries: a value given at login outranks the role's
/// and the database's (`ALTER ROLE ... SET`), and `RESET ALL` returns to it.
pub(crate) fn login_settings(
    synchronous_commit: &str,
    statement_timeout: std::time::Duration,
) -> Vec<(&'static str, String)> {
    vec![
        ("synchronous_commit", synchronous_commit.to_string()),
        (
            "statement_timeout",
            statement_timeout.as_millis().max(1).to_string(),
        ),
    ]
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
    /// session is cleared as the delivery ends ([`SESSION_CLEAR`]).
    #[cfg_attr(not(feature = "test-support"), allow(dead_code))]
    pub async fn load(
        pool: &PgPool,
        isolation: crate::config::Isolation,
        statement_timeout: std::time::Duration,
        group_lock_timeout: Option<std::time::Duration>,
    ) -> Result<Wall, sqlx::Error> {
        Self::load_for(
            pool,
            isolation,
            statement_timeout,
            group_lock_timeout,
            false,
        )
        .await
    }

    /// [`Wall::load`] for connections that log in with the host's `synchronous_commit` and
    /// `statement_timeout` when `at_login` (see [`login_settings`]): a delivery's transaction
    /// then sets neither, and its clearing sets nothing after `RESET ALL`, which returns every
    /// setting to its value at login. The two `SET LOCAL`s sent ahead of the claim cost the
    /// server ~20 µs per transaction (pgbench, pipelined as the host sends them), and in
    /// `idemhost bench` the server's CPU per delivery went from 524 to 467 µs without them and
    /// the `set_config` after the clearing (docs/benchmark.md).
    pub(crate) async fn load_for(
        pool: &PgPool,
        isolation: crate::config::Isolation,
        statement_timeout: std::time::Duration,
        group_lock_timeout: Option<std::time::Duration>,
        at_login: bool,
    ) -> Result<Wall, sqlx::Error> {
        let row = sqlx::query(
            "SELECT current_schema()::text, k.key, current_setting('synchronous_commit'), \
             pg_catalog.to_regprocedure(pg_catalog.format( \
                 '%I.idemhost_session_clear(text[], text[], boolean)', current_schema())) \
                 IS NOT NULL, \
             pg_catalog.to_regprocedure(pg_catalog.format( \
                 '%I.idemhost_session_clear(text[], text[], boolean, text)', current_schema())) \
                 IS NOT NULL, \
             pg_catalog.to_regprocedure(pg_catalog.format( \
                 '%I.idemhost_claim_all(text, text, text[], text, text)', current_schema())) \
                 IS NOT NULL \
             FROM idemhost_key k",
        )
        .fetch_one(pool)
        .await?;
        let schema: String = row.try_get(0)?;
        let key: String = row.try_get(1)?;
        let synchronous_commit: String = row.try_get(2)?;
        // A schema migrated before 0010 (a host started with `--no-migrate` on it) has no
        // `idemhost_session_clear`: the same clearing is then sent as statements. Before 0012
        // it does not check the claim's transaction: a statement of its own does.
        let form = match (row.try_get::<bool, _>(3)?, row.try_get::<bool, _>(4)?) {
            (_, true) => ClearForm::Checking,
            (true, false) => ClearForm::Function,
            (false, false) => ClearForm::Statements,
        };
        // A group's claim with its seal (migration 0014; see `Wall::sealed`).
        let sealed: bool = row.try_get(5)?;
        let s = quote_ident(&schema);
        // The host's settings of a delivery's transaction, as (name, value); a group's adds its
        // lock timeout. `synchronous_commit` is one of a fixed set of words; quoted all the same.
        let durability = ("synchronous_commit", synchronous_commit.replace('\'', "''"));
        let clear = |settings: &[(&str, String)], read_only: bool| {
            clear_sql(&s, form, settings, read_only, None)
        };
        // The clearing, then the durability the operator configured (`set_config(..., true)` is
        // `SET LOCAL`; `RESET ALL` undid the one of the BEGIN), then COMMIT. Where the
        // connection logged in with it, `RESET ALL` itself returns to it. An aborted
        // transaction refuses the first statement (25P02), so such a commit fails instead of
        // answering ROLLBACK.
        let durable: &[(&str, String)] = if at_login {
            &[]
        } else {
            std::slice::from_ref(&durability)
        };
        // The claim's id goes where this marker is (the host's own text: never in a setting).
        const CLAIM: &str = "\u{0}claim\u{0}";
        let commit_sql = super::CommitSql {
            plain: format!("{}; COMMIT", clear(durable, false)),
            // (Were the marker missing, the commit would check with a statement instead.)
            around_claim: (form == ClearForm::Checking)
                .then(|| {
                    format!(
                        "{}; COMMIT",
                        clear_sql(&s, form, durable, false, Some(CLAIM))
                    )
                })
                .and_then(|checked| {
                    let (before, after) = checked.split_once(CLAIM)?;
                    Some((before.to_string(), after.to_string()))
                }),
        };
        let rollback_sql = format!("ROLLBACK; {}", clear(&[], false));
        let mut locals: Vec<(&str, String)> = if at_login {
            Vec::new()
        } else {
            login_settings(&synchronous_commit, statement_timeout)
                .into_iter()
                .map(|(name, value)| (name, value.replace('\'', "''")))
                .collect()
        };
        let begin = format!("BEGIN ISOLATION LEVEL {} READ WRITE", isolation.sql());
        let opening = begin_statements(&begin, &locals);
        if let Some(t) = group_lock_timeout {
            locals.push(("lock_timeout", t.as_millis().max(1).to_string()));
        }
        let group_opening = begin_statements(&begin, &locals);
        // Inside the transaction: `RESET ALL` and the settings after it are the transaction's
        // until it ends (a LISTEN, effective only at COMMIT, is undone by the clearing before
        // it). The row says whether prepared statements are left or the transaction was made
        // read-only.
        let between_sql = clear(&locals, true);
        // The clearing as statements sent ahead (see `Wall::between_statements`). On a schema
        // without the clearing function the commit cannot check for prepared statements, so
        // the statements do.
        let prepared_left = if form == ClearForm::Statements {
            format!(" OR {PREPARED_LEFT}")
        } else {
            String::new()
        };
        let set: String = locals
            .iter()
            .map(|(name, value)| format!(", pg_catalog.set_config('{name}', '{value}', true)"))
            .collect();
        let between_statements: Vec<String> = SESSION_CLEAR
            .split("; ")
            .map(str::to_string)
            .chain(std::iter::once(format!(
                "SELECT pg_catalog.current_setting('transaction_read_only')::pg_catalog.bool\
                 {prepared_left}, pg_catalog.pg_advisory_unlock_all(){set}"
            )))
            .collect();
        // A group's commit fails (22P02, naming the cause) when the clearing finds SQL-level
        // prepared statements in the session: `SELECT CASE WHEN <clearing> THEN <error> END;
        // COMMIT` (`pg_backend_pid()` keeps the planner from folding the failing cast before the
        // condition).
        let group_commit_sql = if form == ClearForm::Statements {
            commit_sql.clone()
        } else {
            let open = |sql: &str| sql.replacen("SELECT ", "SELECT CASE WHEN ", 1);
            let close = |sql: &str| {
                sql.replacen(
                    "; COMMIT",
                    " THEN ('idemhost: a plugin left prepared statements in the session; the \
                     group runs again one delivery per transaction, backend ' \
                     OPERATOR(pg_catalog.||) pg_catalog.pg_backend_pid()::pg_catalog.text)\
                     ::pg_catalog.int4 END; COMMIT",
                    1,
                )
            };
            super::CommitSql {
                plain: close(&open(&commit_sql.plain)),
                around_claim: commit_sql
                    .around_claim
                    .as_ref()
                    .map(|(before, after)| (open(before), close(after))),
            }
        };
        Ok(Wall {
            key,
            claim_sql: format!(
                "SELECT {s}.idemhost_claim($1, $2, $3, $4), pg_catalog.pg_backend_pid(), {}",
                super::CURRENT_XID
            ),
            claim_all_sql: if sealed {
                format!("SELECT {s}.idemhost_claim_all($1, $2, $3, $4, $5)")
            } else {
                format!("SELECT {s}.idemhost_claim_all($1, $2, $3, $4)")
            },
            sealed,
            outbox_sql: format!("SELECT {s}.idemhost_outbox_insert($1, $2, $3, $4, $5, $6, $7)"),
            commit_sql,
            begin_sql: opening.join("; "),
            begin_group_sql: group_opening.join("; "),
            begin_statements: opening,
            begin_group_statements: group_opening,
            between_sql,
            between_statements,
            group_commit_sql,
            rollback_sql,
            grants: Default::default(),
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
    // sqlx logs a statement that ran past a second at WARN, and every statement at DEBUG, with
    // its text, under its own target and outside the delivery's span: a plugin's SQL (its text
    // chosen by the plugin, and made slow at will) would reach the host's log unattributed and
    // unbounded. What a plugin's statements do is the host's to log, in its own lines.
    use sqlx::ConnectOptions as _;
    options = options
        .log_statements(log::LevelFilter::Off)
        .log_slow_statements(log::LevelFilter::Off, std::time::Duration::ZERO);
    // A row, an error or a notice longer than a whole result may be is refused from its
    // header, before it is buffered: the host never allocates a value a plugin made the server
    // build (one row holds up to 1 GB), and the connection is closed.
    Ok(options.max_message_size(PLUGIN_MESSAGE_BYTES))
}

/// A pool of connections logged in as `role`, checked by one connection; it follows `failover`.
/// Its connections log in with the settings of `login` (see [`login_settings`]).
pub async fn role_pool(
    postgres: &PostgresConfig,
    failover: &std::sync::Arc<super::Failover>,
    role: &str,
    password: Option<&str>,
    max_connections: u32,
    login: &[(&'static str, String)],
) -> anyhow::Result<PgPool> {
    let options = role_connect_options(postgres, failover, role, password)?
        .options(login.iter().map(|(n, v)| (*n, v.as_str())));
    let mut checked = login.to_vec();
    checked.extend(super::schema_login(postgres.schema.as_deref()));
    let pool = failover
        .pool_options(&checked)
        .max_connections(max_connections.max(1))
        .acquire_timeout(postgres.acquire_timeout.0)
        .connect_with(options.clone())
        .await;
    let pool = match pool {
        Ok(pool) => pool,
        Err(e) => {
            let why = super::connect_failure(&e, &options, &checked).await;
            return Err(why
                .reword(|why| {
                    format!(
                        "failed to connect to PostgreSQL as the plugin role {role}: {why} (the \
                         role needs LOGIN and an entry in pg_hba.conf; set consumer.role_password \
                         if the server asks for one)"
                    )
                })
                .into());
        }
    };
    failover.follow(&pool);
    Ok(pool)
}

pub(crate) mod grants;
mod provision;

pub(crate) use provision::missing_tables;
pub use provision::provision;
#[cfg_attr(not(feature = "test-support"), allow(unused_imports))]
pub use provision::provision_role;
