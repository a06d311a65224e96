//! The NATS side of a test: its private stream on the machine's (or the matrix's) server, and
//! publishing, including raw header blocks no client library would send.

use std::time::Duration;

use super::*;

/// Publishes one message with a raw header block (`Name: value` lines, any bytes) over a bare
/// NATS protocol connection to `host_port`: what a foreign or broken client can send, which
/// async-nats cannot build. Returns once the server answered the following PING.
pub async fn publish_raw(host_port: &str, subject: &str, header_lines: &[u8], payload: &[u8]) {
    let block = [b"NATS/1.0\r\n", header_lines, b"\r\n"].concat();
    publish_raw_block(host_port, subject, &block, payload).await
}

/// [`publish_raw`] of a whole header block, its first line included (`NATS/1.0 …`).
pub async fn publish_raw_block(host_port: &str, subject: &str, block: &[u8], payload: &[u8]) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let socket = tokio::net::TcpStream::connect(host_port).await.unwrap();
    let mut conn = BufReader::new(socket);
    let mut line = String::new();
    conn.read_line(&mut line).await.unwrap();
    assert!(line.starts_with("INFO"), "{line}");
    let mut out =
        b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"protocol\":1}\r\n"
            .to_vec();
    out.extend(
        format!(
            "HPUB {subject} {} {}\r\n",
            block.len(),
            block.len() + payload.len()
        )
        .as_bytes(),
    );
    out.extend(block);
    out.extend(payload);
    out.extend(b"\r\nPING\r\n");
    conn.get_mut().write_all(&out).await.unwrap();
    loop {
        line.clear();
        assert!(
            conn.read_line(&mut line).await.unwrap() > 0,
            "connection closed"
        );
        assert!(!line.starts_with("-ERR"), "{line}");
        if line.starts_with("PONG") {
            break;
        }
    }
}

/// A private stream `<STREAM>` capturing `<prefix>.>`; the dead-letter subject is
/// `<prefix>.dlq` in the same stream.
pub struct NatsEnv {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub stream: String,
    pub prefix: String,
}

impl NatsEnv {
    pub async fn new(tag: &str, duplicate_window: Duration) -> NatsEnv {
        Self::at(&NATS_URL, tag, duplicate_window).await
    }

    pub async fn at(url: &str, tag: &str, duplicate_window: Duration) -> NatsEnv {
        let prefix = unique(tag);
        let stream = prefix.to_uppercase();
        // As the host connects (credentials in the URL included).
        let nats = idemhost::config::NatsConfig {
            url: url.to_string(),
            ..Default::default()
        };
        let (client, js) = idemhost::ops::connect_nats(&nats)
            .await
            .expect("connect to test NATS");
        js.create_stream(stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window,
            ..Default::default()
        })
        .await
        .unwrap();
        NatsEnv {
            client,
            js,
            stream,
            prefix,
        }
    }

    pub fn subject(&self) -> String {
        format!("{}.orders.placed", self.prefix)
    }

    pub fn dlq(&self) -> String {
        format!("{}.dlq", self.prefix)
    }

    /// Publishes with the given message id (none: no id header) and waits for the stream.
    pub async fn publish(&self, id: Option<&str>, payload: &str) -> jetstream::publish::PublishAck {
        let mut headers = async_nats::HeaderMap::new();
        if let Some(id) = id {
            headers.insert("Nats-Msg-Id", id);
        }
        headers.insert("Idemhost-Event-Type", "OrderPlaced");
        self.js
            .publish_with_headers(
                self.subject(),
                headers,
                payload.to_string().into_bytes().into(),
            )
            .await
            .unwrap()
            .await
            .unwrap()
    }

    /// Publishes (headers, payload) pairs to [`Self::subject`], pipelined: up to 512 awaiting
    /// the stream's ack at a time.
    pub async fn publish_many(
        &self,
        messages: impl IntoIterator<Item = (async_nats::HeaderMap, String)>,
    ) {
        let subject = self.subject();
        self.publish_many_to(messages.into_iter().map(|(h, p)| (subject.clone(), h, p)))
            .await
    }

    /// [`Self::publish_many`] of (subject, headers, payload).
    pub async fn publish_many_to(
        &self,
        messages: impl IntoIterator<Item = (String, async_nats::HeaderMap, String)>,
    ) {
        let mut acks = Vec::new();
        for (subject, headers, payload) in messages {
            let ack = self
                .js
                .publish_with_headers(subject, headers, payload.into_bytes().into())
                .await
                .unwrap();
            acks.push(ack);
            if acks.len() >= 512 {
                for a in acks.drain(..) {
                    a.await.unwrap();
                }
            }
        }
        for a in acks {
            a.await.unwrap();
        }
    }

    pub async fn consumer_info(&self, durable: &str) -> jetstream::consumer::Info {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        stream.consumer_info(durable).await.unwrap()
    }

    /// Waits until the durable consumer has nothing pending and nothing unacknowledged.
    pub async fn wait_drained(
        &self,
        durable: &str,
        timeout: Duration,
    ) -> jetstream::consumer::Info {
        wait_until(timeout, &format!("consumer {durable} to drain"), || async {
            let stream = self.js.get_stream(&self.stream).await.ok()?;
            let info = stream.consumer_info(durable).await.ok()?;
            (info.num_pending == 0
                && info.num_ack_pending == 0
                && info.delivered.consumer_sequence > 0)
                .then_some(info)
        })
        .await
    }

    /// Every message on the dead-letter subject, as (headers, payload).
    pub async fn dead_letters(&self) -> Vec<(async_nats::HeaderMap, Vec<u8>)> {
        self.stored(&self.dlq()).await
    }

    /// Every message the stream holds on `subject`, as (headers, payload), in stream order,
    /// read without consuming (an ephemeral consumer without acks).
    pub async fn stored(&self, subject: &str) -> Vec<(async_nats::HeaderMap, Vec<u8>)> {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let consumer = stream
            .create_consumer(pull::Config {
                filter_subject: subject.to_string(),
                ack_policy: jetstream::consumer::AckPolicy::None,
                ..Default::default()
            })
            .await
            .unwrap();
        let mut out = Vec::new();
        let mut batch = consumer
            .fetch()
            .max_messages(100_000)
            .expires(Duration::from_millis(500))
            .messages()
            .await
            .unwrap();
        while let Some(Ok(m)) = batch.next().await {
            out.push((
                m.message.headers.clone().unwrap_or_default(),
                m.message.payload.to_vec(),
            ));
        }
        out
    }

    pub async fn cleanup(self) {
        let _ = self.js.delete_stream(&self.stream).await;
    }
}
