//! JetStream: binding a consumer's stream and durable pull consumer, the pull loop bounded by
//! `max_in_flight`, and settling each delivery — ack (confirmed) after commit, nak with backoff,
//! or dead-letter with the original id, headers and payload, then term.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::consumer::{Consumer, pull};
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::claim::Claimer;
use crate::config::ConsumerConfig;
use crate::metrics::{ConsumerMetrics, EventTypeLabels, Metrics};
use crate::registry::Slot;

mod dead_letter;
mod disposition;
mod exhausted;
mod gathering;
mod group_limit;
pub(crate) mod ordering;
pub mod partition;
#[cfg(test)]
mod props;
mod provision;
pub(crate) use provision::check as check_consumer;
mod pulling;
mod settle;
pub(crate) use crate::headers::header;
use gathering::Gathering;
use ordering::{KeySpec, KeyedQueues};
pub(crate) use settle::read_message;

/// Connects to NATS with the configured timeouts; the JetStream context's requests are bounded
/// by `nats.request_timeout`.
pub async fn connect_nats(
    config: &crate::config::NatsConfig,
) -> crate::error::Result<(async_nats::Client, async_nats::jetstream::Context)> {
    // Several servers (a cluster) are comma-separated; the client tries them in turn and then
    // also the ones the cluster announces.
    let servers: Vec<&str> = config
        .url
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect();
    let mut options = async_nats::ConnectOptions::new()
        .connection_timeout(config.connect_timeout.0)
        .request_timeout(Some(config.request_timeout.0))
        .custom_inbox_prefix(&config.inbox_prefix);
    // The client does not read credentials from a URL: `nats://user:password@host` (or
    // `nats://token@host`) in the first server's URL is given to it here.
    if let Some((user, password)) = servers.first().and_then(|u| url_credentials(u)) {
        options = match password {
            Some(password) => options.user_and_password(user, password),
            None => options.token(user),
        };
    }
    let client = options.connect(servers).await.with_context(|| {
        format!(
            "failed to connect to NATS at {}",
            crate::pg::redact_urls(&config.url)
        )
    })?;
    let mut js = async_nats::jetstream::new(client.clone());
    js.set_timeout(config.request_timeout.0);
    Ok((client, js))
}

/// The user and password (or the token, a user without a password) of a server URL,
/// percent-decoded.
fn url_credentials(server: &str) -> Option<(String, Option<String>)> {
    let url = url::Url::parse(server).ok()?;
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    if url.username().is_empty() {
        return None;
    }
    Some((decode(url.username()), url.password().map(decode)))
}

/// How long one pull request waits for messages before the server ends it.
const PULL_EXPIRES: Duration = Duration::from_secs(5);

/// A bound consumer: its durable pull consumer, its handler and its claim pipeline.
pub(crate) struct ConsumerRuntime {
    pub config: ConsumerConfig,
    js: jetstream::Context,
    client: async_nats::Client,
    claimer: Claimer,
    /// The consumer's plugin slot: each delivery runs on the version current when it starts.
    plugin: Arc<Slot>,
    metrics: ConsumerMetrics,
    /// `host.log_payload_digest`.
    log_payload_digest: bool,
    /// `ordering.key`: deliveries with the same key run one at a time, in arrival order.
    ordering: Option<KeySpec>,
    keyed: KeyedQueues,
    /// Places for messages waiting behind their key without a pull credit
    /// (`ordering.max_waiting`).
    waiting: Arc<Semaphore>,
    /// The watcher's consumer on this consumer's advisory stream (see [`exhausted`]).
    exhausted: Option<Consumer<pull::Config>>,
    /// The durable consumer's name.
    durable: String,
    /// With `partitions`: this runtime's partition durable and this replica's pin on it.
    partition: Option<(String, partition::Pin)>,
    /// The schema's host key, which signs the replay ids this host honours (see
    /// [`crate::headers::REPLAY_SIGNATURE_HEADER`]).
    replay_key: Option<String>,
}

/// Provisions the consumer on the broker ([`provision`]) — of `partition`, with `partitions`
/// (see [`partition`]), pinned or with a `spread` — and makes its runtime.
pub(crate) async fn bind(
    js: &jetstream::Context,
    config: &ConsumerConfig,
    partition: Option<u32>,
    spread: Option<partition::Spread>,
    claimer: Claimer,
    plugin: Arc<Slot>,
    metrics: &Metrics,
) -> anyhow::Result<ConsumerRuntime> {
    let name = &config.name;
    let replay_key = Some(
        claimer
            .host_key()
            .await
            .map_err(|e| anyhow::anyhow!("consumer {name}: failed to read the host key: {e}"))?,
    );
    let provision::Provisioned {
        durable,
        exhausted,
        prioritized,
    } = provision::provision(js, config, partition, spread).await?;
    Ok(ConsumerRuntime {
        config: config.clone(),
        js: js.clone(),
        client: js.client(),
        claimer,
        plugin,
        metrics: metrics.for_consumer(
            &config.name,
            EventTypeLabels::new(
                &config.event_type_labels,
                config.max_event_type_labels as usize,
            ),
        ),
        log_payload_digest: false,
        ordering: match &config.ordering {
            Some(o) => Some(
                KeySpec::parse(&o.key)
                    .map_err(|e| anyhow::anyhow!("consumer {name}: ordering.key {e}"))?,
            ),
            None => None,
        },
        keyed: KeyedQueues::default(),
        waiting: Arc::new(Semaphore::new(max_waiting(config))),
        exhausted,
        partition: partition.map(|p| {
            let pin = partition::Pin::new(config, p, prioritized, spread);
            (durable.clone(), pin)
        }),
        replay_key,
        durable,
    })
}

impl ConsumerRuntime {
    /// Logs each delivery's payload size and sha256 (`host.log_payload_digest`).
    pub(crate) fn log_payload_digest(mut self, on: bool) -> Self {
        self.log_payload_digest = on;
        self
    }

    /// Starts one pulled message (one transaction per delivery): behind a running delivery of
    /// its ordering key, that key's worker takes it; otherwise it runs on its own task once a
    /// `max_in_flight` slot is free.
    fn dispatch(
        self: &Arc<Self>,
        tasks: &mut JoinSet<()>,
        slots: &Arc<Semaphore>,
        msg: jetstream::Message,
        credit: OwnedSemaphorePermit,
    ) {
        let (this, slots) = (self.clone(), slots.clone());
        match self.ordering.as_ref().and_then(|k| k.key_of(&msg.message)) {
            Some(key) => {
                if let Some(first) = self.keyed.enqueue(&key, (msg, credit), &self.waiting) {
                    tasks.spawn(this.key_worker(slots, key, first));
                }
            }
            None => {
                tasks.spawn(async move {
                    if let Ok(slot) = slots.acquire_owned().await {
                        this.settle(msg, (slot, credit)).await;
                    }
                });
            }
        }
    }

    /// Pulls and handles deliveries until `shutdown` turns true, then stops pulling and lets
    /// in-flight deliveries finish for up to `drain`; what is still running then is dropped
    /// (rolled back, not acked — the broker redelivers it).
    ///
    /// Pulling is explicit: each pull request asks for exactly as many messages as there are
    /// free credits. A credit stands for a message pulled whose transaction has not ended;
    /// there are `2 × max_in_flight` (times `batch_max`), so at most `max_in_flight`
    /// deliveries (or groups) run while as many wait, already fetched, for a slot — the client
    /// never buffers more than that. Per message nothing waits unstarted long enough to reach
    /// its ack deadline; a group's waiting deliveries are told in progress (see [`Gathering`]).
    /// Acks still on their way hold no credit; the server's `max_ack_pending` bounds them.
    /// Under load a request waits (briefly) for a quarter of the credits.
    pub(crate) async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>, drain: Duration) {
        let batch_max = self.config.batch_max().max(1) as usize;
        let progress_every = self.config.ack_wait.0 / 3;
        let slots = Arc::new(Semaphore::new(self.config.max_in_flight as usize));
        let group_limit = Arc::new(group_limit::GroupLimit::new(
            slots.clone(),
            self.config.max_in_flight as usize,
        ));
        let credits = Arc::new(Semaphore::new(pull_credits(&self.config)));
        let gather = (pull_credits(&self.config) / 4).max(1);
        let mut gathering = Gathering::default();
        let mut caution = pulling::Caution::new(&self.client, self.config.ack_wait.0, PULL_EXPIRES);
        let mut tasks = JoinSet::new();
        let mut backoff = Duration::from_millis(100);
        let watcher = {
            let (this, shutdown) = (self.clone(), shutdown.clone());
            tokio::spawn(async move {
                if let Some(w) = &this.exhausted {
                    exhausted::watch(&this, w, shutdown).await;
                }
            })
        };
        let waiting_progress = self
            .ordering
            .is_some()
            .then(|| tokio::spawn(self.clone().keep_waiting_in_progress()));
        'pull: while !*shutdown.borrow() {
            let first = tokio::select! {
                c = credits.clone().acquire_owned() => match c { Ok(c) => c, Err(_) => break 'pull },
                _ = shutdown.changed() => break 'pull,
            };
            let mut held = vec![first];
            while let Ok(c) = credits.clone().try_acquire_owned() {
                held.push(c);
            }
            // Under load a request per freed credit cost the server a pull request per delivery
            // or two. While fewer than a quarter of the credits are free, more than
            // `max_in_flight` deliveries' worth of messages are pulled and not settled, so some
            // are waiting for a slot and keep the deliveries busy: the request waits for a
            // quarter (for a while at most) instead. Not where messages wait behind their key
            // (`ordering`): those may be all there is.
            if self.ordering.is_none() {
                let until = tokio::time::Instant::now() + GATHER_CREDITS_FOR;
                while held.len() < gather {
                    match tokio::time::timeout_at(until, credits.clone().acquire_owned()).await {
                        Ok(Ok(c)) => held.push(c),
                        _ => break,
                    }
                }
            }
            while tasks.try_join_next().is_some() {}
            let (ask, connects) = caution.ask(held.len());
            held.truncate(ask);
            let batch = self.pull(ask).await;
            let mut batch = match batch {
                Ok(b) => b,
                Err(e) => {
                    warn!(consumer = %self.config.name, error = %e, ?backoff, "pull request failed");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = shutdown.changed() => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            let asked_at = tokio::time::Instant::now();
            let mut got = 0usize;
            loop {
                let linger = tokio::time::sleep_until(
                    gathering
                        .until
                        .unwrap_or_else(|| tokio::time::Instant::now() + PULL_EXPIRES),
                );
                let progress = tokio::time::sleep_until(
                    gathering
                        .progress_at
                        .unwrap_or_else(|| tokio::time::Instant::now() + PULL_EXPIRES),
                );
                // With no transaction of this consumer running a group starts at once: waiting
                // for company saves nothing there, and a delivery at low load is not delayed.
                let due =
                    gathering.due(batch_max) || (!gathering.group.is_empty() && group_limit.idle());
                let lingering = gathering.lingering(batch_max);
                let waiting = gathering.progress_at.is_some();
                // In this order: a due group takes a free slot before more is gathered.
                let next = tokio::select! {
                    biased;
                    _ = shutdown.changed() => break 'pull,
                    slot = slots.clone().acquire_owned(), if due => {
                        if let Ok(slot) = slot {
                            let group = gathering.take(batch_max);
                            tasks.spawn(self.clone().settle_batch(slot, group, group_limit.clone()));
                        }
                        continue;
                    }
                    n = batch.next() => n,
                    _ = linger, if lingering => continue,
                    // The last running group ended: what lingers starts now.
                    () = group_limit.became_idle(), if lingering && !due => continue,
                    _ = progress, if waiting => {
                        let waiting: Vec<&jetstream::Message> =
                            gathering.group.iter().map(|(m, _)| m).collect();
                        settle::tell_in_progress(&waiting).await;
                        gathering.progress_at = Some(tokio::time::Instant::now() + progress_every);
                        continue;
                    }
                };
                match next {
                    Some(Ok(msg)) => {
                        got += 1;
                        let Some(credit) = held.pop() else {
                            // The server never sends more than asked; if it did, the message
                            // is left unacked and redelivered after ack_wait.
                            warn!(consumer = %self.config.name, "pull returned more messages than requested");
                            continue;
                        };
                        if batch_max > 1 {
                            gathering.push(
                                (msg, credit),
                                self.config.batch_linger.0,
                                progress_every,
                            );
                            continue;
                        }
                        self.dispatch(&mut tasks, &slots, msg, credit);
                    }
                    Some(Err(e)) => {
                        debug!(consumer = %self.config.name, error = %e, "pull error");
                        break;
                    }
                    None => break,
                }
            }
            if caution.after(connects) {
                warn!(consumer = %self.config.name, "the NATS connection was lost during a pull request; pulling one message at a time for a while, so that a message the client cannot read costs no other message its deliveries");
            }
            // The pull request is over: what it gathered starts now rather than wait for the
            // next request.
            self.start_batches(
                &mut tasks,
                (&slots, &group_limit),
                &mut gathering,
                batch_max,
            );
            // A request the server ends at once with nothing (a consumer gone or refusing
            // pulls) must not turn this loop into a busy one: back off, as after an error.
            if got == 0 && asked_at.elapsed() < Duration::from_millis(50) {
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.changed() => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            } else {
                backoff = Duration::from_millis(100);
            }
        }
        // Already pulled: handled like the other in-flight deliveries.
        self.start_batches(
            &mut tasks,
            (&slots, &group_limit),
            &mut gathering,
            batch_max,
        );
        info!(consumer = %self.config.name, in_flight = tasks.len(), "stopped pulling, draining");
        let drained =
            tokio::time::timeout(drain, async { while tasks.join_next().await.is_some() {} }).await;
        if drained.is_err() {
            warn!(consumer = %self.config.name, left = tasks.len(), "drain timeout; rolling back unfinished deliveries");
            tasks.shutdown().await;
        }
        watcher.abort();
        let _ = watcher.await;
        if let Some(progress) = waiting_progress {
            progress.abort();
            let _ = progress.await;
        }
    }

    /// One pull request for up to `n` messages (see [`pulling`]).
    async fn pull(
        &self,
        n: usize,
    ) -> anyhow::Result<futures::stream::BoxStream<'static, anyhow::Result<jetstream::Message>>>
    {
        let (durable, pin) = match &self.partition {
            Some((durable, pin)) => (durable.as_str(), Some(pin)),
            None => (self.durable.as_str(), None),
        };
        pulling::pull(&self.js, &self.config.stream, durable, pin, n, PULL_EXPIRES).await
    }

    /// Tells the broker, every third of `ack_wait`, that each message waiting behind a running
    /// delivery of its key is in progress: it was pulled and will be handled in its turn, so
    /// it must not be redelivered (which would count an attempt it never had, and could
    /// dead-letter it).
    async fn keep_waiting_in_progress(self: Arc<Self>) {
        let every = self.config.ack_wait.0 / 3;
        loop {
            tokio::time::sleep(every).await;
            for reply in self.keyed.waiting_replies() {
                if let Err(e) = self.client.publish(reply, AckKind::Progress.into()).await {
                    debug!(consumer = %self.config.name, error = %e, "in-progress ack failed");
                }
            }
        }
    }

    /// Starts every gathered delivery, in groups of up to `batch_max`, each as soon as a slot
    /// is free (told in progress while it waits for one), and clears the gathering.
    fn start_batches(
        self: &Arc<Self>,
        tasks: &mut JoinSet<()>,
        (slots, limit): (&Arc<Semaphore>, &Arc<group_limit::GroupLimit>),
        gathering: &mut Gathering,
        batch_max: usize,
    ) {
        while !gathering.group.is_empty() {
            let group = gathering.take(batch_max);
            let (this, slots, limit) = (self.clone(), slots.clone(), limit.clone());
            tasks.spawn(async move {
                let waiting: Vec<&jetstream::Message> = group.iter().map(|(m, _)| m).collect();
                let slot = this.with_progress(&waiting, slots.acquire_owned()).await;
                if let Ok(slot) = slot {
                    this.settle_batch(slot, group, limit).await;
                }
            });
        }
    }

    /// Settles `key`'s deliveries one after another, in arrival order, until none waits.
    async fn key_worker(
        self: Arc<Self>,
        slots: Arc<Semaphore>,
        key: String,
        first: ordering::Queued,
    ) {
        let mut next = Some(first);
        while let Some((msg, credit)) = next {
            let slot = self
                .with_progress(&[&msg], slots.clone().acquire_owned())
                .await;
            if let Ok(slot) = slot {
                self.settle(msg, (slot, credit)).await;
            }
            next = self.keyed.next(&key);
            if let Some((msg, _)) = &next {
                // Its turn: in progress from here, whatever the waiting ticker last sent.
                if let Err(e) = msg.ack_with(AckKind::Progress).await {
                    debug!(consumer = %self.config.name, error = %e, "in-progress ack failed");
                }
            }
        }
    }
}

/// `ordering.max_waiting` (0 without ordering).
fn max_waiting(config: &ConsumerConfig) -> usize {
    config
        .ordering
        .as_ref()
        .map_or(0, |o| o.max_waiting as usize)
}

/// How long a pull waits for more free credits under load (see
/// [`ConsumerRuntime::run`]).
const GATHER_CREDITS_FOR: Duration = Duration::from_millis(20);

/// Messages pulled and not yet settled, at most: `2 × max_in_flight` deliveries (or batches
/// of `batch_max`).
fn pull_credits(config: &ConsumerConfig) -> usize {
    config.max_in_flight as usize * 2 * config.batch_max().max(1) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Credits bound what is pulled and not settled: two rounds of `max_in_flight` deliveries,
    /// or of groups of `batch_max`; ordering's waiting room is its `max_waiting`, none without.
    #[test]
    fn pull_credits_cover_two_rounds_of_what_may_run_at_once() {
        let consumer = |extra: &str| {
            let text = format!(
                "[postgres]\nurl = \"postgres://h/d\"\n[[consumer]]\nname = \"c\"\nstream = \"S\"\nplugin = \"x.wasm\"\n{extra}"
            );
            let config = crate::Config::from_toml(
                &text,
                std::iter::empty(),
                "t.toml".as_ref(),
                ".".as_ref(),
            )
            .unwrap();
            config.consumers[0].clone()
        };
        for (extra, credits) in [
            ("max_in_flight = 1\nbatch_max = 1", 2),
            ("max_in_flight = 16\nbatch_max = 1", 32),
            ("max_in_flight = 4\nbatch_max = 16", 128),
            (
                "max_in_flight = 16",
                2 * 16 * crate::config::DEFAULT_BATCH_MAX as usize,
            ),
        ] {
            assert_eq!(pull_credits(&consumer(extra)), credits, "{extra}");
        }
        assert_eq!(max_waiting(&consumer("batch_max = 1")), 0);
    }
}
