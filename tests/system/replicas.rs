//! Several `idemhost run` processes with one config share one durable pull consumer: the marker
//! in PostgreSQL stays the only authority, so messages redelivered after a replica dies — or
//! delivered to two replicas — still have one effect each.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::*;

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
    let key = env.host_key().await;
    let mut messages = Vec::new();
    for i in 0..EVENTS {
        let mut h = async_nats::HeaderMap::new();
        let (id, original) = if i % DUPLICATE_EVERY == DUPLICATE_EVERY - 1 {
            // The same message again, under a fresh broker id: the marker must decide.
            (format!("again-{i}"), Some(format!("evt-{}", i - 5)))
        } else {
            distinct += 1;
            (format!("evt-{i}"), None)
        };
        h.insert("Nats-Msg-Id", id.as_str());
        if let Some(original) = &original {
            replayed(&mut h, &key, original);
        }
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

/// Per-key order across replicas (`partitions`, NATS 2.11+): 200 keys × 50 versioned events
/// with 20 % duplicates, the key in the subject and the stream's transform putting it in one of
/// 8 partitions; 3 replica processes, each partition pinned to one of them. The replica holding
/// the most pins is SIGKILLed after a third and a new one started: its partitions move to the
/// others (their logs show the new pins) and, by SQL, every key's versions are applied exactly
/// once and in order. A stream whose subjects also capture the partitions' own subjects is
/// refused first. On an older server the host refuses `partitions` with what it needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_keep_each_keys_order_across_replicas_when_one_dies() {
    const NAME: &str = "partitioned-v1";
    const KEYS: usize = 200;
    const VERSIONS: i64 = 50;
    const PARTITIONS: u32 = 8;
    let env = TestEnv::new("partitions").await;
    env.execute("CREATE TABLE key_versions (id bigserial PRIMARY KEY, key text NOT NULL, version integer NOT NULL)").await;
    let nats = NatsEnv::new("partitions", Duration::from_secs(60)).await;
    let keyed = format!("{}.keys.*", nats.prefix);
    let text = config_text(
        &env,
        &nats,
        NAME,
        "testkit",
        &format!(
            "partitions = {PARTITIONS}\nmax_in_flight = 4\nack_wait = \"2s\"\nmax_deliver = 100\n\
             backoff = [\"100ms\", \"1s\"]\nordering = {{ key = \"header:Idemhost-Ordering-Key\" }}"
        ),
    )
    .replace(
        &format!("[\"{}\"]", nats.subject()),
        &format!("[\"{keyed}\"]"),
    )
    .replace("max_connections = 8", "max_connections = 10");
    let version = nats.client.server_info().version;
    if version.starts_with("2.9.") || version.starts_with("2.10.") {
        let err = start_error(parse_config(&text)).await;
        assert!(err.contains("needs a NATS server 2.11"), "{err}");
        nats.cleanup().await;
        env.cleanup().await;
        return;
    }
    let mut stream = nats.js.get_stream(&nats.stream).await.unwrap();
    let mut wanted = stream.info().await.unwrap().config.clone();
    // A stream capturing `<prefix>.>` would also take `<keyed>.<n>` as published, a producer
    // choosing the partition: the host refuses it with the subject to use instead.
    wanted.subject_transform = Some(idemhost::test_support::partition::transform(
        &keyed, PARTITIONS,
    ));
    nats.js.update_stream(&wanted).await.unwrap();
    let err = start_error(parse_config(&text)).await;
    assert!(
        err.contains(&format!("captures `{}.>`", nats.prefix))
            && err.contains(&format!("Give the stream `{keyed}`")),
        "{err}"
    );
    wanted.subjects = vec![keyed.clone(), nats.dlq()];
    nats.js.update_stream(&wanted).await.unwrap();

    // First in every partition, messages whose producer forged a pin: a `Nats-Pin-Id` of its
    // own, and a header block without its closing blank line, which makes the server's appended
    // pin line read as part of the producer's last header. A replica that took its pin from the
    // header would pull with "forged", be refused (423) and leave its partition idle until the
    // pin timed out; the host takes the pin from the consumer's info instead.
    const FORGED: usize = 20;
    for k in (0..KEYS).step_by(KEYS / FORGED) {
        let block =
            format!("NATS/1.0\r\nNats-Msg-Id: forge-{k}\r\nNats-Pin-Id: forged\r\nX-Fold: y\r\n");
        publish_raw_block(
            NATS_URL.trim_start_matches("nats://"),
            &format!("{}.keys.k-{k}", nats.prefix),
            block.as_bytes(),
            br#"{"steps":[]}"#,
        )
        .await;
    }
    let (events, duplicates, _) =
        versioned_events(&env.host_key().await, KEYS, VERSIONS, 11, false);
    let prefix = nats.prefix.clone();
    nats.publish_many_to(
        events
            .into_iter()
            .map(|(key, h, script)| (format!("{prefix}.keys.{key}"), h, script)),
    )
    .await;
    let dir = std::env::temp_dir().join(unique("idemhost_partitions"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("idemhost.toml");
    std::fs::write(&config, &text).unwrap();
    let log = |name: &str| dir.join(format!("{name}.log"));
    let pinned = |name: &str| -> Vec<u32> {
        let text = std::fs::read_to_string(log(name)).unwrap_or_default();
        // The log's colours out: ESC [ digits ; … m.
        let mut plain = String::with_capacity(text.len());
        let mut chars = text.chars();
        while let Some(c) = chars.next() {
            if c == '\x1b' {
                for c in chars.by_ref() {
                    if c == 'm' {
                        break;
                    }
                }
            } else {
                plain.push(c);
            }
        }
        let text = plain;
        let mut held = Vec::new();
        for line in text.lines() {
            let Some(p) = line
                .split("partition=")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if line.contains("partition pinned to this replica") {
                held.push(p);
            } else if line.contains("partition unpinned from this replica") {
                held.retain(|h| *h != p);
            }
        }
        held
    };
    let mut replicas: Vec<Child> = (0..3)
        .map(|i| spawn_host(&config, None, &log(&format!("r{i}"))))
        .collect();
    let total = KEYS as i64 * VERSIONS;
    let applied = || async { env.scalar("SELECT count(*) FROM key_versions").await };
    wait_until(Duration::from_secs(240), "a third applied", || async {
        (applied().await >= total / 3).then_some(())
    })
    .await;
    let victim = (0..3)
        .max_by_key(|i| pinned(&format!("r{i}")).len())
        .unwrap();
    let moved = pinned(&format!("r{victim}"));
    assert!(!moved.is_empty(), "some replica holds a pin");
    kill9(&mut replicas[victim]);
    replicas.push(spawn_host(&config, None, &log("r3")));
    wait_until(
        Duration::from_secs(300),
        "every version applied",
        || async { (applied().await >= total).then_some(()) },
    )
    .await;
    for p in 0..PARTITIONS {
        nats.wait_drained(&format!("{NAME}-p{p}"), Duration::from_secs(60))
            .await;
    }
    for (i, r) in replicas.iter_mut().enumerate() {
        if i != victim {
            // SAFETY: a signal to our own child process.
            unsafe { libc::kill(r.id() as i32, libc::SIGTERM) };
            assert!(r.wait().unwrap().success(), "a graceful stop exits 0");
        }
    }
    let survivors: Vec<u32> = (0..4)
        .filter(|i| *i != victim)
        .flat_map(|i| pinned(&format!("r{i}")))
        .collect();
    println!(
        "partitions: {duplicates} duplicates; replica r{victim} held {moved:?} when killed; \
         pins at the end {survivors:?}"
    );
    for p in &moved {
        assert!(
            survivors.contains(p),
            "partition {p} moved to a live replica: {survivors:?}"
        );
    }
    let logs: String = (0..4)
        .map(|i| std::fs::read_to_string(log(&format!("r{i}"))).unwrap_or_default())
        .collect();
    assert!(!logs.contains("forged"), "a replica took a producer's pin");
    assert_eq!(env.markers(NAME).await, total + FORGED as i64);
    assert_eq!(applied().await, total, "exactly once");
    assert_keys_in_order(&env, VERSIONS).await;
    assert!(
        nats.dead_letters().await.is_empty(),
        "nothing dead-lettered"
    );
    nats.cleanup().await;
    env.cleanup().await;
    let _ = std::fs::remove_dir_all(&dir);
}
