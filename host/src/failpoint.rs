//! Named crash points for fault tests: with the `failpoints` feature, `IDEMHOST_FAILPOINT=<name>`
//! makes the process SIGKILL itself when it reaches that point. Without the feature, nothing.
//!
//! Points: `after_claim`, `in_handler` (a handler's statement has run in the delivery's
//! transaction and the handler has not returned yet), `before_commit`,
//! `after_commit_before_ack`, `outbox_after_publish` (the relay, after JetStream acknowledged
//! a batch and before its rows are deleted).

/// Whether `name` is the selected failpoint. Besides the crash points, `ungated` turns the
/// SQL gate off, so the plugin-wall tests can show what PostgreSQL's walls hold on their own.
#[cfg(feature = "failpoints")]
pub(crate) fn selected(name: &str) -> bool {
    use std::sync::OnceLock;
    static SELECTED: OnceLock<Option<String>> = OnceLock::new();
    let selected = SELECTED.get_or_init(|| std::env::var("IDEMHOST_FAILPOINT").ok());
    selected.as_deref() == Some(name)
}

/// Failpoints are compiled out of this build.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn selected(_name: &str) -> bool {
    false
}

/// Kills the process with SIGKILL if `name` is the selected failpoint.
#[cfg(feature = "failpoints")]
pub(crate) fn hit(name: &str) {
    if selected(name) {
        eprintln!("idemhost: failpoint {name} reached, killing the process");
        // SAFETY: kill(2) on our own pid has no memory-safety preconditions.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// Failpoints are compiled out of this build.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn hit(_name: &str) {}
