//! The marker table's size and age per consumer (`idemhost markers stats`, the growth
//! metrics) and its retention (`idemhost markers prune`) under the replay-horizon contract: a
//! marker may go only once no copy of its message can come back — not from the stream, not
//! from the dead letters, not from a replay the consumer's `replay_horizon` still allows.

use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;
use sqlx::{PgPool, Row as _};

use crate::config::ConsumerConfig;

use super::{broker, human};

/// One consumer's markers.
#[derive(Debug, Clone, Serialize)]
pub struct ConsumerMarkers {
    /// The consumer name.
    pub consumer: String,
    /// Its markers.
    pub rows: i64,
    /// The consumer's share of the table's bytes (indexes included), by row count: an estimate.
    pub bytes: i64,
    /// Age of the oldest and the newest marker.
    #[serde(serialize_with = "secs")]
    pub oldest: Option<Duration>,
    /// Age of the newest marker.
    #[serde(serialize_with = "secs")]
    pub newest: Option<Duration>,
}

/// The marker table.
#[derive(Debug, Clone, Serialize)]
pub struct MarkerState {
    /// `pg_total_relation_size` of `processed_message`.
    pub table_bytes: u64,
    /// Rows in the table (all consumers).
    pub total_rows: i64,
    /// Each consumer's share.
    pub consumers: Vec<ConsumerMarkers>,
}

fn secs<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_f64(d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

/// The table's size (indexes and TOAST included) and the planner's estimate of its rows.
const TABLE_SQL: &str = "SELECT pg_total_relation_size(oid)::bigint, reltuples::float8 \
                         FROM pg_class WHERE oid = 'processed_message'::regclass";

/// Per named consumer: the row count is an index-only scan of that consumer's part of the
/// primary key (cost grows with its markers); oldest and newest are one probe each of the
/// `(consumer_name, processed_at)` index.
const SAMPLE_SQL: &str = "SELECT c.name, \
       (SELECT count(*) FROM processed_message m WHERE m.consumer_name = c.name), \
       (SELECT extract(epoch FROM now() - min(processed_at))::float8 \
          FROM processed_message m WHERE m.consumer_name = c.name), \
       (SELECT extract(epoch FROM now() - max(processed_at))::float8 \
          FROM processed_message m WHERE m.consumer_name = c.name) \
     FROM unnest($1::text[]) AS c(name) ORDER BY c.name";

/// Every consumer in the table: one scan of the whole table.
const ALL_SQL: &str = "SELECT consumer_name, count(*), \
       extract(epoch FROM now() - min(processed_at))::float8, \
       extract(epoch FROM now() - max(processed_at))::float8 \
     FROM processed_message GROUP BY consumer_name ORDER BY consumer_name";

/// Marker statistics of `consumers` (the metrics sampler), or of every consumer that has
/// markers (`None`: `markers stats`).
pub async fn state(
    pool: &PgPool,
    consumers: Option<&[String]>,
) -> Result<MarkerState, sqlx::Error> {
    let (table_bytes, estimate): (i64, f64) = sqlx::query_as(TABLE_SQL).fetch_one(pool).await?;
    let rows = match consumers {
        Some(names) => sqlx::query(SAMPLE_SQL).bind(names).fetch_all(pool).await?,
        None => sqlx::query(ALL_SQL).fetch_all(pool).await?,
    };
    let age = |v: Option<f64>| v.map(|s| Duration::from_secs_f64(s.max(0.0)));
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        out.push(ConsumerMarkers {
            consumer: r.try_get(0)?,
            rows: r.try_get(1)?,
            bytes: 0,
            oldest: age(r.try_get(2)?),
            newest: age(r.try_get(3)?),
        });
    }
    let counted: i64 = out.iter().map(|c| c.rows).sum();
    let total_rows = match consumers {
        None => counted,
        // Other consumers' rows are not counted here: the planner's estimate stands in.
        Some(_) => (estimate as i64).max(counted),
    };
    for c in &mut out {
        if total_rows > 0 {
            c.bytes = (table_bytes as f64 * c.rows as f64 / total_rows as f64) as i64;
        }
    }
    Ok(MarkerState {
        table_bytes: table_bytes.max(0) as u64,
        total_rows,
        consumers: out,
    })
}

/// What a prune would delete, or deleted.
#[derive(Debug, Clone, Serialize)]
pub struct PruneReport {
    /// The consumer name.
    pub consumer: String,
    /// The age past which markers are deleted.
    pub older_than_secs: u64,
    /// Markers deleted (or that would be, on a dry run).
    pub rows: u64,
    /// Delete statements run (each bounded in rows).
    pub batches: u32,
    /// Only counted, nothing deleted.
    pub dry_run: bool,
}

/// Why a prune is refused: the markers it would delete could still be needed.
#[derive(Debug, thiserror::Error)]
#[error("refusing to prune {consumer} markers older than {older_than}: {why}")]
pub struct Refused {
    /// The consumer name.
    pub consumer: String,
    /// The age asked for.
    pub older_than: String,
    /// The contract it breaks.
    pub why: String,
}

/// Checks the replay-horizon contract for deleting `consumer`'s markers older than
/// `older_than`: it must be at least the consumer's `replay_horizon`, at least the stream's
/// `max_age`, and older than the oldest message still in the stream (on the consumer's
/// subjects) and in its dead letters.
pub async fn check_horizon(
    js: &async_nats::jetstream::Context,
    consumer: &ConsumerConfig,
    older_than: Duration,
) -> anyhow::Result<()> {
    let refuse = |why: String| -> anyhow::Result<()> {
        Err(Refused {
            consumer: consumer.name.clone(),
            older_than: human(older_than),
            why,
        }
        .into())
    };
    if older_than < consumer.replay_horizon.0 {
        return refuse(format!(
            "the consumer's replay_horizon is {}: messages that recent may still be replayed",
            human(consumer.replay_horizon.0)
        ));
    }
    let (oldest, max_age) = broker::retention(js, &consumer.stream, &consumer.subjects)
        .await
        .context("reading the stream's retention")?;
    if !max_age.is_zero() && older_than < max_age {
        return refuse(format!(
            "stream {} keeps messages for {} (max_age): a redelivery of one would find no marker",
            consumer.stream,
            human(max_age)
        ));
    }
    if let Some(age) = oldest.filter(|a| *a >= older_than) {
        return refuse(format!(
            "stream {} still holds a message {} old on the consumer's subjects",
            consumer.stream,
            human(age)
        ));
    }
    let dlq = consumer.dead_letter_subject();
    let dlq_stream = js
        .stream_by_subject(dlq.clone())
        .await
        .with_context(|| format!("finding the stream of dead_letter_subject {dlq}"))?;
    let (oldest, _) = broker::retention(js, &dlq_stream, std::slice::from_ref(&dlq)).await?;
    if let Some(age) = oldest.filter(|a| *a >= older_than) {
        return refuse(format!(
            "dead letters on {dlq} include one {} old: replaying it would find no marker",
            human(age)
        ));
    }
    Ok(())
}

/// Deletes (or, with `dry_run`, counts) `consumer`'s markers older than `older_than`, in
/// transactions of at most `batch` rows, oldest first; their `processed_message_handler` rows
/// go with them (a trigger per DELETE on the marker table, migration 0010). The caller checks
/// the horizon first.
pub async fn prune(
    pool: &PgPool,
    consumer: &str,
    older_than: Duration,
    batch: u32,
    dry_run: bool,
) -> anyhow::Result<PruneReport> {
    let secs = older_than.as_secs_f64();
    let mut report = PruneReport {
        consumer: consumer.to_string(),
        older_than_secs: older_than.as_secs(),
        rows: 0,
        batches: 0,
        dry_run,
    };
    if dry_run {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM processed_message \
             WHERE consumer_name = $1 AND processed_at < now() - make_interval(secs => $2)",
        )
        .bind(consumer)
        .bind(secs)
        .fetch_one(pool)
        .await?;
        report.rows = n as u64;
        return Ok(report);
    }
    // The cut-off is fixed once, so the batches agree on it however long they take.
    let cutoff: f64 = sqlx::query_scalar("SELECT extract(epoch FROM now())::float8 - $1")
        .bind(secs)
        .fetch_one(pool)
        .await?;
    loop {
        let deleted = sqlx::query(
            "DELETE FROM processed_message p USING ( \
                 SELECT message_id FROM processed_message \
                 WHERE consumer_name = $1 AND processed_at < to_timestamp($2) \
                 ORDER BY processed_at LIMIT $3 FOR UPDATE SKIP LOCKED) doomed \
             WHERE p.consumer_name = $1 AND p.message_id = doomed.message_id",
        )
        .bind(consumer)
        .bind(cutoff)
        .bind(i64::from(batch))
        .execute(pool)
        .await
        .context("deleting a batch of markers")?
        .rows_affected();
        if deleted == 0 {
            break;
        }
        report.rows += deleted;
        report.batches += 1;
    }
    Ok(report)
}
