//! The host's configuration: TOML (`idemhost run --config FILE`) with `IDEMHOST_*` environment
//! overrides, validated as a whole before any consumer starts, with errors that name the key.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The NATS server with JetStream.
    #[serde(default)]
    pub nats: NatsConfig,
    /// The PostgreSQL database holding markers and the handlers' business tables.
    pub postgres: PostgresConfig,
    /// Process-wide settings.
    #[serde(default)]
    pub host: HostConfig,
    /// The admin HTTP endpoint.
    #[serde(default)]
    pub admin: AdminConfig,
    /// Hot swap: watching plugin files and the optional shared plugin store.
    #[serde(default)]
    pub plugins: PluginsConfig,
    /// What `/metrics` samples on an interval (broker consumer state, marker table growth).
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// The relay of events handlers publish through the transactional outbox.
    #[serde(default)]
    pub outbox: OutboxConfig,
    /// One entry per logical consumer (`[[consumer]]`).
    #[serde(rename = "consumer", default)]
    pub consumers: Vec<ConsumerConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    /// Server URL, e.g. `nats://127.0.0.1:4222`, or several (a cluster's) comma-separated:
    /// `nats://a:4222,nats://b:4222`; credentials in the URL are redacted in logs.
    #[serde(default = "default_nats_url")]
    pub url: String,
    /// How long the first connection may take before start-up fails.
    #[serde(default = "d_5s")]
    pub connect_timeout: Dur,
    /// How long a JetStream API request (publish, ack confirmation, consumer info) may take.
    #[serde(default = "d_5s")]
    pub request_timeout: Dur,
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig {
            url: default_nats_url(),
            connect_timeout: d_5s(),
            request_timeout: d_5s(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostgresConfig {
    /// Connection URL, e.g. `postgres://app@127.0.0.1:5432/app`.
    pub url: String,
    /// Size of the host's own pool: native handlers' deliveries (each holds one connection),
    /// the outbox relay, samplers, the host's checks. A plugin's deliveries run on a pool of
    /// their own, logged in as the consumer's role, of `max_in_flight` connections: the server
    /// must allow this plus the sum of the plugin consumers' `max_in_flight`.
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// Schema put first on the search path (markers and handler tables live there).
    #[serde(default)]
    pub schema: Option<String>,
    /// How long a delivery waits for a free connection before it fails as retryable.
    #[serde(default = "d_10s")]
    pub acquire_timeout: Dur,
    /// `application_name` of the host's sessions, as `pg_stat_activity` shows it.
    #[serde(default = "default_application_name")]
    pub application_name: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Address for `/healthz`, `/readyz` and `/plugins` (e.g. `127.0.0.1:9464`); absent: no
    /// endpoint.
    #[serde(default)]
    pub listen: Option<String>,
    /// Bearer token the mutating endpoints (plugin deploy and rollback) require. Absent: those
    /// endpoints are disabled. Prefer `IDEMHOST_ADMIN__TOKEN` to writing it in the file.
    #[serde(default)]
    pub token: Option<String>,
    /// Largest component a deploy request may upload.
    #[serde(default = "default_max_upload")]
    pub max_upload: Size,
    /// Connections served at once; more wait in the listen backlog.
    #[serde(default = "default_admin_connections")]
    pub max_connections: u32,
    /// The whole exchange on one connection (one request: head, body and answer) must end
    /// within this; the request head within the smaller of this and 10 s.
    #[serde(default = "default_admin_request_timeout")]
    pub request_timeout: Dur,
}

fn default_admin_connections() -> u32 {
    256
}

fn default_admin_request_timeout() -> Dur {
    // A deploy uploads up to `max_upload` and compiles it within this; the CLI waits 120 s.
    Dur(Duration::from_secs(120))
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: None,
            token: None,
            max_upload: default_max_upload(),
            max_connections: default_admin_connections(),
            request_timeout: default_admin_request_timeout(),
        }
    }
}

/// Where hot swaps come from besides the admin API.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginsConfig {
    /// Swap a consumer's plugin when its `plugin` file is replaced (checked every
    /// `watch_interval`; replace the file by an atomic rename).
    #[serde(default = "default_true")]
    pub watch: bool,
    #[serde(default = "d_1s")]
    pub watch_interval: Dur,
    /// `"nats"`: follow the version pointers in a NATS KV bucket (`plugin deploy --store
    /// nats`), so every replica swaps to the same digest; a pointer present at start-up wins
    /// over the `plugin` file.
    #[serde(default)]
    pub store: Option<PluginStoreKind>,
    /// Object Store bucket holding components by digest.
    #[serde(default = "default_object_bucket")]
    pub object_bucket: String,
    /// KV bucket holding each consumer's current version pointer (key: the consumer name).
    #[serde(default = "default_version_bucket")]
    pub version_bucket: String,
    /// Versions kept per consumer: the KV bucket's history and the list `/plugins` shows.
    #[serde(default = "default_plugin_history")]
    pub history: u32,
    /// Bytes of each pooled instance memory reset in place and kept resident between
    /// deliveries (the rest is returned to the OS). Larger makes interpreters (Python,
    /// JavaScript) fault fewer pages per delivery; it is also what a plugin that grew its
    /// memory leaves resident per pool slot, so it bounds the host's memory after a memory bomb.
    #[serde(default = "default_keep_resident")]
    pub keep_resident: Size,
}

impl Default for PluginsConfig {
    fn default() -> Self {
        PluginsConfig {
            watch: true,
            watch_interval: d_1s(),
            store: None,
            object_bucket: default_object_bucket(),
            version_bucket: default_version_bucket(),
            history: default_plugin_history(),
            keep_resident: default_keep_resident(),
        }
    }
}

/// Sampling intervals of the metrics that need a query.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// How often each consumer's JetStream state (pending, ack-pending, oldest unacknowledged
    /// message) is read: one consumer-info request and one message-header lookup per consumer.
    /// `"0s"` disables it.
    #[serde(default = "d_15s")]
    pub consumer_interval: Dur,
    /// How often marker table growth is sampled (rows and oldest marker per consumer, table
    /// bytes). The row count is an index-only scan of the consumer's markers — its cost grows
    /// with the table (see the README); `"0s"` disables it.
    #[serde(default = "d_60s")]
    pub marker_interval: Dur,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            consumer_interval: d_15s(),
            marker_interval: d_60s(),
        }
    }
}

/// The outbox relay.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutboxConfig {
    /// Run the relay in this process (every replica may: they share the table with `FOR UPDATE
    /// SKIP LOCKED`). It holds one PostgreSQL connection for `LISTEN` besides the pool's.
    #[serde(default = "default_true")]
    pub relay: bool,
    /// Polling interval besides the `LISTEN/NOTIFY` wake-up.
    #[serde(default = "d_1s")]
    pub poll_interval: Dur,
    /// Rows published per relay transaction.
    #[serde(default = "default_outbox_batch")]
    pub batch: u32,
    /// Delay before a row that failed to publish is tried again after its first failure;
    /// doubled at each further failure, up to `retry_cap`. Rows behind it flow meanwhile.
    #[serde(default = "d_1s")]
    pub retry_base: Dur,
    /// The longest delay between two attempts of one row.
    #[serde(default = "d_5m")]
    pub retry_cap: Dur,
    /// Failed attempts after which a row is set aside: the relay leaves it until
    /// `idemhost outbox retry` (it is listed by `idemhost outbox list`, counted by
    /// `idemhost_outbox_set_aside`).
    #[serde(default = "default_outbox_max_attempts")]
    pub max_attempts: u32,
}

fn d_5m() -> Dur {
    Dur(Duration::from_secs(300))
}

fn default_outbox_max_attempts() -> u32 {
    10
}

impl Default for OutboxConfig {
    fn default() -> Self {
        OutboxConfig {
            relay: true,
            poll_interval: d_1s(),
            batch: default_outbox_batch(),
            retry_base: d_1s(),
            retry_cap: d_5m(),
            max_attempts: default_outbox_max_attempts(),
        }
    }
}

/// A shared plugin store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PluginStoreKind {
    Nats,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostConfig {
    /// After SIGTERM/SIGINT, how long in-flight deliveries may take to finish; what is still
    /// running then is rolled back and left unacknowledged (the broker redelivers it).
    #[serde(default = "d_30s")]
    pub shutdown_timeout: Dur,
    /// `text` or `json` log lines (also `--log-format`, `IDEMHOST_LOG_FORMAT`).
    #[serde(default)]
    pub log_format: Option<LogFormat>,
    /// Directory for compiled plugins, keyed by component digest, so a restart skips
    /// compilation (seconds for a Python or JavaScript component). `"off"` disables it.
    /// Default: `$XDG_CACHE_HOME/idemhost/components` or `~/.cache/idemhost/components`; when
    /// that cannot be created (a read-only root filesystem) plugins are compiled in memory.
    #[serde(default)]
    pub compile_cache: Option<PathBuf>,
    /// Debugging aid: log each delivery's payload size and sha256 (never the payload itself).
    #[serde(default)]
    pub log_payload_digest: bool,
}

/// The `host.compile_cache` value that disables the compile cache.
pub const COMPILE_CACHE_OFF: &str = "off";

impl HostConfig {
    /// The compile cache directory this configuration asks for, if any.
    pub fn compile_cache_dir(&self) -> Option<PathBuf> {
        match &self.compile_cache {
            Some(p) if p == Path::new(COMPILE_CACHE_OFF) => None,
            Some(p) => Some(p.clone()),
            None => crate::plugin::default_compile_cache_dir(),
        }
    }
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            shutdown_timeout: d_30s(),
            log_format: None,
            compile_cache: None,
            log_payload_digest: false,
        }
    }
}

/// Transaction isolation of a consumer's deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Isolation {
    #[default]
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

impl Isolation {
    pub fn sql(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "READ COMMITTED",
            Isolation::RepeatableRead => "REPEATABLE READ",
            Isolation::Serializable => "SERIALIZABLE",
        }
    }
}

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
    /// Group commit: up to this many deliveries share one transaction, each behind its own
    /// SAVEPOINT (1: one transaction per delivery). `max_in_flight` then counts transactions.
    #[serde(default = "default_batch_max")]
    pub batch_max: u32,
    /// How long a batch waits for more deliveries after its first one before it starts.
    #[serde(default = "default_batch_linger")]
    pub batch_linger: Dur,
    /// Deliveries of one message before a retryable failure is dead-lettered.
    #[serde(default = "default_max_deliver")]
    pub max_deliver: u32,
    /// Redelivery delay after the n-th failed delivery (the last entry repeats).
    #[serde(default = "default_backoff")]
    pub backoff: Vec<Dur>,
    /// Wall-clock budget of one handler call; past it the plugin is interrupted and the
    /// delivery rolls back as retryable.
    #[serde(default = "d_5s")]
    pub handler_timeout: Dur,
    /// `SET LOCAL statement_timeout` of every statement in a delivery's transaction
    /// (default: `handler_timeout`).
    #[serde(default)]
    pub statement_timeout: Option<Dur>,
    /// Largest payload handled; a larger one is a terminal failure (dead-lettered with the
    /// reason), before any transaction or plugin call.
    #[serde(default = "default_max_payload")]
    pub max_payload: Size,
    /// Memory (all linear memories and tables together) one plugin instance may use.
    #[serde(default = "default_memory_limit")]
    pub memory_limit: Size,
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
    pub ack_wait: Dur,
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
    pub replay_horizon: Dur,
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
    /// Tables (`name` in `postgres.schema`, or `schema.name`) the host grants the plugin's role
    /// SELECT, INSERT, UPDATE and DELETE on at start, with USAGE on the schema's sequences;
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
}

fn default_max_event_type_labels() -> u32 {
    32
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

fn default_max_waiting() -> u32 {
    256
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

    pub fn dead_letter_subject(&self) -> String {
        self.dead_letter_subject
            .clone()
            .unwrap_or_else(|| format!("dlq.{}", self.durable_name()))
    }

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

/// A configuration problem, naming the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("failed to read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid environment override {var}: {message}")]
    Env { var: String, message: String },
    #[error("invalid config: `{key}` {problem}")]
    Invalid { key: String, problem: String },
}

impl Config {
    /// Reads `path`, applies `IDEMHOST_*` overrides from the process environment, validates.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Config::from_toml(&text, std::env::vars(), path, base)
    }

    /// Parses TOML text with overrides from `env`; relative plugin paths resolve against
    /// `base` (the config file's directory).
    pub fn from_toml(
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
        origin: &Path,
        base: &Path,
    ) -> Result<Config, ConfigError> {
        let parse_err = |message: String| ConfigError::Parse {
            path: origin.to_path_buf(),
            message,
        };
        let mut table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| parse_err(one_line(&e, text)))?;
        for (var, value) in env {
            if let Some(path) = var.strip_prefix("IDEMHOST_")
                && path.contains("__")
            {
                apply_override(&mut table, path, &value).map_err(|message| ConfigError::Env {
                    var: var.clone(),
                    message,
                })?;
            }
        }
        let mut config: Config = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| parse_err(one_line(&e, text)))?;
        for c in &mut config.consumers {
            if let Some(p) = &c.plugin
                && p.is_relative()
            {
                c.plugin = Some(base.join(p));
            }
        }
        if let Some(p) = &config.host.compile_cache
            && p.is_relative()
            && p != Path::new(COMPILE_CACHE_OFF)
        {
            config.host.compile_cache = Some(base.join(p));
        }
        config.validate()?;
        Ok(config)
    }
}

/// A TOML error on one line: its message, and where in `text` when it knows (`line L, column
/// C`), instead of the multi-line snippet of its `Display`.
fn one_line(e: &toml::de::Error, text: &str) -> String {
    let message = e.message().split_whitespace().collect::<Vec<_>>().join(" ");
    match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!("{message} (line {line}, column {column})")
        }
        None => e
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
    }
}

/// Sets `table[a][b]...` from `IDEMHOST_A__B...`; a numeric segment indexes an array of
/// tables (`IDEMHOST_CONSUMER__0__MAX_IN_FLIGHT=4`). Values parse as TOML (numbers, booleans,
/// arrays) and fall back to a plain string.
fn apply_override(table: &mut toml::Table, path: &str, raw: &str) -> Result<(), String> {
    let segments: Vec<String> = path.split("__").map(|s| s.to_ascii_lowercase()).collect();
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.to_string())),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    set_path(table, &segments, value)
}

fn set_path(
    table: &mut toml::Table,
    segments: &[String],
    value: toml::Value,
) -> Result<(), String> {
    let (first, rest) = segments.split_first().ok_or("empty key")?;
    if rest.is_empty() {
        table.insert(first.clone(), value);
        return Ok(());
    }
    match table
        .entry(first.clone())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
    {
        toml::Value::Table(t) => set_path(t, rest, value),
        toml::Value::Array(items) => {
            let (idx, rest) = rest.split_first().ok_or("missing index")?;
            let idx: usize = idx
                .parse()
                .map_err(|_| format!("`{first}` is a list: `{idx}` is not an index"))?;
            let len = items.len();
            match items.get_mut(idx) {
                Some(toml::Value::Table(t)) if !rest.is_empty() => set_path(t, rest, value),
                Some(_) => Err(format!("`{first}` entry {idx} needs a key after the index")),
                None => Err(format!(
                    "index {idx} of `{first}` is out of range ({len} entries)"
                )),
            }
        }
        _ => Err(format!("`{first}` is not a table")),
    }
}

/// A duration written as a human string (`"250ms"`, `"5s"`, `"2m"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s)
            .map(Dur)
            .map_err(|e| serde::de::Error::custom(format!("invalid duration {s:?}: {e}")))
    }
}

/// A size written as a human string (`"64MiB"`, `"512KiB"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_size(&s).map(Size).map_err(serde::de::Error::custom)
    }
}

/// Bytes in a human size string (`"64MiB"`, `"512KiB"`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    s.parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| format!("invalid size {s:?}: {e}"))
}

fn default_nats_url() -> String {
    "nats://127.0.0.1:4222".into()
}
fn default_application_name() -> String {
    "idemhost".into()
}
fn default_max_connections() -> u32 {
    16
}
fn default_batch_max() -> u32 {
    1
}

fn default_batch_linger() -> Dur {
    Dur(Duration::from_millis(2))
}

fn default_max_in_flight() -> u32 {
    16
}
fn default_max_deliver() -> u32 {
    5
}
fn default_tx_attempts() -> u32 {
    5
}
fn default_backoff() -> Vec<Dur> {
    [100, 1_000, 10_000]
        .map(|ms| Dur(Duration::from_millis(ms)))
        .to_vec()
}
fn default_max_payload() -> Size {
    Size(8 << 20)
}
fn default_memory_limit() -> Size {
    Size(64 << 20)
}
fn default_id_header() -> String {
    "Nats-Msg-Id".into()
}
fn default_true() -> bool {
    true
}
fn default_keep_resident() -> Size {
    Size(4 << 20)
}

fn default_max_upload() -> Size {
    Size(128 << 20)
}
fn default_object_bucket() -> String {
    "idemhost-plugins".into()
}
fn default_version_bucket() -> String {
    "idemhost-plugin-versions".into()
}
fn default_outbox_batch() -> u32 {
    256
}
fn default_plugin_history() -> u32 {
    16
}
fn d_1s() -> Dur {
    Dur(Duration::from_secs(1))
}
fn d_5s() -> Dur {
    Dur(Duration::from_secs(5))
}
fn d_10s() -> Dur {
    Dur(Duration::from_secs(10))
}
fn d_15s() -> Dur {
    Dur(Duration::from_secs(15))
}
fn d_30s() -> Dur {
    Dur(Duration::from_secs(30))
}
fn d_60s() -> Dur {
    Dur(Duration::from_secs(60))
}
fn d_30d() -> Dur {
    Dur(Duration::from_secs(30 * 86_400))
}

mod validate;

#[cfg(test)]
mod tests;
