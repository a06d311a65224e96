//! The per-delivery transaction handle a handler runs its SQL through: statements pass the
//! gate, bind, and run on this delivery's connection; the first database error poisons the
//! handle so a handler that swallows it cannot get its aborted transaction committed.

use std::sync::Arc;

use futures::TryStreamExt;
use sqlx::AssertSqlSafe;
use tokio::sync::Mutex;

use crate::outbox::{self, Origin};
use crate::pg::{self, FailureKind, Tx};
use crate::sql_gate::{self, SqlValue};

/// A database error seen by a handler, kept so the claim pipeline can classify the attempt.
#[derive(Debug, Clone)]
pub struct Poison {
    pub kind: FailureKind,
    pub reason: String,
}

struct TxState {
    /// `None` once the delivery took the transaction back (or lost it).
    tx: Option<Tx>,
    poison: Option<Poison>,
    /// Events published through the outbox so far in this call (the next one's `seq`).
    published: u32,
}

/// A handle on the open transaction of one delivery. Cheap to clone; every clone stops working
/// when the claim pipeline takes the transaction back to commit or roll it back.
#[derive(Clone)]
pub struct TxHandle {
    state: Arc<Mutex<TxState>>,
    origin: Arc<Origin>,
}

/// Error of a handle call. `Refused` and `Database` are data for the handler; `Closed` means the
/// handle outlived its delivery (a trap for a plugin).
#[derive(Debug, Clone, thiserror::Error)]
pub enum TxError {
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Database(String),
    #[error("transaction handle used outside its delivery")]
    Closed,
}

impl TxHandle {
    pub(crate) fn new(tx: Tx, origin: Origin) -> Self {
        TxHandle {
            state: Arc::new(Mutex::new(TxState {
                tx: Some(tx),
                poison: None,
                published: 0,
            })),
            origin: Arc::new(origin),
        }
    }

    /// Publishes an event through the transactional outbox: a row in this transaction that
    /// the relay sends after the commit (see [`outbox`]).
    pub async fn publish(
        &self,
        subject: &str,
        headers: &[(String, String)],
        payload: &[u8],
    ) -> Result<(), TxError> {
        let headers = outbox::event_headers(&self.origin, subject, headers, payload)
            .map_err(TxError::Refused)?;
        let mut state = self.state.lock().await;
        let seq = state.published;
        if seq >= outbox::MAX_EVENTS_PER_DELIVERY {
            return Err(TxError::Refused(format!(
                "at most {} events may be published per delivery",
                outbox::MAX_EVENTS_PER_DELIVERY
            )));
        }
        let conn = state.usable()?;
        let result = outbox::insert(conn, &self.origin, seq, subject, &headers, payload).await;
        match result {
            Ok(()) => {
                state.published += 1;
                Ok(())
            }
            Err(e) => Err(state.poison_with(&e)),
        }
    }

    /// Runs one statement; returns the rows it affected.
    pub async fn execute(&self, sql: &str, params: &[SqlValue]) -> Result<u64, TxError> {
        sql_gate::check(sql).map_err(TxError::Refused)?;
        let args = sql_gate::bind(params).map_err(TxError::Refused)?;
        let mut state = self.state.lock().await;
        let conn = state.usable()?;
        let result = sqlx::query_with(AssertSqlSafe(sql.to_owned()), args)
            .execute(&mut **conn)
            .await;
        match result {
            Ok(done) => {
                // The handler has written in this transaction and not returned yet.
                crate::failpoint::hit("in_handler");
                Ok(done.rows_affected())
            }
            Err(e) => Err(state.poison_with(&e)),
        }
    }

    /// Runs one statement; returns its rows (bounded by [`sql_gate::MAX_ROWS`] rows and
    /// [`sql_gate::MAX_RESULT_BYTES`] bytes).
    pub async fn query(
        &self,
        sql: &str,
        params: &[SqlValue],
    ) -> Result<Vec<Vec<SqlValue>>, TxError> {
        sql_gate::check(sql).map_err(TxError::Refused)?;
        let args = sql_gate::bind(params).map_err(TxError::Refused)?;
        let mut state = self.state.lock().await;
        let conn = state.usable()?;
        let mut rows = Vec::new();
        let mut total = 0usize;
        let outcome: Result<Option<String>, sqlx::Error> = async {
            let mut stream =
                sqlx::query_with(AssertSqlSafe(sql.to_owned()), args).fetch(&mut **conn);
            while let Some(row) = stream.try_next().await? {
                if rows.len() == sql_gate::MAX_ROWS {
                    return Ok(Some(format!(
                        "query returned more than {} rows",
                        sql_gate::MAX_ROWS
                    )));
                }
                match sql_gate::row_values(&row) {
                    Ok((values, bytes)) => {
                        total += bytes;
                        if total > sql_gate::MAX_RESULT_BYTES {
                            return Ok(Some(format!(
                                "query result exceeds {} bytes",
                                sql_gate::MAX_RESULT_BYTES
                            )));
                        }
                        rows.push(values);
                    }
                    Err(refusal) => return Ok(Some(refusal)),
                }
            }
            Ok(None)
        }
        .await;
        match outcome {
            Ok(None) => Ok(rows),
            Ok(Some(refusal)) => Err(TxError::Refused(refusal)),
            Err(e) => Err(state.poison_with(&e)),
        }
    }

    /// Takes the transaction back for commit or rollback, with the first error a handler saw.
    pub(crate) async fn take(&self) -> (Option<Tx>, Option<Poison>) {
        let mut state = self.state.lock().await;
        (state.tx.take(), state.poison.take())
    }
}

impl TxState {
    fn usable(&mut self) -> Result<&mut Tx, TxError> {
        if let Some(p) = &self.poison {
            return Err(TxError::Database(format!(
                "transaction is aborted by an earlier error ({}); the host will roll it back",
                p.reason
            )));
        }
        self.tx.as_mut().ok_or(TxError::Closed)
    }

    fn poison_with(&mut self, error: &sqlx::Error) -> TxError {
        let reason = pg::describe(error);
        if self.poison.is_none() {
            self.poison = Some(Poison {
                kind: pg::classify(error),
                reason: reason.clone(),
            });
        }
        TxError::Database(reason)
    }
}
