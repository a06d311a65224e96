//! The outbox relay: publishes committed `outbox_message` rows to JetStream and deletes each
//! once the stream acknowledged it. Rows are taken oldest first with `FOR UPDATE SKIP LOCKED`,
//! so the relays of several replicas share the table without taking the same row; the locks
//! are held while publishing, and a relay that dies releases them with its connection — the
//! rows are then published again under the same deterministic id. The relay wakes on
//! `LISTEN idemhost_outbox` (a trigger notifies at commit) and polls every
//! `outbox.poll_interval` besides.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream;
use sqlx::postgres::PgListener;
use sqlx::types::Json;
use sqlx::{PgPool, Row as _};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::event_id;
use crate::config::OutboxConfig;
use crate::failpoint;
use crate::metrics::Metrics;
use crate::pg;

/// The channel the outbox trigger notifies.
pub const CHANNEL: &str = "idemhost_outbox";

const SELECT_SQL: &str = "SELECT id, consumer_name, source_message_id, seq, subject, headers, \
                          payload, extract(epoch FROM now() - created_at)::float8 \
                          FROM outbox_message ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED";

/// Starts the relay. When `stop` turns true it makes one last pass and ends.
pub fn spawn(
    pool: PgPool,
    js: jetstream::Context,
    metrics: Arc<Metrics>,
    config: &OutboxConfig,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let (poll, batch) = (config.poll_interval.0, config.batch);
    tokio::spawn(async move {
        let mut listener = listen(&pool).await;
        let mut backoff = Duration::from_millis(100);
        // Every wake-up drains; after `stop`, one last pass sends what the final deliveries
        // committed, then the relay ends.
        loop {
            match drain(&pool, &js, &metrics, batch).await {
                // A full batch: more may be waiting.
                Ok(n) if n == batch as usize => continue,
                Ok(_) => backoff = Duration::from_millis(100),
                Err(e) => {
                    warn!(
                        error = format!("{e:#}"),
                        ?backoff,
                        "outbox relay pass failed"
                    );
                    if *stop.borrow() {
                        return;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = stop.changed() => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            }
            match oldest(&pool).await {
                Ok(age) => metrics.set_outbox_oldest(age),
                Err(e) => debug!(error = %pg::describe(&e), "outbox age not read"),
            }
            if *stop.borrow() {
                return;
            }
            tokio::select! {
                _ = stop.changed() => {}
                _ = tokio::time::sleep(poll) => {}
                woke = notified(&mut listener) => {
                    if !woke {
                        // The listener failed: poll only until it is back.
                        tokio::time::sleep(poll).await;
                        listener = listen(&pool).await;
                    }
                }
            }
        }
    })
}

async fn listen(pool: &PgPool) -> Option<PgListener> {
    let connected = async {
        let mut l = PgListener::connect_with(pool).await?;
        l.listen(CHANNEL).await?;
        Ok::<_, sqlx::Error>(l)
    }
    .await;
    match connected {
        Ok(l) => Some(l),
        Err(e) => {
            warn!(error = %pg::describe(&e), "outbox relay cannot LISTEN; polling only");
            None
        }
    }
}

/// Waits for a notification; `false` when there is no working listener.
async fn notified(listener: &mut Option<PgListener>) -> bool {
    match listener {
        Some(l) => l.recv().await.is_ok(),
        None => std::future::pending().await,
    }
}

/// Age of the oldest row not yet relayed (zero when none).
async fn oldest(pool: &PgPool) -> Result<Duration, sqlx::Error> {
    let age: Option<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - created_at)::float8 FROM outbox_message ORDER BY id LIMIT 1",
    )
    .fetch_optional(pool)
    .await?;
    Ok(Duration::from_secs_f64(age.unwrap_or(0.0).max(0.0)))
}

/// One pass: up to `batch` rows published (all sent before any acknowledgment is awaited),
/// and the acknowledged ones deleted, in one transaction. Returns the rows taken.
pub async fn drain(
    pool: &PgPool,
    js: &jetstream::Context,
    metrics: &Metrics,
    batch: u32,
) -> anyhow::Result<usize> {
    let mut tx = pool.begin().await?;
    let rows = sqlx::query(SELECT_SQL)
        .bind(i64::from(batch))
        .fetch_all(&mut *tx)
        .await?;
    if rows.is_empty() {
        tx.commit().await?;
        return Ok(0);
    }
    let taken = Instant::now();
    let mut in_flight = Vec::with_capacity(rows.len());
    for row in &rows {
        let id: i64 = row.try_get(0)?;
        let consumer: String = row.try_get(1)?;
        let source: String = row.try_get(2)?;
        let seq: i32 = row.try_get(3)?;
        let subject: String = row.try_get(4)?;
        let Json(headers): Json<Vec<(String, String)>> = row.try_get(5)?;
        let payload: Vec<u8> = row.try_get(6)?;
        let age: f64 = row.try_get(7)?;
        let mut map = HeaderMap::new();
        for (k, v) in &headers {
            map.append(k.as_str(), v.as_str());
        }
        map.insert("Nats-Msg-Id", event_id(&consumer, &source, seq).as_str());
        let sent = js
            .publish_with_headers(subject.clone(), map, payload.into())
            .await;
        in_flight.push((id, consumer, subject, age, sent));
    }
    let mut done = Vec::with_capacity(in_flight.len());
    for (id, consumer, subject, age, sent) in in_flight {
        let acked = match sent {
            Ok(ack) => ack.await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match acked {
            Ok(_) => {
                metrics.outbox_published(
                    &consumer,
                    Duration::from_secs_f64(age.max(0.0)) + taken.elapsed(),
                );
                done.push(id);
            }
            Err(e) => {
                metrics.outbox_failed(&consumer);
                warn!(consumer = %consumer, %subject, outbox_id = id, error = %e, "outbox publish failed; retried next pass");
            }
        }
    }
    failpoint::hit("outbox_after_publish");
    sqlx::query("DELETE FROM outbox_message WHERE id = ANY($1)")
        .bind(&done)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(rows.len())
}
