//! The transactional outbox. A handler's `tx.publish(subject, headers, payload)` writes a row of
//! `outbox_message` in the delivery's own transaction ([`insert`]); the [`relay`] publishes
//! committed rows to JetStream and deletes them once the stream acknowledged. An event therefore
//! leaves exactly when the effect that caused it committed, and carries a deterministic broker
//! id — `<consumer>/<source message id>/<seq>` — so neither a redelivery of the source message
//! (its transaction either committed the rows once or rolled them back) nor a relay crash
//! between publish and delete (the same id again) makes a second event downstream.

pub mod relay;

use std::sync::Arc;

use crate::headers::{CAUSATION_HEADER, EVENT_TYPE_HEADER, ORDERING_KEY_HEADER};
use crate::pg::{Tx, Wall};
use crate::subjects::{check_subject, subject_matches};

/// Events one delivery may publish.
pub(crate) const MAX_EVENTS_PER_DELIVERY: u32 = 1000;
/// Largest event payload (NATS's default `max_payload`).
pub(crate) const MAX_PAYLOAD_BYTES: usize = 1 << 20;

const MAX_HEADERS: usize = 64;
const MAX_HEADER_NAME_BYTES: usize = 128;
const MAX_HEADER_VALUE_BYTES: usize = 4096;
/// Trace context headers copied from the source message unless the handler sets its own.
const PROPAGATED: [&str; 2] = ["traceparent", "tracestate"];

/// What an event published during one delivery derives from: the consumer and message it
/// belongs to, and the trace context headers of that message.
#[derive(Debug, Clone, Default)]
pub struct Origin {
    /// The consumer handling the message.
    pub consumer: String,
    /// The message's id.
    pub message_id: String,
    /// Its trace context headers.
    pub trace: Vec<(String, String)>,
    /// Subject patterns the handler may publish to (`consumer.publish_subjects`); empty:
    /// none.
    pub allowed_subjects: Arc<[String]>,
    /// The host's own inbox prefix (`nats.inbox_prefix`), never published to whatever the
    /// patterns allow: an event there would land in the host's pull and reply inboxes.
    pub host_inbox: Option<Arc<str>>,
}

impl Origin {
    /// The origin of events published while `consumer` handles a message with these headers.
    pub fn new(consumer: &str, message_id: &str, headers: &[(String, String)]) -> Self {
        Origin {
            consumer: consumer.to_string(),
            message_id: message_id.to_string(),
            trace: headers
                .iter()
                .filter(|(k, _)| PROPAGATED.iter().any(|p| p.eq_ignore_ascii_case(k)))
                .cloned()
                .collect(),
            allowed_subjects: Arc::from(Vec::new()),
            host_inbox: None,
        }
    }

    /// The same origin, for a handler allowed to publish to `patterns`.
    pub fn allowing(self, patterns: Arc<[String]>) -> Self {
        Origin {
            allowed_subjects: patterns,
            ..self
        }
    }

    /// The same origin, never publishing under the host's inbox prefix `prefix`.
    pub fn sparing_inbox(self, prefix: Arc<str>) -> Self {
        Origin {
            host_inbox: Some(prefix),
            ..self
        }
    }
}

/// The broker id of event `seq` of `origin`.
pub fn event_id(consumer: &str, source_message_id: &str, seq: i32) -> String {
    format!("{consumer}/{source_message_id}/{seq}")
}

/// Checks a handler's event and returns the headers it is published with: the handler's, plus
/// the causation id and the source's trace context (unless the handler set its own).
pub fn event_headers(
    origin: &Origin,
    subject: &str,
    headers: &[(String, String)],
    payload: &[u8],
) -> Result<Vec<(String, String)>, String> {
    check_subject(subject)?;
    if let Some(inbox) = &origin.host_inbox
        && subject
            .strip_prefix(&**inbox)
            .is_some_and(|rest| rest.starts_with('.'))
    {
        return Err(format!(
            "event subject {subject:?} is reserved: the host's own inbox (nats.inbox_prefix)"
        ));
    }
    if !origin
        .allowed_subjects
        .iter()
        .any(|p| subject_matches(p, subject))
    {
        return Err(format!(
            "subject {subject:?} is not one this consumer may publish to (consumer.publish_subjects: {:?})",
            origin.allowed_subjects
        ));
    }
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(format!(
            "event payload is {} bytes, over the {MAX_PAYLOAD_BYTES}-byte limit",
            payload.len()
        ));
    }
    if headers.len() > MAX_HEADERS {
        return Err(format!("at most {MAX_HEADERS} event headers"));
    }
    for (name, value) in headers {
        let token = |c: char| c.is_ascii_graphic() && c != ':';
        if name.is_empty() || name.len() > MAX_HEADER_NAME_BYTES || !name.chars().all(token) {
            return Err(format!("invalid event header name {name:?}"));
        }
        if value.len() > MAX_HEADER_VALUE_BYTES || value.chars().any(char::is_control) {
            return Err(format!("invalid value of event header {name}"));
        }
        let lower = name.to_ascii_lowercase();
        // `Nats-*` steer the broker (ids, expected stream or sequence, rollups, TTLs);
        // `Idemhost-*` are the host's (message id, causation, failure reason, replay audit),
        // except the two a producer sets for its consumers.
        let producer_header = EVENT_TYPE_HEADER.eq_ignore_ascii_case(name)
            || ORDERING_KEY_HEADER.eq_ignore_ascii_case(name);
        if lower.starts_with("nats-") || (lower.starts_with("idemhost-") && !producer_header) {
            return Err(format!(
                "event header {name} is set by the host (ids derive from the source message)"
            ));
        }
    }
    let mut out = headers.to_vec();
    out.push((CAUSATION_HEADER.to_string(), origin.message_id.clone()));
    for (name, value) in &origin.trace {
        if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(name)) {
            out.push((name.clone(), value.clone()));
        }
    }
    Ok(out)
}

/// Writes event `seq` of `origin` in `tx`, through the host's function (the plugin's role has
/// no right on `outbox_message`).
pub(crate) async fn insert(
    tx: &mut Tx,
    wall: &Wall,
    origin: &Origin,
    seq: u32,
    subject: &str,
    headers: &[(String, String)],
    payload: &[u8],
) -> Result<(), sqlx::Error> {
    // Unnamed, parsed with its execution in one batch: it runs while the plugin's code holds
    // the session, and a named (cached) statement could have been deallocated and prepared
    // again by the plugin as its own (the gate refuses both; behind it, the host key would run
    // through the plugin's SQL — found by review with the gate off).
    sqlx::query(sqlx::AssertSqlSafe(wall.outbox_sql.clone()))
        .persistent(false)
        .bind(&wall.key)
        .bind(&origin.consumer)
        .bind(&origin.message_id)
        .bind(seq as i32)
        .bind(subject)
        .bind(sqlx::types::Json(headers))
        .bind(payload)
        .execute(&mut **tx)
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn origin() -> Origin {
        let everything: Arc<[String]> = Arc::from(vec![">".to_string()]);
        Origin::new(
            "inventory-v1",
            "evt-1",
            &[
                ("Nats-Msg-Id".into(), "evt-1".into()),
                ("traceparent".into(), "00-ab-cd-01".into()),
            ],
        )
        .allowing(everything)
    }

    #[test]
    fn events_get_causation_and_trace_headers() {
        let h = event_headers(
            &origin(),
            "inventory.reserved",
            &[("A".into(), "b".into())],
            b"{}",
        )
        .unwrap();
        assert_eq!(
            h,
            vec![
                ("A".to_string(), "b".to_string()),
                (CAUSATION_HEADER.to_string(), "evt-1".to_string()),
                ("traceparent".to_string(), "00-ab-cd-01".to_string()),
            ]
        );
        let own = [("traceparent".to_string(), "00-ef-01-01".to_string())];
        let h = event_headers(&origin(), "x", &own, b"").unwrap();
        assert_eq!(h.iter().filter(|(k, _)| k == "traceparent").count(), 1);
        assert_eq!(event_id("inventory-v1", "evt-1", 2), "inventory-v1/evt-1/2");
    }

    #[test]
    fn bad_events_are_refused() {
        let o = origin();
        for subject in ["", "a.*", "a.>", "a..b", "a b", ".a"] {
            assert!(event_headers(&o, subject, &[], b"").is_err(), "{subject:?}");
        }
        for name in [
            "Nats-Msg-Id",
            "nats-expected-stream",
            "Idemhost-Message-Id",
            "Idemhost-Causation-Id",
            "Idemhost-Failure-Reason",
            "idemhost-replayed-from",
            "a:b",
            "",
        ] {
            let h = [(name.to_string(), "v".to_string())];
            assert!(event_headers(&o, "x", &h, b"").is_err(), "{name:?}");
        }
        let h = [("X".to_string(), "a\r\nb".to_string())];
        assert!(event_headers(&o, "x", &h, b"").is_err());
        assert!(event_headers(&o, "x", &[], &vec![0; MAX_PAYLOAD_BYTES + 1]).is_err());
    }

    #[test]
    fn only_allowed_subjects_are_published() {
        let o = origin();
        for subject in [
            "$JS.API.STREAM.DELETE.ORDERS",
            "$KV.plugins.inventory",
            "$O.store.x",
            "$SYS.REQ.SERVER.PING",
            "_INBOX.abc",
        ] {
            assert!(event_headers(&o, subject, &[], b"").is_err(), "{subject}");
        }
        let narrow = origin().allowing(Arc::from(vec![
            "orders.*".to_string(),
            "audit.>".to_string(),
        ]));
        assert!(event_headers(&narrow, "orders.placed", &[], b"").is_ok());
        assert!(event_headers(&narrow, "audit.a.b", &[], b"").is_ok());
        for subject in ["orders.placed.x", "orders", "audit", "payments.x"] {
            assert!(
                event_headers(&narrow, subject, &[], b"").is_err(),
                "{subject}"
            );
        }
        let none = Origin::new("c", "m", &[]);
        assert!(event_headers(&none, "orders.placed", &[], b"").is_err());
    }

    #[test]
    fn the_hosts_own_inbox_is_never_an_event_subject() {
        let everything: Arc<[String]> = Arc::from(vec![">".to_string()]);
        let origin = origin()
            .allowing(everything)
            .sparing_inbox(Arc::from("idemhost_inbox"));
        let event = |subject: &str| event_headers(&origin, subject, &[], b"{}");
        let refused = event("idemhost_inbox.abc.1").unwrap_err();
        assert!(refused.contains("the host's own inbox"), "{refused}");
        assert!(event("idemhost_inbox").is_ok());
        assert!(event("idemhost_inboxes.abc").is_ok());
        assert!(event("_INBOX.abc").is_err());
    }
}
