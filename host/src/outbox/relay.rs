//! The outbox relay: publishes committed `outbox_message` rows to JetStream and deletes each
//! once the stream acknowledged it. Rows are taken oldest first with `FOR UPDATE SKIP LOCKED`,
//! so the relays of several replicas share the table without taking the same row; the locks
//! are held while publishing, and a relay that dies releases them with its connection — the
//! rows are then published again under the same deterministic id. The relay wakes on
//! `LISTEN idemhost_outbox` (a trigger notifies at commit, naming its schema) and polls every
//! `outbox.poll_interval` besides.
//!
//! A row that fails to publish does not hold up the others: its attempt is counted, its reason
//! kept, and its next attempt moved later (`outbox.retry_base`, doubled per failure up to
//! `outbox.retry_cap`); the relay takes only rows that are due, so the rows behind it flow and
//! a run of failing rows never makes the relay spin. After `outbox.max_attempts` failures the
//! row is set aside (`set_aside_at`): left until an operator runs `idemhost outbox retry`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream;
use async_nats::jetstream::context::PublishErrorKind;
use futures::FutureExt as _;
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

/// Due rows, each consumer's apart: the consumers with due rows (found by skipping along the
/// index of migration 0009 from one consumer to the next), and of each the oldest due rows — at
/// most `$1` rows and, past the first, `$2` bytes of payload — in the order they became due (a
/// new row is due when it was inserted; one delivery's rows share that time and keep their
/// order by id). So one consumer's backlog, or its events that keep failing, never take
/// another consumer's place in a pass, and a pass holds a bounded number of payload bytes.
const SELECT_SQL: &str = "WITH RECURSIVE consumers AS ( \
                              (SELECT consumer_name FROM outbox_message \
                               WHERE set_aside_at IS NULL AND next_attempt_at <= now() \
                               ORDER BY consumer_name LIMIT 1) \
                              UNION ALL \
                              SELECT (SELECT o.consumer_name FROM outbox_message o \
                                      WHERE o.consumer_name > c.consumer_name \
                                        AND o.set_aside_at IS NULL AND o.next_attempt_at <= now() \
                                      ORDER BY o.consumer_name LIMIT 1) \
                              FROM consumers c WHERE c.consumer_name IS NOT NULL), \
                          picked AS ( \
                              SELECT p.id FROM consumers c CROSS JOIN LATERAL ( \
                                  SELECT o.id, octet_length(o.payload) AS len, \
                                         sum(octet_length(o.payload)) OVER (ORDER BY o.next_attempt_at, o.id) AS upto \
                                  FROM outbox_message o \
                                  WHERE o.consumer_name = c.consumer_name \
                                    AND o.set_aside_at IS NULL AND o.next_attempt_at <= now() \
                                  ORDER BY o.next_attempt_at, o.id LIMIT $1) p \
                              WHERE c.consumer_name IS NOT NULL AND p.upto - p.len < $2) \
                          SELECT id, consumer_name, source_message_id, seq, subject, headers, \
                          payload, extract(epoch FROM now() - created_at)::float8 \
                          FROM outbox_message \
                          WHERE id IN (SELECT id FROM picked) \
                            AND set_aside_at IS NULL AND next_attempt_at <= now() \
                          ORDER BY next_attempt_at, id FOR UPDATE SKIP LOCKED";

/// Payload bytes one consumer's rows may hold in a pass (past its first row, which may be up to
/// `max_payload`): what the relay holds in memory is this, times the consumers with due rows.
pub(crate) const PASS_BYTES_PER_CONSUMER: i64 = 4 << 20;

/// Counts one failed attempt of each row in `$1` (reasons in `$2`): the next attempt after
/// `$3` seconds doubled per earlier failure, at most `$4`; set aside at the `$5`-th failure.
const FAILED_SQL: &str = "UPDATE outbox_message o SET attempts = o.attempts + 1, last_error = f.error, \
                          next_attempt_at = clock_timestamp() + make_interval(secs => least($4::float8, $3::float8 * 2 ^ least(o.attempts, 60))), \
                          set_aside_at = CASE WHEN o.attempts + 1 >= $5 THEN clock_timestamp() END \
                          FROM unnest($1::bigint[], $2::text[]) AS f(id, error) WHERE o.id = f.id \
                          RETURNING o.set_aside_at IS NOT NULL";

/// The longest failure reason kept on a row.
const MAX_ERROR_BYTES: usize = 1000;

/// How the relay retries a row that failed to publish (`[outbox]`).
#[derive(Debug, Clone, Copy)]
pub struct Retry {
    /// The first retry delay; doubled each attempt.
    pub base: Duration,
    /// The longest retry delay.
    pub cap: Duration,
    /// Attempts before a row is set aside.
    pub max_attempts: u32,
}

impl From<&OutboxConfig> for Retry {
    fn from(c: &OutboxConfig) -> Self {
        Retry {
            base: c.retry_base.0,
            cap: c.retry_cap.0,
            max_attempts: c.max_attempts.max(1),
        }
    }
}

/// Starts the relay. When `stop` turns true it makes one last pass and ends.
pub fn spawn(
    pool: PgPool,
    js: jetstream::Context,
    metrics: Arc<Metrics>,
    config: &OutboxConfig,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let (poll, batch, retry) = (config.poll_interval.0, config.batch, Retry::from(config));
    tokio::spawn(async move {
        let mut listener = listen(&pool).await;
        // The schema whose notifications wake this relay (see `notified`).
        let mut schema: Option<String> = None;
        let mut backoff = Duration::from_millis(100);
        // Every wake-up drains; after `stop`, one last pass sends what the final deliveries
        // committed, then the relay ends.
        loop {
            metrics.outbox_pass();
            match drain(&pool, &js, &metrics, batch, retry).await {
                // A full batch for some consumer: more may be waiting.
                Ok(n) if n >= batch as usize => continue,
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
            match backlog(&pool).await {
                Ok((age, set_aside)) => {
                    metrics.set_outbox_oldest(age);
                    metrics.set_outbox_set_aside(set_aside);
                }
                Err(e) => debug!(error = %pg::describe(&e), "outbox backlog not read"),
            }
            if *stop.borrow() {
                return;
            }
            if schema.is_none() {
                schema = sqlx::query_scalar("SELECT current_schema()::text")
                    .fetch_one(&pool)
                    .await
                    .ok();
            }
            tokio::select! {
                _ = stop.changed() => {}
                _ = tokio::time::sleep(poll) => {}
                woke = notified(&mut listener, schema.as_deref()) => {
                    if woke {
                        swallow_waiting(&mut listener);
                    } else {
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

/// Waits for a notification about this relay's schema; `false` when there is no working
/// listener.
///
/// Every host's relay listens on one channel: a notification's payload names the schema whose
/// outbox was written (migration 0011), and another schema's wakes nobody here. An empty payload
/// (a schema's trigger from before 0011) counts as this schema's, and so does every payload
/// while the schema is not known yet.
async fn notified(listener: &mut Option<PgListener>, schema: Option<&str>) -> bool {
    let Some(l) = listener else {
        return std::future::pending().await;
    };
    loop {
        match l.recv().await {
            Ok(n) if n.payload().is_empty() || schema.is_none_or(|s| s == n.payload()) => {
                return true;
            }
            Ok(_) => {}
            Err(_) => return false,
        }
    }
}

/// Notifications one wake-up takes in at most; a flood longer than that costs a pass per this
/// many (the pass after it reads every due row anyway).
const SWALLOW_AT_MOST: usize = 10_000;

/// Takes in the notifications already received, without waiting: the pass that follows reads
/// every due row, so they are one wake-up, not one pass each. Every delivery that wrote the
/// outbox notifies at its commit, and a handler may NOTIFY the channel itself with distinct
/// payloads (PostgreSQL folds only equal ones), thousands in one transaction.
fn swallow_waiting(listener: &mut Option<PgListener>) {
    let Some(l) = listener else { return };
    for _ in 0..SWALLOW_AT_MOST {
        // Polled once: ready only if the notification is in already. Dropping the pending
        // future is what a `select!` over `recv` does on every other wake-up too.
        match l.recv().now_or_never() {
            Some(Ok(_)) => {}
            Some(Err(_)) | None => return,
        }
    }
}

/// Age of the oldest row the relay still tries (zero when none), and the rows set aside.
async fn backlog(pool: &PgPool) -> Result<(Duration, i64), sqlx::Error> {
    let (age, set_aside): (Option<f64>, i64) = sqlx::query_as(
        "SELECT (SELECT extract(epoch FROM now() - created_at)::float8 FROM outbox_message \
                 WHERE set_aside_at IS NULL ORDER BY id LIMIT 1), \
                (SELECT count(*) FROM outbox_message WHERE set_aside_at IS NOT NULL)",
    )
    .fetch_one(pool)
    .await?;
    Ok((
        Duration::from_secs_f64(age.unwrap_or(0.0).max(0.0)),
        set_aside,
    ))
}

/// One pass: up to `batch` due rows of each consumer published (all sent before any
/// acknowledgment is awaited, and the acknowledgments awaited together, so a pass lasts at most
/// one publish timeout however many rows time out), the acknowledged ones deleted and the
/// failed ones rescheduled (or set aside), in one transaction. Returns the rows taken.
pub async fn drain(
    pool: &PgPool,
    js: &jetstream::Context,
    metrics: &Metrics,
    batch: u32,
    retry: Retry,
) -> anyhow::Result<usize> {
    let mut tx = pool.begin().await?;
    let rows = sqlx::query(SELECT_SQL)
        .bind(i64::from(batch))
        .bind(PASS_BYTES_PER_CONSUMER)
        .fetch_all(&mut *tx)
        .await?;
    if rows.is_empty() {
        tx.commit().await?;
        return Ok(0);
    }
    let taken = Instant::now();
    let (mut in_flight, mut sends) = (
        Vec::with_capacity(rows.len()),
        Vec::with_capacity(rows.len()),
    );
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
        in_flight.push((id, consumer, subject, age));
        sends.push(sent);
    }
    // Every acknowledgment awaited at once: one subject whose publishes are never answered (a
    // plain subscriber, no stream) costs the pass one timeout, not one per row.
    let acks = futures::future::join_all(sends.into_iter().map(|sent| async move {
        match sent {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        }
    }))
    .await;
    // A publish not answered in time: the broker is down or stopped (an outage: nothing is
    // wrong with the rows), or something listens on the subject without acknowledging (no
    // stream captures it). JetStream's own API tells them apart: it answers only in the second
    // case.
    let timed_out = acks
        .iter()
        .any(|a| matches!(a, Err(e) if e.kind() == PublishErrorKind::TimedOut));
    let broker_answers = timed_out && jetstream_answers(js).await;
    let mut done = Vec::with_capacity(in_flight.len());
    let (mut failed, mut reasons) = (Vec::new(), Vec::new());
    let (mut unanswered, mut unanswered_reasons) = (Vec::new(), Vec::new());
    let mut transient = None;
    for ((id, consumer, subject, age), acked) in in_flight.into_iter().zip(acks) {
        match acked {
            Ok(_) => {
                metrics.outbox_published(
                    &consumer,
                    Duration::from_secs_f64(age.max(0.0)) + taken.elapsed(),
                );
                done.push(id);
            }
            // Not answered in time while JetStream answers: something listens on the subject
            // but does not acknowledge (no stream captures it), or the stream is slow.
            // The row moves out of the way (an attempt counted, its next one later) but is
            // never set aside for this alone: a broker that answers again publishes it.
            Err(e) if broker_answers && e.kind() == PublishErrorKind::TimedOut => {
                metrics.outbox_failed(&consumer);
                debug!(consumer = %consumer, %subject, outbox_id = id, error = %e, "outbox publish not acknowledged");
                unanswered.push(id);
                unanswered_reasons.push(truncated(format!("{subject}: {e}")));
            }
            // The broker does not answer, or the connection is down: nothing is wrong with the
            // row. It is left as it was (no attempt counted) and the pass ends in an error, so
            // the relay backs off as a whole — an outage sets nothing aside.
            Err(e) if transient_failure(&e) => {
                metrics.outbox_failed(&consumer);
                debug!(consumer = %consumer, %subject, outbox_id = id, error = %e, "outbox publish not acknowledged");
                transient.get_or_insert_with(|| format!("{subject}: {e}"));
            }
            Err(e) => {
                metrics.outbox_failed(&consumer);
                debug!(consumer = %consumer, %subject, outbox_id = id, error = %e, "outbox publish failed");
                if reasons.is_empty() {
                    warn!(consumer = %consumer, %subject, outbox_id = id, error = %e, "outbox publish failed; the row is retried later, the rows behind it go on");
                }
                failed.push(id);
                reasons.push(truncated(format!("{subject}: {e}")));
            }
        }
    }
    failpoint::hit("outbox_after_publish");
    sqlx::query("DELETE FROM outbox_message WHERE id = ANY($1)")
        .bind(&done)
        .execute(&mut *tx)
        .await?;
    if !unanswered.is_empty() {
        sqlx::query_scalar::<_, bool>(FAILED_SQL)
            .bind(&unanswered)
            .bind(&unanswered_reasons)
            .bind(retry.base.as_secs_f64())
            .bind(retry.cap.as_secs_f64())
            .bind(i32::MAX)
            .fetch_all(&mut *tx)
            .await?;
        warn!(
            unanswered = unanswered.len(),
            "outbox publishes not acknowledged; those rows are retried later, the others go on"
        );
    }
    if !failed.is_empty() {
        let set_aside: Vec<bool> = sqlx::query_scalar(FAILED_SQL)
            .bind(&failed)
            .bind(&reasons)
            .bind(retry.base.as_secs_f64())
            .bind(retry.cap.as_secs_f64())
            .bind(i32::try_from(retry.max_attempts).unwrap_or(i32::MAX))
            .fetch_all(&mut *tx)
            .await?;
        let set_aside = set_aside.iter().filter(|s| **s).count();
        warn!(
            failed = failed.len(),
            set_aside,
            "outbox rows failed to publish; set-aside rows wait for `idemhost outbox retry`"
        );
    }
    tx.commit().await?;
    match transient {
        Some(first) => Err(anyhow::anyhow!(
            "outbox publishes not acknowledged (first: {first}); retried after a backoff"
        )),
        None => Ok(rows.len()),
    }
}

/// Whether JetStream's API answers at all: any reply to `$JS.API.INFO` (its content is not
/// read: async-nats 0.52 cannot parse NATS 2.9's answer), within the context's timeout.
async fn jetstream_answers(js: &jetstream::Context) -> bool {
    use async_nats::jetstream::context::traits::TimeoutProvider as _;
    let client = js.client();
    let request = client.request("$JS.API.INFO", bytes::Bytes::new());
    matches!(tokio::time::timeout(js.timeout(), request).await, Ok(Ok(_)))
}

/// Whether a publish failed for a reason that is about the broker's reachability rather than
/// the event (no stream captures it, the stream refuses it): those count an attempt, these not.
fn transient_failure(e: &jetstream::context::PublishError) -> bool {
    matches!(
        e.kind(),
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe | PublishErrorKind::MaxAckPending
    )
}

/// `reason`, cut to [`MAX_ERROR_BYTES`] on a character boundary.
fn truncated(mut reason: String) -> String {
    reason.truncate(reason.floor_char_boundary(MAX_ERROR_BYTES));
    reason
}
