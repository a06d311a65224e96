//! Ages of broker timestamps against the wall clock.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Time since `unix_ns` (nanoseconds since the epoch); zero if it is in the future.
pub(crate) fn age_of(unix_ns: i128) -> Duration {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128);
    u64::try_from(now - unix_ns).map_or(Duration::ZERO, Duration::from_nanos)
}
