//! The order flow's first hop, `inventory-reservation-v1`: `OrderPlaced` reserves stock and
//! publishes `InventoryReserved`; `OrderCancelled` releases it.
//!
//! Events go out through the transactional outbox (`tx.publish`), on the subject prefix of the
//! message that caused them (`<prefix>.orders.placed` → `<prefix>.inventory.reserved`).
//!
//! Business idempotency, besides the host's marker: the same order placed again under another
//! message id (a *semantic* duplicate) finds its `inventory_reservation (order_id, sku)` row and
//! changes nothing — acked as applied, no second reservation, no second event.
//!
//! Out of order: an `OrderCancelled` that arrives before its `OrderPlaced` records the order as
//! cancelled (`order_state`); the `OrderPlaced` that follows is then refused as a no-op (nothing
//! reserved, nothing published). A cancellation after the placement releases the stock.

wit_bindgen::generate!({ path: "../../wit/0.2.0", world: "handler" });

use exports::idemhost::consumer::handling::Guest;
use idemhost::consumer::database::Transaction;
use idemhost::consumer::logging::log;
use idemhost::consumer::types::{DbError, HandlerError, Message, SqlValue};

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct OrderPlaced {
    order_id: String,
    sku: String,
    quantity: i64,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct OrderCancelled {
    order_id: String,
}

/// Price of one unit, in cents (the example has no catalogue).
const UNIT_PRICE: i64 = 1250;

fn text(s: &str) -> SqlValue {
    SqlValue::Text(s.to_string())
}

fn db<T>(r: Result<T, DbError>) -> Result<T, HandlerError> {
    r.map_err(db_error)
}

/// `<prefix>.orders.placed` → `<prefix>.`
fn prefix(subject: &str) -> &str {
    subject
        .strip_suffix("orders.placed")
        .or_else(|| subject.strip_suffix("orders.cancelled"))
        .unwrap_or("")
}

fn placed(tx: &Transaction, msg: &Message) -> Result<(), HandlerError> {
    let e: OrderPlaced = serde_json::from_slice(&msg.payload)
        .map_err(|e| HandlerError::Terminal(format!("malformed OrderPlaced: {e}")))?;
    if e.quantity <= 0 {
        return Err(HandlerError::Terminal(format!(
            "quantity must be positive for {}",
            e.order_id
        )));
    }
    let state = db(tx.query(
        "SELECT status FROM order_state WHERE order_id = $1 FOR UPDATE",
        &[text(&e.order_id)],
    ))?;
    if matches!(state.first().and_then(|r| r.first()), Some(SqlValue::Text(s)) if s == "cancelled")
    {
        log(
            "info",
            &format!(
                "order {} was cancelled before it was placed: nothing reserved",
                e.order_id
            ),
        );
        return Ok(());
    }
    let fresh = db(tx.query(
        "INSERT INTO inventory_reservation (order_id, sku, quantity, message_id) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (order_id, sku) DO NOTHING RETURNING order_id",
        &[text(&e.order_id), text(&e.sku), SqlValue::Int(e.quantity), text(&msg.id)],
    ))?;
    if fresh.is_empty() {
        log(
            "info",
            &format!(
                "order {} / {} is already reserved: a business duplicate",
                e.order_id, e.sku
            ),
        );
        return Ok(());
    }
    let changed = db(tx.execute(
        "UPDATE inventory SET available = available - $1, reserved = reserved + $1 \
         WHERE sku = $2 AND available >= $1",
        &[SqlValue::Int(e.quantity), text(&e.sku)],
    ))?;
    if changed != 1 {
        return Err(HandlerError::Terminal(format!(
            "Unknown SKU or insufficient inventory for {}",
            e.order_id
        )));
    }
    db(tx.execute(
        "INSERT INTO order_state (order_id, status, version) VALUES ($1, 'placed', 1) \
         ON CONFLICT (order_id) DO NOTHING",
        &[text(&e.order_id)],
    ))?;
    let event = serde_json::json!({
        "orderId": e.order_id,
        "sku": e.sku,
        "quantity": e.quantity,
        "amount": e.quantity * UNIT_PRICE,
    });
    let subject = format!("{}inventory.reserved", prefix(&msg.subject));
    let headers = [(
        "Idemhost-Event-Type".to_string(),
        "InventoryReserved".to_string(),
    )];
    tx.publish(&subject, &headers, event.to_string().as_bytes())
        .map_err(db_error)
}

fn cancelled(tx: &Transaction, msg: &Message) -> Result<(), HandlerError> {
    let e: OrderCancelled = serde_json::from_slice(&msg.payload)
        .map_err(|e| HandlerError::Terminal(format!("malformed OrderCancelled: {e}")))?;
    // Placed → cancelled (version + 1); unknown → a cancelled tombstone; cancelled stays.
    let before = db(tx.query(
        "SELECT status FROM order_state WHERE order_id = $1 FOR UPDATE",
        &[text(&e.order_id)],
    ))?;
    match before.first().and_then(|r| r.first()) {
        None => {
            db(tx.execute(
                "INSERT INTO order_state (order_id, status, version) VALUES ($1, 'cancelled', 1)",
                &[text(&e.order_id)],
            ))?;
            log(
                "info",
                &format!("order {} cancelled before it was placed", e.order_id),
            );
        }
        Some(SqlValue::Text(s)) if s == "placed" => {
            db(tx.execute(
                "UPDATE inventory i SET available = i.available + r.quantity, reserved = i.reserved - r.quantity \
                 FROM inventory_reservation r WHERE r.order_id = $1 AND r.status = 'reserved' AND i.sku = r.sku",
                &[text(&e.order_id)],
            ))?;
            db(tx.execute(
                "UPDATE inventory_reservation SET status = 'released' WHERE order_id = $1",
                &[text(&e.order_id)],
            ))?;
            db(tx.execute(
                "UPDATE order_state SET status = 'cancelled', version = version + 1 WHERE order_id = $1",
                &[text(&e.order_id)],
            ))?;
        }
        _ => log(
            "info",
            &format!("order {} is already cancelled", e.order_id),
        ),
    }
    Ok(())
}

struct Reservation;

impl Guest for Reservation {
    fn handle(tx: &Transaction, msg: Message) -> Result<(), HandlerError> {
        match msg.event_type.as_deref() {
            Some("OrderCancelled") => cancelled(tx, &msg),
            Some("OrderPlaced") | None => placed(tx, &msg),
            Some(other) => Err(HandlerError::Terminal(format!(
                "unexpected event type {other}"
            ))),
        }
    }
}

export!(Reservation);

/// A failed statement already poisoned the host's transaction, and the host classifies its
/// SQLSTATE (a data error dead-letters the message, a serialization failure runs it again):
/// passed on as retryable, in the words PostgreSQL used.
fn db_error(e: DbError) -> HandlerError {
    HandlerError::Retryable(match e.sqlstate {
        Some(code) => format!("{code}: {}", e.message),
        None => e.message,
    })
}
