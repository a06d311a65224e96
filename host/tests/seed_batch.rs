//! The seed's database-invariant tests (`seed/cases.rs`) in group-commit mode: every delivery
//! runs inside a batch (`Claimer::process_batch`) after a neighbour that fails and is rolled
//! back to its savepoint in the same transaction. The assertions are the per-message ones:
//! batching changes nothing a marker, an effect or an outcome shows.

mod common;

const BATCH: bool = true;

include!("seed/cases.rs");
