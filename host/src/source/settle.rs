//! Settling deliveries: reading what a delivery carries, running it through the claim pipeline
//! (alone first, then with others in one group-commit transaction), then ack after the commit,
//! nak with backoff, or dead-letter (`dead_letter`) and term.

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use tokio::sync::OwnedSemaphorePermit;
use tracing::{Instrument, debug, info, info_span, warn};

use super::ConsumerRuntime;
use crate::claim::{Outcome, Processed};
use crate::config::ConsumerConfig;
use crate::disposition::{Disposition, disposition};
use crate::failpoint;
use crate::handler::Message;
use crate::headers::{EVENT_TYPE_HEADER, flatten, header, message_id, traceparent};

/// What a delivery holds while its transaction runs: one of `max_in_flight` slots and its
/// pull credit.
pub(super) type Lease = (OwnedSemaphorePermit, OwnedSemaphorePermit);

impl ConsumerRuntime {
    /// Handles one delivery start to finish and settles it with the broker.
    /// `lease` (its `max_in_flight` slot and its pull credit) is given back once the
    /// transaction is over, before the broker is told: the next delivery's transaction, and the
    /// next pull, overlap this one's ack round trip.
    pub(super) async fn settle(&self, msg: jetstream::Message, lease: Lease) {
        let (mut delivery, read) = self.prepare(msg);
        let span = delivery.span.clone();
        // Made in place and instrumented by reference: moved into the span's wrapper, the
        // delivery's whole future was copied once more.
        let delivery_work = pin!(async {
            let Some(mut message) = self.admit(&delivery, read).await else {
                return;
            };
            // Ordered consumers retry a retryable failure in place (the key waits); the others
            // nak it and the broker redelivers later. Each pass is one delivery attempt.
            loop {
                message.delivery_attempt = delivery.attempt;
                // One version from here to the ack: a swap meanwhile affects only later deliveries.
                let active = self.plugin.start_delivery();
                tracing::Span::current().record("plugin", active.version.digest.as_str());
                let work = pin!(self.claimer.process(active.handler.as_ref(), &message));
                let processed = self.with_progress(&[&delivery.msg], work).await;
                self.record(&message, &processed);
                match (
                    disposition(&processed.outcome, delivery.attempt, &self.config),
                    &processed.outcome,
                ) {
                    (Disposition::RetryInPlace { delay }, Outcome::RetryableFailure(reason)) => {
                        let sqlstate = processed.failure.as_ref().and_then(|f| f.sqlstate());
                        warn!(outcome = "retryable_failure", %reason, sqlstate, ?delay, "delivery failed; retried in place, its ordering key waits");
                        self.with_progress(&[&delivery.msg], pin!(tokio::time::sleep(delay)))
                            .await;
                        delivery.attempt += 1;
                        tracing::Span::current().record("attempt", delivery.attempt);
                        self.metrics.started(delivery.attempt);
                    }
                    _ => {
                        drop(lease);
                        return self.conclude(&delivery, &message, &processed).await;
                    }
                }
            }
        });
        delivery_work.instrument(span).await
    }

    /// Group commit: handles `group` in one transaction (see [`Claimer::process_batch`]) on the
    /// transaction `slot` it was given, and settles each delivery with the broker after the
    /// commit, as `settle` would have.
    pub(super) async fn settle_batch(
        self: Arc<Self>,
        slot: OwnedSemaphorePermit,
        group: Vec<(jetstream::Message, OwnedSemaphorePermit)>,
        limit: Arc<super::group_limit::GroupLimit>,
    ) {
        let (pulled, credits): (Vec<_>, Vec<_>) = group.into_iter().unzip();
        let mut ready = Vec::with_capacity(pulled.len());
        let mut messages = Vec::with_capacity(pulled.len());
        for msg in pulled {
            let (delivery, read) = self.prepare(msg);
            let span = delivery.span.clone();
            if let Some(message) = self.admit(&delivery, read).instrument(span).await {
                ready.push(delivery);
                messages.push(message);
            }
        }
        if messages.is_empty() {
            return;
        }
        let active = self.plugin.start_delivery();
        let refs: Vec<&jetstream::Message> = ready.iter().map(|d| &d.msg).collect();
        let work = pin!(
            self.claimer
                .process_batch(active.handler.as_ref(), &messages)
        );
        let results = self.with_progress(&refs, work).await;
        // The transaction is over: the next batch may start, and more be pulled, while these
        // are acked. A group that met a conflict (its messages needed more than one
        // transaction) lowers how many groups run at once.
        let conflicted = results.iter().any(|p| p.tx_attempts > 1);
        let allowed = limit.release(slot, conflicted, messages.len());
        if conflicted {
            debug!(consumer = %self.config.name, allowed, "group met a conflict; fewer groups at once");
        }
        drop(credits);
        let size = messages.len();
        let this = &*self;
        let settled =
            ready
                .iter()
                .zip(&messages)
                .zip(&results)
                .map(|((delivery, message), processed)| {
                    let digest = active.version.digest.as_str();
                    async move {
                        let current = tracing::Span::current();
                        current.record("plugin", digest);
                        current.record("batch", size);
                        this.record(message, processed);
                        this.conclude(delivery, message, processed).await;
                    }
                    .instrument(delivery.span.clone())
                });
        futures::future::join_all(settled).await;
    }

    /// Reads what a delivery carries — attempt, stream sequence, id, event type, trace context
    /// — opens its span, and reads the message the handler gets, or why it cannot be handled
    /// at all (an invalid id, a payload over `max_payload`).
    fn prepare(&self, msg: jetstream::Message) -> (Delivery, Result<Message, Refused>) {
        let (attempt, stream_seq, stored_ns) = match msg.info() {
            Ok(info) => (
                u32::try_from(info.delivered).unwrap_or(u32::MAX).max(1),
                info.stream_sequence,
                Some(info.published.unix_timestamp_nanos()),
            ),
            Err(_) => (1, 0, None),
        };
        self.metrics.started(attempt);
        let headers = msg.message.headers.clone().unwrap_or_default();
        let event_type = header(&headers, EVENT_TYPE_HEADER);
        let trace = traceparent(&headers);
        let id = message_id(&headers, &self.config.id_header, self.replay_key.as_deref());
        // What a delivery's log lines carry; never the payload (`host.log_payload_digest`
        // adds its size and sha256). `outcome` and the durations are filled in as it settles.
        let span = info_span!(
            "idemhost.delivery",
            consumer = %self.config.name,
            message_id = id.as_deref().unwrap_or(""),
            event_type = event_type.as_deref().unwrap_or(msg.message.subject.as_str()),
            trace_id = trace.as_ref().map_or("", |t| t.0.as_str()),
            parent_span_id = trace.as_ref().map_or("", |t| t.1.as_str()),
            attempt,
            stream_seq,
            plugin = tracing::field::Empty,
            outcome = tracing::field::Empty,
            tx_ms = tracing::field::Empty,
            claim_ms = tracing::field::Empty,
            handler_ms = tracing::field::Empty,
            tx_attempts = tracing::field::Empty,
            batch = tracing::field::Empty,
            payload_bytes = tracing::field::Empty,
            payload_sha256 = tracing::field::Empty,
            "messaging.system" = "nats",
            "messaging.operation" = "process",
        );
        #[cfg(feature = "otlp")]
        crate::otel::continue_trace(&span, &headers);
        if self.log_payload_digest {
            use sha2::Digest as _;
            let digest = sha2::Sha256::digest(&msg.message.payload);
            span.record("payload_bytes", msg.message.payload.len());
            span.record("payload_sha256", format!("{digest:x}"));
        }
        let read = read_message(
            &self.config,
            id,
            event_type,
            &headers,
            &msg.message.subject,
            msg.message.payload.clone(),
            attempt,
        );
        let delivery = Delivery {
            msg,
            attempt,
            stream_seq,
            stored_ns,
            span,
        };
        (delivery, read)
    }

    /// The message to handle, or `None` when it was refused before any transaction (then it
    /// is dead-lettered here). Runs inside the delivery's span.
    async fn admit(&self, d: &Delivery, read: Result<Message, Refused>) -> Option<Message> {
        match read {
            Ok(message) => Some(message),
            Err(Refused {
                id,
                event_type,
                reason,
            }) => {
                let event = event_type.unwrap_or_else(|| d.msg.message.subject.to_string());
                self.metrics.settled(&event, "terminal_failure", None);
                tracing::Span::current().record("outcome", "terminal_failure");
                warn!(outcome = "terminal_failure", %reason, "delivery refused");
                self.dead_letter(d, id.as_deref(), (&reason, None)).await;
                None
            }
        }
    }

    /// Counts a processed attempt and records its outcome and durations on the current span.
    fn record(&self, message: &Message, processed: &Processed) {
        self.metrics.settled(
            message.event_type_or_subject(),
            processed.outcome.label(),
            Some(processed),
        );
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let span = tracing::Span::current();
        span.record("outcome", processed.outcome.label());
        span.record("tx_ms", ms(processed.tx_time));
        span.record("claim_ms", ms(processed.claim_time));
        if let Some(h) = processed.handler_time {
            span.record("handler_ms", ms(h));
        }
        span.record("tx_attempts", processed.tx_attempts);
    }

    /// Settles a processed delivery with the broker: ack after a commit, nak with backoff
    /// after a retryable failure, dead-letter after a terminal one or the last attempt.
    async fn conclude(&self, d: &Delivery, message: &Message, processed: &Processed) {
        let tx_ms = processed.tx_time.as_secs_f64() * 1e3;
        let reason = match &processed.outcome {
            Outcome::RetryableFailure(r) | Outcome::TerminalFailure(r) => r.as_str(),
            Outcome::Applied | Outcome::Duplicate => "",
        };
        // PostgreSQL's code for the failure, when the server gave one: logged, and sent with a
        // dead letter.
        let sqlstate = processed.failure.as_ref().and_then(|f| f.sqlstate());
        match disposition(&processed.outcome, d.attempt, &self.config) {
            Disposition::Ack => {
                failpoint::hit("after_commit_before_ack");
                match self.confirmed(&d.msg, AckKind::Ack).await {
                    Ok(()) => {
                        if let Some(stored) = d.stored_ns {
                            self.metrics.acked(crate::clock::age_of(stored));
                        }
                        info!(
                            outcome = processed.outcome.label(),
                            tx_ms,
                            tx_attempts = processed.tx_attempts,
                            "delivery done"
                        )
                    }
                    // The marker is committed: a redelivery will be a duplicate.
                    Err(e) => {
                        warn!(outcome = processed.outcome.label(), error = %e, "ack not confirmed; redelivery will be a duplicate")
                    }
                }
            }
            // Ordered consumers retried in place already (`settle`); a group's parts are not
            // ordered.
            Disposition::Nak { delay } | Disposition::RetryInPlace { delay } => {
                warn!(outcome = "retryable_failure", %reason, sqlstate, ?delay, tx_attempts = processed.tx_attempts, "delivery failed");
                if let Err(e) = d.msg.ack_with(AckKind::Nak(Some(delay))).await {
                    warn!(error = %e, "nak failed; the broker redelivers after ack_wait");
                }
            }
            Disposition::DeadLetter {
                out_of_attempts: true,
            } => {
                let key_note = if self.ordering.is_some() {
                    "; its ordering key moves on"
                } else {
                    ""
                };
                let reason = format!(
                    "{reason} (after {} deliveries, max_deliver {}{key_note})",
                    d.attempt, self.config.max_deliver
                );
                warn!(outcome = "retryable_failure", %reason, sqlstate, "out of attempts; dead-lettering");
                self.dead_letter(d, Some(&message.id), (&reason, sqlstate))
                    .await;
            }
            Disposition::DeadLetter {
                out_of_attempts: false,
            } => {
                warn!(outcome = "terminal_failure", %reason, sqlstate, "delivery failed; dead-lettering");
                self.dead_letter(d, Some(&message.id), (reason, sqlstate))
                    .await;
            }
        }
    }

    /// Sends `kind` and waits for the server's confirmation (JetStream's "double ack"), as a
    /// request through the client's shared reply inbox: one round trip, no subscription per
    /// ack. Bounded by `nats.request_timeout`.
    pub(super) async fn confirmed(
        &self,
        msg: &jetstream::Message,
        kind: AckKind,
    ) -> Result<(), async_nats::Error> {
        let reply = msg
            .message
            .reply
            .clone()
            .ok_or("not a JetStream message: no reply subject")?;
        self.client.request(reply, kind.into()).await?;
        Ok(())
    }

    /// Runs `work`, telling JetStream the delivery is in progress every third of `ack_wait` so
    /// a slow (but bounded) delivery is not redelivered to someone else meanwhile (see
    /// [`progress_while`]).
    pub(super) async fn with_progress<T>(
        &self,
        msgs: &[&jetstream::Message],
        work: Pin<&mut impl Future<Output = T>>,
    ) -> T {
        progress_while(self.config.ack_wait.0 / 3, msgs, work).await
    }
}

/// Runs `work`, telling JetStream `msgs` are in progress every `every`. `work` is pinned where
/// the caller made it: a delivery's work is its whole transaction, a future of several
/// kilobytes, and one taken by value was held twice in this one's state (the argument and its
/// pinned copy) and copied into it; the task that runs a delivery was then copied whole when
/// spawned (34 KB, for every delivery).
pub(super) async fn progress_while<T>(
    every: Duration,
    msgs: &[&jetstream::Message],
    mut work: Pin<&mut impl Future<Output = T>>,
) -> T {
    loop {
        tokio::select! {
            out = work.as_mut() => return out,
            _ = tokio::time::sleep(every) => tell_in_progress(msgs).await,
        }
    }
}

/// One delivery from pull to ack: the broker's message, what `prepare` read from it — the
/// attempt (an ordered consumer's retry in place advances it), its place in the stream, when
/// the stream stored it — and the span its log lines go to.
pub(super) struct Delivery {
    pub(super) msg: jetstream::Message,
    pub(super) attempt: u32,
    pub(super) stream_seq: u64,
    pub(super) stored_ns: Option<i128>,
    pub(super) span: tracing::Span,
}

/// Why a delivery is refused before any transaction, with its valid id (if any) and event
/// type, as `prepare` read them.
pub(crate) struct Refused {
    pub(crate) id: Option<String>,
    pub(crate) event_type: Option<String>,
    pub(crate) reason: String,
}

/// The message a handler gets from a delivery's parts — or why it is refused before any
/// transaction (an invalid id: `id` as [`message_id`] read it; a payload over `max_payload`).
/// One place for the rules, which `idemhost plugin test` applies to its message too.
pub(crate) fn read_message(
    config: &ConsumerConfig,
    id: Result<String, String>,
    event_type: Option<String>,
    headers: &async_nats::HeaderMap,
    subject: &str,
    payload: bytes::Bytes,
    attempt: u32,
) -> Result<Message, Refused> {
    let too_big = (payload.len() as u64 > config.max_payload.0).then(|| {
        format!(
            "payload is {} bytes, over the consumer's max_payload of {} bytes",
            payload.len(),
            config.max_payload.0
        )
    });
    match (id, too_big) {
        (Ok(id), None) => Ok(Message {
            id,
            subject: subject.to_string(),
            event_type,
            headers: flatten(headers),
            payload,
            delivery_attempt: attempt,
        }),
        (Ok(id), Some(reason)) => Err(Refused {
            id: Some(id),
            event_type,
            reason,
        }),
        (Err(reason), _) => Err(Refused {
            id: None,
            event_type,
            reason,
        }),
    }
}

/// Tells JetStream each of `msgs` is in progress (its `ack_wait` starts over).
pub(super) async fn tell_in_progress(msgs: &[&jetstream::Message]) {
    for msg in msgs {
        if let Err(e) = msg.ack_with(AckKind::Progress).await {
            debug!(error = %e, "in-progress ack failed");
        }
    }
}
