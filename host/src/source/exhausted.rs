//! Deliveries the host never settled. The host dead-letters a message itself on its last
//! attempt; this catches the ones it never got to judge: a message the NATS client cannot
//! read (a header block that is not UTF-8 drops the connection each time it is delivered), or
//! one whose every delivery crashed the host or lost its connection.
//!
//! The durable consumer's server-side `max_deliver` is the host's `max_deliver + 1`. When the
//! server gives up on a message it publishes a `MAX_DELIVERIES` advisory; a small work-queue
//! stream per consumer keeps those advisories (core NATS alone would lose one sent while no
//! host listens), and a watcher reads each: it fetches the stored message through the raw
//! message API ([`crate::stored`], which never goes through the client's header parser), and unless
//! the marker shows it committed, dead-letters it with the reason, then acks the advisory.

use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::consumer::{Consumer, pull};
use async_nats::jetstream::{self, stream};
use futures::StreamExt;
use serde::Deserialize;
use tokio::sync::watch;
use tracing::{error, info, warn};

use super::ConsumerRuntime;
use super::dead_letter::DeadLetterMessage;
use crate::headers::message_id;
use crate::stored::{Stored, Which};

/// What the watcher's own durable consumer on the advisory stream is called.
const WATCHER: &str = "idemhost-exhausted";

/// The subject the server publishes a consumer's `MAX_DELIVERIES` advisories on.
pub(super) fn advisory_subject(stream: &str, durable: &str) -> String {
    format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{durable}")
}

/// `IDEMHOST_EXHAUSTED_<stream>_<durable>`, with every character a stream name may not hold
/// replaced by `_`.
fn advisory_stream_name(stream: &str, durable: &str) -> String {
    crate::subjects::stream_safe(&format!("IDEMHOST_EXHAUSTED_{stream}_{durable}"))
}

/// Creates (or finds) the advisory stream of one consumer and the watcher's consumer on it.
pub(super) async fn bind(
    js: &jetstream::Context,
    stream: &str,
    durable: &str,
) -> anyhow::Result<Consumer<pull::Config>> {
    let name = advisory_stream_name(stream, durable);
    let advisories = js
        .get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![advisory_subject(stream, durable)],
            retention: stream::RetentionPolicy::WorkQueue,
            max_age: Duration::from_secs(30 * 24 * 3600),
            ..Default::default()
        })
        .await
        .with_context(|| format!("failed to create the advisory stream {name}"))?;
    advisories
        .get_or_create_consumer(
            WATCHER,
            pull::Config {
                durable_name: Some(WATCHER.to_string()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                ..Default::default()
            },
        )
        .await
        .with_context(|| format!("failed to bind the watcher on {name}"))
}

/// The part of a `io.nats.jetstream.advisory.v1.max_deliver` advisory the watcher reads.
#[derive(Deserialize)]
struct Advisory {
    stream_seq: u64,
    deliveries: u64,
}

/// Reads the consumer's advisories until `shutdown`.
pub(super) async fn watch(
    runtime: &ConsumerRuntime,
    watcher: &Consumer<pull::Config>,
    mut shutdown: watch::Receiver<bool>,
) {
    let name = &runtime.config.name;
    let mut backoff = Duration::from_millis(200);
    while !*shutdown.borrow() {
        let messages = tokio::select! {
            m = watcher.messages() => m,
            _ = shutdown.changed() => return,
        };
        let mut messages = match messages {
            Ok(m) => m,
            Err(e) => {
                warn!(consumer = %name, error = %e, "advisory watcher: pull failed");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.changed() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(200);
        loop {
            let next = tokio::select! {
                n = messages.next() => n,
                _ = shutdown.changed() => return,
            };
            let Some(Ok(advisory)) = next else { break };
            let settled = match serde_json::from_slice::<Advisory>(&advisory.payload) {
                Ok(a) => settle(runtime, &a).await,
                Err(e) => {
                    error!(consumer = %name, error = %e, "advisory watcher: unreadable advisory, dropped");
                    Ok(())
                }
            };
            let ack = match settled {
                Ok(()) => advisory.ack().await,
                Err(e) => {
                    warn!(consumer = %name, error = %format!("{e:#}"), "advisory watcher: not settled; retried later");
                    advisory
                        .ack_with(jetstream::AckKind::Nak(Some(Duration::from_secs(2))))
                        .await
                }
            };
            if let Err(e) = ack {
                warn!(consumer = %name, error = %e, "advisory watcher: ack failed; the advisory is redelivered");
            }
        }
    }
}

/// Dead-letters the message an advisory names, unless it is gone from the stream or its
/// marker shows a delivery committed it (a crash after the commit and before the ack).
async fn settle(runtime: &ConsumerRuntime, advisory: &Advisory) -> anyhow::Result<()> {
    let config = &runtime.config;
    let seq = advisory.stream_seq;
    let Some(stored) = crate::stored::get(&runtime.link.js, &config.stream, Which::At(seq)).await?
    else {
        error!(consumer = %config.name, stream_seq = seq,
            "a message ran out of deliveries and is no longer in the stream: nothing to dead-letter");
        return Ok(());
    };
    let Stored {
        subject,
        headers,
        readable,
        payload,
        ..
    } = stored;
    let id = message_id(&headers, &config.id_header, runtime.replay_key.as_deref()).ok();
    if let Some(id) = &id
        && runtime.claimer.marker_exists(id).await?
    {
        info!(consumer = %config.name, message_id = %id, stream_seq = seq,
            "ran out of deliveries after its commit (crash before the ack): nothing to dead-letter");
        return Ok(());
    }
    let why = if readable {
        "each delivery ended without the host settling it (the host crashed or lost its connection)"
    } else {
        "its header block is not valid NATS headers in UTF-8, so the client drops the connection \
         instead of delivering it (headers are copied with invalid bytes replaced)"
    };
    let reason = format!(
        "delivered {} times without being settled: {why}",
        advisory.deliveries
    );
    warn!(consumer = %config.name, stream_seq = seq, %reason, "out of deliveries; dead-lettering");
    let letter = DeadLetterMessage {
        headers,
        id: id.as_deref(),
        stream_seq: seq,
        reason: &reason,
        sqlstate: None,
        attempt: u32::try_from(advisory.deliveries).unwrap_or(u32::MAX),
        subject: &subject,
        payload,
    };
    runtime
        .publish_dead_letter(letter)
        .await
        .map_err(|e| anyhow::anyhow!("dead-letter publish failed: {e}"))?;
    runtime.metrics.dead_lettered();
    Ok(())
}
