//! WASM plugins: the engine, loading and validating a component against the `handler` world,
//! and running one sandboxed instance per delivery with a deadline and a memory cap. What a
//! plugin may touch is exactly its [`PluginState`]: the lent transaction, its limits, a log sink.
//! Submodules: [`world`] (what a component may import and must export), `imports` (the host
//! side of the world's imports), `versions` (each WIT version's bindings and its call) and
//! `cache` (compiled components on disk, keyed by digest).

mod cache;
pub use cache::DEFAULT_MAX_BYTES as DEFAULT_COMPILE_CACHE_MAX;
mod imports;
mod precheck;
pub(crate) mod world;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, Linker, Resource, ResourceTable};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, ResourceLimiter, Store,
    UpdateDeadline,
};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

pub(crate) use crate::handler::PluginTimings;
use crate::handler::{HandleFuture, Handler, HandlerError, Message};
use crate::tx_handle::TxHandle;

mod versions;
use versions::{Pre, bindings, bindings_v2, wit};

/// A consumer's `[consumer.config]` table, which its plugin reads through the `config`
/// interface (WIT 0.2.0 on).
pub type PluginConfig = Arc<std::collections::BTreeMap<String, String>>;

/// How often the epoch advances; a plugin's deadline is checked (and it yields) at this grain.
const EPOCH_TICK: Duration = Duration::from_millis(10);
/// Log lines one delivery may emit; the rest are counted and reported once.
const MAX_LOG_LINES: u32 = 100;
const MAX_LOG_LINE_BYTES: usize = 4096;
/// Bytes of plugin log lines one attempt may put in the host's log, escaped. With the failure
/// reason's [`crate::text::MAX_REASON_BYTES`] that is 64 KiB of plugin-originated text per
/// attempt, whatever its sources (log calls, its error, the database's errors); notices never
/// reach the host (the plugin's sessions have `client_min_messages = error`).
const PLUGIN_LOG_BYTES: usize = (64 << 10) - crate::text::MAX_REASON_BYTES;
/// Slots whose leftover memory (past `keep_resident`) is decommitted together. One: as each
/// instance ends. A batch of 16 left the pages of up to 15 ended instances resident until other
/// deliveries filled it — in an idle host for ever: four memory bombs of a 128 MiB
/// `memory_limit` held 500 MiB (`contained.rs`). Batching saved no system call (each region is
/// one `madvise` either way), only the flush's lock.
const DECOMMIT_BATCH: usize = 1;

/// Core instances one component may hold. A Rust or C component has a handful (its module and
/// the adapter shims); componentize-py links the interpreter's libraries as separate modules:
/// 38 for the inventory example. The pool counts them (no memory is reserved per core
/// instance); when the total was 8 per component, a Python consumer at `max_in_flight = 8`
/// could run 3 instances at once and the rest of its deliveries failed for want of a slot.
const CORE_INSTANCES_PER_COMPONENT: u32 = 64;

/// Linear memories one component may hold (each reserves a pool slot of `max_memory`).
const MEMORIES_PER_COMPONENT: u32 = 2;

/// Tables one component may hold (each reserves a pool slot).
const TABLES_PER_COMPONENT: u32 = 8;
/// Table elements are charged against the memory budget at this many bytes each.
const TABLE_ELEMENT_BYTES: usize = 16;

/// Limits applied to every instance of one consumer's plugin.
#[derive(Debug, Clone, Copy)]
pub struct PluginLimits {
    /// Wall-clock budget of one `handle` call.
    pub timeout: Duration,
    /// Bytes of all linear memories plus tables of one instance, together.
    pub memory: usize,
}

/// A component refused at load.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The file could not be read.
    #[error("failed to read plugin {path}: {source}")]
    Read {
        /// The component's file (or store origin).
        path: PathBuf,
        /// Why it could not be read.
        source: std::io::Error,
    },
    /// Not a valid component, or it could not be compiled.
    #[error("plugin {path} is not a valid WebAssembly component: {reason}")]
    Compile {
        /// The component's file (or store origin).
        path: PathBuf,
        /// The compiler's or parser's error.
        reason: String,
    },
    /// It imports or exports what the handler world does not offer.
    #[error("plugin {path} does not fit the idemhost:consumer/handler world: {reason}")]
    World {
        /// The component's file (or store origin).
        path: PathBuf,
        /// What does not fit.
        reason: String,
    },
    /// It fails to instantiate, or it is over a pool limit.
    #[error("plugin {path} cannot be instantiated: {reason}")]
    Instantiate {
        /// The component's file (or store origin).
        path: PathBuf,
        /// The error, or the limit.
        reason: String,
    },
}

/// The engine and linker shared by every plugin of the process.
pub struct PluginRuntime {
    engine: Engine,
    linker: Arc<Linker<PluginState>>,
    cache: Option<cache::CompileCache>,
}

/// Capacity of the instance pool: slots are reserved once and reused, so a delivery's
/// instantiation costs no mmap/munmap of memories, tables or async stacks.
#[derive(Debug, Clone, Copy)]
pub struct PoolSizing {
    /// Plugin instances alive at once (every in-flight delivery of every consumer holds one).
    pub instances: u32,
    /// Largest linear memory one instance may grow to (the largest `memory_limit`).
    pub max_memory: usize,
    /// Bytes of each pooled memory reset in place rather than decommitted
    /// (`plugins.keep_resident`).
    pub keep_resident: usize,
}

impl Default for PoolSizing {
    fn default() -> Self {
        PoolSizing {
            instances: 64,
            max_memory: 64 << 20,
            keep_resident: 4 << 20,
        }
    }
}

impl PluginRuntime {
    /// A runtime with the default pool (64 concurrent instances of up to 64 MiB).
    pub fn new() -> Result<Self, crate::Error> {
        Self::with_pool(PoolSizing::default())
    }

    /// A runtime whose instance pool is sized by `pool`.
    pub fn with_pool(pool: PoolSizing) -> Result<Self, crate::Error> {
        Ok(Self::engine_with_pool(pool)?)
    }

    fn engine_with_pool(pool: PoolSizing) -> anyhow::Result<Self> {
        let mut config = Config::new();
        config.wasm_component_model(true);
        config.epoch_interruption(true);
        // No .eh_frame registered for compiled plugins. Nothing of ours unwinds through a
        // plugin's frames (wasmtime catches a host function's panic before the wasm frames,
        // and takes a trap's wasm backtrace from its own tables), and the static build's
        // unwinder (LLVM libunwind) removes registered frames one at a time, each a scan of
        // all of them: unloading the Python example spent 69 % of `plugin check`'s CPU there,
        // and every hot swap or `plugin test` of an interpreter paid it.
        config.native_unwind_info(false);
        let n = pool.instances.max(1);
        let mut pooling = PoolingAllocationConfig::default();
        // The totals are `n` times what one component may hold, so any `n` instances of
        // components that loaded fit at once; a component holding more is refused at load
        // (its trial instantiation), not at a delivery.
        pooling
            .total_component_instances(n)
            .max_core_instances_per_component(CORE_INSTANCES_PER_COMPONENT)
            .total_core_instances(n.saturating_mul(CORE_INSTANCES_PER_COMPONENT))
            .max_memories_per_component(MEMORIES_PER_COMPONENT)
            .total_memories(n.saturating_mul(MEMORIES_PER_COMPONENT))
            .max_tables_per_component(TABLES_PER_COMPONENT)
            .total_tables(n.saturating_mul(TABLES_PER_COMPONENT))
            .total_stacks(n)
            .max_memory_size(pool.max_memory)
            // An interpreter (Python, JavaScript) dirties megabytes of its heap image in every
            // delivery. Resetting a slot with madvise makes the next delivery page-fault all of
            // them back in; instead, find the dirty pages (PAGEMAP_SCAN, Linux 6.7+) and copy
            // the image back over them, keeping them resident, up to this much per memory.
            .pagemap_scan(wasmtime::Enabled::Auto)
            .linear_memory_keep_resident(pool.keep_resident)
            .table_keep_resident(pool.keep_resident / 16)
            .decommit_batch_size(DECOMMIT_BATCH);
        config.allocation_strategy(InstanceAllocationStrategy::Pooling(pooling));
        let engine = Engine::new(&config)
            .map_err(|e| anyhow::anyhow!("failed to create wasm engine: {e:?}"))?;
        let mut linker = Linker::<PluginState>::new(&engine);
        imports::link(&mut linker)
            .map_err(|e| anyhow::anyhow!("failed to link host interfaces: {e:?}"))?;
        // The ticker runs while anything holds the engine: this runtime, or a handler it
        // loaded (which must keep its deadline when the runtime is gone: `plugin test` dropped
        // its runtime after loading, and a handler that looped then ran for ever).
        let weak_engine = engine.weak();
        std::thread::Builder::new()
            .name("idemhost-epoch".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(EPOCH_TICK);
                    match weak_engine.upgrade() {
                        Some(engine) => engine.increment_epoch(),
                        None => break,
                    }
                }
            })
            .map_err(|e| anyhow::anyhow!("failed to start epoch ticker: {e}"))?;
        Ok(PluginRuntime {
            engine,
            linker: Arc::new(linker),
            cache: None,
        })
    }

    /// Keeps compiled components in `dir` (created 0700; refused when others could write to
    /// it), so later loads of the same bytes skip compilation. `None` compiles every time.
    pub fn set_compile_cache(&mut self, dir: Option<&Path>) -> Result<(), String> {
        self.cache = match dir {
            Some(dir) => Some(cache::CompileCache::open(dir, &self.engine)?),
            None => None,
        };
        Ok(())
    }

    /// Bounds the compile cache's artifacts to `max_bytes` in total (default
    /// [`DEFAULT_COMPILE_CACHE_MAX`]), evicting the least recently used past it — but none
    /// used within the last hour (see [`Self::set_compile_cache_bound`]).
    pub fn set_compile_cache_max(&mut self, max_bytes: u64) {
        self.set_compile_cache_bound(max_bytes, cache::DEFAULT_MIN_IDLE);
    }

    /// [`Self::set_compile_cache_max`] with the idle time under which an artifact is never
    /// evicted (it may be in use by another process sharing the directory).
    pub fn set_compile_cache_bound(&mut self, max_bytes: u64, min_idle: Duration) {
        if let Some(cache) = &mut self.cache {
            cache.set_bound(max_bytes, min_idle);
        }
    }

    /// The compile cache directory in use, if any.
    pub fn compile_cache_dir(&self) -> Option<&Path> {
        self.cache.as_ref().map(|c| c.dir())
    }

    /// Compiles and validates a component file.
    pub fn load(&self, path: &Path, limits: PluginLimits) -> Result<WasmHandler, PluginError> {
        let bytes = std::fs::read(path).map_err(|source| PluginError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        self.load_bytes(&bytes, path, limits)
    }

    /// [`load_bytes`](Self::load_bytes) on a blocking thread: compiling takes CPU for up to
    /// seconds (or waits while another loader compiles the same component), which must not
    /// hold an async worker that deliveries and the admin endpoint share.
    pub async fn load_bytes_blocking(
        self: &Arc<Self>,
        bytes: Vec<u8>,
        origin: PathBuf,
        limits: PluginLimits,
    ) -> Result<WasmHandler, PluginError> {
        let runtime = self.clone();
        let path = origin.clone();
        tokio::task::spawn_blocking(move || runtime.load_bytes(&bytes, &origin, limits))
            .await
            .unwrap_or_else(|e| {
                Err(PluginError::Compile {
                    path,
                    reason: format!("the compiling thread failed: {e}"),
                })
            })
    }

    /// Compiles (or takes from the compile cache) and validates component bytes: the world's
    /// imports and exports, then one trial instantiation under the consumer's limits, so a
    /// component that traps or outgrows its memory at start-up is refused now, not at every
    /// delivery. `origin` names the bytes in errors.
    pub fn load_bytes(
        &self,
        bytes: &[u8],
        origin: &Path,
        limits: PluginLimits,
    ) -> Result<WasmHandler, PluginError> {
        let path = origin.to_path_buf();
        let world_err = |reason: String| PluginError::World {
            path: path.clone(),
            reason,
        };
        let digest_hex = format!("{:x}", Sha256::digest(bytes));
        // What compiling it would cost, before anything is compiled (see `precheck`).
        precheck::check(bytes).map_err(|reason| PluginError::Compile {
            path: path.clone(),
            reason,
        })?;
        let started = Instant::now();
        let compile = || {
            let component =
                Component::from_binary(&self.engine, bytes).map_err(|e| PluginError::Compile {
                    path: path.clone(),
                    reason: format!("{e:#}"),
                })?;
            // Checked before the compile cache keeps it: a refused component leaves nothing.
            world::check(&component, &self.engine).map_err(world_err)?;
            Ok(component)
        };
        let (component, from_cache) = match &self.cache {
            Some(cache) => cache.load_or_compile(&self.engine, &digest_hex, compile)?,
            None => (compile()?, false),
        };
        let compile_time = started.elapsed();
        let fit = world::check(&component, &self.engine).map_err(world_err)?;
        let instance_pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| world_err(format!("{e:#}")))?;
        let pre = Pre::new(fit.line, instance_pre).map_err(|e| world_err(format!("{e:#}")))?;
        let handler = WasmHandler {
            engine: self.engine.clone(),
            pre,
            config: PluginConfig::default(),
            digest: format!("sha256:{digest_hex}").into(),
            limits,
            info: LoadInfo {
                size: bytes.len(),
                compile_time,
                from_cache,
                wasi_imports: fit.wasi,
                world: format!("idemhost:consumer@{}", fit.version),
            },
            timings: Arc::new(PluginTimings::default()),
        };
        handler
            .trial_instantiation()
            .map_err(|reason| PluginError::Instantiate { path, reason })?;
        Ok(handler)
    }
}

/// What polls a store's futures: a tokio task, or a plain executor (`block_on`).
#[derive(Clone, Copy)]
enum Driver {
    Tokio,
    Plain,
}

/// Everything one plugin instance can reach.
pub(crate) struct PluginState {
    table: ResourceTable,
    wasi: WasiCtx,
    limiter: BudgetLimiter,
    log: LogSink,
    timed_out: bool,
    /// The consumer's `[consumer.config]` (read by 0.2.0 components).
    config: PluginConfig,
}

impl WasiView for PluginState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// One budget for all memories and tables of an instance (components may have several).
struct BudgetLimiter {
    limit: usize,
    used: usize,
    exceeded: bool,
}

impl BudgetLimiter {
    fn grow(&mut self, current: usize, desired: usize, what: &str) -> wasmtime::Result<bool> {
        let extra = desired.saturating_sub(current);
        if self.used.saturating_add(extra) > self.limit {
            self.exceeded = true;
            wasmtime::bail!(
                "memory limit of {} bytes exceeded growing a {what}",
                self.limit
            );
        }
        self.used += extra;
        Ok(true)
    }
}

impl ResourceLimiter for BudgetLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if maximum.is_some_and(|m| desired > m) {
            return Ok(false);
        }
        self.grow(current, desired, "memory")
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if maximum.is_some_and(|m| desired > m) {
            return Ok(false);
        }
        self.grow(
            current * TABLE_ELEMENT_BYTES,
            desired * TABLE_ELEMENT_BYTES,
            "table",
        )
    }
}

/// Where a plugin's `log` lines go: the delivery's tracing span, bounded per delivery.
struct LogSink {
    digest: Arc<str>,
    lines: u32,
    /// Bytes of [`PLUGIN_LOG_BYTES`] still unused.
    bytes_left: usize,
    dropped: u32,
    /// A rehearsal's trace, which keeps the lines as well.
    trace: Option<Arc<crate::tx_handle::Trace>>,
}

/// What loading a plugin found and cost.
#[derive(Debug, Clone)]
pub struct LoadInfo {
    /// Component size in bytes.
    pub size: usize,
    /// Time to compile, or to deserialize from the compile cache (after waiting, if another
    /// loader was compiling the same component).
    pub compile_time: Duration,
    /// Whether the compiled code came from the compile cache.
    pub from_cache: bool,
    /// The WASI interfaces the component imports (all harmless; see `world::GRANTED`).
    pub wasi_imports: Vec<String>,
    /// The version of the WIT package the component was built against, as
    /// `idemhost:consumer@0.1.0` (from its `handling` export).
    pub world: String,
}

/// A loaded, validated plugin. Cheap to share: every delivery instantiates it afresh.
pub struct WasmHandler {
    engine: Engine,
    pre: Pre,
    config: PluginConfig,
    digest: Arc<str>,
    limits: PluginLimits,
    info: LoadInfo,
    timings: Arc<PluginTimings>,
}

impl WasmHandler {
    /// `sha256:<hex>` of the component bytes.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// Component size in bytes.
    pub fn size(&self) -> usize {
        self.info.size
    }

    /// What loading it found and took.
    pub fn load_info(&self) -> &LoadInfo {
        &self.info
    }

    /// Its instantiate and handle times.
    pub fn timings(&self) -> &PluginTimings {
        &self.timings
    }

    /// The handler with the consumer's `[consumer.config]` table, which a 0.2.0 component
    /// reads through the `config` interface (a 0.1.0 one has no way to).
    pub fn with_config(mut self, config: PluginConfig) -> Self {
        self.config = config;
        self
    }

    /// A store for one instance: fresh state, the consumer's memory budget, and a deadline
    /// checked every epoch tick (yielding in between, so a busy plugin cannot starve other
    /// deliveries of its worker thread). `driver` says what polls the store's futures.
    fn new_store(&self, driver: Driver) -> Store<PluginState> {
        let deadline = Instant::now() + self.limits.timeout;
        let state = PluginState {
            table: ResourceTable::new(),
            wasi: WasiCtx::builder().build(),
            limiter: BudgetLimiter {
                limit: self.limits.memory,
                used: 0,
                exceeded: false,
            },
            log: LogSink {
                digest: self.digest.clone(),
                lines: 0,
                bytes_left: PLUGIN_LOG_BYTES,
                dropped: 0,
                trace: None,
            },
            timed_out: false,
            config: self.config.clone(),
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limiter);
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |mut ctx| {
            if Instant::now() >= deadline {
                ctx.data_mut().timed_out = true;
                wasmtime::bail!("handler deadline exceeded");
            }
            Ok(match driver {
                // Tokio's yield hands the wake-up to the scheduler, which runs it only after
                // the ready tasks and the I/O driver had their turn: deliveries whose database
                // replies arrived meanwhile run before this plugin's next slice. (`Yield` wakes
                // at once, and a runtime polls its driver only every 61 task polls.)
                Driver::Tokio => UpdateDeadline::YieldCustom(1, Box::pin(tokio::task::yield_now())),
                // A plain executor polls nothing else, so there is no one to yield to; and
                // tokio's deferred wake-up would wait for this runtime thread's scheduler,
                // which is blocked in that executor (the load hung: the conformance suite's
                // JavaScript and Python plugins take over a tick to instantiate in debug).
                Driver::Plain => UpdateDeadline::Continue(1),
            })
        });
        store
    }

    /// Instantiates once at load without calling anything: start functions run, initial
    /// memories are charged against the budget, and the pool's limits apply.
    fn trial_instantiation(&self) -> Result<(), String> {
        let mut store = self.new_store(Driver::Plain);
        // Instantiation can reach no database call (there is no transaction to call it on),
        // so a plain executor drives it, even on a runtime thread.
        let result = futures::executor::block_on(self.pre.instantiate(&mut store));
        match result {
            Ok(_) => Ok(()),
            Err(e) => Err(self.describe_trap(&store, &e)),
        }
    }

    fn describe_trap(&self, store: &Store<PluginState>, trap: &wasmtime::Error) -> String {
        let state = store.data();
        if state.timed_out {
            format!(
                "plugin interrupted: handler_timeout of {:?} exceeded",
                self.limits.timeout
            )
        } else if state.limiter.exceeded {
            format!(
                "plugin trapped: memory_limit of {} bytes exceeded",
                self.limits.memory
            )
        } else {
            format!("plugin trapped: {}", crate::text::reason(&first_line(trap)))
        }
    }

    async fn call(&self, tx: &TxHandle, msg: &Message) -> Result<(), HandlerError> {
        let mut store = self.new_store(Driver::Tokio);
        store.data_mut().log.trace = tx.trace().cloned();
        let mut took = CallTimes::default();
        let result = self
            .instantiate_and_handle(&mut store, tx, msg, &mut took)
            .await;
        let state = store.data();
        if state.log.dropped > 0 {
            tracing::warn!(dropped = state.log.dropped, "plugin log lines dropped");
        }
        let result = match result {
            Ok(Ok(())) => Ok(()),
            // The plugin's own words: escaped and bounded before anything logs or keeps them.
            Ok(Err(wit::HandlerError::Retryable(r))) => {
                Err(HandlerError::Retryable(crate::text::reason(&r)))
            }
            Ok(Err(wit::HandlerError::Terminal(r))) => {
                Err(HandlerError::Terminal(crate::text::reason(&r)))
            }
            Err(trap) => Err(HandlerError::Retryable(self.describe_trap(&store, &trap))),
        };
        if let Some(trace) = tx.trace() {
            let trap = match &result {
                Err(HandlerError::Retryable(reason)) if took.trapped => Some(reason.clone()),
                _ => None,
            };
            trace.call(took.instantiate, took.handle, trap, state.log.dropped);
        }
        result
        // The store — instance, memories, the lent handle — is dropped here, whatever happened.
    }

    async fn instantiate_and_handle(
        &self,
        store: &mut Store<PluginState>,
        tx: &TxHandle,
        msg: &Message,
        took: &mut CallTimes,
    ) -> wasmtime::Result<Result<(), wit::HandlerError>> {
        let started = Instant::now();
        took.trapped = true;
        let instance = self.pre.instantiate(&mut *store).await?;
        let instantiated = Instant::now();
        took.instantiate = Some(instantiated - started);
        self.timings.instantiate.record(instantiated - started);
        let handle: Resource<TxHandle> = store.data_mut().table.push(tx.clone())?;
        let rep = Resource::<TxHandle>::new_borrow(handle.rep());
        let result = instance.handle(&mut *store, rep, msg).await;
        took.handle = Some(instantiated.elapsed());
        self.timings.handle.record(instantiated.elapsed());
        store.data_mut().table.delete(handle)?;
        took.trapped = result.is_err();
        result
    }
}

/// Where one call's time went, and whether it ended in a trap (rather than the plugin's own
/// answer).
#[derive(Default)]
struct CallTimes {
    instantiate: Option<Duration>,
    handle: Option<Duration>,
    trapped: bool,
}

/// One line saying what went wrong: the trap's reason (`wasm \`unreachable\` instruction
/// executed`) when it was a trap, else the error's first line.
fn first_line(e: &wasmtime::Error) -> String {
    if let Some(trap) = e.downcast_ref::<wasmtime::Trap>() {
        return trap.to_string();
    }
    let text = format!("{e:?}");
    text.lines().next().unwrap_or("").to_string()
}

impl Handler for WasmHandler {
    fn handle<'a>(&'a self, tx: &'a TxHandle, msg: &'a Message) -> HandleFuture<'a> {
        Box::pin(self.call(tx, msg))
    }

    fn describe(&self) -> String {
        format!("wasm {}", self.digest)
    }

    fn digest(&self) -> Option<&str> {
        Some(&self.digest)
    }

    fn timings(&self) -> Option<&PluginTimings> {
        Some(&self.timings)
    }
}
