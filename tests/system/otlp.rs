//! OTLP export (feature `otlp`): the binary, pointed at a collector by
//! `OTEL_EXPORTER_OTLP_ENDPOINT`, exports the delivery's span as a child of the message's W3C
//! `traceparent`. The collector is a minimal OTLP/HTTP endpoint in the test that records each
//! request body.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

/// (path, body) of each request the collector received.
type Requests = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// Accepts OTLP/HTTP requests on `listener`, answering 200, and keeps (path, body) of each.
fn collector(listener: TcpListener) -> Requests {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let keep = seen.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let keep = keep.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut conn = conn;
                loop {
                    let mut request_line = String::new();
                    if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
                        return;
                    }
                    let path = request_line.split(' ').nth(1).unwrap_or("").to_string();
                    let mut length = 0;
                    loop {
                        let mut line = String::new();
                        reader.read_line(&mut line).unwrap();
                        let line = line.trim_end();
                        if line.is_empty() {
                            break;
                        }
                        if let Some((k, v)) = line.split_once(':')
                            && k.eq_ignore_ascii_case("content-length")
                        {
                            length = v.trim().parse().unwrap();
                        }
                    }
                    let mut body = vec![0; length];
                    reader.read_exact(&mut body).unwrap();
                    keep.lock().unwrap().push((path, body));
                    let _ = conn.write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n",
                    );
                }
            });
        }
    });
    seen
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivery_span_continues_the_message_trace() {
    const NAME: &str = "otlp-v1";
    let env = TestEnv::new("otlp").await;
    let nats = NatsEnv::new("otlp", Duration::from_secs(60)).await;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let seen = collector(listener);
    let dir = std::env::temp_dir().join(unique("otlp"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("idemhost.toml");
    std::fs::write(&config, config_text(&env, &nats, NAME, "testkit", "")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemhost"))
        .args(["run", "--config", config.to_str().unwrap()])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .env("OTEL_BSP_SCHEDULE_DELAY", "200")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();

    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "traced-1");
    headers.insert(
        "traceparent",
        format!("00-{TRACE_ID}-{PARENT_ID}-01").as_str(),
    );
    nats.js
        .publish_with_headers(nats.subject(), headers, r#"{"steps":[]}"#.into())
        .await
        .unwrap()
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(60),
        "the traced message to apply",
        || async { (env.markers(NAME).await == 1).then_some(()) },
    )
    .await;
    // SIGTERM: a graceful stop flushes the exporter.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");

    let seen = seen.lock().unwrap().clone();
    let trace_id = hex(TRACE_ID);
    let parent = hex(PARENT_ID);
    let traced: Vec<_> = seen
        .iter()
        .filter(|(path, body)| {
            path == "/v1/traces"
                && contains(body, b"idemhost.delivery")
                && contains(body, &trace_id)
                && contains(body, &parent)
        })
        .collect();
    assert!(
        !traced.is_empty(),
        "no export of idemhost.delivery under trace {TRACE_ID} with parent {PARENT_ID}: {} requests to {:?}",
        seen.len(),
        seen.iter().map(|s| &s.0).collect::<Vec<_>>()
    );
    assert!(
        contains(&traced[0].1, b"traced-1"),
        "the message_id attribute"
    );
    nats.cleanup().await;
    env.cleanup().await;
}
