//! One delivery's transaction: `BEGIN` at the consumer's isolation, the claim statement, the
//! handler, `COMMIT` — and the decision of what the attempt was (`Outcome`), including the
//! bounded whole-transaction retry on serialization failure and deadlock.

mod batch;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use sqlx::PgPool;
use tracing::{Instrument, debug, info_span};

use crate::config::{ConsumerConfig, Isolation};
use crate::failpoint;
use crate::handler::{Handler, HandlerError, Message};
use crate::outbox::Origin;
use crate::pg::{self, Connections, FailureKind, Tx};
use crate::txn::TxHandle;

/// The seed's claim for one id: `$1` the consumer, `$2` the id.
macro_rules! claim_one {
    () => {
        "INSERT INTO processed_message (consumer_name, message_id) \
         VALUES ($1, $2) \
         ON CONFLICT DO NOTHING \
         RETURNING message_id"
    };
}

/// The claim for a batch: `$2` the ids, inserted in sorted order.
macro_rules! claim_all {
    () => {
        "INSERT INTO processed_message (consumer_name, message_id) \
         SELECT $1, id FROM unnest($2::text[]) AS id ORDER BY id \
         ON CONFLICT DO NOTHING \
         RETURNING message_id"
    };
}

/// `claim` that also records, beside each marker it inserted, plugin version `$3`.
macro_rules! recording {
    ($claim:expr) => {
        concat!(
            "WITH claimed AS (",
            $claim,
            "), recorded AS (\
             INSERT INTO processed_message_handler (consumer_name, message_id, plugin_digest) \
             SELECT $1, message_id, $3 FROM claimed) \
             SELECT message_id FROM claimed"
        )
    };
}

/// The claim statement of the pattern, verbatim: one row back means this transaction owns the
/// message, none means a committed duplicate.
pub const CLAIM_SQL: &str = claim_one!();
/// [`CLAIM_SQL`] that also records which plugin version applies the message, beside the
/// marker and in the same round trip: the record exists exactly when the claim inserted a row.
pub const CLAIM_RECORDING_SQL: &str = recording!(claim_one!());
/// The claim of a whole group-commit batch in one statement: the rows back are the ids this
/// transaction now owns. Ids are inserted in sorted order, so two batches claiming common ids
/// take their locks in the same order; an id twice in the batch is claimed once.
pub const CLAIM_ALL_SQL: &str = claim_all!();
/// [`CLAIM_ALL_SQL`] recording the plugin version, as [`CLAIM_RECORDING_SQL`] does.
pub const CLAIM_ALL_RECORDING_SQL: &str = recording!(claim_all!());

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Marker and effect committed together.
    Applied,
    /// The marker was already committed: the empty transaction committed, nothing ran.
    Duplicate,
    /// Rolled back; redeliver later.
    RetryableFailure(String),
    /// Rolled back; dead-letter.
    TerminalFailure(String),
}

impl Outcome {
    /// The label used in logs and metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Applied => "applied",
            Outcome::Duplicate => "duplicate",
            Outcome::RetryableFailure(_) => "retryable_failure",
            Outcome::TerminalFailure(_) => "terminal_failure",
        }
    }

    /// Whether the transaction committed (and the broker may be acked).
    pub fn committed(&self) -> bool {
        matches!(self, Outcome::Applied | Outcome::Duplicate)
    }

    pub fn reason(&self) -> Option<&str> {
        match self {
            Outcome::RetryableFailure(r) | Outcome::TerminalFailure(r) => Some(r),
            _ => None,
        }
    }
}

/// Why a transaction attempt rolled back (`idemhost_rollbacks_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rollback {
    /// Serialization failure (40001) or deadlock (40P01): the whole transaction is retried.
    Conflict,
    /// The handler returned a retryable error, trapped, ran out of time or memory.
    HandlerRetryable,
    /// The handler returned a terminal error.
    HandlerTerminal,
    /// A statement (the claim, the handler's SQL, the commit) failed in PostgreSQL.
    Database,
    /// No transaction could be started (pool timeout, connection lost).
    Connection,
}

impl Rollback {
    pub fn label(self) -> &'static str {
        match self {
            Rollback::Conflict => "serialization_conflict",
            Rollback::HandlerRetryable => "handler_retryable",
            Rollback::HandlerTerminal => "handler_terminal",
            Rollback::Database => "database_error",
            Rollback::Connection => "connection",
        }
    }
}

/// The outcome plus what it took.
#[derive(Debug, Clone)]
pub struct Processed {
    pub outcome: Outcome,
    /// Transactions run (more than 1 after serialization failures or deadlocks).
    pub tx_attempts: u32,
    /// Time the claim statement took in the last attempt (waits on a competing claim show here).
    pub claim_time: Duration,
    /// BEGIN to COMMIT/ROLLBACK of the last attempt.
    pub tx_time: Duration,
    /// The handler call of the last attempt (none for a duplicate or a failed claim).
    pub handler_time: Option<Duration>,
    /// Why the last attempt rolled back (none when it committed). The attempts before it all
    /// rolled back on a conflict (`tx_attempts - 1` of them).
    pub rollback: Option<Rollback>,
}

/// Where an attempt's time went.
#[derive(Default)]
struct Timing {
    claim: Duration,
    handler: Option<Duration>,
}

/// Per-consumer settings of the transaction.
#[derive(Debug, Clone)]
pub struct ClaimSettings {
    pub consumer_name: String,
    pub isolation: Isolation,
    pub statement_timeout: Duration,
    pub tx_max_attempts: u32,
    /// Role the handler's statements run as (validated as a plain identifier).
    pub role: Option<String>,
    /// First retry delay ceiling; doubles each retry up to `retry_cap` (full jitter).
    pub retry_base: Duration,
    pub retry_cap: Duration,
    /// Connections kept between deliveries rather than given back to the pool (see
    /// [`Connections`]). The host gives each consumer its `max_in_flight`, or its share of the
    /// pool when the consumers' sum does not fit; [`ClaimSettings::new`] keeps none. Kept
    /// connections count against the pool's `max_connections` while idle.
    pub keep_connections: usize,
}

impl ClaimSettings {
    pub fn for_consumer(c: &ConsumerConfig) -> Self {
        ClaimSettings {
            consumer_name: c.name.clone(),
            isolation: c.isolation,
            statement_timeout: c.statement_timeout(),
            tx_max_attempts: c.tx_max_attempts,
            role: c.role.clone(),
            retry_base: Duration::from_millis(10),
            retry_cap: Duration::from_secs(1),
            keep_connections: c.max_in_flight as usize,
        }
    }

    /// Settings with the defaults of a config file entry, for embedding and tests.
    pub fn new(consumer_name: impl Into<String>, isolation: Isolation) -> Self {
        ClaimSettings {
            consumer_name: consumer_name.into(),
            isolation,
            statement_timeout: Duration::from_secs(5),
            tx_max_attempts: 5,
            role: None,
            retry_base: Duration::from_millis(10),
            retry_cap: Duration::from_secs(1),
            keep_connections: 0,
        }
    }
}

/// Runs deliveries of one consumer through claim, handler and commit.
pub struct Claimer {
    connections: Arc<Connections>,
    settings: ClaimSettings,
    /// `BEGIN ...; SET LOCAL statement_timeout = ...` in one round trip.
    begin_sql: String,
}

/// Why an attempt did not commit.
struct AttemptFailure {
    kind: FailureKind,
    cause: Rollback,
    reason: String,
}

impl AttemptFailure {
    fn db(context: &str, e: &sqlx::Error) -> Self {
        let kind = pg::classify(e);
        AttemptFailure {
            kind,
            cause: Self::cause_of(kind),
            reason: format!("{context}: {}", pg::describe(e)),
        }
    }

    /// The cause of a failed statement of the given kind.
    fn cause_of(kind: FailureKind) -> Rollback {
        match kind {
            FailureKind::RetryTransaction => Rollback::Conflict,
            _ => Rollback::Database,
        }
    }
}

/// Whether a handler's attempt must roll back, from its answer and the first database error
/// it saw.
fn judge(
    result: Result<(), HandlerError>,
    poison: Option<crate::txn::Poison>,
) -> Option<AttemptFailure> {
    // A serialization failure inside the handler retries the whole transaction whatever
    // the handler answered; otherwise the handler's own error wins; an `Ok` after a
    // database error is never committed (the transaction is aborted in PostgreSQL).
    match (result, poison) {
        (_, Some(p)) if p.kind == FailureKind::RetryTransaction => Some(AttemptFailure {
            kind: p.kind,
            cause: Rollback::Conflict,
            reason: p.reason,
        }),
        (Err(e), poison) => {
            let (kind, cause, reason) = match e {
                HandlerError::Retryable(r) => {
                    (FailureKind::Retryable, Rollback::HandlerRetryable, r)
                }
                HandlerError::Terminal(r) => (FailureKind::Terminal, Rollback::HandlerTerminal, r),
            };
            // A handler passing on a failed statement's error: the database is the cause.
            let cause = if poison.is_some() {
                Rollback::Database
            } else {
                cause
            };
            Some(AttemptFailure {
                kind,
                cause,
                reason,
            })
        }
        (Ok(()), Some(p)) => Some(AttemptFailure {
            kind: p.kind,
            cause: AttemptFailure::cause_of(p.kind),
            reason: format!("handler returned ok after a database error: {}", p.reason),
        }),
        (Ok(()), None) => None,
    }
}

impl Claimer {
    pub fn new(pool: PgPool, settings: ClaimSettings) -> Self {
        let begin_sql = format!(
            "BEGIN ISOLATION LEVEL {}; SET LOCAL statement_timeout = {}",
            settings.isolation.sql(),
            settings.statement_timeout.as_millis().max(1)
        );
        Claimer {
            connections: Connections::new(pool, settings.keep_connections),
            settings,
            begin_sql,
        }
    }

    pub fn settings(&self) -> &ClaimSettings {
        &self.settings
    }

    /// Whether a delivery of message `id` committed for this consumer (its marker exists).
    pub async fn marker_exists(&self, id: &str) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM processed_message WHERE consumer_name = $1 AND message_id = $2)",
        )
        .bind(&self.settings.consumer_name)
        .bind(id)
        .fetch_one(self.connections.pool())
        .await
    }

    /// Processes one delivery: claims its marker and runs `handler` in one transaction,
    /// retrying the whole transaction on 40001/40P01 up to `tx_max_attempts`.
    pub async fn process(&self, handler: &dyn Handler, msg: &Message) -> Processed {
        self.process_from(handler, msg, 1).await
    }

    /// [`Self::process`], counting transaction attempts from `attempt` (a group-commit batch
    /// abandoned on a conflict was the first).
    async fn process_from(
        &self,
        handler: &dyn Handler,
        msg: &Message,
        mut attempt: u32,
    ) -> Processed {
        loop {
            let started = Instant::now();
            let span = info_span!("idemhost.claim", tx_attempt = attempt);
            let mut timing = Timing::default();
            let result = self
                .attempt(handler, msg, &mut timing)
                .instrument(span)
                .await;
            let done = |outcome, rollback| Processed {
                outcome,
                tx_attempts: attempt,
                claim_time: timing.claim,
                tx_time: started.elapsed(),
                handler_time: timing.handler,
                rollback,
            };
            match result {
                Ok(outcome) => return done(outcome, None),
                Err(f) => match f.kind {
                    FailureKind::RetryTransaction if attempt < self.settings.tx_max_attempts => {
                        let delay = self.retry_delay(attempt);
                        debug!(reason = %f.reason, attempt, ?delay, "transaction retry");
                        tokio::time::sleep(delay).await;
                        attempt += 1;
                    }
                    FailureKind::RetryTransaction => {
                        let reason = format!(
                            "{} (gave up after {attempt} transaction attempts)",
                            f.reason
                        );
                        return done(Outcome::RetryableFailure(reason), Some(f.cause));
                    }
                    FailureKind::Retryable => {
                        return done(Outcome::RetryableFailure(f.reason), Some(f.cause));
                    }
                    FailureKind::Terminal => {
                        return done(Outcome::TerminalFailure(f.reason), Some(f.cause));
                    }
                },
            }
        }
    }

    /// Full jitter: uniform in `[0, min(cap, base * 2^(attempt-1))]`.
    fn retry_delay(&self, attempt: u32) -> Duration {
        let ceiling = self
            .settings
            .retry_base
            .saturating_mul(1u32 << (attempt - 1).min(16))
            .min(self.settings.retry_cap);
        let micros = rand::rng().random_range(0..=ceiling.as_micros() as u64);
        Duration::from_micros(micros)
    }

    async fn attempt(
        &self,
        handler: &dyn Handler,
        msg: &Message,
        timing: &mut Timing,
    ) -> Result<Outcome, AttemptFailure> {
        let (tx, claimed) = match self.begin_claimed(handler, msg, timing).await {
            Some(begun) => begun?,
            None => {
                let mut tx = self.begin().await?;
                let claimed = self.claim(&mut tx, handler, msg, timing).await;
                (
                    tx,
                    claimed.map_err(|e| AttemptFailure::db("failed to claim marker", &e))?,
                )
            }
        };
        match claimed {
            false => tx
                .commit()
                .await
                .map(|()| Outcome::Duplicate)
                .map_err(|e| AttemptFailure::db("failed to commit duplicate", &e)),
            true => {
                let (mut tx, failure) = self.lend(tx, handler, msg, timing).await?;
                if let Some(failure) = failure {
                    rollback(tx).await;
                    return Err(failure);
                }
                self.reset_role(&mut tx).await?;
                failpoint::hit("before_commit");
                tx.commit()
                    .await
                    .map(|()| Outcome::Applied)
                    .map_err(|e| AttemptFailure::db("failed to commit", &e))
            }
        }
    }

    /// Opens a transaction at the consumer's isolation, with its statement timeout.
    async fn begin(&self) -> Result<Tx, AttemptFailure> {
        self.connections
            .begin(&self.begin_sql)
            .await
            .map(|(tx, _)| tx)
            .map_err(|e| AttemptFailure {
                cause: Rollback::Connection,
                ..AttemptFailure::db("failed to begin transaction", &e)
            })
    }

    /// Opens the transaction and claims `msg` in the same round trip: `BEGIN`, `SET LOCAL` and
    /// the claim statement sent as one simple query, the values written as escaped literals.
    /// `None` when `msg`'s id cannot be written so (see [`pg::literal`]).
    async fn begin_claimed(
        &self,
        handler: &dyn Handler,
        msg: &Message,
        timing: &mut Timing,
    ) -> Option<Result<(Tx, bool), AttemptFailure>> {
        let digest = handler.digest();
        let mut values = vec![
            pg::literal(&self.settings.consumer_name)?,
            pg::literal(&msg.id)?,
        ];
        if let Some(digest) = digest {
            values.push(pg::literal(digest)?);
        }
        let claim = if digest.is_some() {
            CLAIM_RECORDING_SQL
        } else {
            CLAIM_SQL
        };
        let sql = format!("{}; {}", self.begin_sql, pg::with_values(claim, &values));
        let started = Instant::now();
        let begun = self.connections.begin(&sql).await;
        timing.claim = started.elapsed();
        Some(match begun {
            Ok((tx, rows)) => Ok((tx, !rows.is_empty())),
            Err(e @ sqlx::Error::Database(_)) => {
                Err(AttemptFailure::db("failed to claim marker", &e))
            }
            Err(e) => Err(AttemptFailure {
                cause: Rollback::Connection,
                ..AttemptFailure::db("failed to begin transaction", &e)
            }),
        })
    }

    /// Runs the claim statement (recording the plugin version of `handler`, if it has one);
    /// whether this transaction now owns the marker.
    async fn claim(
        &self,
        tx: &mut Tx,
        handler: &dyn Handler,
        msg: &Message,
        timing: &mut Timing,
    ) -> Result<bool, sqlx::Error> {
        let started = Instant::now();
        let digest = handler.digest();
        let sql = if digest.is_some() {
            CLAIM_RECORDING_SQL
        } else {
            CLAIM_SQL
        };
        let mut query = sqlx::query(sql)
            .bind(&self.settings.consumer_name)
            .bind(&msg.id);
        if let Some(digest) = digest {
            query = query.bind(digest);
        }
        let claimed = query.fetch_optional(&mut **tx).await;
        timing.claim = started.elapsed();
        claimed.map(|row| row.is_some())
    }

    /// Claims all of `ids` in one statement (see [`CLAIM_ALL_SQL`]); the ids this transaction
    /// now owns.
    async fn claim_all(
        &self,
        tx: &mut Tx,
        handler: &dyn Handler,
        ids: &[&str],
    ) -> Result<Vec<String>, sqlx::Error> {
        let digest = handler.digest();
        let sql = if digest.is_some() {
            CLAIM_ALL_RECORDING_SQL
        } else {
            CLAIM_ALL_SQL
        };
        let mut query = sqlx::query_scalar(sql)
            .bind(&self.settings.consumer_name)
            .bind(ids);
        if let Some(digest) = digest {
            query = query.bind(digest);
        }
        query.fetch_all(&mut **tx).await
    }

    /// Lends the claimed transaction to the handler (as the consumer's role, if any) and takes
    /// it back, with the reason it must roll back if it must.
    async fn lend(
        &self,
        mut tx: Tx,
        handler: &dyn Handler,
        msg: &Message,
        timing: &mut Timing,
    ) -> Result<(Tx, Option<AttemptFailure>), AttemptFailure> {
        failpoint::hit("after_claim");
        if let Some(role) = &self.settings.role {
            pg::set_role(&mut tx, Some(role))
                .await
                .map_err(|e| AttemptFailure::db("failed to set the handler's role", &e))?;
        }
        let origin = Origin::new(&self.settings.consumer_name, &msg.id, &msg.headers)
            .with_role(self.settings.role.clone());
        let handle = TxHandle::new(tx, origin);
        let started = Instant::now();
        let result = handler
            .handle(&handle, msg)
            .instrument(info_span!("idemhost.plugin.handle"))
            .await;
        timing.handler = Some(started.elapsed());
        let (tx, poison) = handle.take().await;
        let tx = tx.ok_or_else(|| AttemptFailure {
            kind: FailureKind::Retryable,
            cause: Rollback::Connection,
            reason: "transaction lost during the handler".into(),
        })?;
        Ok((tx, judge(result, poison)))
    }

    /// Back to the host's role after the handler ran as `consumer.role`.
    async fn reset_role(&self, tx: &mut Tx) -> Result<(), AttemptFailure> {
        if self.settings.role.is_some() {
            pg::set_role(tx, None)
                .await
                .map_err(|e| AttemptFailure::db("failed to reset the handler's role", &e))?;
        }
        Ok(())
    }
}

/// Rolls an abandoned transaction back (a failed ROLLBACK discards the connection).
async fn rollback(tx: Tx) {
    if let Err(e) = tx.rollback().await {
        debug!(error = %pg::describe(&e), "rollback failed; the connection is discarded");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_statements_are_the_seeds_insert() {
        assert_eq!(
            CLAIM_SQL,
            "INSERT INTO processed_message (consumer_name, message_id) VALUES ($1, $2) \
             ON CONFLICT DO NOTHING RETURNING message_id"
        );
        assert_eq!(
            CLAIM_RECORDING_SQL,
            format!(
                "WITH claimed AS ({CLAIM_SQL}), recorded AS (INSERT INTO processed_message_handler \
                 (consumer_name, message_id, plugin_digest) SELECT $1, message_id, $3 FROM claimed) \
                 SELECT message_id FROM claimed"
            )
        );
        assert!(CLAIM_ALL_RECORDING_SQL.starts_with(&format!("WITH claimed AS ({CLAIM_ALL_SQL})")));
    }
}
