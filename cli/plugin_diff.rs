//! `idemhost plugin diff`: a candidate version run beside the deployed one on the consumer's
//! last messages, read from its stream without touching its durable, each message through each
//! version in a rolled-back transaction (`plugin test`'s rehearsal); the report says where
//! their outcomes, statements, rows or outbox events differ.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use async_nats::jetstream;
use clap::Args;
use futures::StreamExt as _;
use serde_json::{Value, json};

use idemhost::WasmHandler;
use idemhost::config::{Config, ConsumerConfig, PluginStoreKind};
use idemhost::ops::NatsStore;
use idemhost::rehearsal::{self, Published, StatementResult, Traced};

use super::plugin_test::{self, Ran};

/// What `plugin diff` compares.
#[derive(Debug, Args)]
pub struct DiffArgs {
    /// The candidate component.
    candidate: PathBuf,
    /// The host's config: PostgreSQL, NATS and the consumer.
    #[arg(long, env = "IDEMHOST_CONFIG")]
    config: PathBuf,
    /// Which configured consumer (needed when the config has several).
    #[arg(long)]
    consumer: Option<String>,
    /// How many of the stream's last messages on the consumer's subjects to run (1 to 1000).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u16).range(1..=1000))]
    last: u16,
    /// The version to compare with, a component file. Default: the deployed one: the NATS
    /// plugin store's current version for the consumer when `[plugins] store = "nats"` has
    /// one, else the consumer's `plugin` file. (A version swapped in through a host's admin API
    /// is in neither: give it here.)
    #[arg(long)]
    deployed: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Exit statuses: every message ran the same in both versions, or some did not (1 is an
/// error of the command itself, 2 a usage error).
pub const EXIT_SAME: u8 = 0;
pub const EXIT_DIFFERENT: u8 = 7;

/// How long the stream may stay silent before the messages read so far are all there are.
const READ_IDLE: Duration = Duration::from_secs(2);

/// One message read from the stream.
struct Read {
    sequence: u64,
    subject: String,
    headers: async_nats::HeaderMap,
    payload: Vec<u8>,
}

/// Runs `plugin diff`; the exit status says whether any message ran differently.
pub async fn diff(args: DiffArgs) -> anyhow::Result<u8> {
    let (config, consumer) = plugin_test::consumer_of(
        Some(&args.config),
        args.consumer.as_deref(),
        &args.candidate,
    )?;
    let (_client, js) = idemhost::ops::connect_nats(&config.nats).await?;
    let (deployed_bytes, deployed_from) = deployed(&args, &config, &consumer, &js).await?;
    let deployed = plugin_test::load_bytes(&config, &consumer, &deployed_bytes, &deployed_from)?;
    let candidate_bytes = std::fs::read(&args.candidate)
        .with_context(|| format!("failed to read {}", args.candidate.display()))?;
    let candidate = plugin_test::load_bytes(&config, &consumer, &candidate_bytes, &args.candidate)?;
    if deployed.digest() == candidate.digest() {
        println!(
            "the candidate is the deployed version ({}): nothing to compare",
            deployed.digest()
        );
        return Ok(EXIT_SAME);
    }
    let messages = last_messages(&js, &consumer, usize::from(args.last)).await?;
    if messages.is_empty() {
        eprintln!(
            "no message on {} in stream {}: nothing was compared",
            consumer.subjects.join(", "),
            consumer.stream
        );
    }

    // Each message runs under a fresh id (the same for both versions), so that one already
    // applied runs again instead of being skipped as a duplicate.
    let run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut rows = Vec::new();
    for m in &messages {
        let original = m
            .headers
            .get(consumer.id_header.as_str())
            .map(|v| v.to_string());
        let mut headers = m.headers.clone();
        headers.insert(
            consumer.id_header.as_str(),
            format!("plugin-diff-{run_id}-{}", m.sequence).as_str(),
        );
        let old = run(
            &config, &consumer, &deployed, &m.subject, &headers, &m.payload,
        )
        .await?;
        let new = run(
            &config, &consumer, &candidate, &m.subject, &headers, &m.payload,
        )
        .await?;
        rows.push((m, original, old, new));
    }
    let differ = rows.iter().filter(|(_, _, old, new)| old != new).count();
    if args.json {
        let shown: Vec<Value> = rows
            .iter()
            .map(|(m, id, old, new)| {
                json!({
                    "sequence": m.sequence,
                    "id": id,
                    "subject": m.subject,
                    "same": old == new,
                    "deployed": old.shown,
                    "candidate": new.shown,
                })
            })
            .collect();
        let report = json!({
            "consumer": consumer.name,
            "deployed": {"digest": deployed.digest(), "from": deployed_from},
            "candidate": {"digest": candidate.digest(), "from": args.candidate},
            "messages": shown,
            "differ": differ,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "deployed  {} ({})\ncandidate {} ({})\nconsumer  {}: its last {} message{} on {}, each run in both, rolled back\n",
            deployed.digest(),
            deployed_from.display(),
            candidate.digest(),
            args.candidate.display(),
            consumer.name,
            messages.len(),
            if messages.len() == 1 { "" } else { "s" },
            consumer.subjects.join(", "),
        );
        for (m, id, old, new) in &rows {
            let id = id.as_deref().map_or("-".into(), |i| {
                format!("{:?}", plugin_test::one_line(i, 80))
            });
            if old == new {
                println!("seq {} id {id}: same ({})", m.sequence, old.shown[0]);
                continue;
            }
            println!("seq {} id {id}: DIFFERS", m.sequence);
            for line in changed(old, new) {
                println!("  {line}");
            }
        }
        println!(
            "\n{differ} of {} message{} ran differently",
            messages.len(),
            if messages.len() == 1 { "" } else { "s" }
        );
    }
    Ok(if differ == 0 {
        EXIT_SAME
    } else {
        EXIT_DIFFERENT
    })
}

/// The version to compare with, and where it came from.
async fn deployed(
    args: &DiffArgs,
    config: &Config,
    consumer: &ConsumerConfig,
    js: &jetstream::Context,
) -> anyhow::Result<(Vec<u8>, PathBuf)> {
    let read = |path: &Path| {
        std::fs::read(path)
            .with_context(|| format!("failed to read {}", path.display()))
            .map(|bytes| (bytes, path.to_path_buf()))
    };
    if let Some(path) = &args.deployed {
        return read(path);
    }
    if config.plugins.store == Some(PluginStoreKind::Nats) {
        let store = NatsStore::open(js, &config.plugins).await?;
        if let Some(pointer) = store.pointer(&consumer.name).await? {
            let bytes = store.fetch(&pointer.digest).await?;
            return Ok((
                bytes,
                PathBuf::from(format!("NATS store: {}", pointer.source)),
            ));
        }
    }
    match &consumer.plugin {
        Some(path) => read(path),
        None => bail!(
            "consumer {:?} has no deployed version to compare with (no `plugin` file{}): give --deployed FILE",
            consumer.name,
            if config.plugins.store == Some(PluginStoreKind::Nats) {
                ", no pointer in the NATS store"
            } else {
                ""
            }
        ),
    }
}

/// The last `n` messages of the consumer's stream on its subjects, oldest first, read by an
/// ordered consumer of this command's own (the durable is not touched): from a window before
/// the stream's last sequence, widened until it holds `n` or reaches the stream's start.
async fn last_messages(
    js: &jetstream::Context,
    consumer: &ConsumerConfig,
    n: usize,
) -> anyhow::Result<Vec<Read>> {
    let mut stream = js
        .get_stream(&consumer.stream)
        .await
        .with_context(|| format!("failed to find stream {:?}", consumer.stream))?;
    let state = stream.info().await?.state.clone();
    let (first, last) = (state.first_sequence.max(1), state.last_sequence);
    if state.messages == 0 {
        return Ok(Vec::new());
    }
    let mut window = (n as u64).max(16) * 4;
    loop {
        let start = last.saturating_sub(window - 1).max(first);
        let mut config = jetstream::consumer::pull::OrderedConfig {
            deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                start_sequence: start,
            },
            ..Default::default()
        };
        // One subject as `filter_subject`: servers before 2.10 know no other.
        match consumer.subjects.as_slice() {
            [one] => config.filter_subject = one.clone(),
            many => config.filter_subjects = many.to_vec(),
        }
        let ordered = stream
            .create_consumer(config)
            .await
            .context("failed to create an ordered consumer to read the stream")?;
        let mut messages = ordered.messages().await?;
        let mut kept: VecDeque<Read> = VecDeque::new();
        while let Ok(Some(next)) = tokio::time::timeout(READ_IDLE, messages.next()).await {
            let message = next.context("failed to read the stream")?;
            let info = message.info().map_err(|e| anyhow::anyhow!("{e}"))?;
            let (sequence, pending) = (info.stream_sequence, info.pending);
            if sequence > last {
                break;
            }
            // A server before 2.10 ignores `filter_subjects` and sends every message.
            if !consumer
                .subjects
                .iter()
                .any(|f| idemhost::subject_matches(f, &message.subject))
            {
                if pending == 0 {
                    break;
                }
                continue;
            }
            kept.push_back(Read {
                sequence,
                subject: message.subject.to_string(),
                headers: message.headers.clone().unwrap_or_default(),
                payload: message.payload.to_vec(),
            });
            if kept.len() > n {
                kept.pop_front();
            }
            if pending == 0 || sequence == last {
                break;
            }
        }
        if kept.len() == n || start == first {
            return Ok(kept.into());
        }
        window = window.saturating_mul(4);
    }
}

/// One message through one version, rolled back: what it did, as lines to compare.
async fn run(
    config: &Config,
    consumer: &ConsumerConfig,
    handler: &WasmHandler,
    subject: &str,
    headers: &async_nats::HeaderMap,
    payload: &[u8],
) -> anyhow::Result<Run> {
    let (ran, traced) = match rehearsal::read(consumer, subject, headers, payload.to_vec(), 1) {
        Ok(msg) => {
            let options = rehearsal::RehearsalOptions {
                migrate: false,
                commit: false,
                keep_setup: true,
            };
            let r = rehearsal::run(config, consumer, handler, &msg, options).await?;
            (Ran::Delivered(r.processed), r.traced)
        }
        Err(refused) => (Ran::Refused(refused.reason), Traced::default()),
    };
    Ok(Run::of(&ran, &traced))
}

/// What a run did that a new version may change: the outcome, each statement with its
/// parameters and result, each outbox event (not timings or log lines). Compared in full (as far
/// as the trace keeps them: 20 rows a statement, 4 KiB a value); shown cut to a line each.
struct Run {
    /// One entry per outcome, statement and event, every value in full.
    key: Vec<String>,
    /// The same entries as shown: one line each, cut.
    shown: Vec<String>,
}

impl PartialEq for Run {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

/// The longest line shown for one entry.
const SHOWN_LINE: usize = 400;

impl Run {
    fn of(ran: &Ran, traced: &Traced) -> Run {
        let mut run = Run {
            key: Vec::new(),
            shown: Vec::new(),
        };
        let (outcome, reason) = plugin_test::outcome_of(ran, traced);
        run.push(
            format!("{outcome} {reason:?}"),
            match &reason {
                Some(r) => format!("{outcome}: {r}"),
                None => outcome.to_string(),
            },
        );
        for (i, s) in traced.statements.iter().enumerate() {
            let params: Vec<String> = s.params.iter().map(plugin_test::show).collect();
            let result = match &s.result {
                StatementResult::Affected(n) => format!("{n} rows affected"),
                StatementResult::Rows { rows, total } => {
                    let shown: Vec<String> = rows
                        .iter()
                        .map(|r| {
                            let row: Vec<String> = r.iter().map(plugin_test::show).collect();
                            row.join(", ")
                        })
                        .collect();
                    format!("{total} rows [{}]", shown.join("; "))
                }
                StatementResult::Error(e) => format!("error {e}"),
            };
            run.push(
                format!("{:?} {:?} {:?}", s.sql, s.params, s.result),
                format!(
                    "statement {}: {} [{}] -> {result}",
                    i + 1,
                    s.sql,
                    params.join(", ")
                ),
            );
        }
        if traced.statements_dropped > 0 {
            let more = format!("{} more statements", traced.statements_dropped);
            run.push(more.clone(), more);
        }
        for (i, p) in traced.published.iter().enumerate() {
            run.push(
                format!(
                    "{:?} {:?} {:?} {:?}",
                    p.subject, p.headers, p.payload, p.refused
                ),
                event(i + 1, p),
            );
        }
        if traced.published_dropped > 0 {
            let more = format!("{} more events", traced.published_dropped);
            run.push(more.clone(), more);
        }
        run
    }

    fn push(&mut self, key: String, shown: String) {
        self.key.push(key);
        self.shown.push(plugin_test::one_line(&shown, SHOWN_LINE));
    }
}

fn event(n: usize, p: &Published) -> String {
    let headers: Vec<String> = p
        .headers
        .iter()
        .map(|(k, v)| {
            format!(
                "{}: {}",
                plugin_test::one_line(k, 80),
                plugin_test::one_line(v, 80)
            )
        })
        .collect();
    format!(
        "event {n}: {} [{}] {}{}",
        plugin_test::one_line(&p.subject, 200),
        headers.join(", "),
        plugin_test::one_line(&String::from_utf8_lossy(&p.payload), 200),
        p.refused
            .as_deref()
            .map_or(String::new(), |r| format!(" (refused: {r})"))
    )
}

/// The entries where two runs differ, as `- deployed` / `+ candidate` pairs (at most 6).
fn changed(old: &Run, new: &Run) -> Vec<String> {
    let mut out = Vec::new();
    for i in 0..old.key.len().max(new.key.len()) {
        if old.key.get(i) == new.key.get(i) {
            continue;
        }
        if out.len() >= 12 {
            out.push("...".into());
            break;
        }
        let line = |run: &Run| {
            run.shown
                .get(i)
                .map_or("(nothing)".to_owned(), Clone::clone)
        };
        out.push(format!("- deployed:  {}", line(old)));
        out.push(format!("+ candidate: {}", line(new)));
    }
    out
}
