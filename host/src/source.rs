//! JetStream: binding a consumer's stream and durable pull consumer, the pull loop bounded by
//! `max_in_flight`, and settling each delivery — ack (confirmed) after commit, nak with backoff,
//! or dead-letter with the original id, headers and payload, then term.
//!
//! A message's walk from pull to ack, in three pieces:
//! - the **puller** ([`puller`]): credits, pull requests ([`pulling`]), group commit's
//!   gathering; it yields one delivery or one group ([`Pulled`]);
//! - the consumer's loop ([`ConsumerRuntime::run`]) starts each on its own task
//!   ([`ConsumerRuntime::start`]: a key's worker or a `max_in_flight` slot for one delivery);
//! - the **pipeline** ([`settle`]): `prepare` (read the message and its id), `admit` (the
//!   refusals), the claim pipeline ([`crate::claim`]: BEGIN and claim, the handler on its
//!   transaction handle, `judge`, COMMIT — or for a group `Claimer::process_batch`), `record`,
//!   then `conclude`: ack, nak, retry in place or dead-letter ([`dead_letter`]).
//!
//! Every decision on what follows a failed attempt is made in [`crate::disposition`].

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::consumer::{Consumer, pull};
use async_nats::jetstream::{self, AckKind};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, info, warn};

use crate::claim::Claimer;
use crate::config::ConsumerConfig;
use crate::metrics::{ConsumerMetrics, EventTypeLabels, Metrics};
use crate::registry::Slot;

mod dead_letter;
mod exhausted;
mod gathering;
mod group_limit;
pub(crate) mod ordering;
pub mod partition;
#[cfg(test)]
mod props;
mod provision;
pub(crate) use provision::check as check_consumer;
mod puller;
mod pulling;
mod settle;
pub(crate) use crate::headers::header;
use group_limit::GroupLimit;
use ordering::{KeySpec, KeyedQueues};
use puller::{PULL_EXPIRES, Pulled, Puller};
pub(crate) use settle::read_message;

/// Connects to NATS with the configured timeouts; the JetStream context's requests are bounded
/// by `nats.request_timeout`.
pub async fn connect_nats(
    config: &crate::config::NatsConfig,
) -> crate::error::Result<(async_nats::Client, async_nats::jetstream::Context)> {
    let link = connect_link(config).await?;
    Ok((link.js.client(), link.js))
}

/// A consumer's own NATS connection (see `host::bind`), and word of each time its client
/// connected again.
#[derive(Clone)]
pub(crate) struct Link {
    pub(crate) js: jetstream::Context,
    /// Changes each time the client connects (again). A message the client cannot read makes
    /// it drop the connection, and the pull request under way is lost with it: nothing more
    /// comes for it, and it ended only at its deadline (a request's expiry and a margin, 7 s)
    /// — each delivery of such a message held its consumer's pulls that long.
    pub(crate) connected: watch::Receiver<()>,
    /// Kept so that `connected` never closes while the link is in use.
    _sender: Arc<watch::Sender<()>>,
}

/// [`connect_nats`], with the word of each (re)connection.
pub(crate) async fn connect_link(config: &crate::config::NatsConfig) -> crate::error::Result<Link> {
    // Several servers (a cluster) are comma-separated; the client tries them in turn and then
    // also the ones the cluster announces.
    let servers: Vec<&str> = config
        .url
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect();
    let (sender, connected) = watch::channel(());
    let sender = Arc::new(sender);
    let tell = sender.clone();
    let mut options = async_nats::ConnectOptions::new()
        .connection_timeout(config.connect_timeout.0)
        .request_timeout(Some(config.request_timeout.0))
        .custom_inbox_prefix(&config.inbox_prefix)
        .event_callback(move |event| {
            if event == async_nats::Event::Connected {
                tell.send_replace(());
            }
            async {}
        });
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
    let mut js = async_nats::jetstream::new(client);
    js.set_timeout(config.request_timeout.0);
    Ok(Link {
        js,
        connected,
        _sender: sender,
    })
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

/// A bound consumer: its durable pull consumer, its handler and its claim pipeline.
pub(crate) struct ConsumerRuntime {
    pub config: ConsumerConfig,
    /// The consumer's own connection.
    link: Link,
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
    (link, watcher_js): (&Link, &jetstream::Context),
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
    } = provision::provision((&link.js, watcher_js), config, partition, spread).await?;
    Ok(ConsumerRuntime {
        config: config.clone(),
        link: link.clone(),
        client: link.js.client(),
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
    /// (rolled back, not acked — the broker redelivers it). The [`Puller`] yields the work;
    /// each delivery or group runs on its own task through the pipeline in [`settle`].
    pub(crate) async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>, drain: Duration) {
        let max_in_flight = self.config.max_in_flight as usize;
        let slots = Arc::new(Semaphore::new(max_in_flight));
        let limit = Arc::new(GroupLimit::new(slots.clone(), max_in_flight));
        let mut puller = Puller::new(
            &self.config,
            self.pull_target(),
            slots.clone(),
            limit.clone(),
        );
        let helpers = self.start_helpers(&shutdown);
        let mut tasks = JoinSet::new();
        while let Some(work) = puller.next(&mut shutdown).await {
            while tasks.try_join_next().is_some() {}
            self.start(&mut tasks, (&slots, &limit), work);
        }
        // Already pulled: handled like the other in-flight deliveries.
        for group in puller.gathered() {
            self.start(&mut tasks, (&slots, &limit), Pulled::Waiting(group));
        }
        info!(consumer = %self.config.name, in_flight = tasks.len(), "stopped pulling, draining");
        let drained =
            tokio::time::timeout(drain, async { while tasks.join_next().await.is_some() {} }).await;
        if drained.is_err() {
            warn!(consumer = %self.config.name, left = tasks.len(), "drain timeout; rolling back unfinished deliveries");
            tasks.shutdown().await;
        }
        for helper in helpers {
            helper.abort();
            let _ = helper.await;
        }
        // Acks still buffered in this consumer's connection (its own, see `host::bind`) go out
        // before it is dropped.
        let flushed = tokio::time::timeout(PULL_EXPIRES, self.client.flush()).await;
        if !matches!(flushed, Ok(Ok(()))) {
            warn!(consumer = %self.config.name, "failed to flush the consumer's NATS connection");
        }
    }

    /// Starts what the puller yielded on its own task: one delivery (see
    /// [`ConsumerRuntime::dispatch`]), a group holding its slot, or a group once a slot is free
    /// (told in progress while it waits for one).
    fn start(
        self: &Arc<Self>,
        tasks: &mut JoinSet<()>,
        (slots, limit): (&Arc<Semaphore>, &Arc<GroupLimit>),
        work: Pulled,
    ) {
        let (this, slots, limit) = (self.clone(), slots.clone(), limit.clone());
        match work {
            Pulled::One((msg, credit)) => self.dispatch(tasks, &slots, msg, credit),
            Pulled::Group(group, slot) => {
                tasks.spawn(this.settle_batch(slot, group, limit));
            }
            Pulled::Waiting(group) => {
                tasks.spawn(async move {
                    let waiting: Vec<&jetstream::Message> = group.iter().map(|(m, _)| m).collect();
                    let slot = this
                        .with_progress(&waiting, std::pin::pin!(slots.acquire_owned()))
                        .await;
                    if let Ok(slot) = slot {
                        this.settle_batch(slot, group, limit).await;
                    }
                });
            }
        }
    }

    /// Where this consumer's pulls go: its durable, or its partition's with this replica's pin.
    fn pull_target(&self) -> puller::Target {
        let (durable, pin) = match &self.partition {
            Some((durable, pin)) => (durable.clone(), Some(pin.clone())),
            None => (self.durable.clone(), None),
        };
        puller::Target {
            link: self.link.clone(),
            durable,
            pin,
        }
    }

    /// The tasks beside the pull loop: the advisory watcher (see [`exhausted`]) and, with
    /// `ordering`, the in-progress ticker of the messages waiting behind their key.
    fn start_helpers(self: &Arc<Self>, shutdown: &watch::Receiver<bool>) -> Vec<JoinHandle<()>> {
        let mut helpers = Vec::new();
        if self.exhausted.is_some() {
            let (this, shutdown) = (self.clone(), shutdown.clone());
            helpers.push(tokio::spawn(async move {
                if let Some(w) = &this.exhausted {
                    exhausted::watch(&this, w, shutdown).await;
                }
            }));
        }
        if self.ordering.is_some() {
            helpers.push(tokio::spawn(self.clone().keep_waiting_in_progress()));
        }
        helpers
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
                .with_progress(&[&msg], std::pin::pin!(slots.clone().acquire_owned()))
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
            assert_eq!(puller::pull_credits(&consumer(extra)), credits, "{extra}");
        }
        assert_eq!(max_waiting(&consumer("batch_max = 1")), 0);
    }

    /// Telling JetStream a delivery is in progress wraps the delivery's work by reference: a
    /// delivery's work is its whole transaction, and taken by value it was held twice in the
    /// wrapper (the argument and its pinned copy), each task 34 KB.
    #[tokio::test]
    async fn telling_progress_holds_the_work_by_reference() {
        let work = std::pin::pin!(async {
            let held = [1u8; 8192];
            tokio::task::yield_now().await;
            held.iter().map(|b| usize::from(*b)).sum::<usize>()
        });
        let wrapped = settle::progress_while(Duration::from_secs(1), &[], work);
        let size = std::mem::size_of_val(&wrapped);
        assert!(size < 1024, "the wrapper holds {size} bytes");
        assert_eq!(wrapped.await, 8192);
    }
}
