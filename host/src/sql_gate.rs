//! What plugin SQL may do: which statements pass the gate, how `sql-value` parameters bind and
//! how result columns convert back. Deny by default, judged on PostgreSQL's own parse tree: one
//! data statement per call, nothing that controls the transaction or the session, nothing that
//! names the host's tables. The gate is a guard; the wall is the plugin's login role (see
//! SECURITY.md).

use sqlx::postgres::types::Oid;
use sqlx::postgres::{PgArguments, PgRow, PgTypeInfo, PgValueRef, Postgres};
use sqlx::{Arguments, Column, Decode, Encode, Row, Type, TypeInfo, ValueRef};

use bounds::{MAX_EXPANDED_NODES, MAX_TOKEN_DEPTH, MAX_TOKENS, check_expansions, depth_bound};
use expansion::expanded_size;
use folding::{check_array_operands, check_from_functions};

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
    /// `numeric`, as its exact decimal text (WIT 0.2.0 on).
    Numeric(String),
    /// `timestamptz` (and `timestamp`, read as UTC), in microseconds since 1970-01-01 UTC;
    /// `infinity`/`-infinity` are `i64::MAX`/`i64::MIN` (WIT 0.2.0 on).
    Timestamp(i64),
    /// `date`, in days since 1970-01-01; `infinity`/`-infinity` are `i32::MAX`/`i32::MIN`
    /// (WIT 0.2.0 on).
    Date(i32),
    /// `uuid`, as text (lower-case hyphenated when read; WIT 0.2.0 on).
    Uuid(String),
    /// A one-dimensional array of one scalar type (WIT 0.2.0 on).
    Array(SqlArray),
}

/// A one-dimensional array, by element type; elements may be null.
#[derive(Debug, Clone, PartialEq)]
pub enum SqlArray {
    /// `boolean[]`.
    Boolean(Vec<Option<bool>>),
    /// `int8[]` (`int2[]`, `int4[]` arrive here).
    Int(Vec<Option<i64>>),
    /// `float8[]` (`float4[]` arrives here).
    Float(Vec<Option<f64>>),
    /// `text[]` (and the other text types' arrays).
    Text(Vec<Option<String>>),
    /// `numeric[]`, each as decimal text.
    Numeric(Vec<Option<String>>),
    /// `timestamptz[]`, each in microseconds since 1970.
    Timestamp(Vec<Option<i64>>),
    /// `date[]`, each in days since 1970.
    Date(Vec<Option<i32>>),
    /// `uuid[]`, each as text.
    Uuid(Vec<Option<String>>),
}

impl SqlValue {
    /// About the bytes the value takes on the wire (a scalar: 8).
    pub(crate) fn size(&self) -> usize {
        fn texts(v: &[Option<String>]) -> usize {
            v.iter()
                .map(|s| 4 + s.as_ref().map_or(0, String::len))
                .sum()
        }
        match self {
            SqlValue::Text(s) | SqlValue::Json(s) | SqlValue::Numeric(s) | SqlValue::Uuid(s) => {
                s.len()
            }
            SqlValue::Bytes(b) => b.len(),
            SqlValue::Array(a) => match a {
                SqlArray::Text(v) | SqlArray::Numeric(v) | SqlArray::Uuid(v) => texts(v),
                SqlArray::Boolean(v) => v.len() * 5,
                SqlArray::Date(v) => v.len() * 8,
                SqlArray::Int(v) | SqlArray::Timestamp(v) => v.len() * 12,
                SqlArray::Float(v) => v.len() * 12,
            },
            _ => 8,
        }
    }
}

/// Which `sql-value` cases a result may use: a component's WIT version decides. A 0.1.0
/// component has no numeric, timestamp, date, uuid or array: those columns are refused for it
/// with a hint to cast them, as they always were.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Values {
    /// WIT 0.1.0's cases.
    Basic,
    /// Every case (WIT 0.2.0, native handlers).
    Rich,
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
    "idemhost_group_seal",
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
/// Host memory one `query`'s values may take, charged before each value is built: its slot
/// ([`VALUE_SLOT`]), its heap, an array element's own. What the server sends can be far smaller
/// than what it becomes: an empty text is 4 bytes on the wire and a 32-byte value on the host,
/// a numeric of 14 bytes prints as 131,073 characters.
pub(crate) const MAX_RESULT_HOST_BYTES: usize = 48 << 20;
/// Host bytes of one [`SqlValue`], before its heap.
pub(crate) const VALUE_SLOT: usize = std::mem::size_of::<SqlValue>();
/// The least a heap allocation takes.
const MIN_ALLOCATION: usize = 16;

/// What one `query` may still make the host hold: the result's bytes as the plugin receives
/// them ([`MAX_RESULT_BYTES`]) and the host's memory for them ([`MAX_RESULT_HOST_BYTES`]).
/// Each value is charged before it is built; past either bound the query is refused.
pub(crate) struct ResultBudget {
    bytes: usize,
    host: usize,
}

impl Default for ResultBudget {
    fn default() -> Self {
        ResultBudget {
            bytes: MAX_RESULT_BYTES,
            host: MAX_RESULT_HOST_BYTES,
        }
    }
}

impl ResultBudget {
    /// Charges a value of `bytes` (as the plugin gets it) taking `host` bytes of host memory.
    pub(crate) fn charge(&mut self, bytes: usize, host: usize) -> Result<(), String> {
        match (self.bytes.checked_sub(bytes), self.host.checked_sub(host)) {
            (Some(b), Some(h)) => {
                (self.bytes, self.host) = (b, h);
                Ok(())
            }
            (None, _) => Err(format!("query result exceeds {MAX_RESULT_BYTES} bytes")),
            (_, None) => Err(format!(
                "query result exceeds {MAX_RESULT_HOST_BYTES} bytes of host memory (each value \
                 takes {VALUE_SLOT} bytes and its text's; ask for fewer rows or columns)"
            )),
        }
    }

    /// Charges a text of `len` bytes (its slot in a value or an array, and its allocation).
    pub(crate) fn charge_text(&mut self, len: usize, slot: usize) -> Result<(), String> {
        let heap = if len == 0 { 0 } else { len.max(MIN_ALLOCATION) };
        self.charge(len, slot + heap)
    }
}
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
            let size = p.size() as u64;
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
    if expanded == expansion::UNBOUNDED {
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
            if let Some(from) = fields.get("RangeFunction") {
                check_from_functions(from)?;
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

/// A parameter of a 0.2.0 case: its own type OID (`produces`) and binary value.
impl Type<Postgres> for typed::Encoded {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_oid(Oid(0))
    }
}

impl Encode<'_, Postgres> for typed::Encoded {
    fn produces(&self) -> Option<PgTypeInfo> {
        Some(PgTypeInfo::with_oid(Oid(self.oid)))
    }

    fn encode_by_ref(
        &self,
        buf: &mut sqlx::postgres::PgArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        buf.extend_from_slice(&self.bytes);
        Ok(sqlx::encode::IsNull::No)
    }
}

/// A result value's bytes, which must be in the binary format (every column of an extended
/// query's result is).
fn binary<'r>(raw: PgValueRef<'r>, column: &str) -> Result<&'r [u8], String> {
    if raw.format() != sqlx::postgres::PgValueFormat::Binary {
        return Err(format!("column `{column}` arrived in text format"));
    }
    raw.as_bytes().map_err(|e| e.to_string())
}

/// Binds plugin parameters in order (`$1`, `$2`, ...). Each variant declares its own type:
/// int → int8, float → float8, text → text, bytes → bytea, json → jsonb, boolean → bool,
/// numeric → numeric, timestamp → timestamptz, date → date, uuid → uuid, arrays → their
/// element type's array, null → inferred. A statement casts where a column differs
/// (`$1::int4`).
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
            rich => match typed::encode(rich) {
                Some(Ok(encoded)) => args.add(encoded),
                Some(Err(reason)) => {
                    return Err(format!("parameter ${} is not valid: {reason}", n + 1));
                }
                None => unreachable!("every basic case is bound above"),
            },
        };
        added.map_err(|e| format!("parameter ${} could not be bound: {e}", n + 1))?;
    }
    Ok(args)
}

/// Converts one result row into the cases `values` allows, charging `budget` for each value
/// before it is built; returns the row and its size. Types without a natural `sql-value` are
/// refused with a hint to cast them in the query.
pub(crate) fn row_values(
    row: &PgRow,
    values: Values,
    budget: &mut ResultBudget,
) -> Result<(Vec<SqlValue>, usize), String> {
    let mut converted = Vec::with_capacity(row.len());
    let mut bytes = 0usize;
    for (i, column) in row.columns().iter().enumerate() {
        let raw = row.try_get_raw(i).map_err(|e| e.to_string())?;
        let type_name = column.type_info().name().to_string();
        let value = if raw.is_null() {
            budget.charge(8, VALUE_SLOT)?;
            SqlValue::Null
        } else {
            convert(raw, &type_name, column.name(), values, budget)?
        };
        bytes += value.size();
        converted.push(value);
    }
    Ok((converted, bytes))
}

fn convert(
    raw: PgValueRef<'_>,
    type_name: &str,
    column: &str,
    values: Values,
    budget: &mut ResultBudget,
) -> Result<SqlValue, String> {
    fn dec<'r, T: Decode<'r, Postgres>>(raw: PgValueRef<'r>) -> Result<T, String> {
        T::decode(raw).map_err(|e| e.to_string())
    }
    let rich = values == Values::Rich;
    // Charged before anything is built: the value's text as the wire has it (a numeric's as
    // its header says it prints; an array's element by element, as it is read).
    let wire = raw.as_bytes().map_or(0, <[u8]>::len);
    match type_name {
        "NUMERIC" if rich => {
            let len = typed::numeric_text_len(binary(raw.clone(), column)?)?;
            budget.charge_text(len, VALUE_SLOT)?;
        }
        // 16 bytes on the wire, 36 characters printed.
        "UUID" if rich => budget.charge_text(36, VALUE_SLOT)?,
        array if rich && typed::is_array_type(array) => budget.charge(0, VALUE_SLOT)?,
        _ => budget.charge_text(wire, VALUE_SLOT)?,
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
        "NUMERIC" if rich => SqlValue::Numeric(typed::numeric_text(binary(raw, column)?)?),
        "TIMESTAMPTZ" | "TIMESTAMP" if rich => {
            SqlValue::Timestamp(typed::timestamp_micros(binary(raw, column)?)?)
        }
        "DATE" if rich => SqlValue::Date(typed::date_days(binary(raw, column)?)?),
        "UUID" if rich => SqlValue::Uuid(typed::uuid_text(binary(raw, column)?)?),
        array if rich && typed::is_array_type(array) => SqlValue::Array(typed::array_value(
            binary(raw, column)?,
            array,
            column,
            budget,
        )?),
        other => {
            return Err(format!(
                "column `{column}` has type {other}, which has no sql-value; cast it in the query \
                 (e.g. `{column}::text`)"
            ));
        }
    })
}

mod bounds;
mod expansion;
mod folding;
mod parser;
mod typed;

#[cfg(test)]
mod props;

#[cfg(test)]
mod tests;
