//! What plugin SQL may do: which statements pass the gate, how `sql-value` parameters bind and
//! how result columns convert back. Deny by default: one data statement per call, nothing that
//! controls the transaction or the session, nothing that touches the marker table.

use sqlx::postgres::types::Oid;
use sqlx::postgres::{PgArguments, PgRow, PgTypeInfo, PgValueRef, Postgres};
use sqlx::{Arguments, Column, Decode, Encode, Row, Type, TypeInfo, ValueRef};

/// A SQL parameter or result value, as the WIT `sql-value` variant carries it.
#[derive(Debug, Clone, PartialEq)]
pub enum SqlValue {
    Null,
    Boolean(bool),
    Int(i64),
    Float(f64),
    Text(String),
    Bytes(Vec<u8>),
    /// JSON text; binds as `jsonb`.
    Json(String),
}

/// Statements a plugin may start with. Everything else (transaction control, `SET`, `RESET`,
/// `LOCK`, `LISTEN`, `COPY`, DDL, `DO`, `CALL`, `PREPARE`...) is refused.
const ALLOWED_FIRST_WORDS: &[&str] = &[
    "select", "insert", "update", "delete", "with", "values", "merge", "table",
];

/// Identifiers refused anywhere in a statement: the host's tables (only the host claims
/// markers, records plugin versions, audits repairs and writes the outbox — plugins publish
/// through `tx.publish`), functions that change session settings or outlive the transaction (session-level
/// advisory locks stay on a pooled connection), and server-side file or process access.
const REFUSED_WORDS: &[&str] = &[
    "processed_message",
    "processed_message_handler",
    "dead_letter_repair",
    "outbox_message",
    "set_config",
    "pg_advisory_lock",
    "pg_advisory_lock_shared",
    "pg_try_advisory_lock",
    "pg_try_advisory_lock_shared",
    "pg_advisory_unlock",
    "pg_advisory_unlock_shared",
    "pg_advisory_unlock_all",
    "pg_terminate_backend",
    "pg_cancel_backend",
    "pg_reload_conf",
    "pg_read_file",
    "pg_read_binary_file",
    "pg_ls_dir",
    "pg_stat_file",
    "lo_import",
    "lo_export",
    "dblink",
    "dblink_exec",
];

/// Bounds on what one `query` may return to a plugin.
pub(crate) const MAX_ROWS: usize = 10_000;
pub(crate) const MAX_RESULT_BYTES: usize = 16 << 20;
/// Longest SQL text a plugin may send.
pub(crate) const MAX_SQL_BYTES: usize = 64 << 10;

/// Checks a plugin statement; `Err` is the refusal the plugin sees.
pub fn check(sql: &str) -> Result<(), String> {
    if sql.len() > MAX_SQL_BYTES {
        return Err(format!(
            "statement refused: longer than {MAX_SQL_BYTES} bytes"
        ));
    }
    let words = words(sql)?;
    let Some(first) = words.first() else {
        return Err("statement refused: empty statement".into());
    };
    if !ALLOWED_FIRST_WORDS.contains(&first.as_str()) {
        return Err(format!(
            "statement refused: `{}` is not allowed from a plugin (only SELECT, INSERT, UPDATE, \
             DELETE, WITH, VALUES, MERGE, TABLE; the host owns the transaction and the session)",
            first.to_uppercase()
        ));
    }
    if let Some(w) = words.iter().find(|w| REFUSED_WORDS.contains(&w.as_str())) {
        return Err(format!("statement refused: `{w}` is reserved to the host"));
    }
    Ok(())
}

/// Lower-cased identifiers and keywords of `sql`, outside comments and literals, with quoted
/// identifiers unquoted. A `;` followed by anything but whitespace and comments is refused: one
/// statement per call.
fn words(sql: &str) -> Result<Vec<String>, String> {
    let b = sql.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let mut ended = false;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        if c == b'-' && b.get(i + 1) == Some(&b'-') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        if c == b'/' && b.get(i + 1) == Some(&b'*') {
            // Block comments nest in PostgreSQL.
            let mut depth = 0usize;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            if depth != 0 {
                return Err("statement refused: unterminated comment".into());
            }
            continue;
        }
        if ended {
            return Err("statement refused: only one statement per call".into());
        }
        match c {
            b';' => {
                ended = true;
                i += 1;
            }
            b'\'' => i = skip_quoted(b, i, b'\'')?,
            b'"' => {
                let end = skip_quoted(b, i, b'"')?;
                out.push(sql[i + 1..end - 1].replace("\"\"", "\"").to_lowercase());
                i = end;
            }
            b'$' if !b.get(i + 1).is_some_and(u8::is_ascii_digit) => {
                i = skip_dollar_quoted(sql, i)?
            }
            c if c.is_ascii_alphabetic() || c == b'_' || c >= 0x80 => {
                let start = i;
                while i < b.len()
                    && (b[i].is_ascii_alphanumeric()
                        || b[i] == b'_'
                        || b[i] == b'$'
                        || b[i] >= 0x80)
                {
                    i += 1;
                }
                let word = &sql[start..i];
                // U&"..." spells an identifier with escapes (`U&"processed\005fmessage"`) this
                // scan cannot compare; refused. E'...' and U&'...' are literals: the prefix is
                // not an identifier of interest.
                if word.eq_ignore_ascii_case("u") && b.get(i) == Some(&b'&') {
                    let quote = b[i + 1..].iter().find(|c| !c.is_ascii_whitespace());
                    if quote == Some(&b'"') {
                        return Err(
                            "statement refused: U&\"...\" identifiers (Unicode escapes) are not allowed"
                                .into(),
                        );
                    }
                }
                out.push(word.to_lowercase());
            }
            _ => i += 1,
        }
    }
    Ok(out)
}

/// Index just past a literal or quoted identifier opened by `q` at `start` (doubled `q` is an
/// escaped quote; backslash escapes are only honoured by E'' strings, which cannot hide a quote
/// from this scan without also being a syntax error for PostgreSQL).
fn skip_quoted(b: &[u8], start: usize, q: u8) -> Result<usize, String> {
    let mut i = start + 1;
    while i < b.len() {
        if b[i] == b'\\' && q == b'\'' && start > 0 && matches!(b[start - 1], b'e' | b'E') {
            i += 2;
            continue;
        }
        if b[i] == q {
            if b.get(i + 1) == Some(&q) {
                i += 2;
                continue;
            }
            return Ok(i + 1);
        }
        i += 1;
    }
    Err("statement refused: unterminated quote".into())
}

/// Index just past a `$tag$ ... $tag$` literal starting at `start`.
fn skip_dollar_quoted(sql: &str, start: usize) -> Result<usize, String> {
    let rest = &sql[start + 1..];
    let Some(close) = rest.find('$') else {
        return Ok(start + 1);
    };
    let tag = &rest[..close];
    if !tag.chars().all(|c| c.is_alphanumeric() || c == '_') {
        return Ok(start + 1);
    }
    let delimiter = format!("${tag}$");
    let body_start = start + 1 + close + 1;
    match sql[body_start..].find(&delimiter) {
        Some(end) => Ok(body_start + end + delimiter.len()),
        None => Err("statement refused: unterminated dollar quote".into()),
    }
}

/// A value whose parameter type PostgreSQL infers from the statement (declared OID 0), used for
/// `null` so that a NULL fits any column.
struct Untyped;

impl Type<Postgres> for Untyped {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_oid(Oid(0))
    }
}

impl Encode<'_, Postgres> for Untyped {
    fn encode_by_ref(
        &self,
        _buf: &mut sqlx::postgres::PgArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        Ok(sqlx::encode::IsNull::Yes)
    }
}

/// Binds plugin parameters in order (`$1`, `$2`, ...). Each variant declares its own type:
/// int → int8, float → float8, text → text, bytes → bytea, json → jsonb, boolean → bool,
/// null → inferred. A statement casts where a column differs (`$1::uuid`).
pub fn bind(params: &[SqlValue]) -> Result<PgArguments, String> {
    let mut args = PgArguments::default();
    for (n, p) in params.iter().enumerate() {
        let added = match p {
            SqlValue::Null => args.add(Untyped),
            SqlValue::Boolean(v) => args.add(*v),
            SqlValue::Int(v) => args.add(*v),
            SqlValue::Float(v) => args.add(*v),
            SqlValue::Text(v) => args.add(v.as_str()),
            SqlValue::Bytes(v) => args.add(v.as_slice()),
            SqlValue::Json(text) => {
                let value: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| format!("parameter ${} is not valid JSON: {e}", n + 1))?;
                args.add(value)
            }
        };
        added.map_err(|e| format!("parameter ${} could not be bound: {e}", n + 1))?;
    }
    Ok(args)
}

/// Converts one result row. Types without a natural `sql-value` are refused with a hint to
/// cast them in the query.
pub fn row_values(row: &PgRow) -> Result<(Vec<SqlValue>, usize), String> {
    let mut values = Vec::with_capacity(row.len());
    let mut bytes = 0usize;
    for (i, column) in row.columns().iter().enumerate() {
        let raw = row.try_get_raw(i).map_err(|e| e.to_string())?;
        let type_name = column.type_info().name().to_string();
        let value = if raw.is_null() {
            SqlValue::Null
        } else {
            convert(raw, &type_name, column.name())?
        };
        bytes += match &value {
            SqlValue::Text(s) | SqlValue::Json(s) => s.len(),
            SqlValue::Bytes(b) => b.len(),
            _ => 8,
        };
        values.push(value);
    }
    Ok((values, bytes))
}

fn convert(raw: PgValueRef<'_>, type_name: &str, column: &str) -> Result<SqlValue, String> {
    fn dec<'r, T: Decode<'r, Postgres>>(raw: PgValueRef<'r>) -> Result<T, String> {
        T::decode(raw).map_err(|e| e.to_string())
    }
    Ok(match type_name {
        "BOOL" => SqlValue::Boolean(dec(raw)?),
        "INT2" => SqlValue::Int(dec::<i16>(raw)?.into()),
        "INT4" => SqlValue::Int(dec::<i32>(raw)?.into()),
        "INT8" => SqlValue::Int(dec(raw)?),
        "OID" => SqlValue::Int(dec::<Oid>(raw)?.0.into()),
        "FLOAT4" => SqlValue::Float(dec::<f32>(raw)?.into()),
        "FLOAT8" => SqlValue::Float(dec(raw)?),
        "TEXT" | "VARCHAR" | "BPCHAR" | "NAME" | "CHAR" | "UNKNOWN" | "CITEXT" => {
            SqlValue::Text(dec(raw)?)
        }
        "BYTEA" => SqlValue::Bytes(dec(raw)?),
        "JSON" | "JSONB" => SqlValue::Json(dec::<serde_json::Value>(raw)?.to_string()),
        "VOID" => SqlValue::Null,
        other => {
            return Err(format!(
                "column `{column}` has type {other}, which has no sql-value; cast it in the query \
                 (e.g. `{column}::text`)"
            ));
        }
    })
}

#[cfg(test)]
mod props;

#[cfg(test)]
mod tests {
    use super::check;

    #[test]
    fn data_statements_pass() {
        for sql in [
            "SELECT 1",
            "  update inventory set available = available - $1 where sku = $2",
            "INSERT INTO t VALUES ($1) ON CONFLICT DO NOTHING;",
            "WITH x AS (SELECT 1) SELECT * FROM x -- trailing comment",
            "select 'COMMIT; processed_message' as text_is_fine",
            "select $$ processed_message $$, $tag$ ; drop $tag$",
            "/* leading */ SELECT 1",
        ] {
            assert_eq!(check(sql), Ok(()), "{sql}");
        }
    }

    #[test]
    fn control_and_session_statements_are_refused() {
        for sql in [
            "COMMIT",
            "rollback",
            "SAVEPOINT a",
            "RELEASE SAVEPOINT a",
            "BEGIN",
            "END",
            "SET ROLE postgres",
            "set session_authorization postgres",
            "SET LOCAL statement_timeout = 0",
            "RESET ALL",
            "LISTEN x",
            "COPY t FROM PROGRAM 'id'",
            "LOCK TABLE inventory",
            "DO $$ BEGIN COMMIT; END $$",
            "CALL p()",
            "DROP TABLE inventory",
            "PREPARE TRANSACTION 'x'",
            "select 1; commit",
            "select 1; select 2",
            "/* c */ commit",
            "",
            ";",
        ] {
            assert!(check(sql).is_err(), "{sql} should be refused");
        }
    }

    #[test]
    fn marker_table_and_session_functions_are_refused() {
        for sql in [
            "SELECT * FROM processed_message",
            "delete from public.processed_message",
            "SELECT * FROM \"processed_message\"",
            "SELECT * FROM \"PROCESSED_MESSAGE\"",
            "select set_config('statement_timeout', '0', true)",
            "select pg_advisory_lock(1)",
            "select pg_read_file('/etc/passwd')",
            "with d as (delete from processed_message returning 1) select 1",
            "update processed_message_handler set plugin_digest = 'x'",
            "delete from dead_letter_repair",
            "insert into outbox_message (subject) values ('x')",
            "DELETE FROM U&\"processed\\005fmessage\"",
            "delete from u&\"x\"",
        ] {
            assert!(check(sql).is_err(), "{sql} should be refused");
        }
    }

    #[test]
    fn unterminated_literals_are_refused() {
        for sql in [
            "select 'abc",
            "select \"abc",
            "select $x$ abc",
            "select /* abc",
        ] {
            assert!(check(sql).is_err(), "{sql} should be refused");
        }
    }
}
