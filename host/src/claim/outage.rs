//! A database outage costs no attempts: after an attempt failed because the server went away
//! or stopped taking writes, the delivery checks that the server really is unavailable, waits
//! in place for one that takes writes (`postgres.failover_wait`) and runs again uncounted.

use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::Claimer;

/// How often a delivery waiting for the database asks whether it takes writes again.
const DATABASE_PROBE_EVERY: Duration = Duration::from_millis(250);
/// How long one such question may take.
const DATABASE_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

impl Claimer {
    /// After an attempt failed because the server went away or stopped taking writes: whether
    /// the server really is unavailable now, and takes writes again within `wait_left` (which
    /// the wait uses up). Then the attempt runs again without counting toward `max_deliver`:
    /// a restart or a failover does not dead-letter good messages. A server that answers as a
    /// writable primary at once says the failure was this session's alone (a connection the
    /// host abandoned, a plugin's session ended): `false`, and the failure counts as before.
    /// A rehearsal (`plugin test`) never waits. The delivery's in-progress acks go on
    /// meanwhile, so the broker does not redeliver it.
    pub(super) async fn wait_for_database(&self, wait_left: &mut Duration, reason: &str) -> bool {
        if self.rehearsal.is_some() || wait_left.is_zero() || self.database_writable().await {
            return false;
        }
        let started = Instant::now();
        let budget = *wait_left;
        warn!(consumer = %self.settings.consumer_name, %reason, ?budget,
            "the database is unavailable; the delivery waits for it in place (not counted as an attempt)");
        let back = loop {
            if started.elapsed() >= budget {
                break false;
            }
            tokio::time::sleep(DATABASE_PROBE_EVERY.min(budget.saturating_sub(started.elapsed())))
                .await;
            if self.database_writable().await {
                break true;
            }
        };
        *wait_left = budget.saturating_sub(started.elapsed());
        if back {
            info!(consumer = %self.settings.consumer_name, waited = ?started.elapsed(),
                "the database takes writes again; the delivery runs again");
        } else {
            warn!(consumer = %self.settings.consumer_name, ?budget,
                "the database stayed unavailable past postgres.failover_wait; the failure counts");
        }
        back
    }

    /// Whether the host's pool reaches a server that takes writes (not in recovery), within
    /// [`DATABASE_PROBE_TIMEOUT`].
    async fn database_writable(&self) -> bool {
        let probe = sqlx::query_scalar::<_, bool>("SELECT pg_catalog.pg_is_in_recovery()")
            .fetch_one(&self.host_pool);
        matches!(
            tokio::time::timeout(DATABASE_PROBE_TIMEOUT, probe).await,
            Ok(Ok(false))
        )
    }
}
