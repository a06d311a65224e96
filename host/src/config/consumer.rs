//! One `[[consumer]]`: what it consumes, how its deliveries run, and the plugin's limits and
//! grants.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::defaults::*;
use super::{ByteSize, HumanDuration, Isolation};

/// One `[[consumers]]` entry: a durable consumer, its handler and its transaction.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsumerConfig {
    /// Stable logical consumer name: the marker's `consumer_name`. Never a pod or host id;
    /// changing it is a deliberate replay of everything the stream still holds.
    pub name: String,
    /// JetStream stream to consume.
    pub stream: String,
    /// Subjects to consume (the consumer's filter); empty means the whole stream. With
    /// `create_stream`, also the stream's subjects.
    #[serde(default)]
    pub subjects: Vec<String>,
    /// Per-key order across replicas (NATS 2.11 or newer): the stream's messages carry a
    /// partition number, `0..partitions`, as the last token of their subject (a subject
    /// transform `{{partition(N, …)}}` puts it there; `create_stream` sets one up). The host
    /// binds one durable per partition, `<durable>-p<n>` filtered on `<subject>.<n>`, each in a
    /// `pinned_client` priority group: one replica at a time consumes a partition, and another
    /// takes it over when that replica stops pulling. 0: off.
    #[serde(default)]
    pub partitions: u32,
    /// The handler component (`.wasm`). May be omitted only when an embedding program
    /// registers a native handler under this consumer's name.
    #[serde(default)]
    pub plugin: Option<PathBuf>,
    /// `read-committed` (default), `repeatable-read` or `serializable`.
    #[serde(default)]
    pub isolation: Isolation,
    /// Deliveries handled at once (each holds one PostgreSQL connection).
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: u32,
    /// Group commit: up to this many deliveries share one transaction (1: one transaction per
    /// delivery). `max_in_flight` then counts transactions. Absent: 16, or 1 with `ordering`
    /// or `partitions` (see [`ConsumerConfig::batch_max`]).
    #[serde(default, rename = "batch_max")]
    pub batch_max_set: Option<u32>,
    /// How long a group waits for more deliveries after its first one before it starts (0: a
    /// group holds what is waiting when a transaction is free).
    #[serde(default = "default_batch_linger")]
    pub batch_linger: HumanDuration,
    /// The longest a group-commit transaction waits for a row or table lock; past it the group
    /// is sent back one delivery at a time (0: as long as the server lets it).
    #[serde(default = "default_batch_lock_timeout")]
    pub batch_lock_timeout: HumanDuration,
    /// Deliveries of one message before a retryable failure is dead-lettered.
    #[serde(default = "default_max_deliver")]
    pub max_deliver: u32,
    /// Redelivery delay after the n-th failed delivery (the last entry repeats).
    #[serde(default = "default_backoff")]
    pub backoff: Vec<HumanDuration>,
    /// Wall-clock budget of one handler call; past it the plugin is interrupted and the
    /// delivery rolls back as retryable.
    #[serde(default = "d_5s")]
    pub handler_timeout: HumanDuration,
    /// `SET LOCAL statement_timeout` of every statement in a delivery's transaction
    /// (default: `handler_timeout`).
    #[serde(default)]
    pub statement_timeout: Option<HumanDuration>,
    /// Largest payload handled; a larger one is a terminal failure (dead-lettered with the
    /// reason), before any transaction or plugin call.
    #[serde(default = "default_max_payload")]
    pub max_payload: ByteSize,
    /// Memory (all linear memories and tables together) one plugin instance may use.
    #[serde(default = "default_memory_limit")]
    pub memory_limit: ByteSize,
    /// Subject that receives terminal and out-of-attempts messages, with the original id,
    /// headers and payload plus `Idemhost-Failure-Reason`. Default `dlq.<name>`. Some stream
    /// must capture it (with `create_stream`, the host creates one).
    #[serde(default)]
    pub dead_letter_subject: Option<String>,
    /// Create the stream (and a dead-letter stream) when missing, instead of failing; add
    /// this consumer's subjects to the stream when it lacks them (consumers sharing a stream).
    #[serde(default)]
    pub create_stream: bool,
    /// Header holding the producer's stable message id. `Idemhost-Message-Id`, set by
    /// dead-letter replays, is read first.
    #[serde(default = "default_id_header")]
    pub id_header: String,
    /// How long JetStream waits for an ack before redelivering; the host sends in-progress
    /// acks every third of it while a delivery runs.
    #[serde(default = "d_30s")]
    pub ack_wait: HumanDuration,
    /// Attempts of the whole transaction (claim included) on serialization failure or
    /// deadlock, before the delivery is nak'ed.
    #[serde(default = "default_tx_attempts")]
    pub tx_max_attempts: u32,
    /// Durable consumer name; default derived from `name` (characters JetStream refuses
    /// become `_`).
    #[serde(default)]
    pub durable: Option<String>,
    /// How far back messages of this consumer may still be replayed (from the stream, its
    /// dead letters, an archive or a disaster-recovery copy). `markers prune` refuses to delete
    /// markers younger than this: a replayed message whose marker is gone would apply twice.
    #[serde(default = "d_30d")]
    pub replay_horizon: HumanDuration,
    /// SQL proving a message's business effect, for `idemhost check`: `$1` is the message id
    /// (or the `--effect-param` given); one or more rows means the effect exists.
    #[serde(default)]
    pub effect_query: Option<String>,
    /// PostgreSQL role the plugin's connections log in as: its SQL can reach only what this
    /// role was granted, and no statement can make it act as another role. Absent: the host
    /// derives `idemhost_<schema>_<name>` and creates it (if its own role may create roles;
    /// otherwise it refuses to start and prints what to run). The host refuses a role that is a
    /// superuser, may create roles or databases, bypasses RLS, replicates, is a member of a
    /// role that may, owns or may touch the host's tables. See SECURITY.md.
    #[serde(default)]
    pub role: Option<String>,
    /// Password of `role`, when the server asks for one (`IDEMHOST_CONSUMER__<i>__ROLE_PASSWORD`).
    /// The host's own password is never sent for the plugin's role.
    #[serde(default)]
    pub role_password: Option<String>,
    /// Settings of the plugin's role (`ALTER ROLE … SET`, applied at start), over the host's
    /// defaults: `temp_file_limit = "1GB"` (temp files of one session), `work_mem = "4MB"`
    /// (per sort or hash), `log_min_messages = "fatal"` (the server does not log the errors
    /// a plugin causes: their text quotes its values, megabytes of them), `jit = "off"` (a JIT
    /// compile checks no cancellation). A value `"default"`
    /// leaves that setting to the server. `temp_file_limit` and `log_min_messages` need a
    /// superuser host (or `GRANT SET ON PARAMETER`); otherwise the host warns at start with the
    /// statement to run.
    #[serde(default)]
    pub role_settings: std::collections::BTreeMap<String, String>,
    /// Tables (`name` in `postgres.schema`, or `schema.name`) the host grants the plugin's role
    /// SELECT, INSERT, UPDATE and DELETE on at start, with USAGE on their own sequences;
    /// `"*"`: every table of `postgres.schema` that exists at start, except the host's own.
    /// Grant anything else yourself.
    #[serde(default)]
    pub tables: Vec<String>,
    /// Subjects the plugin may publish to through the outbox (NATS patterns: `*` one token,
    /// `>` the rest). Empty: the plugin may not publish. `$`-subjects (JetStream API, KV,
    /// object store) are refused whatever this says.
    #[serde(default)]
    pub publish_subjects: Vec<String>,
    /// Per-key ordering within this process: deliveries with the same key run one at a time in
    /// arrival (stream) order; a retryable failure is retried in place and blocks only its key.
    #[serde(default)]
    pub ordering: Option<OrderingConfig>,
    /// Values of the `event_type` label of `idemhost_deliveries_total` (the event type comes
    /// from a producer's header or the subject, so it is input): these, and every other value
    /// counts as `other`. Empty: the first `max_event_type_labels` distinct values seen.
    #[serde(default)]
    pub event_type_labels: Vec<String>,
    /// How many distinct `event_type` label values one consumer's metrics keep when
    /// `event_type_labels` is empty; later values count as `other`.
    #[serde(default = "default_max_event_type_labels")]
    pub max_event_type_labels: u32,
    /// The plugin's settings (`[consumer.config]`): thresholds, feature flags, names, which a
    /// WIT 0.2.0 plugin reads through its `config` interface. Values are strings (a number or
    /// a boolean is read as its text). Not for secrets: `plugin test`, `plugin diff` and the
    /// plugin itself see them. At most [`MAX_PLUGIN_CONFIG_ENTRIES`] keys (1-64 characters of
    /// A-Z, a-z, 0-9, `_`, `-`, `.`), values at most [`MAX_PLUGIN_CONFIG_VALUE`] bytes.
    #[serde(default, deserialize_with = "plugin_config")]
    pub config: std::collections::BTreeMap<String, String>,
}

/// Keys a consumer's `config` table may hold.
pub const MAX_PLUGIN_CONFIG_ENTRIES: usize = 64;
/// Bytes of one `config` value.
pub const MAX_PLUGIN_CONFIG_VALUE: usize = 4096;

/// A `config` table whose values may be written as strings, numbers or booleans.
fn plugin_config<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<std::collections::BTreeMap<String, String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Scalar {
        Text(String),
        Int(i64),
        Float(f64),
        Bool(bool),
    }
    let table = std::collections::BTreeMap::<String, Scalar>::deserialize(d)?;
    Ok(table
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                Scalar::Text(s) => s,
                Scalar::Int(i) => i.to_string(),
                Scalar::Float(f) => f.to_string(),
                Scalar::Bool(b) => b.to_string(),
            };
            (k, v)
        })
        .collect())
}

/// `ordering = { key = "header:Idemhost-Ordering-Key" }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrderingConfig {
    /// `header:NAME`, `subject:N` (a 0-based subject token) or `json:/pointer` (payload field).
    pub key: String,
    /// Messages that may wait behind a running delivery of their key without holding a pull
    /// credit (the host holds them in memory: at most this many times `max_payload`). Beyond
    /// it, waiting messages keep their credits and the consumer pulls more slowly.
    #[serde(default = "default_max_waiting")]
    pub max_waiting: u32,
}

/// Whether `key` is a valid NATS KV key (the consumer name keys the plugin version pointer).
pub fn is_kv_key(key: &str) -> bool {
    !key.is_empty()
        && !key.starts_with('.')
        && !key.ends_with('.')
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-/_=.".contains(c))
}

/// A lower-case SQL identifier that needs no quoting care: a-z, 0-9 and `_`, not starting with a
/// digit, at most 63 bytes (schema and role names).
pub fn is_plain_identifier(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// Longest message id accepted (bytes); longer ids are terminal.
pub const MAX_MESSAGE_ID_BYTES: usize = 256;

impl ConsumerConfig {
    /// Deliveries that may share one transaction: `batch_max` as configured, else 16 — or 1
    /// for a consumer with `ordering` or `partitions`, whose order rules are per delivery.
    pub fn batch_max(&self) -> u32 {
        self.batch_max_set
            .unwrap_or(if self.ordering.is_some() || self.partitions > 0 {
                1
            } else {
                DEFAULT_BATCH_MAX
            })
    }

    /// Every durable consumer this consumer pulls from: its one, or with `partitions` one per
    /// partition, `<durable>-p<n>`.
    pub fn durables(&self) -> Vec<String> {
        match self.partitions {
            0 => vec![self.durable_name()],
            n => (0..n).map(|p| self.partition_durable(p)).collect(),
        }
    }

    /// The durable of partition `p` (`partitions`): `<durable>-p<p>`.
    pub fn partition_durable(&self, p: u32) -> String {
        format!("{}-p{p}", self.durable_name())
    }

    /// The JetStream durable: `durable`, else the name with every character other than `[A-Za-z0-9_-]` as `_`.
    pub fn durable_name(&self) -> String {
        self.durable.clone().unwrap_or_else(|| {
            self.name
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect()
        })
    }

    /// Where refused and exhausted messages go: `dead_letter_subject`, else `dlq.<durable>`.
    pub fn dead_letter_subject(&self) -> String {
        self.dead_letter_subject
            .clone()
            .unwrap_or_else(|| format!("dlq.{}", self.durable_name()))
    }

    /// `statement_timeout`, else `handler_timeout`.
    pub fn statement_timeout(&self) -> Duration {
        self.statement_timeout.unwrap_or(self.handler_timeout).0
    }

    /// Redelivery delay after failed delivery number `attempt` (1-based).
    pub fn backoff_for(&self, attempt: u32) -> Duration {
        let i = (attempt.max(1) as usize - 1).min(self.backoff.len().saturating_sub(1));
        self.backoff
            .get(i)
            .map(|d| d.0)
            .unwrap_or(Duration::from_secs(1))
    }
}

/// Where a message's ordering key is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySpec {
    /// `header:NAME`
    Header(String),
    /// `subject:N`: the N-th token of the subject (0-based).
    SubjectToken(usize),
    /// `json:/pointer`: a JSON pointer into the payload (strings and numbers).
    JsonPointer(String),
}

impl KeySpec {
    /// Parses `ordering.key`: `header:NAME`, `subject:N` or `json:/pointer`.
    pub fn parse(spec: &str) -> Result<KeySpec, String> {
        let bad = || {
            format!(
                "{spec:?} is not an ordering key: use header:NAME, subject:N (a 0-based token) or json:/pointer"
            )
        };
        match spec.split_once(':') {
            Some(("header", name)) if !name.is_empty() && !name.contains(char::is_whitespace) => {
                Ok(KeySpec::Header(name.to_string()))
            }
            Some(("subject", n)) => n.parse().map(KeySpec::SubjectToken).map_err(|_| bad()),
            Some(("json", pointer)) if pointer.starts_with('/') => {
                Ok(KeySpec::JsonPointer(pointer.to_string()))
            }
            _ => Err(bad()),
        }
    }
}
