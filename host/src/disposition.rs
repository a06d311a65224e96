//! What follows a delivery attempt, decided in one place, by pure functions: inside the claim
//! pipeline, what a failed transaction attempt leads to ([`after_attempt`], and in a group
//! [`in_group`]); then what the broker hears of the delivery's outcome ([`disposition`]).

use std::time::Duration;

use crate::config::ConsumerConfig;
use crate::outcome::{Failure, FailureKind, Outcome, Rollback};

/// What the claim pipeline does after a transaction attempt of a delivery running alone failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AfterAttempt {
    /// The server was away or read-only: wait for it (within `postgres.failover_wait`) and run
    /// the same attempt again, uncounted; if it does not come back, [`after_attempt`] again with
    /// `may_wait` false.
    WaitForDatabase,
    /// A conflict (serialization failure, deadlock) with transaction attempts left: run the
    /// whole transaction again, claim included, after a jittered pause.
    RetryTransaction,
    /// The failure ends the delivery with this outcome; [`disposition`] says what follows.
    Settle(Outcome),
}

/// What follows failed transaction attempt `tx_attempt` (1-based) of `tx_max_attempts`;
/// `may_wait` while the delivery's `failover_wait` is not used up.
pub(crate) fn after_attempt(
    failure: &Failure,
    tx_attempt: u32,
    tx_max_attempts: u32,
    may_wait: bool,
) -> AfterAttempt {
    match failure.kind {
        // The server was away, not the message at fault.
        _ if may_wait && failure.unavailable && failure.kind != FailureKind::Terminal => {
            AfterAttempt::WaitForDatabase
        }
        FailureKind::RetryTransaction if tx_attempt < tx_max_attempts => {
            AfterAttempt::RetryTransaction
        }
        FailureKind::RetryTransaction => AfterAttempt::Settle(Outcome::RetryableFailure(format!(
            "{} (gave up after {tx_attempt} transaction attempts)",
            failure.reason
        ))),
        FailureKind::Retryable | FailureKind::Terminal => AfterAttempt::Settle(failure.outcome()),
    }
}

/// What a group-commit transaction does when one delivery's part of it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum InGroup {
    /// The whole transaction is lost (a conflict, or a lock wait given up — a conflict between
    /// groups): the group is abandoned, and each of its deliveries runs alone, from the
    /// transaction attempt [`run_alone_from`] gives.
    RunAlone(Failure),
    /// Only this delivery fails, with this failure as its result; the others run again behind
    /// savepoints (or keep their result).
    FailAlone(Failure),
}

impl InGroup {
    /// The failure, as the group sees it.
    pub(crate) fn into_failure(self) -> Failure {
        match self {
            InGroup::RunAlone(f) | InGroup::FailAlone(f) => f,
        }
    }
}

/// What a group does with `failure` of one of its deliveries (see [`InGroup`]).
pub(crate) fn in_group(failure: Failure) -> InGroup {
    if failure.lock_wait {
        // Where it runs alone, such a failure is judged as it would be there.
        return InGroup::RunAlone(Failure {
            kind: FailureKind::RetryTransaction,
            cause: Rollback::Conflict,
            ..failure
        });
    }
    match failure.kind {
        FailureKind::RetryTransaction => InGroup::RunAlone(failure),
        FailureKind::Retryable | FailureKind::Terminal => InGroup::FailAlone(failure),
    }
}

/// The transaction attempt a group's deliveries start from when the group was abandoned for
/// `failure`: a conflict used up each delivery's first attempt; anything else did not.
pub(crate) fn run_alone_from(failure: &Failure, tx_max_attempts: u32) -> u32 {
    if failure.kind == FailureKind::RetryTransaction {
        2.min(tx_max_attempts.max(1))
    } else {
        1
    }
}

/// What the host does with a delivery after an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Disposition {
    /// Committed (applied, or a duplicate): ack, confirmed.
    Ack,
    /// A retryable failure of an ordered consumer with attempts left: wait `delay` (the
    /// delivery kept in progress, its key waiting) and run it again here.
    RetryInPlace { delay: Duration },
    /// A retryable failure with attempts left: nak, the broker redelivers after `delay`.
    Nak { delay: Duration },
    /// Terminal, or retryable on the last attempt (`out_of_attempts`): dead-letter, then ack.
    DeadLetter { out_of_attempts: bool },
}

/// What follows attempt `attempt` (1-based) that ended in `outcome`, for a consumer with
/// `config`'s `max_deliver`, `backoff` and `ordering` (which retries in place).
pub(crate) fn disposition(outcome: &Outcome, attempt: u32, config: &ConsumerConfig) -> Disposition {
    match outcome {
        Outcome::Applied | Outcome::Duplicate => Disposition::Ack,
        Outcome::TerminalFailure(_) => Disposition::DeadLetter {
            out_of_attempts: false,
        },
        Outcome::RetryableFailure(_) if attempt >= config.max_deliver => Disposition::DeadLetter {
            out_of_attempts: true,
        },
        Outcome::RetryableFailure(_) => {
            let delay = config.backoff_for(attempt);
            if config.ordering.is_some() {
                Disposition::RetryInPlace { delay }
            } else {
                Disposition::Nak { delay }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failure of `kind` with the given flags.
    fn failure(kind: FailureKind, lock_wait: bool, unavailable: bool) -> Failure {
        Failure {
            lock_wait,
            unavailable,
            ..Failure::new(kind, Rollback::Database, "r")
        }
    }

    /// Every row of the claim pipeline's policy for a delivery alone: each kind, with the
    /// server away or not, with waiting allowed or used up, at the first, a middle and the last
    /// transaction attempt.
    #[test]
    fn every_failed_attempt_has_its_next_step() {
        use AfterAttempt::{Settle, WaitForDatabase};
        use FailureKind::{Retryable, Terminal};
        const CONFLICT: FailureKind = FailureKind::RetryTransaction;
        const AGAIN: AfterAttempt = AfterAttempt::RetryTransaction;
        let retryable = || Settle(Outcome::RetryableFailure("r".into()));
        let gave_up = |n: u32| {
            Settle(Outcome::RetryableFailure(format!(
                "r (gave up after {n} transaction attempts)"
            )))
        };
        let rows = [
            // (kind, unavailable, may_wait, tx_attempt, want)
            (CONFLICT, false, true, 1, AGAIN),
            (CONFLICT, false, true, 2, AGAIN),
            (CONFLICT, false, true, 3, gave_up(3)),
            (CONFLICT, false, false, 4, gave_up(4)),
            (CONFLICT, true, true, 3, WaitForDatabase),
            (CONFLICT, true, false, 1, AGAIN),
            (Retryable, false, true, 1, retryable()),
            (Retryable, false, true, 3, retryable()),
            (Retryable, true, true, 1, WaitForDatabase),
            (Retryable, true, true, 3, WaitForDatabase),
            (Retryable, true, false, 1, retryable()),
            (
                Terminal,
                false,
                true,
                1,
                Settle(Outcome::TerminalFailure("r".into())),
            ),
            (
                Terminal,
                true,
                true,
                2,
                Settle(Outcome::TerminalFailure("r".into())),
            ),
            (
                Terminal,
                true,
                false,
                3,
                Settle(Outcome::TerminalFailure("r".into())),
            ),
        ];
        for (kind, unavailable, may_wait, tx_attempt, want) in rows {
            let f = failure(kind, false, unavailable);
            assert_eq!(
                after_attempt(&f, tx_attempt, 3, may_wait),
                want,
                "{kind:?} unavailable {unavailable} may_wait {may_wait} attempt {tx_attempt}"
            );
        }
    }

    /// Every row of a group's policy: a conflict or a lock wait given up abandons the group (a
    /// lock wait becomes a conflict there); anything else fails the delivery alone, flags and
    /// text kept. A conflict used up the first transaction attempt of each delivery, within
    /// `tx_max_attempts`.
    #[test]
    fn every_failure_in_a_group_has_its_next_step() {
        use FailureKind::*;
        for (kind, lock_wait, run_alone) in [
            (RetryTransaction, false, true),
            (RetryTransaction, true, true),
            (Retryable, true, true),
            (Terminal, true, true),
            (Retryable, false, false),
            (Terminal, false, false),
        ] {
            let f = failure(kind, lock_wait, false);
            match in_group(f.clone()) {
                InGroup::RunAlone(g) => {
                    assert!(run_alone, "{kind:?} lock_wait {lock_wait}");
                    assert_eq!(g.kind, RetryTransaction);
                    let cause = if lock_wait {
                        Rollback::Conflict
                    } else {
                        f.cause
                    };
                    assert_eq!(g.cause, cause);
                    assert_eq!(g.reason, f.reason);
                }
                InGroup::FailAlone(g) => {
                    assert!(!run_alone, "{kind:?} lock_wait {lock_wait}");
                    assert_eq!(g, f);
                }
            }
        }
        let conflict = failure(RetryTransaction, false, false);
        assert_eq!(run_alone_from(&conflict, 3), 2);
        assert_eq!(run_alone_from(&conflict, 1), 1);
        assert_eq!(run_alone_from(&conflict, 0), 1);
        assert_eq!(run_alone_from(&failure(Retryable, false, false), 3), 1);
        assert_eq!(run_alone_from(&failure(Terminal, false, false), 3), 1);
    }

    /// A consumer with `max_deliver`, `backoff` and, when `ordered`, an ordering key.
    fn consumer(max_deliver: u32, backoff: &str, ordered: bool) -> ConsumerConfig {
        let ordering = if ordered {
            "ordering = { key = \"header:K\" }\n"
        } else {
            ""
        };
        toml::from_str(&format!(
            "name = \"c\"\nstream = \"s\"\nsubjects = [\"a\"]\nplugin = \"p.wasm\"\n\
             max_deliver = {max_deliver}\nbackoff = {backoff}\n{ordering}"
        ))
        .unwrap()
    }

    /// Every row of the policy: each outcome at the first, a middle and the last attempt (and
    /// past it), ordered or not, with the backoff list's steps and its last one repeated.
    #[test]
    fn every_outcome_attempt_and_ordering_has_its_disposition() {
        let ms = Duration::from_millis;
        let retryable = Outcome::RetryableFailure("x".into());
        let terminal = Outcome::TerminalFailure("x".into());
        use Disposition::*;
        let rows: Vec<(&Outcome, u32, bool, Disposition)> = vec![
            (&Outcome::Applied, 1, false, Ack),
            (&Outcome::Applied, 4, true, Ack),
            (&Outcome::Duplicate, 1, true, Ack),
            (&Outcome::Duplicate, 9, false, Ack),
            (
                &terminal,
                1,
                false,
                DeadLetter {
                    out_of_attempts: false,
                },
            ),
            (
                &terminal,
                1,
                true,
                DeadLetter {
                    out_of_attempts: false,
                },
            ),
            (
                &terminal,
                4,
                false,
                DeadLetter {
                    out_of_attempts: false,
                },
            ),
            (&retryable, 1, false, Nak { delay: ms(100) }),
            (&retryable, 2, false, Nak { delay: ms(1_000) }),
            (&retryable, 3, false, Nak { delay: ms(1_000) }),
            (
                &retryable,
                4,
                false,
                DeadLetter {
                    out_of_attempts: true,
                },
            ),
            (
                &retryable,
                5,
                false,
                DeadLetter {
                    out_of_attempts: true,
                },
            ),
            (&retryable, 1, true, RetryInPlace { delay: ms(100) }),
            (&retryable, 3, true, RetryInPlace { delay: ms(1_000) }),
            (
                &retryable,
                4,
                true,
                DeadLetter {
                    out_of_attempts: true,
                },
            ),
        ];
        for (outcome, attempt, ordered, want) in rows {
            let config = consumer(4, "[\"100ms\", \"1s\"]", ordered);
            assert_eq!(
                disposition(outcome, attempt, &config),
                want,
                "{outcome:?} attempt {attempt}, ordered {ordered}"
            );
        }
        // One attempt in all: the first retryable failure is the last.
        assert_eq!(
            disposition(&retryable, 1, &consumer(1, "[\"1s\"]", false)),
            DeadLetter {
                out_of_attempts: true
            }
        );
    }
}
