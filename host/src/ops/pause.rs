//! Pausing a consumer on the server (NATS 2.11+, `$JS.API.CONSUMER.PAUSE`): until the time
//! given, JetStream delivers none of its messages to any replica, while the replicas keep
//! running (connected, ready, pulling in vain). For maintenance beside a running deployment —
//! a migration of the handler's tables, a plugin deploy to verify first — without stopping the
//! hosts; `resume` ends it early. Deliveries already running finish and are acked as usual; a
//! pause never costs a message or an attempt. With `partitions`, every partition's durable.

use std::time::SystemTime;

use anyhow::Context as _;
use async_nats::jetstream;
use serde::Serialize;

use crate::config::ConsumerConfig;
use crate::source::partition::server_at_least;

/// One durable's state after the request.
#[derive(Debug, Serialize)]
pub struct Paused {
    /// The durable.
    pub durable: String,
    /// Whether the server now holds its deliveries.
    pub paused: bool,
    /// RFC 3339, while paused.
    pub until: Option<String>,
}

/// Pauses (`until`: `Some`) or resumes (`None`) every durable of `config`.
pub async fn set(
    js: &jetstream::Context,
    config: &ConsumerConfig,
    until: Option<SystemTime>,
) -> anyhow::Result<Vec<Paused>> {
    server_at_least(&js.client(), (2, 11)).map_err(|version| {
        anyhow::anyhow!(
            "pausing a consumer needs a NATS server 2.11 or newer; this one is {version} \
             (stop the hosts instead: they finish what runs and leave the rest to the broker)"
        )
    })?;
    let stream = js
        .get_stream_no_info(&config.stream)
        .await
        .with_context(|| format!("stream {}", config.stream))?;
    let mut out = Vec::new();
    for durable in config.durables() {
        let response = match until {
            Some(t) => stream.pause_consumer(&durable, t.into()).await,
            None => stream.resume_consumer(&durable).await,
        }
        .map_err(|e| anyhow::anyhow!("consumer {durable} on {}: {e}", config.stream))?;
        out.push(Paused {
            durable,
            paused: response.paused,
            until: response.paused.then(|| {
                humantime::format_rfc3339_seconds(response.pause_until.into()).to_string()
            }),
        });
    }
    Ok(out)
}
