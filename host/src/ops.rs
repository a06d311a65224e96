//! What an operator runs against a deployment, as a library the CLI calls: proving a message's
//! marker and effect ([`check`]), marker table statistics and retention ([`markers`]), dead
//! letters ([`dlq`]), outbox rows the relay could not publish ([`outbox`]), pausing a consumer
//! on the server ([`pause`]); the connections they need, the admin endpoint's client
//! ([`admin`]) and the shared plugin store ([`NatsStore`]).

pub(crate) mod broker;
pub mod check;
pub mod dlq;
pub mod markers;
pub mod outbox;
pub mod pause;
pub(crate) mod sample;

use std::time::Duration;

pub(crate) use crate::clock::age_of;
pub use crate::config::postgres_url::{redact_url, redact_urls};
pub use crate::pg::{connect as connect_postgres, describe as describe_error};
pub use crate::registry::store::NatsStore;
pub use crate::source::connect_nats;

/// The admin endpoint's client: [`admin::probe`] (`idemhost health`) and the HTTP requests of
/// `idemhost plugin deploy | list | rollback`.
pub mod admin {
    pub use crate::admin::http::{Response, get, request, request_ok};
    pub use crate::admin::probe;
}

/// `1d 2h 3m`-style text for an age, to the second.
pub fn human(d: Duration) -> String {
    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
}
