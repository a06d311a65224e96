//! Several `idemhost run` processes with one config share one durable pull consumer: the marker
//! in PostgreSQL stays the only authority, so messages redelivered after a replica dies — or
//! delivered to two replicas — still have one effect each.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream::consumer::PriorityPolicy;

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
    let (text, keyed) = partitioned_config(&env, &nats, NAME, PARTITIONS);
    let version = nats.client.server_info().version;
    if refused_before(&version, "2.11.", parse_config(&text)).await {
        nats.cleanup().await;
        env.cleanup().await;
        return;
    }
    // A stream capturing `<prefix>.>` would also take `<keyed>.<n>` as published, a producer
    // choosing the partition: the host refuses it with the subject to use instead.
    let mut wanted = with_transform(&nats, &keyed, PARTITIONS).await;
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
    each_once_in_order_then_clean(env, nats, total, VERSIONS, &dir).await;
}

/// Whether the server (`version`) is older than `needed` (`2.N.`): then `config` must be
/// refused at start with the version it needs.
async fn refused_before(version: &str, needed: &str, config: idemhost::Config) -> bool {
    let minor = |v: &str| v.split('.').nth(1).and_then(|m| m.parse::<u32>().ok());
    if minor(version) >= minor(needed) {
        return false;
    }
    let err = start_error(config).await;
    assert!(err.contains("needs a NATS server 2.1"), "{err}");
    true
}

/// The stream's config with the transform that puts `partitions` of `keyed` in the subject.
async fn with_transform(
    nats: &NatsEnv,
    keyed: &str,
    partitions: u32,
) -> async_nats::jetstream::stream::Config {
    let mut stream = nats.js.get_stream(&nats.stream).await.unwrap();
    let mut wanted = stream.info().await.unwrap().config.clone();
    wanted.subject_transform = Some(idemhost::test_support::partition::transform(
        keyed, partitions,
    ));
    wanted
}

/// The config of a partitioned consumer on `<prefix>.keys.*` (keys in order by the
/// `Idemhost-Ordering-Key` header), and that subject.
fn partitioned_config(
    env: &TestEnv,
    nats: &NatsEnv,
    name: &str,
    partitions: u32,
) -> (String, String) {
    let keyed = format!("{}.keys.*", nats.prefix);
    let text = config_text(
        env,
        nats,
        name,
        "testkit",
        &format!(
            "partitions = {partitions}\nmax_in_flight = 4\nack_wait = \"2s\"\nmax_deliver = 100\n\
             backoff = [\"100ms\", \"1s\"]\nordering = {{ key = \"header:Idemhost-Ordering-Key\" }}"
        ),
    )
    .replace(
        &format!("[\"{}\"]", nats.subject()),
        &format!("[\"{keyed}\"]"),
    )
    .replace(
        "max_connections = 8",
        &format!("max_connections = {}", partitions + 2),
    );
    (text, keyed)
}

/// Balanced partitions (`host.replica` of `host.replicas`, NATS 2.12+): 12 partitions over 3
/// numbered replicas, each pulling every partition at its rank for it. By SQL (each row records
/// the replica's `application_name` and the time it was applied; the stream gives each key's
/// partition): while all three run, each partition is served by its own replica (4 each); one
/// SIGKILLed mid-stream, its 4 partitions go to the replicas ranked next for them (2 each)
/// within `ack_wait` and a margin; started again with its number, it serves its 4 again; another
/// stopped (SIGSTOP) while idle, its 4 go to the ranks next within the pull expiry and `ack_wait`
/// (its waiting pulls are handed messages it cannot take until they expire). Every
/// key's versions applied exactly once and in order, nothing dead-lettered. An older server
/// refuses the keys with what it needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_spread_over_numbered_replicas_and_come_back() {
    const NAME: &str = "spread-v1";
    const KEYS: usize = 96;
    const VERSIONS: i64 = 30;
    const PARTITIONS: u32 = 12;
    const REPLICAS: u32 = 3;
    /// How long a dead replica's partitions may take to move: its message in flight comes
    /// back after `ack_wait` (2 s), then a survivor's waiting pull takes it.
    const MOVE_BOUND: f64 = 5.0;
    /// A stopped replica's pulls wait at the server until they expire (5 s), and what they
    /// were handed comes back after `ack_wait`.
    const STALL_BOUND: f64 = 9.0;
    let env = TestEnv::new("spread").await;
    env.execute(
        "CREATE TABLE key_versions (id bigserial PRIMARY KEY, key text NOT NULL, \
         version integer NOT NULL, replica text NOT NULL DEFAULT current_setting('application_name'), \
         at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .await;
    let nats = NatsEnv::new("spread", Duration::from_secs(60)).await;
    let (text, keyed) = partitioned_config(&env, &nats, NAME, PARTITIONS);
    let version = nats.client.server_info().version;
    let numbered = |i: u32| {
        [
            ("IDEMHOST_HOST__REPLICA", i.to_string()),
            ("IDEMHOST_HOST__REPLICAS", REPLICAS.to_string()),
            ("IDEMHOST_POSTGRES__APPLICATION_NAME", format!("r{i}")),
        ]
    };
    let mut with_place = parse_config(&text);
    with_place.host.replica = Some(0);
    with_place.host.replicas = Some(REPLICAS);
    if refused_before(&version, "2.12.", with_place).await {
        nats.cleanup().await;
        env.cleanup().await;
        return;
    }
    let mut wanted = with_transform(&nats, &keyed, PARTITIONS).await;
    wanted.subjects = vec![keyed.clone(), nats.dlq()];
    nats.js.update_stream(&wanted).await.unwrap();

    let dir = std::env::temp_dir().join(unique("idemhost_spread"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("idemhost.toml");
    std::fs::write(&config, &text).unwrap();
    let log = |name: &str| dir.join(format!("{name}.log"));
    let start = |i: u32, name: &str| {
        let env = numbered(i);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        spawn_host_with(&config, &log(name), &env)
    };
    let bound = |name: &str| {
        let log = log(name);
        async move {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            (text.matches("consumer bound").count() == PARTITIONS as usize).then_some(())
        }
    };
    // Durables made by a host without the keys are pinned; numbered replicas turn them
    // prioritized (an upgrade in place).
    let policy = |info: async_nats::jetstream::consumer::Info| info.config.priority_policy;
    let unnumbered = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    wait_until(Duration::from_secs(60), "the pinned durables", || async {
        let stream = nats.js.get_stream(&nats.stream).await.ok()?;
        let last = format!("{NAME}-p{}", PARTITIONS - 1);
        stream.consumer_info(&last).await.ok()
    })
    .await;
    unnumbered.stop().await;
    assert_eq!(
        policy(nats.consumer_info(&format!("{NAME}-p0")).await),
        PriorityPolicy::PinnedClient
    );
    let mut replicas: Vec<Child> = (0..REPLICAS).map(|i| start(i, &format!("r{i}"))).collect();
    for i in 0..REPLICAS {
        wait_until(Duration::from_secs(60), "a replica bound", || {
            bound(&format!("r{i}"))
        })
        .await;
    }
    for p in 0..PARTITIONS {
        let info = nats.consumer_info(&format!("{NAME}-p{p}")).await;
        assert_eq!(policy(info), PriorityPolicy::Prioritized, "partition {p}");
    }
    let (events, duplicates, _) =
        versioned_events(&env.host_key().await, KEYS, VERSIONS, 23, false);
    // Five parts, each published once the one before is applied (a part's rows are then an
    // id range): all up; one killed halfway through; one down; the killed one back; another
    // stopped (SIGSTOP) while idle, its pulls still waiting at the server.
    let parts: Vec<Vec<(String, async_nats::HeaderMap, String)>> = events
        .chunks(events.len().div_ceil(5))
        .map(<[_]>::to_vec)
        .collect();
    let originals = |e: &[(String, async_nats::HeaderMap, String)]| {
        e.iter()
            .filter(|(_, h, _)| {
                !h.get("Nats-Msg-Id")
                    .is_some_and(|v| v.as_str().starts_with("dup-"))
            })
            .count() as i64
    };
    let prefix = nats.prefix.clone();
    let applied = || async { env.scalar("SELECT count(*) FROM key_versions").await };
    let last_id = || async {
        env.scalar("SELECT coalesce(max(id), 0) FROM key_versions")
            .await
    };
    let now_us = || async {
        env.scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1e6)::bigint")
            .await
    };
    let mut due = 0;
    let mut ends = Vec::new();
    let (mut killed_at, mut stopped_at) = (0, 0);
    for (i, part) in parts.iter().enumerate() {
        if i == 4 {
            for p in 0..PARTITIONS {
                nats.wait_drained(&format!("{NAME}-p{p}"), Duration::from_secs(60))
                    .await;
            }
            // SAFETY: a signal to our own child process.
            unsafe { libc::kill(replicas[1].id() as i32, libc::SIGSTOP) };
            stopped_at = now_us().await;
        }
        if i == 3 {
            replicas[0] = start(0, "r0-back");
            wait_until(
                Duration::from_secs(60),
                "the replica back and bound",
                || bound("r0-back"),
            )
            .await;
        }
        nats.publish_many_to(
            part.iter().map(|(key, h, script)| {
                (format!("{prefix}.keys.{key}"), h.clone(), script.clone())
            }),
        )
        .await;
        let before = due;
        due += originals(part);
        if i == 1 {
            wait_until(
                Duration::from_secs(120),
                "half of the part applied",
                || async { (applied().await >= (before + due) / 2).then_some(()) },
            )
            .await;
            kill9(&mut replicas[0]);
            killed_at = now_us().await;
        }
        wait_until(Duration::from_secs(120), "the part applied", || async {
            (applied().await >= due).then_some(())
        })
        .await;
        ends.push(last_id().await);
    }
    // SAFETY: a signal to our own child process.
    unsafe { libc::kill(replicas[1].id() as i32, libc::SIGCONT) };
    let total = KEYS as i64 * VERSIONS;
    assert_eq!(due, total);
    for p in 0..PARTITIONS {
        nats.wait_drained(&format!("{NAME}-p{p}"), Duration::from_secs(60))
            .await;
    }
    for r in replicas.iter_mut() {
        // SAFETY: a signal to our own child process.
        unsafe { libc::kill(r.id() as i32, libc::SIGTERM) };
        assert!(r.wait().unwrap().success(), "a graceful stop exits 0");
    }
    // A replica without a number, alone now: it leaves the durables prioritized and serves
    // them (pulling at the best priority).
    const EXTRA: usize = 24;
    let unnumbered = RunningHost::start(idemhost::Host::new(parse_config(&text)));
    nats.publish_many_to((0..EXTRA).map(|i| {
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", format!("extra-{i}").as_str());
        h.insert("Idemhost-Ordering-Key", format!("extra-{i}").as_str());
        let subject = format!("{prefix}.keys.extra-{i}");
        (subject, h, r#"{"steps":[]}"#.to_string())
    }))
    .await;
    wait_until(
        Duration::from_secs(60),
        "the extra messages applied",
        || async { (env.markers(NAME).await == total + EXTRA as i64).then_some(()) },
    )
    .await;
    unnumbered.stop().await;
    for p in 0..PARTITIONS {
        let info = nats.consumer_info(&format!("{NAME}-p{p}")).await;
        assert_eq!(
            policy(info),
            PriorityPolicy::Prioritized,
            "partition {p} kept"
        );
    }

    // Each key's partition, from the subjects the stream stored.
    let mut partition_of = std::collections::HashMap::new();
    for p in 0..PARTITIONS {
        for (h, _) in nats.stored(&format!("{prefix}.keys.*.{p}")).await {
            if let Some(key) = h.get("Idemhost-Ordering-Key") {
                partition_of.insert(key.to_string(), p);
            }
        }
    }
    let rows: Vec<(i64, String, String, i64)> = sqlx::query_as(
        "SELECT id, key, replica, (extract(epoch FROM at) * 1e6)::bigint FROM key_versions ORDER BY id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    // Who applied most of each partition's rows with ids in `ids`, and what share.
    let servers = |ids: std::ops::RangeInclusive<i64>| -> Vec<(String, f64)> {
        (0..PARTITIONS)
            .map(|p| {
                let mut by: std::collections::BTreeMap<&str, usize> = Default::default();
                for (_, _, replica, _) in rows.iter().filter(|(id, k, _, _)| {
                    ids.contains(id) && partition_of.get(k.as_str()) == Some(&p)
                }) {
                    *by.entry(replica.as_str()).or_default() += 1;
                }
                let all: usize = by.values().sum();
                let (who, n) = by
                    .into_iter()
                    .max_by_key(|(_, n)| *n)
                    .unwrap_or(("none", 0));
                (who.to_string(), (n * 100 / all.max(1)) as f64 / 100.0)
            })
            .collect()
    };
    let home = |p: u32| format!("r{}", p % REPLICAS);
    let next = |p: u32| {
        let r = (0..REPLICAS)
            .find(|r| {
                let spread = idemhost::test_support::partition::Spread {
                    replica: *r,
                    replicas: REPLICAS,
                };
                spread.priority(p) == 1
            })
            .unwrap();
        format!("r{r}")
    };
    let all_up = servers(0..=ends[0]);
    let one_down = servers(ends[1] + 1..=ends[2]);
    let returned = servers(ends[2] + 1..=ends[3]);
    let stalled = servers(ends[3] + 1..=ends[4]);
    println!(
        "spread: {duplicates} duplicates; all up {all_up:?}; one down {one_down:?}; back {returned:?}; one stalled {stalled:?}"
    );
    // When a replica other than `from` first applied a row of partition `p` after `since`.
    let first_elsewhere = |p: u32, from: &str, since: i64| {
        let first = rows
            .iter()
            .filter(|(_, k, r, at)| {
                *at > since && r != from && partition_of.get(k.as_str()) == Some(&p)
            })
            .map(|(_, _, _, at)| *at)
            .min()
            .unwrap();
        (first - since) as f64 / 1e6
    };
    let (mut moves, mut stall_moves) = (Vec::new(), Vec::new());
    for p in 0..PARTITIONS {
        let at = p as usize;
        assert_eq!(
            all_up[at].0,
            home(p),
            "partition {p} with all up: {all_up:?}"
        );
        if p % REPLICAS == 0 {
            assert_eq!(one_down[at].0, next(p), "partition {p} moved: {one_down:?}");
            moves.push(first_elsewhere(p, "r0", killed_at));
        } else {
            assert_eq!(
                one_down[at].0,
                home(p),
                "partition {p} stayed: {one_down:?}"
            );
        }
        assert_eq!(returned[at].0, home(p), "partition {p} back: {returned:?}");
        if p % REPLICAS == 1 {
            assert_eq!(stalled[at].0, next(p), "partition {p} stalled: {stalled:?}");
            stall_moves.push(first_elsewhere(p, "r1", stopped_at));
        } else {
            assert_eq!(stalled[at].0, home(p), "partition {p} stayed: {stalled:?}");
        }
    }
    println!(
        "spread: the killed replica's partitions moved after {moves:?} s, the stopped one's after {stall_moves:?} s"
    );
    assert!(
        moves.iter().all(|m| *m <= MOVE_BOUND),
        "moves {moves:?} within {MOVE_BOUND} s"
    );
    assert!(
        stall_moves.iter().all(|m| *m <= STALL_BOUND),
        "moves {stall_moves:?} within {STALL_BOUND} s"
    );
    for (window, servers) in [("all up", &all_up), ("back", &returned)] {
        for r in 0..REPLICAS {
            let n = servers
                .iter()
                .filter(|(who, _)| *who == format!("r{r}"))
                .count();
            assert!(
                (3..=5).contains(&n),
                "{window}: r{r} serves {n} partitions: {servers:?}"
            );
        }
    }
    assert_eq!(env.markers(NAME).await, total + EXTRA as i64);
    each_once_in_order_then_clean(env, nats, total, VERSIONS, &dir).await;
}

/// `key_versions` holds `total` rows, each key's versions 1..=`versions` in order, and nothing
/// was dead-lettered; then the schema, the streams and `dir` are removed.
async fn each_once_in_order_then_clean(
    env: TestEnv,
    nats: NatsEnv,
    total: i64,
    versions: i64,
    dir: &std::path::Path,
) {
    let applied = env.scalar("SELECT count(*) FROM key_versions").await;
    assert_eq!(applied, total, "exactly once");
    assert_keys_in_order(&env, versions).await;
    assert!(
        nats.dead_letters().await.is_empty(),
        "nothing dead-lettered"
    );
    nats.cleanup().await;
    env.cleanup().await;
    let _ = std::fs::remove_dir_all(dir);
}
