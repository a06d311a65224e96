//! Versioned events for the per-key order tests, and the check of their order by SQL.

use super::*;

/// Versioned events of `keys` keys × `versions` versions, shuffled across keys but in order
/// within each key, with about a fifth of them delivered a second time after themselves or an
/// earlier version (under a fresh broker id, so the marker must decide), and about one in
/// twenty failing its first attempt retryably when `failing`. Each is (key, headers, testkit
/// script inserting `(key, version)` into `key_versions`); the headers carry the ids and
/// `Idemhost-Ordering-Key`. Returns them with the number of duplicates and failing ones.
/// `host_key` signs the second deliveries' replayed ids (see [`replayed`]).
pub fn versioned_events(
    host_key: &str,
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
                    replayed(&mut h, host_key, &msg_id);
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
