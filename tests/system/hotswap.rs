//! Hot swap: a consumer's plugin replaced while the host consumes — through the admin API, a
//! replaced plugin file, and the shared NATS store two host processes follow — with every
//! message applied exactly once by exactly one version (proved by SQL: the plugin writes its
//! version into its effect, the host writes the digest into `processed_message_handler`).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use idemhost::ops::admin::{self as http, Response};
use sha2::{Digest, Sha256};

const CONSUMER: &str = "swap-v1";
const TOKEN: &str = "swap-test-token-3f9c1a";

fn digest_of(path: &Path) -> String {
    format!("sha256:{:x}", Sha256::digest(std::fs::read(path).unwrap()))
}

/// A schema with the versioned plugin's effect table, and a stream.
async fn setup(tag: &str) -> (TestEnv, NatsEnv) {
    let env = TestEnv::new(tag).await;
    sqlx::query(
        "CREATE TABLE swap_effect (message_id text PRIMARY KEY, handled_by text NOT NULL, attempt int NOT NULL)",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    let nats = NatsEnv::new(tag, Duration::from_secs(120)).await;
    (env, nats)
}

fn id(i: usize) -> String {
    format!("m-{i:06}")
}

/// Publishes messages `range` (ids `m-000000`...), pipelining up to 256 unacknowledged.
async fn publish_range(nats: &NatsEnv, range: std::ops::Range<usize>) {
    let mut pending = Vec::new();
    for i in range {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id(i).as_str());
        pending.push(
            nats.js
                .publish_with_headers(nats.subject(), headers, "{}".into())
                .await
                .unwrap(),
        );
        if pending.len() == 256 {
            for ack in pending.drain(..) {
                ack.await.unwrap();
            }
        }
    }
    for ack in pending {
        ack.await.unwrap();
    }
}

async fn effects(env: &TestEnv, version: &str) -> i64 {
    env.scalar(&format!(
        "SELECT count(*) FROM swap_effect WHERE handled_by = '{version}'"
    ))
    .await
}

async fn wait_effects(env: &TestEnv, n: i64) {
    wait_until(
        Duration::from_secs(120),
        &format!("{n} effects"),
        || async { (env.scalar("SELECT count(*) FROM swap_effect").await >= n).then_some(()) },
    )
    .await;
}

/// Exactly-once, by SQL: one marker, one effect and one digest row per message, each effect's
/// version matching the digest the host recorded, and no message delivered twice.
async fn assert_exactly_once(env: &TestEnv, n: i64, digest_a: &str, digest_b: &str) {
    assert_eq!(env.markers(CONSUMER).await, n, "markers");
    assert_eq!(
        env.scalar("SELECT count(*) FROM swap_effect").await,
        n,
        "effects"
    );
    let recorded = env
        .scalar("SELECT count(*) FROM processed_message_handler h JOIN swap_effect e USING (message_id)")
        .await;
    assert_eq!(recorded, n, "a digest row per effect");
    let mismatched = env
        .scalar(&format!(
            "SELECT count(*) FROM processed_message_handler h JOIN swap_effect e USING (message_id) \
             WHERE (e.handled_by = 'a') <> (h.plugin_digest = '{digest_a}') \
                OR (e.handled_by = 'b') <> (h.plugin_digest = '{digest_b}')"
        ))
        .await;
    assert_eq!(
        mismatched, 0,
        "effects whose version differs from the recorded digest"
    );
    let redelivered = env
        .scalar("SELECT count(*) FROM swap_effect WHERE attempt > 1")
        .await;
    assert_eq!(redelivered, 0, "redeliveries");
}

async fn admin(method: &str, url: &str, token: Option<&str>, body: &[u8]) -> Response {
    let auth = format!("Bearer {}", token.unwrap_or(""));
    let headers: Vec<(&str, &str)> = match token {
        Some(_) => vec![("Authorization", auth.as_str())],
        None => vec![],
    };
    http::request(method, url, &headers, body, Duration::from_secs(60))
        .await
        .unwrap()
}

async fn current_digest(base: &str) -> String {
    report(base).await["consumers"][0]["current"]["digest"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn report(base: &str) -> serde_json::Value {
    try_report(base).await.expect("GET /plugins")
}

/// `GET /plugins`, parsed; `None` while the host does not answer.
async fn try_report(base: &str) -> Option<serde_json::Value> {
    let body = http::get(&format!("{base}/plugins"), Duration::from_secs(5))
        .await
        .ok()?;
    serde_json::from_str(&body).ok()
}

fn admin_top(port: u16, token: Option<&str>) -> String {
    let token = token
        .map(|t| format!("token = \"{t}\"\n"))
        .unwrap_or_default();
    format!("\n[admin]\nlisten = \"127.0.0.1:{port}\"\n{token}")
}

/// A host running in this process, its admin endpoint on a free port, loaded and listing.
struct InProcess {
    env: TestEnv,
    nats: NatsEnv,
    host: RunningHost,
    base: String,
}

impl InProcess {
    /// Starts a host on the config `text(env, nats, admin port)` builds.
    async fn start(tag: &str, text: impl FnOnce(&TestEnv, &NatsEnv, u16) -> String) -> Self {
        let (env, nats) = setup(tag).await;
        let port = free_port();
        let config = parse_config(&text(&env, &nats, port));
        let host = RunningHost::start(idemhost::Host::new(config));
        let base = format!("http://127.0.0.1:{port}");
        wait_until(Duration::from_secs(60), "the host to load", || async {
            http::get(&format!("{base}/plugins"), Duration::from_secs(5))
                .await
                .ok()
        })
        .await;
        InProcess {
            env,
            nats,
            host,
            base,
        }
    }

    async fn finish(self) {
        self.host.stop().await;
        self.nats.cleanup().await;
        self.env.cleanup().await;
    }
}

/// 10,000 messages at max_in_flight 16, a swap from A to B in the middle: each message once,
/// on exactly one version, A's messages before B's (up to one window of pulled messages), no
/// redelivery. Prints the swap latency.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swap_under_load_applies_every_message_once_on_one_version() {
    const N: usize = 10_000;
    // No compile cache: the swap's validation includes compiling B.
    let swap = InProcess::start("swap_load", |env, nats, port| {
        config_text(env, nats, CONSUMER, "versioned-a", "max_in_flight = 16")
            .replace("max_connections = 8", "max_connections = 16")
            .replace(
                "shutdown_timeout = \"10s\"",
                "shutdown_timeout = \"10s\"\ncompile_cache = \"off\"",
            )
            + &admin_top(port, Some(TOKEN))
    })
    .await;
    let (env, nats, base) = (&swap.env, &swap.nats, swap.base.clone());
    let (digest_a, digest_b) = (
        digest_of(&plugin_path("versioned-a")),
        digest_of(&plugin_path("versioned-b")),
    );
    publish_range(nats, 0..N).await;

    wait_effects(env, 4_000).await;
    let component_b = std::fs::read(plugin_path("versioned-b")).unwrap();
    let asked = Instant::now();
    let r = admin(
        "POST",
        &format!("{base}/plugins?consumer={CONSUMER}"),
        Some(TOKEN),
        &component_b,
    )
    .await;
    let deploy_call = asked.elapsed();
    assert_eq!(r.status, 200, "{}", r.body);
    wait_effects(env, N as i64).await;
    nats.wait_drained(CONSUMER, Duration::from_secs(30)).await;

    assert_exactly_once(env, N as i64, &digest_a, &digest_b).await;
    let (a, b) = (effects(env, "a").await, effects(env, "b").await);
    assert!(a >= 4_000 && b > 0, "a {a}, b {b}");
    // Publish order: A's messages, then B's, overlapping by at most one window of deliveries
    // pulled before the swap and started after it: the pull credits, 2 × max_in_flight
    // deliveries or, in groups (the default here), 2 × max_in_flight groups of `batch_max`.
    // Groups running side by side take their version in the order they start, not in the
    // order of their ids, so a later group can still run on A.
    let window = 2 * 16 * i64::from(idemhost::config::DEFAULT_BATCH_MAX);
    let late_a = env
        .scalar(
            "SELECT count(*) FROM swap_effect WHERE handled_by = 'a' AND message_id > \
             (SELECT min(message_id) FROM swap_effect WHERE handled_by = 'b')",
        )
        .await;
    assert!(
        late_a <= window,
        "{late_a} messages ran on A after B's first one (window {window})"
    );

    let report = report(&base).await;
    let consumer = &report["consumers"][0];
    assert_eq!(consumer["current"]["digest"], digest_b.as_str());
    assert_eq!(consumer["previous"], digest_a.as_str());
    let latency = consumer["current"]["swap_latency_ms"].as_f64().unwrap();
    let validation = consumer["current"]["validation_ms"].as_f64().unwrap();

    // The throughput around a swap is measured by the release benchmark
    // (bench/examples/swap.rs, scripts/bench-swap.sh); here only the swap's own timings.
    println!(
        "SWAP under load: deploy call {:.1} ms (validation {validation:.1} ms), swap latency \
         {latency:.1} ms (request -> first delivery on B); A applied {a}, B {b}",
        deploy_call.as_secs_f64() * 1e3,
    );
    swap.finish().await;
}

/// Components the host must refuse — not a component, the wrong world, a trap while
/// instantiating — are refused with the reason, and A keeps serving. Deploys need the token;
/// an unknown consumer name is refused as a replay, not a swap; rollback toggles A and B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_components_are_refused_and_rollback_restores_the_previous_digest() {
    let swap = InProcess::start("swap_refuse", |env, nats, port| {
        config_text(env, nats, CONSUMER, "versioned-a", "") + &admin_top(port, Some(TOKEN))
    })
    .await;
    let (env, nats, base) = (&swap.env, &swap.nats, swap.base.clone());
    let deploy = format!("{base}/plugins?consumer={CONSUMER}");
    let digest_a = digest_of(&plugin_path("versioned-a"));
    let digest_b = digest_of(&plugin_path("versioned-b"));

    let b = std::fs::read(plugin_path("versioned-b")).unwrap();
    let r = admin("POST", &deploy, None, &b).await;
    assert_eq!(r.status, 401, "{}", r.body);
    let r = admin("POST", &deploy, Some("wrong-token"), &b).await;
    assert_eq!(r.status, 401, "{}", r.body);

    let refusals: [(&str, Vec<u8>, &str); 3] = [
        (
            "not a component",
            b"\0asm garbage".to_vec(),
            "is not a valid WebAssembly component",
        ),
        (
            "wrong world",
            wat::parse_str("(component)").unwrap(),
            "does not export `idemhost:consumer/handling",
        ),
        (
            "trap at start",
            std::fs::read(plugin_path("versioned-trap")).unwrap(),
            "cannot be instantiated",
        ),
    ];
    let mut sent = 0;
    for (what, bytes, reason) in refusals {
        let r = admin("POST", &deploy, Some(TOKEN), &bytes).await;
        assert_eq!(r.status, 422, "{what}: {}", r.body);
        assert!(r.body.contains(reason), "{what}: {}", r.body);
        assert!(
            r.body.contains("the current version keeps serving"),
            "{}",
            r.body
        );
        assert_eq!(current_digest(&base).await, digest_a, "{what}");
        nats.publish(Some(&id(sent)), "{}").await;
        sent += 1;
        wait_effects(env, sent as i64).await;
    }
    assert_eq!(effects(env, "a").await, 3, "A served between the refusals");
    let refusal = &report(&base).await["consumers"][0]["last_refusal"]["reason"];
    assert!(
        refusal.as_str().unwrap().contains("cannot be instantiated"),
        "{refusal}"
    );

    // The CLI says why the host refused, and exits non-zero.
    let (ok, out) = cli_deploy(&base, "versioned-trap");
    assert!(
        !ok && out.contains("422") && out.contains("unreachable"),
        "{out}"
    );

    let r = admin(
        "POST",
        &format!("{base}/plugins?consumer=swap-v2"),
        Some(TOKEN),
        &b,
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(r.body.contains("replay"), "{}", r.body);

    // A -> B, then rollback twice: B -> A -> B. Each version serves the next message.
    for (step, expect, version) in [
        ("deploy", &digest_b, "b"),
        ("rollback", &digest_a, "a"),
        ("rollback", &digest_b, "b"),
    ] {
        let r = match step {
            "deploy" => {
                let (ok, out) = cli_deploy(&base, "versioned-b");
                assert!(
                    ok && out.contains(&format!("{digest_a} -> {digest_b}")),
                    "{out}"
                );
                admin("GET", &format!("{base}/plugins"), None, &[]).await
            }
            _ => {
                admin(
                    "POST",
                    &format!("{base}/plugins/rollback?consumer={CONSUMER}"),
                    Some(TOKEN),
                    &[],
                )
                .await
            }
        };
        assert_eq!(r.status, 200, "{step}: {}", r.body);
        assert_eq!(&current_digest(&base).await, expect, "{step}");
        nats.publish(Some(&id(sent)), "{}").await;
        sent += 1;
        wait_effects(env, sent as i64).await;
        let handled: String =
            sqlx::query_scalar("SELECT handled_by FROM swap_effect WHERE message_id = $1")
                .bind(id(sent - 1))
                .fetch_one(&env.pool)
                .await
                .unwrap();
        assert_eq!(handled, version, "after {step}");
    }
    let r = admin("POST", &deploy, Some(TOKEN), &b).await;
    assert!(
        r.body.contains("\"changed\":false"),
        "same digest again: {}",
        r.body
    );
    assert_eq!(
        report(&base).await["consumers"][0]["history"][1]["source"],
        "rollback"
    );
    let (ok, listed) = cli_run(&["list", "--url", &base]);
    assert!(
        ok && listed.contains(&format!("current {digest_b}  rollback")),
        "{listed}"
    );
    nats.wait_drained(CONSUMER, Duration::from_secs(30)).await;
    assert_exactly_once(env, sent as i64, &digest_a, &digest_b).await;
    swap.finish().await;
}

/// Without `admin.token`, deploys are disabled (and listing still works).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploys_are_disabled_without_a_token() {
    let swap = InProcess::start("swap_notoken", |env, nats, port| {
        config_text(env, nats, CONSUMER, "versioned-a", "") + &admin_top(port, None)
    })
    .await;
    let base = swap.base.clone();
    let listed = report(&base).await;
    assert_eq!(listed["consumers"][0]["name"], CONSUMER);
    let b = std::fs::read(plugin_path("versioned-b")).unwrap();
    let r = admin(
        "POST",
        &format!("{base}/plugins?consumer={CONSUMER}"),
        Some("anything"),
        &b,
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.body);
    assert!(r.body.contains("disabled"), "{}", r.body);
    swap.finish().await;
}

/// Replacing the configured plugin file by an atomic rename swaps the plugin; a broken file
/// is refused and the running version keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacing_the_plugin_file_swaps_the_plugin() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique("swap_file"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("handler.wasm");
    std::fs::copy(plugin_path("versioned-a"), &file).unwrap();
    let swap = InProcess::start("swap_file", |env, nats, port| {
        config_text(env, nats, CONSUMER, "versioned-a", "").replace(
            &plugin_path("versioned-a").display().to_string(),
            &file.display().to_string(),
        ) + &admin_top(port, None)
            + "\n[plugins]\nwatch_interval = \"50ms\"\n"
    })
    .await;
    let (env, nats, base) = (&swap.env, &swap.nats, swap.base.clone());
    nats.publish(Some(&id(0)), "{}").await;
    wait_effects(env, 1).await;

    let replace = |from: &dyn Fn(&Path), tag: &str| {
        let tmp = dir.join(format!("{tag}.tmp"));
        from(&tmp);
        std::fs::rename(&tmp, &file).unwrap();
    };
    replace(
        &|p| std::fs::write(p, b"not wasm at all").unwrap(),
        "broken",
    );
    wait_until(
        Duration::from_secs(10),
        "the broken file to be refused",
        || async {
            let r = report(&base).await;
            r["consumers"][0]["last_refusal"]["source"]
                .as_str()
                .map(str::to_string)
        },
    )
    .await;
    let digest_a = digest_of(&plugin_path("versioned-a"));
    assert_eq!(current_digest(&base).await, digest_a);

    replace(
        &|p| {
            std::fs::copy(plugin_path("versioned-b"), p).unwrap();
        },
        "b",
    );
    let digest_b = digest_of(&plugin_path("versioned-b"));
    wait_until(Duration::from_secs(10), "the swap to B", || async {
        (current_digest(&base).await == digest_b).then_some(())
    })
    .await;
    nats.publish(Some(&id(1)), "{}").await;
    wait_effects(env, 2).await;
    assert_eq!(effects(env, "b").await, 1);
    let source = &report(&base).await["consumers"][0]["current"]["source"];
    assert!(source.as_str().unwrap().starts_with("file:"), "{source}");
    assert_exactly_once(env, 2, &digest_a, &digest_b).await;
    swap.finish().await;
}

struct HostProcess {
    child: Child,
    base: String,
}

impl Drop for HostProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_host(config: &Path, dir: &Path, n: usize) -> HostProcess {
    let port = free_port();
    let log = std::fs::File::create(dir.join(format!("host{n}.log"))).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_idemhost"))
        .args(["run", "--config"])
        .arg(config)
        .env("IDEMHOST_ADMIN__LISTEN", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    HostProcess {
        child,
        base: format!("http://127.0.0.1:{port}"),
    }
}

/// `idemhost plugin ARGS...`: whether it exited 0, and its stdout and stderr.
fn cli_run(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idemhost"))
        .arg("plugin")
        .args(args)
        .env_remove("IDEMHOST_ADMIN__TOKEN")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `idemhost plugin deploy` of a component from plugins/dist to the host at `base`.
fn cli_deploy(base: &str, component: &str) -> (bool, String) {
    let path = plugin_path(component);
    let path = path.to_str().unwrap();
    cli_run(&[
        "deploy",
        "--url",
        base,
        "--token",
        TOKEN,
        "--consumer",
        CONSUMER,
        path,
    ])
}

/// `idemhost plugin ARGS... --config CONFIG`, which must succeed; its output.
fn cli(args: &[&str], config: &Path) -> String {
    let config = config.to_str().unwrap();
    let (ok, text) = cli_run(&[args, &["--config", config]].concat());
    assert!(ok, "idemhost plugin {args:?}: {text}");
    text
}

/// Waits until every host runs `digest`; returns how long that took.
async fn converge(hosts: &[HostProcess], digest: &str) -> Duration {
    let started = Instant::now();
    for h in hosts {
        wait_until(
            Duration::from_secs(30),
            "a host to follow the store",
            || async {
                let report = try_report(&h.base).await?;
                (report["consumers"][0]["current"]["digest"] == digest).then_some(())
            },
        )
        .await;
    }
    started.elapsed()
}

/// Two host processes share one durable consumer and follow the NATS plugin store: `plugin
/// deploy --store nats` moves both to B while messages flow, `plugin rollback --store nats`
/// moves both back; every message is applied once, and what was published after both hosts
/// switched ran on the new version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_follow_the_nats_store() {
    let (env, nats) = setup("swap_fleet").await;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique("swap_fleet"));
    std::fs::create_dir_all(&dir).unwrap();
    let bucket = unique("swapfleet");
    let text = config_text(&env, &nats, CONSUMER, "versioned-a", "max_in_flight = 4")
        + &format!(
            "\n[admin]\ntoken = \"{TOKEN}\"\n\n[plugins]\nstore = \"nats\"\nobject_bucket = \"{bucket}_obj\"\nversion_bucket = \"{bucket}_ver\"\n"
        );
    let config = dir.join("idemhost.toml");
    std::fs::write(&config, text).unwrap();
    let hosts = [spawn_host(&config, &dir, 1), spawn_host(&config, &dir, 2)];
    let digest_a = digest_of(&plugin_path("versioned-a"));
    let digest_b = digest_of(&plugin_path("versioned-b"));
    converge(&hosts, &digest_a).await;

    // Phase 1: messages flow while B is deployed to the store.
    let flowing = {
        let js = nats.js.clone();
        let subject = nats.subject();
        tokio::spawn(async move {
            for i in 0..1_000 {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", id(i).as_str());
                js.publish_with_headers(subject.clone(), headers, "{}".into())
                    .await
                    .unwrap()
                    .await
                    .unwrap();
                if i % 50 == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        })
    };
    wait_effects(&env, 200).await;
    let out = cli(
        &[
            "deploy",
            "--store",
            "nats",
            "--consumer",
            CONSUMER,
            plugin_path("versioned-b").to_str().unwrap(),
        ],
        &config,
    );
    assert!(out.contains(&digest_b), "{out}");
    let took = converge(&hosts, &digest_b).await;
    flowing.await.unwrap();
    // Phase 2: published after both hosts switched, so all on B.
    publish_range(&nats, 1_000..1_500).await;
    wait_effects(&env, 1_500).await;
    let late_a = env
        .scalar(
            "SELECT count(*) FROM swap_effect WHERE handled_by = 'a' AND message_id >= 'm-001000'",
        )
        .await;
    assert_eq!(
        late_a, 0,
        "messages published after the fleet switched ran on A"
    );

    let out = cli(
        &["rollback", "--store", "nats", "--consumer", CONSUMER],
        &config,
    );
    assert!(out.contains(&digest_a), "{out}");
    let took_back = converge(&hosts, &digest_a).await;
    publish_range(&nats, 1_500..2_000).await;
    wait_effects(&env, 2_000).await;
    let late_b = env
        .scalar(
            "SELECT count(*) FROM swap_effect WHERE handled_by = 'b' AND message_id >= 'm-001500'",
        )
        .await;
    assert_eq!(late_b, 0, "messages published after the rollback ran on B");
    let listed = cli(
        &["list", "--store", "nats", "--consumer", CONSUMER],
        &config,
    );
    assert!(listed.contains("rollback"), "{listed}");
    nats.wait_drained(CONSUMER, Duration::from_secs(30)).await;
    assert_exactly_once(&env, 2_000, &digest_a, &digest_b).await;
    for h in &hosts {
        let r = report(&h.base).await;
        let served: u64 = r["consumers"][0]["history"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["deliveries"].as_u64().unwrap())
            .sum();
        assert!(served > 0, "host {} served nothing", h.base);
    }
    println!(
        "SWAP fleet: two hosts converged on B {:.0} ms and back on A {:.0} ms after the CLI returned",
        took.as_secs_f64() * 1e3,
        took_back.as_secs_f64() * 1e3
    );
    drop(hosts);
    let js = nats.js.clone();
    let _ = js.delete_key_value(format!("{bucket}_ver")).await;
    let _ = js.delete_object_store(format!("{bucket}_obj")).await;
    nats.cleanup().await;
    env.cleanup().await;
}

/// One consumer's swap never holds up another's: while consumer A's new component cannot be
/// loaded yet (another loader holds its compile-cache lock, as a long compile would), consumer
/// B's file change is swapped in. Before, the file watcher deployed one change after another,
/// so B waited for A's whole load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_consumers_slow_swap_does_not_hold_up_anothers() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique("swap_two"));
    let cache = dir.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o700)).unwrap();
    let (file_a, file_b) = (dir.join("a.wasm"), dir.join("b.wasm"));
    std::fs::copy(plugin_path("versioned-a"), &file_a).unwrap();
    std::fs::copy(plugin_path("versioned-a"), &file_b).unwrap();
    let other = NatsEnv::new("swap_two_b", Duration::from_secs(60)).await;
    let swap = InProcess::start("swap_two", |env, nats, port| {
        config_text(env, nats, CONSUMER, "versioned-a", "")
            .replace(
                &plugin_path("versioned-a").display().to_string(),
                &file_a.display().to_string(),
            )
            .replace(
                "[host]\n",
                &format!("[host]\ncompile_cache = \"{}\"\n", cache.display()),
            )
            + &format!(
                "\n[[consumer]]\nname = \"other-v1\"\nstream = \"{}\"\nsubjects = [\"{}\"]\n\
             plugin = \"{}\"\ndead_letter_subject = \"{}\"\ntables = [\"*\"]\n",
                other.stream,
                other.subject(),
                file_b.display(),
                other.dlq(),
            )
            + &admin_top(port, None)
            + "\n[plugins]\nwatch_interval = \"50ms\"\n"
    })
    .await;
    let base = swap.base.clone();
    let consumer = |r: &serde_json::Value, name: &str| -> serde_json::Value {
        r["consumers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no consumer {name} in {r}"))
    };
    // The cache's engine key, from the artifact of the version loaded at start.
    let hex_a = digest_of(&plugin_path("versioned-a"))
        .trim_start_matches("sha256:")
        .to_string();
    let artifact = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with(&hex_a) && n.ends_with(".cwasm"))
        .expect("the loaded version's artifact");
    let engine_key = artifact
        .trim_start_matches(&format!("{hex_a}-"))
        .trim_end_matches(".cwasm")
        .to_string();
    // A's next version: its compile lock held, as by a loader compiling it for minutes.
    let next_a = plugin_path("testkit");
    let hex_next = digest_of(&next_a).trim_start_matches("sha256:").to_string();
    let lock = std::fs::File::create(cache.join(format!(".{hex_next}-{engine_key}.lock"))).unwrap();
    lock.lock().unwrap();

    let replace = |file: &Path, from: &Path, tag: &str| {
        let tmp = dir.join(format!("{tag}.tmp"));
        std::fs::copy(from, &tmp).unwrap();
        std::fs::rename(&tmp, file).unwrap();
    };
    // No wait for the watcher: it compares with the files as they were before start-up read
    // them, so a change from then on is seen (it took them when it first ran, and a change
    // made before that, under load, was missed: this test timed out waiting for a swap).
    replace(&file_a, &next_a, "a");
    tokio::time::sleep(Duration::from_millis(300)).await;
    replace(&file_b, &plugin_path("versioned-b"), "b");
    let digest_a = digest_of(&plugin_path("versioned-a"));
    let digest_b = digest_of(&plugin_path("versioned-b"));
    wait_until(
        Duration::from_secs(20),
        "B's swap while A's load waits",
        || async {
            let r = try_report(&base).await?;
            (consumer(&r, "other-v1")["current"]["digest"] == digest_b.as_str()).then_some(())
        },
    )
    .await;
    let r = report(&base).await;
    assert_eq!(
        consumer(&r, CONSUMER)["current"]["digest"],
        digest_a.as_str(),
        "A still waits"
    );
    // Released: A's change goes through.
    lock.unlock().unwrap();
    let digest_next = digest_of(&next_a);
    wait_until(Duration::from_secs(60), "A's swap", || async {
        let r = try_report(&base).await?;
        (consumer(&r, CONSUMER)["current"]["digest"] == digest_next.as_str()).then_some(())
    })
    .await;
    swap.finish().await;
    other.cleanup().await;
}
