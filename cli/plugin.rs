//! `idemhost plugin check | deploy | list | rollback`: components checked locally, swapped in
//! a running host through its admin API, or published to the shared NATS store that every
//! replica follows (`--store nats`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Subcommand};

use idemhost::config::default_compile_cache_dir;
use idemhost::config::{Config, PluginStoreKind};
use idemhost::ops::admin as http;
use idemhost::ops::{self, NatsStore};
use idemhost::{PluginLimits, PluginRuntime, WasmHandler};

#[derive(Debug, Subcommand)]
pub enum PluginCommand {
    /// Load a component exactly as `run` would — compile, check its imports and exports against
    /// the `handler` world, instantiate it once under the limits — and print what it is
    /// granted. Exits non-zero, naming the reason, when the host would refuse it.
    Check {
        /// The component file.
        file: PathBuf,
        /// The consumer's `memory_limit` to instantiate it under.
        #[arg(long, default_value = "64MiB")]
        memory_limit: String,
    },
    /// Swap a consumer's plugin without a restart: in one running host through its admin API
    /// (default), or in every host following the shared NATS store (`--store nats`).
    /// Deliveries already running finish on the old version; a refused component changes
    /// nothing. A consumer *name* is never swapped: a new name is a replay of the stream.
    Deploy {
        #[arg(long)]
        consumer: String,
        /// The component file.
        file: PathBuf,
        #[command(flatten)]
        target: Target,
    },
    /// Run one message through a component exactly as a delivery would — the consumer's
    /// limits, role and SQL gate, the claim included — against the configured PostgreSQL, then
    /// roll back. Prints each statement with its parameters and result, the plugin's log lines,
    /// the outbox events it would publish, the outcome and the timings. Exit status: 0 applied,
    /// 3 duplicate, 4 retryable, 5 terminal, 6 trap (1: the command failed).
    Test(super::plugin_test::TestArgs),
    /// Start a plugin project from the templates: the handler, the WIT, a development config
    /// (`idemhost.toml`), its table (`schema.sql`) and a sample message. Prints the loop's
    /// commands.
    New {
        #[arg(long, value_enum)]
        lang: super::plugin_new::Lang,
        /// The plugin's name (the consumer's, in the development config).
        name: String,
        /// Where to create it (default: ./NAME); must not exist or be empty.
        dir: Option<PathBuf>,
    },
    /// Build a plugin project (any of the four languages) into `plugin.wasm`, installing its
    /// language's pinned toolchain on first use (into IDEMHOST_TOOLCHAIN_DIR, default
    /// ~/.cache/idemhost/toolchain).
    Build {
        /// The project (default: the current directory).
        #[arg(default_value = ".")]
        dir: PathBuf,
    },
    /// Watch a plugin project: build it on every change and run its sample messages through
    /// it as `plugin test` does (rolled back), a few lines per sample; a build's output shows
    /// only when it fails (the language's own error). Until Ctrl-C, or once with `--once`.
    Dev(super::plugin_dev::DevArgs),
    /// Run a candidate version beside the deployed one on the consumer's last messages (read
    /// from its stream without touching its durable), each in a rolled-back transaction, and
    /// show where their outcomes, statements, rows or outbox events differ. Exit status 0: no
    /// message ran differently; 7: some did.
    Diff(super::plugin_diff::DiffArgs),
    /// Show each consumer's current plugin version and history.
    List {
        /// Only this consumer (with `--store nats`).
        #[arg(long)]
        consumer: Option<String>,
        /// Print the admin API's JSON as is.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        target: Target,
    },
    /// Return a consumer to the version before its current one.
    Rollback {
        #[arg(long)]
        consumer: String,
        #[command(flatten)]
        target: Target,
    },
}

/// Which host (or store) a plugin command talks to.
#[derive(Debug, Args)]
pub struct Target {
    /// The admin endpoint, e.g. `http://127.0.0.1:9464`. Default: the config's `admin.listen`.
    #[arg(long, env = "IDEMHOST_ADMIN_URL")]
    url: Option<String>,
    /// The host's config: admin address and token, NATS URL, store buckets, consumer names.
    #[arg(long, env = "IDEMHOST_CONFIG")]
    config: Option<PathBuf>,
    /// The admin token (default: the config's `admin.token`).
    #[arg(long, env = "IDEMHOST_ADMIN__TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// `nats`: write to the shared plugin store instead of one host's admin API.
    #[arg(long, value_enum)]
    store: Option<PluginStoreKind>,
    /// NATS server of the store (default: the config's `nats.url`).
    #[arg(long, env = "IDEMHOST_NATS__URL")]
    nats_url: Option<String>,
    /// How long to wait for the host's answer (validation included).
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

impl Target {
    fn config(&self) -> anyhow::Result<Option<Config>> {
        self.config
            .as_deref()
            .map(Config::load)
            .transpose()
            .map_err(Into::into)
    }

    /// The admin base URL and token.
    fn admin(&self, config: Option<&Config>) -> anyhow::Result<(String, Option<String>)> {
        let url = match (&self.url, config) {
            (Some(url), _) => url.trim_end_matches('/').to_string(),
            (None, Some(c)) => super::admin_base_url(c)?,
            (None, None) => anyhow::bail!("give --url, or --config to read admin.listen from"),
        };
        let token = self
            .token
            .clone()
            .or_else(|| config.and_then(|c| c.admin.token.clone()));
        Ok((url, token))
    }

    async fn store(&self, config: Option<&Config>) -> anyhow::Result<NatsStore> {
        let url = self
            .nats_url
            .clone()
            .or_else(|| config.map(|c| c.nats.url.clone()))
            .unwrap_or_else(|| "nats://127.0.0.1:4222".into());
        let nats = idemhost::config::NatsConfig {
            url,
            ..config.map(|c| c.nats.clone()).unwrap_or_default()
        };
        let (_client, js) = ops::connect_nats(&nats).await?;
        let plugins = config.map(|c| c.plugins.clone()).unwrap_or_default();
        Ok(NatsStore::open(&js, &plugins).await?)
    }
}

/// Runs a `plugin` subcommand.
pub async fn execute(command: PluginCommand) -> anyhow::Result<()> {
    match command {
        PluginCommand::Check { file, memory_limit } => {
            let memory = idemhost::config::parse_size(&memory_limit)
                .map_err(|e| anyhow::anyhow!("--memory-limit: {e}"))?;
            let h = check(&file, memory as usize)?;
            let info = h.load_info();
            println!("{}: accepted", file.display());
            println!("  digest       {}", h.digest());
            println!("  targets      {}", info.world);
            println!("  size         {} bytes", info.size);
            println!("  compiled in  {} ms", info.compile_time.as_millis());
            let wasi = if info.wasi_imports.is_empty() {
                "none".to_string()
            } else {
                info.wasi_imports.join(", ")
            };
            println!("  wasi imports {wasi}");
            Ok(())
        }
        PluginCommand::Deploy {
            consumer,
            file,
            target,
        } => swap(&target, &consumer, Some(&file)).await,
        PluginCommand::Rollback { consumer, target } => swap(&target, &consumer, None).await,
        PluginCommand::List {
            consumer,
            json,
            target,
        } => {
            let config = target.config()?;
            match target.store {
                Some(PluginStoreKind::Nats) => list_store(&target, config.as_ref(), consumer).await,
                None => {
                    let (url, _) = target.admin(config.as_ref())?;
                    let body = http::get(&format!("{url}/plugins"), target.timeout)
                        .await
                        .map_err(|e| anyhow::anyhow!(e))?;
                    if json {
                        println!("{}", body.trim());
                    } else {
                        print_report(&body)?;
                    }
                    Ok(())
                }
            }
        }
        PluginCommand::Test(_) | PluginCommand::Dev(_) | PluginCommand::Diff(_) => {
            unreachable!("handled by cli::execute: it has an exit status")
        }
        PluginCommand::New { lang, name, dir } => {
            let dir = dir.unwrap_or_else(|| PathBuf::from(&name));
            print!("{}", super::plugin_new::new(lang, &name, &dir)?);
            Ok(())
        }
        PluginCommand::Build { dir } => {
            let out = tokio::task::spawn_blocking(move || super::plugin_new::build(&dir)).await??;
            let h = check(&out, 64 << 20)?;
            println!(
                "built {} ({}, {} bytes)",
                out.display(),
                h.digest(),
                h.size()
            );
            Ok(())
        }
    }
}

/// Deploys `file` (or, without one, rolls back) through the admin API or the NATS store.
async fn swap(target: &Target, consumer: &str, file: Option<&Path>) -> anyhow::Result<()> {
    let config = target.config()?;
    let upload = match file {
        Some(file) => {
            let bytes = std::fs::read(file)
                .with_context(|| format!("failed to read {}", file.display()))?;
            let label = file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            Some((file, bytes, label))
        }
        None => None,
    };
    if target.store == Some(PluginStoreKind::Nats) {
        let pointer = match &upload {
            Some((file, bytes, label)) => {
                let memory = known_consumer(config.as_ref(), consumer)?;
                // Refuse here what every host would refuse, before the fleet sees it.
                check(file, memory)?;
                let store = target.store(config.as_ref()).await?;
                store.deploy(consumer, bytes, label).await?
            }
            None => {
                target
                    .store(config.as_ref())
                    .await?
                    .rollback(consumer)
                    .await?
            }
        };
        println!(
            "{consumer}: {} {}; every host following the store swaps to it",
            if upload.is_some() {
                "stored"
            } else {
                "rolled back to"
            },
            pointer.digest
        );
        return Ok(());
    }
    let (url, token) = target.admin(config.as_ref())?;
    let (path, label, body) = match &upload {
        Some((_, bytes, label)) => ("/plugins", label.as_str(), bytes.as_slice()),
        None => ("/plugins/rollback", "", &[][..]),
    };
    let url = format!("{url}{path}?consumer={}", encode(consumer));
    let answer = mutate(&url, token.as_deref(), label, body, target.timeout).await?;
    print_swap(consumer, &answer);
    Ok(())
}

/// Loads a component as `run` would, with the default compile cache.
fn check(file: &Path, memory: usize) -> anyhow::Result<WasmHandler> {
    let mut runtime = PluginRuntime::new()?;
    if let Some(dir) = default_compile_cache_dir() {
        let _ = runtime.set_compile_cache(Some(&dir));
    }
    let limits = PluginLimits {
        timeout: Duration::from_secs(5),
        memory,
    };
    Ok(runtime.load(file, limits)?)
}

/// The consumer's memory limit when the config knows it; an unknown name is refused (a new
/// name is a replay, not a swap), and without a config the name cannot be checked.
fn known_consumer(config: Option<&Config>, consumer: &str) -> anyhow::Result<usize> {
    let Some(config) = config else {
        eprintln!(
            "warning: no --config, so {consumer:?} is not checked against the configured consumers; \
             a pointer for a name no host runs does nothing, and a new consumer name is a replay of \
             its stream, not a hot swap"
        );
        return Ok(64 << 20);
    };
    match config.consumers.iter().find(|c| c.name == consumer) {
        Some(c) => Ok(c.memory_limit.0 as usize),
        None => anyhow::bail!(
            "no consumer named {consumer} in the config: a new consumer name is not a hot swap but \
             a replay of everything its stream holds — add it to the config deliberately"
        ),
    }
}

/// POSTs to a mutating admin endpoint; the answer's JSON, or the host's refusal as the error.
async fn mutate(
    url: &str,
    token: Option<&str>,
    label: &str,
    body: &[u8],
    timeout: Duration,
) -> anyhow::Result<serde_json::Value> {
    let auth = format!("Bearer {}", token.unwrap_or(""));
    let mut headers = vec![("Authorization", auth.as_str())];
    if !label.is_empty() {
        headers.push(("Idemhost-Source", label));
    }
    let answer = http::request_ok("POST", url, &headers, body, timeout)
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    serde_json::from_str(&answer).context("the host answered something other than JSON")
}

fn print_swap(consumer: &str, answer: &serde_json::Value) {
    let field = |k: &str| {
        answer
            .get(k)
            .and_then(|v| v.as_str())
            .unwrap_or("?")
            .to_string()
    };
    if answer.get("changed").and_then(|v| v.as_bool()) == Some(false) {
        println!(
            "{consumer}: {} is already the current version",
            field("digest")
        );
    } else {
        let ms = answer
            .get("validation_ms")
            .and_then(|v| v.as_f64())
            .unwrap_or(0.0);
        println!(
            "{consumer}: {} -> {} (validated in {ms:.0} ms)",
            field("replaced"),
            field("digest")
        );
    }
}

fn print_report(body: &str) -> anyhow::Result<()> {
    let report: serde_json::Value = serde_json::from_str(body).context("bad /plugins answer")?;
    let empty = Vec::new();
    let consumers = report["consumers"].as_array().unwrap_or(&empty);
    for c in consumers {
        let s = |v: &serde_json::Value| v.as_str().unwrap_or("-").to_string();
        println!("{}", s(&c["name"]));
        for (i, v) in c["history"].as_array().unwrap_or(&empty).iter().enumerate() {
            let mark = if i == 0 { "current " } else { "        " };
            println!(
                "  {mark}{}  {}  loaded {}  deliveries {}",
                s(&v["digest"]),
                s(&v["source"]),
                s(&v["loaded_at"]),
                v["deliveries"]
            );
        }
    }
    Ok(())
}

async fn list_store(
    target: &Target,
    config: Option<&Config>,
    consumer: Option<String>,
) -> anyhow::Result<()> {
    let store = target.store(config).await?;
    let names = match consumer {
        Some(c) => vec![c],
        None => store.consumers().await?,
    };
    let bucket = config.map(|c| c.plugins.clone()).unwrap_or_default();
    println!("store {} / {}", bucket.version_bucket, bucket.object_bucket);
    for name in names {
        println!("{name}");
        for (i, p) in store.history(&name).await?.iter().rev().enumerate() {
            let mark = if i == 0 { "current " } else { "        " };
            println!(
                "  {mark}{}  {}  deployed {}",
                p.digest, p.source, p.deployed_at
            );
        }
    }
    Ok(())
}

/// A query-string value, percent-encoded.
fn encode(value: &str) -> String {
    url::form_urlencoded::byte_serialize(value.as_bytes()).collect()
}
