//! Group commit: several deliveries in one transaction, acked only after its one COMMIT.
//!
//! A batch first runs optimistically: one statement claims every id of the batch (and records
//! the plugin version), then the handlers run one after another in the same transaction, then
//! COMMIT. That is one round trip per batch for all the claims, and per message the handler's
//! own statements and one more: between one handler and the next the host clears what the
//! plugin left in the session (settings, temporary objects, cursors, advisory locks: see
//! [`Wall::between_sql`]), as the end of a delivery's own transaction does. What lasts until
//! the group's COMMIT are the transaction's own: row locks, transaction-scoped advisory locks,
//! uncommitted rows.
//!
//! If one message fails on its own (its handler's error, trap, timeout, a statement of its
//! own), the transaction is rolled back: that message keeps its failure and the others run
//! again in a second transaction where each message stands behind a SAVEPOINT of its own
//! (claim first, then handler; ROLLBACK TO on a failure), so a further failure rolls back
//! only its own marker and effect. The result is what savepoints alone would have given: the
//! failed message was judged with the earlier messages applied, the later ones without its
//! effect; an id that comes twice is applied once, by its first delivery that does not fail.
//!
//! Anything that endangers the whole transaction — a serialization failure or deadlock, a lock
//! wait past `batch_lock_timeout`, a lost connection, a failed COMMIT — abandons the batch, and
//! its messages are processed one by one in per-message transactions: their markers decide what
//! (if anything) had committed. A batch holds every row lock its handlers took until its COMMIT,
//! so batches that lock hot rows in different orders deadlock; the lock timeout gives such a
//! wait up long before the server's `deadlock_timeout` would (see [`Wall::begin_group_sql`]).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use tracing::{Instrument, debug, info_span};

use super::{
    Claimer, Failure, FailureKind, Outcome, Processed, Rollback, Timing, db_failure, failpoint,
    not_begun, rollback,
};
use crate::disposition::{self, InGroup};
use crate::handler::{Handler, Message};
use crate::pg::{self, Begin, Tx, Wall};

/// One message's result inside a batch that has not committed yet.
struct Part {
    outcome: Outcome,
    failure: Option<Failure>,
    timing: Timing,
}

impl Part {
    fn done(outcome: Outcome, timing: Timing) -> Self {
        Part {
            outcome,
            failure: None,
            timing,
        }
    }

    /// A message that failed on its own (not a conflict: that abandons the batch).
    fn failed(failure: Failure, timing: Timing) -> Self {
        Part {
            outcome: failure.outcome(),
            failure: Some(failure),
            timing,
        }
    }
}

/// Why the optimistic transaction did not commit.
enum Stop {
    /// Message `.0` failed on its own, with this result.
    Message(usize, Part),
    /// The whole transaction is lost.
    Batch(Failure),
}

impl Claimer {
    /// Processes `msgs` in one transaction, in order; returns one result per message. A
    /// duplicate id later in the batch is a duplicate of the earlier message (unless the
    /// earlier one failed).
    pub async fn process_batch(&self, handler: &dyn Handler, msgs: &[Message]) -> Vec<Processed> {
        if let [one] = msgs {
            return vec![self.process(handler, one).await];
        }
        let started = Instant::now();
        let span = info_span!("idemhost.batch", messages = msgs.len());
        let attempt = async {
            match self.optimistic(handler, msgs).await {
                Ok(parts) => Ok(parts),
                Err(Stop::Message(index, part)) => {
                    debug!(
                        index,
                        "a message of the batch failed; the others run again behind savepoints"
                    );
                    self.with_savepoints(handler, msgs, (index, part)).await
                }
                Err(Stop::Batch(f)) => Err(f),
            }
        };
        match attempt.instrument(span).await {
            Ok(parts) => {
                let tx_time = started.elapsed();
                parts
                    .into_iter()
                    .map(|p| Processed {
                        outcome: p.outcome,
                        tx_attempts: 1,
                        claim_time: p.timing.claim,
                        tx_time,
                        handler_time: p.timing.handler,
                        rollback: p.failure.as_ref().map(Failure::cause),
                        database_waits: 0,
                        failure: p.failure,
                    })
                    .collect()
            }
            Err(f) => {
                debug!(reason = %f.reason, messages = msgs.len(), "batch abandoned; processing its messages one by one");
                let first = disposition::run_alone_from(&f, self.settings.tx_max_attempts);
                let mut out = Vec::with_capacity(msgs.len());
                for msg in msgs {
                    out.push(self.process_from(handler, msg, first).await);
                }
                out
            }
        }
    }

    /// The batch without savepoints: all claims in one statement, the handlers, COMMIT.
    async fn optimistic(&self, handler: &dyn Handler, msgs: &[Message]) -> Result<Vec<Part>, Stop> {
        let wall = self.wall().await.map_err(Stop::Batch)?;
        let started = Instant::now();
        let ids: Vec<&str> = msgs.iter().map(|m| m.id.as_str()).collect();
        // The BEGIN goes ahead of the claims, in their round trip.
        let begun = begin_then!(self.connections, &wall.begin_group_statements, |tx| self
            .claim_all(tx, &wall, handler, &ids)
            .await);
        let (mut tx, (claimed, pid)) = match begun {
            Ok((mut tx, c)) => {
                tx.stoppable(self.backend(c.1));
                (tx, c)
            }
            Err(Begin::First(mut tx, e)) => {
                tx.note_failure(&e);
                rollback(tx, &wall).await;
                // Whatever it was, no claim of the group stands: the group runs alone.
                let failure = db_failure("failed to claim markers", &e);
                return Err(Stop::Batch(disposition::in_group(failure).into_failure()));
            }
            Err(Begin::Refused(e)) => return Err(Stop::Batch(not_begun(&e))),
        };
        let mut claimed: HashSet<String> = claimed.into_iter().collect();
        let claim = started.elapsed();
        let mut parts = Vec::with_capacity(msgs.len());
        let mut handled = false;
        for (index, msg) in msgs.iter().enumerate() {
            let mut timing = Timing {
                claim,
                handler: None,
            };
            // The first delivery of an id owns its claim; a later one in the batch is a
            // duplicate of it.
            if !claimed.remove(msg.id.as_str()) {
                parts.push(Part::done(Outcome::Duplicate, timing));
                continue;
            }
            // A handler ran before this one in the transaction: the session is cleared before
            // this one's first statement, in that statement's round trip (see
            // `Wall::between_statements`). Queued once: a handler that sent nothing leaves it queued
            // for the next one, and the commit clears the session itself.
            if std::mem::replace(&mut handled, true) && !tx.has_ahead() {
                for statement in &wall.between_statements {
                    tx.send_ahead(statement.as_str());
                }
            }
            let (back, failure) = self
                .lend(tx, &wall, pid, handler, msg, &mut timing)
                .await
                .map_err(Stop::Batch)?;
            tx = back;
            // What the clearing found, if it ran during this handler (its failure failed the
            // handler's first statement, which the server then skipped).
            let clearing_failed = failure.is_some() && tx.ahead_failed();
            let left = pg::last_ahead_flag(&tx.take_ahead_rows());
            // A transaction the last plugin made read-only abandons the group, whatever this
            // handler made of it (its writes failed).
            if left {
                rollback(tx, &wall).await;
                return Err(Stop::Batch(left_in_session()));
            }
            if let Some(failure) = failure.as_ref().filter(|_| clearing_failed) {
                // Its statements are prepared once per session: one a plugin deallocated would
                // fail every clearing on this connection.
                tx.close_at_end();
                let reason = format!(
                    "failed to clear the session between deliveries: {}",
                    failure.reason
                );
                rollback(tx, &wall).await;
                return Err(Stop::Batch(Failure::new(
                    FailureKind::Retryable,
                    Rollback::Database,
                    reason,
                )));
            }
            if let Some(failure) = failure {
                rollback(tx, &wall).await;
                return Err(match disposition::in_group(failure) {
                    InGroup::RunAlone(failure) => Stop::Batch(failure),
                    InGroup::FailAlone(failure) => {
                        Stop::Message(index, Part::failed(failure, timing))
                    }
                });
            }
            parts.push(Part::done(Outcome::Applied, timing));
        }
        failpoint::hit("before_commit");
        tx.commit_with(&wall.group_commit_sql)
            .await
            .map_err(|e| Stop::Batch(db_failure("failed to commit", &e)))?;
        Ok(parts)
    }

    /// The batch again after message `failed.0` failed on its own: that message keeps its
    /// result, every other one runs behind its own savepoint.
    async fn with_savepoints(
        &self,
        handler: &dyn Handler,
        msgs: &[Message],
        failed: (usize, Part),
    ) -> Result<Vec<Part>, Failure> {
        let wall = self.wall().await?;
        let mut tx = self.begin_with(&wall.begin_group_sql).await?;
        // The first pass's claim (a wait on a competing claim shows there) counts for every
        // message: it is part of what claiming it took.
        let first_claim = failed.1.timing.claim;
        // Named for this transaction only: a plugin that knew the name could release its own
        // part's savepoint and roll back to an earlier one, taking its claim with it and
        // leaving its later writes (possible only with the SQL gate off, which refuses
        // savepoint statements).
        let savepoint_name = savepoint_name();
        let mut failed = Some(failed);
        let mut parts = Vec::with_capacity(msgs.len());
        let mut handled = false;
        for (index, msg) in msgs.iter().enumerate() {
            if let Some((_, part)) = failed.take_if(|(at, _)| *at == index) {
                parts.push(part);
                continue;
            }
            // A handler ran before this one (its part may have been rolled back to its
            // savepoint, which does not undo all a session holds): cleared first.
            if handled && let Err(f) = clear(&mut tx, &wall).await {
                rollback(tx, &wall).await;
                return Err(f);
            }
            let (back, mut part) = self
                .batch_part(tx, &wall, handler, msg, &savepoint_name)
                .await?;
            handled |= part.timing.handler.is_some();
            part.timing.claim += first_claim;
            tx = back;
            parts.push(part);
        }
        // The name shows in pg_stat_activity to the consumer's other sessions while the
        // SAVEPOINT runs: a plugin that learned it (with the gate off) could roll back to it,
        // taking its own claim (or, after a RELEASE, an earlier part's claim and effect) and
        // keeping what it writes after. Every part reported applied must still hold its claim:
        // claimed again, each must be found taken. One that is not abandons the group; its
        // deliveries then run one per transaction, where no savepoint of the host exists.
        if handled && let Err(f) = clear(&mut tx, &wall).await {
            rollback(tx, &wall).await;
            return Err(f);
        }
        for (msg, part) in msgs.iter().zip(&parts) {
            if part.outcome != Outcome::Applied {
                continue;
            }
            let mut timing = Timing::default();
            match self
                .claim(&mut tx, &wall, handler, msg, &mut timing, false)
                .await
            {
                Ok((false, _)) => {}
                Ok((true, _)) => {
                    rollback(tx, &wall).await;
                    return Err(Failure::new(
                        FailureKind::Retryable,
                        Rollback::Database,
                        "a claim of the group was undone in its transaction (rolled back to \
                         the host's savepoint); the group runs again one delivery per \
                         transaction",
                    ));
                }
                Err(e) => {
                    tx.note_failure(&e);
                    rollback(tx, &wall).await;
                    return Err(db_failure("failed to check the group's claims", &e));
                }
            }
        }
        failpoint::hit("before_commit");
        tx.commit_with(&wall.commit_sql)
            .await
            .map_err(|e| db_failure("failed to commit", &e))?;
        Ok(parts)
    }

    /// One message's part: SAVEPOINT, claim, handler; ROLLBACK TO on a failure of this message
    /// alone. Savepoints are not released (each RELEASE would be one more round trip per
    /// message); the next message's savepoint of the same `name` shadows this one. `Err`
    /// abandons the whole batch.
    async fn batch_part(
        &self,
        mut tx: Tx,
        wall: &Arc<Wall>,
        handler: &dyn Handler,
        msg: &Message,
        name: &str,
    ) -> Result<(Tx, Part), Failure> {
        let mut timing = Timing::default();
        savepoint(&mut tx, &format!("SAVEPOINT {name}")).await?;
        // Not cached: an earlier part's plugin ran on this session (see `claim`).
        let failure = match self
            .claim(&mut tx, wall, handler, msg, &mut timing, false)
            .await
        {
            Err(e) => db_failure("failed to claim marker", &e),
            Ok((false, _)) => return Ok((tx, Part::done(Outcome::Duplicate, timing))),
            Ok((true, pid)) => {
                let (back, failure) = self.lend(tx, wall, pid, handler, msg, &mut timing).await?;
                tx = back;
                match failure {
                    None => {
                        return Ok((tx, Part::done(Outcome::Applied, timing)));
                    }
                    Some(f) => f,
                }
            }
        };
        // A conflict aborts more than this message's part: the whole batch is abandoned.
        let failure = match disposition::in_group(failure) {
            InGroup::RunAlone(failure) => return Err(failure),
            InGroup::FailAlone(failure) => failure,
        };
        savepoint(&mut tx, &format!("ROLLBACK TO SAVEPOINT {name}")).await?;
        Ok((tx, Part::failed(failure, timing)))
    }
}

/// Clears what the last handler's plugin left in the session before the next one runs in the
/// same transaction ([`Wall::between_sql`]). `Err` abandons the group: the statement failed, the
/// plugin left SQL-level prepared statements (which only closing the connection removes) or
/// made the transaction read-only — its deliveries then run one by one, each judged alone and
/// ending with the session reset.
async fn clear(tx: &mut Tx, wall: &Wall) -> Result<(), Failure> {
    // The simple protocol, never a cached statement: the plugin that just ran could have
    // deallocated one and prepared its own under the same name (review, gate off: prepared,
    // the clearing was replaced by `SELECT false` and the next claim by the plugin's). Prepared
    // it cost the server 18 µs less per delivery (`scripts/bench-wall.sh`).
    let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(wall.between_sql.clone()))
        .fetch_all(&mut **tx)
        .await
        .map_err(|e| {
            tx.note_failure(&e);
            db_failure("failed to clear the session between deliveries", &e)
        })?;
    if crate::pg::last_flag(&rows) {
        return Err(left_in_session());
    }
    Ok(())
}

/// What abandons a group whose clearing found a plugin left SQL-level prepared statements in
/// the session (which only closing the connection removes) or made the transaction read-only.
fn left_in_session() -> Failure {
    Failure::new(
        FailureKind::Retryable,
        Rollback::Database,
        "a plugin left prepared statements in the session or made the transaction read-only; \
         the group runs again one delivery per transaction",
    )
}

/// The savepoint name of one transaction of the savepoint path: drawn per transaction. Test
/// builds (`failpoints`) take `IDEMHOST_TEST_SAVEPOINT_NAME` instead when it is set, so that a
/// test can play a plugin that learned the name.
fn savepoint_name() -> String {
    #[cfg(feature = "failpoints")]
    if let Ok(name) = std::env::var("IDEMHOST_TEST_SAVEPOINT_NAME")
        && !name.is_empty()
        && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
    {
        return name;
    }
    format!("idemhost_{:016x}", rand::random::<u64>())
}

/// Runs a savepoint statement; its failure abandons the batch.
async fn savepoint(tx: &mut Tx, sql: &str) -> Result<(), Failure> {
    // The simple protocol: the name differs per transaction, nothing to keep prepared.
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&mut **tx)
        .await
        .map(|_| ())
        .map_err(|e| db_failure(sql, &e))
}
