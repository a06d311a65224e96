//! Broker queries shared by the metrics samplers, `markers prune` and `dlq`: a consumer's
//! backlog, the oldest message it has not acknowledged, the oldest message a stream still holds
//! for a set of subjects.

use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::{self, consumer::pull};

use crate::config::ConsumerConfig;
use crate::stored::{self, Which};

/// A consumer's state as the broker reports it.
#[derive(Debug, Clone, Default)]
pub(crate) struct ConsumerState {
    /// Messages not delivered yet.
    pub pending: u64,
    /// Messages delivered and not acknowledged yet.
    pub ack_pending: u64,
    /// Age of the oldest message not acknowledged (delivered or not); `None` when all are.
    pub oldest_unacked: Option<Duration>,
}

/// One consumer-info request per durable (one, or one per partition), and when anything is
/// unacknowledged, one message lookup per filter subject: the first message after the lowest
/// ack floor.
pub(crate) async fn consumer_state(
    js: &jetstream::Context,
    config: &ConsumerConfig,
) -> anyhow::Result<ConsumerState> {
    let stream = js
        .get_stream_no_info(&config.stream)
        .await
        .with_context(|| format!("stream {}", config.stream))?;
    let mut state = ConsumerState {
        pending: 0,
        ack_pending: 0,
        oldest_unacked: None,
    };
    let mut after = u64::MAX;
    for durable in config.durables() {
        let consumer: jetstream::consumer::Consumer<pull::Config> = stream
            .get_consumer(&durable)
            .await
            .map_err(|e| anyhow::anyhow!("consumer {durable} on {}: {e}", config.stream))?;
        let info = consumer.cached_info();
        state.pending += info.num_pending;
        state.ack_pending += info.num_ack_pending as u64;
        if info.num_pending + info.num_ack_pending as u64 > 0 {
            after = after.min(info.ack_floor.stream_sequence + 1);
        }
    }
    if after != u64::MAX {
        // Partitioned messages are stored under `<subject>.<partition>`.
        let subjects: Vec<String> = match config.partitions {
            0 => config.subjects.clone(),
            _ => config.subjects.iter().map(|s| format!("{s}.*")).collect(),
        };
        state.oldest_unacked = oldest_from(js, &config.stream, &subjects, after).await?;
    }
    Ok(state)
}

/// The age of the first message of `stream` at or after stream sequence `from` on any of
/// `subjects` (all of the stream when empty); `None` when there is none. Read whatever a
/// producer put in the message's header block (see [`crate::stored`]): through the client's
/// getter a header block that is not UTF-8 failed the lookup ("invalid header"), and with it
/// the consumer's samples and `markers prune` for as long as the stream held that message.
pub(crate) async fn oldest_from(
    js: &jetstream::Context,
    stream: &str,
    subjects: &[String],
    from: u64,
) -> anyhow::Result<Option<Duration>> {
    let all = [">".to_string()];
    let subjects = if subjects.is_empty() {
        &all[..]
    } else {
        subjects
    };
    let mut oldest: Option<Duration> = None;
    for subject in subjects {
        let first = stored::get(js, stream, Which::FirstFrom(subject, from))
            .await
            .with_context(|| format!("reading {subject} from the stream"))?;
        if let Some(m) = first {
            let age = super::age_of(m.stored_at_ns);
            oldest = Some(oldest.map_or(age, |o| o.max(age)));
        }
    }
    Ok(oldest)
}

/// The age of the oldest message `stream` holds on `subjects`, and the stream's `max_age`
/// (zero: unlimited).
pub(crate) async fn retention(
    js: &jetstream::Context,
    stream_name: &str,
    subjects: &[String],
) -> anyhow::Result<(Option<Duration>, Duration)> {
    let stream = js
        .get_stream(stream_name)
        .await
        .with_context(|| format!("stream {stream_name}"))?;
    let max_age = stream.cached_info().config.max_age;
    let oldest = oldest_from(js, stream_name, subjects, 1).await?;
    Ok((oldest, max_age))
}
