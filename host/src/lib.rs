//! idemhost: a consumer host that makes NATS JetStream message handling idempotent by
//! construction. Each delivery claims a `(consumer_name, message_id)` marker and runs its
//! handler in one PostgreSQL transaction; the broker is acked only after that commit returned.
//!
//! # Layout (in the order a message flows through)
//! - [`config`]: the TOML configuration, env overrides and validation.
//! - [`source`]: JetStream binding, the pull loop, ack / nak / term and dead-lettering.
//! - [`claim`]: the delivery's transaction — claim, handler, commit — and its [`Outcome`]
//!   ([`outcome`]: the outcome, the rollback reason and what the delivery took).
//! - [`txn`]: the transaction handle lent to a handler for the duration of one call.
//! - [`outbox`]: events published through the transaction (`tx.publish`) and their relay.
//! - [`sql_gate`]: what handler SQL may do; parameter binding and value conversion.
//! - [`plugin`]: WASM components — loading, validation, the compile cache, sandboxed
//!   per-delivery instances.
//! - [`registry`]: each consumer's current plugin version and the hot swap (admin API, file
//!   watch, the shared NATS store, rollback).
//! - [`handler`]: the [`Handler`] trait shared by plugins and native Rust handlers.
//! - [`pg`]: the pool, migrations, and the one classification of database errors.
//! - [`host`]: wiring it all together and running until shutdown.
//! - [`admin`]: `/healthz`, `/readyz`, `/metrics` and `/plugins` (deploy, rollback).
//! - [`metrics`]: the Prometheus metrics and their samplers.
//! - `otel`: OTLP span export (feature `otlp`).
//! - [`ops`]: operator tooling — `check`, marker stats and retention, dead-letter replay.
//! - [`cli`]: the `idemhost` command line.
//! - [`baseline`]: the seed's inventory handler in native Rust (embedding example, WASM baseline).
//! - [`failpoint`]: crash points for fault tests (feature `failpoints`).
//! - [`histogram`]: lock-free latency histograms (plugin instantiate and handle times).
//! - [`clock`]: ages of broker timestamps.

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod admin;
pub mod baseline;
pub mod bench;
pub mod claim;
pub mod cli;
pub mod clock;
pub mod config;
pub mod failpoint;
pub mod handler;
pub mod histogram;
pub mod host;
pub mod metrics;
pub mod ops;
#[cfg(feature = "otlp")]
pub mod otel;
pub mod outbox;
pub mod outcome;
pub mod pg;
pub mod plugin;
pub mod registry;
pub mod source;
pub mod sql_gate;
pub mod txn;

pub use claim::{CLAIM_SQL, ClaimSettings, Claimer, Outcome, Processed, Rollback};
pub use config::{Config, ConsumerConfig, Isolation};
pub use handler::{HandleFuture, Handler, HandlerError, Message};
pub use host::Host;
pub use plugin::{LoadInfo, PluginLimits, PluginRuntime, PluginTimings, PoolSizing, WasmHandler};
pub use sql_gate::SqlValue;
pub use txn::{TxError, TxHandle};
