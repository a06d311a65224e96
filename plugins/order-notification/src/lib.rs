//! The order flow's last hop, `notification-v1`: `PaymentAuthorized` records the customer's
//! notification — once per order, whatever the message ids (`notification.order_id` is the
//! primary key: a second authorization event of one order changes nothing).

wit_bindgen::generate!({ path: "../../wit/0.2.0", world: "handler" });

use exports::idemhost::consumer::handling::Guest;
use idemhost::consumer::database::Transaction;
use idemhost::consumer::types::{DbError, HandlerError, Message, SqlValue};

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct PaymentAuthorized {
    order_id: String,
    authorization_id: String,
    amount: i64,
}

struct Notification;

impl Guest for Notification {
    fn handle(tx: &Transaction, msg: Message) -> Result<(), HandlerError> {
        let e: PaymentAuthorized = serde_json::from_slice(&msg.payload)
            .map_err(|e| HandlerError::Terminal(format!("malformed PaymentAuthorized: {e}")))?;
        let text = format!(
            "Your order {} is confirmed: {}.{:02} authorized ({}).",
            e.order_id,
            e.amount / 100,
            e.amount % 100,
            e.authorization_id
        );
        tx.execute(
            "INSERT INTO notification (order_id, message_id, body) VALUES ($1, $2, $3) \
             ON CONFLICT (order_id) DO NOTHING",
            &[
                SqlValue::Text(e.order_id),
                SqlValue::Text(msg.id),
                SqlValue::Text(text),
            ],
        )
        .map_err(db_error)?;
        Ok(())
    }
}

export!(Notification);

/// A failed statement already poisoned the host's transaction, and the host classifies its
/// SQLSTATE (a data error dead-letters the message, a serialization failure runs it again):
/// passed on as retryable, in the words PostgreSQL used.
fn db_error(e: DbError) -> HandlerError {
    HandlerError::Retryable(match e.sqlstate {
        Some(code) => format!("{code}: {}", e.message),
        None => e.message,
    })
}
