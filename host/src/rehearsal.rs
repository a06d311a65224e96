//! One delivery rehearsed outside the broker (`idemhost plugin test`): the message read from
//! its parts by the rules a real delivery is read by, then claim, handler and the end of the
//! transaction exactly as a consumer runs them — as the consumer's role, through the wall —
//! recording every statement the handler ran, and rolled back unless asked to commit.

use std::sync::Arc;

use crate::claim::{Processed, Rehearsal};
use crate::config::{Config, ConsumerConfig};
use crate::handler::Message;
use crate::headers::{EVENT_TYPE_HEADER, header, message_id};
use crate::plugin::WasmHandler;
use crate::tx_handle::Trace;
use crate::{pg, source};

mod setup;

pub use crate::tx_handle::{Published, Statement, StatementResult, Traced};

/// Why a message is refused before any transaction (a delivery of it would be dead-lettered
/// at once): an invalid id, a payload over `max_payload`.
#[derive(Debug, Clone)]
pub struct Refused {
    /// Why, as the dead letter's `Idemhost-Failure-Reason` would say.
    pub reason: String,
}

/// The message a delivery with these parts would give the handler, read by the same rules
/// (the id from the consumer's id header, `Idemhost-Event-Type`, `max_payload`).
pub fn read(
    consumer: &ConsumerConfig,
    subject: &str,
    headers: &async_nats::HeaderMap,
    payload: Vec<u8>,
    attempt: u32,
) -> Result<Message, Refused> {
    source::read_message(
        consumer,
        // A rehearsal trusts no replay id: nothing it reads was republished by a host.
        message_id(headers, &consumer.id_header, None),
        header(headers, EVENT_TYPE_HEADER),
        headers,
        subject,
        payload.into(),
        attempt,
    )
    .map_err(|r| Refused { reason: r.reason })
}

/// What a rehearsal did: how the delivery ended, and what the handler ran and published.
pub struct Rehearsed {
    /// The delivery's outcome, as the consumer would settle it.
    pub processed: Processed,
    /// The handler's statements, their results and its published events.
    pub traced: Traced,
    /// The set-up taken back after the delivery (the host's migrations of a schema that had
    /// none, the consumer's role when it did not exist); empty when kept or when there was none.
    pub undone: Vec<String>,
    /// What of the set-up could not be taken back, and why (someone else used it meanwhile,
    /// an object of someone else's depends on it, a lock not granted in time).
    pub kept: Vec<String>,
}

/// How a rehearsal treats the server besides its delivery.
#[derive(Debug, Clone, Copy)]
pub struct RehearsalOptions {
    /// Apply the host's migrations first, as `idemhost run` does.
    pub migrate: bool,
    /// Commit the delivery as a consumer would (else roll it back where it would commit).
    pub commit: bool,
    /// Keep the set-up (migrations, the role); implied by `commit`. Otherwise what the
    /// rehearsal created for itself is removed after it, and a schema with only some of the
    /// host's migrations is refused (they could not be taken back).
    pub keep_setup: bool,
}

/// Runs `msg` through `handler` as `consumer` would, on the configured PostgreSQL: applies the
/// host's migrations first when asked (as `idemhost run` does), provisions the consumer's
/// role, runs the delivery, and then takes back what it set up unless asked to keep it.
pub async fn run(
    config: &Config,
    consumer: &ConsumerConfig,
    handler: &WasmHandler,
    msg: &Message,
    options: RehearsalOptions,
) -> anyhow::Result<Rehearsed> {
    let (pool, failover) = pg::connect_following(&config.postgres, 2).await?;
    let keep = options.keep_setup || options.commit;
    let before = if keep {
        None
    } else {
        let role = pg::wall::plugin_role(&config.postgres, consumer);
        Some(
            setup::Before::look(
                &pool,
                config.postgres.schema.as_deref(),
                &role,
                options.migrate,
            )
            .await?,
        )
    };
    // Taking back migrations needs nobody else to start using them: on a schema that had none,
    // the migrations lock is held from before the rehearsal's migrations to the end of the
    // undo, so a host that starts on the schema meanwhile (or another `plugin test`) waits.
    let mut lock = None;
    let ran = async {
        if options.migrate {
            match &before {
                Some(b) if b.migrates_for_itself() => {
                    lock =
                        Some(pg::migrate_holding(&pool, config.postgres.schema.as_deref()).await?);
                }
                _ => pg::migrate(&pool, config.postgres.schema.as_deref()).await?,
            }
        }
        let trace = Arc::new(Trace::default());
        let claimer = crate::host::plugin_claimer(&config.postgres, &pool, &failover, consumer)
            .await?
            .sparing_inbox(&config.nats.inbox_prefix)
            .rehearsing(Rehearsal {
                trace: trace.clone(),
                commit: options.commit,
            });
        let processed = claimer.process(handler, msg).await;
        drop(claimer);
        anyhow::Ok((processed, trace.snapshot()))
    }
    .await;
    // No session of the role may remain when it is dropped.
    failover.close_all().await;
    let undone = match before {
        Some(before) => before.undo(lock, &pool).await,
        None => setup::Undone::default(),
    };
    let (processed, traced) = ran?;
    Ok(Rehearsed {
        processed,
        traced,
        undone: undone.removed,
        kept: undone.kept,
    })
}

/// The PostgreSQL role `consumer`'s handler runs as (its `role`, else one derived from its
/// name).
pub fn role(config: &Config, consumer: &ConsumerConfig) -> String {
    pg::wall::plugin_role(&config.postgres, consumer)
}
