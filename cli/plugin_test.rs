//! `idemhost plugin test`: one message through a component exactly as a delivery would run it
//! — the consumer's world, limits, role and SQL gate, the claim included — against the
//! configured PostgreSQL, then rolled back (unless `--commit`). Prints every statement the
//! plugin ran, its log lines, the outbox events it would publish, the outcome and the timings.
//! Nothing is acked or published: NATS is not contacted at all.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use serde_json::{Value, json};

use idemhost::config::{Config, ConsumerConfig};
use idemhost::headers::EVENT_TYPE_HEADER;
use idemhost::rehearsal::{self, Refused, StatementResult, Traced};
use idemhost::{
    Message, Outcome, PluginLimits, PluginRuntime, PoolSizing, Processed, SqlArray, SqlValue,
    WasmHandler,
};

/// What `plugin test` runs.
#[derive(Debug, Args)]
pub struct TestArgs {
    /// The component file.
    file: PathBuf,
    /// The message's payload: a file, or `-` for stdin.
    #[arg(long)]
    payload: String,
    /// The message id (the `Nats-Msg-Id` header, or the consumer's `id_header`). Default: a new
    /// one per run, so the claim succeeds; give an id that has a marker to see a duplicate.
    #[arg(long)]
    id: Option<String>,
    /// The `Idemhost-Event-Type` header.
    #[arg(long)]
    event_type: Option<String>,
    /// More headers, `Name: value` (repeatable).
    #[arg(long = "header", value_parser = super::parse_header)]
    headers: Vec<(String, String)>,
    /// The subject. Default: the consumer's first subject, wildcards read as `test`.
    #[arg(long)]
    subject: Option<String>,
    /// The delivery attempt the plugin sees (1 is the first delivery).
    #[arg(long, default_value_t = 1)]
    attempt: u32,
    /// The host's config: PostgreSQL, schema, and the consumer's limits, grants and role.
    /// Without it: PostgreSQL at postgres://root@127.0.0.1:5432/test, the defaults
    /// (`IDEMHOST_*` variables apply, e.g. IDEMHOST_POSTGRES__URL), and a consumer named after
    /// the file with no table grants.
    #[arg(long, env = "IDEMHOST_CONFIG")]
    config: Option<PathBuf>,
    /// Which configured consumer to run as (needed when the config has several).
    #[arg(long)]
    consumer: Option<String>,
    /// Commit as a delivery would, marker included (the outbox relay of a running host then
    /// publishes the events). Default: roll back.
    #[arg(long)]
    commit: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Do not apply the host's migrations first (as `run --no-migrate`); the schema must then
    /// be current.
    #[arg(long)]
    no_migrate: bool,
    /// Keep what the test set up for itself: the host's migrations of a schema that had none
    /// (or the schema) and the consumer's role when it did not exist. Default: removed after
    /// the run, so a rolled-back test leaves the server as it was. `--commit` keeps them.
    #[arg(long)]
    keep_setup: bool,
}

/// PostgreSQL when there is no `--config` (the demo's and the tests' server).
const DEFAULT_POSTGRES_URL: &str = "postgres://root@127.0.0.1:5432/test";

/// Exit statuses by outcome (1 is an error of the command itself, 2 a usage error).
pub const EXIT_APPLIED: u8 = 0;
pub const EXIT_DUPLICATE: u8 = 3;
pub const EXIT_RETRYABLE: u8 = 4;
pub const EXIT_TERMINAL: u8 = 5;
pub const EXIT_TRAP: u8 = 6;

impl TestArgs {
    /// A rolled-back run of `payload` through `file`, as `plugin dev` runs each sample.
    pub fn sample(
        file: PathBuf,
        payload: &Path,
        event_type: Option<String>,
        config: Option<PathBuf>,
        consumer: Option<String>,
    ) -> TestArgs {
        TestArgs {
            file,
            payload: payload.to_string_lossy().into_owned(),
            id: None,
            event_type,
            headers: Vec::new(),
            subject: None,
            attempt: 1,
            config,
            consumer,
            commit: false,
            json: false,
            no_migrate: false,
            keep_setup: false,
        }
    }
}

/// Runs `plugin test`; the exit status by outcome.
pub async fn test(args: TestArgs) -> anyhow::Result<u8> {
    let json = args.json;
    let (code, shown) = rehearse(&args, |report| {
        if json {
            serde_json::to_string_pretty(&report.json())
                .map_or_else(|e| format!("{{\"error\": \"{e}\"}}\n"), |text| text + "\n")
        } else {
            report.text()
        }
    })
    .await?;
    print!("{shown}");
    Ok(code)
}

/// `plugin dev`'s run of one sample: the exit status, and what happened in a few lines.
pub async fn summary(args: &TestArgs) -> anyhow::Result<(u8, String)> {
    rehearse(args, |report| report.summary()).await
}

/// Runs the message through the component as a delivery would; the exit status by outcome and
/// the report as `show` writes it.
async fn rehearse(
    args: &TestArgs,
    show: impl FnOnce(&Report) -> String,
) -> anyhow::Result<(u8, String)> {
    let (config, consumer) =
        consumer_of(args.config.as_deref(), args.consumer.as_deref(), &args.file)?;
    let payload = read_payload(&args.payload)?;
    let handler = load(&config, &consumer, &args.file)?;
    let msg = message(args, &consumer, payload);

    let mut undone = Vec::new();
    let mut kept = Vec::new();
    let (ran, traced) = match &msg {
        Ok(msg) => {
            let rehearsed = rehearsal::run(
                &config,
                &consumer,
                &handler,
                msg,
                rehearsal::RehearsalOptions {
                    migrate: !args.no_migrate,
                    commit: args.commit,
                    keep_setup: args.keep_setup,
                },
            )
            .await?;
            undone = rehearsed.undone;
            kept = rehearsed.kept;
            (Ran::Delivered(rehearsed.processed), rehearsed.traced)
        }
        Err(refused) => (Ran::Refused(refused.reason.clone()), Traced::default()),
    };
    let report = Report {
        file: &args.file,
        handler: &handler,
        consumer: &consumer,
        role: rehearsal::role(&config, &consumer),
        msg: msg.as_ref().ok(),
        ran: &ran,
        traced,
        committed: args.commit,
        undone,
        kept,
    };
    Ok((report.exit_code(), show(&report)))
}

/// The configuration (`config`, else the defaults with one consumer named after `file`) and
/// the consumer to run as (`consumer`, else the config's only one).
pub(super) fn consumer_of(
    config: Option<&Path>,
    consumer: Option<&str>,
    file: &Path,
) -> anyhow::Result<(Config, ConsumerConfig)> {
    let config = match config {
        Some(path) => Config::load(path)?,
        None => {
            // The defaults plus one consumer named after the component, through the same
            // parsing and validation as a config file (and its environment overrides).
            let name = match consumer {
                Some(n) => n.to_owned(),
                None => file
                    .file_stem()
                    .map(|s| {
                        s.to_string_lossy()
                            .replace(|c: char| !c.is_ascii_alphanumeric(), "-")
                    })
                    .unwrap_or_else(|| "plugin-test".into()),
            };
            let mut consumer = toml::Table::new();
            consumer.insert("name".into(), name.into());
            consumer.insert("stream".into(), "PLUGIN_TEST".into());
            consumer.insert(
                "subjects".into(),
                vec![toml::Value::from("plugin.test")].into(),
            );
            let mut postgres = toml::Table::new();
            postgres.insert("url".into(), DEFAULT_POSTGRES_URL.into());
            let mut table = toml::Table::new();
            table.insert("postgres".into(), toml::Value::Table(postgres));
            table.insert("consumer".into(), vec![toml::Value::Table(consumer)].into());
            let text = toml::to_string(&table)?;
            Config::from_toml(
                &text,
                std::env::vars(),
                Path::new("(plugin test)"),
                Path::new("."),
            )?
        }
    };
    let consumer = match consumer {
        Some(name) => config
            .consumers
            .iter()
            .find(|c| c.name == name)
            .with_context(|| {
                format!(
                    "no consumer {name:?} in the config (it has: {})",
                    names(&config)
                )
            })?,
        None => match config.consumers.as_slice() {
            [only] => only,
            _ => anyhow::bail!(
                "the config has several consumers ({}): say which with --consumer",
                names(&config)
            ),
        },
    }
    .clone();
    Ok((config, consumer))
}

fn names(config: &Config) -> String {
    let names: Vec<&str> = config.consumers.iter().map(|c| c.name.as_str()).collect();
    names.join(", ")
}

fn read_payload(source: &str) -> anyhow::Result<Vec<u8>> {
    if source == "-" {
        let mut bytes = Vec::new();
        std::io::stdin()
            .read_to_end(&mut bytes)
            .context("failed to read the payload from stdin")?;
        return Ok(bytes);
    }
    std::fs::read(source).with_context(|| format!("failed to read payload file {source}"))
}

/// Loads the component as the host would for this consumer: its limits, the compile cache.
fn load(config: &Config, consumer: &ConsumerConfig, file: &Path) -> anyhow::Result<WasmHandler> {
    let bytes =
        std::fs::read(file).with_context(|| format!("failed to read {}", file.display()))?;
    load_bytes(config, consumer, &bytes, file)
}

/// [`load`] of bytes; `origin` names them in errors.
pub(super) fn load_bytes(
    config: &Config,
    consumer: &ConsumerConfig,
    bytes: &[u8],
    origin: &Path,
) -> anyhow::Result<WasmHandler> {
    // The host sizes its instance pool by the largest `memory_limit`: this consumer's here.
    let mut runtime = PluginRuntime::with_pool(PoolSizing {
        // The host's smallest pool: a language runtime's component holds several core
        // instances.
        instances: 8,
        max_memory: consumer.memory_limit.0 as usize,
        keep_resident: config.plugins.keep_resident.0 as usize,
    })?;
    if let Some(dir) = config.host.compile_cache_dir() {
        let _ = runtime.set_compile_cache(Some(&dir));
    }
    let limits = PluginLimits {
        timeout: consumer.handler_timeout.0,
        memory: consumer.memory_limit.0 as usize,
    };
    let config = std::sync::Arc::new(consumer.config.clone());
    Ok(runtime
        .load_bytes(bytes, origin, limits)?
        .with_config(config))
}

/// The message as a delivery of it would be read: the id from the same headers, by the same
/// rules, the payload checked against `max_payload`.
fn message(
    args: &TestArgs,
    consumer: &ConsumerConfig,
    payload: Vec<u8>,
) -> Result<Message, Refused> {
    let mut headers = async_nats::HeaderMap::new();
    let id = args.id.clone().unwrap_or_else(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("plugin-test-{nanos}")
    });
    headers.insert(consumer.id_header.as_str(), id.as_str());
    if let Some(t) = &args.event_type {
        headers.insert(EVENT_TYPE_HEADER, t.as_str());
    }
    for (k, v) in &args.headers {
        // NATS never delivers a header with a line break in it.
        if k.chars().chain(v.chars()).any(char::is_control) {
            return Err(Refused {
                reason: format!("header {k:?} holds a control character"),
            });
        }
        headers.append(k.as_str(), v.as_str());
    }
    let subject = args.subject.clone().unwrap_or_else(|| {
        let first = consumer
            .subjects
            .first()
            .map_or("plugin.test", String::as_str);
        first
            .split('.')
            .map(|t| if t == "*" || t == ">" { "test" } else { t })
            .collect::<Vec<_>>()
            .join(".")
    });
    rehearsal::read(consumer, &subject, &headers, payload, args.attempt.max(1))
}

/// What happened to the message.
pub(super) enum Ran {
    /// It went through claim, handler and the end of the transaction.
    Delivered(Processed),
    /// Refused before any transaction (a delivery of it would be dead-lettered at once).
    Refused(String),
}

struct Report<'a> {
    file: &'a Path,
    handler: &'a WasmHandler,
    consumer: &'a ConsumerConfig,
    role: String,
    msg: Option<&'a Message>,
    ran: &'a Ran,
    traced: Traced,
    committed: bool,
    /// The set-up taken back after the run.
    undone: Vec<String>,
    /// The set-up that could not be taken back, and why.
    kept: Vec<String>,
}

impl Report<'_> {
    /// `applied`, `duplicate`, `retryable`, `terminal` or `trap`, and the reason.
    fn outcome(&self) -> (&'static str, Option<String>) {
        outcome_of(self.ran, &self.traced)
    }

    fn exit_code(&self) -> u8 {
        match self.outcome().0 {
            "applied" => EXIT_APPLIED,
            "duplicate" => EXIT_DUPLICATE,
            "retryable" => EXIT_RETRYABLE,
            "trap" => EXIT_TRAP,
            _ => EXIT_TERMINAL,
        }
    }

    /// What became of the transaction.
    fn ending(&self) -> &'static str {
        match self.ran {
            Ran::Refused(_) => "no transaction was opened",
            Ran::Delivered(p) if !p.outcome.committed() => "rolled back, as a delivery would be",
            Ran::Delivered(_) if self.committed => "COMMITTED (--commit)",
            Ran::Delivered(_) => "rolled back: nothing was committed (--commit keeps it)",
        }
    }

    fn sql_time(&self) -> Duration {
        self.traced.statements.iter().map(|s| s.elapsed).sum()
    }

    fn text(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let t = &self.traced;
        let c = self.consumer;
        let _ = writeln!(
            out,
            "plugin    {} ({}, {} bytes)",
            self.handler.digest(),
            self.file.display(),
            self.handler.size()
        );
        let _ = writeln!(
            out,
            "consumer  {} as role {}, isolation {}, handler_timeout {:?}, memory_limit {} bytes",
            c.name,
            self.role,
            c.isolation.sql(),
            c.handler_timeout.0,
            c.memory_limit.0
        );
        if let Some(m) = self.msg {
            let _ = writeln!(
                out,
                "message   id {:?}, subject {}, event type {}, attempt {}, {} bytes",
                m.id,
                one_line(&m.subject, 200),
                one_line(m.event_type.as_deref().unwrap_or("-"), 200),
                m.delivery_attempt,
                m.payload.len()
            );
        }
        let _ = writeln!(
            out,
            "\nSQL: {} statement{}{}",
            t.statements.len(),
            plural(t.statements.len()),
            dropped(t.statements_dropped)
        );
        for (i, s) in t.statements.iter().enumerate() {
            let _ = writeln!(out, "  {}. {}", i + 1, one_line(&s.sql, 400));
            if !s.params.is_empty() {
                let params: Vec<String> = s.params.iter().map(show).collect();
                let _ = writeln!(out, "     params {}", params.join(", "));
            }
            let result = match &s.result {
                StatementResult::Affected(n) => format!("{n} row{} affected", plural(*n as usize)),
                StatementResult::Rows { rows, total } => {
                    let shown: Vec<String> = rows
                        .iter()
                        .take(5)
                        .map(|r| format!("({})", r.iter().map(show).collect::<Vec<_>>().join(", ")))
                        .collect();
                    let more = if *total > shown.len() {
                        format!(" … {} more", total - shown.len())
                    } else {
                        String::new()
                    };
                    format!("{total} row{} {}{more}", plural(*total), shown.join(" "))
                }
                StatementResult::Error(e) => format!("ERROR {}", one_line(e, 400)),
            };
            let _ = writeln!(out, "     → {result} ({})", ms(s.elapsed));
        }
        let _ = writeln!(
            out,
            "\nlog: {} line{}{}",
            t.logs.len(),
            plural(t.logs.len()),
            dropped(t.logs_dropped as usize)
        );
        for (level, line) in &t.logs {
            let _ = writeln!(out, "  {:<5} {}", one_line(level, 16), one_line(line, 400));
        }
        let _ = writeln!(
            out,
            "\noutbox: {} event{}{} (never published by this command)",
            t.published.len(),
            plural(t.published.len()),
            dropped(t.published_dropped)
        );
        for e in &t.published {
            let _ = writeln!(
                out,
                "  {} {}",
                one_line(&e.subject, 200),
                one_line(&String::from_utf8_lossy(&e.payload), 200)
            );
            for (k, v) in &e.headers {
                let _ = writeln!(out, "     {}: {}", one_line(k, 100), one_line(v, 200));
            }
            if let Some(r) = &e.refused {
                let _ = writeln!(out, "     REFUSED {}", one_line(r, 400));
            }
        }
        let (outcome, reason) = self.outcome();
        let _ = writeln!(
            out,
            "\noutcome   {outcome}{}",
            reason
                .map(|r| format!(": {}", one_line(&r, 600)))
                .unwrap_or_default()
        );
        let _ = writeln!(out, "          {}", self.ending());
        if !self.undone.is_empty() {
            let _ = writeln!(
                out,
                "          set-up removed: {} (--keep-setup keeps it)",
                self.undone.join(", ")
            );
        }
        for kept in &self.kept {
            let _ = writeln!(out, "          set-up KEPT: {kept}");
        }
        if let Ran::Delivered(p) = self.ran {
            let opt = |d: Option<Duration>| d.map_or("-".to_string(), ms);
            let _ = writeln!(
                out,
                "timings   instantiate {}, handle {}, claim {}, plugin SQL {}, transaction {} ({} attempt{})",
                opt(t.instantiate),
                opt(t.handle),
                ms(p.claim_time),
                ms(self.sql_time()),
                ms(p.tx_time),
                p.tx_attempts,
                plural(p.tx_attempts as usize)
            );
        }
        out
    }

    /// The outcome and what led to it, in a few lines: the statements, log lines and events
    /// counted, the first failed statement, up to three log lines, the timings.
    fn summary(&self) -> String {
        use std::fmt::Write as _;
        let t = &self.traced;
        let (outcome, reason) = self.outcome();
        let failed = t
            .statements
            .iter()
            .filter(|s| matches!(s.result, StatementResult::Error(_)))
            .count();
        let mut out = format!(
            "{outcome}: {} statement{}{}, {} log line{}, {} event{}",
            t.statements.len(),
            plural(t.statements.len()),
            if failed > 0 {
                format!(" ({failed} failed)")
            } else {
                String::new()
            },
            t.logs.len(),
            plural(t.logs.len()),
            t.published.len(),
            plural(t.published.len()),
        );
        if let Ran::Delivered(p) = self.ran {
            let _ = write!(
                out,
                "; handle {}, transaction {}",
                t.handle.map_or("-".to_string(), ms),
                ms(p.tx_time)
            );
        }
        out.push('\n');
        if let Some(r) = reason {
            let _ = writeln!(out, "  reason: {}", one_line(&r, 400));
        }
        let first_error = t
            .statements
            .iter()
            .enumerate()
            .find_map(|(i, s)| match &s.result {
                StatementResult::Error(e) => Some((i, s, e)),
                _ => None,
            });
        if let Some((i, s, e)) = first_error {
            let _ = writeln!(out, "  statement {}: {}", i + 1, one_line(&s.sql, 200));
            let _ = writeln!(out, "    ERROR {}", one_line(e, 300));
        }
        for (level, line) in t.logs.iter().take(3) {
            let _ = writeln!(
                out,
                "  log {:<5} {}",
                one_line(level, 16),
                one_line(line, 200)
            );
        }
        if t.logs.len() > 3 {
            let _ = writeln!(out, "  log … {} more", t.logs.len() - 3);
        }
        out
    }

    fn json(&self) -> Value {
        let t = &self.traced;
        let (outcome, reason) = self.outcome();
        let statements: Vec<Value> = t
            .statements
            .iter()
            .map(|s| {
                let mut v = json!({
                    "sql": s.sql,
                    "params": s.params.iter().map(to_json).collect::<Vec<_>>(),
                    "ms": s.elapsed.as_secs_f64() * 1e3,
                });
                match &s.result {
                    StatementResult::Affected(n) => v["rows_affected"] = json!(n),
                    StatementResult::Rows { rows, total } => {
                        v["rows"] = rows
                            .iter()
                            .map(|r| r.iter().map(to_json).collect::<Vec<_>>())
                            .collect();
                        v["row_count"] = json!(total);
                    }
                    StatementResult::Error(e) => v["error"] = json!(e),
                }
                v
            })
            .collect();
        let processed = match self.ran {
            Ran::Delivered(p) => Some(p),
            Ran::Refused(_) => None,
        };
        let ms_of = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e3);
        json!({
            "plugin": {"file": self.file, "digest": self.handler.digest(), "bytes": self.handler.size()},
            "consumer": self.consumer.name,
            "role": self.role,
            "message": self.msg.map(|m| json!({
                "id": m.id, "subject": m.subject, "event_type": m.event_type,
                "headers": m.headers, "payload_bytes": m.payload.len(), "attempt": m.delivery_attempt,
            })),
            "statements": statements,
            "statements_dropped": t.statements_dropped,
            "logs": t.logs.iter().map(|(l, m)| json!({"level": l, "message": m})).collect::<Vec<_>>(),
            "logs_dropped": t.logs_dropped,
            "outbox": t.published.iter().map(|e| json!({
                "subject": e.subject, "headers": e.headers,
                "payload": String::from_utf8_lossy(&e.payload), "refused": e.refused,
            })).collect::<Vec<_>>(),
            "outbox_dropped": t.published_dropped,
            "outcome": outcome,
            "reason": reason,
            "committed": processed.is_some_and(|p| p.outcome.committed()) && self.committed,
            "timings_ms": {
                "instantiate": ms_of(t.instantiate),
                "handle": ms_of(t.handle),
                "claim": ms_of(processed.map(|p| p.claim_time)),
                "plugin_sql": self.sql_time().as_secs_f64() * 1e3,
                "transaction": ms_of(processed.map(|p| p.tx_time)),
            },
            "tx_attempts": processed.map(|p| p.tx_attempts),
            "setup_removed": self.undone,
            "setup_kept": self.kept,
        })
    }
}

/// `, N more not kept` when some were dropped.
/// `applied`, `duplicate`, `retryable`, `terminal` or `trap`, and the reason.
pub(super) fn outcome_of(ran: &Ran, traced: &Traced) -> (&'static str, Option<String>) {
    match ran {
        Ran::Refused(reason) => (
            "terminal",
            Some(format!("refused before any transaction: {reason}")),
        ),
        Ran::Delivered(p) => match &p.outcome {
            Outcome::Applied => ("applied", None),
            Outcome::Duplicate => ("duplicate", None),
            Outcome::RetryableFailure(r) if traced.trap.is_some() => ("trap", Some(r.clone())),
            Outcome::RetryableFailure(r) => ("retryable", Some(r.clone())),
            Outcome::TerminalFailure(r) => ("terminal", Some(r.clone())),
        },
    }
}

fn dropped(n: usize) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(", {n} more not kept")
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// `text` on one line (control characters shown as spaces), cut at `max` characters.
pub(super) fn one_line(text: &str, max: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let flat: String = flat
        .chars()
        .map(|c| if shown_as_space(c) { ' ' } else { c })
        .collect();
    match flat.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &flat[..cut]),
        None => flat,
    }
}

/// Characters a terminal would act on, or that reorder or hide text: controls, bidirectional
/// overrides and isolates, zero-width characters, the byte-order mark.
fn shown_as_space(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{061c}' | '\u{feff}')
}

/// A value as a reader of the report sees it (long text and bytes cut).
pub(super) fn show(v: &SqlValue) -> String {
    match v {
        SqlValue::Null => "NULL".into(),
        SqlValue::Boolean(b) => b.to_string(),
        SqlValue::Int(i) => i.to_string(),
        SqlValue::Float(f) => f.to_string(),
        SqlValue::Text(s) => format!("{:?}", one_line(s, 80)),
        SqlValue::Json(s) => format!("json {}", one_line(s, 80)),
        SqlValue::Bytes(b) => format!("{} bytes", b.len()),
        SqlValue::Numeric(s) => format!("numeric {}", one_line(s, 80)),
        SqlValue::Timestamp(t) => format!("timestamp {}", timestamp(*t)),
        SqlValue::Date(d) => format!("date {}", date(*d)),
        SqlValue::Uuid(s) => format!("uuid {}", one_line(s, 80)),
        SqlValue::Array(a) => {
            let n = array_len(a);
            format!("array of {n}")
        }
    }
}

fn array_len(a: &SqlArray) -> usize {
    match a {
        SqlArray::Boolean(v) => v.len(),
        SqlArray::Int(v) | SqlArray::Timestamp(v) => v.len(),
        SqlArray::Float(v) => v.len(),
        SqlArray::Text(v) | SqlArray::Numeric(v) | SqlArray::Uuid(v) => v.len(),
        SqlArray::Date(v) => v.len(),
    }
}

/// A day count since 1970-01-01 as `YYYY-MM-DD` (proleptic Gregorian; H. Hinnant's
/// civil-from-days).
fn civil(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + (m <= 2) as i64, m, d)
}

fn date(days: i32) -> String {
    match days {
        i32::MAX => "infinity".into(),
        i32::MIN => "-infinity".into(),
        d => {
            let (y, m, d) = civil(d.into());
            format!("{y:04}-{m:02}-{d:02}")
        }
    }
}

fn timestamp(micros: i64) -> String {
    match micros {
        i64::MAX => "infinity".into(),
        i64::MIN => "-infinity".into(),
        t => {
            let (y, m, d) = civil(t.div_euclid(86_400_000_000));
            let of_day = t.rem_euclid(86_400_000_000);
            let (s, us) = (of_day / 1_000_000, of_day % 1_000_000);
            format!(
                "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{us:06}Z",
                s / 3600,
                s / 60 % 60,
                s % 60
            )
        }
    }
}

fn to_json(v: &SqlValue) -> Value {
    match v {
        SqlValue::Null => Value::Null,
        SqlValue::Boolean(b) => json!(b),
        SqlValue::Int(i) => json!(i),
        SqlValue::Float(f) => json!(f),
        SqlValue::Text(s) => json!(s),
        SqlValue::Json(s) => json!({"json": s}),
        SqlValue::Bytes(b) => json!({"bytes": b.len()}),
        SqlValue::Numeric(s) => json!({"numeric": s}),
        SqlValue::Timestamp(t) => json!({"timestamp": timestamp(*t)}),
        SqlValue::Date(d) => json!({"date": date(*d)}),
        SqlValue::Uuid(s) => json!({"uuid": s}),
        SqlValue::Array(a) => json!({"array": array_json(a)}),
    }
}

fn array_json(a: &SqlArray) -> Value {
    fn each<T>(v: &[Option<T>], f: impl Fn(&T) -> Value) -> Value {
        v.iter()
            .map(|i| i.as_ref().map_or(Value::Null, &f))
            .collect()
    }
    match a {
        SqlArray::Boolean(v) => each(v, |b| json!(b)),
        SqlArray::Int(v) => each(v, |i| json!(i)),
        SqlArray::Float(v) => each(v, |f| json!(f)),
        SqlArray::Text(v) | SqlArray::Numeric(v) | SqlArray::Uuid(v) => each(v, |s| json!(s)),
        SqlArray::Timestamp(v) => each(v, |t| json!(timestamp(*t))),
        SqlArray::Date(v) => each(v, |d| json!(date(*d))),
    }
}
