//! The versions of the `idemhost:consumer` world the host speaks, side by side: the bindings
//! of each, a component ready to instantiate and an instance, by the version it targets, and
//! the one call into it. Everything else of a plugin is the same for every version.

use wasmtime::Store;
use wasmtime::component::{InstancePre, Resource};

use super::PluginState;
use super::world::Line;
use crate::handler::Message;
use crate::tx_handle::TxHandle;

/// WIT 0.1.0.
pub(super) mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "handler",
        imports: { default: async | trappable },
        exports: { default: async },
        with: { "idemhost:consumer/database.transaction": crate::tx_handle::TxHandle },
    });
}

/// WIT 0.2.0: typed database errors, richer values, the consumer's configuration.
pub(super) mod bindings_v2 {
    wasmtime::component::bindgen!({
        path: "../wit/0.2.0",
        world: "handler",
        imports: { default: async | trappable },
        exports: { default: async },
        with: { "idemhost:consumer/database.transaction": crate::tx_handle::TxHandle },
    });
}

pub(super) use bindings::idemhost::consumer::types as wit;
use bindings_v2::idemhost::consumer::types as wit_v2;

/// A component ready to instantiate, by the WIT version it targets.
pub(super) enum Pre {
    V1(bindings::HandlerPre<PluginState>),
    V2(bindings_v2::HandlerPre<PluginState>),
}

/// An instance, by the WIT version its component targets.
pub(super) enum Instance {
    V1(bindings::Handler),
    V2(bindings_v2::Handler),
}

impl Pre {
    /// `pre` as a component of the version line `line`.
    pub(super) fn new(line: Line, pre: InstancePre<PluginState>) -> wasmtime::Result<Self> {
        Ok(match line {
            Line::V1 => Pre::V1(bindings::HandlerPre::new(pre)?),
            Line::V2 => Pre::V2(bindings_v2::HandlerPre::new(pre)?),
        })
    }

    pub(super) async fn instantiate(
        &self,
        store: &mut Store<PluginState>,
    ) -> wasmtime::Result<Instance> {
        Ok(match self {
            Pre::V1(pre) => Instance::V1(pre.instantiate_async(store).await?),
            Pre::V2(pre) => Instance::V2(pre.instantiate_async(store).await?),
        })
    }
}

impl Instance {
    /// Calls the component's `handle` with `msg` in its version's types; its answer comes back
    /// in 0.1.0's (the same cases in every version).
    pub(super) async fn handle(
        self,
        store: &mut Store<PluginState>,
        tx: Resource<TxHandle>,
        msg: &Message,
    ) -> wasmtime::Result<Result<(), wit::HandlerError>> {
        macro_rules! message {
            ($wit:ident) => {
                $wit::Message {
                    id: msg.id.clone(),
                    subject: msg.subject.clone(),
                    event_type: msg.event_type.clone(),
                    headers: msg.headers.clone(),
                    payload: msg.payload.to_vec(),
                    delivery_attempt: msg.delivery_attempt,
                }
            };
        }
        match self {
            Instance::V1(i) => {
                i.idemhost_consumer_handling()
                    .call_handle(store, tx, &message!(wit))
                    .await
            }
            Instance::V2(i) => i
                .idemhost_consumer_handling()
                .call_handle(store, tx, &message!(wit_v2))
                .await
                .map(|answer| {
                    answer.map_err(|e| match e {
                        wit_v2::HandlerError::Retryable(r) => wit::HandlerError::Retryable(r),
                        wit_v2::HandlerError::Terminal(r) => wit::HandlerError::Terminal(r),
                    })
                }),
        }
    }
}
