//! The host side of the world's imports — the lent transaction's methods, plugin logging, value
//! and error conversion, the consumer's configuration — for each WIT version the host speaks
//! (`v1`: 0.1.0, `v2`: 0.2.0), and the WASI pieces linked for language runtimes. Each reaches
//! only what the instance's [`PluginState`] holds.

use wasmtime::component::{HasSelf, Linker, ResourceTable};

use super::{MAX_LOG_LINE_BYTES, MAX_LOG_LINES, PluginState, bindings, bindings_v2};
use crate::tx_handle::TxError;

mod v1;
mod v2;

/// Links the host interfaces: the idemhost world's imports, and the WASI pieces language
/// runtimes import without a way to reach anything (empty environment and arguments, no
/// stdin, output discarded, clocks, randomness). No filesystem, sockets or HTTP are linked,
/// so a component importing them is refused at load.
pub(super) fn link(linker: &mut Linker<PluginState>) -> wasmtime::Result<()> {
    bindings::Handler::add_to_linker::<_, HasSelf<PluginState>>(linker, |s| s)?;
    bindings_v2::Handler::add_to_linker::<_, HasSelf<PluginState>>(linker, |s| s)?;
    use wasmtime_wasi::cli::{WasiCli, WasiCliView as _};
    use wasmtime_wasi::clocks::{WasiClocks, WasiClocksView as _};
    use wasmtime_wasi::p2::bindings::{cli, clocks, random};
    use wasmtime_wasi::random::WasiRandom;
    let l = linker;
    wasmtime_wasi_io_link(l)?;
    clocks::wall_clock::add_to_linker::<_, WasiClocks>(l, |t| t.clocks())?;
    clocks::monotonic_clock::add_to_linker::<_, WasiClocks>(l, |t| t.clocks())?;
    random::random::add_to_linker::<_, WasiRandom>(l, |t| t.wasi.random())?;
    random::insecure::add_to_linker::<_, WasiRandom>(l, |t| t.wasi.random())?;
    random::insecure_seed::add_to_linker::<_, WasiRandom>(l, |t| t.wasi.random())?;
    cli::exit::add_to_linker::<_, WasiCli>(l, |t| t.cli())?;
    cli::environment::add_to_linker::<_, WasiCli>(l, |t| t.cli())?;
    cli::stdin::add_to_linker::<_, WasiCli>(l, |t| t.cli())?;
    cli::stdout::add_to_linker::<_, WasiCli>(l, |t| t.cli())?;
    cli::stderr::add_to_linker::<_, WasiCli>(l, |t| t.cli())?;
    cli::terminal_input::add_to_linker::<_, WasiCli>(l, |t| t.cli())?;
    cli::terminal_output::add_to_linker::<_, WasiCli>(l, |t| t.cli())?;
    cli::terminal_stdin::add_to_linker::<_, WasiCli>(l, |t| t.cli())?;
    cli::terminal_stdout::add_to_linker::<_, WasiCli>(l, |t| t.cli())?;
    cli::terminal_stderr::add_to_linker::<_, WasiCli>(l, |t| t.cli())?;
    Ok(())
}

/// `wasi:io` (error, poll, streams), which the cli and clock interfaces build on.
fn wasmtime_wasi_io_link(l: &mut Linker<PluginState>) -> wasmtime::Result<()> {
    struct HasIo;
    impl wasmtime::component::HasData for HasIo {
        type Data<'a> = &'a mut ResourceTable;
    }
    use wasmtime_wasi_io::bindings::wasi::io;
    io::error::add_to_linker::<PluginState, HasIo>(l, |t| &mut t.table)?;
    io::poll::add_to_linker::<PluginState, HasIo>(l, |t| &mut t.table)?;
    io::streams::add_to_linker::<PluginState, HasIo>(l, |t| &mut t.table)?;
    Ok(())
}

/// The lent transaction's methods and plugin logging for one WIT version, whose modules the
/// caller's scope names `database`, `logging` and `wit` (its `types`), with its conversions
/// `from_wit`, `to_wit` and `error_to_wit`; `$values` are the result cases it has.
macro_rules! host_interfaces {
    ($values:expr) => {
        impl wit::Host for PluginState {}

        impl database::Host for PluginState {}

        impl database::HostTransaction for PluginState {
            async fn execute(
                &mut self,
                tx: Resource<TxHandle>,
                sql: String,
                params: Vec<wit::SqlValue>,
            ) -> wasmtime::Result<Result<u64, GuestError>> {
                let handle = self.table.get(&tx)?.clone();
                let params: Vec<SqlValue> = params.into_iter().map(from_wit).collect();
                super::guest_result(handle.execute(&sql, &params).await, error_to_wit)
            }

            async fn query(
                &mut self,
                tx: Resource<TxHandle>,
                sql: String,
                params: Vec<wit::SqlValue>,
            ) -> wasmtime::Result<Result<Vec<Vec<wit::SqlValue>>, GuestError>> {
                let handle = self.table.get(&tx)?.clone();
                let params: Vec<SqlValue> = params.into_iter().map(from_wit).collect();
                let rows = handle.query_as(&sql, &params, $values).await;
                let rows = super::guest_result(rows, error_to_wit)?;
                Ok(rows.map(|rows| {
                    rows.into_iter()
                        .map(|r| r.into_iter().map(to_wit).collect())
                        .collect()
                }))
            }

            async fn publish(
                &mut self,
                tx: Resource<TxHandle>,
                subject: String,
                headers: Vec<(String, String)>,
                payload: Vec<u8>,
            ) -> wasmtime::Result<Result<(), GuestError>> {
                let handle = self.table.get(&tx)?.clone();
                let published = handle.publish(&subject, &headers, &payload).await;
                super::guest_result(published, error_to_wit)
            }

            async fn drop(&mut self, tx: Resource<TxHandle>) -> wasmtime::Result<()> {
                self.table.delete(tx)?;
                Ok(())
            }
        }

        impl logging::Host for PluginState {
            async fn log(&mut self, level: String, message: String) -> wasmtime::Result<()> {
                self.log_line(&level, &message);
                Ok(())
            }
        }
    };
}
use host_interfaces;

/// Refusals and database errors are data for the plugin (as `error` renders them for its WIT
/// version); a handle used after its delivery traps.
fn guest_result<T, E>(
    r: Result<T, TxError>,
    error: fn(TxError) -> E,
) -> wasmtime::Result<Result<T, E>> {
    match r {
        Ok(v) => Ok(Ok(v)),
        Err(TxError::Closed) => wasmtime::bail!("transaction handle used outside its delivery"),
        Err(e) => Ok(Err(error(e))),
    }
}

impl PluginState {
    /// One `log` call of the plugin, whatever its WIT version.
    fn log_line(&mut self, level: &str, message: &str) {
        let sink = &mut self.log;
        if sink.lines >= MAX_LOG_LINES || sink.bytes_left == 0 {
            sink.dropped += 1;
            return;
        }
        // Escaped (no line of the host's log can be forged) and cut to the line's and the
        // attempt's budget.
        let message = crate::text::bounded(message, MAX_LOG_LINE_BYTES.min(sink.bytes_left));
        sink.lines += 1;
        sink.bytes_left = sink.bytes_left.saturating_sub(message.len());
        if let Some(trace) = &sink.trace {
            trace.log(level, &message);
        }
        let digest = &*sink.digest;
        match level {
            "error" => tracing::error!(target: "idemhost::plugin", plugin = digest, "{message}"),
            "warn" => tracing::warn!(target: "idemhost::plugin", plugin = digest, "{message}"),
            "info" => tracing::info!(target: "idemhost::plugin", plugin = digest, "{message}"),
            "trace" => tracing::trace!(target: "idemhost::plugin", plugin = digest, "{message}"),
            _ => tracing::debug!(target: "idemhost::plugin", plugin = digest, "{message}"),
        }
    }
}
