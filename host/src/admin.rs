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
use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tracing::{debug, info};

use crate::config::AdminConfig;
use crate::metrics::Metrics;
use crate::registry::{DeployError, Plugins};

pub mod http;

/// How long `/readyz` waits for PostgreSQL to answer.
const PG_CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// Whether the host is ready to consume: the host sets it once every consumer is bound and
/// clears it at shutdown; `/readyz` also checks the live connections.
#[derive(Clone, Default)]
pub(crate) struct Readiness {
    bound: Arc<AtomicBool>,
    deps: Arc<OnceLock<(async_nats::Client, sqlx::PgPool)>>,
    /// The plugins `/plugins` lists and deploys swap, once loaded.
    registry: Arc<OnceLock<Arc<Plugins>>>,
    /// What `/metrics` exposes.
    metrics: Arc<OnceLock<Arc<Metrics>>>,
}

impl Readiness {
    pub(crate) fn set(&self, ready: bool) {
        self.bound.store(ready, Ordering::SeqCst);
    }

    pub(crate) fn get(&self) -> bool {
        self.bound.load(Ordering::SeqCst)
    }

    /// The connections `/readyz` checks on every request.
    pub(crate) fn watch(&self, nats: async_nats::Client, pool: sqlx::PgPool) {
        let _ = self.deps.set((nats, pool));
    }

    /// The plugin registry `/plugins` serves.
    pub(crate) fn set_registry(&self, registry: Arc<Plugins>) {
        let _ = self.registry.set(registry);
    }

    /// The metrics `/metrics` exposes.
    pub(crate) fn set_metrics(&self, metrics: Arc<Metrics>) {
        let _ = self.metrics.set(metrics);
    }

    /// `Ok` when ready, else why not.
    pub(crate) async fn check(&self) -> Result<(), &'static str> {
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
pub(crate) struct AdminServer(tokio::task::JoinHandle<()>);

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

/// The live state and the settings, as the handlers see them.
#[derive(Clone)]
struct AppState {
    readiness: Readiness,
    settings: Settings,
}

/// The longest a request head may take to arrive (or `admin.request_timeout`, if shorter).
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest request head hyper buffers.
const MAX_HEAD_BYTES: usize = 16 << 10;

/// Binds `listen` (an error names the key) and serves until the returned value is dropped.
///
/// axum on hyper's HTTP/1.1 server: at most `admin.max_connections` connections at once (more
/// wait in the kernel's backlog, not in memory), each for one request whose head must arrive
/// within [`HEAD_TIMEOUT`] and whose whole exchange must end within `admin.request_timeout`.
/// A deploy's token is checked before any byte of its body is read (a client that sent
/// `Expect: 100-continue` is answered without being asked for the body); the body is read only
/// up to `admin.max_upload`. Unknown paths answer 404, known paths with another method 405 with
/// `Allow`.
pub(crate) async fn serve(
    listen: &str,
    config: &AdminConfig,
    readiness: Readiness,
) -> anyhow::Result<AdminServer> {
    let settings = Settings {
        token: config.token.as_deref().map(Arc::from),
        max_upload: config.max_upload.0,
    };
    let deploys = settings.token.is_some();
    let app = router(AppState {
        readiness,
        settings,
    });
    let server = serve_router("admin.listen", listen, config, app).await?;
    info!(listen, deploys, "admin endpoint listening");
    Ok(server)
}

/// The metrics listener's bounds: a scrape or a probe is answered in milliseconds, so a client
/// that holds a connection longer is cut sooner than on the admin endpoint (whose deploys
/// upload and compile), and fewer such clients are served at once.
const METRICS_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const METRICS_MAX_CONNECTIONS: u32 = 32;

/// Binds `[metrics] listen`: `GET /metrics`, `/healthz` and `/readyz` only (no deploys, no
/// plugin list), so Prometheus and an orchestrator's probes need no access to the admin
/// endpoint. At most [`METRICS_MAX_CONNECTIONS`], each within [`METRICS_REQUEST_TIMEOUT`] (or
/// the admin endpoint's limits, if smaller).
pub(crate) async fn serve_metrics(
    listen: &str,
    config: &AdminConfig,
    readiness: Readiness,
) -> anyhow::Result<AdminServer> {
    let mut limits = config.clone();
    limits.request_timeout.0 = limits.request_timeout.0.min(METRICS_REQUEST_TIMEOUT);
    limits.max_connections = limits.max_connections.min(METRICS_MAX_CONNECTIONS);
    let app = Router::new()
        .route("/healthz", get(|| async { text(StatusCode::OK, "ok") }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(|| async { text(StatusCode::NOT_FOUND, "not found") })
        .with_state(AppState {
            readiness,
            settings: Settings {
                token: None,
                max_upload: 0,
            },
        });
    let server = serve_router("metrics.listen", listen, &limits, app).await?;
    info!(listen, "metrics endpoint listening");
    Ok(server)
}

/// Binds `listen` (an error names `key`) and serves `app` on it until dropped.
async fn serve_router(
    key: &str,
    listen: &str,
    config: &AdminConfig,
    app: Router,
) -> anyhow::Result<AdminServer> {
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("failed to bind {key} {listen}"))?;
    let deadline = config.request_timeout.0;
    let connections = Arc::new(Semaphore::new(config.max_connections.max(1) as usize));
    Ok(AdminServer(tokio::spawn(async move {
        loop {
            let Ok(permit) = connections.clone().acquire_owned().await else {
                return;
            };
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    debug!(error = %e, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let service = hyper_util::service::TowerToHyperService::new(app.clone());
            tokio::spawn(async move {
                let mut http1 = hyper::server::conn::http1::Builder::new();
                http1
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(HEAD_TIMEOUT.min(deadline))
                    .max_buf_size(MAX_HEAD_BYTES)
                    .keep_alive(false);
                let connection =
                    http1.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                match tokio::time::timeout(deadline, connection).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => debug!(error = %e, "admin connection ended"),
                    Err(_) => debug!(
                        ?deadline,
                        "admin connection past admin.request_timeout; closed"
                    ),
                }
                drop(permit);
            });
        }
    })))
}

fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { text(StatusCode::OK, "ok") }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/plugins", get(list_plugins).post(deploy))
        .route("/plugins/rollback", post(rollback))
        .fallback(|| async { text(StatusCode::NOT_FOUND, "not found") })
        .with_state(state)
}

fn text(status: StatusCode, body: impl Into<String>) -> Response {
    let mut body = body.into();
    body.push('\n');
    (status, [(header::CONTENT_TYPE, "text/plain")], body).into_response()
}

fn json(value: &impl serde::Serialize) -> Response {
    match serde_json::to_vec_pretty(value) {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

async fn readyz(State(app): State<AppState>) -> Response {
    match app.readiness.check().await {
        Ok(()) => text(StatusCode::OK, "ready"),
        Err(why) => text(StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}")),
    }
}

async fn metrics(State(app): State<AppState>) -> Response {
    match app.readiness.metrics.get() {
        Some(metrics) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            metrics.render(),
        )
            .into_response(),
        None => text(StatusCode::SERVICE_UNAVAILABLE, "metrics not set up yet"),
    }
}

async fn list_plugins(State(app): State<AppState>) -> Response {
    match app.readiness.registry.get() {
        Some(registry) => json(&registry.report()),
        None => text(StatusCode::SERVICE_UNAVAILABLE, "plugins not loaded yet"),
    }
}

/// `?consumer=NAME`
#[derive(serde::Deserialize)]
struct Target {
    consumer: Option<String>,
}

/// `POST /plugins?consumer=NAME`: the token is checked, and the consumer looked up, from the
/// head alone; only then is the body read, up to `admin.max_upload`.
async fn deploy(
    State(app): State<AppState>,
    Query(target): Query<Target>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (registry, consumer) = match authorized(&app, &headers, target) {
        Ok(found) => found,
        Err((status, why)) => return text(status, why),
    };
    let max = app.settings.max_upload;
    let too_large = || {
        text(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("component over admin.max_upload ({max} bytes)"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max) {
        return too_large();
    }
    let body = match axum::body::to_bytes(body, usize::try_from(max).unwrap_or(usize::MAX)).await {
        Ok(body) => body,
        Err(_) => return too_large(),
    };
    let source = match headers.get("idemhost-source").and_then(|v| v.to_str().ok()) {
        Some(label) => format!("api:{label}"),
        None => "api".to_string(),
    };
    deployed(
        &consumer,
        registry.deploy(&consumer, body.to_vec(), source).await,
    )
}

/// `POST /plugins/rollback?consumer=NAME`.
async fn rollback(
    State(app): State<AppState>,
    Query(target): Query<Target>,
    headers: HeaderMap,
) -> Response {
    match authorized(&app, &headers, target) {
        Ok((registry, consumer)) => deployed(&consumer, registry.rollback(&consumer).await),
        Err((status, why)) => text(status, why),
    }
}

/// Why a mutating request is refused before its body is read.
type Refusal = (StatusCode, &'static str);

/// The registry and the consumer a mutating request names, once its token is right.
fn authorized(
    app: &AppState,
    headers: &HeaderMap,
    target: Target,
) -> Result<(Arc<Plugins>, String), Refusal> {
    authorize(headers, &app.settings)?;
    let Some(registry) = app.readiness.registry.get() else {
        return Err((StatusCode::SERVICE_UNAVAILABLE, "plugins not loaded yet"));
    };
    let Some(consumer) = target.consumer else {
        return Err((StatusCode::BAD_REQUEST, "name the consumer: ?consumer=NAME"));
    };
    Ok((registry.clone(), consumer))
}

fn deployed(consumer: &str, result: Result<crate::registry::Deployed, DeployError>) -> Response {
    match result {
        Ok(d) => {
            let answer = serde_json::json!({
                "consumer": consumer,
                "digest": d.version.digest,
                "replaced": d.replaced,
                "changed": d.changed,
                "validation_ms": d.version.validation.as_secs_f64() * 1e3,
            });
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/json")],
                answer.to_string(),
            )
                .into_response()
        }
        Err(e) => {
            let status = match e {
                DeployError::UnknownConsumer(_) => StatusCode::NOT_FOUND,
                DeployError::Native(_) | DeployError::NoPrevious(_) => StatusCode::CONFLICT,
                DeployError::Refused { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            };
            text(status, e.to_string())
        }
    }
}

/// Mutating requests need `Authorization: Bearer <admin.token>`; without a configured token
/// they are disabled.
fn authorize(headers: &HeaderMap, settings: &Settings) -> Result<(), Refusal> {
    let Some(token) = &settings.token else {
        return Err((
            StatusCode::FORBIDDEN,
            "plugin deploys are disabled: no admin.token configured (IDEMHOST_ADMIN__TOKEN)",
        ));
    };
    let offered = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if constant_time_eq(offered.as_bytes(), token.as_bytes()) {
        Ok(())
    } else {
        Err((StatusCode::UNAUTHORIZED, "missing or wrong admin token"))
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
