//! What plugin SQL may do: which statements pass the gate, how `sql-value` parameters bind and
//! how result columns convert back. Deny by default, judged on PostgreSQL's own parse tree: one
//! data statement per call, nothing that controls the transaction or the session, nothing that
//! names the host's tables. The gate is a guard; the wall is the plugin's login role (see
//! SECURITY.md).

use sqlx::postgres::types::Oid;
use sqlx::postgres::{PgArguments, PgRow, PgTypeInfo, PgValueRef, Postgres};
use sqlx::{Arguments, Column, Decode, Encode, Row, Type, TypeInfo, ValueRef};

use bounds::{
    MAX_EXPANDED_NODES, MAX_TOKEN_DEPTH, MAX_TOKENS, check_expansions, depth_bound, expanded_size,
};

/// A SQL parameter or result value, as the WIT `sql-value` variant carries it.
#[derive(Debug, Clone, PartialEq)]
pub enum SqlValue {
    /// SQL `NULL`.
    Null,
    /// `boolean`.
    Boolean(bool),
    /// An integer (`int2`, `int4`, `int8`).
    Int(i64),
    /// A float (`float4`, `float8`; `numeric` as text).
    Float(f64),
    /// Text.
    Text(String),
    /// `bytea`.
    Bytes(Vec<u8>),
    /// JSON text; binds as `jsonb`.
    Json(String),
}

/// The host's relations. A plugin statement naming one, in any spelling the parser accepts, is
/// refused; the wall behind this guard is that the plugin's role has no privilege on them.
pub(crate) const HOST_RELATIONS: &[&str] = &[
    "processed_message",
    "processed_message_handler",
    "dead_letter_repair",
    "outbox_message",
    "outbox_message_id_seq",
    "idemhost_key",
    "_sqlx_migrations",
];

/// Functions refused by name (in any schema): they run SQL text of their own, change settings,
/// take session-level advisory locks that outlive the transaction, reach files, large objects,
/// the server's processes or other sessions, or are the host's own.
const REFUSED_FUNCTIONS: &[&str] = &[
    "set_config",
    "query_to_xml",
    "query_to_xmlschema",
    "query_to_xml_and_xmlschema",
    "cursor_to_xml",
    "cursor_to_xmlschema",
    "table_to_xml",
    "table_to_xmlschema",
    "table_to_xml_and_xmlschema",
    "ts_stat",
    "ts_rewrite",
    "pg_notify",
    "setseed",
    "pg_cancel_backend",
    "pg_terminate_backend",
    "pg_reload_conf",
    "pg_rotate_logfile",
    "pg_switch_wal",
    "pg_promote",
    "pg_stat_file",
    "pg_current_logfile",
    "loread",
    "lowrite",
    // Opens every relation of a view's definition: over `pg_class`, a lock per view
    // (`availability.rs` finds the functions that lock per relation they are given).
    "pg_get_viewdef",
    // Lock every partition (and index) of a partitioned table, whatever the role may use of
    // it: over `pg_class` with a table of 2,000 partitions, 4,005 locks held to the end.
    "pg_partition_tree",
    "pg_get_partition_constraintdef",
    "dblink",
];

/// Prefixes of refused function names (see [`REFUSED_FUNCTIONS`]). Advisory locks of every
/// kind and scope: transaction-scoped ones end with the delivery, but a set-returning query
/// taking one per row filled the server's shared lock table until the deadline, and every
/// other session of the server, on any database, failed with 53200 meanwhile.
const REFUSED_FUNCTION_PREFIXES: &[&str] = &[
    "pg_advisory_",
    "pg_try_advisory_",
    "idemhost_",
    "lo_",
    "pg_read_",
    "pg_ls_",
    "pg_file_",
    "pg_create_",
    "pg_drop_",
    "pg_replication_",
    "pg_logical_",
    "pg_backup_",
    "pg_stat_reset",
    "pg_log_",
    "pg_import_",
    "schema_to_",
    "database_to_",
    "dblink_",
    "binary_upgrade_",
];

/// Statement kinds a plugin may run (every spelling of a query or a data change: `WITH`,
/// `VALUES` and `TABLE` parse to these).
const ALLOWED_STATEMENTS: &[&str] = &[
    "SelectStmt",
    "InsertStmt",
    "UpdateStmt",
    "DeleteStmt",
    "MergeStmt",
];

/// Bounds on what one `query` may return to a plugin.
pub(crate) const MAX_ROWS: usize = 10_000;
pub(crate) const MAX_RESULT_BYTES: usize = 16 << 20;
/// Longest SQL text a plugin may send.
pub(crate) const MAX_SQL_BYTES: usize = 64 << 10;
/// Most relation references (tables, views, CTEs, each time named) in one statement.
const MAX_RELATION_REFERENCES: usize = 100;
/// Deepest parse tree walked (a deeper one is refused, not recursed into).
const MAX_DEPTH: usize = 400;

/// A relation a statement names: its schema if qualified, and its name, as the parser folded
/// them. PostgreSQL locks a relation it is given by name, and a partitioned table's every
/// partition and index while planning, before it checks the role's privileges; the delivery
/// checks these first (see `tx_handle`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Relation {
    pub(crate) schema: Option<String>,
    pub(crate) name: String,
}

impl std::fmt::Display for Relation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = crate::text::reason(&self.name);
        match &self.schema {
            Some(schema) => write!(f, "{}.{name}", crate::text::reason(schema)),
            None => write!(f, "{name}"),
        }
    }
}

/// What the delivery checks of an admitted statement before sending it.
#[derive(Debug, Default)]
pub(crate) struct Admitted {
    /// The relations it names (see [`Relation`]).
    pub(crate) relations: Vec<Relation>,
    /// How many times it names each parameter (`$1` first). The server copies a parameter's
    /// value into its plan once per reference while planning, uninterruptibly (a 10 MB text
    /// named 200 times: 1.9 GB in one server process).
    pub(crate) parameter_references: Vec<u64>,
}

/// Most bytes of parameter values a statement may make the server copy while planning: each
/// parameter's size times the times the statement names it.
pub(crate) const MAX_PARAMETER_COPIES: u64 = 64 << 20;

impl Admitted {
    /// Refuses `params` whose copies into the plan would pass [`MAX_PARAMETER_COPIES`].
    pub(crate) fn check_parameters(&self, params: &[SqlValue]) -> Result<(), String> {
        let copies = params.iter().enumerate().fold(0u64, |n, (i, p)| {
            let size = match p {
                SqlValue::Text(v) | SqlValue::Json(v) => v.len() as u64,
                SqlValue::Bytes(v) => v.len() as u64,
                _ => 8,
            };
            let refs = self.parameter_references.get(i).copied().unwrap_or(0);
            n.saturating_add(size.saturating_mul(refs))
        });
        if copies > MAX_PARAMETER_COPIES {
            return Err(format!(
                "statement refused: its parameters, each as many times as the statement names \
                 it, come to {copies} bytes, which the server copies into its plan; at most \
                 {MAX_PARAMETER_COPIES} (name a large parameter once, e.g. in a CTE)"
            ));
        }
        Ok(())
    }
}

/// A statement admitted, and what to check before sending it; or the refusal the plugin sees.
pub(crate) type Verdict = Result<std::sync::Arc<Admitted>, String>;

/// Checks a plugin statement on PostgreSQL's own parse tree (libpg_query: the server's
/// grammar and scanner); `Err` is the refusal the plugin sees. One statement, of an allowed
/// kind, no `SELECT ... INTO`, no host relation, no refused function — judged on what the
/// server would parse, so comments, quoting, escapes and case cannot disguise anything.
///
/// The parse runs on the gate's own threads (see `parser`): the caller's task waits for it
/// without blocking its thread, and a plugin's fiber stack never holds a parse.
pub(crate) async fn admit(sql: &str) -> Verdict {
    if let Some(verdict) = known(sql) {
        return verdict;
    }
    let verdict = parser::judge(sql).await;
    VERDICTS.put(sql, &verdict);
    verdict
}

/// [`admit`] for callers outside async code: blocks the calling thread until judged.
#[cfg_attr(not(any(test, feature = "test-support")), allow(dead_code))]
pub fn check(sql: &str) -> Result<(), String> {
    if let Some(verdict) = known(sql) {
        return verdict.map(|_| ());
    }
    let verdict = parser::judge_blocking(sql);
    VERDICTS.put(sql, &verdict);
    verdict.map(|_| ())
}

/// A verdict reached without parsing: the crash tests' ungated mode, or a recent statement's.
pub(crate) fn known(sql: &str) -> Option<Verdict> {
    if crate::failpoint::selected("ungated") {
        return Some(Ok(std::sync::Arc::default()));
    }
    VERDICTS.get(sql)
}

/// The verdicts of recent statements. A plugin sends the same few statement texts over and
/// over; parsing each (libpg_query, then the tree as JSON) costs far more than the lookup.
/// Bounded: when full it is emptied, so a plugin sending endless distinct texts only pays the
/// parse it would have paid anyway.
static VERDICTS: Verdicts = Verdicts(std::sync::Mutex::new(None));

struct Verdicts(std::sync::Mutex<Option<std::collections::HashMap<String, Verdict>>>);

/// Statements whose verdicts are kept (texts up to [`MAX_CACHED_SQL_BYTES`]).
const MAX_CACHED: usize = 4096;
const MAX_CACHED_SQL_BYTES: usize = 4096;

impl Verdicts {
    fn get(&self, sql: &str) -> Option<Verdict> {
        let map = self.0.lock().ok()?;
        map.as_ref()?.get(sql).cloned()
    }

    fn put(&self, sql: &str, verdict: &Verdict) {
        if sql.len() > MAX_CACHED_SQL_BYTES {
            return;
        }
        if let Ok(mut map) = self.0.lock() {
            let map = map.get_or_insert_with(std::collections::HashMap::new);
            if map.len() >= MAX_CACHED {
                map.clear();
            }
            map.insert(sql.to_owned(), verdict.clone());
        }
    }
}

/// [`check`] without the cache; runs on a parser thread (see `parser`).
fn judge(sql: &str) -> Verdict {
    if sql.len() > MAX_SQL_BYTES {
        return Err(format!(
            "statement refused: longer than {MAX_SQL_BYTES} bytes"
        ));
    }
    if sql.contains('\0') {
        return Err("statement refused: NUL character".into());
    }
    // Before parsing: libpg_query's output writer recurses once per tree level, without a
    // stack check. A statement whose tokens allow a deeper tree than the gate accepts anyway
    // (prost refuses trees over ~50 levels when reading the result) is refused unparsed.
    let (depth, tokens) = depth_bound(sql)?;
    // The parse's memory and time grow with the tokens (65,000 of them: 315 MiB and 0.85 s).
    if tokens > MAX_TOKENS {
        return Err(format!(
            "statement refused: {tokens} tokens; at most {MAX_TOKENS}"
        ));
    }
    if depth > MAX_TOKEN_DEPTH {
        return Err(format!(
            "statement refused: nested too deeply (up to {depth} levels; at most \
             {MAX_TOKEN_DEPTH})"
        ));
    }
    let parsed =
        pg_query::parse(sql).map_err(|e| format!("statement refused: it does not parse ({e})"))?;
    let stmts = &parsed.protobuf.stmts;
    let stmt = match stmts.as_slice() {
        [] => return Err("statement refused: empty statement".into()),
        [one] => one,
        _ => return Err("statement refused: only one statement per call".into()),
    };
    let tree = serde_json::to_value(stmt)
        .map_err(|e| format!("statement refused: parse tree not readable ({e})"))?;
    let kind = tree
        .get("stmt")
        .and_then(|s| s.get("node"))
        .and_then(serde_json::Value::as_object)
        .and_then(|o| o.keys().next().cloned())
        .unwrap_or_default();
    if !ALLOWED_STATEMENTS.contains(&kind.as_str()) {
        return Err(format!(
            "statement refused: {} is not allowed from a plugin (only SELECT, INSERT, UPDATE, \
             DELETE, MERGE, with WITH, VALUES or TABLE; the host owns the transaction and the \
             session)",
            statement_name(&kind)
        ));
    }
    let mut named = Vec::new();
    let mut parameter_references = Vec::new();
    walk(&tree, 0, &mut named, &mut parameter_references)?;
    // Each relation named is opened, a view expanded into its definition, while the server
    // analyses the statement: a catalog view referenced 200 times took 2 GB of planning.
    if named.len() > MAX_RELATION_REFERENCES {
        return Err(format!(
            "statement refused: it names relations {} times; at most {MAX_RELATION_REFERENCES}",
            named.len()
        ));
    }
    check_expansions(&tree, 0, &mut 0)?;
    let expanded = expanded_size(&tree, 0);
    if expanded == bounds::UNBOUNDED {
        return Err(
            "statement refused: a simple `CASE x WHEN ...` over a value the server computes \
             while planning (a function's result, a parameter, a subquery's output) is copied \
             whole into every WHEN arm, uninterruptibly; write `CASE WHEN x = ... THEN ...`, \
             or nesting too deep to count"
                .into(),
        );
    }
    if expanded > MAX_EXPANDED_NODES {
        return Err(format!(
            "statement refused: the server would copy {expanded} expression nodes while \
             analysing and planning it (nested BETWEEN or IN lists, or a subquery's outputs \
             referenced again and again in the queries above it); at most {MAX_EXPANDED_NODES}"
        ));
    }
    named.sort_by(|a, b| (&a.schema, &a.name).cmp(&(&b.schema, &b.name)));
    named.dedup();
    Ok(std::sync::Arc::new(Admitted {
        relations: named,
        parameter_references,
    }))
}

/// `SelectStmt` → `SELECT`, for refusals.
fn statement_name(kind: &str) -> String {
    if kind.is_empty() {
        return "this statement".into();
    }
    kind.trim_end_matches("Stmt").to_uppercase()
}

/// Refuses the first forbidden node of a parse tree, read as JSON. Nodes are matched by their
/// fields, not their wrapper (a statement's target relation is a bare `RangeVar` struct, an
/// expression's is wrapped in `{"RangeVar": ...}`): anything with a `relname` names a relation,
/// anything with a `funcname` calls a function, an `into_clause` creates a table.
fn walk(
    value: &serde_json::Value,
    depth: usize,
    named: &mut Vec<Relation>,
    params: &mut Vec<u64>,
) -> Result<(), String> {
    use serde_json::Value;
    if depth > MAX_DEPTH {
        return Err("statement refused: nested too deeply".into());
    }
    match value {
        Value::Array(items) => items
            .iter()
            .try_for_each(|v| walk(v, depth + 1, named, params)),
        Value::Object(fields) => {
            if fields.get("into_clause").is_some_and(|v| !v.is_null()) {
                return Err("statement refused: SELECT ... INTO creates a table".into());
            }
            if fields.contains_key("relname") {
                named.push(check_relation(value)?);
            }
            if fields.get("funcname").is_some_and(Value::is_array) {
                check_function(value)?;
            }
            if let Some(expr) = fields.get("AExpr") {
                check_array_operands(expr)?;
            }
            // An identifier node: a function is also called as `(expr).f` or `t.f` (functional
            // notation), where its name is an indirection or a column reference, not a
            // `funcname`. Every identifier is held to the function rules; literals are `Sval`
            // constants, not `String` nodes, and are not affected.
            if let Some(name) = fields
                .get("String")
                .and_then(|v| v.get("sval"))
                .and_then(Value::as_str)
            {
                check_function_name(name)?;
            }
            if let Some(number) = fields
                .get("ParamRef")
                .and_then(|p| p.get("number"))
                .and_then(Value::as_u64)
                .and_then(|n| usize::try_from(n).ok())
                .filter(|n| (1..=65_535).contains(n))
            {
                if params.len() < number {
                    params.resize(number, 0);
                }
                params[number - 1] += 1;
            }
            fields
                .values()
                .try_for_each(|v| walk(v, depth + 1, named, params))
        }
        _ => Ok(()),
    }
}

/// Refuses `op ANY (array)`, `op ALL (array)` and the array containment operators (`@>`, `<@`,
/// `&&`) over an array the planner would fold from a function call or a cast of one
/// (`array_fill(0::oid, ARRAY[4000000])`, `string_to_array(repeat(...), ',')`): it estimates
/// the selectivity of every element while planning, without checking for cancellation (75
/// bytes ran 34 s and took 1.1 GB past a 1 s statement timeout). A constant, a parameter, an
/// `ARRAY[...]` (bounded by the statement's tokens), a column or a subquery may be compared.
fn check_array_operands(expr: &serde_json::Value) -> Result<(), String> {
    use serde_json::Value;
    let kind = expr.get("kind").and_then(Value::as_i64).unwrap_or(0);
    let operator = expr
        .get("name")
        .and_then(Value::as_array)
        .and_then(|n| n.last())
        .map(string_node)
        .unwrap_or_default();
    let sides: &[&str] = match kind {
        // AEXPR_OP_ANY, AEXPR_OP_ALL: the array is on the right.
        2 | 3 => &["rexpr"],
        1 if matches!(operator.as_str(), "@>" | "<@" | "&&") => &["lexpr", "rexpr"],
        _ => return Ok(()),
    };
    for side in sides {
        if let Some(operand) = expr.get(*side)
            && !plain_operand(operand, 0)
        {
            return Err(
                "statement refused: an array built by a function call in `ANY`, `ALL`, `@>`, \
                 `<@` or `&&` is estimated element by element while the server plans, \
                 uninterruptibly; pass the array as a parameter (`= ANY($1::bigint[])`)"
                    .into(),
            );
        }
    }
    Ok(())
}

/// A constant, a parameter, an `ARRAY[...]` of such, a column, a subquery, or a cast of one.
fn plain_operand(node: &serde_json::Value, depth: usize) -> bool {
    let Some(inner) = node.get("node").and_then(serde_json::Value::as_object) else {
        return false;
    };
    if depth > 8 {
        return false;
    }
    let Some((kind, value)) = inner.iter().next() else {
        return false;
    };
    match kind.as_str() {
        "AConst" | "ParamRef" | "ColumnRef" | "SubLink" => true,
        "TypeCast" => value
            .get("arg")
            .is_some_and(|arg| plain_operand(arg, depth + 1)),
        "AArrayExpr" => value
            .get("elements")
            .and_then(serde_json::Value::as_array)
            .is_none_or(|items| items.iter().all(|i| plain_operand(i, depth + 1))),
        _ => false,
    }
}

fn check_relation(range_var: &serde_json::Value) -> Result<Relation, String> {
    let name = range_var
        .get("relname")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("");
    if name == "pg_settings" {
        return Err(
            "statement refused: `pg_settings` changes session settings (read one with \
             current_setting)"
                .into(),
        );
    }
    if HOST_RELATIONS.contains(&name) {
        return Err(format!(
            "statement refused: `{name}` is reserved to the host"
        ));
    }
    if range_var
        .get("schemaname")
        .and_then(serde_json::Value::as_str)
        == Some("information_schema")
    {
        return Err(
            "statement refused: information_schema's views expand into plans of megabytes per \
             reference (element_types: 10 MB); read pg_catalog instead"
                .into(),
        );
    }
    let schema = range_var
        .get("schemaname")
        .and_then(serde_json::Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string);
    Ok(Relation {
        schema,
        name: name.to_string(),
    })
}

fn check_function(call: &serde_json::Value) -> Result<(), String> {
    // `funcname` is a list of String nodes: [schema,] name.
    let name = call
        .get("funcname")
        .and_then(serde_json::Value::as_array)
        .and_then(|parts| parts.last())
        .map(string_node)
        .unwrap_or_default();
    check_function_name(&name)
}

fn check_function_name(name: &str) -> Result<(), String> {
    let lower = name.to_lowercase();
    if REFUSED_FUNCTIONS.contains(&lower.as_str())
        || REFUSED_FUNCTION_PREFIXES
            .iter()
            .any(|p| lower.starts_with(p))
    {
        return Err(format!(
            "statement refused: function `{name}` is not available to plugins (it reaches \
             beyond the delivery's transaction)"
        ));
    }
    Ok(())
}

/// The text of a `String` node (`{"node": {"String": {"sval": ...}}}`).
fn string_node(node: &serde_json::Value) -> String {
    node.pointer("/node/String/sval")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("")
        .to_string()
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

/// JSON text bound as `jsonb` (binary format: version 1, then the text).
struct JsonbText<'a>(&'a str);

impl Type<Postgres> for JsonbText<'_> {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_name("jsonb")
    }
}

impl Encode<'_, Postgres> for JsonbText<'_> {
    fn encode_by_ref(
        &self,
        buf: &mut sqlx::postgres::PgArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        buf.push(1);
        buf.extend_from_slice(self.0.as_bytes());
        Ok(sqlx::encode::IsNull::No)
    }
}

/// A JSON or JSONB column's text, as the server sent it (never parsed into a tree).
fn json_text(raw: PgValueRef<'_>, jsonb: bool) -> Result<String, String> {
    use sqlx::postgres::PgValueFormat;
    let mut bytes = raw.as_bytes().map_err(|e| e.to_string())?;
    if jsonb && raw.format() == PgValueFormat::Binary {
        match bytes.split_first() {
            Some((1, rest)) => bytes = rest,
            _ => return Err("unsupported jsonb format version".into()),
        }
    }
    String::from_utf8(bytes.to_vec()).map_err(|e| e.to_string())
}

/// Binds plugin parameters in order (`$1`, `$2`, ...). Each variant declares its own type:
/// int → int8, float → float8, text → text, bytes → bytea, json → jsonb, boolean → bool,
/// null → inferred. A statement casts where a column differs (`$1::uuid`).
pub(crate) fn bind(params: &[SqlValue]) -> Result<PgArguments, String> {
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
                // Checked without building a tree (a `serde_json::Value` takes ~16 times the
                // text's size), then sent as the text itself.
                serde_json::from_str::<serde::de::IgnoredAny>(text)
                    .map_err(|e| format!("parameter ${} is not valid JSON: {e}", n + 1))?;
                args.add(JsonbText(text))
            }
        };
        added.map_err(|e| format!("parameter ${} could not be bound: {e}", n + 1))?;
    }
    Ok(args)
}

/// Converts one result row. Types without a natural `sql-value` are refused with a hint to
/// cast them in the query.
pub(crate) fn row_values(row: &PgRow) -> Result<(Vec<SqlValue>, usize), String> {
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
        "JSON" => SqlValue::Json(json_text(raw, false)?),
        "JSONB" => SqlValue::Json(json_text(raw, true)?),
        "VOID" => SqlValue::Null,
        other => {
            return Err(format!(
                "column `{column}` has type {other}, which has no sql-value; cast it in the query \
                 (e.g. `{column}::text`)"
            ));
        }
    })
}

mod bounds;
mod parser;

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
    fn spellings_a_scanner_misreads_are_judged_as_postgresql_parses_them() {
        for sql in [
            // A `--` comment ends at a carriage return: the second statement is real.
            "SELECT 1 --x\r; SELECT set_config('role', 'root', false)",
            "SELECT 1 --\rFROM processed_message",
            // Typed literal with a backslash: standard strings do not escape it.
            "SELECT name'\\' , (SELECT count(*) FROM processed_message)",
            "SELECT * FROM pg_catalog.query_to_xml('select 1', true, true, '')",
            "SELECT * INTO TEMP processed_message FROM inventory",
            "SELECT 1 INTO t",
            "SELECT lo_export(lo_from_bytea(0, 'x'), '/tmp/x')",
            "SELECT \"public\".\"idemhost_claim\"('k', 'c', 'i', null)",
            "VALUES ((SELECT set_config('synchronous_commit', 'off', false)))",
            "TABLE outbox_message",
            "UPDATE pg_settings SET setting = 'off' WHERE name = 'synchronous_commit'",
            "UPDATE pg_catalog.pg_settings SET setting = 'x' WHERE name = 'search_path'",
            "MERGE INTO idemhost_key k USING inventory i ON true WHEN MATCHED THEN DELETE",
            "EXPLAIN ANALYZE DELETE FROM inventory",
            "CREATE TEMP TABLE processed_message (consumer_name text, message_id text)",
            // Functional notation: `(x).f` and `t.f` call f(x) and f(t).
            "SELECT (('select 1'::text).ts_stat).word",
            "SELECT (42::bigint).pg_advisory_lock",
            "SELECT (0::oid).lo_create",
            "SELECT (pg_backend_pid()).pg_terminate_backend",
            "SELECT i.pg_advisory_lock FROM (SELECT 1::bigint) AS i",
            "SELECT ('x'::text).\"SET_CONFIG\"",
        ] {
            assert!(check(sql).is_err(), "{sql:?} should be refused");
        }
        // `\r` and typed literals are fine where they hide nothing.
        for sql in [
            "SELECT 1 --x\r",
            "SELECT name'\\'",
            "SELECT 1 FROM inventory FOR UPDATE",
        ] {
            assert_eq!(check(sql), Ok(()), "{sql:?}");
        }
    }

    #[test]
    fn marker_table_and_session_functions_are_refused() {
        for sql in [
            "SELECT * FROM processed_message",
            "delete from public.processed_message",
            "SELECT * FROM \"processed_message\"",
            "select set_config('statement_timeout', '0', true)",
            "select pg_advisory_lock(1)",
            "select pg_catalog.\"set_config\"('role', 'root', false)",
            "select * from \"public\" . \"processed_message\"",
            "select pg_read_file('/etc/passwd')",
            "with d as (delete from processed_message returning 1) select 1",
            "update processed_message_handler set plugin_digest = 'x'",
            "delete from dead_letter_repair",
            "insert into outbox_message (subject) values ('x')",
            "DELETE FROM U&\"processed\\005fmessage\"",
        ] {
            assert!(check(sql).is_err(), "{sql} should be refused");
        }
    }

    #[test]
    fn statements_the_server_would_expand_past_the_bound_are_refused() {
        // `BETWEEN` nested n deep: the left side copied twice per level.
        let between = |n: usize| {
            let mut e = "x".to_string();
            for _ in 0..n {
                e = format!("(({e}) BETWEEN 1 AND 2)::int");
            }
            format!("SELECT {e} FROM (SELECT 1 AS x) s")
        };
        // `IN` lists of `items` columns, nested `depth` deep: copied once per item.
        let in_lists = |items: usize, depth: usize| {
            let list = vec!["v"; items].join(",");
            let mut e = "v".to_string();
            for _ in 0..depth {
                e = format!("(({e}) IN ({list}))::int");
            }
            format!("SELECT {e} FROM (SELECT 1 AS v) s")
        };
        for n in [18, 21, 24, 40] {
            assert!(check(&between(n)).is_err(), "BETWEEN {n} deep");
        }
        for (items, depth) in [(220, 3), (300, 3), (60, 4), (1000, 2)] {
            assert!(
                check(&in_lists(items, depth)).is_err(),
                "IN {items} x {depth}"
            );
        }
        // `(expression).*` nested, many `*`, NOT MATERIALIZED.
        let mut row = "(n).*".to_string();
        for _ in 0..3 {
            row = format!("(ROW({row})::pg_namespace).*");
        }
        for sql in [
            format!("SELECT {row} FROM pg_namespace n"),
            "SELECT (f(x)).* FROM t".to_string(),
            format!("SELECT {} FROM t", ["*"; 9].join(",")),
            "WITH c AS NOT MATERIALIZED (SELECT 1) SELECT * FROM c, c AS d".to_string(),
        ] {
            assert!(check(&sql).is_err(), "{sql}");
        }
        for sql in [
            "SELECT (t).* FROM t",
            "SELECT t.*, u.* FROM t, u",
            "WITH c AS MATERIALIZED (SELECT 1) SELECT * FROM c",
            "WITH c AS (SELECT 1) SELECT * FROM c",
        ] {
            assert_eq!(check(sql), Ok(()), "{sql}");
        }
        // What a handler writes stays well inside the bound.
        for sql in [
            between(3),
            in_lists(20, 2),
            "SELECT 1 WHERE 5 IN (1, 2, 3, 4, 5, 6, 7, 8)".to_string(),
            format!("SELECT 1 WHERE 5 IN ({})", vec!["7"; 5000].join(",")),
        ] {
            assert_eq!(check(&sql), Ok(()), "{sql}");
        }
    }

    /// A subquery's output expressions, referenced more than once by the query above it, are
    /// copied into it when the planner pulls the subquery up; a chain of such subqueries
    /// doubles per level (26 levels of `s || s`: 22 GB in one server process, then the OOM
    /// killer and a restart of every session). Generated over the ways a query sees another
    /// one's outputs and the ways an expression references a column twice, at every depth
    /// from the bound to a chain of 40.
    #[test]
    fn subquery_outputs_copied_up_a_chain_are_refused() {
        let twice = [
            "s || s",
            "concat(s, s)",
            "format('%s%s', s, s)",
            "ARRAY[s, s]::text",
            "CASE WHEN s = '' THEN s ELSE s END",
            "coalesce(s, s)",
            "(s, s)::text",
        ];
        // Each shape: how level `i` selects `s` from level `i - 1` (`{p}`).
        let ctes = |n: usize, e: &str| {
            let mut list = vec!["c0 AS (SELECT 'xxxxxxxx'::text AS s)".to_string()];
            for i in 1..=n {
                list.push(format!("c{i} AS (SELECT {e} AS s FROM c{p})", p = i - 1));
            }
            format!("WITH {} SELECT length(s) FROM c{n}", list.join(", "))
        };
        let nested = |n: usize, e: &str| {
            let mut q = "SELECT 'xxxxxxxx'::text AS s".to_string();
            for i in 0..n {
                q = format!("SELECT {e} AS s FROM ({q}) AS t{i}");
            }
            q
        };
        let lateral = |n: usize, e: &str| {
            let mut from = "(SELECT 'xxxxxxxx'::text AS s) AS t0".to_string();
            for i in 1..=n {
                from = format!(
                    "{from} CROSS JOIN LATERAL (SELECT {e} AS s FROM (SELECT t{p}.s) AS u) AS t{i}",
                    p = i - 1
                );
            }
            format!("SELECT length(t{n}.s) FROM {from}")
        };
        let unions = |n: usize, e: &str| {
            let mut q = "SELECT 'xxxxxxxx'::text AS s".to_string();
            for i in 0..n {
                q = format!("SELECT {e} AS s FROM ({q} UNION ALL SELECT 'y') AS t{i}");
            }
            q
        };
        let correlated = |n: usize, e: &str| {
            let mut q = "SELECT 'xxxxxxxx'::text AS s".to_string();
            for i in 0..n {
                q = format!("SELECT (SELECT {e}) AS s FROM ({q}) AS t{i}");
            }
            q
        };
        type Shape<'a> = &'a dyn Fn(usize, &str) -> String;
        let shapes: [(&str, Shape); 5] = [
            ("ctes", &ctes),
            ("nested", &nested),
            ("lateral", &lateral),
            ("unions", &unions),
            ("correlated", &correlated),
        ];
        // The statements that carry a query: each refused as the query alone is.
        let carriers = [
            "{q}",
            "INSERT INTO t (v) SELECT s FROM ({q}) AS q",
            "UPDATE t SET v = q.s FROM ({q}) AS q",
            "DELETE FROM t USING ({q}) AS q WHERE t.v = q.s",
            "MERGE INTO t USING ({q}) AS q ON t.v = q.s WHEN MATCHED THEN DELETE",
            "SELECT 1 WHERE EXISTS ({q})",
        ];
        let mut judged = 0;
        for (name, shape) in shapes {
            for e in twice {
                for carrier in carriers {
                    let sql = |n| carrier.replace("{q}", &shape(n, e));
                    for n in [16, 17, 20, 26, 40] {
                        assert!(check(&sql(n)).is_err(), "{name} {n} deep, {e}: {}", sql(n));
                        judged += 1;
                    }
                    // A few levels, as a handler's pipeline of CTEs might have.
                    assert_eq!(check(&sql(4)), Ok(()), "{name} 4 deep, {e}");
                }
            }
        }
        assert_eq!(judged, 5 * 7 * 6 * 5);
        // A column referenced under another name: a whole row (`t`, `row_to_json(t)`, `t.*`),
        // an alias list's name, a `*` passing the columns on.
        let renamed: [&dyn Fn(usize) -> String; 5] = [
            &|n| {
                let mut q = "SELECT 'xxxxxxxx'::text AS s".to_string();
                for i in 0..n {
                    q = format!("SELECT concat(t{i}, t{i}) AS s FROM ({q}) AS t{i}");
                }
                q
            },
            &|n| {
                let mut list = vec!["c0 AS (SELECT 'xxxxxxxx'::text AS s)".to_string()];
                for i in 1..=n {
                    list.push(format!(
                        "c{i} AS (SELECT row_to_json(c{p})::text || row_to_json(c{p})::text \
                         AS s FROM c{p})",
                        p = i - 1
                    ));
                }
                format!("WITH {} SELECT length(s) FROM c{n}", list.join(", "))
            },
            &|n| {
                let mut q = "SELECT 'xxxxxxxx'::text AS s".to_string();
                for i in 0..n {
                    q = format!("SELECT ROW(t{i}.*, t{i}.*)::text AS s FROM ({q}) AS t{i}");
                }
                q
            },
            &|n| {
                let mut q = "SELECT 'xxxxxxxx'::text AS s".to_string();
                for i in 0..n {
                    q = format!(
                        "SELECT a || b AS s FROM (SELECT s AS x, s AS y FROM ({q}) AS w) \
                         AS t{i} (a, b)"
                    );
                }
                q
            },
            &|n| {
                let mut q = "SELECT 'xxxxxxxx'::text AS s".to_string();
                for i in 0..n {
                    q = format!("SELECT s || s AS s FROM (SELECT * FROM ({q}) AS w) AS t{i}");
                }
                q
            },
        ];
        // Found by a review of the above: a column list on a CTE's reference, a join's alias
        // with a column list or referenced as a whole row, an alias shadowing a column name
        // defined elsewhere (`q`), a function called on a row (`x.text`).
        let base = "c0 AS (SELECT current_user::text AS s), q AS (SELECT 1 AS q)";
        let chain = |n: usize, level: &dyn Fn(usize) -> String| {
            let mut list = vec![base.to_string()];
            list.extend((1..=n).map(|i| format!("c{i} AS ({})", level(i - 1))));
            format!("WITH {} SELECT length(s) FROM c{n}", list.join(", "))
        };
        let reviewed: [&dyn Fn(usize) -> String; 6] = [
            &|n| chain(n, &|p| format!("SELECT t || t AS s FROM c{p} AS x (t)")),
            &|n| {
                chain(n, &|p| {
                    format!(
                        "SELECT j.t || j.t AS s FROM (c{p} CROSS JOIN (SELECT 1 AS u) b) \
                         AS j (t, u)"
                    )
                })
            },
            &|n| {
                chain(n, &|p| {
                    format!(
                        "SELECT concat(j, j) AS s FROM (c{p} CROSS JOIN (SELECT 1 AS u) b) AS j"
                    )
                })
            },
            &|n| chain(n, &|p| format!("SELECT concat(q, q) AS s FROM c{p} AS q")),
            &|n| {
                chain(n, &|p| {
                    format!("SELECT x.text || x.text AS s FROM c{p} AS x")
                })
            },
            &|n| {
                chain(n, &|p| {
                    format!("SELECT k.s || k.s AS s FROM (c{p} JOIN q ON true) AS k")
                })
            },
        ];
        for (k, shape) in reviewed.iter().enumerate() {
            for n in [14, 18, 20, 24] {
                assert!(
                    check(&shape(n)).is_err(),
                    "reviewed shape {k}, {n} deep: {}",
                    shape(n)
                );
            }
            assert_eq!(check(&shape(3)), Ok(()), "reviewed shape {k}, 3 deep");
        }
        for (k, shape) in renamed.iter().enumerate() {
            for carrier in carriers {
                let sql = |n| carrier.replace("{q}", &shape(n));
                for n in [16, 20, 30] {
                    assert!(
                        check(&sql(n)).is_err(),
                        "renamed shape {k}, {n} deep: {}",
                        sql(n)
                    );
                }
                assert_eq!(check(&sql(4)), Ok(()), "renamed shape {k}, 4 deep");
            }
        }
        // Long pipelines that reference each column once, and wide sources referenced
        // often, stay inside the bound.
        let mut list = vec!["c0 AS (SELECT 1 AS id, 2.5 AS amount, 'a' AS note)".to_string()];
        for i in 1..=60 {
            list.push(format!(
                "c{i} AS (SELECT id, amount * 1.1 AS amount, upper(note) AS note FROM c{p} \
                 WHERE id > 0)",
                p = i - 1
            ));
        }
        let pipeline = format!("WITH {} SELECT id, amount, note FROM c60", list.join(", "));
        let values = format!(
            "INSERT INTO t (a, b, c) SELECT a, b, c FROM (VALUES {}) AS v (a, b, c) \
             WHERE a > 0 AND b <> '' ORDER BY a",
            (0..1000)
                .map(|i| format!("({i}, 'sku-{i}', {i}.5)"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let wide = format!(
            "SELECT {} FROM (SELECT CASE WHEN k = 1 THEN 'a' WHEN k = 2 THEN 'b' WHEN k = 3 \
             THEN 'c' ELSE 'd' END AS c, k FROM t) AS w WHERE k = $1",
            (0..100)
                .map(|i| format!("c || '{i}'"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for sql in [pipeline, values, wide] {
            assert_eq!(check(&sql), Ok(()), "{sql}");
        }
    }

    /// Grouping sets multiply: `CUBE` of n items is 2^n sets, each compared with the others
    /// while the server analyses the statement (CUBE of 12 beside a set of 1,600 expressions:
    /// 3.3 s past a 1 s timeout; of 200 columns: 485 MB).
    #[test]
    fn grouping_sets_past_the_bound_are_refused() {
        let cols = |n: usize, p: &str| (1..=n).map(|i| format!("{p}{i}")).collect::<Vec<_>>();
        let from = "FROM t";
        for (k, n) in [(200, 12), (1600, 12), (40, 11), (3000, 8)] {
            let sql = format!(
                "SELECT count(*) {from} GROUP BY GROUPING SETS (({})), CUBE({})",
                cols(k, "b").join(", "),
                cols(n, "a").join(", ")
            );
            assert!(check(&sql).is_err(), "{k} x CUBE({n})");
        }
        for sql in [
            format!(
                "SELECT count(*) {from} GROUP BY CUBE({})",
                cols(12, "a").join(", ")
            ),
            format!(
                "SELECT count(*) {from} GROUP BY ROLLUP({})",
                cols(30, "a").join(", ")
            ),
            format!("SELECT a, b, count(*) {from} GROUP BY GROUPING SETS ((a, b), (a), ())"),
            format!(
                "SELECT count(*) {from} GROUP BY {}",
                cols(500, "a").join(", ")
            ),
        ] {
            assert_eq!(check(&sql), Ok(()), "{sql}");
        }
    }

    /// An array the planner folds from a function call is estimated element by element while
    /// it plans, uninterruptibly (`oid < ANY(array_fill(0::oid, ARRAY[4000000]))`: 34 s past a
    /// 1 s timeout); a parameter, a constant, `ARRAY[...]`, a column or a subquery may be
    /// compared. Views are expanded per reference (information_schema's by megabytes); a
    /// statement may name relations at most 100 times.
    #[test]
    fn arrays_folded_from_functions_and_heavy_views_are_refused() {
        for sql in [
            "SELECT 1 FROM pg_class WHERE oid < ANY(array_fill(0::oid, ARRAY[4000000]))",
            "SELECT 1 FROM pg_class WHERE relname < ANY(string_to_array(repeat('a,', 4000000), ','))",
            "SELECT 1 FROM t WHERE v = ALL((repeat('1,', 9) || '1')::int[])",
            "SELECT 1 FROM t WHERE v <> ALL(regexp_split_to_array(repeat('x', 100), ''))",
            "SELECT 1 FROM t WHERE tags @> array_fill('x'::text, ARRAY[1000000])",
            "SELECT 1 FROM t WHERE array_fill('x'::text, ARRAY[1000000]) && tags",
            "SELECT 1 FROM t WHERE v = ANY(ARRAY[1, f(2)])",
            "SELECT * FROM information_schema.element_types",
        ] {
            assert!(check(sql).is_err(), "{sql}");
        }
        let many = vec!["(SELECT 1 FROM pg_class LIMIT 1)"; 101].join(", ");
        assert!(check(&format!("SELECT {many}")).is_err());
        for sql in [
            "SELECT 1 FROM t WHERE id = ANY($1::bigint[])",
            "SELECT 1 FROM t WHERE id = ANY($1)",
            "SELECT 1 FROM t WHERE id = ANY('{1,2,3}'::int[])",
            "SELECT 1 FROM t WHERE id = ANY(ARRAY[1, 2, $1::int])",
            "SELECT 1 FROM t WHERE id <> ALL(u.ids)",
            "SELECT 1 FROM t WHERE id = ANY(ARRAY(SELECT x FROM u))",
            "SELECT 1 FROM t WHERE id IN (1, 2, 3)",
            "SELECT 1 FROM t WHERE tags @> $1::text[] AND tags && ARRAY['a']",
        ] {
            assert_eq!(check(sql), Ok(()), "{sql}");
        }
        let fine = vec!["(SELECT 1 FROM pg_class LIMIT 1)"; 100].join(", ");
        assert_eq!(check(&format!("SELECT {fine}")), Ok(()));
    }

    /// Found by a second review: a simple `CASE` copies its test value into every arm while
    /// the server plans (five arms over a 500 MB `repeat`: 2.4 GB past a 500 ms timeout); a
    /// parameter is copied into the plan once per reference (10 MB named 200 times: 1.9 GB);
    /// a condition on a `UNION ALL` subquery is copied into every arm.
    #[test]
    fn values_the_planner_copies_are_bounded() {
        for sql in [
            "SELECT CASE repeat('x', 5000000) WHEN 'a' THEN 1 WHEN 'b' THEN 2 END",
            "SELECT CASE $1::text WHEN 'a' THEN 1 END",
            "SELECT CASE $1 WHEN 'a' THEN 1 END",
            "SELECT CASE s WHEN 'a' THEN 1 END FROM (SELECT repeat('x', 9) AS s) t",
            "WITH c AS (SELECT lpad('', 9) AS s) SELECT CASE c.s WHEN 'a' THEN 1 END FROM c",
            "SELECT CASE upper(v) WHEN 'A' THEN 1 END FROM t",
        ] {
            assert!(check(sql).is_err(), "{sql}");
        }
        for sql in [
            "SELECT CASE status WHEN 'a' THEN 1 WHEN 'b' THEN 2 END FROM orders",
            "SELECT CASE o.status::text WHEN 'a' THEN 1 END FROM orders o",
            "SELECT CASE 'x' WHEN 'a' THEN 1 END",
            "SELECT CASE WHEN $1 = 'a' THEN 1 WHEN $1 = 'b' THEN 2 END",
            "SELECT CASE WHEN upper(v) = 'A' THEN 1 END FROM t",
        ] {
            assert_eq!(check(sql), Ok(()), "{sql}");
        }
        let admitted = |sql: &str| super::judge(sql).unwrap();
        let named_200 = format!(
            "SELECT {}",
            (0..200)
                .map(|i| format!("$1 = 'a{i}'"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let a = admitted(&named_200);
        assert_eq!(a.parameter_references, vec![200]);
        let text = |n: usize| super::SqlValue::Text("x".repeat(n));
        assert!(a.check_parameters(&[text(1 << 20)]).is_err(), "1 MiB x 200");
        assert!(
            a.check_parameters(&[text(200 << 10)]).is_ok(),
            "200 KiB x 200"
        );
        let once = admitted("INSERT INTO t (a, b) VALUES ($1, $2)");
        assert_eq!(once.parameter_references, vec![1, 1]);
        assert!(
            once.check_parameters(&[text(16 << 20), text(16 << 20)])
                .is_ok()
        );
        assert!(
            once.check_parameters(&[text(40 << 20), text(40 << 20)])
                .is_err()
        );
        // UNION ALL: every arm gets the condition's references.
        let arms = |k: usize, r: usize| {
            let arms = vec!["SELECT current_user::text AS s"; k].join(" UNION ALL ");
            let refs = vec!["s"; r].join(", ");
            format!("SELECT count(*) FROM ({arms}) t WHERE ARRAY[{refs}] <> '{{}}'")
        };
        assert!(check(&arms(40, 2000)).is_err(), "40 arms x 2000");
        assert_eq!(check(&arms(3, 20)), Ok(()));
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
