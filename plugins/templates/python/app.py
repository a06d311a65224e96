"""An idemhost handler in Python: a starting point to copy.

Build: `idemhost plugin build` in a project `idemhost plugin new --lang python` made; in this
repository `scripts/build-plugins.sh` builds it into plugins/dist/template-py.wasm.

`NoteAdded` ({"noteId": str, "text": str}) records the note once. The host has already claimed
the message's marker in the transaction it lends us (`tx`); every write goes through `tx`, so the
note and the marker commit together or not at all. `max_note_bytes` comes from the consumer's
`[consumer.config]` table.
"""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import config, database, logging
from wit_world.imports.types import (
    DbError,
    DbErrorKind,
    HandlerError_Retryable,
    HandlerError_Terminal,
    Message,
    SqlValue_Int,
    SqlValue_Text,
)

# Database errors that mean the data itself is refused: redelivering cannot help.
DATA_ERRORS = {
    DbErrorKind.UNIQUE_VIOLATION,
    DbErrorKind.FOREIGN_KEY_VIOLATION,
    DbErrorKind.CHECK_VIOLATION,
    DbErrorKind.NOT_NULL_VIOLATION,
    DbErrorKind.INTEGRITY_VIOLATION,
    DbErrorKind.INVALID_VALUE,
}


def terminal(reason: str) -> Err:
    """Roll back and dead-letter: retrying cannot help (bad input, a broken business rule)."""
    return Err(HandlerError_Terminal(reason))


def retryable(reason: str) -> Err:
    """Roll back and let the broker redeliver later with backoff."""
    return Err(HandlerError_Retryable(reason))


def db_error(e: DbError) -> Err:
    """What a failed database call means for the message. The host has already marked the
    transaction for rollback (and runs it again after a serialization failure or a deadlock,
    whatever we answer); we decide between dead-lettering and redelivering."""
    if e.kind in DATA_ERRORS:
        return terminal(f"{e.message} ({e.constraint or 'no constraint'})")
    return retryable(e.message)


def note_added(tx: database.Transaction, msg: Message) -> None:
    try:
        event = json.loads(msg.payload)
        note_id, text = event["noteId"], event["text"]
    except (ValueError, TypeError, KeyError) as e:
        raise terminal(f"malformed NoteAdded payload: {e!r}")
    limit = config.get("max_note_bytes")
    max_bytes = int(limit) if limit is not None and limit.isdigit() else 10_000
    if not isinstance(note_id, str) or not isinstance(text, str) or not text:
        raise terminal("noteId and a non-empty text are required")
    if len(text.encode()) > max_bytes:
        raise terminal(f"a note's text must be 1 to {max_bytes} bytes")
    try:
        # A business key can arrive under two message ids: ON CONFLICT DO NOTHING keeps the
        # transaction healthy (a unique violation would abort it) and the count tells us.
        inserted = tx.execute(
            "INSERT INTO note (note_id, body, message_id) VALUES ($1, $2, $3) "
            "ON CONFLICT (note_id) DO NOTHING",
            [SqlValue_Text(note_id), SqlValue_Text(text), SqlValue_Text(msg.id)],
        )
        if inserted == 0:
            logging.log("info", f"note {note_id} already recorded")
            return
        rows = tx.query("SELECT count(*) FROM note", [])
    except Err as e:
        raise db_error(e.value)
    match rows[0][0]:
        case SqlValue_Int(value=count):
            logging.log("info", f"note {note_id} recorded; {count} notes")


class Handling(exports.Handling):
    def handle(self, tx: database.Transaction, msg: Message) -> None:
        event_type = msg.event_type or ""
        if event_type == "NoteAdded":
            note_added(tx, msg)
        else:
            raise terminal(f"unknown event type {event_type!r}")
