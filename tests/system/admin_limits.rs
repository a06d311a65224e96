//! The admin endpoint under abuse, through the binary: 200 connections that never finish their
//! request head and an unauthenticated 100 MiB upload leave the host's memory where it was and
//! do not delay `/readyz` for a legitimate caller; the token is checked before the body is read;
//! slow connections are closed at the head deadline; unknown paths and methods answer as HTTP
//! says.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::*;

const NAME: &str = "admin-v1";
const UPLOAD: usize = 100 << 20;

/// The resident set of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:").unwrap() << 10
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_and_unauthenticated_uploads_cost_nothing() {
    let env = TestEnv::new("admin_limits").await;
    let nats = NatsEnv::new("admin_limits", Duration::from_secs(60)).await;
    let admin = format!("127.0.0.1:{}", free_port());
    let text = config_text(&env, &nats, NAME, "testkit", "")
        + &format!(
            "\n[admin]\nlisten = \"{admin}\"\ntoken = \"s3cret\"\nrequest_timeout = \"5s\"\n"
        );
    let dir = std::env::temp_dir().join(unique("admin_limits"));
    std::fs::create_dir_all(&dir).unwrap();
    let (config, log) = (dir.join("idemhost.toml"), dir.join("host.log"));
    std::fs::write(&config, text).unwrap();
    let mut child = spawn_host(&config, None, &log);
    let pid = child.id();
    wait_ready(&admin, Duration::from_secs(60)).await;
    let readyz = format!("http://{admin}/readyz");
    for _ in 0..20 {
        idemhost::ops::admin::probe(&readyz, Duration::from_secs(5))
            .await
            .unwrap();
    }
    let before = rss(pid);

    // Samples the host's RSS until told to stop; the largest value seen.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let sampler = tokio::spawn(async move {
        let mut peak = 0;
        while !*stopped.borrow() {
            peak = peak.max(rss(pid));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        peak
    });

    // 200 connections that send part of a head and then nothing.
    let mut slow = Vec::new();
    for _ in 0..200 {
        let mut s = TcpStream::connect(&admin).await.unwrap();
        s.write_all(b"GET /readyz HTTP/1.1\r\nHost: admin\r\n")
            .await
            .unwrap();
        slow.push(s);
    }
    let opened = Instant::now();

    // An upload with a wrong token that sends its whole body without waiting for an answer.
    let upload = {
        let admin = admin.clone();
        tokio::spawn(async move {
            let s = TcpStream::connect(&admin).await.unwrap();
            let (mut read, mut write) = s.into_split();
            let writer = tokio::spawn(async move {
                let head = format!(
                    "POST /plugins?consumer={NAME} HTTP/1.1\r\nHost: admin\r\n\
                     Authorization: Bearer wrong\r\nContent-Length: {UPLOAD}\r\n\r\n"
                );
                write.write_all(head.as_bytes()).await.unwrap();
                let chunk = vec![0u8; 1 << 20];
                let mut sent = 0;
                while sent < UPLOAD {
                    match write.write_all(&chunk).await {
                        Ok(()) => sent += chunk.len(),
                        Err(_) => break,
                    }
                }
                sent
            });
            let mut answer = Vec::new();
            let _ =
                tokio::time::timeout(Duration::from_secs(30), read.read_to_end(&mut answer)).await;
            let sent = writer.await.unwrap();
            (String::from_utf8_lossy(&answer).to_string(), sent)
        })
    };

    // A legitimate caller meanwhile.
    let asked = Instant::now();
    idemhost::ops::admin::probe(&readyz, Duration::from_secs(2))
        .await
        .expect("/readyz answers while the endpoint is abused");
    let readyz_took = asked.elapsed();
    let (answer, sent) = upload.await.unwrap();
    let _ = stop.send(true);
    let peak = sampler.await.unwrap();
    let grew = peak.saturating_sub(before);
    println!(
        "admin: RSS {} MiB before, peak {} MiB with 200 slow connections and a {} MiB \
         unauthenticated upload ({} MiB of it sent before the host closed); /readyz in {:?}",
        before >> 20,
        peak >> 20,
        UPLOAD >> 20,
        sent >> 20,
        readyz_took
    );
    assert!(
        answer.starts_with("HTTP/1.1 401"),
        "the wrong token is refused: {answer:?}"
    );
    assert!(sent < UPLOAD, "the host stopped reading the refused body");
    assert!(grew < 8 << 20, "RSS grew by {} MiB", grew >> 20);

    // The slow connections are closed at the head deadline (5 s here).
    let mut first = slow.pop().unwrap();
    let mut buf = [0u8; 256];
    let closed = tokio::time::timeout(Duration::from_secs(15), first.read(&mut buf)).await;
    assert!(closed.is_ok(), "a connection without a full head is closed");
    assert!(opened.elapsed() < Duration::from_secs(15));
    drop(slow);

    // HTTP's answers: unknown path 404, a known path with another method 405 with Allow, the
    // right token reaches the deploy (an empty component is refused as one).
    let base = format!("http://{admin}");
    let http =
        |method: &'static str, path: &'static str, headers: Vec<(&'static str, &'static str)>| {
            let url = format!("{base}{path}");
            async move {
                idemhost::ops::admin::request(method, &url, &headers, b"", Duration::from_secs(5))
                    .await
                    .unwrap()
            }
        };
    assert_eq!(http("GET", "/nope", vec![]).await.status, 404);
    let mut raw = TcpStream::connect(&admin).await.unwrap();
    raw.write_all(b"DELETE /plugins HTTP/1.1\r\nHost: admin\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    raw.read_to_string(&mut answer).await.unwrap();
    let head = answer.to_ascii_lowercase();
    assert!(
        head.starts_with("http/1.1 405") && head.contains("allow: get,head,post"),
        "{answer}"
    );
    assert_eq!(http("DELETE", "/plugins", vec![]).await.status, 405);
    assert_eq!(http("GET", "/plugins/rollback", vec![]).await.status, 405);
    assert_eq!(
        http("POST", "/plugins?consumer=admin-v1", vec![])
            .await
            .status,
        401
    );
    let refused = http(
        "POST",
        "/plugins?consumer=admin-v1",
        vec![("Authorization", "Bearer s3cret")],
    )
    .await;
    assert_eq!(refused.status, 422, "{}", refused.body);
    let unknown = http(
        "POST",
        "/plugins?consumer=nobody",
        vec![("Authorization", "Bearer s3cret")],
    )
    .await;
    assert_eq!(unknown.status, 404, "{}", unknown.body);
    assert_eq!(http("GET", "/healthz", vec![]).await.status, 200);

    // SAFETY: kill(2) on this test's own child process.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    wait_exit(&mut child, Duration::from_secs(30)).await;
    std::fs::remove_dir_all(&dir).unwrap();
    nats.cleanup().await;
    env.cleanup().await;
}
