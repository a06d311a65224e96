//! WIT 0.2.0: typed database errors, the richer values, and the consumer's configuration.

use wasmtime::component::Resource;

use super::super::PluginState;
use super::super::bindings_v2::idemhost::consumer::{config, database, logging, types as wit};
use crate::sql_gate::{SqlArray, SqlValue, Values};
use crate::tx_handle::{DbErrorKind, TxError, TxHandle};

type GuestError = wit::DbError;

super::host_interfaces!(Values::Rich);

impl config::Host for PluginState {
    async fn get(&mut self, key: String) -> wasmtime::Result<Option<String>> {
        Ok(self.config.get(&key).cloned())
    }

    async fn get_all(&mut self) -> wasmtime::Result<Vec<(String, String)>> {
        Ok(self
            .config
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }
}

fn error_to_wit(e: TxError) -> wit::DbError {
    let e = match e {
        TxError::Database(e) => e,
        refused => {
            return wit::DbError {
                kind: wit::DbErrorKind::Refused,
                sqlstate: None,
                message: refused.to_string(),
                detail: None,
                constraint: None,
            };
        }
    };
    wit::DbError {
        kind: match e.kind {
            DbErrorKind::UniqueViolation => wit::DbErrorKind::UniqueViolation,
            DbErrorKind::ForeignKeyViolation => wit::DbErrorKind::ForeignKeyViolation,
            DbErrorKind::CheckViolation => wit::DbErrorKind::CheckViolation,
            DbErrorKind::NotNullViolation => wit::DbErrorKind::NotNullViolation,
            DbErrorKind::IntegrityViolation => wit::DbErrorKind::IntegrityViolation,
            DbErrorKind::InvalidValue => wit::DbErrorKind::InvalidValue,
            DbErrorKind::SerializationFailure => wit::DbErrorKind::SerializationFailure,
            DbErrorKind::Deadlock => wit::DbErrorKind::Deadlock,
            DbErrorKind::Timeout => wit::DbErrorKind::Timeout,
            DbErrorKind::Aborted => wit::DbErrorKind::Aborted,
            DbErrorKind::Other => wit::DbErrorKind::Other,
        },
        sqlstate: e.sqlstate,
        message: e.message,
        detail: e.detail,
        constraint: e.constraint,
    }
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
        wit::SqlValue::Numeric(s) => SqlValue::Numeric(s),
        wit::SqlValue::Timestamp(t) => SqlValue::Timestamp(t),
        wit::SqlValue::Date(d) => SqlValue::Date(d),
        wit::SqlValue::Uuid(s) => SqlValue::Uuid(s),
        wit::SqlValue::Array(a) => SqlValue::Array(match a {
            wit::SqlArray::Boolean(v) => SqlArray::Boolean(v),
            wit::SqlArray::Int(v) => SqlArray::Int(v),
            wit::SqlArray::Float(v) => SqlArray::Float(v),
            wit::SqlArray::Text(v) => SqlArray::Text(v),
            wit::SqlArray::Numeric(v) => SqlArray::Numeric(v),
            wit::SqlArray::Timestamp(v) => SqlArray::Timestamp(v),
            wit::SqlArray::Date(v) => SqlArray::Date(v),
            wit::SqlArray::Uuid(v) => SqlArray::Uuid(v),
        }),
    }
}

fn to_wit(v: SqlValue) -> wit::SqlValue {
    match v {
        SqlValue::Null => wit::SqlValue::Null,
        SqlValue::Boolean(b) => wit::SqlValue::Boolean(b),
        SqlValue::Int(i) => wit::SqlValue::Int(i),
        SqlValue::Float(f) => wit::SqlValue::Float(f),
        SqlValue::Text(s) => wit::SqlValue::Text(s),
        SqlValue::Bytes(b) => wit::SqlValue::Bytes(b),
        SqlValue::Json(s) => wit::SqlValue::Json(s),
        SqlValue::Numeric(s) => wit::SqlValue::Numeric(s),
        SqlValue::Timestamp(t) => wit::SqlValue::Timestamp(t),
        SqlValue::Date(d) => wit::SqlValue::Date(d),
        SqlValue::Uuid(s) => wit::SqlValue::Uuid(s),
        SqlValue::Array(a) => wit::SqlValue::Array(match a {
            SqlArray::Boolean(v) => wit::SqlArray::Boolean(v),
            SqlArray::Int(v) => wit::SqlArray::Int(v),
            SqlArray::Float(v) => wit::SqlArray::Float(v),
            SqlArray::Text(v) => wit::SqlArray::Text(v),
            SqlArray::Numeric(v) => wit::SqlArray::Numeric(v),
            SqlArray::Timestamp(v) => wit::SqlArray::Timestamp(v),
            SqlArray::Date(v) => wit::SqlArray::Date(v),
            SqlArray::Uuid(v) => wit::SqlArray::Uuid(v),
        }),
    }
}
