//! `idemhost outbox list | retry`: the outbox rows the relay could not publish. A row that
//! failed `outbox.max_attempts` times is set aside (see `crate::outbox::relay`); the operator
//! lists them with their reason and, once the cause is fixed (a stream now captures the
//! subject), sends them again. A retried row is published under its deterministic id: a copy
//! that did reach the stream is dropped by the stream within its duplicate window, and by a
//! downstream idemhost consumer's marker after it.

use serde::Serialize;
use sqlx::PgPool;

/// One outbox row the relay has not published yet.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Row {
    /// The row's id.
    pub id: i64,
    /// The consumer whose delivery published it.
    pub consumer: String,
    /// The message whose handling published it.
    pub source_message_id: String,
    /// Its place among that delivery's events.
    pub seq: i32,
    /// Where it goes.
    pub subject: String,
    /// Failed publish attempts so far.
    pub attempts: i32,
    /// The last attempt's error.
    pub last_error: Option<String>,
    /// Seconds since it was committed.
    pub age_secs: f64,
    /// Seconds until the relay tries it again (0: due); `None` when set aside.
    pub next_attempt_in_secs: Option<f64>,
    /// Given up on after `outbox.max_attempts`: sent again only by `outbox retry`.
    pub set_aside: bool,
}

/// Which rows [`list`] and [`retry`] act on.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this consumer's rows.
    pub consumer: Option<String>,
    /// Every row not yet published (failing or not), not only the set-aside ones.
    pub pending_too: bool,
    /// Only these rows.
    pub ids: Vec<i64>,
}

/// The rows matching `filter`, oldest first, at most `limit`.
pub async fn list(pool: &PgPool, filter: &Filter, limit: i64) -> Result<Vec<Row>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, consumer_name AS consumer, source_message_id, seq, subject, attempts, last_error, \
                extract(epoch FROM now() - created_at)::float8 AS age_secs, \
                CASE WHEN set_aside_at IS NULL \
                     THEN greatest(extract(epoch FROM next_attempt_at - now())::float8, 0) END \
                  AS next_attempt_in_secs, \
                set_aside_at IS NOT NULL AS set_aside \
         FROM outbox_message \
         WHERE ($1::text IS NULL OR consumer_name = $1) \
           AND ($2 OR set_aside_at IS NOT NULL OR attempts > 0) \
           AND (cardinality($3::bigint[]) = 0 OR id = ANY($3)) \
         ORDER BY id LIMIT $4",
    )
    .bind(&filter.consumer)
    .bind(filter.pending_too)
    .bind(&filter.ids)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// Makes the set-aside rows matching `filter` due again with their attempts reset (and wakes
/// the relays); the number of rows.
pub async fn retry(pool: &PgPool, filter: &Filter) -> Result<u64, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let n = sqlx::query(
        "UPDATE outbox_message SET set_aside_at = NULL, attempts = 0, next_attempt_at = now() \
         WHERE set_aside_at IS NOT NULL \
           AND ($1::text IS NULL OR consumer_name = $1) \
           AND (cardinality($2::bigint[]) = 0 OR id = ANY($2))",
    )
    .bind(&filter.consumer)
    .bind(&filter.ids)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    sqlx::query("SELECT pg_notify($1, current_schema())")
        .bind(crate::outbox::relay::CHANNEL)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(n)
}
