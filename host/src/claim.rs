//! One delivery's transaction: `BEGIN` at the consumer's isolation, the claim statement, the
//! handler, `COMMIT` — and the decision of what the attempt was (`Outcome`), including the
//! bounded whole-transaction retry on serialization failure and deadlock.

/// Begins a transaction of `$connections` with `$begin` (statements) sent ahead of its first
/// statement, `$first`: an expression using `$tx`, the transaction (`&mut Tx`), that returns a
/// `Result<_, sqlx::Error>` (see `Connections::take`). A kept connection found broken is
/// dropped and the next one tried. Evaluates to `Result<(Tx, T), Begin>`. A macro, not a
/// function taking a closure: a closure borrowing the transaction made the delivery's future
/// not `Send` for the spawner.
macro_rules! begin_then {
    ($connections:expr, $begin:expr, |$tx:ident| $first:expr) => {
        loop {
            let (mut opened, from_pool) = match $connections.take($begin).await {
                Ok(taken) => taken,
                Err(e) => break Err(Begin::Refused(e)),
            };
            let $tx = &mut opened;
            match $first {
                Ok(done) => break Ok((opened, done)),
                Err(e) => {
                    if let Some(failed) = opened.first_failed(e, from_pool).await {
                        break Err(failed);
                    }
                }
            }
        }
    };
}

mod batch;
mod outage;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use sqlx::PgPool;
use tracing::{Instrument, debug, info_span};

use crate::config::{ConsumerConfig, Isolation};
use crate::disposition::{self, AfterAttempt};
use crate::failpoint;
use crate::handler::{Handler, HandlerError, Message};
use crate::outbox::Origin;
use crate::pg::{self, Begin, Connections, Tx, Wall};
use crate::tx_handle::{Deadline, TxHandle};

pub(crate) use crate::outcome::{Failure, FailureKind, Outcome, Processed, Rollback};

/// The pattern's claim statement, verbatim: one row back means this transaction owns the
/// message, none means a committed duplicate. The host runs it inside the `SECURITY DEFINER`
/// function `idemhost_claim` (migration 0006) with the consumer and id bound as parameters,
/// recording the plugin version beside a new marker in the same call; a group-commit batch
/// claims its ids in one `INSERT ... SELECT ... FROM unnest(ids) ORDER BY id` the same way.
pub const CLAIM_SQL: &str = "INSERT INTO processed_message (consumer_name, message_id) \
     VALUES ($1, $2) \
     ON CONFLICT DO NOTHING \
     RETURNING message_id";

/// Where an attempt's time went.
#[derive(Default)]
struct Timing {
    claim: Duration,
    handler: Option<Duration>,
}

/// `postgres.failover_wait`'s default.
const DEFAULT_FAILOVER_WAIT: Duration = Duration::from_secs(60);

/// Per-consumer settings of the transaction.
#[derive(Debug, Clone)]
pub struct ClaimSettings {
    /// The marker's `consumer_name`.
    pub consumer_name: String,
    /// The transaction's isolation level.
    pub isolation: Isolation,
    /// `statement_timeout` of every statement in the transaction.
    pub statement_timeout: Duration,
    /// Transactions tried, at most, after serialization failures and deadlocks.
    pub tx_max_attempts: u32,
    /// Wall-clock budget of one handler call (`handler_timeout`): a plugin statement still
    /// running past it is stopped on the server and the attempt fails. `None`: unbounded
    /// (native handlers embedded without one).
    pub attempt_timeout: Option<Duration>,
    /// Subjects the handler may publish to through the outbox (`publish_subjects`).
    pub publish_subjects: Arc<[String]>,
    /// The host's inbox prefix (`nats.inbox_prefix`): never a subject the handler publishes to.
    pub inbox_prefix: Arc<str>,
    /// First retry delay ceiling; doubles each retry up to `retry_cap` (full jitter).
    pub retry_base: Duration,
    /// The ceiling the retry delay doubles up to.
    pub retry_cap: Duration,
    /// Connections kept between deliveries rather than given back to the pool (see
    /// `Connections`). The host gives each consumer its `max_in_flight`, or its share of the
    /// pool when the consumers' sum does not fit; [`ClaimSettings::new`] keeps none. Kept
    /// connections count against the pool's `max_connections` while idle.
    pub keep_connections: usize,
    /// The longest a group-commit transaction waits for a lock (`batch_lock_timeout`; `None`:
    /// as long as the server lets it). See `Wall::begin_group_sql`.
    pub group_lock_timeout: Option<Duration>,
    /// Whether the delivery connections log in with the server's `synchronous_commit` and
    /// this `statement_timeout` (see `pg::wall::login_settings`): the transactions then set
    /// neither. `false`: each transaction sets both.
    pub settings_at_login: bool,
    /// How long a delivery waits, at most, for a server that went away or stopped taking
    /// writes, before its failure counts (`postgres.failover_wait`; see
    /// the claimer's `wait_for_database`). Zero: it never waits.
    pub failover_wait: Duration,
}

impl ClaimSettings {
    /// The settings a consumer's configuration gives (no kept connections).
    pub fn for_consumer(c: &ConsumerConfig) -> Self {
        ClaimSettings {
            consumer_name: c.name.clone(),
            isolation: c.isolation,
            statement_timeout: c.statement_timeout(),
            tx_max_attempts: c.tx_max_attempts,
            attempt_timeout: Some(c.handler_timeout.0),
            publish_subjects: Arc::from(c.publish_subjects.clone()),
            inbox_prefix: Arc::from("_INBOX"),
            retry_base: Duration::from_millis(10),
            retry_cap: Duration::from_secs(1),
            keep_connections: c.max_in_flight as usize,
            group_lock_timeout: Some(c.batch_lock_timeout.0).filter(|t| !t.is_zero()),
            settings_at_login: false,
            failover_wait: DEFAULT_FAILOVER_WAIT,
        }
    }

    /// Settings with the defaults of a config file entry, for embedding and tests.
    pub fn new(consumer_name: impl Into<String>, isolation: Isolation) -> Self {
        ClaimSettings {
            consumer_name: consumer_name.into(),
            isolation,
            statement_timeout: Duration::from_secs(5),
            tx_max_attempts: 5,
            attempt_timeout: Some(Duration::from_secs(5)),
            publish_subjects: Arc::from(Vec::new()),
            inbox_prefix: Arc::from("_INBOX"),
            retry_base: Duration::from_millis(10),
            retry_cap: Duration::from_secs(1),
            keep_connections: 0,
            group_lock_timeout: Some(crate::config::DEFAULT_BATCH_LOCK_TIMEOUT),
            settings_at_login: false,
            failover_wait: DEFAULT_FAILOVER_WAIT,
        }
    }
}

/// Runs deliveries of one consumer through claim, handler and commit. Clones (a consumer's
/// partitions) share its connections.
#[derive(Clone)]
pub struct Claimer {
    /// Connections deliveries run on: logged in as the plugin's role (see [`pg::wall`]), or
    /// the host's own for an embedded native handler.
    connections: Arc<Connections>,
    /// The host's own role: the host key, marker lookups, stopping a statement at its deadline.
    host_pool: PgPool,
    settings: ClaimSettings,
    wall: tokio::sync::OnceCell<Arc<Wall>>,
    /// This consumer's turn at the SQL gate's shared parser threads: one statement at a time.
    gate_turn: Arc<tokio::sync::Semaphore>,
    /// Set for a rehearsal (`idemhost plugin test`): record what the handler did, and roll
    /// back where a delivery would commit unless told to commit.
    rehearsal: Option<Rehearsal>,
}

/// How a rehearsal ends and where it records.
#[derive(Clone)]
pub(crate) struct Rehearsal {
    pub(crate) trace: Arc<crate::tx_handle::Trace>,
    /// Commit as a delivery would (`plugin test --commit`); else roll back.
    pub(crate) commit: bool,
}

/// The failure of a statement the claim pipeline sent: `context` and the server's words.
fn db_failure(context: &str, e: &sqlx::Error) -> Failure {
    pg::failure(format!("{context}: {}", pg::describe(e)), e)
}

/// Whether a handler's attempt must roll back, from its answer and the first database error
/// it saw.
fn judge(result: Result<(), HandlerError>, poison: Option<Failure>) -> Option<Failure> {
    // A serialization failure inside the handler retries the whole transaction whatever
    // the handler answered, a statement past the server's limits fails for good; otherwise the
    // handler's own error wins; an `Ok` after a database error is never committed (the
    // transaction is aborted in PostgreSQL).
    match (result, poison) {
        (_, Some(p)) if p.kind == FailureKind::RetryTransaction => Some(Failure {
            cause: Rollback::Conflict,
            ..p
        }),
        // Past the server's own limits: running it again costs the server as much again.
        (_, Some(p)) if p.past_limits => Some(Failure {
            kind: FailureKind::Terminal,
            cause: Rollback::Database,
            ..p
        }),
        (Err(e), poison) => {
            let (kind, cause, reason) = match e {
                HandlerError::Retryable(r) => {
                    (FailureKind::Retryable, Rollback::HandlerRetryable, r)
                }
                HandlerError::Terminal(r) => (FailureKind::Terminal, Rollback::HandlerTerminal, r),
            };
            Some(match poison {
                // A handler passing on a failed statement's error: the database is the cause,
                // the handler's answer the kind and the text.
                Some(p) => Failure {
                    kind,
                    cause: Rollback::Database,
                    reason,
                    ..p
                },
                None => Failure::new(kind, cause, reason),
            })
        }
        (Ok(()), Some(p)) => Some(Failure {
            reason: format!("handler returned ok after a database error: {}", p.reason),
            ..p
        }),
        (Ok(()), None) => None,
    }
}

impl Claimer {
    /// Deliveries on connections of `pool`'s own role: for native handlers embedded in a
    /// program (trusted code). Plugins get [`Claimer::with_plugin_pool`].
    pub fn new(pool: PgPool, settings: ClaimSettings) -> Self {
        let connections = Connections::new(pool.clone(), settings.keep_connections);
        Self::on(pool, connections, settings)
    }

    /// Deliveries on connections of `plugin_pool` (logged in as the consumer's role); the
    /// host's own statements outside a delivery on `host_pool`. A `plugin_pool` other than
    /// `host_pool` must be this consumer's alone: its connections are kept between deliveries
    /// even while it has none left to give.
    pub fn with_plugin_pool(
        host_pool: PgPool,
        plugin_pool: PgPool,
        settings: ClaimSettings,
    ) -> Self {
        // The same pool for both (as `Claimer::new` has it) is not one of its own: the host's
        // statements take connections from it too.
        let shared = Arc::ptr_eq(&host_pool.connect_options(), &plugin_pool.connect_options());
        let keep = settings.keep_connections;
        let connections = if shared {
            Connections::new(plugin_pool, keep)
        } else {
            Connections::of_own_pool(plugin_pool, keep)
        };
        Self::on(host_pool, connections, settings)
    }

    fn on(host_pool: PgPool, connections: Arc<Connections>, settings: ClaimSettings) -> Self {
        Claimer {
            connections,
            host_pool,
            settings,
            wall: tokio::sync::OnceCell::new(),
            gate_turn: Arc::new(tokio::sync::Semaphore::new(1)),
            rehearsal: None,
        }
    }

    /// Its kept connections follow `failover` (see [`Connections::follow`]).
    pub(crate) fn following(self, failover: &Arc<pg::Failover>) -> Self {
        self.connections.follow(failover.clone());
        self
    }

    /// Events of this claimer's handlers are never published under `inbox_prefix`, the
    /// host's own (`nats.inbox_prefix`).
    pub(crate) fn sparing_inbox(mut self, inbox_prefix: &str) -> Self {
        self.settings.inbox_prefix = Arc::from(inbox_prefix);
        self
    }

    /// This claimer rehearses deliveries: see [`Rehearsal`]. Only the per-message path
    /// ([`Claimer::process`]) rehearses; a group-commit batch always commits.
    pub(crate) fn rehearsing(mut self, rehearsal: Rehearsal) -> Self {
        self.rehearsal = Some(rehearsal);
        self
    }

    /// The host key and function names, read once from the host's pool.
    async fn wall(&self) -> Result<Arc<Wall>, Failure> {
        self.wall
            .get_or_try_init(|| async {
                let s = &self.settings;
                Wall::load_for(
                    &self.host_pool,
                    s.isolation,
                    s.statement_timeout,
                    s.group_lock_timeout,
                    s.settings_at_login,
                )
                .await
                .map(Arc::new)
            })
            .await
            .cloned()
            .map_err(|e| Failure {
                cause: Rollback::Connection,
                ..db_failure("failed to read the host key", &e)
            })
    }

    /// The schema's host key (it signs the replay ids the host honours).
    pub(crate) async fn host_key(&self) -> Result<String, String> {
        self.wall()
            .await
            .map(|w| w.key.clone())
            .map_err(|f| f.reason)
    }

    /// How to end the session of backend `pid` from the host's side.
    fn backend(&self, pid: i32) -> pg::Backend {
        pg::Backend {
            host_pool: self.host_pool.clone(),
            pid,
        }
    }

    /// The settings this claimer runs with.
    pub fn settings(&self) -> &ClaimSettings {
        &self.settings
    }

    /// Whether a delivery of message `id` committed for this consumer (its marker exists).
    pub async fn marker_exists(&self, id: &str) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM processed_message WHERE consumer_name = $1 AND message_id = $2)",
        )
        .bind(&self.settings.consumer_name)
        .bind(id)
        .fetch_one(&self.host_pool)
        .await
    }

    /// Processes one delivery: claims its marker and runs `handler` in one transaction,
    /// retrying the whole transaction on 40001/40P01 up to `tx_max_attempts`.
    pub async fn process(&self, handler: &dyn Handler, msg: &Message) -> Processed {
        self.process_from(handler, msg, 1).await
    }

    /// [`Self::process`], counting transaction attempts from `attempt` (a group-commit batch
    /// abandoned on a conflict was the first).
    async fn process_from(
        &self,
        handler: &dyn Handler,
        msg: &Message,
        mut attempt: u32,
    ) -> Processed {
        // What is left of this delivery's wait for the database (`failover_wait`).
        let mut wait_left = self.settings.failover_wait;
        let mut database_waits = 0u32;
        loop {
            let started = Instant::now();
            let span = info_span!("idemhost.claim", tx_attempt = attempt);
            let mut timing = Timing::default();
            let result = self
                .attempt(handler, msg, &mut timing)
                .instrument(span)
                .await;
            let done = |outcome, failure: Option<Failure>| Processed {
                outcome,
                tx_attempts: attempt,
                claim_time: timing.claim,
                tx_time: started.elapsed(),
                handler_time: timing.handler,
                rollback: failure.as_ref().map(Failure::cause),
                database_waits,
                failure,
            };
            let f = match result {
                Ok(outcome) => return done(outcome, None),
                Err(f) => f,
            };
            let max = self.settings.tx_max_attempts;
            let mut next = disposition::after_attempt(&f, attempt, max, true);
            if next == AfterAttempt::WaitForDatabase {
                if self.wait_for_database(&mut wait_left, &f.reason).await {
                    database_waits += 1;
                    continue;
                }
                next = disposition::after_attempt(&f, attempt, max, false);
            }
            match next {
                AfterAttempt::RetryTransaction => {
                    let delay = self.retry_delay(attempt);
                    debug!(reason = %f.reason, attempt, ?delay, "transaction retry");
                    tokio::time::sleep(delay).await;
                    attempt += 1;
                }
                AfterAttempt::Settle(outcome) => return done(outcome, Some(f)),
                // Not an answer with waiting used up; as `Settle` would be.
                AfterAttempt::WaitForDatabase => return done(f.outcome(), Some(f)),
            }
        }
    }

    /// Full jitter: uniform in `[0, min(cap, base * 2^(attempt-1))]`.
    fn retry_delay(&self, attempt: u32) -> Duration {
        let ceiling = self
            .settings
            .retry_base
            .saturating_mul(1u32 << (attempt - 1).min(16))
            .min(self.settings.retry_cap);
        let micros = rand::rng().random_range(0..=ceiling.as_micros() as u64);
        Duration::from_micros(micros)
    }

    async fn attempt(
        &self,
        handler: &dyn Handler,
        msg: &Message,
        timing: &mut Timing,
    ) -> Result<Outcome, Failure> {
        if let Some(r) = &self.rehearsal {
            r.trace.new_attempt();
        }
        let wall = self.wall().await?;
        // The BEGIN goes ahead of the claim, in its round trip.
        let begun = begin_then!(self.connections, &wall.begin_statements, |tx| self
            .claim(tx, &wall, handler, msg, timing, true)
            .await);
        let (tx, (claimed, backend_pid)) = match begun {
            Ok((mut tx, c)) => {
                tx.stoppable(self.backend(c.1));
                (tx, c)
            }
            Err(Begin::First(mut tx, e)) => {
                tx.note_failure(&e);
                rollback(tx, &wall).await;
                return Err(db_failure("failed to claim marker", &e));
            }
            Err(Begin::Refused(e)) => return Err(not_begun(&e)),
        };
        if !claimed {
            return self
                .finish(tx, &wall, Outcome::Duplicate)
                .await
                .map_err(|e| db_failure("failed to commit duplicate", &e));
        }
        let (tx, failure) = self
            .lend(tx, &wall, backend_pid, handler, msg, timing)
            .await?;
        if let Some(failure) = failure {
            rollback(tx, &wall).await;
            return Err(failure);
        }
        failpoint::hit("before_commit");
        self.finish(tx, &wall, Outcome::Applied)
            .await
            .map_err(|e| db_failure("failed to commit", &e))
    }

    /// Commits a transaction that reached `outcome` — or, in a rehearsal not told to commit,
    /// rolls it back and reports the outcome the commit would have had.
    async fn finish(&self, tx: Tx, wall: &Wall, outcome: Outcome) -> Result<Outcome, sqlx::Error> {
        match &self.rehearsal {
            Some(r) if !r.commit => tx.rollback_with(&wall.rollback_sql).await,
            _ => tx.commit_with(&wall.commit_sql).await,
        }
        .map(|()| outcome)
    }

    /// Opens a transaction with `begin` (one of the wall's `BEGIN` statements).
    async fn begin_with(&self, begin: &str) -> Result<Tx, Failure> {
        self.connections
            .begin(begin)
            .await
            .map(|(tx, _)| tx)
            .map_err(|e| not_begun(&e))
    }

    /// Claims `msg`'s marker through the host's function, the consumer, id and plugin version
    /// bound as parameters (never written into the SQL text); whether this transaction now
    /// owns the marker, and the session's backend (to stop it at the deadline).
    ///
    /// `cached`: the statement is prepared once per session and kept — only where no plugin
    /// code ran in this transaction yet (the session's clearing at the end of the last one
    /// closes a session left with SQL-level prepared statements). After a plugin ran (a group's
    /// next part) it is sent unnamed: a cached one could have been deallocated and prepared
    /// again by the plugin as its own, and run with the host key (review, gate off).
    async fn claim(
        &self,
        tx: &mut Tx,
        wall: &Wall,
        handler: &dyn Handler,
        msg: &Message,
        timing: &mut Timing,
        cached: bool,
    ) -> Result<(bool, i32), sqlx::Error> {
        let started = Instant::now();
        let claimed = sqlx::query_as::<_, (bool, i32, Option<String>)>(sqlx::AssertSqlSafe(
            wall.claim_sql.clone(),
        ))
        .persistent(cached)
        .bind(&wall.key)
        .bind(&self.settings.consumer_name)
        .bind(&msg.id)
        .bind(handler.digest())
        .fetch_one(&mut **tx)
        .await;
        timing.claim = started.elapsed();
        let (claimed, pid, xid) = claimed?;
        tx.claimed_in(xid)?;
        Ok((claimed, pid))
    }

    /// Claims all of `ids` in one statement (see [`CLAIM_SQL`]); the ids this transaction now
    /// owns, and the session's backend.
    async fn claim_all(
        &self,
        tx: &mut Tx,
        wall: &Wall,
        handler: &dyn Handler,
        ids: &[&str],
    ) -> Result<(Vec<String>, i32), sqlx::Error> {
        let mut claim = sqlx::query_scalar(sqlx::AssertSqlSafe(wall.claim_all_sql.clone()))
            .bind(&wall.key)
            .bind(&self.settings.consumer_name)
            .bind(ids)
            .bind(handler.digest());
        // The group's seal: only the host's commit, which names it, may commit the claims.
        let seal = wall
            .sealed
            .then(|| format!("{:032x}", rand::random::<u128>()));
        if let Some(seal) = &seal {
            claim = claim.bind(seal);
        }
        let claimed: Vec<Option<String>> = claim.fetch_all(&mut **tx).await?;
        if let Some(seal) = seal {
            tx.sealed(seal);
        }
        let (pid, xid): (i32, Option<String>) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT pg_catalog.pg_backend_pid(), {}",
            crate::pg::CURRENT_XID
        )))
        .fetch_one(&mut **tx)
        .await?;
        tx.claimed_in(xid)?;
        Ok((claimed.into_iter().flatten().collect(), pid))
    }

    /// Lends the claimed transaction to the handler and takes it back, with the reason it
    /// must roll back if it must.
    async fn lend(
        &self,
        tx: Tx,
        wall: &Arc<Wall>,
        backend_pid: i32,
        handler: &dyn Handler,
        msg: &Message,
        timing: &mut Timing,
    ) -> Result<(Tx, Option<Failure>), Failure> {
        failpoint::hit("after_claim");
        let origin = Origin::new(&self.settings.consumer_name, &msg.id, &msg.headers)
            .allowing(self.settings.publish_subjects.clone())
            .sparing_inbox(self.settings.inbox_prefix.clone());
        let deadline = self.settings.attempt_timeout.map(|budget| Deadline {
            at: tokio::time::Instant::now() + budget,
            host_pool: self.host_pool.clone(),
            backend_pid,
        });
        let trace = self.rehearsal.as_ref().map(|r| r.trace.clone());
        let handle =
            TxHandle::new(tx, origin, wall.clone(), deadline, self.gate_turn.clone()).traced(trace);
        let started = Instant::now();
        let result = handler
            .handle(&handle, msg)
            .instrument(info_span!("idemhost.plugin.handle"))
            .await;
        timing.handler = Some(started.elapsed());
        let (tx, poison) = handle.take().await;
        let tx = tx.ok_or_else(|| Failure {
            unavailable: poison.as_ref().is_some_and(|p| p.unavailable),
            ..Failure::new(
                FailureKind::Retryable,
                Rollback::Connection,
                poison.as_ref().map_or_else(
                    || "transaction lost during the handler".into(),
                    |p| p.reason.clone(),
                ),
            )
        })?;
        Ok((tx, judge(result, poison)))
    }
}

/// A transaction that did not begin: no connection, or the server refused the `BEGIN`.
fn not_begun(e: &sqlx::Error) -> Failure {
    Failure {
        cause: Rollback::Connection,
        ..db_failure("failed to begin transaction", e)
    }
}

/// Rolls an abandoned transaction back, within the rollback grace (a failed or late
/// ROLLBACK discards the connection).
async fn rollback(tx: Tx, wall: &Wall) {
    if let Err(e) = tx.rollback_within_grace(&wall.rollback_sql).await {
        debug!(error = %pg::describe(&e), "rollback failed; the connection is discarded");
    }
}

#[cfg(test)]
mod tests;
