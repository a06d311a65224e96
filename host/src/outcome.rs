//! What became of a delivery ([`Outcome`]), why an attempt rolled back ([`Rollback`]) and what
//! the delivery took ([`Processed`]): the claim pipeline decides them; the source settles the
//! broker by them and the metrics count them.

use std::time::Duration;

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

    /// Why a failed delivery failed.
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
    /// The `reason` label of `idemhost_rollbacks_total`.
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
    /// How the delivery ended.
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
    /// Times the delivery waited for an unavailable database and ran again, uncounted
    /// (`postgres.failover_wait`).
    pub database_waits: u32,
}
