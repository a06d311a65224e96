//! Validation of a parsed configuration: every rule that needs no server, checked before any
//! consumer starts; the first violation names its key.

use std::collections::HashSet;
use std::time::Duration;

use super::{Config, ConfigError, is_kv_key, postgres_url};

/// The most replicas `host.replicas` may name.
const MAX_REPLICAS: u32 = 1000;

impl Config {
    /// Checks every rule that does not need a server; the first violation names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: String, problem: &str| {
            Err(ConfigError::Invalid {
                key,
                problem: problem.to_string(),
            })
        };
        if self
            .nats
            .url
            .split(',')
            .any(|u| url::Url::parse(u.trim()).is_err())
        {
            return bad(
                "nats.url".into(),
                "is not a URL (several servers: comma-separated URLs)",
            );
        }
        let prefix = &self.nats.inbox_prefix;
        if prefix.starts_with('$')
            || prefix.split('.').any(|t| {
                t.is_empty()
                    || !t
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            })
        {
            return bad(
                "nats.inbox_prefix".into(),
                "must be subject tokens of A-Z, a-z, 0-9, _ and - separated by '.', not \
                 starting with '$' (no wildcards)",
            );
        }
        if !self.postgres.url.starts_with("postgres://")
            && !self.postgres.url.starts_with("postgresql://")
        {
            return bad(
                "postgres.url".into(),
                "must start with postgres:// or postgresql://",
            );
        }
        if let Err(e) = postgres_url::Servers::parse(&self.postgres.url) {
            // The error names the key and shows the URL redacted.
            return bad("postgres.url".into(), &e.to_string());
        }
        if self.postgres.failover_check_interval.0 < Duration::from_millis(100) {
            return bad(
                "postgres.failover_check_interval".into(),
                "must be at least 100ms",
            );
        }
        if self
            .postgres
            .schema
            .as_deref()
            .is_some_and(|s| !super::is_plain_identifier(s))
        {
            return bad(
                "postgres.schema".into(),
                "must be a lower-case identifier (a-z, 0-9, _; at most 63)",
            );
        }
        match (self.host.replica, self.host.replicas) {
            (None, None) => {}
            (Some(_), None) => return bad("host.replicas".into(), "must be set with host.replica"),
            (None, Some(_)) => return bad("host.replica".into(), "must be set with host.replicas"),
            (Some(_), Some(n)) if !(1..=MAX_REPLICAS).contains(&n) => {
                return bad(
                    "host.replicas".into(),
                    &format!("must be between 1 and {MAX_REPLICAS}"),
                );
            }
            (Some(i), Some(n)) if i >= n => {
                return bad(
                    "host.replica".into(),
                    &format!("must be below host.replicas ({n}): replicas are numbered from 0"),
                );
            }
            (Some(_), Some(_)) => {}
        }
        if self.postgres.max_connections == 0 {
            return bad("postgres.max_connections".into(), "must be at least 1");
        }
        for (key, listen) in [
            ("admin.listen", &self.admin.listen),
            ("metrics.listen", &self.metrics.listen),
        ] {
            if let Some(listen) = listen
                && listen.parse::<std::net::SocketAddr>().is_err()
            {
                return bad(key.into(), "must be an address like 127.0.0.1:9464");
            }
        }
        if self.metrics.listen.is_some() && self.metrics.listen == self.admin.listen {
            return bad(
                "metrics.listen".into(),
                "must differ from admin.listen (which serves /metrics already)",
            );
        }
        if self
            .admin
            .token
            .as_deref()
            .is_some_and(|t| t.trim().is_empty())
        {
            return bad(
                "admin.token".into(),
                "must not be empty (omit it to disable deploys)",
            );
        }
        let p = &self.plugins;
        if p.watch_interval.0 < Duration::from_millis(10) {
            return bad("plugins.watch_interval".into(), "must be at least 10ms");
        }
        for (key, bucket) in [
            ("plugins.object_bucket", &p.object_bucket),
            ("plugins.version_bucket", &p.version_bucket),
        ] {
            if bucket.is_empty()
                || !bucket
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return bad(key.into(), "must be a bucket name (A-Z, a-z, 0-9, - and _)");
            }
        }
        if p.history == 0 || p.history > 64 {
            return bad("plugins.history".into(), "must be between 1 and 64");
        }
        if self.outbox.batch == 0 || self.outbox.batch > 10_000 {
            return bad("outbox.batch".into(), "must be between 1 and 10000");
        }
        if self.outbox.poll_interval.0 < Duration::from_millis(10) {
            return bad("outbox.poll_interval".into(), "must be at least 10ms");
        }
        if self.outbox.retry_base.0 < Duration::from_millis(10) {
            return bad("outbox.retry_base".into(), "must be at least 10ms");
        }
        if self.outbox.retry_cap.0 < self.outbox.retry_base.0
            || self.outbox.retry_cap.0 > Duration::from_secs(86_400)
        {
            return bad(
                "outbox.retry_cap".into(),
                "must be at least outbox.retry_base and at most 1 day",
            );
        }
        if self.admin.max_connections == 0 {
            return bad("admin.max_connections".into(), "must be at least 1");
        }
        if self.admin.request_timeout.0 < Duration::from_secs(1) {
            return bad("admin.request_timeout".into(), "must be at least 1s");
        }
        if self.outbox.max_attempts == 0 {
            return bad("outbox.max_attempts".into(), "must be at least 1");
        }
        let mut names = HashSet::new();
        let mut durables = HashSet::new();
        for (i, c) in self.consumers.iter().enumerate() {
            let key = |field: &str| format!("consumer[{i}].{field}");
            if c.name.trim().is_empty()
                || c.name.len() > 200
                || c.name.chars().any(char::is_whitespace)
            {
                return bad(key("name"), "must be 1-200 characters without whitespace");
            }
            if self.plugins.store.is_some() && !is_kv_key(&c.name) {
                return bad(
                    key("name"),
                    "must be usable as a NATS KV key when plugins.store is set \
                     (A-Z, a-z, 0-9, -, _, =, /, . and no leading or trailing '.')",
                );
            }
            if !names.insert(c.name.clone()) {
                return bad(key("name"), "is used by two consumers");
            }
            if !durables.insert(c.durable_name()) {
                return bad(
                    key("durable"),
                    "collides with another consumer's durable name",
                );
            }
            if c.stream.is_empty()
                || c.stream
                    .chars()
                    .any(|ch| matches!(ch, '.' | '*' | '>' | ' ' | '/' | '\\'))
            {
                return bad(
                    key("stream"),
                    "must be a JetStream stream name (no '.', '*', '>', spaces or slashes)",
                );
            }
            if c.create_stream && c.subjects.is_empty() {
                return bad(
                    key("subjects"),
                    "must list the stream's subjects when create_stream = true",
                );
            }
            if c.max_in_flight == 0 || c.max_in_flight > 4096 {
                return bad(key("max_in_flight"), "must be between 1 and 4096");
            }
            // Each message of a batch is a subtransaction; past 64 PostgreSQL's per-backend
            // subtransaction cache overflows and every session's snapshots get slower.
            if c.batch_max() == 0 || c.batch_max() > 64 {
                return bad(key("batch_max"), "must be between 1 and 64");
            }
            if c.batch_max() > 1 && c.ordering.is_some() {
                return bad(
                    key("batch_max"),
                    "cannot be combined with `ordering` (an ordered key retries in place, one delivery at a time)",
                );
            }
            if c.max_deliver == 0 {
                return bad(key("max_deliver"), "must be at least 1");
            }
            if c.backoff.is_empty() {
                return bad(key("backoff"), "must list at least one delay");
            }
            if c.batch_lock_timeout.0 > Duration::from_secs(3600) {
                return bad(
                    key("batch_lock_timeout"),
                    "must be at most 1h (0s: no limit)",
                );
            }
            if c.handler_timeout.0.is_zero() {
                return bad(key("handler_timeout"), "must be positive");
            }
            if c.statement_timeout.is_some_and(|d| d.0.is_zero()) {
                return bad(key("statement_timeout"), "must be positive");
            }
            if c.ack_wait.0 < Duration::from_secs(1) {
                return bad(key("ack_wait"), "must be at least 1s");
            }
            if c.memory_limit.0 < (1 << 20) {
                return bad(key("memory_limit"), "must be at least 1MiB");
            }
            if c.tx_max_attempts == 0 {
                return bad(key("tx_max_attempts"), "must be at least 1");
            }
            if c.id_header.is_empty() {
                return bad(key("id_header"), "must not be empty");
            }
            if c.dead_letter_subject().split('.').any(str::is_empty)
                || c.dead_letter_subject().contains(['*', '>', ' '])
            {
                return bad(key("dead_letter_subject"), "must be a literal NATS subject");
            }
            if c.subjects.iter().any(|s| s.is_empty() || s.contains(' ')) {
                return bad(key("subjects"), "must be NATS subjects");
            }
            if c.partitions > 0 {
                if c.partitions > 1024 {
                    return bad(key("partitions"), "must be at most 1024");
                }
                let wildcards = c
                    .subjects
                    .first()
                    .map_or(0, |s| s.split('.').filter(|t| *t == "*").count());
                if c.subjects.len() != 1 || wildcards == 0 || c.subjects[0].contains('>') {
                    return bad(
                        key("subjects"),
                        "must be one subject with `*` wildcards (the partition key) and no `>` \
                         when `partitions` is set",
                    );
                }
            }
            if c.role
                .as_deref()
                .is_some_and(|r| !super::is_plain_identifier(r))
            {
                return bad(
                    key("role"),
                    "must be a lower-case identifier (a-z, 0-9, _; at most 63)",
                );
            }
            if let Some((name, _)) = c
                .role_settings
                .iter()
                .find(|(n, v)| !super::is_plain_identifier(n) || v.contains('\0') || v.len() > 256)
            {
                return bad(
                    key("role_settings"),
                    &format!(
                        "`{name}`: setting names are lower-case identifiers; values are at most \
                         256 bytes"
                    ),
                );
            }
            if c.config.len() > super::MAX_PLUGIN_CONFIG_ENTRIES {
                return bad(
                    key("config"),
                    &format!(
                        "has {} keys; at most {}",
                        c.config.len(),
                        super::MAX_PLUGIN_CONFIG_ENTRIES
                    ),
                );
            }
            if let Some((name, _)) = c.config.iter().find(|(n, v)| {
                n.is_empty()
                    || n.len() > 64
                    || !n
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
                    || v.len() > super::MAX_PLUGIN_CONFIG_VALUE
            }) {
                return bad(
                    key("config"),
                    &format!(
                        "`{}`: keys are 1-64 characters of A-Z, a-z, 0-9, _, - and .; values \
                         are at most {} bytes",
                        crate::text::reason(name),
                        super::MAX_PLUGIN_CONFIG_VALUE
                    ),
                );
            }
            if c.tables.iter().any(|t| {
                t.is_empty()
                    || t.contains('\0')
                    || t.split('.').count() > 2
                    || t.split('.').any(str::is_empty)
            }) {
                return bad(
                    key("tables"),
                    "must be table names (`name` or `schema.name`)",
                );
            }
            if let Some(p) = c
                .publish_subjects
                .iter()
                .find(|p| crate::subjects::check_pattern(p).is_err())
            {
                return bad(
                    key("publish_subjects"),
                    &crate::subjects::check_pattern(p).err().unwrap_or_default(),
                );
            }
            if let Some(o) = &c.ordering
                && let Err(e) = super::KeySpec::parse(&o.key)
            {
                return bad(key("ordering.key"), &e);
            }
            if c.effect_query.as_deref().is_some_and(|q| !q.contains("$1")) {
                return bad(
                    key("effect_query"),
                    "must use $1 (the message id, or `idemhost check --effect-param`)",
                );
            }
        }
        Ok(())
    }
}
