//! Property tests of reading a delivery's headers: the id rules, the header-safe reason, the
//! W3C trace context and the lenient header-block parser never panic and keep their promises.

use async_nats::HeaderMap;
use proptest::prelude::*;

use crate::config::MAX_MESSAGE_ID_BYTES;
use crate::headers::{header_safe, message_id, traceparent};
use crate::stored::lenient_headers;

/// Header values the client accepts: no CR or LF.
fn header_value() -> impl Strategy<Value = String> {
    "[^\r\n]{0,300}"
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// An id is accepted exactly when it is non-blank and at most the limit, and is then the
    /// header's value unchanged: never trimmed, shortened or invented.
    #[test]
    fn message_id_accepts_exactly_the_valid_ids(value in header_value()) {
        let mut h = HeaderMap::new();
        h.insert("Nats-Msg-Id", value.as_str());
        let stored = h.get("Nats-Msg-Id").map(|v| v.as_str().to_string()).unwrap_or_default();
        let valid = !stored.trim().is_empty() && stored.len() <= MAX_MESSAGE_ID_BYTES;
        match message_id(&h, "Nats-Msg-Id", None) {
            Ok(id) => {
                prop_assert!(valid);
                prop_assert_eq!(id, stored);
            }
            Err(reason) => {
                prop_assert!(!valid, "refused a valid id: {}", reason);
                prop_assert!(reason.contains("Nats-Msg-Id"));
            }
        }
    }

    /// A reason put in a header is one line, bounded, and a prefix of the reason with control
    /// characters blanked.
    #[test]
    fn header_safe_reasons_are_one_bounded_line(reason in any::<String>()) {
        let safe = header_safe(&reason);
        prop_assert!(safe.len() <= 1024);
        prop_assert!(!safe.chars().any(char::is_control));
        let blanked: String = reason.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
        prop_assert!(blanked.starts_with(&safe));
    }

    /// Any traceparent text: an answer, never a panic; a well-formed one is read back.
    #[test]
    fn traceparent_is_total_and_reads_valid_ones(
        junk in header_value(),
        trace in "[0-9a-f]{32}",
        parent in "[0-9a-f]{16}",
    ) {
        let mut h = HeaderMap::new();
        h.insert("traceparent", junk.as_str());
        let _ = traceparent(&h);
        h.insert("traceparent", format!("00-{trace}-{parent}-01").as_str());
        let zero = |s: &str| s.bytes().all(|b| b == b'0');
        let expected = (!zero(&trace) && !zero(&parent)).then(|| (trace.clone(), parent.clone()));
        prop_assert_eq!(traceparent(&h), expected);
    }

    /// Any bytes at all as a header block: an answer, never a panic.
    #[test]
    fn lenient_headers_never_panic(block in prop::collection::vec(any::<u8>(), 0..400)) {
        let _ = lenient_headers(&block);
    }

    /// A well-formed block reads back as clean, with every value in order.
    #[test]
    fn lenient_headers_read_well_formed_blocks_back(
        fields in prop::collection::vec(("[A-Za-z][A-Za-z0-9-]{0,15}", "[!-~]([ -~]{0,30}[!-~])?"), 0..6),
    ) {
        let mut block = b"NATS/1.0\r\n".to_vec();
        for (name, value) in &fields {
            block.extend(format!("{name}: {value}\r\n").as_bytes());
        }
        block.extend(b"\r\n");
        let (headers, clean) = lenient_headers(&block);
        prop_assert!(clean);
        for (name, value) in &fields {
            let values: Vec<String> = headers.get_all(name.as_str()).map(|v| v.as_str().to_string()).collect();
            prop_assert!(values.contains(value), "{}: {:?} not in {:?}", name, value, values);
        }
    }
}
