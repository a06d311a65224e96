//! Which plugin version each consumer runs, and the hot swap. A consumer's [`Slot`] holds its
//! current handler; a delivery takes the current one when it starts ([`Slot::begin`]) and keeps
//! it to the end — commit and ack, or rollback — so a swap is atomic at the transaction
//! boundary: deliveries already running finish on the old version, the next ones start on the
//! new, none waits and none is dropped.
//!
//! Every swap — the admin API, a replaced plugin file ([`watch`]), the shared NATS store
//! ([`store`]), a rollback — goes through [`Plugins::deploy`]: the component is compiled,
//! checked against the world and instantiated once (on a blocking thread, while deliveries go
//! on) *before* it becomes current; a refused component leaves the old one serving.

mod scrape;
pub(crate) mod store;
pub(crate) mod watch;

/// Swaps requested from a loop that must not wait for them (the file watcher, the plugin
/// store's watch): each consumer's run one after another, so its last change wins, and
/// different consumers' side by side, so one consumer's load (a compile of seconds) holds up
/// neither the loop nor another consumer's swap.
#[derive(Default)]
pub(crate) struct SwapQueues(std::collections::HashMap<String, tokio::task::JoinHandle<()>>);

impl SwapQueues {
    /// Runs `swap` for `consumer` once its previous one ended.
    pub(crate) fn push(
        &mut self,
        consumer: &str,
        swap: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        self.0.retain(|_, task| !task.is_finished());
        let before = self.0.remove(consumer);
        let task = tokio::spawn(async move {
            if let Some(before) = before {
                let _ = before.await;
            }
            swap.await;
        });
        self.0.insert(consumer.to_string(), task);
    }
}

pub(crate) use scrape::PluginCollector;

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;
use sha2::{Digest, Sha256};
use tracing::{info, warn};

use crate::handler::Handler;
use crate::plugin::{PluginConfig, PluginLimits, PluginRuntime};

/// One version of a consumer's handler, as `/plugins` shows it.
#[derive(Debug)]
pub(crate) struct Version {
    /// `sha256:<hex>` of the component (`native:<name>` for a native handler).
    pub digest: String,
    /// Where it came from: `file:<path>`, `api`, `nats:<bucket>`, `rollback`, `native`.
    pub source: String,
    /// When the swap was asked for.
    pub requested_at: SystemTime,
    /// When it became current (after validation).
    pub loaded_at: SystemTime,
    /// Compile (or compile-cache read), world check and trial instantiation.
    pub validation: Duration,
    first_delivery: OnceLock<SystemTime>,
    deliveries: AtomicU64,
}

impl Version {
    fn new(digest: String, source: String, requested_at: SystemTime, validation: Duration) -> Self {
        Version {
            digest,
            source,
            requested_at,
            loaded_at: SystemTime::now(),
            validation,
            first_delivery: OnceLock::new(),
            deliveries: AtomicU64::new(0),
        }
    }

    /// When the first delivery on this version started.
    pub(crate) fn first_delivery(&self) -> Option<SystemTime> {
        self.first_delivery.get().copied()
    }

    /// Deliveries started on this version.
    pub(crate) fn deliveries(&self) -> u64 {
        self.deliveries.load(Ordering::Relaxed)
    }
}

/// A handler and the version it is.
#[derive(Clone)]
pub(crate) struct Active {
    pub handler: Arc<dyn Handler>,
    pub version: Arc<Version>,
}

/// One consumer's handler: the current version, the one before it (kept loaded for rollback)
/// and the recent history.
pub(crate) struct Slot {
    consumer: String,
    /// `None` for a native handler, which cannot be swapped (WASM plugins always have limits,
    /// and the registry then has a runtime).
    limits: Option<PluginLimits>,
    /// The consumer's `[consumer.config]`, given to every version of its plugin.
    config: PluginConfig,
    current: RwLock<Active>,
    previous: Mutex<Option<Active>>,
    history: Mutex<VecDeque<Arc<Version>>>,
    last_error: Mutex<Option<Refusal>>,
    /// One swap at a time per consumer, so the history is in the order swaps took effect.
    swapping: tokio::sync::Mutex<()>,
}

#[derive(Debug, Clone, Serialize)]
struct Refusal {
    at: String,
    source: String,
    reason: String,
}

impl Slot {
    /// The version a delivery starting now runs on, start to finish.
    pub(crate) fn start_delivery(&self) -> Active {
        let active = read(&self.current).clone();
        active.version.first_delivery.get_or_init(SystemTime::now);
        active.version.deliveries.fetch_add(1, Ordering::Relaxed);
        active
    }

    /// The current version, without counting a delivery.
    pub(crate) fn current(&self) -> Arc<Version> {
        read(&self.current).version.clone()
    }

    /// The current handler and version, without counting a delivery.
    pub(crate) fn current_active(&self) -> Active {
        read(&self.current).clone()
    }

    pub(crate) fn consumer(&self) -> &str {
        &self.consumer
    }

    fn refused(&self, source: &str, reason: String) -> DeployError {
        warn!(consumer = %self.consumer, %source, %reason, "plugin swap refused; the current version keeps serving");
        *lock(&self.last_error) = Some(Refusal {
            at: rfc3339(SystemTime::now()),
            source: source.to_string(),
            reason: reason.clone(),
        });
        DeployError::Refused {
            consumer: self.consumer.clone(),
            reason,
        }
    }

    fn install(&self, next: Active, keep: usize) {
        let old = std::mem::replace(&mut *write(&self.current), next.clone());
        *lock(&self.previous) = Some(old);
        let mut history = lock(&self.history);
        history.push_back(next.version);
        while history.len() > keep {
            history.pop_front();
        }
    }
}

/// Why a swap did not happen.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DeployError {
    #[error(
        "no consumer named {0} in this host; a new consumer name is not a hot swap but a \
         replay of everything its stream still holds — add it to the config deliberately"
    )]
    UnknownConsumer(String),
    #[error("consumer {0} runs a native handler, which cannot be swapped")]
    Native(String),
    #[error("consumer {consumer}: component refused, the current version keeps serving: {reason}")]
    Refused { consumer: String, reason: String },
    #[error("consumer {0} has no previous version to roll back to")]
    NoPrevious(String),
}

/// What a deploy did.
#[derive(Debug, Clone)]
pub(crate) struct Deployed {
    pub version: Arc<Version>,
    /// The digest that was current before (equal to the new one when nothing changed).
    pub replaced: String,
    /// False when the component already was the current version (nothing to do).
    pub changed: bool,
}

/// Every consumer's slot, and the runtime that loads new versions.
pub(crate) struct Plugins {
    runtime: Option<Arc<PluginRuntime>>,
    slots: BTreeMap<String, Arc<Slot>>,
    history: usize,
}

impl Plugins {
    pub(crate) fn new(runtime: Option<Arc<PluginRuntime>>, history: usize) -> Self {
        Plugins {
            runtime,
            slots: BTreeMap::new(),
            history: history.max(1),
        }
    }

    /// Adds a consumer running `handler` (first version, from `source`).
    pub(crate) fn insert(
        &mut self,
        consumer: &str,
        handler: Arc<dyn Handler>,
        source: String,
        limits: Option<PluginLimits>,
        config: PluginConfig,
    ) -> Arc<Slot> {
        let digest = handler
            .digest()
            .map(str::to_string)
            .unwrap_or_else(|| format!("native:{}", handler.describe()));
        let now = SystemTime::now();
        let version = Arc::new(Version::new(digest, source, now, Duration::ZERO));
        let slot = Arc::new(Slot {
            consumer: consumer.to_string(),
            limits,
            config,
            current: RwLock::new(Active {
                handler,
                version: version.clone(),
            }),
            previous: Mutex::new(None),
            history: Mutex::new(VecDeque::from([version])),
            last_error: Mutex::new(None),
            swapping: tokio::sync::Mutex::new(()),
        });
        self.slots.insert(consumer.to_string(), slot.clone());
        slot
    }

    pub(crate) fn slot(&self, consumer: &str) -> Option<&Arc<Slot>> {
        self.slots.get(consumer)
    }

    pub(crate) fn consumers(&self) -> impl Iterator<Item = &Arc<Slot>> {
        self.slots.values()
    }

    /// Makes `bytes` the current version of `consumer` once it compiled, fits the world and
    /// instantiated; deliveries keep running on the old version meanwhile. The same bytes as
    /// the current version are a no-op.
    pub(crate) async fn deploy(
        &self,
        consumer: &str,
        bytes: Vec<u8>,
        source: String,
    ) -> Result<Deployed, DeployError> {
        let requested_at = SystemTime::now();
        let slot = self
            .slots
            .get(consumer)
            .ok_or_else(|| DeployError::UnknownConsumer(consumer.to_string()))?;
        let (Some(limits), Some(runtime)) = (slot.limits, self.runtime.clone()) else {
            return Err(DeployError::Native(consumer.to_string()));
        };
        let _one_at_a_time = slot.swapping.lock().await;
        let digest = format!("sha256:{:x}", Sha256::digest(&bytes));
        let replaced = slot.current();
        if replaced.digest == digest {
            return Ok(Deployed {
                version: replaced.clone(),
                replaced: replaced.digest.clone(),
                changed: false,
            });
        }
        let started = Instant::now();
        // Off the async workers, so deliveries go on while it compiles.
        let handler = match runtime
            .load_bytes_blocking(bytes, PathBuf::from(&source), limits)
            .await
        {
            Ok(h) => h.with_config(slot.config.clone()),
            Err(e) => return Err(slot.refused(&source, e.to_string())),
        };
        let version = Arc::new(Version::new(
            digest,
            source,
            requested_at,
            started.elapsed(),
        ));
        slot.install(
            Active {
                handler: Arc::new(handler),
                version: version.clone(),
            },
            self.history,
        );
        info!(consumer, digest = %version.digest, replaced = %replaced.digest, source = %version.source,
            validation_ms = version.validation.as_millis() as u64, "plugin swapped");
        Ok(Deployed {
            version,
            replaced: replaced.digest.clone(),
            changed: true,
        })
    }

    /// Makes the version before the current one current again (itself a swap: rolling back
    /// twice returns to where it started).
    pub(crate) async fn rollback(&self, consumer: &str) -> Result<Deployed, DeployError> {
        let requested_at = SystemTime::now();
        let slot = self
            .slots
            .get(consumer)
            .ok_or_else(|| DeployError::UnknownConsumer(consumer.to_string()))?;
        if slot.limits.is_none() {
            return Err(DeployError::Native(consumer.to_string()));
        }
        let _one_at_a_time = slot.swapping.lock().await;
        let Some(previous) = lock(&slot.previous).clone() else {
            return Err(DeployError::NoPrevious(consumer.to_string()));
        };
        let replaced = slot.current();
        let version = Arc::new(Version::new(
            previous.version.digest.clone(),
            "rollback".into(),
            requested_at,
            Duration::ZERO,
        ));
        slot.install(
            Active {
                handler: previous.handler,
                version: version.clone(),
            },
            self.history,
        );
        info!(consumer, digest = %version.digest, replaced = %replaced.digest, "plugin rolled back");
        Ok(Deployed {
            version,
            replaced: replaced.digest.clone(),
            changed: true,
        })
    }

    /// Every consumer's current version, the previous digest and the history (newest first),
    /// as `GET /plugins` serves it.
    pub(crate) fn report(&self) -> PluginsReport {
        let consumers = self
            .slots
            .values()
            .map(|slot| ConsumerReport {
                name: slot.consumer.clone(),
                swappable: slot.limits.is_some(),
                current: VersionReport::of(&slot.current()),
                previous: lock(&slot.previous)
                    .as_ref()
                    .map(|a| a.version.digest.clone()),
                history: lock(&slot.history)
                    .iter()
                    .rev()
                    .map(|v| VersionReport::of(v))
                    .collect(),
                last_refusal: lock(&slot.last_error).clone(),
            })
            .collect();
        PluginsReport { consumers }
    }
}

/// `GET /plugins`.
#[derive(Debug, Serialize)]
pub(crate) struct PluginsReport {
    pub consumers: Vec<ConsumerReport>,
}

#[derive(Debug, Serialize)]
pub(crate) struct ConsumerReport {
    pub name: String,
    pub swappable: bool,
    pub current: VersionReport,
    pub previous: Option<String>,
    pub history: Vec<VersionReport>,
    last_refusal: Option<Refusal>,
}

#[derive(Debug, Serialize)]
pub(crate) struct VersionReport {
    pub digest: String,
    pub source: String,
    pub requested_at: String,
    pub loaded_at: String,
    pub validation_ms: f64,
    /// When the first delivery on this version started; with `requested_at`, the swap latency.
    pub first_delivery_at: Option<String>,
    /// Milliseconds from the swap request to the first delivery on this version.
    pub swap_latency_ms: Option<f64>,
    pub deliveries: u64,
}

impl VersionReport {
    pub(crate) fn of(v: &Version) -> Self {
        let first = v.first_delivery();
        VersionReport {
            digest: v.digest.clone(),
            source: v.source.clone(),
            requested_at: rfc3339(v.requested_at),
            loaded_at: rfc3339(v.loaded_at),
            validation_ms: v.validation.as_secs_f64() * 1e3,
            first_delivery_at: first.map(rfc3339),
            swap_latency_ms: first
                .and_then(|f| f.duration_since(v.requested_at).ok())
                .map(|d| d.as_secs_f64() * 1e3),
            deliveries: v.deliveries(),
        }
    }
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

// A panic while a lock is held cannot leave these values half-written (each is one
// assignment), so a poisoned lock is used as is.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
fn read<T>(m: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}
fn write<T>(m: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}
