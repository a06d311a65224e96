//! The admin endpoint (`[admin] listen`): `GET /healthz` answers while the process serves,
//! `GET /readyz` only while every consumer is bound (plugins loaded), NATS is connected and
//! PostgreSQL answers, and not once shutdown began. `GET /plugins` lists each consumer's plugin
//! versions; `POST /plugins?consumer=NAME` (the component as the body) deploys one and `POST
//! /plugins/rollback?consumer=NAME` rolls back — both only with `Authorization: Bearer
//! <admin.token>`, and disabled when no token is configured. Plain HTTP/1.1 ([`http`]), one
//! request per connection; anything else is 404. [`probe`] is the client side of health checks
//! (`idemhost health`, for a container's HEALTHCHECK where there is no curl).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info};

use crate::config::AdminConfig;
use crate::metrics::Metrics;
use crate::registry::{DeployError, Registry};
use http::{ReadError, Request};

pub mod http;

/// How long `/readyz` waits for PostgreSQL to answer.
const PG_CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// Whether the host is ready to consume: the host sets it once every consumer is bound and
/// clears it at shutdown; `/readyz` also checks the live connections.
#[derive(Clone, Default)]
pub struct Readiness {
    bound: Arc<AtomicBool>,
    deps: Arc<OnceLock<(async_nats::Client, sqlx::PgPool)>>,
    /// The plugins `/plugins` lists and deploys swap, once loaded.
    registry: Arc<OnceLock<Arc<Registry>>>,
    /// What `/metrics` exposes.
    metrics: Arc<OnceLock<Arc<Metrics>>>,
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

    /// The plugin registry `/plugins` serves.
    pub fn set_registry(&self, registry: Arc<Registry>) {
        let _ = self.registry.set(registry);
    }

    /// The metrics `/metrics` exposes.
    pub fn set_metrics(&self, metrics: Arc<Metrics>) {
        let _ = self.metrics.set(metrics);
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

/// What the endpoint needs besides the live state: the deploy token and the upload limit.
#[derive(Clone)]
struct Settings {
    token: Option<Arc<str>>,
    max_upload: u64,
}

/// Binds `listen` (an error names the key) and serves until the returned value is dropped.
pub async fn serve(
    listen: &str,
    config: &AdminConfig,
    readiness: Readiness,
) -> anyhow::Result<AdminServer> {
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("failed to bind admin.listen {listen}"))?;
    let settings = Settings {
        token: config.token.as_deref().map(Arc::from),
        max_upload: config.max_upload.0,
    };
    info!(
        listen,
        deploys = settings.token.is_some(),
        "admin endpoint listening"
    );
    Ok(AdminServer(tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    let (readiness, settings) = (readiness.clone(), settings.clone());
                    tokio::spawn(async move {
                        if let Err(e) = answer(stream, &readiness, &settings).await {
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

type Answer = (&'static str, &'static str, Vec<u8>);

fn text(status: &'static str, body: impl Into<String>) -> Answer {
    let mut body = body.into();
    body.push('\n');
    (status, "text/plain", body.into_bytes())
}

async fn answer(
    mut stream: TcpStream,
    readiness: &Readiness,
    settings: &Settings,
) -> std::io::Result<()> {
    let (status, content_type, body) =
        match http::read_request(&mut stream, settings.max_upload).await {
            Err(ReadError::Gone) => return Ok(()),
            Err(ReadError::Bad(why)) => text("400 Bad Request", why),
            Err(ReadError::LengthRequired) => {
                text("411 Length Required", "send the body with a Content-Length")
            }
            Err(ReadError::TooLarge(max)) => text(
                "413 Content Too Large",
                format!("component over admin.max_upload ({max} bytes)"),
            ),
            Ok(request) => route(request, readiness, settings).await,
        };
    http::respond(&mut stream, status, content_type, &body).await
}

async fn route(request: Request, readiness: &Readiness, settings: &Settings) -> Answer {
    match (request.method.as_str(), request.path.as_str()) {
        ("GET", "/healthz") => text("200 OK", "ok"),
        ("GET", "/readyz") => match readiness.check().await {
            Ok(()) => text("200 OK", "ready"),
            Err(why) => text("503 Service Unavailable", format!("not ready: {why}")),
        },
        ("GET", "/metrics") => match readiness.metrics.get() {
            Some(metrics) => (
                "200 OK",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                metrics.render().into_bytes(),
            ),
            None => text("503 Service Unavailable", "metrics not set up yet"),
        },
        ("GET", "/plugins") => match readiness.registry.get() {
            Some(registry) => match serde_json::to_vec_pretty(&registry.report()) {
                Ok(json) => ("200 OK", "application/json", json),
                Err(e) => text("500 Internal Server Error", e.to_string()),
            },
            None => text("503 Service Unavailable", "plugins not loaded yet"),
        },
        ("POST", "/plugins") | ("POST", "/plugins/rollback") => {
            if let Err(refusal) = authorize(&request, settings) {
                return refusal;
            }
            let Some(registry) = readiness.registry.get() else {
                return text("503 Service Unavailable", "plugins not loaded yet");
            };
            let Some(consumer) = request.query("consumer").map(str::to_string) else {
                return text("400 Bad Request", "name the consumer: ?consumer=NAME");
            };
            let consumer = consumer.as_str();
            let result = if request.path == "/plugins" {
                let source = match request.header("idemhost-source") {
                    Some(label) => format!("api:{label}"),
                    None => "api".to_string(),
                };
                registry.deploy(consumer, request.body, source).await
            } else {
                registry.rollback(consumer).await
            };
            match result {
                Ok(d) => {
                    let json = serde_json::json!({
                        "consumer": consumer,
                        "digest": d.version.digest,
                        "replaced": d.replaced,
                        "changed": d.changed,
                        "validation_ms": d.version.validation.as_secs_f64() * 1e3,
                    });
                    ("200 OK", "application/json", json.to_string().into_bytes())
                }
                Err(e) => {
                    let status = match e {
                        DeployError::UnknownConsumer(_) => "404 Not Found",
                        DeployError::Native(_) | DeployError::NoPrevious(_) => "409 Conflict",
                        DeployError::Refused { .. } => "422 Unprocessable Content",
                    };
                    text(status, e.to_string())
                }
            }
        }
        _ => text("404 Not Found", "not found"),
    }
}

/// Mutating requests need `Authorization: Bearer <admin.token>`; without a configured token
/// they are disabled.
fn authorize(request: &Request, settings: &Settings) -> Result<(), Answer> {
    let Some(token) = &settings.token else {
        return Err(text(
            "403 Forbidden",
            "plugin deploys are disabled: no admin.token configured (IDEMHOST_ADMIN__TOKEN)",
        ));
    };
    let offered = request
        .header("authorization")
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if constant_time_eq(offered.as_bytes(), token.as_bytes()) {
        Ok(())
    } else {
        Err(text("401 Unauthorized", "missing or wrong admin token"))
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// GETs `url` (`http://host:port/path`) and succeeds on a 200 within `timeout`; otherwise the
/// error says what happened.
pub async fn probe(url: &str, timeout: Duration) -> Result<(), String> {
    http::request_ok("GET", url, &[], &[], timeout)
        .await
        .map(drop)
}
