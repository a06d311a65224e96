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
pub(super) struct Gathering<T = (jetstream::Message, OwnedSemaphorePermit)> {
    pub(super) group: VecDeque<T>,
    pub(super) until: Option<tokio::time::Instant>,
    /// When the waiting deliveries are next told in progress.
    pub(super) progress_at: Option<tokio::time::Instant>,
}

impl<T> Default for Gathering<T> {
    fn default() -> Self {
        Gathering {
            group: VecDeque::new(),
            until: None,
            progress_at: None,
        }
    }
}

impl<T> Gathering<T> {
    /// Adds a pulled delivery; the first one starts the linger and the progress clock.
    pub(super) fn push(&mut self, delivery: T, linger: Duration, progress_every: Duration) {
        if self.group.is_empty() {
            let now = tokio::time::Instant::now();
            self.until = Some(now + linger);
            self.progress_at = Some(now + progress_every);
        }
        self.group.push_back(delivery);
    }

    /// The next group: up to `batch_max` of the waiting deliveries, in arrival order. What
    /// is left has waited its linger already: it is due as soon as a slot is free.
    pub(super) fn take(&mut self, batch_max: usize) -> Vec<T> {
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

#[cfg(test)]
mod tests {
    use super::*;

    const LONG: Duration = Duration::from_secs(3600);

    /// A group is due when it is full or its first delivery has waited the linger, never
    /// when empty; it is taken in arrival order, up to `batch_max`; what is left is due at
    /// once; an emptied gathering has no clocks, and the next delivery starts them again.
    #[test]
    fn a_group_is_due_full_or_after_its_linger_and_is_taken_in_arrival_order() {
        // (linger, deliveries pushed, batch_max) -> due, lingering.
        for (linger, pushed, batch_max, due, lingering) in [
            (LONG, 0, 4, false, false),
            (LONG, 1, 4, false, true),
            (LONG, 3, 4, false, true),
            (LONG, 4, 4, true, false),
            (LONG, 9, 4, true, false),
            (Duration::ZERO, 1, 4, true, false),
            (Duration::ZERO, 3, 16, true, false),
            (LONG, 1, 1, true, false),
        ] {
            let mut g = Gathering::default();
            for i in 0..pushed {
                g.push(i, linger, LONG);
            }
            assert_eq!(g.due(batch_max), due, "{linger:?} {pushed} {batch_max}");
            assert_eq!(
                g.lingering(batch_max),
                lingering,
                "{linger:?} {pushed} {batch_max}"
            );
        }

        let mut g = Gathering::default();
        for i in 0..10 {
            g.push(i, LONG, LONG);
        }
        assert!(g.progress_at.is_some());
        assert_eq!(g.take(4), [0, 1, 2, 3]);
        assert_eq!(g.take(4), [4, 5, 6, 7]);
        // The two left, fewer than a group, waited the first one's linger already: due.
        assert!(g.due(4) && !g.lingering(4));
        assert_eq!(g.take(4), [8, 9]);
        assert!(g.group.is_empty() && g.until.is_none() && g.progress_at.is_none());
        assert!(!g.due(4) && !g.lingering(4));
        assert!(g.take(4).is_empty());
        // A new first delivery starts a new linger.
        g.push(10, LONG, LONG);
        assert!(!g.due(4) && g.lingering(4) && g.progress_at.is_some());
    }
}
