//! The values of a consumer's `event_type` label: bounded, because the event type is input.

use std::collections::HashSet;
use std::sync::Mutex;

/// The values one consumer's `event_type` label may take. The event type is input (a
/// producer's header, or the subject), and every distinct label value is a series kept for the
/// life of the process: only the configured values, or the first `max` distinct ones that
/// read well as a label (printable ASCII, at most [`MAX_LABEL_BYTES`]), are kept; the rest
/// count as [`OTHER_EVENT_TYPE`].
#[derive(Debug)]
pub struct EventTypeLabels {
    allowed: Option<HashSet<String>>,
    max: usize,
    seen: Mutex<HashSet<String>>,
}

/// The `event_type` label of every value past the bound.
pub(crate) const OTHER_EVENT_TYPE: &str = "other";
/// The longest `event_type` label value kept as itself.
pub(crate) const MAX_LABEL_BYTES: usize = 64;

impl EventTypeLabels {
    /// `allowed` non-empty: those values only; else the first `max` distinct values.
    pub fn new(allowed: &[String], max: usize) -> Self {
        EventTypeLabels {
            allowed: (!allowed.is_empty()).then(|| allowed.iter().cloned().collect()),
            max,
            seen: Mutex::new(HashSet::new()),
        }
    }

    /// The label values known before any delivery: the configured ones, else `other`.
    pub(super) fn known(&self) -> Vec<String> {
        match &self.allowed {
            Some(allowed) => {
                let mut known: Vec<String> = allowed.iter().cloned().collect();
                known.sort();
                known.push(OTHER_EVENT_TYPE.to_string());
                known
            }
            None => vec![OTHER_EVENT_TYPE.to_string()],
        }
    }

    /// The label value `event_type` counts under.
    pub fn label(&self, event_type: &str) -> String {
        let kept = match &self.allowed {
            Some(allowed) => allowed.contains(event_type),
            None => {
                let readable = event_type.len() <= MAX_LABEL_BYTES
                    && !event_type.is_empty()
                    && event_type
                        .bytes()
                        .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\');
                readable && {
                    let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
                    seen.contains(event_type)
                        || (seen.len() < self.max && seen.insert(event_type.to_string()))
                }
            }
        };
        if kept {
            event_type.to_string()
        } else {
            OTHER_EVENT_TYPE.to_string()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    /// 10,000 distinct event types from producers leave `/metrics` the size it has with the
    /// first 32 of them: the rest count under `other`.
    #[test]
    fn event_type_labels_from_input_are_bounded() {
        let metrics = Metrics::new();
        let consumer = metrics.for_consumer("c", EventTypeLabels::new(&[], 32));
        for i in 0..32 {
            consumer.started(1);
            consumer.settled(&format!("Type{i}"), "applied", None);
        }
        let bounded = metrics.render().len();
        for i in 0..10_000 {
            consumer.started(1);
            consumer.settled(&format!("Type{i}"), "applied", None);
        }
        consumer.started(1);
        consumer.settled("with \"quotes\"\nand lines", "applied", None);
        let text = metrics.render();
        assert!(
            text.len() < bounded + 200,
            "/metrics grew from {bounded} to {} bytes",
            text.len()
        );
        assert!(
            text.contains(r#"event_type="other",outcome="applied"} 9969"#),
            "{text}"
        );
        assert!(text.contains(r#"event_type="Type31",outcome="applied"} 2"#));
        assert!(!text.contains("Type32"));
    }

    #[test]
    fn configured_event_types_are_the_only_labels() {
        let metrics = Metrics::new();
        let allowed = ["OrderPlaced".to_string()];
        let consumer = metrics.for_consumer("c", EventTypeLabels::new(&allowed, 32));
        for t in ["OrderPlaced", "OrderCancelled", "OrderPlaced"] {
            consumer.started(1);
            consumer.settled(t, "applied", None);
        }
        let text = metrics.render();
        assert!(
            text.contains(r#"event_type="OrderPlaced",outcome="applied"} 2"#),
            "{text}"
        );
        assert!(text.contains(r#"event_type="other",outcome="applied"} 1"#));
        assert!(!text.contains("OrderCancelled"));
    }
}
