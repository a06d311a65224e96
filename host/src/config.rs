//! The host's configuration: TOML (`idemhost run --config FILE`) with `IDEMHOST_*` environment
//! overrides, validated as a whole before any consumer starts, with errors that name the key.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};

mod consumer;
mod defaults;
pub(crate) mod postgres_url;

pub use consumer::{
    ConsumerConfig, KeySpec, MAX_MESSAGE_ID_BYTES, MAX_PLUGIN_CONFIG_ENTRIES,
    MAX_PLUGIN_CONFIG_VALUE, OrderingConfig, is_kv_key, is_plain_identifier,
};
use defaults::*;
pub use defaults::{
    DEFAULT_BATCH_LINGER, DEFAULT_BATCH_LOCK_TIMEOUT, DEFAULT_BATCH_MAX, DEFAULT_COMPILE_CACHE_MAX,
};

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

/// `[nats]`: the broker connection.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    /// Server URL, e.g. `nats://127.0.0.1:4222`, or several (a cluster's) comma-separated:
    /// `nats://a:4222,nats://b:4222`; credentials in the URL are redacted in logs.
    #[serde(default = "default_nats_url")]
    pub url: String,
    /// How long the first connection may take before start-up fails.
    #[serde(default = "d_5s")]
    pub connect_timeout: HumanDuration,
    /// How long a JetStream API request (publish, ack confirmation, consumer info) may take.
    #[serde(default = "d_5s")]
    pub request_timeout: HumanDuration,
    /// The prefix of the host's reply subjects (its pull requests', acks' and API requests'
    /// answers). NATS's default, `_INBOX`, is every client's: give the host one of its own
    /// (`idemhost_inbox`) and its user may subscribe to exactly that while producers are denied
    /// it, so no producer can publish into the host's pull inboxes.
    #[serde(default = "default_inbox_prefix")]
    pub inbox_prefix: String,
}

/// NATS's own inbox prefix.
fn default_inbox_prefix() -> String {
    "_INBOX".into()
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig {
            url: default_nats_url(),
            connect_timeout: d_5s(),
            request_timeout: d_5s(),
            inbox_prefix: default_inbox_prefix(),
        }
    }
}

/// `[postgres]`: the database and the host's pool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostgresConfig {
    /// Connection URL, e.g. `postgres://app@127.0.0.1:5432/app`. Several servers as libpq
    /// writes them: `postgres://app@db1:5432,db2:5432/app?target_session_attrs=read-write` (the
    /// host uses the first that offers such a session and follows the primary when it moves).
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
    pub acquire_timeout: HumanDuration,
    /// `application_name` of the host's sessions, as `pg_stat_activity` shows it.
    #[serde(default = "default_application_name")]
    pub application_name: String,
    /// With several servers in `url` (or a `target_session_attrs`): how often the host asks the
    /// one in use whether it still offers the session asked for, and looks for the one that
    /// does when not (see `pg::failover`).
    #[serde(default = "d_1s")]
    pub failover_check_interval: HumanDuration,
    /// How long, at most, a delivery whose attempt failed because the server went away or
    /// stopped taking writes (a restart, a failover, a lost connection) waits in place for a
    /// server that takes writes, and then runs again **without counting an attempt** toward
    /// `max_deliver`. The host checks first that the server is really unavailable (one that
    /// answers as a writable primary at once means the failure was this session's: it counts).
    /// Past it the failure counts as a retryable attempt. `0s`: every such failure counts.
    #[serde(default = "d_60s")]
    pub failover_wait: HumanDuration,
}

/// `[admin]`: the health, metrics and plugin endpoint.
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
    pub max_upload: ByteSize,
    /// Connections served at once; more wait in the listen backlog.
    #[serde(default = "default_admin_connections")]
    pub max_connections: u32,
    /// The whole exchange on one connection (one request: head, body and answer) must end
    /// within this; the request head within the smaller of this and 10 s.
    #[serde(default = "default_admin_request_timeout")]
    pub request_timeout: HumanDuration,
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
    /// How often the `plugin` files are checked for a replacement.
    #[serde(default = "d_1s")]
    pub watch_interval: HumanDuration,
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
    pub keep_resident: ByteSize,
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

/// Where `/metrics` is served besides the admin endpoint, and the sampling intervals of the
/// metrics that need a query.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// A listener of its own for `GET /metrics`, `/healthz` and `/readyz`, e.g. `0.0.0.0:9465`:
    /// scrape and probe there and keep `admin.listen`, which can deploy plugins, on a private
    /// address. The admin endpoint serves them too. Absent: no separate listener.
    #[serde(default)]
    pub listen: Option<String>,
    /// How often each consumer's JetStream state (pending, ack-pending, oldest unacknowledged
    /// message) is read: one consumer-info request and one message-header lookup per consumer.
    /// `"0s"` disables it.
    #[serde(default = "d_15s")]
    pub consumer_interval: HumanDuration,
    /// How often marker table growth is sampled (rows and oldest marker per consumer, table
    /// bytes). The row count is an index-only scan of the consumer's markers — its cost grows
    /// with the table (see docs/operations.md, Metrics); `"0s"` disables it.
    #[serde(default = "d_60s")]
    pub marker_interval: HumanDuration,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: None,
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
    pub poll_interval: HumanDuration,
    /// Rows of one consumer published per relay pass (one transaction for all consumers').
    #[serde(default = "default_outbox_batch")]
    pub batch: u32,
    /// Delay before a row that failed to publish is tried again after its first failure;
    /// doubled at each further failure, up to `retry_cap`. Rows behind it flow meanwhile.
    #[serde(default = "d_1s")]
    pub retry_base: HumanDuration,
    /// The longest delay between two attempts of one row.
    #[serde(default = "d_5m")]
    pub retry_cap: HumanDuration,
    /// Failed attempts after which a row is set aside: the relay leaves it until
    /// `idemhost outbox retry` (it is listed by `idemhost outbox list`, counted by
    /// `idemhost_outbox_set_aside`).
    #[serde(default = "default_outbox_max_attempts")]
    pub max_attempts: u32,
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PluginStoreKind {
    /// A NATS object store (`plugins.store = "nats"`).
    Nats,
}

impl std::str::FromStr for PluginStoreKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "nats" => Ok(PluginStoreKind::Nats),
            _ => Err(format!("unknown plugin store {s:?} (known: nats)")),
        }
    }
}

/// `[host]`: the process: shutdown, logs, the compile cache.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostConfig {
    /// After SIGTERM/SIGINT, how long in-flight deliveries may take to finish; what is still
    /// running then is rolled back and left unacknowledged (the broker redelivers it).
    #[serde(default = "d_30s")]
    pub shutdown_timeout: HumanDuration,
    /// `text` or `json` log lines (also `--log-format`, `IDEMHOST_LOG_FORMAT`).
    #[serde(default)]
    pub log_format: Option<LogFormat>,
    /// Directory for compiled plugins, keyed by component digest, so a restart skips
    /// compilation (seconds for a Python or JavaScript component). `"off"` disables it.
    /// Default: `$XDG_CACHE_HOME/idemhost/components` or `~/.cache/idemhost/components`; when
    /// that cannot be created (a read-only root filesystem) plugins are compiled in memory.
    #[serde(default)]
    pub compile_cache: Option<PathBuf>,
    /// The compile cache's bound: past it, the artifacts used least recently are removed (an
    /// interpreter-sized plugin compiles to ~35 MB), except those used in the last hour (by
    /// this process or another sharing the directory), so the bound is soft by that much.
    #[serde(default = "default_compile_cache_max")]
    pub compile_cache_max: ByteSize,
    /// Debugging aid: log each delivery's payload size and sha256 (never the payload itself).
    #[serde(default)]
    pub log_payload_digest: bool,
    /// This replica's number, `0..replicas` (with `replicas`; a StatefulSet's pod index, e.g.
    /// `IDEMHOST_HOST__REPLICA`). With both set, consumers with `partitions` spread them over
    /// the replicas (NATS 2.12+): each pulls its own share first, and the others' only while
    /// no replica ranked above it is pulling (see docs/scaling.md).
    #[serde(default)]
    pub replica: Option<u32>,
    /// How many replicas share the partitioned consumers (with `replica`).
    #[serde(default)]
    pub replicas: Option<u32>,
}

/// Where compiled plugins are kept unless `host.compile_cache` says otherwise:
/// `$XDG_CACHE_HOME/idemhost/components`, else `$HOME/.cache/idemhost/components`.
pub fn default_compile_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })?;
    Some(base.join("idemhost").join("components"))
}

/// The `host.compile_cache` value that disables the compile cache.
pub const COMPILE_CACHE_OFF: &str = "off";

impl HostConfig {
    /// The compile cache directory this configuration asks for, if any.
    pub fn compile_cache_dir(&self) -> Option<PathBuf> {
        match &self.compile_cache {
            Some(p) if p == Path::new(COMPILE_CACHE_OFF) => None,
            Some(p) => Some(p.clone()),
            None => default_compile_cache_dir(),
        }
    }
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!("unknown log format {s:?} (known: text, json)")),
        }
    }
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            shutdown_timeout: d_30s(),
            log_format: None,
            compile_cache: None,
            compile_cache_max: default_compile_cache_max(),
            log_payload_digest: false,
            replica: None,
            replicas: None,
        }
    }
}

/// Transaction isolation of a consumer's deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Isolation {
    /// `read-committed` (the default): a competing claim waits for the winner, then sees its marker.
    #[default]
    ReadCommitted,
    /// `repeatable-read`: a concurrent update is a serialization failure, retried whole.
    RepeatableRead,
    /// `serializable`: as repeatable read, and every anomaly is a serialization failure.
    Serializable,
}

impl Isolation {
    /// The level as `BEGIN ISOLATION LEVEL` spells it.
    pub fn sql(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "READ COMMITTED",
            Isolation::RepeatableRead => "REPEATABLE READ",
            Isolation::Serializable => "SERIALIZABLE",
        }
    }
}

/// A configuration problem, naming the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read. (The cause is this error's source: an error chain printed
    /// with `{:#}` shows it once.)
    #[error("failed to read config file {path}{}", read_hint(source))]
    Read {
        /// The configuration file.
        path: PathBuf,
        /// Why it could not be read.
        source: std::io::Error,
    },
    /// The file is not valid TOML for the configuration.
    #[error("invalid config {path}: {message}")]
    Parse {
        /// The configuration file.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// An `IDEMHOST_*` environment override is invalid.
    #[error("invalid environment override {var}: {message}")]
    Env {
        /// The variable.
        var: String,
        /// What is wrong with its value.
        message: String,
    },
    /// A key's value is refused by validation.
    #[error("invalid config: `{key}` {problem}")]
    Invalid {
        /// The key, as written in the file.
        key: String,
        /// What is wrong with it.
        problem: String,
    },
}

/// The error `e` of a configuration with the file's `text` and `overrides` applied, as the
/// operator can act on it: when the key it is about was set by an override, and the
/// configuration without that override does not fail so, the variable is named; otherwise the
/// file is, with the line and column its own parse points at. An unknown key gets the nearest
/// known one.
fn blame(
    e: &toml::de::Error,
    text: &str,
    origin: &Path,
    overrides: &[(String, String)],
    without: impl Fn(usize) -> Option<toml::Value>,
) -> ConfigError {
    let message = suggest(&one_line(e, text));
    // serde names the key last: "... in `consumer.handler_timeout`".
    let key = message
        .rsplit_once(" in `")
        .and_then(|(_, k)| k.strip_suffix('`'))
        .unwrap_or("");
    let culprit = overrides.iter().enumerate().find(|(i, (var, _))| {
        let path: Vec<String> = var["IDEMHOST_".len()..]
            .split("__")
            .filter(|s| s.parse::<usize>().is_err())
            .map(str::to_ascii_lowercase)
            .collect();
        let path = path.join(".");
        let about = !key.is_empty() && (key == path || key.starts_with(&format!("{path}.")));
        about
            && without(*i).is_some_and(|v| {
                v.try_into::<Config>()
                    .err()
                    .is_none_or(|f| suggest(&one_line(&f, text)) != message)
            })
    });
    if let Some((_, (var, _))) = culprit {
        return ConfigError::Env {
            var: var.clone(),
            message,
        };
    }
    // The file's own mistake: parsed from the text, the error carries its place.
    let place = match toml::from_str::<Config>(text) {
        Err(f) => place(&f, text),
        Ok(_) => None,
    };
    let message = match place {
        Some(place) if !message.contains(" (line ") => format!("{message} ({place})"),
        _ => message,
    };
    ConfigError::Parse {
        path: origin.to_path_buf(),
        message,
    }
}

/// `message` with the nearest expected key named after an unknown one ("unknown field `x`,
/// expected one of `a`, `b`" from serde), when one is near enough to be a typo.
fn suggest(message: &str) -> String {
    let Some(rest) = message.strip_prefix("unknown field `") else {
        return message.to_string();
    };
    let Some((unknown, expected)) = rest.split_once('`') else {
        return message.to_string();
    };
    let nearest = expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|known| (edit_distance(unknown, known), known))
        .min();
    match nearest {
        Some((d, known)) if d <= (unknown.len() / 3).max(1) => {
            format!("unknown field `{unknown}` (did you mean `{known}`?){expected}")
        }
        _ => message.to_string(),
    }
}

/// Levenshtein distance between two short keys.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// `IDEMHOST_*` variables that look like configuration overrides but are not read as one: a
/// section and key joined by one underscore (`IDEMHOST_POSTGRES_URL`) where an override takes
/// two (`IDEMHOST_POSTGRES__URL`). One warning each, for the host to log.
pub fn unread_overrides(env: impl IntoIterator<Item = (String, String)>) -> Vec<String> {
    const SECTIONS: &[&str] = &[
        "nats", "postgres", "host", "admin", "plugins", "metrics", "outbox", "consumer",
    ];
    let mut warnings: Vec<String> = env
        .into_iter()
        .filter_map(|(var, _)| {
            let rest = var.strip_prefix("IDEMHOST_")?;
            if rest.contains("__") {
                return None;
            }
            let lower = rest.to_ascii_lowercase();
            let section = SECTIONS
                .iter()
                .find(|s| lower.strip_prefix(**s).is_some_and(|r| r.starts_with('_')))?;
            let meant = format!("IDEMHOST_{}__{}", &rest[..section.len()], &rest[section.len() + 1..]);
            Some(format!(
                "{var} is not read: an override joins section and key with two underscores ({meant})"
            ))
        })
        .collect();
    warnings.sort();
    warnings
}

/// Where in `text` the error `e` points: "line L, column C".
fn place(e: &toml::de::Error, text: &str) -> Option<String> {
    let span = e.span()?;
    let before = &text[..span.start.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    Some(format!("line {line}, column {column}"))
}

/// What to do when the config file cannot be read, after its path.
fn read_hint(error: &std::io::Error) -> &'static str {
    match error.kind() {
        std::io::ErrorKind::NotFound => {
            " (no such file: give --config the path of an idemhost.toml; docs/configuration.md shows one)"
        }
        std::io::ErrorKind::PermissionDenied => " (the host's user may not read it)",
        _ => "",
    }
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
        let file: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| parse_err(one_line(&e, text)))?;
        let overrides: Vec<(String, String)> = env
            .into_iter()
            .filter(|(var, _)| {
                var.strip_prefix("IDEMHOST_")
                    .is_some_and(|p| p.contains("__"))
            })
            .collect();
        // The file with every override applied but the one at `skip` (none: all of them).
        let overridden = |skip: Option<usize>| -> Result<toml::Table, ConfigError> {
            let mut table = file.clone();
            let applied = overrides
                .iter()
                .enumerate()
                .filter(|(i, _)| Some(*i) != skip);
            for (_, (var, value)) in applied {
                let path = &var["IDEMHOST_".len()..];
                apply_override(&mut table, path, value).map_err(|message| ConfigError::Env {
                    var: var.clone(),
                    message,
                })?;
            }
            Ok(table)
        };
        let mut config: Config = match toml::Value::Table(overridden(None)?).try_into() {
            Ok(config) => config,
            Err(e) => {
                return Err(blame(&e, text, origin, &overrides, |i| {
                    overridden(Some(i)).ok().map(toml::Value::Table)
                }));
            }
        };
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
    match place(e, text) {
        Some(place) => format!("{message} ({place})"),
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
pub struct HumanDuration(pub Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s)
            .map(HumanDuration)
            .map_err(|e| serde::de::Error::custom(format!("invalid duration {s:?}: {e}")))
    }
}

/// A size written as a human string (`"64MiB"`, `"512KiB"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_size(&s)
            .map(ByteSize)
            .map_err(serde::de::Error::custom)
    }
}

/// Bytes in a human size string (`"64MiB"`, `"512KiB"`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    s.parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| format!("invalid size {s:?}: {e}"))
}

mod validate;

#[cfg(test)]
mod tests;
