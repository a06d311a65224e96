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
//! Params are JSON: null, bool, integer, float or string; built with the `wit-0-2` feature
//! (against idemhost:consumer@0.2.0) also `{"numeric": TEXT}`, `{"uuid": TEXT}`,
//! `{"timestamp": N}`, `{"date": N}`, `{"text_array": [TEXT|null, ...]}`,
//! `{"int_array": [N|null, ...]}`, and made in the plugin at any size: `{"text_array_of": N}`
//! (N empty texts), `{"int_array_of": N}` and `{"numeric_digits": N}` (N nines).

#[cfg(not(feature = "wit-0-2"))]
wit_bindgen::generate!({ path: "../../wit", world: "handler" });
#[cfg(feature = "wit-0-2")]
wit_bindgen::generate!({ path: "../../wit/0.2.0", world: "handler" });

use exports::idemhost::consumer::handling::Guest;
use idemhost::consumer::database::Transaction;
use idemhost::consumer::logging::log;
use idemhost::consumer::types::{HandlerError, Message, SqlValue};
use serde_json::Value;

struct Testkit;

/// A database call's error as text: 0.1.0's string, or 0.2.0's error as `SQLSTATE: message`.
#[cfg(not(feature = "wit-0-2"))]
fn text<T>(r: Result<T, String>) -> Result<T, String> {
    r
}

#[cfg(feature = "wit-0-2")]
fn text<T>(r: Result<T, idemhost::consumer::types::DbError>) -> Result<T, String> {
    r.map_err(|e| match e.sqlstate {
        Some(code) => format!("{code}: {}", e.message),
        None => e.message,
    })
}

/// A parameter of a 0.2.0 case, written `{"numeric": "1.5"}` and so on.
#[cfg(feature = "wit-0-2")]
fn rich(key: &str, v: &Value) -> Option<SqlValue> {
    use idemhost::consumer::types::SqlArray;
    let texts = |v: &Value| -> Option<Vec<Option<String>>> {
        Some(v.as_array()?.iter().map(|e| e.as_str().map(str::to_string)).collect())
    };
    Some(match key {
        "numeric" => SqlValue::Numeric(v.as_str()?.to_string()),
        "uuid" => SqlValue::Uuid(v.as_str()?.to_string()),
        "timestamp" => SqlValue::Timestamp(v.as_i64()?),
        "date" => SqlValue::Date(i32::try_from(v.as_i64()?).ok()?),
        "text_array" => SqlValue::Array(SqlArray::Text(texts(v)?)),
        "int_array" => SqlValue::Array(SqlArray::Int(
            v.as_array()?.iter().map(Value::as_i64).collect(),
        )),
        // Made here, at sizes a message could not carry.
        "text_array_of" => SqlValue::Array(SqlArray::Text(vec![
            Some(String::new());
            usize::try_from(v.as_u64()?).ok()?
        ])),
        "int_array_of" => {
            SqlValue::Array(SqlArray::Int(vec![Some(1); usize::try_from(v.as_u64()?).ok()?]))
        }
        "numeric_digits" => SqlValue::Numeric("9".repeat(usize::try_from(v.as_u64()?).ok()?)),
        _ => return None,
    })
}

#[cfg(not(feature = "wit-0-2"))]
fn rich(_key: &str, _v: &Value) -> Option<SqlValue> {
    None
}

fn param(v: &Value) -> SqlValue {
    if let Some(obj) = v.as_object()
        && obj.len() == 1
        && let Some((key, inner)) = obj.iter().next()
        && let Some(value) = rich(key, inner)
    {
        return value;
    }
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
                text(tx.execute(sql, &params(step))).map(|_| ())
            } else if let Some(sql) = step.get("query").and_then(Value::as_str) {
                text(tx.query(sql, &params(step))).map(|_| ())
            } else if let Some(table) = step.get("record_errors").and_then(Value::as_str) {
                for e in errors.drain(..) {
                    let sql = format!("INSERT INTO {table} (error) VALUES ($1)");
                    text(tx.execute(&sql, &[SqlValue::Text(e)])).map_err(HandlerError::Retryable)?;
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
                text(tx.publish(subject, &headers, payload.as_bytes()))
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
