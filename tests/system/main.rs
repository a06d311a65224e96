//! The system tests, one test binary: each suite a module (`seed`, `e2e`, `wall`, …), all of
//! them sharing `tests/common` and running in parallel against the real PostgreSQL and NATS
//! (each test in its own schema and stream). Run one suite by its module path:
//!
//!   cargo test -p idemhost-cli --features failpoints,otlp,bench --test system wall::
//!
//! One binary links wasmtime, sqlx and libpg_query once, where 31 binaries linked them 31 times.
//! The one suite that is not here is `tests/group_session.rs`: it switches the SQL gate off for
//! its whole process (the failpoint is read once per process), which must not reach these.

#[path = "../common/mod.rs"]
mod common;

mod admin_limits;
mod alloc_attack;
mod availability;
mod bad_input;
mod batch;
// `idemhost bench` is in the binary only with the `bench` feature (scripts/test.sh asks for it).
#[cfg(feature = "bench")]
mod bench_smoke;
mod chaos;
mod cli;
mod cluster;
mod conformance;
mod contained;
mod container;
/// Needs the `failpoints` feature: it kills the host at named crash points.
#[cfg(feature = "failpoints")]
mod crash;
mod docs;
mod e2e;
mod errors;
mod gate_vs_postgres;
mod header_gate_vs_nats;
mod hostile;
mod hotswap;
mod kept_connections;
mod operations;
mod operator_cli;
mod order_flow;
mod ordering;
/// Needs the `otlp` feature: the host exports its spans.
#[cfg(feature = "otlp")]
mod otlp;
mod outbox;
mod plugin_dev;
mod plugin_diff;
mod plugin_load;
mod plugin_undo;
mod pooler;
mod replicas;
mod scripts;
mod seed;
mod shipped;
mod values;
/// Needs the `failpoints` feature: one set-up switches the SQL gate off in the host it runs.
#[cfg(feature = "failpoints")]
mod wall;
