//! The admin endpoint (`[admin] listen`): `GET /healthz` answers while the process serves,
//! `GET /readyz` only while every consumer is bound (plugins loaded), NATS is connected and
//! PostgreSQL answers, and not once shutdown began. Plain HTTP/1.1, one request per
//! connection; anything else is 404. [`probe`] is the client side (`idemhost health`, for a
//! container's HEALTHCHECK where there is no curl).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info};

/// Longest request head read before answering.
const MAX_REQUEST_BYTES: usize = 8192;
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// How long `/readyz` waits for PostgreSQL to answer.
const PG_CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// Whether the host is ready to consume: the host sets it once every consumer is bound and
/// clears it at shutdown; `/readyz` also checks the live connections.
#[derive(Clone, Default)]
pub struct Readiness {
    bound: Arc<AtomicBool>,
    deps: Arc<OnceLock<(async_nats::Client, sqlx::PgPool)>>,
}

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.bound.store(ready, Ordering::SeqCst);
    }

    pub fn get(&self) -> bool {
        self.bound.load(Ordering::SeqCst)
    }

    /// The connections `/readyz` checks on every request.
    pub fn watch(&self, nats: async_nats::Client, pool: sqlx::PgPool) {
        let _ = self.deps.set((nats, pool));
    }

    /// `Ok` when ready, else why not.
    pub async fn check(&self) -> Result<(), &'static str> {
        if !self.get() {
            return Err("consumers not bound (starting or stopping)");
        }
        let Some((nats, pool)) = self.deps.get() else {
            return Err("connections not established");
        };
        if nats.connection_state() != async_nats::connection::State::Connected {
            return Err("NATS disconnected");
        }
        // Every pooled connection busy with a delivery is proof enough that PostgreSQL
        // answers; otherwise ask it, briefly.
        if pool.num_idle() == 0 && pool.size() >= pool.options().get_max_connections() {
            return Ok(());
        }
        let ping = async {
            let mut conn = pool.acquire().await?;
            sqlx::query("SELECT 1").execute(&mut *conn).await
        };
        match tokio::time::timeout(PG_CHECK_TIMEOUT, ping).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err("PostgreSQL does not answer"),
        }
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
        ("GET", "/healthz") => ("200 OK", "ok\n".to_string()),
        ("GET", "/readyz") => match readiness.check().await {
            Ok(()) => ("200 OK", "ready\n".to_string()),
            Err(why) => ("503 Service Unavailable", format!("not ready: {why}\n")),
        },
        _ => ("404 Not Found", "not found\n".to_string()),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

/// GETs `url` (`http://host:port/path`) and succeeds on a 200 within `timeout`; otherwise the
/// error says what happened.
pub async fn probe(url: &str, timeout: Duration) -> Result<(), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url}: only http:// URLs are probed"))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let exchange = async {
        let mut stream = TcpStream::connect(authority)
            .await
            .map_err(|e| format!("cannot connect to {authority}: {e}"))?;
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("cannot send to {authority}: {e}"))?;
        let mut response = Vec::new();
        stream
            .take(MAX_REQUEST_BYTES as u64)
            .read_to_end(&mut response)
            .await
            .map_err(|e| format!("cannot read from {authority}: {e}"))?;
        let text = String::from_utf8_lossy(&response);
        let status = text.lines().next().unwrap_or("").to_string();
        let body = text
            .split("\r\n\r\n")
            .nth(1)
            .unwrap_or("")
            .trim()
            .to_string();
        if status.split_whitespace().nth(1) == Some("200") {
            Ok(())
        } else {
            Err(format!("{url}: {status}: {body}"))
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("{url}: no answer within {timeout:?}"))?
}
