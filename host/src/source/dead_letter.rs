//! Dead-lettering: a refused or exhausted delivery is published to the consumer's dead-letter
//! subject with its original headers and payload, its original id in `Idemhost-Message-Id`
//! (what a replay is processed under) and why (the header names are in `crate::headers`); once
//! JetStream stored it, the delivery is terminated. `ops::dlq` lists and replays them.

use async_nats::jetstream::AckKind;
use tracing::{error, info, warn};

use super::ConsumerRuntime;
use super::settle::Delivery;
use crate::headers::{
    DEAD_LETTER_HEADERS, DELIVERY_ATTEMPT_HEADER, FAILED_CONSUMER_HEADER, FAILURE_REASON_HEADER,
    FAILURE_SQLSTATE_HEADER, NATS_MSG_ID_HEADER, ORIGINAL_SUBJECT_HEADER, REPLAY_ID_HEADER,
    header_safe, without,
};

/// A message on its way to the dead-letter subject: its original headers (to which the reason,
/// its SQLSTATE, consumer, original subject and attempt are added), id and stream sequence
/// (which make its broker-level id) and payload.
pub(super) struct DeadLetterMessage<'a> {
    pub(super) headers: async_nats::HeaderMap,
    pub(super) id: Option<&'a str>,
    pub(super) stream_seq: u64,
    pub(super) reason: &'a str,
    /// PostgreSQL's code for the failure, when the server gave one.
    pub(super) sqlstate: Option<&'a str>,
    pub(super) attempt: u32,
    pub(super) subject: &'a str,
    pub(super) payload: bytes::Bytes,
}

impl ConsumerRuntime {
    /// Publishes the message to the dead-letter subject — original headers and payload, the
    /// original id in `Idemhost-Message-Id` (what a replay is processed under), plus the
    /// reason — and, once JetStream stored it, terminates the delivery. If the publish fails
    /// the delivery is nak'ed instead, so nothing is lost.
    ///
    /// The dead letter's broker-level `Nats-Msg-Id` is `<consumer>/<id>/<stream seq>` (or
    /// `<consumer>/seq-<n>` without a valid id): a stream that already saw the original id (the
    /// same stream, or one shared by several consumers' dead letters) would otherwise drop it
    /// as a duplicate, and a replayed copy (a new stream sequence) that fails again must not
    /// be taken for the first dead letter; a second dead-lettering of the same stored message
    /// is still absorbed.
    pub(super) async fn dead_letter(
        &self,
        d: &Delivery,
        id: Option<&str>,
        (reason, sqlstate): (&str, Option<&str>),
    ) {
        let (msg, stream_seq, attempt) = (&d.msg, d.stream_seq, d.attempt);
        let letter = DeadLetterMessage {
            headers: msg.message.headers.clone().unwrap_or_default(),
            id,
            stream_seq,
            reason,
            sqlstate,
            attempt,
            subject: msg.message.subject.as_str(),
            payload: msg.message.payload.clone(),
        };
        match self.publish_dead_letter(letter).await {
            Ok(()) => {
                self.metrics.dead_lettered();
                if let Err(e) = self.confirmed(msg, AckKind::Term).await {
                    warn!(error = %e, "term not confirmed after dead-lettering; a redelivery may be dead-lettered again");
                }
            }
            Err(e) => {
                error!(error = %e, "dead-letter publish failed; nak instead");
                let _ = msg
                    .ack_with(AckKind::Nak(Some(self.config.backoff_for(attempt))))
                    .await;
            }
        }
    }

    /// Publishes a dead letter and waits until JetStream stored it.
    pub(super) async fn publish_dead_letter(
        &self,
        letter: DeadLetterMessage<'_>,
    ) -> Result<(), async_nats::Error> {
        let DeadLetterMessage {
            headers,
            id,
            stream_seq,
            reason,
            sqlstate,
            attempt,
            subject: original_subject,
            payload,
        } = letter;
        // The producer's headers, less those a dead letter carries in the host's word: each is
        // the host's or absent (see `DEAD_LETTER_HEADERS`).
        let mut headers = without(&headers, &DEAD_LETTER_HEADERS);
        if let Some(code) = sqlstate {
            headers.insert(FAILURE_SQLSTATE_HEADER, header_safe(code).as_str());
        }
        let broker_id = match id {
            Some(id) => {
                headers.insert(REPLAY_ID_HEADER, id);
                format!("{}/{id}/{stream_seq}", self.config.name)
            }
            None => format!("{}/seq-{stream_seq}", self.config.name),
        };
        headers.insert(NATS_MSG_ID_HEADER, broker_id.as_str());
        headers.insert(FAILURE_REASON_HEADER, header_safe(reason).as_str());
        headers.insert(FAILED_CONSUMER_HEADER, self.config.name.as_str());
        headers.insert(ORIGINAL_SUBJECT_HEADER, original_subject);
        headers.insert(DELIVERY_ATTEMPT_HEADER, attempt.to_string().as_str());
        let subject = self.config.dead_letter_subject();
        let ack = self
            .link
            .js
            .publish_with_headers(subject.clone(), headers, payload)
            .await?
            .await?;
        if ack.duplicate {
            info!(dead_letter_subject = %subject, "already dead-lettered");
        } else {
            info!(dead_letter_subject = %subject, "dead-lettered");
        }
        Ok(())
    }
}
