"""The host's conformance cases in Python (tests/system/conformance.rs runs the same cases
against every language's build), against WIT 0.2.0: `NoteAdded` as the template handles it, and
a `conformance.<case>` event type per case."""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import database
from wit_world.imports.types import (
    DbErrorKind,
    HandlerError_Retryable,
    HandlerError_Terminal,
    Message,
    SqlValue_Int,
    SqlValue_Text,
)


def terminal(reason: str) -> Err:
    return Err(HandlerError_Terminal(reason))


def retryable(reason: str) -> Err:
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
        tx.execute(
            "INSERT INTO note (note_id, body, message_id) VALUES ($1, $2, $3) "
            "ON CONFLICT (note_id) DO NOTHING",
            [SqlValue_Text(note_id), SqlValue_Text(text), SqlValue_Text(msg.id)],
        )
    except Err as e:
        raise retryable(e.value.message)


# Module state lives as long as the instance, and every delivery gets a fresh instance: the
# `state` case records this counter to prove it is 1 every time.
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
            if refusal.value.kind != DbErrorKind.REFUSED:
                raise terminal(f"the refusal came as {refusal.value.kind}")
            # The refusal already fails the attempt; this write only shows it is not committed.
            try:
                tx.execute(
                    "INSERT INTO conformance_refusal (message_id, error) VALUES ($1, $2)",
                    [SqlValue_Text(msg.id), SqlValue_Text(refusal.value.message)],
                )
            except Err as e:
                raise retryable(e.value.message)
            return
        raise terminal("the host accepted a statement on processed_message")
    if case == "unique":
        # The same key twice: a unique violation, which this handler treats as terminal.
        insert = "INSERT INTO conformance_unique (k, message_id) VALUES ('k', $1)"
        try:
            tx.execute(insert, [SqlValue_Text(msg.id)])
            tx.execute(insert, [SqlValue_Text(msg.id)])
        except Err as e:
            if e.value.kind == DbErrorKind.UNIQUE_VIOLATION:
                raise terminal(f"duplicate: {e.value.sqlstate} {e.value.constraint}")
            raise retryable(e.value.message)
        raise terminal("no unique violation")
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
