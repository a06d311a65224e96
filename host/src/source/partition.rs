//! Partitions (`partitions = N`): per-key order across replicas on NATS's own primitives.
//!
//! The stream's messages carry their partition, `0..N`, as the last token of their subject (a
//! subject transform with `{{partition(N, …)}}` over the key's tokens puts it there). Each
//! partition has its durable, and each durable a `pinned_client` priority group: the server
//! delivers a partition's messages to one pull client at a time — the pinned one — and keeps the
//! others on standby until the pinned one stops pulling for the durable's `priority_timeout`.
//! Every replica pulls every partition; each partition is served by one of them.
//!
//! Order of a key: each partition's durable has `max_ack_pending = 1`, so the server hands out
//! a partition's next message only once the one before is acked — or, when its holder died,
//! redelivers that one first. That holds across a move of the pin too: the server moves a pin
//! as soon as its holder is gone, but nothing newer can reach the new holder while the old
//! holder's message is still unacked. A stalled old holder that wakes up and commits late
//! cannot run ahead of the new one either: the marker's row lock makes the later claim of the
//! same message wait, then see a duplicate. Concurrency is one delivery per partition: choose
//! `partitions` for the parallelism wanted (every replica binds all of them).
//!
//! The pull requests ([`super::pulling`]) carry the group and the pin id this replica was given,
//! by which the server recognizes it as the same client.
//!
//! **Spread** (`host.replica` and `host.replicas` set, NATS 2.12+): pinning gives every
//! partition to the first replica that pulls it, so the others stand by. With the replicas
//! numbered, the durables use the `prioritized` policy instead: every replica pulls every
//! partition, each at the priority its number has for that partition ([`Spread::priority`]),
//! and the server hands a partition's next message to the waiting pull of the best priority.
//! So each replica serves its own share (priority 0) while it pulls; when it stops pulling
//! (dead: its pulls go with its connection; stalled: they expire), its partitions' next
//! messages go to the replica ranked next, a different one for each of its partitions; when it
//! pulls again, they come back at the next message. Order holds as above: `max_ack_pending = 1`
//! still lets one message of a partition out at a time, whoever pulls it. A numbered replica
//! turns a pinned durable prioritized; a replica without a number leaves a prioritized durable
//! as it is and pulls it at the best priority (so a rolling change of the keys never has
//! replicas turning the durable back and forth); going back to pinning is an edit of the
//! durables once no replica has a number (docs/scaling.md).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PriorityPolicy, consumer::pull};

use crate::config::ConsumerConfig;

/// The priority group every replica pulls in.
pub const GROUP: &str = "idemhost";

/// The server version partitions need (priority groups with `pinned_client`).
const NEEDS: (u64, u64) = (2, 11);

/// Whether the server behind `client` is at least `wanted` (major, minor): `Err` carries the
/// version it is.
pub fn server_at_least(client: &async_nats::Client, wanted: (u64, u64)) -> Result<(), String> {
    let version = client.server_info().version;
    let mut parts = version
        .trim_start_matches('v')
        .split(['.', '-'])
        .map(|p| p.parse::<u64>().unwrap_or(0));
    let found = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if found < wanted { Err(version) } else { Ok(()) }
}

/// Whether the server behind `client` has priority groups; `Err` says what to do otherwise.
pub fn check_server(client: &async_nats::Client, consumer: &str) -> anyhow::Result<()> {
    server_at_least(client, NEEDS).map_err(|version| {
        anyhow::anyhow!(
            "consumer {consumer}: `partitions` needs a NATS server 2.11 or newer (priority groups \
             with pinned_client); this one is {version}. Without it, per-key order holds within \
             one replica only (`ordering`)"
        )
    })
}

/// The server version spreading partitions needs (the `prioritized` priority policy).
const SPREAD_NEEDS: (u64, u64) = (2, 12);

/// This replica's place among the replicas (`host.replica` of `host.replicas`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spread {
    /// This replica's number, `0..replicas`.
    pub replica: u32,
    /// How many replicas there are.
    pub replicas: u32,
}

impl Spread {
    /// The spread `host.replica` and `host.replicas` describe, when both are set.
    pub fn of(host: &crate::config::HostConfig) -> Option<Spread> {
        Some(Spread {
            replica: host.replica?,
            replicas: host.replicas?,
        })
    }

    /// The priority (0 best, 9 worst: the server's range) at which this replica pulls
    /// partition `p`: its rank in the partition's order of replicas. Partition `p` belongs to
    /// replica `p mod R` first; the others follow in an order rotated by `p div R`, so that a
    /// replica's partitions each fall back to a different replica and a dead replica's share
    /// is spread over the survivors rather than doubling one of them. Ranks past 9 share 9.
    /// (A number past the count, which the config's validation refuses but an embedder's
    /// `Config` may hold, counts modulo it.)
    pub fn priority(&self, p: u32) -> u8 {
        let r = self.replicas.max(1);
        let (home, me) = (p % r, self.replica % r);
        if me == home {
            return 0;
        }
        let others = r - 1;
        // The position of this replica among the others, counting from the one after home.
        let after_home = (me + r - home) % r - 1;
        let rotation = (p / r) % others;
        let rank = 1 + (after_home + others - rotation) % others;
        rank.min(9) as u8
    }
}

/// Whether the server behind `client` can spread partitions; `Err` says what to do otherwise.
pub fn check_spread(client: &async_nats::Client, consumer: &str) -> anyhow::Result<()> {
    server_at_least(client, SPREAD_NEEDS).map_err(|version| {
        anyhow::anyhow!(
            "consumer {consumer}: spreading `partitions` over replicas (`host.replica` and \
             `host.replicas`) needs a NATS server 2.12 or newer (the prioritized priority \
             policy); this one is {version}. Without both keys, each partition is pinned to \
             the first replica that pulls it"
        )
    })
}

/// How long a partition's pin outlives its holder's last pull: past a pull request's expiry,
/// so a live holder between two requests keeps it.
pub fn pin_timeout(pull_expires: Duration) -> Duration {
    pull_expires + Duration::from_secs(5)
}

/// The durable of partition `p`.
pub fn durable(config: &ConsumerConfig, p: u32) -> String {
    config.partition_durable(p)
}

/// Makes `pull_config` the durable of partition `p`: its filter, its priority group — pinned,
/// or `prioritized` (spread).
pub fn configure(
    pull_config: &mut pull::Config,
    config: &ConsumerConfig,
    p: u32,
    pull_expires: Duration,
    prioritized: bool,
) {
    pull_config.filter_subject = format!("{}.{p}", config.subjects[0]);
    pull_config.filter_subjects = Vec::new();
    pull_config.priority_groups = vec![GROUP.to_string()];
    if prioritized {
        pull_config.priority_policy = PriorityPolicy::Prioritized;
        pull_config.priority_timeout = Duration::ZERO;
    } else {
        pull_config.priority_policy = PriorityPolicy::PinnedClient;
        pull_config.priority_timeout = pin_timeout(pull_expires);
    }
    pull_config.max_ack_pending = 1;
}

/// The stream's subject transform that appends the partition to `subject`: each `*` kept, and
/// `{{partition(N, …)}}` over all of them.
pub fn transform(subject: &str, partitions: u32) -> jetstream::stream::SubjectTransform {
    let mut wildcard = 0;
    let kept: Vec<String> = subject
        .split('.')
        .map(|t| {
            if t == "*" {
                wildcard += 1;
                format!("{{{{wildcard({wildcard})}}}}")
            } else {
                t.to_string()
            }
        })
        .collect();
    let all: Vec<String> = (1..=wildcard).map(|i| i.to_string()).collect();
    jetstream::stream::SubjectTransform {
        source: subject.to_string(),
        destination: format!(
            "{}.{{{{partition({partitions},{})}}}}",
            kept.join("."),
            all.join(",")
        ),
    }
}

/// This replica's pin on one partition: the id the server gave it, sent with each pull — or,
/// spread, the priority this replica pulls the partition at (no pin then).
#[derive(Clone)]
pub struct Pin {
    partition: u32,
    consumer: String,
    id: Arc<Mutex<Option<String>>>,
    priority: Option<u8>,
}

impl Pin {
    /// The pin of `config`'s partition `partition`, holding no message yet; on a `prioritized`
    /// durable, the priority this replica pulls it at (its rank with a `spread`, else the
    /// best).
    pub fn new(
        config: &ConsumerConfig,
        partition: u32,
        prioritized: bool,
        spread: Option<Spread>,
    ) -> Pin {
        Pin {
            partition,
            consumer: config.name.clone(),
            id: Arc::default(),
            priority: prioritized.then(|| spread.map_or(0, |s| s.priority(partition))),
        }
    }

    /// With a spread: the priority this replica's pulls of the partition carry.
    pub(super) fn priority(&self) -> Option<u8> {
        self.priority
    }

    fn id(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.id.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn current(&self) -> Option<String> {
        self.id().clone()
    }

    /// This replica got a message of the partition while it had no pin: the server pinned it.
    /// The id is taken from the consumer's info, the server's own answer, not from the
    /// message's `Nats-Pin-Id` header: a producer decides the header block, and can make the
    /// server's line unreadable (a block ending without its blank line folds the appended line
    /// into the producer's last header) or put its own before it.
    pub(super) async fn adopt(&self, js: &jetstream::Context, stream: &str, durable: &str) {
        if self.priority.is_some() || self.current().is_some() {
            return;
        }
        let info = match js.get_stream_no_info(stream).await {
            Ok(s) => s.consumer_info(durable).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let pinned = match info {
            Ok(info) => info
                .priority_groups
                .into_iter()
                .find(|g| g.group == GROUP)
                .and_then(|g| g.pinned_client_id),
            Err(e) => {
                tracing::warn!(consumer = %self.consumer, partition = self.partition, error = %e,
                    "could not read the partition's pin");
                None
            }
        };
        if let Some(id) = pinned {
            tracing::info!(consumer = %self.consumer, partition = self.partition, pin = %id,
                "partition pinned to this replica");
            *self.id() = Some(id);
        }
    }

    /// The server no longer knows this pin (423): another replica has the partition now.
    pub(super) fn lost(&self) {
        if let Some(id) = self.id().take() {
            tracing::info!(consumer = %self.consumer, partition = self.partition, pin = %id,
                "partition unpinned from this replica");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every partition has one replica at each rank; each replica's own share is about P/R;
    /// a replica's partitions fall back to the others evenly.
    #[test]
    fn the_spread_ranks_every_replica_once_per_partition_and_balances_the_fallback() {
        for replicas in 1..=12u32 {
            for partitions in [1u32, 2, 3, 7, 12, 16, 64] {
                let rank = |replica, p| Spread { replica, replicas }.priority(p);
                let mut home = vec![0u32; replicas as usize];
                for p in 0..partitions {
                    let mut ranks: Vec<u8> = (0..replicas).map(|r| rank(r, p)).collect();
                    let first = ranks.iter().position(|r| *r == 0).unwrap();
                    home[first] += 1;
                    ranks.sort_unstable();
                    let want: Vec<u8> = (0..replicas).map(|i| i.min(9) as u8).collect();
                    assert_eq!(ranks, want, "R={replicas} p={p}");
                }
                let (lo, hi) = (partitions / replicas, partitions.div_ceil(replicas));
                assert!(home.iter().all(|h| (lo..=hi).contains(h)), "{home:?}");
                // The second choices of each replica's own partitions.
                if replicas > 1 && partitions >= replicas * (replicas - 1) {
                    for dead in 0..replicas {
                        let mut takes = vec![0u32; replicas as usize];
                        for p in (0..partitions).filter(|p| p % replicas == dead) {
                            let next = (0..replicas).find(|r| rank(*r, p) == 1).unwrap();
                            takes[next as usize] += 1;
                        }
                        let alive: Vec<u32> = (0..replicas)
                            .filter(|r| *r != dead)
                            .map(|r| takes[r as usize])
                            .collect();
                        let (min, max) = (alive.iter().min(), alive.iter().max());
                        assert!(max.unwrap() - min.unwrap() <= 1, "R={replicas} {takes:?}");
                    }
                }
            }
        }
        // A number past the count (an embedder's unvalidated config) is taken modulo it.
        for p in 0..12 {
            let past = Spread {
                replica: 4,
                replicas: 3,
            }
            .priority(p);
            assert_eq!(
                past,
                Spread {
                    replica: 1,
                    replicas: 3
                }
                .priority(p)
            );
        }
        // R = 3, P = 12: replica 0 owns 0, 3, 6, 9; they fall back to 1, 2, 1, 2.
        let second = |p| {
            (0..3).find(|r| {
                Spread {
                    replica: *r,
                    replicas: 3,
                }
                .priority(p)
                    == 1
            })
        };
        let fallback: Vec<_> = [0, 3, 6, 9].into_iter().map(second).collect();
        assert_eq!(fallback, [Some(1), Some(2), Some(1), Some(2)]);
    }

    #[test]
    fn the_transform_keeps_every_token_and_partitions_on_all_wildcards() {
        let t = transform("orders.*.placed.*", 8);
        assert_eq!(t.source, "orders.*.placed.*");
        assert_eq!(
            t.destination,
            "orders.{{wildcard(1)}}.placed.{{wildcard(2)}}.{{partition(8,1,2)}}"
        );
    }
}
