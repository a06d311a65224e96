//! Per-key ordering (opt-in per consumer, `ordering = { key = "…" }`): deliveries with the same
//! key run one at a time, in the order they arrived (stream order), while different keys run in
//! parallel up to `max_in_flight`. A delivery that fails retryably is retried *in place* — its
//! key stays blocked — until it succeeds or is dead-lettered; then the key moves on.
//!
//! A message waiting behind its key is not being handled: it gives its pull credit back (for
//! up to `ordering.max_waiting` messages per consumer), so a hot key does not stop the others
//! from being pulled, and the broker is told it is in progress every third of `ack_wait`, so it
//! is never redelivered — nor counted as an attempt, nor dead-lettered — for the time it waits.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use async_nats::jetstream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub(crate) use crate::config::KeySpec;

/// Reading a key from a message (the spec itself is configuration).
impl KeySpec {
    /// The key of a message; `None` when it has none (such messages are not ordered).
    pub fn key_of(&self, msg: &async_nats::Message) -> Option<String> {
        match self {
            KeySpec::Header(name) => {
                let v = msg
                    .headers
                    .as_ref()?
                    .get(name.as_str())?
                    .as_str()
                    .to_string();
                (!v.is_empty()).then_some(v)
            }
            KeySpec::SubjectToken(n) => msg.subject.as_str().split('.').nth(*n).map(str::to_string),
            KeySpec::JsonPointer(p) => {
                let v: serde_json::Value = serde_json::from_slice(&msg.payload).ok()?;
                match v.pointer(p)? {
                    serde_json::Value::String(s) => Some(s.clone()),
                    serde_json::Value::Number(n) => Some(n.to_string()),
                    _ => None,
                }
            }
        }
    }
}

/// A pulled message waiting for its key, with the permit it holds: its pull credit, or — once
/// it waits behind a running delivery of its key — a place in `max_waiting`.
pub(crate) type Queued = (jetstream::Message, OwnedSemaphorePermit);

/// The keys being worked on and what waits behind each.
#[derive(Default)]
pub(crate) struct KeyedQueues {
    keys: Mutex<HashMap<String, VecDeque<Queued>>>,
}

impl KeyedQueues {
    /// Queues `item` behind `key`'s running delivery, or — when the key is idle — marks it busy
    /// and gives the item back for the caller to start a worker with. A queued item trades its
    /// pull credit for a permit of `waiting` when one is free (else it keeps the credit, and
    /// pulling slows down until the queues shrink).
    pub(crate) fn enqueue(
        &self,
        key: &str,
        item: Queued,
        waiting: &Arc<Semaphore>,
    ) -> Option<Queued> {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        match keys.get_mut(key) {
            Some(queue) => {
                let (msg, credit) = item;
                let permit = match waiting.clone().try_acquire_owned() {
                    Ok(place) => {
                        drop(credit);
                        place
                    }
                    Err(_) => credit,
                };
                queue.push_back((msg, permit));
                None
            }
            None => {
                keys.insert(key.to_string(), VecDeque::new());
                Some(item)
            }
        }
    }

    /// The next item of `key`, or `None` after marking the key idle.
    pub(crate) fn next(&self, key: &str) -> Option<Queued> {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        let next = keys.get_mut(key).and_then(VecDeque::pop_front);
        if next.is_none() {
            keys.remove(key);
        }
        next
    }

    /// The reply subjects of every message waiting behind a running delivery of its key: where
    /// their in-progress acks go.
    pub(crate) fn waiting_replies(&self) -> Vec<async_nats::Subject> {
        let keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        keys.values()
            .flatten()
            .filter_map(|(msg, _)| msg.message.reply.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_specs_parse() {
        assert_eq!(
            KeySpec::parse("header:Idemhost-Ordering-Key"),
            Ok(KeySpec::Header("Idemhost-Ordering-Key".into()))
        );
        assert_eq!(KeySpec::parse("subject:2"), Ok(KeySpec::SubjectToken(2)));
        assert_eq!(
            KeySpec::parse("json:/orderId"),
            Ok(KeySpec::JsonPointer("/orderId".into()))
        );
        for bad in ["", "header:", "subject:x", "json:orderId", "payload:/x"] {
            assert!(KeySpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn keys_are_read_from_headers_subjects_and_payloads() {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("K", "k-7");
        let msg = async_nats::Message {
            subject: "orders.eu.o-9.placed".into(),
            reply: None,
            payload: br#"{"orderId":"o-9","n":4}"#.to_vec().into(),
            headers: Some(headers),
            status: None,
            description: None,
            length: 0,
        };
        assert_eq!(
            KeySpec::Header("K".into()).key_of(&msg).as_deref(),
            Some("k-7")
        );
        assert_eq!(KeySpec::Header("L".into()).key_of(&msg), None);
        assert_eq!(
            KeySpec::SubjectToken(2).key_of(&msg).as_deref(),
            Some("o-9")
        );
        assert_eq!(KeySpec::SubjectToken(9).key_of(&msg), None);
        assert_eq!(
            KeySpec::JsonPointer("/orderId".into())
                .key_of(&msg)
                .as_deref(),
            Some("o-9")
        );
        assert_eq!(
            KeySpec::JsonPointer("/n".into()).key_of(&msg).as_deref(),
            Some("4")
        );
        assert_eq!(KeySpec::JsonPointer("/x".into()).key_of(&msg), None);
    }
}
