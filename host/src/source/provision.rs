//! Provisioning a consumer on the broker: its stream (found, or created with `create_stream`),
//! the partition transform it needs, its dead-letter stream, the max-deliveries advisory
//! watcher, and its durable pull consumer with the settings the host relies on. Errors name the
//! consumer and what is missing.

use anyhow::Context as _;
use async_nats::jetstream::consumer::{Consumer, PriorityPolicy, pull};
use async_nats::jetstream::{self, stream};
use tracing::warn;

use super::partition::Spread;
use super::puller::{PULL_EXPIRES, pull_credits};
use super::{exhausted, max_waiting, partition};
use crate::config::ConsumerConfig;
use crate::subjects::subject_matches;

/// What the runtime keeps of the provisioning: the durable's name and the advisory watcher.
pub(super) struct Provisioned {
    pub(super) durable: String,
    pub(super) exhausted: Option<Consumer<pull::Config>>,
    /// Whether the durable is a partition's with the `prioritized` policy (spread).
    pub(super) prioritized: bool,
}

/// What the servers will refuse for this consumer, found by reading only, so that a start
/// refused for any consumer changes nothing for any (`Host::run` checks every consumer before
/// the first change): what the NATS server cannot do, a stream that is missing without
/// `create_stream`, an existing stream without the partition transform.
pub(crate) async fn check(
    js: &jetstream::Context,
    config: &ConsumerConfig,
    spread: Option<Spread>,
) -> anyhow::Result<()> {
    refuse_unsupported(js, config, spread)?;
    match js.get_stream(&config.stream).await {
        Ok(stream) => check_transform(config, &stream.cached_info().config),
        // Made by provisioning, after every consumer passed.
        Err(_) if config.create_stream => Ok(()),
        Err(e) => Err(anyhow::Error::new(e).context(stream_not_found(config))),
    }
}

fn stream_not_found(config: &ConsumerConfig) -> String {
    format!(
        "consumer {}: stream {} not found (create it, or set create_stream = true)",
        config.name, config.stream
    )
}

/// What the server cannot do is refused before anything on it changes: a refused start must
/// leave the stream and an existing durable (its position in the stream) as they were.
fn refuse_unsupported(
    js: &jetstream::Context,
    config: &ConsumerConfig,
    spread: Option<Spread>,
) -> anyhow::Result<()> {
    let name = &config.name;
    if config.partitions > 0 {
        partition::check_server(&js.client(), name)?;
        if spread.is_some() {
            partition::check_spread(&js.client(), name)?;
        }
    }
    if config.subjects.len() > 1 {
        // Several filter subjects need NATS 2.10; an older server ignores the field and would
        // deliver the whole stream (this consumer's dead letters included) to this consumer.
        partition::server_at_least(&js.client(), (2, 10)).map_err(|version| {
            anyhow::anyhow!(
                "consumer {name}: `subjects` lists {} subjects, which needs a NATS server 2.10 or \
                 newer (filter_subjects); this one is {version}. Use one subject (wildcards allowed)",
                config.subjects.len()
            )
        })?;
    }
    Ok(())
}

/// With partitions, the stream must put the partition in the subject: without the transform
/// nothing would match the partitions' filters (or a producer could pick a partition by
/// publishing `<subject>.<n>` itself).
fn check_transform(config: &ConsumerConfig, have: &stream::Config) -> anyhow::Result<()> {
    if config.partitions == 0 {
        return Ok(());
    }
    let wanted = partition::transform(&config.subjects[0], config.partitions);
    if have.subject_transform.as_ref() != Some(&wanted) {
        anyhow::bail!(
            "consumer {}: `partitions = {}` needs stream {} to put the partition in the \
             subject: subject_transform {{ src = \"{}\", dest = \"{}\" }} (it has {:?}; \
             create_stream = true sets it when it creates the stream)",
            config.name,
            config.partitions,
            config.stream,
            wanted.source,
            wanted.destination,
            have.subject_transform
        );
    }
    // The transform applies to what its source matches; a stream subject that also captures
    // `<subject>.<n>` would store such a message as it was published, in partition n: a
    // producer could choose the partition, and one key's messages land in two of them.
    let partitioned = format!("{}.*", config.subjects[0]);
    if let Some(wide) = have
        .subjects
        .iter()
        .find(|s| crate::subjects::patterns_overlap(s, &partitioned))
    {
        anyhow::bail!(
            "consumer {}: stream {} captures `{wide}`, which includes the partitions' own \
             subjects (`{partitioned}`): a producer could publish straight into a partition, \
             and one key's messages could land in two. Give the stream `{}` (the transform's \
             source) instead of `{wide}`",
            config.name,
            config.stream,
            config.subjects[0]
        );
    }
    Ok(())
}

/// Finds (or, with `create_stream`, creates) the stream, the dead-letter stream and the durable
/// consumer — of `partition`, with `partitions`, pinned or with a `spread`.
pub(super) async fn provision(
    (js, watcher_js): (&jetstream::Context, &jetstream::Context),
    config: &ConsumerConfig,
    partition: Option<u32>,
    spread: Option<Spread>,
) -> anyhow::Result<Provisioned> {
    let name = &config.name;
    refuse_unsupported(js, config, spread)?;
    let stream = stream(js, config).await?;
    check_transform(config, &stream.cached_info().config)?;
    dead_letter_stream(js, config).await?;
    let durable = match partition {
        Some(p) => partition::durable(config, p),
        None => config.durable_name(),
    };
    // The host enforces max_deliver itself (dead-lettering on the last attempt). The server
    // stops one delivery later, for messages the host never got to settle, and its advisory
    // makes the watcher dead-letter them (see `exhausted`). Without the watcher's stream the
    // server redelivers without end rather than drop a message silently.
    let exhausted = match exhausted::bind(watcher_js, &config.stream, &durable).await {
        Ok(watcher) => Some(watcher),
        Err(e) => {
            warn!(consumer = %name, error = %format!("{e:#}"),
                "messages the host cannot settle will be redelivered without end (no advisory stream)");
            None
        }
    };
    if partition.is_some() && exhausted.is_none() {
        // A message the client cannot read would hold its partition (one message at a time)
        // for ever: the advisory stream is what dead-letters it.
        anyhow::bail!(
            "consumer {name}: `partitions` needs the max-deliveries advisory stream, which could \
             not be set up (see the warning above)"
        );
    }
    let max_deliver = match exhausted {
        Some(_) => i64::from(config.max_deliver) + 1,
        None => -1,
    };
    let mut pull_config = pull::Config {
        durable_name: Some(durable.clone()),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: config.ack_wait.0,
        max_deliver,
        // Room for the pull loop's credits (see `run`), as many acks on their way, and the
        // messages waiting behind their ordering key.
        max_ack_pending: (2 * pull_credits(config) as i64 + max_waiting(config) as i64).max(16),
        ..Default::default()
    };
    match config.subjects.as_slice() {
        [] => {}
        [one] => pull_config.filter_subject = one.clone(),
        many => pull_config.filter_subjects = many.to_vec(),
    }
    if let Some(p) = partition {
        partition::configure(&mut pull_config, config, p, PULL_EXPIRES, spread.is_some());
    }
    let mut consumer = stream
        .get_or_create_consumer(&durable, pull_config.clone())
        .await
        .with_context(|| {
            format!(
                "consumer {name}: failed to bind durable consumer {durable} on {}",
                config.stream
            )
        })?;
    let bound = &consumer.cached_info().config;
    if let Some(p) = partition
        && spread.is_none()
        && bound.priority_policy == PriorityPolicy::Prioritized
    {
        // Spread by numbered replicas: a replica without a number pulls at the best priority
        // rather than turn the durable back (replicas started with and without the keys would
        // turn it back and forth, each pulling in a way the other policy refuses).
        partition::configure(&mut pull_config, config, p, PULL_EXPIRES, true);
    }
    if bound.max_deliver != max_deliver
        || bound.ack_wait != pull_config.ack_wait
        || bound.max_ack_pending < pull_config.max_ack_pending
        || bound.priority_timeout != pull_config.priority_timeout
        || bound.priority_policy != pull_config.priority_policy
        || (partition.is_some() && bound.max_ack_pending != pull_config.max_ack_pending)
    {
        // A durable made by an older version or another config: bring the settings the host
        // relies on up to date (both may be edited on a live consumer).
        consumer = stream.update_consumer(pull_config).await.with_context(|| {
            format!("consumer {name}: failed to update durable consumer {durable}")
        })?;
    }
    let filters = &consumer.cached_info().config.filter_subjects;
    if config.subjects.len() > 1 && filters != &config.subjects {
        // A server that reports 2.10 or newer and dropped the filter, or a durable made for
        // other subjects. It is left as it is (deleting it would lose its position in the
        // stream) and not consumed from.
        anyhow::bail!(
            "consumer {name}: durable consumer {durable} on {} filters {:?}, not the {} configured \
             subjects; the host does not consume from it. If `subjects` changed since the durable \
             was made, edit its filter_subjects (nats consumer edit) or use a new consumer name",
            config.stream,
            filters,
            config.subjects.len(),
        );
    }
    let prioritized = consumer.cached_info().config.priority_policy == PriorityPolicy::Prioritized;
    Ok(Provisioned {
        durable,
        exhausted,
        prioritized,
    })
}

/// The consumer's stream: found, or with `create_stream` created (and given the consumer's
/// subjects it lacks).
async fn stream(
    js: &jetstream::Context,
    config: &ConsumerConfig,
) -> anyhow::Result<jetstream::stream::Stream> {
    let name = &config.name;
    Ok(if config.create_stream {
        let mut stream = js
            .get_or_create_stream(stream::Config {
                name: config.stream.clone(),
                subjects: config.subjects.clone(),
                subject_transform: (config.partitions > 0)
                    .then(|| partition::transform(&config.subjects[0], config.partitions)),
                ..Default::default()
            })
            .await
            .with_context(|| {
                format!("consumer {name}: failed to create stream {}", config.stream)
            })?;
        // Several consumers (or processes) may share a stream they create: each adds the
        // subjects it lacks, re-reading after its update in case a concurrent one overwrote it.
        for _ in 0..5 {
            let mut wanted = stream.cached_info().config.clone();
            let missing: Vec<String> = config
                .subjects
                .iter()
                .filter(|s| !wanted.subjects.iter().any(|have| subject_matches(have, s)))
                .cloned()
                .collect();
            if missing.is_empty() {
                break;
            }
            wanted.subjects.extend(missing);
            js.update_stream(&wanted).await.with_context(|| {
                format!(
                    "consumer {name}: failed to add its subjects to stream {}",
                    config.stream
                )
            })?;
            stream = js.get_stream(&config.stream).await?;
        }
        stream
    } else {
        js.get_stream(&config.stream)
            .await
            .with_context(|| stream_not_found(config))?
    })
}

/// Makes sure a stream captures the consumer's dead-letter subject — not its own stream where
/// the consumer would read its dead letters back —, creating one with `create_stream`.
async fn dead_letter_stream(
    js: &jetstream::Context,
    config: &ConsumerConfig,
) -> anyhow::Result<()> {
    let name = &config.name;
    let dlq = config.dead_letter_subject();
    if let Ok(dlq_stream) = js.stream_by_subject(dlq.clone()).await {
        let consumes_own_dead_letters =
            config.subjects.is_empty() || config.subjects.iter().any(|s| subject_matches(s, &dlq));
        if dlq_stream == config.stream && consumes_own_dead_letters {
            anyhow::bail!(
                "consumer {name}: dead_letter_subject {dlq} is in stream {} and matches the consumer's subjects: \
                 it would consume its own dead letters (narrow `subjects` or use another subject)",
                config.stream
            );
        }
    } else {
        if config.create_stream {
            // Named after the subject, not the consumer: two configs with one consumer name and
            // different dead-letter subjects must not meet in one stream that captures only
            // the first subject.
            let dlq_stream = dead_letter_stream_name(&dlq);
            js.get_or_create_stream(stream::Config {
                name: dlq_stream.clone(),
                subjects: vec![dlq.clone()],
                ..Default::default()
            })
            .await
            .with_context(|| {
                format!("consumer {name}: failed to create dead-letter stream {dlq_stream}")
            })?;
            if js.stream_by_subject(dlq.clone()).await.is_err() {
                anyhow::bail!(
                    "consumer {name}: stream {dlq_stream} exists but does not capture dead_letter_subject {dlq}"
                );
            }
        } else {
            anyhow::bail!(
                "consumer {name}: no JetStream stream captures dead_letter_subject {dlq} (create one, or set create_stream = true)"
            );
        }
    }
    Ok(())
}

/// `IDEMHOST_DLQ_<subject>` with every character a stream name may not hold replaced by `_`.
fn dead_letter_stream_name(subject: &str) -> String {
    crate::subjects::stream_safe(&format!("IDEMHOST_DLQ_{subject}"))
}
