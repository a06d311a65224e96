//! The `idemhost` command line: `run`, `migrate`, `publish` (a producer helper for scripts
//! and demos), `health`, `bench` (the `idemhost-bench` package), `plugin check | new | test |
//! deploy | list | rollback` (in [`plugin`]) and the operator's `check`, `markers stats |
//! prune`, `dlq list | replay`, `outbox`, `consumer pause | resume` (in [`ops`]). Parsing and
//! printing live here; every command calls the `idemhost` library.

#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

use idemhost::config::{Config, LogFormat};
pub use ops::{DlqCommand, MarkersCommand};
pub use plugin::PluginCommand;

mod ops;
mod plugin;
mod plugin_dev;
mod plugin_diff;
mod plugin_new;
mod plugin_repro;
mod plugin_test;
mod plugin_types;
use idemhost::{Host, RunOptions};

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
    #[cfg(feature = "bench")]
    Bench(idemhost_bench::BenchOptions),
    /// Measure throughput and latency (docs/benchmark.md): not in this build, which was made
    /// without the benchmark harness (`--features bench`; scripts/bench.sh asks for it).
    #[cfg(not(feature = "bench"))]
    Bench {
        /// The benchmark's options (see docs/benchmark.md).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
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
            idemhost::telemetry::init_tracing_at(cli.log_format, "warn,idemhost::plugin=off");
            plugin_test::test(args).await
        }
        Command::Plugin {
            command: PluginCommand::Diff(args),
        } => {
            idemhost::telemetry::init_tracing_at(cli.log_format, "warn,idemhost::plugin=off");
            plugin_diff::diff(args).await
        }
        Command::Plugin {
            command: PluginCommand::Dev(args),
        } => {
            idemhost::telemetry::init_tracing_at(cli.log_format, "warn,idemhost::plugin=off");
            plugin_dev::dev(args).await
        }
        command => execute_command(Cli { command, ..cli }).await.map(|()| 0),
    }
}

async fn execute_command(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run { config, no_migrate } => {
            let config = Config::load(&config)?;
            idemhost::telemetry::init_tracing(cli.log_format.or(config.host.log_format));
            Ok(Host::new(config)
                .run(
                    RunOptions {
                        migrate: !no_migrate,
                    },
                    idemhost::telemetry::shutdown_signal(),
                )
                .await?)
        }
        #[cfg(feature = "bench")]
        Command::Bench(options) => {
            // Per-delivery lines would cost more than the deliveries: warnings only.
            idemhost::telemetry::init_tracing_at(cli.log_format, "warn");
            let report = idemhost_bench::run(options).await?;
            println!("{report}");
            Ok(())
        }
        Command::Migrate { config } => {
            let config = Config::load(&config)?;
            idemhost::telemetry::init_tracing(cli.log_format.or(config.host.log_format));
            let pool = idemhost::ops::connect_postgres(&config.postgres, 1).await?;
            idemhost::migrate(&pool, config.postgres.schema.as_deref()).await?;
            println!(
                "migrations applied to {}",
                idemhost::ops::redact_url(&config.postgres.url)
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
            let nats = idemhost::config::NatsConfig {
                url: nats_url,
                ..Default::default()
            };
            let (_client, js) = idemhost::ops::connect_nats(&nats).await?;
            let mut map = async_nats::HeaderMap::new();
            if let Some(id) = &id {
                map.insert("Nats-Msg-Id", id.as_str());
            }
            if let Some(t) = &event_type {
                map.insert(idemhost::headers::EVENT_TYPE_HEADER, t.as_str());
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
            idemhost::ops::admin::probe(&url, timeout)
                .await
                .map_err(|e| anyhow::anyhow!("not healthy: {e}"))?;
            println!("{url}: 200 OK");
            Ok(())
        }
        #[cfg(not(feature = "bench"))]
        Command::Bench { .. } => anyhow::bail!(
            "this idemhost was built without the benchmark harness; build it with `cargo build \
             --release -p idemhost-cli --features bench`, or run scripts/bench.sh, which does \
             (docs/benchmark.md)"
        ),
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

/// The static build's allocator (the container image's): mimalloc. With musl's own, the host
/// spent 26–48 % more CPU per WASM delivery and 21–47 % more in group commit, with 4.2 context
/// switches per WASM delivery against 3.4 (its lock), at 10–21 % less throughput (`idemhost
/// bench`, alternating runs; docs/benchmark.md). A glibc build keeps glibc's: mimalloc measured
/// within the noise there, with 10 MiB more resident.
#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Memory freed goes back to the system without delay once mimalloc lets go of its pages
/// (`purge_delay` 0): by default it purges 10 ms later, and only when the freeing thread
/// allocates again, so an idle host could keep what a plugin made it hold.
fn return_freed_memory_at_once() {
    /// `mi_option_purge_delay`: its place in `mi_option_e` (mimalloc 2's `include/mimalloc.h`
    /// in libmimalloc-sys 0.1.49, pinned exactly in Cargo.toml; the crate does not name it).
    #[cfg(target_env = "musl")]
    const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    // SAFETY: sets a process-wide option; mimalloc reads it at each purge decision.
    #[cfg(target_env = "musl")]
    unsafe {
        libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0)
    };
}

/// Parses the command line, runs it on a tokio runtime and reports errors.
fn main() -> ExitCode {
    return_freed_memory_at_once();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: failed to start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(execute(cli));
    idemhost::telemetry::shutdown_tracing();
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
