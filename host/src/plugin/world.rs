//! What a plugin component may import and must export, checked before it is linked, so a
//! refusal names the offending import or the missing export instead of a linker error.

use wasmtime::Engine;
use wasmtime::component::Component;

/// The interface every plugin exports; the host calls its `handle`.
pub(crate) const HANDLING: &str = "idemhost:consumer/handling";
/// The version lines of the `idemhost:consumer` package this host speaks, oldest first.
const LINES: &[(&str, Line)] = &[("0.1.", Line::V1), ("0.2.", Line::V2)];

/// A version line of the `idemhost:consumer` package: what the host links for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Line {
    /// 0.1.x: string errors, seven value cases.
    V1,
    /// 0.2.x: typed errors, richer values, `config`.
    V2,
}

/// Interfaces a version line has beyond 0.1.0's, with the line that brought them.
const SINCE: &[(&str, Line)] = &[("idemhost:consumer/config", Line::V2)];

/// Every interface a plugin may import (version left out), and what it gets there. Nothing
/// else is linked: no filesystem, sockets, HTTP or host environment.
pub(crate) const GRANTED: &[(&str, &str)] = &[
    ("idemhost:consumer/types", "the world's types"),
    ("idemhost:consumer/database", "the lent transaction"),
    (
        "idemhost:consumer/logging",
        "log lines into the delivery's span",
    ),
    (
        "idemhost:consumer/config",
        "the consumer's [consumer.config] table (0.2.0 on)",
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
    /// That version's line.
    pub(crate) line: Line,
}

fn line_of(version: &str) -> Option<Line> {
    LINES
        .iter()
        .find(|(prefix, _)| version.starts_with(prefix))
        .map(|(_, line)| *line)
}

fn spoken() -> String {
    let lines: Vec<String> = LINES.iter().map(|(p, _)| format!("{p}x")).collect();
    lines.join(" and ")
}

/// Checks the component's imports against [`GRANTED`] and that it exports `handling`.
/// Returns what it imports and targets, or the reason it is refused.
pub(crate) fn check(component: &Component, engine: &Engine) -> Result<Fit, String> {
    let ty = component.component_type();
    let mut wasi = Vec::new();
    let mut idemhost = Vec::new();
    for (name, _) in ty.imports(engine) {
        let (interface, version) = name.split_once('@').unwrap_or((name, ""));
        if !GRANTED.iter().any(|(granted, _)| *granted == interface) {
            return Err(format!(
                "it imports `{name}`, which idemhost does not grant; a plugin may import only {}",
                granted_summary()
            ));
        }
        if interface.starts_with("idemhost:") {
            let Some(line) = line_of(version) else {
                return Err(format!(
                    "it imports `{name}`, but this host speaks idemhost:consumer@{}",
                    spoken()
                ));
            };
            idemhost.push((name, interface, line));
        }
        if interface.starts_with("wasi:") {
            wasi.push(name.to_string());
        }
    }
    let exports: Vec<&str> = ty.exports(engine).map(|(name, _)| name).collect();
    let handles = exports.iter().find_map(|name| {
        name.split_once('@')
            .filter(|(i, v)| *i == HANDLING && line_of(v).is_some())
            .map(|(_, v)| v)
    });
    let Some((version, line)) = handles.and_then(|v| Some((v, line_of(v)?))) else {
        let wanted: Vec<String> = LINES
            .iter()
            .map(|(p, _)| format!("`{HANDLING}@{p}x`"))
            .collect();
        return Err(format!(
            "it does not export {} (it exports: {})",
            wanted.join(" or "),
            if exports.is_empty() {
                "nothing".to_string()
            } else {
                exports.join(", ")
            }
        ));
    };
    // One version line throughout: its export's.
    for (name, interface, imported) in idemhost {
        if imported != line {
            return Err(format!(
                "it imports `{name}` but exports `{HANDLING}@{version}`: a component targets \
                 one version of idemhost:consumer"
            ));
        }
        if let Some((_, since)) = SINCE.iter().find(|(i, _)| *i == interface)
            && line < *since
        {
            return Err(format!(
                "it imports `{name}`, which idemhost:consumer@{version} does not have"
            ));
        }
    }
    Ok(Fit {
        wasi,
        version: version.to_string(),
        line,
    })
}

fn granted_summary() -> String {
    let names: Vec<&str> = GRANTED.iter().map(|(name, _)| *name).collect();
    names.join(", ")
}
