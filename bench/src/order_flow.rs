//! The order-flow example's fake payment provider, as a native idemhost handler: it consumes
//! `AuthorizePayment` commands (`<prefix>.payments.authorize`) and answers `PaymentAuthorized`
//! (`<prefix>.payments.authorized`) through the outbox. Like a real provider it dedupes by the
//! request's idempotency key — its own ledger `provider_authorization` has the key as primary
//! key — so a second request for the same payment attempt, under whatever message id, is
//! answered by nothing new: one authorization per attempt.

use idemhost::{HandleFuture, Handler, HandlerError, Message, SqlValue, TxHandle};
use serde::Deserialize;
use sha2::Digest as _;

/// The consumer name the provider runs under.
pub const CONSUMER: &str = "fake-payment-provider";

pub struct FakeProvider;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AuthorizePayment {
    idempotency_key: String,
    order_id: String,
    amount: i64,
}

fn db(e: idemhost::TxError) -> HandlerError {
    HandlerError::Retryable(e.to_string())
}

impl Handler for FakeProvider {
    fn handle<'a>(&'a self, tx: &'a TxHandle, msg: &'a Message) -> HandleFuture<'a> {
        Box::pin(async move {
            let cmd: AuthorizePayment = serde_json::from_slice(&msg.payload)
                .map_err(|e| HandlerError::Terminal(format!("malformed AuthorizePayment: {e}")))?;
            let digest = sha2::Sha256::digest(cmd.idempotency_key.as_bytes());
            let authorization_id = format!("auth-{}", &format!("{digest:x}")[..12]);
            let fresh = tx
                .query(
                    "INSERT INTO provider_authorization (idempotency_key, authorization_id, order_id, amount) \
                     VALUES ($1, $2, $3, $4) ON CONFLICT (idempotency_key) DO NOTHING \
                     RETURNING authorization_id",
                    &[
                        SqlValue::Text(cmd.idempotency_key.clone()),
                        SqlValue::Text(authorization_id.clone()),
                        SqlValue::Text(cmd.order_id.clone()),
                        SqlValue::Int(cmd.amount),
                    ],
                )
                .await
                .map_err(db)?;
            if fresh.is_empty() {
                tracing::info!(key = %cmd.idempotency_key, "already authorized: idempotent request");
                return Ok(());
            }
            let prefix = msg.subject.strip_suffix("payments.authorize").unwrap_or("");
            let answer = serde_json::json!({
                "orderId": cmd.order_id,
                "idempotencyKey": cmd.idempotency_key,
                "authorizationId": authorization_id,
                "amount": cmd.amount,
            });
            let headers = [(
                "Idemhost-Event-Type".to_string(),
                "PaymentAuthorized".to_string(),
            )];
            tx.publish(
                &format!("{prefix}payments.authorized"),
                &headers,
                answer.to_string().as_bytes(),
            )
            .await
            .map_err(db)
        })
    }

    fn describe(&self) -> String {
        "fake payment provider".into()
    }
}
