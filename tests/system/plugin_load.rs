//! Loading plugins: what the host refuses, with the reason named, before a component serves
//! any delivery; and the compile cache that lets a restart skip compilation safely.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use crate::common::*;
use idemhost::PluginError;
use idemhost::{PluginLimits, PluginRuntime};

const LIMITS: PluginLimits = PluginLimits {
    timeout: Duration::from_secs(5),
    memory: 64 << 20,
};

fn refuse(wat: &str) -> String {
    let bytes = wat::parse_str(wat).unwrap();
    match runtime().load_bytes(&bytes, "test.wasm".as_ref(), LIMITS) {
        Ok(_) => panic!("accepted: {wat}"),
        Err(e) => e.to_string(),
    }
}

fn scratch_dir(tag: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique(tag));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The cache directory's files whose names end in `.<ext>`.
fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    found.sort();
    found
}

/// A core module is not a component: refused as such.
#[test]
fn core_module_is_refused_as_not_a_component() {
    let err = refuse("(module)");
    assert!(
        err.contains("is not a valid WebAssembly component"),
        "{err}"
    );
}

/// A component asking for the filesystem is refused, and the error names that import.
#[test]
fn filesystem_import_is_refused_by_name() {
    let err = refuse(r#"(component (import "wasi:filesystem/types@0.2.0" (instance)))"#);
    assert!(
        err.contains("imports `wasi:filesystem/types@0.2.0`, which idemhost does not grant"),
        "{err}"
    );
    let err = refuse(r#"(component (import "wasi:sockets/tcp@0.2.0" (instance)))"#);
    assert!(err.contains("`wasi:sockets/tcp@0.2.0`"), "{err}");
}

/// A component that does not export the handling interface is refused, naming what it lacks.
#[test]
fn component_without_the_handling_export_is_refused() {
    let err = refuse("(component)");
    assert!(
        err.contains(
            "does not export `idemhost:consumer/handling@0.1.x` or \
             `idemhost:consumer/handling@0.2.x` (it exports: nothing)"
        ),
        "{err}"
    );
}

/// An idemhost interface of another version line is refused with the version this host speaks.
#[test]
fn other_idemhost_version_is_refused() {
    let err = refuse(r#"(component (import "idemhost:consumer/database@0.3.0" (instance)))"#);
    assert!(
        err.contains("this host speaks idemhost:consumer@0.1.x and 0.2.x"),
        "{err}"
    );
    // 0.1.0 has no `config`: a component of the 0.1 line importing it is refused by name.
    let err = refuse(
        r#"(component
             (import "idemhost:consumer/config@0.1.0" (instance))
             (instance $h)
             (export "idemhost:consumer/handling@0.1.0" (instance $h)))"#,
    );
    assert!(
        err.contains("which idemhost:consumer@0.1.0 does not have"),
        "{err}"
    );
}

/// A component whose start-up memory exceeds the consumer's `memory_limit` is refused at
/// load (by its trial instantiation), not at every delivery.
#[test]
fn component_outgrowing_its_memory_limit_at_start_is_refused_at_load() {
    let limits = PluginLimits {
        memory: 1 << 20,
        ..LIMITS
    };
    let err = match runtime().load(&plugin_path("inventory-py"), limits) {
        Ok(_) => panic!("a Python component fits in 1 MiB?"),
        Err(e) => e,
    };
    assert!(matches!(err, PluginError::Instantiate { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("memory_limit of 1048576 bytes exceeded"),
        "{err}"
    );
}

/// The second load of the same bytes deserializes the cached artifact; the digest and the
/// behaviour are the same.
#[test]
fn second_load_comes_from_the_compile_cache() {
    let dir = scratch_dir("cache_hit");
    let mut rt = PluginRuntime::new().unwrap();
    rt.set_compile_cache(Some(&dir)).unwrap();
    let first = rt.load(&plugin_path("inventory-c"), LIMITS).unwrap();
    let second = rt.load(&plugin_path("inventory-c"), LIMITS).unwrap();
    assert!(!first.load_info().from_cache);
    assert!(second.load_info().from_cache);
    assert_eq!(first.digest(), second.digest());
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "the cache directory is private");
    assert_eq!(files(&dir, "cwasm").len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The cache is bounded: past `host.compile_cache_max` the artifact used least recently goes
/// (a load renews its artifact), never the one just written, and the bound holds after every
/// load — here with no idle time required (the host's is an hour: see the next test). Three small plugins with room for two: it was unbounded (35 MB per digest of an
/// interpreter-sized plugin, 207 MB after ten `plugin build`s).
#[test]
fn the_compile_cache_is_bounded_and_evicts_the_least_recently_used() {
    let dir = scratch_dir("cache_bound");
    let mut rt = PluginRuntime::new().unwrap();
    rt.set_compile_cache(Some(&dir)).unwrap();
    let load = |rt: &PluginRuntime, name: &str| {
        let h = rt.load(&plugin_path(name), LIMITS).unwrap();
        (h.load_info().from_cache, h.digest().to_string())
    };
    let sizes = |dir: &std::path::Path| -> Vec<u64> {
        files(dir, "cwasm")
            .iter()
            .map(|f| std::fs::metadata(f).unwrap().len())
            .collect()
    };
    // Their artifacts' sizes, measured in a cache of their own: `b` is the largest, so once it
    // is evicted the other two fit the bound of `a` and `b`.
    let measure = scratch_dir("cache_measure");
    let mut sizing = PluginRuntime::new().unwrap();
    sizing.set_compile_cache(Some(&measure)).unwrap();
    let mut by_size: Vec<(u64, &str)> = ["inventory", "testkit", "inventory-c"]
        .into_iter()
        .map(|name| {
            let before: u64 = sizes(&measure).iter().sum();
            load(&sizing, name);
            (sizes(&measure).iter().sum::<u64>() - before, name)
        })
        .collect();
    std::fs::remove_dir_all(&measure).unwrap();
    by_size.sort();
    let [(size_a, name_a), (_, name_c), (size_b, name_b)] = by_size[..] else {
        unreachable!()
    };
    let bound = size_a + size_b;

    let (_, a) = load(&rt, name_a);
    std::thread::sleep(Duration::from_millis(20));
    let (_, b) = load(&rt, name_b);
    rt.set_compile_cache_bound(bound, Duration::ZERO);
    assert_eq!(files(&dir, "cwasm").len(), 2, "both fit");
    std::thread::sleep(Duration::from_millis(20));
    // a is used again: b is now the least recently used.
    assert!(load(&rt, name_a).0, "a still cached");
    std::thread::sleep(Duration::from_millis(20));
    let (cached, c) = load(&rt, name_c);
    assert!(!cached);
    let kept = files(&dir, "cwasm");
    let has = |digest: &str| {
        let hex = digest.trim_start_matches("sha256:");
        kept.iter().any(|f| f.to_string_lossy().contains(hex))
    };
    assert!(
        has(&a) && has(&c) && !has(&b),
        "kept {kept:?}; a {a} b {b} c {c}"
    );
    assert!(sizes(&dir).iter().sum::<u64>() <= bound);
    // Evicted means compiled again, then kept.
    assert!(!load(&rt, name_b).0);
    assert!(load(&rt, name_b).0);
    // A bound under one artifact keeps the one just written, alone.
    rt.set_compile_cache_bound(1, Duration::ZERO);
    assert_eq!(files(&dir, "cwasm").len(), 0);
    assert!(!load(&rt, "inventory").0);
    assert_eq!(files(&dir, "cwasm").len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Artifacts used within the idle time are never evicted, over the bound or not: processes
/// sharing a cache whose working set exceeds the bound (replicas on one volume, the suite's
/// hosts sharing `~/.cache` with stale artifacts) would otherwise evict each other's artifacts
/// and compile them again for ever (review finding F6).
#[test]
fn artifacts_in_use_are_not_evicted() {
    let dir = scratch_dir("cache_in_use");
    let mut rt = PluginRuntime::new().unwrap();
    rt.set_compile_cache(Some(&dir)).unwrap();
    rt.load(&plugin_path("inventory"), LIMITS).unwrap();
    rt.load(&plugin_path("testkit"), LIMITS).unwrap();
    rt.set_compile_cache_bound(1, Duration::from_secs(3600));
    assert_eq!(
        files(&dir, "cwasm").len(),
        2,
        "nothing idle for an hour: nothing evicted"
    );
    assert!(
        rt.load(&plugin_path("inventory"), LIMITS)
            .unwrap()
            .load_info()
            .from_cache
    );
    assert!(
        rt.load(&plugin_path("testkit"), LIMITS)
            .unwrap()
            .load_info()
            .from_cache
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Loaders of one component that start together (replicas sharing a cache volume, tests in
/// parallel) compile it once: the others wait on the artifact's lock and deserialize it.
#[test]
fn loads_that_start_together_compile_once() {
    let dir = scratch_dir("cache_together");
    let barrier = Arc::new(Barrier::new(3));
    let loads: Vec<_> = (0..3)
        .map(|_| {
            let (dir, barrier) = (dir.clone(), barrier.clone());
            std::thread::spawn(move || {
                // One runtime each, as separate processes would have.
                let mut rt = PluginRuntime::new().unwrap();
                rt.set_compile_cache(Some(&dir)).unwrap();
                barrier.wait();
                let h = rt.load(&plugin_path("inventory-c"), LIMITS).unwrap();
                (h.load_info().from_cache, h.digest().to_string())
            })
        })
        .collect();
    let loaded: Vec<(bool, String)> = loads.into_iter().map(|t| t.join().unwrap()).collect();
    let compiled = loaded.iter().filter(|(from_cache, _)| !from_cache).count();
    assert_eq!(compiled, 1, "compiled once: {loaded:?}");
    assert!(loaded.iter().all(|(_, d)| *d == loaded[0].1));
    assert_eq!(files(&dir, "cwasm").len(), 1);
    assert!(files(&dir, "tmp").is_empty(), "no temporary file left");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A damaged artifact fails its checksum: the host compiles again and replaces it, never
/// running the damaged code.
#[test]
fn corrupt_cached_artifact_is_recompiled_and_replaced() {
    let dir = scratch_dir("cache_corrupt");
    let mut rt = PluginRuntime::new().unwrap();
    rt.set_compile_cache(Some(&dir)).unwrap();
    rt.load(&plugin_path("inventory"), LIMITS).unwrap();
    let artifact = files(&dir, "cwasm").remove(0);
    let mut bytes = std::fs::read(&artifact).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&artifact, &bytes).unwrap();

    let again = rt.load(&plugin_path("inventory"), LIMITS).unwrap();
    assert!(
        !again.load_info().from_cache,
        "the damaged artifact was not used"
    );
    let third = rt.load(&plugin_path("inventory"), LIMITS).unwrap();
    assert!(third.load_info().from_cache, "a sound artifact replaced it");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A cache directory other users can write to is refused: compiled code is trusted code.
#[test]
fn cache_directory_writable_by_others_is_refused() {
    let dir = scratch_dir("cache_open");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut rt = PluginRuntime::new().unwrap();
    let err = rt.set_compile_cache(Some(&dir)).unwrap_err();
    assert!(err.contains("writable by other users (mode 777)"), "{err}");
    assert!(rt.compile_cache_dir().is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A component holding more core instances than the pool grants one component (64) is refused
/// at load, with the count named: were it loaded, a few of its instances would take every
/// slot and the deliveries of every consumer would fail.
#[test]
fn component_with_too_many_core_instances_is_refused_at_load() {
    let instances = "(core instance (instantiate $m))\n".repeat(65);
    let err = refuse(&format!("(component (core module $m) {instances})"));
    assert!(
        err.contains("65 core module instances, which exceeds the configured maximum of 64"),
        "{err}"
    );
    let fits = "(core instance (instantiate $m))\n".repeat(64);
    let err = refuse(&format!("(component (core module $m) {fits})"));
    assert!(err.contains("does not export"), "{err}");
}

/// The same for memories and tables: each reserves a slot of the pool shared by every consumer,
/// so a component with more than 2 memories or 8 tables (its modules instantiated several
/// times) is refused at load, with the count named, and one at the cap is not.
#[test]
fn component_with_too_many_memories_or_tables_is_refused_at_load() {
    let component = |module: &str, n: usize| {
        let instances = "(core instance (instantiate $m))\n".repeat(n);
        format!("(component (core module $m {module}) {instances})")
    };
    let err = refuse(&component("(memory 1)", 3));
    assert!(
        err.contains("3 Wasm linear memories, which exceeds the configured maximum of 2"),
        "{err}"
    );
    let err = refuse(&component("(table 1 funcref)", 9));
    assert!(
        err.contains("9 tables, which exceeds the configured maximum of 8"),
        "{err}"
    );
    for at_cap in [
        component("(memory 1)", 2),
        component("(table 1 funcref)", 8),
    ] {
        let err = refuse(&at_cap);
        assert!(err.contains("does not export"), "{err}");
    }
}

/// A component that would take minutes to compile is refused before anything is compiled:
/// functions over the bound of locals (one, or several spread over modules and nested
/// components), or over the total. Before, three functions of 25,000 live locals took 75 s of
/// CPU on both cores and +200 MiB, and the refusal (at the world check, after compiling) left
/// the compiled code in the cache.
#[test]
fn a_compile_bomb_is_refused_before_compiling() {
    // A function declaring `n` locals and keeping all of them live.
    let bomb = |n: usize| {
        let mut f = format!("(func (result i64) (local {}) ", "i64 ".repeat(n));
        for i in 0..n {
            f.push_str(&format!("(local.set {i} (i64.const {i})) "));
        }
        f.push_str("(i64.const 0) ");
        for i in 0..n {
            f.push_str(&format!("(local.get {i}) i64.add "));
        }
        f.push(')');
        f
    };
    let cache = scratch_dir("bomb-cache");
    let mut rt = PluginRuntime::new().unwrap();
    rt.set_compile_cache(Some(&cache)).unwrap();
    for (what, wat) in [
        (
            "one function",
            format!("(component (core module {}))", bomb(25_000)),
        ),
        (
            "three functions",
            format!(
                "(component (core module {} {} {}))",
                bomb(10_001),
                bomb(10_001),
                bomb(10_001)
            ),
        ),
        (
            "a nested component",
            format!("(component (component (core module {})))", bomb(12_000)),
        ),
        (
            "locals declared, not used",
            format!(
                "(component (core module (func (local {}))))",
                "i32 ".repeat(50_000)
            ),
        ),
    ] {
        let bytes = wat::parse_str(&wat).unwrap();
        let started = std::time::Instant::now();
        let err = match rt.load_bytes(&bytes, "bomb.wasm".as_ref(), LIMITS) {
            Ok(_) => panic!("{what}: accepted"),
            Err(e) => e.to_string(),
        };
        // The precheck's refusal: nothing was compiled.
        assert!(err.contains("locals"), "{what}: {err}");
        eprintln!("{what}: refused after {:?}", started.elapsed());
    }
    // A component refused at the world check leaves no compiled code behind.
    let err = match rt.load_bytes(
        &wat::parse_str(r#"(component (import "wasi:sockets/tcp@0.2.0" (instance)))"#).unwrap(),
        "sockets.wasm".as_ref(),
        LIMITS,
    ) {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("does not grant"), "{err}");
    assert!(
        files(&cache, "cwasm").is_empty(),
        "{:?}",
        files(&cache, "cwasm")
    );
}
