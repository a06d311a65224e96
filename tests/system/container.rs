//! The host as a container: the FROM scratch image of `Containerfile` (built by
//! `scripts/build-image.sh`, which `scripts/test.sh` runs first) under podman, against the
//! machine's PostgreSQL and NATS. Skipped, saying so, only where podman is absent.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::common::*;
use async_nats::HeaderMap;

const CONSUMER: &str = "inventory-reservation-v1";

fn image() -> String {
    std::env::var("IDEMHOST_TEST_IMAGE").unwrap_or_else(|_| "localhost/idemhost:latest".into())
}

/// podman with the servers' URLs in its environment: `-e NAME` without a value passes them into
/// the container, so a private server's password never shows on a command line.
fn podman(args: &[&str]) -> Output {
    Command::new("podman")
        .args(args)
        .env("IDEMHOST_POSTGRES__URL", PG_URL.get())
        .env("IDEMHOST_NATS__URL", NATS_URL.get())
        .output()
        .expect("run podman")
}

fn podman_ok(args: &[&str]) -> String {
    let out = podman(args);
    assert!(
        out.status.success(),
        "podman {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Says so when podman is absent (the tests are then skipped).
fn podman_absent() -> bool {
    let absent = Command::new("podman").arg("--version").output().is_err();
    if absent {
        println!("skipped: podman is absent (scripts/test.sh installs it)");
    }
    absent
}

/// A container of the image, removed when dropped.
struct Container {
    name: String,
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman(&["rm", "-f", &self.name]);
    }
}

impl Container {
    fn logs(&self) -> String {
        let out = podman(&["logs", &self.name]);
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
    }

    fn inspect(&self, format: &str) -> String {
        podman_ok(&["inspect", &self.name, "--format", format])
    }
}

/// Publishes `n` OrderPlaced for `ids`; every fifth also goes out a second time under a fresh
/// broker id with the original in `Idemhost-Message-Id`: a duplicate delivery the broker cannot
/// absorb, so the marker must.
async fn publish_batch(nats: &NatsEnv, key: &str, ids: &[String]) {
    let mut acks = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let payload = order_payload(id, &format!("sku-{}", i % 10), 1);
        let mut copies = vec![(id.clone(), None)];
        if i % 5 == 0 {
            copies.push((format!("again-{id}"), Some(id.clone())));
        }
        for (broker_id, original) in copies {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", broker_id.as_str());
            headers.insert("Idemhost-Event-Type", "OrderPlaced");
            if let Some(original) = &original {
                replayed(&mut headers, key, original);
            }
            let ack = nats
                .js
                .publish_with_headers(nats.subject(), headers, payload.clone().into_bytes().into())
                .await
                .unwrap();
            acks.push(ack);
        }
    }
    for ack in acks {
        assert!(!ack.await.unwrap().duplicate, "every copy is stored");
    }
}

/// Builds no image itself: the image is the one `scripts/build-image.sh` made from this tree.
/// Runs it read-only as its non-root user; 1,000 deliveries (800 ids, 200 duplicates) give 800
/// effects; `podman stop` in the middle of a second batch (3,000 ids, 3,600 deliveries) drains
/// and exits 0; after a restart every message has exactly one effect, by SQL.
#[tokio::test]
async fn container_applies_once_drains_on_stop_and_resumes_without_loss_or_doubles() {
    if podman_absent() {
        return;
    }
    let image = image();
    assert!(
        podman(&["image", "exists", &image]).status.success(),
        "image {image} is missing: run scripts/build-image.sh"
    );
    let env = TestEnv::new("container").await;
    let skus: Vec<(String, i64)> = (0..10).map(|i| (format!("sku-{i}"), 1_000_000)).collect();
    let skus: Vec<(&str, i64)> = skus.iter().map(|(s, n)| (s.as_str(), *n)).collect();
    env.seed_inventory(&skus).await;
    let nats = NatsEnv::new("container", Duration::from_secs(60)).await;
    let port = free_port();
    let name = unique("idemhost-test");
    let vars = [
        "IDEMHOST_POSTGRES__URL".to_string(),
        "IDEMHOST_NATS__URL".to_string(),
        format!("IDEMHOST_POSTGRES__SCHEMA={}", env.schema),
        format!("IDEMHOST_POSTGRES__APPLICATION_NAME={}", env.schema),
        format!("IDEMHOST_CONSUMER__0__STREAM={}", nats.stream),
        format!("IDEMHOST_CONSUMER__0__SUBJECTS=[\"{}\"]", nats.subject()),
        format!("IDEMHOST_CONSUMER__0__DEAD_LETTER_SUBJECT={}", nats.dlq()),
        "IDEMHOST_CONSUMER__0__CREATE_STREAM=false".into(),
        format!("IDEMHOST_ADMIN__LISTEN=127.0.0.1:{port}"),
    ];
    let mut args: Vec<String> = [
        "--runtime",
        "runc",
        "run",
        "-d",
        "--name",
        &name,
        "--network=host",
        "--read-only",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=1000:1000",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for v in &vars {
        args.extend(["-e".to_string(), v.clone()]);
    }
    args.push(image.clone());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();

    let started = Instant::now();
    podman_ok(&args);
    let container = Container { name };
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    let cold_start = wait_until(Duration::from_secs(60), "/readyz to answer 200", || async {
        idemhost::ops::admin::probe(&readyz, Duration::from_secs(1))
            .await
            .ok()
            .map(|()| started.elapsed())
    })
    .await;

    // The image's HEALTHCHECK (`idemhost health`, finding the port from the config and the
    // env override) passes. podman cannot schedule it without systemd; run it once by hand.
    podman_ok(&["healthcheck", "run", &container.name]);

    // It runs as the image's numeric non-root user, on a read-only root filesystem.
    assert_eq!(container.inspect("{{.Config.User}}"), "65532:65532");
    let pid = container.inspect("{{.State.Pid}}");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert!(
        uid_line.split_whitespace().skip(1).all(|u| u == "65532"),
        "{uid_line}"
    );
    let size: u64 = podman_ok(&["image", "inspect", &image, "--format", "{{.Size}}"])
        .parse()
        .unwrap();
    assert!(size < 64 << 20, "a small image: {size} bytes");

    // First batch: 800 ids, 1,000 deliveries.
    let first: Vec<String> = (0..800).map(|i| format!("a-{i}")).collect();
    let key = env.host_key().await;
    publish_batch(&nats, &key, &first).await;
    nats.wait_drained(CONSUMER, Duration::from_secs(120)).await;
    assert_eq!(env.markers(CONSUMER).await, 800, "{}", container.logs());
    assert_eq!(
        env.scalar("SELECT sum(reserved)::bigint FROM inventory")
            .await,
        800
    );

    // Second batch, stopped in the middle: SIGTERM drains what is in flight and exits 0.
    let second: Vec<String> = (0..3000).map(|i| format!("b-{i}")).collect();
    publish_batch(&nats, &key, &second).await;
    wait_until(
        Duration::from_secs(60),
        "part of the second batch",
        || async { (env.markers(CONSUMER).await >= 900).then_some(()) },
    )
    .await;
    let stop = Instant::now();
    podman_ok(&["stop", "-t", "30", &container.name]);
    let drain = stop.elapsed();
    assert_eq!(
        container.inspect("{{.State.ExitCode}}"),
        "0",
        "{}",
        container.logs()
    );
    let at_stop = env.markers(CONSUMER).await;
    let info = nats.consumer_info(CONSUMER).await;
    assert!(
        info.num_pending > 0 && at_stop < 3800,
        "stopped in the middle: {at_stop} markers, {} pending",
        info.num_pending
    );
    assert_eq!(
        env.scalar("SELECT sum(reserved)::bigint FROM inventory")
            .await,
        at_stop,
        "every committed marker has its effect, and only those"
    );

    // Restarted, it finishes: every id applied once, duplicates and the stop absorbed.
    podman_ok(&["start", &container.name]);
    nats.wait_drained(CONSUMER, Duration::from_secs(120)).await;
    assert_eq!(env.markers(CONSUMER).await, 3800, "{}", container.logs());
    assert_eq!(
        env.scalar("SELECT sum(reserved)::bigint FROM inventory")
            .await,
        3800
    );
    assert!(nats.dead_letters().await.is_empty(), "{}", container.logs());
    println!(
        "image {size} bytes; podman run to /readyz 200 in {cold_start:?}; podman stop drained in {drain:?} with {at_stop} of 3800 applied"
    );
    drop(container);
    nats.cleanup().await;
    env.cleanup().await;
}

/// `compose.yaml` as shipped, run by podman-compose (`scripts/ensure-compose.sh`) with the
/// suite's image against the suite's servers: the service comes up ready, applies a message
/// once (and its duplicate not at all), and `down` stops it gracefully. Before, the file named
/// public images this machine cannot pull and was never run. The test's own settings (schema,
/// stream) go in through a second file of variable names, as an operator's override would.
#[tokio::test]
async fn compose_runs_the_locally_built_image() {
    if podman_absent() {
        return;
    }
    let root = repo_root();
    let installer = run_ok(&mut Command::new(root.join("scripts/ensure-compose.sh")));
    let compose_cmd: Vec<String> = String::from_utf8_lossy(&installer.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let env = TestEnv::new("compose").await;
    env.seed_inventory(&[("sku-0", 100)]).await;
    let nats = NatsEnv::new("compose", Duration::from_secs(60)).await;
    let port = free_port();
    let project = unique("idemhost_compose");
    let override_file =
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{project}.yaml"));
    std::fs::write(
        &override_file,
        "services:\n  idemhost:\n    environment:\n      - IDEMHOST_POSTGRES__SCHEMA\n      \
         - IDEMHOST_CONSUMER__0__STREAM\n      - IDEMHOST_CONSUMER__0__SUBJECTS\n      \
         - IDEMHOST_CONSUMER__0__DEAD_LETTER_SUBJECT\n      - IDEMHOST_CONSUMER__0__CREATE_STREAM\n",
    )
    .unwrap();
    let compose = |args: &[&str]| {
        let mut command = Command::new(&compose_cmd[0]);
        command
            .args(&compose_cmd[1..])
            .current_dir(&root)
            .args(["--podman-args", "--runtime runc", "--in-pod", "false"])
            .args([
                "--podman-run-args",
                "--ulimit nofile=1024:1024 --ulimit nproc=1000:1000",
            ])
            .args(["-p", &project, "-f", "compose.yaml", "-f"])
            .arg(&override_file)
            .args(args)
            .env("IDEMHOST_IMAGE", image())
            .env("IDEMHOST_POSTGRES__URL", PG_URL.get())
            .env("IDEMHOST_NATS__URL", NATS_URL.get())
            .env("IDEMHOST_ADMIN__LISTEN", format!("127.0.0.1:{port}"))
            .env("IDEMHOST_POSTGRES__SCHEMA", &env.schema)
            .env("IDEMHOST_CONSUMER__0__STREAM", &nats.stream)
            .env(
                "IDEMHOST_CONSUMER__0__SUBJECTS",
                format!("[\"{}\"]", nats.subject()),
            )
            .env("IDEMHOST_CONSUMER__0__DEAD_LETTER_SUBJECT", nats.dlq())
            .env("IDEMHOST_CONSUMER__0__CREATE_STREAM", "false");
        command.output().unwrap()
    };
    let container = Container {
        name: format!("{project}_idemhost_1"),
    };
    let up = compose(&["up", "-d"]);
    assert!(
        up.status.success(),
        "compose up: {}{}",
        String::from_utf8_lossy(&up.stdout),
        String::from_utf8_lossy(&up.stderr)
    );
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    wait_until(Duration::from_secs(60), "/readyz to answer 200", || async {
        idemhost::ops::admin::probe(&readyz, Duration::from_secs(1))
            .await
            .ok()
    })
    .await;
    // The variables went in from the shell by name.
    let vars = container.inspect("{{.Config.Env}}");
    assert!(
        vars.contains(&format!("IDEMHOST_POSTGRES__SCHEMA={}", env.schema)),
        "{vars}"
    );

    let key = env.host_key().await;
    publish_batch(&nats, &key, &["c-0".to_string()]).await;
    nats.wait_drained(CONSUMER, Duration::from_secs(60)).await;
    assert_eq!(env.markers(CONSUMER).await, 1, "{}", container.logs());
    assert_eq!(env.reserved("sku-0").await, 1);

    let down = compose(&["down", "-t", "30"]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    let gone = podman(&["container", "exists", &container.name]);
    assert!(!gone.status.success(), "compose down left the container");
    let _ = std::fs::remove_file(&override_file);
    nats.cleanup().await;
    env.cleanup().await;
}
