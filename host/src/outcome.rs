//! What became of a delivery ([`Outcome`]), why an attempt rolled back ([`Rollback`]), the
//! failure behind it ([`Failure`]) and what the delivery took ([`Processed`]): the claim
//! pipeline decides them; the source settles the broker by them and the metrics count them.
//!
//! A [`Failure`] is one type from the statement (or the handler, or the host) that failed to
//! the delivery's disposition: what to do about it, why (the `idemhost_rollbacks_total`
//! reason), the text, PostgreSQL's SQLSTATE when the server answered, and the facts the claim
//! pipeline and group commit decide by.

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
    /// The failure of the last attempt (none when it committed): its SQLSTATE when a statement
    /// failed at the server.
    pub failure: Option<Failure>,
}

/// What to do about a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Serialization failure or deadlock: run the whole transaction again (claim included).
    RetryTransaction,
    /// Transient (connection lost, timeout, server shutting down, resources, schema not there
    /// yet), or the handler asked for a retry: roll back and let the broker redeliver after a
    /// backoff.
    Retryable,
    /// The data itself is refused (constraint, bad value), or the handler said so: redelivery
    /// cannot help.
    Terminal,
}

/// Why an attempt did not commit (see the module).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub(crate) kind: FailureKind,
    pub(crate) cause: Rollback,
    pub(crate) reason: String,
    /// PostgreSQL's SQLSTATE, when a statement failed at the server.
    pub(crate) sqlstate: Option<String>,
    /// A lock wait was given up (`lock_timeout`, `NOWAIT`): in a group, a conflict between
    /// groups.
    pub(crate) lock_wait: bool,
    /// The statement went past the server's own limits (class 54): the delivery fails for
    /// good, whatever the handler answers.
    pub(crate) past_limits: bool,
    /// The server was away or read-only: the attempt may wait for it and run again without
    /// counting (`postgres.failover_wait`).
    pub(crate) unavailable: bool,
}

impl Failure {
    /// A failure the host or the handler decided, with no statement behind it.
    pub(crate) fn new(kind: FailureKind, cause: Rollback, reason: impl Into<String>) -> Self {
        Failure {
            kind,
            cause,
            reason: reason.into(),
            sqlstate: None,
            lock_wait: false,
            past_limits: false,
            unavailable: false,
        }
    }

    /// What to do about it.
    pub fn kind(&self) -> FailureKind {
        self.kind
    }

    /// Why the attempt rolled back.
    pub fn cause(&self) -> Rollback {
        self.cause
    }

    /// The text logged, and sent with a dead letter.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// PostgreSQL's SQLSTATE, when a statement failed at the server.
    pub fn sqlstate(&self) -> Option<&str> {
        self.sqlstate.as_deref()
    }

    /// The delivery's outcome when this failure is its last word.
    pub(crate) fn outcome(&self) -> Outcome {
        match self.kind {
            FailureKind::Terminal => Outcome::TerminalFailure(self.reason.clone()),
            FailureKind::RetryTransaction | FailureKind::Retryable => {
                Outcome::RetryableFailure(self.reason.clone())
            }
        }
    }
}
