//! The metrics that need a query, refreshed on an interval: each consumer's state in JetStream
//! (`[metrics] consumer_interval`) and the marker table's growth (`marker_interval`). A failed
//! sample is logged, counted in `idemhost_sample_errors_total` and retried next interval; the
//! last good values stay exposed meanwhile.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::warn;

use super::{broker, markers};
use crate::config::{ConsumerConfig, MetricsConfig};
use crate::metrics::Metrics;

/// Starts the samplers `config` enables; they stop when `stop` turns true.
pub(crate) fn spawn(
    metrics: Arc<Metrics>,
    config: &MetricsConfig,
    js: jetstream::Context,
    pool: PgPool,
    consumers: Vec<ConsumerConfig>,
    stop: watch::Receiver<bool>,
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    if !config.consumer_interval.0.is_zero() {
        let (metrics, consumers) = (metrics.clone(), consumers.clone());
        tasks.push(every(config.consumer_interval.0, stop.clone(), move || {
            let (metrics, js, consumers) = (metrics.clone(), js.clone(), consumers.clone());
            async move {
                for c in &consumers {
                    match broker::consumer_state(&js, c).await {
                        Ok(state) => metrics.set_consumer_state(
                            &c.name,
                            state.pending,
                            state.ack_pending,
                            state.oldest_unacked,
                        ),
                        Err(e) => {
                            metrics.sample_failed("consumer");
                            warn!(consumer = %c.name, error = format!("{e:#}"), "consumer state sample failed");
                        }
                    }
                }
            }
        }));
    }
    if !config.marker_interval.0.is_zero() {
        let names: Vec<String> = consumers.iter().map(|c| c.name.clone()).collect();
        tasks.push(every(config.marker_interval.0, stop, move || {
            let (metrics, pool, names) = (metrics.clone(), pool.clone(), names.clone());
            async move {
                match markers::state(&pool, Some(&names)).await {
                    Ok(state) => {
                        metrics.set_marker_table_bytes(state.table_bytes);
                        for c in &state.consumers {
                            metrics.set_consumer_markers(&c.consumer, c.rows, c.bytes, c.oldest);
                        }
                    }
                    Err(e) => {
                        metrics.sample_failed("markers");
                        warn!(error = %crate::pg::describe(&e), "marker table sample failed");
                    }
                }
            }
        }));
    }
    tasks
}

/// Runs `sample` now and then every `interval` until `stop`.
fn every<F, Fut>(interval: Duration, mut stop: watch::Receiver<bool>, sample: F) -> JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => sample().await,
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
        }
    })
}
