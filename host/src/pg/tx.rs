//! Delivery transactions on connections the claim pipeline keeps between deliveries (see
//! [`Connections`], in `kept`).
//!
//! A [`Tx`] is a transaction on one of them. Dropped before it ended (a delivery cancelled at
//! shutdown), its connection is closed, never reused: PostgreSQL rolls the transaction back.

mod kept;

use kept::GROWN_MESSAGE_BYTES;
pub use kept::{Connections, session_failed};

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Postgres};

/// Whether the last row of a multi-statement reset is a single `true` (the session holds state
/// the reset cannot undo: see [`super::Wall`]).
pub(crate) fn last_flag(rows: &[PgRow]) -> bool {
    rows.last()
        .and_then(|row| sqlx::Row::try_get::<bool, _>(row, 0).ok())
        .unwrap_or(false)
}

/// The transaction's id as text, or NULL while it has none (a claim that inserted nothing):
/// read with the claim, checked again at the commit ([`Tx::claimed_in`]).
pub(crate) const CURRENT_XID: &str = "pg_catalog.pg_current_xact_id_if_assigned()::pg_catalog.text";

/// Why a transaction did not begin (see [`Connections::take`] and `claim::begin_then!`).
pub(crate) enum Begin {
    /// No connection, or the server refused the `BEGIN` (the connection is closed).
    Refused(sqlx::Error),
    /// The transaction's first statement failed; the transaction is still open.
    First(Tx, sqlx::Error),
}

impl From<sqlx::Error> for Begin {
    fn from(e: sqlx::Error) -> Self {
        Begin::Refused(e)
    }
}

impl From<Begin> for sqlx::Error {
    fn from(begin: Begin) -> Self {
        match begin {
            Begin::Refused(e) | Begin::First(_, e) => e,
        }
    }
}

/// Ends a transaction whose `BEGIN` the server refused: about the session, so its connection
/// is closed, not kept.
async fn refused(mut tx: Tx) {
    tx.session_failed = true;
    let _ = tx.rollback().await;
}

/// Whether the last of `flags` (the first column of rows a statement sent ahead returned, as
/// text) is `true`.
pub(crate) fn last_ahead_flag(flags: &[Option<Vec<u8>>]) -> bool {
    matches!(flags.last(), Some(Some(v)) if v.as_slice() == b"t")
}

/// A delivery's COMMIT round trip as the wall sends it (see [`Tx::commit_with`]).
#[derive(Clone, Debug)]
pub(crate) struct CommitSql {
    /// The clearing, the host's settings and `COMMIT`, checking nothing.
    pub(crate) plain: String,
    /// The same with the claim's transaction id checked by the clearing: the text before and
    /// after the id's quoted literal. `None` on a schema migrated before 0012.
    pub(crate) around_claim: Option<(String, String)>,
}

impl CommitSql {
    /// The statement as sent when nothing was claimed.
    pub(crate) fn plain(&self) -> &str {
        &self.plain
    }
}

/// An open transaction. Statements run on it through `&mut *tx` (a [`PgConnection`]).
pub struct Tx {
    /// `None` once the transaction ended.
    conn: Option<PoolConnection<Postgres>>,
    home: Arc<Connections>,
    /// When `home` took the connection from the pool.
    since: Instant,
    /// A statement failed for a reason about the session: closed when the transaction ends.
    session_failed: bool,
    /// A backend message of at least [`GROWN_MESSAGE_BYTES`] came through: the connection's
    /// read buffer grew to its size and stays that size (sqlx's `shrink_buffers` did not free
    /// it, measured), so the connection is closed at the end instead of kept or pooled.
    grown: bool,
    /// How to end the session's backend from outside, once known (see [`Tx::stoppable`]).
    backend: Option<Backend>,
    /// The transaction id the claim ran in (`Some(None)`: none assigned yet), once claimed.
    claimed_in: Option<Option<String>>,
    /// The group's seal, which the commit names (see `Wall::sealed`).
    seal: Option<String>,
}

/// How long a rollback, with the session reset after it, may take before the connection is
/// closed instead and its backend ended: the grace an attempt gets past its deadline. A
/// rollback waits for whatever the connection still has in flight (the rest of a query's rows,
/// a statement running until `statement_timeout`); the delivery does not.
pub(crate) const ROLLBACK_GRACE: Duration = Duration::from_secs(1);

/// A session's backend and a pool of the host's own role, which may end it (the host's role is
/// a member of every plugin role it provisioned).
#[derive(Clone)]
pub(crate) struct Backend {
    pub(crate) host_pool: PgPool,
    pub(crate) pid: i32,
}

impl Backend {
    /// Ends the backend (its transaction rolls back, its locks are released), in the
    /// background: nobody waits for it.
    pub(crate) fn stop(self) {
        tokio::spawn(async move {
            let ended = tokio::time::timeout(
                Duration::from_secs(5),
                sqlx::query_scalar::<_, bool>("SELECT pg_catalog.pg_terminate_backend($1)")
                    .bind(self.pid)
                    .fetch_one(&self.host_pool),
            )
            .await;
            match ended {
                Ok(Ok(true)) => {}
                Ok(Ok(false)) => tracing::debug!(pid = self.pid, "plugin session already gone"),
                Ok(Err(e)) => tracing::warn!(
                    pid = self.pid,
                    error = %super::describe(&e),
                    "failed to stop a plugin session"
                ),
                Err(_) => tracing::warn!(pid = self.pid, "stopping a plugin session timed out"),
            }
        });
    }
}

impl Tx {
    /// Judges the failure of a transaction's first statement, the `BEGIN` sent ahead of it (see
    /// [`Connections::take`]): `None` when the connection was a kept one that turned out broken
    /// (not an error from the server) — it is dropped, and the next one may be tried; a
    /// refused `BEGIN` closes the connection ([`Begin::Refused`]); the first statement's own
    /// failure comes back with its transaction ([`Begin::First`]), for the caller to roll back.
    pub(crate) async fn first_failed(
        mut self,
        error: sqlx::Error,
        from_pool: bool,
    ) -> Option<Begin> {
        match error {
            // The server refused the host's own fixed statements: that is about the server or
            // the session (a standby answers `BEGIN ... READ WRITE` with 0A000, "during
            // recovery"), never about a message. The connection is closed, not kept.
            e @ sqlx::Error::Database(_) if self.ahead_failed() => {
                refused(self).await;
                Some(Begin::Refused(e))
            }
            e @ sqlx::Error::Database(_) => Some(Begin::First(self, e)),
            e => {
                drop(self);
                from_pool.then_some(Begin::Refused(e))
            }
        }
    }

    /// Records a statement's failure: one about the session ([`session_failed`]) closes the
    /// connection when the transaction ends, instead of keeping it.
    pub fn note_failure(&mut self, error: &sqlx::Error) {
        self.session_failed |= session_failed(error);
    }

    /// Records that a row of `bytes` came through (see [`GROWN_MESSAGE_BYTES`]).
    pub(crate) fn note_row_bytes(&mut self, bytes: usize) {
        self.grown |= bytes >= GROWN_MESSAGE_BYTES;
    }

    /// Records the transaction id the claim ran in ([`CURRENT_XID`]): the commit then first
    /// checks that it is still the same transaction. A later claim in the same transaction (a
    /// group's next part) must report the id already known: one that differs means a statement
    /// ended the transaction and began another in between (`ROLLBACK AND CHAIN` with the gate
    /// off: the earlier parts' claims and effects were rolled back), and fails here — keeping
    /// the last id instead let the commit pass with those parts reported applied (review).
    pub(crate) fn claimed_in(&mut self, xid: Option<String>) -> Result<(), sqlx::Error> {
        match (&self.claimed_in, &xid) {
            (Some(Some(known)), seen) if seen.as_deref() != Some(known.as_str()) => {
                self.session_failed = true;
                Err(sqlx::Error::Protocol(format!(
                    "idemhost: the transaction is not the one the delivery claimed in (a \
                     statement ended it): transaction {known}, now {}",
                    seen.as_deref().unwrap_or("none")
                )))
            }
            (Some(Some(_)), _) => Ok(()),
            _ => {
                self.claimed_in = Some(xid);
                Ok(())
            }
        }
    }

    /// Commits with the wall's `commit` statement: `COMMIT`, possibly after the session's
    /// clearing and the settings the commit depends on (see [`super::Wall`]), in one round
    /// trip. After a claim, the round trip first fails (22P02, a message naming the cause)
    /// unless the transaction is still the one the claim ran in: a statement that ended it and
    /// began another (`ROLLBACK AND CHAIN`, possible only with the SQL gate off) would
    /// otherwise have the host commit writes without their claim. The clearing checks that
    /// itself where the schema has its four-argument form (migration 0012); before it, a
    /// statement of its own does, which the server parses and plans every time.
    pub(crate) async fn commit_with(self, commit: &CommitSql) -> Result<(), sqlx::Error> {
        let Some(xid) = &self.claimed_in else {
            return self.end(&commit.plain).await;
        };
        let statement = self.commit_statement(commit, xid.as_deref().unwrap_or(""))?;
        let Some(seal) = &self.seal else {
            return self.end(&statement).await;
        };
        // A group's commit. The seal, named after the clearing (whose `RESET ALL` would undo
        // it), just before the COMMIT; hexadecimal digits of the host's own.
        let statement = match statement.strip_suffix("COMMIT") {
            Some(head) => format!("{head}SET LOCAL idemhost.seal = '{seal}'; COMMIT"),
            None => statement,
        };
        // The group's clearings were statements prepared once per session: a plugin that
        // replaced one with its own (gate off) and deallocated that again before the commit,
        // so that the commit's look for prepared statements found none, left one of them
        // missing. The commit fails unless every one is there as the host prepared it (a
        // plugin cannot prepare a statement the protocol's way).
        let names = self.ahead_names();
        let statement = match statement.strip_prefix("SELECT CASE WHEN ") {
            Some(rest) if !names.is_empty() => {
                let listed: Vec<String> = names.iter().map(|n| format!("'{n}'")).collect();
                format!(
                    "SELECT CASE WHEN (SELECT pg_catalog.count(*) FROM \
                     pg_catalog.pg_prepared_statement() AS p WHERE NOT p.from_sql AND p.name \
                     OPERATOR(pg_catalog.=) ANY (ARRAY[{}]::pg_catalog.text[])) \
                     OPERATOR(pg_catalog.<>) {} OR {rest}",
                    listed.join(", "),
                    names.len()
                )
            }
            _ => statement,
        };
        self.end(&statement).await
    }

    /// Closes the connection when the transaction ends, instead of keeping it: a statement the
    /// host sent ahead failed (see `claim::batch`).
    pub(crate) fn close_at_end(&mut self) {
        self.session_failed = true;
    }

    /// Records the group's seal (see `Wall::sealed`).
    pub(crate) fn sealed(&mut self, seal: String) {
        self.seal = Some(seal);
    }

    /// The commit statement checking that the transaction is still `xid`'s, the claim's.
    fn commit_statement(&self, commit: &CommitSql, xid: &str) -> Result<String, sqlx::Error> {
        // The id is the server's own digits; anything else would be a server bug.
        if !xid.bytes().all(|b| b.is_ascii_digit()) {
            return Err(sqlx::Error::Protocol(format!(
                "unexpected transaction id {xid:?}"
            )));
        }
        let statement = match &commit.around_claim {
            Some((before, after)) => format!("{before}'{xid}'{after}"),
            None => {
                // The failing cast names the cause; `pg_backend_pid()` keeps the planner from
                // evaluating it before the condition.
                format!(
                    "SELECT CASE WHEN COALESCE({CURRENT_XID}, '') OPERATOR(pg_catalog.=) '{xid}' \
                     THEN 0 ELSE ('idemhost: the transaction is not the one the delivery \
                     claimed in (a statement ended it), backend ' OPERATOR(pg_catalog.||) \
                     pg_catalog.pg_backend_pid()::pg_catalog.text)::pg_catalog.int4 END; {}",
                    commit.plain
                )
            }
        };
        Ok(statement)
    }

    /// Commits with `statement` as it is, whatever was claimed: for transactions outside a
    /// delivery.
    #[cfg_attr(not(feature = "test-support"), allow(dead_code))]
    pub async fn commit_plain(self, statement: &str) -> Result<(), sqlx::Error> {
        self.end(statement).await
    }

    /// Rolls back with `statement` (`ROLLBACK`, then possibly a session reset).
    pub async fn rollback_with(self, statement: &str) -> Result<(), sqlx::Error> {
        self.end(statement).await
    }

    /// Rolls the transaction back.
    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        self.end("ROLLBACK").await
    }

    /// Whose backend this is, so that a rollback past its grace can end it.
    pub(crate) fn stoppable(&mut self, backend: Backend) {
        self.backend = Some(backend);
    }

    /// [`Tx::rollback_with`] within [`ROLLBACK_GRACE`]: past it the connection is closed, never
    /// reused, and the backend (if known) ended on the server.
    pub(crate) async fn rollback_within_grace(self, statement: &str) -> Result<(), sqlx::Error> {
        let backend = self.backend.clone();
        match tokio::time::timeout(ROLLBACK_GRACE, self.end(statement)).await {
            Ok(done) => done,
            Err(_) => {
                // The `Tx` was dropped with the timed-out future: its connection is closed.
                if let Some(backend) = backend {
                    backend.stop();
                }
                Err(sqlx::Error::Protocol(format!(
                    "rollback did not finish within {ROLLBACK_GRACE:?}; the session was closed"
                )))
            }
        }
    }

    /// Runs `statement` (COMMIT or ROLLBACK, and what follows it); once it was answered the
    /// connection is kept or given back — unless its last row is a single `true` (the session
    /// reset found state it cannot undo) or a statement failed for a reason about the session:
    /// then it is closed. On an error (or if this future is dropped first) the connection is
    /// closed.
    ///
    /// A COMMIT in a transaction that an error aborted answers `ROLLBACK`, not an error. The
    /// host's commit statement therefore starts with other statements (see [`super::Wall`]),
    /// which an aborted transaction refuses (25P02): such a commit returns `Err`, and the
    /// delivery is not acked.
    async fn end(mut self, statement: &str) -> Result<(), sqlx::Error> {
        // A clearing queued ahead of a statement that never came: the end clears the session
        // itself. What one sent ahead left to read goes too, so that nothing of this
        // transaction is read in the connection's next one.
        self.discard_ahead();
        self.take_ahead_rows();
        self.ahead_failed();
        // A statement sent ahead that returned more than the host's do was replaced by a
        // plugin's (gate off): the session is not reused.
        self.session_failed |= self.ahead_overflowed();
        let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_owned()))
            .fetch_all(&mut *self)
            .await?;
        let discard = last_flag(&rows);
        if let Some(conn) = self.conn.take() {
            if discard || self.session_failed || self.grown {
                tracing::debug!(
                    "session state the reset cannot undo, a failure about the session or a grown buffer; the connection is closed"
                );
                let _ = conn.close().await;
            } else {
                self.home.give_back(conn, self.since);
            }
        }
        Ok(())
    }
}

impl Drop for Tx {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.conn {
            conn.close_on_drop();
        }
    }
}

impl Deref for Tx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match &self.conn {
            Some(conn) => conn,
            // `conn` is taken only by `end`, which consumes the transaction.
            None => unreachable!("transaction used after it ended"),
        }
    }
}

impl DerefMut for Tx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match &mut self.conn {
            Some(conn) => conn,
            None => unreachable!("transaction used after it ended"),
        }
    }
}
