//! A scriptable plugin for idemhost's own tests: the payload is a JSON script of steps, so one
//! component can behave well, fail, trap, loop forever or grab memory on request.
//!
//! Build: `scripts/build-plugins.sh`. Payload: `{"steps": [STEP, ...]}` where STEP is one of
//! `{"execute": SQL, "params": [...]}`, `{"query": SQL, "params": [...]}` (an error from either
//! ends the script with `retryable(error)` unless `"keep_going": true`, in which case the error
//! text is recorded by the next `{"record_errors": TABLE}` step), `{"fail": "retryable" |
//! "terminal", "reason": TEXT}`, `{"fail_before_attempt": N}` (retryable while the delivery
//! attempt is below N), `"trap"`, `"loop"`, `{"alloc_mib": N}`, `{"log": TEXT, "times": N}`,
//! `{"publish": SUBJECT, "payload": TEXT, "headers": [[NAME, VALUE], ...]}` (through the outbox).
//! Params are JSON: null, bool, integer, float or string.

wit_bindgen::generate!({ path: "../../wit", world: "handler" });

use exports::idemhost::consumer::handling::Guest;
use idemhost::consumer::database::Transaction;
use idemhost::consumer::logging::log;
use idemhost::consumer::types::{HandlerError, Message, SqlValue};
use serde_json::Value;

struct Testkit;

fn param(v: &Value) -> SqlValue {
    match v {
        Value::Null => SqlValue::Null,
        Value::Bool(b) => SqlValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => SqlValue::Int(i),
            None => SqlValue::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => SqlValue::Text(s.clone()),
        other => SqlValue::Json(other.to_string()),
    }
}

fn params(step: &Value) -> Vec<SqlValue> {
    step.get("params")
        .and_then(Value::as_array)
        .map(|a| a.iter().map(param).collect())
        .unwrap_or_default()
}

impl Guest for Testkit {
    fn handle(tx: &Transaction, msg: Message) -> Result<(), HandlerError> {
        let script: Value = serde_json::from_slice(&msg.payload)
            .map_err(|e| HandlerError::Terminal(format!("bad script: {e}")))?;
        let keep_going = script
            .get("keep_going")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let steps = script
            .get("steps")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let mut errors: Vec<String> = Vec::new();
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        for step in &steps {
            let result = if let Some(sql) = step.get("execute").and_then(Value::as_str) {
                tx.execute(sql, &params(step)).map(|_| ())
            } else if let Some(sql) = step.get("query").and_then(Value::as_str) {
                tx.query(sql, &params(step)).map(|_| ())
            } else if let Some(table) = step.get("record_errors").and_then(Value::as_str) {
                for e in errors.drain(..) {
                    let sql = format!("INSERT INTO {table} (error) VALUES ($1)");
                    tx.execute(&sql, &[SqlValue::Text(e)])
                        .map_err(HandlerError::Retryable)?;
                }
                Ok(())
            } else if let Some(kind) = step.get("fail").and_then(Value::as_str) {
                let reason = step
                    .get("reason")
                    .and_then(Value::as_str)
                    .unwrap_or("asked to fail");
                return Err(match kind {
                    "terminal" => HandlerError::Terminal(reason.to_string()),
                    _ => HandlerError::Retryable(reason.to_string()),
                });
            } else if let Some(n) = step.get("fail_before_attempt").and_then(Value::as_u64) {
                if u64::from(msg.delivery_attempt) < n {
                    return Err(HandlerError::Retryable(format!(
                        "attempt {} < {n}",
                        msg.delivery_attempt
                    )));
                }
                Ok(())
            } else if let Some(mib) = step.get("alloc_mib").and_then(Value::as_u64) {
                for _ in 0..mib {
                    hoard.push(vec![1u8; 1 << 20]);
                }
                Ok(())
            } else if let Some(subject) = step.get("publish").and_then(Value::as_str) {
                let payload = step.get("payload").and_then(Value::as_str).unwrap_or("");
                let headers: Vec<(String, String)> = step
                    .get("headers")
                    .and_then(Value::as_array)
                    .map(|hs| {
                        hs.iter()
                            .filter_map(|h| {
                                Some((
                                    h.get(0)?.as_str()?.to_string(),
                                    h.get(1)?.as_str()?.to_string(),
                                ))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                tx.publish(subject, &headers, payload.as_bytes())
            } else if let Some(text) = step.get("log").and_then(Value::as_str) {
                let times = step.get("times").and_then(Value::as_u64).unwrap_or(1);
                for _ in 0..times {
                    log("info", text);
                }
                Ok(())
            } else if step.as_str() == Some("trap") {
                core::arch::wasm32::unreachable()
            } else if step.as_str() == Some("loop") {
                let mut n: u64 = 0;
                loop {
                    n = core::hint::black_box(n.wrapping_add(1));
                }
            } else {
                Err(format!("unknown step {step}"))
            };
            if let Err(e) = result {
                if !keep_going {
                    return Err(HandlerError::Retryable(e));
                }
                errors.push(e);
            }
        }
        core::hint::black_box(&hoard);
        Ok(())
    }
}

export!(Testkit);
