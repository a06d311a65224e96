//! What compiling a component may cost, judged from its bytes before anything is compiled.
//! Cranelift's time and memory grow faster than quadratically with a function's live locals (a
//! 1.15 MB component of three functions with 25,000 locals each took 75 s of CPU and 200 MiB);
//! a component whose functions are over these bounds is refused at once, whoever sent it (a
//! file, the admin deploy, the plugin store).

use wasmparser::{Parser, Payload};

/// Locals one function may declare. The largest in the project's own plugins (Rust, C, and the
/// CPython and JavaScript interpreters componentize-py and jco link in) is measured by
/// `plugin_load.rs`; this leaves room above it.
pub(crate) const MAX_LOCALS_PER_FUNCTION: u64 = 10_000;
/// Bytes of one function's body.
pub(crate) const MAX_FUNCTION_BYTES: usize = 4 << 20;
/// Locals of all functions together, which bounds the whole compile.
pub(crate) const MAX_TOTAL_LOCALS: u64 = 4_000_000;

/// What the largest function of `bytes` (every core module, nested ones included) declares:
/// (locals, body bytes), and the locals of all functions. `Err` if it does not parse.
pub(crate) fn measure(bytes: &[u8]) -> Result<(u64, usize, u64), String> {
    let (mut locals_max, mut body_max, mut total) = (0u64, 0usize, 0u64);
    for payload in Parser::new(0).parse_all(bytes) {
        let payload = payload.map_err(|e| format!("{e}"))?;
        if let Payload::CodeSectionEntry(body) = payload {
            let mut locals = 0u64;
            for local in body.get_locals_reader().map_err(|e| format!("{e}"))? {
                let (count, _) = local.map_err(|e| format!("{e}"))?;
                locals = locals.saturating_add(u64::from(count));
            }
            locals_max = locals_max.max(locals);
            body_max = body_max.max(body.range().len());
            total = total.saturating_add(locals);
        }
    }
    Ok((locals_max, body_max, total))
}

/// Refuses a component whose compile is not bounded (see the constants).
pub(crate) fn check(bytes: &[u8]) -> Result<(), String> {
    let (locals, body, total) = measure(bytes)?;
    if locals > MAX_LOCALS_PER_FUNCTION {
        return Err(format!(
            "a function declares {locals} locals; at most {MAX_LOCALS_PER_FUNCTION} (compiling \
             such a function takes minutes)"
        ));
    }
    if body > MAX_FUNCTION_BYTES {
        return Err(format!(
            "a function's body is {body} bytes; at most {MAX_FUNCTION_BYTES}"
        ));
    }
    if total > MAX_TOTAL_LOCALS {
        return Err(format!(
            "its functions declare {total} locals together; at most {MAX_TOTAL_LOCALS}"
        ));
    }
    Ok(())
}
