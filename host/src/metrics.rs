//! Prometheus metrics (`GET /metrics`, OpenMetrics text via the `prometheus-client` crate):
//! what each delivery became and what it took. Recorded by the pull loop as deliveries settle;
//! the plugin versions are read from the registry at scrape time.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::claim::Processed;
use crate::registry::Registry as Plugins;

/// A claim slower than this counts in `idemhost_slow_claims_total`: it waited on a competing
/// delivery of the same message id (or on a busy database).
pub const SLOW_CLAIM: Duration = Duration::from_millis(100);

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
struct PluginLabels {
    consumer: String,
    digest: String,
}

fn seconds_histogram() -> Histogram {
    // 250 µs to ~16 s.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 17))
}

type Seconds = Family<ConsumerLabels, Histogram, fn() -> Histogram>;

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
    redeliveries: Family<ConsumerLabels, Counter>,
    dead_letters: Family<ConsumerLabels, Counter>,
    in_flight: Family<ConsumerLabels, Gauge>,
    plugin_info: Family<PluginLabels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("idemhost");
        let seconds = || Seconds::new_with_constructor(seconds_histogram as fn() -> Histogram);
        let m = Metrics {
            deliveries: Family::default(),
            transaction: seconds(),
            claim: seconds(),
            handler: seconds(),
            end_to_end: seconds(),
            slow_claims: Family::default(),
            tx_retries: Family::default(),
            redeliveries: Family::default(),
            dead_letters: Family::default(),
            in_flight: Family::default(),
            plugin_info: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "deliveries",
            "Deliveries settled, by outcome: applied, duplicate, retryable_failure, terminal_failure",
            m.deliveries.clone(),
        );
        registry.register(
            "transaction_seconds",
            "BEGIN to COMMIT or ROLLBACK of a delivery's last transaction attempt",
            m.transaction.clone(),
        );
        registry.register(
            "claim_seconds",
            "The claim statement (waits on a competing claim of the same id show here)",
            m.claim.clone(),
        );
        registry.register(
            "handler_seconds",
            "The handler call (plugin instantiation and its SQL included)",
            m.handler.clone(),
        );
        registry.register(
            "end_to_end_seconds",
            "From the message's storage in the stream to its confirmed ack",
            m.end_to_end.clone(),
        );
        registry.register(
            "slow_claims",
            "Claims that took longer than 100 ms",
            m.slow_claims.clone(),
        );
        registry.register(
            "transaction_retries",
            "Whole-transaction retries after serialization failures (40001) or deadlocks (40P01)",
            m.tx_retries.clone(),
        );
        registry.register(
            "redeliveries",
            "Deliveries the broker made more than once (num_delivered > 1)",
            m.redeliveries.clone(),
        );
        registry.register(
            "dead_letters",
            "Messages published to the dead-letter subject",
            m.dead_letters.clone(),
        );
        registry.register(
            "in_flight",
            "Deliveries being handled now",
            m.in_flight.clone(),
        );
        registry.register(
            "plugin_info",
            "The plugin version each consumer runs (value 1)",
            m.plugin_info.clone(),
        );
        Metrics { registry, ..m }
    }

    /// One consumer's handles, resolved once (at bind) so a delivery records without
    /// building label sets or looking them up.
    pub fn for_consumer(&self, consumer: &str) -> ConsumerMetrics {
        let labels = ConsumerLabels {
            consumer: consumer.to_string(),
        };
        ConsumerMetrics {
            consumer: consumer.to_string(),
            deliveries: self.deliveries.clone(),
            transaction: self.transaction.get_or_create_owned(&labels),
            claim: self.claim.get_or_create_owned(&labels),
            handler: self.handler.get_or_create_owned(&labels),
            end_to_end: self.end_to_end.get_or_create_owned(&labels),
            slow_claims: self.slow_claims.get_or_create_owned(&labels),
            tx_retries: self.tx_retries.get_or_create_owned(&labels),
            redeliveries: self.redeliveries.get_or_create_owned(&labels),
            dead_letters: self.dead_letters.get_or_create_owned(&labels),
            in_flight: self.in_flight.get_or_create_owned(&labels),
        }
    }

    /// The exposition, with the plugin versions `plugins` runs now.
    pub fn render(&self, plugins: Option<&Arc<Plugins>>) -> String {
        if let Some(plugins) = plugins {
            self.plugin_info.clear();
            for slot in plugins.consumers() {
                self.plugin_info
                    .get_or_create(&PluginLabels {
                        consumer: slot.consumer().to_string(),
                        digest: slot.current().digest.clone(),
                    })
                    .set(1);
            }
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// One consumer's metrics (clones share the process's series).
pub struct ConsumerMetrics {
    consumer: String,
    deliveries: Family<DeliveryLabels, Counter>,
    transaction: Histogram,
    claim: Histogram,
    handler: Histogram,
    end_to_end: Histogram,
    slow_claims: Counter,
    tx_retries: Counter,
    redeliveries: Counter,
    dead_letters: Counter,
    in_flight: Gauge,
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
                event_type: event_type.to_string(),
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
            self.tx_retries.inc_by(u64::from(p.tx_attempts - 1));
        }
    }

    /// An acked delivery's age since the stream stored it.
    pub fn acked(&self, since_stored: Duration) {
        self.end_to_end.observe(since_stored.as_secs_f64());
    }

    pub fn dead_lettered(&self) {
        self.dead_letters.inc();
    }
}
