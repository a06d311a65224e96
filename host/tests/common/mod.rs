//! Shared test environment: each test gets its own PostgreSQL schema (with the host's and the
//! example's migrations applied) and its own JetStream stream, so tests run in parallel against
//! the machine's real PostgreSQL (127.0.0.1:5432) and NATS (127.0.0.1:4222).
#![allow(dead_code)]

use std::future::Future;
use std::path::PathBuf;
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

/// A test setting read once from the environment, else its default: the server matrix
/// (`scripts/test.sh`) runs the core suites again against private newer servers by setting them.
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
/// PostgreSQL's programs for private instances (`IDEMHOST_TEST_PG_BIN`).
pub static PG_BIN: FromEnv = FromEnv::new("IDEMHOST_TEST_PG_BIN", "/usr/lib/postgresql/15/bin");
/// `nats-server` for private instances (`IDEMHOST_TEST_NATS_SERVER`).
pub static NATS_SERVER: FromEnv =
    FromEnv::new("IDEMHOST_TEST_NATS_SERVER", "/usr/sbin/nats-server");

/// A pool on `schema` of the PostgreSQL at `url`, with the host's and the example's migrations
/// applied.
pub async fn schema_pool(url: &str, schema: &str, max_connections: u32) -> PgPool {
    let options = idemhost::pg::connect_options(url, Some(schema), schema).unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .connect_with(options)
        .await
        .unwrap();
    idemhost::pg::migrate(&pool, Some(schema)).await.unwrap();
    sqlx::raw_sql(include_str!(
        "../../../examples/order-flow/migrations/0001_inventory.sql"
    ))
    .execute(&pool)
    .await
    .unwrap();
    pool
}

/// Waits (up to 10 s) until something accepts connections on 127.0.0.1:`port`.
fn wait_accepting(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs a host with `config` and returns why it refused to start (panics if it starts).
pub async fn start_error(config: Config) -> String {
    let run = Host::new(config).run(
        idemhost::host::RunOptions::default(),
        std::future::pending::<()>(),
    );
    match tokio::time::timeout(Duration::from_secs(60), run).await {
        Ok(Err(e)) => format!("{e:#}"),
        Ok(Ok(())) => panic!("the host ran"),
        Err(_) => panic!("the host started instead of refusing"),
    }
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
        let pool = schema_pool(&PG_URL, &schema, 12).await;
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
        idemhost::pg::wall::plugin_role(&config.postgres, &config.consumers[0])
    }

    /// A claimer whose deliveries run behind the plugin wall, as the host runs plugins: on
    /// connections logged in as `consumer`'s provisioned role, granted `tables` only.
    pub async fn plugin_claimer(&self, settings: ClaimSettings, tables: &[&str]) -> Claimer {
        let role = self.plugin_role(&settings.consumer_name);
        let tables: Vec<String> = tables.iter().map(|t| t.to_string()).collect();
        idemhost::pg::wall::provision_role(
            &self.pool,
            &settings.consumer_name,
            &role,
            &tables,
            None,
        )
        .await
        .unwrap();
        let options =
            idemhost::pg::wall::connect_as(&PG_URL, Some(&self.schema), &self.schema, &role, None)
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

/// Waits until the admin endpoint at `admin` (`host:port`) answers `/readyz` with 200: every
/// consumer bound, NATS and PostgreSQL reachable.
pub async fn wait_ready(admin: &str, timeout: Duration) {
    let readyz = format!("http://{admin}/readyz");
    wait_until(timeout, "/readyz to answer 200", || async {
        idemhost::admin::probe(&readyz, Duration::from_secs(5))
            .await
            .ok()
    })
    .await;
}

/// Path of a built guest plugin (`scripts/build-plugins.sh` builds them).
pub fn plugin_path(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../plugins/dist")
        .join(format!("{name}.wasm"));
    assert!(
        p.exists(),
        "{} is missing: run scripts/build-plugins.sh first",
        p.display()
    );
    p
}

/// The tests' plugin runtime, with a compile cache every test binary shares (under the target
/// directory), so a component is compiled once per build, not once per test process.
pub fn runtime() -> &'static PluginRuntime {
    static RT: std::sync::OnceLock<PluginRuntime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        let mut rt = PluginRuntime::new().unwrap();
        rt.set_compile_cache(Some(&test_compile_cache())).unwrap();
        rt
    })
}

pub fn test_compile_cache() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("compile-cache")
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

/// Publishes one message with a raw header block (`Name: value` lines, any bytes) over a bare
/// NATS protocol connection to `host_port`: what a foreign or broken client can send, which
/// async-nats cannot build. Returns once the server answered the following PING.
pub async fn publish_raw(host_port: &str, subject: &str, header_lines: &[u8], payload: &[u8]) {
    let block = [b"NATS/1.0\r\n", header_lines, b"\r\n"].concat();
    publish_raw_block(host_port, subject, &block, payload).await
}

/// [`publish_raw`] of a whole header block, its first line included (`NATS/1.0 …`).
pub async fn publish_raw_block(host_port: &str, subject: &str, block: &[u8], payload: &[u8]) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let socket = tokio::net::TcpStream::connect(host_port).await.unwrap();
    let mut conn = BufReader::new(socket);
    let mut line = String::new();
    conn.read_line(&mut line).await.unwrap();
    assert!(line.starts_with("INFO"), "{line}");
    let mut out =
        b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"protocol\":1}\r\n"
            .to_vec();
    out.extend(
        format!(
            "HPUB {subject} {} {}\r\n",
            block.len(),
            block.len() + payload.len()
        )
        .as_bytes(),
    );
    out.extend(block);
    out.extend(payload);
    out.extend(b"\r\nPING\r\n");
    conn.get_mut().write_all(&out).await.unwrap();
    loop {
        line.clear();
        assert!(
            conn.read_line(&mut line).await.unwrap() > 0,
            "connection closed"
        );
        assert!(!line.starts_with("-ERR"), "{line}");
        if line.starts_with("PONG") {
            break;
        }
    }
}

/// A private stream `<STREAM>` capturing `<prefix>.>`; the dead-letter subject is
/// `<prefix>.dlq` in the same stream.
pub struct NatsEnv {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub stream: String,
    pub prefix: String,
}

impl NatsEnv {
    pub async fn new(tag: &str, duplicate_window: Duration) -> NatsEnv {
        Self::at(&NATS_URL, tag, duplicate_window).await
    }

    pub async fn at(url: &str, tag: &str, duplicate_window: Duration) -> NatsEnv {
        let prefix = unique(tag);
        let stream = prefix.to_uppercase();
        let client = async_nats::connect(url)
            .await
            .expect("connect to test NATS");
        let js = jetstream::new(client.clone());
        js.create_stream(stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window,
            ..Default::default()
        })
        .await
        .unwrap();
        NatsEnv {
            client,
            js,
            stream,
            prefix,
        }
    }

    pub fn subject(&self) -> String {
        format!("{}.orders.placed", self.prefix)
    }

    pub fn dlq(&self) -> String {
        format!("{}.dlq", self.prefix)
    }

    /// Publishes with the given message id (none: no id header) and waits for the stream.
    pub async fn publish(&self, id: Option<&str>, payload: &str) -> jetstream::publish::PublishAck {
        let mut headers = async_nats::HeaderMap::new();
        if let Some(id) = id {
            headers.insert("Nats-Msg-Id", id);
        }
        headers.insert("Idemhost-Event-Type", "OrderPlaced");
        self.js
            .publish_with_headers(
                self.subject(),
                headers,
                payload.to_string().into_bytes().into(),
            )
            .await
            .unwrap()
            .await
            .unwrap()
    }

    /// Publishes (headers, payload) pairs to [`Self::subject`], pipelined: up to 512 awaiting
    /// the stream's ack at a time.
    pub async fn publish_many(
        &self,
        messages: impl IntoIterator<Item = (async_nats::HeaderMap, String)>,
    ) {
        let subject = self.subject();
        self.publish_many_to(messages.into_iter().map(|(h, p)| (subject.clone(), h, p)))
            .await
    }

    /// [`Self::publish_many`] of (subject, headers, payload).
    pub async fn publish_many_to(
        &self,
        messages: impl IntoIterator<Item = (String, async_nats::HeaderMap, String)>,
    ) {
        let mut acks = Vec::new();
        for (subject, headers, payload) in messages {
            let ack = self
                .js
                .publish_with_headers(subject, headers, payload.into_bytes().into())
                .await
                .unwrap();
            acks.push(ack);
            if acks.len() >= 512 {
                for a in acks.drain(..) {
                    a.await.unwrap();
                }
            }
        }
        for a in acks {
            a.await.unwrap();
        }
    }

    pub async fn consumer_info(&self, durable: &str) -> jetstream::consumer::Info {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        stream.consumer_info(durable).await.unwrap()
    }

    /// Waits until the durable consumer has nothing pending and nothing unacknowledged.
    pub async fn wait_drained(
        &self,
        durable: &str,
        timeout: Duration,
    ) -> jetstream::consumer::Info {
        wait_until(timeout, &format!("consumer {durable} to drain"), || async {
            let stream = self.js.get_stream(&self.stream).await.ok()?;
            let info = stream.consumer_info(durable).await.ok()?;
            (info.num_pending == 0
                && info.num_ack_pending == 0
                && info.delivered.consumer_sequence > 0)
                .then_some(info)
        })
        .await
    }

    /// Every message on the dead-letter subject, as (headers, payload).
    pub async fn dead_letters(&self) -> Vec<(async_nats::HeaderMap, Vec<u8>)> {
        self.stored(&self.dlq()).await
    }

    /// Every message the stream holds on `subject`, as (headers, payload), in stream order,
    /// read without consuming (an ephemeral consumer without acks).
    pub async fn stored(&self, subject: &str) -> Vec<(async_nats::HeaderMap, Vec<u8>)> {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let consumer = stream
            .create_consumer(pull::Config {
                filter_subject: subject.to_string(),
                ack_policy: jetstream::consumer::AckPolicy::None,
                ..Default::default()
            })
            .await
            .unwrap();
        let mut out = Vec::new();
        let mut batch = consumer
            .fetch()
            .max_messages(100_000)
            .expires(Duration::from_millis(500))
            .messages()
            .await
            .unwrap();
        while let Some(Ok(m)) = batch.next().await {
            out.push((
                m.message.headers.clone().unwrap_or_default(),
                m.message.payload.to_vec(),
            ));
        }
        out
    }

    pub async fn cleanup(self) {
        let _ = self.js.delete_stream(&self.stream).await;
    }
}

/// `idemhost run --config CONFIG` as a child process, its stderr in `log`, with the named
/// failpoint selected (the binary must be built with `failpoints` for it to fire).
pub fn spawn_host(
    config: &std::path::Path,
    failpoint: Option<&str>,
    log: &std::path::Path,
) -> std::process::Child {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idemhost"));
    cmd.arg("run")
        .arg("--config")
        .arg(config)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(log).unwrap());
    cmd.env("RUST_LOG", "info").env_remove("IDEMHOST_FAILPOINT");
    if let Some(fp) = failpoint {
        cmd.env("IDEMHOST_FAILPOINT", fp);
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
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl RunningHost {
    pub fn start(host: Host) -> RunningHost {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let run = host.run(idemhost::host::RunOptions::default(), async move {
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

/// A private `nats-server` with JetStream on a free port and its own store directory, for
/// tests that stop the server: the machine's shared NATS stays up. Killed when dropped.
pub struct PrivateNats {
    port: u16,
    dir: PathBuf,
    child: Option<std::process::Child>,
}

impl PrivateNats {
    pub fn start() -> PrivateNats {
        let port = free_port();
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique("nats-store"));
        let mut server = PrivateNats {
            port,
            dir,
            child: None,
        };
        server.restart();
        server
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the server on the same port and store, and waits until it accepts.
    pub fn restart(&mut self) {
        let child = std::process::Command::new(NATS_SERVER.get())
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        wait_accepting(self.port, "private nats-server");
    }

    /// Stops the server gracefully (SIGTERM: it flushes its store) and waits for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: a signal to our own child process.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = child.wait();
        }
    }

    /// Sends `signal` to the server (SIGSTOP / SIGCONT: a stalled server).
    pub fn signal(&self, signal: i32) {
        if let Some(child) = &self.child {
            // SAFETY: a signal to our own child process.
            unsafe { libc::kill(child.id() as i32, signal) };
        }
    }

    /// Kills the server (SIGKILL) and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A private PostgreSQL 15 cluster (`initdb` + `pg_ctl` from /usr/lib/postgresql/15/bin, run as
/// `nobody`, trust auth, superuser `idemhost`) on a free port in its own directory, for tests
/// that stop the server: the machine's shared PostgreSQL stays up. Stopped when dropped.
pub struct PrivatePostgres {
    port: u16,
    dir: PathBuf,
}

impl PrivatePostgres {
    pub fn start() -> PrivatePostgres {
        let port = free_port();
        let dir = std::env::temp_dir().join(unique("idemhost-pg"));
        std::fs::create_dir_all(&dir).unwrap();
        let pg = PrivatePostgres { port, dir };
        run("chown", &["nobody:nogroup", pg.path("")]);
        as_nobody(
            "initdb",
            &[
                "-D",
                pg.path("data"),
                "-A",
                "trust",
                "-U",
                "idemhost",
                "--no-sync",
            ],
        );
        pg.start_again();
        pg
    }

    /// A streaming standby of `primary` (`pg_basebackup -R`), started: read-only, in recovery.
    pub fn standby_of(primary: &PrivatePostgres) -> PrivatePostgres {
        let port = free_port();
        let dir = std::env::temp_dir().join(unique("idemhost-pg-standby"));
        std::fs::create_dir_all(&dir).unwrap();
        let pg = PrivatePostgres { port, dir };
        run("chown", &["nobody:nogroup", pg.path("")]);
        let source = primary.port.to_string();
        as_nobody(
            "pg_basebackup",
            &[
                "-D",
                pg.path("data"),
                "-h",
                "127.0.0.1",
                "-p",
                &source,
                "-U",
                "idemhost",
                "-R",
                "--no-sync",
            ],
        );
        pg.start_again();
        pg
    }

    fn path(&self, name: &str) -> &str {
        // Leaked once per call site and test: a few bytes, and it keeps the call sites plain.
        let p = self.dir.join(name);
        Box::leak(p.to_string_lossy().into_owned().into_boxed_str())
    }

    pub fn url(&self) -> String {
        format!("postgres://idemhost@127.0.0.1:{}/postgres", self.port)
    }

    /// `host:port` of this server, for a host list.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `pg_ctl promote`, waiting until the standby is a primary that accepts writes.
    pub fn promote(&self) {
        as_nobody("pg_ctl", &["-D", self.path("data"), "-w", "promote"]);
    }

    /// `pg_ctl start`, waiting until it accepts connections.
    pub fn start_again(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.path("")
        );
        as_nobody(
            "pg_ctl",
            &[
                "-D",
                self.path("data"),
                "-w",
                "-o",
                &options,
                "-l",
                self.path("log"),
                "start",
            ],
        );
    }

    /// `pg_ctl stop -m immediate`: the server dies without a checkpoint, connections drop.
    pub fn stop_immediate(&self) {
        as_nobody(
            "pg_ctl",
            &["-D", self.path("data"), "-w", "-m", "immediate", "stop"],
        );
    }

    /// Sends `signal` to the postmaster and every backend (SIGSTOP / SIGCONT: a stalled server
    /// that neither answers nor closes its connections).
    pub fn signal_all(&self, signal: i32) {
        let pid_file = std::fs::read_to_string(self.dir.join("data/postmaster.pid")).unwrap();
        let postmaster: i32 = pid_file.lines().next().unwrap().trim().parse().unwrap();
        let children = std::process::Command::new("pgrep")
            .args(["-P", &postmaster.to_string()])
            .output()
            .unwrap();
        let mut pids = vec![postmaster];
        pids.extend(
            String::from_utf8_lossy(&children.stdout)
                .lines()
                .filter_map(|l| l.trim().parse::<i32>().ok()),
        );
        for pid in pids {
            // SAFETY: kill(2) on processes of this test's own server.
            unsafe { libc::kill(pid, signal) };
        }
    }

    /// `pg_ctl stop -m fast`: open transactions are rolled back, sessions are closed.
    pub fn stop_fast(&self) {
        as_nobody(
            "pg_ctl",
            &["-D", self.path("data"), "-w", "-m", "fast", "stop"],
        );
    }
}

fn run(program: &str, args: &[&str]) {
    let out = std::process::Command::new(program)
        .args(args)
        .current_dir("/tmp")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{program} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs a PostgreSQL tool as `nobody` (initdb refuses root).
fn as_nobody(tool: &str, args: &[&str]) {
    let tool = format!("{PG_BIN}/{tool}");
    let mut all = vec!["-u", "nobody", "--", tool.as_str()];
    all.extend_from_slice(args);
    run("runuser", &all);
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = std::process::Command::new("runuser")
            .args(["-u", "nobody", "--", &format!("{PG_BIN}/pg_ctl"), "-D"])
            .arg(self.dir.join("data"))
            .args(["-m", "immediate", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A private JetStream cluster of `nats-server` nodes on loopback (routes between all of them,
/// a store directory each). Nodes are killed when dropped.
pub struct PrivateCluster {
    nodes: Vec<ClusterNode>,
}

struct ClusterNode {
    name: String,
    port: u16,
    route_port: u16,
    dir: PathBuf,
    child: Option<std::process::Child>,
}

impl PrivateCluster {
    /// Starts `n` nodes and waits until each accepts connections.
    pub fn start(n: usize) -> PrivateCluster {
        let tag = unique("cluster");
        let nodes = (0..n)
            .map(|i| ClusterNode {
                name: format!("n{i}"),
                port: free_port(),
                route_port: free_port(),
                dir: PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{tag}-n{i}")),
                child: None,
            })
            .collect();
        let mut cluster = PrivateCluster { nodes };
        for i in 0..n {
            cluster.start_node(i);
        }
        cluster
    }

    /// Every node's client URL, comma-separated (what `nats.url` takes).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// (Re)starts node `i` on its ports and store.
    pub fn start_node(&mut self, i: usize) {
        let routes = self
            .nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.route_port))
            .collect::<Vec<_>>()
            .join(",");
        let node = &mut self.nodes[i];
        let child = std::process::Command::new(NATS_SERVER.get())
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &node.port.to_string(),
                "-n",
                &node.name,
            ])
            .args(["-js", "--cluster_name", "idemhost-test"])
            .arg("-cluster")
            .arg(format!("nats://127.0.0.1:{}", node.route_port))
            .args(["-routes", &routes, "-sd"])
            .arg(&node.dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start nats-server");
        node.child = Some(child);
        wait_accepting(node.port, "cluster node");
    }

    /// The index of the node called `name` (as stream info names a leader).
    pub fn index_of(&self, name: &str) -> usize {
        self.nodes.iter().position(|n| n.name == name).unwrap()
    }

    /// SIGKILLs node `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `signal` to node `i` (SIGSTOP / SIGCONT: a stalled node).
    pub fn signal(&self, i: usize, signal: i32) {
        if let Some(child) = &self.nodes[i].child {
            // SAFETY: a signal to our own child process.
            unsafe { libc::kill(child.id() as i32, signal) };
        }
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.signal(i, libc::SIGCONT);
            self.kill(i);
            let _ = std::fs::remove_dir_all(&self.nodes[i].dir);
        }
    }
}

/// Versioned events of `keys` keys × `versions` versions, shuffled across keys but in order
/// within each key, with about a fifth of them delivered a second time after themselves or an
/// earlier version (under a fresh broker id, so the marker must decide), and about one in
/// twenty failing its first attempt retryably when `failing`. Each is (key, headers, testkit
/// script inserting `(key, version)` into `key_versions`); the headers carry the ids and
/// `Idemhost-Ordering-Key`. Returns them with the number of duplicates and failing ones.
pub fn versioned_events(
    keys: usize,
    versions: i64,
    seed: u64,
    failing: bool,
) -> (Vec<(String, async_nats::HeaderMap, String)>, usize, usize) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut next = vec![1i64; keys];
    let mut live: Vec<usize> = (0..keys).collect();
    let (mut duplicates, mut fails) = (0, 0);
    let mut out = Vec::new();
    while !live.is_empty() {
        let pick = rng.random_range(0..live.len());
        let k = live[pick];
        let key = format!("k-{k}");
        let version = next[k];
        next[k] += 1;
        if next[k] > versions {
            live.swap_remove(pick);
        }
        let fail_first = failing && rng.random_bool(0.05);
        fails += usize::from(fail_first);
        let id = format!("{key}-v{version}");
        let mut sends = vec![(id.clone(), None, fail_first)];
        if rng.random_bool(0.2) {
            // A second delivery of this key's message (this one or an earlier), after it.
            let earlier = rng.random_range(1..=version);
            sends.push((
                format!("{key}-v{earlier}"),
                Some(format!("dup-{}", out.len())),
                false,
            ));
            duplicates += 1;
        }
        for (msg_id, broker_id, fail) in sends {
            let v: i64 = msg_id.rsplit("-v").next().unwrap().parse().unwrap();
            let mut h = async_nats::HeaderMap::new();
            h.insert("Idemhost-Ordering-Key", key.as_str());
            match broker_id {
                Some(b) => {
                    h.insert("Nats-Msg-Id", b.as_str());
                    h.insert("Idemhost-Message-Id", msg_id.as_str());
                }
                None => h.insert("Nats-Msg-Id", msg_id.as_str()),
            }
            out.push((key.clone(), h, version_script(&key, v, fail)));
        }
    }
    (out, duplicates, fails)
}

/// The testkit script that inserts `(key, version)` into `key_versions`, failing its first
/// attempt retryably when `fail_first`.
pub fn version_script(key: &str, version: i64, fail_first: bool) -> String {
    let fail = if fail_first {
        r#"{"fail_before_attempt":2},"#
    } else {
        ""
    };
    format!(
        r#"{{"steps":[{fail}{{"execute":"INSERT INTO key_versions (key, version) VALUES ($1, $2)","params":["{key}",{version}]}}]}}"#
    )
}

/// Asserts that every key's `key_versions` rows, in insertion order, are exactly 1..=`versions`.
pub async fn assert_keys_in_order(env: &TestEnv, versions: i64) {
    let out_of_order: Vec<(String, Vec<i32>)> = sqlx::query_as(
        "SELECT key, array_agg(version ORDER BY id) FROM key_versions GROUP BY key \
         HAVING array_agg(version ORDER BY id) <> (SELECT array_agg(g) FROM generate_series(1, $1) g)",
    )
    .bind(versions as i32)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert!(
        out_of_order.is_empty(),
        "keys applied out of order: {:?}",
        &out_of_order[..out_of_order.len().min(3)]
    );
}
