//! The seed's database-invariant tests, driven through the host's own claim pipeline
//! (`Claimer`) with the real inventory WASM plugin against real PostgreSQL, one transaction per
//! delivery. (The crash test, the seed's seventh, needs a host process: see `crash.rs`.)
//! `seed_batch.rs` runs the same cases in group-commit mode.

mod common;

const BATCH: bool = false;

include!("seed/cases.rs");
