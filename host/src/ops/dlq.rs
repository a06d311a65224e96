//! Dead letters: listing a consumer's (`idemhost dlq list`) and replaying them (`idemhost dlq
//! replay`). A replay republishes the message to its original subject under its *original*
//! message id, so the marker decides: a message that never applied applies once, one that did
//! is a duplicate. Reprocessing on purpose takes an explicit repair key — a new id — and is
//! recorded in `dead_letter_repair` before it is published.

use anyhow::Context as _;
use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream::Stream};
use serde::Serialize;
use sqlx::PgPool;

use crate::config::ConsumerConfig;
use crate::headers::{
    DELIVERY_ATTEMPT_HEADER, FAILED_CONSUMER_HEADER, FAILURE_REASON_HEADER, NATS_MSG_ID_HEADER,
    ORIGINAL_SUBJECT_HEADER, REPAIR_OF_HEADER, REPLAY_ID_HEADER, REPLAY_SIGNATURE_HEADER,
    REPLAYED_FROM_HEADER,
};

use super::age_of;
use crate::source::header;
use crate::stored::{self, Which};

/// Dead letters looked at, at most, by one listing (a subject shared by many consumers).
const MAX_SCAN: usize = 100_000;

/// One dead letter of a consumer.
#[derive(Debug, Clone, Serialize)]
pub struct DeadLetter {
    /// The dead-letter stream.
    pub stream: String,
    /// Its sequence in that stream.
    pub seq: u64,
    /// The original message id (`None` when the message was dead-lettered for lacking a valid
    /// one).
    pub message_id: Option<String>,
    /// The subject the message was first published to.
    pub original_subject: Option<String>,
    /// Why it was dead-lettered.
    pub reason: String,
    /// Deliveries the broker had made when it was dead-lettered.
    pub attempts: Option<u32>,
    /// Seconds since it was dead-lettered.
    pub age_secs: f64,
    /// Size of the payload.
    pub payload_bytes: usize,
    #[serde(skip)]
    headers: HeaderMap,
    #[serde(skip)]
    payload: bytes::Bytes,
}

/// `consumer`'s dead-letter stream: its name and handle, read through `js`.
struct DeadLetters {
    name: String,
    stream: Stream<()>,
    js: jetstream::Context,
}

impl DeadLetters {
    async fn of(js: &jetstream::Context, consumer: &ConsumerConfig) -> anyhow::Result<Self> {
        let subject = consumer.dead_letter_subject();
        let name = js
            .stream_by_subject(subject.clone())
            .await
            .with_context(|| format!("no stream captures dead_letter_subject {subject}"))?;
        let stream = js.get_stream_no_info(&name).await?;
        Ok(DeadLetters {
            name,
            stream,
            js: js.clone(),
        })
    }

    /// Up to `limit` of `consumer`'s dead letters, oldest first.
    async fn scan(
        &self,
        consumer: &ConsumerConfig,
        limit: usize,
    ) -> anyhow::Result<Vec<DeadLetter>> {
        let subject = consumer.dead_letter_subject();
        let mut out = Vec::new();
        let mut seq = 1;
        for _ in 0..MAX_SCAN {
            if out.len() >= limit {
                break;
            }
            // Read whatever a producer put in the header block: a dead-letter subject may
            // take a producer's messages too, and one the client cannot read failed the
            // listing (and replay) through the client's getter.
            let Some(m) = stored::get(&self.js, &self.name, Which::FirstFrom(&subject, seq))
                .await
                .with_context(|| format!("reading {subject} from {}", self.name))?
            else {
                break;
            };
            seq = m.seq + 1;
            if header(&m.headers, FAILED_CONSUMER_HEADER).as_deref() != Some(consumer.name.as_str())
            {
                continue;
            }
            out.push(DeadLetter {
                stream: self.name.clone(),
                seq: m.seq,
                message_id: header(&m.headers, REPLAY_ID_HEADER),
                original_subject: header(&m.headers, ORIGINAL_SUBJECT_HEADER),
                reason: header(&m.headers, FAILURE_REASON_HEADER).unwrap_or_default(),
                attempts: header(&m.headers, DELIVERY_ATTEMPT_HEADER).and_then(|a| a.parse().ok()),
                age_secs: age_of(m.stored_at_ns).as_secs_f64(),
                payload_bytes: m.payload.len(),
                headers: m.headers,
                payload: m.payload,
            });
        }
        Ok(out)
    }
}

/// Up to `limit` of `consumer`'s dead letters, oldest first (the subject may be shared: only
/// those whose `Idemhost-Consumer` is this consumer count).
pub async fn list(
    js: &jetstream::Context,
    consumer: &ConsumerConfig,
    limit: usize,
) -> anyhow::Result<Vec<DeadLetter>> {
    DeadLetters::of(js, consumer)
        .await?
        .scan(consumer, limit)
        .await
}

/// Which dead letters to replay.
#[derive(Debug, Clone)]
pub enum Selection {
    /// The dead letters of this original message id.
    MessageId(String),
    /// Every dead letter of the consumer.
    All,
}

/// Reprocessing on purpose: the message is republished under `key`, a new message id.
#[derive(Debug, Clone)]
pub struct Repair {
    /// The new message id: the effect applies again under it.
    pub key: String,
    /// Why it was dead-lettered.
    pub reason: String,
    /// Who asked (recorded in the audit table).
    pub requested_by: String,
}

/// A dead letter sent back to its stream.
#[derive(Debug, Clone, Serialize)]
pub struct Replayed {
    /// The dead letter's sequence.
    pub seq: u64,
    /// The id the replay carries: the original, or the repair key.
    pub message_id: String,
    /// The subject it was republished to.
    pub subject: String,
    /// Stream sequence of the republished message.
    pub published_seq: u64,
}

/// A dead letter not replayed.
#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    /// The dead letter's sequence.
    pub seq: u64,
    /// Why not.
    pub why: String,
}

/// What a replay did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReplayReport {
    /// The dead letters replayed (and removed from the dead-letter stream).
    pub replayed: Vec<Replayed>,
    /// The ones left where they are.
    pub skipped: Vec<Skipped>,
}

/// Replays the selected dead letters of `consumer` and removes each from the dead-letter
/// stream once the original stream stored its copy. With `repair` (one message only), the
/// copy carries the repair key as its id, audited in `dead_letter_repair` in the same
/// transaction that is committed once the copy is stored.
pub async fn replay(
    js: &jetstream::Context,
    pool: &PgPool,
    consumer: &ConsumerConfig,
    selection: &Selection,
    repair: Option<&Repair>,
) -> anyhow::Result<ReplayReport> {
    let dead_letters = DeadLetters::of(js, consumer).await?;
    let letters = dead_letters.scan(consumer, usize::MAX).await?;
    let chosen: Vec<DeadLetter> = match selection {
        Selection::All => letters,
        Selection::MessageId(id) => letters
            .into_iter()
            .filter(|d| d.message_id.as_deref() == Some(id.as_str()))
            .collect(),
    };
    if chosen.is_empty() {
        anyhow::bail!(
            "no dead letters of consumer {} match (see `idemhost dlq list --consumer {}`)",
            consumer.name,
            consumer.name
        );
    }
    if repair.is_some() && chosen.len() != 1 {
        anyhow::bail!(
            "--repair-key replays exactly one dead letter; {} match",
            chosen.len()
        );
    }
    // The key that signs each replay's id (see `REPLAY_SIGNATURE_HEADER`).
    let key: String = sqlx::query_scalar("SELECT key FROM idemhost_key")
        .fetch_one(pool)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "failed to read the host key that signs replays: {} (run `idemhost migrate`)",
                crate::pg::describe(&e)
            )
        })?;
    // The dead letter's own headers and an earlier replay's go; the host writes the replay's.
    let dropped = [
        &crate::headers::DEAD_LETTER_HEADERS[..],
        &[
            REPLAYED_FROM_HEADER,
            REPLAY_SIGNATURE_HEADER,
            REPAIR_OF_HEADER,
        ],
    ]
    .concat();
    let mut report = ReplayReport::default();
    for d in chosen {
        let Some(subject) = d.original_subject.clone() else {
            report.skipped.push(Skipped {
                seq: d.seq,
                why: format!("no {ORIGINAL_SUBJECT_HEADER} header"),
            });
            continue;
        };
        let id = match (repair, &d.message_id) {
            (Some(r), _) => r.key.clone(),
            (None, Some(id)) => id.clone(),
            (None, None) => {
                report.skipped.push(Skipped {
                    seq: d.seq,
                    why: format!(
                        "dead-lettered without a valid message id ({}): only a --repair-key replay can give it one",
                        d.reason
                    ),
                });
                continue;
            }
        };
        let mut headers = crate::headers::without(&d.headers, &dropped);
        let from = format!("{}/{}", d.stream, d.seq);
        headers.insert(REPLAY_ID_HEADER, id.as_str());
        headers.insert(REPLAYED_FROM_HEADER, from.as_str());
        // The host honours the id only with this proof that a replay set it.
        let signature = crate::headers::replay_signature(&key, &id, &from);
        headers.insert(REPLAY_SIGNATURE_HEADER, signature.as_str());
        // The broker's own duplicate window absorbs a second replay of the same dead letter.
        headers.insert(NATS_MSG_ID_HEADER, format!("replay/{from}").as_str());
        let audit = match repair {
            Some(r) => {
                headers.insert(REPAIR_OF_HEADER, d.message_id.as_deref().unwrap_or(""));
                let mut tx = pool.begin().await?;
                sqlx::query(
                    "INSERT INTO dead_letter_repair (consumer_name, repair_key, original_message_id, \
                     reason, requested_by, dead_letter_stream, dead_letter_seq) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7)",
                )
                .bind(&consumer.name)
                .bind(&r.key)
                .bind(d.message_id.as_deref().unwrap_or(""))
                .bind(&r.reason)
                .bind(&r.requested_by)
                .bind(&d.stream)
                .bind(d.seq as i64)
                .execute(&mut *tx)
                .await
                .map_err(|e| match e.as_database_error().and_then(|d| d.code()) {
                    Some(code) if code == "23505" => anyhow::anyhow!(
                        "repair key {} was already used for consumer {} (see dead_letter_repair)",
                        r.key,
                        consumer.name
                    ),
                    _ => anyhow::Error::from(e).context("recording the repair"),
                })?;
                Some(tx)
            }
            None => None,
        };
        let ack = js
            .publish_with_headers(subject.clone(), headers, d.payload.clone())
            .await
            .with_context(|| format!("republishing dead letter {from} to {subject}"))?
            .await
            .with_context(|| format!("JetStream did not store the replay of {from}"))?;
        if let Some(tx) = audit {
            tx.commit().await.with_context(|| {
                format!("the replay of {from} was published but its repair record did not commit")
            })?;
        }
        dead_letters
            .stream
            .delete_message(d.seq)
            .await
            .with_context(|| {
                format!("replayed {from}, but could not remove it from the dead letters")
            })?;
        report.replayed.push(Replayed {
            seq: d.seq,
            message_id: id,
            subject,
            published_seq: ack.sequence,
        });
    }
    Ok(report)
}
