//! Several `idemhost run` processes with one config share one durable pull consumer: the marker
//! in PostgreSQL stays the only authority, so messages redelivered after a replica dies — or
//! delivered to two replicas — still have one effect each.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

const NAME: &str = "inventory-reservation-v1";
const EVENTS: usize = 20_000;
/// One event in ten repeats an earlier id (a second delivery past the broker).
const DUPLICATE_EVERY: usize = 10;

fn spawn(config: &std::path::Path, log: &std::path::Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_idemhost"))
        .args(["run", "--config", config.to_str().unwrap()])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap()
}

fn kill9(child: &mut Child) {
    // SAFETY: a signal to our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let _ = child.wait();
}

/// Three replicas on one consumer, 20,000 events with 10% duplicate ids, one replica SIGKILLed
/// and restarted twice mid-run: markers == effects == distinct ids, everything acked, nothing
/// dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_one_killed_twice_apply_each_message_once() {
    let env = TestEnv::new("replicas").await;
    env.seed_inventory(&[("sku-1", 1_000_000)]).await;
    let nats = NatsEnv::new("replicas", Duration::from_secs(60)).await;
    let text = config_text(
        &env,
        &nats,
        NAME,
        "inventory",
        "max_in_flight = 8\nack_wait = \"2s\"",
    )
    .replace("max_connections = 8", "max_connections = 10");
    let dir = std::env::temp_dir().join(unique("idemhost_replicas"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("idemhost.toml");
    std::fs::write(&config, text).unwrap();

    let mut distinct = 0;
    let mut messages = Vec::new();
    for i in 0..EVENTS {
        let mut h = async_nats::HeaderMap::new();
        let id = if i % DUPLICATE_EVERY == DUPLICATE_EVERY - 1 {
            // The same message again, under a fresh broker id: the marker must decide.
            let original = format!("evt-{}", i - 5);
            h.insert("Idemhost-Message-Id", original.as_str());
            format!("again-{i}")
        } else {
            distinct += 1;
            format!("evt-{i}")
        };
        h.insert("Nats-Msg-Id", id.as_str());
        messages.push((h, order_payload(&id, "sku-1", 1)));
    }
    nats.publish_many(messages).await;

    let log = |name: &str| dir.join(format!("{name}.log"));
    let mut replicas: Vec<Child> = (0..3)
        .map(|i| spawn(&config, &log(&format!("r{i}-0"))))
        .collect();
    for (round, at) in [(1, distinct / 4), (2, distinct / 2)] {
        wait_until(
            Duration::from_secs(240),
            &format!("{at} markers"),
            || async { (env.markers(NAME).await >= at as i64).then_some(()) },
        )
        .await;
        kill9(&mut replicas[0]);
        replicas[0] = spawn(&config, &log(&format!("r0-{round}")));
    }
    let info = nats.wait_drained(NAME, Duration::from_secs(300)).await;
    for r in &mut replicas {
        // SAFETY: a signal to our own child process.
        unsafe { libc::kill(r.id() as i32, libc::SIGTERM) };
        assert!(r.wait().unwrap().success(), "a graceful stop exits 0");
    }
    let markers = env.markers(NAME).await;
    assert_eq!(markers, distinct as i64, "one marker per distinct id");
    assert_eq!(
        env.reserved("sku-1").await,
        markers,
        "one effect per marker"
    );
    assert!(
        nats.dead_letters().await.is_empty(),
        "nothing dead-lettered"
    );
    assert_eq!(info.num_ack_pending, 0);
    assert!(
        info.num_redelivered > 0 || info.delivered.consumer_sequence > EVENTS as u64,
        "the kills caused redeliveries: {info:?}"
    );
    nats.cleanup().await;
    env.cleanup().await;
    let _ = std::fs::remove_dir_all(&dir);
}
