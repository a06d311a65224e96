//! The connections a consumer keeps between its deliveries' transactions.
//!
//! sqlx's pool checks a connection's liveness with a round trip each time one is taken from it
//! idle and each time one is given back: two round trips per delivery on top of its
//! transaction's. A consumer's [`Connections`] keeps some connections between deliveries instead
//! (the host decides how many, leaving room in the pool for the others), and only a connection
//! whose transaction ended cleanly (COMMIT or ROLLBACK answered) goes back there; any other goes
//! back to the pool, which tests it. While a shared pool has none left to give, connections go
//! back to it rather than be kept, so nobody waits on the pool for a connection a consumer
//! keeps. A pool of the consumer's own (a plugin role's: [`Connections::of_own_pool`]) has no
//! other taker: its connections are kept whatever it has left, and a transaction waiting for the
//! pool takes a kept one as soon as one is given back. Under load such a pool is always
//! exhausted (every connection in a delivery), so giving connections back to it cost every
//! delivery the pool's two checks: two of its six round trips to the server.
//!
//! Kept connections age like the pool's own: one kept longer than the pool's `max_lifetime`
//! (at most [`KEEP_AT_MOST`]) goes back to the pool, which closes it if it is past its lifetime
//! and tests it otherwise; one left unused longer than the pool's `idle_timeout` is given back
//! as well. A connection whose transaction failed for a reason that is about the session, not
//! the statement (the server is read-only or shutting down, the connection is in a state the
//! host's functions refuse: see [`session_failed`]), is closed, never kept — after a failover
//! the next transaction gets a fresh connection rather than the same refusal forever.
//!
//! A [`Tx`] is a transaction on one of them (`pg::tx`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgPool, Postgres};

use super::{Tx, refused};

/// A consumer's connections: the ones it keeps, and the pool for more.
pub struct Connections {
    pool: PgPool,
    keep: usize,
    /// Nobody but these transactions takes connections from `pool`.
    own_pool: bool,
    idle: Mutex<Vec<Kept>>,
    /// Told when a connection is kept (see [`Connections::take_from_pool`]).
    returned: tokio::sync::Notify,
    /// The primary the pool follows: a kept connection taken before it moved is closed.
    failover: std::sync::OnceLock<Arc<crate::pg::Failover>>,
    /// A connection kept this long goes back to the pool (its `max_lifetime`, at most
    /// [`KEEP_AT_MOST`]).
    retire_after: Duration,
    /// A kept connection unused this long goes back to the pool (its `idle_timeout`).
    idle_timeout: Option<Duration>,
}

/// The longest a connection stays kept before the pool sees it again (tests it, and applies
/// its `max_lifetime`).
pub(crate) const KEEP_AT_MOST: Duration = Duration::from_secs(60);

/// A row this large closes its connection when the transaction ends. sqlx grows a connection's
/// read buffer to its largest message and keeps it while the connection lives: a plugin's
/// 16 MB values left ~16 MiB on each of its consumer's connections (+264 MiB of host RSS at
/// 16 in flight, for good). Below this, a kept connection holds at most twice this much.
pub(crate) const GROWN_MESSAGE_BYTES: usize = 256 << 10;

/// A connection kept between transactions: since when this consumer has it, and since when
/// it is unused.
struct Kept {
    conn: PoolConnection<Postgres>,
    since: Instant,
    unused_since: Instant,
}

/// Whether `error` is about the session rather than the statement: the connection is then
/// closed, not kept. Connection exceptions (class 08), the server shutting down or the
/// database going away (57P01–57P04), a read-only transaction where the host writes (25006: a
/// server that became read-only behind a proxy), and 55000 (object not in prerequisite state: what the host's
/// functions raise for a session whose `client_encoding` is not UTF-8), and 26000 (a statement
/// the driver prepared is gone: a plugin's `DEALLOCATE ALL`, gate off, failed every later
/// claim on that connection).
pub fn session_failed(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = error else {
        return false;
    };
    let code = db.code();
    let code = code.as_deref().unwrap_or("");
    code.starts_with("08")
        || matches!(
            code,
            "57P01" | "57P02" | "57P03" | "57P04" | "25006" | "55000" | "26000"
        )
}

impl Connections {
    /// Keeps up to `keep` connections between transactions (0: always the pool's).
    ///
    /// `Pool::close` waits for every connection taken from the pool, kept ones included, so
    /// they are given back as soon as the pool starts closing. That takes a task on the tokio
    /// runtime: outside one, nothing is kept.
    pub fn new(pool: PgPool, keep: usize) -> Arc<Self> {
        Self::build(pool, keep, false)
    }

    /// Keeps up to `keep` connections of `pool`, a pool that serves nobody else (a plugin
    /// role's): kept even while the pool has none left to give (see the module's notes).
    pub fn of_own_pool(pool: PgPool, keep: usize) -> Arc<Self> {
        Self::build(pool, keep, true)
    }

    fn build(pool: PgPool, keep: usize, own_pool: bool) -> Arc<Self> {
        let runtime = tokio::runtime::Handle::try_current().ok();
        let keep = if runtime.is_some() { keep } else { 0 };
        let options = pool.options();
        let retire_after = options
            .get_max_lifetime()
            .map_or(KEEP_AT_MOST, |l| l.min(KEEP_AT_MOST));
        let idle_timeout = options.get_idle_timeout();
        let this = Arc::new(Connections {
            pool,
            keep,
            own_pool,
            idle: Mutex::new(Vec::with_capacity(keep)),
            returned: tokio::sync::Notify::new(),
            failover: std::sync::OnceLock::new(),
            retire_after,
            idle_timeout,
        });
        if let Some(runtime) = runtime
            && keep > 0
        {
            let closing = this.pool.close_event();
            let kept = Arc::downgrade(&this);
            // Also sweeps now and then, so kept connections age while no delivery comes.
            let every = this
                .idle_timeout
                .map_or(this.retire_after, |t| t.min(this.retire_after))
                .max(Duration::from_secs(1));
            runtime.spawn(async move {
                tokio::pin!(closing);
                loop {
                    tokio::select! {
                        _ = &mut closing => break,
                        _ = tokio::time::sleep(every) => match kept.upgrade() {
                            Some(this) => this.sweep(),
                            None => return,
                        },
                    }
                }
                if let Some(this) = kept.upgrade()
                    && let Ok(mut idle) = this.idle.lock()
                {
                    idle.clear();
                }
            });
        }
        this
    }

    /// Follows `failover`: a kept connection taken from the pool before the primary moved is
    /// closed, not used again (it may be to an old primary that still takes writes). Before, such
    /// connections went on taking claims until they aged out, for up to [`KEEP_AT_MOST`].
    pub fn follow(&self, failover: Arc<crate::pg::Failover>) {
        let _ = self.failover.set(failover);
    }

    /// The pool behind the kept connections, for statements outside a delivery.
    #[cfg_attr(not(feature = "test-support"), allow(dead_code))]
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Begins a transaction with `begin`: a `BEGIN ...` and the statements that follow it, in
    /// one simple query (one round trip); the rows they returned. A kept connection that turns
    /// out broken (the server restarted meanwhile) is dropped and the next one tried; the
    /// pool's last. When a statement fails, the transaction is rolled back and `Err` returned
    /// (the connection closed if the failure was about the session: [`session_failed`]).
    pub async fn begin(self: &Arc<Self>, begin: &str) -> Result<(Tx, Vec<PgRow>), sqlx::Error> {
        loop {
            let (mut tx, from_pool) = self.take(&[]).await?;
            let rows = sqlx::raw_sql(AssertSqlSafe(begin.to_owned()))
                .fetch_all(&mut *tx)
                .await;
            match rows {
                Ok(rows) => return Ok((tx, rows)),
                // The simple query is all `begin`: its failure is the BEGIN's.
                Err(e @ sqlx::Error::Database(_)) => {
                    refused(tx).await;
                    return Err(e);
                }
                Err(e) => match tx.first_failed(e, from_pool).await {
                    Some(begin) => return Err(begin.into()),
                    None => continue,
                },
            }
        }
    }

    /// A transaction's connection with `begin` (the statements, one by one: `BEGIN ...` and the
    /// `SET LOCAL`s after it) queued to go ahead of its first statement, in that statement's
    /// round trip: where it is a statement the connection has prepared already, one round trip
    /// for both (see sqlx's `send_ahead`, patched in `vendor/`); on a connection new to it,
    /// `begin` is sent in a round trip of its own first. The extended protocol's own rule keeps
    /// the first statement out of the server's autocommit: after an error the server skips
    /// every message up to the Sync, so a refused `BEGIN` never lets it run (and commit) on its
    /// own. Whether the connection came from the pool (not a kept one) is returned with it: a
    /// failure of the first statement goes to [`Tx::first_failed`] (see `claim::begin_then!`).
    pub(crate) async fn take(
        self: &Arc<Self>,
        begin: &[String],
    ) -> Result<(Tx, bool), sqlx::Error> {
        // Waiting on an exhausted pool of its own ends with the pool's `acquire_timeout`, however
        // often a kept connection was given back to another waiter first.
        let deadline = Instant::now() + self.pool.options().get_acquire_timeout();
        loop {
            // Listening before looking: a connection kept after the look wakes this waiter,
            // whatever else is given back meanwhile.
            let returned = self.returned.notified();
            tokio::pin!(returned);
            returned.as_mut().enable();
            let kept = self.idle.lock().map(|mut idle| idle.pop()).unwrap_or(None);
            let from_pool = kept.is_none();
            // When the look began: a connection the pool gives after a move of the primary
            // that began before it may still be to the old one.
            let asked = Instant::now();
            let (conn, since) = match kept {
                Some(kept) if self.moved_since(kept.since) => {
                    // Maybe to the old primary: closed; the next one is tried.
                    close(kept.conn);
                    continue;
                }
                Some(kept) if self.aged(&kept) => {
                    // Back to the pool, which closes or tests it; the next one is tried.
                    drop(kept);
                    continue;
                }
                Some(kept) => (kept.conn, kept.since),
                // Boxed: the pool's `acquire` (which may open a connection) is a future of
                // ~15 KB, which every delivery's future held inline though kept connections
                // serve nearly all of them.
                None => match Box::pin(self.take_from_pool(returned, deadline)).await? {
                    Some(conn) if self.moved_since(asked) => {
                        // Opened while the primary moved, perhaps to the old one.
                        close(conn);
                        continue;
                    }
                    Some(conn) => (conn, asked),
                    // A kept connection was given back first: take it.
                    None => continue,
                },
            };
            // From here the connection is in a `Tx`: dropped unfinished (this future
            // cancelled), it is closed, never pooled in the middle of a transaction.
            let mut tx = Tx {
                conn: Some(conn),
                home: self.clone(),
                since,
                session_failed: false,
                grown: false,
                backend: None,
                claimed_in: None,
                seal: None,
            };
            for statement in begin {
                tx.send_ahead(statement.as_str());
            }
            return Ok((tx, from_pool));
        }
    }

    /// A connection from the pool; `None` when, from an exhausted pool of this consumer's own,
    /// a kept connection was given back first. There only this consumer's transactions hold the
    /// pool's connections, and they keep them: waiting on the pool alone would wait for ever
    /// (for `acquire_timeout`) while connections sit kept. While the pool may still open one,
    /// that is awaited: given up for a kept one, the half-opened connection was thrown away
    /// again and again (a server process started and ended each time; the server's CPU per
    /// delivery tripled in `idemhost bench`).
    ///
    /// Racing the pool, the pool's side runs in a task of its own: when the kept connection wins,
    /// whatever the pool then gives (it may be opening one) is kept for a later transaction, not
    /// thrown away half-opened.
    async fn take_from_pool(
        self: &Arc<Self>,
        returned: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
        deadline: Instant,
    ) -> Result<Option<PoolConnection<Postgres>>, sqlx::Error> {
        if !self.own_pool || !self.exhausted() {
            return self.pool.acquire().await.map(Some);
        }
        let pool = self.pool.clone();
        let asked = Instant::now();
        let mut acquiring = tokio::spawn(async move { pool.acquire().await });
        let lost = tokio::select! {
            got = &mut acquiring => return match got {
                Ok(conn) => conn.map(Some),
                Err(e) => Err(sqlx::Error::Protocol(format!("taking a connection from the pool failed: {e}"))),
            },
            () = returned => false,
            () = tokio::time::sleep_until(deadline.into()) => true,
        };
        // The pool's answer, when it comes, goes to the kept ones, as taken when it was asked
        // for (were the primary to move meanwhile, it would be closed at its next use).
        // Without holding the consumer's connections alive: dropped meanwhile (the consumer
        // stopped), they give theirs back to the pool, and this one goes there too.
        let this = Arc::downgrade(self);
        tokio::spawn(async move {
            if let Ok(Ok(conn)) = acquiring.await
                && let Some(this) = this.upgrade()
            {
                this.give_back(conn, asked);
            }
        });
        if lost {
            return Err(sqlx::Error::PoolTimedOut);
        }
        Ok(None)
    }

    /// Whether the primary moved after `at` (a connection taken from the pool before then,
    /// or opened while it moved, may be to the old one).
    fn moved_since(&self, at: Instant) -> bool {
        self.failover
            .get()
            .is_some_and(|failover| failover.moved_since(at))
    }

    /// Whether the pool has no connection to give and may open none.
    fn exhausted(&self) -> bool {
        self.pool.num_idle() == 0 && self.pool.size() >= self.pool.options().get_max_connections()
    }

    /// Gives every kept connection that is due back to the pool. Run on a timer (see
    /// [`Connections::new`]), not per transaction: the stack is last in, first out, so the ones
    /// under the top are not looked at by `begin`, which checks only the one it takes.
    fn sweep(&self) {
        let due: Vec<Kept> = match self.idle.lock() {
            Ok(mut idle) => {
                let (due, keep): (Vec<Kept>, Vec<Kept>) = idle
                    .drain(..)
                    .partition(|k| self.aged(k) || self.moved_since(k.since));
                *idle = keep;
                due
            }
            Err(_) => Vec::new(),
        };
        for kept in due {
            if self.moved_since(kept.since) {
                // Maybe to the old primary: closed, not given to the pool to test.
                close(kept.conn);
            }
        }
    }

    /// Whether a kept connection is due back to the pool: kept longer than `retire_after`, or
    /// unused longer than the pool's `idle_timeout`.
    fn aged(&self, kept: &Kept) -> bool {
        kept.since.elapsed() >= self.retire_after
            || self
                .idle_timeout
                .is_some_and(|t| kept.unused_since.elapsed() >= t)
    }

    /// Keeps `conn` for the next transaction, unless this consumer keeps enough already, a
    /// shared pool has none left to give (someone else may be waiting for one) or the
    /// connection is due back: then it goes back to the pool.
    pub(super) fn give_back(&self, conn: PoolConnection<Postgres>, since: Instant) {
        let exhausted = !self.own_pool && self.exhausted();
        let kept = Kept {
            conn,
            since,
            unused_since: Instant::now(),
        };
        if let Ok(mut idle) = self.idle.lock()
            && idle.len() < self.keep
            && !exhausted
            && !self.pool.is_closed()
            && !self.aged(&kept)
        {
            idle.push(kept);
            drop(idle);
            self.returned.notify_one();
        }
        // Otherwise dropped: back to the pool.
    }
}

/// Closes `conn` instead of giving it back to its pool.
fn close(mut conn: PoolConnection<Postgres>) {
    conn.close_on_drop();
}
