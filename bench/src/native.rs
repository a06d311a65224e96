//! The seed's inventory reservation as a native Rust [`Handler`]: the example of embedding
//! idemhost without WASM, and the baseline that measures what the WASM sandbox costs.

use serde::Deserialize;

use idemhost::{HandleFuture, Handler, HandlerError, Message, SqlValue, TxHandle};

/// Same SQL, same errors, same JSON rules as `plugins/inventory`.
pub struct NativeInventory;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct OrderPlaced {
    order_id: String,
    sku: String,
    quantity: i64,
}

const RESERVE: &str = "UPDATE inventory SET available = available - $1, reserved = reserved + $1 \
                       WHERE sku = $2 AND available >= $1";

impl Handler for NativeInventory {
    fn handle<'a>(&'a self, tx: &'a TxHandle, msg: &'a Message) -> HandleFuture<'a> {
        Box::pin(async move {
            let event: OrderPlaced = serde_json::from_slice(&msg.payload).map_err(|e| {
                HandlerError::Terminal(format!("malformed OrderPlaced payload: {e}"))
            })?;
            if event.quantity <= 0 {
                return Err(HandlerError::Terminal(format!(
                    "quantity must be positive for {}",
                    event.order_id
                )));
            }
            let changed = tx
                .execute(
                    RESERVE,
                    &[SqlValue::Int(event.quantity), SqlValue::Text(event.sku)],
                )
                .await
                .map_err(|e| HandlerError::Retryable(e.to_string()))?;
            if changed != 1 {
                return Err(HandlerError::Terminal(format!(
                    "Unknown SKU or insufficient inventory for {}",
                    event.order_id
                )));
            }
            Ok(())
        })
    }

    fn describe(&self) -> String {
        "native inventory".into()
    }
}
