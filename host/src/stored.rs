//! A stream's stored messages, read whatever a producer put in their header blocks.
//!
//! JetStream stores the header block a producer sent, bytes that are not UTF-8 included, and
//! async-nats's getters parse it and fail ("invalid header") — or, delivered, drop the
//! connection. Here the message API's JSON reply (header block and data in base64) is read as
//! it is and the block parsed leniently ([`lenient_headers`]). The advisory watcher's dead
//! letters, `idemhost dlq`, `idemhost markers prune`'s horizon check and the consumer samplers'
//! oldest unacknowledged message all read through it, so a producer's bytes stop none of them.

use anyhow::Context as _;
use async_nats::jetstream::{self, ErrorCode, response::Response, stream::RawMessage};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use base64::Engine as _;
use serde::Deserialize;

/// One stored message.
pub(crate) struct Stored {
    /// Its stream sequence.
    pub seq: u64,
    pub subject: String,
    /// When the server stored it, in nanoseconds since the Unix epoch.
    pub stored_at_ns: i128,
    /// Its headers, invalid bytes replaced (see [`lenient_headers`]).
    pub headers: HeaderMap,
    /// Whether the header block was clean: whether the client could have read it.
    pub readable: bool,
    pub payload: bytes::Bytes,
}

/// Which stored message to read.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Which<'a> {
    /// The one at this sequence.
    At(u64),
    /// The first on this subject (wildcards allowed) at or after this sequence.
    FirstFrom(&'a str, u64),
}

/// `$JS.API.STREAM.MSG.GET` reply.
#[derive(Deserialize)]
struct Get {
    message: RawMessage,
}

/// The message of `stream` that `which` names; `None` when there is none.
pub(crate) async fn get(
    js: &jetstream::Context,
    stream: &str,
    which: Which<'_>,
) -> anyhow::Result<Option<Stored>> {
    let request = match which {
        Which::At(seq) => serde_json::json!({ "seq": seq }),
        Which::FirstFrom(subject, seq) => {
            serde_json::json!({ "seq": seq, "next_by_subj": subject })
        }
    };
    let reply: Response<Get> = js
        .request(format!("STREAM.MSG.GET.{stream}"), &request)
        .await
        .with_context(|| format!("reading a message of stream {stream}"))?;
    let raw = match reply {
        Response::Ok(Get { message }) => message,
        Response::Err { error } if error.error_code() == ErrorCode::NO_MESSAGE_FOUND => {
            return Ok(None);
        }
        Response::Err { error } => {
            return Err(anyhow::anyhow!(
                "reading a message of stream {stream}: {error}"
            ));
        }
    };
    let b64 = base64::engine::general_purpose::STANDARD;
    let block = b64
        .decode(raw.headers.unwrap_or_default())
        .context("the server sent a header block that is not base64")?;
    let payload = b64
        .decode(raw.payload)
        .context("the server sent data that is not base64")?;
    let (headers, readable) = lenient_headers(&block);
    Ok(Some(Stored {
        seq: raw.sequence,
        subject: raw.subject,
        stored_at_ns: raw.time.unix_timestamp_nanos(),
        headers,
        readable,
        payload: payload.into(),
    }))
}

/// Parses a NATS header block (`NATS/1.0` status line, `Name: value` lines) without failing:
/// invalid UTF-8 is replaced, lines without a valid name are skipped. The flag says whether
/// the block was clean, i.e. whether the client could have read it.
pub(crate) fn lenient_headers(block: &[u8]) -> (HeaderMap, bool) {
    let text = String::from_utf8_lossy(block);
    let mut clean = std::str::from_utf8(block).is_ok();
    let mut fields: Vec<(String, String)> = Vec::new();
    for line in text.split("\r\n").skip(1) {
        if line.is_empty() {
            continue;
        }
        // A line starting with whitespace continues the previous value.
        if line.starts_with(char::is_whitespace)
            && let Some((_, value)) = fields.last_mut()
        {
            value.push_str(line);
            continue;
        }
        match line.split_once(':') {
            Some((name, value)) => fields.push((name.to_string(), value.to_string())),
            None => clean = false,
        }
    }
    let mut headers = HeaderMap::new();
    for (name, value) in fields {
        let name: Result<HeaderName, _> = name.parse();
        let value: Result<HeaderValue, _> = value.trim().parse();
        match (name, value) {
            (Ok(name), Ok(value)) => headers.append(name, value),
            _ => clean = false,
        }
    }
    (headers, clean)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lenient_headers_read_clean_and_broken_blocks() {
        let (h, clean) = lenient_headers(b"NATS/1.0\r\nNats-Msg-Id: evt-1\r\nA: b\r\nA: c\r\n\r\n");
        assert!(clean);
        assert_eq!(h.get("Nats-Msg-Id").map(|v| v.as_str()), Some("evt-1"));
        assert_eq!(h.get_all("A").count(), 2);

        let (h, clean) =
            lenient_headers(b"NATS/1.0\r\nNats-Msg-Id: evt-2\r\nX-Bin: \xff\xfe\r\n\r\n");
        assert!(!clean);
        assert_eq!(h.get("Nats-Msg-Id").map(|v| v.as_str()), Some("evt-2"));
        assert_eq!(h.get("X-Bin").map(|v| v.as_str()), Some("\u{fffd}\u{fffd}"));

        let (h, clean) = lenient_headers(b"NATS/1.0\r\nno colon here\r\n\r\n");
        assert!(!clean);
        assert_eq!(h.iter().count(), 0);
        assert_eq!(lenient_headers(b"").0.iter().count(), 0);
    }
}
