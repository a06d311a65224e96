//! What a statement would cost before the gate lets it run: how deep its tree can be and how
//! many tokens it has (judged from PostgreSQL's scanner, before parsing), and how much the
//! server's analysis and planning would multiply it (judged on the parse tree). Each bound
//! answers a shape a review made cost gigabytes or seconds the deadline could not stop.

use super::MAX_DEPTH;

/// Most tokens of a statement: a parse costs memory and time by the token (a multi-row
/// `VALUES` of 1,000 rows of 4 columns is about 10,000).
pub(super) const MAX_TOKENS: usize = 12_000;
/// Most parse-tree nodes a statement may stand for once PostgreSQL's analysis has copied what
/// it copies: the left side of `BETWEEN` (twice, four times `SYMMETRIC`) and of an `IN` list
/// that is not all constants (once per item). Nested, they multiply: `BETWEEN` 21 deep, or
/// three `IN` lists of 220 columns, made one server process allocate 3.4–4.6 GB during
/// analysis, which checks no cancellation (see [`expanded_size`]); about 1.6 KB per copy, so
/// this bound keeps one statement's analysis near 100 MB. A statement within the token bound
/// and without such copies stays under it.
pub(super) const MAX_EXPANDED_NODES: u64 = 64_000;
/// Most tree levels a statement's tokens may allow before it is parsed (see [`depth_bound`]).
/// Trees deeper than ~50 levels are refused after parsing anyway; this keeps the parser's own
/// recursion within a few MiB of the parser threads' stack.
pub(super) const MAX_TOKEN_DEPTH: usize = 1000;

/// The nodes a parse tree (read as JSON) stands for once PostgreSQL's analysis and planning have
/// copied what they copy, saturating:
/// * the left side of each `BETWEEN` (2 copies, 4 for `SYMMETRIC`) and of each `IN` list holding
///   anything but constants (one per item);
/// * a subquery's or common table expression's output expressions, once per reference to them:
///   the planner pulls a simple subquery (and a CTE referenced once) up into the query above,
///   replacing every reference to its columns by the expression itself. A chain of 26 CTEs each
///   selecting `s || s` from the one before (1.3 KB of text) made one server process allocate
///   22 GB while planning, past its statement timeout, until the kernel's OOM killer ended it
///   and the whole server restarted every session. A column reference counts as the largest
///   output of that name in its scope (the query's own subqueries and the CTEs it sees, and
///   every enclosing query's), or of any name where PostgreSQL names the output itself; a `*`
///   as all of them.
///
/// Depth is bounded by the walk before it.
pub(super) fn expanded_size(value: &serde_json::Value, depth: usize) -> u64 {
    size(value, &Scope::default(), Walk::Whole, depth)
}

/// What the columns in a query's scope stand for, once its subqueries are pulled up.
#[derive(Clone, Default)]
struct Scope {
    /// Outputs of the subqueries and CTEs in scope, by name.
    named: Vec<(String, u64)>,
    /// The largest output whose name the gate does not know (PostgreSQL names an expression
    /// itself; a `*` brings names of its own): a reference of any name may be it.
    unnamed: u64,
    /// All outputs together: what a `*` stands for.
    all: u64,
    /// The FROM items that are subqueries or CTEs, by the name a whole-row reference uses
    /// (`SELECT t`, `row_to_json(t)`, `t.f`): all their outputs.
    rows: Vec<(String, u64)>,
    /// The CTEs in scope, by name: all their outputs.
    ctes: Vec<(String, u64)>,
}

impl Scope {
    /// What a column reference stands for (its fields: `[table.]column`, or a whole row).
    fn column(&self, fields: &[&str]) -> u64 {
        let Some(last) = fields.last() else {
            return self.star();
        };
        let named = self
            .named
            .iter()
            .filter(|(n, _)| n == last)
            .fold(0, |m, (_, s)| m.max(*s));
        // Not a column of a subquery: a whole row, or a function called on one (`t.f`).
        let rows = if named == 0 {
            self.rows
                .iter()
                .filter(|(n, _)| fields.contains(&n.as_str()))
                .fold(0, |m, (_, s)| m.max(*s))
        } else {
            0
        };
        named.max(rows).max(self.unnamed).max(1)
    }

    fn star(&self) -> u64 {
        self.all.max(1)
    }

    /// The scope once a subquery or CTE with these outputs is in it.
    fn add(&mut self, outputs: &Outputs) {
        self.named.extend(outputs.named.iter().cloned());
        self.unnamed = self.unnamed.max(outputs.unnamed);
        self.all = self.all.saturating_add(outputs.all);
    }
}

/// A query's size and what its outputs stand for.
#[derive(Clone, Default)]
struct Outputs {
    total: u64,
    /// The outputs in order, by name (`None`: named by PostgreSQL).
    columns: Vec<(Option<String>, u64)>,
    /// Outputs a `*` brought in, of names and positions not known here.
    starred: Option<Scope>,
    named: Vec<(String, u64)>,
    unnamed: u64,
    all: u64,
}

impl Outputs {
    /// Settles `named`, `unnamed` and `all` from the columns (renamed by an alias list).
    fn settle(mut self, renames: &[String]) -> Outputs {
        let widest = self.columns.iter().fold(0u64, |m, (_, s)| m.max(*s));
        let starred_widest = self.starred.as_ref().map_or(0, |s| {
            s.named.iter().fold(s.unnamed, |m, (_, size)| m.max(*size))
        });
        if self.starred.is_some() {
            // Positions are not known: every new name may be any output.
            let any = widest.max(starred_widest);
            self.named = renames.iter().map(|n| (n.clone(), any)).collect();
        } else {
            self.named = Vec::new();
            for (i, (name, size)) in self.columns.iter().enumerate() {
                match renames.get(i).cloned().or_else(|| name.clone()) {
                    Some(n) => self.named.push((n, *size)),
                    None => self.unnamed = self.unnamed.max(*size),
                }
            }
        }
        if let Some(starred) = &self.starred {
            if renames.is_empty() {
                self.named.extend(starred.named.iter().cloned());
            }
            self.unnamed = self.unnamed.max(starred.unnamed);
        }
        self.all = self
            .columns
            .iter()
            .fold(0u64, |n, (_, s)| n.saturating_add(*s))
            .saturating_add(self.starred.as_ref().map_or(0, |s| s.all));
        self
    }
}

/// Whether a walk counts the subqueries of a FROM list (already counted by [`query`]).
#[derive(Clone, Copy, PartialEq)]
enum Walk {
    Whole,
    SkipSubqueries,
}

fn size(value: &serde_json::Value, scope: &Scope, walk: Walk, depth: usize) -> u64 {
    use serde_json::Value;
    if depth > MAX_DEPTH {
        return u64::MAX;
    }
    match value {
        Value::Array(items) => items.iter().fold(0u64, |n, v| {
            n.saturating_add(size(v, scope, walk, depth + 1))
        }),
        Value::Object(fields) => {
            if is_query(fields) {
                return query(fields, scope, depth).total;
            }
            if walk == Walk::SkipSubqueries && fields.contains_key("RangeSubselect") {
                return 0;
            }
            if let Some(column) = fields.get("ColumnRef") {
                return match column_name(column) {
                    Some(_) => scope.column(&column_fields(column)),
                    None => scope.star(),
                };
            }
            if let Some(expr) = fields.get("AExpr") {
                let kind = expr.get("kind").and_then(Value::as_i64).unwrap_or(0);
                let part = |f: &str| expr.get(f).map_or(0, |v| size(v, scope, walk, depth + 1));
                let copies: u64 = match kind {
                    // AEXPR_BETWEEN, AEXPR_NOT_BETWEEN; the SYMMETRIC ones.
                    11 | 12 => 2,
                    13 | 14 => 4,
                    // AEXPR_IN over a list with anything but constants: one per item.
                    7 => in_list_items(expr.get("rexpr")),
                    _ => 1,
                };
                return part("lexpr")
                    .saturating_mul(copies.max(1))
                    .saturating_add(part("rexpr"))
                    .saturating_add(1);
            }
            fields.values().fold(1u64, |n, v| {
                n.saturating_add(size(v, scope, walk, depth + 1))
            })
        }
        _ => 0,
    }
}

/// The names of a `ColumnRef`'s fields (a `*` left out).
fn column_fields(column: &serde_json::Value) -> Vec<&str> {
    column
        .get("fields")
        .and_then(serde_json::Value::as_array)
        .map(|f| {
            f.iter()
                .filter_map(|n| {
                    n.pointer("/node/String/sval")
                        .and_then(serde_json::Value::as_str)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The column a `ColumnRef` names (its last field); `None` for a `*`.
fn column_name(column: &serde_json::Value) -> Option<&str> {
    let last = column.get("fields")?.as_array()?.last()?;
    last.pointer("/node/String/sval")?.as_str()
}

/// A statement or subquery (`SELECT`, `INSERT`, `UPDATE`, `DELETE`, `MERGE`; a set operation's
/// arms): the nodes that may carry a WITH list (the field is there, `null` or not; a join's
/// `using_clause` is a list of names, not a statement's).
fn is_query(fields: &serde_json::Map<String, serde_json::Value>) -> bool {
    fields.contains_key("with_clause")
}

/// A query's size and outputs, its CTEs and FROM subqueries sized first: each sees the scope
/// before it (a later CTE references an earlier one; a LATERAL subquery an earlier FROM
/// item), and the rest of the query sees them all.
fn query(
    fields: &serde_json::Map<String, serde_json::Value>,
    outer: &Scope,
    depth: usize,
) -> Outputs {
    use serde_json::Value;
    let mut out = Outputs {
        total: 1,
        ..Outputs::default()
    };
    if depth > MAX_DEPTH {
        out.total = u64::MAX;
        return out;
    }
    let mut scope = outer.clone();
    let ctes = fields
        .get("with_clause")
        .and_then(|w| w.get("ctes"))
        .and_then(Value::as_array);
    for cte in ctes.into_iter().flatten() {
        let Some(cte) = cte.pointer("/node/CommonTableExpr") else {
            continue;
        };
        if let Some(q) = cte.get("ctequery") {
            let outputs = subquery(q, &scope, &names(cte.get("aliascolnames")), depth + 1);
            out.total = out.total.saturating_add(outputs.total);
            scope.add(&outputs);
            if let Some(name) = cte.get("ctename").and_then(Value::as_str) {
                scope.ctes.push((name.to_string(), outputs.all));
            }
        }
    }
    // A set operation: its arms are the queries; the outputs are the first arm's names, each
    // as large as the larger arm's at that place.
    if let (Some(Value::Object(l)), Some(Value::Object(r))) =
        (fields.get("larg"), fields.get("rarg"))
    {
        let (l, r) = (query(l, &scope, depth + 1), query(r, &scope, depth + 1));
        let mut columns = l.columns.clone();
        for (i, (_, s)) in columns.iter_mut().enumerate() {
            *s = (*s).max(r.columns.get(i).map_or(0, |c| c.1));
        }
        return Outputs {
            total: out.total.saturating_add(l.total).saturating_add(r.total),
            columns,
            starred: match (l.starred, r.starred) {
                (None, None) => None,
                (a, b) => {
                    let (mut a, b) = (a.unwrap_or_default(), b.unwrap_or_default());
                    a.named.extend(b.named);
                    a.unnamed = a.unnamed.max(b.unnamed);
                    a.all = a.all.max(b.all);
                    Some(a)
                }
            },
            ..Outputs::default()
        }
        .settle(&[]);
    }
    for key in ["from_clause", "using_clause", "source_relation"] {
        if let Some(from) = fields.get(key) {
            let mut found = Vec::new();
            from_items(from, depth + 1, &mut found);
            for item in found {
                match item {
                    FromItem::Subquery {
                        query: q,
                        alias,
                        renames,
                    } => {
                        let outputs = subquery(q, &scope, &renames, depth + 1);
                        out.total = out.total.saturating_add(outputs.total);
                        scope.add(&outputs);
                        if let Some(alias) = alias {
                            scope.rows.push((alias, outputs.all));
                        }
                    }
                    FromItem::Relation { name, alias } => {
                        let cte = scope
                            .ctes
                            .iter()
                            .filter(|(n, _)| *n == name)
                            .fold(0, |m, (_, s)| m.max(*s));
                        if cte > 0 {
                            scope.rows.push((alias.unwrap_or(name), cte));
                        }
                    }
                }
            }
        }
    }
    for (key, value) in fields {
        let part = match key.as_str() {
            "with_clause" | "larg" | "rarg" => 0,
            "from_clause" | "using_clause" | "source_relation" => {
                size(value, &scope, Walk::SkipSubqueries, depth + 1)
            }
            "target_list" => {
                let items = value.as_array().map_or(&[][..], Vec::as_slice);
                items.iter().fold(0u64, |n, item| {
                    let s = size(item, &scope, Walk::Whole, depth + 1);
                    let target = item.pointer("/node/ResTarget");
                    let alias = target
                        .and_then(|t| t.get("name"))
                        .and_then(Value::as_str)
                        .filter(|n| !n.is_empty());
                    let column = target.and_then(|t| t.pointer("/val/node/ColumnRef"));
                    match (alias, column) {
                        (Some(a), _) => out.columns.push((Some(a.to_string()), s)),
                        (None, Some(c)) => match column_name(c) {
                            Some(name) => out.columns.push((Some(name.to_string()), s)),
                            // `*`, `t.*`: every column in scope, of names not known here.
                            None => {
                                let starred = out.starred.get_or_insert_with(Scope::default);
                                starred.named.extend(scope.named.iter().cloned());
                                starred.unnamed = starred.unnamed.max(scope.unnamed);
                                starred.all = starred.all.saturating_add(scope.all);
                            }
                        },
                        (None, None) => out.columns.push((None, s)),
                    }
                    n.saturating_add(s)
                })
            }
            "values_lists" => {
                let rows = value.as_array().map_or(&[][..], Vec::as_slice);
                rows.iter().fold(0u64, |n, row| {
                    let items = row
                        .pointer("/node/List/items")
                        .and_then(Value::as_array)
                        .map_or(&[][..], Vec::as_slice);
                    items.iter().enumerate().fold(n, |n, (i, v)| {
                        let s = size(v, &scope, Walk::Whole, depth + 1);
                        if out.columns.len() <= i {
                            out.columns.push((Some(format!("column{}", i + 1)), 0));
                        }
                        out.columns[i].1 = out.columns[i].1.max(s);
                        n.saturating_add(s)
                    })
                })
            }
            _ => size(value, &scope, Walk::Whole, depth + 1),
        };
        out.total = out.total.saturating_add(part);
    }
    out.settle(&[])
}

/// The names of an alias list (`AS t (a, b)`, `c (a, b) AS (...)`).
fn names(list: Option<&serde_json::Value>) -> Vec<String> {
    list.and_then(serde_json::Value::as_array)
        .map(|items| {
            items
                .iter()
                .filter_map(|n| {
                    n.pointer("/node/String/sval")
                        .and_then(serde_json::Value::as_str)
                })
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// A subquery node (`{"SelectStmt": ...}`, or any statement a CTE may hold) sized as a query,
/// its outputs renamed by an alias list.
fn subquery(node: &serde_json::Value, scope: &Scope, renames: &[String], depth: usize) -> Outputs {
    let inner = node
        .get("node")
        .and_then(serde_json::Value::as_object)
        .and_then(|n| n.values().next())
        .and_then(serde_json::Value::as_object);
    match inner {
        Some(fields) if is_query(fields) => {
            let outputs = query(fields, scope, depth);
            if renames.is_empty() {
                outputs
            } else {
                outputs.settle(renames)
            }
        }
        _ => {
            let total = size(node, scope, Walk::Whole, depth);
            Outputs {
                total,
                unnamed: total,
                all: total,
                ..Outputs::default()
            }
        }
    }
}

/// A subquery of a FROM list, or a relation it names (perhaps a CTE).
enum FromItem<'a> {
    Subquery {
        query: &'a serde_json::Value,
        alias: Option<String>,
        renames: Vec<String>,
    },
    Relation {
        name: String,
        alias: Option<String>,
    },
}

/// The subqueries of a FROM list (with their alias lists) and the relations it names without a
/// schema, in order, through joins; not into the subqueries.
fn from_items<'a>(value: &'a serde_json::Value, depth: usize, found: &mut Vec<FromItem<'a>>) {
    use serde_json::Value;
    if depth > MAX_DEPTH {
        return;
    }
    let alias_of = |v: &serde_json::Value| {
        v.pointer("/alias/aliasname")
            .and_then(Value::as_str)
            .filter(|a| !a.is_empty())
            .map(str::to_string)
    };
    match value {
        Value::Array(items) => items.iter().for_each(|v| from_items(v, depth + 1, found)),
        Value::Object(fields) => {
            if let Some(sub) = fields.get("RangeSubselect") {
                if let Some(q) = sub.get("subquery") {
                    found.push(FromItem::Subquery {
                        query: q,
                        alias: alias_of(sub),
                        renames: names(sub.pointer("/alias/colnames")),
                    });
                }
                return;
            }
            if let Some(rel) = fields.get("RangeVar") {
                let unqualified = rel
                    .get("schemaname")
                    .and_then(Value::as_str)
                    .is_none_or(str::is_empty);
                if let (true, Some(name)) =
                    (unqualified, rel.get("relname").and_then(Value::as_str))
                {
                    found.push(FromItem::Relation {
                        name: name.to_string(),
                        alias: alias_of(rel),
                    });
                }
                return;
            }
            if is_query(fields) {
                return;
            }
            fields
                .values()
                .for_each(|v| from_items(v, depth + 1, found));
        }
        _ => {}
    }
}

/// Items of an `IN` list that PostgreSQL expands into one comparison each (a list with anything
/// but constants); 1 for a list of constants (one array comparison) or a subquery.
fn in_list_items(rexpr: Option<&serde_json::Value>) -> u64 {
    let items = rexpr
        .and_then(|r| r.get("node"))
        .and_then(|n| n.get("List"))
        .and_then(|l| l.get("items"))
        .and_then(serde_json::Value::as_array);
    match items {
        Some(items) if items.iter().any(|i| i.pointer("/node/AConst").is_none()) => {
            items.len() as u64
        }
        _ => 1,
    }
}

/// Most `*` a statement may hold: each expands to every column of its FROM list while the
/// server analyses the statement, before its 1,664-column limit applies and without a check for
/// cancellation (800 `*` over 100 joined CTEs of 100 columns: 1.66 GB).
const MAX_STARS: usize = 8;

/// Refuses what makes the server's analysis or planning multiply work from a short text, that
/// [`expanded_size`] does not count: `(expression).*` (the expression copied once per column,
/// nested ×4 per level: 1.97 GB from 299 bytes), more than [`MAX_STARS`] `*`, and `NOT
/// MATERIALIZED` common table expressions (each reference plans its query again; nested and
/// referenced twice, the plan doubles per level: 1 GB from 989 bytes).
pub(super) fn check_expansions(
    value: &serde_json::Value,
    depth: usize,
    stars: &mut usize,
) -> Result<(), String> {
    use serde_json::Value;
    if depth > MAX_DEPTH {
        return Err("statement refused: nested too deeply".into());
    }
    match value {
        Value::Array(items) => items
            .iter()
            .try_for_each(|v| check_expansions(v, depth + 1, stars)),
        Value::Object(fields) => {
            if fields.contains_key("AStar") {
                *stars += 1;
                if *stars > MAX_STARS {
                    return Err(format!(
                        "statement refused: more than {MAX_STARS} `*` (each expands to every \
                         column; name the columns)"
                    ));
                }
            }
            if let Some(ind) = fields.get("AIndirection") {
                let starred = ind
                    .get("indirection")
                    .and_then(Value::as_array)
                    .is_some_and(|i| i.iter().any(|n| n.pointer("/node/AStar").is_some()));
                let plain = ind.pointer("/arg/node/ColumnRef").is_some();
                if starred && !plain {
                    return Err(
                        "statement refused: `(expression).*` copies the expression once per \
                         column; select the fields by name"
                            .into(),
                    );
                }
            }
            if fields.get("ctematerialized").and_then(Value::as_i64) == Some(3) {
                return Err(
                    "statement refused: NOT MATERIALIZED plans its query again at every \
                     reference"
                        .into(),
                );
            }
            fields
                .values()
                .try_for_each(|v| check_expansions(v, depth + 1, stars))
        }
        _ => Ok(()),
    }
}

/// The deepest tree the tokens of a statement allow, bounded from above, read with PostgreSQL's
/// own scanner (flat: no recursion). Every tree level needs a token that is neither a name nor
/// a constant nor a list separator: an operator, a keyword, or an opening parenthesis or
/// bracket. So the bound is the largest number of such tokens on any path of nested groups,
/// counting within one list element (a comma starts the next element, a sibling at the same
/// depth). A `VALUES` list of thousands of rows stays shallow; `1+1+…` does not.
pub(super) fn depth_bound(sql: &str) -> Result<(usize, usize), String> {
    use pg_query::protobuf::Token;
    let scanned =
        pg_query::scan(sql).map_err(|e| format!("statement refused: it does not parse ({e})"))?;
    let mut groups: Vec<(usize, usize)> = Vec::new();
    let (mut base, mut element, mut deepest) = (0usize, 0usize, 0usize);
    for token in &scanned.tokens {
        match Token::try_from(token.token).unwrap_or(Token::Nul) {
            Token::Ascii40 | Token::Ascii91 => {
                groups.push((base, element));
                base += element + 1;
                element = 0;
            }
            Token::Ascii41 | Token::Ascii93 => {
                if let Some((b, e)) = groups.pop() {
                    (base, element) = (b, e);
                }
            }
            Token::Ascii44 => element = 0,
            Token::Ident
            | Token::Uident
            | Token::Fconst
            | Token::Sconst
            | Token::Usconst
            | Token::Bconst
            | Token::Xconst
            | Token::Iconst
            | Token::Param
            | Token::SqlComment
            | Token::CComment
            | Token::Ascii46 => {}
            _ => element += 1,
        }
        deepest = deepest.max(base + element);
    }
    Ok((deepest, scanned.tokens.len()))
}
