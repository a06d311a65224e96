//! The `idemhost` command line: `run`, `migrate`, `publish` (a producer helper for scripts
//! and demos), `health`, `plugin check | deploy | list | rollback` (in [`plugin`]) and the
//! operator's `check`, `markers stats | prune`, `dlq list | replay` (in [`ops`]). Parsing lives here; every command calls the library.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

use crate::config::{Config, LogFormat};
pub use ops::{DlqCommand, MarkersCommand};
pub use plugin::PluginCommand;

mod ops;
mod plugin;
mod plugin_new;
mod plugin_test;
use crate::host::{Host, RunOptions};
use crate::pg;

#[derive(Debug, Parser)]
#[command(
    name = "idemhost",
    version,
    about = "Idempotent NATS JetStream consumer host with WASM handlers"
)]
pub struct Cli {
    /// Log line format (default: the config's `host.log_format`, else text).
    #[arg(long, env = "IDEMHOST_LOG_FORMAT", global = true)]
    pub log_format: Option<LogFormat>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Consume every configured consumer until SIGINT/SIGTERM.
    Run {
        #[arg(long, env = "IDEMHOST_CONFIG")]
        config: PathBuf,
        /// Do not apply the host's migrations at start-up.
        #[arg(long)]
        no_migrate: bool,
    },
    /// Measure throughput and latency side by side with pgbench and the seed's Node consumer
    /// (see docs/benchmark.md); prints a table, then one JSON line.
    Bench(crate::bench::BenchOptions),
    /// Apply the host's migrations (the `processed_message` table) and exit.
    Migrate {
        #[arg(long, env = "IDEMHOST_CONFIG")]
        config: PathBuf,
    },
    /// Publish one message to JetStream and wait for the stream's ack.
    Publish {
        #[arg(
            long,
            env = "IDEMHOST_NATS__URL",
            default_value = "nats://127.0.0.1:4222"
        )]
        nats_url: String,
        #[arg(long)]
        subject: String,
        /// The stable message id (sent as `Nats-Msg-Id`). Omit to publish without one.
        #[arg(long)]
        id: Option<String>,
        /// Sent as `Idemhost-Event-Type`.
        #[arg(long)]
        event_type: Option<String>,
        /// Extra header, `Name: value` (repeatable).
        #[arg(long = "header", value_parser = parse_header)]
        headers: Vec<(String, String)>,
        /// The payload (e.g. JSON text).
        payload: String,
    },
    /// Exit 0 when the admin endpoint answers 200 (a HEALTHCHECK for images without curl).
    Health {
        /// `/readyz` (ready to consume) or `/healthz` (alive) of a running host. Default: the
        /// `/readyz` of the config's `admin.listen` (env overrides included).
        #[arg(long, env = "IDEMHOST_HEALTH_URL")]
        url: Option<String>,
        /// The host's config, to find `admin.listen` when `--url` is not given.
        #[arg(long, env = "IDEMHOST_CONFIG")]
        config: Option<PathBuf>,
        /// How long to wait for the answer.
        #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
    },
    /// Check, deploy (hot swap), list and roll back plugin components.
    Plugin {
        #[command(subcommand)]
        command: PluginCommand,
    },
    /// Prove one message's marker (with processed_at and plugin version) and, through the
    /// consumer's `effect_query`, its effect. Exit 0: applied; 2: marker WITHOUT effect (the
    /// invariant is broken); 3: not processed.
    Check(ops::CheckArgs),
    /// Marker table statistics and retention.
    Markers {
        #[command(subcommand)]
        command: MarkersCommand,
    },
    /// List and replay dead letters.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// Outbox events the relay could not publish: list them, send set-aside ones again.
    Outbox {
        #[command(subcommand)]
        command: ops::OutboxCommand,
    },
    /// Pause a consumer on the server for a while (NATS 2.11+), or resume it.
    Consumer {
        #[command(subcommand)]
        command: ops::ConsumerCommand,
    },
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once(':').ok_or("expected `Name: value`")?;
    Ok((k.trim().to_string(), v.trim().to_string()))
}

/// Runs the parsed command line; the process's exit status on success (`check` tells its
/// verdict by it).
pub async fn execute(cli: Cli) -> anyhow::Result<u8> {
    match cli.command {
        Command::Check(args) => ops::check(args).await.map(|code| code as u8),
        Command::Markers { command } => ops::markers(command).await.map(|()| 0),
        Command::Dlq { command } => ops::dlq(command).await.map(|()| 0),
        Command::Outbox { command } => ops::outbox(command).await.map(|()| 0),
        Command::Consumer { command } => ops::consumer_command(command).await.map(|()| 0),
        Command::Plugin {
            command: PluginCommand::Test(args),
        } => {
            // The plugin's own lines are in the report (sanitized); on stderr they would reach
            // the terminal as the plugin wrote them.
            init_tracing_at(cli.log_format, "warn,idemhost::plugin=off");
            plugin_test::test(args).await
        }
        command => execute_command(Cli { command, ..cli }).await.map(|()| 0),
    }
}

async fn execute_command(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run { config, no_migrate } => {
            let config = Config::load(&config)?;
            init_tracing(cli.log_format.or(config.host.log_format));
            Host::new(config)
                .run(
                    RunOptions {
                        migrate: !no_migrate,
                    },
                    shutdown_signal(),
                )
                .await
        }
        Command::Bench(options) => {
            // Per-delivery lines would cost more than the deliveries: warnings only.
            init_tracing_at(cli.log_format, "warn");
            let report = crate::bench::run(options).await?;
            println!("{report}");
            Ok(())
        }
        Command::Migrate { config } => {
            let config = Config::load(&config)?;
            init_tracing(cli.log_format.or(config.host.log_format));
            let pool = pg::connect(&config.postgres, 1).await?;
            pg::migrate(&pool, config.postgres.schema.as_deref()).await?;
            println!(
                "migrations applied to {}",
                pg::redact_url(&config.postgres.url)
            );
            Ok(())
        }
        Command::Publish {
            nats_url,
            subject,
            id,
            event_type,
            headers,
            payload,
        } => {
            let nats = crate::config::NatsConfig {
                url: nats_url,
                ..Default::default()
            };
            let (_client, js) = crate::host::connect_nats(&nats).await?;
            let mut map = async_nats::HeaderMap::new();
            if let Some(id) = &id {
                map.insert("Nats-Msg-Id", id.as_str());
            }
            if let Some(t) = &event_type {
                map.insert(crate::source::EVENT_TYPE_HEADER, t.as_str());
            }
            for (k, v) in &headers {
                map.insert(k.as_str(), v.as_str());
            }
            let ack = js
                .publish_with_headers(subject.clone(), map, payload.into_bytes().into())
                .await
                .context("failed to publish")?
                .await
                .context("JetStream did not store the message")?;
            println!(
                "published to {} (stream {}, seq {}{})",
                subject,
                ack.stream,
                ack.sequence,
                if ack.duplicate {
                    ", duplicate id: dropped by the broker's duplicate window"
                } else {
                    ""
                }
            );
            Ok(())
        }
        Command::Health {
            url,
            config,
            timeout,
        } => {
            let url = match (url, config) {
                (Some(url), _) => url,
                (None, Some(path)) => readyz_url(&Config::load(&path)?)?,
                (None, None) => anyhow::bail!("give --url, or --config to read admin.listen from"),
            };
            crate::admin::probe(&url, timeout)
                .await
                .map_err(|e| anyhow::anyhow!("not healthy: {e}"))?;
            println!("{url}: 200 OK");
            Ok(())
        }
        Command::Plugin { command } => plugin::execute(command).await,
        Command::Check(_)
        | Command::Markers { .. }
        | Command::Dlq { .. }
        | Command::Outbox { .. }
        | Command::Consumer { .. } => {
            unreachable!("handled by execute")
        }
    }
}

/// `http://<admin.listen>/readyz`.
fn readyz_url(config: &Config) -> anyhow::Result<String> {
    Ok(format!("{}/readyz", admin_base_url(config)?))
}

/// `http://<admin.listen>`, asking a wildcard listen address over loopback.
fn admin_base_url(config: &Config) -> anyhow::Result<String> {
    let listen = config
        .admin
        .listen
        .as_deref()
        .ok_or_else(|| anyhow::anyhow!("admin.listen is not configured: no endpoint to ask"))?;
    let addr: std::net::SocketAddr = listen
        .parse()
        .with_context(|| format!("admin.listen {listen}"))?;
    let host = match addr.ip() {
        ip if ip.is_unspecified() && ip.is_ipv4() => "127.0.0.1".to_string(),
        ip if ip.is_unspecified() => "[::1]".to_string(),
        std::net::IpAddr::V6(ip) => format!("[{ip}]"),
        ip => ip.to_string(),
    };
    Ok(format!("http://{host}:{}", addr.port()))
}

/// Logs to stderr; `RUST_LOG` filters (default `info`). Built with the `otlp` feature, spans
/// are also exported when `OTEL_EXPORTER_OTLP_ENDPOINT` is set.
pub fn init_tracing(format: Option<LogFormat>) {
    init_tracing_at(format, "info")
}

/// [`init_tracing`] with another default filter (`RUST_LOG` still wins).
pub fn init_tracing_at(format: Option<LogFormat>, default_filter: &str) {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = match format.unwrap_or(LogFormat::Text) {
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .boxed(),
        LogFormat::Text => fmt.boxed(),
    };
    let registry = tracing_subscriber::registry().with(fmt).with(filter);
    #[cfg(feature = "otlp")]
    let _ = registry.with(crate::otel::layer()).try_init();
    #[cfg(not(feature = "otlp"))]
    {
        if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() {
            eprintln!(
                "warning: OTEL_EXPORTER_OTLP_ENDPOINT is set, but this idemhost was built without the `otlp` feature"
            );
        }
        let _ = registry.try_init();
    }
}

/// Flushes exported spans (feature `otlp`); call once before the process exits.
pub fn shutdown_tracing() {
    #[cfg(feature = "otlp")]
    crate::otel::shutdown();
}

/// Resolves on SIGINT or SIGTERM (also as PID 1 in a container: tokio installs real handlers).
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
