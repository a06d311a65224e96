//! idemhost: a consumer host that makes NATS JetStream message handling idempotent by
//! construction. Each delivery claims a `(consumer_name, message_id)` marker and runs its
//! handler in one PostgreSQL transaction; the broker is acked only after that commit returned.
//!
//! # Embedding
//! Build a [`Config`] (or [`Config::load`] a TOML file), optionally give a consumer a native
//! [`Handler`] with [`Host::with_handler`] and the host your [`HostMetrics`] with
//! [`Host::with_metrics`], and [`Host::run`] until a shutdown future resolves, on your own
//! tokio runtime (docs/embedding.md; `examples/embedding`). A handler gets the [`Message`] and a [`TxHandle`] — the delivery's transaction,
//! its only database access — and its result decides the [`Outcome`]. [`Claimer`] runs one
//! delivery's transaction without a broker (tests, replays).
//!
//! Beside the embedder's API: [`config`] (every key of the configuration file), [`headers`]
//! (the header names producers and operators use), [`ops`] (what the operator's commands do:
//! marker retention, dead-letter replay, the outbox, `check`) and [`rehearsal`] (one delivery
//! outside the broker, as `idemhost plugin test` runs it). The command line is the
//! `idemhost-cli` package; the benchmark harness is `idemhost-bench`.
//!
//! # Layout, bottom up (a module uses only the ones listed before it; `scripts/module-graph.sh`
//! checks it)
//! - `error` (the library's [`Error`]), `config`, `subjects`, `headers`, `outcome`, `clock`,
//!   `histogram`, `failpoint`, `metrics`: the configuration and the types and counters
//!   everything shares.
//! - `sql_gate`: what handler SQL may do. `pg`: the pool, migrations, the plugin role's wall,
//!   the one classification of database errors. `outbox`: events published through the
//!   transaction, and their relay.
//! - `tx_handle`: the transaction handle lent to a handler for one call. `handler`: the
//!   [`Handler`] trait. `plugin`: WASM components — loading, validation, the compile cache,
//!   sandboxed per-delivery instances.
//! - `claim`: the delivery's transaction — claim, handler, commit — and its [`Outcome`].
//! - `registry`: each consumer's current plugin version and the hot swap.
//! - `source`: JetStream binding, the pull loop, ack / nak / term and dead-lettering.
//! - `admin` (`/healthz`, `/readyz`, `/metrics`, `/plugins`), `ops` (operator commands and the
//!   metric samplers), `host` (wiring it all together and running until shutdown),
//!   `rehearsal`, `telemetry`.

#![warn(missing_docs)]
// Everything not in the API is `pub(crate)`; checked where the hidden `test_support` exists,
// since without it the items it re-exports are crate-private in fact.
#![cfg_attr(feature = "test-support", warn(unreachable_pub))]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

mod admin;
mod claim;
mod clock;
pub mod config;
mod disposition;
mod error;
mod failpoint;
mod handler;
pub mod headers;
mod histogram;
mod host;
mod metrics;
pub mod ops;
#[cfg(feature = "otlp")]
mod otel;
mod outbox;
mod outcome;
mod pg;
mod plugin;
mod registry;
pub mod rehearsal;
mod source;
mod sql_gate;
mod stored;
mod subjects;
pub mod telemetry;
mod text;
mod tx_handle;

pub use claim::{CLAIM_SQL, ClaimSettings, Claimer};
pub use config::{Config, ConsumerConfig, Isolation};
pub use error::{Error, ErrorKind};
pub use handler::{HandleFuture, Handler, HandlerError, Message, PluginTimings};
pub use host::{Host, HostMetrics, RunOptions};
pub use outcome::{Failure, FailureKind, Outcome, Processed, Rollback};
pub use pg::migrate;
pub use plugin::{
    DEFAULT_COMPILE_CACHE_MAX, LoadInfo, PluginConfig, PluginError, PluginLimits, PluginRuntime,
    PoolSizing, WasmHandler,
};
pub use sql_gate::{SqlArray, SqlValue, Values};
/// NATS subject matching (`*`, `>`), as the host filters by it.
pub use subjects::subject_matches;
pub use tx_handle::{DbError, DbErrorKind, TxError, TxHandle};

/// Internals the system tests in `tests/` drive directly. Not API: hidden from the docs, and
/// only built with the `test-support` feature.
#[cfg(feature = "test-support")]
#[doc(hidden)]
#[allow(missing_docs)]
pub mod test_support {
    pub use crate::admin::{http, probe};
    pub use crate::metrics::{EventTypeLabels, Metrics};
    pub use crate::outbox::{Origin, event_headers, event_id, relay};
    /// The database layer's helpers the tests call.
    pub mod pg {
        pub use crate::pg::wall;
        pub use crate::pg::{
            Connections, Failover, Tx, Wall, check_login_settings, connect_options, session_failed,
        };
    }
    pub use crate::source::partition;
    pub use crate::sql_gate::check;
}
