//! The admin endpoint (`[admin] listen`): `GET /healthz` answers while the process serves,
//! `GET /readyz` only once every consumer is bound and until shutdown begins. Plain HTTP/1.1,
//! one request per connection; anything else is 404.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info};

/// Longest request head read before answering.
const MAX_REQUEST_BYTES: usize = 8192;
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether the host is ready to consume (set by the host, read by `/readyz`).
#[derive(Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::SeqCst);
    }

    pub fn get(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// The running endpoint; dropping it stops serving (also when start-up fails later on).
pub struct AdminServer(tokio::task::JoinHandle<()>);

impl Drop for AdminServer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Binds `listen` (an error names the key) and serves until the returned value is dropped.
pub async fn serve(listen: &str, readiness: Readiness) -> anyhow::Result<AdminServer> {
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("failed to bind admin.listen {listen}"))?;
    info!(listen, "admin endpoint listening");
    Ok(AdminServer(tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    let readiness = readiness.clone();
                    tokio::spawn(async move {
                        if let Err(e) = answer(stream, &readiness).await {
                            debug!(error = %e, "admin request failed");
                        }
                    });
                }
                Err(e) => {
                    debug!(error = %e, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    })))
}

async fn answer(mut stream: TcpStream, readiness: &Readiness) -> std::io::Result<()> {
    let mut buf = vec![0u8; MAX_REQUEST_BYTES];
    let mut len = 0;
    // Read until the end of the request line (the only part we route on).
    while !buf[..len].contains(&b'\n') && len < buf.len() {
        match tokio::time::timeout(READ_TIMEOUT, stream.read(&mut buf[len..])).await {
            Ok(Ok(0)) | Err(_) => break,
            Ok(Ok(n)) => len += n,
            Ok(Err(e)) => return Err(e),
        }
    }
    let head = String::from_utf8_lossy(&buf[..len]);
    let mut parts = head.lines().next().unwrap_or("").split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, body) = match (method, path) {
        ("GET", "/healthz") => ("200 OK", "ok\n"),
        ("GET", "/readyz") if readiness.get() => ("200 OK", "ready\n"),
        ("GET", "/readyz") => ("503 Service Unavailable", "not ready\n"),
        _ => ("404 Not Found", "not found\n"),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}
