//! The handler contract shared by WASM plugins and native Rust handlers: the message a handler
//! sees, the error it may return, and the [`Handler`] trait the claim pipeline calls.

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;

use crate::tx_handle::TxHandle;

/// One delivery of one message, as a handler sees it.
#[derive(Debug, Clone)]
pub struct Message {
    /// The producer's stable message id (the marker's `message_id`).
    pub id: String,
    /// The subject the message was published on.
    pub subject: String,
    /// `Idemhost-Event-Type` when the producer set it.
    pub event_type: Option<String>,
    /// All headers, sorted by name; a header with several values appears once per value.
    pub headers: Vec<(String, String)>,
    /// The message body, as the producer sent it.
    pub payload: Bytes,
    /// Delivery attempt counted by the broker, 1 for the first.
    pub delivery_attempt: u32,
}

impl Message {
    /// The event type for logs and metrics: the header when set, else the subject.
    pub fn event_type_or_subject(&self) -> &str {
        self.event_type.as_deref().unwrap_or(&self.subject)
    }
}

/// Why a handler gave up on a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandlerError {
    /// Roll back; the broker redelivers after a backoff (until `max_deliver`).
    #[error("retryable: {0}")]
    Retryable(String),
    /// Roll back; dead-letter the message with this reason; never redeliver.
    #[error("terminal: {0}")]
    Terminal(String),
}

/// The future a handler returns.
pub type HandleFuture<'a> = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'a>>;

/// A message handler. The host has already claimed the message's marker in `tx` and commits
/// after `handle` returns `Ok`; `tx` is the handler's only access to the database.
///
/// Implemented by the WASM plugin runtime and by native Rust handlers that embed the library.
pub trait Handler: Send + Sync + 'static {
    /// Handles one delivery of `msg` in the transaction `tx`: `Ok` commits, an error rolls back.
    fn handle<'a>(&'a self, tx: &'a TxHandle, msg: &'a Message) -> HandleFuture<'a>;

    /// A short description for logs (`wasm sha256:…` or a native handler's name).
    fn describe(&self) -> String;

    /// The version recorded with each message this handler applies
    /// (`processed_message_handler.plugin_digest`): a WASM plugin's `sha256:<hex>`. `None`
    /// (native handlers, by default) records nothing.
    fn digest(&self) -> Option<&str> {
        None
    }

    /// Where a plugin's calls spend their time (instantiation, the call): WASM plugins only.
    fn timings(&self) -> Option<&PluginTimings> {
        None
    }
}

/// Where a plugin's deliveries spend their time, recorded by every call.
#[derive(Default)]
pub struct PluginTimings {
    /// Creating the store and instantiating the component.
    pub instantiate: crate::histogram::LatencyHistogram,
    /// The `handle` call itself, including the SQL it runs.
    pub handle: crate::histogram::LatencyHistogram,
}
