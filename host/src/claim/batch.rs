//! Group commit: several deliveries in one transaction, each behind its own SAVEPOINT, so one
//! message's failure rolls back only its own marker and effect. The claim is still the first
//! statement of each message's part and the broker is still acked only after the one COMMIT.
//!
//! Anything that endangers the whole transaction — a serialization failure or deadlock, a lost
//! connection, a failed COMMIT — abandons the batch, and its messages are processed one by one
//! in per-message transactions: their markers decide what (if anything) had committed.

use std::time::Instant;

use sqlx::{Postgres, Transaction};
use tracing::{Instrument, debug, info_span};

use super::{AttemptFailure, Claimer, Outcome, Processed, Rollback, Timing, failpoint};
use crate::handler::{Handler, Message};
use crate::pg::FailureKind;

/// One message's result inside a batch that has not committed yet.
struct Part {
    outcome: Outcome,
    rollback: Option<Rollback>,
    timing: Timing,
}

impl Part {
    fn done(outcome: Outcome, timing: Timing) -> Self {
        Part {
            outcome,
            rollback: None,
            timing,
        }
    }
}

impl Claimer {
    /// Processes `msgs` in one transaction, in order; returns one result per message. A
    /// duplicate id later in the batch finds the earlier message's marker and is a duplicate
    /// (unless the earlier one failed and was rolled back to its savepoint).
    pub async fn process_batch(&self, handler: &dyn Handler, msgs: &[Message]) -> Vec<Processed> {
        if let [one] = msgs {
            return vec![self.process(handler, one).await];
        }
        let started = Instant::now();
        let span = info_span!("idemhost.batch", messages = msgs.len());
        match self.batch_attempt(handler, msgs).instrument(span).await {
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
                        rollback: p.rollback,
                    })
                    .collect()
            }
            Err(f) => {
                debug!(reason = %f.reason, messages = msgs.len(), "batch abandoned; processing its messages one by one");
                // A conflict used up each message's first transaction attempt.
                let first = if f.kind == FailureKind::RetryTransaction {
                    2.min(self.settings.tx_max_attempts.max(1))
                } else {
                    1
                };
                let mut out = Vec::with_capacity(msgs.len());
                for msg in msgs {
                    out.push(self.process_from(handler, msg, first).await);
                }
                out
            }
        }
    }

    async fn batch_attempt(
        &self,
        handler: &dyn Handler,
        msgs: &[Message],
    ) -> Result<Vec<Part>, AttemptFailure> {
        let mut tx = self
            .pool
            .begin_with(sqlx::AssertSqlSafe(self.begin_sql.clone()))
            .await
            .map_err(|e| AttemptFailure {
                cause: Rollback::Connection,
                ..AttemptFailure::db("failed to begin transaction", &e)
            })?;
        let mut parts = Vec::with_capacity(msgs.len());
        for msg in msgs {
            let (back, part) = self.batch_part(tx, handler, msg).await?;
            tx = back;
            parts.push(part);
        }
        let applied: Vec<&str> = msgs
            .iter()
            .zip(&parts)
            .filter(|(_, p)| p.outcome == Outcome::Applied)
            .map(|(m, _)| m.id.as_str())
            .collect();
        self.record_handler(&mut tx, handler, &applied).await?;
        failpoint::hit("before_commit");
        tx.commit()
            .await
            .map_err(|e| AttemptFailure::db("failed to commit", &e))?;
        Ok(parts)
    }

    /// One message's part: SAVEPOINT, claim, handler; ROLLBACK TO on a failure of this message
    /// alone. Savepoints are not released (each RELEASE would be one more round trip per
    /// message); the next message's savepoint of the same name shadows this one, and the
    /// plugins' versions are recorded for the whole batch before the COMMIT. `Err` abandons
    /// the whole batch.
    async fn batch_part(
        &self,
        mut tx: Transaction<'static, Postgres>,
        handler: &dyn Handler,
        msg: &Message,
    ) -> Result<(Transaction<'static, Postgres>, Part), AttemptFailure> {
        let mut timing = Timing::default();
        savepoint(&mut tx, "SAVEPOINT idemhost_message").await?;
        let failure = match self.claim(&mut tx, msg, &mut timing).await {
            Err(e) => AttemptFailure::db("failed to claim marker", &e),
            Ok(false) => return Ok((tx, Part::done(Outcome::Duplicate, timing))),
            Ok(true) => {
                let (back, failure) = self.lend(tx, handler, msg, &mut timing).await?;
                tx = back;
                match failure {
                    None => {
                        self.reset_role(&mut tx).await?;
                        return Ok((tx, Part::done(Outcome::Applied, timing)));
                    }
                    Some(f) => f,
                }
            }
        };
        // A conflict aborts more than this message's part: the whole batch is abandoned.
        if failure.kind == FailureKind::RetryTransaction {
            return Err(failure);
        }
        savepoint(&mut tx, "ROLLBACK TO SAVEPOINT idemhost_message").await?;
        let outcome = match failure.kind {
            FailureKind::Terminal => Outcome::TerminalFailure(failure.reason),
            _ => Outcome::RetryableFailure(failure.reason),
        };
        let part = Part {
            outcome,
            rollback: Some(failure.cause),
            timing,
        };
        Ok((tx, part))
    }
}

/// Runs a savepoint statement; its failure abandons the batch.
async fn savepoint(
    tx: &mut Transaction<'static, Postgres>,
    sql: &'static str,
) -> Result<(), AttemptFailure> {
    sqlx::query(sql)
        .execute(&mut **tx)
        .await
        .map(|_| ())
        .map_err(|e| AttemptFailure::db(sql, &e))
}
