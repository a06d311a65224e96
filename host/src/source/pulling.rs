//! Pull requests, sent by the host itself rather than through async-nats's `batch()`.
//!
//! Two reasons. A partition's pulls must carry the group and the pin id or priority (see
//! [`partition`]), and async-nats refuses one-shot pulls on a pinned consumer. And a producer
//! decides a stored message's whole header block, its first line included: a message published with
//! `NATS/1.0 404 No Messages` (or 408, 409, 423, 100, 503) comes back from JetStream with that
//! status, and a client that reads statuses first takes it for the server ending the request.
//! async-nats does: the request ended there, the messages after it in the same request were dropped
//! unseen (and redelivered an `ack_wait` later), and the forged one came back each `ack_wait` to do
//! it again — any producer could slow a consumer to a crawl. Here a message that carries an ack
//! subject (`$JS.ACK.…`, which only a stream message has) is a message, whatever its first line
//! says; only the server's own replies to the request, which have none, are statuses.
//!
//! [`partition`]: super::partition

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::StatusCode;
use async_nats::jetstream;
use futures::StreamExt;
use futures::stream::BoxStream;

use super::partition::{GROUP, Pin};

/// One pull request for up to `batch` messages of `durable` on `stream` (in [`GROUP`] with
/// `pin`'s id or priority, for a partition): the messages the server sends for it, ending when it has sent
/// `batch`, ended the request (timeout, no messages, pin mismatch) or `expires` (and a margin)
/// passed. A reply that ends the request because the consumer is gone is an error.
pub(crate) async fn pull(
    js: &jetstream::Context,
    stream: &str,
    durable: &str,
    pin: Option<&Pin>,
    batch: usize,
    expires: Duration,
) -> anyhow::Result<BoxStream<'static, anyhow::Result<jetstream::Message>>> {
    let client = js.client();
    let inbox = client.new_inbox();
    let sub = client.subscribe(inbox.clone()).await?;
    let mut request = serde_json::json!({
        "batch": batch,
        "expires": expires.as_nanos() as u64,
    });
    if let Some(pin) = pin {
        request["group"] = GROUP.into();
        if let Some(priority) = pin.priority() {
            request["priority"] = priority.into();
        } else if let Some(id) = pin.current() {
            request["id"] = id.into();
        }
    }
    client
        .publish_with_reply(
            format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"),
            inbox,
            request.to_string().into(),
        )
        .await?;
    let deadline = tokio::time::Instant::now() + expires + Duration::from_secs(2);
    // What each step needs, made once per request and moved from step to step (the stream's
    // state), not cloned per message.
    let request = Request {
        pin: pin.cloned(),
        context: js.clone(),
        stream: stream.to_string(),
        durable: durable.to_string(),
    };
    let messages = futures::stream::unfold((sub, batch, request), move |(mut sub, left, r)| {
        async move {
            let Request {
                pin,
                context,
                stream,
                durable,
            } = &r;
            if left == 0 {
                return None;
            }
            loop {
                let message = tokio::time::timeout_at(deadline, sub.next()).await.ok()??;
                let stored = message
                    .reply
                    .as_ref()
                    .is_some_and(|r| r.starts_with("$JS.ACK."));
                if !stored {
                    match message.status.unwrap_or(StatusCode::OK) {
                        StatusCode::IDLE_HEARTBEAT => continue,
                        StatusCode::PIN_ID_MISMATCH => {
                            if let Some(pin) = pin {
                                pin.lost();
                            }
                            return None;
                        }
                        StatusCode::NO_RESPONDERS => {
                            let e = anyhow::anyhow!("no JetStream server answered the pull");
                            return Some((Err(e), (sub, 0, r)));
                        }
                        StatusCode::REQUEST_TERMINATED
                            if message.description.as_deref() == Some("Consumer Deleted") =>
                        {
                            let e = anyhow::anyhow!("the consumer was deleted");
                            return Some((Err(e), (sub, 0, r)));
                        }
                        // The ordinary ends of a request: nothing (left) to deliver.
                        StatusCode::NOT_FOUND
                        | StatusCode::TIMEOUT
                        | StatusCode::REQUEST_TERMINATED => return None,
                        other => {
                            // 400 (a bad request: an unknown priority group), 412, …: the
                            // consumer is not what the host bound; say so, the loop backs off.
                            tracing::warn!(durable = %durable, status = %other,
                                description = message.description.as_deref().unwrap_or(""),
                                "pull request refused");
                            return None;
                        }
                    }
                }
                if let Some(pin) = pin {
                    pin.adopt(context, stream, durable).await;
                }
                let message = jetstream::Message {
                    message,
                    context: context.clone(),
                };
                return Some((Ok(message), (sub, left - 1, r)));
            }
        }
    });
    Ok(messages.boxed())
}

/// One pull request's own state, carried from message to message.
struct Request {
    pin: Option<Pin>,
    context: jetstream::Context,
    stream: String,
    durable: String,
}

/// Pull requests of one message at a time for a while after the client lost its connection
/// during one.
///
/// A message whose header block the client cannot read (bytes that are not UTF-8: JetStream
/// stores what a producer sent) makes async-nats drop the connection when it arrives, and with
/// it every message sent after it for the same request. Those come back an `ack_wait` later,
/// each delivery counted, in a request with the unreadable one again — until the server's
/// `max_deliver` gives up on them all and good messages are dead-lettered with the bad one. The
/// bigger the requests (group commit pulls `2 × max_in_flight × batch_max`), the more of them.
/// After a request during which the client reconnected, the next ones ask for one message each
/// until `2 × ack_wait` (and a request's wait) has passed without another: the redeliveries
/// then come one per request, and only the unreadable message loses its deliveries.
pub(super) struct Caution {
    stats: Arc<async_nats::Statistics>,
    /// How long requests stay single after a reconnect.
    window: Duration,
    until: Option<tokio::time::Instant>,
}

impl Caution {
    pub(super) fn new(client: &async_nats::Client, ack_wait: Duration, expires: Duration) -> Self {
        Caution {
            stats: client.statistics(),
            window: ack_wait * 2 + expires,
            until: None,
        }
    }

    /// How many messages to ask for with `credits` free (all of them, or one while cautious),
    /// and the client's connection count to give [`Caution::after`].
    pub(super) fn ask(&self, credits: usize) -> (usize, u64) {
        let single = self.until.is_some_and(|u| u > tokio::time::Instant::now());
        let n = if single { credits.min(1) } else { credits };
        (n, self.stats.connects.load(Ordering::Relaxed))
    }

    /// Whether the client connected again since `connects` (see [`Caution::ask`]).
    pub(super) fn connected_since(&self, connects: u64) -> bool {
        self.stats.connects.load(Ordering::Relaxed) != connects
    }

    /// After a request: whether the client connected again since `connects` (then requests
    /// are single for the window from now).
    pub(super) fn after(&mut self, connects: u64) -> bool {
        if !self.connected_since(connects) {
            return false;
        }
        self.until = Some(tokio::time::Instant::now() + self.window);
        true
    }
}
