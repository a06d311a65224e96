//! WIT 0.1.0: errors are strings, and values are the seven cases it has (a result column of a
//! later case is refused, as it always was).

use wasmtime::component::Resource;

use super::super::PluginState;
use super::super::bindings::idemhost::consumer::{database, logging, types as wit};
use crate::sql_gate::{SqlValue, Values};
use crate::tx_handle::{TxError, TxHandle};

type GuestError = String;

super::host_interfaces!(Values::Basic);

fn error_to_wit(e: TxError) -> String {
    e.to_string()
}

fn from_wit(v: wit::SqlValue) -> SqlValue {
    match v {
        wit::SqlValue::Null => SqlValue::Null,
        wit::SqlValue::Boolean(b) => SqlValue::Boolean(b),
        wit::SqlValue::Int(i) => SqlValue::Int(i),
        wit::SqlValue::Float(f) => SqlValue::Float(f),
        wit::SqlValue::Text(s) => SqlValue::Text(s),
        wit::SqlValue::Bytes(b) => SqlValue::Bytes(b),
        wit::SqlValue::Json(s) => SqlValue::Json(s),
    }
}

/// Results reach a 0.1.0 plugin in [`Values::Basic`] only: every other case was refused at
/// its row.
fn to_wit(v: SqlValue) -> wit::SqlValue {
    match v {
        SqlValue::Boolean(b) => wit::SqlValue::Boolean(b),
        SqlValue::Int(i) => wit::SqlValue::Int(i),
        SqlValue::Float(f) => wit::SqlValue::Float(f),
        SqlValue::Text(s) => wit::SqlValue::Text(s),
        SqlValue::Bytes(b) => wit::SqlValue::Bytes(b),
        SqlValue::Json(s) => wit::SqlValue::Json(s),
        SqlValue::Null
        | SqlValue::Numeric(_)
        | SqlValue::Timestamp(_)
        | SqlValue::Date(_)
        | SqlValue::Uuid(_)
        | SqlValue::Array(_) => wit::SqlValue::Null,
    }
}
