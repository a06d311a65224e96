//! Delivery transactions on connections the claim pipeline keeps between deliveries.
//!
//! sqlx's pool checks a connection's liveness with a round trip each time one is taken from it
//! idle and each time one is given back: two round trips per delivery on top of its
//! transaction's. A consumer's [`Connections`] keeps some connections between deliveries instead
//! (the host decides how many, leaving room in the pool for the others), and only a connection
//! whose transaction ended cleanly (COMMIT or ROLLBACK answered) goes back there; any other goes
//! back to the pool, which tests it. While the pool has none left to give, connections go back
//! to it rather than be kept, so nobody waits on the pool for a connection a consumer keeps.
//!
//! A [`Tx`] is a transaction on one of them. Dropped before it ended (a delivery cancelled at
//! shutdown), its connection is closed, never reused: PostgreSQL rolls the transaction back.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres};

/// A consumer's connections: the ones it keeps, and the pool for more.
pub struct Connections {
    pool: PgPool,
    keep: usize,
    idle: Mutex<Vec<PoolConnection<Postgres>>>,
}

impl Connections {
    /// Keeps up to `keep` connections between transactions (0: always the pool's).
    ///
    /// `Pool::close` waits for every connection taken from the pool, kept ones included, so
    /// they are given back as soon as the pool starts closing. That takes a task on the tokio
    /// runtime: outside one, nothing is kept.
    pub fn new(pool: PgPool, keep: usize) -> Arc<Self> {
        let runtime = tokio::runtime::Handle::try_current().ok();
        let keep = if runtime.is_some() { keep } else { 0 };
        let this = Arc::new(Connections {
            pool,
            keep,
            idle: Mutex::new(Vec::with_capacity(keep)),
        });
        if let Some(runtime) = runtime
            && keep > 0
        {
            let closing = this.pool.close_event();
            let kept = Arc::downgrade(&this);
            runtime.spawn(async move {
                closing.await;
                if let Some(this) = kept.upgrade()
                    && let Ok(mut idle) = this.idle.lock()
                {
                    idle.clear();
                }
            });
        }
        this
    }

    /// The pool behind the kept connections, for statements outside a delivery.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Begins a transaction with `begin`: a `BEGIN ...` and the statements that follow it, in
    /// one simple query (one round trip); the rows they returned. A kept connection that turns
    /// out broken (the server restarted meanwhile) is dropped and the next one tried; the
    /// pool's last. When a statement fails, the transaction is rolled back and `Err` returned.
    pub async fn begin(self: &Arc<Self>, begin: &str) -> Result<(Tx, Vec<PgRow>), sqlx::Error> {
        loop {
            let kept = self.idle.lock().map(|mut idle| idle.pop()).unwrap_or(None);
            let from_pool = kept.is_none();
            let conn = match kept {
                Some(conn) => conn,
                None => self.pool.acquire().await?,
            };
            // From here the connection is in a `Tx`: dropped unfinished (this future
            // cancelled), it is closed, never pooled in the middle of a transaction.
            let mut tx = Tx {
                conn: Some(conn),
                home: self.clone(),
            };
            match sqlx::raw_sql(AssertSqlSafe(begin.to_owned()))
                .fetch_all(&mut *tx)
                .await
            {
                Ok(rows) => return Ok((tx, rows)),
                // The server answered: the connection works; end what the statements began.
                Err(e @ sqlx::Error::Database(_)) => {
                    let _ = tx.rollback().await;
                    return Err(e);
                }
                Err(e) => {
                    drop(tx);
                    if from_pool {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Keeps `conn` for the next transaction, unless this consumer keeps enough already or
    /// the pool has none left to give: then someone may be waiting for one, and it goes back.
    fn give_back(&self, conn: PoolConnection<Postgres>) {
        let exhausted = self.pool.num_idle() == 0
            && self.pool.size() >= self.pool.options().get_max_connections();
        if let Ok(mut idle) = self.idle.lock()
            && idle.len() < self.keep
            && !exhausted
            && !self.pool.is_closed()
        {
            idle.push(conn);
        }
        // Otherwise dropped: back to the pool.
    }
}

/// An open transaction. Statements run on it through `&mut *tx` (a [`PgConnection`]).
pub struct Tx {
    /// `None` once the transaction ended.
    conn: Option<PoolConnection<Postgres>>,
    home: Arc<Connections>,
}

impl Tx {
    /// Commits with `statement`: `COMMIT`, possibly after `SET LOCAL`s that re-assert what the
    /// commit depends on and before a session reset (see [`super::Wall`]), in one round trip.
    pub async fn commit_with(self, statement: &str) -> Result<(), sqlx::Error> {
        self.end(statement).await
    }

    /// Rolls back with `statement` (`ROLLBACK`, then possibly a session reset).
    pub async fn rollback_with(self, statement: &str) -> Result<(), sqlx::Error> {
        self.end(statement).await
    }

    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        self.end("ROLLBACK").await
    }

    /// Runs `statement` (COMMIT or ROLLBACK, and what follows it); once it was answered the
    /// connection is kept or given back — unless its last row is a single `true` (the session
    /// reset found state it cannot undo): then it is closed. On an error (or if this future is
    /// dropped first) the connection is closed.
    async fn end(mut self, statement: &str) -> Result<(), sqlx::Error> {
        let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_owned()))
            .fetch_all(&mut *self)
            .await?;
        let discard = rows
            .last()
            .and_then(|row| sqlx::Row::try_get::<bool, _>(row, 0).ok())
            .unwrap_or(false);
        if let Some(conn) = self.conn.take() {
            if discard {
                tracing::debug!("session state the reset cannot undo; the connection is closed");
                let _ = conn.close().await;
            } else {
                self.home.give_back(conn);
            }
        }
        Ok(())
    }
}

impl Drop for Tx {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.conn {
            conn.close_on_drop();
        }
    }
}

impl Deref for Tx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match &self.conn {
            Some(conn) => conn,
            // `conn` is taken only by `end`, which consumes the transaction.
            None => unreachable!("transaction used after it ended"),
        }
    }
}

impl DerefMut for Tx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match &mut self.conn {
            Some(conn) => conn,
            None => unreachable!("transaction used after it ended"),
        }
    }
}
