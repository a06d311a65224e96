//! `idemhost check`: proves, for one message, that its marker exists (when, under which plugin
//! version) and — through the consumer's `effect_query` — that its business effect does. A
//! marker without its effect breaks the pattern's invariant (code or a hand edit committed one
//! without the other) and is reported as such.

use anyhow::Context as _;
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgPool, Row as _};

/// The marker of one message.
#[derive(Debug, Clone, Serialize)]
pub struct Marker {
    /// RFC 3339, UTC.
    pub processed_at: String,
    /// Seconds since it was written.
    pub age_secs: f64,
    /// The plugin version that applied it (none for native handlers).
    pub plugin_digest: Option<String>,
}

/// What `effect_query` returned.
#[derive(Debug, Clone, Serialize)]
pub struct Effect {
    /// The consumer's `effect_query`.
    pub query: String,
    /// The value bound to its `$1` (the message id, or a payload field).
    pub param: String,
    /// Rows found (at most [`MAX_EFFECT_ROWS`] are kept).
    pub rows: usize,
    /// The rows as JSON objects.
    pub sample: Vec<serde_json::Value>,
}

/// Rows of the effect query kept for display.
pub const MAX_EFFECT_ROWS: usize = 20;

/// The verdict, and the exit status the CLI gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Marker and effect (or a marker and no effect query to ask): exit 0.
    Applied,
    /// No marker: not processed by this consumer (or its marker was pruned): exit 3.
    NotProcessed,
    /// A marker without its effect: the invariant is broken; exit 2.
    MarkerWithoutEffect,
}

impl Verdict {
    /// The exit status `idemhost check` gives this verdict.
    pub fn exit_code(self) -> i32 {
        match self {
            Verdict::Applied => 0,
            Verdict::MarkerWithoutEffect => 2,
            Verdict::NotProcessed => 3,
        }
    }
}

/// What `check` found for one message.
#[derive(Debug, Clone, Serialize)]
pub struct CheckReport {
    /// The consumer asked about.
    pub consumer: String,
    /// The message id asked about.
    pub message_id: String,
    /// Its marker, if there is one.
    pub marker: Option<Marker>,
    /// `None` when the consumer declares no `effect_query`.
    pub effect: Option<Effect>,
    /// What marker and effect together say.
    pub verdict: Verdict,
}

const MARKER_SQL: &str = "SELECT to_char(m.processed_at AT TIME ZONE 'UTC', \
                                  'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
       extract(epoch FROM now() - m.processed_at)::float8, h.plugin_digest \
     FROM processed_message m \
     LEFT JOIN processed_message_handler h USING (consumer_name, message_id) \
     WHERE m.consumer_name = $1 AND m.message_id = $2";

/// Looks up the marker of (`consumer`, `message_id`) and runs `effect_query` (if any) with
/// `$1` = `effect_param`, in a read-only transaction bounded by a 10 s statement timeout.
pub async fn check(
    pool: &PgPool,
    consumer: &str,
    message_id: &str,
    effect_query: Option<&str>,
    effect_param: &str,
) -> anyhow::Result<CheckReport> {
    let mut tx = pool
        .begin_with("BEGIN READ ONLY; SET LOCAL statement_timeout = 10000")
        .await
        .context("failed to begin a read-only transaction")?;
    let marker = sqlx::query(MARKER_SQL)
        .bind(consumer)
        .bind(message_id)
        .fetch_optional(&mut *tx)
        .await
        .context("failed to read the marker")?
        .map(|r| -> Result<Marker, sqlx::Error> {
            Ok(Marker {
                processed_at: r.try_get(0)?,
                age_secs: r.try_get(1)?,
                plugin_digest: r.try_get(2)?,
            })
        })
        .transpose()?;
    let effect = match effect_query {
        Some(q) => {
            let q = q.trim().trim_end_matches(';');
            let wrapped = format!(
                "SELECT row_to_json(q)::text FROM ({q}) q LIMIT {}",
                MAX_EFFECT_ROWS + 1
            );
            let rows: Vec<String> = sqlx::query_scalar(AssertSqlSafe(wrapped))
                .bind(effect_param)
                .fetch_all(&mut *tx)
                .await
                .with_context(|| format!("effect_query failed: {q}"))?;
            Some(Effect {
                query: q.to_string(),
                param: effect_param.to_string(),
                rows: rows.len(),
                sample: rows
                    .iter()
                    .take(MAX_EFFECT_ROWS)
                    .map(|r| serde_json::from_str(r).unwrap_or(serde_json::Value::Null))
                    .collect(),
            })
        }
        None => None,
    };
    let _ = tx.rollback().await;
    let verdict = match (&marker, &effect) {
        (None, _) => Verdict::NotProcessed,
        (Some(_), Some(e)) if e.rows == 0 => Verdict::MarkerWithoutEffect,
        (Some(_), _) => Verdict::Applied,
    };
    Ok(CheckReport {
        consumer: consumer.to_string(),
        message_id: message_id.to_string(),
        marker,
        effect,
        verdict,
    })
}
