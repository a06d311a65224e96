//! OTLP trace export (cargo feature `otlp`, off by default): when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set, the host's spans
//! go to that collector over OTLP/HTTP (protobuf) from a batch exporter thread, and each
//! delivery's span continues the trace of the message's W3C `traceparent` header. Without the
//! variables nothing is exported and no connection is made.

use std::sync::OnceLock;
use std::time::Duration;

use async_nats::HeaderMap;
use opentelemetry::propagation::{Extractor, TextMapPropagator as _};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracerProvider, Tracer};
use tracing::Subscriber;
use tracing_opentelemetry::{OpenTelemetryLayer, OpenTelemetrySpanExt as _};
use tracing_subscriber::registry::LookupSpan;

static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Whether the environment names a collector.
pub(crate) fn configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

/// The layer exporting spans, when a collector is configured. The exporter's blocking HTTP
/// client is built on a thread of its own (it may not be created inside the async runtime).
pub(crate) fn layer<S>() -> Option<OpenTelemetryLayer<S, Tracer>>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    if !configured() {
        return None;
    }
    let built = std::thread::spawn(|| {
        opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()
            .map_err(|e| e.to_string())
    })
    .join();
    let exporter = match built {
        Ok(Ok(e)) => e,
        Ok(Err(e)) => {
            eprintln!("warning: OTLP export disabled: {e}");
            return None;
        }
        Err(_) => {
            eprintln!("warning: OTLP export disabled: the exporter panicked while starting");
            return None;
        }
    };
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name("idemhost")
        .build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("idemhost");
    let _ = PROVIDER.set(provider);
    Some(tracing_opentelemetry::layer().with_tracer(tracer))
}

/// Exports what is still buffered; called once before the process exits.
pub(crate) fn shutdown() {
    if let Some(p) = PROVIDER.get()
        && let Err(e) = p.shutdown_with_timeout(Duration::from_secs(5))
    {
        eprintln!("warning: OTLP export did not flush: {e}");
    }
}

struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(|v| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        ["traceparent", "tracestate"]
            .into_iter()
            .filter(|k| self.0.get(*k).is_some())
            .collect()
    }
}

/// Makes `span` a child of the message's `traceparent` (if valid).
pub(crate) fn continue_trace(span: &tracing::Span, headers: &HeaderMap) {
    if headers.get("traceparent").is_none() {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&Headers(headers));
    let _ = span.set_parent(cx);
}
