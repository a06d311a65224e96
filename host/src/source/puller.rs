//! The puller: a consumer's pull requests, each sized by the credits free, and group commit's
//! gathering. It yields the work the consumer's loop starts — one delivery, or one group — and
//! decides nothing about a delivery once yielded.
//!
//! A credit stands for a message pulled whose transaction has not ended; there are
//! `2 × max_in_flight` (times `batch_max`, see [`pull_credits`]), so at most `max_in_flight`
//! deliveries (or groups) run while as many wait, already fetched, for a slot — the client
//! never buffers more than that. Per message nothing waits unstarted long enough to reach its
//! ack deadline; a group's waiting deliveries are told in progress (see [`Gathering`]). Acks
//! still on their way hold no credit; the server's `max_ack_pending` bounds them. Under load a
//! request waits (briefly) for a quarter of the credits.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;
use tracing::{debug, warn};

use super::gathering::Gathering;
use super::group_limit::GroupLimit;
use super::ordering::Queued;
use super::partition::Pin;
use super::pulling::{self, Caution};
use super::settle::tell_in_progress;
use crate::config::ConsumerConfig;

/// How long one pull request waits for messages before the server ends it.
pub(super) const PULL_EXPIRES: Duration = Duration::from_secs(5);

/// How long a pull waits for more free credits under load.
const GATHER_CREDITS_FOR: Duration = Duration::from_millis(20);

/// What the puller yields. It is moved once, from the puller to the task that runs it, so a
/// delivery is not boxed for it.
#[allow(clippy::large_enum_variant)]
pub(super) enum Pulled {
    /// One delivery (`batch_max` 1); it takes a transaction slot where it runs.
    One(Queued),
    /// A group that is due, with the free transaction slot it runs in.
    Group(Vec<Queued>, OwnedSemaphorePermit),
    /// A gathered group with no slot yet: a pull request ended, or the consumer stops pulling.
    Waiting(Vec<Queued>),
}

/// Where the pulls go: the stream, the durable and, for a partition, this replica's pin.
pub(super) struct Target {
    /// The consumer's own connection.
    pub(super) link: super::Link,
    pub(super) durable: String,
    pub(super) pin: Option<Pin>,
}

/// One pull request under way.
struct Request {
    messages: BoxStream<'static, anyhow::Result<jetstream::Message>>,
    /// The credits of the messages still to come.
    held: Vec<OwnedSemaphorePermit>,
    got: usize,
    asked_at: Instant,
    /// The client's connection count when it was sent (see [`Caution`]).
    connects: u64,
}

/// A consumer's puller (see the module).
pub(super) struct Puller {
    consumer: String,
    stream: String,
    target: Target,
    /// `ordering`: messages may wait behind their key, so requests do not wait for credits.
    ordered: bool,
    batch_max: usize,
    linger: Duration,
    progress_every: Duration,
    /// Credits a request waits for under load: a quarter.
    gather: usize,
    credits: Arc<Semaphore>,
    slots: Arc<Semaphore>,
    group_limit: Arc<GroupLimit>,
    caution: Caution,
    gathering: Gathering,
    request: Option<Request>,
    /// The shutdown signal's sender is gone: as good as shutdown.
    stopped: bool,
    /// A pause before the next request, after one that failed or ended at once with nothing.
    pause: Option<Duration>,
    backoff: Duration,
}

impl Puller {
    /// The puller of `config` on `target`; groups take their slots from `slots`, within
    /// `group_limit`.
    pub(super) fn new(
        config: &ConsumerConfig,
        target: Target,
        slots: Arc<Semaphore>,
        group_limit: Arc<GroupLimit>,
    ) -> Self {
        let credits = pull_credits(config);
        Puller {
            consumer: config.name.clone(),
            stream: config.stream.clone(),
            caution: Caution::new(&target.link.js.client(), config.ack_wait.0, PULL_EXPIRES),
            target,
            ordered: config.ordering.is_some(),
            batch_max: config.batch_max().max(1) as usize,
            linger: config.batch_linger.0,
            progress_every: config.ack_wait.0 / 3,
            gather: (credits / 4).max(1),
            credits: Arc::new(Semaphore::new(credits)),
            slots,
            group_limit,
            gathering: Gathering::default(),
            request: None,
            stopped: false,
            pause: None,
            backoff: Duration::from_millis(100),
        }
    }

    /// The next work to start, or `None` once `shutdown` turns true: then [`Puller::gathered`]
    /// holds what was pulled and not yielded.
    pub(super) async fn next(&mut self, shutdown: &mut watch::Receiver<bool>) -> Option<Pulled> {
        loop {
            if self.stopped || *shutdown.borrow() {
                return None;
            }
            if self.request.is_none() {
                // The request is over: what it gathered starts now rather than wait for the
                // next request.
                if !self.gathering.group.is_empty() {
                    return Some(Pulled::Waiting(self.gathering.take(self.batch_max)));
                }
                if let Some(pause) = self.pause.take() {
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        r = shutdown.changed() => self.stopped |= r.is_err(),
                    }
                    continue;
                }
                self.request = self.send(shutdown).await;
                continue;
            }
            if let Some(work) = self.receive(shutdown).await {
                return Some(work);
            }
        }
    }

    /// What was gathered and not yielded, in groups of up to `batch_max`.
    pub(super) fn gathered(mut self) -> Vec<Vec<Queued>> {
        let mut groups = Vec::new();
        while !self.gathering.group.is_empty() {
            groups.push(self.gathering.take(self.batch_max));
        }
        groups
    }

    /// Waits for a free credit (or a quarter of them under load) and sends a pull request for
    /// as many messages. `None` when shutdown came first or the request failed (then
    /// [`Puller::pause`] is set).
    async fn send(&mut self, shutdown: &mut watch::Receiver<bool>) -> Option<Request> {
        let first = tokio::select! {
            c = self.credits.clone().acquire_owned() => match c {
                Ok(c) => c,
                Err(_) => {
                    self.stopped = true;
                    return None;
                }
            },
            r = shutdown.changed() => {
                self.stopped |= r.is_err();
                return None;
            }
        };
        let mut held = vec![first];
        while let Ok(c) = self.credits.clone().try_acquire_owned() {
            held.push(c);
        }
        // Under load a request per freed credit cost the server a pull request per delivery
        // or two. While fewer than a quarter of the credits are free, more than
        // `max_in_flight` deliveries' worth of messages are pulled and not settled, so some
        // are waiting for a slot and keep the deliveries busy: the request waits for a
        // quarter (for a while at most) instead. Not where messages wait behind their key
        // (`ordering`): those may be all there is.
        if !self.ordered {
            let until = Instant::now() + GATHER_CREDITS_FOR;
            while held.len() < self.gather {
                match tokio::time::timeout_at(until, self.credits.clone().acquire_owned()).await {
                    Ok(Ok(c)) => held.push(c),
                    _ => break,
                }
            }
        }
        let (ask, connects) = self.caution.ask(held.len());
        held.truncate(ask);
        let Target { link, durable, pin } = &mut self.target;
        // A (re)connection from now on ends the request (see `receive`).
        link.connected.borrow_and_update();
        match pulling::pull(
            &link.js,
            &self.stream,
            durable,
            pin.as_ref(),
            ask,
            PULL_EXPIRES,
        )
        .await
        {
            Ok(messages) => Some(Request {
                messages,
                held,
                got: 0,
                asked_at: Instant::now(),
                connects,
            }),
            Err(e) => {
                warn!(consumer = %self.consumer, error = %e, backoff = ?self.backoff, "pull request failed");
                self.pause = Some(self.next_backoff());
                None
            }
        }
    }

    /// Waits on the request under way for its next message, a group due with a free slot, a
    /// linger's end or the waiting group's progress tick. `None` when there is nothing to yield
    /// yet (the caller loops), including when the request ended.
    async fn receive(&mut self, shutdown: &mut watch::Receiver<bool>) -> Option<Pulled> {
        let gathering = &mut self.gathering;
        let request = self.request.as_mut()?;
        let connected = &mut self.target.link.connected;
        let linger = tokio::time::sleep_until(
            gathering
                .until
                .unwrap_or_else(|| Instant::now() + PULL_EXPIRES),
        );
        let progress = tokio::time::sleep_until(
            gathering
                .progress_at
                .unwrap_or_else(|| Instant::now() + PULL_EXPIRES),
        );
        // With no transaction of this consumer running a group starts at once: waiting for
        // company saves nothing there, and a delivery at low load is not delayed.
        let due = gathering.due(self.batch_max)
            || (!gathering.group.is_empty() && self.group_limit.idle());
        let lingering = gathering.lingering(self.batch_max);
        let waiting = gathering.progress_at.is_some();
        // In this order: a due group takes a free slot before more is gathered.
        let next = tokio::select! {
            biased;
            r = shutdown.changed() => {
                self.stopped |= r.is_err();
                return None;
            }
            slot = self.slots.clone().acquire_owned(), if due => {
                return slot.ok().map(|slot| Pulled::Group(gathering.take(self.batch_max), slot));
            }
            n = request.messages.next() => n,
            // The client connected again: the request was lost with the connection, and
            // nothing more comes for it. It ends now, not at its deadline. (Word of the first
            // connection may come after the first request: that one goes on.)
            _ = connected.changed() => {
                if !self.caution.connected_since(request.connects) {
                    // Nothing to yield; the request goes on.
                    return None;
                }
                // Below: the request ends.
                None
            }
            _ = linger, if lingering => return None,
            // The last running group ended: what lingers starts now.
            () = self.group_limit.became_idle(), if lingering && !due => return None,
            _ = progress, if waiting => {
                let waiting: Vec<&jetstream::Message> =
                    gathering.group.iter().map(|(m, _)| m).collect();
                tell_in_progress(&waiting).await;
                gathering.progress_at = Some(Instant::now() + self.progress_every);
                return None;
            }
        };
        match next {
            Some(Ok(msg)) => {
                request.got += 1;
                let Some(credit) = request.held.pop() else {
                    // The server never sends more than asked; if it did, the message is left
                    // unacked and redelivered after ack_wait.
                    warn!(consumer = %self.consumer, "pull returned more messages than requested");
                    return None;
                };
                if self.batch_max > 1 {
                    gathering.push((msg, credit), self.linger, self.progress_every);
                    return None;
                }
                Some(Pulled::One((msg, credit)))
            }
            Some(Err(e)) => {
                debug!(consumer = %self.consumer, error = %e, "pull error");
                self.end_request();
                None
            }
            None => {
                self.end_request();
                None
            }
        }
    }

    /// The request under way is over: caution after a reconnect, and a pause if it ended at
    /// once with nothing.
    fn end_request(&mut self) {
        let Some(request) = self.request.take() else {
            return;
        };
        if self.caution.after(request.connects) {
            warn!(consumer = %self.consumer, "the NATS connection was lost during a pull request; pulling one message at a time for a while, so that a message the client cannot read costs no other message its deliveries");
        }
        // A request the server ends at once with nothing (a consumer gone or refusing pulls)
        // must not turn the loop into a busy one: back off, as after an error.
        if request.got == 0 && request.asked_at.elapsed() < Duration::from_millis(50) {
            self.pause = Some(self.next_backoff());
        } else {
            self.backoff = Duration::from_millis(100);
        }
    }

    /// The pause to take now, doubling the next one (up to 5 s).
    fn next_backoff(&mut self) -> Duration {
        let now = self.backoff;
        self.backoff = (self.backoff * 2).min(Duration::from_secs(5));
        now
    }
}

/// Messages pulled and not yet settled, at most: `2 × max_in_flight` deliveries (or batches
/// of `batch_max`).
pub(super) fn pull_credits(config: &ConsumerConfig) -> usize {
    config.max_in_flight as usize * 2 * config.batch_max().max(1) as usize
}
