//! The outbox's header gate judged against the NATS server itself. A plugin names the headers
//! of the events it publishes; the host refuses the ones that steer the broker (`Nats-*`:
//! de-duplication ids, expected stream and sequences, rollups, TTLs) and the host's own
//! (`Idemhost-*`: the message id a downstream consumer claims under, causation, failure
//! reasons). Names are generated from the corners a hand-written check misreads — case
//! scrambled, `_` for `-`, prefixes and suffixes, whitespace, look-alike letters, a `:` — each
//! with a value that would show its effect, and every one the gate accepts is published twice
//! exactly as the outbox relay publishes it. What the server did must be what the gate judged:
//! both publishes stored, neither a duplicate nor refused, nothing purged, and the stored event
//! carrying the relay's id and no `Idemhost-Message-Id` a downstream consumer would read. The
//! detector is checked first on the real spellings, sent past the gate.
//!
//!   scripts/test.sh --test system header_gate_vs_nats::

use std::sync::Arc;

use crate::common::*;
use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use idemhost::test_support::{Origin, event_headers, event_id};

/// Headers NATS 2.9 acts on, each with a value that shows its effect when it is acted on.
const BROKER: [(&str, &str); 6] = [
    ("Nats-Msg-Id", "forged-id"),
    ("Nats-Expected-Stream", "NO_SUCH_STREAM"),
    ("Nats-Expected-Last-Msg-Id", "no-such-id"),
    ("Nats-Expected-Last-Sequence", "999999"),
    ("Nats-Expected-Last-Subject-Sequence", "999999"),
    ("Nats-Rollup", "sub"),
];

/// Headers of newer servers (2.11+) and the host's own, generated from too.
const OTHERS: [(&str, &str); 6] = [
    ("Nats-TTL", "1s"),
    ("Nats-Marker-Reason", "Purge"),
    ("Idemhost-Message-Id", "forged-id"),
    ("Idemhost-Causation-Id", "forged"),
    ("Idemhost-Failure-Reason", "forged"),
    ("Idemhost-Replayed-From", "forged/1"),
];

/// A small deterministic generator (the cases are the same every run).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// Spellings of `name` a check could miss.
fn variants(name: &str, rng: &mut Lcg) -> Vec<String> {
    let mut out = vec![
        name.to_string(),
        name.to_lowercase(),
        name.to_uppercase(),
        name.replace('-', "_"),
        name.replace('-', ""),
        name.replace('-', "."),
        format!("X-{name}"),
        format!("{name}-X"),
        format!(" {name}"),
        format!("{name} "),
        format!("{name}\t"),
        format!("{name}:"),
        name.replacen('-', ":", 1),
        // Look-alike letters: Cyrillic а and е, Greek Ν.
        name.replace('a', "\u{430}"),
        name.replace('e', "\u{435}"),
        name.replacen('N', "\u{39d}", 1),
        format!("{name}\u{200b}"),
    ];
    for _ in 0..8 {
        out.push(
            name.chars()
                .map(|c| {
                    if rng.next().is_multiple_of(2) {
                        c.to_ascii_uppercase()
                    } else {
                        c.to_ascii_lowercase()
                    }
                })
                .collect(),
        );
    }
    out.sort();
    out.dedup();
    out
}

/// The event headers as the relay sends them: the row's, then its own `Nats-Msg-Id`.
fn as_relayed(headers: &[(String, String)], relay_id: &str) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (k, v) in headers {
        map.append(k.as_str(), v.as_str());
    }
    map.insert("Nats-Msg-Id", relay_id);
    map
}

/// What the server did with two publishes of `headers` on `subject` beyond storing two plain
/// messages; `None` when it did nothing else.
async fn effect(
    js: &jetstream::Context,
    stream_name: &str,
    subject: &str,
    headers: &[(String, String)],
    ids: [&str; 2],
) -> Option<String> {
    let mut stream = js.get_stream(stream_name).await.unwrap();
    let before = stream.info().await.unwrap().state.messages;
    let mut sequences = Vec::new();
    for id in ids {
        let sent = js
            .publish_with_headers(subject.to_string(), as_relayed(headers, id), "{}".into())
            .await;
        let ack = match sent {
            Ok(ack) => ack.await,
            Err(e) => return Some(format!("publish refused: {e}")),
        };
        match ack {
            Ok(ack) if ack.duplicate => return Some("stored as a duplicate".into()),
            Ok(ack) => sequences.push(ack.sequence),
            Err(e) => return Some(format!("publish refused: {e}")),
        }
    }
    let after = stream.info().await.unwrap().state.messages;
    if after != before + 2 {
        return Some(format!(
            "{before} messages, then {after} after two publishes"
        ));
    }
    for (seq, id) in sequences.into_iter().zip(ids) {
        let stored = stream.get_raw_message(seq).await.unwrap();
        let got = |name: &str| stored.headers.get(name).map(|v| v.as_str().to_string());
        if got("Nats-Msg-Id").as_deref() != Some(id) {
            return Some(format!("stored with Nats-Msg-Id {:?}", got("Nats-Msg-Id")));
        }
        if let Some(forged) = got("Idemhost-Message-Id") {
            return Some(format!("stored with Idemhost-Message-Id {forged:?}"));
        }
    }
    None
}

#[tokio::test]
async fn the_header_gate_refuses_whatever_the_server_acts_on() {
    let client = async_nats::connect(&*NATS_URL).await.unwrap();
    let js = jetstream::new(client);
    let prefix = unique("hdrgate");
    let stream_name = prefix.to_uppercase();
    js.create_stream(stream::Config {
        name: stream_name.clone(),
        subjects: vec![format!("{prefix}.>")],
        allow_rollup: true,
        ..Default::default()
    })
    .await
    .unwrap();

    // The detector sees each broker header's effect when the real spelling reaches the server.
    for (i, (name, value)) in BROKER.iter().enumerate() {
        let subject = format!("{prefix}.control.{i}");
        // Something to roll up or to expect past.
        js.publish(subject.clone(), "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
        let headers = [(name.to_string(), value.to_string())];
        // `Nats-Msg-Id` is the relay's own: it replaces a plugin's copy, so its effect is
        // shown with the same id twice.
        let ids: [&str; 2] = if *name == "Nats-Msg-Id" {
            [value, value]
        } else {
            ["control-a", "control-b"]
        };
        let seen = effect(&js, &stream_name, &subject, &headers, ids).await;
        assert!(
            seen.is_some(),
            "{name}: {value} had no effect the test could see"
        );
    }

    let origin = Origin::new("hdrgate-v1", "source-1", &[])
        .allowing(Arc::from(vec![format!("{prefix}.events.*")]));
    let mut rng = Lcg(0x1d3_4057);
    let (mut accepted, mut refused, mut escapes) = (0, 0, Vec::new());
    for (name, value) in BROKER.iter().chain(&OTHERS) {
        for variant in variants(name, &mut rng) {
            let case = accepted + refused;
            let subject = format!("{prefix}.events.{case}");
            let asked = [(variant.clone(), value.to_string())];
            let Ok(headers) = event_headers(&origin, &subject, &asked, b"{}") else {
                refused += 1;
                continue;
            };
            accepted += 1;
            let ids = [0, 1].map(|seq| event_id("hdrgate-v1", &format!("case-{case}"), seq));
            if let Some(what) =
                effect(&js, &stream_name, &subject, &headers, [&ids[0], &ids[1]]).await
            {
                escapes.push(format!("{variant:?}: {value:?} -> {what}"));
            }
        }
    }
    eprintln!("header gate vs NATS: {accepted} spellings accepted, {refused} refused");
    assert!(
        escapes.is_empty(),
        "the gate accepted headers the server acted on:\n{}",
        escapes.join("\n")
    );
    assert!(
        refused > 0 && accepted > 0,
        "{accepted} accepted, {refused} refused"
    );
    let _ = js.delete_stream(&stream_name).await;
}
