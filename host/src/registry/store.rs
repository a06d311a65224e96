//! The shared plugin store on NATS, so a fleet of replicas converges on one version without
//! restarts: components live in an Object Store bucket under their digest, and each consumer's
//! current version is a pointer in a KV bucket (key: the consumer name). `idemhost plugin
//! deploy --store nats` writes both; every host follows the KV and swaps through
//! [`Plugins::deploy`], after checking that the fetched bytes have the pointer's digest.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use async_nats::jetstream::{self, kv, object_store, stream};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;
use tokio::sync::watch;
use tracing::{info, warn};

use super::Plugins;
use crate::config::PluginsConfig;

/// A consumer's version pointer, the KV value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pointer {
    /// `sha256:<hex>`; also the object's name in the object bucket.
    pub digest: String,
    /// What the deployer said it deployed (file name, `rollback`).
    pub source: String,
    pub deployed_at: String,
}

/// The two buckets, opened (and created when missing).
#[derive(Clone)]
pub struct NatsStore {
    objects: object_store::ObjectStore,
    versions: kv::Store,
    object_bucket: String,
}

impl NatsStore {
    /// Opens (creating if missing) the configured KV bucket and object store.
    pub async fn open(
        js: &jetstream::Context,
        config: &PluginsConfig,
    ) -> crate::error::Result<Self> {
        // Another replica may create a bucket between our lookup and our create: look again.
        let objects = match js.get_object_store(&config.object_bucket).await {
            Ok(o) => o,
            Err(_) => match js
                .create_object_store(object_store::Config {
                    bucket: config.object_bucket.clone(),
                    description: Some("idemhost plugin components by digest".into()),
                    ..Default::default()
                })
                .await
            {
                Ok(o) => o,
                Err(e) => js
                    .get_object_store(&config.object_bucket)
                    .await
                    .map_err(|_| e)
                    .with_context(|| {
                        format!(
                            "failed to create plugin object bucket {}",
                            config.object_bucket
                        )
                    })?,
            },
        };
        let versions = match js.get_key_value(&config.version_bucket).await {
            Ok(kv) => kv,
            Err(_) => {
                // The stream `create_key_value` would make, made directly: that call first asks
                // for the account's info, whose answer async-nats 0.51 cannot parse from a
                // NATS 2.9 server. Creating an identical stream twice is not an error, so
                // replicas starting together do not race.
                let bucket = &config.version_bucket;
                js.get_or_create_stream(stream::Config {
                    name: format!("KV_{bucket}"),
                    description: Some("idemhost plugin version per consumer".into()),
                    subjects: vec![format!("$KV.{bucket}.>")],
                    max_messages_per_subject: i64::from(config.history),
                    max_message_size: 4096,
                    allow_rollup: true,
                    deny_delete: true,
                    allow_direct: true,
                    discard: stream::DiscardPolicy::New,
                    num_replicas: 1,
                    ..Default::default()
                })
                .await
                .with_context(|| format!("failed to create plugin version bucket {bucket}"))?;
                js.get_key_value(bucket)
                    .await
                    .with_context(|| format!("failed to open plugin version bucket {bucket}"))?
            }
        };
        Ok(NatsStore {
            objects,
            versions,
            object_bucket: config.object_bucket.clone(),
        })
    }

    /// Stores `bytes` (when not stored yet) and points `consumer` at them.
    pub async fn deploy(
        &self,
        consumer: &str,
        bytes: &[u8],
        source: &str,
    ) -> crate::error::Result<Pointer> {
        let digest = self.store(bytes).await?;
        Ok(self.point(consumer, &digest, source).await?)
    }

    /// Makes `bytes` the first version of `consumer` unless it has one: a host starting from
    /// its `plugin` file seeds the store, so the fleet shares that version from then on (and
    /// can roll back to it). Only one seed wins; `false` when another was there first.
    pub async fn seed(
        &self,
        consumer: &str,
        bytes: &[u8],
        source: &str,
    ) -> crate::error::Result<bool> {
        let digest = self.store(bytes).await?;
        let value = serde_json::to_vec(&pointer(&digest, source)).map_err(anyhow::Error::from)?;
        Ok(self.versions.create(consumer, value.into()).await.is_ok())
    }

    async fn store(&self, bytes: &[u8]) -> anyhow::Result<String> {
        let digest = format!("sha256:{:x}", Sha256::digest(bytes));
        if self.objects.info(&digest).await.is_err() {
            let mut reader = bytes;
            self.objects
                .put(digest.as_str(), &mut reader)
                .await
                .with_context(|| format!("failed to store {digest} in {}", self.object_bucket))?;
        }
        Ok(digest)
    }

    async fn point(&self, consumer: &str, digest: &str, source: &str) -> anyhow::Result<Pointer> {
        let pointer = pointer(digest, source);
        let value = serde_json::to_vec(&pointer)?;
        self.versions
            .put(consumer, value.into())
            .await
            .with_context(|| format!("failed to set the version pointer of {consumer}"))?;
        Ok(pointer)
    }

    /// The pointer `consumer` follows now, if any.
    pub async fn pointer(&self, consumer: &str) -> crate::error::Result<Option<Pointer>> {
        let entry = self
            .versions
            .entry(consumer)
            .await
            .with_context(|| format!("failed to read the version pointer of {consumer}"))?;
        Ok(entry.and_then(|e| decode(&e)))
    }

    /// The consumers that have a pointer.
    pub async fn consumers(&self) -> crate::error::Result<Vec<String>> {
        let keys = self
            .versions
            .keys()
            .await
            .context("failed to list the version bucket")?;
        let mut out: Vec<String> = keys.filter_map(|k| async { k.ok() }).collect().await;
        out.sort();
        Ok(out)
    }

    /// Every pointer `consumer` had, oldest first (as deep as the bucket's history).
    pub async fn history(&self, consumer: &str) -> crate::error::Result<Vec<Pointer>> {
        let mut entries = self
            .versions
            .history(consumer)
            .await
            .with_context(|| format!("failed to read the version history of {consumer}"))?;
        let mut out = Vec::new();
        while let Some(entry) = entries.next().await {
            if let Some(p) = entry.ok().as_ref().and_then(decode) {
                out.push(p);
            }
        }
        Ok(out)
    }

    /// Points `consumer` back at the digest it had before the current one.
    pub async fn rollback(&self, consumer: &str) -> crate::error::Result<Pointer> {
        let history = self.history(consumer).await?;
        let current = history
            .last()
            .with_context(|| format!("no version of {consumer} in the store"))?;
        let previous = history
            .iter()
            .rev()
            .find(|p| p.digest != current.digest)
            .with_context(|| {
                format!("{consumer} has no previous version in the store's history")
            })?;
        Ok(self.point(consumer, &previous.digest, "rollback").await?)
    }

    /// The component with `digest`, checked against it.
    pub async fn fetch(&self, digest: &str) -> crate::error::Result<Vec<u8>> {
        let mut object = self
            .objects
            .get(digest)
            .await
            .with_context(|| format!("{digest} not found in {}", self.object_bucket))?;
        let mut bytes = Vec::new();
        object
            .read_to_end(&mut bytes)
            .await
            .with_context(|| format!("failed to read {digest} from {}", self.object_bucket))?;
        let actual = format!("sha256:{:x}", Sha256::digest(&bytes));
        if actual != digest {
            return Err(anyhow::anyhow!(
                "{} holds {actual} under the name {digest}",
                self.object_bucket
            )
            .into());
        }
        Ok(bytes)
    }

    /// Follows the pointers of this host's consumers until `stop`: each change is fetched and
    /// deployed. The watch starts with the current values (already loaded: a no-op), so no
    /// change between start-up and the watch is missed; a broken watch is re-opened.
    pub(crate) fn follow(
        self,
        registry: Arc<Plugins>,
        mut stop: watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(100);
            // One consumer's load holds up neither the watch nor another consumer's.
            let mut swaps = super::SwapQueues::default();
            loop {
                let mut entries = match self.versions.watch_with_history(">").await {
                    Ok(w) => w,
                    Err(e) => {
                        warn!(error = %e, ?backoff, "plugin version watch failed");
                        tokio::select! {
                            _ = tokio::time::sleep(backoff) => {}
                            _ = stop.changed() => return,
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        continue;
                    }
                };
                backoff = Duration::from_millis(100);
                loop {
                    let entry = tokio::select! {
                        e = entries.next() => e,
                        _ = stop.changed() => return,
                    };
                    let entry = match entry {
                        Some(Ok(e)) => e,
                        Some(Err(e)) => {
                            warn!(error = %e, "plugin version watch broke; re-opening");
                            break;
                        }
                        None => break,
                    };
                    if registry.slot(&entry.key).is_none() {
                        continue;
                    }
                    if let Some(pointer) = decode(&entry) {
                        let (store, registry, key) =
                            (self.clone(), registry.clone(), entry.key.clone());
                        swaps.push(&entry.key, async move {
                            store.apply(&registry, &key, &pointer).await;
                        });
                    }
                }
            }
        })
    }

    /// Fetches and deploys `pointer` for `consumer` unless it is current already.
    pub(crate) async fn apply(&self, registry: &Plugins, consumer: &str, pointer: &Pointer) {
        let Some(slot) = registry.slot(consumer) else {
            return;
        };
        if slot.current().digest == pointer.digest {
            return;
        }
        let source = format!("nats:{}", self.object_bucket);
        let bytes = match self.fetch(&pointer.digest).await {
            Ok(b) => b,
            Err(e) => {
                warn!(%consumer, digest = %pointer.digest, error = %format!("{e:#}"), "plugin version not applied");
                return;
            }
        };
        match registry.deploy(consumer, bytes, source).await {
            Ok(d) if d.changed => {
                info!(%consumer, digest = %pointer.digest, "following the shared plugin store")
            }
            Ok(_) => {}
            Err(e) => warn!(%consumer, error = %e, "plugin version from the store not applied"),
        }
    }
}

fn pointer(digest: &str, source: &str) -> Pointer {
    Pointer {
        digest: digest.to_string(),
        source: source.to_string(),
        deployed_at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
    }
}

fn decode(entry: &kv::Entry) -> Option<Pointer> {
    if entry.operation != kv::Operation::Put {
        return None;
    }
    serde_json::from_slice(&entry.value).ok()
}
