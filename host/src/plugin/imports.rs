//! The host side of the world's imports — the lent transaction's methods, plugin logging, value
//! conversion — and the WASI pieces linked for language runtimes. Each reaches only what the
//! instance's [`PluginState`] holds.

use wasmtime::component::{HasSelf, Linker, Resource, ResourceTable};

use super::bindings::{self, idemhost::consumer::database, idemhost::consumer::logging};
use super::{MAX_LOG_LINE_BYTES, MAX_LOG_LINES, PluginState, wit};
use crate::sql_gate::SqlValue;
use crate::tx_handle::{TxError, TxHandle};

/// Links the host interfaces: the idemhost world's imports, and the WASI pieces language
/// runtimes import without a way to reach anything (empty environment and arguments, no
/// stdin, output discarded, clocks, randomness). No filesystem, sockets or HTTP are linked,
/// so a component importing them is refused at load.
pub(super) fn link(linker: &mut Linker<PluginState>) -> wasmtime::Result<()> {
    bindings::Handler::add_to_linker::<_, HasSelf<PluginState>>(linker, |s| s)?;
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

impl wit::Host for PluginState {}

impl database::Host for PluginState {}

impl database::HostTransaction for PluginState {
    async fn execute(
        &mut self,
        tx: Resource<TxHandle>,
        sql: String,
        params: Vec<wit::SqlValue>,
    ) -> wasmtime::Result<Result<u64, String>> {
        let handle = self.table.get(&tx)?.clone();
        let params: Vec<SqlValue> = params.into_iter().map(from_wit).collect();
        guest_result(handle.execute(&sql, &params).await)
    }

    async fn query(
        &mut self,
        tx: Resource<TxHandle>,
        sql: String,
        params: Vec<wit::SqlValue>,
    ) -> wasmtime::Result<Result<Vec<Vec<wit::SqlValue>>, String>> {
        let handle = self.table.get(&tx)?.clone();
        let params: Vec<SqlValue> = params.into_iter().map(from_wit).collect();
        let rows = guest_result(handle.query(&sql, &params).await)?;
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
    ) -> wasmtime::Result<Result<(), String>> {
        let handle = self.table.get(&tx)?.clone();
        guest_result(handle.publish(&subject, &headers, &payload).await)
    }

    async fn drop(&mut self, tx: Resource<TxHandle>) -> wasmtime::Result<()> {
        self.table.delete(tx)?;
        Ok(())
    }
}

/// Refusals and database errors are data for the plugin; a handle used after its delivery
/// traps.
fn guest_result<T>(r: Result<T, TxError>) -> wasmtime::Result<Result<T, String>> {
    match r {
        Ok(v) => Ok(Ok(v)),
        Err(TxError::Closed) => wasmtime::bail!("transaction handle used outside its delivery"),
        Err(e) => Ok(Err(e.to_string())),
    }
}

impl logging::Host for PluginState {
    async fn log(&mut self, level: String, message: String) -> wasmtime::Result<()> {
        let sink = &mut self.log;
        if sink.lines >= MAX_LOG_LINES || sink.bytes_left == 0 {
            sink.dropped += 1;
            return Ok(());
        }
        // Escaped (no line of the host's log can be forged) and cut to the line's and the
        // attempt's budget.
        let message = crate::text::bounded(&message, MAX_LOG_LINE_BYTES.min(sink.bytes_left));
        sink.lines += 1;
        sink.bytes_left = sink.bytes_left.saturating_sub(message.len());
        if let Some(trace) = &sink.trace {
            trace.log(&level, &message);
        }
        let digest = &*sink.digest;
        match level.as_str() {
            "error" => tracing::error!(target: "idemhost::plugin", plugin = digest, "{message}"),
            "warn" => tracing::warn!(target: "idemhost::plugin", plugin = digest, "{message}"),
            "info" => tracing::info!(target: "idemhost::plugin", plugin = digest, "{message}"),
            "trace" => tracing::trace!(target: "idemhost::plugin", plugin = digest, "{message}"),
            _ => tracing::debug!(target: "idemhost::plugin", plugin = digest, "{message}"),
        }
        Ok(())
    }
}

fn from_wit(v: wit::SqlValue) -> SqlValue {
    match v {
        wit::SqlValue::Null => SqlValue::Null,
        wit::SqlValue::Boolean(b) => SqlValue::Boolean(b),
        wit::SqlValue::Int(i) => SqlValue::Int(i),
        wit::SqlValue::Float(f) => SqlValue::Float(f),
        wit::SqlValue::Text(s) => SqlValue::Text(s),
        wit::SqlValue::Bytes(b) => SqlValue::Bytes(b),
        wit::SqlValue::Json(s) => SqlValue::Json(s),
    }
}

fn to_wit(v: SqlValue) -> wit::SqlValue {
    match v {
        SqlValue::Null => wit::SqlValue::Null,
        SqlValue::Boolean(b) => wit::SqlValue::Boolean(b),
        SqlValue::Int(i) => wit::SqlValue::Int(i),
        SqlValue::Float(f) => wit::SqlValue::Float(f),
        SqlValue::Text(s) => wit::SqlValue::Text(s),
        SqlValue::Bytes(b) => wit::SqlValue::Bytes(b),
        SqlValue::Json(s) => wit::SqlValue::Json(s),
    }
}
