//! Every header name idemhost reads or writes, and the readers of a delivery's headers: its
//! message id, the W3C trace context it continues, and header-safe failure reasons for dead
//! letters. The names are public interface: producers, replay scripts and dashboards use them.

use async_nats::HeaderMap;

use crate::config::MAX_MESSAGE_ID_BYTES;

/// The broker's own de-duplication id, and the message id a consumer reads by default
/// (`consumers.id_header`).
pub const NATS_MSG_ID_HEADER: &str = "Nats-Msg-Id";
/// Header read before the configured id header: set by dead-letter replays, which must carry
/// the original id while publishing under a fresh broker-level id. Honoured only with a valid
/// [`REPLAY_SIGNATURE_HEADER`]: a producer cannot choose which marker its message claims.
pub const REPLAY_ID_HEADER: &str = "Idemhost-Message-Id";
/// A replay's proof that the host's own `dlq replay` set [`REPLAY_ID_HEADER`]: HMAC-SHA256,
/// keyed with the schema's host key (which no plugin or producer can read), of the id and the
/// [`REPLAYED_FROM_HEADER`] value, in hex.
pub const REPLAY_SIGNATURE_HEADER: &str = "Idemhost-Replay-Signature";
/// Header naming the event type (else the subject is used).
pub const EVENT_TYPE_HEADER: &str = "Idemhost-Event-Type";
/// The header a producer conventionally puts a per-key ordering key in (`ordering.key =
/// "header:Idemhost-Ordering-Key"`); a plugin may set it on the events it publishes.
pub const ORDERING_KEY_HEADER: &str = "Idemhost-Ordering-Key";
/// A dead letter's failure reason (one line, at most 1 KiB).
pub const FAILURE_REASON_HEADER: &str = "Idemhost-Failure-Reason";
/// A dead letter's SQLSTATE: PostgreSQL's code for the statement whose failure dead-lettered
/// it (`23505`, `22P02`, …); absent when the failure did not come from the server (the
/// handler's own error, a refusal, out of deliveries without one).
pub const FAILURE_SQLSTATE_HEADER: &str = "Idemhost-Failure-Sqlstate";
/// The consumer that dead-lettered the message.
pub const FAILED_CONSUMER_HEADER: &str = "Idemhost-Consumer";
/// The subject the dead-lettered message was published to.
pub const ORIGINAL_SUBJECT_HEADER: &str = "Idemhost-Original-Subject";
/// How many times the broker had delivered the message when it was dead-lettered.
pub const DELIVERY_ATTEMPT_HEADER: &str = "Idemhost-Delivery-Attempt";
/// Header of a replayed message naming the dead letter it came from (`<stream>/<seq>`).
pub const REPLAYED_FROM_HEADER: &str = "Idemhost-Replayed-From";
/// Header of a repair replay naming the original message id.
pub const REPAIR_OF_HEADER: &str = "Idemhost-Repair-Of";
/// Header of an outbox event naming the message whose handling published it.
pub const CAUSATION_HEADER: &str = "Idemhost-Causation-Id";

/// The headers a dead letter carries in the host's word (its id, why, where from, which
/// attempt). Dropped from the producer's copy before the host writes its own: a producer's
/// `Idemhost-Message-Id` on a message dead-lettered without a valid id would otherwise stay,
/// and `idemhost dlq replay` would sign a replay of the producer's payload under that id.
pub(crate) const DEAD_LETTER_HEADERS: [&str; 7] = [
    NATS_MSG_ID_HEADER,
    REPLAY_ID_HEADER,
    FAILURE_REASON_HEADER,
    FAILURE_SQLSTATE_HEADER,
    FAILED_CONSUMER_HEADER,
    ORIGINAL_SUBJECT_HEADER,
    DELIVERY_ATTEMPT_HEADER,
];

/// `headers` without any value of the `names` (compared ignoring ASCII case).
pub(crate) fn without(headers: &HeaderMap, names: &[&str]) -> HeaderMap {
    let mut kept = HeaderMap::new();
    for (name, values) in headers.iter() {
        let name_text: &str = name.as_ref();
        if names.iter().any(|n| n.eq_ignore_ascii_case(name_text)) {
            continue;
        }
        for value in values {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

/// Longest failure reason put in a header.
const MAX_REASON_BYTES: usize = 1024;

/// The first value of header `name`, if present.
pub(crate) fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers.get(name).map(|v| v.as_str().to_string())
}

/// The signature of a replay of message `id` from dead letter `from` (see
/// [`REPLAY_SIGNATURE_HEADER`]), under `key`, the schema's host key (`SELECT key FROM
/// idemhost_key`, readable by the host's role only). `idemhost dlq replay` signs with it; a
/// tool of the operator's that republishes messages for the marker to decide may too.
pub fn replay_signature(key: &str, id: &str, from: &str) -> String {
    use sha2::{Digest, Sha256};
    // HMAC (RFC 2104) over SHA-256; the key is shorter than the 64-byte block, else hashed.
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key.as_bytes()));
    } else {
        block[..key.len()].copy_from_slice(key.as_bytes());
    }
    let pad = |byte: u8| block.map(|b| b ^ byte);
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(b"idemhost-replay\0")
        .chain_update(id.as_bytes())
        .chain_update(b"\0")
        .chain_update(from.as_bytes())
        .finalize();
    let outer = Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize();
    outer.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `headers` carry a replay id the host itself signed with `key`.
fn signed_replay(headers: &HeaderMap, key: Option<&str>) -> Option<String> {
    let key = key?;
    let id = header(headers, REPLAY_ID_HEADER)?;
    let from = header(headers, REPLAYED_FROM_HEADER)?;
    let given = header(headers, REPLAY_SIGNATURE_HEADER)?;
    let expected = replay_signature(key, &id, &from);
    // Compared without an early exit.
    let same = given.len() == expected.len()
        && given
            .bytes()
            .zip(expected.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    same.then_some(id)
}

/// The delivery's message id: `Idemhost-Message-Id` if the host's own replay signed it (with
/// `replay_key`, the schema's host key), else `id_header`. Missing, empty and over-long ids
/// are refused (terminal): an id is never invented.
pub(crate) fn message_id(
    headers: &HeaderMap,
    id_header: &str,
    replay_key: Option<&str>,
) -> Result<String, String> {
    let (name, value) = match signed_replay(headers, replay_key) {
        Some(v) => (REPLAY_ID_HEADER, v),
        None => match header(headers, id_header) {
            Some(v) => (id_header, v),
            None => return Err(format!("missing message id header {id_header}")),
        },
    };
    if value.trim().is_empty() {
        return Err(format!("empty message id in header {name}"));
    }
    if value.len() > MAX_MESSAGE_ID_BYTES {
        return Err(format!(
            "message id in header {name} is {} bytes, over the {MAX_MESSAGE_ID_BYTES}-byte limit",
            value.len()
        ));
    }
    Ok(value)
}

pub(crate) fn flatten(headers: &HeaderMap) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (name, values) in headers.iter() {
        for v in values {
            out.push((name.to_string(), v.as_str().to_string()));
        }
    }
    out.sort();
    out
}

/// A reason fit for a header value: one line, bounded length.
pub(crate) fn header_safe(reason: &str) -> String {
    let mut s: String = reason
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    s.truncate(s.floor_char_boundary(MAX_REASON_BYTES));
    s
}

/// The trace id and parent span id of a W3C `traceparent` header
/// (`00-<32 hex>-<16 hex>-<2 hex>`); `None` when it is absent or malformed (all-zero ids are
/// invalid, and version `ff` is forbidden).
pub(crate) fn traceparent(headers: &HeaderMap) -> Option<(String, String)> {
    let value = header(headers, "traceparent")?;
    let mut parts = value.trim().split('-');
    let (version, trace, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let valid = hex(version, 2)
        && version != "ff"
        && (version != "00" || parts.next().is_none())
        && hex(trace, 32)
        && hex(parent, 16)
        && hex(flags, 2)
        && trace.bytes().any(|b| b != b'0')
        && parent.bytes().any(|b| b != b'0');
    valid.then(|| (trace.to_string(), parent.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_id_prefers_a_signed_replay_id_and_refuses_bad_ids() {
        let mut h = HeaderMap::new();
        assert!(
            message_id(&h, "Nats-Msg-Id", None)
                .unwrap_err()
                .contains("missing")
        );
        h.insert("Nats-Msg-Id", "");
        assert!(
            message_id(&h, "Nats-Msg-Id", None)
                .unwrap_err()
                .contains("empty")
        );
        h.insert("Nats-Msg-Id", "x".repeat(257).as_str());
        assert!(
            message_id(&h, "Nats-Msg-Id", None)
                .unwrap_err()
                .contains("257 bytes")
        );
        h.insert("Nats-Msg-Id", "x".repeat(256).as_str());
        assert_eq!(message_id(&h, "Nats-Msg-Id", None).unwrap().len(), 256);
        h.insert("Nats-Msg-Id", "evt-1");
        h.insert(REPLAY_ID_HEADER, "evt-7");
        h.insert(REPLAYED_FROM_HEADER, "DLQ/3");
        // A replay id is honoured only when the host's key signed it, for that dead letter.
        assert_eq!(message_id(&h, "Nats-Msg-Id", None).unwrap(), "evt-1");
        assert_eq!(message_id(&h, "Nats-Msg-Id", Some("k")).unwrap(), "evt-1");
        let good = replay_signature("k", "evt-7", "DLQ/3");
        for forged in [
            String::new(),
            "0".repeat(64),
            replay_signature("other key", "evt-7", "DLQ/3"),
            replay_signature("k", "evt-7", "DLQ/4"),
            replay_signature("k", "evt-8", "DLQ/3"),
            good[..63].to_string(),
            good.to_uppercase(),
            format!("{good}0"),
        ] {
            h.insert(REPLAY_SIGNATURE_HEADER, forged.as_str());
            assert_eq!(
                message_id(&h, "Nats-Msg-Id", Some("k")).unwrap(),
                "evt-1",
                "{forged}"
            );
        }
        h.insert(REPLAY_SIGNATURE_HEADER, good.as_str());
        assert_eq!(message_id(&h, "Nats-Msg-Id", Some("k")).unwrap(), "evt-7");
        assert_eq!(message_id(&h, "Nats-Msg-Id", None).unwrap(), "evt-1");
    }

    #[test]
    fn traceparent_is_parsed_strictly() {
        let mut h = HeaderMap::new();
        assert_eq!(traceparent(&h), None);
        h.insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        );
        assert_eq!(
            traceparent(&h),
            Some((
                "4bf92f3577b34da6a3ce929d0e0e4736".into(),
                "00f067aa0ba902b7".into()
            ))
        );
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "garbage",
        ] {
            h.insert("traceparent", bad);
            assert_eq!(traceparent(&h), None, "{bad}");
        }
    }

    #[test]
    fn reasons_are_header_safe() {
        assert_eq!(header_safe("a\nb\r\nc"), "a b  c");
        assert_eq!(header_safe(&"é".repeat(1000)).len(), 1024);
    }
}
