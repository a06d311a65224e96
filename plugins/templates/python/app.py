"""An idemhost handler in Python: a starting point to copy.

Build: `scripts/build-plugins.sh` builds it into plugins/dist/template-py.wasm; on your own:
`componentize-py -d wit -w handler componentize --stub-wasi -p plugins/templates/python app -o handler.wasm`.

`NoteAdded` ({"noteId": str, "text": str}) records the note once. The host has already claimed
the message's marker in the transaction it lends us (`tx`); every write goes through `tx`, so the
note and the marker commit together or not at all. The `conformance.*` event types exist for the
host's conformance suite (tests/conformance.rs); delete them in your own handler.
"""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import database, logging
from wit_world.imports.types import (
    HandlerError_Retryable,
    HandlerError_Terminal,
    Message,
    SqlValue_Int,
    SqlValue_Text,
)


def terminal(reason: str) -> Err:
    """Roll back and dead-letter: retrying cannot help (bad input, a broken business rule)."""
    return Err(HandlerError_Terminal(reason))


def retryable(reason: str) -> Err:
    """Roll back and let the broker redeliver later with backoff."""
    return Err(HandlerError_Retryable(reason))


def note_added(tx: database.Transaction, msg: Message) -> None:
    try:
        event = json.loads(msg.payload)
        note_id, text = event["noteId"], event["text"]
    except (ValueError, TypeError, KeyError) as e:
        raise terminal(f"malformed NoteAdded payload: {e!r}")
    if not isinstance(note_id, str) or not isinstance(text, str) or not text:
        raise terminal("noteId and a non-empty text are required")
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
        # A database error: the host has already marked the transaction for rollback and
        # classifies the SQLSTATE itself; we pass the text along.
        raise retryable(e.value)
    match rows[0][0]:
        case SqlValue_Int(value=count):
            logging.log("info", f"note {note_id} recorded; {count} notes")


# Module state lives as long as the instance, and every delivery gets a fresh instance: the
# `conformance.state` case records this counter to prove it is 1 every time.
calls = 0


def conformance(tx: database.Transaction, msg: Message, case: str) -> None:
    global calls
    calls += 1
    if case == "state":
        tx.execute(
            "INSERT INTO conformance_state (message_id, calls) VALUES ($1, $2)",
            [SqlValue_Text(msg.id), SqlValue_Int(calls)],
        )
        return
    if case == "refused-sql":
        try:
            tx.execute("DELETE FROM processed_message", [])
        except Err as refusal:
            # The refusal already fails the attempt; this write only shows it is not committed.
            try:
                tx.execute(
                    "INSERT INTO conformance_refusal (message_id, error) VALUES ($1, $2)",
                    [SqlValue_Text(msg.id), SqlValue_Text(refusal.value)],
                )
            except Err as e:
                raise retryable(e.value)
            return
        raise terminal("the host accepted a statement on processed_message")
    if case == "trap":
        raise RuntimeError("conformance: trap requested")  # uncaught: the component traps
    if case == "busy-loop":
        while True:
            pass
    if case == "retry":
        raise retryable("conformance: retry requested")
    raise terminal(f"unknown conformance case {case}")


class Handling(exports.Handling):
    def handle(self, tx: database.Transaction, msg: Message) -> None:
        event_type = msg.event_type or ""
        if event_type == "NoteAdded":
            note_added(tx, msg)
        elif event_type.startswith("conformance."):
            conformance(tx, msg, event_type.removeprefix("conformance."))
        else:
            raise terminal(f"unknown event type {event_type!r}")
