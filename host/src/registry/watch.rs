//! Swapping a consumer's plugin when its configured file is replaced. The file's identity
//! (device, inode, size, modification time) is checked every interval — no inotify, so it also
//! works on bind mounts and for symlink swaps (a Kubernetes ConfigMap's `..data`); on a change
//! the file is read and deployed. Replace the file by an atomic rename: a file caught half
//! written is refused by validation (the old version keeps serving) and retried at its next
//! change.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tracing::debug;

use super::Plugins;

/// What identifies one content of a file without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Identity {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

/// A consumer's plugin file, with its identity from before start-up read it.
pub(crate) type Watched = (String, PathBuf, Option<Identity>);

/// The file's identity now; `None` when it cannot be read. Taken before a file is read at
/// start-up, so that a replacement between that read and the watcher's first look is a change.
pub(crate) fn identity(path: &PathBuf) -> Option<Identity> {
    let m = std::fs::metadata(path).ok()?;
    Some(Identity {
        dev: m.dev(),
        ino: m.ino(),
        len: m.len(),
        mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
    })
}

/// Watches each `(consumer, file)` until `stop` turns true.
/// Each file comes with its identity from before start-up read it (or read the shared store's
/// version instead, which a later file change then overrides: the last change wins). Taken
/// when the watcher first looked instead, a file replaced while the host started (or before
/// this task first ran) was never swapped in.
pub(crate) fn spawn(
    registry: Arc<Plugins>,
    watched: Vec<Watched>,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let (files, mut seen): (Vec<(String, PathBuf)>, Vec<Option<Identity>>) = watched
        .into_iter()
        .map(|(consumer, path, seen)| ((consumer, path), seen))
        .unzip();
    tokio::spawn(async move {
        // A swap compiles on a blocking thread for as long as its component takes: this loop
        // (other consumers' changes) does not wait for it (see `SwapQueues`).
        let mut swaps = super::SwapQueues::default();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.changed() => return,
            }
            for ((consumer, path), last) in files.iter().zip(seen.iter_mut()) {
                let now = identity(path);
                // A missing file (between unlink and rename, or deleted) changes nothing.
                if now.is_none() || now == *last {
                    continue;
                }
                *last = now;
                let bytes = match tokio::fs::read(path).await {
                    Ok(b) => b,
                    Err(e) => {
                        debug!(%consumer, path = %path.display(), error = %e, "plugin file unreadable");
                        continue;
                    }
                };
                let source = format!("file:{}", path.display());
                let (registry, name, path) = (registry.clone(), consumer.clone(), path.clone());
                swaps.push(consumer, async move {
                    let consumer = name;
                    match registry.deploy(&consumer, bytes, source).await {
                        Ok(d) if !d.changed => {
                            debug!(%consumer, path = %path.display(), "plugin file touched, same digest")
                        }
                        Ok(_) => {}
                        // The registry logged the refusal with its reason.
                        Err(e) => {
                            debug!(%consumer, path = %path.display(), error = %e, "plugin file change not applied")
                        }
                    }
                });
            }
        }
    })
}
