//! An idemhost handler in Rust: a starting point to copy.
//!
//! Build: `idemhost plugin build` in a project `idemhost plugin new --lang rust` made; in this
//! repository `scripts/build-plugins.sh` builds it into plugins/dist/template-rust.wasm.
//!
//! `NoteAdded` (`{"noteId": str, "text": str}`) records the note once. The host has already
//! claimed the message's marker in the transaction it lends us (`tx`); every write goes through
//! `tx`, so the note and the marker commit together or not at all. `max_note_bytes` comes from
//! the consumer's `[consumer.config]` table.

wit_bindgen::generate!({ path: "../../../wit/0.2.0", world: "handler" });

use exports::idemhost::consumer::handling::Guest;
use idemhost::consumer::config;
use idemhost::consumer::database::Transaction;
use idemhost::consumer::logging::log;
use idemhost::consumer::types::{DbError, DbErrorKind, HandlerError, Message, SqlValue};

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct NoteAdded {
    note_id: String,
    text: String,
}

/// What a failed database call means for the message. The host has already marked the
/// transaction for rollback (and runs it again after a serialization failure or a deadlock,
/// whatever we answer); we decide between dead-lettering and redelivering.
fn db_error(e: DbError) -> HandlerError {
    match e.kind {
        // The data itself is refused: redelivering the same message cannot help.
        DbErrorKind::UniqueViolation
        | DbErrorKind::ForeignKeyViolation
        | DbErrorKind::CheckViolation
        | DbErrorKind::NotNullViolation
        | DbErrorKind::IntegrityViolation
        | DbErrorKind::InvalidValue => HandlerError::Terminal(format!(
            "{} ({})",
            e.message,
            e.constraint.as_deref().unwrap_or("no constraint")
        )),
        // A timeout, a missing table, a refused statement: a later attempt (or a fixed plugin)
        // may succeed.
        _ => HandlerError::Retryable(e.message),
    }
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
    let max_bytes = config::get("max_note_bytes")
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(10_000);
    if event.text.len() > max_bytes {
        return Err(HandlerError::Terminal(format!(
            "a note's text must be 1 to {max_bytes} bytes"
        )));
    }
    // A business key can arrive under two message ids: ON CONFLICT DO NOTHING keeps the
    // transaction healthy (a unique violation would abort it) and the count tells us.
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
        .map_err(db_error)?;
    if inserted == 0 {
        log("info", &format!("note {} already recorded", event.note_id));
        return Ok(());
    }
    let rows = tx
        .query("SELECT count(*) FROM note", &[])
        .map_err(db_error)?;
    if let Some(SqlValue::Int(count)) = rows.first().and_then(|r| r.first()) {
        log(
            "info",
            &format!("note {} recorded; {count} notes", event.note_id),
        );
    }
    Ok(())
}

struct Template;

impl Guest for Template {
    fn handle(tx: &Transaction, msg: Message) -> Result<(), HandlerError> {
        match msg.event_type.as_deref().unwrap_or("") {
            "NoteAdded" => note_added(tx, &msg),
            t => Err(HandlerError::Terminal(format!("unknown event type {t:?}"))),
        }
    }
}

export!(Template);
