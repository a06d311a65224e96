//! What follows a delivery attempt, decided in one place: a pure function of the outcome, the
//! attempt and the consumer's retry settings (see [`disposition`]).

use std::time::Duration;

use crate::config::ConsumerConfig;
use crate::outcome::Outcome;

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
