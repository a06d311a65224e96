//! An idemhost handler in Rust: a starting point to copy.
//!
//! Build: `scripts/build-plugins.sh` builds it into plugins/dist/template-rust.wasm; on your own:
//! `cargo build --release --target wasm32-wasip2` with this crate as a `cdylib`.
//!
//! `NoteAdded` (`{"noteId": str, "text": str}`) records the note once. The host has already
//! claimed the message's marker in the transaction it lends us (`tx`); every write goes through
//! `tx`, so the note and the marker commit together or not at all. The `conformance.*` event
//! types exist for the host's conformance suite (tests/system/conformance.rs); delete them in your
//! own handler.

wit_bindgen::generate!({ path: "../../../wit", world: "handler" });

use exports::idemhost::consumer::handling::Guest;
use idemhost::consumer::database::Transaction;
use idemhost::consumer::logging::log;
use idemhost::consumer::types::{HandlerError, Message, SqlValue};

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct NoteAdded {
    note_id: String,
    text: String,
}

fn note_added(tx: &Transaction, msg: &Message) -> Result<(), HandlerError> {
    // Terminal: roll back and dead-letter, retrying cannot help (bad input, a business rule).
    let event: NoteAdded = serde_json::from_slice(&msg.payload)
        .map_err(|e| HandlerError::Terminal(format!("malformed NoteAdded payload: {e}")))?;
    if event.text.is_empty() {
        return Err(HandlerError::Terminal(
            "noteId and a non-empty text are required".into(),
        ));
    }
    // A business key can arrive under two message ids: ON CONFLICT DO NOTHING keeps the
    // transaction healthy (a unique violation would abort it) and the count tells us.
    // A database error: the host has already marked the transaction for rollback and classifies
    // the SQLSTATE itself, so we pass its text along as retryable.
    let inserted = tx
        .execute(
            "INSERT INTO note (note_id, body, message_id) VALUES ($1, $2, $3) \
             ON CONFLICT (note_id) DO NOTHING",
            &[
                SqlValue::Text(event.note_id.clone()),
                SqlValue::Text(event.text),
                SqlValue::Text(msg.id.clone()),
            ],
        )
        .map_err(HandlerError::Retryable)?;
    if inserted == 0 {
        log("info", &format!("note {} already recorded", event.note_id));
        return Ok(());
    }
    let rows = tx
        .query("SELECT count(*) FROM note", &[])
        .map_err(HandlerError::Retryable)?;
    if let Some(SqlValue::Int(count)) = rows.first().and_then(|r| r.first()) {
        log(
            "info",
            &format!("note {} recorded; {count} notes", event.note_id),
        );
    }
    Ok(())
}

/// Module state lives as long as the instance, and every delivery gets a fresh instance: the
/// `conformance.state` case records this counter to prove it is 1 every time.
static CALLS: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

fn conformance(tx: &Transaction, msg: &Message, case: &str) -> Result<(), HandlerError> {
    let calls = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    match case {
        "state" => tx
            .execute(
                "INSERT INTO conformance_state (message_id, calls) VALUES ($1, $2)",
                &[SqlValue::Text(msg.id.clone()), SqlValue::Int(calls)],
            )
            .map(|_| ())
            .map_err(HandlerError::Retryable),
        "refused-sql" => match tx.execute("DELETE FROM processed_message", &[]) {
            Ok(_) => Err(HandlerError::Terminal(
                "the host accepted a statement on processed_message".into(),
            )),
            Err(refusal) => tx
                .execute(
                    "INSERT INTO conformance_refusal (message_id, error) VALUES ($1, $2)",
                    &[SqlValue::Text(msg.id.clone()), SqlValue::Text(refusal)],
                )
                .map(|_| ())
                .map_err(HandlerError::Retryable),
        },
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

struct Template;

impl Guest for Template {
    fn handle(tx: &Transaction, msg: Message) -> Result<(), HandlerError> {
        match msg.event_type.as_deref().unwrap_or("") {
            "NoteAdded" => note_added(tx, &msg),
            t if t.starts_with("conformance.") => conformance(tx, &msg, &t["conformance.".len()..]),
            t => Err(HandlerError::Terminal(format!("unknown event type {t:?}"))),
        }
    }
}

export!(Template);
