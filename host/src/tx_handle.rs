//! The per-delivery transaction handle a handler runs its SQL through: statements pass the
//! gate, bind, and run on this delivery's connection (logged in as the consumer's role). The
//! first error of any kind — a database error, a refusal, a cap, a refused publish — poisons the
//! handle, so a handler that swallows it cannot get a half-done effect committed. Past the
//! attempt's deadline a statement still running is stopped on the server.

use futures::TryStreamExt;
use sqlx::postgres::PgArguments;
use sqlx::{AssertSqlSafe, PgPool};
use std::sync::Arc;
use tokio::sync::Mutex;
use tokio::time::Instant;

mod trace;

pub use trace::{Published, Statement, StatementResult, Traced};
pub(crate) use trace::{TRACED_ROWS, Trace};

use crate::outbox::{self, Origin};
use crate::outcome::{Failure, FailureKind, Rollback};
use crate::pg::{self, Tx, Wall};
use crate::sql_gate::{self, SqlValue, Values};

/// When the attempt must end, and how to stop a statement still running then: the session's
/// backend, ended from a connection of the host's own role (the transaction rolls back with
/// it, its locks are released).
#[derive(Clone)]
pub(crate) struct Deadline {
    pub(crate) at: Instant,
    pub(crate) host_pool: PgPool,
    pub(crate) backend_pid: i32,
}

struct TxState {
    /// `None` once the delivery took the transaction back (or lost it).
    tx: Option<Tx>,
    poison: Option<Failure>,
    /// Events published through the outbox so far in this call (the next one's `seq`).
    published: u32,
}

/// A handle on the open transaction of one delivery. Cheap to clone; every clone stops working
/// when the claim pipeline takes the transaction back to commit or roll it back.
#[derive(Clone)]
pub struct TxHandle {
    state: Arc<Mutex<TxState>>,
    origin: Arc<Origin>,
    wall: Arc<Wall>,
    deadline: Option<Deadline>,
    /// This consumer's turn at the SQL gate (shared by its deliveries; see [`TxHandle::admitted`]).
    gate_turn: Arc<tokio::sync::Semaphore>,
    /// Where a rehearsal (`idemhost plugin test`) records what the plugin did.
    trace: Option<Arc<Trace>>,
}

/// Error of a handle call. `Refused` and `Database` are data for the handler (and fail the
/// attempt all the same); `Closed` means the handle outlived its delivery (a trap for a plugin).
#[derive(Debug, Clone, thiserror::Error)]
pub enum TxError {
    /// The host refused the statement (the SQL gate, a closed transaction, a limit).
    #[error("{0}")]
    Refused(String),
    /// PostgreSQL returned an error (shown as `SQLSTATE: message`), the attempt's deadline
    /// passed, or an earlier error aborted the transaction.
    #[error("{0}")]
    Database(DbError),
    /// The handle was used after its delivery ended.
    #[error("transaction handle used outside its delivery")]
    Closed,
}

/// A failed database call, as a handler may act on it: the kind, and what PostgreSQL said.
/// Every text is escaped and cut to 1 KiB.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DbError {
    /// What kind of failure it is.
    pub kind: DbErrorKind,
    /// The SQLSTATE, when PostgreSQL answered.
    pub sqlstate: Option<String>,
    /// The server's message (or the host's, without a SQLSTATE).
    pub message: String,
    /// The server's DETAIL.
    pub detail: Option<String>,
    /// The constraint an integrity violation names.
    pub constraint: Option<String>,
}

/// The kinds of [`DbError`], from the SQLSTATE (WIT 0.2.0's `db-error-kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbErrorKind {
    /// 23505.
    UniqueViolation,
    /// 23503.
    ForeignKeyViolation,
    /// 23514.
    CheckViolation,
    /// 23502.
    NotNullViolation,
    /// Another class 23 error.
    IntegrityViolation,
    /// Class 22.
    InvalidValue,
    /// 40001.
    SerializationFailure,
    /// 40P01.
    Deadlock,
    /// 57014, 55P03, or the attempt's deadline.
    Timeout,
    /// 25P02: an earlier error aborted the transaction.
    Aborted,
    /// Anything else.
    Other,
}

impl DbErrorKind {
    /// The kind of a SQLSTATE.
    pub fn of_sqlstate(code: &str) -> Self {
        match code {
            "23505" => DbErrorKind::UniqueViolation,
            "23503" => DbErrorKind::ForeignKeyViolation,
            "23514" => DbErrorKind::CheckViolation,
            "23502" => DbErrorKind::NotNullViolation,
            "40001" => DbErrorKind::SerializationFailure,
            "40P01" => DbErrorKind::Deadlock,
            "57014" | "55P03" => DbErrorKind::Timeout,
            "25P02" => DbErrorKind::Aborted,
            c if c.starts_with("23") => DbErrorKind::IntegrityViolation,
            c if c.starts_with("22") => DbErrorKind::InvalidValue,
            _ => DbErrorKind::Other,
        }
    }
}

impl DbError {
    /// The host's own account of a failure, without a SQLSTATE.
    fn host(kind: DbErrorKind, message: String) -> Self {
        DbError {
            kind,
            sqlstate: None,
            message,
            detail: None,
            constraint: None,
        }
    }

    /// What `error` says, bounded.
    fn of(error: &sqlx::Error) -> Self {
        let sqlx::Error::Database(db) = error else {
            return DbError::host(DbErrorKind::Other, pg::describe(error));
        };
        let code = db.code().map(|c| crate::text::reason(&c));
        let pg = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>();
        DbError {
            kind: DbErrorKind::of_sqlstate(code.as_deref().unwrap_or("")),
            sqlstate: code,
            message: crate::text::reason(db.message()),
            detail: pg.and_then(|e| e.detail()).map(crate::text::reason),
            constraint: db.constraint().map(crate::text::reason),
        }
    }
}

impl std::fmt::Display for DbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.sqlstate {
            Some(code) => write!(f, "{code}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl TxHandle {
    pub(crate) fn new(
        tx: Tx,
        origin: Origin,
        wall: Arc<Wall>,
        deadline: Option<Deadline>,
        gate_turn: Arc<tokio::sync::Semaphore>,
    ) -> Self {
        TxHandle {
            state: Arc::new(Mutex::new(TxState {
                tx: Some(tx),
                poison: None,
                published: 0,
            })),
            origin: Arc::new(origin),
            wall,
            deadline,
            gate_turn,
            trace: None,
        }
    }

    /// Records every statement, publish and log line of this delivery in `trace`.
    pub(crate) fn traced(mut self, trace: Option<Arc<Trace>>) -> Self {
        self.trace = trace;
        self
    }

    /// The trace this delivery records into, if it is a rehearsal.
    pub(crate) fn trace(&self) -> Option<&Arc<Trace>> {
        self.trace.as_ref()
    }

    /// `sql` through the SQL gate and `params` bound: not at all once the attempt failed (its
    /// first error poisoned the handle), and within the attempt's deadline. A consumer's
    /// statements take their turn at the gate one at a time, so a plugin sending distinct
    /// statements endlessly (each parsed) queues only behind itself, not before other
    /// consumers' statements on the gate's shared threads.
    async fn admitted(&self, sql: &str, params: &[SqlValue]) -> Result<PgArguments, TxError> {
        self.state.lock().await.usable()?;
        let judged = async {
            // A verdict the gate already has costs no turn (the common case: a handler's few
            // statement texts); only a parse waits for this consumer's turn.
            if let Some(verdict) = sql_gate::known(sql) {
                return verdict;
            }
            let _turn = self.gate_turn.acquire().await;
            sql_gate::admit(sql).await
        };
        let verdict = match &self.deadline {
            Some(deadline) => tokio::time::timeout_at(deadline.at, judged)
                .await
                .unwrap_or_else(|_| {
                    Err(
                        "the attempt's deadline passed while the statement waited for the SQL \
                         gate"
                            .into(),
                    )
                }),
            None => judged.await,
        };
        let admitted = match verdict.and_then(|a| a.check_parameters(params).map(|()| a)) {
            Ok(admitted) => admitted,
            Err(reason) => return self.refuse(reason).await,
        };
        self.usable(&admitted.relations).await?;
        match sql_gate::bind(params) {
            Ok(args) => Ok(args),
            Err(reason) => self.refuse(reason).await,
        }
    }

    /// Refuses a statement naming a relation the consumer's role has no privilege on, before
    /// the server locks it (see `pg::wall::grants`). Relations without a fresh answer are
    /// looked up in one round trip on the delivery's own session, within the deadline.
    async fn usable(&self, named: &[sql_gate::Relation]) -> Result<(), TxError> {
        use pg::wall::grants;
        if named.is_empty() {
            return Ok(());
        }
        let ask = match self.wall.grants.to_ask(named) {
            Ok(ask) if ask.is_empty() => return Ok(()),
            Ok(ask) => ask,
            Err(unusable) => return self.refuse(grants::refusal(&unusable)).await,
        };
        let schemas: Vec<Option<&str>> = ask.iter().map(|r| r.schema.as_deref()).collect();
        let names: Vec<&str> = ask.iter().map(|r| r.name.as_str()).collect();
        let unusable: Vec<i64> = {
            let mut state = self.state.lock().await;
            self.bounded(&mut state, async |tx: &mut Tx| {
                sqlx::query_scalar(grants::UNUSABLE_SQL)
                    .bind(&schemas)
                    .bind(&names)
                    .fetch_all(&mut **tx)
                    .await
            })
            .await?
        };
        self.wall.grants.learn(&ask, &unusable);
        match unusable
            .first()
            .and_then(|i| ask.get(usize::try_from(*i - 1).ok()?))
        {
            Some(relation) => self.refuse(grants::refusal(relation)).await,
            None => Ok(()),
        }
    }

    /// A refusal: returned to the handler, and the attempt fails.
    async fn refuse<T>(&self, reason: String) -> Result<T, TxError> {
        let mut state = self.state.lock().await;
        state.poison_refused(&reason);
        Err(TxError::Refused(reason))
    }

    /// Runs `work` on the transaction, bounded by the attempt's deadline. Past it the future is
    /// dropped, the connection discarded and its backend ended on the server.
    async fn bounded<T, F>(&self, state: &mut TxState, work: F) -> Result<T, TxError>
    where
        F: AsyncFnOnce(&mut Tx) -> Result<T, sqlx::Error>,
    {
        let tx = state.usable()?;
        let Some(deadline) = &self.deadline else {
            let result = work(tx).await;
            return self.still_open(state, result);
        };
        match tokio::time::timeout_at(deadline.at, work(tx)).await {
            Ok(result) => self.still_open(state, result),
            Err(_) => {
                let reason = "the attempt's deadline passed while the plugin waited on the \
                              database; its session on the server was told to end (a statement the server is still \
                              planning ends when the server next checks)"
                    .to_string();
                if state.poison.is_none() {
                    state.poison = Some(Failure::new(
                        FailureKind::Retryable,
                        Rollback::Database,
                        reason.clone(),
                    ));
                }
                // Dropped mid-statement: the connection is closed, never reused.
                self.abandon(state);
                Err(TxError::Database(DbError::host(
                    DbErrorKind::Timeout,
                    reason,
                )))
            }
        }
    }

    /// Publishes an event through the transactional outbox: a row in this transaction that
    /// the relay sends after the commit (see `outbox`).
    pub async fn publish(
        &self,
        subject: &str,
        headers: &[(String, String)],
        payload: &[u8],
    ) -> Result<(), TxError> {
        let result = self.publish_untraced(subject, headers, payload).await;
        if let Some(trace) = &self.trace {
            // The headers the event would carry on the broker (the host adds its own).
            let sent = outbox::event_headers(&self.origin, subject, headers, payload);
            let sent = sent.as_deref().unwrap_or(headers);
            let refused = result.as_ref().err().map(ToString::to_string);
            trace.published(subject, sent, payload, refused);
        }
        result
    }

    async fn publish_untraced(
        &self,
        subject: &str,
        headers: &[(String, String)],
        payload: &[u8],
    ) -> Result<(), TxError> {
        let headers = match outbox::event_headers(&self.origin, subject, headers, payload) {
            Ok(h) => h,
            Err(reason) => return self.refuse(reason).await,
        };
        let mut state = self.state.lock().await;
        let seq = state.published;
        if seq >= outbox::MAX_EVENTS_PER_DELIVERY {
            let reason = format!(
                "at most {} events may be published per delivery",
                outbox::MAX_EVENTS_PER_DELIVERY
            );
            state.poison_refused(&reason);
            return Err(TxError::Refused(reason));
        }
        let (origin, wall) = (&self.origin, &self.wall);
        self.bounded(&mut state, async |tx: &mut Tx| {
            outbox::insert(tx, wall, origin, seq, subject, &headers, payload).await
        })
        .await?;
        state.published += 1;
        Ok(())
    }

    /// Runs one statement; returns the rows it affected.
    pub async fn execute(&self, sql: &str, params: &[SqlValue]) -> Result<u64, TxError> {
        let Some(trace) = &self.trace else {
            return self.execute_untraced(sql, params).await;
        };
        let started = std::time::Instant::now();
        let result = self.execute_untraced(sql, params).await;
        let traced = match &result {
            Ok(n) => StatementResult::Affected(*n),
            Err(e) => StatementResult::Error(e.to_string()),
        };
        trace.statement(sql, params, traced, started.elapsed());
        result
    }

    async fn execute_untraced(&self, sql: &str, params: &[SqlValue]) -> Result<u64, TxError> {
        let args = self.admitted(sql, params).await?;
        let mut state = self.state.lock().await;
        let done = self
            .bounded(&mut state, async |tx: &mut Tx| {
                sqlx::query_with(AssertSqlSafe(sql.to_owned()), args)
                    .execute(&mut **tx)
                    .await
            })
            .await?;
        // The handler has written in this transaction and not returned yet.
        crate::failpoint::hit("in_handler");
        Ok(done.rows_affected())
    }

    /// Runs one statement; returns its rows (bounded by `sql_gate::MAX_ROWS` rows and
    /// `sql_gate::MAX_RESULT_BYTES` bytes; past either bound the attempt fails).
    pub async fn query(
        &self,
        sql: &str,
        params: &[SqlValue],
    ) -> Result<Vec<Vec<SqlValue>>, TxError> {
        self.query_as(sql, params, Values::Rich).await
    }

    /// [`Self::query`] with the result's columns in the cases `values` allows (a column of
    /// another type fails the attempt, with a hint to cast it).
    pub async fn query_as(
        &self,
        sql: &str,
        params: &[SqlValue],
        values: Values,
    ) -> Result<Vec<Vec<SqlValue>>, TxError> {
        let Some(trace) = &self.trace else {
            return self.query_untraced(sql, params, values).await;
        };
        let started = std::time::Instant::now();
        let result = self.query_untraced(sql, params, values).await;
        let traced = match &result {
            Ok(rows) => StatementResult::Rows {
                rows: rows.iter().take(TRACED_ROWS).cloned().collect(),
                total: rows.len(),
            },
            Err(e) => StatementResult::Error(e.to_string()),
        };
        trace.statement(sql, params, traced, started.elapsed());
        result
    }

    async fn query_untraced(
        &self,
        sql: &str,
        params: &[SqlValue],
        values: Values,
    ) -> Result<Vec<Vec<SqlValue>>, TxError> {
        let args = self.admitted(sql, params).await?;
        let mut state = self.state.lock().await;
        let outcome = self
            .bounded(&mut state, async |tx: &mut Tx| {
                let mut rows = Vec::new();
                let mut budget = sql_gate::ResultBudget::default();
                let mut largest = 0usize;
                let mut stream =
                    sqlx::query_with(AssertSqlSafe(sql.to_owned()), args).fetch(&mut **tx);
                while let Some(row) = stream.try_next().await? {
                    if rows.len() == sql_gate::MAX_ROWS {
                        return Ok(Err(format!(
                            "query returned more than {} rows",
                            sql_gate::MAX_ROWS
                        )));
                    }
                    match sql_gate::row_values(&row, values, &mut budget) {
                        Ok((values, bytes)) => {
                            largest = largest.max(bytes);
                            rows.push(values);
                        }
                        Err(refusal) => return Ok(Err(refusal)),
                    }
                }
                drop(stream);
                tx.note_row_bytes(largest);
                Ok(Ok(rows))
            })
            .await?;
        outcome.map_err(|reason| {
            state.poison_refused(&reason);
            // Refused at a row: the rest of the result is still coming, and a rollback on this
            // connection would first wait for all of it (for as long as `statement_timeout`
            // lets the query run). The connection is closed instead, and its backend ended.
            self.abandon(&mut state);
            TxError::Refused(reason)
        })
    }

    /// Gives up the connection of a statement the handle stopped reading: closed, never
    /// reused, and its backend ended on the server.
    fn abandon(&self, state: &mut TxState) {
        drop(state.tx.take());
        if let Some(deadline) = &self.deadline {
            stop_backend(deadline.clone());
        }
    }

    /// `result` of a statement, unless the statement ended the delivery's transaction (only the
    /// host commits or rolls back; the gate refuses transaction control, so only with the gate
    /// off): then the attempt fails and the connection is closed at once, before a later
    /// statement could run — and commit — in a transaction of its own, without the claim. The
    /// server's ReadyForQuery tells the transaction status after every statement.
    fn still_open<T>(
        &self,
        state: &mut TxState,
        result: Result<T, sqlx::Error>,
    ) -> Result<T, TxError> {
        if state.tx.as_ref().is_some_and(|tx| tx.transaction_idle()) {
            let reason = "a statement ended the delivery's transaction (only the host commits or \
                          rolls back); the session was closed";
            state.poison_refused(reason);
            self.abandon(state);
            return Err(TxError::Refused(reason.into()));
        }
        result.map_err(|e| state.poison_with(&e))
    }

    /// Takes the transaction back for commit or rollback, with the first error a handler saw.
    pub(crate) async fn take(&self) -> (Option<Tx>, Option<Failure>) {
        let mut state = self.state.lock().await;
        (state.tx.take(), state.poison.take())
    }
}

impl TxState {
    fn usable(&mut self) -> Result<&mut Tx, TxError> {
        if let Some(p) = &self.poison {
            return Err(TxError::Database(DbError::host(
                DbErrorKind::Aborted,
                format!(
                    "transaction is aborted by an earlier error ({}); the host will roll it back",
                    p.reason
                ),
            )));
        }
        self.tx.as_mut().ok_or(TxError::Closed)
    }

    fn poison_with(&mut self, error: &sqlx::Error) -> TxError {
        let db = DbError::of(error);
        let reason = db.to_string();
        if self.poison.is_none() {
            self.poison = Some(pg::failure(reason.clone(), error));
        }
        TxError::Database(db)
    }

    /// A refusal fails the attempt as retryable: a fixed plugin (a hot swap) may cure it.
    fn poison_refused(&mut self, reason: &str) {
        if self.poison.is_none() {
            self.poison = Some(Failure::new(
                FailureKind::Retryable,
                Rollback::Database,
                format!(
                    "the host refused a plugin request: {}",
                    crate::text::reason(reason)
                ),
            ));
        }
    }
}

/// Ends the backend of a plugin's session whose statement outlived the attempt's deadline or
/// was abandoned, from the host's own pool. In the background: the delivery does not wait.
fn stop_backend(deadline: Deadline) {
    pg::Backend {
        host_pool: deadline.host_pool,
        pid: deadline.backend_pid,
    }
    .stop();
}
