//! The host's conformance cases in Rust (tests/system/conformance.rs runs the same cases
//! against every language's build), against WIT 0.2.0: `NoteAdded` as the template handles it,
//! and a `conformance.<case>` event type per case.

wit_bindgen::generate!({ path: "../../../wit/0.2.0", world: "handler" });

use exports::idemhost::consumer::handling::Guest;
use idemhost::consumer::database::Transaction;
use idemhost::consumer::types::{DbErrorKind, HandlerError, Message, SqlValue};

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct NoteAdded {
    note_id: String,
    text: String,
}

fn note_added(tx: &Transaction, msg: &Message) -> Result<(), HandlerError> {
    let event: NoteAdded = serde_json::from_slice(&msg.payload)
        .map_err(|e| HandlerError::Terminal(format!("malformed NoteAdded payload: {e}")))?;
    if event.text.is_empty() {
        return Err(HandlerError::Terminal(
            "noteId and a non-empty text are required".into(),
        ));
    }
    tx.execute(
        "INSERT INTO note (note_id, body, message_id) VALUES ($1, $2, $3) \
         ON CONFLICT (note_id) DO NOTHING",
        &[
            SqlValue::Text(event.note_id),
            SqlValue::Text(event.text),
            SqlValue::Text(msg.id.clone()),
        ],
    )
    .map(|_| ())
    .map_err(|e| HandlerError::Retryable(e.message))
}

/// Module state lives as long as the instance, and every delivery gets a fresh instance: the
/// `state` case records this counter to prove it is 1 every time.
static CALLS: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

fn conformance(tx: &Transaction, msg: &Message, case: &str) -> Result<(), HandlerError> {
    let calls = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    let id = || SqlValue::Text(msg.id.clone());
    match case {
        "state" => tx
            .execute(
                "INSERT INTO conformance_state (message_id, calls) VALUES ($1, $2)",
                &[id(), SqlValue::Int(calls)],
            )
            .map(|_| ())
            .map_err(|e| HandlerError::Retryable(e.message)),
        "refused-sql" => match tx.execute("DELETE FROM processed_message", &[]) {
            Ok(_) => Err(HandlerError::Terminal(
                "the host accepted a statement on processed_message".into(),
            )),
            Err(refusal) if refusal.kind != DbErrorKind::Refused => Err(HandlerError::Terminal(
                format!("the refusal came as {:?}", refusal.kind),
            )),
            // The refusal already fails the attempt; this write only shows it is not committed.
            Err(refusal) => tx
                .execute(
                    "INSERT INTO conformance_refusal (message_id, error) VALUES ($1, $2)",
                    &[id(), SqlValue::Text(refusal.message)],
                )
                .map(|_| ())
                .map_err(|e| HandlerError::Retryable(e.message)),
        },
        // The same key twice: the second is a unique violation, which this handler treats as
        // terminal, naming the constraint.
        "unique" => {
            let insert = || {
                tx.execute(
                    "INSERT INTO conformance_unique (k, message_id) VALUES ('k', $1)",
                    &[id()],
                )
            };
            insert().map_err(|e| HandlerError::Retryable(e.message))?;
            match insert() {
                Ok(_) => Err(HandlerError::Terminal("no unique violation".into())),
                Err(e) if e.kind == DbErrorKind::UniqueViolation => {
                    Err(HandlerError::Terminal(format!(
                        "duplicate: {} {}",
                        e.sqlstate.unwrap_or_default(),
                        e.constraint.unwrap_or_default()
                    )))
                }
                Err(e) => Err(HandlerError::Retryable(e.message)),
            }
        }
        "trap" => panic!("conformance: trap requested"),
        "busy-loop" => loop {
            std::hint::black_box(());
        },
        "retry" => Err(HandlerError::Retryable(
            "conformance: retry requested".into(),
        )),
        other => Err(HandlerError::Terminal(format!(
            "unknown conformance case {other}"
        ))),
    }
}

struct Conformance;

impl Guest for Conformance {
    fn handle(tx: &Transaction, msg: Message) -> Result<(), HandlerError> {
        match msg.event_type.as_deref().unwrap_or("") {
            "NoteAdded" => note_added(tx, &msg),
            t if t.starts_with("conformance.") => conformance(tx, &msg, &t["conformance.".len()..]),
            t => Err(HandlerError::Terminal(format!("unknown event type {t:?}"))),
        }
    }
}

export!(Conformance);
