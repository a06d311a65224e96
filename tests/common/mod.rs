//! Shared test environment: each test gets its own PostgreSQL schema (with the host's and the
//! example's migrations applied) and its own JetStream stream, so tests run in parallel against
//! real servers: the ones scripts/test-servers.sh starts (their URLs in `IDEMHOST_TEST_PG_URL` /
//! `IDEMHOST_TEST_NATS_URL`), else the machine's at 127.0.0.1:5432 and 127.0.0.1:4222.
#![allow(dead_code)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use futures::StreamExt;
use idemhost::{
    ClaimSettings, Claimer, Config, Host, Message, PluginLimits, PluginRuntime, WasmHandler,
};
use rand::Rng;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

mod events;
mod nats;
mod servers;
// Not every test binary uses every part.
#[allow(unused_imports)]
pub use events::*;
pub use nats::*;
#[allow(unused_imports)]
pub use servers::*;

/// A test setting read once from the environment, else its default: scripts/test-servers.sh
/// points the suite at its private servers, scripts/test-matrix.sh at the oldest supported.
pub struct FromEnv {
    var: &'static str,
    default: &'static str,
    value: std::sync::OnceLock<String>,
}

impl FromEnv {
    const fn new(var: &'static str, default: &'static str) -> FromEnv {
        FromEnv {
            var,
            default,
            value: std::sync::OnceLock::new(),
        }
    }

    pub fn get(&self) -> &str {
        self.value.get_or_init(|| {
            std::env::var(self.var)
                .ok()
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| self.default.to_string())
        })
    }
}

impl std::ops::Deref for FromEnv {
    type Target = str;
    fn deref(&self) -> &str {
        self.get()
    }
}

impl std::fmt::Display for FromEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.get())
    }
}

/// The shared PostgreSQL the tests use (`IDEMHOST_TEST_PG_URL`).
pub static PG_URL: FromEnv = FromEnv::new(
    "IDEMHOST_TEST_PG_URL",
    "postgres://root@127.0.0.1:5432/test",
);
/// The shared NATS with JetStream (`IDEMHOST_TEST_NATS_URL`).
pub static NATS_URL: FromEnv = FromEnv::new("IDEMHOST_TEST_NATS_URL", "nats://127.0.0.1:4222");
/// The shared PostgreSQL's URL logged in as `user` instead: as is for the URL's own user (its
/// password kept), else without a password (the roles tests create have none; a private server
/// trusts them over loopback, scripts/private-servers.sh).
pub fn pg_url_as(user: &str) -> String {
    let mut url = url::Url::parse(&PG_URL).expect("IDEMHOST_TEST_PG_URL is a URL");
    if url.username() != user {
        url.set_username(user).unwrap();
        url.set_password(None).unwrap();
    }
    url.to_string()
}
/// PostgreSQL's programs for private instances (`IDEMHOST_TEST_PG_BIN`).
pub static PG_BIN: FromEnv = FromEnv::new("IDEMHOST_TEST_PG_BIN", "/usr/lib/postgresql/15/bin");
/// `nats-server` for private instances (`IDEMHOST_TEST_NATS_SERVER`).
pub static NATS_SERVER: FromEnv =
    FromEnv::new("IDEMHOST_TEST_NATS_SERVER", "/usr/sbin/nats-server");

/// A pool on `schema` of the PostgreSQL at `url`, with the host's and the example's migrations
/// applied.
pub async fn schema_pool(url: &str, schema: &str, max_connections: u32) -> PgPool {
    let options = idemhost::test_support::pg::connect_options(url, Some(schema), schema).unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .connect_with(options)
        .await
        .unwrap();
    idemhost::migrate(&pool, Some(schema)).await.unwrap();
    sqlx::raw_sql(include_str!(
        "../../examples/order-flow/migrations/0001_inventory.sql"
    ))
    .execute(&pool)
    .await
    .unwrap();
    pool
}

/// Waits (up to 30 s) until `child` accepts connections on 127.0.0.1:`port`; if it exits
/// first, or the time runs out, panics with the end of its output (`log`).
fn wait_accepting(port: u16, what: &str, child: &mut std::process::Child, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let tail = || {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    };
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "{what} exited ({status}) before accepting on port {port}:\n{}",
                tail()
            );
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not accept on port {port} within 30 s:\n{}",
            tail()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Where a private server's output goes: `<dir>.log`, appended to across restarts.
fn server_log(dir: &Path) -> (PathBuf, std::fs::File) {
    let path = dir.with_extension("log");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .expect("open the server's log");
    (path, file)
}

/// Runs a host with `config` and returns why it refused to start (panics if it starts).
pub async fn start_error(config: Config) -> String {
    let run = Host::new(config).run(
        idemhost::RunOptions::default(),
        std::future::pending::<()>(),
    );
    match tokio::time::timeout(Duration::from_secs(60), run).await {
        Ok(Err(e)) => format!("{e:#}"),
        Ok(Ok(())) => panic!("the host ran"),
        Err(_) => panic!("the host started instead of refusing"),
    }
}

/// A new, empty schema `t_<tag>_<unique>`.
async fn new_schema(tag: &str) -> String {
    init_logs();
    let schema = format!("t_{}", unique(tag));
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&PG_URL)
        .await
        .expect("connect to test PostgreSQL");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
    schema
}

/// One bigint from `sql`, asked on a connection of its own (outside any test schema).
pub async fn server_scalar(sql: String) -> i64 {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&PG_URL)
        .await
        .expect("connect to test PostgreSQL");
    let value = sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let _ = sqlx::Connection::close(conn).await;
    value
}

pub fn unique(tag: &str) -> String {
    format!(
        "{}_{:08x}",
        tag.to_lowercase().replace('-', "_"),
        rand::rng().random::<u32>()
    )
}

/// A private schema with `processed_message` and the example's `inventory`.
pub struct TestEnv {
    pub schema: String,
    pub pool: PgPool,
}

impl TestEnv {
    pub async fn new(tag: &str) -> TestEnv {
        let schema = new_schema(tag).await;
        let pool = schema_pool(&PG_URL, &schema, 12).await;
        TestEnv { schema, pool }
    }

    /// A schema holding only the application's `inventory` (as the application's own
    /// migrations leave it before idemhost's first start): none of the host's migrations.
    pub async fn without_migrations(tag: &str) -> TestEnv {
        let schema = new_schema(tag).await;
        let options =
            idemhost::test_support::pg::connect_options(&PG_URL, Some(&schema), &schema).unwrap();
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .unwrap();
        sqlx::raw_sql(include_str!(
            "../../examples/order-flow/migrations/0001_inventory.sql"
        ))
        .execute(&pool)
        .await
        .unwrap();
        TestEnv { schema, pool }
    }

    pub async fn seed_inventory(&self, skus: &[(&str, i64)]) {
        for (sku, available) in skus {
            sqlx::query("INSERT INTO inventory (sku, available, reserved) VALUES ($1, $2, 0)")
                .bind(sku)
                .bind(available)
                .execute(&self.pool)
                .await
                .unwrap();
        }
    }

    /// Runs SQL without parameters (one or more statements) in this schema.
    pub async fn execute(&self, sql: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
            .execute(&self.pool)
            .await
            .unwrap();
    }

    pub async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar::<_, Option<i64>>(sqlx::AssertSqlSafe(sql.to_string()))
            .fetch_one(&self.pool)
            .await
            .unwrap()
            .unwrap_or(0)
    }

    /// The schema's host key: what signs a replay's id (see [`replayed`]).
    pub async fn host_key(&self) -> String {
        sqlx::query_scalar("SELECT key FROM idemhost_key")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn markers(&self, consumer: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM processed_message WHERE consumer_name = $1")
            .bind(consumer)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn reserved(&self, sku: &str) -> i64 {
        sqlx::query_scalar("SELECT reserved FROM inventory WHERE sku = $1")
            .bind(sku)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn available(&self, sku: &str) -> i64 {
        sqlx::query_scalar("SELECT available FROM inventory WHERE sku = $1")
            .bind(sku)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Pid of this test's session that waits on a lock while running a statement containing
    /// `prefix`, once there is one. (The claim is sent with the `BEGIN` of its transaction,
    /// so the whole text is searched, not only its start.)
    pub async fn wait_for_lock_wait(&self, prefix: &str) -> i32 {
        let like = format!("%{prefix}%");
        wait_until(
            Duration::from_secs(20),
            &format!("a session blocked in `{prefix}`"),
            || async {
                sqlx::query_scalar::<_, i32>(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = $1 \
                 AND wait_event_type = 'Lock' AND query LIKE $2",
                )
                .bind(&self.schema)
                .bind(&like)
                .fetch_optional(&self.pool)
                .await
                .unwrap()
            },
        )
        .await
    }

    /// The login role this schema's host derives for `consumer` (see `pg::wall::plugin_role`).
    pub fn plugin_role(&self, consumer: &str) -> String {
        let text = format!(
            "{}\n[[consumer]]\nname = \"{consumer}\"\nstream = \"S\"\nplugin = \"x.wasm\"\n",
            self.postgres_toml()
        );
        let config = parse_config(&text);
        idemhost::test_support::pg::wall::plugin_role(&config.postgres, &config.consumers[0])
    }

    /// A claimer whose deliveries run behind the plugin wall, as the host runs plugins: on
    /// connections logged in as `consumer`'s provisioned role, granted `tables` only.
    pub async fn plugin_claimer(&self, settings: ClaimSettings, tables: &[&str]) -> Claimer {
        let role = self.plugin_role(&settings.consumer_name);
        let tables: Vec<String> = tables.iter().map(|t| t.to_string()).collect();
        idemhost::test_support::pg::wall::provision_role(
            &self.pool,
            &settings.consumer_name,
            &role,
            &tables,
            None,
        )
        .await
        .unwrap();
        let options = idemhost::test_support::pg::wall::connect_as(
            &PG_URL,
            Some(&self.schema),
            &self.schema,
            &role,
            None,
        )
        .unwrap();
        let plugin_pool = PgPoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .unwrap();
        Claimer::with_plugin_pool(self.pool.clone(), plugin_pool, settings)
    }

    /// The `[postgres]` section pointing a host at this schema.
    pub fn postgres_toml(&self) -> String {
        format!(
            "[postgres]\nurl = \"{PG_URL}\"\nschema = \"{}\"\nmax_connections = 8\napplication_name = \"{}\"\n",
            self.schema, self.schema
        )
    }

    pub async fn cleanup(self) {
        self.pool.close().await;
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(&PG_URL)
            .await
            .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            self.schema
        )))
        .execute(&admin)
        .await
        .unwrap();
        // The plugin roles the hosts of this schema provisioned (best effort: a session of one
        // may still be closing).
        let roles: Vec<String> =
            sqlx::query_scalar("SELECT rolname::text FROM pg_roles WHERE starts_with(rolname, $1)")
                .bind(format!("idemhost_{}_", self.schema))
                .fetch_all(&admin)
                .await
                .unwrap_or_default();
        for role in roles {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP ROLE \"{role}\"")))
                .execute(&admin)
                .await;
        }
    }
}

/// Test logs go through the test harness's capture; `RUST_LOG=idemhost=debug` shows more.
pub fn init_logs() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// A TCP port on 127.0.0.1 that nothing listens on right now.
/// A `kB` field of `/proc/<pid>/status` (`"VmRSS:"`, `"VmHWM:"`), in KiB; `None` when the
/// process or the field is gone.
pub fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls `probe` until it yields a value; panics after `timeout` naming what it waited for.
pub async fn wait_until<T, F, Fut>(timeout: Duration, what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The admin endpoint's `/metrics` text (`admin` is `host:port`).
pub async fn scrape(admin: &str) -> String {
    idemhost::ops::admin::get(&format!("http://{admin}/metrics"), Duration::from_secs(5))
        .await
        .unwrap()
}

/// The value of the sample `name{labels}` in an OpenMetrics exposition (labels in order).
pub fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
    let key = if labels.is_empty() {
        name.to_string()
    } else {
        format!("{name}{{{labels}}}")
    };
    text.lines()
        .find_map(|l| l.strip_prefix(&key)?.strip_prefix(' ')?.parse().ok())
}

/// Waits until the admin endpoint at `admin` (`host:port`) answers `/readyz` with 200: every
/// consumer bound, NATS and PostgreSQL reachable.
pub async fn wait_ready(admin: &str, timeout: Duration) {
    let readyz = format!("http://{admin}/readyz");
    wait_until(timeout, "/readyz to answer 200", || async {
        idemhost::ops::admin::probe(&readyz, Duration::from_secs(5))
            .await
            .ok()
    })
    .await;
}

/// `command` without the compiler wrapper `scripts/test.sh` lints the workspace with (clippy's
/// driver, warnings as errors): a cargo build a test starts (the plugins' workspace, a plugin
/// project) is built as a user's would be, with the artifacts it shares.
pub fn without_lints(command: &mut std::process::Command) -> &mut std::process::Command {
    command
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("CLIPPY_ARGS")
}

/// Runs `command` to its end; panics with its output unless it succeeded.
pub fn run_ok(command: &mut std::process::Command) -> std::process::Output {
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{command:?}\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The repository's root (the scripts' working directory).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Path of a built guest plugin (`scripts/build-plugins.sh` builds them).
pub fn plugin_path(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("plugins/dist")
        .join(format!("{name}.wasm"));
    assert!(
        p.exists(),
        "{} is missing: run scripts/build-plugins.sh first",
        p.display()
    );
    p
}

/// The tests' plugin runtime, with the compile cache every test binary and every host the tests
/// start share (see [`test_compile_cache`]), so a component is compiled once, not once per test
/// process.
pub fn runtime() -> &'static PluginRuntime {
    static RT: std::sync::OnceLock<PluginRuntime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        let mut rt = PluginRuntime::new().unwrap();
        rt.set_compile_cache(Some(&test_compile_cache())).unwrap();
        rt
    })
}

/// The hosts' default compile cache (`~/.cache/idemhost/components`), which the hosts the tests
/// start, in this process or as the binary, use too: with a cache of the tests' own (under the
/// target directory), each of the suite's 13 components loaded both ways — the four JavaScript
/// and Python ones ~15 s of CPU each — was compiled twice in a clean run. Under the target
/// directory only where no home directory is known.
pub fn test_compile_cache() -> PathBuf {
    idemhost::config::default_compile_cache_dir()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("compile-cache"))
}

pub fn load_plugin(name: &str, timeout: Duration) -> Arc<WasmHandler> {
    let limits = PluginLimits {
        timeout,
        memory: 64 << 20,
    };
    Arc::new(runtime().load(&plugin_path(name), limits).unwrap())
}

/// Orders `evt-<i>` of one unit of sku-1, under their ids.
pub fn good_orders(
    range: std::ops::Range<usize>,
) -> impl Iterator<Item = (async_nats::HeaderMap, String)> {
    range.map(|i| {
        let id = format!("evt-{i}");
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", id.as_str());
        (h, order_payload(&id, "sku-1", 1))
    })
}

pub fn order_payload(id: &str, sku: &str, quantity: i64) -> String {
    format!(r#"{{"id":"{id}","orderId":"order-{id}","sku":"{sku}","quantity":{quantity}}}"#)
}

pub fn message(id: &str, payload: &str) -> Message {
    Message {
        id: id.to_string(),
        subject: "orders.placed".into(),
        event_type: Some("OrderPlaced".into()),
        headers: vec![("Nats-Msg-Id".into(), id.into())],
        payload: payload.as_bytes().to_vec().into(),
        delivery_attempt: 1,
    }
}

/// `idemhost run --config CONFIG` as a child process, its stderr in `log`, with the named
/// failpoint selected (the binary must be built with `failpoints` for it to fire).
pub fn spawn_host(
    config: &std::path::Path,
    failpoint: Option<&str>,
    log: &std::path::Path,
) -> std::process::Child {
    spawn_host_with(
        config,
        log,
        &[("IDEMHOST_FAILPOINT", failpoint.unwrap_or(""))],
    )
}

/// [`spawn_host`] with environment variables (`IDEMHOST_*` overrides; an empty value removes
/// the variable).
pub fn spawn_host_with(
    config: &std::path::Path,
    log: &std::path::Path,
    env: &[(&str, &str)],
) -> std::process::Child {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idemhost"));
    cmd.arg("run")
        .arg("--config")
        .arg(config)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(log).unwrap());
    cmd.env("RUST_LOG", "info").env_remove("IDEMHOST_FAILPOINT");
    for (k, v) in env {
        if v.is_empty() {
            cmd.env_remove(k);
        } else {
            cmd.env(k, v);
        }
    }
    cmd.spawn().unwrap()
}

/// Waits for a child process to exit.
pub async fn wait_exit(
    child: &mut std::process::Child,
    timeout: Duration,
) -> std::process::ExitStatus {
    wait_until(timeout, "the host process to exit", || {
        let status = child.try_wait().unwrap();
        async move { status }
    })
    .await
}

/// A host running in this process until `stop`.
pub struct RunningHost {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), idemhost::Error>>,
}

impl RunningHost {
    pub fn start(host: Host) -> RunningHost {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let run = host.run(idemhost::RunOptions::default(), async move {
            let _ = rx.await;
        });
        let task = tokio::spawn(async move {
            let result = run.await;
            if let Err(e) = &result {
                // Shown at once, not only when the test stops the host.
                eprintln!("host failed: {e:#}");
            }
            result
        });
        RunningHost {
            stop: Some(tx),
            task,
        }
    }

    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.task.await.unwrap().unwrap();
    }
}

/// A host configuration for one consumer of `nats`'s stream on `env`'s schema, with the given
/// extra consumer keys.
pub fn config(env: &TestEnv, nats: &NatsEnv, name: &str, plugin: &str, extra: &str) -> Config {
    parse_config(&config_text(env, nats, name, plugin, extra))
}

/// The TOML of [`config`]; top-level tables (`[admin]`, `[plugins]`) may be appended.
pub fn config_text(env: &TestEnv, nats: &NatsEnv, name: &str, plugin: &str, extra: &str) -> String {
    // The plugin's role is granted the schema's tables (those made before the host starts)
    // unless the test says otherwise.
    let tables = if extra.contains("tables =") {
        String::new()
    } else {
        "tables = [\"*\"]\n".to_string()
    };
    let publish = if extra.contains("publish_subjects =") {
        String::new()
    } else {
        "publish_subjects = [\">\"]\n".to_string()
    };
    let extra = format!("{tables}{publish}{extra}");
    format!(
        "[nats]\nurl = \"{NATS_URL}\"\n{}\n[host]\nshutdown_timeout = \"10s\"\n\n[[consumer]]\nname = \"{name}\"\nstream = \"{}\"\nsubjects = [\"{}\"]\nplugin = \"{}\"\ndead_letter_subject = \"{}\"\n{extra}\n",
        env.postgres_toml(),
        nats.stream,
        nats.subject(),
        plugin_path(plugin).display(),
        nats.dlq(),
    )
}

pub fn parse_config(text: &str) -> Config {
    Config::from_toml(text, std::iter::empty(), "test.toml".as_ref(), ".".as_ref()).unwrap()
}

/// Marks `h` as a replay of message `id`, as `idemhost dlq replay` publishes one: the id in
/// `Idemhost-Message-Id`, honoured because it is signed with the schema's host `key`
/// ([`TestEnv::host_key`]). The tests publish the same id again under a fresh broker id this
/// way; a producer's unsigned header is ignored.
pub fn replayed(h: &mut async_nats::HeaderMap, key: &str, id: &str) {
    use idemhost::headers::{REPLAY_ID_HEADER, REPLAY_SIGNATURE_HEADER, REPLAYED_FROM_HEADER};
    let from = format!("TEST/{}", h.get("Nats-Msg-Id").map_or("", |v| v.as_str()));
    h.insert(REPLAY_ID_HEADER, id);
    h.insert(REPLAYED_FROM_HEADER, from.as_str());
    let signature = idemhost::headers::replay_signature(key, id, &from);
    h.insert(REPLAY_SIGNATURE_HEADER, signature.as_str());
}

/// A schema with `sku-1` in stock, the testkit plugin and a claimer of consumer `testkit-v1`
/// behind the plugin wall (its role granted `inventory`).
pub async fn testkit_behind_the_wall(
    tag: &str,
) -> (TestEnv, Arc<idemhost::WasmHandler>, idemhost::Claimer) {
    let env = TestEnv::new(tag).await;
    env.seed_inventory(&[("sku-1", 1_000)]).await;
    let plugin = load_plugin("testkit", Duration::from_secs(5));
    let c = env
        .plugin_claimer(
            idemhost::ClaimSettings::new("testkit-v1", idemhost::Isolation::ReadCommitted),
            &["inventory"],
        )
        .await;
    (env, plugin, c)
}

/// One group of two deliveries on `c`: `leave` (a testkit script), then one that records as
/// `sku-1`'s `reserved` 64 plus the `bits` (SQL terms, one per kind of session state it still
/// sees); both must apply in the one transaction. What it recorded: 64 when nothing carried over.
pub async fn what_the_next_delivery_of_a_group_sees(
    env: &TestEnv,
    c: &idemhost::Claimer,
    plugin: &idemhost::WasmHandler,
    leave: &str,
    bits: &str,
) -> i64 {
    let sql = format!("UPDATE inventory SET reserved = 64 {bits} WHERE sku = 'sku-1'");
    let record = serde_json::json!({"steps": [{"execute": sql}]}).to_string();
    let results = c
        .process_batch(
            plugin,
            &[
                message("leaves-state", leave),
                message("records-state", &record),
            ],
        )
        .await;
    assert!(
        results
            .iter()
            .all(|p| p.outcome == idemhost::Outcome::Applied && p.tx_attempts == 1),
        "one group: {results:?}"
    );
    env.reserved("sku-1").await
}
