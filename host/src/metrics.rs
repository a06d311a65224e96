//! Prometheus metrics (`GET /metrics`, OpenMetrics text via the `prometheus-client` crate):
//! what each delivery became and what it took, recorded by the pull loop as deliveries settle;
//! the broker's view of each consumer and the marker table's growth, sampled on an interval
//! (`ops::sample`); the plugin versions and their instantiation times, read from the registry
//! at scrape time (`registry::PluginCollector`); the process's own figures (`process_*`, read
//! from `/proc` at scrape time, [`process`]) and `idemhost_build_info`.
//!
//! Every series a consumer will have is created, at zero, when it is bound: a counter that has
//! not counted yet reads 0, not "absent" (which `rate()` and alerts cannot tell from a host
//! that is down). The sampled gauges appear with their first sample, taken at start.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::outcome::{Processed, Rollback};

mod event_types;
mod process;

pub use event_types::EventTypeLabels;

/// A claim slower than this counts in `idemhost_slow_claims_total`: it waited on a competing
/// delivery of the same message id (or on a busy database).
pub(crate) const SLOW_CLAIM: Duration = Duration::from_millis(100);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConsumerLabels {
    consumer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeliveryLabels {
    consumer: String,
    event_type: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    consumer: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SamplerLabels {
    sampler: String,
}

fn seconds_histogram() -> Histogram {
    // 250 µs to ~16 s.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 17))
}

/// The bounds of the ages a backlog or a backoff can reach (end to end, the outbox's lag):
/// the octaves of [`seconds_histogram`], then 30 s to a day.
pub(crate) const AGE_BUCKETS_PAST_OCTAVES: [f64; 10] = [
    30.0, 60.0, 120.0, 300.0, 600.0, 1_800.0, 3_600.0, 7_200.0, 21_600.0, 86_400.0,
];

fn age_histogram() -> Histogram {
    Histogram::new(
        exponential_buckets(0.000_25, 2.0, 17).chain(AGE_BUCKETS_PAST_OCTAVES.iter().copied()),
    )
}

/// Every outcome label a delivery can settle with ([`crate::outcome::Outcome::label`]).
const OUTCOMES: [&str; 4] = [
    "applied",
    "duplicate",
    "retryable_failure",
    "terminal_failure",
];

/// The samplers of `idemhost_sample_errors_total` (`ops::sample`).
const SAMPLERS: [&str; 2] = ["consumer", "markers"];

type Seconds = Family<ConsumerLabels, Histogram, fn() -> Histogram>;
type SecondsGauge = Family<ConsumerLabels, Gauge<f64, AtomicU64>>;

const ROLLBACKS: [Rollback; 5] = [
    Rollback::Conflict,
    Rollback::HandlerRetryable,
    Rollback::HandlerTerminal,
    Rollback::Database,
    Rollback::Connection,
];

/// Every metric of the process.
pub struct Metrics {
    registry: Registry,
    deliveries: Family<DeliveryLabels, Counter>,
    transaction: Seconds,
    claim: Seconds,
    handler: Seconds,
    end_to_end: Seconds,
    slow_claims: Family<ConsumerLabels, Counter>,
    tx_retries: Family<ConsumerLabels, Counter>,
    rollbacks: Family<ReasonLabels, Counter>,
    redeliveries: Family<ConsumerLabels, Counter>,
    database_waits: Family<ConsumerLabels, Counter>,
    dead_letters: Family<ConsumerLabels, Counter>,
    in_flight: Family<ConsumerLabels, Gauge>,
    pending: Family<ConsumerLabels, Gauge>,
    ack_pending: Family<ConsumerLabels, Gauge>,
    oldest_unacked: SecondsGauge,
    markers: Family<ConsumerLabels, Gauge>,
    marker_bytes: Family<ConsumerLabels, Gauge>,
    oldest_marker: SecondsGauge,
    marker_table_bytes: Gauge,
    sample_errors: Family<SamplerLabels, Counter>,
    outbox_published: Family<ConsumerLabels, Counter>,
    outbox_errors: Family<ConsumerLabels, Counter>,
    outbox_lag: Seconds,
    outbox_oldest: Gauge<f64, AtomicU64>,
    outbox_set_aside: Gauge,
    outbox_passes: Counter,
    plugins: Arc<Late>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every metric, registered under the `idemhost_` prefix.
    pub fn new() -> Self {
        let seconds = || Seconds::new_with_constructor(seconds_histogram as fn() -> Histogram);
        let ages = || Seconds::new_with_constructor(age_histogram as fn() -> Histogram);
        let m = Metrics {
            deliveries: Family::default(),
            transaction: seconds(),
            claim: seconds(),
            handler: seconds(),
            end_to_end: ages(),
            slow_claims: Family::default(),
            tx_retries: Family::default(),
            rollbacks: Family::default(),
            redeliveries: Family::default(),
            database_waits: Family::default(),
            dead_letters: Family::default(),
            in_flight: Family::default(),
            pending: Family::default(),
            ack_pending: Family::default(),
            oldest_unacked: Family::default(),
            markers: Family::default(),
            marker_bytes: Family::default(),
            oldest_marker: Family::default(),
            marker_table_bytes: Gauge::default(),
            sample_errors: Family::default(),
            outbox_published: Family::default(),
            outbox_errors: Family::default(),
            outbox_lag: ages(),
            outbox_oldest: Gauge::default(),
            outbox_set_aside: Gauge::default(),
            outbox_passes: Counter::default(),
            plugins: Arc::new(Late::default()),
            registry: Registry::default(),
        };
        for sampler in SAMPLERS {
            let _ = m.sample_errors.get_or_create(&SamplerLabels {
                sampler: sampler.to_string(),
            });
        }
        let mut root = Registry::default();
        root.register_collector(Box::new(process::ProcessCollector));
        let r = root.sub_registry_with_prefix("idemhost");
        r.register(
            "build",
            "The running build: version, target, profile",
            build_info(),
        );
        r.register(
            "deliveries",
            "Deliveries settled, by outcome: applied, duplicate, retryable_failure, terminal_failure",
            m.deliveries.clone(),
        );
        r.register(
            "transaction_seconds",
            "BEGIN to COMMIT or ROLLBACK of a delivery's last transaction attempt",
            m.transaction.clone(),
        );
        r.register(
            "claim_seconds",
            "The claim statement (waits on a competing claim of the same id show here)",
            m.claim.clone(),
        );
        r.register(
            "handler_seconds",
            "The handler call (plugin instantiation and its SQL included)",
            m.handler.clone(),
        );
        r.register(
            "end_to_end_seconds",
            "From the message's storage in the stream to its confirmed ack",
            m.end_to_end.clone(),
        );
        r.register(
            "slow_claims",
            "Claims that took longer than 100 ms",
            m.slow_claims.clone(),
        );
        r.register(
            "transaction_retries",
            "Whole-transaction retries after serialization failures (40001) or deadlocks (40P01)",
            m.tx_retries.clone(),
        );
        r.register(
            "rollbacks",
            "Transaction attempts rolled back, by reason: serialization_conflict, handler_retryable, \
             handler_terminal, database_error, connection",
            m.rollbacks.clone(),
        );
        r.register(
            "database_waits",
            "Attempts that failed because the database was unavailable (a restart, a failover) and \
             ran again after waiting for it, not counted toward max_deliver",
            m.database_waits.clone(),
        );
        r.register(
            "redeliveries",
            "Deliveries the broker made more than once (num_delivered > 1)",
            m.redeliveries.clone(),
        );
        r.register(
            "dead_letters",
            "Messages published to the dead-letter subject",
            m.dead_letters.clone(),
        );
        r.register(
            "in_flight",
            "Deliveries being handled now by this process",
            m.in_flight.clone(),
        );
        r.register(
            "pending",
            "Messages the broker has not delivered to the consumer yet (sampled)",
            m.pending.clone(),
        );
        r.register(
            "ack_pending",
            "Messages delivered to the consumer and not acknowledged yet (sampled)",
            m.ack_pending.clone(),
        );
        r.register(
            "oldest_unacked_seconds",
            "Age of the oldest message the consumer has not acknowledged, delivered or not; 0 when \
             none (sampled)",
            m.oldest_unacked.clone(),
        );
        r.register(
            "markers",
            "Marker rows of the consumer (sampled)",
            m.markers.clone(),
        );
        r.register(
            "marker_bytes",
            "The consumer's share of the marker table's size, indexes included (sampled estimate)",
            m.marker_bytes.clone(),
        );
        r.register(
            "oldest_marker_seconds",
            "Age of the consumer's oldest marker; 0 when it has none (sampled)",
            m.oldest_marker.clone(),
        );
        r.register(
            "marker_table_bytes",
            "Size of processed_message with its indexes and TOAST (sampled)",
            m.marker_table_bytes.clone(),
        );
        r.register(
            "sample_errors",
            "Failed samples, by sampler: consumer (JetStream) or markers (PostgreSQL)",
            m.sample_errors.clone(),
        );
        r.register(
            "outbox_published",
            "Outbox events the relay published and JetStream acknowledged, by the consumer whose \
             handler published them",
            m.outbox_published.clone(),
        );
        r.register(
            "outbox_publish_errors",
            "Outbox publishes that failed (retried on the next relay pass)",
            m.outbox_errors.clone(),
        );
        r.register(
            "outbox_lag_seconds",
            "From the commit that wrote an outbox event (its row's insert) to JetStream's ack",
            m.outbox_lag.clone(),
        );
        r.register(
            "outbox_oldest_seconds",
            "Age of the oldest outbox event not yet relayed; 0 when none",
            m.outbox_oldest.clone(),
        );
        r.register(
            "outbox_set_aside",
            "Outbox events set aside after outbox.max_attempts failed publishes; \
             see `idemhost outbox list` and `idemhost outbox retry`",
            m.outbox_set_aside.clone(),
        );
        r.register(
            "outbox_relay_passes",
            "Passes of the outbox relay over outbox_message: one per wake-up (notifications \
             already waiting count as one) and per poll_interval",
            m.outbox_passes.clone(),
        );
        r.register_collector(Box::new(m.plugins.clone()));
        Metrics {
            registry: root,
            ..m
        }
    }

    /// The collector of the plugins' versions and instantiation times `/metrics` shows (set
    /// when they are loaded; `None` when the run that loaded them ends).
    pub fn set_plugins(&self, collector: Option<Box<dyn Collector>>) {
        if let Ok(mut inner) = self.plugins.inner.write() {
            *inner = collector;
        }
    }

    /// One consumer's handles, resolved once (at bind) so a delivery records without
    /// building label sets or looking them up; `event_types` bounds the values its
    /// `event_type` label takes.
    pub fn for_consumer(&self, consumer: &str, event_types: EventTypeLabels) -> ConsumerMetrics {
        let labels = ConsumerLabels {
            consumer: consumer.to_string(),
        };
        let rollbacks = ROLLBACKS.map(|r| {
            self.rollbacks.get_or_create_owned(&ReasonLabels {
                consumer: consumer.to_string(),
                reason: r.label().to_string(),
            })
        });
        // At zero from the start: the event types it will count (the configured ones, or
        // `other` for the first), and the outbox events its handler may publish.
        for event_type in event_types.known() {
            for outcome in OUTCOMES {
                let _ = self.deliveries.get_or_create(&DeliveryLabels {
                    consumer: consumer.to_string(),
                    event_type: event_type.clone(),
                    outcome: outcome.to_string(),
                });
            }
        }
        let _ = self.outbox_published.get_or_create(&labels);
        let _ = self.outbox_errors.get_or_create(&labels);
        let _ = self.outbox_lag.get_or_create(&labels);
        ConsumerMetrics {
            consumer: consumer.to_string(),
            event_types,
            deliveries: self.deliveries.clone(),
            transaction: self.transaction.get_or_create_owned(&labels),
            claim: self.claim.get_or_create_owned(&labels),
            handler: self.handler.get_or_create_owned(&labels),
            end_to_end: self.end_to_end.get_or_create_owned(&labels),
            slow_claims: self.slow_claims.get_or_create_owned(&labels),
            tx_retries: self.tx_retries.get_or_create_owned(&labels),
            rollbacks,
            redeliveries: self.redeliveries.get_or_create_owned(&labels),
            database_waits: self.database_waits.get_or_create_owned(&labels),
            dead_letters: self.dead_letters.get_or_create_owned(&labels),
            in_flight: self.in_flight.get_or_create_owned(&labels),
        }
    }

    /// The exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Records a sample of a consumer's broker state: messages not yet delivered, delivered
    /// and not acked, and the age of the oldest unacked one.
    pub fn set_consumer_state(
        &self,
        consumer: &str,
        pending: u64,
        ack_pending: u64,
        oldest_unacked: Option<Duration>,
    ) {
        let labels = ConsumerLabels {
            consumer: consumer.to_string(),
        };
        self.pending
            .get_or_create(&labels)
            .set(i64::try_from(pending).unwrap_or(i64::MAX));
        self.ack_pending
            .get_or_create(&labels)
            .set(i64::try_from(ack_pending).unwrap_or(i64::MAX));
        self.oldest_unacked
            .get_or_create(&labels)
            .set(oldest_unacked.map_or(0.0, |d| d.as_secs_f64()));
    }

    /// Records a sample of the marker table's size.
    pub fn set_marker_table_bytes(&self, bytes: u64) {
        self.marker_table_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Records a sample of one consumer's markers: rows, share of the table's bytes, age of
    /// the oldest.
    pub fn set_consumer_markers(
        &self,
        consumer: &str,
        rows: i64,
        bytes: i64,
        oldest: Option<Duration>,
    ) {
        let labels = ConsumerLabels {
            consumer: consumer.to_string(),
        };
        self.markers.get_or_create(&labels).set(rows);
        self.marker_bytes.get_or_create(&labels).set(bytes);
        self.oldest_marker
            .get_or_create(&labels)
            .set(oldest.map_or(0.0, |d| d.as_secs_f64()));
    }

    /// An outbox event of `consumer` was published `lag` after its row was written.
    pub fn outbox_published(&self, consumer: &str, lag: Duration) {
        let labels = ConsumerLabels {
            consumer: consumer.to_string(),
        };
        self.outbox_published.get_or_create(&labels).inc();
        self.outbox_lag
            .get_or_create(&labels)
            .observe(lag.as_secs_f64());
    }

    /// Counts a failed publish of one of `consumer`'s outbox events.
    pub fn outbox_failed(&self, consumer: &str) {
        self.outbox_errors
            .get_or_create(&ConsumerLabels {
                consumer: consumer.to_string(),
            })
            .inc();
    }

    /// Counts one pass of the outbox relay.
    pub fn outbox_pass(&self) {
        self.outbox_passes.inc();
    }

    /// Outbox rows set aside after `outbox.max_attempts` (sampled).
    pub fn set_outbox_set_aside(&self, rows: i64) {
        self.outbox_set_aside.set(rows);
    }

    /// Age of the oldest outbox row not yet published (sampled).
    pub fn set_outbox_oldest(&self, age: Duration) {
        self.outbox_oldest.set(age.as_secs_f64());
    }

    /// Counts a failed sample of `sampler`.
    pub fn sample_failed(&self, sampler: &str) {
        self.sample_errors
            .get_or_create(&SamplerLabels {
                sampler: sampler.to_string(),
            })
            .inc();
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
    target: String,
    profile: String,
}

/// `idemhost_build_info`: one series, value 1.
fn build_info() -> Info<BuildLabels> {
    Info::new(BuildLabels {
        version: env!("CARGO_PKG_VERSION").to_string(),
        target: format!(
            "{}-{}-{}",
            std::env::consts::ARCH,
            std::env::consts::OS,
            if cfg!(target_env = "musl") {
                "musl"
            } else {
                "gnu"
            }
        ),
        profile: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
        .to_string(),
    })
}

/// One consumer's metrics (clones share the process's series).
pub struct ConsumerMetrics {
    consumer: String,
    event_types: EventTypeLabels,
    deliveries: Family<DeliveryLabels, Counter>,
    transaction: Histogram,
    claim: Histogram,
    handler: Histogram,
    end_to_end: Histogram,
    slow_claims: Counter,
    tx_retries: Counter,
    /// Indexed like [`ROLLBACKS`].
    rollbacks: [Counter; 5],
    redeliveries: Counter,
    dead_letters: Counter,
    in_flight: Gauge,
    database_waits: Counter,
}

impl ConsumerMetrics {
    /// A delivery started (`attempt` as the broker counts it).
    pub fn started(&self, attempt: u32) {
        self.in_flight.inc();
        if attempt > 1 {
            self.redeliveries.inc();
        }
    }

    /// A delivery ended; `outcome` is its label (refused ids count as `terminal_failure`).
    pub fn settled(&self, event_type: &str, outcome: &str, processed: Option<&Processed>) {
        self.in_flight.dec();
        self.deliveries
            .get_or_create(&DeliveryLabels {
                consumer: self.consumer.clone(),
                event_type: self.event_types.label(event_type),
                outcome: outcome.to_string(),
            })
            .inc();
        let Some(p) = processed else { return };
        self.transaction.observe(p.tx_time.as_secs_f64());
        self.claim.observe(p.claim_time.as_secs_f64());
        if let Some(h) = p.handler_time {
            self.handler.observe(h.as_secs_f64());
        }
        if p.claim_time > SLOW_CLAIM {
            self.slow_claims.inc();
        }
        if p.tx_attempts > 1 {
            let retried = u64::from(p.tx_attempts - 1);
            self.tx_retries.inc_by(retried);
            self.rollback(Rollback::Conflict).inc_by(retried);
        }
        if let Some(r) = p.rollback {
            self.rollback(r).inc();
        }
        if p.database_waits > 0 {
            self.database_waits.inc_by(u64::from(p.database_waits));
        }
    }

    fn rollback(&self, reason: Rollback) -> &Counter {
        let i = ROLLBACKS.iter().position(|r| *r == reason).unwrap_or(0);
        &self.rollbacks[i]
    }

    /// An acked delivery's age since the stream stored it.
    pub fn acked(&self, since_stored: Duration) {
        self.end_to_end.observe(since_stored.as_secs_f64());
    }

    pub fn dead_lettered(&self) {
        self.dead_letters.inc();
    }
}

/// A collector registered at start-up and filled in later: the plugins' versions, known once
/// they are loaded (`registry::PluginCollector`), and emptied when the run that loaded them
/// ends (it holds the run's plugins, and with them their engine and its ticker thread).
#[derive(Default)]
struct Late {
    inner: RwLock<Option<Box<dyn Collector>>>,
}

impl std::fmt::Debug for Late {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Late")
    }
}

impl Collector for Late {
    fn encode(&self, encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        match self.inner.read() {
            Ok(inner) => match inner.as_ref() {
                Some(collector) => collector.encode(encoder),
                None => Ok(()),
            },
            Err(_) => Ok(()),
        }
    }
}
