//! What an operator runs against a deployment, as a library the CLI calls: proving a message's
//! marker and effect ([`check`]), marker table statistics and retention ([`markers`]), dead
//! letters ([`dlq`]), outbox rows the relay could not publish ([`outbox`]), and the broker queries they and the metrics samplers share ([`broker`]).

pub mod broker;
pub mod check;
pub mod dlq;
pub mod markers;
pub mod outbox;
pub mod pause;

use std::time::Duration;

pub use crate::clock::age_of;

/// `1d 2h 3m`-style text for an age, to the second.
pub fn human(d: Duration) -> String {
    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
}
