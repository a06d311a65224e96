//! The default values of configuration keys (serde's `default = "…"`).

use std::time::Duration;

use super::{ByteSize, HumanDuration};

pub(super) fn default_admin_connections() -> u32 {
    256
}

pub(super) fn default_admin_request_timeout() -> HumanDuration {
    // A deploy uploads up to `max_upload` and compiles it within this; the CLI waits 120 s.
    HumanDuration(Duration::from_secs(120))
}

pub(super) fn d_5m() -> HumanDuration {
    HumanDuration(Duration::from_secs(300))
}

pub(super) fn default_outbox_max_attempts() -> u32 {
    10
}

pub(super) fn default_max_event_type_labels() -> u32 {
    32
}

pub(super) fn default_max_waiting() -> u32 {
    256
}

pub(super) fn default_nats_url() -> String {
    "nats://127.0.0.1:4222".into()
}

pub(super) fn default_max_connections() -> u32 {
    16
}

/// `batch_linger` when absent: how long a group's first delivery waits for company while
/// another group of the consumer is running (with none running it starts at once). With 0,
/// a consumer at half its peak ran groups of one or two, each paying a whole transaction, until
/// the CPU ran out and a queue formed (`idemhost bench`, docs/benchmark.md).
pub const DEFAULT_BATCH_LINGER: Duration = Duration::from_millis(2);

pub(super) fn default_batch_linger() -> HumanDuration {
    HumanDuration(DEFAULT_BATCH_LINGER)
}

/// How long a group-commit transaction waits for a lock by default (`batch_lock_timeout`).
/// Far above what a clean group holds its locks for here (a few milliseconds), far below the
/// 1 s `deadlock_timeout` after which the server breaks a deadlock between groups.
pub const DEFAULT_BATCH_LOCK_TIMEOUT: Duration = Duration::from_millis(50);

pub(super) fn default_batch_lock_timeout() -> HumanDuration {
    HumanDuration(DEFAULT_BATCH_LOCK_TIMEOUT)
}

pub(super) fn default_max_in_flight() -> u32 {
    16
}

pub(super) fn default_tx_attempts() -> u32 {
    5
}

pub(super) fn default_max_payload() -> ByteSize {
    ByteSize(8 << 20)
}

pub(super) fn default_id_header() -> String {
    "Nats-Msg-Id".into()
}

pub(super) fn default_keep_resident() -> ByteSize {
    ByteSize(4 << 20)
}

pub(super) fn default_max_upload() -> ByteSize {
    ByteSize(128 << 20)
}

/// The default bound of a compile cache directory's artifacts (`plugins.compile_cache_max`).
pub const DEFAULT_COMPILE_CACHE_MAX: u64 = 512 << 20;

pub(super) fn default_compile_cache_max() -> ByteSize {
    ByteSize(DEFAULT_COMPILE_CACHE_MAX)
}

pub(super) fn default_version_bucket() -> String {
    "idemhost-plugin-versions".into()
}

pub(super) fn default_plugin_history() -> u32 {
    16
}

pub(super) fn d_5s() -> HumanDuration {
    HumanDuration(Duration::from_secs(5))
}

pub(super) fn d_15s() -> HumanDuration {
    HumanDuration(Duration::from_secs(15))
}

pub(super) fn d_60s() -> HumanDuration {
    HumanDuration(Duration::from_secs(60))
}

pub(super) fn default_application_name() -> String {
    "idemhost".into()
}

/// `batch_max` when absent (see [`super::ConsumerConfig::batch_max`]): group commit is the
/// default, and at low load every group is one delivery (a group starts at once while none runs).
pub const DEFAULT_BATCH_MAX: u32 = 16;

pub(super) fn default_max_deliver() -> u32 {
    5
}

pub(super) fn default_backoff() -> Vec<HumanDuration> {
    [100, 1_000, 10_000]
        .map(|ms| HumanDuration(Duration::from_millis(ms)))
        .to_vec()
}

pub(super) fn default_memory_limit() -> ByteSize {
    ByteSize(64 << 20)
}

pub(super) fn default_true() -> bool {
    true
}

pub(super) fn default_object_bucket() -> String {
    "idemhost-plugins".into()
}

pub(super) fn default_outbox_batch() -> u32 {
    256
}

pub(super) fn d_1s() -> HumanDuration {
    HumanDuration(Duration::from_secs(1))
}

pub(super) fn d_10s() -> HumanDuration {
    HumanDuration(Duration::from_secs(10))
}

pub(super) fn d_30s() -> HumanDuration {
    HumanDuration(Duration::from_secs(30))
}

pub(super) fn d_30d() -> HumanDuration {
    HumanDuration(Duration::from_secs(30 * 86_400))
}
