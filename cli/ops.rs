//! `idemhost check`, `idemhost markers stats | prune` and `idemhost dlq list | replay`: the
//! operator's commands. Each reads the host's config (PostgreSQL, NATS, the consumers) and
//! calls `idemhost::ops`; `--json` prints the machine-readable report instead of text.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Subcommand};

use idemhost::config::{Config, ConsumerConfig};
use idemhost::ops::{self, check::Verdict, dlq, human, markers, outbox};

/// The config every operator command reads.
#[derive(Debug, Args)]
pub struct Source {
    #[arg(long, env = "IDEMHOST_CONFIG")]
    pub config: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub source: Source,
    #[arg(long)]
    pub consumer: String,
    #[arg(long)]
    pub message_id: String,
    /// The value bound to `$1` of the consumer's `effect_query` (default: the message id), for
    /// effects keyed by a payload field such as an order id.
    #[arg(long)]
    pub effect_param: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum MarkersCommand {
    /// Markers per consumer: rows, oldest and newest, the table's size. Counts every row
    /// (a full scan of the marker table).
    Stats {
        #[command(flatten)]
        source: Source,
    },
    /// Delete a consumer's markers older than a cut-off, in bounded batches — refused while
    /// any copy of those messages could still come back (see docs/operations.md, the retention contract).
    Prune {
        #[command(flatten)]
        source: Source,
        #[arg(long)]
        consumer: String,
        /// Age of the markers to delete, e.g. `90d`.
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Duration,
        /// Rows per transaction.
        #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
        batch: u32,
        /// Count what would be deleted; delete nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConsumerCommand {
    /// Pause a consumer on the server (NATS 2.11+): no replica gets its messages until the time
    /// is up or `resume`; the hosts keep running. Every partition's durable with `partitions`.
    Pause {
        #[command(flatten)]
        source: Source,
        #[arg(long)]
        consumer: String,
        /// For how long (e.g. `10m`).
        #[arg(long = "for", value_parser = humantime::parse_duration)]
        duration: std::time::Duration,
    },
    /// Resume a paused consumer now.
    Resume {
        #[command(flatten)]
        source: Source,
        #[arg(long)]
        consumer: String,
    },
}

pub async fn consumer_command(command: ConsumerCommand) -> anyhow::Result<()> {
    let (source, name, until) = match command {
        ConsumerCommand::Pause {
            source,
            consumer,
            duration,
        } => (
            source,
            consumer,
            Some(std::time::SystemTime::now() + duration),
        ),
        ConsumerCommand::Resume { source, consumer } => (source, consumer, None),
    };
    let config = Config::load(&source.config)?;
    let c = consumer(&config, &name)?;
    let (_client, js) = ops::connect_nats(&config.nats).await?;
    let states = ops::pause::set(&js, c, until).await?;
    if source.json {
        return print_json(&states);
    }
    for s in states {
        match s.until {
            Some(until) => println!("{}: paused until {until}", s.durable),
            None => println!("{}: delivering", s.durable),
        }
    }
    Ok(())
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// A consumer's dead letters: stream sequence, message id, attempts, age, reason.
    List {
        #[command(flatten)]
        source: Source,
        #[arg(long)]
        consumer: String,
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Republish dead letters to their original subject under their original message id (the
    /// marker decides: a message already applied becomes a duplicate), removing each from the
    /// dead letters once stored.
    Replay {
        #[command(flatten)]
        source: Source,
        #[arg(long)]
        consumer: String,
        /// The dead letters of this message id.
        #[arg(long, conflicts_with = "all", required_unless_present = "all")]
        message_id: Option<String>,
        /// Every dead letter of the consumer.
        #[arg(long)]
        all: bool,
        /// Reprocess on purpose under this new message id (one message; audited in
        /// `dead_letter_repair`; needs --reason).
        #[arg(long, requires = "reason", requires = "message_id")]
        repair_key: Option<String>,
        /// Why the repair is needed (recorded with it).
        #[arg(long)]
        reason: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum OutboxCommand {
    /// Outbox rows that failed to publish: set aside (the relay left them) and, with
    /// `--pending`, the ones still backing off or not yet sent; with attempts and last reason.
    List {
        #[command(flatten)]
        source: Source,
        #[arg(long)]
        consumer: Option<String>,
        /// Also rows not set aside (still retried by the relay, or not yet sent).
        #[arg(long)]
        pending: bool,
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Make set-aside rows due again (attempts reset); the relays publish them on their next
    /// pass, under their original event ids.
    Retry {
        #[command(flatten)]
        source: Source,
        /// Only this consumer's rows.
        #[arg(long)]
        consumer: Option<String>,
        /// These rows (repeatable).
        #[arg(long = "id", conflicts_with = "all", required_unless_present = "all")]
        ids: Vec<i64>,
        /// Every set-aside row (of `--consumer`, if given).
        #[arg(long)]
        all: bool,
    },
}

fn consumer<'a>(config: &'a Config, name: &str) -> anyhow::Result<&'a ConsumerConfig> {
    config
        .consumers
        .iter()
        .find(|c| c.name == name)
        .ok_or_else(|| {
            let known: Vec<&str> = config.consumers.iter().map(|c| c.name.as_str()).collect();
            anyhow::anyhow!(
                "consumer {name} is not in the config (configured: {})",
                known.join(", ")
            )
        })
}

async fn pool(config: &Config) -> anyhow::Result<sqlx::PgPool> {
    Ok(ops::connect_postgres(&config.postgres, 2).await?)
}

fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

fn age(secs: f64) -> String {
    human(Duration::from_secs_f64(secs.max(0.0)))
}

/// `idemhost check`; returns the exit status (0 applied, 2 marker without effect, 3 not
/// processed).
pub async fn check(args: CheckArgs) -> anyhow::Result<i32> {
    let config = Config::load(&args.source.config)?;
    let query = config
        .consumers
        .iter()
        .find(|c| c.name == args.consumer)
        .and_then(|c| c.effect_query.clone());
    let pool = pool(&config).await?;
    let param = args.effect_param.as_deref().unwrap_or(&args.message_id);
    let report = ops::check::check(
        &pool,
        &args.consumer,
        &args.message_id,
        query.as_deref(),
        param,
    )
    .await?;
    if args.source.json {
        print_json(&report)?;
    } else {
        println!("consumer:   {}", report.consumer);
        println!("message id: {}", report.message_id);
        match &report.marker {
            Some(m) => println!(
                "marker:     yes, processed_at {} ({} ago), plugin {}",
                m.processed_at,
                age(m.age_secs),
                m.plugin_digest
                    .as_deref()
                    .unwrap_or("(native handler: not recorded)")
            ),
            None => println!("marker:     none"),
        }
        match &report.effect {
            Some(e) => {
                println!(
                    "effect:     {} row(s) from effect_query with $1 = {:?}",
                    e.rows, e.param
                );
                for row in &e.sample {
                    println!("            {row}");
                }
            }
            None => println!("effect:     (no effect_query configured for this consumer)"),
        }
    }
    match report.verdict {
        Verdict::Applied => {}
        Verdict::NotProcessed => eprintln!(
            "not processed by {}: no marker (never delivered, still failing, dead-lettered, or pruned)",
            args.consumer
        ),
        Verdict::MarkerWithoutEffect => eprintln!(
            "\n!!! INVARIANT VIOLATED: {} has a marker for {} but effect_query finds no effect.\n\
             !!! Marker and effect commit together, so code or a manual change removed or bypassed\n\
             !!! the effect. Investigate now; a redelivery will NOT repair it (it is a duplicate).",
            args.consumer, args.message_id
        ),
    }
    Ok(report.verdict.exit_code())
}

pub async fn markers(command: MarkersCommand) -> anyhow::Result<()> {
    match command {
        MarkersCommand::Stats { source } => {
            let config = Config::load(&source.config)?;
            let state = markers::state(&pool(&config).await?, None)
                .await
                .map_err(|e| {
                    anyhow::anyhow!("reading marker statistics: {}", ops::describe_error(&e))
                })?;
            if source.json {
                return print_json(&state);
            }
            println!(
                "processed_message: {} rows, {} (table, indexes, TOAST)",
                state.total_rows,
                bytesize::ByteSize(state.table_bytes)
            );
            println!(
                "{:<40} {:>12} {:>12} {:>16} {:>16}",
                "consumer", "rows", "~bytes", "oldest", "newest"
            );
            for c in &state.consumers {
                let show = |d: Option<Duration>| d.map(human).unwrap_or_else(|| "-".into());
                println!(
                    "{:<40} {:>12} {:>12} {:>16} {:>16}",
                    c.consumer,
                    c.rows,
                    bytesize::ByteSize(c.bytes.max(0) as u64).to_string(),
                    show(c.oldest),
                    show(c.newest)
                );
            }
            Ok(())
        }
        MarkersCommand::Prune {
            source,
            consumer: name,
            older_than,
            batch,
            dry_run,
        } => {
            let config = Config::load(&source.config)?;
            let c = consumer(&config, &name)?;
            let (_client, js) = ops::connect_nats(&config.nats).await?;
            markers::check_horizon(&js, c, older_than).await?;
            let report =
                markers::prune(&pool(&config).await?, &name, older_than, batch, dry_run).await?;
            if source.json {
                return print_json(&report);
            }
            if dry_run {
                println!(
                    "dry run: would delete {} markers of {name} older than {}",
                    report.rows,
                    human(older_than)
                );
            } else {
                println!(
                    "deleted {} markers of {name} older than {} in {} batch(es)",
                    report.rows,
                    human(older_than),
                    report.batches
                );
            }
            Ok(())
        }
    }
}

pub async fn dlq(command: DlqCommand) -> anyhow::Result<()> {
    match command {
        DlqCommand::List {
            source,
            consumer: name,
            limit,
        } => {
            let config = Config::load(&source.config)?;
            let c = consumer(&config, &name)?;
            let (_client, js) = ops::connect_nats(&config.nats).await?;
            let letters = dlq::list(&js, c, limit).await?;
            if source.json {
                return print_json(&letters);
            }
            println!(
                "{:>8}  {:<36} {:>8} {:>12}  reason",
                "seq", "message id", "attempts", "age"
            );
            for d in &letters {
                println!(
                    "{:>8}  {:<36} {:>8} {:>12}  {}",
                    d.seq,
                    d.message_id.as_deref().unwrap_or("(none)"),
                    d.attempts
                        .map(|a| a.to_string())
                        .unwrap_or_else(|| "-".into()),
                    age(d.age_secs),
                    d.reason
                );
            }
            println!(
                "{} dead letter(s) of {name} on {}",
                letters.len(),
                c.dead_letter_subject()
            );
            Ok(())
        }
        DlqCommand::Replay {
            source,
            consumer: name,
            message_id,
            all,
            repair_key,
            reason,
        } => {
            let config = Config::load(&source.config)?;
            let c = consumer(&config, &name)?;
            let (client, js) = ops::connect_nats(&config.nats).await?;
            let selection = match (message_id, all) {
                (Some(id), _) => dlq::Selection::MessageId(id),
                (None, _) => dlq::Selection::All,
            };
            let repair = repair_key.map(|key| dlq::Repair {
                key,
                reason: reason.unwrap_or_default(),
                requested_by: std::env::var("USER").unwrap_or_else(|_| "unknown".into()),
            });
            let pool = pool(&config).await?;
            let report = dlq::replay(&js, &pool, c, &selection, repair.as_ref()).await?;
            client.flush().await.context("flushing NATS")?;
            if source.json {
                return print_json(&report);
            }
            for r in &report.replayed {
                println!(
                    "replayed dead letter {} as {} to {} (stream seq {})",
                    r.seq, r.message_id, r.subject, r.published_seq
                );
            }
            for s in &report.skipped {
                println!("skipped dead letter {}: {}", s.seq, s.why);
            }
            if !report.skipped.is_empty() {
                anyhow::bail!("{} dead letter(s) not replayed", report.skipped.len());
            }
            Ok(())
        }
    }
}

/// `idemhost outbox list | retry`.
pub async fn outbox(command: OutboxCommand) -> anyhow::Result<()> {
    match command {
        OutboxCommand::List {
            source,
            consumer,
            pending,
            limit,
        } => {
            let config = Config::load(&source.config)?;
            let filter = outbox::Filter {
                consumer,
                pending_too: pending,
                ids: Vec::new(),
            };
            let rows = outbox::list(&pool(&config).await?, &filter, limit)
                .await
                .map_err(|e| anyhow::anyhow!("reading the outbox: {}", ops::describe_error(&e)))?;
            if source.json {
                return print_json(&rows);
            }
            println!(
                "{:>10}  {:<24} {:<36} {:>8} {:>12} {:>12}  last error",
                "id", "consumer", "subject", "attempts", "age", "next"
            );
            for r in &rows {
                let next = match r.next_attempt_in_secs {
                    None => "set aside".to_string(),
                    Some(s) => age(s),
                };
                println!(
                    "{:>10}  {:<24} {:<36} {:>8} {:>12} {:>12}  {}",
                    r.id,
                    r.consumer,
                    r.subject,
                    r.attempts,
                    age(r.age_secs),
                    next,
                    r.last_error.as_deref().unwrap_or("-")
                );
            }
            println!("{} row(s)", rows.len());
            Ok(())
        }
        OutboxCommand::Retry {
            source,
            consumer,
            ids,
            all: _,
        } => {
            let config = Config::load(&source.config)?;
            let filter = outbox::Filter {
                consumer,
                pending_too: false,
                ids,
            };
            let n = outbox::retry(&pool(&config).await?, &filter)
                .await
                .map_err(|e| {
                    anyhow::anyhow!("retrying outbox rows: {}", ops::describe_error(&e))
                })?;
            if source.json {
                return print_json(&serde_json::json!({ "retried": n }));
            }
            println!("{n} set-aside row(s) made due again");
            Ok(())
        }
    }
}
