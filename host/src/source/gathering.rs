//! Group commit's waiting room: deliveries pulled and not started yet.

use std::collections::VecDeque;
use std::time::Duration;

use async_nats::jetstream;
use tokio::sync::OwnedSemaphorePermit;

/// Group commit: deliveries pulled and not started yet, and when the next group must start.
/// Every delivery a pull request brings is read into it (the request's credits bound them), so
/// each one waiting is in one place where it is told in progress every third of `ack_wait`:
/// under load (a slow group, a deadlock the server breaks only after `deadlock_timeout`) the
/// broker must not redeliver what waits here.
#[derive(Default)]
pub(super) struct Gathering {
    pub(super) group: VecDeque<(jetstream::Message, OwnedSemaphorePermit)>,
    pub(super) until: Option<tokio::time::Instant>,
    /// When the waiting deliveries are next told in progress.
    pub(super) progress_at: Option<tokio::time::Instant>,
}

impl Gathering {
    /// Adds a pulled delivery; the first one starts the linger and the progress clock.
    pub(super) fn push(
        &mut self,
        delivery: (jetstream::Message, OwnedSemaphorePermit),
        linger: Duration,
        progress_every: Duration,
    ) {
        if self.group.is_empty() {
            let now = tokio::time::Instant::now();
            self.until = Some(now + linger);
            self.progress_at = Some(now + progress_every);
        }
        self.group.push_back(delivery);
    }

    /// The next group: up to `batch_max` of the waiting deliveries, in arrival order. What
    /// is left has waited its linger already: it is due as soon as a slot is free.
    pub(super) fn take(
        &mut self,
        batch_max: usize,
    ) -> Vec<(jetstream::Message, OwnedSemaphorePermit)> {
        let n = self.group.len().min(batch_max);
        let group = self.group.drain(..n).collect();
        if self.group.is_empty() {
            self.until = None;
            self.progress_at = None;
        } else {
            self.until = Some(tokio::time::Instant::now());
        }
        group
    }

    /// Whether the group should start as soon as a transaction slot is free: it is full, or
    /// its first delivery has waited `batch_linger`. Until a slot is free it keeps gathering,
    /// so under load batches grow. The pull loop also starts it when no group of the consumer
    /// runs (`GroupLimit::idle`), so at low load each delivery starts at once.
    pub(super) fn due(&self, batch_max: usize) -> bool {
        !self.group.is_empty()
            && (self.group.len() >= batch_max
                || self.until.is_some_and(|u| u <= tokio::time::Instant::now()))
    }

    /// Whether the group is waiting out its linger (not full, time not up).
    pub(super) fn lingering(&self, batch_max: usize) -> bool {
        self.group.len() < batch_max && self.until.is_some_and(|u| u > tokio::time::Instant::now())
    }
}
