//! Compiled plugins on disk, keyed by the component's digest and the engine's compatibility
//! hash: a restart or a second replica deserializes an artifact (milliseconds) instead of
//! compiling the component again (seconds for an interpreter-sized one). The directory is
//! bounded (`host.compile_cache_max`): past the bound, the artifacts used least recently are
//! removed (a load marks its artifact used) — never the one just written, nor one used within
//! [`DEFAULT_MIN_IDLE`]: processes sharing the directory (replicas on one volume, a host and
//! `plugin test`) may be about to load it, and evicting what is in use would have each of them
//! compile it again, for ever, whenever their working set exceeds the bound. The bound is
//! therefore soft by what was used in the last hour.

use std::hash::{Hash, Hasher};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

/// First bytes of every artifact file, then the SHA-256 of the body, then the body.
const MAGIC: &[u8; 16] = b"idemhost-cwasm1\n";

/// The default bound of a compile cache directory's artifacts (the configuration's default).
pub use crate::config::DEFAULT_COMPILE_CACHE_MAX as DEFAULT_MAX_BYTES;
/// An artifact used (loaded or written) more recently than this is never evicted.
pub(crate) const DEFAULT_MIN_IDLE: std::time::Duration = std::time::Duration::from_secs(3600);

/// A directory of compiled components that only this user can write.
#[derive(Debug, Clone)]
pub(crate) struct CompileCache {
    dir: PathBuf,
    /// Changes with the wasmtime version and every engine setting that affects code.
    engine_key: String,
    /// The artifacts' total size past which the least recently used are removed.
    max_bytes: u64,
    /// Artifacts used more recently than this stay, over the bound or not.
    min_idle: std::time::Duration,
}

impl CompileCache {
    /// Opens (creating with mode 0700) `dir`. Refused when another user owns it or others may
    /// write to it: deserializing compiled code trusts the files, so nobody else may plant one.
    pub(crate) fn open(dir: &Path, engine: &Engine) -> Result<CompileCache, String> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let meta =
            std::fs::metadata(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        if meta.uid() != me {
            return Err(format!(
                "{} belongs to uid {}, not to this process (uid {me})",
                dir.display(),
                meta.uid()
            ));
        }
        if meta.permissions().mode() & 0o022 != 0 {
            return Err(format!(
                "{} is writable by other users (mode {:o})",
                dir.display(),
                meta.permissions().mode() & 0o777
            ));
        }
        let mut hasher = std::hash::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        Ok(CompileCache {
            dir: dir.to_path_buf(),
            engine_key: format!("{:016x}", hasher.finish()),
            max_bytes: DEFAULT_MAX_BYTES,
            min_idle: DEFAULT_MIN_IDLE,
        })
    }

    /// Bounds the artifacts' total size (artifacts used within `min_idle` excepted), evicting
    /// now down to it.
    pub(crate) fn set_bound(&mut self, max_bytes: u64, min_idle: std::time::Duration) {
        self.max_bytes = max_bytes;
        self.min_idle = min_idle;
        self.evict(None);
    }

    /// Removes the least recently used artifacts (by modification time, which a load renews)
    /// until their total is within the bound, never `keep`; also temporary files a crashed
    /// writer left over an hour ago. Returns how many bytes it removed.
    pub(crate) fn evict(&self, keep: Option<&Path>) -> u64 {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let now = std::time::SystemTime::now();
        let mut artifacts: Vec<(std::time::SystemTime, u64, PathBuf)> = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(meta) = entry.metadata() else { continue };
            let modified = meta.modified().unwrap_or(now);
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.ends_with(".tmp")
                && now
                    .duration_since(modified)
                    .is_ok_and(|age| age.as_secs() > 3600)
            {
                let _ = std::fs::remove_file(&path);
            } else if meta.is_file() && name.ends_with(".cwasm") {
                artifacts.push((modified, meta.len(), path));
            }
        }
        let mut total: u64 = artifacts.iter().map(|(_, len, _)| len).sum();
        artifacts.sort();
        let mut removed = 0;
        for (modified, len, path) in artifacts {
            if total <= self.max_bytes {
                break;
            }
            if Some(path.as_path()) == keep {
                continue;
            }
            let idle = now.duration_since(modified).unwrap_or_default();
            if idle < self.min_idle {
                // In use, here or in another process: the rest are newer still.
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                tracing::info!(path = %path.display(), bytes = len, "compile cache over host.compile_cache_max; evicted the least recently used artifact");
                total -= len;
                removed += len;
            }
        }
        removed
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, digest_hex: &str) -> PathBuf {
        self.dir
            .join(format!("{digest_hex}-{}.cwasm", self.engine_key))
    }

    /// The cached component for `digest_hex` (and `true`), or `compile`'s (and `false`), then
    /// stored. Loaders of one component serialize on a lock file in the directory, so
    /// processes or threads that start together (replicas sharing a cache volume, parallel
    /// tests) compile it once, and the others wait and deserialize the artifact. Without the
    /// lock (a read-only directory) each compiles on its own, as it would without a cache.
    pub(crate) fn load_or_compile<E>(
        &self,
        engine: &Engine,
        digest_hex: &str,
        compile: impl FnOnce() -> Result<Component, E>,
    ) -> Result<(Component, bool), E> {
        if let Some(component) = self.load(engine, digest_hex) {
            return Ok((component, true));
        }
        let lock = self.lock(digest_hex);
        match &lock {
            Ok(_) => {
                if let Some(component) = self.load(engine, digest_hex) {
                    return Ok((component, true));
                }
            }
            Err(reason) => tracing::warn!(%reason, "compiling without the compile cache's lock"),
        }
        let component = compile()?;
        if let Err(reason) = self.store(digest_hex, &component) {
            tracing::warn!(%reason, "failed to cache compiled plugin");
        }
        drop(lock);
        Ok((component, false))
    }

    /// Waits for the exclusive lock of `digest_hex`'s artifact (released when the file is
    /// closed, also by a process that died). The lock file stays: removing it could let two
    /// holders lock two different files.
    fn lock(&self, digest_hex: &str) -> Result<std::fs::File, String> {
        let path = self
            .dir
            .join(format!(".{digest_hex}-{}.lock", self.engine_key));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        file.lock()
            .map_err(|e| format!("cannot lock {}: {e}", path.display()))?;
        Ok(file)
    }

    /// The compiled component for `digest_hex`, when a sound artifact is cached. A corrupt or
    /// incompatible one is removed (and compiled again by the caller).
    pub(crate) fn load(&self, engine: &Engine, digest_hex: &str) -> Option<Component> {
        let path = self.path(digest_hex);
        let bytes = std::fs::read(&path).ok()?;
        let body = match verified_body(&bytes) {
            Some(body) => body,
            None => {
                tracing::warn!(path = %path.display(), "compiled plugin failed its checksum; compiling again");
                let _ = std::fs::remove_file(&path);
                return None;
            }
        };
        // SAFETY: `deserialize` trusts its input to be wasmtime's own output. This body was
        // serialized by this host (the directory is writable by this user only, checked in
        // `open`), its checksum matches, its name binds it to the component's digest, and
        // wasmtime itself refuses an artifact of another version or engine configuration.
        match unsafe { Component::deserialize(engine, body) } {
            Ok(component) => {
                // Used now: the last to be evicted.
                if let Ok(f) = std::fs::File::options().write(true).open(&path) {
                    let _ = f.set_modified(std::time::SystemTime::now());
                }
                Some(component)
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cached compiled plugin refused; compiling again");
                let _ = std::fs::remove_file(&path);
                None
            }
        }
    }

    /// Writes the compiled component atomically (temporary file, fsync, rename); a failure
    /// only costs the next start a compilation, so it is returned for a warning.
    fn store(&self, digest_hex: &str, component: &Component) -> Result<(), String> {
        let body = component
            .serialize()
            .map_err(|e| format!("cannot serialize: {e}"))?;
        let path = self.path(digest_hex);
        // Unique per write: two threads of one process may store at once.
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let write_no = WRITES.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!(
            ".{digest_hex}.{}.{write_no}.tmp",
            std::process::id()
        ));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(MAGIC)?;
            f.write_all(&Sha256::digest(&body))?;
            f.write_all(&body)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!("cannot write {}: {e}", path.display())
        })?;
        self.evict(Some(&path));
        Ok(())
    }
}

fn verified_body(bytes: &[u8]) -> Option<&[u8]> {
    let rest = bytes.strip_prefix(MAGIC.as_slice())?;
    if rest.len() < 32 {
        return None;
    }
    let (sum, body) = rest.split_at(32);
    (Sha256::digest(body)[..] == *sum).then_some(body)
}
