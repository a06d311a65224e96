//! A plugin that exists in two versions, for idemhost's hot-swap tests: every message inserts
//! one row `swap_effect(message_id, handled_by, attempt)`, where `handled_by` is the version
//! that ran (`a`, or `b` when built with `--features v2`). A second effect for one message
//! fails on the table's primary key, so a doubled effect cannot hide.

wit_bindgen::generate!({ path: "../../wit", world: "handler" });

use exports::idemhost::consumer::handling::Guest;
use idemhost::consumer::database::Transaction;
use idemhost::consumer::types::{HandlerError, Message, SqlValue};

#[cfg(not(feature = "v2"))]
const VERSION: &str = "a";
#[cfg(feature = "v2")]
const VERSION: &str = "b";

struct Versioned;

impl Guest for Versioned {
    fn handle(tx: &Transaction, msg: Message) -> Result<(), HandlerError> {
        tx.execute(
            "INSERT INTO swap_effect (message_id, handled_by, attempt) VALUES ($1, $2, $3)",
            &[
                SqlValue::Text(msg.id),
                SqlValue::Text(VERSION.to_string()),
                SqlValue::Int(i64::from(msg.delivery_attempt)),
            ],
        )
        .map(|_| ())
        .map_err(HandlerError::Retryable)
    }
}

export!(Versioned);
