//! What one delivery did, recorded for `idemhost plugin test`: each statement the plugin ran
//! with its parameters and result, its log lines, the events it published through the outbox,
//! and where the time went. Only a rehearsal attaches a [`Trace`]; deliveries of a running host
//! record nothing.

use std::sync::Mutex;
use std::time::Duration;

use crate::sql_gate::{SqlArray, SqlValue};

/// Rows of a query's result kept in the trace; the count says how many there were.
pub(crate) const TRACED_ROWS: usize = 20;
/// Statements and publishes kept; the rest are counted. A plugin is hostile to the developer's
/// terminal and memory too: it may run statements with large parameters in a loop until its
/// deadline.
pub(crate) const TRACED_STATEMENTS: usize = 1000;
pub(crate) const TRACED_PUBLISHES: usize = 100;
/// Bytes of one text kept (SQL, a parameter, a cell, a payload, a subject, a header, an error).
pub(crate) const TRACED_VALUE_BYTES: usize = 4096;
/// Parameters of one statement, and headers of one event, kept.
pub(crate) const TRACED_ITEMS: usize = 100;

/// The record of one delivery, filled in as it runs.
#[derive(Debug, Default)]
pub(crate) struct Trace {
    inner: Mutex<Traced>,
}

/// What a `Trace` holds.
#[derive(Debug, Default, Clone)]
pub struct Traced {
    /// The plugin's statements in the order it ran them (the host's own are not included),
    /// the first `TRACED_STATEMENTS`; and how many more there were.
    pub statements: Vec<Statement>,
    /// Statements past the first `TRACED_STATEMENTS`.
    pub statements_dropped: usize,
    /// Log lines the plugin kept (after the per-delivery cap), and how many were dropped.
    pub logs: Vec<(String, String)>,
    /// Log lines dropped by the cap.
    pub logs_dropped: u32,
    /// Outbox events, in the order published (refused ones included, with the refusal), the
    /// first `TRACED_PUBLISHES`; and how many more there were.
    pub published: Vec<Published>,
    /// Events past the first `TRACED_PUBLISHES`.
    pub published_dropped: usize,
    /// Creating the instance, and the `handle` call.
    pub instantiate: Option<Duration>,
    /// The `handle` call.
    pub handle: Option<Duration>,
    /// The trap or interruption that ended the call, if one did.
    pub trap: Option<String>,
}

/// One statement the plugin sent through the transaction handle.
#[derive(Debug, Clone)]
pub struct Statement {
    /// The statement's text.
    pub sql: String,
    /// Its parameters (long values cut).
    pub params: Vec<SqlValue>,
    /// What it came back with.
    pub result: StatementResult,
    /// How long it took.
    pub elapsed: Duration,
}

/// What a statement came back with.
#[derive(Debug, Clone)]
pub enum StatementResult {
    /// `execute`: rows affected.
    Affected(u64),
    /// `query`: the first `TRACED_ROWS` rows, and how many there were.
    Rows {
        /// The rows kept.
        rows: Vec<Vec<SqlValue>>,
        /// Rows returned.
        total: usize,
    },
    /// A refusal by the host or an error from PostgreSQL, as the plugin saw it.
    Error(String),
}

/// One event published through the outbox.
#[derive(Debug, Clone)]
pub struct Published {
    /// The subject.
    pub subject: String,
    /// Its headers.
    pub headers: Vec<(String, String)>,
    /// Its payload.
    pub payload: Vec<u8>,
    /// Why the host refused it, when it did.
    pub refused: Option<String>,
}

impl Trace {
    fn with<T>(&self, f: impl FnOnce(&mut Traced) -> T) -> T {
        // A panic while recording leaves a partial trace, still worth showing.
        let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard)
    }

    /// Records a statement; what it holds is cut to the trace's bounds first (a refused
    /// statement may be any size).
    pub(crate) fn statement(
        &self,
        sql: &str,
        params: &[SqlValue],
        result: StatementResult,
        elapsed: Duration,
    ) {
        self.with(|t| {
            if t.statements.len() >= TRACED_STATEMENTS {
                t.statements_dropped += 1;
                return;
            }
            let mut result = result;
            match &mut result {
                StatementResult::Rows { rows, .. } => rows.iter_mut().flatten().for_each(clip),
                StatementResult::Error(e) => *e = clipped(e),
                StatementResult::Affected(_) => {}
            }
            let mut params: Vec<SqlValue> = params.iter().take(TRACED_ITEMS).cloned().collect();
            params.iter_mut().for_each(clip);
            t.statements.push(Statement {
                sql: clipped(sql),
                params,
                result,
                elapsed,
            });
        });
    }

    /// Records an event published through the outbox, cut to the trace's bounds.
    pub(crate) fn published(
        &self,
        subject: &str,
        headers: &[(String, String)],
        payload: &[u8],
        refused: Option<String>,
    ) {
        self.with(|t| {
            if t.published.len() >= TRACED_PUBLISHES {
                t.published_dropped += 1;
                return;
            }
            t.published.push(Published {
                subject: clipped(subject),
                headers: headers
                    .iter()
                    .take(TRACED_ITEMS)
                    .map(|(k, v)| (clipped(k), clipped(v)))
                    .collect(),
                payload: payload[..payload.len().min(TRACED_VALUE_BYTES)].to_vec(),
                refused: refused.as_deref().map(clipped),
            });
        });
    }

    /// Records a log line the plugin kept (the message is already cut to the host's limit).
    pub(crate) fn log(&self, level: &str, message: &str) {
        self.with(|t| t.logs.push((clipped_to(level, 16), message.to_string())));
    }

    /// Starts over for another transaction attempt (after a serialization failure or a
    /// deadlock): the report shows what the last attempt did, not the rolled-back ones too.
    pub(crate) fn new_attempt(&self) {
        self.with(|t| *t = Traced::default());
    }

    pub(crate) fn call(
        &self,
        instantiate: Option<Duration>,
        handle: Option<Duration>,
        trap: Option<String>,
        logs_dropped: u32,
    ) {
        self.with(|t| {
            t.instantiate = instantiate;
            t.handle = handle;
            t.trap = trap;
            t.logs_dropped = logs_dropped;
        });
    }

    /// A copy of what was recorded so far.
    pub(crate) fn snapshot(&self) -> Traced {
        self.with(|t| t.clone())
    }
}

/// Cuts a long value to [`TRACED_VALUE_BYTES`] (an array to its first [`TRACED_ITEMS`]
/// elements, each cut so).
fn clip(v: &mut SqlValue) {
    fn text(s: &mut String) {
        s.truncate(s.floor_char_boundary(TRACED_VALUE_BYTES))
    }
    fn texts(v: &mut Vec<Option<String>>) {
        v.truncate(TRACED_ITEMS);
        v.iter_mut().flatten().for_each(text);
    }
    match v {
        SqlValue::Text(s) | SqlValue::Json(s) | SqlValue::Numeric(s) | SqlValue::Uuid(s) => text(s),
        SqlValue::Bytes(b) => b.truncate(TRACED_VALUE_BYTES),
        SqlValue::Array(a) => match a {
            SqlArray::Text(v) | SqlArray::Numeric(v) | SqlArray::Uuid(v) => texts(v),
            SqlArray::Boolean(v) => v.truncate(TRACED_ITEMS),
            SqlArray::Int(v) | SqlArray::Timestamp(v) => v.truncate(TRACED_ITEMS),
            SqlArray::Float(v) => v.truncate(TRACED_ITEMS),
            SqlArray::Date(v) => v.truncate(TRACED_ITEMS),
        },
        _ => {}
    }
}

/// The first [`TRACED_VALUE_BYTES`] of `text` (at a character boundary), copied.
fn clipped(text: &str) -> String {
    clipped_to(text, TRACED_VALUE_BYTES)
}

fn clipped_to(text: &str, max: usize) -> String {
    text[..text.floor_char_boundary(max)].to_string()
}
