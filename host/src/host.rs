//! Wiring: connect to PostgreSQL and NATS, migrate, load every consumer's handler, bind its
//! JetStream consumer, and run all consumers until the shutdown future resolves.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tracing::info;

use crate::admin::{self, Readiness};
use crate::claim::{ClaimSettings, Claimer};
use crate::config::{Config, ConsumerConfig, PluginStoreKind, PostgresConfig};
use crate::handler::Handler;
use crate::metrics::Metrics;
use crate::pg;
use crate::plugin::{PluginConfig, PluginLimits, PluginRuntime, PoolSizing};
use crate::registry::{self, Plugins, store::NatsStore};
use crate::source;

/// Start-up choices that are not part of the configuration file.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Apply the host's migrations before consuming (`idemhost run` unless `--no-migrate`).
    pub migrate: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions { migrate: true }
    }
}

/// A consumer host: a validated configuration plus any native handlers an embedding program
/// registers (they take the place of the consumer's `plugin`).
pub struct Host {
    config: Config,
    native: HashMap<String, Arc<dyn Handler>>,
    metrics: Option<HostMetrics>,
}

/// The host's metrics, held by an embedder that serves them itself (docs/embedding.md): give
/// the same handle to each [`Host`] it runs ([`Host::with_metrics`]) and its counters go on
/// across runs; [`HostMetrics::render`] is what `/metrics` would show. Without one, each run
/// has its own, seen only at `metrics.listen` or `admin.listen`. One running host at a time
/// per handle: the plugins' metrics are those of the run that loaded them last, and a run that
/// ends drops them.
#[derive(Clone, Default)]
pub struct HostMetrics(Arc<Metrics>);

impl HostMetrics {
    /// Every metric at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// The exposition (OpenMetrics text, ending in `# EOF`), as `/metrics` serves it: the
    /// counters of every run given this handle, the gauges as the last one left them, the
    /// plugins of the run in progress.
    pub fn render(&self) -> String {
        self.0.render()
    }

    /// [`HostMetrics::render`] without its final `# EOF` line: to put before an embedder's
    /// own families in one exposition.
    pub fn families(&self) -> String {
        let text = self.0.render();
        match text.strip_suffix("# EOF\n") {
            Some(families) => families.to_string(),
            None => text,
        }
    }
}

impl std::fmt::Debug for HostMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostMetrics")
    }
}

impl Host {
    /// A host for a validated `config`; every consumer runs its configured plugin.
    pub fn new(config: Config) -> Self {
        Host {
            config,
            native: HashMap::new(),
            metrics: None,
        }
    }

    /// Records into `metrics`, an embedder's handle, instead of metrics of this run's own.
    pub fn with_metrics(mut self, metrics: &HostMetrics) -> Self {
        self.metrics = Some(metrics.clone());
        self
    }

    /// Runs `consumer` with a native Rust handler instead of a WASM plugin.
    pub fn with_handler(mut self, consumer: &str, handler: Arc<dyn Handler>) -> Self {
        self.native.insert(consumer.to_string(), handler);
        self
    }

    /// Connects, migrates (unless told not to), loads and binds every consumer, then consumes
    /// until `shutdown` resolves; in-flight deliveries then get `host.shutdown_timeout` to
    /// finish. Any start-up problem is returned before a single message is pulled.
    pub async fn run(
        self,
        options: RunOptions,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), crate::Error> {
        self.run_anyhow(options, shutdown).await.map_err(|e| {
            // The first cause that says which side failed; the configuration's and the
            // plugins' errors are known here.
            let kind = e.chain().find_map(|cause| {
                if cause.is::<crate::config::ConfigError>() {
                    Some(crate::ErrorKind::Config)
                } else if cause.is::<crate::plugin::PluginError>() {
                    Some(crate::ErrorKind::Plugin)
                } else {
                    crate::error::kind_of(cause)
                }
            });
            match kind {
                Some(kind) => crate::Error::of_kind(e, kind),
                None => e.into(),
            }
        })
    }

    async fn run_anyhow(
        self,
        options: RunOptions,
        shutdown: impl Future<Output = ()>,
    ) -> anyhow::Result<()> {
        let Host {
            config,
            native,
            metrics,
        } = self;
        info!(
            version = env!("CARGO_PKG_VERSION"),
            consumers = config.consumers.len(),
            "idemhost starting"
        );
        for warning in crate::config::unread_overrides(std::env::vars()) {
            tracing::warn!("{warning}");
        }
        plugin_files_readable(&config, &native)?;
        let total_in_flight: u32 = config.consumers.iter().map(|c| c.max_in_flight).sum();
        if total_in_flight > config.postgres.max_connections {
            tracing::warn!(
                total_in_flight,
                max_connections = config.postgres.max_connections,
                "more deliveries in flight than pooled connections; some will wait for a connection"
            );
        }
        let readiness = Readiness::default();
        let metrics = metrics.unwrap_or_default().0;
        readiness.set_metrics(metrics.clone());
        let _admin = match &config.admin.listen {
            Some(listen) => Some(admin::serve(listen, &config.admin, readiness.clone()).await?),
            None => None,
        };
        let _metrics_endpoint = match &config.metrics.listen {
            Some(listen) => {
                Some(admin::serve_metrics(listen, &config.admin, readiness.clone()).await?)
            }
            None => None,
        };
        let (pool, failover) =
            pg::connect_following(&config.postgres, config.postgres.max_connections).await?;
        let _watcher = failover.spawn_watch(config.postgres.failover_check_interval.0);
        let served = serve(
            &config,
            &native,
            total_in_flight,
            options,
            shutdown,
            (&pool, &failover),
            (&readiness, &metrics),
        )
        .await;
        // Whether it ran or failed to start: the plugins' role pools are closed too, not the
        // host's alone.
        if tokio::time::timeout(CLOSE_POOLS_WITHIN, failover.close_all())
            .await
            .is_err()
        {
            tracing::warn!(
                "PostgreSQL connections still in use {CLOSE_POOLS_WITHIN:?} after the consumers stopped; not waiting for them"
            );
        }
        // The plugins' collector holds this run's plugins (their engine, its ticker thread):
        // an embedder's handle outlives the run.
        metrics.set_plugins(None);
        served?;
        info!("idemhost stopped");
        Ok(())
    }
}

/// How long a returning [`Host::run`] waits for its pools to close.
const CLOSE_POOLS_WITHIN: Duration = Duration::from_secs(10);

/// [`Host::run`] once connected to PostgreSQL: migrates, loads and binds, consumes until
/// `shutdown`, drains.
async fn serve(
    config: &Config,
    native: &HashMap<String, Arc<dyn Handler>>,
    total_in_flight: u32,
    options: RunOptions,
    shutdown: impl Future<Output = ()>,
    (pool, failover): (&PgPool, &Arc<pg::Failover>),
    (readiness, metrics): (&Readiness, &Arc<Metrics>),
) -> anyhow::Result<()> {
    if !options.migrate {
        pg::check_migrated(pool).await?;
    }
    let runtime = plugin_runtime(config, native, total_in_flight)?;
    let nats_url = pg::redact_urls(&config.nats.url);
    let (client, js) = source::connect_nats(&config.nats).await?;
    readiness.watch(client.clone(), pool.clone());
    let store = match (config.plugins.store, &runtime) {
        (Some(PluginStoreKind::Nats), Some(_)) => {
            Some(NatsStore::open(&js, &config.plugins).await?)
        }
        _ => None,
    };

    let (registry, watched) = load(config, native, runtime, store.as_ref()).await?;
    // Every plugin is loaded and every consumer checked against both servers before anything
    // on them changes: a start refused for one consumer leaves the schema unmigrated, no role
    // made and no stream or durable created for any.
    preflight(config, native, pool, &js).await?;
    if options.migrate {
        pg::migrate(pool, config.postgres.schema.as_deref()).await?;
    }
    let registry = Arc::new(registry);
    readiness.set_registry(registry.clone());
    metrics.set_plugins(Some(Box::new(registry::PluginCollector(registry.clone()))));
    let runtimes = bind(config, native, pool, failover, &registry, metrics, &js).await?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut background = Vec::new();
    if config.plugins.watch && !watched.is_empty() {
        background.push(registry::watch::spawn(
            registry.clone(),
            watched,
            config.plugins.watch_interval.0,
            stop_rx.clone(),
        ));
    }
    if let Some(store) = store {
        background.push(store.follow(registry.clone(), stop_rx.clone()));
    }
    background.extend(crate::ops::sample::spawn(
        metrics.clone(),
        &config.metrics,
        js.clone(),
        pool.clone(),
        config.consumers.clone(),
        stop_rx.clone(),
    ));
    // The relay stops after the consumers: its last pass sends what they committed.
    let (relay_stop, relay_stop_rx) = watch::channel(false);
    let relay = config.outbox.relay.then(|| {
        crate::outbox::relay::spawn(
            pool.clone(),
            js.clone(),
            metrics.clone(),
            &config.outbox,
            relay_stop_rx,
        )
    });
    let drain_for = config.host.shutdown_timeout.0;
    let mut running = JoinSet::new();
    for rt in runtimes {
        running.spawn(rt.run(stop_rx.clone(), drain_for));
    }
    info!(consumers = config.consumers.len(), nats = %nats_url, "idemhost running");
    readiness.set(true);
    shutdown.await;
    readiness.set(false);
    info!("shutdown requested; finishing in-flight deliveries");
    let _ = stop_tx.send(true);
    drain(
        running,
        relay.map(|r| (r, relay_stop)),
        background,
        drain_for,
    )
    .await;
    // Flush acks still buffered in the client before the process exits.
    if let Err(e) = client.flush().await {
        tracing::warn!(error = %e, "failed to flush NATS connection");
    }
    Ok(())
}

/// Every consumer's plugin file can be read, checked before anything connects: a missing one
/// was found only after the migrations ran and NATS connected. With a plugin store the store's
/// version comes first, and the file is read only where it has none: not checked here.
fn plugin_files_readable(
    config: &Config,
    native: &HashMap<String, Arc<dyn Handler>>,
) -> anyhow::Result<()> {
    if config.plugins.store.is_some() {
        return Ok(());
    }
    for c in &config.consumers {
        if let Some(path) = &c.plugin
            && !native.contains_key(&c.name)
        {
            std::fs::File::open(path).with_context(|| {
                format!(
                    "consumer {}: cannot read its plugin {} (nothing was changed on the servers: \
                     build it, or fix `plugin` in the config)",
                    c.name,
                    path.display()
                )
            })?;
        }
    }
    Ok(())
}

/// The WASM runtime, when any consumer has no native handler: its instance pool sized for the
/// configured concurrency and the largest `memory_limit`, with the compile cache.
fn plugin_runtime(
    config: &Config,
    native: &HashMap<String, Arc<dyn Handler>>,
    total_in_flight: u32,
) -> anyhow::Result<Option<Arc<PluginRuntime>>> {
    if config
        .consumers
        .iter()
        .all(|c| native.contains_key(&c.name))
    {
        return Ok(None);
    }
    let sizing = PoolSizing {
        // Twice the configured concurrency: headroom for instances still being torn down.
        instances: total_in_flight.saturating_mul(2).max(8),
        max_memory: config
            .consumers
            .iter()
            .map(|c| c.memory_limit.0 as usize)
            .max()
            .unwrap_or(64 << 20),
        keep_resident: config.plugins.keep_resident.0 as usize,
    };
    let mut rt = PluginRuntime::with_pool(sizing)?;
    if let Some(dir) = config.host.compile_cache_dir() {
        // An unusable cache only costs compile time: warn and compile in memory.
        if let Err(reason) = rt.set_compile_cache(Some(&dir)) {
            tracing::warn!(%reason, "compile cache disabled");
        }
        rt.set_compile_cache_max(config.host.compile_cache_max.0);
    }
    Ok(Some(Arc::new(rt)))
}

/// Every consumer's handler in a registry: its native handler, else its plugin — the shared
/// store's current version when there is one (the file seeds the store when it has none).
/// Also the plugin files to watch for swaps, by consumer.
async fn load(
    config: &Config,
    native: &HashMap<String, Arc<dyn Handler>>,
    runtime: Option<Arc<PluginRuntime>>,
    store: Option<&NatsStore>,
) -> anyhow::Result<(Plugins, Vec<registry::watch::Watched>)> {
    let mut registry = Plugins::new(runtime.clone(), config.plugins.history as usize);
    let mut watched = Vec::new();
    for c in &config.consumers {
        let limits = PluginLimits {
            timeout: c.handler_timeout.0,
            memory: c.memory_limit.0 as usize,
        };
        if let Some(h) = native.get(&c.name) {
            registry.insert(
                &c.name,
                h.clone(),
                "native".into(),
                None,
                Default::default(),
            );
            continue;
        }
        let (Some(path), Some(rt)) = (&c.plugin, &runtime) else {
            anyhow::bail!(
                "consumer {}: no `plugin` configured and no native handler registered",
                c.name
            );
        };
        // Before anything is read: a replacement from here on is a change to swap in.
        let seen = registry::watch::identity(path);
        let from_store = match store {
            Some(store) => store.pointer(&c.name).await?.map(|p| (store, p)),
            None => None,
        };
        let (h, source) = match from_store {
            Some((store, pointer)) => {
                let bytes = store
                    .fetch(&pointer.digest)
                    .await
                    .with_context(|| format!("consumer {}: the store's version", c.name))?;
                let origin = format!("nats:{}", config.plugins.object_bucket);
                let h = rt
                    .load_bytes_blocking(bytes, PathBuf::from(&origin), limits)
                    .await
                    .with_context(|| format!("consumer {}", c.name))?;
                (h, origin)
            }
            None => {
                let bytes = std::fs::read(path).with_context(|| {
                    format!(
                        "consumer {}: failed to read plugin {}",
                        c.name,
                        path.display()
                    )
                })?;
                let h = rt
                    .load_bytes_blocking(bytes.clone(), path.clone(), limits)
                    .await
                    .with_context(|| format!("consumer {}", c.name))?;
                if let Some(store) = store {
                    // Another replica may seed first; the store's watch then converges.
                    let label = path.file_name().map(|n| n.to_string_lossy().into_owned());
                    store
                        .seed(&c.name, &bytes, &label.unwrap_or_default())
                        .await?;
                }
                (h, format!("file:{}", path.display()))
            }
        };
        let load = h.load_info();
        info!(consumer = %c.name, plugin = %source, digest = h.digest(), bytes = load.size,
            compile_ms = load.compile_time.as_millis() as u64, from_cache = load.from_cache,
            wasi = %load.wasi_imports.join(","), "plugin loaded");
        let config: PluginConfig = Arc::new(c.config.clone());
        let h = h.with_config(config.clone());
        registry.insert(&c.name, Arc::new(h), source, Some(limits), config);
        watched.push((c.name.clone(), path.clone(), seen));
    }
    Ok((registry, watched))
}

/// The refusals that need the servers and change nothing on them, for every consumer: what
/// the NATS server cannot do and a missing stream (`source::check_consumer`), and a table in
/// `tables` that does not exist. Run before the migrations and before any consumer is bound.
async fn preflight(
    config: &Config,
    native: &HashMap<String, Arc<dyn Handler>>,
    pool: &PgPool,
    js: &async_nats::jetstream::Context,
) -> anyhow::Result<()> {
    let schema = pg::schema_name(pool, config.postgres.schema.as_deref()).await?;
    let mut conn = pool.acquire().await?;
    for c in &config.consumers {
        source::check_consumer(js, c, source::partition::Spread::of(&config.host)).await?;
        if !native.contains_key(&c.name) {
            pg::wall::missing_tables(&mut conn, &c.name, &schema, &c.tables).await?;
        }
    }
    Ok(())
}

/// Binds every consumer's JetStream durable (one per partition), each on its consumer's
/// claimer: the host's pool for a native handler, the consumer's role pool for a plugin.
async fn bind(
    config: &Config,
    native: &HashMap<String, Arc<dyn Handler>>,
    pool: &PgPool,
    failover: &Arc<pg::Failover>,
    registry: &Plugins,
    metrics: &Arc<Metrics>,
    host_js: &async_nats::jetstream::Context,
) -> anyhow::Result<Vec<Arc<source::ConsumerRuntime>>> {
    let total_in_flight: u32 = config.consumers.iter().map(|c| c.max_in_flight).sum();
    let mut runtimes = Vec::new();
    for c in &config.consumers {
        let claimer = if native.contains_key(&c.name) {
            // The embedding program's own (trusted) code: on the host's pool.
            let mut settings = ClaimSettings::for_consumer(c);
            settings.failover_wait = config.postgres.failover_wait.0;
            settings.keep_connections = kept_connections(
                c.max_in_flight,
                total_in_flight,
                config.postgres.max_connections,
            );
            Claimer::new(pool.clone(), settings)
                .following(failover)
                .sparing_inbox(&config.nats.inbox_prefix)
        } else {
            plugin_claimer(&config.postgres, pool, failover, c)
                .await?
                .sparing_inbox(&config.nats.inbox_prefix)
        };
        let slot = registry
            .slot(&c.name)
            .cloned()
            .context("consumer missing from the plugin registry")?;
        // With partitions, one durable (and pull loop) each, all on the consumer's claimer.
        let partitions: Vec<Option<u32>> = match c.partitions {
            0 => vec![None],
            n => (0..n).map(Some).collect(),
        };
        let spread = source::partition::Spread::of(&config.host).filter(|_| c.partitions > 0);
        // Each consumer pulls, acks and dead-letters on a NATS connection of its own: a message
        // the client cannot read (a header block that is not UTF-8, which any producer can
        // publish) makes it drop the connection the message came on, and on a shared one every
        // consumer's pull requests and acks in flight went with it, each time the broker
        // delivered that message again. The watcher of the messages no delivery settles (see
        // `source::exhausted`) reads its advisories on the host's connection, which such a
        // message never reaches: on the consumer's, each drop cut its pull for up to its
        // heartbeat timeout, and four such messages took over 90 s to be dead-lettered.
        let link = source::connect_link(&config.nats).await?;
        for p in partitions {
            let bound = source::bind(
                (&link, host_js),
                c,
                p,
                spread,
                claimer.clone(),
                slot.clone(),
                metrics,
            )
            .await?;
            let priority = p.zip(spread).map(|(p, s)| s.priority(p));
            info!(consumer = %c.name, stream = %c.stream, durable = %c.durable_name(), partition = ?p, priority = ?priority, isolation = ?c.isolation, max_in_flight = c.max_in_flight, "consumer bound");
            runtimes.push(Arc::new(
                bound.log_payload_digest(config.host.log_payload_digest),
            ));
        }
    }
    Ok(runtimes)
}

/// After the stop signal: waits for every consumer to finish its in-flight deliveries, then
/// gives the outbox relay `drain_for` for its last pass (what the consumers committed), and
/// stops the background tasks (a swap still validating is abandoned: it only takes effect when
/// installed).
async fn drain(
    mut consumers: JoinSet<()>,
    relay: Option<(JoinHandle<()>, watch::Sender<bool>)>,
    background: Vec<JoinHandle<()>>,
    drain_for: Duration,
) {
    while consumers.join_next().await.is_some() {}
    if let Some((mut relay, stop)) = relay {
        let _ = stop.send(true);
        tokio::select! {
            _ = &mut relay => {}
            _ = tokio::time::sleep(drain_for) => {
                relay.abort();
                tracing::warn!("outbox relay did not finish its last pass; the next relay sends the rest");
            }
        }
    }
    for task in background {
        task.abort();
    }
}

/// The claimer of a consumer whose handler is a plugin: deliveries on a pool of its own,
/// logged in as the consumer's role (provisioned first; SECURITY.md), the host's own
/// statements on `pool`.
pub(crate) async fn plugin_claimer(
    postgres: &PostgresConfig,
    pool: &PgPool,
    failover: &Arc<pg::Failover>,
    c: &ConsumerConfig,
) -> anyhow::Result<Claimer> {
    let role = pg::wall::plugin_role(postgres, c);
    pg::wall::provision(pool, c, &role).await?;
    // With partitions every partition may have a delivery running.
    let size = c.max_in_flight.max(c.partitions).max(1);
    let mut settings = ClaimSettings::for_consumer(c);
    settings.failover_wait = postgres.failover_wait.0;
    // The durability the operator configured, and the consumer's statement timeout, carried
    // by the role's connections from their login: the transactions need not set them. And a
    // bound on a stalled host's open transaction.
    let synchronous_commit: String =
        sqlx::query_scalar("SELECT pg_catalog.current_setting('synchronous_commit')")
            .fetch_one(pool)
            .await?;
    let mut login = pg::wall::login_settings(&synchronous_commit, settings.statement_timeout);
    let idle = pg::wall::idle_in_transaction_timeout(c.handler_timeout.0);
    login.push((
        "idle_in_transaction_session_timeout",
        idle.as_millis().to_string(),
    ));
    let plugin_pool = pg::wall::role_pool(
        postgres,
        failover,
        &role,
        c.role_password.as_deref(),
        size,
        &login,
    )
    .await?;
    settings.keep_connections = size as usize;
    settings.settings_at_login = true;
    info!(consumer = %c.name, %role, connections = size, "plugin role ready");
    Ok(Claimer::with_plugin_pool(pool.clone(), plugin_pool, settings).following(failover))
}

/// Pooled connections the host never lets consumers keep between deliveries: the outbox relay's
/// listener and one for everything else (samplers, the relay's reads, operator queries).
const UNKEPT_CONNECTIONS: u32 = 2;

/// How many connections a consumer with `max_in_flight` keeps between deliveries (see
/// `pg::Connections`): all it can use at once when every consumer's fit in the pool beside
/// [`UNKEPT_CONNECTIONS`], else its share of what does fit, so kept connections can never take
/// the whole pool.
fn kept_connections(max_in_flight: u32, total_in_flight: u32, max_connections: u32) -> usize {
    let room = max_connections.saturating_sub(UNKEPT_CONNECTIONS);
    if total_in_flight <= room {
        max_in_flight as usize
    } else {
        (u64::from(max_in_flight) * u64::from(room) / u64::from(total_in_flight.max(1))) as usize
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn kept_connections_leave_room_in_the_pool() {
        assert_eq!(super::kept_connections(16, 16, 20), 16);
        assert_eq!(super::kept_connections(16, 16, 16), 14);
        // Six consumers of 16 in a pool of 8: 16 × 6 / 96 = 1 each, 6 of the 8 at most.
        assert_eq!(super::kept_connections(16, 96, 8), 1);
        assert_eq!(super::kept_connections(4, 96, 8), 0);
        assert_eq!(super::kept_connections(1, 1, 2), 0);
    }
}
