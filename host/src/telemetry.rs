//! Logging and tracing for a process running a host — the `idemhost` binary, or a program
//! embedding the library — and the signals that stop it.

use crate::config::LogFormat;

/// Logs to stderr; `RUST_LOG` filters (default `info`). Built with the `otlp` feature, spans
/// are also exported when `OTEL_EXPORTER_OTLP_ENDPOINT` is set.
pub fn init_tracing(format: Option<LogFormat>) {
    init_tracing_at(format, "info")
}

/// [`init_tracing`] with another default filter (`RUST_LOG` still wins).
pub fn init_tracing_at(format: Option<LogFormat>, default_filter: &str) {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    // The server's notices to the host's own sessions ("relation … already exists, skipping"
    // at every start's migrations) only at `RUST_LOG=sqlx::postgres::notice=info`; its
    // warnings still show.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!("{default_filter},sqlx::postgres::notice=warn"))
    });
    // Colours only for a terminal: a file, a pipe or a log collector gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let fmt = match format.unwrap_or(LogFormat::Text) {
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .boxed(),
        LogFormat::Text => fmt.boxed(),
    };
    let registry = tracing_subscriber::registry().with(fmt).with(filter);
    #[cfg(feature = "otlp")]
    let _ = registry.with(crate::otel::layer()).try_init();
    #[cfg(not(feature = "otlp"))]
    {
        if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() {
            eprintln!(
                "warning: OTEL_EXPORTER_OTLP_ENDPOINT is set, but this idemhost was built without the `otlp` feature"
            );
        }
        let _ = registry.try_init();
    }
}

/// Flushes exported spans (feature `otlp`); call once before the process exits.
pub fn shutdown_tracing() {
    #[cfg(feature = "otlp")]
    crate::otel::shutdown();
}

/// Resolves on SIGINT or SIGTERM (also as PID 1 in a container: tokio installs real handlers),
/// from the moment it is called (inside the tokio runtime), not from its first poll.
pub fn shutdown_signal() -> impl Future<Output = ()> {
    // The handlers are installed now, not when the future is first polled: a SIGTERM between
    // "idemhost running" and that first poll killed the process outright (exit by the signal,
    // no drain), found by a test that stops the host as soon as it runs.
    #[cfg(unix)]
    let signals = {
        use tokio::signal::unix::{SignalKind, signal};
        (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        )
    };
    async move {
        #[cfg(unix)]
        if let (Ok(mut int), Ok(mut term)) = signals {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            return;
        }
        let _ = tokio::signal::ctrl_c().await;
    }
}
