use std::collections::BTreeMap;
use std::fmt::{self, Debug, Formatter};
use std::future::Future;
use std::sync::Arc;

use crate::HashMap;

use crate::common::StatementCache;
use crate::error::Error;
use crate::ext::ustr::UStr;
use crate::io::StatementId;
use crate::message::{
    BackendMessageFormat, Close, Query, ReadyForQuery, ReceivedMessage, Terminate,
    TransactionStatus,
};
use crate::statement::PgStatementMetadata;
use crate::transaction::Transaction;
use crate::types::Oid;
use crate::{PgConnectOptions, PgTypeInfo, Postgres};

pub(crate) use sqlx_core::connection::*;
use sqlx_core::sql_str::SqlSafeStr;

pub use self::stream::PgStream;

#[cfg(feature = "offline")]
mod describe;
mod establish;
mod executor;
mod resolve;
mod sasl;
mod stream;
mod tls;

/// idemhost: how many texts of statements sent ahead a connection keeps prepared.
const AHEAD_NAMED: usize = 32;

/// idemhost: the most rows statements sent ahead may return between two reads of them.
const AHEAD_ROWS: usize = 8;

/// idemhost: the largest row a statement sent ahead may return.
const AHEAD_ROW_BYTES: usize = 1024;

/// A connection to a PostgreSQL database.
///
/// See [`PgConnectOptions`] for connection URL reference.
pub struct PgConnection {
    pub(crate) inner: Box<PgConnectionInner>,
}

pub struct PgConnectionInner {
    // underlying TCP or UDS stream,
    // wrapped in a potentially TLS stream,
    // wrapped in a buffered stream
    pub(crate) stream: PgStream,

    // process id of this backend
    // used to send cancel requests
    #[allow(dead_code)]
    process_id: u32,

    // secret key of this backend
    // used to send cancel requests
    #[allow(dead_code)]
    secret_key: u32,

    // sequence of statement IDs for use in preparing statements
    // in PostgreSQL, the statement is prepared to a user-supplied identifier
    next_statement_id: StatementId,

    // cache statement by query string to the id and columns
    cache_statement: StatementCache<(StatementId, Arc<PgStatementMetadata>)>,

    // cache user-defined types by id <-> info
    cache_type_info: HashMap<Oid, PgTypeInfo>,
    cache_type_oid: HashMap<UStr, Oid>,
    cache_elem_type_to_array: HashMap<Oid, Oid>,
    cache_table_data: HashMap<Oid, TableData>,

    // number of ReadyForQuery messages that we are currently expecting
    pub(crate) pending_ready_for_query_count: usize,

    // idemhost: statements sent ahead of the next prepared statement's execution, in its Sync
    // (see `PgConnection::send_ahead`), and the rows they returned (text, first column)
    pub(crate) ahead: Vec<String>,
    pub(crate) ahead_rows: Vec<Option<Vec<u8>>>,
    pub(crate) ahead_failed: bool,
    // the statements sent ahead, prepared on the session under these names
    pub(crate) ahead_names: HashMap<String, StatementId>,
    pub(crate) ahead_overflow: bool,

    // current transaction status
    transaction_status: TransactionStatus,
    pub(crate) transaction_depth: usize,

    log_settings: LogSettings,
}

pub(crate) struct TableData {
    table_name: Arc<str>,
    /// Attribute number -> name.
    columns: BTreeMap<i16, Arc<str>>,
}

impl PgConnection {
    /// the version number of the server in `libpq` format
    pub fn server_version_num(&self) -> Option<u32> {
        self.inner.stream.server_version_num
    }

    // will return when the connection is ready for another query
    pub(crate) async fn wait_until_ready(&mut self) -> Result<(), Error> {
        if !self.inner.stream.write_buffer_mut().is_empty() {
            self.inner.stream.flush().await?;
        }

        while self.inner.pending_ready_for_query_count > 0 {
            let message = self.inner.stream.recv().await?;

            if let BackendMessageFormat::ReadyForQuery = message.format {
                self.handle_ready_for_query(message)?;
            }
        }

        Ok(())
    }

    async fn recv_ready_for_query(&mut self) -> Result<(), Error> {
        let r: ReadyForQuery = self.inner.stream.recv_expect().await?;

        self.inner.pending_ready_for_query_count -= 1;
        self.inner.transaction_status = r.transaction_status;

        Ok(())
    }

    #[inline(always)]
    fn handle_ready_for_query(&mut self, message: ReceivedMessage) -> Result<(), Error> {
        self.inner.pending_ready_for_query_count = self
            .inner
            .pending_ready_for_query_count
            .checked_sub(1)
            .ok_or_else(|| err_protocol!("received more ReadyForQuery messages than expected"))?;

        self.inner.transaction_status = message.decode::<ReadyForQuery>()?.transaction_status;

        Ok(())
    }

    /// Queue a simple query (not prepared) to execute the next time this connection is used.
    ///
    /// Used for rolling back transactions and releasing advisory locks.
    #[inline(always)]
    pub(crate) fn queue_simple_query(&mut self, query: &str) -> Result<(), Error> {
        self.inner.stream.write_msg(Query(query))?;
        self.inner.pending_ready_for_query_count += 1;

        Ok(())
    }

    /// idemhost: whether the server said, in its last ReadyForQuery, that no transaction is
    /// open on this session (`I`): a statement sent now would run in a transaction of its own.
    pub fn transaction_idle(&self) -> bool {
        matches!(self.inner.transaction_status, TransactionStatus::Idle)
    }

    /// idemhost: sends `sql` (no parameters) ahead of the next statement this connection runs,
    /// without a round trip of its own: when that statement is a prepared one already cached,
    /// as Bind/Execute messages (and a Parse the first time: see `write_ahead`) in the same
    /// Sync as its Bind and Execute (a
    /// failure of `sql` fails that statement, which the server then skips); otherwise in a
    /// Sync of its own just before it. What `sql` returned, the first column of each row as
    /// text, is kept for [`PgConnection::take_ahead_rows`].
    pub fn send_ahead(&mut self, sql: impl Into<String>) {
        self.inner.ahead.push(sql.into());
    }

    /// idemhost: drops the statements [`PgConnection::send_ahead`] queued and not sent yet.
    pub fn discard_ahead(&mut self) {
        self.inner.ahead.clear();
    }

    /// idemhost: whether statements queued with [`PgConnection::send_ahead`] are still unsent.
    pub fn has_ahead(&self) -> bool {
        !self.inner.ahead.is_empty()
    }

    /// idemhost: the first column (text; `None`: NULL) of each row the statements sent ahead
    /// returned since the last call.
    pub fn take_ahead_rows(&mut self) -> Vec<Option<Vec<u8>>> {
        std::mem::take(&mut self.inner.ahead_rows)
    }

    /// idemhost: whether a statement sent ahead returned more than the host's do (see
    /// `keep_ahead_row`): the connection should be closed, not reused.
    pub fn ahead_overflowed(&self) -> bool {
        self.inner.ahead_overflow
    }

    /// idemhost: the names under which the statements sent ahead are prepared on the session
    /// (a plugin that deallocated one, or prepared its own under the name, shows in
    /// `pg_prepared_statements`).
    pub fn ahead_names(&self) -> Vec<String> {
        self.inner
            .ahead_names
            .values()
            .filter_map(|id| id.display().map(|d| d.to_string()))
            .collect()
    }

    /// idemhost: whether the last error came from a statement sent ahead (the statement behind
    /// it was then skipped by the server); reset by the call.
    pub fn ahead_failed(&mut self) -> bool {
        std::mem::take(&mut self.inner.ahead_failed)
    }

    /// idemhost: writes the queued statements ahead (text results, the unnamed portal): each
    /// prepared under a name of its own the first time (up to [`AHEAD_NAMED`] texts per
    /// connection; past them unnamed, parsed every time), then bound and executed; how many
    /// were written.
    pub(crate) fn write_ahead(&mut self) -> Result<usize, Error> {
        use crate::io::PortalId;
        use crate::message::{Bind, Execute, Parse};
        let ahead = std::mem::take(&mut self.inner.ahead);
        for sql in &ahead {
            let statement = match self.inner.ahead_names.get(sql) {
                Some(id) => *id,
                None => {
                    let id = if self.inner.ahead_names.len() < AHEAD_NAMED {
                        let id = self.inner.next_statement_id;
                        self.inner.next_statement_id = id.next();
                        self.inner.ahead_names.insert(sql.clone(), id);
                        id
                    } else {
                        StatementId::UNNAMED
                    };
                    self.inner.stream.write_msg(Parse {
                        statement: id,
                        query: sql,
                        param_types: &[],
                    })?;
                    id
                }
            };
            self.inner.stream.write_msg(Bind {
                portal: PortalId::UNNAMED,
                statement,
                formats: &[],
                num_params: 0,
                params: &[],
                result_formats: &[],
            })?;
            self.inner.stream.write_msg(Execute {
                portal: PortalId::UNNAMED,
                limit: 0,
            })?;
        }
        Ok(ahead.len())
    }

    /// idemhost: keeps a row a statement sent ahead returned: at most [`AHEAD_ROWS`] rows of
    /// [`AHEAD_ROW_BYTES`] each (the host's statements return one small row). Past either, the
    /// statement is not the one the host sent (a plugin replaced a prepared statement under
    /// its name): the statement fails, and [`PgConnection::ahead_overflowed`] says so.
    pub(crate) fn keep_ahead_row(&mut self, message: ReceivedMessage) -> Result<(), Error> {
        if self.inner.ahead_rows.len() >= AHEAD_ROWS || message.contents.len() > AHEAD_ROW_BYTES {
            self.inner.ahead_overflow = true;
            self.inner.ahead_failed = true;
            return Err(err_protocol!(
                "a statement sent ahead returned more than the host's statements return"
            ));
        }
        let row: crate::message::DataRow = message.decode()?;
        let first = if row.values.is_empty() {
            None
        } else {
            row.get(0).map(<[u8]>::to_vec)
        };
        self.inner.ahead_rows.push(first);
        Ok(())
    }

    /// idemhost: sends the queued statements ahead in a Sync of their own and reads their
    /// results (the first error, if any, is returned once the server is ready again).
    pub(crate) async fn flush_ahead(&mut self) -> Result<(), Error> {
        if self.inner.ahead.is_empty() {
            return Ok(());
        }
        self.wait_until_ready().await?;
        self.write_ahead()?;
        self.write_sync();
        self.inner.stream.flush().await?;
        let mut failed = None;
        loop {
            match self.inner.stream.recv().await {
                Ok(message) => match message.format {
                    BackendMessageFormat::DataRow => self.keep_ahead_row(message)?,
                    BackendMessageFormat::ReadyForQuery => {
                        self.handle_ready_for_query(message)?;
                        break;
                    }
                    _ => {}
                },
                // An error: the server skips to the Sync; its ReadyForQuery follows.
                Err(e @ Error::Database(_)) => {
                    self.inner.ahead_failed = true;
                    failed.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        failed.map_or(Ok(()), Err)
    }

    pub(crate) fn in_transaction(&self) -> bool {
        match self.inner.transaction_status {
            TransactionStatus::Transaction => true,
            TransactionStatus::Error | TransactionStatus::Idle => false,
        }
    }
}

impl Debug for PgConnection {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgConnection").finish()
    }
}

impl Connection for PgConnection {
    type Database = Postgres;

    type Options = PgConnectOptions;

    async fn close(mut self) -> Result<(), Error> {
        // The normal, graceful termination procedure is that the frontend sends a Terminate
        // message and immediately closes the connection.

        // On receipt of this message, the backend closes the
        // connection and terminates.
        self.inner.stream.send(Terminate).await?;
        self.inner.stream.shutdown().await?;

        Ok(())
    }

    async fn close_hard(mut self) -> Result<(), Error> {
        self.inner.stream.shutdown().await?;

        Ok(())
    }

    async fn ping(&mut self) -> Result<(), Error> {
        // Users were complaining about this showing up in query statistics on the server.
        // By sending a comment we avoid an error if the connection was in the middle of a rowset
        // self.execute("/* SQLx ping */").map_ok(|_| ()).boxed()

        // The simplest call-and-response that's possible.
        self.write_sync();
        self.wait_until_ready().await
    }

    fn begin(
        &mut self,
    ) -> impl Future<Output = Result<Transaction<'_, Self::Database>, Error>> + Send + '_ {
        Transaction::begin(self, None)
    }

    fn begin_with(
        &mut self,
        statement: impl SqlSafeStr,
    ) -> impl Future<Output = Result<Transaction<'_, Self::Database>, Error>> + Send + '_
    where
        Self: Sized,
    {
        Transaction::begin(self, Some(statement.into_sql_str()))
    }

    fn cached_statements_size(&self) -> usize {
        self.inner.cache_statement.len()
    }

    async fn clear_cached_statements(&mut self) -> Result<(), Error> {
        self.inner.cache_type_oid.clear();

        let mut cleared = 0_usize;

        self.wait_until_ready().await?;

        while let Some((id, _)) = self.inner.cache_statement.remove_lru() {
            self.inner.stream.write_msg(Close::Statement(id))?;
            cleared += 1;
        }

        if cleared > 0 {
            self.write_sync();
            self.inner.stream.flush().await?;

            self.wait_for_close_complete(cleared).await?;
            self.recv_ready_for_query().await?;
        }

        Ok(())
    }

    fn shrink_buffers(&mut self) {
        self.inner.stream.shrink_buffers();
    }

    #[doc(hidden)]
    fn flush(&mut self) -> impl Future<Output = Result<(), Error>> + Send + '_ {
        self.wait_until_ready()
    }

    #[doc(hidden)]
    fn should_flush(&self) -> bool {
        !self.inner.stream.write_buffer().is_empty()
    }
}

// Implement `AsMut<Self>` so that `PgConnection` can be wrapped in
// a `PgAdvisoryLockGuard`.
//
// See: https://github.com/launchbadge/sqlx/issues/2520
impl AsMut<PgConnection> for PgConnection {
    fn as_mut(&mut self) -> &mut PgConnection {
        self
    }
}
