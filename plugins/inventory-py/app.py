"""The seed's inventory reservation as an idemhost plugin in Python.

Build: `scripts/build-plugins.sh` (componentize-py, pinned in plugins/toolchain/requirements.txt).
It does exactly what the Rust plugin (plugins/inventory) does: the same JSON rules, the same SQL,
the same errors. The host has already claimed the message's marker in the transaction it lends
us; all this does is the business mutation, in that same transaction.
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

RESERVE = (
    "UPDATE inventory SET available = available - $1, reserved = reserved + $1 "
    "WHERE sku = $2 AND available >= $1"
)

# The fields of OrderPlaced and their JSON types, as the Rust plugin's serde struct declares
# them. Unknown fields are ignored; a missing, duplicated or mistyped one is malformed.
FIELDS = {"id": str, "orderId": str, "sku": str, "quantity": int}
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
MAX_DEPTH = 128  # serde_json's recursion limit


class Malformed(Exception):
    pass


def _object(pairs):
    seen = {}
    for key, value in pairs:
        if key in FIELDS and key in seen:
            raise Malformed(f"duplicate field `{key}`")
        seen[key] = value
    return seen


def _reject_constant(name):
    raise Malformed(f"invalid number {name}")


def _check_value(value, depth: int = 0) -> None:
    """What json.loads lets through and serde_json does not: lone surrogates (from \\ud800
    escapes; they cannot cross into a WIT string either) and nesting past MAX_DEPTH."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise Malformed("lone surrogate in string") from None
    elif isinstance(value, (dict, list)):
        if depth >= MAX_DEPTH:
            raise Malformed("recursion limit exceeded")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            _check_value(key, depth + 1)
            _check_value(item, depth + 1)


def parse_order_placed(payload: bytes) -> dict:
    try:
        text = payload.decode("utf-8")
        event = json.loads(
            text, object_pairs_hook=_object, parse_constant=_reject_constant
        )
    except UnicodeDecodeError as e:
        raise Malformed(f"payload is not UTF-8: {e.reason}") from None
    except json.JSONDecodeError as e:
        raise Malformed(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise Malformed("recursion limit exceeded") from None
    _check_value(event)
    if not isinstance(event, dict):
        raise Malformed(f"expected an object, found {type(event).__name__}")
    for name, kind in FIELDS.items():
        if name not in event:
            raise Malformed(f"missing field `{name}`")
        value = event[name]
        # bool is an int in Python; JSON true is not a number.
        if not isinstance(value, kind) or isinstance(value, bool):
            raise Malformed(f"invalid type for `{name}`: expected {kind.__name__}")
    if not I64_MIN <= event["quantity"] <= I64_MAX:
        raise Malformed("invalid value for `quantity`: out of range for i64")
    return event


class Handling(exports.Handling):
    def handle(self, tx: database.Transaction, msg: Message) -> None:
        try:
            event = parse_order_placed(msg.payload)
        except Malformed as e:
            raise Err(HandlerError_Terminal(f"malformed OrderPlaced payload: {e}"))
        order_id, quantity = event["orderId"], event["quantity"]
        if quantity <= 0:
            raise Err(HandlerError_Terminal(f"quantity must be positive for {order_id}"))
        # A SQL error already poisoned the host's transaction; the host classifies it
        # (serialization failures are retried whole), so we only pass its text along.
        try:
            changed = tx.execute(RESERVE, [SqlValue_Int(quantity), SqlValue_Text(event["sku"])])
        except Err as e:
            raise Err(HandlerError_Retryable(f"{e.value.sqlstate}: {e.value.message}" if e.value.sqlstate else e.value.message))
        if changed != 1:
            raise Err(
                HandlerError_Terminal(f"Unknown SKU or insufficient inventory for {order_id}")
            )
        logging.log("debug", f"reserved {quantity} for {order_id}")
