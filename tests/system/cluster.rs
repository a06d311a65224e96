//! A three-node JetStream cluster under faults, with two host replicas: the consumed stream
//! (which also holds the dead-letter subject) at R3, 20,000 events of which 10 % repeat an
//! earlier id under a new broker id. Midway the stream's leader is SIGKILLed and restarted, then
//! the new leader is paused (SIGSTOP) past the host's request timeout. Proven by SQL: every id
//! applied once (0 lost, 0 doubled, effects == markers), nothing dead-lettered, nothing left
//! pending. The hosts are given the cluster as a comma-separated `nats.url`.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common::*;

const CONSUMER: &str = "inventory-reservation-v1";
const EVENTS: usize = 20_000;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Publishes `(broker id, message id)` pairs, pipelined, retrying each until the stream stored
/// it (during a leader change publishes fail or time out; the broker id makes a retry safe).
async fn publish_all(
    js: &jetstream::Context,
    subject: &str,
    key: &str,
    events: &[(String, String)],
) {
    for chunk in events.chunks(256) {
        let mut pending: Vec<&(String, String)> = chunk.iter().collect();
        while !pending.is_empty() {
            let mut acks = Vec::new();
            for (broker_id, id) in &pending {
                let mut h = async_nats::HeaderMap::new();
                h.insert("Nats-Msg-Id", broker_id.as_str());
                replayed(&mut h, key, id);
                let sent = js
                    .publish_with_headers(
                        subject.to_string(),
                        h,
                        order_payload(id, "sku-1", 1).into(),
                    )
                    .await;
                acks.push(sent);
            }
            let mut failed = Vec::new();
            for (event, sent) in pending.into_iter().zip(acks) {
                let stored = match sent {
                    Ok(ack) => ack.await.is_ok(),
                    Err(_) => false,
                };
                if !stored {
                    failed.push(event);
                }
            }
            if !failed.is_empty() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            pending = failed;
        }
    }
}

/// The stream's leader, once the cluster names one.
async fn leader(js: &jetstream::Context, name: &str) -> String {
    wait_until(Duration::from_secs(30), "a stream leader", || async {
        let mut s = js.get_stream(name).await.ok()?;
        let info = s.info().await.ok()?;
        info.cluster.as_ref()?.leader.clone()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_losing_its_leader_and_pausing_a_node_loses_and_doubles_nothing() {
    let env = TestEnv::new("cluster").await;
    env.seed_inventory(&[("sku-1", 1_000_000)]).await;
    let mut cluster = PrivateCluster::start(3);
    let prefix = unique("cluster");
    let (stream_name, subject, dlq) = (
        prefix.to_uppercase(),
        format!("{prefix}.orders.placed"),
        format!("{prefix}.dlq"),
    );
    let client = async_nats::ConnectOptions::new()
        .connect(cluster.urls().split(',').collect::<Vec<_>>())
        .await
        .unwrap();
    let mut js = jetstream::new(client);
    js.set_timeout(Duration::from_secs(5));
    wait_until(Duration::from_secs(30), "an R3 stream", || async {
        js.create_stream(stream::Config {
            name: stream_name.clone(),
            subjects: vec![format!("{prefix}.>")],
            num_replicas: 3,
            duplicate_window: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .ok()
    })
    .await;

    // Two host replicas on one durable consumer, given all three servers.
    let dir = std::env::temp_dir().join(unique("cluster-hosts"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("idemhost.toml");
    std::fs::write(
        &config,
        format!(
            "[nats]\nurl = \"{}\"\nrequest_timeout = \"{}s\"\n{}\n[host]\nshutdown_timeout = \"10s\"\n\n\
             [[consumer]]\nname = \"{CONSUMER}\"\nstream = \"{stream_name}\"\nsubjects = [\"{subject}\"]\n\
             plugin = \"{}\"\ndead_letter_subject = \"{dlq}\"\ntables = [\"*\"]\nmax_in_flight = 8\nack_wait = \"10s\"\n",
            cluster.urls(),
            REQUEST_TIMEOUT.as_secs(),
            env.postgres_toml(),
            plugin_path("inventory").display(),
        ),
    )
    .unwrap();
    let mut hosts: Vec<_> = (0..2)
        .map(|i| spawn_host(&config, None, &dir.join(format!("host-{i}.log"))))
        .collect();

    // 20,000 events: 18,000 ids, 2,000 of them sent again under a new broker id.
    let mut rng = StdRng::seed_from_u64(21);
    let mut events: Vec<(String, String)> = Vec::with_capacity(EVENTS);
    for i in 0..EVENTS {
        if i > 100 && rng.random_bool(0.1) {
            let earlier = rng.random_range(0..i);
            let id = events[earlier].1.clone();
            events.push((format!("dup-{i}"), id));
        } else {
            let id = format!("evt-{i}");
            events.push((id.clone(), id));
        }
    }
    let unique_ids = events
        .iter()
        .map(|e| &e.1)
        .collect::<std::collections::HashSet<_>>()
        .len() as i64;
    let started = Instant::now();
    let publisher = {
        let (js, subject, events) = (js.clone(), subject.clone(), events.clone());
        let key = env.host_key().await;
        tokio::spawn(async move { publish_all(&js, &subject, &key, &events).await })
    };

    // Midway: the stream leader SIGKILLed, then restarted.
    wait_until(
        Duration::from_secs(120),
        "a third of the ids applied",
        || async { (env.markers(CONSUMER).await >= unique_ids / 3).then_some(()) },
    )
    .await;
    let first = leader(&js, &stream_name).await;
    let victim = cluster.index_of(&first);
    let before_kill = env.markers(CONSUMER).await;
    let killed = Instant::now();
    cluster.kill(victim);
    let recovered = wait_until(Duration::from_secs(60), "deliveries to resume", || async {
        (env.markers(CONSUMER).await >= before_kill + 200).then(|| killed.elapsed())
    })
    .await;
    cluster.start_node(victim);

    // Then the (new) leader paused past the hosts' request timeout.
    let second = leader(&js, &stream_name).await;
    let paused = cluster.index_of(&second);
    cluster.signal(paused, libc::SIGSTOP);
    tokio::time::sleep(REQUEST_TIMEOUT * 3).await;
    cluster.signal(paused, libc::SIGCONT);

    publisher.await.unwrap();
    wait_until(Duration::from_secs(180), "every id applied", || async {
        (env.markers(CONSUMER).await >= unique_ids).then_some(())
    })
    .await;
    let elapsed = started.elapsed();
    let drained = wait_until(
        Duration::from_secs(120),
        "the consumer to drain",
        || async {
            let s = js.get_stream(&stream_name).await.ok()?;
            let info = s.consumer_info(CONSUMER).await.ok()?;
            (info.num_pending == 0 && info.num_ack_pending == 0).then_some(info)
        },
    )
    .await;
    println!(
        "cluster: {EVENTS} events ({unique_ids} ids) through 2 replicas in {elapsed:.1?} \
         ({:.0} msg/s); leader {first} killed, deliveries resumed after {recovered:.1?}; \
         then {second} paused {:?}; {} deliveries by the broker",
        EVENTS as f64 / elapsed.as_secs_f64(),
        REQUEST_TIMEOUT * 3,
        drained.delivered.consumer_sequence
    );
    assert_eq!(env.markers(CONSUMER).await, unique_ids, "0 lost, 0 doubled");
    assert_eq!(
        env.reserved("sku-1").await,
        unique_ids,
        "effects == markers"
    );
    let letters = js
        .get_stream(&stream_name)
        .await
        .unwrap()
        .get_last_raw_message_by_subject(&dlq)
        .await;
    assert!(letters.is_err(), "nothing dead-lettered");

    for host in &hosts {
        // SAFETY: SIGTERM to our own child process.
        unsafe { libc::kill(host.id() as i32, libc::SIGTERM) };
    }
    for host in &mut hosts {
        wait_exit(host, Duration::from_secs(30)).await;
    }
    std::fs::remove_dir_all(&dir).unwrap();
    env.cleanup().await;
}
