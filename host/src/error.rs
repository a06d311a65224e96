//! The library's error: what `Host::run`, `migrate`, `PluginRuntime::new` and the operator
//! functions of `ops` return. Its text is the whole account, outermost first (`{:#}` joins
//! the causes with `: `); [`Error::kind`] says which side failed and [`Error::sqlstate`] what
//! PostgreSQL answered, so that an embedder can act on it without parsing text.

use std::fmt;

/// Which side an [`Error`] came from: the first cause in its chain that says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The configuration was refused (a key, a value, a combination).
    Config,
    /// PostgreSQL failed or refused ([`Error::sqlstate`] when it answered).
    Database,
    /// NATS or JetStream failed or refused.
    Broker,
    /// A plugin could not be read, compiled or instantiated.
    Plugin,
    /// A file or the network, outside both servers' protocols.
    Io,
    /// Anything else: the text says.
    Other,
}

/// An error of the library (see the module's documentation).
pub struct Error {
    inner: anyhow::Error,
    /// Set where a layer above this module knew better (see [`Error::of_kind`]).
    kind: Option<ErrorKind>,
}

impl Error {
    /// Which side failed.
    pub fn kind(&self) -> ErrorKind {
        self.kind.unwrap_or_else(|| {
            self.inner
                .chain()
                .find_map(kind_of)
                .unwrap_or(ErrorKind::Other)
        })
    }

    /// `inner`, of the `kind` a layer above this module found (one whose error types this
    /// module does not know: the configuration's, the plugins').
    pub(crate) fn of_kind(inner: anyhow::Error, kind: ErrorKind) -> Error {
        Error {
            inner,
            kind: Some(kind),
        }
    }

    /// The SQLSTATE PostgreSQL answered with, when a cause is its answer.
    pub fn sqlstate(&self) -> Option<String> {
        self.inner.chain().find_map(|cause| {
            if let Some(c) = cause.downcast_ref::<Cause>() {
                return c.sqlstate.clone();
            }
            match cause.downcast_ref() {
                Some(sqlx::Error::Database(db)) => db.code().map(|c| c.into_owned()),
                _ => None,
            }
        })
    }
}

/// The kind `cause` says, if it is one of the errors this module knows: the host's own accounts
/// ([`Cause`]), the database driver's, the broker client's, I/O.
pub(crate) fn kind_of(cause: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
    if let Some(c) = cause.downcast_ref::<Cause>() {
        Some(c.kind)
    } else if cause.is::<sqlx::Error>() || cause.is::<sqlx::migrate::MigrateError>() {
        Some(ErrorKind::Database)
    } else if is_broker(cause) {
        Some(ErrorKind::Broker)
    } else if cause.is::<std::io::Error>() {
        Some(ErrorKind::Io)
    } else {
        None
    }
}

/// Whether `cause` is one of async-nats's errors (connecting, requests, JetStream's).
fn is_broker(cause: &(dyn std::error::Error + 'static)) -> bool {
    use async_nats::jetstream::{context, kv, stream};
    cause.is::<async_nats::ConnectError>()
        || cause.is::<async_nats::SubscribeError>()
        || cause.is::<async_nats::PublishError>()
        || cause.is::<async_nats::RequestError>()
        || cause.is::<context::CreateStreamError>()
        || cause.is::<context::GetStreamError>()
        || cause.is::<context::PublishError>()
        || cause.is::<context::CreateKeyValueError>()
        || cause.is::<context::KeyValueError>()
        || cause.is::<kv::EntryError>()
        || cause.is::<kv::PutError>()
        || cause.is::<kv::WatchError>()
        || cause.is::<stream::ConsumerError>()
        || cause.is::<stream::InfoError>()
        || cause.is::<async_nats::jetstream::object_store::GetError>()
        || cause.is::<async_nats::jetstream::object_store::PutError>()
}

/// A cause whose text is already the whole account (the host's message, the server's answer
/// and a hint in one line), carrying what [`Error`] reports of it: made where a database or
/// broker failure is described for an operator, so that the typed error is not lost with it.
#[derive(Debug)]
pub(crate) struct Cause {
    kind: ErrorKind,
    sqlstate: Option<String>,
    text: String,
}

impl Cause {
    /// A PostgreSQL failure, `error` being what the driver said, `text` the account of it.
    pub(crate) fn database(error: &sqlx::Error, text: String) -> Cause {
        let sqlstate = match error {
            sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
            _ => None,
        };
        Cause {
            kind: ErrorKind::Database,
            sqlstate,
            text,
        }
    }

    /// The same failure, its account told anew from the old one.
    pub(crate) fn reword(self, account: impl FnOnce(&str) -> String) -> Cause {
        Cause {
            text: account(&self.text),
            ..self
        }
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::error::Error for Cause {}

impl From<anyhow::Error> for Error {
    fn from(inner: anyhow::Error) -> Self {
        Error { inner, kind: None }
    }
}

impl fmt::Display for Error {
    /// The outermost account; with `{:#}`, every cause after it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.inner, f)
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.inner, f)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner.chain().nth(1)
    }
}

/// The crate's results in its public functions.
pub(crate) type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// The kind comes from the first cause that says, however deep; the text keeps the
    /// chain; the SQLSTATE is found under the context added to it.
    #[test]
    fn the_kind_and_the_chain_come_through() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let e = Error::from(anyhow::Error::new(io).context("reading the plugin"));
        assert_eq!(e.kind(), ErrorKind::Io);
        assert_eq!(e.to_string(), "reading the plugin");
        assert_eq!(format!("{e:#}"), "reading the plugin: no such file");
        assert_eq!(
            std::error::Error::source(&e).map(|s| s.to_string()),
            Some("no such file".to_string())
        );
        assert_eq!(e.sqlstate(), None);

        let e = Error::of_kind(anyhow::anyhow!("a bad key"), ErrorKind::Config);
        assert_eq!(e.kind(), ErrorKind::Config);

        let e = Error::from(anyhow::anyhow!("something else"));
        assert_eq!(e.kind(), ErrorKind::Other);
        // Through anyhow again (the command line's), the chain is whole.
        let again = anyhow::Error::new(Error::from(
            anyhow::anyhow!("inner cause").context("outer account"),
        ));
        assert_eq!(format!("{again:#}"), "outer account: inner cause");
    }
}
