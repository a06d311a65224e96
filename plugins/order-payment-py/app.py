"""The order flow's payment hop, `payment-authorization-v1`, in Python.

`InventoryReserved` records a payment attempt and asks the payment provider to authorize it.
The provider call is not made from here — a remote call cannot join the database transaction —
but written as an outbox command, `payments.authorize`, that the host relays only if this
transaction commits. The command carries an idempotency key derived from the *payment attempt*
(`pay-<order>-<attempt>`), not from the message id: the provider dedupes by it, so a second
request for the same attempt (from a semantic duplicate, a replay, a repair) is answered without
a second authorization.

`PaymentAuthorized` (the provider's answer) marks the attempt authorized. The same component runs
under two consumer names — `payment-authorization-v1` on `inventory.reserved` and
`payment-confirmation-v1` on `payments.authorized` — one subject each (a NATS 2.9 consumer
filters on one subject).

Build: `scripts/build-plugins.sh py` (componentize-py, pinned in plugins/toolchain).
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

ATTEMPT = 1  # the example makes one payment attempt per order


def _fields(payload: bytes, kinds: dict, event: str) -> dict:
    try:
        value = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise Err(HandlerError_Terminal(f"malformed {event}: {e}"))
    if not isinstance(value, dict):
        raise Err(HandlerError_Terminal(f"malformed {event}: not an object"))
    for name, kind in kinds.items():
        v = value.get(name)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise Err(HandlerError_Terminal(f"malformed {event}: `{name}` missing or not {kind.__name__}"))
    return value


def _db(call, *args):
    try:
        return call(*args)
    except Err as e:
        # The failed statement already poisoned the host's transaction; it classifies it.
        raise Err(HandlerError_Retryable(f"{e.value.sqlstate}: {e.value.message}" if e.value.sqlstate else e.value.message))


def _prefix(subject: str) -> str:
    suffix = "inventory.reserved"
    return subject[: -len(suffix)] if subject.endswith(suffix) else ""


def reserved(tx: database.Transaction, msg: Message) -> None:
    e = _fields(msg.payload, {"orderId": str, "amount": int}, "InventoryReserved")
    order_id, amount = e["orderId"], e["amount"]
    key = f"pay-{order_id}-{ATTEMPT}"
    fresh = _db(
        tx.query,
        "INSERT INTO payment_attempt (order_id, attempt, idempotency_key, amount, status) "
        "VALUES ($1, $2, $3, $4, 'requested') ON CONFLICT (order_id, attempt) DO NOTHING "
        "RETURNING idempotency_key",
        [SqlValue_Text(order_id), SqlValue_Int(ATTEMPT), SqlValue_Text(key), SqlValue_Int(amount)],
    )
    if not fresh:
        logging.log("info", f"payment attempt {key} already requested: a business duplicate")
        return
    command = json.dumps({"idempotencyKey": key, "orderId": order_id, "amount": amount})
    headers = [("Idemhost-Event-Type", "AuthorizePayment")]
    _db(tx.publish, _prefix(msg.subject) + "payments.authorize", headers, command.encode())


def authorized(tx: database.Transaction, msg: Message) -> None:
    e = _fields(msg.payload, {"idempotencyKey": str, "authorizationId": str}, "PaymentAuthorized")
    _db(
        tx.execute,
        "UPDATE payment_attempt SET status = 'authorized', authorization_id = $2 "
        "WHERE idempotency_key = $1 AND status = 'requested'",
        [SqlValue_Text(e["idempotencyKey"]), SqlValue_Text(e["authorizationId"])],
    )


class Handling(exports.Handling):
    def handle(self, tx: database.Transaction, msg: Message) -> None:
        if msg.event_type == "PaymentAuthorized":
            authorized(tx, msg)
        elif msg.event_type in ("InventoryReserved", None):
            reserved(tx, msg)
        else:
            raise Err(HandlerError_Terminal(f"unexpected event type {msg.event_type}"))
