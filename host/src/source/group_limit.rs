//! How many group-commit transactions a consumer runs at once: `max_in_flight` while groups
//! commit cleanly, fewer after they meet conflicts.
//!
//! Groups hold their row locks until their last handler returns, so handlers that update the
//! same rows in different orders deadlock across groups, and PostgreSQL breaks a deadlock only
//! after `deadlock_timeout` (1 s by default) — then the group is sent back one delivery at a
//! time. A group that met a serialization failure or deadlock halves the number of groups
//! allowed at once (at least one); as many clean groups in a row as are allowed raise it by one,
//! up to `max_in_flight` (additive increase, multiplicative decrease, as TCP does). The limit is
//! kept in the consumer's slot semaphore itself: permits are forgotten as they come back while
//! the limit is below the permits in circulation, and added when it rises again.

use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The limit and the slot semaphore it governs.
pub(super) struct GroupLimit {
    slots: Arc<Semaphore>,
    max: usize,
    state: Mutex<State>,
    /// Told when a group's slot comes back and no group runs any more (see
    /// [`GroupLimit::became_idle`]).
    idle_now: tokio::sync::Notify,
}

/// Permits in existence (available or held) are always `limit + debt`.
struct State {
    limit: usize,
    /// Permits still to be forgotten as they come back.
    debt: usize,
    /// Groups that committed without a conflict since the limit last changed.
    clean: usize,
}

impl State {
    /// Whether every permit in existence (`limit + debt`) is free in `slots`: no group runs.
    fn all_free(&self, slots: &Semaphore) -> bool {
        slots.available_permits() >= self.limit + self.debt
    }
}

impl GroupLimit {
    /// A limit of `max` on `slots`, which must hold `max` permits.
    pub(super) fn new(slots: Arc<Semaphore>, max: usize) -> Self {
        GroupLimit {
            slots,
            max: max.max(1),
            state: Mutex::new(State {
                limit: max.max(1),
                debt: 0,
                clean: 0,
            }),
            idle_now: tokio::sync::Notify::new(),
        }
    }

    /// Whether no group's transaction is running: every permit in existence is free.
    pub(super) fn idle(&self) -> bool {
        self.state.lock().is_ok_and(|s| s.all_free(&self.slots))
    }

    /// Completes once a group's slot came back leaving no group running (at once if that
    /// happened since the last wait: a lingering group then looks again, and starts).
    pub(super) async fn became_idle(&self) {
        self.idle_now.notified().await;
    }

    /// Gives back a group's slot once its transaction is over. `conflicted`: it met a
    /// serialization failure or deadlock; `size`: its deliveries — only a group of several
    /// counts as clean (a delivery alone holds its locks too briefly to show that groups no
    /// longer collide, and at low load every group is one). The limit after it.
    pub(super) fn release(
        &self,
        slot: OwnedSemaphorePermit,
        conflicted: bool,
        size: usize,
    ) -> usize {
        // A poisoned lock (a panic elsewhere while holding it) keeps the slot as it is.
        let Ok(mut s) = self.state.lock() else {
            return self.max;
        };
        if conflicted {
            let lower = (s.limit / 2).max(1);
            s.debt += s.limit - lower;
            s.limit = lower;
            s.clean = 0;
        } else if size > 1 {
            s.clean += 1;
            if s.clean >= s.limit && s.limit < self.max {
                s.clean = 0;
                s.limit += 1;
                if s.debt > 0 {
                    s.debt -= 1;
                } else {
                    self.slots.add_permits(1);
                }
            }
        }
        if s.debt > 0 {
            s.debt -= 1;
            slot.forget();
        } else {
            drop(slot);
        }
        // Permits nobody holds are forgotten at once; the others as they come back.
        if s.debt > 0 {
            let forgotten = self.slots.forget_permits(s.debt);
            s.debt -= forgotten;
        }
        if s.all_free(&self.slots) {
            self.idle_now.notify_one();
        }
        s.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn take(slots: &Arc<Semaphore>, n: usize) -> Vec<OwnedSemaphorePermit> {
        let mut held = Vec::new();
        for _ in 0..n {
            held.push(slots.clone().acquire_owned().await.unwrap());
        }
        held
    }

    /// A conflict halves the groups allowed at once (permits nobody holds at once, the others
    /// as groups end), clean groups raise it one at a time back to `max_in_flight`, and never
    /// past it. With no group running, the free permits are the limit.
    #[tokio::test]
    async fn conflicts_halve_the_groups_and_clean_groups_restore_them() {
        let slots = Arc::new(Semaphore::new(8));
        let limit = GroupLimit::new(slots.clone(), 8);
        // One group of 8 running meets a conflict: 4 allowed, the other 7 free permits shrink.
        let one = take(&slots, 1).await.pop().unwrap();
        assert_eq!(limit.release(one, true, 8), 4);
        assert_eq!(slots.available_permits(), 4);
        // All 4 running; one conflicts, the others end cleanly.
        let mut held = take(&slots, 4).await;
        assert_eq!(limit.release(held.pop().unwrap(), true, 8), 2);
        let mut last = 2;
        for p in held.drain(..) {
            last = limit.release(p, false, 8);
        }
        assert_eq!(slots.available_permits(), last);
        // Conflicts down to one group at a time, never zero.
        for _ in 0..5 {
            let p = take(&slots, 1).await.pop().unwrap();
            last = limit.release(p, true, 8);
        }
        assert_eq!(last, 1);
        assert_eq!(slots.available_permits(), 1);
        // Deliveries alone prove nothing: the limit stays.
        for _ in 0..20 {
            let p = take(&slots, 1).await.pop().unwrap();
            last = limit.release(p, false, 1);
        }
        assert_eq!(last, 1);
        // Clean groups raise it back to 8, one step per window, and no further.
        for _ in 0..100 {
            let p = take(&slots, 1).await.pop().unwrap();
            last = limit.release(p, false, 8);
        }
        assert_eq!(last, 8);
        assert_eq!(slots.available_permits(), 8);
    }
}
