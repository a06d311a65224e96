//! `analytics-v1` reads the same `OrderPlaced` events as `inventory-reservation-v1`: one message
//! id, two consumer names, two markers, two effects — each consumer's marker guards only its own.

wit_bindgen::generate!({ path: "../../wit/0.2.0", world: "handler" });

use exports::idemhost::consumer::handling::Guest;
use idemhost::consumer::database::Transaction;
use idemhost::consumer::types::{DbError, HandlerError, Message, SqlValue};

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct OrderPlaced {
    order_id: String,
    sku: String,
    quantity: i64,
}

struct Analytics;

impl Guest for Analytics {
    fn handle(tx: &Transaction, msg: Message) -> Result<(), HandlerError> {
        if msg
            .event_type
            .as_deref()
            .is_some_and(|t| t != "OrderPlaced")
        {
            return Ok(());
        }
        let e: OrderPlaced = serde_json::from_slice(&msg.payload)
            .map_err(|e| HandlerError::Terminal(format!("malformed OrderPlaced: {e}")))?;
        tx.execute(
            "INSERT INTO order_analytics (message_id, order_id, sku, quantity) VALUES ($1, $2, $3, $4)",
            &[SqlValue::Text(msg.id), SqlValue::Text(e.order_id), SqlValue::Text(e.sku), SqlValue::Int(e.quantity)],
        )
        .map_err(db_error)?;
        Ok(())
    }
}

export!(Analytics);

/// A failed statement already poisoned the host's transaction, and the host classifies its
/// SQLSTATE (a data error dead-letters the message, a serialization failure runs it again):
/// passed on as retryable, in the words PostgreSQL used.
fn db_error(e: DbError) -> HandlerError {
    HandlerError::Retryable(match e.sqlstate {
        Some(code) => format!("{code}: {}", e.message),
        None => e.message,
    })
}
