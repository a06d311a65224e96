//! The seed's database-invariant tests, driven through the host's own claim pipeline
//! (`Claimer`) with the real inventory WASM plugin against real PostgreSQL. Each case
//! (`seed/cases.rs`) runs twice: `per_message::*` gives every delivery its own transaction;
//! `group_commit::*` runs every delivery inside a batch (`Claimer::process_batch`) after a
//! neighbour that fails and is rolled back to its savepoint in the same transaction. The
//! assertions are the per-message ones: batching changes nothing a marker, an effect or an
//! outcome shows. (The crash test, the seed's seventh, needs a host process: see `crash.rs`.)

/// The cases, in `tests/system/seed/`.
mod cases;

/// A `#[tokio::test]` per case in each mode.
macro_rules! in_both_modes {
    ($($case:ident),* $(,)?) => {
        mod per_message {
            $(
                #[tokio::test]
                async fn $case() {
                    crate::seed::cases::$case(false).await
                }
            )*
        }
        mod group_commit {
            $(
                #[tokio::test]
                async fn $case() {
                    crate::seed::cases::$case(true).await
                }
            )*
        }
    };
}

in_both_modes!(
    duplicate_delivery_is_acked_without_second_effect,
    simultaneous_deliveries_apply_exactly_once,
    failed_business_update_rolls_back_marker_and_effect,
    waiting_claim_is_duplicate_when_winner_commits,
    waiting_claim_applies_when_winner_rolls_back,
    two_consumer_names_each_apply_the_same_message,
    serialization_failure_retries_whole_transaction_with_same_id,
    serialization_failure_past_limit_is_retryable_and_commits_nothing,
    concurrent_update_under_repeatable_read_is_retried,
);
