//! Several PostgreSQL servers behind one `postgres.url`, and following the primary among them.
//!
//! `postgres://user@h1:5432,h2:5432/db?target_session_attrs=read-write` names the servers in the
//! order libpq tries them. sqlx connects to one host only and knows no `target_session_attrs`,
//! so the host does what libpq would: at start it connects to the first server that accepts the
//! session the attribute asks for, and while it runs a watcher asks that server every
//! `postgres.failover_check_interval` whether it still does (one kept connection, one round
//! trip). When it does not — the primary is gone, or a promoted standby took over and the old
//! primary came back read-only — the watcher looks for the new one in the list's order and points
//! every pool of the host (its own and the plugins' role pools) at it: connections opened from
//! then on go there, and a pool hands out no connection opened before the move (it closes it):
//! an old primary that still takes writes — promoted over without fencing — gets no more claims
//! from the pools, nor from the connections a consumer keeps between deliveries (each is checked as it is
//! taken: one taken from its pool before the move is closed). Connections already open to a server that died fail and are discarded; a
//! transaction that fails on one is rolled back or lost with its server, never acked, and its
//! message is redelivered and decided by the marker on the new primary (docs/scaling.md says
//! what the replication settings must be for an acked commit to be on that primary).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool};
use sqlx::{ConnectOptions, PgConnection};

use super::redact_url;
use crate::config::PostgresConfig;
use crate::config::postgres_url::{Servers, SessionAttrs};

/// `options` pointed at server `i` of `servers` (everything else — user, database,
/// settings — kept).
fn retarget(servers: &Servers, options: PgConnectOptions, i: usize) -> PgConnectOptions {
    let (host, port) = servers.host(i);
    options.host(host).port(port)
}

/// Whether a session on `conn` is one `attrs` asks for.
async fn offers(conn: &mut PgConnection, attrs: SessionAttrs) -> Result<bool, sqlx::Error> {
    let (in_recovery, read_only): (bool, String) = sqlx::query_as(
        "SELECT pg_catalog.pg_is_in_recovery(), pg_catalog.current_setting('transaction_read_only')",
    )
    .fetch_one(conn)
    .await?;
    Ok(match attrs {
        SessionAttrs::Any => true,
        SessionAttrs::ReadWrite => !in_recovery && read_only == "off",
        SessionAttrs::Primary => !in_recovery,
    })
}

/// The pools that follow the primary, and which server that is.
pub struct Failover {
    servers: Servers,
    /// The session options of the host's own login (for the watcher's connection).
    options: PgConnectOptions,
    current: AtomicUsize,
    pools: Mutex<Vec<PgPool>>,
    /// When the watcher last moved the pools.
    switched_at: Mutex<Option<std::time::Instant>>,
    /// How long one server may take to answer (connect and query) before it counts as down.
    probe_timeout: Duration,
}

impl Failover {
    /// Finds the first server of `config.url` that offers the session it asks for, trying each
    /// in order.
    pub async fn find(config: &PostgresConfig) -> anyhow::Result<Arc<Failover>> {
        let servers = Servers::parse(&config.url)?;
        let options = super::connect_options(
            servers.url(0),
            config.schema.as_deref(),
            &config.application_name,
        )
        .map_err(|e| anyhow::anyhow!("invalid postgres.url {}: {e}", redact_url(&config.url)))?;
        let this = Failover {
            probe_timeout: config
                .acquire_timeout
                .0
                .clamp(Duration::from_millis(500), Duration::from_secs(10)),
            servers,
            options,
            current: AtomicUsize::new(0),
            pools: Mutex::new(Vec::new()),
            switched_at: Mutex::new(None),
        };
        if this.servers.watched() {
            let mut refusals = Vec::new();
            let found = this.search(&mut refusals).await;
            match found {
                Some((i, _)) => this.current.store(i, Ordering::Relaxed),
                None => anyhow::bail!(
                    "no server of postgres.url {} offers a {:?} session: {}",
                    redact_url(&config.url),
                    this.servers.attrs(),
                    refusals.join("; ")
                ),
            }
        }
        Ok(Arc::new(this))
    }

    /// The URL of the server in use now (one host).
    pub fn current_url(&self) -> &str {
        self.servers.url(self.current.load(Ordering::Relaxed))
    }

    /// The host's own login, pointed at the server in use now.
    pub fn options(&self) -> PgConnectOptions {
        retarget(
            &self.servers,
            self.options.clone(),
            self.current.load(Ordering::Relaxed),
        )
    }

    /// Whether a connection `age` old was opened before the last move (to the old server).
    pub fn opened_before_move(&self, age: Duration) -> bool {
        let at = *self.switched_at.lock().unwrap_or_else(|p| p.into_inner());
        at.is_some_and(|at| age > at.elapsed())
    }

    /// Whether the pools moved to another server after `at` (a connection taken from a pool
    /// before then may be to the old one: the pool's check at acquire did not see the move).
    pub fn moved_since(&self, at: std::time::Instant) -> bool {
        let moved = *self.switched_at.lock().unwrap_or_else(|p| p.into_inner());
        moved.is_some_and(|moved| moved > at)
    }

    /// Records a move to the server in use (the tests' stand-in for a promotion).
    #[cfg(feature = "test-support")]
    pub fn note_move(&self) {
        *self.switched_at.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(std::time::Instant::now());
    }

    /// Pool options that close, rather than hand out, a connection opened before the last move:
    /// one to an old primary that still takes writes (promoted over without fencing) must not
    /// go on taking claims. Each new connection must show the settings of `login` as given at
    /// its login (see [`super::check_login_settings`]).
    pub fn pool_options(
        self: &Arc<Self>,
        login: &[(&'static str, String)],
    ) -> sqlx::postgres::PgPoolOptions {
        let this = self.clone();
        let login: Arc<[(&'static str, String)]> = login.into();
        sqlx::postgres::PgPoolOptions::new()
            .after_connect(move |conn, _meta| {
                let login = login.clone();
                Box::pin(async move { super::check_login_settings(conn, &login).await })
            })
            .before_acquire(move |_conn, meta| {
                let stale = this.opened_before_move(meta.age);
                Box::pin(async move { Ok(!stale) })
            })
    }

    /// Makes `pool` follow the primary: when the watcher moves, its new connections go to the
    /// new server.
    pub fn follow(&self, pool: &PgPool) {
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        pools.retain(|p| !p.is_closed());
        // Under the lock a move cannot happen in between: the pool starts where the others are.
        let options = (*pool.connect_options()).clone();
        let current = self.current.load(Ordering::Relaxed);
        pool.set_connect_options(retarget(&self.servers, options, current));
        pools.push(pool.clone());
    }

    /// Closes every pool it follows (the host's own and the plugins' role pools) and waits
    /// until each has closed its connections: what a host that returns leaves open is nothing
    /// (an embedder may run hosts one after another in one process).
    pub async fn close_all(&self) {
        let pools = std::mem::take(&mut *self.pools.lock().unwrap_or_else(|p| p.into_inner()));
        futures::future::join_all(pools.iter().map(PgPool::close)).await;
    }

    /// A connection to server `i` that offers the session asked for, or why not.
    async fn probe(&self, i: usize) -> Result<PgConnection, String> {
        let options = retarget(&self.servers, self.options.clone(), i);
        let attempt = async {
            let mut conn = options.connect().await.map_err(|e| e.to_string())?;
            match offers(&mut conn, self.servers.attrs()).await {
                Ok(true) => Ok(conn),
                Ok(false) => Err(format!("not a {:?} session", self.servers.attrs())),
                Err(e) => Err(e.to_string()),
            }
        };
        tokio::time::timeout(self.probe_timeout, attempt)
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {:?}", self.probe_timeout)))
    }

    /// The first server, in the list's order, that offers the session asked for, with a
    /// connection to it; `refusals` gets why each one before it did not.
    async fn search(&self, refusals: &mut Vec<String>) -> Option<(usize, PgConnection)> {
        for i in 0..self.servers.len() {
            match self.probe(i).await {
                Ok(conn) => return Some((i, conn)),
                Err(why) => refusals.push(format!("{}: {why}", redact_url(self.servers.url(i)))),
            }
        }
        None
    }

    /// Points every followed pool at server `i`.
    fn switch_to(&self, i: usize) {
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let from = self.current.swap(i, Ordering::Relaxed);
        pools.retain(|p| !p.is_closed());
        for pool in pools.iter() {
            let options = (*pool.connect_options()).clone();
            pool.set_connect_options(retarget(&self.servers, options, i));
        }
        // Once every pool points at the new server: a connection asked for after this instant
        // is opened there (see `moved_since`).
        *self.switched_at.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(std::time::Instant::now());
        tracing::warn!(
            from = %redact_url(self.servers.url(from)),
            to = %redact_url(self.servers.url(i)),
            pools = pools.len(),
            "PostgreSQL: moved to another server (the one in use no longer offers a {:?} session)",
            self.servers.attrs()
        );
    }

    /// Watches the server in use every `every`, and moves the pools when it no longer offers
    /// the session asked for, until the returned [`Watcher`] is dropped. Nothing to watch (one
    /// server, any session): `None`.
    pub fn spawn_watch(self: &Arc<Self>, every: Duration) -> Option<Watcher> {
        if !self.servers.watched() {
            return None;
        }
        let this = self.clone();
        Some(Watcher(tokio::spawn(async move {
            let mut conn: Option<PgConnection> = None;
            let mut reported = false;
            loop {
                tokio::time::sleep(every).await;
                let current = this.current.load(Ordering::Relaxed);
                let healthy = match conn.as_mut() {
                    Some(c) => matches!(
                        tokio::time::timeout(this.probe_timeout, offers(c, this.servers.attrs()))
                            .await,
                        Ok(Ok(true))
                    ),
                    None => false,
                };
                if healthy {
                    continue;
                }
                conn = None;
                let mut refusals = Vec::new();
                match this.search(&mut refusals).await {
                    Some((i, c)) => {
                        if i != current {
                            this.switch_to(i);
                        }
                        conn = Some(c);
                        reported = false;
                    }
                    None if !reported => {
                        tracing::error!(
                            refusals = %refusals.join("; "),
                            "PostgreSQL: no server offers a {:?} session; deliveries fail and are \
                             redelivered until one does",
                            this.servers.attrs()
                        );
                        reported = true;
                    }
                    None => {}
                }
            }
        })))
    }
}

/// The watcher's task: stops when dropped.
pub struct Watcher(tokio::task::JoinHandle<()>);

impl Drop for Watcher {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(url: &str) -> PostgresConfig {
        toml::from_str(&format!("url = \"{url}\"")).unwrap()
    }

    /// Against the suite's PostgreSQL (`IDEMHOST_TEST_PG_URL`, else the machine's at
    /// 127.0.0.1:5432): a server that does not answer is passed over, and none answering is an
    /// error that names each.
    #[tokio::test]
    async fn the_first_server_that_answers_as_asked_is_used() {
        let suite = std::env::var("IDEMHOST_TEST_PG_URL")
            .unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into());
        let parsed = url::Url::parse(&suite).unwrap();
        let server = format!(
            "{}:{}",
            parsed.host_str().unwrap(),
            parsed.port().unwrap_or(5432)
        );
        let url = format!(
            "{}?target_session_attrs=read-write",
            suite.replacen(&format!("@{server}"), &format!("@127.0.0.1:1,{server}"), 1)
        );
        let failover = Failover::find(&config(&url)).await.unwrap();
        let current = url::Url::parse(failover.current_url()).unwrap();
        assert_eq!(
            (current.host_str(), current.port(), current.path()),
            (parsed.host_str(), parsed.port(), parsed.path()),
            "{}",
            failover.current_url()
        );
        let url = "postgres://root@127.0.0.1:1,127.0.0.1:2/test?target_session_attrs=primary";
        let err = Failover::find(&config(url))
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("127.0.0.1:1/test:") && err.contains("127.0.0.1:2/test:"),
            "{err}"
        );
    }
}
