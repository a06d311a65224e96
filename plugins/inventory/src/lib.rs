//! The seed's inventory reservation: one `OrderPlaced` reserves `quantity` units of `sku`.
//!
//! Build: `cargo build --release --target wasm32-wasip2 --manifest-path plugins/Cargo.toml -p inventory`
//! (or `scripts/build-plugins.sh`). The host has already claimed the message's marker in the
//! transaction it lends us; all we do is the business mutation, in that same transaction.

wit_bindgen::generate!({ path: "../../wit/0.2.0", world: "handler" });

use exports::idemhost::consumer::handling::Guest;
use idemhost::consumer::database::Transaction;
use idemhost::consumer::logging::log;
use idemhost::consumer::types::{DbError, HandlerError, Message, SqlValue};

/// The event as the producer publishes it (`{"id", "orderId", "sku", "quantity"}`).
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct OrderPlaced {
    #[allow(dead_code)] // carried for the producer's sake; the host uses the header id
    id: String,
    order_id: String,
    sku: String,
    quantity: i64,
}

const RESERVE: &str = "UPDATE inventory SET available = available - $1, reserved = reserved + $1 \
                       WHERE sku = $2 AND available >= $1";

struct Inventory;

impl Guest for Inventory {
    fn handle(tx: &Transaction, msg: Message) -> Result<(), HandlerError> {
        let event: OrderPlaced = serde_json::from_slice(&msg.payload)
            .map_err(|e| HandlerError::Terminal(format!("malformed OrderPlaced payload: {e}")))?;
        if event.quantity <= 0 {
            return Err(HandlerError::Terminal(format!(
                "quantity must be positive for {}",
                event.order_id
            )));
        }
        // A SQL error here already poisoned the host's transaction; the host classifies it
        // (serialization failures are retried whole), so we only pass its text along.
        let changed = tx
            .execute(
                RESERVE,
                &[SqlValue::Int(event.quantity), SqlValue::Text(event.sku)],
            )
            .map_err(db_error)?;
        if changed != 1 {
            return Err(HandlerError::Terminal(format!(
                "Unknown SKU or insufficient inventory for {}",
                event.order_id
            )));
        }
        log(
            "debug",
            &format!("reserved {} for {}", event.quantity, event.order_id),
        );
        Ok(())
    }
}

export!(Inventory);

/// A failed statement already poisoned the host's transaction, and the host classifies its
/// SQLSTATE (a data error dead-letters the message, a serialization failure runs it again):
/// passed on as retryable, in the words PostgreSQL used.
fn db_error(e: DbError) -> HandlerError {
    HandlerError::Retryable(match e.sqlstate {
        Some(code) => format!("{code}: {}", e.message),
        None => e.message,
    })
}
