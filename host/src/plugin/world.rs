//! What a plugin component may import and must export, checked before it is linked, so a
//! refusal names the offending import or the missing export instead of a linker error.

use wasmtime::Engine;
use wasmtime::component::Component;

/// The interface every plugin exports; the host calls its `handle`.
pub(crate) const HANDLING: &str = "idemhost:consumer/handling";
/// The version line of the `idemhost:consumer` package this host speaks.
const IDEMHOST_VERSION: &str = "0.1.";

/// Every interface a plugin may import (version left out), and what it gets there. Nothing
/// else is linked: no filesystem, sockets, HTTP or host environment.
pub(crate) const GRANTED: &[(&str, &str)] = &[
    ("idemhost:consumer/types", "the world's types"),
    ("idemhost:consumer/database", "the lent transaction"),
    (
        "idemhost:consumer/logging",
        "log lines into the delivery's span",
    ),
    ("wasi:io/error", "errors of the streams below"),
    ("wasi:io/poll", "pollables of the clocks and streams below"),
    (
        "wasi:io/streams",
        "the streams of stdin/stdout/stderr below",
    ),
    ("wasi:clocks/wall-clock", "the real time of day"),
    ("wasi:clocks/monotonic-clock", "a monotonic clock"),
    ("wasi:random/random", "secure random bytes"),
    ("wasi:random/insecure", "fast random bytes"),
    ("wasi:random/insecure-seed", "a random seed"),
    (
        "wasi:cli/environment",
        "an empty environment, no arguments, no working directory",
    ),
    ("wasi:cli/exit", "exit, which ends the call as a trap"),
    ("wasi:cli/stdin", "an empty stdin"),
    ("wasi:cli/stdout", "a stdout that discards what is written"),
    ("wasi:cli/stderr", "a stderr that discards what is written"),
    ("wasi:cli/terminal-input", "no terminal"),
    ("wasi:cli/terminal-output", "no terminal"),
    ("wasi:cli/terminal-stdin", "no terminal"),
    ("wasi:cli/terminal-stdout", "no terminal"),
    ("wasi:cli/terminal-stderr", "no terminal"),
];

/// What a component that fits the world imports and targets.
pub(crate) struct Fit {
    /// The WASI interfaces it imports (the capabilities it is granted beyond the world).
    pub(crate) wasi: Vec<String>,
    /// The `idemhost:consumer` version it was built against, from its `handling` export
    /// (`0.1.0`).
    pub(crate) version: String,
}

/// Checks the component's imports against [`GRANTED`] and that it exports `handling`.
/// Returns what it imports and targets, or the reason it is refused.
pub(crate) fn check(component: &Component, engine: &Engine) -> Result<Fit, String> {
    let ty = component.component_type();
    let mut wasi = Vec::new();
    for (name, _) in ty.imports(engine) {
        let (interface, version) = name.split_once('@').unwrap_or((name, ""));
        if !GRANTED.iter().any(|(granted, _)| *granted == interface) {
            return Err(format!(
                "it imports `{name}`, which idemhost does not grant; a plugin may import only {}",
                granted_summary()
            ));
        }
        if interface.starts_with("idemhost:") && !version.starts_with(IDEMHOST_VERSION) {
            return Err(format!(
                "it imports `{name}`, but this host speaks idemhost:consumer@{IDEMHOST_VERSION}x"
            ));
        }
        if interface.starts_with("wasi:") {
            wasi.push(name.to_string());
        }
    }
    let exports: Vec<&str> = ty.exports(engine).map(|(name, _)| name).collect();
    let handles = exports.iter().find_map(|name| {
        name.split_once('@')
            .filter(|(i, v)| *i == HANDLING && v.starts_with(IDEMHOST_VERSION))
            .map(|(_, v)| v)
    });
    let Some(version) = handles else {
        return Err(format!(
            "it does not export `{HANDLING}@{IDEMHOST_VERSION}x` (it exports: {})",
            if exports.is_empty() {
                "nothing".to_string()
            } else {
                exports.join(", ")
            }
        ));
    };
    Ok(Fit {
        wasi,
        version: version.to_string(),
    })
}

fn granted_summary() -> String {
    let names: Vec<&str> = GRANTED.iter().map(|(name, _)| *name).collect();
    names.join(", ")
}
